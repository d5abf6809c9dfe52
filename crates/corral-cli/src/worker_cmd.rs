//! `corral worker --config FILE`: a worker daemon from TOML. Parses and validates the file
//! (errors name the key), builds the GPU backend and executors, registers with the
//! coordinators and runs until SIGINT/SIGTERM. A changed file takes effect at the next start:
//! the worker registers again with the new spec.

use anyhow::{bail, Context};
use corral_client::{Client, ClientConfig};
use corral_worker::executor::{Executor, ProcessExecutor, RoutingExecutor, RuncConfig, RuncExecutor};
use corral_worker::gpu::{GpuBackend, NvmlGpus, SimulatedDevice, SimulatedGpus};
use corral_worker::health::{HealthPolicy, DEFAULT_FATAL_XIDS};
use corral_worker::hygiene::HygieneConfig;
use corral_worker::mps::MpsConfig;
use corral_worker::{GuardCommand, JobUser, UserMapping, Worker, WorkerConfig};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// The worker's config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct WorkerFile {
    /// Unique node name (default: the host name).
    pub node_name: Option<String>,
    /// Coordinator addresses, host:port.
    pub coordinators: Vec<String>,
    /// Token the worker authenticates with (default: $CORRAL_TOKEN).
    pub token: Option<String>,
    /// Job directories, logs, runc state and the GPU leak record.
    pub data_dir: PathBuf,
    /// Address of the worker agent (log streaming).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Address the coordinators reach the agent at (default: the bound `listen` address).
    pub advertise: Option<String>,
    /// Address to serve Prometheus metrics on (`GET /metrics`); absent: no metrics listener.
    pub metrics_addr: Option<String>,
    #[serde(default = "default_heartbeat_interval")]
    pub heartbeat_interval: String,
    /// SIGTERM to SIGKILL when a job is cancelled.
    #[serde(default = "default_kill_grace")]
    pub kill_grace: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub partitions: Vec<String>,
    #[serde(default)]
    pub resources: ResourcesSection,
    pub gpu: GpuSection,
    #[serde(default)]
    pub executor: ExecutorSection,
    pub users: Option<UsersSection>,
    #[serde(default)]
    pub health: HealthSection,
    #[serde(default)]
    pub hygiene: HygieneSection,
    #[serde(default)]
    pub mps: MpsSection,
    #[serde(default)]
    pub mig: MigSection,
    /// Mutual TLS towards the coordinators and for the agent (a worker certificate whose name
    /// is this node's name).
    pub tls: Option<crate::coordinator_cmd::TlsSection>,
    /// Serve the agent (job logs) in plaintext on a non-loopback address (without [tls]).
    #[serde(default)]
    pub insecure: bool,
}

fn default_listen() -> String {
    "0.0.0.0:7171".into()
}
fn default_heartbeat_interval() -> String {
    "500ms".into()
}
fn default_kill_grace() -> String {
    "5s".into()
}

/// What the node offers besides GPUs (default: the whole host).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ResourcesSection {
    pub cpus: Option<f64>,
    pub memory: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct GpuSection {
    /// `nvml` or `simulated`.
    pub backend: String,
    /// Simulated devices, in index order.
    #[serde(default)]
    pub devices: Vec<SimulatedDeviceSection>,
    /// Fault injection file of the simulated backend (default: `<data-dir>/faults.toml`).
    pub faults_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct SimulatedDeviceSection {
    pub model: String,
    pub memory: String,
    #[serde(default = "one")]
    pub count: u32,
    /// A MIG-capable card with MIG mode on (instances are simulated in memory).
    #[serde(default)]
    pub mig: bool,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct ExecutorSection {
    /// Parent cgroup of the job cgroups.
    pub cgroup_root: String,
    /// runc binary for `--image` jobs; `""` disables containers.
    pub runc: String,
    /// Directories searched for CDI specs.
    pub cdi_dirs: Vec<PathBuf>,
    /// Give containers /dev/infiniband (RDMA).
    pub rdma: bool,
    /// RLIMIT_NOFILE of jobs.
    pub open_files: Option<u64>,
    /// Most processes and threads of one job (its cgroup's pids.max).
    pub pids_max: u64,
}

impl Default for ExecutorSection {
    fn default() -> Self {
        ExecutorSection {
            cgroup_root: ProcessExecutor::DEFAULT_CGROUP_ROOT.into(),
            runc: "runc".into(),
            cdi_dirs: vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
            rdma: false,
            open_files: None,
            pids_max: corral_worker::DEFAULT_PIDS_MAX,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct UserSection {
    pub uid: u32,
    pub gid: u32,
}

/// Tenant to uid/gid mapping.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct UsersSection {
    #[serde(default)]
    pub allow_root: bool,
    /// For tenants without an entry; absent: their jobs are refused.
    pub default: Option<UserSection>,
    #[serde(default)]
    pub tenants: BTreeMap<String, UserSection>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct HealthSection {
    /// 0 disables the check.
    pub max_temperature_c: u32,
    pub fatal_xids: Vec<u64>,
    /// Uncorrected ECC errors tolerated; -1 ignores ECC.
    pub max_ecc_uncorrected: i64,
}

impl Default for HealthSection {
    fn default() -> Self {
        HealthSection { max_temperature_c: 90, fatal_xids: DEFAULT_FATAL_XIDS.to_vec(), max_ecc_uncorrected: 0 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct HygieneSection {
    pub memory_tolerance: String,
    pub settle_time: String,
    pub recheck_interval: String,
}

impl Default for HygieneSection {
    fn default() -> Self {
        HygieneSection { memory_tolerance: "128MiB".into(), settle_time: "5s".into(), recheck_interval: "10s".into() }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct MpsSection {
    pub enabled: bool,
    pub control: PathBuf,
}

impl Default for MpsSection {
    fn default() -> Self {
        let d = MpsConfig::default();
        MpsSection { enabled: d.enabled, control: d.control }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct MigSection {
    /// Create a MIG instance for a MIG job when no free one of its profile exists, and destroy
    /// it when the job ends. MIG mode itself must already be on (`nvidia-smi -mig 1`).
    pub manage: bool,
}

/// Which GPU backend to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Nvml,
    Simulated(Vec<SimulatedDevice>),
}

fn duration(key: &str, value: &str) -> Result<Duration, String> {
    // A bare number means minutes to parse_duration; here it would surely be a mistake.
    if value.trim().bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{key}: '{value}' has no unit; write e.g. \"500ms\", \"5s\" or \"2m\""));
    }
    corral_types::parse_duration(value).map_err(|e| format!("{key}: {e}"))
}

fn size(key: &str, value: &str) -> Result<u64, String> {
    corral_types::parse_size(value).map_err(|e| format!("{key}: {e}"))
}

fn host_port(value: &str) -> bool {
    value.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default()
}

impl WorkerFile {
    /// Reads, parses and validates `path`; errors are one line naming the file and the key.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        let file: WorkerFile = toml::from_str(&text).map_err(|e| {
            let line = e.span().map(|s| text[..s.start.min(text.len())].lines().count().max(1));
            let message = e.message().trim().replace('\n', " ");
            match line {
                Some(line) => anyhow::anyhow!("invalid worker config {} (line {line}): {message}", path.display()),
                None => anyhow::anyhow!("invalid worker config {}: {message}", path.display()),
            }
        })?;
        file.validate().map_err(|e| anyhow::anyhow!("invalid worker config {}: {e}", path.display()))?;
        Ok(file)
    }

    /// Checks every value; the error starts with the key (`gpu.backend: ...`).
    pub fn validate(&self) -> Result<(), String> {
        if let Some(name) = &self.node_name {
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                return Err(format!("node-name: '{name}' must be letters, digits, '-', '_' or '.'"));
            }
        }
        if self.coordinators.is_empty() {
            return Err("coordinators: give at least one coordinator address, e.g. [\"10.0.0.1:7070\"]".into());
        }
        for (i, c) in self.coordinators.iter().enumerate() {
            if !host_port(c) {
                return Err(format!("coordinators[{i}]: '{c}' is not host:port"));
            }
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err("data-dir: must not be empty".into());
        }
        self.listen.parse::<SocketAddr>().map_err(|_| format!("listen: '{}' is not IP:PORT", self.listen))?;
        if let Some(a) = &self.advertise {
            if !host_port(a) {
                return Err(format!("advertise: '{a}' is not host:port"));
            }
        }
        if let Some(m) = &self.metrics_addr {
            crate::metrics_http::parse_addr("metrics-addr", m)?;
        }
        if duration("heartbeat-interval", &self.heartbeat_interval)?.is_zero() {
            return Err("heartbeat-interval: must be greater than 0".into());
        }
        duration("kill-grace", &self.kill_grace)?;
        for key in self.labels.keys() {
            if key.is_empty() || key == "partition" {
                return Err(format!("labels: '{key}' is not a usable label name (partitions go in `partitions`)"));
            }
        }
        if let Some(p) = self.partitions.iter().find(|p| p.is_empty()) {
            return Err(format!("partitions: '{p}' is empty"));
        }
        if let Some(cpus) = self.resources.cpus {
            if !(cpus > 0.0 && cpus.is_finite()) {
                return Err(format!("resources.cpus: {cpus} must be a positive number of cores"));
            }
        }
        if let Some(m) = &self.resources.memory {
            if size("resources.memory", m)? == 0 {
                return Err("resources.memory: must be greater than 0".into());
            }
        }
        self.backend()?;
        let e = &self.executor;
        if e.cgroup_root.is_empty()
            || e.cgroup_root.starts_with('/')
            || e.cgroup_root.split('/').any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(format!(
                "executor.cgroup-root: '{}' must be a relative path of plain names such as \"corral\"",
                e.cgroup_root
            ));
        }
        if e.pids_max == 0 {
            return Err("executor.pids-max: must be greater than 0".into());
        }
        if e.open_files == Some(0) {
            return Err("executor.open-files: must be greater than 0 (leave it out to inherit)".into());
        }
        self.user_mapping()?;
        if self.health.max_ecc_uncorrected < -1 {
            return Err("health.max-ecc-uncorrected: use -1 to ignore ECC, or a count >= 0".into());
        }
        size("hygiene.memory-tolerance", &self.hygiene.memory_tolerance)?;
        duration("hygiene.settle-time", &self.hygiene.settle_time)?;
        if duration("hygiene.recheck-interval", &self.hygiene.recheck_interval)?.is_zero() {
            return Err("hygiene.recheck-interval: must be greater than 0".into());
        }
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        if self.mig.manage && self.gpu.backend == "simulated" && !self.gpu.devices.iter().any(|d| d.mig) {
            return Err("mig.manage: no device in gpu.devices has mig = true, so there is nothing to manage".into());
        }
        Ok(())
    }

    pub fn backend(&self) -> Result<Backend, String> {
        match self.gpu.backend.as_str() {
            "nvml" => {
                if !self.gpu.devices.is_empty() {
                    return Err("gpu.devices: only the simulated backend declares devices; nvml finds them".into());
                }
                Ok(Backend::Nvml)
            }
            "simulated" => {
                let mut devices = Vec::new();
                for (i, d) in self.gpu.devices.iter().enumerate() {
                    if d.model.trim().is_empty() {
                        return Err(format!("gpu.devices[{i}].model: must not be empty"));
                    }
                    let memory = size(&format!("gpu.devices[{i}].memory"), &d.memory)?;
                    if memory < 1 << 20 {
                        return Err(format!("gpu.devices[{i}].memory: '{}' is less than 1MiB", d.memory));
                    }
                    if d.count == 0 {
                        return Err(format!("gpu.devices[{i}].count: must be at least 1"));
                    }
                    let device = SimulatedDevice { model: d.model.clone(), memory_mib: memory >> 20, mig: d.mig };
                    devices.extend(std::iter::repeat_n(device, d.count as usize));
                }
                Ok(Backend::Simulated(devices))
            }
            other => Err(format!("gpu.backend: unknown backend '{other}' (expected nvml or simulated)")),
        }
    }

    /// The tenant users; without a `[users]` section jobs run as nobody (65534).
    pub fn user_mapping(&self) -> Result<UserMapping, String> {
        let users = self.users.clone().unwrap_or_else(|| UsersSection {
            default: Some(UserSection { uid: 65534, gid: 65534 }),
            ..Default::default()
        });
        let root = |key: String, u: &UserSection| -> Result<(), String> {
            if (u.uid == 0 || u.gid == 0) && !users.allow_root {
                return Err(format!(
                    "{key}: uid/gid 0 is root; map the tenant to another user or set users.allow-root = true"
                ));
            }
            Ok(())
        };
        if let Some(d) = &users.default {
            root("users.default".into(), d)?;
        }
        for (tenant, u) in &users.tenants {
            root(format!("users.tenants.{tenant}"), u)?;
        }
        let user = |u: &UserSection| JobUser { uid: u.uid, gid: u.gid };
        Ok(UserMapping::Tenants {
            tenants: users.tenants.iter().map(|(t, u)| (t.clone(), user(u))).collect(),
            default: users.default.as_ref().map(user),
            allow_root: users.allow_root,
        })
    }

    pub fn node_name(&self) -> String {
        self.node_name.clone().unwrap_or_else(host_name)
    }

    /// The library settings (the file must have been validated).
    pub fn worker_config(&self) -> Result<WorkerConfig, String> {
        let mut c = WorkerConfig::for_host(self.node_name(), self.data_dir.clone());
        c.heartbeat_interval = duration("heartbeat-interval", &self.heartbeat_interval)?;
        c.kill_grace = duration("kill-grace", &self.kill_grace)?;
        if let Some(cpus) = self.resources.cpus {
            c.cpu_millis = (cpus * 1000.0).round() as u64;
        }
        if let Some(m) = &self.resources.memory {
            c.memory_bytes = size("resources.memory", m)?;
        }
        c.labels = self.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        c.partitions = self.partitions.clone();
        c.users = self.user_mapping()?;
        c.health = HealthPolicy {
            max_temperature_c: (self.health.max_temperature_c > 0).then_some(self.health.max_temperature_c),
            fatal_xids: self.health.fatal_xids.iter().copied().collect(),
            max_ecc_uncorrected: u64::try_from(self.health.max_ecc_uncorrected).ok(),
        };
        c.hygiene = HygieneConfig {
            memory_tolerance_mib: size("hygiene.memory-tolerance", &self.hygiene.memory_tolerance)? >> 20,
            settle_time: duration("hygiene.settle-time", &self.hygiene.settle_time)?,
            recheck_interval: duration("hygiene.recheck-interval", &self.hygiene.recheck_interval)?,
        };
        c.mps = MpsConfig { enabled: self.mps.enabled, control: self.mps.control.clone() };
        if self.executor.rdma {
            c.extra_devices = corral_worker::infiniband_devices();
        }
        c.open_files = self.executor.open_files;
        c.mig_manage = self.mig.manage;
        c.pids_max = Some(self.executor.pids_max);
        Ok(c)
    }

    /// The faults file of the simulated backend.
    pub fn faults_file(&self) -> PathBuf {
        self.gpu.faults_file.clone().unwrap_or_else(|| self.data_dir.join("faults.toml"))
    }
}

fn gpu_backend(file: &WorkerFile) -> anyhow::Result<Arc<dyn GpuBackend>> {
    match file.backend().map_err(anyhow::Error::msg)? {
        Backend::Nvml => {
            let gpus = NvmlGpus::open().context("gpu.backend = \"nvml\"")?;
            Ok(Arc::new(gpus))
        }
        Backend::Simulated(devices) => {
            let faults = file.faults_file();
            tracing::info!(devices = devices.len(), faults_file = %faults.display(), "using simulated gpus");
            Ok(Arc::new(SimulatedGpus::with_devices(&file.node_name(), &devices).with_faults_file(faults)))
        }
    }
}

fn executor(file: &WorkerFile) -> anyhow::Result<Arc<dyn Executor>> {
    let process = ProcessExecutor::new(file.executor.cgroup_root.clone())?;
    if file.executor.runc.is_empty() {
        tracing::info!("containers disabled (executor.runc = \"\"): --image jobs will fail");
        return Ok(Arc::new(process));
    }
    let mut runc = RuncConfig::new(file.data_dir.join("containers"), file.executor.cgroup_root.clone());
    runc.runc = PathBuf::from(&file.executor.runc);
    runc.cdi_dirs = file.executor.cdi_dirs.clone();
    match RuncExecutor::new(runc) {
        Ok(runc) => {
            tracing::info!(runc = %runc.runc().display(), "containers enabled");
            Ok(Arc::new(RoutingExecutor::new(Arc::new(process), Arc::new(runc))))
        }
        Err(e) => {
            tracing::warn!(error = %e, "containers disabled: --image jobs will fail");
            Ok(Arc::new(process))
        }
    }
}

/// The worker a validated file describes, with its bound agent listener.
/// The fence guard of a worker whose job cgroups live under `cgroup_root`: this binary's
/// hidden `worker-guard` command.
pub fn fence_guard(cgroup_root: &str) -> anyhow::Result<GuardCommand> {
    let program = std::env::current_exe().context("cannot find the corral binary to start the fence guard")?;
    Ok(GuardCommand { program, args: vec!["worker-guard".into(), "--cgroup-root".into(), cgroup_root.into()] })
}

/// Builds the worker of `file`; `guard` starts its fence guard (see [`fence_guard`]).
async fn build(
    file: &WorkerFile,
    token: Option<String>,
    guard: Option<GuardCommand>,
) -> anyhow::Result<(Worker, TcpListener)> {
    std::fs::create_dir_all(&file.data_dir)
        .with_context(|| format!("cannot create data-dir {}", file.data_dir.display()))?;
    // Jobs get work dirs under data-dir and run with them as cwd: resolve a relative one now.
    let mut absolute = file.clone();
    absolute.data_dir = file.data_dir.canonicalize()?;
    let file = &absolute;
    let gpus = gpu_backend(file)?;
    let executor = executor(file)?;
    let mut config = file.worker_config().map_err(anyhow::Error::msg)?;
    config.fence_guard = guard;
    let tls = match &file.tls {
        Some(section) => {
            let identity = corral_security::certificate_identity(&section.cert)?;
            if identity.name != config.node_name {
                bail!(
                    "tls.cert: {} is the certificate of worker '{}', but this node is '{}'",
                    section.cert.display(),
                    identity.name,
                    config.node_name
                );
            }
            Some(section.load(corral_security::Role::Worker)?)
        }
        None => None,
    };
    let listen: SocketAddr = file.listen.parse()?;
    if tls.is_none() && !file.insecure && !listen.ip().is_loopback() {
        bail!(
            "listen: {listen} is not a loopback address and the agent would serve job logs in plaintext: configure [tls] (see `corral certs init`), or set insecure = true"
        );
    }
    let listener = crate::listen::bind(listen, "for the coordinators").await?;
    let bound = listener.local_addr()?;
    config.advertise_addr = match &file.advertise {
        Some(a) => a.clone(),
        None if bound.ip().is_unspecified() => {
            bail!("advertise: listen {bound} is a wildcard address; set advertise = \"<this host>:{}\"", bound.port())
        }
        None => bound.to_string(),
    };
    let mut client_config = ClientConfig::new(file.coordinators.clone());
    client_config.token = file.token.clone().or(token);
    client_config.tls = tls.as_ref().map(|(_, client)| client.clone());
    config.agent_tls = tls.map(|(server, _)| server);
    let client = Client::new(client_config)?;
    Ok((Worker::new(config, client.gateway(), executor, gpus), listener))
}

pub async fn run(config_path: &Path, token: Option<String>) -> anyhow::Result<()> {
    crate::dev::init_tracing();
    let file = WorkerFile::load(config_path)?;
    let guard = fence_guard(&file.executor.cgroup_root)?;
    let (worker, listener) = build(&file, token, Some(guard)).await?;
    println!(
        "corral worker {} serving logs on {}; registering with {}",
        file.node_name(),
        listener.local_addr()?,
        file.coordinators.join(",")
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    if let Some(m) = &file.metrics_addr {
        let addr = crate::metrics_http::parse_addr("metrics-addr", m).map_err(anyhow::Error::msg)?;
        let sources = vec![crate::metrics_http::MetricsSource::Worker(worker.metrics())];
        let bound = crate::metrics_http::start(addr, sources, stopped(stop_rx.clone())).await?;
        println!("corral worker {} serving metrics at http://{bound}/metrics", file.node_name());
    }
    let mut running = tokio::spawn(worker.run(listener, stopped(stop_rx)));
    tokio::select! {
        _ = crate::dev::termination() => {
            tracing::info!("shutting down: killing local jobs");
            let _ = stop_tx.send(true);
            (&mut running).await??;
        }
        result = &mut running => result??,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "coordinators = [\"127.0.0.1:7071\"]\ndata-dir = \"/var/lib/corral\"\n[gpu]\nbackend = \"simulated\"\n[[gpu.devices]]\nmodel = \"RTX 5090\"\nmemory = \"32GiB\"\ncount = 2\n";

    #[test]
    fn every_example_worker_config_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cluster-configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("cluster-configs/") {
            let path = entry.expect("entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            if name.starts_with("worker") && name.ends_with(".toml") {
                let file = WorkerFile::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
                file.worker_config().unwrap_or_else(|e| panic!("{name}: {e}"));
                seen += 1;
            }
        }
        assert!(seen >= 2, "expected the simulated and nvml example worker configs, found {seen}");
    }

    #[test]
    fn a_minimal_config_gets_safe_defaults() {
        let file: WorkerFile = toml::from_str(MINIMAL).expect("parse");
        file.validate().expect("valid");
        assert_eq!(
            file.backend(),
            Ok(Backend::Simulated(vec![
                SimulatedDevice { model: "RTX 5090".into(), memory_mib: 32768, mig: false };
                2
            ]))
        );
        let config = file.worker_config().expect("config");
        assert_eq!(config.heartbeat_interval, Duration::from_millis(500));
        assert_eq!(config.hygiene, HygieneConfig::default());
        assert_eq!(config.health, HealthPolicy::default());
        // Without [users], jobs run as nobody, never as the (root) worker.
        assert_eq!(config.users.resolve("team-a"), Ok(Some(JobUser { uid: 65534, gid: 65534 })));
        assert_eq!(file.faults_file(), PathBuf::from("/var/lib/corral/faults.toml"));
    }

    #[test]
    fn tenants_map_to_users_and_root_needs_consent() {
        let text = format!("{MINIMAL}[users]\ndefault = {{ uid = 1000, gid = 1000 }}\n[users.tenants]\nteam-a = {{ uid = 2001, gid = 2002 }}\n");
        let file: WorkerFile = toml::from_str(&text).expect("parse");
        let users = file.user_mapping().expect("users");
        assert_eq!(users.resolve("team-a"), Ok(Some(JobUser { uid: 2001, gid: 2002 })));
        assert_eq!(users.resolve("other"), Ok(Some(JobUser { uid: 1000, gid: 1000 })));

        let text = format!("{MINIMAL}[users.tenants]\nteam-a = {{ uid = 2001, gid = 2001 }}\n");
        let users = toml::from_str::<WorkerFile>(&text).expect("parse").user_mapping().expect("users");
        let err = users.resolve("team-b").expect_err("unmapped tenant");
        assert!(err.contains("tenant 'team-b' has no user"), "{err}");

        let text = format!("{MINIMAL}[users]\nallow-root = true\n[users.tenants]\nops = {{ uid = 0, gid = 0 }}\n");
        let users = toml::from_str::<WorkerFile>(&text).expect("parse").user_mapping().expect("users");
        assert_eq!(users.resolve("ops"), Ok(Some(JobUser { uid: 0, gid: 0 })));
    }

    /// Polls `check` until it holds (bounded).
    async fn eventually<F: Fn() -> Fut, Fut: std::future::Future<Output = bool>>(what: &str, check: F) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !check().await {
            assert!(std::time::Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A coordinator in this process and a worker built from a config file as `corral worker`
    /// builds it: a job that leaves memory on its GPU makes the GPU dirty (attributed to the
    /// job), an overheating GPU takes no jobs, and both heal when the faults go away.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn simulated_leak_and_overheat_make_gpus_unschedulable_until_healed() {
        use corral_coordinator::{Coordinator, CoordinatorConfig};
        use corral_core::{ClusterConfig, Command};
        use corral_raft::{RaftNode, RaftNodeConfig};
        use corral_types::{JobSpec, JobState};

        let dir = tempfile::tempdir().expect("tempdir");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let node = RaftNode::open(&RaftNodeConfig::new(1, dir.path().join("coordinator"))).await.expect("raft");
        node.initialize(&addr).await.expect("init");
        let coordinator = Coordinator::new(node.clone(), CoordinatorConfig::default());
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let server = tokio::spawn(coordinator.clone().serve(listener, stopped(stop_rx.clone())));
        node.wait_for(Duration::from_secs(30), |s| s.leader == Some(s.id)).await.expect("leader");
        coordinator.propose(Command::Configure(ClusterConfig::dev_defaults())).await.expect("configure");

        let data_dir = dir.path().join("worker");
        let config = dir.path().join("worker.toml");
        std::fs::write(
            &config,
            format!(
                "node-name = \"sim-it\"\ncoordinators = [\"{addr}\"]\ndata-dir = \"{}\"\nlisten = \"127.0.0.1:0\"\n\
                 heartbeat-interval = \"100ms\"\nkill-grace = \"1s\"\n\
                 [gpu]\nbackend = \"simulated\"\n[[gpu.devices]]\nmodel = \"RTX 5090\"\nmemory = \"32GiB\"\ncount = 2\n\
                 [executor]\ncgroup-root = \"corral-it-{}\"\nrunc = \"\"\n\
                 [hygiene]\nsettle-time = \"300ms\"\nrecheck-interval = \"100ms\"\n",
                data_dir.display(),
                std::process::id()
            ),
        )
        .expect("write config");
        let file = WorkerFile::load(&config).expect("config");
        // In-process: this test binary cannot be the fence guard.
        let (worker, agent) = build(&file, None, None).await.expect("build worker");
        let worker = tokio::spawn(worker.run(agent, stopped(stop_rx.clone())));

        let client = Client::new(ClientConfig::new(vec![addr.clone()])).expect("client");
        let gpu_states = || async {
            let nodes = client.list_nodes().await.expect("nodes");
            nodes
                .iter()
                .find(|n| n.name == "sim-it" && n.state == "up")
                .map(|n| n.gpus.iter().map(|g| g.state.clone()).collect::<Vec<_>>())
                .unwrap_or_default()
        };
        eventually("the worker is up with 2 idle gpus", || async { gpu_states().await == ["idle", "idle"] }).await;

        // GPU 0 will keep 2 GiB after the job; GPU 1 overheats.
        let faults = file.faults_file();
        std::fs::write(&faults, "[[gpu]]\nindex = 0\nleaked-memory-mib = 2048\n").expect("faults");
        let spec = |gpus: u32| JobSpec {
            name: "t".into(),
            tenant: "default".into(),
            priority_class: String::new(),
            gpus,
            gpu_slice: None,
            cpu_millis: 0,
            memory_bytes: 0,
            time_limit_secs: None,
            image: None,
            command: vec!["true".into()],
            env: BTreeMap::new(),
            sched: Default::default(),
        };
        let first = client.submit(&spec(2)).await.expect("submit").job_id;
        let state = |id: u64| {
            let client = client.clone();
            async move { client.get_job(id).await.expect("job").state }
        };
        eventually("the first job succeeded", || async { state(first).await == JobState::Succeeded }).await;
        assert_eq!(gpu_states().await, ["dirty", "idle"], "the leak is reported before the job's end");
        let leaks = std::fs::read_to_string(data_dir.join("gpu-leaks.jsonl")).expect("leak record");
        let leak: serde_json::Value = serde_json::from_str(leaks.lines().next().expect("a leak")).expect("json");
        assert_eq!((leak["job_id"].as_u64(), leak["gpu"].as_u64()), (Some(first), Some(0)), "{leaks}");

        std::fs::write(
            &faults,
            "[[gpu]]\nindex = 0\nleaked-memory-mib = 2048\n[[gpu]]\nindex = 1\ntemperature-c = 97\n",
        )
        .expect("faults");
        eventually("the hot gpu is unschedulable", || async { gpu_states().await == ["dirty", "unhealthy"] }).await;
        let second = client.submit(&spec(1)).await.expect("submit").job_id;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(state(second).await, JobState::Pending, "no job on a dirty or hot gpu");

        std::fs::remove_file(&faults).expect("heal");
        eventually("the second job ran once the gpus healed", || async { state(second).await == JobState::Succeeded })
            .await;
        let leaks = std::fs::read_to_string(data_dir.join("gpu-leaks.jsonl")).expect("leak record");
        assert!(leaks.lines().any(|l| l.contains("\"event\":\"clean\"")), "{leaks}");

        let _ = stop_tx.send(true);
        worker.await.expect("worker task").expect("worker");
        let _ = node.shutdown().await;
        server.await.expect("server task").expect("server");
        let _ = ProcessExecutor::new(format!("corral-it-{}", std::process::id())).map(|e| e.remove_root_cgroup());
    }

    #[test]
    fn bad_configs_name_the_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let with = |extra: &str| format!("{MINIMAL}{extra}");
        let cases = [
            (MINIMAL.replace("simulated", "foo"), "gpu.backend: unknown backend 'foo' (expected nvml or simulated)"),
            (MINIMAL.replace("[gpu]", "bogus = 1\n[gpu]"), "unknown field `bogus`"),
            (MINIMAL.replace("backend", "bckend"), "unknown field `bckend`"),
            (MINIMAL.replace("coordinators = [\"127.0.0.1:7071\"]\n", ""), "missing field `coordinators`"),
            (MINIMAL.replace("127.0.0.1:7071", "nowhere"), "coordinators[0]: 'nowhere' is not host:port"),
            (MINIMAL.replace("32GiB", "lots"), "gpu.devices[0].memory"),
            (MINIMAL.replace("backend = \"simulated\"", "backend = \"nvml\""), "gpu.devices: only the simulated"),
            (format!("heartbeat-interval = \"5\"\n{MINIMAL}"), "heartbeat-interval: '5' has no unit"),
            (with("[users.tenants]\nops = { uid = 0, gid = 0 }\n"), "users.tenants.ops: uid/gid 0 is root"),
            (with("[hygiene]\nsettle-time = \"soon\"\n"), "hygiene.settle-time"),
            (with("[mig]\nmanage = true\n"), "mig.manage: no device in gpu.devices has mig = true"),
            (with("[executor]\ncgroup-root = \"../x\"\n"), "executor.cgroup-root"),
            (format!("metrics-addr = \":9481\"\n{MINIMAL}"), "metrics-addr: ':9481' is not IP:PORT"),
        ];
        for (text, expected) in cases {
            let path = dir.path().join("w.toml");
            std::fs::write(&path, &text).expect("write");
            let err = WorkerFile::load(&path).expect_err(&text).to_string();
            assert!(err.starts_with(&format!("invalid worker config {}", path.display())), "{err}");
            assert!(err.contains(expected), "{err} should mention {expected}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }
}
