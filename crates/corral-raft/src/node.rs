//! Opening a coordinator's Raft node: storage under a data dir, timing config, network.

use crate::log_store::LogStore;
use crate::network::GrpcNetworkFactory;
use crate::state_machine::StateMachineStore;
use crate::types::{NodeId, Raft, TypeConfig};
use openraft::{BasicNode, SnapshotPolicy};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// How to open a Raft node.
#[derive(Debug, Clone)]
pub struct RaftNodeConfig {
    pub node_id: NodeId,
    /// Holds `raft-log/` (log + vote), `sm/` (sled) and `snapshots/`.
    pub data_dir: PathBuf,
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot after this many applied entries since the last one.
    pub snapshot_every: u64,
    /// Keep this many entries in the log below the snapshot for lagging followers.
    pub keep_logs_after_snapshot: u64,
    /// TLS towards peers (our coordinator certificate, the cluster CA); `None`: plaintext.
    pub client_tls: Option<tonic::transport::ClientTlsConfig>,
}

impl RaftNodeConfig {
    pub fn new(node_id: NodeId, data_dir: PathBuf) -> Self {
        RaftNodeConfig {
            node_id,
            data_dir,
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 150,
            election_timeout_max_ms: 300,
            snapshot_every: 20_000,
            keep_logs_after_snapshot: 1_000,
            client_tls: None,
        }
    }
}

/// A running Raft node and its state machine.
#[derive(Clone)]
pub struct RaftNode {
    pub id: NodeId,
    pub raft: Raft,
    pub state: StateMachineStore,
    log: LogStore<TypeConfig>,
}

impl RaftNode {
    /// Opens storage and starts the Raft core. Does not initialize a cluster.
    pub async fn open(config: &RaftNodeConfig) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&config.data_dir)?;
        let raft_config = openraft::Config {
            cluster_name: "corral".to_string(),
            heartbeat_interval: config.heartbeat_interval_ms,
            election_timeout_min: config.election_timeout_min_ms,
            election_timeout_max: config.election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(config.snapshot_every),
            max_in_snapshot_log_to_keep: config.keep_logs_after_snapshot,
            snapshot_max_chunk_size: 1 << 20,
            ..Default::default()
        }
        .validate()?;
        let log_dir = config.data_dir.join("raft-log");
        std::fs::create_dir_all(&log_dir)?;
        let mut log_config = raft_log::Config::new(log_dir.display());
        // Small chunks: purged log space is reclaimed per closed chunk.
        log_config.wal.chunk_max_size = Some(64 << 20);
        log_config.log_cache_capacity = Some(256 << 20);
        // openraft 0.9 keeps one log write in flight: waiting for more writes to batch into one
        // fsync only adds latency. Batching happens above, in the coordinator's group commit.
        log_config.wal.flush_batch_wait = Some(std::time::Duration::ZERO);
        let log_store = LogStore::<TypeConfig>::open_with_config(log_config)?;
        let state = StateMachineStore::open(&config.data_dir)?;
        let network = GrpcNetworkFactory { tls: config.client_tls.clone() };
        let raft = Raft::new(config.node_id, Arc::new(raft_config), network, log_store.clone(), state.clone()).await?;
        Ok(RaftNode { id: config.node_id, raft, state, log: log_store })
    }

    /// Highest log index this node knows to be committed (persisted lazily: may lag).
    pub async fn committed_index(&self) -> Option<u64> {
        use openraft::storage::RaftLogStorage;
        let mut log = self.log.clone();
        log.read_committed().await.ok().flatten().map(|l| l.index)
    }

    /// Makes this node the single voter of a new cluster. Succeeds if already initialized.
    pub async fn initialize_single(&self, raft_addr: &str) -> anyhow::Result<()> {
        let members = BTreeMap::from([(self.id, BasicNode { addr: raft_addr.to_string() })]);
        match self.raft.initialize(members).await {
            Ok(()) => Ok(()),
            Err(openraft::error::RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
