//! MIG instance management through NVML's raw API (nvml-wrapper has no safe wrapper for it):
//! create a GPU instance of a named profile, at the scheduler's placement when one is given,
//! with one compute instance spanning it; destroy one by the UUID of its MIG device.
//!
//! Every call goes through the function table nvml-wrapper loaded, so a driver without the
//! MIG entry points fails with an error instead of a missing symbol at link time.

use super::{GpuError, MigInstance, MigPlacement};
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t, nvmlDevice_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstance_t,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT, NVML_GPU_INSTANCE_PROFILE_COUNT,
};
use std::mem::MaybeUninit;

/// MIG devices per GPU never exceed this (7 on A100/H100/H200).
pub(super) const MAX_MIG_DEVICES: u32 = 8;

/// Maps an NVML failure of `what` on device `index` to a MIG error.
fn call_error(index: u32, what: impl Into<String>) -> impl Fn(NvmlError) -> GpuError {
    let what = what.into();
    move |e| GpuError::Mig { index, detail: format!("{what}: {e}") }
}

/// A GPU instance profile a device offers.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GiProfile {
    id: u32,
    name: String,
    slice_count: u32,
}

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`.
fn profile_info_v2_version() -> u32 {
    std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32 | (2 << 24)
}

/// The profile name in NVML's `MIG 1g.10gb` form, without the prefix.
fn profile_name_from_driver(raw: &[std::os::raw::c_char]) -> Option<String> {
    let bytes: Vec<u8> = raw.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
    let name = String::from_utf8(bytes).ok()?;
    let name = name.trim().trim_start_matches("MIG").trim();
    (!name.is_empty()).then(|| name.to_owned())
}

/// The name older drivers do not give: `<slices>g.<memory rounded up to GB>gb`.
fn profile_name_from_sizes(slice_count: u32, memory_mib: u64) -> String {
    format!("{slice_count}g.{}gb", memory_mib.div_ceil(1024))
}

/// Every GPU instance profile `device` supports.
fn gi_profiles(nvml: &Nvml, device: nvmlDevice_t) -> Vec<GiProfile> {
    let lib = nvml.lib();
    let mut out = Vec::new();
    for profile in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        if let Ok(get_v2) = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()) {
            let mut info = MaybeUninit::<nvmlGpuInstanceProfileInfo_v2_t>::zeroed();
            // SAFETY: `info` is a zeroed v2 struct with its version set, as the API requires.
            let ok = unsafe {
                (*info.as_mut_ptr()).version = profile_info_v2_version();
                nvml_try(get_v2(device, profile, info.as_mut_ptr()))
            };
            if ok.is_ok() {
                // SAFETY: the call succeeded and filled the struct.
                let info = unsafe { info.assume_init() };
                let name = profile_name_from_driver(&info.name)
                    .unwrap_or_else(|| profile_name_from_sizes(info.sliceCount, info.memorySizeMB));
                out.push(GiProfile { id: info.id, name, slice_count: info.sliceCount });
                continue;
            }
        }
        let Ok(get) = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfo.as_ref()) else { continue };
        let mut info = MaybeUninit::<nvmlGpuInstanceProfileInfo_t>::zeroed();
        // SAFETY: valid device handle and an out pointer to a properly sized struct.
        if unsafe { nvml_try(get(device, profile, info.as_mut_ptr())) }.is_ok() {
            // SAFETY: the call succeeded and filled the struct.
            let info = unsafe { info.assume_init() };
            let name = profile_name_from_sizes(info.sliceCount, info.memorySizeMB);
            out.push(GiProfile { id: info.id, name, slice_count: info.sliceCount });
        }
    }
    out
}

/// Creates a GPU instance of `profile` with one compute instance spanning it on `device`.
pub(super) fn create(
    nvml: &Nvml,
    device: &Device<'_>,
    index: u32,
    profile: &str,
    placement: Option<MigPlacement>,
) -> Result<MigInstance, GpuError> {
    let mig_error = |detail: String| GpuError::Mig { index, detail };
    // SAFETY: the handle is only used while `device` (and so the library) is alive.
    let handle = unsafe { device.handle() };
    let profiles = gi_profiles(nvml, handle);
    let Some(gi_profile) = profiles.iter().find(|p| p.name == profile) else {
        let offered: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
        return Err(mig_error(format!(
            "MIG profile {profile} is not offered by this device (it offers: {})",
            if offered.is_empty() { "none; is MIG mode on?".to_owned() } else { offered.join(", ") }
        )));
    };
    let lib = nvml.lib();
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    let mut placed = false;
    if let Some(p) = placement {
        let create_at =
            nvml_sym(lib.nvmlDeviceCreateGpuInstanceWithPlacement.as_ref()).map_err(call_error(index, "create"))?;
        let at = nvmlGpuInstancePlacement_t { start: p.start, size: p.size };
        // SAFETY: valid handle, placement and out pointer.
        match unsafe { nvml_try(create_at(handle, gi_profile.id, &at, &mut gi)) } {
            Ok(()) => placed = true,
            Err(e) => tracing::warn!(
                gpu = index, profile, start = p.start, size = p.size, error = %e,
                "cannot create the MIG instance at the scheduler's placement; letting the driver place it"
            ),
        }
    }
    if !placed {
        let create_any = nvml_sym(lib.nvmlDeviceCreateGpuInstance.as_ref()).map_err(call_error(index, "create"))?;
        // SAFETY: valid handle and out pointer.
        unsafe { nvml_try(create_any(handle, gi_profile.id, &mut gi)) }
            .map_err(call_error(index, format!("creating a {profile} GPU instance")))?;
    }
    match create_compute_instance(nvml, gi, gi_profile.slice_count) {
        Ok(()) => {}
        Err(e) => {
            destroy_gpu_instance(nvml, gi);
            return Err(mig_error(format!("creating the compute instance of {profile}: {e}")));
        }
    }
    let gi_id = gpu_instance_id(nvml, gi).map_err(call_error(index, "reading the new GPU instance"))?;
    // SAFETY: the MIG device handle is used while its device lives.
    let found = find_mig_device(device, |m| mig_gpu_instance_id(nvml, unsafe { m.handle() }) == Some(gi_id));
    let Some(mig) = found else {
        return Err(mig_error(format!("the new {profile} instance (GPU instance {gi_id}) has no MIG device")));
    };
    Ok(MigInstance {
        uuid: mig.uuid().map_err(call_error(index, "reading the MIG device uuid"))?,
        profile: Some(profile.to_owned()),
        memory_mib: mig.memory_info().map(|m| m.total >> 20).unwrap_or(0),
    })
}

/// Destroys the MIG device `uuid` of `device`: its compute instance, then its GPU instance.
pub(super) fn destroy(nvml: &Nvml, device: &Device<'_>, index: u32, uuid: &str) -> Result<(), GpuError> {
    let mig_error = |detail: String| GpuError::Mig { index, detail };
    let Some(mig) = find_mig_device(device, |m| m.uuid().ok().as_deref() == Some(uuid)) else {
        return Err(mig_error(format!("no MIG device {uuid}")));
    };
    // SAFETY: the MIG device handle is valid while `mig` lives.
    let mig_handle = unsafe { mig.handle() };
    let gi_id =
        mig_gpu_instance_id(nvml, mig_handle).ok_or_else(|| mig_error(format!("{uuid}: no GPU instance id")))?;
    let ci_id = mig_compute_instance_id(nvml, mig_handle);
    let lib = nvml.lib();
    let by_id =
        nvml_sym(lib.nvmlDeviceGetGpuInstanceById.as_ref()).map_err(call_error(index, format!("lookup of {uuid}")))?;
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: valid parent handle and out pointer.
    unsafe { nvml_try(by_id(device.handle(), gi_id, &mut gi)) }
        .map_err(call_error(index, format!("looking up the GPU instance of {uuid}")))?;
    if let Some(ci_id) = ci_id {
        let ci_by_id = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceById.as_ref())
            .map_err(call_error(index, format!("lookup of {uuid}")))?;
        let destroy_ci = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref())
            .map_err(call_error(index, format!("destroy of {uuid}")))?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: valid GPU instance handle and out pointer; then the handle it returned.
        unsafe {
            nvml_try(ci_by_id(gi, ci_id, &mut ci))
                .map_err(call_error(index, format!("looking up the compute instance of {uuid}")))?;
            nvml_try(destroy_ci(ci))
                .map_err(call_error(index, format!("destroying the compute instance (still in use?) of {uuid}")))?;
        }
    }
    let destroy_gi =
        nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref()).map_err(call_error(index, format!("destroy of {uuid}")))?;
    // SAFETY: the handle was returned by the driver above.
    unsafe { nvml_try(destroy_gi(gi)) }
        .map_err(call_error(index, format!("destroying the GPU instance (still in use?) of {uuid}")))
}

fn create_compute_instance(nvml: &Nvml, gi: nvmlGpuInstance_t, slice_count: u32) -> Result<(), NvmlError> {
    let lib = nvml.lib();
    let info_of = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref())?;
    let create = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())?;
    // The compute profile spanning the whole GPU instance: the largest that fits.
    let mut best: Option<nvmlComputeInstanceProfileInfo_t> = None;
    for profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let mut info = MaybeUninit::<nvmlComputeInstanceProfileInfo_t>::zeroed();
        // SAFETY: valid GPU instance handle and out pointer.
        let ok =
            unsafe { nvml_try(info_of(gi, profile, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, info.as_mut_ptr())) };
        if ok.is_ok() {
            // SAFETY: filled by the successful call.
            let info = unsafe { info.assume_init() };
            if info.sliceCount <= slice_count && best.is_none_or(|b| info.sliceCount > b.sliceCount) {
                best = Some(info);
            }
        }
    }
    let Some(profile) = best else { return Err(NvmlError::NotSupported) };
    let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: valid GPU instance handle and out pointer.
    unsafe { nvml_try(create(gi, profile.id, &mut ci)) }
}

fn destroy_gpu_instance(nvml: &Nvml, gi: nvmlGpuInstance_t) {
    if let Ok(destroy) = nvml_sym(nvml.lib().nvmlGpuInstanceDestroy.as_ref()) {
        // SAFETY: the handle came from a successful create.
        if let Err(e) = unsafe { nvml_try(destroy(gi)) } {
            tracing::warn!(error = %e, "cannot clean up a half-created MIG instance");
        }
    }
}

fn gpu_instance_id(nvml: &Nvml, gi: nvmlGpuInstance_t) -> Result<u32, NvmlError> {
    let get = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    let mut info = MaybeUninit::<nvmlGpuInstanceInfo_t>::zeroed();
    // SAFETY: valid handle and out pointer; read only after success.
    unsafe {
        nvml_try(get(gi, info.as_mut_ptr()))?;
        Ok(info.assume_init().id)
    }
}

fn mig_gpu_instance_id(nvml: &Nvml, mig: nvmlDevice_t) -> Option<u32> {
    let get = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref()).ok()?;
    let mut id = 0;
    // SAFETY: valid MIG device handle and out pointer.
    unsafe { nvml_try(get(mig, &mut id)) }.ok().map(|()| id)
}

fn mig_compute_instance_id(nvml: &Nvml, mig: nvmlDevice_t) -> Option<u32> {
    let get = nvml_sym(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref()).ok()?;
    let mut id = 0;
    // SAFETY: valid MIG device handle and out pointer.
    unsafe { nvml_try(get(mig, &mut id)) }.ok().map(|()| id)
}

/// The first MIG device of `device` that satisfies `pred`.
fn find_mig_device<'n>(device: &Device<'n>, pred: impl Fn(&Device<'n>) -> bool) -> Option<Device<'n>> {
    (0..MAX_MIG_DEVICES).filter_map(|i| device.mig_device_by_index(i).ok()).find(|m| pred(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_names_come_from_the_driver_or_the_sizes() {
        let mut raw = [0 as std::os::raw::c_char; 96];
        for (slot, byte) in raw.iter_mut().zip(b"MIG 1g.10gb+me") {
            *slot = *byte as std::os::raw::c_char;
        }
        assert_eq!(profile_name_from_driver(&raw).as_deref(), Some("1g.10gb+me"));
        assert_eq!(profile_name_from_driver(&[0; 4]), None);
        // A100 40GB's 4.75 GiB slice is the profile nvidia-smi calls 1g.5gb.
        assert_eq!(profile_name_from_sizes(1, 4864), "1g.5gb");
        assert_eq!(profile_name_from_sizes(3, 20_096), "3g.20gb");
    }

    #[test]
    fn the_v2_struct_version_encodes_its_size() {
        assert_eq!(profile_info_v2_version() >> 24, 2);
        assert_eq!(
            profile_info_v2_version() & 0xff_ffff,
            std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32
        );
    }
}
