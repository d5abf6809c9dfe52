//! A coordinator's Raft node, the one door to openraft: opening storage under a data dir,
//! proposing commands, linearizable reads, membership changes, status and shutdown. Callers see
//! corral's own types ([`RaftStatus`], [`RaftError`]); openraft's stay inside this crate.

use crate::election::{ElectionClock, Elections};
use crate::log_store::LogStore;
use crate::network::{GrpcNetworkFactory, RaftGrpcService};
use crate::state_machine::StateMachineStore;
use crate::types::{NodeId, Raft, RaftRequest, TypeConfig};
use corral_proto::raft::raft_server::RaftServer;
use openraft::error::{ChangeMembershipError, CheckIsLeaderError, ClientWriteError, InitializeError};
use openraft::{BasicNode, ChangeMembers, RaftMetrics, ServerState, SnapshotPolicy};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How to open a Raft node.
#[derive(Debug, Clone)]
pub struct RaftNodeConfig {
    pub node_id: NodeId,
    /// Holds `raft-log/` (log + vote), `history.redb` and `snapshots/`.
    pub data_dir: PathBuf,
    pub heartbeat_interval_ms: u64,
    /// A voter that heard from no leader for a random time between these two asks for
    /// pre-votes, and campaigns if a majority grants them (`election.rs`). A voter that heard
    /// from a leader within the minimum refuses pre-votes and votes.
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot every this many applied entries (each node at its own phase: see
    /// [`snapshot_due`]).
    pub snapshot_every: u64,
    /// Keep this many entries in the log below the snapshot for lagging followers.
    pub keep_logs_after_snapshot: u64,
    /// Job changes remembered for `WatchJobs` clients that resume from a revision.
    pub watch_history: usize,
    /// TLS towards peers (our coordinator certificate, the cluster CA); `None`: plaintext.
    pub client_tls: Option<corral_security::ClientTls>,
}

impl RaftNodeConfig {
    pub fn new(node_id: NodeId, data_dir: PathBuf) -> Self {
        RaftNodeConfig {
            node_id,
            data_dir,
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 250,
            election_timeout_max_ms: 500,
            snapshot_every: 20_000,
            keep_logs_after_snapshot: 1_000,
            watch_history: crate::DEFAULT_CHANGE_LOG_CAPACITY,
            client_tls: None,
        }
    }
}

/// What a node is in the cluster right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower,
    Candidate,
    Learner,
    Shutdown,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Leader => "leader",
            Role::Follower => "follower",
            Role::Candidate => "candidate",
            Role::Learner => "learner",
            Role::Shutdown => "shutdown",
        }
    }
}

/// A coordinator in the cluster's membership.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: NodeId,
    pub addr: String,
    /// A voter, or a learner that only receives the log.
    pub voter: bool,
}

/// This node's view of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaftStatus {
    pub id: NodeId,
    pub role: Role,
    pub term: u64,
    pub leader: Option<NodeId>,
    pub leader_addr: Option<String>,
    pub last_log_index: Option<u64>,
    pub applied_index: Option<u64>,
    pub snapshot_index: Option<u64>,
    pub purged_index: Option<u64>,
    pub members: Vec<Member>,
    /// A membership was ever committed (the cluster was bootstrapped or this node joined).
    pub initialized: bool,
}

/// The cheap part of the status that leadership checks need on every write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leadership {
    pub term: u64,
    pub leader: Option<NodeId>,
    /// Since a quorum last acknowledged this node as leader (leaders only).
    pub millis_since_quorum_ack: Option<u64>,
    pub voters: usize,
}

/// A leader's view of whether it can serve: the term and index it applied, its log, when a
/// quorum last acknowledged it, and how far each member's log matches its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderHealth {
    pub term: u64,
    /// (term, index) of the last applied entry.
    pub applied: Option<(u64, u64)>,
    pub last_log_index: Option<u64>,
    pub millis_since_quorum_ack: Option<u64>,
    pub voters: usize,
    pub matched: Vec<(NodeId, Option<u64>)>,
}

/// Why a Raft call failed.
#[derive(Debug, thiserror::Error)]
pub enum RaftError {
    /// This node does not lead; the leader when one is known.
    #[error("this coordinator is not the leader (leader: {})", leader_addr.as_deref().unwrap_or("unknown"))]
    NotLeader { leader_id: Option<NodeId>, leader_addr: Option<String> },
    /// A membership change that the current membership does not allow.
    #[error("{0}")]
    Refused(String),
    /// Anything else: shut down, storage failure, no quorum in time.
    #[error("{0}")]
    Failed(String),
}

impl RaftError {
    fn forward(leader_id: Option<NodeId>, leader_node: Option<BasicNode>) -> RaftError {
        RaftError::NotLeader { leader_id, leader_addr: leader_node.map(|n| n.addr) }
    }
}

fn write_error(e: openraft::error::RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>) -> RaftError {
    match e {
        openraft::error::RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            RaftError::forward(f.leader_id, f.leader_node)
        }
        openraft::error::RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => refused(c),
        other => RaftError::Failed(other.to_string()),
    }
}

fn refused(e: ChangeMembershipError<NodeId>) -> RaftError {
    RaftError::Refused(e.to_string())
}

/// A running Raft node and its state machine.
#[derive(Clone)]
pub struct RaftNode {
    pub id: NodeId,
    raft: Raft,
    pub state: StateMachineStore,
    log: LogStore<TypeConfig>,
    /// Each follower's replicated index and when it last moved (flow control).
    progress: Arc<std::sync::Mutex<BTreeMap<NodeId, (u64, Instant)>>>,
    /// When this node last heard from a leader (the election timer and pre-votes).
    clock: Arc<ElectionClock>,
    min_election_timeout: Duration,
}

impl RaftNode {
    /// Opens storage and starts the Raft core. Does not initialize a cluster.
    pub async fn open(config: &RaftNodeConfig) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&config.data_dir)?;
        // corral's election timer campaigns, after a pre-vote (`election.rs`); openraft's is off.
        // Its timeouts still set two things: its leader lease, `election_timeout_max` (a voter
        // that heard from its leader within it refuses to vote), which is the minimum election
        // timeout, so that a pre-vote granted is a vote granted (and a leader that a quorum
        // acknowledged within it is still the only one); and how long a vote request waits,
        // `election_timeout_min`, just below it.
        let lease = config.election_timeout_min_ms.max(config.heartbeat_interval_ms + 2);
        let raft_config = openraft::Config {
            cluster_name: "corral".to_string(),
            heartbeat_interval: config.heartbeat_interval_ms,
            election_timeout_min: lease - 1,
            election_timeout_max: lease,
            enable_elect: false,
            // Built when `schedule_snapshots` asks, so that the nodes take turns.
            snapshot_policy: SnapshotPolicy::Never,
            max_in_snapshot_log_to_keep: config.keep_logs_after_snapshot,
            snapshot_max_chunk_size: 4 << 20,
            // The last chunk's reply waits for the follower to install the snapshot, history
            // included (the default, 200 ms, would time out and send it again from the start).
            install_snapshot_timeout: 60_000,
            ..Default::default()
        }
        .validate()?;
        let log_dir = config.data_dir.join("raft-log");
        std::fs::create_dir_all(&log_dir)?;
        let mut log_config = raft_log::Config::new(log_dir.display());
        // Small chunks: purged log space is reclaimed per closed chunk, a restart holds one
        // chunk's records at a time while it replays them, and the entries of the chunk being
        // written (which the cache below cannot evict) stay few.
        log_config.wal.chunk_max_size = Some(16 << 20);
        // Recent entries stay in memory for followers that lag a little; one that lags far reads
        // from disk or gets a snapshot. Bounded so a coordinator's memory stays flat.
        log_config.log_cache_capacity = Some(64 << 20);
        // openraft 0.9 keeps one log write in flight: waiting for more writes to batch into one
        // fsync only adds latency. Batching happens above, in the coordinator's group commit.
        log_config.wal.flush_batch_wait = Some(Duration::ZERO);
        let log_store =
            wait_for_lock(&log_dir, LOCK_PATIENCE, || LogStore::<TypeConfig>::open_with_config(log_config.clone()))
                .await?;
        let state = wait_for_lock(&config.data_dir.join("history.redb"), LOCK_PATIENCE, || {
            StateMachineStore::open(&config.data_dir)
        })
        .await?;
        state.changes().set_capacity(config.watch_history);
        let network = GrpcNetworkFactory { tls: config.client_tls.clone() };
        let raft =
            Raft::new(config.node_id, Arc::new(raft_config), network.clone(), log_store.clone(), state.clone()).await?;
        tokio::spawn(schedule_snapshots(raft.clone(), config.node_id, config.snapshot_every));
        let clock = Arc::new(ElectionClock::new());
        let min_election_timeout = Duration::from_millis(config.election_timeout_min_ms);
        let elections = Elections {
            id: config.node_id,
            raft: raft.clone(),
            log: log_store.clone(),
            clock: clock.clone(),
            network,
            min_timeout: min_election_timeout,
            max_timeout: Duration::from_millis(config.election_timeout_max_ms),
        };
        tokio::spawn(elections.run());
        Ok(RaftNode {
            id: config.node_id,
            raft,
            state,
            log: log_store,
            progress: Arc::default(),
            clock,
            min_election_timeout,
        })
    }

    /// Flow control for client writes on a leader: waits, at most `patience`, while a follower
    /// that is replicating lags this node's log by more than `max_lag` entries.
    ///
    /// A 3-node cluster commits with the leader and the faster follower; the slower one can fall
    /// behind without bound under a write load the machines cannot all keep up with. When the
    /// leader then dies, the new leader can commit nothing until that follower has caught up:
    /// every write waits for seconds. Holding new writes back while a live follower lags keeps
    /// that catch-up short. A follower whose index has not moved for a second is down or stuck,
    /// not slow: it is not waited for (the cluster runs on without it); nor is one that has not
    /// answered this leader at all, such as the leader it replaced: a new leader's first write
    /// would wait out `patience` for a dead node.
    pub async fn wait_for_followers(&self, max_lag: u64, patience: Duration) {
        let deadline = Instant::now() + patience;
        let mut metrics = self.raft.metrics();
        loop {
            let lagging = {
                let m = metrics.borrow_and_update();
                let Some(replication) = m.replication.as_ref() else { return };
                // A follower that has not acknowledged anything to this leader yet (the leader
                // a failover replaced, still in the membership) is not known to replicate.
                let followers = replication
                    .iter()
                    .filter(|(id, _)| **id != self.id)
                    .filter_map(|(id, matched)| matched.as_ref().map(|l| (*id, l.index)));
                let mut progress = self.progress.lock().unwrap_or_else(|p| p.into_inner());
                live_follower_lags(&mut progress, followers, m.last_log_index.unwrap_or(0), max_lag, Instant::now())
            };
            if !lagging {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, metrics.changed()).await.is_err() {
                return;
            }
        }
    }

    /// Highest log index this node knows to be committed (persisted lazily: may lag).
    pub async fn committed_index(&self) -> Option<u64> {
        use openraft::storage::RaftLogStorage;
        let mut log = self.log.clone();
        log.read_committed().await.ok().flatten().map(|l| l.index)
    }

    /// Makes this node the single voter of a new cluster, reachable at `addr`. Succeeds if the
    /// cluster was already initialized.
    pub async fn initialize(&self, addr: &str) -> Result<(), RaftError> {
        let members = BTreeMap::from([(self.id, BasicNode { addr: addr.to_string() })]);
        match self.raft.initialize(members).await {
            Ok(()) | Err(openraft::error::RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
            Err(e) => Err(RaftError::Failed(e.to_string())),
        }
    }

    /// Replicates `request` and applies it; returns the state machine's answer and the log
    /// index it was applied at.
    pub async fn propose(&self, request: corral_core::Request) -> Result<(corral_core::Response, u64), RaftError> {
        let reply = self.raft.client_write(RaftRequest::new(request)).await.map_err(write_error)?;
        Ok((reply.data, reply.log_id.index))
    }

    /// Waits until this node may serve a linearizable read: it leads, a quorum confirmed it,
    /// and everything committed before the call is applied.
    pub async fn ensure_linearizable(&self) -> Result<(), RaftError> {
        match self.raft.ensure_linearizable().await {
            Ok(_) => Ok(()),
            Err(openraft::error::RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f))) => {
                Err(RaftError::forward(f.leader_id, f.leader_node))
            }
            Err(e) => Err(RaftError::Failed(e.to_string())),
        }
    }

    /// Adds a learner and waits until it has caught up with the log.
    pub async fn add_learner(&self, id: NodeId, addr: &str) -> Result<(), RaftError> {
        self.raft.add_learner(id, BasicNode { addr: addr.to_string() }, true).await.map_err(write_error)?;
        Ok(())
    }

    /// Makes a learner a voter.
    pub async fn promote(&self, id: NodeId) -> Result<(), RaftError> {
        self.raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
            .await
            .map_err(write_error)?;
        Ok(())
    }

    /// Takes a voter's vote away, or removes a learner from the membership.
    pub async fn remove(&self, id: NodeId) -> Result<(), RaftError> {
        let voter = self.raft.metrics().borrow().membership_config.membership().voter_ids().any(|v| v == id);
        let change = if voter {
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        self.raft.change_membership(change, false).await.map_err(write_error)?;
        Ok(())
    }

    /// This node's view of the cluster.
    pub fn status(&self) -> RaftStatus {
        status_of(self.id, &self.raft.metrics().borrow())
    }

    /// Term, leader and lease of this node, without copying the membership.
    pub fn leadership(&self) -> Leadership {
        let metrics = self.raft.metrics();
        let m = metrics.borrow();
        Leadership {
            term: m.current_term,
            leader: m.current_leader,
            millis_since_quorum_ack: m.millis_since_quorum_ack,
            voters: m.membership_config.membership().voter_ids().count(),
        }
    }

    /// What a leader needs to serve, from Raft's metrics alone (no lock of the state): `None`
    /// unless this node leads.
    pub fn leader_health(&self) -> Option<LeaderHealth> {
        let metrics = self.raft.metrics();
        let m = metrics.borrow();
        if m.current_leader != Some(self.id) {
            return None;
        }
        Some(LeaderHealth {
            term: m.current_term,
            applied: m.last_applied.map(|l| (l.leader_id.term, l.index)),
            last_log_index: m.last_log_index,
            millis_since_quorum_ack: m.millis_since_quorum_ack,
            voters: m.membership_config.membership().voter_ids().count(),
            matched: m
                .replication
                .as_ref()
                .map(|r| r.iter().map(|(id, log)| (*id, log.map(|l| l.index))).collect())
                .unwrap_or_default(),
        })
    }

    /// Waits, at most `timeout`, until `ready` holds for this node's status.
    pub async fn wait_for(&self, timeout: Duration, ready: impl Fn(&RaftStatus) -> bool) -> Result<(), RaftError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut metrics = self.raft.metrics();
        loop {
            let status = status_of(self.id, &metrics.borrow_and_update());
            if ready(&status) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, metrics.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(RaftError::Failed("the Raft node has stopped".to_string())),
                Err(_) => return Err(RaftError::Failed(format!("not ready after {timeout:?}: {status:?}"))),
            }
        }
    }

    /// Builds a snapshot of this node's state machine now and waits, at most `timeout`, until it
    /// covers every entry applied when it was asked for; returns the snapshot's index. The log
    /// before it may then be purged, and a restart applies only the entries after it again.
    pub async fn snapshot(&self, timeout: Duration) -> Result<u64, RaftError> {
        let deadline = Instant::now() + timeout;
        let applied = self.status().applied_index.unwrap_or(0);
        loop {
            let before = self.status().snapshot_index;
            if before.unwrap_or(0) >= applied {
                return Ok(before.unwrap_or(0));
            }
            // openraft ignores the trigger while a build runs: that build ends (the snapshot
            // index moves), and the next round asks again.
            self.raft.trigger().snapshot().await.map_err(|e| RaftError::Failed(e.to_string()))?;
            let left = deadline.saturating_duration_since(Instant::now());
            self.wait_for(left, |s| s.snapshot_index != before).await?;
        }
    }

    /// The gRPC service through which peers reach this node.
    pub fn grpc_service(&self) -> RaftServer<RaftGrpcService> {
        RaftGrpcService::new(self.raft.clone(), self.log.clone(), self.clock.clone(), self.min_election_timeout)
            .into_server()
    }

    /// Stops the Raft core (the storage closes when the last handle is dropped).
    pub async fn shutdown(&self) -> Result<(), RaftError> {
        self.raft.shutdown().await.map_err(|e| RaftError::Failed(e.to_string()))
    }
}

fn status_of(id: NodeId, m: &RaftMetrics<NodeId, BasicNode>) -> RaftStatus {
    let membership = m.membership_config.membership();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    let members = membership
        .nodes()
        .map(|(id, n)| Member { id: *id, addr: n.addr.clone(), voter: voters.contains(id) })
        .collect();
    let role = match m.state {
        ServerState::Leader => Role::Leader,
        ServerState::Follower => Role::Follower,
        ServerState::Candidate => Role::Candidate,
        ServerState::Learner => Role::Learner,
        ServerState::Shutdown => Role::Shutdown,
    };
    RaftStatus {
        id,
        role,
        term: m.current_term,
        leader: m.current_leader,
        leader_addr: m.current_leader.and_then(|l| membership.get_node(&l).map(|n| n.addr.clone())),
        last_log_index: m.last_log_index,
        applied_index: m.last_applied.map(|l| l.index),
        snapshot_index: m.snapshot.map(|l| l.index),
        purged_index: m.purged.map(|l| l.index),
        members,
        initialized: m.membership_config.log_id().is_some(),
    }
}

/// True if a follower lags `last` by more than `max_lag` entries while its index still moves;
/// `progress` remembers each follower's index and when it last changed.
fn live_follower_lags(
    progress: &mut BTreeMap<NodeId, (u64, Instant)>,
    followers: impl Iterator<Item = (NodeId, u64)>,
    last: u64,
    max_lag: u64,
    now: Instant,
) -> bool {
    let followers: BTreeMap<NodeId, u64> = followers.collect();
    progress.retain(|id, _| followers.contains_key(id));
    let mut lagging = false;
    for (id, matched) in followers {
        let seen = progress.entry(id).or_insert((matched, now));
        if seen.0 != matched {
            *seen = (matched, now);
        }
        let live = now.duration_since(seen.1) < FOLLOWER_STALL;
        lagging |= live && last.saturating_sub(matched) > max_lag;
    }
    lagging
}

/// Whether a node whose last snapshot is at `snapshot` builds one now that it applied up to
/// `applied`: when its applied index crossed a multiple of `every` shifted by the node's phase
/// (a third of `every` times `node_id % 3`) since that snapshot.
///
/// Every node of a 3-node cluster used to build at the same index (openraft's
/// `LogsSinceLast`): three encodes of the whole hot state at once, on machines that also serve
/// the leader's writes. With the phases, the builds of a 3-node cluster take turns, and a
/// follower's build leaves the other follower to make the quorum.
pub fn snapshot_due(node_id: NodeId, every: u64, applied: u64, snapshot: u64) -> bool {
    let every = every.max(1);
    let phase = (node_id % 3) * (every / 3);
    applied > snapshot && (applied + phase) / every > (snapshot + phase) / every
}

/// Asks openraft for a snapshot whenever [`snapshot_due`] says so, one at a time; ends when the
/// Raft core stops.
async fn schedule_snapshots(raft: Raft, node_id: NodeId, every: u64) {
    let mut metrics = raft.metrics();
    // The applied index a build was asked for at, until a snapshot covers it (or, should the
    // build have failed, `every` more entries were applied).
    let mut asked: Option<u64> = None;
    while metrics.changed().await.is_ok() {
        let (applied, snapshot) = {
            let m = metrics.borrow_and_update();
            (m.last_applied.map_or(0, |l| l.index), m.snapshot.map_or(0, |l| l.index))
        };
        if let Some(at) = asked {
            if snapshot < at && applied < at + every {
                continue;
            }
            asked = None;
        }
        if snapshot_due(node_id, every, applied, snapshot) {
            asked = Some(applied);
            if raft.trigger().snapshot().await.is_err() {
                return;
            }
        }
    }
}

/// A follower whose replicated index has not moved for this long is not waited for.
const FOLLOWER_STALL: Duration = Duration::from_secs(1);

/// How long `open` waits for a data directory another process holds locked.
const LOCK_PATIENCE: Duration = Duration::from_secs(10);

/// Runs `open` until the directory's lock is free, for at most `patience`. A process that was
/// just killed can hold its data dir locked for a moment after it is reaped: a child it was
/// forking still shares its open files until that child execs.
async fn wait_for_lock<T, E>(
    dir: &std::path::Path,
    patience: Duration,
    mut open: impl FnMut() -> Result<T, E>,
) -> anyhow::Result<T>
where
    E: Into<anyhow::Error>,
{
    let deadline = Instant::now() + patience;
    let mut told = false;
    loop {
        let err: anyhow::Error = match open() {
            Ok(opened) => return Ok(opened),
            Err(e) => e.into(),
        };
        if !is_lock_held(&err) {
            return Err(err);
        }
        if Instant::now() >= deadline {
            return Err(err.context(format!(
                "{} is locked by another process for more than {patience:?}: is another coordinator (or `corral dev`) running on this data dir?",
                dir.display()
            )));
        }
        if !told {
            told = true;
            tracing::warn!(dir = %dir.display(), "data dir locked by another process; waiting up to {patience:?} for it to exit");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// True if `err` says a file lock is held elsewhere (raft-log's WAL lock, the history's, or
/// that of the sled store an earlier version kept).
pub(crate) fn is_lock_held(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::WouldBlock)
            || matches!(cause.downcast_ref::<redb::DatabaseError>(), Some(redb::DatabaseError::DatabaseAlreadyOpen))
            || cause.to_string().contains("already locked")
            || cause.to_string().contains("could not acquire lock")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each node of a 3-node cluster builds once every `every` entries, at its own third.
    #[test]
    fn the_nodes_of_a_cluster_build_their_snapshots_in_turn() {
        let builds = |node_id: NodeId| {
            let (mut snapshot, mut at) = (0, Vec::new());
            for applied in 1..=1_000 {
                if snapshot_due(node_id, 300, applied, snapshot) {
                    at.push(applied);
                    snapshot = applied;
                }
            }
            at
        };
        assert_eq!(builds(3), vec![300, 600, 900]);
        assert_eq!(builds(1), vec![200, 500, 800]);
        assert_eq!(builds(2), vec![100, 400, 700, 1000]);
        // A snapshot installed from the leader (at 250) moves node 3's next build to its phase.
        assert!(!snapshot_due(3, 300, 299, 250));
        assert!(snapshot_due(3, 300, 300, 250));
        // Applied entries that jump past a boundary (a batch) still build once.
        assert!(snapshot_due(1, 300, 260, 150) && !snapshot_due(1, 300, 260, 260));
        assert!(!snapshot_due(1, 0, 0, 0), "nothing applied: nothing to build");
    }

    #[test]
    fn only_a_follower_that_lags_and_still_moves_holds_writes() {
        let mut progress = BTreeMap::new();
        let t0 = Instant::now();
        // Within the allowed lag: no hold.
        assert!(!live_follower_lags(&mut progress, [(2, 95), (3, 100)].into_iter(), 100, 8, t0));
        // Node 3 falls 20 entries behind while it replicates: hold.
        assert!(live_follower_lags(&mut progress, [(2, 120), (3, 100)].into_iter(), 120, 8, t0));
        let later = t0 + Duration::from_millis(500);
        assert!(live_follower_lags(&mut progress, [(2, 130), (3, 110)].into_iter(), 130, 8, later));
        // Node 3 stops moving (down, or stuck) for longer than the stall limit: not waited for.
        let much_later = later + FOLLOWER_STALL + Duration::from_millis(1);
        assert!(!live_follower_lags(&mut progress, [(2, 200), (3, 110)].into_iter(), 200, 8, much_later));
        // It moves again: waited for again.
        assert!(live_follower_lags(&mut progress, [(2, 210), (3, 150)].into_iter(), 210, 8, much_later));
        // A node that left the membership is forgotten.
        assert!(!live_follower_lags(&mut progress, [(2, 210)].into_iter(), 210, 8, much_later));
        assert_eq!(progress.len(), 1);
    }

    #[tokio::test]
    async fn a_lock_held_elsewhere_is_waited_for_then_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let held = LogStore::<TypeConfig>::open(dir.path()).expect("first open");
        let second = wait_for_lock(dir.path(), Duration::from_millis(200), || LogStore::<TypeConfig>::open(dir.path()))
            .await
            .map(|_| ())
            .expect_err("the lock is held");
        let message = format!("{second:#}");
        assert!(message.contains("locked by another process for more than"), "{message}");
        assert!(message.contains(&dir.path().display().to_string()), "{message}");
        drop(held);

        let sm = StateMachineStore::open(dir.path()).expect("first state machine open");
        let second = wait_for_lock(dir.path(), Duration::from_millis(200), || StateMachineStore::open(dir.path()))
            .await
            .map(|_| ())
            .expect_err("the history's lock is held");
        assert!(format!("{second:#}").contains("locked by another process for more than"), "{second:#}");
        drop(sm);
    }

    #[tokio::test]
    async fn a_lock_freed_while_waiting_opens_and_other_errors_fail_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut tries = 0;
        let opened = wait_for_lock(dir.path(), Duration::from_secs(10), || {
            tries += 1;
            if tries < 3 {
                Err(std::io::Error::new(std::io::ErrorKind::WouldBlock, "already locked"))
            } else {
                Ok(tries)
            }
        })
        .await
        .expect("opens once free");
        assert_eq!(opened, 3);

        let started = Instant::now();
        let mut tries = 0;
        let err = wait_for_lock(dir.path(), Duration::from_secs(10), || -> Result<(), std::io::Error> {
            tries += 1;
            Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied"))
        })
        .await
        .expect_err("not a lock");
        assert_eq!(tries, 1, "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
