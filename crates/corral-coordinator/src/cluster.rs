//! The `ClusterAdmin` gRPC service: bootstrap, join, leave, status and snapshots of the coordinator
//! cluster.
//!
//! Join follows the safe order: record the id (never reused), add as learner and wait until it
//! caught up, then promote to voter.
//!
//! Bounds (callers hold a coordinator or admin certificate): `Status` reads the node's Raft
//! status; with `digest` it also encodes the whole state and history (a blocking thread, one
//! digest at a time per coordinator: concurrent ones wait their turn); `Snapshot` builds one
//! snapshot (the node builds one at a time); `Init` and `Join` take a policy of at most the
//! small message limit; the rest are one log entry or membership change each.

use crate::{CoordError, Coordinator};
use corral_core::{ClusterConfig, Command};
use corral_proto::v1::cluster_admin_server::{ClusterAdmin, ClusterAdminServer};
use corral_proto::v1::{self as pb};
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// How long `corral cluster snapshot` waits for the snapshot to be written: a state of a million
/// jobs encodes in seconds; the client's own deadline may be shorter.
const SNAPSHOT_PATIENCE: Duration = Duration::from_secs(300);

pub(crate) fn server(coord: Coordinator) -> ClusterAdminServer<Admin> {
    ClusterAdminServer::new(Admin { coord, digests: Arc::new(tokio::sync::Semaphore::new(1)) })
        .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
}

pub(crate) struct Admin {
    coord: Coordinator,
    /// One state digest at a time: each encodes the whole state.
    digests: Arc<tokio::sync::Semaphore>,
}

impl Admin {
    async fn status(&self) -> pb::ClusterStatus {
        self.coord.cluster_status(false).await
    }
}

impl Coordinator {
    /// This node's view of the cluster; with `digest`, also the digest of its state machine
    /// (which encodes the whole state: only on request, on a blocking thread), and then the
    /// applied index is the one the digest stands at: while entries keep applying (a leader
    /// extends its timestamp window every second or so), a digest compared with another
    /// node's is meaningful only at the same index.
    pub async fn cluster_status(&self, digest: bool) -> pb::ClusterStatus {
        let (digest_applied, state_digest) = if digest {
            let store = self.store().clone();
            match tokio::task::spawn_blocking(move || store.digest_at()).await {
                Ok((applied, digest)) => (Some(applied), digest),
                Err(_) => (None, 0),
            }
        } else {
            (None, 0)
        };
        let node = &self.raft_node();
        let status = node.status();
        let members = status
            .members
            .iter()
            .map(|m| pb::ClusterMember {
                node_id: m.id,
                addr: m.addr.clone(),
                role: if m.voter { "voter" } else { "learner" }.to_string(),
            })
            .collect();
        pb::ClusterStatus {
            node_id: node.id,
            state: status.role.as_str().to_string(),
            leader_id: status.leader,
            leader_addr: status.leader_addr.unwrap_or_default(),
            term: status.term,
            last_log_index: status.last_log_index,
            committed_index: node.committed_index().await,
            applied_index: digest_applied.or(status.applied_index),
            snapshot_index: status.snapshot_index,
            purged_index: status.purged_index,
            members,
            state_digest,
            initialized: status.initialized,
            jobs_in_memory: node.state.read().state.jobs.len() as u64,
        }
    }

    /// Makes this node the first voter of a new cluster and installs its first policy: `policy`,
    /// or the dev pool's (`cluster-configs/dev-policy.toml`) when none is given. Initializing an
    /// initialized cluster again changes nothing; asking it for another policy is refused
    /// (policies change with `corral admin apply`).
    pub async fn init_cluster(&self, policy: Option<ClusterConfig>) -> Result<(), CoordError> {
        let node = &self.raft_node();
        let addr = self.config().advertise_addr.clone();
        node.initialize(&addr).await?;
        node.wait_for(Duration::from_secs(30), |s| s.leader.is_some())
            .await
            .map_err(|e| CoordError::Unavailable(format!("no leader after init: {e}")))?;
        let recorded = node.state.read().state.coordinators.contains_key(&node.id);
        if !recorded {
            self.propose(Command::AddCoordinator { node_id: node.id, addr }).await?;
        }
        self.install_first_policy(policy, "cluster init").await
    }

    /// Installs `policy` (default: the dev policy) as version 1 if the cluster has no policy
    /// yet; refuses a different one when a policy is in force.
    pub async fn install_first_policy(&self, policy: Option<ClusterConfig>, by: &str) -> Result<(), CoordError> {
        let (configured, version, current) = {
            let data = self.store().read();
            (!data.state.config.tenants.is_empty(), data.state.policy_version, data.state.config.clone())
        };
        if configured {
            return match policy {
                Some(wanted) if wanted != current => Err(CoordError::InvalidArgument(format!(
                    "the cluster has a policy already (version {version}): change it with `corral admin apply -f FILE`"
                ))),
                _ => Ok(()),
            };
        }
        let config = policy.unwrap_or_else(crate::policy::dev_policy);
        self.propose(Command::ApplyPolicy { config, by: by.to_string(), force: false }).await?;
        Ok(())
    }
}

#[tonic::async_trait]
impl ClusterAdmin for Admin {
    async fn init(&self, request: Request<pb::ClusterInitRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let req = request.get_ref();
        let policy = if req.policy_toml.is_empty() {
            None
        } else {
            let source = if req.source.is_empty() { "policy" } else { req.source.as_str() };
            Some(crate::policy::parse_policy(source, &req.policy_toml).map_err(Status::invalid_argument)?)
        };
        self.coord.init_cluster(policy).await?;
        self.coord.audit_cluster(&request, "cluster init", format!("node {}", self.coord.raft_node().id));
        Ok(Response::new(self.status().await))
    }

    async fn join(&self, request: Request<pb::JoinRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let req = request.get_ref().clone();
        if req.addr.is_empty() {
            return Err(Status::invalid_argument("missing address of the joining coordinator"));
        }
        let raft = &self.coord.raft_node();
        let is_voter = raft.status().members.iter().any(|m| m.id == req.node_id && m.voter);
        // Recording first makes the id taken forever, even if the rest fails and is retried.
        self.coord.propose(Command::AddCoordinator { node_id: req.node_id, addr: req.addr.clone() }).await?;
        if !is_voter {
            tracing::info!(node_id = req.node_id, addr = %req.addr, "adding coordinator as learner");
            raft.add_learner(req.node_id, &req.addr).await.map_err(CoordError::from)?;
            tracing::info!(node_id = req.node_id, "learner caught up: promoting to voter");
            raft.promote(req.node_id).await.map_err(CoordError::from)?;
        }
        self.coord.audit_cluster(&request, "cluster join", format!("node {} at {}", req.node_id, req.addr));
        Ok(Response::new(self.status().await))
    }

    async fn leave(&self, request: Request<pb::LeaveRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let node_id = request.get_ref().node_id;
        let raft = &self.coord.raft_node();
        if !raft.status().members.iter().any(|m| m.id == node_id) {
            return Err(CoordError::NotFound(format!("coordinator {node_id} is not a member")).into());
        }
        if !self.coord.is_leader() {
            return Err(self.coord.not_leader().into());
        }
        self.coord.propose(Command::RemoveCoordinator { node_id }).await?;
        raft.remove(node_id).await.map_err(CoordError::from)?;
        tracing::info!(node_id, "coordinator removed from the cluster");
        self.coord.audit_cluster(&request, "cluster leave", format!("node {node_id}"));
        Ok(Response::new(self.status().await))
    }

    async fn status(&self, request: Request<pb::ClusterStatusRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let digest = request.get_ref().digest;
        // A digest waits for the one before it; the permit is held while it is computed.
        let _turn = match digest {
            true => Some(self.digests.acquire().await.map_err(|_| Status::unavailable("shutting down"))?),
            false => None,
        };
        Ok(Response::new(self.coord.cluster_status(digest).await))
    }

    async fn snapshot(
        &self,
        request: Request<pb::ClusterSnapshotRequest>,
    ) -> Result<Response<pb::ClusterStatus>, Status> {
        let raft = &self.coord.raft_node();
        let index = raft.snapshot(SNAPSHOT_PATIENCE).await.map_err(CoordError::from)?;
        tracing::info!(index, "snapshot built on request");
        self.coord.audit_cluster(&request, "cluster snapshot", format!("node {} at index {index}", raft.id));
        Ok(Response::new(self.status().await))
    }

    async fn create_join_token(
        &self,
        request: Request<pb::CreateJoinTokenRequest>,
    ) -> Result<Response<pb::CreateJoinTokenResponse>, Status> {
        self.coord.create_join_token(&request).await.map(Response::new)
    }
}
