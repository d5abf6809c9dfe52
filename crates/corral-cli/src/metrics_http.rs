//! The `/metrics` HTTP listener of coordinators and workers: OpenMetrics text (prometheus-client)
//! served by axum on its own listener, with every series computed at scrape time. On a
//! coordinator's listener every other path is the web view (`Coordinator::web`) — unless the
//! coordinator refuses it on this listener (`Coordinator::web_view_refusal`: no TLS or tokens
//! and not loopback), which is logged once when the listener starts; then it is `/metrics` only.

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, COOKIE, HOST, ORIGIN, REFERER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use corral_coordinator::{Coordinator, WebRequest};
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

/// What a listener serves: its sources' series, and the web view of its coordinator when it
/// serves one there (`Err`: why not).
struct Served {
    sources: Vec<MetricsSource>,
    web: Result<Coordinator, String>,
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
    let mut workers = Vec::new();
    for source in sources {
        match source {
            MetricsSource::Coordinator(c) => c.collect_metrics(&mut registry).await,
            MetricsSource::Worker(w) => workers.push(w.clone()),
        }
    }
    // Several workers of one process share each family (their series differ by `Hostname`).
    WorkerMetrics::collect_all(&workers, &mut registry);
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        tracing::warn!(error = %e, "cannot encode metrics");
    }
    text
}

async fn metrics(State(served): State<Arc<Served>>) -> impl IntoResponse {
    ([(CONTENT_TYPE, OPENMETRICS)], render(&served.sources).await)
}

/// Every path but `/metrics`: a coordinator's web view where it is served; 404 otherwise.
async fn web(
    State(served): State<Arc<Served>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let coordinator = match &served.web {
        Ok(coordinator) => coordinator,
        Err(why) => {
            return (StatusCode::NOT_FOUND, format!("not found: this listener serves /metrics only ({why})\n"))
                .into_response()
        }
    };
    let header = |name| headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok()).map(String::from);
    let request = WebRequest {
        method: method.as_str().to_string(),
        path: uri.path().to_string(),
        authorization: header(AUTHORIZATION),
        cookie: header(COOKIE),
        body: body.to_vec(),
        peer: peer.to_string(),
        // This listener speaks plain HTTP (see README "Web view").
        secure: false,
        host: header(HOST),
        origin: header(ORIGIN),
        referer: header(REFERER),
    };
    let answer = coordinator.web(request).await;
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, answer.body).into_response();
    for (name, value) in answer.headers {
        if let Ok(value) = HeaderValue::from_str(&value) {
            response.headers_mut().insert(HeaderName::from_static(name), value);
        }
    }
    response
}

/// Serves `GET /metrics` on `listener` (and a coordinator's web view on the other paths) until
/// `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    sources: Vec<MetricsSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let bound = listener.local_addr().context("metrics listener")?;
    let coordinator = sources.iter().find_map(|s| match s {
        MetricsSource::Coordinator(c) => Some(c.clone()),
        MetricsSource::Worker(_) => None,
    });
    let web_view = match coordinator {
        None => Err("a worker has no web view".to_string()),
        Some(coordinator) => match coordinator.web_view_refusal(bound) {
            None => Ok(coordinator),
            Some(why) => {
                tracing::warn!("{why}");
                Err(why)
            }
        },
    };
    let served = Arc::new(Served { sources, web: web_view });
    let app = Router::new().route("/metrics", get(metrics)).fallback(web).with_state(served);
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(shutdown)
        .await
        .context("metrics listener failed")
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
