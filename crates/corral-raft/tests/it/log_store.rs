//! Tests of the raft-log backed openraft log store: openraft's conformance suite, reopen and
//! purge/truncate persistence, and a single-node Raft restart.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::io;
use std::io::Cursor;
use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use corral_raft::log_store::LogStore;
use corral_raft::log_store::PayloadCodec;
use openraft::error::InstallSnapshotError;
use openraft::error::RPCError;
use openraft::error::RaftError;
use openraft::error::Unreachable;
use openraft::network::RPCOption;
use openraft::network::RaftNetwork;
use openraft::network::RaftNetworkFactory;
use openraft::raft::AppendEntriesRequest;
use openraft::raft::AppendEntriesResponse;
use openraft::raft::InstallSnapshotRequest;
use openraft::raft::InstallSnapshotResponse;
use openraft::raft::VoteRequest;
use openraft::raft::VoteResponse;
use openraft::storage::LogState;
use openraft::storage::RaftLogStorage;
use openraft::storage::RaftStateMachine;
use openraft::testing::StoreBuilder;
use openraft::testing::Suite;
use openraft::BasicNode;
use openraft::CommittedLeaderId;
use openraft::Entry;
use openraft::EntryPayload;
use openraft::LogId;
use openraft::Membership;
use openraft::OptionalSend;
use openraft::Raft;
use openraft::RaftLogReader;
use openraft::RaftSnapshotBuilder;
use openraft::ServerState;
use openraft::Snapshot;
use openraft::SnapshotMeta;
use openraft::StorageError;
use openraft::StorageIOError;
use openraft::StoredMembership;
use openraft::Vote;
use prost::bytes::Bytes;
use serde::Deserialize;
use serde::Serialize;
use tempfile::TempDir;

/// Tiny application payload for the tests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Req(pub String);

impl PayloadCodec for Req {
    fn encode_payload(&self) -> Bytes {
        Bytes::from(self.0.clone().into_bytes())
    }

    fn decode_payload(bytes: Bytes) -> Result<Self, io::Error> {
        String::from_utf8(bytes.to_vec()).map(Req).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Application response: the number of values after applying.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resp(pub usize);

openraft::declare_raft_types!(
    pub TestConfig:
        D = Req,
        R = Resp,
);

type Store = LogStore<TestConfig>;

// ---------------------------------------------------------------------------------------------
// In-memory state machine (the conformance suite needs one).
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct SmData {
    last_applied: Option<LogId<u64>>,
    last_membership: StoredMembership<u64, BasicNode>,
    values: Vec<String>,
}

#[derive(Debug)]
struct StoredSnapshot {
    meta: SnapshotMeta<u64, BasicNode>,
    data: Vec<u8>,
}

#[derive(Debug, Default)]
struct SmInner {
    data: SmData,
    snapshot: Option<StoredSnapshot>,
    snapshot_seq: u64,
}

/// In-memory state machine; the mutex is never held across an await.
#[derive(Debug, Clone, Default)]
struct MemStateMachine {
    inner: Arc<Mutex<SmInner>>,
}

impl MemStateMachine {
    fn values(&self) -> Vec<String> {
        self.inner.lock().unwrap().data.values.clone()
    }
}

impl RaftSnapshotBuilder<TestConfig> for MemStateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TestConfig>, StorageError<u64>> {
        let mut inner = self.inner.lock().unwrap();
        let data = serde_json::to_vec(&inner.data).map_err(|e| StorageIOError::read_state_machine(&e))?;
        inner.snapshot_seq += 1;
        let snapshot_id = match &inner.data.last_applied {
            Some(id) => format!("{}-{}-{}", id.leader_id, id.index, inner.snapshot_seq),
            None => format!("--{}", inner.snapshot_seq),
        };
        let meta = SnapshotMeta {
            last_log_id: inner.data.last_applied,
            last_membership: inner.data.last_membership.clone(),
            snapshot_id,
        };
        inner.snapshot = Some(StoredSnapshot { meta: meta.clone(), data: data.clone() });
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

impl RaftStateMachine<TestConfig> for MemStateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<u64>>, StoredMembership<u64, BasicNode>), StorageError<u64>> {
        let inner = self.inner.lock().unwrap();
        Ok((inner.data.last_applied, inner.data.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Resp>, StorageError<u64>>
    where
        I: IntoIterator<Item = Entry<TestConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut inner = self.inner.lock().unwrap();
        let mut responses = Vec::new();
        for entry in entries {
            inner.data.last_applied = Some(entry.log_id);
            match entry.payload {
                EntryPayload::Blank => {}
                EntryPayload::Normal(req) => inner.data.values.push(req.0),
                EntryPayload::Membership(m) => {
                    inner.data.last_membership = StoredMembership::new(Some(entry.log_id), m);
                }
            }
            responses.push(Resp(inner.data.values.len()));
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError<u64>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<u64>> {
        let bytes = snapshot.into_inner();
        let data: SmData =
            serde_json::from_slice(&bytes).map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        let mut inner = self.inner.lock().unwrap();
        inner.data = data;
        inner.snapshot = Some(StoredSnapshot { meta: meta.clone(), data: bytes });
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TestConfig>>, StorageError<u64>> {
        let inner = self.inner.lock().unwrap();
        Ok(inner
            .snapshot
            .as_ref()
            .map(|s| Snapshot { meta: s.meta.clone(), snapshot: Box::new(Cursor::new(s.data.clone())) }))
    }
}

// ---------------------------------------------------------------------------------------------
// openraft conformance suite
// ---------------------------------------------------------------------------------------------

struct Builder;

impl StoreBuilder<TestConfig, Store, MemStateMachine, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, Store, MemStateMachine), StorageError<u64>> {
        let dir = tempfile::tempdir().map_err(|e| StorageIOError::write(&e))?;
        let store = Store::open(dir.path()).map_err(|e| StorageIOError::write(&e))?;
        Ok((dir, store, MemStateMachine::default()))
    }
}

/// openraft's own storage conformance suite against `LogStore` (plus the in-memory SM).
#[test]
fn openraft_conformance_suite() -> TestResult {
    Suite::test_all(Builder)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn lid(term: u64, node: u64, index: u64) -> LogId<u64> {
    LogId::new(CommittedLeaderId::new(term, node), index)
}

fn blank(term: u64, node: u64, index: u64) -> Entry<TestConfig> {
    Entry { log_id: lid(term, node, index), payload: EntryPayload::Blank }
}

fn normal(term: u64, node: u64, index: u64, s: &str) -> Entry<TestConfig> {
    Entry { log_id: lid(term, node, index), payload: EntryPayload::Normal(Req(s.to_string())) }
}

fn membership(term: u64, node: u64, index: u64, voters: &[u64]) -> Entry<TestConfig> {
    let voters: BTreeSet<u64> = voters.iter().copied().collect();
    Entry { log_id: lid(term, node, index), payload: EntryPayload::Membership(Membership::new(vec![voters], ())) }
}

fn small_chunks(dir: &Path) -> raft_log::Config {
    let mut config = raft_log::Config::new(dir.to_str().unwrap());
    config.wal.chunk_max_records = Some(4);
    // Keep almost nothing cached, so reads after reopen go to the chunk files.
    config.log_cache_max_items = Some(1);
    config
}

fn wal_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".wal"))
        .count()
}

type TestResult = Result<(), Box<dyn std::error::Error>>;

// ---------------------------------------------------------------------------------------------
// Reopen / purge / truncate persistence
// ---------------------------------------------------------------------------------------------

/// Replication reads a bounded number of bytes per request (`limited_get_log_entries`): entries
/// of a megabyte each come a few at a time, small entries all at once, and never none.
#[tokio::test(flavor = "multi_thread")]
async fn replication_reads_about_four_megabytes_of_entries_at_a_time() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut store = Store::open(dir.path())?;
    let big = "x".repeat(1 << 20);
    let entries: Vec<_> = (1..=20).map(|i| normal(1, 1, i, &big)).collect();
    store.append_and_wait(entries.clone()).await?;
    let mut reader = store.get_log_reader().await;
    let first = reader.limited_get_log_entries(1, 21).await?;
    assert_eq!(first, entries[..4].to_vec(), "four entries of 1 MiB make the 4 MiB budget");
    let next = reader.limited_get_log_entries(5, 21).await?;
    assert_eq!(next, entries[4..8].to_vec());
    assert_eq!(reader.limited_get_log_entries(20, 21).await?, entries[19..].to_vec(), "the last one alone");

    let small: Vec<_> = (21..=120).map(|i| normal(1, 1, i, "small")).collect();
    store.append_and_wait(small.clone()).await?;
    assert_eq!(reader.limited_get_log_entries(21, 121).await?, small, "small entries come all at once");
    assert!(reader.limited_get_log_entries(121, 121).await?.is_empty());
    Ok(())
}

/// Vote, entries of every payload kind and the committed log id survive a reopen.
#[tokio::test(flavor = "multi_thread")]
async fn reopen_keeps_vote_entries_and_committed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let entries = vec![
        membership(1, 1, 0, &[1, 2, 3]),
        blank(1, 1, 1),
        normal(1, 1, 2, "a"),
        normal(2, 2, 3, "b"),
        normal(2, 2, 4, "c"),
    ];

    {
        let mut store = Store::open(dir.path())?;
        assert_eq!(None, store.read_vote().await?);
        store.save_vote(&Vote::new(2, 2)).await?;
        store.save_vote(&Vote::new_committed(2, 2)).await?;
        store.append_and_wait(entries.clone()).await?;
        store.save_committed(Some(lid(2, 2, 3))).await?;
    }

    {
        let mut store = Store::open(dir.path())?;
        assert_eq!(Some(Vote::new_committed(2, 2)), store.read_vote().await?);
        assert_eq!(Some(lid(2, 2, 3)), store.read_committed().await?);
        assert_eq!(
            LogState { last_purged_log_id: None, last_log_id: Some(lid(2, 2, 4)) },
            store.get_log_state().await?
        );
        assert_eq!(entries, store.try_get_log_entries(..).await?);
        assert_eq!(entries[2..4].to_vec(), store.try_get_log_entries(2..4).await?);
        assert_eq!(entries[1..=2].to_vec(), store.get_log_reader().await.try_get_log_entries(1..=2).await?);
        assert!(store.try_get_log_entries(5..).await?.is_empty());

        // Keep writing after the reopen.
        store.append_and_wait([normal(3, 1, 5, "d")]).await?;
        store.save_vote(&Vote::new(3, 1)).await?;
    }

    {
        let mut store = Store::open(dir.path())?;
        assert_eq!(Some(Vote::new(3, 1)), store.read_vote().await?);
        let got = store.try_get_log_entries(..).await?;
        assert_eq!(6, got.len());
        assert_eq!(normal(3, 1, 5, "d"), got[5]);
    }
    Ok(())
}

/// The directory is locked while a store is open.
#[tokio::test(flavor = "multi_thread")]
async fn second_open_of_same_dir_fails() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Store::open(dir.path())?;
    assert!(Store::open(dir.path()).is_err());
    drop(store);
    Store::open(dir.path())?;
    Ok(())
}

/// Purge, reopen: purged id, last id and remaining entries are intact; obsolete chunk files are
/// deleted; entries are read back from disk with a tiny cache.
#[tokio::test(flavor = "multi_thread")]
async fn purge_then_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    let entries: Vec<_> = (0..20).map(|i| normal(1, 1, i, &format!("v{i}"))).collect();

    let files_before_purge;
    {
        let mut store = Store::open_with_config(small_chunks(dir.path()))?;
        store.save_vote(&Vote::new_committed(1, 1)).await?;
        store.append_and_wait(entries.clone()).await?;
        store.save_committed(Some(lid(1, 1, 15))).await?;
        files_before_purge = wal_files(dir.path());

        store.purge(lid(1, 1, 9)).await?;
        assert_eq!(
            LogState { last_purged_log_id: Some(lid(1, 1, 9)), last_log_id: Some(lid(1, 1, 19)) },
            store.get_log_state().await?
        );
        assert_eq!(entries[10..].to_vec(), store.try_get_log_entries(0..100).await?);
    }
    let files_after_purge = wal_files(dir.path());
    assert!(
        files_after_purge < files_before_purge,
        "purged chunk files are removed: before {files_before_purge}, after {files_after_purge}"
    );

    {
        let mut store = Store::open_with_config(small_chunks(dir.path()))?;
        assert_eq!(
            LogState { last_purged_log_id: Some(lid(1, 1, 9)), last_log_id: Some(lid(1, 1, 19)) },
            store.get_log_state().await?
        );
        assert_eq!(Some(Vote::new_committed(1, 1)), store.read_vote().await?);
        assert_eq!(Some(lid(1, 1, 15)), store.read_committed().await?);
        assert!(store.try_get_log_entries(0..10).await?.is_empty());
        assert_eq!(entries[10..].to_vec(), store.try_get_log_entries(..).await?);

        // Purge beyond the last entry (as after installing a snapshot).
        store.purge(lid(2, 3, 30)).await?;
        assert_eq!(
            LogState { last_purged_log_id: Some(lid(2, 3, 30)), last_log_id: Some(lid(2, 3, 30)) },
            store.get_log_state().await?
        );
    }

    {
        let mut store = Store::open_with_config(small_chunks(dir.path()))?;
        assert_eq!(
            LogState { last_purged_log_id: Some(lid(2, 3, 30)), last_log_id: Some(lid(2, 3, 30)) },
            store.get_log_state().await?
        );
        assert!(store.try_get_log_entries(..).await?.is_empty());

        // The log continues right after the purged id.
        store.append_and_wait([blank(3, 1, 31), normal(3, 1, 32, "x")]).await?;
        assert_eq!(vec![blank(3, 1, 31), normal(3, 1, 32, "x")], store.try_get_log_entries(..).await?);
    }

    {
        let mut store = Store::open_with_config(small_chunks(dir.path()))?;
        assert_eq!(
            LogState { last_purged_log_id: Some(lid(2, 3, 30)), last_log_id: Some(lid(3, 1, 32)) },
            store.get_log_state().await?
        );
        assert_eq!(vec![blank(3, 1, 31), normal(3, 1, 32, "x")], store.try_get_log_entries(..).await?);
    }
    Ok(())
}

/// Truncate (conflict deletion), reopen: the removed suffix stays removed, new entries follow.
#[tokio::test(flavor = "multi_thread")]
async fn truncate_then_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    let entries: Vec<_> = (0..10).map(|i| normal(1, 1, i, &format!("v{i}"))).collect();

    {
        let mut store = Store::open(dir.path())?;
        store.append_and_wait(entries.clone()).await?;
        // openraft truncate(log_id) removes log_id.index and everything after it.
        store.truncate(lid(1, 1, 6)).await?;
        assert_eq!(Some(lid(1, 1, 5)), store.get_log_state().await?.last_log_id);
        // Truncating past the end is a no-op.
        store.truncate(lid(1, 1, 42)).await?;
        store.append_and_wait([normal(2, 2, 6, "new6"), normal(2, 2, 7, "new7")]).await?;
    }

    {
        let mut store = Store::open(dir.path())?;
        let mut want = entries[..6].to_vec();
        want.push(normal(2, 2, 6, "new6"));
        want.push(normal(2, 2, 7, "new7"));
        assert_eq!(want, store.try_get_log_entries(..).await?);
        assert_eq!(
            LogState { last_purged_log_id: None, last_log_id: Some(lid(2, 2, 7)) },
            store.get_log_state().await?
        );

        // Truncate everything after the purged id.
        store.purge(lid(1, 1, 3)).await?;
        store.truncate(lid(1, 1, 4)).await?;
        assert_eq!(
            LogState { last_purged_log_id: Some(lid(1, 1, 3)), last_log_id: Some(lid(1, 1, 3)) },
            store.get_log_state().await?
        );
    }

    {
        let mut store = Store::open(dir.path())?;
        assert_eq!(
            LogState { last_purged_log_id: Some(lid(1, 1, 3)), last_log_id: Some(lid(1, 1, 3)) },
            store.get_log_state().await?
        );
        assert!(store.try_get_log_entries(..).await?.is_empty());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Single-node Raft on top of the store: openraft's own append path (LogFlushed callback),
// save_committed, and re-apply on restart.
// ---------------------------------------------------------------------------------------------

struct NoNetwork;

fn unreachable<E: std::error::Error>() -> RPCError<u64, BasicNode, E> {
    RPCError::Unreachable(Unreachable::new(&io::Error::other("single-node test has no network")))
}

impl RaftNetwork<TestConfig> for NoNetwork {
    async fn append_entries(
        &mut self,
        _rpc: AppendEntriesRequest<TestConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        Err(unreachable())
    }

    async fn install_snapshot(
        &mut self,
        _rpc: InstallSnapshotRequest<TestConfig>,
        _option: RPCOption,
    ) -> Result<InstallSnapshotResponse<u64>, RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>> {
        Err(unreachable())
    }

    async fn vote(
        &mut self,
        _rpc: VoteRequest<u64>,
        _option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        Err(unreachable())
    }
}

impl RaftNetworkFactory<TestConfig> for NoNetwork {
    type Network = NoNetwork;

    async fn new_client(&mut self, _target: u64, _node: &BasicNode) -> Self::Network {
        NoNetwork
    }
}

fn raft_config() -> Arc<openraft::Config> {
    let config = openraft::Config {
        heartbeat_interval: 50,
        election_timeout_min: 150,
        election_timeout_max: 300,
        ..Default::default()
    };
    Arc::new(config.validate().expect("valid raft config"))
}

async fn start_node(dir: &Path, sm: MemStateMachine) -> Result<Raft<TestConfig>, Box<dyn std::error::Error>> {
    let store = Store::open(dir)?;
    let raft = Raft::new(1, raft_config(), NoNetwork, store, sm).await?;
    Ok(raft)
}

#[tokio::test(flavor = "multi_thread")]
async fn single_node_raft_restart() -> TestResult {
    let dir = tempfile::tempdir()?;
    let timeout = Some(Duration::from_secs(10));

    let last_index = {
        let sm = MemStateMachine::default();
        let raft = start_node(dir.path(), sm.clone()).await?;
        raft.initialize(BTreeMap::from([(1u64, BasicNode::default())])).await?;
        raft.wait(timeout).state(ServerState::Leader, "leader").await?;

        for v in ["a", "b", "c"] {
            raft.client_write(Req(v.to_string())).await?;
        }
        assert_eq!(vec!["a", "b", "c"], sm.values());

        let last_index = raft.metrics().borrow().last_log_index.expect("has logs");
        raft.shutdown().await?;
        last_index
    };

    // Everything the node wrote is in the log store.
    {
        let mut store = Store::open(dir.path())?;
        let vote = store.read_vote().await?.expect("vote saved");
        assert!(vote.is_committed());
        assert_eq!(1, vote.leader_id.node_id);

        let st = store.get_log_state().await?;
        assert_eq!(Some(last_index), st.last_log_id.map(|id| id.index));
        assert_eq!(Some(last_index), store.read_committed().await?.map(|id| id.index));

        let entries = store.try_get_log_entries(..).await?;
        assert!(matches!(entries[0].payload, EntryPayload::Membership(_)));
        let values: Vec<String> = entries
            .iter()
            .filter_map(|e| match &e.payload {
                EntryPayload::Normal(req) => Some(req.0.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(vec!["a", "b", "c"], values);
    }

    // Restart with an empty state machine: committed entries are re-applied from the log.
    {
        let sm = MemStateMachine::default();
        let raft = start_node(dir.path(), sm.clone()).await?;
        raft.wait(timeout).applied_index_at_least(Some(last_index), "re-applied").await?;
        assert_eq!(vec!["a", "b", "c"], sm.values());

        raft.wait(timeout).state(ServerState::Leader, "leader again").await?;
        raft.client_write(Req("d".to_string())).await?;
        assert_eq!(vec!["a", "b", "c", "d"], sm.values());
        raft.shutdown().await?;
    }
    Ok(())
}
