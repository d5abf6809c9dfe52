//! The rendezvous environment of a job's part: where the parts of a gang meet (MASTER_ADDR,
//! MASTER_PORT), who this part is (NODE_RANK, RANK) and how big the gang is (NNODES,
//! LOCAL_WORLD_SIZE, WORLD_SIZE), their `PET_*` twins that torchrun reads as defaults of its
//! flags, their Slurm twins (with the node list, `SLURM_JOB_NODELIST`), and a hostfile of the parts' nodes (`CORRAL_HOSTFILE`).
//!
//! One process runs per part (typically a launcher: torchrun, deepspeed, mpirun) and starts one
//! worker per GPU of its node, so: NODE_RANK is the part index (the allocation's order, the
//! first part is where the gang meets), NNODES the number of parts, LOCAL_WORLD_SIZE the GPUs
//! of this part, WORLD_SIZE = NNODES x LOCAL_WORLD_SIZE and RANK = NODE_RANK x LOCAL_WORLD_SIZE
//! (the global rank of the part's first GPU worker; torchrun sets each worker's own RANK).
//! A single-node job gets only NNODES=1, NODE_RANK=0, LOCAL_WORLD_SIZE (jobs with GPUs) and their
//! twins: no
//! MASTER_* (`torchrun --standalone` picks its own port), no WORLD_SIZE/RANK, no hostfile.

use corral_types::{hostlist, Job};
use std::collections::BTreeMap;

/// Name of the hostfile in the job's work directory.
pub(crate) const HOSTFILE: &str = "hostfile";

/// Where the parts of a job's run are, as the leader's desired state says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartAddrs {
    /// Host of the first part's node (where the gang meets).
    pub master_addr: String,
    /// Host of every part's node, in part order.
    pub part_addrs: Vec<String>,
}

/// The gang variables of the part of `job` on `node`, and the hostfile's contents (gangs only).
/// `hostfile_path` is where the job sees the work directory's hostfile.
pub(crate) fn gang_env(
    job: &Job,
    node: &str,
    addrs: &PartAddrs,
    hostfile_path: &str,
) -> (BTreeMap<String, String>, Option<String>) {
    let mut env = BTreeMap::new();
    let Some(alloc) = job.allocation.as_ref() else { return (env, None) };
    let parts: Vec<(&str, &[u32])> = alloc.parts().collect();
    let node_rank = parts.iter().position(|(n, _)| *n == node).unwrap_or(0);
    let local = parts.get(node_rank).map_or(0, |(_, gpus)| gpus.len());
    let nnodes = parts.len();
    let mut set = |keys: &[&str], value: String| {
        for key in keys {
            env.insert((*key).to_string(), value.clone());
        }
    };
    // SLURM_NTASKS counts tasks, not nodes: the allocation's variables set it.
    set(&["NNODES", "PET_NNODES", "SLURM_NNODES"], nnodes.to_string());
    set(&["NODE_RANK", "PET_NODE_RANK", "SLURM_NODEID", "SLURM_PROCID"], node_rank.to_string());
    // One process a part (a batch step, a gang's command): the first of its node.
    set(&["SLURM_LOCALID"], "0".to_string());
    if local > 0 {
        set(&["LOCAL_WORLD_SIZE", "PET_NPROC_PER_NODE"], local.to_string());
    }
    if !alloc.is_gang() {
        return (env, None);
    }
    // Slurm's compressed form, in allocation order: `scontrol show hostnames | head -n 1` is
    // the first node, where a batch job's script runs and the gang meets.
    let names: Vec<&str> = parts.iter().map(|(n, _)| *n).collect();
    set(&["SLURM_JOB_NODELIST", "SLURM_NODELIST"], hostlist::compress(&names));
    set(&["SLURM_JOB_NUM_NODES"], nnodes.to_string());
    set(&["WORLD_SIZE"], (nnodes * local).to_string());
    set(&["RANK"], (node_rank * local).to_string());
    if !addrs.master_addr.is_empty() {
        set(&["MASTER_ADDR", "PET_MASTER_ADDR"], addrs.master_addr.clone());
    }
    if let Some(port) = alloc.master_port {
        set(&["MASTER_PORT", "PET_MASTER_PORT"], port.to_string());
    }
    // One line per part, as MPI and DeepSpeed read it: `host slots=<gpus>`.
    let hostfile: String = parts
        .iter()
        .enumerate()
        .map(|(i, (_, gpus))| {
            let host = addrs.part_addrs.get(i).map_or("", String::as_str);
            format!("{host} slots={}\n", gpus.len())
        })
        .collect();
    set(&["CORRAL_HOSTFILE"], hostfile_path.to_string());
    (env, Some(hostfile))
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{Allocation, JobSpec, JobState, NodeGpus, Timestamp};

    fn job(alloc: Allocation) -> Job {
        Job {
            id: 7,
            spec: JobSpec::default(),
            state: JobState::Running,
            request_id: String::new(),
            submitted_at: Timestamp(1),
            admitted_at: None,
            started_at: None,
            finished_at: None,
            allocation: Some(alloc),
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 1,
            worker_run_time_ms: None,
            preemption: None,
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: Default::default(),
        }
    }

    fn gang() -> Job {
        job(Allocation {
            node: "gpu-01".into(),
            gpus: vec![0, 1, 2, 3],
            epoch: 9,
            more_nodes: vec![NodeGpus { node: "gpu-02".into(), gpus: vec![4, 5, 6, 7] }],
            master_port: Some(29500),
            ..Default::default()
        })
    }

    fn addrs() -> PartAddrs {
        PartAddrs { master_addr: "10.0.0.1".into(), part_addrs: vec!["10.0.0.1".into(), "10.0.0.2".into()] }
    }

    #[test]
    fn each_part_of_a_gang_knows_where_to_meet_and_who_it_is() {
        let (env, hostfile) = gang_env(&gang(), "gpu-02", &addrs(), "/data/jobs/7/9/hostfile");
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("29500"));
        assert_eq!((get("NNODES"), get("NODE_RANK"), get("LOCAL_WORLD_SIZE")), (Some("2"), Some("1"), Some("4")));
        assert_eq!((get("WORLD_SIZE"), get("RANK")), (Some("8"), Some("4")));
        assert_eq!(
            (get("PET_NNODES"), get("PET_NODE_RANK"), get("PET_NPROC_PER_NODE")),
            (Some("2"), Some("1"), Some("4"))
        );
        assert_eq!((get("PET_MASTER_ADDR"), get("PET_MASTER_PORT")), (Some("10.0.0.1"), Some("29500")));
        assert_eq!((get("SLURM_NNODES"), get("SLURM_NODEID"), get("SLURM_PROCID")), (Some("2"), Some("1"), Some("1")));
        assert_eq!(get("CORRAL_HOSTFILE"), Some("/data/jobs/7/9/hostfile"));
        assert_eq!((get("SLURM_JOB_NODELIST"), get("SLURM_NODELIST")), (Some("gpu-[01-02]"), Some("gpu-[01-02]")));
        assert_eq!(get("SLURM_JOB_NUM_NODES"), Some("2"));
        assert_eq!(hostfile.as_deref(), Some("10.0.0.1 slots=4\n10.0.0.2 slots=4\n"));

        let (env, _) = gang_env(&gang(), "gpu-01", &addrs(), "h");
        assert_eq!((env["NODE_RANK"].as_str(), env["RANK"].as_str()), ("0", "0"));
    }

    #[test]
    fn a_single_node_job_gets_only_the_harmless_counts() {
        let single = job(Allocation { node: "gpu-01".into(), gpus: vec![0, 1], epoch: 3, ..Default::default() });
        let (env, hostfile) = gang_env(&single, "gpu-01", &PartAddrs::default(), "h");
        assert_eq!(hostfile, None);
        let keys: Vec<&str> = env.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "LOCAL_WORLD_SIZE",
                "NNODES",
                "NODE_RANK",
                "PET_NNODES",
                "PET_NODE_RANK",
                "PET_NPROC_PER_NODE",
                "SLURM_LOCALID",
                "SLURM_NNODES",
                "SLURM_NODEID",
                "SLURM_PROCID"
            ]
        );
        assert_eq!(
            (env["NNODES"].as_str(), env["NODE_RANK"].as_str(), env["LOCAL_WORLD_SIZE"].as_str()),
            ("1", "0", "2")
        );
        // Without GPUs there is no per-node process count to suggest.
        let cpu_only = job(Allocation { node: "gpu-01".into(), epoch: 4, ..Default::default() });
        let (env, _) = gang_env(&cpu_only, "gpu-01", &PartAddrs::default(), "h");
        assert!(!env.contains_key("LOCAL_WORLD_SIZE") && !env.contains_key("PET_NPROC_PER_NODE"), "{env:?}");
    }
}
