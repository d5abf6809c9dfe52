//! `corral worker --config FILE [--join ADDR --token T]`: a worker daemon from TOML. The file's
//! schema, validation, the join and the assembly of the worker live in corral-worker
//! (`WorkerFile`, `Worker::join_and_build`, `Worker::build`); this binds the agent's listener,
//! starts the metrics listener and runs until SIGINT/SIGTERM, then removes its (empty) cgroup
//! root. A changed file takes effect at the next start: the worker registers again with the new
//! spec.

use corral_worker::{BuildOptions, JoinOptions, Worker, WorkerFile};
use std::path::Path;
use tokio_util::sync::CancellationToken;

/// Runs the worker; with `join`, `token` is the join token (otherwise the worker's access token).
pub async fn run(config_path: &Path, join: Option<String>, token: Option<String>) -> anyhow::Result<()> {
    crate::daemon::init_tracing();
    let file = WorkerFile::load(config_path)?;
    let join = match (join, &token) {
        (Some(addr), Some(token)) => Some(JoinOptions { addr, token: token.clone() }),
        (Some(_), None) => anyhow::bail!("--join needs --token: the join token from `corral node join-token`"),
        (None, _) => None,
    };
    let listen = file.listen.parse()?;
    let listener = crate::listen::bind(listen, "for the coordinators").await?;
    let fence_guard = Some(crate::daemon::fence_guard()?);
    let worker = match &join {
        Some(join) => {
            let options = BuildOptions { token: None, fence_guard, gpus: None };
            Worker::join_and_build(&file, listener.local_addr()?, options, join).await?
        }
        None => Worker::build(&file, listener.local_addr()?, BuildOptions { token, fence_guard, gpus: None })?,
    };
    println!(
        "corral worker {} serving logs on {}; registering with {}",
        file.node_name(),
        listener.local_addr()?,
        file.coordinators.join(",")
    );
    let stop = CancellationToken::new();
    if let Some(m) = &file.metrics_addr {
        let addr = crate::metrics_http::parse_addr("metrics-addr", m).map_err(anyhow::Error::msg)?;
        let sources = vec![crate::metrics_http::MetricsSource::Worker(worker.metrics())];
        let bound = crate::metrics_http::start(addr, sources, stop.clone().cancelled_owned()).await?;
        println!("corral worker {} serving metrics at http://{bound}/metrics", file.node_name());
    }
    let mut running = tokio::spawn(worker.run(listener, stop.clone().cancelled_owned()));
    tokio::select! {
        _ = crate::daemon::termination() => {
            tracing::info!("shutting down: killing local jobs");
            stop.cancel();
            (&mut running).await??;
            // The worker ended its jobs: its cgroup root (one per data dir) goes too, or every
            // stop would leave one behind. Left in place, with a warning, while anything is
            // still under it.
            let cgroup_root = file.job_cgroup_root();
            if let Err(e) =
                corral_worker::executor::ProcessExecutor::new(cgroup_root.as_str()).and_then(|e| e.remove_root_cgroup())
            {
                tracing::warn!(error = %e, cgroup_root, "cannot remove the worker's cgroup root");
            }
        }
        result = &mut running => result??,
    }
    stop.cancel();
    Ok(())
}
