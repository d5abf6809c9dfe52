//! The in-job service: what `srun` inside a job reaches on its node. A unix socket
//! (`<data dir>/in-job.sock`, named in each job's `CORRAL_IN_JOB_SOCKET`) speaking one JSON
//! request a connection, a line each way. Every request carries the run secret the worker minted
//! into the job's environment at its launch (`CORRAL_RUN_SECRET`); the secret names the one run
//! (job, epoch) the caller acts for, whatever else the request says. Creates and signals are
//! forwarded to the leader through the link as this node; a wait answers once the desired state
//! shows the step ended; a read of a task's output on another node answers `Streaming`, then
//! relays the raw bytes (through the leader's proxy from that node's agent) until that node's
//! tasks of the step are gone, and closes.
//!
//! Bounds: a request line is at most `MAX_REQUEST_BYTES`; at most `MAX_CONNECTIONS` are served at
//! once (more are answered with an error); a wait or a read lasts at most as long as the run.

use crate::jobs::JobTable;
use crate::link::Link;
use crate::reconcile::Desired;
use corral_types::{JobId, JobStep, StepId, StepSpec};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, Semaphore};

/// The variable holding the run secret.
pub const SECRET_ENV: &str = "CORRAL_RUN_SECRET";
/// The variable naming the in-job service's socket.
pub const SOCKET_ENV: &str = "CORRAL_IN_JOB_SOCKET";
/// Longest request line.
pub const MAX_REQUEST_BYTES: u64 = 512 * 1024;
/// Set in a step's environment by `srun --export=NONE`: its tasks get only the run's `SLURM_*`
/// variables and their node's own (`runtime::tasks::task_env`), not the job's environment.
pub const EXPORT_NONE: &str = "CORRAL_EXPORT_NONE";
/// The answer to a secret that names no run.
const NO_RUN: &str = "no running job of this node holds this run secret: srun works inside a running job";
/// Connections served at once.
const MAX_CONNECTIONS: usize = 256;

/// One request, with the secret of the run it is for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    pub secret: String,
    pub call: Call,
}

/// What an in-job command asks for.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Call {
    /// A new step of the caller's run (`request_id` made once by the caller: a retry returns the
    /// step it made).
    CreateStep { request_id: String, spec: StepSpec },
    /// Answers once the step is no longer live, with the step as it ended.
    WaitStep { step: StepId },
    /// `signal` to every task of the step.
    SignalStep { step: StepId, signal: i32 },
    /// The output of task `task` (its rank) of the step, from the node it runs on: answered
    /// `Streaming`, then the output's raw bytes until that node's tasks of the step are gone.
    ReadOutput { step: StepId, task: u32 },
}

/// The answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Step(Box<JobStep>),
    Signalled,
    /// The raw output follows, until the connection closes.
    Streaming,
    Error(String),
}

/// A new run secret: 32 random bytes, hex.
pub(crate) fn mint_secret() -> String {
    let mut bytes = [0u8; 32];
    if let Err(e) = std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
    {
        // Without randomness no secret is safe: this one never matches a request.
        tracing::error!(error = %e, "cannot read /dev/urandom: in-job commands of this run are refused");
        return String::new();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Serves the in-job socket at `path` until the task is aborted.
pub(crate) async fn serve(path: &Path, jobs: Arc<JobTable>, link: Arc<Link>, desired: watch::Receiver<Desired>) {
    let _ = std::fs::remove_file(path);
    let listener = match UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot serve the in-job socket: srun inside jobs fails");
            return;
        }
    };
    {
        use std::os::unix::fs::PermissionsExt;
        // Every job's user connects; the run secret, not the socket's mode, decides.
        let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666));
    }
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let (jobs, link, desired) = (jobs.clone(), link.clone(), desired.clone());
        match slots.clone().try_acquire_owned() {
            Ok(permit) => {
                tokio::spawn(async move {
                    connection(stream, &jobs, &link, desired).await;
                    drop(permit);
                });
            }
            Err(_) => {
                tokio::spawn(async move {
                    let mut stream = stream;
                    let _ = write_reply(&mut stream, &Reply::Error("the node's in-job service is busy: retry".into()))
                        .await;
                });
            }
        }
    }
}

async fn write_reply(stream: &mut UnixStream, reply: &Reply) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(reply).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line).await
}

async fn connection(mut stream: UnixStream, jobs: &JobTable, link: &Link, desired: watch::Receiver<Desired>) {
    let mut line = String::new();
    let read = BufReader::new((&mut stream).take(MAX_REQUEST_BYTES)).read_line(&mut line).await;
    let reply = match read {
        Ok(_) if line.ends_with('\n') => match serde_json::from_str::<Request>(&line) {
            Ok(Request { secret, call: Call::ReadOutput { step, task } }) => {
                return relay_output(stream, &secret, step, task, jobs, link).await;
            }
            Ok(request) => answer(request, jobs, link, desired).await,
            Err(e) => Reply::Error(format!("malformed request: {e}")),
        },
        Ok(_) => Reply::Error(format!("request too long or cut off (at most {MAX_REQUEST_BYTES} bytes)")),
        Err(e) => Reply::Error(format!("cannot read the request: {e}")),
    };
    let _ = write_reply(&mut stream, &reply).await;
}

/// Answers `Streaming` and relays task `task`'s output of `step` of the caller's job, or
/// answers why not.
async fn relay_output(mut stream: UnixStream, secret: &str, step: StepId, task: u32, jobs: &JobTable, link: &Link) {
    let Some((job_id, _)) = jobs.run_of_secret(secret) else {
        let _ = write_reply(&mut stream, &Reply::Error(NO_RUN.into())).await;
        return;
    };
    let mut output = match link.read_step_output(job_id, step, task).await {
        Ok(output) => output,
        Err(e) => {
            let _ = write_reply(&mut stream, &Reply::Error(e)).await;
            return;
        }
    };
    if write_reply(&mut stream, &Reply::Streaming).await.is_err() {
        return;
    }
    loop {
        match output.message().await {
            Ok(Some(chunk)) => {
                if stream.write_all(&chunk.data).await.is_err() {
                    return; // srun went away
                }
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(job_id, step, task, error = %e, "the output of a step's task stopped coming");
                return;
            }
        }
    }
}

async fn answer(request: Request, jobs: &JobTable, link: &Link, desired: watch::Receiver<Desired>) -> Reply {
    let Some((job_id, epoch)) = jobs.run_of_secret(&request.secret) else {
        return Reply::Error(NO_RUN.into());
    };
    match request.call {
        Call::CreateStep { request_id, spec } => {
            if let Err(e) = spec.validate() {
                return Reply::Error(e);
            }
            match link.create_step(job_id, epoch, request_id, &spec).await {
                Ok(step) => Reply::Step(Box::new(step)),
                Err(e) => Reply::Error(e),
            }
        }
        Call::SignalStep { step, signal } => match link.signal_step(job_id, step, signal).await {
            Ok(_) => Reply::Signalled,
            Err(e) => Reply::Error(e),
        },
        Call::WaitStep { step } => wait_step(job_id, epoch, step, desired).await,
        // Served by `relay_output` before any answer.
        Call::ReadOutput { .. } => Reply::Error("an output read is a stream of its own".into()),
    }
}

/// The step once the desired state shows it ended (or its run gone).
async fn wait_step(job_id: JobId, epoch: u64, step: StepId, mut desired: watch::Receiver<Desired>) -> Reply {
    loop {
        {
            let now = desired.borrow_and_update();
            if now.revision > 0 {
                let Some(job) = now.jobs.get(&job_id).filter(|d| d.epoch == epoch) else {
                    return Reply::Error(format!("job {job_id} no longer runs here: its steps ended with it"));
                };
                match job.job.steps.steps.iter().find(|s| s.id == step && s.epoch == epoch) {
                    Some(s) if !s.state.is_live() => return Reply::Step(Box::new(s.clone())),
                    Some(_) => {}
                    None => {
                        // Not in the desired state yet (it lags the create by a push), or gone.
                        if job.job.steps.next_id > step {
                            return Reply::Error(format!("step {job_id}.{step} is no longer kept"));
                        }
                    }
                }
            }
        }
        if desired.changed().await.is_err() {
            return Reply::Error("the worker is shutting down".into());
        }
    }
}
