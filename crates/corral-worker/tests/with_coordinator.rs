//! A coordinator and a worker in one process, the worker built from a config file as `corral
//! worker` builds it (`Worker::build`): GPU faults of the simulated backend reach the scheduler.

use corral_client::{Client, ClientConfig};
use corral_coordinator::{Coordinator, CoordinatorConfig};
use corral_core::{ClusterConfig, Command};
use corral_raft::{RaftNode, RaftNodeConfig};
use corral_types::{JobSpec, JobState};
use corral_worker::executor::ProcessExecutor;
use corral_worker::{BuildOptions, Worker, WorkerFile};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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
    let dir = tempfile::tempdir().expect("tempdir");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let node = RaftNode::open(&RaftNodeConfig::new(1, dir.path().join("coordinator"))).await.expect("raft");
    node.initialize(&addr).await.expect("init");
    let coordinator = Coordinator::new(node.clone(), CoordinatorConfig::default());
    let stop = CancellationToken::new();
    let server = tokio::spawn(coordinator.clone().serve(listener, stop.clone().cancelled_owned()));
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
    let agent = TcpListener::bind(&file.listen).await.expect("bind the agent");
    // In-process: this test binary cannot be the fence guard.
    let worker = Worker::build(&file, agent.local_addr().expect("agent addr"), BuildOptions::default()).expect("build");
    let worker_stop = CancellationToken::new();
    let worker = tokio::spawn(worker.run(agent, worker_stop.clone().cancelled_owned()));

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
        gpus,
        command: vec!["true".into()].into(),
        ..Default::default()
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

    std::fs::write(&faults, "[[gpu]]\nindex = 0\nleaked-memory-mib = 2048\n[[gpu]]\nindex = 1\ntemperature-c = 97\n")
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

    worker_stop.cancel();
    worker.await.expect("worker task").expect("worker");
    stop.cancel();
    let _ = node.shutdown().await;
    server.await.expect("server task").expect("server");
    // The worker's own cgroup (named after its data dir), then the configured root above it.
    for root in [file.job_cgroup_root(), format!("corral-it-{}", std::process::id())] {
        let _ = ProcessExecutor::new(root).map(|e| e.remove_root_cgroup());
    }
}
