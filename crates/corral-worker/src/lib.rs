//! corral worker daemon: GPU backends, job executors in cgroups and containers, heartbeats,
//! GPU health and post-job hygiene, log files.
//!
//! Boundary: talks to coordinators only through `corral_client::GatewayClient`; hardware
//! behind `gpu::GpuBackend`, process isolation behind `executor::Executor`.

mod agent;
pub mod executor;
pub mod gpu;
pub mod health;
pub mod hygiene;
mod metrics;
pub mod mps;
mod worker;

pub use metrics::WorkerMetrics;
pub use worker::{infiniband_devices, JobUser, UserMapping, Worker, WorkerConfig, DEFAULT_PIDS_MAX};
