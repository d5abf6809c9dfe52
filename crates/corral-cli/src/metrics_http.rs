//! The `/metrics` HTTP listener of coordinators and workers: OpenMetrics text (prometheus-client)
//! served by axum on its own listener, with every series computed at scrape time.

use anyhow::Context;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use corral_coordinator::Coordinator;
use corral_worker::WorkerMetrics;
use prometheus_client::registry::Registry;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// The content type of the OpenMetrics text format.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What one listener exports; `corral dev` serves both on one.
#[derive(Clone)]
pub enum MetricsSource {
    Coordinator(Coordinator),
    Worker(WorkerMetrics),
}

/// Parses a `metrics-addr` value; `key` names it in the error.
pub fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, String> {
    value.parse().map_err(|_| format!("{key}: '{value}' is not IP:PORT (e.g. 127.0.0.1:9471)"))
}

/// Binds the metrics listener.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    crate::listen::bind(addr, "for metrics").await
}

/// Renders every source's series as one OpenMetrics document.
pub async fn render(sources: &[MetricsSource]) -> String {
    let mut registry = Registry::default();
    for source in sources {
        match source {
            MetricsSource::Coordinator(c) => c.collect_metrics(&mut registry).await,
            MetricsSource::Worker(w) => w.collect(&mut registry),
        }
    }
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        tracing::warn!(error = %e, "cannot encode metrics");
    }
    text
}

async fn metrics(State(sources): State<Arc<Vec<MetricsSource>>>) -> impl IntoResponse {
    ([(CONTENT_TYPE, OPENMETRICS)], render(&sources).await)
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    sources: Vec<MetricsSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = Router::new().route("/metrics", get(metrics)).with_state(Arc::new(sources));
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await.context("metrics listener failed")
}

/// Binds `addr`, logs where metrics are served and serves them in the background until
/// `shutdown`. Returns the bound address (`addr` may have port 0).
pub async fn start(
    addr: SocketAddr,
    sources: Vec<MetricsSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<SocketAddr> {
    let listener = bind(addr).await?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "serving metrics at http://{bound}/metrics");
    tokio::spawn(async move {
        if let Err(e) = serve(listener, sources, shutdown).await {
            tracing::warn!(error = %e, "metrics listener stopped");
        }
    });
    Ok(bound)
}
