//! GPU backends: what devices a host has and how healthy they are. `nvml` reads real NVIDIA
//! devices through libnvidia-ml (loaded at run time); `simulated` stands in for it on machines
//! without GPUs, behind the same trait, and can be told to misbehave (see [`simulated`]).
//!
//! Boundary: only this module knows NVML. Everything above it sees [`DeviceInfo`] and
//! [`GpuReading`].

mod nvml;
mod nvml_mig;
pub mod simulated;

pub use nvml::NvmlGpus;
pub use simulated::{SimulatedConfig, SimulatedDevice, SimulatedGpus};

use corral_types::{GpuDevice, GpuHealth};

/// Name of the process that serves MPS clients; it holds GPU memory on purpose.
pub const MPS_SERVER_PROCESS: &str = "nvidia-cuda-mps-server";

/// MIG state of one device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum MigState {
    /// The card cannot be partitioned (e.g. RTX 5090), or the backend cannot tell.
    #[default]
    Unsupported,
    /// MIG-capable, partitioning off.
    Disabled,
    /// Partitioned; the existing GPU instances.
    Enabled { instances: Vec<MigInstance> },
}

/// One MIG device (a GPU instance with its compute instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInstance {
    /// `MIG-...` UUID, what CUDA_VISIBLE_DEVICES takes.
    pub uuid: String,
    /// Profile such as `1g.10gb`, when the driver names it.
    pub profile: Option<String>,
    pub memory_mib: u64,
}

/// Where a GPU instance sits: its first memory slice and how many it covers (eighths of the
/// device memory on A100/H100/H200).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigPlacement {
    pub start: u32,
    pub size: u32,
}

/// What a backend knows about one device beyond what registration carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub device: GpuDevice,
    /// PCI address in sysfs form (`0000:17:00.0`), when known.
    pub pci_bus_id: Option<String>,
    /// NUMA node of the PCI device, when the platform reports one.
    pub numa_node: Option<u32>,
    /// Minor number of `/dev/nvidia<minor>`, when known.
    pub minor: Option<u32>,
    pub mig: MigState,
}

impl DeviceInfo {
    /// Facts for a device nothing more is known about.
    pub fn plain(device: GpuDevice) -> Self {
        DeviceInfo { device, pci_bus_id: None, numa_node: None, minor: None, mig: MigState::Unsupported }
    }
}

/// A process holding a context on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    pub pid: u32,
    /// Device memory it holds, when the driver says.
    pub used_memory_mib: Option<u64>,
    /// `comm` of the process, when it is visible from here.
    pub name: Option<String>,
}

impl GpuProcess {
    /// The MPS server keeps its context between jobs: not a leak.
    pub fn is_mps_server(&self) -> bool {
        self.name.as_deref() == Some(MPS_SERVER_PROCESS)
    }
}

/// One reading of one device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuReading {
    pub index: u32,
    pub temperature_c: u32,
    pub utilization_percent: u32,
    pub memory_used_mib: u64,
    pub power_mw: u64,
    /// Critical XID errors seen since the backend started (monotonic).
    pub xid_errors: u64,
    /// The most recent XID code, if any was seen.
    pub last_xid: Option<u64>,
    /// Uncorrected ECC errors since the last driver reload (0 where ECC is off or unsupported).
    pub ecc_uncorrected: u64,
    /// Processes with a compute context on the device.
    pub processes: Vec<GpuProcess>,
    /// Set when the device could not be read (e.g. it fell off the bus).
    pub error: Option<String>,
}

impl GpuReading {
    /// The part of a reading the heartbeat carries; `dirty` is decided by the caller.
    pub fn to_health(&self, dirty: bool) -> GpuHealth {
        GpuHealth {
            index: self.index,
            temperature_c: self.temperature_c,
            utilization_percent: self.utilization_percent,
            memory_used_mib: self.memory_used_mib,
            power_mw: self.power_mw,
            xid_errors: self.xid_errors,
            dirty,
            ..Default::default()
        }
    }
}

/// Errors of the GPU backends.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "no NVML: {detail}; install the NVIDIA driver (libnvidia-ml.so.1) or set gpu.backend = \"simulated\" in the worker config"
    )]
    NoNvml { detail: String },
    #[error("nvml {call} failed: {detail}; check the driver with nvidia-smi")]
    Nvml { call: &'static str, detail: String },
    /// A MIG request the device cannot satisfy (MIG off, unknown profile, no room left).
    #[error("gpu {index}: {detail}")]
    Mig { index: u32, detail: String },
    #[error("the {backend} backend cannot create or destroy MIG instances")]
    MigUnsupported { backend: &'static str },
}

/// A source of GPU inventory and health.
pub trait GpuBackend: Send + Sync + 'static {
    /// Short name for logs and `corral nodes` (`simulated`, `nvml`).
    fn name(&self) -> &'static str;

    /// The devices of this host, in index order.
    fn devices(&self) -> Vec<GpuDevice>;

    /// The GPU driver's version, when the backend can tell (the worker's self-check).
    fn driver_version(&self) -> Option<String> {
        None
    }

    /// Static facts (PCI, NUMA, MIG layout) of every device, in index order.
    fn info(&self) -> Vec<DeviceInfo> {
        self.devices().into_iter().map(DeviceInfo::plain).collect()
    }

    /// Reads every device; `allocated` lists the indices running jobs. Blocks briefly (driver
    /// calls): async callers use `spawn_blocking`.
    fn read(&self, allocated: &[u32]) -> Vec<GpuReading>;

    /// Creates a GPU instance of `profile` (e.g. `1g.10gb`) on device `index`, with one compute
    /// instance spanning it, and returns the new MIG device. Needs MIG mode already on: turning
    /// it on resets the GPU, which the worker never does by itself.
    /// `placement` is where the scheduler put it (memory-slice start and size); `None` lets the
    /// driver choose.
    fn create_mig_instance(
        &self,
        index: u32,
        profile: &str,
        placement: Option<MigPlacement>,
    ) -> Result<MigInstance, GpuError> {
        let _ = (index, profile, placement);
        Err(GpuError::MigUnsupported { backend: self.name() })
    }

    /// Destroys the MIG device `uuid` of device `index` (its compute and GPU instance). Fails
    /// while processes still use it.
    fn destroy_mig_instance(&self, index: u32, uuid: &str) -> Result<(), GpuError> {
        let _ = (index, uuid);
        Err(GpuError::MigUnsupported { backend: self.name() })
    }

    /// Current health of every device, never dirty (the worker decides that).
    fn health(&self, allocated: &[u32]) -> Vec<GpuHealth> {
        self.read(allocated).iter().map(|r| r.to_health(false)).collect()
    }
}

/// A MIG profile name such as `1g.10gb` or `3g.40gb`: (compute slices, memory in GB). Suffixes
/// such as `+me` are kept out of the numbers.
pub fn parse_mig_profile(profile: &str) -> Option<(u32, u64)> {
    let (slices, rest) = profile.split_once("g.")?;
    let memory = rest.split(['+', '-']).next()?.strip_suffix("gb")?;
    Some((slices.parse().ok().filter(|s| *s > 0)?, memory.parse().ok().filter(|m| *m > 0)?))
}

/// Reads `/proc/<pid>/comm`.
pub(crate) fn process_name(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).ok().map(|s| s.trim_end().to_owned())
}
