//! The web view on the metrics listener: a `corral dev` pool's pages over HTTP (nodes and GPUs,
//! the queue with why a job waits, a job with its output, tenants, status codes, escaping of a
//! job named like a script), the same pages in a real headless Chromium, and a coordinator with
//! tokens on, where every page needs a token and a tenant sees only its own jobs, and a job
//! whose node left the pool says its output went with it; cross-site posts to `/login` and
//! `/logout` are refused, and without auth a listener off loopback serves `/metrics` only.

use corral_integration::cluster::free_port;
use corral_integration::worker::WorkerProc;
use corral_integration::{corral_bin, DevPool};
use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A job name that would run as a script if a page wrote it unescaped.
const EVIL: &str = "<script>alert(1)</script>";
const EVIL_ESCAPED: &str = "&lt;script&gt;alert(1)&lt;/script&gt;";

/// One HTTP/1.0 answer.
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// An HTTP/1.0 request on loopback with extra header lines and a form body.
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], form: Option<&str>) -> Answer {
    let mut stream = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    let body = form.unwrap_or_default();
    if form.is_some() {
        request.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).expect("send");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).expect("read");
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Answer { status, head: head.to_string(), body: body.to_string() }
}

fn get(addr: &str, path: &str) -> Answer {
    http(addr, "GET", path, &[], None)
}

/// GETs `path` until its page satisfies `check` (bounded); the failure shows the last page.
fn page_until(addr: &str, path: &str, headers: &[(&str, &str)], what: &str, check: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = http(addr, "GET", path, headers, None);
        if answer.status == 200 && check(&answer.body) {
            return answer.body;
        }
        assert!(Instant::now() < deadline, "{path} never showed {what}: {} {}", answer.status, answer.body);
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A dev pool with two GPUs, a running job named like a script that printed a line, and a
/// job waiting for two GPUs. Returns (pool, web address, running job, waiting job).
fn busy_pool() -> (DevPool, String, u64, u64) {
    let pool = DevPool::start_with_metrics(&["--gpus", "2"]);
    let web = pool.metrics_addr.clone().expect("metrics addr");
    let running =
        pool.submit(&["--name", EVIL, "--gpus", "1", "--", "sh", "-c", "echo hello-from-the-log; sleep 1000"]);
    pool.wait_for(running, "running", |d| d["state"] == "running");
    let waiting = pool.submit(&["--name", "waits-for-two", "--gpus", "2", "--", "true"]);
    (pool, web, running, waiting)
}

#[test]
fn web_view_of_a_dev_pool_shows_the_pool_queue_jobs_and_tenants() {
    let (_pool, web, running, waiting) = busy_pool();

    let home = page_until(&web, "/", &[], "the running job on a GPU and GPU readings", |p| {
        p.contains(EVIL_ESCAPED) && p.contains("35 °C")
    });
    assert!(home.contains("<h2>dev-node <span class=\"state-up\">up</span></h2>"), "{home}");
    assert_eq!(home.matches("<tr class=\"gpu\">").count(), 2, "two GPU rows: {home}");
    assert!(home.contains(&format!("<a href=\"/jobs/{running}\">{running}</a> {EVIL_ESCAPED} (default)")), "{home}");
    assert!(!home.contains(EVIL), "the job name is escaped: {home}");
    let first = get(&web, "/");
    assert_eq!(first.header("content-type"), Some("text/html; charset=utf-8"));
    assert!(first.header("content-security-policy").is_some_and(|c| c.contains("default-src 'none'")));

    let queue = page_until(&web, "/queue", &[], "why the job waits", |p| p.contains("resources:"));
    assert!(queue.contains(&format!("id=\"job-{waiting}\"")) && queue.contains("waits-for-two"), "{queue}");
    assert!(queue.contains("<h2>Running (1)</h2>") && queue.contains("dev-node [0]"), "{queue}");

    let job = page_until(&web, &format!("/jobs/{running}"), &[], "the log tail", |p| p.contains("hello-from-the-log"));
    assert!(job.contains("<code>sh -c &#39;echo hello-from-the-log; sleep 1000&#39;</code>"), "{job}");
    assert!(job.contains(EVIL_ESCAPED) && !job.contains(EVIL), "{job}");
    let pending = get(&web, &format!("/jobs/{waiting}"));
    assert_eq!(pending.status, 200);
    assert!(pending.body.contains("The job has not run yet"), "{}", pending.body);

    let tenants = get(&web, "/tenants");
    assert_eq!(tenants.status, 200);
    assert!(
        tenants.body.contains("<td>default</td><td class=\"num\">1</td><td class=\"num\">1</td>"),
        "{}",
        tenants.body
    );

    for (path, status, text) in [
        ("/nope", 404, "there is no page /nope"),
        ("/jobs/abc", 400, "&#39;abc&#39; is not a job id"),
        ("/jobs/999999", 404, "there is no job 999999"),
    ] {
        let answer = get(&web, path);
        assert_eq!(answer.status, status, "{path}: {}", answer.body);
        assert!(answer.body.contains(text), "{path}: {}", answer.body);
    }
    let post = http(&web, "POST", "/queue", &[], Some(""));
    assert_eq!(post.status, 405, "{}", post.body);
    // Prometheus keeps scraping as before.
    let metrics = get(&web, "/metrics");
    assert_eq!(metrics.status, 200);
    assert!(metrics.header("content-type").is_some_and(|c| c.starts_with("application/openmetrics-text")));
    assert!(metrics.body.contains("corral_raft_is_leader 1"), "{}", metrics.body);
}

/// `chromium` on PATH, or `None` (with a loud message) where it is not installed outside CI.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .flat_map(|d| ["chromium", "chromium-browser"].map(|name| d.join(name)))
        .find(|p| p.is_file());
    if found.is_some() {
        return found;
    }
    if std::env::var_os("CI").is_some() {
        panic!("chromium is not installed: CI must install the Debian package `chromium` (see .ci/run)");
    }
    eprintln!(
        "\n!!!!!!!!\n!!! SKIPPING web_view_in_a_headless_browser: no `chromium` on PATH \
         (install the Debian package `chromium`; in CI this test fails instead)\n!!!!!!!!\n"
    );
    None
}

/// The DOM Chromium builds from `url`, after loading it (bounded: a hung browser is killed).
fn dump_dom(chromium: &Path, profile: &Path, url: &str) -> String {
    let out_path = profile.with_extension(format!("dom-{}.html", url.len()));
    let out = std::fs::File::create(&out_path).expect("dom file");
    let mut child: Child = Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--dump-dom", url])
        .stdout(Stdio::from(out))
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn chromium");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait().expect("wait chromium") {
            Some(status) => {
                assert!(status.success(), "chromium --dump-dom {url} exited with {status}");
                break;
            }
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("chromium --dump-dom {url} did not finish within 60s");
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    std::fs::read_to_string(&out_path).expect("read dom")
}

#[test]
fn web_view_in_a_headless_browser() {
    let Some(chromium) = chromium() else { return };
    let (pool, web, running, waiting) = busy_pool();
    // Served first over plain HTTP, so that the browser sees the settled pages.
    page_until(&web, "/queue", &[], "why the job waits", |p| p.contains("resources:"));
    page_until(&web, &format!("/jobs/{running}"), &[], "the log tail", |p| p.contains("hello-from-the-log"));
    let profile = tempfile::tempdir().expect("profile dir");
    let dom = |path: &str| dump_dom(&chromium, &profile.path().join("profile"), &format!("http://{web}{path}"));

    let home = dom("/");
    assert!(home.contains("dev-node"), "node name: {home}");
    assert_eq!(home.matches("<tr class=\"gpu\">").count(), 2, "GPU rows: {home}");
    // The job name is text in the page, not an element: the DOM has no script at all.
    assert!(home.contains(EVIL_ESCAPED), "the job name shows as text: {home}");
    assert!(!home.contains("<script"), "no script element: {home}");

    let queue = dom("/queue");
    let row = queue.split(&format!("id=\"job-{waiting}\"")).nth(1).expect("the waiting job's row");
    let row = row.split("</tr>").next().unwrap_or_default();
    assert!(row.contains("resources:"), "the pending job's reason: {row}");

    let job = dom(&format!("/jobs/{running}"));
    assert!(job.contains("hello-from-the-log"), "the log tail: {job}");
    assert!(job.contains(EVIL_ESCAPED) && !job.contains("<script"), "{job}");
    drop(pool);
}

/// A coordinator with tokens required (no TLS) and a web view; tokens for an admin and for
/// tenants team-a and team-b, each of which has submitted one job (no worker: they wait).
struct TokenPool {
    child: Child,
    addr: String,
    web: String,
    dir: tempfile::TempDir,
}

const ADMIN_SECRET: &str = "web-admin-secret";

impl TokenPool {
    fn start() -> TokenPool {
        let auth = format!("[auth]\nrequire-tokens = true\nadmin-token-sha256 = \"{}\"\n", sha256_hex(ADMIN_SECRET));
        TokenPool::start_with("127.0.0.1", "", &auth)
    }

    /// A coordinator whose metrics listener binds `metrics_ip` (reached on loopback), with
    /// `top` among the top-level keys and `sections` appended.
    fn start_with(metrics_ip: &str, top: &str, sections: &str) -> TokenPool {
        let dir = tempfile::tempdir().expect("tempdir");
        let (addr, port) = (format!("127.0.0.1:{}", free_port()), free_port());
        let web = format!("127.0.0.1:{port}");
        let config = dir.path().join("coordinator.toml");
        std::fs::write(
            &config,
            format!(
                "node-id = 1\nlisten = \"{addr}\"\ndata-dir = \"{}\"\nmetrics-addr = \"{metrics_ip}:{port}\"\n{top}\n\
                 [scheduler]\nnode-ttl = \"2s\"\n\n{sections}",
                dir.path().join("data").display()
            ),
        )
        .expect("config");
        let log = std::fs::File::create(dir.path().join("coordinator.log")).expect("log");
        let child = Command::new(corral_bin())
            .args(["coordinator", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn coordinator");
        let pool = TokenPool { child, addr, web, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&pool.web).is_err() || std::net::TcpStream::connect(&pool.addr).is_err() {
            assert!(Instant::now() < deadline, "coordinator did not start: {}", pool.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        pool.ok(None, &["cluster", "init"]);
        pool
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("coordinator.log")).unwrap_or_default()
    }

    fn run(&self, token: Option<&str>, args: &[&str]) -> Output {
        let mut command = Command::new(corral_bin());
        command.args(["--endpoint", &self.addr]);
        if let Some(token) = token {
            command.args(["--token", token]);
        }
        command.args(args).output().expect("corral")
    }

    fn ok(&self, token: Option<&str>, args: &[&str]) -> String {
        let out = self.run(token, args);
        assert!(out.status.success(), "corral {args:?}: {}\n{}", String::from_utf8_lossy(&out.stderr), self.log());
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Polls `corral --output json ARGS` as `token` until `check` holds (bounded).
    fn wait_json(&self, token: &str, args: &[&str], what: &str, check: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut all = vec!["--output", "json"];
            all.extend(args);
            let doc: Value = serde_json::from_str(&self.ok(Some(token), &all)).expect("json");
            if check(&doc) {
                return doc;
            }
            assert!(Instant::now() < deadline, "never {what}: {doc}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn submit(&self, token: &str, name: &str) -> u64 {
        let out = self.ok(Some(token), &["--output", "json", "submit", "--name", name, "--gpus", "1", "--", "true"]);
        let doc: Value = serde_json::from_str(&out).expect("json");
        doc["id"].as_u64().unwrap_or_else(|| panic!("no id in {doc}"))
    }
}

impl Drop for TokenPool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lower-case hex SHA-256, via the coreutils every test machine has.
fn sha256_hex(text: &str) -> String {
    let mut child = Command::new("sha256sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("sha256sum");
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write");
    let out = child.wait_with_output().expect("sha256sum");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().expect("hash").to_string()
}

#[test]
fn web_view_with_tokens_needs_a_login_and_shows_tenants_their_own_jobs() {
    let pool = TokenPool::start();
    let web = pool.web.clone();
    let team_a = pool.ok(Some(ADMIN_SECRET), &["token", "create", "--tenant", "team-a"]);
    let team_b = pool.ok(Some(ADMIN_SECRET), &["token", "create", "--tenant", "team-b"]);
    let job_a = pool.submit(&team_a, "job-of-team-a");
    let job_b = pool.submit(&team_b, "job-of-team-b");

    // No token: a login form, 401; a wrong one: its refusal.
    let anonymous = get(&web, "/queue");
    assert_eq!(anonymous.status, 401, "{}", anonymous.body);
    assert!(
        anonymous.body.contains("action=\"/login\"") && !anonymous.body.contains("job-of-team"),
        "{}",
        anonymous.body
    );
    let wrong = http(&web, "GET", "/", &[("Authorization", "Bearer crl_wrong")], None);
    assert_eq!(wrong.status, 401);
    assert!(wrong.body.contains("invalid token: not issued by this cluster"), "{}", wrong.body);
    // Prometheus needs no token.
    assert_eq!(get(&web, "/metrics").status, 200);

    // A tenant with a bearer token sees its own jobs only.
    let bearer_a = format!("Bearer {team_a}");
    let a = [("Authorization", bearer_a.as_str())];
    let queue = page_until(&web, "/queue", &a, "team-a's job", |p| p.contains("job-of-team-a"));
    assert!(!queue.contains("job-of-team-b") && !queue.contains(&format!("/jobs/{job_b}\"")), "{queue}");
    assert!(queue.contains("tenant team-a"), "who is looking: {queue}");
    let denied = http(&web, "GET", &format!("/jobs/{job_b}"), &a, None);
    assert_eq!(denied.status, 403, "{}", denied.body);
    assert!(
        denied.body.contains("owned by another tenant") && !denied.body.contains("job-of-team-b"),
        "{}",
        denied.body
    );
    assert_eq!(http(&web, "GET", &format!("/jobs/{job_a}"), &a, None).status, 200);
    let tenants = http(&web, "GET", "/tenants", &a, None).body;
    assert!(tenants.contains("id=\"tenant-team-a\"") && !tenants.contains("team-b"), "{tenants}");
    // Its own invoice, not another tenant's (refused, and the refusal names neither's bill).
    let own = http(&web, "GET", "/tenants/team-a", &a, None);
    assert_eq!(own.status, 200, "{}", own.body);
    assert!(own.body.contains("Invoice of tenant team-a") && own.body.contains("id=\"entries\""), "{}", own.body);
    let other = http(&web, "GET", "/tenants/team-b", &a, None);
    assert_eq!(other.status, 403, "{}", other.body);
    assert!(other.body.contains("cannot see the invoice of tenant team-b"), "{}", other.body);

    // A browser logs in with the form (posted from a page of this listener: its origin) and
    // gets an HttpOnly, SameSite=Strict cookie.
    let origin = format!("http://{web}");
    let ours = [("Origin", origin.as_str())];
    let login = http(&web, "POST", "/login", &ours, Some(&format!("token={team_b}")));
    assert_eq!(login.status, 303, "{}", login.body);
    assert_eq!(login.header("location"), Some("/"));
    let cookie = login.header("set-cookie").expect("a cookie").to_string();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict") && cookie.contains("Path=/"), "{cookie}");
    assert!(!cookie.contains("Secure"), "a plain HTTP listener cannot set a Secure cookie: {cookie}");
    let pair = cookie.split(';').next().expect("name=value").to_string();
    let b = [("Cookie", pair.as_str())];
    let queue = http(&web, "GET", "/queue", &b, None).body;
    assert!(queue.contains("job-of-team-b") && !queue.contains("job-of-team-a"), "{queue}");
    let bad_login = http(&web, "POST", "/login", &ours, Some("token=crl_nope"));
    assert_eq!(bad_login.status, 401);
    assert!(bad_login.body.contains("invalid token"), "{}", bad_login.body);
    // Another site's page cannot log a browser in (as the attacker's tenant) or out.
    let referer = format!("http://{web}/login");
    for (headers, path) in [
        (vec![("Origin", "http://evil.example")], "/login"),
        (vec![("Origin", "null")], "/login"),
        (vec![("Referer", "http://evil.example/page")], "/login"),
        (vec![], "/login"),
        (vec![("Origin", "http://evil.example"), ("Cookie", pair.as_str())], "/logout"),
    ] {
        let refused = http(&web, "POST", path, &headers, Some(&format!("token={team_a}")));
        assert_eq!(refused.status, 403, "{path} {headers:?}: {}", refused.body);
        assert!(refused.body.contains("Cross-site request refused"), "{}", refused.body);
        assert!(refused.header("set-cookie").is_none(), "{path} {headers:?} set a cookie");
    }
    let with_referer = http(&web, "POST", "/login", &[("Referer", referer.as_str())], Some(&format!("token={team_b}")));
    assert_eq!(with_referer.status, 303, "a same-origin Referer is enough: {}", with_referer.body);
    let logout = http(&web, "POST", "/logout", &[("Origin", origin.as_str()), ("Cookie", pair.as_str())], Some(""));
    assert_eq!(logout.status, 303);
    assert!(logout.header("set-cookie").is_some_and(|c| c.contains("Max-Age=0")));

    // An admin sees every tenant's jobs.
    let bearer_admin = format!("Bearer {ADMIN_SECRET}");
    let admin = [("Authorization", bearer_admin.as_str())];
    let queue = http(&web, "GET", "/queue", &admin, None).body;
    assert!(queue.contains("job-of-team-a") && queue.contains("job-of-team-b"), "{queue}");

    // The jobs run on a worker, which then dies and leaves the pool: a finished job's page says
    // its output went with the node.
    let mut worker = WorkerProc::configure(pool.dir.path(), "w1", &pool.addr, 2);
    worker.append_config("\n[users]\nas-worker = true\n");
    worker.start();
    pool.wait_json(ADMIN_SECRET, &["show", &job_a.to_string()], "job a succeeded", |d| d["state"] == "succeeded");
    pool.wait_json(ADMIN_SECRET, &["show", &job_b.to_string()], "job b succeeded", |d| d["state"] == "succeeded");
    let ran = http(&web, "GET", &format!("/jobs/{job_a}"), &a, None).body;
    assert!(ran.contains("w1 [0]") || ran.contains("w1 [1]"), "{ran}");
    worker.kill();
    let down =
        |d: &Value| d.as_array().is_some_and(|nodes| nodes.iter().any(|n| n["name"] == "w1" && n["state"] == "down"));
    pool.wait_json(ADMIN_SECRET, &["nodes"], "w1 down", down);
    pool.ok(Some(ADMIN_SECRET), &["node", "remove", "w1"]);
    let gone = http(&web, "GET", &format!("/jobs/{job_a}"), &a, None).body;
    assert!(gone.contains(&format!("node w1 of job {job_a} is not registered")), "{gone}");
    assert!(gone.contains("the node is gone"), "{gone}");

    // Refusals are audited like the API's.
    let audit = std::fs::read_to_string(pool.dir.path().join("data/audit.jsonl")).unwrap_or_default();
    assert!(audit.lines().any(|l| l.contains("\"web view\"") && l.contains("owned by another tenant")), "{audit}");
    assert!(audit.lines().any(|l| l.contains("cross-site post to /login refused")), "{audit}");
}

/// Without TLS or tokens every caller is admin: a metrics listener off loopback serves
/// `/metrics` only and says why, unless the config says `insecure = true`.
#[test]
fn web_view_off_loopback_without_auth_serves_metrics_only_unless_insecure() {
    let pool = TokenPool::start_with("0.0.0.0", "", "");
    pool.ok(None, &["submit", "--name", "secret-experiment", "--gpus", "1", "--", "true"]);
    assert_eq!(get(&pool.web, "/metrics").status, 200);
    for path in ["/", "/queue", "/jobs/1", "/tenants", "/login"] {
        let answer = get(&pool.web, path);
        assert_eq!(answer.status, 404, "{path}: {}", answer.body);
        assert!(answer.body.contains("serves /metrics only"), "{path}: {}", answer.body);
        assert!(
            answer.body.contains("insecure = true") && !answer.body.contains("secret-experiment"),
            "{}",
            answer.body
        );
    }
    let posted = http(&pool.web, "POST", "/login", &[], Some("token=x"));
    assert_eq!(posted.status, 404, "{}", posted.body);
    assert!(pool.log().contains("the web view is off on 0.0.0.0:"), "the reason is logged: {}", pool.log());

    let open = TokenPool::start_with("0.0.0.0", "insecure = true\n", "");
    open.ok(None, &["submit", "--name", "open-experiment", "--gpus", "1", "--", "true"]);
    page_until(&open.web, "/queue", &[], "the job, insecure = true", |p| p.contains("open-experiment"));
}
