//! The user-facing `Corral` gRPC service: submit, show, list, cancel, logs, nodes.

use crate::{CoordError, Coordinator};
use corral_core::{Command, Outcome};
use corral_proto::v1::corral_server::{Corral, CorralServer};
use corral_proto::v1::worker_agent_client::WorkerAgentClient;
use corral_proto::v1::{self as pb};
use corral_types::{Job, JobSpec};
use std::pin::Pin;
use std::time::Duration;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub(crate) fn server(coord: Coordinator) -> CorralServer<Api> {
    CorralServer::new(Api { coord })
        .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
}

pub(crate) struct Api {
    coord: Coordinator,
}

impl Api {
    fn job(&self, job_id: u64) -> Result<Job, CoordError> {
        let data = self.coord.inner.node.state.read();
        data.state.jobs.get(&job_id).cloned().ok_or_else(|| CoordError::NotFound(format!("job {job_id} not found")))
    }

    fn node_address(&self, node: &str) -> Option<String> {
        self.coord.inner.node.state.read().state.nodes.get(node).map(|n| n.spec.address.clone())
    }
}

/// Most jobs one `SubmitBatch` call may carry.
const MAX_BATCH: usize = 10_000;

/// A job as the API returns it: a pending job without a reason of its own shows why the
/// leader's last scheduling pass left it waiting.
fn job_reply(job: &Job, pending_reasons: &std::collections::BTreeMap<u64, String>) -> pb::Job {
    let mut reply = pb::Job::from(job);
    if job.state == corral_types::JobState::Pending && reply.reason.is_none() {
        reply.reason = pending_reasons.get(&job.id).cloned();
    }
    reply
}

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;

#[tonic::async_trait]
impl Corral for Api {
    async fn submit(&self, request: Request<pb::SubmitRequest>) -> Result<Response<pb::SubmitResponse>, Status> {
        let req = request.into_inner();
        let spec: JobSpec = req.spec.ok_or_else(|| Status::invalid_argument("missing job spec"))?.try_into()?;
        // Fail fast on what the state machine would refuse anyway; apply() checks again.
        self.coord.inner.node.state.read().state.check_submit(&spec).map_err(CoordError::from)?;
        let (job_id, duplicate) = self.coord.submit(req.request_id, spec).await?;
        Ok(Response::new(pb::SubmitResponse { job_id, duplicate }))
    }

    async fn submit_batch(
        &self,
        request: Request<pb::SubmitBatchRequest>,
    ) -> Result<Response<pb::SubmitBatchResponse>, Status> {
        let req = request.into_inner();
        if req.jobs.len() > MAX_BATCH {
            return Err(Status::invalid_argument(format!(
                "batch of {} jobs is too large: send at most {MAX_BATCH} per call",
                req.jobs.len()
            )));
        }
        let mut jobs = Vec::with_capacity(req.jobs.len());
        for (i, job) in req.jobs.into_iter().enumerate() {
            let spec = job.spec.ok_or_else(|| Status::invalid_argument(format!("job {i} of the batch has no spec")))?;
            let spec: JobSpec = spec.try_into()?;
            jobs.push((job.request_id, spec));
        }
        let results = match self.coord.propose(Command::SubmitJobs { jobs }).await? {
            Outcome::JobsSubmitted(results) => results,
            other => return Err(Status::internal(format!("unexpected outcome of batch submit: {other:?}"))),
        };
        let results = results
            .into_iter()
            .map(|r| match r {
                Ok((job_id, duplicate)) => pb::SubmitResult { job_id, duplicate, error: String::new() },
                Err(e) => pb::SubmitResult { job_id: 0, duplicate: false, error: e.to_string() },
            })
            .collect();
        Ok(Response::new(pb::SubmitBatchResponse { results }))
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::Job>, Status> {
        self.coord.linearizable().await?;
        let job = self.job(request.into_inner().job_id)?;
        let reasons = self.coord.inner.pending_reasons.lock().unwrap_or_else(|p| p.into_inner());
        Ok(Response::new(job_reply(&job, &reasons)))
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        self.coord.linearizable().await?;
        let req = request.into_inner();
        let data = self.coord.inner.node.state.read();
        let tenant_ok = |j: &Job| req.tenant.as_ref().is_none_or(|t| *t == j.spec.tenant);
        let reasons = self.coord.inner.pending_reasons.lock().unwrap_or_else(|p| p.into_inner());
        let with_reason = |j: &Job| job_reply(j, &reasons);
        let jobs: Vec<pb::Job> = if req.all {
            data.state.jobs.values().filter(|j| tenant_ok(j)).map(with_reason).collect()
        } else {
            data.state.live_jobs().filter(|j| tenant_ok(j)).map(with_reason).collect()
        };
        Ok(Response::new(pb::ListJobsResponse { jobs }))
    }

    async fn cancel_job(&self, request: Request<pb::CancelJobRequest>) -> Result<Response<pb::Job>, Status> {
        let job_id = request.into_inner().job_id;
        match self.coord.propose(Command::CancelJob { job_id, reason: "cancelled by user".into() }).await? {
            Outcome::Job(job) => Ok(Response::new((&*job).into())),
            other => Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
        }
    }

    type ReadLogsStream = LogStream;

    async fn read_logs(&self, request: Request<pb::ReadLogsRequest>) -> Result<Response<LogStream>, Status> {
        let req = request.into_inner();
        let mut job = self.job(req.job_id)?;
        // With --follow, wait until the job is placed somewhere (or ends without running).
        while req.follow && job.allocation.is_none() && !job.state.is_terminal() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            job = self.job(req.job_id)?;
        }
        let Some(allocation) = job.allocation else {
            return Ok(Response::new(Box::pin(tokio_stream::empty())));
        };
        let address = self.node_address(&allocation.node).ok_or_else(|| {
            Status::not_found(format!("node {} of job {} is not registered", allocation.node, job.id))
        })?;
        let unreachable = |e: &dyn std::fmt::Display| {
            Status::unavailable(format!(
                "logs of job {} are on node {} at {address}, which is unreachable: {e}",
                job.id, allocation.node
            ))
        };
        let mut client = WorkerAgentClient::connect(format!("http://{address}")).await.map_err(|e| unreachable(&e))?;
        let upstream = client.read_logs(req).await.map_err(|e| unreachable(&e.message()))?.into_inner();
        Ok(Response::new(Box::pin(upstream)))
    }

    async fn list_segments(
        &self,
        request: Request<pb::ListSegmentsRequest>,
    ) -> Result<Response<pb::ListSegmentsResponse>, Status> {
        self.coord.linearizable().await?;
        let req = request.into_inner();
        let data = self.coord.inner.node.state.read();
        let segments = data
            .state
            .ledger
            .values()
            .filter(|g| req.tenant.as_ref().is_none_or(|t| *t == g.tenant))
            .filter(|g| req.job_id.is_none_or(|j| j == g.job_id))
            .filter(|g| req.since.is_none_or(|s| g.end.0 >= s))
            .filter(|g| req.until.is_none_or(|u| g.start.0 < u))
            .map(corral_proto::segment_to_pb)
            .collect();
        Ok(Response::new(pb::ListSegmentsResponse { segments }))
    }

    async fn get_timestamps(
        &self,
        request: Request<pb::GetTimestampsRequest>,
    ) -> Result<Response<pb::GetTimestampsResponse>, Status> {
        let count = request.into_inner().count;
        let first = self.coord.timestamps(u64::from(count)).await?;
        Ok(Response::new(pb::GetTimestampsResponse { first: first.0, count }))
    }

    async fn list_nodes(&self, _: Request<pb::ListNodesRequest>) -> Result<Response<pb::ListNodesResponse>, Status> {
        self.coord.linearizable().await?;
        let data = self.coord.inner.node.state.read();
        let nodes = data
            .state
            .nodes
            .values()
            .map(|n| {
                let live = self.coord.inner.liveness.get(&n.spec.name).filter(|l| l.heard);
                let jobs: Vec<&Job> = data.state.jobs_on_node(&n.spec.name).collect();
                let gpus = n
                    .spec
                    .gpus
                    .iter()
                    .map(|g| {
                        let health = live.as_ref().and_then(|l| l.gpus.iter().find(|h| h.index == g.index));
                        let on_gpu: Vec<&&Job> = jobs
                            .iter()
                            .filter(|j| j.allocation.as_ref().is_some_and(|a| a.gpus.contains(&g.index)))
                            .collect();
                        let job_ids: Vec<u64> = on_gpu.iter().map(|j| j.id).collect();
                        let slices = on_gpu
                            .iter()
                            .filter_map(|j| {
                                let slice = j.allocation.as_ref()?.slice.as_ref()?;
                                Some(pb::GpuSliceView { job_id: j.id, slice: slice.to_string() })
                            })
                            .collect();
                        let state = if health.is_some_and(|h| h.dirty) {
                            "dirty"
                        } else if health.is_some_and(|h| !h.problems.is_empty()) {
                            "unhealthy"
                        } else if !job_ids.is_empty() {
                            "allocated"
                        } else if n.state == corral_types::NodeState::Up {
                            "idle"
                        } else {
                            "unavailable"
                        };
                        pb::GpuView {
                            index: g.index,
                            uuid: g.uuid.clone(),
                            model: g.model.clone(),
                            memory_mib: g.memory_mib,
                            state: state.to_string(),
                            temperature_c: health.map(|h| h.temperature_c).unwrap_or(0),
                            utilization_percent: health.map(|h| h.utilization_percent).unwrap_or(0),
                            memory_used_mib: health.map(|h| h.memory_used_mib).unwrap_or(0),
                            job_ids,
                            problems: health.map(|h| h.problems.clone()).unwrap_or_default(),
                            dirty_reason: health.map(|h| h.dirty_reason.clone()).unwrap_or_default(),
                            dirty_job_id: health.and_then(|h| h.dirty_job_id),
                            xid_errors: health.map(|h| h.xid_errors).unwrap_or(0),
                            power_mw: health.map(|h| h.power_mw).unwrap_or(0),
                            slices,
                            mig_capable: g.supports_mig(),
                        }
                    })
                    .collect();
                pb::NodeView {
                    name: n.spec.name.clone(),
                    address: n.spec.address.clone(),
                    state: n.state.as_str().to_string(),
                    epoch: n.epoch,
                    gpus,
                    cpu_millis: n.spec.cpu_millis,
                    memory_bytes: n.spec.memory_bytes,
                    heartbeat_age_ms: live.map(|l| l.last_seen.elapsed().as_millis() as u64),
                }
            })
            .collect();
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }
}
