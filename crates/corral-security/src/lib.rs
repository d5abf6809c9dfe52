//! corral security: mutual TLS with roles carried in certificates, the dev CA generator and the
//! audit log.
//!
//! Every certificate the cluster CA issues carries its role as a subject alternative name URI
//! `corral://role/<role>` (coordinator, worker, client, admin) and its name as the subject CN.
//! Servers accept connections only from certificates the CA signed ([`ServerTls`]; a coordinator
//! that signs joining workers' certificates also lets certificate-less clients in, whom every
//! role check refuses: only its join service answers them, see [`JoinToken`]); each
//! connection's [`Peer`] (role and name) reaches every request, and services check the role.
//! Clients check the server the same way ([`ClientTls`]): a chain to the cluster CA valid for
//! the address, and the role they expect (a coordinator; the named worker's agent), before any
//! request leaves. Certificates live a finite time; a coordinator refuses revoked worker
//! certificates ([`Revocations`]: by node name and issue time, replicated by corral-core).
//! Boundary: the only crate that knows rustls, rcgen and x509-parser.

mod audit;
mod certs;
mod client;
mod connector;
mod credentials;
mod guard;
mod join;
mod server;
pub mod testing;

pub use audit::{AuditEvent, AuditLog};
pub use certs::{expiry_warning, generate_dev_certs, renew_dev_certs, DevCerts, DEFAULT_CERT_DAYS, MAX_CERT_DAYS};
pub use client::{describe_tls_error, ClientTls, ExpectedServer};
pub use guard::{audited_incoming, RoleGuard};
pub use join::{
    check_issued, check_renewed, pinned_channel, renewal_request, worker_request, CaPin, ClusterCa, JoinToken,
    PinnedCaVerifier, VerifiedRequest, WorkerRequest, DEFAULT_WORKER_CERT_LIFETIME, PIN_MISMATCH,
};
pub use server::{incoming, Conn, Refusal, ServerTls};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How far before its issue a certificate corral issues is valid (its notBefore), so that a
/// peer whose clock lags a little accepts it at once. A certificate's issue time is its
/// notBefore plus this ([`PeerIdentity::issued_at_s`]).
pub const CERT_BACKDATE: Duration = Duration::from_secs(5 * 60);

/// Prefix of the SAN URI that carries a certificate's role.
pub const ROLE_URI_PREFIX: &str = "corral://role/";

/// What a certificate entitles its holder to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// A Raft member: Raft RPCs, cluster admin, the worker agent's log stream.
    Coordinator,
    /// A worker daemon: the worker gateway only.
    Worker,
    /// A user client: the user API, with a tenant token.
    Client,
    /// An operator client: the user API as admin (no token needed) and cluster admin.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Coordinator => "coordinator",
            Role::Worker => "worker",
            Role::Client => "client",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "coordinator" => Some(Role::Coordinator),
            "worker" => Some(Role::Worker),
            "client" => Some(Role::Client),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    /// The SAN URI naming this role.
    pub fn uri(self) -> String {
        format!("{ROLE_URI_PREFIX}{}", self.as_str())
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// PEM files of one party: the cluster CA it trusts, and its own certificate and key. Also the
/// `[tls]` section of the coordinator's and the worker's config files (`corral certs init`
/// writes the files).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TlsFiles {
    /// The cluster CA: peers must present certificates it signed.
    pub ca: PathBuf,
    /// Our certificate (its role must match the daemon).
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// Checks the section of a config file; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        for (key, path) in [("tls.ca", &self.ca), ("tls.cert", &self.cert), ("tls.key", &self.key)] {
            if path.as_os_str().is_empty() {
                return Err(format!("{key}: must not be empty"));
            }
        }
        Ok(())
    }

    /// Loads the files of a daemon whose certificate must carry `role`: what it serves with
    /// and what it calls others with. Both present the same certificate:
    /// [`ClientTls::reload`] replaces it in both.
    pub fn load_for(&self, role: Role) -> Result<(ServerTls, ClientTls), TlsError> {
        self.load_daemon(role, false)
    }

    /// Like [`TlsFiles::load_for`], with a server that also lets clients without a certificate
    /// complete the handshake (a coordinator that signs joining workers' certificates); every
    /// role check still refuses them.
    pub fn load_accepting_joins(&self, role: Role) -> Result<(ServerTls, ClientTls), TlsError> {
        self.load_daemon(role, true)
    }

    fn load_daemon(&self, role: Role, accept_joins: bool) -> Result<(ServerTls, ClientTls), TlsError> {
        let identity = certificate_identity(&self.cert)?;
        if identity.role != role {
            return Err(TlsError::WrongRole { path: self.cert.clone(), found: identity.role, needed: role });
        }
        let credentials = credentials::Credentials::load(self)?;
        let server = ServerTls::build(self, credentials.clone(), accept_joins)?;
        Ok((server, ClientTls::with_credentials(self, credentials)?))
    }
}

/// Who holds a verified certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    pub role: Role,
    /// The subject common name (a node name, "admin", a client name).
    pub name: String,
    /// The certificate's validity, in seconds since the Unix epoch.
    pub not_before_s: u64,
    pub not_after_s: u64,
}

impl PeerIdentity {
    /// When the certificate was issued, in seconds since the Unix epoch: its notBefore plus
    /// the backdate every certificate corral issues carries ([`CERT_BACKDATE`]).
    pub fn issued_at_s(&self) -> u64 {
        self.not_before_s.saturating_add(CERT_BACKDATE.as_secs())
    }
}

/// Which verified client certificates a server refuses although the CA signed them (on a
/// coordinator: worker certificates of a removed node, issued before its removal). `check`
/// answers why a certificate is refused, or `None`.
#[derive(Clone)]
pub struct Revocations(Arc<RevocationCheck>);

/// Why a certificate is refused, or `None`.
type RevocationCheck = dyn Fn(&PeerIdentity) -> Option<String> + Send + Sync;

impl Revocations {
    pub fn new(check: impl Fn(&PeerIdentity) -> Option<String> + Send + Sync + 'static) -> Revocations {
        Revocations(Arc::new(check))
    }

    /// Why `identity` is refused, if it is.
    pub fn check(&self, identity: &PeerIdentity) -> Option<String> {
        (self.0)(identity)
    }
}

impl std::fmt::Debug for Revocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Revocations")
    }
}

/// Two peers are alike whatever revocation check their server applies.
impl PartialEq for Revocations {
    fn eq(&self, _: &Revocations) -> bool {
        true
    }
}

impl Eq for Revocations {}

/// The other end of a server connection, attached to every request it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub addr: Option<SocketAddr>,
    /// Over TLS: the verified client certificate's identity (`None` for a plaintext connection,
    /// or a CA-signed certificate without a valid role).
    pub identity: Option<PeerIdentity>,
    pub tls: bool,
    /// The client presented a certificate the CA signed (false: plaintext, or a TLS client
    /// without a certificate on a server that accepts joins).
    pub certificate: bool,
    /// The server's revocation check, asked again on every request: a certificate revoked
    /// after the connection was made is refused from then on.
    pub revocations: Option<Revocations>,
}

impl Peer {
    pub fn role(&self) -> Option<Role> {
        self.identity.as_ref().map(|i| i.role)
    }

    /// Why this peer's certificate is refused now, if it is (see [`Revocations`]).
    pub fn revoked(&self) -> Option<String> {
        self.revocations.as_ref()?.check(self.identity.as_ref()?)
    }

    /// "worker w1 at 127.0.0.1:4242", for audit lines and errors.
    pub fn describe(&self) -> String {
        let addr = self.addr.map(|a| a.to_string()).unwrap_or_else(|| "unknown address".into());
        match &self.identity {
            Some(i) => format!("{} {} at {addr}", i.role, i.name),
            None if self.tls && !self.certificate => format!("peer without a client certificate at {addr}"),
            None if self.tls => format!("certificate without a corral role at {addr}"),
            None => format!("plaintext peer at {addr}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("TLS: {0}")]
    Config(String),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot generate certificates: {0}")]
    Generate(String),
    #[error("tls.cert: {} is a {found} certificate; this daemon needs a {needed} certificate", path.display())]
    WrongRole { path: PathBuf, found: Role, needed: Role },
}

/// The role and name a certificate (DER) carries.
pub fn identity_of(cert_der: &[u8]) -> Result<PeerIdentity, String> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(cert_der).map_err(|e| format!("unreadable certificate: {e}"))?;
    let name = cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).unwrap_or_default().to_string();
    let san = cert.subject_alternative_name().map_err(|e| format!("bad subject alternative names: {e}"))?;
    let mut roles = san.into_iter().flat_map(|s| s.value.general_names.iter()).filter_map(|g| match g {
        x509_parser::extensions::GeneralName::URI(uri) => uri.strip_prefix(ROLE_URI_PREFIX),
        _ => None,
    });
    let role = roles.next().ok_or("certificate carries no corral://role/ URI")?;
    if roles.next().is_some() {
        return Err("certificate carries more than one corral role".into());
    }
    let role = Role::parse(role).ok_or_else(|| format!("unknown role '{role}' in certificate"))?;
    let validity = cert.validity();
    let seconds = |t: &x509_parser::time::ASN1Time| u64::try_from(t.timestamp()).unwrap_or(0);
    Ok(PeerIdentity {
        role,
        name,
        not_before_s: seconds(&validity.not_before),
        not_after_s: seconds(&validity.not_after),
    })
}

/// The role and name of the (first) certificate in a PEM file.
pub fn certificate_identity(path: &std::path::Path) -> Result<PeerIdentity, TlsError> {
    let certs = server::load_certs(path)?;
    identity_of(certs[0].as_ref()).map_err(|what| TlsError::Pem { path: path.to_path_buf(), what })
}

/// Reads a whole file, naming it on error.
pub(crate) fn read(path: &std::path::Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}
