//! Who may call what: every service checks the role in the caller's certificate, and the user
//! API resolves the caller's token to a principal (a tenant, or an admin) that each call checks.
//!
//! Roles per service (default deny: a service not listed here is not served):
//! Raft: coordinator. Cluster admin: coordinator, admin (join tokens: admin only). Worker
//! gateway: worker. User API: client (with a tenant or admin token), admin (the certificate
//! alone makes it admin). Health and reflection: every role (any certificate of the cluster
//! CA; a certificate-less joining worker is refused). The one exception is the join service (`join.rs`): no role, since a
//! joining worker has no certificate yet; it answers only a valid, unused join token.
//! Without TLS and without `require_tokens` (`corral dev` on loopback) every caller is admin.
//! Every denial and every admin action is written to the audit log.

use crate::Coordinator;
use corral_security::{AuditEvent, AuditLog, Peer, Role, RoleGuard, ServerTls};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use tonic::{Request, Status};

/// Security settings of a coordinator.
#[derive(Debug, Clone, Default)]
pub struct SecurityConfig {
    /// Serve TLS with required client certificates of the cluster CA; `None`: plaintext.
    pub server_tls: Option<ServerTls>,
    /// Our certificate towards worker agents (log streaming); needed with `server_tls`. An
    /// agent must present the worker certificate of its node.
    pub client_tls: Option<corral_security::ClientTls>,
    /// Require a token on the user API even without TLS.
    pub require_tokens: bool,
    /// Serve without TLS or tokens off loopback (the config's `insecure = true`): the API, and
    /// the web view's pages on any metrics listener, to whoever reaches them, as admin.
    pub insecure: bool,
    /// Hex SHA-256 of a bootstrap admin token from the config file.
    pub admin_token_sha256: Option<String>,
    pub audit: Arc<AuditLog>,
    /// The cluster CA with its key (`tls.ca-key`): signs the certificates of workers that join
    /// with a token. Only with `server_tls`, which then lets certificate-less clients complete
    /// the handshake for the join service alone.
    pub cluster_ca: Option<Arc<corral_security::ClusterCa>>,
}

impl SecurityConfig {
    /// Whether callers must authenticate (otherwise everyone is admin).
    pub fn auth_enabled(&self) -> bool {
        self.server_tls.is_some() || self.require_tokens
    }
}

/// The services of one coordinator, for role checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Service {
    Raft,
    ClusterAdmin,
    Gateway,
    Api,
    /// grpc.health.v1 and server reflection.
    Standard,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Service::Raft => "raft",
            Service::ClusterAdmin => "cluster admin",
            Service::Gateway => "worker gateway",
            Service::Api => "user API",
            Service::Standard => "health and reflection",
        }
    }

    fn allowed(self) -> &'static [Role] {
        match self {
            Service::Raft => &[Role::Coordinator],
            Service::ClusterAdmin => &[Role::Coordinator, Role::Admin],
            Service::Gateway => &[Role::Worker],
            Service::Api => &[Role::Client, Role::Admin],
            Service::Standard => &[Role::Coordinator, Role::Worker, Role::Client, Role::Admin],
        }
    }

    /// The interceptor of this service: the caller's certificate must carry a role it accepts.
    pub(crate) fn guard(self, security: &SecurityConfig) -> RoleGuard {
        RoleGuard::new(self.name(), self.allowed(), security.server_tls.is_some(), security.audit.clone())
    }
}

/// Whom a user API call acts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Principal {
    Admin { name: String },
    Tenant { tenant: String, token_id: u64 },
}

impl Principal {
    pub(crate) fn is_admin(&self) -> bool {
        matches!(self, Principal::Admin { .. })
    }

    /// The only tenant this principal may act for (`None`: any).
    pub(crate) fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Admin { .. } => None,
            Principal::Tenant { tenant, .. } => Some(tenant),
        }
    }

    pub(crate) fn may_access(&self, tenant: &str) -> bool {
        self.tenant().is_none_or(|t| t == tenant)
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            Principal::Admin { name } => format!("admin ({name})"),
            Principal::Tenant { tenant, token_id } => format!("tenant {tenant} (token {token_id})"),
        }
    }
}

/// Lower-case hex SHA-256 of a token secret.
pub fn token_sha256(secret: &str) -> String {
    Sha256::digest(secret.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// A new random token secret (256 bits from the OS generator).
pub(crate) fn new_token_secret() -> String {
    format!("crl_{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn peer_of<T>(request: &Request<T>) -> Option<&Peer> {
    request.extensions().get::<Peer>()
}

fn describe_peer<T>(request: &Request<T>) -> String {
    peer_of(request).map(Peer::describe).unwrap_or_else(|| "unknown peer".into())
}

impl Coordinator {
    pub(crate) fn security(&self) -> &SecurityConfig {
        &self.config().security
    }

    /// Records a refusal and returns the status for it.
    pub(crate) fn deny<T>(&self, request: &Request<T>, action: &str, principal: &str, status: Status) -> Status {
        self.security().audit.record(AuditEvent::denied(action, describe_peer(request), principal, status.message()));
        status
    }

    /// Records an admin action.
    pub(crate) fn audit_admin<T>(&self, request: &Request<T>, action: &str, principal: &Principal, detail: String) {
        self.security().audit.record(AuditEvent::admin(action, describe_peer(request), principal.describe(), detail));
    }

    /// Records a cluster admin action (init, join, leave) when authentication is on.
    pub(crate) fn audit_cluster<T>(&self, request: &Request<T>, action: &str, detail: String) {
        if self.security().auth_enabled() {
            let peer = describe_peer(request);
            self.security().audit.record(AuditEvent::admin(action, peer.clone(), peer, detail));
        }
    }

    /// Whom a user API call acts for: an admin certificate, or the bearer token's principal.
    pub(crate) fn principal<T>(&self, request: &Request<T>, action: &str) -> Result<Principal, Status> {
        let security = self.security();
        if !security.auth_enabled() {
            return Ok(Principal::Admin { name: "auth disabled".into() });
        }
        if let Some(identity) = peer_of(request).and_then(|p| p.identity.as_ref()).filter(|i| i.role == Role::Admin) {
            return Ok(Principal::Admin { name: format!("certificate {}", identity.name) });
        }
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        self.principal_of_token(token, action, &describe_peer(request))
    }

    /// Whom a bearer token acts for (`None`: no token given), with auth on; `peer` describes the
    /// caller in audit lines. Every refusal is audited. An unknown token on a follower is
    /// `NotLeader`: the follower may not have applied a token the leader just issued.
    pub(crate) fn principal_of_token(
        &self,
        token: Option<&str>,
        action: &str,
        peer: &str,
    ) -> Result<Principal, Status> {
        let security = self.security();
        let deny = |principal: &str, status: Status| {
            security.audit.record(AuditEvent::denied(action, peer.to_string(), principal, status.message()));
            status
        };
        let Some(token) = token.map(str::trim).filter(|t| !t.is_empty()) else {
            return Err(deny(
                "-",
                Status::unauthenticated("authentication required: pass --token or set CORRAL_TOKEN"),
            ));
        };
        let hash = token_sha256(token);
        if security.admin_token_sha256.as_deref() == Some(hash.as_str()) {
            return Ok(Principal::Admin { name: "bootstrap admin token".into() });
        }
        let record = self.store().read().state.token_by_hash(&hash).cloned();
        let Some(record) = record else {
            // A follower may not have applied a token the leader just issued: let the client
            // ask the leader, whose answer is final.
            if !self.is_leader() {
                return Err(self.not_leader().into());
            }
            return Err(deny("-", Status::unauthenticated("invalid token: not issued by this cluster")));
        };
        let who = if record.admin {
            format!("admin token {}", record.id)
        } else {
            format!("tenant {} (token {})", record.tenant, record.id)
        };
        if record.revoked {
            return Err(deny(&who, Status::unauthenticated(format!("token {} was revoked", record.id))));
        }
        if record.expires_at_ms.is_some_and(|at| at <= now_ms()) {
            return Err(deny(&who, Status::unauthenticated(format!("token {} expired", record.id))));
        }
        Ok(if record.admin {
            Principal::Admin { name: format!("token {}", record.id) }
        } else {
            Principal::Tenant { tenant: record.tenant, token_id: record.id }
        })
    }

    /// Refuses (and audits) a non-admin principal.
    pub(crate) fn require_admin<T>(
        &self,
        request: &Request<T>,
        action: &str,
        principal: &Principal,
    ) -> Result<(), Status> {
        if principal.is_admin() {
            return Ok(());
        }
        Err(self.deny(
            request,
            action,
            &principal.describe(),
            Status::permission_denied(format!("permission denied: {action} needs an admin token or certificate")),
        ))
    }

    /// Refuses (and audits) access to a job of another tenant.
    pub(crate) fn require_owner<T>(
        &self,
        request: &Request<T>,
        action: &str,
        verb: &str,
        principal: &Principal,
        job: &corral_types::Job,
    ) -> Result<(), Status> {
        if principal.may_access(&job.spec.tenant) {
            return Ok(());
        }
        let tenant = principal.tenant().unwrap_or_default();
        Err(self.deny(
            request,
            action,
            &principal.describe(),
            Status::permission_denied(format!(
                "permission denied: tenant {tenant} cannot {verb} job {} (owned by another tenant)",
                job.id
            )),
        ))
    }

    /// The worker node a gateway caller's certificate names (`None` without TLS).
    pub(crate) fn worker_identity<T>(&self, request: &Request<T>) -> Option<String> {
        self.security().server_tls.as_ref()?;
        peer_of(request).and_then(|p| p.identity.as_ref()).map(|i| i.name.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hash_is_hex_sha256() {
        assert_eq!(token_sha256("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let secret = new_token_secret();
        assert!(secret.starts_with("crl_") && secret.len() == 68, "{secret}");
        assert_ne!(secret, new_token_secret());
    }

    #[test]
    fn principals_see_only_their_tenant() {
        let a = Principal::Tenant { tenant: "team-a".into(), token_id: 1 };
        assert!(a.may_access("team-a") && !a.may_access("team-b") && !a.is_admin());
        let admin = Principal::Admin { name: "x".into() };
        assert!(admin.may_access("team-b") && admin.is_admin());
    }
}
