//! Requests at and just past the API's per-request limits, against a real coordinator: the
//! largest legal request is served, one more entry is refused whole with one line naming the
//! limit, and nothing of a refused request is created.

use corral_client::{Client, ClientConfig, JobQuery, SegmentQuery};
use corral_integration::{trivial_job, DevPool};
use corral_proto::v1 as pb;
use corral_types::{Dependency, DependencyKind, JobSpec};
use std::time::Duration;
use tonic::Code;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

fn client(addr: &str) -> Client {
    let mut config = ClientConfig::new(vec![addr.to_string()]);
    config.retry_for = Duration::from_secs(20);
    Client::new(config).expect("client")
}

/// A held job (it never runs: the test needs no worker) depending `count` times on `on`.
fn depending(count: usize, on: u64) -> JobSpec {
    let mut spec = trivial_job("depending");
    spec.sched.hold = true;
    spec.sched.dependencies = vec![Dependency { kind: DependencyKind::AfterAny, job_id: on }; count];
    spec
}

/// Asserts a refusal is INVALID_ARGUMENT on one line that contains `limit`.
fn refused(result: Result<impl std::fmt::Debug, corral_client::ClientError>, limit: &str) {
    let err = result.expect_err("over the limit");
    assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
    let message = err.to_string();
    assert!(message.contains(limit), "{limit:?} not in {message:?}");
    assert_eq!(message.lines().count(), 1, "{message}");
}

#[test]
fn each_request_is_bounded_and_a_refusal_names_its_limit_and_creates_nothing() {
    let pool = DevPool::start(&["--gpus", "1"]);
    let rt = runtime();
    let c = client(&pool.addr);
    rt.block_on(async {
        let mut held = trivial_job("first");
        held.sched.hold = true;
        let first = c.submit(&held).await.expect("submit").job_id;
        let jobs = || async { c.list_jobs(true, None).await.expect("list").len() };

        // Dependencies of one job: 256 are served, 257 refused.
        c.submit(&depending(256, first)).await.expect("256 dependencies");
        refused(c.submit(&depending(257, first)).await, "at most 256");
        // Node labels: 64 are judged against the nodes (none has them), 65 refused unread.
        let labelled = |count: usize| {
            let mut spec = trivial_job("labelled");
            spec.sched.hold = true;
            spec.sched.node_selector = (0..count).map(|i| format!("label{i}=x")).collect();
            spec
        };
        let judged = c.submit(&labelled(64)).await.expect_err("no node has 64 labels");
        assert_eq!(judged.code(), Some(Code::FailedPrecondition), "{judged}");
        assert!(judged.to_string().contains("label63=x"), "{judged}");
        refused(c.submit(&labelled(65)).await, "at most 64");
        assert_eq!(jobs().await, 2, "the refused submits created nothing");

        // A batch: one job too many, or too many dependencies together, is refused whole.
        let batch = |count: usize, each: usize| -> Vec<(String, JobSpec)> {
            (0..count).map(|i| (format!("batch-{count}-{each}-{i}"), depending(each, first))).collect()
        };
        refused(c.submit_batch(&batch(10_001, 0)).await, "at most 10000");
        refused(c.submit_batch(&batch(400, 251)).await, "at most 100000");
        assert_eq!(jobs().await, 2, "a refused batch created nothing");
        let served = c.submit_batch(&batch(398, 251)).await.expect("99898 dependencies");
        assert!(served.iter().all(Result::is_ok), "{:?}", served.iter().find(|r| r.is_err()));

        // A watch names at most 10000 jobs: the largest lists the ones that exist, then goes on.
        let ids: Vec<u64> = (1..=10_000).collect();
        let request = pb::WatchJobsRequest { job_ids: ids.clone(), ..Default::default() };
        let mut stream = c.watch_jobs(request).await.expect("a watch of 10000 ids");
        let mut listed = 0;
        loop {
            let event = tokio::time::timeout(Duration::from_secs(60), stream.message()).await;
            let event = event.expect("in time").expect("an event").expect("not ended");
            match event.job {
                Some(_) => listed += 1,
                None => break,
            }
        }
        assert_eq!(listed, 2 + 398, "every named job that exists, once");
        let request = pb::WatchJobsRequest { job_ids: [ids.clone(), vec![10_001]].concat(), ..Default::default() };
        refused(c.watch_jobs(request).await, "at most 10000");

        // A billing listing names at most 10000 jobs too.
        let query = SegmentQuery { job_ids: ids.clone(), ..Default::default() };
        c.segments_page(&query, "", 0).await.expect("a listing of 10000 ids");
        let query = SegmentQuery { job_ids: [ids, vec![10_001]].concat(), ..Default::default() };
        refused(c.segments_page(&query, "", 0).await, "at most 10000");
    });
}

/// A watch buffers a few events per client, and a principal may hold many watches: its events
/// carry each job without the script and environment (up to 1 MiB and 256 KiB), which `GetJob`
/// still returns whole, as a listing does unless it asks to be brief.
#[test]
fn watches_and_brief_listings_send_jobs_without_their_script_and_environment() {
    let pool = DevPool::start(&["--gpus", "1"]);
    let rt = runtime();
    let c = client(&pool.addr);
    rt.block_on(async {
        let mut spec = trivial_job("big");
        spec.sched.hold = true;
        let script = format!("#!/bin/sh\n#{}\ntrue\n", "x".repeat(corral_types::MAX_SCRIPT_BYTES - 20));
        spec.script = Some(script.clone().into());
        spec.batch_step = true;
        spec.command = Vec::new().into();
        spec.env = std::sync::Arc::new([("BIG".to_string(), "y".repeat(200_000))].into());
        let id = c.submit(&spec).await.expect("the largest script is legal").job_id;

        let whole = c.get_job(id).await.expect("get");
        assert_eq!(whole.spec.script.as_deref(), Some(script.as_str()), "GetJob returns the script");
        assert_eq!(whole.spec.env.len(), 1, "GetJob returns the environment");

        let request = pb::WatchJobsRequest { job_ids: vec![id], ..Default::default() };
        let mut stream = c.watch_jobs(request).await.expect("watch");
        let event = tokio::time::timeout(Duration::from_secs(30), stream.message()).await;
        let job = event.expect("in time").expect("an event").expect("not ended").job.expect("the job");
        let watched = job.spec.expect("its spec");
        assert_eq!(watched.script, None, "no script in a watch event");
        assert!(watched.env.is_empty(), "no environment in a watch event");
        assert!(watched.batch_step, "still says it is a batch job");
        assert_eq!(watched.name, "big");

        let mut one = c.watch_job(id).await.expect("watch one");
        let first = tokio::time::timeout(Duration::from_secs(30), one.message()).await;
        let job = first.expect("in time").expect("a reply").expect("not ended");
        let watched = job.spec.expect("its spec");
        assert_eq!(watched.script, None, "no script from WatchJob");
        assert!(watched.env.is_empty(), "no environment from WatchJob");

        // A listing has them unless it asks to be brief, as `corral queue` and `jobs` do.
        let full = c.list_jobs_page(&JobQuery::default(), "", 0).await.expect("list").items;
        assert_eq!((full.len(), full[0].spec.script.as_deref()), (1, Some(script.as_str())));
        assert_eq!(full[0].spec.env.len(), 1);
        let query = JobQuery { brief: true, ..Default::default() };
        let brief = c.list_jobs_page(&query, "", 0).await.expect("brief list").items;
        assert_eq!((brief.len(), brief[0].spec.script.as_deref()), (1, None), "no script in a brief listing");
        assert!(brief[0].spec.env.is_empty(), "no environment in a brief listing");
        assert_eq!((brief[0].id, brief[0].spec.name.as_str(), brief[0].state), (id, "big", full[0].state));
    });
}
