//! `srun` inside a job, on real processes: a coordinator and two workers. A 2-node batch script
//! runs `srun` steps whose tasks run on both nodes inside the job's cgroups, each with its own
//! ranks and GPUs; every task's output reaches the job's output file through `srun`,
//! which exits with Slurm's rule; `--kill-on-bad-exit` stops the other tasks; a cancel while a
//! step runs kills its tasks on every node; a torchrun-style launcher finds its head node with
//! `scontrol`; a login-shell script reaches Slurm's commands; one-GPU steps side by side get
//! GPUs of their own and wait for one; `--export=NONE` leaves the script's variables out;
//! outside a job `srun` points at `corral run`; `--ntasks` with `--gpus-per-task` spreads over
//! the fewest nodes that hold the tasks; `srun --wait` kills the rest after the first task
//! ended; `srun --gpus` is shared by each node's tasks.

use corral_integration::cluster::{free_port, Cluster};
use corral_integration::one_line_stderr;
use corral_integration::worker::WorkerProc;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// A coordinator and workers w1 and w2 (2 simulated GPUs each).
fn pool() -> (Cluster, Vec<WorkerProc>, tempfile::TempDir) {
    corral_integration::worker::two_node_pool(free_port())
}

fn submit(cluster: &Cluster, script: &Path) -> u64 {
    let submitted = cluster.corral_at(0, &["sbatch", &script.display().to_string()]);
    assert!(submitted.status.success(), "{}", one_line_stderr(&submitted));
    String::from_utf8_lossy(&submitted.stdout).trim().parse().expect("a job id")
}

/// Writes `name` in `out` with `body` after the shebang line and submits it.
fn sbatch(cluster: &Cluster, out: &Path, name: &str, body: &str) -> u64 {
    let script = out.join(name);
    std::fs::write(&script, format!("#!/bin/sh\n{body}")).expect("write");
    submit(cluster, &script)
}

/// Waits for `job` to end and returns it as `corral show` has it.
fn ended(cluster: &Cluster, job: u64) -> serde_json::Value {
    cluster.wait_for(job, Duration::from_secs(120), "ended", |d| d["state"] != "pending" && d["state"] != "running")
}

fn logs(workers: &[WorkerProc]) -> String {
    workers.iter().map(WorkerProc::log).collect::<Vec<_>>().join("\n")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn srun_runs_a_steps_tasks_on_every_node_of_the_job() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "train.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --gpus-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             echo batch-once\n\
             export HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n\
             srun -l sh -c 'echo \"$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURM_NTASKS $SLURM_STEP_ID $SLURMD_NODENAME $HEAD\" > {out}/task-$SLURM_PROCID; echo hello-$SLURM_PROCID'\n\
             echo \"srun-exit $?\"\n\
             srun sh -c 'exit 0'\n\
             srun -o {out}/o-%j-%t.out sh -c 'echo rank-$SLURM_PROCID'\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    assert_eq!(output.matches("batch-once").count(), 1, "the batch step ran once: {output}");
    // Every task's output reaches the job's output through srun, labelled: the batch node's
    // (0 and 1) from their files, the other node's (2 and 3) through the workers.
    for line in ["0: hello-0", "1: hello-1", "2: hello-2", "3: hello-3", "srun-exit 0"] {
        assert!(output.lines().any(|l| l == line), "{line:?} in {output:?}\n{}", logs(&workers));
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
    // `srun -o PATTERN`: each task's output in its own file, none in the job's.
    for rank in 0..4 {
        assert_eq!(read(&out.join(format!("o-{job}-{rank}.out"))), format!("rank-{rank}\n"), "{}", logs(&workers));
    }
    assert!(!output.contains("rank-"), "{output}");
    // Listed like sacct.
    let shown = cluster.json(&["show", &job.to_string()]);
    let ids: Vec<String> =
        shown["steps"].as_array().expect("steps").iter().map(|s| s["id"].as_str().unwrap_or("").to_string()).collect();
    for id in ["batch", "0", "1"] {
        assert!(ids.contains(&format!("{job}.{id}")), "{job}.{id} in {ids:?}");
    }
}

#[test]
fn srun_gpus_per_task_binds_a_distinct_gpu_to_each_task_of_a_node() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "gpus.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --gpus-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             srun --gpus-per-task 1 sh -c 'echo \"$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES\" > {out}/gpu-$SLURM_PROCID'\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    for pair in [[0, 1], [2, 3]] {
        let [a, b] = pair.map(|r| read(&out.join(format!("gpu-{r}"))));
        let (na, ga) = a.trim().split_once(' ').expect("node gpu");
        let (nb, gb) = b.trim().split_once(' ').expect("node gpu");
        assert_eq!(na, nb, "{a:?} {b:?}");
        assert!(ga != gb && ga.len() == 1 && gb.len() == 1, "distinct single GPUs: {a:?} {b:?}");
    }
    // The job's own --gpus-per-task binds a plain srun's tasks too, as Slurm's srun reads
    // SLURM_GPUS_PER_TASK.
    let job = sbatch(
        &cluster,
        &out,
        "job-gpus.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --gpus-per-task=1\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             srun sh -c 'echo \"$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES\" > {out}/job-gpu-$SLURM_PROCID'\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    for pair in [[0, 1], [2, 3]] {
        let [a, b] = pair.map(|r| read(&out.join(format!("job-gpu-{r}"))));
        let (na, ga) = a.trim().split_once(' ').expect("node gpu");
        let (nb, gb) = b.trim().split_once(' ').expect("node gpu");
        assert_eq!(na, nb, "{a:?} {b:?}");
        assert!(ga != gb && ga.len() == 1 && gb.len() == 1, "the job's --gpus-per-task: {a:?} {b:?}");
    }
}

/// Slurm's `--ntasks` with `--gpus-per-task` and no `--nodes`, as users write it: the tasks
/// spread over the fewest nodes that hold them (3 one-GPU tasks on 2-GPU nodes: 2 + 1), the
/// allocation's variables say so, and a plain `srun` lays its tasks out the same way; tasks
/// that fit one node stay on one; tasks no set of nodes holds are refused at submit.
#[test]
fn tasks_with_gpus_spread_over_the_fewest_nodes_that_hold_them() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let script = |name: &str, tasks: u32| {
        format!(
            "#SBATCH --job-name={name}\n\
             #SBATCH --ntasks={tasks}\n\
             #SBATCH --gpus-per-task=1\n\
             #SBATCH --cpus-per-task=1\n\
             #SBATCH --time=00:10:00\n\
             #SBATCH --output={out}/%x-%j.out\n\
             \n\
             export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n\
             echo \"nodes=$SLURM_JOB_NUM_NODES nnodes=$SLURM_NNODES ntasks=$SLURM_NTASKS per-node=$SLURM_TASKS_PER_NODE\"\n\
             srun sh -c 'echo \"$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURM_NTASKS $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES\" > {out}/{name}-$SLURM_PROCID'\n",
            out = out.display()
        )
    };
    let job = sbatch(&cluster, &out, "spread.sbatch", &script("spread", 3));
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("spread-{job}.out")));
    assert!(output.contains("nodes=2 nnodes=2 ntasks=3 per-node=2,1"), "{output}");
    let tasks: Vec<Vec<String>> = (0..3)
        .map(|r| read(&out.join(format!("spread-{r}"))).split_whitespace().map(str::to_string).collect())
        .collect();
    // procid localid nodeid ntasks node gpus
    assert_eq!(tasks.iter().map(|t| t[..4].join(" ")).collect::<Vec<_>>(), ["0 0 0 3", "1 1 0 3", "2 0 1 3"]);
    assert_eq!(tasks[0][4], tasks[1][4], "the first node runs two tasks: {tasks:?}");
    assert_ne!(tasks[0][4], tasks[2][4], "the third on the other node: {tasks:?}");
    assert!(tasks.iter().all(|t| t.len() == 6 && t[5].len() == 1), "one GPU each: {tasks:?}");
    assert_ne!(tasks[0][5], tasks[1][5], "distinct GPUs on the first node: {tasks:?}");

    // Two tasks fit one node: one node.
    let job = sbatch(&cluster, &out, "pair.sbatch", &script("pair", 2));
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("pair-{job}.out")));
    assert!(output.contains("nodes=1 nnodes=1 ntasks=2 per-node=2"), "{output}");

    // Five one-GPU tasks: no set of these nodes holds them; one line, nothing submitted.
    let before = cluster.corral_at(0, &["queue", "--all"]);
    let script_path = out.join("five.sbatch");
    std::fs::write(&script_path, format!("#!/bin/sh\n{}", script("five", 5))).expect("write");
    let refused = cluster.corral_at(0, &["sbatch", &script_path.display().to_string()]);
    assert!(!refused.status.success());
    let line = one_line_stderr(&refused);
    assert!(line.contains("could never run"), "{line}");
    let after = cluster.corral_at(0, &["queue", "--all"]);
    assert_eq!(before.stdout, after.stdout, "nothing submitted");
}

#[test]
fn srun_kill_on_bad_exit_kills_every_task_and_exits_with_the_highest_status() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "bad.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             start=$(date +%s)\n\
             srun -K sh -c 'if [ \"$SLURM_PROCID\" = 3 ]; then exit 3; fi; exec sleep 60'\n\
             echo \"bad-exit $? after $(( $(date +%s) - start ))\"\n\
             srun sh -c 'exit $SLURM_PROCID'\n\
             echo \"plain-exit $?\"\n\
             srun no-such-program-here\n\
             echo \"missing-exit $?\"\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    // Task 3 fails on the other node; every other task is killed long before its sleep ends
    // (SIGTERM: 128 + 15), and srun exits with the highest status.
    let bad = output.lines().find_map(|l| l.strip_prefix("bad-exit ")).unwrap_or_else(|| panic!("{output:?}"));
    let (code, secs) = bad.split_once(" after ").expect("code and time");
    assert_eq!(code, "143", "{bad}");
    assert!(secs.parse::<u64>().expect("secs") < 30, "the other tasks were killed: {bad}");
    // Without -K every task runs to its end: the highest exit code wins.
    assert!(output.lines().any(|l| l == "plain-exit 3"), "{output:?}");
    assert!(output.contains("task 3: Exited with exit code 3"), "srun names the failed task: {output:?}");
    // A program that is not there: every node says why, srun fails.
    assert!(!output.lines().any(|l| l == "missing-exit 0"), "{output:?}");
    assert!(output.lines().any(|l| l.starts_with("missing-exit ")), "{output:?}");
    assert!(output.contains("no-such-program-here"), "the reason names the program: {output:?}");
}

/// What users care about most: a torchrun launcher computing its head node with `scontrol`,
/// one launcher a node through `srun`.
#[test]
fn a_torchrun_style_launcher_finds_its_head_node_and_runs_once_a_node() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let launcher = out.join("torchrun");
    std::fs::write(
        &launcher,
        format!(
            "#!/bin/sh\n\
             # A stand-in for torchrun: records what it was told and where it runs.\n\
             echo \"$SLURMD_NODENAME $SLURM_NODEID $SLURM_PROCID $*\" > {out}/launcher-$SLURM_NODEID\n\
             scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1 > {out}/head-$SLURM_NODEID\n\
             echo launched-on-$SLURM_NODEID\n",
            out = out.display()
        ),
    )
    .expect("write");
    std::fs::set_permissions(&launcher, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let job = sbatch(
        &cluster,
        &out,
        "torchrun.sbatch",
        &format!(
            "#SBATCH --job-name=ddp\n\
             #SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=1\n\
             #SBATCH --gpus-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             nodes=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\")\n\
             head_node=$(echo \"$nodes\" | head -n 1)\n\
             echo \"head $head_node\"\n\
             srun -u --cpu-bind=none {launcher} --nnodes $SLURM_NNODES --nproc_per_node 2 --rdzv_id $SLURM_JOB_ID \
             --rdzv_backend c10d --rdzv_endpoint $head_node:29500 train.py --epochs 1\n\
             echo \"srun-exit $?\"\n",
            out = out.display(),
            launcher = launcher.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    let head = output.lines().find_map(|l| l.strip_prefix("head ")).unwrap_or_else(|| panic!("{output:?}")).to_owned();
    assert!(!head.is_empty(), "{output:?}");
    for line in ["launched-on-0", "launched-on-1"] {
        assert!(output.lines().any(|l| l == line), "both launchers' output: {output:?}");
    }
    assert!(output.lines().any(|l| l == "srun-exit 0"), "{output:?}");
    assert!(output.contains("srun: warning: --cpu-bind is accepted but not acted on"), "{output:?}");
    let mut nodes = Vec::new();
    for node_id in 0..2 {
        let line = read(&out.join(format!("launcher-{node_id}")));
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f[1..3], [node_id.to_string(), node_id.to_string()], "NODEID and PROCID: {line:?}");
        assert!(line.contains(&format!("--rdzv_endpoint {head}:29500 train.py --epochs 1")), "{line:?}");
        assert!(line.contains("--nnodes 2 "), "{line:?}");
        nodes.push(f[0].to_owned());
        let seen = read(&out.join(format!("head-{node_id}")));
        assert_eq!(seen.trim(), head, "scontrol inside a task on node {node_id}");
    }
    assert_eq!(nodes[0], head, "node 0 is the head node scontrol named");
    assert_ne!(nodes[0], nodes[1], "one launcher a node");
}

/// SIGTERM to `srun` reaches every task of its step, on both nodes; `srun` exits with the
/// tasks' status.
#[test]
fn srun_forwards_sigterm_to_every_task() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "term.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             srun sh -c 'trap \"echo got-term > {out}/term-$SLURM_PROCID; exit 9\" TERM; touch {out}/ready-$SLURM_PROCID; while :; do sleep 0.1; done' &\n\
             srun_pid=$!\n\
             while [ ! -e {out}/ready-0 ] || [ ! -e {out}/ready-1 ] || [ ! -e {out}/ready-2 ] || [ ! -e {out}/ready-3 ]; do sleep 0.1; done\n\
             kill -TERM $srun_pid\n\
             wait $srun_pid\n\
             echo \"srun-exit $?\"\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    assert!(output.lines().any(|l| l == "srun-exit 9"), "{output:?}\n{}", logs(&workers));
    for rank in 0..4 {
        assert_eq!(read(&out.join(format!("term-{rank}"))).trim(), "got-term", "task {rank}");
    }
}

/// A cancel while a step runs kills its tasks on every node: no task outlives its job.
#[test]
fn a_cancel_while_a_step_runs_kills_its_tasks_on_every_node() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "cancel.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=1\n\
             #SBATCH --output={out}/cancel-%j.out\n\
             srun sh -c 'echo $$ > {out}/pid-$SLURM_PROCID; exec sleep 300'\n",
            out = out.display()
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let pids: Vec<i32> = loop {
        let pids: Vec<i32> = (0..2)
            .filter_map(|r| std::fs::read_to_string(out.join(format!("pid-{r}"))).ok()?.trim().parse().ok())
            .collect();
        if pids.len() == 2 {
            break pids;
        }
        assert!(Instant::now() < deadline, "the step's tasks never ran\n{}", logs(&workers));
        std::thread::sleep(Duration::from_millis(50));
    };
    let cancelled = cluster.corral_at(0, &["cancel", &job.to_string()]);
    assert!(cancelled.status.success(), "{}", one_line_stderr(&cancelled));
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "cancelled", "{done}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids.iter().any(|&p| Path::new(&format!("/proc/{p}")).exists()) {
        assert!(Instant::now() < deadline, "a task outlived its cancelled job: {pids:?}\n{}", logs(&workers));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Outside a job `srun` says what to use instead, in one line.
#[test]
fn srun_outside_a_job_points_at_corral_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srun = dir.path().join("srun");
    std::os::unix::fs::symlink(corral_integration::corral_bin(), &srun).expect("symlink");
    let output = std::process::Command::new(&srun)
        .args(["-n", "2", "hostname"])
        .env_remove("CORRAL_RUN_SECRET")
        .env_remove("CORRAL_IN_JOB_SOCKET")
        .output()
        .expect("run srun");
    assert_eq!(output.status.code(), Some(1));
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.contains("not inside a corral job") && err.contains("corral run"), "{err:?}");
}

/// A login-shell script (`#!/bin/bash -l`: its profile resets `PATH` to the system's) still
/// reaches Slurm's commands, in the batch step and in each task, as on a Slurm host where they
/// are on the system's `PATH`.
#[test]
fn a_login_shell_script_reaches_slurms_commands() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let script = out.join("login.sbatch");
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash -l\n\
             #SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=1\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             head=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n\
             echo \"head=$head\"\n\
             srun bash -l -c 'echo \"task $SLURM_PROCID $(command -v scontrol)\"'\n\
             echo \"srun-exit $?\"\n",
            out = out.display()
        ),
    )
    .expect("write");
    let job = submit(&cluster, &script);
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    let head = output.lines().find_map(|l| l.strip_prefix("head=")).unwrap_or_default();
    assert!(head.starts_with('w'), "scontrol ran in the login shell: {output:?}");
    assert!(output.lines().any(|l| l == "srun-exit 0"), "{output:?}");
    for rank in 0..2 {
        let line = output.lines().find(|l| l.starts_with(&format!("task {rank} "))).unwrap_or_default();
        assert!(line.ends_with("/slurm-bin/scontrol"), "task {rank} reaches scontrol: {output:?}");
    }
}

/// Many one-task steps side by side, each with `--gpus=1` (the "one run a GPU" pattern): each
/// task sees a GPU of its own, and a step whose GPUs are all held waits for one, as Slurm's
/// `srun` does, instead of failing.
#[test]
fn side_by_side_one_gpu_steps_get_their_own_gpu_and_wait_for_one() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "sweep.sbatch",
        &format!(
            "#SBATCH --gres=gpu:2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             for i in 0 1 2; do\n\
               srun --exclusive -n1 --gpus=1 sh -c \"echo \\$CUDA_VISIBLE_DEVICES \\$(date +%s%N) > {out}/run-$i; sleep 2; date +%s%N >> {out}/run-$i\" &\n\
             done\n\
             wait\n\
             echo all-done\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    assert!(output.lines().any(|l| l == "all-done"), "{output:?}");
    assert!(output.contains("srun: step creation temporarily disabled"), "the third step waited: {output:?}");
    // (gpu, start, end) of each run.
    let runs: Vec<(String, u128, u128)> = (0..3)
        .map(|i| {
            let text = read(&out.join(format!("run-{i}")));
            let f: Vec<&str> = text.split_whitespace().collect();
            assert_eq!(f.len(), 3, "one GPU, a start and an end: {text:?}");
            (f[0].to_owned(), f[1].parse().expect("start"), f[2].parse().expect("end"))
        })
        .collect();
    for (a, ra) in runs.iter().enumerate() {
        for rb in runs.iter().skip(a + 1) {
            let overlap = ra.1 < rb.2 && rb.1 < ra.2;
            assert!(!overlap || ra.0 != rb.0, "two runs at once on GPU {}: {runs:?}", ra.0);
        }
    }
}

/// `srun --export=NONE`: as Slurm's, the tasks get the job's `SLURM_*` variables and their
/// own, none of the batch script's others; named ones travel.
#[test]
fn srun_export_none_leaves_the_scripts_variables_out() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "none.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=1\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             export MY_VAR=x\n\
             srun --export=NONE sh -c 'echo \"none $SLURM_PROCID my=${{MY_VAR-unset}} job=$SLURM_JOB_ID\"'\n\
             srun --export=NONE,MY_VAR sh -c 'echo \"named $SLURM_PROCID my=$MY_VAR\"'\n\
             srun sh -c 'echo \"all $SLURM_PROCID my=$MY_VAR\"'\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    for rank in 0..2 {
        for line in
            [format!("none {rank} my=unset job={job}"), format!("named {rank} my=x"), format!("all {rank} my=x")]
        {
            assert!(output.lines().any(|l| l == line), "{line:?} in {output:?}");
        }
    }
}

/// `srun --wait=S`: once a task ended, the step's other tasks are killed S seconds later, on
/// its node and on the others; srun then exits with the highest status (SIGTERM: 143).
#[test]
fn srun_wait_kills_the_other_tasks_some_seconds_after_the_first_ends() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "wait.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             start=$(date +%s)\n\
             srun -N 1 -n 2 --wait=1 sh -c '[ $SLURM_PROCID = 0 ] || exec sleep 100'\n\
             echo \"one-node $? $(( $(date +%s) - start ))\"\n\
             start=$(date +%s)\n\
             srun --ntasks-per-node=1 --wait=1 sh -c '[ $SLURM_PROCID = 0 ] || exec sleep 100'\n\
             echo \"two-nodes $? $(( $(date +%s) - start ))\"\n\
             srun --wait=0 -n 2 sh -c '[ $SLURM_PROCID = 0 ] || sleep 3'\n\
             echo \"no-limit $?\"\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    let output = read(&out.join(format!("slurm-{job}.out")));
    for what in ["one-node", "two-nodes"] {
        let line = output.lines().find(|l| l.starts_with(what)).unwrap_or_else(|| panic!("{what}: {output}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words[1], "143", "killed by SIGTERM: {output}");
        let secs: u64 = words[2].parse().expect("seconds");
        assert!((1..60).contains(&secs), "killed about a second after the first task ended, not after 100: {output}");
    }
    assert!(output.lines().any(|l| l == "no-limit 0"), "--wait=0 lets the others run: {output}");
}

/// `srun --gpus=N` over several tasks: the step's GPUs spread over its nodes and each node's
/// tasks share theirs; `--gres=gpu:N`: N on each node.
#[test]
fn srun_gpus_are_shared_by_the_tasks_of_each_node() {
    let (cluster, workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let job = sbatch(
        &cluster,
        &out,
        "shared.sbatch",
        &format!(
            "#SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --gpus-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             srun --gpus=2 sh -c 'echo \"$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES\" > {out}/total-$SLURM_PROCID'\n\
             srun --gres=gpu:2 sh -c 'echo \"$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES\" > {out}/each-$SLURM_PROCID'\n",
            out = out.display()
        ),
    );
    let done = ended(&cluster, job);
    assert_eq!(done["state"], "succeeded", "{done}\n{}", logs(&workers));
    for (prefix, count) in [("total", 1), ("each", 2)] {
        for pair in [[0, 1], [2, 3]] {
            let [a, b] = pair.map(|r| read(&out.join(format!("{prefix}-{r}"))));
            assert_eq!(a, b, "the tasks of a node share its GPUs: {a:?} {b:?}");
            let gpus = a.trim().split_once(' ').map(|(_, g)| g.split(',').count());
            assert_eq!(gpus, Some(count), "{prefix}: {a:?}");
        }
    }
}
