//! The worker's settings as plain values: who jobs run as, limits, intervals, hygiene, health,
//! MPS and MIG policy; `file.rs` reads them from the worker's TOML file.

mod file;

pub use file::{
    Backend, ExecutorSection, GpuSection, HealthSection, HygieneSection, MigSection, MpsSection, ResourcesSection,
    SimulatedDeviceSection, UserSection, UsersSection, WorkerFile,
};

use crate::fence::GuardCommand;
use crate::health::HealthPolicy;
use crate::hygiene::HygieneConfig;
use crate::mps::MpsConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// A uid/gid pair a job runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobUser {
    pub uid: u32,
    pub gid: u32,
}

/// Which user a job runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserMapping {
    /// As the worker's own user (`corral dev`, a single-user playground).
    WorkerUser,
    /// As its tenant's user.
    Tenants {
        tenants: BTreeMap<String, JobUser>,
        /// For tenants without an entry; `None` refuses their jobs.
        default: Option<JobUser>,
        /// Whether uid 0 may be used at all.
        allow_root: bool,
    },
}

impl UserMapping {
    /// The uid/gid for `tenant`'s jobs; `None` keeps the worker's.
    pub fn resolve(&self, tenant: &str) -> Result<Option<JobUser>, String> {
        match self {
            UserMapping::WorkerUser => Ok(None),
            UserMapping::Tenants { tenants, default, allow_root } => {
                let user = tenants.get(tenant).or(default.as_ref()).copied().ok_or_else(|| {
                    format!("tenant '{tenant}' has no user on this worker: add it under [users.tenants] in the worker config, or set users.default")
                })?;
                if (user.uid == 0 || user.gid == 0) && !allow_root {
                    return Err(format!(
                        "tenant '{tenant}' maps to root, which this worker refuses: map it to another uid, or set users.allow-root = true"
                    ));
                }
                Ok(Some(user))
            }
        }
    }
}

/// Default `pids.max` of a job.
pub const DEFAULT_PIDS_MAX: u64 = 4096;

/// Plain worker settings (the binary builds them from TOML or flags).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub node_name: String,
    /// Job directories and logs live under `<data_dir>/jobs`.
    pub data_dir: PathBuf,
    /// Address the coordinator uses to reach this worker's agent (logs).
    pub advertise_addr: String,
    pub heartbeat_interval: Duration,
    /// Time between SIGTERM and SIGKILL when a job is cancelled.
    pub kill_grace: Duration,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub labels: Vec<(String, String)>,
    /// Partitions this node serves, registered as `partition=<name>` labels.
    pub partitions: Vec<String>,
    /// Rendezvous ports (inclusive) offered to gangs whose first part runs here; `None`: the
    /// default range (`corral_types::DEFAULT_RENDEZVOUS_PORTS`).
    pub rendezvous_ports: Option<(u32, u32)>,
    /// When the host's lease ends (`lease-end`), sent at registration; `None`: no lease.
    pub lease_end: Option<corral_types::Timestamp>,
    pub users: UserMapping,
    pub hygiene: HygieneConfig,
    pub health: HealthPolicy,
    pub mps: MpsConfig,
    /// Device nodes every container gets besides its GPUs (e.g. /dev/infiniband/*).
    pub extra_devices: Vec<PathBuf>,
    /// `RLIMIT_NOFILE` of every job; `None` inherits the worker's.
    pub open_files: Option<u64>,
    /// Create a MIG instance for a MIG job when no free one of its profile exists, and destroy
    /// it when the job ends. Off: jobs use the instances the operator laid out.
    pub mig_manage: bool,
    /// Most processes and threads of one job (`pids.max` of its cgroup): a fork bomb stops
    /// there instead of starving the node. `None`: unlimited.
    pub pids_max: Option<u64>,
    /// Serve the agent over TLS, to coordinator certificates only; `None`: plaintext.
    pub agent_tls: Option<corral_security::ServerTls>,
    /// Renew the certificate a join stored before it expires (`renew.rs`); `None`: the
    /// certificate is the operator's, or there is none.
    pub cert_renewal: Option<crate::renew::CertRenewal>,
    /// How to start the fence guard, the process that kills this worker's jobs when its lease
    /// runs out even if the worker is frozen or dead (see `fence`). `None`: no guard (jobs of a
    /// frozen worker keep running; only for tests that run the worker in-process).
    pub fence_guard: Option<GuardCommand>,
    /// The `[images]` table: jobs whose image is a registry reference are pulled into this
    /// store. `None`: this worker runs no registry images (rootfs directories still run).
    pub images: Option<corral_image::ImagesSettings>,
    /// The coordinators this worker talks to (`coordinators` of its file): a bare job's
    /// `CORRAL_ENDPOINT` unless it sets its own, so that `squeue`, `scancel` and `scontrol show
    /// job` inside it reach the cluster as Slurm's do. Empty: none given.
    pub coordinator_endpoints: Vec<String>,
}

impl WorkerConfig {
    /// Settings for `node_name` with this host's CPUs and memory.
    pub fn for_host(node_name: String, data_dir: PathBuf) -> Self {
        WorkerConfig {
            node_name,
            data_dir,
            advertise_addr: String::new(),
            heartbeat_interval: Duration::from_millis(500),
            kill_grace: Duration::from_secs(5),
            cpu_millis: host_cpu_millis(),
            memory_bytes: host_memory_bytes(),
            labels: Vec::new(),
            partitions: Vec::new(),
            rendezvous_ports: None,
            lease_end: None,
            users: UserMapping::WorkerUser,
            hygiene: HygieneConfig::default(),
            health: HealthPolicy::default(),
            mps: MpsConfig::default(),
            extra_devices: Vec::new(),
            open_files: None,
            mig_manage: false,
            pids_max: Some(DEFAULT_PIDS_MAX),
            agent_tls: None,
            cert_renewal: None,
            fence_guard: None,
            images: None,
            coordinator_endpoints: Vec::new(),
        }
    }

    /// Where each run's work dir and logs live: `<jobs_dir>/<job id>/<epoch>/`.
    pub fn jobs_dir(&self) -> PathBuf {
        self.data_dir.join("jobs")
    }

    /// Directory of Slurm's in-job commands (links to the corral binary), first on every bare
    /// job's `PATH`.
    pub fn in_job_bin_dir(&self) -> PathBuf {
        self.data_dir.join("slurm-bin")
    }

    /// Slurm's in-job commands for image jobs (`in_job_bin.rs`), bound into their containers.
    pub fn in_image_dir(&self) -> PathBuf {
        self.data_dir.join("slurm-bin-image")
    }

    /// Unix socket of the in-job service (`srun` inside a job reaches its node's worker there).
    pub fn in_job_socket(&self) -> PathBuf {
        self.data_dir.join("in-job.sock")
    }

    /// File where GPU leaks are recorded, one JSON object per line.
    pub fn leak_record_file(&self) -> PathBuf {
        self.data_dir.join("gpu-leaks.jsonl")
    }
}

/// The InfiniBand device nodes of this host (`/dev/infiniband/*`), for RDMA jobs.
pub fn infiniband_devices() -> Vec<PathBuf> {
    let mut nodes: Vec<PathBuf> = std::fs::read_dir("/dev/infiniband")
        .map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    nodes.sort();
    nodes
}

fn host_cpu_millis() -> u64 {
    std::thread::available_parallelism().map(|n| n.get() as u64 * 1000).unwrap_or(1000)
}

fn host_memory_bytes() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}
