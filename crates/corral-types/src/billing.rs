//! A billing ledger segment: one priced run of a job on GPUs, or a credit against one, as the
//! ledger keeps it and the API lists it (the pricing itself lives with the replicated state in
//! corral-core), and why a run ended.

use crate::{JobId, Timestamp};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Why a billed run ended: whose doing it was decides whether the policy credits it
/// (`[billing.credits]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EndCause {
    /// The job's own exit, success or failure (a crash on its own bug included).
    Exited,
    /// Cancelled by its owner or an operator.
    Cancelled,
    /// An interactive session whose GPUs stayed idle for its idle timeout, ended by the pool.
    Idle,
    /// Killed at its time limit.
    TimeLimit,
    /// Stopped for a higher-priority job, or put back in the queue by request (`corral requeue`).
    Preempted,
    /// Stopped because its node was drained.
    Drained,
    /// Stopped because the lease of its rented host ended.
    LeaseEnded,
    /// Its node was lost (the worker stopped answering, restarted, or lost the coordinators).
    NodeLost,
    /// A fault of its GPU (hardware or driver), not of the job.
    GpuFault,
}

impl EndCause {
    pub const ALL: [EndCause; 9] = [
        EndCause::Exited,
        EndCause::Cancelled,
        EndCause::Idle,
        EndCause::TimeLimit,
        EndCause::Preempted,
        EndCause::Drained,
        EndCause::LeaseEnded,
        EndCause::NodeLost,
        EndCause::GpuFault,
    ];

    /// The name the policy file, the API and the invoice use.
    pub fn as_str(self) -> &'static str {
        match self {
            EndCause::Exited => "exited",
            EndCause::Cancelled => "cancelled",
            EndCause::Idle => "idle",
            EndCause::TimeLimit => "time-limit",
            EndCause::Preempted => "preempted",
            EndCause::Drained => "drained",
            EndCause::LeaseEnded => "lease-ended",
            EndCause::NodeLost => "node-lost",
            EndCause::GpuFault => "gpu-fault",
        }
    }

    /// The cause named `name`; an unknown name is one line listing the known ones.
    pub fn parse(name: &str) -> Result<EndCause, String> {
        EndCause::ALL.into_iter().find(|c| c.as_str() == name).ok_or_else(|| {
            let known: Vec<&str> = EndCause::ALL.iter().map(|c| c.as_str()).collect();
            format!("unknown end cause '{name}': the causes are {}", known.join(", "))
        })
    }
}

impl fmt::Display for EndCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One priced stretch of GPU use, or a credit against one (`credit_for`): the ledger is
/// append-only, so a credit is an entry of its own, never a change to the segment it credits.
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
    /// Why the run ended (absent in segments written before causes were recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<EndCause>,
    /// This entry is a credit against segment `credit_for` (of the same run): `cost_micros` is the
    /// amount credited, to be subtracted, for the run's end `cause`, stamped `start` = `end` when
    /// the run ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credit_for: Option<u64>,
}

impl Segment {
    pub fn duration_ms(&self) -> u64 {
        self.duration_ms
    }

    /// A credit, not a charge.
    pub fn is_credit(&self) -> bool {
        self.credit_for.is_some()
    }

    /// What the entry adds to the bill, micro-units: its cost, or minus the credit.
    pub fn signed_micros(&self) -> i128 {
        if self.is_credit() {
            -i128::from(self.cost_micros)
        } else {
            i128::from(self.cost_micros)
        }
    }
}
