//! openraft glue for corral: type config, raft-log log store, sled state machine, gRPC network.
//!
//! Boundary: the only crate that knows openraft, raft-log and sled.

pub mod log_store;
pub mod network;
pub mod node;
pub mod state_machine;
pub mod types;

pub use network::{GrpcNetworkFactory, RaftGrpcService};
pub use node::{RaftNode, RaftNodeConfig};
pub use state_machine::{StateMachineData, StateMachineStore};
pub use types::{NodeId, Raft, RaftRequest, TypeConfig};
