//! The control loop of a coordinator cluster cannot be starved by clients: under the heaviest
//! legal client load — the largest listing pages, full batches of submits, `show` of a large
//! array, slow `WatchJobs` readers that never read — no worker's lease lapses and no running
//! job is stopped or requeued.

use corral_client::{Client, ClientConfig, JobQuery};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::worker::WorkerProc;
use corral_proto::v1 as pb;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the load lasts: several fence times of the worker (5 s by default).
const LOAD: Duration = Duration::from_secs(20);
/// Largest batch of one `SubmitBatch` and largest listing page the coordinator admits.
const MAX_BATCH: usize = 10_000;
const MAX_PAGE: u32 = 10_000;

fn client(endpoints: &str) -> Client {
    let mut config = ClientConfig::new(endpoints.split(',').map(String::from).collect());
    config.retry_for = Duration::from_secs(30);
    config.request_timeout = Duration::from_secs(60);
    Client::new(config).expect("client")
}

/// A held job: it stays pending, so listings and the state grow without a worker.
fn held(name: &str) -> corral_types::JobSpec {
    let mut spec = corral_integration::trivial_job(name);
    spec.sched.hold = true;
    spec
}

#[test]
fn the_heaviest_client_load_lapses_no_worker_lease_and_requeues_no_job() {
    let _alone = crate::alone();
    let cluster = Cluster::start(3, ClusterOptions::default());
    cluster.init_and_join_all();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 1);
    worker.start();
    worker.wait_registered(&cluster);
    let running = cluster.json(&["submit", "--gpus", "1", "--", "sleep", "600"])["id"].as_u64().expect("job id");
    cluster.wait_for(running, Duration::from_secs(30), "running", |d| d["state"] == "running");
    let array = cluster.json(&["submit", "--hold", "--array", "0-99999", "--", "true"])["id"].as_u64().expect("id");

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
    let endpoints = cluster.endpoints();
    // The state the listings walk: two full batches of held jobs.
    rt.block_on(async {
        let client = client(&endpoints);
        for b in 0..2 {
            let batch: Vec<_> = (0..MAX_BATCH).map(|i| (format!("seed-{b}-{i}"), held("seed"))).collect();
            client.submit_batch(&batch).await.expect("seed batch");
        }
    });

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let mut load = Vec::new();
    // Slow readers: watches of every job that are never read.
    let mut watches = Vec::new();
    for _ in 0..8 {
        let client = client(&endpoints);
        watches.push(rt.block_on(client.watch_jobs(pb::WatchJobsRequest::default())));
    }
    // The largest listing pages, in a loop.
    for _ in 0..8 {
        let (client, stop, served) = (client(&endpoints), stop.clone(), served.clone());
        load.push(rt.spawn(async move {
            let query = JobQuery { all: true, ..Default::default() };
            while !stop.load(Ordering::Relaxed) {
                if client.list_jobs_page(&query, "", MAX_PAGE).await.is_ok() {
                    served.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    // Full batches of submits.
    for c in 0..2 {
        let (client, stop, served) = (client(&endpoints), stop.clone(), served.clone());
        load.push(rt.spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<_> = (0..MAX_BATCH).map(|i| (format!("load-{c}-{n}-{i}"), held("load"))).collect();
                if client.submit_batch(&batch).await.is_ok() {
                    served.fetch_add(1, Ordering::Relaxed);
                }
                n += 1;
            }
        }));
    }
    // `show` of the large array and `status`, through the CLI, in a loop.
    let started = Instant::now();
    let mut shows = 0;
    while started.elapsed() < LOAD {
        let out = cluster.corral_at(0, &["show", &array.to_string()]);
        shows += usize::from(out.status.success());
        let _ = cluster.corral_at(1, &["cluster", "status"]);
    }
    stop.store(true, Ordering::Relaxed);
    for task in load {
        rt.block_on(task).expect("load task");
    }
    drop(watches);
    let served = served.load(Ordering::Relaxed);
    assert!(served > 0 && shows > 0, "the load was never served: {served} listings or batches, {shows} shows");

    let doc = cluster.show(running);
    assert_eq!(doc["state"], "running", "the running job was stopped under client load: {doc}");
    assert_eq!(doc["attempts"], 1, "the running job was requeued under client load: {doc}");
    let nodes = cluster.json(&["nodes"]);
    assert_eq!(nodes[0]["state"], "up", "{nodes}");
    let log = worker.log();
    assert!(!log.contains("no leader answered within the fence time"), "the worker's lease lapsed:\n{log}");
    assert!(!log.contains("stopping every job"), "the worker stopped its jobs:\n{log}");
}
