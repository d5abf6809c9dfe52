//! Job steps, Slurm's model of what runs inside an allocation: a job's batch script is its
//! batch step (`12.batch`, derived from the job's own run), and each `srun` inside the job
//! creates a numbered step (`12.0`, `12.1`, …) whose tasks run on the allocation's nodes, in
//! the job's cgroup.
//!
//! A step is recorded in its job (`Job::steps`), so it is replicated, survives a leader change,
//! travels to the workers in the desired state and leaves for the history with its job. It is
//! bound to one run of the job (its allocation `epoch`) and never outlives it. The records are
//! bounded per job: at most [`MAX_LIVE_STEPS`] live and [`MAX_KEPT_STEPS`] kept (older ended
//! ones are dropped, counted in `JobSteps::dropped`); an ended step keeps only the first word of
//! its command and none of its environment.

use crate::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// A step's number within its job: 0, 1, … in creation order.
pub type StepId = u32;

/// Most steps of one job that may run at once (a further `srun` is refused until one ends).
pub const MAX_LIVE_STEPS: usize = 32;
/// Most step records one job keeps: the newest; older ended ones are dropped.
pub const MAX_KEPT_STEPS: usize = 128;
/// Most tasks one step may have.
pub const MAX_STEP_TASKS: u32 = 4096;
/// Largest command and environment of one step (names and values together).
pub const MAX_STEP_SPEC_BYTES: usize = 128 * 1024;
/// Most signals one step records (`srun` forwarding Ctrl-C and SIGTERM, `scancel ID.STEP`).
pub const MAX_STEP_SIGNALS: usize = 16;
/// Most nodes `-w/--nodelist` may name.
pub const MAX_STEP_NODELIST: usize = 1024;

/// What one `srun` asks for. Counts left `None` take Slurm's defaults inside the allocation
/// (corral-core's `plan_tasks`); `srun` fills them from the batch environment first
/// (`SLURM_NTASKS`, …), as Slurm's does.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSpec {
    /// Program and arguments of every task.
    pub command: Vec<String>,
    /// The tasks' environment as `srun --export` gives it (the caller's, by default); the
    /// worker adds each task's own variables on top.
    pub env: BTreeMap<String, String>,
    /// Working directory of the tasks (absolute; `srun`'s own); `None`: the job's.
    #[serde(default)]
    pub cwd: Option<String>,
    /// `-n/--ntasks`.
    #[serde(default)]
    pub ntasks: Option<u32>,
    /// `-N/--nodes`.
    #[serde(default)]
    pub nodes: Option<u32>,
    /// `--ntasks-per-node`.
    #[serde(default)]
    pub ntasks_per_node: Option<u32>,
    /// `--gpus-per-task`: each task gets its own GPUs of its node (`CUDA_VISIBLE_DEVICES`).
    #[serde(default)]
    pub gpus_per_task: Option<u32>,
    /// `-c/--cpus-per-task` (`SLURM_CPUS_PER_TASK` of the tasks).
    #[serde(default)]
    pub cpus_per_task: Option<u32>,
    /// `-w/--nodelist`, expanded: the step runs on exactly these nodes of the allocation.
    #[serde(default)]
    pub nodelist: Vec<String>,
    /// `--overlap`: share GPUs with the other steps instead of taking free ones.
    #[serde(default)]
    pub overlap: bool,
    /// `-K/--kill-on-bad-exit`: a task that fails stops every other task of the step.
    #[serde(default)]
    pub kill_on_bad_exit: bool,
    /// `-G/--gpus`: the step's GPUs, spread over its nodes as evenly as they go (the first
    /// nodes one more) and shared by the tasks of each node (without `--gpus-per-task`).
    #[serde(default)]
    pub gpus: Option<u32>,
    /// `--gres=gpu:N` / `--gpus-per-node`: the step's GPUs on each of its nodes, shared by
    /// that node's tasks (without `--gpus-per-task`).
    #[serde(default)]
    pub gpus_per_node: Option<u32>,
    /// `-W/--wait`: once a task of the step has ended, the others are killed this many
    /// seconds later. `None` or 0: they run on (Slurm's default).
    #[serde(default)]
    pub wait_secs: Option<u32>,
}

impl StepSpec {
    /// Checks what can be checked without the allocation; the message is one line.
    pub fn validate(&self) -> Result<(), String> {
        if self.command.first().is_none_or(|p| p.trim().is_empty()) {
            return Err("no command: give the program to run, e.g. `srun python train.py`".into());
        }
        let bytes: usize = self.command.iter().map(String::len).sum::<usize>()
            + self.env.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
            + self.cwd.as_ref().map_or(0, String::len);
        if bytes > MAX_STEP_SPEC_BYTES {
            return Err(format!(
                "command and environment are {bytes} bytes, at most {MAX_STEP_SPEC_BYTES}: export fewer variables (--export)"
            ));
        }
        if let Some(cwd) = &self.cwd {
            if !cwd.starts_with('/') || cwd.contains('\0') {
                return Err(format!("working directory '{cwd}' must be an absolute path"));
            }
        }
        if self.command.iter().any(|a| a.contains('\0')) {
            return Err("the command contains a NUL byte".into());
        }
        if let Some(key) = self.env.keys().find(|k| k.is_empty() || k.contains('=') || k.contains('\0')) {
            return Err(format!("bad variable name '{key}'"));
        }
        if self.env.values().any(|v| v.contains('\0')) {
            return Err("a variable's value contains a NUL byte".into());
        }
        for (flag, value) in [
            ("--ntasks", self.ntasks),
            ("--nodes", self.nodes),
            ("--ntasks-per-node", self.ntasks_per_node),
            ("--cpus-per-task", self.cpus_per_task),
        ] {
            match value {
                Some(0) => return Err(format!("{flag} must be at least 1")),
                Some(n) if n > MAX_STEP_TASKS => return Err(format!("{flag} {n} is more than {MAX_STEP_TASKS}")),
                _ => {}
            }
        }
        if self.gpus_per_task.is_some_and(|g| g > crate::MAX_GPUS_PER_JOB) {
            return Err(format!("--gpus-per-task is more than {}", crate::MAX_GPUS_PER_JOB));
        }
        if self.nodelist.len() > MAX_STEP_NODELIST {
            return Err(format!("--nodelist names {} nodes, at most {MAX_STEP_NODELIST}", self.nodelist.len()));
        }
        Ok(())
    }
}

/// The tasks of a step on one node: global ranks `first_task .. first_task + tasks`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepNode {
    pub node: String,
    pub first_task: u32,
    pub tasks: u32,
    /// With `--gpus-per-task G`: the node's GPU indices of its tasks, G per task in task order;
    /// empty: every task sees all the job's GPUs of the node.
    #[serde(default)]
    pub gpus: Vec<u32>,
}

impl StepNode {
    /// The GPUs task `local` (0-based on this node) sees, or `None` for all the job's.
    pub fn task_gpus(&self, local: u32) -> Option<&[u32]> {
        if self.gpus.is_empty() || self.tasks == 0 {
            return None;
        }
        let per_task = self.gpus.len() / self.tasks as usize;
        let start = local as usize * per_task;
        self.gpus.get(start..start + per_task)
    }
}

/// Where a step stands, as `sacct` names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum StepState {
    #[default]
    Running,
    /// Every task exited 0.
    Completed,
    /// A task failed: the step's exit code is the highest task's.
    Failed,
    /// The job's run ended (cancel, end of the batch step, preemption, lost node) before every
    /// task did.
    Cancelled,
}

impl StepState {
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Running => "running",
            StepState::Completed => "completed",
            StepState::Failed => "failed",
            StepState::Cancelled => "cancelled",
        }
    }

    pub fn is_live(self) -> bool {
        self == StepState::Running
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one task ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskExit {
    /// Global rank (`SLURM_PROCID`).
    pub task: u32,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
}

impl TaskExit {
    /// The status Slurm counts for the task: its exit code, or 128 + N for signal N.
    pub fn status(&self) -> i32 {
        match (self.exit_code, self.signal) {
            (Some(code), _) => code,
            (None, Some(signal)) => 128 + signal,
            (None, None) => 1,
        }
    }
}

/// What one node of a step reported (or that it was lost).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepNodeEnd {
    pub node: String,
    /// The node's tasks, in rank order.
    pub tasks: Vec<TaskExit>,
    /// The tasks could not be started there.
    #[serde(default)]
    pub launch_error: Option<String>,
}

impl StepNodeEnd {
    /// The highest task status of the node (a launch error counts as 1).
    pub fn status(&self) -> i32 {
        let highest = self.tasks.iter().map(TaskExit::status).max().unwrap_or(0);
        if self.launch_error.is_some() {
            highest.max(1)
        } else {
            highest
        }
    }
}

/// One `srun` of a job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStep {
    pub id: StepId,
    /// The run (allocation epoch) it belongs to.
    pub epoch: u64,
    /// The `srun`'s request id: a retried create returns this step.
    pub request_id: String,
    /// What was asked (an ended step keeps only the first word of its command).
    pub spec: StepSpec,
    /// Its tasks, node by node, in task order.
    pub nodes: Vec<StepNode>,
    pub state: StepState,
    pub created_at: Timestamp,
    #[serde(default)]
    pub ended_at: Option<Timestamp>,
    /// Slurm's rule: the highest task status (a signal N counts as 128 + N).
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// Why it ended, in words.
    #[serde(default)]
    pub reason: Option<String>,
    /// The nodes that reported, in the order they did.
    #[serde(default)]
    pub ended: Vec<StepNodeEnd>,
    /// Signals forwarded to every task, in order; a worker delivers each once.
    #[serde(default)]
    pub signals: Vec<i32>,
    /// With `--kill-on-bad-exit`, a task failed: the nodes still running tasks stop them.
    #[serde(default)]
    pub stopping: bool,
}

impl JobStep {
    /// Number of tasks.
    pub fn ntasks(&self) -> u32 {
        self.nodes.iter().map(|n| n.tasks).sum()
    }

    /// The step's part on `node`, if it has tasks there.
    pub fn on_node(&self, node: &str) -> Option<&StepNode> {
        self.nodes.iter().find(|n| n.node == node)
    }

    /// True once `node` reported its tasks' end.
    pub fn node_ended(&self, node: &str) -> bool {
        self.ended.iter().any(|e| e.node == node)
    }

    /// Node names in task order.
    pub fn node_names(&self) -> Vec<&str> {
        self.nodes.iter().map(|n| n.node.as_str()).collect()
    }
}

/// The steps of a job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSteps {
    /// The id the next step gets.
    pub next_id: StepId,
    /// Kept steps, oldest first (at most [`MAX_KEPT_STEPS`]).
    pub steps: Vec<JobStep>,
    /// Ended steps dropped to stay within the bound.
    #[serde(default)]
    pub dropped: u32,
}

impl JobSteps {
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty() && self.next_id == 0
    }

    pub fn get(&self, id: StepId) -> Option<&JobStep> {
        self.steps.iter().find(|s| s.id == id)
    }

    pub fn get_mut(&mut self, id: StepId) -> Option<&mut JobStep> {
        self.steps.iter_mut().find(|s| s.id == id)
    }

    /// Steps that have not ended.
    pub fn live(&self) -> impl Iterator<Item = &JobStep> {
        self.steps.iter().filter(|s| s.state.is_live())
    }
}

/// How users name a step: `12.0`, `12.batch`, or `12_3.1` for a step of an array task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepRef {
    Batch,
    Numbered(StepId),
}

impl fmt::Display for StepRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepRef::Batch => f.write_str("batch"),
            StepRef::Numbered(id) => write!(f, "{id}"),
        }
    }
}

impl std::str::FromStr for StepRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "batch" => Ok(StepRef::Batch),
            n => {
                n.parse().map(StepRef::Numbered).map_err(|_| format!("invalid step '{s}': expected batch or a number"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> StepSpec {
        StepSpec { command: vec!["python".into(), "train.py".into()], ..Default::default() }
    }

    #[test]
    fn specs_are_checked_with_one_line_errors() {
        assert_eq!(spec().validate(), Ok(()));
        let cases: Vec<(StepSpec, &str)> = vec![
            (StepSpec::default(), "no command"),
            (StepSpec { ntasks: Some(0), ..spec() }, "--ntasks must be at least 1"),
            (StepSpec { nodes: Some(MAX_STEP_TASKS + 1), ..spec() }, "--nodes 4097 is more than 4096"),
            (StepSpec { cwd: Some("rel".into()), ..spec() }, "must be an absolute path"),
            (
                StepSpec { env: [("BIG".to_string(), "v".repeat(MAX_STEP_SPEC_BYTES))].into(), ..spec() },
                "export fewer variables",
            ),
            (StepSpec { env: [("A=B".to_string(), String::new())].into(), ..spec() }, "bad variable name"),
            (StepSpec { nodelist: vec!["n".into(); MAX_STEP_NODELIST + 1], ..spec() }, "--nodelist names 1025"),
        ];
        for (spec, want) in cases {
            let err = spec.validate().expect_err(want);
            assert!(err.contains(want) && !err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn task_status_follows_slurm() {
        let exit = |code, signal| TaskExit { task: 0, exit_code: code, signal };
        assert_eq!(exit(Some(0), None).status(), 0);
        assert_eq!(exit(Some(3), None).status(), 3);
        assert_eq!(exit(None, Some(9)).status(), 137);
        assert_eq!(exit(None, Some(15)).status(), 143);
        let node = StepNodeEnd {
            node: "n1".into(),
            tasks: vec![exit(Some(2), None), exit(None, Some(2))],
            launch_error: None,
        };
        assert_eq!(node.status(), 130, "the highest of 2 and 128+2");
        let failed = StepNodeEnd { node: "n1".into(), tasks: vec![], launch_error: Some("no such program".into()) };
        assert_eq!(failed.status(), 1);
    }

    #[test]
    fn each_task_sees_its_own_gpus() {
        let node = StepNode { node: "n1".into(), first_task: 2, tasks: 2, gpus: vec![4, 5, 6, 7] };
        assert_eq!(node.task_gpus(0), Some(&[4, 5][..]));
        assert_eq!(node.task_gpus(1), Some(&[6, 7][..]));
        let shared = StepNode { gpus: vec![], ..node };
        assert_eq!(shared.task_gpus(1), None);
    }

    #[test]
    fn step_refs_read_and_print() {
        assert_eq!("batch".parse(), Ok(StepRef::Batch));
        assert_eq!("3".parse(), Ok(StepRef::Numbered(3)));
        assert!("x".parse::<StepRef>().is_err());
        assert_eq!(StepRef::Numbered(12).to_string(), "12");
    }
}
