//! Gangs across nodes: the rendezvous port (MASTER_PORT) a gang's parts meet on, and the
//! restarts of failed runs under `max_restarts`.
//!
//! The port is chosen by apply() when a gang is placed, deterministically: the lowest port of
//! the first part's node's `rendezvous_ports` range that no other held allocation whose first
//! part is on that node uses. The scheduler only places a gang whose first node has one left
//! (`free_port_count`), so apply's choice never fails on a proposal of a current leader.
//!
//! A run that ends failed (a part exited other than 0, was killed or OOM-killed, or did not
//! launch; not a time-limit kill, a cancel, a preemption or a lost node, which have their own
//! rules) is requeued as a whole while `restarts < max_restarts` (`restart_reason`).

use crate::State;
use corral_types::{Job, JobExitReport, NodeStatus, DEFAULT_RENDEZVOUS_PORTS};
use std::collections::BTreeSet;

/// The inclusive rendezvous port range of a node (its own, or the default); empty (`None`) when
/// the registered range is not a valid one.
pub(crate) fn port_range(node: &NodeStatus) -> Option<(u32, u32)> {
    let (first, last) = node.spec.rendezvous_ports.unwrap_or(DEFAULT_RENDEZVOUS_PORTS);
    (first >= 1 && first <= last && last <= u32::from(u16::MAX)).then_some((first, last))
}

/// Rendezvous ports of `node` held by allocations whose first part is there.
fn ports_in_use(state: &State, node: &str) -> BTreeSet<u32> {
    state
        .jobs_on_node(node)
        .filter_map(|j| j.allocation.as_ref())
        .filter(|a| a.node == node)
        .filter_map(|a| a.master_port)
        .collect()
}

/// The lowest free rendezvous port of `node`, or why there is none.
pub(crate) fn free_port(state: &State, node: &str) -> Result<u32, String> {
    let status = state.nodes.get(node).ok_or_else(|| format!("node '{node}' is not registered"))?;
    let Some((first, last)) = port_range(status) else {
        return Err(format!("node {node} offers no valid rendezvous port range"));
    };
    let used = ports_in_use(state, node);
    (first..=last)
        .find(|p| !used.contains(p))
        .ok_or_else(|| format!("every rendezvous port of node {node} ({first}-{last}) is in use by another gang"))
}

/// How many rendezvous ports of `node` are free (0 for an unknown node).
pub(crate) fn free_port_count(state: &State, node: &str) -> u32 {
    let Some((first, last)) = state.nodes.get(node).and_then(port_range) else { return 0 };
    let used = ports_in_use(state, node).range(first..=last).count() as u32;
    (last - first + 1).saturating_sub(used)
}

/// What went wrong with a run, for a reason: `exit 1`, `signal 9`, `oom-killed`, ...
fn failure(report: &JobExitReport) -> String {
    if let Some(err) = &report.launch_error {
        format!("launch failed: {err}")
    } else if report.oom_killed {
        "oom-killed".into()
    } else if let Some(code) = report.exit_code {
        format!("exit {code}")
    } else if let Some(sig) = report.signal {
        format!("signal {sig}")
    } else {
        "no exit status".into()
    }
}

/// Whether a run of `job` that ended as `report` (from `node`) is restarted, and the reason the
/// requeued job then shows (`requeued: part on gpu-02 failed (exit 1), restart 1 of 3`). The
/// caller has ruled out cancels, preemptions, fenced and never-started runs.
pub(crate) fn restart_reason(job: &Job, node: &str, report: &JobExitReport) -> Option<String> {
    let max = job.spec.sched.max_restarts?;
    if report.succeeded() || report.timed_out || report.idle_end.is_some() || job.restarts >= max {
        return None;
    }
    let gang = job.allocation.as_ref().is_some_and(|a| a.is_gang());
    let what = if gang { format!("part on {node} failed") } else { format!("run on {node} failed") };
    Some(format!("requeued: {what} ({}), restart {} of {max}", failure(report), job.restarts + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::tests::{node, req, spec, submit};
    use crate::{ClusterConfig, Command, Outcome, Placement, ScheduleOutcome};
    use corral_types::{JobId, JobState, NodeGpus};

    fn gang_spec(max_restarts: Option<u32>) -> corral_types::JobSpec {
        let mut s = spec(2);
        s.sched.gpus_per_node = Some(1);
        s.sched.max_restarts = max_restarts;
        s
    }

    fn gang_on(job_id: JobId, first: &str, second: &str, gpu: u32) -> Placement {
        Placement {
            job_id,
            node: first.into(),
            gpus: vec![gpu],
            more_nodes: vec![NodeGpus { node: second.into(), gpus: vec![gpu] }],
            slice: None,
        }
    }

    fn schedule(s: &mut State, ts: u64, placements: Vec<Placement>) -> ScheduleOutcome {
        match s.apply(&req(ts, Command::Schedule { placements, preemptions: vec![] })) {
            Ok(Outcome::Scheduled(out)) => out,
            other => panic!("{other:?}"),
        }
    }

    fn job_id(r: crate::Response) -> JobId {
        match r {
            Ok(Outcome::JobSubmitted { job_id, .. }) => job_id,
            other => panic!("{other:?}"),
        }
    }

    fn exit(code: i32) -> JobExitReport {
        JobExitReport { exit_code: Some(code), run_time_ms: 1000, ..Default::default() }
    }

    fn finish(s: &mut State, ts: u64, job_id: JobId, node: &str, report: JobExitReport) {
        let epoch = s.jobs[&job_id].allocation.as_ref().expect("running").epoch;
        s.apply(&req(ts, Command::JobFinished { job_id, epoch, node: node.into(), report })).expect("finished");
    }

    /// Two nodes with 4 GPUs; node a offers `range`.
    fn pool(range: Option<(u32, u32)>) -> State {
        let mut s = State::default();
        s.apply(&req(1, Command::Configure(ClusterConfig::dev_defaults()))).expect("configure");
        let mut a = node("a", 4);
        a.rendezvous_ports = range;
        s.apply(&req(1, Command::RegisterNode { spec: a })).expect("register");
        s.apply(&req(2, Command::RegisterNode { spec: node("b", 4) })).expect("register");
        s
    }

    #[test]
    fn a_gang_gets_the_lowest_free_port_of_its_first_node_and_frees_it_when_it_ends() {
        let mut s = pool(Some((30000, 30001)));
        let ids: Vec<JobId> = (0..4).map(|i| job_id(submit(&mut s, 10, &format!("g{i}"), gang_spec(None)))).collect();
        let out = schedule(&mut s, 20, vec![gang_on(ids[0], "a", "b", 0), gang_on(ids[1], "a", "b", 1)]);
        assert_eq!(out.placed, vec![ids[0], ids[1]]);
        let port = |s: &State, id| s.jobs[&id].allocation.as_ref().and_then(|a| a.master_port);
        assert_eq!((port(&s, ids[0]), port(&s, ids[1])), (Some(30000), Some(30001)));
        assert_eq!(free_port_count(&s, "a"), 0);
        // A gang whose first part is on b takes b's (default) range; a's is used up.
        let out = schedule(&mut s, 21, vec![gang_on(ids[2], "a", "b", 2), gang_on(ids[3], "b", "a", 3)]);
        assert_eq!(out.placed, vec![ids[3]]);
        assert!(out.rejected[0].1.contains("every rendezvous port of node a (30000-30001) is in use"), "{out:?}");
        assert_eq!(port(&s, ids[3]), Some(DEFAULT_RENDEZVOUS_PORTS.0));
        // The first gang ends: its port is free again, and the lowest one is taken.
        finish(&mut s, 30, ids[0], "a", exit(0));
        finish(&mut s, 31, ids[0], "b", exit(0));
        assert_eq!(s.jobs[&ids[0]].state, JobState::Succeeded);
        assert_eq!(free_port(&s, "a"), Ok(30000));
        let out = schedule(&mut s, 32, vec![gang_on(ids[2], "a", "b", 0)]);
        assert_eq!(out.placed, vec![ids[2]]);
        assert_eq!(port(&s, ids[2]), Some(30000));
    }

    #[test]
    fn the_scheduler_starts_a_gang_on_a_node_with_a_free_port_or_says_why_it_waits() {
        let mut s = pool(Some((30000, 30000)));
        let mut b = node("b", 4);
        b.rendezvous_ports = Some((30000, 30000));
        s.apply(&req(3, Command::RegisterNode { spec: b })).expect("register");
        let ids: Vec<JobId> = (0..3).map(|i| job_id(submit(&mut s, 10, &format!("g{i}"), gang_spec(None)))).collect();
        let pass = crate::schedule(&s, corral_types::Timestamp(20), &BTreeSet::new());
        // One port on a and one on b: two gangs start, each meeting on its own first node.
        let firsts: Vec<&str> = pass.placements.iter().map(|p| p.node.as_str()).collect();
        assert_eq!(pass.placements.len(), 2, "{pass:?}");
        assert_ne!(firsts[0], firsts[1], "{pass:?}");
        let waiting = pass.reasons();
        let reason = waiting.get(&ids[2]).expect("the third gang waits").to_string();
        assert!(reason.starts_with("gang: every rendezvous port of "), "{reason}");
        assert!(reason.contains("rendezvous-ports"), "{reason}");
        let command = pass.command().expect("placements");
        match s.apply(&req(20, command)) {
            Ok(Outcome::Scheduled(out)) => assert_eq!(out.placed.len(), 2, "{out:?}"),
            other => panic!("{other:?}"),
        }
        let ports: Vec<Option<u32>> =
            ids[..2].iter().map(|id| s.jobs[id].allocation.as_ref().and_then(|a| a.master_port)).collect();
        assert_eq!(ports, vec![Some(30000), Some(30000)], "one port each, on different nodes");
    }

    #[test]
    fn a_single_node_job_takes_no_port_and_a_bad_range_offers_none() {
        let mut s = pool(Some((30010, 30000)));
        let single = job_id(submit(&mut s, 10, "one", spec(1)));
        let gang = job_id(submit(&mut s, 10, "gang", gang_spec(None)));
        let one = Placement { job_id: single, node: "a".into(), gpus: vec![0], more_nodes: vec![], slice: None };
        let out = schedule(&mut s, 20, vec![one, gang_on(gang, "a", "b", 1)]);
        assert_eq!(out.placed, vec![single]);
        assert_eq!(s.jobs[&single].allocation.as_ref().and_then(|a| a.master_port), None);
        assert!(out.rejected[0].1.contains("no valid rendezvous port range"), "{out:?}");
        assert_eq!(free_port_count(&s, "a"), 0);
    }

    #[test]
    fn a_failed_gang_restarts_as_a_whole_until_max_restarts_then_fails() {
        let mut s = pool(None);
        let id = job_id(submit(&mut s, 10, "g", gang_spec(Some(1))));
        schedule(&mut s, 20, vec![gang_on(id, "a", "b", 0)]);
        // Part b fails: the run goes on holding both parts until a's part stopped too.
        finish(&mut s, 30, id, "b", exit(1));
        let job = &s.jobs[&id];
        assert_eq!(job.state, JobState::Running, "the allocation holds every part until all ended");
        assert!(job.allocation.as_ref().is_some_and(|a| a.stops_remaining_parts()));
        finish(&mut s, 31, id, "a", JobExitReport { signal: Some(15), ..Default::default() });
        let job = &s.jobs[&id];
        assert_eq!(job.state, JobState::Pending);
        assert_eq!(job.reason.as_deref(), Some("requeued: part on b failed (exit 1), restart 1 of 1"));
        assert_eq!((job.restarts, job.attempts), (1, 1));
        assert!(job.allocation.is_none());
        assert!(s.allocated_gpus("a").is_empty() && s.allocated_gpus("b").is_empty());

        // The second attempt fails too: the job fails, and says after how many restarts.
        schedule(&mut s, 40, vec![gang_on(id, "b", "a", 1)]);
        finish(&mut s, 50, id, "a", exit(3));
        finish(&mut s, 51, id, "b", JobExitReport { signal: Some(15), ..Default::default() });
        let job = &s.jobs[&id];
        assert_eq!(job.state, JobState::Failed);
        assert_eq!((job.restarts, job.attempts, job.exit_code), (1, 2, Some(3)));
        assert_eq!(job.reason.as_deref(), Some("exit code 3 (on node a), after 1 restart"));
    }

    #[test]
    fn a_single_node_job_restarts_but_never_after_a_cancel_a_timeout_or_a_lost_node_count() {
        let mut s = pool(None);
        let mut one = spec(1);
        one.sched.max_restarts = Some(2);
        let id = job_id(submit(&mut s, 10, "one", one.clone()));
        let on_a = |id| Placement { job_id: id, node: "a".into(), gpus: vec![0], more_nodes: vec![], slice: None };
        schedule(&mut s, 20, vec![on_a(id)]);
        finish(&mut s, 30, id, "a", JobExitReport { oom_killed: true, signal: Some(9), ..Default::default() });
        let job = &s.jobs[&id];
        assert_eq!(job.state, JobState::Pending);
        assert_eq!(job.reason.as_deref(), Some("requeued: run on a failed (oom-killed), restart 1 of 2"));

        // A lost node requeues as before, without counting a restart.
        schedule(&mut s, 40, vec![on_a(id)]);
        s.apply(&req(41, Command::RegisterNode { spec: node("a", 4) })).expect("re-register");
        let job = &s.jobs[&id];
        assert_eq!((job.state, job.restarts), (JobState::Pending, 1));

        // A cancelled run is never restarted.
        schedule(&mut s, 50, vec![on_a(id)]);
        s.apply(&req(51, Command::CancelJob { job_id: id, reason: String::new() })).expect("cancel");
        finish(&mut s, 52, id, "a", JobExitReport { signal: Some(15), ..Default::default() });
        assert_eq!(s.jobs[&id].state, JobState::Cancelled);

        // A run killed at its time limit is not restarted either.
        let timed = job_id(submit(&mut s, 60, "timed", one));
        schedule(&mut s, 61, vec![on_a(timed)]);
        finish(&mut s, 62, timed, "a", JobExitReport { timed_out: true, signal: Some(9), ..Default::default() });
        assert_eq!((s.jobs[&timed].state, s.jobs[&timed].restarts), (JobState::Failed, 0));
    }

    #[test]
    fn without_max_restarts_a_failed_gang_fails_at_once() {
        let mut s = pool(None);
        let id = job_id(submit(&mut s, 10, "g", gang_spec(None)));
        schedule(&mut s, 20, vec![gang_on(id, "a", "b", 0)]);
        finish(&mut s, 30, id, "a", exit(2));
        finish(&mut s, 31, id, "b", JobExitReport { signal: Some(15), ..Default::default() });
        let job = &s.jobs[&id];
        assert_eq!((job.state, job.restarts), (JobState::Failed, 0));
        assert_eq!(job.reason.as_deref(), Some("exit code 2 (on node a)"));
    }

    /// An image gang's parts say their image is ready one by one: each node once, only nodes of
    /// the current run, and a new run starts with none ready.
    #[test]
    fn image_gang_parts_are_ready_once_each_and_only_for_their_run() {
        let mut s = pool(None);
        let id = job_id(submit(&mut s, 3, "default", gang_spec(Some(1))));
        schedule(&mut s, 4, vec![gang_on(id, "a", "b", 0)]);
        let epoch = s.jobs[&id].allocation.as_ref().expect("placed").epoch;
        let ready = |s: &mut State, ts, epoch, node: &str| {
            s.apply(&req(ts, Command::PartReady { job_id: id, epoch, node: node.into() })).expect("applies")
        };
        let all_ready = |s: &State| s.jobs[&id].allocation.as_ref().is_some_and(|a| a.all_ready());
        assert_eq!(ready(&mut s, 5, epoch, "a"), Outcome::Done);
        assert_eq!(ready(&mut s, 6, epoch, "a"), Outcome::Done, "again: no change");
        assert!(!all_ready(&s), "b is still pulling");
        assert_eq!(ready(&mut s, 7, epoch, "c"), Outcome::Stale, "no part there");
        assert_eq!(ready(&mut s, 7, epoch + 1, "b"), Outcome::Stale, "another run");
        assert_eq!(ready(&mut s, 8, epoch, "b"), Outcome::Done);
        assert!(all_ready(&s));
        assert_eq!(s.jobs[&id].allocation.as_ref().expect("placed").ready, vec!["a".to_string(), "b".to_string()]);
        // Part b fails; the gang is requeued (one restart allowed) and runs again with none ready.
        finish(&mut s, 9, id, "b", exit(1));
        finish(&mut s, 10, id, "a", JobExitReport { signal: Some(15), run_time_ms: 1000, ..Default::default() });
        assert_eq!(s.jobs[&id].state, JobState::Pending, "{:?}", s.jobs[&id].reason);
        schedule(&mut s, 11, vec![gang_on(id, "a", "b", 1)]);
        let again = s.jobs[&id].allocation.as_ref().expect("placed again");
        assert!(again.epoch > epoch && again.ready.is_empty(), "{again:?}");
        assert_eq!(ready(&mut s, 12, epoch, "a"), Outcome::Stale, "the old run's report");
    }

    /// A session's parts say when their GPUs are idle past the timeout and when busy again:
    /// `all_idle` holds only while every part is idle, and only for the current run.
    #[test]
    fn session_parts_are_idle_until_busy_again_and_all_idle_needs_every_part() {
        let mut s = pool(None);
        let id = job_id(submit(&mut s, 3, "default", gang_spec(None)));
        schedule(&mut s, 4, vec![gang_on(id, "a", "b", 0)]);
        let epoch = s.jobs[&id].allocation.as_ref().expect("placed").epoch;
        let say = |s: &mut State, ts, epoch, node: &str, idle| {
            s.apply(&req(ts, Command::PartIdle { job_id: id, epoch, node: node.into(), idle })).expect("applies")
        };
        let all_idle = |s: &State| s.jobs[&id].allocation.as_ref().is_some_and(|a| a.all_idle());
        assert_eq!(say(&mut s, 5, epoch, "a", true), Outcome::Done);
        assert_eq!(say(&mut s, 6, epoch, "a", true), Outcome::Done, "again: no change");
        assert!(!all_idle(&s), "b is busy");
        assert_eq!(say(&mut s, 7, epoch, "b", true), Outcome::Done);
        assert!(all_idle(&s));
        assert_eq!(say(&mut s, 8, epoch, "a", false), Outcome::Done);
        assert!(!all_idle(&s), "a is busy again");
        assert_eq!(s.jobs[&id].allocation.as_ref().expect("placed").idle, vec!["b".to_string()]);
        assert_eq!(say(&mut s, 9, epoch, "c", true), Outcome::Stale, "no part there");
        assert_eq!(say(&mut s, 9, epoch + 1, "a", true), Outcome::Stale, "another run");
        finish(&mut s, 10, id, "b", exit(0));
        assert_eq!(say(&mut s, 11, epoch, "b", false), Outcome::Stale, "b's part ended");
    }
}
