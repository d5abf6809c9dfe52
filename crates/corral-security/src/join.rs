//! Joining a worker with a single-use token: the token string, the CA pin it carries, the
//! worker's key and certificate request, the coordinator's signing of worker certificates with
//! the cluster CA key, and the pinned TLS connection a joining worker talks over.
//!
//! How a worker that has no CA yet knows it talks to the real cluster (as kubeadm's discovery
//! hash): the token `crlj1.<secret>.<sha256 of the CA certificate>` carries the SHA-256 of the
//! cluster CA certificate (DER). Every coordinator sends the CA certificate after its own in
//! the TLS chain ([`crate::ServerTls`]). The joining worker's verifier ([`PinnedCaVerifier`])
//! takes from that chain the certificate whose hash equals the pin, and only then verifies the
//! server chain against it as the one trust anchor (signature, validity, the address as a
//! server name) and checks that the server certificate carries the coordinator role. A server
//! that does not hold a certificate issued by the pinned CA fails the handshake, so the secret
//! is never sent to it. The worker keeps its private key: it sends a certificate request (CSR,
//! whose signature proves it holds the key) and stores the certificate the coordinator returns,
//! with the CA whose hash it checked against the pin.

use crate::{identity_of, Role, TlsError};
use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData, SanType,
};
use sha2::{Digest, Sha256};
use std::future::Future;
use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, CertificateSigningRequestDer, ServerName, UnixTime};
use tokio_rustls::rustls::{DigitallySignedStruct, SignatureScheme};

/// Prefix (and format version) of a join token.
const TOKEN_PREFIX: &str = "crlj1";
/// Most host names and addresses a joining worker's certificate may be valid for.
const MAX_WORKER_HOSTS: usize = 16;
/// What the verifier says when the coordinator's CA is not the token's: found in error chains.
pub const PIN_MISMATCH: &str = "the coordinator's CA certificate does not match the join token's CA hash";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The SHA-256 of a CA certificate (DER): what a join token pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaPin([u8; 32]);

impl CaPin {
    pub fn of_der(der: &[u8]) -> CaPin {
        CaPin(Sha256::digest(der).into())
    }

    /// The pin of the first certificate in a PEM text.
    pub fn of_pem(pem: &str) -> Result<CaPin, String> {
        let der =
            CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| format!("invalid PEM certificate: {e}"))?;
        Ok(CaPin::of_der(der.as_ref()))
    }

    /// The pin of the (first) CA certificate in a PEM file.
    pub fn of_file(path: &Path) -> Result<CaPin, TlsError> {
        let certs = crate::server::load_certs(path)?;
        Ok(CaPin::of_der(certs[0].as_ref()))
    }

    /// 64 lower-case hex digits.
    pub fn to_hex(self) -> String {
        hex(&self.0)
    }

    fn from_hex(s: &str) -> Option<CaPin> {
        if !is_hex64(s) {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(CaPin(out))
    }
}

/// A join token: the secret the coordinators know by its hash, and the CA the worker pins.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    secret: String,
    ca: CaPin,
}

impl std::fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinToken").field("ca", &self.ca.to_hex()).finish_non_exhaustive()
    }
}

impl std::fmt::Display for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{TOKEN_PREFIX}.{}.{}", self.secret, self.ca.to_hex())
    }
}

impl JoinToken {
    /// A token for `secret` (64 lower-case hex digits) pinning `ca`.
    pub fn new(secret: String, ca: CaPin) -> Result<JoinToken, String> {
        if !is_hex64(&secret) {
            return Err("a join token secret is 64 lower-case hex digits".into());
        }
        Ok(JoinToken { secret, ca })
    }

    /// Reads a token as `corral node join-token` printed it.
    pub fn parse(text: &str) -> Result<JoinToken, String> {
        let bad = || {
            "--token: not a join token (expected crlj1.<secret>.<ca hash>, as `corral node join-token` prints it)"
                .to_string()
        };
        let mut parts = text.trim().split('.');
        let (Some(TOKEN_PREFIX), Some(secret), Some(ca), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let ca = CaPin::from_hex(ca).ok_or_else(bad)?;
        JoinToken::new(secret.to_string(), ca).map_err(|_| bad())
    }

    /// What the coordinators check (by its SHA-256).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    pub fn ca(&self) -> CaPin {
        self.ca
    }
}

/// A joining worker's new key and its certificate request.
pub struct WorkerRequest {
    /// The private key (PEM): it never leaves the worker.
    pub key_pem: String,
    /// The certificate request (DER) sent to the coordinators.
    pub csr_der: Vec<u8>,
}

/// Makes a key for worker `node` and a request for a certificate with that name, valid as a
/// server for `hosts` (the address the coordinators reach its agent at).
pub fn worker_request(node: &str, hosts: &[String]) -> Result<WorkerRequest, TlsError> {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, node);
    for host in hosts.iter().take(MAX_WORKER_HOSTS) {
        params.subject_alt_names.push(crate::certs::san(host)?);
    }
    let key = KeyPair::generate().map_err(crate::certs::gen_err)?;
    let csr = params.serialize_request(&key).map_err(crate::certs::gen_err)?;
    Ok(WorkerRequest { key_pem: key.serialize_pem(), csr_der: csr.der().to_vec() })
}

/// A verified certificate request of a joining worker.
pub struct VerifiedRequest {
    params: CertificateSigningRequestParams,
    node: String,
    hosts: Vec<SanType>,
}

impl VerifiedRequest {
    /// Parses `csr_der` and checks its signature (the sender holds the key): the node name is
    /// its subject CN; DNS names and IP addresses it asks for are kept as server names.
    pub fn parse(csr_der: &[u8]) -> Result<VerifiedRequest, String> {
        let params = CertificateSigningRequestParams::from_der(&CertificateSigningRequestDer::from(csr_der))
            .map_err(|e| format!("unusable certificate request: {e}"))?;
        let node = params
            .params
            .distinguished_name
            .get(&DnType::CommonName)
            .map(dn_text)
            .filter(|n| !n.is_empty())
            .ok_or("the certificate request names no node (subject CN)")?;
        let hosts: Vec<SanType> = params
            .params
            .subject_alt_names
            .iter()
            .filter(|s| matches!(s, SanType::DnsName(_) | SanType::IpAddress(_)))
            .take(MAX_WORKER_HOSTS)
            .cloned()
            .collect();
        Ok(VerifiedRequest { params, node, hosts })
    }

    /// The node name the worker asks for.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Lower-case hex SHA-256 of the public key to certify.
    pub fn public_key_sha256(&self) -> String {
        hex(&Sha256::digest(self.params.public_key.der_bytes()))
    }
}

fn dn_text(v: &rcgen::DnValue) -> String {
    match v {
        rcgen::DnValue::Utf8String(s) => s.clone(),
        rcgen::DnValue::PrintableString(s) => s.as_str().to_string(),
        rcgen::DnValue::Ia5String(s) => s.as_str().to_string(),
        rcgen::DnValue::TeletexString(s) => s.as_str().to_string(),
        _ => String::new(),
    }
}

/// The cluster CA with its key, on coordinators that sign joining workers' certificates
/// (`tls.ca-key`).
pub struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    ca_pem: String,
    pin: CaPin,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").field("pin", &self.pin.to_hex()).finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// Loads the CA certificate (the first of `ca`) and its key; refuses a key that is not the
    /// certificate's.
    pub fn load(ca: &Path, ca_key: &Path) -> Result<ClusterCa, TlsError> {
        let der = crate::server::load_certs(ca)?.remove(0);
        let key_pem = String::from_utf8(crate::read(ca_key)?)
            .map_err(|_| TlsError::Pem { path: ca_key.to_path_buf(), what: "not a PEM text file".into() })?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| TlsError::Pem {
            path: ca_key.to_path_buf(),
            what: format!("no usable PEM private key: {e}"),
        })?;
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
            .map_err(|e| TlsError::Pem { path: ca.to_path_buf(), what: format!("unreadable certificate: {e}") })?;
        if cert.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(TlsError::Pem {
                path: ca_key.to_path_buf(),
                what: format!("tls.ca-key is not the key of the CA certificate {}", ca.display()),
            });
        }
        let issuer = Issuer::from_ca_cert_der(&der, key)
            .map_err(|e| TlsError::Pem { path: ca.to_path_buf(), what: format!("not a usable CA certificate: {e}") })?;
        let ca_pem = String::from_utf8_lossy(&crate::read(ca)?).into_owned();
        Ok(ClusterCa { issuer, ca_pem, pin: CaPin::of_der(der.as_ref()) })
    }

    pub fn pin(&self) -> CaPin {
        self.pin
    }

    /// The CA certificate(s), PEM, as the worker stores them.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A worker certificate for `request`: role worker, the node name as CN and server name,
    /// the host names it asked for. Nothing else the request asks for is granted.
    pub fn sign_worker(&self, request: &VerifiedRequest) -> Result<String, TlsError> {
        let role = Role::Worker;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, request.node.as_str());
        params.distinguished_name.push(DnType::OrganizationalUnitName, role.as_str());
        params.subject_alt_names.push(SanType::URI(role.uri().try_into().map_err(crate::certs::gen_err)?));
        if let Ok(san) = crate::certs::san(&request.node) {
            params.subject_alt_names.push(san);
        }
        for host in &request.hosts {
            if !params.subject_alt_names.contains(host) {
                params.subject_alt_names.push(host.clone());
            }
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&request.params.public_key, &self.issuer).map_err(crate::certs::gen_err)?;
        Ok(cert.pem())
    }
}

/// Checks what a coordinator returned to a joining worker: the CA is the pinned one and the
/// certificate is a worker certificate for `node`.
pub fn check_issued(cert_pem: &str, ca_pem: &str, node: &str, pin: CaPin) -> Result<(), String> {
    if CaPin::of_pem(ca_pem)? != pin {
        return Err(PIN_MISMATCH.into());
    }
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| format!("invalid certificate: {e}"))?;
    let identity = identity_of(der.as_ref())?;
    if identity.role != Role::Worker || identity.name != node {
        return Err(format!(
            "the coordinator issued a {} certificate for '{}', not a worker certificate for '{node}'",
            identity.role, identity.name
        ));
    }
    Ok(())
}

/// Verifies a coordinator's chain against the CA the join token pins (see the module docs).
#[derive(Debug)]
pub struct PinnedCaVerifier {
    pin: CaPin,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl PinnedCaVerifier {
    pub fn new(pin: CaPin) -> PinnedCaVerifier {
        PinnedCaVerifier { pin, provider: crate::server::provider() }
    }
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| CaPin::of_der(c.as_ref()) == self.pin)
            .ok_or_else(|| rustls::Error::General(PIN_MISMATCH.into()))?;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let webpki =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(format!("pinned CA: {e}")))?;
        let verified = webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        match identity_of(end_entity.as_ref()) {
            Ok(identity) if identity.role == Role::Coordinator => Ok(verified),
            Ok(identity) => Err(rustls::Error::General(format!(
                "the server at this address holds a {} certificate, not a coordinator's",
                identity.role
            ))),
            Err(e) => Err(rustls::Error::General(format!("the server's certificate: {e}"))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// Connects a tonic channel to `addr` (host:port) over TLS verified by [`PinnedCaVerifier`],
/// without a client certificate: what a joining worker calls the join service over.
pub async fn pinned_channel(
    addr: &str,
    pin: CaPin,
    endpoint: tonic::transport::Endpoint,
) -> Result<tonic::transport::Channel, String> {
    let (host, _) = addr.rsplit_once(':').ok_or_else(|| format!("'{addr}' is not host:port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let server_name = match host.parse::<IpAddr>() {
        Ok(ip) => ServerName::IpAddress(ip.into()),
        Err(_) => ServerName::try_from(host.to_string()).map_err(|_| format!("'{host}' is not a valid host name"))?,
    };
    let mut config = rustls::ClientConfig::builder_with_provider(crate::server::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedCaVerifier::new(pin)))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = PinnedConnector {
        tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
        server_name,
        addr: addr.to_string(),
    };
    endpoint.connect_with_connector(connector).await.map_err(|e| {
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            chain.push_str(": ");
            chain.push_str(&s.to_string());
            source = s.source();
        }
        crate::describe_tls_error(&chain).unwrap_or(chain)
    })
}

#[derive(Clone)]
struct PinnedConnector {
    tls: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
    addr: String,
}

type Connecting = Pin<
    Box<
        dyn Future<
                Output = Result<
                    hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
                    std::io::Error,
                >,
            > + Send,
    >,
>;

impl tonic::codegen::Service<tonic::codegen::http::Uri> for PinnedConnector {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: tonic::codegen::http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let tcp = tokio::net::TcpStream::connect(&this.addr).await?;
            let _ = tcp.set_nodelay(true);
            let tls = this.tls.connect(this.server_name.clone(), tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{generate_dev_certs, DevCerts};

    fn der(path: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(path).expect("pem")
    }

    #[test]
    fn tokens_print_and_parse() {
        let pin = CaPin::of_der(b"ca");
        let token = JoinToken::new("ab".repeat(32), pin).expect("token");
        let text = token.to_string();
        assert!(text.starts_with("crlj1.") && text.ends_with(&pin.to_hex()), "{text}");
        assert_eq!(JoinToken::parse(&format!(" {text}\n")), Ok(token.clone()));
        assert_eq!(token.secret(), "ab".repeat(32));
        assert!(!format!("{token:?}").contains(&"ab".repeat(32)), "Debug shows the secret");
        for bad in [
            "",
            "crl_abc",
            &text.replace("crlj1", "crlj2"),
            &format!("{text}.x"),
            &text.replace(&pin.to_hex(), "zz"),
            &format!("crlj1.{}.{}", "AB".repeat(32), pin.to_hex()),
            &format!("crlj1.{}.{}", "ab".repeat(31), pin.to_hex()),
        ] {
            let err = JoinToken::parse(bad).expect_err(bad);
            assert!(err.starts_with("--token: not a join token"), "{err}");
        }
    }

    /// A coordinator's chain as the server sends it: its certificate, then the CA.
    fn chain(dir: &Path) -> (CertificateDer<'static>, Vec<CertificateDer<'static>>) {
        (der(&dir.join("coordinator-1.pem")), vec![der(&dir.join("ca.pem"))])
    }

    fn verify(pin: CaPin, end: &CertificateDer<'_>, rest: &[CertificateDer<'_>], host: &str) -> Result<(), String> {
        let name = ServerName::try_from(host.to_string()).expect("name");
        PinnedCaVerifier::new(pin)
            .verify_server_cert(end, rest, &name, &[], UnixTime::now())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_pinned_verifier_accepts_only_the_pinned_cluster() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = dir.path().join("ours");
        let theirs = dir.path().join("theirs");
        let spec = DevCerts { coordinators: 1, workers: vec!["w1".into()], ..Default::default() };
        generate_dev_certs(&ours, &spec).expect("certs");
        generate_dev_certs(&theirs, &spec).expect("certs");
        let pin = CaPin::of_file(&ours.join("ca.pem")).expect("pin");
        let (end, rest) = chain(&ours);
        verify(pin, &end, &rest, "127.0.0.1").expect("our coordinator");
        // Without the CA in the chain there is nothing to pin.
        assert!(verify(pin, &end, &[], "127.0.0.1").expect_err("no CA").contains(PIN_MISMATCH));
        // Another cluster, whole: its CA is not the pinned one.
        let (their_end, their_rest) = chain(&theirs);
        assert!(verify(pin, &their_end, &their_rest, "127.0.0.1").expect_err("their cluster").contains(PIN_MISMATCH));
        // Their coordinator sending our CA along: the chain does not verify against it.
        let mixed = vec![rest[0].clone()];
        assert!(verify(pin, &their_end, &mixed, "127.0.0.1").is_err());
        // Our CA, but not valid for this address.
        assert!(verify(pin, &end, &rest, "elsewhere.example").is_err());
        // Our CA, but a worker certificate (a worker posing as a coordinator).
        let worker = der(&ours.join("worker-w1.pem"));
        let err = verify(pin, &worker, &rest, "127.0.0.1").expect_err("a worker");
        assert!(err.contains("not a coordinator"), "{err}");
    }

    #[test]
    fn a_coordinator_signs_what_a_worker_requested_as_a_worker_certificate() {
        let dir = tempfile::tempdir().expect("tempdir");
        generate_dev_certs(dir.path(), &DevCerts { coordinators: 1, ..Default::default() }).expect("certs");
        let ca = ClusterCa::load(&dir.path().join("ca.pem"), &dir.path().join("ca-key.pem")).expect("ca");
        assert_eq!(ca.pin(), CaPin::of_file(&dir.path().join("ca.pem")).expect("pin"));
        let request = worker_request("gpu-7", &["10.0.0.7".into()]).expect("request");
        let verified = VerifiedRequest::parse(&request.csr_der).expect("verified");
        assert_eq!(verified.node(), "gpu-7");
        assert_eq!(verified.public_key_sha256().len(), 64);
        let cert = ca.sign_worker(&verified).expect("signed");
        check_issued(&cert, ca.ca_pem(), "gpu-7", ca.pin()).expect("a worker certificate for gpu-7");
        assert!(check_issued(&cert, ca.ca_pem(), "gpu-8", ca.pin()).is_err());
        assert!(check_issued(&cert, ca.ca_pem(), "gpu-7", CaPin::of_der(b"x"))
            .expect_err("pin")
            .contains(PIN_MISMATCH));
        // The certificate holds the worker's key and chains to the CA.
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).expect("der");
        let (_, parsed) = x509_parser::parse_x509_certificate(der.as_ref()).expect("parse");
        let key = KeyPair::from_pem(&request.key_pem).expect("key");
        assert_eq!(parsed.public_key().raw, key.subject_public_key_info().as_slice());
        let ca_der = der_of(ca.ca_pem());
        let (_, ca_parsed) = x509_parser::parse_x509_certificate(ca_der.as_ref()).expect("ca");
        parsed.verify_signature(Some(ca_parsed.public_key())).expect("signed by the CA");
        // A tampered request is refused.
        let mut bad = request.csr_der.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(VerifiedRequest::parse(&bad).is_err());
        // A key that is not the CA's is refused.
        let other = dir.path().join("other-key.pem");
        std::fs::write(&other, KeyPair::generate().expect("key").serialize_pem()).expect("write");
        let err = ClusterCa::load(&dir.path().join("ca.pem"), &other).expect_err("wrong key").to_string();
        assert!(err.contains("is not the key of the CA certificate"), "{err}");
    }

    fn der_of(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem")
    }
}
