//! The worker daemon: `Worker::new` builds its owners of shared state — the job table
//! (`jobs.rs`), the devices (`devices.rs`) and the link to the leader (`link.rs`) — and
//! `Worker::run` serves the log agent and runs the runtime (`runtime/`), which registers,
//! follows the leader's desired state and reports.

use crate::config::WorkerConfig;
use crate::devices::Devices;
use crate::executor::Executor;
use crate::gpu::GpuBackend;
use crate::jobs::JobTable;
use crate::link::Link;
use corral_client::GatewayClient;
use corral_types::NodeSpec;
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;

/// A worker daemon.
pub struct Worker {
    config: Arc<WorkerConfig>,
    executor: Arc<dyn Executor>,
    jobs: Arc<JobTable>,
    devices: Arc<Devices>,
    link: Arc<Link>,
}

impl Worker {
    pub fn new(
        config: WorkerConfig,
        gateway: GatewayClient,
        executor: Arc<dyn Executor>,
        gpus: Arc<dyn GpuBackend>,
    ) -> Self {
        let devices = Arc::new(Devices::new(gpus, &config));
        let link = Arc::new(Link::new(gateway, node_spec(&config), config.heartbeat_interval));
        Worker { config: Arc::new(config), executor, jobs: Arc::default(), devices, link }
    }

    /// The worker's metrics, to serve while it runs.
    pub fn metrics(&self) -> crate::WorkerMetrics {
        let hostname = self.config.node_name.clone();
        crate::WorkerMetrics::new(hostname, self.devices.clone(), self.jobs.clone(), self.link.clone())
    }

    /// Serves the agent on `agent_listener` and runs the runtime until `shutdown`; then stops
    /// every job it runs and waits for them.
    pub async fn run(
        self,
        agent_listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        std::fs::create_dir_all(self.config.jobs_dir())?;
        if let Err(e) = crate::in_job_bin::install_in_job_commands(&self.config.in_job_bin_dir()) {
            // Jobs run without them (`scontrol: command not found`); nothing else depends on them.
            tracing::warn!(dir = %self.config.in_job_bin_dir().display(), error = %e, "cannot link Slurm's in-job commands");
        }
        if let Err(e) = crate::in_job_bin::install_for_images(&self.config.in_image_dir()) {
            tracing::warn!(dir = %self.config.in_image_dir().display(), error = %e, "cannot write Slurm's in-job commands for image jobs");
        }
        // Jobs of an earlier worker process are stale: the leader requeues them when we register.
        for cgroup in self.executor.reap_leftovers()? {
            tracing::warn!(cgroup = %cgroup, "killed a job left running by an earlier worker process");
        }
        self.link.stale_jobs_stopped();
        // The image store; opening it unmounts the job roots an earlier worker process left.
        let images = match self.config.images.clone() {
            Some(settings) => Some(
                tokio::task::spawn_blocking(move || corral_image::Images::open(&settings))
                    .await?
                    .map_err(|e| anyhow::anyhow!("cannot open the image store: {e}"))?,
            ),
            None => None,
        };
        if let Some(images) = &images {
            self.link.report_images(images.clone());
        }
        self.devices.inspect().await;
        let audit = Arc::new(corral_security::AuditLog::in_dir(&self.config.data_dir));
        let tls = self.config.agent_tls.clone();
        let guard = crate::agent::guard(tls.is_some(), audit.clone());
        let standard = crate::grpc_health::guard(tls.is_some(), audit.clone());
        let incoming = corral_security::audited_incoming(agent_listener, tls, audit);
        let (reporter, health) = tonic_health::server::health_reporter();
        let health_task = tokio::spawn(crate::grpc_health::report(self.link.serving(), reporter));
        let (reflection, reflection_alpha) = crate::grpc_health::reflection()?;
        use tonic::service::interceptor::InterceptedService;
        let check = move |request| standard.check(request);
        let agent_images = crate::agent_images::AgentImages::new(self.config.node_name.clone(), images.clone());
        let agent_service = crate::agent::server(self.config.jobs_dir(), self.jobs.clone(), agent_images);
        let agent = tonic::transport::Server::builder()
            .add_service(InterceptedService::new(agent_service, move |request| guard.check(request)))
            .add_service(InterceptedService::new(health, check.clone()))
            .add_service(InterceptedService::new(reflection, check.clone()))
            .add_service(InterceptedService::new(reflection_alpha, check))
            .serve_with_incoming(incoming);
        let agent = tokio::spawn(agent);
        let (desired_tx, desired_rx) = tokio::sync::watch::channel(crate::reconcile::Desired::default());
        let in_job = {
            let (path, jobs, link) = (self.config.in_job_socket(), self.jobs.clone(), self.link.clone());
            tokio::spawn(async move { crate::in_job::serve(&path, jobs, link, desired_rx).await })
        };
        let renewal = self.config.cert_renewal.clone().map(|r| tokio::spawn(crate::renew::run(r)));
        let runtime = crate::runtime::Runtime::new(
            self.config.clone(),
            self.executor.clone(),
            images,
            self.jobs.clone(),
            self.devices.clone(),
            self.link.clone(),
            desired_tx,
        );
        let result = runtime.run(shutdown).await;
        agent.abort();
        in_job.abort();
        if let Some(renewal) = renewal {
            renewal.abort();
        }
        health_task.abort();
        let devices = Arc::clone(&self.devices);
        let _ = tokio::task::spawn_blocking(move || devices.shutdown_mps()).await;
        result
    }
}

/// What this node offers, its GPUs left out (the link reads them at each registration).
fn node_spec(config: &WorkerConfig) -> NodeSpec {
    let mut labels = config.labels.clone();
    labels.extend(config.partitions.iter().map(|p| ("partition".to_owned(), p.clone())));
    NodeSpec {
        name: config.node_name.clone(),
        address: config.advertise_addr.clone(),
        gpus: Vec::new(),
        cpu_millis: config.cpu_millis,
        memory_bytes: config.memory_bytes,
        labels,
        rendezvous_ports: config.rendezvous_ports,
        lease_end: config.lease_end,
    }
}
