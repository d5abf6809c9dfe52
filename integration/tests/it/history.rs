//! Finished jobs leave the coordinators' memory for the on-disk history: they stay readable
//! (`show`, `jobs --all`, `wait`), dependencies on them are judged by their outcome, the history
//! travels in snapshots to a follower that was away, and it survives the leader.

use corral_integration::cluster::{Cluster, ClusterOptions};
use serde_json::Value;
use std::time::{Duration, Instant};

fn history_cluster() -> Cluster {
    let options = ClusterOptions {
        snapshot_every: 50,
        keep_logs_after_snapshot: 10,
        extra_config: "\n[history]\narchive-after = \"1s\"\ncompact-every = \"200ms\"\n".into(),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(3, options);
    cluster.init_and_join_all();
    cluster
}

fn submit(cluster: &Cluster, args: &[&str]) -> std::process::Output {
    let mut all = vec!["--endpoint".to_string(), cluster.endpoints(), "submit".to_string()];
    all.extend(args.iter().map(|a| a.to_string()));
    all.extend(["--".to_string(), "true".to_string()]);
    std::process::Command::new(corral_integration::corral_bin()).args(&all).output().expect("corral")
}

fn submit_ok(cluster: &Cluster, args: &[&str]) -> u64 {
    let out = submit(cluster, args);
    assert!(out.status.success(), "submit {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("a job id")
}

/// Waits until the leader holds at most `most` jobs in memory.
fn wait_for_compaction(cluster: &Cluster, most: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = cluster.status(cluster.leader()).expect("status");
        if status["jobs_in_memory"].as_u64().is_some_and(|n| n <= most) {
            return;
        }
        assert!(Instant::now() < deadline, "finished jobs never left memory: {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn finished_jobs_move_to_the_history_and_stay_readable_across_snapshots_and_failover() {
    let mut cluster = history_cluster();
    let leader = cluster.leader();
    let away = (leader + 1) % 3;
    let away_last = cluster.status(away).expect("status")["last_log_index"].as_u64().expect("index");
    cluster.stop(away);

    // No worker: the jobs wait, and a cancel ends them.
    let ids: Vec<u64> = (0..30).map(|i| submit_ok(&cluster, &["--name", &format!("h{i}")])).collect();
    for id in &ids {
        cluster.json(&["cancel", &id.to_string()]);
    }
    wait_for_compaction(&cluster, 0);

    // Still readable from the history.
    let first = cluster.show(ids[0]);
    assert_eq!((first["state"].as_str(), first["name"].as_str()), (Some("cancelled"), Some("h0")), "{first}");
    let all = cluster.json(&["jobs", "--all"]);
    let listed: Vec<u64> = all.as_array().expect("array").iter().filter_map(|j| j["id"].as_u64()).collect();
    assert_eq!(listed, ids, "jobs --all lists the history in id order");
    let waited = std::process::Command::new(corral_integration::corral_bin())
        .args(["--endpoint", &cluster.endpoints(), "wait", &ids[1].to_string(), "--timeout", "10s"])
        .output()
        .expect("corral wait");
    assert_eq!(waited.status.code(), Some(1), "wait on a cancelled job in the history ends at once, not ok");
    // Cancelling it again changes nothing and says what it is.
    let again = cluster.json(&["cancel", &ids[2].to_string()]);
    assert_eq!(again["state"], "cancelled", "{again}");

    // Dependencies on jobs in the history are judged by their outcome.
    let refused = submit(&cluster, &["--dependency", &format!("afterok:{}", ids[3])]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("can never be met") && stderr.contains("cancelled"), "{stderr}");
    let after_any = submit_ok(&cluster, &["--dependency", &format!("afterany:{}", ids[3])]);
    let job = cluster.show(after_any);
    assert_eq!(job["state"], "pending", "{job}");
    let reason = job["reason"].as_str().unwrap_or_default();
    assert!(!reason.contains("dependency"), "a met dependency does not hold the job: {job}");
    let unknown = submit(&cluster, &["--dependency", "afterok:999999"]);
    assert!(!unknown.status.success(), "a dependency on an unknown job is refused");

    // The follower that was away catches up through a snapshot carrying the history.
    // Compactions keep adding entries: wait until the leader purged what the follower lacks.
    let deadline = Instant::now() + Duration::from_secs(60);
    while cluster.status(leader).expect("status")["purged_index"].as_u64().unwrap_or(0) <= away_last + 20 {
        assert!(Instant::now() < deadline, "the leader never purged its log past the follower's");
        submit_ok(&cluster, &["--name", "filler"]);
    }
    cluster.restart(away);
    let digest = cluster.wait_converged();
    assert!(!digest.is_empty());
    let caught_up = cluster.status(away).expect("status");
    assert!(
        caught_up["snapshot_index"].as_u64().is_some_and(|i| i > away_last + 20),
        "it installed a snapshot: {caught_up}"
    );

    // The history survives the leader.
    cluster.kill(leader);
    let new_leader = cluster.leader();
    assert_ne!(new_leader, leader);
    let job: Value = cluster.show(ids[29]);
    assert_eq!((job["state"].as_str(), job["name"].as_str()), (Some("cancelled"), Some("h29")), "{job}");
    let segments = cluster.json(&["billing", "report", "--format", "json"]);
    assert!(segments.is_array() || segments.is_object(), "billing report answers: {segments}");
}
