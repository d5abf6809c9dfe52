//! openraft type configuration of corral and the log payload wrapper.

use corral_core::Request;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::io::Cursor;

openraft::declare_raft_types!(
    /// Raft types of the corral coordinator cluster.
    pub TypeConfig:
        D = RaftRequest,
        R = corral_core::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type NodeId = u64;
pub type Raft = openraft::Raft<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;

/// The application payload of a log entry: a TSO-stamped command, stored and sent as protobuf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaftRequest(pub Request);

impl fmt::Display for RaftRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}@{}", std::mem::discriminant(&self.0.command), self.0.ts)
    }
}

impl Serialize for RaftRequest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&corral_proto::command_to_bytes(&self.0))
    }
}

impl<'de> Deserialize<'de> for RaftRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BytesVisitor;
        impl<'de> serde::de::Visitor<'de> for BytesVisitor {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("protobuf-encoded command bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        let bytes = deserializer.deserialize_bytes(BytesVisitor)?;
        corral_proto::command_from_bytes(&bytes).map(RaftRequest).map_err(serde::de::Error::custom)
    }
}

impl crate::log_store::PayloadCodec for RaftRequest {
    fn encode_payload(&self) -> Vec<u8> {
        corral_proto::command_to_bytes(&self.0)
    }

    fn decode_payload(bytes: &[u8]) -> Result<Self, std::io::Error> {
        corral_proto::command_from_bytes(bytes)
            .map(RaftRequest)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }
}
