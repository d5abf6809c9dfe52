//! Whose fault: a real worker with simulated GPUs, faults injected through its faults file. A
//! card fault (XID 79) on a running job's GPU ends the run with cause `gpu-fault`, requeues it
//! onto a healthy GPU without counting a restart, credits it on the invoice, and holds the GPU
//! out of placement (`corral nodes` says why) until it has checked clean for `recover-after`.
//! The job's own error (XID 13) is its business: the GPU stays in the pool, no credit.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::worker::WorkerProc;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// One coordinator crediting `gpu-fault` in full, and a worker with 2 simulated GPUs whose card
/// faults clear after `recover-after` of clean checks.
fn setup(recover_after: &str) -> (Cluster, WorkerProc, tempfile::TempDir) {
    let cluster = Cluster::start(1, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let policy = dir.path().join("credits.toml");
    let dev = include_str!("../../../cluster-configs/dev-policy.toml");
    std::fs::write(&policy, format!("{dev}\n[billing.credits]\ngpu-fault = 1.0\n")).expect("write");
    cluster.json(&["admin", "apply", "-f", policy.to_str().expect("utf-8")]);
    let mut worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 2);
    worker.append_config(&format!("\n[health]\nrecover-after = \"{recover_after}\"\n"));
    worker.start();
    worker.wait_registered(&cluster);
    (cluster, worker, dir)
}

/// Writes the worker's faults file atomically.
fn inject(worker: &WorkerProc, text: &str) {
    let path = worker.data_dir.join("faults.toml");
    let tmp = worker.data_dir.join("faults.toml.tmp");
    std::fs::write(&tmp, text).expect("write faults");
    std::fs::rename(&tmp, &path).expect("rename faults");
}

/// The GPU `index` of the only node, as `corral nodes --output json` shows it.
fn gpu(cluster: &Cluster, index: u64) -> Value {
    let nodes = cluster.json(&["nodes"]);
    let gpus = nodes[0]["gpus"].as_array().cloned().unwrap_or_default();
    gpus.into_iter().find(|g| g["index"] == index).unwrap_or_else(|| panic!("no gpu {index}: {nodes}"))
}

fn wait_gpu(cluster: &Cluster, index: u64, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let g = gpu(cluster, index);
        if pred(&g) {
            return g;
        }
        assert!(Instant::now() < deadline, "gpu {index} never became {what}: {g}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A job that runs until `stop` exists, then exits 3 (its own failure).
fn submit_until(cluster: &Cluster, stop: &Path) -> u64 {
    let script = format!("while [ ! -e {} ]; do sleep 0.05; done; exit 3", stop.display());
    let doc = cluster.json(&["submit", "--gpus", "1", "--", "sh", "-c", &script]);
    doc["id"].as_u64().expect("job id")
}

fn invoice_entries(cluster: &Cluster) -> Vec<Value> {
    let invoice = cluster.json(&["billing", "invoice", "--tenant", "default"]);
    invoice["entries"].as_array().cloned().unwrap_or_default()
}

#[test]
fn a_card_fault_requeues_the_run_onto_a_healthy_gpu_credits_it_and_keeps_the_gpu_out() {
    let (cluster, worker, dir) = setup("6s");
    let job = submit_until(&cluster, &dir.path().join("stop"));
    let doc = cluster.wait_for(job, Duration::from_secs(60), "running", |d| d["state"] == "running");
    let faulted = doc["gpus"][0].as_u64().expect("gpu index");
    std::thread::sleep(Duration::from_millis(500));

    inject(&worker, &format!("[[gpu]]\nindex = {faulted}\nxid = [79]\n"));
    let doc = cluster
        .wait_for(job, Duration::from_secs(60), "running again", |d| d["state"] == "running" && d["attempts"] == 2);
    assert_ne!(doc["gpus"][0].as_u64(), Some(faulted), "placed on the healthy gpu: {doc}");
    assert_eq!(doc["restarts"], 0, "a card fault is not the job's restart: {doc}");

    let out = gpu(&cluster, faulted);
    assert_eq!(out["state"], "unhealthy", "{out}");
    let why = out["out_reason"].as_str().unwrap_or_default();
    assert!(why.contains("XID 79") && why.contains("fallen off the bus"), "{out}");
    let table = cluster.corral_at(0, &["nodes", "--output", "table"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains(&format!("gpu{faulted} unhealthy: card fault")), "{table}");

    let entries = invoice_entries(&cluster);
    let run = entries.iter().find(|e| e["kind"] == "charge" && e["job_id"] == job).expect("the faulted run");
    assert_eq!(run["cause"], "gpu-fault", "{entries:?}");
    let credit = entries.iter().find(|e| e["kind"] == "credit").expect("its credit");
    assert_eq!(credit["credit_for"], run["entry"], "{entries:?}");
    assert_eq!(credit["amount_micros"].as_i64(), run["amount_micros"].as_i64().map(|a| -a), "{entries:?}");

    // The card checks clean for recover-after (no new XID, still on the bus): it comes back.
    wait_gpu(&cluster, faulted, "back in the pool", |g| g["state"] == "idle" && g["out_reason"].is_null());
    std::fs::write(dir.path().join("stop"), "").expect("stop");
    cluster.wait_for(job, Duration::from_secs(60), "failed", |d| d["state"] == "failed");
}

#[test]
fn the_jobs_own_xid_leaves_the_gpu_in_the_pool_and_credits_nothing() {
    let (cluster, worker, dir) = setup("6s");
    let stop = dir.path().join("stop");
    let job = submit_until(&cluster, &stop);
    let doc = cluster.wait_for(job, Duration::from_secs(60), "running", |d| d["state"] == "running");
    let index = doc["gpus"][0].as_u64().expect("gpu index");

    inject(&worker, &format!("[[gpu]]\nindex = {index}\nxid = [13]\n"));
    // A few heartbeats later the run still runs on its GPU, which is not out.
    std::thread::sleep(Duration::from_secs(2));
    let doc = cluster.show(job);
    assert_eq!((doc["state"].as_str(), doc["attempts"].as_u64()), (Some("running"), Some(1)), "{doc}");
    let g = gpu(&cluster, index);
    assert_eq!(g["state"], "allocated", "{g}");
    assert!(g["out_reason"].is_null() && g["problems"].as_array().is_some_and(|p| p.is_empty()), "{g}");
    assert!(worker.log().contains("the job's own gpu error"), "the worker attributes it to the job");

    // The job then fails on its own: billed as its exit, not credited.
    std::fs::write(&stop, "").expect("stop");
    cluster.wait_for(job, Duration::from_secs(60), "failed", |d| d["state"] == "failed");
    let entries = invoice_entries(&cluster);
    assert_eq!(entries.len(), 1, "the run, no credit: {entries:?}");
    assert_eq!(entries[0]["cause"], "exited", "{entries:?}");
    assert_eq!(gpu(&cluster, index)["state"], "idle");
}
