//! NVML backend: real NVIDIA devices through `nvml-wrapper`, which loads libnvidia-ml.so.1 at
//! run time, so the worker builds and runs on hosts without the driver (where opening this
//! backend fails with [`GpuError::NoNvml`]).
//!
//! Static facts (UUID, model, memory, PCI bus id, NUMA node, MIG layout) are read once at open;
//! readings (temperature, utilization, memory, power, ECC, compute processes) at every call.
//! Critical XID errors arrive as NVML events, which a background thread collects into counters.

use super::nvml_mig::{self, MAX_MIG_DEVICES};
use super::{
    process_name, DeviceInfo, GpuBackend, GpuError, GpuProcess, GpuReading, MigInstance, MigPlacement, MigState,
};
use corral_types::GpuDevice;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the XID thread has seen per device index: (count, last code).
type XidCounters = Arc<Mutex<BTreeMap<u32, (u64, u64)>>>;

/// The devices NVML reports on this host.
pub struct NvmlGpus {
    nvml: Arc<Nvml>,
    /// Static facts; the MIG layout part changes when instances are created or destroyed.
    info: Mutex<Vec<DeviceInfo>>,
    xids: XidCounters,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for NvmlGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlGpus").field("info", &self.info).finish_non_exhaustive()
    }
}

fn nvml_error(call: &'static str) -> impl Fn(NvmlError) -> GpuError {
    move |e| GpuError::Nvml { call, detail: e.to_string() }
}

impl NvmlGpus {
    /// Loads libnvidia-ml, reads the inventory and starts watching for XID errors.
    pub fn open() -> Result<Self, GpuError> {
        let nvml = Nvml::init().map_err(|e| GpuError::NoNvml { detail: describe_init_error(&e) })?;
        let count = nvml.device_count().map_err(nvml_error("device_count"))?;
        let mut info = Vec::with_capacity(count as usize);
        for index in 0..count {
            let device = nvml.device_by_index(index).map_err(nvml_error("device_by_index"))?;
            info.push(device_info(index, &device)?);
        }
        let nvml = Arc::new(nvml);
        let xids = XidCounters::default();
        let stop = Arc::new(AtomicBool::new(false));
        watch_xids(Arc::clone(&nvml), count, Arc::clone(&xids), Arc::clone(&stop));
        tracing::info!(devices = count, "nvml backend ready");
        Ok(NvmlGpus { nvml, info: Mutex::new(info), xids, stop })
    }

    fn read_one(&self, info: &DeviceInfo) -> GpuReading {
        let index = info.device.index;
        let (xid_errors, last_xid) = match self.xids.lock().unwrap_or_else(|p| p.into_inner()).get(&index) {
            Some(&(count, last)) => (count, Some(last)),
            None => (0, None),
        };
        let mut reading = GpuReading { index, xid_errors, last_xid, ..Default::default() };
        let device = match self.nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                reading.error = Some(format!("cannot open the device: {e}"));
                return reading;
            }
        };
        // A lost GPU fails every call; the first failure of memory_info tells.
        match device.memory_info() {
            Ok(m) => reading.memory_used_mib = m.used >> 20,
            Err(e @ (NvmlError::GpuLost | NvmlError::Unknown)) => {
                reading.error = Some(format!("cannot read the device: {e}"));
                return reading;
            }
            Err(_) => {}
        }
        reading.temperature_c = device.temperature(TemperatureSensor::Gpu).unwrap_or(0);
        reading.utilization_percent = device.utilization_rates().map(|u| u.gpu).unwrap_or(0);
        reading.power_mw = device.power_usage().map(u64::from).unwrap_or(0);
        reading.ecc_uncorrected = device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).unwrap_or(0);
        match device.running_compute_processes() {
            Ok(processes) => {
                reading.processes = processes
                    .into_iter()
                    .map(|p| GpuProcess {
                        pid: p.pid,
                        used_memory_mib: match p.used_gpu_memory {
                            UsedGpuMemory::Used(bytes) => Some(bytes >> 20),
                            UsedGpuMemory::Unavailable => None,
                        },
                        name: process_name(p.pid),
                    })
                    .collect();
            }
            Err(e) => tracing::debug!(gpu = index, error = %e, "cannot list compute processes"),
        }
        reading
    }
}

impl Drop for NvmlGpus {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl GpuBackend for NvmlGpus {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn devices(&self) -> Vec<GpuDevice> {
        self.info().into_iter().map(|i| i.device).collect()
    }

    fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok().filter(|v| !v.trim().is_empty())
    }

    fn info(&self) -> Vec<DeviceInfo> {
        self.info.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn read(&self, _allocated: &[u32]) -> Vec<GpuReading> {
        self.info().iter().map(|info| self.read_one(info)).collect()
    }

    fn create_mig_instance(
        &self,
        index: u32,
        profile: &str,
        placement: Option<MigPlacement>,
    ) -> Result<MigInstance, GpuError> {
        let device = self.nvml.device_by_index(index).map_err(nvml_error("device_by_index"))?;
        let created = nvml_mig::create(&self.nvml, &device, index, profile, placement);
        self.refresh_mig(index, &device);
        let created = created?;
        tracing::info!(gpu = index, profile, uuid = %created.uuid, "created a MIG instance");
        Ok(created)
    }

    fn destroy_mig_instance(&self, index: u32, uuid: &str) -> Result<(), GpuError> {
        let device = self.nvml.device_by_index(index).map_err(nvml_error("device_by_index"))?;
        let destroyed = nvml_mig::destroy(&self.nvml, &device, index, uuid);
        self.refresh_mig(index, &device);
        destroyed?;
        tracing::info!(gpu = index, uuid, "destroyed a MIG instance");
        Ok(())
    }
}

impl NvmlGpus {
    /// Re-reads the MIG layout of one device after it changed.
    fn refresh_mig(&self, index: u32, device: &Device<'_>) {
        let layout = mig_state(device);
        let mut info = self.info.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = info.iter_mut().find(|i| i.device.index == index) {
            entry.mig = layout;
        }
    }
}

/// Says why NVML could not start, in terms of what to install.
fn describe_init_error(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(inner) => format!("libnvidia-ml.so.1 not found ({inner})"),
        NvmlError::DriverNotLoaded => {
            "libnvidia-ml.so.1 is installed but the NVIDIA kernel driver is not loaded".into()
        }
        NvmlError::NoPermission => "no permission to talk to the NVIDIA driver (run the worker as root)".into(),
        other => format!("nvmlInit failed: {other}"),
    }
}

fn device_info(index: u32, device: &Device<'_>) -> Result<DeviceInfo, GpuError> {
    let uuid = device.uuid().map_err(nvml_error("uuid"))?;
    let model = device.name().map_err(nvml_error("name"))?;
    let memory_mib = device.memory_info().map_err(nvml_error("memory_info"))?.total >> 20;
    let pci_bus_id = device.pci_info().ok().map(|p| sysfs_bus_id(&p.bus_id));
    let numa_node = pci_bus_id
        .as_deref()
        .and_then(|id| parse_numa_node(&std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node")).ok()?));
    let mig = mig_state(device);
    // The coordinator places MIG slices only where the worker says it can make them.
    let mig_capable = !matches!(mig, MigState::Unsupported);
    Ok(DeviceInfo {
        device: GpuDevice { index, uuid, model, memory_mib, numa_node, mig_capable, ..Default::default() },
        pci_bus_id,
        numa_node,
        minor: device.minor_number().ok(),
        mig,
    })
}

fn mig_state(device: &Device<'_>) -> MigState {
    match device.mig_mode() {
        Ok(mode) if mode.current == 1 => {
            let instances = (0..MAX_MIG_DEVICES)
                .filter_map(|i| device.mig_device_by_index(i).ok())
                .filter_map(|mig| {
                    Some(MigInstance {
                        uuid: mig.uuid().ok()?,
                        profile: mig.name().ok().as_deref().and_then(mig_profile),
                        memory_mib: mig.memory_info().map(|m| m.total >> 20).unwrap_or(0),
                    })
                })
                .collect();
            MigState::Enabled { instances }
        }
        Ok(_) => MigState::Disabled,
        Err(_) => MigState::Unsupported,
    }
}

/// NVML's bus id (`00000000:17:00.0`, 8-digit domain, upper case) in sysfs form (`0000:17:00.0`).
fn sysfs_bus_id(nvml_bus_id: &str) -> String {
    let id = nvml_bus_id.trim_end_matches('\0').to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => id,
    }
}

/// `numa_node` from sysfs; -1 means the platform has no NUMA information.
fn parse_numa_node(text: &str) -> Option<u32> {
    text.trim().parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
}

/// The profile in a MIG device name such as `NVIDIA H100 80GB HBM3 MIG 1g.10gb`.
fn mig_profile(name: &str) -> Option<String> {
    let (_, profile) = name.rsplit_once("MIG ")?;
    let profile = profile.trim();
    (profile.contains("g.") && !profile.contains(' ')).then(|| profile.to_owned())
}

/// Collects critical XID events of every device into `xids` until `stop` is set.
fn watch_xids(nvml: Arc<Nvml>, count: u32, xids: XidCounters, stop: Arc<AtomicBool>) {
    let spawned = std::thread::Builder::new().name("nvml-xid".into()).spawn(move || {
        let mut set = match nvml.create_event_set() {
            Ok(set) => set,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch for XID errors: no event set");
                return;
            }
        };
        for index in 0..count {
            let Ok(device) = nvml.device_by_index(index) else { continue };
            let supported = device.supported_event_types().unwrap_or(EventTypes::empty());
            if !supported.contains(EventTypes::CRITICAL_XID_ERROR) {
                tracing::info!(gpu = index, "device reports no XID events");
                continue;
            }
            set = match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                Ok(set) => set,
                Err(e) => {
                    // The set is released on failure: nothing left to wait on.
                    tracing::warn!(gpu = index, error = %e, "cannot watch for XID errors");
                    return;
                }
            };
        }
        while !stop.load(Ordering::Relaxed) {
            match set.wait(1000) {
                Ok(event) => {
                    let code = match event.event_data {
                        Some(XidError::Value(v)) => v,
                        Some(XidError::Unknown) | None => 999,
                    };
                    let index = event.device.index().unwrap_or(u32::MAX);
                    tracing::error!(gpu = index, xid = code, "gpu reported a critical XID error");
                    let mut counters = xids.lock().unwrap_or_else(|p| p.into_inner());
                    let entry = counters.entry(index).or_insert((0, 0));
                    *entry = (entry.0 + 1, code);
                }
                Err(NvmlError::Timeout) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for XID events failed");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the XID watcher thread");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_take_the_sysfs_form() {
        assert_eq!(sysfs_bus_id("00000000:17:00.0"), "0000:17:00.0");
        assert_eq!(sysfs_bus_id("0000000A:C1:00.0\0"), "000a:c1:00.0");
        assert_eq!(sysfs_bus_id("0000:17:00.0"), "0000:17:00.0");
    }

    #[test]
    fn numa_nodes_parse() {
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node("-1\n"), None);
        assert_eq!(parse_numa_node("x"), None);
    }

    #[test]
    fn mig_profiles_come_from_device_names() {
        assert_eq!(mig_profile("NVIDIA H100 80GB HBM3 MIG 1g.10gb").as_deref(), Some("1g.10gb"));
        assert_eq!(mig_profile("NVIDIA A100-SXM4-40GB MIG 3g.20gb").as_deref(), Some("3g.20gb"));
        assert_eq!(mig_profile("NVIDIA GeForce RTX 5090"), None);
    }

    /// Without libnvidia-ml (this CI) opening fails with advice; with it, devices are listed.
    #[test]
    fn open_says_what_to_do_without_nvml() {
        match NvmlGpus::open() {
            Err(e) => {
                let text = e.to_string();
                assert!(text.starts_with("no NVML: "), "{text}");
                assert!(text.contains("backend = \"simulated\""), "{text}");
            }
            Ok(gpus) => {
                let readings = gpus.read(&[]);
                assert_eq!(readings.len(), gpus.devices().len());
            }
        }
    }
}
