//! The pages of the web view, as pure functions of the replicated state, what the leader keeps
//! in memory (GPU readings, why jobs wait; absent on a follower) and who is looking. Each
//! returns the markup of the page body; `web/mod.rs` frames it and serves it.
//!
//! Invariant: a tenant sees its own jobs only: on the pool page a GPU held by another tenant's
//! job says "other tenant" with no id or name, the queue lists only its jobs, and the tenants
//! page only its own row. Every user-controlled text goes through `escape`.
//!
//! Bounds: the queue lists at most `MAX_ROWS` pending and `MAX_ROWS` running jobs, after
//! looking at most `SCAN_ROWS` jobs for each list, and says how many it left out; counts come
//! from the state's counters; the pool page shows the nodes and what runs on them (the
//! cluster's size); a job page shows one job (its spec is bounded by `JobSpec::validate`) and
//! the output tail it is given.

use super::html::{escape, money};
use crate::auth::Principal;
use crate::scheduler::LeaderMemory;
use corral_core::{format_gpus, State, MILLI_PER_GPU};
use corral_types::{format_duration, format_size, format_utc, Job, JobState};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::time::Duration;

/// The tail of a job's output, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LogTail {
    /// The last bytes of the output (stdout and stderr as the worker sent them); `truncated`
    /// when earlier output was left out.
    Text { text: String, truncated: bool },
    /// No output to show, and why (e.g. the job's node is gone).
    Unavailable(String),
}

/// Shown where a follower cannot tell.
const ON_LEADER: &str = "shown on the leader";
/// Most jobs the queue page lists of each kind (pending, running).
pub(crate) const MAX_ROWS: usize = 500;
/// Most jobs the queue page looks at to find the rows of each list.
pub(crate) const SCAN_ROWS: usize = 100_000;

fn ago(now_ms: u64, then_ms: u64) -> String {
    format!("{} ago", format_duration(Duration::from_millis(now_ms.saturating_sub(then_ms))))
}

fn job_link(job: &Job) -> String {
    format!("<a href=\"/jobs/{}\">{}</a>", job.id, escape(&job.display_id()))
}

fn state_span(state: &str) -> String {
    format!("<span class=\"state-{0}\">{0}</span>", escape(state))
}

/// A command line as a shell would read it back: words with spaces or quotes single-quoted.
fn shell_words(words: &[String]) -> String {
    let plain = |w: &str| !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:=,+@%".contains(&b));
    words
        .iter()
        .map(|w| if plain(w) { w.clone() } else { format!("'{}'", w.replace('\'', "'\\''")) })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a job asks for: `2`, or its slice (`mps:25:8GiB`).
fn gpus_of(job: &Job) -> String {
    match &job.spec.gpu_slice {
        Some(slice) => escape(&slice.to_string()),
        None => job.spec.gpus.to_string(),
    }
}

/// The nodes (and GPUs) a job holds: `n1 [0,1]`.
fn placement_of(job: &Job) -> String {
    let Some(allocation) = &job.allocation else { return "-".into() };
    allocation
        .parts()
        .map(|(node, gpus)| {
            let gpus: Vec<String> = gpus.iter().map(u32::to_string).collect();
            format!("{} [{}]", escape(node), gpus.join(","))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The pool: every node with its state and GPUs (readings, health, the jobs on each), and totals.
pub(crate) fn pool(state: &State, leader: Option<&LeaderMemory<'_>>, viewer: &Principal) -> String {
    let mut body = String::from("<h1>Pool</h1>");
    let mut node_states: BTreeMap<&str, usize> = BTreeMap::new();
    let mut gpu_states: BTreeMap<&str, usize> = BTreeMap::new();
    let mut nodes_html = String::new();
    for node in state.nodes.values() {
        let name = node.spec.name.as_str();
        let jobs: Vec<&Job> = state.jobs_on_node(name).collect();
        let display = node.display_state(jobs.len());
        *node_states.entry(display).or_default() += 1;
        let live = leader.and_then(|m| m.live.get(name)).filter(|l| l.heard);
        let _ = write!(
            nodes_html,
            "<section class=\"node\" id=\"node-{0}\"><h2>{0} {1}</h2><p>{2} GPUs, {3} CPUs, {4} memory; \
             {5} running job(s)",
            escape(name),
            state_span(display),
            node.spec.gpus.len(),
            format_gpus(node.spec.cpu_millis),
            format_size(node.spec.memory_bytes),
            jobs.len(),
        );
        if !node.spec.labels.is_empty() {
            let labels: Vec<String> = node.spec.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = write!(nodes_html, "; labels {}", escape(&labels.join(", ")));
        }
        if !node.mode_reason.is_empty() {
            let _ = write!(nodes_html, "; reason: {}", escape(&node.mode_reason));
        }
        if let Some(end) = node.lease_end() {
            let _ = write!(nodes_html, "; lease ends {}", escape(&format_utc(end)));
        }
        match (leader, live) {
            (Some(_), Some(l)) => {
                let _ = write!(nodes_html, "; last heartbeat {}", escape(&format_duration(l.last_seen.elapsed())));
                nodes_html.push_str(" ago");
            }
            (Some(_), None) => nodes_html.push_str("; no heartbeat yet in this leader's term"),
            (None, _) => {}
        }
        nodes_html.push_str(
            "</p><table class=\"gpus\"><tr><th>GPU</th><th>Model</th><th>State</th><th>Temperature</th>\
             <th>Utilisation</th><th>Memory used</th><th>Power</th><th>Jobs</th></tr>",
        );
        for gpu in &node.spec.gpus {
            let health = live.and_then(|l| l.gpus.iter().find(|h| h.index == gpu.index));
            let on_gpu: Vec<&&Job> = jobs
                .iter()
                .filter(|j| {
                    j.allocation.as_ref().and_then(|a| a.gpus_on(name)).is_some_and(|gs| gs.contains(&gpu.index))
                })
                .collect();
            let gpu_state = if health.is_some_and(|h| h.dirty) {
                "dirty"
            } else if health.is_some_and(|h| !h.problems.is_empty()) {
                "unhealthy"
            } else if !on_gpu.is_empty() {
                "allocated"
            } else if node.accepts_jobs() {
                "idle"
            } else {
                "unavailable"
            };
            if display != "down" {
                *gpu_states.entry(gpu_state).or_default() += 1;
            }
            let class = match gpu_state {
                "dirty" | "unhealthy" => "bad",
                "allocated" => "warn",
                "idle" => "ok",
                _ => "other",
            };
            let mut state_cell = format!("<span class=\"{class}\">{gpu_state}</span>");
            if let Some(h) = health {
                for problem in &h.problems {
                    let _ = write!(state_cell, "<br>{}", escape(problem));
                }
                if h.dirty && !h.dirty_reason.is_empty() {
                    let _ = write!(state_cell, "<br>{}", escape(&h.dirty_reason));
                }
            }
            let reading = |f: &dyn Fn(&corral_types::GpuHealth) -> String| match (leader, health) {
                (_, Some(h)) => f(h),
                (None, None) => ON_LEADER.to_string(),
                (Some(_), None) => "-".to_string(),
            };
            let jobs_cell = if on_gpu.is_empty() {
                "-".to_string()
            } else {
                on_gpu
                    .iter()
                    .map(|j| {
                        if !viewer.may_access(&j.spec.tenant) {
                            return "<span class=\"other\">other tenant</span>".to_string();
                        }
                        let mut cell = format!("{} {} ({})", job_link(j), escape(&j.spec.name), escape(&j.spec.tenant));
                        if let Some(slice) = j.allocation.as_ref().and_then(|a| a.slice.as_ref()) {
                            let _ = write!(cell, " {}", escape(&slice.to_string()));
                        }
                        cell
                    })
                    .collect::<Vec<_>>()
                    .join("<br>")
            };
            let _ = write!(
                nodes_html,
                "<tr class=\"gpu\"><td class=\"num\">{}</td><td>{}</td><td>{state_cell}</td><td class=\"num\">{}</td>\
                 <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{jobs_cell}</td></tr>",
                gpu.index,
                escape(&gpu.model),
                reading(&|h| format!("{} °C", h.temperature_c)),
                reading(&|h| format!("{} %", h.utilization_percent)),
                reading(&|h| format!("{} / {} MiB", h.memory_used_mib, gpu.memory_mib)),
                reading(&|h| format!("{:.0} W", h.power_mw as f64 / 1000.0)),
            );
        }
        nodes_html.push_str("</table></section>");
    }
    let running = match viewer.tenant() {
        Some(tenant) => state.running_count_of(tenant) as usize,
        // What runs is what the nodes above hold: the cluster's size.
        None => state.running_jobs().count(),
    };
    let pending = pending_count(state, viewer);
    let total_gpus: usize = gpu_states.values().sum();
    let _ = write!(
        body,
        "<p class=\"totals\" id=\"totals\"><span>{} node(s)</span><span>{total_gpus} GPUs on nodes not down</span>",
        state.nodes.len()
    );
    for (s, n) in &node_states {
        let _ = write!(body, "<span>{n} {s}</span>");
    }
    for s in ["allocated", "idle", "unhealthy", "dirty", "unavailable"] {
        let _ = write!(body, "<span>{} GPUs {s}</span>", gpu_states.get(s).copied().unwrap_or(0));
    }
    let whose = if viewer.is_admin() { "" } else { " of yours" };
    let _ = write!(body, "<span>{running} job(s){whose} running</span><span>{pending} pending</span></p>");
    if state.nodes.is_empty() {
        body.push_str(
            "<p id=\"empty\">No worker node has registered yet: start a worker (corral worker --config FILE).</p>",
        );
    }
    body.push_str(&nodes_html);
    body
}

/// Why a pending job waits, as the queue page says it.
fn wait_reason(job: &Job, leader: Option<&LeaderMemory<'_>>) -> String {
    if job.held {
        return format!("held: corral release {}", job.display_id());
    }
    if !job.waiting_on.is_empty() {
        let ids: Vec<String> = job.waiting_on.iter().map(u64::to_string).collect();
        return format!("dependency: waits for job(s) {}", ids.join(", "));
    }
    match leader {
        Some(m) => match (m.pending.reason(job.id), &job.reason) {
            (Some(reason), _) => reason.to_string(),
            (None, Some(reason)) => reason.clone(),
            (None, None) => "not looked at by a scheduling pass yet".into(),
        },
        None => ON_LEADER.into(),
    }
}

/// Pending jobs `viewer` may see (held and waiting ones included).
fn pending_count(state: &State, viewer: &Principal) -> usize {
    match viewer.tenant() {
        Some(tenant) => state.pending_count_of(tenant) as usize,
        None => state.pending_count(),
    }
}

/// What a list of the queue page left out: `shown` of `total` jobs listed.
fn more_rows(shown: usize, total: usize, command: &str) -> String {
    if shown >= total {
        return String::new();
    }
    format!(
        "<p class=\"more\">{} more not listed here (this page lists at most {MAX_ROWS}): <code>{command}</code> lists them all.</p>",
        total - shown
    )
}

/// The queue: pending jobs in the order the leader's last pass considered them (then those it
/// did not look at, by id), each with why it waits, and the running jobs; at most `MAX_ROWS`
/// of each.
pub(crate) fn queue(state: &State, leader: Option<&LeaderMemory<'_>>, viewer: &Principal, now_ms: u64) -> String {
    let visible = |j: &&Job| viewer.may_access(&j.spec.tenant);
    let is_pending = |j: &&Job| j.state == JobState::Pending;
    let mut ordered: Vec<&Job> = Vec::new();
    let mut seen = BTreeSet::new();
    let pass_order = leader.map(|m| m.pending.order()).unwrap_or_default();
    let by_pass = pass_order.iter().filter_map(|id| state.jobs.get(id));
    // Then those the pass did not look at, by id.
    let candidates = by_pass.chain(state.pending_jobs()).take(SCAN_ROWS);
    for job in candidates.filter(is_pending).filter(visible) {
        if ordered.len() >= MAX_ROWS {
            break;
        }
        if seen.insert(job.id) {
            ordered.push(job);
        }
    }
    let mut body = String::from("<h1>Queue</h1>");
    let total_pending = pending_count(state, viewer);
    let _ = write!(body, "<h2>Pending ({total_pending})</h2>");
    if ordered.is_empty() && total_pending == 0 {
        body.push_str("<p>No job waits.</p>");
    } else {
        body.push_str(
            "<table id=\"pending\"><tr><th>#</th><th>Job</th><th>Name</th><th>Tenant</th><th>Class</th><th>GPUs</th>\
             <th>Submitted</th><th>Why it waits</th></tr>",
        );
        for (n, job) in ordered.iter().enumerate() {
            let _ = write!(
                body,
                "<tr class=\"job\" id=\"job-{}\"><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td class=\"num\">{}</td><td>{}</td><td class=\"reason\">{}</td></tr>",
                job.id,
                n + 1,
                job_link(job),
                escape(&job.spec.name),
                escape(&job.spec.tenant),
                escape(&job.spec.priority_class),
                gpus_of(job),
                ago(now_ms, job.submitted_at.physical_ms()),
                escape(&wait_reason(job, leader)),
            );
        }
        body.push_str("</table>");
        body.push_str(&more_rows(ordered.len(), total_pending, "corral queue"));
    }
    let total_running = match viewer.tenant() {
        Some(tenant) => state.running_count_of(tenant) as usize,
        None => state.running_jobs().take(SCAN_ROWS).count(),
    };
    let running: Vec<&Job> = state.running_jobs().take(SCAN_ROWS).filter(visible).take(MAX_ROWS).collect();
    let _ = write!(body, "<h2>Running ({total_running})</h2>");
    if running.is_empty() && total_running == 0 {
        body.push_str("<p>No job runs.</p>");
    } else {
        body.push_str(
            "<table id=\"running\"><tr><th>Job</th><th>Name</th><th>Tenant</th><th>Class</th><th>GPUs</th>\
             <th>Node</th><th>Started</th><th>Time limit</th></tr>",
        );
        let shown = running.len();
        for job in running {
            let started = match job.started_at {
                Some(t) => ago(now_ms, t.physical_ms()),
                // A run whose image is still being pulled says how far the pull is.
                None => leader.and_then(|m| m.pulls.detail(job)).unwrap_or_else(|| "starting".into()),
            };
            let limit = job
                .spec
                .time_limit_secs
                .map(|s| format_duration(Duration::from_secs(s)))
                .unwrap_or_else(|| "none".into());
            let _ = write!(
                body,
                "<tr class=\"job\" id=\"job-{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td>\
                 <td>{}</td><td>{started}</td><td>{}</td></tr>",
                job.id,
                job_link(job),
                escape(&job.spec.name),
                escape(&job.spec.tenant),
                escape(&job.spec.priority_class),
                gpus_of(job),
                placement_of(job),
                escape(&limit),
            );
        }
        body.push_str("</table>");
        body.push_str(&more_rows(shown, total_running, "corral jobs --state running"));
    }
    body
}

/// One job: its spec, state, times, placement, exit and the tail of its output.
pub(crate) fn job(job: &Job, leader: Option<&LeaderMemory<'_>>, log: &LogTail, now_ms: u64) -> String {
    let mut body =
        format!("<h1>Job {} {}</h1><table id=\"job\">", escape(&job.display_id()), state_span(job.state.as_str()));
    let mut row = |key: &str, value: String| {
        let _ = write!(body, "<tr><th>{key}</th><td>{value}</td></tr>");
    };
    row("Name", escape(&job.spec.name));
    row("Tenant", escape(&job.spec.tenant));
    row("State", state_span(job.state.as_str()));
    row("Priority class", escape(&job.spec.priority_class));
    row("Command", format!("<code>{}</code>", escape(&shell_words(&job.spec.command))));
    if let Some(image) = &job.spec.image {
        row("Image", escape(image));
    }
    if job.spec.script.is_some() {
        row("Script", "batch script".into());
    }
    let mut resources = format!("{} GPU(s)", gpus_of(job));
    if job.spec.parts() > 1 {
        let _ = write!(resources, " on {} nodes", job.spec.parts());
    }
    if job.spec.cpu_millis > 0 {
        let _ = write!(resources, ", {} CPUs", format_gpus(u64::from(job.spec.cpu_millis)));
    }
    if job.spec.memory_bytes > 0 {
        let _ = write!(resources, ", {} memory", format_size(job.spec.memory_bytes));
    }
    row("Resources", resources);
    let limit =
        job.spec.time_limit_secs.map(|s| format_duration(Duration::from_secs(s))).unwrap_or_else(|| "none".into());
    row("Time limit", escape(&limit));
    let time = |t: Option<corral_types::Timestamp>| match t {
        Some(t) => format!("{} ({})", format_utc(t), ago(now_ms, t.physical_ms())),
        None => "-".into(),
    };
    row("Submitted", time(Some(job.submitted_at)));
    row("Placed", time(job.admitted_at));
    row("Started", time(job.started_at));
    row("Finished", time(job.finished_at));
    row("Node", placement_of(job));
    row("Exit code", job.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()));
    if let Some(signal) = job.signal {
        row("Signal", signal.to_string());
    }
    let pulling = || leader.and_then(|m| m.pulls.detail(job));
    let reason = if job.state == JobState::Pending {
        wait_reason(job, leader)
    } else {
        job.reason.clone().or_else(pulling).unwrap_or_else(|| "-".into())
    };
    row("Reason", format!("<span id=\"reason\">{}</span>", escape(&reason)));
    row("Attempts", job.attempts.to_string());
    if let Some(max) = job.spec.sched.max_restarts {
        row("Restarts", format!("{} of {max}", job.restarts));
    }
    body.push_str("</table><h2>Output</h2>");
    match log {
        LogTail::Text { text, truncated } => {
            if *truncated {
                body.push_str("<p>The last part of the output (corral logs shows all of it):</p>");
            }
            if text.is_empty() {
                body.push_str("<p id=\"log-note\">No output yet.</p>");
            }
            let _ = write!(body, "<pre class=\"log\" id=\"log\">{}</pre>", escape(text));
        }
        LogTail::Unavailable(why) => {
            let _ = write!(body, "<p id=\"log-note\">{}</p>", escape(why));
        }
    }
    body
}

/// Per tenant: running and pending jobs, GPUs held, quota and what the billing ledger holds.
pub(crate) fn tenants(state: &State, viewer: &Principal) -> String {
    let billed = state.billed_by_tenant();
    let mut names: BTreeSet<&str> = state.config.tenants.iter().map(String::as_str).collect();
    names.extend(state.live_jobs().map(|j| j.spec.tenant.as_str()));
    names.extend(billed.keys().map(String::as_str));
    let mut body = String::from(
        "<h1>Tenants</h1><table id=\"tenants\"><tr><th>Tenant</th><th>Running jobs</th><th>Pending jobs</th>\
         <th>GPUs held</th><th>Quota (GPUs)</th><th>Cohort</th><th>GPU-hours billed</th><th>Charged</th>\
         <th>Credited</th><th>Net</th><th></th></tr>",
    );
    for name in names.into_iter().filter(|t| viewer.may_access(t)) {
        let policy = state.config.tenant_policies.get(name);
        let quota = policy.and_then(|p| p.quota_milli_gpus).map(format_gpus).unwrap_or_else(|| "none".into());
        let cohort = policy.and_then(|p| p.cohort.clone()).unwrap_or_else(|| "-".into());
        let total = billed.get(name);
        let gpu_hours = total.map_or(0.0, |t| t.gpu_milli_ms as f64 / MILLI_PER_GPU as f64 / 3_600_000.0);
        let _ = write!(
            body,
            "<tr class=\"tenant\" id=\"tenant-{0}\"><td>{0}</td><td class=\"num\">{1}</td><td class=\"num\">{2}</td>\
             <td class=\"num\">{3}</td><td class=\"num\">{4}</td><td>{5}</td><td class=\"num\">{6:.3}</td>\
             <td class=\"num\">{7}</td><td class=\"num\">{8}</td><td class=\"num\">{9}</td>\
             <td><a href=\"/tenants/{10}\">invoice</a></td></tr>",
            escape(name),
            state.running_count_of(name),
            state.pending_count_of(name),
            format_gpus(state.tenant_usage(name)),
            escape(&quota),
            escape(&cohort),
            gpu_hours,
            money(total.map_or(0, |t| t.cost_micros)),
            credited(total.map_or(0, |t| t.credited_micros)),
            money(total.map_or(0, |t| t.cost_micros.saturating_sub(t.credited_micros))),
            url_segment(name),
        );
    }
    body.push_str("</table>");
    body
}

/// A credit as an amount: negative, or a plain zero.
fn credited(micros: u64) -> String {
    if micros == 0 {
        money(0)
    } else {
        format!("-{}", money(micros))
    }
}

/// `name` as one path segment of a link (tenant names are `[a-z0-9-]`, but a link never
/// trusts that).
fn url_segment(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One tenant's invoice, as `corral billing invoice --tenant T` prints it: the totals of every
/// run billed to it (archived ones included) less the credits, then its latest ledger entries
/// still in memory, newest first — each billed run (job, GPUs, model, class, start, end, billed
/// length, price, amount, why it ended) and each credit (a negative amount naming the entry it
/// credits and the cause). At most [`MAX_ROWS`] entries, looking at most [`SCAN_ROWS`].
pub(crate) fn invoice(state: &State, tenant: &str) -> String {
    let billed = state.billed_by_tenant();
    let total = billed.get(tenant).copied().unwrap_or_default();
    let gpu_hours = total.gpu_milli_ms as f64 / MILLI_PER_GPU as f64 / 3_600_000.0;
    let mut body = format!(
        "<h1>Invoice of tenant {0}</h1><table id=\"totals\"><tr><th>GPU-hours billed</th><th>Charged</th>\
         <th>Credited</th><th>Net</th></tr><tr><td class=\"num\">{1:.3}</td><td class=\"num\">{2}</td>\
         <td class=\"num\">{3}</td><td class=\"num\">{4}</td></tr></table>\
         <h2>Latest entries</h2><table id=\"entries\"><tr><th>Entry</th><th>Job</th><th>GPUs</th><th>Model</th>\
         <th>Class</th><th>Start</th><th>End</th><th>Billed</th><th>Price/h</th><th>Amount</th><th>Cause</th></tr>",
        escape(tenant),
        gpu_hours,
        money(total.cost_micros),
        credited(total.credited_micros),
        money(total.cost_micros.saturating_sub(total.credited_micros)),
    );
    let mut shown = 0;
    for segment in state.ledger.values().rev().take(SCAN_ROWS).filter(|g| g.tenant == tenant) {
        if shown == MAX_ROWS {
            break;
        }
        shown += 1;
        let cause = segment.cause.map_or("-", |c| c.as_str());
        let job = format!("<a href=\"/jobs/{0}\">{0}</a>", segment.job_id);
        if segment.is_credit() {
            let of = segment.credit_for.map(|id| format!(", entry {id}")).unwrap_or_default();
            let _ = write!(
                body,
                "<tr class=\"credit\"><td>{}</td><td>{job}</td><td></td><td></td><td></td><td>{}</td><td></td>\
                 <td></td><td></td><td class=\"num\">{}</td><td>credit: {}{}</td></tr>",
                segment.id,
                format_utc(segment.start),
                credited(segment.cost_micros),
                escape(cause),
                of,
            );
        } else {
            let _ = write!(
                body,
                "<tr class=\"charge\"><td>{}</td><td>{job}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
                 <td>{}</td></tr>",
                segment.id,
                corral_core::format_multiplier(segment.gpu_milli),
                escape(&segment.gpu_model),
                escape(&segment.priority_class),
                format_utc(segment.start),
                format_utc(segment.end),
                format_duration(Duration::from_millis(segment.duration_ms())),
                money(segment.price_micros_per_gpu_hour),
                money(segment.cost_micros),
                escape(cause),
            );
        }
    }
    body.push_str("</table>");
    if shown == 0 {
        body.push_str("<p>No entries in memory: older ones are in the history.</p>");
    }
    let _ = write!(
        body,
        "<p>Entries archived to the history, and the whole bill as a file: <code>corral billing invoice \
         --tenant {} [--since] [--until] [--format csv]</code>.</p>",
        escape(tenant)
    );
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::NodeLive;
    use crate::pulls::PullBoard;
    use crate::scheduler::PendingJobs;
    use crate::testing::{apply, dev_state_with_node};
    use corral_core::{schedule, ClusterConfig, Command};
    use corral_types::{GpuHealth, JobSpec, Timestamp};
    use std::time::Instant;

    const EVIL: &str = "<script>alert(1)</script>";

    fn spec(name: &str, tenant: &str, gpus: u32) -> JobSpec {
        JobSpec {
            name: name.into(),
            tenant: tenant.into(),
            gpus,
            command: vec!["echo".into(), "<b>hi</b>".into()].into(),
            ..Default::default()
        }
    }

    fn admin() -> Principal {
        Principal::Admin { name: "test".into() }
    }

    fn tenant(name: &str) -> Principal {
        Principal::Tenant { tenant: name.into(), token_id: 1 }
    }

    /// Node `n1` with two GPUs; job 1 (team-a, named like a script, 1 GPU) runs on GPU 0; job 2
    /// (team-b, 2 GPUs) and job 3 (team-a) wait.
    fn pool_state() -> State {
        let mut state = dev_state_with_node();
        apply(&mut state, 2_000, Command::SubmitJob { request_id: "a".into(), spec: spec(EVIL, "team-a", 1) });
        let pass = schedule(&state, Timestamp::compose(2_500, 0), &BTreeSet::new());
        apply(&mut state, 2_500, pass.command().expect("a placement"));
        apply(&mut state, 3_000, Command::SubmitJob { request_id: "b".into(), spec: spec("big", "team-b", 2) });
        apply(&mut state, 3_100, Command::SubmitJob { request_id: "c".into(), spec: spec("small", "team-a", 2) });
        state
    }

    fn live() -> BTreeMap<String, NodeLive> {
        let hot = GpuHealth {
            index: 1,
            temperature_c: 91,
            utilization_percent: 0,
            problems: vec!["overheating: 91 C <hot>".into()],
            ..Default::default()
        };
        let busy = GpuHealth {
            index: 0,
            temperature_c: 64,
            utilization_percent: 97,
            memory_used_mib: 1000,
            ..Default::default()
        };
        BTreeMap::from([("n1".to_string(), NodeLive { last_seen: Instant::now(), gpus: vec![busy, hot], heard: true })])
    }

    fn assert_no_raw_markup(html: &str) {
        assert!(!html.contains("<script>") && !html.contains("<b>hi") && !html.contains("<hot>"), "{html}");
    }

    #[test]
    fn pool_shows_nodes_gpus_readings_and_escaped_jobs() {
        let state = pool_state();
        let (pending, live) = (PendingJobs::default(), live());
        let memory = LeaderMemory { pending: &pending, live: &live, pulls: &PullBoard::default() };
        let html = pool(&state, Some(&memory), &admin());
        assert!(html.contains("<h2>n1 <span class=\"state-up\">up</span></h2>"), "{html}");
        assert!(html.contains("64 °C") && html.contains("97 %") && html.contains("1000 / 32768 MiB"), "{html}");
        assert!(html.contains("overheating: 91 C &lt;hot&gt;") && html.contains(">unhealthy<"), "{html}");
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt; (team-a)"), "{html}");
        assert!(html.contains("<a href=\"/jobs/1\">1</a>"), "{html}");
        assert!(html.contains("<span>1 GPUs allocated</span>") && html.contains("<span>1 GPUs unhealthy</span>"));
        assert!(html.contains("<span>1 job(s) running</span><span>2 pending</span>"), "{html}");
        assert_no_raw_markup(&html);
    }

    #[test]
    fn a_tenant_sees_other_tenants_jobs_only_as_other_tenant() {
        let state = pool_state();
        let (pending, live) = (PendingJobs::default(), live());
        let memory = LeaderMemory { pending: &pending, live: &live, pulls: &PullBoard::default() };
        let html = pool(&state, Some(&memory), &tenant("team-b"));
        assert!(html.contains("<span class=\"other\">other tenant</span>"), "{html}");
        assert!(!html.contains("/jobs/1") && !html.contains("alert") && !html.contains("team-a"), "{html}");
        assert!(html.contains("<span>0 job(s) of yours running</span><span>1 pending</span>"), "{html}");
        let own = pool(&state, Some(&memory), &tenant("team-a"));
        assert!(own.contains("<a href=\"/jobs/1\">1</a>"), "{own}");
    }

    #[test]
    fn an_empty_pool_says_so_and_a_follower_says_where_readings_are() {
        let mut state = State::default();
        apply(&mut state, 1_000, Command::Configure(ClusterConfig::dev_defaults()));
        let html = pool(&state, None, &admin());
        assert!(html.contains("No worker node has registered yet"), "{html}");
        assert!(html.contains("<span>0 node(s)</span><span>0 GPUs on nodes not down</span>"), "{html}");
        let html = pool(&pool_state(), None, &admin());
        assert!(html.contains(ON_LEADER), "a follower has no GPU readings: {html}");
    }

    #[test]
    fn queue_follows_the_pass_order_with_reasons_and_filters_tenants() {
        let state = pool_state();
        // The pass looked at job 3 before job 2.
        let pending = PendingJobs::of_pass([
            (3, "quota: <tenant> team-a uses 1 of its 1".to_string()),
            (2, "resources: needs 2 gpus on one node".to_string()),
        ]);
        let live = BTreeMap::new();
        // Job 1 is placed, its image still pulled on n1.
        let pulls = PullBoard::default();
        let epoch = state.jobs[&1].allocation.as_ref().expect("placed").epoch;
        let progress = corral_proto::v1::PullProgress {
            job_id: 1,
            epoch,
            image: "reg:5000/train:v1".into(),
            layers_done: 1,
            layers_total: 3,
            bytes_done: 12_300_000,
            bytes_total: 200_000_000,
        };
        pulls.report("n1", vec![progress]);
        let memory = LeaderMemory { pending: &pending, live: &live, pulls: &pulls };
        let html = queue(&state, Some(&memory), &admin(), 13_000);
        assert!(html.contains("<td>pulling image reg:5000/train:v1: 1/3 layers, 12.3/200.0 MB</td>"), "{html}");
        let (at3, at2) = (html.find("id=\"job-3\"").expect("job 3"), html.find("id=\"job-2\"").expect("job 2"));
        assert!(at3 < at2, "queue order: {html}");
        assert!(
            html.contains("resources: needs 2 gpus on one node") && html.contains("quota: &lt;tenant&gt;"),
            "{html}"
        );
        assert!(html.contains("<h2>Running (1)</h2>") && html.contains("n1 [0]"), "{html}");
        assert!(html.contains("10s ago"), "job 2 was submitted 10 s before now: {html}");
        assert_no_raw_markup(&html);
        let b = queue(&state, Some(&memory), &tenant("team-b"), 13_000);
        assert!(b.contains("id=\"job-2\"") && !b.contains("id=\"job-3\"") && !b.contains("id=\"job-1\""), "{b}");
        assert!(b.contains("<h2>Running (0)</h2>"), "{b}");
        let follower = queue(&state, None, &admin(), 13_000);
        assert!(follower.contains(ON_LEADER), "{follower}");
    }

    /// A queue longer than a page lists `MAX_ROWS` jobs, counts them all and names the command
    /// that lists the rest; a tenant's count is its own.
    #[test]
    fn a_long_queue_lists_at_most_max_rows_and_says_how_many_more() {
        let mut state = pool_state();
        let extra = MAX_ROWS + 7;
        for i in 0..extra {
            let command = Command::SubmitJob { request_id: format!("q{i}"), spec: spec("queued", "team-b", 1) };
            apply(&mut state, 4_000 + i as u64, command);
        }
        let html = queue(&state, None, &admin(), 13_000);
        // Jobs 2 and 3 of the pool wait too.
        let total = extra + 2;
        assert!(html.contains(&format!("<h2>Pending ({total})</h2>")), "the count is whole");
        assert_eq!(
            html.matches("<tr class=\"job\" id=\"job-").count(),
            MAX_ROWS + 1,
            "a page of pending jobs and the running one"
        );
        assert!(html.contains(&format!("{} more not listed here", total - MAX_ROWS)), "{html}");
        assert!(html.contains("<code>corral queue</code>"), "{html}");
        let a = queue(&state, None, &tenant("team-a"), 13_000);
        assert!(a.contains("<h2>Pending (1)</h2>") && !a.contains("more not listed"), "{a}");
    }

    #[test]
    fn job_page_escapes_spec_reason_and_log() {
        let state = pool_state();
        let job1 = state.jobs[&1].clone();
        let log = LogTail::Text { text: "step 1\n<img src=x onerror=alert(2)>\n".into(), truncated: false };
        let html = job(&job1, None, &log, 13_000);
        assert!(html.contains("<code>echo &#39;&lt;b&gt;hi&lt;/b&gt;&#39;</code>"), "{html}");
        assert!(html.contains("&lt;img src=x onerror=alert(2)&gt;") && !html.contains("<img"), "{html}");
        assert!(html.contains("n1 [0]") && html.contains("<th>Attempts</th><td>1</td>"), "{html}");
        assert_no_raw_markup(&html);
        let gone = LogTail::Unavailable("node <n1> of job 1 is not registered".into());
        let html = job(&job1, None, &gone, 13_000);
        assert!(html.contains("node &lt;n1&gt; of job 1 is not registered"), "{html}");
    }

    #[test]
    fn commands_read_back_as_shell_words() {
        let words = |ws: &[&str]| shell_words(&ws.iter().map(|w| w.to_string()).collect::<Vec<_>>());
        assert_eq!(words(&["python", "train.py", "--lr=0.1"]), "python train.py --lr=0.1");
        assert_eq!(words(&["sh", "-c", "echo hi; sleep 1"]), "sh -c 'echo hi; sleep 1'");
        assert_eq!(words(&["echo", "it's", ""]), "echo 'it'\\''s' ''");
    }

    #[test]
    fn tenants_page_shows_usage_quota_and_cost_of_visible_tenants() {
        let state = pool_state();
        let html = tenants(&state, &admin());
        for t in ["default", "team-a", "team-b"] {
            assert!(html.contains(&format!("id=\"tenant-{t}\"")), "{t}: {html}");
        }
        assert!(
            html.contains(
                "<td>team-a</td><td class=\"num\">1</td><td class=\"num\">1</td><td class=\"num\">1</td><td class=\"num\">4</td><td>dev</td>"
            ),
            "{html}"
        );
        let own = tenants(&state, &tenant("team-b"));
        assert!(own.contains("id=\"tenant-team-b\"") && !own.contains("team-a") && !own.contains("default"), "{own}");
        assert!(own.contains("<a href=\"/tenants/team-b\">invoice</a>"), "{own}");
    }

    fn segment(id: u64, tenant: &str, cost_micros: u64, credit_for: Option<u64>) -> corral_types::Segment {
        corral_types::Segment {
            id,
            job_id: 7,
            epoch: 3,
            tenant: tenant.into(),
            node: "n1".into(),
            gpu_model: "RTX 5090".into(),
            gpus: 1,
            gpu_milli: 1000,
            priority_class: "normal".into(),
            multiplier_milli: 1000,
            price_micros_per_gpu_hour: 890_000,
            start: Timestamp::compose(1_000, 0),
            end: Timestamp::compose(3_601_000, 0),
            duration_ms: 3_600_000,
            lost: false,
            end_state: "requeued".into(),
            cost_micros,
            policy_version: 1,
            cause: Some(corral_types::EndCause::GpuFault),
            credit_for,
        }
    }

    /// A tenant's invoice: the totals net of credits, the run and its credit (negative, naming
    /// the entry it credits), and nothing of another tenant.
    #[test]
    fn an_invoice_lists_runs_and_credits_and_totals_net_of_credits() {
        let mut state = pool_state();
        state.ledger.insert(1, segment(1, "team-a", 890_000, None));
        state.ledger.insert(2, segment(2, "team-a", 890_000, Some(1)));
        state.ledger.insert(3, segment(3, "team-b", 1_780_000, None));
        let html = invoice(&state, "team-a");
        assert!(html.contains("<h1>Invoice of tenant team-a</h1>"), "{html}");
        assert!(
            html.contains(
                "<td class=\"num\">1.000</td><td class=\"num\">0.890000</td><td class=\"num\">-0.890000</td>\
                 <td class=\"num\">0.000000</td>"
            ),
            "GPU-hours, charged, credited and net: {html}"
        );
        let credit = html.find("class=\"credit\"").expect("the credit's row");
        let charge = html.find("class=\"charge\"").expect("the run's row");
        assert!(credit < charge, "newest first: {html}");
        assert!(html.contains("<td class=\"num\">-0.890000</td><td>credit: gpu-fault, entry 1</td>"), "{html}");
        assert!(html.contains("<td>RTX 5090</td><td>normal</td>") && html.contains("1h"), "{html}");
        assert!(html.contains("<a href=\"/jobs/7\">7</a>"), "{html}");
        assert!(!html.contains("1.780000"), "another tenant's entry: {html}");
        let tenants_page = tenants(&state, &admin());
        assert!(
            tenants_page.contains(
                "<td class=\"num\">0.890000</td><td class=\"num\">-0.890000</td><td class=\"num\">0.000000</td>"
            ),
            "{tenants_page}"
        );
        let none = invoice(&state, "default");
        assert!(none.contains("No entries in memory"), "{none}");
    }
}
