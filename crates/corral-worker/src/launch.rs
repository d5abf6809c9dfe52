//! From an allocation to a launch: the job's GPUs as devices and environment (CUDA, MPS, MIG),
//! its user, limits and work dir. Also picks (or, with `mig.manage`, makes) the MIG instance a
//! MIG job runs on.

use crate::executor::{LaunchSpec, ResourceLimits, CONTAINER_WORK_DIR};
use crate::gang::{gang_env, PartAddrs, HOSTFILE};
use crate::gpu::{DeviceInfo, MigPlacement, MigState};
use crate::worker::WorkerShared;
use corral_types::{GpuSlice, Job, SliceAssignment};
use std::path::PathBuf;

/// GPU control nodes a container with GPUs needs besides `/dev/nvidia<minor>`.
const NVIDIA_CONTROL_NODES: [&str; 4] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"];

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
    shared: &WorkerShared,
    job: &Job,
    gpus: &[u32],
    taken: &[String],
) -> Result<Option<MigPick>, String> {
    let Some(GpuSlice::Mig { profile, .. }) = &job.spec.gpu_slice else { return Ok(None) };
    let Some(&gpu) = gpus.first() else { return Ok(None) };
    let layout = shared.device_info().into_iter().find(|d| d.device.index == gpu).map(|d| d.mig);
    let config = shared.config();
    let instances = match layout {
        Some(MigState::Enabled { instances }) => instances,
        Some(MigState::Disabled) if config.mig_manage => {
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
    if !config.mig_manage {
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
    let created = shared.gpus().create_mig_instance(gpu, profile, placement).map_err(|e| e.to_string())?;
    shared.refresh_info();
    Ok(Some(MigPick { uuid: created.uuid, created: true }))
}

/// What the executor runs for allocation `epoch` of `job` on this node's `gpus`.
pub(crate) fn launch_spec(
    shared: &WorkerShared,
    job: &Job,
    epoch: u64,
    gpus: &[u32],
    mig_uuid: Option<&str>,
    addrs: &PartAddrs,
) -> Result<LaunchSpec, String> {
    let config = shared.config();
    let user = config.users.resolve(&job.spec.tenant)?;
    let info = shared.device_info();
    let devices: Vec<&DeviceInfo> = gpus.iter().filter_map(|i| info.iter().find(|d| d.device.index == *i)).collect();
    let uuids: Vec<String> = devices.iter().map(|d| d.device.uuid.clone()).collect();
    let in_container = job.spec.image.is_some();
    let mut env = job.spec.env.clone();
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
            if let Some(attachment) = shared.mps().attach(gpu, uuid)? {
                env.extend(attachment.env);
                binds.extend(attachment.binds);
            }
        }
    }
    env.insert("CORRAL_JOB_ID".into(), job.id.to_string());
    env.insert("CORRAL_NODE".into(), config.node_name.clone());
    env.insert("CORRAL_TENANT".into(), job.spec.tenant.clone());
    // Which run this is: the placement count, and the allocation epoch that billing segments
    // and `corral show` name.
    env.insert("CORRAL_ATTEMPT".into(), job.attempts.to_string());
    env.insert("CORRAL_EPOCH".into(), epoch.to_string());
    let work_dir = shared.jobs_dir().join(job.id.to_string()).join(epoch.to_string());
    let mut work_files = Vec::new();
    let seen_dir = if in_container { PathBuf::from(CONTAINER_WORK_DIR) } else { work_dir.clone() };
    let (gang_vars, hostfile) = gang_env(job, &config.node_name, addrs, &seen_dir.join(HOSTFILE).display().to_string());
    env.extend(gang_vars);
    work_files.extend(hostfile.map(|h| (HOSTFILE.to_string(), h)));
    let mut device_nodes: Vec<PathBuf> = Vec::new();
    if in_container && !devices.is_empty() {
        device_nodes.extend(devices.iter().filter_map(|d| d.minor).map(|m| PathBuf::from(format!("/dev/nvidia{m}"))));
        device_nodes.extend(NVIDIA_CONTROL_NODES.iter().map(PathBuf::from));
        device_nodes.retain(|p| p.exists());
    }
    if in_container {
        device_nodes.extend(config.extra_devices.iter().cloned());
    }
    Ok(LaunchSpec {
        job_id: job.id,
        attempt: epoch,
        argv: job.spec.command.clone(),
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
        image: job.spec.image.as_ref().map(PathBuf::from),
        devices: device_nodes,
        cdi_devices: uuids.iter().map(|u| format!("nvidia.com/gpu={u}")).collect(),
        binds,
    })
}
