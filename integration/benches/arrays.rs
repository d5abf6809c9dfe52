//! Job arrays on a lone coordinator (no worker: every task stays pending): how much the
//! coordinator's RSS grows for `corral sbatch --array 0-999%1000` of a 1 MiB script, and how long
//! `corral show A_N` of the last task takes for arrays written as 20 000 and 100 000 single
//! indices (`#SBATCH --array=0,1,2,...`). Each figure is the median over fresh coordinators
//! (RSS) or over repeated calls (show: the gRPC call alone, and the whole `corral show` process).
//!
//! Run: `cargo build --release -p corral-cli && CORRAL_BIN=target/release/corral cargo bench -p
//! corral-integration --bench arrays`. Point `CORRAL_BIN` at another build to compare (the
//! bench speaks the public API and CLI only). `CORRAL_ARRAYS_RUNS` (default 3): coordinators
//! started per RSS figure; `CORRAL_ARRAYS_CALLS` (default 21): calls per show figure (fewer once
//! they take more than 20 s in all).

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::rss_mib;
use corral_types::JobRef;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median<T: PartialOrd + Copy>(mut values: Vec<T>) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).expect("comparable"));
    values[values.len() / 2]
}

/// RSS of coordinator 0 once it settled: the median of 5 readings 200 ms apart, after a second.
fn settled_rss(cluster: &Cluster) -> f64 {
    std::thread::sleep(Duration::from_secs(1));
    let pid = cluster.pid(0).expect("coordinator runs");
    median(
        (0..5)
            .map(|_| {
                std::thread::sleep(Duration::from_millis(200));
                rss_mib(pid)
            })
            .collect(),
    )
}

/// A one-coordinator cluster, initialized and leading.
fn lone_coordinator() -> Cluster {
    let cluster = Cluster::start(1, ClusterOptions::default());
    cluster.init_and_join_all();
    cluster.leader();
    cluster
}

/// `corral sbatch SCRIPT [ARGS]` on coordinator 0: the job id it printed.
fn sbatch(cluster: &Cluster, args: &[&str]) -> u64 {
    let mut all = vec!["sbatch"];
    all.extend(args);
    let out = cluster.corral_at(0, &all);
    assert!(out.status.success(), "sbatch: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("a job id")
}

/// A batch script of exactly `bytes` bytes: a shebang, comment lines, `exit 0`.
fn write_script(path: &Path, bytes: usize) {
    let (head, tail) = ("#!/bin/sh\n", "exit 0\n");
    let mut text = String::with_capacity(bytes);
    text.push_str(head);
    let line = format!("# {}\n", "x".repeat(125));
    while bytes - text.len() - tail.len() >= line.len() {
        text.push_str(&line);
    }
    match bytes - text.len() - tail.len() {
        0 => {}
        1 => text.push('\n'),
        left => text.push_str(&format!("#{}\n", "x".repeat(left - 2))),
    }
    text.push_str(tail);
    assert_eq!(text.len(), bytes);
    std::fs::write(path, text).expect("write script");
}

/// RSS growth of a coordinator for `corral sbatch --array 0-999%1000` of a 1 MiB script.
fn rss_of_a_big_array(runs: usize) {
    let (mut growths, mut after_snapshots, mut bodies) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..runs {
        let cluster = lone_coordinator();
        let script = cluster.dir().join("big.sh");
        write_script(&script, 1 << 20);
        let before = settled_rss(&cluster);
        let array = sbatch(&cluster, &["--array", "0-999%1000", script.to_str().expect("utf-8")]);
        let after = settled_rss(&cluster);
        let in_memory = cluster.status(0).map(|s| s["jobs_in_memory"].clone()).unwrap_or_default();
        // A snapshot still encodes each task's whole spec: the stored format's part of the cost.
        let out = cluster.corral_at(0, &["cluster", "snapshot"]);
        let snapshot = if out.status.success() { settled_rss(&cluster) } else { f64::NAN };
        let body = snapshot_bytes(&cluster.data_dir(0));
        println!(
            "run {run}: array {array}, {in_memory} jobs in memory: RSS {before:.0} -> {after:.0} MiB, +{:.1} MiB; \
             after a snapshot {snapshot:.0} MiB, snapshot files {:.0} MiB",
            after - before,
            body as f64 / (1 << 20) as f64
        );
        growths.push(after - before);
        after_snapshots.push(snapshot - before);
        bodies.push(body);
    }
    println!(
        "sbatch --array 0-999%1000 of a 1 MiB script: coordinator RSS +{:.1} MiB, +{:.1} MiB once a snapshot \
         was built, snapshot files {:.0} MiB (medians)",
        median(growths),
        median(after_snapshots),
        median(bodies) as f64 / (1 << 20) as f64
    );
}

/// Bytes of the snapshot files under a coordinator's data dir.
fn snapshot_bytes(data_dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(data_dir.join("snapshots")) else { return 0 };
    entries.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

/// `corral show A_N` of the last task of an array written as `n` single indices.
fn show_last_task(n: u32, calls: usize, rt: &tokio::runtime::Runtime) {
    let cluster = lone_coordinator();
    let indices: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    let script = cluster.dir().join("indices.sh");
    std::fs::write(&script, format!("#!/bin/sh\n#SBATCH --array={}\nexit 0\n", indices.join(","))).expect("script");
    let array = sbatch(&cluster, &[script.to_str().expect("utf-8")]);
    let task = JobRef { id: array, task: Some(n - 1) };
    let client = Client::new(ClientConfig::new(vec![cluster.nodes[0].addr.clone()])).expect("client");
    let started = Instant::now();
    let mut rpc = Vec::new();
    let mut answer = String::new();
    while rpc.len() < calls && (rpc.len() < 3 || started.elapsed() < Duration::from_secs(20)) {
        let t = Instant::now();
        let reply = rt.block_on(client.get_job_ref(task));
        rpc.push(t.elapsed());
        answer = match reply {
            Ok(job) => format!("{} {}", job.display_id(), job.state),
            Err(e) => e.to_string(),
        };
    }
    let started = Instant::now();
    let mut cli = Vec::new();
    while cli.len() < calls && (cli.len() < 3 || started.elapsed() < Duration::from_secs(20)) {
        let t = Instant::now();
        let out = Command::new(corral_integration::corral_bin())
            .args(["--endpoint", &cluster.nodes[0].addr, "show", &task.to_string()])
            .output()
            .expect("corral show");
        cli.push(t.elapsed());
        assert!(!out.stderr.is_empty() || out.status.success(), "corral show said nothing");
    }
    println!(
        "show {task} of an array of {n} single indices: {:.2} ms the call, {:.1} ms `corral show` (medians of {} and {}): {answer}",
        median(rpc.clone()).as_secs_f64() * 1e3,
        median(cli.clone()).as_secs_f64() * 1e3,
        rpc.len(),
        cli.len()
    );
}

fn main() {
    let runs = env("CORRAL_ARRAYS_RUNS", 3);
    let calls = env("CORRAL_ARRAYS_CALLS", 21);
    println!("binary: {}", corral_integration::corral_bin().display());
    rss_of_a_big_array(runs);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for n in [20_000, 100_000] {
        show_last_task(n, calls, &rt);
    }
}
