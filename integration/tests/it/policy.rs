//! Cluster policy as a file on real processes: applied to a running 3-coordinator cluster it
//! changes quota enforcement at once and survives a leader's death; a price change in the middle
//! of a run bills it in two pieces; bad policies are refused with one line and change nothing.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::worker::WorkerProc;
use corral_integration::{one_line_stderr, DevPool};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The repository's example policies.
fn example(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster-configs").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write policy");
    path
}

/// A policy with one tenant `team-a` of `quota` GPUs and the dev classes.
fn quota_policy(quota: u32) -> String {
    format!(
        "[tenants.team-a]\nquota-gpus = {quota}\n\n[classes.normal]\nvalue = 1000\ndefault = true\n\n\
         [prices]\n\"RTX 5090\" = 0.89\n"
    )
}

fn submit(cluster: &Cluster, args: &[&str]) -> u64 {
    let mut all = vec!["submit"];
    all.extend_from_slice(args);
    cluster.json(&all)["id"].as_u64().expect("job id")
}

#[test]
fn a_policy_applied_to_a_running_cluster_changes_quotas_at_once_and_survives_the_leader() {
    let cluster = Cluster::start(3, ClusterOptions::default());
    cluster.init_and_join_all();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 8);
    worker.start();
    worker.wait_registered(&cluster);
    assert_eq!(cluster.json(&["admin", "show"])["version"], 1, "init installs the first policy");

    let two = write(dir.path(), "two.toml", &quota_policy(2));
    let applied = cluster.json(&["admin", "apply", "-f", two.to_str().unwrap()]);
    assert_eq!(applied["version"], 2, "{applied}");
    assert!(
        applied["changes"].as_array().unwrap().iter().any(|c| c == "tenant team-a: quota-gpus 4 -> 2"),
        "{applied}"
    );

    let jobs: Vec<u64> =
        (0..3).map(|_| submit(&cluster, &["--tenant", "team-a", "--gpus", "1", "--", "sleep", "60"])).collect();
    for job in &jobs[..2] {
        cluster.wait_for(*job, Duration::from_secs(30), "running", |d| d["state"] == "running");
    }
    let third = cluster.wait_for(jobs[2], Duration::from_secs(30), "held by the quota", |d| {
        d["state"] == "pending" && d["reason"].as_str().unwrap_or_default().contains("quota")
    });
    assert!(third["reason"].as_str().unwrap().contains("2 gpus"), "{third}");

    // A bigger quota lets it start, without any restart.
    let four = write(dir.path(), "four.toml", &quota_policy(4));
    let diff = cluster.json(&["admin", "diff", "-f", four.to_str().unwrap()]);
    assert_eq!(diff["changes"], serde_json::json!(["tenant team-a: quota-gpus 2 -> 4"]), "{diff}");
    assert_eq!(cluster.json(&["admin", "show"])["version"], 2, "diff changes nothing");
    cluster.json(&["admin", "apply", "-f", four.to_str().unwrap()]);
    cluster.wait_for(jobs[2], Duration::from_secs(30), "running", |d| d["state"] == "running");

    // Removing the tenant of running jobs needs --force, which cancels them.
    let without = write(dir.path(), "without.toml", &quota_policy(4).replace("team-a", "team-z"));
    let refused = cluster.corral_at(cluster.leader(), &["admin", "apply", "-f", without.to_str().unwrap()]);
    assert!(!refused.status.success());
    let message = one_line_stderr(&refused);
    assert!(message.contains("0 pending and 3 running job(s)") && message.contains("--force"), "{message}");
    assert_eq!(cluster.json(&["admin", "show"])["version"], 3, "the refused policy changed nothing");

    // The leader dies: the next one serves the same policy and history.
    let leader = cluster.leader();
    let mut cluster = cluster;
    cluster.kill(leader);
    let shown = cluster.json(&["admin", "show"]);
    assert_eq!(shown["version"], 3, "{shown}");
    assert!(shown["toml"].as_str().unwrap().contains("quota-gpus = 4"), "{shown}");
    let history = cluster.json(&["admin", "history"]);
    let versions: Vec<u64> = history.as_array().unwrap().iter().map(|h| h["version"].as_u64().unwrap()).collect();
    assert_eq!(versions, vec![1, 2, 3]);
    assert_eq!(history[0]["by"], "cluster init");
    let forced = cluster.json(&["admin", "apply", "-f", without.to_str().unwrap(), "--force"]);
    assert_eq!(forced["version"], 4);
    assert_eq!(forced["cancelled"].as_array().unwrap().len(), 3, "{forced}");
    for job in &jobs {
        let doc = cluster.wait_for(*job, Duration::from_secs(30), "cancelled", |d| d["state"] == "cancelled");
        assert!(doc["reason"].as_str().unwrap().contains("by policy version 4"), "{doc}");
    }
}

#[test]
fn a_price_change_in_the_middle_of_a_run_bills_two_pieces() {
    let pool = DevPool::start(&["--gpus", "2"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let job = pool.submit(&["--gpus", "1", "--", "sleep", "2"]);
    pool.wait_for(job, "started", |d| d["state"] == "running" && d["started_ts"].is_u64());
    std::thread::sleep(Duration::from_millis(700));
    let dearer = write(dir.path(), "dearer.toml", &example("dev-policy.toml").replace("0.89", "1.78"));
    let applied = pool.json(&["admin", "apply", "-f", dearer.to_str().unwrap()]);
    assert_eq!(applied["changes"], serde_json::json!(["prices: \"RTX 5090\" 0.89 -> 1.78"]), "{applied}");
    let done = pool.wait_for(job, "succeeded", |d| d["state"] == "succeeded");
    let worker_ms = done["worker_run_time_ms"].as_u64().expect("worker_run_time_ms");

    let report = pool.json(&["billing", "report", "--job", &job.to_string()]);
    let pieces = report["segments"].as_array().expect("segments");
    assert_eq!(pieces.len(), 2, "{report}");
    let field = |i: usize, k: &str| pieces[i][k].as_u64().unwrap();
    assert_eq!((field(0, "policy_version"), field(0, "price_micros_per_gpu_hour")), (1, 890_000), "{report}");
    assert_eq!((field(1, "policy_version"), field(1, "price_micros_per_gpu_hour")), (2, 1_780_000), "{report}");
    assert_eq!(pieces[0]["end"], pieces[1]["start"], "the pieces meet at the change");
    assert!(field(0, "duration_ms") >= 500 && field(1, "duration_ms") >= 500, "{report}");
    assert_eq!(field(0, "duration_ms") + field(1, "duration_ms"), worker_ms, "the pieces add up to the run");
    let cost = |i: usize, price: u128| (u128::from(field(i, "duration_ms")) * price / 3_600_000) as u64;
    assert_eq!(field(0, "cost_micros"), cost(0, 890_000));
    assert_eq!(field(1, "cost_micros"), cost(1, 1_780_000));
    assert_eq!(report["total_cost_micros"], field(0, "cost_micros") + field(1, "cost_micros"));
}

#[test]
fn bad_policies_get_one_line_and_change_nothing() {
    let pool = DevPool::start(&["--gpus", "1"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let before = pool.json(&["admin", "show"]);
    let dev = example("dev-policy.toml");
    let cases = [
        ("unknown-key.toml", dev.replace("cohort = \"dev\"\n", "cohort = \"dev\"\nquota-gpu = 3\n"), "quota-gpu"),
        ("negative.toml", dev.replace("quota-gpus = 4", "quota-gpus = -4"), "must not be negative"),
        ("no-default.toml", dev.replace("default = true\n", ""), "no default class"),
        ("no-model.toml", dev.replace("\"H200\"", "\"\""), "a price for no model"),
        ("not-toml.toml", "[tenants.a\n".to_string(), "line 1"),
    ];
    for (name, text, wanted) in cases {
        let path = write(dir.path(), name, &text);
        for verb in ["apply", "diff"] {
            let out = pool.corral(&["admin", verb, "-f", path.to_str().unwrap()]);
            assert!(!out.status.success(), "{name} was accepted");
            let message = one_line_stderr(&out);
            assert!(message.contains(wanted) && message.contains(name), "{name}: {message}");
        }
    }
    let missing = pool.corral(&["admin", "apply", "-f", "/nonexistent/policy.toml"]);
    assert!(one_line_stderr(&missing).contains("cannot read policy /nonexistent/policy.toml"));
    assert_eq!(pool.json(&["admin", "show"]), before, "no bad policy changed anything");
    assert_eq!(pool.json(&["admin", "history"]).as_array().unwrap().len(), 1);
    let init =
        pool.corral(&["cluster", "init", "--policy", write(dir.path(), "x.toml", &quota_policy(1)).to_str().unwrap()]);
    assert!(one_line_stderr(&init).contains("has a policy already"), "{}", one_line_stderr(&init));
}

#[test]
fn dev_runs_jobs_as_the_run_as_user() {
    let pool = DevPool::start(&["--gpus", "1", "--run-as", "nobody"]);
    let job = pool.submit(&["--", "id", "-un"]);
    pool.wait_for(job, "succeeded", |d| d["state"] == "succeeded");
    assert_eq!(pool.ok(&["logs", &job.to_string()]).trim(), "nobody");
    let out = corral_integration::corral_raw(&["dev", "--run-as", "no-such-user-here", "--listen", "127.0.0.1:0"]);
    assert!(one_line_stderr(&out).contains("no user 'no-such-user-here'"), "{}", one_line_stderr(&out));
}
