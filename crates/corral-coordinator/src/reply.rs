//! The user API's replies built from the state: a job as the API shows it (with why it waits),
//! a token's record, a node with its GPUs. One place, so that `GetJob`, `ListJobs`,
//! `WatchJob`, `WatchJobs` and job control answer with the same job.

use crate::auth::Principal;
use crate::liveness::NodeLive;
use crate::scheduler::PendingJobs;
use corral_core::State;
use corral_proto::v1 as pb;
use corral_types::{Job, JobState, NodeStatus};

/// A job as the API returns it: a pending job without a reason of its own shows why the
/// leader's last scheduling pass left it waiting.
pub(crate) fn job_reply(job: &Job, pending: &PendingJobs) -> pb::Job {
    let mut reply = pb::Job::from(job);
    if job.state == JobState::Pending && reply.reason.is_none() {
        reply.reason = pending.reason(job.id).map(String::from);
    }
    reply
}

/// A token's record (never its secret, which is not kept).
pub(crate) fn token_info(t: &corral_core::TokenRecord) -> pb::TokenInfo {
    pb::TokenInfo {
        id: t.id,
        tenant: t.tenant.clone(),
        admin: t.admin,
        created: t.created.0,
        expires_at_ms: t.expires_at_ms,
        revoked: t.revoked,
    }
}

/// A node as `ListNodes` shows it to `who`: its GPUs with the leader's readings (`live`, from
/// a real heartbeat) and the jobs on each. A tenant sees that a GPU is busy, but only its own
/// job ids and slices.
pub(crate) fn node_view(state: &State, n: &NodeStatus, live: Option<&NodeLive>, who: &Principal) -> pb::NodeView {
    let jobs: Vec<&Job> = state.jobs_on_node(&n.spec.name).collect();
    let gpus = n
        .spec
        .gpus
        .iter()
        .map(|g| {
            let health = live.and_then(|l| l.gpus.iter().find(|h| h.index == g.index));
            let on_gpu: Vec<&&Job> = jobs
                .iter()
                .filter(|j| {
                    j.allocation.as_ref().and_then(|a| a.gpus_on(&n.spec.name)).is_some_and(|gs| gs.contains(&g.index))
                })
                .collect();
            let busy = !on_gpu.is_empty();
            // A tenant sees that a GPU is busy, but only its own job ids and slices.
            let visible: Vec<&&Job> = on_gpu.iter().copied().filter(|j| who.may_access(&j.spec.tenant)).collect();
            let job_ids: Vec<u64> = visible.iter().map(|j| j.id).collect();
            let slices = visible
                .iter()
                .filter_map(|j| {
                    let slice = j.allocation.as_ref()?.slice.as_ref()?;
                    Some(pb::GpuSliceView { job_id: j.id, slice: slice.to_string() })
                })
                .collect();
            // The replicated card fault mark holds the GPU out whatever the heartbeat says.
            let mark = n.gpu_faults.iter().find(|m| m.gpu == g.index);
            let mut problems = health.map(|h| h.problems.clone()).unwrap_or_default();
            if let Some(mark) = mark {
                let after = match state.jobs.get(&mark.job_id) {
                    Some(j) if mark.job_id != 0 && who.may_access(&j.spec.tenant) => format!(" (ended job {})", j.id),
                    _ => String::new(),
                };
                let line = format!("card fault: {}{after}; out until the worker checks it clean", mark.reason);
                if !problems.iter().any(|p| p.contains(&mark.reason)) {
                    problems.insert(0, line);
                }
            }
            let gpu_state = if health.is_some_and(|h| h.dirty) {
                "dirty"
            } else if !problems.is_empty() {
                "unhealthy"
            } else if busy {
                "allocated"
            } else if n.accepts_jobs() {
                "idle"
            } else {
                "unavailable"
            };
            pb::GpuView {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                state: gpu_state.to_string(),
                temperature_c: health.map(|h| h.temperature_c).unwrap_or(0),
                utilization_percent: health.map(|h| h.utilization_percent).unwrap_or(0),
                memory_used_mib: health.map(|h| h.memory_used_mib).unwrap_or(0),
                job_ids,
                problems,
                dirty_reason: health.map(|h| h.dirty_reason.clone()).unwrap_or_default(),
                dirty_job_id: health
                    .and_then(|h| h.dirty_job_id)
                    .filter(|id| state.jobs.get(id).is_none_or(|j| who.may_access(&j.spec.tenant))),
                xid_errors: health.map(|h| h.xid_errors).unwrap_or(0),
                power_mw: health.map(|h| h.power_mw).unwrap_or(0),
                slices,
                mig_capable: g.supports_mig(),
            }
        })
        .collect();
    pb::NodeView {
        name: n.spec.name.clone(),
        address: n.spec.address.clone(),
        state: n.display_state(jobs.len()).to_string(),
        epoch: n.epoch,
        gpus,
        cpu_millis: n.spec.cpu_millis,
        memory_bytes: n.spec.memory_bytes,
        heartbeat_age_ms: live.map(|l| l.last_seen.elapsed().as_millis() as u64),
        reason: n.mode_reason.clone(),
        labels: n.spec.labels.iter().cloned().collect(),
        drain_deadline: n.drain_deadline.map(|t| t.0),
        running_jobs: jobs.len() as u32,
        partitions: n.spec.labels.iter().filter(|(k, _)| k == "partition").map(|(_, v)| v.clone()).collect(),
        lease_end: n.lease_end().map(|t| t.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{apply, dev_state_with_node};
    use corral_core::{schedule, Command};
    use corral_types::{JobSpec, Timestamp};

    /// The pass's reason shows on a pending job that has none of its own, and nowhere else.
    #[test]
    fn a_pending_job_shows_why_the_last_pass_left_it() {
        let spec = corral_types::JobSpec { tenant: "a".into(), ..Default::default() };
        let mut job = Job::pending(4, spec, String::new(), corral_types::Timestamp(1));
        let pending = PendingJobs::of_pass([(4, "resources: no node is up".to_string())]);
        assert_eq!(job_reply(&job, &pending).reason.as_deref(), Some("resources: no node is up"));
        assert_eq!(job_reply(&job, &PendingJobs::default()).reason, None);
        job.reason = Some("held by the user".into());
        assert_eq!(job_reply(&job, &pending).reason.as_deref(), Some("held by the user"), "its own reason first");
        job.reason = None;
        job.state = JobState::Running;
        assert_eq!(job_reply(&job, &pending).reason, None, "only a pending job waits");
    }

    /// Job 1 of team-a runs on one GPU of n1: team-b sees that GPU busy, but not whose job.
    #[test]
    fn a_tenant_sees_a_busy_gpu_but_only_its_own_jobs_on_it() {
        let mut state = dev_state_with_node();
        let spec = JobSpec {
            name: "t".into(),
            tenant: "team-a".into(),
            gpus: 1,
            command: vec!["true".into()].into(),
            ..Default::default()
        };
        apply(&mut state, 2_000, Command::SubmitJob { request_id: "a".into(), spec });
        let pass = schedule(&state, Timestamp::compose(2_500, 0), &Default::default());
        apply(&mut state, 2_500, pass.command().expect("a placement"));
        let gpu = state.jobs[&1].allocation.as_ref().and_then(|a| a.gpus_on("n1")).expect("placed on n1")[0];
        let view = |who: Principal| node_view(&state, &state.nodes["n1"], None, &who);
        let busy = |view: &pb::NodeView| view.gpus.iter().find(|g| g.index == gpu).cloned().expect("the gpu");
        let a = view(Principal::Tenant { tenant: "team-a".into(), token_id: 1 });
        assert_eq!((busy(&a).state.as_str(), busy(&a).job_ids), ("allocated", vec![1]));
        let b = view(Principal::Tenant { tenant: "team-b".into(), token_id: 2 });
        assert_eq!((busy(&b).state.as_str(), busy(&b).job_ids), ("allocated", vec![]));
        assert_eq!((a.running_jobs, b.running_jobs), (1, 1), "both see that one job runs there");
    }
}
