//! The client side: a tonic TLS config presenting our certificate and trusting only the
//! cluster CA, and readable messages for TLS failures.

use crate::{read, TlsError, TlsFiles};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// A tonic client TLS config from PEM files (CA, our certificate, our key).
pub fn client_tls_config(files: &TlsFiles) -> Result<ClientTlsConfig, TlsError> {
    // Parse now, so a bad file is reported at startup and not as a connection error later.
    crate::server::load_certs(&files.ca)?;
    crate::server::load_certs(&files.cert)?;
    crate::server::load_key(&files.key)?;
    let ca = Certificate::from_pem(read(&files.ca)?);
    let identity = Identity::from_pem(read(&files.cert)?, read(&files.key)?);
    Ok(ClientTlsConfig::new().ca_certificate(ca).identity(identity))
}

/// A one-line explanation of a TLS failure seen by a client, or `None` if `error` (an error
/// chain rendered as text) is not about TLS.
pub fn describe_tls_error(error: &str) -> Option<String> {
    let known = [
        (
            crate::PIN_MISMATCH,
            "TLS: the coordinator's CA is not the one the join token names (check --join and --token)",
        ),
        ("not a coordinator's", "TLS: the server at --join is not a coordinator of this cluster"),
        ("UnknownIssuer", "TLS: server certificate not signed by the configured CA (check --ca)"),
        ("BadSignature", "TLS: server certificate not signed by the configured CA (check --ca)"),
        ("DecryptError", "TLS: the server refused our client certificate: not signed by its CA"),
        ("NotValidForName", "TLS: server certificate is not valid for this address (check --endpoint)"),
        ("CertificateRequired", "TLS: the server requires a client certificate (pass --cert and --key)"),
        ("UnknownCA", "TLS: the server refused our client certificate: not signed by its CA"),
        ("BadCertificate", "TLS: the server refused our client certificate"),
        ("CertExpired", "TLS: certificate expired"),
        ("Expired", "TLS: certificate expired"),
        ("InvalidContentType", "TLS: the server does not speak TLS (drop --ca/--cert/--key for a plaintext server)"),
        ("corrupt message", "TLS: the server does not speak TLS (drop --ca/--cert/--key for a plaintext server)"),
    ];
    known.iter().find(|(needle, _)| error.contains(needle)).map(|(_, message)| message.to_string())
}
