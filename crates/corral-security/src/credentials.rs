//! Our own certificate and key, shared by the server and the client side of a daemon and
//! replaced in place when the certificate is renewed: new connections present the new
//! certificate, connections already open keep the one they were made with.

use crate::server::{load_certs, load_key, provider};
use crate::{TlsError, TlsFiles};
use std::sync::{Arc, RwLock};
use tokio_rustls::rustls;
use tokio_rustls::rustls::sign::CertifiedKey;

/// The certificate (followed by the CA, so that a joining worker can check the CA against its
/// token's pin: see `join`) and key of `files`, reloadable.
pub(crate) struct Credentials {
    files: TlsFiles,
    current: RwLock<Arc<CertifiedKey>>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("cert", &self.files.cert).finish_non_exhaustive()
    }
}

impl Credentials {
    pub(crate) fn load(files: &TlsFiles) -> Result<Arc<Credentials>, TlsError> {
        let current = RwLock::new(read(files)?);
        Ok(Arc::new(Credentials { files: files.clone(), current }))
    }

    /// Reads the files again; on success new connections use what they hold now.
    pub(crate) fn reload(&self) -> Result<(), TlsError> {
        let fresh = read(&self.files)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    fn current(&self) -> Arc<CertifiedKey> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The chain we present (our certificate, then the CA certificates not in it) and our key,
/// which must be the certificate's.
fn read(files: &TlsFiles) -> Result<Arc<CertifiedKey>, TlsError> {
    let mut chain = load_certs(&files.cert)?;
    for ca in load_certs(&files.ca)? {
        if !chain.contains(&ca) {
            chain.push(ca);
        }
    }
    let key = load_key(&files.key)?;
    let certified = CertifiedKey::from_der(chain, key, &provider()).map_err(|e| TlsError::Pem {
        path: files.key.clone(),
        what: format!("not the key of {}: {e}", files.cert.display()),
    })?;
    Ok(Arc::new(certified))
}

impl rustls::client::ResolvesClientCert for Credentials {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl rustls::server::ResolvesServerCert for Credentials {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}
