//! Simulated GPUs for hosts without NVIDIA hardware (and for tests).

use super::GpuBackend;
use corral_types::{GpuDevice, GpuHealth};

/// What to simulate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulatedConfig {
    pub count: u32,
    pub model: String,
    pub memory_mib: u64,
    /// Seed of the device UUIDs, so two simulated hosts never share one.
    pub host: String,
}

impl Default for SimulatedConfig {
    /// 8 x RTX 5090 with 32 GiB each.
    fn default() -> Self {
        SimulatedConfig { count: 8, model: "RTX 5090".into(), memory_mib: 32 * 1024, host: "localhost".into() }
    }
}

/// A deterministic simulated GPU set: idle devices sit at 35 C, busy ones at 65 C.
#[derive(Debug, Clone)]
pub struct SimulatedGpus {
    config: SimulatedConfig,
}

impl SimulatedGpus {
    pub fn new(config: SimulatedConfig) -> Self {
        SimulatedGpus { config }
    }

    fn uuid(&self, index: u32) -> String {
        // FNV-1a of host name: stable per host, distinct across hosts.
        let hash = self
            .config
            .host
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        format!(
            "GPU-{:08x}-{:04x}-{:04x}-sim0-{:012x}",
            (hash >> 32) as u32,
            (hash >> 16) as u16,
            index,
            hash & 0xffff_ffff_ffff
        )
    }
}

impl GpuBackend for SimulatedGpus {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn devices(&self) -> Vec<GpuDevice> {
        (0..self.config.count)
            .map(|index| GpuDevice {
                index,
                uuid: self.uuid(index),
                model: self.config.model.clone(),
                memory_mib: self.config.memory_mib,
            })
            .collect()
    }

    fn health(&self, allocated: &[u32]) -> Vec<GpuHealth> {
        (0..self.config.count)
            .map(|index| {
                let busy = allocated.contains(&index);
                GpuHealth {
                    index,
                    temperature_c: if busy { 65 } else { 35 },
                    utilization_percent: if busy { 100 } else { 0 },
                    memory_used_mib: 0,
                    power_mw: if busy { 450_000 } else { 30_000 },
                    xid_errors: 0,
                    dirty: false,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_stable_and_unique_per_host() {
        let a = SimulatedGpus::new(SimulatedConfig::default());
        let b = SimulatedGpus::new(SimulatedConfig { host: "other".into(), ..Default::default() });
        let da = a.devices();
        assert_eq!(da.len(), 8);
        assert_eq!(da[3].model, "RTX 5090");
        assert_eq!(da[3].memory_mib, 32768);
        assert_eq!(da, a.devices(), "stable across calls");
        let mut uuids: Vec<String> = da.iter().chain(b.devices().iter()).map(|d| d.uuid.clone()).collect();
        uuids.sort();
        uuids.dedup();
        assert_eq!(uuids.len(), 16);
        let health = a.health(&[2]);
        assert_eq!(health[2].temperature_c, 65);
        assert_eq!(health[1].temperature_c, 35);
    }
}
