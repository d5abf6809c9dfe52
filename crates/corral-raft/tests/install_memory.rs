//! A follower installing a snapshot holds a bounded part of its history at a time, however
//! large the history: measured with a counting allocator, in a test binary of its own so that
//! no other test's allocations are counted.

use corral_core::{ClusterConfig, Command, CompactCutoffs, Request};
use corral_raft::{RaftRequest, StateMachineStore, TypeConfig};
use corral_types::{JobSpec, Timestamp, MAX_SCRIPT_BYTES};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

static HELD: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);

struct Counting;

fn count(delta: i64) {
    let held = HELD.fetch_add(delta, Ordering::Relaxed) + delta;
    PEAK.fetch_max(held, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` as it is; the counting touches no memory of it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as i64));
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as i64 - layout.size() as i64);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

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

/// Sends `snapshot` to `to` as openraft does: read in chunks, written into data `to` made to
/// receive it, then installed. Returns the most the process held during the install, above
/// what it held before.
async fn send(snapshot: Snapshot<TypeConfig>, to: &mut StateMachineStore) -> i64 {
    use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
    let mut data = snapshot.snapshot;
    let end = data.seek(std::io::SeekFrom::End(0)).await.expect("seek to the end");
    data.seek(std::io::SeekFrom::Start(0)).await.expect("seek to the start");
    let mut received = to.begin_receiving_snapshot().await.expect("begin receiving");
    let mut chunk = vec![0u8; 1 << 20];
    let mut offset = 0;
    while offset < end {
        let n = data.read(&mut chunk).await.expect("read a chunk");
        assert!(n > 0, "the data ended at {offset} of {end}");
        received.write_all(&chunk[..n]).await.expect("write a chunk");
        offset += n as u64;
    }
    received.shutdown().await.expect("shutdown");
    drop((data, chunk));
    let before = HELD.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    to.install_snapshot(&snapshot.meta, received).await.expect("install");
    PEAK.load(Ordering::Relaxed) - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn installing_a_snapshot_holds_a_bounded_part_of_a_large_history() {
    const JOBS: u64 = 128;
    let (from_dir, to_dir) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
    let mut a = Applier { store: StateMachineStore::open(from_dir.path()).expect("open"), index: 0 };
    a.apply(1, Command::Configure(ClusterConfig::dev_defaults())).await;
    // Jobs as the largest legal script makes them, submitted one per entry (an entry is
    // bounded too), then cancelled and moved into the history.
    let script: String = "#".repeat(MAX_SCRIPT_BYTES);
    for i in 0..JOBS {
        let spec = JobSpec {
            tenant: "default".into(),
            command: vec!["true".into()].into(),
            script: Some(script.clone().into()),
            ..JobSpec::default()
        };
        a.apply(1_000, Command::SubmitJobs { jobs: vec![(format!("big-{i}"), spec)] }).await;
    }
    a.apply(2_000, Command::CancelJobs { job_ids: (1..=JOBS).collect(), reason: "test".into() }).await;
    let cutoffs = CompactCutoffs {
        archive_before: Timestamp::compose(3_000, 0),
        request_ids_before: Timestamp::compose(3_000, 0),
        jobs_before: None,
        segments_before: None,
        max_finished_bytes: None,
    };
    while !a.store.read().state.jobs.is_empty() {
        a.apply(3_001, Command::Compact(cutoffs)).await;
    }
    a.store.clone().build_snapshot().await.expect("build");
    let snapshot = a.store.get_current_snapshot().await.expect("read").expect("a snapshot");

    let mut to = StateMachineStore::open(to_dir.path()).expect("open");
    let peak = send(snapshot, &mut to).await;
    let history = (JOBS as usize * MAX_SCRIPT_BYTES) as i64;
    assert_eq!(to.archived_job(JOBS).map(|j| j.spec.script.map(|s| s.len())), Some(Some(MAX_SCRIPT_BYTES)));
    // What the install may hold whatever the history's size: the history store's page cache
    // (64 MiB), a batch of records being written and the one being read (8 MiB each), and the
    // hot state. Before batches were bounded by bytes it held the whole history, decoded
    // besides: 207 MiB for 64 MiB.
    let bound = 96 << 20;
    eprintln!("the install held at most {} MiB for a history of {} MiB", peak >> 20, history >> 20);
    assert!(history > bound, "the history must outweigh the bound to prove anything");
    assert!(peak < bound, "the install held {} MiB at its peak for a history of {} MiB", peak >> 20, history >> 20);
}
