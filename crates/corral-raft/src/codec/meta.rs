//! The store's scalar record (`StateMeta`: counters, clock, config, tokens, usage, billing
//! totals) and the small records only it and the snapshot carry: coordinators and fair-share
//! usage.

use super::config::{config_from_pb, config_to_pb};
use super::segment::{billed_from_pb, billed_to_pb};
use super::tokens::{join_tokens_from_pb, join_tokens_to_pb, tokens_from_pb, tokens_to_pb};
use super::{check_version, pb, CodecError, FORMAT_VERSION};
use corral_core::{BilledTotal, ClusterConfig, CoordinatorRecord, JoinTokenRecord, State, TokenRecord, UsageLedger};
use corral_types::Timestamp;
use prost::Message;
use std::collections::BTreeMap;

/// The scalar part of the state (counters, clock, config), without jobs, nodes and request ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateMeta {
    pub next_job_id: u64,
    pub next_epoch: u64,
    pub last_ts: Timestamp,
    pub config: ClusterConfig,
    pub coordinators: BTreeMap<u64, CoordinatorRecord>,
    pub tso_window_end_ms: u64,
    /// Fair-share usage history: set `State::usage` to it after `State::from_parts`.
    pub usage: UsageLedger,
    pub next_segment_id: u64,
    /// Access tokens: set `State::tokens` to them after `State::from_parts`.
    pub tokens: BTreeMap<u64, TokenRecord>,
    pub next_token_id: u64,
    /// Set `State::policy_version` to it (the history is stored per record).
    pub policy_version: u64,
    /// Join tokens: set `State::join_tokens` to them after `State::from_parts`.
    pub join_tokens: BTreeMap<u64, JoinTokenRecord>,
    pub next_join_token_id: u64,
    /// The deny list: set `State::revoked_workers` to it after `State::from_parts`.
    pub revoked_workers: BTreeMap<String, u64>,
    /// Set `State::segments_archived_below` to it (load segments from there).
    pub segments_archived_below: u64,
    /// Set `State::archived_billed` to it.
    pub archived_billed: BTreeMap<String, BilledTotal>,
}

/// Encodes the scalar part of the state.
pub fn meta_to_bytes(s: &State) -> Vec<u8> {
    pb::StateSnapshot {
        format_version: FORMAT_VERSION,
        next_job_id: s.next_job_id,
        next_epoch: s.next_epoch,
        last_ts: s.last_ts.0,
        config: Some(config_to_pb(&s.config)),
        coordinators: coordinators_to_pb(s),
        tso_window_end_ms: s.tso_window_end_ms,
        usage: usage_to_pb(&s.usage),
        next_segment_id: s.next_segment_id,
        tokens: tokens_to_pb(s),
        next_token_id: s.next_token_id,
        policy_version: s.policy_version,
        join_tokens: join_tokens_to_pb(s),
        next_join_token_id: s.next_join_token_id,
        revoked_workers: super::revocations::to_pb(&s.revoked_workers),
        segments_archived_below: s.segments_archived_below,
        archived_billed: billed_to_pb(&s.archived_billed),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Decodes what [`meta_to_bytes`] wrote.
pub fn meta_from_bytes(bytes: &[u8]) -> Result<StateMeta, CodecError> {
    let s = pb::StateSnapshot::decode(bytes)?;
    check_version(s.format_version)?;
    Ok(StateMeta {
        next_job_id: s.next_job_id,
        next_epoch: s.next_epoch,
        last_ts: Timestamp(s.last_ts),
        config: s.config.map(config_from_pb).unwrap_or_default(),
        coordinators: coordinators_from_pb(s.coordinators),
        tso_window_end_ms: s.tso_window_end_ms,
        usage: usage_from_pb(s.usage),
        next_segment_id: s.next_segment_id.max(1),
        tokens: tokens_from_pb(s.tokens),
        next_token_id: s.next_token_id.max(1),
        policy_version: s.policy_version,
        join_tokens: join_tokens_from_pb(s.join_tokens),
        next_join_token_id: s.next_join_token_id,
        revoked_workers: super::revocations::from_pb(s.revoked_workers),
        segments_archived_below: s.segments_archived_below,
        archived_billed: billed_from_pb(s.archived_billed),
    })
}

pub(super) fn usage_to_pb(u: &UsageLedger) -> Vec<pb::TenantUsage> {
    u.tenants
        .iter()
        .map(|(tenant, buckets)| pb::TenantUsage {
            tenant: tenant.clone(),
            buckets: buckets
                .iter()
                .map(|(start_ms, milli_gpu_secs)| pb::UsageBucket {
                    start_ms: *start_ms,
                    milli_gpu_secs: *milli_gpu_secs,
                })
                .collect(),
        })
        .collect()
}

pub(super) fn usage_from_pb(u: Vec<pb::TenantUsage>) -> UsageLedger {
    UsageLedger {
        tenants: u
            .into_iter()
            .map(|t| (t.tenant, t.buckets.into_iter().map(|b| (b.start_ms, b.milli_gpu_secs)).collect()))
            .collect(),
    }
}

pub(super) fn coordinators_to_pb(s: &State) -> Vec<pb::CoordinatorRecord> {
    s.coordinators
        .iter()
        .map(|(id, r)| pb::CoordinatorRecord { node_id: *id, addr: r.addr.clone(), removed: r.removed })
        .collect()
}

pub(super) fn coordinators_from_pb(records: Vec<pb::CoordinatorRecord>) -> BTreeMap<u64, CoordinatorRecord> {
    records.into_iter().map(|r| (r.node_id, CoordinatorRecord { addr: r.addr, removed: r.removed })).collect()
}
