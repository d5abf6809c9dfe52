//! corral's wire protocol: generated gRPC/protobuf code (`corral.v1`: user API, worker protocol,
//! cluster admin; `corral.raft.v1`: Raft RPCs) and its conversions to and from corral-types
//! (`wire`), used by both ends of every connection.
//!
//! Boundary: depends on corral-types only, so a client does not compile the scheduler; how the
//! state is stored is corral-raft's (`corral_raft::codec`). prost types stop here and in
//! corral-raft (that codec, and its Raft wire over `corral.raft.v1`); every other crate speaks
//! corral-types. Conversions from the wire are fallible (`ProtoError`): a peer can send
//! anything. Servers list their services for reflection through `reflection` (the one setup of
//! coordinators and worker agents).

mod reflection;
mod wire;

pub use reflection::{reflection_services, ReflectionError};
pub use wire::{job_state_from_i32, ProtoError};

/// Metadata key of a `NotLeader` refusal that carries the leader's API address, so that a client
/// can redirect.
pub const LEADER_ADDR_METADATA: &str = "corral-leader-addr";

/// Metadata key of a RESOURCE_EXHAUSTED refusal of a full submit queue: how many milliseconds
/// the client should wait before it retries (with the same request ids).
pub const RETRY_AFTER_METADATA: &str = "retry-after-ms";

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

/// The encoded file descriptor set of corral.proto and raft.proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("corral_descriptor");

/// Largest gRPC message between coordinators (Raft: batches of entries, snapshot chunks) and
/// between coordinators and workers (heartbeat replies list every job placed on a node).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Largest message of the user API (a `SubmitBatch` of 10,000 ordinary jobs fits).
pub const MAX_USER_MESSAGE_BYTES: usize = 16 << 20;

/// Largest message of cluster admin calls and of the worker agent's log stream (64 KiB chunks).
pub const MAX_SMALL_MESSAGE_BYTES: usize = 4 << 20;
