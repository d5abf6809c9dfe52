//! The user API's job control: cancel one job (or an array task not created yet), cancel the
//! jobs a filter selects, and hold, release, requeue, signal or update a job.

use super::{filter_tenant, own_tenant_filter};
use crate::filter::JobFilter;
use crate::snapshot::{Snapshot, Target};
use crate::Coordinator;
use corral_core::{Command, Outcome};
use corral_proto::v1::{self as pb};
use tonic::{Request, Response, Status};

/// Jobs one `CancelJobs` command cancels at most.
const CANCEL_CHUNK: usize = 10_000;

pub(super) async fn cancel_job(
    coord: &Coordinator,
    request: Request<pb::CancelJobRequest>,
) -> Result<Response<pb::Job>, Status> {
    let who = coord.principal(&request, "cancel")?;
    let req = request.get_ref();
    let owned = |job: &corral_types::Job| coord.require_owner(&request, "cancel", "cancel", &who, job);
    let job = match coord.snapshot().resolve(req.job_id, req.array_index, owned)? {
        Target::Job(job) => job,
        Target::Uncreated { array, index } => {
            let command = Command::CancelArrayTask { array: array.id, index, reason: "cancelled by user".into() };
            return match coord.propose(command).await? {
                Outcome::Job(job) => Ok(Response::new((&*job).into())),
                other => Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
            };
        }
    };
    let job_id = job.id;
    if job.state.is_terminal() {
        // Nothing to stop (and a job in the history is no longer in the state machine).
        return Ok(Response::new((&job).into()));
    }
    if who.is_admin() && coord.security().auth_enabled() {
        coord.audit_admin(&request, "cancel", &who, format!("job {job_id} of tenant {}", job.spec.tenant));
    }
    match coord.propose(Command::CancelJob { job_id, reason: "cancelled by user".into() }).await? {
        Outcome::Job(job) => Ok(Response::new((&*job).into())),
        other => Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
    }
}

pub(super) async fn control_job(
    coord: &Coordinator,
    request: Request<pb::ControlJobRequest>,
) -> Result<Response<pb::Job>, Status> {
    let req = request.get_ref().clone();
    let action = req.action.as_str();
    if !matches!(action, "hold" | "release" | "requeue" | "signal" | "update") {
        return Err(Status::invalid_argument(format!(
            "unknown job action '{action}' (hold, release, requeue, signal or update)"
        )));
    }
    let who = coord.principal(&request, action)?;
    let snapshot = coord.snapshot();
    let owned = |job: &corral_types::Job| coord.require_owner(&request, action, action, &who, job);
    let job = match snapshot.resolve(req.job_id, req.array_index, owned)? {
        Target::Job(job) => job,
        Target::Uncreated { array, index } => {
            return Err(Status::failed_precondition(format!(
                "task {}_{index} was not created yet: {action} the array {} instead",
                array.id, array.id
            )))
        }
    };
    if job.state.is_terminal() && !snapshot.read().state.jobs.contains_key(&job.id) {
        return Err(Status::failed_precondition(format!(
            "job {} ended ({}) and is in the history: it can no longer be changed",
            job.display_id(),
            job.state
        )));
    }
    let command = match action {
        "hold" => Command::HoldJob { job_id: job.id, hold: true },
        "release" => Command::HoldJob { job_id: job.id, hold: false },
        "requeue" => Command::RequeueJob { job_id: job.id },
        "signal" => Command::SignalJob { job_id: job.id, signal: req.signal },
        _ => {
            let update = corral_core::JobUpdate {
                time_limit_secs: req.time_limit_secs,
                priority_class: req.priority_class.clone(),
                gpus: req.gpus,
                name: req.name.clone(),
            };
            if update == corral_core::JobUpdate::default() {
                return Err(Status::invalid_argument("nothing to update: give --time, --priority, --gpus or --name"));
            }
            Command::UpdateJob { job_id: job.id, update, admin: who.is_admin() }
        }
    };
    let outcome = coord.propose(command).await?;
    coord.audit_admin(
        &request,
        &format!("job {action}"),
        &who,
        format!("job {} of tenant {}", job.display_id(), job.spec.tenant),
    );
    // After the write: the job as applied, and the leader's latest pass.
    let snapshot = coord.snapshot();
    let job = match outcome {
        Outcome::Job(job) => *job,
        _ => snapshot.job(job.id)?,
    };
    Ok(Response::new(snapshot.job_reply(&job)))
}

pub(super) async fn cancel_jobs(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::CancelJobsRequest>,
) -> Result<Response<pb::CancelJobsResponse>, Status> {
    let who = coord.principal(&request, "cancel")?;
    own_tenant_filter(coord, &request, "cancel", &who, request.get_ref().tenant.as_deref())?;
    let req = request.get_ref();
    let filter = JobFilter::of_cancel(req, filter_tenant(&who, req.tenant.as_deref()))?;
    let ids: Vec<u64> = {
        let data = snapshot.read();
        data.state.live_jobs().filter(|j| filter.matches(j) && !j.cancel_requested).map(|j| j.id).collect()
    };
    if who.is_admin() && coord.security().auth_enabled() {
        let scope = filter.tenant.as_deref().map_or("every tenant".to_string(), |t| format!("tenant {t}"));
        coord.audit_admin(&request, "cancel", &who, format!("{} jobs of {scope}", ids.len()));
    }
    // In bounded commands: each is one log entry of at most CANCEL_CHUNK jobs.
    let mut job_ids = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(CANCEL_CHUNK) {
        let command = Command::CancelJobs { job_ids: chunk.to_vec(), reason: "cancelled by user".into() };
        match coord.propose(command).await? {
            Outcome::JobsCancelled(done) => job_ids.extend(done),
            other => return Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
        }
    }
    Ok(Response::new(pb::CancelJobsResponse { job_ids }))
}
