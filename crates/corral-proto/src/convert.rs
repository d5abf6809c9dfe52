//! Conversions between generated protobuf messages and corral's domain types.

use crate::v1 as pb;
use corral_core::{ClusterConfig, Command, CoordinatorRecord, PriorityClass, Request, State, FORMAT_VERSION};
use corral_types::{
    Allocation, GpuDevice, GpuSlice, Job, JobExitReport, JobSpec, JobState, NodeSpec, NodeState, NodeStatus, Timestamp,
};
use prost::Message;
use std::collections::BTreeMap;

/// A message that does not decode into a valid domain value.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("missing field '{0}'")]
    Missing(&'static str),
    #[error("invalid value of '{field}': {value}")]
    Invalid { field: &'static str, value: String },
    #[error("unsupported format version {found} (this build reads up to {supported})")]
    Version { found: u32, supported: u32 },
    #[error("protobuf decode error: {0}")]
    Decode(#[from] prost::DecodeError),
}

impl From<ProtoError> for tonic::Status {
    fn from(e: ProtoError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

// ---- jobs ----

impl From<&GpuSlice> for pb::GpuSlice {
    fn from(s: &GpuSlice) -> Self {
        use pb::gpu_slice::Kind;
        let kind = match s {
            GpuSlice::Mig { profile, compute_slices } => {
                Kind::Mig(pb::MigSlice { profile: profile.clone(), compute_slices: *compute_slices })
            }
            GpuSlice::Mps { thread_percent, memory_mib } => {
                Kind::Mps(pb::MpsSlice { thread_percent: *thread_percent, memory_mib: *memory_mib })
            }
        };
        pb::GpuSlice { kind: Some(kind) }
    }
}

impl TryFrom<pb::GpuSlice> for GpuSlice {
    type Error = ProtoError;
    fn try_from(s: pb::GpuSlice) -> Result<Self, ProtoError> {
        use pb::gpu_slice::Kind;
        match s.kind.ok_or(ProtoError::Missing("gpu_slice.kind"))? {
            Kind::Mig(m) => Ok(GpuSlice::Mig { profile: m.profile, compute_slices: m.compute_slices }),
            Kind::Mps(m) => Ok(GpuSlice::Mps { thread_percent: m.thread_percent, memory_mib: m.memory_mib }),
        }
    }
}

impl From<&JobSpec> for pb::JobSpec {
    fn from(s: &JobSpec) -> Self {
        pb::JobSpec {
            name: s.name.clone(),
            tenant: s.tenant.clone(),
            priority_class: s.priority_class.clone(),
            gpus: s.gpus,
            gpu_slice: s.gpu_slice.as_ref().map(Into::into),
            cpu_millis: s.cpu_millis,
            memory_bytes: s.memory_bytes,
            time_limit_secs: s.time_limit_secs,
            image: s.image.clone(),
            command: s.command.clone(),
            env: s.env.clone(),
        }
    }
}

impl TryFrom<pb::JobSpec> for JobSpec {
    type Error = ProtoError;
    fn try_from(s: pb::JobSpec) -> Result<Self, ProtoError> {
        Ok(JobSpec {
            name: s.name,
            tenant: s.tenant,
            priority_class: s.priority_class,
            gpus: s.gpus,
            gpu_slice: s.gpu_slice.map(TryInto::try_into).transpose()?,
            cpu_millis: s.cpu_millis,
            memory_bytes: s.memory_bytes,
            time_limit_secs: s.time_limit_secs,
            image: s.image,
            command: s.command,
            env: s.env,
        })
    }
}

impl From<JobState> for pb::JobState {
    fn from(s: JobState) -> Self {
        match s {
            JobState::Pending => pb::JobState::Pending,
            JobState::Running => pb::JobState::Running,
            JobState::Succeeded => pb::JobState::Succeeded,
            JobState::Failed => pb::JobState::Failed,
            JobState::Cancelled => pb::JobState::Cancelled,
            JobState::Preempted => pb::JobState::Preempted,
        }
    }
}

fn job_state_from_i32(v: i32) -> Result<JobState, ProtoError> {
    let invalid = || ProtoError::Invalid { field: "state", value: v.to_string() };
    Ok(match pb::JobState::try_from(v).map_err(|_| invalid())? {
        pb::JobState::Unspecified => return Err(invalid()),
        pb::JobState::Pending => JobState::Pending,
        pb::JobState::Running => JobState::Running,
        pb::JobState::Succeeded => JobState::Succeeded,
        pb::JobState::Failed => JobState::Failed,
        pb::JobState::Cancelled => JobState::Cancelled,
        pb::JobState::Preempted => JobState::Preempted,
    })
}

impl From<&Job> for pb::Job {
    fn from(j: &Job) -> Self {
        pb::Job {
            id: j.id,
            spec: Some((&j.spec).into()),
            state: pb::JobState::from(j.state) as i32,
            request_id: j.request_id.clone(),
            submitted_at: j.submitted_at.0,
            admitted_at: j.admitted_at.map(|t| t.0),
            started_at: j.started_at.map(|t| t.0),
            finished_at: j.finished_at.map(|t| t.0),
            allocation: j.allocation.as_ref().map(|a| pb::Allocation {
                node: a.node.clone(),
                gpus: a.gpus.clone(),
                epoch: a.epoch,
            }),
            exit_code: j.exit_code,
            signal: j.signal,
            reason: j.reason.clone(),
            cancel_requested: j.cancel_requested,
            attempts: j.attempts,
            worker_run_time_ms: j.worker_run_time_ms,
        }
    }
}

impl TryFrom<pb::Job> for Job {
    type Error = ProtoError;
    fn try_from(j: pb::Job) -> Result<Self, ProtoError> {
        Ok(Job {
            id: j.id,
            spec: j.spec.ok_or(ProtoError::Missing("job.spec"))?.try_into()?,
            state: job_state_from_i32(j.state)?,
            request_id: j.request_id,
            submitted_at: Timestamp(j.submitted_at),
            admitted_at: j.admitted_at.map(Timestamp),
            started_at: j.started_at.map(Timestamp),
            finished_at: j.finished_at.map(Timestamp),
            allocation: j.allocation.map(|a| Allocation { node: a.node, gpus: a.gpus, epoch: a.epoch }),
            exit_code: j.exit_code,
            signal: j.signal,
            reason: j.reason,
            cancel_requested: j.cancel_requested,
            attempts: j.attempts,
            worker_run_time_ms: j.worker_run_time_ms,
        })
    }
}

impl From<&JobExitReport> for pb::JobExitReport {
    fn from(r: &JobExitReport) -> Self {
        pb::JobExitReport {
            exit_code: r.exit_code,
            signal: r.signal,
            oom_killed: r.oom_killed,
            run_time_ms: r.run_time_ms,
            launch_error: r.launch_error.clone(),
            timed_out: r.timed_out,
        }
    }
}

impl From<pb::JobExitReport> for JobExitReport {
    fn from(r: pb::JobExitReport) -> Self {
        JobExitReport {
            exit_code: r.exit_code,
            signal: r.signal,
            oom_killed: r.oom_killed,
            run_time_ms: r.run_time_ms,
            timed_out: r.timed_out,
            launch_error: r.launch_error,
        }
    }
}

// ---- nodes ----

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
                })
                .collect(),
            cpu_millis: n.cpu_millis,
            memory_bytes: n.memory_bytes,
            labels: n.labels.iter().map(|(k, v)| pb::Label { key: k.clone(), value: v.clone() }).collect(),
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
                .map(|g| GpuDevice { index: g.index, uuid: g.uuid, model: g.model, memory_mib: g.memory_mib })
                .collect(),
            cpu_millis: n.cpu_millis,
            memory_bytes: n.memory_bytes,
            labels: n.labels.into_iter().map(|l| (l.key, l.value)).collect(),
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

fn node_state_from_i32(v: i32) -> Result<NodeState, ProtoError> {
    match pb::NodeState::try_from(v) {
        Ok(pb::NodeState::Up) => Ok(NodeState::Up),
        Ok(pb::NodeState::Down) => Ok(NodeState::Down),
        _ => Err(ProtoError::Invalid { field: "node state", value: v.to_string() }),
    }
}

fn node_status_to_pb(n: &NodeStatus) -> pb::NodeStatus {
    pb::NodeStatus { spec: Some((&n.spec).into()), state: pb::NodeState::from(n.state) as i32, epoch: n.epoch }
}

fn node_status_from_pb(n: pb::NodeStatus) -> Result<NodeStatus, ProtoError> {
    Ok(NodeStatus {
        spec: n.spec.ok_or(ProtoError::Missing("node.spec"))?.into(),
        state: node_state_from_i32(n.state)?,
        epoch: n.epoch,
    })
}

// ---- config ----

fn config_to_pb(c: &ClusterConfig) -> pb::ClusterConfig {
    pb::ClusterConfig {
        tenants: c.tenants.iter().map(|t| pb::Tenant { name: t.clone() }).collect(),
        priority_classes: c
            .priority_classes
            .values()
            .map(|p| pb::PriorityClass {
                name: p.name.clone(),
                value: p.value,
                preempts_lower: p.preempts_lower,
                billing_multiplier_milli: p.billing_multiplier_milli,
                is_default: p.is_default,
            })
            .collect(),
    }
}

fn config_from_pb(c: pb::ClusterConfig) -> ClusterConfig {
    ClusterConfig {
        tenants: c.tenants.into_iter().map(|t| t.name).collect(),
        priority_classes: c
            .priority_classes
            .into_iter()
            .map(|p| {
                let class = PriorityClass {
                    name: p.name.clone(),
                    value: p.value,
                    preempts_lower: p.preempts_lower,
                    billing_multiplier_milli: p.billing_multiplier_milli,
                    is_default: p.is_default,
                };
                (p.name, class)
            })
            .collect(),
    }
}

// ---- commands ----

fn command_to_pb(r: &Request) -> pb::Command {
    use pb::command::Kind;
    let kind = match &r.command {
        Command::SubmitJob { request_id, spec } => {
            Kind::SubmitJob(pb::SubmitJob { request_id: request_id.clone(), spec: Some(spec.into()) })
        }
        Command::SubmitJobs { jobs } => Kind::SubmitJobs(pb::SubmitJobs {
            jobs: jobs
                .iter()
                .map(|(request_id, spec)| pb::SubmitJob { request_id: request_id.clone(), spec: Some(spec.into()) })
                .collect(),
        }),
        Command::PlaceJob { job_id, node, gpus } => {
            Kind::PlaceJob(pb::PlaceJob { job_id: *job_id, node: node.clone(), gpus: gpus.clone() })
        }
        Command::JobStarted { job_id, epoch } => Kind::JobStarted(pb::JobStarted { job_id: *job_id, epoch: *epoch }),
        Command::JobFinished { job_id, epoch, report } => {
            Kind::JobFinished(pb::JobFinished { job_id: *job_id, epoch: *epoch, report: Some(report.into()) })
        }
        Command::CancelJob { job_id, reason } => {
            Kind::CancelJob(pb::CancelJob { job_id: *job_id, reason: reason.clone() })
        }
        Command::RegisterNode { spec } => Kind::RegisterNode(pb::RegisterNode { spec: Some(spec.into()) }),
        Command::SetNodeState { node, state, reason } => Kind::SetNodeState(pb::SetNodeState {
            node: node.clone(),
            state: pb::NodeState::from(*state) as i32,
            reason: reason.clone(),
        }),
        Command::Configure(c) => Kind::Configure(config_to_pb(c)),
        Command::Noop => Kind::Noop(true),
        Command::AddCoordinator { node_id, addr } => {
            Kind::AddCoordinator(pb::AddCoordinator { node_id: *node_id, addr: addr.clone() })
        }
        Command::RemoveCoordinator { node_id } => Kind::RemoveCoordinator(pb::RemoveCoordinator { node_id: *node_id }),
        Command::ExtendTso { upper_ms } => Kind::ExtendTso(pb::ExtendTso { upper_ms: *upper_ms }),
    };
    pb::Command { format_version: FORMAT_VERSION, ts: r.ts.0, kind: Some(kind) }
}

fn command_from_pb(c: pb::Command) -> Result<Request, ProtoError> {
    use pb::command::Kind;
    check_version(c.format_version)?;
    let command = match c.kind.ok_or(ProtoError::Missing("command.kind"))? {
        Kind::SubmitJob(s) => Command::SubmitJob {
            request_id: s.request_id,
            spec: s.spec.ok_or(ProtoError::Missing("submit_job.spec"))?.try_into()?,
        },
        Kind::SubmitJobs(batch) => Command::SubmitJobs {
            jobs: batch
                .jobs
                .into_iter()
                .map(|s| Ok((s.request_id, s.spec.ok_or(ProtoError::Missing("submit_jobs.spec"))?.try_into()?)))
                .collect::<Result<Vec<_>, ProtoError>>()?,
        },
        Kind::PlaceJob(p) => Command::PlaceJob { job_id: p.job_id, node: p.node, gpus: p.gpus },
        Kind::JobStarted(s) => Command::JobStarted { job_id: s.job_id, epoch: s.epoch },
        Kind::JobFinished(f) => Command::JobFinished {
            job_id: f.job_id,
            epoch: f.epoch,
            report: f.report.ok_or(ProtoError::Missing("job_finished.report"))?.into(),
        },
        Kind::CancelJob(c) => Command::CancelJob { job_id: c.job_id, reason: c.reason },
        Kind::RegisterNode(r) => {
            Command::RegisterNode { spec: r.spec.ok_or(ProtoError::Missing("register_node.spec"))?.into() }
        }
        Kind::SetNodeState(s) => {
            Command::SetNodeState { node: s.node, state: node_state_from_i32(s.state)?, reason: s.reason }
        }
        Kind::Configure(c) => Command::Configure(config_from_pb(c)),
        Kind::Noop(_) => Command::Noop,
        Kind::AddCoordinator(a) => Command::AddCoordinator { node_id: a.node_id, addr: a.addr },
        Kind::RemoveCoordinator(r) => Command::RemoveCoordinator { node_id: r.node_id },
        Kind::ExtendTso(e) => Command::ExtendTso { upper_ms: e.upper_ms },
    };
    Ok(Request { ts: Timestamp(c.ts), command })
}

fn check_version(found: u32) -> Result<(), ProtoError> {
    if found == 0 || found > FORMAT_VERSION {
        return Err(ProtoError::Version { found, supported: FORMAT_VERSION });
    }
    Ok(())
}

/// Encodes a replicated request as it is stored in the Raft log.
pub fn command_to_bytes(r: &Request) -> Vec<u8> {
    command_to_pb(r).encode_to_vec()
}

/// Decodes a replicated request from the Raft log.
pub fn command_from_bytes(bytes: &[u8]) -> Result<Request, ProtoError> {
    command_from_pb(pb::Command::decode(bytes)?)
}

/// Encodes the whole state machine for a snapshot.
pub fn snapshot_to_bytes(s: &State) -> Vec<u8> {
    pb::StateSnapshot {
        format_version: FORMAT_VERSION,
        jobs: s.jobs.values().map(Into::into).collect(),
        nodes: s.nodes.values().map(node_status_to_pb).collect(),
        request_ids: s
            .request_ids
            .iter()
            .map(|(r, j)| pb::RequestIdEntry { request_id: r.clone(), job_id: *j })
            .collect(),
        next_job_id: s.next_job_id,
        next_epoch: s.next_epoch,
        last_ts: s.last_ts.0,
        config: Some(config_to_pb(&s.config)),
        coordinators: coordinators_to_pb(s),
        tso_window_end_ms: s.tso_window_end_ms,
    }
    .encode_to_vec()
}

fn coordinators_to_pb(s: &State) -> Vec<pb::CoordinatorRecord> {
    s.coordinators
        .iter()
        .map(|(id, r)| pb::CoordinatorRecord { node_id: *id, addr: r.addr.clone(), removed: r.removed })
        .collect()
}

fn coordinators_from_pb(records: Vec<pb::CoordinatorRecord>) -> BTreeMap<u64, CoordinatorRecord> {
    records.into_iter().map(|r| (r.node_id, CoordinatorRecord { addr: r.addr, removed: r.removed })).collect()
}

/// Decodes a snapshot written by [`snapshot_to_bytes`].
pub fn snapshot_from_bytes(bytes: &[u8]) -> Result<State, ProtoError> {
    let s = pb::StateSnapshot::decode(bytes)?;
    check_version(s.format_version)?;
    let jobs =
        s.jobs.into_iter().map(|j| Job::try_from(j).map(|j| (j.id, j))).collect::<Result<BTreeMap<_, _>, _>>()?;
    let nodes = s
        .nodes
        .into_iter()
        .map(|n| node_status_from_pb(n).map(|n| (n.spec.name.clone(), n)))
        .collect::<Result<BTreeMap<_, _>, _>>()?;
    Ok(State::from_parts(
        jobs,
        nodes,
        s.request_ids.into_iter().map(|e| (e.request_id, e.job_id)).collect(),
        s.next_job_id,
        s.next_epoch,
        Timestamp(s.last_ts),
        s.config.map(config_from_pb).unwrap_or_default(),
        coordinators_from_pb(s.coordinators),
        s.tso_window_end_ms,
    ))
}

/// Encodes one job (persisted per key in the state machine store).
pub fn job_to_bytes(j: &Job) -> Vec<u8> {
    pb::Job::from(j).encode_to_vec()
}

/// Decodes one job written by [`job_to_bytes`].
pub fn job_from_bytes(bytes: &[u8]) -> Result<Job, ProtoError> {
    pb::Job::decode(bytes)?.try_into()
}

/// Encodes one node (persisted per key in the state machine store).
pub fn node_to_bytes(n: &NodeStatus) -> Vec<u8> {
    node_status_to_pb(n).encode_to_vec()
}

/// Decodes one node written by [`node_to_bytes`].
pub fn node_from_bytes(bytes: &[u8]) -> Result<NodeStatus, ProtoError> {
    node_status_from_pb(pb::NodeStatus::decode(bytes)?)
}

/// The scalar part of the state (counters, clock, config), without jobs, nodes and request ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateMeta {
    pub next_job_id: u64,
    pub next_epoch: u64,
    pub last_ts: Timestamp,
    pub config: ClusterConfig,
    pub coordinators: BTreeMap<u64, CoordinatorRecord>,
    pub tso_window_end_ms: u64,
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
        ..Default::default()
    }
    .encode_to_vec()
}

/// Decodes what [`meta_to_bytes`] wrote.
pub fn meta_from_bytes(bytes: &[u8]) -> Result<StateMeta, ProtoError> {
    let s = pb::StateSnapshot::decode(bytes)?;
    check_version(s.format_version)?;
    Ok(StateMeta {
        next_job_id: s.next_job_id,
        next_epoch: s.next_epoch,
        last_ts: Timestamp(s.last_ts),
        config: s.config.map(config_from_pb).unwrap_or_default(),
        coordinators: coordinators_from_pb(s.coordinators),
        tso_window_end_ms: s.tso_window_end_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_and_snapshots_round_trip() {
        let spec = JobSpec {
            name: "n".into(),
            tenant: "default".into(),
            priority_class: "normal".into(),
            gpus: 0,
            gpu_slice: Some(GpuSlice::Mps { thread_percent: 25, memory_mib: Some(1024) }),
            cpu_millis: 500,
            memory_bytes: 1 << 30,
            time_limit_secs: Some(60),
            image: None,
            command: vec!["sh".into(), "-c".into(), "echo hi".into()],
            env: [("A".to_string(), "1".to_string())].into(),
        };
        let req = Request { ts: Timestamp(77), command: Command::SubmitJob { request_id: "r".into(), spec } };
        assert_eq!(command_from_bytes(&command_to_bytes(&req)).unwrap(), req);

        let mut state = State::default();
        state.apply(&Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) }).unwrap();
        state.apply(&req).unwrap();
        let back = snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap();
        assert_eq!(back, state);
        assert_eq!(back.pending_jobs().count(), 1, "derived index rebuilt");
    }

    #[test]
    fn garbage_and_future_versions_are_refused() {
        assert!(command_from_bytes(&[0xff, 0xff, 0xff]).is_err());
        let future = pb::Command { format_version: 99, ts: 1, kind: Some(pb::command::Kind::Noop(true)) };
        assert!(matches!(command_from_bytes(&future.encode_to_vec()), Err(ProtoError::Version { found: 99, .. })));
    }
}
