//! Workers joining a TLS cluster with single-use tokens (`corral node join-token`, `corral
//! worker --join ADDR --token T`): a worker joins through a follower, runs a job over mutual
//! TLS and restarts without its token; reused (also after a failover), unknown and expired
//! tokens are refused and audited; a client without a certificate reaches the join service
//! and nothing else; a cluster without TLS refuses to issue join tokens. A joined worker's
//! certificate lives `tls.worker-cert-lifetime` and names only the node and its address; the
//! worker renews it with the certificate itself; `corral node remove` revokes it.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::corral_bin;
use corral_integration::worker::WorkerProc;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A TLS cluster of `n` coordinators holding the CA key, initialized, and its temp dir.
fn signing_cluster(n: u64) -> (Cluster, tempfile::TempDir) {
    signing_cluster_with(n, None)
}

/// [`signing_cluster`] whose worker certificates live `worker_cert_lifetime` (e.g. "20s").
fn signing_cluster_with(n: u64, worker_cert_lifetime: Option<&str>) -> (Cluster, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    // Jobs run as nobody: let them into their work dirs under the worker's data dir.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let certs = dir.path().join("certs");
    let out = Command::new(corral_bin())
        .args(["certs", "init", "--dir"])
        .arg(&certs)
        .args(["--coordinators", &n.to_string()])
        .output()
        .expect("certs init");
    assert!(out.status.success(), "certs init: {}", String::from_utf8_lossy(&out.stderr));
    let options = ClusterOptions {
        tls: Some(certs),
        sign_joins: true,
        worker_cert_lifetime: worker_cert_lifetime.map(String::from),
        node_ttl: "3s".into(),
        ..Default::default()
    };
    let cluster = Cluster::start(n, options);
    cluster.init_and_join_all();
    (cluster, dir)
}

/// `corral node join-token` through every endpoint: (id, token).
fn join_token(cluster: &Cluster, ttl: &str) -> (u64, String) {
    let doc = cluster.json(&["node", "join-token", "--ttl", ttl]);
    let token = doc["token"].as_str().expect("token").to_string();
    assert!(token.starts_with("crlj1."), "{doc}");
    (doc["id"].as_u64().expect("id"), token)
}

/// Runs `corral worker --join addr --token token` for `worker`'s config, which must exit
/// non-zero within 30 s; returns the last line of its stderr (the error).
fn refused_join(worker: &WorkerProc, addr: &str, token: &str) -> String {
    let mut child = Command::new(corral_bin())
        .current_dir(worker.config.parent().expect("dir"))
        .args(["worker", "--config"])
        .arg(&worker.config)
        .args(["--join", addr, "--token", token])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn worker");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("corral worker --join {addr} was not refused within 30s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
    assert!(!status.success(), "the join was not refused: {stderr}");
    let last = stderr.lines().last().unwrap_or_default().to_string();
    assert!(last.starts_with("error: "), "the error is not the last line: {stderr}");
    last
}

fn audit(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("audit line {l}: {e}")))
        .collect()
}

/// Waits until some coordinator's audit log has a `node join` denial containing `detail`.
fn assert_join_denial_audited(cluster: &Cluster, detail: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines: Vec<Value> =
            (0..cluster.nodes.len()).flat_map(|i| audit(&cluster.data_dir(i).join("audit.jsonl"))).collect();
        if lines.iter().any(|l| {
            l["outcome"] == "denied"
                && l["action"] == "node join"
                && l["detail"].as_str().is_some_and(|d| d.contains(detail))
        }) {
            return;
        }
        assert!(Instant::now() < deadline, "no audited join denial with '{detail}' in {lines:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run_job(cluster: &Cluster, text: &str) {
    let job = cluster.json(&["submit", "--", "sh", "-c", &format!("echo {text}")])["id"].as_u64().expect("job id");
    let doc = cluster
        .wait_for(job, Duration::from_secs(60), "succeeded", |d| d["state"] == "succeeded" || d["state"] == "failed");
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!(doc["node"], "joined", "{doc}");
    let out = Command::new(corral_bin())
        .args(cluster.admin_tls_args())
        .args(["--endpoint", &cluster.endpoints(), "logs", &job.to_string()])
        .output()
        .expect("logs");
    // The coordinator reads the logs from the joined worker's agent over mutual TLS.
    assert!(String::from_utf8_lossy(&out.stdout).contains(text), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_worker_joins_with_a_token_runs_jobs_and_restarts_without_it_and_reuse_is_refused_after_failover() {
    let (mut cluster, dir) = signing_cluster(3);
    let (_, token) = join_token(&cluster, "10m");
    // Join through a follower: it refers the worker to the leader, which spends the token.
    let leader = cluster.leader();
    let follower = (leader + 1) % 3;
    let mut worker = WorkerProc::configure(dir.path(), "joined", &cluster.endpoints(), 2);
    worker.join_with(Some((&cluster.nodes[follower].addr, &token)));
    worker.start();
    worker.wait_registered(&cluster);
    let stored = worker.data_dir.join("tls");
    let mode = std::fs::metadata(stored.join("key.pem")).expect("key stored").permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(stored.join("cert.pem").exists() && stored.join("ca.pem").exists());
    run_job(&cluster, "hello-from-a-joined-worker");

    // A restart needs no token: the worker finds its credentials in its data dir.
    worker.kill();
    worker.join_with(None);
    worker.start();
    let deadline = Instant::now() + Duration::from_secs(30);
    while worker.log().matches("registered with the leader").count() < 2 {
        assert!(Instant::now() < deadline, "the restarted worker did not register: {}", worker.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    run_job(&cluster, "again-after-a-restart");

    // The token is spent everywhere: another worker is refused through any coordinator, also
    // once the leader that admitted the first one is gone.
    let other = WorkerProc::configure(dir.path(), "intruder", &cluster.endpoints(), 1);
    let reused = refused_join(&other, &cluster.nodes[leader].addr, &token);
    assert!(reused.contains("join refused: join token 1 was already used by node 'joined'"), "{reused}");
    cluster.kill(leader);
    let survivor = (leader + 2) % 3;
    let reused = refused_join(&other, &cluster.nodes[survivor].addr, &token);
    assert!(reused.contains("was already used by node 'joined'"), "{reused}");
    assert!(!other.data_dir.join("tls").join("cert.pem").exists(), "a refused worker stored credentials");
    assert_join_denial_audited(&cluster, "join token 1 was already used");
}

#[test]
fn unknown_expired_and_foreign_tokens_are_refused_and_audited() {
    let (cluster, dir) = signing_cluster(1);
    let addr = cluster.nodes[0].addr.clone();
    let worker = WorkerProc::configure(dir.path(), "late", &cluster.endpoints(), 1);
    let (_, token) = join_token(&cluster, "1s");
    let pin = token.rsplit('.').next().expect("pin").to_string();

    // Unknown: the right CA, a secret the cluster never issued.
    let unknown = refused_join(&worker, &addr, &format!("crlj1.{}.{pin}", "ab".repeat(32)));
    assert!(unknown.contains("join refused: unknown join token: not issued by this cluster"), "{unknown}");
    assert_join_denial_audited(&cluster, "unknown join token");

    // Expired: judged at the TSO timestamp of the consume, on every coordinator alike.
    std::thread::sleep(Duration::from_millis(1500));
    let expired = refused_join(&worker, &addr, &token);
    assert!(expired.contains("join refused: join token 1 expired"), "{expired}");
    assert_join_denial_audited(&cluster, "join token 1 expired");

    // A token pinning another CA: the worker refuses the coordinator before sending anything.
    let foreign = refused_join(&worker, &addr, &format!("crlj1.{}.{}", "ab".repeat(32), "cd".repeat(32)));
    assert!(foreign.contains("the coordinator's CA is not the one the join token names"), "{foreign}");
    // Not a token at all.
    let garbage = refused_join(&worker, &addr, "crl_0123");
    assert!(garbage.contains("--token: not a join token"), "{garbage}");
    assert!(!worker.data_dir.join("tls").join("cert.pem").exists());

    // Issuing is audited, and only an admin certificate may issue.
    let lines = audit(&cluster.data_dir(0).join("audit.jsonl"));
    assert!(lines.iter().any(|l| l["outcome"] == "admin" && l["action"] == "node join-token"), "{lines:#?}");
    let certs = dir.path().join("certs");
    let out = Command::new(corral_bin())
        .args(corral_integration::tls_args(&certs, "coordinator-1"))
        .args(["--endpoint", &addr, "node", "join-token"])
        .output()
        .expect("corral");
    let stderr = corral_integration::one_line_stderr(&out);
    assert!(!out.status.success() && stderr.contains("node join-token needs an admin certificate"), "{stderr}");
}

/// A gRPC channel over TLS trusting the cluster CA, presenting no client certificate.
async fn anonymous_channel(certs: &Path, addr: &str) -> tonic::transport::Channel {
    let ca = tonic::transport::Certificate::from_pem(std::fs::read(certs.join("ca.pem")).expect("ca"));
    let tls = tonic::transport::ClientTlsConfig::new().ca_certificate(ca);
    tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .expect("a coordinator that signs joins completes a handshake without a client certificate")
}

fn refusal<T>(result: Result<tonic::Response<T>, tonic::Status>) -> String {
    match result {
        Ok(_) => panic!("a peer without a client certificate got an answer"),
        Err(status) => format!("{:?}: {}", status.code(), status.message()),
    }
}

#[test]
fn a_peer_without_a_certificate_reaches_only_the_join_service() {
    use corral_proto::v1 as pb;
    let (cluster, dir) = signing_cluster(1);
    let certs = dir.path().join("certs");
    let addr = cluster.nodes[0].addr.clone();
    // A token the cluster issued: its secret gets as far as the certificate request.
    let (_, issued) = join_token(&cluster, "10m");
    let issued_secret = issued.split('.').nth(1).expect("crlj1.<secret>.<pin>").to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let refusals = rt.block_on(async {
        let channel = anonymous_channel(&certs, &addr).await;
        let mut api = pb::corral_client::CorralClient::new(channel.clone());
        let mut gateway = pb::worker_gateway_client::WorkerGatewayClient::new(channel.clone());
        let mut admin = pb::cluster_admin_client::ClusterAdminClient::new(channel.clone());
        let mut raft = corral_proto::raft::raft_client::RaftClient::new(channel.clone());
        let mut join = pb::node_join_client::NodeJoinClient::new(channel);
        vec![
            ("user API", refusal(api.list_jobs(pb::ListJobsRequest::default()).await)),
            ("user API", refusal(api.list_nodes(pb::ListNodesRequest::default()).await)),
            (
                "worker gateway",
                refusal(gateway.heartbeat(pb::HeartbeatRequest { node: "w1".into(), ..Default::default() }).await),
            ),
            ("cluster admin", refusal(admin.status(pb::ClusterStatusRequest::default()).await)),
            ("cluster admin", refusal(admin.create_join_token(pb::CreateJoinTokenRequest { ttl_ms: 60_000 }).await)),
            ("raft", refusal(raft.append_entries(corral_proto::raft::AppendEntriesRequest::default()).await)),
            // The join service answers, and refuses what is not a valid token before it
            // looks at the certificate request; a valid token with an unusable one is refused
            // for that.
            ("join", refusal(join.join(pb::JoinNodeRequest { secret: "guess".into(), csr: vec![1, 2, 3] }).await)),
            ("join", refusal(join.join(pb::JoinNodeRequest { secret: issued_secret, csr: vec![1, 2, 3] }).await)),
        ]
    });
    for (service, refused) in &refusals[..6] {
        let expected = format!("PermissionDenied: permission denied: a peer without a client certificate cannot call the {service} service");
        assert_eq!(refused, &expected);
    }
    assert!(refusals[6].1.contains("unknown join token"), "{:?}", refusals[6]);
    assert!(refusals[7].1.contains("unusable certificate request"), "{:?}", refusals[7]);
    let lines = audit(&cluster.data_dir(0).join("audit.jsonl"));
    let denied = lines
        .iter()
        .filter(|l| {
            l["outcome"] == "denied"
                && l["peer"].as_str().is_some_and(|p| p.starts_with("peer without a client certificate"))
        })
        .count();
    assert_eq!(denied, 8, "{lines:#?}");
}

#[test]
fn a_cluster_without_tls_issues_no_join_tokens() {
    let cluster = Cluster::start(1, ClusterOptions::default());
    cluster.init_and_join_all();
    let out = cluster.corral_at(0, &["node", "join-token"]);
    let stderr = corral_integration::one_line_stderr(&out);
    assert!(!out.status.success(), "join-token succeeded without TLS");
    assert!(stderr.contains("join tokens need TLS"), "{stderr}");
}

/// What a joined worker's stored certificate says.
fn stored_identity(worker: &WorkerProc) -> corral_security::PeerIdentity {
    corral_security::certificate_identity(&worker.data_dir.join("tls").join("cert.pem")).expect("stored certificate")
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs()
}

/// A joined worker's certificate is valid for `tls.worker-cert-lifetime` and for its node name
/// and advertised address only; two thirds into its life the worker renews it over a
/// connection made with it (no token), and keeps working once the first one expired: the
/// coordinator reaches its agent, which serves the new certificate, and a restarted worker
/// connects with it.
#[test]
fn a_joined_worker_renews_its_certificate_before_it_expires() {
    let (cluster, dir) = signing_cluster_with(1, Some("20s"));
    let (_, token) = join_token(&cluster, "10m");
    let mut worker = WorkerProc::configure(dir.path(), "joined", &cluster.endpoints(), 2);
    worker.join_with(Some((&cluster.nodes[0].addr, &token)));
    worker.start();
    worker.wait_registered(&cluster);
    let first = stored_identity(&worker);
    assert_eq!((first.role, first.name.as_str()), (corral_security::Role::Worker, "joined"));
    assert_eq!(first.not_after_s - first.issued_at_s(), 20, "{first:?}");
    assert!(first.issued_at_s().abs_diff(now_s()) < 30, "{first:?}");

    let deadline = Instant::now() + Duration::from_secs(60);
    while stored_identity(&worker).not_after_s <= first.not_after_s {
        assert!(Instant::now() < deadline, "the certificate was not renewed: {}", worker.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(worker.log().contains("renewed the worker certificate"), "{}", worker.log());
    let lines = audit(&cluster.data_dir(0).join("audit.jsonl"));
    assert!(
        lines.iter().any(|l| l["outcome"] == "admin" && l["action"] == "node renew" && l["principal"] == "node joined"),
        "{lines:#?}"
    );
    // Past the first certificate's expiry the worker still runs jobs and serves their logs.
    while now_s() <= first.not_after_s + 1 {
        std::thread::sleep(Duration::from_millis(200));
    }
    run_job(&cluster, "after-the-first-certificate-expired");
    worker.kill();
    worker.join_with(None);
    worker.start();
    let deadline = Instant::now() + Duration::from_secs(30);
    while worker.log().matches("registered with the leader").count() < 2 {
        assert!(Instant::now() < deadline, "the restarted worker did not register: {}", worker.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    run_job(&cluster, "after-a-restart-with-the-renewed-certificate");
}

/// `corral node remove` revokes the node's certificates: its worker, still running, is refused
/// on its next call and at every new handshake, cannot renew and cannot register again; the
/// node comes back only by joining again with a new token, under the same name.
#[test]
fn removing_a_node_revokes_its_certificate_until_it_joins_again() {
    let (cluster, dir) = signing_cluster(1);
    let (_, token) = join_token(&cluster, "10m");
    let mut worker = WorkerProc::configure(dir.path(), "joined", &cluster.endpoints(), 1);
    worker.join_with(Some((&cluster.nodes[0].addr, &token)));
    worker.start();
    worker.wait_registered(&cluster);
    let cordon = cluster.corral_at(0, &["node", "cordon", "joined"]);
    assert!(cordon.status.success(), "cordon: {}", String::from_utf8_lossy(&cordon.stderr));
    let remove = cluster.corral_at(0, &["node", "remove", "joined"]);
    assert!(remove.status.success(), "remove: {}", String::from_utf8_lossy(&remove.stderr));

    // The worker, left running, is refused: on its open connection, then at its handshakes.
    let revoked = |l: &Value| l["outcome"] == "denied" && l["detail"].as_str().is_some_and(|d| d.contains("revoked"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !audit(&cluster.data_dir(0).join("audit.jsonl")).iter().any(revoked) {
        assert!(Instant::now() < deadline, "no revoked certificate refused: {}", worker.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    // The worker hears why, and its node stays gone.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !worker.log().contains("was revoked") {
        assert!(Instant::now() < deadline, "the worker was not told its certificate is revoked: {}", worker.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let nodes = cluster.json(&["nodes"]);
    assert!(
        nodes.as_array().is_some_and(|n| n.iter().all(|n| n["name"] != "joined")),
        "the removed worker registered again: {nodes}"
    );
    // A new connection with the revoked certificate fails its handshake.
    let stored = worker.data_dir.join("tls");
    let out = Command::new(corral_bin())
        .args(["--ca"])
        .arg(stored.join("ca.pem"))
        .args(["--cert"])
        .arg(stored.join("cert.pem"))
        .args(["--key"])
        .arg(stored.join("key.pem"))
        .args(["--endpoint", &cluster.endpoints(), "jobs"])
        .output()
        .expect("corral");
    let stderr = corral_integration::one_line_stderr(&out);
    assert!(!out.status.success(), "a revoked certificate was served");
    assert!(stderr.contains("revoked"), "{stderr}");
    let lines = audit(&cluster.data_dir(0).join("audit.jsonl"));
    assert!(
        lines.iter().any(|l| l["action"] == "tls-handshake" && l["detail"] == "client certificate revoked"),
        "{lines:#?}"
    );

    // It joins again under its name with a new token: a certificate issued after the removal.
    worker.kill();
    std::fs::remove_dir_all(&stored).expect("remove the revoked credentials");
    let (_, token) = join_token(&cluster, "10m");
    worker.join_with(Some((&cluster.nodes[0].addr, &token)));
    worker.start();
    worker.wait_registered(&cluster);
    let resume = cluster.corral_at(0, &["node", "resume", "joined"]);
    assert!(resume.status.success(), "resume: {}", String::from_utf8_lossy(&resume.stderr));
    run_job(&cluster, "back-after-joining-again");
}
