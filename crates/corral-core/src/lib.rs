//! Pure, deterministic replicated state of corral: `State::apply(Request) -> Response` and the
//! scheduling policy engine (`schedule(&State, now, ...) -> SchedulingPass`): priorities and
//! preemption, quotas with cohort borrowing and reclaim, fair share with decayed usage, backfill
//! reservations, gang jobs across nodes, topology-aware GPU choice, MIG and MPS slices.
//!
//! Boundary: no I/O, no clock, no randomness, no HashMap iteration. Time enters only through the
//! TSO timestamp that the leader stamps into each `Request` (and the `now` it passes to a pass).
//! Invariant: applying the same sequence of requests to two `State`s gives identical states.
//! Invariant: apply() re-validates every scheduling decision; no sequence of commands can
//! over-commit a GPU, a slice, a node's CPU or memory, or a quota.

mod apply;
mod command;
mod config;
mod gang;
mod history;
mod jobctl;
mod jobs;
mod join_tokens;
mod leases;
mod ledger;
mod nodes;
mod policy;
mod quota;
mod resources;
mod revocations;
mod sched;
mod state;
mod steps;
mod tokens;
mod usage;

pub use apply::Touched;
pub use command::{ApplyError, Command, JobUpdate, Outcome, Placement, Preemption, Request, Response, ScheduleOutcome};
pub use config::{ClusterConfig, PriorityClass, SchedulerConfig, SlurmNaming, TenantPolicy, DEFAULT_GRACE_SECS};
pub use history::{CompactCutoffs, Compacted, RequestKey, RequestRecord, MAX_ARCHIVED_PER_COMPACTION};
pub use jobctl::{dep_status, DepStatus, MAX_SIGNALS};
pub use jobs::Jobs;
pub use join_tokens::{
    valid_node_name, JoinTokenRecord, JoinTokenUse, JOIN_TOKEN_RETENTION_MS, MAX_JOIN_TOKENS, MAX_JOIN_TOKEN_TTL_MS,
};
pub use leases::lease_need_ms;
pub use ledger::{cost_micros, TSO_LEAD_ALLOWANCE_MS};
pub use policy::{format_multiplier, format_price, format_secs, PolicyPlan, PolicyRecord, MAX_POLICY_HISTORY};
pub use quota::{format_gpus, QuotaBlock};
pub use resources::{job_milli_gpus, MILLI_PER_GPU};
pub use revocations::REVOCATION_RETENTION_S;
pub use sched::{
    place, schedule, schedule_with_images, ImageHints, PassStats, PendingJob, PendingReason, SchedulingPass,
};
pub use state::{BilledTotal, CoordinatorRecord, State};
pub use steps::plan_tasks;
pub use tokens::{TokenRecord, MAX_TOKENS};
pub use usage::UsageLedger;
