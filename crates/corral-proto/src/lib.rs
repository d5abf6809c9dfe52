//! Generated gRPC/protobuf code for corral: the wire protocol (`corral.v1`: user API, worker
//! protocol, cluster admin; `corral.raft.v1`: Raft RPCs) and its conversions to and from
//! corral-types (`wire`); for now also the persisted encoding (`corral.state.v1`, `codec`).
//!
//! Boundary: prost types stop here and in the persistence codec of corral-raft; every other crate
//! speaks corral-types. Conversions from the wire are fallible (`ProtoError`): a peer can send
//! anything.

mod codec;
pub mod fuzz;
mod wire;

pub use codec::{
    command_from_bytes, command_to_bytes, job_from_bytes, job_to_bytes, meta_from_bytes, meta_to_bytes,
    node_from_bytes, node_to_bytes, segment_from_bytes, segment_to_bytes, snapshot_from_bytes, snapshot_to_bytes,
    CodecError, StateMeta,
};
pub use wire::ProtoError;

/// Metadata key of a `NotLeader` refusal that carries the leader's API address, so that a client
/// can redirect.
pub const LEADER_ADDR_METADATA: &str = "corral-leader-addr";

/// Generated code of package `corral.v1` (user API, worker protocol, cluster admin).
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("corral.v1");
}

/// Generated code of package `corral.raft.v1` (Raft RPCs between coordinators).
pub mod raft {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("corral.raft.v1");
}

/// Generated code of package `corral.state.v1` (the persisted state).
mod state {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("corral.state.v1");
}

/// Largest gRPC message between coordinators (Raft: batches of entries, snapshot chunks) and
/// between coordinators and workers (heartbeat replies list every job placed on a node).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Largest message of the user API (a `SubmitBatch` of 10,000 ordinary jobs fits).
pub const MAX_USER_MESSAGE_BYTES: usize = 16 << 20;

/// Largest message of cluster admin calls and of the worker agent's log stream (64 KiB chunks).
pub const MAX_SMALL_MESSAGE_BYTES: usize = 4 << 20;
