//! Job lifecycle benchmark: submit-to-done latency of a `true` job on an idle `corral dev` pool
//! (`corral submit` then `corral wait`, two CLI processes, as a user runs them), the drain rate of
//! 1000 one-GPU `true` jobs on 8 simulated GPUs, and how long a write waits after a leader
//! kill -9 that follows heavy load on a 3-node cluster (each kill on a healthy cluster: the
//! previous victim was restarted and has caught up).
//!
//! Run: `cargo build --release -p corral-cli && cargo bench -p corral-integration --bench lifecycle`
//! Knobs: `CORRAL_BENCH_ONLY=latency|drain|failover` runs one phase; `CORRAL_BENCH_SAMPLES`
//! (submit-to-done samples, default 50), `CORRAL_BENCH_DRAINS` (drain repetitions, default 3),
//! `CORRAL_BENCH_KILLS` (leader kills, default 100), `CORRAL_BENCH_LOAD_MS` (heavy load before
//! each kill, default 1000), `CORRAL_BENCH_POOL_LOG` (a file for the last drain pool's log).

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::DevPool;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn summary(samples: &mut [Duration]) -> String {
    samples.sort();
    format!(
        "median {:>8.1?}  p90 {:>8.1?}  min {:>8.1?}  max {:>8.1?}  (n={})",
        percentile(samples, 0.5),
        percentile(samples, 0.9),
        percentile(samples, 0.0),
        percentile(samples, 1.0),
        samples.len()
    )
}

/// `corral submit --gpus 1 -- true` then `corral wait ID`, timed from the first process start
/// to the second one's exit.
fn submit_to_done(pool: &DevPool) -> Duration {
    let bin = corral_integration::corral_bin();
    let started = Instant::now();
    let out = Command::new(&bin)
        .args(["--endpoint", &pool.addr, "submit", "--gpus", "1", "--", "true"])
        .output()
        .expect("corral submit");
    assert!(out.status.success(), "submit: {}", String::from_utf8_lossy(&out.stderr));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = Command::new(&bin).args(["--endpoint", &pool.addr, "wait", &id]).output().expect("corral wait");
    let elapsed = started.elapsed();
    assert!(out.status.success(), "job {id} did not succeed: {}", String::from_utf8_lossy(&out.stdout));
    elapsed
}

fn latency_phase() {
    let samples: usize = env_or("CORRAL_BENCH_SAMPLES", 50);
    let pool = DevPool::start(&["--gpus", "8"]);
    for _ in 0..3 {
        submit_to_done(&pool);
    }
    let mut all: Vec<Duration> = (0..samples)
        .map(|_| {
            let d = submit_to_done(&pool);
            // An idle pool between samples: the next job finds nothing in flight.
            std::thread::sleep(Duration::from_millis(100));
            d
        })
        .collect();
    println!("submit-to-done of `true`, idle corral dev (submit + wait CLI): {}", summary(&mut all));
}

/// Submits `jobs` one-GPU `true` jobs in one batch and waits until none is live; jobs/s.
/// One drain; returns its rate and the pool's data dir, which the caller deletes after the last
/// run: on an ext4 without a journal, new inodes skip those deleted in the last half minute, so
/// deleting one run's thousands of job dirs would slow the next run's launches.
fn drain_once(rt: &tokio::runtime::Runtime, jobs: usize) -> (f64, Option<tempfile::TempDir>) {
    let mut pool = DevPool::start(&["--gpus", "8"]);
    let client = Client::new(ClientConfig::new(vec![pool.addr.clone()])).expect("client");
    let specs: Vec<(String, corral_types::JobSpec)> = (0..jobs)
        .map(|i| {
            let mut spec = corral_integration::trivial_job(&format!("drain-{i}"));
            spec.gpus = 1;
            (format!("drain-{}-{i}", std::process::id()), spec)
        })
        .collect();
    rt.block_on(async {
        let started = Instant::now();
        let results = client.submit_batch(&specs).await.expect("batch submit");
        let ids: Vec<u64> = results.into_iter().map(|r| r.expect("a drain job was refused").job_id).collect();
        // Follow each job's server-side watch in submit order (they end roughly in that order):
        // no polling of a thousand-job listing competes with the drain.
        for id in ids {
            let wait = tokio::time::timeout(Duration::from_secs(600), client.wait_job(id, |_| {}));
            wait.await.expect("the queue did not drain in 10 minutes").expect("wait");
        }
        let elapsed = started.elapsed();
        let all = client.list_jobs(true, None).await.expect("list jobs");
        let failed = all.iter().filter(|j| j.state != corral_types::JobState::Succeeded).count();
        assert_eq!(failed, 0, "{failed} drain jobs did not succeed");
        if let Ok(path) = std::env::var("CORRAL_BENCH_POOL_LOG") {
            std::fs::write(&path, pool.logs()).expect("write the pool's log");
        }
        (jobs as f64 / elapsed.as_secs_f64(), pool.take_dir())
    })
}

fn drain_phase(rt: &tokio::runtime::Runtime) {
    let runs: usize = env_or("CORRAL_BENCH_DRAINS", 3);
    let mut kept = Vec::new();
    let mut rates: Vec<f64> = (0..runs)
        .map(|i| {
            let (rate, dir) = drain_once(rt, 1000);
            eprintln!("drain {i}: {rate:.0} jobs/s");
            kept.push(dir);
            rate
        })
        .collect();
    drop(kept);
    rates.sort_by(f64::total_cmp);
    println!(
        "drain of 1000 one-GPU `true` jobs on 8 simulated GPUs: median {:.0} jobs/s  min {:.0}  max {:.0}  (n={runs})",
        rates[rates.len() / 2],
        rates[0],
        rates[rates.len() - 1]
    );
}

/// Batch submitters that run until stopped: the heavy load before each kill.
fn heavy_load(
    rt: &tokio::runtime::Runtime,
    endpoints: &str,
    callers: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    (0..callers)
        .map(|_| {
            let mut config = ClientConfig::new(endpoints.split(',').map(String::from).collect());
            config.retry_for = Duration::from_secs(1);
            let client = Client::new(config).expect("client");
            let stop = stop.clone();
            rt.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let jobs: Vec<(String, corral_types::JobSpec)> = (0..2000)
                        .map(|_| {
                            let n = NEXT.fetch_add(1, Ordering::Relaxed);
                            (format!("load-{}-{n}", std::process::id()), corral_integration::trivial_job("load"))
                        })
                        .collect();
                    // Failures during the kill are expected: the load only has to be heavy.
                    let _ = client.submit_batch(&jobs).await;
                }
            })
        })
        .collect()
}

fn failover_phase(rt: &tokio::runtime::Runtime) {
    let kills: usize = env_or("CORRAL_BENCH_KILLS", 100);
    let load_ms: u64 = env_or("CORRAL_BENCH_LOAD_MS", 1000);
    // CORRAL_BENCH_ELECTION_MS=MIN-MAX tries other election timeouts than the default 150-300.
    let mut options = ClusterOptions::default();
    if let Ok(range) = std::env::var("CORRAL_BENCH_ELECTION_MS") {
        let (min, max) = range.split_once('-').expect("CORRAL_BENCH_ELECTION_MS=MIN-MAX");
        options.election_timeout_ms = (min.parse().expect("min ms"), max.parse().expect("max ms"));
    }
    let mut cluster = Cluster::start(3, options);
    cluster.init_and_join_all();
    let endpoints = cluster.endpoints();
    let probe = {
        let mut config = ClientConfig::new(endpoints.split(',').map(String::from).collect());
        config.retry_for = Duration::from_secs(120);
        Client::new(config).expect("client")
    };
    let mut waits = Vec::new();
    let mut catch_ups = Vec::new();
    for round in 0..kills {
        let stop = Arc::new(AtomicBool::new(false));
        let load = heavy_load(rt, &endpoints, 4, stop.clone());
        std::thread::sleep(Duration::from_millis(load_ms));
        let leader = cluster.leader();
        let before: Vec<String> = (0..3)
            .map(|i| {
                cluster.status(i).map_or("-".into(), |s| format!("{}/{}", s["applied_index"], s["committed_index"]))
            })
            .collect();
        let started = Instant::now();
        let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        eprintln!("round {round}: killing node {} at {at:.3}", leader + 1);
        cluster.kill(leader);
        let rid = format!("failover-{}-{round}", std::process::id());
        let wrote = rt.block_on(probe.submit_with_id(&rid, &corral_integration::trivial_job("probe")));
        let waited = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        for task in load {
            let _ = rt.block_on(task);
        }
        if let Err(e) = wrote {
            eprintln!("round {round}: no write within {waited:?}: {e}");
        } else if waited > Duration::from_secs(2) {
            eprintln!(
                "round {round}: killed node {}, first write after {waited:?} (applied/committed before: {before:?})",
                leader + 1
            );
            // CORRAL_BENCH_CLUSTER_LOGS=DIR keeps the survivors' logs of each slow round.
            if let Ok(dir) = std::env::var("CORRAL_BENCH_CLUSTER_LOGS") {
                std::fs::create_dir_all(&dir).expect("log dir");
                for i in (0..3).filter(|i| *i != leader) {
                    let path = std::path::Path::new(&dir).join(format!("round-{round}-node-{}.log", i + 1));
                    std::fs::write(path, cluster.log_of(i)).expect("write log");
                }
            }
        }
        waits.push(waited);
        cluster.restart(leader);
        // The next kill hits a healthy cluster: the restarted node has caught up. (Killing a
        // leader while the previous victim still replays is a second failure: the write then
        // waits for that node's catch-up, whatever the election does.)
        catch_ups.push(caught_up(&cluster, leader));
    }
    let slow = waits.iter().filter(|w| **w > Duration::from_secs(2)).count();
    println!(
        "write after a leader kill -9 following {load_ms} ms of batch load: {}  over 2 s: {slow}",
        summary(&mut waits)
    );
    println!("catch-up of the restarted node before the next round: {}", summary(&mut catch_ups));
}

/// Waits until node `index` has applied what the leader had committed when it came back; how
/// long that took.
fn caught_up(cluster: &Cluster, index: usize) -> Duration {
    let started = Instant::now();
    let leader = cluster.leader();
    let target = cluster.status(leader).and_then(|s| s["committed_index"].as_u64()).unwrap_or(0);
    while cluster.status(index).and_then(|s| s["applied_index"].as_u64()).unwrap_or(0) < target {
        assert!(started.elapsed() < Duration::from_secs(120), "node {index} did not catch up in 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    started.elapsed()
}

fn main() {
    let only = std::env::var("CORRAL_BENCH_ONLY").unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    if only.is_empty() || only == "latency" {
        latency_phase();
    }
    if only.is_empty() || only == "drain" {
        drain_phase(&rt);
    }
    if only.is_empty() || only == "failover" {
        failover_phase(&rt);
    }
}
