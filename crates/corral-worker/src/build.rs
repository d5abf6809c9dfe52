//! Assembling a worker from its config file: the GPU backend, the executors (processes, and
//! runc containers when available), TLS, the coordinator client, the advertised address.

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
    /// How to start the fence guard; `None` only for workers run inside a test process.
    pub fence_guard: Option<GuardCommand>,
    /// GPUs to use instead of the file's `[gpu]` backend (`corral dev` names its simulated
    /// devices after its data dir).
    pub gpus: Option<Arc<dyn GpuBackend>>,
}

impl Worker {
    /// The worker a validated config file describes, serving its agent on the address `agent`
    /// is bound to.
    pub fn build(file: &WorkerFile, agent: SocketAddr, options: BuildOptions) -> anyhow::Result<Worker> {
        if file.tls.is_none() && !file.insecure && !agent.ip().is_loopback() {
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
        let executor = executor(&file)?;
        let mut config = file.worker_config().map_err(anyhow::Error::msg)?;
        config.fence_guard = options.fence_guard;
        let tls = match &file.tls {
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
        config.advertise_addr = match &file.advertise {
            Some(a) => a.clone(),
            None if agent.ip().is_unspecified() => {
                bail!(
                    "advertise: listen {agent} is a wildcard address; set advertise = \"<this host>:{}\"",
                    agent.port()
                )
            }
            None => agent.to_string(),
        };
        let mut client_config = ClientConfig::new(file.coordinators.clone());
        client_config.token = file.token.clone().or(options.token);
        client_config.tls = tls.as_ref().map(|(_, client)| client.clone());
        config.agent_tls = tls.map(|(server, _)| server);
        let client = Client::new(client_config)?;
        Ok(Worker::new(config, client.gateway(), executor, gpus))
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
