//! The replicated state machine: `corral_core::State` in memory, persisted in sled, with fsynced
//! snapshot files, and the on-disk history of finished jobs and billed segments.
//!
//! The history lives in the same sled tree: `h/<job id>` holds each job a `Compact` took out of
//! the hot state, `t/<array><index>` finds an archived array task, and `l/<segment id>` holds
//! every segment (the hot state keeps only recent ones). Retention deletes from the front of
//! `h/` and `l/` by a pure predicate on each record (ids grow with submit and end time), so
//! every replica deletes the same records.
//!
//! Invariant: sled is written in one atomic batch (one tree, prefixed keys) per applied batch of
//! entries, including the last applied log id, so a reopened sled is a consistent prefix of the
//! log; whatever sled lost is re-applied from the log. A snapshot file newer than sled wins on open, because the log
//! before it may already be purged.

use crate::change_log::ChangeLog;
use crate::codec;
use crate::types::{LogId, NodeId, StoredMembership, TypeConfig};
use corral_core::{CompactCutoffs, Outcome, RequestRecord, State, Touched};
use corral_types::{Job, JobId, Segment, Timestamp};
use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError, StorageIOError};
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use tokio::sync::watch;

const META_RAFT_APPLIED: &[u8] = b"m/raft/last_applied";
const META_RAFT_MEMBERSHIP: &[u8] = b"m/raft/membership";
const META_STATE: &[u8] = b"m/state";
const SNAPSHOT_FILE: &str = "current.snap";
/// sled's page cache (its default is 1 GiB): the hot state is in memory already, and the
/// history is read page by page, so a small cache keeps a coordinator's memory bounded.
const SLED_CACHE_BYTES: u64 = 128 << 20;
/// A snapshot file is synced every this many bytes while it is written.
const SNAPSHOT_SYNC_BYTES: usize = 8 << 20;

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

/// One sled tree with key prefixes, so every applied batch is a single atomic `apply_batch`
/// (no cross-tree transaction).
struct Trees {
    db: sled::Db,
    tree: sled::Tree,
}

const JOB: &[u8] = b"j/";
const NODE: &[u8] = b"n/";
const REQUEST: &[u8] = b"r/";
const SEGMENT: &[u8] = b"l/";
const POLICY: &[u8] = b"p/";
const HISTORY: &[u8] = b"h/";
const TASK: &[u8] = b"t/";

fn key(prefix: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + rest.len());
    k.extend_from_slice(prefix);
    k.extend_from_slice(rest);
    k
}

struct Shared {
    data: RwLock<StateMachineData>,
    trees: Trees,
    snapshot_dir: PathBuf,
    /// Serializes writes of the snapshot file (a build and an install may race).
    snapshot_file: std::sync::Mutex<()>,
    applied_tx: watch::Sender<u64>,
    /// Which jobs each applied entry changed, for `WatchJobs` resumes (locked inside `data`'s lock).
    changes: std::sync::Mutex<ChangeLog>,
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

fn json_err(e: serde_json::Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

impl StateMachineStore {
    /// Opens (or creates) the store under `dir` (`dir/sm` for sled, `dir/snapshots`).
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let snapshot_dir = dir.join("snapshots");
        std::fs::create_dir_all(&snapshot_dir)?;
        // sled flushes in the background (every 500 ms by default); durability still comes from
        // the Raft log and fsynced snapshots, whatever sled lost is re-applied on open.
        let db = sled::Config::new().path(dir.join("sm")).cache_capacity(SLED_CACHE_BYTES).open()?;
        let trees = Trees { tree: db.open_tree("state")?, db };
        let mut data = load_from_sled(&trees)?;
        if let Some((meta, bytes)) = read_snapshot_file(&snapshot_dir)? {
            if meta.last_log_id > data.last_applied {
                tracing::info!(snapshot = %meta.snapshot_id, "state machine store is older than the snapshot: loading the snapshot");
                let contents = codec::snapshot_contents(&bytes)?;
                data = StateMachineData {
                    state: contents.state.clone(),
                    last_applied: meta.last_log_id,
                    membership: meta.last_membership.clone(),
                };
                rewrite_sled(&trees, &data, &contents)?;
            }
        }
        let applied = data.last_applied.map(|l| l.index).unwrap_or(0);
        let (applied_tx, _) = watch::channel(applied);
        let shared = Shared {
            data: RwLock::new(data),
            trees,
            snapshot_dir,
            snapshot_file: std::sync::Mutex::new(()),
            applied_tx,
            changes: std::sync::Mutex::new(ChangeLog::new(crate::change_log::DEFAULT_CHANGE_LOG_CAPACITY, applied)),
        };
        Ok(StateMachineStore { shared: Arc::new(shared) })
    }

    /// Read access to the applied state. Never hold the guard across an `.await`.
    pub fn read(&self) -> RwLockReadGuard<'_, StateMachineData> {
        self.shared.data.read().unwrap_or_else(|p| p.into_inner())
    }

    /// FNV-1a of the encoded state and its history: equal on every node that applied the same
    /// log prefix. Encodes everything: for tests and `cluster status --digest`, not a hot path.
    pub fn digest(&self) -> u64 {
        let (bytes, _) = self.snapshot_bytes().unwrap_or_default();
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
    }

    /// The snapshot of the state as of now: the hot state is cloned under the read lock (it
    /// holds live and recently finished jobs only) and encoded after the lock is released; the
    /// history is appended from the store, as of the clone: archived jobs not in the clone's
    /// hot state, segments below its hot ledger.
    fn snapshot_bytes(&self) -> std::io::Result<(Vec<u8>, AppliedAt)> {
        let (state, applied) = {
            let data = self.read();
            (data.state.clone(), (data.last_applied, data.membership.clone()))
        };
        let mut bytes = codec::snapshot_to_bytes(&state);
        let tree = &self.shared.trees.tree;
        let scan_err = |e: sled::Error| std::io::Error::other(format!("sled scan failed: {e}"));
        for kv in tree.scan_prefix(HISTORY) {
            let (k, v) = kv.map_err(scan_err)?;
            let id = k[HISTORY.len()..].try_into().map(u64::from_be_bytes).unwrap_or(u64::MAX);
            if id < state.next_job_id && !state.jobs.contains_key(&id) {
                codec::snapshot_append_archived_job(&mut bytes, &v);
            }
        }
        for kv in
            tree.range(key(SEGMENT, &0u64.to_be_bytes())..key(SEGMENT, &state.segments_archived_below.to_be_bytes()))
        {
            let (_, v) = kv.map_err(scan_err)?;
            codec::snapshot_append_segment(&mut bytes, &v);
        }
        Ok((bytes, applied))
    }

    /// A job of the history (finished and moved out of the hot state), if kept.
    pub fn archived_job(&self, id: JobId) -> Option<Job> {
        let bytes = self.shared.trees.tree.get(key(HISTORY, &id.to_be_bytes())).ok()??;
        codec::job_from_bytes(&bytes).ok()
    }

    /// Task `index` of job array `array` from the history, if kept.
    pub fn archived_task(&self, array: JobId, index: u32) -> Option<Job> {
        let id = self.shared.trees.tree.get(task_key(array, index)).ok()??;
        self.archived_job(u64::from_be_bytes(id.as_ref().try_into().ok()?))
    }

    /// Jobs of the history with an id of at least `from`, in id order (lazily read).
    pub fn archived_jobs_from(&self, from: JobId) -> impl Iterator<Item = Job> + '_ {
        self.shared
            .trees
            .tree
            .range(key(HISTORY, &from.to_be_bytes())..prefix_end(HISTORY))
            .filter_map(|kv| kv.ok())
            .filter_map(|(_, v)| codec::job_from_bytes(&v).ok())
    }

    /// Billing segments (hot and archived) with an id of at least `from`, in id order.
    pub fn segments_from(&self, from: u64) -> impl Iterator<Item = Segment> + '_ {
        self.shared
            .trees
            .tree
            .range(key(SEGMENT, &from.to_be_bytes())..prefix_end(SEGMENT))
            .filter_map(|kv| kv.ok())
            .filter_map(|(_, v)| codec::segment_from_bytes(&v).ok())
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

fn load_from_sled(t: &Trees) -> anyhow::Result<StateMachineData> {
    let last_applied = match t.tree.get(META_RAFT_APPLIED)? {
        Some(v) => serde_json::from_slice(&v)?,
        None => None,
    };
    let membership = match t.tree.get(META_RAFT_MEMBERSHIP)? {
        Some(v) => serde_json::from_slice(&v)?,
        None => StoredMembership::default(),
    };
    let Some(meta) = t.tree.get(META_STATE)? else {
        return Ok(StateMachineData { state: State::default(), last_applied, membership });
    };
    let meta = codec::meta_from_bytes(&meta)?;
    let mut jobs = std::collections::BTreeMap::new();
    for kv in t.tree.scan_prefix(JOB) {
        let (_, v) = kv?;
        let job = codec::job_from_bytes(&v)?;
        jobs.insert(job.id, job);
    }
    let mut nodes = std::collections::BTreeMap::new();
    for kv in t.tree.scan_prefix(NODE) {
        let (_, v) = kv?;
        let node = codec::node_from_bytes(&v)?;
        nodes.insert(node.spec.name.clone(), node);
    }
    let mut request_ids = std::collections::BTreeMap::new();
    for kv in t.tree.scan_prefix(REQUEST) {
        let (k, v) = kv?;
        let k = &k[REQUEST.len()..];
        let record = request_record_from_bytes(&v).ok_or_else(|| anyhow::anyhow!("corrupt request id entry"))?;
        request_ids.insert(String::from_utf8_lossy(k).into_owned(), record);
    }
    let mut state = State::from_parts(
        jobs,
        nodes,
        request_ids,
        meta.next_job_id,
        meta.next_epoch,
        meta.last_ts,
        meta.config,
        meta.coordinators,
        meta.tso_window_end_ms,
    );
    state.usage = meta.usage;
    state.next_segment_id = meta.next_segment_id;
    state.tokens = meta.tokens;
    state.next_token_id = meta.next_token_id;
    state.policy_version = meta.policy_version;
    for kv in t.tree.scan_prefix(POLICY) {
        let (_, v) = kv?;
        state.policy_history.push(codec::policy_record_from_bytes(&v)?);
    }
    state.join_tokens = meta.join_tokens;
    state.next_join_token_id = meta.next_join_token_id;
    state.segments_archived_below = meta.segments_archived_below;
    state.archived_billed = meta.archived_billed;
    for kv in t.tree.range(key(SEGMENT, &meta.segments_archived_below.to_be_bytes())..prefix_end(SEGMENT)) {
        let (_, v) = kv?;
        let segment = codec::segment_from_bytes(&v)?;
        state.ledger.insert(segment.id, segment);
    }
    Ok(StateMachineData { state, last_applied, membership })
}

/// The first key after every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

fn request_record_to_bytes(r: &RequestRecord) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&r.job_id.to_be_bytes());
    bytes[8..].copy_from_slice(&r.at.0.to_be_bytes());
    bytes
}

/// A request id entry: the job id, then the submit's timestamp (absent in entries written
/// before request ids expired: they expire at the next compaction).
fn request_record_from_bytes(v: &[u8]) -> Option<RequestRecord> {
    let job_id = u64::from_be_bytes(v.get(..8)?.try_into().ok()?);
    let at = match v.get(8..) {
        Some([]) => 0,
        Some(rest) => u64::from_be_bytes(rest.try_into().ok()?),
        None => return None,
    };
    Some(RequestRecord { job_id, at: Timestamp(at) })
}

/// Writes `job` (encoded as `bytes`) into the history, with its task key if it is an array task.
fn put_archived(batch: &mut sled::Batch, job: &Job, bytes: &[u8]) {
    let id = job.id.to_be_bytes();
    batch.insert(key(HISTORY, &id), bytes);
    if let Some(task) = job.array_task {
        batch.insert(task_key(task.array, task.index), &id);
    }
}

fn task_key(array: u64, index: u32) -> Vec<u8> {
    let mut rest = array.to_be_bytes().to_vec();
    rest.extend_from_slice(&index.to_be_bytes());
    key(TASK, &rest)
}

/// Replaces everything in sled with `data` and the history of `contents` (a snapshot), and
/// flushes.
fn rewrite_sled(t: &Trees, data: &StateMachineData, contents: &codec::SnapshotContents<'_>) -> anyhow::Result<()> {
    t.tree.clear()?;
    // The history first, in bounded batches; the hot state and `last_applied` last, so a crash
    // in between leaves a store that the snapshot replaces again on the next open.
    for chunk in contents.archived_jobs.chunks(10_000) {
        let mut batch = sled::Batch::default();
        for bytes in chunk {
            put_archived(&mut batch, &codec::job_from_bytes(bytes)?, bytes);
        }
        t.tree.apply_batch(batch)?;
    }
    for chunk in contents.segments.chunks(10_000) {
        let mut batch = sled::Batch::default();
        for bytes in chunk {
            let segment = codec::segment_from_bytes(bytes)?;
            batch.insert(key(SEGMENT, &segment.id.to_be_bytes()), *bytes);
        }
        t.tree.apply_batch(batch)?;
    }
    let all = Touched {
        jobs: data.state.jobs.keys().copied().collect(),
        nodes: data.state.nodes.keys().cloned().collect(),
        policy: true,
        ..Touched::default()
    };
    persist(t, data, &all)?;
    for (request_id, record) in &data.state.request_ids {
        t.tree.insert(key(REQUEST, request_id.as_bytes()), &request_record_to_bytes(record))?;
    }
    t.db.flush()?;
    Ok(())
}

/// Deletes the history records past the retention of `cutoffs`: archived jobs submitted before
/// `jobs_before` (and their task keys), segments that ended before `segments_before`.
fn expire_history(t: &Trees, cutoffs: &CompactCutoffs, batch: &mut sled::Batch) -> Result<(), std::io::Error> {
    let scan_err = |e: sled::Error| std::io::Error::other(format!("sled scan failed: {e}"));
    let decode_err = |e: codec::CodecError| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string());
    if let Some(before) = cutoffs.jobs_before {
        for kv in t.tree.scan_prefix(HISTORY) {
            let (k, v) = kv.map_err(scan_err)?;
            let job = codec::job_from_bytes(&v).map_err(decode_err)?;
            if job.submitted_at >= before {
                break;
            }
            if let Some(task) = job.array_task {
                batch.remove(task_key(task.array, task.index));
            }
            batch.remove(k);
        }
    }
    if let Some(before) = cutoffs.segments_before {
        for kv in t.tree.scan_prefix(SEGMENT) {
            let (k, v) = kv.map_err(scan_err)?;
            let segment = codec::segment_from_bytes(&v).map_err(decode_err)?;
            if segment.end >= before {
                break;
            }
            batch.remove(k);
        }
    }
    Ok(())
}

/// Writes what `touched` names plus the scalar state and the raft metadata, atomically.
fn persist(t: &Trees, data: &StateMachineData, touched: &Touched) -> Result<(), std::io::Error> {
    let state = &data.state;
    let mut batch = sled::Batch::default();
    for id in &touched.jobs {
        match state.jobs.get(id) {
            Some(job) => {
                batch.insert(key(JOB, &id.to_be_bytes()), codec::job_to_bytes(job));
                if let Some(record) = state.request_ids.get(&job.request_id).filter(|r| r.job_id == *id) {
                    batch.insert(key(REQUEST, job.request_id.as_bytes()), &request_record_to_bytes(record));
                }
            }
            None => batch.remove(key(JOB, &id.to_be_bytes())),
        }
    }
    for job in &touched.archived {
        batch.remove(key(JOB, &job.id.to_be_bytes()));
        put_archived(&mut batch, job, &codec::job_to_bytes(job));
    }
    for request_id in &touched.expired_request_ids {
        batch.remove(key(REQUEST, request_id.as_bytes()));
    }
    if let Some(cutoffs) = &touched.history_cutoffs {
        expire_history(t, cutoffs, &mut batch)?;
    }
    for name in &touched.nodes {
        match state.nodes.get(name) {
            Some(node) => batch.insert(key(NODE, name.as_bytes()), codec::node_to_bytes(node)),
            None => batch.remove(key(NODE, name.as_bytes())),
        }
    }
    for id in &touched.segments {
        if let Some(segment) = state.ledger.get(id) {
            batch.insert(key(SEGMENT, &id.to_be_bytes()), codec::segment_to_bytes(segment));
        }
    }
    // A segment written and archived in one batch (a run reported long after it ended, then a
    // compaction) is no longer in the hot ledger: write it from what the compaction took.
    for segment in touched.archived_segments.iter().filter(|g| touched.segments.contains(&g.id)) {
        batch.insert(key(SEGMENT, &segment.id.to_be_bytes()), codec::segment_to_bytes(segment));
    }
    if touched.policy {
        // Rare (a policy apply): rewrite the kept history, dropping what fell out of it.
        let kept: std::collections::BTreeSet<u64> = state.policy_history.iter().map(|r| r.version).collect();
        for kv in t.tree.scan_prefix(POLICY) {
            let (k, _) = kv.map_err(|e| std::io::Error::other(format!("sled scan failed: {e}")))?;
            let version = k[POLICY.len()..].try_into().map(u64::from_be_bytes).unwrap_or(0);
            if !kept.contains(&version) {
                batch.remove(k);
            }
        }
        for record in &state.policy_history {
            batch.insert(key(POLICY, &record.version.to_be_bytes()), codec::policy_record_to_bytes(record));
        }
    }
    batch.insert(META_STATE, codec::meta_to_bytes(state));
    batch.insert(META_RAFT_APPLIED, serde_json::to_vec(&data.last_applied).map_err(json_err)?);
    batch.insert(META_RAFT_MEMBERSHIP, serde_json::to_vec(&data.membership).map_err(json_err)?);
    t.tree.apply_batch(batch).map_err(|e| std::io::Error::other(format!("sled batch failed: {e}")))
}

type SnapshotMetaT = SnapshotMeta<NodeId, openraft::BasicNode>;

/// The last applied log id and membership a snapshot stands at.
type AppliedAt = (Option<LogId>, StoredMembership);

/// Snapshot file: u64 BE length of the JSON meta, the meta, then the protobuf state.
///
/// Invariant: the file only moves forward. Writers (a snapshot build and an install can run at
/// once) take `lock`, write their own temporary file, and replace the current file only if it
/// is not newer than theirs; returns false when a newer snapshot was already there.
fn write_snapshot_file(
    dir: &Path,
    lock: &std::sync::Mutex<()>,
    meta: &SnapshotMetaT,
    state: &[u8],
) -> std::io::Result<bool> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let meta_json = serde_json::to_vec(meta).map_err(json_err)?;
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{SNAPSHOT_FILE}.tmp-{}-{n}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&(meta_json.len() as u64).to_be_bytes())?;
        f.write_all(&meta_json)?;
        // Synced as it is written: a snapshot of a large history never leaves hundreds of
        // megabytes of dirty pages for the Raft log's next fsync to wait behind.
        for chunk in state.chunks(SNAPSHOT_SYNC_BYTES) {
            f.write_all(chunk)?;
            f.sync_data()?;
        }
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
    let current = read_snapshot_meta(dir).ok().flatten();
    if current.is_some_and(|c| c.last_log_id > meta.last_log_id) {
        let _ = std::fs::remove_file(&tmp);
        return Ok(false);
    }
    std::fs::rename(&tmp, dir.join(SNAPSHOT_FILE))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(true)
}

/// The meta of the current snapshot file, without reading the state.
fn read_snapshot_meta(dir: &Path) -> std::io::Result<Option<SnapshotMetaT>> {
    use std::io::Read;
    let mut file = match std::fs::File::open(dir.join(SNAPSHOT_FILE)) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut len = [0u8; 8];
    file.read_exact(&mut len)?;
    let len = usize::try_from(u64::from_be_bytes(len))
        .ok()
        .filter(|l| *l < 64 << 20)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "corrupt snapshot file"))?;
    let mut meta = vec![0u8; len];
    file.read_exact(&mut meta)?;
    serde_json::from_slice(&meta).map(Some).map_err(json_err)
}

fn read_snapshot_file(dir: &Path) -> std::io::Result<Option<(SnapshotMetaT, Vec<u8>)>> {
    let bytes = match std::fs::read(dir.join(SNAPSHOT_FILE)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let corrupt = || std::io::Error::new(std::io::ErrorKind::InvalidData, "corrupt snapshot file");
    let len = u64::from_be_bytes(bytes.get(..8).ok_or_else(corrupt)?.try_into().map_err(|_| corrupt())?) as usize;
    let meta_end = 8usize.checked_add(len).filter(|e| *e <= bytes.len()).ok_or_else(corrupt)?;
    let meta: SnapshotMetaT = serde_json::from_slice(&bytes[8..meta_end]).map_err(json_err)?;
    Ok(Some((meta, bytes[meta_end..].to_vec())))
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
        let mut responses = Vec::new();
        let applied = {
            let mut data = shared.data.write().unwrap_or_else(|p| p.into_inner());
            let mut touched = Touched::default();
            for entry in entries {
                data.last_applied = Some(entry.log_id);
                let response = match entry.payload {
                    EntryPayload::Blank => Ok(Outcome::Done),
                    EntryPayload::Normal(request) => {
                        let (response, t) = data.state.apply_tracked(&request.0);
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
            persist(&shared.trees, &data, &touched).map_err(io_err)?;
            data.last_applied.map(|l| l.index).unwrap_or(0)
        };
        shared.applied_tx.send_replace(applied);
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaT,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = snapshot.into_inner();
        let contents = codec::snapshot_contents(&bytes)
            .map_err(|e| StorageError::from(StorageIOError::<NodeId>::read_snapshot(Some(meta.signature()), &e)))?;
        let shared = Arc::clone(&self.shared);
        let (meta_copy, written_bytes) = (meta.clone(), bytes.clone());
        tokio::task::spawn_blocking(move || {
            write_snapshot_file(&shared.snapshot_dir, &shared.snapshot_file, &meta_copy, &written_bytes)
        })
        .await
        .map_err(|e| io_err(std::io::Error::other(e.to_string())))?
        .map_err(|e| StorageError::from(StorageIOError::<NodeId>::write_snapshot(Some(meta.signature()), &e)))?;
        let applied = {
            let mut data = self.shared.data.write().unwrap_or_else(|p| p.into_inner());
            *data = StateMachineData {
                state: contents.state.clone(),
                last_applied: meta.last_log_id,
                membership: meta.last_membership.clone(),
            };
            rewrite_sled(&self.shared.trees, &data, &contents)
                .map_err(|e| io_err(std::io::Error::other(e.to_string())))?;
            self.changes().reset(data.applied_index());
            data.last_applied.map(|l| l.index).unwrap_or(0)
        };
        self.shared.applied_tx.send_replace(applied);
        tracing::info!(snapshot = %meta.snapshot_id, "installed snapshot");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let found = read_snapshot_file(&self.shared.snapshot_dir).map_err(read_err)?;
        Ok(found.map(|(meta, bytes)| Snapshot { meta, snapshot: Box::new(Cursor::new(bytes)) }))
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let store = self.clone();
        let (bytes, (last_applied, membership)) =
            tokio::task::spawn_blocking(move || at_low_priority(|| store.snapshot_bytes()))
                .await
                .map_err(|e| io_err(std::io::Error::other(e.to_string())))?
                .map_err(|e| StorageError::from(StorageIOError::<NodeId>::read_state_machine(&e)))?;
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => "empty".to_string(),
        };
        let meta = SnapshotMeta { last_log_id: last_applied, last_membership: membership, snapshot_id };
        let shared = Arc::clone(&self.shared);
        let (meta, bytes, current) = tokio::task::spawn_blocking(move || {
            at_low_priority(|| write_snapshot_file(&shared.snapshot_dir, &shared.snapshot_file, &meta, &bytes))
                .map(|w| (meta, bytes, w))
        })
        .await
        .map_err(|e| io_err(std::io::Error::other(e.to_string())))?
        .map_err(|e| StorageError::from(StorageIOError::<NodeId>::write_snapshot(None, &e)))?;
        if current {
            tracing::info!(snapshot = %meta.snapshot_id, bytes = bytes.len(), "built snapshot");
        } else {
            tracing::info!(snapshot = %meta.snapshot_id, "built snapshot is older than the installed one: not kept");
        }
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(bytes)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::{ClusterConfig, Command, Request};
    use corral_types::{JobSpec, Timestamp};
    use openraft::{CommittedLeaderId, LogId};

    /// A state with `jobs` queued jobs: a snapshot of a few megabytes.
    fn state_with(jobs: usize) -> State {
        let mut state = State::default();
        let config = Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) };
        state.apply(&config).expect("configure");
        let spec = |i: usize| JobSpec {
            name: format!("job-{i}"),
            tenant: "default".into(),
            command: vec!["sleep".into(), "x".repeat(64)],
            ..Default::default()
        };
        let batch = (0..jobs).map(|i| (format!("r{i}"), spec(i))).collect();
        state.apply(&Request { ts: Timestamp(2), command: Command::SubmitJobs { jobs: batch } }).expect("submit");
        state
    }

    /// The policy history is stored per version: what an apply records survives a reopen,
    /// and versions that fell out of the history leave the store.
    #[test]
    fn policy_history_is_stored_per_version_and_pruned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::Config::new().path(dir.path().join("sm")).open().expect("sled");
        let trees = Trees { tree: db.open_tree("state").expect("tree"), db };
        let mut data = StateMachineData::of(State::default());
        let mut config = ClusterConfig::dev_defaults();
        for version in 1..=3u64 {
            config.default_gpu_price = version * 1000;
            let request = Request {
                ts: Timestamp(version),
                command: Command::ApplyPolicy { config: config.clone(), by: "admin".into(), force: false },
            };
            let (response, touched) = data.state.apply_tracked(&request);
            response.expect("apply");
            assert!(touched.policy);
            persist(&trees, &data, &touched).expect("persist");
        }
        let loaded = load_from_sled(&trees).expect("load");
        assert_eq!(loaded.state.policy_history, data.state.policy_history);
        assert_eq!(loaded.state.policy_version, 3);
        data.state.policy_history.remove(0);
        persist(&trees, &data, &Touched { policy: true, ..Touched::default() }).expect("persist");
        let loaded = load_from_sled(&trees).expect("load");
        let versions: Vec<u64> = loaded.state.policy_history.iter().map(|r| r.version).collect();
        assert_eq!(versions, vec![2, 3]);
    }

    /// Ends every job of `state` (cancelled while pending) and compacts: all of them move to the
    /// history. Returns what the compaction touched.
    fn cancel_all_and_compact(data: &mut StateMachineData, trees: &Trees, ms: u64) -> Touched {
        let ids: Vec<u64> = data.state.jobs.keys().copied().collect();
        let at = |ms: u64| Timestamp::compose(ms, 0);
        for id in ids {
            let request = Request { ts: at(ms), command: Command::CancelJob { job_id: id, reason: "test".into() } };
            let (response, touched) = data.state.apply_tracked(&request);
            response.expect("cancel");
            persist(trees, data, &touched).expect("persist");
        }
        let cutoffs = CompactCutoffs {
            archive_before: at(ms + 1),
            request_ids_before: at(ms + 1),
            jobs_before: None,
            segments_before: None,
        };
        let (response, touched) =
            data.state.apply_tracked(&Request { ts: at(ms + 2), command: Command::Compact(cutoffs) });
        response.expect("compact");
        persist(trees, data, &touched).expect("persist");
        touched
    }

    /// Archived jobs leave the hot state and its sled records for the history; a reopen loads
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
            let all = Touched { jobs: data.state.jobs.keys().copied().collect(), ..Touched::default() };
            persist(&store.shared.trees, &data, &all).expect("persist");
            let touched = cancel_all_and_compact(&mut data, &store.shared.trees, 100);
            assert_eq!(touched.archived.len(), 50);
            assert!(data.state.jobs.is_empty() && data.state.request_ids.is_empty());
            data.last_applied = Some(LogId::new(CommittedLeaderId::new(1, 1), 7));
            persist(&store.shared.trees, &data, &Touched::default()).expect("persist");
        }
        let job = store.archived_job(3).expect("job 3 is in the history");
        assert_eq!((job.id, job.state), (3, corral_types::JobState::Cancelled));
        assert_eq!(store.archived_jobs_from(48).map(|j| j.id).collect::<Vec<_>>(), vec![48, 49, 50]);
        let loaded = load_from_sled(&store.shared.trees).expect("load");
        assert!(loaded.state.jobs.is_empty(), "archived jobs are not loaded into memory");
        assert!(loaded.state.request_ids.is_empty(), "expired request ids are gone from the store");

        // A snapshot carries the history to another store.
        let mut builder = store.clone();
        let snapshot = builder.build_snapshot().await.expect("build");
        let other_dir = tempfile::tempdir().expect("tempdir");
        let mut other = StateMachineStore::open(other_dir.path()).expect("open");
        other.install_snapshot(&snapshot.meta, snapshot.snapshot).await.expect("install");
        assert_eq!(other.archived_job(50).map(|j| j.id), Some(50));
        assert_eq!(other.archived_jobs_from(0).count(), 50);
        assert_eq!(other.digest(), store.digest());
        drop(other);
        let reopened = StateMachineStore::open(other_dir.path()).expect("reopen");
        assert_eq!(reopened.archived_jobs_from(0).count(), 50, "the history survives a reopen");

        // Retention: jobs submitted before the cutoff (all of them, at 2 ns) are deleted.
        {
            let mut data = store.shared.data.write().unwrap();
            let cutoffs = CompactCutoffs {
                archive_before: Timestamp::compose(200, 0),
                request_ids_before: Timestamp::compose(200, 0),
                jobs_before: Some(Timestamp(3)),
                segments_before: Some(Timestamp(3)),
            };
            let request = Request { ts: Timestamp::compose(300, 0), command: Command::Compact(cutoffs) };
            let (response, touched) = data.state.apply_tracked(&request);
            response.expect("compact");
            persist(&store.shared.trees, &data, &touched).expect("persist");
        }
        assert_eq!(store.archived_jobs_from(0).count(), 0, "every archived job was submitted before the cutoff");
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
        };
        let spec = JobSpec { tenant: "default".into(), command: vec!["true".into()], gpus: 1, ..Default::default() };
        let setup = [
            Command::Configure(ClusterConfig::dev_defaults()),
            Command::RegisterNode { spec: node },
            Command::SubmitJob { request_id: "r".into(), spec },
            Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: vec![0] },
        ];
        for (i, command) in setup.into_iter().enumerate() {
            let (response, touched) = data.state.apply_tracked(&Request { ts: at(100 + i as u64), command });
            response.expect("setup");
            persist(&store.shared.trees, &data, &touched).expect("persist");
        }
        let epoch = data.state.jobs[&1].allocation.as_ref().expect("placed").epoch;
        let (response, touched) =
            data.state.apply_tracked(&Request { ts: at(200), command: Command::JobStarted { job_id: 1, epoch } });
        response.expect("started");
        persist(&store.shared.trees, &data, &touched).expect("persist");
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
        };
        let (response, compacted) =
            data.state.apply_tracked(&Request { ts: at(10_000), command: Command::Compact(cutoffs) });
        response.expect("compact");
        batch.merge(compacted);
        assert!(data.state.ledger.is_empty(), "the segment left the hot ledger in the batch that wrote it");
        persist(&store.shared.trees, &data, &batch).expect("persist");
        drop(data);
        let stored: Vec<(u64, u64)> = store.segments_from(0).map(|g| (g.job_id, g.epoch)).collect();
        assert_eq!(stored, vec![(1, epoch)], "the run is billed in the store");
        assert_eq!(store.archived_job(1).map(|j| j.state), Some(corral_types::JobState::Succeeded));
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
            store.install_snapshot(&meta(10), Box::new(Cursor::new(older_bytes.clone()))).await.expect("install older");
            let (mut builder, mut installer) = (store.clone(), store.clone());
            let newer_bytes = newer_bytes.clone();
            let build = tokio::spawn(async move { builder.build_snapshot().await.map(|_| ()) });
            let install =
                tokio::spawn(
                    async move { installer.install_snapshot(&meta(20), Box::new(Cursor::new(newer_bytes))).await },
                );
            let (built, installed) = (build.await.expect("build task"), install.await.expect("install task"));
            built.unwrap_or_else(|e| panic!("round {round}: build failed: {e}"));
            installed.unwrap_or_else(|e| panic!("round {round}: install failed: {e}"));
            let (meta, bytes) = read_snapshot_file(&dir.path().join("snapshots"))
                .unwrap_or_else(|e| panic!("round {round}: unreadable snapshot file: {e}"))
                .expect("a snapshot file");
            assert_eq!(meta.last_log_id.map(|l| l.index), Some(20), "round {round}: the snapshot went back");
            let state = codec::snapshot_from_bytes(&bytes)
                .unwrap_or_else(|e| panic!("round {round}: corrupt snapshot state: {e}"));
            assert_eq!(state.jobs.len(), 30_001, "round {round}");
            let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("snapshots"))
                .expect("dir")
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != SNAPSHOT_FILE)
                .collect();
            assert!(leftovers.is_empty(), "round {round}: temporary files left: {leftovers:?}");
        }
    }
}
