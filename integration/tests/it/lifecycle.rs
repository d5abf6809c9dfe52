//! Job lifecycle under hostile timing, one test per race that once broke it: a cancel or a
//! preemption that lands before the worker launched the job, a leader that wins again long after
//! it lost, a worker report that reaches a follower, a frozen worker whose job is placed again
//! elsewhere, a leader whose wall clock is an hour ahead, and a gang whose parts end apart.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::corral_bin;
use corral_integration::worker::WorkerProc;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn submit(cluster: &Cluster, args: &[&str]) -> u64 {
    let mut all = vec!["submit"];
    all.extend_from_slice(args);
    cluster.json(&all)["id"].as_u64().expect("job id")
}

/// A temp dir jobs (running as nobody) may write into.
fn shared_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    dir
}

/// An initialized cluster of `n` coordinators with `options`.
fn cluster(n: u64, options: ClusterOptions) -> Cluster {
    let cluster = Cluster::start(n, options);
    if n == 1 {
        let init = cluster.corral_at(0, &["cluster", "init"]);
        assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    } else {
        cluster.init_and_join_all();
    }
    cluster
}

/// A worker `name` with `gpus` simulated GPUs, registered with `cluster`.
fn worker(cluster: &Cluster, dir: &Path, name: &str, gpus: u32) -> WorkerProc {
    let mut worker = WorkerProc::configure(dir, name, &cluster.endpoints(), gpus);
    worker.start();
    worker.wait_registered(cluster);
    worker
}

/// Lines `<pid> <seconds>` a ticking job appended to `file`, as (pid, time).
fn ticks(file: &Path) -> Vec<(u32, f64)> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
        })
        .collect()
}

/// Deposes `leader` by freezing it past the election timeout; returns the node that leads next.
fn depose(cluster: &Cluster, leader: usize) -> usize {
    cluster.signal(leader, libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(800));
    cluster.signal(leader, libc::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let next = cluster.leader();
        if next != leader {
            return next;
        }
        assert!(Instant::now() < deadline, "node {leader} stayed leader after its freeze");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Makes `target` the leader of a three-node cluster. Deposing the leader is not enough:
/// openraft draws each node's election timeout once, at start, so the node with the shortest
/// one wins every election it takes part in. Here the other two nodes are frozen together, so
/// that `target` alone times out and campaigns; the follower then wakes to its vote request.
fn elect(cluster: &Cluster, target: usize) {
    for _ in 0..10 {
        let leader = cluster.leader();
        if leader == target {
            return;
        }
        let others: Vec<usize> = (0..3).filter(|i| *i != target).collect();
        for i in &others {
            cluster.signal(*i, libc::SIGSTOP);
        }
        std::thread::sleep(Duration::from_millis(600));
        for i in others.iter().filter(|i| **i != leader) {
            cluster.signal(*i, libc::SIGCONT);
        }
        std::thread::sleep(Duration::from_millis(400));
        cluster.signal(leader, libc::SIGCONT);
        let deadline = Instant::now() + Duration::from_secs(20);
        while cluster.leader() == leader && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    panic!("node {target} never won an election");
}

/// `corral cancel` right after the submit, before the worker launched the job (it is frozen
/// while the job is placed on it): the job ends cancelled and its GPUs serve the next job.
#[test]
fn a_job_cancelled_before_its_launch_ends_and_frees_its_gpus() {
    let cluster = cluster(1, ClusterOptions::default());
    let dir = shared_dir();
    let w1 = worker(&cluster, dir.path(), "w1", 2);

    w1.signal(libc::SIGSTOP);
    let job = submit(&cluster, &["--gpus", "2", "--", "sleep", "600"]);
    cluster.wait_for(job, Duration::from_secs(10), "placed", |d| d["node"] == "w1");
    cluster.json(&["cancel", &job.to_string()]);
    w1.signal(libc::SIGCONT);

    let doc = cluster.wait_for(job, Duration::from_secs(20), "cancelled", |d| d["state"] == "cancelled");
    assert!(doc["gpus"].as_array().is_none_or(Vec::is_empty) || doc["state"] == "cancelled", "{doc}");
    let next = submit(&cluster, &["--gpus", "2", "--", "true"]);
    cluster.wait_for(next, Duration::from_secs(20), "succeeded on the freed GPUs", |d| d["state"] == "succeeded");
}

/// A gpu-high-priority job preempts a victim that is placed but not yet launched: the victim
/// goes back to the queue without running and the high-priority job runs at once.
#[test]
fn preempting_a_job_before_its_launch_lets_the_high_priority_job_run() {
    let cluster = cluster(1, ClusterOptions::default());
    let dir = shared_dir();
    let w1 = worker(&cluster, dir.path(), "w1", 2);

    w1.signal(libc::SIGSTOP);
    let victim = submit(&cluster, &["--gpus", "2", "--priority", "preemptible", "--", "sleep", "600"]);
    cluster.wait_for(victim, Duration::from_secs(10), "placed", |d| d["node"] == "w1");
    let high = submit(&cluster, &["--gpus", "2", "--priority", "gpu-high-priority", "--", "true"]);
    w1.signal(libc::SIGCONT);

    cluster.wait_for(high, Duration::from_secs(20), "succeeded", |d| d["state"] == "succeeded");
    let doc = cluster.show(victim);
    assert!(doc["state"] == "pending" || doc["state"] == "running", "the victim is requeued, not ended: {doc}");
    cluster.json(&["cancel", &victim.to_string()]);
    cluster.wait_for(victim, Duration::from_secs(20), "cancelled", |d| d["state"] == "cancelled");
}

/// A coordinator that lost leadership longer than the node TTL ago and wins again must not
/// judge workers by the heartbeats it saw in its old term: the running job keeps its node, its
/// process and its single attempt through every change of leader.
#[test]
fn a_leader_that_wins_again_after_the_ttl_keeps_every_node_and_job() {
    let ttl = Duration::from_secs(6);
    let cluster = cluster(3, ClusterOptions { node_ttl: "6s".into(), ..Default::default() });
    let dir = shared_dir();
    let _w1 = worker(&cluster, dir.path(), "w1", 1);
    let pids = dir.path().join("pids");
    let script = format!("echo $$ >> {}; exec sleep 600", pids.display());
    let job = submit(&cluster, &["--gpus", "1", "--", "sh", "-c", &script]);
    cluster.wait_for(job, Duration::from_secs(20), "running", |d| d["state"] == "running");

    let mut former_leaders = Vec::new();
    let mut rewon = false;
    for _ in 0..6 {
        let leader = cluster.leader();
        let next = depose(&cluster, leader);
        if former_leaders.contains(&next) {
            // It lost leadership at least one TTL ago: give its scheduler a few passes.
            std::thread::sleep(Duration::from_secs(2));
            rewon = true;
        }
        former_leaders.push(leader);
        let doc = cluster.show(job);
        assert_eq!(doc["state"], "running", "{doc}");
        assert_eq!(doc["attempts"], 1, "a change of leader restarted the job: {doc}");
        let nodes = cluster.json(&["nodes"]);
        assert_eq!(nodes[0]["state"], "up", "{nodes}");
        if rewon {
            break;
        }
        std::thread::sleep(ttl + Duration::from_secs(1));
    }
    assert!(rewon, "no former leader won again in six elections");
    let written = std::fs::read_to_string(&pids).unwrap_or_default();
    assert_eq!(written.lines().count(), 1, "the job was launched more than once: {written}");
    cluster.json(&["cancel", &job.to_string()]);
    cluster.wait_for(job, Duration::from_secs(20), "cancelled", |d| d["state"] == "cancelled");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// A worker report that reaches a follower is referred to the leader (Unavailable with the
/// leader's address), never judged from the follower's possibly lagging state; the leader
/// itself answers a report about an unknown job as not accepted.
#[test]
fn a_follower_refers_worker_reports_to_the_leader() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    let out = Command::new(corral_bin())
        .args(["certs", "init", "--dir"])
        .arg(&certs)
        .args(["--coordinators", "3", "--workers", "w1"])
        .output()
        .expect("corral certs init");
    assert!(out.status.success(), "certs init: {}", String::from_utf8_lossy(&out.stderr));
    let cluster = cluster(3, ClusterOptions { tls: Some(certs.clone()), ..Default::default() });
    let leader = cluster.leader();
    let follower = (leader + 1) % 3;
    cluster.wait_converged();

    let report = |addr: String| {
        let certs = certs.clone();
        runtime().block_on(async move {
            let ca = tonic::transport::Certificate::from_pem(std::fs::read(certs.join("ca.pem")).expect("ca"));
            let pem = std::fs::read(certs.join("worker-w1.pem")).expect("cert");
            let key = std::fs::read(certs.join("worker-w1-key.pem")).expect("key");
            let tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(ca)
                .identity(tonic::transport::Identity::from_pem(pem, key));
            let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
                .expect("endpoint")
                .tls_config(tls)
                .expect("tls")
                .connect()
                .await
                .expect("connect");
            let mut client = corral_proto::v1::worker_gateway_client::WorkerGatewayClient::new(channel);
            let request = corral_proto::v1::ReportFinishedRequest {
                node: "w1".into(),
                job_id: 424_242,
                epoch: 1,
                report: Some(corral_proto::v1::JobExitReport { exit_code: Some(0), ..Default::default() }),
            };
            client.report_finished(request).await.map(tonic::Response::into_inner)
        })
    };

    let refused = report(cluster.nodes[follower].addr.clone()).expect_err("a follower judged a worker report");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let hint = refused.metadata().get("corral-leader-addr").and_then(|v| v.to_str().ok()).map(String::from);
    assert_eq!(hint.as_deref(), Some(cluster.nodes[leader].addr.as_str()), "{refused:?}");

    let answer = report(cluster.nodes[leader].addr.clone()).expect("the leader answers");
    assert!(!answer.accepted, "a report about an unknown job was accepted");
}

/// A worker frozen with its job running: its fence guard kills the job before the TTL hands it
/// to the other worker, so the two attempts never tick at the same time.
#[test]
fn a_frozen_workers_job_never_overlaps_its_next_attempt() {
    let cluster = cluster(1, ClusterOptions { node_ttl: "4s".into(), ..Default::default() });
    let dir = shared_dir();
    let w1 = worker(&cluster, dir.path(), "w1", 1);
    let w2 = worker(&cluster, dir.path(), "w2", 1);
    let file = dir.path().join("ticks");
    let script = format!("while true; do echo \"$$ $(date +%s.%N)\" >> {}; sleep 0.05; done", file.display());
    let job = submit(&cluster, &["--gpus", "1", "--", "sh", "-c", &script]);
    let doc = cluster.wait_for(job, Duration::from_secs(20), "running", |d| d["state"] == "running");
    let (frozen, other) = if doc["node"] == "w1" { (&w1, "w2") } else { (&w2, "w1") };

    frozen.signal(libc::SIGSTOP);
    cluster.wait_for(job, Duration::from_secs(30), "running on the other worker", |d| {
        d["state"] == "running" && d["node"] == other && d["attempts"] == 2
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while ticks(&file).iter().map(|t| t.0).collect::<std::collections::BTreeSet<_>>().len() < 2 {
        assert!(Instant::now() < deadline, "the second attempt never ticked");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    frozen.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(1));

    let all = ticks(&file);
    let first_pid = all[0].0;
    let last_of_first = all.iter().filter(|t| t.0 == first_pid).map(|t| t.1).fold(f64::MIN, f64::max);
    let first_of_second = all.iter().filter(|t| t.0 != first_pid).map(|t| t.1).fold(f64::MAX, f64::min);
    assert!(
        last_of_first < first_of_second,
        "attempt 1 ticked at {last_of_first:.3} after attempt 2 started at {first_of_second:.3}"
    );
    cluster.json(&["cancel", &job.to_string()]);
    cluster.wait_for(job, Duration::from_secs(20), "cancelled", |d| d["state"] == "cancelled");
}

/// A job that starts under a leader with a true clock and ends under one whose clock is an
/// hour ahead is billed what the worker measured, not an hour more.
#[test]
fn a_leader_an_hour_ahead_bills_runs_what_the_worker_measured() {
    let skewed = 2;
    let options = ClusterOptions {
        node_env: vec![(skewed, "FAILPOINTS".into(), "clock-skew-ms=return(3600000)".into())],
        ..Default::default()
    };
    let cluster = cluster(3, options);
    let dir = shared_dir();
    let _w1 = worker(&cluster, dir.path(), "w1", 1);
    while cluster.leader() == skewed {
        depose(&cluster, skewed);
    }
    let stop = dir.path().join("stop");
    let script = format!("while [ ! -e {} ]; do sleep 0.05; done", stop.display());
    let job = submit(&cluster, &["--gpus", "1", "--", "sh", "-c", &script]);
    cluster.wait_for(job, Duration::from_secs(20), "started", |d| !d["started_ts"].is_null());
    elect(&cluster, skewed);
    assert_eq!(cluster.leader(), skewed, "the skewed node never won an election");
    std::fs::write(&stop, "").expect("stop file");
    let doc = cluster.wait_for(job, Duration::from_secs(20), "succeeded", |d| d["state"] == "succeeded");
    let worker_ms = doc["worker_run_time_ms"].as_u64().expect("worker_run_time_ms");
    // The only GPU job of the pool: its GPU-hours are its billed length on one GPU.
    let report = cluster.json(&["billing", "report"]);
    let gpu_hours: f64 =
        report["rows"].as_array().expect("rows").iter().map(|r| r["gpu_hours"].as_f64().unwrap_or(0.0)).sum();
    let billed = (gpu_hours * 3_600_000.0).round() as u64;
    assert!(
        billed.abs_diff(worker_ms) <= 1_000,
        "billed {billed} ms for a run the worker measured at {worker_ms} ms: {report}"
    );
}

/// A gang across two workers ends when its last part ends, not its first: a part that exits 0
/// early leaves the other running (and the job running, its GPUs held); a part that fails stops
/// the other, and the job fails once both have stopped.
#[test]
fn a_gang_runs_until_its_last_part_ends_and_fails_as_a_whole() {
    let cluster = cluster(1, ClusterOptions::default());
    let dir = shared_dir();
    let _w1 = worker(&cluster, dir.path(), "w1", 1);
    let _w2 = worker(&cluster, dir.path(), "w2", 1);
    let gate = dir.path().join("gate");
    let done = dir.path().join("done");
    // w1's part exits 0 at once; w2's waits for the gate, then leaves a mark and exits 0.
    let script = format!(
        "if [ \"$CORRAL_NODE\" = w1 ]; then exit 0; fi; while [ ! -e {gate} ]; do sleep 0.05; done; touch {done}",
        gate = gate.display(),
        done = done.display()
    );
    let job = submit(&cluster, &["--gpus", "2", "--gpus-per-node", "1", "--", "sh", "-c", &script]);
    cluster.wait_for(job, Duration::from_secs(20), "started", |d| !d["started_ts"].is_null());
    // Long enough for w1's exit report to land: the job must still run.
    std::thread::sleep(Duration::from_secs(2));
    let doc = cluster.show(job);
    assert_eq!(doc["state"], "running", "a gang ended with its first part: {doc}");
    let parts: Vec<(String, String)> = doc["parts"]
        .as_array()
        .expect("parts")
        .iter()
        .map(|p| (p["node"].as_str().unwrap_or("").to_string(), p["status"].as_str().unwrap_or("").to_string()))
        .collect();
    assert!(parts.contains(&("w1".into(), "exited 0".into())), "{doc}");
    assert!(parts.contains(&("w2".into(), "running".into())), "{doc}");
    let queued = submit(&cluster, &["--gpus", "1", "--", "true"]);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(cluster.show(queued)["state"], "pending", "w1's GPU stays held while the gang runs");
    std::fs::write(&gate, "").expect("gate");
    let doc = cluster.wait_for(job, Duration::from_secs(20), "succeeded", |d| d["state"] == "succeeded");
    assert_eq!(doc["exit_code"], 0);
    assert!(done.exists(), "w2's part was stopped instead of running to its end");
    cluster.wait_for(queued, Duration::from_secs(20), "succeeded", |d| d["state"] == "succeeded");

    // w2's part fails at once; w1's would run for ever: it is stopped, and the gang fails.
    let script = "if [ \"$CORRAL_NODE\" = w2 ]; then exit 3; fi; exec sleep 1000";
    let job = submit(&cluster, &["--gpus", "2", "--gpus-per-node", "1", "--", "sh", "-c", script]);
    let doc = cluster.wait_for(job, Duration::from_secs(30), "failed", |d| d["state"] == "failed");
    assert_eq!(doc["reason"], "exit code 3 (on node w2)", "{doc}");
    assert_eq!(doc["attempts"], 1);
    let next = submit(&cluster, &["--gpus", "2", "--gpus-per-node", "1", "--", "true"]);
    cluster.wait_for(next, Duration::from_secs(20), "succeeded", |d| d["state"] == "succeeded");
}
