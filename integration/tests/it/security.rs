//! Multi-tenant security over mutual TLS: the denial matrix (no certificate, a foreign CA, the
//! wrong role, another tenant's token, expired, revoked and unknown tokens), each refused with
//! a clear error and written to the coordinator's audit log; and the happy path, where an admin
//! issues tokens and tenants run jobs on a worker that talks TLS too.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::worker::WorkerProc;
use corral_integration::{corral_bin, tls_args};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A one-coordinator TLS cluster with a TLS worker `w1`, and its certificate directory.
struct Secure {
    cluster: Cluster,
    worker: WorkerProc,
    certs: PathBuf,
    _dir: tempfile::TempDir,
}

fn certs_init(dir: &Path, extra: &[&str]) {
    let out = Command::new(corral_bin())
        .args(["certs", "init", "--dir"])
        .arg(dir)
        .args(["--coordinators", "1", "--workers", "w1", "--clients", "user"])
        .args(extra)
        .output()
        .expect("corral certs init");
    assert!(out.status.success(), "certs init: {}", String::from_utf8_lossy(&out.stderr));
}

fn secure() -> Secure {
    let dir = tempfile::tempdir().expect("tempdir");
    // Jobs run as nobody: let them into their work dirs under the worker's data dir.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let certs = dir.path().join("certs");
    certs_init(&certs, &[]);
    let options = ClusterOptions { tls: Some(certs.clone()), node_ttl: "3s".into(), ..Default::default() };
    let cluster = Cluster::start(1, options);
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "init: {}", String::from_utf8_lossy(&init.stderr));
    let mut worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 2);
    worker.use_tls(&certs);
    worker.start();
    worker.wait_registered(&cluster);
    Secure { cluster, worker, certs, _dir: dir }
}

impl Secure {
    /// Runs the CLI with the given certificate (`admin`, `client-user`, `worker-w1`) and token.
    fn run(&self, cert: &str, token: Option<&str>, args: &[&str]) -> Output {
        let mut command = Command::new(corral_bin());
        command.args(tls_args(&self.certs, cert)).args(["--endpoint", &self.cluster.endpoints()]);
        if let Some(token) = token {
            command.args(["--token", token]);
        }
        command.args(args).output().expect("corral")
    }

    fn ok(&self, cert: &str, token: Option<&str>, args: &[&str]) -> String {
        let out = self.run(cert, token, args);
        assert!(out.status.success(), "corral {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The CLI call fails with one line on stderr containing `expected`.
    fn refused(&self, cert: &str, token: Option<&str>, args: &[&str], expected: &str) -> String {
        let out = self.run(cert, token, args);
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        assert!(
            !out.status.success(),
            "corral {args:?} should be refused, printed {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(stderr.contains(expected), "corral {args:?}: expected '{expected}' in: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one-line error expected: {stderr}");
        stderr
    }

    fn token(&self, args: &[&str]) -> String {
        let mut full = vec!["token", "create"];
        full.extend_from_slice(args);
        self.ok("admin", None, &full).trim().to_string()
    }

    fn audit(&self) -> Vec<Value> {
        audit_lines(&self.cluster.data_dir(0).join("audit.jsonl"))
    }

    /// Waits until the audit log has a denial whose detail contains `detail`.
    fn assert_audited(&self, detail: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let lines = self.audit();
            if let Some(line) = lines
                .iter()
                .find(|l| l["outcome"] == "denied" && l["detail"].as_str().is_some_and(|d| d.contains(detail)))
            {
                return line.clone();
            }
            assert!(Instant::now() < deadline, "no audited denial with '{detail}' in {lines:#?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait_state(&self, token: &str, job: u64, state: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let doc: Value = serde_json::from_str(&self.ok(
                "client-user",
                Some(token),
                &["--output", "json", "show", &job.to_string()],
            ))
            .expect("json");
            if doc["state"] == state {
                return doc;
            }
            assert!(Instant::now() < deadline, "job {job} never became {state}: {doc}\n{}", self.worker.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn audit_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("audit line {l}: {e}")))
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// A gRPC channel to `addr` presenting `cert` (or no certificate at all).
async fn channel(certs: &Path, cert: Option<&str>, addr: &str) -> Result<tonic::transport::Channel, String> {
    let ca = tonic::transport::Certificate::from_pem(std::fs::read(certs.join("ca.pem")).expect("ca"));
    let mut tls = tonic::transport::ClientTlsConfig::new().ca_certificate(ca);
    if let Some(cert) = cert {
        let pem = std::fs::read(certs.join(format!("{cert}.pem"))).expect("cert");
        let key = std::fs::read(certs.join(format!("{cert}-key.pem"))).expect("key");
        tls = tls.identity(tonic::transport::Identity::from_pem(pem, key));
    }
    tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .map_err(|e| e.to_string())?
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn certificates_are_checked_on_every_connection_and_denials_are_audited() {
    let s = secure();
    let addr = s.cluster.nodes[0].addr.clone();

    // No client certificate: the handshake is refused.
    let rt = runtime();
    let no_cert = rt.block_on(async {
        let channel = channel(&s.certs, None, &addr).await?;
        let mut client = corral_proto::v1::corral_client::CorralClient::new(channel);
        client.list_jobs(corral_proto::v1::ListJobsRequest::default()).await.map(|_| ()).map_err(|e| format!("{e:?}"))
    });
    assert!(no_cert.is_err(), "a client without a certificate got an answer");
    s.assert_audited("no client certificate");

    // Plaintext to the TLS port.
    let out = Command::new(corral_bin()).args(["--endpoint", &addr, "jobs"]).output().expect("corral");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("requires TLS"), "{}", String::from_utf8_lossy(&out.stderr));
    s.assert_audited("not a TLS client");

    // A certificate from a foreign CA (the same names, another key).
    let foreign = s._dir.path().join("foreign");
    certs_init(&foreign, &[]);
    let mut command = Command::new(corral_bin());
    command.args(["--ca"]).arg(s.certs.join("ca.pem"));
    command.args(["--cert"]).arg(foreign.join("admin.pem")).args(["--key"]).arg(foreign.join("admin-key.pem"));
    let out = command.args(["--endpoint", &addr, "jobs"]).output().expect("corral");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("refused our client certificate"), "{stderr}");
    s.assert_audited("client certificate not signed by the cluster CA");
    // ... and a server certificate from a CA the client does not trust.
    let mut command = Command::new(corral_bin());
    command.args(["--ca"]).arg(foreign.join("ca.pem"));
    command.args(["--cert"]).arg(s.certs.join("admin.pem")).args(["--key"]).arg(s.certs.join("admin-key.pem"));
    let out = command.args(["--endpoint", &addr, "jobs"]).output().expect("corral");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("server certificate not signed by the configured CA"), "{stderr}");

    // Wrong role: a worker certificate cannot call Raft or cluster admin, nor the user API.
    let raft = rt.block_on(async {
        let channel = channel(&s.certs, Some("worker-w1"), &addr).await?;
        let mut client = corral_proto::raft::raft_client::RaftClient::new(channel);
        client
            .append_entries(corral_proto::raft::AppendEntriesRequest::default())
            .await
            .map(|_| ())
            .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
    });
    let raft = raft.expect_err("a worker certificate called Raft AppendEntries");
    assert!(
        raft.contains("PermissionDenied") && raft.contains("a worker certificate cannot call the raft service"),
        "{raft}"
    );
    s.assert_audited("a worker certificate cannot call the raft service");
    s.refused(
        "worker-w1",
        None,
        &["cluster", "status"],
        "permission denied: a worker certificate cannot call the cluster admin service",
    );
    s.assert_audited("a worker certificate cannot call the cluster admin service");
    s.refused("worker-w1", None, &["jobs"], "a worker certificate cannot call the user API service");
    // A client certificate cannot pose as a worker, nor run cluster admin.
    let gateway = rt.block_on(async {
        let channel = channel(&s.certs, Some("client-user"), &addr).await?;
        let mut client = corral_proto::v1::worker_gateway_client::WorkerGatewayClient::new(channel);
        let request = corral_proto::v1::HeartbeatRequest { node: "w1".into(), ..Default::default() };
        client
            .heartbeat(request)
            .await
            .map(|_| ())
            .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
    });
    let gateway = gateway.expect_err("a client certificate called the worker gateway");
    assert!(gateway.contains("a client certificate cannot call the worker gateway service"), "{gateway}");
    s.assert_audited("a client certificate cannot call the worker gateway service");
    s.refused(
        "client-user",
        None,
        &["cluster", "status"],
        "a client certificate cannot call the cluster admin service",
    );
    // A coordinator certificate is not a user either.
    s.refused("coordinator-1", None, &["jobs"], "a coordinator certificate cannot call the user API service");

    // The worker agent serves logs to coordinators only.
    let agent = s.cluster.json(&["nodes"])[0]["address"].as_str().expect("agent address").to_string();
    let logs = rt.block_on(async {
        let channel = channel(&s.certs, Some("admin"), &agent).await?;
        let mut client = corral_proto::v1::worker_agent_client::WorkerAgentClient::new(channel);
        let request = corral_proto::v1::ReadLogsRequest { job_id: 1, follow: false, rank: 0, tail_bytes: None };
        client
            .read_logs(request)
            .await
            .map(|_| ())
            .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
    });
    let logs = logs.expect_err("an admin certificate read logs from the worker agent directly");
    assert!(logs.contains("only coordinators may read job logs"), "{logs}");
    let worker_audit = audit_lines(&s.worker.data_dir.join("audit.jsonl"));
    assert!(
        worker_audit.iter().any(|l| l["detail"]
            == "an admin certificate cannot call the worker agent service: only coordinators may read job logs from a worker"),
        "{worker_audit:?}"
    );
}

#[test]
fn tenants_see_and_control_only_their_own_jobs_and_every_denial_is_audited() {
    let s = secure();
    let team_a = s.token(&["--tenant", "team-a"]);
    let team_b = s.token(&["--tenant", "team-b"]);
    assert!(team_a.starts_with("crl_") && team_a != team_b, "{team_a}");
    // Only hashes are stored: the secret appears in no state file.
    let tokens: Value =
        serde_json::from_str(&s.ok("admin", None, &["--output", "json", "token", "list"])).expect("json");
    assert_eq!(tokens.as_array().map(Vec::len), Some(2), "{tokens}");
    assert!(!tokens.to_string().contains(&team_a[4..]), "token list shows a secret: {tokens}");

    // Happy path: team-a submits over mTLS (the tenant comes from its token) and the worker runs it.
    let job_a: u64 = s
        .ok("client-user", Some(&team_a), &["submit", "--", "sh", "-c", "echo secret-of-team-a"])
        .trim()
        .parse()
        .expect("id");
    let doc = s.wait_state(&team_a, job_a, "succeeded");
    assert_eq!(doc["tenant"], "team-a");
    assert!(s.ok("client-user", Some(&team_a), &["logs", &job_a.to_string()]).contains("secret-of-team-a"));
    let job_b: u64 = s
        .ok("client-user", Some(&team_b), &["submit", "--tenant", "team-b", "--", "sleep", "30"])
        .trim()
        .parse()
        .expect("id");

    // team-b cannot show, cancel, read the logs of, or bill team-a's job, nor submit as team-a.
    let a = job_a.to_string();
    s.refused(
        "client-user",
        Some(&team_b),
        &["show", &a],
        &format!("permission denied: tenant team-b cannot show job {job_a}"),
    );
    s.refused(
        "client-user",
        Some(&team_b),
        &["cancel", &a],
        &format!("permission denied: tenant team-b cannot cancel job {job_a}"),
    );
    s.refused(
        "client-user",
        Some(&team_b),
        &["logs", &a],
        &format!("permission denied: tenant team-b cannot show job {job_a}"),
    );
    // The log stream itself checks the owner too (the CLI asks for the job first).
    let rt = runtime();
    let logs = rt.block_on(async {
        let channel = channel(&s.certs, Some("client-user"), &s.cluster.nodes[0].addr).await?;
        let mut client = corral_proto::v1::corral_client::CorralClient::new(channel);
        let mut request = tonic::Request::new(corral_proto::v1::ReadLogsRequest {
            job_id: job_a,
            follow: false,
            rank: 0,
            tail_bytes: None,
        });
        request.metadata_mut().insert("authorization", format!("Bearer {team_b}").parse().expect("header"));
        client
            .read_logs(request)
            .await
            .map(|_| ())
            .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
    });
    let logs = logs.expect_err("team-b read team-a's logs");
    assert!(logs.contains("PermissionDenied") && logs.contains("cannot read the logs of job"), "{logs}");
    s.refused(
        "client-user",
        Some(&team_b),
        &["billing", "report", "--tenant", "team-a"],
        "permission denied: tenant team-b cannot see tenant team-a",
    );
    s.refused(
        "client-user",
        Some(&team_b),
        &["submit", "--tenant", "team-a", "--", "true"],
        "tenant team-b cannot submit jobs as tenant team-a",
    );
    s.refused("client-user", Some(&team_b), &["jobs", "--tenant", "team-a"], "cannot see tenant team-a");
    s.refused("client-user", Some(&team_b), &["token", "create", "--tenant", "team-b"], "token create needs an admin");
    for detail in [
        "cannot show job",
        "cannot cancel job",
        "cannot read the logs of job",
        "cannot see tenant team-a",
        "cannot submit jobs as tenant team-a",
        "token create needs an admin",
    ] {
        let line = s.assert_audited(detail);
        assert_eq!(line["principal"].as_str().map(|p| p.starts_with("tenant team-b")), Some(true), "{line}");
    }
    // Listing shows only one's own jobs; the admin sees all.
    let listed: Value =
        serde_json::from_str(&s.ok("client-user", Some(&team_b), &["--output", "json", "jobs", "--all"]))
            .expect("json");
    let ids: Vec<u64> = listed.as_array().expect("array").iter().filter_map(|j| j["id"].as_u64()).collect();
    assert_eq!(ids, vec![job_b], "team-b sees {listed}");
    let all = s.cluster.json(&["jobs", "--all"]);
    assert_eq!(all.as_array().map(Vec::len), Some(2), "admin sees {all}");
    // team-a's bill holds only team-a.
    let bill = s.ok("client-user", Some(&team_a), &["billing", "report", "--format", "csv"]);
    assert!(!bill.contains("team-b"), "{bill}");

    // Tokens: none, unknown, expired, revoked.
    s.refused("client-user", None, &["jobs"], "authentication required: pass --token or set CORRAL_TOKEN");
    s.assert_audited("authentication required");
    s.refused("client-user", Some("crl_not-a-token"), &["jobs"], "invalid token");
    s.assert_audited("invalid token");
    let short = s.token(&["--tenant", "team-a", "--ttl", "1s"]);
    s.ok("client-user", Some(&short), &["jobs"]);
    std::thread::sleep(Duration::from_millis(1500));
    s.refused("client-user", Some(&short), &["jobs"], "expired");
    s.assert_audited("expired");
    let listed: Value =
        serde_json::from_str(&s.ok("admin", None, &["--output", "json", "token", "list"])).expect("json");
    let b_id =
        listed.as_array().expect("array").iter().find(|t| t["tenant"] == "team-b").expect("team-b token")["id"].clone();
    s.ok("admin", None, &["token", "revoke", &b_id.to_string()]);
    s.refused("client-user", Some(&team_b), &["jobs"], "was revoked");
    s.assert_audited("was revoked");
    // Admin actions are audited too.
    let audit = s.audit();
    assert!(audit.iter().any(|l| l["outcome"] == "admin" && l["action"] == "token revoke"), "{audit:#?}");
    assert!(
        audit.iter().filter(|l| l["outcome"] == "admin" && l["action"] == "token create").count() >= 3,
        "{audit:#?}"
    );
    // An admin token works like the admin certificate.
    let admin_token = s.token(&["--admin"]);
    s.ok("client-user", Some(&admin_token), &["cancel", &job_b.to_string()]);
}

/// PEM files of `name` (`admin`, `worker-w1`, ...) in a `corral certs init` directory.
fn files(certs: &Path, name: &str) -> corral_security::TlsFiles {
    corral_security::TlsFiles {
        ca: certs.join("ca.pem"),
        cert: certs.join(format!("{name}.pem")),
        key: certs.join(format!("{name}-key.pem")),
    }
}

/// Waits until `impostor` saw the client give up on its handshake; asserts that it got no
/// request (so no bearer token) and no completed handshake.
fn assert_refused_before_sending(impostor: &corral_security::testing::Impostor) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while impostor.seen().refusals.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let seen = impostor.seen();
    assert!(!seen.refusals.is_empty(), "the client never refused the impostor: {seen:?}");
    assert_eq!(seen.handshakes, 0, "a handshake with the impostor completed: {seen:?}");
    assert!(seen.received.is_empty(), "the impostor received {} bytes", seen.received.len());
}

/// The outage of the hardening issue: a server presenting a worker certificate of the cluster CA
/// (there an `openssl s_server`) received the admin CLI's requests, bearer token included.
/// Every client now refuses a server without the role it expects before sending anything, and
/// says so in one line: the CLI a worker certificate where it expects a coordinator, the
/// coordinator a coordinator certificate where it expects the node's worker agent.
#[test]
fn clients_refuse_a_server_without_the_role_they_expect_and_send_it_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let certs = dir.path().join("certs");
    certs_init(&certs, &[]);

    // The CLI (and every Rust client) expects a coordinator.
    let impostor = corral_security::testing::Impostor::start(&files(&certs, "worker-w1")).expect("impostor");
    let addr = impostor.addr().to_string();
    let out = Command::new(corral_bin())
        .args(tls_args(&certs, "admin"))
        .args(["--endpoint", &addr, "--token", "crl_a-bearer-token-for-the-impostor", "jobs"])
        .output()
        .expect("corral");
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(!out.status.success(), "the CLI talked to a worker certificate: {}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(
        stderr,
        format!("error: TLS: the server at {addr} presented a certificate with role worker, not coordinator")
    );
    assert_refused_before_sending(&impostor);

    // The coordinator reading job logs expects the node's worker: w1 advertises the address of
    // an impostor holding a coordinator certificate.
    let options = ClusterOptions { tls: Some(certs.clone()), node_ttl: "3s".into(), ..Default::default() };
    let cluster = Cluster::start(1, options);
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "init: {}", String::from_utf8_lossy(&init.stderr));
    let fake_agent = corral_security::testing::Impostor::start(&files(&certs, "coordinator-1")).expect("impostor");
    let mut worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 1);
    worker.use_tls(&certs);
    worker.edit_config(|config| format!("advertise = \"{}\"\n{config}", fake_agent.addr()));
    worker.start();
    worker.wait_registered(&cluster);
    let job = cluster.json(&["submit", "--", "echo", "for-the-real-agent-only"])["id"].as_u64().expect("job id");
    let doc = cluster
        .wait_for(job, Duration::from_secs(60), "ended", |d| d["state"] == "succeeded" || d["state"] == "failed");
    assert_eq!(doc["state"], "succeeded", "{doc}\n{}", worker.log());
    let out = Command::new(corral_bin())
        .args(cluster.admin_tls_args())
        .args(["--endpoint", &cluster.endpoints(), "logs", &job.to_string()])
        .output()
        .expect("logs");
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(
        !out.status.success(),
        "logs came from a coordinator certificate: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let line = format!("the server at {} presented a certificate with role coordinator, not worker", fake_agent.addr());
    assert!(stderr.contains(&line) && stderr.lines().count() == 1, "{stderr}");
    assert_refused_before_sending(&fake_agent);
}

/// `corral certs init` certificates live `--days` (365 by default), `corral certs renew` issues
/// them again for longer with the same CA, names and keys; a daemon whose certificate expires
/// within 14 days says so at start.
#[test]
fn dev_certificates_are_finite_and_renewed_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs();
    let day = 24 * 3600;
    certs_init(&certs, &["--days", "3"]);
    let identity =
        |name: &str| corral_security::certificate_identity(&certs.join(format!("{name}.pem"))).expect("identity");
    for name in ["coordinator-1", "worker-w1", "admin", "client-user"] {
        let until = identity(name).not_after_s;
        assert!(until.abs_diff(now + 3 * day) < 120, "{name} expires at {until}, not in 3 days");
    }
    let default = dir.path().join("default");
    certs_init(&default, &[]);
    let until = corral_security::certificate_identity(&default.join("admin.pem")).expect("identity").not_after_s;
    assert!(until.abs_diff(now + 365 * day) < 120, "expires at {until}, not in 365 days");

    // A coordinator started with a certificate that expires within 14 days warns.
    let options = ClusterOptions { tls: Some(certs.clone()), ..Default::default() };
    let mut cluster = Cluster::start(1, options);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cluster.log_of(0).contains("expires on") {
        assert!(Instant::now() < deadline, "no expiry warning: {}", cluster.log_of(0));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(cluster.log_of(0).contains("corral certs renew"), "{}", cluster.log_of(0));
    cluster.stop(0);

    let key = std::fs::read(certs.join("worker-w1-key.pem")).expect("key");
    let ca = std::fs::read(certs.join("ca.pem")).expect("ca");
    let out = Command::new(corral_bin())
        .args(["certs", "renew", "--dir"])
        .arg(&certs)
        .args(["--days", "90"])
        .output()
        .expect("renew");
    assert!(out.status.success(), "certs renew: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 4, "{}", String::from_utf8_lossy(&out.stdout));
    for name in ["coordinator-1", "worker-w1", "admin", "client-user"] {
        let renewed = identity(name);
        assert!(renewed.not_after_s.abs_diff(now + 90 * day) < 120, "{name}: {renewed:?}");
    }
    assert_eq!(identity("worker-w1").name, "w1");
    assert_eq!(std::fs::read(certs.join("worker-w1-key.pem")).expect("key"), key, "keys are kept");
    assert_eq!(std::fs::read(certs.join("ca.pem")).expect("ca"), ca, "the CA is kept");
    // The renewed certificates work: the restarted coordinator serves the admin CLI.
    cluster.restart(0);
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "init: {}", String::from_utf8_lossy(&init.stderr));
    let out = Command::new(corral_bin())
        .args(["certs", "renew", "--dir"])
        .arg(&certs)
        .args(["--days", "0"])
        .output()
        .expect("renew");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--days must be between 1 and 3650"), "{stderr}");
}
