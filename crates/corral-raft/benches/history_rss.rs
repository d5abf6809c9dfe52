//! Memory of one state machine store as its on-disk history grows, with nothing else in the
//! process: rounds of 100k jobs are submitted (1000-job entries), cancelled and compacted
//! through the store's `apply`, as a coordinator applies them (no network, no Raft), with their
//! request ids expired at once, so none of them stays in the hot state. After each round the
//! store builds a snapshot (which syncs the history store) and the process RSS and the round's
//! time are printed. At the end the history is read back: one job, a page of 50, all of it.
//!
//! Run: `cargo bench -p corral-raft --bench history_rss`; `CORRAL_HISTORY_JOBS` sets the number
//! of jobs (default 1000000).

use corral_core::{ClusterConfig, Command, CompactCutoffs, Request};
use corral_raft::{RaftRequest, StateMachineStore, TypeConfig};
use corral_types::{JobSpec, Timestamp};
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder};

/// The allocator of the `corral` binary.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

struct Applier {
    store: StateMachineStore,
    index: u64,
}

impl Applier {
    async fn apply(&mut self, ms: u64, command: Command) {
        self.index += 1;
        let entry = openraft::Entry::<TypeConfig> {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), self.index),
            payload: EntryPayload::Normal(RaftRequest::new(Request { ts: Timestamp::compose(ms, 0), command })),
        };
        for response in self.store.apply([entry]).await.expect("apply") {
            response.expect("applied");
        }
    }
}

fn main() {
    let jobs: u64 = std::env::var("CORRAL_HISTORY_JOBS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    rt.block_on(async {
        let store = StateMachineStore::open(dir.path()).expect("open");
        let mut a = Applier { store, index: 0 };
        a.apply(1, Command::Configure(ClusterConfig::dev_defaults())).await;
        println!("empty store: RSS {:.0} MiB", rss_mib());
        let spec = JobSpec {
            name: "scale".into(),
            tenant: "default".into(),
            command: vec!["true".into()].into(),
            gpus: 1,
            ..Default::default()
        };
        let (mut done, mut next_id, mut ms) = (0u64, 1u64, 1_000u64);
        while done < jobs {
            let started = std::time::Instant::now();
            let round = (jobs - done).min(100_000);
            for batch in 0..round.div_ceil(1000) {
                let n = (round - batch * 1000).min(1000);
                let entries = (0..n).map(|i| (format!("history-{}", done + batch * 1000 + i), spec.clone())).collect();
                a.apply(ms, Command::SubmitJobs { jobs: entries }).await;
            }
            ms += 1_000;
            let job_ids = (next_id..next_id + round).collect();
            a.apply(ms, Command::CancelJobs { job_ids, reason: "bench".into() }).await;
            next_id += round;
            ms += 1_000;
            let cutoffs = CompactCutoffs {
                archive_before: Timestamp::compose(ms, 0),
                request_ids_before: Timestamp::compose(ms, 0),
                jobs_before: None,
                segments_before: None,
                max_finished_bytes: None,
            };
            while !a.store.read().state.jobs.is_empty() {
                a.apply(ms + 1, Command::Compact(cutoffs)).await;
            }
            ms += 1_000;
            a.store.clone().build_snapshot().await.expect("snapshot");
            done += round;
            let hot = a.store.read().state.request_ids.len();
            println!(
                "{done:>8} jobs in the history ({hot} request ids in memory): RSS {:.0} MiB, round {} ms",
                rss_mib(),
                started.elapsed().as_millis()
            );
        }
        let timed = |what: &str, f: &dyn Fn() -> usize| {
            let started = std::time::Instant::now();
            let n = f();
            println!("read {what}: {n} jobs in {:.2} ms", started.elapsed().as_secs_f64() * 1e3);
        };
        let middle = jobs / 2;
        timed("one job", &|| a.store.archived_job(middle).into_iter().count());
        timed("a page of 50", &|| a.store.archived_jobs_from(middle).take(50).count());
        timed("the whole history", &|| a.store.archived_jobs_from(0).count());
        println!("at the end: RSS {:.0} MiB", rss_mib());
    });
}
