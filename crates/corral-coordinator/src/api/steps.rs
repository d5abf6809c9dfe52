//! The user API's step calls: `srun` in a `corral alloc` session runs on the submit host, off
//! the job's nodes, so it reaches its job through the coordinator, as its owner (the job's
//! tenant or an admin), instead of through a node's in-job service with a run secret.
//! `CreateJobStep` creates a step of the run the session was granted (a requeued job's new
//! run refuses it: apply checks the epoch), `SignalJobStep` forwards srun's signals, and
//! `ReadJobStepOutput` proxies one task's output from the agent of its node, as the worker
//! gateway's `ReadStepOutput` does for an in-job srun.
//!
//! Cost: each call looks up one job in a snapshot; a create or signal proposes one command; a
//! read is one proxied stream, counted against the caller's open watches.

use crate::watch::Watches;
use crate::{CoordError, Coordinator};
use corral_core::{ApplyError, Command, Outcome};
use corral_proto::v1::{self as pb};
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

/// A task's output, chunk by chunk, as the agent of its node streams it.
pub(super) type StepOutputStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;

/// `Corral.CreateJobStep`: a step of run `epoch` of the caller's own job.
pub(super) async fn create_job_step(
    coord: &Coordinator,
    request: Request<pb::CreateStepRequest>,
) -> Result<Response<pb::CreateStepResponse>, Status> {
    let who = coord.principal(&request, "create step")?;
    let job = coord.snapshot().job(request.get_ref().job_id)?;
    coord.require_owner(&request, "create step", "create a step of", &who, &job)?;
    let r = request.into_inner();
    let spec: corral_types::StepSpec = r.spec.ok_or_else(|| Status::invalid_argument("missing step spec"))?.into();
    spec.validate().map_err(Status::invalid_argument)?;
    let command = Command::CreateStep { job_id: r.job_id, epoch: r.epoch, request_id: r.request_id, spec };
    let ts = coord.timestamps(1).await?;
    match coord.propose_indexed(ts, command).await? {
        (Outcome::Step { step, duplicate }, revision) => {
            if !duplicate {
                tracing::info!(job_id = r.job_id, step = step.id, tasks = step.ntasks(), "step created from a session");
            }
            Ok(Response::new(pb::CreateStepResponse { step: Some(step.as_ref().into()), revision }))
        }
        (other, _) => Err(Status::internal(format!("unexpected outcome of create step: {other:?}"))),
    }
}

/// `Corral.SignalJobStep`: `signal` to every task of a step of the caller's own job.
pub(super) async fn signal_job_step(
    coord: &Coordinator,
    request: Request<pb::SignalStepRequest>,
) -> Result<Response<pb::ReportResponse>, Status> {
    let who = coord.principal(&request, "signal step")?;
    let job = coord.snapshot().job(request.get_ref().job_id)?;
    coord.require_owner(&request, "signal step", "signal a step of", &who, &job)?;
    let r = request.into_inner();
    let ts = coord.timestamps(1).await?;
    match coord.propose_indexed(ts, Command::SignalStep { job_id: r.job_id, step: r.step, signal: r.signal }).await {
        Ok((outcome, revision)) => {
            Ok(Response::new(pb::ReportResponse { accepted: outcome != Outcome::Stale, revision }))
        }
        Err(CoordError::Rejected(ApplyError::NoSuchJob(_))) => {
            let revision = coord.store().read().applied_index();
            Ok(Response::new(pb::ReportResponse { accepted: false, revision }))
        }
        Err(e) => Err(e.into()),
    }
}

/// `Corral.ReadJobStepOutput`: one task's output of a step of the caller's own running job,
/// from the agent of the task's node.
pub(super) async fn read_job_step_output(
    coord: &Coordinator,
    watches: &Arc<Watches>,
    request: Request<pb::ReadStepOutputRequest>,
) -> Result<Response<StepOutputStream>, Status> {
    let who = coord.principal(&request, "read step output")?;
    let job = coord.snapshot().job(request.get_ref().job_id)?;
    coord.require_owner(&request, "read step output", "read the steps of", &who, &job)?;
    let permit = watches.open(&who)?;
    let r = request.into_inner();
    let Some(allocation) = job.allocation.as_ref() else {
        return Err(Status::failed_precondition(format!(
            "job {} does not run: its steps ended with its run",
            r.job_id
        )));
    };
    let step = job.steps.steps.iter().find(|s| s.id == r.step && s.epoch == allocation.epoch);
    let step = step.ok_or_else(|| Status::not_found(format!("job {} has no step {}", r.job_id, r.step)))?;
    let task_node = step.nodes.iter().find(|n| (n.first_task..n.first_task + n.tasks).contains(&r.task));
    let task_node =
        task_node.ok_or_else(|| Status::not_found(format!("step {}.{} has no task {}", r.job_id, r.step, r.task)))?;
    let request = pb::ReadStepOutputRequest {
        node: task_node.node.clone(),
        job_id: r.job_id,
        step: r.step,
        task: r.task,
        epoch: allocation.epoch,
    };
    let upstream = coord.open_worker_step_output(&job, &task_node.node, request).await?;
    // The watch lasts as long as the stream: the permit goes with it.
    Ok(Response::new(Box::pin(upstream.map(move |chunk| {
        let _ = &permit;
        chunk
    }))))
}
