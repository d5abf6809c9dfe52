//! This node's tasks of a step (`srun` inside a job): `start` launches them into the run's
//! cgroup, each with its own environment (`SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NODEID`,
//! `SLURM_STEP_ID`, its GPUs with `--gpus-per-task`) and output file
//! (`<run dir>/step-<step>.<task>.out`); `wait` reaps them, carries out the runtime's orders
//! (signals, a kill, `srun --wait`'s kill once a task ended here or on another node) on those
//! not reaped yet, and reports their end as one event.

use super::state::Event;
use crate::executor::{task_output, TaskProcess, TaskSpec};
use crate::jobs::JobTable;
use corral_types::{Job, JobId, StepId, StepNodeEnd, TaskExit};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;

/// What the runtime asks of a step's running tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// This signal to every task not yet gone.
    Signal(i32),
    /// SIGTERM, then SIGKILL after `grace`.
    Kill { grace: Duration },
    /// A task of the step ended on another node: `--wait`'s time runs from now (unless a task
    /// here ended first).
    StartWait,
}

/// This node's started tasks of a step.
pub(crate) struct Started {
    job_id: JobId,
    epoch: u64,
    step: StepId,
    node: String,
    /// `--kill-on-bad-exit`: a task that fails here kills the others here at once (the leader
    /// then stops the other nodes' tasks when this node reports).
    kill_on_bad_exit: bool,
    /// `--wait`: once a task ended (here, or another node's as `Order::StartWait` says), the
    /// others here are killed this much later.
    wait: Option<Duration>,
    /// (task rank, process)
    tasks: Vec<(u32, TaskProcess)>,
}

/// The environment of one task: the run's, the step's (what `srun` exported), then the task's
/// own Slurm variables; this node's directory of in-job commands (`in_job_bin`) first on its
/// `PATH` (the exported `PATH` names the `srun` node's, which may be elsewhere here).
pub(crate) fn task_env(
    run_env: &BTreeMap<String, String>,
    job: &Job,
    step: &corral_types::JobStep,
    node: &str,
    local: u32,
    in_job_bin: &Path,
) -> BTreeMap<String, String> {
    let export_none = step.spec.env.contains_key(crate::in_job::EXPORT_NONE);
    // `srun --export=NONE`: as Slurm's, only SLURM_* of the job's environment, with what the
    // node gives every task (corral's own, the GPUs'); the job's other variables stay out.
    let kept =
        |k: &str| !export_none || ["SLURM_", "SLURMD_", "CORRAL_", "CUDA_", "NVIDIA_"].iter().any(|p| k.starts_with(p));
    let mut env: BTreeMap<String, String> =
        run_env.iter().filter(|(k, _)| kept(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
    env.extend(step.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.remove(crate::in_job::EXPORT_NONE);
    let bin = in_job_bin.display().to_string();
    let path = env.get("PATH").map_or(crate::executor::DEFAULT_PATH, String::as_str);
    if path.split(':').next() != Some(bin.as_str()) {
        let path = format!("{bin}:{path}");
        env.insert("PATH".to_owned(), path);
    }
    // The batch node's BASH_ENV file (srun exports it) is this node's own here.
    let ours = Path::new(env.get("BASH_ENV").map_or("", String::as_str)).file_name()
        == Some(std::ffi::OsStr::new(crate::in_job_bin::BASH_ENV_FILE));
    if ours {
        let file = in_job_bin.join(crate::in_job_bin::BASH_ENV_FILE);
        env.insert("BASH_ENV".to_owned(), file.display().to_string());
    }
    let here = step.on_node(node);
    let first = here.map_or(0, |n| n.first_task);
    let node_id = job.allocation.as_ref().and_then(|a| a.parts().position(|(n, _)| n == node)).unwrap_or(0);
    let ntasks = step.ntasks();
    let step_nodes = step.node_names();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_owned(), v);
    };
    set("SLURM_PROCID", (first + local).to_string());
    set("SLURM_LOCALID", local.to_string());
    set("SLURM_NODEID", node_id.to_string());
    set("SLURM_STEP_ID", step.id.to_string());
    set("SLURM_STEPID", step.id.to_string());
    set("SLURM_NTASKS", ntasks.to_string());
    set("SLURM_NPROCS", ntasks.to_string());
    set("SLURM_STEP_NUM_TASKS", ntasks.to_string());
    set("SLURM_STEP_NUM_NODES", step_nodes.len().to_string());
    set("SLURM_STEP_NODELIST", corral_types::hostlist::compress(&step_nodes));
    set("SLURM_STEP_TASKS_PER_NODE", step.nodes.iter().map(|n| n.tasks.to_string()).collect::<Vec<_>>().join(","));
    // torchrun-style launchers read these too.
    set("RANK", (first + local).to_string());
    set("LOCAL_RANK", local.to_string());
    set("WORLD_SIZE", ntasks.to_string());
    // Without --gpus-per-task, the step's GPUs of this node (srun --gpus) are its tasks' to share.
    let shared = step.spec.gpus_per_task.is_none_or(|g| g == 0)
        && (step.spec.gpus.is_some() || step.spec.gpus_per_node.is_some());
    let gpus =
        here.and_then(|n| if shared && !n.gpus.is_empty() { Some(n.gpus.as_slice()) } else { n.task_gpus(local) });
    if let Some(gpus) = gpus {
        set("CUDA_VISIBLE_DEVICES", gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
    }
    env
}

/// Launches this node's tasks of step `step_id` of run `epoch` of `job`. On failure the tasks
/// started are killed and the error is the node's end of the step.
pub(crate) fn start(
    jobs: &JobTable,
    job: &Job,
    epoch: u64,
    step_id: StepId,
    node: &str,
    in_job_bin: &Path,
) -> Result<Started, StepNodeEnd> {
    let fail = |e: String| StepNodeEnd { node: node.to_owned(), tasks: Vec::new(), launch_error: Some(e) };
    let step = job.steps.steps.iter().find(|s| s.id == step_id).ok_or_else(|| fail("no such step".into()))?;
    let here = step.on_node(node).ok_or_else(|| fail(format!("the step has no tasks on node {node}")))?;
    let (Some(handle), Some(info)) = (jobs.handle(job.id, epoch), jobs.info(job.id, epoch)) else {
        return Err(fail(format!("the run does not run on node {node}")));
    };
    // In an image job the tasks run in the job's container, where the in-job commands are
    // mounted at their own place.
    let in_job_bin = if info.in_container { Path::new(crate::in_job_bin::CONTAINER_IN_JOB_BIN) } else { in_job_bin };
    let cwd = step.spec.cwd.as_ref().map(PathBuf::from).unwrap_or_else(|| info.cwd.clone());
    let mut tasks = Vec::new();
    for local in 0..here.tasks {
        let rank = here.first_task + local;
        let spec = TaskSpec {
            argv: step.spec.command.clone(),
            env: task_env(&info.env, job, step, node, local, in_job_bin),
            cwd: cwd.clone(),
            output: task_output(&info.work_dir, step_id, rank),
            uid: info.uid,
            gid: info.gid,
            open_files: info.open_files,
        };
        match handle.spawn_task(&spec) {
            Ok(process) => tasks.push((rank, process)),
            Err(e) => {
                for (_, process) in &tasks {
                    process.signal(Signal::SIGKILL);
                }
                return Err(fail(format!("task {rank}: {e}")));
            }
        }
    }
    tracing::info!(job_id = job.id, epoch, step = step_id, tasks = tasks.len(), "step tasks started");
    let kill_on_bad_exit = step.spec.kill_on_bad_exit;
    let wait = step.spec.wait_secs.filter(|s| *s > 0).map(|s| Duration::from_secs(u64::from(s)));
    Ok(Started { job_id: job.id, epoch, step: step_id, node: node.to_owned(), kill_on_bad_exit, wait, tasks })
}

/// What woke the waiter.
enum Woke {
    Exit(usize, std::io::Result<(Option<i32>, Option<i32>)>),
    Order(Option<Order>),
    KillDue,
    WaitOver,
}

/// Waits for every task of `started`, carrying out `orders` on those not reaped yet, then
/// reports their exits.
pub(crate) async fn wait(
    started: Started,
    mut orders: mpsc::UnboundedReceiver<Order>,
    events: mpsc::UnboundedSender<Event>,
    kill_grace: Duration,
) {
    let Started { job_id, epoch, step, node, kill_on_bad_exit, wait, tasks } = started;
    let mut running = tasks;
    let mut exits = Vec::new();
    let mut kill_at: Option<tokio::time::Instant> = None;
    // `--wait`: when the others are killed; `waited` once that time was set (it is set once).
    let mut wait_over: Option<tokio::time::Instant> = None;
    let mut waited = false;
    let mut start_wait = |wait_over: &mut Option<tokio::time::Instant>| {
        if let (Some(wait), false) = (wait, waited) {
            waited = true;
            *wait_over = Some(tokio::time::Instant::now() + wait);
        }
    };
    let signal_all = |running: &[(u32, TaskProcess)], signal: Signal| {
        for (_, process) in running {
            // Not reaped yet, so its pids are still its own.
            process.signal(signal);
        }
    };
    let mut orders_open = true;
    while !running.is_empty() {
        let woke = {
            let next = futures::future::select_all(running.iter_mut().map(|(_, p)| Box::pin(p.wait())));
            let at = |when: Option<tokio::time::Instant>| async move {
                match when {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                (result, index, _) = next => Woke::Exit(index, result),
                order = orders.recv(), if orders_open => Woke::Order(order),
                _ = at(kill_at) => Woke::KillDue,
                _ = at(wait_over) => Woke::WaitOver,
            }
        };
        match woke {
            Woke::Exit(index, result) => {
                let (rank, _) = running.remove(index);
                let (exit_code, signal) = result.unwrap_or((None, Some(libc::SIGKILL)));
                let exit = TaskExit { task: rank, exit_code, signal };
                if kill_on_bad_exit && exit.status() != 0 && kill_at.is_none() && !running.is_empty() {
                    tracing::info!(job_id, step, task = rank, "a task failed: killing the step's other tasks here");
                    signal_all(&running, Signal::SIGTERM);
                    kill_at = Some(tokio::time::Instant::now() + kill_grace);
                }
                exits.push(exit);
                start_wait(&mut wait_over);
            }
            Woke::Order(Some(Order::StartWait)) => start_wait(&mut wait_over),
            Woke::WaitOver => {
                tracing::info!(job_id, step, "--wait is over since a task ended: killing the step's other tasks here");
                signal_all(&running, Signal::SIGTERM);
                kill_at.get_or_insert(tokio::time::Instant::now() + kill_grace);
                wait_over = None;
            }
            Woke::Order(None) => orders_open = false,
            Woke::Order(Some(Order::Signal(signal))) => match Signal::try_from(signal) {
                Ok(signal) => signal_all(&running, signal),
                Err(_) => tracing::warn!(job_id, step, signal, "not a signal: ignored"),
            },
            Woke::Order(Some(Order::Kill { grace })) => {
                signal_all(&running, Signal::SIGTERM);
                kill_at.get_or_insert(tokio::time::Instant::now() + grace);
            }
            Woke::KillDue => {
                signal_all(&running, Signal::SIGKILL);
                kill_at = None;
            }
        }
    }
    exits.sort_by_key(|e| e.task);
    tracing::info!(job_id, epoch, step, status = ?exits.iter().map(TaskExit::status).max(), "step tasks ended");
    let end = StepNodeEnd { node, tasks: exits, launch_error: None };
    let _ = events.send(Event::TasksEnded { job_id, epoch, step, end });
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{JobStep, NodeGpus, StepNode};

    /// Ranks as Slurm's block distribution gives them, each task its GPU with
    /// `--gpus-per-task`, what srun exported, and this node's in-job commands first on `PATH`.
    #[test]
    fn each_task_has_its_own_ranks_gpus_and_this_nodes_commands() {
        let mut job = (*crate::reconcile::tests::job(7, 3)).clone();
        let alloc = job.allocation.as_mut().expect("allocation");
        alloc.node = "n1".into();
        alloc.more_nodes = vec![NodeGpus { node: "n2".into(), gpus: vec![0, 1] }];
        let mut step = JobStep {
            id: 2,
            epoch: 3,
            nodes: vec![
                StepNode { node: "n1".into(), first_task: 0, tasks: 2, gpus: vec![] },
                StepNode { node: "n2".into(), first_task: 2, tasks: 2, gpus: vec![1, 0] },
            ],
            ..Default::default()
        };
        step.spec.env.insert("PATH".into(), "/elsewhere/slurm-bin:/usr/bin".into());
        step.spec.env.insert("MY_VAR".into(), "x".into());
        step.spec.env.insert("BASH_ENV".into(), "/elsewhere/slurm-bin/corral-bash-env.sh".into());
        let run_env = BTreeMap::from([("CORRAL_JOB_DIR".to_owned(), "/data/jobs/7/3".to_owned())]);
        let bin = Path::new("/data/slurm-bin");
        let env = task_env(&run_env, &job, &step, "n2", 1, bin);
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(
            [get("SLURM_PROCID"), get("SLURM_LOCALID"), get("SLURM_NODEID"), get("SLURM_STEP_ID")],
            [Some("3"), Some("1"), Some("1"), Some("2")]
        );
        assert_eq!([get("SLURM_NTASKS"), get("SLURM_STEP_NUM_NODES")], [Some("4"), Some("2")]);
        assert_eq!(get("CUDA_VISIBLE_DEVICES"), Some("0"), "task 1 of n2 gets the second of [1, 0]");
        assert_eq!(get("MY_VAR"), Some("x"));
        assert_eq!(get("CORRAL_JOB_DIR"), Some("/data/jobs/7/3"), "the node's own run directory");
        assert_eq!(get("PATH"), Some("/data/slurm-bin:/elsewhere/slurm-bin:/usr/bin"));
        assert_eq!(get("BASH_ENV"), Some("/data/slurm-bin/corral-bash-env.sh"), "this node's file");
        let mut own = step.clone();
        own.spec.env.insert("BASH_ENV".into(), "/home/ana/env.sh".into());
        let env = task_env(&run_env, &job, &own, "n2", 1, bin);
        assert_eq!(env.get("BASH_ENV").map(String::as_str), Some("/home/ana/env.sh"), "a user's own is kept");
        let mut shared = step.clone();
        shared.spec.gpus = Some(2);
        let env = task_env(&run_env, &job, &shared, "n2", 1, bin);
        assert_eq!(env.get("CUDA_VISIBLE_DEVICES").map(String::as_str), Some("1,0"), "srun --gpus: shared");
        let first = task_env(&run_env, &job, &step, "n1", 0, bin);
        assert_eq!(first.get("CUDA_VISIBLE_DEVICES"), None, "without --gpus-per-task: the job's GPUs");
        assert_eq!(first.get("SLURM_PROCID").map(String::as_str), Some("0"));
        let again = task_env(&first, &job, &JobStep { nodes: step.nodes.clone(), ..Default::default() }, "n1", 0, bin);
        assert_eq!(again.get("PATH"), first.get("PATH"), "not added twice");
        // --export=NONE,A=1: the run's SLURM_* and corral's own, what was named, no other.
        let run_env = BTreeMap::from([
            ("CORRAL_JOB_DIR".to_owned(), "/data/jobs/7/3".to_owned()),
            ("SLURM_JOB_ID".to_owned(), "7".to_owned()),
            ("HOME".to_owned(), "/home/ana".to_owned()),
            ("MY_VAR".to_owned(), "x".to_owned()),
        ]);
        let mut none = step.clone();
        none.spec.env = BTreeMap::from([("A".into(), "1".into()), (crate::in_job::EXPORT_NONE.into(), "1".into())]);
        let env = task_env(&run_env, &job, &none, "n2", 1, bin);
        for (k, want) in [("A", Some("1")), ("SLURM_JOB_ID", Some("7")), ("HOME", None), ("MY_VAR", None)] {
            assert_eq!(env.get(k).map(String::as_str), want, "{k}");
        }
        assert_eq!(env.get(crate::in_job::EXPORT_NONE), None, "the mark is the worker's");
        assert_eq!(
            env.get("PATH").map(String::as_str),
            Some(format!("/data/slurm-bin:{}", crate::executor::DEFAULT_PATH).as_str())
        );
        assert_eq!(env.get("SLURM_PROCID").map(String::as_str), Some("3"), "the task's own");
    }
}
