//! The one test fixture of the executor's tests: an executor with a cgroup root of its own, a
//! temp dir holding the job's work dir (and a container image), launch specs and log reads.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{ExecError, JobExit, LaunchSpec, ProcessExecutor, ResourceLimits, RuncExecutor, RunningJob};

/// Executors whose cgroup root a fixture removes when the test ends.
pub(crate) trait TestExecutor {
    fn remove_root_cgroup(&self) -> Result<(), ExecError>;
}

impl TestExecutor for ProcessExecutor {
    fn remove_root_cgroup(&self) -> Result<(), ExecError> {
        ProcessExecutor::remove_root_cgroup(self)
    }
}

impl TestExecutor for RuncExecutor {
    fn remove_root_cgroup(&self) -> Result<(), ExecError> {
        RuncExecutor::remove_root_cgroup(self)
    }
}

/// A cgroup root no other test (or test process) uses: tests run in parallel.
pub(crate) fn unique_cgroup_root(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{prefix}-{}-{}-{nanos}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Whether the tests run as root, which `test` needs (it runs a job as another user). When they
/// do not, says loudly that `test` is skipped; under `CI` it fails instead.
pub(crate) fn root_for(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "{test} needs root: CI runs the worker's tests as root");
    // Past the test harness's capture of `eprintln!`: a skip is seen.
    let banner = "!".repeat(78);
    let _ = writeln!(
        std::io::stderr(),
        "\n{banner}\nSKIPPING {test}: it needs root (under CI it fails instead)\n{banner}\n"
    );
    false
}

/// One test's executor and temp dir; the executor's root cgroup is removed on drop.
pub(crate) struct Fixture<E: TestExecutor> {
    pub(crate) executor: E,
    pub(crate) dir: tempfile::TempDir,
    /// Set for container tests: every spec runs in this rootfs.
    pub(crate) image: Option<PathBuf>,
    job_id: u64,
    attempt: u64,
}

impl<E: TestExecutor> Fixture<E> {
    pub(crate) fn with(executor: E, dir: tempfile::TempDir, image: Option<PathBuf>, job_id: u64, attempt: u64) -> Self {
        Fixture { executor, dir, image, job_id, attempt }
    }

    /// A spec running `argv` in `<dir>/job`, without limits.
    pub(crate) fn spec(&self, argv: &[&str]) -> LaunchSpec {
        LaunchSpec {
            job_id: self.job_id,
            attempt: self.attempt,
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            env: BTreeMap::new(),
            work_dir: self.dir.path().join("job"),
            work_files: Vec::new(),
            limits: ResourceLimits::default(),
            uid: None,
            gid: None,
            image: self.image.clone(),
            writable_root: false,
            devices: Vec::new(),
            cdi_devices: Vec::new(),
            binds: Vec::new(),
            mounts: Vec::new(),
            files: Default::default(),
            not_after: None,
        }
    }

    /// One of the job's log files.
    pub(crate) fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join("job").join(name)).expect("log file")
    }

    /// Waits for the job at most `deadline`; kills it and fails the test (with its stderr) past
    /// that.
    pub(crate) async fn wait_bounded(&self, job: &mut RunningJob, deadline: Duration) -> JobExit {
        match tokio::time::timeout(deadline, job.wait()).await {
            Ok(exit) => exit,
            Err(_) => {
                let _ = job.kill_tree();
                let stderr = std::fs::read_to_string(self.dir.path().join("job").join(super::STDERR_LOG));
                panic!("job did not finish within {deadline:?}; stderr: {}", stderr.unwrap_or_default());
            }
        }
    }
}

impl<E: TestExecutor> Drop for Fixture<E> {
    fn drop(&mut self) {
        if let Err(e) = self.executor.remove_root_cgroup() {
            eprintln!("cleanup: {e}");
        }
    }
}
