//! Scale benchmark: a 3-coordinator loopback cluster runs N jobs (no worker: rounds of 100k are
//! submitted through the batch RPC and ended by a bulk cancel, so that compaction moves them to
//! the on-disk history). Reports batch throughput, coordinator RSS as the history grows, then
//! with 100k pending on top: `corral jobs --limit 50`, `cluster status`, submit latency at 1k/s
//! offered while snapshots are built (with the 100k pending, and with the history only), how
//! long a follower stopped for E entries takes to catch up after its restart, and how long a new,
//! empty coordinator takes to join.
//!
//! Run: `cargo build --release -p corral-cli && CORRAL_BIN=target/release/corral cargo bench -p
//! corral-integration --bench scale`. `CORRAL_SCALE_JOBS` (default 100000), `CORRAL_SCALE_ENTRIES`
//! (entries the stopped follower misses, default 20000), `CORRAL_SCALE_SECS` (length of the
//! latency phases, default 20), `CORRAL_SCALE_REQUEST_ID_WINDOW` (default 24h),
//! `CORRAL_SCALE_SNAPSHOT_EVERY` (default 5000), `CORRAL_SCALE_WARM_SNAPSHOTS` (default 1: each
//! coordinator builds a snapshot before the latency phases; 0 leaves their first builds, which
//! write every request id, inside them). Phases the binary does not support (an older
//! build) are skipped; `CORRAL_SCALE_NO_HISTORY=1` leaves out the `[history]` config section
//! older builds refuse.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::rss_mib;
use corral_types::JobSpec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn client(endpoints: &str) -> Client {
    Client::new(ClientConfig::new(endpoints.split(',').map(String::from).collect())).expect("client")
}

fn spec() -> JobSpec {
    JobSpec { gpus: 1, ..corral_integration::trivial_job("scale") }
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn rid() -> String {
    format!("scale-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn rss_all(cluster: &Cluster) -> Vec<f64> {
    (0..cluster.nodes.len()).filter_map(|i| cluster.pid(i)).map(rss_mib).collect()
}

fn fmt_rss(rss: &[f64]) -> String {
    rss.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join("/")
}

fn status(cluster: &Cluster, index: usize) -> serde_json::Value {
    cluster.status(index).unwrap_or_default()
}

/// Submits `total` jobs in batches of 1000 from 4 callers; with `progress`, prints RSS at every
/// tenth.
async fn fill(cluster: &Cluster, total: u64, progress: bool) -> f64 {
    let endpoints = cluster.endpoints();
    let claimed = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    // When the last caller finished (µs after `started`): the rate is not rounded to the
    // progress loop's 200 ms ticks.
    let finished_us = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let callers: Vec<_> = (0..4)
        .map(|_| {
            let client = client(&endpoints);
            let (claimed, done, finished_us) = (claimed.clone(), done.clone(), finished_us.clone());
            tokio::spawn(async move {
                loop {
                    let first = claimed.fetch_add(1000, Ordering::Relaxed);
                    if first >= total {
                        finished_us.fetch_max(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                        return;
                    }
                    let n = (total - first).min(1000) as usize;
                    let jobs: Vec<(String, JobSpec)> = (0..n).map(|_| (rid(), spec())).collect();
                    // A leader change on this loaded machine can outlast the client's retries:
                    // retry the same request ids (a duplicate is answered with its first job).
                    let mut tries = 0;
                    let results = loop {
                        match client.submit_batch(&jobs).await {
                            Ok(results) => break results,
                            Err(e) if tries < 10 => {
                                tries += 1;
                                eprintln!("  batch failed ({e}); retrying");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                            }
                            Err(e) => panic!("batch: {e}"),
                        }
                    };
                    assert!(results.iter().all(|r| r.is_ok()), "a batch job was refused");
                    done.fetch_add(n as u64, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let mut next_report = total / 10;
    while !callers.iter().all(|c| c.is_finished()) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = done.load(Ordering::Relaxed).min(total);
        if progress && now >= next_report {
            println!(
                "  {now:>8} jobs in {:>6.1?}: coordinator RSS {} MiB",
                started.elapsed(),
                fmt_rss(&rss_all(cluster))
            );
            next_report += total / 10;
        }
    }
    for c in callers {
        c.await.expect("caller");
    }
    total as f64 / (finished_us.load(Ordering::Relaxed) as f64 / 1e6)
}

/// One submit every millisecond for `secs`; returns sorted latencies and how many snapshots the
/// leader built meanwhile.
async fn open_loop(cluster: &Cluster, secs: u64) -> (Vec<Duration>, u64) {
    let endpoints = cluster.endpoints();
    let leader = cluster.leader();
    let snap_before = status(cluster, leader)["snapshot_index"].as_u64().unwrap_or(0);
    let clients: Vec<Client> = (0..8).map(|_| client(&endpoints)).collect();
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    for i in 0..1000 * secs {
        ticker.tick().await;
        let client = clients[i as usize % clients.len()].clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            client.submit_with_id(&rid(), &spec()).await.map(|_| t.elapsed())
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        if let Ok(l) = t.await.expect("task") {
            lat.push(l);
        }
    }
    lat.sort();
    let snap_after = status(cluster, leader)["snapshot_index"].as_u64().unwrap_or(0);
    let per = cluster_snapshot_every();
    (lat, snap_after.saturating_sub(snap_before).div_ceil(per))
}

/// Entries between a coordinator's snapshots: 5000, so that several are built during each
/// 20 s of submits (CORRAL_SCALE_SNAPSHOT_EVERY sets another; a huge one shows the latency
/// without snapshot builds).
fn cluster_snapshot_every() -> u64 {
    env("CORRAL_SCALE_SNAPSHOT_EVERY", 5_000)
}

fn report_latency(what: &str, lat: &[Duration], snapshots: u64) {
    println!(
        "{what}: {} ok, p50 {:.2?} p99 {:.2?} max {:.2?} ({snapshots} snapshots built meanwhile)",
        lat.len(),
        percentile(lat, 0.5),
        percentile(lat, 0.99),
        lat.last().copied().unwrap_or_default()
    );
}

/// Median wall time of a CLI command (5 runs).
fn cli_median(cluster: &Cluster, args: &[&str]) -> Option<Duration> {
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let out = std::process::Command::new(corral_integration::corral_bin())
            .args(["--endpoint", &cluster.endpoints()])
            .args(args)
            .output()
            .expect("corral");
        if !out.status.success() {
            println!("  corral {args:?} not supported: {}", String::from_utf8_lossy(&out.stderr).trim());
            return None;
        }
        times.push(t.elapsed());
    }
    times.sort();
    Some(times[2])
}

/// Waits (at most 5 minutes) until the leader holds fewer than 1000 jobs in memory; returns how
/// many it holds.
fn wait_for_compaction(cluster: &Cluster, leader: usize) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let hot = status(cluster, leader)["jobs_in_memory"].as_u64();
        if hot.is_some_and(|n| n < 1000) || Instant::now() > deadline {
            return hot;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn main() {
    let jobs = env("CORRAL_SCALE_JOBS", 100_000);
    let entries = env("CORRAL_SCALE_ENTRIES", 20_000);
    let secs = env("CORRAL_SCALE_SECS", 20);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let options = ClusterOptions {
        snapshot_every: cluster_snapshot_every(),
        keep_logs_after_snapshot: 1_000,
        // Builds from before the history have no [history] section: CORRAL_SCALE_NO_HISTORY=1.
        extra_config: if std::env::var_os("CORRAL_SCALE_NO_HISTORY").is_some() {
            String::new()
        } else {
            // CORRAL_SCALE_REQUEST_ID_WINDOW (default 24h, as a coordinator's): a short one
            // shows what memory is left once request ids expire.
            format!(
                "\n[history]\narchive-after = \"5s\"\ncompact-every = \"1s\"\nrequest-id-window = \"{}\"\n",
                std::env::var("CORRAL_SCALE_REQUEST_ID_WINDOW").unwrap_or_else(|_| "24h".into())
            )
        },
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(3, options);
    cluster.init_and_join_all();
    let leader = cluster.leader();
    println!("3 coordinators on loopback, {jobs} jobs, binary {}", corral_integration::corral_bin().display());
    println!("empty cluster: coordinator RSS {} MiB", fmt_rss(&rss_all(&cluster)));
    let endpoints = cluster.endpoints();

    // A year of short jobs: rounds of 100k submitted by batch and ended by a bulk cancel; the
    // compaction moves each round to the history while the next one arrives.
    let round = jobs.min(100_000);
    let mut finished = 0;
    let mut rates = Vec::new();
    while finished < jobs {
        let n = round.min(jobs - finished);
        rates.push(rt.block_on(fill(&cluster, n, finished == 0)));
        let t = Instant::now();
        match rt.block_on(client(&endpoints).cancel_jobs(Default::default())) {
            Ok(_) => {}
            Err(e) => {
                println!("bulk cancel not supported ({e}): the jobs stay pending");
                finished += n;
                continue;
            }
        }
        let hot = wait_for_compaction(&cluster, leader);
        finished += n;
        println!(
            "{finished:>8} jobs finished: cancel + compaction {:>5.1?} ({hot:?} left in memory), coordinator RSS {} MiB",
            t.elapsed(),
            fmt_rss(&rss_all(&cluster))
        );
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "batch submit: median {:.0} jobs/s over {} rounds (4 callers x 1000-job batches, durable)",
        rates[rates.len() / 2],
        rates.len()
    );

    // Then 100k pending on top of the history.
    let pending = jobs.min(100_000);
    rt.block_on(fill(&cluster, pending, false));
    println!("{pending} pending and {finished} in the history: coordinator RSS {} MiB", fmt_rss(&rss_all(&cluster)));
    if let Some(t) = cli_median(&cluster, &["jobs", "--limit", "50"]) {
        println!("corral jobs --limit 50 with {pending} pending: median {t:.2?} (whole CLI process)");
    }
    if let Some(t) = cli_median(&cluster, &["cluster", "status"]) {
        println!("corral cluster status with {pending} pending: median {t:.2?}");
    }
    if env("CORRAL_SCALE_WARM_SNAPSHOTS", 1) == 1 {
        // A coordinator's first snapshot writes every request id applied since it started (all
        // 1.1M here: the fill's 1000-job entries never reached `snapshot-every`). Each builds it
        // now, so that the builds measured below are those a running cluster makes.
        let t = Instant::now();
        for node in &cluster.nodes {
            let out = std::process::Command::new(corral_integration::corral_bin())
                .args(["--endpoint", &node.addr, "cluster", "snapshot"])
                .output()
                .expect("corral");
            if !out.status.success() {
                println!("  corral cluster snapshot not supported: {}", String::from_utf8_lossy(&out.stderr).trim());
                break;
            }
        }
        println!("each coordinator built a snapshot first (cluster snapshot): {:.1?}", t.elapsed());
    }
    let (lat, snaps) = rt.block_on(open_loop(&cluster, secs));
    report_latency(&format!("submit at 1k/s for {secs}s with {pending} pending"), &lat, snaps);
    if rt.block_on(client(&endpoints).cancel_jobs(Default::default())).is_ok() {
        wait_for_compaction(&cluster, leader);
        let (lat, snaps) = rt.block_on(open_loop(&cluster, secs));
        report_latency(&format!("submit at 1k/s for {secs}s with the history only"), &lat, snaps);
        println!("after that: coordinator RSS {} MiB", fmt_rss(&rss_all(&cluster)));
    }

    // A follower misses `entries` entries (single submits, each its own entry), then restarts.
    let leader = cluster.leader();
    let follower = (leader + 1) % 3;
    cluster.stop(follower);
    let first = status(&cluster, leader)["last_log_index"].as_u64().unwrap_or(0);
    let endpoints = cluster.endpoints();
    rt.block_on(async {
        let c = client(&endpoints);
        loop {
            let last = status(&cluster, leader)["last_log_index"].as_u64().unwrap_or(0);
            if last >= first + entries {
                break;
            }
            // 8 callers, 250 submits each back to back: mostly one entry per submit.
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let c = c.clone();
                    tokio::spawn(async move {
                        for _ in 0..250 {
                            let _ = c.submit_with_id(&rid(), &spec()).await;
                        }
                    })
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
        }
    });
    let target = status(&cluster, leader)["last_log_index"].as_u64().unwrap_or(0);
    let t = Instant::now();
    cluster.restart(follower);
    loop {
        let applied = status(&cluster, follower)["applied_index"].as_u64().unwrap_or(0);
        if applied >= target {
            println!(
                "follower stopped for {} entries caught up {:.1?} after its restart (snapshot {:?})",
                target - first,
                t.elapsed(),
                status(&cluster, follower)["snapshot_index"].as_u64()
            );
            break;
        }
        if t.elapsed() > Duration::from_secs(300) {
            println!("follower did not catch up within 300s (applied {applied} of {target})");
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    // A new, empty coordinator joins: it gets the whole history in a snapshot, then is promoted.
    let leader = cluster.leader();
    let joining = cluster.add_node(4);
    let addr = cluster.nodes[joining].addr.clone();
    let t = Instant::now();
    let out = cluster.corral_at(leader, &["cluster", "join", &addr]);
    if out.status.success() {
        println!(
            "a new coordinator joined (caught up as learner, promoted) in {:.1?}: RSS {:.0} MiB",
            t.elapsed(),
            cluster.pid(joining).map_or(0.0, rss_mib)
        );
    } else {
        println!("the new coordinator did not join: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    println!("end: coordinator RSS {} MiB", fmt_rss(&rss_all(&cluster)));
    // What the snapshots cost on each coordinator, from their logs.
    for i in 0..cluster.nodes.len() {
        for line in cluster.log_of(i).lines().filter(|l| {
            l.contains("snapshot of the hot state written")
                || l.contains("with its history to send")
                || l.contains("installed snapshot")
                || l.contains("history written to the store")
        }) {
            println!("  coordinator {i}: {}", line.split_once("INFO").map_or(line, |(_, rest)| rest).trim());
        }
    }
}
