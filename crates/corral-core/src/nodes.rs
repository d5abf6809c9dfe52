//! Node lifecycle set by operators: cordon (no new jobs), drain (no new jobs; at the deadline
//! running jobs get their checkpoint signal, then grace, then are requeued elsewhere), resume,
//! and removal of an empty node.
//!
//! Invariant: a node that is not active takes no placement (the scheduler skips it and apply
//! refuses one). Invariant: a drain stops a job the way a preemption does (`DRAIN_PREEMPTOR`), so
//! its exit report, a lost node or a cancel end it exactly as they end a preempted run.

use crate::{ApplyError, Outcome, Response, State};
use corral_types::{JobId, JobState, NodeMode, NodeState, PreemptionNotice, Timestamp, DRAIN_PREEMPTOR};

impl State {
    pub(crate) fn set_node_mode(
        &mut self,
        ts: Timestamp,
        node: &str,
        mode: NodeMode,
        reason: &str,
        drain_deadline: Option<Timestamp>,
    ) -> Response {
        let status = self.nodes.get_mut(node).ok_or_else(|| ApplyError::NoSuchNode(node.to_string()))?;
        status.mode = mode;
        status.mode_reason = if mode == NodeMode::Active { String::new() } else { reason.to_string() };
        status.drain_deadline = drain_deadline.filter(|_| mode == NodeMode::Draining);
        if mode != NodeMode::Draining {
            // Resumed or cordoned before its deadline: jobs already told to stop still stop (their
            // notice stands), the others stay.
            return Ok(Outcome::Done);
        }
        self.evict_drained_jobs(ts, node)?;
        Ok(Outcome::Done)
    }

    /// Running jobs with a part on `node` that a passed drain deadline would stop now.
    pub fn jobs_to_evict(&self, node: &str, now: Timestamp) -> Vec<JobId> {
        let Some(status) = self.nodes.get(node) else { return Vec::new() };
        if status.mode != NodeMode::Draining || status.drain_deadline.is_none_or(|d| now < d) {
            return Vec::new();
        }
        self.jobs_on_node(node)
            .filter(|j| j.state == JobState::Running && !j.cancel_requested && j.preemption.is_none())
            .map(|j| j.id)
            .collect()
    }

    pub(crate) fn evict_drained_jobs(&mut self, ts: Timestamp, node: &str) -> Response {
        if !self.nodes.contains_key(node) {
            return Err(ApplyError::NoSuchNode(node.to_string()));
        }
        let victims = self.jobs_to_evict(node, ts);
        if victims.is_empty() {
            return Ok(Outcome::Stale);
        }
        for id in victims {
            self.stop_for_requeue(ts, id, DRAIN_PREEMPTOR);
        }
        Ok(Outcome::Done)
    }

    /// Tells running job `job_id` to stop the way a preemption does (its checkpoint signal, its
    /// class's grace), on behalf of `by` (a drain, `corral requeue`): its exit puts it back in
    /// the queue.
    pub(crate) fn stop_for_requeue(&mut self, ts: Timestamp, job_id: JobId, by: JobId) {
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        let grace_secs = self
            .config
            .priority_classes
            .get(&job.spec.priority_class)
            .map_or(crate::DEFAULT_GRACE_SECS, |c| c.grace_secs());
        job.preemption =
            Some(PreemptionNotice { by, at: ts, grace_secs, checkpoint_signal: job.spec.sched.checkpoint_signal });
        self.index.preemptors.entry(by).or_default().insert(job_id);
    }

    pub(crate) fn remove_node(&mut self, node: &str) -> Response {
        let status = self.nodes.get(node).ok_or_else(|| ApplyError::NoSuchNode(node.to_string()))?;
        if status.state == NodeState::Up && status.mode == NodeMode::Active {
            return Err(ApplyError::NodeNotRemovable(format!(
                "node {node} is up and takes jobs: drain or cordon it first, and stop its worker (or it registers again)"
            )));
        }
        let running = self.jobs_on_node(node).count();
        if running > 0 {
            return Err(ApplyError::NodeNotRemovable(format!(
                "node {node} still holds {running} job(s): drain it (corral node drain {node} --deadline 0s) and wait until it is drained"
            )));
        }
        self.nodes.remove(node);
        self.index.caps = crate::state::Caps::of(&self.nodes);
        Ok(Outcome::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::tests::{cluster, node, spec, submit};
    use crate::{schedule, Command, Request};
    use corral_types::JobExitReport;
    use std::collections::BTreeSet;

    fn at(ms: u64, command: Command) -> Request {
        Request { ts: Timestamp::compose(ms, 0), command }
    }

    fn mode(s: &mut State, ms: u64, n: &str, mode: NodeMode, deadline_ms: Option<u64>) -> Response {
        let drain_deadline = deadline_ms.map(|d| Timestamp::compose(d, 0));
        s.apply(&at(ms, Command::SetNodeMode { node: n.into(), mode, reason: "maintenance".into(), drain_deadline }))
    }

    /// Runs one scheduling pass at `ms` and applies its placements; returns (job, node) pairs.
    fn pass(s: &mut State, ms: u64) -> Vec<(JobId, String)> {
        let pass = schedule(s, Timestamp::compose(ms, 0), &BTreeSet::new());
        let placed: Vec<(JobId, String)> = pass.placements.iter().map(|p| (p.job_id, p.node.clone())).collect();
        if let Some(command) = pass.command() {
            s.apply(&at(ms, command)).unwrap();
        }
        placed
    }

    fn new_job(s: &mut State, ms: u64, rid: &str, gpus: u32) -> JobId {
        match submit(s, ms, rid, spec(gpus)) {
            Ok(Outcome::JobSubmitted { job_id, .. }) => job_id,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_cordoned_node_takes_no_new_job_and_keeps_its_running_ones() {
        let mut s = cluster();
        let running = new_job(&mut s, 10, "a", 1);
        assert_eq!(pass(&mut s, 20), vec![(running, "n1".to_string())]);
        mode(&mut s, 30, "n1", NodeMode::Cordoned, None).unwrap();
        assert_eq!(s.nodes["n1"].display_state(1), "cordoned");
        let waiting = new_job(&mut s, 40, "b", 1);
        assert!(pass(&mut s, 50).is_empty(), "nothing is placed on a cordoned node");
        let err = s.apply(&at(60, Command::PlaceJob { job_id: waiting, node: "n1".into(), gpus: vec![5] }));
        assert!(err.unwrap_err().to_string().contains("cordoned and takes no new jobs"));
        assert_eq!(s.jobs[&running].state, JobState::Running, "running jobs stay");
        assert!(s.jobs[&running].preemption.is_none());
        // A restart of its worker keeps the cordon.
        s.apply(&at(70, Command::RegisterNode { spec: node("n1", 8) })).unwrap();
        assert_eq!((s.nodes["n1"].mode, s.nodes["n1"].mode_reason.as_str()), (NodeMode::Cordoned, "maintenance"));
        mode(&mut s, 80, "n1", NodeMode::Active, None).unwrap();
        assert_eq!(pass(&mut s, 90).len(), 2, "resumed: both jobs are placed");
        assert!(matches!(mode(&mut s, 95, "ghost", NodeMode::Cordoned, None), Err(ApplyError::NoSuchNode(_))));
    }

    #[test]
    fn a_drain_stops_running_jobs_at_its_deadline_and_they_run_again_elsewhere() {
        let mut s = cluster();
        s.apply(&at(5, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        let mut checkpointing = spec(8);
        checkpointing.sched.checkpoint_signal = Some(10);
        let Ok(Outcome::JobSubmitted { job_id: job, .. }) = submit(&mut s, 10, "a", checkpointing) else { panic!() };
        let on = pass(&mut s, 20)[0].1.clone();
        let other = if on == "n1" { "n2" } else { "n1" };
        mode(&mut s, 1_000, &on, NodeMode::Draining, Some(61_000)).unwrap();
        assert_eq!(s.nodes[&on].display_state(1), "draining");
        assert!(s.jobs[&job].preemption.is_none(), "before the deadline the job runs on");
        assert_eq!(s.apply(&at(60_000, Command::EvictDrainedJobs { node: on.clone() })), Ok(Outcome::Stale));
        assert!(s.jobs_to_evict(&on, Timestamp::compose(60_999, 0)).is_empty());
        assert_eq!(s.jobs_to_evict(&on, Timestamp::compose(61_000, 0)), vec![job]);
        s.apply(&at(61_000, Command::EvictDrainedJobs { node: on.clone() })).unwrap();
        let notice = s.jobs[&job].preemption.clone().expect("stopped like a preempted job");
        assert_eq!((notice.by, notice.grace_secs, notice.checkpoint_signal), (DRAIN_PREEMPTOR, 60, Some(10)));
        // Its exit (a checkpointing job often exits 0) requeues it; it runs again on the other node.
        let epoch = s.jobs[&job].allocation.as_ref().unwrap().epoch;
        let report = JobExitReport { exit_code: Some(0), run_time_ms: 61_000, ..Default::default() };
        s.apply(&at(62_000, Command::JobFinished { job_id: job, epoch, node: on.clone(), report })).unwrap();
        assert_eq!(s.jobs[&job].state, JobState::Pending);
        assert_eq!(s.jobs[&job].reason.as_deref(), Some(format!("requeued: node {on} was drained").as_str()));
        assert_eq!(s.nodes[&on].display_state(0), "drained");
        assert_eq!(pass(&mut s, 63_000), vec![(job, other.to_string())]);
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index, "indexes stay exact");
    }

    #[test]
    fn a_drain_without_time_left_stops_jobs_at_once() {
        let mut s = cluster();
        let job = new_job(&mut s, 10, "a", 1);
        pass(&mut s, 20);
        mode(&mut s, 1_000, "n1", NodeMode::Draining, Some(1_000)).unwrap();
        assert_eq!(s.jobs[&job].preemption.as_ref().map(|p| p.by), Some(DRAIN_PREEMPTOR));
        // Without a deadline nothing is stopped.
        let mut s = cluster();
        let job = new_job(&mut s, 10, "a", 1);
        pass(&mut s, 20);
        mode(&mut s, 1_000, "n1", NodeMode::Draining, None).unwrap();
        assert!(s.jobs_to_evict("n1", Timestamp::compose(u64::MAX >> 20, 0)).is_empty());
        assert!(s.jobs[&job].preemption.is_none());
    }

    #[test]
    fn a_job_runs_only_on_nodes_with_the_labels_it_asks_for() {
        let mut s = cluster();
        let mut labelled = node("n2", 8);
        labelled.labels = vec![("partition".into(), "train".into()), ("gpu".into(), "5090".into())];
        s.apply(&at(5, Command::RegisterNode { spec: labelled })).unwrap();
        let mut wants = spec(1);
        wants.sched.node_selector = vec!["partition=train".into(), "5090".into()];
        let Ok(Outcome::JobSubmitted { job_id, .. }) = submit(&mut s, 10, "a", wants.clone()) else { panic!() };
        assert_eq!(pass(&mut s, 20), vec![(job_id, "n2".to_string())]);
        // apply refuses a placement on a node without the labels.
        let Ok(Outcome::JobSubmitted { job_id: other, .. }) = submit(&mut s, 30, "b", wants.clone()) else { panic!() };
        let err = s.apply(&at(40, Command::PlaceJob { job_id: other, node: "n1".into(), gpus: vec![0] }));
        assert!(err.unwrap_err().to_string().contains("lacks the labels"));
        wants.sched.node_selector = vec!["partition=inference".into()];
        let err = submit(&mut s, 50, "c", wants).unwrap_err().to_string();
        assert!(err.contains("no registered node has the labels partition=inference"), "{err}");
    }

    #[test]
    fn only_an_empty_node_out_of_service_can_be_removed_and_its_gpus_leave_the_pool() {
        let mut s = cluster();
        s.apply(&at(5, Command::RegisterNode { spec: node("n2", 2) })).unwrap();
        let err = s
            .apply(&at(10, Command::RemoveNode { node: "n1".into(), revoke_certificates: true }))
            .unwrap_err()
            .to_string();
        assert!(err.contains("up and takes jobs"), "{err}");
        let job = new_job(&mut s, 20, "a", 8);
        pass(&mut s, 30);
        mode(&mut s, 40, "n1", NodeMode::Draining, None).unwrap();
        let err = s
            .apply(&at(50, Command::RemoveNode { node: "n1".into(), revoke_certificates: true }))
            .unwrap_err()
            .to_string();
        assert!(err.contains("still holds 1 job(s)"), "{err}");
        s.apply(&at(60, Command::CancelJob { job_id: job, reason: String::new() })).unwrap();
        let epoch = s.jobs[&job].allocation.as_ref().unwrap().epoch;
        let report = JobExitReport { signal: Some(15), run_time_ms: 10, ..Default::default() };
        s.apply(&at(70, Command::JobFinished { job_id: job, epoch, node: "n1".into(), report })).unwrap();
        s.apply(&at(80, Command::RemoveNode { node: "n1".into(), revoke_certificates: true })).unwrap();
        assert!(!s.nodes.contains_key("n1"));
        let err = submit(&mut s, 90, "big", spec(8)).unwrap_err();
        assert!(matches!(err, ApplyError::TooManyGpus { largest: 2, .. }), "{err}");
        assert!(matches!(
            s.apply(&at(95, Command::RemoveNode { node: "n1".into(), revoke_certificates: true })),
            Err(ApplyError::NoSuchNode(_))
        ));
    }
}
