//! Simulated GPUs for hosts without NVIDIA hardware (and for tests), with fault injection.
//!
//! Faults come from a TOML file (by convention `<data-dir>/faults.toml`, see
//! [`SimulatedGpus::with_faults_file`]) that is re-read at every reading, i.e. at every
//! heartbeat, so a test or an operator outside the worker process can make a device misbehave
//! and heal it again:
//!
//! ```toml
//! [[gpu]]
//! index = 0
//! temperature-c = 97        # overheat: the reported temperature
//! xid = [79]                # XID errors (see xid.rs: 13 the job's, 79 the card's); append
//!                           # a code to inject one more (the last one is reported)
//! leaked-memory-mib = 2048  # device memory that stays in use after jobs end
//! stray-pids = [4242]       # compute processes the device reports
//! ecc-uncorrected = 1       # uncorrected ECC errors
//! lost = false              # true: the device fell off the bus
//! utilization-pct = 0       # the utilisation reported (default: 100 busy, 0 idle)
//! ```
//!
//! Removing an entry (or the file) heals the device, except the XID counter, which only grows.
//!
//! A device declared with `mig = true` behaves like a MIG-capable card with MIG mode on and no
//! instances yet: instances are created and destroyed in memory, with the card's limits (7
//! compute slices, 8 memory slices, no overlap), so the worker's MIG management runs here too.
//! Write the file atomically (write a temp file, then rename it over) so a reading never sees
//! half of it; a file that does not parse is reported once and the previous faults stay.

use super::{
    parse_mig_profile, process_name, DeviceInfo, GpuBackend, GpuError, GpuProcess, GpuReading, MigInstance,
    MigPlacement, MigState,
};
use corral_types::GpuDevice;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What to simulate: `count` identical devices.
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

/// One simulated device of a mixed host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulatedDevice {
    pub model: String,
    pub memory_mib: u64,
    /// MIG-capable with MIG mode on.
    pub mig: bool,
}

/// Compute and memory slices of a simulated MIG card.
const MIG_COMPUTE_SLICES: u32 = 7;
const MIG_MEMORY_SLICES: u32 = 8;

/// One simulated MIG instance.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SimMig {
    uuid: String,
    profile: String,
    compute_slices: u32,
    start: u32,
    memory_slices: u32,
    memory_mib: u64,
}

/// Injected misbehaviour of the simulated devices: the content of the faults file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Faults {
    #[serde(default)]
    pub gpu: Vec<GpuFault>,
}

/// Faults of one device (by index).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct GpuFault {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub xid: Vec<u64>,
    #[serde(default)]
    pub leaked_memory_mib: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stray_pids: Vec<u32>,
    #[serde(default)]
    pub ecc_uncorrected: u64,
    #[serde(default)]
    pub lost: bool,
    /// The utilisation the device reports (default: 100 busy, 0 idle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_pct: Option<u32>,
}

impl Faults {
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string().replace('\n', " "))
    }

    /// Writes the faults atomically to `path` (temp file + rename), for tests and tools.
    pub fn write_to(&self, path: &Path) -> std::io::Result<()> {
        let text = toml::to_string(self).map_err(std::io::Error::other)?;
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    }

    fn for_gpu(&self, index: u32) -> Option<&GpuFault> {
        self.gpu.iter().find(|f| f.index == index)
    }
}

#[derive(Debug, Default)]
struct FaultState {
    /// The last faults that parsed.
    faults: Faults,
    /// The last parse or read error reported, so it is logged once.
    last_error: Option<String>,
    /// XIDs counted so far per device: the counter never goes down.
    xid_seen: BTreeMap<u32, u64>,
}

/// Simulated GPUs: idle devices sit at 35 C, busy ones at 65 C and use a quarter of their
/// memory; faults from the faults file are layered on top.
#[derive(Debug)]
pub struct SimulatedGpus {
    devices: Vec<GpuDevice>,
    faults_file: Option<PathBuf>,
    state: Mutex<FaultState>,
    /// MIG instances per device index; present only for MIG devices.
    mig: Mutex<BTreeMap<u32, Vec<SimMig>>>,
    /// Numbers the MIG UUIDs handed out.
    mig_serial: std::sync::atomic::AtomicU64,
}

impl SimulatedGpus {
    /// `config.count` identical devices, without fault injection.
    pub fn new(config: SimulatedConfig) -> Self {
        let specs = vec![
            SimulatedDevice { model: config.model, memory_mib: config.memory_mib, mig: false };
            config.count as usize
        ];
        Self::with_devices(&config.host, &specs)
    }

    /// The given devices, in index order, without fault injection.
    pub fn with_devices(host: &str, specs: &[SimulatedDevice]) -> Self {
        let devices = specs
            .iter()
            .zip(0u32..)
            .map(|(spec, index)| GpuDevice {
                index,
                uuid: simulated_uuid(host, index),
                model: spec.model.clone(),
                memory_mib: spec.memory_mib,
                mig_capable: spec.mig,
                ..Default::default()
            })
            .collect();
        let mig = specs.iter().zip(0u32..).filter(|(spec, _)| spec.mig).map(|(_, index)| (index, Vec::new())).collect();
        SimulatedGpus {
            devices,
            faults_file: None,
            state: Mutex::new(FaultState::default()),
            mig: Mutex::new(mig),
            mig_serial: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Re-reads faults from `path` at every reading; a missing file means no faults.
    pub fn with_faults_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.faults_file = Some(path.into());
        self
    }

    pub fn faults_file(&self) -> Option<&Path> {
        self.faults_file.as_deref()
    }

    /// Loads the faults file into the state (keeping the previous faults if it is broken).
    fn refresh(&self, state: &mut FaultState) {
        let Some(path) = &self.faults_file else { return };
        let loaded = match std::fs::read_to_string(path) {
            Ok(text) => Faults::parse(&text).map_err(|e| format!("cannot parse {}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Faults::default()),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        };
        match loaded {
            Ok(faults) => {
                if faults != state.faults {
                    tracing::info!(file = %path.display(), ?faults, "simulated gpu faults changed");
                }
                state.faults = faults;
                state.last_error = None;
            }
            Err(e) => {
                if state.last_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "ignoring the simulated faults file; fix it to change the faults");
                    state.last_error = Some(e);
                }
            }
        }
    }
}

/// A stable UUID per (host, index): FNV-1a of the host name, so hosts never share one.
fn simulated_uuid(host: &str, index: u32) -> String {
    let hash = host.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-sim0-{:012x}",
        (hash >> 32) as u32,
        (hash >> 16) as u16,
        index,
        hash & 0xffff_ffff_ffff
    )
}

impl GpuBackend for SimulatedGpus {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn driver_version(&self) -> Option<String> {
        Some("simulated".into())
    }

    fn devices(&self) -> Vec<GpuDevice> {
        self.devices.clone()
    }

    fn info(&self) -> Vec<DeviceInfo> {
        let mig = self.mig.lock().unwrap_or_else(|p| p.into_inner());
        self.devices
            .iter()
            .map(|device| {
                let mut info = DeviceInfo::plain(device.clone());
                if let Some(instances) = mig.get(&device.index) {
                    info.mig = MigState::Enabled {
                        instances: instances
                            .iter()
                            .map(|m| MigInstance {
                                uuid: m.uuid.clone(),
                                profile: Some(m.profile.clone()),
                                memory_mib: m.memory_mib,
                            })
                            .collect(),
                    };
                }
                info
            })
            .collect()
    }

    fn create_mig_instance(
        &self,
        index: u32,
        profile: &str,
        placement: Option<MigPlacement>,
    ) -> Result<MigInstance, GpuError> {
        let error = |detail: String| GpuError::Mig { index, detail };
        let device = self.devices.iter().find(|d| d.index == index).ok_or_else(|| error("no such device".into()))?;
        let mut mig = self.mig.lock().unwrap_or_else(|p| p.into_inner());
        let instances = mig.get_mut(&index).ok_or_else(|| error("MIG mode is off (not a MIG device)".into()))?;
        let (compute_slices, memory_gb) = parse_mig_profile(profile)
            .filter(|(c, _)| *c <= MIG_COMPUTE_SLICES)
            .ok_or_else(|| error(format!("MIG profile {profile} is not offered by this device")))?;
        let slice_mib = (device.memory_mib / u64::from(MIG_MEMORY_SLICES)).max(1);
        let memory_slices = u32::try_from((memory_gb * 1024).div_ceil(slice_mib)).unwrap_or(u32::MAX);
        if memory_slices > MIG_MEMORY_SLICES {
            return Err(error(format!("MIG profile {profile} is not offered by this device")));
        }
        let used_compute: u32 = instances.iter().map(|m| m.compute_slices).sum();
        if used_compute + compute_slices > MIG_COMPUTE_SLICES {
            return Err(error(format!("no room for a {profile} instance: {used_compute} of 7 compute slices in use")));
        }
        let free = |start: u32| {
            start + memory_slices <= MIG_MEMORY_SLICES
                && instances.iter().all(|m| start + memory_slices <= m.start || m.start + m.memory_slices <= start)
        };
        let start = match placement {
            Some(p) if free(p.start) => p.start,
            _ => (0..MIG_MEMORY_SLICES)
                .find(|s| free(*s))
                .ok_or_else(|| error(format!("no room for a {profile} instance: memory slices taken")))?,
        };
        let serial = self.mig_serial.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let parent = device.uuid.trim_start_matches("GPU-");
        let created = SimMig {
            uuid: format!("MIG-{parent}-{serial:04x}"),
            profile: profile.to_owned(),
            compute_slices,
            start,
            memory_slices,
            memory_mib: u64::from(memory_slices) * slice_mib,
        };
        tracing::info!(gpu = index, profile, start, uuid = %created.uuid, "created a simulated MIG instance");
        let instance = MigInstance {
            uuid: created.uuid.clone(),
            profile: Some(created.profile.clone()),
            memory_mib: created.memory_mib,
        };
        instances.push(created);
        Ok(instance)
    }

    fn destroy_mig_instance(&self, index: u32, uuid: &str) -> Result<(), GpuError> {
        let mut mig = self.mig.lock().unwrap_or_else(|p| p.into_inner());
        let instances = mig.get_mut(&index).ok_or_else(|| GpuError::Mig { index, detail: "MIG mode is off".into() })?;
        let before = instances.len();
        instances.retain(|m| m.uuid != uuid);
        if instances.len() == before {
            return Err(GpuError::Mig { index, detail: format!("no MIG device {uuid}") });
        }
        tracing::info!(gpu = index, uuid, "destroyed a simulated MIG instance");
        Ok(())
    }

    fn read(&self, allocated: &[u32]) -> Vec<GpuReading> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refresh(&mut state);
        let state = &mut *state;
        self.devices
            .iter()
            .map(|device| {
                let index = device.index;
                let busy = allocated.contains(&index);
                let fault = state.faults.for_gpu(index).cloned().unwrap_or_default();
                let seen = state.xid_seen.entry(index).or_insert(0);
                *seen = (*seen).max(fault.xid.len() as u64);
                if fault.lost {
                    return GpuReading {
                        index,
                        xid_errors: *seen,
                        last_xid: fault.xid.last().copied(),
                        error: Some("gpu has fallen off the bus (simulated)".into()),
                        ..Default::default()
                    };
                }
                let job_memory = if busy { device.memory_mib / 4 } else { 0 };
                GpuReading {
                    index,
                    temperature_c: fault.temperature_c.unwrap_or(if busy { 65 } else { 35 }),
                    utilization_percent: fault.utilization_pct.unwrap_or(if busy { 100 } else { 0 }).min(100),
                    memory_used_mib: (job_memory + fault.leaked_memory_mib).min(device.memory_mib),
                    power_mw: if busy { 450_000 } else { 30_000 },
                    xid_errors: *seen,
                    last_xid: fault.xid.last().copied(),
                    ecc_uncorrected: fault.ecc_uncorrected,
                    processes: fault
                        .stray_pids
                        .iter()
                        .map(|&pid| GpuProcess { pid, used_memory_mib: None, name: process_name(pid) })
                        .collect(),
                    error: None,
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
        assert!(health.iter().all(|h| !h.dirty));
    }

    #[test]
    fn mixed_devices_keep_their_order() {
        let gpus = SimulatedGpus::with_devices(
            "h",
            &[
                SimulatedDevice { model: "H200".into(), memory_mib: 143_771, mig: false },
                SimulatedDevice { model: "RTX 5090".into(), memory_mib: 32_768, mig: false },
            ],
        );
        let devices = gpus.devices();
        assert_eq!(
            devices.iter().map(|d| (d.index, d.model.as_str())).collect::<Vec<_>>(),
            [(0, "H200"), (1, "RTX 5090")]
        );
        assert_eq!(gpus.info()[1].device, devices[1]);
    }

    #[test]
    fn faults_file_is_reread_and_heals() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("faults.toml");
        let gpus = SimulatedGpus::new(SimulatedConfig { count: 2, ..Default::default() }).with_faults_file(&file);
        assert_eq!(gpus.read(&[]), SimulatedGpus::new(SimulatedConfig { count: 2, ..Default::default() }).read(&[]));

        std::fs::write(
            &file,
            "[[gpu]]\nindex = 1\ntemperature-c = 97\nxid = [13, 79]\nleaked-memory-mib = 2048\nstray-pids = [1]\necc-uncorrected = 3\n",
        )
        .expect("write faults");
        let r = &gpus.read(&[])[1];
        assert_eq!(r.temperature_c, 97);
        assert_eq!((r.xid_errors, r.last_xid), (2, Some(79)));
        assert_eq!(r.memory_used_mib, 2048);
        assert_eq!(r.ecc_uncorrected, 3);
        assert_eq!(r.processes.iter().map(|p| p.pid).collect::<Vec<_>>(), [1]);
        assert_eq!(gpus.read(&[])[0].temperature_c, 35, "other devices unaffected");
        std::fs::write(&file, "[[gpu]]\nindex = 0\nutilization-pct = 3\n").expect("write faults");
        assert_eq!(gpus.read(&[0])[0].utilization_percent, 3, "a busy device as idle as told");
        std::fs::write(
            &file,
            "[[gpu]]\nindex = 1\ntemperature-c = 97\nxid = [13, 79]\nleaked-memory-mib = 2048\nstray-pids = [1]\necc-uncorrected = 3\n",
        )
        .expect("write faults");
        assert_eq!(gpus.read(&[])[1].temperature_c, 97);

        // A broken file keeps the previous faults.
        std::fs::write(&file, "[[gpu]]\nindex = 1\ntemprature-c = 1\n").expect("write");
        assert_eq!(gpus.read(&[])[1].temperature_c, 97);

        // Healing: everything but the XID counter returns to normal.
        Faults::default().write_to(&file).expect("write faults");
        let r = &gpus.read(&[1])[1];
        assert_eq!(r.temperature_c, 65);
        assert_eq!(r.memory_used_mib, 32768 / 4);
        assert!(r.processes.is_empty());
        assert_eq!(r.xid_errors, 2, "the XID counter never goes down");
    }

    #[test]
    fn a_lost_device_reads_as_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("faults.toml");
        Faults { gpu: vec![GpuFault { index: 0, lost: true, ..Default::default() }] }
            .write_to(&file)
            .expect("write faults");
        let gpus = SimulatedGpus::new(SimulatedConfig { count: 1, ..Default::default() }).with_faults_file(&file);
        let r = &gpus.read(&[])[0];
        assert!(r.error.as_deref().is_some_and(|e| e.contains("fallen off the bus")), "{r:?}");
    }

    #[test]
    fn mig_instances_are_created_within_the_card_limits_and_destroyed() {
        let gpus = SimulatedGpus::with_devices(
            "h",
            &[
                SimulatedDevice { model: "H100 80GB".into(), memory_mib: 81_920, mig: true },
                SimulatedDevice { model: "RTX 5090".into(), memory_mib: 32_768, mig: false },
            ],
        );
        assert!(gpus.devices()[0].mig_capable);
        assert_eq!(gpus.info()[0].mig, MigState::Enabled { instances: vec![] });
        assert_eq!(gpus.info()[1].mig, MigState::Unsupported);

        let a = gpus.create_mig_instance(0, "3g.40gb", Some(MigPlacement { start: 4, size: 4 })).expect("3g.40gb");
        assert!(a.uuid.starts_with("MIG-"), "{a:?}");
        assert_eq!(a.memory_mib, 40_960);
        let b = gpus.create_mig_instance(0, "3g.40gb", None).expect("second 3g.40gb");
        assert_ne!(a.uuid, b.uuid);
        // 6 of 7 compute slices and all 8 memory slices are taken now.
        let full = gpus.create_mig_instance(0, "1g.10gb", None).expect_err("no memory left");
        assert!(full.to_string().contains("no room"), "{full}");
        let MigState::Enabled { instances } = &gpus.info()[0].mig else { panic!("mig on") };
        assert_eq!(instances.len(), 2);

        gpus.destroy_mig_instance(0, &a.uuid).expect("destroy");
        gpus.create_mig_instance(0, "1g.10gb", None).expect("room again");
        assert!(gpus.destroy_mig_instance(0, &a.uuid).is_err(), "already gone");
        let err = gpus.create_mig_instance(1, "1g.10gb", None).expect_err("not a MIG device");
        assert!(err.to_string().contains("MIG mode is off"), "{err}");
        let err = gpus.create_mig_instance(0, "9g.1gb", None).expect_err("unknown profile");
        assert!(err.to_string().contains("not offered"), "{err}");
    }

    #[test]
    fn unknown_fault_keys_are_refused() {
        let err = Faults::parse("[[gpu]]\nindex = 0\noverheat = true\n").expect_err("unknown key");
        assert!(err.contains("overheat"), "{err}");
    }
}
