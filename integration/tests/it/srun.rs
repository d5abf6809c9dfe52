//! `srun` inside a job, on real processes: a coordinator and two workers. A 2-node batch script
//! runs `srun` steps whose tasks run on both nodes inside the job's cgroups, each with its own
//! ranks and GPUs; the batch node's task output reaches the job's output file through `srun`,
//! which exits with Slurm's rule; `--kill-on-bad-exit` stops the other tasks; a cancel while a
//! step runs kills its tasks on every node.

use corral_integration::cluster::{free_port, Cluster, ClusterOptions};
use corral_integration::one_line_stderr;
use corral_integration::worker::WorkerProc;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// A coordinator and workers w1 and w2 (2 simulated GPUs each).
fn pool() -> (Cluster, Vec<WorkerProc>, tempfile::TempDir) {
    let port = free_port();
    let cluster = Cluster::start(1, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", one_line_stderr(&init));
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut workers = Vec::new();
    for name in ["w1", "w2"] {
        let mut w = WorkerProc::configure(dir.path(), name, &cluster.endpoints(), 2);
        w.edit_config(|c| format!("rendezvous-ports = \"{port}-{port}\"\n{c}"));
        w.start();
        w.wait_registered(&cluster);
        workers.push(w);
    }
    (cluster, workers, dir)
}

fn submit(cluster: &Cluster, script: &Path) -> u64 {
    let submitted = cluster.corral_at(0, &["sbatch", &script.display().to_string()]);
    assert!(submitted.status.success(), "{}", one_line_stderr(&submitted));
    String::from_utf8_lossy(&submitted.stdout).trim().parse().expect("a job id")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn srun_runs_a_steps_tasks_on_every_node_of_the_job() {
    let (cluster, workers, dir) = pool();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let script = out.join("train.sbatch");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             #SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --gpus-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             echo batch-once\n\
             export HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n\
             srun -l sh -c 'echo \"$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURM_NTASKS $SLURM_STEP_ID $SLURMD_NODENAME $HEAD\" > {out}/task-$SLURM_PROCID; echo hello-$SLURM_PROCID'\n\
             echo \"srun-exit $?\"\n\
             srun --gpus-per-task 1 sh -c 'echo \"$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES\" > {out}/gpu-$SLURM_PROCID'\n\
             echo \"gpu-exit $?\"\n\
             start=$(date +%s)\n\
             srun -K sh -c 'if [ \"$SLURM_PROCID\" = 3 ]; then exit 3; fi; exec sleep 60'\n\
             echo \"bad-exit $? after $(( $(date +%s) - start ))\"\n",
            out = out.display()
        ),
    )
    .expect("write");
    let job = submit(&cluster, &script);
    let done = cluster
        .wait_for(job, Duration::from_secs(120), "ended", |d| d["state"] != "pending" && d["state"] != "running");
    let logs = || format!("{}\n{}", workers[0].log(), workers[1].log());
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs());
    let output = read(&out.join(format!("slurm-{job}.out")));
    assert_eq!(output.matches("batch-once").count(), 1, "the batch step ran once: {output}");
    // The batch node's tasks (0 and 1) reach the job's output through srun, labelled.
    for line in ["0: hello-0", "1: hello-1", "srun-exit 0", "gpu-exit 0"] {
        assert!(output.lines().any(|l| l == line), "{line:?} in {output:?}\n{}", logs());
    }
    // Four tasks, two a node, block distribution, the batch node first.
    let mut by_node = std::collections::BTreeMap::new();
    for rank in 0..4 {
        let line = read(&out.join(format!("task-{rank}")));
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 7, "{line:?}");
        let want = [rank.to_string(), (rank % 2).to_string(), (rank / 2).to_string(), "4".into(), "0".into()];
        assert_eq!(f[..5], want, "PROCID LOCALID NODEID NTASKS STEP_ID of task {rank}: {line:?}");
        by_node.entry(f[5].to_string()).or_insert_with(Vec::new).push(rank);
        if rank < 2 {
            assert_eq!(f[6], f[5], "scontrol's head node is the batch node, where tasks 0 and 1 run: {line:?}");
        } else {
            assert_ne!(f[6], f[5], "{line:?}");
        }
    }
    assert_eq!(by_node.len(), 2, "{by_node:?}");
    // --gpus-per-task 1: each task of a node its own GPU.
    for pair in [[0, 1], [2, 3]] {
        let [a, b] = pair.map(|r| read(&out.join(format!("gpu-{r}"))));
        let (na, ga) = a.trim().split_once(' ').expect("node gpu");
        let (nb, gb) = b.trim().split_once(' ').expect("node gpu");
        assert_eq!(na, nb, "{a:?} {b:?}");
        assert!(ga != gb && ga.len() == 1 && gb.len() == 1, "distinct single GPUs: {a:?} {b:?}");
    }
    // --kill-on-bad-exit: task 3 fails on the other node; every task is killed long before its
    // sleep ends; the exit is the highest status (a task killed by SIGTERM counts 143).
    let bad = output.lines().find_map(|l| l.strip_prefix("bad-exit ")).unwrap_or_else(|| panic!("{output:?}"));
    let (code, secs) = bad.split_once(" after ").expect("code and time");
    assert_ne!(code, "0", "{bad}");
    assert!(secs.parse::<u64>().expect("secs") < 30, "the other tasks were killed: {bad}");
    // Listed like sacct.
    let shown = cluster.json(&["show", &job.to_string()]);
    let ids: Vec<String> =
        shown["steps"].as_array().expect("steps").iter().map(|s| s["id"].as_str().unwrap_or("").to_string()).collect();
    for id in ["batch", "0", "1", "2"] {
        assert!(ids.contains(&format!("{job}.{id}")), "{job}.{id} in {ids:?}");
    }

    // A cancel while a step runs kills its tasks on every node.
    let script = out.join("cancel.sbatch");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             #SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=1\n\
             #SBATCH --output={out}/cancel-%j.out\n\
             srun sh -c 'echo $$ > {out}/pid-$SLURM_PROCID; exec sleep 300'\n",
            out = out.display()
        ),
    )
    .expect("write");
    let job = submit(&cluster, &script);
    let deadline = Instant::now() + Duration::from_secs(60);
    let pids: Vec<i32> = loop {
        let pids: Vec<i32> = (0..2)
            .filter_map(|r| std::fs::read_to_string(out.join(format!("pid-{r}"))).ok()?.trim().parse().ok())
            .collect();
        if pids.len() == 2 {
            break pids;
        }
        assert!(Instant::now() < deadline, "the step's tasks never ran\n{}", logs());
        std::thread::sleep(Duration::from_millis(50));
    };
    let cancelled = cluster.corral_at(0, &["cancel", &job.to_string()]);
    assert!(cancelled.status.success(), "{}", one_line_stderr(&cancelled));
    cluster.wait_for(job, Duration::from_secs(60), "ended", |d| d["state"] != "pending" && d["state"] != "running");
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids.iter().any(|&p| Path::new(&format!("/proc/{p}")).exists()) {
        assert!(Instant::now() < deadline, "a task outlived its cancelled job: {pids:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
