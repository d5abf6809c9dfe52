//! Commands carried by the Raft log and the state machine's responses.

use crate::history::{CompactCutoffs, Compacted};
use crate::ClusterConfig;
use corral_types::{
    Job, JobExitReport, JobId, JobSpec, JobSpecError, JobStep, NodeGpus, NodeMode, NodeSpec, NodeState,
    SliceAssignment, StepId, StepNodeEnd, StepSpec, Timestamp,
};
use serde::{Deserialize, Serialize};

/// Where the scheduler puts one job: a node and GPU indices, the other nodes of a gang, and for
/// a fractional job the slice of its one GPU. Applied all-or-nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub job_id: JobId,
    pub node: String,
    pub gpus: Vec<u32>,
    /// The other parts of a gang across nodes.
    #[serde(default)]
    pub more_nodes: Vec<NodeGpus>,
    /// The slice of `gpus[0]` for a fractional job (`None` lets apply() choose one).
    #[serde(default)]
    pub slice: Option<SliceAssignment>,
}

impl Placement {
    /// Every (node, gpus) part, the first part first.
    pub fn parts(&self) -> impl Iterator<Item = (&str, &[u32])> + '_ {
        std::iter::once((self.node.as_str(), self.gpus.as_slice()))
            .chain(self.more_nodes.iter().map(|p| (p.node.as_str(), p.gpus.as_slice())))
    }

    /// Whole GPUs over every part.
    pub fn gpu_count(&self) -> u32 {
        self.parts().map(|(_, gpus)| gpus.len() as u32).sum()
    }
}

/// A running job the scheduler stops to make room for a pending one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preemption {
    /// The victim.
    pub job_id: JobId,
    /// The pending job it makes room for.
    pub by: JobId,
    /// Seconds between SIGTERM and SIGKILL (from the victim's priority class).
    pub grace_secs: u32,
}

/// One replicated change.
// `SubmitJob` (a whole `JobSpec`) is the common command and the large one: boxing the spec would
// add an allocation to every submit, and commands are built once and moved, never kept in bulk
// (batches of submits travel as `SubmitJobs`).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    SubmitJob {
        request_id: String,
        spec: JobSpec,
    },
    /// Many submits in one log entry (one fsync); each is applied and answered on its own.
    SubmitJobs {
        jobs: Vec<(String, JobSpec)>,
    },
    /// Leader's placement proposal; apply() re-validates it against the state at apply time.
    PlaceJob {
        job_id: JobId,
        node: String,
        gpus: Vec<u32>,
    },
    JobStarted {
        job_id: JobId,
        epoch: u64,
    },
    /// A worker's exit report for its part of the run with `epoch`. `node` names the reporting
    /// node (empty: the whole run ends, as entries written before gangs ended part by part).
    JobFinished {
        job_id: JobId,
        epoch: u64,
        #[serde(default)]
        node: String,
        report: JobExitReport,
    },
    CancelJob {
        job_id: JobId,
        reason: String,
    },
    /// Leader's preemption proposal: stop running `job_id` so that pending `by` can run. The job
    /// is requeued when its worker reports the exit (or ends `Preempted` if it opted out).
    PreemptJob {
        job_id: JobId,
        by: JobId,
        grace_secs: u32,
    },
    /// One scheduling pass in one log entry: placements, each all-or-nothing (a gang across
    /// nodes), then preemptions; apply() re-validates each on its own and reports which it took.
    Schedule {
        placements: Vec<Placement>,
        preemptions: Vec<Preemption>,
    },
    RegisterNode {
        spec: NodeSpec,
    },
    SetNodeState {
        node: String,
        state: NodeState,
        reason: String,
    },
    Configure(ClusterConfig),
    Noop,
    /// Records a coordinator joining the Raft cluster (before it is added as learner).
    AddCoordinator {
        node_id: u64,
        addr: String,
    },
    /// Persists the timestamp oracle's upper bound: no leader serves a timestamp whose physical
    /// part is above it until a later `ExtendTso` commits, and a new leader starts above it.
    ExtendTso {
        upper_ms: u64,
    },
    /// Records a coordinator leaving; its id stays taken.
    RemoveCoordinator {
        node_id: u64,
    },
    /// Issues an access token; only the SHA-256 of its secret is replicated.
    CreateToken {
        /// Empty for an admin token.
        tenant: String,
        admin: bool,
        /// Lower-case hex SHA-256 of the secret.
        sha256: String,
        /// Unix milliseconds after which the token is refused.
        expires_at_ms: Option<u64>,
    },
    /// Revokes a token for good (the record stays, so its use is reported as revoked).
    RevokeToken {
        token_id: u64,
    },
    /// A new version of the cluster policy (`corral admin apply`, `cluster init`): refused if
    /// it strands unfinished jobs unless `force`, which cancels them.
    ApplyPolicy {
        config: ClusterConfig,
        /// Who applied it, as the audit log names the principal.
        by: String,
        force: bool,
    },
    /// An operator cordons, drains or resumes a node (`corral node cordon|drain|resume`).
    SetNodeMode {
        node: String,
        mode: NodeMode,
        reason: String,
        /// Draining: when running jobs are stopped and requeued (`None`: they run to the end).
        drain_deadline: Option<Timestamp>,
    },
    /// The drain deadline of `node` passed: its running jobs get their checkpoint signal, then
    /// their class's grace, then are requeued. Proposed by the leader; apply checks the deadline
    /// against the request's timestamp.
    EvictDrainedJobs {
        node: String,
    },
    /// Forgets an empty node that is down, cordoned or draining (`corral node remove`).
    RemoveNode {
        node: String,
        /// Also refuse from now on every worker certificate of the node issued so far (the
        /// replicated deny list, `revocations.rs`). Entries written before it existed carry
        /// false and replay as they did.
        #[serde(default)]
        revoke_certificates: bool,
    },
    /// Issues a single-use join token for a worker node; only the SHA-256 of its secret is
    /// replicated. It expires `ttl_ms` after the request's timestamp.
    CreateJoinToken {
        /// Lower-case hex SHA-256 of the secret.
        sha256: String,
        ttl_ms: u64,
    },
    /// Holds (`hold`) or releases a pending job; a job array with its pending tasks.
    HoldJob {
        job_id: JobId,
        hold: bool,
    },
    /// Stops a running job (checkpoint signal, grace) and puts it back in the queue.
    RequeueJob {
        job_id: JobId,
    },
    /// Asks the worker to send `signal` to a running job (every running task of an array).
    SignalJob {
        job_id: JobId,
        signal: i32,
    },
    /// Changes a pending job (every pending task of an array, and its tasks to come). `admin`:
    /// asked by an admin, who may also lengthen the time limit.
    UpdateJob {
        job_id: JobId,
        update: JobUpdate,
        admin: bool,
    },
    /// Cancels task `index` of job array `array`, created or not.
    CancelArrayTask {
        array: JobId,
        index: u32,
        reason: String,
    },
    /// Uses a join token for `node`, whose public key hashes to `public_key_sha256`; refused
    /// when the token is unknown, expired (at the request's timestamp) or used by another.
    /// Cancels many jobs at once (`corral cancel --all`): each as `CancelJob` would; unknown or
    /// ended ones are skipped.
    CancelJobs {
        job_ids: Vec<JobId>,
        reason: String,
    },
    /// Moves finished jobs and ended segments out of the hot state, expires request ids and
    /// sets the history's retention (`history.rs`); proposed by the leader periodically.
    Compact(CompactCutoffs),
    ConsumeJoinToken {
        sha256: String,
        node: String,
        public_key_sha256: String,
    },
    /// `srun` inside run `epoch` of a job: a new step (`steps.rs`). `request_id` is the
    /// `srun`'s own, so a retried create returns the step it made.
    CreateStep {
        job_id: JobId,
        epoch: u64,
        request_id: String,
        spec: StepSpec,
    },
    /// A node's tasks of step `step` of run `epoch` are gone: how each ended.
    StepEnded {
        job_id: JobId,
        epoch: u64,
        step: StepId,
        end: StepNodeEnd,
    },
    /// Forwards `signal` to every task of a live step.
    SignalStep {
        job_id: JobId,
        step: StepId,
        signal: i32,
    },
    /// A restarted worker process registers (see `RegisterNode`): the runs of the node's old
    /// registration ended `stale_jobs_stopped_ms_ago` before the entry's ts, when the new process
    /// stopped them, and are billed until then.
    RegisterRestartedNode {
        spec: NodeSpec,
        stale_jobs_stopped_ms_ago: u64,
    },
    /// A heartbeat showed a card fault of a GPU (`clear: false`: the GPU leaves placement) or
    /// showed it schedulable after the marked fault (`clear: true`: the mark goes if
    /// `GpuFaultMark::cleared_by` says the reading came after it).
    SetGpuFault {
        node: String,
        mark: corral_types::GpuFaultMark,
        clear: bool,
    },
    /// `corral node lease NODE --until TIME` (`Some`) or `--clear` (`None`): the operator's lease
    /// end of a node, which wins over its worker's `lease-end` while set (`leases.rs`).
    /// A worker's part of run `epoch` of an image gang has its image ready: the gang starts once
    /// every part is (`Allocation::ready`).
    PartReady {
        job_id: JobId,
        epoch: u64,
        node: String,
    },
    /// The GPUs of a worker's part of run `epoch` of a session stayed idle past its idle timeout
    /// (`idle`), or were busy again after that (`Allocation::idle`).
    PartIdle {
        job_id: JobId,
        epoch: u64,
        node: String,
        idle: bool,
    },
    SetNodeLease {
        node: String,
        lease_end: Option<Timestamp>,
    },
    /// The lease of `node` nears its end: running jobs its class's grace reaches get their
    /// checkpoint signal and are requeued (`lease-ended`); at the lease end the node drains.
    /// Proposed by the leader; apply judges against the request's timestamp.
    EndLease {
        node: String,
    },
}

impl Command {
    /// The command's name, for logs (cheap: a submit's script is not formatted).
    pub fn name(&self) -> &'static str {
        match self {
            Command::SubmitJob { .. } => "SubmitJob",
            Command::SubmitJobs { .. } => "SubmitJobs",
            Command::PlaceJob { .. } => "PlaceJob",
            Command::JobStarted { .. } => "JobStarted",
            Command::JobFinished { .. } => "JobFinished",
            Command::CancelJob { .. } => "CancelJob",
            Command::PreemptJob { .. } => "PreemptJob",
            Command::Schedule { .. } => "Schedule",
            Command::RegisterNode { .. } => "RegisterNode",
            Command::SetNodeState { .. } => "SetNodeState",
            Command::Configure(_) => "Configure",
            Command::Noop => "Noop",
            Command::AddCoordinator { .. } => "AddCoordinator",
            Command::ExtendTso { .. } => "ExtendTso",
            Command::RemoveCoordinator { .. } => "RemoveCoordinator",
            Command::CreateToken { .. } => "CreateToken",
            Command::RevokeToken { .. } => "RevokeToken",
            Command::ApplyPolicy { .. } => "ApplyPolicy",
            Command::SetNodeMode { .. } => "SetNodeMode",
            Command::EvictDrainedJobs { .. } => "EvictDrainedJobs",
            Command::RemoveNode { .. } => "RemoveNode",
            Command::CreateJoinToken { .. } => "CreateJoinToken",
            Command::HoldJob { .. } => "HoldJob",
            Command::RequeueJob { .. } => "RequeueJob",
            Command::SignalJob { .. } => "SignalJob",
            Command::UpdateJob { .. } => "UpdateJob",
            Command::CancelArrayTask { .. } => "CancelArrayTask",
            Command::CancelJobs { .. } => "CancelJobs",
            Command::Compact(_) => "Compact",
            Command::ConsumeJoinToken { .. } => "ConsumeJoinToken",
            Command::CreateStep { .. } => "CreateStep",
            Command::StepEnded { .. } => "StepEnded",
            Command::SignalStep { .. } => "SignalStep",
            Command::RegisterRestartedNode { .. } => "RegisterRestartedNode",
            Command::SetGpuFault { .. } => "SetGpuFault",
            Command::PartReady { .. } => "PartReady",
            Command::PartIdle { .. } => "PartIdle",
            Command::SetNodeLease { .. } => "SetNodeLease",
            Command::EndLease { .. } => "EndLease",
        }
    }
}

/// What `corral update` changes in a pending job (`None`: unchanged).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobUpdate {
    pub time_limit_secs: Option<u64>,
    pub priority_class: Option<String>,
    pub gpus: Option<u32>,
    pub name: Option<String>,
}

/// A command with the TSO timestamp the leader stamped on it: the state machine's only clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub ts: Timestamp,
    pub command: Command,
}

/// What applying a command produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    JobSubmitted {
        job_id: JobId,
        duplicate: bool,
    },
    /// One result per job of a `SubmitJobs`, in order: (job id, duplicate) or why it was refused.
    JobsSubmitted(Vec<Result<(JobId, bool), ApplyError>>),
    Job(Box<Job>),
    NodeRegistered {
        epoch: u64,
    },
    /// A report for an older placement, or a change that was already made: ignored.
    Stale,
    Done,
    /// What a `Schedule` command did.
    Scheduled(ScheduleOutcome),
    TokenCreated {
        token_id: u64,
    },
    /// The policy version now in force, what changed (empty: nothing, no new version) and the
    /// jobs cancelled because their tenant or class was removed.
    PolicyApplied {
        version: u64,
        changes: Vec<String>,
        cancelled: Vec<JobId>,
    },
    JoinTokenCreated {
        token_id: u64,
    },
    /// The jobs a `CancelJobs` cancelled or asked to stop.
    JobsCancelled(Vec<JobId>),
    /// What a `Compact` moved out of the hot state.
    Compacted(Compacted),
    /// A join token admitted a worker (`duplicate`: the same worker and key asked again).
    JoinTokenConsumed {
        token_id: u64,
        duplicate: bool,
        /// The issue time (seconds since the Unix epoch) of the certificate the worker gets,
        /// judged at this entry (`State::worker_certificate_issue_s`): a later removal of the
        /// node revokes it, an earlier one does not.
        issued_at_s: u64,
    },
    /// The step a `CreateStep` made (`duplicate`: made by an earlier try of the same request).
    Step {
        step: Box<JobStep>,
        duplicate: bool,
    },
}

/// The parts of a `Schedule` command that were applied and the ones that were not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleOutcome {
    pub placed: Vec<JobId>,
    pub preempted: Vec<JobId>,
    /// Refused or stale decisions, with the reason (the next pass recomputes them).
    pub rejected: Vec<(JobId, String)>,
}

pub type Response = Result<Outcome, ApplyError>;

/// Why a command was refused. Messages are shown to users as they are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum ApplyError {
    #[error(transparent)]
    InvalidSpec(#[from] JobSpecError),
    #[error("unknown tenant '{tenant}' (known tenants: {known})")]
    UnknownTenant { tenant: String, known: String },
    #[error("unknown priority class '{class}' (known classes: {known})")]
    UnknownPriorityClass { class: String, known: String },
    #[error("job asks for {requested} gpus but the largest node has {largest}: it could never run")]
    TooManyGpus { requested: u32, largest: u32 },
    #[error("job asks for {requested} of memory but the largest node has {largest}: it could never run")]
    TooMuchMemory { requested: String, largest: String },
    #[error("job asks for {requested} cpus but the largest node has {largest}: it could never run")]
    TooManyCpus { requested: String, largest: String },
    #[error(
        "job asks for {nodes} nodes with {per_node} gpus each but {}: it could never run",
        match available { 0 => "no node has that many".to_string(), 1 => "only 1 node has that many".to_string(), n => format!("only {n} nodes have that many") }
    )]
    GangTooLarge { nodes: u32, per_node: u32, available: u32 },
    #[error("job asks for mig slice '{profile}' but no registered gpu supports it: use an mps slice such as mps:25")]
    NoMigGpu { profile: String },
    #[error("job asks for {requested} of gpu memory but the largest gpu has {largest}: it could never run")]
    SliceTooLarge { requested: String, largest: String },
    #[error("job {0} not found")]
    NoSuchJob(JobId),
    #[error("node '{0}' is not registered")]
    NoSuchNode(String),
    #[error("placement of job {job_id} rejected: {reason}")]
    PlacementRejected { job_id: JobId, reason: String },
    #[error("preemption of job {job_id} rejected: {reason}")]
    PreemptionRejected { job_id: JobId, reason: String },
    #[error("coordinator node id {0} was used before: node ids are never reused, pick a new one")]
    NodeIdReused(u64),
    #[error("invalid cluster config: {0}")]
    InvalidConfig(String),
    #[error("token {0} not found")]
    NoSuchToken(u64),
    #[error("invalid token: {0}")]
    InvalidToken(String),
    #[error("{0}")]
    PolicyStrandsJobs(String),
    /// `pending` jobs not started yet (see `State::pending_count_of`), `adding` more asked for
    /// (an array's tasks), `max` allowed.
    #[error("{}", too_many_pending(tenant, *pending, *adding, *max))]
    TooManyPendingJobs { tenant: String, pending: u64, adding: u64, max: u32 },
    #[error("job asks for a time limit of {requested} but class '{class}' allows at most {max} (max-time)")]
    TimeAboveClassMax { class: String, requested: String, max: String },
    #[error("{0}")]
    NodeNotRemovable(String),
    #[error("join refused: {0}")]
    JoinTokenRefused(String),
    #[error("invalid dependency: {0}")]
    InvalidDependency(String),
    #[error("{0}")]
    JobControl(String),
    #[error("node '{node}' has no gpu {gpu}")]
    NoSuchGpu { node: String, gpu: u32 },
}

/// The message of `ApplyError::TooManyPendingJobs`.
fn too_many_pending(tenant: &str, pending: u64, adding: u64, max: u32) -> String {
    if adding <= 1 {
        return format!(
            "tenant '{tenant}' has {pending} pending jobs, its limit (max-pending-jobs): wait for some to start or end"
        );
    }
    format!(
        "an array of {adding} tasks would give tenant '{tenant}' {} pending jobs, above its limit of {max} \
         (max-pending-jobs counts each task not started yet): wait for some to start or end, or submit a smaller array",
        pending + adding
    )
}
