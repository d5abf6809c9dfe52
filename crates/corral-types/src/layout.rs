//! Slurm's shape of an allocation (`TaskLayout`: nodes, tasks and what each task gets) and the
//! names a Slurm user gave a job (`SlurmNames`: account, QOS, partition, where it was submitted
//! from). Pure data with pure accessors: the CLI fills them from directives, placement and the
//! worker read them.

use serde::{Deserialize, Serialize};

/// Most nodes one job may span.
pub const MAX_NODES_PER_JOB: u32 = 1024;

/// Most tasks one job may have (`-n`), and most per node (`--ntasks-per-node`).
pub const MAX_TASKS_PER_JOB: u32 = 65_536;

/// Slurm's shape of an allocation: how many nodes and tasks, and what each task gets.
///
/// Every field is 0 (or `false`, `None`) when not given, and the default layout is what a
/// `corral submit` job always had: one node (or `gpus / gpus_per_node` nodes for a gang), one
/// task per node, the command's CPU and memory limits as given. The job's `gpus`,
/// `sched.gpus_per_node`, `cpu_millis` and `memory_bytes` stay what placement and the cgroup
/// read; the CLI computes them from the Slurm forms kept here (`--gpus-per-task`,
/// `--mem-per-gpu`, ...), which the worker needs again for Slurm's variables.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskLayout {
    /// `--nodes/-N`: the allocation's node count. 0: as many as the GPUs need (today's rule:
    /// `gpus / gpus_per_node` for a gang, else one).
    #[serde(default)]
    pub nodes: u32,
    /// `--ntasks/-n`: tasks of the allocation, spread over its nodes (`tasks_on_nodes`). 0: not
    /// given (`ntasks_per_node` on each node, else one per node).
    #[serde(default)]
    pub ntasks: u32,
    /// `--ntasks-per-node`: tasks on each node (with `ntasks`: at most this many). 0: not given.
    #[serde(default)]
    pub ntasks_per_node: u32,
    /// `--cpus-per-task/-c`, whole CPUs. 0: not given (Slurm's default of one).
    #[serde(default)]
    pub cpus_per_task: u32,
    /// `--gpus-per-task`: each task sees its own GPUs (`CUDA_VISIBLE_DEVICES` per task). 0: GPUs
    /// are not bound per task; every task sees the node's GPUs of the job.
    #[serde(default)]
    pub gpus_per_task: u32,
    /// `--cpus-per-gpu`, whole CPUs. 0: not given.
    #[serde(default)]
    pub cpus_per_gpu: u32,
    /// `--mem-per-cpu` in bytes. 0: not given.
    #[serde(default)]
    pub mem_per_cpu: u64,
    /// `--mem-per-gpu` in bytes. 0: not given.
    #[serde(default)]
    pub mem_per_gpu: u64,
    /// `--exclusive`: the allocation's nodes run no other job, and it gets their CPUs.
    #[serde(default)]
    pub exclusive: bool,
    /// The GPU type of `--gres=gpu:TYPE:N` / `--gpus=TYPE:N`, matched against the GPU model
    /// (`a100` matches "NVIDIA A100-SXM4-80GB"; see `gpu_type_matches`). `None`: any model.
    #[serde(default)]
    pub gpu_type: Option<String>,
    /// Set when a placement chose part of the job's shape: the node count of tasks that spread
    /// over nodes (`JobSpec::spread_over`), or the GPUs of an `--exclusive` job that asked for
    /// none (`JobSpec::with_whole_nodes_gpus`). What the job was submitted with, so that a
    /// requeued run chooses again (`JobSpec::restore_submitted_shape`) instead of keeping its
    /// first run's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_shape: Option<SubmittedShape>,
}

/// What a job asked for before a placement chose part of its shape: the fields
/// `JobSpec::spread_over` and `JobSpec::with_whole_nodes_gpus` replace (`layout.nodes` and
/// `sched.gpus_per_node` were unset in the first case, and stay as they were in the second).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmittedShape {
    pub gpus: u32,
    pub cpu_millis: u32,
    pub memory_bytes: u64,
}

impl TaskLayout {
    /// True when nothing was given: the job is laid out as before Slurm's shapes existed.
    pub fn is_default(&self) -> bool {
        *self == TaskLayout::default()
    }

    /// Tasks on each of `nodes` nodes, in allocation order: Slurm's block distribution.
    /// `ntasks` tasks are spread as evenly as possible, the first nodes taking one more
    /// (`-N 2 -n 5`: 3, 2); without `ntasks`, `ntasks_per_node` on each node, else one. Every
    /// node gets at least one task when there are enough (a layout with fewer tasks than nodes
    /// is refused by `validate`).
    pub fn tasks_on_nodes(&self, nodes: u32) -> Vec<u32> {
        let nodes = nodes.clamp(1, MAX_NODES_PER_JOB);
        if self.ntasks > 0 {
            let (base, extra) = (self.ntasks / nodes, self.ntasks % nodes);
            (0..nodes).map(|i| base + u32::from(i < extra)).collect()
        } else {
            vec![self.ntasks_per_node.max(1); nodes as usize]
        }
    }

    /// Tasks of the allocation on `nodes` nodes.
    pub fn total_tasks(&self, nodes: u32) -> u32 {
        self.tasks_on_nodes(nodes).iter().sum()
    }

    /// The node count the layout asks for by itself (`-N`, else what `ntasks` and
    /// `ntasks_per_node` imply), or `None` when it does not say.
    pub fn nodes_asked(&self) -> Option<u32> {
        if self.nodes > 0 {
            Some(self.nodes)
        } else if self.ntasks > 0 && self.ntasks_per_node > 0 {
            Some(self.ntasks.div_ceil(self.ntasks_per_node))
        } else {
            None
        }
    }

    /// CPUs of one task: `cpus_per_task`, else one.
    pub fn cpus_of_task(&self) -> u32 {
        self.cpus_per_task.max(1)
    }

    /// Checks the layout by itself: counts in range, no fewer tasks than nodes, a task count
    /// that fits `ntasks_per_node` on the nodes asked for.
    pub fn validate(&self) -> Result<(), String> {
        if self.nodes > MAX_NODES_PER_JOB {
            return Err(format!("--nodes {}: at most {MAX_NODES_PER_JOB}", self.nodes));
        }
        for (name, value) in [("--ntasks", self.ntasks), ("--ntasks-per-node", self.ntasks_per_node)] {
            if value > MAX_TASKS_PER_JOB {
                return Err(format!("{name} {value}: at most {MAX_TASKS_PER_JOB}"));
            }
        }
        for (name, value) in [
            ("--cpus-per-task", self.cpus_per_task),
            ("--cpus-per-gpu", self.cpus_per_gpu),
            ("--gpus-per-task", self.gpus_per_task),
        ] {
            if value > 4096 {
                return Err(format!("{name} {value}: at most 4096"));
            }
        }
        if self.nodes > 0 && self.ntasks > 0 && self.ntasks < self.nodes {
            return Err(format!(
                "--ntasks {} is fewer than --nodes {}: every node runs at least one task",
                self.ntasks, self.nodes
            ));
        }
        if self.nodes > 0 && self.ntasks > 0 && self.ntasks_per_node > 0 {
            let most = u64::from(self.nodes) * u64::from(self.ntasks_per_node);
            if u64::from(self.ntasks) > most {
                return Err(format!(
                    "--ntasks {} does not fit {} nodes of --ntasks-per-node {}",
                    self.ntasks, self.nodes, self.ntasks_per_node
                ));
            }
        }
        if self.cpus_per_task > 0 && self.cpus_per_gpu > 0 {
            return Err("--cpus-per-task and --cpus-per-gpu are mutually exclusive".into());
        }
        if self.mem_per_cpu > 0 && self.mem_per_gpu > 0 {
            return Err("--mem-per-cpu and --mem-per-gpu are mutually exclusive".into());
        }
        if let Some(t) = &self.gpu_type {
            if t.is_empty() || t.len() > 64 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
                return Err(format!("GPU type '{t}': expected a model name such as a100 or h100"));
            }
        }
        Ok(())
    }
}

/// Whether a GPU of `model` (as the node reports it, e.g. "NVIDIA A100-SXM4-80GB" or "RTX
/// 5090") is of Slurm GPU type `wanted` (`a100`, `rtx_5090`, `h100-80gb`): compared without
/// case, spaces, `-` and `_`, the type must appear in the model's name.
pub fn gpu_type_matches(model: &str, wanted: &str) -> bool {
    let squash = |s: &str| s.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect();
    let (model, wanted): (String, String) = (squash(model), squash(wanted));
    !wanted.is_empty() && model.contains(&wanted)
}

/// What a Slurm user named, kept as given: Slurm's variables (`SLURM_JOB_ACCOUNT`,
/// `SLURM_JOB_PARTITION`, `SLURM_SUBMIT_DIR`, `SLURM_SUBMIT_HOST`) and the `%u` of output
/// patterns need them. Placement does not read them: the coordinator maps an account to a
/// tenant and a QOS to a priority class (the policy's `[slurm]`), and a partition is a node
/// label (`sched.node_selector`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlurmNames {
    /// `--account/-A`, or the policy's `default-account` the coordinator chose.
    #[serde(default)]
    pub account: Option<String>,
    /// `--qos/-q`.
    #[serde(default)]
    pub qos: Option<String>,
    /// `--partition/-p`.
    #[serde(default)]
    pub partition: Option<String>,
    /// The directory `sbatch` ran in (absolute), whatever `--chdir` says.
    #[serde(default)]
    pub submit_dir: Option<String>,
    /// The host `sbatch` ran on.
    #[serde(default)]
    pub submit_host: Option<String>,
    /// The user who submitted (the `%u` of output patterns).
    #[serde(default)]
    pub user: Option<String>,
}

impl SlurmNames {
    pub fn is_default(&self) -> bool {
        *self == SlurmNames::default()
    }

    /// Refuses names longer than `max` bytes or holding a NUL, naming the field.
    pub fn validate(&self, max: usize) -> Result<(), String> {
        for (field, value) in [
            ("account", &self.account),
            ("qos", &self.qos),
            ("partition", &self.partition),
            ("submit dir", &self.submit_dir),
            ("submit host", &self.submit_host),
            ("user", &self.user),
        ] {
            if let Some(v) = value {
                if v.len() > max || v.contains('\0') {
                    return Err(format!("{field}: at most {max} bytes, without NUL"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(nodes: u32, ntasks: u32, per_node: u32) -> TaskLayout {
        TaskLayout { nodes, ntasks, ntasks_per_node: per_node, ..Default::default() }
    }

    #[test]
    fn tasks_spread_as_slurm_blocks_them() {
        assert_eq!(TaskLayout::default().tasks_on_nodes(1), [1]);
        assert_eq!(TaskLayout::default().tasks_on_nodes(3), [1, 1, 1], "one task per node by default");
        assert_eq!(layout(2, 5, 0).tasks_on_nodes(2), [3, 2]);
        assert_eq!(layout(3, 5, 0).tasks_on_nodes(3), [2, 2, 1]);
        assert_eq!(layout(4, 5, 0).tasks_on_nodes(4), [2, 1, 1, 1]);
        assert_eq!(layout(2, 0, 4).tasks_on_nodes(2), [4, 4]);
        assert_eq!(layout(2, 6, 4).tasks_on_nodes(2), [3, 3], "ntasks wins; ntasks-per-node is a maximum");
        assert_eq!(layout(0, 4, 0).tasks_on_nodes(1), [4]);
        assert_eq!(layout(2, 0, 2).total_tasks(2), 4);
        assert_eq!(TaskLayout::default().tasks_on_nodes(0), [1], "at least one node");
    }

    #[test]
    fn the_node_count_comes_from_nodes_or_tasks() {
        assert_eq!(TaskLayout::default().nodes_asked(), None);
        assert_eq!(layout(3, 0, 0).nodes_asked(), Some(3));
        assert_eq!(layout(0, 8, 4).nodes_asked(), Some(2));
        assert_eq!(layout(0, 9, 4).nodes_asked(), Some(3));
        assert_eq!(layout(0, 8, 0).nodes_asked(), None, "-n alone may fit on one node");
        assert_eq!(TaskLayout::default().cpus_of_task(), 1);
    }

    #[test]
    fn bad_layouts_are_refused_with_the_reason() {
        assert_eq!(TaskLayout::default().validate(), Ok(()));
        assert_eq!(layout(2, 8, 4).validate(), Ok(()));
        for (bad, why) in [
            (layout(4, 2, 0), "fewer than --nodes"),
            (layout(2, 9, 4), "does not fit"),
            (layout(MAX_NODES_PER_JOB + 1, 0, 0), "--nodes"),
            (layout(1, MAX_TASKS_PER_JOB + 1, 0), "--ntasks"),
            (TaskLayout { cpus_per_task: 2, cpus_per_gpu: 2, ..Default::default() }, "mutually exclusive"),
            (TaskLayout { mem_per_cpu: 1, mem_per_gpu: 1, ..Default::default() }, "mutually exclusive"),
            (TaskLayout { gpu_type: Some("a 100".into()), ..Default::default() }, "GPU type"),
        ] {
            let e = bad.validate().unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn gpu_types_match_model_names() {
        assert!(gpu_type_matches("NVIDIA A100-SXM4-80GB", "a100"));
        assert!(gpu_type_matches("NVIDIA A100-SXM4-80GB", "A100-SXM4"));
        assert!(gpu_type_matches("RTX 5090", "rtx_5090"));
        assert!(gpu_type_matches("NVIDIA H100 80GB HBM3", "h100"));
        assert!(!gpu_type_matches("NVIDIA H100 80GB HBM3", "a100"));
        assert!(!gpu_type_matches("RTX 5090", ""));
    }

    #[test]
    fn old_encodings_decode_to_the_default_layout() {
        let layout: TaskLayout = serde_json::from_str("{}").unwrap();
        assert!(layout.is_default());
        let names: SlurmNames = serde_json::from_str("{}").unwrap();
        assert!(names.is_default());
    }
}
