//! OCI containers via runc: the job's image is an unpacked root filesystem; a `config.json`
//! built with `oci-spec` runs the job's command in it, inside the same job cgroup a bare
//! process would get (created here with the limits, then joined by runc through
//! `linux.cgroupsPath`), so OOM detection, `kill_tree` and leftover reaping work unchanged.
//!
//! The container: read-only root, the work dir bind-mounted read-write at `/work` (its cwd and
//! HOME), a private `/tmp`, `/proc` and a minimal `/dev`, no capabilities, no new privileges,
//! the host network (jobs talk to each other for NCCL), GPUs through CDI specs when the host
//! has them, else through the device nodes in [`LaunchSpec::devices`]. `runc run` runs in the
//! foreground with the job's log files as its stdout and stderr; its exit status is the
//! container's (128 + N for a signal, which [`container_status`] turns back into the signal).
//!
//! Boundary: runc's state lives under `<state_dir>/runc`, bundles under `<state_dir>/bundles`;
//! nothing here touches the host's default runc root.

use super::cdi::{self, Edits};
use super::cgroup::{self, CgroupVersion, JobCgroup};
use super::job::{ContainerExec, ContainerRuntime, ExecStarted, MainProcess, Shared};
use super::{process, spawn, ExecError, Executor, LaunchSpec, RunningJob};
use oci_spec::runtime::{
    Capabilities, HookBuilder, Hooks, LinuxBuilder, LinuxCpuBuilder, LinuxDevice, LinuxDeviceBuilder,
    LinuxDeviceCgroupBuilder, LinuxDeviceType, LinuxMemoryBuilder, LinuxNamespaceType, LinuxPidsBuilder,
    LinuxResourcesBuilder, MountBuilder, PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec,
    UserBuilder,
};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;
use tracing::{info, warn};

/// Where runc is looked for after the worker's PATH: the directories root's PATH has.
const SBIN_DIRS: &[&str] = &["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// Where the job's work dir appears in the container.
pub const CONTAINER_WORK_DIR: &str = "/work";

/// Settings of the runc executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncConfig {
    /// The runc binary; a bare name is looked up in PATH, /usr/sbin and /usr/bin.
    pub runc: PathBuf,
    /// runc state (`<state_dir>/runc`) and bundles (`<state_dir>/bundles`).
    pub state_dir: PathBuf,
    /// Parent of the job cgroups, like [`super::ProcessExecutor::new`]'s.
    pub cgroup_root: String,
    /// Directories searched for CDI specs.
    pub cdi_dirs: Vec<PathBuf>,
}

impl RuncConfig {
    /// runc from PATH, CDI specs from /etc/cdi and /var/run/cdi.
    pub fn new(state_dir: PathBuf, cgroup_root: impl Into<String>) -> Self {
        RuncConfig {
            runc: PathBuf::from("runc"),
            state_dir,
            cgroup_root: cgroup_root.into(),
            cdi_dirs: vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
        }
    }
}

/// Runs jobs with an image as runc containers.
#[derive(Debug, Clone)]
pub struct RuncExecutor {
    runc: PathBuf,
    runc_root: PathBuf,
    bundles: PathBuf,
    cgroup_root: String,
    version: CgroupVersion,
    cdi_dirs: Vec<PathBuf>,
}

/// A container's runtime state, deleted after its job ends.
#[derive(Debug, Clone)]
pub(crate) struct Container {
    runc: PathBuf,
    runc_root: PathBuf,
    id: String,
    bundle: PathBuf,
    cgroup_name: String,
}

impl Container {
    /// `runc delete --force`, the bundle, and cgroup directories runc made in hierarchies the
    /// job cgroup does not cover (v1). Blocking.
    pub(crate) fn delete(&self) {
        if self.runc_root.join(&self.id).exists() {
            let out = std::process::Command::new(&self.runc)
                .arg("--root")
                .arg(&self.runc_root)
                .args(["delete", "--force", &self.id])
                .stdin(Stdio::null())
                .output();
            match out {
                Ok(out) if out.status.success() => {}
                Ok(out) => {
                    warn!(container = %self.id, stderr = %String::from_utf8_lossy(&out.stderr).trim(), "runc delete failed")
                }
                Err(e) => warn!(container = %self.id, error = %e, "cannot run runc delete"),
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.bundle) {
            if e.kind() != std::io::ErrorKind::NotFound {
                warn!(bundle = %self.bundle.display(), error = %e, "cannot remove the container bundle");
            }
        }
        remove_in_every_v1_hierarchy(&self.cgroup_name);
    }
}

impl ContainerRuntime for Container {
    fn exit_status(&self, code: Option<i32>, signal: Option<i32>) -> (Option<i32>, Option<i32>) {
        container_status(code, signal)
    }

    /// `runc exec` in the foreground, as root, outside the job cgroup (as `runc run`): runc puts
    /// the process in the container's namespaces and cgroup, with the container's limits,
    /// capabilities (none) and no new privileges, and forwards the signals it gets to it.
    fn exec(&self, exec: &ContainerExec<'_>, stdio: [&std::fs::File; 3]) -> Result<ExecStarted, ExecError> {
        let pids = self.bundle.join("exec");
        let bundle_error = |path: &Path| {
            let path = path.to_path_buf();
            move |e: std::io::Error| ExecError::Bundle { path, source: Box::new(e) }
        };
        std::fs::create_dir_all(&pids).map_err(bundle_error(&pids))?;
        let pid_file = pids.join(format!("{}.pid", exec.name));
        match std::fs::remove_file(&pid_file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(bundle_error(&pid_file)(e)),
            _ => {}
        }
        let mut command = std::process::Command::new(&self.runc);
        command.arg("--root").arg(&self.runc_root).arg("exec");
        if exec.tty {
            command.arg("--tty");
        }
        if let Some(uid) = exec.uid {
            command.arg("--user").arg(format!("{uid}:{}", exec.gid.unwrap_or(uid)));
        }
        command.arg("--cwd").arg(exec.cwd);
        for (k, v) in exec.env {
            command.arg("--env").arg(format!("{k}={v}"));
        }
        command.arg("--pid-file").arg(&pid_file).arg(&self.id).args(exec.argv);
        let spawn_error = |source| ExecError::Spawn { program: self.runc.display().to_string(), source };
        let [stdin, stdout, stderr] = stdio.map(|f| f.try_clone().map(Stdio::from));
        command
            .env_clear()
            .env("PATH", process::DEFAULT_PATH)
            .current_dir("/")
            .stdin(stdin.map_err(spawn_error)?)
            .stdout(stdout.map_err(spawn_error)?)
            .stderr(stderr.map_err(spawn_error)?);
        if exec.tty {
            // runc's terminal is its controlling one, so that it hears of resizes (SIGWINCH)
            // and passes them on to the container's.
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                command.pre_exec(|| {
                    if libc::setsid() == -1 || libc::ioctl(0, libc::TIOCSCTTY, 0) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        } else {
            // Its own process group: signals for the task reach runc, which passes them on.
            command.process_group(0);
        }
        let child = command.spawn().map_err(spawn_error)?;
        Ok(ExecStarted { runtime_process: spawn::JobProcess::adopt(child), pid_file })
    }

    fn remove(&self) {
        self.delete();
    }
}

/// Best effort: removes the cgroup `name` from every v1 hierarchy mounted under
/// /sys/fs/cgroup (runc also creates it in devices, cpuset, blkio, ...), retrying for a moment
/// while killed members are still exiting.
fn remove_in_every_v1_hierarchy(name: &str) {
    if CgroupVersion::detect() != CgroupVersion::V1 {
        return;
    }
    let Ok(mounts) = std::fs::read_dir("/sys/fs/cgroup") else { return };
    let mut left: Vec<PathBuf> = mounts.filter_map(|e| e.ok()).map(|m| m.path().join(name)).collect();
    let deadline = Instant::now() + std::time::Duration::from_secs(2);
    loop {
        left.retain(|dir| match std::fs::remove_dir(dir) {
            Err(e) => e.raw_os_error() == Some(libc::EBUSY),
            Ok(()) => false,
        });
        if left.is_empty() || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    if !left.is_empty() {
        warn!(cgroup = name, dirs = ?left, "cannot remove cgroup directories runc made");
    }
}

/// Turns runc's exit code back into the container's signal (runc exits with 128 + N).
pub(crate) fn container_status(code: Option<i32>, signal: Option<i32>) -> (Option<i32>, Option<i32>) {
    match code {
        Some(c) if (129..=128 + 64).contains(&c) => (None, Some(c - 128)),
        _ => (code, signal),
    }
}

/// Where `program` (a name or path) is: the worker's PATH, then root's usual directories.
pub fn find_runc(program: &Path) -> Option<PathBuf> {
    process::find_program(program, SBIN_DIRS)
}

impl RuncExecutor {
    /// Finds runc and prepares its state directories. Fails when runc is not installed.
    pub fn new(config: RuncConfig) -> Result<Self, ExecError> {
        let runc = process::find_program(&config.runc, SBIN_DIRS).ok_or_else(|| {
            ExecError::RuncNotFound(format!("no executable {} in PATH, /usr/sbin or /usr/bin", config.runc.display()))
        })?;
        if !cgroup::validate_relative_name(&config.cgroup_root) {
            return Err(ExecError::InvalidCgroupRoot(config.cgroup_root));
        }
        let runc_root = config.state_dir.join("runc");
        let bundles = config.state_dir.join("bundles");
        for dir in [&runc_root, &bundles] {
            std::fs::create_dir_all(dir).map_err(|e| ExecError::Bundle { path: dir.clone(), source: Box::new(e) })?;
        }
        Ok(RuncExecutor {
            runc,
            runc_root,
            bundles,
            cgroup_root: config.cgroup_root.trim_end_matches('/').to_owned(),
            version: CgroupVersion::detect(),
            cdi_dirs: config.cdi_dirs,
        })
    }

    /// The runc binary in use.
    pub fn runc(&self) -> &Path {
        &self.runc
    }

    fn container_id(job_id: u64, attempt: u64) -> String {
        format!("job-{job_id}-{attempt}")
    }

    /// Removes the root cgroup (tests, worker shutdown); fails while job cgroups remain.
    pub fn remove_root_cgroup(&self) -> Result<(), ExecError> {
        remove_in_every_v1_hierarchy(&self.cgroup_root);
        cgroup::remove_empty_cgroup(self.version, &self.cgroup_root)
    }
}

impl Executor for RuncExecutor {
    fn launch(&self, spec: &LaunchSpec) -> Result<RunningJob, ExecError> {
        let Some(image) = &spec.image else {
            return Err(ExecError::InvalidSpec("no image: the runc executor runs containers only".into()));
        };
        process::validate(spec)?;
        if !image.is_absolute() || !image.join("bin").is_dir() && !image.join("usr").is_dir() {
            return Err(ExecError::InvalidSpec(format!(
                "image {} is not an unpacked root filesystem: give the absolute path of a directory with bin/ or usr/",
                image.display()
            )));
        }
        let user_files = process::open_host_output_files(spec)?;
        let (stdout, stderr) = process::prepare_work_dir(spec)?;
        // `--output`/`--error`: the log and the job's own file both get what it writes.
        let mut copiers = Vec::new();
        let mut with_copy = |log: std::fs::File, extra: Option<std::fs::File>| match extra {
            Some(extra) => super::output::tee(spec.job_id, log, extra).map(|(write_end, copier)| {
                copiers.push(copier);
                write_end
            }),
            None => Ok(log),
        };
        let stdout = with_copy(stdout, user_files.stdout)?;
        let stderr = with_copy(stderr, user_files.stderr)?;
        let name = format!("{}/job-{}-{}", self.cgroup_root, spec.job_id, spec.attempt);
        let cgroup = JobCgroup::create(self.version, &name, &spec.limits)?;
        let id = Self::container_id(spec.job_id, spec.attempt);
        let container = Container {
            runc: self.runc.clone(),
            runc_root: self.runc_root.clone(),
            id: id.clone(),
            bundle: self.bundles.join(&id),
            cgroup_name: name.clone(),
        };
        // A container of the same id can only be a leftover of a dead worker.
        container.delete();
        let cdi = cdi::Registry::load(&self.cdi_dirs).resolve(&spec.cdi_devices);
        // runc rewrites the limits of the cgroup it joins: it must be given the same ones.
        let swap_limit = cgroup
            .dirs()
            .iter()
            .any(|d| d.join("memory.memsw.limit_in_bytes").exists() || d.join("memory.swap.max").exists());
        let written = build_spec(spec, image, &name, cdi.as_ref(), swap_limit).and_then(|oci| {
            std::fs::create_dir_all(&container.bundle)
                .map_err(|e| ExecError::Bundle { path: container.bundle.clone(), source: Box::new(e) })?;
            let path = container.bundle.join("config.json");
            oci.save(&path).map_err(|e| ExecError::Bundle { path, source: Box::new(e) })
        });
        if let Err(e) = written {
            cgroup.remove_quietly();
            container.delete();
            return Err(e);
        }
        let started = Instant::now();
        let mut command = tokio::process::Command::new(&self.runc);
        command
            .arg("--root")
            .arg(&self.runc_root)
            .args(["run", "--bundle"])
            .arg(&container.bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            // Its own process group: a ^C to the worker must not reach the container.
            .process_group(0);
        // The bundle took a while: a worker stopped meanwhile may have lost its lease.
        if spec.not_after.is_some_and(|end| Instant::now() >= end) {
            cgroup.remove_quietly();
            container.delete();
            return Err(ExecError::LeaseEnded);
        }
        let child = match command.spawn() {
            Ok(child) => child,
            Err(source) => {
                cgroup.remove_quietly();
                container.delete();
                return Err(ExecError::Spawn { program: self.runc.display().to_string(), source });
            }
        };
        let pid = child.id().unwrap_or(0);
        info!(job_id = spec.job_id, attempt = spec.attempt, pid, container = %id, image = %image.display(), cgroup = %name, "container started");
        let runtime: Arc<dyn ContainerRuntime> = Arc::new(container);
        Ok(RunningJob::new(
            MainProcess::Runc(child),
            started,
            Shared::new(spec.job_id, spec.attempt, pid, cgroup, Some(runtime)),
        )
        .with_copiers(copiers))
    }

    /// Deletes containers and bundles a dead worker left, then their cgroups.
    fn reap_leftovers(&self) -> Result<Vec<String>, ExecError> {
        let mut ids: Vec<String> = [&self.runc_root, &self.bundles]
            .iter()
            .filter_map(|dir| std::fs::read_dir(dir).ok())
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str().map(str::to_owned))
            .filter(|name| name.starts_with("job-"))
            .collect();
        ids.sort();
        ids.dedup();
        let mut reaped = Vec::new();
        for id in &ids {
            let container = Container {
                runc: self.runc.clone(),
                runc_root: self.runc_root.clone(),
                id: id.clone(),
                bundle: self.bundles.join(id),
                cgroup_name: format!("{}/{id}", self.cgroup_root),
            };
            warn!(container = %id, "deleting a container left by an earlier worker process");
            container.delete();
            reaped.push(container.cgroup_name);
        }
        for name in cgroup::reap_job_cgroups(self.version, &self.cgroup_root)? {
            if !reaped.contains(&name) {
                reaped.push(name);
            }
        }
        // runc's own cgroups of those containers, now that their processes are gone.
        for name in &reaped {
            remove_in_every_v1_hierarchy(name);
        }
        Ok(reaped)
    }
}

fn oci_error(what: &str) -> impl Fn(oci_spec::OciSpecError) -> ExecError + '_ {
    move |e| ExecError::InvalidSpec(format!("cannot build the container {what}: {e}"))
}

/// A device node of the host, as runc wants it (type, major, minor, mode).
fn host_device(path: &Path, container_path: &Path) -> Result<LinuxDevice, ExecError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| {
        ExecError::InvalidSpec(format!("device {} is not usable: {e}; check the driver is loaded", path.display()))
    })?;
    let typ = if meta.file_type().is_char_device() {
        LinuxDeviceType::C
    } else if meta.file_type().is_block_device() {
        LinuxDeviceType::B
    } else {
        return Err(ExecError::InvalidSpec(format!("{} is not a device node", path.display())));
    };
    let rdev = meta.rdev();
    LinuxDeviceBuilder::default()
        .path(container_path)
        .typ(typ)
        .major(libc::major(rdev) as i64)
        .minor(libc::minor(rdev) as i64)
        .file_mode(meta.mode() & 0o7777)
        .uid(meta.uid())
        .gid(meta.gid())
        .build()
        .map_err(oci_error("device"))
}

/// The container's config.json for `spec`. `swap_limit`: the host accounts swap, so the
/// memory limit covers memory plus swap (as the job cgroup's own limits do).
pub(crate) fn build_spec(
    spec: &LaunchSpec,
    image: &Path,
    cgroup_name: &str,
    cdi: Option<&Edits>,
    swap_limit: bool,
) -> Result<Spec, ExecError> {
    let mut env =
        vec![format!("PATH={}", process::DEFAULT_PATH), format!("HOME={CONTAINER_WORK_DIR}"), "LANG=C".to_owned()];
    env.retain(|e| !spec.env.keys().any(|k| e.split_once('=').is_some_and(|(name, _)| name == k)));
    env.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
    if let Some(cdi) = cdi {
        env.extend(cdi.env.iter().cloned());
    }
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = (spec.uid.unwrap_or_else(|| unsafe { libc::getuid() }), spec.gid);
    let gid = gid.unwrap_or_else(|| if spec.uid.is_some() { uid } else { unsafe { libc::getgid() } });
    let user = UserBuilder::default().uid(uid).gid(gid).build().map_err(oci_error("user"))?;
    let rlimits = match spec.limits.open_files {
        Some(n) => vec![PosixRlimitBuilder::default()
            .typ(PosixRlimitType::RlimitNofile)
            .soft(n)
            .hard(n)
            .build()
            .map_err(oci_error("rlimits"))?],
        None => Vec::new(),
    };
    let no_capabilities = oci_spec::runtime::LinuxCapabilitiesBuilder::default()
        .bounding(Capabilities::new())
        .effective(Capabilities::new())
        .inheritable(Capabilities::new())
        .permitted(Capabilities::new())
        .ambient(Capabilities::new())
        .build()
        .map_err(oci_error("capabilities"))?;
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(user)
        .args(spec.argv.clone())
        .env(env)
        .cwd(spec.files.cwd.clone().unwrap_or_else(|| PathBuf::from(CONTAINER_WORK_DIR)))
        .no_new_privileges(true)
        .capabilities(no_capabilities)
        .rlimits(rlimits)
        .build()
        .map_err(oci_error("process"))?;

    let bind = |source: &Path, destination: &Path, read_only: bool| {
        let mut options = vec!["rbind".to_owned(), "nosuid".to_owned(), "nodev".to_owned()];
        options.push(if read_only { "ro" } else { "rw" }.to_owned());
        MountBuilder::default()
            .destination(destination)
            .typ("bind")
            .source(source)
            .options(options)
            .build()
            .map_err(oci_error("mounts"))
    };
    let mut mounts = oci_spec::runtime::get_default_mounts();
    mounts.push(bind(&spec.work_dir, Path::new(CONTAINER_WORK_DIR), false)?);
    mounts.push(
        MountBuilder::default()
            .destination("/tmp")
            .typ("tmpfs")
            .source("tmpfs")
            .options(vec!["nosuid".to_owned(), "nodev".to_owned(), "mode=1777".to_owned()])
            .build()
            .map_err(oci_error("mounts"))?,
    );
    for dir in &spec.binds {
        mounts.push(bind(dir, dir, false)?);
    }
    for mount in &spec.mounts {
        mounts.push(bind(&mount.source, &mount.target, mount.read_only)?);
    }

    let mut devices = Vec::new();
    match cdi {
        Some(cdi) => {
            for node in &cdi.device_nodes {
                let host = node.host_path.as_deref().unwrap_or(&node.path);
                devices.push(host_device(host, &node.path)?);
            }
            for m in &cdi.mounts {
                let options = if m.options.is_empty() { vec!["rbind".into(), "ro".into()] } else { m.options.clone() };
                mounts.push(
                    MountBuilder::default()
                        .destination(&m.container_path)
                        .typ(m.typ.clone().unwrap_or_else(|| "bind".into()))
                        .source(&m.host_path)
                        .options(options)
                        .build()
                        .map_err(oci_error("mounts"))?,
                );
            }
            // Other nodes (InfiniBand) still come from the spec.
            for path in spec.devices.iter().filter(|p| !is_nvidia_node(p)) {
                devices.push(host_device(path, path)?);
            }
        }
        None => {
            for path in &spec.devices {
                devices.push(host_device(path, path)?);
            }
        }
    }
    let device_rules = std::iter::once(
        LinuxDeviceCgroupBuilder::default().allow(false).access("rwm").build().map_err(oci_error("device rules")),
    )
    .chain(devices.iter().map(|d| {
        LinuxDeviceCgroupBuilder::default()
            .allow(true)
            .typ(d.typ())
            .major(d.major())
            .minor(d.minor())
            .access("rwm")
            .build()
            .map_err(oci_error("device rules"))
    }))
    .collect::<Result<Vec<_>, _>>()?;
    let mut resources = LinuxResourcesBuilder::default().devices(device_rules);
    if let Some(bytes) = spec.limits.memory_bytes {
        let limit = i64::try_from(bytes).unwrap_or(i64::MAX);
        let mut memory = LinuxMemoryBuilder::default().limit(limit);
        if swap_limit {
            memory = memory.swap(limit);
        }
        resources = resources.memory(memory.build().map_err(oci_error("memory limit"))?);
    }
    if let Some(millis) = spec.limits.cpu_millis {
        let (quota, period) = cgroup::cfs_quota_and_period(millis);
        resources = resources
            .cpu(LinuxCpuBuilder::default().quota(quota).period(period).build().map_err(oci_error("cpu limit"))?);
    }
    if let Some(max) = spec.limits.pids_max {
        let max = i64::try_from(max).unwrap_or(i64::MAX);
        resources = resources.pids(LinuxPidsBuilder::default().limit(max).build().map_err(oci_error("pids limit"))?);
    }
    let resources = resources.build().map_err(oci_error("resources"))?;
    // The host network: jobs reach each other and the outside like bare processes.
    let namespaces: Vec<_> = oci_spec::runtime::get_default_namespaces()
        .into_iter()
        .filter(|ns| ns.typ() != LinuxNamespaceType::Network)
        .collect();
    let linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .cgroups_path(PathBuf::from("/").join(cgroup_name))
        .devices(devices)
        .resources(resources)
        .masked_paths(oci_spec::runtime::get_default_maskedpaths())
        .readonly_paths(oci_spec::runtime::get_default_readonly_paths())
        .build()
        .map_err(oci_error("linux section"))?;

    let mut oci = Spec::default();
    oci.set_hostname(Some(format!("corral-job-{}", spec.job_id)));
    oci.set_root(Some(
        RootBuilder::default().path(image).readonly(!spec.writable_root).build().map_err(oci_error("root"))?,
    ));
    oci.set_process(Some(process));
    oci.set_mounts(Some(mounts));
    oci.set_linux(Some(linux));
    if let Some(cdi) = cdi.filter(|c| !c.hooks.is_empty()) {
        oci.set_hooks(Some(hooks(&cdi.hooks)?));
    }
    Ok(oci)
}

fn is_nvidia_node(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("nvidia"))
}

fn hooks(cdi_hooks: &[cdi::Hook]) -> Result<Hooks, ExecError> {
    let mut hooks = Hooks::default();
    for h in cdi_hooks {
        let mut builder = HookBuilder::default().path(&h.path).args(h.args.clone()).env(h.env.clone());
        if let Some(t) = h.timeout {
            builder = builder.timeout(t);
        }
        let hook = builder.build().map_err(oci_error("hooks"))?;
        let list = match h.hook_name.as_str() {
            "prestart" => hooks.prestart_mut(),
            "createRuntime" => hooks.create_runtime_mut(),
            "createContainer" => hooks.create_container_mut(),
            "startContainer" => hooks.start_container_mut(),
            "poststart" => hooks.poststart_mut(),
            "poststop" => hooks.poststop_mut(),
            other => {
                warn!(hook = other, "ignoring a CDI hook of an unknown kind");
                continue;
            }
        };
        list.get_or_insert_with(Vec::new).push(hook);
    }
    Ok(hooks)
}

#[cfg(test)]
mod tests {
    //! Real containers: these need root, runc and a static busybox (CI installs the Debian
    //! packages runc and busybox-static). Each test has its own cgroup root and state dir.

    use super::*;
    use crate::executor::{ResourceLimits, STDERR_LOG, STDOUT_LOG};
    use std::collections::BTreeMap;
    use std::time::Duration;

    const DEADLINE: Duration = Duration::from_secs(60);
    const BUSYBOX: &str = "/bin/busybox";
    const APPLETS: [&str; 10] = ["sh", "id", "cat", "sleep", "echo", "touch", "pwd", "grep", "ls", "true"];

    type Fixture = crate::executor::testing::Fixture<RuncExecutor>;

    impl Fixture {
        /// A runc executor with its own state dir and cgroup root, and a busybox rootfs; runs
        /// job 11, attempt 2.
        fn new() -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            let image = dir.path().join("rootfs");
            std::fs::create_dir_all(image.join("bin")).expect("rootfs");
            assert!(
                Path::new(BUSYBOX).exists(),
                "{BUSYBOX} not found: install the Debian package busybox-static (the CI script installs it)"
            );
            let binary = std::fs::read(BUSYBOX).expect("read busybox");
            assert!(
                !binary.windows(b"/ld-linux".len()).any(|w| w == b"/ld-linux"),
                "{BUSYBOX} is dynamically linked and cannot run alone in a rootfs: install busybox-static"
            );
            std::fs::copy(BUSYBOX, image.join("bin/busybox")).expect("copy busybox");
            for applet in APPLETS {
                std::os::unix::fs::symlink("busybox", image.join("bin").join(applet)).expect("applet link");
            }
            let root = crate::executor::testing::unique_cgroup_root("corral-runc-test");
            let executor = RuncExecutor::new(RuncConfig::new(dir.path().join("state"), root))
                .unwrap_or_else(|e| panic!("{e} (the CI script installs the Debian package runc)"));
            Fixture::with(executor, dir, Some(image), 11, 2)
        }

        fn state_is_gone(&self) -> bool {
            let empty = |dir: &Path| std::fs::read_dir(dir).map(|mut d| d.next().is_none()).unwrap_or(true);
            empty(&self.executor.runc_root) && empty(&self.executor.bundles)
        }
    }

    /// Waits until the job's command (not `runc init`) runs in the job cgroup.
    async fn wait_for_command(job: &RunningJob, comm: &str) -> Vec<u32> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let pids = job.pids().expect("pids");
            let running = pids
                .iter()
                .any(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == comm));
            if running {
                return pids;
            }
            assert!(Instant::now() < deadline, "{comm} never ran in the job cgroup (pids {pids:?})");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn container_exit_code_and_logs() {
        let fx = Fixture::new();
        let mut job = fx.executor.launch(&fx.spec(&["sh", "-c", "echo hi; echo err >&2; exit 3"])).expect("launch");
        let dirs = job.cgroup_dirs();
        let exit = fx.wait_bounded(&mut job, DEADLINE).await;
        assert_eq!((exit.exit_code, exit.signal), (Some(3), None), "stderr: {}", fx.log(STDERR_LOG));
        assert_eq!(fx.log(STDOUT_LOG), "hi\n");
        assert_eq!(fx.log(STDERR_LOG), "err\n");
        assert!(dirs.iter().all(|d| !d.exists()), "job cgroup left behind: {dirs:?}");
        assert!(fx.state_is_gone(), "runc state or bundle left behind");
    }

    #[tokio::test]
    async fn container_is_confined_and_runs_as_the_job_user() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&[
            "sh",
            "-c",
            "id -u; id -g; pwd; echo $HOME $CORRAL_X; touch /work/owned; touch /not-allowed 2>/dev/null || echo ro; \
             grep -E '^(CapEff|NoNewPrivs)' /proc/self/status",
        ]);
        spec.env.insert("CORRAL_X".into(), "42".into());
        spec.uid = Some(65534);
        spec.gid = Some(65534);
        std::fs::set_permissions(fx.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        let mut job = fx.executor.launch(&spec).expect("launch");
        let exit = fx.wait_bounded(&mut job, DEADLINE).await;
        assert_eq!(exit.exit_code, Some(0), "stderr: {}", fx.log(STDERR_LOG));
        let out = fx.log(STDOUT_LOG);
        let lines: Vec<String> = out.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        assert_eq!(
            lines,
            ["65534", "65534", "/work", "/work 42", "ro", "CapEff: 0000000000000000", "NoNewPrivs: 1"],
            "{out}"
        );
        use std::os::unix::fs::MetadataExt;
        let owned = std::fs::metadata(spec.work_dir.join("owned")).expect("file made in the container");
        assert_eq!((owned.uid(), owned.gid()), (65534, 65534));
    }

    #[tokio::test]
    async fn killing_a_container_reports_the_signal_and_keeps_the_limits() {
        let fx = Fixture::new();
        let mut spec = fx.spec(&["sleep", "1000"]);
        spec.limits.memory_bytes = Some(64 * 1024 * 1024);
        let mut job = fx.executor.launch(&spec).expect("launch");
        let pids = wait_for_command(&job, "sleep").await;
        assert!(!pids.contains(&job.pid()), "runc itself stays outside the job cgroup");
        let limit = match job.cgroup_dirs().iter().find_map(|d| {
            std::fs::read_to_string(d.join("memory.limit_in_bytes"))
                .or_else(|_| std::fs::read_to_string(d.join("memory.max")))
                .ok()
        }) {
            Some(text) => text.trim().to_owned(),
            None => panic!("no memory limit file in {:?}", job.cgroup_dirs()),
        };
        assert_eq!(limit, (64 * 1024 * 1024).to_string(), "runc must keep the job's limits");
        job.kill_tree().expect("kill_tree");
        let exit = fx.wait_bounded(&mut job, DEADLINE).await;
        assert_eq!((exit.exit_code, exit.signal), (None, Some(libc::SIGKILL)), "{exit:?}");
        assert!(fx.state_is_gone());
    }

    #[tokio::test]
    async fn reap_leftovers_deletes_containers_of_a_dead_worker() {
        let fx = Fixture::new();
        let job = fx.executor.launch(&fx.spec(&["sleep", "1000"])).expect("launch");
        let pids = wait_for_command(&job, "sleep").await;
        std::mem::forget(job);
        let reaped = fx.executor.reap_leftovers().expect("reap");
        assert_eq!(reaped, vec![format!("{}/job-11-2", fx.executor.cgroup_root)]);
        for pid in pids {
            let deadline = Instant::now() + DEADLINE;
            while Path::new(&format!("/proc/{pid}/cmdline")).exists()
                && std::fs::read_to_string(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with("sleep"))
            {
                assert!(Instant::now() < deadline, "container process {pid} survived the reaping");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert!(fx.state_is_gone());
    }

    #[test]
    fn missing_runc_and_bad_images_are_explained() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = RuncConfig::new(dir.path().to_path_buf(), "corral-x");
        config.runc = PathBuf::from("no-such-runc-corral");
        let err = RuncExecutor::new(config).expect_err("no runc");
        assert!(err.to_string().starts_with("runc not found"), "{err}");
        assert!(err.to_string().contains("apt-get install runc"), "{err}");
    }

    #[test]
    fn config_json_has_devices_binds_and_no_network_namespace() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut spec = LaunchSpec {
            job_id: 5,
            attempt: 1,
            argv: vec!["python".into(), "train.py".into()],
            env: BTreeMap::from([("CUDA_VISIBLE_DEVICES".to_owned(), "0".to_owned())]),
            work_dir: dir.path().join("work"),
            work_files: Vec::new(),
            limits: ResourceLimits { open_files: Some(4096), ..Default::default() },
            uid: Some(2001),
            gid: Some(2002),
            writable_root: false,
            image: Some(dir.path().join("rootfs")),
            devices: vec![PathBuf::from("/dev/null")],
            cdi_devices: Vec::new(),
            binds: vec![PathBuf::from("/run/corral/mps/0/pipe")],
            mounts: vec![super::super::BindMount {
                source: PathBuf::from("/data/set"),
                target: PathBuf::from("/data"),
                read_only: true,
            }],
            files: Default::default(),
            not_after: None,
        };
        spec.limits.memory_bytes = Some(1 << 30);
        spec.limits.cpu_millis = Some(1500);
        let oci = build_spec(&spec, &dir.path().join("rootfs"), "corral/job-5-1", None, true).expect("spec");
        let json = serde_json::to_value(&oci).expect("json");
        assert_eq!(json["linux"]["cgroupsPath"], "/corral/job-5-1");
        assert_eq!(json["process"]["user"]["uid"], 2001);
        assert_eq!(json["process"]["user"]["gid"], 2002);
        assert_eq!(json["process"]["cwd"], "/work");
        assert_eq!(json["process"]["noNewPrivileges"], true);
        assert_eq!(json["process"]["capabilities"]["bounding"], serde_json::json!([]));
        assert_eq!(json["process"]["rlimits"][0]["hard"], 4096);
        assert!(json["process"]["env"].as_array().expect("env").contains(&"CUDA_VISIBLE_DEVICES=0".into()));
        assert_eq!(json["root"]["readonly"], true);
        let resources = &json["linux"]["resources"];
        assert_eq!(
            (resources["memory"]["limit"].as_i64(), resources["memory"]["swap"].as_i64()),
            (Some(1 << 30), Some(1 << 30))
        );
        assert_eq!(
            (resources["cpu"]["quota"].as_i64(), resources["cpu"]["period"].as_u64()),
            (Some(150_000), Some(100_000))
        );
        let namespaces: Vec<&str> =
            json["linux"]["namespaces"].as_array().expect("ns").iter().filter_map(|n| n["type"].as_str()).collect();
        assert!(!namespaces.contains(&"network") && namespaces.contains(&"pid"), "{namespaces:?}");
        let device = &json["linux"]["devices"][0];
        assert_eq!(
            (device["path"].as_str(), device["major"].as_i64(), device["minor"].as_i64()),
            (Some("/dev/null"), Some(1), Some(3))
        );
        let rules = json["linux"]["resources"]["devices"].as_array().expect("rules");
        assert_eq!(rules[0]["allow"], false);
        assert_eq!((rules[1]["allow"].as_bool(), rules[1]["major"].as_i64()), (Some(true), Some(1)));
        let destinations: Vec<&str> =
            json["mounts"].as_array().expect("mounts").iter().filter_map(|m| m["destination"].as_str()).collect();
        for wanted in ["/proc", "/dev", "/work", "/tmp", "/run/corral/mps/0/pipe", "/data"] {
            assert!(destinations.contains(&wanted), "{wanted} not in {destinations:?}");
        }
        let data =
            json["mounts"].as_array().expect("mounts").iter().find(|m| m["destination"] == "/data").expect("/data");
        assert_eq!(data["source"], "/data/set");
        assert!(data["options"].as_array().expect("options").contains(&"ro".into()), "{data}");

        // With CDI edits the GPU nodes come from the spec, other nodes still from the job.
        spec.devices = vec![PathBuf::from("/dev/nvidia0"), PathBuf::from("/dev/zero")];
        let cdi = Edits {
            env: vec!["NVIDIA_CDI=1".into()],
            device_nodes: vec![cdi::DeviceNode { path: "/dev/null".into(), host_path: None, permissions: None }],
            mounts: Vec::new(),
            hooks: vec![cdi::Hook {
                hook_name: "createContainer".into(),
                path: "/usr/bin/nvidia-ctk".into(),
                args: vec!["nvidia-ctk".into(), "hook".into()],
                env: Vec::new(),
                timeout: None,
            }],
        };
        let json = serde_json::to_value(
            build_spec(&spec, &dir.path().join("rootfs"), "c/job-5-1", Some(&cdi), false).expect("spec"),
        )
        .expect("json");
        let paths: Vec<&str> =
            json["linux"]["devices"].as_array().expect("devices").iter().filter_map(|d| d["path"].as_str()).collect();
        assert_eq!(paths, ["/dev/null", "/dev/zero"]);
        assert_eq!(json["hooks"]["createContainer"][0]["path"], "/usr/bin/nvidia-ctk");
        assert!(json["process"]["env"].as_array().expect("env").contains(&"NVIDIA_CDI=1".into()));
    }
}
