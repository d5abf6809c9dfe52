//! Worker nodes and their GPUs as registered with the coordinator.

use crate::Timestamp;
use serde::{Deserialize, Serialize};
use std::fmt;

/// One GPU as the worker discovered it.
///
/// The topology fields are optional (older workers and the persisted format before them leave
/// them unset); the scheduler then treats every GPU of a node as equally close.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDevice {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    /// NUMA node the GPU is attached to (sysfs `numa_node`), if known.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// Id of the PCIe switch (or root port) above the GPU, e.g. its bus id `0000:3a:00.0`.
    /// GPUs with the same id talk peer-to-peer without crossing the CPU.
    #[serde(default)]
    pub pci_switch: Option<String>,
    /// RDMA NIC under the same PCIe switch (e.g. `mlx5_0`), for GPUDirect RDMA jobs.
    #[serde(default)]
    pub rdma_nic: Option<String>,
    /// The card supports MIG (A100, H100, H200, RTX PRO 6000 Blackwell...).
    #[serde(default)]
    pub mig_capable: bool,
}

impl GpuDevice {
    /// Whether MIG slices may be placed on this GPU: what its worker reported, never guessed
    /// from the model name (a simulated or MIG-less card of a MIG model must not get slices
    /// its worker cannot make).
    pub fn supports_mig(&self) -> bool {
        self.mig_capable
    }
}

/// What a worker registers: its identity, address and capacity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: String,
    /// gRPC address of the worker agent (logs), `host:port`.
    pub address: String,
    pub gpus: Vec<GpuDevice>,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub labels: Vec<(String, String)>,
    /// Ports (inclusive) the node offers gangs whose first part runs here to meet on
    /// (MASTER_PORT); `None`: [`DEFAULT_RENDEZVOUS_PORTS`].
    #[serde(default)]
    pub rendezvous_ports: Option<(u32, u32)>,
    /// When the host goes back to its owner (the worker's `lease-end`); `None`: no lease.
    #[serde(default)]
    pub lease_end: Option<Timestamp>,
}

/// Rendezvous ports of a node that does not say (torchrun's default port and the 499 above it).
pub const DEFAULT_RENDEZVOUS_PORTS: (u32, u32) = (29500, 29999);

/// Replicated liveness of a node (state changes only; heartbeats stay in the leader's memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    Up,
    Down,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Up => "up",
            NodeState::Down => "down",
        }
    }
}

impl fmt::Display for NodeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What operators asked of a node (`corral node cordon | drain | resume`). It outlives a restart
/// of the node's worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeMode {
    /// Takes new jobs.
    #[default]
    Active,
    /// Takes no new jobs; running ones stay.
    Cordoned,
    /// Takes no new jobs; running ones are stopped and requeued at the drain deadline (if any).
    Draining,
}

impl NodeMode {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeMode::Active => "active",
            NodeMode::Cordoned => "cordoned",
            NodeMode::Draining => "draining",
        }
    }
}

/// A node in the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub spec: NodeSpec,
    pub state: NodeState,
    /// Incremented at each registration; a worker fences its stale jobs with it.
    pub epoch: u64,
    #[serde(default)]
    pub mode: NodeMode,
    /// Why the node was cordoned or drained (empty: not said, or active).
    #[serde(default)]
    pub mode_reason: String,
    /// When a draining node's running jobs are stopped and requeued (`None`: they run to the end).
    #[serde(default)]
    pub drain_deadline: Option<Timestamp>,
    /// GPUs out of placement for a card fault, at most one mark per GPU, in index order: set
    /// when the fault ended a run (in the same command that requeued it) or when a heartbeat
    /// first shows it, cleared when a heartbeat shows the GPU clean after the fault.
    #[serde(default)]
    pub gpu_faults: Vec<GpuFaultMark>,
    /// The lease end an operator set (`corral node lease NODE --until`): it wins over the
    /// worker's `lease-end` until `--clear` removes it.
    #[serde(default)]
    pub lease_end_set: Option<Timestamp>,
}

/// A card fault (hardware or driver, not the job's doing) the worker attributed to one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuFaultMark {
    pub gpu: u32,
    /// One line: what the worker saw (`XID 79: GPU has fallen off the bus`).
    pub reason: String,
    /// The worker process that saw it (its node epoch) and its count of faults seen then: a
    /// heartbeat clears the mark only if it was read after the fault (`GpuFaultMark::cleared_by`).
    pub node_epoch: u64,
    pub seq: u64,
    /// The run it ended, if one ran on the GPU (job id, 0: none).
    #[serde(default)]
    pub job_id: u64,
}

impl GpuFaultMark {
    /// Whether a heartbeat of worker process `node_epoch`, whose fault count for this GPU
    /// was `seq`, showing the GPU schedulable, was read after this fault: a later process, or
    /// the same one once it counted this fault.
    pub fn cleared_by(&self, node_epoch: u64, seq: u64) -> bool {
        node_epoch > self.node_epoch || (node_epoch == self.node_epoch && seq >= self.seq)
    }
}

impl NodeStatus {
    /// Up, and neither cordoned nor draining: the scheduler may place jobs here.
    pub fn accepts_jobs(&self) -> bool {
        self.state == NodeState::Up && self.mode == NodeMode::Active
    }

    /// When the node's lease ends: the operator's (`corral node lease`), else the worker's.
    pub fn lease_end(&self) -> Option<Timestamp> {
        self.lease_end_set.or(self.spec.lease_end)
    }

    /// The state operators see (`corral nodes`): up, cordoned, draining (jobs still run),
    /// drained (no job left) or down.
    pub fn display_state(&self, running_jobs: usize) -> &'static str {
        match (self.state, self.mode) {
            (NodeState::Down, _) => "down",
            (NodeState::Up, NodeMode::Active) => "up",
            (NodeState::Up, NodeMode::Cordoned) => "cordoned",
            (NodeState::Up, NodeMode::Draining) if running_jobs > 0 => "draining",
            (NodeState::Up, NodeMode::Draining) => "drained",
        }
    }
}

/// Health of one GPU as last reported by its worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealth {
    pub index: u32,
    pub temperature_c: u32,
    pub utilization_percent: u32,
    pub memory_used_mib: u64,
    pub power_mw: u64,
    pub xid_errors: u64,
    /// Memory left behind by a finished job: not schedulable until clean.
    pub dirty: bool,
    /// Why the device is dirty, and which job left it so (`None`: found at worker start).
    pub dirty_reason: String,
    pub dirty_job_id: Option<u64>,
    /// Health problems (overheat, fatal XID, uncorrected ECC, lost): not schedulable.
    pub problems: Vec<String>,
    /// Card faults the worker process attributed to this GPU so far (a count that only grows):
    /// what `GpuFaultMark::cleared_by` compares.
    #[serde(default)]
    pub fault_seq: u64,
    /// The card fault the device is out for (empty: none): the leader marks it in the
    /// replicated state, so placement keeps away from it whatever leader comes next.
    #[serde(default)]
    pub card_fault: String,
}

impl GpuHealth {
    /// A device the scheduler may place jobs on.
    pub fn schedulable(&self) -> bool {
        !self.dirty && self.problems.is_empty()
    }
}
