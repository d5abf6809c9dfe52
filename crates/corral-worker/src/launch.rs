//! From an allocation to a launch: the job's GPUs as devices and environment (CUDA, MPS, MIG),
//! its user, limits and work dir. Also picks (or, with `mig.manage`, makes) the MIG instance a
//! MIG job runs on.

use crate::config::WorkerConfig;
use crate::devices::Devices;
use crate::executor::{as_fs_user, DEFAULT_PATH};
use crate::executor::{BindMount, JobFiles, LaunchSpec, ResourceLimits, CONTAINER_WORK_DIR, SCRIPT_FILE};
use crate::gang::{gang_env, PartAddrs, HOSTFILE};
use crate::gpu::{DeviceInfo, MigPlacement, MigState};
use crate::in_job_bin::{self, BASH_ENV_FILE, CONTAINER_IN_JOB_BIN};
use corral_image::{ImageConfig, JobOverrides, JobRoot};
use corral_types::{expand_output_pattern, slurm_allocation_env, GpuSlice, Job, OutputPlace, SliceAssignment};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// GPU control nodes a container with GPUs needs besides `/dev/nvidia<minor>`.
const NVIDIA_CONTROL_NODES: [&str; 4] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"];

/// What a run's registry image gives its launch: the mounted root (its pin held until it is
/// removed) and the image config.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub root: JobRoot,
    pub config: ImageConfig,
}

/// The MIG device picked for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MigPick {
    pub uuid: String,
    /// Made for this job (destroyed after it), not one the operator laid out.
    pub created: bool,
}

/// For a MIG slice on a partitioned GPU: a free existing instance of the profile, else (with
/// `mig_manage`) a new one at the scheduler's placement. Creating one is a driver call of well
/// under a second, made inline. `taken` are the instances other jobs hold.
pub(crate) fn pick_mig_instance(
    devices: &Devices,
    mig_manage: bool,
    job: &Job,
    gpus: &[u32],
    taken: &[String],
) -> Result<Option<MigPick>, String> {
    let Some(GpuSlice::Mig { profile, .. }) = &job.spec.gpu_slice else { return Ok(None) };
    let Some(&gpu) = gpus.first() else { return Ok(None) };
    let layout = devices.info().into_iter().find(|d| d.device.index == gpu).map(|d| d.mig);
    let instances = match layout {
        Some(MigState::Enabled { instances }) => instances,
        Some(MigState::Disabled) if mig_manage => {
            return Err(format!(
                "MIG mode is off on gpu {gpu}: enable it with `nvidia-smi -i {gpu} -mig 1` (this resets the GPU, which corral never does by itself)"
            ))
        }
        // Simulated without MIG, or MIG off: nothing to pick; the job sees the whole device.
        _ => return Ok(None),
    };
    if let Some(free) =
        instances.iter().find(|i| i.profile.as_deref() == Some(profile.as_str()) && !taken.contains(&i.uuid))
    {
        return Ok(Some(MigPick { uuid: free.uuid.clone(), created: false }));
    }
    if !mig_manage {
        return Err(format!(
            "no free MIG instance of profile {profile} on gpu {gpu}: create one (nvidia-smi mig -cgi {profile} -C), free one, or set mig.manage = true in the worker config"
        ));
    }
    let placement = match job.allocation.as_ref().and_then(|a| a.slice.as_ref()) {
        Some(SliceAssignment::Mig { start, memory_slices, .. }) => {
            Some(MigPlacement { start: *start, size: *memory_slices })
        }
        _ => None,
    };
    let created = devices.create_mig_instance(gpu, profile, placement).map_err(|e| e.to_string())?;
    Ok(Some(MigPick { uuid: created.uuid, created: true }))
}

/// What holds a batch job's part on a node other than its first: it waits, doing nothing, until
/// the job's end stops it with the part's cgroup. (An image job runs it in its container, where
/// the steps' tasks then run too.)
const HOLD_ARGV: [&str; 3] = ["/bin/sh", "-c", "exec sleep 2147483647"];

/// True when this node's part of `job` runs none of its script: a batch job's script (Slurm's
/// batch step) runs once, on the allocation's first node; the other nodes only hold their part
/// for the steps `srun` starts there.
pub(crate) fn holds_allocation_only(job: &Job, node: &str) -> bool {
    job.runs_batch_once() && job.allocation.as_ref().is_some_and(|a| a.is_gang() && a.node != node)
}

/// What the executor runs for allocation `epoch` of `job` on this node's `gpus`.
#[allow(clippy::too_many_arguments)] // the run, where it runs, and its image
pub(crate) fn launch_spec(
    config: &WorkerConfig,
    devices: &Devices,
    job: &Job,
    epoch: u64,
    gpus: &[u32],
    mig_uuid: Option<&str>,
    addrs: &PartAddrs,
    image: Option<&Prepared>,
) -> Result<LaunchSpec, String> {
    if image.is_none() {
        check_rootfs_image(job)?;
    }
    let user = config.users.resolve(&job.spec.tenant)?;
    let info = devices.info();
    let job_devices: Vec<&DeviceInfo> =
        gpus.iter().filter_map(|i| info.iter().find(|d| d.device.index == *i)).collect();
    let uuids: Vec<String> = job_devices.iter().map(|d| d.device.uuid.clone()).collect();
    let in_container = job.spec.image.is_some();
    let mut env = (*job.spec.env).clone();
    let ids: Vec<String> = match (mig_uuid, in_container) {
        (Some(mig), _) => vec![mig.to_owned()],
        // A container only has its own GPUs' nodes: CUDA numbers them from 0.
        (None, true) => (0..gpus.len()).map(|i| i.to_string()).collect(),
        (None, false) => gpus.iter().map(u32::to_string).collect(),
    };
    env.insert("CUDA_VISIBLE_DEVICES".into(), ids.join(","));
    // NVML and CUDA agree on indices only in PCI order.
    env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
    env.insert("NVIDIA_VISIBLE_DEVICES".into(), if uuids.is_empty() { "void".into() } else { uuids.join(",") });
    let mut binds = Vec::new();
    // The share the scheduler assigned (it fills in a memory cap the user left open), else the
    // one the job asked for.
    let mps = match job.allocation.as_ref().and_then(|a| a.slice.as_ref()) {
        Some(SliceAssignment::Mps { thread_percent, memory_mib }) => Some((*thread_percent, Some(*memory_mib))),
        _ => match &job.spec.gpu_slice {
            Some(GpuSlice::Mps { thread_percent, memory_mib }) => Some((*thread_percent, *memory_mib)),
            _ => None,
        },
    };
    if let Some((thread_percent, memory_mib)) = mps {
        env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), thread_percent.to_string());
        if let Some(m) = memory_mib.filter(|m| *m > 0) {
            env.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("0={m}M"));
        }
        if let (Some(&gpu), Some(uuid)) = (gpus.first(), uuids.first()) {
            if let Some(attachment) = devices.attach_mps(gpu, uuid)? {
                env.extend(attachment.env);
                binds.extend(attachment.binds);
            }
        }
    }
    env.extend(job_environment(job, epoch, &config.node_name));
    let work_dir = config.jobs_dir().join(job.id.to_string()).join(epoch.to_string());
    // A gang's variables come last: they override the single-node SLURM_* values.
    let mut work_files = Vec::new();
    let seen_dir = if in_container { PathBuf::from(CONTAINER_WORK_DIR) } else { work_dir.clone() };
    let (gang_vars, hostfile) = gang_env(job, &config.node_name, addrs, &seen_dir.join(HOSTFILE).display().to_string());
    env.extend(gang_vars);
    work_files.extend(hostfile.map(|h| (HOSTFILE.to_string(), h)));
    let mut device_nodes: Vec<PathBuf> = Vec::new();
    if in_container && !job_devices.is_empty() {
        device_nodes
            .extend(job_devices.iter().filter_map(|d| d.minor).map(|m| PathBuf::from(format!("/dev/nvidia{m}"))));
        device_nodes.extend(NVIDIA_CONTROL_NODES.iter().map(PathBuf::from));
        device_nodes.retain(|p| p.exists());
    }
    if in_container {
        device_nodes.extend(config.extra_devices.iter().cloned());
    }
    if !in_container {
        // Slurm's in-job commands come first. (An image job gets them mounted: below.)
        let path = env.get("PATH").map_or(DEFAULT_PATH, String::as_str);
        let path = format!("{}:{path}", config.in_job_bin_dir().display());
        env.insert("PATH".into(), path);
        // Slurm's commands inside the job reach the cluster this worker reaches.
        if !env.contains_key("CORRAL_ENDPOINT") && !config.coordinator_endpoints.is_empty() {
            env.insert("CORRAL_ENDPOINT".into(), config.coordinator_endpoints.join(","));
        }
        // A login shell's profile resets PATH; bash then reads BASH_ENV, which restores it.
        // (A job submitted from a job may carry that job's: this node's takes its place.)
        let ours = env.get("BASH_ENV").is_some_and(|v| Path::new(v).file_name() == Some(BASH_ENV_FILE.as_ref()));
        if !env.contains_key("BASH_ENV") || ours {
            let file = config.in_job_bin_dir().join(BASH_ENV_FILE);
            env.insert("BASH_ENV".into(), file.display().to_string());
        }
    }
    // The job's own private directory (its logs, its script, its tasks' output), wherever it
    // runs (a container sees it at /work).
    env.insert("CORRAL_JOB_DIR".into(), seen_dir.display().to_string());
    // The per-job scratch directory that Alliance and Mila clusters' scripts copy data into
    // (a site's variable, not Slurm's): this job's own, unless the job sets one.
    env.entry("SLURM_TMPDIR".into()).or_insert_with(|| seen_dir.display().to_string());
    let (mut argv, mut files) = if holds_allocation_only(job, &config.node_name) {
        // Not the batch step's node: hold the part (cgroup, GPUs) for the job's steps, and
        // write none of the job's output files, which are the batch step's.
        let cwd = if in_container { None } else { job.spec.workdir.as_ref().map(PathBuf::from) };
        (HOLD_ARGV.iter().map(|a| a.to_string()).collect(), JobFiles { cwd, ..JobFiles::default() })
    } else if in_container {
        // Containers keep their own directory and environment. A batch script is written to
        // the work dir, seen at /work. `--output`/`--error` are files of the host, as Slurm's
        // are with pyxis: named from the submit directory, written by the worker.
        let (argv, mut files) = container_script(job);
        let host = job_files(job, &work_dir, &config.node_name).1;
        (files.stdout, files.stderr, files.truncate) = (host.stdout, host.stderr, host.truncate);
        (argv, files)
    } else {
        job_files(job, &work_dir, &config.node_name)
    };
    let root = match image {
        // A registry image: its config gives the process (Entrypoint, the job's command in
        // place of Cmd, Env under the job's, WorkingDir); the job still runs as its tenant's
        // user.
        Some(image) => {
            let overrides = JobOverrides {
                command: &job.spec.command,
                env: &env,
                working_dir: job.spec.container.workdir.as_deref(),
            };
            let exec = image.config.exec(overrides).map_err(|e| e.to_string())?;
            // A batch script runs by itself, not through the image's Entrypoint (as pyxis).
            if !holds_allocation_only(job, &config.node_name) && job.spec.script.is_none() {
                argv = exec.argv;
            }
            env = exec.env;
            files.cwd = Some(PathBuf::from(exec.working_dir));
            Some(image.root.path().to_path_buf())
        }
        None => {
            if let Some(dir) = &job.spec.container.workdir {
                files.cwd = Some(PathBuf::from(dir));
            }
            job.spec.image.as_ref().map(PathBuf::from)
        }
    };
    let mut mounts = if in_container { checked_mounts(config, job)? } else { Vec::new() };
    // A registry image's root is the job's own overlay, where runc makes the mount point. A root
    // filesystem directory is shared (and may be read-only): it gets the commands only if it has
    // the mount point already.
    let takes_commands = image.is_some()
        || root.as_ref().is_some_and(|r| r.join(in_job_bin::CONTAINER_DIR.trim_start_matches('/')).is_dir());
    if let Some(binds) = (in_container && takes_commands)
        .then(|| in_job_bin::mounts(&config.in_image_dir(), &config.in_job_socket()))
        .flatten()
    {
        // Slurm's in-job commands in the container too, first on its PATH (after the image's
        // Env and the job's are merged), as in a bare job.
        let path = env.get("PATH").map_or(DEFAULT_PATH, String::as_str);
        let path = format!("{CONTAINER_IN_JOB_BIN}:{path}");
        env.insert("PATH".into(), path);
        if !env.contains_key("CORRAL_ENDPOINT") && !config.coordinator_endpoints.is_empty() {
            env.insert("CORRAL_ENDPOINT".into(), config.coordinator_endpoints.join(","));
        }
        let ours = env.get("BASH_ENV").is_some_and(|v| Path::new(v).file_name() == Some(BASH_ENV_FILE.as_ref()));
        if !env.contains_key("BASH_ENV") || ours {
            env.insert("BASH_ENV".into(), format!("{CONTAINER_IN_JOB_BIN}/{BASH_ENV_FILE}"));
        }
        // Last: a job's own mount cannot hide them.
        mounts.extend(binds);
    }
    Ok(LaunchSpec {
        job_id: job.id,
        attempt: epoch,
        argv,
        env,
        work_dir,
        work_files,
        limits: ResourceLimits {
            memory_bytes: (job.spec.memory_bytes > 0).then_some(job.spec.memory_bytes),
            cpu_millis: (job.spec.cpu_millis > 0).then_some(job.spec.cpu_millis),
            pids_max: config.pids_max,
            open_files: config.open_files,
        },
        uid: user.map(|u| u.uid),
        gid: user.map(|u| u.gid),
        writable_root: image.is_some(),
        image: root,
        devices: device_nodes,
        cdi_devices: uuids.iter().map(|u| format!("nvidia.com/gpu={u}")).collect(),
        binds,
        mounts,
        files,
        // Set by the runtime, which holds the lease.
        not_after: None,
    })
}

/// The argv and files of a container job's main process: its command, or its batch script
/// written to the work dir and run from [`CONTAINER_WORK_DIR`] (directly with `#!`, else with
/// /bin/sh) with the command as its arguments.
fn container_script(job: &Job) -> (Vec<String>, JobFiles) {
    let Some(script) = &job.spec.script else { return (job.spec.command.to_vec(), JobFiles::default()) };
    let path = format!("{CONTAINER_WORK_DIR}/{SCRIPT_FILE}");
    let mut argv = if script.starts_with("#!") { vec![path] } else { vec!["/bin/sh".to_owned(), path] };
    argv.extend(job.spec.command.iter().cloned());
    (argv, JobFiles { script: Some(script.to_string()), ..JobFiles::default() })
}

/// The job's `--container-mounts`, each checked against the node's `[images] mount-allow`
/// (a source inside the list resolved on the host as the job's user, who must be able to reach
/// it: the bind is made by root); the first refused one fails the launch, named.
pub(crate) fn checked_mounts(config: &WorkerConfig, job: &Job) -> Result<Vec<BindMount>, String> {
    let allow = config.images.as_ref().map(|i| i.mount_allow.clone()).unwrap_or_default();
    if job.spec.container.mounts.is_empty() {
        return Ok(Vec::new());
    }
    let user = config.users.resolve(&job.spec.tenant)?;
    let (uid, gid) = (user.map(|u| u.uid), user.map(|u| u.gid));
    job.spec
        .container
        .mounts
        .iter()
        .map(|m| {
            let wanted = corral_image::ContainerMount {
                source: PathBuf::from(&m.source),
                target: PathBuf::from(&m.target),
                read_only: m.read_only,
            };
            let checked = allow
                .check_with(&wanted, |source| as_fs_user(uid, gid, || source.canonicalize()))
                .map_err(|e| format!("container mount {m} refused: {e}"))?;
            Ok(BindMount { source: checked.source, target: checked.target, read_only: checked.read_only })
        })
        .collect()
}

/// Refuses a job whose image is a registry reference (the coordinator pinned it to a digest):
/// this worker runs containers from root filesystem directories only, and the launch error
/// says so rather than calling the reference a bad directory.
fn check_rootfs_image(job: &Job) -> Result<(), String> {
    match (&job.spec.image, &job.spec.image_digest) {
        (Some(image), Some(digest)) => Err(format!(
            "image {image} ({digest}) is a registry image: this worker runs containers from root filesystem directories only (--image /abs/dir)"
        )),
        _ => Ok(()),
    }
}

/// The variables the worker sets for every job, on top of the submitted environment: corral's
/// own and their Slurm twins. The one place they are assembled.
pub(crate) fn job_environment(job: &Job, epoch: u64, node: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_owned(), v);
    };
    set("CORRAL_JOB_ID", job.id.to_string());
    set("CORRAL_NODE", node.to_owned());
    set("CORRAL_TENANT", job.spec.tenant.clone());
    // Which run this is: the placement count, and the allocation epoch that billing segments
    // and `corral show` name.
    set("CORRAL_ATTEMPT", job.attempts.to_string());
    set("CORRAL_EPOCH", epoch.to_string());
    if let Some(task) = job.array_task {
        set("CORRAL_ARRAY_JOB_ID", task.array.to_string());
        set("CORRAL_ARRAY_TASK_ID", task.index.to_string());
    }
    if !job.allocation.as_ref().is_some_and(|a| a.is_gang()) {
        // A gang's ranks (SLURM_PROCID, NODE_RANK, ...) are set by the gang launch.
        set("SLURM_PROCID", "0".to_owned());
        // Slurm's batch step is task 0 of its node too (Lightning reads SLURM_LOCALID).
        set("SLURM_LOCALID", "0".to_owned());
    }
    // The allocation's SLURM_* variables: ids, node list and counts, tasks, CPUs, GPUs,
    // memory, submit directory and host, account, partition.
    let nodes: Vec<&str> = match &job.allocation {
        Some(a) => a.parts().map(|(n, _)| n).collect(),
        None => vec![node],
    };
    env.extend(slurm_allocation_env(job, &nodes, node, SLURM_CLUSTER_NAME));
    env
}

/// `SLURM_CLUSTER_NAME` of every job.
const SLURM_CLUSTER_NAME: &str = "corral";

/// The argv and files of a bare-process job: its working directory, its batch script (run
/// directly when it starts with `#!`, else with /bin/sh; `command` holds its arguments) and
/// its output files (patterns expanded, relative to the working directory).
pub(crate) fn job_files(job: &Job, work_dir: &Path, node: &str) -> (Vec<String>, JobFiles) {
    let spec = &job.spec;
    let cwd = spec.workdir.as_ref().map(PathBuf::from);
    let argv = match &spec.script {
        Some(script) => {
            let path = work_dir.join(SCRIPT_FILE).display().to_string();
            let mut argv = if script.starts_with("#!") { vec![path] } else { vec!["/bin/sh".to_owned(), path] };
            argv.extend(spec.command.iter().cloned());
            argv
        }
        None => spec.command.to_vec(),
    };
    let base = cwd.clone().unwrap_or_else(|| work_dir.to_path_buf());
    let node_index = job.allocation.as_ref().and_then(|a| a.parts().position(|(n, _)| n == node)).unwrap_or(0);
    let place = OutputPlace { node, node_index: node_index as u32, task: 0, step: None };
    let output = |pattern: &str| {
        let mut name = expand_output_pattern(pattern, job, &place);
        // The other nodes of a job that runs its command on every node write files of their
        // own instead of overwriting the first node's (unless the pattern names the node).
        if node_index > 0 && !["%N", "%n", "%t"].iter().any(|p| pattern.contains(p)) {
            name.push_str(&format!(".{node_index}"));
        }
        base.join(name)
    };
    let stdout = spec.stdout_path.as_deref().map(output);
    // As in Slurm, stderr goes with stdout unless it has a file of its own.
    let stderr = spec.stderr_path.as_deref().map(output).or_else(|| stdout.clone());
    // `--open-mode=append`, and a requeued run, append to what is there.
    let truncate = job.attempts <= 1 && !spec.append_output;
    let files = JobFiles { cwd, script: spec.script.as_deref().map(String::from), stdout, stderr, truncate };
    (argv, files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{Allocation, ArrayTask, JobSpec, JobState, NodeGpus, Timestamp};

    fn job() -> Job {
        Job {
            id: 42,
            spec: JobSpec {
                name: "train".into(),
                tenant: "default".into(),
                command: vec!["--lr".into(), "0.1".into()].into(),
                cpu_millis: 2500,
                workdir: Some("/home/ana/exp".into()),
                ..Default::default()
            },
            state: JobState::Running,
            request_id: String::new(),
            submitted_at: Timestamp(1),
            admitted_at: None,
            started_at: None,
            finished_at: None,
            allocation: Some(Allocation { node: "gpu-01".into(), gpus: vec![0], epoch: 7, ..Default::default() }),
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 1,
            worker_run_time_ms: None,
            preemption: None,
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: Default::default(),
        }
    }

    /// A mount source inside the allow-list is resolved as the job's user: a directory the user
    /// cannot enter is refused as not accessible (root makes the bind, so the check is the
    /// user's reach); one outside the list gets the same line whether it exists or not.
    #[test]
    fn container_mounts_are_resolved_as_the_jobs_user() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP container_mounts_are_resolved_as_the_jobs_user: needs root");
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI runs the worker tests as root");
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        let host = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(host.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let allowed = host.path().join("data");
        std::fs::create_dir_all(allowed.join("open")).expect("dirs");
        std::fs::create_dir_all(allowed.join("private/inner")).expect("dirs");
        std::fs::set_permissions(allowed.join("private"), std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let mut config = WorkerConfig::for_host("gpu-01".into(), host.path().join("state"));
        let mut images = corral_image::ImagesSection::default().settings(host.path()).expect("settings");
        images.mount_allow = corral_image::MountAllow::new(vec![allowed.clone()]);
        config.images = Some(images);
        let nobody = crate::config::JobUser { uid: 65534, gid: 65534 };
        config.users = crate::config::UserMapping::Tenants {
            tenants: BTreeMap::from([("ana".to_string(), nobody)]),
            default: None,
            allow_root: false,
        };
        let mut j = job();
        j.spec.tenant = "ana".into();
        let mut with_mount = |source: &Path| {
            j.spec.container.mounts = vec![corral_types::ContainerMount {
                source: source.display().to_string(),
                target: "/in".into(),
                read_only: true,
            }];
            checked_mounts(&config, &j)
        };
        let open = with_mount(&allowed.join("open")).expect("the user reaches it");
        assert_eq!(open[0].source, allowed.join("open").canonicalize().expect("canonical"));
        let private = with_mount(&allowed.join("private/inner")).expect_err("not the user's");
        assert!(private.ends_with("inner: is not accessible to the job's user"), "{private}");
        let outside = |p: &Path, e: String| e.replace(&p.display().to_string(), "SRC");
        let (there, missing) = (host.path().join("state"), host.path().join("missing"));
        std::fs::create_dir_all(&there).expect("dir");
        assert_eq!(
            outside(&there, with_mount(&there).expect_err("outside")),
            outside(&missing, with_mount(&missing).expect_err("outside"))
        );
    }

    #[test]
    fn environment_has_corral_and_slurm_variables() {
        let mut j = job();
        let env = job_environment(&j, 7, "gpu-01");
        let get = |env: &BTreeMap<String, String>, k: &str| env.get(k).cloned();
        assert_eq!(get(&env, "CORRAL_JOB_ID").as_deref(), Some("42"));
        assert_eq!(get(&env, "SLURM_JOB_ID").as_deref(), Some("42"));
        assert_eq!(get(&env, "SLURM_JOB_NAME").as_deref(), Some("train"));
        assert_eq!(get(&env, "SLURM_SUBMIT_DIR").as_deref(), Some("/home/ana/exp"));
        assert_eq!(get(&env, "SLURM_CPUS_PER_TASK").as_deref(), Some("3"));
        assert_eq!(get(&env, "SLURM_NNODES").as_deref(), Some("1"));
        assert_eq!(get(&env, "SLURM_PROCID").as_deref(), Some("0"));
        assert_eq!(get(&env, "SLURM_LOCALID").as_deref(), Some("0"));
        assert_eq!(get(&env, "CORRAL_ARRAY_TASK_ID"), None);
        j.array_task = Some(ArrayTask { array: 40, index: 3 });
        let env = job_environment(&j, 7, "gpu-01");
        assert_eq!(get(&env, "CORRAL_ARRAY_TASK_ID").as_deref(), Some("3"));
        assert_eq!(get(&env, "SLURM_ARRAY_TASK_ID").as_deref(), Some("3"));
        assert_eq!(get(&env, "SLURM_ARRAY_JOB_ID").as_deref(), Some("40"));
        j.allocation.as_mut().unwrap().more_nodes = vec![NodeGpus { node: "gpu-02".into(), gpus: vec![0] }];
        let env = job_environment(&j, 7, "gpu-02");
        assert_eq!(get(&env, "SLURM_NNODES").as_deref(), Some("2"));
        assert_eq!(get(&env, "SLURM_JOB_NODELIST").as_deref(), Some("gpu-[01-02]"));
        assert_eq!(get(&env, "SLURM_NODEID").as_deref(), Some("1"));
        assert_eq!(get(&env, "SLURM_PROCID"), None, "a gang's ranks are the gang launch's");
    }

    /// Slurm's batch step: a batch job's script runs on the allocation's first node only; a
    /// `corral submit` gang runs its command on every node.
    #[test]
    fn a_batch_script_runs_once_on_the_first_node() {
        let mut j = job();
        j.allocation.as_mut().unwrap().more_nodes = vec![NodeGpus { node: "gpu-02".into(), gpus: vec![0] }];
        assert!(!holds_allocation_only(&j, "gpu-02"), "a gang without a script runs everywhere");
        j.spec.script = Some("#!/bin/sh\nsrun hostname\n".into());
        let first = j.allocation.as_ref().unwrap().node.clone();
        assert!(!holds_allocation_only(&j, &first));
        assert!(holds_allocation_only(&j, "gpu-02"));
        j.allocation.as_mut().unwrap().more_nodes.clear();
        assert!(!holds_allocation_only(&j, &first), "a one-node batch job runs its script");
    }

    #[test]
    fn scripts_run_with_their_arguments_in_the_working_directory() {
        let mut j = job();
        let dir = Path::new("/var/lib/corral/jobs/42/7");
        let (argv, files) = job_files(&j, dir, "gpu-01");
        assert_eq!(argv, ["--lr", "0.1"], "no script: the command as given");
        assert_eq!(files.cwd.as_deref(), Some(Path::new("/home/ana/exp")));
        j.spec.script = Some(
            "#!/bin/bash
echo hi
"
            .into(),
        );
        let (argv, _) = job_files(&j, dir, "gpu-01");
        assert_eq!(argv, ["/var/lib/corral/jobs/42/7/job-script", "--lr", "0.1"]);
        j.spec.script = Some(
            "echo hi
"
            .into(),
        );
        let (argv, files) = job_files(&j, dir, "gpu-01");
        assert_eq!(argv, ["/bin/sh", "/var/lib/corral/jobs/42/7/job-script", "--lr", "0.1"]);
        assert_eq!(
            files.script.as_deref(),
            Some(
                "echo hi
"
            )
        );
        assert_eq!((files.stdout, files.stderr, files.truncate), (None, None, true));
    }

    #[test]
    fn registry_images_are_refused_with_one_line() {
        let mut j = job();
        assert_eq!(check_rootfs_image(&j), Ok(()));
        j.spec.image = Some("/srv/rootfs".into());
        assert_eq!(check_rootfs_image(&j), Ok(()));
        j.spec.image = Some("docker.io/library/busybox:1".into());
        j.spec.image_digest = Some(format!("sha256:{}", "ab".repeat(32)));
        let error = check_rootfs_image(&j).expect_err("a registry image");
        assert!(error.starts_with("image docker.io/library/busybox:1 (sha256:abab"), "{error}");
        assert!(!error.contains('\n'), "{error}");
    }

    #[test]
    fn output_patterns_expand() {
        let mut j = job();
        j.spec.stdout_path = Some("logs/%x-%j.out".into());
        let (_, files) = job_files(&j, Path::new("/jobs/42/7"), "gpu-01");
        let out = PathBuf::from("/home/ana/exp/logs/train-42.out");
        assert_eq!((files.stdout.as_ref(), files.stderr.as_ref()), (Some(&out), Some(&out)));
        j.spec.stderr_path = Some("/scratch/%A_%a.%N.err%%%q".into());
        j.array_task = Some(ArrayTask { array: 40, index: 3 });
        j.attempts = 2;
        let (_, files) = job_files(&j, Path::new("/jobs/42/7"), "gpu-01");
        assert_eq!(files.stderr, Some(PathBuf::from("/scratch/40_3.gpu-01.err%%q")));
        assert!(!files.truncate, "a requeued run appends");
        j.attempts = 1;
        j.spec.append_output = true;
        assert!(!job_files(&j, Path::new("/jobs/42/7"), "gpu-01").1.truncate, "--open-mode=append");
    }

    #[test]
    fn the_other_nodes_of_a_gang_write_files_of_their_own() {
        let mut j = job();
        j.spec.stdout_path = Some("slurm-%j.out".into());
        j.spec.stderr_path = Some("err-%N.txt".into());
        j.allocation.as_mut().unwrap().more_nodes = vec![NodeGpus { node: "gpu-02".into(), gpus: vec![0] }];
        let (_, first) = job_files(&j, Path::new("/jobs/42/7"), "gpu-01");
        let (_, second) = job_files(&j, Path::new("/jobs/42/7"), "gpu-02");
        assert_eq!(first.stdout, Some(PathBuf::from("/home/ana/exp/slurm-42.out")));
        assert_eq!(second.stdout, Some(PathBuf::from("/home/ana/exp/slurm-42.out.1")));
        assert_eq!(second.stderr, Some(PathBuf::from("/home/ana/exp/err-gpu-02.txt")), "the pattern names the node");
    }
}
