//! Worker daemons from their TOML config: a worker killed with SIGKILL has its jobs killed by
//! its fence guard at once and requeued after the TTL; a worker frozen past the TTL is
//! fenced and kills its stale job itself; a run lost with its node is credited on the invoice
//! when the policy credits `node-lost`; a worker managing MIG creates an instance per MIG job
//! and destroys it afterwards; two workers of one host never kill each other's jobs.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::is_dead;
use corral_integration::worker::WorkerProc;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Pids the job appended to `file`, one per attempt.
fn pids(file: &Path, at_least: usize) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pids: Vec<u32> =
            std::fs::read_to_string(file).unwrap_or_default().lines().filter_map(|l| l.trim().parse().ok()).collect();
        if pids.len() >= at_least {
            return pids;
        }
        assert!(Instant::now() < deadline, "job wrote {} pids, expected {at_least}", pids.len());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn setup() -> (Cluster, WorkerProc, tempfile::TempDir) {
    setup_with(|config| config)
}

/// A one-coordinator cluster and one worker whose config `edit` may change.
fn setup_with(edit: impl FnOnce(String) -> String) -> (Cluster, WorkerProc, tempfile::TempDir) {
    let cluster = Cluster::start(1, ClusterOptions { node_ttl: "2s".into(), ..Default::default() });
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let dir = tempfile::tempdir().expect("tempdir");
    // Jobs run as nobody: let them write their pid file.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 2);
    worker.edit_config(edit);
    worker.start();
    worker.wait_registered(&cluster);
    (cluster, worker, dir)
}

fn submit_sleeper(cluster: &Cluster, pid_file: &Path) -> u64 {
    let script = format!("echo $$ >> {}; exec sleep 1000", pid_file.display());
    let doc = cluster.json(&["submit", "--gpus", "1", "--", "sh", "-c", &script]);
    doc["id"].as_u64().expect("job id")
}

#[test]
fn killed_worker_has_its_jobs_killed_by_its_guard_and_requeued() {
    let (cluster, mut worker, dir) = setup();
    let pid_file = dir.path().join("pids");
    let job = submit_sleeper(&cluster, &pid_file);
    cluster.wait_for(job, Duration::from_secs(60), "running", |d| d["state"] == "running" && d["node"] == "w1");
    let first = pids(&pid_file, 1)[0];

    // The fence guard sees its worker's pipe close and kills the job's cgroup: no orphan keeps
    // running while the coordinator, after the TTL, places the job again.
    worker.kill();
    let deadline = Instant::now() + Duration::from_secs(1);
    while !is_dead(first) {
        assert!(Instant::now() < deadline, "the guard did not kill the orphan {first} of its dead worker");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(cluster.show(job)["state"], "running", "the coordinator waits for the TTL");
    let doc = cluster.wait_for(job, Duration::from_secs(60), "requeued", |d| d["state"] == "pending");
    assert!(doc["reason"].as_str().unwrap_or("").contains("lost"), "{doc}");
    let nodes = cluster.json(&["nodes"]);
    assert_eq!(nodes[0]["state"], "down", "{nodes}");

    worker.start();
    let doc = cluster
        .wait_for(job, Duration::from_secs(60), "running again", |d| d["state"] == "running" && d["attempts"] == 2);
    assert_eq!(doc["node"], "w1");
    let second = pids(&pid_file, 2)[1];
    assert_ne!(first, second);
    assert!(!is_dead(second));
    cluster.json(&["cancel", &job.to_string()]);
    cluster.wait_for(job, Duration::from_secs(60), "cancelled", |d| d["state"] == "cancelled");
}

/// A run lost with its node is billed with cause `node-lost`, and under a policy crediting that
/// cause the tenant's invoice lists the run, then a credit of its whole cost naming it: the
/// tenant owes nothing for it.
#[test]
fn a_run_lost_with_its_node_is_credited_on_the_tenants_invoice() {
    let (cluster, mut worker, dir) = setup();
    let policy = dir.path().join("credits.toml");
    let dev = include_str!("../../../cluster-configs/dev-policy.toml");
    std::fs::write(&policy, format!("{dev}\n[billing.credits]\nnode-lost = 1.0\n")).expect("write");
    let applied = cluster.json(&["admin", "apply", "-f", policy.to_str().expect("utf-8")]);
    assert!(applied.to_string().contains("billing.credits: node-lost set to 1"), "{applied}");
    let pid_file = dir.path().join("pids");
    let job = submit_sleeper(&cluster, &pid_file);
    cluster.wait_for(job, Duration::from_secs(60), "running", |d| d["state"] == "running");
    pids(&pid_file, 1);
    std::thread::sleep(Duration::from_secs(1));
    worker.kill();
    cluster.wait_for(job, Duration::from_secs(60), "requeued", |d| d["state"] == "pending");
    cluster.json(&["cancel", &job.to_string()]);

    let invoice = cluster.json(&["billing", "invoice", "--tenant", "default"]);
    let entries = invoice["entries"].as_array().expect("entries");
    assert_eq!(entries.len(), 2, "the run and its credit: {invoice}");
    let (run, credit) = (&entries[0], &entries[1]);
    assert_eq!(
        (run["kind"].as_str(), run["cause"].as_str(), run["job_id"].as_u64()),
        (Some("charge"), Some("node-lost"), Some(job))
    );
    let cost = run["amount_micros"].as_i64().expect("amount");
    assert!(cost > 0, "a second on a GPU costs something: {invoice}");
    assert_eq!((credit["kind"].as_str(), credit["credit_for"].as_u64()), (Some("credit"), run["entry"].as_u64()));
    assert_eq!(credit["amount_micros"].as_i64(), Some(-cost), "{invoice}");
    assert_eq!(invoice["totals"]["total_micros"], 0, "{invoice}");
    assert_eq!(invoice["totals"]["charged_micros"].as_i64(), Some(cost), "{invoice}");

    // The table and the CSV say the same.
    let table = cluster.corral_at(0, &["billing", "invoice", "--tenant", "default"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("node-lost") && table.contains(&format!("credit: node-lost, entry {}", run["entry"])),
        "{table}"
    );
    assert!(table.lines().any(|l| l.starts_with("total") && l.trim_end().ends_with("0.000000")), "{table}");
    let csv = cluster.corral_at(0, &["billing", "invoice", "--tenant", "default", "--format", "csv"]);
    let csv = String::from_utf8_lossy(&csv.stdout);
    let credit_line = csv.lines().find(|l| l.split(',').nth(1) == Some("credit")).unwrap_or_default();
    assert!(credit_line.ends_with(&format!(",node-lost,{}", run["entry"])), "{csv}");
    let report = cluster.json(&["billing", "report"]);
    assert_eq!(report["total_net_micros"], 0, "{report}");
}

#[test]
fn frozen_worker_is_fenced_and_kills_its_stale_job() {
    let (cluster, worker, dir) = setup();
    let pid_file = dir.path().join("pids");
    let job = submit_sleeper(&cluster, &pid_file);
    cluster.wait_for(job, Duration::from_secs(60), "running", |d| d["state"] == "running");
    let first = pids(&pid_file, 1)[0];

    // Frozen past the TTL: its guard (not frozen) kills the job at the fence deadline, and the
    // coordinator gives the node up and requeues the job after the full TTL.
    worker.signal(libc::SIGSTOP);
    cluster.wait_for(job, Duration::from_secs(60), "requeued", |d| d["state"] == "pending");
    // Thawed, the worker learns its epoch is stale and registers again.
    worker.signal(libc::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_dead(first) {
        assert!(Instant::now() < deadline, "the fenced worker kept its stale job {first}: {}", worker.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let doc = cluster
        .wait_for(job, Duration::from_secs(60), "running again", |d| d["state"] == "running" && d["attempts"] == 2);
    assert_eq!(doc["node"], "w1");
    assert_ne!(pids(&pid_file, 2)[1], first);
    cluster.json(&["cancel", &job.to_string()]);
    cluster.wait_for(job, Duration::from_secs(60), "cancelled", |d| d["state"] == "cancelled");
}

/// With `mig.manage`, each MIG job gets an instance made for it at start and destroyed at its
/// end: two 3g.40gb jobs share the card at once, each on its own MIG device, and a 7g.80gb job
/// after them can only be created because both of their instances are gone.
#[test]
fn managed_mig_instances_are_created_per_job_and_destroyed_after() {
    let (cluster, worker, _dir) = setup_with(|config| {
        let config = config.replace(
            "model = \"RTX 5090\"\nmemory = \"32GiB\"\ncount = 2\n",
            "model = \"H100 80GB\"\nmemory = \"80GiB\"\ncount = 1\nmig = true\n",
        );
        assert!(config.contains("mig = true"), "the device section changed: {config}");
        format!("{config}\n[mig]\nmanage = true\n")
    });
    let submit = |profile: &str, secs: u32| -> u64 {
        let script = format!("echo $CUDA_VISIBLE_DEVICES; sleep {secs}");
        let doc = cluster.json(&["submit", "--gpu-slice", &format!("mig:{profile}"), "--", "sh", "-c", &script]);
        doc["id"].as_u64().expect("job id")
    };
    let logs = |job: u64| -> String {
        let out = cluster.corral_at(0, &["logs", &job.to_string()]);
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let a = submit("3g.40gb", 3);
    let b = submit("3g.40gb", 3);
    cluster.wait_for(a, Duration::from_secs(60), "running", |d| d["state"] == "running");
    cluster.wait_for(b, Duration::from_secs(60), "running", |d| d["state"] == "running");
    assert_eq!(cluster.show(a)["state"], "running", "both halves of the card at once");
    let nodes = cluster.json(&["nodes"]);
    let gpu = &nodes[0]["gpus"][0];
    assert_eq!(gpu["mig_capable"], true, "{nodes}");
    let mut slices: Vec<String> = gpu["slices"]
        .as_array()
        .expect("slices")
        .iter()
        .map(|s| s["slice"].as_str().unwrap_or("").to_owned())
        .collect();
    slices.sort();
    assert_eq!(slices, ["mig:3g.40gb@0", "mig:3g.40gb@4"], "{nodes}");
    let c = submit("7g.80gb", 0);
    for job in [a, b, c] {
        let doc = cluster
            .wait_for(job, Duration::from_secs(60), "finished", |d| d["state"] != "pending" && d["state"] != "running");
        assert_eq!(doc["state"], "succeeded", "job {job}: {doc}\n{}", worker.log());
    }
    let (ua, ub, uc) = (logs(a), logs(b), logs(c));
    for uuid in [&ua, &ub, &uc] {
        assert!(uuid.starts_with("MIG-"), "CUDA_VISIBLE_DEVICES should name a MIG device: '{uuid}'");
    }
    assert_ne!(ua, ub, "each job has its own instance");
    let log = worker.log();
    assert_eq!(log.matches("destroyed a simulated MIG instance").count(), 3, "{log}");
}

/// Two workers of one host given the same `executor.cgroup-root` (as a copied example config
/// has) keep their jobs apart: each puts them under a cgroup named after its data dir. The
/// second worker's start (which reaps what an earlier worker of its data dir left), its death
/// (its fence guard kills its jobs) and its restart leave the first worker's job running.
#[test]
fn two_workers_sharing_a_cgroup_root_never_kill_each_others_jobs() {
    let (cluster, w1, dir) = setup();
    let mut root_line = String::new();
    w1.edit_config(|config| {
        root_line = config.lines().find(|l| l.starts_with("cgroup-root")).expect("a cgroup-root line").to_owned();
        config
    });
    let sleeper = |pid_file: &Path| -> u64 {
        let script = format!("echo $$ >> {}; exec sleep 1000", pid_file.display());
        cluster.json(&["submit", "--gpus", "2", "--", "sh", "-c", &script])["id"].as_u64().expect("job id")
    };
    let (pids_1, pids_2) = (dir.path().join("pids-1"), dir.path().join("pids-2"));
    let first = sleeper(&pids_1);
    cluster.wait_for(first, Duration::from_secs(60), "running on w1", |d| d["state"] == "running" && d["node"] == "w1");
    let first_pid = pids(&pids_1, 1)[0];

    let mut w2 = WorkerProc::configure(dir.path(), "w2", &cluster.endpoints(), 2);
    w2.edit_config(|config| {
        let own = config.lines().find(|l| l.starts_with("cgroup-root")).expect("a cgroup-root line").to_owned();
        config.replace(&own, &root_line)
    });
    w2.start();
    w2.wait_registered(&cluster);
    // w1's GPUs are taken: this one runs on w2.
    let second = sleeper(&pids_2);
    cluster
        .wait_for(second, Duration::from_secs(60), "running on w2", |d| d["state"] == "running" && d["node"] == "w2");
    let second_pid = pids(&pids_2, 1)[0];
    assert!(!is_dead(first_pid), "w2's start killed w1's job: {}", w2.log());

    // w2 dies: its guard kills its own job at once, and only that one.
    w2.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !is_dead(second_pid) {
        assert!(Instant::now() < deadline, "w2's guard did not kill w2's job");
        std::thread::sleep(Duration::from_millis(20));
    }
    w2.start();
    w2.wait_registered(&cluster);
    std::thread::sleep(Duration::from_millis(500));
    assert!(!is_dead(first_pid), "w2's guard or restart killed w1's job: {}", w2.log());
    assert_eq!(cluster.show(first)["state"], "running");
    assert!(!w2.log().contains(&format!("/job-{first}-")), "w2 reaped w1's job: {}", w2.log());
    for job in [first, second] {
        cluster.json(&["cancel", &job.to_string()]);
    }
    cluster.wait_for(first, Duration::from_secs(60), "cancelled", |d| d["state"] == "cancelled");
    drop(w1);
}
