//! `corral coordinator --config FILE`: a coordinator daemon (one Raft member) from TOML. The
//! file's schema, validation and the opening of the coordinator live in corral-coordinator
//! (`CoordinatorFile`, `Coordinator::open`); this binds the listener, serves until SIGINT or
//! SIGTERM and stops.

use crate::metrics_http::MetricsSource;
use corral_coordinator::{Coordinator, CoordinatorFile};
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub async fn run(config_path: &Path) -> anyhow::Result<()> {
    crate::daemon::init_tracing();
    let file = CoordinatorFile::load(config_path)?;
    let listener = crate::listen::bind(file.listen.parse()?, "for clients and peers").await?;
    let bound = listener.local_addr()?;
    let coordinator = Coordinator::open(&file, bound).await?;
    let stop = CancellationToken::new();
    if let Some(m) = &file.metrics_addr {
        let addr = crate::metrics_http::parse_addr("metrics-addr", m).map_err(anyhow::Error::msg)?;
        let sources = vec![MetricsSource::Coordinator(coordinator.clone())];
        let bound = crate::metrics_http::start(addr, sources, stop.clone().cancelled_owned()).await?;
        println!("corral coordinator {} serving metrics at http://{bound}/metrics", file.node_id);
        match coordinator.web_view_refusal(bound) {
            None => println!("corral coordinator {} serving the web view at http://{bound}/", file.node_id),
            Some(why) => println!("corral coordinator {}: {why}", file.node_id),
        }
    }
    let advertise = file.advertise.clone().unwrap_or_else(|| bound.to_string());
    let server = tokio::spawn(coordinator.clone().serve(listener, stop.clone().cancelled_owned()));
    println!("corral coordinator {} listening on {bound} (advertised as {advertise})", file.node_id);
    crate::daemon::termination().await;
    tracing::info!("shutting down");
    stop.cancel();
    if let Err(e) = tokio::time::timeout(Duration::from_secs(10), coordinator.raft_node().shutdown()).await {
        tracing::warn!(error = %e, "raft shutdown timed out");
    }
    server.await??;
    Ok(())
}
