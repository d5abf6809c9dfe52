//! Job cgroups on cgroup v1 (hybrid) and v2 (unified): creation with limits, membership, freezing
//! and killing every member, the OOM-kill counter, and removal.
//!
//! Creation and limits go through cgroups-rs; reading `cgroup.procs`, the OOM counters, v2
//! `cgroup.kill`/`cgroup.freeze` and the few files cgroups-rs does not cover are plain file I/O,
//! because cgroupfs is just files and cgroups-rs swallows some errors there.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use cgroups_rs::cpu::CpuController;
use cgroups_rs::freezer::{FreezerController, FreezerState};
use cgroups_rs::hierarchies::{V1, V2};
use cgroups_rs::memory::MemController;
use cgroups_rs::pid::PidController;
use cgroups_rs::{Cgroup, Controller, Hierarchy, MaxValue};
use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tracing::{debug, warn};

use super::{ExecError, ResourceLimits};

/// Mount point of the unified (v2) hierarchy on a pure cgroup v2 host.
const UNIFIED_MOUNT: &str = "/sys/fs/cgroup";

/// CFS period used for `cpu_millis` limits: 100 ms, the kernel default.
const CFS_PERIOD_US: u64 = 100_000;

/// Smallest CFS quota the kernel accepts, in microseconds.
const CFS_MIN_QUOTA_US: u64 = 1_000;

/// How long one freeze may take before we kill what we see anyway.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(1);

/// Controllers a job cgroup joins on cgroup v1 (those not mounted are skipped).
const V1_CONTROLLERS: [&str; 5] = ["memory", "cpu", "cpuacct", "pids", "freezer"];

/// Controllers a job cgroup enables on cgroup v2 (those the kernel lacks are skipped).
const V2_CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

/// Which cgroup layout the host uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Legacy or hybrid: one hierarchy per controller under `/sys/fs/cgroup/<controller>`.
    V1,
    /// Unified: a single hierarchy at `/sys/fs/cgroup`.
    V2,
}

impl CgroupVersion {
    /// Detects the layout: unified v2 when `/sys/fs/cgroup/cgroup.controllers` exists, else v1.
    /// A hybrid host (v1 controllers plus an empty v2 tree at `/sys/fs/cgroup/unified`) is v1.
    pub fn detect() -> Self {
        if Path::new(UNIFIED_MOUNT).join("cgroup.controllers").exists() {
            CgroupVersion::V2
        } else {
            CgroupVersion::V1
        }
    }

    fn hierarchy(self) -> Box<dyn Hierarchy> {
        match self {
            CgroupVersion::V1 => Box::new(V1::new()),
            CgroupVersion::V2 => Box::new(V2::new()),
        }
    }
}

/// CFS quota and period (µs) for `millis` thousandths of a core.
pub(crate) fn cfs_quota_and_period(millis: u32) -> (i64, u64) {
    let quota = u64::from(millis).saturating_mul(CFS_PERIOD_US) / 1000;
    (i64::try_from(quota.max(CFS_MIN_QUOTA_US)).unwrap_or(i64::MAX), CFS_PERIOD_US)
}

/// Checks that a cgroup path is relative and made of plain names only (no `..`, no `/` prefix).
pub(crate) fn validate_relative_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('\0') && Path::new(name).components().all(|c| matches!(c, Component::Normal(_)))
}

/// Resource use of a job cgroup at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CgroupUsage {
    /// Memory charged to the cgroup (page cache included), in bytes.
    pub memory_bytes: Option<u64>,
    /// CPU time of every process that ran in it, in seconds.
    pub cpu_seconds: Option<f64>,
}

/// One job's cgroup: one directory per mounted hierarchy on v1, a single directory on v2.
#[derive(Debug)]
pub(crate) struct JobCgroup {
    version: CgroupVersion,
    /// Path relative to each hierarchy root, e.g. `corral/job-7-0`.
    name: String,
    cgroup: Cgroup,
    /// Every directory of the cgroup, deduplicated (co-mounted v1 controllers share one).
    dirs: Vec<PathBuf>,
    /// Directory holding the memory interface files, when the memory controller is present.
    memory_dir: Option<PathBuf>,
}

impl JobCgroup {
    /// Creates (or adopts an empty leftover of) the cgroup `name` and applies `limits`.
    ///
    /// On failure after the directories were made, they are removed again.
    pub(crate) fn create(version: CgroupVersion, name: &str, limits: &ResourceLimits) -> Result<Self, ExecError> {
        let job = Self::load(version, name)?;
        if job.exists() {
            let pids = job.pids()?;
            if !pids.is_empty() {
                return Err(ExecError::CgroupBusy { cgroup: name.to_owned(), pids });
            }
            debug!(cgroup = name, "reusing empty leftover job cgroup");
        }
        job.cgroup.create().map_err(|e| ExecError::Cgroup {
            action: "create",
            cgroup: name.to_owned(),
            source: Box::new(e),
        })?;
        // cgroups-rs only logs v1 mkdir failures, so check that every directory is really there.
        if let Some(missing) = job.dirs.iter().find(|d| !d.is_dir()) {
            let missing = missing.display().to_string();
            job.remove_quietly();
            return Err(ExecError::Cgroup {
                action: "create",
                cgroup: name.to_owned(),
                source: format!("directory {missing} was not created").into(),
            });
        }
        if let Err(e) = job.apply_limits(limits) {
            job.remove_quietly();
            return Err(e);
        }
        Ok(job)
    }

    /// Builds the handle without touching the filesystem.
    fn load(version: CgroupVersion, name: &str) -> Result<Self, ExecError> {
        let controllers: Vec<String> = match version {
            CgroupVersion::V1 => V1_CONTROLLERS.iter().map(|c| (*c).to_owned()).collect(),
            CgroupVersion::V2 => {
                // cgroups-rs refuses controllers the root does not offer, so ask only for those.
                let available =
                    fs::read_to_string(Path::new(UNIFIED_MOUNT).join("cgroup.controllers")).unwrap_or_default();
                let available: BTreeSet<&str> = available.split_whitespace().collect();
                V2_CONTROLLERS.iter().filter(|c| available.contains(*c)).map(|c| (*c).to_owned()).collect()
            }
        };
        let cgroup = Cgroup::load_with_specified_controllers(version.hierarchy(), name, controllers);
        let (dirs, memory_dir) = match version {
            CgroupVersion::V1 => {
                let mut dirs: Vec<PathBuf> =
                    cgroup.subsystems().iter().map(|s| s.to_controller().path().to_path_buf()).collect();
                dirs.sort();
                dirs.dedup();
                let memory_dir = cgroup.controller_of::<MemController>().map(|m| m.path().to_path_buf());
                (dirs, memory_dir)
            }
            CgroupVersion::V2 => {
                let dir = Path::new(UNIFIED_MOUNT).join(name);
                (vec![dir.clone()], Some(dir))
            }
        };
        if dirs.is_empty() {
            return Err(ExecError::ControllerUnavailable {
                controller: "any",
                cgroup: name.to_owned(),
                hint: "no cgroup v1 hierarchy is mounted under /sys/fs/cgroup; mount memory, pids, cpu and freezer",
            });
        }
        Ok(Self { version, name: name.to_owned(), cgroup, dirs, memory_dir })
    }

    /// A handle to an existing (or absent) cgroup, for assertions in tests.
    #[cfg(test)]
    pub(crate) fn load_for_tests(version: CgroupVersion, name: &str) -> Self {
        Self::load(version, name).expect("cgroup hierarchies are mounted")
    }

    /// The path relative to the hierarchy root(s), e.g. `corral/job-7-0`.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Every directory of this cgroup (one per v1 hierarchy, one on v2).
    pub(crate) fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Whether any directory of the cgroup exists.
    pub(crate) fn exists(&self) -> bool {
        self.dirs.iter().any(|d| d.is_dir())
    }

    /// Opens every `cgroup.procs` for writing, so that a child can move itself in before exec by
    /// writing `0` to each.
    pub(crate) fn open_procs_files(&self) -> Result<Vec<File>, ExecError> {
        self.dirs
            .iter()
            .map(|dir| {
                OpenOptions::new().write(true).open(dir.join("cgroup.procs")).map_err(|e| ExecError::Cgroup {
                    action: "open cgroup.procs of",
                    cgroup: self.name.clone(),
                    source: Box::new(e),
                })
            })
            .collect()
    }

    fn apply_limits(&self, limits: &ResourceLimits) -> Result<(), ExecError> {
        if let Some(bytes) = limits.memory_bytes {
            self.apply_memory(bytes)?;
        }
        if let Some(millis) = limits.cpu_millis {
            let cpu = self.controller::<CpuController>("cpu")?;
            self.require_file(cpu.path(), "cpu", "cpu.max", "cpu.cfs_quota_us")?;
            let (quota, period) = cfs_quota_and_period(millis);
            cpu.set_cfs_quota_and_period(Some(quota), Some(period))
                .map_err(|e| self.write_error("set the cpu quota of", e))?;
        }
        if let Some(max) = limits.pids_max {
            let pids = self.controller::<PidController>("pids")?;
            self.require_file(pids.path(), "pids", "pids.max", "pids.max")?;
            let max = i64::try_from(max).unwrap_or(i64::MAX);
            pids.set_pid_max(MaxValue::Value(max)).map_err(|e| self.write_error("set pids.max of", e))?;
        }
        Ok(())
    }

    fn apply_memory(&self, bytes: u64) -> Result<(), ExecError> {
        let mem = self.controller::<MemController>("memory")?;
        self.require_file(mem.path(), "memory", "memory.max", "memory.limit_in_bytes")?;
        let limit = i64::try_from(bytes).map_err(|_| {
            ExecError::InvalidSpec(format!("memory_bytes {bytes} is too large; use at most {}", i64::MAX))
        })?;
        mem.set_limit(limit).map_err(|e| self.write_error("set the memory limit of", e))?;
        // Without a swap limit a memory hog swaps instead of being OOM-killed.
        match self.version {
            CgroupVersion::V1 => {
                // memory+swap together; absent when the kernel has no swap accounting.
                if mem.path().join("memory.memsw.limit_in_bytes").exists() {
                    if let Err(e) = mem.set_memswap_limit(limit) {
                        warn!(cgroup = %self.name, error = %e, "cannot set memory.memsw.limit_in_bytes; the job may swap");
                    }
                }
            }
            CgroupVersion::V2 => {
                if mem.path().join("memory.swap.max").exists() {
                    if let Err(e) = mem.set_memswap_limit(0) {
                        warn!(cgroup = %self.name, error = %e, "cannot set memory.swap.max; the job may swap");
                    }
                }
                // An OOM kill takes down the whole job rather than one process of it.
                let group = mem.path().join("memory.oom.group");
                if group.exists() {
                    if let Err(e) = fs::write(&group, "1") {
                        warn!(cgroup = %self.name, error = %e, "cannot set memory.oom.group");
                    }
                }
            }
        }
        Ok(())
    }

    fn controller<'a, T>(&'a self, controller: &'static str) -> Result<&'a T, ExecError>
    where
        &'a T: From<&'a cgroups_rs::Subsystem>,
        T: Controller + cgroups_rs::ControllIdentifier,
    {
        self.cgroup.controller_of::<T>().ok_or_else(|| self.unavailable(controller))
    }

    /// Fails when the interface file of a controller is missing from the job cgroup (on v2 this
    /// means the parent does not delegate the controller in `cgroup.subtree_control`).
    fn require_file(
        &self,
        dir: &Path,
        controller: &'static str,
        v2_file: &str,
        v1_file: &str,
    ) -> Result<(), ExecError> {
        let file = match self.version {
            CgroupVersion::V1 => v1_file,
            CgroupVersion::V2 => v2_file,
        };
        if dir.join(file).exists() {
            Ok(())
        } else {
            Err(self.unavailable(controller))
        }
    }

    fn unavailable(&self, controller: &'static str) -> ExecError {
        ExecError::ControllerUnavailable {
            controller,
            cgroup: self.name.clone(),
            hint: match self.version {
                CgroupVersion::V1 => "mount its cgroup v1 hierarchy under /sys/fs/cgroup/<controller>",
                CgroupVersion::V2 => {
                    "enable it in cgroup.subtree_control of every ancestor (the worker needs a delegated cgroup)"
                }
            },
        }
    }

    fn write_error(&self, action: &'static str, e: cgroups_rs::error::Error) -> ExecError {
        ExecError::Cgroup { action, cgroup: self.name.clone(), source: Box::new(e) }
    }

    /// The process ids in the cgroup (union over hierarchies), sorted. A cgroup that no longer
    /// exists is empty.
    pub(crate) fn pids(&self) -> Result<Vec<u32>, ExecError> {
        let mut pids = BTreeSet::new();
        for dir in &self.dirs {
            match fs::read_to_string(dir.join("cgroup.procs")) {
                Ok(text) => pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                // ENODEV: the cgroup is being removed.
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                Err(e) => {
                    return Err(ExecError::Cgroup {
                        action: "list the processes of",
                        cgroup: self.name.clone(),
                        source: Box::new(e),
                    })
                }
            }
        }
        Ok(pids.into_iter().collect())
    }

    /// Sends `signal` to every process of the cgroup once; processes that have already exited
    /// are skipped. Not race-free against forks (use [`JobCgroup::kill_all`] for SIGKILL).
    pub(crate) fn signal_all(&self, signal: Signal, skip_group: Option<i32>) -> Result<usize, ExecError> {
        let pids = self.pids()?;
        let mut sent = 0;
        for pid in &pids {
            // Members of a process group that was just signalled as a whole already have it: a
            // second copy would run a job's checkpoint handler twice.
            let group = i32::try_from(*pid).ok().and_then(|p| nix::unistd::getpgid(Some(Pid::from_raw(p))).ok());
            if skip_group.is_some() && group.map(Pid::as_raw) == skip_group {
                continue;
            }
            if send(*pid, signal).map_err(|e| self.signal_error(e))? {
                sent += 1;
            }
        }
        Ok(sent)
    }

    /// Kills every process of the cgroup with SIGKILL in one round that no fork can escape:
    /// `cgroup.kill` on v2 (5.14+), else freeze, SIGKILL each member, thaw. Without a freezer it
    /// falls back to repeated kill passes. Returns without waiting for the processes to exit.
    pub(crate) fn kill_all(&self) -> Result<(), ExecError> {
        if !self.exists() {
            return Ok(());
        }
        if self.version == CgroupVersion::V2 {
            let kill_file = self.dirs[0].join("cgroup.kill");
            if kill_file.exists() {
                return match fs::write(&kill_file, "1") {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                    Err(e) => Err(self.signal_error(e.to_string())),
                };
            }
        }
        let frozen = match self.freeze() {
            Ok(frozen) => frozen,
            Err(e) => {
                warn!(cgroup = %self.name, error = %e, "cannot freeze job cgroup; killing without freezing");
                false
            }
        };
        let killed = self.kill_members(frozen);
        if frozen {
            if let Err(e) = self.thaw() {
                // Frozen processes only die once thawed: this is worth shouting about.
                warn!(cgroup = %self.name, error = %e, "cannot thaw job cgroup after killing it");
                killed?;
                return Err(self.signal_error(format!("thaw failed: {e}")));
            }
        }
        killed
    }

    fn kill_members(&self, frozen: bool) -> Result<(), ExecError> {
        // Frozen members cannot fork, so one pass is complete; otherwise repeat a few passes to
        // catch children forked while we were killing.
        let passes = if frozen { 1 } else { 5 };
        let mut seen = BTreeSet::new();
        for _ in 0..passes {
            let pids = self.pids()?;
            let fresh: Vec<u32> = pids.into_iter().filter(|p| seen.insert(*p)).collect();
            if fresh.is_empty() {
                break;
            }
            for pid in fresh {
                send(pid, Signal::SIGKILL).map_err(|e| self.signal_error(e))?;
            }
        }
        Ok(())
    }

    /// Freezes the cgroup and waits (bounded) until the kernel reports it frozen. Returns false
    /// when no freezer is available.
    fn freeze(&self) -> io::Result<bool> {
        match self.version {
            CgroupVersion::V1 => {
                let Some(freezer) = self.cgroup.controller_of::<FreezerController>() else {
                    return Ok(false);
                };
                freezer.freeze().map_err(io::Error::other)?;
                let deadline = Instant::now() + FREEZE_TIMEOUT;
                loop {
                    match freezer.state().map_err(io::Error::other)? {
                        FreezerState::Frozen => return Ok(true),
                        _ if Instant::now() >= deadline => {
                            warn!(cgroup = %self.name, "job cgroup did not finish freezing; killing what is visible");
                            return Ok(true);
                        }
                        _ => std::thread::sleep(Duration::from_millis(1)),
                    }
                }
            }
            CgroupVersion::V2 => {
                let file = self.dirs[0].join("cgroup.freeze");
                if !file.exists() {
                    return Ok(false);
                }
                fs::write(&file, "1")?;
                let deadline = Instant::now() + FREEZE_TIMEOUT;
                loop {
                    let events = fs::read_to_string(self.dirs[0].join("cgroup.events"))?;
                    if flat_keyed_value(&events, "frozen") == Some(1) {
                        return Ok(true);
                    }
                    if Instant::now() >= deadline {
                        warn!(cgroup = %self.name, "job cgroup did not finish freezing; killing what is visible");
                        return Ok(true);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    fn thaw(&self) -> io::Result<()> {
        match self.version {
            CgroupVersion::V1 => match self.cgroup.controller_of::<FreezerController>() {
                Some(freezer) => freezer.thaw().map_err(io::Error::other),
                None => Ok(()),
            },
            CgroupVersion::V2 => fs::write(self.dirs[0].join("cgroup.freeze"), "0"),
        }
    }

    fn signal_error(&self, detail: impl std::fmt::Display) -> ExecError {
        ExecError::Signal { cgroup: self.name.clone(), detail: detail.to_string() }
    }

    /// How many processes the kernel OOM killer killed in this cgroup: `oom_kill` in
    /// `memory.oom_control` (v1, kernel 4.13+) or `memory.events` (v2). `None` when unknown.
    pub(crate) fn oom_kill_count(&self) -> Option<u64> {
        let dir = self.memory_dir.as_ref()?;
        let file = match self.version {
            CgroupVersion::V1 => "memory.oom_control",
            CgroupVersion::V2 => "memory.events",
        };
        match fs::read_to_string(dir.join(file)) {
            Ok(text) => flat_keyed_value(&text, "oom_kill"),
            Err(e) => {
                warn!(cgroup = %self.name, file, error = %e, "cannot read the OOM counter");
                None
            }
        }
    }

    /// Current memory use and total CPU time of the cgroup's processes: `memory.usage_in_bytes`
    /// and `cpuacct.usage` (v1), `memory.current` and `usage_usec` of `cpu.stat` (v2). A value
    /// whose controller or file is missing is `None`.
    pub(crate) fn usage(&self) -> CgroupUsage {
        let read = |path: PathBuf| fs::read_to_string(path).ok();
        match self.version {
            CgroupVersion::V1 => CgroupUsage {
                memory_bytes: self
                    .memory_dir
                    .as_ref()
                    .and_then(|d| read(d.join("memory.usage_in_bytes")))
                    .and_then(|t| t.trim().parse().ok()),
                cpu_seconds: self
                    .dirs
                    .iter()
                    .find_map(|d| read(d.join("cpuacct.usage")))
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .map(|ns| ns as f64 / 1e9),
            },
            CgroupVersion::V2 => CgroupUsage {
                memory_bytes: read(self.dirs[0].join("memory.current")).and_then(|t| t.trim().parse().ok()),
                cpu_seconds: read(self.dirs[0].join("cpu.stat"))
                    .and_then(|t| flat_keyed_value(&t, "usage_usec"))
                    .map(|us| us as f64 / 1e6),
            },
        }
    }

    /// Removes the cgroup directories. Blocks for up to a few hundred milliseconds on v1 (the
    /// kernel may still be tearing down exited members), so call it off the async executor.
    pub(crate) fn remove(&self) -> Result<(), ExecError> {
        if !self.exists() {
            return Ok(());
        }
        self.cgroup.delete().map_err(|e| ExecError::Cgroup {
            action: "remove",
            cgroup: self.name.clone(),
            source: Box::new(e),
        })?;
        if let Some(left) = self.dirs.iter().find(|d| d.exists()) {
            return Err(ExecError::Cgroup {
                action: "remove",
                cgroup: self.name.clone(),
                source: format!("{} still exists", left.display()).into(),
            });
        }
        Ok(())
    }

    pub(crate) fn remove_quietly(&self) {
        if let Err(e) = self.remove() {
            warn!(cgroup = %self.name, error = %e, "cannot remove job cgroup");
        }
    }
}

/// Removes the (empty) cgroup `name` in every hierarchy, ignoring directories that do not exist.
pub(crate) fn remove_empty_cgroup(version: CgroupVersion, name: &str) -> Result<(), ExecError> {
    let dirs: Vec<PathBuf> = match version {
        CgroupVersion::V2 => vec![Path::new(UNIFIED_MOUNT).join(name)],
        CgroupVersion::V1 => {
            let cgroup = Cgroup::load(version.hierarchy(), name);
            let mut dirs: Vec<PathBuf> =
                cgroup.subsystems().iter().map(|s| s.to_controller().path().to_path_buf()).collect();
            dirs.sort();
            dirs.dedup();
            dirs
        }
    };
    for dir in dirs {
        match fs::remove_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(ExecError::Cgroup {
                    action: "remove",
                    cgroup: name.to_owned(),
                    source: format!("{}: {e}; remove its job cgroups first", dir.display()).into(),
                })
            }
        }
    }
    Ok(())
}

/// Sends `signal` to `pid`; Ok(false) when the process no longer exists.
fn send(pid: u32, signal: Signal) -> Result<bool, String> {
    let Ok(raw) = i32::try_from(pid) else {
        return Ok(false);
    };
    match kill(Pid::from_raw(raw), signal) {
        Ok(()) => Ok(true),
        Err(Errno::ESRCH) => Ok(false),
        Err(e) => Err(format!("kill({pid}, {signal}): {e}")),
    }
}

/// Value of `key` in a flat-keyed cgroup file (`key value` per line).
fn flat_keyed_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        (parts.next() == Some(key)).then(|| parts.next().and_then(|v| v.parse().ok())).flatten()
    })
}

/// Names (`<root>/job-...`) of the job cgroups under `root`, in every hierarchy.
fn job_cgroups(version: CgroupVersion, root: &str) -> Vec<String> {
    let parents: Vec<PathBuf> = match version {
        CgroupVersion::V2 => vec![Path::new(UNIFIED_MOUNT).join(root)],
        CgroupVersion::V1 => V1_CONTROLLERS.iter().map(|c| Path::new(UNIFIED_MOUNT).join(c).join(root)).collect(),
    };
    let mut names: Vec<String> = parents
        .iter()
        .filter_map(|p| fs::read_dir(p).ok())
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| n.starts_with("job-"))
        .collect();
    names.sort();
    names.dedup();
    names.into_iter().map(|name| format!("{root}/{name}")).collect()
}

/// Kills (without removing) every process of every `job-*` cgroup under `root`; returns the
/// cgroups that still had processes. What a worker's fence guard does when the lease expires.
pub(crate) fn kill_job_cgroups(version: CgroupVersion, root: &str) -> Result<Vec<String>, ExecError> {
    let mut killed = Vec::new();
    for full in job_cgroups(version, root) {
        let cgroup = JobCgroup::load(version, &full)?;
        if cgroup.pids()?.is_empty() {
            continue;
        }
        cgroup.kill_all()?;
        killed.push(full);
    }
    Ok(killed)
}

/// Removes the empty `job-*` cgroups directly under `root` and names the others, left as they
/// are: a worker of an earlier version kept its jobs there, before each worker had a root of
/// its own, and a job with processes there may be another worker's, so only what is empty
/// (no one's) goes. Returns (removed, kept).
pub(crate) fn remove_empty_job_cgroups(
    version: CgroupVersion,
    root: &str,
) -> Result<(Vec<String>, Vec<String>), ExecError> {
    let (mut removed, mut kept) = (Vec::new(), Vec::new());
    for full in job_cgroups(version, root) {
        let cgroup = JobCgroup::load(version, &full)?;
        if cgroup.pids()?.is_empty() && cgroup.remove().is_ok() {
            removed.push(full);
        } else {
            kept.push(full);
        }
    }
    Ok((removed, kept))
}

/// Kills and removes every `job-*` cgroup under `root`: what a previous worker process left
/// behind when it died without cleaning up. Returns the names it reaped.
pub(crate) fn reap_job_cgroups(version: CgroupVersion, root: &str) -> Result<Vec<String>, ExecError> {
    let mut reaped = Vec::new();
    for full in job_cgroups(version, root) {
        let cgroup = JobCgroup::load(version, &full)?;
        cgroup.kill_all()?;
        cgroup.remove()?;
        reaped.push(full);
    }
    Ok(reaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Job cgroups directly under the configured root (an earlier version's): the empty one is
    /// removed, the one with a process is left with it, alive.
    #[test]
    fn only_empty_job_cgroups_left_by_an_earlier_version_are_removed() {
        use std::io::Write;
        let version = CgroupVersion::detect();
        let root = format!("corral-legacy-test-{}", std::process::id());
        let empty = format!("{root}/job-1-0");
        let busy = format!("{root}/job-2-0");
        for name in [&empty, &busy] {
            if let Err(e) = JobCgroup::create(version, name, &ResourceLimits::default()) {
                assert!(std::env::var_os("CI").is_none(), "cannot make a cgroup: {e}");
                eprintln!("SKIPPED: cannot make a cgroup here: {e}");
                return;
            }
        }
        let busy_cgroup = JobCgroup::load(version, &busy).expect("load");
        let mut sleeper = std::process::Command::new("sleep").arg("60").spawn().expect("sleep");
        for mut procs in busy_cgroup.open_procs_files().expect("cgroup.procs") {
            procs.write_all(sleeper.id().to_string().as_bytes()).expect("move the sleeper in");
        }
        let (removed, kept) = remove_empty_job_cgroups(version, &root).expect("look");
        assert_eq!((removed, kept), (vec![empty.clone()], vec![busy.clone()]));
        assert!(!JobCgroup::load(version, &empty).expect("load").exists());
        assert_eq!(sleeper.try_wait().expect("wait"), None, "a process of a kept cgroup was killed");
        busy_cgroup.kill_all().expect("kill");
        let _ = sleeper.wait();
        busy_cgroup.remove().expect("remove");
        remove_empty_cgroup(version, &root).expect("remove the root");
    }

    #[test]
    fn flat_keyed_value_finds_the_exact_key() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(flat_keyed_value(v1, "oom_kill"), Some(3));
        assert_eq!(flat_keyed_value(v1, "under_oom"), Some(0));
        let v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(flat_keyed_value(v2, "oom_kill"), Some(1));
        assert_eq!(flat_keyed_value(v2, "oom"), Some(2));
        assert_eq!(flat_keyed_value("oom_kill_disable 0\n", "oom_kill"), None);
        assert_eq!(flat_keyed_value("", "oom_kill"), None);
        let cpu_stat = "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n";
        assert_eq!(flat_keyed_value(cpu_stat, "usage_usec"), Some(2_500_000));
    }

    /// A cgroup of this host holding a busy process reports its memory and CPU time; one that
    /// does not exist reports nothing.
    #[test]
    fn usage_reads_memory_and_cpu_time() {
        let version = CgroupVersion::detect();
        let absent = JobCgroup::load_for_tests(version, "corral-usage-test-absent/job-1-0");
        assert_eq!(absent.usage(), CgroupUsage::default());
        // The root cgroup on v1 always has both files; on v2 the root has no memory.current, so
        // only the parsing is checked there (see flat_keyed_value_finds_the_exact_key).
        if version == CgroupVersion::V1 {
            let root = JobCgroup::load_for_tests(version, "");
            let usage = root.usage();
            assert!(usage.memory_bytes.is_some_and(|b| b > 0), "{usage:?}");
            assert!(usage.cpu_seconds.is_some_and(|s| s > 0.0), "{usage:?}");
        }
    }

    #[test]
    fn relative_names_are_validated() {
        assert!(validate_relative_name("corral"));
        assert!(validate_relative_name("corral/job-1-0"));
        assert!(!validate_relative_name(""));
        assert!(!validate_relative_name("/corral"));
        assert!(!validate_relative_name("corral/../x"));
        assert!(!validate_relative_name("./corral"));
    }
}
