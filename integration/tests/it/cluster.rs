//! A replicated coordinator cluster of real processes: crashes of the leader under load,
//! full restarts, snapshot catch-up and membership changes lose no acknowledged job.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::netns::NetHosts;
use corral_types::{Job, JobSpec};
use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spec(name: &str) -> JobSpec {
    corral_integration::trivial_job(name)
}

fn client(endpoints: &str) -> Client {
    client_with_patience(endpoints, Duration::from_secs(10))
}

/// Concurrent submitters; each remembers the (request id, job id) pairs that were acknowledged.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<(String, u64)>>>,
}

impl Load {
    fn start(rt: &tokio::runtime::Runtime, endpoints: &str, clients: usize, tag: &str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..clients)
            .map(|c| {
                let client = client(endpoints);
                let stop = stop.clone();
                let tag = format!("{tag}-{c}");
                rt.spawn(async move {
                    let mut acked = Vec::new();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let rid = format!("{tag}-{n}");
                        n += 1;
                        if let Ok(s) = client.submit_with_id(&rid, &spec(&rid)).await {
                            acked.push((rid, s.job_id));
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    acked
                })
            })
            .collect();
        Load { stop, tasks }
    }

    fn finish(self, rt: &tokio::runtime::Runtime) -> Vec<(String, u64)> {
        self.stop.store(true, Ordering::Relaxed);
        self.tasks.into_iter().flat_map(|t| rt.block_on(t).expect("load task")).collect()
    }
}

/// Every acknowledged submit is present exactly once, under the id it was acknowledged with.
fn assert_no_loss(jobs: &[Job], acked: &[(String, u64)]) {
    let mut by_request: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for job in jobs {
        by_request.entry(job.request_id.as_str()).or_default().push(job.id);
    }
    for (rid, ids) in &by_request {
        assert_eq!(ids.len(), 1, "request {rid} created {} jobs: {ids:?}", ids.len());
    }
    for (rid, id) in acked {
        assert_eq!(by_request.get(rid.as_str()), Some(&vec![*id]), "acknowledged job {id} ({rid}) is missing");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

#[test]
fn killing_the_leader_under_load_loses_no_acknowledged_job() {
    let rt = runtime();
    let mut cluster = Cluster::start(3, ClusterOptions::default());
    cluster.init_and_join_all();
    let endpoints = cluster.endpoints();
    let load = Load::start(&rt, &endpoints, 4, "kill");
    let probe = client(&endpoints);
    let mut failovers = Vec::new();
    for round in 0..20 {
        std::thread::sleep(Duration::from_millis(300));
        let leader = cluster.leader();
        let started = Instant::now();
        cluster.kill(leader);
        // A new leader serves writes.
        let rid = format!("probe-{round}");
        rt.block_on(probe.submit_with_id(&rid, &spec(&rid))).expect("a write after the leader died");
        failovers.push(started.elapsed());
        cluster.restart(leader);
    }
    let acked = load.finish(&rt);
    assert!(acked.len() > 100, "load made too little progress: {}", acked.len());
    let jobs = rt.block_on(probe.list_jobs(true, None)).expect("list");
    assert_no_loss(&jobs, &acked);
    for round in 0..20 {
        assert!(jobs.iter().any(|j| j.request_id == format!("probe-{round}")), "probe {round} lost");
    }
    cluster.wait_converged();
    failovers.sort();
    eprintln!("failover to first write: median {:?}, max {:?}", failovers[10], failovers[19]);
}

#[test]
fn restarting_every_node_from_disk_gives_identical_state() {
    let rt = runtime();
    let mut cluster = Cluster::start(3, ClusterOptions::default());
    cluster.init_and_join_all();
    let load = Load::start(&rt, &cluster.endpoints(), 4, "restart");
    std::thread::sleep(Duration::from_secs(2));
    let acked = load.finish(&rt);
    let before = cluster.wait_converged();
    for i in 0..3 {
        cluster.stop(i);
    }
    for i in 0..3 {
        cluster.restart(i);
    }
    cluster.leader();
    let after = cluster.wait_converged();
    assert_eq!(before, after, "state digest changed across a full restart");
    let jobs = rt.block_on(client(&cluster.endpoints()).list_jobs(true, None)).expect("list");
    assert_no_loss(&jobs, &acked);
}

#[test]
fn lagging_follower_catches_up_from_a_snapshot() {
    let rt = runtime();
    let options = ClusterOptions { snapshot_every: 50, keep_logs_after_snapshot: 10, ..Default::default() };
    let mut cluster = Cluster::start(3, options);
    cluster.init_and_join_all();
    let leader = cluster.leader();
    let follower = (leader + 1) % 3;
    let follower_last = cluster.status(follower).expect("status")["last_log_index"].as_u64().expect("index");
    cluster.kill(follower);
    let load = Load::start(&rt, &cluster.endpoints(), 4, "lag");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let purged = cluster.status(cluster.leader()).and_then(|s| s["purged_index"].as_u64()).unwrap_or(0);
        if purged > follower_last + 20 {
            break;
        }
        assert!(Instant::now() < deadline, "leader never purged past the follower's log");
        std::thread::sleep(Duration::from_millis(100));
    }
    let acked = load.finish(&rt);
    cluster.restart(follower);
    cluster.wait_converged();
    let status = cluster.status(follower).expect("status");
    assert!(status["snapshot_index"].as_u64().is_some(), "follower caught up without a snapshot: {status}");
    let jobs = rt.block_on(client(&cluster.nodes[follower].addr).list_jobs(true, None));
    // A follower answers reads with a redirect; through all endpoints the data is complete.
    drop(jobs);
    let jobs = rt.block_on(client(&cluster.endpoints()).list_jobs(true, None)).expect("list");
    assert_no_loss(&jobs, &acked);
}

/// A follower frozen through ~80 MB of large batch entries catches up through bounded
/// AppendEntries, so that after the leader dies the next one commits a write at once: requests
/// of hundreds of MiB never fit openraft's per-request timeout nor the message limit.
#[test]
fn a_follower_behind_by_80_mb_of_entries_catches_up_and_the_next_leader_writes() {
    let rt = runtime();
    // No snapshot: the follower must catch up from the log itself.
    let options = ClusterOptions { snapshot_every: 10_000_000, ..Default::default() };
    let mut cluster = Cluster::start(3, options);
    cluster.init_and_join_all();
    let leader = cluster.leader();
    let follower = (leader + 1) % 3;
    cluster.signal(follower, libc::SIGSTOP);
    // 2 MiB entries fsynced while the whole suite runs beside: a batch may take longer than the
    // usual 10 s of retries on a loaded machine (retries reuse the request ids). What this test
    // checks is the catch-up after the leader dies, not how fast batches commit.
    let client = client_with_patience(&cluster.nodes[leader].addr, Duration::from_secs(60));
    let mut acked = Vec::new();
    for batch in 0..40 {
        // 250 jobs of 8 KiB each: 2 MiB per entry.
        let jobs: Vec<(String, JobSpec)> = (0..250)
            .map(|i| {
                let rid = format!("big-{batch}-{i}");
                let mut spec = spec(&rid);
                spec.command = vec!["echo".into(), "x".repeat(8 * 1024)].into();
                (rid, spec)
            })
            .collect();
        let results = rt.block_on(client.submit_batch(&jobs)).expect("batch submit");
        for ((rid, _), result) in jobs.iter().zip(results) {
            acked.push((rid.clone(), result.expect("job accepted").job_id));
        }
    }
    cluster.signal(follower, libc::SIGCONT);
    cluster.kill(leader);

    // A write through the survivors: the new leader must first bring the follower up to date.
    let survivors: Vec<String> = (0..3).filter(|i| *i != leader).map(|i| cluster.nodes[i].addr.clone()).collect();
    let survivors = survivors.join(",");
    let writer = client_with_patience(&survivors, Duration::from_secs(60));
    let written = rt.block_on(writer.submit_with_id("after-kill", &spec("after-kill")));
    let written = written.unwrap_or_else(|e| {
        let tails: Vec<String> = (0..3)
            .filter(|i| *i != leader)
            .map(|i| {
                let log = cluster.log_of(i);
                let tail: Vec<&str> = log.lines().filter(|l| !l.contains("requesting vote")).rev().take(40).collect();
                format!("node {}:\n{}", i + 1, tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect();
        panic!("no write within 60 s after the leader died: {e}\n{}", tails.join("\n"))
    });
    acked.push(("after-kill".into(), written.job_id));
    cluster.wait_converged();
    // The listing of 80 MB exceeds one message: look the first and last job of every batch up.
    let reader = client_with_patience(&survivors, Duration::from_secs(10));
    for (rid, id) in acked.iter().step_by(249) {
        let job = rt.block_on(reader.get_job(*id)).unwrap_or_else(|e| panic!("acknowledged job {id} ({rid}): {e}"));
        assert_eq!(&job.request_id, rid);
    }
}

fn client_with_patience(endpoints: &str, retry_for: Duration) -> Client {
    let mut config = ClientConfig::new(endpoints.split(',').map(String::from).collect());
    config.retry_for = retry_for;
    Client::new(config).expect("client")
}

#[test]
fn join_and_leave_under_load() {
    let rt = runtime();
    let mut cluster = Cluster::start(3, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let load = Load::start(&rt, &cluster.endpoints(), 4, "members");
    for i in 1..3 {
        let out = cluster.corral_at(0, &["cluster", "join", &cluster.nodes[i].addr.clone()]);
        assert!(out.status.success(), "join: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(300));
    }
    // The first node (the leader) leaves while clients keep submitting.
    let out = cluster.corral_at(1, &["cluster", "leave", "1"]);
    assert!(out.status.success(), "leave: {}", String::from_utf8_lossy(&out.stderr));
    std::thread::sleep(Duration::from_millis(500));
    let acked = load.finish(&rt);
    cluster.kill(0);
    let status = cluster.status(1).expect("status");
    let members: Vec<u64> =
        status["members"].as_array().expect("members").iter().filter_map(|m| m["node_id"].as_u64()).collect();
    assert_eq!(members, vec![2, 3]);
    let endpoints = format!("{},{}", cluster.nodes[1].addr, cluster.nodes[2].addr);
    let jobs = rt.block_on(client(&endpoints).list_jobs(true, None)).expect("list");
    assert_no_loss(&jobs, &acked);

    // Node ids are never reused: a fresh coordinator with id 1 is refused.
    let index = cluster.add_node(1);
    let out = cluster.corral_at(1, &["cluster", "join", &cluster.nodes[index].addr.clone()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("node id 1 was used before"), "{err}");
}

#[test]
fn partitioned_leader_loses_nothing_and_terms_have_one_leader() {
    let rt = runtime();
    let hosts = Arc::new(NetHosts::create(3));
    let options = ClusterOptions { hosts: Some(hosts.clone()), ..Default::default() };
    let cluster = Cluster::start(3, options);
    cluster.init_and_join_all();
    let endpoints = cluster.endpoints();

    // Watch every node's view: which node claims leadership in which term.
    let leaders: Arc<std::sync::Mutex<BTreeMap<u64, BTreeSet<u64>>>> = Arc::default();
    let watching = Arc::new(AtomicBool::new(true));
    let addrs: Vec<String> = cluster.nodes.iter().map(|n| n.addr.clone()).collect();
    let watcher = {
        let (leaders, watching) = (leaders.clone(), watching.clone());
        std::thread::spawn(move || {
            while watching.load(Ordering::Relaxed) {
                for addr in &addrs {
                    let out = std::process::Command::new(corral_integration::corral_bin())
                        .args(["--endpoint", addr, "--output", "json", "cluster", "status"])
                        .output();
                    let Ok(out) = out else { continue };
                    let Ok(status) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else { continue };
                    if status["state"] == "leader" {
                        let (term, id) = (status["term"].as_u64(), status["node_id"].as_u64());
                        if let (Some(term), Some(id)) = (term, id) {
                            leaders.lock().expect("lock").entry(term).or_default().insert(id);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let load = Load::start(&rt, &endpoints, 4, "partition");
    std::thread::sleep(Duration::from_secs(1));
    let old = cluster.leader();
    let old_term = cluster.status(old).expect("status")["term"].as_u64().expect("term");
    hosts.isolate(old + 1);
    // The majority side elects a new leader in a higher term and keeps serving writes.
    let deadline = Instant::now() + Duration::from_secs(30);
    let new = loop {
        let found = (0..3).filter(|i| *i != old).find(|i| {
            cluster.status(*i).is_some_and(|s| s["state"] == "leader" && s["term"].as_u64() > Some(old_term))
        });
        if let Some(i) = found {
            break i;
        }
        assert!(Instant::now() < deadline, "the majority never elected a new leader");
        std::thread::sleep(Duration::from_millis(50));
    };
    let majority = format!("{},{}", cluster.nodes[new].addr, cluster.nodes[3 - old - new].addr);
    let probe = client(&majority);
    rt.block_on(probe.submit_with_id("during-partition", &spec("during-partition"))).expect("write on the majority");
    std::thread::sleep(Duration::from_secs(1));
    hosts.heal(old + 1);
    std::thread::sleep(Duration::from_secs(1));
    let acked = load.finish(&rt);
    cluster.wait_converged();
    watching.store(false, Ordering::Relaxed);
    watcher.join().expect("watcher");

    let jobs = rt.block_on(client(&endpoints).list_jobs(true, None)).expect("list");
    assert_no_loss(&jobs, &acked);
    assert!(jobs.iter().any(|j| j.request_id == "during-partition"));
    let leaders = leaders.lock().expect("lock");
    for (term, ids) in leaders.iter() {
        assert_eq!(ids.len(), 1, "term {term} had leaders {ids:?}");
    }
    assert!(leaders.len() >= 2, "expected a leader change: {leaders:?}");
}

/// Pre-vote: a follower cut off from the others for many election timeouts asks for pre-votes
/// that nobody answers, so it never campaigns; when it comes back, the leader stays the leader
/// in the same term and the follower catches up.
#[test]
fn a_follower_cut_off_and_back_does_not_depose_the_leader() {
    let rt = runtime();
    let hosts = Arc::new(NetHosts::create(3));
    let options = ClusterOptions { hosts: Some(hosts.clone()), ..Default::default() };
    let cluster = Cluster::start(3, options);
    cluster.init_and_join_all();
    let endpoints = cluster.endpoints();
    let leader = cluster.leader();
    let term = |i: usize| cluster.status(i).and_then(|s| s["term"].as_u64());
    let before = term(leader).expect("the leader's term");
    let follower = (leader + 1) % 3;
    assert_eq!(term(follower), Some(before));

    hosts.isolate(follower + 1);
    // Twenty of the longest election timeouts (300 ms): without pre-vote the follower would
    // campaign about twenty times, and its term would depose the leader on its return.
    std::thread::sleep(Duration::from_secs(6));
    rt.block_on(client(&endpoints).submit_with_id("while-cut-off", &spec("while-cut-off"))).expect("write");
    hosts.heal(follower + 1);
    std::thread::sleep(Duration::from_secs(2));
    rt.block_on(client(&endpoints).submit_with_id("after-return", &spec("after-return"))).expect("write");
    cluster.wait_converged();

    assert_eq!(cluster.leader(), leader, "the leader changed");
    for i in 0..3 {
        assert_eq!(term(i), Some(before), "node {} is in another term", i + 1);
    }
    let jobs = rt.block_on(client(&endpoints).list_jobs(true, None)).expect("list");
    for rid in ["while-cut-off", "after-return"] {
        assert!(jobs.iter().any(|j| j.request_id == rid), "{rid} is missing");
    }
}
