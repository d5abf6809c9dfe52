//! `srun` inside a job (the corral binary called as `srun`): builds the step from Slurm's flags
//! (and, where none are given, the batch environment's counts, as Slurm's `srun` does), asks
//! the node's worker for it through the in-job socket with the run secret of its environment,
//! relays its tasks' output (this node's from each task's file in the run's directory, other
//! nodes' through the worker, which reads them through the leader's proxy; `--label` prefixing
//! `N: `), forwards SIGINT/SIGTERM to the step, and exits with the step's code (the highest task
//! status; a signal N counts as 128 + N). A step whose GPUs other live steps hold is retried
//! until they are free, as Slurm's srun waits. `--gpus`/`--gres` of a step of several tasks
//! and `--wait` are carried in the step for the coordinator's layout and the workers.
//!
//! In a `corral alloc` session (on the submit host, off the job's nodes: `CORRAL_ALLOC_JOB_ID`
//! and `CORRAL_ALLOC_EPOCH` instead of a run secret) the same step is made, followed, signalled
//! and read through the coordinator, as the job's owner (`Corral.CreateJobStep`, ...): every
//! task's output is relayed as another node's is.

use corral_types::{Job, JobStep, StepSpec};
use corral_worker::in_job::{Call, Reply, Request, MAX_REQUEST_BYTES, SECRET_ENV, SOCKET_ENV};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// How often the tasks' output files are read.
const OUTPUT_POLL: Duration = Duration::from_millis(20);
/// Other nodes' tasks whose output one `srun` relays (one stream each, through the node's
/// worker): the rest stay in their nodes' files.
const MAX_REMOTE_STREAMS: usize = 64;
/// Longest piece of a task's line held back waiting for its end.
const MAX_LINE: usize = 64 * 1024;
/// The coordinator's refusal of a step whose GPUs other live steps hold (`plan_tasks`): srun
/// retries it every `STEP_RETRY` until they are free, as Slurm's srun waits.
const STEP_BUSY: &str = "held by other steps";
const STEP_RETRY: Duration = Duration::from_millis(250);
/// How long the last of other nodes' output may take to arrive once the step has ended.
const REMOTE_DRAIN: Duration = Duration::from_secs(10);

/// Writes one line to stderr in a single write, so that it reaches the job's output file whole
/// next to what the batch script writes to stdout.
macro_rules! say {
    ($($arg:tt)*) => {{
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

/// What the flags ask for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Flags {
    pub spec: StepSpec,
    pub label: bool,
    /// `-u`: output relayed as it comes, not a line at a time (without `--label`).
    pub unbuffered: bool,
    /// `--export`: `None` is Slurm's default (`ALL`).
    pub export: Option<String>,
    /// Slurm options given that corral's srun accepts without acting on them (`IGNORED`).
    pub ignored: Vec<String>,
    /// `--pty`: the command on the allocation's first node with a terminal of its own.
    pub pty: bool,
    /// `-o`/`--output PATTERN`: the tasks' output goes to these files instead of srun's own
    /// (`%t` a file per task; see `output_file`).
    pub output: Option<String>,
}

/// Slurm `srun` options accepted and not acted on, one warning each (name, takes a value):
/// binding, memory and accounting options (each task sees the job's GPUs and memory of its
/// node), `--mpi` (there is no PMI: an MPI program sees no launcher), and `-e` (a task's
/// output and errors are one stream, which `-o` names).
const IGNORED: [(&str, bool); 40] = [
    ("--gres-flags", true),
    ("--exact", false),
    ("-e", true),
    ("--error", true),
    ("-X", false),
    ("--disable-status", false),
    ("-Q", false),
    ("--quiet", false),
    ("-v", false),
    ("--verbose", false),
    ("-E", false),
    ("--preserve-env", false),
    ("--exclusive", false),
    ("--cpu-bind", true),
    ("--cpu_bind", true),
    ("--mem-bind", true),
    ("--gpu-bind", true),
    ("--accel-bind", true),
    ("--hint", true),
    ("--mpi", true),
    ("--mem", true),
    ("--mem-per-cpu", true),
    ("--mem-per-gpu", true),
    ("--gres", true),
    ("-G", true),
    ("--gpus", true),
    ("--gpus-per-node", true),
    ("--cpus-per-gpu", true),
    ("--threads-per-core", true),
    ("-m", true),
    ("--distribution", true),
    ("-J", true),
    ("--job-name", true),
    ("-t", true),
    ("--time", true),
    ("-p", true),
    ("--partition", true),
    ("-A", true),
    ("--account", true),
    ("--jobid", true),
];

/// Variables that describe one node or one run's secret: never carried to other nodes' tasks
/// by `--export` (each task gets its own from its node).
pub fn node_specific(key: &str) -> bool {
    const PREFIXES: [&str; 4] = ["CORRAL_", "CUDA_", "NVIDIA_", "SLURMD_"];
    const KEYS: [&str; 8] = [
        "SLURM_NODEID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_TOPOLOGY_ADDR",
        "HOSTNAME",
        "NODE_RANK",
        "GROUP_RANK",
        "SLURM_GTIDS",
    ];
    PREFIXES.iter().any(|p| key.starts_with(p)) || KEYS.contains(&key)
}

fn number(flag: &str, value: &str) -> Result<u32, String> {
    value.parse().map_err(|_| format!("{flag} takes a number, got '{value}'"))
}

/// Parses Slurm's `srun` flags up to the command; `env` is the caller's environment.
pub fn parse(args: &[String], env: &BTreeMap<String, String>) -> Result<Flags, String> {
    let args = &unbundled(args);
    let mut flags = Flags::default();
    let mut i = 0;
    let mut explicit_layout = false;
    // `--gpus`/`-G`/`--gres=gpu:N`: the step's GPUs (name and count).
    let mut step_gpus: Option<(String, u32)> = None;
    while i < args.len() {
        let arg = &args[i];
        if !arg.starts_with('-') || arg == "-" {
            break;
        }
        if arg == "--" {
            i += 1;
            break;
        }
        // --name=value, --name value, -n4, -n 4
        let (name, inline): (String, Option<String>) = if let Some(long) = arg.strip_prefix("--") {
            match long.split_once('=') {
                Some((n, v)) => (format!("--{}", long_option(n)), Some(v.to_owned())),
                None => (format!("--{}", long_option(long)), None),
            }
        } else if arg.len() > 2 {
            (arg[..2].to_owned(), Some(arg[2..].to_owned()))
        } else {
            (arg.clone(), None)
        };
        let ignored = IGNORED.iter().find(|(n, _)| *n == name);
        // Slurm's optional values (`-K1`, `--exclusive=user`): inline only.
        let optional_value = OPTIONAL_VALUE.contains(&name.as_str());
        let takes_value = takes_value(&name);
        let value = if optional_value {
            inline.unwrap_or_default()
        } else if takes_value {
            match inline {
                Some(v) => v,
                None => {
                    i += 1;
                    args.get(i).cloned().ok_or_else(|| format!("{name} needs a value"))?
                }
            }
        } else {
            if inline.is_some() {
                return Err(format!("{name} takes no value"));
            }
            String::new()
        };
        match name.as_str() {
            "-n" | "--ntasks" => {
                flags.spec.ntasks = Some(number(&name, &value)?);
                explicit_layout = true;
            }
            "-N" | "--nodes" => {
                flags.spec.nodes = Some(number(&name, &value)?);
                explicit_layout = true;
            }
            "--ntasks-per-node" => {
                flags.spec.ntasks_per_node = Some(number(&name, &value)?);
                explicit_layout = true;
            }
            // `TYPE:N` names the node's GPU type: the job's GPUs are of it already.
            "--gpus-per-task" => {
                flags.spec.gpus_per_task = Some(number(&name, value.rsplit(':').next().unwrap_or(&value))?)
            }
            "-c" | "--cpus-per-task" => flags.spec.cpus_per_task = Some(number(&name, &value)?),
            "-w" | "--nodelist" => {
                flags.spec.nodelist = corral_types::hostlist::expand(&value).map_err(|e| e.to_string())?;
                explicit_layout = true;
            }
            "-l" | "--label" => flags.label = true,
            "-u" | "--unbuffered" => flags.unbuffered = true,
            "-K" | "--kill-on-bad-exit" => {
                flags.spec.kill_on_bad_exit = match value.as_str() {
                    "" | "1" => true,
                    "0" => false,
                    other => return Err(format!("{name} takes 0 or 1, got '{other}'")),
                }
            }
            "--overlap" => flags.spec.overlap = true,
            "-o" | "--output" => flags.output = Some(value),
            "--export" => flags.export = Some(value),
            "-D" | "--chdir" => flags.spec.cwd = Some(value),
            // A step of this job (scripts name it with `--jobid $SLURM_JOB_ID`) is what srun makes.
            "--jobid" => {
                let own = env.get("SLURM_JOB_ID").or_else(|| env.get("SLURM_JOBID"));
                if own != Some(&value) {
                    return Err(format!("--jobid {value}: corral's srun runs steps of its own job only"));
                }
            }
            "-W" | "--wait" => {
                // Slurm's 0: no limit.
                let secs = number(&name, &value)?;
                flags.spec.wait_secs = (secs > 0).then_some(secs);
            }
            "--gpus" | "-G" | "--gres" | "--gpus-per-node" => match step_gpu_count(&name, &value) {
                Some(n) => step_gpus = Some((name, n)),
                None => flags.ignored.push(name),
            },
            _ if ignored.is_some() => flags.ignored.push(name),
            "--pty" => flags.pty = true,
            // Its command is a configuration file of commands per task, which would run as one.
            "--multi-prog" => {
                return Err("--multi-prog is not served by corral's srun: run one command per step".into())
            }
            // Any other option of Slurm's srun (or pyxis's) changes what corral's does not do
            // (reservations, binding, container options of a job that has its own): one warning,
            // as for the directives of a batch script.
            other if is_slurm_option(other) => flags.ignored.push(name),
            other => return Err(format!("{other} is not an option of srun")),
        }
        i += 1;
    }
    flags.spec.command = args[i..].to_vec();
    if flags.spec.command.is_empty() {
        return Err("no command: give the program to run, e.g. `srun python train.py`".into());
    }
    if !explicit_layout {
        // As Slurm's srun inside an allocation: the batch environment's counts.
        let read = |k: &str| env.get(k).and_then(|v| v.parse::<u32>().ok());
        flags.spec.ntasks = read("SLURM_NTASKS");
        flags.spec.ntasks_per_node = read("SLURM_NTASKS_PER_NODE");
    }
    if flags.spec.cpus_per_task.is_none() {
        flags.spec.cpus_per_task = env.get("SLURM_CPUS_PER_TASK").and_then(|v| v.parse().ok());
    }
    if flags.spec.gpus_per_task.is_none() && step_gpus.is_none() {
        // As Slurm's srun: the job's --gpus-per-task, from the batch environment.
        flags.spec.gpus_per_task = env.get("SLURM_GPUS_PER_TASK").and_then(|v| v.rsplit(':').next()?.parse().ok());
    }
    if let Some((name, gpus)) = step_gpus {
        // A one-task step's GPUs are its task's: bound as --gpus-per-task binds them (steps
        // running side by side get distinct GPUs). Over several tasks, as Slurm: --gpus
        // spreads over the step's nodes, --gres=gpu:N and --gpus-per-node give each node N,
        // and a node's tasks share its GPUs. With --gpus-per-task, that binds.
        if flags.spec.gpus_per_task.is_some() || gpus == 0 {
            flags.ignored.push(name);
        } else if flags.spec.ntasks == Some(1) {
            flags.spec.gpus_per_task = Some(gpus);
        } else if matches!(name.as_str(), "--gpus" | "-G") {
            flags.spec.gpus = Some(gpus);
        } else {
            flags.spec.gpus_per_node = Some(gpus);
        }
    }
    flags.spec.env = exported(flags.export.as_deref(), env)?;
    Ok(flags)
}

/// The GPU count of srun's `--gpus`/`-G` (`N`, `TYPE:N`) or `--gres` (`gpu:N`, `gpu:TYPE:N`).
fn step_gpu_count(name: &str, value: &str) -> Option<u32> {
    let value = if name == "--gres" { value.strip_prefix("gpu")?.trim_start_matches(':') } else { value };
    if value.is_empty() {
        return (name == "--gres").then_some(1);
    }
    value.rsplit(':').next()?.parse().ok()
}

/// The variables `--export` carries to the tasks (node-specific ones never travel).
fn exported(export: Option<&str>, env: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let carry = |out: &mut BTreeMap<String, String>, k: &str| {
        if let Some(v) = env.get(k).filter(|_| !node_specific(k)) {
            out.insert(k.to_owned(), v.clone());
        }
    };
    let items: Vec<&str> = export.unwrap_or("ALL").split(',').filter(|s| !s.is_empty()).collect();
    for item in items {
        match item {
            "ALL" => {
                for k in env.keys() {
                    carry(&mut out, k);
                }
            }
            // Slurm's NONE: the tasks get only the SLURM_* variables (and their node's own),
            // marked for the worker, which builds their environment.
            "NONE" => {
                out.insert(corral_worker::in_job::EXPORT_NONE.to_owned(), "1".to_owned());
            }
            other => match other.split_once('=') {
                Some((k, v)) => {
                    out.insert(k.to_owned(), v.to_owned());
                }
                None => carry(&mut out, other),
            },
        }
    }
    Ok(out)
}

/// Slurm's `srun` long options (22.05), for `long_option`: Slurm reads them through
/// `getopt_long`, which takes any unambiguous abbreviation.
const SRUN_LONG: &[&str] = &[
    "account",
    "acctg-freq",
    "bb",
    "bbf",
    "bcast",
    "bcast-exclude",
    "begin",
    "chdir",
    "cluster-constraint",
    "clusters",
    "comment",
    "compress",
    "constraint",
    "container",
    "contiguous",
    "core-spec",
    "cores-per-socket",
    "cpu-bind",
    "cpu-freq",
    "cpus-per-gpu",
    "cpus-per-task",
    "deadline",
    "delay-boot",
    "dependency",
    "disable-status",
    "distribution",
    "epilog",
    "error",
    "exact",
    "exclude",
    "exclusive",
    "export",
    "extra-node-info",
    "gpu-bind",
    "gpu-freq",
    "gpus",
    "gpus-per-node",
    "gpus-per-socket",
    "gpus-per-task",
    "gres",
    "gres-flags",
    "help",
    "het-group",
    "hint",
    "hold",
    "immediate",
    "input",
    "job-name",
    "jobid",
    "kill-on-bad-exit",
    "label",
    "licenses",
    "mail-type",
    "mail-user",
    "mcs-label",
    "mem",
    "mem-bind",
    "mem-per-cpu",
    "mem_bind",
    "mem-per-gpu",
    "mincpus",
    "mpi",
    "multi-prog",
    "nice",
    "no-allocate",
    "no-kill",
    "nodefile",
    "nodelist",
    "network",
    "nodes",
    "ntasks",
    "ntasks-per-core",
    "ntasks-per-gpu",
    "ntasks-per-node",
    "open-mode",
    "ntasks-per-socket",
    "output",
    "overcommit",
    "overlap",
    "oversubscribe",
    "partition",
    "power",
    "preserve-env",
    "priority",
    "profile",
    "prolog",
    "propagate",
    "pty",
    "qos",
    "quiet",
    "quit-on-interrupt",
    "reboot",
    "relative",
    "reservation",
    "resv-ports",
    "send-libs",
    "signal",
    "slurmd-debug",
    "sockets-per-node",
    "spread-job",
    "switches",
    "task-epilog",
    "task-prolog",
    "thread-spec",
    "threads",
    "threads-per-core",
    "time",
    "time-min",
    "tmp",
    "unbuffered",
    "usage",
    "use-min-nodes",
    "verbose",
    "version",
    "wait",
    "x11",
    "wckey",
];

/// The long option `name` (without `--`) stands for: itself, Slurm's alias resolved
/// (`tasks-per-node`), or the one Slurm option an abbreviation begins (`--ntasks-per-n`); else
/// `name`, refused later as not an option.
fn long_option(name: &str) -> String {
    match crate::sbatch::unabbreviated(name, SRUN_LONG).as_str() {
        "tasks-per-node" => "ntasks-per-node".to_string(),
        other => other.to_string(),
    }
}

/// Slurm's (and pyxis's) `srun` options that take no value (`--name`, `-c`), and those whose
/// value is optional and only inline (`--exclusive[=user]`).
const SWITCHES: &[&str] = &[
    "--contiguous",
    "--disable-status",
    "--exact",
    "--help",
    "--hold",
    "--label",
    "--multi-prog",
    "--no-allocate",
    "--overcommit",
    "--overlap",
    "--oversubscribe",
    "--preserve-env",
    "--pty",
    "--quiet",
    "--quit-on-interrupt",
    "--reboot",
    "--spread-job",
    "--test-only",
    "--unbuffered",
    "--usage",
    "--use-min-nodes",
    "--verbose",
    "--version",
    "--container-mount-home",
    "--no-container-mount-home",
    "--container-remap-root",
    "--no-container-remap-root",
    "--container-writable",
    "--container-readonly",
    "--container-entrypoint",
    "--no-container-entrypoint",
    "-E",
    "-H",
    "-h",
    "-l",
    "-O",
    "-Q",
    "-s",
    "-u",
    "-v",
    "-V",
    "-X",
    "-Z",
];

/// Options whose value is optional, given inline only (`-K1`, `--kill-on-bad-exit=0`).
const OPTIONAL_VALUE: &[&str] =
    &["-K", "--kill-on-bad-exit", "--exclusive", "-I", "--immediate", "-k", "--no-kill", "--x11", "--send-libs"];

/// Short options of Slurm's srun that take a value.
const SHORT_WITH_VALUE: &str = "ABcCdDeGiJLmMnNopqrStTwWx";

/// pyxis's `srun` options (the container plugin of NVIDIA's Slurm clusters).
const PYXIS_LONG: &[&str] = &[
    "container-image",
    "container-mounts",
    "container-workdir",
    "container-name",
    "container-save",
    "container-env",
    "container-mount-home",
    "no-container-mount-home",
    "container-remap-root",
    "no-container-remap-root",
    "container-writable",
    "container-readonly",
    "container-entrypoint",
    "no-container-entrypoint",
];

/// Whether option `name` (`--name` or `-c`, as `parse` names it) takes a value after it.
fn takes_value(name: &str) -> bool {
    if let Some((_, takes)) = IGNORED.iter().find(|(n, _)| *n == name) {
        return *takes;
    }
    !SWITCHES.contains(&name) && !OPTIONAL_VALUE.contains(&name)
}

/// Whether `name` is one of Slurm's srun options or pyxis's.
fn is_slurm_option(name: &str) -> bool {
    match name.strip_prefix("--") {
        Some(long) => SRUN_LONG.contains(&long) || PYXIS_LONG.contains(&long),
        None => name.strip_prefix('-').and_then(|c| c.chars().next()).is_some_and(|c| {
            SHORT_WITH_VALUE.contains(c) || SWITCHES.contains(&name) || OPTIONAL_VALUE.contains(&name)
        }),
    }
}

/// `args` with bundled short switches apart (`-ul` is `-u -l`, as getopt reads it), up to the
/// command.
fn unbundled(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        if arg == "--" || !arg.starts_with('-') || arg == "-" {
            break;
        }
        i += 1;
        if let Some(long) = arg.strip_prefix("--") {
            out.push(arg.clone());
            if !long.contains('=') && takes_value(&format!("--{}", long_option(long))) && i < args.len() {
                out.push(args[i].clone());
                i += 1;
            }
            continue;
        }
        let switches = arg.len() > 2 && arg[1..].chars().all(|c| SWITCHES.contains(&format!("-{c}").as_str()));
        if switches {
            out.extend(arg[1..].chars().map(|c| format!("-{c}")));
            continue;
        }
        out.push(arg.clone());
        if arg.len() == 2 && takes_value(arg) && i < args.len() {
            out.push(args[i].clone());
            i += 1;
        }
    }
    out.extend(args[i..].iter().cloned());
    out
}

/// `srun ARGS`.
pub fn main(args: &[String]) -> ExitCode {
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let via = match (env.get(SECRET_ENV), env.get(SOCKET_ENV)) {
        (Some(secret), Some(socket)) => Via::Node { socket: PathBuf::from(socket), secret: secret.clone() },
        _ => match session(&env) {
            Ok(Some(via)) => via,
            Ok(None) => {
                say!(
                    "srun: error: not inside a corral job ({SECRET_ENV} is not set) nor a `corral alloc` session ({SESSION_JOB_ENV} is not set): srun runs a step of a running job; to start a job use `corral run`, `corral sbatch` or `corral alloc`"
                );
                return ExitCode::from(1);
            }
            Err(e) => {
                say!("srun: error: {e}");
                return ExitCode::from(1);
            }
        },
    };
    let flags = match parse(args, &env) {
        Ok(f) => {
            for name in &f.ignored {
                say!("srun: warning: {name} is accepted but not acted on by corral's srun");
            }
            f
        }
        Err(e) => {
            say!("srun: error: {e}");
            return ExitCode::from(1);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            say!("srun: error: {e}");
            return ExitCode::from(1);
        }
    };
    if flags.pty {
        match &via {
            // `srun --pty bash` in a session: the command on the allocation's first node, in the
            // job's cgroup (and container), with a terminal relayed as `corral attach` does.
            Via::Coordinator { job_id, global, .. } => {
                let attach = crate::args::AttachArgs { job: *job_id, node: None, command: flags.spec.command.clone() };
                return match runtime.block_on(crate::attach::attach(global, attach)) {
                    Ok(code) => code,
                    Err(e) => {
                        say!("srun: error: {e}");
                        ExitCode::from(1)
                    }
                };
            }
            Via::Node { .. } => {
                say!("srun: warning: --pty: a batch step has no terminal to give; the tasks run without one");
            }
        }
    }
    // In a session every task is on another host: none is read from a file here.
    let (node, job_dir) = match via {
        Via::Node { .. } => {
            (env.get("CORRAL_NODE").cloned().unwrap_or_default(), env.get("CORRAL_JOB_DIR").map(PathBuf::from))
        }
        Via::Coordinator { .. } => (String::new(), None),
    };
    match runtime.block_on(run(flags, via, node, job_dir)) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            say!("srun: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// The variable naming a `corral alloc` session's job (set by `corral alloc` in its shell).
pub const SESSION_JOB_ENV: &str = "CORRAL_ALLOC_JOB_ID";
/// The variable naming the run (allocation epoch) the session was granted.
pub const SESSION_EPOCH_ENV: &str = "CORRAL_ALLOC_EPOCH";

/// Where `srun` reaches its job.
#[derive(Clone)]
enum Via {
    /// Inside the job: the node's in-job service, with the run's secret.
    Node { socket: PathBuf, secret: String },
    /// In a `corral alloc` session on the submit host: the coordinator, as the job's owner
    /// (`CORRAL_ENDPOINT`, `CORRAL_TOKEN`, `CORRAL_CA`/`CORRAL_CERT`/`CORRAL_KEY`), for the run
    /// the session was granted.
    Coordinator { client: corral_client::Client, job_id: u64, epoch: u64, global: Box<crate::args::GlobalArgs> },
}

/// The session `env` names, if any.
fn session(env: &BTreeMap<String, String>) -> Result<Option<Via>, String> {
    let Some(job) = env.get(SESSION_JOB_ENV) else { return Ok(None) };
    let job_id = job.parse::<u64>().map_err(|_| format!("{SESSION_JOB_ENV}={job} is not a job id"))?;
    let epoch = env.get(SESSION_EPOCH_ENV).map(|e| e.parse::<u64>()).transpose();
    let epoch = epoch.ok().flatten().ok_or_else(|| format!("{SESSION_EPOCH_ENV} is missing or not a number"))?;
    let endpoint = env.get("CORRAL_ENDPOINT").map_or("127.0.0.1:7070", String::as_str);
    let global = crate::args::GlobalArgs {
        endpoint: endpoint.split(',').map(str::to_owned).collect(),
        token: env.get("CORRAL_TOKEN").cloned(),
        ca: env.get("CORRAL_CA").map(PathBuf::from),
        cert: env.get("CORRAL_CERT").map(PathBuf::from),
        key: env.get("CORRAL_KEY").map(PathBuf::from),
        output: crate::args::OutputFormat::Table,
    };
    let client = crate::connect::client(&global).map_err(|e| e.to_string())?;
    Ok(Some(Via::Coordinator { client, job_id, epoch, global: Box::new(global) }))
}

impl Via {
    async fn create(&self, spec: &StepSpec) -> Result<JobStep, String> {
        match self {
            Via::Node { socket, secret } => {
                let create = Call::CreateStep { request_id: request_id(), spec: spec.clone() };
                match call(socket, secret, create).await? {
                    Reply::Step(step) => Ok(*step),
                    other => Err(format!("unexpected answer: {other:?}")),
                }
            }
            Via::Coordinator { client, job_id, epoch, .. } => {
                client.create_job_step(*job_id, *epoch, &request_id(), spec).await.map_err(|e| e.to_string())
            }
        }
    }

    /// The step once it is no longer live.
    async fn wait(&self, step: u32) -> Result<JobStep, String> {
        match self {
            Via::Node { socket, secret } => match call(socket, secret, Call::WaitStep { step }).await? {
                Reply::Step(step) => Ok(*step),
                other => Err(format!("unexpected answer: {other:?}")),
            },
            Via::Coordinator { client, job_id, epoch, .. } => loop {
                // The stream ends with a leader change: watch again.
                let mut watch = client.watch_job(*job_id).await.map_err(|e| e.to_string())?;
                while let Some(job) = watch.message().await.ok().flatten() {
                    let job = corral_types::Job::try_from(job).map_err(|e| e.to_string())?;
                    match job.steps.steps.iter().find(|s| s.id == step && s.epoch == *epoch) {
                        Some(s) if !s.state.is_live() => return Ok(s.clone()),
                        Some(_) => {}
                        None if job.steps.next_id > step => {
                            return Err(format!("step {job_id}.{step} is no longer kept"));
                        }
                        None => {}
                    }
                    if job.allocation.as_ref().is_none_or(|a| a.epoch != *epoch) {
                        return Err(format!("job {job_id} no longer runs: its steps ended with it"));
                    }
                }
                tokio::time::sleep(STEP_RETRY).await;
            },
        }
    }

    async fn signal(&self, step: u32, signal: i32) -> Result<(), String> {
        match self {
            Via::Node { socket, secret } => call(socket, secret, Call::SignalStep { step, signal }).await.map(|_| ()),
            Via::Coordinator { client, job_id, .. } => {
                client.signal_job_step(*job_id, step, signal).await.map(|_| ()).map_err(|e| e.to_string())
            }
        }
    }
}

/// One call to the node's in-job service.
async fn call(socket: &Path, secret: &str, call: Call) -> Result<Reply, String> {
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("cannot reach the node's worker at {}: {e}", socket.display()))?;
    let mut line = serde_json::to_vec(&Request { secret: secret.to_owned(), call }).map_err(|e| e.to_string())?;
    if line.len() as u64 >= MAX_REQUEST_BYTES {
        return Err(format!("the step is too large ({} bytes): export fewer variables", line.len()));
    }
    line.push(b'\n');
    stream.write_all(&line).await.map_err(|e| format!("cannot send to the node's worker: {e}"))?;
    let mut answer = String::new();
    BufReader::new(stream.take(16 * 1024 * 1024))
        .read_line(&mut answer)
        .await
        .map_err(|e| format!("no answer from the node's worker: {e}"))?;
    match serde_json::from_str::<Reply>(&answer) {
        Ok(Reply::Error(e)) => Err(e),
        Ok(reply) => Ok(reply),
        Err(_) if answer.is_empty() => Err("the node's worker closed the connection".into()),
        Err(e) => Err(format!("malformed answer from the node's worker: {e}")),
    }
}

fn request_id() -> String {
    let mut bytes = [0u8; 16];
    let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Creates the step, relays its output here until it ends, and returns its exit code.
async fn run(flags: Flags, via: Via, node: String, job_dir: Option<PathBuf>) -> Result<i32, String> {
    // Caught from the start: a signal that comes while the step is being made is forwarded to
    // its tasks once it exists (the tasks may run before the create's answer arrives).
    let mut sigint =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(|e| e.to_string())?;
    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(|e| e.to_string())?;
    // As Slurm's srun, a step whose GPUs other steps hold waits for them.
    let mut said_waiting = false;
    let step = loop {
        match via.create(&flags.spec).await {
            Ok(step) => break step,
            Err(e) if e.contains(STEP_BUSY) => {
                if !said_waiting {
                    say!("srun: step creation temporarily disabled, retrying ({e})");
                    said_waiting = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(STEP_RETRY) => {}
                    _ = sigint.recv() => return Ok(128 + libc::SIGINT),
                    _ = sigterm.recv() => return Ok(128 + libc::SIGTERM),
                }
            }
            Err(e) => return Err(e),
        }
    };
    if said_waiting {
        say!("srun: step created");
    }
    let mut relay = Relay::new(&step, &node, job_dir.as_deref(), flags.label, flags.unbuffered);
    if let Some(pattern) = &flags.output {
        relay.write_to_files(pattern, &step, &std::env::vars().collect());
    }
    // Other nodes' tasks: one reader each, bounded, feeding this loop.
    let (chunks, mut received) = tokio::sync::mpsc::channel::<(u32, Option<Vec<u8>>)>(64);
    let remote: Vec<u32> =
        step.nodes.iter().filter(|n| n.node != node).flat_map(|n| n.first_task..n.first_task + n.tasks).collect();
    if remote.len() > MAX_REMOTE_STREAMS {
        say!(
            "srun: relaying the output of {MAX_REMOTE_STREAMS} of the {} tasks on other nodes; the others write step-{}.<task>.out in the job's directory on their node",
            remote.len(),
            step.id
        );
    }
    let mut remote_open = 0;
    for &task in remote.iter().take(MAX_REMOTE_STREAMS) {
        tokio::spawn(read_remote(via.clone(), step.id, task, chunks.clone()));
        remote_open += 1;
    }
    drop(chunks);
    let mut wait = Box::pin(via.wait(step.id));
    let ended = loop {
        tokio::select! {
            answer = &mut wait => break answer?,
            _ = tokio::time::sleep(OUTPUT_POLL) => relay.poll(),
            Some((task, data)) = received.recv() => match data {
                Some(data) => relay.emit(task, &data),
                None => remote_open -= 1,
            },
            _ = sigint.recv() => forward(&via, step.id, libc::SIGINT).await,
            _ = sigterm.recv() => forward(&via, step.id, libc::SIGTERM).await,
        }
    };
    relay.poll();
    // Each node marked its tasks gone before reporting them, so the readers end after the last
    // of their output; the bound is for a node that cannot be reached any more.
    let drain = tokio::time::Instant::now() + REMOTE_DRAIN;
    while remote_open > 0 {
        match tokio::time::timeout_at(drain, received.recv()).await {
            Ok(Some((task, Some(data)))) => relay.emit(task, &data),
            Ok(Some((_, None))) => remote_open -= 1,
            Ok(None) => break,
            Err(_) => {
                say!("srun: the output of {remote_open} tasks on other nodes did not all arrive");
                break;
            }
        }
    }
    relay.finish();
    let failures = failed_tasks(&ended);
    for line in &failures {
        say!("srun: error: {line}");
    }
    if let Some(reason) = ended.reason.as_deref().filter(|_| ended.exit_code != Some(0) && failures.is_empty()) {
        say!("srun: step {}: {reason}", ended.id);
    }
    Ok(ended.exit_code.unwrap_or(1))
}

/// Most failed tasks named one a line when a step ends; the rest are counted.
const MAX_FAILURE_LINES: usize = 16;

/// What went wrong in an ended step, as Slurm's srun says it: a node whose tasks could not
/// start, each task that exited non-zero or was killed (at most `MAX_FAILURE_LINES` lines).
fn failed_tasks(step: &JobStep) -> Vec<String> {
    let mut lines = Vec::new();
    let mut more = 0;
    for node in &step.ended {
        let mut said = |line: String| {
            if lines.len() < MAX_FAILURE_LINES {
                lines.push(line);
            } else {
                more += 1;
            }
        };
        if let Some(error) = &node.launch_error {
            said(format!("{}: launch failed: {error}", node.node));
        }
        for task in &node.tasks {
            match (task.exit_code, task.signal) {
                (Some(0), _) => {}
                (Some(code), _) => said(format!("{}: task {}: Exited with exit code {code}", node.node, task.task)),
                (None, Some(signal)) => said(format!("{}: task {}: Killed by signal {signal}", node.node, task.task)),
                (None, None) => said(format!("{}: task {}: ended without a status", node.node, task.task)),
            }
        }
    }
    if more > 0 {
        lines.push(format!("and {more} more failed tasks"));
    }
    lines
}

/// Reads task `task`'s output on another node (through the in-job service, or the
/// coordinator in a session) into `chunks`, then says it ended (`None`).
async fn read_remote(via: Via, step: u32, task: u32, chunks: tokio::sync::mpsc::Sender<(u32, Option<Vec<u8>>)>) {
    let read = match &via {
        Via::Node { socket, secret } => stream_remote(socket, secret, step, task, &chunks).await,
        Via::Coordinator { client, job_id, .. } => stream_session(client, *job_id, step, task, &chunks).await,
    };
    if let Err(e) = read {
        say!("srun: output of task {task}: {e}");
    }
    let _ = chunks.send((task, None)).await;
}

async fn stream_session(
    client: &corral_client::Client,
    job_id: u64,
    step: u32,
    task: u32,
    chunks: &tokio::sync::mpsc::Sender<(u32, Option<Vec<u8>>)>,
) -> Result<(), String> {
    let mut stream = client.read_job_step_output(job_id, step, task).await.map_err(|e| e.to_string())?;
    while let Some(chunk) = stream.message().await.map_err(|e| e.message().to_owned())? {
        if chunks.send((task, Some(chunk.data))).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

async fn stream_remote(
    socket: &Path,
    secret: &str,
    step: u32,
    task: u32,
    chunks: &tokio::sync::mpsc::Sender<(u32, Option<Vec<u8>>)>,
) -> Result<(), String> {
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("cannot reach the node's worker at {}: {e}", socket.display()))?;
    let mut line = serde_json::to_vec(&Request { secret: secret.to_owned(), call: Call::ReadOutput { step, task } })
        .map_err(|e| e.to_string())?;
    line.push(b'\n');
    stream.write_all(&line).await.map_err(|e| format!("cannot send to the node's worker: {e}"))?;
    let mut reader = BufReader::new(stream);
    let mut answer = String::new();
    (&mut reader).take(64 * 1024).read_line(&mut answer).await.map_err(|e| format!("no answer: {e}"))?;
    match serde_json::from_str::<Reply>(&answer) {
        Ok(Reply::Streaming) => {}
        Ok(Reply::Error(e)) => return Err(e),
        Ok(other) => return Err(format!("unexpected answer: {other:?}")),
        Err(_) if answer.is_empty() => return Err("the node's worker closed the connection".into()),
        Err(e) => return Err(format!("malformed answer from the node's worker: {e}")),
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf).await.map_err(|e| format!("reading: {e}"))?;
        if n == 0 {
            return Ok(());
        }
        if chunks.send((task, Some(buf[..n].to_vec()))).await.is_err() {
            return Ok(());
        }
    }
}

async fn forward(via: &Via, step: u32, signal: i32) {
    if let Err(e) = via.signal(step, signal).await {
        say!("srun: cannot forward signal {signal}: {e}");
    }
}

/// Writes the step's tasks' output to stdout (or the `-o` files): this node's read from their
/// files, the others' as they come; with `--label` each line prefixed by its task's rank.
struct Relay {
    /// (task, file, bytes read) of this node's tasks
    files: Vec<(u32, PathBuf, u64)>,
    /// Each task's unfinished line.
    partial: BTreeMap<u32, Vec<u8>>,
    label: bool,
    unbuffered: bool,
    /// `-o`: each task's file (several tasks may share one), opened once each.
    outputs: BTreeMap<u32, PathBuf>,
    open: BTreeMap<PathBuf, std::fs::File>,
}

/// srun's `-o PATTERN` for task `task` of step `step` on node `node` (its index `node_index`),
/// relative to srun's directory: Slurm's patterns as the worker expands a job's
/// (`corral_types::expand_output_pattern`), for the job the batch environment `env` names
/// (`SLURM_JOB_ID`, `SLURM_JOB_NAME`, `SLURM_JOB_USER` else `USER`, the array's ids).
fn output_file(
    pattern: &str,
    step: u32,
    task: u32,
    node: &str,
    node_index: usize,
    env: &BTreeMap<String, String>,
) -> PathBuf {
    let number = |k: &str| env.get(k).and_then(|v| v.parse().ok());
    let spec = corral_types::JobSpec {
        name: env.get("SLURM_JOB_NAME").cloned().unwrap_or_default(),
        slurm: corral_types::SlurmNames {
            user: env.get("SLURM_JOB_USER").or(env.get("USER")).cloned(),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut job = Job::pending(number("SLURM_JOB_ID").unwrap_or(0), spec, String::new(), Default::default());
    if let (Some(array), Some(index)) = (number("SLURM_ARRAY_JOB_ID"), number("SLURM_ARRAY_TASK_ID")) {
        job.array_task = Some(corral_types::ArrayTask { array, index: index as u32 });
    }
    let step = step.to_string();
    let place = corral_types::OutputPlace { node, node_index: node_index as u32, task, step: Some(&step) };
    PathBuf::from(corral_types::expand_output_pattern(pattern, &job, &place))
}

impl Relay {
    fn new(step: &JobStep, node: &str, job_dir: Option<&Path>, label: bool, unbuffered: bool) -> Relay {
        let mut files = Vec::new();
        if let (Some(here), Some(dir)) = (step.on_node(node), job_dir) {
            for task in here.first_task..here.first_task + here.tasks {
                files.push((task, dir.join(format!("step-{}.{task}.out", step.id)), 0));
            }
        }
        Relay { files, partial: BTreeMap::new(), label, unbuffered, outputs: BTreeMap::new(), open: BTreeMap::new() }
    }

    /// `-o PATTERN`: every task's output to its file, each created (emptied) now, as Slurm's
    /// srun creates them whether the task writes or not. A file that cannot be made is said
    /// once, and that task's output stays on srun's own.
    fn write_to_files(&mut self, pattern: &str, step: &JobStep, env: &BTreeMap<String, String>) {
        for (index, node) in step.nodes.iter().enumerate() {
            for task in node.first_task..node.first_task + node.tasks {
                let path = output_file(pattern, step.id, task, &node.node, index, env);
                if !self.open.contains_key(&path) {
                    match std::fs::File::create(&path) {
                        Ok(file) => {
                            self.open.insert(path.clone(), file);
                        }
                        Err(e) => {
                            say!("srun: error: cannot open output file {}: {e}", path.display());
                            continue;
                        }
                    }
                }
                self.outputs.insert(task, path);
            }
        }
    }

    /// Where task `task`'s output goes.
    fn sink(&mut self, task: u32) -> Box<dyn Write + '_> {
        match self.outputs.get(&task).and_then(|path| self.open.get_mut(path)) {
            Some(file) => Box::new(file),
            None => Box::new(std::io::stdout().lock()),
        }
    }

    /// Relays what this node's tasks wrote since the last poll.
    fn poll(&mut self) {
        let mut read = Vec::new();
        for (task, path, offset) in &mut self.files {
            let Ok(mut file) = std::fs::File::open(&*path) else { continue };
            use std::io::{Read, Seek, SeekFrom};
            if file.seek(SeekFrom::Start(*offset)).is_err() {
                continue;
            }
            let mut data = Vec::new();
            if file.take(1 << 20).read_to_end(&mut data).is_err() || data.is_empty() {
                continue;
            }
            *offset += data.len() as u64;
            read.push((*task, data));
        }
        for (task, data) in read {
            self.emit(task, &data);
        }
    }

    /// Writes `data` of task `task` a whole line at a time, as Slurm's srun does (tasks' lines
    /// never cut into each other), labelled with `--label`; a line longer than `MAX_LINE` is
    /// written in pieces.
    fn emit(&mut self, task: u32, data: &[u8]) {
        let label = self.label;
        if self.unbuffered && !label {
            let mut out = self.sink(task);
            let _ = out.write_all(data);
            let _ = out.flush();
            return;
        }
        let mut partial = std::mem::take(self.partial.entry(task).or_default());
        partial.extend_from_slice(data);
        {
            let mut out = self.sink(task);
            loop {
                let end = match partial.iter().position(|b| *b == b'\n') {
                    Some(end) => end + 1,
                    None if partial.len() > MAX_LINE => MAX_LINE,
                    None => break,
                };
                let line: Vec<u8> = partial.drain(..end).collect();
                if label {
                    let _ = write!(out, "{task}: ");
                }
                let _ = out.write_all(&line);
            }
            let _ = out.flush();
        }
        self.partial.insert(task, partial);
    }

    /// Writes each task's unfinished last line (labelled ones ended with a newline).
    fn finish(&mut self) {
        let label = self.label;
        for (task, partial) in std::mem::take(&mut self.partial) {
            if !partial.is_empty() {
                let mut out = self.sink(task);
                if label {
                    let _ = write!(out, "{task}: ");
                }
                let _ = out.write_all(&partial);
                if label {
                    let _ = out.write_all(b"\n");
                }
                let _ = out.flush();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn flags_as_slurm_reads_them() {
        let env = BTreeMap::from([
            ("SLURM_NTASKS".to_owned(), "4".to_owned()),
            ("CUDA_VISIBLE_DEVICES".to_owned(), "0,1".to_owned()),
            ("MY_VAR".to_owned(), "x".to_owned()),
        ]);
        let f = parse(&args("-n4 --ntasks-per-node=2 -l -K --gpus-per-task 1 python train.py -n 3"), &env).unwrap();
        assert_eq!(f.spec.ntasks, Some(4));
        assert_eq!(f.spec.ntasks_per_node, Some(2));
        assert_eq!(f.spec.gpus_per_task, Some(1));
        assert!(f.label && f.spec.kill_on_bad_exit);
        assert_eq!(f.spec.command, args("python train.py -n 3"), "flags after the command are the command's");
        assert_eq!(f.spec.env.get("MY_VAR").map(String::as_str), Some("x"));
        assert!(!f.spec.env.contains_key("CUDA_VISIBLE_DEVICES"), "a node's own variables never travel");
        let d = parse(&args("hostname"), &env).unwrap();
        assert_eq!(d.spec.ntasks, Some(4), "no layout flags: the batch environment's counts");
        assert_eq!(d.spec.gpus_per_task, None);
        let mut bound = env.clone();
        bound.insert("SLURM_GPUS_PER_TASK".to_owned(), "1".to_owned());
        let b = parse(&args("hostname"), &bound).unwrap();
        assert_eq!(b.spec.gpus_per_task, Some(1), "the job's --gpus-per-task binds its steps' tasks");
        let n = parse(&args("-N 1 hostname"), &env).unwrap();
        assert_eq!((n.spec.nodes, n.spec.ntasks), (Some(1), None));
        let none = parse(&args("--export=NONE,A=1 true"), &env).unwrap();
        let marked = BTreeMap::from([
            ("A".to_owned(), "1".to_owned()),
            (corral_worker::in_job::EXPORT_NONE.to_owned(), "1".to_owned()),
        ]);
        assert_eq!(none.spec.env, marked, "what was named, and NONE for the worker");
        let w = parse(&args("-w n[1-2] true"), &env).unwrap();
        assert_eq!(w.spec.nodelist, ["n1", "n2"]);
    }

    /// Options of published scripts that change nothing here are accepted with a warning;
    /// -K takes Slurm's optional 0 or 1.
    #[test]
    fn slurm_options_without_effect_here_are_accepted() {
        let env = BTreeMap::new();
        let f = parse(&args("-u --cpu-bind=none --mpi pmix --exclusive -K1 python train.py"), &env).unwrap();
        assert_eq!(f.ignored, ["--cpu-bind", "--mpi", "--exclusive"]);
        assert!(f.unbuffered);
        assert!(f.spec.kill_on_bad_exit);
        assert_eq!(f.spec.command, args("python train.py"), "--mpi took its value");
        let off = parse(&args("--kill-on-bad-exit=0 true"), &env).unwrap();
        assert!(!off.spec.kill_on_bad_exit);
        let on = parse(&args("--kill-on-bad-exit true"), &env).unwrap();
        assert!(on.spec.kill_on_bad_exit && on.spec.command == ["true"], "no value taken from the command");
        let mila = parse(&args("--gres-flags=allow-task-sharing --exact uv run python main.py"), &env).unwrap();
        assert_eq!(mila.ignored, ["--gres-flags", "--exact"]);
        assert_eq!(mila.spec.command, args("uv run python main.py"));
        let pty = parse(&args("--pty bash -i"), &env).unwrap();
        assert!(pty.pty && pty.spec.command == args("bash -i"), "--pty takes no value: {pty:?}");
    }

    /// A one-task step's `--gpus`/`--gres` bind its GPUs as `--gpus-per-task` does; over
    /// several tasks `--gpus` is the step's total and `--gres`/`--gpus-per-node` each node's.
    #[test]
    fn a_one_task_steps_gpus_are_its_own() {
        let env = BTreeMap::from([("SLURM_NTASKS".to_owned(), "4".to_owned())]);
        for flag in ["--gpus=1", "-G 1", "--gpus=a100:1", "--gres=gpu:1", "--gres=gpu:a100:1", "--gres=gpu"] {
            let f = parse(&args(&format!("--exclusive -n1 {flag} python x.py")), &env).unwrap();
            assert_eq!(f.spec.gpus_per_task, Some(1), "{flag}");
            assert_eq!(f.ignored, ["--exclusive"], "{flag}");
        }
        let two = parse(&args("-n1 --gpus=2 true"), &env).unwrap();
        assert_eq!(two.spec.gpus_per_task, Some(2));
        let many = parse(&args("--gpus=4 python x.py"), &env).unwrap();
        assert_eq!((many.spec.gpus_per_task, many.spec.gpus, many.ignored.len()), (None, Some(4), 0));
        let each = parse(&args("--gres=gpu:2 python x.py"), &env).unwrap();
        assert_eq!((each.spec.gpus, each.spec.gpus_per_node), (None, Some(2)));
        let per_node = parse(&args("--gpus-per-node=a100:1 python x.py"), &env).unwrap();
        assert_eq!(per_node.spec.gpus_per_node, Some(1));
        let bound = parse(&args("--gpus-per-task=1 --gpus=4 python x.py"), &env).unwrap();
        assert_eq!(
            (bound.spec.gpus_per_task, bound.spec.gpus, bound.ignored.as_slice()),
            (Some(1), None, &["--gpus".to_owned()][..])
        );
        // --wait: seconds after the first task ends; 0 is no limit.
        let wait = parse(&args("--wait=60 --kill-on-bad-exit=1 true"), &env).unwrap();
        assert_eq!((wait.spec.wait_secs, wait.ignored.len()), (Some(60), 0));
        assert_eq!(parse(&args("-W 0 true"), &env).unwrap().spec.wait_secs, None);
        assert!(parse(&args("--wait=soon true"), &env).unwrap_err().contains("--wait takes a number"));
        let nvme = parse(&args("-n1 --gres=nvme:1 true"), &env).unwrap();
        assert_eq!((nvme.spec.gpus_per_task, nvme.ignored.as_slice()), (None, &["--gres".to_owned()][..]));
    }

    /// getopt_long's abbreviations as Slurm reads them; `--jobid` of the job itself is a step
    /// of it, another job's is refused.
    #[test]
    fn abbreviations_and_the_own_jobid() {
        let env = BTreeMap::from([("SLURM_JOB_ID".to_owned(), "14".to_owned())]);
        let f = parse(&args("--ntasks-per-n=2 --kill-on=1 --jobid 14 --lab true"), &env).unwrap();
        assert_eq!(f.spec.ntasks_per_node, Some(2));
        assert!(f.spec.kill_on_bad_exit && f.label);
        assert!(f.ignored.is_empty(), "{:?}", f.ignored);
        let other = parse(&args("--jobid=15 true"), &env).unwrap_err();
        assert!(other.contains("own job"), "{other}");
        let ambiguous = parse(&args("--ntasks-per=2 true"), &env).unwrap_err();
        assert!(ambiguous.contains("--ntasks-per is not an option of srun"), "{ambiguous}");
    }

    /// Each failed task a line, as Slurm's srun writes them; a node that could not start its
    /// tasks says why.
    #[test]
    fn an_ended_step_names_its_failed_tasks() {
        use corral_types::{StepNodeEnd, TaskExit};
        let step = JobStep {
            ended: vec![
                StepNodeEnd {
                    node: "n2".into(),
                    tasks: vec![
                        TaskExit { task: 2, exit_code: None, signal: Some(15) },
                        TaskExit { task: 3, exit_code: Some(3), signal: None },
                    ],
                    launch_error: None,
                },
                StepNodeEnd {
                    node: "n1".into(),
                    tasks: vec![TaskExit { task: 0, exit_code: Some(0), signal: None }],
                    launch_error: None,
                },
                StepNodeEnd { node: "n3".into(), tasks: vec![], launch_error: Some("task 4: not found".into()) },
            ],
            ..Default::default()
        };
        assert_eq!(
            failed_tasks(&step),
            [
                "n2: task 2: Killed by signal 15",
                "n2: task 3: Exited with exit code 3",
                "n3: launch failed: task 4: not found"
            ]
        );
        let many = JobStep {
            ended: vec![StepNodeEnd {
                node: "n1".into(),
                tasks: (0..20).map(|task| TaskExit { task, exit_code: Some(1), signal: None }).collect(),
                launch_error: None,
            }],
            ..Default::default()
        };
        let lines = failed_tasks(&many);
        assert_eq!(lines.len(), MAX_FAILURE_LINES + 1);
        assert_eq!(lines.last().map(String::as_str), Some("and 4 more failed tasks"));
    }

    /// What published scripts pass to srun: bundled switches (`-ul`), Slurm's aliases, a typed
    /// `--gpus-per-task`, and options corral does not act on (pyxis's container options of a
    /// job that has its own environment, reservations, exclusions), each with its value, a
    /// warning each and never the command taken for a value.
    #[test]
    fn every_option_of_slurms_srun_is_read_with_its_value() {
        let env = BTreeMap::new();
        let f = parse(&args("-ul --tasks-per-node=2 --gpus-per-task=a100:1 bash -c x"), &env).unwrap();
        assert!(f.unbuffered && f.label);
        assert_eq!((f.spec.ntasks_per_node, f.spec.gpus_per_task), (Some(2), Some(1)));
        assert_eq!(f.spec.command, ["bash", "-c", "x"]);
        let line = "--container-image nvcr.io#nvidia/pytorch:24.01-py3 --container-mounts /fsx:/fsx \
                    --no-container-mount-home --reservation=maint -x n1 -C gpu80 --ntasks-per-core 1 -s \
                    --open-mode append --signal=USR1@60 python train.py";
        let f = parse(&args(line), &env).unwrap();
        assert_eq!(f.spec.command, ["python", "train.py"]);
        assert_eq!(
            f.ignored,
            [
                "--container-image",
                "--container-mounts",
                "--no-container-mount-home",
                "--reservation",
                "-x",
                "-C",
                "--ntasks-per-core",
                "-s",
                "--open-mode",
                "--signal"
            ]
        );
    }

    /// srun's `-o` patterns, as Slurm's srun names its tasks' files.
    #[test]
    fn output_patterns_name_each_tasks_file() {
        let env = BTreeMap::from([
            ("SLURM_JOB_ID".to_owned(), "12".to_owned()),
            ("SLURM_JOB_NAME".to_owned(), "train".to_owned()),
            ("USER".to_owned(), "ana".to_owned()),
        ]);
        let file = |pattern: &str, env: &BTreeMap<String, String>| {
            output_file(pattern, 3, 5, "gpu-02", 1, env).display().to_string()
        };
        assert_eq!(file("logs/slurm-%j_%t.out", &env), "logs/slurm-12_5.out");
        assert_eq!(file("%x-%J-%s-%n-%N-%u-%A-100%%-%3t", &env), "train-12.3-3-1-gpu-02-ana-12-100%-005");
        // %a of a job that is not an array task is Slurm's NO_VAL, as for the job's own files.
        assert_eq!(file("%a", &env), "4294967294");
        let mut task = env.clone();
        task.extend([
            ("SLURM_ARRAY_JOB_ID".to_owned(), "10".to_owned()),
            ("SLURM_ARRAY_TASK_ID".to_owned(), "2".to_owned()),
        ]);
        assert_eq!(file("%A_%a", &task), "10_2");
        let f = parse(&args("-o out-%t.txt --output=x true"), &BTreeMap::new()).unwrap();
        assert_eq!((f.output.as_deref(), f.ignored.len()), (Some("x"), 0), "the last -o wins");
    }

    #[test]
    fn bad_flags_are_one_line_errors() {
        let env = BTreeMap::new();
        for (a, want) in [
            ("-n x true", "takes a number"),
            ("", "no command"),
            ("--bogus true", "--bogus is not an option of srun"),
            ("--multi-prog tasks.conf", "--multi-prog is not served"),
            ("-n", "needs a value"),
            ("-K2 true", "takes 0 or 1"),
            ("--pty=1 bash", "takes no value"),
        ] {
            let e = parse(&args(a), &env).expect_err(a);
            assert!(e.contains(want) && !e.contains('\n'), "{a}: {e}");
        }
    }
}
