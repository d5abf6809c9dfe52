//! The deny list of worker certificates (`State::revoked_workers`) in the stored format: one
//! `RevokedWorker` record per node, in node order, kept with the scalar state (field 42 of
//! `StateSnapshot`). A state that never revoked anything writes nothing, so its bytes are those
//! of the format before the deny list.

use super::pb;
use std::collections::BTreeMap;

pub(super) fn to_pb(revoked: &BTreeMap<String, u64>) -> Vec<pb::RevokedWorker> {
    revoked.iter().map(|(node, &revoked_before)| pb::RevokedWorker { node: node.clone(), revoked_before }).collect()
}

pub(super) fn from_pb(records: Vec<pb::RevokedWorker>) -> BTreeMap<String, u64> {
    records.into_iter().map(|r| (r.node, r.revoked_before)).collect()
}
