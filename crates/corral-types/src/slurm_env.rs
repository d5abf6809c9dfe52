//! Slurm's view of an allocation for the programs in it: the allocation-wide `SLURM_*`
//! variables, the same on every node and task (node lists in Slurm's compressed syntax, written
//! by `hostlist`). Per-task variables (`SLURM_PROCID`, `SLURM_LOCALID`, ...) are the
//! launcher's. Pure: the worker calls these with the allocation's node names.

use crate::hostlist;
use crate::Job;
use std::collections::BTreeMap;

/// Slurm's compressed tasks-per-node form: counts in node order, repeats as `N(xK)`
/// (`[2, 2, 1]` is `2(x2),1`).
pub fn tasks_per_node_string(tasks: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < tasks.len() {
        let run = tasks[i..].iter().take_while(|t| **t == tasks[i]).count();
        out.push(if run == 1 { tasks[i].to_string() } else { format!("{}(x{run})", tasks[i]) });
        i += run;
    }
    out.join(",")
}

/// The allocation-wide `SLURM_*` variables of `job`, whose allocation spans `nodes` (in
/// allocation order), as seen on `node`: ids and names, the node list and counts, tasks, CPUs,
/// GPUs and memory as the layout asked for them, where and by whom it was submitted, its
/// account and partition. `cluster` is `SLURM_CLUSTER_NAME`.
pub fn slurm_allocation_env(job: &Job, nodes: &[&str], node: &str, cluster: &str) -> BTreeMap<String, String> {
    let spec = &job.spec;
    let layout = &spec.layout;
    let mut env = BTreeMap::new();
    let mut set = |keys: &[&str], value: String| {
        for k in keys {
            env.insert((*k).to_string(), value.clone());
        }
    };
    let count = nodes.len().max(1) as u32;
    set(&["SLURM_JOB_ID", "SLURM_JOBID"], job.id.to_string());
    set(&["SLURM_JOB_NAME"], spec.name.clone());
    set(&["SLURM_JOB_NODELIST", "SLURM_NODELIST"], hostlist::compress(nodes));
    set(&["SLURM_JOB_NUM_NODES", "SLURM_NNODES"], count.to_string());
    let tasks = layout.tasks_on_nodes(count);
    set(&["SLURM_NTASKS", "SLURM_NPROCS"], tasks.iter().sum::<u32>().to_string());
    set(&["SLURM_TASKS_PER_NODE"], tasks_per_node_string(&tasks));
    if layout.ntasks_per_node > 0 {
        set(&["SLURM_NTASKS_PER_NODE"], layout.ntasks_per_node.to_string());
    }
    let node_index = nodes.iter().position(|n| *n == node).unwrap_or(0);
    set(&["SLURM_NODEID"], node_index.to_string());
    set(&["SLURMD_NODENAME"], node.to_string());
    set(&["SLURM_CLUSTER_NAME"], cluster.to_string());
    if layout.cpus_per_task > 0 {
        set(&["SLURM_CPUS_PER_TASK"], layout.cpus_per_task.to_string());
    } else if layout.ntasks == 0 && layout.ntasks_per_node == 0 && spec.cpu_millis > 0 {
        // One task per node: `--cpus` is its CPUs.
        set(&["SLURM_CPUS_PER_TASK"], spec.cpu_millis.div_ceil(1000).to_string());
    }
    if spec.cpu_millis > 0 {
        set(&["SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE"], spec.cpu_millis.div_ceil(1000).to_string());
    }
    let gpu_ids = job.allocation.as_ref().and_then(|a| a.gpus_on(node)).unwrap_or_default();
    let gpus_here = gpu_ids.len();
    if spec.gpu_slice.is_none() && spec.gpus > 0 {
        set(&["SLURM_GPUS_ON_NODE"], gpus_here.to_string());
        // The node's GPU indices, as Slurm's gres plugin writes them.
        set(&["SLURM_JOB_GPUS"], gpu_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
        set(&["SLURM_GPUS_PER_NODE"], spec.gpus_per_part().to_string());
        set(&["SLURM_GPUS"], spec.gpus.to_string());
    }
    if layout.gpus_per_task > 0 {
        set(&["SLURM_GPUS_PER_TASK"], layout.gpus_per_task.to_string());
    }
    if layout.cpus_per_gpu > 0 {
        set(&["SLURM_CPUS_PER_GPU"], layout.cpus_per_gpu.to_string());
    }
    // Slurm's count of requeues, set once the job ran before (`attempts` counts this run).
    if job.attempts > 1 {
        set(&["SLURM_RESTART_COUNT"], (job.attempts - 1).to_string());
    }
    // When the run was placed (it starts then), and when its time limit ends it, in seconds
    // since the epoch.
    if let Some(placed) = job.admitted_at.or(job.started_at) {
        let start = placed.physical_ms() / 1000;
        set(&["SLURM_JOB_START_TIME"], start.to_string());
        if let Some(limit) = spec.time_limit_secs {
            set(&["SLURM_JOB_END_TIME"], start.saturating_add(limit).to_string());
        }
    }
    let mib = |bytes: u64| bytes.div_ceil(1 << 20).to_string();
    if layout.mem_per_cpu > 0 {
        set(&["SLURM_MEM_PER_CPU"], mib(layout.mem_per_cpu));
    } else if layout.mem_per_gpu > 0 {
        set(&["SLURM_MEM_PER_GPU"], mib(layout.mem_per_gpu));
    } else if spec.memory_bytes > 0 {
        set(&["SLURM_MEM_PER_NODE"], mib(spec.memory_bytes));
    }
    let names = &spec.slurm;
    if let Some(dir) = names.submit_dir.as_ref().or(spec.workdir.as_ref()) {
        set(&["SLURM_SUBMIT_DIR"], dir.clone());
    }
    if let Some(host) = &names.submit_host {
        set(&["SLURM_SUBMIT_HOST"], host.clone());
    }
    if let Some(user) = &names.user {
        set(&["SLURM_JOB_USER"], user.clone());
    }
    set(&["SLURM_JOB_ACCOUNT"], names.account.clone().unwrap_or_else(|| spec.tenant.clone()));
    if let Some(partition) = &names.partition {
        set(&["SLURM_JOB_PARTITION"], partition.clone());
    }
    if let Some(qos) = &names.qos {
        set(&["SLURM_JOB_QOS"], qos.clone());
    }
    if let Some(task) = job.array_task {
        set(&["SLURM_ARRAY_JOB_ID"], task.array.to_string());
        set(&["SLURM_ARRAY_TASK_ID"], task.index.to_string());
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Allocation, JobSpec, NodeGpus, SchedOptions, SlurmNames, TaskLayout, Timestamp};

    #[test]
    fn tasks_per_node_repeat_as_slurm_counts_them() {
        assert_eq!(tasks_per_node_string(&[2, 2]), "2(x2)");
        assert_eq!(tasks_per_node_string(&[3, 2]), "3,2");
        assert_eq!(tasks_per_node_string(&[2, 2, 1]), "2(x2),1");
    }

    #[test]
    fn allocation_variables_follow_the_layout() {
        let spec = JobSpec {
            name: "ddp".into(),
            tenant: "team-a".into(),
            gpus: 4,
            cpu_millis: 12_000,
            memory_bytes: 48 << 30,
            sched: SchedOptions { gpus_per_node: Some(2), ..Default::default() },
            layout: TaskLayout {
                nodes: 2,
                ntasks_per_node: 2,
                gpus_per_task: 1,
                cpus_per_task: 6,
                ..Default::default()
            },
            slurm: SlurmNames {
                account: Some("proj_x".into()),
                partition: Some("gpu".into()),
                submit_dir: Some("/home/ana/exp".into()),
                submit_host: Some("login1".into()),
                user: Some("ana".into()),
                ..Default::default()
            },
            workdir: Some("/scratch".into()),
            ..Default::default()
        };
        let mut job = Job::pending(12, spec, String::new(), Timestamp(1));
        job.allocation = Some(Allocation {
            node: "gpu-01".into(),
            gpus: vec![0, 1],
            more_nodes: vec![NodeGpus { node: "gpu-02".into(), gpus: vec![2, 3] }],
            ..Default::default()
        });
        let env = slurm_allocation_env(&job, &["gpu-01", "gpu-02"], "gpu-02", "corral");
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!((get("SLURM_JOB_ID"), get("SLURM_JOBID")), (Some("12"), Some("12")));
        assert_eq!((get("SLURM_JOB_NODELIST"), get("SLURM_NODELIST")), (Some("gpu-[01-02]"), Some("gpu-[01-02]")));
        assert_eq!((get("SLURM_JOB_NUM_NODES"), get("SLURM_NNODES")), (Some("2"), Some("2")));
        assert_eq!((get("SLURM_NTASKS"), get("SLURM_NPROCS")), (Some("4"), Some("4")));
        assert_eq!((get("SLURM_NTASKS_PER_NODE"), get("SLURM_TASKS_PER_NODE")), (Some("2"), Some("2(x2)")));
        assert_eq!((get("SLURM_NODEID"), get("SLURMD_NODENAME")), (Some("1"), Some("gpu-02")));
        assert_eq!((get("SLURM_CPUS_PER_TASK"), get("SLURM_CPUS_ON_NODE")), (Some("6"), Some("12")));
        assert_eq!((get("SLURM_GPUS_ON_NODE"), get("SLURM_GPUS_PER_NODE")), (Some("2"), Some("2")));
        assert_eq!(get("SLURM_JOB_GPUS"), Some("2,3"), "this node's GPU indices");
        assert_eq!(get("SLURM_MEM_PER_NODE"), Some("49152"));
        assert_eq!(get("SLURM_SUBMIT_DIR"), Some("/home/ana/exp"), "the submit directory, not the working one");
        assert_eq!((get("SLURM_SUBMIT_HOST"), get("SLURM_JOB_USER")), (Some("login1"), Some("ana")));
        assert_eq!((get("SLURM_JOB_ACCOUNT"), get("SLURM_JOB_PARTITION")), (Some("proj_x"), Some("gpu")));
        assert_eq!(get("SLURM_CLUSTER_NAME"), Some("corral"));
        assert_eq!(get("SLURM_PROCID"), None, "per task: the launcher's");
        assert_eq!((get("SLURM_RESTART_COUNT"), get("SLURM_JOB_START_TIME")), (None, None), "never placed");

        // Placed a third time at 1 700 000 000.5 s, with an hour's limit and CPUs per GPU.
        job.attempts = 3;
        job.admitted_at = Some(Timestamp::compose(1_700_000_000_500, 0));
        job.spec.time_limit_secs = Some(3600);
        job.spec.layout.cpus_per_gpu = 4;
        let env = slurm_allocation_env(&job, &["gpu-01", "gpu-02"], "gpu-02", "corral");
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("SLURM_RESTART_COUNT"), Some("2"), "requeued twice");
        assert_eq!((get("SLURM_JOB_START_TIME"), get("SLURM_JOB_END_TIME")), (Some("1700000000"), Some("1700003600")));
        assert_eq!(get("SLURM_CPUS_PER_GPU"), Some("4"));
    }
}
