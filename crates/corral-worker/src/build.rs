//! Assembling a worker from its config file: the GPU backend, its self-check (`preflight`), the
//! executors (processes, and runc containers when available), TLS (the file's `[tls]`, or the
//! credentials a join stored in the data dir), the coordinator client, the advertised address.

use crate::config::{Backend, WorkerFile};
use crate::executor::{Executor, ProcessExecutor, RoutingExecutor, RuncConfig, RuncExecutor};
use crate::fence::GuardCommand;
use crate::gpu::{GpuBackend, NvmlGpus, SimulatedGpus};
use crate::Worker;
use anyhow::{bail, Context};
use corral_client::{Client, ClientConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// What a worker needs besides its config file.
#[derive(Default)]
pub struct BuildOptions {
    /// Token towards the coordinators when the file has none (e.g. `$CORRAL_TOKEN`).
    pub token: Option<String>,
    /// How to start the fence guard; `None` only for workers run inside a test process. The
    /// worker adds `--cgroup-root` and its job cgroup root to the arguments.
    pub fence_guard: Option<GuardCommand>,
    /// GPUs to use instead of the file's `[gpu]` backend (`corral dev` names its simulated
    /// devices after its data dir).
    pub gpus: Option<Arc<dyn GpuBackend>>,
}

impl Worker {
    /// Joins the cluster with a token first (see `join.rs`; nothing is sent when the data dir
    /// holds credentials already), after the self-check passed, then builds the worker.
    pub async fn join_and_build(
        file: &WorkerFile,
        agent: SocketAddr,
        mut options: BuildOptions,
        join: &crate::join::JoinOptions,
    ) -> anyhow::Result<Worker> {
        let gpus = match options.gpus.take() {
            Some(gpus) => gpus,
            None => gpu_backend(file)?,
        };
        // A host that could not run jobs does not spend the token.
        crate::preflight::check(file, gpus.as_ref())?;
        let advertise = advertise_addr(file, agent)?;
        crate::join::join(file, advertise_host(&advertise), join).await?;
        options.gpus = Some(gpus);
        Worker::build(file, agent, options)
    }

    /// The worker a validated config file describes, serving its agent on the address `agent`
    /// is bound to.
    pub fn build(file: &WorkerFile, agent: SocketAddr, options: BuildOptions) -> anyhow::Result<Worker> {
        let stored = match &file.tls {
            Some(_) => None,
            None => crate::join::stored_credentials(&file.data_dir),
        };
        if file.tls.is_none() && stored.is_none() && !file.insecure && !agent.ip().is_loopback() {
            bail!(
                "listen: {agent} is not a loopback address and the agent would serve job logs in plaintext: configure [tls] (see `corral certs init`), or set insecure = true"
            );
        }
        std::fs::create_dir_all(&file.data_dir)
            .with_context(|| format!("cannot create data-dir {}", file.data_dir.display()))?;
        // Jobs get work dirs under data-dir and run with them as cwd: resolve a relative one now.
        let mut file = file.clone();
        file.data_dir = file.data_dir.canonicalize()?;
        let gpus = match options.gpus {
            Some(gpus) => gpus,
            None => gpu_backend(&file)?,
        };
        crate::preflight::check(&file, gpus.as_ref())?;
        // After the data dir was resolved: the guard and the executors name the same cgroup.
        let cgroup_root = file.job_cgroup_root();
        match crate::executor::remove_empty_legacy_job_cgroups(&file.executor.cgroup_root) {
            Ok((removed, kept)) => {
                if !removed.is_empty() {
                    tracing::info!(count = removed.len(), root = %file.executor.cgroup_root, "removed empty job cgroups an earlier version left");
                }
                if !kept.is_empty() {
                    tracing::warn!(cgroups = ?kept, "job cgroups with processes directly under executor.cgroup-root: not this worker's to reap");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot look for job cgroups an earlier version left"),
        }
        let executor = executor(&file, &cgroup_root)?;
        let mut config = file.worker_config().map_err(anyhow::Error::msg)?;
        config.fence_guard = options.fence_guard.map(|mut guard| {
            guard.args.extend(["--cgroup-root".to_string(), cgroup_root.clone()]);
            guard
        });
        let tls_files = file.tls.clone().or_else(|| crate::join::stored_credentials(&file.data_dir));
        let tls = match &tls_files {
            Some(files) => {
                let identity = corral_security::certificate_identity(&files.cert)?;
                if identity.name != config.node_name {
                    bail!(
                        "tls.cert: {} is the certificate of worker '{}', but this node is '{}'",
                        files.cert.display(),
                        identity.name,
                        config.node_name
                    );
                }
                Some(files.load_for(corral_security::Role::Worker)?)
            }
            None => None,
        };
        config.advertise_addr = advertise_addr(&file, agent)?;
        if let Some(warning) = tls_files.as_ref().and_then(|f| corral_security::expiry_warning(&f.cert, EXPIRY_WARNING))
        {
            tracing::warn!("tls.cert: {warning}");
        }
        let mut client_config = ClientConfig::new(file.coordinators.clone());
        client_config.token = file.token.clone().or(options.token);
        client_config.tls = tls.as_ref().map(|(_, client)| client.clone());
        let client = Client::new(client_config)?;
        // A certificate the worker got by joining is its own to renew; `[tls]` files are not.
        if let (None, Some(files), Some((_, client_tls))) = (&file.tls, &tls_files, &tls) {
            config.cert_renewal = Some(crate::renew::CertRenewal {
                files: files.clone(),
                node: config.node_name.clone(),
                address: advertise_host(&config.advertise_addr).to_string(),
                client: client.clone(),
                tls: client_tls.clone(),
            });
        }
        config.agent_tls = tls.map(|(server, _)| server);
        Ok(Worker::new(config, client.gateway(), executor, gpus))
    }
}

/// A daemon warns at start when its certificate expires within this.
const EXPIRY_WARNING: std::time::Duration = std::time::Duration::from_secs(14 * 24 * 3600);

/// The host of an advertised `host:port` (an IPv6 address without its brackets).
fn advertise_host(advertise: &str) -> &str {
    let host = advertise.rsplit_once(':').map_or(advertise, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// The address the coordinators reach the agent at.
fn advertise_addr(file: &WorkerFile, agent: SocketAddr) -> anyhow::Result<String> {
    match &file.advertise {
        Some(a) => Ok(a.clone()),
        None if agent.ip().is_unspecified() => {
            bail!("advertise: listen {agent} is a wildcard address; set advertise = \"<this host>:{}\"", agent.port())
        }
        None => Ok(agent.to_string()),
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

fn executor(file: &WorkerFile, cgroup_root: &str) -> anyhow::Result<Arc<dyn Executor>> {
    let process = ProcessExecutor::new(cgroup_root)?;
    if file.executor.runc.is_empty() {
        tracing::info!("containers disabled (executor.runc = \"\"): --image jobs will fail");
        return Ok(Arc::new(process));
    }
    let mut runc = RuncConfig::new(file.data_dir.join("containers"), cgroup_root);
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
