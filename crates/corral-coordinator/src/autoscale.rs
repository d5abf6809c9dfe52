//! Elastic capacity, Slurm's power-saving interface: nodes declared in the coordinator's
//! `[autoscale]` section are resumed by `resume-program` when pending work would fit them and
//! nothing else can take it, and suspended by `suspend-program` after `suspend-after` without
//! a job.
//!
//! The leader decides, in its control loop. What it decides from is replicated: a suspended
//! node is cordoned with the reason [`suspended_reason`], which names the node's epoch then, so
//! any leader tells a node still shutting down (same epoch, up) from one that is off (down) and
//! from one that was resumed since (it registered again: a higher epoch), and a resume that
//! timed out cordons the node with [`RESUME_FAILED`] until an operator resumes it. Every declared
//! node is in the replicated state before the leader decides anything about it (it registers
//! the ones that never did as suspended). Only clocks live in the leader's memory (how long a
//! node has been idle or resuming): a new leader starts them afresh.
//!
//! Cost: a look for nodes to resume is one scheduling pass over a copy of the state with the
//! off nodes registered in it, at most once per [`RESUME_LOOK_EVERY`] and only while jobs wait
//! and a declared node is off; the declared nodes are at most [`MAX_DECLARED_NODES`].

use crate::Coordinator;
use corral_core::{schedule, Command, Request, State};
use corral_types::{hostlist, ConfigDuration, ConfigSize, GpuDevice, NodeMode, NodeSpec, NodeState, Timestamp};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The reason a suspended node is cordoned with starts so (see [`suspended_reason`]).
pub const SUSPENDED: &str = "autoscale: suspended";
/// The reason a registered node whose resume timed out is cordoned with starts so.
pub const RESUME_FAILED: &str = "autoscale: resume timed out";
/// Most nodes an `[autoscale]` section declares.
pub const MAX_DECLARED_NODES: usize = 4096;
/// Most GPUs of one declared node.
const MAX_GPUS_PER_NODE: u32 = 64;
/// Looks for nodes to resume at most this often (each is a scheduling pass).
pub const RESUME_LOOK_EVERY: Duration = Duration::from_secs(2);
/// The most of a program's output kept for the log.
const OUTPUT_KEPT: usize = 2048;

/// The `[autoscale]` section of the coordinator's config. In the coordinator's own file, not
/// the policy: the programs run as the coordinator's user, which an admin token must not
/// choose. Every coordinator should have the same section: the leader's acts.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct AutoscaleSection {
    /// Run with the nodes to power on, as one Slurm hostlist (`gpu-[05-06]`) in `$1` and
    /// space-separated in `CORRAL_NODES`; it should start their workers.
    pub resume_program: Option<PathBuf>,
    /// Run the same way with nodes that had no job for `suspend-after`; it should stop their
    /// workers (and power the hosts off). Absent: nodes are never suspended.
    pub suspend_program: Option<PathBuf>,
    /// How long a declared node has no job before it is suspended (default 30m).
    pub suspend_after: Option<ConfigDuration>,
    /// A resumed node must register within this (default 10m), else it is marked failed and
    /// not resumed again until `corral node resume`.
    pub resume_timeout: Option<ConfigDuration>,
    /// The nodes that may be powered on, with what each offers.
    pub nodes: Vec<DeclaredNodes>,
}

/// `[[autoscale.nodes]]`: nodes of one shape, as their workers will register.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DeclaredNodes {
    /// Node names, a Slurm hostlist: `gpu-[05-08]`, `a,b`.
    pub names: String,
    pub gpus: u32,
    /// The GPUs' model as the worker reports it (what `--gres=gpu:TYPE:N` matches).
    #[serde(default)]
    pub gpu_model: String,
    /// Memory of each GPU (default 32GiB).
    pub gpu_memory: Option<ConfigSize>,
    /// CPUs of the node, as its worker will register them.
    pub cpus: u32,
    /// Memory of the node, as its worker will register it (e.g. "512GiB").
    pub memory: ConfigSize,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub partitions: Vec<String>,
}

/// The checked `[autoscale]` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoscaleConfig {
    pub resume_program: PathBuf,
    pub suspend_program: Option<PathBuf>,
    pub suspend_after: Duration,
    pub resume_timeout: Duration,
    /// What each declared node offers, by name.
    pub nodes: BTreeMap<String, NodeSpec>,
}

impl AutoscaleSection {
    /// The checked section; `None` when it declares nothing. Errors name the key.
    pub fn config(&self) -> Result<Option<AutoscaleConfig>, String> {
        if self.nodes.is_empty() {
            if self.resume_program.is_some() || self.suspend_program.is_some() {
                return Err("autoscale.nodes: no node declared ([[autoscale.nodes]] with names and gpus)".into());
            }
            return Ok(None);
        }
        let Some(resume_program) = self.resume_program.clone() else {
            return Err("autoscale.resume-program: needed to power the declared nodes on".into());
        };
        for (key, program) in
            [("resume-program", Some(&resume_program)), ("suspend-program", self.suspend_program.as_ref())]
        {
            if let Some(program) = program {
                if !program.is_absolute() {
                    return Err(format!("autoscale.{key}: '{}' is not an absolute path", program.display()));
                }
            }
        }
        if self.suspend_after.is_some() && self.suspend_program.is_none() {
            return Err("autoscale.suspend-after: set suspend-program too (nothing suspends nodes without it)".into());
        }
        let suspend_after = self.suspend_after.map_or(Duration::from_secs(30 * 60), ConfigDuration::get);
        let resume_timeout = self.resume_timeout.map_or(Duration::from_secs(10 * 60), ConfigDuration::get);
        if suspend_after < Duration::from_secs(1) {
            return Err("autoscale.suspend-after: must be at least 1s".into());
        }
        if resume_timeout < Duration::from_secs(1) {
            return Err("autoscale.resume-timeout: must be at least 1s".into());
        }
        let mut nodes = BTreeMap::new();
        for (i, declared) in self.nodes.iter().enumerate() {
            let key = format!("autoscale.nodes[{i}]");
            let names = hostlist::expand(&declared.names).map_err(|e| format!("{key}.names: {e}"))?;
            if names.is_empty() {
                return Err(format!("{key}.names: no name"));
            }
            if declared.gpus > MAX_GPUS_PER_NODE {
                return Err(format!("{key}.gpus: at most {MAX_GPUS_PER_NODE}"));
            }
            if declared.gpus > 0 && declared.gpu_model.trim().is_empty() {
                return Err(format!(
                    "{key}.gpu-model: needed with gpus (the model the worker reports, e.g. \"NVIDIA GeForce RTX 5090\")"
                ));
            }
            let memory_mib = declared.gpu_memory.map_or(32 * 1024, |m| m.bytes() / (1024 * 1024));
            for name in names {
                if nodes.len() >= MAX_DECLARED_NODES {
                    return Err(format!("autoscale.nodes: more than {MAX_DECLARED_NODES} nodes"));
                }
                let mut labels: Vec<(String, String)> = declared.labels.clone().into_iter().collect();
                labels.extend(declared.partitions.iter().map(|p| ("partition".to_owned(), p.clone())));
                let gpus = (0..declared.gpus)
                    .map(|index| GpuDevice {
                        index,
                        uuid: format!("GPU-declared-{name}-{index}"),
                        model: declared.gpu_model.clone(),
                        memory_mib,
                        ..Default::default()
                    })
                    .collect();
                let spec = NodeSpec {
                    name: name.clone(),
                    address: String::new(),
                    gpus,
                    cpu_millis: u64::from(declared.cpus) * 1000,
                    memory_bytes: declared.memory.bytes(),
                    labels,
                    rendezvous_ports: None,
                    lease_end: None,
                };
                if nodes.insert(name.clone(), spec).is_some() {
                    return Err(format!("{key}.names: {name} is declared twice"));
                }
            }
        }
        Ok(Some(AutoscaleConfig {
            resume_program,
            suspend_program: self.suspend_program.clone(),
            suspend_after,
            resume_timeout,
            nodes,
        }))
    }
}

/// The cordon reason of a node suspended while it had registration epoch `epoch`.
pub fn suspended_reason(epoch: u64) -> String {
    format!("{SUSPENDED} (epoch {epoch})")
}

/// The epoch a suspended node's cordon reason names.
fn suspended_epoch(reason: &str) -> Option<u64> {
    reason.strip_prefix(SUSPENDED)?.trim().strip_prefix("(epoch ")?.strip_suffix(')')?.parse().ok()
}

/// Where a declared node stands, as the replicated state says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Power {
    /// Registered and up, and not ours to act on (active, or an operator's cordon or drain).
    On,
    /// Registered again since it was suspended, still cordoned: the leader makes it active.
    Resumed,
    /// Suspended, its worker not yet gone.
    Suspending,
    /// Never registered, or down and neither cordoned nor drained by an operator.
    Off,
    /// Its resume timed out; out until an operator resumes it.
    ResumeFailed,
}

/// A declared node's power, from the replicated state only.
pub(crate) fn power(state: &State, name: &str) -> Power {
    let Some(node) = state.nodes.get(name) else { return Power::Off };
    let suspended = suspended_epoch(&node.mode_reason).filter(|_| node.mode == NodeMode::Cordoned);
    if node.mode == NodeMode::Cordoned && node.mode_reason.starts_with(RESUME_FAILED) {
        return Power::ResumeFailed;
    }
    match (node.state, suspended) {
        (NodeState::Down, Some(_)) => Power::Off,
        (NodeState::Down, None) if node.mode == NodeMode::Active => Power::Off,
        (NodeState::Down, None) => Power::On,
        (NodeState::Up, Some(epoch)) if node.epoch > epoch => Power::Resumed,
        (NodeState::Up, Some(_)) => Power::Suspending,
        (NodeState::Up, None) => Power::On,
    }
}

/// The off nodes that waiting work would be placed on if they were up: a scheduling pass over
/// a copy of `state` with each of `off` registered (as it registered last, else as declared)
/// and active. Only placements of `waiting` count: the jobs the last real pass left pending,
/// which fit no node that is up (a job submitted since may fit one; the copy's pass may put it
/// on an off node all the same); `None` when no node is up (there was no real pass), where
/// every placement counts.
pub(crate) fn nodes_to_resume(
    state: &State,
    off: &[&NodeSpec],
    waiting: Option<&BTreeSet<u64>>,
    now: Timestamp,
    unschedulable: &BTreeSet<(String, u32)>,
) -> (BTreeSet<String>, Vec<u64>) {
    let mut what_if = state.clone();
    for declared in off {
        let spec = state.nodes.get(&declared.name).map_or((*declared).clone(), |n| n.spec.clone());
        let _ = what_if.apply(&Request { ts: now, command: Command::RegisterNode { spec } });
        let _ = what_if.apply(&Request {
            ts: now,
            command: Command::SetNodeMode {
                node: declared.name.clone(),
                mode: NodeMode::Active,
                reason: String::new(),
                drain_deadline: None,
            },
        });
    }
    let names: BTreeSet<&str> = off.iter().map(|n| n.name.as_str()).collect();
    let pass = schedule(&what_if, now, unschedulable);
    let mut resume = BTreeSet::new();
    let mut jobs = Vec::new();
    for placement in pass.placements.iter().filter(|p| waiting.is_none_or(|w| w.contains(&p.job_id))) {
        let wanted: Vec<&str> = placement.parts().map(|(node, _)| node).filter(|n| names.contains(n)).collect();
        if !wanted.is_empty() {
            jobs.push(placement.job_id);
            resume.extend(wanted.into_iter().map(String::from));
        }
    }
    (resume, jobs)
}

/// The leader's memory of its power decisions (clocks, never replicated).
#[derive(Debug, Default)]
struct Memory {
    /// The leadership term these clocks belong to: a new term starts them afresh.
    term: u64,
    /// Nodes the resume program was run for, and when.
    resuming: BTreeMap<String, Instant>,
    /// Registered declared nodes without a job, since when.
    idle_since: BTreeMap<String, Instant>,
    /// Suspended nodes whose worker is still up, since when this leader saw them so.
    suspending_since: BTreeMap<String, Instant>,
    last_look: Option<Instant>,
    /// Jobs the last look would place on resuming nodes, with the nodes (for `corral queue`).
    waiting: BTreeMap<u64, String>,
}

/// The autoscaler: the checked config and the leader's clocks.
#[derive(Debug, Default)]
pub(crate) struct Autoscaler {
    config: Option<AutoscaleConfig>,
    memory: Mutex<Memory>,
}

impl Autoscaler {
    pub(crate) fn new(config: Option<AutoscaleConfig>) -> Autoscaler {
        Autoscaler { config, memory: Mutex::default() }
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The declared nodes (empty without `[autoscale]`).
    pub(crate) fn declared(&self) -> impl Iterator<Item = &NodeSpec> {
        self.config.iter().flat_map(|c| c.nodes.values())
    }

    /// How `corral nodes` shows a declared node (`None`: as any node), with a reason.
    pub(crate) fn shown_state(&self, state: &State, name: &str) -> Option<(&'static str, String)> {
        self.config.as_ref().filter(|c| c.nodes.contains_key(name))?;
        if let Some(since) = self.memory().resuming.get(name) {
            let secs = since.elapsed().as_secs();
            return Some(("resuming", format!("autoscale: resume program run {secs}s ago")));
        }
        match power(state, name) {
            Power::Off => Some(("off", "autoscale: powered off, resumed for pending work".into())),
            Power::Suspending => Some(("suspending", "autoscale: suspend program run, worker not gone yet".into())),
            Power::ResumeFailed => Some(("resume-failed", state.nodes.get(name)?.mode_reason.clone())),
            Power::On | Power::Resumed => None,
        }
    }

    /// The jobs that wait for nodes being resumed for them, each with that reason (a small
    /// map: the jobs of the resumes in progress).
    pub(crate) fn waiting(&self) -> BTreeMap<u64, String> {
        let memory = self.memory();
        memory.waiting.iter().map(|(job, nodes)| (*job, format!("autoscale: waiting for {nodes} to resume"))).collect()
    }
}

/// One round of the leader's power decisions: activate resumed nodes, fail resumes past their
/// timeout, resume off nodes that waiting work needs, suspend nodes idle long enough.
pub(crate) async fn tick(coord: &Coordinator, term: u64) {
    let Some(config) = coord.autoscaler().config.clone() else { return };
    {
        let mut memory = coord.autoscaler().memory();
        if memory.term != term {
            *memory = Memory { term, ..Memory::default() };
        }
    }
    if !adopt_declared(coord, &config).await {
        return;
    }
    settle_resumes(coord, &config).await;
    resume_for_waiting_work(coord, &config).await;
    if config.suspend_program.is_some() {
        suspend_idle(coord, &config).await;
    }
}

/// Registers each declared node that never registered as suspended (down, cordoned with
/// [`suspended_reason`]): from then on the replicated state knows it, so a submit is judged
/// against what it offers (a job only a declared node can take is accepted and waits), and
/// every leader and `corral nodes` sees it off. Its worker's own registration replaces the
/// declared spec. Three log entries per node, once; the scheduling pass that could place on it
/// in between runs after this in the same loop, so it never sees it up. Whether every declared
/// node is registered now (else the round stops: nothing is decided about an absent node).
async fn adopt_declared(coord: &Coordinator, config: &AutoscaleConfig) -> bool {
    let absent: Vec<NodeSpec> = {
        let data = coord.store().read();
        config.nodes.values().filter(|n| !data.state.nodes.contains_key(&n.name)).cloned().collect()
    };
    for spec in absent {
        let node = spec.name.clone();
        let epoch = match coord.propose(Command::RegisterNode { spec }).await {
            Ok(corral_core::Outcome::NodeRegistered { epoch }) => epoch,
            Ok(other) => {
                tracing::warn!(node = %node, outcome = ?other, "autoscale: unexpected outcome declaring a node");
                return false;
            }
            Err(e) => {
                tracing::warn!(node = %node, error = %e, "autoscale: could not declare a node");
                return false;
            }
        };
        let cordon = Command::SetNodeMode {
            node: node.clone(),
            mode: NodeMode::Cordoned,
            reason: suspended_reason(epoch),
            drain_deadline: None,
        };
        let down = Command::SetNodeState {
            node: node.clone(),
            state: NodeState::Down,
            reason: "autoscale: declared, powered off".into(),
        };
        for command in [cordon, down] {
            if let Err(e) = coord.propose(command).await {
                tracing::warn!(node = %node, error = %e, "autoscale: could not declare a node");
                return false;
            }
        }
        tracing::info!(node = %node, "autoscale: declared node registered as powered off");
    }
    true
}

/// Resumed nodes become active; resumes past their timeout fail.
async fn settle_resumes(coord: &Coordinator, config: &AutoscaleConfig) {
    let mut activate = Vec::new();
    let mut still_up = Vec::new();
    let mut timed_out = Vec::new();
    {
        let data = coord.store().read();
        let mut memory = coord.autoscaler().memory();
        for name in config.nodes.keys() {
            let power = power(&data.state, name);
            if power != Power::Suspending {
                memory.suspending_since.remove(name);
            }
            match power {
                Power::Resumed => {
                    memory.resuming.remove(name);
                    activate.push((name.clone(), data.state.nodes[name].mode_reason.clone()));
                }
                Power::On => {
                    memory.resuming.remove(name);
                }
                Power::Suspending => {
                    // A suspend program that exited 0 but left the worker running: after the
                    // resume timeout the node takes jobs again rather than stay out for good.
                    let since = *memory.suspending_since.entry(name.clone()).or_insert_with(Instant::now);
                    if since.elapsed() >= config.resume_timeout {
                        memory.suspending_since.remove(name);
                        still_up.push((name.clone(), data.state.nodes[name].mode_reason.clone()));
                    }
                }
                Power::Off | Power::ResumeFailed => {}
            }
            if memory.resuming.get(name).is_some_and(|since| since.elapsed() >= config.resume_timeout) {
                memory.resuming.remove(name);
                timed_out.push(name.clone());
            }
        }
        let Memory { waiting, resuming, .. } = &mut *memory;
        waiting.retain(|_, nodes| {
            hostlist::expand(nodes).is_ok_and(|names| names.iter().any(|n| resuming.contains_key(n)))
        });
    }
    for (node, reason) in activate {
        tracing::info!(node = %node, "autoscale: node resumed, taking jobs again");
        reactivate(coord, &node, &reason).await;
    }
    for (node, reason) in still_up {
        tracing::warn!(node = %node, "autoscale: the suspend program ran but the node's worker is still up: it takes jobs again");
        reactivate(coord, &node, &reason).await;
    }
    let timeout = ConfigDuration::from_millis(config.resume_timeout.as_millis() as u64);
    for node in timed_out {
        tracing::warn!(node = %node, resume_timeout = %timeout, "autoscale: the node did not register in time: out until `corral node resume`");
        let command = Command::SetNodeMode {
            node,
            mode: NodeMode::Cordoned,
            reason: format!("{RESUME_FAILED}: not registered within {timeout}"),
            drain_deadline: None,
        };
        if let Err(e) = coord.propose(command).await {
            tracing::warn!(error = %e, "autoscale: could not mark a failed resume");
        }
    }
}

/// Runs the resume program for the off nodes that waiting jobs would be placed on.
async fn resume_for_waiting_work(coord: &Coordinator, config: &AutoscaleConfig) {
    {
        let mut memory = coord.autoscaler().memory();
        if memory.last_look.is_some_and(|at| at.elapsed() < RESUME_LOOK_EVERY) {
            return;
        }
        memory.last_look = Some(Instant::now());
    }
    // The real pass is skipped while no node is up: then any job waits.
    let any_up = coord.store().read().state.nodes.values().any(|n| n.state == NodeState::Up);
    let waiting: BTreeSet<u64> = coord.leader_view().pending().order().iter().copied().collect();
    if any_up && waiting.is_empty() {
        return;
    }
    let Ok(now) = coord.timestamps(1).await else { return };
    let unschedulable = coord.liveness().unschedulable();
    let (resume, jobs) = {
        let data = coord.store().read();
        let memory = coord.autoscaler().memory();
        let off: Vec<&NodeSpec> = config
            .nodes
            .values()
            .filter(|n| power(&data.state, &n.name) == Power::Off)
            .filter(|n| !memory.resuming.contains_key(&n.name))
            .collect();
        if off.is_empty() {
            return;
        }
        drop(memory);
        let state = data.state.clone();
        drop(data);
        nodes_to_resume(&state, &off, any_up.then_some(&waiting), now, &unschedulable)
    };
    if resume.is_empty() {
        return;
    }
    let names: Vec<String> = resume.into_iter().collect();
    let list = hostlist::compress(&names);
    {
        let mut memory = coord.autoscaler().memory();
        for name in &names {
            memory.resuming.insert(name.clone(), Instant::now());
        }
        for job in jobs {
            memory.waiting.insert(job, list.clone());
        }
    }
    tracing::info!(nodes = %list, "autoscale: resuming nodes for waiting jobs");
    let program = config.resume_program.clone();
    let timeout = config.resume_timeout;
    tokio::spawn(async move {
        if let Err(e) = run_program("resume", &program, &names, timeout).await {
            // The resume timeout still applies: the node fails then unless it registers.
            tracing::warn!(nodes = %hostlist::compress(&names), "autoscale: {e}");
        }
    });
}

/// Suspends the declared nodes without a job for `suspend-after`: cordons each (so nothing is
/// placed there from then on), then, if no job was placed before the cordon, runs the suspend
/// program; if a job was, or the program fails, the node is made active again.
async fn suspend_idle(coord: &Coordinator, config: &AutoscaleConfig) {
    let mut due = Vec::new();
    {
        let data = coord.store().read();
        let mut memory = coord.autoscaler().memory();
        for name in config.nodes.keys() {
            let idle = data.state.nodes.get(name).is_some_and(|n| n.accepts_jobs())
                && data.state.jobs_on_node(name).next().is_none();
            if !idle {
                memory.idle_since.remove(name);
                continue;
            }
            let since = *memory.idle_since.entry(name.clone()).or_insert_with(Instant::now);
            if since.elapsed() >= config.suspend_after {
                memory.idle_since.remove(name);
                due.push((name.clone(), data.state.nodes[name].epoch));
            }
        }
    }
    for (node, epoch) in due {
        let reason = suspended_reason(epoch);
        let cordon = Command::SetNodeMode {
            node: node.clone(),
            mode: NodeMode::Cordoned,
            reason: reason.clone(),
            drain_deadline: None,
        };
        if let Err(e) = coord.propose(cordon).await {
            tracing::warn!(node = %node, error = %e, "autoscale: could not cordon an idle node to suspend it");
            continue;
        }
        // Placements are ordered with the cordon in the log: one that got in first is seen now,
        // and none comes after it.
        let placed_meanwhile = coord.store().read().state.jobs_on_node(&node).next().is_some();
        if placed_meanwhile {
            tracing::info!(node = %node, "autoscale: a job was placed on the idle node: not suspending it");
            reactivate(coord, &node, &reason).await;
            continue;
        }
        tracing::info!(node = %node, "autoscale: suspending a node without jobs");
        let coord = coord.clone();
        let program = config.suspend_program.clone().expect("checked by the caller");
        let timeout = config.resume_timeout;
        tokio::spawn(async move {
            if let Err(e) = run_program("suspend", &program, std::slice::from_ref(&node), timeout).await {
                tracing::warn!(node = %node, "autoscale: {e}: the node takes jobs again");
                reactivate(&coord, &node, &reason).await;
            }
        });
    }
}

/// Makes `node` active again if it is still cordoned with `reason` (an operator's cordon since
/// is left alone).
async fn reactivate(coord: &Coordinator, node: &str, reason: &str) {
    let ours = coord.store().read().state.nodes.get(node).is_some_and(|n| n.mode_reason == reason);
    if !ours {
        return;
    }
    let command = Command::SetNodeMode {
        node: node.to_string(),
        mode: NodeMode::Active,
        reason: String::new(),
        drain_deadline: None,
    };
    if let Err(e) = coord.propose(command).await {
        tracing::warn!(node = %node, error = %e, "autoscale: could not make the node active again");
    }
}

/// Runs `program` with the nodes as one hostlist (`$1`) and in `CORRAL_NODES`; its exit within
/// `timeout` (it is killed after), with the start of what it printed. Its output goes to an
/// unnamed file, not a pipe: a worker it starts in the background keeps its descriptors, and
/// the program's end is its exit, not theirs.
async fn run_program(
    action: &str,
    program: &std::path::Path,
    nodes: &[String],
    timeout: Duration,
) -> Result<(), String> {
    use std::io::{Read, Seek};
    let list = hostlist::compress(nodes);
    let failed = |e: std::io::Error| format!("{action} program {}: {e}", program.display());
    let mut out = tempfile::tempfile().map_err(failed)?;
    let err = out.try_clone().map_err(failed)?;
    let mut child = tokio::process::Command::new(program)
        .arg(&list)
        .env("CORRAL_NODES", nodes.join(" "))
        .env("CORRAL_AUTOSCALE_ACTION", action)
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone().map_err(failed)?)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("{action} program {}: cannot start: {e}", program.display()))?;
    let status = tokio::time::timeout(timeout, child.wait())
        .await
        .map_err(|_| format!("{action} program {} ran past {}s: killed", program.display(), timeout.as_secs()))?
        .map_err(failed)?;
    let mut said = Vec::new();
    let _ = out.rewind().and_then(|_| out.take(OUTPUT_KEPT as u64).read_to_end(&mut said));
    let said = String::from_utf8_lossy(&said).trim().to_string();
    if !status.success() {
        return Err(format!("{action} program {} for {list} failed ({status}): {said}", program.display()));
    }
    tracing::info!(nodes = %list, program = %program.display(), output = %said, "autoscale: {action} program done");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::Outcome;
    use corral_types::JobSpec;

    fn section(text: &str) -> Result<Option<AutoscaleConfig>, String> {
        let section: AutoscaleSection = toml::from_str(text).map_err(|e| e.to_string())?;
        section.config()
    }

    const TWO_NODES: &str =
        "resume-program = \"/usr/local/sbin/resume\"\nsuspend-program = \"/usr/local/sbin/suspend\"\n\
        suspend-after = \"5m\"\n[[nodes]]\nnames = \"gpu-[05-06]\"\ngpus = 2\ngpu-model = \"RTX 5090\"\ncpus = 16\n\
        memory = \"64GiB\"\npartitions = [\"rent\"]\n";

    #[test]
    fn the_section_declares_nodes_by_hostlist_and_names_bad_keys() {
        let config = section(TWO_NODES).unwrap().unwrap();
        assert_eq!(config.nodes.keys().collect::<Vec<_>>(), ["gpu-05", "gpu-06"]);
        let spec = &config.nodes["gpu-05"];
        assert_eq!(spec.gpus.len(), 2);
        assert_eq!(spec.cpu_millis, 16_000);
        assert_eq!(spec.labels, vec![("partition".to_string(), "rent".to_string())]);
        assert_eq!(config.suspend_after, Duration::from_secs(300));
        assert_eq!(config.resume_timeout, Duration::from_secs(600));
        assert_eq!(section("").unwrap(), None);
        let cases = [
            ("resume-program = \"/x\"\n", "autoscale.nodes: no node declared"),
            ("[[nodes]]\nnames = \"a\"\ngpus = 1\ngpu-model = \"m\"\ncpus = 1\nmemory = \"1GiB\"\n", "autoscale.resume-program: needed"),
            ("resume-program = \"x\"\n[[nodes]]\nnames = \"a\"\ngpus = 0\ncpus = 1\nmemory = \"1GiB\"\n", "autoscale.resume-program: 'x' is not an absolute path"),
            ("resume-program = \"/x\"\nsuspend-after = \"1m\"\n[[nodes]]\nnames = \"a\"\ngpus = 0\ncpus = 1\nmemory = \"1GiB\"\n", "autoscale.suspend-after: set suspend-program"),
            ("resume-program = \"/x\"\n[[nodes]]\nnames = \"a\"\ngpus = 1\ncpus = 1\nmemory = \"1GiB\"\n", "autoscale.nodes[0].gpu-model: needed"),
            ("resume-program = \"/x\"\n[[nodes]]\nnames = \"a[1-2\"\ngpus = 0\ncpus = 1\nmemory = \"1GiB\"\n", "autoscale.nodes[0].names:"),
            ("resume-program = \"/x\"\n[[nodes]]\nnames = \"a\"\ngpus = 0\ncpus = 1\nmemory = \"1GiB\"\n[[nodes]]\nnames = \"a\"\ngpus = 0\ncpus = 1\nmemory = \"1GiB\"\n", "autoscale.nodes[1].names: a is declared twice"),
            ("resume-program = \"/x\"\n[[nodes]]\nnames = \"a\"\ngpus = 0\n", "missing field `cpus`"),
            ("resume-program = \"/x\"\n[[nodes]]\nnames = \"a[1-5000]\"\ngpus = 0\ncpus = 1\nmemory = \"1GiB\"\n", "more than 4096 nodes"),
        ];
        for (text, want) in cases {
            let err = section(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    fn at(ms: u64, command: Command) -> Request {
        Request { ts: Timestamp::compose(ms, 0), command }
    }

    fn registered(state: &mut State, spec: NodeSpec, ms: u64) {
        assert!(matches!(state.apply(&at(ms, Command::RegisterNode { spec })), Ok(Outcome::NodeRegistered { .. })));
    }

    fn mode(state: &mut State, node: &str, mode: NodeMode, reason: &str, ms: u64) {
        let command = Command::SetNodeMode { node: node.into(), mode, reason: reason.into(), drain_deadline: None };
        state.apply(&at(ms, command)).unwrap();
    }

    #[test]
    fn power_follows_the_replicated_state_whoever_leads() {
        let config = section(TWO_NODES).unwrap().unwrap();
        let mut state = State::default();
        assert_eq!(power(&state, "gpu-05"), Power::Off, "never registered");
        registered(&mut state, config.nodes["gpu-05"].clone(), 1);
        assert_eq!(power(&state, "gpu-05"), Power::On);
        let epoch = state.nodes["gpu-05"].epoch;
        mode(&mut state, "gpu-05", NodeMode::Cordoned, &suspended_reason(epoch), 2);
        assert_eq!(power(&state, "gpu-05"), Power::Suspending, "cordoned, its worker still up");
        let down = Command::SetNodeState { node: "gpu-05".into(), state: NodeState::Down, reason: String::new() };
        state.apply(&at(3, down.clone())).unwrap();
        assert_eq!(power(&state, "gpu-05"), Power::Off, "its worker gone");
        registered(&mut state, config.nodes["gpu-05"].clone(), 4);
        assert_eq!(power(&state, "gpu-05"), Power::Resumed, "registered again since");
        mode(&mut state, "gpu-05", NodeMode::Active, "", 5);
        assert_eq!(power(&state, "gpu-05"), Power::On);
        // An operator's cordon of a down node is the operator's: not powered on for work.
        mode(&mut state, "gpu-05", NodeMode::Cordoned, "maintenance", 6);
        state.apply(&at(7, down)).unwrap();
        assert_eq!(power(&state, "gpu-05"), Power::On);
        mode(&mut state, "gpu-05", NodeMode::Cordoned, &format!("{RESUME_FAILED}: not registered within 5m"), 8);
        assert_eq!(power(&state, "gpu-05"), Power::ResumeFailed);
        assert_eq!(suspended_epoch(&suspended_reason(42)), Some(42));
        assert_eq!(suspended_epoch("autoscale: suspended"), None);
    }

    fn job(id: &str, gpus: u32) -> Command {
        let spec =
            JobSpec { tenant: "default".into(), command: vec!["true".into()].into(), gpus, ..Default::default() };
        Command::SubmitJob { request_id: id.into(), spec }
    }

    #[test]
    fn only_work_that_fits_nowhere_else_resumes_the_fewest_nodes_that_take_it() {
        let config = section(TWO_NODES).unwrap().unwrap();
        let off: Vec<&NodeSpec> = config.nodes.values().collect();
        let now = Timestamp::compose(10_000, 0);
        let none = BTreeSet::new();
        // The real pass, as the leader's loop runs it: what it leaves pending waits.
        let real_pass = |state: &mut State| -> BTreeSet<u64> {
            let pass = schedule(state, now, &none);
            if let Some(command) = pass.command() {
                state.apply(&at(9_000, command)).unwrap();
            }
            pass.pending.iter().map(|p| p.job_id).collect()
        };
        // n1 is up with two GPUs; a one-GPU job fits it: nothing to resume.
        let mut state = crate::testing::dev_state_with_node();
        state.apply(&at(2_000, job("a", 1))).unwrap();
        let waiting = real_pass(&mut state);
        assert!(waiting.is_empty());
        assert!(nodes_to_resume(&state, &off, Some(&waiting), now, &none).0.is_empty());
        // Two 2-GPU jobs: n1 has one GPU left, so each needs an off node.
        state.apply(&at(3_000, job("b", 2))).unwrap();
        state.apply(&at(4_000, job("c", 2))).unwrap();
        let waiting = real_pass(&mut state);
        assert_eq!(waiting.len(), 2);
        let (resume, jobs) = nodes_to_resume(&state, &off, Some(&waiting), now, &none);
        assert_eq!(resume.len(), 2, "{resume:?}");
        assert_eq!(jobs.len(), 2);
        // A job submitted after the real pass is not a reason to resume, even if the look
        // would put it on an off node.
        let mut fresh = crate::testing::dev_state_with_node();
        fresh.apply(&at(2_000, job("e", 1))).unwrap();
        assert!(nodes_to_resume(&fresh, &off, Some(&BTreeSet::new()), now, &none).0.is_empty());
        // A job no declared node can take resumes nothing: one-GPU nodes for a two-GPU job
        // behind a one-GPU job on n1.
        let small = section(&TWO_NODES.replace("gpus = 2", "gpus = 1")).unwrap().unwrap();
        let small_off: Vec<&NodeSpec> = small.nodes.values().collect();
        let mut big = crate::testing::dev_state_with_node();
        big.apply(&at(2_000, job("a", 1))).unwrap();
        big.apply(&at(2_000, job("d", 2))).unwrap();
        let waiting = real_pass(&mut big);
        assert_eq!(waiting.len(), 1);
        assert!(nodes_to_resume(&big, &small_off, Some(&waiting), now, &none).0.is_empty());
        // The look changed nothing.
        assert!(!state.nodes.contains_key("gpu-05"));
        assert_eq!(state.jobs.values().filter(|j| j.allocation.is_some()).count(), 1, "only the real pass placed");
    }
}
