//! Jobs as the store, the snapshot and the log's submits carry them: the spec (GPU slice,
//! scheduling options, dependencies, array), the state, the allocation (gang parts, slice,
//! how each part ended, price breaks), the preemption notice and the exit report.

use super::{pb, CodecError};
use corral_types::{
    Allocation, ArrayProgress, ArrayRange, ArraySpec, ArrayTask, Dependency, DependencyKind, GpuSlice, Job,
    JobExitReport, JobSpec, JobState, NodeGpus, PartEnd, PreemptionNotice, PriceBreak, SchedOptions, SliceAssignment,
    SlurmNames, TaskLayout, Timestamp,
};
use prost::Message;

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
            command: s.command.into(),
            env: s.env.into(),
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

fn dependency_kind_from_i32(v: i32) -> Result<DependencyKind, CodecError> {
    match pb::DependencyKind::try_from(v) {
        Ok(pb::DependencyKind::AfterOk) => Ok(DependencyKind::AfterOk),
        Ok(pb::DependencyKind::AfterAny) => Ok(DependencyKind::AfterAny),
        Ok(pb::DependencyKind::AfterNotOk) => Ok(DependencyKind::AfterNotOk),
        _ => Err(CodecError::Invalid { field: "dependency kind", value: v.to_string() }),
    }
}

pub(super) fn node_gpus_to_pb(parts: &[NodeGpus]) -> Vec<pb::NodeGpus> {
    parts.iter().map(|p| pb::NodeGpus { node: p.node.clone(), gpus: p.gpus.clone() }).collect()
}

pub(super) fn node_gpus_from_pb(parts: Vec<pb::NodeGpus>) -> Vec<NodeGpus> {
    parts.into_iter().map(|p| NodeGpus { node: p.node, gpus: p.gpus }).collect()
}

pub(super) fn slice_to_pb(s: &SliceAssignment) -> pb::SliceAssignment {
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

pub(super) fn slice_from_pb(s: pb::SliceAssignment) -> Result<SliceAssignment, CodecError> {
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
            steps: super::step::steps_to_pb(&j.steps),
            spec_from_array: false,
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
            steps: super::step::steps_from_pb(j.steps)?,
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
            gpu_faults: r.gpu_faults.iter().map(super::node::gpu_fault_to_pb).collect(),
            idle_end: r.idle_end.clone(),
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
            gpu_faults: r.gpu_faults.into_iter().map(super::node::gpu_fault_from_pb).collect(),
            idle_end: r.idle_end,
        }
    }
}

/// Encodes one job (persisted per key in the state machine store).
pub fn job_to_bytes(j: &Job) -> Vec<u8> {
    pb::Job::from(j).encode_to_vec()
}

/// Decodes one job written by [`job_to_bytes`].
pub fn job_from_bytes(bytes: &[u8]) -> Result<Job, CodecError> {
    pb::Job::decode(bytes)?.try_into()
}

#[cfg(test)]
mod tests {
    use super::super::{command_from_bytes, command_to_bytes};
    use super::*;
    use corral_core::{Command, Request};

    #[test]
    fn slurm_layouts_and_names_round_trip() {
        let spec = JobSpec {
            tenant: "team-a".into(),
            gpus: 8,
            sched: SchedOptions { gpus_per_node: Some(4), ..Default::default() },
            layout: TaskLayout {
                nodes: 2,
                ntasks: 8,
                ntasks_per_node: 4,
                cpus_per_task: 6,
                gpus_per_task: 1,
                cpus_per_gpu: 0,
                mem_per_cpu: 0,
                mem_per_gpu: 20 << 30,
                exclusive: true,
                gpu_type: Some("a100".into()),
                submitted_shape: Some(corral_types::SubmittedShape {
                    gpus: 7,
                    cpu_millis: 14_000,
                    memory_bytes: 1 << 30,
                }),
            },
            batch_step: true,
            slurm: SlurmNames {
                account: Some("proj_x".into()),
                qos: Some("short".into()),
                partition: Some("gpu".into()),
                submit_dir: Some("/home/ana/exp".into()),
                submit_host: Some("login1".into()),
                user: Some("ana".into()),
            },
            append_output: true,
            script: Some("#!/bin/sh\nsrun true\n".into()),
            ..Default::default()
        };
        let req = Request { ts: Timestamp(5), command: Command::SubmitJob { request_id: "s".into(), spec } };
        assert_eq!(command_from_bytes(&command_to_bytes(&req)).unwrap(), req);
        // A spec without them writes none of the new fields: older readers see the same bytes.
        let plain = JobSpec { tenant: "t".into(), command: vec!["true".into()].into(), ..Default::default() };
        let bytes = pb::JobSpec::from(&plain).encode_to_vec();
        assert_eq!(
            bytes,
            pb::JobSpec { tenant: "t".into(), command: vec!["true".into()], ..Default::default() }.encode_to_vec()
        );
    }
}
