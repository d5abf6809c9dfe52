//! What the daemon subcommands (`dev`, `coordinator`, `worker`) share: their tracing, the end
//! on SIGINT or SIGTERM, and the fence guard command a worker starts beside itself.

use anyhow::Context;
use corral_worker::GuardCommand;

/// Logs to stderr, filtered by `RUST_LOG` (by default: info, and only warnings of the storage
/// and Raft libraries).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,openraft=warn,sled=warn,redb=warn,raft_log=warn,h2=warn")
    });
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Resolves when SIGINT or SIGTERM arrives.
pub async fn termination() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The fence guard of a worker: this binary's hidden `worker-guard` command (the worker adds
/// `--cgroup-root` and its job cgroup root).
pub fn fence_guard() -> anyhow::Result<GuardCommand> {
    let program = std::env::current_exe().context("cannot find the corral binary to start the fence guard")?;
    Ok(GuardCommand { program, args: vec!["worker-guard".into()] })
}
