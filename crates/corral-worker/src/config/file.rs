//! The worker's config file (`corral worker --config FILE`): its schema, kebab-case with unknown
//! keys refused, durations and sizes parsed once into [`ConfigDuration`] and [`ConfigSize`],
//! validation whose errors name the key, and the [`WorkerConfig`] it yields.

use super::{infiniband_devices, JobUser, UserMapping, WorkerConfig, DEFAULT_PIDS_MAX};
use crate::executor::ProcessExecutor;
use crate::gpu::SimulatedDevice;
use crate::health::HealthPolicy;
use crate::hygiene::HygieneConfig;
use crate::mps::MpsConfig;
use anyhow::Context;
use corral_security::TlsFiles;
use corral_types::{describe_config_error, ConfigDuration, ConfigSize};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

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
    pub heartbeat_interval: ConfigDuration,
    /// SIGTERM to SIGKILL when a job is cancelled.
    #[serde(default = "default_kill_grace")]
    pub kill_grace: ConfigDuration,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub partitions: Vec<String>,
    /// Ports (`FIRST-LAST`, inclusive, or one port) that gangs whose first part runs here meet
    /// on (MASTER_PORT); default 29500-29999.
    pub rendezvous_ports: Option<String>,
    /// When the host goes back to its owner (UTC, `2026-12-31T18:00:00Z`): no job that would
    /// outlast it is placed here, running ones are checkpointed and requeued before it, and the
    /// node drains at it. `corral node lease` overrides it until cleared.
    pub lease_end: Option<String>,
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
    /// Jobs from registry images: the layer store, registries, `--container-mounts` allowed.
    #[serde(default)]
    pub images: corral_image::ImagesSection,
    /// Mutual TLS towards the coordinators and for the agent (a worker certificate whose name
    /// is this node's name).
    pub tls: Option<TlsFiles>,
    /// Serve the agent (job logs) in plaintext on a non-loopback address (without [tls]).
    #[serde(default)]
    pub insecure: bool,
}

fn default_listen() -> String {
    "0.0.0.0:7171".into()
}
fn default_heartbeat_interval() -> ConfigDuration {
    ConfigDuration::from_millis(500)
}
fn default_kill_grace() -> ConfigDuration {
    ConfigDuration::from_secs(5)
}

/// What the node offers besides GPUs (default: the whole host).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ResourcesSection {
    pub cpus: Option<f64>,
    pub memory: Option<ConfigSize>,
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
    pub memory: ConfigSize,
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
    /// Parent cgroup of the workers' cgroups: each worker's job cgroups go one level below,
    /// in a cgroup named after its data dir (see [`WorkerFile::job_cgroup_root`]).
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
            pids_max: DEFAULT_PIDS_MAX,
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
    /// Jobs run as the worker's own user: a single-user machine, as `corral dev` is. Excludes
    /// `default` and `tenants`.
    #[serde(default)]
    pub as_worker: bool,
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
    /// A GPU out for a card fault comes back after this long of clean checks; absent: it
    /// stays out until the worker restarts (after a GPU reset).
    pub recover_after: Option<ConfigDuration>,
}

impl Default for HealthSection {
    fn default() -> Self {
        HealthSection {
            max_temperature_c: 90,
            fatal_xids: crate::xid::card_codes(),
            max_ecc_uncorrected: 0,
            recover_after: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct HygieneSection {
    pub memory_tolerance: ConfigSize,
    pub settle_time: ConfigDuration,
    pub recheck_interval: ConfigDuration,
}

impl Default for HygieneSection {
    fn default() -> Self {
        let d = HygieneConfig::default();
        HygieneSection {
            memory_tolerance: ConfigSize(d.memory_tolerance_mib << 20),
            settle_time: ConfigDuration(d.settle_time),
            recheck_interval: ConfigDuration(d.recheck_interval),
        }
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

/// `IP:PORT` of a listener, or an error naming the key.
pub(crate) fn socket_addr(key: &str, value: &str) -> Result<SocketAddr, String> {
    value.parse().map_err(|_| format!("{key}: '{value}' is not IP:PORT"))
}

fn host_port(value: &str) -> bool {
    value.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
}

/// `lease-end`: a UTC date and time.
fn lease_end(value: &str) -> Result<corral_types::Timestamp, String> {
    corral_types::parse_utc(value)
        .ok_or_else(|| format!("lease-end: '{value}' is not a UTC date and time such as 2026-12-31T18:00:00Z"))
}

/// `FIRST-LAST` (inclusive) or a single port, each 1..=65535; the error names the key.
pub(crate) fn port_range(key: &str, value: &str) -> Result<(u32, u32), String> {
    let bad = |why: &str| format!("{key}: '{value}' {why}");
    let port = |p: &str| p.trim().parse::<u16>().ok().filter(|p| *p > 0).map(u32::from);
    let (first, last) = match value.split_once('-') {
        Some((a, b)) => (port(a), port(b)),
        None => (port(value), port(value)),
    };
    let (Some(first), Some(last)) = (first, last) else {
        return Err(bad("is not a port range FIRST-LAST of ports 1-65535, e.g. \"29500-29599\""));
    };
    if first > last {
        return Err(bad("ends before it starts: write the lower port first"));
    }
    Ok((first, last))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default()
}

impl WorkerFile {
    /// A config with every default: what a file with only these keys says.
    pub fn new(coordinators: Vec<String>, data_dir: PathBuf, gpu: GpuSection) -> WorkerFile {
        WorkerFile {
            node_name: None,
            coordinators,
            token: None,
            data_dir,
            listen: default_listen(),
            advertise: None,
            metrics_addr: None,
            heartbeat_interval: default_heartbeat_interval(),
            kill_grace: default_kill_grace(),
            labels: BTreeMap::new(),
            partitions: Vec::new(),
            rendezvous_ports: None,
            lease_end: None,
            resources: ResourcesSection::default(),
            gpu,
            executor: ExecutorSection::default(),
            images: corral_image::ImagesSection::default(),
            users: None,
            health: HealthSection::default(),
            hygiene: HygieneSection::default(),
            mps: MpsSection::default(),
            mig: MigSection::default(),
            tls: None,
            insecure: false,
        }
    }

    /// Reads, parses and validates `path`; errors are one line naming the file and the key.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        let file: WorkerFile = toml::from_str(&text)
            .map_err(|e| anyhow::anyhow!(describe_config_error("worker config", path, &text, e.message(), e.span())))?;
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
        socket_addr("listen", &self.listen)?;
        if let Some(a) = &self.advertise {
            if !host_port(a) {
                return Err(format!("advertise: '{a}' is not host:port"));
            }
        }
        if let Some(m) = &self.metrics_addr {
            socket_addr("metrics-addr", m)?;
        }
        if self.heartbeat_interval.get().is_zero() {
            return Err("heartbeat-interval: must be greater than 0".into());
        }
        for key in self.labels.keys() {
            if key.is_empty() || key == "partition" {
                return Err(format!("labels: '{key}' is not a usable label name (partitions go in `partitions`)"));
            }
        }
        if let Some(p) = self.partitions.iter().find(|p| p.is_empty()) {
            return Err(format!("partitions: '{p}' is empty"));
        }
        if let Some(range) = &self.rendezvous_ports {
            port_range("rendezvous-ports", range)?;
        }
        if let Some(end) = &self.lease_end {
            lease_end(end)?;
        }
        if let Some(cpus) = self.resources.cpus {
            if !(cpus > 0.0 && cpus.is_finite()) {
                return Err(format!("resources.cpus: {cpus} must be a positive number of cores"));
            }
        }
        if self.resources.memory == Some(ConfigSize(0)) {
            return Err("resources.memory: must be greater than 0".into());
        }
        self.backend()?;
        self.images.validate()?;
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
        if self.hygiene.recheck_interval.get().is_zero() {
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
                    let memory = d.memory.bytes();
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
        if users.as_worker {
            if users.default.is_some() || !users.tenants.is_empty() {
                return Err(
                    "users.as-worker: jobs run as the worker's user; remove users.default and users.tenants".into()
                );
            }
            return Ok(UserMapping::WorkerUser);
        }
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
        c.coordinator_endpoints = self.coordinators.clone();
        c.heartbeat_interval = self.heartbeat_interval.get();
        c.kill_grace = self.kill_grace.get();
        if let Some(cpus) = self.resources.cpus {
            c.cpu_millis = (cpus * 1000.0).round() as u64;
        }
        if let Some(m) = self.resources.memory {
            c.memory_bytes = m.bytes();
        }
        c.labels = self.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        c.partitions = self.partitions.clone();
        c.rendezvous_ports = self.rendezvous_ports.as_deref().map(|r| port_range("rendezvous-ports", r)).transpose()?;
        c.lease_end = self.lease_end.as_deref().map(lease_end).transpose()?;
        c.users = self.user_mapping()?;
        c.health = HealthPolicy {
            max_temperature_c: (self.health.max_temperature_c > 0).then_some(self.health.max_temperature_c),
            fatal_xids: self.health.fatal_xids.iter().copied().collect(),
            max_ecc_uncorrected: u64::try_from(self.health.max_ecc_uncorrected).ok(),
            recover_after: self.health.recover_after.map(|d| d.get()),
        };
        c.hygiene = HygieneConfig {
            memory_tolerance_mib: self.hygiene.memory_tolerance.bytes() >> 20,
            settle_time: self.hygiene.settle_time.get(),
            recheck_interval: self.hygiene.recheck_interval.get(),
        };
        c.mps = MpsConfig { enabled: self.mps.enabled, control: self.mps.control.clone() };
        if self.executor.rdma {
            c.extra_devices = infiniband_devices();
        }
        c.open_files = self.executor.open_files;
        c.mig_manage = self.mig.manage;
        c.pids_max = Some(self.executor.pids_max);
        c.images = Some(self.images.settings(&self.data_dir)?);
        Ok(c)
    }

    /// The faults file of the simulated backend.
    pub fn faults_file(&self) -> PathBuf {
        self.gpu.faults_file.clone().unwrap_or_else(|| self.data_dir.join("faults.toml"))
    }

    /// The cgroup this worker puts its job cgroups under: `executor.cgroup-root`, then one level
    /// named after the data dir (the worker's identity on this host), so that two workers of
    /// one host never share it, even with the same `cgroup-root`. Everything a worker reaps at
    /// start and its fence guard kills lies under it: what a worker of this data dir started.
    /// The data dir is resolved (symlinks, relative paths) where it exists.
    pub fn job_cgroup_root(&self) -> String {
        let dir = self
            .data_dir
            .canonicalize()
            .or_else(|_| std::path::absolute(&self.data_dir))
            .unwrap_or_else(|_| self.data_dir.clone());
        format!("{}/{}", self.executor.cgroup_root.trim_end_matches('/'), identity_cgroup(&dir))
    }
}

/// The cgroup name of the worker whose data dir is `dir`: `w-` and a 64-bit FNV-1a hash of
/// the path, stable across restarts and versions.
pub fn identity_cgroup(dir: &Path) -> String {
    let hash = dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
    format!("w-{hash:016x}")
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
        assert_eq!(config.heartbeat_interval, std::time::Duration::from_millis(500));
        assert_eq!(config.hygiene, HygieneConfig::default());
        assert_eq!(config.health, HealthPolicy::default());
        // Without [users], jobs run as nobody, never as the (root) worker.
        assert_eq!(config.users.resolve("team-a"), Ok(Some(JobUser { uid: 65534, gid: 65534 })));
        assert_eq!(file.faults_file(), PathBuf::from("/var/lib/corral/faults.toml"));
        assert_eq!(config.rendezvous_ports, None, "the default range is the coordinators' to apply");
    }

    #[test]
    fn a_lease_end_is_a_utc_date_and_time() {
        let lease = |value: &str| {
            let file: WorkerFile = toml::from_str(&format!("lease-end = \"{value}\"\n{MINIMAL}")).expect("parse");
            file.validate().and_then(|()| file.worker_config()).map(|c| c.lease_end)
        };
        let end = lease("2026-12-31T18:00:00Z").expect("valid").expect("set");
        assert_eq!(end.physical_ms(), 1_798_740_000_000);
        let err = lease("tomorrow").unwrap_err();
        assert!(err.starts_with("lease-end: 'tomorrow'"), "{err}");
        let file: WorkerFile = toml::from_str(MINIMAL).expect("parse");
        assert_eq!(file.worker_config().expect("config").lease_end, None);
    }

    #[test]
    fn rendezvous_ports_are_a_range_or_one_port() {
        let ports = |value: &str| {
            let file: WorkerFile =
                toml::from_str(&format!("rendezvous-ports = \"{value}\"\n{MINIMAL}")).expect("parse");
            file.validate().and_then(|()| file.worker_config()).map(|c| c.rendezvous_ports)
        };
        assert_eq!(ports("29500-29599"), Ok(Some((29500, 29599))));
        assert_eq!(ports("40000"), Ok(Some((40000, 40000))));
        assert_eq!(ports(" 1 - 65535 "), Ok(Some((1, 65535))));
        assert!(ports("0-10").is_err_and(|e| e.starts_with("rendezvous-ports: '0-10'")));
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
            (format!("rendezvous-ports = \"29600-29500\"\n{MINIMAL}"), "rendezvous-ports: '29600-29500' ends before"),
            (format!("rendezvous-ports = \"29500-70000\"\n{MINIMAL}"), "rendezvous-ports: '29500-70000' is not a port"),
            (format!("rendezvous-ports = \"torch\"\n{MINIMAL}"), "rendezvous-ports: 'torch' is not a port range"),
            (format!("rendezvous-ports = 29500\n{MINIMAL}"), "rendezvous-ports"),
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
