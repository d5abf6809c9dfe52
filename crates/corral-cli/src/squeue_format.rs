//! `squeue` in Slurm's own output: its default columns, `-o/--format` (`%.18i %.8j %L`...),
//! `-O/--Format` (`JobID,TimeLeft:10`) and `-h`, so that scripts that read it inside a job
//! (`squeue -h -j $SLURM_JOB_ID -o %L` for the time left, `squeue -u $USER -h -t PD | wc -l`)
//! get what Slurm prints. Pure: the caller fetches the jobs.

use crate::scontrol_job::{slurm_reason, slurm_state, slurm_time, tres_mem, RunTimes, Shape};
use corral_types::{hostlist, Job, JobState};
use std::time::SystemTime;

/// squeue's default columns.
pub const DEFAULT_FORMAT: &str = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R";

/// One piece of a format: text as it is, or a field with its width (`right`: `%.N`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Field { letter: char, width: Option<usize>, right: bool },
}

/// The letters corral fills, with their headers; `-O` names map to them.
const FIELDS: &[(char, &str, &str)] = &[
    ('i', "JOBID", "jobid"),
    ('A', "JOBID", "jobarrayid"),
    ('F', "ARRAY_JOB_ID", "arrayjobid"),
    ('K', "ARRAY_TASK_ID", "arraytaskid"),
    ('j', "NAME", "name"),
    ('u', "USER", "username"),
    ('t', "ST", "statecompact"),
    ('T', "STATE", "state"),
    ('M', "TIME", "timeused"),
    ('L', "TIME_LEFT", "timeleft"),
    ('l', "TIME_LIMIT", "timelimit"),
    ('D', "NODES", "numnodes"),
    ('C', "CPUS", "numcpus"),
    ('c', "MIN_CPUS", "mincpus"),
    ('m', "MIN_MEMORY", "minmemory"),
    ('R', "NODELIST(REASON)", "reasonlist"),
    ('N', "NODELIST", "nodelist"),
    ('P', "PARTITION", "partition"),
    ('a', "ACCOUNT", "account"),
    ('q', "QOS", "qos"),
    ('b', "TRES_PER_NODE", "tres-per-node"),
    ('r', "REASON", "reason"),
    ('S', "START_TIME", "starttime"),
    ('e', "END_TIME", "endtime"),
    ('V', "SUBMIT_TIME", "submittime"),
    ('Z', "WORK_DIR", "workdir"),
    ('o', "COMMAND", "command"),
    ('p', "PRIORITY", "priority"),
    ('Q', "PRIORITY", "prioritylong"),
    ('y', "NICE", "nice"),
];

/// Parses an `-o` format: `%[.][WIDTH]LETTER` fields among text; `%%` is a `%`.
fn parse_format(format: &str) -> Result<Vec<Piece>, String> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            text.push(c);
            continue;
        }
        if chars.peek() == Some(&'%') {
            chars.next();
            text.push('%');
            continue;
        }
        let right = chars.next_if_eq(&'.').is_some();
        let mut digits = String::new();
        while let Some(d) = chars.next_if(char::is_ascii_digit) {
            digits.push(d);
        }
        let letter = chars.next().ok_or("a format ends with '%'")?;
        if !FIELDS.iter().any(|(l, _, _)| *l == letter) {
            return Err(format!(
                "'%{letter}' is not served here: the fields are {}",
                FIELDS.iter().map(|(l, _, _)| format!("%{l}")).collect::<Vec<_>>().join(" ")
            ));
        }
        if !text.is_empty() {
            pieces.push(Piece::Text(std::mem::take(&mut text)));
        }
        let width = digits.parse::<usize>().ok().map(|w| w.min(1024));
        pieces.push(Piece::Field { letter, width, right });
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

/// An `-O` list (`JobID,Name:30,TimeLeft:.10`) as an `-o` format: each field 20 wide unless
/// it says, left-justified unless its width starts with `.`.
pub fn format_of_fields(fields: &str) -> Result<String, String> {
    let mut out = String::new();
    for item in fields.split(',').filter(|f| !f.is_empty()) {
        let (name, width) = item.split_once(':').unwrap_or((item, "20"));
        let lower = name.trim().to_ascii_lowercase();
        let (letter, _, _) = FIELDS.iter().find(|(_, _, n)| *n == lower).ok_or_else(|| {
            format!(
                "field '{name}' is not served here: the fields are {}",
                FIELDS.iter().map(|(_, _, n)| *n).collect::<Vec<_>>().join(",")
            )
        })?;
        let (right, digits) = match width.strip_prefix('.') {
            Some(rest) => (".", rest),
            None => ("", width),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("'{item}': the width after ':' is a number"));
        }
        out.push_str(&format!("%{right}{digits}{letter}"));
    }
    if out.is_empty() {
        return Err("no field given".into());
    }
    Ok(out)
}

/// Checks a format before anything is fetched.
pub fn check_format(format: &str) -> Result<(), String> {
    Squeue::new(format).map(|_| ())
}

/// A parsed format, which prints squeue's header and rows.
pub struct Squeue {
    pieces: Vec<Piece>,
}

impl Squeue {
    pub fn new(format: &str) -> Result<Squeue, String> {
        Ok(Squeue { pieces: parse_format(format)? })
    }

    /// One line, each field's value from `value`.
    fn line(&self, out: &mut String, value: &dyn Fn(char) -> String) {
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Field { letter, width, right } => {
                    let v = value(*letter);
                    match width {
                        Some(w) => {
                            let v: String = v.chars().take(*w).collect();
                            if *right {
                                out.push_str(&format!("{v:>w$}"));
                            } else {
                                out.push_str(&format!("{v:<w$}"));
                            }
                        }
                        None => out.push_str(&v),
                    }
                }
            }
        }
        out.push('\n');
    }

    /// The header line.
    pub fn header(&self) -> String {
        let mut out = String::new();
        self.line(&mut out, &|letter| {
            FIELDS.iter().find(|(l, _, _)| *l == letter).map(|(_, h, _)| h.to_string()).unwrap_or_default()
        });
        out
    }

    /// The lines of `jobs`, their times up to `now`.
    pub fn rows(&self, jobs: &[Job], now: SystemTime) -> String {
        let mut out = String::new();
        for job in jobs {
            let (shape, times) = (Shape::of(job), RunTimes::of(job, now));
            self.line(&mut out, &|letter| field(job, &shape, &times, letter));
        }
        out
    }
}

/// The lines squeue prints for `jobs` in `format` (a header first unless `noheader`).
#[cfg(test)]
fn render(jobs: &[Job], format: &str, noheader: bool, now: SystemTime) -> Result<String, String> {
    let squeue = Squeue::new(format)?;
    let header = if noheader { String::new() } else { squeue.header() };
    Ok(header + &squeue.rows(jobs, now))
}

/// squeue's compact state.
fn compact_state(job: &Job) -> &'static str {
    match slurm_state(job) {
        "PENDING" => "PD",
        "RUNNING" => "R",
        "COMPLETED" => "CD",
        "TIMEOUT" => "TO",
        "OUT_OF_MEMORY" => "OOM",
        "NODE_FAIL" => "NF",
        "CANCELLED" => "CA",
        "PREEMPTED" => "PR",
        _ => "F",
    }
}

/// A duration as squeue writes times: `M:SS`, `H:MM:SS`, `D-HH:MM:SS`.
fn squeue_duration(secs: u64) -> String {
    let (days, hours, minutes, seconds) = (secs / 86_400, secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    match (days, hours) {
        (0, 0) => format!("{minutes}:{seconds:02}"),
        (0, h) => format!("{h}:{minutes:02}:{seconds:02}"),
        (d, h) => format!("{d}-{h:02}:{minutes:02}:{seconds:02}"),
    }
}

/// Field `letter` of `job`, whose shape and times are worked out once for all its fields.
fn field(job: &Job, shape: &Shape<'_>, times: &RunTimes, letter: char) -> String {
    let spec = &job.spec;
    let names = &spec.slurm;
    let Shape { nodes, node_count, cpus_per_node } = shape;
    let (node_count, cpus_per_node) = (*node_count, *cpus_per_node);
    let RunTimes { started, end, used_ms } = *times;
    let used_secs = used_ms / 1000;
    let null = |v: &Option<String>| v.clone().unwrap_or_else(|| "(null)".into());
    match letter {
        'i' => job.display_id(),
        'A' => job.id.to_string(),
        'F' => job.array_task.map_or(job.id, |t| t.array).to_string(),
        'K' => job.array_task.map_or_else(|| "N/A".into(), |t| t.index.to_string()),
        'j' => spec.name.clone(),
        'u' => names.user.clone().unwrap_or_else(|| spec.tenant.clone()),
        't' => compact_state(job).into(),
        'T' => slurm_state(job).into(),
        'M' => squeue_duration(used_secs),
        'L' => match spec.time_limit_secs {
            None => "UNLIMITED".into(),
            Some(limit) => squeue_duration(limit.saturating_sub(used_secs)),
        },
        'l' => spec.time_limit_secs.map_or_else(|| "UNLIMITED".into(), squeue_duration),
        'D' => node_count.to_string(),
        'C' => (cpus_per_node * node_count).to_string(),
        'c' => cpus_per_node.to_string(),
        'm' if spec.memory_bytes == 0 => "0".into(),
        'm' => tres_mem(spec.memory_bytes),
        'R' if job.state == JobState::Pending => format!("({})", slurm_reason(job)),
        'R' | 'N' => hostlist::compress(nodes),
        'P' => null(&names.partition),
        'a' => names.account.clone().unwrap_or_else(|| spec.tenant.clone()),
        'q' => null(&names.qos),
        'b' if spec.gpus > 0 && spec.gpu_slice.is_none() => format!("gres:gpu:{}", spec.gpus_per_part()),
        'b' => "N/A".into(),
        'r' => slurm_reason(job).into(),
        'S' => started.map_or_else(|| "N/A".into(), slurm_time),
        'e' => end.map_or_else(|| "N/A".into(), slurm_time),
        'V' => slurm_time(job.submitted_at.physical_ms()),
        'Z' => null(&names.submit_dir.clone().or_else(|| spec.workdir.clone())),
        'o' if spec.command.is_empty() => "(null)".into(),
        'o' => spec.command.join(" "),
        'p' | 'Q' => spec.priority_class.clone(),
        'y' => "0".into(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{Allocation, JobSpec, SlurmNames, Timestamp};
    use std::time::{Duration, UNIX_EPOCH};

    fn job(id: u64, name: &str, state: JobState) -> Job {
        let spec = JobSpec {
            name: name.into(),
            tenant: "team-a".into(),
            priority_class: "normal".into(),
            time_limit_secs: Some(5400),
            slurm: SlurmNames { user: Some("ana".into()), partition: Some("gpu".into()), ..Default::default() },
            ..Default::default()
        };
        let mut job = Job::pending(id, spec, String::new(), Timestamp::compose(1_000_000, 0));
        job.state = state;
        if state == JobState::Running {
            job.started_at = Some(Timestamp::compose(1_000_000, 0));
            job.allocation = Some(Allocation { node: "gpu-01".into(), gpus: vec![0], ..Default::default() });
        }
        job
    }

    #[test]
    fn the_default_columns_read_as_slurms() {
        let mut held = job(2425, "held", JobState::Pending);
        held.held = true;
        let jobs = [held, job(2424, "longname-demo-job", JobState::Running)];
        let now = UNIX_EPOCH + Duration::from_millis(1_000_000 + 2_000);
        let text = render(&jobs, DEFAULT_FORMAT, false, now).unwrap();
        // As Slurm 22.05's squeue printed the same two jobs.
        assert_eq!(
            text,
            "             JOBID PARTITION     NAME     USER ST       TIME  NODES NODELIST(REASON)\n\
             \x20             2425       gpu     held      ana PD       0:00      1 (JobHeldUser)\n\
             \x20             2424       gpu longname      ana  R       0:02      1 gpu-01\n"
        );
    }

    #[test]
    fn formats_and_field_lists_pick_columns_as_slurm_does() {
        let jobs = [job(2424, "longname-demo-job", JobState::Running)];
        let now = UNIX_EPOCH + Duration::from_millis(1_000_000 + 2_000);
        assert_eq!(render(&jobs, "%L", true, now).unwrap(), "1:29:58\n", "squeue -h -j $SLURM_JOB_ID -o %L");
        assert_eq!(render(&jobs, "%i|%t|%T|%l|%%", true, now).unwrap(), "2424|R|RUNNING|1:30:00|%\n");
        let fields = format_of_fields("JobID,Name,TimeLeft").unwrap();
        assert_eq!(fields, "%20i%20j%20L");
        assert_eq!(
            render(&jobs, &fields, false, now).unwrap(),
            format!(
                "{:<20}{:<20}{:<20}\n{:<20}{:<20}{:<20}\n",
                "JOBID", "NAME", "TIME_LEFT", "2424", "longname-demo-job", "1:29:58"
            )
        );
        assert_eq!(format_of_fields("jobid:8,timeleft:.10").unwrap(), "%8i%.10L");
        assert_eq!(squeue_duration(59), "0:59");
        assert_eq!(squeue_duration(2 * 86_400 + 3 * 3600 + 4 * 60 + 5), "2-03:04:05");
        assert!(parse_format("%w").unwrap_err().contains("'%w' is not served here"));
        assert!(format_of_fields("JobID,Bogus").unwrap_err().contains("field 'Bogus' is not served here"));
        assert!(format_of_fields("JobID:x").is_err());
    }
}
