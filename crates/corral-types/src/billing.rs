//! A billing ledger segment: one priced run of a job on GPUs, as the ledger keeps it and the
//! API lists it (the pricing itself lives with the replicated state in corral-core).

use crate::{JobId, Timestamp};
use serde::{Deserialize, Serialize};

/// One priced stretch of GPU use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub id: u64,
    pub job_id: JobId,
    /// Allocation epoch of the run.
    pub epoch: u64,
    pub tenant: String,
    pub node: String,
    pub gpu_model: String,
    /// Whole GPUs, or 1 for a slice.
    pub gpus: u32,
    /// GPU-equivalents in thousandths (whole GPU = 1000, a slice its fraction).
    pub gpu_milli: u32,
    pub priority_class: String,
    pub multiplier_milli: u32,
    /// Price of one whole GPU-hour of this model, in micro-units.
    pub price_micros_per_gpu_hour: u64,
    pub start: Timestamp,
    pub end: Timestamp,
    /// The billed length of the run (see the billing invariant of corral-core's ledger).
    pub duration_ms: u64,
    /// The node was lost before the worker reported the end: billed the TSO interval.
    #[serde(default)]
    pub lost: bool,
    /// How the run ended: succeeded, failed, cancelled, requeued, preempted.
    pub end_state: String,
    pub cost_micros: u64,
    /// The cluster policy version whose prices this segment used (0: before the first
    /// versioned policy). A run that spans a price change is billed in one segment per piece.
    #[serde(default)]
    pub policy_version: u64,
}

impl Segment {
    pub fn duration_ms(&self) -> u64 {
        self.duration_ms
    }
}
