//! `WatchJobs` against real processes: the first list and live changes, a resume that gets
//! exactly the jobs changed since a revision, across a restart too, refused revisions (before
//! the snapshot a restart started from, evicted from a small watch history, and ahead of the
//! cluster), tenants who see only their own jobs, the bound on the watches a principal holds
//! open, and a reader too slow for the changes, dropped and resumed without missing any.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::{corral_bin, trivial_job, DevPool};
use corral_proto::v1 as pb;
use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;
use tonic::Code;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

fn client(addr: &str, token: Option<&str>) -> Client {
    let mut config = ClientConfig::new(vec![addr.to_string()]);
    config.token = token.map(String::from);
    config.retry_for = Duration::from_secs(20);
    Client::new(config).expect("client")
}

/// What a stream delivered: (revision, job id, state) per job event, and the last resume point.
#[derive(Debug, Default)]
struct Seen {
    events: Vec<(u64, u64, i32)>,
    resume: Option<u64>,
}

impl Seen {
    fn jobs(&self) -> BTreeSet<u64> {
        self.events.iter().map(|(_, id, _)| *id).collect()
    }
}

/// Reads `stream` until `done` holds (checked after every event), within a minute.
async fn read_until(
    stream: &mut tonic::Streaming<pb::JobEvent>,
    seen: &mut Seen,
    done: impl Fn(&pb::JobEvent, &Seen) -> bool,
) {
    loop {
        let next = tokio::time::timeout(Duration::from_secs(60), stream.message()).await;
        let event = match next {
            Ok(Ok(Some(event))) => event,
            other => panic!("watch ended or stalled before the expected event: {other:?}; so far {seen:?}"),
        };
        if let Some(job) = &event.job {
            if let Some((last, ..)) = seen.events.last() {
                assert!(event.revision >= *last, "revisions went back: {event:?} after {seen:?}");
            }
            seen.events.push((event.revision, job.id, job.state));
        }
        if let Some(resume) = event.resume_revision {
            seen.resume = Some(resume);
        }
        if done(&event, seen) {
            return;
        }
    }
}

fn is_progress(event: &pb::JobEvent) -> bool {
    event.job.is_none()
}

fn succeeded(id: u64) -> impl Fn(&pb::JobEvent, &Seen) -> bool {
    move |event, _| event.job.as_ref().is_some_and(|j| j.id == id && j.state == pb::JobState::Succeeded as i32)
}

#[test]
fn watch_sends_jobs_and_changes_resumes_from_a_revision_and_refuses_forgotten_ones() {
    let mut pool = DevPool::start(&["--gpus", "1"]);
    let dir = pool.take_dir().expect("dir");
    let rt = runtime();
    let c = client(&pool.addr, None);
    let first = rt.block_on(c.submit(&trivial_job("first"))).expect("submit").job_id;
    rt.block_on(c.wait_job(first, |_| {})).expect("first ends");

    rt.block_on(async {
        // The current jobs, a progress event, then the changes of a new job up to its end.
        let mut stream = c.watch_jobs(pb::WatchJobsRequest::default()).await.expect("watch");
        let mut seen = Seen::default();
        read_until(&mut stream, &mut seen, |e, _| is_progress(e)).await;
        assert_eq!(seen.jobs(), BTreeSet::from([first]), "{seen:?}");
        let listed_at = seen.resume.expect("a resume point after the first list");
        let second = c.submit(&trivial_job("second")).await.expect("submit").job_id;
        read_until(&mut stream, &mut seen, succeeded(second)).await;
        let states: Vec<i32> = seen.events.iter().filter(|(_, id, _)| *id == second).map(|e| e.2).collect();
        // Changes within one window are sent once, as the job is then (a job placed at once may
        // first be seen running): never out of order, and always to the end.
        let order = [pb::JobState::Pending as i32, pb::JobState::Running as i32, pb::JobState::Succeeded as i32];
        let ranks: Vec<usize> =
            states.iter().map(|s| order.iter().position(|o| o == s).expect("a known state")).collect();
        assert!(ranks.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
        assert_eq!(states.last(), Some(&(pb::JobState::Succeeded as i32)), "{seen:?}");
        assert!(seen.events.iter().all(|(r, id, _)| *id == second || *r == listed_at), "{seen:?}");
        let after_second = seen.resume.expect("resume point");

        // A third job changes after that point; a resume sends it alone (once, as it is now),
        // not the first two, which did not change since.
        let third = c.submit(&trivial_job("third")).await.expect("submit").job_id;
        c.wait_job(third, |_| {}).await.expect("third ends");
        let resumed = pb::WatchJobsRequest { from_revision: Some(after_second), ..Default::default() };
        let mut stream = c.watch_jobs(resumed).await.expect("resume");
        let mut again = Seen::default();
        read_until(&mut stream, &mut again, |e, _| is_progress(e)).await;
        assert_eq!(again.events.len(), 1, "{again:?}");
        assert_eq!(again.events[0].1, third);
        assert_eq!(again.events[0].2, pb::JobState::Succeeded as i32);
        assert!(again.events[0].0 > after_second, "{again:?}");

        // Filters: by id and by state.
        let by_id = pb::WatchJobsRequest { job_ids: vec![second], ..Default::default() };
        let mut stream = c.watch_jobs(by_id).await.expect("watch by id");
        let mut only = Seen::default();
        read_until(&mut stream, &mut only, |e, _| is_progress(e)).await;
        assert_eq!(only.jobs(), BTreeSet::from([second]));
        let running = pb::WatchJobsRequest { states: vec![pb::JobState::Running as i32], ..Default::default() };
        let mut stream = c.watch_jobs(running).await.expect("watch running");
        let mut none = Seen::default();
        read_until(&mut stream, &mut none, |e, _| is_progress(e)).await;
        assert!(none.events.is_empty(), "{none:?}");

        // A revision the cluster has not reached is refused.
        let ahead = pb::WatchJobsRequest { from_revision: Some(u64::MAX / 2), ..Default::default() };
        let err = c.watch_jobs(ahead).await.expect_err("a revision from the future");
        assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
        assert!(err.to_string().contains("ahead of this cluster"), "{err}");
        after_second
    });

    // A restarted coordinator applies the log after its last snapshot again (here, with no
    // snapshot yet, all of it), so it still knows what changed after a revision from before the
    // restart: the resume sends the three jobs, as they are now.
    pool.stop();
    let mut pool = DevPool::start_in(&dir.path().join("data"), &["--gpus", "1"]);
    let c = client(&pool.addr, None);
    let old = pb::WatchJobsRequest { from_revision: Some(1), ..Default::default() };
    let mut stream = rt.block_on(c.watch_jobs(old)).expect("a revision from before the restart");
    let mut resumed = Seen::default();
    rt.block_on(read_until(&mut stream, &mut resumed, |e, _| is_progress(e)));
    assert_eq!(resumed.jobs().len(), 3, "{resumed:?}");
    assert!(resumed.events.iter().all(|e| e.2 == pb::JobState::Succeeded as i32), "{resumed:?}");

    // Once a snapshot covers a revision, a restart forgets it: an older revision is refused
    // with the oldest one the coordinator can resume from, and the advice to list again.
    let snapshot = Command::new(corral_bin())
        .args(["--endpoint", &pool.addr, "--output", "json", "cluster", "snapshot"])
        .output()
        .expect("corral cluster snapshot");
    assert!(snapshot.status.success(), "{}", String::from_utf8_lossy(&snapshot.stderr));
    let status: serde_json::Value = serde_json::from_slice(&snapshot.stdout).expect("json status");
    assert!(status["snapshot_index"].as_u64() >= Some(3), "{status}");
    pool.stop();
    let pool = DevPool::start_in(&dir.path().join("data"), &["--gpus", "1"]);
    let c = client(&pool.addr, None);
    let old = pb::WatchJobsRequest { from_revision: Some(1), ..Default::default() };
    let err = rt.block_on(c.watch_jobs(old)).expect_err("a forgotten revision");
    assert_eq!(err.code(), Some(Code::OutOfRange), "{err}");
    let message = err.to_string();
    assert!(message.contains("revision 1 is too old") && message.contains("list the jobs again"), "{message}");
    let oldest: u64 = message
        .split("resume from revision ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no oldest revision named in: {message}"));
    let from_oldest = pb::WatchJobsRequest { from_revision: Some(oldest), ..Default::default() };
    let mut stream = rt.block_on(c.watch_jobs(from_oldest)).expect("the oldest revision named is accepted");
    rt.block_on(read_until(&mut stream, &mut Seen::default(), |e, _| is_progress(e)));
}

#[test]
fn tenants_watch_only_their_jobs_and_a_small_history_refuses_evicted_revisions() {
    let admin = "admin-secret-for-watch-test";
    let options = ClusterOptions {
        watch_history: Some(2),
        auth: Some(format!(
            "require-tokens = true\nadmin-token-sha256 = \"{}\"",
            corral_coordinator::token_sha256(admin)
        )),
        ..Default::default()
    };
    let cluster = Cluster::start(1, options);
    let addr = cluster.nodes[0].addr.clone();
    let cli = |args: &[&str]| {
        let out = Command::new(corral_bin()).args(["--endpoint", &addr, "--token", admin]).args(args).output();
        let out = out.expect("corral");
        assert!(out.status.success(), "corral {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    cli(&["cluster", "init"]);
    let team_a = cli(&["token", "create", "--tenant", "team-a"]);
    let team_b = cli(&["token", "create", "--tenant", "team-b"]);
    let rt = runtime();
    let (a, b) = (client(&addr, Some(&team_a)), client(&addr, Some(&team_b)));
    let spec = |tenant: &str| corral_types::JobSpec { tenant: tenant.into(), ..trivial_job("sleepy") };
    // No worker: the jobs stay pending.
    let job_a = rt.block_on(a.submit(&spec("team-a"))).expect("submit a").job_id;
    let job_b = rt.block_on(b.submit(&spec("team-b"))).expect("submit b").job_id;

    rt.block_on(async {
        // team-a's watch lists and follows team-a's jobs only, even when it names team-b's job.
        let mut stream = a.watch_jobs(pb::WatchJobsRequest::default()).await.expect("watch a");
        let mut seen = Seen::default();
        read_until(&mut stream, &mut seen, |e, _| is_progress(e)).await;
        assert_eq!(seen.jobs(), BTreeSet::from([job_a]), "{seen:?}");
        b.cancel(job_b).await.expect("cancel b");
        let job_a2 = a.submit(&spec("team-a")).await.expect("submit a2").job_id;
        read_until(&mut stream, &mut seen, |e, _| e.job.as_ref().is_some_and(|j| j.id == job_a2)).await;
        assert!(!seen.jobs().contains(&job_b), "team-a saw team-b's job: {seen:?}");
        let named = pb::WatchJobsRequest { job_ids: vec![job_b], ..Default::default() };
        let mut stream = a.watch_jobs(named).await.expect("watch by id");
        let mut none = Seen::default();
        read_until(&mut stream, &mut none, |e, _| is_progress(e)).await;
        assert!(none.events.is_empty(), "team-a saw team-b's job by id: {none:?}");
        let other = pb::WatchJobsRequest { tenant: Some("team-b".into()), ..Default::default() };
        let err = a.watch_jobs(other).await.expect_err("team-a watching team-b");
        assert_eq!(err.code(), Some(Code::PermissionDenied), "{err}");
        assert!(err.to_string().contains("tenant team-a cannot see tenant team-b"), "{err}");

        // The history keeps two job changes: after three more, a resume from before them is
        // refused, naming the oldest revision it still serves.
        let before = seen.resume.expect("resume point");
        for _ in 0..3 {
            a.submit(&spec("team-a")).await.expect("submit");
        }
        let old = pb::WatchJobsRequest { from_revision: Some(before), ..Default::default() };
        let err = a.watch_jobs(old).await.expect_err("an evicted revision");
        assert_eq!(err.code(), Some(Code::OutOfRange), "{err}");
        assert!(err.to_string().contains(&format!("revision {before} is too old")), "{err}");
    });
}

/// Reads `stream` until it ends; returns the jobs it sent, its last resume point and how it
/// ended (`None`: it just ended).
async fn read_to_end(stream: &mut tonic::Streaming<pb::JobEvent>, seen: &mut Seen) -> Option<tonic::Status> {
    loop {
        match tokio::time::timeout(Duration::from_secs(60), stream.message()).await {
            Ok(Ok(Some(event))) => {
                if let Some(job) = &event.job {
                    seen.events.push((event.revision, job.id, job.state));
                }
                if let Some(resume) = event.resume_revision {
                    seen.resume = Some(resume);
                }
            }
            Ok(Ok(None)) => return None,
            Ok(Err(status)) => return Some(status),
            Err(_) => panic!("the watch stalled; so far {seen:?}"),
        }
    }
}

#[test]
fn a_principal_holds_at_most_max_watches_per_principal() {
    let admin = "admin-secret-for-watch-limits";
    let options = ClusterOptions {
        auth: Some(format!(
            "require-tokens = true\nadmin-token-sha256 = \"{}\"",
            corral_coordinator::token_sha256(admin)
        )),
        extra_config: "\n[limits]\nmax-watches-per-principal = 2\n".into(),
        ..Default::default()
    };
    let cluster = Cluster::start(1, options);
    let addr = cluster.nodes[0].addr.clone();
    let cli = |args: &[&str]| {
        let out = Command::new(corral_bin()).args(["--endpoint", &addr, "--token", admin]).args(args).output();
        let out = out.expect("corral");
        assert!(out.status.success(), "corral {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    cli(&["cluster", "init"]);
    let team_a = cli(&["token", "create", "--tenant", "team-a"]);
    let team_b = cli(&["token", "create", "--tenant", "team-b"]);
    let rt = runtime();
    let (a, b) = (client(&addr, Some(&team_a)), client(&addr, Some(&team_b)));
    let spec = corral_types::JobSpec { tenant: "team-a".into(), ..trivial_job("waits") };
    // No worker: the job stays pending, and a watch of it lasts.
    let job = rt.block_on(a.submit(&spec)).expect("submit").job_id;

    rt.block_on(async {
        // Two watches of any kind: a WatchJobs stream and a `corral wait`'s WatchJob.
        let first = a.watch_jobs(pb::WatchJobsRequest::default()).await.expect("first watch");
        let _second = a.watch_job(job).await.expect("second watch");
        let err = a.watch_jobs(pb::WatchJobsRequest::default()).await.expect_err("a third watch");
        assert_eq!(err.code(), Some(Code::ResourceExhausted), "{err}");
        let message = err.to_string();
        assert!(message.contains("limits.max-watches-per-principal") && message.contains("at most 2"), "{message}");
        assert_eq!(message.lines().count(), 1, "{message}");
        let err = a.watch_job(job).await.expect_err("a third watch of one job");
        assert_eq!(err.code(), Some(Code::ResourceExhausted), "{err}");
        // Another tenant has places of its own.
        let _other = b.watch_jobs(pb::WatchJobsRequest::default()).await.expect("team-b's watch");
        // A watch that ends frees its place (once the coordinator saw the stream close).
        drop(first);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match a.watch_jobs(pb::WatchJobsRequest::default()).await {
                Ok(_third) => break,
                Err(e) if e.code() == Some(Code::ResourceExhausted) => {
                    assert!(std::time::Instant::now() < deadline, "the ended watch kept its place: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("{e}"),
            }
        }
    });
}

#[test]
fn a_reader_too_slow_for_the_changes_is_dropped_and_resumes_without_missing_any() {
    // Half of a watch history of 1000 job changes: a reader whose last resume point is more
    // than 500 changes behind is dropped; its resume point is still remembered.
    let cluster = Cluster::start(1, ClusterOptions { watch_history: Some(1000), ..Default::default() });
    let addr = cluster.nodes[0].addr.clone();
    let out = Command::new(corral_bin()).args(["--endpoint", &addr, "cluster", "init"]).output().expect("corral");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rt = runtime();
    let c = client(&addr, None);
    // Each event carries a 32 KiB command: about a hundred fill what the stream holds in
    // flight (the watch's buffer, the client's 2 MiB HTTP/2 window, the server's send buffer).
    let big = |i: usize| corral_types::JobSpec {
        command: vec!["echo".into(), "x".repeat(32 * 1024)].into(),
        ..trivial_job(&format!("big-{i}"))
    };
    rt.block_on(async {
        let mut slow = c.watch_jobs(pb::WatchJobsRequest::default()).await.expect("watch");
        // Nobody reads the watch while 700 jobs are submitted, 10 per entry.
        let mut submitted = BTreeSet::new();
        for batch in 0..70 {
            let jobs: Vec<_> = (0..10).map(|i| (format!("slow-{batch}-{i}"), big(batch * 10 + i))).collect();
            for result in c.submit_batch(&jobs).await.expect("batch") {
                submitted.insert(result.expect("submitted").job_id);
            }
        }
        let mut seen = Seen::default();
        let ended = read_to_end(&mut slow, &mut seen).await.expect("the watch was dropped");
        assert_eq!(ended.code(), Code::Aborted, "{ended:?}");
        let resume = seen.resume.expect("a resume point before the drop");
        assert!(
            ended.message().contains("the watch fell behind")
                && ended.message().contains(&format!("resume from revision {resume}")),
            "{ended:?}"
        );
        assert!(seen.jobs().len() < submitted.len(), "the reader was dropped before it got every job");
        // Resuming from its revision gets the rest: every job was sent on one stream or the other.
        let resumed = pb::WatchJobsRequest { from_revision: Some(resume), ..Default::default() };
        let mut stream = c.watch_jobs(resumed).await.expect("the resume point is remembered");
        let mut rest = Seen::default();
        read_until(&mut stream, &mut rest, |e, _| is_progress(e)).await;
        let all: BTreeSet<u64> = seen.jobs().union(&rest.jobs()).copied().collect();
        assert_eq!(all, submitted, "a job was missed across the drop");
    });
}
