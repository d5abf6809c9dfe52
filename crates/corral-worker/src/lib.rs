//! corral worker daemon: GPU backends, job executors in cgroups and containers, the reconciler
//! and its runtime, the fence guard, heartbeats, GPU health and post-job hygiene, log files.
//!
//! Boundary: talks to coordinators only through `corral_client::GatewayClient` (the link);
//! hardware behind `gpu::GpuBackend`, process isolation behind `executor::Executor`; every
//! decision about jobs in `reconcile` (pure), the runtime's own (lease, registration) in its
//! pure book-keeping, every effect in `runtime`. The state its tasks share has owners: the job
//! table (`jobs`), the devices (`devices`), the link to the leader (`link`).

mod agent;
mod agent_attach;
mod agent_images;
mod build;
mod devices;
pub mod executor;
pub mod fence;
mod gang;
pub mod gpu;
mod grpc_health;
pub mod health;
pub mod hygiene;
pub mod in_job;
pub mod in_job_bin;
mod jobs;
pub mod join;
mod launch;
mod link;
mod metrics;
#[cfg(test)]
mod module_graph;
pub mod mps;
pub mod preflight;
pub mod reconcile;
mod renew;
mod runtime;
mod worker;
pub mod xid;

pub mod config;
pub use build::BuildOptions;
pub use config::{infiniband_devices, JobUser, UserMapping, WorkerConfig, WorkerFile, DEFAULT_PIDS_MAX};
pub use fence::{run_guard, GuardCommand};
pub use gang::PartAddrs;
pub use in_job_bin::IN_JOB_COMMANDS;
pub use join::JoinOptions;
pub use metrics::WorkerMetrics;
pub use worker::Worker;
