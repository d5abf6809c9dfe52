//! Jobs: what a user asks for (`JobSpec`), where it runs (`Allocation`) and its lifecycle (`JobState`).

use crate::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Cluster-wide job id, assigned by the replicated state machine in submit order.
pub type JobId = u64;

/// Upper bound on whole GPUs one job may ask for.
pub const MAX_GPUS_PER_JOB: u32 = 1024;

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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// OCI rootfs to run the command in; `None` runs a bare process.
    pub image: Option<String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
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
    /// Checks what can be checked without cluster state.
    pub fn validate(&self) -> Result<(), JobSpecError> {
        if self.command.is_empty() || self.command[0].trim().is_empty() {
            return Err(JobSpecError::EmptyCommand);
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
        if self.name.len() > 256 {
            return Err(JobSpecError::Invalid { field: "name".into(), reason: "longer than 256 bytes".into() });
        }
        if self.time_limit_secs == Some(0) {
            return Err(JobSpecError::Invalid { field: "time".into(), reason: "must be greater than zero".into() });
        }
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
}

/// Lifecycle of a job. `Pending` and `Running` are live; the rest are terminal except
/// `Preempted`, which is requeued as `Pending` by the scheduler.
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
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a running job was placed. `epoch` is unique per placement: worker reports carry it and
/// the state machine ignores reports of an older placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub node: String,
    pub gpus: Vec<u32>,
    pub epoch: u64,
}

/// What a worker reports when a job's process tree is gone.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobExitReport {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub oom_killed: bool,
    /// Monotonic run time measured by the worker, a cross-check of the TSO timestamps.
    pub run_time_ms: u64,
    /// The worker killed the job at its time limit.
    pub timed_out: bool,
    /// Set when the worker could not start the job at all.
    pub launch_error: Option<String>,
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
            command: vec!["true".into()],
            env: BTreeMap::new(),
        }
    }

    #[test]
    fn validate_rejects_bad_specs() {
        assert_eq!(spec().validate(), Ok(()));
        let mut s = spec();
        s.command.clear();
        assert_eq!(s.validate(), Err(JobSpecError::EmptyCommand));
        let mut s = spec();
        s.command = vec!["  ".into()];
        assert_eq!(s.validate(), Err(JobSpecError::EmptyCommand));
        let mut s = spec();
        s.gpu_slice = Some(GpuSlice::parse("mps:50").unwrap());
        assert_eq!(s.validate(), Err(JobSpecError::GpusAndSlice));
        let mut s = spec();
        s.gpus = 5000;
        assert!(matches!(s.validate(), Err(JobSpecError::TooManyGpus { .. })));
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
        assert!(!JobState::Preempted.is_terminal());
    }
}
