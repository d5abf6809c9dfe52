//! The replicated state machine: `corral_core::State` in memory, durable as fsynced snapshot
//! files plus the Raft log after them, and the on-disk history of finished jobs and billed
//! segments (`history.rs`: each job a `Compact` took out of the hot state, and every segment,
//! where the hot state keeps only recent ones).
//!
//! Invariant: the hot state never reaches the history store. It is durable as the current
//! snapshot and the log entries after it: on open the store loads the snapshot and reports its
//! index as applied, and openraft applies the committed entries after it again. Applying an
//! entry writes to the history only what it adds to or deletes from it, and applying it again
//! writes the same records, so a history that ran ahead of the snapshot converges to the same
//! bytes.
//!
//! A snapshot this store builds holds the hot state only: the history is already in the store,
//! which is synced up to the snapshot's index before the snapshot is published. Its request ids (up
//! to a day of them) are not re-encoded by every build either: each build writes the ids recorded
//! since the one before into a file of its own, and the snapshot names every file that still holds
//! an id that has not expired, merging the newest small files into the new one (see
//! `request_ids.rs`). When a follower needs the snapshot, its body is written again with the
//! history added (once per snapshot, into a file, read in chunks). A snapshot a follower receives
//! carries the history and is installed into the history store as it is read; a received body is
//! current from before its install until the next build, so a crash during the install installs it
//! again on open.

use crate::change_log::ChangeLog;
use crate::codec::{self, HistoryRecord};
use crate::history::History;
use crate::request_ids::{self, RequestIdLog};
use crate::snapshot_store::{Current, IdFiles, SnapshotDir, SnapshotFile, SnapshotMetaT, SyncedWriter};
use crate::types::{LogId, NodeId, StoredMembership, TypeConfig};
use corral_core::{Outcome, State, Touched};
use corral_types::{Job, JobId, Segment};
use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError, StorageIOError};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Runs `f` on this thread at a lower CPU priority (nice 10), then restores it: a snapshot build
/// yields the CPU to the threads that serve and replicate writes.
fn at_low_priority<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: gettid, getpriority and setpriority on the calling thread (on Linux a thread id
    // is a PRIO_PROCESS target), with plain integer arguments; failures only leave the priority.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
    let before = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 10) };
    let out = f();
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, before) };
    out
}

/// What the state machine holds in memory.
#[derive(Debug, Default)]
pub struct StateMachineData {
    pub state: State,
    pub(crate) last_applied: Option<LogId>,
    pub(crate) membership: StoredMembership,
    pub(crate) request_id_log: RequestIdLog,
}

impl StateMachineData {
    /// State machine data holding `state`, as if nothing were applied yet (tests of callers).
    pub fn of(state: State) -> StateMachineData {
        StateMachineData { state, ..Default::default() }
    }

    /// Index of the last applied log entry (0 before any): the state's revision.
    pub fn applied_index(&self) -> u64 {
        self.last_applied.map_or(0, |l| l.index)
    }

    /// Term of the leader that wrote the last applied entry.
    pub fn applied_term(&self) -> Option<u64> {
        self.last_applied.map(|l| l.leader_id.term)
    }
}

struct Shared {
    data: RwLock<StateMachineData>,
    history: History,
    snapshots: SnapshotDir,
    applied_tx: watch::Sender<u64>,
    /// Which jobs each applied entry changed, for `WatchJobs` resumes (locked inside `data`'s lock).
    changes: std::sync::Mutex<ChangeLog>,
    /// The jobs of the last snapshot built here, encoded: the next build encodes only those
    /// that changed. Locked by builds only.
    job_encodings: std::sync::Mutex<codec::JobEncodings>,
}

/// Cheap to clone handle on the state machine; the coordinator reads through it.
#[derive(Clone)]
pub struct StateMachineStore {
    shared: Arc<Shared>,
}

fn io_err<E: std::error::Error + 'static>(e: E) -> StorageError<NodeId> {
    StorageIOError::<NodeId>::write_state_machine(&e).into()
}

fn read_err<E: std::error::Error + 'static>(e: E) -> StorageError<NodeId> {
    StorageIOError::<NodeId>::read_state_machine(&e).into()
}

/// A wait for, or a hold of, the state lock at least this long is logged: applies (and so the
/// leader's lease and every worker's report) wait behind it.
const SLOW_LOCK: Duration = Duration::from_millis(250);

/// A read guard of the applied state that logs, when dropped, a hold of at least [`SLOW_LOCK`]
/// with the place it was taken: the one witness of a reader that starves the applies.
pub struct StateRead<'a> {
    guard: RwLockReadGuard<'a, StateMachineData>,
    taken: Instant,
    at: &'static std::panic::Location<'static>,
}

impl std::ops::Deref for StateRead<'_> {
    type Target = StateMachineData;

    fn deref(&self) -> &StateMachineData {
        &self.guard
    }
}

impl Drop for StateRead<'_> {
    fn drop(&mut self) {
        let held = self.taken.elapsed();
        if held >= SLOW_LOCK {
            tracing::warn!(ms = held.as_millis() as u64, at = %self.at, "held the state for reading long: applies waited");
        }
    }
}

impl StateMachineStore {
    /// Opens (or creates) the store under `dir` (`dir/history.redb`, `dir/snapshots`).
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let snapshots = SnapshotDir::open(&dir.join("snapshots"))?;
        // Applied batches reach the history without an fsync: durability still comes from the
        // Raft log and fsynced snapshots, whatever the history lost is re-applied on open.
        let history = History::open(dir)?;
        let data = match snapshots.current()? {
            None => StateMachineData::default(),
            Some(current) => {
                let started = std::time::Instant::now();
                let body = std::fs::File::open(snapshots.path(&current.body))?;
                let (state, request_id_log) = if current.history_in_store {
                    let mut state = load_hot_body(body)?;
                    let log = request_ids::load(&snapshots, &current.request_ids, &mut state)?;
                    (state, log)
                } else {
                    // A received body, current since before its install: the history may hold less
                    // than it (a crash during the install) or more (entries applied after it).
                    (history.install(body)?, RequestIdLog::default())
                };
                tracing::info!(
                    snapshot = %current.meta.snapshot_id,
                    jobs = state.jobs.len(),
                    ms = started.elapsed().as_millis() as u64,
                    "loaded the state machine from its snapshot; the log entries after it are applied again"
                );
                StateMachineData {
                    state,
                    last_applied: current.meta.last_log_id,
                    membership: current.meta.last_membership,
                    request_id_log,
                }
            }
        };
        let applied = data.last_applied.map(|l| l.index).unwrap_or(0);
        let (applied_tx, _) = watch::channel(applied);
        let shared = Shared {
            data: RwLock::new(data),
            history,
            snapshots,
            applied_tx,
            changes: std::sync::Mutex::new(ChangeLog::new(crate::change_log::DEFAULT_CHANGE_LOG_CAPACITY, applied)),
            job_encodings: Default::default(),
        };
        Ok(StateMachineStore { shared: Arc::new(shared) })
    }

    /// Read access to the applied state. Never hold the guard across an `.await`: every apply
    /// waits behind it, and every later read behind that apply. A long wait or hold is logged
    /// with the caller's place (see [`StateRead`]).
    #[track_caller]
    pub fn read(&self) -> StateRead<'_> {
        let at = std::panic::Location::caller();
        let asked = Instant::now();
        let guard = self.shared.data.read().unwrap_or_else(|p| p.into_inner());
        let taken = Instant::now();
        let waited = taken - asked;
        if waited >= SLOW_LOCK {
            tracing::warn!(ms = waited.as_millis() as u64, at = %at, "waited long to read the state");
        }
        StateRead { guard, taken, at }
    }

    /// FNV-1a of the encoded state and its history: equal on every node that applied the same
    /// log prefix. Reads everything: for tests and `cluster status --digest`, not a hot path.
    pub fn digest(&self) -> u64 {
        self.digest_at().1
    }

    /// The applied index and the digest of the state at exactly that index. The state is
    /// copied under the read lock but the history is read after it is released: an entry
    /// applied meanwhile would mix two indexes, so the digest is taken again (a few times at
    /// most; the last try is returned as it stands) until no entry was applied during it.
    pub fn digest_at(&self) -> (u64, u64) {
        let mut last = (0, 0);
        for _ in 0..DIGEST_TRIES {
            let (applied, state) = {
                let data = self.read();
                (data.applied_index(), data.state.replicated_copy())
            };
            last = (applied, Self::digest_of(&state, &self.shared.history));
            if self.read().applied_index() == applied {
                break;
            }
        }
        last
    }

    fn digest_of(state: &State, history: &History) -> u64 {
        struct Fnv(u64);
        impl Write for Fnv {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0 = buf.iter().fold(self.0, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut hash = Fnv(0xcbf2_9ce4_8422_2325);
        let written = hash
            .write_all(&codec::snapshot_to_bytes(state))
            .and_then(|()| history.write_to(&codec::HotBounds::of(state), &mut hash));
        written.map_or(0, |()| hash.0)
    }

    /// The hot state's replicated fields, where they stand and the request-id log at that
    /// point, copied under the read lock (jobs are shared, not copied; the derived indexes are
    /// left out; the ids applied since the last build are slices, copied as pointers): encoding
    /// happens after the lock is released.
    fn clone_hot(&self) -> (State, AppliedAt, request_ids::RequestIdCopy) {
        let data = self.read();
        (data.state.replicated_copy(), (data.last_applied, data.membership.clone()), data.request_id_log.copy())
    }

    /// Builds a snapshot of the hot state and publishes it; its history is the store's, its
    /// request ids are in the files it names.
    fn build_hot_snapshot(&self) -> std::io::Result<(SnapshotMetaT, bool)> {
        let started = std::time::Instant::now();
        let (state, (last_applied, membership), ids) = self.clone_hot();
        let cloned = started.elapsed();
        // Everything applied up to the clone reaches the disk before the snapshot names it.
        self.shared.history.sync()?;
        let flushed = started.elapsed();
        let to_write = ids.plan(&state, |f| request_ids::read_file(&self.shared.snapshots, f));
        let planned = started.elapsed();
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => "empty".to_string(),
        };
        let meta = SnapshotMeta { last_log_id: last_applied, last_membership: membership, snapshot_id };
        let snapshots = &self.shared.snapshots;
        let (tmp, ids_tmp) = (snapshots.temp_path("build"), snapshots.temp_path("ids"));
        let mut bytes = 0;
        let written = (|| {
            let id_files = to_write.write(&ids_tmp)?;
            // Encoded straight into the file, a job at a time: never a second copy of the state.
            let mut out = SyncedWriter::create(&tmp)?;
            let mut jobs = self.shared.job_encodings.lock().unwrap_or_else(|p| p.into_inner());
            bytes = codec::write_snapshot_without_request_ids(&state, &mut jobs, &mut out)?;
            drop(jobs);
            out.finish()?;
            snapshots.publish(&meta, &tmp, true, id_files)
        })();
        drop(state);
        if !matches!(written, Ok(Some(_))) {
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_file(&ids_tmp);
        }
        if let Ok(Some(current)) = &written {
            let mut data = self.shared.data.write().unwrap_or_else(|p| p.into_inner());
            data.request_id_log.built(&ids, &current.request_ids);
        }
        let ms = |d: std::time::Duration| d.as_millis() as u64;
        tracing::info!(
            snapshot = %meta.snapshot_id,
            bytes,
            request_id_bytes = to_write.new.as_ref().map_or(0, |n| n.bytes.len()),
            request_id_files = written.as_ref().ok().and_then(Option::as_ref).map_or(0, |c| c.request_ids.len()),
            clone_ms = ms(cloned),
            flush_ms = ms(flushed - cloned),
            plan_ms = ms(planned - flushed),
            encode_and_write_ms = ms(started.elapsed() - planned),
            "snapshot of the hot state written"
        );
        Ok((meta, written?.is_some()))
    }

    /// The data of snapshot `current`, to send: its body, or for a snapshot whose history is in
    /// the store, that body with the history added (made on first read, then kept).
    fn snapshot_data(&self, current: &Current) -> std::io::Result<SnapshotFile> {
        let snapshots = &self.shared.snapshots;
        if !current.history_in_store {
            return Ok(SnapshotFile::open(std::fs::File::open(snapshots.path(&current.body))?));
        }
        let send = snapshots.path(&SnapshotDir::send_name(&current.body));
        match std::fs::File::open(&send) {
            Ok(file) => return Ok(SnapshotFile::open(file)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        // Opened now: a newer snapshot may replace this body and its files before the first read.
        let hot = std::fs::File::open(snapshots.path(&current.body))?;
        let ids = request_ids::open_files(snapshots, &current.request_ids)?;
        let (store, body) = (self.clone(), current.body.clone());
        // At normal priority, unlike a build: a follower that needs a snapshot gets neither it
        // nor any entry until this is written, and while its log does not match the leader's,
        // its answers to heartbeats confirm nothing. With the other follower down, the leader's
        // lease then waits for this write, and at nice 10 on a busy host it waited 45 s.
        Ok(SnapshotFile::lazy(move || store.make_send_body(hot, ids, &body)))
    }

    /// Writes the body `body` (open as `hot`) with its request ids (the files `ids`) and the
    /// history added, as `send-<body>`, and opens it. Several followers share one.
    fn make_send_body(
        &self,
        mut hot: std::fs::File,
        ids: Vec<std::fs::File>,
        body: &str,
    ) -> std::io::Result<std::fs::File> {
        let snapshots = &self.shared.snapshots;
        let _guard = snapshots.send.lock().unwrap_or_else(|p| p.into_inner());
        let path = snapshots.path(&SnapshotDir::send_name(body));
        if let Ok(file) = std::fs::File::open(&path) {
            return Ok(file);
        }
        let started = std::time::Instant::now();
        tracing::info!(body, "writing a snapshot with its history to send");
        let bytes = crate::snapshot_store::read_all(&mut hot)?;
        let bounds = codec::HotBounds::from_snapshot(&bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
        let tmp = snapshots.temp_path("send");
        let written = (|| {
            let mut out = SyncedWriter::create(&tmp)?;
            out.write_all(&bytes)?;
            request_ids::write_table(ids, &mut out)?;
            self.shared.history.write_to(&bounds, &mut out)?;
            out.finish()?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let file = std::fs::File::open(&path)?;
        if snapshots.current()?.is_none_or(|c| c.body != body) {
            // A newer snapshot was published meanwhile: this one is sent once, not kept.
            let _ = std::fs::remove_file(&path);
        }
        let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        tracing::info!(
            body,
            bytes,
            ms = started.elapsed().as_millis() as u64,
            "wrote a snapshot with its history to send"
        );
        Ok(file)
    }

    /// A job of the history (finished and moved out of the hot state), if kept.
    pub fn archived_job(&self, id: JobId) -> Option<Job> {
        let bytes =
            self.shared.history.job(id).inspect_err(|e| tracing::warn!(error = %e, "history read failed")).ok()??;
        codec::job_from_bytes(&bytes).ok()
    }

    /// Task `index` of job array `array` from the history, if kept.
    pub fn archived_task(&self, array: JobId, index: u32) -> Option<Job> {
        let id = self
            .shared
            .history
            .task(array, index)
            .inspect_err(|e| tracing::warn!(error = %e, "history read failed"))
            .ok()??;
        self.archived_job(id)
    }

    /// Jobs of the history with an id of at least `from`, in id order (lazily read, from one
    /// read transaction of the history).
    pub fn archived_jobs_from(&self, from: JobId) -> impl Iterator<Item = Job> + '_ {
        self.shared.history.jobs_from(from).filter_map(|v| codec::job_from_bytes(&v).ok())
    }

    /// Billing segments (hot and archived) with an id of at least `from`, in id order.
    pub fn segments_from(&self, from: u64) -> impl Iterator<Item = Segment> + '_ {
        self.shared.history.segments_from(from).filter_map(|v| codec::segment_from_bytes(&v).ok())
    }

    /// Index of the last applied entry, updated after every applied batch.
    pub fn subscribe_applied(&self) -> watch::Receiver<u64> {
        self.shared.applied_tx.subscribe()
    }

    /// Which jobs the last applied entries changed. Take it after [`Self::read`] (same order as
    /// apply) to see both at one revision.
    pub fn changes(&self) -> std::sync::MutexGuard<'_, ChangeLog> {
        self.shared.changes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The hot state of a body this store built (`history_in_store`): every segment in it is one of
/// the hot ledger, and the history is the store's.
fn load_hot_body(body: std::fs::File) -> anyhow::Result<State> {
    let mut ledger = Vec::new();
    let reader = std::io::BufReader::with_capacity(1 << 20, body);
    let mut state = codec::read_snapshot(reader, |kind, record| -> anyhow::Result<()> {
        match kind {
            HistoryRecord::Segment => ledger.push(codec::segment_from_bytes(&record)?),
            HistoryRecord::ArchivedJob => anyhow::bail!("a snapshot of the hot state holds an archived job"),
        }
        Ok(())
    })?;
    state.ledger.extend(ledger.into_iter().map(|g| (g.id, g)));
    Ok(state)
}

/// The last applied log id and membership a snapshot stands at.
type AppliedAt = (Option<LogId>, StoredMembership);

/// How many times [`StateMachineStore::digest_at`] takes the digest while entries apply.
const DIGEST_TRIES: usize = 3;

fn blocking_err(e: tokio::task::JoinError) -> StorageError<NodeId> {
    io_err(std::io::Error::other(e.to_string()))
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError<NodeId>> {
        let data = self.read();
        Ok((data.last_applied, data.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<corral_core::Response>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = openraft::Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let shared = &self.shared;
        let entries: Vec<_> = entries.into_iter().collect();
        // Every command decodes before one applies, outside the lock: an entry that does not (a
        // newer format) stops this node before it changes the state.
        for entry in &entries {
            if let EntryPayload::Normal(request) = &entry.payload {
                request.request().map_err(io_err)?;
            }
        }
        let mut responses = Vec::new();
        let count = entries.len();
        let asked = Instant::now();
        let applied = {
            let mut data = shared.data.write().unwrap_or_else(|p| p.into_inner());
            let taken = Instant::now();
            let mut touched = Touched::default();
            for entry in entries {
                data.last_applied = Some(entry.log_id);
                let response = match entry.payload {
                    EntryPayload::Blank => Ok(Outcome::Done),
                    EntryPayload::Normal(request) => {
                        let (response, t) = data.state.apply_tracked(request.request().map_err(io_err)?);
                        self.changes().record(entry.log_id.index, t.jobs.iter().copied());
                        touched.merge(t);
                        response
                    }
                    EntryPayload::Membership(m) => {
                        data.membership = StoredMembership::new(Some(entry.log_id), m);
                        Ok(Outcome::Done)
                    }
                };
                responses.push(response);
            }
            data.request_id_log.record(std::mem::take(&mut touched.request_ids));
            let persisting = Instant::now();
            shared.history.persist(&data.state, &touched).map_err(io_err)?;
            let done = Instant::now();
            if done - asked >= SLOW_LOCK {
                let ms = |d: Duration| d.as_millis() as u64;
                tracing::warn!(
                    entries = count,
                    lock_wait_ms = ms(taken - asked),
                    apply_ms = ms(persisting - taken),
                    history_ms = ms(done - persisting),
                    "applying took long: readers of the state waited"
                );
            }
            data.last_applied.map(|l| l.index).unwrap_or(0)
        };
        shared.applied_tx.send_replace(applied);
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotFile>, StorageError<NodeId>> {
        let path = self.shared.snapshots.temp_path("receive");
        Ok(Box::new(
            SnapshotFile::receiving(path)
                .map_err(|e| StorageError::from(StorageIOError::<NodeId>::write_snapshot(None, &e)))?,
        ))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaT,
        mut snapshot: Box<SnapshotFile>,
    ) -> Result<(), StorageError<NodeId>> {
        let snapshot_err = |why: String| {
            StorageError::from(StorageIOError::<NodeId>::write_snapshot(
                Some(meta.signature()),
                &std::io::Error::other(why),
            ))
        };
        let path = snapshot.take_received().ok_or_else(|| snapshot_err("not a received snapshot".into()))?;
        drop(snapshot);
        let (shared, meta_copy) = (Arc::clone(&self.shared), meta.clone());
        // The received body becomes the current snapshot first, so a crash while the history is
        // rewritten installs it again on open; then the history is written, outside the lock.
        let started = std::time::Instant::now();
        let state = tokio::task::spawn_blocking(move || -> anyhow::Result<(State, u64)> {
            let installed = (|| {
                let body = std::fs::File::open(&path)?;
                body.sync_all()?;
                let published = shared.snapshots.publish(&meta_copy, &path, false, IdFiles::none())?.is_some();
                anyhow::Ok((body, published))
            })();
            let (body, published) = match installed {
                Ok(v) => v,
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    return Err(e);
                }
            };
            if !published {
                let _ = std::fs::remove_file(&path);
            }
            let published_ms = started.elapsed().as_millis() as u64;
            shared.history.install(body).map(|state| (state, published_ms))
        })
        .await
        .map_err(blocking_err)?
        .map_err(|e| snapshot_err(e.to_string()))?;
        let (state, published_ms) = state;
        let applied = {
            let mut data = self.shared.data.write().unwrap_or_else(|p| p.into_inner());
            *data = StateMachineData {
                state,
                last_applied: meta.last_log_id,
                membership: meta.last_membership.clone(),
                request_id_log: data.request_id_log.after(),
            };
            self.changes().reset(data.applied_index());
            data.last_applied.map(|l| l.index).unwrap_or(0)
        };
        self.shared.applied_tx.send_replace(applied);
        let ms = |d: std::time::Duration| d.as_millis() as u64;
        tracing::info!(
            snapshot = %meta.snapshot_id,
            ms = ms(started.elapsed()),
            published_ms,
            "installed snapshot"
        );
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        // A body can be replaced between reading CURRENT and opening it: read CURRENT again.
        let mut last_err = None;
        for _ in 0..3 {
            let Some(current) = self.shared.snapshots.current().map_err(read_err)? else {
                return Ok(None);
            };
            match self.snapshot_data(&current) {
                Ok(data) => return Ok(Some(Snapshot { meta: current.meta, snapshot: Box::new(data) })),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => last_err = Some(e),
                Err(e) => return Err(read_err(e)),
            }
        }
        Err(read_err(last_err.unwrap_or_else(|| std::io::Error::other("no snapshot body"))))
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let store = self.clone();
        let (meta, published) = tokio::task::spawn_blocking(move || at_low_priority(|| store.build_hot_snapshot()))
            .await
            .map_err(blocking_err)?
            .map_err(|e| StorageError::from(StorageIOError::<NodeId>::write_snapshot(None, &e)))?;
        if !published {
            tracing::info!(snapshot = %meta.snapshot_id, "built snapshot is older than the installed one: not kept");
            return Ok(Snapshot {
                meta,
                snapshot: Box::new(SnapshotFile::failed("a newer snapshot replaced this one")),
            });
        }
        tracing::info!(snapshot = %meta.snapshot_id, "built snapshot");
        // openraft keeps only the meta of a built snapshot; the data is what a send would read.
        let data = match self.shared.snapshots.current() {
            Ok(Some(c)) if c.meta.snapshot_id == meta.snapshot_id => self.snapshot_data(&c).map_err(read_err)?,
            _ => SnapshotFile::failed("a newer snapshot replaced this one"),
        };
        Ok(Snapshot { meta, snapshot: Box::new(data) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::{ClusterConfig, Command, CompactCutoffs, Request};
    use corral_types::{JobSpec, Timestamp};
    use openraft::{CommittedLeaderId, LogId};

    /// Opens the store under `dir` again. The history's file lock is released with the last
    /// handle, which a snapshot still being sent may hold a moment longer: retry while it is
    /// held (at most 5 s).
    fn reopen(dir: &Path) -> StateMachineStore {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match StateMachineStore::open(dir) {
                Ok(store) => return store,
                Err(e) if crate::node::is_lock_held(&e) && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => panic!("reopen: {e:#}"),
            }
        }
    }

    /// A state with `jobs` queued jobs: a snapshot of a few megabytes.
    fn state_with(jobs: usize) -> State {
        let mut state = State::default();
        let config = Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) };
        state.apply(&config).expect("configure");
        let spec = |i: usize| JobSpec {
            name: format!("job-{i}"),
            tenant: "default".into(),
            command: vec!["sleep".into(), "x".repeat(64)].into(),
            ..Default::default()
        };
        let batch = (0..jobs).map(|i| (format!("r{i}"), spec(i))).collect();
        state.apply(&Request { ts: Timestamp(2), command: Command::SubmitJobs { jobs: batch } }).expect("submit");
        state
    }

    /// The hot state (here the policy history) never reaches the history store: it survives a
    /// reopen through the snapshot, and versions that fell out of the history are gone from the
    /// next one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_hot_state_survives_a_reopen_through_its_snapshot_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateMachineStore::open(dir.path()).expect("open");
        let expected = {
            let mut data = store.shared.data.write().unwrap();
            data.state = state_with(10);
            let mut config = ClusterConfig::dev_defaults();
            for version in 1..=3u64 {
                config.default_gpu_price = version * 1000;
                let request = Request {
                    ts: Timestamp(version + 10),
                    command: Command::ApplyPolicy { config: config.clone(), by: "admin".into(), force: false },
                };
                let (response, touched) = data.state.apply_tracked(&request);
                response.expect("apply");
                assert_eq!(data.state.policy_version, version, "a new policy version is recorded");
                store.shared.history.persist(&data.state, &touched).expect("persist");
            }
            data.last_applied = Some(LogId::new(CommittedLeaderId::new(1, 1), 5));
            data.state.policy_history.clone()
        };
        assert!(store.shared.history.is_empty(), "applying writes nothing of the hot state to the history");
        store.clone().build_snapshot().await.expect("build");
        drop(store);
        let reopened = reopen(dir.path());
        {
            let data = reopened.read();
            assert_eq!(data.applied_index(), 5, "the snapshot's index is the applied one");
            assert_eq!(data.state.policy_history, expected);
            assert_eq!((data.state.policy_version, data.state.jobs.len()), (3, 10));
        }
        reopened.shared.data.write().unwrap().state.policy_history.remove(0);
        reopened.shared.data.write().unwrap().last_applied = Some(LogId::new(CommittedLeaderId::new(1, 1), 6));
        reopened.clone().build_snapshot().await.expect("build");
        drop(reopened);
        let reopened = reopen(dir.path());
        let versions: Vec<u64> = reopened.read().state.policy_history.iter().map(|r| r.version).collect();
        assert_eq!(versions, vec![2, 3]);
    }

    /// The history a store of an earlier version kept in sled (`sm/`) is moved into the history
    /// store on open, without the hot records that version also kept there; the sled store is
    /// removed, and the history survives the next reopen.
    #[test]
    fn a_history_an_earlier_version_kept_in_sled_is_moved_in() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut data = StateMachineData::of(state_with(3));
        let archived = {
            let legacy = History::open(tempfile::tempdir().expect("tempdir").path()).expect("scratch history");
            cancel_all_and_compact(&mut data, &legacy, 100).archived
        };
        let segment = corral_types::Segment {
            id: 7,
            job_id: 2,
            epoch: 1,
            tenant: "default".into(),
            node: "n1".into(),
            gpu_model: "RTX 5090".into(),
            gpus: 1,
            gpu_milli: 1000,
            priority_class: "normal".into(),
            multiplier_milli: 1000,
            price_micros_per_gpu_hour: 1_000_000,
            start: Timestamp(10),
            end: Timestamp(20),
            duration_ms: 1,
            lost: false,
            end_state: "succeeded".into(),
            cost_micros: 1,
            policy_version: 0,
            cause: None,
            credit_for: None,
        };
        {
            let db = sled::Config::new().path(dir.path().join("sm")).open().expect("sled");
            let tree = db.open_tree("state").expect("tree");
            let key = |prefix: &[u8], rest: &[u8]| [prefix, rest].concat();
            for job in &archived {
                tree.insert(key(b"h/", &job.id.to_be_bytes()), codec::job_to_bytes(job)).expect("insert");
            }
            let task = key(&9u64.to_be_bytes(), &2u32.to_be_bytes());
            tree.insert(key(b"t/", &task), &archived[1].id.to_be_bytes()).expect("insert");
            tree.insert(key(b"l/", &7u64.to_be_bytes()), codec::segment_to_bytes(&segment)).expect("insert");
            tree.insert(b"m/state", b"stale".as_slice()).expect("insert");
            tree.insert(key(b"j/", &1u64.to_be_bytes()), b"stale".as_slice()).expect("insert");
            db.flush().expect("flush");
        }
        // sled releases its lock from background threads a moment after the drop.
        let store = reopen(dir.path());
        assert!(!dir.path().join("sm").exists(), "the sled store is removed once moved");
        for _ in 0..2 {
            assert_eq!(store.archived_jobs_from(0).collect::<Vec<_>>(), archived);
            assert_eq!(store.archived_task(9, 2).map(|j| j.id), Some(archived[1].id));
            assert_eq!(store.segments_from(0).collect::<Vec<_>>(), vec![segment.clone()]);
        }
        drop(store);
        let store = reopen(dir.path());
        assert_eq!(store.archived_jobs_from(0).count(), archived.len(), "the moved history is durable");
        assert_eq!(store.segments_from(0).count(), 1);
    }

    /// Ends every job of `state` (cancelled while pending) and compacts: all of them move to the
    /// history. Returns what the compaction touched.
    fn cancel_all_and_compact(data: &mut StateMachineData, history: &History, ms: u64) -> Touched {
        let ids: Vec<u64> = data.state.jobs.keys().copied().collect();
        let at = |ms: u64| Timestamp::compose(ms, 0);
        for id in ids {
            let request = Request { ts: at(ms), command: Command::CancelJob { job_id: id, reason: "test".into() } };
            let (response, touched) = data.state.apply_tracked(&request);
            response.expect("cancel");
            history.persist(&data.state, &touched).expect("persist");
        }
        let cutoffs = CompactCutoffs {
            archive_before: at(ms + 1),
            request_ids_before: at(ms + 1),
            jobs_before: None,
            segments_before: None,
            max_finished_bytes: None,
        };
        let (response, touched) =
            data.state.apply_tracked(&Request { ts: at(ms + 2), command: Command::Compact(cutoffs) });
        response.expect("compact");
        history.persist(&data.state, &touched).expect("persist");
        touched
    }

    /// A `Compact` whose retention cutoff covers the jobs it archives deletes them in the same
    /// batch, and applying that batch again (after a crash) gives the same history: retention
    /// runs after the batch's own writes. A `Compact` that deletes nothing leaves it as it is.
    #[test]
    fn retention_in_the_batch_that_archives_deletes_the_same_records_when_applied_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let history = History::open(dir.path()).expect("open");
        let mut data = StateMachineData::of(state_with(5));
        let kept = cancel_all_and_compact(&mut data, &history, 100);
        assert_eq!(kept.archived.len(), 5);
        assert_eq!(history.jobs_from(0).count(), 5, "no cutoff: the archived jobs are kept");
        // Nothing is past this cutoff (jobs were submitted at 2 ns): the store is unchanged.
        let none_due = CompactCutoffs {
            archive_before: Timestamp(1),
            request_ids_before: Timestamp(1),
            jobs_before: Some(Timestamp(1)),
            segments_before: Some(Timestamp(1)),
            max_finished_bytes: None,
        };
        let (response, touched) =
            data.state.apply_tracked(&Request { ts: Timestamp::compose(200, 0), command: Command::Compact(none_due) });
        response.expect("compact");
        history.persist(&data.state, &touched).expect("persist");
        assert_eq!(history.jobs_from(0).count(), 5);

        // A batch that archives jobs already past retention, into an empty history: written,
        // then deleted, the first time as the second.
        let dir = tempfile::tempdir().expect("tempdir");
        let history = History::open(dir.path()).expect("open");
        let mut data = StateMachineData::of(state_with(3));
        let ids: Vec<u64> = data.state.jobs.keys().copied().collect();
        for id in ids {
            let cancel = Command::CancelJob { job_id: id, reason: "test".into() };
            data.state.apply(&Request { ts: Timestamp::compose(300, 0), command: cancel }).expect("cancel");
        }
        let cutoffs = CompactCutoffs {
            archive_before: Timestamp::compose(301, 0),
            request_ids_before: Timestamp::compose(301, 0),
            jobs_before: Some(Timestamp(3)),
            segments_before: None,
            max_finished_bytes: None,
        };
        let (response, touched) =
            data.state.apply_tracked(&Request { ts: Timestamp::compose(302, 0), command: Command::Compact(cutoffs) });
        response.expect("compact");
        assert_eq!(touched.archived.len(), 3);
        for _ in 0..2 {
            history.persist(&data.state, &touched).expect("persist");
            assert_eq!(history.jobs_from(0).count(), 0, "the archived jobs are past the cutoff");
        }
    }

    /// Archived jobs leave the hot state for the history store; a reopen loads
    /// only the hot state; a snapshot carries the history to a new store, where the same jobs
    /// can be read; both stores have the same digest; retention deletes the oldest records.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn compacted_jobs_move_to_the_history_and_travel_in_snapshots() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateMachineStore::open(dir.path()).expect("open");
        {
            let mut data = store.shared.data.write().unwrap();
            let state = state_with(50);
            data.state = state;
            let touched = cancel_all_and_compact(&mut data, &store.shared.history, 100);
            assert_eq!(touched.archived.len(), 50);
            assert!(data.state.jobs.is_empty() && data.state.request_ids.is_empty());
            data.last_applied = Some(LogId::new(CommittedLeaderId::new(1, 1), 7));
        }
        let job = store.archived_job(3).expect("job 3 is in the history");
        assert_eq!((job.id, job.state), (3, corral_types::JobState::Cancelled));
        assert_eq!(store.archived_jobs_from(48).map(|j| j.id).collect::<Vec<_>>(), vec![48, 49, 50]);

        // A snapshot carries the history to another store.
        let mut builder = store.clone();
        let snapshot = builder.build_snapshot().await.expect("build");
        let hot = load_hot_body(
            std::fs::File::open(
                dir.path().join("snapshots").join(&store.shared.snapshots.current().unwrap().unwrap().body),
            )
            .expect("body"),
        )
        .expect("the hot body");
        assert!(hot.jobs.is_empty(), "archived jobs are not in the hot state a reopen loads");
        assert!(hot.request_ids.is_empty(), "expired request ids are gone from it");
        let other_dir = tempfile::tempdir().expect("tempdir");
        let mut other = StateMachineStore::open(other_dir.path()).expect("open");
        let current = store.shared.snapshots.current().expect("CURRENT").expect("a snapshot");
        assert!(current.history_in_store, "a built snapshot leaves the history to the store");
        let hot_body = std::fs::metadata(dir.path().join("snapshots").join(&current.body)).expect("body").len();
        send(snapshot, &mut other).await;
        let sent = dir.path().join("snapshots").join(SnapshotDir::send_name(&current.body));
        let sent_bytes = std::fs::read(&sent).expect("the body with its history is kept for the next follower");
        assert!(sent_bytes.len() as u64 > hot_body, "the history is added to what is sent");
        let mut again = store.clone();
        let resent = again.get_current_snapshot().await.expect("get").expect("a snapshot");
        let third_dir = tempfile::tempdir().expect("tempdir");
        let mut third = StateMachineStore::open(third_dir.path()).expect("open");
        send(resent, &mut third).await;
        assert_eq!(std::fs::read(&sent).expect("sent"), sent_bytes, "a second follower gets the same bytes");
        assert_eq!(third.archived_jobs_from(0).count(), 50);
        assert_eq!(other.archived_job(50).map(|j| j.id), Some(50));
        assert_eq!(other.archived_jobs_from(0).count(), 50);
        assert_eq!(other.digest(), store.digest());
        drop(other);
        let reopened = reopen(other_dir.path());
        assert_eq!(reopened.archived_jobs_from(0).count(), 50, "the history survives a reopen");
        // A crash while the history was rewritten (here: emptied): the received snapshot,
        // current since before the rewrite, is installed again on open.
        reopened.shared.history.clear();
        drop(reopened);
        let reinstalled = reopen(other_dir.path());
        assert_eq!(reinstalled.archived_jobs_from(0).count(), 50, "the history is installed again");
        assert_eq!(reinstalled.digest(), store.digest());
        drop(reinstalled);

        // Retention: jobs submitted before the cutoff (all of them, at 2 ns) are deleted.
        {
            let mut data = store.shared.data.write().unwrap();
            let cutoffs = CompactCutoffs {
                archive_before: Timestamp::compose(200, 0),
                request_ids_before: Timestamp::compose(200, 0),
                jobs_before: Some(Timestamp(3)),
                segments_before: Some(Timestamp(3)),
                max_finished_bytes: None,
            };
            let request = Request { ts: Timestamp::compose(300, 0), command: Command::Compact(cutoffs) };
            let (response, touched) = data.state.apply_tracked(&request);
            response.expect("compact");
            store.shared.history.persist(&data.state, &touched).expect("persist");
        }
        assert_eq!(store.archived_jobs_from(0).count(), 0, "every archived job was submitted before the cutoff");

        // A store that holds a history the snapshot no longer has: what the body lacks is removed.
        {
            let mut data = store.shared.data.write().unwrap();
            data.last_applied = Some(LogId::new(CommittedLeaderId::new(1, 1), 9));
        }
        let snapshot = store.clone().build_snapshot().await.expect("build");
        let mut behind = reopen(other_dir.path());
        assert_eq!(behind.archived_jobs_from(0).count(), 50);
        send(snapshot, &mut behind).await;
        assert_eq!(behind.archived_jobs_from(0).count(), 0, "records the snapshot lacks are removed");
        assert_eq!(behind.digest(), store.digest());
    }

    /// A snapshot file of the earlier single-file format (meta first, then the body) is
    /// converted on open, and loaded when it is newer than the store.
    #[test]
    fn a_snapshot_file_of_the_earlier_format_is_converted_and_loaded() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("snapshots")).expect("mkdir");
        let meta = meta(42);
        let meta_json = serde_json::to_vec(&meta).expect("json");
        let mut legacy = (meta_json.len() as u64).to_be_bytes().to_vec();
        legacy.extend_from_slice(&meta_json);
        legacy.extend_from_slice(&codec::snapshot_to_bytes(&state_with(20)));
        std::fs::write(dir.path().join("snapshots").join("current.snap"), legacy).expect("write");
        let store = StateMachineStore::open(dir.path()).expect("open");
        assert_eq!(store.read().applied_index(), 42);
        assert_eq!(store.read().state.jobs.len(), 20);
        let current = store.shared.snapshots.current().expect("CURRENT").expect("converted");
        assert_eq!(current.meta.snapshot_id, "1-1-42");
        assert!(!current.history_in_store);
        assert!(!dir.path().join("snapshots").join("current.snap").exists());
    }

    /// A run reported long after it ended, applied in the same batch as a compaction that
    /// archives its segment at once: the segment still reaches the store.
    #[test]
    fn a_segment_archived_in_the_batch_that_wrote_it_is_stored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateMachineStore::open(dir.path()).expect("open");
        let at = |ms: u64| Timestamp::compose(ms, 0);
        let mut data = store.shared.data.write().unwrap();
        let gpu = corral_types::GpuDevice {
            index: 0,
            uuid: "GPU-0".into(),
            model: "RTX 5090".into(),
            memory_mib: 32768,
            ..Default::default()
        };
        let node = corral_types::NodeSpec {
            name: "n1".into(),
            address: "127.0.0.1:1".into(),
            gpus: vec![gpu],
            cpu_millis: 16_000,
            memory_bytes: 64 << 30,
            labels: vec![],
            rendezvous_ports: None,
            lease_end: None,
        };
        let spec =
            JobSpec { tenant: "default".into(), command: vec!["true".into()].into(), gpus: 1, ..Default::default() };
        let setup = [
            Command::Configure(ClusterConfig::dev_defaults()),
            Command::RegisterNode { spec: node },
            Command::SubmitJob { request_id: "r".into(), spec },
            Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: vec![0] },
        ];
        for (i, command) in setup.into_iter().enumerate() {
            let (response, touched) = data.state.apply_tracked(&Request { ts: at(100 + i as u64), command });
            response.expect("setup");
            store.shared.history.persist(&data.state, &touched).expect("persist");
        }
        let epoch = data.state.jobs[&1].allocation.as_ref().expect("placed").epoch;
        let (response, touched) =
            data.state.apply_tracked(&Request { ts: at(200), command: Command::JobStarted { job_id: 1, epoch } });
        response.expect("started");
        store.shared.history.persist(&data.state, &touched).expect("persist");
        // One batch: the exit stamped at 1 s, then a compaction at 10 s archiving before 5 s.
        let report = corral_types::JobExitReport { exit_code: Some(0), run_time_ms: 700, ..Default::default() };
        let finished = Command::JobFinished { job_id: 1, epoch, node: "n1".into(), report };
        let (response, mut batch) = data.state.apply_tracked(&Request { ts: at(1_000), command: finished });
        response.expect("finished");
        let cutoffs = CompactCutoffs {
            archive_before: at(5_000),
            request_ids_before: at(0),
            jobs_before: None,
            segments_before: None,
            max_finished_bytes: None,
        };
        let (response, compacted) =
            data.state.apply_tracked(&Request { ts: at(10_000), command: Command::Compact(cutoffs) });
        response.expect("compact");
        batch.merge(compacted);
        assert!(data.state.ledger.is_empty(), "the segment left the hot ledger in the batch that wrote it");
        store.shared.history.persist(&data.state, &batch).expect("persist");
        drop(data);
        let stored: Vec<(u64, u64)> = store.segments_from(0).map(|g| (g.job_id, g.epoch)).collect();
        assert_eq!(stored, vec![(1, epoch)], "the run is billed in the store");
        assert_eq!(store.archived_job(1).map(|j| j.state), Some(corral_types::JobState::Succeeded));
    }

    /// A digest names the applied index it stands at: two stores that applied the same entries
    /// agree at every index, and a later entry changes the digest along with the index (a
    /// digest compared with another node's at a different index says nothing).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_digest_names_the_index_it_stands_at() {
        let (dir, other_dir) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
        let mut store = StateMachineStore::open(dir.path()).expect("open");
        let mut other = StateMachineStore::open(other_dir.path()).expect("open");
        for s in [&mut store, &mut other] {
            apply_at(s, 1, 1, Command::Configure(ClusterConfig::dev_defaults())).await;
            submit_ids(s, 2, 1_000, "a", 3).await;
        }
        let at_two = store.digest_at();
        assert_eq!(at_two.0, 2);
        assert_eq!(other.digest_at(), at_two);
        submit_ids(&mut store, 3, 2_000, "b", 1).await;
        let at_three = store.digest_at();
        assert_eq!(at_three.0, 3);
        assert_ne!(at_three.1, at_two.1);
        assert_eq!(store.digest(), at_three.1);
    }

    /// Applies `command` at log index `index` through the store, as openraft does.
    async fn apply_at(store: &mut StateMachineStore, index: u64, ms: u64, command: Command) {
        let entry = openraft::Entry::<TypeConfig> {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(crate::types::RaftRequest::new(Request {
                ts: Timestamp::compose(ms, 0),
                command,
            })),
        };
        let responses = store.apply([entry]).await.expect("apply");
        responses.into_iter().for_each(|r| drop(r.expect("applied")));
    }

    /// Submits `n` jobs with request ids `{prefix}{i}` at log index `index`.
    async fn submit_ids(store: &mut StateMachineStore, index: u64, ms: u64, prefix: &str, n: usize) {
        let spec = JobSpec { tenant: "default".into(), command: vec!["true".into()].into(), ..Default::default() };
        let jobs = (0..n).map(|i| (format!("{prefix}{i}"), spec.clone())).collect();
        apply_at(store, index, ms, Command::SubmitJobs { jobs }).await;
    }

    /// Request ids are written once: each build writes those recorded since the one before into
    /// a file of its own and names the earlier files; a reopen reads them all back; a file whose
    /// ids all expired is dropped; small files merge into the new one, so the files stay few; a
    /// follower gets the ids inside the snapshot.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn request_ids_are_written_once_into_files_the_snapshot_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = StateMachineStore::open(dir.path()).expect("open");
        apply_at(&mut store, 1, 1, Command::Configure(ClusterConfig::dev_defaults())).await;
        submit_ids(&mut store, 2, 1_000, "a", 100).await;
        store.clone().build_snapshot().await.expect("build");
        let files = |store: &StateMachineStore| store.shared.snapshots.current().unwrap().unwrap().request_ids;
        let sizes = |store: &StateMachineStore| files(store).iter().map(|f| f.entries).collect::<Vec<_>>();
        let first = files(&store);
        assert_eq!(sizes(&store), vec![100], "the first build writes all");
        let body = dir.path().join("snapshots").join(store.shared.snapshots.current().unwrap().unwrap().body);
        let hot = load_hot_body(std::fs::File::open(&body).expect("body")).expect("hot body");
        assert!(hot.request_ids.is_empty(), "the body leaves its request ids to the files");

        submit_ids(&mut store, 3, 2_000, "b", 20).await;
        store.clone().build_snapshot().await.expect("build");
        let second = files(&store);
        assert_eq!(second.len(), 2);
        assert_eq!(second[0], first[0], "the earlier file is named again, not written again");
        assert_eq!((second[1].entries, second[1].max_at), (20, Timestamp::compose(2_000, 0).0));
        // Applied after the build: the next one writes them (or the log after it replays them).
        submit_ids(&mut store, 4, 3_000, "c", 10).await;
        let expected = store.read().state.request_ids.clone();
        assert_eq!(expected.len(), 130);
        drop(store);
        let mut store = reopen(dir.path());
        assert_eq!(store.read().state.request_ids.len(), 120, "the snapshot's ids: the files");
        submit_ids(&mut store, 4, 3_000, "c", 10).await;
        assert_eq!(store.read().state.request_ids, expected, "and the entry after it applied again");
        // A retried submit is a duplicate after the reopen, whichever file holds its id.
        let spec = JobSpec { tenant: "default".into(), command: vec!["true".into()].into(), ..Default::default() };
        let retry =
            Request { ts: Timestamp::compose(3_500, 0), command: Command::SubmitJob { request_id: "a7".into(), spec } };
        assert!(matches!(store.read().state.clone().apply(&retry), Ok(Outcome::JobSubmitted { duplicate: true, .. })));

        // The ids of the first file expire: the next build drops it, and merges the file of 20
        // (at most twice the 10 new ones) into its new file.
        let cutoffs = CompactCutoffs {
            archive_before: Timestamp::ZERO,
            request_ids_before: Timestamp::compose(1_500, 0),
            jobs_before: None,
            segments_before: None,
            max_finished_bytes: None,
        };
        apply_at(&mut store, 5, 4_000, Command::Compact(cutoffs)).await;
        store.clone().build_snapshot().await.expect("build");
        assert_eq!(sizes(&store), vec![30]);
        for old in first.iter().chain(&second) {
            assert!(!dir.path().join("snapshots").join(&old.name).exists(), "{} is removed", old.name);
        }
        let live = store.read().state.request_ids.clone();
        assert_eq!(live.len(), 30);

        // Many small builds: the files stay few, each more than twice the next.
        for i in 0..100u64 {
            submit_ids(&mut store, 10 + i, 6_000 + i, &format!("e{i}-"), 1 + (i % 3) as usize).await;
            store.clone().build_snapshot().await.expect("build");
            let sizes = sizes(&store);
            assert!(sizes.windows(2).all(|w| w[0] > 2 * w[1]), "after build {i}: {sizes:?}");
            assert!(sizes.len() <= 8, "after build {i}: {sizes:?}");
        }
        let expected = store.read().state.request_ids.clone();
        assert_eq!(sizes(&store).iter().sum::<u64>(), expected.len() as u64);
        let named: Vec<String> = files(&store).into_iter().map(|f| f.name).collect();
        let on_disk = std::fs::read_dir(dir.path().join("snapshots")).unwrap().filter_map(|e| e.ok());
        let mut on_disk: Vec<String> = on_disk.map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        on_disk.retain(|n| n.ends_with(".ids"));
        on_disk.sort();
        let mut sorted = named.clone();
        sorted.sort();
        assert_eq!(on_disk, sorted, "only the named files are kept");
        drop(store);
        let store = reopen(dir.path());
        assert_eq!(store.read().state.request_ids, expected);

        // A follower gets the ids inside the snapshot and writes them all at its first build.
        let snapshot = store.clone().get_current_snapshot().await.expect("get").expect("a snapshot");
        let other_dir = tempfile::tempdir().expect("tempdir");
        let mut other = StateMachineStore::open(other_dir.path()).expect("open");
        send(snapshot, &mut other).await;
        assert_eq!(other.read().state.request_ids, expected);
        assert_eq!(other.digest(), store.digest());
        submit_ids(&mut other, 200, 9_000, "d", 5).await;
        other.clone().build_snapshot().await.expect("build");
        assert_eq!(sizes(&other), vec![expected.len() as u64 + 5]);
        drop(other);
        let other = reopen(other_dir.path());
        assert_eq!(other.read().state.request_ids.len(), expected.len() + 5);
    }

    /// Sends `snapshot` to `to` as openraft does: read from the data in chunks, written into
    /// data `to` made to receive it, then installed.
    async fn send(snapshot: Snapshot<TypeConfig>, to: &mut StateMachineStore) {
        use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
        let mut data = snapshot.snapshot;
        let end = data.seek(std::io::SeekFrom::End(0)).await.expect("seek to the end");
        let mut received = to.begin_receiving_snapshot().await.expect("begin receiving");
        let mut offset = 0;
        while offset < end {
            data.seek(std::io::SeekFrom::Start(offset)).await.expect("seek");
            let mut chunk = vec![0u8; 64 << 10];
            let n = data.read(&mut chunk).await.expect("read a chunk");
            assert!(n > 0, "the data ended at {offset} of {end}");
            received.write_all(&chunk[..n]).await.expect("write a chunk");
            offset += n as u64;
        }
        received.shutdown().await.expect("shutdown");
        to.install_snapshot(&snapshot.meta, received).await.expect("install");
    }

    /// Data received with `bytes` in it, ready to install.
    async fn received(store: &mut StateMachineStore, bytes: &[u8]) -> Box<SnapshotFile> {
        use tokio::io::AsyncWriteExt;
        let mut data = store.begin_receiving_snapshot().await.expect("begin receiving");
        data.write_all(bytes).await.expect("write");
        data.shutdown().await.expect("shutdown");
        data
    }

    fn meta(index: u64) -> SnapshotMetaT {
        SnapshotMeta {
            last_log_id: Some(LogId::new(CommittedLeaderId::new(1, 1), index)),
            last_membership: StoredMembership::default(),
            snapshot_id: format!("1-1-{index}"),
        }
    }

    /// A snapshot build (of the state at index 10) racing an install (of the state at index
    /// 20) leaves the snapshot file whole and at index 20: never corrupt, never rolled back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_build_racing_an_install_keeps_the_newest_snapshot_intact() {
        let (older, newer) = (state_with(30_000), state_with(30_001));
        let (older_bytes, newer_bytes) = (codec::snapshot_to_bytes(&older), codec::snapshot_to_bytes(&newer));
        for round in 0..6 {
            let dir = tempfile::tempdir().expect("tempdir");
            let mut store = StateMachineStore::open(dir.path()).expect("open");
            let older = received(&mut store, &older_bytes).await;
            store.install_snapshot(&meta(10), older).await.expect("install older");
            let (mut builder, mut installer) = (store.clone(), store.clone());
            let newer = received(&mut store, &newer_bytes).await;
            let build = tokio::spawn(async move { builder.build_snapshot().await.map(|_| ()) });
            let install = tokio::spawn(async move { installer.install_snapshot(&meta(20), newer).await });
            let (built, installed) = (build.await.expect("build task"), install.await.expect("install task"));
            built.unwrap_or_else(|e| panic!("round {round}: build failed: {e}"));
            installed.unwrap_or_else(|e| panic!("round {round}: install failed: {e}"));
            let current = store
                .shared
                .snapshots
                .current()
                .unwrap_or_else(|e| panic!("round {round}: unreadable CURRENT: {e}"))
                .expect("a current snapshot");
            assert_eq!(current.meta.last_log_id.map(|l| l.index), Some(20), "round {round}: the snapshot went back");
            let bytes = std::fs::read(dir.path().join("snapshots").join(&current.body)).expect("the current body");
            let state = codec::snapshot_from_bytes(&bytes)
                .unwrap_or_else(|e| panic!("round {round}: corrupt snapshot state: {e}"));
            assert_eq!(state.jobs.len(), 30_001, "round {round}");
            let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("snapshots"))
                .expect("dir")
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != "CURRENT" && *n != current.body)
                .collect();
            assert!(leftovers.is_empty(), "round {round}: temporary files left: {leftovers:?}");
        }
    }
}
