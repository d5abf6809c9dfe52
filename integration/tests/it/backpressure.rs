//! Backpressure on a real coordinator: with a tiny submit queue, a burst of submits is refused
//! with RESOURCE_EXHAUSTED and a retry-after at the server, and corral's client still lands
//! every job of a burst exactly once; with every client-request slot taken, the CLI waits the
//! refusals out and answers once the load ends.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::trivial_job;
use corral_proto::v1 as pb;
use std::collections::BTreeSet;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime")
}

/// A job that stays pending (no worker needed).
fn held(name: &str) -> corral_types::JobSpec {
    let mut spec = trivial_job(name);
    spec.sched.hold = true;
    spec
}

#[test]
fn a_full_submit_queue_refuses_with_a_retry_after_and_the_client_still_lands_every_job_once() {
    // One coordinator whose queue holds 4 jobs, and whose every group waits 300ms before it is
    // proposed: a burst overflows it.
    let options = ClusterOptions {
        extra_config: "\n[limits]\nmax-queued-submits = 4\n".into(),
        node_env: vec![(0, "FAILPOINTS".into(), "group-commit-delay-ms=return(300)".into())],
        ..Default::default()
    };
    let cluster = Cluster::start(1, options);
    cluster.init_and_join_all();
    cluster.leader();
    let rt = runtime();
    let addr = cluster.nodes[0].addr.clone();

    // The server level: a burst of raw Submits, each tried once.
    let refusals = rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connect");
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..48 {
            let mut raw = pb::corral_client::CorralClient::new(channel.clone());
            let request = pb::SubmitRequest { request_id: format!("raw-{i}"), spec: Some((&held("raw")).into()) };
            calls.spawn(async move { raw.submit(request).await });
        }
        let mut refusals = Vec::new();
        while let Some(done) = calls.join_next().await {
            if let Err(status) = done.expect("call") {
                refusals.push(status);
            }
        }
        refusals
    });
    assert!(!refusals.is_empty(), "48 submits at once never filled a queue of 4");
    for status in &refusals {
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        let retry_after: u64 = status
            .metadata()
            .get(corral_proto::RETRY_AFTER_METADATA)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no retry-after in {status:?}"));
        assert!(retry_after > 0);
        assert!(status.message().contains("retry after"), "{}", status.message());
    }
    let raw_accepted = 48 - refusals.len();

    // corral's client waits the refusals out: every job of a burst lands, exactly once.
    let client = Client::new(ClientConfig::new(vec![addr.clone()])).expect("client");
    let landed = rt.block_on(async {
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..40 {
            let client = client.clone();
            calls.spawn(async move { client.submit_with_id(&format!("burst-{i}"), &held("burst")).await });
        }
        let mut landed = Vec::new();
        while let Some(done) = calls.join_next().await {
            landed.push(done.expect("task").expect("the client retries until the job lands"));
        }
        landed
    });
    let job_ids: BTreeSet<u64> = landed.iter().map(|s| s.job_id).collect();
    assert_eq!(job_ids.len(), 40, "one job per request id");
    let jobs = rt.block_on(client.list_jobs(true, None)).expect("list");
    let burst: Vec<&corral_types::Job> = jobs.iter().filter(|j| j.request_id.starts_with("burst-")).collect();
    let request_ids: BTreeSet<&str> = burst.iter().map(|j| j.request_id.as_str()).collect();
    assert_eq!((burst.len(), request_ids.len()), (40, 40), "every burst job exactly once");
    assert_eq!(jobs.iter().filter(|j| j.request_id.starts_with("raw-")).count(), raw_accepted);
}

#[test]
fn with_every_client_request_slot_taken_the_cli_waits_and_answers_once_the_load_ends() {
    // One slot for client requests, and the first listing holds it for two seconds.
    let options = ClusterOptions {
        extra_config: "\n[limits]\nmax-client-requests = 1\n".into(),
        node_env: vec![(
            0,
            "FAILPOINTS".into(),
            format!("{}=1*return(2000)", corral_coordinator::LIST_JOBS_DELAY_FAILPOINT),
        )],
        ..Default::default()
    };
    let cluster = Cluster::start(1, options);
    cluster.init_and_join_all();
    cluster.leader();
    let rt = runtime();
    let addr = cluster.nodes[0].addr.clone();
    let channel = rt.block_on(async {
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connect")
    });
    // The API serves (a job that does not exist is not found) before the slot is taken.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let mut raw = pb::corral_client::CorralClient::new(channel.clone());
        let answer = rt.block_on(raw.get_job(pb::GetJobRequest { job_id: 1, ..Default::default() }));
        match answer {
            Err(status) if status.code() == tonic::Code::NotFound => break,
            other => assert!(std::time::Instant::now() < deadline, "the API does not serve: {other:?}"),
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut raw = pb::corral_client::CorralClient::new(channel.clone());
    let load = rt.spawn(async move {
        let started = std::time::Instant::now();
        raw.list_jobs(pb::ListJobsRequest::default()).await.map(|_| started.elapsed())
    });
    std::thread::sleep(std::time::Duration::from_millis(300));

    // The coordinator is full: a call tried once is refused, with a retry-after.
    let refused = rt
        .block_on(
            pb::corral_client::CorralClient::new(channel)
                .get_job(pb::GetJobRequest { job_id: 1, ..Default::default() }),
        )
        .expect_err("the one slot is taken");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}\n{}", cluster.log_of(0));
    assert!(refused.metadata().get(corral_proto::RETRY_AFTER_METADATA).is_some(), "{refused:?}");

    // The CLI, started while the slot is taken, is refused too, waits, and answers.
    let started = std::time::Instant::now();
    let out = cluster.corral_at(0, &["jobs"]);
    let waited = started.elapsed();
    assert!(out.status.success(), "the CLI gave up: {}", String::from_utf8_lossy(&out.stderr));
    assert!(waited >= std::time::Duration::from_millis(1000), "answered in {waited:?}: the slot was not taken");
    let held = rt.block_on(load).expect("task").expect("the slow listing itself is answered");
    assert!(held >= std::time::Duration::from_millis(1500), "the failpoint held the slot {held:?}");
}
