//! The worker's self-check before it registers (and before it spends a join token): GPUs and
//! their driver from the backend (NVML or simulated), runc when `--image` jobs are allowed, and
//! the cgroup controllers its job cgroups need (v1 hybrid or v2). Everything missing is
//! reported in one line, so that an operator fixes it all in one go.
//!
//! Cheap by design: one NVML inventory the worker reads anyway, a PATH lookup, and one read of
//! `/proc/self/mounts` or `cgroup.controllers`. The facts are gathered by [`HostFacts::gather`];
//! the verdict ([`HostFacts::judge`]) is pure and table-tested.

use crate::config::WorkerFile;
use crate::executor::{find_runc, CgroupVersion};
use crate::gpu::GpuBackend;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Controllers the job cgroups need on cgroup v1: limits (memory, cpu, pids) and the freezer
/// that kills a job's processes without races.
const V1_REQUIRED: [&str; 4] = ["memory", "cpu", "pids", "freezer"];
/// On cgroup v2 (where `cgroup.kill` replaces the freezer).
const V2_REQUIRED: [&str; 3] = ["memory", "cpu", "pids"];

/// What the self-check found on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    /// `nvml` or `simulated`.
    pub backend: &'static str,
    pub gpus: usize,
    pub driver: Option<String>,
    /// `executor.runc`, when `--image` jobs are allowed (not `""`), and where it was found.
    pub runc: Option<(String, Option<PathBuf>)>,
    pub cgroup: CgroupVersion,
    /// Controllers available to job cgroups (v1: mounted hierarchies; v2: the root's
    /// `cgroup.controllers`).
    pub controllers: BTreeSet<String>,
}

impl HostFacts {
    /// Reads the facts of this host for the worker `file` describes with `gpus`.
    pub fn gather(file: &WorkerFile, gpus: &dyn GpuBackend) -> HostFacts {
        let runc = (!file.executor.runc.is_empty())
            .then(|| (file.executor.runc.clone(), find_runc(Path::new(&file.executor.runc))));
        let cgroup = CgroupVersion::detect();
        let controllers = match cgroup {
            CgroupVersion::V1 => v1_controllers(&std::fs::read_to_string("/proc/self/mounts").unwrap_or_default()),
            CgroupVersion::V2 => std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
                .unwrap_or_default()
                .split_whitespace()
                .map(String::from)
                .collect(),
        };
        HostFacts {
            backend: gpus.name(),
            gpus: gpus.devices().len(),
            driver: gpus.driver_version(),
            runc,
            cgroup,
            controllers,
        }
    }

    /// `Ok(summary)` for the log, or one line naming everything missing.
    pub fn judge(&self) -> Result<String, String> {
        let mut missing = Vec::new();
        if self.backend == "nvml" {
            if self.gpus == 0 {
                missing.push(
                    "NVML found no GPU (check nvidia-smi, or use gpu.backend = \"simulated\" on a host without GPUs)"
                        .to_string(),
                );
            }
            if self.driver.is_none() {
                missing.push("NVML reports no driver version (check the NVIDIA driver with nvidia-smi)".to_string());
            }
        }
        if let Some((runc, None)) = &self.runc {
            missing.push(format!(
                "runc not found (executor.runc = \"{runc}\"): install runc, or set executor.runc = \"\" to run no --image jobs"
            ));
        }
        let (required, hint): (&[&str], &str) = match self.cgroup {
            CgroupVersion::V1 => (&V1_REQUIRED, "mount each under /sys/fs/cgroup/<controller>"),
            CgroupVersion::V2 => (&V2_REQUIRED, "enable them in /sys/fs/cgroup/cgroup.subtree_control"),
        };
        let absent: Vec<&str> = required.iter().copied().filter(|c| !self.controllers.contains(*c)).collect();
        if !absent.is_empty() {
            let version = if self.cgroup == CgroupVersion::V1 { "v1" } else { "v2" };
            missing.push(format!("cgroup {version} controllers missing: {} ({hint})", absent.join(", ")));
        }
        if !missing.is_empty() {
            return Err(format!("worker self-check failed: {}", missing.join("; ")));
        }
        let runc = match &self.runc {
            Some((_, Some(path))) => format!("runc {}", path.display()),
            _ => "no containers".to_string(),
        };
        let version = if self.cgroup == CgroupVersion::V1 { "v1" } else { "v2" };
        Ok(format!(
            "{} {} gpus, driver {}, {runc}, cgroup {version}",
            self.gpus,
            self.backend,
            self.driver.as_deref().unwrap_or("unknown")
        ))
    }
}

/// Controllers of the mounted cgroup v1 hierarchies in a `/proc/self/mounts` text.
fn v1_controllers(mounts: &str) -> BTreeSet<String> {
    mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 4 && fields[2] == "cgroup").then(|| fields[3])
        })
        .flat_map(|options| options.split(','))
        .map(String::from)
        .collect()
}

/// Checks this host for the worker `file` describes; the error is one line.
pub fn check(file: &WorkerFile, gpus: &dyn GpuBackend) -> anyhow::Result<()> {
    let summary = HostFacts::gather(file, gpus).judge().map_err(anyhow::Error::msg)?;
    tracing::info!(%summary, "worker self-check passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostFacts {
        HostFacts {
            backend: "nvml",
            gpus: 8,
            driver: Some("570.86".into()),
            runc: Some(("runc".into(), Some(PathBuf::from("/usr/sbin/runc")))),
            cgroup: CgroupVersion::V2,
            controllers: ["cpuset", "cpu", "io", "memory", "pids"].map(String::from).into(),
        }
    }

    #[test]
    fn a_complete_host_passes() {
        assert_eq!(host().judge(), Ok("8 nvml gpus, driver 570.86, runc /usr/sbin/runc, cgroup v2".into()));
        let simulated = HostFacts { backend: "simulated", gpus: 0, driver: None, runc: None, ..host() };
        assert!(simulated.judge().is_ok(), "a simulated host without gpus is a CPU node");
    }

    #[test]
    fn everything_missing_is_named_in_one_line() {
        let cases: Vec<(HostFacts, &str)> = vec![
            (HostFacts { gpus: 0, ..host() }, "NVML found no GPU"),
            (HostFacts { driver: None, ..host() }, "NVML reports no driver version"),
            (HostFacts { runc: Some(("runc".into(), None)), ..host() }, "runc not found (executor.runc = \"runc\")"),
            (
                HostFacts { controllers: ["cpu"].map(String::from).into(), ..host() },
                "cgroup v2 controllers missing: memory, pids",
            ),
            (
                HostFacts { cgroup: CgroupVersion::V1, ..host() },
                "cgroup v1 controllers missing: freezer (mount each under /sys/fs/cgroup/<controller>)",
            ),
        ];
        for (facts, expected) in cases {
            let err = facts.judge().expect_err(expected);
            assert!(err.starts_with("worker self-check failed: ") && err.contains(expected), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
        let all = HostFacts { gpus: 0, runc: Some(("runc".into(), None)), controllers: BTreeSet::new(), ..host() };
        let err = all.judge().expect_err("all");
        assert_eq!(err.matches("; ").count(), 2, "{err}");
    }

    #[test]
    fn v1_controllers_come_from_the_cgroup_mounts() {
        let mounts = "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n\
                      cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n\
                      cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nsdelegate 0 0\n";
        let found = v1_controllers(mounts);
        assert!(found.contains("cpu") && found.contains("cpuacct") && found.contains("memory"), "{found:?}");
        assert!(!found.contains("pids") && !found.contains("nsdelegate"), "{found:?}");
    }
}
