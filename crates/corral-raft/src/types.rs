//! openraft type configuration of corral and the log payload wrapper.

use crate::codec::{self, CodecError};
use corral_core::Request;
use prost::bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::sync::{Arc, OnceLock};

openraft::declare_raft_types!(
    /// Raft types of the corral coordinator cluster.
    pub TypeConfig:
        D = RaftRequest,
        R = corral_core::Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = crate::snapshot_store::SnapshotFile,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type NodeId = u64;
pub type Raft = openraft::Raft<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;

/// The application payload of a log entry: a TSO-stamped command, as the bytes the log stores
/// for it (`codec::command_to_bytes`, encoded once, when it is proposed) and the command they
/// decode to (decoded when first needed: to apply it, or to check an entry a follower
/// receives). Clones share both, so the leader's replication streams send every follower the
/// same bytes, and an entry read from the log only to be sent is never decoded.
#[derive(Clone)]
pub struct RaftRequest {
    bytes: Bytes,
    request: Arc<OnceLock<Request>>,
}

impl RaftRequest {
    /// A request to propose, encoded once.
    pub fn new(request: Request) -> RaftRequest {
        let bytes = Bytes::from(codec::command_to_bytes(&request));
        RaftRequest { bytes, request: Arc::new(OnceLock::from(request)) }
    }

    /// The request the log stored as `bytes` (which it checksums), decoded when first needed.
    pub(crate) fn stored(bytes: Bytes) -> RaftRequest {
        RaftRequest { bytes, request: Arc::new(OnceLock::new()) }
    }

    /// The request a peer sent as `bytes`, decoded now: bytes that do not decode are refused.
    pub fn received(bytes: Bytes) -> Result<RaftRequest, CodecError> {
        let request = codec::command_from_bytes(&bytes)?;
        Ok(RaftRequest { bytes, request: Arc::new(OnceLock::from(request)) })
    }

    /// The bytes the log stores, and the wire carries, for this request.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The request, decoded on first use.
    pub fn request(&self) -> Result<&Request, CodecError> {
        if let Some(request) = self.request.get() {
            return Ok(request);
        }
        let request = codec::command_from_bytes(&self.bytes)?;
        Ok(self.request.get_or_init(|| request))
    }
}

/// Equal bytes, equal requests: the encoding is deterministic.
impl PartialEq for RaftRequest {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for RaftRequest {}

impl fmt::Debug for RaftRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.request.get() {
            Some(request) => f.debug_tuple("RaftRequest").field(request).finish(),
            None => write!(f, "RaftRequest({} bytes, not decoded)", self.bytes.len()),
        }
    }
}

impl fmt::Display for RaftRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.request.get() {
            Some(request) => write!(f, "{:?}@{}", std::mem::discriminant(&request.command), request.ts),
            None => write!(f, "command of {} bytes", self.bytes.len()),
        }
    }
}

/// openraft asks its payloads for serde; corral never serializes one (the log stores, and the
/// wire carries, [`RaftRequest::bytes`]). Written as those bytes.
impl Serialize for RaftRequest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.bytes)
    }
}

impl<'de> Deserialize<'de> for RaftRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let bytes = serde_bytes_like::deserialize(deserializer)?;
        RaftRequest::received(Bytes::from(bytes)).map_err(serde::de::Error::custom)
    }
}

/// Bytes from a serde format: as bytes, or as a sequence of numbers (JSON).
mod serde_bytes_like {
    use serde::Deserializer;
    use std::fmt;

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
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
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        deserializer.deserialize_bytes(BytesVisitor)
    }
}

impl crate::log_store::PayloadCodec for RaftRequest {
    fn encode_payload(&self) -> Bytes {
        self.bytes.clone()
    }

    fn decode_payload(bytes: Bytes) -> Result<Self, std::io::Error> {
        Ok(RaftRequest::stored(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::{Command, Request};
    use corral_types::Timestamp;

    /// A proposed request carries its encoding; a stored one decodes when asked, once; bytes
    /// that do not decode are refused on receipt and reported when a stored one is asked for.
    #[test]
    fn a_request_is_encoded_once_and_decoded_when_needed() {
        let request = Request { ts: Timestamp(42), command: Command::CancelJob { job_id: 7, reason: "r".into() } };
        let proposed = RaftRequest::new(request.clone());
        assert_eq!(proposed.bytes().as_ref(), codec::command_to_bytes(&request).as_slice());
        let stored = RaftRequest::stored(proposed.bytes().clone());
        assert_eq!(stored.bytes().as_ptr(), proposed.bytes().as_ptr(), "the bytes are shared, not copied");
        assert!(format!("{stored:?}").contains("not decoded"));
        assert_eq!(stored.request().expect("decodes"), &request);
        assert!(std::ptr::eq(stored.request().expect("decoded"), stored.clone().request().expect("decoded")));
        assert_eq!(stored, proposed);
        assert!(RaftRequest::received(Bytes::from_static(&[0xff, 0xff])).is_err());
        assert!(RaftRequest::stored(Bytes::from_static(&[0xff, 0xff])).request().is_err());
        // serde (which openraft asks for) writes the bytes and reads them back.
        let json = serde_json::to_vec(&proposed).expect("serialize");
        assert_eq!(serde_json::from_slice::<RaftRequest>(&json).expect("deserialize"), proposed);
    }
}
