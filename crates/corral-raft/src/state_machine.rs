//! The replicated state machine: `corral_core::State` in memory, persisted in sled, with fsynced
//! snapshot files.
//!
//! Invariant: sled is written in one atomic batch (one tree, prefixed keys) per applied batch of
//! entries, including the last applied log id, so a reopened sled is a consistent prefix of the
//! log; whatever sled lost is re-applied from the log. A snapshot file newer than sled wins on open, because the log
//! before it may already be purged.

use crate::change_log::ChangeLog;
use crate::codec;
use crate::types::{LogId, NodeId, StoredMembership, TypeConfig};
use corral_core::{Outcome, State, Touched};
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
        let db = sled::Config::new().path(dir.join("sm")).open()?;
        let trees = Trees { tree: db.open_tree("state")?, db };
        let mut data = load_from_sled(&trees)?;
        if let Some((meta, bytes)) = read_snapshot_file(&snapshot_dir)? {
            if meta.last_log_id > data.last_applied {
                tracing::info!(snapshot = %meta.snapshot_id, "state machine store is older than the snapshot: loading the snapshot");
                data = StateMachineData {
                    state: codec::snapshot_from_bytes(&bytes)?,
                    last_applied: meta.last_log_id,
                    membership: meta.last_membership.clone(),
                };
                rewrite_sled(&trees, &data)?;
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

    /// FNV-1a of the encoded state: equal on every node that applied the same log prefix.
    pub fn digest(&self) -> u64 {
        let bytes = codec::snapshot_to_bytes(&self.read().state);
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
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
        let id: [u8; 8] = v.as_ref().try_into().map_err(|_| anyhow::anyhow!("corrupt request id entry"))?;
        request_ids.insert(String::from_utf8_lossy(k).into_owned(), u64::from_be_bytes(id));
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
    for kv in t.tree.scan_prefix(SEGMENT) {
        let (_, v) = kv?;
        let segment = codec::segment_from_bytes(&v)?;
        state.ledger.insert(segment.id, segment);
    }
    Ok(StateMachineData { state, last_applied, membership })
}

/// Replaces everything in sled with `data` and flushes.
fn rewrite_sled(t: &Trees, data: &StateMachineData) -> anyhow::Result<()> {
    t.tree.clear()?;
    let all = Touched {
        jobs: data.state.jobs.keys().copied().collect(),
        nodes: data.state.nodes.keys().cloned().collect(),
        segments: data.state.ledger.keys().copied().collect(),
        policy: true,
    };
    persist(t, data, &all)?;
    t.db.flush()?;
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
                if !job.request_id.is_empty() {
                    batch.insert(key(REQUEST, job.request_id.as_bytes()), &id.to_be_bytes());
                }
            }
            None => batch.remove(key(JOB, &id.to_be_bytes())),
        }
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
        f.write_all(state)?;
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
        let state = codec::snapshot_from_bytes(&bytes)
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
            *data =
                StateMachineData { state, last_applied: meta.last_log_id, membership: meta.last_membership.clone() };
            rewrite_sled(&self.shared.trees, &data).map_err(|e| io_err(std::io::Error::other(e.to_string())))?;
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
        let (bytes, last_applied, membership) = {
            let data = self.read();
            (codec::snapshot_to_bytes(&data.state), data.last_applied, data.membership.clone())
        };
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => "empty".to_string(),
        };
        let meta = SnapshotMeta { last_log_id: last_applied, last_membership: membership, snapshot_id };
        let shared = Arc::clone(&self.shared);
        let (meta, bytes, current) = tokio::task::spawn_blocking(move || {
            write_snapshot_file(&shared.snapshot_dir, &shared.snapshot_file, &meta, &bytes).map(|w| (meta, bytes, w))
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
