//! GPU backends: what devices a host has and how healthy they are. `simulated` stands in for
//! NVML on machines without GPUs, behind the same trait.

mod simulated;

pub use simulated::{SimulatedConfig, SimulatedGpus};

use corral_types::{GpuDevice, GpuHealth};

/// A source of GPU inventory and health.
pub trait GpuBackend: Send + Sync + 'static {
    /// Short name for logs and `corral nodes` (`simulated`, `nvml`).
    fn name(&self) -> &'static str;
    /// The devices of this host, in index order.
    fn devices(&self) -> Vec<GpuDevice>;
    /// Current health of every device; `allocated` lists the indices running jobs.
    fn health(&self, allocated: &[u32]) -> Vec<GpuHealth>;
}
