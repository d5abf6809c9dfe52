//! A started job: its main process, its cgroup and what a container runtime left to clean up.
//! [`RunningJob::wait`] reaps the main process, kills what is left in the cgroup, reads the
//! OOM counter and removes the cgroup; [`JobHandle`]s signal or kill it from other tasks.

use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tracing::{debug, error, info, warn};

use super::cgroup::JobCgroup;
use super::spawn;
use super::{CgroupUsage, ExecError, JobExit};

/// What a container runtime adds to a job: how its main process's status reads, how one more
/// process starts in the container, and the state to remove after the exit.
pub(crate) trait ContainerRuntime: std::fmt::Debug + Send + Sync {
    /// The job's (exit code, signal) from the runtime process's own.
    fn exit_status(&self, code: Option<i32>, signal: Option<i32>) -> (Option<i32>, Option<i32>);
    /// Starts `exec` in the running container (a step's task, `corral attach`) with `stdio`,
    /// through a runtime process whose own status reads as [`Self::exit_status`] says. Also
    /// returns the file the runtime writes the process's pid (in the host's pid namespace) to.
    /// Blocking.
    fn exec(&self, exec: &ContainerExec<'_>, stdio: [&std::fs::File; 3]) -> Result<ExecStarted, ExecError>;
    /// Removes the container's state. Blocking.
    fn remove(&self);
}

/// One more process in a running container: what it runs, as whom and where (paths as the
/// container sees them).
#[derive(Debug)]
pub(crate) struct ContainerExec<'a> {
    pub(crate) argv: &'a [String],
    pub(crate) env: &'a std::collections::BTreeMap<String, String>,
    pub(crate) cwd: &'a std::path::Path,
    pub(crate) uid: Option<u32>,
    pub(crate) gid: Option<u32>,
    /// `stdio[0]` is a terminal: the process gets one of its own in the container, relayed.
    pub(crate) tty: bool,
    /// Unique among the container's execs (names its pid file).
    pub(crate) name: String,
}

/// A process started by [`ContainerRuntime::exec`]: the runtime's process (our child), and where
/// the pid of the process in the container is written once it started.
#[derive(Debug)]
pub(crate) struct ExecStarted {
    pub(crate) runtime_process: spawn::JobProcess,
    pub(crate) pid_file: std::path::PathBuf,
}

/// How long [`RunningJob::wait`] keeps killing leftovers before giving up on removing the cgroup.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// How long to wait for killed processes to disappear before killing again.
const DRAIN_ROUND: Duration = Duration::from_millis(500);

/// Interval between checks of whether the cgroup is empty.
const DRAIN_POLL: Duration = Duration::from_millis(5);

/// State shared between a [`RunningJob`] and its [`JobHandle`]s.
#[derive(Debug)]
pub(crate) struct Shared {
    job_id: u64,
    attempt: u64,
    pid: u32,
    cgroup: JobCgroup,
    /// Set when the main process is a container runtime's (`runc run`): reads its exit
    /// status and removes its state after the exit.
    pub(crate) runtime: Option<Arc<dyn ContainerRuntime>>,
}

impl Shared {
    pub(crate) fn new(
        job_id: u64,
        attempt: u64,
        pid: u32,
        cgroup: JobCgroup,
        runtime: Option<Arc<dyn ContainerRuntime>>,
    ) -> Shared {
        Shared { job_id, attempt, pid, cgroup, runtime }
    }

    fn kill_tree(&self) -> Result<(), ExecError> {
        debug!(job_id = self.job_id, attempt = self.attempt, "killing job process tree");
        self.cgroup.kill_all()
    }

    fn signal_tree(&self, signal: Signal) -> Result<(), ExecError> {
        if signal == Signal::SIGKILL {
            return self.kill_tree();
        }
        let pids = self.cgroup.pids()?;
        // The main process leads its own process group (setsid); signalling the group also
        // reaches children forked after the listing. Only while it is still in the cgroup, so
        // the group id cannot have been reused. Each process gets the signal once: the cgroup
        // pass below skips the group's members.
        let mut signalled_group = None;
        if pids.contains(&self.pid) {
            if let Ok(pgid) = i32::try_from(self.pid) {
                match killpg(Pid::from_raw(pgid), signal) {
                    Ok(()) => signalled_group = Some(pgid),
                    Err(nix::errno::Errno::ESRCH) => {}
                    Err(e) => {
                        return Err(ExecError::Signal {
                            cgroup: self.cgroup.name().to_owned(),
                            detail: format!("killpg({pgid}, {signal}): {e}"),
                        })
                    }
                }
            }
        }
        let sent = self.cgroup.signal_all(signal, signalled_group)?;
        debug!(job_id = self.job_id, attempt = self.attempt, %signal, sent, "signalled job processes");
        Ok(())
    }

    /// Kills everything left in the cgroup until it is empty (bounded), then reads the OOM
    /// counter and removes the cgroup. Returns whether anything was OOM-killed.
    async fn drain_and_remove(self: Arc<Self>) -> bool {
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut emptied = false;
        loop {
            match self.cgroup.pids() {
                Ok(pids) if pids.is_empty() => {
                    emptied = true;
                    break;
                }
                Ok(pids) => debug!(job_id = self.job_id, ?pids, "killing leftover job processes"),
                Err(e) => warn!(job_id = self.job_id, error = %e, "cannot list job processes"),
            }
            if Instant::now() >= deadline {
                break;
            }
            let shared = Arc::clone(&self);
            match tokio::task::spawn_blocking(move || shared.kill_tree()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(job_id = self.job_id, error = %e, "cannot kill leftover job processes"),
                Err(e) => warn!(job_id = self.job_id, error = %e, "kill task failed"),
            }
            let round_end = Instant::now() + DRAIN_ROUND;
            while Instant::now() < round_end {
                if matches!(self.cgroup.pids(), Ok(pids) if pids.is_empty()) {
                    break;
                }
                tokio::time::sleep(DRAIN_POLL).await;
            }
        }
        let oom_killed = self.cgroup.oom_kill_count().unwrap_or(0) > 0;
        if emptied {
            let shared = Arc::clone(&self);
            match tokio::task::spawn_blocking(move || shared.cgroup.remove()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(job_id = self.job_id, error = %e, "cannot remove job cgroup"),
                Err(e) => warn!(job_id = self.job_id, error = %e, "cgroup removal task failed"),
            }
        } else {
            error!(
                job_id = self.job_id,
                attempt = self.attempt,
                cgroup = %self.cgroup.name(),
                "job processes survive SIGKILL (stuck in the kernel?); leaving the cgroup in place"
            );
        }
        if let Some(runtime) = self.runtime.clone() {
            if let Err(e) = tokio::task::spawn_blocking(move || runtime.remove()).await {
                warn!(job_id = self.job_id, error = %e, "container clean-up task failed");
            }
        }
        oom_killed
    }
}

/// A cheap, cloneable handle to signal a running job from other tasks while one task awaits
/// [`RunningJob::wait`].
#[derive(Clone, Debug)]
pub struct JobHandle {
    shared: Arc<Shared>,
}

impl JobHandle {
    /// Pid of the job's main process.
    pub fn pid(&self) -> u32 {
        self.shared.pid
    }

    /// SIGKILLs every process of the job; see [`RunningJob::kill_tree`].
    pub fn kill_tree(&self) -> Result<(), ExecError> {
        self.shared.kill_tree()
    }

    /// Sends `signal` to every process of the job; see [`RunningJob::signal_tree`].
    pub fn signal_tree(&self, signal: Signal) -> Result<(), ExecError> {
        self.shared.signal_tree(signal)
    }

    /// Pids currently in the job's cgroup, sorted.
    pub fn pids(&self) -> Result<Vec<u32>, ExecError> {
        self.shared.cgroup.pids()
    }

    /// The job's cgroup path relative to the hierarchy root(s).
    pub fn cgroup_name(&self) -> &str {
        self.shared.cgroup.name()
    }

    /// Memory and CPU time the job's cgroup uses now (reads a few cgroup files).
    pub fn usage(&self) -> CgroupUsage {
        self.shared.cgroup.usage()
    }

    /// The job cgroup's `cgroup.procs` files, opened for writing (for a task to join it).
    pub(crate) fn cgroup_procs(&self) -> Result<Vec<std::fs::File>, ExecError> {
        self.shared.cgroup.open_procs_files()
    }

    /// The job's container runtime, when it runs in an image.
    pub(crate) fn container(&self) -> Option<&Arc<dyn ContainerRuntime>> {
        self.shared.runtime.as_ref()
    }
}

#[cfg(test)]
impl JobHandle {
    /// A handle to a job that never started (its cgroup does not exist), for the tests of what
    /// keeps handles.
    pub(crate) fn detached(job_id: u64) -> JobHandle {
        let name = format!("corral-detached/job-{job_id}-0");
        let cgroup = JobCgroup::load_for_tests(super::CgroupVersion::detect(), &name);
        JobHandle { shared: Arc::new(Shared::new(job_id, 0, 0, cgroup, None)) }
    }
}

/// The main process of a job: spawned by the process executor, or a `runc run` started by
/// tokio.
#[derive(Debug)]
pub(crate) enum MainProcess {
    Job(spawn::JobProcess),
    Runc(tokio::process::Child),
}

impl MainProcess {
    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            MainProcess::Job(process) => process.wait().await,
            MainProcess::Runc(child) => child.wait().await,
        }
    }
}

/// A started job. Call [`RunningJob::wait`] to collect it; dropping it unwaited kills the job
/// and removes its cgroup in the background.
#[derive(Debug)]
pub struct RunningJob {
    child: MainProcess,
    started: Instant,
    /// (exit code, signal, run time) once the main process was reaped.
    main_exit: Option<(Option<i32>, Option<i32>, Duration)>,
    /// The final result once `wait` completed.
    exit: Option<JobExit>,
    shared: Arc<Shared>,
    /// Threads copying the job's output into its output files too (`--stdout`/`--stderr`).
    copiers: Vec<std::thread::JoinHandle<()>>,
}

impl RunningJob {
    /// A job whose main process started at `started`.
    pub(crate) fn new(child: MainProcess, started: Instant, shared: Shared) -> RunningJob {
        RunningJob { child, started, main_exit: None, exit: None, shared: Arc::new(shared), copiers: Vec::new() }
    }

    /// With the threads that copy its output: `wait` returns once they drained it.
    pub(crate) fn with_copiers(mut self, copiers: Vec<std::thread::JoinHandle<()>>) -> RunningJob {
        self.copiers = copiers;
        self
    }

    /// The job cgroup's directories (one per hierarchy on v1).
    #[cfg(test)]
    pub(crate) fn cgroup_dirs(&self) -> Vec<std::path::PathBuf> {
        self.shared.cgroup.dirs().to_vec()
    }

    /// Pid of the job's main process (also its session and process-group id).
    pub fn pid(&self) -> u32 {
        self.shared.pid
    }

    /// A handle for killing or signalling the job from other tasks.
    pub fn handle(&self) -> JobHandle {
        JobHandle { shared: Arc::clone(&self.shared) }
    }

    /// The job's cgroup path relative to the hierarchy root(s).
    pub fn cgroup_name(&self) -> &str {
        self.shared.cgroup.name()
    }

    /// Pids currently in the job's cgroup, sorted.
    pub fn pids(&self) -> Result<Vec<u32>, ExecError> {
        self.shared.cgroup.pids()
    }

    /// Waits for the main process to exit, then kills everything left in the cgroup, reads the
    /// OOM counter and removes the cgroup. Cancel-safe; calling it again returns the same result.
    pub async fn wait(&mut self) -> JobExit {
        if let Some(exit) = &self.exit {
            return exit.clone();
        }
        let (exit_code, signal, run_time) = match self.main_exit {
            Some(main_exit) => main_exit,
            None => {
                let status = self.child.wait().await;
                let run_time = self.started.elapsed();
                let main_exit = match status {
                    Ok(status) => match &self.shared.runtime {
                        Some(runtime) => {
                            let (code, signal) = runtime.exit_status(status.code(), status.signal());
                            (code, signal, run_time)
                        }
                        None => (status.code(), status.signal(), run_time),
                    },
                    Err(e) => {
                        error!(job_id = self.shared.job_id, error = %e, "cannot wait for the job's main process");
                        (None, None, run_time)
                    }
                };
                self.main_exit = Some(main_exit);
                main_exit
            }
        };
        let oom_killed = Arc::clone(&self.shared).drain_and_remove().await;
        // Every process is gone, so the pipes are closed: the copies end at once.
        super::output::join_copiers(self.shared.job_id, std::mem::take(&mut self.copiers)).await;
        let exit = JobExit { exit_code, signal, oom_killed, run_time };
        info!(
            job_id = self.shared.job_id,
            attempt = self.shared.attempt,
            exit_code = ?exit.exit_code,
            signal = ?exit.signal,
            oom_killed,
            run_time_ms = u64::try_from(run_time.as_millis()).unwrap_or(u64::MAX),
            "job finished"
        );
        self.exit = Some(exit.clone());
        exit
    }

    /// SIGKILLs every process of the job (the whole cgroup, race-free against forks: v2
    /// `cgroup.kill`, else freeze + kill + thaw). Returns without waiting for them to exit;
    /// [`RunningJob::wait`] returns once they are gone. May block for a moment while the cgroup
    /// freezes. Use [`RunningJob::handle`] to call it while another task awaits `wait`.
    pub fn kill_tree(&self) -> Result<(), ExecError> {
        self.shared.kill_tree()
    }

    /// Sends `signal` (e.g. SIGTERM for a graceful stop) to the main process's group and to every
    /// process in the cgroup. SIGKILL is routed to [`RunningJob::kill_tree`].
    pub fn signal_tree(&self, signal: Signal) -> Result<(), ExecError> {
        self.shared.signal_tree(signal)
    }
}

impl Drop for RunningJob {
    fn drop(&mut self) {
        if self.exit.is_some() {
            return;
        }
        warn!(
            job_id = self.shared.job_id,
            attempt = self.shared.attempt,
            "running job dropped without wait; killing it"
        );
        if let Err(e) = self.shared.kill_tree() {
            warn!(job_id = self.shared.job_id, error = %e, "cannot kill dropped job");
        }
        // The dropped child is reaped in the background; the cgroup needs an async drain.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let shared = Arc::clone(&self.shared);
            runtime.spawn(async move {
                shared.drain_and_remove().await;
            });
        }
    }
}
