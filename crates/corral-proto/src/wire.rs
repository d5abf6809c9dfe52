//! Conversions between the wire messages of `corral.v1` (user API, worker protocol) and the
//! domain types of corral-types. Decoding is fallible: a peer can send anything.

mod step;

use crate::v1 as pb;
use corral_types::{
    Allocation, ArrayProgress, ArrayRange, ArraySpec, ArrayTask, Dependency, DependencyKind, GpuDevice, GpuHealth,
    GpuSlice, Job, JobExitReport, JobSpec, JobState, NodeGpus, NodeSpec, PartEnd, PreemptionNotice, SchedOptions,
    Segment, SliceAssignment, SlurmNames, TaskLayout, Timestamp,
};

/// A wire message that does not convert into a valid domain value.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("missing field '{0}'")]
    Missing(&'static str),
    #[error("invalid value of '{field}': {value}")]
    Invalid { field: &'static str, value: String },
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
            command: s.command.to_vec(),
            env: (*s.env).clone(),
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
            script: s.script.as_deref().map(String::from),
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
            image_digest: s.image_digest.clone(),
            layout: (!s.layout.is_default()).then(|| layout_to_pb(&s.layout)),
            batch_step: s.batch_step,
            slurm: (!s.slurm.is_default()).then(|| slurm_names_to_pb(&s.slurm)),
            append_output: s.append_output,
            container: (!s.container.is_default()).then(|| container_to_pb(&s.container)),
            session: s.session.as_ref().map(|o| pb::SessionOptions {
                idle_timeout_secs: o.idle_timeout_secs,
                min_gpu_util_pct: o.min_gpu_util_pct,
            }),
        }
    }
}

fn layout_to_pb(l: &TaskLayout) -> pb::TaskLayout {
    pb::TaskLayout {
        nodes: l.nodes,
        ntasks: l.ntasks,
        ntasks_per_node: l.ntasks_per_node,
        cpus_per_task: l.cpus_per_task,
        gpus_per_task: l.gpus_per_task,
        cpus_per_gpu: l.cpus_per_gpu,
        mem_per_cpu: l.mem_per_cpu,
        mem_per_gpu: l.mem_per_gpu,
        exclusive: l.exclusive,
        gpu_type: l.gpu_type.clone(),
        submitted_shape: l.submitted_shape.map(|o| pb::SubmittedShape {
            gpus: o.gpus,
            cpu_millis: o.cpu_millis,
            memory_bytes: o.memory_bytes,
        }),
    }
}

fn layout_from_pb(l: pb::TaskLayout) -> TaskLayout {
    TaskLayout {
        nodes: l.nodes,
        ntasks: l.ntasks,
        ntasks_per_node: l.ntasks_per_node,
        cpus_per_task: l.cpus_per_task,
        gpus_per_task: l.gpus_per_task,
        cpus_per_gpu: l.cpus_per_gpu,
        mem_per_cpu: l.mem_per_cpu,
        mem_per_gpu: l.mem_per_gpu,
        exclusive: l.exclusive,
        gpu_type: l.gpu_type,
        submitted_shape: l.submitted_shape.map(|o| corral_types::SubmittedShape {
            gpus: o.gpus,
            cpu_millis: o.cpu_millis,
            memory_bytes: o.memory_bytes,
        }),
    }
}

fn container_to_pb(c: &corral_types::ContainerOptions) -> pb::ContainerOptions {
    pb::ContainerOptions {
        mounts: c
            .mounts
            .iter()
            .map(|m| pb::ContainerMount { source: m.source.clone(), target: m.target.clone(), read_only: m.read_only })
            .collect(),
        workdir: c.workdir.clone(),
        env: c.env.clone(),
    }
}

fn container_from_pb(c: pb::ContainerOptions) -> corral_types::ContainerOptions {
    corral_types::ContainerOptions {
        mounts: c
            .mounts
            .into_iter()
            .map(|m| corral_types::ContainerMount { source: m.source, target: m.target, read_only: m.read_only })
            .collect(),
        workdir: c.workdir,
        env: c.env,
    }
}

fn slurm_names_to_pb(n: &SlurmNames) -> pb::SlurmNames {
    pb::SlurmNames {
        account: n.account.clone(),
        qos: n.qos.clone(),
        partition: n.partition.clone(),
        submit_dir: n.submit_dir.clone(),
        submit_host: n.submit_host.clone(),
        user: n.user.clone(),
    }
}

fn slurm_names_from_pb(n: pb::SlurmNames) -> SlurmNames {
    SlurmNames {
        account: n.account,
        qos: n.qos,
        partition: n.partition,
        submit_dir: n.submit_dir,
        submit_host: n.submit_host,
        user: n.user,
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
            command: s.command.into(),
            env: s.env.into(),
            sched: s
                .sched
                .map(|o| -> Result<SchedOptions, ProtoError> {
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
                            .collect::<Result<_, ProtoError>>()?,
                        singleton: o.singleton,
                        max_restarts: o.max_restarts,
                        node_selector: o.node_selector,
                        hold: o.hold,
                    })
                })
                .transpose()?
                .unwrap_or_default(),
            workdir: s.workdir,
            script: s.script.map(Into::into),
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
            image_digest: s.image_digest,
            layout: s.layout.map(layout_from_pb).unwrap_or_default(),
            batch_step: s.batch_step,
            slurm: s.slurm.map(slurm_names_from_pb).unwrap_or_default(),
            append_output: s.append_output,
            container: s.container.map(container_from_pb).unwrap_or_default(),
            session: s.session.map(|o| corral_types::SessionOptions {
                idle_timeout_secs: o.idle_timeout_secs,
                min_gpu_util_pct: o.min_gpu_util_pct,
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

fn dependency_kind_from_i32(v: i32) -> Result<DependencyKind, ProtoError> {
    match pb::DependencyKind::try_from(v) {
        Ok(pb::DependencyKind::AfterOk) => Ok(DependencyKind::AfterOk),
        Ok(pb::DependencyKind::AfterAny) => Ok(DependencyKind::AfterAny),
        Ok(pb::DependencyKind::AfterNotOk) => Ok(DependencyKind::AfterNotOk),
        _ => Err(ProtoError::Invalid { field: "dependency kind", value: v.to_string() }),
    }
}

// ---- allocations ----

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

fn slice_from_pb(s: pb::SliceAssignment) -> Result<SliceAssignment, ProtoError> {
    use pb::slice_assignment::Kind;
    Ok(match s.kind.ok_or(ProtoError::Missing("slice.kind"))? {
        Kind::Mig(m) => SliceAssignment::Mig {
            profile: m.profile,
            start: m.start,
            memory_slices: m.memory_slices,
            compute_slices: m.compute_slices,
        },
        Kind::Mps(m) => SliceAssignment::Mps { thread_percent: m.thread_percent, memory_mib: m.memory_mib },
    })
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

/// A `corral.v1.JobState` as corral-types' `JobState`; an unknown or unspecified value is
/// refused.
pub fn job_state_from_i32(v: i32) -> Result<JobState, ProtoError> {
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
                more_nodes: node_gpus_to_pb(&a.more_nodes),
                slice: a.slice.as_ref().map(slice_to_pb),
                master_port: a.master_port,
                ended: a
                    .ended
                    .iter()
                    .map(|e| pb::PartEnd { node: e.node.clone(), report: e.report.as_ref().map(Into::into) })
                    .collect(),
                ready: a.ready.clone(),
                idle: a.idle.clone(),
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
            allocation: j
                .allocation
                .map(|a| -> Result<Allocation, ProtoError> {
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
                        // The API does not carry pricing history; the segments do.
                        price_breaks: Vec::new(),
                        ready: a.ready,
                        idle: a.idle,
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
            gpu_faults: r
                .gpu_faults
                .iter()
                .map(|m| pb::GpuFault {
                    gpu: m.gpu,
                    reason: m.reason.clone(),
                    node_epoch: m.node_epoch,
                    seq: m.seq,
                    job_id: m.job_id,
                })
                .collect(),
            idle_end: r.idle_end.clone(),
        }
    }
}

/// At most this many card faults of one report are read (a node has fewer GPUs), each reason
/// cut to `MAX_GPU_FAULT_REASON` bytes: a report's cost is bounded whatever a worker sends.
pub const MAX_GPU_FAULTS: usize = 64;
pub const MAX_GPU_FAULT_REASON: usize = 256;

fn bounded_reason(mut reason: String) -> String {
    if reason.len() > MAX_GPU_FAULT_REASON {
        let mut end = MAX_GPU_FAULT_REASON;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    reason
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
            gpu_faults: r
                .gpu_faults
                .into_iter()
                .take(MAX_GPU_FAULTS)
                .map(|m| corral_types::GpuFaultMark {
                    gpu: m.gpu,
                    reason: bounded_reason(m.reason),
                    node_epoch: m.node_epoch,
                    seq: m.seq,
                    job_id: m.job_id,
                })
                .collect(),
            idle_end: r.idle_end.map(bounded_reason),
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

impl From<&GpuHealth> for pb::GpuHealth {
    fn from(g: &GpuHealth) -> Self {
        pb::GpuHealth {
            index: g.index,
            temperature_c: g.temperature_c,
            utilization_percent: g.utilization_percent,
            memory_used_mib: g.memory_used_mib,
            power_mw: g.power_mw,
            xid_errors: g.xid_errors,
            dirty: g.dirty,
            problems: g.problems.clone(),
            dirty_reason: g.dirty_reason.clone(),
            dirty_job_id: g.dirty_job_id.unwrap_or(0),
            fault_seq: g.fault_seq,
            card_fault: g.card_fault.clone(),
        }
    }
}

impl From<pb::GpuHealth> for GpuHealth {
    fn from(g: pb::GpuHealth) -> Self {
        GpuHealth {
            index: g.index,
            temperature_c: g.temperature_c,
            utilization_percent: g.utilization_percent,
            memory_used_mib: g.memory_used_mib,
            power_mw: g.power_mw,
            xid_errors: g.xid_errors,
            dirty: g.dirty,
            dirty_reason: g.dirty_reason,
            // 0 on the wire: no job left it dirty (found at worker start).
            dirty_job_id: (g.dirty_job_id != 0).then_some(g.dirty_job_id),
            problems: g.problems,
            fault_seq: g.fault_seq,
            card_fault: bounded_reason(g.card_fault),
        }
    }
}

// ---- billing ----

impl From<&Segment> for pb::Segment {
    fn from(g: &Segment) -> Self {
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
            cause: g.cause.map(|c| c.as_str().to_string()).unwrap_or_default(),
            credit_for: g.credit_for,
        }
    }
}

impl From<pb::Segment> for Segment {
    fn from(g: pb::Segment) -> Self {
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
            // A cause this version does not know (written by a newer one) reads as unknown.
            cause: corral_types::EndCause::parse(&g.cause).ok(),
            credit_for: g.credit_for,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_layouts_and_names_cross_the_wire() {
        let spec = JobSpec {
            tenant: "team-a".into(),
            gpus: 2,
            layout: TaskLayout {
                nodes: 1,
                ntasks: 2,
                gpus_per_task: 1,
                exclusive: true,
                gpu_type: Some("h100".into()),
                ..Default::default()
            },
            batch_step: true,
            slurm: SlurmNames { account: Some("proj_x".into()), user: Some("ana".into()), ..Default::default() },
            append_output: true,
            ..Default::default()
        };
        assert_eq!(JobSpec::try_from(pb::JobSpec::from(&spec)).unwrap(), spec);
    }

    #[test]
    fn jobs_cross_the_wire_unchanged() {
        let job = Job {
            id: 7,
            spec: JobSpec {
                name: "g".into(),
                tenant: "team-a".into(),
                priority_class: "normal".into(),
                gpus: 2,
                gpu_slice: None,
                cpu_millis: 500,
                memory_bytes: 1 << 30,
                time_limit_secs: Some(60),
                image: Some("img".into()),
                command: vec!["true".into()].into(),
                env: std::sync::Arc::new([("A".to_string(), "1".to_string())].into()),
                sched: SchedOptions {
                    gpus_per_node: Some(1),
                    rdma: true,
                    no_requeue: true,
                    checkpoint_signal: Some(10),
                    ..Default::default()
                },
                ..Default::default()
            },
            state: JobState::Running,
            request_id: "r".into(),
            submitted_at: Timestamp(1),
            admitted_at: Some(Timestamp(2)),
            started_at: Some(Timestamp(3)),
            finished_at: None,
            allocation: Some(Allocation {
                node: "n1".into(),
                gpus: vec![0],
                epoch: 3,
                more_nodes: vec![NodeGpus { node: "n2".into(), gpus: vec![1] }],
                slice: Some(SliceAssignment::Mps { thread_percent: 50, memory_mib: 1024 }),
                ended: vec![PartEnd {
                    node: "n2".into(),
                    report: Some(JobExitReport { exit_code: Some(1), ..Default::default() }),
                }],
                price_breaks: vec![],
                ready: vec!["n2".into()],
                idle: vec!["n1".into()],
                master_port: None,
            }),
            preemption: Some(PreemptionNotice { by: 8, at: Timestamp(4), grace_secs: 30, checkpoint_signal: None }),
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: corral_types::JobSteps {
                next_id: 3,
                dropped: 1,
                steps: vec![corral_types::JobStep {
                    id: 2,
                    epoch: 3,
                    request_id: "srun-2".into(),
                    spec: corral_types::StepSpec {
                        command: vec!["python".into()],
                        env: [("A".to_string(), "b".to_string())].into(),
                        ntasks: Some(4),
                        gpus_per_task: Some(1),
                        nodelist: vec!["n2".into()],
                        kill_on_bad_exit: true,
                        gpus: Some(2),
                        wait_secs: Some(30),
                        ..Default::default()
                    },
                    nodes: vec![corral_types::StepNode {
                        node: "n2".into(),
                        first_task: 0,
                        tasks: 4,
                        gpus: vec![3, 2, 1, 0],
                    }],
                    state: corral_types::StepState::Cancelled,
                    created_at: Timestamp(4),
                    ended_at: Some(Timestamp(5)),
                    exit_code: Some(130),
                    reason: Some("why".into()),
                    ended: vec![corral_types::StepNodeEnd {
                        node: "n2".into(),
                        tasks: vec![corral_types::TaskExit { task: 1, exit_code: None, signal: Some(2) }],
                        launch_error: None,
                    }],
                    signals: vec![2],
                    stopping: false,
                }],
            },
            exit_code: None,
            signal: None,
            reason: Some("why".into()),
            cancel_requested: true,
            attempts: 1,
            worker_run_time_ms: Some(5),
        };
        assert_eq!(Job::try_from(pb::Job::from(&job)).unwrap(), job);
        let mig = JobSpec {
            gpu_slice: Some(GpuSlice::Mig { profile: "1g.10gb".into(), compute_slices: 1 }),
            ..job.spec.clone()
        };
        assert_eq!(JobSpec::try_from(pb::JobSpec::from(&mig)).unwrap(), mig);
        let unspecified = pb::Job { state: pb::JobState::Unspecified as i32, ..pb::Job::from(&job) };
        assert!(matches!(Job::try_from(unspecified), Err(ProtoError::Invalid { field: "state", .. })));
    }

    #[test]
    fn nodes_and_segments_cross_the_wire_unchanged() {
        let node = NodeSpec {
            name: "n1".into(),
            address: "a:1".into(),
            gpus: vec![GpuDevice {
                index: 0,
                uuid: "GPU-0".into(),
                model: "H100".into(),
                memory_mib: 81_559,
                numa_node: Some(1),
                pci_switch: Some("0000:3a".into()),
                rdma_nic: Some("mlx5_0".into()),
                mig_capable: true,
            }],
            cpu_millis: 8000,
            memory_bytes: 1 << 34,
            labels: vec![("rack".into(), "r1".into())],
            rendezvous_ports: None,
            lease_end: None,
        };
        assert_eq!(NodeSpec::from(pb::NodeSpec::from(&node)), node);
        let segment = Segment {
            id: 1,
            job_id: 2,
            epoch: 3,
            tenant: "t".into(),
            node: "n1".into(),
            gpu_model: "H100".into(),
            gpus: 1,
            gpu_milli: 500,
            priority_class: "normal".into(),
            multiplier_milli: 1000,
            price_micros_per_gpu_hour: 10,
            start: Timestamp(5),
            end: Timestamp(9),
            duration_ms: 3,
            lost: true,
            end_state: "failed".into(),
            cost_micros: 1,
            policy_version: 4,
            cause: Some(corral_types::EndCause::NodeLost),
            credit_for: Some(7),
        };
        assert_eq!(Segment::from(pb::Segment::from(&segment)), segment);
    }

    /// A worker's card faults cross with their reasons cut to a bound, at most
    /// `MAX_GPU_FAULTS` of them.
    #[test]
    fn card_faults_of_a_report_are_bounded() {
        let fault = |gpu| pb::GpuFault { gpu, reason: "é".repeat(200), node_epoch: 1, seq: 1, job_id: 0 };
        let report = pb::JobExitReport { gpu_faults: (0..100).map(fault).collect(), ..Default::default() };
        let report = JobExitReport::from(report);
        assert_eq!(report.gpu_faults.len(), MAX_GPU_FAULTS);
        assert!(report.gpu_faults.iter().all(|m| m.reason.len() <= MAX_GPU_FAULT_REASON));
        let back = JobExitReport::from(pb::JobExitReport::from(&report));
        assert_eq!(back, report);
    }

    #[test]
    fn gpu_health_crosses_the_wire_unchanged() {
        let dirty = GpuHealth {
            index: 3,
            temperature_c: 71,
            utilization_percent: 99,
            memory_used_mib: 1024,
            power_mw: 350_000,
            xid_errors: 2,
            dirty: true,
            dirty_reason: "1 process left behind".into(),
            dirty_job_id: Some(42),
            problems: vec!["overheat: 95 C".into()],
            fault_seq: 2,
            card_fault: "XID 79 (GPU has fallen off the bus)".into(),
        };
        let found_at_start = GpuHealth { dirty: true, dirty_job_id: None, ..dirty.clone() };
        for health in [dirty, found_at_start, GpuHealth::default()] {
            assert_eq!(GpuHealth::from(pb::GpuHealth::from(&health)), health);
        }
    }
}
