//! openraft glue for corral: type config, raft-log log store, state machine (its history in
//! redb), gRPC network and its typed wire (`raft_wire`, over `proto/raft.proto`), the election
//! timer with its pre-vote (`election`), and the
//! persisted encoding of the replicated state (`codec`, over `proto/state.proto`).
//!
//! Boundary: the only crate that knows openraft, raft-log, redb and sled (read once, to move an
//! earlier version's history into redb), and the only one that knows how the state is stored
//! (the format version included). Other crates reach Raft through
//! [`RaftNode`] (propose, linearizable reads, membership, status, shutdown) and read the applied
//! state through [`StateMachineData`]; no openraft type crosses this boundary.

mod change_log;
pub mod codec;
mod election;
pub mod fuzz;
mod history;
pub mod log_store;
mod network;
mod node;
pub mod raft_wire;
mod request_ids;
mod snapshot_store;
mod state_machine;
mod types;

pub use change_log::{ChangeLog, ChangeWindow, Compacted, DEFAULT_CHANGE_LOG_CAPACITY};
pub use node::{LeaderHealth, Leadership, Member, RaftError, RaftNode, RaftNodeConfig, RaftStatus, Role};
pub use state_machine::{StateMachineData, StateMachineStore, StateRead};
pub use types::{NodeId, RaftRequest, TypeConfig};
