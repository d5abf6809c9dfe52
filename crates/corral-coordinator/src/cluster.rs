//! The `ClusterAdmin` gRPC service: bootstrap, join, leave and status of the coordinator cluster.
//!
//! Join follows the safe order: record the id (never reused), add as learner and wait until it
//! caught up, then promote to voter.

use crate::{CoordError, Coordinator};
use corral_core::{ClusterConfig, Command};
use corral_proto::v1::cluster_admin_server::{ClusterAdmin, ClusterAdminServer};
use corral_proto::v1::{self as pb};
use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ChangeMembers, ServerState};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tonic::{Request, Response, Status};

pub(crate) fn server(coord: Coordinator) -> ClusterAdminServer<Admin> {
    ClusterAdminServer::new(Admin { coord })
        .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
}

pub(crate) struct Admin {
    coord: Coordinator,
}

fn membership_error(e: RaftError<u64, ClientWriteError<u64, BasicNode>>) -> CoordError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            CoordError::NotLeader { leader_id: f.leader_id, leader_addr: f.leader_node.map(|n| n.addr) }
        }
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => CoordError::InvalidArgument(c.to_string()),
        other => CoordError::Raft(other.to_string()),
    }
}

impl Admin {
    async fn status(&self) -> pb::ClusterStatus {
        self.coord.cluster_status().await
    }
}

impl Coordinator {
    /// This node's view of the cluster.
    pub async fn cluster_status(&self) -> pb::ClusterStatus {
        let node = &self.inner.node;
        let m = node.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(id, n)| pb::ClusterMember {
                node_id: *id,
                addr: n.addr.clone(),
                role: if voters.contains(id) { "voter" } else { "learner" }.to_string(),
            })
            .collect();
        let state = match m.state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        };
        let leader_addr =
            m.current_leader.and_then(|id| membership.get_node(&id).map(|n| n.addr.clone())).unwrap_or_default();
        pb::ClusterStatus {
            node_id: node.id,
            state: state.to_string(),
            leader_id: m.current_leader,
            leader_addr,
            term: m.current_term,
            last_log_index: m.last_log_index,
            committed_index: node.committed_index().await,
            applied_index: m.last_applied.map(|l| l.index),
            snapshot_index: m.snapshot.map(|l| l.index),
            purged_index: m.purged.map(|l| l.index),
            members,
            state_digest: node.state.digest(),
            initialized: m.membership_config.log_id().is_some(),
        }
    }

    /// Makes this node the first voter of a new cluster and installs the default config.
    pub async fn init_cluster(&self) -> Result<(), CoordError> {
        let node = &self.inner.node;
        let addr = self.inner.config.advertise_addr.clone();
        let members = BTreeMap::from([(node.id, BasicNode { addr: addr.clone() })]);
        match node.raft.initialize(members).await {
            Ok(()) => {}
            Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
            Err(e) => return Err(CoordError::Raft(e.to_string())),
        }
        node.raft
            .wait(Some(Duration::from_secs(30)))
            .metrics(|m| m.current_leader.is_some(), "a leader is elected")
            .await
            .map_err(|e| CoordError::Unavailable(format!("no leader after init: {e}")))?;
        let (recorded, configured) = {
            let data = node.state.read();
            (data.state.coordinators.contains_key(&node.id), !data.state.config.tenants.is_empty())
        };
        if !recorded {
            self.propose(Command::AddCoordinator { node_id: node.id, addr }).await?;
        }
        if !configured {
            self.propose(Command::Configure(ClusterConfig::dev_defaults())).await?;
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl ClusterAdmin for Admin {
    async fn init(&self, request: Request<pb::ClusterInitRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        self.coord.init_cluster().await?;
        self.coord.audit_cluster(&request, "cluster init", format!("node {}", self.coord.inner.node.id));
        Ok(Response::new(self.status().await))
    }

    async fn join(&self, request: Request<pb::JoinRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let req = request.get_ref().clone();
        if req.addr.is_empty() {
            return Err(Status::invalid_argument("missing address of the joining coordinator"));
        }
        let raft = &self.coord.inner.node.raft;
        let is_voter = raft.metrics().borrow().membership_config.membership().voter_ids().any(|id| id == req.node_id);
        // Recording first makes the id taken forever, even if the rest fails and is retried.
        self.coord.propose(Command::AddCoordinator { node_id: req.node_id, addr: req.addr.clone() }).await?;
        if !is_voter {
            tracing::info!(node_id = req.node_id, addr = %req.addr, "adding coordinator as learner");
            raft.add_learner(req.node_id, BasicNode { addr: req.addr.clone() }, true)
                .await
                .map_err(membership_error)?;
            tracing::info!(node_id = req.node_id, "learner caught up: promoting to voter");
            raft.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([req.node_id])), false)
                .await
                .map_err(membership_error)?;
        }
        self.coord.audit_cluster(&request, "cluster join", format!("node {} at {}", req.node_id, req.addr));
        Ok(Response::new(self.status().await))
    }

    async fn leave(&self, request: Request<pb::LeaveRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let node_id = request.get_ref().node_id;
        let raft = &self.coord.inner.node.raft;
        let membership = raft.metrics().borrow().membership_config.membership().clone();
        if membership.get_node(&node_id).is_none() {
            return Err(CoordError::NotFound(format!("coordinator {node_id} is not a member")).into());
        }
        if !self.coord.is_leader() {
            return Err(self.coord.not_leader().into());
        }
        self.coord.propose(Command::RemoveCoordinator { node_id }).await?;
        if membership.voter_ids().any(|id| id == node_id) {
            raft.change_membership(ChangeMembers::RemoveVoters(BTreeSet::from([node_id])), false)
                .await
                .map_err(membership_error)?;
        } else {
            raft.change_membership(ChangeMembers::RemoveNodes(BTreeSet::from([node_id])), false)
                .await
                .map_err(membership_error)?;
        }
        tracing::info!(node_id, "coordinator removed from the cluster");
        self.coord.audit_cluster(&request, "cluster leave", format!("node {node_id}"));
        Ok(Response::new(self.status().await))
    }

    async fn status(&self, _: Request<pb::ClusterStatusRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        Ok(Response::new(self.status().await))
    }
}
