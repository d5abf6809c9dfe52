//! The worker daemon loop: register, heartbeat, launch what the coordinator assigns, kill what
//! it revokes, and report starts and exits.
//!
//! Invariant: an allocation epoch is launched at most once per worker process; exit reports are
//! retried until the coordinator acknowledges them (it ignores stale epochs, so retries are safe).

use crate::executor::{Executor, JobHandle, LaunchSpec, ResourceLimits};
use crate::gpu::{DeviceInfo, GpuBackend, GpuReading, MigPlacement, MigState};
use crate::health::{HealthPolicy, HealthTracker};
use crate::hygiene::{Hygiene, HygieneConfig};
use crate::mps::{Mps, MpsConfig};
use corral_client::GatewayClient;
use corral_proto::v1::{self as pb};
use corral_types::{GpuSlice, Job, JobExitReport, NodeSpec, SliceAssignment};
use nix::sys::signal::Signal;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::Notify;

/// Interval between two hygiene checks while a device settles after a job.
const SETTLE_POLL: Duration = Duration::from_millis(250);

/// GPU control nodes a container with GPUs needs besides `/dev/nvidia<minor>`.
const NVIDIA_CONTROL_NODES: [&str; 4] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"];

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
            users: UserMapping::WorkerUser,
            hygiene: HygieneConfig::default(),
            health: HealthPolicy::default(),
            mps: MpsConfig::default(),
            extra_devices: Vec::new(),
            open_files: None,
            mig_manage: false,
            pids_max: Some(DEFAULT_PIDS_MAX),
            agent_tls: None,
        }
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

/// A job this worker process launched.
struct LocalJob {
    epoch: u64,
    gpus: Vec<u32>,
    /// The MIG device the job runs on, if any, until it is free for another job (at the exit, or
    /// once destroyed if it was made for this job).
    mig_uuid: Option<String>,
    handle: Option<JobHandle>,
    /// Tenant the job runs for (metrics).
    tenant: String,
    /// The process tree is gone; the exit report may still be in flight.
    exited: bool,
    /// A stop order is being carried out (signals sent, SIGKILL scheduled).
    stopping: bool,
}

/// State shared by the daemon loop, job tasks and the agent service.
pub(crate) struct WorkerShared {
    config: WorkerConfig,
    gateway: GatewayClient,
    executor: Arc<dyn Executor>,
    gpus: Arc<dyn GpuBackend>,
    jobs: Mutex<BTreeMap<u64, LocalJob>>,
    /// Allocation epochs already launched by this process: never launched twice.
    launched: Mutex<BTreeSet<u64>>,
    node_epoch: AtomicU64,
    wake: Notify,
    hygiene: Hygiene,
    health: Mutex<HealthTracker>,
    mps: Mps,
    /// Static device facts, read at start; the MIG layout is re-read when it changes.
    info: Mutex<Vec<DeviceInfo>>,
    /// Number of heartbeats started; each one's id is the count after its start.
    heartbeats_started: AtomicU64,
    /// Highest id of a heartbeat the coordinator accepted, and a signal at each.
    heartbeat_accepted: AtomicU64,
    heartbeat_sent: Notify,
    /// The GPU reading of the last heartbeat (metrics show it).
    last_readings: Mutex<Vec<GpuReading>>,
    /// When the coordinator last accepted a heartbeat.
    last_heartbeat_ok: Mutex<Option<Instant>>,
    started: Instant,
}

/// The MIG device picked for a job.
struct MigPick {
    uuid: String,
    /// Made for this job (destroyed after it), not one the operator laid out.
    created: bool,
}

impl WorkerShared {
    /// Re-reads the device facts after the MIG layout changed.
    fn refresh_info(&self) {
        let info = self.gpus.info();
        *self.info.lock().unwrap_or_else(|p| p.into_inner()) = info;
    }

    /// Destroys a MIG device this worker created; a failure (e.g. a process still holds it) is
    /// logged and the instance stays, free for the next job of its profile.
    fn destroy_mig_instance(&self, gpu: u32, uuid: String) {
        if let Err(e) = self.gpus.destroy_mig_instance(gpu, &uuid) {
            tracing::warn!(gpu, uuid, error = %e, "cannot destroy the job's MIG instance; it stays for reuse");
        }
        self.refresh_info();
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, LocalJob>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn jobs_dir(&self) -> PathBuf {
        self.config.data_dir.join("jobs")
    }

    /// True while the job's process tree runs here.
    pub(crate) fn is_running(&self, job_id: u64) -> bool {
        self.jobs().get(&job_id).is_some_and(|j| !j.exited)
    }

    /// GPU indices of jobs whose processes still run.
    fn allocated_gpus(&self) -> Vec<u32> {
        self.jobs().values().filter(|j| !j.exited).flat_map(|j| j.gpus.clone()).collect()
    }

    /// What a metrics scrape exports now: the last heartbeat's GPU reading with hygiene and
    /// health, and the cgroup usage of every running job.
    pub(crate) fn metrics_snapshot(&self) -> crate::metrics::Snapshot {
        let info = self.info.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let readings = self.last_readings.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let gpus = {
            let health = self.health.lock().unwrap_or_else(|p| p.into_inner());
            readings
                .into_iter()
                .map(|reading| {
                    let device = info.iter().find(|d| d.device.index == reading.index);
                    crate::metrics::GpuSample {
                        uuid: device.map(|d| d.device.uuid.clone()).unwrap_or_default(),
                        device: format!("nvidia{}", device.and_then(|d| d.minor).unwrap_or(reading.index)),
                        model: device.map(|d| d.device.model.clone()).unwrap_or_default(),
                        total_mib: device.map_or(0, |d| d.device.memory_mib),
                        dirty: self.hygiene.is_dirty(reading.index),
                        healthy: health.is_healthy(reading.index),
                        reading,
                    }
                })
                .collect()
        };
        let running: Vec<(u64, String, JobHandle)> = self
            .jobs()
            .iter()
            .filter(|(_, j)| !j.exited)
            .filter_map(|(id, j)| j.handle.clone().map(|h| (*id, j.tenant.clone(), h)))
            .collect();
        let jobs = running
            .into_iter()
            .map(|(job_id, tenant, handle)| crate::metrics::JobSample { job_id, tenant, usage: handle.usage() })
            .collect();
        let last_ok = *self.last_heartbeat_ok.lock().unwrap_or_else(|p| p.into_inner());
        crate::metrics::Snapshot {
            hostname: self.config.node_name.clone(),
            gpus,
            heartbeat_age_secs: last_ok.unwrap_or(self.started).elapsed().as_secs_f64(),
            jobs,
        }
    }

    /// Reads every GPU off the async executor (driver calls block).
    async fn read_gpus(&self) -> Vec<GpuReading> {
        let gpus = Arc::clone(&self.gpus);
        let allocated = self.allocated_gpus();
        tokio::task::spawn_blocking(move || gpus.read(&allocated)).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "gpu reading task failed");
            Vec::new()
        })
    }

    /// After a job: waits (bounded by the settle time) until its GPUs are clean, else marks
    /// them dirty and attributes them to the job. GPUs another running job shares (MPS) are
    /// skipped: their memory is not the finished job's. Returns whether any became dirty.
    async fn check_hygiene(&self, job_id: u64, epoch: u64, gpus: &[u32]) -> bool {
        let shared_with_others = self.allocated_gpus();
        let gpus: Vec<u32> = gpus.iter().copied().filter(|g| !shared_with_others.contains(g)).collect();
        if gpus.is_empty() {
            return false;
        }
        let deadline = Instant::now() + self.hygiene.config().settle_time;
        loop {
            let readings = self.read_gpus().await;
            let findings = self.hygiene.inspect(&readings, &gpus);
            if findings.is_empty() {
                self.hygiene.note_clean(&readings, &gpus);
                return false;
            }
            if Instant::now() >= deadline {
                self.hygiene.mark_dirty(job_id, epoch, findings);
                return true;
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }

    /// Triggers a heartbeat and waits (bounded) until one that started after this call was
    /// accepted, so the coordinator knows about a dirty GPU before it learns the job ended.
    async fn heartbeat_now(&self) {
        let started_before = self.heartbeats_started.load(Ordering::SeqCst);
        let limit = self.config.heartbeat_interval * 3 + Duration::from_secs(1);
        let waited = tokio::time::timeout(limit, async {
            while self.heartbeat_accepted.load(Ordering::SeqCst) <= started_before {
                let sent = self.heartbeat_sent.notified();
                self.wake.notify_one();
                if self.heartbeat_accepted.load(Ordering::SeqCst) > started_before {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(100), sent).await;
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!("no heartbeat got through in time; reporting the job anyway");
        }
    }
}

/// A worker daemon.
pub struct Worker {
    shared: Arc<WorkerShared>,
}

impl Worker {
    pub fn new(
        config: WorkerConfig,
        gateway: GatewayClient,
        executor: Arc<dyn Executor>,
        gpus: Arc<dyn GpuBackend>,
    ) -> Self {
        let hygiene = Hygiene::new(config.hygiene.clone(), Some(config.leak_record_file()));
        let health = Mutex::new(HealthTracker::new(config.health.clone()));
        let mps = Mps::new(&config.mps, config.data_dir.join("mps"));
        Worker {
            shared: Arc::new(WorkerShared {
                config,
                gateway,
                executor,
                gpus,
                jobs: Mutex::new(BTreeMap::new()),
                launched: Mutex::new(BTreeSet::new()),
                node_epoch: AtomicU64::new(0),
                wake: Notify::new(),
                hygiene,
                health,
                mps,
                info: Mutex::new(Vec::new()),
                heartbeats_started: AtomicU64::new(0),
                heartbeat_accepted: AtomicU64::new(0),
                heartbeat_sent: Notify::new(),
                last_readings: Mutex::new(Vec::new()),
                last_heartbeat_ok: Mutex::new(None),
                started: Instant::now(),
            }),
        }
    }

    /// The worker's metrics, to serve while it runs.
    pub fn metrics(&self) -> crate::WorkerMetrics {
        crate::metrics::WorkerMetrics { shared: Arc::clone(&self.shared) }
    }

    fn node_spec(&self) -> NodeSpec {
        let c = &self.shared.config;
        let mut labels = c.labels.clone();
        labels.extend(c.partitions.iter().map(|p| ("partition".to_owned(), p.clone())));
        NodeSpec {
            name: c.node_name.clone(),
            address: c.advertise_addr.clone(),
            gpus: self.shared.gpus.devices(),
            cpu_millis: c.cpu_millis,
            memory_bytes: c.memory_bytes,
            labels,
        }
    }

    /// Reads the devices once before any job runs: static facts, idle baselines, health.
    async fn inspect_gpus(&self) {
        let gpus = Arc::clone(&self.shared.gpus);
        let (info, readings) =
            tokio::task::spawn_blocking(move || (gpus.info(), gpus.read(&[]))).await.unwrap_or_else(|e| {
                tracing::warn!(error = %e, "gpu inventory task failed");
                (Vec::new(), Vec::new())
            });
        for device in &info {
            tracing::info!(
                gpu = device.device.index,
                uuid = %device.device.uuid,
                model = %device.device.model,
                memory_mib = device.device.memory_mib,
                pci = ?device.pci_bus_id,
                numa = ?device.numa_node,
                mig = ?device.mig,
                "gpu"
            );
        }
        *self.shared.info.lock().unwrap_or_else(|p| p.into_inner()) = info;
        self.shared.hygiene.start(&readings);
        self.shared.health.lock().unwrap_or_else(|p| p.into_inner()).update(&readings);
        *self.shared.last_readings.lock().unwrap_or_else(|p| p.into_inner()) = readings;
    }

    /// Serves the agent on `agent_listener`, registers, and runs the heartbeat loop until
    /// `shutdown`; then kills every job it runs.
    pub async fn run(
        self,
        agent_listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        std::fs::create_dir_all(self.shared.jobs_dir())?;
        // Jobs of an earlier worker process are stale: the coordinator requeues them when we register.
        for cgroup in self.shared.executor.reap_leftovers()? {
            tracing::warn!(cgroup = %cgroup, "killed a job left running by an earlier worker process");
        }
        self.inspect_gpus().await;
        let audit = Arc::new(corral_security::AuditLog::in_dir(&self.shared.config.data_dir));
        let refusals = audit.clone();
        let on_refused = Arc::new(move |r: corral_security::Refusal| {
            refusals.record(corral_security::AuditEvent::denied("tls-handshake", r.addr.to_string(), "-", r.reason));
        });
        let tls = self.shared.config.agent_tls.clone();
        let guard = crate::agent::RoleGuard { tls: tls.is_some(), audit };
        let incoming = corral_security::incoming(agent_listener, tls, on_refused);
        let agent = tonic::transport::Server::builder()
            .add_service(tonic::service::interceptor::InterceptedService::new(
                crate::agent::server(self.shared.clone()),
                move |request| guard.check(request),
            ))
            .serve_with_incoming(incoming);
        let agent = tokio::spawn(agent);
        tokio::pin!(shutdown);
        tokio::select! {
            _ = &mut shutdown => {}
            _ = self.main_loop() => {}
        }
        agent.abort();
        self.kill_all("worker shutting down");
        let shared = Arc::clone(&self.shared);
        let _ = tokio::task::spawn_blocking(move || shared.mps.shutdown()).await;
        Ok(())
    }

    async fn register(&self) {
        let spec = self.node_spec();
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.shared.gateway.register(pb::RegisterRequest { spec: Some((&spec).into()) }).await {
                Ok(reply) => {
                    self.shared.node_epoch.store(reply.node_epoch, Ordering::SeqCst);
                    tracing::info!(node = %spec.name, epoch = reply.node_epoch, gpus = spec.gpus.len(),
                        backend = self.shared.gpus.name(), "registered with the coordinator");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "registration failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn main_loop(&self) {
        self.register().await;
        loop {
            if let Err(e) = self.heartbeat_once().await {
                tracing::warn!(error = %e, "heartbeat failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(self.shared.config.heartbeat_interval) => {}
                _ = self.shared.wake.notified() => {}
            }
        }
    }

    async fn heartbeat_once(&self) -> Result<(), corral_client::ClientError> {
        let shared = &self.shared;
        let id = shared.heartbeats_started.fetch_add(1, Ordering::SeqCst) + 1;
        let readings = shared.read_gpus().await;
        let running: Vec<pb::RunningJob> = shared
            .jobs()
            .iter()
            .filter(|(_, j)| !j.exited)
            .map(|(id, j)| pb::RunningJob { job_id: *id, epoch: j.epoch, ..Default::default() })
            .collect();
        if shared.hygiene.recheck_due() {
            shared.hygiene.recheck(&readings);
        }
        let gpus = {
            let leaks = shared.hygiene.leaks();
            let mut health = shared.health.lock().unwrap_or_else(|p| p.into_inner());
            health.update(&readings);
            readings
                .iter()
                .map(|r| {
                    let h = r.to_health(shared.hygiene.is_dirty(r.index));
                    let leak = leaks.iter().find(|l| l.finding.gpu == r.index);
                    pb::GpuHealth {
                        index: h.index,
                        temperature_c: h.temperature_c,
                        utilization_percent: h.utilization_percent,
                        memory_used_mib: h.memory_used_mib,
                        power_mw: h.power_mw,
                        xid_errors: h.xid_errors,
                        dirty: h.dirty,
                        problems: health.problems(r.index).to_vec(),
                        dirty_reason: leak.map(|l| l.finding.reason.clone()).unwrap_or_default(),
                        dirty_job_id: leak.and_then(|l| l.job_id).unwrap_or(0),
                    }
                })
                .collect()
        };
        *shared.last_readings.lock().unwrap_or_else(|p| p.into_inner()) = readings;
        let request = pb::HeartbeatRequest {
            node: shared.config.node_name.clone(),
            node_epoch: shared.node_epoch.load(Ordering::SeqCst),
            gpus,
            running,
        };
        let reply = shared.gateway.heartbeat(request).await?;
        *shared.last_heartbeat_ok.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        shared.heartbeat_accepted.fetch_max(id, Ordering::SeqCst);
        shared.heartbeat_sent.notify_waiters();
        if reply.reregister {
            tracing::warn!("coordinator does not know this node's epoch: killing local jobs and registering again");
            self.kill_all("node fenced by the coordinator");
            self.register().await;
            return Ok(());
        }
        for kill in reply.kill {
            let grace = (kill.grace_secs > 0).then(|| Duration::from_secs(u64::from(kill.grace_secs)));
            self.stop_job(kill.job_id, kill.epoch, grace, kill.checkpoint_signal);
        }
        for job in reply.assignments {
            match Job::try_from(job) {
                Ok(job) => self.maybe_launch(job),
                Err(e) => tracing::warn!(error = %e, "malformed assignment"),
            }
        }
        Ok(())
    }

    /// Stops one job: SIGTERM to its tree, SIGKILL after the grace period.
    /// Stops one job: the checkpoint signal first if any (SIGTERM then follows half-way through
    /// the grace period), else SIGTERM at once; SIGKILL to the whole tree when the grace period
    /// (the worker's `kill-grace` unless the order names one) is over.
    fn stop_job(&self, job_id: u64, epoch: u64, grace: Option<Duration>, checkpoint_signal: Option<i32>) {
        let handle = {
            let jobs = self.shared.jobs();
            match jobs.get(&job_id) {
                Some(j) if j.epoch == epoch && !j.exited && !j.stopping => j.handle.clone(),
                _ => None,
            }
        };
        let Some(handle) = handle else { return };
        if let Some(j) = self.shared.jobs().get_mut(&job_id) {
            j.stopping = true;
        }
        let grace = grace.unwrap_or(self.shared.config.kill_grace);
        let checkpoint = checkpoint_signal.and_then(|s| Signal::try_from(s).ok());
        tracing::info!(job_id, epoch, grace_secs = grace.as_secs(), checkpoint = ?checkpoint, "stopping job");
        let first = checkpoint.unwrap_or(Signal::SIGTERM);
        if let Err(e) = handle.signal_tree(first) {
            tracing::warn!(job_id, error = %e, "signal failed");
        }
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let running =
                |shared: &WorkerShared| shared.jobs().get(&job_id).is_some_and(|j| j.epoch == epoch && !j.exited);
            if checkpoint.is_some() {
                tokio::time::sleep(grace / 2).await;
                if running(&shared) {
                    if let Err(e) = handle.signal_tree(Signal::SIGTERM) {
                        tracing::warn!(job_id, error = %e, "SIGTERM failed");
                    }
                }
                tokio::time::sleep(grace - grace / 2).await;
            } else {
                tokio::time::sleep(grace).await;
            }
            if running(&shared) {
                if let Err(e) = handle.kill_tree() {
                    tracing::warn!(job_id, error = %e, "kill failed");
                }
            }
        });
    }

    fn kill_all(&self, why: &str) {
        let handles: Vec<(u64, JobHandle)> = self
            .shared
            .jobs()
            .iter()
            .filter(|(_, j)| !j.exited)
            .filter_map(|(id, j)| j.handle.clone().map(|h| (*id, h)))
            .collect();
        for (job_id, handle) in handles {
            tracing::info!(job_id, reason = why, "killing job");
            if let Err(e) = handle.kill_tree() {
                tracing::warn!(job_id, error = %e, "kill failed");
            }
        }
    }

    fn maybe_launch(&self, job: Job) {
        let Some(allocation) = job.allocation.clone() else { return };
        // A gang job across nodes runs one part here, on this node's GPUs.
        let Some(local_gpus) = allocation.gpus_on(&self.shared.config.node_name).map(<[u32]>::to_vec) else {
            return;
        };
        {
            let mut launched = self.shared.launched.lock().unwrap_or_else(|p| p.into_inner());
            if self.shared.jobs().contains_key(&job.id) || !launched.insert(allocation.epoch) {
                return;
            }
        }
        let (job_id, epoch) = (job.id, allocation.epoch);
        let time_limit = job.spec.time_limit_secs.map(Duration::from_secs);
        let (mig_uuid, mig_created) = match self.pick_mig_instance(&job, &local_gpus) {
            Ok(Some(MigPick { uuid, created })) => (Some(uuid), created),
            Ok(None) => (None, false),
            Err(e) => return self.launch_failed(job_id, epoch, e),
        };
        let launched = self
            .launch_spec(&job, epoch, &local_gpus, mig_uuid.as_deref())
            .and_then(|spec| self.shared.executor.launch(&spec).map_err(|e| e.to_string()));
        let mut running = match launched {
            Ok(running) => running,
            Err(e) => {
                if let (Some(uuid), true, Some(&gpu)) = (&mig_uuid, mig_created, local_gpus.first()) {
                    self.shared.destroy_mig_instance(gpu, uuid.clone());
                }
                return self.launch_failed(job_id, epoch, e);
            }
        };
        let shared = self.shared.clone();
        tracing::info!(job_id, epoch, pid = running.pid(), gpus = ?local_gpus, image = ?job.spec.image, "job started");
        let handle = running.handle();
        let gpus = local_gpus.clone();
        shared.jobs().insert(
            job_id,
            LocalJob {
                epoch,
                tenant: job.spec.tenant.clone(),
                gpus: gpus.clone(),
                mig_uuid: mig_uuid.clone(),
                handle: Some(handle.clone()),
                exited: false,
                stopping: false,
            },
        );
        tokio::spawn(async move {
            report_started(&shared, job_id, epoch).await;
            let mut timed_out = false;
            let exit = {
                let wait = running.wait();
                tokio::pin!(wait);
                let limit = async {
                    match time_limit {
                        Some(t) => tokio::time::sleep(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    exit = &mut wait => exit,
                    _ = limit => {
                        tracing::info!(job_id, "time limit reached: killing job");
                        timed_out = true;
                        if let Err(e) = handle.kill_tree() {
                            tracing::warn!(job_id, error = %e, "kill failed");
                        }
                        wait.await
                    }
                }
            };
            tracing::info!(job_id, epoch, code = ?exit.exit_code, signal = ?exit.signal, oom = exit.oom_killed, "job exited");
            if let Some(j) = shared.jobs().get_mut(&job_id) {
                j.exited = true;
                // An instance the operator laid out is free again; one made for this job stays
                // taken until it is destroyed below, so no other job starts on it meanwhile.
                if !mig_created {
                    j.mig_uuid = None;
                }
            }
            // The job's cgroup is empty now (wait drained it): its GPUs must be clean too.
            if shared.check_hygiene(job_id, epoch, &gpus).await {
                shared.heartbeat_now().await;
            }
            if let (Some(uuid), true, Some(&gpu)) = (mig_uuid, mig_created, gpus.first()) {
                let cleanup = Arc::clone(&shared);
                let _ = tokio::task::spawn_blocking(move || cleanup.destroy_mig_instance(gpu, uuid)).await;
                if let Some(j) = shared.jobs().get_mut(&job_id) {
                    j.mig_uuid = None;
                }
            }
            let report = JobExitReport {
                exit_code: exit.exit_code,
                signal: exit.signal,
                oom_killed: exit.oom_killed,
                run_time_ms: exit.run_time.as_millis() as u64,
                timed_out,
                launch_error: None,
            };
            report_finished(&shared, job_id, epoch, report).await;
        });
    }

    fn launch_failed(&self, job_id: u64, epoch: u64, error: String) {
        tracing::warn!(job_id, epoch, error = %error, "launch failed");
        let report = JobExitReport { launch_error: Some(error), ..Default::default() };
        let shared = self.shared.clone();
        shared.jobs().insert(
            job_id,
            LocalJob {
                epoch,
                tenant: String::new(),
                gpus: Vec::new(),
                mig_uuid: None,
                handle: None,
                exited: true,
                stopping: false,
            },
        );
        tokio::spawn(async move { report_finished(&shared, job_id, epoch, report).await });
    }

    /// For a MIG slice on a partitioned GPU: a free existing instance of the profile, else (with
    /// `mig_manage`) a new one at the scheduler's placement. Creating one is a driver call of
    /// well under a second, made inline.
    fn pick_mig_instance(&self, job: &Job, gpus: &[u32]) -> Result<Option<MigPick>, String> {
        let Some(GpuSlice::Mig { profile, .. }) = &job.spec.gpu_slice else { return Ok(None) };
        let Some(&gpu) = gpus.first() else { return Ok(None) };
        let layout = {
            let info = self.shared.info.lock().unwrap_or_else(|p| p.into_inner());
            info.iter().find(|d| d.device.index == gpu).map(|d| d.mig.clone())
        };
        let instances = match layout {
            Some(MigState::Enabled { instances }) => instances,
            Some(MigState::Disabled) if self.shared.config.mig_manage => {
                return Err(format!(
                    "MIG mode is off on gpu {gpu}: enable it with `nvidia-smi -i {gpu} -mig 1` (this resets the GPU, which corral never does by itself)"
                ))
            }
            // Simulated without MIG, or MIG off: nothing to pick; the job sees the whole device.
            _ => return Ok(None),
        };
        // Held by a running job, or made for a job that ended and not destroyed yet.
        let used: Vec<String> = self.shared.jobs().values().filter_map(|j| j.mig_uuid.clone()).collect();
        if let Some(free) =
            instances.iter().find(|i| i.profile.as_deref() == Some(profile.as_str()) && !used.contains(&i.uuid))
        {
            return Ok(Some(MigPick { uuid: free.uuid.clone(), created: false }));
        }
        if !self.shared.config.mig_manage {
            return Err(format!(
                "no free MIG instance of profile {profile} on gpu {gpu}: create one (nvidia-smi mig -cgi {profile} -C), free one, or set mig.manage = true in the worker config"
            ));
        }
        let placement = match job.allocation.as_ref().and_then(|a| a.slice.as_ref()) {
            Some(SliceAssignment::Mig { start, memory_slices, .. }) => {
                Some(MigPlacement { start: *start, size: *memory_slices })
            }
            _ => None,
        };
        let created = self.shared.gpus.create_mig_instance(gpu, profile, placement).map_err(|e| e.to_string())?;
        self.shared.refresh_info();
        Ok(Some(MigPick { uuid: created.uuid, created: true }))
    }

    fn launch_spec(&self, job: &Job, epoch: u64, gpus: &[u32], mig_uuid: Option<&str>) -> Result<LaunchSpec, String> {
        let config = &self.shared.config;
        let user = config.users.resolve(&job.spec.tenant)?;
        let info = self.shared.info.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let devices: Vec<&DeviceInfo> =
            gpus.iter().filter_map(|i| info.iter().find(|d| d.device.index == *i)).collect();
        let uuids: Vec<String> = devices.iter().map(|d| d.device.uuid.clone()).collect();
        let in_container = job.spec.image.is_some();
        let mut env = job.spec.env.clone();
        let ids: Vec<String> = match (mig_uuid, in_container) {
            (Some(mig), _) => vec![mig.to_owned()],
            // A container only has its own GPUs' nodes: CUDA numbers them from 0.
            (None, true) => (0..gpus.len()).map(|i| i.to_string()).collect(),
            (None, false) => gpus.iter().map(u32::to_string).collect(),
        };
        env.insert("CUDA_VISIBLE_DEVICES".into(), ids.join(","));
        // NVML and CUDA agree on indices only in PCI order.
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), if uuids.is_empty() { "void".into() } else { uuids.join(",") });
        let mut binds = Vec::new();
        // The share the scheduler assigned (it fills in a memory cap the user left open), else
        // the one the job asked for.
        let mps = match job.allocation.as_ref().and_then(|a| a.slice.as_ref()) {
            Some(SliceAssignment::Mps { thread_percent, memory_mib }) => Some((*thread_percent, Some(*memory_mib))),
            _ => match &job.spec.gpu_slice {
                Some(GpuSlice::Mps { thread_percent, memory_mib }) => Some((*thread_percent, *memory_mib)),
                _ => None,
            },
        };
        if let Some((thread_percent, memory_mib)) = mps {
            env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), thread_percent.to_string());
            if let Some(m) = memory_mib.filter(|m| *m > 0) {
                env.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("0={m}M"));
            }
            if let (Some(&gpu), Some(uuid)) = (gpus.first(), uuids.first()) {
                if let Some(attachment) = self.shared.mps.attach(gpu, uuid)? {
                    env.extend(attachment.env);
                    binds.extend(attachment.binds);
                }
            }
        }
        env.insert("CORRAL_JOB_ID".into(), job.id.to_string());
        env.insert("CORRAL_NODE".into(), config.node_name.clone());
        env.insert("CORRAL_TENANT".into(), job.spec.tenant.clone());
        let mut device_nodes: Vec<PathBuf> = Vec::new();
        if in_container && !devices.is_empty() {
            device_nodes
                .extend(devices.iter().filter_map(|d| d.minor).map(|m| PathBuf::from(format!("/dev/nvidia{m}"))));
            device_nodes.extend(NVIDIA_CONTROL_NODES.iter().map(PathBuf::from));
            device_nodes.retain(|p| p.exists());
        }
        if in_container {
            device_nodes.extend(config.extra_devices.iter().cloned());
        }
        Ok(LaunchSpec {
            job_id: job.id,
            attempt: epoch,
            argv: job.spec.command.clone(),
            env,
            work_dir: self.shared.jobs_dir().join(job.id.to_string()).join(epoch.to_string()),
            limits: ResourceLimits {
                memory_bytes: (job.spec.memory_bytes > 0).then_some(job.spec.memory_bytes),
                cpu_millis: (job.spec.cpu_millis > 0).then_some(job.spec.cpu_millis),
                pids_max: config.pids_max,
                open_files: config.open_files,
            },
            uid: user.map(|u| u.uid),
            gid: user.map(|u| u.gid),
            image: job.spec.image.as_ref().map(PathBuf::from),
            devices: device_nodes,
            cdi_devices: uuids.iter().map(|u| format!("nvidia.com/gpu={u}")).collect(),
            binds,
        })
    }
}

async fn report_started(shared: &WorkerShared, job_id: u64, epoch: u64) {
    let req = pb::ReportStartedRequest { node: shared.config.node_name.clone(), job_id, epoch };
    if let Err(e) = shared.gateway.report_started(req).await {
        // Not fatal: the exit report also records a start time.
        tracing::warn!(job_id, error = %e, "could not report job start");
    }
}

/// Reports an exit until the coordinator acknowledges it, then forgets the job.
async fn report_finished(shared: &WorkerShared, job_id: u64, epoch: u64, report: JobExitReport) {
    let req = pb::ReportFinishedRequest {
        node: shared.config.node_name.clone(),
        job_id,
        epoch,
        report: Some((&report).into()),
    };
    let mut backoff = Duration::from_millis(200);
    loop {
        match shared.gateway.report_finished(req.clone()).await {
            Ok(accepted) => {
                if !accepted {
                    tracing::info!(job_id, epoch, "exit report was for a stale placement: ignored");
                }
                break;
            }
            Err(e) => {
                tracing::warn!(job_id, error = %e, "could not report job exit; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    let mut jobs = shared.jobs();
    if jobs.get(&job_id).is_some_and(|j| j.epoch == epoch) {
        jobs.remove(&job_id);
    }
    drop(jobs);
    shared.wake.notify_one();
}
