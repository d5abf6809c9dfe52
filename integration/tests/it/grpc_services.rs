//! The standard gRPC services on real processes: server reflection lists what a coordinator
//! and a worker serve; grpc.health.v1 says SERVING on a leader and a registered worker,
//! NOT_SERVING on a follower, which flips to SERVING when it becomes leader. Over mutual TLS any
//! certificate of the cluster CA may call them, a caller without one may not.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::worker::WorkerProc;
use corral_integration::{corral_bin, DevPool};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::ServerReflectionRequest;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}")).expect("uri").connect().await.expect("connect")
}

/// The services that `addr` lists through reflection (v1).
async fn services(addr: &str) -> BTreeSet<String> {
    let mut client = ServerReflectionClient::new(channel(addr).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies =
        client.server_reflection_info(tokio_stream::iter([request])).await.expect("reflection").into_inner();
    match replies.message().await.expect("reply").and_then(|r| r.message_response) {
        Some(MessageResponse::ListServicesResponse(list)) => list.service.into_iter().map(|s| s.name).collect(),
        other => panic!("unexpected reflection reply: {other:?}"),
    }
}

/// Whether `addr` can describe `symbol` (reflection serves the file that declares it).
async fn describes(addr: &str, symbol: &str) -> bool {
    let mut client = ServerReflectionClient::new(channel(addr).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(symbol.to_string())),
    };
    let mut replies =
        client.server_reflection_info(tokio_stream::iter([request])).await.expect("reflection").into_inner();
    matches!(
        replies.message().await.expect("reply").and_then(|r| r.message_response),
        Some(MessageResponse::FileDescriptorResponse(files)) if !files.file_descriptor_proto.is_empty()
    )
}

async fn health(addr: &str, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(channel(addr).await);
    let reply = client.check(HealthCheckRequest { service: service.to_string() }).await.expect("health check");
    ServingStatus::try_from(reply.into_inner().status).expect("status")
}

/// Polls `addr`'s health of `service` until it is `want` (within a minute).
async fn wait_health(addr: &str, service: &str, want: ServingStatus) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = health(addr, service).await;
        if now == want {
            return;
        }
        assert!(Instant::now() < deadline, "{addr} health of '{service}' stayed {now:?}, expected {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn reflection_and_health_on_a_dev_coordinator_and_its_worker() {
    let pool = DevPool::start(&["--gpus", "1"]);
    let nodes = pool.json(&["nodes"]);
    let worker = nodes[0]["address"].as_str().expect("worker address").to_string();
    runtime().block_on(async {
        let listed = services(&pool.addr).await;
        for service in [
            "corral.v1.Corral",
            "corral.v1.WorkerGateway",
            "corral.v1.ClusterAdmin",
            "corral.raft.v1.Raft",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
        ] {
            assert!(listed.contains(service), "{service} not listed by the coordinator: {listed:?}");
        }
        assert!(!listed.contains("corral.v1.WorkerAgent"), "the coordinator lists the worker's service: {listed:?}");
        assert!(describes(&pool.addr, "corral.v1.Corral.WatchJobs").await);
        assert!(describes(&pool.addr, "corral.v1.JobEvent").await);
        wait_health(&pool.addr, "", ServingStatus::Serving).await;
        assert_eq!(health(&pool.addr, "corral.v1.Corral").await, ServingStatus::Serving);

        let listed = services(&worker).await;
        assert!(listed.contains("corral.v1.WorkerAgent") && listed.contains("grpc.health.v1.Health"), "{listed:?}");
        assert!(!listed.contains("corral.v1.Corral"), "the worker lists the coordinator's API: {listed:?}");
        wait_health(&worker, "", ServingStatus::Serving).await;
        assert_eq!(health(&worker, "corral.v1.WorkerAgent").await, ServingStatus::Serving);
        // An unknown service is NOT_FOUND, as the health protocol says.
        let mut client = HealthClient::new(channel(&worker).await);
        let err = client.check(HealthCheckRequest { service: "no.such.Service".into() }).await.expect_err("unknown");
        assert_eq!(err.code(), tonic::Code::NotFound);
    });
}

#[test]
fn a_follower_is_not_serving_until_it_becomes_leader() {
    let mut cluster = Cluster::start(3, ClusterOptions::default());
    cluster.init_and_join_all();
    let leader = cluster.leader();
    let rt = runtime();
    let addrs: Vec<String> = cluster.nodes.iter().map(|n| n.addr.clone()).collect();
    rt.block_on(async {
        wait_health(&addrs[leader], "", ServingStatus::Serving).await;
        for (i, addr) in addrs.iter().enumerate().filter(|(i, _)| *i != leader) {
            assert_eq!(health(addr, "").await, ServingStatus::NotServing, "follower {i}");
            assert_eq!(health(addr, "corral.v1.Corral").await, ServingStatus::NotServing, "follower {i}");
            // Raft and cluster admin answer on every member.
            assert_eq!(health(addr, "corral.raft.v1.Raft").await, ServingStatus::Serving, "follower {i}");
            assert_eq!(health(addr, "corral.v1.ClusterAdmin").await, ServingStatus::Serving, "follower {i}");
        }
    });
    cluster.kill(leader);
    let new_leader = cluster.leader();
    assert_ne!(new_leader, leader);
    rt.block_on(async {
        wait_health(&addrs[new_leader], "", ServingStatus::Serving).await;
        wait_health(&addrs[new_leader], "corral.v1.Corral", ServingStatus::Serving).await;
        let other = (0..3).find(|i| *i != leader && *i != new_leader).expect("the third node");
        assert_eq!(health(&addrs[other], "").await, ServingStatus::NotServing);
    });
}

/// A TLS channel to `addr` presenting certificate `cert` of `certs` (or none).
async fn tls_channel(certs: &Path, cert: Option<&str>, addr: &str) -> Channel {
    let ca = tonic::transport::Certificate::from_pem(std::fs::read(certs.join("ca.pem")).expect("ca"));
    let mut tls = tonic::transport::ClientTlsConfig::new().ca_certificate(ca);
    if let Some(cert) = cert {
        let pem = std::fs::read(certs.join(format!("{cert}.pem"))).expect("cert");
        let key = std::fs::read(certs.join(format!("{cert}-key.pem"))).expect("key");
        tls = tls.identity(tonic::transport::Identity::from_pem(pem, key));
    }
    let endpoint = Channel::from_shared(format!("https://{addr}")).expect("uri").tls_config(tls).expect("tls");
    endpoint.connect().await.expect("connect")
}

#[test]
fn over_tls_every_certificate_of_the_cluster_may_probe_and_none_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    let out = std::process::Command::new(corral_bin())
        .args(["certs", "init", "--dir"])
        .arg(&certs)
        .args(["--coordinators", "1", "--workers", "w1", "--clients", "user"])
        .output()
        .expect("corral certs init");
    assert!(out.status.success(), "certs init: {}", String::from_utf8_lossy(&out.stderr));
    // With the CA key the coordinator completes handshakes without a client certificate (for
    // joining workers), so the role guard is what refuses them.
    let options = ClusterOptions { tls: Some(certs.clone()), sign_joins: true, ..Default::default() };
    let cluster = Cluster::start(1, options);
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "init: {}", String::from_utf8_lossy(&init.stderr));
    let addr = cluster.nodes[0].addr.clone();
    runtime().block_on(async {
        for cert in ["worker-w1", "client-user", "admin", "coordinator-1"] {
            let channel = tls_channel(&certs, Some(cert), &addr).await;
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let mut client = HealthClient::new(channel.clone());
                let reply = client.check(HealthCheckRequest { service: String::new() }).await;
                let status = reply.unwrap_or_else(|e| panic!("{cert}: {e}")).into_inner().status;
                if status == ServingStatus::Serving as i32 {
                    break;
                }
                assert!(Instant::now() < deadline, "{cert}: the leader never said SERVING");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let channel = tls_channel(&certs, None, &addr).await;
        let err = HealthClient::new(channel)
            .check(HealthCheckRequest { service: String::new() })
            .await
            .expect_err("a caller without a certificate");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
        assert!(err.message().contains("without a client certificate"), "{err}");
    });
}

#[test]
fn a_worker_is_not_serving_once_no_leader_answers_it() {
    let mut cluster = Cluster::start(1, ClusterOptions { node_ttl: "2s".into(), ..Default::default() });
    cluster.init_and_join_all();
    let mut worker = WorkerProc::configure(cluster.dir(), "w1", &cluster.endpoints(), 1);
    worker.start();
    worker.wait_registered(&cluster);
    let nodes = cluster.json(&["nodes"]);
    let addr = nodes[0]["address"].as_str().expect("worker address").to_string();
    let rt = runtime();
    rt.block_on(wait_health(&addr, "", ServingStatus::Serving));
    // Without a coordinator the worker's lease runs out (fence-after, 1s here): it stops
    // serving until a leader answers again.
    cluster.kill(0);
    rt.block_on(wait_health(&addr, "", ServingStatus::NotServing));
    rt.block_on(wait_health(&addr, "corral.v1.WorkerAgent", ServingStatus::NotServing));
    cluster.restart(0);
    rt.block_on(wait_health(&addr, "", ServingStatus::Serving));
}
