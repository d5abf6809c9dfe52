//! openraft glue for corral: type config, raft-log log store, sled state machine, gRPC network.
//!
//! Boundary: the only crate that knows openraft, raft-log and sled. Other crates reach Raft
//! through [`RaftNode`] (propose, linearizable reads, membership, status, shutdown) and read
//! the applied state through [`StateMachineData`]; no openraft type crosses this boundary.

pub mod log_store;
mod network;
mod node;
mod state_machine;
mod types;

pub use node::{Leadership, Member, RaftError, RaftNode, RaftNodeConfig, RaftStatus, Role};
pub use state_machine::{StateMachineData, StateMachineStore};
pub use types::{NodeId, RaftRequest, TypeConfig};
