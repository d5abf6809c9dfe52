//! Human tables and JSON documents for jobs and nodes; tables printed page by page as a
//! paged listing arrives (`StreamTable`, `JobsTableStream`).

use corral_proto::v1 as pb;
use corral_types::{format_duration, format_size, Job, JobState, Timestamp};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Wall-clock now as a TSO-comparable timestamp (display only).
fn now_ts() -> Timestamp {
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    Timestamp::compose(ms, 0)
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for a TSO timestamp (shared with the coordinator's web view).
pub use corral_types::format_utc;

/// How long the job has run (or ran).
pub fn elapsed(job: &Job) -> Option<Duration> {
    let start = job.started_at?;
    let end = job.finished_at.unwrap_or_else(now_ts);
    Some(Duration::from_millis(end.millis_since(start)))
}

/// Why a job is where it is, for humans.
pub fn reason(job: &Job) -> String {
    match (&job.reason, job.state) {
        (Some(r), _) => r.clone(),
        (None, JobState::Pending) => "waiting for resources".into(),
        (None, JobState::Running) if job.started_at.is_none() => "starting".into(),
        (None, _) => String::new(),
    }
}

/// What a job asks for: its whole-GPU count or its slice (`2`, `mps:25`).
pub fn resources(job: &Job) -> String {
    match &job.spec.gpu_slice {
        Some(slice) => slice.to_string(),
        None => job.spec.gpus.to_string(),
    }
}

pub fn job_json(job: &Job) -> Value {
    let mut doc = job_json_base(job);
    // Added apart: one more key in the literal above would pass json!'s recursion limit.
    let container = &job.spec.container;
    doc["container_mounts"] = json!(container.mounts.iter().map(ToString::to_string).collect::<Vec<_>>());
    doc["container_workdir"] = json!(container.workdir);
    doc["container_env"] = json!(container.env);
    doc
}

fn job_json_base(job: &Job) -> Value {
    let ts = |t: Option<Timestamp>| t.map(format_utc);
    json!({
        "id": job.id,
        "name": job.spec.name,
        "tenant": job.spec.tenant,
        "priority": job.spec.priority_class,
        "state": job.state.as_str(),
        "node": job.allocation.as_ref().map(|a| a.node.clone()),
        "gpus": job.allocation.as_ref().map(|a| a.gpus.clone()).unwrap_or_default(),
        "parts": job.allocation.as_ref().map(|a| {
            a.parts()
                .map(|(node, gpus)| json!({ "node": node, "gpus": gpus, "status": part_status(a, node) }))
                .collect::<Vec<_>>()
        }).unwrap_or_default(),
        "gpus_requested": job.spec.gpus,
        "gpu_slice": job.spec.gpu_slice.as_ref().map(ToString::to_string),
        "cpus": f64::from(job.spec.cpu_millis) / 1000.0,
        "mem_bytes": job.spec.memory_bytes,
        "time_limit_secs": job.spec.time_limit_secs,
        "image": job.spec.image,
        "image_digest": job.spec.image_digest,
        "command": job.spec.command,
        "exit_code": job.exit_code,
        "signal": job.signal,
        "reason": reason(job),
        "cancel_requested": job.cancel_requested,
        "attempts": job.attempts,
        "submitted_at": format_utc(job.submitted_at),
        "admitted_at": ts(job.admitted_at),
        "started_at": ts(job.started_at),
        "finished_at": ts(job.finished_at),
        "submitted_ts": job.submitted_at.0,
        "admitted_ts": job.admitted_at.map(|t| t.0),
        "started_ts": job.started_at.map(|t| t.0),
        "finished_ts": job.finished_at.map(|t| t.0),
        "elapsed_secs": elapsed(job).map(|d| d.as_secs_f64()),
        "worker_run_time_ms": job.worker_run_time_ms,
        "display_id": job.display_id(),
        "array_job_id": job.array_task.map(|t| t.array),
        "array_task_id": job.array_task.map(|t| t.index),
        "array": job.spec.array.as_ref().map(|a| json!({
            "tasks": a.len(),
            "max_running": a.max_running,
            "created": job.array_progress.as_ref().map(|p| p.created),
            "succeeded": job.array_progress.as_ref().map(|p| p.succeeded),
            "unsuccessful": job.array_progress.as_ref().map(|p| p.unsuccessful),
        })),
        "held": job.held,
        "waiting_on": job.waiting_on,
        "dependencies": job.spec.sched.dependencies.iter().map(|d| format!("{}:{}", d.kind.as_str(), d.job_id)).collect::<Vec<_>>(),
        "restarts": job.restarts,
        "steps": steps_json(job),
        "steps_dropped": job.steps.dropped,
    })
}

/// One step of a job as `corral show` and `sacct` list it: `12.batch` (a batch job's script,
/// from the job's own run), then `12.0`, `12.1`, … (its `srun`s, as recorded).
#[derive(Debug, Clone, PartialEq)]
pub struct StepRow {
    pub id: String,
    pub state: String,
    pub exit_code: Option<i32>,
    pub elapsed: Option<Duration>,
    pub tasks: u32,
    /// Its nodes in Slurm's compressed hostlist form.
    pub nodes: String,
    pub command: String,
    pub reason: Option<String>,
}

/// The steps of `job`, the batch step first (batch jobs that were placed).
pub fn step_rows(job: &Job) -> Vec<StepRow> {
    let display = job.display_id();
    let mut rows = Vec::new();
    if let (true, Some(alloc)) = (job.runs_batch_once(), &job.allocation) {
        rows.push(StepRow {
            id: format!("{display}.batch"),
            state: job.state.to_string(),
            exit_code: job.exit_code,
            elapsed: elapsed(job),
            tasks: 1,
            nodes: alloc.node.clone(),
            command: "batch".into(),
            reason: None,
        });
    }
    for step in &job.steps.steps {
        let end = step.ended_at.unwrap_or_else(now_ts);
        rows.push(StepRow {
            id: format!("{display}.{}", step.id),
            state: step.state.to_string(),
            exit_code: step.exit_code,
            elapsed: Some(Duration::from_millis(end.millis_since(step.created_at))),
            tasks: step.ntasks(),
            nodes: corral_types::hostlist::compress(&step.node_names()),
            command: step.spec.command.first().cloned().unwrap_or_default(),
            reason: step.reason.clone(),
        });
    }
    rows
}

/// The steps of `job` as JSON (`corral show`, `corral history`).
pub fn steps_json(job: &Job) -> Vec<Value> {
    step_rows(job)
        .into_iter()
        .map(|r| {
            json!({
                "id": r.id,
                "state": r.state,
                "exit_code": r.exit_code,
                "elapsed_secs": r.elapsed.map(|d| d.as_secs_f64()),
                "tasks": r.tasks,
                "nodes": r.nodes,
                "command": r.command,
                "reason": r.reason,
            })
        })
        .collect()
}

/// The steps of `job` as a table (`sacct`'s columns), or `None` when it has none.
pub fn steps_table(job: &Job) -> Option<String> {
    let rows: Vec<Vec<String>> = step_rows(job)
        .into_iter()
        .map(|r| {
            vec![
                r.id,
                r.state,
                r.exit_code.map_or_else(|| "-".into(), |c| c.to_string()),
                r.elapsed.map_or_else(|| "-".into(), format_duration),
                r.tasks.to_string(),
                r.nodes,
                r.command,
            ]
        })
        .collect();
    (!rows.is_empty()).then(|| table(&["STEP", "STATE", "EXIT", "ELAPSED", "TASKS", "NODES", "COMMAND"], &rows))
}

/// How the part of `alloc` on `node` stands: `running`, or how it ended.
pub fn part_status(alloc: &corral_types::Allocation, node: &str) -> String {
    let Some(end) = alloc.ended.iter().find(|e| e.node == node) else { return "running".into() };
    let Some(r) = &end.report else { return "lost with its node".into() };
    if r.never_started {
        "never started".into()
    } else if r.fenced {
        "stopped: its node lost the coordinators".into()
    } else if let Some(e) = &r.launch_error {
        format!("launch failed: {e}")
    } else if r.oom_killed {
        "oom-killed".into()
    } else if r.timed_out {
        "timed out".into()
    } else if let Some(code) = r.exit_code {
        format!("exited {code}")
    } else if let Some(signal) = r.signal {
        format!("killed by signal {signal}")
    } else {
        "ended".into()
    }
}

/// Renders rows as left-aligned columns.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let widths = column_widths(header, rows);
    let mut out = table_line(header, &widths);
    for row in rows {
        out.push('\n');
        out.push_str(&table_line(row, &widths));
    }
    out
}

/// The width of each column: its widest cell, header included.
fn column_widths(header: &[&str], rows: &[Vec<String>]) -> Vec<usize> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    widths
}

/// One line of a table; a cell wider than its column pushes the rest right.
fn table_line<S: AsRef<str>>(cells: &[S], widths: &[usize]) -> String {
    let mut out = String::new();
    for (i, cell) in cells.iter().enumerate() {
        if i + 1 == cells.len() {
            out.push_str(cell.as_ref());
        } else {
            out.push_str(&format!("{:<w$}  ", cell.as_ref(), w = widths.get(i).copied().unwrap_or(0)));
        }
    }
    out.trim_end().to_string()
}

/// Prints `lines` in one write to stdout (line by line, a page of a thousand jobs was a
/// thousand writes: stdout is line-buffered even into a pipe).
fn print_lines(lines: &[String]) {
    if lines.is_empty() {
        return;
    }
    let mut text = lines.join("\n");
    text.push('\n');
    print!("{text}");
}

/// A table printed as its rows arrive (one listing page at a time): the header and the
/// column widths come from the first rows; later rows keep those widths.
pub struct StreamTable {
    header: &'static [&'static str],
    widths: Option<Vec<usize>>,
}

impl StreamTable {
    pub fn new(header: &'static [&'static str]) -> Self {
        StreamTable { header, widths: None }
    }

    /// Prints `rows` (the header first, the first time there are any).
    pub fn print(&mut self, rows: &[Vec<String>]) {
        print_lines(&self.lines(rows));
    }

    /// Ends the table: a table without rows still prints its header.
    pub fn finish(self) {
        print_lines(&self.finish_lines());
    }

    /// The lines that print `rows`.
    fn lines(&mut self, rows: &[Vec<String>]) -> Vec<String> {
        if rows.is_empty() {
            return Vec::new();
        }
        let mut lines = Vec::new();
        let widths = self.widths.get_or_insert_with(|| {
            let widths = column_widths(self.header, rows);
            lines.push(table_line(self.header, &widths));
            widths
        });
        lines.extend(rows.iter().map(|row| table_line(row, widths)));
        lines
    }

    fn finish_lines(self) -> Vec<String> {
        match self.widths {
            Some(_) => Vec::new(),
            None => vec![table(self.header, &[])],
        }
    }
}

/// Indices as Slurm writes them: `1-3,7,9-12`.
pub fn index_ranges(indices: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < indices.len() {
        let start = indices[i];
        let mut end = start;
        while i + 1 < indices.len() && indices[i + 1] == end + 1 {
            i += 1;
            end = indices[i];
        }
        parts.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    parts.join(",")
}

/// The pending task indices of array `array` (those created and listed in `jobs`, and those not
/// created yet), sorted.
fn pending_indices(array: &Job, jobs: &[Job]) -> Vec<u32> {
    let mut indices: Vec<u32> = jobs
        .iter()
        .filter(|j| j.state == JobState::Pending && j.array_task.is_some_and(|t| t.array == array.id))
        .filter_map(|j| j.array_task.map(|t| t.index))
        .collect();
    if let (Some(spec), Some(progress)) = (&array.spec.array, &array.array_progress) {
        if !array.state.is_terminal() && !array.cancel_requested {
            indices.extend(
                spec.indices_from(u64::from(progress.created)).filter(|i| progress.skipped.binary_search(i).is_err()),
            );
        }
    }
    indices.sort_unstable();
    indices.dedup();
    indices
}

/// Why the row of an unfinished array waits: the array's own reason (held, a dependency);
/// else that of its first created task still pending in `jobs`; and for the tasks not created
/// yet because the array has its window's worth (`%N`) unfinished, that throttle (what Slurm
/// calls JobArrayTaskLimit).
fn array_reason(array: &Job, jobs: &[Job]) -> String {
    if array.state.is_terminal() || array.reason.as_ref().is_some_and(|r| !r.is_empty()) {
        return reason(array);
    }
    let task = jobs
        .iter()
        .find(|j| j.state == JobState::Pending && j.array_task.is_some_and(|t| t.array == array.id))
        .map(reason);
    let throttled = match (&array.spec.array, &array.array_progress) {
        (Some(spec), Some(p)) if !array.cancel_requested => {
            let unfinished = p.created.saturating_sub(p.succeeded.saturating_add(p.unsuccessful));
            let waiting = spec.indices_from(u64::from(p.created)).any(|i| p.skipped.binary_search(&i).is_err());
            (waiting && unfinished >= spec.window()).then(|| {
                let limit = spec.max_running.map_or_else(|| format!("{} at once", spec.window()), |n| format!("%{n}"));
                format!("array task limit ({limit}): {unfinished} unfinished, the next starts when one ends")
            })
        }
        _ => None,
    };
    match (task, throttled) {
        (Some(task), Some(throttled)) => format!("{task}; the rest: {throttled}"),
        (Some(task), None) => task,
        (None, Some(throttled)) => throttled,
        (None, None) => reason(array),
    }
}

const JOBS_HEADER: &[&str] = &["ID", "NAME", "TENANT", "PRIORITY", "STATE", "GPUS", "NODE", "ELAPSED", "REASON"];

/// The job table; the pending tasks of an array collapse into one row (`12_[5-999]`).
pub fn jobs_table(jobs: &[Job]) -> String {
    let arrays: BTreeSet<u64> = jobs.iter().filter(|j| j.is_array()).map(|j| j.id).collect();
    let rows: Vec<Vec<String>> = job_rows(jobs, &arrays).into_iter().map(|(_, row)| row).collect();
    table(JOBS_HEADER, &rows)
}

/// The job table printed page by page. The pending tasks of an array collapse into its row,
/// so the row of an unfinished array waits (and the rows after it) until every unfinished
/// task it counts has arrived, or the listing ends.
#[derive(Default)]
pub struct JobsTableStream {
    table: Option<StreamTable>,
    /// Jobs not printed yet, in listing order.
    held: Vec<Job>,
    /// Every array seen: its pending tasks never get rows of their own.
    arrays: BTreeSet<u64>,
    /// Unfinished arrays -> how many of their unfinished tasks have not arrived yet.
    missing: std::collections::BTreeMap<u64, u64>,
}

impl JobsTableStream {
    /// Takes one page of the listing and prints what can be printed already.
    pub fn push(&mut self, page: Vec<Job>) {
        print_lines(&self.accept(page));
    }

    /// Prints what is held, and the header if nothing was printed.
    pub fn finish(self) {
        print_lines(&self.finish_lines());
    }

    /// Takes one page; returns the lines that can be printed already.
    fn accept(&mut self, page: Vec<Job>) -> Vec<String> {
        for job in page {
            if job.is_array() {
                self.arrays.insert(job.id);
                if let (false, Some(p)) = (job.state.is_terminal(), &job.array_progress) {
                    let unfinished = u64::from(p.created.saturating_sub(p.succeeded).saturating_sub(p.unsuccessful));
                    if unfinished > 0 {
                        self.missing.insert(job.id, unfinished);
                    }
                }
            }
            if let Some(task) = job.array_task.filter(|_| !job.state.is_terminal()) {
                if let Some(left) = self.missing.get_mut(&task.array) {
                    *left -= 1;
                    if *left == 0 {
                        self.missing.remove(&task.array);
                    }
                }
            }
            self.held.push(job);
        }
        let ready = self.held.iter().position(|j| self.missing.contains_key(&j.id)).unwrap_or(self.held.len());
        self.release(ready)
    }

    fn finish_lines(mut self) -> Vec<String> {
        let mut lines = self.release(self.held.len());
        lines.extend(self.table.take().unwrap_or_else(|| StreamTable::new(JOBS_HEADER)).finish_lines());
        lines
    }

    /// The lines of the first `count` held jobs, which are no longer held.
    fn release(&mut self, count: usize) -> Vec<String> {
        if count == 0 {
            return Vec::new();
        }
        // Rows from all that is held: an array's pending tasks held after it still collapse.
        let rows: Vec<Vec<String>> =
            job_rows(&self.held, &self.arrays).into_iter().filter(|(i, _)| *i < count).map(|(_, row)| row).collect();
        self.held.drain(..count);
        self.table.get_or_insert_with(|| StreamTable::new(JOBS_HEADER)).lines(&rows)
    }
}

/// The rows of `jobs` with the index of the job each stands for; pending tasks of the arrays
/// in `arrays` collapse into their array's row.
fn job_rows(jobs: &[Job], arrays: &BTreeSet<u64>) -> Vec<(usize, Vec<String>)> {
    jobs.iter()
        .enumerate()
        .filter_map(|(i, j)| {
            let collapsed = j.state == JobState::Pending && j.array_task.is_some_and(|t| arrays.contains(&t.array));
            if collapsed {
                return None;
            }
            let id = if j.is_array() {
                let pending = pending_indices(j, jobs);
                match (pending.is_empty(), j.state.is_terminal()) {
                    (false, _) => format!("{}_[{}]", j.id, index_ranges(&pending)),
                    // Only running tasks left: they have rows of their own.
                    (true, false) => return None,
                    (true, true) => j.id.to_string(),
                }
            } else {
                j.display_id()
            };
            let state = if j.is_array() && !j.state.is_terminal() { JobState::Pending } else { j.state };
            let row = vec![
                id,
                j.spec.name.clone(),
                j.spec.tenant.clone(),
                j.spec.priority_class.clone(),
                state.to_string(),
                resources(j),
                j.allocation.as_ref().map(|a| a.node.clone()).unwrap_or_else(|| "-".into()),
                // An array's own row stands for its waiting tasks: no run time of its own.
                if j.is_array() { "-".into() } else { elapsed(j).map(format_duration).unwrap_or_else(|| "-".into()) },
                if j.is_array() { array_reason(j, jobs) } else { reason(j) },
            ];
            Some((i, row))
        })
        .collect()
}

pub fn job_details(job: &Job) -> String {
    let mut lines = vec![
        ("id", job.id.to_string()),
        ("name", job.spec.name.clone()),
        ("state", job.state.to_string()),
        ("reason", reason(job)),
        ("tenant", job.spec.tenant.clone()),
        ("priority", job.spec.priority_class.clone()),
        ("gpus", resources(job)),
        ("command", job.spec.command.join(" ")),
    ];
    if let Some(image) = &job.spec.image {
        lines.push(("image", image.clone()));
    }
    if let Some(digest) = &job.spec.image_digest {
        lines.push(("digest", digest.clone()));
    }
    let container = &job.spec.container;
    if !container.mounts.is_empty() {
        lines.push(("mounts", container.mounts.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")));
    }
    if let Some(dir) = &container.workdir {
        lines.push(("workdir", dir.clone()));
    }
    if !container.env.is_empty() {
        lines.push(("host env", container.env.join(",")));
    }
    if let Some(a) = &job.allocation {
        for (node, gpus) in a.parts() {
            let gpus: Vec<String> = gpus.iter().map(u32::to_string).collect();
            let gpus = if gpus.is_empty() { "none".into() } else { gpus.join(",") };
            // A gang's parts end apart: say how each one stands.
            let status = if a.is_gang() { format!(", {}", part_status(a, node)) } else { String::new() };
            lines.push(("node", format!("{node} (gpus {gpus}{status})")));
        }
    }
    if job.spec.cpu_millis > 0 {
        lines.push(("cpus", format!("{}", f64::from(job.spec.cpu_millis) / 1000.0)));
    }
    if job.spec.memory_bytes > 0 {
        lines.push(("memory", format_size(job.spec.memory_bytes)));
    }
    if let Some(t) = job.spec.time_limit_secs {
        lines.push(("time limit", format_duration(Duration::from_secs(t))));
    }
    lines.push(("submitted", format_utc(job.submitted_at)));
    if let Some(t) = job.started_at {
        lines.push(("started", format_utc(t)));
    }
    if let Some(t) = job.finished_at {
        lines.push(("finished", format_utc(t)));
    }
    if let Some(d) = elapsed(job) {
        lines.push(("elapsed", format_duration(d)));
    }
    if let Some(code) = job.exit_code {
        lines.push(("exit code", code.to_string()));
    }
    if let Some(sig) = job.signal {
        lines.push(("signal", sig.to_string()));
    }
    lines.push(("attempts", job.attempts.to_string()));
    let mut out = lines.iter().map(|(k, v)| format!("{:<11} {v}", format!("{k}:"))).collect::<Vec<_>>().join("\n");
    if let Some(steps) = steps_table(job) {
        out.push_str("\n\n");
        out.push_str(&steps);
        if job.steps.dropped > 0 {
            out.push_str(&format!("\n({} older steps not kept)", job.steps.dropped));
        }
    }
    out
}

/// A node's labels, sorted by key, the key `partition` once with every partition (comma
/// separated, as Slurm writes a node's partitions).
fn node_labels(n: &pb::NodeView) -> Vec<(String, String)> {
    let mut labels: std::collections::BTreeMap<String, String> =
        n.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    if !n.partitions.is_empty() {
        labels.insert("partition".into(), n.partitions.join(","));
    }
    labels.into_iter().collect()
}

pub fn node_json(n: &pb::NodeView) -> Value {
    json!({
        "name": n.name,
        "address": n.address,
        "state": n.state,
        "epoch": n.epoch,
        "cpus": n.cpu_millis as f64 / 1000.0,
        "memory_bytes": n.memory_bytes,
        "heartbeat_age_ms": n.heartbeat_age_ms,
        "reason": (!n.reason.is_empty()).then(|| n.reason.clone()),
        "labels": node_labels(n).into_iter().collect::<std::collections::BTreeMap<_, _>>(),
        "partitions": n.partitions,
        "drain_deadline": n.drain_deadline.map(|t| format_utc(Timestamp(t))),
        "lease_end": n.lease_end.map(|t| format_utc(Timestamp(t))),
        "running_jobs": n.running_jobs,
        "gpus": n.gpus.iter().map(|g| json!({
            "index": g.index,
            "uuid": g.uuid,
            "model": g.model,
            "memory_mib": g.memory_mib,
            "state": g.state,
            "temperature_c": g.temperature_c,
            "utilization_percent": g.utilization_percent,
            "memory_used_mib": g.memory_used_mib,
            "power_w": g.power_mw as f64 / 1000.0,
            "xid_errors": g.xid_errors,
            "jobs": g.job_ids,
            "problems": g.problems,
            "dirty_reason": (!g.dirty_reason.is_empty()).then(|| g.dirty_reason.clone()),
            "dirty_job_id": g.dirty_job_id,
            "out_reason": gpu_out_reason(g),
            "mig_capable": g.mig_capable,
            "slices": g.slices.iter().map(|s| json!({"job_id": s.job_id, "slice": s.slice})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Why a GPU is out of placement (`dirty: ...`, `unhealthy: ...`); `None` when it is not.
pub fn gpu_out_reason(g: &pb::GpuView) -> Option<String> {
    match g.state.as_str() {
        "dirty" if g.dirty_reason.is_empty() => Some("dirty".into()),
        "dirty" => Some(format!("dirty: {}", g.dirty_reason)),
        "unhealthy" => Some(format!("unhealthy: {}", g.problems.join("; "))),
        _ => None,
    }
}

pub fn nodes_table(nodes: &[pb::NodeView]) -> String {
    let mut rows = Vec::new();
    for n in nodes {
        let free = n.gpus.iter().filter(|g| g.state == "idle").count();
        let dirty = n.gpus.iter().filter(|g| g.state == "dirty").count();
        let unhealthy = n.gpus.iter().filter(|g| g.state == "unhealthy").count();
        let models: std::collections::BTreeSet<&str> = n.gpus.iter().map(|g| g.model.as_str()).collect();
        let temps = n.gpus.iter().map(|g| g.temperature_c.to_string()).collect::<Vec<_>>().join(",");
        rows.push(vec![
            n.name.clone(),
            n.state.clone(),
            format!("{free}/{}", n.gpus.len()),
            models.into_iter().collect::<Vec<_>>().join(","),
            match (dirty, unhealthy) {
                (0, 0) => "ok".to_string(),
                _ => n
                    .gpus
                    .iter()
                    .filter_map(|g| Some(format!("gpu{} {}", g.index, gpu_out_reason(g)?)))
                    .collect::<Vec<_>>()
                    .join("; "),
            },
            temps,
            n.heartbeat_age_ms.map(|ms| format!("{:.1}s", ms as f64 / 1000.0)).unwrap_or_else(|| "-".into()),
            {
                let text = node_labels(n).iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
                if text.is_empty() {
                    "-".to_string()
                } else {
                    text
                }
            },
            n.lease_end.map(|t| lease_text(Timestamp(t))).unwrap_or_else(|| "-".into()),
            if n.reason.is_empty() { "-".to_string() } else { n.reason.clone() },
        ]);
    }
    let header =
        ["NODE", "STATE", "FREE/GPUS", "MODEL", "HEALTH", "TEMPS(C)", "HEARTBEAT", "LABELS", "LEASE-END", "REASON"];
    table(&header, &rows)
}

/// A lease end to the second (`2026-12-31T18:00:00Z`).
fn lease_text(t: Timestamp) -> String {
    let full = format_utc(t);
    match full.split_once('.') {
        Some((seconds, _)) => format!("{seconds}Z"),
        None => full,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_print_as_slurm_ranges() {
        assert_eq!(index_ranges(&[1, 2, 3, 7, 9, 10, 11, 12]), "1-3,7,9-12");
        assert_eq!(index_ranges(&[5]), "5");
        assert_eq!(index_ranges(&[]), "");
    }

    fn pending(id: u64, name: &str) -> Job {
        let spec = corral_types::JobSpec { name: name.into(), tenant: "t".into(), ..Default::default() };
        Job::pending(id, spec, format!("r{id}"), Timestamp(id))
    }

    fn task(id: u64, array: u64, index: u32) -> Job {
        let mut job = pending(id, "arr");
        job.spec.array = Some(corral_types::ArraySpec {
            ranges: vec![corral_types::ArrayRange { first: 0, last: 3, step: 1 }],
            max_running: None,
        });
        job.array_task = Some(corral_types::ArrayTask { array, index });
        job
    }

    /// `corral show` lists a batch job's steps as `sacct` does: `12.batch`, then its `srun`s.
    #[test]
    fn steps_are_listed_batch_first_like_sacct() {
        let mut job = pending(12, "train");
        assert_eq!(steps_table(&job), None, "a job without steps shows no table");
        job.spec.script = Some("#!/bin/sh\nsrun python train.py\n".into());
        job.state = JobState::Failed;
        job.exit_code = Some(3);
        job.started_at = Some(Timestamp::compose(1_000, 0));
        job.finished_at = Some(Timestamp::compose(61_000, 0));
        job.allocation = Some(corral_types::Allocation { node: "gpu-01".into(), ..Default::default() });
        let node =
            |n: &str, first_task, tasks| corral_types::StepNode { node: n.into(), first_task, tasks, gpus: vec![] };
        job.steps = corral_types::JobSteps {
            next_id: 2,
            dropped: 0,
            steps: vec![corral_types::JobStep {
                id: 1,
                nodes: vec![node("gpu-01", 0, 2), node("gpu-02", 2, 2)],
                spec: corral_types::StepSpec { command: vec!["python".into()], ..Default::default() },
                state: corral_types::StepState::Failed,
                created_at: Timestamp::compose(2_000, 0),
                ended_at: Some(Timestamp::compose(32_000, 0)),
                exit_code: Some(137),
                reason: Some("exit code 137".into()),
                ..Default::default()
            }],
        };
        let rows = step_rows(&job);
        assert_eq!(rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["12.batch", "12.1"]);
        assert_eq!((rows[0].state.as_str(), rows[0].exit_code, rows[0].nodes.as_str()), ("failed", Some(3), "gpu-01"));
        assert_eq!((rows[1].tasks, rows[1].nodes.as_str(), rows[1].exit_code), (4, "gpu-[01-02]", Some(137)));
        assert_eq!(rows[1].elapsed, Some(Duration::from_secs(30)));
        let table = steps_table(&job).expect("a table");
        assert!(table.starts_with("STEP"), "{table}");
        assert!(table.lines().nth(2).is_some_and(|l| l.starts_with("12.1") && l.contains("137")), "{table}");
        let json = job_json(&job);
        assert_eq!(json["steps"][1]["id"], "12.1");
        assert_eq!(json["steps"][1]["nodes"], "gpu-[01-02]");
        assert!(job_details(&job).contains("\n\nSTEP"), "{}", job_details(&job));
    }

    #[test]
    fn streamed_pages_print_as_they_come_under_one_header() {
        let mut stream = JobsTableStream::default();
        let first = stream.accept(vec![pending(1, "a"), pending(2, "b")]);
        assert_eq!(first.len(), 3, "header and two rows at once: {first:?}");
        assert!(first[0].starts_with("ID"));
        let second = stream.accept(vec![pending(3, "a-much-longer-name")]);
        assert_eq!(second.len(), 1, "no second header: {second:?}");
        // The first page's column widths hold: the long name starts under NAME.
        assert_eq!(second[0].find("a-much-longer-name"), first[0].find("NAME"), "{first:?} {second:?}");
        assert!(stream.finish_lines().is_empty());
        assert_eq!(JobsTableStream::default().finish_lines().len(), 1, "an empty listing prints its header");
    }

    #[test]
    fn an_array_row_waits_for_its_pending_tasks_from_later_pages() {
        let mut array = task(1, 0, 0);
        array.array_task = None;
        array.array_progress = Some(corral_types::ArrayProgress { created: 2, ..Default::default() });
        let mut stream = JobsTableStream::default();
        // The array's first task comes with it, the second one a page later.
        assert!(stream.accept(vec![array, pending(2, "plain"), task(3, 1, 0)]).is_empty());
        let lines = stream.accept(vec![task(4, 1, 1), pending(5, "after")]);
        let ids: Vec<&str> = lines.iter().skip(1).map(|l| l.split_whitespace().next().unwrap_or_default()).collect();
        assert_eq!(ids, vec!["1_[0-3]", "2", "5"], "{lines:?}");
        // Without its tasks ever arriving (a filter left them out), the end of the listing prints it.
        let mut array = task(1, 0, 0);
        array.array_task = None;
        array.array_progress = Some(corral_types::ArrayProgress { created: 2, ..Default::default() });
        let mut stream = JobsTableStream::default();
        assert!(stream.accept(vec![array]).is_empty());
        assert_eq!(stream.finish_lines().len(), 2);
    }

    /// An array of 10 tasks with `%2`, two of them running: its row says the rest wait for the
    /// throttle; with a created task pending too, that task's reason comes first.
    #[test]
    fn an_array_row_held_back_by_its_throttle_says_so() {
        let mut array = task(1, 0, 0);
        array.array_task = None;
        array.state = JobState::Running;
        array.spec.array = Some(corral_types::ArraySpec {
            ranges: vec![corral_types::ArrayRange { first: 0, last: 9, step: 1 }],
            max_running: Some(2),
        });
        array.array_progress = Some(corral_types::ArrayProgress { created: 2, ..Default::default() });
        let running = |id, index| {
            let mut t = task(id, 1, index);
            t.state = JobState::Running;
            t
        };
        let table = jobs_table(&[array.clone(), running(2, 0), running(3, 1)]);
        let row = table.lines().find(|l| l.starts_with("1_[2-9]")).expect("the array's row");
        assert!(row.ends_with("array task limit (%2): 2 unfinished, the next starts when one ends"), "{table}");

        let mut waiting = task(3, 1, 1);
        waiting.reason = Some("resources: needs 1 gpu".into());
        let table = jobs_table(&[array.clone(), running(2, 0), waiting]);
        let row = table.lines().find(|l| l.starts_with("1_[1-9]")).expect("the array's row");
        assert!(
            row.ends_with(
                "resources: needs 1 gpu; the rest: array task limit (%2): 2 unfinished, the next starts when one ends"
            ),
            "{table}"
        );

        // Below its window the array creates tasks at once: no throttle to speak of.
        array.array_progress = Some(corral_types::ArrayProgress { created: 2, succeeded: 1, ..Default::default() });
        let table = jobs_table(&[array, running(3, 1)]);
        assert!(!table.contains("task limit"), "{table}");
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(&["A", "LONGER"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    LONGER\nxyz  1");
    }
}
