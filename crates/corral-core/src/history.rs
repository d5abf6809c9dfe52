//! Compaction of the hot state: finished jobs and billed segments leave memory for the on-disk
//! history, request ids expire, and history past its retention is deleted — all driven by one
//! replicated command (`Command::Compact`), so every replica moves the same records at the same
//! log index.
//!
//! The hot state (`State`) keeps live jobs, jobs finished less than the archive delay ago and
//! segments written in that delay; the state machine store writes what a compaction moved
//! (`Touched::archived`) to its history and applies the retention cutoffs
//! (`Touched::history_cutoffs`) to it. Apply itself never reads the history.
//!
//! Invariant: a job is archived only when it is terminal, and a job array only with all its
//! tasks, once the array itself ended; a task of a live array stays hot. Invariant: the
//! cutoffs of a command are clamped to its own timestamp (a proposal cannot archive the future).

use crate::{Outcome, Response, State};
use corral_types::{Job, JobId, Segment, Timestamp};
use serde::{Deserialize, Serialize};

/// Most jobs (tasks of an array included) and segments one compaction moves: a backlog (a
/// bulk cancel of a million jobs) leaves over several commands, each one a bounded apply and
/// store batch. Candidates go in id order, so every replica moves the same ones.
pub const MAX_ARCHIVED_PER_COMPACTION: usize = 20_000;

/// What an array task holds of its own, for `max_finished_bytes`: its command, environment and
/// script are its array's, shared, and counted once with the array.
const TASK_BYTES: u64 = 512;

/// What `job` weighs against `max_finished_bytes`.
fn finished_weight(job: &Job) -> u64 {
    if job.array_task.is_some() {
        TASK_BYTES + job.reason.as_deref().map_or(0, str::len) as u64
    } else {
        job.approx_bytes() as u64
    }
}

/// Cutoffs of one compaction, computed by the leader from its configured delays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactCutoffs {
    /// Jobs that finished and segments that ended before this leave the hot state.
    pub archive_before: Timestamp,
    /// Request ids of submits before this expire (a retry after that creates a new job).
    pub request_ids_before: Timestamp,
    /// History records of jobs submitted before this are deleted (`None`: kept).
    pub jobs_before: Option<Timestamp>,
    /// Billing segments that ended before this are deleted (`None`: kept).
    pub segments_before: Option<Timestamp>,
    /// When the finished jobs still in the hot state weigh more than this (about, by
    /// [`Job::approx_bytes`]), the oldest finished leave too, before `archive_before`, until
    /// they weigh no more (`None`: only `archive_before` counts). What finished jobs hold in
    /// memory is then bounded by configuration, not by how much and how fast tenants submit.
    #[serde(default)]
    pub max_finished_bytes: Option<u64>,
}

/// What a compaction did, for the state machine store and the caller.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compacted {
    pub archived_jobs: u64,
    pub archived_segments: u64,
    pub expired_request_ids: u64,
}

/// The client request id of a submit and when it was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub job_id: JobId,
    pub at: Timestamp,
}

/// A client request id as the hot state keeps it: the first 128 bits of its SHA-256.
///
/// Up to a day of request ids stay in memory and in every snapshot; a fixed 16-byte key instead
/// of the string makes each entry small and lets a snapshot write the whole table as one packed
/// field. Two ids share a key only by a SHA-256 collision on 128 bits, which no client can
/// produce, on purpose or by chance (at a billion ids a day, about 1 in 10^21 per day), so the
/// key stands for the id.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestKey(pub [u8; 16]);

impl RequestKey {
    pub fn of(request_id: &str) -> RequestKey {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(request_id.as_bytes());
        let mut key = [0; 16];
        key.copy_from_slice(&digest[..16]);
        RequestKey(key)
    }
}

impl std::fmt::Debug for RequestKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// What a compaction took out of the hot state: the store writes it to the history.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Archive {
    /// Jobs moved to the history (in id order).
    pub jobs: Vec<Job>,
    /// Segments that left the hot ledger (the store has them unless they were written in the
    /// same batch: a run that ended long before its report arrived).
    pub segments: Vec<Segment>,
    /// The cutoffs whose retention the store applies to its history.
    pub cutoffs: Option<CompactCutoffs>,
}

impl State {
    /// Applies `Command::Compact`: moves finished jobs and ended segments out, expires request
    /// ids. What moved is left in `self.archive` for `apply_tracked`.
    pub(crate) fn compact(&mut self, ts: Timestamp, cutoffs: &CompactCutoffs) -> Response {
        let clamp = |t: Timestamp| t.min(ts);
        let cutoffs = CompactCutoffs {
            archive_before: clamp(cutoffs.archive_before),
            request_ids_before: clamp(cutoffs.request_ids_before),
            jobs_before: cutoffs.jobs_before.map(clamp),
            segments_before: cutoffs.segments_before.map(clamp),
            max_finished_bytes: cutoffs.max_finished_bytes,
        };
        let before = cutoffs.archive_before;
        let finished = |job: &Job| job.finished_at.unwrap_or(job.submitted_at);
        // Tasks leave with their array; an array leaves once it ended and each of its tasks did.
        let candidates: Vec<JobId> = (self.index.ended.iter())
            .filter_map(|id| self.jobs.get(id))
            .filter(|job| job.array_task.is_none() && job.state.is_terminal() && finished(job) < before)
            .map(|job| job.id)
            .collect();
        let mut moved = Vec::new();
        for id in candidates {
            if moved.len() >= MAX_ARCHIVED_PER_COMPACTION {
                break;
            }
            self.take_finished(id, &mut moved);
        }
        // Past the weight budget, the oldest finished leave too (by finish time, then id: the
        // same order on every replica).
        if let Some(budget) = cutoffs.max_finished_bytes {
            let mut weight: u64 = self.index.ended.iter().filter_map(|id| self.jobs.get(id)).map(finished_weight).sum();
            if weight > budget {
                let mut oldest: Vec<(Timestamp, JobId)> = (self.index.ended.iter())
                    .filter_map(|id| self.jobs.get(id))
                    .filter(|job| job.array_task.is_none() && job.state.is_terminal())
                    .map(|job| (finished(job), job.id))
                    .collect();
                oldest.sort_unstable();
                for (_, id) in oldest {
                    if weight <= budget || moved.len() >= MAX_ARCHIVED_PER_COMPACTION {
                        break;
                    }
                    let from = moved.len();
                    self.take_finished(id, &mut moved);
                    weight = weight.saturating_sub(moved[from..].iter().map(finished_weight).sum());
                }
            }
        }
        moved.sort_unstable_by_key(|j| j.id);
        let mut segments = Vec::new();
        while let Some(entry) = self.ledger.first_entry() {
            if entry.get().end >= before || segments.len() >= MAX_ARCHIVED_PER_COMPACTION {
                break;
            }
            let segment = entry.remove();
            self.archived_billed.entry(segment.tenant.clone()).or_default().add(&segment);
            segments.push(segment);
        }
        let archived_segments = segments.len() as u64;
        self.segments_archived_below = self.ledger.keys().next().copied().unwrap_or(self.next_segment_id);
        // Oldest first: the work is what expires, not what is kept.
        self.request_ids_expired_before = self.request_ids_expired_before.max(cutoffs.request_ids_before);
        let mut expired = 0;
        while let Some(first) = self.request_order.first() {
            if first.0 >= self.request_ids_expired_before {
                break;
            }
            let Some((_, key)) = self.request_order.pop_first() else { break };
            self.request_ids.remove(&key);
            expired += 1;
        }
        let outcome = Compacted { archived_jobs: moved.len() as u64, archived_segments, expired_request_ids: expired };
        self.archive = Archive { jobs: moved, segments, cutoffs: Some(cutoffs) };
        Ok(Outcome::Compacted(outcome))
    }

    /// Moves finished job `id` (an array: with all its tasks, once each of them ended) out of
    /// the hot state into `moved`; an array with a task not ended yet stays.
    fn take_finished(&mut self, id: JobId, moved: &mut Vec<Job>) {
        let tasks: Vec<JobId> = if self.jobs[&id].is_array() { self.array_tasks(id).collect() } else { Vec::new() };
        if tasks.iter().any(|t| self.jobs.get(t).is_some_and(|task| !task.state.is_terminal())) {
            return;
        }
        for task in tasks {
            if let Some(job) = self.jobs.remove(&task) {
                self.index.forget(&job);
                moved.push(job);
            }
        }
        if let Some(job) = self.jobs.remove(&id) {
            self.index.forget(&job);
            moved.push(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::apply::tests::{cluster, spec};
    use crate::{Command, Outcome, Request, State};
    use corral_types::{ArraySpec, JobExitReport, JobSpec, JobState, Timestamp};

    fn at(ms: u64) -> Timestamp {
        Timestamp::compose(ms, 0)
    }

    fn apply(s: &mut State, ms: u64, command: Command) -> (crate::Response, crate::Touched) {
        s.apply_tracked(&Request { ts: at(ms), command })
    }

    fn compact(s: &mut State, ms: u64, archive_before_ms: u64) -> (Outcome, crate::Touched) {
        let cutoffs = super::CompactCutoffs {
            archive_before: at(archive_before_ms),
            request_ids_before: at(archive_before_ms),
            jobs_before: None,
            segments_before: None,
            max_finished_bytes: None,
        };
        let (response, touched) = apply(s, ms, Command::Compact(cutoffs));
        (response.expect("compact"), touched)
    }

    /// Runs job `id` on n1 and ends it with exit code 0 at `end_ms`.
    fn run_to_end(s: &mut State, id: u64, start_ms: u64, end_ms: u64) {
        apply(s, start_ms, Command::PlaceJob { job_id: id, node: "n1".into(), gpus: vec![0] }).0.expect("place");
        let epoch = s.jobs[&id].allocation.as_ref().expect("allocation").epoch;
        apply(s, start_ms + 1, Command::JobStarted { job_id: id, epoch }).0.expect("started");
        let report =
            JobExitReport { exit_code: Some(0), run_time_ms: end_ms - start_ms - 1, ..JobExitReport::default() };
        apply(s, end_ms, Command::JobFinished { job_id: id, epoch, node: "n1".into(), report }).0.expect("finished");
    }

    /// Only jobs finished before the cutoff leave; live ones and recent ones stay, the index
    /// equals a rebuild, the segments of archived runs leave the hot ledger but the billing
    /// totals keep them, and request ids expire by submit time.
    #[test]
    fn compaction_moves_only_what_ended_before_the_cutoff() {
        let mut s = cluster();
        for (i, ms) in [(1, 10), (2, 11), (3, 12)] {
            apply(&mut s, ms, Command::SubmitJob { request_id: format!("r{i}"), spec: spec(1) }).0.expect("submit");
        }
        run_to_end(&mut s, 1, 100, 1_000);
        run_to_end(&mut s, 2, 1_100, 5_000);
        let billed = s.billed_by_tenant();
        let (outcome, touched) = compact(&mut s, 6_000, 2_000);
        let Outcome::Compacted(done) = outcome else { panic!("{outcome:?}") };
        assert_eq!((done.archived_jobs, done.archived_segments), (1, 1));
        assert_eq!(touched.archived.iter().map(|j| j.id).collect::<Vec<_>>(), vec![1]);
        assert!(!s.jobs.contains_key(&1) && s.jobs.contains_key(&2) && s.jobs.contains_key(&3));
        assert_eq!(s.ledger.keys().copied().collect::<Vec<_>>(), vec![2]);
        assert_eq!(s.segments_archived_below, 2);
        assert_eq!(s.billed_by_tenant(), billed, "totals keep archived segments");
        // Request ids of submits before 2 s expired (all three were at 10-12 ms).
        assert_eq!(done.expired_request_ids, 3);
        assert!(s.request_ids.is_empty());
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index);
        // A retry of an expired request id is a new job.
        let (response, _) = apply(&mut s, 6_001, Command::SubmitJob { request_id: "r3".into(), spec: spec(1) });
        assert!(matches!(response, Ok(Outcome::JobSubmitted { job_id: 4, duplicate: false })));
    }

    /// A backlog leaves over several compactions, the lowest ids first.
    #[test]
    fn one_compaction_moves_a_bounded_number_of_jobs() {
        let mut s = cluster();
        let n = super::MAX_ARCHIVED_PER_COMPACTION + 5;
        let jobs = (0..n).map(|i| (format!("r{i}"), spec(1))).collect();
        apply(&mut s, 10, Command::SubmitJobs { jobs }).0.expect("submit");
        let job_ids: Vec<u64> = s.jobs.keys().copied().collect();
        let (response, _) = apply(&mut s, 20, Command::CancelJobs { job_ids, reason: "bulk".into() });
        assert!(matches!(response, Ok(Outcome::JobsCancelled(ids)) if ids.len() == n));
        let (_, first) = compact(&mut s, 1_000, 500);
        assert_eq!(first.archived.len(), super::MAX_ARCHIVED_PER_COMPACTION);
        assert_eq!(first.archived.first().map(|j| j.id), Some(1));
        let (_, second) = compact(&mut s, 1_001, 500);
        assert_eq!(second.archived.iter().map(|j| j.id).collect::<Vec<_>>(), (20_001..=20_005).collect::<Vec<_>>());
        assert!(s.jobs.is_empty());
    }

    /// The cutoff of a proposal is clamped to the command's timestamp.
    #[test]
    fn a_cutoff_in_the_future_archives_only_the_past() {
        let mut s = cluster();
        apply(&mut s, 10, Command::SubmitJob { request_id: "r1".into(), spec: spec(1) }).0.expect("submit");
        run_to_end(&mut s, 1, 100, 1_000);
        let (outcome, _) = compact(&mut s, 500, u64::MAX >> 20);
        let Outcome::Compacted(done) = outcome else { panic!("{outcome:?}") };
        assert_eq!(done.archived_jobs, 0, "the job finished after the command's timestamp");
        assert!(s.jobs.contains_key(&1));
    }

    /// A task of a live array stays hot; the array leaves with all its tasks once it ended.
    #[test]
    fn an_array_leaves_with_its_tasks() {
        let mut s = cluster();
        let array = ArraySpec::parse("0-1").expect("array");
        let spec = JobSpec { array: Some(array), ..spec(1) };
        apply(&mut s, 10, Command::SubmitJob { request_id: "a".into(), spec }).0.expect("submit");
        let tasks: Vec<u64> = s.jobs.values().filter(|j| j.array_task.is_some()).map(|j| j.id).collect();
        assert_eq!(tasks.len(), 2);
        run_to_end(&mut s, tasks[0], 100, 1_000);
        let (outcome, _) = compact(&mut s, 3_000, 2_000);
        assert_eq!(
            outcome,
            Outcome::Compacted(super::Compacted { archived_jobs: 0, archived_segments: 1, expired_request_ids: 1 }),
            "the ended run's segment leaves, the task stays"
        );
        assert!(s.jobs.contains_key(&tasks[0]), "a task of a live array stays");
        run_to_end(&mut s, tasks[1], 3_100, 4_000);
        assert_eq!(s.jobs[&1].state, JobState::Succeeded);
        let (_, touched) = compact(&mut s, 9_000, 8_000);
        let mut moved: Vec<u64> = touched.archived.iter().map(|j| j.id).collect();
        moved.sort_unstable();
        assert_eq!(moved, vec![1, tasks[0], tasks[1]]);
        assert!(s.jobs.is_empty());
        assert_eq!(s.array_task(1, 0), None);
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index);
    }

    /// Finished jobs past the weight budget leave before their delay, the oldest finished
    /// first, until what stays weighs no more than the budget; live jobs never leave.
    #[test]
    fn finished_jobs_past_the_weight_budget_leave_oldest_first() {
        let mut s = cluster();
        let big = || JobSpec { script: Some(format!("#!/bin/sh\n#{}\n", "x".repeat(100_000)).into()), ..spec(1) };
        for i in 1..=5 {
            apply(&mut s, 10 + i, Command::SubmitJob { request_id: format!("r{i}"), spec: big() }).0.expect("submit");
        }
        // Jobs 1-4 end in the order 3, 1, 4, 2; job 5 stays pending.
        for (id, end) in [(3, 1_000), (1, 2_000), (4, 3_000), (2, 4_000)] {
            run_to_end(&mut s, id, end - 500, end);
        }
        let weight = s.jobs[&1].approx_bytes() as u64;
        let cutoffs = super::CompactCutoffs {
            archive_before: at(0),
            request_ids_before: at(0),
            jobs_before: None,
            segments_before: None,
            max_finished_bytes: Some(2 * weight),
        };
        let (response, touched) = apply(&mut s, 5_000, Command::Compact(cutoffs));
        let Ok(Outcome::Compacted(done)) = response else { panic!("{response:?}") };
        assert_eq!(done.archived_jobs, 2);
        assert_eq!(touched.archived.iter().map(|j| j.id).collect::<Vec<_>>(), vec![1, 3], "the two that ended first");
        assert_eq!(s.jobs.keys().copied().collect::<Vec<_>>(), vec![2, 4, 5]);
        // Within the budget, nothing more leaves.
        let (response, touched) = apply(&mut s, 5_001, Command::Compact(cutoffs));
        assert!(matches!(response, Ok(Outcome::Compacted(ref d)) if d.archived_jobs == 0), "{response:?}");
        assert!(touched.archived.is_empty());
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index);
        // The pending job stays however small the budget.
        let tiny = super::CompactCutoffs { max_finished_bytes: Some(0), ..cutoffs };
        apply(&mut s, 5_002, Command::Compact(tiny)).0.expect("compact");
        assert_eq!(s.jobs.keys().copied().collect::<Vec<_>>(), vec![5]);
    }
}
