//! The user API's job control: cancel one job (or an array task not created yet), cancel the
//! jobs a filter selects, and hold, release, requeue, signal or update a job. Each handler's
//! doc comment states what bounds its cost; the owner is checked before anything is done.

use super::{filter_tenant, own_tenant_filter};
use crate::filter::JobFilter;
use crate::snapshot::{Snapshot, Target};
use crate::{listing, Coordinator};
use corral_core::{Command, Outcome};
use corral_proto::v1::{self as pb};
use std::ops::Bound;
use tonic::{Request, Response, Status};

/// Jobs one `CancelJobs` command cancels at most.
pub(crate) const CANCEL_CHUNK: usize = 10_000;

/// `Corral.CancelJob`. Cost: a lookup or two (the array's owner first, for a task reference)
/// and one log entry.
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

/// `Corral.ControlJob` (hold, release, requeue, signal, update). Cost: a lookup or two (the
/// array's owner first, for a task reference) and one log entry; a job keeps at most
/// `corral_core::MAX_SIGNALS` signals.
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

/// `Corral.CancelJobs`. Cost: the jobs that match when the call is made are found page by page
/// — at most `CANCEL_CHUNK` of them or `listing::SCAN_BUDGET` jobs looked at per page, on a
/// constant-time copy of the job map (no state lock held while walking) — and each page is
/// cancelled in one log entry before the next is looked for. The reply lists the cancelled ids.
pub(super) async fn cancel_jobs(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::CancelJobsRequest>,
) -> Result<Response<pb::CancelJobsResponse>, Status> {
    let who = coord.principal(&request, "cancel")?;
    own_tenant_filter(coord, &request, "cancel", &who, request.get_ref().tenant.as_deref())?;
    let req = request.get_ref();
    let filter = JobFilter::of_cancel(req, filter_tenant(&who, req.tenant.as_deref()))?;
    let scope = filter.tenant.as_deref().map_or("every tenant".to_string(), |t| format!("tenant {t}"));
    // The jobs submitted later are not this call's: the walk ends at the newest job now.
    let Some(last) = snapshot.read().state.jobs.keys().next_back().copied() else {
        return Ok(Response::new(pb::CancelJobsResponse { job_ids: Vec::new() }));
    };
    let mut job_ids = Vec::new();
    let mut cursor = Bound::Unbounded;
    loop {
        let (chunk, next) = {
            let jobs = coord.snapshot().read().state.jobs.clone();
            cancel_page(&jobs, &filter, cursor, last)
        };
        if !chunk.is_empty() {
            if who.is_admin() && coord.security().auth_enabled() {
                coord.audit_admin(&request, "cancel", &who, format!("{} jobs of {scope}", chunk.len()));
            }
            let command = Command::CancelJobs { job_ids: chunk, reason: "cancelled by user".into() };
            match coord.propose(command).await? {
                Outcome::JobsCancelled(done) => job_ids.extend(done),
                other => return Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
            }
        }
        match next {
            Some(id) => cursor = Bound::Excluded(id),
            None => return Ok(Response::new(pb::CancelJobsResponse { job_ids })),
        }
    }
}

/// One page of a bulk cancel: the live jobs of `jobs` after `cursor`, up to job `last`, that
/// `filter` selects and no cancel reached yet — at most `CANCEL_CHUNK`, after looking at most
/// `listing::SCAN_BUDGET` jobs. Returns them and the last id looked at when more may follow.
fn cancel_page(jobs: &corral_core::Jobs, filter: &JobFilter, cursor: Bound<u64>, last: u64) -> (Vec<u64>, Option<u64>) {
    let mut chunk = Vec::new();
    let mut scanned = 0;
    for (id, job) in jobs.range((cursor, Bound::Included(last))) {
        scanned += 1;
        if !job.state.is_terminal() && !job.cancel_requested && filter.matches(job) {
            chunk.push(*id);
        }
        if (chunk.len() >= CANCEL_CHUNK || scanned >= listing::SCAN_BUDGET) && *id < last {
            return (chunk, Some(*id));
        }
    }
    (chunk, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::LIVE_STATES;
    use corral_types::{Job, JobSpec, JobState, Timestamp};

    fn jobs(count: u64, tenant_of: impl Fn(u64) -> &'static str) -> corral_core::Jobs {
        (1..=count)
            .map(|id| {
                let spec = JobSpec { tenant: tenant_of(id).into(), ..Default::default() };
                (id, Job::pending(id, spec, format!("r{id}"), Timestamp(id)))
            })
            .collect()
    }

    /// Follows every page of a bulk cancel, as the handler does between its log entries.
    fn pages(jobs: &corral_core::Jobs, filter: &JobFilter, last: u64) -> Vec<Vec<u64>> {
        let (mut pages, mut cursor) = (Vec::new(), Bound::Unbounded);
        loop {
            let (chunk, next) = cancel_page(jobs, filter, cursor, last);
            pages.push(chunk);
            match next {
                Some(id) => cursor = Bound::Excluded(id),
                None => return pages,
            }
        }
    }

    #[test]
    fn a_bulk_cancel_goes_in_bounded_pages_up_to_the_newest_job_of_the_call() {
        let total = 2 * CANCEL_CHUNK as u64 + 5;
        let mut jobs = jobs(total, |_| "a");
        jobs.get_mut(&3).expect("job 3").state = JobState::Succeeded;
        jobs.get_mut(&4).expect("job 4").cancel_requested = true;
        let filter = JobFilter { states: LIVE_STATES.into(), ..Default::default() };
        let pages = pages(&jobs, &filter, total - 1);
        assert_eq!(pages.iter().map(Vec::len).collect::<Vec<_>>(), vec![CANCEL_CHUNK, CANCEL_CHUNK, 2]);
        let all: Vec<u64> = pages.concat();
        assert!(!all.contains(&3) && !all.contains(&4), "ended or already cancelled jobs are left");
        assert!(!all.contains(&total), "a job newer than the call is not its");
        assert_eq!(all.len() as u64, total - 3);
    }

    #[test]
    fn a_sparse_filter_looks_at_a_bounded_number_of_jobs_per_page() {
        let total = listing::SCAN_BUDGET as u64 + 10;
        let jobs = jobs(total, |id| if id == 7 || id == total { "b" } else { "a" });
        let filter = JobFilter { states: LIVE_STATES.into(), tenant: Some("b".into()), ..Default::default() };
        let pages = pages(&jobs, &filter, total);
        assert_eq!(pages, vec![vec![7], vec![total]], "the budget ends the first page");
    }
}
