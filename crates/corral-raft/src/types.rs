//! openraft type configuration of corral and the log payload wrapper.

use crate::codec;
use corral_core::Request;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

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
        let bytes = codec::command_to_bytes(&self.0);
        if serializer.is_human_readable() {
            // JSON would spell bytes as an array of numbers (~3.5x); base64 is 1.33x.
            serializer.serialize_str(&base64::encode(&bytes))
        } else {
            serializer.serialize_bytes(&bytes)
        }
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
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Vec<u8>, E> {
                base64::decode(v).map_err(E::custom)
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
        let bytes = if deserializer.is_human_readable() {
            deserializer.deserialize_any(BytesVisitor)?
        } else {
            deserializer.deserialize_bytes(BytesVisitor)?
        };
        codec::command_from_bytes(&bytes).map(RaftRequest).map_err(serde::de::Error::custom)
    }
}

impl crate::log_store::PayloadCodec for RaftRequest {
    fn encode_payload(&self) -> Vec<u8> {
        codec::command_to_bytes(&self.0)
    }

    fn decode_payload(bytes: &[u8]) -> Result<Self, std::io::Error> {
        codec::command_from_bytes(bytes)
            .map(RaftRequest)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }
}

/// Standard base64 (RFC 4648, padded), for command bytes inside JSON Raft messages.
mod base64 {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    pub fn encode(input: &[u8]) -> String {
        let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
        for chunk in input.chunks(3) {
            let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    pub fn decode(input: &str) -> Result<Vec<u8>, String> {
        let bytes = input.as_bytes();
        if !bytes.len().is_multiple_of(4) {
            return Err("base64 length is not a multiple of 4".into());
        }
        let value = |c: u8| -> Result<u32, String> {
            match c {
                b'A'..=b'Z' => Ok(u32::from(c - b'A')),
                b'a'..=b'z' => Ok(u32::from(c - b'a') + 26),
                b'0'..=b'9' => Ok(u32::from(c - b'0') + 52),
                b'+' => Ok(62),
                b'/' => Ok(63),
                _ => Err(format!("invalid base64 byte {c:#x}")),
            }
        };
        let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
        for (i, quad) in bytes.chunks(4).enumerate() {
            let last = i + 1 == bytes.len() / 4;
            let pad = quad.iter().rev().take_while(|c| **c == b'=').count();
            if pad > 2 || (pad > 0 && !last) {
                return Err("misplaced base64 padding".into());
            }
            let mut n = 0u32;
            for (j, c) in quad.iter().enumerate() {
                n <<= 6;
                if j < 4 - pad {
                    n |= value(*c)?;
                }
            }
            out.push((n >> 16) as u8);
            if pad < 2 {
                out.push((n >> 8) as u8);
            }
            if pad < 1 {
                out.push(n as u8);
            }
        }
        Ok(out)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn round_trips_every_length() {
            for len in 0..64usize {
                let data: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
                assert_eq!(super::decode(&super::encode(&data)).unwrap(), data, "len {len}");
            }
            assert_eq!(super::encode(b"foobar"), "Zm9vYmFy");
            assert_eq!(super::encode(b"fo"), "Zm8=");
            assert!(super::decode("Zm9").is_err());
            assert!(super::decode("Zm=v").is_err());
            assert!(super::decode("Z!9v").is_err());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::{Command, Request};
    use corral_types::Timestamp;

    #[test]
    fn requests_survive_json_as_base64() {
        let request = RaftRequest(Request { ts: Timestamp(42), command: Command::Noop });
        let json = serde_json::to_string(&request).unwrap();
        assert!(json.starts_with('"'), "a string, not an array of numbers: {json}");
        let back: RaftRequest = serde_json::from_str(&json).unwrap();
        assert_eq!(back, request);
        // Older messages spelled the bytes as an array: still readable.
        let bytes = codec::command_to_bytes(&request.0);
        let legacy = serde_json::to_string(&bytes).unwrap();
        assert_eq!(serde_json::from_str::<RaftRequest>(&legacy).unwrap(), request);
    }
}
