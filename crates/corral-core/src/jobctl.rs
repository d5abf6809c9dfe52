//! Slurm-style job control in the replicated state: job arrays whose tasks are created as they
//! may run, dependencies (afterok, afterany, afternotok, singleton), hold and release, requeue,
//! signals, and updates of pending jobs.
//!
//! Invariant: what follows from a job's change (its dependents, its array) is applied in the same
//! command (`follow_up`), so every replica sees the same consequences at the same log index.
//! Invariant: a job array holds at most its window (`ArraySpec::window`: `%N`, else
//! `DEFAULT_ARRAY_WINDOW`, never above `MAX_ARRAY_WINDOW`) unfinished tasks; the others exist
//! only as the array's cursor, so an array of 100 000 tasks is one record. A task's record is
//! small whatever the array's script, environment and command: its spec shares them with the
//! array's (`JobSpec`'s shared parts). No two tasks of an array created here have the same
//! index (apply refuses an array that lists an index twice); a record of an earlier version may
//! have two, and cancels and compaction reach both (`Index::array_tasks` keeps every task).
//! Invariant: a pending job that is held or waits on a dependency is not in the queue.
//!
//! Entries committed by an earlier version are applied with today's rules when replayed: an
//! array whose index list overlaps itself, has more than `MAX_ARRAY_RANGES` ranges or a `%N`
//! above `MAX_ARRAY_WINDOW` (`--array 0-99999%100000`) is refused, and creates nothing; an array
//! of a tenant whose unstarted tasks would exceed its `max-pending-jobs` likewise. An array of an
//! earlier version's state (a snapshot) that asks for more runs at most `MAX_ARRAY_WINDOW` tasks
//! at once. Every replica replays the same entries with the same rules, so they agree; the jobs
//! an earlier version had created from such an entry are not created again.

use crate::{ApplyError, JobUpdate, Outcome, Response, State};
use corral_types::{
    ArrayProgress, ArrayTask, DependencyKind, Job, JobId, JobSpec, JobState, Timestamp, REQUEUE_PREEMPTOR,
};

/// Most signals `corral signal` may queue for one job.
pub const MAX_SIGNALS: usize = 64;

/// Where a dependency stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DepStatus {
    Met,
    Waiting,
    Never(String),
}

/// Where a dependency of `kind` on `target` stands (the coordinator judges dependencies on jobs
/// in the history with it too).
pub fn dep_status(kind: DependencyKind, target: &Job) -> DepStatus {
    if !target.state.is_terminal() {
        return DepStatus::Waiting;
    }
    let ok = target.state == JobState::Succeeded;
    match kind {
        DependencyKind::AfterAny => DepStatus::Met,
        DependencyKind::AfterOk if ok => DepStatus::Met,
        DependencyKind::AfterOk => DepStatus::Never(format!("job {} ended {}", target.display_id(), target.state)),
        DependencyKind::AfterNotOk if ok => DepStatus::Never(format!("job {} succeeded", target.display_id())),
        DependencyKind::AfterNotOk => DepStatus::Met,
    }
}

impl State {
    /// The jobs a new job with `spec` must wait for; refuses dependencies on unknown jobs, on
    /// another tenant's jobs, or that can no longer be met.
    pub(crate) fn dependencies_of(&self, spec: &JobSpec) -> Result<Vec<JobId>, ApplyError> {
        let mut waiting = Vec::new();
        for dep in &spec.sched.dependencies {
            let target = self
                .jobs
                .get(&dep.job_id)
                .ok_or_else(|| ApplyError::InvalidDependency(format!("job {} not found", dep.job_id)))?;
            if target.spec.tenant != spec.tenant {
                return Err(ApplyError::InvalidDependency(format!(
                    "job {} belongs to another tenant",
                    target.display_id()
                )));
            }
            match dep_status(dep.kind, target) {
                DepStatus::Met => {}
                DepStatus::Waiting => waiting.push(dep.job_id),
                DepStatus::Never(why) => {
                    return Err(ApplyError::InvalidDependency(format!(
                        "{}:{} can never be met: {why}",
                        dep.kind.as_str(),
                        dep.job_id
                    )))
                }
            }
        }
        if spec.sched.singleton {
            // Every earlier unfinished job of this tenant and name (tasks of arrays aside).
            waiting.extend(
                self.live_jobs()
                    .filter(|j| j.array_task.is_none() && j.spec.tenant == spec.tenant && j.spec.name == spec.name)
                    .map(|j| j.id),
            );
        }
        waiting.sort_unstable();
        waiting.dedup();
        Ok(waiting)
    }

    /// Takes `job_id` out of the index before a change of the fields the index files it by.
    fn unfile(&mut self, job_id: JobId) {
        if let Some(job) = self.jobs.get(&job_id) {
            let job = job.clone();
            self.index.set_state(&job, JobState::Cancelled);
        }
    }

    /// Handles what the jobs changed by the last command imply: their dependents, their arrays.
    pub(crate) fn follow_up(&mut self, ts: Timestamp) {
        while let Some(id) = self.follow_ups.pop() {
            let Some(job) = self.jobs.get(&id) else { continue };
            let (state, task, array) = (job.state, job.array_task, job.is_array());
            if let Some(task) = task {
                if state.is_terminal() {
                    if let Some(p) = self.jobs.get_mut(&task.array).and_then(|a| a.array_progress.as_mut()) {
                        if state == JobState::Succeeded {
                            p.succeeded += 1;
                        } else {
                            p.unsuccessful += 1;
                        }
                    }
                }
                self.advance_array(ts, task.array, state == JobState::Running);
            }
            if array {
                self.advance_array(ts, id, false);
            }
            if state.is_terminal() {
                self.release_dependents(ts, id);
            }
        }
    }

    /// Creates the array's next tasks while its window has room, and brings the array's own
    /// state along: running once a task ran, ended once every task ended. Costs O(ranges) plus
    /// O(log jobs) per task created, at most the window's worth.
    fn advance_array(&mut self, ts: Timestamp, array_id: JobId, task_started: bool) {
        let Some(array) = self.jobs.get(&array_id) else { return };
        let Some(spec) = array.spec.array.clone() else { return };
        if array.state.is_terminal() {
            return;
        }
        let total = spec.len();
        let window = spec.window();
        let blocked = array.held || !array.waiting_on.is_empty() || array.cancel_requested;
        let mut progress = array.array_progress.clone().unwrap_or_default();
        // Shares the array's script, environment and command: each task is a small record.
        let template = task_spec(&array.spec);
        let mut created = Vec::new();
        let mut indices = spec.indices_from(u64::from(progress.created));
        while !blocked && u64::from(progress.created) < total && self.array_live_tasks(array_id) < window {
            let Some(index) = indices.next() else { break };
            progress.created += 1;
            let id = self.next_job_id;
            self.next_job_id += 1;
            // A skipped index leaves the list as its (cancelled) task is created.
            let skipped = match progress.skipped.binary_search(&index) {
                Ok(at) => {
                    progress.skipped.remove(at);
                    true
                }
                Err(_) => false,
            };
            let (state, reason) = if skipped {
                (JobState::Cancelled, Some("cancelled before it started".to_string()))
            } else {
                (JobState::Pending, None)
            };
            let job = Job {
                state,
                finished_at: skipped.then_some(ts),
                reason,
                array_task: Some(ArrayTask { array: array_id, index }),
                ..Job::pending(id, template.clone(), String::new(), ts)
            };
            self.jobs.insert(id, job);
            // A skipped task is counted by `follow_up` like any task that ended.
            self.set_job_state_index(id, state);
            created.push(id);
        }
        self.followed.extend(created);
        let live = self.array_live_tasks(array_id);
        let Some(array) = self.jobs.get_mut(&array_id) else { return };
        // Every task ended, or the array was cancelled and its last created task ended.
        let done = live == 0 && (u64::from(progress.created) >= total || array.cancel_requested);
        array.array_progress = Some(progress);
        self.followed.insert(array_id);
        let new_state = if done {
            let p = array.array_progress.as_ref().cloned().unwrap_or_default();
            if array.cancel_requested {
                JobState::Cancelled
            } else if p.unsuccessful == 0 {
                JobState::Succeeded
            } else {
                array.reason = Some(format!("{} of {total} tasks did not succeed", p.unsuccessful));
                JobState::Failed
            }
        } else if task_started && array.state == JobState::Pending {
            if array.started_at.is_none() {
                array.started_at = Some(ts);
            }
            JobState::Running
        } else {
            // Its tasks still to create changed: they count as pending jobs of its tenant.
            self.refile(array_id);
            return;
        };
        if new_state.is_terminal() {
            array.finished_at = Some(ts);
        }
        array.state = new_state;
        self.set_job_state_index(array_id, new_state);
    }

    /// `target` ended: its waiting dependents go on (or end, when it can never be met).
    fn release_dependents(&mut self, ts: Timestamp, target: JobId) {
        let waiters: Vec<JobId> =
            self.index.dependents.get(&target).map(|w| w.iter().copied().collect()).unwrap_or_default();
        for waiter in waiters {
            let (Some(job), Some(ended)) = (self.jobs.get(&waiter), self.jobs.get(&target)) else { continue };
            if job.state != JobState::Pending {
                continue;
            }
            let mut kinds: Vec<DependencyKind> =
                job.spec.sched.dependencies.iter().filter(|d| d.job_id == target).map(|d| d.kind).collect();
            if kinds.is_empty() {
                // A singleton waits for the other job to end, however.
                kinds.push(DependencyKind::AfterAny);
            }
            let never = kinds.iter().find_map(|k| match dep_status(*k, ended) {
                DepStatus::Never(why) => Some(format!("{}:{} can never be met: {why}", k.as_str(), target)),
                _ => None,
            });
            self.unfile(waiter);
            let Some(job) = self.jobs.get_mut(&waiter) else { continue };
            let array = job.is_array();
            let state = match never {
                Some(why) => {
                    job.waiting_on.clear();
                    job.state = JobState::Cancelled;
                    job.finished_at = Some(ts);
                    job.reason = Some(format!("cancelled: dependency {why}"));
                    JobState::Cancelled
                }
                None => {
                    job.waiting_on.retain(|t| *t != target);
                    if job.reason.as_deref().is_some_and(|r| r.starts_with("dependency")) {
                        job.reason = waiting_reason(&job.waiting_on);
                    }
                    JobState::Pending
                }
            };
            self.set_job_state_index(waiter, state);
            if array && state == JobState::Pending {
                self.follow_ups.push(waiter);
            }
            self.followed.insert(waiter);
        }
    }

    /// Tasks of array `array_id` whose state passes `wanted`, in index order (every one, should
    /// an earlier version have created two of one index).
    fn tasks_of(&self, array_id: JobId, wanted: impl Fn(JobState) -> bool) -> Vec<JobId> {
        self.array_tasks(array_id).filter(|id| self.jobs.get(id).is_some_and(|j| wanted(j.state))).collect()
    }

    /// Files job `id` again as it is now (an array whose tasks still to create changed).
    fn refile(&mut self, id: JobId) {
        if let Some(job) = self.jobs.get(&id) {
            self.index.set_state(job, job.state);
        }
    }

    pub(crate) fn hold(&mut self, job_id: JobId, hold: bool) -> Response {
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if !controllable_while_pending(job) {
            return Err(ApplyError::JobControl(format!(
                "job {} is {}: only pending jobs can be held or released",
                job.display_id(),
                job.state
            )));
        }
        let mut ids = vec![job_id];
        if job.is_array() {
            ids.extend(self.tasks_of(job_id, |s| s == JobState::Pending));
        }
        let mut changed = false;
        for id in ids {
            let Some(job) = self.jobs.get(&id) else { continue };
            if job.held == hold {
                continue;
            }
            let state = job.state;
            self.unfile(id);
            let Some(job) = self.jobs.get_mut(&id) else { continue };
            job.held = hold;
            job.reason = hold.then(|| format!("held: corral release {} lets it run", job.display_id()));
            self.set_job_state_index(id, state);
            self.followed.insert(id);
            changed = true;
        }
        if !hold && self.jobs.get(&job_id).is_some_and(Job::is_array) {
            self.follow_ups.push(job_id);
        }
        if !changed {
            return Ok(Outcome::Stale);
        }
        Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())))
    }

    pub(crate) fn requeue_request(&mut self, ts: Timestamp, job_id: JobId) -> Response {
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if job.is_array() {
            return Err(ApplyError::JobControl(format!(
                "job {job_id} is an array: requeue its running tasks one by one ({job_id}_N)"
            )));
        }
        if job.state != JobState::Running {
            return Err(ApplyError::JobControl(format!(
                "job {} is {}: only a running job can be requeued",
                job.display_id(),
                job.state
            )));
        }
        if job.cancel_requested || job.preemption.is_some() {
            return Ok(Outcome::Stale);
        }
        self.stop_for_requeue(ts, job_id, REQUEUE_PREEMPTOR);
        Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())))
    }

    pub(crate) fn signal_job(&mut self, job_id: JobId, signal: i32) -> Response {
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if !(1..=64).contains(&signal) {
            return Err(ApplyError::JobControl(format!("signal {signal} is not a signal number (1 to 64)")));
        }
        let targets = if job.is_array() { self.tasks_of(job_id, |s| s == JobState::Running) } else { vec![job_id] };
        let job = &self.jobs[&job_id];
        if targets.is_empty() || (!job.is_array() && job.state != JobState::Running) {
            return Err(ApplyError::JobControl(format!(
                "job {} has nothing running to signal ({})",
                job.display_id(),
                job.state
            )));
        }
        for id in targets {
            let Some(job) = self.jobs.get_mut(&id) else { continue };
            if job.signals.len() >= MAX_SIGNALS {
                return Err(ApplyError::JobControl(format!(
                    "job {} has {MAX_SIGNALS} signals queued already",
                    job.display_id()
                )));
            }
            job.signals.push(signal);
            self.followed.insert(id);
        }
        Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())))
    }

    /// Updates a pending job, or an array and its pending tasks. O(spec) for the array and for
    /// its tasks' shared spec, and O(log jobs) per task (at most the array's window).
    pub(crate) fn update_job(&mut self, job_id: JobId, update: &JobUpdate, admin: bool) -> Response {
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if !controllable_while_pending(job) {
            return Err(ApplyError::JobControl(format!(
                "job {} is {}: only pending jobs can be updated",
                job.display_id(),
                job.state
            )));
        }
        let mut ids = vec![job_id];
        if job.is_array() {
            ids.extend(self.tasks_of(job_id, |s| s == JobState::Pending));
        }
        // Check every change first: the update applies to all or none. An array's own index set
        // does not change and is not checked again (an earlier version's record may not pass).
        // An array's tasks share one spec: it is checked once, not once per task (comparing
        // specs that share their large parts compares the small ones).
        let mut specs = Vec::new();
        let mut last_checked: Option<(JobSpec, JobSpec)> = None;
        for id in &ids {
            let job = &self.jobs[id];
            let mut spec = JobSpec { array: None, ..job.spec.clone() };
            if let Some(t) = update.time_limit_secs {
                if !admin && job.spec.time_limit_secs.is_none_or(|old| t > old) {
                    return Err(ApplyError::JobControl(format!(
                        "a tenant may only shorten a job's time limit (job {}: {} asked, {} now); an admin may lengthen it",
                        job.display_id(),
                        crate::format_secs(t),
                        job.spec.time_limit_secs.map_or("none".into(), crate::format_secs)
                    )));
                }
                spec.time_limit_secs = Some(t);
            }
            if let Some(class) = &update.priority_class {
                spec.priority_class = class.clone();
            }
            if let Some(gpus) = update.gpus {
                spec.gpus = gpus;
            }
            if let Some(name) = &update.name {
                spec.name = name.clone();
            }
            let mut checked = match &last_checked {
                Some((asked, checked)) if *asked == spec => checked.clone(),
                _ => {
                    let checked = self.check_submit(&spec)?;
                    last_checked = Some((spec, checked.clone()));
                    checked
                }
            };
            checked.array = job.spec.array.clone();
            specs.push((*id, checked));
        }
        for (id, spec) in specs {
            let state = self.jobs[&id].state;
            self.unfile(id);
            if let Some(job) = self.jobs.get_mut(&id) {
                job.spec = spec;
            }
            self.set_job_state_index(id, state);
            self.followed.insert(id);
        }
        Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())))
    }

    /// Cancels task `index` of an array: its task, or the index before its task is created.
    /// O(ranges + log jobs), and O(skipped) to note an index not created yet.
    pub(crate) fn cancel_array_task(&mut self, ts: Timestamp, array_id: JobId, index: u32, reason: &str) -> Response {
        let array = self.jobs.get(&array_id).ok_or(ApplyError::NoSuchJob(array_id))?;
        let Some(spec) = &array.spec.array else {
            return Err(ApplyError::JobControl(format!("job {array_id} is not an array")));
        };
        if !spec.contains(index) {
            return Err(ApplyError::JobControl(format!("array {array_id} has no task {index}")));
        }
        let tasks: Vec<JobId> = self.array_tasks_at(array_id, index).collect();
        if !tasks.is_empty() {
            // One task, or each of an index an earlier version created twice.
            let live: Vec<JobId> =
                tasks.iter().copied().filter(|t| self.jobs.get(t).is_some_and(|j| !j.state.is_terminal())).collect();
            let Some((&last, others)) = live.split_last() else { return self.cancel(ts, tasks[0], reason) };
            for task in others {
                self.cancel(ts, *task, reason)?;
                self.followed.insert(*task);
            }
            return self.cancel(ts, last, reason);
        }
        let created = array.array_progress.as_ref().map_or(0, |p| p.created);
        // Past the cursor but without a task: only in an earlier version's odd record.
        let passed = spec.position_of(index).is_some_and(|n| n < u64::from(created));
        if array.state.is_terminal() || passed {
            return Ok(Outcome::Stale);
        }
        let array = self.jobs.get_mut(&array_id).ok_or(ApplyError::NoSuchJob(array_id))?;
        let progress = array.array_progress.get_or_insert_with(ArrayProgress::default);
        if let Err(at) = progress.skipped.binary_search(&index) {
            progress.skipped.insert(at, index);
        }
        self.refile(array_id);
        self.followed.insert(array_id);
        Ok(Outcome::Job(Box::new(self.jobs[&array_id].clone())))
    }

    /// Cancels an array: its unfinished tasks, and no new ones; it ends once they have.
    pub(crate) fn cancel_array(&mut self, ts: Timestamp, array_id: JobId, reason: &str) -> Response {
        let tasks = self.tasks_of(array_id, |s| !s.is_terminal());
        let Some(array) = self.jobs.get_mut(&array_id) else { return Err(ApplyError::NoSuchJob(array_id)) };
        if array.state.is_terminal() || array.cancel_requested {
            return Ok(Outcome::Job(Box::new(array.clone())));
        }
        array.cancel_requested = true;
        array.reason = Some(reason.to_string());
        for task in tasks {
            self.cancel(ts, task, reason)?;
            self.followed.insert(task);
        }
        self.follow_ups.push(array_id);
        Ok(Outcome::Job(Box::new(self.jobs[&array_id].clone())))
    }
}

/// A pending job, or an unfinished array (whose pending tasks and tasks to come are concerned).
fn controllable_while_pending(job: &Job) -> bool {
    job.state == JobState::Pending || (job.is_array() && !job.state.is_terminal())
}

/// Why a job with unmet dependencies waits (`None`: it does not).
pub(crate) fn waiting_reason(waiting_on: &[JobId]) -> Option<String> {
    if waiting_on.is_empty() {
        return None;
    }
    let ids: Vec<String> = waiting_on.iter().map(u64::to_string).collect();
    Some(format!("dependency: waits for job {}", ids.join(", ")))
}

/// The spec of an array's tasks: the array's, without what belongs to the array itself.
fn task_spec(array: &JobSpec) -> JobSpec {
    let mut spec = array.clone();
    spec.array = None;
    spec.sched.dependencies.clear();
    spec.sched.singleton = false;
    spec.sched.hold = false;
    spec
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::tests::{cluster, spec};
    use crate::{schedule, Command, Request};
    use corral_types::{ArrayRange, ArraySpec, Dependency, JobExitReport};
    use std::collections::BTreeSet;

    fn at(ms: u64, command: Command) -> Request {
        Request { ts: Timestamp::compose(ms, 0), command }
    }

    fn submit(s: &mut State, ms: u64, spec: JobSpec) -> Result<JobId, ApplyError> {
        let rid = format!("r{}", s.next_job_id);
        match s.apply(&at(ms, Command::SubmitJob { request_id: rid, spec })) {
            Ok(Outcome::JobSubmitted { job_id, .. }) => Ok(job_id),
            Err(e) => Err(e),
            other => panic!("{other:?}"),
        }
    }

    /// A scheduling pass whose placements are applied and started.
    fn pass(s: &mut State, ms: u64) -> Vec<JobId> {
        let pass = schedule(s, Timestamp::compose(ms, 0), &BTreeSet::new());
        let placed: Vec<JobId> = pass.placements.iter().map(|p| p.job_id).collect();
        if let Some(command) = pass.command() {
            s.apply(&at(ms, command)).unwrap();
        }
        for id in &placed {
            let epoch = s.jobs[id].allocation.as_ref().unwrap().epoch;
            s.apply(&at(ms, Command::JobStarted { job_id: *id, epoch })).unwrap();
        }
        placed
    }

    fn finish(s: &mut State, ms: u64, id: JobId, code: i32) {
        let epoch = s.jobs[&id].allocation.as_ref().unwrap().epoch;
        let node = s.jobs[&id].allocation.as_ref().unwrap().node.clone();
        let report = JobExitReport { exit_code: Some(code), run_time_ms: 10, ..Default::default() };
        s.apply(&at(ms, Command::JobFinished { job_id: id, epoch, node, report })).unwrap();
    }

    fn assert_index_exact(s: &State) {
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index, "the maintained index equals a rebuild");
    }

    fn array_spec(first: u32, last: u32, max_running: Option<u32>) -> JobSpec {
        let mut a = spec(1);
        a.array = Some(ArraySpec { ranges: vec![ArrayRange { first, last, step: 1 }], max_running });
        a
    }

    #[test]
    fn an_array_runs_every_task_and_never_more_than_its_throttle() {
        let mut s = cluster();
        let array = submit(&mut s, 10, array_spec(0, 19, Some(4))).unwrap();
        assert_eq!(s.array_live_tasks(array), 4, "only the throttle's worth of tasks exist");
        assert_eq!(s.jobs[&array].state, JobState::Pending);
        let mut ms = 20;
        let mut seen = BTreeSet::new();
        while !s.jobs[&array].state.is_terminal() {
            let placed = pass(&mut s, ms);
            let running = s.running_jobs().filter(|j| j.array_task.is_some()).count();
            assert!(running <= 4, "{running} tasks run at once");
            assert_eq!(s.jobs[&array].state, JobState::Running);
            for id in placed {
                seen.insert(s.jobs[&id].array_task.unwrap().index);
                let code = if s.jobs[&id].array_task.unwrap().index == 7 { 1 } else { 0 };
                finish(&mut s, ms + 1, id, code);
            }
            assert_index_exact(&s);
            ms += 10;
            assert!(ms < 10_000);
        }
        assert_eq!(seen, (0..20).collect());
        let a = &s.jobs[&array];
        assert_eq!(a.state, JobState::Failed);
        assert_eq!(a.reason.as_deref(), Some("1 of 20 tasks did not succeed"));
        let p = a.array_progress.as_ref().unwrap();
        assert_eq!((p.created, p.succeeded, p.unsuccessful), (20, 19, 1));
        assert_eq!(s.jobs[&s.array_task(array, 3).unwrap()].display_id(), format!("{array}_3"));
    }

    #[test]
    fn cancelling_an_array_or_one_task_created_or_not() {
        let mut s = cluster();
        let array = submit(&mut s, 10, array_spec(1, 10, Some(2))).unwrap();
        // Task 9 does not exist yet: it is created cancelled when its turn comes.
        s.apply(&at(15, Command::CancelArrayTask { array, index: 9, reason: "not needed".into() })).unwrap();
        let task1 = s.array_task(array, 1).unwrap();
        s.apply(&at(16, Command::CancelArrayTask { array, index: 1, reason: "x".into() })).unwrap();
        assert_eq!(s.jobs[&task1].state, JobState::Cancelled);
        assert!(s.apply(&at(17, Command::CancelArrayTask { array, index: 11, reason: "x".into() })).is_err());
        let mut ms = 20;
        while s.array_task(array, 9).is_none() {
            for id in pass(&mut s, ms) {
                finish(&mut s, ms + 1, id, 0);
            }
            ms += 10;
        }
        assert_eq!(s.jobs[&s.array_task(array, 9).unwrap()].state, JobState::Cancelled);
        // The whole array: its running and pending tasks end, no new ones come.
        pass(&mut s, ms);
        let created = s.jobs[&array].array_progress.as_ref().unwrap().created;
        s.apply(&at(ms + 5, Command::CancelJob { job_id: array, reason: "done with it".into() })).unwrap();
        let running: Vec<JobId> = s.running_jobs().map(|j| j.id).collect();
        for id in running {
            finish(&mut s, ms + 6, id, 143);
        }
        assert_eq!(s.jobs[&array].state, JobState::Cancelled);
        assert_eq!(
            s.jobs[&array].array_progress.as_ref().unwrap().created,
            created,
            "no task created after the cancel"
        );
        assert!(s.live_jobs().next().is_none(), "{:?}", s.live_jobs().map(|j| j.display_id()).collect::<Vec<_>>());
        assert_index_exact(&s);
    }

    #[test]
    fn an_index_listed_twice_is_refused_and_counted_tasks_are_pending_jobs() {
        let mut s = cluster();
        let mut twice = array_spec(0, 0, None);
        twice.array.as_mut().unwrap().ranges.push(ArrayRange { first: 0, last: 0, step: 1 });
        let err = submit(&mut s, 10, twice).unwrap_err().to_string();
        assert!(err.starts_with("invalid array: 0 and 0 overlap"), "{err}");
        assert!(s.jobs.is_empty(), "nothing created");
        // A tenant allowed 4 pending jobs: an array of 5 is refused, one of 3 counts 3, created
        // or not, and then a job more fits, and no other.
        let mut policy = s.config.clone();
        policy.tenant_policies.entry("default".into()).or_default().max_pending_jobs = Some(4);
        s.apply(&at(11, Command::Configure(policy))).unwrap();
        let err = submit(&mut s, 12, array_spec(0, 4, Some(1))).unwrap_err().to_string();
        assert_eq!(
            err,
            "an array of 5 tasks would give tenant 'default' 5 pending jobs, above its limit of 4 \
             (max-pending-jobs counts each task not started yet): wait for some to start or end, or submit a smaller array"
        );
        let array = submit(&mut s, 13, array_spec(0, 2, Some(1))).unwrap();
        assert_eq!((s.array_live_tasks(array), s.pending_count_of("default")), (1, 3));
        submit(&mut s, 14, spec(1)).unwrap();
        let err = submit(&mut s, 15, spec(1)).unwrap_err().to_string();
        assert!(err.starts_with("tenant 'default' has 4 pending jobs, its limit"), "{err}");
        // Cancelling an index not created yet takes it off the count.
        s.apply(&at(16, Command::CancelArrayTask { array, index: 2, reason: "x".into() })).unwrap();
        assert_eq!(s.pending_count_of("default"), 3);
        assert_index_exact(&s);
    }

    /// A state an earlier version left: array 1 lists index 0 twice and created a task for
    /// each. Cancelling the index, or the array, reaches both, and compaction archives them.
    #[test]
    fn tasks_an_earlier_version_created_twice_are_cancelled_and_archived() {
        for cancel_array in [false, true] {
            let mut s = cluster();
            let mut old = array_spec(0, 0, None);
            old.array.as_mut().unwrap().ranges.push(ArrayRange { first: 0, last: 0, step: 1 });
            let ts = Timestamp::compose(10, 0);
            let progress = ArrayProgress { created: 2, ..Default::default() };
            let array = Job { array_progress: Some(progress), ..Job::pending(1, old.clone(), "r".into(), ts) };
            s.jobs.insert(1, array);
            for id in [2, 3] {
                let task = Job {
                    array_task: Some(ArrayTask { array: 1, index: 0 }),
                    ..Job::pending(id, task_spec(&old), String::new(), ts)
                };
                s.jobs.insert(id, task);
            }
            s.next_job_id = 4;
            s.rebuild_indexes();
            assert_eq!(s.array_tasks_at(1, 0).collect::<Vec<_>>(), vec![2, 3]);
            assert_eq!(s.array_task(1, 0), Some(3));
            let command = if cancel_array {
                Command::CancelJob { job_id: 1, reason: "x".into() }
            } else {
                Command::CancelArrayTask { array: 1, index: 0, reason: "x".into() }
            };
            s.apply(&at(20, command)).unwrap();
            for id in [2, 3] {
                assert_eq!(s.jobs[&id].state, JobState::Cancelled, "job {id}");
            }
            // Every task ended: so did the array (cancelled, or failed as its tasks were).
            assert!(s.jobs[&1].state.is_terminal() && s.live_jobs().next().is_none());
            let cutoffs = crate::CompactCutoffs {
                archive_before: Timestamp::compose(30, 0),
                request_ids_before: Timestamp::compose(30, 0),
                jobs_before: None,
                segments_before: None,
                max_finished_bytes: None,
            };
            let (_, touched) = s.apply_tracked(&at(40, Command::Compact(cutoffs)));
            assert_eq!(touched.archived.iter().map(|j| j.id).collect::<Vec<_>>(), vec![1, 2, 3]);
            assert!(s.jobs.is_empty());
            assert_index_exact(&s);
        }
    }

    #[test]
    fn dependencies_run_in_order_and_end_when_they_can_never_be_met() {
        let mut s = cluster();
        let a = submit(&mut s, 10, spec(1)).unwrap();
        let after = |kind, on: JobId, s: &mut State| {
            let mut b = spec(1);
            b.sched.dependencies = vec![Dependency { kind, job_id: on }];
            submit(s, 11, b).unwrap()
        };
        let b = after(DependencyKind::AfterOk, a, &mut s);
        let c = after(DependencyKind::AfterOk, b, &mut s);
        let if_b_fails = after(DependencyKind::AfterNotOk, b, &mut s);
        let any = after(DependencyKind::AfterAny, b, &mut s);
        assert_eq!(pass(&mut s, 20), vec![a], "only the job without dependencies runs");
        assert_eq!(s.jobs[&b].reason.as_deref(), Some(format!("dependency: waits for job {a}").as_str()));
        finish(&mut s, 30, a, 0);
        assert_eq!(pass(&mut s, 40), vec![b]);
        finish(&mut s, 50, b, 2);
        // b failed: c can never run, the afternotok and afterany ones can.
        assert_eq!(s.jobs[&c].state, JobState::Cancelled);
        assert!(s.jobs[&c].reason.as_deref().unwrap().contains(&format!("afterok:{b} can never be met")));
        let mut placed = pass(&mut s, 60);
        placed.sort_unstable();
        assert_eq!(placed, vec![if_b_fails, any]);
        assert_index_exact(&s);
        // Bad dependencies are refused: unknown, another tenant's, already impossible.
        let mut bad = spec(1);
        bad.sched.dependencies = vec![Dependency { kind: DependencyKind::AfterOk, job_id: 999 }];
        assert_eq!(submit(&mut s, 70, bad.clone()).unwrap_err().to_string(), "invalid dependency: job 999 not found");
        bad.sched.dependencies[0].job_id = b;
        assert!(submit(&mut s, 70, bad.clone()).unwrap_err().to_string().contains("can never be met"));
        bad.tenant = "team-a".into();
        bad.sched.dependencies[0].job_id = a;
        assert!(submit(&mut s, 70, bad).unwrap_err().to_string().contains("belongs to another tenant"));
    }

    #[test]
    fn a_singleton_waits_for_the_earlier_job_of_its_name() {
        let mut s = cluster();
        let mut one = spec(1);
        one.name = "nightly".into();
        one.sched.singleton = true;
        let first = submit(&mut s, 10, one.clone()).unwrap();
        let second = submit(&mut s, 11, one).unwrap();
        assert_eq!(pass(&mut s, 20), vec![first]);
        finish(&mut s, 30, first, 1);
        assert_eq!(pass(&mut s, 40), vec![second], "it waits for the end, whatever the end");
    }

    #[test]
    fn hold_release_update_requeue_and_signal() {
        let mut s = cluster();
        let mut held = spec(1);
        held.sched.hold = true;
        held.time_limit_secs = Some(3600);
        let job = submit(&mut s, 10, held).unwrap();
        assert!(pass(&mut s, 20).is_empty(), "a held job waits");
        assert!(s.jobs[&job].reason.as_deref().unwrap().starts_with("held"));
        let shorten = JobUpdate { time_limit_secs: Some(600), name: Some("renamed".into()), ..Default::default() };
        s.apply(&at(25, Command::UpdateJob { job_id: job, update: shorten, admin: false })).unwrap();
        let longer = JobUpdate { time_limit_secs: Some(7200), ..Default::default() };
        let err =
            s.apply(&at(26, Command::UpdateJob { job_id: job, update: longer.clone(), admin: false })).unwrap_err();
        assert!(err.to_string().contains("may only shorten"), "{err}");
        s.apply(&at(27, Command::UpdateJob { job_id: job, update: longer, admin: true })).unwrap();
        let bad_class = JobUpdate { priority_class: Some("nope".into()), ..Default::default() };
        assert!(s.apply(&at(28, Command::UpdateJob { job_id: job, update: bad_class, admin: true })).is_err());
        assert_eq!((s.jobs[&job].spec.name.as_str(), s.jobs[&job].spec.time_limit_secs), ("renamed", Some(7200)));
        s.apply(&at(30, Command::HoldJob { job_id: job, hold: false })).unwrap();
        assert_eq!(pass(&mut s, 40), vec![job]);
        let err = s.apply(&at(45, Command::HoldJob { job_id: job, hold: true })).unwrap_err();
        assert!(err.to_string().contains("only pending jobs"), "{err}");
        s.apply(&at(50, Command::SignalJob { job_id: job, signal: 10 })).unwrap();
        assert_eq!(s.jobs[&job].signals, vec![10]);
        s.apply(&at(60, Command::RequeueJob { job_id: job })).unwrap();
        assert_eq!(s.jobs[&job].preemption.as_ref().map(|p| p.by), Some(REQUEUE_PREEMPTOR));
        finish(&mut s, 70, job, 0);
        assert_eq!(s.jobs[&job].state, JobState::Pending);
        assert_eq!(s.jobs[&job].reason.as_deref(), Some("requeued: by request (corral requeue)"));
        assert!(s.apply(&at(80, Command::SignalJob { job_id: job, signal: 10 })).is_err());
        assert_index_exact(&s);
    }
}
