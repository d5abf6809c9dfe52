//! corral coordinator: gRPC API, worker gateway, leader scheduling loop and worker liveness.
//!
//! Boundary: talks to Raft only through `corral_raft::RaftNode`; every state change is a
//! `corral_core::Command` proposed through Raft. Heartbeats and GPU health stay in the leader's
//! memory; only state changes (node down, registrations) go through the log.

mod api;
mod cluster;
mod error;
mod gateway;
mod group_commit;
mod liveness;
mod scheduler;
mod tso;

pub use error::{CoordError, LEADER_ADDR_METADATA};
pub use tso::Tso;

use corral_core::{Command, Outcome, Request};
use corral_raft::{RaftNode, RaftRequest};
use liveness::Liveness;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Tunables of a coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// A node whose last heartbeat is older than this is marked down and its jobs requeued.
    pub node_ttl: Duration,
    /// Scheduling passes run at least this often on the leader (and on every applied change).
    pub schedule_interval: Duration,
    /// Address other coordinators, workers and clients reach this one at (API and Raft).
    pub advertise_addr: String,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            node_ttl: Duration::from_secs(10),
            schedule_interval: Duration::from_millis(500),
            advertise_addr: String::new(),
        }
    }
}

/// A coordinator process: one Raft member plus the services on top of it.
#[derive(Clone)]
pub struct Coordinator {
    inner: Arc<Inner>,
}

struct Inner {
    node: RaftNode,
    /// Set once by `serve`: batches concurrent submits into one Raft entry.
    submits: std::sync::OnceLock<group_commit::GroupCommit>,
    tso: Tso,
    liveness: Liveness,
    config: CoordinatorConfig,
}

impl Coordinator {
    pub fn new(node: RaftNode, config: CoordinatorConfig) -> Self {
        Coordinator {
            inner: Arc::new(Inner {
                node,
                submits: std::sync::OnceLock::new(),
                tso: Tso::default(),
                liveness: Liveness::default(),
                config,
            }),
        }
    }

    pub fn raft_node(&self) -> &RaftNode {
        &self.inner.node
    }

    /// Stamps `command` with a TSO timestamp and replicates it; returns the state machine's outcome.
    pub async fn propose(&self, command: Command) -> Result<Outcome, CoordError> {
        let node = &self.inner.node;
        let floor = node.state.read().state.last_ts;
        let ts = self.inner.tso.next(floor);
        match node.raft.client_write(RaftRequest(Request { ts, command })).await {
            Ok(reply) => reply.data.map_err(CoordError::Rejected),
            Err(openraft::error::RaftError::APIError(openraft::error::ClientWriteError::ForwardToLeader(f))) => {
                Err(CoordError::NotLeader { leader_id: f.leader_id, leader_addr: f.leader_node.map(|n| n.addr) })
            }
            Err(e) => Err(CoordError::Raft(e.to_string())),
        }
    }

    /// Submits one job through group commit (or alone, before `serve` started).
    pub(crate) async fn submit(
        &self,
        request_id: String,
        spec: corral_types::JobSpec,
    ) -> Result<(u64, bool), CoordError> {
        if let Some(submits) = self.inner.submits.get() {
            return submits.submit(request_id, spec).await;
        }
        match self.propose(Command::SubmitJob { request_id, spec }).await? {
            Outcome::JobSubmitted { job_id, duplicate } => Ok((job_id, duplicate)),
            other => Err(CoordError::Raft(format!("unexpected outcome of submit: {other:?}"))),
        }
    }

    /// The "not the leader" error, naming the leader when one is known.
    pub(crate) fn not_leader(&self) -> CoordError {
        let metrics = self.inner.node.raft.metrics().borrow().clone();
        let leader_addr = metrics
            .current_leader
            .and_then(|id| metrics.membership_config.membership().get_node(&id).map(|n| n.addr.clone()));
        CoordError::NotLeader { leader_id: metrics.current_leader, leader_addr }
    }

    /// Waits until this node may serve a linearizable read: it is the leader, a quorum confirmed
    /// it, and everything committed before the read is applied. Followers answer `NotLeader`.
    pub(crate) async fn linearizable(&self) -> Result<(), CoordError> {
        use openraft::error::{CheckIsLeaderError, RaftError};
        match self.inner.node.raft.ensure_linearizable().await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f))) => {
                Err(CoordError::NotLeader { leader_id: f.leader_id, leader_addr: f.leader_node.map(|n| n.addr) })
            }
            Err(e) => Err(CoordError::Unavailable(format!("cannot confirm leadership: {e}"))),
        }
    }

    /// True if this node currently believes it leads the cluster.
    pub fn is_leader(&self) -> bool {
        let metrics = self.inner.node.raft.metrics().borrow().clone();
        metrics.current_leader == Some(self.inner.node.id)
    }

    /// Serves the Raft, user API and worker gateway services on `listener` until `shutdown`
    /// resolves; the leader's scheduling loop runs alongside.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let scheduler = tokio::spawn(scheduler::run(self.clone()));
        let (submits, group_task) = group_commit::GroupCommit::start(self.clone());
        let _ = self.inner.submits.set(submits);
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let result = tonic::transport::Server::builder()
            .add_service(corral_raft::RaftGrpcService::new(self.inner.node.raft.clone()).into_server())
            .add_service(api::server(self.clone()))
            .add_service(gateway::server(self.clone()))
            .add_service(cluster::server(self.clone()))
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await;
        scheduler.abort();
        group_task.abort();
        result.map_err(Into::into)
    }
}
