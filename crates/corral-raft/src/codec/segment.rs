//! Billing: the segments of the ledger (one per priced piece of a run) and the billing totals
//! of the segments that left the hot ledger.

use super::{pb, CodecError};
use corral_core::BilledTotal;
use corral_types::{Segment, Timestamp};
use prost::Message;
use std::collections::BTreeMap;

/// A billing segment as the store and the snapshot carry it.
impl From<&Segment> for pb::Segment {
    fn from(g: &Segment) -> Self {
        pb::Segment {
            id: g.id,
            job_id: g.job_id,
            epoch: g.epoch,
            tenant: g.tenant.clone(),
            node: g.node.clone(),
            gpu_model: g.gpu_model.clone(),
            gpus: g.gpus,
            gpu_milli: g.gpu_milli,
            priority_class: g.priority_class.clone(),
            multiplier_milli: g.multiplier_milli,
            price_micros_per_gpu_hour: g.price_micros_per_gpu_hour,
            start: g.start.0,
            end: g.end.0,
            end_state: g.end_state.clone(),
            cost_micros: g.cost_micros,
            duration_ms: Some(g.duration_ms),
            lost: g.lost,
            policy_version: g.policy_version,
            cause: g.cause.map(|c| c.as_str().to_string()).unwrap_or_default(),
            credit_for: g.credit_for,
        }
    }
}

impl From<pb::Segment> for Segment {
    fn from(g: pb::Segment) -> Self {
        Segment {
            id: g.id,
            job_id: g.job_id,
            epoch: g.epoch,
            tenant: g.tenant,
            node: g.node,
            gpu_model: g.gpu_model,
            gpus: g.gpus,
            gpu_milli: g.gpu_milli,
            priority_class: g.priority_class,
            multiplier_milli: g.multiplier_milli,
            price_micros_per_gpu_hour: g.price_micros_per_gpu_hour,
            start: Timestamp(g.start),
            end: Timestamp(g.end),
            duration_ms: g.duration_ms.unwrap_or_else(|| Timestamp(g.end).millis_since(Timestamp(g.start))),
            lost: g.lost,
            end_state: g.end_state,
            cost_micros: g.cost_micros,
            policy_version: g.policy_version,
            // A cause this version does not know (written by a newer one) reads as unknown.
            cause: corral_types::EndCause::parse(&g.cause).ok(),
            credit_for: g.credit_for,
        }
    }
}

/// Encodes one billing segment (persisted per key in the state machine store).
pub fn segment_to_bytes(g: &Segment) -> Vec<u8> {
    pb::Segment::from(g).encode_to_vec()
}

/// Decodes what [`segment_to_bytes`] wrote.
pub fn segment_from_bytes(bytes: &[u8]) -> Result<Segment, CodecError> {
    Ok(pb::Segment::decode(bytes)?.into())
}

pub(super) fn billed_to_pb(billed: &BTreeMap<String, BilledTotal>) -> Vec<pb::BilledTotal> {
    billed
        .iter()
        .map(|(tenant, t)| pb::BilledTotal {
            tenant: tenant.clone(),
            cost_micros: t.cost_micros,
            credited_micros: t.credited_micros,
            gpu_milli_ms_high: (t.gpu_milli_ms >> 64) as u64,
            gpu_milli_ms_low: t.gpu_milli_ms as u64,
        })
        .collect()
}

pub(super) fn billed_from_pb(records: Vec<pb::BilledTotal>) -> BTreeMap<String, BilledTotal> {
    records
        .into_iter()
        .map(|t| {
            let gpu_milli_ms = (u128::from(t.gpu_milli_ms_high) << 64) | u128::from(t.gpu_milli_ms_low);
            (t.tenant, BilledTotal { cost_micros: t.cost_micros, credited_micros: t.credited_micros, gpu_milli_ms })
        })
        .collect()
}
