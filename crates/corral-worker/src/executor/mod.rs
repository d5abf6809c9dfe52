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
mod job;
mod output;
mod process;
mod routing;
mod runc;
mod spawn;
mod task;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

pub use cgroup::{CgroupUsage, CgroupVersion};
pub use job::{JobHandle, RunningJob};
pub(crate) use process::{as_fs_user, find_program, DEFAULT_PATH};
pub use process::{ProcessExecutor, SCRIPT_FILE, STDERR_LOG, STDOUT_LOG};
pub use routing::RoutingExecutor;
pub use runc::{find_runc, RuncConfig, RuncExecutor, CONTAINER_WORK_DIR};
pub use task::{step_done_marker, task_output, AttachSpec, TaskProcess, TaskSpec};

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
    /// Files written into `work_dir` before the job starts (name, contents), owned by the
    /// job's user, mode 0600: e.g. a gang's hostfile.
    pub work_files: Vec<(String, String)>,
    pub limits: ResourceLimits,
    /// User to run as (setuid in the child); `None` keeps the worker's.
    pub uid: Option<u32>,
    /// Group to run as (setgid, and the only supplementary group); `None` keeps the worker's.
    pub gid: Option<u32>,
    /// Unpacked root filesystem to run the job in, as an OCI container; `None` runs a bare
    /// process. Only container executors ([`RuncExecutor`]) accept it.
    pub image: Option<PathBuf>,
    /// The container may write its root (an image's per-job overlay); else it is read-only
    /// (a shared rootfs directory).
    pub writable_root: bool,
    /// Host device nodes a container gets (GPUs, InfiniBand), on top of the defaults. Bare
    /// processes see the host's /dev anyway.
    pub devices: Vec<PathBuf>,
    /// Fully qualified CDI device names (`nvidia.com/gpu=GPU-...`); a container executor that
    /// finds them in a CDI spec applies their edits instead of adding GPU nodes from `devices`.
    pub cdi_devices: Vec<String>,
    /// Host directories a container sees at the same path (e.g. the MPS pipe directory).
    pub binds: Vec<PathBuf>,
    /// The job's own bind mounts (`--container-mounts`), already checked against the node's
    /// allow-list; containers only.
    pub mounts: Vec<BindMount>,
    /// Working directory, batch script and output files of a Slurm-style job (bare processes
    /// only; container executors take only `cwd`, a directory inside the container).
    pub files: JobFiles,
    /// When the worker's lease runs out: a job not yet exec'd by then is not started (checked
    /// again in the child, just before exec), so a worker frozen in the middle of a launch
    /// never starts, once thawed, a run the leader may have given to another node meanwhile.
    /// `None`: no such check.
    pub not_after: Option<std::time::Instant>,
}

/// A host path bound into a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindMount {
    pub source: PathBuf,
    /// Absolute, in the container.
    pub target: PathBuf,
    pub read_only: bool,
}

/// Where a job runs and writes besides its own `work_dir`. The default runs it in `work_dir`
/// with its output in the log files only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFiles {
    /// Working directory (absolute) of the job, which must exist and be accessible to its user;
    /// `None`: `work_dir`. A relative program is found in it. In a container, a path of the
    /// container.
    pub cwd: Option<PathBuf>,
    /// A batch script, written to `<work_dir>/`[`SCRIPT_FILE`] (mode 0700, owned by the job's
    /// user) before the launch; `argv` names it.
    pub script: Option<String>,
    /// Files (absolute, on the host also for a container) that also receive the job's stdout /
    /// stderr, opened as the job's user. The same path for both gets both streams.
    pub stdout: Option<PathBuf>,
    pub stderr: Option<PathBuf>,
    /// Truncate them first (a first run), else append (a requeued run).
    pub truncate: bool,
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

/// What a launch refused because the worker's lease ran out says (the runtime reports such a
/// run as never started, and the leader places it again).
pub const LEASE_ENDED: &str = "this worker's lease ran out before the job could start";

/// Errors of the executor.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The worker's lease ran out before the job was exec'd: it did not start.
    #[error("{}", LEASE_ENDED)]
    LeaseEnded,
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
    #[error("working directory {} {reason}", path.display())]
    WorkingDir { path: PathBuf, reason: String },
    #[error("cannot open output file {}: {source}; check that the job's user may write there", path.display())]
    OutputFile {
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
    #[error("{} is not executable (permission denied): chmod +x it, or run it through its interpreter (e.g. sh {program})", path.display())]
    NotExecutable { program: String, path: PathBuf },
    #[error("program {program:?} not found: no such file {}", path.display())]
    NoSuchProgram { program: String, path: PathBuf },
    #[error("cannot run {program}: it has no #! line and is not a binary (exec format error, ENOEXEC): start it with #!/bin/sh (or the interpreter it needs), or run it as `sh {program}`")]
    NoShebang { program: String },
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

/// Removes the empty job cgroups an earlier version of the worker left directly under the
/// configured `executor.cgroup-root` (each worker now keeps its jobs under a root of its own
/// below it); returns (removed, kept: with processes, maybe another worker's).
pub fn remove_empty_legacy_job_cgroups(cgroup_root: &str) -> Result<(Vec<String>, Vec<String>), ExecError> {
    if !cgroup::validate_relative_name(cgroup_root) {
        return Err(ExecError::InvalidCgroupRoot(cgroup_root.to_owned()));
    }
    cgroup::remove_empty_job_cgroups(CgroupVersion::detect(), cgroup_root.trim_end_matches('/'))
}

/// Kills (SIGKILL, without removing them) the processes of every job cgroup under
/// `cgroup_root`, whichever executor made them; returns the cgroups that had processes. Blocking.
pub fn kill_job_cgroups(cgroup_root: &str) -> Result<Vec<String>, ExecError> {
    if !cgroup::validate_relative_name(cgroup_root) {
        return Err(ExecError::InvalidCgroupRoot(cgroup_root.to_owned()));
    }
    cgroup::kill_job_cgroups(CgroupVersion::detect(), cgroup_root.trim_end_matches('/'))
}
