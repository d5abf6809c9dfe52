//! Raft log commands: a TSO-stamped `corral_core::Request` as the `Command` message stored in
//! the log (the application payload of an entry), with the placements and preemptions a
//! scheduling pass proposes.

use super::config::{config_from_pb, config_to_pb};
use super::job::{node_gpus_from_pb, node_gpus_to_pb, slice_from_pb, slice_to_pb};
use super::node::{node_mode_from_i32, node_mode_to_pb, node_state_from_i32};
use super::{check_version, pb, CodecError, FORMAT_VERSION};
use corral_core::{Command, CompactCutoffs, JobUpdate, Placement, Preemption, Request};
use corral_types::Timestamp;
use prost::Message;

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
        Command::RemoveNode { node, revoke_certificates } => {
            Kind::RemoveNode(pb::RemoveNode { node: node.clone(), revoke_certificates: *revoke_certificates })
        }
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
            spec: Some(super::step::spec_to_pb(spec)),
        }),
        Command::StepEnded { job_id, epoch, step: id, end } => Kind::StepEnded(pb::StepEnded {
            job_id: *job_id,
            epoch: *epoch,
            step: *id,
            end: Some(super::step::node_end_to_pb(end)),
        }),
        Command::SignalStep { job_id, step: id, signal } => {
            Kind::SignalStep(pb::SignalStep { job_id: *job_id, step: *id, signal: *signal })
        }
        Command::RegisterRestartedNode { spec, stale_jobs_stopped_ms_ago } => {
            Kind::RegisterRestartedNode(pb::RegisterRestartedNode {
                spec: Some(spec.into()),
                stale_jobs_stopped_ms_ago: *stale_jobs_stopped_ms_ago,
            })
        }
        Command::SetGpuFault { node, mark, clear } => Kind::SetGpuFault(pb::SetGpuFault {
            node: node.clone(),
            mark: Some(super::node::gpu_fault_to_pb(mark)),
            clear: *clear,
        }),
        Command::SetNodeLease { node, lease_end } => {
            Kind::SetNodeLease(pb::SetNodeLease { node: node.clone(), lease_end: lease_end.map(|t| t.0) })
        }
        Command::EndLease { node } => Kind::EndLease(pb::EndLease { node: node.clone() }),
        Command::PartReady { job_id, epoch, node } => {
            Kind::PartReady(pb::PartReady { job_id: *job_id, epoch: *epoch, node: node.clone() })
        }
        Command::PartIdle { job_id, epoch, node, idle } => {
            Kind::PartIdle(pb::PartIdle { job_id: *job_id, epoch: *epoch, node: node.clone(), idle: *idle })
        }
        Command::Compact(c) => Kind::Compact(pb::Compact {
            archive_before: c.archive_before.0,
            request_ids_before: c.request_ids_before.0,
            jobs_before: c.jobs_before.map(|t| t.0),
            segments_before: c.segments_before.map(|t| t.0),
            max_finished_bytes: c.max_finished_bytes,
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
        Kind::RemoveNode(r) => Command::RemoveNode { node: r.node, revoke_certificates: r.revoke_certificates },
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
            spec: super::step::spec_from_pb(c.spec.ok_or(CodecError::Missing("create_step.spec"))?),
        },
        Kind::StepEnded(c) => Command::StepEnded {
            job_id: c.job_id,
            epoch: c.epoch,
            step: c.step,
            end: super::step::node_end_from_pb(c.end.ok_or(CodecError::Missing("step_ended.end"))?),
        },
        Kind::SignalStep(c) => Command::SignalStep { job_id: c.job_id, step: c.step, signal: c.signal },
        Kind::RegisterRestartedNode(r) => Command::RegisterRestartedNode {
            spec: r.spec.ok_or(CodecError::Missing("register_restarted_node.spec"))?.into(),
            stale_jobs_stopped_ms_ago: r.stale_jobs_stopped_ms_ago,
        },
        Kind::SetGpuFault(c) => Command::SetGpuFault {
            node: c.node,
            mark: super::node::gpu_fault_from_pb(c.mark.ok_or(CodecError::Missing("set_gpu_fault.mark"))?),
            clear: c.clear,
        },
        Kind::SetNodeLease(c) => Command::SetNodeLease { node: c.node, lease_end: c.lease_end.map(Timestamp) },
        Kind::EndLease(c) => Command::EndLease { node: c.node },
        Kind::PartReady(c) => Command::PartReady { job_id: c.job_id, epoch: c.epoch, node: c.node },
        Kind::PartIdle(c) => Command::PartIdle { job_id: c.job_id, epoch: c.epoch, node: c.node, idle: c.idle },
        Kind::Compact(c) => Command::Compact(CompactCutoffs {
            archive_before: Timestamp(c.archive_before),
            request_ids_before: Timestamp(c.request_ids_before),
            jobs_before: c.jobs_before.map(Timestamp),
            segments_before: c.segments_before.map(Timestamp),
            max_finished_bytes: c.max_finished_bytes,
        }),
    };
    Ok(Request { ts: Timestamp(c.ts), command })
}

/// Encodes a replicated request as it is stored in the Raft log.
pub fn command_to_bytes(r: &Request) -> Vec<u8> {
    command_to_pb(r).encode_to_vec()
}

/// Decodes a replicated request from the Raft log.
pub fn command_from_bytes(bytes: &[u8]) -> Result<Request, CodecError> {
    command_from_pb(pb::Command::decode(bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_and_future_versions_are_refused() {
        assert!(command_from_bytes(&[0xff, 0xff, 0xff]).is_err());
        let future = pb::Command { format_version: 99, ts: 1, kind: Some(pb::command::Kind::Noop(true)) };
        assert!(matches!(command_from_bytes(&future.encode_to_vec()), Err(CodecError::Version { found: 99, .. })));
    }
}
