//! The server side: a listener whose connections are TLS with a required client certificate
//! signed by the cluster CA (or plaintext, where TLS is off), each tagged with its [`Peer`].
//!
//! Handshakes run in their own tasks, so a slow or hostile client never blocks the accept loop;
//! every refused handshake (no certificate, a foreign CA, a revoked certificate, not TLS at
//! all) is reported to the caller's `on_refused` for the audit log. The server presents its
//! certificate through the daemon's reloadable credentials (a renewed certificate serves new
//! connections).

use crate::credentials::Credentials;
use crate::{identity_of, read, Peer, Revocations, TlsError, TlsFiles};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_stream::Stream;

/// Longest a client may take to complete the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(crate) fn load_certs(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem { path: path.to_path_buf(), what: format!("invalid PEM certificate: {e}") })?;
    if certs.is_empty() {
        return Err(TlsError::Pem { path: path.to_path_buf(), what: "no PEM certificate in the file".into() });
    }
    Ok(certs)
}

pub(crate) fn load_key(path: &std::path::Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| TlsError::Pem { path: path.to_path_buf(), what: format!("no usable PEM private key: {e}") })
}

/// A server's TLS setup: its certificate, the CA every client certificate must chain to, and
/// the revocations a coordinator checks.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: tokio_rustls::TlsAcceptor,
    /// Set once by [`ServerTls::set_revocations`]; shared with the handshake's verifier.
    revocations: Arc<RwLock<Option<Revocations>>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

impl ServerTls {
    /// Serves `files`' certificate followed by the CA (so that a joining worker can check the
    /// CA against its token's pin: see `join`); every client must present a certificate the CA
    /// signed.
    pub fn load(files: &TlsFiles) -> Result<ServerTls, TlsError> {
        ServerTls::build(files, Credentials::load(files)?, false)
    }

    /// Like [`ServerTls::load`], but a client without a certificate completes the handshake
    /// too, as a [`Peer`] without identity whom every role check refuses: only the join service
    /// (which needs no role) serves it. A certificate that is presented must still be the CA's.
    pub fn load_accepting_joins(files: &TlsFiles) -> Result<ServerTls, TlsError> {
        ServerTls::build(files, Credentials::load(files)?, true)
    }

    /// Refuses the client certificates `revocations` names, at the handshake (with the
    /// certificate_revoked alert, which the client reads) and on every later request of a
    /// connection made before (the role guard asks the connection's [`Peer`]). Applies to
    /// every clone of this `ServerTls`.
    pub fn set_revocations(&self, revocations: Revocations) {
        *self.revocations.write().unwrap_or_else(|p| p.into_inner()) = Some(revocations);
    }

    fn revocations(&self) -> Option<Revocations> {
        self.revocations.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn build(
        files: &TlsFiles,
        credentials: Arc<Credentials>,
        accept_without_certificate: bool,
    ) -> Result<ServerTls, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for ca in load_certs(&files.ca)? {
            roots.add(ca).map_err(|e| TlsError::Pem {
                path: files.ca.clone(),
                what: format!("not a usable CA certificate: {e}"),
            })?;
        }
        let mut verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
        if accept_without_certificate {
            verifier = verifier.allow_unauthenticated();
        }
        let verifier = verifier.build().map_err(|e| TlsError::Config(format!("client verifier: {e}")))?;
        let revocations = Arc::new(RwLock::new(None));
        let verifier = Arc::new(RevocationVerifier { inner: verifier, revocations: revocations.clone() });
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(credentials);
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(ServerTls { acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)), revocations })
    }
}

/// The cluster CA's verification of a client certificate, then the revocation check.
#[derive(Debug)]
struct RevocationVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    revocations: Arc<RwLock<Option<Revocations>>>,
}

impl ClientCertVerifier for RevocationVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        let revocations = self.revocations.read().unwrap_or_else(|p| p.into_inner()).clone();
        if let (Some(revocations), Ok(identity)) = (revocations, identity_of(end_entity.as_ref())) {
            if let Some(why) = revocations.check(&identity) {
                tracing::warn!(role = %identity.role, name = %identity.name, reason = %why, "refused a revoked client certificate");
                return Err(rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked));
            }
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A refused connection, for the audit log.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub addr: SocketAddr,
    pub reason: String,
}

/// Turns a rustls handshake error into what an operator reads in the audit log.
fn refusal_reason(e: &io::Error) -> String {
    let text = e.to_string();
    if text.contains("NoCertificatesPresented") || text.contains("peer sent no certificates") {
        "no client certificate".into()
    } else if text.contains("UnknownIssuer") || text.contains("BadSignature") {
        "client certificate not signed by the cluster CA".into()
    } else if text.contains("Revoked") {
        "client certificate revoked".into()
    } else if text.contains("Expired") || text.contains("expired") {
        "client certificate expired".into()
    } else if text.contains("corrupt message") || text.contains("InvalidContentType") {
        "not a TLS client (plaintext connection to a TLS port)".into()
    } else {
        format!("TLS handshake failed: {text}")
    }
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// One accepted connection and who is on the other end.
pub struct Conn {
    io: Io,
    peer: Peer,
}

impl Conn {
    pub fn peer(&self) -> &Peer {
        &self.peer
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// Accepts connections on `listener`: TLS with a verified client certificate when `tls` is
/// set, plaintext otherwise. Refused handshakes go to `on_refused` and are not yielded.
pub fn incoming(
    listener: TcpListener,
    tls: Option<ServerTls>,
    on_refused: Arc<dyn Fn(Refusal) + Send + Sync>,
) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Conn>>(64);
    tokio::spawn(async move {
        loop {
            let (stream, addr) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let _ = stream.set_nodelay(true);
            let Some(tls) = tls.clone() else {
                let conn = Conn {
                    io: Io::Plain(stream),
                    peer: Peer { addr: Some(addr), identity: None, tls: false, certificate: false, revocations: None },
                };
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
                continue;
            };
            let tx = tx.clone();
            let on_refused = on_refused.clone();
            tokio::spawn(async move {
                let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.acceptor.accept(stream)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => return on_refused(Refusal { addr, reason: refusal_reason(&e) }),
                    Err(_) => return on_refused(Refusal { addr, reason: "TLS handshake timed out".into() }),
                };
                let presented = stream.get_ref().1.peer_certificates().and_then(|certs| certs.first());
                let certificate = presented.is_some();
                let identity = presented.map(|cert| identity_of(cert.as_ref()));
                let identity = match identity {
                    Some(Ok(identity)) => Some(identity),
                    Some(Err(reason)) => {
                        // Signed by the CA but without a usable role: connected, but every
                        // service refuses it (and audits the attempt).
                        tracing::warn!(%addr, %reason, "client certificate without a corral role");
                        None
                    }
                    None => None,
                };
                let revocations = tls.revocations();
                let conn = Conn {
                    io: Io::Tls(Box::new(stream)),
                    peer: Peer { addr: Some(addr), identity, tls: true, certificate, revocations },
                };
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
