//! The worker daemon: `Worker::run` serves the log agent and runs the runtime (`runtime.rs`),
//! which registers, follows the leader's desired state and reports. `WorkerShared` holds what
//! the runtime's tasks, the agent and the metrics read: devices, GPU hygiene and health, and the
//! job processes that run.

use crate::config::WorkerConfig;
use crate::executor::{Executor, JobHandle};
use crate::gpu::{DeviceInfo, GpuBackend, GpuReading};
use crate::health::HealthTracker;
use crate::hygiene::Hygiene;
use crate::mps::Mps;
use corral_client::GatewayClient;
use corral_types::{JobId, NodeSpec};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::Notify;

/// Interval between two hygiene checks while a device settles after a job.
const SETTLE_POLL: Duration = Duration::from_millis(250);

/// A job process of this worker as the agent, the metrics and GPU hygiene see it.
#[derive(Clone)]
pub(crate) struct RunningView {
    pub epoch: u64,
    pub tenant: String,
    pub gpus: Vec<u32>,
    pub handle: JobHandle,
    /// The MIG device it holds: until its exit, or until destroyed if made for it.
    pub mig_uuid: Option<String>,
    /// The process tree is gone (GPU hygiene and clean-up may still run).
    pub exited: bool,
}

/// State shared by the runtime's tasks, the agent service and the metrics.
pub(crate) struct WorkerShared {
    config: WorkerConfig,
    pub(crate) gateway: GatewayClient,
    pub(crate) executor: Arc<dyn Executor>,
    gpus: Arc<dyn GpuBackend>,
    running: Mutex<BTreeMap<JobId, RunningView>>,
    /// Jobs whose launch is under way: their log directory may exist before their process.
    launching: Mutex<BTreeSet<JobId>>,
    /// Epoch of the current registration; 0 while (re-)registering.
    pub(crate) node_epoch: AtomicU64,
    /// Highest Raft term a leader answered a heartbeat in.
    pub(crate) leader_term: AtomicU64,
    /// Wakes the heartbeat task early.
    pub(crate) wake_heartbeat: Notify,
    /// Tells the desired-state stream to check its registration and term.
    pub(crate) watch_reset: Notify,
    pub(crate) hygiene: Hygiene,
    pub(crate) health: Mutex<HealthTracker>,
    mps: Mps,
    /// Static device facts, read at start; the MIG layout is re-read when it changes.
    info: Mutex<Vec<DeviceInfo>>,
    /// Number of heartbeats started; each one's id is the count after its start.
    pub(crate) heartbeats_started: AtomicU64,
    /// Highest id of a heartbeat a leader answered, and a signal at each.
    pub(crate) heartbeat_accepted: AtomicU64,
    pub(crate) heartbeat_sent: Notify,
    /// The GPU reading of the last heartbeat (metrics show it).
    pub(crate) last_readings: Mutex<Vec<GpuReading>>,
    /// When a leader last answered a heartbeat.
    pub(crate) last_heartbeat_ok: Mutex<Option<Instant>>,
    /// Registered and leased by a leader: what the health service reports.
    pub(crate) serving: tokio::sync::watch::Sender<bool>,
    started: Instant,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl WorkerShared {
    pub(crate) fn config(&self) -> &WorkerConfig {
        &self.config
    }

    pub(crate) fn gpus(&self) -> &dyn GpuBackend {
        self.gpus.as_ref()
    }

    pub(crate) fn mps(&self) -> &Mps {
        &self.mps
    }

    pub(crate) fn device_info(&self) -> Vec<DeviceInfo> {
        lock(&self.info).clone()
    }

    /// Re-reads the device facts after the MIG layout changed.
    pub(crate) fn refresh_info(&self) {
        let info = self.gpus.info();
        *lock(&self.info) = info;
    }

    /// Destroys a MIG device this worker created; a failure (e.g. a process still holds it) is
    /// logged and the instance stays, free for the next job of its profile. Blocking.
    pub(crate) fn destroy_mig_instance(&self, gpu: u32, uuid: String) {
        if let Err(e) = self.gpus.destroy_mig_instance(gpu, &uuid) {
            tracing::warn!(gpu, uuid, error = %e, "cannot destroy the job's MIG instance; it stays for reuse");
        }
        self.refresh_info();
    }

    pub(crate) fn jobs_dir(&self) -> PathBuf {
        self.config.data_dir.join("jobs")
    }

    /// True while the job's process tree runs here or is being launched.
    pub(crate) fn is_running(&self, job_id: u64) -> bool {
        lock(&self.launching).contains(&job_id) || lock(&self.running).get(&job_id).is_some_and(|j| !j.exited)
    }

    /// Marks the start (true) or the end (false) of a job's launch.
    pub(crate) fn set_launching(&self, job_id: JobId, launching: bool) {
        let mut set = lock(&self.launching);
        if launching {
            set.insert(job_id);
        } else {
            set.remove(&job_id);
        }
    }

    /// True while allocation `epoch` of the job runs here.
    pub(crate) fn runs(&self, job_id: u64, epoch: u64) -> bool {
        lock(&self.running).get(&job_id).is_some_and(|j| j.epoch == epoch && !j.exited)
    }

    pub(crate) fn handle(&self, job_id: u64, epoch: u64) -> Option<JobHandle> {
        lock(&self.running).get(&job_id).filter(|j| j.epoch == epoch && !j.exited).map(|j| j.handle.clone())
    }

    /// The handles of every job process that runs.
    pub(crate) fn running_handles(&self) -> Vec<(JobId, JobHandle)> {
        lock(&self.running).iter().filter(|(_, j)| !j.exited).map(|(id, j)| (*id, j.handle.clone())).collect()
    }

    pub(crate) fn add_running(&self, job_id: JobId, view: RunningView) {
        lock(&self.running).insert(job_id, view);
    }

    /// The job's process tree is gone: its GPUs are no longer in use; an instance the operator
    /// laid out is free again, one made for it stays taken until destroyed.
    pub(crate) fn mark_exited(&self, job_id: JobId, epoch: u64, keep_mig: bool) {
        if let Some(j) = lock(&self.running).get_mut(&job_id).filter(|j| j.epoch == epoch) {
            j.exited = true;
            if !keep_mig {
                j.mig_uuid = None;
            }
        }
    }

    pub(crate) fn remove_running(&self, job_id: JobId, epoch: u64) {
        let mut running = lock(&self.running);
        if running.get(&job_id).is_some_and(|j| j.epoch == epoch) {
            running.remove(&job_id);
        }
    }

    /// MIG devices held by jobs (running, or made for one and not destroyed yet).
    pub(crate) fn taken_mig_instances(&self) -> Vec<String> {
        lock(&self.running).values().filter_map(|j| j.mig_uuid.clone()).collect()
    }

    /// GPU indices of jobs whose processes still run.
    pub(crate) fn allocated_gpus(&self) -> Vec<u32> {
        lock(&self.running).values().filter(|j| !j.exited).flat_map(|j| j.gpus.clone()).collect()
    }

    /// What a metrics scrape exports now: the last heartbeat's GPU reading with hygiene and
    /// health, and the cgroup usage of every running job.
    pub(crate) fn metrics_snapshot(&self) -> crate::metrics::Snapshot {
        let info = self.device_info();
        let readings = lock(&self.last_readings).clone();
        let gpus = {
            let health = lock(&self.health);
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
        let running: Vec<(u64, String, JobHandle)> = lock(&self.running)
            .iter()
            .filter(|(_, j)| !j.exited)
            .map(|(id, j)| (*id, j.tenant.clone(), j.handle.clone()))
            .collect();
        let jobs = running
            .into_iter()
            .map(|(job_id, tenant, handle)| crate::metrics::JobSample { job_id, tenant, usage: handle.usage() })
            .collect();
        let last_ok = *lock(&self.last_heartbeat_ok);
        crate::metrics::Snapshot {
            hostname: self.config.node_name.clone(),
            gpus,
            heartbeat_age_secs: last_ok.unwrap_or(self.started).elapsed().as_secs_f64(),
            jobs,
        }
    }

    /// Reads every GPU off the async executor (driver calls block).
    pub(crate) async fn read_gpus(&self) -> Vec<GpuReading> {
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
    pub(crate) async fn check_hygiene(&self, job_id: u64, epoch: u64, gpus: &[u32]) -> bool {
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
    /// answered, so the leader knows about a dirty GPU before it learns the job ended.
    pub(crate) async fn heartbeat_now(&self) {
        let started_before = self.heartbeats_started.load(Ordering::SeqCst);
        let limit = self.config.heartbeat_interval * 3 + Duration::from_secs(1);
        let waited = tokio::time::timeout(limit, async {
            while self.heartbeat_accepted.load(Ordering::SeqCst) <= started_before {
                let sent = self.heartbeat_sent.notified();
                self.wake_heartbeat.notify_one();
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

    /// What this node offers, as it registers.
    pub(crate) fn node_spec(&self) -> NodeSpec {
        let c = &self.config;
        let mut labels = c.labels.clone();
        labels.extend(c.partitions.iter().map(|p| ("partition".to_owned(), p.clone())));
        NodeSpec {
            name: c.node_name.clone(),
            address: c.advertise_addr.clone(),
            gpus: self.gpus.devices(),
            cpu_millis: c.cpu_millis,
            memory_bytes: c.memory_bytes,
            labels,
            rendezvous_ports: c.rendezvous_ports,
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
        // Heartbeats must fail over quickly from a frozen coordinator: well within the fence time.
        let gateway = gateway.with_attempt_timeout(config.heartbeat_interval.max(Duration::from_millis(250)) * 2);
        Worker {
            shared: Arc::new(WorkerShared {
                config,
                gateway,
                executor,
                gpus,
                running: Mutex::new(BTreeMap::new()),
                launching: Mutex::new(BTreeSet::new()),
                node_epoch: AtomicU64::new(0),
                leader_term: AtomicU64::new(0),
                wake_heartbeat: Notify::new(),
                watch_reset: Notify::new(),
                hygiene,
                health,
                mps,
                info: Mutex::new(Vec::new()),
                heartbeats_started: AtomicU64::new(0),
                heartbeat_accepted: AtomicU64::new(0),
                heartbeat_sent: Notify::new(),
                last_readings: Mutex::new(Vec::new()),
                last_heartbeat_ok: Mutex::new(None),
                serving: tokio::sync::watch::Sender::new(false),
                started: Instant::now(),
            }),
        }
    }

    /// The worker's metrics, to serve while it runs.
    pub fn metrics(&self) -> crate::WorkerMetrics {
        crate::metrics::WorkerMetrics { shared: Arc::clone(&self.shared) }
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
        *lock(&self.shared.info) = info;
        self.shared.hygiene.start(&readings);
        lock(&self.shared.health).update(&readings);
        *lock(&self.shared.last_readings) = readings;
    }

    /// Serves the agent on `agent_listener` and runs the runtime until `shutdown`; then stops
    /// every job it runs and waits for them.
    pub async fn run(
        self,
        agent_listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        std::fs::create_dir_all(self.shared.jobs_dir())?;
        // Jobs of an earlier worker process are stale: the leader requeues them when we register.
        for cgroup in self.shared.executor.reap_leftovers()? {
            tracing::warn!(cgroup = %cgroup, "killed a job left running by an earlier worker process");
        }
        self.inspect_gpus().await;
        let audit = Arc::new(corral_security::AuditLog::in_dir(&self.shared.config.data_dir));
        let tls = self.shared.config.agent_tls.clone();
        let guard = crate::agent::guard(tls.is_some(), audit.clone());
        let standard = crate::grpc_health::guard(tls.is_some(), audit.clone());
        let incoming = corral_security::audited_incoming(agent_listener, tls, audit);
        let (reporter, health) = tonic_health::server::health_reporter();
        let health_task = tokio::spawn(crate::grpc_health::report(self.shared.serving.subscribe(), reporter));
        let (reflection, reflection_alpha) = crate::grpc_health::reflection()?;
        use tonic::service::interceptor::InterceptedService;
        let check = move |request| standard.check(request);
        let agent = tonic::transport::Server::builder()
            .add_service(InterceptedService::new(crate::agent::server(self.shared.clone()), move |request| {
                guard.check(request)
            }))
            .add_service(InterceptedService::new(health, check.clone()))
            .add_service(InterceptedService::new(reflection, check.clone()))
            .add_service(InterceptedService::new(reflection_alpha, check))
            .serve_with_incoming(incoming);
        let agent = tokio::spawn(agent);
        let renewal = self.shared.config.cert_renewal.clone().map(|r| tokio::spawn(crate::renew::run(r)));
        let result = crate::runtime::Runtime::new(self.shared.clone()).run(shutdown).await;
        agent.abort();
        if let Some(renewal) = renewal {
            renewal.abort();
        }
        health_task.abort();
        let shared = Arc::clone(&self.shared);
        let _ = tokio::task::spawn_blocking(move || shared.mps.shutdown()).await;
        result
    }
}
