//! Placement: which pending jobs go where. FIFO inside a priority level, first fit by whole GPUs.

use crate::State;
use corral_types::{Job, JobId, NodeState};
use std::collections::{BTreeMap, BTreeSet};

/// A placement the leader proposes through Raft; apply() re-validates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub job_id: JobId,
    pub node: String,
    pub gpus: Vec<u32>,
}

/// Free capacity of one node during a pass.
struct Free {
    gpus: BTreeSet<u32>,
    cpu_millis: u64,
    memory_bytes: u64,
}

/// GPUs a job occupies exclusively: whole GPUs, or one GPU for a slice (slices get a whole GPU
/// until fractional sharing lands).
pub(crate) fn gpus_needed(job: &Job) -> usize {
    if job.spec.gpu_slice.is_some() {
        1
    } else {
        job.spec.gpus as usize
    }
}

/// Computes placements for pending jobs. `unschedulable` lists (node, gpu index) pairs that must
/// not be used (dirty or unhealthy devices, known only to the leader's memory).
pub fn place(state: &State, unschedulable: &BTreeSet<(String, u32)>) -> Vec<Placement> {
    let mut free: BTreeMap<&str, Free> = BTreeMap::new();
    for (name, node) in &state.nodes {
        if node.state != NodeState::Up {
            continue;
        }
        let allocated = state.allocated_gpus(name);
        let gpus = node
            .spec
            .gpus
            .iter()
            .map(|g| g.index)
            .filter(|i| !allocated.contains(i) && !unschedulable.contains(&(name.clone(), *i)))
            .collect();
        let (mut cpu, mut mem) = (node.spec.cpu_millis, node.spec.memory_bytes);
        for job in state.jobs_on_node(name) {
            cpu = cpu.saturating_sub(u64::from(job.spec.cpu_millis));
            mem = mem.saturating_sub(job.spec.memory_bytes);
        }
        free.insert(name, Free { gpus, cpu_millis: cpu, memory_bytes: mem });
    }

    let mut pending: Vec<&Job> = state.pending_jobs().collect();
    // Higher priority first; inside a priority level, submit order (the sort is stable).
    pending.sort_by_key(|j| std::cmp::Reverse(state.config.priority_value(&j.spec.priority_class)));

    let mut out = Vec::new();
    for job in pending {
        let need = gpus_needed(job);
        let chosen = free.iter_mut().find(|(_, f)| {
            f.gpus.len() >= need
                && f.cpu_millis >= u64::from(job.spec.cpu_millis)
                && f.memory_bytes >= job.spec.memory_bytes
        });
        if let Some((name, f)) = chosen {
            let gpus: Vec<u32> = f.gpus.iter().copied().take(need).collect();
            for g in &gpus {
                f.gpus.remove(g);
            }
            f.cpu_millis -= u64::from(job.spec.cpu_millis);
            f.memory_bytes -= job.spec.memory_bytes;
            out.push(Placement { job_id: job.id, node: name.to_string(), gpus });
        }
    }
    out
}
