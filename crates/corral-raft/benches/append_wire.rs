//! What the leader spends to put one AppendEntries of N entries on the wire for 2 followers.
//!
//! Each entry is a group-committed `SubmitJobs` of 8 jobs. Two paths per follower:
//! - `encode`: the entries as openraft hands them to the network, encoded into the gRPC
//!   request's bytes;
//! - `read+enc`: from the bytes the log store holds, as each replication stream reads them
//!   (the JSON wire's log reader decoded every command; the typed wire's shares the bytes), to
//!   the request's bytes.
//!
//! `typed` is the wire of `raft.proto` (`corral_raft::raft_wire`); `json` the encoding corral
//! used before it (each entry's command encoded, base64, the request as JSON, in a
//! `RaftMessage`), kept here as the baseline: it writes the bytes the JSON wire wrote (checked
//! against the JSON wire's own serialization while it was corral's).
//!
//! Run: `cargo bench -p corral-raft --bench append_wire`. Prints the median and the 90th
//! percentile of each path over `CORRAL_BENCH_ROUNDS` rounds (default 300).

use corral_core::{Command, Request};
use corral_raft::log_store::PayloadCodec;
use corral_raft::{codec, raft_wire, RaftRequest, TypeConfig};
use corral_types::{JobSpec, Timestamp};
use openraft::raft::AppendEntriesRequest;
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};
use prost::bytes::Bytes;
use prost::Message;
use std::time::{Duration, Instant};

/// The allocator of the `corral` binary.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const FOLLOWERS: usize = 2;

/// The encoding of AppendEntries before the typed wire.
mod json {
    use super::*;
    use serde::Serialize;

    /// A `RaftMessage` of the JSON wire.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RaftMessage {
        #[prost(bytes = "vec", tag = "1")]
        pub data: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub chunk: Vec<u8>,
    }

    /// An entry's payload as the JSON wire wrote it: the command's protobuf bytes in base64.
    struct Base64Command<'a>(&'a Request);

    impl Serialize for Base64Command<'_> {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_str(&base64(&codec::command_to_bytes(self.0)))
        }
    }

    #[derive(Serialize)]
    enum Payload<'a> {
        Normal(Base64Command<'a>),
    }

    #[derive(Serialize)]
    struct WireEntry<'a> {
        log_id: &'a LogId<u64>,
        payload: Payload<'a>,
    }

    #[derive(Serialize)]
    struct Wire<'a> {
        vote: &'a Vote<u64>,
        prev_log_id: &'a Option<LogId<u64>>,
        entries: Vec<Box<serde_json::value::RawValue>>,
        leader_commit: &'a Option<LogId<u64>>,
    }

    /// The request's bytes: each entry serialized once, then the request around them.
    pub fn encode(rpc: &AppendEntriesRequest<TypeConfig>, requests: &[Request]) -> Vec<u8> {
        let entries = rpc
            .entries
            .iter()
            .zip(requests)
            .map(|(e, r)| {
                let entry = WireEntry { log_id: &e.log_id, payload: Payload::Normal(Base64Command(r)) };
                serde_json::value::to_raw_value(&entry).expect("serialize")
            })
            .collect();
        let wire = Wire { vote: &rpc.vote, prev_log_id: &rpc.prev_log_id, entries, leader_commit: &rpc.leader_commit };
        RaftMessage { data: serde_json::to_vec(&wire).expect("serialize"), chunk: Vec::new() }.encode_to_vec()
    }

    fn base64(input: &[u8]) -> String {
        const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
        for chunk in input.chunks(3) {
            let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                out.push(if i <= chunk.len() { ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char } else { '=' });
            }
        }
        out
    }
}

fn request(i: u64) -> Request {
    let spec = |j: u64| JobSpec {
        name: format!("train-{i}-{j}"),
        tenant: "team-a".into(),
        priority_class: "normal".into(),
        gpus: 1,
        cpu_millis: 4000,
        memory_bytes: 32 << 30,
        time_limit_secs: Some(3600),
        command: vec!["python".into(), "train.py".into(), format!("--seed={j}")].into(),
        env: std::sync::Arc::new([("NCCL_DEBUG".to_string(), "INFO".to_string())].into()),
        ..Default::default()
    };
    let jobs = (0..8).map(|j| (format!("req-{i}-{j}"), spec(j))).collect();
    Request { ts: Timestamp::compose(1_700_000_000_000 + i, 0), command: Command::SubmitJobs { jobs } }
}

fn append(entries: Vec<Entry<TypeConfig>>) -> AppendEntriesRequest<TypeConfig> {
    AppendEntriesRequest {
        vote: Vote::new_committed(3, 1),
        prev_log_id: Some(LogId::new(CommittedLeaderId::new(3, 1), 99)),
        entries,
        leader_commit: Some(LogId::new(CommittedLeaderId::new(3, 1), 99)),
    }
}

/// Median and 90th percentile of `f` over `rounds` rounds, after a few to warm up.
fn measure(rounds: usize, mut f: impl FnMut() -> usize) -> (Duration, Duration, usize) {
    let mut bytes = 0;
    for _ in 0..rounds / 10 + 1 {
        bytes = std::hint::black_box(f());
    }
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let started = Instant::now();
            std::hint::black_box(f());
            started.elapsed()
        })
        .collect();
    times.sort();
    (times[rounds / 2], times[rounds * 9 / 10], bytes)
}

fn main() {
    let rounds: usize = std::env::var("CORRAL_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    println!("{:>7} {:>14} {:>12} {:>12} {:>12}", "entries", "path", "median", "p90", "bytes/follower");
    for n in [1u64, 16, 256] {
        let requests: Vec<Request> = (0..n).map(request).collect();
        let stored: Vec<Bytes> = requests.iter().map(|r| Bytes::from(codec::command_to_bytes(r))).collect();
        let entries = |payload: &dyn Fn(usize) -> RaftRequest| -> Vec<Entry<TypeConfig>> {
            (0..requests.len())
                .map(|i| Entry {
                    log_id: LogId::new(CommittedLeaderId::new(3, 1), 100 + i as u64),
                    payload: EntryPayload::Normal(payload(i)),
                })
                .collect()
        };
        let rpc = append(entries(&|i| RaftRequest::new(requests[i].clone())));
        let typed =
            |rpc: &AppendEntriesRequest<TypeConfig>| raft_wire::append_request_to_pb(rpc, usize::MAX).0.encode_to_vec();
        let report = |path: &str, (median, p90, bytes): (Duration, Duration, usize)| {
            println!(
                "{n:>7} {path:>14} {:>10.1}us {:>10.1}us {bytes:>12}",
                median.as_secs_f64() * 1e6,
                p90.as_secs_f64() * 1e6
            );
        };
        report(
            "typed encode",
            measure(rounds, || (0..FOLLOWERS).map(|_| typed(&rpc).len()).sum::<usize>() / FOLLOWERS),
        );
        report(
            "typed read+enc",
            measure(rounds, || {
                let per_follower = || {
                    typed(&append(entries(&|i| {
                        RaftRequest::decode_payload(stored[i].clone()).expect("as the log store reads it")
                    })))
                    .len()
                };
                (0..FOLLOWERS).map(|_| per_follower()).sum::<usize>() / FOLLOWERS
            }),
        );
        report(
            "json encode",
            measure(rounds, || (0..FOLLOWERS).map(|_| json::encode(&rpc, &requests).len()).sum::<usize>() / FOLLOWERS),
        );
        report(
            "json read+enc",
            measure(rounds, || {
                let per_follower = || {
                    let decoded: Vec<Request> =
                        stored.iter().map(|b| codec::command_from_bytes(b).expect("decodes")).collect();
                    json::encode(&rpc, &decoded).len()
                };
                (0..FOLLOWERS).map(|_| per_follower()).sum::<usize>() / FOLLOWERS
            }),
        );
    }
}
