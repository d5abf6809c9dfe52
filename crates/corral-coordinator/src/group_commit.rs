//! The submit path of a coordinator ([`Submits`]). Group commit of submits: concurrent `Submit`
//! calls that arrive while a proposal is in flight are carried by the next single Raft entry
//! (`SubmitJobs`), so one fsync and one replication round acknowledge many jobs. At low load a
//! submit is proposed at once, alone. Admission of batches: a `SubmitBatch` is one entry of its
//! own, and at most `BATCHES_IN_FLIGHT` of them are in the Raft pipeline at once.
//!
//! Backpressure: the jobs waiting to be proposed — single submits queued here and batches
//! waiting for a pipeline slot — are bounded by [`SubmitQueue`] (`limits.max-queued-submits`);
//! past it a submit is refused at once with RESOURCE_EXHAUSTED and a retry-after, instead of
//! piling up memory and latency. A queued submit whose caller has gone (deadline, cancel) is
//! dropped before its entry is proposed.
//!
//! Invariant: a caller is answered only after its job's entry is committed and applied; each
//! job keeps its own request id, validation and answer.

use crate::{CoordError, Coordinator};
use corral_core::{ApplyError, Command, Outcome};
use corral_types::{JobId, JobSpec};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Semaphore};

/// Most submits carried by one entry.
const MAX_GROUP: usize = 512;
/// Entries proposed concurrently: one being written while the next one fills up.
const IN_FLIGHT: usize = 2;
/// `SubmitBatch` entries a leader keeps in the Raft pipeline at once.
const BATCHES_IN_FLIGHT: usize = 2;
/// Bounds of the retry-after a refused submit is given.
const MIN_RETRY_AFTER: Duration = Duration::from_millis(50);
const MAX_RETRY_AFTER: Duration = Duration::from_secs(5);
/// Default of `limits.max-queued-submits`.
pub const DEFAULT_MAX_QUEUED_SUBMITS: usize = 100_000;

/// Failpoint (test builds): each group waits this many milliseconds before it is proposed, so
/// a test can fill the queue deterministically (`FAILPOINTS=group-commit-delay-ms=return(300)`).
pub const GROUP_COMMIT_DELAY_FAILPOINT: &str = "group-commit-delay-ms";

type Reply = oneshot::Sender<Result<(JobId, bool), CoordError>>;

/// The submit path of one coordinator: the bound on jobs waiting to be proposed, group commit
/// of single submits, and the admission of batches into the Raft pipeline.
pub(crate) struct Submits {
    /// The bound on jobs waiting to be proposed, shared by `Submit` and `SubmitBatch`.
    queue: Arc<SubmitQueue>,
    /// Set once by `serve`: batches concurrent submits into one Raft entry.
    group: OnceLock<GroupCommit>,
    /// At most this many batch entries in the Raft pipeline at once; further callers wait
    /// here instead of piling megabytes of entries onto the followers (which then miss
    /// heartbeats and call elections).
    batch_slots: Semaphore,
}

impl Submits {
    /// A submit path whose queue holds at most `max_queued` jobs.
    pub(crate) fn new(max_queued: usize) -> Submits {
        Submits {
            queue: SubmitQueue::new(max_queued),
            group: OnceLock::new(),
            batch_slots: Semaphore::new(BATCHES_IN_FLIGHT),
        }
    }

    /// Starts group commit for `coord` (once: `serve` calls it); returns the task to abort
    /// when the server stops.
    pub(crate) fn start(&self, coord: Coordinator) -> tokio::task::JoinHandle<()> {
        let (group, task) = GroupCommit::start(coord, self.queue.clone());
        let _ = self.group.set(group);
        task
    }

    /// The bound on jobs waiting to be proposed (its gauges are exported).
    pub(crate) fn queue(&self) -> &SubmitQueue {
        &self.queue
    }

    /// Submits one job through group commit (or alone, before `serve` started it).
    pub(crate) async fn submit(
        &self,
        coord: &Coordinator,
        request_id: String,
        spec: JobSpec,
    ) -> Result<(JobId, bool), CoordError> {
        if let Some(group) = self.group.get() {
            return group.submit(request_id, spec).await;
        }
        match coord.propose(Command::SubmitJob { request_id, spec }).await? {
            Outcome::JobSubmitted { job_id, duplicate } => Ok((job_id, duplicate)),
            other => Err(CoordError::Raft(format!("unexpected outcome of submit: {other:?}"))),
        }
    }

    /// Proposes `jobs` as one entry of their own, once admitted: they count against the
    /// queue's bound while they wait for one of `BATCHES_IN_FLIGHT` pipeline slots, and the
    /// entry waits while a follower lags. Returns each job's outcome, in order.
    pub(crate) async fn submit_batch(
        &self,
        coord: &Coordinator,
        jobs: Vec<(String, JobSpec)>,
    ) -> Result<Vec<Result<(JobId, bool), ApplyError>>, CoordError> {
        let admitted = self.queue.admit(jobs.len())?;
        let _slot = self
            .batch_slots
            .acquire()
            .await
            .map_err(|_| CoordError::Unavailable("coordinator is shutting down".into()))?;
        drop(admitted);
        coord.hold_while_followers_lag().await;
        match coord.propose(Command::SubmitJobs { jobs }).await? {
            Outcome::JobsSubmitted(results) => Ok(results),
            other => Err(CoordError::Raft(format!("unexpected outcome of batch submit: {other:?}"))),
        }
    }
}

struct Pending {
    request_id: String,
    spec: JobSpec,
    reply: Reply,
}

/// A pending submit and its place in the queue's bound (freed when it is taken into a group).
struct Queued {
    pending: Pending,
    _admitted: Admitted,
}

/// The bound on jobs waiting to be proposed, shared by `Submit` and `SubmitBatch`.
#[derive(Debug)]
pub(crate) struct SubmitQueue {
    queued: AtomicUsize,
    capacity: usize,
    /// Moving average of how long one submit entry took to commit, in microseconds (0: none yet).
    commit_us: AtomicU64,
    /// Jobs refused because the queue was full (exported as a metric).
    pub(crate) refused: prometheus_client::metrics::counter::Counter,
}

/// Jobs admitted into the queue; they leave it when this is dropped.
#[derive(Debug)]
pub(crate) struct Admitted {
    queue: Arc<SubmitQueue>,
    jobs: usize,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.queue.queued.fetch_sub(self.jobs, Ordering::AcqRel);
    }
}

impl SubmitQueue {
    pub(crate) fn new(capacity: usize) -> Arc<SubmitQueue> {
        Arc::new(SubmitQueue {
            queued: AtomicUsize::new(0),
            capacity: capacity.max(1),
            commit_us: AtomicU64::new(0),
            refused: Default::default(),
        })
    }

    /// Admits `jobs` more jobs, or refuses them when the queue would exceed its capacity. An
    /// empty queue takes anything (a batch larger than the bound goes alone).
    pub(crate) fn admit(self: &Arc<Self>, jobs: usize) -> Result<Admitted, CoordError> {
        let mut current = self.queued.load(Ordering::Acquire);
        loop {
            if current > 0 && current.saturating_add(jobs) > self.capacity {
                self.refused.inc_by(jobs as u64);
                return Err(CoordError::Overloaded {
                    queued: current,
                    capacity: self.capacity,
                    retry_after: self.retry_after(current),
                });
            }
            match self.queued.compare_exchange_weak(current, current + jobs, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(Admitted { queue: self.clone(), jobs }),
                Err(now) => current = now,
            }
        }
    }

    /// Jobs waiting now.
    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// About how long `queued` jobs take to drain at the recent commit pace (MAX_GROUP jobs per
    /// entry, IN_FLIGHT entries at once), within [MIN_RETRY_AFTER, MAX_RETRY_AFTER].
    fn retry_after(&self, queued: usize) -> Duration {
        let entries = queued.div_ceil(MAX_GROUP).max(1) as u64;
        let per_entry_us = self.commit_us.load(Ordering::Relaxed).max(1_000);
        Duration::from_micros(entries * per_entry_us / IN_FLIGHT as u64).clamp(MIN_RETRY_AFTER, MAX_RETRY_AFTER)
    }

    /// Records how long one entry took to commit.
    fn record_commit(&self, took: Duration) {
        let took = took.as_micros().min(u128::from(u32::MAX)) as u64;
        let old = self.commit_us.load(Ordering::Relaxed);
        let new = if old == 0 { took } else { (old * 7 + took) / 8 };
        self.commit_us.store(new, Ordering::Relaxed);
    }
}

/// Handle to the group-commit task of one coordinator.
#[derive(Clone)]
struct GroupCommit {
    tx: mpsc::UnboundedSender<Queued>,
    queue: Arc<SubmitQueue>,
}

impl GroupCommit {
    fn start(coord: Coordinator, queue: Arc<SubmitQueue>) -> (GroupCommit, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(coord, rx, queue.clone()));
        (GroupCommit { tx, queue }, task)
    }

    /// Submits one job; resolves once its entry is applied. Refused at once when the queue is
    /// full.
    async fn submit(&self, request_id: String, spec: JobSpec) -> Result<(JobId, bool), CoordError> {
        let admitted = self.queue.admit(1)?;
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Queued { pending: Pending { request_id, spec, reply }, _admitted: admitted })
            .map_err(|_| CoordError::Unavailable("coordinator is shutting down".into()))?;
        rx.await.map_err(|_| CoordError::Unavailable("coordinator is shutting down".into()))?
    }
}

async fn run(coord: Coordinator, mut rx: mpsc::UnboundedReceiver<Queued>, queue: Arc<SubmitQueue>) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        // Everything that queued up while we waited for a slot goes into this entry; taken
        // out of the queue, its jobs leave the bound (dropping `Queued::_admitted`).
        let mut group = vec![first.pending];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(q) => group.push(q.pending),
                Err(_) => break,
            }
        }
        let coord = coord.clone();
        let queue = queue.clone();
        tokio::spawn(async move {
            propose_group(&coord, &queue, group).await;
            drop(permit);
        });
    }
}

/// The submits whose caller still waits for the answer.
fn without_gone_callers(mut group: Vec<Pending>) -> Vec<Pending> {
    let before = group.len();
    group.retain(|p| !p.reply.is_closed());
    if group.len() < before {
        tracing::debug!(dropped = before - group.len(), "dropped queued submits whose caller has gone");
    }
    group
}

/// Test builds: the delay (ms) the failpoint asks for before a group is proposed.
fn failpoint_delay_ms() -> u64 {
    crate::failpoints::setup();
    fail::fail_point!(GROUP_COMMIT_DELAY_FAILPOINT, |v| v.and_then(|v| v.parse().ok()).unwrap_or(0));
    0
}

async fn propose_group(coord: &Coordinator, queue: &SubmitQueue, group: Vec<Pending>) {
    let delay_ms = failpoint_delay_ms();
    if delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    }
    coord.hold_while_followers_lag().await;
    // A caller that gave up (deadline, cancel) is not proposed for: it retries with its own
    // request id, or it does not care any more.
    let group = without_gone_callers(group);
    if group.is_empty() {
        return;
    }
    let (jobs, replies): (Vec<(String, JobSpec)>, Vec<Reply>) =
        group.into_iter().map(|p| ((p.request_id, p.spec), p.reply)).unzip();
    let started = Instant::now();
    let command = if jobs.len() == 1 {
        let (request_id, spec) = jobs.into_iter().next().expect("one job");
        Command::SubmitJob { request_id, spec }
    } else {
        Command::SubmitJobs { jobs }
    };
    let proposed = coord.propose(command).await;
    queue.record_commit(started.elapsed());
    match proposed {
        Ok(Outcome::JobSubmitted { job_id, duplicate }) => {
            for reply in replies {
                let _ = reply.send(Ok((job_id, duplicate)));
            }
        }
        Ok(Outcome::JobsSubmitted(results)) => {
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result.map_err(CoordError::Rejected));
            }
        }
        Ok(other) => {
            for reply in replies {
                let _ = reply.send(Err(CoordError::Raft(format!("unexpected outcome of submit: {other:?}"))));
            }
        }
        Err(e) => {
            // Every caller gets the same failure (e.g. not the leader, with its address): each
            // client retries or follows the redirect with its own request id.
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_refuses_past_its_bound_until_jobs_leave() {
        let queue = SubmitQueue::new(3);
        let first = queue.admit(2).expect("room for two");
        let third = queue.admit(1).expect("room for a third");
        assert_eq!(queue.queued(), 3);
        let err = queue.admit(1).expect_err("full");
        match err {
            CoordError::Overloaded { queued, capacity, retry_after } => {
                assert_eq!((queued, capacity), (3, 3));
                assert!((MIN_RETRY_AFTER..=MAX_RETRY_AFTER).contains(&retry_after), "{retry_after:?}");
            }
            other => panic!("expected overloaded, got {other:?}"),
        }
        drop(first);
        assert_eq!(queue.queued(), 1);
        let _batch = queue.admit(2).expect("room again");
        drop(third);
        assert_eq!(queue.queued(), 2);
    }

    #[test]
    fn an_empty_queue_takes_a_batch_larger_than_its_bound() {
        let queue = SubmitQueue::new(2);
        let batch = queue.admit(10).expect("alone");
        assert!(queue.admit(1).is_err(), "nothing more while it waits");
        drop(batch);
        assert_eq!(queue.queued(), 0);
    }

    #[test]
    fn retry_after_follows_the_commit_pace() {
        let queue = SubmitQueue::new(100_000);
        assert_eq!(queue.retry_after(1), MIN_RETRY_AFTER, "no commit seen: the floor");
        queue.record_commit(Duration::from_millis(100));
        // 10,240 jobs are 20 entries of 100ms, two at a time.
        assert_eq!(queue.retry_after(20 * MAX_GROUP), Duration::from_secs(1));
        assert_eq!(queue.retry_after(100_000), MAX_RETRY_AFTER, "capped");
    }

    #[test]
    fn submits_whose_caller_has_gone_are_dropped() {
        let mut receivers = Vec::new();
        let group: Vec<Pending> = (0..4)
            .map(|i| {
                let (reply, rx) = oneshot::channel();
                receivers.push(Some(rx));
                Pending { request_id: format!("r{i}"), spec: JobSpec::default(), reply }
            })
            .collect();
        // Callers 1 and 3 gave up (their handler was dropped with its receiver).
        receivers[1] = None;
        receivers[3] = None;
        let kept = without_gone_callers(group);
        assert_eq!(kept.iter().map(|p| p.request_id.as_str()).collect::<Vec<_>>(), vec!["r0", "r2"]);
    }
}
