//! Commands carried by the Raft log and the state machine's responses.

use crate::ClusterConfig;
use corral_types::{Job, JobExitReport, JobId, JobSpec, JobSpecError, NodeSpec, NodeState, Timestamp};
use serde::{Deserialize, Serialize};

/// Version of the persisted command and snapshot encoding.
pub const FORMAT_VERSION: u32 = 1;

/// One replicated change.
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
    JobFinished {
        job_id: JobId,
        epoch: u64,
        report: JobExitReport,
    },
    CancelJob {
        job_id: JobId,
        reason: String,
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
    #[error("job {0} not found")]
    NoSuchJob(JobId),
    #[error("node '{0}' is not registered")]
    NoSuchNode(String),
    #[error("placement of job {job_id} rejected: {reason}")]
    PlacementRejected { job_id: JobId, reason: String },
    #[error("coordinator node id {0} was used before: node ids are never reused, pick a new one")]
    NodeIdReused(u64),
    #[error("invalid cluster config: {0}")]
    InvalidConfig(String),
}
