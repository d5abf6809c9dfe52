//! The Raft wire: openraft's RPCs and their replies as the typed messages of `raft.proto`
//! (`corral.raft.v1`), both ways, with the wire's version.
//!
//! A log entry's command goes out as the bytes the log stores for it (`RaftRequest::bytes`, a
//! `Bytes` every follower's request shares): building a request copies no command and encodes
//! none. A received command is decoded once, to refuse an entry that does not decode before
//! the log takes it. Decoding is fallible: a peer can send anything, and gets a one-line error.
//!
//! Public for the golden test of the wire bytes and the benchmark; `network.rs` is its user.

use crate::types::{NodeId, RaftRequest, TypeConfig};
use corral_proto::raft as pb;
use openraft::error::{Fatal, InstallSnapshotError, RaftError, SnapshotMismatch};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{
    AnyError, BasicNode, CommittedLeaderId, Entry, EntryPayload, ErrorSubject, ErrorVerb, LeaderId, LogId, Membership,
    SnapshotMeta, SnapshotSegmentId, StorageIOError, StoredMembership, Vote,
};
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

/// The version of the wire this build speaks, written into every request and reply. A message
/// of another version is refused: 0 is a peer that does not write it, higher a newer build.
pub const WIRE_VERSION: u32 = 1;

/// A message of the wire that does not convert into openraft's.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error(
        "raft wire version {found}, this coordinator speaks version {WIRE_VERSION}: upgrade every coordinator together"
    )]
    Version { found: u32 },
    #[error("missing field '{0}'")]
    Missing(&'static str),
    #[error("invalid value of '{field}': {value}")]
    Invalid { field: &'static str, value: String },
    #[error("the command of entry {index} does not decode: {source}")]
    Command { index: u64, source: crate::codec::CodecError },
}

impl From<WireError> for tonic::Status {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Version { .. } => tonic::Status::failed_precondition(e.to_string()),
            _ => tonic::Status::invalid_argument(e.to_string()),
        }
    }
}

fn check_version(found: u32) -> Result<(), WireError> {
    if found != WIRE_VERSION {
        return Err(WireError::Version { found });
    }
    Ok(())
}

// ---- metadata ----

fn vote_to_pb(v: &Vote<NodeId>) -> pb::Vote {
    pb::Vote { term: v.leader_id.term, node_id: v.leader_id.node_id, committed: v.committed }
}

fn vote_from_pb(v: Option<pb::Vote>) -> Result<Vote<NodeId>, WireError> {
    let v = v.ok_or(WireError::Missing("vote"))?;
    Ok(Vote { leader_id: LeaderId::new(v.term, v.node_id), committed: v.committed })
}

fn log_id_to_pb(l: &LogId<NodeId>) -> pb::LogId {
    pb::LogId { term: l.leader_id.term, node_id: l.leader_id.node_id, index: l.index }
}

fn log_id_from_pb(l: pb::LogId) -> LogId<NodeId> {
    LogId::new(CommittedLeaderId::new(l.term, l.node_id), l.index)
}

fn membership_to_pb(m: &Membership<NodeId, BasicNode>) -> pb::Membership {
    pb::Membership {
        configs: m.get_joint_config().iter().map(|ids| pb::VoterSet { ids: ids.iter().copied().collect() }).collect(),
        nodes: m.nodes().map(|(id, node)| pb::Node { id: *id, addr: node.addr.clone() }).collect(),
    }
}

fn membership_from_pb(m: pb::Membership) -> Membership<NodeId, BasicNode> {
    let configs: Vec<BTreeSet<NodeId>> = m.configs.into_iter().map(|c| c.ids.into_iter().collect()).collect();
    let nodes: BTreeMap<NodeId, BasicNode> = m.nodes.into_iter().map(|n| (n.id, BasicNode { addr: n.addr })).collect();
    Membership::new(configs, nodes)
}

// ---- entries ----

/// An entry as it goes out: its command as the bytes the log stores (shared, not copied).
pub fn entry_to_pb(e: &Entry<TypeConfig>) -> pb::Entry {
    use pb::entry::Payload;
    let payload = match &e.payload {
        EntryPayload::Blank => Payload::Blank(pb::Blank {}),
        EntryPayload::Normal(request) => Payload::Command(request.bytes().clone()),
        EntryPayload::Membership(m) => Payload::Membership(membership_to_pb(m)),
    };
    pb::Entry { log_id: Some(log_id_to_pb(&e.log_id)), payload: Some(payload) }
}

/// A received entry; its command is decoded now, so an entry that does not decode is refused
/// before the log takes it.
pub fn entry_from_pb(e: pb::Entry) -> Result<Entry<TypeConfig>, WireError> {
    use pb::entry::Payload;
    let log_id = log_id_from_pb(e.log_id.ok_or(WireError::Missing("entry.log_id"))?);
    let payload = match e.payload.ok_or(WireError::Missing("entry.payload"))? {
        Payload::Blank(_) => EntryPayload::Blank,
        Payload::Command(bytes) => EntryPayload::Normal(
            RaftRequest::received(bytes).map_err(|source| WireError::Command { index: log_id.index, source })?,
        ),
        Payload::Membership(m) => EntryPayload::Membership(membership_from_pb(m)),
    };
    Ok(Entry { log_id, payload })
}

// ---- errors ----

fn fatal_to_pb(f: &Fatal<NodeId>) -> pb::RaftError {
    let kind = match f {
        Fatal::StorageError(_) => pb::FatalKind::Storage,
        Fatal::Panicked => pb::FatalKind::Panicked,
        Fatal::Stopped => pb::FatalKind::Stopped,
    };
    let fatal = pb::Fatal { kind: kind as i32, message: f.to_string() };
    pb::RaftError { kind: Some(pb::raft_error::Kind::Fatal(fatal)) }
}

/// The fatal error a peer reported. A storage error keeps its message, not its structure
/// (openraft only reports it).
fn fatal_from_pb(f: pb::Fatal) -> Result<Fatal<NodeId>, WireError> {
    Ok(match pb::FatalKind::try_from(f.kind) {
        Ok(pb::FatalKind::Storage) => Fatal::StorageError(
            StorageIOError::new(ErrorSubject::Store, ErrorVerb::Write, AnyError::error(f.message)).into(),
        ),
        Ok(pb::FatalKind::Panicked) => Fatal::Panicked,
        Ok(pb::FatalKind::Stopped) => Fatal::Stopped,
        _ => return Err(WireError::Invalid { field: "fatal.kind", value: f.kind.to_string() }),
    })
}

/// A peer's refusal of an RPC whose only error is fatal (AppendEntries, Vote).
fn error_from_pb(e: pb::RaftError) -> Result<RaftError<NodeId>, WireError> {
    match e.kind.ok_or(WireError::Missing("error.kind"))? {
        pb::raft_error::Kind::Fatal(f) => Ok(RaftError::Fatal(fatal_from_pb(f)?)),
        pb::raft_error::Kind::SnapshotMismatch(_) => {
            Err(WireError::Invalid { field: "error", value: "a snapshot mismatch outside InstallSnapshot".into() })
        }
    }
}

fn segment_to_pb(s: &SnapshotSegmentId) -> pb::SnapshotSegmentId {
    pb::SnapshotSegmentId { id: s.id.clone(), offset: s.offset }
}

fn segment_from_pb(s: Option<pb::SnapshotSegmentId>) -> Result<SnapshotSegmentId, WireError> {
    let s = s.ok_or(WireError::Missing("snapshot_mismatch segment"))?;
    Ok(SnapshotSegmentId { id: s.id, offset: s.offset })
}

// ---- AppendEntries ----

/// The request to send: `rpc`'s metadata and as many of its entries as fit `budget` bytes
/// (encoded), at least one; and how many it carries.
pub fn append_request_to_pb(
    rpc: &AppendEntriesRequest<TypeConfig>,
    budget: usize,
) -> (pb::AppendEntriesRequest, usize) {
    let mut size = 0;
    let mut entries = Vec::with_capacity(rpc.entries.len());
    for entry in &rpc.entries {
        let entry = entry_to_pb(entry);
        size += entry.encoded_len();
        if !entries.is_empty() && size > budget {
            break;
        }
        entries.push(entry);
    }
    let count = entries.len();
    let request = pb::AppendEntriesRequest {
        version: WIRE_VERSION,
        vote: Some(vote_to_pb(&rpc.vote)),
        prev_log_id: rpc.prev_log_id.as_ref().map(log_id_to_pb),
        entries,
        leader_commit: rpc.leader_commit.as_ref().map(log_id_to_pb),
    };
    (request, count)
}

pub fn append_request_from_pb(r: pb::AppendEntriesRequest) -> Result<AppendEntriesRequest<TypeConfig>, WireError> {
    check_version(r.version)?;
    Ok(AppendEntriesRequest {
        vote: vote_from_pb(r.vote)?,
        prev_log_id: r.prev_log_id.map(log_id_from_pb),
        entries: r.entries.into_iter().map(entry_from_pb).collect::<Result<_, _>>()?,
        leader_commit: r.leader_commit.map(log_id_from_pb),
    })
}

pub fn append_reply_to_pb(r: &Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>) -> pb::AppendEntriesReply {
    use pb::append_entries_reply::Result as Reply;
    let result = match r {
        Ok(AppendEntriesResponse::Success) => Reply::Success(pb::Blank {}),
        Ok(AppendEntriesResponse::PartialSuccess(matching)) => {
            Reply::PartialSuccess(pb::PartialSuccess { matching: matching.as_ref().map(log_id_to_pb) })
        }
        Ok(AppendEntriesResponse::Conflict) => Reply::Conflict(pb::Blank {}),
        Ok(AppendEntriesResponse::HigherVote(v)) => Reply::HigherVote(vote_to_pb(v)),
        Err(RaftError::Fatal(f)) => Reply::Error(fatal_to_pb(f)),
        Err(RaftError::APIError(never)) => match *never {},
    };
    pb::AppendEntriesReply { version: WIRE_VERSION, result: Some(result) }
}

pub fn append_reply_from_pb(
    r: pb::AppendEntriesReply,
) -> Result<Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>, WireError> {
    use pb::append_entries_reply::Result as Reply;
    check_version(r.version)?;
    Ok(match r.result.ok_or(WireError::Missing("append_entries_reply.result"))? {
        Reply::Success(_) => Ok(AppendEntriesResponse::Success),
        Reply::PartialSuccess(p) => Ok(AppendEntriesResponse::PartialSuccess(p.matching.map(log_id_from_pb))),
        Reply::Conflict(_) => Ok(AppendEntriesResponse::Conflict),
        Reply::HigherVote(v) => Ok(AppendEntriesResponse::HigherVote(vote_from_pb(Some(v))?)),
        Reply::Error(e) => Err(error_from_pb(e)?),
    })
}

// ---- Vote ----

pub fn vote_request_to_pb(r: &VoteRequest<NodeId>) -> pb::VoteRequest {
    pb::VoteRequest {
        version: WIRE_VERSION,
        vote: Some(vote_to_pb(&r.vote)),
        last_log_id: r.last_log_id.as_ref().map(log_id_to_pb),
    }
}

pub fn vote_request_from_pb(r: pb::VoteRequest) -> Result<VoteRequest<NodeId>, WireError> {
    check_version(r.version)?;
    Ok(VoteRequest { vote: vote_from_pb(r.vote)?, last_log_id: r.last_log_id.map(log_id_from_pb) })
}

pub fn vote_reply_to_pb(r: &Result<VoteResponse<NodeId>, RaftError<NodeId>>) -> pb::VoteReply {
    use pb::vote_reply::Result as Reply;
    let result = match r {
        Ok(v) => Reply::Response(pb::VoteResponse {
            vote: Some(vote_to_pb(&v.vote)),
            vote_granted: v.vote_granted,
            last_log_id: v.last_log_id.as_ref().map(log_id_to_pb),
        }),
        Err(RaftError::Fatal(f)) => Reply::Error(fatal_to_pb(f)),
        Err(RaftError::APIError(never)) => match *never {},
    };
    pb::VoteReply { version: WIRE_VERSION, result: Some(result) }
}

pub fn vote_reply_from_pb(r: pb::VoteReply) -> Result<Result<VoteResponse<NodeId>, RaftError<NodeId>>, WireError> {
    use pb::vote_reply::Result as Reply;
    check_version(r.version)?;
    Ok(match r.result.ok_or(WireError::Missing("vote_reply.result"))? {
        Reply::Response(v) => Ok(VoteResponse {
            vote: vote_from_pb(v.vote)?,
            vote_granted: v.vote_granted,
            last_log_id: v.last_log_id.map(log_id_from_pb),
        }),
        Reply::Error(e) => Err(error_from_pb(e)?),
    })
}

// ---- pre-vote ----

/// A pre-vote request: `candidate` would campaign at `term` with a log ending at `last_log_id`.
pub fn pre_vote_request_to_pb(candidate: NodeId, term: u64, last_log_id: Option<LogId<NodeId>>) -> pb::PreVoteRequest {
    pb::PreVoteRequest { version: WIRE_VERSION, candidate, term, last_log_id: last_log_id.as_ref().map(log_id_to_pb) }
}

/// A received pre-vote request: the candidate, the term it would campaign at, its last log id.
pub fn pre_vote_request_from_pb(r: pb::PreVoteRequest) -> Result<(NodeId, u64, Option<LogId<NodeId>>), WireError> {
    check_version(r.version)?;
    Ok((r.candidate, r.term, r.last_log_id.map(log_id_from_pb)))
}

pub fn pre_vote_reply_to_pb(granted: bool, term: u64) -> pb::PreVoteReply {
    pb::PreVoteReply { version: WIRE_VERSION, granted, term }
}

/// A pre-vote reply: whether it was granted, and the receiver's term.
pub fn pre_vote_reply_from_pb(r: pb::PreVoteReply) -> Result<(bool, u64), WireError> {
    check_version(r.version)?;
    Ok((r.granted, r.term))
}

// ---- InstallSnapshot ----

fn snapshot_meta_to_pb(m: &SnapshotMeta<NodeId, BasicNode>) -> pb::SnapshotMeta {
    pb::SnapshotMeta {
        last_log_id: m.last_log_id.as_ref().map(log_id_to_pb),
        membership_log_id: m.last_membership.log_id().as_ref().map(log_id_to_pb),
        membership: Some(membership_to_pb(m.last_membership.membership())),
        snapshot_id: m.snapshot_id.clone(),
    }
}

fn snapshot_meta_from_pb(m: Option<pb::SnapshotMeta>) -> Result<SnapshotMeta<NodeId, BasicNode>, WireError> {
    let m = m.ok_or(WireError::Missing("meta"))?;
    let membership = membership_from_pb(m.membership.ok_or(WireError::Missing("meta.membership"))?);
    Ok(SnapshotMeta {
        last_log_id: m.last_log_id.map(log_id_from_pb),
        last_membership: StoredMembership::new(m.membership_log_id.map(log_id_from_pb), membership),
        snapshot_id: m.snapshot_id,
    })
}

/// The chunk request to send; its data moves into the message, not copied.
pub fn snapshot_request_to_pb(r: InstallSnapshotRequest<TypeConfig>) -> pb::InstallSnapshotRequest {
    pb::InstallSnapshotRequest {
        version: WIRE_VERSION,
        vote: Some(vote_to_pb(&r.vote)),
        meta: Some(snapshot_meta_to_pb(&r.meta)),
        offset: r.offset,
        data: r.data.into(),
        done: r.done,
    }
}

pub fn snapshot_request_from_pb(
    r: pb::InstallSnapshotRequest,
) -> Result<InstallSnapshotRequest<TypeConfig>, WireError> {
    check_version(r.version)?;
    Ok(InstallSnapshotRequest {
        vote: vote_from_pb(r.vote)?,
        meta: snapshot_meta_from_pb(r.meta)?,
        offset: r.offset,
        data: r.data.into(),
        done: r.done,
    })
}

type SnapshotResult = Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>;

pub fn snapshot_reply_to_pb(r: &SnapshotResult) -> pb::InstallSnapshotReply {
    use pb::install_snapshot_reply::Result as Reply;
    let result = match r {
        Ok(response) => Reply::Vote(vote_to_pb(&response.vote)),
        Err(RaftError::Fatal(f)) => Reply::Error(fatal_to_pb(f)),
        Err(RaftError::APIError(InstallSnapshotError::SnapshotMismatch(m))) => Reply::Error(pb::RaftError {
            kind: Some(pb::raft_error::Kind::SnapshotMismatch(pb::SnapshotMismatch {
                expect: Some(segment_to_pb(&m.expect)),
                got: Some(segment_to_pb(&m.got)),
            })),
        }),
    };
    pb::InstallSnapshotReply { version: WIRE_VERSION, result: Some(result) }
}

pub fn snapshot_reply_from_pb(r: pb::InstallSnapshotReply) -> Result<SnapshotResult, WireError> {
    use pb::install_snapshot_reply::Result as Reply;
    check_version(r.version)?;
    Ok(match r.result.ok_or(WireError::Missing("install_snapshot_reply.result"))? {
        Reply::Vote(v) => Ok(InstallSnapshotResponse { vote: vote_from_pb(Some(v))? }),
        Reply::Error(e) => Err(match e.kind.ok_or(WireError::Missing("error.kind"))? {
            pb::raft_error::Kind::Fatal(f) => RaftError::Fatal(fatal_from_pb(f)?),
            pb::raft_error::Kind::SnapshotMismatch(m) => {
                RaftError::APIError(InstallSnapshotError::SnapshotMismatch(SnapshotMismatch {
                    expect: segment_from_pb(m.expect)?,
                    got: segment_from_pb(m.got)?,
                }))
            }
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::{Command, Request};

    /// The envelope of the JSON wire that came before (`RaftMessage`: the request as JSON in
    /// field 1, a snapshot chunk in field 2).
    #[derive(Clone, PartialEq, prost::Message)]
    struct JsonWireMessage {
        #[prost(bytes = "vec", tag = "1")]
        data: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        chunk: Vec<u8>,
    }

    fn append(entries: Vec<Entry<TypeConfig>>) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(3, 1),
            prev_log_id: None,
            entries,
            leader_commit: Some(LogId::new(CommittedLeaderId::new(3, 1), 1)),
        }
    }

    /// A coordinator of the JSON wire and one of this wire refuse each other's messages, both
    /// ways, instead of misreading them; a message of another version of this wire is refused
    /// with FAILED_PRECONDITION, naming the versions.
    #[test]
    fn another_wire_is_refused_not_misread() {
        let old = JsonWireMessage { data: br#"{"vote":{},"entries":[]}"#.to_vec(), chunk: Vec::new() }.encode_to_vec();
        assert!(pb::AppendEntriesRequest::decode(old.as_slice()).is_err());
        assert!(pb::VoteRequest::decode(old.as_slice()).is_err());
        assert!(pb::InstallSnapshotRequest::decode(old.as_slice()).is_err());
        assert!(pb::AppendEntriesReply::decode(old.as_slice()).is_err());
        assert!(pb::VoteReply::decode(old.as_slice()).is_err());
        assert!(pb::InstallSnapshotReply::decode(old.as_slice()).is_err());
        let heartbeat = append_request_to_pb(&append(Vec::new()), usize::MAX).0;
        let vote = vote_request_to_pb(&VoteRequest::new(Vote::new(4, 2), None));
        let reply = append_reply_to_pb(&Ok(AppendEntriesResponse::Success));
        for new in [heartbeat.encode_to_vec(), vote.encode_to_vec(), reply.encode_to_vec()] {
            assert!(JsonWireMessage::decode(new.as_slice()).is_err(), "the JSON wire cannot read {new:?}");
        }

        for version in [0, WIRE_VERSION + 1] {
            let newer = pb::AppendEntriesRequest { version, ..heartbeat.clone() };
            let refused = append_request_from_pb(newer).expect_err("another version");
            assert!(refused.to_string().contains("upgrade every coordinator together"), "{refused}");
            assert_eq!(tonic::Status::from(refused).code(), tonic::Code::FailedPrecondition);
            let reply = pb::VoteReply { version, ..vote_reply_to_pb(&Err(RaftError::Fatal(Fatal::Stopped))) };
            assert!(matches!(vote_reply_from_pb(reply), Err(WireError::Version { found }) if found == version));
        }
    }

    /// A pre-vote crosses the wire as it was sent, an empty log included; another version is
    /// refused.
    #[test]
    fn a_pre_vote_crosses_the_wire() {
        let last = Some(LogId::new(CommittedLeaderId::new(4, 2), 17));
        for last in [last, None] {
            let sent = pre_vote_request_to_pb(2, 5, last);
            let bytes = sent.encode_to_vec();
            let received = pb::PreVoteRequest::decode(bytes.as_slice()).expect("decodes");
            assert_eq!(pre_vote_request_from_pb(received).expect("converts"), (2, 5, last));
        }
        assert_eq!(pre_vote_reply_from_pb(pre_vote_reply_to_pb(false, 7)).expect("converts"), (false, 7));
        let newer = pb::PreVoteRequest { version: WIRE_VERSION + 1, ..pre_vote_request_to_pb(2, 5, None) };
        assert!(matches!(pre_vote_request_from_pb(newer), Err(WireError::Version { .. })));
        let older = pb::PreVoteReply { version: 0, ..pre_vote_reply_to_pb(true, 7) };
        assert!(matches!(pre_vote_reply_from_pb(older), Err(WireError::Version { found: 0 })));
    }

    /// A received entry whose command does not decode is refused with its index, before any
    /// log takes it; an entry's command goes out as the bytes it holds.
    #[test]
    fn a_command_that_does_not_decode_is_refused_on_receipt() {
        let request = Request { ts: corral_types::Timestamp(5), command: Command::Noop };
        let entry = Entry::<TypeConfig> {
            log_id: LogId::new(CommittedLeaderId::new(3, 1), 7),
            payload: EntryPayload::Normal(RaftRequest::new(request)),
        };
        let (mut sent, count) = append_request_to_pb(&append(vec![entry.clone()]), usize::MAX);
        assert_eq!(count, 1);
        assert_eq!(append_request_from_pb(sent.clone()).expect("converts").entries, vec![entry]);
        sent.entries[0].payload = Some(pb::entry::Payload::Command(vec![0xff, 0xff].into()));
        let refused = append_request_from_pb(sent).expect_err("garbage");
        assert!(matches!(refused, WireError::Command { index: 7, .. }), "{refused}");
        assert_eq!(tonic::Status::from(refused).code(), tonic::Code::InvalidArgument);
    }

    /// What a peer's Raft reports when it stopped arrives as the same fatal error, and a
    /// storage error keeps its message.
    #[test]
    fn fatal_errors_cross_the_wire() {
        for fatal in [Fatal::Stopped, Fatal::Panicked] {
            let reply = append_reply_to_pb(&Err(RaftError::Fatal(fatal.clone())));
            assert_eq!(append_reply_from_pb(reply).expect("converts"), Err(RaftError::Fatal(fatal)));
        }
        let storage = StorageIOError::<NodeId>::read_logs(&std::io::Error::other("disk gone"));
        let reply = vote_reply_to_pb(&Err(RaftError::Fatal(Fatal::StorageError(storage.into()))));
        let back = vote_reply_from_pb(reply).expect("converts").expect_err("an error");
        assert!(back.to_string().contains("disk gone"), "{back}");
    }
}
