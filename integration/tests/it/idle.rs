//! Idle sessions on real processes: a worker with simulated GPUs whose utilisation the faults
//! file sets. A `corral alloc` session whose GPU stays under 1% for its `--idle-timeout` is
//! ended by its worker with the reason `idle: GPU utilisation under 1% for 3s`, and alloc says
//! so and ends; a busy one (50%) runs past the same timeout until its command ends; a session
//! without `--idle-timeout` takes its class's `idle-timeout` from the policy. A session on two
//! nodes ends only once both nodes' GPUs are idle, and is billed with cause `idle`.

use corral_integration::cluster::{free_port, Cluster, ClusterOptions};
use corral_integration::worker::WorkerProc;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

/// One coordinator whose class `preemptible` has an idle timeout of 2s, and a worker with 2
/// simulated GPUs.
fn setup() -> (Cluster, WorkerProc, tempfile::TempDir) {
    let cluster = Cluster::start(1, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let policy = dir.path().join("idle.toml");
    let dev = include_str!("../../../cluster-configs/dev-policy.toml");
    let with_idle = dev.replace("grace = \"30s\"\n", "grace = \"30s\"\nidle-timeout = \"2s\"\n");
    assert_ne!(dev, with_idle, "the dev policy's preemptible class changed: update this test");
    std::fs::write(&policy, with_idle).expect("write");
    cluster.json(&["admin", "apply", "-f", policy.to_str().expect("utf-8")]);
    let worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 2);
    let mut worker = worker;
    worker.start();
    worker.wait_registered(&cluster);
    (cluster, worker, dir)
}

/// Sets both GPUs' utilisation through the worker's faults file (atomically).
fn utilisation(worker: &WorkerProc, pct: u32) {
    let text = format!("[[gpu]]\nindex = 0\nutilization-pct = {pct}\n\n[[gpu]]\nindex = 1\nutilization-pct = {pct}\n");
    let tmp = worker.data_dir.join("faults.toml.tmp");
    std::fs::write(&tmp, text).expect("write faults");
    std::fs::rename(&tmp, worker.data_dir.join("faults.toml")).expect("rename faults");
}

/// Runs `corral alloc ARGS` to its end; returns its exit code, stderr and how long it took.
fn alloc(cluster: &Cluster, dir: &tempfile::TempDir, args: &[&str]) -> (Option<i32>, String, Duration) {
    let started = Instant::now();
    let output = Command::new(corral_integration::corral_bin())
        .args(cluster.admin_tls_args())
        .args(["--endpoint", &cluster.endpoints(), "alloc", "--gpus", "1", "-D", &dir.path().display().to_string()])
        .args(args)
        .output()
        .expect("corral alloc");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned(), started.elapsed())
}

fn granted(stderr: &str) -> u64 {
    let id = stderr.lines().find_map(|l| l.strip_prefix("salloc: Granted job allocation "));
    id.and_then(|j| j.trim().parse().ok()).unwrap_or_else(|| panic!("no grant: {stderr}"))
}

#[test]
fn an_idle_session_ends_with_the_reason_and_a_busy_one_does_not() {
    let (cluster, worker, dir) = setup();

    // Busy at 50%: the session outlives its 3s idle timeout until its command ends.
    utilisation(&worker, 50);
    let (code, stderr, took) = alloc(&cluster, &dir, &["--idle-timeout", "3s", "--", "sleep", "8"]);
    assert_eq!(code, Some(0), "the busy session's command ran to its end: {stderr}");
    assert!(took >= Duration::from_secs(8), "{took:?}: {stderr}");
    let busy = cluster.show(granted(&stderr));
    assert_eq!(
        (busy["state"].as_str(), busy["reason"].as_str()),
        (Some("cancelled"), Some("cancelled by user")),
        "{busy}"
    );
    assert!(stderr.contains("Relinquishing job allocation"), "{stderr}");

    // Idle at 0%: the worker ends it after 3s of idleness; alloc says why and ends its command.
    utilisation(&worker, 0);
    let (code, stderr, took) = alloc(&cluster, &dir, &["--idle-timeout", "3s", "--", "sleep", "120"]);
    let job = granted(&stderr);
    let idle = cluster.show(job);
    let reason = "idle: GPU utilisation under 1% for 3s";
    assert_eq!(
        (idle["state"].as_str(), idle["reason"].as_str()),
        (Some("cancelled"), Some(reason)),
        "{idle}\n{}",
        worker.log()
    );
    assert!(took < Duration::from_secs(60), "the session ended well before its command: {took:?}");
    assert!(stderr.contains(&format!("Job allocation {job} has been revoked: {reason}")), "{stderr}");
    assert_ne!(code, Some(0), "the command was hung up on: {stderr}");

    // No --idle-timeout: the class's (2s), with --min-gpu-util's threshold in the reason.
    let (_, stderr, _) =
        alloc(&cluster, &dir, &["--priority", "preemptible", "--min-gpu-util", "5", "--", "sleep", "120"]);
    let classed = cluster.show(granted(&stderr));
    assert_eq!(classed["reason"], "idle: GPU utilisation under 5% for 2s", "{classed}");
}

#[test]
fn a_session_on_two_nodes_ends_idle_only_once_both_nodes_are_idle() {
    let (cluster, workers, dir) = corral_integration::worker::two_node_pool(free_port());
    utilisation(&workers[0], 0);
    utilisation(&workers[1], 50);
    let session = Command::new(corral_integration::corral_bin())
        .args(cluster.admin_tls_args())
        .args(["--endpoint", &cluster.endpoints(), "alloc", "-N", "2", "--gpus-per-node", "1"])
        .args(["--idle-timeout", "2s", "-D", &dir.path().display().to_string(), "--", "sleep", "120"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("corral alloc");
    let deadline = Instant::now() + Duration::from_secs(60);
    let job = loop {
        let jobs = cluster.json(&["jobs"]);
        let running = jobs.as_array().and_then(|a| a.iter().find(|j| j["state"] == "running").cloned());
        if let Some(job) = running {
            break job["id"].as_u64().expect("job id");
        }
        assert!(Instant::now() < deadline, "the session never ran: {jobs}");
        std::thread::sleep(Duration::from_millis(200));
    };
    // w1 has been idle for three times the timeout, w2 is busy: the session goes on.
    std::thread::sleep(Duration::from_secs(6));
    let doc = cluster.show(job);
    assert_eq!(doc["state"], "running", "one idle node does not end a session: {doc}\n{}", workers[0].log());
    utilisation(&workers[1], 0);
    let reason = "idle: GPU utilisation under 1% for 2s";
    let deadline = Instant::now() + Duration::from_secs(60);
    let doc = loop {
        let doc = cluster.show(job);
        if doc["state"] != "running" {
            break doc;
        }
        assert!(Instant::now() < deadline, "both nodes idle, the session did not end: {doc}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!((doc["state"].as_str(), doc["reason"].as_str()), (Some("cancelled"), Some(reason)), "{doc}");
    let output = session.wait_with_output().expect("alloc");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&format!("Job allocation {job} has been revoked: {reason}")), "{stderr}");
    let out = cluster.corral_at(0, &["billing", "invoice", "--tenant", "default", "--format", "csv"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let invoice = String::from_utf8_lossy(&out.stdout);
    let causes: Vec<&str> = invoice
        .lines()
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| f.get(2) == Some(&job.to_string().as_str()))
        .filter_map(|f| f.get(11).copied())
        .collect();
    assert!(!causes.is_empty() && causes.iter().all(|c| *c == "idle"), "billed as ended idle: {invoice}");
}
