//! `corral alloc` (Slurm's `salloc`): an interactive allocation. It submits a job whose batch
//! step only holds the allocation (the holder the other nodes of a batch job run: a sleep that
//! the job's end stops with its cgroup), waits until it runs, then runs `$SHELL` (or the
//! command after `--`) on this host with the allocation's environment: the `SLURM_*` variables
//! of its first node, `CORRAL_ALLOC_JOB_ID` and `CORRAL_ALLOC_EPOCH` (the run it was granted),
//! the coordinator's endpoint and credentials, and a directory of links to this binary named
//! `srun`, `scontrol`, ... first on `PATH`. `srun` there reaches the job through the
//! coordinator as its owner (`srun.rs`, `Via::Coordinator`).
//!
//! The allocation ends when the shell exits (`Relinquishing job allocation N`: it is
//! cancelled) or when the job ends on its own (time limit, idle timeout, cancel, node loss: the
//! shell gets SIGHUP). If alloc itself dies without relinquishing (killed, its terminal gone),
//! a guard process it started beside itself in its own process group, which holds the read end
//! of a pipe only alloc writes to, sees the pipe close and cancels the job. If the whole host
//! goes, the session's idle timeout (the GPUs fall idle) or its time limit ends it.
//!
//! A session's idle rule (`--idle-timeout`, else its class's `idle-timeout`, else 30m; 0:
//! never; `--min-gpu-util`, default 1%) travels in its spec; the worker of each node keeps the
//! idle clock of its part's GPUs and ends the run (`runtime/task.rs`).

use crate::args::{AllocArgs, GlobalArgs};
use crate::commands::{build_spec, job_input};
use crate::connect::client;
use anyhow::Context;
use corral_types::{Job, JobState};
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;

/// What holds the allocation on its first node: what holds a batch job's other nodes.
const HOLD_ARGV: [&str; 3] = ["/bin/sh", "-c", "exec sleep 2147483647"];
/// How often a pending allocation's reason is repeated.
const PENDING_NOTE: Duration = Duration::from_secs(10);
/// The commands a session's `PATH` finds in this binary (as inside a job).
const SESSION_COMMANDS: [&str; 7] = ["srun", "scontrol", "squeue", "scancel", "sbatch", "sacct", "sinfo"];
/// How long the shell has after SIGHUP, when the allocation was revoked, before SIGKILL.
const REVOKE_GRACE: Duration = Duration::from_secs(5);

macro_rules! say {
    ($($arg:tt)*) => {{
        eprintln!("salloc: {}", format_args!($($arg)*));
    }};
}

pub async fn alloc(global: &GlobalArgs, args: AllocArgs) -> anyhow::Result<ExitCode> {
    let command = if args.command.is_empty() {
        vec![std::env::var("SHELL").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "/bin/sh".into())]
    } else {
        args.command.clone()
    };
    let default_name = command[0].rsplit('/').next().unwrap_or("interactive").to_string();
    let input = job_input(HOLD_ARGV.iter().map(|s| s.to_string()).collect(), None, default_name)?;
    let mut spec = build_spec(args.job, input)?;
    // The holder runs once, on the first node; the other nodes hold their part for steps.
    spec.batch_step = true;
    // Its idle rule: the flag's timeout, else the class's (filled in at submit).
    spec.session = Some(corral_types::SessionOptions {
        idle_timeout_secs: args.idle_timeout.map(|d| d.as_secs()),
        min_gpu_util_pct: args.min_gpu_util.unwrap_or(0),
    });
    let client = client(global)?;
    let job_id = client.submit(&spec).await?.job_id;
    say!("Pending job allocation {job_id}");
    let job = tokio::select! {
        job = granted(&client, job_id) => job?,
        _ = tokio::signal::ctrl_c() => {
            say!("Job allocation {job_id} has been revoked.");
            relinquish(&client, job_id).await;
            return Ok(ExitCode::from(130));
        }
    };
    let Some(job) = job else {
        let job = client.get_job(job_id).await?;
        say!("Job allocation {job_id} ended before it was granted: {}", crate::output::reason(&job));
        return Ok(ExitCode::from(1));
    };
    say!("Granted job allocation {job_id}");
    let epoch = job.allocation.as_ref().map_or(0, |a| a.epoch);
    // From here on, the allocation has an end even if this process is killed.
    let guard = start_guard(global, job_id);
    let links = match session_links() {
        Ok(dir) => dir,
        Err(e) => {
            relinquish(&client, job_id).await;
            return Err(e);
        }
    };
    let mut child = tokio::process::Command::new(&command[0]);
    child.args(&command[1..]).envs(session_env(global, &job, epoch, links.path()));
    let mut child = match child.spawn() {
        Ok(c) => c,
        Err(e) => {
            say!("cannot run {}: {e}", command[0]);
            relinquish(&client, job_id).await;
            return Ok(ExitCode::from(127));
        }
    };
    // As salloc, Ctrl-C belongs to the shell (the terminal sends it to both of us): ignore it.
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut sighup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let ended = ended(&client, job_id, epoch);
    tokio::pin!(ended);
    let mut revoked = false;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status?,
            _ = sigint.recv() => {}
            _ = sigterm.recv() => { signal_child(&child, libc::SIGTERM); }
            _ = sighup.recv() => { signal_child(&child, libc::SIGHUP); }
            job = &mut ended, if !revoked => {
                revoked = true;
                let why = job.map(|j| crate::output::reason(&j)).unwrap_or_else(|e| e.to_string());
                say!("Job allocation {job_id} has been revoked: {why}");
                signal_child(&child, libc::SIGHUP);
                let pid = child.id();
                tokio::spawn(async move {
                    tokio::time::sleep(REVOKE_GRACE).await;
                    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
                        // SAFETY: kill(2) on our own child's pid (it is not reaped before we wait).
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                });
            }
        }
    };
    if !revoked {
        say!("Relinquishing job allocation {job_id}");
    }
    relinquish(&client, job_id).await;
    drop(guard);
    drop(links);
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        _ => 1,
    };
    Ok(ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1)))
}

fn signal_child(child: &tokio::process::Child, signal: i32) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) on our own child's pid, not yet reaped.
        unsafe { libc::kill(pid, signal) };
    }
}

/// Cancels the allocation (a no-op for one that already ended).
async fn relinquish(client: &corral_client::Client, job_id: u64) {
    if let Err(e) = client.cancel(job_id).await {
        say!("cannot relinquish job allocation {job_id}: {e} (cancel it with `corral cancel {job_id}`)");
    }
}

/// The job once it runs (`None`: it ended without running), saying why it waits meanwhile.
async fn granted(client: &corral_client::Client, job_id: u64) -> anyhow::Result<Option<Job>> {
    let mut last: Option<(String, std::time::Instant)> = None;
    loop {
        let mut watch = client.watch_job(job_id).await?;
        loop {
            let next = tokio::time::timeout(PENDING_NOTE, watch.message()).await;
            let job = match next {
                Ok(Ok(Some(job))) => Job::try_from(job)?,
                // A leader change ends the stream: watch again.
                Ok(Ok(None)) | Ok(Err(_)) => break,
                Err(_) => {
                    if let Some((reason, at)) = &mut last {
                        say!("job {job_id} queued and waiting for resources: {reason}");
                        *at = std::time::Instant::now();
                    }
                    continue;
                }
            };
            match job.state {
                JobState::Running if job.started_at.is_some() && job.allocation.is_some() => return Ok(Some(job)),
                JobState::Running => {}
                JobState::Pending => {
                    let reason = crate::output::reason(&job);
                    if last.as_ref().is_none_or(|(r, at)| *r != reason || at.elapsed() >= PENDING_NOTE) {
                        say!("job {job_id} queued and waiting for resources: {reason}");
                        last = Some((reason, std::time::Instant::now()));
                    }
                }
                _ => return Ok(None),
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Resolves when run `epoch` of the job is over (ended, or requeued into another run).
async fn ended(client: &corral_client::Client, job_id: u64, epoch: u64) -> anyhow::Result<Job> {
    loop {
        if let Ok(mut watch) = client.watch_job(job_id).await {
            while let Ok(Some(job)) = watch.message().await {
                let job = Job::try_from(job)?;
                if job.state.is_terminal() || job.allocation.as_ref().is_none_or(|a| a.epoch != epoch) {
                    return Ok(job);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The shell's environment: the allocation's Slurm variables (as its first node sees them),
/// the session's job and run, how to reach the coordinator, and the links first on `PATH`.
fn session_env(global: &GlobalArgs, job: &Job, epoch: u64, links: &Path) -> Vec<(String, String)> {
    let nodes: Vec<&str> = match &job.allocation {
        Some(a) => a.parts().map(|(n, _)| n).collect(),
        None => Vec::new(),
    };
    let first = nodes.first().copied().unwrap_or_default();
    let mut env: Vec<(String, String)> =
        corral_types::slurm_allocation_env(job, &nodes, first, "corral").into_iter().collect();
    // The per-node variables are the tasks' (srun sets them), not the submit host's.
    env.retain(|(k, _)| !matches!(k.as_str(), "SLURM_NODEID" | "SLURMD_NODENAME"));
    env.push(("CORRAL_JOB_ID".into(), job.id.to_string()));
    env.push((crate::srun::SESSION_JOB_ENV.into(), job.id.to_string()));
    env.push((crate::srun::SESSION_EPOCH_ENV.into(), epoch.to_string()));
    env.push(("CORRAL_ENDPOINT".into(), global.endpoint.join(",")));
    if let Some(token) = &global.token {
        env.push(("CORRAL_TOKEN".into(), token.clone()));
    }
    for (key, path) in [("CORRAL_CA", &global.ca), ("CORRAL_CERT", &global.cert), ("CORRAL_KEY", &global.key)] {
        if let Some(path) = path {
            env.push((key.into(), absolute(path).display().to_string()));
        }
    }
    let path = std::env::var("PATH").unwrap_or_default();
    env.push(("PATH".into(), format!("{}:{path}", links.display())));
    env
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A private directory of links to this binary named after Slurm's commands; removed with it.
struct Links(PathBuf);

impl Links {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn session_links() -> anyhow::Result<Links> {
    let exe = std::env::current_exe().context("cannot find the corral binary for the session's srun")?;
    let base = std::env::var_os("TMPDIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"));
    let dir = base.join(format!("corral-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("cannot create {} for the session's srun", dir.display()))?;
    let links = Links(dir);
    for name in SESSION_COMMANDS {
        std::os::unix::fs::symlink(&exe, links.0.join(name))
            .with_context(|| format!("cannot link {name} in {}", links.0.display()))?;
    }
    Ok(links)
}

use std::os::unix::fs::DirBuilderExt;

/// The guard: this binary, in a process group of its own (the terminal's signals do not reach
/// it), reading a pipe whose write end only this process holds (close-on-exec: the shell does
/// not inherit it). When the pipe closes — this process exited or was killed — it cancels the
/// allocation. Dropping the returned handle closes the pipe.
fn start_guard(global: &GlobalArgs, job_id: u64) -> Option<std::process::ChildStdin> {
    let exe = std::env::current_exe().ok()?;
    let mut guard = std::process::Command::new(exe);
    guard.arg("alloc-guard").arg(job_id.to_string()).stdin(Stdio::piped()).stdout(Stdio::null());
    guard.env("CORRAL_ENDPOINT", global.endpoint.join(","));
    if let Some(token) = &global.token {
        guard.env("CORRAL_TOKEN", token);
    }
    for (key, path) in [("CORRAL_CA", &global.ca), ("CORRAL_CERT", &global.cert), ("CORRAL_KEY", &global.key)] {
        if let Some(path) = path {
            guard.env(key, absolute(path));
        }
    }
    guard.process_group(0);
    match guard.spawn() {
        Ok(mut child) => child.stdin.take(),
        Err(e) => {
            say!("warning: cannot start the guard that relinquishes the allocation if this process dies: {e}");
            None
        }
    }
}

/// `corral alloc-guard JOB` (internal): waits until its stdin closes, then cancels the job.
pub async fn guard(global: &GlobalArgs, job_id: u64) -> anyhow::Result<ExitCode> {
    tokio::task::spawn_blocking(|| {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    })
    .await?;
    let client = client(global)?;
    let job = client.get_job(job_id).await?;
    if !job.state.is_terminal() {
        client.cancel(job_id).await?;
    }
    Ok(ExitCode::SUCCESS)
}
