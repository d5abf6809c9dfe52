//! Why a job is still pending after a pass, as `corral queue` shows it. Each message starts with
//! its category (`quota:`, `resources:`, `gang:`, `backfill reservation:`, `priority:`,
//! `preemption:`, `lease:`).

use crate::quota::QuotaBlock;
use corral_types::{format_duration, JobId};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The reason a job was left pending by a scheduling pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PendingReason {
    /// A quota (tenant, cohort, borrowing limit or class cap) is used up.
    Quota(QuotaBlock),
    /// Not enough free whole GPUs on any one node. `starts_in_secs`: the job holds a backfill
    /// reservation and is expected to start then.
    Gpus { needed: u32, largest_free: u32, starts_in_secs: Option<u64> },
    /// No GPU has room for the slice.
    Slice { slice: Arc<str> },
    /// Nodes with enough GPUs lack CPU or memory.
    CpuMemory,
    /// A gang job needs more nodes with enough free GPUs than there are now.
    Gang { nodes: u32, gpus_per_node: u32, available: u32, starts_in_secs: Option<u64> },
    /// A gang fits on these nodes, but none has a rendezvous port (MASTER_PORT) free.
    RendezvousPorts { nodes: Arc<str> },
    /// It would fit, but only on resources reserved for a job higher in the queue, and it would
    /// not end before that job's reserved start.
    Backfill { reserved_for: JobId, starts_in_secs: u64 },
    /// The free resources it would fit are held for a job ahead of it in the queue (higher
    /// priority or fair share) that preempted running jobs and waits for them to exit.
    Priority { waiting_for: JobId },
    /// This job preempted running jobs and waits for them to exit.
    Preempting { victims: u32, grace_left_secs: u64 },
    /// No node of the kind the job asks for has room: idle nodes for `--exclusive`, GPUs of a
    /// model (`--gres=gpu:TYPE:N`). `what` says which.
    NodeKind { what: Arc<str> },
    /// No node is registered and up.
    NoNodes,
    /// The tenant runs as many jobs as its `max-running-jobs` allows.
    JobLimit { tenant: Arc<str>, max: u32 },
    /// It would fit this leased node now, but its time limit (or, without one, the lease guard)
    /// plus its class's grace would outlast the node's lease.
    Lease { node: Arc<str> },
}

fn gpus(n: u32) -> String {
    if n == 1 {
        "1 gpu".into()
    } else {
        format!("{n} gpus")
    }
}

fn dur(secs: u64) -> String {
    format_duration(Duration::from_secs(secs))
}

impl fmt::Display for PendingReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PendingReason::Quota(block) => write!(f, "{block}"),
            PendingReason::Gpus { needed, largest_free, starts_in_secs } => {
                write!(f, "resources: needs {} on one node, at most {largest_free} free on any node", gpus(*needed))?;
                if let Some(s) = starts_in_secs {
                    write!(f, "; reserved to start in {}", dur(*s))?;
                }
                Ok(())
            }
            PendingReason::Slice { slice } => write!(f, "resources: no gpu has room for a {slice} slice"),
            PendingReason::CpuMemory => write!(f, "resources: no node with free gpus has enough cpu or memory left"),
            PendingReason::Gang { nodes, gpus_per_node, available, starts_in_secs } => {
                write!(
                    f,
                    "gang: needs {nodes} nodes with {} free each, {available} have them now",
                    gpus(*gpus_per_node)
                )?;
                if let Some(s) = starts_in_secs {
                    write!(f, "; reserved to start in {}", dur(*s))?;
                }
                Ok(())
            }
            PendingReason::RendezvousPorts { nodes } => write!(
                f,
                "gang: every rendezvous port of {nodes} is in use by other gangs (the worker setting rendezvous-ports)"
            ),
            PendingReason::Backfill { reserved_for, starts_in_secs } => write!(
                f,
                "backfill reservation: the free resources are held for job {reserved_for}, which starts in {}; \
                 a job with a shorter time limit could use them now",
                dur(*starts_in_secs)
            ),
            PendingReason::Priority { waiting_for } => {
                write!(f, "priority: the free resources are held for job {waiting_for}, ahead in the queue, until its preempted jobs exit")
            }
            PendingReason::Preempting { victims, grace_left_secs } => write!(
                f,
                "preemption: waiting for {victims} preempted job(s) to exit (grace period ends in {})",
                dur(*grace_left_secs)
            ),
            PendingReason::NodeKind { what } => write!(f, "resources: {what}"),
            PendingReason::NoNodes => write!(f, "resources: no node is up and taking jobs"),
            PendingReason::JobLimit { tenant, max } => {
                write!(f, "limit: tenant {tenant} runs {max} jobs, its max-running-jobs")
            }
            PendingReason::Lease { node } => write!(f, "lease: the job ends after the lease of {node}"),
        }
    }
}
