//! The client side: channels that present our certificate, trust only the cluster CA and
//! require the server to hold the role the caller expects, and readable messages for TLS
//! failures.
//!
//! A CA-signed certificate valid for the address is not enough: a worker certificate is
//! signed by the same CA, so a worker (or whoever stole its key) listening on a coordinator's
//! address would otherwise receive the CLI's requests, bearer token included. The verifier
//! ([`RoleVerifier`]) first does the usual chain and name verification against the cluster CA,
//! then checks the role (and, for a worker agent, the node name) the end-entity certificate
//! carries; a mismatch fails the handshake, before any request is written.

use crate::connector::TlsConnector;
use crate::credentials::Credentials;
use crate::{identity_of, Role, TlsError, TlsFiles};
use std::sync::Arc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::rustls::{CertificateError, DigitallySignedStruct, OtherError, SignatureScheme};

/// Who a client requires at the other end, besides a certificate of the cluster CA valid for
/// the address it dialled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpectedServer {
    /// A coordinator (the CLI, the Rust and Python clients, workers, Raft peers).
    Coordinator,
    /// The agent of worker `node` (a coordinator reading job logs).
    Worker { node: String },
}

impl ExpectedServer {
    /// Why `presented` is not the expected server, in words that follow "the server at ADDR ".
    fn mismatch(&self, presented: &crate::PeerIdentity) -> Option<String> {
        let (role, node) = match self {
            ExpectedServer::Coordinator => (Role::Coordinator, None),
            ExpectedServer::Worker { node } => (Role::Worker, Some(node)),
        };
        if presented.role != role {
            return Some(format!("presented a certificate with role {}, not {role}", presented.role));
        }
        match node {
            Some(node) if presented.name != *node => {
                Some(format!("presented the certificate of worker {}, not of worker {node}", presented.name))
            }
            _ => None,
        }
    }
}

/// What every refusal of [`RoleVerifier`] says after the server's address: found in error
/// chains by [`describe_tls_error`].
const PRESENTED: &str = " presented ";

/// A server that is not the one the client expects: the line the user reads.
#[derive(Debug)]
struct WrongServer(String);

impl std::fmt::Display for WrongServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WrongServer {}

/// The cluster CA's chain and name verification, then the role check (see the module docs).
#[derive(Debug)]
struct RoleVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    expect: ExpectedServer,
    /// The address dialled, for the refusal.
    addr: String,
}

impl ServerCertVerifier for RoleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        let mismatch = match identity_of(end_entity.as_ref()) {
            Ok(identity) => self.expect.mismatch(&identity),
            Err(e) => Some(format!("presented a certificate without a usable corral role ({e})")),
        };
        match mismatch {
            None => Ok(verified),
            Some(why) => {
                let line = format!("the server at {} {why}", self.addr);
                Err(rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(WrongServer(line))))))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// A client's TLS: the cluster CA it trusts and the certificate it presents. Cheap to clone;
/// clones share the certificate, which [`ClientTls::reload`] replaces.
#[derive(Clone)]
pub struct ClientTls {
    webpki: Arc<WebPkiServerVerifier>,
    credentials: Arc<Credentials>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("credentials", &self.credentials).finish_non_exhaustive()
    }
}

impl ClientTls {
    /// From PEM files (CA, our certificate, our key), all read and checked now, so that a bad
    /// file is reported at startup and not as a connection error later.
    pub fn load(files: &TlsFiles) -> Result<ClientTls, TlsError> {
        ClientTls::with_credentials(files, Credentials::load(files)?)
    }

    pub(crate) fn with_credentials(files: &TlsFiles, credentials: Arc<Credentials>) -> Result<ClientTls, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for ca in crate::server::load_certs(&files.ca)? {
            roots.add(ca).map_err(|e| TlsError::Pem {
                path: files.ca.clone(),
                what: format!("not a usable CA certificate: {e}"),
            })?;
        }
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), crate::server::provider())
            .build()
            .map_err(|e| TlsError::Config(format!("server verifier: {e}")))?;
        Ok(ClientTls { webpki, credentials })
    }

    /// Reads our certificate and key files again: connections made from now on (by this
    /// client and by the server loaded with it, see [`TlsFiles::load_for`]) present them.
    pub fn reload(&self) -> Result<(), TlsError> {
        self.credentials.reload()
    }

    fn connector(&self, addr: &str, expect: ExpectedServer) -> Result<TlsConnector, String> {
        let verifier = RoleVerifier { webpki: self.webpki.clone(), expect, addr: addr.to_string() };
        let config = rustls::ClientConfig::builder_with_provider(crate::server::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_cert_resolver(self.credentials.clone());
        TlsConnector::new(addr, config)
    }

    /// Connects to `addr` (host:port), which must be `expect`. `endpoint` carries the caller's
    /// timeouts and must be `http://` (the connector does the TLS). A failure is one readable
    /// line (see [`describe_tls_error`]).
    pub async fn connect(
        &self,
        endpoint: tonic::transport::Endpoint,
        addr: &str,
        expect: ExpectedServer,
    ) -> Result<tonic::transport::Channel, String> {
        self.connector(addr, expect)?.channel(endpoint).await
    }

    /// Like [`ClientTls::connect`], connecting at the first call (and again after a broken
    /// connection, each time with the same checks).
    pub fn connect_lazy(
        &self,
        endpoint: tonic::transport::Endpoint,
        addr: &str,
        expect: ExpectedServer,
    ) -> Result<tonic::transport::Channel, String> {
        Ok(self.connector(addr, expect)?.channel_lazy(endpoint))
    }
}

/// A one-line explanation of a TLS failure seen by a client, or `None` if `error` (an error
/// chain rendered as text) is not about TLS.
pub fn describe_tls_error(error: &str) -> Option<String> {
    // The role check names the server and what it presented (see `RoleVerifier`); rustls
    // renders it inside its own error, possibly quoted.
    if let Some(start) = error.find("the server at ") {
        let line = &error[start..];
        let end = [line.find(": "), line.find('"')].into_iter().flatten().min();
        let line = &line[..end.unwrap_or(line.len())];
        if line.contains(PRESENTED) {
            return Some(format!("TLS: {line}"));
        }
    }
    let renew = "renew it (`corral certs renew`, or a worker joins again with a new token)";
    let known = [
        (
            crate::PIN_MISMATCH,
            "TLS: the coordinator's CA is not the one the join token names (check --join and --token)".to_string(),
        ),
        ("not a coordinator's", "TLS: the server at --join is not a coordinator of this cluster".into()),
        ("UnknownIssuer", "TLS: server certificate not signed by the configured CA (check --ca)".into()),
        ("BadSignature", "TLS: server certificate not signed by the configured CA (check --ca)".into()),
        ("DecryptError", "TLS: the server refused our client certificate: not signed by its CA".into()),
        ("NotValidForName", "TLS: server certificate is not valid for this address (check --endpoint)".into()),
        ("not valid for name", "TLS: server certificate is not valid for this address (check --endpoint)".into()),
        ("CertificateRequired", "TLS: the server requires a client certificate (pass --cert and --key)".into()),
        ("UnknownCA", "TLS: the server refused our client certificate: not signed by its CA".into()),
        (
            "CertificateRevoked",
            "TLS: the server refused our client certificate: it was revoked (`corral node remove`); a worker joins again with a new token".into(),
        ),
        ("CertificateExpired", format!("TLS: the server refused our client certificate: it expired; {renew}")),
        ("BadCertificate", "TLS: the server refused our client certificate".into()),
        ("certificate expired", format!("TLS: the server's certificate expired; {renew}")),
        ("certificate not valid yet", "TLS: the server's certificate is not valid yet (check the clocks)".into()),
        ("CertExpired", "TLS: certificate expired".into()),
        ("Expired", "TLS: certificate expired".into()),
        (
            "InvalidContentType",
            "TLS: the server does not speak TLS (drop --ca/--cert/--key for a plaintext server)".into(),
        ),
        ("corrupt message", "TLS: the server does not speak TLS (drop --ca/--cert/--key for a plaintext server)".into()),
    ];
    known.into_iter().find(|(needle, _)| error.contains(needle)).map(|(_, message)| message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{generate_dev_certs, DevCerts};
    use std::path::Path;
    use tokio_rustls::rustls::pki_types::pem::PemObject;

    fn der(path: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(path).expect("pem")
    }

    fn files(dir: &Path, name: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}-key.pem")),
        }
    }

    fn verify(tls: &ClientTls, expect: ExpectedServer, presented: &Path) -> Result<(), String> {
        let verifier = RoleVerifier { webpki: tls.webpki.clone(), expect, addr: "127.0.0.1:7070".into() };
        let name = ServerName::try_from("127.0.0.1").expect("name");
        verifier.verify_server_cert(&der(presented), &[], &name, &[], UnixTime::now()).map(|_| ()).map_err(|e| {
            let chain = e.to_string();
            describe_tls_error(&chain).unwrap_or(chain)
        })
    }

    #[test]
    fn a_client_accepts_only_the_role_it_expects() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = DevCerts { coordinators: 1, workers: vec!["w1".into(), "w2".into()], ..Default::default() };
        generate_dev_certs(dir.path(), &spec).expect("certs");
        let tls = ClientTls::load(&files(dir.path(), "admin")).expect("client tls");
        let coordinator = dir.path().join("coordinator-1.pem");
        let w1 = dir.path().join("worker-w1.pem");
        verify(&tls, ExpectedServer::Coordinator, &coordinator).expect("a coordinator");
        assert_eq!(
            verify(&tls, ExpectedServer::Coordinator, &w1).expect_err("a worker"),
            "TLS: the server at 127.0.0.1:7070 presented a certificate with role worker, not coordinator"
        );
        let expect_w1 = || ExpectedServer::Worker { node: "w1".into() };
        verify(&tls, expect_w1(), &w1).expect("worker w1");
        assert_eq!(
            verify(&tls, expect_w1(), &dir.path().join("worker-w2.pem")).expect_err("another worker"),
            "TLS: the server at 127.0.0.1:7070 presented the certificate of worker w2, not of worker w1"
        );
        assert_eq!(
            verify(&tls, expect_w1(), &coordinator).expect_err("a coordinator"),
            "TLS: the server at 127.0.0.1:7070 presented a certificate with role coordinator, not worker"
        );
        // The chain is still checked first: another cluster's coordinator is refused as such.
        let other = tempfile::tempdir().expect("tempdir");
        generate_dev_certs(other.path(), &spec).expect("certs");
        let foreign = verify(&tls, ExpectedServer::Coordinator, &other.path().join("coordinator-1.pem"));
        assert!(foreign.expect_err("foreign").contains("not signed by the configured CA"));
    }

    #[test]
    fn tls_failures_read_as_one_line() {
        let role = "transport error: error trying to connect: invalid peer certificate: the server at [::1]:7070 presented a certificate with role worker, not coordinator: the server at [::1]:7070 presented a certificate with role worker, not coordinator";
        assert_eq!(
            describe_tls_error(role).as_deref(),
            Some("TLS: the server at [::1]:7070 presented a certificate with role worker, not coordinator")
        );
        let expired = "invalid peer certificate: certificate expired: verification time 2 (UNIX), but certificate is not valid after 1 (1 seconds ago)";
        assert!(describe_tls_error(expired).expect("expired").starts_with("TLS: the server's certificate expired"));
        let revoked = "h2 protocol error: received fatal alert: CertificateRevoked";
        assert!(describe_tls_error(revoked).expect("revoked").contains("it was revoked"));
        assert_eq!(describe_tls_error("connection refused"), None);
    }

    #[test]
    fn nothing_is_sent_to_a_server_with_the_wrong_role() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = DevCerts { coordinators: 1, workers: vec!["w1".into()], ..Default::default() };
        generate_dev_certs(dir.path(), &spec).expect("certs");
        let impostor = crate::testing::Impostor::start(&files(dir.path(), "worker-w1")).expect("impostor");
        let addr = impostor.addr().to_string();
        let tls = ClientTls::load(&files(dir.path(), "admin")).expect("client tls");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let err = runtime.block_on(async {
            let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).expect("endpoint");
            tls.connect(endpoint, &addr, ExpectedServer::Coordinator).await.expect_err("refused")
        });
        assert_eq!(err, format!("TLS: the server at {addr} presented a certificate with role worker, not coordinator"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while impostor.seen().refusals.is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let seen = impostor.seen();
        assert_eq!((seen.handshakes, seen.received.len()), (0, 0), "{seen:?}");
        assert!(seen.refusals[0].contains("alert"), "{seen:?}");
    }
}
