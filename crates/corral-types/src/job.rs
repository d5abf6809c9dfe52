//! Jobs: what a user asks for (`JobSpec`), where it runs (`Allocation`) and its lifecycle (`JobState`).

use crate::layout::{SlurmNames, TaskLayout};
use crate::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// Cluster-wide job id, assigned by the replicated state machine in submit order.
pub type JobId = u64;

/// The "preemptor" of a job stopped because its node is drained (job ids start at 1).
pub const DRAIN_PREEMPTOR: JobId = 0;

/// The "preemptor" of a job stopped by `corral requeue`.
pub const REQUEUE_PREEMPTOR: JobId = JobId::MAX;

/// The "preemptor" of a job stopped because its node's lease ends (`corral node lease`, the
/// worker's `lease-end`): its run ends with cause `lease-ended`.
pub const LEASE_PREEMPTOR: JobId = JobId::MAX - 1;

/// Upper bound on whole GPUs one job may ask for.
pub const MAX_GPUS_PER_JOB: u32 = 1024;

/// Most node counts placement tries for a job whose tasks spread over nodes
/// (`JobSpec::spread_node_counts`).
pub const MAX_SPREAD_SHAPES: usize = 32;

/// A fraction of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuSlice {
    /// A MIG profile such as `1g.10gb` on MIG-capable cards; `compute_slices` of 7.
    Mig { profile: String, compute_slices: u32 },
    /// An MPS share on cards without MIG: active thread percentage and pinned memory limit.
    Mps { thread_percent: u32, memory_mib: Option<u64> },
}

impl GpuSlice {
    /// Parses `mig:1g.10gb` or `mps:25` / `mps:25:8GiB` (thread percent, optional memory cap).
    pub fn parse(input: &str) -> Result<Self, JobSpecError> {
        let err = || JobSpecError::InvalidSlice(input.to_string());
        let (kind, rest) = input.split_once(':').ok_or_else(err)?;
        match kind {
            "mig" => {
                let (g, _) = rest.split_once("g.").ok_or_else(err)?;
                let compute_slices: u32 = g.parse().map_err(|_| err())?;
                if !(1..=7).contains(&compute_slices) {
                    return Err(err());
                }
                Ok(GpuSlice::Mig { profile: rest.to_string(), compute_slices })
            }
            "mps" => {
                let (percent, memory) = match rest.split_once(':') {
                    Some((p, m)) => (p, Some(m)),
                    None => (rest, None),
                };
                let thread_percent: u32 = percent.trim_end_matches('%').parse().map_err(|_| err())?;
                if !(1..=100).contains(&thread_percent) {
                    return Err(err());
                }
                let memory_mib = match memory {
                    Some(m) => Some(crate::parse_size(m).map_err(|_| err())? >> 20),
                    None => None,
                };
                Ok(GpuSlice::Mps { thread_percent, memory_mib })
            }
            _ => Err(err()),
        }
    }

    /// Fraction of a GPU in millis (1000 = one whole GPU).
    pub fn milli_gpus(&self) -> u32 {
        match self {
            GpuSlice::Mig { compute_slices, .. } => compute_slices * 1000 / 7,
            GpuSlice::Mps { thread_percent, .. } => thread_percent * 10,
        }
    }
}

impl fmt::Display for GpuSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuSlice::Mig { profile, .. } => write!(f, "mig:{profile}"),
            GpuSlice::Mps { thread_percent, memory_mib: None } => write!(f, "mps:{thread_percent}"),
            GpuSlice::Mps { thread_percent, memory_mib: Some(m) } => write!(f, "mps:{thread_percent}:{m}MiB"),
        }
    }
}

/// What a user submits.
///
/// Its large parts (`command`, `env`, `script`: up to `MAX_COMMAND_BYTES`, `MAX_ENV_BYTES` and
/// `MAX_SCRIPT_BYTES`) are shared: a clone of a spec, such as the spec of each task of a job
/// array, points at the same bytes, so a copy costs the small fields only. They serialize as
/// the values they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub name: String,
    pub tenant: String,
    pub priority_class: String,
    /// Whole GPUs.
    pub gpus: u32,
    pub gpu_slice: Option<GpuSlice>,
    /// CPU in millicores (1000 = one core); 0 means no limit.
    pub cpu_millis: u32,
    /// Memory limit in bytes; 0 means no limit.
    pub memory_bytes: u64,
    /// Wall-clock limit in seconds; the job is killed after it.
    pub time_limit_secs: Option<u64>,
    /// What the command runs in: the absolute path of an unpacked root filesystem on every
    /// worker, or an image reference (normalised: `docker.io/library/busybox:latest`); `None`
    /// runs a bare process.
    pub image: Option<String>,
    /// Program and arguments (of a batch script: the script's arguments). Shared.
    pub command: Arc<[String]>,
    /// Environment of the job. Shared.
    pub env: Arc<BTreeMap<String, String>>,
    /// How the job wants to be placed and preempted.
    #[serde(default)]
    pub sched: SchedOptions,
    /// Working directory of the job (absolute); `None`: a fresh directory of its own on the
    /// worker. The CLI sends the directory of the submit (Slurm's default), or `--chdir`.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Body of a batch script (`corral sbatch`, at most `MAX_SCRIPT_BYTES`), stored with the job
    /// as Slurm's controller stores it. The worker writes it into the job's directory and runs
    /// it with `command` as its arguments. Shared.
    #[serde(default)]
    pub script: Option<Arc<str>>,
    /// Where the job's stdout and stderr also go, as patterns (`%j` job id, `%A` array job id,
    /// `%a` array task id, `%x` name, `%N` node, `%%`), relative to the working directory.
    #[serde(default)]
    pub stdout_path: Option<String>,
    #[serde(default)]
    pub stderr_path: Option<String>,
    /// A job array (`--array 0-999%16`): one record whose tasks are created as they can run.
    #[serde(default)]
    pub array: Option<ArraySpec>,
    /// The digest (`sha256:…`) the image reference named when the job was submitted: what
    /// every part, retry and step of the job runs, whatever the tag names later. Set by the
    /// coordinator at submit; `None` for a rootfs path or a bare process.
    #[serde(default)]
    pub image_digest: Option<String>,
    /// Slurm's shape of the allocation: nodes, tasks and what each task gets (default: one
    /// node, or a gang's `gpus / gpus_per_node`, one task on each).
    #[serde(default)]
    pub layout: TaskLayout,
    /// The command (a batch script) runs once, on the allocation's first node: Slurm's batch
    /// step (`corral sbatch`); its tasks reach the other nodes through steps (`srun`).
    /// `false`: every node of the allocation runs it (a gang of `corral submit`).
    #[serde(default)]
    pub batch_step: bool,
    /// The names a Slurm user gave (account, QOS, partition) and where the job was submitted
    /// from, kept for Slurm's variables and output patterns.
    #[serde(default)]
    pub slurm: SlurmNames,
    /// `--open-mode=append`: output files are appended to instead of truncated.
    #[serde(default)]
    pub append_output: bool,
    /// Mounts, working directory and variables of the job's container (pyxis's
    /// `--container-*` flags); only with an image.
    #[serde(default)]
    pub container: crate::ContainerOptions,
    /// An interactive session (`corral alloc`): its worker ends it when its GPUs stay idle.
    #[serde(default)]
    pub session: Option<SessionOptions>,
}

/// The idle rule of an interactive session (`corral alloc`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionOptions {
    /// How long every GPU of a node's part may stay under `min_gpu_util_pct` before the worker
    /// ends the session (`None` as submitted: the class's `idle-timeout`, else
    /// `DEFAULT_IDLE_TIMEOUT_SECS`, filled in at submit; 0: never).
    #[serde(default)]
    pub idle_timeout_secs: Option<u64>,
    /// Utilisation (percent) under which a GPU counts as idle; 0: `DEFAULT_MIN_GPU_UTIL_PCT`.
    #[serde(default)]
    pub min_gpu_util_pct: u32,
}

/// A session's idle timeout when neither it nor its class gives one.
pub const DEFAULT_IDLE_TIMEOUT_SECS: u64 = 30 * 60;
/// A session's GPU counts as idle under this utilisation (percent) unless it says otherwise.
pub const DEFAULT_MIN_GPU_UTIL_PCT: u32 = 1;

impl SessionOptions {
    /// The utilisation under which a GPU counts as idle.
    pub fn min_gpu_util(&self) -> u32 {
        if self.min_gpu_util_pct == 0 {
            DEFAULT_MIN_GPU_UTIL_PCT
        } else {
            self.min_gpu_util_pct
        }
    }

    /// Why a session idle this long ends, as its job's reason says it:
    /// `idle: GPU utilisation under 1% for 30m`.
    pub fn idle_reason(&self, idle_secs: u64) -> String {
        format!("idle: GPU utilisation under {}% for {}", self.min_gpu_util(), short_secs(idle_secs))
    }

    /// The options as far as their shape goes.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_gpu_util_pct > 100 {
            return Err(format!("min-gpu-util is a percentage (1-100), not {}", self.min_gpu_util_pct));
        }
        Ok(())
    }
}

/// `30m`, `1h30m`, `3s`, `1d2h`: the units that are not zero.
fn short_secs(secs: u64) -> String {
    let units = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let mut out = String::new();
    let mut rest = secs;
    for (size, unit) in units {
        if rest >= size {
            out.push_str(&format!("{}{unit}", rest / size));
            rest %= size;
        }
    }
    if out.is_empty() {
        out.push_str("0s");
    }
    out
}

/// Largest batch script a job may carry.
pub const MAX_SCRIPT_BYTES: usize = 1 << 20;

/// Most tasks one job array may have, and one above its largest index (a coordinator may admit
/// fewer tasks: `limits.max-array-size`). Tasks not created yet cost nothing: an array is one
/// record, plus the tasks of its window.
pub const MAX_ARRAY_TASKS: u32 = 100_000;

/// Most tasks of one array unfinished at once: the largest `%N` (a coordinator may admit less:
/// `limits.max-array-window`). Apply never creates more, whatever the array's record says.
pub const MAX_ARRAY_WINDOW: u32 = 10_000;

/// Unfinished tasks at once of an array without a `%N` throttle.
pub const DEFAULT_ARRAY_WINDOW: u32 = 1024;

/// Most ranges the index set of an array may have, once consecutive and evenly spaced indices
/// are merged (`0,1,2,...,19999` is one range): finding a task walks them.
pub const MAX_ARRAY_RANGES: usize = 4096;

/// The task indices of a job array and how many may run at once.
///
/// Valid (`validate`) when its ranges are in increasing order and do not overlap, so that each
/// index is listed once, and there are at most `MAX_ARRAY_RANGES` of them: every lookup below
/// is then O(ranges), whatever the number of tasks. `ArraySpec::parse` builds such a set from
/// what users write. Tasks are created in the order of their positions (index order).
///
/// A record written by an earlier version may list an index twice or its ranges out of order:
/// the lookups still work on it (an index listed twice is found at its first position).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArraySpec {
    /// Inclusive ranges with a step (`1-9:2`); a single index is a range of one.
    pub ranges: Vec<ArrayRange>,
    /// Most tasks pending-to-run or running at once (the `%N` of `--array`); `None`:
    /// `DEFAULT_ARRAY_WINDOW`.
    #[serde(default)]
    pub max_running: Option<u32>,
}

impl ArraySpec {
    /// Number of tasks. O(ranges).
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(ArrayRange::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The index of the `n`-th task (0-based, in position order). O(ranges).
    pub fn index_at(&self, n: u64) -> Option<u32> {
        self.indices_from(n).next()
    }

    /// The indices from position `n` on, in position order: O(ranges) to the first, then O(1)
    /// each.
    pub fn indices_from(&self, mut n: u64) -> impl Iterator<Item = u32> + '_ {
        let mut skipped = 0;
        for r in &self.ranges {
            let len = r.len();
            if n < len {
                break;
            }
            n -= len;
            skipped += 1;
        }
        self.ranges[skipped..].iter().enumerate().flat_map(move |(i, r)| {
            let from = if i == 0 { n } else { 0 };
            // Below `len`, so at most `last`: no overflow.
            (from..r.len()).map(move |k| r.first + k as u32 * r.step)
        })
    }

    /// The position of task `index` (its first one, should an earlier version's record list it
    /// twice). O(ranges).
    pub fn position_of(&self, index: u32) -> Option<u64> {
        let mut before = 0;
        for r in &self.ranges {
            if r.contains(index) {
                return Some(before + u64::from((index - r.first) / r.step));
            }
            before += r.len();
        }
        None
    }

    /// True if the array has a task `index`. O(ranges).
    pub fn contains(&self, index: u32) -> bool {
        self.ranges.iter().any(|r| r.contains(index))
    }

    /// How many tasks may be unfinished at once: `%N`, else `DEFAULT_ARRAY_WINDOW`, never more
    /// than `MAX_ARRAY_WINDOW` (a record written before that cap may ask for more).
    pub fn window(&self) -> u32 {
        self.max_running.unwrap_or(DEFAULT_ARRAY_WINDOW).clamp(1, MAX_ARRAY_WINDOW)
    }

    /// Refuses an empty array, more than `MAX_ARRAY_RANGES` ranges, a backward range or zero
    /// step, an index of `MAX_ARRAY_TASKS` or more, ranges out of order or overlapping (an
    /// index listed twice), and a `%N` of 0 or above `MAX_ARRAY_WINDOW`. O(ranges), the range
    /// count checked first.
    pub fn validate(&self) -> Result<(), String> {
        if self.ranges.is_empty() {
            return Err("an array needs at least one index".into());
        }
        if self.ranges.len() > MAX_ARRAY_RANGES {
            return Err(format!(
                "{} ranges, at most {MAX_ARRAY_RANGES}: write consecutive or evenly spaced indices as one range (0-99, 0-98:2)",
                self.ranges.len()
            ));
        }
        let mut previous: Option<&ArrayRange> = None;
        for r in &self.ranges {
            if r.step == 0 || r.first > r.last {
                return Err(format!("bad range {}-{}:{}", r.first, r.last, r.step));
            }
            if r.last >= MAX_ARRAY_TASKS {
                return Err(format!("index {} is above {}", r.last, MAX_ARRAY_TASKS - 1));
            }
            if let Some(p) = previous {
                if r.first <= p.last {
                    return Err(format!(
                        "{p} and {r} overlap or are out of order: list each index once, in increasing order"
                    ));
                }
            }
            previous = Some(r);
        }
        // Distinct indices below MAX_ARRAY_TASKS: at most MAX_ARRAY_TASKS tasks.
        match self.max_running {
            Some(0) => Err("the %N throttle must be at least 1".into()),
            Some(n) if n > MAX_ARRAY_WINDOW => {
                Err(format!("%{n} asks for more than {MAX_ARRAY_WINDOW} tasks at once, the most an array may run"))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ArraySpec {
    /// As `--array` takes it: `0-999%16`, `1,3,5-9`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.ranges.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        match self.max_running {
            Some(n) => write!(f, "%{n}"),
            None => Ok(()),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayRange {
    pub first: u32,
    pub last: u32,
    /// At least 1.
    pub step: u32,
}

impl ArrayRange {
    /// Number of indices in the range.
    pub fn len(&self) -> u64 {
        if self.first > self.last || self.step == 0 {
            return 0;
        }
        u64::from((self.last - self.first) / self.step) + 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True if `index` is one of the range's.
    pub fn contains(&self, index: u32) -> bool {
        !self.is_empty() && (self.first..=self.last).contains(&index) && (index - self.first).is_multiple_of(self.step)
    }
}

impl fmt::Display for ArrayRange {
    /// `7`, `0-9` or `0-15:4`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.first == self.last, self.step) {
            (true, _) => write!(f, "{}", self.first),
            (false, 1) => write!(f, "{}-{}", self.first, self.last),
            (false, step) => write!(f, "{}-{}:{step}", self.first, self.last),
        }
    }
}

/// What a coordinator admits of a new job array (its `[limits]` `max-array-window` and
/// `max-array-size`), within the absolute caps that apply enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayLimits {
    /// Most tasks unfinished at once: the largest `%N`, and the window of an array without one
    /// when less than `DEFAULT_ARRAY_WINDOW`. At most `MAX_ARRAY_WINDOW`.
    pub max_window: u32,
    /// Most tasks of one array. At most `MAX_ARRAY_TASKS`.
    pub max_size: u32,
}

impl Default for ArrayLimits {
    fn default() -> Self {
        ArrayLimits { max_window: DEFAULT_ARRAY_WINDOW, max_size: MAX_ARRAY_TASKS }
    }
}

impl ArrayLimits {
    /// Checks `array` against these limits, once normalized (`ArraySpec::normalize`: a client
    /// may send its ranges as written) and valid (`ArraySpec::validate`), each refusal one line
    /// naming the limit; an array without `%N` gets `max_window` when that is less than
    /// `DEFAULT_ARRAY_WINDOW`. O(r log r) for the r ranges sent, at most `MAX_ARRAY_TASKS`.
    pub fn admit(&self, array: &mut ArraySpec) -> Result<(), JobSpecError> {
        let refuse = |reason: String| JobSpecError::Invalid { field: "array".into(), reason };
        array.normalize().map_err(refuse)?;
        array.validate().map_err(refuse)?;
        match array.max_running {
            Some(n) if n > self.max_window => {
                return Err(refuse(format!(
                    "%{n} asks for {n} tasks at once, this pool allows at most {} (limits.max-array-window)",
                    self.max_window
                )))
            }
            None if self.max_window < DEFAULT_ARRAY_WINDOW => array.max_running = Some(self.max_window),
            _ => {}
        }
        let len = array.len();
        if len > u64::from(self.max_size) {
            return Err(refuse(format!(
                "{len} tasks, this pool allows at most {} in one array (limits.max-array-size)",
                self.max_size
            )));
        }
        Ok(())
    }
}

/// How a job depends on another (Slurm's `--dependency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DependencyKind {
    /// The other job succeeded.
    AfterOk,
    /// The other job ended, however.
    AfterAny,
    /// The other job ended other than successfully.
    AfterNotOk,
}

impl DependencyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DependencyKind::AfterOk => "afterok",
            DependencyKind::AfterAny => "afterany",
            DependencyKind::AfterNotOk => "afternotok",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dependency {
    pub kind: DependencyKind,
    pub job_id: JobId,
}

/// Placement and preemption options of a job (all optional; the default is a single-node job
/// that is requeued when preempted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedOptions {
    /// Gang across nodes: whole GPUs on each node (Slurm `--gpus-per-node`). `gpus` must be a
    /// multiple of it; the job then runs on `gpus / gpus_per_node` nodes, all started together.
    /// `None`: all GPUs on one node.
    #[serde(default)]
    pub gpus_per_node: Option<u32>,
    /// The job uses GPUDirect RDMA: prefer GPUs that share a PCIe switch with an RDMA NIC.
    #[serde(default)]
    pub rdma: bool,
    /// When preempted, end in `preempted` instead of going back to the queue.
    #[serde(default)]
    pub no_requeue: bool,
    /// Signal sent first when the job is preempted, before SIGTERM, so it can checkpoint
    /// (as Slurm's `--signal`), e.g. 10 for SIGUSR1.
    #[serde(default)]
    pub checkpoint_signal: Option<i32>,
    /// Send `checkpoint_signal` this long before the time limit too (Slurm's `--signal
    /// USR1@300`).
    #[serde(default)]
    pub signal_before_end_secs: Option<u32>,
    /// Jobs that must end (as the kind says) before this one may start.
    #[serde(default)]
    pub dependencies: Vec<Dependency>,
    /// Start only once no earlier job of the same tenant and name is pending or running.
    #[serde(default)]
    pub singleton: bool,
    /// A run that fails (a gang: a part fails or its node is lost) is requeued as a whole up to
    /// this many times before the job fails.
    #[serde(default)]
    pub max_restarts: Option<u32>,
    /// Node labels the job needs (`partition=gpu`, `zone=a`; a bare word matches a label of that
    /// name): `--partition` and `--constraint`.
    #[serde(default)]
    pub node_selector: Vec<String>,
    /// Submitted held: it does not start until released.
    #[serde(default)]
    pub hold: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum JobSpecError {
    #[error("empty command: give the program to run after `--`, e.g. `corral submit -- python train.py`")]
    EmptyCommand,
    #[error("invalid gpu slice '{0}': expected mig:<profile> (e.g. mig:1g.10gb) or mps:<percent>[:<memory>] (e.g. mps:25:8GiB)")]
    InvalidSlice(String),
    #[error("a job asks for either whole gpus (--gpus) or one gpu slice (--gpu-slice), not both")]
    GpusAndSlice,
    #[error("a job may ask for at most {max} gpus, got {requested}")]
    TooManyGpus { requested: u32, max: u32 },
    #[error("invalid {field}: {reason}")]
    Invalid { field: String, reason: String },
}

impl JobSpec {
    /// How many parts (nodes) a run of the job has: the layout's `--nodes`, else `gpus /
    /// gpus_per_node` for a gang, else 1.
    pub fn parts(&self) -> u32 {
        if self.layout.nodes > 0 {
            return self.layout.nodes;
        }
        match self.sched.gpus_per_node {
            Some(per_node) if per_node > 0 && self.gpu_slice.is_none() => (self.gpus / per_node).max(1),
            _ => 1,
        }
    }

    /// Whole GPUs on each node of the allocation (a slice job: 0).
    pub fn gpus_per_part(&self) -> u32 {
        if self.gpu_slice.is_some() {
            0
        } else {
            self.gpus / self.parts()
        }
    }

    /// Tasks on each node of the allocation, in allocation order (Slurm's block distribution of
    /// the layout over `parts()` nodes).
    pub fn tasks_on_nodes(&self) -> Vec<u32> {
        self.layout.tasks_on_nodes(self.parts())
    }

    /// Slurm's `-n N --gpus-per-task G` without `--nodes`, `--ntasks-per-node`, `--gpus` or
    /// `--gpus-per-node` (the CLI leaves `sched.gpus_per_node` unset for it): the tasks spread
    /// over as many nodes as they need, each task's GPUs on one node. Until placed, the spec
    /// holds one task's CPU and memory (or `--mem`, per node) and all the tasks' GPUs on one
    /// node; placement chooses a node count from `spread_node_counts` and the job becomes the
    /// gang `spread_over` gives.
    pub fn spreads(&self) -> bool {
        self.gpu_slice.is_none()
            && self.layout.nodes == 0
            && self.layout.ntasks > 1
            && self.layout.gpus_per_task > 0
            && self.layout.ntasks_per_node == 0
            && self.sched.gpus_per_node.is_none()
    }

    /// The node counts a spreading job may run on when no node has more than `largest` GPUs,
    /// fewest first: for each task count `b` of the busiest node (most first, `b * G` GPUs
    /// fitting `largest`), the fewest nodes holding the tasks with at most `b` on each. At most
    /// `MAX_SPREAD_SHAPES` counts, whatever the task count; none when a task does not fit a node.
    pub fn spread_node_counts(&self, largest: u32) -> Vec<u32> {
        let (tasks, per_task) = (self.layout.ntasks, self.layout.gpus_per_task.max(1));
        let most = (largest / per_task).min(tasks);
        let mut counts: Vec<u32> = Vec::new();
        for busiest in (1..=most).rev() {
            if counts.len() >= MAX_SPREAD_SHAPES {
                break;
            }
            let nodes = tasks.div_ceil(busiest);
            if nodes <= crate::layout::MAX_NODES_PER_JOB && counts.last() != Some(&nodes) {
                counts.push(nodes);
            }
        }
        counts
    }

    /// What each node of a spreading job holds on `nodes` nodes: `(gpus, cpu_millis,
    /// memory_bytes)`, those of its busiest node's tasks (Slurm's block distribution; a gang's
    /// parts are alike). `--mem`, when given, is per node as it was.
    pub fn spread_shape(&self, nodes: u32) -> (u32, u32, u64) {
        let layout = &self.layout;
        let nodes = nodes.clamp(1, crate::layout::MAX_NODES_PER_JOB);
        let busiest = layout.ntasks.max(1).div_ceil(nodes);
        let per_node = layout.gpus_per_task.saturating_mul(busiest);
        let cpus = if layout.cpus_per_gpu > 0 {
            u64::from(layout.cpus_per_gpu) * u64::from(per_node)
        } else {
            u64::from(busiest) * u64::from(layout.cpus_of_task())
        };
        let memory = if layout.mem_per_cpu > 0 {
            layout.mem_per_cpu.saturating_mul(cpus)
        } else if layout.mem_per_gpu > 0 {
            layout.mem_per_gpu.saturating_mul(u64::from(per_node))
        } else {
            self.memory_bytes
        };
        (per_node, u32::try_from(cpus.saturating_mul(1000)).unwrap_or(u32::MAX), memory)
    }

    /// The spec of a spreading job laid out over `nodes` nodes (`spread_shape` on each, the
    /// tasks blocked over them by `tasks_on_nodes`), `layout.nodes` set: no longer spreading.
    /// Any other spec: itself.
    pub fn spread_over(&self, nodes: u32) -> JobSpec {
        let mut spec = self.clone();
        if !self.spreads() {
            return spec;
        }
        let nodes = nodes.clamp(1, crate::layout::MAX_NODES_PER_JOB);
        let (per_node, cpu_millis, memory_bytes) = self.spread_shape(nodes);
        spec.layout.nodes = nodes;
        spec.layout.submitted_shape = Some(crate::layout::SubmittedShape {
            gpus: self.gpus,
            cpu_millis: self.cpu_millis,
            memory_bytes: self.memory_bytes,
        });
        spec.gpus = per_node.saturating_mul(nodes);
        spec.sched.gpus_per_node = Some(per_node);
        spec.cpu_millis = cpu_millis;
        spec.memory_bytes = memory_bytes;
        spec
    }

    /// An `--exclusive` job that asks for no GPUs: as Slurm allocates such a job all the GRES of
    /// its nodes, it gets every GPU of each (`with_whole_nodes_gpus`, at placement).
    pub fn takes_whole_nodes_gpus(&self) -> bool {
        self.layout.exclusive
            && self.gpu_slice.is_none()
            && self.gpus == 0
            && self.sched.gpus_per_node.unwrap_or(0) == 0
            && self.layout.gpus_per_task == 0
    }

    /// The spec of a `takes_whole_nodes_gpus` job placed with `gpus` GPUs in all (every GPU of
    /// its nodes): it holds, and is billed for, those. Any other spec, or none placed: itself.
    pub fn with_whole_nodes_gpus(&self, gpus: u32) -> JobSpec {
        let mut spec = self.clone();
        if !self.takes_whole_nodes_gpus() || gpus == 0 {
            return spec;
        }
        spec.layout.submitted_shape = Some(crate::layout::SubmittedShape {
            gpus: self.gpus,
            cpu_millis: self.cpu_millis,
            memory_bytes: self.memory_bytes,
        });
        spec.gpus = gpus;
        spec
    }

    /// Undoes `spread_over` and `with_whole_nodes_gpus`: the spec as it was submitted, whose
    /// next run chooses its node count or GPUs anew (a requeue). Any other spec is unchanged.
    pub fn restore_submitted_shape(&mut self) {
        if let Some(origin) = self.layout.submitted_shape.take() {
            // Tasks that spread asked for GPUs (their node count was the placement's); an
            // exclusive job given its nodes' GPUs asked for none (its nodes were its own).
            if origin.gpus != 0 {
                self.layout.nodes = 0;
                self.sched.gpus_per_node = None;
            }
            self.gpus = origin.gpus;
            self.cpu_millis = origin.cpu_millis;
            self.memory_bytes = origin.memory_bytes;
        }
    }

    /// Checks what can be checked without cluster state.
    pub fn validate(&self) -> Result<(), JobSpecError> {
        // A batch script is the program; `command` then holds its arguments (maybe none).
        if self.script.is_none() && (self.command.is_empty() || self.command[0].trim().is_empty()) {
            return Err(JobSpecError::EmptyCommand);
        }
        if let Some(script) = &self.script {
            if script.len() > MAX_SCRIPT_BYTES {
                return Err(JobSpecError::Invalid {
                    field: "script".into(),
                    reason: format!("{} bytes, at most {MAX_SCRIPT_BYTES}", script.len()),
                });
            }
        }
        if let Some(dir) = &self.workdir {
            if !dir.starts_with('/') || dir.len() > MAX_PATH || dir.contains('\0') {
                return Err(JobSpecError::Invalid {
                    field: "workdir".into(),
                    reason: format!("'{dir}' must be an absolute path of at most {MAX_PATH} bytes"),
                });
            }
        }
        for (field, path) in [("output", &self.stdout_path), ("error", &self.stderr_path)] {
            if path.as_ref().is_some_and(|p| p.is_empty() || p.len() > MAX_PATH || p.contains('\0')) {
                return Err(JobSpecError::Invalid {
                    field: field.into(),
                    reason: format!("must be a non-empty path of at most {MAX_PATH} bytes"),
                });
            }
        }
        if self.gpus > 0 && self.gpu_slice.is_some() {
            return Err(JobSpecError::GpusAndSlice);
        }
        if self.gpus > MAX_GPUS_PER_JOB {
            return Err(JobSpecError::TooManyGpus { requested: self.gpus, max: MAX_GPUS_PER_JOB });
        }
        if self.tenant.is_empty() {
            return Err(JobSpecError::Invalid { field: "tenant".into(), reason: "must not be empty".into() });
        }
        let too_long = |field: &str, len: usize, max: usize| {
            (len > max)
                .then(|| JobSpecError::Invalid { field: field.into(), reason: format!("longer than {max} bytes") })
        };
        if let Some(e) = too_long("tenant", self.tenant.len(), MAX_SHORT_NAME)
            .or_else(|| too_long("priority", self.priority_class.len(), MAX_SHORT_NAME))
            .or_else(|| too_long("image", self.image.as_deref().map_or(0, str::len), MAX_PATH))
        {
            return Err(e);
        }
        if let Some(digest) = &self.image_digest {
            let hex = digest.strip_prefix("sha256:").unwrap_or_default();
            if self.image.is_none() || hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(JobSpecError::Invalid {
                    field: "image digest".into(),
                    reason: "must be sha256: and 64 lowercase hex digits, with an image".into(),
                });
            }
        }
        if self.command.len() > MAX_ARGS {
            return Err(JobSpecError::Invalid {
                field: "command".into(),
                reason: format!("{} arguments, at most {MAX_ARGS}", self.command.len()),
            });
        }
        let command_bytes: usize = self.command.iter().map(String::len).sum();
        if command_bytes > MAX_COMMAND_BYTES {
            return Err(JobSpecError::Invalid {
                field: "command".into(),
                reason: format!("{command_bytes} bytes, at most {MAX_COMMAND_BYTES}: pass large inputs in a file"),
            });
        }
        if self.env.len() > MAX_ENV_VARS {
            return Err(JobSpecError::Invalid {
                field: "env".into(),
                reason: format!("{} variables, at most {MAX_ENV_VARS}", self.env.len()),
            });
        }
        let env_bytes: usize = self.env.iter().map(|(k, v)| k.len() + v.len()).sum();
        if env_bytes > MAX_ENV_BYTES {
            return Err(JobSpecError::Invalid {
                field: "env".into(),
                reason: format!("{env_bytes} bytes, at most {MAX_ENV_BYTES}"),
            });
        }
        if self.name.len() > 256 {
            return Err(JobSpecError::Invalid { field: "name".into(), reason: "longer than 256 bytes".into() });
        }
        if let Some(array) = &self.array {
            array.validate().map_err(|reason| JobSpecError::Invalid { field: "array".into(), reason })?;
        }
        if let Some(per_node) = self.sched.gpus_per_node {
            if per_node == 0 || self.gpus == 0 || !self.gpus.is_multiple_of(per_node) {
                return Err(JobSpecError::Invalid {
                    field: "gpus-per-node".into(),
                    reason: format!("must divide --gpus ({}) and be at least 1", self.gpus),
                });
            }
        }
        self.validate_layout()?;
        if let Some(session) = &self.session {
            session.validate().map_err(|reason| JobSpecError::Invalid { field: "session".into(), reason })?;
        }
        if let Some(sig) = self.sched.checkpoint_signal {
            if !(1..=64).contains(&sig) || sig == 9 || sig == 19 {
                return Err(JobSpecError::Invalid {
                    field: "signal".into(),
                    reason: format!("{sig} is not a catchable signal number (e.g. 10 for SIGUSR1)"),
                });
            }
        }
        if self.time_limit_secs == Some(0) {
            return Err(JobSpecError::Invalid { field: "time".into(), reason: "must be greater than zero".into() });
        }
        if !self.container.is_default() && self.image.is_none() {
            return Err(JobSpecError::Invalid {
                field: "container options".into(),
                reason: "--container-mounts, --container-workdir and --container-env need --image".into(),
            });
        }
        self.container.validate().map_err(|(field, reason)| JobSpecError::Invalid { field: field.into(), reason })?;
        for key in self.env.keys() {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(JobSpecError::Invalid {
                    field: "env".into(),
                    reason: format!("bad variable name '{key}'"),
                });
            }
        }
        Ok(())
    }

    /// The layout by itself, and with the GPUs: a node count that splits the GPUs evenly, GPUs
    /// per task that the tasks of each node find there, no slice across nodes.
    fn validate_layout(&self) -> Result<(), JobSpecError> {
        let invalid = |reason: String| JobSpecError::Invalid { field: "layout".into(), reason };
        self.layout.validate().map_err(invalid)?;
        self.slurm.validate(MAX_PATH).map_err(|reason| JobSpecError::Invalid { field: "slurm".into(), reason })?;
        let nodes = self.layout.nodes;
        if nodes > 1 && self.gpu_slice.is_some() {
            return Err(invalid(format!("a GPU slice runs on one node, not --nodes {nodes}")));
        }
        if nodes > 1 && self.gpus > 0 {
            match self.sched.gpus_per_node {
                Some(per_node) if u64::from(per_node) * u64::from(nodes) == u64::from(self.gpus) => {}
                _ => {
                    return Err(invalid(format!(
                        "{} GPUs on --nodes {nodes} need as many on each node (--gpus-per-node)",
                        self.gpus
                    )))
                }
            }
        }
        if nodes == 1 && self.gpus > 0 && self.sched.gpus_per_node.is_some_and(|p| p != self.gpus) {
            return Err(invalid(format!("--nodes 1 holds all {} GPUs, not --gpus-per-node", self.gpus)));
        }
        if self.layout.gpus_per_task > 0 {
            let busiest = self.tasks_on_nodes().into_iter().max().unwrap_or(1);
            let needed = u64::from(self.layout.gpus_per_task) * u64::from(busiest);
            if u64::from(self.gpus_per_part()) < needed {
                return Err(invalid(format!(
                    "--gpus-per-task {} for {busiest} tasks on a node needs {needed} GPUs there, the job has {}",
                    self.layout.gpus_per_task,
                    self.gpus_per_part()
                )));
            }
        }
        Ok(())
    }
}

/// Lifecycle of a job. `Pending` and `Running` are live; the rest are terminal. A preempted job
/// goes straight back to `Pending` (requeued); it ends in `Preempted` only when it opted out of
/// requeueing (`SchedOptions::no_requeue`).
/// Longest tenant or priority class name.
pub const MAX_SHORT_NAME: usize = 128;
/// Longest image path.
pub const MAX_PATH: usize = 4096;
/// Most command arguments, and their total size.
pub const MAX_ARGS: usize = 4096;
pub const MAX_COMMAND_BYTES: usize = 256 * 1024;
/// Most environment variables, and their total size (names and values).
pub const MAX_ENV_VARS: usize = 1024;
pub const MAX_ENV_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum JobState {
    Pending,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Preempted,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Preempted => "preempted",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => JobState::Pending,
            "running" => JobState::Running,
            "succeeded" => JobState::Succeeded,
            "failed" => JobState::Failed,
            "cancelled" => JobState::Cancelled,
            "preempted" => JobState::Preempted,
            _ => return None,
        })
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Preempted)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a running job was placed. `epoch` is unique per placement: worker reports carry it and
/// the state machine ignores reports of an older placement.
///
/// `node`/`gpus` is the first (or only) part; a gang across nodes has its other parts in
/// `more_nodes`, each node running its part with the same epoch.
///
/// A gang's run ends when every part has ended (`ended`): until then the allocation keeps every
/// part's GPUs, so no part of the next attempt can start while a part of this one still runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub node: String,
    pub gpus: Vec<u32>,
    pub epoch: u64,
    /// The other nodes of a gang job (empty for a single-node job).
    #[serde(default)]
    pub more_nodes: Vec<NodeGpus>,
    /// For a fractional job: the slice of `gpus[0]` it got.
    #[serde(default)]
    pub slice: Option<SliceAssignment>,
    /// For a gang: the port on the first part's node where its parts meet (MASTER_PORT), from
    /// that node's rendezvous port range.
    #[serde(default)]
    pub master_port: Option<u32>,
    /// The parts of a gang that ended, in the order they ended (empty for a single-node job,
    /// whose run ends with its one part).
    #[serde(default)]
    pub ended: Vec<PartEnd>,
    /// Pricing changes applied while this run held its GPUs, oldest first: each ends one
    /// piece of the run, billed with the pricing it records (see corral-core's ledger).
    #[serde(default)]
    pub price_breaks: Vec<PriceBreak>,
    /// For a gang that runs in a registry image: the nodes whose part has pulled and mounted
    /// its image, in the order they said so. No part starts before every part is ready.
    #[serde(default)]
    pub ready: Vec<String>,
    /// For an interactive session on several nodes: the nodes whose GPUs have stayed idle for
    /// its idle timeout (and not been busy since), in the order they said so. The session ends
    /// idle once every part is.
    #[serde(default)]
    pub idle: Vec<String>,
}

/// The pricing of one piece of a run: from the previous break (or the start) to `at`, when a
/// policy with other prices for this run was applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriceBreak {
    pub at: Timestamp,
    pub price_micros_per_gpu_hour: u64,
    pub multiplier_milli: u32,
    /// The policy version these prices came from.
    pub policy_version: u64,
}

/// How one part of a gang ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartEnd {
    pub node: String,
    /// The worker's report; `None` when the node was lost (down, or registered again).
    pub report: Option<JobExitReport>,
}

impl PartEnd {
    /// Exited with code 0: the other parts may go on.
    pub fn succeeded(&self) -> bool {
        self.report.as_ref().is_some_and(JobExitReport::succeeded)
    }
}

impl Allocation {
    /// Every (node, gpus) part, the first part first.
    pub fn parts(&self) -> impl Iterator<Item = (&str, &[u32])> + '_ {
        std::iter::once((self.node.as_str(), self.gpus.as_slice()))
            .chain(self.more_nodes.iter().map(|p| (p.node.as_str(), p.gpus.as_slice())))
    }

    /// Every part said its image is ready (see `ready`): an image gang may start.
    pub fn all_ready(&self) -> bool {
        self.parts().all(|(node, _)| self.ready.iter().any(|r| r == node))
    }

    /// Every part's GPUs are idle (see `idle`): a session on several nodes ends idle.
    pub fn all_idle(&self) -> bool {
        self.parts().all(|(node, _)| self.idle.iter().any(|r| r == node))
    }

    /// The GPUs this allocation holds on `node`, if it has a part there.
    pub fn gpus_on(&self, node: &str) -> Option<&[u32]> {
        self.parts().find(|(n, _)| *n == node).map(|(_, g)| g)
    }

    /// True for a gang across nodes.
    pub fn is_gang(&self) -> bool {
        !self.more_nodes.is_empty()
    }

    /// True if the part on `node` has ended.
    pub fn part_ended(&self, node: &str) -> bool {
        self.ended.iter().any(|e| e.node == node)
    }

    /// True once every part has ended.
    pub fn all_parts_ended(&self) -> bool {
        self.parts().all(|(node, _)| self.part_ended(node))
    }

    /// True once a part ended other than with exit code 0: the parts still running are stopped
    /// (a gang fails as a whole, like `srun --kill-on-bad-exit`).
    pub fn stops_remaining_parts(&self) -> bool {
        self.ended.iter().any(|e| !e.succeeded())
    }
}

/// Whole GPUs of one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeGpus {
    pub node: String,
    pub gpus: Vec<u32>,
}

/// The concrete share of one GPU a fractional job was given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SliceAssignment {
    /// A MIG GPU instance of `profile` at memory-slice position `start` (0..8), covering
    /// `memory_slices` eighths of the memory and `compute_slices` sevenths of the SMs.
    Mig { profile: String, start: u32, memory_slices: u32, compute_slices: u32 },
    /// An MPS client limited to `thread_percent` of the SMs and `memory_mib` of device memory
    /// (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT).
    Mps { thread_percent: u32, memory_mib: u64 },
}

impl fmt::Display for SliceAssignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SliceAssignment::Mig { profile, start, .. } => write!(f, "mig:{profile}@{start}"),
            SliceAssignment::Mps { thread_percent, memory_mib } => write!(f, "mps:{thread_percent}:{memory_mib}MiB"),
        }
    }
}

/// A running job was asked to make room for `by`: the worker sends the job's checkpoint signal
/// (if it asked for one) and SIGTERM at once, and SIGKILL `grace_secs` after `at`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptionNotice {
    pub by: JobId,
    pub at: Timestamp,
    pub grace_secs: u32,
    pub checkpoint_signal: Option<i32>,
}

/// What a worker reports when a job's process tree is gone.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobExitReport {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub oom_killed: bool,
    /// Monotonic run time measured by the worker (spawn to exit): what the run is billed,
    /// clipped to the TSO interval since its placement.
    pub run_time_ms: u64,
    /// The worker killed the job at its time limit.
    pub timed_out: bool,
    /// Set when the worker could not start the job at all.
    pub launch_error: Option<String>,
    /// The job was asked to stop (cancel, preemption) before this worker launched it: it never
    /// ran, nothing is billed.
    #[serde(default)]
    pub never_started: bool,
    /// The worker killed the job because it lost contact with every coordinator for the fence
    /// time: the job did not end on its own and goes back to the queue.
    #[serde(default)]
    pub fenced: bool,
    /// Card faults of the run's GPUs on the reporting node (hardware or driver, not the job's
    /// doing): the worker stopped the run for them. Non-empty: the run ends with cause
    /// `gpu-fault`, is requeued without counting a restart, and the GPUs leave placement.
    #[serde(default)]
    pub gpu_faults: Vec<crate::GpuFaultMark>,
    /// The worker ended an interactive session whose GPUs stayed idle: why, as the job's reason
    /// (`idle: GPU utilisation under 1% for 30m`). The job ends cancelled, not requeued.
    #[serde(default)]
    pub idle_end: Option<String>,
}

impl JobExitReport {
    /// The process exited by itself with code 0.
    pub fn succeeded(&self) -> bool {
        self.exit_code == Some(0)
            && self.signal.is_none()
            && !self.oom_killed
            && !self.timed_out
            && self.launch_error.is_none()
            && !self.never_started
            && !self.fenced
            && self.gpu_faults.is_empty()
            && self.idle_end.is_none()
    }
}

/// A job as the replicated state holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    pub state: JobState,
    pub request_id: String,
    pub submitted_at: Timestamp,
    /// When the current attempt was placed on a node.
    pub admitted_at: Option<Timestamp>,
    pub started_at: Option<Timestamp>,
    pub finished_at: Option<Timestamp>,
    pub allocation: Option<Allocation>,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// Why the job is in its state, e.g. `oom-killed`, `cancelled by user`.
    pub reason: Option<String>,
    pub cancel_requested: bool,
    /// How many times the job was placed.
    pub attempts: u32,
    pub worker_run_time_ms: Option<u64>,
    /// Set while a running job is being preempted (until the worker reports its exit).
    #[serde(default)]
    pub preemption: Option<PreemptionNotice>,
    /// Held (`corral hold`): pending, and not considered until released.
    #[serde(default)]
    pub held: bool,
    /// Dependencies not yet met (job ids); the job is not considered while any is left.
    #[serde(default)]
    pub waiting_on: Vec<JobId>,
    /// For a task of a job array: its array and index.
    #[serde(default)]
    pub array_task: Option<ArrayTask>,
    /// For a job array: how far its tasks got.
    #[serde(default)]
    pub array_progress: Option<ArrayProgress>,
    /// How many failed runs were requeued under `max_restarts`.
    #[serde(default)]
    pub restarts: u32,
    /// Signals asked for with `corral signal`, in order; a worker delivers each once per run.
    #[serde(default)]
    pub signals: Vec<i32>,
    /// Its `srun` steps (Slurm's `12.0`, `12.1`, …), bound to the run they were made in.
    #[serde(default)]
    pub steps: crate::JobSteps,
}

impl Job {
    /// About how many bytes `self` takes, in memory or on the wire: its variable-size parts
    /// (name, image, working directory, script, output paths, reason, command, environment,
    /// node selector, dependencies, signals) plus a margin for the rest. An estimate for
    /// budgets (a listing page, the finished jobs kept in memory), never an exact size.
    pub fn approx_bytes(&self) -> usize {
        let spec = &self.spec;
        let strings =
            [Some(spec.name.as_str()), spec.image.as_deref(), spec.workdir.as_deref(), spec.script.as_deref()]
                .into_iter()
                .chain([spec.stdout_path.as_deref(), spec.stderr_path.as_deref(), self.reason.as_deref()])
                .flatten()
                .map(str::len)
                .sum::<usize>();
        let command: usize = spec.command.iter().map(|c| c.len() + 2).sum();
        let env: usize = spec.env.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
        let selectors: usize = spec.sched.node_selector.iter().map(|s| s.len() + 2).sum();
        512 + strings + command + env + selectors + 8 * (self.waiting_on.len() + self.signals.len())
    }

    /// True for a batch job (`corral sbatch`): its script is Slurm's batch step, which runs
    /// once, on the allocation's first node, and the job ends when it ends; the allocation's
    /// other nodes hold their part (cgroup, GPUs) for the steps `srun` starts there. Other
    /// jobs (`corral submit`'s gangs) run their command on every node.
    pub fn runs_batch_once(&self) -> bool {
        self.spec.batch_step || self.spec.script.is_some()
    }

    /// A job as submitted at `ts`: pending, never run.
    pub fn pending(id: JobId, spec: JobSpec, request_id: String, ts: Timestamp) -> Job {
        Job {
            id,
            spec,
            state: JobState::Pending,
            request_id,
            submitted_at: ts,
            admitted_at: None,
            started_at: None,
            finished_at: None,
            allocation: None,
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 0,
            worker_run_time_ms: None,
            preemption: None,
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: crate::JobSteps::default(),
        }
    }

    /// A job array (the record of all its tasks), not one of its tasks.
    pub fn is_array(&self) -> bool {
        self.spec.array.is_some() && self.array_task.is_none()
    }

    /// `12` for a job, `12_7` for task 7 of array 12 (how Slurm users name them).
    pub fn display_id(&self) -> String {
        match self.array_task {
            Some(t) => format!("{}_{}", t.array, t.index),
            None => self.id.to_string(),
        }
    }
}

/// How users name a job: `12`, or `12_7` for task 7 of array 12.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobRef {
    pub id: JobId,
    pub task: Option<u32>,
}

impl std::str::FromStr for JobRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("invalid job '{s}': expected a job id such as 12, or 12_7 for task 7 of array 12");
        let (id, task) = match s.trim().split_once('_') {
            Some((id, task)) => (id, Some(task.parse().map_err(|_| bad())?)),
            None => (s.trim(), None),
        };
        let id: JobId = id.parse().map_err(|_| bad())?;
        if id == 0 {
            return Err(bad());
        }
        Ok(JobRef { id, task })
    }
}

impl fmt::Display for JobRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.task {
            Some(t) => write!(f, "{}_{t}", self.id),
            None => write!(f, "{}", self.id),
        }
    }
}

/// A task of a job array.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayTask {
    pub array: JobId,
    pub index: u32,
}

/// How far the tasks of a job array got.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayProgress {
    /// How many tasks were created (the next one is the `created`-th index of the spec).
    pub created: u32,
    pub succeeded: u32,
    /// Ended other than successfully (failed, cancelled, preempted).
    pub unsuccessful: u32,
    /// Indices cancelled before their task was created, sorted: created as cancelled when
    /// reached, and then no longer listed (a record of an earlier version may still list it).
    #[serde(default)]
    pub skipped: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec {
            name: "t".into(),
            tenant: "default".into(),
            priority_class: "normal".into(),
            gpus: 1,
            gpu_slice: None,
            cpu_millis: 0,
            memory_bytes: 0,
            time_limit_secs: None,
            image: None,
            command: vec!["true".into()].into(),
            env: BTreeMap::new().into(),
            sched: SchedOptions::default(),
            ..Default::default()
        }
    }

    /// `-n N --gpus-per-task G` without `--nodes`: as few nodes as hold the tasks, each node
    /// laid out as Slurm blocks the tasks, with its busiest node's GPUs, CPUs and memory.
    #[test]
    fn tasks_spread_over_the_fewest_nodes_that_hold_them() {
        let spread = |tasks: u32, per_task: u32| {
            let mut s = spec();
            s.gpus = tasks * per_task;
            s.layout = TaskLayout { ntasks: tasks, gpus_per_task: per_task, cpus_per_task: 2, ..Default::default() };
            s.cpu_millis = 2000;
            s
        };
        let s = spread(7, 1);
        assert!(s.spreads());
        assert_eq!(s.spread_node_counts(4), [2, 3, 4, 7], "4, 3, 2 and 1 tasks on the busiest node");
        assert_eq!(s.spread_node_counts(8), [1, 2, 3, 4, 7]);
        assert_eq!(s.spread_node_counts(0), [] as [u32; 0], "no GPUs anywhere: no shape");
        assert_eq!(spread(4, 3).spread_node_counts(8), [2, 4], "two 3-GPU tasks fit an 8-GPU node");
        assert_eq!(spread(4, 9).spread_node_counts(8), [] as [u32; 0], "a task never splits");
        let big = spread(crate::layout::MAX_TASKS_PER_JOB, 1);
        assert!(big.spread_node_counts(4096).len() <= MAX_SPREAD_SHAPES, "bounded by configuration, not input");

        let on = s.spread_over(4);
        assert_eq!((on.layout.nodes, on.gpus, on.sched.gpus_per_node), (4, 8, Some(2)));
        assert_eq!(on.tasks_on_nodes(), [2, 2, 2, 1], "SLURM_TASKS_PER_NODE 2(x3),1");
        assert_eq!(on.cpu_millis, 4000, "two tasks of two CPUs on the busiest node");
        assert!(!on.spreads(), "placed: a gang of four");
        assert_eq!(on.validate(), Ok(()));
        let mut again = on.clone();
        again.restore_submitted_shape();
        assert_eq!(again, s, "requeued: spreads as submitted");
        assert_eq!(again.spread_over(2).spread_over(3), again.spread_over(2), "placed once");
        let mut per_gpu = spread(6, 2);
        per_gpu.layout.mem_per_gpu = 1 << 30;
        let on = per_gpu.spread_over(2);
        assert_eq!((on.gpus, on.sched.gpus_per_node, on.memory_bytes), (12, Some(6), 6 << 30));

        let mut given = spread(4, 1);
        given.sched.gpus_per_node = Some(4);
        assert!(!given.spreads(), "--gpus-per-node fixes the nodes");
        assert_eq!(given.spread_over(2), given);
        let mut kept = given.clone();
        kept.restore_submitted_shape();
        assert_eq!(kept, given, "a spec no placement laid out stays");

        // `--exclusive` without GPUs: every GPU of its nodes, until requeued.
        let mut whole = spec();
        whole.gpus = 0;
        whole.layout = TaskLayout { nodes: 2, exclusive: true, ..Default::default() };
        assert!(whole.takes_whole_nodes_gpus());
        let placed = whole.with_whole_nodes_gpus(16);
        assert_eq!((placed.gpus, placed.layout.nodes, placed.gpus_per_part()), (16, 2, 8));
        assert!(!placed.takes_whole_nodes_gpus(), "placed once");
        let mut again = placed.clone();
        again.restore_submitted_shape();
        assert_eq!(again, whole, "requeued: as submitted, on its own two nodes");
        assert_eq!(whole.with_whole_nodes_gpus(0), whole, "nodes without GPUs: none");
        let mut asks = whole.clone();
        asks.sched.gpus_per_node = Some(2);
        assert!(!asks.takes_whole_nodes_gpus(), "GPUs asked for are what it gets");
        let mut nodes = spread(4, 1);
        nodes.layout.nodes = 2;
        assert!(!nodes.spreads(), "--nodes fixes them too");
        assert!(!spread(1, 1).spreads(), "one task: one node");
    }

    #[test]
    fn validate_rejects_bad_specs() {
        assert_eq!(spec().validate(), Ok(()));
        let mut s = spec();
        s.command = Vec::new().into();
        assert_eq!(s.validate(), Err(JobSpecError::EmptyCommand));
        let mut s = spec();
        s.command = vec!["  ".into()].into();
        assert_eq!(s.validate(), Err(JobSpecError::EmptyCommand));
        let mut s = spec();
        s.gpu_slice = Some(GpuSlice::parse("mps:50").unwrap());
        assert_eq!(s.validate(), Err(JobSpecError::GpusAndSlice));
        let mut s = spec();
        s.gpus = 5000;
        assert!(matches!(s.validate(), Err(JobSpecError::TooManyGpus { .. })));
        let mut s = spec();
        s.gpus = 16;
        s.sched.gpus_per_node = Some(8);
        assert_eq!(s.validate(), Ok(()));
        s.sched.gpus_per_node = Some(3);
        assert!(matches!(s.validate(), Err(JobSpecError::Invalid { .. })));
        let mut s = spec();
        s.sched.checkpoint_signal = Some(9);
        assert!(matches!(s.validate(), Err(JobSpecError::Invalid { .. })));
        let mut s = spec();
        s.command = Vec::new().into();
        s.script = Some("#!/bin/sh\necho hi\n".into());
        assert_eq!(s.validate(), Ok(()), "a batch script needs no command");
        s.script = Some("x".repeat(MAX_SCRIPT_BYTES + 1).into());
        assert!(matches!(s.validate(), Err(JobSpecError::Invalid { field, .. }) if field == "script"));
        let mut s = spec();
        s.workdir = Some("relative/dir".into());
        assert!(matches!(s.validate(), Err(JobSpecError::Invalid { field, .. }) if field == "workdir"));
        s.workdir = Some("/home/ana/exp".into());
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn validate_bounds_sizes() {
        let field = |s: &JobSpec| match s.validate() {
            Err(JobSpecError::Invalid { field, reason }) => format!("{field}: {reason}"),
            other => format!("{other:?}"),
        };
        let mut s = spec();
        s.command = vec!["x".repeat(MAX_COMMAND_BYTES + 1)].into();
        assert!(field(&s).starts_with("command: "), "{}", field(&s));
        let mut s = spec();
        s.command = vec!["a".into(); MAX_ARGS + 1].into();
        assert!(field(&s).starts_with("command: 4097 arguments"), "{}", field(&s));
        let mut s = spec();
        s.env = Arc::new((0..=MAX_ENV_VARS).map(|i| (format!("K{i}"), String::new())).collect());
        assert!(field(&s).starts_with("env: "), "{}", field(&s));
        let mut s = spec();
        s.env = Arc::new([("BIG".into(), "v".repeat(MAX_ENV_BYTES))].into());
        assert!(field(&s).starts_with("env: "), "{}", field(&s));
        let mut s = spec();
        s.tenant = "t".repeat(MAX_SHORT_NAME + 1);
        assert_eq!(field(&s), "tenant: longer than 128 bytes");
        let mut s = spec();
        s.image = Some("/".repeat(MAX_PATH + 1));
        assert_eq!(field(&s), "image: longer than 4096 bytes");
        let mut s = spec();
        s.image = Some("localhost:5000/x:1".into());
        s.image_digest = Some(format!("sha256:{}", "ab".repeat(32)));
        assert!(s.validate().is_ok());
        s.image_digest = Some(format!("sha256:{}", "AB".repeat(32)));
        assert!(field(&s).starts_with("image digest: "), "{}", field(&s));
        s.image_digest = Some("sha512:00".into());
        assert!(field(&s).starts_with("image digest: "), "{}", field(&s));
        s.image = None;
        s.image_digest = Some(format!("sha256:{}", "ab".repeat(32)));
        assert!(field(&s).starts_with("image digest: "), "{}", field(&s));
    }

    #[test]
    fn a_copy_of_a_spec_shares_its_large_parts_and_serializes_as_before() {
        let mut s = spec();
        s.script = Some("#!/bin/sh\n".into());
        s.env = Arc::new([("K".to_string(), "v".to_string())].into());
        let copy = s.clone();
        assert!(Arc::ptr_eq(&copy.command, &s.command) && Arc::ptr_eq(&copy.env, &s.env));
        assert!(Arc::ptr_eq(copy.script.as_ref().unwrap(), s.script.as_ref().unwrap()));
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["command"], serde_json::json!(["true"]));
        assert_eq!(json["env"], serde_json::json!({"K": "v"}));
        assert_eq!(json["script"], "#!/bin/sh\n");
        assert_eq!(serde_json::from_value::<JobSpec>(json).unwrap(), s);
    }

    #[test]
    fn array_limits_admit_within_the_pool_and_name_the_limit() {
        let limits = ArrayLimits { max_window: 100, max_size: 5000 };
        let admit = |text: &str| {
            let mut array = ArraySpec::parse(text).unwrap();
            limits.admit(&mut array).map(|()| array).map_err(|e| e.to_string())
        };
        assert_eq!(admit("0-4999%100").unwrap().max_running, Some(100));
        assert_eq!(admit("0-9").unwrap().max_running, Some(100), "no %N: the pool's window");
        let e = admit("0-9%101").unwrap_err();
        assert_eq!(
            e,
            "invalid array: %101 asks for 101 tasks at once, this pool allows at most 100 (limits.max-array-window)"
        );
        let e = admit("0-5000").unwrap_err();
        assert_eq!(e, "invalid array: 5001 tasks, this pool allows at most 5000 in one array (limits.max-array-size)");
        let mut default = ArraySpec::parse("0-99999").unwrap();
        ArrayLimits::default().admit(&mut default).unwrap();
        assert_eq!(default.max_running, None, "the default window needs no %N");
        // What did not come through `parse` is put in its form, and checked all the same.
        let range = |first, last, step| ArrayRange { first, last, step };
        let mut as_written = ArraySpec {
            ranges: vec![range(9, 9, 1), range(12, 22, 4), range(4000, 4000, 7), range(1, 3, 1), range(0, 0, 1)],
            max_running: None,
        };
        limits.admit(&mut as_written).unwrap();
        assert_eq!(as_written.ranges, vec![range(0, 3, 1), range(9, 9, 1), range(12, 20, 4), range(4000, 4000, 1)]);
        let mut overlapping = ArraySpec { ranges: vec![range(0, 9, 1), range(9, 9, 1)], max_running: None };
        let e = limits.admit(&mut overlapping).unwrap_err().to_string();
        assert!(e.starts_with("invalid array: 0-9 and 9 overlap"), "{e}");
        let singles =
            |n: u32| ArraySpec { ranges: (0..n).map(|i| range(i * 3, i * 3, 1)).collect(), max_running: None };
        let mut merged = singles(20_000);
        ArrayLimits::default().admit(&mut merged).unwrap();
        assert_eq!(merged.ranges, vec![range(0, 59_997, 3)], "20000 single indices evenly spaced: one range");
        let mut apart = ArraySpec {
            ranges: (0..MAX_ARRAY_RANGES as u32 + 1)
                .map(|i| range(i * 10 + (i % 2) * 3, i * 10 + (i % 2) * 3, 1))
                .collect(),
            max_running: None,
        };
        assert!(limits.admit(&mut apart).unwrap_err().to_string().contains("4097 ranges even once"));
        let mut too_many = singles(MAX_ARRAY_TASKS + 1);
        assert!(limits.admit(&mut too_many).unwrap_err().to_string().contains("more than an array may have tasks"));
        let big = ArraySpec { ranges: vec![range(0, 0, 1); MAX_ARRAY_RANGES + 1], max_running: None };
        assert!(big.validate().unwrap_err().contains("4097 ranges, at most 4096"));
        let mut window = ArraySpec::parse("0-9").unwrap();
        window.max_running = Some(MAX_ARRAY_WINDOW + 1);
        assert_eq!(window.window(), MAX_ARRAY_WINDOW, "an earlier version's record runs within the cap");
        assert!(window.validate().unwrap_err().contains("more than 10000 tasks at once"));
    }

    #[test]
    fn old_encodings_without_new_fields_still_decode() {
        let json = r#"{"node":"n1","gpus":[0,1],"epoch":3}"#;
        let a: Allocation = serde_json::from_str(json).unwrap();
        assert!(a.more_nodes.is_empty() && a.slice.is_none());
        assert_eq!(a.gpus_on("n1"), Some(&[0, 1][..]));
        assert_eq!(a.gpus_on("n2"), None);
    }

    #[test]
    fn slices_parse() {
        assert_eq!(
            GpuSlice::parse("mig:1g.10gb").unwrap(),
            GpuSlice::Mig { profile: "1g.10gb".into(), compute_slices: 1 }
        );
        assert_eq!(
            GpuSlice::parse("mps:25:8GiB").unwrap(),
            GpuSlice::Mps { thread_percent: 25, memory_mib: Some(8192) }
        );
        assert_eq!(GpuSlice::parse("mps:50").unwrap().milli_gpus(), 500);
        for bad in ["mps", "mps:0", "mps:101", "mig:9g.1gb", "foo:1", "mps:20:xx"] {
            assert!(GpuSlice::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn states_round_trip() {
        for s in [
            JobState::Pending,
            JobState::Running,
            JobState::Succeeded,
            JobState::Failed,
            JobState::Cancelled,
            JobState::Preempted,
        ] {
            assert_eq!(JobState::parse(s.as_str()), Some(s));
        }
        assert!(JobState::Failed.is_terminal());
        assert!(JobState::Preempted.is_terminal(), "a job that opted out of requeueing ends preempted");
        assert!(!JobState::Pending.is_terminal());
    }
}
