//! Domain types shared by every corral crate: ids, resources, job specs and states, Slurm's
//! allocation layout, TSO timestamps, billing ledger segments, job steps, Slurm's hostlists.
//!
//! Boundary: serde + thiserror only. Nothing here does I/O or reads a clock.

mod billing;
mod container;
pub mod hostlist;
mod job;
mod job_options;
mod layout;
mod node;
mod output_pattern;
mod parse;
mod slurm_env;
mod step;
mod timestamp;

pub use billing::{EndCause, Segment};
pub use container::{ContainerMount, ContainerOptions, MAX_CONTAINER_ENV, MAX_CONTAINER_MOUNTS};
pub use job::{
    Allocation, ArrayLimits, ArrayProgress, ArrayRange, ArraySpec, ArrayTask, Dependency, DependencyKind, GpuSlice,
    Job, JobExitReport, JobId, JobRef, JobSpec, JobSpecError, JobState, NodeGpus, PartEnd, PreemptionNotice,
    PriceBreak, SchedOptions, SessionOptions, SliceAssignment, DEFAULT_ARRAY_WINDOW, DEFAULT_IDLE_TIMEOUT_SECS,
    DEFAULT_MIN_GPU_UTIL_PCT, DRAIN_PREEMPTOR, LEASE_PREEMPTOR, MAX_ARGS, MAX_ARRAY_RANGES, MAX_ARRAY_TASKS,
    MAX_ARRAY_WINDOW, MAX_COMMAND_BYTES, MAX_ENV_BYTES, MAX_ENV_VARS, MAX_GPUS_PER_JOB, MAX_SCRIPT_BYTES,
    MAX_SPREAD_SHAPES, REQUEUE_PREEMPTOR,
};
pub use job_options::parse_dependencies;
pub use layout::{gpu_type_matches, SlurmNames, SubmittedShape, TaskLayout, MAX_NODES_PER_JOB, MAX_TASKS_PER_JOB};
pub use node::{
    GpuDevice, GpuFaultMark, GpuHealth, NodeMode, NodeSpec, NodeState, NodeStatus, DEFAULT_RENDEZVOUS_PORTS,
};
pub use output_pattern::{default_output_pattern, expand_output_pattern, OutputPlace, NO_ARRAY_INDEX};
pub use parse::{
    describe_config_error, format_duration, format_size, parse_duration, parse_size, ConfigDuration, ConfigSize,
    ParseError,
};
pub use slurm_env::{slurm_allocation_env, tasks_per_node_string};
pub use step::{
    JobStep, JobSteps, StepId, StepNode, StepNodeEnd, StepRef, StepSpec, StepState, TaskExit, MAX_KEPT_STEPS,
    MAX_LIVE_STEPS, MAX_STEP_NODELIST, MAX_STEP_SIGNALS, MAX_STEP_SPEC_BYTES, MAX_STEP_TASKS,
};
pub use timestamp::{format_utc, parse_utc, Timestamp};
