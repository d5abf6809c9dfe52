//! GPU health policy and fault attribution: which readings make a device unfit for new jobs
//! (too hot, a card fault, uncorrected ECC errors, unreadable), and whose fault each new GPU
//! event is (`xid.rs`: an application's XID is the job's; a hardware or driver XID, a new
//! uncorrectable ECC error, a device gone from the bus are the card's).
//!
//! A card fault sticks: the GPU stays unhealthy until its readings have been clean for
//! `recover-after` (`[health]` of the worker config; absent: until the worker restarts, since
//! only a GPU reset clears most of them). Each card fault counts in the device's `seq`, which the
//! heartbeat carries, so the leader clears its replicated mark only with a reading made after
//! the fault. The other conditions last as long as the reading shows them. Transitions are
//! logged once.

use crate::gpu::GpuReading;
use crate::xid::{self, Blame};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// When a device is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    /// At or above this temperature a device takes no new jobs; `None` never.
    pub max_temperature_c: Option<u32>,
    /// XID codes that are the card's fault (default: the catalogue's hardware and driver codes).
    pub fatal_xids: BTreeSet<u64>,
    /// Uncorrected ECC errors tolerated; above it the device is unhealthy. `None` ignores ECC.
    pub max_ecc_uncorrected: Option<u64>,
    /// A card fault clears after this long of clean readings; `None`: it sticks until the
    /// worker restarts.
    pub recover_after: Option<Duration>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            max_temperature_c: Some(90),
            fatal_xids: xid::card_codes().into_iter().collect(),
            max_ecc_uncorrected: Some(0),
            recover_after: None,
        }
    }
}

/// A new event of one device, and whose fault it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuEvent {
    /// The card's fault: runs on it are stopped and it leaves placement. `seq` counts the
    /// device's card faults in this worker process.
    Card { gpu: u32, reason: String, seq: u64 },
    /// The job's own error (an application XID): the card stays in the pool.
    Job { gpu: u32, reason: String },
}

/// The card fault a device is out for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardFault {
    pub reason: String,
    pub seq: u64,
    pub at: Instant,
    /// Since when its readings have been clean (`None`: not clean now).
    clean_since: Option<Instant>,
}

#[derive(Debug, Default)]
struct Device {
    /// The XID counter of the last reading (the counter only grows).
    xids_seen: u64,
    ecc_seen: u64,
    lost: bool,
    /// Card faults counted so far.
    seq: u64,
    fault: Option<CardFault>,
}

/// Health of every device over time.
#[derive(Debug, Default)]
pub struct HealthTracker {
    policy: HealthPolicy,
    devices: BTreeMap<u32, Device>,
    /// Current problems per device (only unhealthy devices have an entry).
    problems: BTreeMap<u32, Vec<String>>,
}

impl HealthTracker {
    pub fn new(policy: HealthPolicy) -> Self {
        HealthTracker { policy, ..Default::default() }
    }

    /// Evaluates fresh readings, logs devices that turn unhealthy or recover, and returns the
    /// events new since the last readings.
    pub fn update(&mut self, readings: &[GpuReading]) -> Vec<GpuEvent> {
        self.update_at(readings, Instant::now())
    }

    pub(crate) fn update_at(&mut self, readings: &[GpuReading], now: Instant) -> Vec<GpuEvent> {
        let mut events = Vec::new();
        for reading in readings {
            let index = reading.index;
            let device = self.devices.entry(index).or_default();
            let mut card = Vec::new();
            if reading.xid_errors > device.xids_seen {
                if let Some(code) = reading.last_xid {
                    let blame = if self.policy.fatal_xids.contains(&code) { Blame::Card } else { Blame::Job };
                    match blame {
                        Blame::Card => card.push(xid::describe(code)),
                        Blame::Job => events.push(GpuEvent::Job { gpu: index, reason: xid::describe(code) }),
                    }
                }
            }
            device.xids_seen = device.xids_seen.max(reading.xid_errors);
            if let Some(max) = self.policy.max_ecc_uncorrected {
                if reading.ecc_uncorrected > max && reading.ecc_uncorrected > device.ecc_seen {
                    card.push(format!("{} uncorrectable ECC errors", reading.ecc_uncorrected));
                }
            }
            if reading.error.is_none() {
                // A driver reload resets the volatile counter.
                device.ecc_seen = reading.ecc_uncorrected;
            }
            let lost = reading.error.is_some();
            if lost && !device.lost {
                card.push(reading.error.clone().unwrap_or_default());
            }
            device.lost = lost;
            let clean = !lost && self.policy.max_ecc_uncorrected.is_none_or(|max| reading.ecc_uncorrected <= max);
            if !card.is_empty() {
                device.seq += 1;
                let reason = card.join("; ");
                device.fault = Some(CardFault { reason: reason.clone(), seq: device.seq, at: now, clean_since: None });
                events.push(GpuEvent::Card { gpu: index, reason, seq: device.seq });
            } else if let Some(fault) = &mut device.fault {
                if !clean {
                    fault.clean_since = None;
                } else {
                    let since = *fault.clean_since.get_or_insert(now);
                    if self.policy.recover_after.is_some_and(|after| now.duration_since(since) >= after) {
                        tracing::info!(gpu = index, fault = %fault.reason, "gpu checked clean long enough after its card fault");
                        device.fault = None;
                    }
                }
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
        events
    }

    fn problems_of(&self, reading: &GpuReading) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(e) = &reading.error {
            problems.push(e.clone());
        }
        if let Some(fault) = self.devices.get(&reading.index).and_then(|d| d.fault.as_ref()) {
            let until = match self.policy.recover_after {
                Some(after) => format!("back after {} of clean checks", corral_types::format_duration(after)),
                None => "reset the GPU, then restart the worker".to_string(),
            };
            problems.push(format!("card fault: {}: {until}", fault.reason));
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

    /// The card fault the device is out for, if any.
    pub fn card_fault(&self, gpu: u32) -> Option<&CardFault> {
        self.devices.get(&gpu).and_then(|d| d.fault.as_ref())
    }

    /// Card faults the device has counted in this process.
    pub fn fault_seq(&self, gpu: u32) -> u64 {
        self.devices.get(&gpu).map_or(0, |d| d.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(index: u32, temperature_c: u32) -> GpuReading {
        GpuReading { index, temperature_c, ..Default::default() }
    }

    fn xid(index: u32, count: u64, code: u64) -> GpuReading {
        GpuReading { index, xid_errors: count, last_xid: Some(code), ..Default::default() }
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
    fn card_xids_stick_and_application_xids_are_the_jobs() {
        let mut t = HealthTracker::new(HealthPolicy::default());
        let events = t.update(&[xid(0, 1, 13)]);
        assert!(
            matches!(&events[..], [GpuEvent::Job { gpu: 0, reason }] if reason.starts_with("XID 13")),
            "{events:?}"
        );
        assert!(t.is_healthy(0), "XID 13 is an application error");
        assert!(t.update(&[xid(0, 1, 13)]).is_empty(), "an event is new once");
        let events = t.update(&[xid(0, 2, 79)]);
        assert_eq!(events, [GpuEvent::Card { gpu: 0, reason: "XID 79 (GPU has fallen off the bus)".into(), seq: 1 }]);
        assert!(t.problems(0)[0].starts_with("card fault: XID 79"), "{:?}", t.problems(0));
        assert_eq!(t.fault_seq(0), 1);
        t.update(&[xid(0, 3, 13)]);
        assert!(!t.is_healthy(0), "without recover-after a card fault needs a reset");
    }

    #[test]
    fn a_card_fault_clears_after_recover_after_of_clean_readings() {
        let after = Duration::from_secs(60);
        let mut t = HealthTracker::new(HealthPolicy { recover_after: Some(after), ..Default::default() });
        let t0 = Instant::now();
        t.update_at(&[xid(0, 1, 48)], t0);
        assert!(t.card_fault(0).is_some());
        t.update_at(&[xid(0, 1, 48)], t0 + Duration::from_secs(10));
        // Unclean in between: the clock starts again.
        t.update_at(&[GpuReading { index: 0, xid_errors: 1, ecc_uncorrected: 2, ..Default::default() }], t0 + after);
        t.update_at(&[xid(0, 1, 48)], t0 + after + Duration::from_secs(1));
        assert!(!t.is_healthy(0), "not clean for long enough yet");
        t.update_at(&[xid(0, 1, 48)], t0 + after * 2 + Duration::from_secs(1));
        assert!(t.is_healthy(0), "{:?}", t.problems(0));
        assert_eq!(t.fault_seq(0), 2, "the ECC errors were a second card fault");
    }

    #[test]
    fn ecc_and_lost_devices_are_card_faults_once() {
        let mut t = HealthTracker::new(HealthPolicy::default());
        let lost = GpuReading { index: 1, error: Some("gpu lost".into()), ..Default::default() };
        let ecc = GpuReading { index: 0, ecc_uncorrected: 1, ..Default::default() };
        let events = t.update(&[ecc.clone(), lost.clone()]);
        assert_eq!(events.len(), 2, "{events:?}");
        assert!(matches!(&events[1], GpuEvent::Card { gpu: 1, reason, seq: 1 } if reason == "gpu lost"));
        assert!(!t.is_healthy(0) && !t.is_healthy(1));
        assert!(t.update(&[ecc, lost]).is_empty(), "still the same faults");
        let mut lenient = HealthTracker::new(HealthPolicy { max_ecc_uncorrected: None, ..Default::default() });
        assert!(lenient.update(&[GpuReading { index: 0, ecc_uncorrected: 5, ..Default::default() }]).is_empty());
        assert!(lenient.is_healthy(0));
    }
}
