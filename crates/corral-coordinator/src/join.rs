//! Worker certificates: `ClusterAdmin.CreateJoinToken` issues a single-use token (admin
//! certificates only), `NodeJoin.Join` spends it and signs the worker's certificate with the
//! cluster CA key (`tls.ca-key`), `NodeJoin.Renew` signs a new one for a worker that calls with
//! its current certificate, and [`revocations`] refuses the certificates of removed nodes (the
//! replicated deny list `State::revoked_workers`) at every handshake and on every request.
//!
//! A certificate's issue time comes from the replicated state (`State::worker_certificate_issue_s`,
//! the second of the latest applied timestamp): for a join, as the token's consume applied it;
//! for a renewal, as read (after a `Noop` through Raft brought that clock up to now) together
//! with the deny list that judged the old certificate. A removal applied later always revokes
//! the new certificate; one applied before never does (a node joining again under its name).
//!
//! `NodeJoin` is the only service a caller without a client certificate reaches (the acceptor
//! lets such callers in only on a coordinator that holds the CA key; every other service's
//! role check refuses them). The token is spent by a replicated `ConsumeJoinToken` whose apply
//! refuses an unknown, expired or used token, so it admits one worker across coordinators and
//! failovers; the certificate is signed only after that command committed. Every refusal and
//! every admission is audited.
//!
//! Bounds: a join request is at most the small message limit; an unknown token is refused
//! with one hash and one lookup, before its certificate request is parsed and without a log
//! entry; a known one costs one parse, one log entry and one signature. The cluster holds at
//! most `corral_core::MAX_JOIN_TOKENS` join tokens.

use crate::auth::token_sha256;
use crate::{CoordError, Coordinator};
use corral_core::{ApplyError, Command, Outcome, MAX_JOIN_TOKEN_TTL_MS};
use corral_proto::v1::node_join_server::{NodeJoin, NodeJoinServer};
use corral_proto::v1::{self as pb};
use corral_raft::StateMachineStore;
use corral_security::{AuditEvent, JoinToken, Peer, Revocations, Role, VerifiedRequest};
use corral_types::{format_utc, Timestamp};
use tonic::{Request, Response, Status};

/// The deny list as the TLS acceptor and the role guards ask it: a worker certificate issued
/// before its node's removal is refused (see `corral_core::State::worker_certificate_revoked`).
pub(crate) fn revocations(store: StateMachineStore) -> Revocations {
    Revocations::new(move |identity| {
        if identity.role != Role::Worker {
            return None;
        }
        let data = store.read();
        data.state.worker_certificate_revoked(&identity.name, identity.issued_at_s()).then(|| {
            let removed = data.state.revoked_workers.get(&identity.name).copied().unwrap_or_default();
            format!(
                "the certificate of node {} was revoked: the node was removed at {} (`corral node remove`); join it again with a new token",
                identity.name,
                format_utc(Timestamp::compose(removed.saturating_mul(1000), 0))
            )
        })
    })
}

pub(crate) fn server(coord: Coordinator) -> NodeJoinServer<Joins> {
    NodeJoinServer::new(Joins { coord })
        .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
}

pub(crate) struct Joins {
    coord: Coordinator,
}

fn describe_peer<T>(request: &Request<T>) -> String {
    request.extensions().get::<Peer>().map(Peer::describe).unwrap_or_else(|| "unknown peer".into())
}

const ACTION: &str = "node join";

impl Coordinator {
    /// Issues a join token living `ttl_ms` (the caller must hold an admin certificate).
    pub(crate) async fn create_join_token(
        &self,
        request: &Request<pb::CreateJoinTokenRequest>,
    ) -> Result<pb::CreateJoinTokenResponse, Status> {
        const ACTION: &str = "node join-token";
        let security = self.security();
        if security.server_tls.is_none() {
            return Err(Status::failed_precondition(
                "join tokens need TLS: this cluster runs without [tls], so workers join without a token (start them with `corral worker --config FILE`)",
            ));
        }
        let peer = request.extensions().get::<Peer>();
        if peer.and_then(Peer::role) != Some(Role::Admin) {
            return Err(self.deny(
                request,
                ACTION,
                "-",
                Status::permission_denied("permission denied: node join-token needs an admin certificate"),
            ));
        }
        if !self.is_leader() {
            return Err(self.not_leader().into());
        }
        let Some(ca) = security.cluster_ca.clone() else {
            return Err(Status::failed_precondition(
                "this coordinator holds no CA key, so it cannot sign joining workers' certificates: set ca-key in the [tls] section of every coordinator's config",
            ));
        };
        let ttl_ms = request.get_ref().ttl_ms;
        if ttl_ms == 0 || ttl_ms > MAX_JOIN_TOKEN_TTL_MS {
            return Err(Status::invalid_argument(format!(
                "--ttl must be greater than zero and at most {}h",
                MAX_JOIN_TOKEN_TTL_MS / 3_600_000
            )));
        }
        let secret = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
        let token = JoinToken::new(secret, ca.pin()).map_err(Status::internal)?;
        let command = Command::CreateJoinToken { sha256: token_sha256(token.secret()), ttl_ms };
        let token_id = match self.propose(command).await? {
            Outcome::JoinTokenCreated { token_id } => token_id,
            other => return Err(Status::internal(format!("unexpected outcome of join-token: {other:?}"))),
        };
        let expires_at_ms =
            self.store().read().state.join_tokens.get(&token_id).map(|t| t.expires_at_ms).unwrap_or_default();
        let who = describe_peer(request);
        security.audit.record(AuditEvent::admin(ACTION, who.clone(), who, format!("join token {token_id}")));
        Ok(pb::CreateJoinTokenResponse { id: token_id, token: token.to_string(), expires_at_ms })
    }

    fn deny_join<T>(&self, request: &Request<T>, status: Status) -> Status {
        self.deny(request, ACTION, "-", status)
    }
}

#[tonic::async_trait]
impl NodeJoin for Joins {
    async fn join(&self, request: Request<pb::JoinNodeRequest>) -> Result<Response<pb::JoinNodeResponse>, Status> {
        let coord = &self.coord;
        let security = coord.security();
        if security.server_tls.is_none() {
            return Err(Status::failed_precondition(
                "this cluster runs without TLS: workers need no join token (start the worker without --join)",
            ));
        }
        // The leader judges the token; a follower refers the worker to it.
        coord.linearizable().await?;
        let Some(ca) = security.cluster_ca.clone() else {
            return Err(Status::failed_precondition(
                "the leader holds no CA key, so it cannot sign worker certificates: set ca-key in the [tls] section of every coordinator's config",
            ));
        };
        let req = request.get_ref();
        let sha256 = token_sha256(&req.secret);
        // Unknown secrets are refused first, before the request is parsed and without a log
        // entry each (everything committed before this call is applied: `linearizable` above).
        if coord.store().read().state.join_token_by_hash(&sha256).is_none() {
            let status = Status::permission_denied("join refused: unknown join token: not issued by this cluster");
            return Err(coord.deny_join(&request, status));
        }
        let csr =
            VerifiedRequest::parse(&req.csr).map_err(|e| coord.deny_join(&request, Status::invalid_argument(e)))?;
        let node = csr.node().to_string();
        let command =
            Command::ConsumeJoinToken { sha256, node: node.clone(), public_key_sha256: csr.public_key_sha256() };
        let (token_id, duplicate, issued_at_s) = match coord.propose(command).await {
            Ok(Outcome::JoinTokenConsumed { token_id, duplicate, issued_at_s }) => (token_id, duplicate, issued_at_s),
            Ok(other) => return Err(Status::internal(format!("unexpected outcome of join: {other:?}"))),
            Err(CoordError::Rejected(e @ ApplyError::JoinTokenRefused(_))) => {
                return Err(coord.deny_join(&request, Status::permission_denied(e.to_string())));
            }
            Err(e) => return Err(e.into()),
        };
        let certificate = ca.sign_worker(&csr, issued_at_s).map_err(|e| Status::internal(e.to_string()))?;
        let again = if duplicate { " (again: the same worker and key retried)" } else { "" };
        security.audit.record(AuditEvent::admin(
            ACTION,
            describe_peer(&request),
            format!("join token {token_id}"),
            format!("worker certificate for node {node}{again}"),
        ));
        tracing::info!(node = %node, token_id, "worker joined with a token");
        Ok(Response::new(pb::JoinNodeResponse { certificate, ca: ca.ca_pem().to_string() }))
    }

    async fn renew(
        &self,
        request: Request<pb::RenewCertificateRequest>,
    ) -> Result<Response<pb::JoinNodeResponse>, Status> {
        const ACTION: &str = "node renew";
        let coord = &self.coord;
        let security = coord.security();
        if security.server_tls.is_none() {
            return Err(Status::failed_precondition("this cluster runs without TLS: there is no certificate to renew"));
        }
        let deny = |status: Status| coord.deny(&request, ACTION, "-", status);
        let peer = request.extensions().get::<Peer>().and_then(|p| p.identity.clone());
        let Some(peer) = peer.filter(|p| p.role == Role::Worker) else {
            return Err(deny(Status::permission_denied(
                "permission denied: a certificate is renewed only over a connection made with the worker certificate it replaces",
            )));
        };
        let now_s =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default();
        if peer.not_after_s <= now_s {
            return Err(deny(Status::permission_denied(
                "permission denied: the certificate expired: join again with a new token",
            )));
        }
        // The leader judges; a follower refers the worker to it.
        coord.linearizable().await?;
        let Some(ca) = security.cluster_ca.clone() else {
            return Err(Status::failed_precondition(
                "the leader holds no CA key, so it cannot sign worker certificates: set ca-key in the [tls] section of every coordinator's config",
            ));
        };
        let csr = VerifiedRequest::parse(&request.get_ref().csr).map_err(|e| deny(Status::invalid_argument(e)))?;
        // Brings the state's clock (the latest applied timestamp, which dates the certificate)
        // up to now: an idle cluster applies nothing for hours.
        coord.propose(Command::Noop).await?;
        if csr.node() != peer.name {
            return Err(deny(Status::permission_denied(format!(
                "permission denied: the certificate of node {} renews only itself, not node {}",
                peer.name,
                csr.node()
            ))));
        }
        // The state is read once: the deny list that judges the old certificate also dates the
        // new one (see the module docs).
        let issued_at_s = {
            let data = coord.store().read();
            if data.state.worker_certificate_revoked(&peer.name, peer.issued_at_s()) {
                drop(data);
                return Err(deny(Status::permission_denied(format!(
                    "permission denied: the certificate of node {} was revoked (`corral node remove`): join again with a new token",
                    peer.name
                ))));
            }
            data.state.worker_certificate_issue_s(&peer.name)
        };
        let certificate = ca.sign_worker(&csr, issued_at_s).map_err(|e| Status::internal(e.to_string()))?;
        security.audit.record(AuditEvent::admin(
            ACTION,
            describe_peer(&request),
            format!("node {}", peer.name),
            format!("worker certificate for node {} renewed for {}s", peer.name, ca.worker_lifetime().as_secs()),
        ));
        tracing::info!(node = %peer.name, "worker certificate renewed");
        Ok(Response::new(pb::JoinNodeResponse { certificate, ca: ca.ca_pem().to_string() }))
    }
}
