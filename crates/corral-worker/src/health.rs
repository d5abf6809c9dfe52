//! GPU health policy: which readings make a device unfit for new jobs (too hot, a fatal XID
//! error, uncorrected ECC errors, unreadable). Fatal XIDs stick until the worker restarts,
//! since only a GPU reset clears them; the other conditions last as long as the reading shows
//! them. Transitions are logged once.

use crate::gpu::GpuReading;
use std::collections::{BTreeMap, BTreeSet};

/// XIDs after which NVIDIA says the GPU needs a reset: double-bit ECC (48), GSP/PMU halt
/// (62, 119, 120), row-remapping failure (64), NVLink (74), fallen off the bus (79), contained
/// and uncontained ECC (94, 95).
pub const DEFAULT_FATAL_XIDS: [u64; 9] = [48, 62, 64, 74, 79, 94, 95, 119, 120];

/// When a device is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    /// At or above this temperature a device takes no new jobs; `None` never.
    pub max_temperature_c: Option<u32>,
    /// XID codes that make a device unhealthy until the worker restarts.
    pub fatal_xids: BTreeSet<u64>,
    /// Uncorrected ECC errors tolerated; above it the device is unhealthy. `None` ignores ECC.
    pub max_ecc_uncorrected: Option<u64>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            max_temperature_c: Some(90),
            fatal_xids: DEFAULT_FATAL_XIDS.into_iter().collect(),
            max_ecc_uncorrected: Some(0),
        }
    }
}

/// Health of every device over time.
#[derive(Debug, Default)]
pub struct HealthTracker {
    policy: HealthPolicy,
    /// Fatal XID codes seen per device.
    fatal: BTreeMap<u32, u64>,
    /// Current problems per device (only unhealthy devices have an entry).
    problems: BTreeMap<u32, Vec<String>>,
}

impl HealthTracker {
    pub fn new(policy: HealthPolicy) -> Self {
        HealthTracker { policy, ..Default::default() }
    }

    /// Evaluates fresh readings and logs devices that turn unhealthy or recover.
    pub fn update(&mut self, readings: &[GpuReading]) {
        for reading in readings {
            let index = reading.index;
            if let Some(xid) = reading.last_xid.filter(|x| self.policy.fatal_xids.contains(x)) {
                self.fatal.entry(index).or_insert(xid);
            }
            let problems = self.problems_of(reading);
            let before = self.problems.get(&index);
            if before != Some(&problems) && !(before.is_none() && problems.is_empty()) {
                if problems.is_empty() {
                    tracing::info!(gpu = index, "gpu is healthy again");
                } else {
                    tracing::warn!(gpu = index, problems = %problems.join("; "), "gpu is unhealthy: no new jobs");
                }
            }
            if problems.is_empty() {
                self.problems.remove(&index);
            } else {
                self.problems.insert(index, problems);
            }
        }
    }

    fn problems_of(&self, reading: &GpuReading) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(e) = &reading.error {
            problems.push(e.clone());
        }
        if let Some(xid) = self.fatal.get(&reading.index) {
            problems.push(format!("fatal XID {xid}: reset the GPU, then restart the worker"));
        }
        if let Some(max) = self.policy.max_temperature_c {
            if reading.error.is_none() && reading.temperature_c >= max {
                problems.push(format!("overheating: {} C (limit {max} C)", reading.temperature_c));
            }
        }
        if let Some(max) = self.policy.max_ecc_uncorrected {
            if reading.ecc_uncorrected > max {
                problems.push(format!("{} uncorrected ECC errors", reading.ecc_uncorrected));
            }
        }
        problems
    }

    /// Why the device is unhealthy; empty when healthy.
    pub fn problems(&self, gpu: u32) -> &[String] {
        self.problems.get(&gpu).map_or(&[], Vec::as_slice)
    }

    pub fn is_healthy(&self, gpu: u32) -> bool {
        !self.problems.contains_key(&gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(index: u32, temperature_c: u32) -> GpuReading {
        GpuReading { index, temperature_c, ..Default::default() }
    }

    #[test]
    fn overheating_lasts_as_long_as_the_heat() {
        let mut t = HealthTracker::new(HealthPolicy::default());
        t.update(&[reading(0, 95), reading(1, 60)]);
        assert!(!t.is_healthy(0));
        assert!(t.problems(0)[0].contains("overheating: 95 C"), "{:?}", t.problems(0));
        assert!(t.is_healthy(1));
        t.update(&[reading(0, 70)]);
        assert!(t.is_healthy(0));
    }

    #[test]
    fn fatal_xids_stick_and_others_do_not() {
        let mut t = HealthTracker::new(HealthPolicy::default());
        t.update(&[GpuReading { index: 0, xid_errors: 1, last_xid: Some(13), ..Default::default() }]);
        assert!(t.is_healthy(0), "XID 13 is an application error");
        t.update(&[GpuReading { index: 0, xid_errors: 2, last_xid: Some(79), ..Default::default() }]);
        assert!(t.problems(0)[0].contains("fatal XID 79"));
        t.update(&[GpuReading { index: 0, xid_errors: 3, last_xid: Some(13), ..Default::default() }]);
        assert!(!t.is_healthy(0), "a fatal XID needs a reset");
    }

    #[test]
    fn ecc_and_unreadable_devices_are_unhealthy() {
        let mut t = HealthTracker::new(HealthPolicy::default());
        t.update(&[
            GpuReading { index: 0, ecc_uncorrected: 1, ..Default::default() },
            GpuReading { index: 1, error: Some("gpu lost".into()), ..Default::default() },
        ]);
        assert!(!t.is_healthy(0) && !t.is_healthy(1));
        let lenient = HealthTracker::new(HealthPolicy { max_ecc_uncorrected: None, ..Default::default() });
        let mut lenient = lenient;
        lenient.update(&[GpuReading { index: 0, ecc_uncorrected: 5, ..Default::default() }]);
        assert!(lenient.is_healthy(0));
    }
}
