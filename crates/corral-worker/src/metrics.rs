//! Prometheus metrics of a worker (names fixed by the metrics contract, see README "Metrics"):
//! GPU series under dcgm-exporter's names from the backend's last reading, GPU hygiene and
//! health, heartbeat age, and the usage of each running job's cgroup.
//!
//! Values are those of the last heartbeat's GPU reading, so what is scraped agrees with what
//! the coordinator was told; nothing here calls the GPU driver.

use crate::devices::{Devices, GpuSample};
use crate::jobs::{JobSample, JobTable};
use crate::link::Link;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

type Labels = Vec<(String, String)>;
type IntGauges = Family<Labels, Gauge>;
type FloatGauges = Family<Labels, Gauge<f64, AtomicU64>>;

/// Everything a scrape exports, gathered from the devices, the job table and the link, and
/// encoded after.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Snapshot {
    pub hostname: String,
    pub gpus: Vec<GpuSample>,
    /// Seconds since the coordinator last accepted a heartbeat (since the worker started, if
    /// none was accepted yet).
    pub heartbeat_age_secs: f64,
    pub jobs: Vec<JobSample>,
}

fn pairs(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Registers the series of `snapshot`.
#[cfg(test)]
pub(crate) fn register(snapshot: &Snapshot, registry: &mut Registry) {
    register_all(std::slice::from_ref(snapshot), registry);
}

/// Registers the series of several workers' snapshots, each family once (every series names
/// its `Hostname`), so one document holds them all.
pub(crate) fn register_all(snapshots: &[Snapshot], registry: &mut Registry) {
    let temp = IntGauges::default();
    let util = IntGauges::default();
    let fb_used = IntGauges::default();
    let fb_free = IntGauges::default();
    let power = FloatGauges::default();
    let xid = IntGauges::default();
    let dirty = IntGauges::default();
    let healthy = IntGauges::default();
    let age = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    let running = IntGauges::default();
    let memory = IntGauges::default();
    let cpu = Family::<Labels, Counter<f64, AtomicU64>>::default();
    for snapshot in snapshots {
        fill(snapshot, [&temp, &util, &fb_used, &fb_free, &xid, &dirty, &healthy], &power);
        let host = snapshot.hostname.as_str();
        age.get_or_create(&pairs(&[("Hostname", host)])).set(snapshot.heartbeat_age_secs);
        running.get_or_create(&pairs(&[("Hostname", host)])).set(snapshot.jobs.len() as i64);
        for job in &snapshot.jobs {
            let id = job.job_id.to_string();
            let labels = pairs(&[("job_id", &id), ("tenant", &job.tenant), ("Hostname", host)]);
            if let Some(bytes) = job.usage.memory_bytes {
                memory.get_or_create(&labels).set(clamp(bytes));
            }
            if let Some(seconds) = job.usage.cpu_seconds {
                cpu.get_or_create(&labels).inc_by(seconds);
            }
        }
    }
    registry.register("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)", temp);
    registry.register("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)", util);
    registry.register("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)", fb_used);
    registry.register("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)", fb_free);
    registry.register("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)", power);
    registry.register("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered (0: none)", xid);
    registry.register("corral_gpu_dirty", "1 if post-job hygiene found the GPU left dirty", dirty);
    registry.register("corral_gpu_healthy", "1 if the GPU passes the health policy", healthy);
    registry.register(
        "corral_worker_heartbeat_age_seconds",
        "Seconds since the coordinator last accepted a heartbeat",
        age,
    );
    registry.register("corral_worker_jobs_running", "Jobs whose processes run on this worker", running);
    registry.register("corral_job_memory_bytes", "Memory used by the job's cgroup", memory);
    registry.register("corral_job_cpu_seconds", "CPU time used by the job's cgroup", cpu);
}

/// The GPU series of one worker's snapshot: temperature, utilisation, memory used and free,
/// XID, dirty and healthy (`ints`, in that order) and power.
fn fill(snapshot: &Snapshot, ints: [&IntGauges; 7], power: &FloatGauges) {
    let [temp, util, fb_used, fb_free, xid, dirty, healthy] = ints;
    let host = snapshot.hostname.as_str();
    for gpu in &snapshot.gpus {
        let r = &gpu.reading;
        let index = r.index.to_string();
        let dcgm = pairs(&[
            ("gpu", &index),
            ("UUID", &gpu.uuid),
            ("device", &gpu.device),
            ("modelName", &gpu.model),
            ("Hostname", host),
        ]);
        let short = pairs(&[("gpu", &index), ("UUID", &gpu.uuid), ("Hostname", host)]);
        // An unreadable device (fallen off the bus) has no readings to show, only its XIDs
        // and its health.
        if r.error.is_none() {
            temp.get_or_create(&dcgm).set(i64::from(r.temperature_c));
            util.get_or_create(&dcgm).set(i64::from(r.utilization_percent));
            fb_used.get_or_create(&dcgm).set(clamp(r.memory_used_mib));
            fb_free.get_or_create(&dcgm).set(clamp(gpu.total_mib.saturating_sub(r.memory_used_mib)));
            power.get_or_create(&dcgm).set(r.power_mw as f64 / 1000.0);
        }
        xid.get_or_create(&dcgm).set(clamp(r.last_xid.unwrap_or(0)));
        dirty.get_or_create(&short).set(i64::from(gpu.dirty));
        healthy.get_or_create(&short).set(i64::from(gpu.healthy));
    }
}

/// The metrics of one worker, to register at every scrape (see `Worker::metrics`).
#[derive(Clone)]
pub struct WorkerMetrics {
    hostname: String,
    devices: Arc<Devices>,
    jobs: Arc<JobTable>,
    link: Arc<Link>,
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMetrics").finish_non_exhaustive()
    }
}

impl WorkerMetrics {
    /// The metrics of node `hostname`, read from the owners of what they show.
    pub(crate) fn new(hostname: String, devices: Arc<Devices>, jobs: Arc<JobTable>, link: Arc<Link>) -> Self {
        WorkerMetrics { hostname, devices, jobs, link }
    }

    /// What a scrape exports now: the last heartbeat's GPU reading with hygiene and health,
    /// the heartbeat's age, and the cgroup usage of every running job.
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            hostname: self.hostname.clone(),
            gpus: self.devices.samples(),
            heartbeat_age_secs: self.link.heartbeat_age().as_secs_f64(),
            jobs: self.jobs.samples(),
        }
    }

    /// Registers the series of `workers` into `registry` (a fresh one per scrape), each family
    /// once, so several workers of one process (`corral dev --nodes N`) share one document.
    /// Reads the running jobs' cgroup files.
    pub fn collect_all(workers: &[WorkerMetrics], registry: &mut Registry) {
        let snapshots: Vec<Snapshot> = workers.iter().map(WorkerMetrics::snapshot).collect();
        register_all(&snapshots, registry);
    }

    /// Registers this worker's series into `registry` (a fresh one per scrape). Reads the
    /// running jobs' cgroup files.
    pub fn collect(&self, registry: &mut Registry) {
        register_all(std::slice::from_ref(&self.snapshot()), registry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::CgroupUsage;
    use crate::gpu::{GpuBackend, SimulatedConfig, SimulatedGpus};
    use crate::health::{HealthPolicy, HealthTracker};

    fn encode(snapshot: &Snapshot) -> String {
        let mut registry = Registry::default();
        register(snapshot, &mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        text
    }

    /// Samples of a simulated host's devices, as the worker builds them from a reading.
    fn samples(gpus: &SimulatedGpus, allocated: &[u32]) -> Vec<GpuSample> {
        let readings = gpus.read(allocated);
        let mut health = HealthTracker::new(HealthPolicy::default());
        health.update(&readings);
        gpus.devices()
            .into_iter()
            .zip(readings)
            .map(|(device, reading)| GpuSample {
                uuid: device.uuid,
                device: format!("nvidia{}", device.index),
                model: device.model,
                total_mib: device.memory_mib,
                dirty: false,
                healthy: health.is_healthy(reading.index),
                reading,
            })
            .collect()
    }

    #[test]
    fn simulated_gpus_export_dcgm_names_and_labels() {
        let dir = tempfile::tempdir().expect("tempdir");
        let faults = dir.path().join("faults.toml");
        std::fs::write(&faults, "[[gpu]]\nindex = 1\ntemperature-c = 95\nxid = [79]\n").expect("faults");
        let gpus = SimulatedGpus::new(SimulatedConfig { count: 2, host: "h1".into(), ..Default::default() })
            .with_faults_file(&faults);
        let uuid0 = gpus.devices()[0].uuid.clone();
        let uuid1 = gpus.devices()[1].uuid.clone();
        let mut gpu_samples = samples(&gpus, &[0]);
        gpu_samples[0].dirty = true;
        let snapshot = Snapshot {
            hostname: "h1".into(),
            gpus: gpu_samples,
            heartbeat_age_secs: 0.5,
            jobs: vec![JobSample {
                job_id: 7,
                tenant: "team-a".into(),
                usage: CgroupUsage { memory_bytes: Some(1 << 20), cpu_seconds: Some(2.5) },
            }],
        };
        let text = encode(&snapshot);
        let dcgm = |gpu: u32, uuid: &str| {
            format!("{{gpu=\"{gpu}\",UUID=\"{uuid}\",device=\"nvidia{gpu}\",modelName=\"RTX 5090\",Hostname=\"h1\"}}")
        };
        let expected = [
            "# TYPE DCGM_FI_DEV_GPU_TEMP gauge".to_string(),
            format!("DCGM_FI_DEV_GPU_TEMP{} 65", dcgm(0, &uuid0)),
            format!("DCGM_FI_DEV_GPU_TEMP{} 95", dcgm(1, &uuid1)),
            format!("DCGM_FI_DEV_GPU_UTIL{} 100", dcgm(0, &uuid0)),
            format!("DCGM_FI_DEV_GPU_UTIL{} 0", dcgm(1, &uuid1)),
            format!("DCGM_FI_DEV_FB_USED{} 8192", dcgm(0, &uuid0)),
            format!("DCGM_FI_DEV_FB_FREE{} 24576", dcgm(0, &uuid0)),
            format!("DCGM_FI_DEV_POWER_USAGE{} 450.0", dcgm(0, &uuid0)),
            format!("DCGM_FI_DEV_POWER_USAGE{} 30.0", dcgm(1, &uuid1)),
            format!("DCGM_FI_DEV_XID_ERRORS{} 0", dcgm(0, &uuid0)),
            format!("DCGM_FI_DEV_XID_ERRORS{} 79", dcgm(1, &uuid1)),
            format!("corral_gpu_dirty{{gpu=\"0\",UUID=\"{uuid0}\",Hostname=\"h1\"}} 1"),
            format!("corral_gpu_dirty{{gpu=\"1\",UUID=\"{uuid1}\",Hostname=\"h1\"}} 0"),
            format!("corral_gpu_healthy{{gpu=\"0\",UUID=\"{uuid0}\",Hostname=\"h1\"}} 1"),
            format!("corral_gpu_healthy{{gpu=\"1\",UUID=\"{uuid1}\",Hostname=\"h1\"}} 0"),
            "corral_worker_heartbeat_age_seconds{Hostname=\"h1\"} 0.5".to_string(),
            "corral_worker_jobs_running{Hostname=\"h1\"} 1".to_string(),
            "corral_job_memory_bytes{job_id=\"7\",tenant=\"team-a\",Hostname=\"h1\"} 1048576".to_string(),
            "# TYPE corral_job_cpu_seconds counter".to_string(),
            "corral_job_cpu_seconds_total{job_id=\"7\",tenant=\"team-a\",Hostname=\"h1\"} 2.5".to_string(),
        ];
        for line in &expected {
            assert!(text.lines().any(|l| l == line), "missing `{line}` in:\n{text}");
        }
    }

    #[test]
    fn an_unreadable_gpu_exports_only_its_xid_and_health() {
        let dir = tempfile::tempdir().expect("tempdir");
        let faults = dir.path().join("faults.toml");
        std::fs::write(&faults, "[[gpu]]\nindex = 0\nlost = true\nxid = [79]\n").expect("faults");
        let gpus = SimulatedGpus::new(SimulatedConfig { count: 1, host: "h1".into(), ..Default::default() })
            .with_faults_file(&faults);
        let snapshot =
            Snapshot { hostname: "h1".into(), gpus: samples(&gpus, &[]), heartbeat_age_secs: 0.0, jobs: vec![] };
        let text = encode(&snapshot);
        assert!(!text.lines().any(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("DCGM_FI_DEV_XID_ERRORS{") && l.ends_with(" 79")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("corral_gpu_healthy{") && l.ends_with(" 0")), "{text}");
        assert!(text.contains("corral_worker_jobs_running{Hostname=\"h1\"} 0"), "{text}");
    }
}
