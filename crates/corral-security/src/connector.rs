//! The TLS connector of every corral client channel: tonic connects through it over plain TCP
//! (its endpoint stays `http://`, so tonic adds no TLS of its own) and it runs the handshake
//! with a rustls config whose verifier is corral's (the role check of [`crate::ClientTls`], the
//! pin of a joining worker), so nothing is sent to a server that fails it.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// The name a server's certificate must be valid for: the host of `addr` (host:port).
pub(crate) fn server_name(addr: &str) -> Result<ServerName<'static>, String> {
    let (host, _) = addr.rsplit_once(':').ok_or_else(|| format!("'{addr}' is not host:port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<IpAddr>() {
        Ok(ip) => Ok(ServerName::IpAddress(ip.into())),
        Err(_) => ServerName::try_from(host.to_string()).map_err(|_| format!("'{host}' is not a valid host name")),
    }
}

/// Connects to one address over TLS with `config`.
#[derive(Clone)]
pub(crate) struct TlsConnector {
    tls: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
    addr: String,
}

impl TlsConnector {
    pub(crate) fn new(addr: &str, mut config: rustls::ClientConfig) -> Result<TlsConnector, String> {
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(TlsConnector {
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            server_name: server_name(addr)?,
            addr: addr.to_string(),
        })
    }

    /// A channel that connects at its first call (and again after a broken connection).
    pub(crate) fn channel_lazy(self, endpoint: tonic::transport::Endpoint) -> tonic::transport::Channel {
        endpoint.connect_with_connector_lazy(self)
    }

    /// A connected channel, or the failure as one readable line: a TLS failure explained
    /// (see [`crate::describe_tls_error`]), else the innermost error ("Connection refused").
    pub(crate) async fn channel(
        self,
        endpoint: tonic::transport::Endpoint,
    ) -> Result<tonic::transport::Channel, String> {
        endpoint.connect_with_connector(self).await.map_err(|e| {
            let mut chain = e.to_string();
            let mut last = chain.clone();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                last = s.to_string();
                chain.push_str(": ");
                chain.push_str(&last);
                source = s.source();
            }
            crate::describe_tls_error(&chain).unwrap_or(last)
        })
    }
}

type Io = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
type Connecting = Pin<Box<dyn Future<Output = Result<Io, std::io::Error>> + Send>>;

impl tonic::codegen::Service<tonic::codegen::http::Uri> for TlsConnector {
    type Response = Io;
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
