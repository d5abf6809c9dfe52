//! Job executor: runs a job as a real process inside its own cgroup with resource limits, logs
//! to files in its work dir, reports the exit status and OOM kills, and kills the whole process
//! tree.
//!
//! Each launch gets the cgroup `<root>/job-<id>-<attempt>` (root `corral` by default) in every
//! hierarchy on cgroup v1, or in the unified tree on v2. The main process joins it in the child
//! before exec (`spawn.rs`: a vfork-style clone, not a copy of the worker), so neither it nor
//! anything it forks ever runs outside. [`RunningJob::wait`] waits for the main process, kills
//! whatever is left in the cgroup, reads the OOM counter and removes the cgroup.
//!
//! Boundary: this module knows cgroupfs and process spawning; it knows nothing about GPUs,
//! scheduling or the coordinator. Callers must be inside a tokio runtime.

mod cdi;
mod cgroup;
mod process;
mod runc;
mod spawn;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tracing::{debug, error, info, warn};

use cgroup::JobCgroup;
pub use cgroup::{CgroupUsage, CgroupVersion};
pub use process::{STDERR_LOG, STDOUT_LOG};
pub use runc::{RuncConfig, RuncExecutor};

/// How long [`RunningJob::wait`] keeps killing leftovers before giving up on removing the cgroup.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// How long to wait for killed processes to disappear before killing again.
const DRAIN_ROUND: Duration = Duration::from_millis(500);

/// Interval between checks of whether the cgroup is empty.
const DRAIN_POLL: Duration = Duration::from_millis(5);

/// Resource limits enforced by the job's cgroup; `None` means unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceLimits {
    /// Memory limit in bytes (`memory.max` / `memory.limit_in_bytes`); swap is limited too so
    /// that exceeding it means an OOM kill.
    pub memory_bytes: Option<u64>,
    /// CPU bandwidth in thousandths of a core: 1000 = one core, 250 = a quarter (CFS quota over
    /// a 100 ms period). At least 10.
    pub cpu_millis: Option<u32>,
    /// Maximum number of processes and threads (`pids.max`).
    pub pids_max: Option<u64>,
    /// Open file descriptors per process (`RLIMIT_NOFILE`, soft = hard).
    pub open_files: Option<u64>,
}

/// What to run and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpec {
    pub job_id: u64,
    /// Part of the cgroup name (`<root>/job-<id>-<attempt>`), so a retry never meets the
    /// leftovers of an earlier attempt.
    pub attempt: u64,
    /// Program and arguments; `argv[0]` is looked up in the job's PATH unless it contains `/`
    /// (relative paths are taken from `work_dir`).
    pub argv: Vec<String>,
    /// Added on top of the minimal environment `PATH`, `HOME=<work_dir>`, `LANG=C`.
    pub env: BTreeMap<String, String>,
    /// Absolute; created when missing (and then owned by `uid`/`gid`). The job's cwd; its stdout
    /// and stderr are appended to [`STDOUT_LOG`] and [`STDERR_LOG`] in it.
    pub work_dir: PathBuf,
    pub limits: ResourceLimits,
    /// User to run as (setuid in the child); `None` keeps the worker's.
    pub uid: Option<u32>,
    /// Group to run as (setgid, and the only supplementary group); `None` keeps the worker's.
    pub gid: Option<u32>,
    /// Unpacked root filesystem to run the job in, as an OCI container; `None` runs a bare
    /// process. Only container executors ([`RuncExecutor`]) accept it.
    pub image: Option<PathBuf>,
    /// Host device nodes a container gets (GPUs, InfiniBand), on top of the defaults. Bare
    /// processes see the host's /dev anyway.
    pub devices: Vec<PathBuf>,
    /// Fully qualified CDI device names (`nvidia.com/gpu=GPU-...`); a container executor that
    /// finds them in a CDI spec applies their edits instead of adding GPU nodes from `devices`.
    pub cdi_devices: Vec<String>,
    /// Host directories a container sees at the same path (e.g. the MPS pipe directory).
    pub binds: Vec<PathBuf>,
}

/// How a job's main process ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobExit {
    /// Exit code when the main process exited normally.
    pub exit_code: Option<i32>,
    /// Signal number when the main process was killed by a signal.
    pub signal: Option<i32>,
    /// The kernel OOM killer killed at least one process of the job.
    pub oom_killed: bool,
    /// From spawn to the main process's exit (monotonic clock).
    pub run_time: Duration,
}

impl JobExit {
    /// Exited with code 0 and nothing was OOM-killed.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0) && !self.oom_killed
    }
}

/// Errors of the executor.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("invalid launch spec: {0}")]
    InvalidSpec(String),
    #[error("invalid cgroup root {0:?}: use a relative path of plain names such as \"corral\"")]
    InvalidCgroupRoot(String),
    #[error("program {program:?} not found in PATH {path:?}: install it or give its absolute path as argv[0]")]
    ProgramNotFound { program: String, path: String },
    #[error("cannot prepare {}: {source}; check that the parent directory exists and the worker may write there", path.display())]
    WorkDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cgroup controller {controller} is unavailable for {cgroup}: {hint}")]
    ControllerUnavailable { controller: &'static str, cgroup: String, hint: &'static str },
    #[error("cannot {action} cgroup {cgroup}: {source}; check that the worker runs as root and cgroupfs is mounted read-write")]
    Cgroup {
        action: &'static str,
        cgroup: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("cgroup {cgroup} still holds processes {pids:?}: kill them or launch with a new attempt number")]
    CgroupBusy { cgroup: String, pids: Vec<u32> },
    #[error("cannot start {program}: {source}; check that it is executable and that uid, gid and work dir are valid")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot signal the processes of cgroup {cgroup}: {detail}; retry, or inspect the cgroup by hand")]
    Signal { cgroup: String, detail: String },
    #[error("this worker runs no containers, so it cannot run image {0}: configure a container runtime (executor.runc) in the worker config, or submit without --image")]
    NoContainerRuntime(String),
    #[error("runc not found ({0}): install it (apt-get install runc) or set executor.runc to its path")]
    RuncNotFound(String),
    #[error("cannot write the container bundle {}: {source}; check that the worker may write there", path.display())]
    Bundle {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Starts jobs. Implementations: [`ProcessExecutor`] (bare process in a cgroup),
/// [`RuncExecutor`] (OCI container in a cgroup) and [`RoutingExecutor`] (picks one per job).
pub trait Executor: Send + Sync + 'static {
    /// Starts the job and returns once its main process runs. Must be called inside a tokio
    /// runtime; does a little blocking filesystem work (cgroupfs, work dir).
    fn launch(&self, spec: &LaunchSpec) -> Result<RunningJob, ExecError>;

    /// Kills and removes whatever an earlier worker process on this host left running.
    fn reap_leftovers(&self) -> Result<Vec<String>, ExecError>;
}

/// Kills (SIGKILL, without removing them) the processes of every job cgroup under
/// `cgroup_root`, whichever executor made them; returns the cgroups that had processes. Blocking.
pub fn kill_job_cgroups(cgroup_root: &str) -> Result<Vec<String>, ExecError> {
    if !cgroup::validate_relative_name(cgroup_root) {
        return Err(ExecError::InvalidCgroupRoot(cgroup_root.to_owned()));
    }
    cgroup::kill_job_cgroups(CgroupVersion::detect(), cgroup_root.trim_end_matches('/'))
}

/// Runs each job as a plain process in its own cgroup under a common root cgroup.
#[derive(Clone, Debug)]
pub struct ProcessExecutor {
    cgroup_root: String,
    version: CgroupVersion,
}

impl Default for ProcessExecutor {
    /// Root cgroup `corral`, cgroup version detected from the host.
    fn default() -> Self {
        Self { cgroup_root: Self::DEFAULT_CGROUP_ROOT.to_owned(), version: CgroupVersion::detect() }
    }
}

impl ProcessExecutor {
    /// Root cgroup under which job cgroups are created by default.
    pub const DEFAULT_CGROUP_ROOT: &'static str = "corral";

    /// An executor putting job cgroups under `cgroup_root` (relative to each hierarchy's root,
    /// e.g. `corral` or `corral/worker-3`), with the cgroup version detected from the host.
    pub fn new(cgroup_root: impl Into<String>) -> Result<Self, ExecError> {
        let cgroup_root = cgroup_root.into();
        if !cgroup::validate_relative_name(&cgroup_root) {
            return Err(ExecError::InvalidCgroupRoot(cgroup_root));
        }
        Ok(Self { cgroup_root: cgroup_root.trim_end_matches('/').to_owned(), version: CgroupVersion::detect() })
    }

    pub fn cgroup_root(&self) -> &str {
        &self.cgroup_root
    }

    pub fn cgroup_version(&self) -> CgroupVersion {
        self.version
    }

    /// The cgroup path of one attempt of a job, relative to the hierarchy root(s).
    pub fn job_cgroup_name(&self, job_id: u64, attempt: u64) -> String {
        format!("{}/job-{job_id}-{attempt}", self.cgroup_root)
    }

    /// Removes the root cgroup itself (e.g. at worker shutdown). Fails while job cgroups remain
    /// under it; succeeds when it does not exist.
    pub fn remove_root_cgroup(&self) -> Result<(), ExecError> {
        cgroup::remove_empty_cgroup(self.version, &self.cgroup_root)
    }
}

impl Executor for ProcessExecutor {
    /// Kills and removes job cgroups left under the root by an earlier worker process (one that
    /// was killed before it could clean up). Call once at start-up, before launching anything.
    fn reap_leftovers(&self) -> Result<Vec<String>, ExecError> {
        cgroup::reap_job_cgroups(self.version, &self.cgroup_root)
    }

    fn launch(&self, spec: &LaunchSpec) -> Result<RunningJob, ExecError> {
        if let Some(image) = &spec.image {
            return Err(ExecError::NoContainerRuntime(image.display().to_string()));
        }
        process::validate(spec)?;
        let env = process::environment(spec);
        let path_var = env.get("PATH").map_or(process::DEFAULT_PATH, String::as_str);
        let argv0 = spec.argv.first().map_or("", String::as_str);
        let program = process::resolve_program(argv0, path_var, &spec.work_dir)?;
        let (stdout, stderr) = process::prepare_work_dir(spec)?;

        let name = self.job_cgroup_name(spec.job_id, spec.attempt);
        let cgroup = JobCgroup::create(self.version, &name, &spec.limits)?;
        let cgroup_procs = match cgroup.open_procs_files() {
            Ok(files) => files,
            Err(e) => {
                cgroup.remove_quietly();
                return Err(e);
            }
        };
        let started = Instant::now();
        let plan = process::SpawnPlan { spec, program, env, stdout, stderr, cgroup_procs };
        let child = match process::spawn(plan) {
            Ok(child) => child,
            Err(e) => {
                // The child may have joined the cgroup before failing to exec.
                if let Err(kill) = cgroup.kill_all() {
                    warn!(cgroup = %name, error = %kill, "cannot kill a failed launch");
                }
                cgroup.remove_quietly();
                return Err(e);
            }
        };
        let pid = child.id();
        info!(
            job_id = spec.job_id,
            attempt = spec.attempt,
            pid,
            cgroup = %name,
            "job started"
        );
        Ok(RunningJob {
            child: MainProcess::Job(child),
            started,
            main_exit: None,
            exit: None,
            shared: Arc::new(Shared { job_id: spec.job_id, attempt: spec.attempt, pid, cgroup, container: None }),
        })
    }
}

/// Sends jobs with an image to a container executor and the others to a process executor.
pub struct RoutingExecutor {
    process: Arc<dyn Executor>,
    container: Arc<dyn Executor>,
}

impl RoutingExecutor {
    pub fn new(process: Arc<dyn Executor>, container: Arc<dyn Executor>) -> Self {
        RoutingExecutor { process, container }
    }
}

impl Executor for RoutingExecutor {
    fn launch(&self, spec: &LaunchSpec) -> Result<RunningJob, ExecError> {
        match spec.image {
            Some(_) => self.container.launch(spec),
            None => self.process.launch(spec),
        }
    }

    /// Containers first: their runtime state goes with them.
    fn reap_leftovers(&self) -> Result<Vec<String>, ExecError> {
        let mut reaped = self.container.reap_leftovers()?;
        reaped.extend(self.process.reap_leftovers()?);
        Ok(reaped)
    }
}

/// State shared between a [`RunningJob`] and its [`JobHandle`]s.
#[derive(Debug)]
struct Shared {
    job_id: u64,
    attempt: u64,
    pid: u32,
    cgroup: JobCgroup,
    /// Set when the main process is `runc run`: its state to delete after the exit.
    container: Option<runc::Container>,
}

impl Shared {
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
        // the group id cannot have been reused.
        if pids.contains(&self.pid) {
            if let Ok(pgid) = i32::try_from(self.pid) {
                match killpg(Pid::from_raw(pgid), signal) {
                    Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                    Err(e) => {
                        return Err(ExecError::Signal {
                            cgroup: self.cgroup.name().to_owned(),
                            detail: format!("killpg({pgid}, {signal}): {e}"),
                        })
                    }
                }
            }
        }
        let sent = self.cgroup.signal_all(signal)?;
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
        if let Some(container) = self.container.clone() {
            if let Err(e) = tokio::task::spawn_blocking(move || container.delete()).await {
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
}

/// The main process of a job: spawned by the process executor, or a `runc run` started by
/// tokio.
#[derive(Debug)]
enum MainProcess {
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
}

impl RunningJob {
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
                    Ok(status) if self.shared.container.is_some() => {
                        let (code, signal) = runc::container_status(status.code(), status.signal());
                        (code, signal, run_time)
                    }
                    Ok(status) => (status.code(), status.signal(), run_time),
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

#[cfg(test)]
mod tests {
    //! These tests use real cgroups and processes, so they need root (the worker's CI runs as
    //! root). Each test has its own cgroup root so they can run in parallel.

    use super::*;
    use std::fs;
    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};

    const DEADLINE: Duration = Duration::from_secs(30);

    /// A unique cgroup root and a temp dir for one test; removes both on drop.
    struct Fixture {
        executor: ProcessExecutor,
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let root = format!("corral-test-{}-{}-{nanos}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
            let executor = ProcessExecutor::new(root).expect("valid root");
            let dir = tempfile::tempdir().expect("tempdir");
            Self { executor, dir }
        }

        fn spec(&self, argv: &[&str]) -> LaunchSpec {
            LaunchSpec {
                job_id: 7,
                attempt: 0,
                argv: argv.iter().map(|a| (*a).to_owned()).collect(),
                env: BTreeMap::new(),
                work_dir: self.dir.path().join("job"),
                limits: ResourceLimits::default(),
                uid: None,
                gid: None,
                image: None,
                devices: Vec::new(),
                cdi_devices: Vec::new(),
                binds: Vec::new(),
            }
        }

        fn log(&self, name: &str) -> String {
            fs::read_to_string(self.dir.path().join("job").join(name)).expect("log file")
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            if let Err(e) = self.executor.remove_root_cgroup() {
                eprintln!("cleanup: {e}");
            }
        }
    }

    async fn wait_bounded(job: &mut RunningJob) -> JobExit {
        match tokio::time::timeout(DEADLINE, job.wait()).await {
            Ok(exit) => exit,
            Err(_) => {
                let _ = job.kill_tree();
                panic!("job did not finish within {DEADLINE:?}");
            }
        }
    }

    /// Polls until the job's cgroup holds `n` processes.
    async fn wait_for_pids(job: &RunningJob, n: usize) -> Vec<u32> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let pids = job.pids().expect("pids");
            if pids.len() == n {
                return pids;
            }
            assert!(Instant::now() < deadline, "expected {n} processes, have {pids:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Gone, or a zombie nobody reaps yet (orphans are reparented to init): either way not running.
    fn is_dead(pid: u32) -> bool {
        match fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => {
                let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
                matches!(state.and_then(|s| s.chars().next()), Some('Z' | 'X'))
            }
        }
    }

    fn assert_cgroup_removed(dirs: &[PathBuf]) {
        for dir in dirs {
            assert!(!dir.exists(), "{} still exists", dir.display());
        }
    }

    #[tokio::test]
    async fn exit_code_and_log_files() {
        let fx = Fixture::new();
        let spec = fx.spec(&["sh", "-c", "echo hi; echo err >&2; exit 3"]);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let dirs = job.shared.cgroup.dirs().to_vec();
        assert!(dirs.iter().all(|d| d.ends_with("job-7-0")), "{dirs:?}");
        let exit = wait_bounded(&mut job).await;
        assert_eq!(exit.exit_code, Some(3));
        assert_eq!(exit.signal, None);
        assert!(!exit.oom_killed);
        assert!(!exit.success());
        assert_eq!(fx.log(STDOUT_LOG), "hi\n");
        assert_eq!(fx.log(STDERR_LOG), "err\n");
        assert_cgroup_removed(&dirs);
        // A second wait returns the same result.
        assert_eq!(job.wait().await, exit);
    }

    #[tokio::test]
    async fn logs_append_across_attempts() {
        let fx = Fixture::new();
        for attempt in 0..2 {
            let mut spec = fx.spec(&["echo", "run"]);
            spec.attempt = attempt;
            let mut job = fx.executor.launch(&spec).expect("launch");
            assert!(wait_bounded(&mut job).await.success());
        }
        assert_eq!(fx.log(STDOUT_LOG), "run\nrun\n");
    }

    #[tokio::test]
    async fn process_joins_the_cgroup_before_exec() {
        let fx = Fixture::new();
        // cat is the main process itself: what it prints is where it was when it started.
        let spec = fx.spec(&["cat", "/proc/self/cgroup"]);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let exit = wait_bounded(&mut job).await;
        assert_eq!(exit.exit_code, Some(0));
        let wanted = format!("/{}", fx.executor.job_cgroup_name(7, 0));
        let out = fx.log(STDOUT_LOG);
        let lines: Vec<&str> = out.lines().collect();
        match fx.executor.cgroup_version() {
            CgroupVersion::V2 => assert!(lines.contains(&format!("0::{wanted}").as_str()), "{out}"),
            CgroupVersion::V1 => {
                for controller in ["memory", "pids", "freezer"] {
                    assert!(
                        lines.iter().any(|l| {
                            let mut parts = l.splitn(3, ':');
                            let _id = parts.next();
                            let names = parts.next().unwrap_or("");
                            let path = parts.next().unwrap_or("");
                            names.split(',').any(|n| n == controller) && path == wanted
                        }),
                        "{controller} not in {wanted}: {out}"
                    );
                }
            }
        }
    }

    #[tokio::test]
    async fn environment_cwd_and_identity() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&[
            "sh",
            "-c",
            "pwd; echo \"$HOME\"; echo \"$LANG\"; echo \"$CORRAL_X\"; echo \"${CARGO_PKG_NAME-unset}\"; id -u; id -g; id -G; touch owned",
        ]);
        spec.env.insert("CORRAL_X".to_owned(), "42".to_owned());
        spec.uid = Some(65534);
        spec.gid = Some(65534);
        // Let the unprivileged job reach its work dir.
        fs::set_permissions(fx.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        let mut job = fx.executor.launch(&spec).expect("launch");
        let exit = wait_bounded(&mut job).await;
        assert_eq!(exit.exit_code, Some(0), "stderr: {}", fx.log(STDERR_LOG));
        let work_dir = spec.work_dir.display().to_string();
        let expected = format!("{work_dir}\n{work_dir}\nC\n42\nunset\n65534\n65534\n65534\n");
        assert_eq!(fx.log(STDOUT_LOG), expected);
        use std::os::unix::fs::MetadataExt;
        let owned = fs::metadata(spec.work_dir.join("owned")).expect("file made by the job");
        assert_eq!((owned.uid(), owned.gid()), (65534, 65534));
    }

    #[tokio::test]
    async fn memory_hog_is_oom_killed() {
        let fx = Fixture::new();
        // dash keeps the whole command substitution (200 MB) in its own heap, so the main
        // process itself is the biggest one and the OOM killer's victim.
        let mut spec = fx.spec(&["sh", "-c", "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived ${#x}"]);
        spec.limits.memory_bytes = Some(64 * 1024 * 1024);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let dirs = job.shared.cgroup.dirs().to_vec();
        let exit = wait_bounded(&mut job).await;
        assert!(exit.oom_killed, "{exit:?}");
        assert_eq!(exit.signal, Some(libc::SIGKILL), "{exit:?}");
        assert_eq!(exit.exit_code, None);
        assert_eq!(fx.log(STDOUT_LOG), "");
        assert_cgroup_removed(&dirs);
    }

    #[tokio::test]
    async fn small_job_under_memory_limit_is_not_oom_killed() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&["sh", "-c", "x=$(head -c 1000000 /dev/zero | tr '\\0' a); echo ${#x}"]);
        spec.limits.memory_bytes = Some(64 * 1024 * 1024);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let exit = wait_bounded(&mut job).await;
        assert!(exit.success(), "{exit:?}");
        assert_eq!(fx.log(STDOUT_LOG), "1000000\n");
    }

    #[tokio::test]
    async fn kill_tree_kills_every_process_and_removes_the_cgroup() {
        let fx = Fixture::new();
        let spec = fx.spec(&["sh", "-c", "sleep 1000 & sleep 1000 & wait"]);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let pids = wait_for_pids(&job, 3).await;
        assert!(pids.contains(&job.pid()));
        let dirs = job.shared.cgroup.dirs().to_vec();
        let handle = job.handle();
        let waiter = tokio::spawn(async move { wait_bounded(&mut job).await });
        handle.kill_tree().expect("kill_tree");
        let exit = waiter.await.expect("wait task");
        assert_eq!(exit.signal, Some(libc::SIGKILL), "{exit:?}");
        assert!(!exit.oom_killed);
        for pid in pids {
            assert!(is_dead(pid), "pid {pid} survived");
        }
        assert_cgroup_removed(&dirs);
        // Killing a finished job is a no-op.
        handle.kill_tree().expect("kill_tree after exit");
        handle.signal_tree(Signal::SIGTERM).expect("signal_tree after exit");
    }

    #[tokio::test]
    async fn reap_leftovers_kills_jobs_of_a_dead_worker() {
        let fx = Fixture::new();
        let spec = fx.spec(&["sh", "-c", "sleep 1000 & sleep 1000 & wait"]);
        let job = fx.executor.launch(&spec).expect("launch");
        let pids = wait_for_pids(&job, 3).await;
        let dirs = job.shared.cgroup.dirs().to_vec();
        // A worker killed with SIGKILL never runs its clean-up: forget the job like it would.
        std::mem::forget(job);
        let next_worker = ProcessExecutor::new(fx.executor.cgroup_root()).expect("same root");
        let reaped = next_worker.reap_leftovers().expect("reap");
        assert_eq!(reaped, vec![fx.executor.job_cgroup_name(7, 0)]);
        let deadline = Instant::now() + DEADLINE;
        while !pids.iter().all(|pid| is_dead(*pid)) {
            assert!(Instant::now() < deadline, "some of {pids:?} survived the reaping");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_cgroup_removed(&dirs);
        assert!(next_worker.reap_leftovers().expect("reap again").is_empty());
    }

    #[tokio::test]
    async fn kill_tree_reaches_processes_that_left_the_session() {
        let fx = Fixture::new();
        // setsid puts the grandchild in its own session: a process-group kill would miss it.
        let spec = fx.spec(&["sh", "-c", "setsid sleep 1000 & wait"]);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let pids = wait_for_pids(&job, 2).await;
        job.kill_tree().expect("kill_tree");
        // kill_tree alone must do it: check before wait() gets a chance to kill leftovers.
        let deadline = Instant::now() + DEADLINE;
        while !pids.iter().all(|pid| is_dead(*pid)) {
            assert!(Instant::now() < deadline, "some of {pids:?} survived kill_tree");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let exit = wait_bounded(&mut job).await;
        assert_eq!(exit.signal, Some(libc::SIGKILL));
    }

    #[tokio::test]
    async fn wait_kills_leftovers_of_an_exited_main_process() {
        let fx = Fixture::new();
        let spec = fx.spec(&["sh", "-c", "sleep 1000 & echo $!"]);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let dirs = job.shared.cgroup.dirs().to_vec();
        let exit = wait_bounded(&mut job).await;
        assert_eq!(exit.exit_code, Some(0));
        let orphan: u32 = fx.log(STDOUT_LOG).trim().parse().expect("pid");
        assert!(is_dead(orphan), "orphan {orphan} survived");
        assert_cgroup_removed(&dirs);
    }

    #[tokio::test]
    async fn signal_tree_delivers_sigterm() {
        let fx = Fixture::new();
        let spec = fx.spec(&["sh", "-c", "trap 'exit 7' TERM; sleep 1000 & wait"]);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let pids = wait_for_pids(&job, 2).await;
        job.signal_tree(Signal::SIGTERM).expect("signal_tree");
        let exit = wait_bounded(&mut job).await;
        assert_eq!(exit.exit_code, Some(7), "{exit:?}");
        for pid in pids {
            assert!(is_dead(pid), "pid {pid} survived");
        }
    }

    #[tokio::test]
    async fn pids_limit_stops_forks() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&[
            "sh",
            "-c",
            "i=0; while [ $i -lt 20 ]; do sleep 1000 & i=$((i+1)); done; echo all started; wait",
        ]);
        spec.limits.pids_max = Some(5);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let exit = wait_bounded(&mut job).await;
        assert_ne!(exit.exit_code, Some(0), "{exit:?}");
        assert!(fx.log(STDERR_LOG).contains("fork"), "{}", fx.log(STDERR_LOG));
        assert_eq!(fx.log(STDOUT_LOG), "");
    }

    #[tokio::test]
    async fn cpu_limit_sets_the_cfs_quota() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&["sleep", "1000"]);
        spec.limits.cpu_millis = Some(250);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let read = |dir: &Path, file: &str| -> Option<String> {
            fs::read_to_string(dir.join(file)).ok().map(|s| s.trim().to_owned())
        };
        let dirs = job.shared.cgroup.dirs().to_vec();
        let quota: Vec<String> = match fx.executor.cgroup_version() {
            CgroupVersion::V2 => dirs.iter().filter_map(|d| read(d, "cpu.max")).collect(),
            CgroupVersion::V1 => dirs
                .iter()
                .filter_map(|d| Some(format!("{} {}", read(d, "cpu.cfs_quota_us")?, read(d, "cpu.cfs_period_us")?)))
                .collect(),
        };
        job.kill_tree().expect("kill_tree");
        let exit = wait_bounded(&mut job).await;
        assert_eq!(quota, vec!["25000 100000".to_owned()]);
        assert_eq!(exit.signal, Some(libc::SIGKILL));
    }

    #[tokio::test]
    async fn open_files_limit_is_applied() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&["sh", "-c", "ulimit -n"]);
        spec.limits.open_files = Some(321);
        let mut job = fx.executor.launch(&spec).expect("launch");
        assert!(wait_bounded(&mut job).await.success());
        assert_eq!(fx.log(STDOUT_LOG), "321\n");
    }

    #[tokio::test]
    async fn a_process_executor_refuses_images() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&["true"]);
        spec.image = Some(PathBuf::from("/srv/images/busybox"));
        let err = fx.executor.launch(&spec).map(|_| ()).expect_err("image");
        assert!(matches!(err, ExecError::NoContainerRuntime(_)), "{err}");
        assert!(err.to_string().contains("/srv/images/busybox"), "{err}");
    }

    #[tokio::test]
    async fn a_busy_cgroup_is_not_reused() {
        let fx = Fixture::new();
        let spec = fx.spec(&["sleep", "1000"]);
        let mut first = fx.executor.launch(&spec).expect("launch");
        wait_for_pids(&first, 1).await;
        let second = fx.executor.launch(&spec);
        assert!(matches!(second, Err(ExecError::CgroupBusy { .. })), "{second:?}");
        first.kill_tree().expect("kill_tree");
        wait_bounded(&mut first).await;
    }

    #[tokio::test]
    async fn dropping_an_unwaited_job_kills_it() {
        let fx = Fixture::new();
        let job = fx.executor.launch(&fx.spec(&["sleep", "1000"])).expect("launch");
        let pid = job.pid();
        let dirs = job.shared.cgroup.dirs().to_vec();
        drop(job);
        let deadline = Instant::now() + DEADLINE;
        while !(is_dead(pid) && dirs.iter().all(|d| !d.exists())) {
            assert!(Instant::now() < deadline, "dropped job {pid} or its cgroup survived");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn bad_specs_are_refused_without_leaving_a_cgroup() {
        let fx = Fixture::new();
        let missing = fx.spec(&["no-such-program-corral"]);
        let err = fx.executor.launch(&missing).map(|_| ()).expect_err("missing program");
        assert!(matches!(err, ExecError::ProgramNotFound { .. }), "{err}");
        assert!(err.to_string().starts_with("program \"no-such-program-corral\" not found"));

        let empty = fx.spec(&[]);
        assert!(matches!(fx.executor.launch(&empty), Err(ExecError::InvalidSpec(_))));

        let mut relative = fx.spec(&["true"]);
        relative.work_dir = PathBuf::from("relative/dir");
        assert!(matches!(fx.executor.launch(&relative), Err(ExecError::InvalidSpec(_))));

        let file = fx.dir.path().join("file");
        fs::write(&file, "").expect("write");
        let mut under_file = fx.spec(&["true"]);
        under_file.work_dir = file.join("job");
        assert!(matches!(fx.executor.launch(&under_file), Err(ExecError::WorkDir { .. })));

        let name = fx.executor.job_cgroup_name(7, 0);
        let job = JobCgroup::load_for_tests(fx.executor.cgroup_version(), &name);
        assert!(!job.exists(), "a refused launch left cgroup {name}");

        assert!(matches!(ProcessExecutor::new("../escape"), Err(ExecError::InvalidCgroupRoot(_))));
        assert!(matches!(ProcessExecutor::new("/abs"), Err(ExecError::InvalidCgroupRoot(_))));
    }

    #[tokio::test]
    async fn a_failed_exec_names_the_step_and_leaves_no_cgroup() {
        let fx = Fixture::new();
        fs::create_dir_all(fx.dir.path().join("job")).expect("work dir");
        let bogus = fx.dir.path().join("job").join("bogus");
        fs::write(&bogus, [0x7f, b'E', b'L', b'F', 0, 1, 2, 3]).expect("write");
        fs::set_permissions(&bogus, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        let err = fx.executor.launch(&fx.spec(&["./bogus"])).map(|_| ()).expect_err("not a program");
        let message = format!("{err}: {}", std::error::Error::source(&err).map(|s| s.to_string()).unwrap_or_default());
        assert!(message.contains("cannot exec the program"), "{message}");
        let name = fx.executor.job_cgroup_name(7, 0);
        let job = JobCgroup::load_for_tests(fx.executor.cgroup_version(), &name);
        assert!(!job.exists(), "a failed exec left cgroup {name}");
    }

    #[tokio::test]
    async fn jobs_start_with_default_signals_and_the_worker_keeps_its_identity() {
        let fx = Fixture::new();
        // The worker ignores SIGPIPE (as every Rust program does): the job must not inherit it.
        let mut spec = fx.spec(&["grep", "-E", "^(SigBlk|SigIgn|Uid)", "/proc/self/status"]);
        spec.uid = Some(65534);
        spec.gid = Some(65534);
        fs::set_permissions(fx.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        let mut job = fx.executor.launch(&spec).expect("launch");
        let exit = wait_bounded(&mut job).await;
        assert_eq!(exit.exit_code, Some(0), "stderr: {}", fx.log(STDERR_LOG));
        let status = fx.log(STDOUT_LOG);
        assert!(status.contains("SigBlk:\t0000000000000000"), "{status}");
        assert!(status.contains("SigIgn:\t0000000000000000"), "{status}");
        assert!(status.contains("Uid:\t65534"), "{status}");
        // The child switched its uid with raw system calls: no thread of this process changed.
        let me = fs::read_dir("/proc/self/task").expect("tasks");
        for task in me.flatten() {
            let status = fs::read_to_string(task.path().join("status")).unwrap_or_default();
            if let Some(uid) = status.lines().find(|l| l.starts_with("Uid:")) {
                assert!(uid.split_whitespace().skip(1).all(|id| id == "0"), "thread {:?}: {uid}", task.file_name());
            }
        }
    }
}
