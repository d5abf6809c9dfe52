//! `corral dev`: a single-node coordinator and one or more workers with simulated GPUs (MIG
//! capable with `--mig`) in one process.

use crate::args::DevArgs;
use crate::metrics_http::MetricsSource;
use anyhow::{bail, Context};
use corral_coordinator::policy::parse_policy;
use corral_coordinator::{Coordinator, CoordinatorFile};
use corral_core::Command;
use corral_types::ConfigSize;
use corral_worker::config::{ExecutorSection, GpuSection, SimulatedDeviceSection, UserSection, UsersSection};
use corral_worker::gpu::{SimulatedDevice, SimulatedGpus};
use corral_worker::{BuildOptions, Worker, WorkerFile};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const NODE_NAME: &str = "dev-node";

/// The names of `count` simulated nodes: `dev-node`, then `dev-node-2` ... `dev-node-N` (so a
/// pool restarted with more nodes keeps its first one).
fn node_names(count: u32) -> Vec<String> {
    (1..=count).map(|i| if i == 1 { NODE_NAME.to_string() } else { format!("{NODE_NAME}-{i}") }).collect()
}

/// A `--node-labels` value: `key=value` pairs separated by commas; `partition=P` (any number)
/// puts the node in partition P.
fn parse_node_labels(text: &str) -> anyhow::Result<(BTreeMap<String, String>, Vec<String>)> {
    let mut labels = BTreeMap::new();
    let mut partitions = Vec::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("--node-labels: '{pair}' is not key=value (e.g. partition=train,zone=a)");
        };
        let (key, value) = (key.trim(), value.trim());
        if key.is_empty() || value.is_empty() {
            bail!("--node-labels: '{pair}' needs a key and a value (e.g. partition=train,zone=a)");
        }
        if key == "partition" {
            partitions.push(value.to_string());
        } else {
            labels.insert(key.to_string(), value.to_string());
        }
    }
    Ok((labels, partitions))
}

/// Stable short hash of a path, naming this data dir's simulated GPUs.
fn path_tag(path: &std::path::Path) -> String {
    let hash = path
        .to_string_lossy()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("{:08x}", hash as u32)
}

/// The uid and primary gid of a user given by name or number.
fn resolve_user(user: &str) -> anyhow::Result<(u32, u32)> {
    let name = std::ffi::CString::new(user).context("--run-as: a user name has no NUL byte")?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buf` outlives the reads of `pwd` below.
    let rc = unsafe { libc::getpwnam_r(name.as_ptr(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found) };
    if rc == 0 && !found.is_null() {
        return Ok((pwd.pw_uid, pwd.pw_gid));
    }
    if let Ok(uid) = user.parse::<u32>() {
        // SAFETY: as above.
        let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found) };
        let gid = if rc == 0 && !found.is_null() { pwd.pw_gid } else { uid };
        return Ok((uid, gid));
    }
    bail!("--run-as: no user '{user}' on this machine (give a user name from /etc/passwd or a uid)")
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    crate::daemon::init_tracing();
    let listen: SocketAddr = args
        .listen
        .parse()
        .with_context(|| format!("invalid --listen '{}': expected IP:PORT such as 127.0.0.1:7070", args.listen))?;
    if !listen.ip().is_loopback() {
        bail!("corral dev serves without TLS, so it listens on loopback only: use e.g. 127.0.0.1:{}", listen.port());
    }
    let metrics_addr = match &args.metrics_addr {
        Some(m) => {
            let addr = crate::metrics_http::parse_addr("--metrics-addr", m).map_err(anyhow::Error::msg)?;
            if !addr.ip().is_loopback() {
                bail!("corral dev serves metrics on loopback only: use e.g. --metrics-addr 127.0.0.1:{}", addr.port());
            }
            Some(addr)
        }
        None => None,
    };
    let policy = match &args.policy {
        Some(path) => {
            let text = crate::admin_cmd::read_policy(path)?;
            Some(parse_policy(&path.display().to_string(), &text).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };
    let users = match &args.run_as {
        None => UsersSection { as_worker: true, ..Default::default() },
        Some(user) => {
            let (uid, gid) = resolve_user(user)?;
            let mut users = UsersSection { allow_root: uid == 0, ..Default::default() };
            users.default = Some(UserSection { uid, gid });
            users
        }
    };
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create data dir {}", args.data_dir.display()))?;
    let data_dir = args.data_dir.canonicalize()?;
    let listener = crate::listen::bind(listen, "for clients").await?;
    let addr = listener.local_addr()?;

    // Opened as `corral coordinator` opens one: node 1 of a cluster of one, with every default.
    let coordinator_file = CoordinatorFile::new(1, addr, data_dir.join("coordinator"));
    coordinator_file.validate().map_err(anyhow::Error::msg)?;
    let coordinator = Coordinator::open(&coordinator_file, addr)
        .await
        .with_context(|| format!("cannot open coordinator data in {}", data_dir.display()))?;
    let node = coordinator.raft_node().clone();
    node.initialize(&addr.to_string()).await?;
    let stop = CancellationToken::new();
    let server = tokio::spawn(coordinator.clone().serve(listener, stop.clone().cancelled_owned()));

    node.wait_for(Duration::from_secs(30), |s| s.leader == Some(s.id))
        .await
        .context("the coordinator did not become leader")?;
    match &policy {
        // Given on the command line: the policy of this pool, applied again if it changed.
        Some(config) if !node.state.read().state.config.tenants.is_empty() => {
            let by = "corral dev --policy".to_string();
            coordinator.propose(Command::ApplyPolicy { config: config.clone(), by, force: false }).await?;
        }
        _ => coordinator.install_first_policy(policy.clone(), "corral dev").await?,
    }

    // Each worker is assembled as `corral worker` assembles one, from a config that says what
    // a dev pool is: simulated GPUs, jobs as this user, its own data dir (and so its own cgroup).
    let runc = corral_worker::executor::find_runc(std::path::Path::new(&ExecutorSection::default().runc)).is_some();
    if !runc {
        // A try-out pool runs without containers where runc is missing (a real worker's
        // self-check refuses to start without the runc its config names).
        tracing::info!("runc not found: corral dev runs no --image jobs");
    }
    let names = node_names(args.nodes);
    if args.node_labels.len() > names.len() {
        bail!("--node-labels: {} given for {} node(s) (one per node, in order)", args.node_labels.len(), names.len());
    }
    let mut workers = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let worker_dir = if i == 0 { data_dir.join("worker") } else { data_dir.join(format!("worker-{}", i + 1)) };
        let gpu = GpuSection {
            backend: "simulated".into(),
            devices: vec![SimulatedDeviceSection {
                model: args.gpu_model.clone(),
                memory: ConfigSize(args.gpu_memory),
                count: args.gpus,
                mig: args.mig,
            }],
            // Operators and tests inject GPU faults (overheat, XID, leaked memory) by writing this file.
            faults_file: Some(worker_dir.join("faults.toml")),
        };
        let mut worker_file = WorkerFile::new(vec![addr.to_string()], worker_dir.clone(), gpu);
        worker_file.node_name = Some(name.clone());
        worker_file.users = Some(users.clone());
        // A simulated MIG card gets the instance each MIG job needs, as `[mig] manage` does.
        worker_file.mig.manage = args.mig;
        worker_file.images.mount_allow = args.mount_allow.clone();
        if let Some(size) = args.image_max_size {
            worker_file.images.max_size = ConfigSize(size);
        }
        if let Some(labels) = args.node_labels.get(i) {
            let (labels, partitions) = parse_node_labels(labels)?;
            worker_file.labels = labels;
            worker_file.partitions = partitions;
        }
        if !runc {
            worker_file.executor.runc = String::new();
        }
        worker_file.validate().map_err(anyhow::Error::msg)?;
        let agent_listener = TcpListener::bind("127.0.0.1:0").await?;
        let agent_addr = agent_listener.local_addr()?;
        // Simulated GPU ids unique to this data dir and node: two dev pools never share a device.
        let device =
            SimulatedDevice { model: args.gpu_model.clone(), memory_mib: args.gpu_memory >> 20, mig: args.mig };
        let gpus =
            SimulatedGpus::with_devices(&format!("{name}-{}", path_tag(&data_dir)), &vec![device; args.gpus as usize])
                .with_faults_file(worker_dir.join("faults.toml"));
        let options =
            BuildOptions { token: None, fence_guard: Some(crate::daemon::fence_guard()?), gpus: Some(Arc::new(gpus)) };
        let worker = Worker::build(&worker_file, agent_addr, options)?;
        // The data dir exists now: the root is the one the worker resolved.
        let cgroup_root = worker_file.job_cgroup_root();
        workers.push((name.clone(), agent_addr.to_string(), cgroup_root, worker, agent_listener));
    }
    // One listener exports the coordinator's series and every worker's (one family each, the
    // workers' series told apart by their `Hostname` label).
    let metrics = match metrics_addr {
        Some(addr) => {
            let mut sources = vec![MetricsSource::Coordinator(coordinator.clone())];
            sources.extend(workers.iter().map(|w| MetricsSource::Worker(w.3.metrics())));
            Some(crate::metrics_http::start(addr, sources, stop.clone().cancelled_owned()).await?)
        }
        None => None,
    };
    // The workers stop first, while the coordinator still takes their last reports.
    let worker_stop = stop.child_token();
    let mut running = Vec::new();
    for (name, agent_addr, cgroup_root, worker, listener) in workers {
        let task = tokio::spawn(worker.run(listener, worker_stop.clone().cancelled_owned()));
        running.push((name, agent_addr, cgroup_root, task));
    }

    let deadline = Instant::now() + Duration::from_secs(30);
    // Ready once this process's workers registered: after a restart a node is already up in the
    // persisted state, but with the previous worker's address.
    let registered =
        |agent: &str, n: &corral_types::NodeStatus| n.state == corral_types::NodeState::Up && n.spec.address == agent;
    while !running
        .iter()
        .all(|(name, agent, ..)| node.state.read().state.nodes.get(name).is_some_and(|n| registered(agent, n)))
    {
        if Instant::now() > deadline {
            bail!("the dev workers did not register within 30s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(bound) = metrics {
        println!("corral dev metrics at http://{bound}/metrics");
        println!("corral dev web view at http://{bound}/");
    }
    let nodes = if args.nodes == 1 { String::new() } else { format!("{} nodes of ", args.nodes) };
    let mig = if args.mig { ", MIG on" } else { "" };
    println!(
        "corral dev ready at {addr} ({nodes}{} x {} simulated{mig}, data in {})",
        args.gpus,
        args.gpu_model,
        data_dir.display()
    );
    println!("try: corral --endpoint {addr} submit --gpus 1 -- sh -c 'echo hello from $CUDA_VISIBLE_DEVICES'");

    crate::daemon::termination().await;
    tracing::info!("shutting down");
    worker_stop.cancel();
    for (_, _, cgroup_root, task) in running {
        task.await??;
        // The worker ended its jobs: its cgroup root goes too (one per data dir would pile up).
        // Left in place, with a warning, while anything is still under it.
        if let Err(e) =
            corral_worker::executor::ProcessExecutor::new(cgroup_root.as_str()).and_then(|e| e.remove_root_cgroup())
        {
            tracing::warn!(error = %e, cgroup_root, "cannot remove the dev pool's cgroup root");
        }
    }
    stop.cancel();
    if let Err(e) = node.shutdown().await {
        tracing::warn!(error = %e, "raft shutdown");
    }
    server.await??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_keep_the_first_node_of_a_single_node_pool() {
        assert_eq!(node_names(1), ["dev-node"]);
        assert_eq!(node_names(3), ["dev-node", "dev-node-2", "dev-node-3"]);
    }

    #[test]
    fn node_labels_take_partitions_apart_and_refuse_what_is_not_key_value() {
        let (labels, partitions) = parse_node_labels("partition=train, zone=a,partition=infer").expect("valid");
        assert_eq!(partitions, ["train", "infer"]);
        assert_eq!(labels, BTreeMap::from([("zone".to_string(), "a".to_string())]));
        for bad in ["zone", "=a", "zone=", "partition=train,x"] {
            let e = parse_node_labels(bad).expect_err(bad).to_string();
            assert!(e.starts_with("--node-labels: "), "{bad}: {e}");
        }
    }
}
