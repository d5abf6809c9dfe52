//! corral worker daemon: GPU backends, job executors in cgroups, heartbeats, log files.
//!
//! Boundary: talks to coordinators only through `corral_client::GatewayClient`; hardware
//! behind `gpu::GpuBackend`, process isolation behind `executor::Executor`.

mod agent;
pub mod executor;
pub mod gpu;
mod worker;

pub use worker::{Worker, WorkerConfig};
