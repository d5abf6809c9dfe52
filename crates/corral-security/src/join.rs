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
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, CertificateSigningRequestDer, ServerName, UnixTime};
use tokio_rustls::rustls::{DigitallySignedStruct, SignatureScheme};

/// How long a worker certificate signed by a coordinator is valid unless
/// `tls.worker-cert-lifetime` says otherwise.
pub const DEFAULT_WORKER_CERT_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);

/// Prefix (and format version) of a join token.
const TOKEN_PREFIX: &str = "crlj1";
/// Most subject alternative names a worker's certificate request may carry (what is read of
/// one, whatever its size).
const MAX_REQUESTED_NAMES: usize = 16;
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
/// server for the name and for `address` (the host the coordinators reach its agent at).
pub fn worker_request(node: &str, address: &str) -> Result<WorkerRequest, TlsError> {
    let key = KeyPair::generate().map_err(crate::certs::gen_err)?;
    let csr_der = request_der(node, address, &key)?;
    Ok(WorkerRequest { key_pem: key.serialize_pem(), csr_der })
}

/// A certificate request of worker `node` for its renewal, signed with the key it holds
/// already (`key_pem`, the key of its current certificate): the key file is never rewritten,
/// so a renewal interrupted at any point leaves a certificate and key that belong together.
pub fn renewal_request(node: &str, address: &str, key_pem: &str) -> Result<Vec<u8>, TlsError> {
    let key = KeyPair::from_pem(key_pem).map_err(|e| TlsError::Generate(format!("unusable private key: {e}")))?;
    request_der(node, address, &key)
}

fn request_der(node: &str, address: &str, key: &KeyPair) -> Result<Vec<u8>, TlsError> {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, node);
    if let Ok(name) = crate::certs::san(node) {
        params.subject_alt_names.push(name);
    }
    let address = crate::certs::san(address)?;
    if !params.subject_alt_names.contains(&address) {
        params.subject_alt_names.push(address);
    }
    let csr = params.serialize_request(key).map_err(crate::certs::gen_err)?;
    Ok(csr.der().to_vec())
}

/// A verified certificate request of a worker.
pub struct VerifiedRequest {
    params: CertificateSigningRequestParams,
    node: String,
    /// The one host besides the node name the certificate is valid for (its agent's address).
    address: Option<SanType>,
}

impl VerifiedRequest {
    /// Parses `csr_der` and checks its signature (the sender holds the key): the node name is
    /// its subject CN. Of its subject alternative names, DNS names and IP addresses are kept
    /// as server names: the node name and at most one more (the address the coordinators reach
    /// its agent at); a wildcard or any further name is refused, since a worker certificate
    /// valid for other hosts' names could answer in their place.
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
        let names = &params.params.subject_alt_names;
        if names.len() > MAX_REQUESTED_NAMES {
            return Err(format!("the certificate request carries more than {MAX_REQUESTED_NAMES} names"));
        }
        let mut address = None;
        for name in names {
            let text = match name {
                SanType::DnsName(dns) => dns.as_str().to_string(),
                SanType::IpAddress(ip) => ip.to_string(),
                _ => continue,
            };
            if text.contains('*') {
                return Err(format!("the certificate request asks for the wildcard name '{text}'"));
            }
            if text == node {
                continue;
            }
            if address.is_some() {
                return Err(format!(
                    "the certificate request asks for more than the node name '{node}' and one address: a worker certificate is valid for its node name and its advertised address only"
                ));
            }
            address = Some(name.clone());
        }
        Ok(VerifiedRequest { params, node, address })
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
    /// The CA certificate's notAfter (seconds since the epoch): no certificate outlives it.
    ca_not_after_s: u64,
    worker_lifetime: Duration,
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
        let ca_not_after_s = u64::try_from(cert.validity().not_after.timestamp()).unwrap_or(0);
        let ca_pem = String::from_utf8_lossy(&crate::read(ca)?).into_owned();
        Ok(ClusterCa {
            issuer,
            ca_pem,
            pin: CaPin::of_der(der.as_ref()),
            ca_not_after_s,
            worker_lifetime: DEFAULT_WORKER_CERT_LIFETIME,
        })
    }

    /// How long the worker certificates it signs are valid (`tls.worker-cert-lifetime`).
    pub fn with_worker_lifetime(mut self, lifetime: Duration) -> ClusterCa {
        self.worker_lifetime = lifetime;
        self
    }

    pub fn worker_lifetime(&self) -> Duration {
        self.worker_lifetime
    }

    pub fn pin(&self) -> CaPin {
        self.pin
    }

    pub(crate) fn into_issuer(self) -> Issuer<'static, KeyPair> {
        self.issuer
    }

    /// The CA certificate(s), PEM, as the worker stores them.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A worker certificate for `request`: role worker, the node name as CN and server name,
    /// the one address it asked for (see [`VerifiedRequest::parse`]); issued at `issued_at_s`
    /// (seconds since the epoch: notBefore is [`crate::CERT_BACKDATE`] earlier) and valid for
    /// the worker lifetime, or until the CA expires if that comes first. Nothing else the
    /// request asks for is granted.
    pub fn sign_worker(&self, request: &VerifiedRequest, issued_at_s: u64) -> Result<String, TlsError> {
        let role = Role::Worker;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, request.node.as_str());
        params.distinguished_name.push(DnType::OrganizationalUnitName, role.as_str());
        params.subject_alt_names.push(SanType::URI(role.uri().try_into().map_err(crate::certs::gen_err)?));
        if let Ok(san) = crate::certs::san(&request.node) {
            params.subject_alt_names.push(san);
        }
        if let Some(address) = &request.address {
            params.subject_alt_names.push(address.clone());
        }
        let not_after_s = issued_at_s.saturating_add(self.worker_lifetime.as_secs()).min(self.ca_not_after_s);
        crate::certs::set_validity(&mut params, issued_at_s, not_after_s);
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

/// Checks what a coordinator returned to a renewing worker: [`check_issued`] against the CA it
/// holds (`pin`), and the certificate certifies the key it holds (`key_pem`), so that storing
/// it keeps a certificate and key that belong together.
pub fn check_renewed(cert_pem: &str, key_pem: &str, ca_pem: &str, node: &str, pin: CaPin) -> Result<(), String> {
    check_issued(cert_pem, ca_pem, node, pin)?;
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| format!("invalid certificate: {e}"))?;
    let (_, cert) =
        x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| format!("unreadable certificate: {e}"))?;
    let key = KeyPair::from_pem(key_pem).map_err(|e| format!("unusable private key: {e}"))?;
    if cert.public_key().raw != key.subject_public_key_info().as_slice() {
        return Err("the coordinator certified another key than this worker's".into());
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
    let config = rustls::ClientConfig::builder_with_provider(crate::server::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedCaVerifier::new(pin)))
        .with_no_client_auth();
    crate::connector::TlsConnector::new(addr, config)?.channel(endpoint).await
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
        let request = worker_request("gpu-7", "10.0.0.7").expect("request");
        let verified = VerifiedRequest::parse(&request.csr_der).expect("verified");
        assert_eq!(verified.node(), "gpu-7");
        assert_eq!(verified.public_key_sha256().len(), 64);
        let issued = crate::certs::now_s();
        let ca = ca.with_worker_lifetime(Duration::from_secs(3600));
        let cert = ca.sign_worker(&verified, issued).expect("signed");
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
        // Valid for the node name and its address only, for the worker lifetime.
        assert_eq!(server_names(&parsed), ["gpu-7", "10.0.0.7"]);
        let identity = identity_of(der.as_ref()).expect("identity");
        assert_eq!(identity.issued_at_s(), issued);
        assert_eq!(identity.not_after_s, issued + 3600);
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

    /// The DNS names and IP addresses of a certificate.
    fn server_names(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
        use x509_parser::extensions::GeneralName;
        let san = cert.subject_alternative_name().expect("san").expect("a SAN extension");
        san.value
            .general_names
            .iter()
            .filter_map(|g| match g {
                GeneralName::DNSName(d) => Some(d.to_string()),
                GeneralName::IPAddress(b) if b.len() == 4 => {
                    Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).expect("4 bytes")).to_string())
                }
                _ => None,
            })
            .collect()
    }

    /// A request as a worker of an earlier version (or a hostile one) could make it.
    fn request_for(node: &str, hosts: &[&str]) -> Vec<u8> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, node);
        for host in hosts {
            params.subject_alt_names.push(crate::certs::san(host).expect("san"));
        }
        let key = KeyPair::generate().expect("key");
        params.serialize_request(&key).expect("csr").der().to_vec()
    }

    #[test]
    fn a_worker_certificate_carries_only_its_node_name_and_one_address() {
        for (hosts, refusal) in [
            (&["*.example"][..], "wildcard name '*.example'"),
            (&["gpu-7", "10.0.0.7", "coordinator.example"], "more than the node name 'gpu-7' and one address"),
            (&["10.0.0.7", "10.0.0.8"], "more than the node name"),
        ] {
            let err = VerifiedRequest::parse(&request_for("gpu-7", hosts)).err().expect("refused");
            assert!(err.contains(refusal), "{hosts:?}: {err}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        generate_dev_certs(dir.path(), &DevCerts { coordinators: 1, ..Default::default() }).expect("certs");
        let ca = ClusterCa::load(&dir.path().join("ca.pem"), &dir.path().join("ca-key.pem")).expect("ca");
        assert_eq!(ca.worker_lifetime(), DEFAULT_WORKER_CERT_LIFETIME);
        // Other kinds of names (a role URI, say) are not granted.
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, "gpu-7");
        params.subject_alt_names.push(SanType::URI(Role::Coordinator.uri().try_into().expect("uri")));
        params.subject_alt_names.push(crate::certs::san("gpu-7.example").expect("san"));
        let key = KeyPair::generate().expect("key");
        let csr = params.serialize_request(&key).expect("csr").der().to_vec();
        let issued = crate::certs::now_s();
        let cert = ca.sign_worker(&VerifiedRequest::parse(&csr).expect("verified"), issued).expect("signed");
        let der = der_of(&cert);
        assert_eq!(identity_of(der.as_ref()).expect("identity").role, Role::Worker);
        let (_, parsed) = x509_parser::parse_x509_certificate(der.as_ref()).expect("parse");
        assert_eq!(server_names(&parsed), ["gpu-7", "gpu-7.example"]);
        // Never past the CA's own expiry.
        let identity = identity_of(der.as_ref()).expect("identity");
        assert_eq!(identity.not_after_s, issued + DEFAULT_WORKER_CERT_LIFETIME.as_secs());
        let late =
            ca.sign_worker(&VerifiedRequest::parse(&csr).expect("verified"), issued + 3649 * 86400).expect("late");
        let ca_der = der_of(ca.ca_pem());
        let (_, ca_parsed) = x509_parser::parse_x509_certificate(ca_der.as_ref()).expect("ca");
        let ca_until = u64::try_from(ca_parsed.validity().not_after.timestamp()).expect("after 1970");
        assert_eq!(identity_of(der_of(&late).as_ref()).expect("identity").not_after_s, ca_until);
    }

    #[test]
    fn a_renewal_request_keeps_the_key() {
        let request = worker_request("gpu-7", "gpu-7.example").expect("request");
        let renewal = renewal_request("gpu-7", "gpu-7.example", &request.key_pem).expect("renewal");
        let (first, again) = (
            VerifiedRequest::parse(&request.csr_der).expect("first"),
            VerifiedRequest::parse(&renewal).expect("renewal"),
        );
        assert_eq!(first.public_key_sha256(), again.public_key_sha256());
        assert_eq!(again.node(), "gpu-7");
        assert!(renewal_request("gpu-7", "gpu-7.example", "not a key").is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        generate_dev_certs(dir.path(), &DevCerts { coordinators: 1, ..Default::default() }).expect("certs");
        let ca = ClusterCa::load(&dir.path().join("ca.pem"), &dir.path().join("ca-key.pem")).expect("ca");
        let cert = ca.sign_worker(&again, crate::certs::now_s()).expect("signed");
        check_renewed(&cert, &request.key_pem, ca.ca_pem(), "gpu-7", ca.pin()).expect("our key");
        let other = worker_request("gpu-7", "gpu-7.example").expect("another key");
        let err = check_renewed(&cert, &other.key_pem, ca.ca_pem(), "gpu-7", ca.pin()).expect_err("another key");
        assert!(err.contains("another key"), "{err}");
    }
}
