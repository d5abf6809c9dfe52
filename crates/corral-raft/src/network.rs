//! Raft RPCs over gRPC: the client side (`GrpcNetworkFactory`) and the server side
//! (`RaftGrpcService`), which also answers corral's pre-vote (`election.rs`).
//!
//! openraft's requests and replies travel as the typed messages of `raft.proto`
//! (`raft_wire.rs`): an entry's command as the bytes the log stores for it, shared by every
//! follower's request (never encoded per follower); a snapshot chunk as raw bytes. A snapshot
//! is sent only to a follower that accepts a TCP connection (the body it reads may first have
//! to be written with the whole history).
//!
//! AppendEntries is bounded twice over, because openraft 0.9 bounds it by entry count only and
//! gives each request one heartbeat interval (50 ms) to complete:
//! - by bytes: a request carries at most `APPEND_BUDGET` bytes of entries (at least one entry)
//!   and answers `PartialSuccess` up to the last entry it carried, so a follower far behind
//!   catches up in many small steps instead of failing on one huge message for ever;
//! - by time: a request that outlives openraft's timeout keeps going in the background, and
//!   the retry of the same range waits for it instead of starting over, so one slow request
//!   (a large entry, a slow disk, a busy host) still completes.

use crate::election::{self, ElectionClock, PreVoteView};
use crate::log_store::LogStore;
use crate::raft_wire::{self, WireError};
use crate::types::{NodeId, Raft, TypeConfig};
use corral_proto::raft as pb;
use corral_proto::raft::raft_client::RaftClient;
use corral_proto::raft::raft_server::{Raft as RaftRpc, RaftServer};
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::BasicNode;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Creates one gRPC client per peer.
#[derive(Debug, Clone, Default)]
pub struct GrpcNetworkFactory {
    /// Our coordinator certificate and the cluster CA; `None`: plaintext. A peer must present
    /// a coordinator certificate, or nothing is sent to it.
    pub tls: Option<corral_security::ClientTls>,
}

impl RaftNetworkFactory<TypeConfig> for GrpcNetworkFactory {
    type Network = GrpcNetwork;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> GrpcNetwork {
        self.client_for(target, &node.addr)
    }
}

impl GrpcNetworkFactory {
    /// A connection to the peer `target` at `addr`, made on its first request.
    pub(crate) fn client_for(&self, target: NodeId, addr: &str) -> GrpcNetwork {
        GrpcNetwork { target, addr: addr.to_string(), tls: self.tls.clone(), client: None, in_flight: None }
    }
}

/// Most bytes (encoded) of entries one AppendEntries request carries: what the log store gives
/// replication to send (`LogStore::limited_get_log_entries`), checked again here.
use crate::log_store::APPEND_BUDGET;

type AppendResult = Result<AppendEntriesResponse<NodeId>, RpcErr>;

/// An AppendEntries request still on its way after openraft stopped waiting for it.
struct InFlight {
    vote: openraft::Vote<NodeId>,
    prev: Option<openraft::LogId<NodeId>>,
    /// Last entry the request carries.
    last: Option<openraft::LogId<NodeId>>,
    task: tokio::task::JoinHandle<AppendResult>,
}

/// A connection to one peer, (re)connected lazily.
pub struct GrpcNetwork {
    target: NodeId,
    addr: String,
    tls: Option<corral_security::ClientTls>,
    client: Option<RaftClient<Channel>>,
    in_flight: Option<InFlight>,
}

impl Drop for GrpcNetwork {
    fn drop(&mut self) {
        if let Some(in_flight) = self.in_flight.take() {
            in_flight.task.abort();
        }
    }
}

type RpcErr<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

impl GrpcNetwork {
    pub(crate) fn client(&mut self) -> Result<RaftClient<Channel>, Unreachable> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        // Over TLS the connector does the handshake (and checks the peer's role).
        let endpoint = Endpoint::from_shared(format!("http://{}", self.addr))
            .map_err(|e| Unreachable::new(&e))?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true);
        let channel = match &self.tls {
            Some(tls) => tls
                .connect_lazy(endpoint, &self.addr, corral_security::ExpectedServer::Coordinator)
                .map_err(|e| Unreachable::new(&std::io::Error::other(e)))?,
            None => endpoint.connect_lazy(),
        };
        let client = RaftClient::new(channel)
            .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES);
        self.client = Some(client.clone());
        Ok(client)
    }

    /// One RPC: `call` with a handle on the client, its reply decoded by `decode`.
    async fn call<Reply, Resp, E, Fut>(
        &mut self,
        option: &RPCOption,
        call: impl FnOnce(RaftClient<Channel>) -> Fut,
        decode: Decode<Reply, Resp, E>,
    ) -> Result<Resp, RpcErr<E>>
    where
        Fut: Future<Output = Result<tonic::Response<Reply>, tonic::Status>>,
        E: std::error::Error,
    {
        let client = self.client().map_err(RPCError::Unreachable)?;
        let result = send(self.target, option.hard_ttl(), call(client), decode).await;
        if result.is_err() {
            // A broken channel is reconnected on the next call.
            self.client = None;
        }
        result
    }

    /// AppendEntries within the byte budget, joined to an earlier request of the same range
    /// that is still on its way (see the module docs).
    async fn append(&mut self, rpc: AppendEntriesRequest<TypeConfig>, option: RPCOption) -> AppendResult {
        if rpc.entries.is_empty() {
            // A heartbeat: it never disturbs a transfer in flight.
            let (request, _) = raft_wire::append_request_to_pb(&rpc, APPEND_BUDGET);
            let call = |mut client: RaftClient<Channel>| async move { client.append_entries(request).await };
            return self.call(&option, call, raft_wire::append_reply_from_pb).await;
        }
        let last = rpc.entries.last().map(|e| e.log_id);
        let joinable =
            self.in_flight.as_ref().is_some_and(|f| f.vote == rpc.vote && f.prev == rpc.prev_log_id && f.last <= last);
        if !joinable {
            if let Some(stale) = self.in_flight.take() {
                stale.task.abort();
            }
            let (request, count) = raft_wire::append_request_to_pb(&rpc, APPEND_BUDGET);
            if count < rpc.entries.len() {
                tracing::debug!(entries = count, of = rpc.entries.len(), "append entries split by size");
            }
            let carried = rpc.entries[..count].last().map(|e| e.log_id);
            let mut client = self.client().map_err(RPCError::Unreachable)?;
            let (target, ttl) = (self.target, option.hard_ttl());
            // The request may take longer than openraft waits: it runs on its own.
            let task = tokio::spawn(async move {
                let call = client.append_entries(request);
                send(target, ttl.max(APPEND_PATIENCE), call, raft_wire::append_reply_from_pb).await
            });
            self.in_flight = Some(InFlight { vote: rpc.vote, prev: rpc.prev_log_id, last: carried, task });
        }
        let in_flight = self.in_flight.as_mut().expect("set above");
        let result = match tokio::time::timeout(option.hard_ttl(), &mut in_flight.task).await {
            Err(elapsed) => return Err(RPCError::Network(NetworkError::new(&elapsed))),
            Ok(Err(join)) => Err(RPCError::Network(NetworkError::new(&join))),
            Ok(Ok(result)) => result,
        };
        let carried = in_flight.last;
        self.in_flight = None;
        match result {
            // The follower took what this request carried: say how far that is.
            Ok(AppendEntriesResponse::Success) if carried < last => Ok(AppendEntriesResponse::PartialSuccess(carried)),
            Err(e) => {
                self.client = None;
                Err(e)
            }
            other => other,
        }
    }
}

/// How long an AppendEntries request may run in the background before it is given up.
const APPEND_PATIENCE: Duration = Duration::from_secs(30);

/// Asks a peer for a pre-vote, waiting at most `ttl`: whether it was granted. A peer of an
/// earlier build, which has no pre-vote (UNIMPLEMENTED), counts as granting it: it would
/// answer the vote itself as it always did.
pub(crate) async fn pre_vote(
    mut client: RaftClient<Channel>,
    request: pb::PreVoteRequest,
    ttl: Duration,
) -> Result<bool, String> {
    match tokio::time::timeout(ttl, client.pre_vote(request)).await {
        Err(_) => Err(format!("no answer within {ttl:?}")),
        Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => Ok(true),
        Ok(Err(status)) => Err(error_chain(&status)),
        Ok(Ok(reply)) => raft_wire::pre_vote_reply_from_pb(reply.into_inner())
            .map(|(granted, _term)| granted)
            .map_err(|e| e.to_string()),
    }
}

/// Decodes a reply: what the peer's Raft answered, or a reply that does not decode.
type Decode<Reply, Resp, E> = fn(Reply) -> Result<Result<Resp, RaftError<NodeId, E>>, WireError>;

/// One Raft RPC to `target`: waits for `call` at most `ttl`, and decodes its reply.
async fn send<Reply, Resp, E>(
    target: NodeId,
    ttl: Duration,
    call: impl Future<Output = Result<tonic::Response<Reply>, tonic::Status>>,
    decode: Decode<Reply, Resp, E>,
) -> Result<Resp, RpcErr<E>>
where
    E: std::error::Error,
{
    let reply = match tokio::time::timeout(ttl, call).await {
        Ok(Ok(reply)) => reply.into_inner(),
        Ok(Err(status)) => {
            return Err(match status.code() {
                // A peer refused by TLS (not a coordinator, a foreign CA) says so in one line.
                tonic::Code::Unavailable => match corral_security::describe_tls_error(&error_chain(&status)) {
                    Some(line) => RPCError::Unreachable(Unreachable::new(&std::io::Error::other(line))),
                    None => RPCError::Unreachable(Unreachable::new(&status)),
                },
                code => {
                    if matches!(code, tonic::Code::FailedPrecondition | tonic::Code::Internal) {
                        warn_incompatible(target, &status);
                    }
                    RPCError::Network(NetworkError::new(&status))
                }
            });
        }
        Err(elapsed) => return Err(RPCError::Network(NetworkError::new(&elapsed))),
    };
    match decode(reply) {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(refused)) => Err(RPCError::RemoteError(RemoteError::new(target, refused))),
        Err(e) => {
            warn_incompatible(target, &e);
            Err(RPCError::Network(NetworkError::new(&e)))
        }
    }
}

/// Says, at most every ten seconds, that a peer refused a request or sent a reply this node
/// cannot read: a coordinator of another wire version (see `raft.proto`) refuses every
/// request, and the cluster waits until every coordinator is upgraded.
fn warn_incompatible(target: NodeId, error: &dyn std::fmt::Display) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_some_and(|t| t.elapsed() < Duration::from_secs(10)) {
        return;
    }
    *last = Some(std::time::Instant::now());
    tracing::warn!(
        target_node = target,
        "a Raft RPC failed: {error} (a coordinator of another Raft wire version refuses every request: \
         upgrade every coordinator together)"
    );
}

/// An error and its sources, joined by ": ".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut chain = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    chain
}

impl RaftNetwork<TypeConfig> for GrpcNetwork {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        self.append(rpc, option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        let request = raft_wire::snapshot_request_to_pb(rpc);
        let call = |mut client: RaftClient<Channel>| async move { client.install_snapshot(request).await };
        self.call(&option, call, raft_wire::snapshot_reply_from_pb).await
    }

    /// Sends a snapshot in chunks, as openraft does, to a follower that accepts a connection:
    /// the body it reads may first have to be written with the whole history, which is not
    /// done each time a follower that is down is retried.
    async fn full_snapshot(
        &mut self,
        vote: openraft::Vote<NodeId>,
        snapshot: openraft::Snapshot<TypeConfig>,
        cancel: impl std::future::Future<Output = openraft::error::ReplicationClosed> + openraft::OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<
        openraft::raft::SnapshotResponse<NodeId>,
        openraft::error::StreamingError<TypeConfig, openraft::error::Fatal<NodeId>>,
    > {
        use openraft::network::snapshot_transport::{Chunked, SnapshotTransport};
        match tokio::time::timeout(Duration::from_millis(500), tokio::net::TcpStream::connect(&self.addr)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(Unreachable::new(&e).into()),
            Err(elapsed) => return Err(Unreachable::new(&elapsed).into()),
        }
        Chunked::send_snapshot(self, vote, snapshot, cancel, option).await
    }

    async fn vote(&mut self, rpc: VoteRequest<NodeId>, option: RPCOption) -> Result<VoteResponse<NodeId>, RpcErr> {
        let request = raft_wire::vote_request_to_pb(&rpc);
        let call = |mut client: RaftClient<Channel>| async move { client.vote(request).await };
        self.call(&option, call, raft_wire::vote_reply_from_pb).await
    }
}

/// The Raft gRPC service a coordinator serves to its peers.
#[derive(Clone)]
pub struct RaftGrpcService {
    raft: Raft,
    log: LogStore<TypeConfig>,
    /// When this node last heard from a leader (pre-votes are judged by it, and the election
    /// timer starts again from it).
    clock: Arc<ElectionClock>,
    min_election_timeout: Duration,
}

impl RaftGrpcService {
    pub(crate) fn new(
        raft: Raft,
        log: LogStore<TypeConfig>,
        clock: Arc<ElectionClock>,
        min_election_timeout: Duration,
    ) -> Self {
        RaftGrpcService { raft, log, clock, min_election_timeout }
    }

    /// Notes a request of a leader whose vote is at least this node's (the current leader, or
    /// a newer one), as it arrives: a follower busy storing a large request still counts its
    /// leader as heard, and refuses pre-votes.
    fn note_leader(&self, vote: &openraft::Vote<NodeId>) {
        let current = self.raft.metrics().borrow().vote;
        if vote.is_committed() && *vote >= current {
            self.clock.leader_heard();
        }
    }

    pub fn into_server(self) -> RaftServer<Self> {
        RaftServer::new(self)
            .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl RaftRpc for RaftGrpcService {
    async fn append_entries(
        &self,
        request: tonic::Request<pb::AppendEntriesRequest>,
    ) -> Result<tonic::Response<pb::AppendEntriesReply>, tonic::Status> {
        let rpc = raft_wire::append_request_from_pb(request.into_inner())?;
        self.note_leader(&rpc.vote);
        let response = self.raft.append_entries(rpc).await;
        Ok(tonic::Response::new(raft_wire::append_reply_to_pb(&response)))
    }

    async fn vote(
        &self,
        request: tonic::Request<pb::VoteRequest>,
    ) -> Result<tonic::Response<pb::VoteReply>, tonic::Status> {
        let rpc = raft_wire::vote_request_from_pb(request.into_inner())?;
        let response = self.raft.vote(rpc).await;
        if response.as_ref().is_ok_and(|r| r.vote_granted) {
            // Give the candidate time to win before campaigning too.
            self.clock.restart_timer();
        }
        Ok(tonic::Response::new(raft_wire::vote_reply_to_pb(&response)))
    }

    /// Answers a pre-vote by `election::grant_pre_vote`; changes nothing here.
    async fn pre_vote(
        &self,
        request: tonic::Request<pb::PreVoteRequest>,
    ) -> Result<tonic::Response<pb::PreVoteReply>, tonic::Status> {
        use openraft::storage::RaftLogStorage;
        let (candidate, term, candidate_last_log) = raft_wire::pre_vote_request_from_pb(request.into_inner())?;
        let (quiet_for, current_term) = {
            let metrics = self.raft.metrics();
            let m = metrics.borrow();
            (election::quiet_for(&m, &self.clock), m.current_term)
        };
        let last_log_id = self
            .log
            .clone()
            .get_log_state()
            .await
            .map_err(|e| tonic::Status::internal(format!("cannot read the log's state: {e}")))?
            .last_log_id;
        let view = PreVoteView { quiet_for, last_log_id };
        let granted = election::grant_pre_vote(&view, candidate_last_log, self.min_election_timeout);
        tracing::debug!(candidate, term, granted, ?quiet_for, "pre-vote");
        Ok(tonic::Response::new(raft_wire::pre_vote_reply_to_pb(granted, current_term)))
    }

    async fn install_snapshot(
        &self,
        request: tonic::Request<pb::InstallSnapshotRequest>,
    ) -> Result<tonic::Response<pb::InstallSnapshotReply>, tonic::Status> {
        let rpc = raft_wire::snapshot_request_from_pb(request.into_inner())?;
        self.note_leader(&rpc.vote);
        Ok(tonic::Response::new(raft_wire::snapshot_reply_to_pb(&self.raft.install_snapshot(rpc).await)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// An AppendEntries request carries the entries that fit the budget (at least one), each
    /// command as the bytes the log holds (shared, not copied), and decodes as it was sent.
    #[test]
    fn an_append_request_is_cut_to_the_budget_and_decodes_as_sent() {
        use corral_core::{Command, Request};
        let entry = |index: u64, bytes: usize| openraft::Entry::<TypeConfig> {
            log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(3, 1), index),
            payload: openraft::EntryPayload::Normal(crate::RaftRequest::new(Request {
                ts: corral_types::Timestamp(index),
                command: Command::CancelJob { job_id: index, reason: "x".repeat(bytes) },
            })),
        };
        let rpc = |entries| AppendEntriesRequest::<TypeConfig> {
            vote: openraft::Vote::new_committed(3, 1),
            prev_log_id: Some(openraft::LogId::new(openraft::CommittedLeaderId::new(2, 1), 9)),
            entries,
            leader_commit: Some(openraft::LogId::new(openraft::CommittedLeaderId::new(3, 1), 10)),
        };
        let decode = |request: pb::AppendEntriesRequest| {
            let bytes = request.encode_to_vec();
            raft_wire::append_request_from_pb(pb::AppendEntriesRequest::decode(bytes.as_slice()).expect("decodes"))
                .expect("converts")
        };
        let whole = rpc(vec![entry(10, 10), entry(11, 10), entry(12, 10)]);
        let (request, count) = raft_wire::append_request_to_pb(&whole, APPEND_BUDGET);
        assert_eq!(count, 3);
        let shared = |i: usize| match (&request.entries[i].payload, &whole.entries[i].payload) {
            (Some(pb::entry::Payload::Command(sent)), openraft::EntryPayload::Normal(held)) => {
                sent.as_ptr() == held.bytes().as_ptr()
            }
            _ => false,
        };
        assert!((0..3).all(shared), "each command is the log's bytes, not a copy");
        let back = decode(request);
        assert_eq!(
            (back.vote, back.prev_log_id, back.leader_commit),
            (whole.vote, whole.prev_log_id, whole.leader_commit)
        );
        assert_eq!(back.entries, whole.entries);
        // 3 MiB entries: two do not fit the 4 MiB budget, one more than the budget still goes alone.
        let big = rpc(vec![entry(10, 3 << 20), entry(11, 3 << 20), entry(12, 10)]);
        let (request, count) = raft_wire::append_request_to_pb(&big, APPEND_BUDGET);
        assert_eq!(count, 1);
        assert_eq!(decode(request).entries, big.entries[..1].to_vec());
        let huge = rpc(vec![entry(10, 5 << 20)]);
        let (request, count) = raft_wire::append_request_to_pb(&huge, APPEND_BUDGET);
        assert_eq!((count, decode(request).entries.len()), (1, 1));
        let heartbeat = rpc(vec![]);
        let (request, count) = raft_wire::append_request_to_pb(&heartbeat, APPEND_BUDGET);
        assert_eq!((count, decode(request).entries.len()), (0, 0));
    }

    #[test]
    fn a_peer_that_is_not_a_coordinator_gets_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = corral_security::DevCerts { coordinators: 1, workers: vec!["w1".into()], ..Default::default() };
        corral_security::generate_dev_certs(dir.path(), &spec).expect("certs");
        let files = |name: &str| corral_security::TlsFiles {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join(format!("{name}.pem")),
            key: dir.path().join(format!("{name}-key.pem")),
        };
        let impostor = corral_security::testing::Impostor::start(&files("worker-w1")).expect("impostor");
        let addr = impostor.addr().to_string();
        let tls = corral_security::ClientTls::load(&files("coordinator-1")).expect("tls");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let err = runtime.block_on(async {
            let mut factory = GrpcNetworkFactory { tls: Some(tls) };
            let mut network = factory.new_client(2, &BasicNode { addr: addr.clone() }).await;
            let vote = VoteRequest::new(openraft::Vote::new(3, 1), None);
            let option = RPCOption::new(Duration::from_secs(5));
            network.vote(vote, option).await.expect_err("refused").to_string()
        });
        let line = format!("the server at {addr} presented a certificate with role worker, not coordinator");
        assert!(err.contains(&line), "{err}");
        let seen = impostor.seen();
        assert_eq!((seen.handshakes, seen.received.len()), (0, 0), "{seen:?}");
    }
}
