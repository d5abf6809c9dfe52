//! An abusive tenant for fault and soak runs: it uses every per-request limit at once, beside
//! whatever else the cluster is doing, and never lets its own jobs run.
//!
//! What it does, over and over, at random: submits the largest legal array (`0-99999%1024`) with
//! the largest legal script (1 MiB), submits an array written as 4096 single indices and shows its
//! last task, lists every job (all pages, history included), and keeps the most watches a
//! principal may open reading one event every few seconds. Its jobs are held, so they change the
//! queue's size but never the GPUs' use, and it cancels each array a few seconds later (at most
//! [`LIVE_ARRAYS`] live at once, so the cluster's memory has a bound the caller can state).

use corral_client::{Client, ClientConfig};
use corral_proto::v1 as pb;
use corral_types::{ArrayRange, ArraySpec, JobRef, JobSpec, MAX_ARRAY_RANGES, MAX_ARRAY_TASKS, MAX_SCRIPT_BYTES};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The tenant the abuser submits as.
pub const TENANT: &str = "team-a";

/// Most of its arrays alive (not yet cancelled) at once.
pub const LIVE_ARRAYS: usize = 3;

/// Slow watches it keeps open: the default `limits.max-watches-per-principal`.
pub const WATCHES: usize = 64;

/// The coordinators' array window default (`limits.max-array-window`).
const ARRAY_WINDOW: u32 = 1024;

/// What the abuser did and what it was told, by action.
#[derive(Debug, Default, Clone)]
pub struct AbuseReport {
    /// Per action: (served, refused or failed).
    pub actions: BTreeMap<&'static str, (u64, u64)>,
    /// The slowest answer to each action, in ms.
    pub slowest_ms: BTreeMap<&'static str, u64>,
    /// Events the slow watchers received.
    pub watch_events: u64,
    /// One line per distinct error, with its count.
    pub errors: BTreeMap<String, u64>,
}

impl AbuseReport {
    fn record<T, E: std::fmt::Display>(&mut self, action: &'static str, started: Instant, result: &Result<T, E>) {
        let entry = self.actions.entry(action).or_default();
        match result {
            Ok(_) => entry.0 += 1,
            Err(e) => {
                entry.1 += 1;
                let line = e.to_string();
                let line: String = line.lines().next().unwrap_or_default().chars().take(160).collect();
                *self.errors.entry(format!("{action}: {line}")).or_default() += 1;
            }
        }
        let ms = started.elapsed().as_millis() as u64;
        let slowest = self.slowest_ms.entry(action).or_default();
        *slowest = (*slowest).max(ms);
    }
}

/// A running abuser; [`Abuser::stop`] cancels what it left and returns its report.
pub struct Abuser {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<AbuseReport>>,
}

impl Abuser {
    /// Starts abusing the cluster at `endpoints`, with its own client, runtime and threads.
    pub fn start(endpoints: Vec<String>, seed: u64) -> Abuser {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("abuser".into())
            .spawn(move || run(endpoints, seed, flag))
            .expect("abuser thread");
        Abuser { stop, thread: Some(thread) }
    }

    /// Stops, cancels every array it left (retried through leader changes for up to a minute)
    /// and closes its watches.
    pub fn stop(mut self) -> AbuseReport {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().map(|t| t.join().expect("abuser panicked")).unwrap_or_default()
    }
}

impl Drop for Abuser {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A held job of the abusing tenant with the largest legal script.
fn held(name: &str) -> JobSpec {
    let mut script = String::from("#!/bin/sh\n# padding to the largest legal script\n");
    let pad = MAX_SCRIPT_BYTES - script.len() - "exit 0\n".len() - 1;
    script.push('#');
    script.push_str(&"x".repeat(pad - 1));
    script.push('\n');
    script.push_str("exit 0\n");
    debug_assert!(script.len() <= MAX_SCRIPT_BYTES);
    let mut spec = JobSpec {
        name: name.into(),
        tenant: TENANT.into(),
        script: Some(script.into()),
        batch_step: true,
        ..Default::default()
    };
    spec.sched.hold = true;
    spec
}

/// The largest legal array: every index, the widest window.
fn largest_array() -> JobSpec {
    let mut spec = held("abuse-array");
    spec.array = Some(ArraySpec {
        ranges: vec![ArrayRange { first: 0, last: MAX_ARRAY_TASKS - 1, step: 1 }],
        max_running: Some(ARRAY_WINDOW),
    });
    spec
}

/// An array written as the most single indices (`0,2,4,...`): the longest index list.
fn index_list() -> JobSpec {
    let mut spec = held("abuse-indices");
    let ranges = (0..MAX_ARRAY_RANGES as u32).map(|i| ArrayRange { first: 2 * i, last: 2 * i, step: 1 }).collect();
    spec.array = Some(ArraySpec { ranges, max_running: Some(ARRAY_WINDOW) });
    spec
}

fn run(endpoints: Vec<String>, seed: u64, stop: Arc<AtomicBool>) -> AbuseReport {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let mut config = ClientConfig::new(endpoints);
    config.connect_timeout = Duration::from_millis(500);
    config.request_timeout = Duration::from_secs(10);
    config.retry_for = Duration::from_secs(3);
    let client = Client::new(config).expect("client");
    let mut rng = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = move |n: u64| {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    };
    let mut report = AbuseReport::default();
    let mut live: VecDeque<u64> = VecDeque::new();
    let watch_events = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let watchers: Vec<_> = (0..WATCHES)
        .map(|i| rt.spawn(slow_watcher(client.clone(), stop.clone(), watch_events.clone(), 1_000 + 50 * i as u64)))
        .collect();

    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(200 + next(800)));
        let started = Instant::now();
        match next(4) {
            0 => {
                let spec = largest_array();
                let result = rt.block_on(client.submit(&spec));
                report.record("submit largest array", started, &result);
                if let Ok(job) = result {
                    live.push_back(job.job_id);
                }
            }
            1 => {
                let spec = index_list();
                let result = rt.block_on(client.submit(&spec));
                report.record("submit 4096 indices", started, &result);
                if let Ok(job) = result {
                    live.push_back(job.job_id);
                    let last = JobRef { id: job.job_id, task: Some(2 * (MAX_ARRAY_RANGES as u32 - 1)) };
                    for _ in 0..10 {
                        let started = Instant::now();
                        let shown = rt.block_on(client.get_job_ref(last));
                        report.record("show last task", started, &shown);
                    }
                }
            }
            _ => {
                let result = rt.block_on(client.list_jobs(true, None));
                report.record("list every job", started, &result);
            }
        }
        while live.len() > LIVE_ARRAYS {
            let id = live.pop_front().expect("nonempty");
            let started = Instant::now();
            let result = rt.block_on(client.cancel(id));
            report.record("cancel array", started, &result);
            if result.is_err() {
                live.push_front(id);
                break;
            }
        }
    }
    // Leave nothing behind: every array cancelled, retried through leader changes.
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Some(id) = live.pop_front() {
        let started = Instant::now();
        let result = rt.block_on(client.cancel(id));
        report.record("cancel array", started, &result);
        if result.is_err() {
            if Instant::now() > deadline {
                break;
            }
            live.push_front(id);
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    for w in watchers {
        w.abort();
    }
    report.watch_events = watch_events.load(Ordering::SeqCst);
    report
}

/// A watch of every job that reads one event every `pause_ms`, reopened when it ends or fails.
async fn slow_watcher(client: Client, stop: Arc<AtomicBool>, events: Arc<std::sync::atomic::AtomicU64>, pause_ms: u64) {
    while !stop.load(Ordering::SeqCst) {
        let request = pb::WatchJobsRequest::default();
        let Ok(mut stream) = client.watch_jobs(request).await else {
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            continue;
        };
        while !stop.load(Ordering::SeqCst) {
            match stream.message().await {
                Ok(Some(_)) => {
                    events.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                }
                Ok(None) | Err(_) => break,
            }
        }
    }
}
