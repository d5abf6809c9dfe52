//! Host leases on real processes: a worker's `lease-end` and `corral node lease` keep jobs that
//! would outlast the lease pending with the reason, while jobs that fit run; at the lease end
//! minus the class's grace running jobs get their checkpoint signal and are requeued with cause
//! `lease-ended` (credited on the invoice, no restart counted); at the lease end the node drains.
//! A leader killed just before the lease end minus grace neither loses the requeue nor repeats it.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::one_line_stderr;
use corral_integration::worker::WorkerProc;
use corral_types::{format_utc, Timestamp};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as u64
}

/// One coordinator whose default class has a 2 s grace, a one-minute lease guard, and
/// `lease-ended` credited in full.
fn setup() -> (Cluster, tempfile::TempDir) {
    setup_with(1)
}

/// [`setup`] with `coordinators` coordinators.
fn setup_with(coordinators: u64) -> (Cluster, tempfile::TempDir) {
    let cluster = Cluster::start(coordinators, ClusterOptions::default());
    cluster.init_and_join_all();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let dev = include_str!("../../../cluster-configs/dev-policy.toml").replace("grace = \"1m\"", "grace = \"2s\"");
    let policy = dir.path().join("leases.toml");
    let text = format!("{dev}\n[scheduler]\nlease-guard = \"1m\"\n\n[billing.credits]\nlease-ended = 1.0\n");
    std::fs::write(&policy, text).expect("write");
    cluster.json(&["admin", "apply", "-f", policy.to_str().expect("utf-8")]);
    (cluster, dir)
}

fn node(cluster: &Cluster, name: &str) -> Value {
    let nodes = cluster.json(&["nodes"]);
    nodes.as_array().and_then(|n| n.iter().find(|n| n["name"] == name)).cloned().unwrap_or_else(|| panic!("{nodes}"))
}

fn submit(cluster: &Cluster, args: &[&str]) -> u64 {
    cluster.json(&[&["submit", "--gpus", "1"], args].concat())["id"].as_u64().expect("job id")
}

#[test]
fn a_job_past_the_lease_end_waits_with_the_reason_and_one_that_fits_runs() {
    let (cluster, dir) = setup();
    // The worker's lease ends in an hour.
    let lease_end = format_utc(Timestamp::compose(now_ms() / 1000 * 1000 + 3_600_000, 0));
    let lease_end = format!("{}Z", lease_end.split('.').next().expect("date"));
    let mut worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 2);
    worker.edit_config(|c| format!("lease-end = \"{lease_end}\"\n{c}"));
    worker.start();
    worker.wait_registered(&cluster);
    let shown = node(&cluster, "w1");
    assert_eq!(shown["lease_end"].as_str().map(|s| s.replace(".000Z", "Z")), Some(lease_end.clone()), "{shown}");
    let table = cluster.corral_at(0, &["nodes", "--output", "table"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("LEASE-END") && table.contains(&lease_end), "{table}");

    let long = submit(&cluster, &["--time", "2h", "--", "true"]);
    let fits = submit(&cluster, &["--time", "10m", "--", "true"]);
    cluster.wait_for(fits, Duration::from_secs(30), "succeeded", |d| d["state"] == "succeeded");
    let waiting = cluster.wait_for(long, Duration::from_secs(10), "pending for the lease", |d| {
        d["state"] == "pending" && d["reason"].as_str().is_some_and(|r| r.contains("ends after the lease of w1"))
    });
    assert_eq!(waiting["attempts"], 0, "{waiting}");
    let queue = cluster.corral_at(0, &["queue", "--output", "table"]);
    let queue = String::from_utf8_lossy(&queue.stdout);
    assert!(queue.contains("ends after the lease of w1"), "corral queue says why: {queue}");

    // The operator's lease end wins over the worker's: three hours from now, the job fits.
    let set = cluster.json(&["node", "lease", "w1", "--until", "3h"]);
    assert!(set["lease_end"].as_str().is_some_and(|t| t != shown["lease_end"].as_str().unwrap_or("")), "{set}");
    cluster.wait_for(long, Duration::from_secs(30), "succeeded", |d| d["state"] == "succeeded");
    // Cleared: the worker's lease end applies again.
    let cleared = cluster.json(&["node", "lease", "w1", "--clear"]);
    assert_eq!(cleared["lease_end"], shown["lease_end"], "{cleared}");
    // Bad input: a clear one-line error, nothing changed.
    let out = cluster.corral_at(0, &["node", "lease", "w1"]);
    assert!(!out.status.success(), "--until or --clear is required");
    let out = cluster.corral_at(0, &["node", "lease", "w1", "--until", "someday"]);
    assert!(one_line_stderr(&out).contains("invalid time 'someday'"), "{}", one_line_stderr(&out));
    let out = cluster.corral_at(0, &["node", "lease", "ghost", "--until", "1h"]);
    assert!(one_line_stderr(&out).contains("ghost"), "{}", one_line_stderr(&out));
    assert_eq!(node(&cluster, "w1")["lease_end"], shown["lease_end"]);
}

#[test]
fn the_lease_end_checkpoints_requeues_and_credits_running_jobs_then_drains_the_node() {
    let (cluster, dir) = setup();
    let mut w1 = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 2);
    w1.start();
    w1.wait_registered(&cluster);
    // Two jobs without a time limit on w1: one checkpoints and exits at its signal, the other
    // records it and runs on, ignoring SIGTERM too (it is killed at the end of its grace).
    let marks = dir.path().join("checkpoints");
    let exits = format!("trap 'echo $CORRAL_JOB_ID >> {}; exit 0' USR1; sleep 120 & wait", marks.display());
    let stays =
        format!("trap 'echo $CORRAL_JOB_ID >> {}' USR1; trap '' TERM; while true; do sleep 0.1; done", marks.display());
    let quick = submit(&cluster, &["--signal", "USR1", "--", "sh", "-c", &exits]);
    let stubborn = submit(&cluster, &["--signal", "USR1", "--", "sh", "-c", &stays]);
    for job in [quick, stubborn] {
        cluster.wait_for(job, Duration::from_secs(30), "running", |d| d["state"] == "running" && d["node"] == "w1");
    }
    std::thread::sleep(Duration::from_millis(500));

    // The lease ends in 5 s; the class's grace is 2 s: the jobs are stopped 3 s from now.
    let set = cluster.json(&["node", "lease", "w1", "--until", "5s"]);
    let end = set["lease_end"].as_str().unwrap_or_else(|| panic!("{set}"));
    let (seconds, millis) = end.trim_end_matches('Z').split_once('.').expect("milliseconds");
    let end_ms = corral_types::parse_utc(seconds).expect("a date").physical_ms() + millis.parse::<u64>().expect("ms");
    let stop_at_ms = end_ms - 2_000;
    let mut requeued_after: Vec<(u64, f64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut left = vec![quick, stubborn];
    while !left.is_empty() {
        assert!(Instant::now() < deadline, "jobs {left:?} were never requeued");
        left.retain(|job| {
            let doc = cluster.show(*job);
            if doc["state"] == "pending" && doc["attempts"] == 1 {
                requeued_after.push((*job, (now_ms() as f64 - stop_at_ms as f64) / 1000.0));
                false
            } else {
                true
            }
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    for (job, secs) in &requeued_after {
        let kind = if *job == quick { "checkpoints and exits" } else { "ignores the signal and SIGTERM" };
        println!("lease end minus grace to job {job} ({kind}) requeued: {secs:.3} s (grace 2 s)");
    }
    let checkpoints = std::fs::read_to_string(&marks).unwrap_or_default();
    let mut signalled: Vec<u64> = checkpoints.lines().filter_map(|l| l.trim().parse().ok()).collect();
    signalled.sort_unstable();
    assert_eq!(signalled, vec![quick, stubborn], "each job got its checkpoint signal once");
    for job in [quick, stubborn] {
        let doc = cluster.show(job);
        assert_eq!(doc["restarts"], 0, "a lease end is not the job's restart: {doc}");
        assert!(doc["reason"].as_str().is_some_and(|r| r.contains("lease")), "{doc}");
    }

    // At the lease end the node drains and leaves the pool; the jobs run on a new node.
    let drained = Instant::now() + Duration::from_secs(30);
    loop {
        let w = node(&cluster, "w1");
        if w["state"] == "drained" {
            assert!(w["reason"].as_str().is_some_and(|r| r.starts_with("lease ended at")), "{w}");
            break;
        }
        assert!(Instant::now() < drained, "w1 never drained: {w}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut w2 = WorkerProc::configure(dir.path(), "w2", &cluster.endpoints(), 2);
    w2.start();
    w2.wait_registered(&cluster);
    for job in [quick, stubborn] {
        cluster
            .wait_for(job, Duration::from_secs(30), "running on w2", |d| d["state"] == "running" && d["node"] == "w2");
    }

    // The invoice: each lease-ended run, and its credit in full.
    let invoice = cluster.json(&["billing", "invoice", "--tenant", "default"]);
    let entries = invoice["entries"].as_array().cloned().unwrap_or_default();
    for job in [quick, stubborn] {
        let run = entries
            .iter()
            .find(|e| e["kind"] == "charge" && e["job_id"] == job)
            .unwrap_or_else(|| panic!("run of {job}: {entries:?}"));
        assert_eq!(run["cause"], "lease-ended", "{entries:?}");
        let credit = entries
            .iter()
            .find(|e| e["kind"] == "credit" && e["credit_for"] == run["entry"])
            .unwrap_or_else(|| panic!("credit of {job}: {entries:?}"));
        assert_eq!(credit["amount_micros"].as_i64(), run["amount_micros"].as_i64().map(|a| -a), "{entries:?}");
    }
    cluster.corral_at(0, &["cancel", &quick.to_string()]);
    cluster.corral_at(0, &["cancel", &stubborn.to_string()]);
}

#[test]
fn a_leader_killed_as_the_lease_ends_neither_loses_the_requeue_nor_repeats_it() {
    let (mut cluster, dir) = setup_with(3);
    let mut w1 = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 1);
    w1.start();
    w1.wait_registered(&cluster);
    let marks = dir.path().join("checkpoints");
    let script = format!("trap 'echo $CORRAL_JOB_ID >> {}; exit 0' USR1; sleep 120 & wait", marks.display());
    let job = submit(&cluster, &["--signal", "USR1", "--", "sh", "-c", &script]);
    cluster.wait_for(job, Duration::from_secs(30), "running", |d| d["state"] == "running");
    std::thread::sleep(Duration::from_millis(500));

    // Stopped 4 s from now (lease end in 6 s, grace 2 s); the leader dies 100 ms before that.
    let set = cluster.json(&["node", "lease", "w1", "--until", "6s"]);
    assert!(set["lease_end"].is_string(), "{set}");
    std::thread::sleep(Duration::from_millis(3_900));
    let leader = cluster.leader();
    cluster.kill(leader);
    let requeued = cluster.wait_for(job, Duration::from_secs(30), "requeued by the next leader", |d| {
        d["state"] == "pending" && d["attempts"] == 1
    });
    assert_eq!(requeued["restarts"], 0, "{requeued}");
    cluster.restart(leader);
    let deadline = Instant::now() + Duration::from_secs(30);
    while node(&cluster, "w1")["state"] != "drained" {
        assert!(Instant::now() < deadline, "w1 never drained: {}", node(&cluster, "w1"));
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut w2 = WorkerProc::configure(dir.path(), "w2", &cluster.endpoints(), 1);
    w2.start();
    w2.wait_registered(&cluster);
    let moved = cluster.wait_for(job, Duration::from_secs(30), "running on w2", |d| d["state"] == "running");
    assert_eq!((moved["node"].as_str(), moved["attempts"].as_u64()), (Some("w2"), Some(2)), "{moved}");
    let checkpoints = std::fs::read_to_string(&marks).unwrap_or_default();
    assert_eq!(checkpoints.trim(), job.to_string(), "one checkpoint signal, once");
    let invoice = cluster.json(&["billing", "invoice", "--tenant", "default"]);
    let entries = invoice["entries"].as_array().cloned().unwrap_or_default();
    let ended: Vec<&Value> = entries.iter().filter(|e| e["kind"] == "charge" && e["cause"] == "lease-ended").collect();
    assert_eq!(ended.len(), 1, "one lease-ended run: {entries:?}");
    let credits = entries.iter().filter(|e| e["kind"] == "credit").count();
    assert_eq!(credits, 1, "credited once: {entries:?}");
    cluster.wait_converged();
    cluster.corral_at(0, &["cancel", &job.to_string()]);
}
