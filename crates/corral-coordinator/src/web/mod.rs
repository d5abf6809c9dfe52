//! The web view: read-only HTML pages of the pool (`/`), the queue (`/queue`), one job
//! (`/jobs/ID`, with the tail of its output), the tenants (`/tenants`) and one tenant's
//! invoice (`/tenants/NAME`), served on the
//! listener that serves `/metrics` (the binary hands every other path to [`Coordinator::web`]).
//!
//! Auth is the user API's: with TLS or `auth.require-tokens` every page needs a token, given as
//! `Authorization: Bearer T` or, for browsers, the HttpOnly cookie the form at `/login` sets;
//! without either (`corral dev`) the pages are open and everyone is admin, so they are served
//! only on a loopback listener (unless `insecure = true`): see [`Coordinator::web_view_refusal`],
//! which the listener asks once. A tenant sees its own jobs only (see `pages.rs`). `/login` and
//! `/logout` take only same-origin posts (`Origin`, else `Referer`): another site cannot log a
//! browser in or out.
//!
//! Bounds: a page lists at most `pages::MAX_ROWS` jobs of a kind (then says how many more,
//! and which command lists them all), after looking at most `pages::SCAN_ROWS` jobs, and its
//! counts come from the state's per-tenant counters; a job page reads only the last
//! `LOG_TAIL_BYTES` of each output stream from the worker, within `LOG_READ_TIMEOUT`.
//!
//! On a follower the pages show its replicated state (which may lag the leader by a little);
//! GPU readings and why jobs wait live in the leader's memory, so a follower says so and names
//! the leader rather than asking it (the leader's API refuses a coordinator's certificate).
//!
//! Boundary: this module only reads; it never proposes anything.

mod html;
mod pages;

use crate::auth::Principal;
use crate::scheduler::LeaderMemory;
use crate::snapshot::Snapshot;
use crate::Coordinator;
use corral_proto::v1 as pb;
use corral_types::{Job, JobState};
use html::{escape, Frame};
use pages::LogTail;
use std::time::Duration;
use tokio_stream::StreamExt;

/// One HTTP request to the web view, as the listener saw it.
#[derive(Debug, Clone, Default)]
pub struct WebRequest {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The `Authorization` header.
    pub authorization: Option<String>,
    /// The `Cookie` header.
    pub cookie: Option<String>,
    /// The body (a form of `POST /login`).
    pub body: Vec<u8>,
    /// Who sent it (the peer address), for the audit log.
    pub peer: String,
    /// Served over TLS: the login cookie is marked `Secure`.
    pub secure: bool,
    /// The `Host` header.
    pub host: Option<String>,
    /// The `Origin` header (a browser's form post carries it).
    pub origin: Option<String>,
    /// The `Referer` header.
    pub referer: Option<String>,
}

/// The answer: status, headers and an HTML body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebResponse {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

/// The cookie that carries a browser's token.
const COOKIE: &str = "corral_token";
/// The pool and queue pages reload themselves this often.
const REFRESH_SECS: u32 = 5;
/// How much of a job's output its page shows (the end of it).
const LOG_TAIL_BYTES: usize = 64 * 1024;
/// The longest a job page waits for its worker's log stream.
const LOG_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// No script, no external asset: inline style and same-origin forms only.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'";

/// The pages.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Pool,
    Queue,
    Tenants,
    /// `/tenants/NAME`: one tenant's invoice.
    Invoice(String),
    Job(JobRef),
}

/// `/jobs/12` or `/jobs/12_7` (task 7 of array 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct JobRef {
    id: u64,
    task: Option<u32>,
}

/// A path segment with its `%XX` escapes decoded; `None` when it is not valid UTF-8.
fn percent_decoded(segment: &str) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = segment.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The page of a path, or the error response for it.
fn route(path: &str) -> Result<Route, WebResponse> {
    match path {
        "/" => return Ok(Route::Pool),
        "/queue" => return Ok(Route::Queue),
        "/tenants" | "/usage" => return Ok(Route::Tenants),
        _ => {}
    }
    if let Some(name) = path.strip_prefix("/tenants/").filter(|n| !n.is_empty() && !n.contains('/')) {
        return percent_decoded(name).map(Route::Invoice).ok_or_else(|| {
            error_page(400, "Bad tenant name", "a tenant name is letters, digits and dashes, e.g. /tenants/team-a")
        });
    }
    let Some(id) = path.strip_prefix("/jobs/").filter(|id| !id.is_empty() && !id.contains('/')) else {
        return Err(error_page(
            404,
            "Not found",
            &format!("there is no page {path}: see the pool, queue or tenants pages"),
        ));
    };
    let bad = || {
        error_page(
            400,
            "Bad job id",
            &format!("'{id}' is not a job id: use the number corral submit printed, e.g. /jobs/12 (or /jobs/12_7 for an array task)"),
        )
    };
    let (job, task) = match id.split_once('_') {
        Some((job, task)) => (job, Some(task.parse::<u32>().map_err(|_| bad())?)),
        None => (id, None),
    };
    let id = job.parse::<u64>().map_err(|_| bad())?;
    Ok(Route::Job(JobRef { id, task }))
}

fn response(status: u16, body: String) -> WebResponse {
    WebResponse {
        status,
        headers: vec![
            ("content-type", "text/html; charset=utf-8".into()),
            ("cache-control", "no-store".into()),
            ("content-security-policy", CSP.into()),
            ("x-content-type-options", "nosniff".into()),
            // Not no-referrer: a browser would then post the login form with `Origin: null`,
            // and the same-origin check of `/login` could not tell it from another site's.
            ("referrer-policy", "same-origin".into()),
        ],
        body,
    }
}

/// A page that says what went wrong, in one sentence.
fn error_page(status: u16, title: &str, message: &str) -> WebResponse {
    let frame = Frame { title, who: None, banner: None, refresh_secs: None };
    let body = format!("<h1>{}</h1><p class=\"error\" id=\"error\">{}</p>", escape(title), escape(message));
    response(status, html::page(&frame, &body))
}

/// The login form, with an error above it when a token was refused.
fn login_page(status: u16, error: Option<&str>) -> WebResponse {
    let frame = Frame { title: "Log in", who: None, banner: None, refresh_secs: None };
    let mut body = String::from("<h1>Log in</h1>");
    if let Some(error) = error {
        body.push_str(&format!("<p class=\"error\" id=\"error\">{}</p>", escape(error)));
    }
    body.push_str(
        "<p>This pool asks for a token, as the corral CLI does (<code>corral token create</code> makes one).</p>\
         <form method=\"post\" action=\"/login\"><label>Token <input type=\"password\" name=\"token\" \
         autocomplete=\"off\" size=\"70\"></label> <button>Log in</button></form>",
    );
    response(status, html::page(&frame, &body))
}

/// A redirect after a form (303: the browser follows with a GET).
fn see_other(location: &str, cookie: String) -> WebResponse {
    let mut r = response(303, String::new());
    r.headers.push(("location", location.into()));
    r.headers.push(("set-cookie", cookie));
    r
}

/// Refuses a form post that did not come from a page of this listener: its `Origin` (or, when
/// a browser sends none, its `Referer`) must be this listener's own origin, as the `Host`
/// header names it. Another site's page can post a form here, but not with our origin.
fn same_origin(request: &WebRequest) -> Result<(), WebResponse> {
    let refuse = |why: String| {
        Err(error_page(
            403,
            "Cross-site request refused",
            &format!("{why}: log in and out from the pages of this coordinator"),
        ))
    };
    let Some(host) = request.host.as_deref().filter(|h| !h.is_empty()) else {
        return refuse("the request names no Host".into());
    };
    let scheme = if request.secure { "https" } else { "http" };
    let ours = format!("{scheme}://{host}");
    let same = |origin: &str| origin.eq_ignore_ascii_case(&ours);
    match (&request.origin, &request.referer) {
        (Some(origin), _) if same(origin) => Ok(()),
        (Some(origin), _) => refuse(format!("a form posted from {origin}, not from {ours}")),
        (None, Some(referer)) => {
            // The origin of the referring page: scheme://host[:port], before its path.
            let rest = referer.split_once("://").map_or("", |(_, rest)| rest);
            let origin_len = referer.len() - rest.len() + rest.find('/').unwrap_or(rest.len());
            if same(&referer[..origin_len]) {
                Ok(())
            } else {
                refuse(format!("a form posted from a page of {}, not of {ours}", &referer[..origin_len]))
            }
        }
        (None, None) => refuse("a form post without an Origin or Referer header".into()),
    }
}

/// The value of cookie `name` in a `Cookie` header.
fn cookie_value<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').filter_map(|pair| pair.trim().split_once('=')).find(|(k, _)| *k == name).map(|(_, v)| v)
}

/// The value of `key` in an `application/x-www-form-urlencoded` body.
fn form_value(body: &[u8], key: &str) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let raw = text.split('&').filter_map(|pair| pair.split_once('=')).find(|(k, _)| *k == key)?.1;
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

impl Coordinator {
    /// Answers one request to the web view (any path but `/metrics`), on the client runtime
    /// (`client_work.rs`): rendering a page is client work, whoever serves the listener.
    pub async fn web(&self, request: WebRequest) -> WebResponse {
        let coordinator = self.clone();
        let page = self.client_work().run(async move { coordinator.web_page(request).await });
        page.await.unwrap_or_else(|| error_page(503, "Unavailable", "the coordinator is shutting down"))
    }

    /// [`Coordinator::web`], on the runtime it is called on.
    async fn web_page(&self, request: WebRequest) -> WebResponse {
        let read = matches!(request.method.as_str(), "GET" | "HEAD");
        match (request.method.as_str(), request.path.as_str()) {
            (_, "/login") if read => {
                if self.security().auth_enabled() {
                    return login_page(200, None);
                }
                return error_page(200, "No login needed", "this pool has no tokens: every page is open");
            }
            ("POST", path @ ("/login" | "/logout")) => {
                if let Err(refused) = same_origin(&request) {
                    self.security().audit.record(corral_security::AuditEvent::denied(
                        "web login",
                        format!("web {}", request.peer),
                        "-",
                        format!("cross-site post to {path} refused"),
                    ));
                    return refused;
                }
                if path == "/login" {
                    return self.web_login(&request);
                }
                let cookie = format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
                return see_other("/login", cookie);
            }
            _ if !read => {
                let mut r = error_page(405, "Method not allowed", "these pages are read-only: use GET");
                r.headers.push(("allow", "GET, HEAD".into()));
                return r;
            }
            _ => {}
        }
        let route = match route(&request.path) {
            Ok(route) => route,
            Err(response) => return response,
        };
        let viewer = match self.web_viewer(&request) {
            Ok(viewer) => viewer,
            Err(response) => return response,
        };
        let who = self.security().auth_enabled().then(|| match &viewer {
            Principal::Admin { .. } => "admin".to_string(),
            Principal::Tenant { tenant, .. } => format!("tenant {tenant}"),
        });
        let banner = self.follower_banner();
        let leads = banner.is_none();
        let snapshot = self.snapshot();
        let live = if leads { self.liveness().snapshot() } else { Default::default() };
        let memory = LeaderMemory { pending: snapshot.pending(), live: &live, pulls: snapshot.pulls() };
        let leader = leads.then_some(&memory);
        let now_ms = now_ms();
        let frame = |title, refresh_secs| Frame { title, who: who.as_deref(), banner: banner.as_deref(), refresh_secs };
        let (title, body) = match route {
            Route::Pool => ("Pool", pages::pool(&snapshot.read().state, leader, &viewer)),
            Route::Queue => ("Queue", pages::queue(&snapshot.read().state, leader, &viewer, now_ms)),
            Route::Tenants => ("Tenants", pages::tenants(&snapshot.read().state, &viewer)),
            Route::Invoice(tenant) => {
                if !viewer.may_access(&tenant) {
                    let message = format!(
                        "permission denied: tenant {} cannot see the invoice of tenant {tenant}",
                        viewer.tenant().unwrap_or_default(),
                    );
                    self.security().audit.record(corral_security::AuditEvent::denied(
                        "web view",
                        format!("web {}", request.peer),
                        viewer.describe(),
                        message.as_str(),
                    ));
                    return error_page(403, "Permission denied", &message);
                }
                let body = {
                    let data = snapshot.read();
                    let state = &data.state;
                    let known =
                        state.config.tenants.contains(&tenant) || state.billed_by_tenant().contains_key(&tenant);
                    if !known {
                        return error_page(
                            404,
                            "No such tenant",
                            &format!("there is no tenant {tenant}: see the tenants page for those there are"),
                        );
                    }
                    pages::invoice(state, &tenant)
                };
                let title = format!("Invoice of {tenant}");
                return response(200, html::page(&frame(&title, Some(REFRESH_SECS)), &body));
            }
            Route::Job(job_ref) => {
                let job = match web_job(&snapshot, job_ref) {
                    Ok(job) => job,
                    Err(response) => return response,
                };
                if !viewer.may_access(&job.spec.tenant) {
                    let message = format!(
                        "permission denied: tenant {} cannot see job {} (owned by another tenant)",
                        viewer.tenant().unwrap_or_default(),
                        job.id
                    );
                    self.security().audit.record(corral_security::AuditEvent::denied(
                        "web view",
                        format!("web {}", request.peer),
                        viewer.describe(),
                        message.as_str(),
                    ));
                    return error_page(403, "Permission denied", &message);
                }
                let log = self.log_tail(&job).await;
                let refresh = (!job.state.is_terminal()).then_some(REFRESH_SECS);
                let title = format!("Job {}", job.display_id());
                let body = pages::job(&job, leader, &log, now_ms);
                return response(200, html::page(&frame(&title, refresh), &body));
            }
        };
        response(200, html::page(&frame(title, Some(REFRESH_SECS)), &body))
    }

    /// Why the web view's pages are not served on a listener bound to `listener`, if they are
    /// not. Without TLS and tokens every caller is admin, so the pages (every tenant's jobs,
    /// commands and output) are served only on a loopback listener — the rule `listen`
    /// follows — unless the config's `insecure = true` opts out; the listener then serves
    /// `/metrics` only.
    pub fn web_view_refusal(&self, listener: std::net::SocketAddr) -> Option<String> {
        let security = self.security();
        web_refusal(security.auth_enabled(), security.insecure, listener)
    }

    /// Whom a page request acts for, or the answer that refuses it (a login form for browsers).
    fn web_viewer(&self, request: &WebRequest) -> Result<Principal, WebResponse> {
        if !self.security().auth_enabled() {
            return Ok(Principal::Admin { name: "auth disabled".into() });
        }
        let bearer = request.authorization.as_deref().and_then(|v| v.strip_prefix("Bearer "));
        let token = bearer.or_else(|| request.cookie.as_deref().and_then(|c| cookie_value(c, COOKIE)));
        match self.principal_of_token(token, "web view", &format!("web {}", request.peer)) {
            Ok(principal) => Ok(principal),
            // The refusal is audited; a browser that never logged in just gets the form.
            Err(_) if token.is_none() => Err(login_page(401, None)),
            Err(status) => Err(login_page(401, Some(status.message()))),
        }
    }

    /// `POST /login`: checks the form's token and keeps it in an HttpOnly cookie.
    fn web_login(&self, request: &WebRequest) -> WebResponse {
        if !self.security().auth_enabled() {
            return see_other("/", format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"));
        }
        let Some(token) = form_value(&request.body, "token").map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
        else {
            return login_page(400, Some("enter a token"));
        };
        if !token.bytes().all(|b| b.is_ascii_graphic() && b != b';' && b != b',') {
            return login_page(400, Some("a token is one word of printable characters"));
        }
        match self.principal_of_token(Some(&token), "web login", &format!("web {}", request.peer)) {
            Ok(_) => {
                let secure = if request.secure { "; Secure" } else { "" };
                see_other("/", format!("{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict{secure}"))
            }
            Err(status) => login_page(401, Some(status.message())),
        }
    }

    /// The last part of the output of `job`'s first part, through the worker agent that has it.
    async fn log_tail(&self, job: &Job) -> LogTail {
        let request =
            pb::ReadLogsRequest { job_id: job.id, follow: false, rank: 0, tail_bytes: Some(LOG_TAIL_BYTES as u64) };
        let mut stream = match self.open_worker_logs(job, request).await {
            Ok(Some(stream)) => stream,
            Ok(None) if job.state == JobState::Pending => {
                return LogTail::Unavailable("The job has not run yet: no output.".into())
            }
            Ok(None) => return LogTail::Unavailable("The job never ran on a node: no output.".into()),
            Err(status) if status.code() == tonic::Code::NotFound => {
                return LogTail::Unavailable(format!(
                    "{}: the node is gone, and the job's output with it.",
                    status.message()
                ))
            }
            Err(status) => return LogTail::Unavailable(status.message().to_string()),
        };
        let mut tail: Vec<u8> = Vec::new();
        let mut truncated = false;
        let read = async {
            while let Some(chunk) = stream.next().await {
                let chunk = chunk?;
                tail.extend_from_slice(&chunk.data);
                if tail.len() > 2 * LOG_TAIL_BYTES {
                    tail.drain(..tail.len() - LOG_TAIL_BYTES);
                    truncated = true;
                }
            }
            Ok::<(), tonic::Status>(())
        };
        let outcome = tokio::time::timeout(LOG_READ_TIMEOUT, read).await;
        if let Ok(Err(status)) = outcome {
            return LogTail::Unavailable(format!("cannot read the output of job {}: {}", job.id, status.message()));
        }
        if tail.len() > LOG_TAIL_BYTES {
            tail.drain(..tail.len() - LOG_TAIL_BYTES);
            truncated = true;
        }
        LogTail::Text { text: String::from_utf8_lossy(&tail).into_owned(), truncated }
    }

    /// On a follower: what its pages cannot show, and where the leader is.
    fn follower_banner(&self) -> Option<String> {
        if self.is_leader() {
            return None;
        }
        let status = self.raft_node().status();
        let leader = match (status.leader, status.leader_addr) {
            (Some(id), Some(addr)) => format!("the leader is coordinator {id} at {addr}"),
            (Some(id), None) => format!("the leader is coordinator {id}"),
            _ => "no leader is known right now".to_string(),
        };
        Some(format!(
            "This coordinator ({}) is a follower: these pages show its copy of the replicated state, which may \
             lag the leader by a little. GPU readings and why jobs wait are kept by the leader only: open the web \
             view on the leader's metrics-addr ({leader}).",
            status.id
        ))
    }
}

/// See [`Coordinator::web_view_refusal`].
fn web_refusal(auth: bool, insecure: bool, listener: std::net::SocketAddr) -> Option<String> {
    if auth || insecure || listener.ip().is_loopback() {
        return None;
    }
    Some(format!(
        "the web view is off on {listener}: without [tls] or auth.require-tokens its pages would show every tenant's jobs, commands and output to anyone who reaches that address; serving /metrics only (bind metrics-addr to a loopback address, require tokens, or set insecure = true)"
    ))
}

/// The job a page names (from the hot state or the history), or its error page.
fn web_job(snapshot: &Snapshot, job_ref: JobRef) -> Result<Job, WebResponse> {
    let not_found = |what: String| error_page(404, "Job not found", &what);
    let job = match job_ref.task {
        None => snapshot.find_job(job_ref.id),
        Some(index) => {
            let hot = snapshot.read().state.array_task(job_ref.id, index);
            match hot {
                Some(id) => snapshot.find_job(id),
                None => snapshot.store().archived_task(job_ref.id, index),
            }
            .ok_or_else(|| {
                not_found(format!(
                    "there is no task {}_{index}: array {} has not created it (or is not an array)",
                    job_ref.id, job_ref.id
                ))
            })
            .map(Some)?
        }
    };
    job.ok_or_else(|| not_found(format!("there is no job {} in this pool", job_ref.id)))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_pages_or_readable_errors() {
        assert_eq!(route("/"), Ok(Route::Pool));
        assert_eq!(route("/queue"), Ok(Route::Queue));
        assert_eq!(route("/usage"), Ok(Route::Tenants));
        assert_eq!(route("/jobs/12"), Ok(Route::Job(JobRef { id: 12, task: None })));
        assert_eq!(route("/jobs/12_7"), Ok(Route::Job(JobRef { id: 12, task: Some(7) })));
        assert_eq!(route("/tenants/team-a"), Ok(Route::Invoice("team-a".into())));
        assert_eq!(route("/tenants/team%2Da"), Ok(Route::Invoice("team-a".into())));
        assert_eq!(route("/tenants/%ff").map_err(|r| r.status), Err(400));
        assert_eq!(route("/tenants/a/b").map_err(|r| r.status), Err(404));
        for (path, status) in
            [("/nope", 404), ("/jobs/", 404), ("/jobs/1/x", 404), ("/jobs/abc", 400), ("/jobs/1_x", 400)]
        {
            let answer = route(path).expect_err(path);
            assert_eq!(answer.status, status, "{path}");
            assert!(answer.body.contains("id=\"error\""), "{path}: {}", answer.body);
        }
        let answer = route("/jobs/<script>").expect_err("bad id");
        assert!(answer.body.contains("&lt;script&gt;") && !answer.body.contains("<script>"), "{}", answer.body);
    }

    #[test]
    fn pages_are_served_with_auth_or_on_loopback_or_when_asked_to() {
        let any: std::net::SocketAddr = "0.0.0.0:9471".parse().expect("addr");
        let public: std::net::SocketAddr = "10.1.2.3:9471".parse().expect("addr");
        let loopback: std::net::SocketAddr = "127.0.0.1:9471".parse().expect("addr");
        let loopback6: std::net::SocketAddr = "[::1]:9471".parse().expect("addr");
        for listener in [any, public] {
            let why = web_refusal(false, false, listener).expect("refused");
            assert!(why.contains("serving /metrics only") && why.contains("insecure = true"), "{why}");
            assert_eq!(why.lines().count(), 1);
            assert_eq!(web_refusal(true, false, listener), None, "tokens or TLS");
            assert_eq!(web_refusal(false, true, listener), None, "insecure = true");
        }
        assert_eq!(web_refusal(false, false, loopback), None);
        assert_eq!(web_refusal(false, false, loopback6), None);
    }

    #[test]
    fn login_and_logout_take_same_origin_posts_only() {
        let post = |origin: Option<&str>, referer: Option<&str>| WebRequest {
            method: "POST".into(),
            path: "/login".into(),
            host: Some("10.0.0.5:9471".into()),
            origin: origin.map(String::from),
            referer: referer.map(String::from),
            ..Default::default()
        };
        assert!(same_origin(&post(Some("http://10.0.0.5:9471"), None)).is_ok());
        assert!(same_origin(&post(None, Some("http://10.0.0.5:9471/login"))).is_ok());
        assert!(same_origin(&post(None, Some("http://10.0.0.5:9471"))).is_ok());
        for (origin, referer) in [
            (Some("http://evil.example"), None),
            (Some("null"), Some("http://10.0.0.5:9471/login")),
            (Some("https://10.0.0.5:9471"), None),
            (None, Some("http://10.0.0.5:9471.evil.example/x")),
            (None, Some("http://evil.example/http://10.0.0.5:9471/")),
            (None, None),
        ] {
            let refused = same_origin(&post(origin, referer)).expect_err("cross-site");
            assert_eq!(refused.status, 403, "{origin:?} {referer:?}");
            assert!(refused.body.contains("Cross-site request refused"), "{}", refused.body);
        }
        let no_host = WebRequest { host: None, ..post(Some("http://10.0.0.5:9471"), None) };
        assert!(same_origin(&no_host).is_err());
        let tls = WebRequest { secure: true, ..post(Some("https://10.0.0.5:9471"), None) };
        assert!(same_origin(&tls).is_ok());
    }

    #[test]
    fn tokens_come_from_cookies_and_forms() {
        assert_eq!(cookie_value("a=1; corral_token=crl_x; b=2", COOKIE), Some("crl_x"));
        assert_eq!(cookie_value("a=1", COOKIE), None);
        assert_eq!(form_value(b"token=crl_ab%2Bc+d&x=1", "token").as_deref(), Some("crl_ab+c d"));
        assert_eq!(form_value(b"token=%zz", "token"), None);
        assert_eq!(form_value(b"other=1", "token"), None);
    }
}
