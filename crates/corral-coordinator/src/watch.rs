//! `WatchJobs`: the matching jobs, then each change of one, as events at revisions (applied log
//! indexes), resumable from a revision through the state machine's change log; and the bound on
//! the watches a principal holds open ([`Watches`]: `WatchJobs`, `WatchJob` and `ReadLogs` with
//! follow).
//!
//! Invariant: an event's `resume_revision` is set only when every matching change up to it was
//! sent on the stream, so a client that resumes from it misses nothing. Events go out in
//! increasing revision order; a job changed several times within one window of changes is
//! sent once, as it is now (with the revision of its latest change in the window). The first
//! list is sent at the revision the watch started at; a job in it may be newer than that (it is
//! read page by page) and then comes again with its change.
//!
//! Bounds (configuration, never the request or the state's size): a watch builds its events a
//! page at a time — the first list walks the jobs in id order, at most `FIRST_PAGE` events or
//! `SCAN_PAGE` jobs looked at per page, each page from a constant-time copy of the job map (no
//! state lock held while it is walked or encoded); the changes come in windows of about
//! `CHANGE_WINDOW` job changes (`ChangeLog::window_after`) — and holds at most `BUFFER` events
//! its client has not taken (a bounded channel), each without the job's script and environment
//! (`Snapshot::brief_reply`), so a watch holds a few MiB at most. A client that reads slower than the jobs
//! change falls behind: once more than half of `raft.watch-history` job changes were applied
//! after its last resume point, the watch ends with ABORTED naming that revision, which is then
//! still remembered, so the client resumes from it instead of listing again.

use crate::auth::Principal;
use crate::filter::JobFilter;
use crate::{CoordError, Coordinator};
use corral_proto::v1 as pb;
use std::collections::BTreeMap;
use std::ops::Bound;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

/// Most events of the first list per page (one copy of the job map, then encoded and sent).
const FIRST_PAGE: usize = 256;
/// Most jobs the first list looks at per page (a tenant's few jobs among many others).
const SCAN_PAGE: usize = 4096;
/// About how many job changes one window of changes holds (whole log entries; one entry may
/// hold more, e.g. a bulk cancel of `CANCEL_CHUNK`).
const CHANGE_WINDOW: usize = 4096;
/// Events a watch keeps ready for its client; the client's HTTP/2 window holds a few more.
pub(crate) const BUFFER: usize = 16;
/// A quiet watch gets a progress event at most this often (on an applied change).
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// The default of `limits.max-watches-per-principal`.
pub(crate) const DEFAULT_MAX_WATCHES_PER_PRINCIPAL: usize = 64;

/// The watches each principal holds open, against `limits.max-watches-per-principal`: a
/// `WatchJobs`, a `WatchJob` (`corral wait`) or a `ReadLogs` that follows (`corral logs -f`)
/// each hold one [`WatchPermit`] from the call until its stream ends.
#[derive(Debug)]
pub(crate) struct Watches {
    limit: usize,
    open: Mutex<BTreeMap<String, usize>>,
}

/// One open watch of a principal; dropping it (the stream ended) frees the place.
#[derive(Debug)]
pub(crate) struct WatchPermit {
    watches: Arc<Watches>,
    who: String,
}

impl Watches {
    pub(crate) fn new(limit: usize) -> Arc<Watches> {
        Arc::new(Watches { limit: limit.max(1), open: Mutex::default() })
    }

    /// A place for one more watch of `who`, or RESOURCE_EXHAUSTED naming the limit.
    pub(crate) fn open(self: &Arc<Self>, who: &Principal) -> Result<WatchPermit, CoordError> {
        let key = who.describe();
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(key.clone()).or_default();
        if *count >= self.limit {
            return Err(CoordError::Exhausted(format!(
                "{key} already has {count} watches open (watches, `corral wait`, `corral logs -f`), at most {} (limits.max-watches-per-principal): end one first",
                self.limit
            )));
        }
        *count += 1;
        Ok(WatchPermit { watches: self.clone(), who: key })
    }

    /// Watches `who` holds open now.
    #[cfg(test)]
    pub(crate) fn held_by(&self, who: &Principal) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).get(&who.describe()).copied().unwrap_or(0)
    }
}

impl Drop for WatchPermit {
    fn drop(&mut self) {
        let mut open = self.watches.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.who) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.who);
            }
        }
    }
}

pub(crate) type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The sending side of a watch's stream: a bounded channel, and the status that ends the
/// stream after the events already in it (delivered even when the channel is full).
pub(crate) struct Sink<T> {
    tx: mpsc::Sender<Result<T, Status>>,
    last: Arc<Mutex<Option<Status>>>,
}

/// A watch's bounded stream of `BUFFER` items and its sending side.
pub(crate) fn stream<T: Send + 'static>() -> (Sink<T>, EventStream<T>) {
    let (tx, rx) = mpsc::channel(BUFFER);
    let last: Arc<Mutex<Option<Status>>> = Arc::default();
    let end = last.clone();
    let tail = futures::stream::once(async move { end.lock().unwrap_or_else(|p| p.into_inner()).take() })
        .filter_map(|status| status.map(Err));
    (Sink { tx, last }, Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx).chain(tail)))
}

impl<T> Sink<T> {
    /// Ends the stream with `status`, after what it holds.
    pub(crate) fn end(self, status: Status) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
    }
}

/// Why a watch stopped sending.
enum Stop {
    /// The client went away, or this node no longer leads: the stream just ends.
    Quiet,
    /// The stream ends with this status.
    Status(Status),
}

impl From<CoordError> for Stop {
    fn from(e: CoordError) -> Stop {
        Stop::Status(e.into())
    }
}

fn compacted(e: corral_raft::Compacted) -> CoordError {
    CoordError::OutOfRange(format!(
        "revision {} is too old to resume the watch from: this coordinator remembers changes from revision {} on; list the jobs again (watch without a revision) or resume from revision {} or later",
        e.asked, e.oldest, e.oldest
    ))
}

/// Starts a watch for the leader of `term`, holding `permit`: a refused revision (ahead of the
/// cluster, or forgotten) is the call's error; the events follow on the returned stream.
pub(crate) fn watch_jobs(
    coord: &Coordinator,
    filter: JobFilter,
    from: Option<u64>,
    term: u64,
    permit: WatchPermit,
) -> Result<EventStream<pb::JobEvent>, CoordError> {
    let store = coord.store();
    let applied = store.subscribe_applied();
    let started_at = store.read().applied_index();
    if let Some(from) = from {
        if from > started_at {
            return Err(CoordError::InvalidArgument(format!(
                "revision {from} is ahead of this cluster (at revision {started_at}): resume only from a revision a watch sent"
            )));
        }
        store.changes().recorded_after(from).map_err(compacted)?;
    }
    let (sink, events) = stream();
    let lag_limit = (store.changes().capacity() / 2).max(1) as u64;
    let mut task = WatchTask {
        coord: coord.clone(),
        filter,
        term,
        sink,
        applied,
        started_at,
        seen_applied: started_at,
        // A resuming client holds `from` already.
        resume: from,
        lag_limit,
    };
    tokio::spawn(async move {
        let _permit = permit;
        let stopped = match from {
            None => task.run_from_list(started_at).await,
            Some(from) => task.run_from(from).await,
        };
        if let Err(Stop::Status(status)) = stopped {
            task.sink.end(status);
        }
    });
    Ok(events)
}

/// One watch's sending task.
struct WatchTask {
    coord: Coordinator,
    filter: JobFilter,
    term: u64,
    sink: Sink<pb::JobEvent>,
    applied: watch::Receiver<u64>,
    /// The applied index when the watch started.
    started_at: u64,
    /// The applied index the last window of changes was read at.
    seen_applied: u64,
    /// The last resume point sent.
    resume: Option<u64>,
    /// Job changes applied after the last resume point that make the watch too far behind.
    lag_limit: u64,
}

impl WatchTask {
    /// The jobs that match now, at revision `at`, then their changes.
    async fn run_from_list(&mut self, at: u64) -> Result<(), Stop> {
        self.send_list(at).await?;
        self.send(progress(at)).await?;
        self.follow(at).await
    }

    /// The matching jobs changed after `from`, then their changes.
    async fn run_from(&mut self, from: u64) -> Result<(), Stop> {
        let upto = self.send_changes(from).await?;
        self.send(progress(upto)).await?;
        self.follow(upto).await
    }

    /// Sends each applied change after `after`, as it comes, while this node leads.
    async fn follow(&mut self, mut after: u64) -> Result<(), Stop> {
        let mut last_sent = std::time::Instant::now();
        loop {
            // Sending may have taken the last notification: wait only if nothing new was applied.
            while *self.applied.borrow_and_update() <= self.seen_applied {
                tokio::select! {
                    changed = self.applied.changed() => if changed.is_err() { return Err(Stop::Quiet) },
                    _ = self.sink.tx.closed() => return Err(Stop::Quiet),
                }
            }
            if self.coord.leading_term() != Some(self.term) {
                // Deposed: the client resumes at the new leader from its last resume point.
                return Err(Stop::Quiet);
            }
            let resume_before = self.resume;
            after = self.send_changes(after).await?;
            if self.resume == resume_before && last_sent.elapsed() >= PROGRESS_EVERY {
                // A watch whose jobs rarely change still moves its resume point now and then, so
                // that its revision is not forgotten (evicted from the change log) while it waits.
                self.send(progress(after)).await?;
            }
            if self.resume != resume_before {
                last_sent = std::time::Instant::now();
            }
        }
    }

    /// The first list: every matching job, in id order, page by page, at revision `at`.
    async fn send_list(&mut self, at: u64) -> Result<(), Stop> {
        if !self.filter.job_ids.is_empty() {
            // Named jobs: looked up, not searched for.
            let ids: Vec<u64> = self.filter.job_ids.iter().copied().collect();
            for page in ids.chunks(FIRST_PAGE) {
                let snapshot = self.coord.snapshot();
                let jobs = snapshot.read().state.jobs.clone();
                for id in page {
                    if let Some(job) = jobs.get(id).filter(|j| self.filter.matches(j)) {
                        let event =
                            pb::JobEvent { revision: at, job: Some(snapshot.brief_reply(job)), resume_revision: None };
                        self.send(event).await?;
                    }
                }
            }
            return Ok(());
        }
        let mut cursor: Option<u64> = None;
        loop {
            let snapshot = self.coord.snapshot();
            // A constant-time copy: the page is walked and encoded without the state's lock.
            let jobs = snapshot.read().state.jobs.clone();
            let start = cursor.map_or(Bound::Unbounded, Bound::Excluded);
            let (mut sent, mut scanned) = (0, 0);
            let mut page = jobs.range((start, Bound::Unbounded));
            loop {
                let Some((id, job)) = page.next() else { return Ok(()) };
                cursor = Some(*id);
                scanned += 1;
                if self.filter.matches(job) {
                    let event =
                        pb::JobEvent { revision: at, job: Some(snapshot.brief_reply(job)), resume_revision: None };
                    self.send(event).await?;
                    sent += 1;
                }
                if sent >= FIRST_PAGE || scanned >= SCAN_PAGE {
                    break;
                }
            }
        }
    }

    /// Sends the matching jobs changed after `after`, window by window, up to what is applied
    /// now; returns the revision that covers.
    async fn send_changes(&mut self, mut after: u64) -> Result<u64, Stop> {
        loop {
            let (window, applied) = {
                let store = self.coord.store();
                // The applied index first: every change up to it is in the log once it is read.
                let applied = store.read().applied_index();
                let window = store.changes().window_after(after, CHANGE_WINDOW).map_err(compacted)?;
                (window, applied)
            };
            let upto = if window.more { window.upto } else { window.upto.max(applied) };
            self.send_window(&window.changes, upto).await?;
            after = upto;
            if !window.more {
                self.seen_applied = self.seen_applied.max(applied);
                return Ok(upto);
            }
        }
    }

    /// The matching jobs of one window of `changes` ((revision, job id), in revision order),
    /// every change up to `upto` included: each revision's last event is a resume point, the
    /// window's last event resumes from `upto`.
    async fn send_window(&mut self, changes: &[(u64, u64)], upto: u64) -> Result<(), Stop> {
        // One event is held back until the next shows whether it ends its revision.
        let mut held: Option<pb::JobEvent> = None;
        for page in changes.chunks(FIRST_PAGE) {
            let snapshot = self.coord.snapshot();
            let jobs = snapshot.read().state.jobs.clone();
            for (revision, id) in page {
                // A job gone from the state (moved to the history) is not sent.
                let Some(job) = jobs.get(id).filter(|j| self.filter.matches(j)) else { continue };
                let event =
                    pb::JobEvent { revision: *revision, job: Some(snapshot.brief_reply(job)), resume_revision: None };
                if let Some(mut previous) = held.replace(event) {
                    if *revision > previous.revision {
                        previous.resume_revision = Some(previous.revision);
                    }
                    self.send(previous).await?;
                }
            }
        }
        if let Some(mut last) = held {
            last.resume_revision = Some(upto);
            self.send(last).await?;
        }
        Ok(())
    }

    /// Sends `event` once the client has room for it; meanwhile, each applied change checks
    /// that the client is not too far behind.
    async fn send(&mut self, event: pb::JobEvent) -> Result<(), Stop> {
        loop {
            tokio::select! {
                biased;
                permit = self.sink.tx.reserve() => {
                    let Ok(permit) = permit else { return Err(Stop::Quiet) };
                    if let Some(resume) = event.resume_revision {
                        self.resume = Some(resume);
                    }
                    permit.send(Ok(event));
                    return Ok(());
                }
                changed = self.applied.changed() => {
                    if changed.is_err() {
                        return Err(Stop::Quiet);
                    }
                    if let Some(status) = self.behind() {
                        return Err(Stop::Status(status));
                    }
                }
            }
        }
    }

    /// The status that ends a watch whose client fell too far behind, if it did: more than
    /// half of `raft.watch-history` job changes applied after its last resume point (or, in
    /// the first list, after the revision it lists at).
    fn behind(&self) -> Option<Status> {
        let since = self.resume.unwrap_or(self.started_at);
        let lag = match self.coord.store().changes().recorded_after(since) {
            Ok(lag) if lag <= self.lag_limit => return None,
            Ok(lag) => lag.to_string(),
            Err(_) => "more".to_string(),
        };
        let then = match self.resume {
            Some(resume) => format!("resume from revision {resume}"),
            None => "watch again".to_string(),
        };
        Some(Status::aborted(format!(
            "the watch fell behind: {lag} job changes were applied after revision {since} while its client read slower, more than half of raft.watch-history; {then}"
        )))
    }
}

/// An event that carries no job, only a resume point.
fn progress(upto: u64) -> pb::JobEvent {
    pb::JobEvent { revision: upto, job: None, resume_revision: Some(upto) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_principal_holds_at_most_the_limit_of_watches() {
        let watches = Watches::new(2);
        let a = Principal::Tenant { tenant: "a".into(), token_id: 1 };
        let b = Principal::Tenant { tenant: "b".into(), token_id: 2 };
        let first = watches.open(&a).expect("first");
        let _second = watches.open(&a).expect("second");
        let refused = watches.open(&a).expect_err("third");
        let status = Status::from(refused);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("limits.max-watches-per-principal"), "{}", status.message());
        assert!(status.message().contains("at most 2"), "{}", status.message());
        assert_eq!(status.message().lines().count(), 1);
        // Another principal has its own places; an ended watch frees one.
        let _other = watches.open(&b).expect("another tenant");
        drop(first);
        assert_eq!(watches.held_by(&a), 1);
        let _again = watches.open(&a).expect("a place was freed");
        assert_eq!(watches.held_by(&a), 2);
    }

    #[tokio::test]
    async fn the_last_status_follows_the_events_even_when_the_channel_was_full() {
        let (sink, mut events) = stream::<u64>();
        for i in 0..BUFFER as u64 {
            sink.tx.try_send(Ok(i)).expect("room");
        }
        assert!(sink.tx.try_send(Ok(99)).is_err(), "the channel is full");
        sink.end(Status::aborted("behind"));
        for i in 0..BUFFER as u64 {
            assert_eq!(events.next().await.expect("event").expect("ok"), i);
        }
        let last = events.next().await.expect("the status").expect_err("an error");
        assert_eq!(last.code(), tonic::Code::Aborted);
        assert!(events.next().await.is_none());
    }
}
