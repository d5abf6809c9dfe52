//! The devices of this worker: the GPU backend, each device's static facts (re-read when the
//! MIG layout changes), post-job hygiene (`hygiene.rs`), the health policy (`health.rs`), the
//! MPS daemons (`mps.rs`) and the reading the last heartbeat carried. One `Mutex<State>` for
//! what changes, behind methods; driver calls run off the lock (reads on the blocking pool).
//!
//! Which GPUs runs hold is the job table's (`jobs.rs`): the methods that read devices take it.

use crate::config::WorkerConfig;
use crate::gpu::{DeviceInfo, GpuBackend, GpuError, GpuReading, MigInstance, MigPlacement};
use crate::health::{GpuEvent, HealthTracker};
use crate::hygiene::Hygiene;
use crate::jobs::JobTable;
use crate::mps::{Mps, MpsAttachment};
use corral_types::{GpuDevice, GpuHealth, JobId};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Interval between two hygiene checks while a device settles after a job.
const SETTLE_POLL: Duration = Duration::from_millis(250);

/// One GPU as the metrics export it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuSample {
    pub uuid: String,
    /// Device node name, `nvidia<minor>`.
    pub device: String,
    pub model: String,
    /// Memory of the device.
    pub total_mib: u64,
    pub reading: GpuReading,
    /// Post-job hygiene found memory or processes left behind.
    pub dirty: bool,
    pub healthy: bool,
}

struct State {
    /// Static device facts, read at start; the MIG layout is re-read when it changes.
    info: Vec<DeviceInfo>,
    health: HealthTracker,
    /// The GPU reading of the last heartbeat (the metrics show it).
    last_readings: Vec<GpuReading>,
}

/// The GPUs of this worker and what it knows of them.
pub(crate) struct Devices {
    backend: Arc<dyn GpuBackend>,
    hygiene: Hygiene,
    mps: Mps,
    state: Mutex<State>,
}

impl Devices {
    /// The devices of `backend`, with the hygiene, health and MPS settings of `config`. Nothing
    /// is read yet: see [`Devices::inspect`].
    pub(crate) fn new(backend: Arc<dyn GpuBackend>, config: &WorkerConfig) -> Devices {
        Devices {
            backend,
            hygiene: Hygiene::new(config.hygiene.clone(), Some(config.leak_record_file())),
            mps: Mps::new(&config.mps, config.data_dir.join("mps")),
            state: Mutex::new(State {
                info: Vec::new(),
                health: HealthTracker::new(config.health.clone()),
                last_readings: Vec::new(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The backend's short name (`simulated`, `nvml`).
    pub(crate) fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// The devices this node offers, as it registers.
    pub(crate) fn offered(&self) -> Vec<GpuDevice> {
        self.backend.devices()
    }

    /// Static facts of every device (PCI, NUMA, minor number, MIG layout).
    pub(crate) fn info(&self) -> Vec<DeviceInfo> {
        self.state().info.clone()
    }

    /// Re-reads the device facts after the MIG layout changed. Blocking.
    fn refresh_info(&self) {
        let info = self.backend.info();
        self.state().info = info;
    }

    /// Reads the devices once before any job runs: static facts, idle baselines, health.
    pub(crate) async fn inspect(&self) {
        let backend = Arc::clone(&self.backend);
        let (info, readings) =
            tokio::task::spawn_blocking(move || (backend.info(), backend.read(&[]))).await.unwrap_or_else(|e| {
                tracing::warn!(error = %e, "gpu inventory task failed");
                (Vec::new(), Vec::new())
            });
        for device in &info {
            tracing::info!(
                gpu = device.device.index,
                uuid = %device.device.uuid,
                model = %device.device.model,
                memory_mib = device.device.memory_mib,
                pci = ?device.pci_bus_id,
                numa = ?device.numa_node,
                mig = ?device.mig,
                "gpu"
            );
        }
        self.hygiene.start(&readings);
        let mut state = self.state();
        state.info = info;
        for event in state.health.update(&readings) {
            if let GpuEvent::Card { gpu, reason, .. } = event {
                tracing::error!(gpu, %reason, "card fault at worker start: the gpu stays out of placement");
            }
        }
        state.last_readings = readings;
    }

    /// Acts on new GPU events: a card fault stops every run on its GPU (the run is reported
    /// with the fault, requeued and credited); a job's own error is only logged.
    async fn attribute(&self, jobs: &JobTable, events: Vec<GpuEvent>) {
        for event in events {
            match event {
                GpuEvent::Card { gpu, reason, .. } => {
                    let runs = jobs.running_on_gpu(gpu);
                    if runs.is_empty() {
                        tracing::error!(gpu, %reason, "card fault: the gpu leaves placement");
                    }
                    for (job_id, epoch, handle) in runs {
                        tracing::error!(
                            job_id,
                            epoch,
                            gpu,
                            %reason,
                            "card fault on a running job's gpu: stopping the run (requeued without counting a restart)"
                        );
                        let _ = tokio::task::spawn_blocking(move || {
                            if let Err(e) = handle.kill_tree() {
                                tracing::warn!(job_id, error = %e, "kill failed");
                            }
                        })
                        .await;
                    }
                }
                GpuEvent::Job { gpu, reason } => {
                    let jobs: Vec<JobId> = jobs.running_on_gpu(gpu).into_iter().map(|(job, _, _)| job).collect();
                    tracing::warn!(gpu, ?jobs, %reason, "the job's own gpu error: the gpu stays in the pool");
                }
            }
        }
    }

    /// After a run's process is gone: reads its GPUs again and returns the card faults they
    /// had since `since` (the run's start) as (gpu, reason, seq): the faults the run ended with.
    pub(crate) async fn run_faults(&self, jobs: &JobTable, gpus: &[u32], since: Instant) -> Vec<(u32, String, u64)> {
        let readings = self.read(jobs).await;
        let events = self.state().health.update(&readings);
        self.attribute(jobs, events).await;
        let state = self.state();
        let faults = gpus.iter().filter_map(|&gpu| {
            let fault = state.health.card_fault(gpu).filter(|f| f.at >= since)?;
            Some((gpu, fault.reason.clone(), fault.seq))
        });
        faults.collect()
    }

    /// Creates a MIG instance of `profile` on `gpu` (see `GpuBackend::create_mig_instance`)
    /// and re-reads the layout. Blocking: a driver call of well under a second.
    pub(crate) fn create_mig_instance(
        &self,
        gpu: u32,
        profile: &str,
        placement: Option<MigPlacement>,
    ) -> Result<MigInstance, GpuError> {
        let created = self.backend.create_mig_instance(gpu, profile, placement)?;
        self.refresh_info();
        Ok(created)
    }

    /// Destroys a MIG device this worker created; a failure (e.g. a process still holds it) is
    /// logged and the instance stays, free for the next job of its profile. Blocking.
    pub(crate) fn destroy_mig_instance(&self, gpu: u32, uuid: &str) {
        if let Err(e) = self.backend.destroy_mig_instance(gpu, uuid) {
            tracing::warn!(gpu, uuid, error = %e, "cannot destroy the job's MIG instance; it stays for reuse");
        }
        self.refresh_info();
    }

    /// Makes sure an MPS daemon serves `gpu` (device `uuid`) and says how a job reaches it;
    /// `None` when MPS is simulated. Blocking (may start the daemon).
    pub(crate) fn attach_mps(&self, gpu: u32, uuid: &str) -> Result<Option<MpsAttachment>, String> {
        self.mps.attach(gpu, uuid)
    }

    /// Stops the MPS daemons this worker started. Blocking.
    pub(crate) fn shutdown_mps(&self) {
        self.mps.shutdown();
    }

    /// Reads every device off the async executor (driver calls block).
    async fn read(&self, jobs: &JobTable) -> Vec<GpuReading> {
        let backend = Arc::clone(&self.backend);
        let busy = jobs.busy_gpus();
        tokio::task::spawn_blocking(move || backend.read(&busy)).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "gpu reading task failed");
            Vec::new()
        })
    }

    /// After a run: waits (bounded by the settle time) until its GPUs are clean, else marks
    /// them dirty and attributes them to the run. GPUs another running job shares (MPS) are
    /// skipped: their memory is not the finished job's. Returns whether any became dirty.
    pub(crate) async fn check_hygiene(&self, jobs: &JobTable, job_id: u64, epoch: u64, gpus: &[u32]) -> bool {
        let shared_with_others = jobs.busy_gpus();
        let gpus: Vec<u32> = gpus.iter().copied().filter(|g| !shared_with_others.contains(g)).collect();
        if gpus.is_empty() {
            return false;
        }
        let deadline = Instant::now() + self.hygiene.config().settle_time;
        loop {
            let readings = self.read(jobs).await;
            let findings = self.hygiene.inspect(&readings, &gpus);
            if findings.is_empty() {
                self.hygiene.note_clean(&readings, &gpus);
                return false;
            }
            if Instant::now() >= deadline {
                self.hygiene.mark_dirty(job_id, epoch, findings);
                return true;
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }

    /// Reads every device for a heartbeat: dirty devices are checked again when due, the
    /// health policy judges the reading, which is kept for the metrics. Returns each device's
    /// health as the heartbeat carries it.
    pub(crate) async fn heartbeat_health(&self, jobs: &JobTable) -> Vec<GpuHealth> {
        let readings = self.read(jobs).await;
        if self.hygiene.recheck_due() {
            self.hygiene.recheck(&readings);
        }
        let leaks = self.hygiene.leaks();
        let events = self.state().health.update(&readings);
        self.attribute(jobs, events).await;
        let mut state = self.state();
        let gpus = readings
            .iter()
            .map(|r| {
                let leak = leaks.iter().find(|l| l.finding.gpu == r.index);
                GpuHealth {
                    problems: state.health.problems(r.index).to_vec(),
                    dirty_reason: leak.map(|l| l.finding.reason.clone()).unwrap_or_default(),
                    dirty_job_id: leak.and_then(|l| l.job_id),
                    fault_seq: state.health.fault_seq(r.index),
                    card_fault: state.health.card_fault(r.index).map(|f| f.reason.clone()).unwrap_or_default(),
                    ..r.to_health(self.hygiene.is_dirty(r.index))
                }
            })
            .collect();
        state.last_readings = readings;
        gpus
    }

    /// The last heartbeat's reading of every device with its facts, hygiene and health.
    pub(crate) fn samples(&self) -> Vec<GpuSample> {
        let state = self.state();
        let samples = state.last_readings.iter().map(|reading| {
            let device = state.info.iter().find(|d| d.device.index == reading.index);
            GpuSample {
                uuid: device.map(|d| d.device.uuid.clone()).unwrap_or_default(),
                device: format!("nvidia{}", device.and_then(|d| d.minor).unwrap_or(reading.index)),
                model: device.map(|d| d.device.model.clone()).unwrap_or_default(),
                total_mib: device.map_or(0, |d| d.device.memory_mib),
                dirty: self.hygiene.is_dirty(reading.index),
                healthy: state.health.is_healthy(reading.index),
                reading: reading.clone(),
            }
        });
        samples.collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::JobHandle;
    use crate::gpu::simulated::{Faults, GpuFault};
    use crate::gpu::{SimulatedConfig, SimulatedGpus};
    use crate::hygiene::HygieneConfig;
    use crate::jobs::StartedRun;
    use std::path::{Path, PathBuf};

    /// Two simulated GPUs with their faults file, a short settle time and rechecks at every
    /// heartbeat.
    fn devices(dir: &Path) -> (Devices, PathBuf) {
        let faults = dir.join("faults.toml");
        let gpus = SimulatedGpus::new(SimulatedConfig { count: 2, host: "h1".into(), ..Default::default() })
            .with_faults_file(&faults);
        let mut config = WorkerConfig::for_host("h1".into(), dir.to_path_buf());
        config.hygiene = HygieneConfig {
            memory_tolerance_mib: 128,
            settle_time: Duration::from_millis(100),
            recheck_interval: Duration::ZERO,
        };
        config.mps.enabled = false;
        (Devices::new(Arc::new(gpus), &config), faults)
    }

    fn inject(path: &Path, gpu: Vec<GpuFault>) {
        Faults { gpu }.write_to(path).expect("write the faults");
    }

    #[tokio::test]
    async fn a_leak_after_a_run_makes_its_gpu_dirty_until_a_heartbeat_finds_it_clean() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (devices, faults) = devices(dir.path());
        let jobs = JobTable::default();
        devices.inspect().await;
        assert!(devices.samples().iter().all(|s| !s.dirty && s.healthy));

        inject(&faults, vec![GpuFault { index: 0, leaked_memory_mib: 4096, ..Default::default() }]);
        assert!(devices.check_hygiene(&jobs, 7, 2, &[0]).await, "memory left behind past the settle time");
        let health = devices.heartbeat_health(&jobs).await;
        assert!(health[0].dirty && !health[1].dirty, "{health:?}");
        assert_eq!(health[0].dirty_job_id, Some(7), "the leak is the run's");
        assert!(health[0].dirty_reason.contains("4096 MiB"), "{}", health[0].dirty_reason);
        let dirty: Vec<bool> = devices.samples().iter().map(|s| s.dirty).collect();
        assert_eq!(dirty, [true, false]);

        // A GPU another running job shares: its memory is not the finished run's.
        let handle = JobHandle::detached(8);
        let run = StartedRun { tenant: "team-a".into(), gpus: vec![1], handle, mig_uuid: None };
        jobs.started(8, 1, run);
        inject(&faults, vec![GpuFault { index: 1, leaked_memory_mib: 4096, ..Default::default() }]);
        assert!(!devices.check_hygiene(&jobs, 9, 1, &[1]).await);

        inject(&faults, Vec::new());
        let health = devices.heartbeat_health(&jobs).await;
        assert!(health.iter().all(|h| !h.dirty && h.dirty_reason.is_empty()), "{health:?}");
    }

    #[tokio::test]
    async fn an_overheating_gpu_is_unhealthy_in_the_heartbeat_and_the_metrics() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (devices, faults) = devices(dir.path());
        inject(&faults, vec![GpuFault { index: 1, temperature_c: Some(95), ..Default::default() }]);
        devices.inspect().await;
        let health = devices.heartbeat_health(&JobTable::default()).await;
        assert!(health[0].problems.is_empty() && !health[1].problems.is_empty(), "{health:?}");
        let samples = devices.samples();
        let seen: Vec<(&str, bool, u32)> =
            samples.iter().map(|s| (s.device.as_str(), s.healthy, s.reading.temperature_c)).collect();
        assert_eq!(seen, [("nvidia0", true, 35), ("nvidia1", false, 95)]);
        assert_eq!(samples[0].uuid, devices.offered()[0].uuid);
    }
}
