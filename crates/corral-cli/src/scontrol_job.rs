//! `scontrol show job` in Slurm's own format: `Key=Value` pairs, a few to a line (or one line
//! with `--oneliner`), so that the scripts that read it (`grep -oP 'StdOut=\K\S+'`, `awk -F=`
//! on `EndTime`, `NodeList`, `Command`) find the keys they look for. Pure: the caller fetches the
//! job and says where its script lies.

use corral_types::{hostlist, Job, JobState};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `job` as Slurm 22.05's `scontrol show job` prints it (fields corral has no counterpart for
/// get Slurm's value for "not set"). `script` is where the batch script can be read on this
/// host (the caller's own job: its copy on the node), `now` the time `RunTime` runs up to.
pub fn show_job(job: &Job, script: Option<&str>, now: SystemTime, oneliner: bool) -> String {
    let spec = &job.spec;
    let names = &spec.slurm;
    let Shape { nodes, node_count, cpus_per_node } = Shape::of(job);
    let tasks: u32 = spec.layout.tasks_on_nodes(node_count).iter().sum();
    let cpus_per_task = match spec.layout.cpus_per_task {
        0 => (cpus_per_node * node_count / tasks.max(1)).max(1),
        n => n,
    };
    let user = names.user.clone().unwrap_or_else(|| spec.tenant.clone());
    let at = |ms: Option<u64>| ms.map_or_else(|| "Unknown".to_string(), slurm_time);
    let RunTimes { started, end, used_ms } = RunTimes::of(job, now);
    let mut array = String::new();
    if let Some(task) = job.array_task {
        array = format!(" ArrayJobId={} ArrayTaskId={}", task.array, task.index);
    }
    let null = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(null)".into());
    // The dependencies still waited for, as Slurm lists them.
    let waiting: Vec<String> = spec
        .sched
        .dependencies
        .iter()
        .filter(|d| job.waiting_on.contains(&d.job_id))
        .map(|d| format!("{}:{}(unfulfilled)", d.kind.as_str(), d.job_id))
        .collect();
    let dependency = if waiting.is_empty() { "(null)".to_string() } else { waiting.join(",") };
    let workdir = names.submit_dir.as_ref().or(spec.workdir.as_ref()).cloned().unwrap_or_else(|| "(null)".into());
    let output = |path: Option<&String>| match path {
        None => "(null)".to_string(),
        Some(pattern) => {
            let place = corral_types::OutputPlace { node: nodes.first().copied().unwrap_or(""), ..Default::default() };
            let name = corral_types::expand_output_pattern(pattern, job, &place);
            let dir = spec.workdir.as_ref().or(names.submit_dir.as_ref());
            match dir {
                Some(dir) if !name.starts_with('/') => format!("{}/{name}", dir.trim_end_matches('/')),
                _ => name,
            }
        }
    };
    let stdout = output(spec.stdout_path.as_ref());
    let stderr = if spec.stderr_path.is_some() { output(spec.stderr_path.as_ref()) } else { stdout.clone() };
    let command = match (&spec.script, script) {
        (Some(_), Some(path)) => path.to_string(),
        (Some(_), None) => "(null)".to_string(),
        (None, _) if spec.command.is_empty() => "(null)".to_string(),
        (None, _) => spec.command.join(" "),
    };
    let gpus_per_node = if spec.gpu_slice.is_none() { spec.gpus_per_part() } else { 0 };
    let mut tres = format!(
        "cpu={},mem={},node={node_count},billing={}",
        cpus_per_node * node_count,
        tres_mem(spec.memory_bytes.saturating_mul(u64::from(node_count))),
        cpus_per_node * node_count
    );
    if spec.gpus > 0 && spec.gpu_slice.is_none() {
        tres.push_str(&format!(",gres/gpu={}", spec.gpus));
    }
    let mut lines = vec![
        format!("JobId={}{array} JobName={}", job.id, spec.name),
        // The user's name without Slurm's `(uid)`: the uid is the worker's mapping, not known here.
        format!("UserId={user} GroupId={user} MCS_label=N/A"),
        format!(
            "Priority={} Nice=0 Account={} QOS={}",
            spec.priority_class,
            names.account.clone().unwrap_or_else(|| spec.tenant.clone()),
            null(names.qos.as_ref())
        ),
        format!("JobState={} Reason={} Dependency={dependency}", slurm_state(job), slurm_reason(job)),
        format!(
            "Requeue={} Restarts={} BatchFlag={} Reboot=0 ExitCode={}:{}",
            u8::from(!spec.sched.no_requeue),
            job.attempts.saturating_sub(1),
            u8::from(spec.script.is_some()),
            job.exit_code.unwrap_or(0),
            job.signal.unwrap_or(0)
        ),
        format!(
            "RunTime={} TimeLimit={} TimeMin=N/A",
            slurm_duration(used_ms / 1000),
            spec.time_limit_secs.map_or_else(|| "UNLIMITED".to_string(), slurm_duration)
        ),
        format!(
            "SubmitTime={} EligibleTime={}",
            slurm_time(job.submitted_at.physical_ms()),
            slurm_time(job.submitted_at.physical_ms())
        ),
        format!("StartTime={} EndTime={} Deadline=N/A", at(started), at(end)),
        format!("Partition={} AllocNode:Sid={}:0", null(names.partition.as_ref()), null(names.submit_host.as_ref())),
        "ReqNodeList=(null) ExcNodeList=(null)".to_string(),
        format!("NodeList={}", if nodes.is_empty() { "(null)".to_string() } else { hostlist::compress(&nodes) }),
    ];
    if let Some(first) = nodes.first() {
        lines.push(format!("BatchHost={first}"));
    }
    lines.extend([
        format!(
            "NumNodes={node_count} NumCPUs={} NumTasks={tasks} CPUs/Task={cpus_per_task} ReqB:S:C:T=0:0:*:*",
            cpus_per_node * node_count
        ),
        format!("TRES={tres}"),
        format!("MinCPUsNode={cpus_per_node} MinMemoryNode={} MinTmpDiskNode=0", tres_mem(spec.memory_bytes)),
        format!("Command={command}"),
        format!("WorkDir={workdir}"),
        format!("StdErr={stderr}"),
        "StdIn=/dev/null".to_string(),
        format!("StdOut={stdout}"),
    ]);
    if gpus_per_node > 0 {
        lines.push(format!("TresPerNode=gres:gpu:{gpus_per_node}"));
    }
    if oneliner {
        lines.join(" ")
    } else {
        format!("{}\n", lines.join("\n   "))
    }
}

/// Where a job runs and on how much, as Slurm's commands count it.
pub(crate) struct Shape<'a> {
    /// Its nodes, the first first (none before it is placed).
    pub nodes: Vec<&'a str>,
    /// How many nodes it has, or asks for before it is placed.
    pub node_count: u32,
    /// Whole CPUs on each node (at least 1, as Slurm allocates).
    pub cpus_per_node: u32,
}

impl<'a> Shape<'a> {
    pub(crate) fn of(job: &'a Job) -> Shape<'a> {
        let nodes: Vec<&str> = job.allocation.as_ref().map(|a| a.parts().map(|(n, _)| n).collect()).unwrap_or_default();
        let node_count = if nodes.is_empty() { job.spec.parts() } else { nodes.len() as u32 };
        Shape { nodes, node_count, cpus_per_node: job.spec.cpu_millis.div_ceil(1000).max(1) }
    }
}

/// When a job started and ends and how long it has run, in milliseconds since the epoch, as
/// Slurm's commands show them.
#[derive(Clone, Copy)]
pub(crate) struct RunTimes {
    /// Placed is started, as for `SLURM_JOB_START_TIME` (the worker's report of the start comes
    /// a moment later); a pending job has not started, whatever an earlier run did.
    pub started: Option<u64>,
    /// When it ended, or else when its time limit ends it.
    pub end: Option<u64>,
    /// From its start to its end, or to `now`.
    pub used_ms: u64,
}

impl RunTimes {
    pub(crate) fn of(job: &Job, now: SystemTime) -> RunTimes {
        let started =
            job.started_at.or(job.admitted_at).filter(|_| job.state != JobState::Pending).map(|t| t.physical_ms());
        let end = match (job.finished_at, started, job.spec.time_limit_secs) {
            (Some(t), _, _) => Some(t.physical_ms()),
            (None, Some(start), Some(limit)) => Some(start.saturating_add(limit.saturating_mul(1000))),
            _ => None,
        };
        let used_ms = match (started, job.finished_at) {
            (Some(start), Some(end)) => end.physical_ms().saturating_sub(start),
            (Some(start), None) => millis_since_epoch(now).saturating_sub(start),
            (None, _) => 0,
        };
        RunTimes { started, end, used_ms }
    }
}

/// Slurm's state name of `job`.
pub(crate) fn slurm_state(job: &Job) -> &'static str {
    let reason = job.reason.as_deref().unwrap_or_default();
    match job.state {
        JobState::Pending => "PENDING",
        JobState::Running => "RUNNING",
        JobState::Succeeded => "COMPLETED",
        JobState::Failed if reason.starts_with("timeout") => "TIMEOUT",
        JobState::Failed if reason.starts_with("oom-killed") => "OUT_OF_MEMORY",
        JobState::Failed if reason.contains("node lost") => "NODE_FAIL",
        JobState::Failed => "FAILED",
        JobState::Cancelled => "CANCELLED",
        JobState::Preempted => "PREEMPTED",
    }
}

/// Slurm's one-word reason: why a pending job waits, `None` otherwise.
pub(crate) fn slurm_reason(job: &Job) -> &'static str {
    match job.state {
        JobState::Pending if job.held => "JobHeldUser",
        JobState::Pending if !job.waiting_on.is_empty() => "Dependency",
        JobState::Pending => "Resources",
        _ => "None",
    }
}

/// `[D-]HH:MM:SS`, as Slurm writes run times and limits.
pub(crate) fn slurm_duration(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let hms = format!("{:02}:{:02}:{:02}", rest / 3600, rest % 3600 / 60, rest % 60);
    if days > 0 {
        format!("{days}-{hms}")
    } else {
        hms
    }
}

/// Memory as Slurm's TRES writes it: megabytes, or gigabytes when whole (`16G`, `500M`).
pub(crate) fn tres_mem(bytes: u64) -> String {
    let mib = bytes.div_ceil(1 << 20);
    if mib > 0 && mib.is_multiple_of(1024) {
        format!("{}G", mib / 1024)
    } else {
        format!("{mib}M")
    }
}

pub(crate) fn millis_since_epoch(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_millis() as u64
}

/// A time as Slurm writes it: `2026-12-07T21:53:18`, in this host's local time.
pub(crate) fn slurm_time(ms: u64) -> String {
    let secs = libc::time_t::try_from(ms / 1000).unwrap_or(0);
    // SAFETY: localtime_r writes only the `tm` it is given.
    let tm = unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&secs, &mut tm);
        tm
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{
        Allocation, Dependency, DependencyKind, JobSpec, NodeGpus, SchedOptions, SlurmNames, TaskLayout, Timestamp,
    };

    fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
        text.split_whitespace().find_map(|pair| pair.strip_prefix(key)?.strip_prefix('='))
    }

    fn running_gang() -> Job {
        let spec = JobSpec {
            name: "ddp".into(),
            tenant: "team-a".into(),
            priority_class: "normal".into(),
            gpus: 4,
            cpu_millis: 8_000,
            memory_bytes: 16 << 30,
            time_limit_secs: Some(3600),
            script: Some("#!/bin/sh\nsrun true\n".into()),
            stdout_path: Some("logs/%x-%j.out".into()),
            workdir: Some("/home/a/proj".into()),
            sched: SchedOptions { gpus_per_node: Some(2), ..Default::default() },
            layout: TaskLayout { nodes: 2, ntasks_per_node: 2, ..Default::default() },
            slurm: SlurmNames {
                account: Some("proj_x".into()),
                partition: Some("gpu".into()),
                submit_dir: Some("/home/a/proj".into()),
                submit_host: Some("login1".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut job = Job::pending(41, spec, String::new(), Timestamp::compose(1_000_000, 0));
        job.state = JobState::Running;
        job.attempts = 2;
        job.started_at = Some(Timestamp::compose(1_060_000, 0));
        job.allocation = Some(Allocation {
            node: "gpu-01".into(),
            gpus: vec![0, 1],
            more_nodes: vec![NodeGpus { node: "gpu-02".into(), gpus: vec![0, 1] }],
            ..Default::default()
        });
        job
    }

    #[test]
    fn a_running_gang_reads_as_slurm_prints_it() {
        let job = running_gang();
        let now = UNIX_EPOCH + Duration::from_millis(1_060_000 + 65_000);
        let text = show_job(&job, Some("/var/lib/corral/jobs/41/2/job-script"), now, false);
        assert!(text.starts_with("JobId=41 JobName=ddp\n   UserId="), "{text}");
        let get = |k: &str| field(&text, k).unwrap_or_else(|| panic!("no {k} in {text}"));
        assert_eq!(get("JobState"), "RUNNING");
        assert_eq!(get("Reason"), "None");
        assert_eq!(get("Restarts"), "1");
        assert_eq!(get("RunTime"), "00:01:05");
        assert_eq!(get("TimeLimit"), "01:00:00");
        assert_eq!(get("NodeList"), "gpu-[01-02]");
        assert_eq!(get("BatchHost"), "gpu-01");
        assert_eq!((get("NumNodes"), get("NumCPUs"), get("NumTasks"), get("CPUs/Task")), ("2", "16", "4", "4"));
        assert_eq!(get("TRES"), "cpu=16,mem=32G,node=2,billing=16,gres/gpu=4");
        assert_eq!(get("TresPerNode"), "gres:gpu:2");
        assert_eq!((get("Account"), get("Partition"), get("AllocNode:Sid")), ("proj_x", "gpu", "login1:0"));
        assert_eq!(get("StdOut"), "/home/a/proj/logs/ddp-41.out");
        assert_eq!(get("StdErr"), get("StdOut"), "stderr goes with stdout unless it has a file");
        assert_eq!(get("Command"), "/var/lib/corral/jobs/41/2/job-script");
        assert_eq!(get("WorkDir"), "/home/a/proj");
        assert_eq!(get("StartTime"), slurm_time(1_060_000));
        assert_eq!(get("EndTime"), slurm_time(1_060_000 + 3_600_000), "a running job ends at its limit");
        assert_eq!(text.lines().count(), 21, "{text}");
        let one = show_job(&job, None, now, true);
        assert_eq!(one.lines().count(), 1);
        assert_eq!(field(&one, "Command"), Some("(null)"), "a script that cannot be read here");
        assert_eq!(field(&one, "NodeList"), Some("gpu-[01-02]"));
    }

    #[test]
    fn pending_and_ended_jobs_take_slurms_states_and_reasons() {
        let mut job = running_gang();
        job.state = JobState::Pending;
        job.started_at = None;
        job.allocation = None;
        job.held = true;
        let now = SystemTime::now();
        let text = show_job(&job, None, now, false);
        assert_eq!((field(&text, "JobState"), field(&text, "Reason")), (Some("PENDING"), Some("JobHeldUser")));
        assert_eq!((field(&text, "NodeList"), field(&text, "StartTime")), (Some("(null)"), Some("Unknown")));
        assert_eq!(field(&text, "NumNodes"), Some("2"), "the nodes it asks for");
        job.held = false;
        job.spec.sched.dependencies = vec![
            Dependency { kind: DependencyKind::AfterOk, job_id: 7 },
            Dependency { kind: DependencyKind::AfterAny, job_id: 8 },
            Dependency { kind: DependencyKind::AfterNotOk, job_id: 9 },
        ];
        job.waiting_on = vec![7, 9];
        let text = show_job(&job, None, now, false);
        assert_eq!(
            (field(&text, "Reason"), field(&text, "Dependency")),
            (Some("Dependency"), Some("afterok:7(unfulfilled),afternotok:9(unfulfilled)")),
            "the ones still waited for, of their kinds"
        );
        for (reason, state) in [
            ("timeout: killed at its time limit", "TIMEOUT"),
            ("oom-killed: exceeded", "OUT_OF_MEMORY"),
            ("exit code 3", "FAILED"),
        ] {
            job.state = JobState::Failed;
            job.reason = Some(reason.into());
            job.exit_code = Some(3);
            assert_eq!(field(&show_job(&job, None, now, false), "JobState"), Some(state));
        }
        assert_eq!(field(&show_job(&job, None, now, false), "ExitCode"), Some("3:0"));
        job.spec.time_limit_secs = Some(2 * 86_400 + 5);
        assert_eq!(field(&show_job(&job, None, now, false), "TimeLimit"), Some("2-00:00:05"));
    }
}
