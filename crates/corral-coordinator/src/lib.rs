//! corral coordinator: gRPC API, worker gateway, leader scheduling loop and worker liveness.
//!
//! Boundary: talks to Raft only through `corral_raft::RaftNode`; every state change is a
//! `corral_core::Command` proposed through Raft. Heartbeats and GPU health stay in the leader's
//! memory; only state changes (node down, registrations) go through the log.
//!
//! The `Coordinator` handle (`coordinator.rs`) keeps its parts private; the modules below
//! reach them through its methods, and a request handler reads through a `Snapshot`.

// The handle, its server and the leader's loops.
mod autoscale;
mod compaction;
mod coordinator;
mod scheduler;
mod server;
mod serving;
mod tso;
// Client-facing: the user API and what it serves with (submits, listings, watches, replies,
// the logs proxy), the web view.
mod api;
mod client_work;
mod filter;
mod group_commit;
mod images;
mod leader_writes;
mod listing;
mod log_proxy;
mod reply;
mod snapshot;
mod watch;
mod web;
// Worker-facing: the gateway, the desired-state streams, joining, the leader's view of workers.
mod desired;
mod gateway;
mod join;
mod liveness;
mod pulls;
// The cluster's members, and what every service shares.
mod auth;
mod cluster;
mod config;
mod error;
mod failpoints;
mod grpc_health;
mod metrics;
pub mod policy;
#[cfg(test)]
mod testing;

pub use api::LIST_JOBS_DELAY_FAILPOINT;
pub use auth::{token_sha256, SecurityConfig};
pub use autoscale::{AutoscaleConfig, AutoscaleSection, DeclaredNodes};
pub use client_work::DEFAULT_MAX_CLIENT_REQUESTS;
pub use compaction::HistoryConfig;
pub use config::{
    AuthSection, CoordinatorFile, HistorySection, ImagesSection, LimitsSection, RaftSection, Retention,
    SchedulerSection, TlsSection,
};
pub use coordinator::{Coordinator, CoordinatorConfig, MAX_RAFT_WAIT, STRANDED_PROPOSAL_FAILPOINT};
pub use error::CoordError;
pub use group_commit::{DEFAULT_MAX_QUEUED_SUBMITS, GROUP_COMMIT_DELAY_FAILPOINT};
pub use tso::{CLOCK_SKEW_FAILPOINT, MAX_COUNT as MAX_TIMESTAMPS_PER_CALL};
pub use web::{WebRequest, WebResponse};
