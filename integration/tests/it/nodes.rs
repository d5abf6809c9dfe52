//! Node lifecycle on real processes: a drain with a deadline sends a running job its checkpoint
//! signal and requeues it onto the other worker; cordon and resume; removal of an empty node;
//! labels from the worker config; bad node names.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::one_line_stderr;
use corral_integration::worker::WorkerProc;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

fn node<'a>(nodes: &'a Value, name: &str) -> &'a Value {
    nodes.as_array().and_then(|n| n.iter().find(|n| n["name"] == name)).unwrap_or_else(|| panic!("{name}: {nodes}"))
}

fn wait_node_state(cluster: &Cluster, name: &str, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let nodes = cluster.json(&["nodes"]);
        if node(&nodes, name)["state"] == state {
            return nodes;
        }
        assert!(Instant::now() < deadline, "{name} never became {state}: {nodes}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_drain_with_a_deadline_checkpoints_and_requeues_a_running_job_onto_another_worker() {
    let cluster = Cluster::start(1, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", one_line_stderr(&init));
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut workers: Vec<WorkerProc> = ["w1", "w2"]
        .iter()
        .map(|name| {
            let w = WorkerProc::configure(dir.path(), name, &cluster.endpoints(), 2);
            w.edit_config(|c| format!("labels = {{ zone = \"{name}-zone\", gpu = \"5090\" }}\n{c}"));
            w
        })
        .collect();
    for w in &mut workers {
        w.start();
        w.wait_registered(&cluster);
    }
    let nodes = cluster.json(&["nodes"]);
    assert_eq!(node(&nodes, "w1")["labels"], serde_json::json!({"gpu": "5090", "zone": "w1-zone"}), "{nodes}");

    // The job records each checkpoint signal, then exits as a checkpointing job does.
    let marks = dir.path().join("checkpoints");
    let script = format!("trap 'echo $CORRAL_JOB_ID >> {}; exit 0' USR1; sleep 60 & wait", marks.display());
    let job = cluster.json(&["submit", "--gpus", "2", "--signal", "USR1", "--", "sh", "-c", &script])["id"]
        .as_u64()
        .expect("id");
    let first = cluster.wait_for(job, Duration::from_secs(30), "running", |d| d["state"] == "running");
    let first_node = first["node"].as_str().expect("node").to_string();
    let other = if first_node == "w1" { "w2" } else { "w1" };
    std::thread::sleep(Duration::from_millis(500));

    let drained = cluster.json(&["node", "drain", &first_node, "--reason", "disk swap", "--deadline", "2s"]);
    assert_eq!(drained["state"], "draining", "{drained}");
    assert!(drained["drain_deadline"].is_string(), "{drained}");
    let nodes = cluster.json(&["nodes"]);
    assert_eq!(
        (node(&nodes, &first_node)["state"].as_str(), node(&nodes, &first_node)["reason"].as_str()),
        (Some("draining"), Some("disk swap"))
    );
    assert_eq!(cluster.show(job)["state"], "running", "before the deadline the job runs on");

    let moved = cluster.wait_for(job, Duration::from_secs(30), "running on the other node", |d| {
        d["state"] == "running" && d["node"] == other
    });
    assert_eq!(moved["attempts"], 2, "{moved}");
    let checkpoints = std::fs::read_to_string(&marks).unwrap_or_default();
    assert_eq!(checkpoints.trim(), job.to_string(), "the job got its checkpoint signal once before the requeue");
    wait_node_state(&cluster, &first_node, "drained");

    // A cordoned node keeps its job; nothing new starts while every node takes no jobs.
    let cordoned = cluster.json(&["node", "cordon", other, "--reason", "firmware"]);
    assert_eq!(cordoned["state"], "cordoned");
    let waiting = cluster.json(&["submit", "--gpus", "1", "--", "true"])["id"].as_u64().expect("id");
    let pending = cluster.wait_for(waiting, Duration::from_secs(10), "held", |d| {
        d["state"] == "pending" && d["reason"].as_str().is_some_and(|r| r.contains("no node is up and taking jobs"))
    });
    assert_eq!(pending["state"], "pending");
    assert_eq!(cluster.show(job)["state"], "running", "cordon keeps running jobs");
    cluster.json(&["node", "resume", &first_node]);
    cluster.wait_for(waiting, Duration::from_secs(30), "succeeded on the resumed node", |d| {
        d["state"] == "succeeded" && d["node"] == first_node.as_str()
    });

    // Removal: refused for a node that takes jobs, and for one that still holds a job.
    let busy = cluster.corral_at(0, &["node", "remove", other]);
    assert!(one_line_stderr(&busy).contains("still holds 1 job(s)"), "{}", one_line_stderr(&busy));
    let active = cluster.corral_at(0, &["node", "remove", &first_node]);
    assert!(one_line_stderr(&active).contains("up and takes jobs"), "{}", one_line_stderr(&active));
    // Drained and its worker stopped: it goes, and its GPUs leave the pool.
    cluster.json(&["node", "drain", &first_node]);
    workers.iter_mut().find(|w| w.name == first_node).expect("worker").kill();
    let removed = cluster.json(&["node", "remove", &first_node]);
    assert_eq!(removed["gpus"], 2);
    let nodes = cluster.json(&["nodes"]);
    assert_eq!(nodes.as_array().map(Vec::len), Some(1), "{nodes}");
    let too_big = cluster.corral_at(0, &["submit", "--gpus", "3", "--", "true"]);
    assert!(one_line_stderr(&too_big).contains("largest node has 2"), "{}", one_line_stderr(&too_big));

    for args in [["node", "drain", "ghost"], ["node", "cordon", "ghost"], ["node", "remove", "ghost"]] {
        let out = cluster.corral_at(0, &args);
        assert!(!out.status.success());
        assert!(
            one_line_stderr(&out).contains("node 'ghost' is not registered"),
            "{args:?}: {}",
            one_line_stderr(&out)
        );
    }
    cluster.json(&["cancel", &job.to_string()]);
}
