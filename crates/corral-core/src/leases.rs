//! Host leases: a node's lease end (the worker's `lease-end`, or `corral node lease`, which wins
//! until cleared), the runs it forbids (one whose time limit plus its class's grace would run
//! past it; one without a limit within `lease-guard` of it), and what its approach does
//! (`Command::EndLease`): at the lease end minus a job's grace the job gets its checkpoint signal
//! and is requeued with cause `lease-ended`; at the lease end the node is drained.
//!
//! Invariant: both judgements are pure functions of the replicated state and a timestamp (the
//! scheduler's pass clock, apply's `Request.ts`): apply re-checks each placement against its own
//! timestamp, and `EndLease` stops only runs not yet told to stop and drains only a node not yet
//! draining, so a proposal repeated by a new leader, or replayed, changes nothing more.

use crate::{ApplyError, Outcome, Response, State};
use corral_types::{format_utc, JobId, JobSpec, JobState, NodeMode, Timestamp, LEASE_PREEMPTOR};

/// The latest moment (unix ms) a run started at `now_ms` may hold a node: the end of its time
/// limit, or `now + guard` without one, plus its class's grace. A leased node takes the run only
/// if this is not after its lease end.
pub fn lease_need_ms(time_limit_secs: Option<u64>, grace_secs: u32, guard_secs: u64, now_ms: u64) -> u64 {
    let held = time_limit_secs.unwrap_or(guard_secs).saturating_mul(1000);
    now_ms.saturating_add(held).saturating_add(u64::from(grace_secs) * 1000)
}

impl State {
    /// Grace (seconds) of a priority class (the default's for an unknown one).
    pub fn class_grace_secs(&self, class: &str) -> u32 {
        self.config.priority_classes.get(class).map_or(crate::DEFAULT_GRACE_SECS, |c| c.grace_secs())
    }

    /// Why a run of `spec` started at `now` may not hold `node` (its lease ends first); `None`:
    /// it may (no lease, or it ends in time).
    pub fn lease_refusal(&self, spec: &JobSpec, node: &str, now: Timestamp) -> Option<String> {
        let end = self.nodes.get(node)?.lease_end()?;
        let grace = self.class_grace_secs(&spec.priority_class);
        let need =
            lease_need_ms(spec.time_limit_secs, grace, self.config.scheduler.lease_guard_secs, now.physical_ms());
        (need > end.physical_ms()).then(|| format!("the job ends after the lease of {node} ({})", format_utc(end)))
    }

    /// Running jobs with a part on `node` that its lease end stops at `now`: those whose class's
    /// grace reaches the lease end, not already told to stop.
    pub fn lease_victims(&self, node: &str, now: Timestamp) -> Vec<JobId> {
        let Some(end) = self.nodes.get(node).and_then(|n| n.lease_end()) else { return Vec::new() };
        let (now_ms, end_ms) = (now.physical_ms(), end.physical_ms());
        let longest_grace = self.config.priority_classes.values().map(|c| c.grace_secs()).max();
        let longest_grace = longest_grace.unwrap_or(0).max(crate::DEFAULT_GRACE_SECS);
        if now_ms.saturating_add(u64::from(longest_grace) * 1000) < end_ms {
            return Vec::new();
        }
        self.jobs_on_node(node)
            .filter(|j| j.state == JobState::Running && !j.cancel_requested && j.preemption.is_none())
            .filter(|j| {
                now_ms.saturating_add(u64::from(self.class_grace_secs(&j.spec.priority_class)) * 1000) >= end_ms
            })
            .map(|j| j.id)
            .collect()
    }

    /// Whether `Command::EndLease` for `node` at `now` would change anything (the leader's check).
    pub fn lease_due(&self, node: &str, now: Timestamp) -> bool {
        let Some(status) = self.nodes.get(node) else { return false };
        let Some(end) = status.lease_end() else { return false };
        (now >= end && status.mode != NodeMode::Draining) || !self.lease_victims(node, now).is_empty()
    }

    /// `corral node lease`: sets (`Some`) or clears (`None`) the operator's lease end of `node`.
    pub(crate) fn set_node_lease(&mut self, node: &str, lease_end: Option<Timestamp>) -> Response {
        let status = self.nodes.get_mut(node).ok_or_else(|| ApplyError::NoSuchNode(node.to_string()))?;
        status.lease_end_set = lease_end;
        Ok(Outcome::Done)
    }

    /// The lease of `node` nears its end at `ts`: stops the runs it reaches (checkpoint signal,
    /// grace, requeue as `lease-ended`) and, once it ended, drains the node.
    pub(crate) fn end_lease(&mut self, ts: Timestamp, node: &str) -> Response {
        let status = self.nodes.get(node).ok_or_else(|| ApplyError::NoSuchNode(node.to_string()))?;
        let Some(end) = status.lease_end() else { return Ok(Outcome::Stale) };
        let drain = ts >= end && status.mode != NodeMode::Draining;
        let victims = self.lease_victims(node, ts);
        if victims.is_empty() && !drain {
            return Ok(Outcome::Stale);
        }
        for id in victims {
            self.stop_for_requeue(ts, id, LEASE_PREEMPTOR);
        }
        if drain {
            let status = self.nodes.get_mut(node).expect("checked above");
            status.mode = NodeMode::Draining;
            status.mode_reason = format!("lease ended at {}", format_utc(end));
            // Its runs were stopped for the lease above (or before): nothing is left to evict.
            status.drain_deadline = None;
        }
        Ok(Outcome::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::tests::{cluster, spec, submit};
    use crate::{schedule, Command, PendingReason, Request};
    use corral_types::{EndCause, JobExitReport};
    use std::collections::BTreeSet;

    fn at(ms: u64, command: Command) -> Request {
        Request { ts: Timestamp::compose(ms, 0), command }
    }

    fn lease(s: &mut State, ms: u64, until_ms: Option<u64>) {
        let lease_end = until_ms.map(|u| Timestamp::compose(u, 0));
        s.apply(&at(ms, Command::SetNodeLease { node: "n1".into(), lease_end })).unwrap();
    }

    fn job(s: &mut State, ms: u64, rid: &str, limit_secs: Option<u64>) -> JobId {
        let mut spec = spec(1);
        spec.time_limit_secs = limit_secs;
        spec.sched.checkpoint_signal = Some(10);
        match submit(s, ms, rid, spec) {
            Ok(Outcome::JobSubmitted { job_id, .. }) => job_id,
            other => panic!("{other:?}"),
        }
    }

    /// One pass at `ms`, its placements applied; returns the placed jobs and the pending reasons.
    fn pass(s: &mut State, ms: u64) -> (Vec<JobId>, Vec<(JobId, PendingReason)>) {
        let pass = schedule(s, Timestamp::compose(ms, 0), &BTreeSet::new());
        let placed = pass.placements.iter().map(|p| p.job_id).collect();
        let pending = pass.pending.iter().map(|p| (p.job_id, p.reason.clone())).collect();
        if let Some(command) = pass.command() {
            s.apply(&at(ms, command)).unwrap();
        }
        (placed, pending)
    }

    #[test]
    fn a_job_that_would_outlast_the_lease_waits_with_the_reason_and_one_that_fits_runs() {
        let mut s = cluster();
        // The lease ends 50 minutes in; the default class's grace is 60 s; the pass runs at 1 s.
        lease(&mut s, 5, Some(3_000_000));
        let long = job(&mut s, 10, "long", Some(7200));
        let fits = job(&mut s, 11, "fits", Some(1800));
        let just_fits = job(&mut s, 12, "just", Some(3_000 - 60 - 1));
        let tight = job(&mut s, 13, "tight", Some(3_000 - 60));
        // Without a limit: within the lease guard (1 h by default) of the lease end.
        let unlimited = job(&mut s, 14, "unlimited", None);
        let (placed, pending) = pass(&mut s, 1_000);
        assert_eq!(placed, vec![fits, just_fits], "only jobs that end (with their grace) by the lease end run");
        let waiting: BTreeSet<JobId> = pending.iter().map(|(j, _)| *j).collect();
        assert_eq!(waiting, [long, tight, unlimited].into());
        for (_, reason) in &pending {
            let shown = reason.to_string();
            assert!(shown.contains("ends after the lease of n1"), "{shown}");
        }
        // apply refuses a proposal past the lease, whatever the leader said.
        let err = s.apply(&at(2_000, Command::PlaceJob { job_id: long, node: "n1".into(), gpus: vec![7] }));
        assert!(err.unwrap_err().to_string().contains("ends after the lease of n1"));
        // Cleared: the worker's lease (none here) applies again, and everything runs.
        lease(&mut s, 3_000, None);
        let (placed, _) = pass(&mut s, 4_000);
        assert_eq!(placed.len(), 3, "{placed:?}");
        assert!(placed.contains(&unlimited));
    }

    #[test]
    fn an_unlimited_job_runs_until_the_guard_before_the_lease() {
        let mut s = cluster();
        s.config.scheduler.lease_guard_secs = 600;
        lease(&mut s, 5, Some(1_000_000));
        let a = job(&mut s, 10, "a", None);
        // 1_000 s lease, 600 s guard, 60 s grace: placeable until 340 s.
        let (placed, pending) = pass(&mut s, 340_001);
        assert!(placed.is_empty());
        assert!(pending[0].1.to_string().contains("ends after the lease of n1"));
        let (placed, _) = pass(&mut s, 340_000);
        assert_eq!(placed, vec![a]);
    }

    #[test]
    fn the_lease_end_checkpoints_and_requeues_running_jobs_once_then_drains_the_node() {
        let mut s = cluster();
        s.config.credits.insert(EndCause::LeaseEnded, 1000);
        let running = job(&mut s, 10, "a", None);
        assert_eq!(pass(&mut s, 20).0, vec![running]);
        s.apply(&at(30, Command::JobStarted { job_id: running, epoch: 1 })).ok();
        lease(&mut s, 25, Some(100_000));
        // Grace 60 s: at 39.999 s nothing is due, at 40 s the job is stopped.
        assert!(!s.lease_due("n1", Timestamp::compose(39_999, 0)));
        assert_eq!(s.apply(&at(39_999, Command::EndLease { node: "n1".into() })), Ok(Outcome::Stale));
        assert!(s.lease_due("n1", Timestamp::compose(40_000, 0)));
        s.apply(&at(40_000, Command::EndLease { node: "n1".into() })).unwrap();
        let notice = s.jobs[&running].preemption.clone().expect("told to stop");
        assert_eq!((notice.by, notice.grace_secs, notice.checkpoint_signal), (LEASE_PREEMPTOR, 60, Some(10)));
        // Proposed again (a new leader): nothing more happens.
        assert_eq!(s.apply(&at(40_500, Command::EndLease { node: "n1".into() })), Ok(Outcome::Stale));
        assert_eq!(s.nodes["n1"].mode, NodeMode::Active, "the node drains at the lease end, not before");
        let epoch = s.jobs[&running].allocation.as_ref().unwrap().epoch;
        let report = JobExitReport { exit_code: Some(0), run_time_ms: 70_000, ..Default::default() };
        s.apply(&at(80_000, Command::JobFinished { job_id: running, epoch, node: "n1".into(), report })).unwrap();
        let job = &s.jobs[&running];
        assert_eq!(job.state, JobState::Pending);
        assert_eq!(job.restarts, 0, "a lease end counts no restart");
        assert_eq!(job.reason.as_deref(), Some("requeued: the lease of node n1 ended"));
        let (run, credit): (Vec<_>, Vec<_>) = s.ledger.values().partition(|g| !g.is_credit());
        assert_eq!(run.last().unwrap().cause, Some(EndCause::LeaseEnded));
        let credit = credit.last().expect("credited per policy");
        assert_eq!((credit.cause, credit.credit_for), (Some(EndCause::LeaseEnded), Some(run.last().unwrap().id)));
        // At the lease end the node drains and leaves the pool.
        assert!(s.lease_due("n1", Timestamp::compose(100_000, 0)));
        s.apply(&at(100_000, Command::EndLease { node: "n1".into() })).unwrap();
        assert_eq!(s.nodes["n1"].mode, NodeMode::Draining);
        assert_eq!(s.nodes["n1"].display_state(0), "drained");
        assert!(!s.lease_due("n1", Timestamp::compose(200_000, 0)));
        assert!(pass(&mut s, 200_000).0.is_empty(), "a drained node takes nothing");
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index, "indexes stay exact");
    }

    #[test]
    fn the_operators_lease_wins_over_the_workers_until_cleared() {
        let mut s = cluster();
        let mut spec = crate::apply::tests::node("n1", 8);
        spec.lease_end = Some(Timestamp::compose(50_000, 0));
        s.apply(&at(3, Command::RegisterNode { spec })).unwrap();
        assert_eq!(s.nodes["n1"].lease_end(), Some(Timestamp::compose(50_000, 0)));
        lease(&mut s, 4, Some(90_000));
        assert_eq!(s.nodes["n1"].lease_end(), Some(Timestamp::compose(90_000, 0)));
        // A restart of the worker keeps the operator's lease.
        let mut spec = crate::apply::tests::node("n1", 8);
        spec.lease_end = Some(Timestamp::compose(50_000, 0));
        s.apply(&at(5, Command::RegisterNode { spec })).unwrap();
        assert_eq!(s.nodes["n1"].lease_end(), Some(Timestamp::compose(90_000, 0)));
        lease(&mut s, 6, None);
        assert_eq!(s.nodes["n1"].lease_end(), Some(Timestamp::compose(50_000, 0)));
        assert!(matches!(
            s.apply(&at(7, Command::SetNodeLease { node: "ghost".into(), lease_end: None })),
            Err(ApplyError::NoSuchNode(_))
        ));
    }
}
