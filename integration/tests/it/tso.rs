//! The timestamp oracle across leader changes: strictly increasing, no duplicates, no inversion
//! between calls that do not overlap in real time, even when a new leader's clock is behind.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn client(endpoints: &str) -> Client {
    let mut config = ClientConfig::new(endpoints.split(',').map(String::from).collect());
    config.retry_for = Duration::from_secs(20);
    Client::new(config).expect("client")
}

/// One answered call: when it was made, when it returned, and the range it got.
#[derive(Debug, Clone, Copy)]
struct Call {
    start: Instant,
    end: Instant,
    first: u64,
    last: u64,
}

/// No two ranges share a timestamp, and a call that began after another ended got larger ones.
fn check_linearizable(mut calls: Vec<Call>) {
    calls.sort_by_key(|c| c.first);
    for pair in calls.windows(2) {
        assert!(pair[0].last < pair[1].first, "overlapping ranges: {:?} and {:?}", pair[0], pair[1]);
    }
    let mut by_end = calls.clone();
    by_end.sort_by_key(|c| c.end);
    let mut by_start = calls;
    by_start.sort_by_key(|c| c.start);
    let (mut i, mut max_last_ended) = (0, 0u64);
    for call in &by_start {
        while i < by_end.len() && by_end[i].end < call.start {
            max_last_ended = max_last_ended.max(by_end[i].last);
            i += 1;
        }
        assert!(
            max_last_ended < call.first,
            "inversion: a call that started after another ended got {} <= {max_last_ended}",
            call.first
        );
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// `callers` tasks taking small ranges until `stop`.
fn start_callers(
    rt: &tokio::runtime::Runtime,
    endpoints: &str,
    callers: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Call>>> {
    (0..callers)
        .map(|c| {
            let client = client(endpoints);
            let stop = stop.clone();
            rt.spawn(async move {
                let mut calls = Vec::new();
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let count = 1 + (n + c as u32) % 5;
                    n += 1;
                    let start = Instant::now();
                    if let Ok(first) = client.timestamps(count).await {
                        let end = Instant::now();
                        calls.push(Call { start, end, first: first.0, last: first.0 + u64::from(count) - 1 });
                    }
                }
                calls
            })
        })
        .collect()
}

#[test]
fn timestamps_strictly_increase_across_leader_kills() {
    let rt = runtime();
    let mut cluster = Cluster::start(3, ClusterOptions::default());
    cluster.init_and_join_all();
    let stop = Arc::new(AtomicBool::new(false));
    let callers = start_callers(&rt, &cluster.endpoints(), 8, stop.clone());
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(200));
        let leader = cluster.leader();
        cluster.kill(leader);
        cluster.leader();
        cluster.restart(leader);
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let calls: Vec<Call> = callers.into_iter().flat_map(|t| rt.block_on(t).expect("caller")).collect();
    assert!(calls.len() > 200, "callers made too little progress: {}", calls.len());
    check_linearizable(calls);
}

#[test]
fn a_leader_with_a_clock_far_behind_still_issues_larger_timestamps() {
    let rt = runtime();
    // Node 1, the first leader, has a clock one hour ahead: what it issues lies an hour in the
    // future of every other node's clock.
    let skew = (0, "FAILPOINTS".to_string(), "clock-skew-ms=return(3600000)".to_string());
    let mut cluster = Cluster::start(3, ClusterOptions { node_env: vec![skew], ..Default::default() });
    cluster.init_and_join_all();
    assert_eq!(cluster.leader(), 0, "the node that ran `cluster init` leads first");
    let all = client(&cluster.endpoints());
    let mut previous = rt.block_on(all.timestamps(1)).expect("ts from the fast-clock leader");
    let wall_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64;
    assert!(previous.physical_ms() > wall_ms + 3_000_000, "the failpoint moved the leader's clock: {previous:?}");
    // The next leaders' clocks are an hour behind what was issued: timestamps still increase.
    cluster.kill(0);
    for _ in 0..50 {
        let ts = rt.block_on(all.timestamps(1)).expect("ts from a slow-clock leader");
        assert!(
            ts > previous,
            "timestamp went backwards under a leader whose clock is behind: {ts:?} after {previous:?}"
        );
        previous = ts;
    }
    let leader = cluster.leader();
    assert_ne!(leader, 0);
    cluster.kill(leader);
    cluster.restart(0);
    for _ in 0..50 {
        let ts = rt.block_on(all.timestamps(1)).expect("ts after a second failover");
        assert!(ts > previous, "{ts:?} after {previous:?}");
        previous = ts;
    }
}

/// openraft 0.9 can leave a proposal unanswered for good (a former leader's write replaced by a
/// snapshot install: databendlabs/openraft#1762). The fault harness found a leader whose timestamp
/// oracle waited on such a proposal, and with it every report, submit and scheduling pass, for
/// minutes, while it answered heartbeats: the oracle's early extension of its window, a task of
/// its own that holds the oracle's lock, was the waiter. Here that extension is stranded the same
/// way (a failpoint: proposed, never answered; the oracle's first window is proposed normally).
/// Once the window runs out the oracle needs the lock: callers wait, but no longer than
/// `MAX_RAFT_WAIT` from the stranding, after which the extension gives up and the oracle serves.
#[test]
fn a_stranded_proposal_holds_the_timestamp_oracle_no_longer_than_the_bound() {
    let failpoint = format!("{}-ExtendTso=1*off->1*return", corral_coordinator::STRANDED_PROPOSAL_FAILPOINT);
    let options = ClusterOptions { node_env: vec![(0, "FAILPOINTS".into(), failpoint)], ..Default::default() };
    let cluster = Cluster::start(1, options);
    cluster.init_and_join_all();
    let client = client(&cluster.endpoints());
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let bound = corral_coordinator::MAX_RAFT_WAIT;
    // Timestamps for longer than a window and the bound: each call is answered (the client
    // retries for 20 s), and none waits much past the bound.
    let until = Instant::now() + bound + Duration::from_secs(8);
    let (mut slowest, mut last) = (Duration::ZERO, 0);
    while Instant::now() < until {
        let asked = Instant::now();
        let ts = rt.block_on(client.timestamps(1)).expect("timestamps while an extension is stranded");
        slowest = slowest.max(asked.elapsed());
        assert!(ts.0 > last, "timestamps increase");
        last = ts.0;
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = cluster.log_of(0);
    assert!(log.contains("the proposal of ExtendTso is never answered"), "the failpoint stranded nothing:\n{log}");
    assert!(log.contains("proposal of ExtendTso not answered: given up"), "{log}");
    assert!(slowest < bound + Duration::from_secs(3), "a call waited {slowest:?}");
}
