//! The persisted encoding of the replicated state: Raft log commands, snapshots, and the state
//! machine store's per-key records (jobs, nodes, billing segments, the scalar meta), as the
//! messages of `state.proto` with their format version.
//!
//! Compatibility boundary: these bytes are on disk (raft-log, the history store, snapshot files) and in other
//! coordinators' logs. Fields are only added; a change that alters the bytes of an existing
//! value fails the golden tests (`tests/it/golden.rs`). This is the only place that knows the
//! persisted messages: the wire protocol (corral-proto) has its own.

use corral_core::{
    BilledTotal, ClusterConfig, Command, CompactCutoffs, CoordinatorRecord, JobUpdate, JoinTokenRecord, JoinTokenUse,
    Placement, PolicyRecord, Preemption, PriorityClass, Request, RequestKey, RequestRecord, SchedulerConfig, State,
    TenantPolicy, TokenRecord, UsageLedger,
};
use corral_types::{
    Allocation, ArrayProgress, ArrayRange, ArraySpec, ArrayTask, Dependency, DependencyKind, GpuDevice, GpuSlice, Job,
    JobExitReport, JobSpec, JobState, NodeGpus, NodeMode, NodeSpec, NodeState, NodeStatus, PartEnd, PreemptionNotice,
    PriceBreak, SchedOptions, Segment, SliceAssignment, Timestamp,
};
use prost::Message;
use std::collections::BTreeMap;

/// Version of the persisted command encoding, written into every `Command` (and the store's
/// scalar record); a build refuses versions newer than [`SNAPSHOT_FORMAT_VERSION`].
/// 2: preemption, gang placements across nodes, GPU slices, quotas and fair-share usage.
pub const FORMAT_VERSION: u32 = 2;

/// Version of the snapshot encoding, written into every `StateSnapshot`: the newest version this
/// build reads. 3: request ids as a packed table of keys (`request_id_table`); a build of
/// version 2 would not see them, so it refuses such a snapshot instead. Version 2 snapshots
/// (request ids as strings) are still read.
pub const SNAPSHOT_FORMAT_VERSION: u32 = 3;

/// Bytes of one entry of a snapshot's `request_id_table`: key, job id (LE), submit time (LE).
pub const REQUEST_ID_ENTRY_BYTES: usize = 32;

/// Field number of `StateSnapshot.request_id_table`.
const SNAPSHOT_REQUEST_ID_TABLE_FIELD: u32 = 16;

mod step;

/// Generated code of package `corral.state.v1` (`proto/state.proto`).
mod pb {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/corral.state.v1.rs"));
}

/// Persisted bytes that do not decode into a valid domain value.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("missing field '{0}'")]
    Missing(&'static str),
    #[error("invalid value of '{field}': {value}")]
    Invalid { field: &'static str, value: String },
    #[error("unsupported format version {found} (this build reads up to {supported})")]
    Version { found: u32, supported: u32 },
    #[error("protobuf decode error: {0}")]
    Decode(#[from] prost::DecodeError),
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
    type Error = CodecError;
    fn try_from(s: pb::GpuSlice) -> Result<Self, CodecError> {
        use pb::gpu_slice::Kind;
        match s.kind.ok_or(CodecError::Missing("gpu_slice.kind"))? {
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
            sched: (s.sched != SchedOptions::default()).then_some(pb::SchedOptions {
                gpus_per_node: s.sched.gpus_per_node,
                rdma: s.sched.rdma,
                no_requeue: s.sched.no_requeue,
                checkpoint_signal: s.sched.checkpoint_signal,
                signal_before_end_secs: s.sched.signal_before_end_secs,
                dependencies: s
                    .sched
                    .dependencies
                    .iter()
                    .map(|d| pb::Dependency { kind: dependency_kind_to_pb(d.kind), job_id: d.job_id })
                    .collect(),
                singleton: s.sched.singleton,
                max_restarts: s.sched.max_restarts,
                node_selector: s.sched.node_selector.clone(),
                hold: s.sched.hold,
            }),
            workdir: s.workdir.clone(),
            script: s.script.clone(),
            stdout_path: s.stdout_path.clone(),
            stderr_path: s.stderr_path.clone(),
            array: s.array.as_ref().map(|a| pb::ArraySpec {
                ranges: a
                    .ranges
                    .iter()
                    .map(|r| pb::ArrayRange { first: r.first, last: r.last, step: r.step })
                    .collect(),
                max_running: a.max_running,
            }),
        }
    }
}

impl TryFrom<pb::JobSpec> for JobSpec {
    type Error = CodecError;
    fn try_from(s: pb::JobSpec) -> Result<Self, CodecError> {
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
            sched: s
                .sched
                .map(|o| -> Result<SchedOptions, CodecError> {
                    Ok(SchedOptions {
                        gpus_per_node: o.gpus_per_node,
                        rdma: o.rdma,
                        no_requeue: o.no_requeue,
                        checkpoint_signal: o.checkpoint_signal,
                        signal_before_end_secs: o.signal_before_end_secs,
                        dependencies: o
                            .dependencies
                            .into_iter()
                            .map(|d| Ok(Dependency { kind: dependency_kind_from_i32(d.kind)?, job_id: d.job_id }))
                            .collect::<Result<_, CodecError>>()?,
                        singleton: o.singleton,
                        max_restarts: o.max_restarts,
                        node_selector: o.node_selector,
                        hold: o.hold,
                    })
                })
                .transpose()?
                .unwrap_or_default(),
            workdir: s.workdir,
            script: s.script,
            stdout_path: s.stdout_path,
            stderr_path: s.stderr_path,
            array: s.array.map(|a| ArraySpec {
                ranges: a
                    .ranges
                    .into_iter()
                    .map(|r| ArrayRange { first: r.first, last: r.last, step: r.step })
                    .collect(),
                max_running: a.max_running,
            }),
        })
    }
}

fn dependency_kind_to_pb(k: DependencyKind) -> i32 {
    match k {
        DependencyKind::AfterOk => pb::DependencyKind::AfterOk as i32,
        DependencyKind::AfterAny => pb::DependencyKind::AfterAny as i32,
        DependencyKind::AfterNotOk => pb::DependencyKind::AfterNotOk as i32,
    }
}

fn dependency_kind_from_i32(v: i32) -> Result<DependencyKind, CodecError> {
    match pb::DependencyKind::try_from(v) {
        Ok(pb::DependencyKind::AfterOk) => Ok(DependencyKind::AfterOk),
        Ok(pb::DependencyKind::AfterAny) => Ok(DependencyKind::AfterAny),
        Ok(pb::DependencyKind::AfterNotOk) => Ok(DependencyKind::AfterNotOk),
        _ => Err(CodecError::Invalid { field: "dependency kind", value: v.to_string() }),
    }
}

// ---- allocations and preemption ----

fn node_gpus_to_pb(parts: &[NodeGpus]) -> Vec<pb::NodeGpus> {
    parts.iter().map(|p| pb::NodeGpus { node: p.node.clone(), gpus: p.gpus.clone() }).collect()
}

fn node_gpus_from_pb(parts: Vec<pb::NodeGpus>) -> Vec<NodeGpus> {
    parts.into_iter().map(|p| NodeGpus { node: p.node, gpus: p.gpus }).collect()
}

fn slice_to_pb(s: &SliceAssignment) -> pb::SliceAssignment {
    use pb::slice_assignment::Kind;
    let kind = match s {
        SliceAssignment::Mig { profile, start, memory_slices, compute_slices } => Kind::Mig(pb::MigAssignment {
            profile: profile.clone(),
            start: *start,
            memory_slices: *memory_slices,
            compute_slices: *compute_slices,
        }),
        SliceAssignment::Mps { thread_percent, memory_mib } => {
            Kind::Mps(pb::MpsAssignment { thread_percent: *thread_percent, memory_mib: *memory_mib })
        }
    };
    pb::SliceAssignment { kind: Some(kind) }
}

fn slice_from_pb(s: pb::SliceAssignment) -> Result<SliceAssignment, CodecError> {
    use pb::slice_assignment::Kind;
    Ok(match s.kind.ok_or(CodecError::Missing("slice.kind"))? {
        Kind::Mig(m) => SliceAssignment::Mig {
            profile: m.profile,
            start: m.start,
            memory_slices: m.memory_slices,
            compute_slices: m.compute_slices,
        },
        Kind::Mps(m) => SliceAssignment::Mps { thread_percent: m.thread_percent, memory_mib: m.memory_mib },
    })
}

fn placement_to_pb(p: &Placement) -> pb::Placement {
    pb::Placement {
        job_id: p.job_id,
        node: p.node.clone(),
        gpus: p.gpus.clone(),
        more_nodes: node_gpus_to_pb(&p.more_nodes),
        slice: p.slice.as_ref().map(slice_to_pb),
    }
}

fn placement_from_pb(p: pb::Placement) -> Result<Placement, CodecError> {
    Ok(Placement {
        job_id: p.job_id,
        node: p.node,
        gpus: p.gpus,
        more_nodes: node_gpus_from_pb(p.more_nodes),
        slice: p.slice.map(slice_from_pb).transpose()?,
    })
}

fn preemption_to_pb(p: &Preemption) -> pb::Preemption {
    pb::Preemption { job_id: p.job_id, by: p.by, grace_secs: p.grace_secs }
}

fn preemption_from_pb(p: pb::Preemption) -> Preemption {
    Preemption { job_id: p.job_id, by: p.by, grace_secs: p.grace_secs }
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

fn job_state_from_i32(v: i32) -> Result<JobState, CodecError> {
    let invalid = || CodecError::Invalid { field: "state", value: v.to_string() };
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
                more_nodes: node_gpus_to_pb(&a.more_nodes),
                slice: a.slice.as_ref().map(slice_to_pb),
                master_port: a.master_port,
                ended: a
                    .ended
                    .iter()
                    .map(|e| pb::PartEnd { node: e.node.clone(), report: e.report.as_ref().map(Into::into) })
                    .collect(),
                price_breaks: a
                    .price_breaks
                    .iter()
                    .map(|b| pb::PriceBreak {
                        at: b.at.0,
                        price_micros_per_gpu_hour: b.price_micros_per_gpu_hour,
                        multiplier_milli: b.multiplier_milli,
                        policy_version: b.policy_version,
                    })
                    .collect(),
            }),
            preemption: j.preemption.as_ref().map(|p| pb::PreemptionNotice {
                by: p.by,
                at: p.at.0,
                grace_secs: p.grace_secs,
                checkpoint_signal: p.checkpoint_signal,
            }),
            exit_code: j.exit_code,
            signal: j.signal,
            reason: j.reason.clone(),
            cancel_requested: j.cancel_requested,
            attempts: j.attempts,
            worker_run_time_ms: j.worker_run_time_ms,
            held: j.held,
            waiting_on: j.waiting_on.clone(),
            array_task: j.array_task.map(|t| pb::ArrayTask { array: t.array, index: t.index }),
            array_progress: j.array_progress.as_ref().map(|p| pb::ArrayProgress {
                created: p.created,
                succeeded: p.succeeded,
                unsuccessful: p.unsuccessful,
                skipped: p.skipped.clone(),
            }),
            restarts: j.restarts,
            signals: j.signals.clone(),
            steps: step::steps_to_pb(&j.steps),
        }
    }
}

impl TryFrom<pb::Job> for Job {
    type Error = CodecError;
    fn try_from(j: pb::Job) -> Result<Self, CodecError> {
        Ok(Job {
            id: j.id,
            spec: j.spec.ok_or(CodecError::Missing("job.spec"))?.try_into()?,
            state: job_state_from_i32(j.state)?,
            request_id: j.request_id,
            submitted_at: Timestamp(j.submitted_at),
            admitted_at: j.admitted_at.map(Timestamp),
            started_at: j.started_at.map(Timestamp),
            finished_at: j.finished_at.map(Timestamp),
            allocation: j
                .allocation
                .map(|a| -> Result<Allocation, CodecError> {
                    Ok(Allocation {
                        node: a.node,
                        gpus: a.gpus,
                        epoch: a.epoch,
                        more_nodes: node_gpus_from_pb(a.more_nodes),
                        slice: a.slice.map(slice_from_pb).transpose()?,
                        master_port: a.master_port,
                        ended: a
                            .ended
                            .into_iter()
                            .map(|e| PartEnd { node: e.node, report: e.report.map(Into::into) })
                            .collect(),
                        price_breaks: a
                            .price_breaks
                            .into_iter()
                            .map(|b| PriceBreak {
                                at: Timestamp(b.at),
                                price_micros_per_gpu_hour: b.price_micros_per_gpu_hour,
                                multiplier_milli: b.multiplier_milli,
                                policy_version: b.policy_version,
                            })
                            .collect(),
                    })
                })
                .transpose()?,
            preemption: j.preemption.map(|p| PreemptionNotice {
                by: p.by,
                at: Timestamp(p.at),
                grace_secs: p.grace_secs,
                checkpoint_signal: p.checkpoint_signal,
            }),
            exit_code: j.exit_code,
            signal: j.signal,
            reason: j.reason,
            cancel_requested: j.cancel_requested,
            attempts: j.attempts,
            worker_run_time_ms: j.worker_run_time_ms,
            held: j.held,
            waiting_on: j.waiting_on,
            array_task: j.array_task.map(|t| ArrayTask { array: t.array, index: t.index }),
            array_progress: j.array_progress.map(|p| ArrayProgress {
                created: p.created,
                succeeded: p.succeeded,
                unsuccessful: p.unsuccessful,
                skipped: p.skipped,
            }),
            restarts: j.restarts,
            signals: j.signals,
            steps: step::steps_from_pb(j.steps)?,
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
            never_started: r.never_started,
            fenced: r.fenced,
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
            never_started: r.never_started,
            fenced: r.fenced,
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

fn node_state_from_i32(v: i32) -> Result<NodeState, CodecError> {
    match pb::NodeState::try_from(v) {
        Ok(pb::NodeState::Up) => Ok(NodeState::Up),
        Ok(pb::NodeState::Down) => Ok(NodeState::Down),
        _ => Err(CodecError::Invalid { field: "node state", value: v.to_string() }),
    }
}

fn node_mode_to_pb(m: NodeMode) -> i32 {
    match m {
        NodeMode::Active => pb::NodeMode::Active as i32,
        NodeMode::Cordoned => pb::NodeMode::Cordoned as i32,
        NodeMode::Draining => pb::NodeMode::Draining as i32,
    }
}

fn node_mode_from_i32(v: i32) -> Result<NodeMode, CodecError> {
    match pb::NodeMode::try_from(v) {
        Ok(pb::NodeMode::Active) => Ok(NodeMode::Active),
        Ok(pb::NodeMode::Cordoned) => Ok(NodeMode::Cordoned),
        Ok(pb::NodeMode::Draining) => Ok(NodeMode::Draining),
        Err(_) => Err(CodecError::Invalid { field: "node mode", value: v.to_string() }),
    }
}

fn node_status_to_pb(n: &NodeStatus) -> pb::NodeStatus {
    pb::NodeStatus {
        spec: Some((&n.spec).into()),
        state: pb::NodeState::from(n.state) as i32,
        epoch: n.epoch,
        mode: node_mode_to_pb(n.mode),
        mode_reason: n.mode_reason.clone(),
        drain_deadline: n.drain_deadline.map(|t| t.0),
    }
}

fn node_status_from_pb(n: pb::NodeStatus) -> Result<NodeStatus, CodecError> {
    Ok(NodeStatus {
        spec: n.spec.ok_or(CodecError::Missing("node.spec"))?.into(),
        state: node_state_from_i32(n.state)?,
        epoch: n.epoch,
        mode: node_mode_from_i32(n.mode)?,
        mode_reason: n.mode_reason,
        drain_deadline: n.drain_deadline.map(Timestamp),
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
                grace_secs: p.grace_secs,
                default_time_secs: p.default_time_secs,
                max_time_secs: p.max_time_secs,
            })
            .collect(),
        tenant_policies: c
            .tenant_policies
            .iter()
            .map(|(tenant, p)| pb::TenantPolicy {
                tenant: tenant.clone(),
                quota_milli_gpus: p.quota_milli_gpus,
                class_quotas: p.class_quotas.clone(),
                cohort: p.cohort.clone(),
                borrowing_limit_milli_gpus: p.borrowing_limit_milli_gpus,
                fair_share_weight: p.fair_share_weight,
                max_running_jobs: p.max_running_jobs,
                max_pending_jobs: p.max_pending_jobs,
            })
            .collect(),
        scheduler: Some(pb::SchedulerConfig {
            usage_half_life_secs: c.scheduler.usage_half_life_secs,
            backfill_reservations: c.scheduler.backfill_reservations,
            max_preemptors_per_pass: c.scheduler.max_preemptors_per_pass,
        }),
        gpu_prices: c
            .gpu_prices
            .iter()
            .map(|(model, price)| pb::GpuPrice { model: model.clone(), micros_per_gpu_hour: *price })
            .collect(),
        default_gpu_price: c.default_gpu_price,
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
                    grace_secs: p.grace_secs,
                    default_time_secs: p.default_time_secs,
                    max_time_secs: p.max_time_secs,
                };
                (p.name, class)
            })
            .collect(),
        tenant_policies: c
            .tenant_policies
            .into_iter()
            .map(|p| {
                let policy = TenantPolicy {
                    quota_milli_gpus: p.quota_milli_gpus,
                    class_quotas: p.class_quotas,
                    cohort: p.cohort,
                    borrowing_limit_milli_gpus: p.borrowing_limit_milli_gpus,
                    fair_share_weight: p.fair_share_weight.max(1),
                    max_running_jobs: p.max_running_jobs,
                    max_pending_jobs: p.max_pending_jobs,
                };
                (p.tenant, policy)
            })
            .collect(),
        scheduler: c
            .scheduler
            .map(|s| SchedulerConfig {
                usage_half_life_secs: s.usage_half_life_secs,
                backfill_reservations: s.backfill_reservations,
                max_preemptors_per_pass: s.max_preemptors_per_pass,
            })
            .unwrap_or_default(),
        gpu_prices: c.gpu_prices.into_iter().map(|p| (p.model, p.micros_per_gpu_hour)).collect(),
        default_gpu_price: c.default_gpu_price,
    }
}

/// A billing segment as the store and the snapshot carry it.
fn segment_to_pb(g: &Segment) -> pb::Segment {
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
    }
}

/// Inverse of [`segment_to_pb`].
fn segment_from_pb(g: pb::Segment) -> Segment {
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
    }
}

/// Encodes one billing segment (persisted per key in the state machine store).
pub fn segment_to_bytes(g: &Segment) -> Vec<u8> {
    segment_to_pb(g).encode_to_vec()
}

/// Decodes what [`segment_to_bytes`] wrote.
pub fn segment_from_bytes(bytes: &[u8]) -> Result<Segment, CodecError> {
    Ok(segment_from_pb(pb::Segment::decode(bytes)?))
}

fn usage_to_pb(u: &UsageLedger) -> Vec<pb::TenantUsage> {
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

fn usage_from_pb(u: Vec<pb::TenantUsage>) -> UsageLedger {
    UsageLedger {
        tenants: u
            .into_iter()
            .map(|t| (t.tenant, t.buckets.into_iter().map(|b| (b.start_ms, b.milli_gpu_secs)).collect()))
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
        Command::JobFinished { job_id, epoch, node, report } => Kind::JobFinished(pb::JobFinished {
            job_id: *job_id,
            epoch: *epoch,
            report: Some(report.into()),
            node: node.clone(),
        }),
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
        Command::PreemptJob { job_id, by, grace_secs } => {
            Kind::PreemptJob(pb::Preemption { job_id: *job_id, by: *by, grace_secs: *grace_secs })
        }
        Command::Schedule { placements, preemptions } => Kind::Schedule(pb::Schedule {
            placements: placements.iter().map(placement_to_pb).collect(),
            preemptions: preemptions.iter().map(preemption_to_pb).collect(),
        }),
        Command::CreateToken { tenant, admin, sha256, expires_at_ms } => Kind::CreateToken(pb::CreateToken {
            tenant: tenant.clone(),
            admin: *admin,
            sha256: sha256.clone(),
            expires_at_ms: *expires_at_ms,
        }),
        Command::RevokeToken { token_id } => Kind::RevokeToken(pb::RevokeToken { token_id: *token_id }),
        Command::SetNodeMode { node, mode, reason, drain_deadline } => Kind::SetNodeMode(pb::SetNodeMode {
            node: node.clone(),
            mode: node_mode_to_pb(*mode),
            reason: reason.clone(),
            drain_deadline: drain_deadline.map(|t| t.0),
        }),
        Command::EvictDrainedJobs { node } => Kind::EvictDrainedJobs(pb::EvictDrainedJobs { node: node.clone() }),
        Command::RemoveNode { node } => Kind::RemoveNode(pb::RemoveNode { node: node.clone() }),
        Command::HoldJob { job_id, hold } => Kind::HoldJob(pb::HoldJob { job_id: *job_id, hold: *hold }),
        Command::RequeueJob { job_id } => Kind::RequeueJob(pb::RequeueJob { job_id: *job_id }),
        Command::SignalJob { job_id, signal } => Kind::SignalJob(pb::SignalJob { job_id: *job_id, signal: *signal }),
        Command::UpdateJob { job_id, update, admin } => Kind::UpdateJob(pb::UpdateJob {
            job_id: *job_id,
            update: Some(pb::JobUpdate {
                time_limit_secs: update.time_limit_secs,
                priority_class: update.priority_class.clone(),
                gpus: update.gpus,
                name: update.name.clone(),
            }),
            admin: *admin,
        }),
        Command::CancelArrayTask { array, index, reason } => {
            Kind::CancelArrayTask(pb::CancelArrayTask { array: *array, index: *index, reason: reason.clone() })
        }
        Command::ApplyPolicy { config, by, force } => {
            Kind::ApplyPolicy(pb::ApplyPolicy { config: Some(config_to_pb(config)), by: by.clone(), force: *force })
        }
        Command::CreateJoinToken { sha256, ttl_ms } => {
            Kind::CreateJoinToken(pb::CreateJoinToken { sha256: sha256.clone(), ttl_ms: *ttl_ms })
        }
        Command::ConsumeJoinToken { sha256, node, public_key_sha256 } => Kind::ConsumeJoinToken(pb::ConsumeJoinToken {
            sha256: sha256.clone(),
            node: node.clone(),
            public_key_sha256: public_key_sha256.clone(),
        }),
        Command::CancelJobs { job_ids, reason } => {
            Kind::CancelJobs(pb::CancelJobs { job_ids: job_ids.clone(), reason: reason.clone() })
        }
        Command::CreateStep { job_id, epoch, request_id, spec } => Kind::CreateStep(pb::CreateStep {
            job_id: *job_id,
            epoch: *epoch,
            request_id: request_id.clone(),
            spec: Some(step::spec_to_pb(spec)),
        }),
        Command::StepEnded { job_id, epoch, step: id, end } => Kind::StepEnded(pb::StepEnded {
            job_id: *job_id,
            epoch: *epoch,
            step: *id,
            end: Some(step::node_end_to_pb(end)),
        }),
        Command::SignalStep { job_id, step: id, signal } => {
            Kind::SignalStep(pb::SignalStep { job_id: *job_id, step: *id, signal: *signal })
        }
        Command::Compact(c) => Kind::Compact(pb::Compact {
            archive_before: c.archive_before.0,
            request_ids_before: c.request_ids_before.0,
            jobs_before: c.jobs_before.map(|t| t.0),
            segments_before: c.segments_before.map(|t| t.0),
        }),
    };
    pb::Command { format_version: FORMAT_VERSION, ts: r.ts.0, kind: Some(kind) }
}

fn command_from_pb(c: pb::Command) -> Result<Request, CodecError> {
    use pb::command::Kind;
    check_version(c.format_version)?;
    let command = match c.kind.ok_or(CodecError::Missing("command.kind"))? {
        Kind::SubmitJob(s) => Command::SubmitJob {
            request_id: s.request_id,
            spec: s.spec.ok_or(CodecError::Missing("submit_job.spec"))?.try_into()?,
        },
        Kind::SubmitJobs(batch) => Command::SubmitJobs {
            jobs: batch
                .jobs
                .into_iter()
                .map(|s| Ok((s.request_id, s.spec.ok_or(CodecError::Missing("submit_jobs.spec"))?.try_into()?)))
                .collect::<Result<Vec<_>, CodecError>>()?,
        },
        Kind::PlaceJob(p) => Command::PlaceJob { job_id: p.job_id, node: p.node, gpus: p.gpus },
        Kind::JobStarted(s) => Command::JobStarted { job_id: s.job_id, epoch: s.epoch },
        Kind::JobFinished(f) => Command::JobFinished {
            job_id: f.job_id,
            epoch: f.epoch,
            node: f.node,
            report: f.report.ok_or(CodecError::Missing("job_finished.report"))?.into(),
        },
        Kind::CancelJob(c) => Command::CancelJob { job_id: c.job_id, reason: c.reason },
        Kind::RegisterNode(r) => {
            Command::RegisterNode { spec: r.spec.ok_or(CodecError::Missing("register_node.spec"))?.into() }
        }
        Kind::SetNodeState(s) => {
            Command::SetNodeState { node: s.node, state: node_state_from_i32(s.state)?, reason: s.reason }
        }
        Kind::Configure(c) => Command::Configure(config_from_pb(c)),
        Kind::Noop(_) => Command::Noop,
        Kind::AddCoordinator(a) => Command::AddCoordinator { node_id: a.node_id, addr: a.addr },
        Kind::RemoveCoordinator(r) => Command::RemoveCoordinator { node_id: r.node_id },
        Kind::ExtendTso(e) => Command::ExtendTso { upper_ms: e.upper_ms },
        Kind::PreemptJob(p) => Command::PreemptJob { job_id: p.job_id, by: p.by, grace_secs: p.grace_secs },
        Kind::Schedule(s) => Command::Schedule {
            placements: s.placements.into_iter().map(placement_from_pb).collect::<Result<_, _>>()?,
            preemptions: s.preemptions.into_iter().map(preemption_from_pb).collect(),
        },
        Kind::CreateToken(t) => {
            Command::CreateToken { tenant: t.tenant, admin: t.admin, sha256: t.sha256, expires_at_ms: t.expires_at_ms }
        }
        Kind::RevokeToken(r) => Command::RevokeToken { token_id: r.token_id },
        Kind::SetNodeMode(m) => Command::SetNodeMode {
            node: m.node,
            mode: node_mode_from_i32(m.mode)?,
            reason: m.reason,
            drain_deadline: m.drain_deadline.map(Timestamp),
        },
        Kind::EvictDrainedJobs(e) => Command::EvictDrainedJobs { node: e.node },
        Kind::RemoveNode(r) => Command::RemoveNode { node: r.node },
        Kind::HoldJob(h) => Command::HoldJob { job_id: h.job_id, hold: h.hold },
        Kind::RequeueJob(r) => Command::RequeueJob { job_id: r.job_id },
        Kind::SignalJob(g) => Command::SignalJob { job_id: g.job_id, signal: g.signal },
        Kind::UpdateJob(u) => {
            let update = u.update.unwrap_or_default();
            Command::UpdateJob {
                job_id: u.job_id,
                update: JobUpdate {
                    time_limit_secs: update.time_limit_secs,
                    priority_class: update.priority_class,
                    gpus: update.gpus,
                    name: update.name,
                },
                admin: u.admin,
            }
        }
        Kind::CancelArrayTask(c) => Command::CancelArrayTask { array: c.array, index: c.index, reason: c.reason },
        Kind::ApplyPolicy(a) => Command::ApplyPolicy {
            config: config_from_pb(a.config.ok_or(CodecError::Missing("apply_policy.config"))?),
            by: a.by,
            force: a.force,
        },
        Kind::CreateJoinToken(t) => Command::CreateJoinToken { sha256: t.sha256, ttl_ms: t.ttl_ms },
        Kind::ConsumeJoinToken(c) => {
            Command::ConsumeJoinToken { sha256: c.sha256, node: c.node, public_key_sha256: c.public_key_sha256 }
        }
        Kind::CancelJobs(c) => Command::CancelJobs { job_ids: c.job_ids, reason: c.reason },
        Kind::CreateStep(c) => Command::CreateStep {
            job_id: c.job_id,
            epoch: c.epoch,
            request_id: c.request_id,
            spec: step::spec_from_pb(c.spec.ok_or(CodecError::Missing("create_step.spec"))?),
        },
        Kind::StepEnded(c) => Command::StepEnded {
            job_id: c.job_id,
            epoch: c.epoch,
            step: c.step,
            end: step::node_end_from_pb(c.end.ok_or(CodecError::Missing("step_ended.end"))?),
        },
        Kind::SignalStep(c) => Command::SignalStep { job_id: c.job_id, step: c.step, signal: c.signal },
        Kind::Compact(c) => Command::Compact(CompactCutoffs {
            archive_before: Timestamp(c.archive_before),
            request_ids_before: Timestamp(c.request_ids_before),
            jobs_before: c.jobs_before.map(Timestamp),
            segments_before: c.segments_before.map(Timestamp),
        }),
    };
    Ok(Request { ts: Timestamp(c.ts), command })
}

fn check_version(found: u32) -> Result<(), CodecError> {
    if found == 0 || found > SNAPSHOT_FORMAT_VERSION {
        return Err(CodecError::Version { found, supported: SNAPSHOT_FORMAT_VERSION });
    }
    Ok(())
}

/// Encodes a replicated request as it is stored in the Raft log.
pub fn command_to_bytes(r: &Request) -> Vec<u8> {
    command_to_pb(r).encode_to_vec()
}

/// Decodes a replicated request from the Raft log.
pub fn command_from_bytes(bytes: &[u8]) -> Result<Request, CodecError> {
    command_from_pb(pb::Command::decode(bytes)?)
}

/// Field numbers of `StateSnapshot` whose records a snapshot streams after the hot state.
const SNAPSHOT_SEGMENTS_FIELD: u32 = 12;
const SNAPSHOT_ARCHIVED_JOBS_FIELD: u32 = 52;

/// Writes one record of the history after a snapshot begun with [`snapshot_to_bytes`]: the
/// result is still one `StateSnapshot` message.
pub fn write_snapshot_record(out: &mut impl std::io::Write, kind: HistoryRecord, record: &[u8]) -> std::io::Result<()> {
    let field = match kind {
        HistoryRecord::Segment => SNAPSHOT_SEGMENTS_FIELD,
        HistoryRecord::ArchivedJob => SNAPSHOT_ARCHIVED_JOBS_FIELD,
    };
    let mut head = Vec::with_capacity(16);
    prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, &mut head);
    prost::encoding::encode_varint(record.len() as u64, &mut head);
    out.write_all(&head)?;
    out.write_all(record)
}

/// What the history written after a snapshot's hot state depends on: its job ids, the next job
/// id and where its hot ledger starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotBounds {
    /// The hot state's job ids, ascending.
    pub job_ids: Vec<corral_types::JobId>,
    pub next_job_id: corral_types::JobId,
    pub segments_archived_below: u64,
}

impl HotBounds {
    pub fn of(s: &State) -> HotBounds {
        HotBounds {
            job_ids: s.jobs.keys().copied().collect(),
            next_job_id: s.next_job_id,
            segments_archived_below: s.segments_archived_below,
        }
    }

    /// Decoded from a snapshot of the hot state without the rest of it (request ids, jobs'
    /// contents): prost skips the fields these messages do not name.
    pub fn from_snapshot(bytes: &[u8]) -> Result<HotBounds, CodecError> {
        #[derive(Clone, PartialEq, prost::Message)]
        struct JobIdOnly {
            #[prost(uint64, tag = "1")]
            id: u64,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        struct Bounds {
            #[prost(uint32, tag = "1")]
            format_version: u32,
            #[prost(message, repeated, tag = "2")]
            jobs: Vec<JobIdOnly>,
            #[prost(uint64, tag = "5")]
            next_job_id: u64,
            #[prost(uint64, tag = "50")]
            segments_archived_below: u64,
        }
        let b = Bounds::decode(bytes)?;
        check_version(b.format_version)?;
        let mut job_ids: Vec<corral_types::JobId> = b.jobs.into_iter().map(|j| j.id).collect();
        job_ids.sort_unstable();
        Ok(HotBounds { job_ids, next_job_id: b.next_job_id, segments_archived_below: b.segments_archived_below })
    }

    /// Whether job `id` belongs in the history after this hot state: archived before it.
    pub fn archived(&self, id: corral_types::JobId) -> bool {
        id < self.next_job_id && self.job_ids.binary_search(&id).is_err()
    }
}

/// What a snapshot record of the history is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryRecord {
    /// A billing segment (hot or archived), encoded as [`segment_to_bytes`] writes it.
    Segment,
    /// A job of the history, encoded as [`job_to_bytes`] writes it.
    ArchivedJob,
}

/// A snapshot failed to read: its source failed, or its bytes do not decode.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotReadError {
    #[error("reading the snapshot failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the snapshot does not decode: {0}")]
    Codec(#[from] CodecError),
}

/// Reads a snapshot from `reader` in one pass, without holding its history in memory: every
/// record of the history (every segment, hot ones included, and every archived job) goes to
/// `on_record` as it is read, still encoded; the other top-level fields are the hot state,
/// returned decoded with an empty ledger (the caller keeps the segments it needs).
pub fn read_snapshot<R: std::io::Read, E>(
    mut reader: R,
    mut on_record: impl FnMut(HistoryRecord, Vec<u8>) -> Result<(), E>,
) -> Result<State, E>
where
    E: From<SnapshotReadError>,
{
    use prost::encoding::{encode_key, encode_varint, WireType};
    use std::io::Read;
    let invalid = |value: &str| SnapshotReadError::from(CodecError::Invalid { field: "snapshot", value: value.into() });
    let mut rest = Vec::new();
    while let Some(key) = read_varint(&mut reader)? {
        let field = u32::try_from(key >> 3)
            .ok()
            .filter(|f| (prost::encoding::MIN_TAG..=prost::encoding::MAX_TAG).contains(f))
            .ok_or_else(|| invalid("a bad field key"))?;
        let wire = WireType::try_from(key & 7).map_err(|_| invalid("a bad wire type"))?;
        match wire {
            WireType::Varint => {
                let v = read_varint(&mut reader)?.ok_or_else(|| invalid("a truncated field"))?;
                encode_key(field, wire, &mut rest);
                encode_varint(v, &mut rest);
            }
            WireType::LengthDelimited => {
                let len = read_varint(&mut reader)?.ok_or_else(|| invalid("a truncated field"))?;
                // Read as it arrives, never allocated up front from a length that may be corrupt.
                let mut record = Vec::new();
                (&mut reader).take(len).read_to_end(&mut record).map_err(SnapshotReadError::from)?;
                if record.len() as u64 != len {
                    return Err(invalid("a truncated field").into());
                }
                match field {
                    SNAPSHOT_SEGMENTS_FIELD => on_record(HistoryRecord::Segment, record)?,
                    SNAPSHOT_ARCHIVED_JOBS_FIELD => on_record(HistoryRecord::ArchivedJob, record)?,
                    _ => {
                        encode_key(field, wire, &mut rest);
                        encode_varint(len, &mut rest);
                        rest.extend_from_slice(&record);
                    }
                }
            }
            WireType::SixtyFourBit | WireType::ThirtyTwoBit => {
                let mut fixed = [0u8; 8];
                let n = if wire == WireType::SixtyFourBit { 8 } else { 4 };
                reader.read_exact(&mut fixed[..n]).map_err(|_| invalid("a truncated field"))?;
                encode_key(field, wire, &mut rest);
                rest.extend_from_slice(&fixed[..n]);
            }
            WireType::StartGroup | WireType::EndGroup => return Err(invalid("a group field").into()),
        }
    }
    let snapshot =
        pb::StateSnapshot::decode(rest.as_slice()).map_err(CodecError::from).map_err(SnapshotReadError::from)?;
    Ok(state_from_snapshot_pb(snapshot).map_err(SnapshotReadError::from)?)
}

/// A protobuf varint from `reader`; `None` at the end of the input before its first byte.
fn read_varint(reader: &mut impl std::io::Read) -> Result<Option<u64>, SnapshotReadError> {
    let mut value = 0u64;
    for i in 0..10 {
        let mut byte = [0u8; 1];
        if reader.read(&mut byte)? == 0 {
            if i == 0 {
                return Ok(None);
            }
            return Err(CodecError::Invalid { field: "snapshot", value: "a truncated varint".into() }.into());
        }
        value |= u64::from(byte[0] & 0x7f) << (7 * i);
        if byte[0] & 0x80 == 0 {
            return Ok(Some(value));
        }
    }
    Err(CodecError::Invalid { field: "snapshot", value: "a varint longer than 10 bytes".into() }.into())
}

/// Encodes the hot state for a snapshot (the history is appended by the store).
pub fn snapshot_to_bytes(s: &State) -> Vec<u8> {
    encode_snapshot(s, true, &mut JobEncodings::default())
}

/// Encodes the hot state without its request ids, which a store keeps in files of their own
/// (see [`request_id_entries_to_bytes`]), reusing the encodings of jobs that did not change
/// since the last call with `jobs`.
pub fn snapshot_without_request_ids_to_bytes(s: &State, jobs: &mut JobEncodings) -> Vec<u8> {
    encode_snapshot(s, false, jobs)
}

/// The encoded jobs of the last snapshot built, with a `Weak` of the job each encodes. While a
/// `Weak` is held, a change to the job moves it into a new `Arc` (`Arc::make_mut`, see
/// `corral_core::Jobs`) and its old allocation is not reused: a job at the same address is
/// unchanged and its bytes are reused. A `Weak` keeps no job's contents alive.
#[derive(Default)]
pub struct JobEncodings(std::collections::HashMap<corral_types::JobId, (std::sync::Weak<Job>, Vec<u8>)>);

impl JobEncodings {
    /// Jobs held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn encode_snapshot(s: &State, with_request_ids: bool, cache: &mut JobEncodings) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    // In field order, which is how prost would write the whole message: the version, the jobs
    // one by one (an unchanged job's bytes come from `cache`), the nodes, the request-id table
    // written straight from the state (up to a day of ids: no message per id is built), then
    // the fields after it.
    let mut buf = pb::StateSnapshot { format_version: SNAPSHOT_FORMAT_VERSION, ..Default::default() }.encode_to_vec();
    let mut encoded = std::collections::HashMap::with_capacity(s.jobs.len());
    for (id, job) in s.jobs.shared() {
        let bytes = match cache.0.remove(id) {
            Some((held, bytes)) if std::ptr::eq(held.as_ptr(), std::sync::Arc::as_ptr(job)) => bytes,
            _ => pb::Job::from(&**job).encode_to_vec(),
        };
        encode_key(2, WireType::LengthDelimited, &mut buf);
        encode_varint(bytes.len() as u64, &mut buf);
        buf.extend_from_slice(&bytes);
        encoded.insert(*id, (std::sync::Arc::downgrade(job), bytes));
    }
    cache.0 = encoded;
    pb::StateSnapshot { nodes: s.nodes.values().map(node_status_to_pb).collect(), ..Default::default() }
        .encode(&mut buf)
        .expect("a Vec grows as needed");
    if with_request_ids {
        encode_request_ids(s, &mut buf);
    }
    pb::StateSnapshot {
        next_job_id: s.next_job_id,
        request_ids_expired_before: s.request_ids_expired_before.0,
        next_epoch: s.next_epoch,
        last_ts: s.last_ts.0,
        config: Some(config_to_pb(&s.config)),
        coordinators: coordinators_to_pb(s),
        tso_window_end_ms: s.tso_window_end_ms,
        usage: usage_to_pb(&s.usage),
        segments: s.ledger.values().map(segment_to_pb).collect(),
        next_segment_id: s.next_segment_id,
        tokens: tokens_to_pb(s),
        next_token_id: s.next_token_id,
        policy_version: s.policy_version,
        policy_history: policy_history_to_pb(s),
        join_tokens: join_tokens_to_pb(s),
        next_join_token_id: s.next_join_token_id,
        segments_archived_below: s.segments_archived_below,
        archived_billed: billed_to_pb(&s.archived_billed),
        ..Default::default()
    }
    .encode(&mut buf)
    .expect("a Vec grows as needed");
    buf
}

/// Field `request_id_table` of `StateSnapshot`: one fixed-size entry per request id, in key
/// order, as prost writes a `bytes` field (left out when empty, as proto3 does).
fn encode_request_ids(s: &State, buf: &mut Vec<u8>) {
    if s.request_ids.is_empty() {
        return;
    }
    let len = s.request_ids.len() * REQUEST_ID_ENTRY_BYTES;
    buf.extend_from_slice(&request_id_table_key(len as u64));
    buf.reserve(len);
    request_id_entries_to_bytes(s.request_ids.iter().map(|(k, r)| (*k, *r)), buf);
}

/// The key and length that start a snapshot's `request_id_table` field of `len` bytes: a store
/// that keeps request ids in files of their own writes this, then the files' entries, after a
/// body encoded without them.
pub fn request_id_table_key(len: u64) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    let mut buf = Vec::with_capacity(12);
    encode_key(SNAPSHOT_REQUEST_ID_TABLE_FIELD, WireType::LengthDelimited, &mut buf);
    encode_varint(len, &mut buf);
    buf
}

/// Appends request ids as entries of a `request_id_table` ([`REQUEST_ID_ENTRY_BYTES`] each).
pub fn request_id_entries_to_bytes(entries: impl IntoIterator<Item = (RequestKey, RequestRecord)>, out: &mut Vec<u8>) {
    for (key, record) in entries {
        out.extend_from_slice(&key.0);
        out.extend_from_slice(&record.job_id.to_le_bytes());
        out.extend_from_slice(&record.at.0.to_le_bytes());
    }
}

/// Decodes entries [`request_id_entries_to_bytes`] wrote.
pub fn request_id_entries_from_bytes(bytes: &[u8]) -> Result<Vec<(RequestKey, RequestRecord)>, CodecError> {
    if !bytes.len().is_multiple_of(REQUEST_ID_ENTRY_BYTES) {
        return Err(CodecError::Invalid {
            field: "request_id_table",
            value: format!("{} bytes, not a multiple of {REQUEST_ID_ENTRY_BYTES}", bytes.len()),
        });
    }
    let u64_at = |entry: &[u8], at: usize| u64::from_le_bytes(entry[at..at + 8].try_into().expect("8 bytes"));
    Ok(bytes
        .chunks_exact(REQUEST_ID_ENTRY_BYTES)
        .map(|entry| {
            let key = RequestKey(entry[..16].try_into().expect("16 bytes"));
            (key, RequestRecord { job_id: u64_at(entry, 16), at: Timestamp(u64_at(entry, 24)) })
        })
        .collect())
}

/// The request ids of a snapshot: its table, and the string entries of version 2 snapshots.
fn request_ids_from_pb(
    table: &[u8],
    entries: Vec<pb::RequestIdEntry>,
) -> Result<Vec<(RequestKey, RequestRecord)>, CodecError> {
    let mut ids = request_id_entries_from_bytes(table)?;
    ids.extend(
        entries
            .into_iter()
            .map(|e| (RequestKey::of(&e.request_id), RequestRecord { job_id: e.job_id, at: Timestamp(e.at) })),
    );
    Ok(ids)
}

fn billed_to_pb(billed: &BTreeMap<String, BilledTotal>) -> Vec<pb::BilledTotal> {
    billed
        .iter()
        .map(|(tenant, t)| pb::BilledTotal {
            tenant: tenant.clone(),
            cost_micros: t.cost_micros,
            gpu_milli_ms_high: (t.gpu_milli_ms >> 64) as u64,
            gpu_milli_ms_low: t.gpu_milli_ms as u64,
        })
        .collect()
}

fn billed_from_pb(records: Vec<pb::BilledTotal>) -> BTreeMap<String, BilledTotal> {
    records
        .into_iter()
        .map(|t| {
            let gpu_milli_ms = (u128::from(t.gpu_milli_ms_high) << 64) | u128::from(t.gpu_milli_ms_low);
            (t.tenant, BilledTotal { cost_micros: t.cost_micros, gpu_milli_ms })
        })
        .collect()
}

fn policy_history_to_pb(s: &State) -> Vec<pb::PolicyRecord> {
    s.policy_history
        .iter()
        .map(|r| pb::PolicyRecord {
            version: r.version,
            ts: r.ts.0,
            by: r.by.clone(),
            changes: r.changes.clone(),
            cancelled: r.cancelled.clone(),
        })
        .collect()
}

/// Encodes one policy history record (as stores of earlier versions kept it per version; the
/// policy history now travels in snapshots).
pub fn policy_record_to_bytes(r: &PolicyRecord) -> Vec<u8> {
    pb::PolicyRecord {
        version: r.version,
        ts: r.ts.0,
        by: r.by.clone(),
        changes: r.changes.clone(),
        cancelled: r.cancelled.clone(),
    }
    .encode_to_vec()
}

/// Decodes what [`policy_record_to_bytes`] wrote.
pub fn policy_record_from_bytes(bytes: &[u8]) -> Result<PolicyRecord, CodecError> {
    Ok(policy_history_from_pb(vec![pb::PolicyRecord::decode(bytes)?]).remove(0))
}

fn policy_history_from_pb(records: Vec<pb::PolicyRecord>) -> Vec<PolicyRecord> {
    records
        .into_iter()
        .map(|r| PolicyRecord {
            version: r.version,
            ts: Timestamp(r.ts),
            by: r.by,
            changes: r.changes,
            cancelled: r.cancelled,
        })
        .collect()
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

/// Decodes the hot state of a snapshot, its hot segments in the ledger (see [`read_snapshot`] to
/// read its history too).
pub fn snapshot_from_bytes(bytes: &[u8]) -> Result<State, CodecError> {
    let mut segments = Vec::new();
    let read = read_snapshot(bytes, |kind, record| {
        if kind == HistoryRecord::Segment {
            segments.push(segment_from_bytes(&record)?);
        }
        Ok::<(), SnapshotReadError>(())
    });
    let mut state = read.map_err(|e| match e {
        SnapshotReadError::Codec(e) => e,
        SnapshotReadError::Io(e) => CodecError::Invalid { field: "snapshot", value: e.to_string() },
    })?;
    for segment in segments.into_iter().filter(|g| g.id >= state.segments_archived_below) {
        state.ledger.insert(segment.id, segment);
    }
    Ok(state)
}

/// The state of a snapshot message whose segments and archived jobs were set aside.
fn state_from_snapshot_pb(s: pb::StateSnapshot) -> Result<State, CodecError> {
    check_version(s.format_version)?;
    let jobs =
        s.jobs.into_iter().map(|j| Job::try_from(j).map(|j| (j.id, j))).collect::<Result<BTreeMap<_, _>, _>>()?;
    let nodes = s
        .nodes
        .into_iter()
        .map(|n| node_status_from_pb(n).map(|n| (n.spec.name.clone(), n)))
        .collect::<Result<BTreeMap<_, _>, _>>()?;
    let request_ids = request_ids_from_pb(&s.request_id_table, s.request_ids)?;
    let mut state = State::from_parts(
        jobs,
        nodes,
        [],
        s.next_job_id,
        s.next_epoch,
        Timestamp(s.last_ts),
        s.config.map(config_from_pb).unwrap_or_default(),
        coordinators_from_pb(s.coordinators),
        s.tso_window_end_ms,
    );
    state.request_ids_expired_before = Timestamp(s.request_ids_expired_before);
    state.add_request_ids(request_ids);
    state.usage = usage_from_pb(s.usage);
    state.next_segment_id = s.next_segment_id.max(1);
    state.segments_archived_below = s.segments_archived_below;
    state.archived_billed = billed_from_pb(s.archived_billed);
    state.tokens = tokens_from_pb(s.tokens);
    state.next_token_id = s.next_token_id.max(1);
    state.policy_version = s.policy_version;
    state.policy_history = policy_history_from_pb(s.policy_history);
    state.join_tokens = join_tokens_from_pb(s.join_tokens);
    state.next_join_token_id = s.next_join_token_id;
    Ok(state)
}

fn join_tokens_to_pb(s: &State) -> Vec<pb::JoinTokenRecord> {
    s.join_tokens
        .values()
        .map(|t| pb::JoinTokenRecord {
            id: t.id,
            sha256: t.sha256.clone(),
            created: t.created.0,
            expires_at_ms: t.expires_at_ms,
            used: t.used.as_ref().map(|u| pb::JoinTokenUse {
                node: u.node.clone(),
                public_key_sha256: u.public_key_sha256.clone(),
                at: u.at.0,
            }),
        })
        .collect()
}

fn join_tokens_from_pb(records: Vec<pb::JoinTokenRecord>) -> BTreeMap<u64, JoinTokenRecord> {
    records
        .into_iter()
        .map(|t| {
            let used = t.used.map(|u| JoinTokenUse {
                node: u.node,
                public_key_sha256: u.public_key_sha256,
                at: Timestamp(u.at),
            });
            let record = JoinTokenRecord {
                id: t.id,
                sha256: t.sha256,
                created: Timestamp(t.created),
                expires_at_ms: t.expires_at_ms,
                used,
            };
            (t.id, record)
        })
        .collect()
}

fn tokens_to_pb(s: &State) -> Vec<pb::TokenRecord> {
    s.tokens
        .values()
        .map(|t| pb::TokenRecord {
            id: t.id,
            tenant: t.tenant.clone(),
            admin: t.admin,
            sha256: t.sha256.clone(),
            created: t.created.0,
            expires_at_ms: t.expires_at_ms,
            revoked: t.revoked,
        })
        .collect()
}

fn tokens_from_pb(records: Vec<pb::TokenRecord>) -> BTreeMap<u64, TokenRecord> {
    records
        .into_iter()
        .map(|t| {
            let record = TokenRecord {
                id: t.id,
                tenant: t.tenant,
                admin: t.admin,
                sha256: t.sha256,
                created: Timestamp(t.created),
                expires_at_ms: t.expires_at_ms,
                revoked: t.revoked,
            };
            (t.id, record)
        })
        .collect()
}

/// Encodes one job (persisted per key in the state machine store).
pub fn job_to_bytes(j: &Job) -> Vec<u8> {
    pb::Job::from(j).encode_to_vec()
}

/// Decodes one job written by [`job_to_bytes`].
pub fn job_from_bytes(bytes: &[u8]) -> Result<Job, CodecError> {
    pb::Job::decode(bytes)?.try_into()
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
        segments_archived_below: s.segments_archived_below,
        archived_billed: billed_from_pb(s.archived_billed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step spec with every field set.
    fn test_step_spec() -> corral_types::StepSpec {
        corral_types::StepSpec {
            command: vec!["python".into(), "train.py".into()],
            env: [("SLURM_JOB_ID".to_string(), "4".to_string())].into(),
            cwd: Some("/home/ana".into()),
            ntasks: Some(4),
            nodes: Some(2),
            ntasks_per_node: Some(2),
            gpus_per_task: Some(1),
            cpus_per_task: Some(8),
            nodelist: vec!["n1".into(), "n2".into()],
            overlap: true,
            kill_on_bad_exit: true,
        }
    }

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
            sched: SchedOptions {
                gpus_per_node: None,
                rdma: true,
                no_requeue: true,
                checkpoint_signal: Some(10),
                ..Default::default()
            },
            ..Default::default()
        };
        let req = Request { ts: Timestamp(77), command: Command::SubmitJob { request_id: "r".into(), spec } };
        assert_eq!(command_from_bytes(&command_to_bytes(&req)).unwrap(), req);

        let mut state = State::default();
        state.apply(&Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) }).unwrap();
        state.apply(&req).unwrap();
        let back = snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap();
        assert_eq!(back, state);
        assert_eq!(back.pending_jobs().count(), 1, "derived index rebuilt");
        let bounds = HotBounds::from_snapshot(&snapshot_to_bytes(&state)).unwrap();
        assert_eq!(bounds, HotBounds::of(&state), "the bounds decode without the rest");
        assert!(!bounds.archived(1) && !bounds.archived(2), "a hot job and a job not yet submitted");
        // The request-id table is written straight from the state, byte for byte as prost
        // would write the field.
        let mut table = Vec::new();
        for (key, record) in state.request_ids.iter() {
            table.extend_from_slice(&key.0);
            table.extend_from_slice(&record.job_id.to_le_bytes());
            table.extend_from_slice(&record.at.0.to_le_bytes());
        }
        assert_eq!(table.len(), REQUEST_ID_ENTRY_BYTES);
        assert_eq!(&table[..16], &RequestKey::of("r").0, "keyed by the id's SHA-256");
        let whole = pb::StateSnapshot { request_id_table: table, ..Default::default() };
        let mut part = Vec::new();
        encode_request_ids(&state, &mut part);
        assert_eq!(part, whole.encode_to_vec());
        // A table cut short is refused, not read as fewer ids.
        let mut cut = pb::StateSnapshot::decode(snapshot_to_bytes(&state).as_slice()).unwrap();
        cut.request_id_table.pop();
        assert!(snapshot_from_bytes(&cut.encode_to_vec()).is_err());
    }

    /// A build reuses the bytes of the jobs that did not change since the last one and encodes
    /// the rest again: the result is what a fresh encode writes.
    #[test]
    fn unchanged_jobs_are_not_encoded_again() {
        let mut state = State::default();
        state.apply(&Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) }).unwrap();
        let spec = JobSpec { tenant: "default".into(), command: vec!["true".into()], ..Default::default() };
        let jobs = (0..3).map(|i| (format!("r{i}"), spec.clone())).collect();
        state.apply(&Request { ts: Timestamp(2), command: Command::SubmitJobs { jobs } }).unwrap();
        let mut cache = JobEncodings::default();
        let first = snapshot_without_request_ids_to_bytes(&state, &mut cache);
        assert_eq!(first, snapshot_without_request_ids_to_bytes(&state, &mut JobEncodings::default()));
        assert_eq!(cache.len(), 3);
        let cancel = Command::CancelJob { job_id: 2, reason: "changed".into() };
        state.apply(&Request { ts: Timestamp(3), command: cancel }).unwrap();
        let held = |cache: &JobEncodings, id: u64| cache.0[&id].0.as_ptr();
        let (one, two) = (held(&cache, 1), held(&cache, 2));
        let second = snapshot_without_request_ids_to_bytes(&state, &mut cache);
        assert_eq!(second, snapshot_without_request_ids_to_bytes(&state, &mut JobEncodings::default()));
        assert_ne!(first, second, "the cancelled job is encoded again");
        assert_eq!(one, held(&cache, 1), "an unchanged job keeps its bytes");
        assert_ne!(two, held(&cache, 2), "a changed job moved to a new Arc");
        let back = snapshot_from_bytes(&second).unwrap();
        assert_eq!(back.jobs, state.jobs);
    }

    #[test]
    fn policies_and_node_modes_round_trip_through_commands_snapshots_and_meta() {
        let mut config = ClusterConfig::dev_defaults();
        let team = config.tenant_policies.get_mut("team-a").unwrap();
        team.max_running_jobs = Some(3);
        team.max_pending_jobs = Some(30);
        let normal = config.priority_classes.get_mut("normal").unwrap();
        normal.default_time_secs = Some(60);
        normal.max_time_secs = Some(3600);
        let node = NodeSpec {
            name: "n1".into(),
            address: "a:1".into(),
            gpus: vec![],
            cpu_millis: 1000,
            memory_bytes: 1 << 30,
            labels: vec![],
            rendezvous_ports: None,
        };
        let commands = [
            Command::ApplyPolicy { config: ClusterConfig::dev_defaults(), by: "cluster init".into(), force: false },
            Command::RegisterNode { spec: node },
            Command::ApplyPolicy { config, by: "admin (token 1)".into(), force: true },
            Command::SetNodeMode {
                node: "n1".into(),
                mode: NodeMode::Draining,
                reason: "disk swap".into(),
                drain_deadline: Some(Timestamp(77)),
            },
            Command::EvictDrainedJobs { node: "n1".into() },
            Command::SetNodeMode {
                node: "n1".into(),
                mode: NodeMode::Cordoned,
                reason: "r".into(),
                drain_deadline: None,
            },
            Command::HoldJob { job_id: 4, hold: true },
            Command::RequeueJob { job_id: 4 },
            Command::SignalJob { job_id: 4, signal: 10 },
            Command::UpdateJob {
                job_id: 4,
                update: JobUpdate {
                    time_limit_secs: Some(60),
                    priority_class: Some("normal".into()),
                    gpus: Some(2),
                    name: Some("n".into()),
                },
                admin: true,
            },
            Command::CancelArrayTask { array: 4, index: 7, reason: "r".into() },
            Command::CancelJobs { job_ids: vec![1, 2], reason: "bulk".into() },
            Command::CreateStep { job_id: 4, epoch: 9, request_id: "srun-1".into(), spec: test_step_spec() },
            Command::StepEnded {
                job_id: 4,
                epoch: 9,
                step: 2,
                end: corral_types::StepNodeEnd {
                    node: "n2".into(),
                    tasks: vec![corral_types::TaskExit { task: 3, exit_code: None, signal: Some(9) }],
                    launch_error: Some("no python".into()),
                },
            },
            Command::SignalStep { job_id: 4, step: 2, signal: 2 },
            Command::Compact(CompactCutoffs {
                archive_before: Timestamp(3),
                request_ids_before: Timestamp(2),
                jobs_before: Some(Timestamp(1)),
                segments_before: None,
            }),
        ];
        let mut state = State::default();
        for (i, command) in commands.into_iter().enumerate() {
            let request = Request { ts: Timestamp(i as u64 + 1), command };
            assert_eq!(command_from_bytes(&command_to_bytes(&request)).unwrap(), request);
            let _ = state.apply(&request);
        }
        assert_eq!((state.policy_version, state.policy_history.len()), (2, 2));
        assert_eq!(state.nodes["n1"].mode, NodeMode::Cordoned);
        assert_eq!(snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap(), state);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!(meta.policy_version, 2);
        for record in &state.policy_history {
            assert_eq!(&policy_record_from_bytes(&policy_record_to_bytes(record)).unwrap(), record);
        }
        assert_eq!(node_from_bytes(&node_to_bytes(&state.nodes["n1"])).unwrap(), state.nodes["n1"]);
        let remove = Request { ts: Timestamp(9), command: Command::RemoveNode { node: "n1".into() } };
        assert_eq!(command_from_bytes(&command_to_bytes(&remove)).unwrap(), remove);
    }

    #[test]
    fn tokens_round_trip_through_commands_snapshots_and_meta() {
        let hash: String = std::iter::repeat_n('e', 64).collect();
        let commands = [
            Command::Configure(ClusterConfig::dev_defaults()),
            Command::CreateToken { tenant: "team-a".into(), admin: false, sha256: hash, expires_at_ms: Some(99) },
            Command::CreateToken { tenant: String::new(), admin: true, sha256: "f".repeat(64), expires_at_ms: None },
            Command::RevokeToken { token_id: 2 },
        ];
        let mut state = State::default();
        for (i, command) in commands.into_iter().enumerate() {
            let request = Request { ts: Timestamp(i as u64 + 1), command };
            assert_eq!(command_from_bytes(&command_to_bytes(&request)).unwrap(), request);
            state.apply(&request).unwrap();
        }
        assert_eq!(state.tokens.len(), 2);
        assert_eq!(snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap(), state);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!((meta.tokens, meta.next_token_id), (state.tokens.clone(), state.next_token_id));
    }

    #[test]
    fn join_tokens_round_trip_through_commands_snapshots_and_meta() {
        let hour = 3_600_000;
        let commands = [
            Command::CreateJoinToken { sha256: "a".repeat(64), ttl_ms: hour },
            Command::CreateJoinToken { sha256: "b".repeat(64), ttl_ms: hour },
            Command::ConsumeJoinToken {
                sha256: "a".repeat(64),
                node: "gpu-1".into(),
                public_key_sha256: "c".repeat(64),
            },
        ];
        let mut state = State::default();
        for (i, command) in commands.into_iter().enumerate() {
            let request = Request { ts: Timestamp::compose(1_000 + i as u64, 0), command };
            assert_eq!(command_from_bytes(&command_to_bytes(&request)).unwrap(), request);
            state.apply(&request).unwrap();
        }
        assert!(state.join_tokens[&1].used.is_some() && state.join_tokens[&2].used.is_none());
        assert_eq!(snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap(), state);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!((meta.join_tokens, meta.next_join_token_id), (state.join_tokens.clone(), state.next_join_token_id));
    }

    #[test]
    fn scheduling_commands_and_state_round_trip() {
        let schedule = Request {
            ts: Timestamp(5),
            command: Command::Schedule {
                placements: vec![
                    Placement {
                        job_id: 1,
                        node: "n1".into(),
                        gpus: vec![0, 1],
                        more_nodes: vec![NodeGpus { node: "n2".into(), gpus: vec![2, 3] }],
                        slice: None,
                    },
                    Placement {
                        job_id: 2,
                        node: "n3".into(),
                        gpus: vec![4],
                        more_nodes: vec![],
                        slice: Some(SliceAssignment::Mig {
                            profile: "3g.40gb".into(),
                            start: 4,
                            memory_slices: 4,
                            compute_slices: 3,
                        }),
                    },
                ],
                preemptions: vec![Preemption { job_id: 7, by: 1, grace_secs: 30 }],
            },
        };
        assert_eq!(command_from_bytes(&command_to_bytes(&schedule)).unwrap(), schedule);
        let preempt = Request { ts: Timestamp(6), command: Command::PreemptJob { job_id: 7, by: 1, grace_secs: 9 } };
        assert_eq!(command_from_bytes(&command_to_bytes(&preempt)).unwrap(), preempt);
        let part = Request {
            ts: Timestamp(7),
            command: Command::JobFinished {
                job_id: 1,
                epoch: 3,
                node: "n2".into(),
                report: JobExitReport { exit_code: Some(0), run_time_ms: 10, ..Default::default() },
            },
        };
        assert_eq!(command_from_bytes(&command_to_bytes(&part)).unwrap(), part);
        // A gang whose parts ended apart keeps how each ended (a lost node has no report).
        let job = Job {
            id: 1,
            spec: JobSpec { name: "g".into(), command: vec!["true".into()], ..JobSpec::default() },
            state: JobState::Running,
            request_id: "r".into(),
            submitted_at: Timestamp(1),
            admitted_at: None,
            started_at: None,
            finished_at: None,
            allocation: Some(Allocation {
                node: "n1".into(),
                gpus: vec![0],
                epoch: 3,
                more_nodes: vec![NodeGpus { node: "n2".into(), gpus: vec![1] }],
                slice: None,
                ended: vec![
                    PartEnd {
                        node: "n2".into(),
                        report: Some(JobExitReport { exit_code: Some(1), ..Default::default() }),
                    },
                    PartEnd { node: "n1".into(), report: None },
                ],
                price_breaks: vec![PriceBreak {
                    at: Timestamp(7),
                    price_micros_per_gpu_hour: 890_000,
                    multiplier_milli: 400,
                    policy_version: 2,
                }],
                master_port: None,
            }),
            preemption: None,
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: corral_types::JobSteps {
                next_id: 7,
                dropped: 5,
                steps: vec![
                    corral_types::JobStep {
                        id: 5,
                        epoch: 3,
                        request_id: "srun-5".into(),
                        spec: corral_types::StepSpec { command: vec!["hostname".into()], ..Default::default() },
                        nodes: vec![corral_types::StepNode {
                            node: "n1".into(),
                            first_task: 0,
                            tasks: 2,
                            gpus: vec![],
                        }],
                        state: corral_types::StepState::Failed,
                        created_at: Timestamp(4),
                        ended_at: Some(Timestamp(6)),
                        exit_code: Some(137),
                        reason: Some("exit code 137".into()),
                        ended: vec![corral_types::StepNodeEnd {
                            node: "n1".into(),
                            tasks: vec![corral_types::TaskExit { task: 1, exit_code: None, signal: Some(9) }],
                            launch_error: None,
                        }],
                        signals: vec![2, 15],
                        stopping: true,
                    },
                    corral_types::JobStep {
                        id: 6,
                        epoch: 3,
                        request_id: "srun-6".into(),
                        spec: test_step_spec(),
                        nodes: vec![corral_types::StepNode {
                            node: "n1".into(),
                            first_task: 0,
                            tasks: 1,
                            gpus: vec![1, 0],
                        }],
                        created_at: Timestamp(5),
                        ..Default::default()
                    },
                ],
            },
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 1,
            worker_run_time_ms: None,
        };
        assert_eq!(Job::try_from(pb::Job::from(&job)).unwrap(), job);

        // A running MPS job being preempted, fair-share usage, quotas and topology survive a snapshot.
        let mut config = ClusterConfig::dev_defaults();
        config.tenant_policies.get_mut("team-a").unwrap().class_quotas.insert("normal".into(), 2000);
        config.scheduler.backfill_reservations = 2;
        let node = NodeSpec {
            name: "n1".into(),
            address: "a:1".into(),
            gpus: vec![GpuDevice {
                index: 0,
                uuid: "GPU-0".into(),
                model: "RTX 5090".into(),
                memory_mib: 32768,
                numa_node: Some(1),
                pci_switch: Some("0000:3a".into()),
                rdma_nic: Some("mlx5_0".into()),
                mig_capable: false,
            }],
            cpu_millis: 8000,
            memory_bytes: 1 << 34,
            labels: vec![],
            rendezvous_ports: None,
        };
        let mut state = State::default();
        let apply = |state: &mut State, ts: u64, command: Command| state.apply(&Request { ts: Timestamp(ts), command });
        apply(&mut state, 1, Command::Configure(config)).unwrap();
        apply(&mut state, 2, Command::RegisterNode { spec: node }).unwrap();
        let mut low = JobSpec {
            name: "low".into(),
            tenant: "team-a".into(),
            priority_class: "preemptible".into(),
            gpu_slice: Some(GpuSlice::Mps { thread_percent: 50, memory_mib: None }),
            command: vec!["true".into()],
            ..JobSpec::default()
        };
        apply(&mut state, 3, Command::SubmitJob { request_id: "a".into(), spec: low.clone() }).unwrap();
        low.priority_class = "gpu-high-priority".into();
        low.gpu_slice = Some(GpuSlice::Mps { thread_percent: 80, memory_mib: None });
        apply(&mut state, 4, Command::SubmitJob { request_id: "b".into(), spec: low }).unwrap();
        apply(&mut state, 5, Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: vec![0] }).unwrap();
        apply(&mut state, 6, Command::JobStarted { job_id: 1, epoch: 2 }).unwrap();
        apply(&mut state, 7, Command::PreemptJob { job_id: 1, by: 2, grace_secs: 30 }).unwrap();
        state.usage.tenants.insert("team-a".into(), [(0, 5000), (60_000, 7000)].into());
        let back = snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap();
        assert_eq!(back, state);
        assert!(back.jobs[&1].allocation.as_ref().unwrap().slice.is_some());
        assert_eq!(back.preempting_jobs().map(|j| j.id).collect::<Vec<_>>(), vec![1]);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!((meta.usage, meta.config), (state.usage.clone(), state.config.clone()));
        assert_eq!(job_from_bytes(&job_to_bytes(&state.jobs[&1])).unwrap(), state.jobs[&1]);
    }

    #[test]
    fn garbage_and_future_versions_are_refused() {
        assert!(command_from_bytes(&[0xff, 0xff, 0xff]).is_err());
        let future = pb::Command { format_version: 99, ts: 1, kind: Some(pb::command::Kind::Noop(true)) };
        assert!(matches!(command_from_bytes(&future.encode_to_vec()), Err(CodecError::Version { found: 99, .. })));
    }
}
