//! Raft RPCs over gRPC: the client side (`GrpcNetworkFactory`) and the server side (`RaftGrpcService`).
//!
//! openraft's request/response types travel as serde_json inside a `RaftMessage`; application
//! commands inside entries are protobuf (see `RaftRequest`).

use crate::types::{NodeId, Raft, TypeConfig};
use corral_proto::raft::raft_client::RaftClient;
use corral_proto::raft::raft_server::{Raft as RaftRpc, RaftServer};
use corral_proto::raft::RaftMessage;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Creates one gRPC client per peer.
#[derive(Debug, Clone, Default)]
pub struct GrpcNetworkFactory {
    /// Our coordinator certificate and the cluster CA; `None`: plaintext.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

impl RaftNetworkFactory<TypeConfig> for GrpcNetworkFactory {
    type Network = GrpcNetwork;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> GrpcNetwork {
        GrpcNetwork { target, addr: node.addr.clone(), tls: self.tls.clone(), client: None }
    }
}

/// A connection to one peer, (re)connected lazily.
pub struct GrpcNetwork {
    target: NodeId,
    addr: String,
    tls: Option<tonic::transport::ClientTlsConfig>,
    client: Option<RaftClient<Channel>>,
}

type RpcErr<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

impl GrpcNetwork {
    fn client(&mut self) -> Result<RaftClient<Channel>, Unreachable> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", self.addr))
            .map_err(|e| Unreachable::new(&e))?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            endpoint = endpoint.tls_config(tls.clone()).map_err(|e| Unreachable::new(&e))?;
        }
        let client = RaftClient::new(endpoint.connect_lazy())
            .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES);
        self.client = Some(client.clone());
        Ok(client)
    }

    async fn call<Req, Resp, E>(&mut self, kind: RpcKind, req: &Req, option: &RPCOption) -> Result<Resp, RpcErr<E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let data = serde_json::to_vec(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut client = self.client().map_err(RPCError::Unreachable)?;
        let msg = RaftMessage { data };
        let call = async {
            match kind {
                RpcKind::Append => client.append_entries(msg).await,
                RpcKind::Vote => client.vote(msg).await,
                RpcKind::Snapshot => client.install_snapshot(msg).await,
            }
        };
        let reply = match tokio::time::timeout(option.hard_ttl(), call).await {
            Ok(Ok(reply)) => reply.into_inner(),
            Ok(Err(status)) => {
                // A broken channel is reconnected on the next call.
                self.client = None;
                return Err(if status.code() == tonic::Code::Unavailable {
                    RPCError::Unreachable(Unreachable::new(&status))
                } else {
                    RPCError::Network(NetworkError::new(&status))
                });
            }
            Err(elapsed) => return Err(RPCError::Network(NetworkError::new(&elapsed))),
        };
        let result: Result<Resp, RaftError<NodeId, E>> =
            serde_json::from_slice(&reply.data).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

#[derive(Clone, Copy)]
enum RpcKind {
    Append,
    Vote,
    Snapshot,
}

impl RaftNetwork<TypeConfig> for GrpcNetwork {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        self.call(RpcKind::Append, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        self.call(RpcKind::Snapshot, &rpc, &option).await
    }

    async fn vote(&mut self, rpc: VoteRequest<NodeId>, option: RPCOption) -> Result<VoteResponse<NodeId>, RpcErr> {
        self.call(RpcKind::Vote, &rpc, &option).await
    }
}

/// The Raft gRPC service a coordinator serves to its peers.
#[derive(Clone)]
pub struct RaftGrpcService {
    raft: Raft,
}

impl RaftGrpcService {
    pub fn new(raft: Raft) -> Self {
        RaftGrpcService { raft }
    }

    pub fn into_server(self) -> RaftServer<Self> {
        RaftServer::new(self)
            .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
    }
}

fn decode<T: DeserializeOwned>(msg: tonic::Request<RaftMessage>) -> Result<T, tonic::Status> {
    serde_json::from_slice(&msg.into_inner().data)
        .map_err(|e| tonic::Status::invalid_argument(format!("malformed raft message: {e}")))
}

fn encode<T: Serialize>(value: &T) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
    let data = serde_json::to_vec(value).map_err(|e| tonic::Status::internal(e.to_string()))?;
    Ok(tonic::Response::new(RaftMessage { data }))
}

#[tonic::async_trait]
impl RaftRpc for RaftGrpcService {
    async fn append_entries(
        &self,
        request: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let rpc: AppendEntriesRequest<TypeConfig> = decode(request)?;
        encode(&self.raft.append_entries(rpc).await)
    }

    async fn vote(&self, request: tonic::Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let rpc: VoteRequest<NodeId> = decode(request)?;
        encode(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let rpc: InstallSnapshotRequest<TypeConfig> = decode(request)?;
        encode(&self.raft.install_snapshot(rpc).await)
    }
}
