//! What every corral server does with its callers: accept connections through the audited TLS
//! acceptor, and let each service through only the certificate roles it serves, auditing every
//! refusal the same way.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_stream::Stream;
use tonic::{Request, Status};

use crate::{incoming, AuditEvent, AuditLog, Conn, Peer, Refusal, Role, ServerTls};

/// Accepts connections on `listener` (TLS when `tls` is set), recording every refused
/// handshake in `audit` as a `tls-handshake` denial.
pub fn audited_incoming(
    listener: TcpListener,
    tls: Option<ServerTls>,
    audit: Arc<AuditLog>,
) -> impl Stream<Item = std::io::Result<Conn>> + Send + 'static {
    let on_refused = Arc::new(move |r: Refusal| {
        audit.record(AuditEvent::denied("tls-handshake", r.addr.to_string(), "-", r.reason));
    });
    incoming(listener, tls, on_refused)
}

/// The role check of one gRPC service, for a tonic interceptor: over TLS only certificates of
/// the allowed roles pass; every refusal is audited. Plaintext servers let everyone in.
#[derive(Clone)]
pub struct RoleGuard {
    service: &'static str,
    allowed: &'static [Role],
    /// Said after the refusal, e.g. why only those roles may call.
    hint: Option<&'static str>,
    tls: bool,
    audit: Arc<AuditLog>,
}

impl RoleGuard {
    /// A guard for `service` (named in refusals: "the {service} service").
    pub fn new(service: &'static str, allowed: &'static [Role], tls: bool, audit: Arc<AuditLog>) -> RoleGuard {
        RoleGuard { service, allowed, hint: None, tls, audit }
    }

    /// Adds why the service is restricted to the refusal message.
    pub fn with_hint(mut self, hint: &'static str) -> RoleGuard {
        self.hint = Some(hint);
        self
    }

    /// Lets `request` through, or refuses it with PERMISSION_DENIED and an audit record.
    #[allow(clippy::result_large_err)]
    pub fn check(&self, request: Request<()>) -> Result<Request<()>, Status> {
        if !self.tls {
            return Ok(request);
        }
        let peer = request.extensions().get::<Peer>();
        let role = peer.and_then(Peer::role);
        let revoked = peer.and_then(Peer::revoked);
        if role.is_some_and(|r| self.allowed.contains(&r)) && revoked.is_none() {
            return Ok(request);
        }
        let mut detail = match (role, revoked) {
            (Some(role), Some(why)) => {
                format!("a revoked {role} certificate cannot call the {} service: {why}", self.service)
            }
            (role, _) => self.refusal(role, peer),
        };
        if let Some(hint) = self.hint {
            detail = format!("{detail}: {hint}");
        }
        let who = peer.map(Peer::describe).unwrap_or_else(|| "unknown peer".into());
        self.audit.record(AuditEvent::denied(format!("{} service", self.service), who, "-", detail.clone()));
        Err(Status::permission_denied(format!("permission denied: {detail}")))
    }

    /// Why a peer with `role` (none: no usable certificate) may not call this service.
    fn refusal(&self, role: Option<Role>, peer: Option<&Peer>) -> String {
        match role {
            Some(role) => format!("{} {role} certificate cannot call the {} service", article(role), self.service),
            None if peer.is_some_and(|p| !p.certificate) => {
                format!("a peer without a client certificate cannot call the {} service", self.service)
            }
            None => format!("a certificate without a corral role cannot call the {} service", self.service),
        }
    }
}

/// "an admin", "a worker".
fn article(role: Role) -> &'static str {
    if role.as_str().starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PeerIdentity;

    fn request(role: Option<Role>) -> Request<()> {
        let mut request = Request::new(());
        request.extensions_mut().insert(Peer {
            addr: "127.0.0.1:4242".parse().ok(),
            tls: true,
            identity: role.map(|role| PeerIdentity { role, name: "w1".into(), not_before_s: 0, not_after_s: 0 }),
            certificate: true,
            revocations: None,
        });
        request
    }

    #[test]
    fn only_allowed_roles_pass_and_refusals_are_audited() {
        let dir = tempfile::tempdir().expect("tempdir");
        let audit = Arc::new(AuditLog::in_dir(dir.path()));
        let guard = RoleGuard::new("raft", &[Role::Coordinator], true, audit.clone());
        assert!(guard.check(request(Some(Role::Coordinator))).is_ok());
        let refused = guard.check(request(Some(Role::Worker))).expect_err("a worker");
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert_eq!(refused.message(), "permission denied: a worker certificate cannot call the raft service");
        let admin = guard.check(request(Some(Role::Admin))).expect_err("an admin");
        assert_eq!(admin.message(), "permission denied: an admin certificate cannot call the raft service");
        let anonymous = guard.with_hint("only coordinators replicate").check(request(None)).expect_err("no role");
        assert!(anonymous.message().ends_with("cannot call the raft service: only coordinators replicate"));
        let log = std::fs::read_to_string(dir.path().join("audit.jsonl")).expect("audit log");
        assert_eq!(log.lines().count(), 3, "{log}");
        assert!(log.contains("worker w1 at 127.0.0.1:4242"), "{log}");

        // A TLS client without a certificate (let in by a coordinator that accepts joins).
        let mut anonymous = Request::new(());
        anonymous.extensions_mut().insert(Peer {
            addr: "127.0.0.1:4243".parse().ok(),
            tls: true,
            identity: None,
            certificate: false,
            revocations: None,
        });
        let refused = RoleGuard::new("user API", &[Role::Client, Role::Admin], true, audit.clone())
            .check(anonymous)
            .expect_err("no certificate");
        assert_eq!(
            refused.message(),
            "permission denied: a peer without a client certificate cannot call the user API service"
        );
        let log = std::fs::read_to_string(dir.path().join("audit.jsonl")).expect("audit log");
        assert!(log.contains("peer without a client certificate at 127.0.0.1:4243"), "{log}");

        let plaintext = RoleGuard::new("raft", &[Role::Coordinator], false, audit);
        assert!(plaintext.check(Request::new(())).is_ok());
    }

    #[test]
    fn a_certificate_revoked_after_the_handshake_is_refused_on_its_next_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let audit = Arc::new(AuditLog::in_dir(dir.path()));
        let guard = RoleGuard::new("worker gateway", &[Role::Worker], true, audit);
        let revoked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = revoked.clone();
        let revocations = crate::Revocations::new(move |identity| {
            flag.load(std::sync::atomic::Ordering::SeqCst).then(|| format!("node {} was removed", identity.name))
        });
        let request = || {
            let mut request = request(Some(Role::Worker));
            if let Some(peer) = request.extensions_mut().get_mut::<Peer>() {
                peer.revocations = Some(revocations.clone());
            }
            request
        };
        assert!(guard.check(request()).is_ok());
        revoked.store(true, std::sync::atomic::Ordering::SeqCst);
        let refused = guard.check(request()).expect_err("revoked");
        assert_eq!(
            refused.message(),
            "permission denied: a revoked worker certificate cannot call the worker gateway service: node w1 was removed"
        );
    }
}
