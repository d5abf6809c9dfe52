//! The coordinator's proxy to worker agents' log streams: `ReadLogs` of the user API and the
//! web view's log tail both open a job part's output through [`open_worker_logs`]; `srun` on
//! another node of the job reads a step's task output through [`open_worker_step_output`];
//! `corral image` reaches a node's agent through `Coordinator::node_agent`; `corral attach`
//! through [`open_worker_attach`].

use crate::Coordinator;
use corral_proto::v1::worker_agent_client::WorkerAgentClient;
use corral_proto::v1::{self as pb};
use corral_types::Job;
use std::time::Duration;
use tonic::Status;

/// How long connecting to a worker agent may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl Coordinator {
    /// Opens the output of part `req.rank` of `job` on the worker agent of that part's node.
    /// `Ok(None)`: the job holds no allocation (never placed, or between runs), so no worker has
    /// its output. A node that is no longer registered is `NotFound`; an agent that cannot be
    /// reached is `Unavailable`, naming the node and its address.
    pub(crate) async fn open_worker_logs(
        &self,
        job: &Job,
        req: pb::ReadLogsRequest,
    ) -> Result<Option<tonic::Streaming<pb::LogChunk>>, Status> {
        let Some(allocation) = &job.allocation else { return Ok(None) };
        // The part's node: the rank is its index in the allocation.
        let node = allocation.parts().nth(req.rank as usize).map(|(n, _)| n.to_string()).ok_or_else(|| {
            Status::invalid_argument(format!("job {} has no rank {} in its current run", job.id, req.rank))
        })?;
        let mut client = self.agent_client(job, &node).await?;
        let upstream =
            client.read_logs(req).await.map_err(|e| unreachable_agent(job, &node, &e.message()))?.into_inner();
        Ok(Some(upstream))
    }

    /// Opens one task's output of a step on the worker agent of `node`, where it runs.
    pub(crate) async fn open_worker_step_output(
        &self,
        job: &Job,
        node: &str,
        req: pb::ReadStepOutputRequest,
    ) -> Result<tonic::Streaming<pb::LogChunk>, Status> {
        let mut client = self.agent_client(job, node).await?;
        let upstream = client.read_step_output(req).await.map_err(|e| unreachable_agent(job, node, &e.message()))?;
        Ok(upstream.into_inner())
    }

    /// Opens `corral attach`'s process on the worker agent of `node`, where part of `job` runs:
    /// `input` (its start, then its stdin) goes there, its output comes back.
    pub(crate) async fn open_worker_attach(
        &self,
        job: &Job,
        node: &str,
        input: impl tokio_stream::Stream<Item = pb::AttachInput> + Send + 'static,
    ) -> Result<tonic::Streaming<pb::AttachOutput>, Status> {
        let mut client = self.agent_client(job, node).await?;
        match client.attach(input).await {
            Ok(upstream) => Ok(upstream.into_inner()),
            // The agent's own refusal (the run just ended, an image job) is the caller's answer.
            Err(e) if e.code() != tonic::Code::Unavailable && e.code() != tonic::Code::Unknown => Err(e),
            Err(e) => Err(unreachable_agent(job, node, &e.message())),
        }
    }

    /// A client of the worker agent of `node`, where part of `job` runs.
    async fn agent_client(
        &self,
        job: &Job,
        node: &str,
    ) -> Result<WorkerAgentClient<tonic::transport::Channel>, Status> {
        let address = self
            .store()
            .read()
            .state
            .nodes
            .get(node)
            .map(|n| n.spec.address.clone())
            .ok_or_else(|| Status::not_found(format!("node {node} of job {} is not registered", job.id)))?;
        let unreachable = |e: &dyn std::fmt::Display| unreachable_agent(job, &format!("{node} at {address}"), e);
        self.connect_agent(node, &address).await.map_err(|e| unreachable(&e))
    }

    /// A client of the worker agent of `node` (`corral image`); the error is one line for the
    /// caller's list of nodes that failed.
    pub(crate) async fn node_agent(&self, node: &str) -> Result<WorkerAgentClient<tonic::transport::Channel>, String> {
        let address = self
            .store()
            .read()
            .state
            .nodes
            .get(node)
            .map(|n| n.spec.address.clone())
            .ok_or_else(|| format!("node {node} is not registered"))?;
        self.connect_agent(node, &address).await.map_err(|e| format!("its agent at {address} is unreachable: {e}"))
    }

    async fn connect_agent(
        &self,
        node: &str,
        address: &str,
    ) -> Result<WorkerAgentClient<tonic::transport::Channel>, String> {
        let unreachable = |e: &dyn std::fmt::Display| e.to_string();
        // Over TLS the connector does the handshake: the agent must hold the node's worker
        // certificate, or the request is never sent.
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| unreachable(&e))?
            .connect_timeout(CONNECT_TIMEOUT);
        let channel = match &self.security().client_tls {
            Some(tls) => tls
                .connect(endpoint, address, corral_security::ExpectedServer::Worker { node: node.to_string() })
                .await
                .map_err(|e| unreachable(&e))?,
            None => endpoint.connect().await.map_err(|e| unreachable(&e))?,
        };
        Ok(WorkerAgentClient::new(channel)
            .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES))
    }
}

/// The error when the agent of `node` cannot be reached or refuses.
fn unreachable_agent(job: &Job, node: &str, e: &dyn std::fmt::Display) -> Status {
    // The prefix tells clients not to retry: another coordinator cannot reach it either.
    Status::unavailable(format!("logs of job {} are on node {node}, which is unreachable: {e}", job.id))
}
