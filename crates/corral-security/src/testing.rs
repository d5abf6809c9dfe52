//! For tests of every crate: a TLS server that presents whatever certificate it is given (a
//! worker's on a coordinator's port, say) and records what clients send it, so a test can show
//! that a client refused it before sending anything (its bearer token included). Tests outside
//! this crate cannot name rustls; this is their way to stand up such a server.

use crate::credentials::Credentials;
use crate::{TlsError, TlsFiles};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio_rustls::rustls;

/// What an [`Impostor`] saw.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Connections whose handshake completed.
    pub handshakes: usize,
    /// Handshakes that failed, with the error (a client's alert, e.g. "received fatal alert:
    /// BadCertificate").
    pub refusals: Vec<String>,
    /// The application bytes clients sent after a completed handshake.
    pub received: Vec<u8>,
}

/// A TLS server on a loopback port presenting the certificate of `files`, running on its own
/// thread until dropped. It asks for no client certificate and answers nothing.
pub struct Impostor {
    addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Impostor {
    /// Listens on 127.0.0.1 at a free port.
    pub fn start(files: &TlsFiles) -> Result<Impostor, TlsError> {
        Impostor::start_at("127.0.0.1:0".parse().expect("an address"), files)
    }

    /// Listens on `addr` (a port another server left, say).
    pub fn start_at(addr: SocketAddr, files: &TlsFiles) -> Result<Impostor, TlsError> {
        let mut config = rustls::ServerConfig::builder_with_provider(crate::server::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(Credentials::load(files)?);
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind(addr).map_err(|e| TlsError::Config(format!("bind {addr}: {e}")))?;
        listener.set_nonblocking(true).map_err(|e| TlsError::Config(e.to_string()))?;
        let addr = listener.local_addr().map_err(|e| TlsError::Config(e.to_string()))?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let record = seen.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                tokio::select! {
                    _ = stopped => {}
                    _ = serve(listener, acceptor, record) => {}
                }
            });
        });
        Ok(Impostor { addr, seen, stop: Some(stop) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it saw so far.
    pub fn seen(&self) -> Seen {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for Impostor {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn serve(listener: tokio::net::TcpListener, acceptor: tokio_rustls::TlsAcceptor, seen: Arc<Mutex<Seen>>) {
    while let Ok((stream, _)) = listener.accept().await {
        let acceptor = acceptor.clone();
        let seen = seen.clone();
        tokio::spawn(async move {
            let mut stream = match acceptor.accept(stream).await {
                Ok(stream) => stream,
                Err(e) => {
                    seen.lock().unwrap_or_else(|p| p.into_inner()).refusals.push(e.to_string());
                    return;
                }
            };
            seen.lock().unwrap_or_else(|p| p.into_inner()).handshakes += 1;
            let mut buf = [0u8; 4096];
            // A client that completed the handshake sends its request at once; read for a while.
            while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
                if n == 0 {
                    break;
                }
                seen.lock().unwrap_or_else(|p| p.into_inner()).received.extend_from_slice(&buf[..n]);
            }
        });
    }
}
