//! The policy history: one record per applied policy change.

use super::{pb, CodecError};
use corral_core::{PolicyRecord, State};
use corral_types::Timestamp;
use prost::Message;

pub(super) fn policy_history_to_pb(s: &State) -> Vec<pb::PolicyRecord> {
    s.policy_history
        .iter()
        .map(|r| pb::PolicyRecord {
            version: r.version,
            ts: r.ts.0,
            by: r.by.clone(),
            changes: r.changes.clone(),
            cancelled: r.cancelled.clone(),
        })
        .collect()
}

/// Encodes one policy history record (as stores of earlier versions kept it per version; the
/// policy history now travels in snapshots).
pub fn policy_record_to_bytes(r: &PolicyRecord) -> Vec<u8> {
    pb::PolicyRecord {
        version: r.version,
        ts: r.ts.0,
        by: r.by.clone(),
        changes: r.changes.clone(),
        cancelled: r.cancelled.clone(),
    }
    .encode_to_vec()
}

/// Decodes what [`policy_record_to_bytes`] wrote.
pub fn policy_record_from_bytes(bytes: &[u8]) -> Result<PolicyRecord, CodecError> {
    Ok(policy_history_from_pb(vec![pb::PolicyRecord::decode(bytes)?]).remove(0))
}

pub(super) fn policy_history_from_pb(records: Vec<pb::PolicyRecord>) -> Vec<PolicyRecord> {
    records
        .into_iter()
        .map(|r| PolicyRecord {
            version: r.version,
            ts: Timestamp(r.ts),
            by: r.by,
            changes: r.changes,
            cancelled: r.cancelled,
        })
        .collect()
}
