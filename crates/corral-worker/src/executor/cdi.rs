//! Container Device Interface (CDI): device specs such as the one `nvidia-ctk cdi generate`
//! writes to /etc/cdi or /var/run/cdi say which device nodes, mounts (driver libraries), env
//! and hooks a container needs for a device. Best effort: JSON specs are read; YAML specs are
//! skipped with a log line saying how to produce JSON; a device no spec names falls back to
//! plain device nodes.

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Edits a CDI device (or a whole spec) makes to a container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Edits {
    #[serde(default)]
    pub(crate) env: Vec<String>,
    #[serde(default)]
    pub(crate) device_nodes: Vec<DeviceNode>,
    #[serde(default)]
    pub(crate) mounts: Vec<Mount>,
    #[serde(default)]
    pub(crate) hooks: Vec<Hook>,
}

impl Edits {
    fn extend(&mut self, other: &Edits) {
        self.env.extend(other.env.iter().cloned());
        self.device_nodes.extend(other.device_nodes.iter().cloned());
        self.mounts.extend(other.mounts.iter().cloned());
        self.hooks.extend(other.hooks.iter().cloned());
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct DeviceNode {
    /// Path in the container.
    pub(crate) path: PathBuf,
    /// Path on the host, when it differs.
    pub(crate) host_path: Option<PathBuf>,
    pub(crate) permissions: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Mount {
    pub(crate) host_path: PathBuf,
    pub(crate) container_path: PathBuf,
    #[serde(rename = "type")]
    pub(crate) typ: Option<String>,
    #[serde(default)]
    pub(crate) options: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Hook {
    /// OCI hook point: prestart, createRuntime, createContainer, startContainer, poststart, poststop.
    pub(crate) hook_name: String,
    pub(crate) path: PathBuf,
    #[serde(default)]
    pub(crate) args: Vec<String>,
    #[serde(default)]
    pub(crate) env: Vec<String>,
    pub(crate) timeout: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    #[serde(default)]
    container_edits: Edits,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    kind: String,
    #[serde(default)]
    devices: Vec<Device>,
    #[serde(default)]
    container_edits: Edits,
}

/// The CDI specs found on this host.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    specs: Vec<Spec>,
}

impl Registry {
    /// Reads every `*.json` spec in `dirs` (missing directories are fine).
    pub(crate) fn load(dirs: &[PathBuf]) -> Registry {
        let mut specs = Vec::new();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            paths.sort();
            for path in paths {
                match path.extension().and_then(|e| e.to_str()) {
                    Some("json") => match read_spec(&path) {
                        Ok(spec) => specs.push(spec),
                        Err(e) => tracing::warn!(file = %path.display(), error = %e, "ignoring an invalid CDI spec"),
                    },
                    Some("yaml" | "yml") => tracing::info!(
                        file = %path.display(),
                        "ignoring a YAML CDI spec: corral reads JSON ones (nvidia-ctk cdi generate --format=json)"
                    ),
                    _ => {}
                }
            }
        }
        Registry { specs }
    }

    /// The edits for all `names` (`vendor.com/class=device`), or `None` if any is unknown.
    pub(crate) fn resolve(&self, names: &[String]) -> Option<Edits> {
        if names.is_empty() {
            return None;
        }
        let mut edits = Edits::default();
        let mut used_specs: Vec<usize> = Vec::new();
        for name in names {
            let (kind, device) = name.split_once('=')?;
            let (spec_index, found) = self.specs.iter().enumerate().find_map(|(i, spec)| {
                (spec.kind == kind).then(|| spec.devices.iter().find(|d| d.name == device)).flatten().map(|d| (i, d))
            })?;
            if !used_specs.contains(&spec_index) {
                used_specs.push(spec_index);
                edits.extend(&self.specs[spec_index].container_edits);
            }
            edits.extend(&found.container_edits);
        }
        Some(edits)
    }
}

fn read_spec(path: &Path) -> Result<Spec, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    serde_json::from_str(&text).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NVIDIA: &str = r#"{
      "cdiVersion": "0.5.0",
      "kind": "nvidia.com/gpu",
      "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
        {"name": "GPU-aaaa", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
        {"name": "1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}}
      ],
      "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}],
        "mounts": [{"hostPath": "/usr/lib/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1",
                    "options": ["ro", "nosuid", "nodev", "bind"]}],
        "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-ctk", "args": ["nvidia-ctk", "hook"]}]
      }
    }"#;

    #[test]
    fn devices_resolve_with_their_spec_edits_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("nvidia.json"), NVIDIA).expect("write");
        std::fs::write(dir.path().join("other.yaml"), "cdiVersion: 0.5.0\n").expect("write");
        let registry = Registry::load(&[dir.path().to_path_buf(), PathBuf::from("/nonexistent/cdi")]);
        let edits = registry.resolve(&["nvidia.com/gpu=0".into(), "nvidia.com/gpu=1".into()]).expect("known");
        let nodes: Vec<&Path> = edits.device_nodes.iter().map(|n| n.path.as_path()).collect();
        assert_eq!(nodes, [Path::new("/dev/nvidiactl"), Path::new("/dev/nvidia0"), Path::new("/dev/nvidia1")]);
        assert_eq!(edits.mounts.len(), 1, "spec-wide edits apply once");
        assert_eq!(edits.hooks[0].hook_name, "createContainer");
        assert!(registry.resolve(&["nvidia.com/gpu=GPU-aaaa".into()]).is_some());
        assert!(registry.resolve(&["nvidia.com/gpu=7".into()]).is_none());
        assert!(registry.resolve(&["amd.com/gpu=0".into()]).is_none());
        assert!(registry.resolve(&[]).is_none());
    }
}
