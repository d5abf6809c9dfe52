//! `corral dev --nodes N --node-labels ... --mig`: several simulated workers with partitions
//! and labels, MIG-capable GPUs; without `--mig` no MIG job is taken, whatever the model.

use corral_integration::DevPool;

/// Two nodes, the first in two partitions: a gang spans both, a MIG job gets an instance, a
/// `--partition` job goes where its partition is, and `corral nodes` lists every partition.
#[test]
fn a_dev_pool_of_two_mig_nodes_runs_gangs_mig_and_partition_jobs() {
    let pool = DevPool::start(&[
        "--nodes",
        "2",
        "--gpus",
        "4",
        "--mig",
        "--node-labels",
        "partition=train,partition=infer,zone=a",
    ]);
    let nodes = pool.json(&["nodes"]);
    let names: Vec<&str> = nodes.as_array().expect("nodes").iter().filter_map(|n| n["name"].as_str()).collect();
    assert_eq!(names, ["dev-node", "dev-node-2"]);
    assert_eq!(nodes[0]["partitions"], serde_json::json!(["train", "infer"]), "{nodes}");
    assert_eq!(nodes[0]["labels"]["zone"], "a");
    assert!(nodes.as_array().unwrap().iter().all(|n| n["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .all(|g| g["mig_capable"] == true)));
    let table = pool.ok(&["nodes"]);
    assert!(table.contains("partition=train,infer,zone=a"), "every partition in the table: {table}");

    let gang =
        pool.submit(&["--gpus", "8", "--gpus-per-node", "4", "--", "sh", "-c", "echo rank $NODE_RANK of $NNODES"]);
    let doc = pool.wait_for(gang, "succeeded", |d| d["state"] == "succeeded" || d["state"] == "failed");
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let parts: Vec<&str> = doc["parts"].as_array().expect("parts").iter().filter_map(|p| p["node"].as_str()).collect();
    assert_eq!(parts.len(), 2, "one part on each node: {doc}");

    let mig = pool.submit(&["--gpu-slice", "mig:1g.10gb", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]);
    let doc = pool.wait_for(mig, "ended", |d| d["state"] == "succeeded" || d["state"] == "failed");
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert!(pool.ok(&["logs", &mig.to_string()]).trim().starts_with("MIG-"), "a MIG device is visible");

    for (partition, extra) in [("infer", None), ("train", Some("zone=a"))] {
        let mut args = vec!["--partition", partition];
        if let Some(c) = extra {
            args.extend(["--constraint", c]);
        }
        args.extend(["--", "true"]);
        let job = pool.submit(&args);
        let doc = pool.wait_for(job, "ended", |d| d["state"] == "succeeded" || d["state"] == "failed");
        assert_eq!((doc["state"].as_str(), doc["node"].as_str()), (Some("succeeded"), Some("dev-node")), "{doc}");
    }
}

/// A pool of H200s without `--mig`: its GPUs are not MIG-capable (the coordinator says what the
/// worker says, not what the model name suggests), so a MIG job is refused, saying why.
#[test]
fn without_mig_a_mig_job_is_not_placed_on_a_mig_model() {
    let pool = DevPool::start(&["--gpus", "2", "--gpu-model", "H200", "--gpu-memory", "141GiB"]);
    let nodes = pool.json(&["nodes"]);
    assert!(nodes[0]["gpus"].as_array().unwrap().iter().all(|g| g["mig_capable"] == false), "{nodes}");
    let out = pool.corral(&["submit", "--gpu-slice", "mig:1g.18gb", "--", "true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a MIG job admitted where no GPU can slice: {stderr}");
    assert!(stderr.contains("no registered gpu supports it"), "{stderr}");
}
