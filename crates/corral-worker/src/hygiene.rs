//! Post-job GPU hygiene: after a job's cgroup is empty, its GPUs must hold no compute process
//! and their memory must be back at the idle baseline; otherwise the device is DIRTY (not
//! schedulable, reported in the heartbeat) until a later check finds it clean again. The leak
//! is attributed to the job in the log and in `<data-dir>/gpu-leaks.jsonl`.
//!
//! Invariant: the baseline of a device is only ever taken from a reading without foreign
//! compute processes; MPS server processes and their memory are not counted as leaks.

use crate::gpu::GpuReading;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Hygiene settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HygieneConfig {
    /// Memory above a device's idle baseline that still counts as clean (driver noise).
    pub memory_tolerance_mib: u64,
    /// How long a device may take to release its memory after the job's processes are gone.
    pub settle_time: Duration,
    /// Interval between two checks of a dirty device.
    pub recheck_interval: Duration,
}

impl Default for HygieneConfig {
    fn default() -> Self {
        HygieneConfig {
            memory_tolerance_mib: 128,
            settle_time: Duration::from_secs(5),
            recheck_interval: Duration::from_secs(10),
        }
    }
}

/// What is wrong with a device after a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub gpu: u32,
    /// Memory in use above the baseline (MPS server memory excluded).
    pub leaked_mib: u64,
    /// Compute processes still on the device (MPS servers excluded).
    pub pids: Vec<u32>,
    /// One line for logs and `corral nodes`.
    pub reason: String,
}

/// A dirty device and who left it so.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Leak {
    #[serde(flatten)]
    pub finding: Finding,
    /// The job whose run left the device dirty; `None` when found at worker start.
    pub job_id: Option<u64>,
    pub epoch: Option<u64>,
    /// Unix time in milliseconds.
    pub detected_at_ms: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Idle memory use per device, MiB.
    baseline: BTreeMap<u32, u64>,
    dirty: BTreeMap<u32, Leak>,
    last_recheck: Option<std::time::Instant>,
}

/// Tracks baselines and dirty devices of one worker.
#[derive(Debug)]
pub struct Hygiene {
    config: HygieneConfig,
    /// Append-only JSON lines: one per leak found and one per device cleaned.
    record_file: Option<PathBuf>,
    state: Mutex<State>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Hygiene {
    pub fn new(config: HygieneConfig, record_file: Option<PathBuf>) -> Self {
        Hygiene { config, record_file, state: Mutex::new(State::default()) }
    }

    pub fn config(&self) -> &HygieneConfig {
        &self.config
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the idle baselines from readings made before any job runs. A device that already
    /// has compute processes is dirty from the start (a previous worker's job, or a user
    /// running outside corral).
    pub fn start(&self, readings: &[GpuReading]) {
        let mut state = self.state();
        for reading in readings {
            let (pids, memory) = foreign(reading);
            if reading.error.is_none() && pids.is_empty() {
                state.baseline.insert(reading.index, memory);
                continue;
            }
            let finding = Finding {
                gpu: reading.index,
                leaked_mib: 0,
                reason: match &reading.error {
                    Some(e) => format!("unreadable at worker start: {e}"),
                    None => format!("compute processes {pids:?} at worker start"),
                },
                pids,
            };
            tracing::error!(gpu = reading.index, reason = %finding.reason, "gpu is dirty at worker start");
            let leak = Leak { finding, job_id: None, epoch: None, detected_at_ms: now_ms() };
            self.record(&leak_record("dirty", &leak));
            state.dirty.insert(reading.index, leak);
        }
    }

    /// What is unclean on `gpus` according to `readings`; empty when all are clean.
    pub fn inspect(&self, readings: &[GpuReading], gpus: &[u32]) -> Vec<Finding> {
        let state = self.state();
        readings.iter().filter(|r| gpus.contains(&r.index)).filter_map(|r| self.finding(&state, r)).collect()
    }

    fn finding(&self, state: &State, reading: &GpuReading) -> Option<Finding> {
        if let Some(e) = &reading.error {
            return Some(Finding {
                gpu: reading.index,
                leaked_mib: 0,
                pids: Vec::new(),
                reason: format!("cannot verify the device: {e}"),
            });
        }
        let (pids, memory) = foreign(reading);
        let baseline = state.baseline.get(&reading.index).copied();
        let leaked_mib = baseline.map_or(0, |b| memory.saturating_sub(b));
        let over = leaked_mib > self.config.memory_tolerance_mib;
        if pids.is_empty() && !over {
            return None;
        }
        let mut reasons = Vec::new();
        if !pids.is_empty() {
            reasons.push(format!("compute processes {pids:?} still on the device"));
        }
        if over {
            reasons.push(format!("{leaked_mib} MiB of device memory not released"));
        }
        Some(Finding { gpu: reading.index, leaked_mib, pids, reason: reasons.join(", ") })
    }

    /// Marks the devices of `findings` dirty, attributing them to the job.
    pub fn mark_dirty(&self, job_id: u64, epoch: u64, findings: Vec<Finding>) {
        let mut state = self.state();
        for finding in findings {
            tracing::error!(
                job_id,
                epoch,
                gpu = finding.gpu,
                leaked_mib = finding.leaked_mib,
                pids = ?finding.pids,
                reason = %finding.reason,
                "gpu left dirty by job: not schedulable until clean"
            );
            let leak = Leak { finding, job_id: Some(job_id), epoch: Some(epoch), detected_at_ms: now_ms() };
            self.record(&leak_record("dirty", &leak));
            state.dirty.insert(leak.finding.gpu, leak);
        }
    }

    /// A device found clean after a job: lowers its baseline if it idles lower now.
    pub fn note_clean(&self, readings: &[GpuReading], gpus: &[u32]) {
        let mut state = self.state();
        for reading in readings.iter().filter(|r| gpus.contains(&r.index) && r.error.is_none()) {
            let (pids, memory) = foreign(reading);
            if pids.is_empty() {
                let baseline = state.baseline.entry(reading.index).or_insert(memory);
                *baseline = (*baseline).min(memory);
            }
        }
    }

    /// Whether a recheck of dirty devices is due (at most one per `recheck_interval`).
    pub fn recheck_due(&self) -> bool {
        let state = self.state();
        !state.dirty.is_empty() && state.last_recheck.is_none_or(|t| t.elapsed() >= self.config.recheck_interval)
    }

    /// Checks dirty devices again; clears and returns those that are clean now.
    pub fn recheck(&self, readings: &[GpuReading]) -> Vec<u32> {
        let mut state = self.state();
        state.last_recheck = Some(std::time::Instant::now());
        let dirty: Vec<u32> = state.dirty.keys().copied().collect();
        let mut cleaned = Vec::new();
        for reading in readings.iter().filter(|r| dirty.contains(&r.index)) {
            if self.finding(&state, reading).is_some() {
                continue;
            }
            let (_, memory) = foreign(reading);
            state.baseline.entry(reading.index).or_insert(memory);
            if let Some(leak) = state.dirty.remove(&reading.index) {
                tracing::info!(gpu = reading.index, job_id = ?leak.job_id, "dirty gpu is clean again: schedulable");
                self.record(&leak_record("clean", &leak));
                cleaned.push(reading.index);
            }
        }
        cleaned
    }

    pub fn is_dirty(&self, gpu: u32) -> bool {
        self.state().dirty.contains_key(&gpu)
    }

    /// The dirty devices and why.
    pub fn leaks(&self) -> Vec<Leak> {
        self.state().dirty.values().cloned().collect()
    }

    fn record(&self, line: &serde_json::Value) {
        let Some(path) = &self.record_file else { return };
        let written =
            std::fs::OpenOptions::new().create(true).append(true).open(path).and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            tracing::warn!(file = %path.display(), error = %e, "cannot record a gpu leak");
        }
    }
}

fn leak_record(event: &str, leak: &Leak) -> serde_json::Value {
    let mut value = serde_json::to_value(leak).unwrap_or_default();
    if let Some(object) = value.as_object_mut() {
        object.insert("event".into(), event.into());
        object.insert("time_ms".into(), now_ms().into());
    }
    value
}

/// Compute processes other than MPS servers, and the memory in use minus what MPS servers hold.
fn foreign(reading: &GpuReading) -> (Vec<u32>, u64) {
    let mut pids = Vec::new();
    let mut mps_memory = 0;
    for process in &reading.processes {
        if process.is_mps_server() {
            mps_memory += process.used_memory_mib.unwrap_or(0);
        } else {
            pids.push(process.pid);
        }
    }
    (pids, reading.memory_used_mib.saturating_sub(mps_memory))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{GpuProcess, MPS_SERVER_PROCESS};

    fn reading(index: u32, memory_used_mib: u64, pids: &[u32]) -> GpuReading {
        GpuReading {
            index,
            memory_used_mib,
            processes: pids.iter().map(|&pid| GpuProcess { pid, used_memory_mib: None, name: None }).collect(),
            ..Default::default()
        }
    }

    fn hygiene(dir: &tempfile::TempDir) -> Hygiene {
        Hygiene::new(HygieneConfig::default(), Some(dir.path().join("gpu-leaks.jsonl")))
    }

    #[test]
    fn leaked_memory_makes_a_device_dirty_until_released() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = hygiene(&dir);
        h.start(&[reading(0, 400, &[]), reading(1, 400, &[])]);
        assert!(h.inspect(&[reading(0, 450, &[])], &[0]).is_empty(), "within tolerance");

        let findings = h.inspect(&[reading(0, 2448, &[]), reading(1, 9999, &[])], &[0]);
        assert_eq!(findings.len(), 1, "only the job's gpus are inspected");
        assert_eq!(findings[0].leaked_mib, 2048);
        h.mark_dirty(7, 3, findings);
        assert!(h.is_dirty(0) && !h.is_dirty(1));
        assert_eq!(h.leaks()[0].job_id, Some(7));

        assert!(h.recheck(&[reading(0, 2448, &[])]).is_empty());
        assert_eq!(h.recheck(&[reading(0, 410, &[])]), [0]);
        assert!(!h.is_dirty(0));

        let log = std::fs::read_to_string(dir.path().join("gpu-leaks.jsonl")).expect("record file");
        let lines: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        assert_eq!(lines.len(), 2, "{log}");
        assert_eq!(lines[0]["event"], "dirty");
        assert_eq!(lines[0]["job_id"], 7);
        assert_eq!(lines[0]["gpu"], 0);
        assert_eq!(lines[0]["leaked_mib"], 2048);
        assert_eq!(lines[1]["event"], "clean");
    }

    #[test]
    fn stray_processes_are_a_leak_but_mps_servers_are_not() {
        let h = Hygiene::new(HygieneConfig::default(), None);
        h.start(&[reading(0, 300, &[])]);
        let stray = h.inspect(&[reading(0, 300, &[4242])], &[0]);
        assert_eq!(stray[0].pids, [4242]);
        assert!(stray[0].reason.contains("4242"), "{}", stray[0].reason);

        let mut with_mps = reading(0, 800, &[]);
        with_mps.processes.push(GpuProcess {
            pid: 99,
            used_memory_mib: Some(500),
            name: Some(MPS_SERVER_PROCESS.into()),
        });
        assert!(h.inspect(&[with_mps], &[0]).is_empty());
    }

    #[test]
    fn busy_devices_at_start_are_dirty_without_a_job() {
        let h = Hygiene::new(HygieneConfig::default(), None);
        let mut lost = reading(1, 0, &[]);
        lost.error = Some("gpu has fallen off the bus".into());
        h.start(&[reading(0, 5000, &[123]), lost]);
        let leaks = h.leaks();
        assert_eq!(leaks.len(), 2);
        assert_eq!(leaks[0].job_id, None);
        // Once the process is gone the device is clean, and its baseline is taken then.
        assert!(h.recheck_due());
        assert_eq!(h.recheck(&[reading(0, 350, &[])]), [0]);
        assert!(!h.recheck_due(), "rechecks are spaced by the interval");
        assert!(h.inspect(&[reading(0, 360, &[])], &[0]).is_empty());
        assert!(h.is_dirty(1));
    }

    #[test]
    fn a_clean_check_lowers_the_baseline() {
        let h = Hygiene::new(HygieneConfig { memory_tolerance_mib: 10, ..Default::default() }, None);
        h.start(&[reading(0, 500, &[])]);
        h.note_clean(&[reading(0, 300, &[])], &[0]);
        assert_eq!(h.inspect(&[reading(0, 400, &[])], &[0])[0].leaked_mib, 100);
    }
}
