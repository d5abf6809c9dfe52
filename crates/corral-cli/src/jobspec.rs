//! From job flags to a `JobSpec`: the one mapping that `submit`, `sbatch` and `run` share
//! (working directory, exported environment, Slurm-style options), and the overlay of
//! command-line flags over a script's directives.

use crate::args::JobFlags;
use anyhow::bail;
use corral_types::{
    default_output_pattern, parse_dependencies, ArraySpec, ContainerMount, ContainerOptions, GpuSlice, JobSpec,
    SchedOptions, SlurmNames, TaskLayout, MAX_ENV_BYTES, MAX_ENV_VARS,
};
use std::collections::BTreeMap;
use std::path::Path;

/// Variables of the submitting shell never exported by `--export ALL` (the default): the
/// client's credentials and endpoint, and handles to the login session. Keep `--export`'s help
/// in `args.rs` in step.
pub const EXPORT_DENY: &[&str] = &[
    "CORRAL_TOKEN",
    "CORRAL_CA",
    "CORRAL_CERT",
    "CORRAL_KEY",
    "CORRAL_ENDPOINT",
    "SSH_AUTH_SOCK",
    "SSH_AGENT_PID",
    "GPG_AGENT_INFO",
    "KRB5CCNAME",
    "XAUTHORITY",
    "DBUS_SESSION_BUS_ADDRESS",
    "VAULT_TOKEN",
    // A run's secret and its worker's socket: what acts for that run, never another job's.
    "CORRAL_RUN_SECRET",
    "CORRAL_IN_JOB_SOCKET",
];

/// Whether `key` is one of the variables a running job gets from its worker (its allocation's
/// `SLURM_*`, its node's `SLURMD_*`, corral's own): a job submitted from inside another one
/// (`sbatch` in a batch script) gets its own, not these.
fn a_jobs_own(key: &str) -> bool {
    ["CORRAL_", "SLURM_", "SLURMD_"].iter().any(|p| key.starts_with(p))
}

/// What a job is made of besides its flags.
pub struct JobInput<'a> {
    /// Program and arguments (for a batch script: the script's arguments).
    pub command: Vec<String>,
    /// Body of a batch script.
    pub script: Option<String>,
    /// Name when `--name` is absent.
    pub default_name: String,
    /// The directory of the submit (absolute).
    pub cwd: &'a Path,
    /// The submitting shell's environment.
    pub environment: Vec<(String, String)>,
    /// The host of the submit (empty: unknown).
    pub host: String,
}

impl JobFlags {
    /// These flags, with what they leave unset taken from `under` (e.g. a script's directives:
    /// command-line flags win). Lists are joined, `under`'s first.
    pub fn over(self, under: JobFlags) -> JobFlags {
        let mut env = under.env;
        env.extend(self.env);
        let mut constraint = under.constraint;
        constraint.extend(self.constraint);
        let mut container_mounts = under.container_mounts;
        container_mounts.extend(self.container_mounts);
        let mut container_env = under.container_env;
        container_env.extend(self.container_env);
        JobFlags {
            tenant: self.tenant.or(under.tenant),
            priority: self.priority.or(under.priority),
            account: self.account.or(under.account),
            qos: self.qos.or(under.qos),
            gpus: self.gpus.or(under.gpus),
            gpu_slice: self.gpu_slice.or(under.gpu_slice),
            cpus: self.cpus.or(under.cpus),
            mem: self.mem.or(under.mem),
            time: self.time.or(under.time),
            name: self.name.or(under.name),
            image: self.image.or(under.image),
            container_mounts,
            container_workdir: self.container_workdir.or(under.container_workdir),
            container_env,
            gpus_per_node: self.gpus_per_node.or(under.gpus_per_node),
            rdma: self.rdma || under.rdma,
            no_requeue: self.no_requeue || under.no_requeue,
            signal: self.signal.or(under.signal),
            env,
            chdir: self.chdir.or(under.chdir),
            export: self.export.or(under.export),
            stdout: self.stdout.or(under.stdout),
            stderr: self.stderr.or(under.stderr),
            array: self.array.or(under.array),
            dependency: self.dependency.or(under.dependency),
            partition: self.partition.or(under.partition),
            constraint,
            hold: self.hold || under.hold,
            max_restarts: self.max_restarts.or(under.max_restarts),
            nodes: self.nodes.or(under.nodes),
            ntasks: self.ntasks.or(under.ntasks),
            ntasks_per_node: self.ntasks_per_node.or(under.ntasks_per_node),
            ntasks_per_gpu: self.ntasks_per_gpu.or(under.ntasks_per_gpu),
            cpus_per_task: self.cpus_per_task.or(under.cpus_per_task),
            gpus_per_task: self.gpus_per_task.or(under.gpus_per_task),
            cpus_per_gpu: self.cpus_per_gpu.or(under.cpus_per_gpu),
            mem_per_cpu: self.mem_per_cpu.or(under.mem_per_cpu),
            mem_per_gpu: self.mem_per_gpu.or(under.mem_per_gpu),
            exclusive: self.exclusive || under.exclusive,
            gpu_type: self.gpu_type.or(under.gpu_type),
            open_mode: self.open_mode.or(under.open_mode),
        }
    }
}

/// The job spec the flags describe, and the warnings to print (variables not exported).
pub fn job_spec(flags: JobFlags, input: JobInput<'_>) -> anyhow::Result<(JobSpec, Vec<String>)> {
    if input.command.is_empty() && input.script.is_none() {
        bail!("empty command: give the program to run after `--`, e.g. `corral submit --gpus 1 -- python train.py`");
    }
    let gpu_slice = flags.gpu_slice.as_deref().map(GpuSlice::parse).transpose()?;
    let shape = allocation_shape(&flags)?;
    let layout = shape.layout;
    let image = flags.image;
    let mut container = ContainerOptions { workdir: flags.container_workdir.clone(), ..ContainerOptions::default() };
    for list in &flags.container_mounts {
        container.mounts.extend(ContainerMount::parse_list(list).map_err(anyhow::Error::msg)?);
    }
    for name in &flags.container_env {
        let name = name.trim();
        if !name.is_empty() && !container.env.iter().any(|n| n == name) {
            container.env.push(name.to_string());
        }
    }
    if image.is_none() && !container.is_default() {
        bail!("--container-mounts, --container-workdir and --container-env need --image (--container-image)");
    }
    if image.is_some() && flags.chdir.is_some() {
        bail!("--chdir is not supported with --image yet: the container starts in its own directory");
    }
    let workdir = match (&flags.chdir, &image) {
        (Some(dir), _) => Some(input.cwd.join(dir)),
        (None, Some(_)) => None,
        (None, None) => Some(input.cwd.to_path_buf()),
    };
    let workdir = workdir
        .map(|d| d.to_str().map(str::to_owned).ok_or_else(|| anyhow::anyhow!("--chdir {} is not UTF-8", d.display())))
        .transpose()?;
    let export = flags.export.clone().unwrap_or_else(|| if image.is_some() { "NONE" } else { "ALL" }.into());
    let user = input.environment.iter().find(|(k, _)| k == "USER" || k == "LOGNAME").map(|(_, v)| v.clone());
    let slurm = SlurmNames {
        account: flags.account.clone(),
        qos: flags.qos.clone(),
        partition: flags.partition.clone(),
        submit_dir: input.cwd.to_str().map(str::to_owned),
        submit_host: (!input.host.is_empty()).then(|| input.host.clone()),
        user,
    };
    let mut explicit: BTreeMap<String, String> = flags.env.into_iter().collect();
    let mut unset = Vec::new();
    // `--container-env`: these variables of the submitting shell, whatever --export says.
    for name in &container.env {
        match input.environment.iter().find(|(k, _)| k == name) {
            Some((k, v)) => {
                explicit.entry(k.clone()).or_insert_with(|| v.clone());
            }
            None => unset.push(format!("--container-env {name}: not set in this shell, the image's value stays")),
        }
    }
    let array = flags.array.as_deref().map(ArraySpec::parse).transpose()?;
    // What Slurm's sbatch sets for every task of an array (the same for each of them).
    for (key, value) in array.as_ref().map(array_env).unwrap_or_default() {
        explicit.insert(key.to_string(), value);
    }
    let (env, mut warnings) = exported_environment(&export, input.environment, explicit)?;
    warnings.extend(unset);
    let (stdout_pattern, stderr_pattern) = (flags.stdout, flags.stderr);
    let (dependencies, singleton) = match flags.dependency.as_deref() {
        Some(spec) => parse_dependencies(spec)?,
        None => (Vec::new(), false),
    };
    let mut node_selector = Vec::new();
    if let Some(p) = flags.partition {
        if p.is_empty() || p.contains(['=', ',']) {
            bail!("invalid --partition '{p}': expected a partition name such as gpu");
        }
        node_selector.push(format!("partition={p}"));
    }
    for term in flags.constraint {
        let term = term.trim();
        if term.is_empty() || term.starts_with('=') || term.contains([' ', '|', '&', '[', ']', '*', '!']) {
            bail!("invalid --constraint '{term}': expected labels key=value or a label name, comma-separated");
        }
        node_selector.push(term.to_string());
    }
    let name = flags.name.unwrap_or(input.default_name);
    let batch = input.script.is_some();
    let in_image = image.is_some();
    let spec = JobSpec {
        name,
        // Empty: the coordinator fills in the token's tenant (or `default`).
        tenant: flags.tenant.unwrap_or_default(),
        priority_class: flags.priority.unwrap_or_default(),
        gpus: shape.gpus,
        gpu_slice,
        cpu_millis: shape.cpu_millis,
        memory_bytes: shape.memory_bytes,
        // 0 is no limit, as in Slurm.
        time_limit_secs: flags.time.filter(|t| !t.is_zero()).map(|t| t.as_secs().max(1)),
        image,
        command: input.command.into(),
        env: env.into(),
        sched: SchedOptions {
            gpus_per_node: shape.gpus_per_node,
            rdma: flags.rdma,
            no_requeue: flags.no_requeue,
            checkpoint_signal: flags.signal.map(|s| s.signal),
            signal_before_end_secs: flags
                .signal
                .and_then(|s| s.before_end)
                .map(|d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX)),
            dependencies,
            singleton,
            max_restarts: flags.max_restarts,
            node_selector,
            hold: flags.hold,
        },
        workdir,
        // A batch script is Slurm's batch step: it runs once, on the first node.
        batch_step: batch,
        script: input.script.map(Into::into),
        // Slurm writes a batch job's output to slurm-%j.out (slurm-%A_%a.out for an array) in
        // its working directory unless told otherwise.
        // (An --image job's output is in its logs only.)
        stdout_path: stdout_pattern
            .or_else(|| (batch && !in_image).then(|| default_output_pattern(array.is_some()).to_string())),
        stderr_path: stderr_pattern,
        array,
        layout,
        slurm,
        append_output: flags.open_mode.as_deref() == Some("append"),
        // The coordinator pins the image's tag at submit.
        image_digest: None,
        container,
        // `corral alloc` makes its job a session.
        session: None,
    };
    let mut checked = spec.clone();
    if checked.tenant.is_empty() {
        checked.tenant = "default".into();
    }
    checked.validate()?;
    Ok((spec, warnings))
}

/// What the allocation flags come to: Slurm's layout, and the per-node amounts placement and
/// the cgroup read.
#[derive(Debug, PartialEq)]
struct Shape {
    layout: TaskLayout,
    /// Whole GPUs over all nodes.
    gpus: u32,
    /// Set for an allocation across nodes with GPUs (and when given).
    gpus_per_node: Option<u32>,
    /// CPU of each node in milli-CPUs (0: no limit).
    cpu_millis: u32,
    /// Memory of each node in bytes (0: no limit).
    memory_bytes: u64,
}

/// Reads the allocation flags with Slurm's meaning: `--gpus-per-node` (and `--gres`) count on
/// each node, `--gpus` over the job, `--gpus-per-task` for each task; `--mem` is per node and
/// `--mem-per-cpu` / `--mem-per-gpu` multiply the node's CPUs / GPUs; a task gets one CPU unless
/// `--cpus-per-task` says more. `--gpus G --gpus-per-node P` without `--nodes` stays the gang of
/// `corral submit` (G / P nodes).
fn allocation_shape(flags: &JobFlags) -> anyhow::Result<Shape> {
    for (name, value) in [
        ("--nodes", flags.nodes),
        ("--ntasks", flags.ntasks),
        ("--ntasks-per-node", flags.ntasks_per_node),
        ("--ntasks-per-gpu", flags.ntasks_per_gpu),
        ("--cpus-per-task", flags.cpus_per_task),
        ("--gpus-per-task", flags.gpus_per_task),
        ("--cpus-per-gpu", flags.cpus_per_gpu),
    ] {
        if value == Some(0) {
            bail!("invalid {name} 0: expected at least 1");
        }
    }
    for (a, a_set, b, b_set) in [
        ("--cpus", flags.cpus.is_some(), "--cpus-per-task", flags.cpus_per_task.is_some()),
        ("--cpus", flags.cpus.is_some(), "--cpus-per-gpu", flags.cpus_per_gpu.is_some()),
        ("--mem", flags.mem.is_some(), "--mem-per-cpu", flags.mem_per_cpu.is_some()),
        ("--mem", flags.mem.is_some(), "--mem-per-gpu", flags.mem_per_gpu.is_some()),
    ] {
        if a_set && b_set {
            bail!("{a} and {b} are mutually exclusive: give one of them");
        }
    }
    let (ntasks, ntasks_per_node, gpus_per_task) = tasks_per_gpu(flags)?;
    let mut layout = TaskLayout {
        nodes: 0,
        ntasks: ntasks.unwrap_or(0),
        ntasks_per_node: ntasks_per_node.unwrap_or(0),
        cpus_per_task: flags.cpus_per_task.unwrap_or(0),
        gpus_per_task: gpus_per_task.unwrap_or(0),
        cpus_per_gpu: flags.cpus_per_gpu.unwrap_or(0),
        mem_per_cpu: flags.mem_per_cpu.unwrap_or(0),
        mem_per_gpu: flags.mem_per_gpu.unwrap_or(0),
        exclusive: flags.exclusive,
        gpu_type: flags.gpu_type.clone(),
        submitted_shape: None,
    };
    layout.nodes = flags.nodes.or_else(|| layout.nodes_asked()).unwrap_or(0);
    let nodes = layout.nodes;
    // Slurm's `-n N --gpus-per-task G` alone: the tasks spread over the fewest nodes that hold
    // them, which placement chooses (`JobSpec::spreads`); until then the job states one task's
    // CPUs and memory, and all its GPUs.
    let spread = nodes == 0
        && layout.ntasks > 1
        && layout.gpus_per_task > 0
        && layout.ntasks_per_node == 0
        && flags.gpus.is_none()
        && flags.gpus_per_node.is_none();
    if spread && flags.cpus.is_some() {
        bail!("--cpus is per node, and -n with --gpus-per-task lets placement choose the nodes: give --cpus-per-task");
    }
    let (gpus, per_node) = match (flags.gpus, flags.gpus_per_node) {
        _ if spread => (layout.gpus_per_task.saturating_mul(layout.ntasks), None),
        _ if layout.gpus_per_task > 0 => {
            let on = nodes.max(1);
            let busiest = layout.tasks_on_nodes(on).into_iter().max().unwrap_or(1);
            let per_node = layout.gpus_per_task.saturating_mul(busiest);
            let total = per_node.saturating_mul(on);
            if flags.gpus.is_some_and(|g| g != total) || flags.gpus_per_node.is_some_and(|p| p != per_node) {
                bail!(
                    "--gpus-per-task {} for {} tasks means {total} GPUs ({per_node} on each of {on} nodes): \
                     leave out --gpus and --gpus-per-node, or make them agree",
                    layout.gpus_per_task,
                    layout.total_tasks(on)
                );
            }
            (total, Some(per_node))
        }
        (Some(g), Some(p)) if nodes > 0 => {
            if nodes.checked_mul(p) != Some(g) {
                bail!("--nodes {nodes} with --gpus-per-node {p} means {} gpus, but --gpus is {g}", nodes * p);
            }
            (g, Some(p))
        }
        // The gang of `corral submit`: as many nodes as the GPUs need.
        (Some(g), Some(p)) => (g, Some(p)),
        (None, Some(p)) => (p.saturating_mul(nodes.max(1)), Some(p)),
        (Some(g), None) if nodes > 1 && g > 0 => {
            if g % nodes != 0 {
                bail!("--gpus {g} does not split evenly over --nodes {nodes}: give --gpus-per-node instead");
            }
            (g, Some(g / nodes))
        }
        (Some(g), None) => (g, None),
        (None, None) => (0, None),
    };
    let on = if nodes > 0 { nodes } else { per_node.filter(|p| *p > 0).map(|p| (gpus / p).max(1)).unwrap_or(1) };
    let (gpus_here, tasks_here) = match spread {
        true => (layout.gpus_per_task, 1),
        false => (gpus.checked_div(on).unwrap_or(gpus), layout.tasks_on_nodes(on).into_iter().max().unwrap_or(1)),
    };
    let asks_tasks = ntasks.is_some() || ntasks_per_node.is_some() || flags.cpus_per_task.is_some();
    let cpus_here: u64 = if layout.cpus_per_gpu > 0 {
        u64::from(layout.cpus_per_gpu) * u64::from(gpus_here.max(1))
    } else if asks_tasks {
        u64::from(tasks_here) * u64::from(layout.cpus_of_task())
    } else {
        0
    };
    let cpu_millis = match flags.cpus {
        Some(c) if !(c.is_finite() && c > 0.0 && c <= 4096.0) => {
            bail!("invalid --cpus {c}: expected a number of cores greater than 0, e.g. 2 or 0.5")
        }
        Some(c) => (c * 1000.0).round() as u32,
        None if cpus_here > 4096 => bail!("{cpus_here} CPUs on a node: at most 4096"),
        None => (cpus_here * 1000) as u32,
    };
    let memory_bytes = if let Some(mem) = flags.mem {
        mem
    } else if layout.mem_per_cpu > 0 {
        let cpus = u64::from(cpu_millis.div_ceil(1000)).max(u64::from(tasks_here) * u64::from(layout.cpus_of_task()));
        layout.mem_per_cpu.checked_mul(cpus).ok_or_else(|| anyhow::anyhow!("--mem-per-cpu: too much memory"))?
    } else if layout.mem_per_gpu > 0 {
        if gpus_here == 0 {
            bail!("--mem-per-gpu needs GPUs: give --gpus, --gpus-per-node or --gpus-per-task");
        }
        layout
            .mem_per_gpu
            .checked_mul(u64::from(gpus_here))
            .ok_or_else(|| anyhow::anyhow!("--mem-per-gpu: too much memory"))?
    } else {
        0
    };
    Ok(Shape { layout, gpus, gpus_per_node: per_node, cpu_millis, memory_bytes })
}

/// `--ntasks`, `--ntasks-per-node` and `--gpus-per-task` with Slurm's `--ntasks-per-gpu N`
/// resolved: N tasks for each GPU of a node (`--gpus-per-node`, `--gres`) or of the job
/// (`--gpus`), each bound to its GPU when N is 1 (Slurm's implied `--gpu-bind=single:1`).
/// Without it, as given.
fn tasks_per_gpu(flags: &JobFlags) -> anyhow::Result<(Option<u32>, Option<u32>, Option<u32>)> {
    let given = (flags.ntasks, flags.ntasks_per_node, flags.gpus_per_task);
    let Some(per_gpu) = flags.ntasks_per_gpu else { return Ok(given) };
    if flags.gpus_per_task.is_some() {
        bail!("--ntasks-per-gpu and --gpus-per-task are mutually exclusive: give one of them");
    }
    let bound = (per_gpu == 1).then_some(1);
    match (flags.gpus_per_node, flags.gpus) {
        _ if flags.ntasks.is_some() || flags.ntasks_per_node.is_some() => {
            Ok((flags.ntasks, flags.ntasks_per_node, None))
        }
        (Some(node_gpus), _) if node_gpus > 0 => Ok((None, Some(node_gpus.saturating_mul(per_gpu)), bound)),
        (_, Some(gpus)) if gpus > 0 => Ok((Some(gpus.saturating_mul(per_gpu)), None, bound)),
        _ => bail!("--ntasks-per-gpu needs GPUs: give --gpus-per-node (--gres=gpu:N) or --gpus"),
    }
}

/// `SLURM_ARRAY_TASK_COUNT`, `_MIN`, `_MAX` and `_STEP` of an array: its number of tasks, its
/// lowest and highest index, and the distance between consecutive indices when it is the same
/// throughout (`0-15:4`: 4), else 1.
fn array_env(array: &ArraySpec) -> Vec<(&'static str, String)> {
    let (Some(first), Some(last)) = (array.ranges.first(), array.ranges.last()) else { return Vec::new() };
    let highest = last.first + (last.len().saturating_sub(1) as u32) * last.step;
    // Ranges are merged where evenly spaced: more than one means uneven steps.
    let step = match array.ranges.as_slice() {
        [only] if only.len() > 1 => only.step,
        _ => 1,
    };
    vec![
        ("SLURM_ARRAY_TASK_COUNT", array.len().to_string()),
        ("SLURM_ARRAY_TASK_MIN", first.first.to_string()),
        ("SLURM_ARRAY_TASK_MAX", highest.to_string()),
        ("SLURM_ARRAY_TASK_STEP", step.to_string()),
    ]
}

/// The job's environment for `--export SPEC` from the submitting shell's `environment`, with
/// `explicit` (`--env`) on top; what does not fit the spec's limits is dropped and named in one
/// warning.
pub fn exported_environment(
    spec: &str,
    environment: Vec<(String, String)>,
    explicit: BTreeMap<String, String>,
) -> anyhow::Result<(BTreeMap<String, String>, Vec<String>)> {
    let shell: BTreeMap<String, String> = environment.into_iter().collect();
    let mut all = false;
    let mut named: BTreeMap<String, String> = BTreeMap::new();
    for item in spec.split(',').map(str::trim) {
        match item {
            "ALL" => all = true,
            "NONE" => {}
            "" => bail!("invalid --export '{spec}': an empty item (expected ALL, NONE or VAR[,VAR=value...])"),
            _ => match item.split_once('=') {
                Some((key, value)) if valid_name(key) => {
                    named.insert(key.to_string(), value.to_string());
                }
                None if valid_name(item) => {
                    // Named explicitly: exported even if on the deny list; absent, nothing.
                    if let Some(value) = shell.get(item) {
                        named.insert(item.to_string(), value.clone());
                    }
                }
                _ => bail!("invalid --export item '{item}': expected a variable name or VAR=value"),
            },
        }
    }
    if spec.split(',').any(|i| i.trim() == "NONE") && spec.split(',').count() > 1 {
        bail!("invalid --export '{spec}': NONE cannot be combined with other items");
    }
    // Wanted first, then the shell's variables in name order while they fit.
    let mut env = explicit;
    for (k, v) in named {
        env.entry(k).or_insert(v);
    }
    let mut bytes: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
    let mut dropped = Vec::new();
    if all {
        let inside_a_job = shell.contains_key("CORRAL_RUN_SECRET");
        for (key, value) in shell {
            if env.contains_key(&key) || EXPORT_DENY.contains(&key.as_str()) || !valid_name(&key) {
                continue;
            }
            if inside_a_job && a_jobs_own(&key) {
                continue;
            }
            let size = key.len() + value.len();
            if env.len() >= MAX_ENV_VARS || bytes + size > MAX_ENV_BYTES {
                dropped.push(key);
                continue;
            }
            bytes += size;
            env.insert(key, value);
        }
    }
    let mut warnings = Vec::new();
    if !dropped.is_empty() {
        warnings.push(format!(
            "{} environment variables not exported (a job carries at most {MAX_ENV_VARS} variables, {} KiB): {}",
            dropped.len(),
            MAX_ENV_BYTES / 1024,
            dropped.join(", ")
        ));
    }
    Ok((env, warnings))
}

fn valid_name(key: &str) -> bool {
    !key.is_empty() && !key.contains(['=', '\0'])
}

/// The submitting shell's environment (variables that are not UTF-8 are left out).
pub fn current_environment() -> Vec<(String, String)> {
    std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::SignalSpec;
    use std::time::Duration;

    fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Slurm's `--ntasks-per-gpu`: that many tasks for each GPU of a node or of the job, one
    /// bound to each GPU when it is 1.
    #[test]
    fn tasks_per_gpu_make_the_task_count() {
        let shape = |flags: JobFlags| job_spec(flags, input(Path::new("/"))).map(|(s, _)| s);
        let per_node =
            JobFlags { nodes: Some(2), gpus_per_node: Some(4), ntasks_per_gpu: Some(1), ..Default::default() };
        let spec = shape(per_node).expect("4 tasks a node");
        assert_eq!((spec.layout.ntasks_per_node, spec.layout.gpus_per_task, spec.gpus), (4, 1, 8));
        assert_eq!(spec.tasks_on_nodes(), [4, 4]);
        let total = JobFlags { gpus: Some(2), ntasks_per_gpu: Some(2), ..Default::default() };
        let spec = shape(total).expect("2 tasks a GPU");
        assert_eq!((spec.layout.ntasks, spec.layout.gpus_per_task, spec.gpus), (4, 0, 2), "two tasks share a GPU");
        let none = shape(JobFlags { ntasks_per_gpu: Some(1), ..Default::default() }).unwrap_err().to_string();
        assert!(none.contains("--ntasks-per-gpu needs GPUs"), "{none}");
        let both = JobFlags { gpus: Some(2), ntasks_per_gpu: Some(1), gpus_per_task: Some(1), ..Default::default() };
        assert!(shape(both).unwrap_err().to_string().contains("mutually exclusive"));
    }

    /// Every task of an array sees how many there are and their lowest, highest and step, as
    /// Slurm's sbatch sets them (`--export=NONE` too).
    #[test]
    fn arrays_carry_slurms_count_min_max_and_step() {
        let get = |spec: &str| {
            let array = ArraySpec::parse(spec).expect("array");
            array_env(&array).into_iter().map(|(_, v)| v).collect::<Vec<_>>().join(" ")
        };
        assert_eq!(get("0-15:4"), "4 0 12 4");
        assert_eq!(get("1,3,5"), "3 1 5 2");
        assert_eq!(get("1-3,10"), "4 1 10 1");
        assert_eq!(get("7"), "1 7 7 1");
        let flags = JobFlags { array: Some("2-8:3%2".into()), export: Some("NONE".into()), ..Default::default() };
        let (spec, _) = job_spec(flags, input(Path::new("/"))).expect("spec");
        let env: Vec<_> = spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(
            env,
            ["SLURM_ARRAY_TASK_COUNT=3", "SLURM_ARRAY_TASK_MAX=8", "SLURM_ARRAY_TASK_MIN=2", "SLURM_ARRAY_TASK_STEP=3"]
        );
    }

    fn input(cwd: &Path) -> JobInput<'_> {
        JobInput {
            command: vec!["./train.sh".into()],
            script: None,
            default_name: "train.sh".into(),
            cwd,
            environment: vars(&[("HOME", "/home/ana"), ("CORRAL_TOKEN", "secret"), ("LR", "0.1"), ("USER", "ana")]),
            host: "login1".into(),
        }
    }

    #[test]
    fn export_all_leaves_credentials_out() {
        let (env, warnings) = exported_environment("ALL", input(Path::new("/")).environment, BTreeMap::new()).unwrap();
        assert_eq!(env.get("LR").map(String::as_str), Some("0.1"));
        assert!(!env.contains_key("CORRAL_TOKEN"));
        assert!(warnings.is_empty());
        let (env, _) = exported_environment("NONE", input(Path::new("/")).environment, BTreeMap::new()).unwrap();
        assert!(env.is_empty());
        let (env, _) =
            exported_environment("LR,X=1,MISSING", input(Path::new("/")).environment, BTreeMap::new()).unwrap();
        assert_eq!(env, vars(&[("LR", "0.1"), ("X", "1")]).into_iter().collect());
        let explicit = vars(&[("LR", "0.5")]).into_iter().collect();
        let (env, _) = exported_environment("ALL,Y=2", input(Path::new("/")).environment, explicit).unwrap();
        assert_eq!(env.get("LR").map(String::as_str), Some("0.5"), "--env wins");
        assert_eq!(env.get("Y").map(String::as_str), Some("2"));
        for bad in ["", "ALL,", "=x", "NONE,LR"] {
            assert!(exported_environment(bad, vec![], BTreeMap::new()).is_err(), "{bad}");
        }
    }

    #[test]
    fn export_drops_what_does_not_fit_with_one_warning() {
        let many: Vec<(String, String)> = (0..MAX_ENV_VARS + 5).map(|i| (format!("V{i:05}"), "x".into())).collect();
        let (env, warnings) = exported_environment("ALL", many, BTreeMap::new()).unwrap();
        assert_eq!(env.len(), MAX_ENV_VARS);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].starts_with("5 environment variables not exported"), "{}", warnings[0]);
        let big = vec![("BIG".to_string(), "v".repeat(MAX_ENV_BYTES)), ("SMALL".into(), "1".into())];
        let (env, warnings) = exported_environment("ALL", big, BTreeMap::new()).unwrap();
        assert_eq!(env.keys().collect::<Vec<_>>(), ["SMALL"]);
        assert!(warnings[0].contains("BIG"));
    }

    /// A submit from inside a job (its run secret in the shell) carries none of that job's
    /// own variables, and never a run secret.
    #[test]
    fn a_submit_from_inside_a_job_leaves_that_jobs_variables() {
        let shell = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let inside = shell(&[
            ("CORRAL_RUN_SECRET", "s3cr3t"),
            ("CORRAL_IN_JOB_SOCKET", "/var/lib/corral/in-job.sock"),
            ("CORRAL_JOB_ID", "12"),
            ("SLURM_JOB_ID", "12"),
            ("SLURM_GPUS_PER_TASK", "1"),
            ("SLURMD_NODENAME", "gpu-01"),
            ("MY_VAR", "x"),
        ]);
        let (env, _) = exported_environment("ALL", inside, BTreeMap::new()).unwrap();
        assert_eq!(env.keys().collect::<Vec<_>>(), ["MY_VAR"]);
        let (env, _) =
            exported_environment("ALL", shell(&[("SLURM_CONF", "/etc/slurm.conf")]), BTreeMap::new()).unwrap();
        assert_eq!(env.keys().collect::<Vec<_>>(), ["SLURM_CONF"], "outside a job a shell's SLURM_* are its own");
    }

    #[test]
    fn export_help_names_every_denied_variable() {
        use clap::CommandFactory;
        let mut cmd = crate::args::Cli::command();
        let help = cmd.find_subcommand_mut("submit").unwrap().render_long_help().to_string();
        for name in EXPORT_DENY {
            assert!(help.contains(name), "--export's help misses {name}");
        }
    }

    #[test]
    fn flags_map_to_the_spec() {
        let cwd = Path::new("/home/ana/exp");
        let flags = JobFlags {
            gpus_per_node: Some(4),
            nodes: Some(2),
            signal: Some(SignalSpec { signal: 10, before_end: Some(Duration::from_secs(300)) }),
            partition: Some("gpu".into()),
            constraint: vec!["a100".into(), "zone=a".into()],
            array: Some("0-9%2".into()),
            dependency: Some("afterok:3,singleton".into()),
            max_restarts: Some(2),
            hold: true,
            chdir: Some("sub".into()),
            ..Default::default()
        };
        let (spec, _) = job_spec(flags, input(cwd)).unwrap();
        assert_eq!(spec.gpus, 8);
        assert_eq!(spec.sched.gpus_per_node, Some(4));
        assert_eq!((spec.sched.checkpoint_signal, spec.sched.signal_before_end_secs), (Some(10), Some(300)));
        assert_eq!(spec.sched.node_selector, ["partition=gpu", "a100", "zone=a"]);
        assert_eq!(spec.array.unwrap().max_running, Some(2));
        assert!(spec.sched.singleton && spec.sched.hold);
        assert_eq!(spec.sched.dependencies.len(), 1);
        assert_eq!(spec.sched.max_restarts, Some(2));
        assert_eq!(spec.workdir.as_deref(), Some("/home/ana/exp/sub"));
        assert!(!spec.env.contains_key("CORRAL_TOKEN"));
        // Slurm's variables name the submit directory, not --chdir's.
        assert_eq!(spec.slurm.submit_dir.as_deref(), Some("/home/ana/exp"));
        assert_eq!((spec.slurm.submit_host.as_deref(), spec.slurm.user.as_deref()), (Some("login1"), Some("ana")));
        assert_eq!(spec.slurm.partition.as_deref(), Some("gpu"));
        let (spec, _) = job_spec(JobFlags::default(), input(cwd)).unwrap();
        assert_eq!(spec.workdir.as_deref(), Some("/home/ana/exp"), "the submit directory by default");
        let flags = JobFlags { chdir: Some("/abs".into()), ..Default::default() };
        assert_eq!(job_spec(flags, input(cwd)).unwrap().0.workdir.as_deref(), Some("/abs"));
        let flags = JobFlags { image: Some("/rootfs".into()), ..Default::default() };
        let (spec, _) = job_spec(flags, input(cwd)).unwrap();
        assert_eq!((spec.workdir, spec.env.len()), (None, 0), "--image jobs keep the old defaults");
    }

    #[test]
    fn container_flags_need_an_image_and_pass_the_named_variables() {
        let cwd = Path::new("/home/ana/exp");
        let flags = JobFlags {
            image: Some("busybox".into()),
            container_mounts: vec!["/data/set:/data:ro,/scratch".into(), "/x:/y".into()],
            container_workdir: Some("/data".into()),
            container_env: vec!["LR".into(), "MISSING".into(), "LR".into()],
            ..Default::default()
        };
        let (spec, warnings) = job_spec(flags, input(cwd)).unwrap();
        let mounts: Vec<String> = spec.container.mounts.iter().map(ToString::to_string).collect();
        assert_eq!(mounts, ["/data/set:/data:ro", "/scratch:/scratch", "/x:/y"]);
        assert_eq!(
            (spec.container.workdir.as_deref(), spec.container.env.as_slice()),
            (Some("/data"), &["LR".to_string(), "MISSING".to_string()][..])
        );
        assert_eq!(spec.env.get("LR").map(String::as_str), Some("0.1"), "exported though --image defaults to NONE");
        assert_eq!(spec.env.len(), 1);
        assert!(warnings.iter().any(|w| w.contains("--container-env MISSING")), "{warnings:?}");
        let flags = JobFlags { container_workdir: Some("/w".into()), ..Default::default() };
        assert!(job_spec(flags, input(cwd)).unwrap_err().to_string().contains("need --image"));
        let flags =
            JobFlags { image: Some("busybox".into()), container_mounts: vec!["/a:b".into()], ..Default::default() };
        assert!(job_spec(flags, input(cwd)).unwrap_err().to_string().contains("the target must be an absolute path"));
        // A batch script runs in its image; its output is in its logs, not in slurm-%j.out.
        let flags = JobFlags { image: Some("busybox".into()), ..Default::default() };
        let script = JobInput { script: Some("#!/bin/sh\necho hi\n".into()), ..input(cwd) };
        let (spec, _) = job_spec(flags, script).unwrap();
        assert_eq!((spec.stdout_path, spec.workdir, spec.batch_step), (None, None, true));
    }

    #[test]
    fn time_zero_is_no_limit_as_in_slurm() {
        let cwd = Path::new("/home/ana/exp");
        let time = |t: &str| {
            let flags = JobFlags { time: Some(crate::args::parse_duration(t).unwrap()), ..Default::default() };
            job_spec(flags, input(cwd)).unwrap().0.time_limit_secs
        };
        assert_eq!(time("0"), None);
        assert_eq!(time("0s"), None);
        assert_eq!(time("2"), Some(120), "a bare number is minutes");
        assert_eq!(time("90s"), Some(90));
    }

    #[test]
    fn bad_flags_are_refused() {
        let cwd = Path::new("/");
        for (flags, why) in [
            (JobFlags { nodes: Some(2), gpus: Some(3), ..Default::default() }, "does not split evenly"),
            (JobFlags { ntasks: Some(0), ..Default::default() }, "invalid --ntasks 0"),
            (JobFlags { mem: Some(1), mem_per_gpu: Some(1), ..Default::default() }, "mutually exclusive"),
            (JobFlags { cpus: Some(1.0), cpus_per_task: Some(1), ..Default::default() }, "mutually exclusive"),
            (JobFlags { mem_per_gpu: Some(1), ..Default::default() }, "--mem-per-gpu needs GPUs"),
            (JobFlags { nodes: Some(4), ntasks: Some(2), ..Default::default() }, "fewer than --nodes"),
            (JobFlags { gpus_per_task: Some(1), ntasks: Some(4), gpus: Some(2), ..Default::default() }, "means 4 GPUs"),
            (JobFlags { nodes: Some(2), gpus_per_node: Some(2), gpus: Some(3), ..Default::default() }, "means 4 gpus"),
            (
                JobFlags { ntasks: Some(4), gpus_per_task: Some(1), cpus: Some(2.0), ..Default::default() },
                "give --cpus-per-task",
            ),
            (JobFlags { array: Some("5-1".into()), ..Default::default() }, "invalid array"),
            (JobFlags { dependency: Some("after:1".into()), ..Default::default() }, "invalid dependency"),
            (JobFlags { constraint: vec!["a|b".into()], ..Default::default() }, "invalid --constraint"),
            (JobFlags { partition: Some("a=b".into()), ..Default::default() }, "invalid --partition"),
        ] {
            let e = job_spec(flags, input(cwd)).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn allocations_read_with_slurms_meaning() {
        let shape = |flags: JobFlags| {
            let s = allocation_shape(&flags).unwrap();
            (s.layout.nodes, s.gpus, s.gpus_per_node, s.cpu_millis, s.memory_bytes)
        };
        // --gres=gpu:4 alone: one node with 4 GPUs; with -N 2, 4 on each.
        assert_eq!(shape(JobFlags { gpus_per_node: Some(4), ..Default::default() }), (0, 4, Some(4), 0, 0));
        assert_eq!(
            shape(JobFlags { gpus_per_node: Some(4), nodes: Some(2), ..Default::default() }),
            (2, 8, Some(4), 0, 0)
        );
        // corral submit's gang: --gpus 8 --gpus-per-node 4 is two nodes.
        assert_eq!(
            shape(JobFlags { gpus: Some(8), gpus_per_node: Some(4), ..Default::default() }),
            (0, 8, Some(4), 0, 0)
        );
        // --gpus is the total, split over -N.
        assert_eq!(shape(JobFlags { gpus: Some(8), nodes: Some(2), ..Default::default() }), (2, 8, Some(4), 0, 0));
        // -N 2 without GPUs, one CPU per task by default.
        assert_eq!(shape(JobFlags { nodes: Some(2), ntasks: Some(2), ..Default::default() }), (2, 0, None, 1000, 0));
        // -n 1: one CPU, not none.
        assert_eq!(shape(JobFlags { ntasks: Some(1), ..Default::default() }), (0, 0, None, 1000, 0));
        // 2 nodes x 2 tasks x 1 GPU, 6 CPUs and 4G per CPU for each task.
        let ddp = JobFlags {
            nodes: Some(2),
            ntasks_per_node: Some(2),
            gpus_per_task: Some(1),
            cpus_per_task: Some(6),
            mem_per_cpu: Some(4 << 30),
            ..Default::default()
        };
        assert_eq!(shape(ddp), (2, 4, Some(2), 12_000, 48 << 30));
        // -n 4 --gpus-per-task 1 without -N: the tasks spread over the nodes placement chooses;
        // until then one task's CPU and memory (--mem-per-gpu times its GPU).
        let tasks =
            JobFlags { ntasks: Some(4), gpus_per_task: Some(1), mem_per_gpu: Some(10 << 30), ..Default::default() };
        assert_eq!(shape(tasks.clone()), (0, 4, None, 1000, 10 << 30));
        let (spec, _) = job_spec(tasks, input(Path::new("/"))).unwrap();
        assert!(spec.spreads());
        assert_eq!(spec.spread_shape(2), (2, 2000, 20 << 30), "two tasks on each of two nodes");
        let with_cpus =
            JobFlags { ntasks: Some(3), gpus_per_task: Some(2), cpus_per_task: Some(8), ..Default::default() };
        assert_eq!(shape(with_cpus), (0, 6, None, 8000, 0));
        // With --nodes, --ntasks-per-node or a GPU count, the nodes are the user's.
        let one_node =
            JobFlags { ntasks: Some(4), gpus_per_task: Some(1), gpus_per_node: Some(4), ..Default::default() };
        assert_eq!(shape(one_node), (0, 4, Some(4), 4000, 0));
        // -n 8 --ntasks-per-node 4: two nodes; --cpus-per-gpu counts the node's GPUs.
        let per_node = JobFlags {
            ntasks: Some(8),
            ntasks_per_node: Some(4),
            gpus_per_node: Some(4),
            cpus_per_gpu: Some(8),
            ..Default::default()
        };
        assert_eq!(shape(per_node), (2, 8, Some(4), 32_000, 0));
        let (spec, _) = job_spec(
            JobFlags {
                exclusive: true,
                gpu_type: Some("a100".into()),
                open_mode: Some("append".into()),
                ..Default::default()
            },
            input(Path::new("/")),
        )
        .unwrap();
        assert!(spec.layout.exclusive && spec.append_output);
        assert_eq!(spec.layout.gpu_type.as_deref(), Some("a100"));
    }

    #[test]
    fn command_line_flags_override_directives() {
        let directives = JobFlags { gpus: Some(2), name: Some("from-script".into()), hold: true, ..Default::default() };
        let cli = JobFlags { gpus: Some(4), ..Default::default() };
        let merged = cli.over(directives);
        assert_eq!((merged.gpus, merged.name.as_deref(), merged.hold), (Some(4), Some("from-script"), true));
    }
}
