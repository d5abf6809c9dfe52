//! The worker daemon loop: register, heartbeat, launch what the coordinator assigns, kill what
//! it revokes, and report starts and exits.
//!
//! Invariant: an allocation epoch is launched at most once per worker process; exit reports are
//! retried until the coordinator acknowledges them (it ignores stale epochs, so retries are safe).

use crate::executor::{Executor, JobHandle, LaunchSpec, ResourceLimits};
use crate::gpu::GpuBackend;
use corral_client::GatewayClient;
use corral_proto::v1::{self as pb};
use corral_types::{GpuSlice, Job, JobExitReport, NodeSpec};
use nix::sys::signal::Signal;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Notify;

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
        }
    }
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
    handle: Option<JobHandle>,
    /// The process tree is gone; the exit report may still be in flight.
    exited: bool,
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
}

impl WorkerShared {
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
            }),
        }
    }

    fn node_spec(&self) -> NodeSpec {
        let c = &self.shared.config;
        NodeSpec {
            name: c.node_name.clone(),
            address: c.advertise_addr.clone(),
            gpus: self.shared.gpus.devices(),
            cpu_millis: c.cpu_millis,
            memory_bytes: c.memory_bytes,
            labels: c.labels.clone(),
        }
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
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(agent_listener);
        let agent = tonic::transport::Server::builder()
            .add_service(crate::agent::server(self.shared.clone()))
            .serve_with_incoming(incoming);
        let agent = tokio::spawn(agent);
        tokio::pin!(shutdown);
        tokio::select! {
            _ = &mut shutdown => {}
            _ = self.main_loop() => {}
        }
        agent.abort();
        self.kill_all("worker shutting down");
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
        let (running, allocated): (Vec<pb::RunningJob>, Vec<u32>) = {
            let jobs = shared.jobs();
            let running = jobs
                .iter()
                .filter(|(_, j)| !j.exited)
                .map(|(id, j)| pb::RunningJob { job_id: *id, epoch: j.epoch })
                .collect();
            (running, jobs.values().filter(|j| !j.exited).flat_map(|j| j.gpus.clone()).collect())
        };
        let gpus = shared
            .gpus
            .health(&allocated)
            .into_iter()
            .map(|h| pb::GpuHealth {
                index: h.index,
                temperature_c: h.temperature_c,
                utilization_percent: h.utilization_percent,
                memory_used_mib: h.memory_used_mib,
                power_mw: h.power_mw,
                xid_errors: h.xid_errors,
                dirty: h.dirty,
            })
            .collect();
        let request = pb::HeartbeatRequest {
            node: shared.config.node_name.clone(),
            node_epoch: shared.node_epoch.load(Ordering::SeqCst),
            gpus,
            running,
        };
        let reply = shared.gateway.heartbeat(request).await?;
        if reply.reregister {
            tracing::warn!("coordinator does not know this node's epoch: killing local jobs and registering again");
            self.kill_all("node fenced by the coordinator");
            self.register().await;
            return Ok(());
        }
        for kill in reply.kill {
            self.stop_job(kill.job_id, kill.epoch);
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
    fn stop_job(&self, job_id: u64, epoch: u64) {
        let handle = {
            let jobs = self.shared.jobs();
            match jobs.get(&job_id) {
                Some(j) if j.epoch == epoch && !j.exited => j.handle.clone(),
                _ => None,
            }
        };
        let Some(handle) = handle else { return };
        tracing::info!(job_id, epoch, "stopping job");
        if let Err(e) = handle.signal_tree(Signal::SIGTERM) {
            tracing::warn!(job_id, error = %e, "SIGTERM failed");
        }
        let grace = self.shared.config.kill_grace;
        let shared = self.shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            if shared.jobs().get(&job_id).is_some_and(|j| j.epoch == epoch && !j.exited) {
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
        {
            let mut launched = self.shared.launched.lock().unwrap_or_else(|p| p.into_inner());
            if self.shared.jobs().contains_key(&job.id) || !launched.insert(allocation.epoch) {
                return;
            }
        }
        let spec = self.launch_spec(&job, allocation.epoch, &allocation.gpus);
        let time_limit = job.spec.time_limit_secs.map(Duration::from_secs);
        let launched = self.shared.executor.launch(&spec);
        let shared = self.shared.clone();
        let (job_id, epoch) = (job.id, allocation.epoch);
        match launched {
            Ok(mut running) => {
                tracing::info!(job_id, epoch, pid = running.pid(), gpus = ?allocation.gpus, "job started");
                let handle = running.handle();
                shared.jobs().insert(
                    job_id,
                    LocalJob { epoch, gpus: allocation.gpus.clone(), handle: Some(handle.clone()), exited: false },
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
            Err(e) => {
                tracing::warn!(job_id, epoch, error = %e, "launch failed");
                let report = JobExitReport { launch_error: Some(e.to_string()), ..Default::default() };
                shared.jobs().insert(job_id, LocalJob { epoch, gpus: Vec::new(), handle: None, exited: true });
                tokio::spawn(async move { report_finished(&shared, job_id, epoch, report).await });
            }
        }
    }

    fn launch_spec(&self, job: &Job, epoch: u64, gpus: &[u32]) -> LaunchSpec {
        let devices = self.shared.gpus.devices();
        let uuids: Vec<String> =
            gpus.iter().filter_map(|i| devices.iter().find(|d| d.index == *i).map(|d| d.uuid.clone())).collect();
        let mut env = job.spec.env.clone();
        let ids: Vec<String> = gpus.iter().map(u32::to_string).collect();
        env.insert("CUDA_VISIBLE_DEVICES".into(), ids.join(","));
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), if uuids.is_empty() { "void".into() } else { uuids.join(",") });
        if let Some(GpuSlice::Mps { thread_percent, memory_mib }) = &job.spec.gpu_slice {
            env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), thread_percent.to_string());
            if let Some(m) = memory_mib {
                env.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("0={m}M"));
            }
        }
        env.insert("CORRAL_JOB_ID".into(), job.id.to_string());
        env.insert("CORRAL_NODE".into(), self.shared.config.node_name.clone());
        env.insert("CORRAL_TENANT".into(), job.spec.tenant.clone());
        LaunchSpec {
            job_id: job.id,
            attempt: epoch,
            argv: job.spec.command.clone(),
            env,
            work_dir: self.shared.jobs_dir().join(job.id.to_string()).join(epoch.to_string()),
            limits: ResourceLimits {
                memory_bytes: (job.spec.memory_bytes > 0).then_some(job.spec.memory_bytes),
                cpu_millis: (job.spec.cpu_millis > 0).then_some(job.spec.cpu_millis),
                pids_max: None,
            },
            uid: None,
            gid: None,
        }
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
