//! Golden bytes of the Raft wire (`raft.proto`, `corral_raft::raft_wire`): an AppendEntries
//! request with a blank, a command and a membership entry, its replies, a vote request and its
//! reply, a pre-vote request and its reply, a snapshot chunk and its replies. Coordinators of one wire version must read each
//! other's bytes: every message decodes to the values below, and they encode to the very same
//! bytes.
//!
//! The command entry carries `tests/golden/command-submit-job.bin` as it is: the wire sends the
//! bytes the log stores. A missing file is written when `CORRAL_WRITE_GOLDEN=1` is set (for a new
//! message); an existing file is never rewritten.

// The values checked are openraft's replies: Results, with its large errors.
#![allow(clippy::result_large_err)]

use corral_proto::raft as pb;
use corral_raft::raft_wire::{self, WIRE_VERSION};
use corral_raft::{RaftRequest, TypeConfig};
use openraft::error::{Fatal, InstallSnapshotError, RaftError, SnapshotMismatch};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{
    BasicNode, CommittedLeaderId, Entry, EntryPayload, LogId, Membership, SnapshotMeta, SnapshotSegmentId,
    StoredMembership, Vote,
};
use prost::bytes::Bytes;
use prost::Message;
use std::fmt::Debug;
use std::path::PathBuf;

/// The bytes of `tests/golden/<name>.bin`; a missing file is written from `write` only when
/// `CORRAL_WRITE_GOLDEN` is set.
fn golden(name: &str, write: impl FnOnce() -> Vec<u8>) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(format!("{name}.bin"));
    if !path.exists() && std::env::var_os("CORRAL_WRITE_GOLDEN").is_some() {
        std::fs::write(&path, write()).expect("write a golden file");
    }
    std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Checks one golden message: `value` encodes to its bytes, and they decode to `value`.
fn check<T, M>(name: &str, value: &T, encode: impl Fn(&T) -> M, decode: impl Fn(M) -> T)
where
    T: PartialEq + Debug,
    M: Message + Default,
{
    let bytes = golden(name, || encode(value).encode_to_vec());
    assert!(encode(value).encode_to_vec() == bytes, "{name} no longer encodes to its golden bytes");
    let message = M::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("golden {name} no longer decodes: {e}"));
    assert_eq!(&decode(message), value, "golden {name} decodes to another value");
}

fn log_id(term: u64, node: u64, index: u64) -> LogId<u64> {
    LogId::new(CommittedLeaderId::new(term, node), index)
}

fn membership() -> Membership<u64, BasicNode> {
    let nodes = [(1, "10.0.0.1:7100"), (2, "10.0.0.2:7100"), (3, "10.0.0.3:7100"), (4, "10.0.0.4:7100")];
    let nodes: std::collections::BTreeMap<u64, BasicNode> =
        nodes.into_iter().map(|(id, addr)| (id, BasicNode { addr: addr.into() })).collect();
    Membership::new(vec![[1, 2, 3].into()], nodes)
}

fn command_bytes() -> Bytes {
    Bytes::from(golden("command-submit-job", || unreachable!("the stored golden command exists")))
}

/// The fields of an AppendEntries request (openraft's type has no `PartialEq`).
type AppendFields = (Vote<u64>, Option<LogId<u64>>, Vec<Entry<TypeConfig>>, Option<LogId<u64>>);

fn append_fields(r: AppendEntriesRequest<TypeConfig>) -> AppendFields {
    (r.vote, r.prev_log_id, r.entries, r.leader_commit)
}

#[test]
fn an_append_entries_request_keeps_its_bytes() {
    let command = RaftRequest::received(command_bytes()).expect("the golden command decodes");
    let entries = vec![
        Entry { log_id: log_id(3, 1, 10), payload: EntryPayload::Blank },
        Entry { log_id: log_id(3, 1, 11), payload: EntryPayload::Normal(command) },
        Entry { log_id: log_id(3, 1, 12), payload: EntryPayload::Membership(membership()) },
    ];
    let request: AppendFields = (Vote::new_committed(3, 1), Some(log_id(2, 1, 9)), entries, Some(log_id(3, 1, 11)));
    let encode = |(vote, prev_log_id, entries, leader_commit): &AppendFields| {
        let rpc = AppendEntriesRequest::<TypeConfig> {
            vote: *vote,
            prev_log_id: *prev_log_id,
            entries: entries.clone(),
            leader_commit: *leader_commit,
        };
        raft_wire::append_request_to_pb(&rpc, usize::MAX).0
    };
    let decode = |m| append_fields(raft_wire::append_request_from_pb(m).expect("converts"));
    check("wire-append-entries", &request, encode, decode);
    // The command entry is the stored bytes, as they are.
    let sent = pb::AppendEntriesRequest::decode(golden("wire-append-entries", Vec::new).as_slice()).expect("decodes");
    assert_eq!(sent.version, WIRE_VERSION);
    assert_eq!(sent.entries[1].payload, Some(pb::entry::Payload::Command(command_bytes())));
    // A heartbeat: no entries, no commit yet.
    let heartbeat: AppendFields = (Vote::new_committed(3, 1), None, Vec::new(), None);
    check("wire-heartbeat", &heartbeat, encode, decode);
}

#[test]
fn append_entries_replies_keep_their_bytes() {
    type Reply = Result<AppendEntriesResponse<u64>, RaftError<u64>>;
    let replies: [(&str, Reply); 5] = [
        ("wire-append-success", Ok(AppendEntriesResponse::Success)),
        ("wire-append-partial", Ok(AppendEntriesResponse::PartialSuccess(Some(log_id(3, 1, 11))))),
        ("wire-append-conflict", Ok(AppendEntriesResponse::Conflict)),
        ("wire-append-higher-vote", Ok(AppendEntriesResponse::HigherVote(Vote::new(4, 2)))),
        ("wire-append-stopped", Err(RaftError::Fatal(Fatal::Stopped))),
    ];
    for (name, reply) in &replies {
        let decode = |m| raft_wire::append_reply_from_pb(m).expect("converts");
        check(name, reply, raft_wire::append_reply_to_pb, decode);
    }
}

#[test]
fn a_vote_keeps_its_bytes() {
    let request = VoteRequest::new(Vote::new(4, 2), Some(log_id(3, 1, 12)));
    let decode = |m| raft_wire::vote_request_from_pb(m).expect("converts");
    check("wire-vote-request", &request, raft_wire::vote_request_to_pb, decode);
    let reply: Result<VoteResponse<u64>, RaftError<u64>> =
        Ok(VoteResponse::new(Vote::new(4, 2), Some(log_id(3, 1, 12)), true));
    let decode = |m| raft_wire::vote_reply_from_pb(m).expect("converts");
    check("wire-vote-reply", &reply, raft_wire::vote_reply_to_pb, decode);
}

#[test]
fn a_pre_vote_keeps_its_bytes() {
    let request = (2u64, 5u64, Some(log_id(4, 2, 17)));
    let encode = |r: &(u64, u64, Option<LogId<u64>>)| raft_wire::pre_vote_request_to_pb(r.0, r.1, r.2);
    let decode = |m| raft_wire::pre_vote_request_from_pb(m).expect("converts");
    check("wire-pre-vote-request", &request, encode, decode);
    let reply = (true, 4u64);
    let encode = |r: &(bool, u64)| raft_wire::pre_vote_reply_to_pb(r.0, r.1);
    let decode = |m| raft_wire::pre_vote_reply_from_pb(m).expect("converts");
    check("wire-pre-vote-reply", &reply, encode, decode);
}

/// The fields of an InstallSnapshot request (openraft's type has no `PartialEq`).
type ChunkFields = (Vote<u64>, SnapshotMeta<u64, BasicNode>, u64, Vec<u8>, bool);

#[test]
fn a_snapshot_chunk_keeps_its_bytes() {
    let meta = SnapshotMeta {
        last_log_id: Some(log_id(3, 1, 12)),
        last_membership: StoredMembership::new(Some(log_id(3, 1, 12)), membership()),
        snapshot_id: "3-1-12".into(),
    };
    let chunk: ChunkFields = (Vote::new_committed(3, 1), meta, 4 << 20, b"the snapshot's bytes".to_vec(), true);
    let encode = |(vote, meta, offset, data, done): &ChunkFields| {
        raft_wire::snapshot_request_to_pb(InstallSnapshotRequest::<TypeConfig> {
            vote: *vote,
            meta: meta.clone(),
            offset: *offset,
            data: data.clone(),
            done: *done,
        })
    };
    let decode = |m| {
        let r = raft_wire::snapshot_request_from_pb(m).expect("converts");
        (r.vote, r.meta, r.offset, r.data, r.done)
    };
    check("wire-snapshot-chunk", &chunk, encode, decode);

    type Reply = Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>>;
    let mismatch = SnapshotMismatch {
        expect: SnapshotSegmentId { id: "3-1-12".into(), offset: 0 },
        got: SnapshotSegmentId { id: "3-1-12".into(), offset: 4 << 20 },
    };
    let replies: [(&str, Reply); 2] = [
        ("wire-snapshot-reply", Ok(InstallSnapshotResponse { vote: Vote::new_committed(3, 1) })),
        ("wire-snapshot-mismatch", Err(RaftError::APIError(InstallSnapshotError::SnapshotMismatch(mismatch)))),
    ];
    for (name, reply) in &replies {
        let decode = |m| raft_wire::snapshot_reply_from_pb(m).expect("converts");
        check(name, reply, raft_wire::snapshot_reply_to_pb, decode);
    }
}
