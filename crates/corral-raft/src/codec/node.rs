//! Nodes: the spec a worker registers (GPUs, labels, rendezvous ports), its state, mode and
//! epoch.

use super::{pb, CodecError};
use corral_types::{GpuDevice, GpuFaultMark, NodeMode, NodeSpec, NodeState, NodeStatus, Timestamp};
use prost::Message;

impl From<&NodeSpec> for pb::NodeSpec {
    fn from(n: &NodeSpec) -> Self {
        pb::NodeSpec {
            name: n.name.clone(),
            address: n.address.clone(),
            gpus: n
                .gpus
                .iter()
                .map(|g| pb::GpuDevice {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    numa_node: g.numa_node,
                    pci_switch: g.pci_switch.clone(),
                    rdma_nic: g.rdma_nic.clone(),
                    mig_capable: g.mig_capable,
                })
                .collect(),
            cpu_millis: n.cpu_millis,
            memory_bytes: n.memory_bytes,
            labels: n.labels.iter().map(|(k, v)| pb::Label { key: k.clone(), value: v.clone() }).collect(),
            rendezvous_ports: n.rendezvous_ports.map(|(first, last)| pb::PortRange { first, last }),
            lease_end: n.lease_end.map(|t| t.0),
        }
    }
}

impl From<pb::NodeSpec> for NodeSpec {
    fn from(n: pb::NodeSpec) -> Self {
        NodeSpec {
            name: n.name,
            address: n.address,
            gpus: n
                .gpus
                .into_iter()
                .map(|g| GpuDevice {
                    index: g.index,
                    uuid: g.uuid,
                    model: g.model,
                    memory_mib: g.memory_mib,
                    numa_node: g.numa_node,
                    pci_switch: g.pci_switch,
                    rdma_nic: g.rdma_nic,
                    mig_capable: g.mig_capable,
                })
                .collect(),
            cpu_millis: n.cpu_millis,
            memory_bytes: n.memory_bytes,
            labels: n.labels.into_iter().map(|l| (l.key, l.value)).collect(),
            rendezvous_ports: n.rendezvous_ports.map(|r| (r.first, r.last)),
            lease_end: n.lease_end.map(Timestamp),
        }
    }
}

impl From<NodeState> for pb::NodeState {
    fn from(s: NodeState) -> Self {
        match s {
            NodeState::Up => pb::NodeState::Up,
            NodeState::Down => pb::NodeState::Down,
        }
    }
}

pub(super) fn node_state_from_i32(v: i32) -> Result<NodeState, CodecError> {
    match pb::NodeState::try_from(v) {
        Ok(pb::NodeState::Up) => Ok(NodeState::Up),
        Ok(pb::NodeState::Down) => Ok(NodeState::Down),
        _ => Err(CodecError::Invalid { field: "node state", value: v.to_string() }),
    }
}

pub(super) fn node_mode_to_pb(m: NodeMode) -> i32 {
    match m {
        NodeMode::Active => pb::NodeMode::Active as i32,
        NodeMode::Cordoned => pb::NodeMode::Cordoned as i32,
        NodeMode::Draining => pb::NodeMode::Draining as i32,
    }
}

pub(super) fn node_mode_from_i32(v: i32) -> Result<NodeMode, CodecError> {
    match pb::NodeMode::try_from(v) {
        Ok(pb::NodeMode::Active) => Ok(NodeMode::Active),
        Ok(pb::NodeMode::Cordoned) => Ok(NodeMode::Cordoned),
        Ok(pb::NodeMode::Draining) => Ok(NodeMode::Draining),
        Err(_) => Err(CodecError::Invalid { field: "node mode", value: v.to_string() }),
    }
}

pub(super) fn node_status_to_pb(n: &NodeStatus) -> pb::NodeStatus {
    pb::NodeStatus {
        spec: Some((&n.spec).into()),
        state: pb::NodeState::from(n.state) as i32,
        epoch: n.epoch,
        mode: node_mode_to_pb(n.mode),
        mode_reason: n.mode_reason.clone(),
        drain_deadline: n.drain_deadline.map(|t| t.0),
        gpu_faults: n.gpu_faults.iter().map(gpu_fault_to_pb).collect(),
        lease_end_set: n.lease_end_set.map(|t| t.0),
    }
}

pub(super) fn gpu_fault_to_pb(m: &GpuFaultMark) -> pb::GpuFaultMark {
    pb::GpuFaultMark { gpu: m.gpu, reason: m.reason.clone(), node_epoch: m.node_epoch, seq: m.seq, job_id: m.job_id }
}

pub(super) fn gpu_fault_from_pb(m: pb::GpuFaultMark) -> GpuFaultMark {
    GpuFaultMark { gpu: m.gpu, reason: m.reason, node_epoch: m.node_epoch, seq: m.seq, job_id: m.job_id }
}

pub(super) fn node_status_from_pb(n: pb::NodeStatus) -> Result<NodeStatus, CodecError> {
    Ok(NodeStatus {
        spec: n.spec.ok_or(CodecError::Missing("node.spec"))?.into(),
        state: node_state_from_i32(n.state)?,
        epoch: n.epoch,
        mode: node_mode_from_i32(n.mode)?,
        mode_reason: n.mode_reason,
        drain_deadline: n.drain_deadline.map(Timestamp),
        gpu_faults: n.gpu_faults.into_iter().map(gpu_fault_from_pb).collect(),
        lease_end_set: n.lease_end_set.map(Timestamp),
    })
}

/// Encodes one node (as stores of earlier versions kept it per key; nodes now travel in
/// snapshots).
pub fn node_to_bytes(n: &NodeStatus) -> Vec<u8> {
    node_status_to_pb(n).encode_to_vec()
}

/// Decodes one node written by [`node_to_bytes`].
pub fn node_from_bytes(bytes: &[u8]) -> Result<NodeStatus, CodecError> {
    node_status_from_pb(pb::NodeStatus::decode(bytes)?)
}
