//! The worker gateway's step calls: `srun` inside a job (`CreateStep`, forwarded by the worker
//! agent of the node where the `srun` runs), the nodes' reports that their tasks of a step are
//! gone (`ReportStepEnded`), the signals `srun` forwards (`SignalStep`) and the output of the
//! step's tasks on other nodes that `srun` relays (`ReadStepOutput`, proxied from the agent of
//! the task's node as `corral logs` is).
//!
//! Over TLS a worker acts only for the node its certificate names, and only for jobs with a part
//! there: an in-job command can reach no other job through its node.

use super::Gateway;
use crate::CoordError;
use corral_core::{ApplyError, Command, Outcome};
use corral_proto::v1::{self as pb};
use std::pin::Pin;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// A task's output, chunk by chunk, as the agent of its node streams it.
pub(super) type OutputStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;

impl Gateway {
    /// The node a step call speaks for: the certificate's name over TLS, else the request's.
    fn calling_node<T>(&self, request: &Request<T>, action: &str, named: &str) -> Result<String, Status> {
        self.require_node(request, action, named)?;
        let node = self.coord.worker_identity(request).unwrap_or_else(|| named.to_string());
        if node.is_empty() {
            return Err(Status::invalid_argument("missing node: name the node the call comes from"));
        }
        Ok(node)
    }

    /// A new step of run `epoch` of a job that has a part, not ended, on the calling node.
    pub(super) async fn create_step_call(
        &self,
        request: Request<pb::CreateStepRequest>,
    ) -> Result<Response<pb::CreateStepResponse>, Status> {
        self.coord.worker_term()?;
        let node = self.calling_node(&request, "create step", &request.get_ref().node)?;
        let r = request.into_inner();
        let part_here = {
            let data = self.coord.store().read();
            let alloc = data.state.jobs.get(&r.job_id).and_then(|j| j.allocation.as_ref());
            alloc.is_some_and(|a| a.gpus_on(&node).is_some() && !a.part_ended(&node))
        };
        if !part_here {
            return Err(Status::failed_precondition(format!(
                "job {} does not run on node {node}: srun works inside the job's own allocation",
                r.job_id
            )));
        }
        let spec = r.spec.ok_or_else(|| Status::invalid_argument("missing step spec"))?.into();
        let command = Command::CreateStep { job_id: r.job_id, epoch: r.epoch, request_id: r.request_id, spec };
        let ts = self.coord.timestamps(1).await?;
        match self.coord.propose_indexed(ts, command).await? {
            (Outcome::Step { step, duplicate }, revision) => {
                if !duplicate {
                    tracing::info!(job_id = r.job_id, step = step.id, tasks = step.ntasks(), node = %node, "step created");
                }
                Ok(Response::new(pb::CreateStepResponse { step: Some(step.as_ref().into()), revision }))
            }
            (other, _) => Err(Status::internal(format!("unexpected outcome of create step: {other:?}"))),
        }
    }

    pub(super) async fn report_step_ended_call(
        &self,
        request: Request<pb::ReportStepEndedRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.coord.worker_term()?;
        if let Err(revision) = self.job_on_own_node(&request, "report step ended", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false, revision }));
        }
        let node = self.calling_node(&request, "report step ended", &request.get_ref().node)?;
        let r = request.into_inner();
        let mut end: corral_types::StepNodeEnd =
            r.end.ok_or_else(|| Status::invalid_argument("missing step report"))?.into();
        end.node = node;
        self.report(Command::StepEnded { job_id: r.job_id, epoch: r.epoch, step: r.step, end }).await
    }

    pub(super) async fn signal_step_call(
        &self,
        request: Request<pb::SignalStepRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.coord.worker_term()?;
        if let Err(revision) = self.job_on_own_node(&request, "signal step", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false, revision }));
        }
        self.calling_node(&request, "signal step", &request.get_ref().node)?;
        let r = request.into_inner();
        let ts = self.coord.timestamps(1).await?;
        match self
            .coord
            .propose_indexed(ts, Command::SignalStep { job_id: r.job_id, step: r.step, signal: r.signal })
            .await
        {
            Ok((outcome, revision)) => {
                Ok(Response::new(pb::ReportResponse { accepted: outcome != Outcome::Stale, revision }))
            }
            Err(CoordError::Rejected(ApplyError::NoSuchJob(_))) => {
                let revision = self.coord.store().read().applied_index();
                Ok(Response::new(pb::ReportResponse { accepted: false, revision }))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// One task's output of a step of a job that has a live part on the calling node, from the
    /// agent of the task's node. Cost: a lookup in the state, then one proxied stream (gRPC's
    /// flow control holds the agent back while `srun` reads slowly).
    pub(super) async fn read_step_output_call(
        &self,
        request: Request<pb::ReadStepOutputRequest>,
    ) -> Result<Response<OutputStream>, Status> {
        let node = self.calling_node(&request, "read step output", &request.get_ref().node)?;
        let r = request.into_inner();
        let job = {
            let data = self.coord.store().read();
            data.state.jobs.get(&r.job_id).cloned()
        };
        let job = job.ok_or_else(|| Status::not_found(format!("no job {}", r.job_id)))?;
        let Some(allocation) = job.allocation.as_ref().filter(|a| a.gpus_on(&node).is_some() && !a.part_ended(&node))
        else {
            return Err(Status::failed_precondition(format!(
                "job {} does not run on node {node}: srun reads only its own job's steps",
                r.job_id
            )));
        };
        let step = job.steps.steps.iter().find(|s| s.id == r.step && s.epoch == allocation.epoch);
        let step = step.ok_or_else(|| Status::not_found(format!("job {} has no step {}", r.job_id, r.step)))?;
        let task_node = step.nodes.iter().find(|n| (n.first_task..n.first_task + n.tasks).contains(&r.task));
        let task_node = task_node
            .ok_or_else(|| Status::not_found(format!("step {}.{} has no task {}", r.job_id, r.step, r.task)))?;
        let request =
            pb::ReadStepOutputRequest { node, job_id: r.job_id, step: r.step, task: r.task, epoch: allocation.epoch };
        let upstream = self.coord.open_worker_step_output(&job, &task_node.node, request).await?;
        Ok(Response::new(Box::pin(upstream)))
    }
}
