//! `sacct` in Slurm's own output: a job's row and its steps' (`12.batch`, `12.0`...), in the
//! columns `--format` names (default `JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode`),
//! padded and cut with `+` as sacct does, or `|`-separated with `-p`/`-P`, with `-n` and `-X`.
//! Scripts end with `sacct -j $SLURM_JOB_ID --format=JobID,JobName,Elapsed,MaxRSS` to log what
//! ran, or read `sacct -j ID -n -X -o State`. Pure: the caller fetches the job.

use crate::scontrol_job::{millis_since_epoch, slurm_duration, slurm_state, slurm_time, tres_mem, RunTimes, Shape};
use corral_types::{hostlist, Job, JobState, StepState};
use std::time::SystemTime;

/// sacct's default columns.
pub const DEFAULT_FIELDS: &str = "JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode";

/// How the rows are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Layout {
    /// `-n`: no header lines.
    pub noheader: bool,
    /// `-p` (`Some(true)`: every field ends with `|`) or `-P` (`Some(false)`: `|` between
    /// fields); `None`: padded columns.
    pub parsable: Option<bool>,
    /// `-X`: the job's row only, no steps.
    pub allocations: bool,
}

/// Fields corral fills (lower case) with their default width; those sacct has that corral
/// does not measure print empty, as sacct prints them for a job it has no samples of.
const FIELDS: &[(&str, usize)] = &[
    ("jobid", 12),
    ("jobidraw", 12),
    ("jobname", 10),
    ("partition", 10),
    ("account", 10),
    ("alloccpus", 10),
    ("ncpus", 10),
    ("state", 10),
    ("exitcode", 8),
    ("elapsed", 10),
    ("elapsedraw", 10),
    ("start", 19),
    ("end", 19),
    ("submit", 19),
    ("nodelist", 15),
    ("nnodes", 8),
    ("allocnodes", 10),
    ("ntasks", 8),
    ("timelimit", 10),
    ("user", 9),
    ("workdir", 20),
    ("reqmem", 10),
    ("alloctres", 10),
    ("cputime", 10),
    ("cputimeraw", 10),
    ("maxrss", 10),
    ("maxvmsize", 10),
    ("averss", 10),
    ("avevmsize", 10),
    ("avecpu", 10),
    ("totalcpu", 10),
    ("maxdiskread", 12),
    ("maxdiskwrite", 12),
    ("consumedenergy", 14),
];

/// A requested column: its field, header as written, width, and whether it is left-justified.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Column {
    field: &'static str,
    header: String,
    width: usize,
    left: bool,
}

/// Parses `--format` (`JobID,JobName%30,Elapsed`).
fn columns(format: &str) -> Result<Vec<Column>, String> {
    let mut out = Vec::new();
    for item in format.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        let (name, width) = match item.split_once('%') {
            Some((name, width)) => {
                let w = width.trim_start_matches('-');
                let w: usize = w.parse().map_err(|_| format!("'{item}': the width after '%' is a number"))?;
                (name, Some((w.min(1024), width.starts_with('-'))))
            }
            None => (item, None),
        };
        let lower = name.to_ascii_lowercase();
        let Some((field, default)) = FIELDS.iter().find(|(f, _)| *f == lower) else {
            return Err(format!(
                "field '{name}' is not served here: the fields are {}",
                FIELDS.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(",")
            ));
        };
        let (width, minus) = width.unwrap_or((*default, false));
        // sacct left-justifies the job id and right-justifies the rest.
        let left = (*field == "jobid" || *field == "jobidraw") != minus;
        out.push(Column { field, header: name.to_string(), width, left });
    }
    if out.is_empty() {
        return Err("no field given".into());
    }
    Ok(out)
}

/// Checks a `--format` before anything is fetched.
pub fn check_format(format: &str) -> Result<(), String> {
    columns(format).map(|_| ())
}

/// One row: the job, its batch step or one of its steps.
struct Row<'a> {
    job: &'a Job,
    id: String,
    name: String,
    partition: String,
    state: String,
    exit: String,
    started: Option<u64>,
    ended: Option<u64>,
    used_ms: u64,
    nodes: Vec<&'a str>,
    tasks: Option<u32>,
    cpus: u32,
}

fn rows<'a>(job: &'a Job, now: SystemTime, allocations: bool) -> Vec<Row<'a>> {
    let spec = &job.spec;
    let Shape { nodes, node_count, cpus_per_node } = Shape::of(job);
    let times = RunTimes::of(job, now);
    let ended = job.finished_at.map(|t| t.physical_ms());
    let exit = format!("{}:{}", job.exit_code.unwrap_or(0), job.signal.unwrap_or(0));
    let mut out = vec![Row {
        job,
        id: job.display_id(),
        name: spec.name.clone(),
        partition: spec.slurm.partition.clone().unwrap_or_default(),
        state: slurm_state(job).into(),
        exit: exit.clone(),
        started: times.started,
        ended,
        used_ms: times.used_ms,
        nodes: nodes.clone(),
        tasks: None,
        cpus: cpus_per_node * node_count,
    }];
    if allocations || job.state == JobState::Pending {
        return out;
    }
    if job.runs_batch_once() {
        out.push(Row {
            job,
            id: format!("{}.batch", job.display_id()),
            name: "batch".into(),
            partition: String::new(),
            state: slurm_state(job).into(),
            exit,
            started: times.started,
            ended,
            used_ms: times.used_ms,
            nodes: nodes.first().copied().into_iter().collect(),
            tasks: Some(1),
            cpus: cpus_per_node,
        });
    }
    // A step still running runs until the job's end, or until now.
    let until = ended.unwrap_or_else(|| millis_since_epoch(now));
    for step in &job.steps.steps {
        let created = step.created_at.physical_ms();
        let end = step.ended_at.map(|t| t.physical_ms());
        let state = match step.state {
            StepState::Running => "RUNNING",
            StepState::Completed => "COMPLETED",
            StepState::Failed => "FAILED",
            StepState::Cancelled => "CANCELLED",
        };
        let program = step.spec.command.first().map(|p| p.rsplit('/').next().unwrap_or(p).to_string());
        out.push(Row {
            job,
            id: format!("{}.{}", job.display_id(), step.id),
            name: program.unwrap_or_default(),
            partition: String::new(),
            state: state.into(),
            exit: format!("{}:0", step.exit_code.unwrap_or(0)),
            started: Some(created),
            ended: end,
            used_ms: end.unwrap_or(until).saturating_sub(created),
            nodes: step.node_names(),
            tasks: Some(step.ntasks()),
            cpus: step.ntasks() * step.spec.cpus_per_task.unwrap_or(1).max(1),
        });
    }
    out
}

fn value(row: &Row<'_>, field: &str) -> String {
    let spec = &row.job.spec;
    let names = &spec.slurm;
    let at = |ms: Option<u64>| ms.map_or_else(|| "Unknown".to_string(), slurm_time);
    match field {
        "jobid" | "jobidraw" => row.id.clone(),
        "jobname" => row.name.clone(),
        "partition" => row.partition.clone(),
        "account" => names.account.clone().unwrap_or_else(|| spec.tenant.clone()),
        "alloccpus" | "ncpus" => row.cpus.to_string(),
        "state" => row.state.clone(),
        "exitcode" => row.exit.clone(),
        "elapsed" => slurm_duration(row.used_ms / 1000),
        "elapsedraw" => (row.used_ms / 1000).to_string(),
        "start" => at(row.started),
        "end" => at(row.ended),
        "submit" => slurm_time(row.job.submitted_at.physical_ms()),
        "nodelist" if row.nodes.is_empty() => "None assigned".into(),
        "nodelist" => hostlist::compress(&row.nodes),
        "nnodes" | "allocnodes" => row.nodes.len().max(1).to_string(),
        "ntasks" => row.tasks.map(|t| t.to_string()).unwrap_or_default(),
        "timelimit" if row.tasks.is_some() => String::new(),
        "timelimit" => spec.time_limit_secs.map_or_else(|| "UNLIMITED".into(), slurm_duration),
        "user" if row.tasks.is_some() => String::new(),
        "user" => names.user.clone().unwrap_or_else(|| spec.tenant.clone()),
        "workdir" => names.submit_dir.clone().or_else(|| spec.workdir.clone()).unwrap_or_default(),
        "reqmem" if spec.memory_bytes == 0 => "0".into(),
        "reqmem" => tres_mem(spec.memory_bytes),
        "alloctres" => {
            let mut tres = format!("cpu={}", row.cpus);
            if spec.memory_bytes > 0 {
                tres.push_str(&format!(",mem={}", tres_mem(spec.memory_bytes)));
            }
            tres.push_str(&format!(",node={}", row.nodes.len().max(1)));
            if spec.gpus > 0 && spec.gpu_slice.is_none() && row.tasks.is_none() {
                tres.push_str(&format!(",gres/gpu={}", spec.gpus));
            }
            tres
        }
        "cputime" => slurm_duration(row.used_ms / 1000 * u64::from(row.cpus)),
        "cputimeraw" => (row.used_ms / 1000 * u64::from(row.cpus)).to_string(),
        _ => String::new(),
    }
}

/// The lines sacct prints for `jobs` in the columns of `format`.
pub fn render(jobs: &[Job], format: &str, layout: Layout, now: SystemTime) -> Result<String, String> {
    let columns = columns(format)?;
    let rows: Vec<Row<'_>> = jobs.iter().flat_map(|job| rows(job, now, layout.allocations)).collect();
    let mut out = String::new();
    let mut line = |cells: Vec<String>| {
        match layout.parsable {
            Some(trailing) => {
                out.push_str(&cells.join("|"));
                if trailing {
                    out.push('|');
                }
            }
            None => {
                for (cell, column) in cells.iter().zip(&columns) {
                    let w = column.width;
                    // Cut to the width, its last character a `+`, as sacct marks a cut value.
                    let cell = if cell.chars().count() > w {
                        format!("{}+", cell.chars().take(w.saturating_sub(1)).collect::<String>())
                    } else {
                        cell.clone()
                    };
                    if column.left {
                        out.push_str(&format!("{cell:<w$} "));
                    } else {
                        out.push_str(&format!("{cell:>w$} "));
                    }
                }
            }
        }
        out.push('\n');
    };
    if !layout.noheader {
        line(columns.iter().map(|c| c.header.clone()).collect());
        if layout.parsable.is_none() {
            line(columns.iter().map(|c| "-".repeat(c.width)).collect());
        }
    }
    for row in &rows {
        line(columns.iter().map(|c| value(row, c.field)).collect());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{Allocation, JobSpec, JobStep, SlurmNames, StepNode, Timestamp};
    use std::time::{Duration, UNIX_EPOCH};

    fn finished_job() -> Job {
        let spec = JobSpec {
            name: "interactive-session".into(),
            tenant: "team-a".into(),
            cpu_millis: 2000,
            script: Some("#!/bin/sh\nsrun hostname\n".into()),
            slurm: SlurmNames { account: Some("proj_x".into()), partition: Some("gpu".into()), ..Default::default() },
            ..Default::default()
        };
        let mut job = Job::pending(4012, spec, String::new(), Timestamp::compose(1_000_000, 0));
        job.state = JobState::Succeeded;
        job.attempts = 1;
        job.exit_code = Some(0);
        job.started_at = Some(Timestamp::compose(1_000_000, 0));
        job.finished_at = Some(Timestamp::compose(1_065_000, 0));
        job.allocation = Some(Allocation { node: "gpu-01".into(), gpus: vec![], ..Default::default() });
        job.steps.steps.push(JobStep {
            id: 0,
            epoch: 1,
            spec: corral_types::StepSpec { command: vec!["/usr/bin/hostname".into()], ..Default::default() },
            nodes: vec![StepNode { node: "gpu-01".into(), tasks: 2, ..Default::default() }],
            state: StepState::Completed,
            created_at: Timestamp::compose(1_001_000, 0),
            ended_at: Some(Timestamp::compose(1_003_000, 0)),
            exit_code: Some(0),
            ..Default::default()
        });
        job
    }

    #[test]
    fn the_default_columns_read_as_saccts() {
        let now = UNIX_EPOCH + Duration::from_secs(2000);
        let text = render(&[finished_job()], DEFAULT_FIELDS, Layout::default(), now).unwrap();
        assert_eq!(
            text,
            "JobID           JobName  Partition    Account  AllocCPUS      State ExitCode \n\
             ------------ ---------- ---------- ---------- ---------- ---------- -------- \n\
             4012         interacti+        gpu     proj_x          2  COMPLETED      0:0 \n\
             4012.batch        batch                proj_x          2  COMPLETED      0:0 \n\
             4012.0         hostname                proj_x          2  COMPLETED      0:0 \n"
        );
    }

    #[test]
    fn formats_parsable_output_and_allocations_only() {
        let now = UNIX_EPOCH + Duration::from_secs(2000);
        let job = finished_job();
        let parsable = Layout { noheader: true, parsable: Some(false), allocations: false };
        assert_eq!(
            render(std::slice::from_ref(&job), "JobID,Elapsed,NTasks,MaxRSS", parsable, now).unwrap(),
            "4012|00:01:05||\n4012.batch|00:01:05|1|\n4012.0|00:00:02|2|\n"
        );
        let one = Layout { noheader: true, parsable: Some(true), allocations: true };
        assert_eq!(
            render(std::slice::from_ref(&job), "state", one, now).unwrap(),
            "COMPLETED|\n",
            "sacct -j ID -n -X -p -o State"
        );
        let wide = render(&[job], "JobName%25", Layout { noheader: true, ..Layout::default() }, now).unwrap();
        assert_eq!(wide.lines().next(), Some("      interactive-session "));
        assert!(check_format("JobID,Bogus").unwrap_err().contains("field 'Bogus' is not served here"));
        assert!(check_format("JobName%x").is_err());
    }
}
