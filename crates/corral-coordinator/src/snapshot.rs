//! What a request handler reads: a [`Snapshot`], handed out by `Coordinator::snapshot` at the
//! start of a request, as rust-analyzer hands its request handlers a `GlobalStateSnapshot`.
//! Taking one costs two `Arc` clones; it is immutable to the handler and holds everything the
//! reads of the user API, watches and the web view need, so that a read does not go through
//! the coordinator.
//!
//! It holds the store of the applied state, not a frozen copy of it: copying `State` would
//! cost its nodes, tokens and ledger (only its jobs and request ids are persistent maps). Each
//! read takes the state's read lock for one step and lets it go (never across an `.await`),
//! and sees everything applied by then. The leader's memory is frozen: the last scheduling
//! pass as it was when the snapshot was taken.

use crate::pulls::PullBoard;
use crate::reply::job_reply;
use crate::scheduler::PendingJobs;
use crate::CoordError;
use corral_core::ApplyError;
use corral_proto::v1 as pb;
use corral_raft::{StateMachineStore, StateRead};
use corral_types::{Job, JobId, JobSpec};
use std::sync::Arc;

/// A handler's view of the coordinator's state: the applied state (and the history of
/// finished jobs) and the leader's last scheduling pass.
#[derive(Clone)]
pub(crate) struct Snapshot {
    store: StateMachineStore,
    pending: Arc<PendingJobs>,
    /// Live, not frozen: the pulls workers reported last.
    pulls: Arc<PullBoard>,
}

/// What a job reference (`12` or `12_7`) names.
pub(crate) enum Target {
    Job(Job),
    /// A task of an array not created yet.
    Uncreated {
        array: Job,
        index: u32,
    },
}

impl Snapshot {
    pub(crate) fn new(store: StateMachineStore, pending: Arc<PendingJobs>, pulls: Arc<PullBoard>) -> Snapshot {
        Snapshot { store, pending, pulls }
    }

    /// The applied state, read-locked. Never hold the guard across an `.await`.
    #[track_caller]
    pub(crate) fn read(&self) -> StateRead<'_> {
        self.store.read()
    }

    /// The store: the history of finished jobs and segments, the change log, applied-index
    /// notifications.
    pub(crate) fn store(&self) -> &StateMachineStore {
        &self.store
    }

    /// The pending jobs of the leader's last scheduling pass.
    pub(crate) fn pending(&self) -> &PendingJobs {
        &self.pending
    }

    /// The image pulls workers reported last.
    pub(crate) fn pulls(&self) -> &PullBoard {
        &self.pulls
    }

    /// `job` as the API returns it (see [`job_reply`]).
    pub(crate) fn job_reply(&self, job: &Job) -> pb::Job {
        let mut reply = job_reply(job, &self.pending);
        // A placed run whose image is still being pulled says so (leader memory only).
        if reply.reason.is_none() {
            reply.reason = self.pulls.detail(job);
        }
        reply
    }

    /// `job` as a watch and a brief listing send it: [`Self::job_reply`] without the script and
    /// the environment, the parts of a spec that may take megabytes (`GetJob` has them). A watch
    /// buffers a few events, and a principal may hold `limits.max-watches-per-principal`
    /// watches: without them an event is at most the command's cap plus a few KiB, whatever the
    /// jobs hold. Neither is copied or encoded (the spec holds them behind `Arc`s).
    pub(crate) fn brief_reply(&self, job: &Job) -> pb::Job {
        let mut brief = job.clone();
        brief.spec.script = None;
        brief.spec.env = Default::default();
        self.job_reply(&brief)
    }

    /// Job `job_id` from the hot state, or else from the history of finished jobs.
    pub(crate) fn find_job(&self, job_id: JobId) -> Option<Job> {
        let hot = self.store.read().state.jobs.get(&job_id).cloned();
        hot.or_else(|| self.store.archived_job(job_id))
    }

    /// Job `job_id`, or the one `NotFound` error of the API.
    pub(crate) fn job(&self, job_id: JobId) -> Result<Job, CoordError> {
        self.find_job(job_id).ok_or_else(|| CoordError::NotFound(format!("job {job_id} not found")))
    }

    /// The job `job_id`, or task `array_index` of array `job_id`, once `owned` accepts it: the
    /// job's owner (for a task, its array's) is checked before anything about the task is
    /// looked up. Bound: O(log jobs) under the state's read lock, plus O(ranges) of the array
    /// (at most `MAX_ARRAY_RANGES`), and a read of the history for a job that left the hot
    /// state; a job's copy shares its script, environment and command.
    pub(crate) fn resolve<E>(
        &self,
        job_id: JobId,
        array_index: Option<u32>,
        owned: impl Fn(&Job) -> Result<(), E>,
    ) -> Result<Target, E>
    where
        E: From<CoordError>,
    {
        let not_an_array = |index: u32| {
            CoordError::InvalidArgument(format!("job {job_id} is not an array: write {job_id}, not {job_id}_{index}"))
        };
        let Some(index) = array_index else {
            let job = self.job(job_id)?;
            owned(&job)?;
            return Ok(Target::Job(job));
        };
        let hot = self.store.read().state.jobs.get(&job_id).cloned();
        let Some(array) = hot else {
            // An array that ended long ago: it and its tasks are in the history.
            let array = self
                .store
                .archived_job(job_id)
                .ok_or_else(|| CoordError::NotFound(format!("job {job_id} not found")))?;
            owned(&array)?;
            if array.spec.array.is_none() {
                return Err(not_an_array(index).into());
            }
            return self.store.archived_task(job_id, index).map(Target::Job).ok_or_else(|| {
                CoordError::NotFound(format!("array {job_id} ended without a task {index} (or it left the history)"))
                    .into()
            });
        };
        owned(&array)?;
        let Some(spec) = &array.spec.array else { return Err(not_an_array(index).into()) };
        let task = {
            let data = self.store.read();
            data.state.array_task(job_id, index).and_then(|task| data.state.jobs.get(&task).cloned())
        };
        if let Some(task) = task {
            return Ok(Target::Job(task));
        }
        if !spec.contains(index) {
            return Err(CoordError::NotFound(format!("array {job_id} has no task {index}")).into());
        }
        Ok(Target::Uncreated { array, index })
    }

    /// Judges the dependencies of `spec` on jobs that already left the hot state (they ended
    /// long ago, their outcome is final): met ones are dropped from the spec, one that can never
    /// be met (or names another tenant's job) refuses the submit. Dependencies on other jobs are
    /// left to apply.
    pub(crate) fn settle_archived_dependencies(&self, mut spec: JobSpec) -> Result<JobSpec, CoordError> {
        if spec.sched.dependencies.is_empty() {
            return Ok(spec);
        }
        let mut kept = Vec::with_capacity(spec.sched.dependencies.len());
        for dep in std::mem::take(&mut spec.sched.dependencies) {
            if self.store.read().state.jobs.contains_key(&dep.job_id) {
                kept.push(dep);
                continue;
            }
            let Some(target) = self.store.archived_job(dep.job_id) else {
                kept.push(dep);
                continue;
            };
            if target.spec.tenant != spec.tenant {
                return Err(CoordError::Rejected(ApplyError::InvalidDependency(format!(
                    "job {} belongs to another tenant",
                    target.display_id()
                ))));
            }
            if let corral_core::DepStatus::Never(why) = corral_core::dep_status(dep.kind, &target) {
                return Err(CoordError::Rejected(ApplyError::InvalidDependency(format!(
                    "{}:{} can never be met: {why}",
                    dep.kind.as_str(),
                    dep.job_id
                ))));
            }
        }
        spec.sched.dependencies = kept;
        Ok(spec)
    }
}
