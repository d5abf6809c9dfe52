//! Invoice benchmark: `corral billing invoice --tenant default` over a tenant with N billed runs
//! in the on-disk history (default 100000): the time to its first line and to its last, and
//! the coordinator's resident memory while it prints (the ledger is paged: neither side holds
//! it whole).
//!
//! The runs are real runs of the coordinator's lifecycle (submitted in batches, placed by the
//! leader, reported started and finished through the worker gateway, billed by apply, moved to
//! the history by compaction); the worker is this bench's own gateway client, which starts no
//! process, so N runs take minutes instead of hours.
//!
//! Run: `cargo build --release -p corral-cli && CORRAL_BIN=target/release/corral cargo bench -p
//! corral-integration --bench invoice`. Knobs: `CORRAL_INVOICE_RUNS` (default 100000),
//! `CORRAL_BENCH_SAMPLES` (invoices timed, default 5).

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::{corral_bin, rss_mib};
use corral_proto::v1 as pb;
use corral_types::{GpuDevice, JobSpec, NodeSpec};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

const GPUS: u32 = 64;

/// A worker without processes: registers `GPUS` GPUs, heartbeats, and reports every run it is
/// told to run started, then finished with exit code 0. Counts the accepted finishes.
async fn fake_worker(addr: String, finished: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to the coordinator");
    let mut gateway = pb::worker_gateway_client::WorkerGatewayClient::new(channel);
    let gpus = (0..GPUS)
        .map(|index| GpuDevice {
            index,
            uuid: format!("GPU-bench-{index}"),
            model: "RTX 5090".into(),
            memory_mib: 32768,
            ..Default::default()
        })
        .collect();
    let spec = NodeSpec {
        name: "bench".into(),
        address: "127.0.0.1:1".into(),
        gpus,
        cpu_millis: 1_000_000,
        memory_bytes: 1 << 40,
        labels: Vec::new(),
        rendezvous_ports: None,
        lease_end: None,
    };
    let registered = gateway
        .register(pb::RegisterRequest { spec: Some((&spec).into()), stale_jobs_stopped_ms_ago: None })
        .await
        .expect("register")
        .into_inner();
    let epoch = registered.node_epoch;
    {
        let mut gateway = gateway.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let beat = pb::HeartbeatRequest { node: "bench".into(), node_epoch: epoch, ..Default::default() };
                let _ = gateway.heartbeat(beat).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
    }
    let mut stream = gateway
        .watch_desired(pb::WatchDesiredRequest { node: "bench".into(), node_epoch: epoch })
        .await
        .expect("watch desired")
        .into_inner();
    let mut seen = std::collections::BTreeSet::new();
    let limit = Arc::new(tokio::sync::Semaphore::new(64));
    while let Ok(Some(desired)) = stream.message().await {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        for d in desired.jobs {
            let Some(job) = d.job else { continue };
            let run_epoch = job.allocation.as_ref().map_or(0, |a| a.epoch);
            if d.action != pb::DesiredAction::Run as i32 || !seen.insert((job.id, run_epoch)) {
                continue;
            }
            let mut gateway = gateway.clone();
            let finished = finished.clone();
            let permit = limit.clone().acquire_owned().await.expect("semaphore");
            tokio::spawn(async move {
                let _permit = permit;
                let started = pb::ReportStartedRequest { node: "bench".into(), job_id: job.id, epoch: run_epoch };
                if gateway.report_started(started).await.is_err() {
                    return;
                }
                let report = pb::JobExitReport { exit_code: Some(0), run_time_ms: 5, ..Default::default() };
                let end = pb::ReportFinishedRequest {
                    node: "bench".into(),
                    job_id: job.id,
                    epoch: run_epoch,
                    report: Some(report),
                };
                if gateway.report_finished(end).await.is_ok_and(|r| r.into_inner().accepted) {
                    finished.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    }
}

/// One invoice: (seconds to its first run's line, seconds to its last line, lines, largest
/// coordinator RSS in MiB while it ran).
fn invoice(cluster: &Cluster) -> (f64, f64, usize, f64) {
    let pid = cluster.pid(0).expect("coordinator pid");
    let started = Instant::now();
    let mut child = Command::new(corral_bin())
        .args(["--endpoint", &cluster.endpoints(), "billing", "invoice", "--tenant", "default", "--format", "csv"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("corral billing invoice");
    let rss_max = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (rss_max, done) = (rss_max.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let kib = (rss_mib(pid) * 1024.0) as u64;
                rss_max.fetch_max(kib, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let mut first = None;
    let mut lines = 0;
    for line in BufReader::new(child.stdout.take().expect("stdout")).lines() {
        line.expect("line");
        // The first line after the CSV header: the first run of the bill.
        if lines == 1 {
            first = Some(started.elapsed());
        }
        lines += 1;
    }
    let last = started.elapsed();
    assert!(child.wait().expect("wait").success(), "the invoice failed");
    done.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler");
    let first = first.unwrap_or(last);
    (first.as_secs_f64(), last.as_secs_f64(), lines, rss_max.load(Ordering::Relaxed) as f64 / 1024.0)
}

fn main() {
    let runs: u64 = env_or("CORRAL_INVOICE_RUNS", 100_000);
    let samples: usize = env_or("CORRAL_BENCH_SAMPLES", 5);
    // Ended jobs and their segments leave memory for the on-disk history within seconds.
    let extra_config = "\n[history]\narchive-after = \"1s\"\ncompact-every = \"500ms\"\n".to_string();
    let cluster = Cluster::start(1, ClusterOptions { extra_config, ..Default::default() });
    cluster.init_and_join_all();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let client = Client::new(ClientConfig::new(vec![cluster.endpoints()])).expect("client");
    let finished = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    rt.spawn(fake_worker(cluster.nodes[0].addr.clone(), finished.clone(), stop.clone()));

    let filled = Instant::now();
    let spec = JobSpec { gpus: 1, ..corral_integration::trivial_job("bill") };
    let mut submitted = 0;
    while submitted < runs {
        // At most 20000 waiting at once: the queue stays short and the pass fast.
        while submitted - finished.load(Ordering::Relaxed) > 20_000 {
            std::thread::sleep(Duration::from_millis(50));
        }
        let n = (runs - submitted).min(1000);
        let batch: Vec<(String, JobSpec)> =
            (0..n).map(|i| (format!("invoice-{}-{}", std::process::id(), submitted + i), spec.clone())).collect();
        let client = client.clone();
        let answers = rt.block_on(async move { client.submit_batch(&batch).await }).expect("submit batch");
        assert!(answers.iter().all(Result::is_ok), "a submit was refused");
        submitted += n;
    }
    while finished.load(Ordering::Relaxed) < runs {
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "{runs} runs billed in {:.1}s ({:.0} runs/s)",
        filled.elapsed().as_secs_f64(),
        runs as f64 / filled.elapsed().as_secs_f64()
    );
    // Compaction moves them to the history.
    std::thread::sleep(Duration::from_secs(5));
    stop.store(true, Ordering::Relaxed);
    let idle_rss = rss_mib(cluster.pid(0).expect("pid"));
    let (mut firsts, mut lasts, mut peaks) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        let (first, last, lines, peak) = invoice(&cluster);
        assert!(lines as u64 > runs, "the invoice has a line per run: {lines} lines for {runs} runs");
        println!(
            "invoice: first line {:.0} ms, last line {:.2} s, {lines} lines, coordinator RSS peak {peak:.0} MiB",
            first * 1000.0,
            last
        );
        firsts.push(first);
        lasts.push(last);
        peaks.push(peak);
    }
    println!(
        "median of {samples}: first line {:.0} ms, last line {:.2} s; coordinator RSS {idle_rss:.0} MiB before, peak {:.0} MiB during",
        median(firsts) * 1000.0,
        median(lasts),
        median(peaks)
    );
}
