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
            .append_entries(corral_proto::raft::RaftMessage { data: b"{}".to_vec(), chunk: Vec::new() })
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
