//! Cluster benchmark: durable submits/s on a 3-node loopback cluster with 1, 16 and 64 clients,
//! latency at 1k submits/s offered, batch submit throughput, and time from a leader kill -9 to
//! the first successful write.
//!
//! Run: `cargo build --release -p corral-cli && cargo bench -p corral-integration --bench cluster`
//! (set `CORRAL_BENCH_SECS` to change the length of each phase, default 5; `CORRAL_BENCH_TLS=1`
//! runs every connection, Raft and clients, over mutual TLS with the admin certificate;
//! `CORRAL_BENCH_ONLY_FAILOVER=1` measures only idle failover through the CLI: the time from a
//! leader kill -9 to the success of a `corral submit` started at once, over 10 kills).

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_types::JobSpec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spec() -> JobSpec {
    corral_integration::trivial_job("bench")
}

/// Mutual TLS of the clients, when the bench runs with `CORRAL_BENCH_TLS`.
static CLIENT_TLS: std::sync::OnceLock<corral_security::ClientTls> = std::sync::OnceLock::new();

fn client_config(endpoints: &str) -> ClientConfig {
    let mut config = ClientConfig::new(endpoints.split(',').map(String::from).collect());
    config.tls = CLIENT_TLS.get().cloned();
    config
}

fn client(endpoints: &str) -> Client {
    Client::new(client_config(endpoints)).expect("client")
}

/// Writes a dev CA and certificates for `nodes` coordinators under `dir` with `corral certs init`.
fn certs_init(dir: &std::path::Path, nodes: u64) {
    let out = std::process::Command::new(corral_integration::corral_bin())
        .args(["certs", "init", "--dir"])
        .arg(dir)
        .args(["--coordinators", &nodes.to_string()])
        .output()
        .expect("corral certs init");
    assert!(out.status.success(), "certs init: {}", String::from_utf8_lossy(&out.stderr));
    let files = corral_security::TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join("admin.pem"),
        key: dir.join("admin-key.pem"),
    };
    let tls = corral_security::ClientTls::load(&files).expect("client tls");
    CLIENT_TLS.set(tls).expect("set once");
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn rid() -> String {
    format!("bench-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Closed loop: `clients` callers submit back to back for `secs`.
async fn closed_loop(endpoints: &str, clients: usize, secs: u64) -> (f64, Vec<Duration>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let client = client(endpoints);
            tokio::spawn(async move {
                let mut lat = Vec::new();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    client.submit_with_id(&rid(), &spec()).await.expect("submit");
                    lat.push(t.elapsed());
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    all.sort();
    (all.len() as f64 / secs as f64, all)
}

/// Open loop: one submit every 1/rate seconds, whatever the latency.
async fn open_loop(endpoints: &str, rate: u64, secs: u64) -> (Vec<Duration>, usize) {
    let clients: Vec<Client> = (0..8).map(|_| client(endpoints)).collect();
    let mut ticker = tokio::time::interval(Duration::from_nanos(1_000_000_000 / rate));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    for i in 0..rate * secs {
        ticker.tick().await;
        let client = clients[i as usize % clients.len()].clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            client.submit_with_id(&rid(), &spec()).await.map(|_| t.elapsed())
        }));
    }
    let mut lat = Vec::new();
    let mut failed = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(l) => lat.push(l),
            Err(e) => {
                failed += 1;
                if failed == 1 {
                    eprintln!("first failed submit: {e}");
                }
            }
        }
    }
    lat.sort();
    (lat, failed)
}

/// Timestamps per second with `clients` callers each asking for `count` per call.
async fn timestamps(endpoints: &str, clients: usize, count: u32, secs: u64) -> (f64, Vec<Duration>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let client = client(endpoints);
            tokio::spawn(async move {
                let mut lat = Vec::new();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    client.timestamps(count).await.expect("timestamps");
                    lat.push(t.elapsed());
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    all.sort();
    (all.len() as f64 * f64::from(count) / secs as f64, all)
}

async fn batches(endpoints: &str, callers: usize, batch: usize, secs: u64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let done = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let client = client(endpoints);
            let done = done.clone();
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let jobs: Vec<(String, JobSpec)> = (0..batch).map(|_| (rid(), spec())).collect();
                    let results = client.submit_batch(&jobs).await.expect("batch");
                    assert!(results.iter().all(Result::is_ok));
                    done.fetch_add(batch as u64, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let started = Instant::now();
    for t in tasks {
        t.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Idle failover as a user sees it: `kills` times, the leader is killed with SIGKILL and a
/// `corral submit` (a new process, every endpoint given) is started at once; prints the median
/// and max time from the kill to its success.
fn idle_failover_through_cli(cluster: &mut Cluster, kills: usize) {
    let endpoints = cluster.endpoints();
    let mut failovers = Vec::new();
    for round in 0..kills {
        std::thread::sleep(Duration::from_millis(1000));
        let leader = cluster.leader();
        let started = Instant::now();
        cluster.kill(leader);
        let out = std::process::Command::new(corral_integration::corral_bin())
            .args(cluster.admin_tls_args())
            .args(["--endpoint", &endpoints, "submit", "--hold", "--", "true"])
            .output()
            .expect("corral");
        let took = started.elapsed();
        assert!(out.status.success(), "submit after failover: {}", String::from_utf8_lossy(&out.stderr));
        failovers.push(took);
        eprintln!("round {round}: killed node {} ({took:?} to a submit through the CLI)", leader + 1);
        cluster.restart(leader);
    }
    failovers.sort();
    println!(
        "idle leader kill -9 to a `corral submit` ({kills} kills): median {} ms  max {} ms",
        percentile(&failovers, 0.5).as_millis(),
        percentile(&failovers, 1.0).as_millis()
    );
}

fn main() {
    let secs: u64 = std::env::var("CORRAL_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let nodes: u64 = std::env::var("CORRAL_BENCH_NODES").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let certs = tempfile::tempdir().expect("tempdir");
    let mut options = ClusterOptions::default();
    if std::env::var("CORRAL_BENCH_TLS").is_ok() {
        certs_init(certs.path(), nodes);
        options.tls = Some(certs.path().to_path_buf());
    }
    let mut cluster = Cluster::start(nodes, options);
    cluster.init_and_join_all();
    let endpoints = cluster.endpoints();
    let transport = if CLIENT_TLS.get().is_some() { "mutual TLS" } else { "plaintext" };
    println!("{nodes}-node loopback cluster ({transport}), {secs}s per phase, fsync on every append");
    if std::env::var("CORRAL_BENCH_ONLY_LATENCY").is_ok() {
        let (lat, failed) = rt.block_on(open_loop(&endpoints, 1000, secs));
        println!(
            "1k submits/s offered:            p50 {:>7.2?}  p99 {:>7.2?}  max {:>7.2?}  failed {failed}",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            percentile(&lat, 1.0)
        );
        return;
    }
    if std::env::var("CORRAL_BENCH_ONLY_FAILOVER").is_ok() {
        idle_failover_through_cli(&mut cluster, 10);
        return;
    }
    if std::env::var("CORRAL_BENCH_ONLY_BATCH").is_ok() {
        let callers: usize = std::env::var("CORRAL_BENCH_BATCH_CALLERS").ok().and_then(|s| s.parse().ok()).unwrap_or(4);
        let rate = rt.block_on(batches(&endpoints, callers, 1000, secs));
        println!("batch submit ({callers} callers x 1000 jobs): {rate:>8.0} jobs/s");
        return;
    }
    if std::env::var("CORRAL_BENCH_ONLY_UNARY").is_ok() {
        rt.block_on(async {
            for clients in [1, 16, 64] {
                let (rate, _) = closed_loop(&endpoints, clients, secs).await;
                println!("unary submit, {clients:>2} clients: {rate:>8.0} submits/s");
            }
        });
        return;
    }
    rt.block_on(async {
        for clients in [1, 16, 64] {
            let (rate, lat) = closed_loop(&endpoints, clients, secs).await;
            println!(
                "unary submit, {clients:>2} clients: {rate:>8.0} submits/s  p50 {:>7.2?}  p99 {:>7.2?}",
                percentile(&lat, 0.5),
                percentile(&lat, 0.99)
            );
        }
        let (lat, failed) = open_loop(&endpoints, 1000, secs).await;
        println!(
            "1k submits/s offered:            p50 {:>7.2?}  p99 {:>7.2?}  max {:>7.2?}  failed {failed}",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            percentile(&lat, 1.0)
        );
        let rate = batches(&endpoints, 4, 1000, secs).await;
        println!("batch submit (4 callers x 1000 jobs): {rate:>8.0} jobs/s");
        for (clients, count) in [(1, 1), (64, 1), (16, 1000), (16, 10_000)] {
            let (rate, lat) = timestamps(&endpoints, clients, count, secs).await;
            println!(
                "tso, {clients:>2} callers x {count:>5} per call: {rate:>12.0} timestamps/s  p50 {:>7.2?}",
                percentile(&lat, 0.5)
            );
        }
    });
    let probe = {
        let mut config = client_config(&endpoints);
        config.retry_for = Duration::from_secs(60);
        Client::new(config).expect("client")
    };
    let mut failovers = Vec::new();
    for round in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        let leader = cluster.leader();
        let started = Instant::now();
        cluster.kill(leader);
        rt.block_on(probe.submit_with_id(&format!("failover-{round}"), &spec())).expect("write after failover");
        failovers.push(started.elapsed());
        eprintln!("round {round}: killed node {} ({:?} to first write)", leader + 1, started.elapsed());
        cluster.restart(leader);
    }
    failovers.sort();
    println!(
        "leader kill -9 to first write (20 kills): median {:.0?}  max {:.0?}",
        percentile(&failovers, 0.5),
        percentile(&failovers, 1.0)
    );
}
