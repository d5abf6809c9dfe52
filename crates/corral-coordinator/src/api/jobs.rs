//! The user API's job calls: submit (one job or a batch), show, list, watch (one job or a
//! filter), logs, and the billing segments and timestamps clients read.
//!
//! Each handler's doc comment states what bounds its cost: the limits below, the listing's
//! page size and scan budget (`listing.rs`), a job's size (`JobSpec::validate`: command,
//! environment and script are capped, the whole request by the user message limit) and the
//! configuration (`limits.*`, `raft.watch-history`). Ownership is checked first: a caller
//! learns nothing of, and costs nothing for, another tenant's jobs.

use super::{filter_tenant, own_tenant_filter, JobEventStream, JobStream, LogStream};
use crate::auth::Principal;
use crate::filter::{JobFilter, MAX_FILTER_JOB_IDS};
use crate::images::ImagePinner;
use crate::snapshot::{Snapshot, Target};
use crate::watch::{WatchPermit, Watches};
use crate::{listing, CoordError, Coordinator};
use corral_core::ClusterConfig;
use corral_proto::v1::{self as pb};
use corral_types::{JobSpec, Timestamp};
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

/// Most jobs one `SubmitBatch` call may carry.
pub(crate) const MAX_BATCH: usize = 10_000;
/// Most dependencies one job may name (each is looked up at submit and judged by apply).
pub(crate) const MAX_DEPENDENCIES: usize = 256;
/// Most dependencies the jobs of one `SubmitBatch` call name together.
pub(crate) const MAX_BATCH_DEPENDENCIES: usize = 100_000;
/// Most node selectors (`--partition`, `--constraint` labels) of one job: every scheduling
/// pass matches them against the nodes.
pub(crate) const MAX_NODE_SELECTORS: usize = 64;

/// A watched job is sent again at least this often while it waits, so that the reason of the
/// leader's latest scheduling pass reaches the watcher.
const WATCH_REFRESH: Duration = Duration::from_millis(500);

/// The spec as `who` may submit it: a tenant submits only as itself (an empty tenant becomes
/// the token's tenant, or `default` for an admin), a job array only within this coordinator's
/// `[limits]` (checked once the tenant is, in O(ranges)), and the lists that cost work per entry
/// at submit and in every scheduling pass within their limits.
fn own_spec<T>(
    coord: &Coordinator,
    request: &Request<T>,
    who: &Principal,
    mut spec: JobSpec,
) -> Result<JobSpec, Status> {
    slurm_names(&coord.snapshot().read().state.config, who, &mut spec).map_err(Status::invalid_argument)?;
    if spec.tenant.is_empty() {
        spec.tenant = who.tenant().unwrap_or("default").to_string();
    }
    if !who.may_access(&spec.tenant) {
        return Err(coord.deny(
            request,
            "submit",
            &who.describe(),
            Status::permission_denied(format!(
                "permission denied: tenant {} cannot submit jobs as tenant {}",
                who.tenant().unwrap_or_default(),
                spec.tenant
            )),
        ));
    }
    if let Some(array) = &mut spec.array {
        coord.config().array_limits.admit(array).map_err(|e| Status::invalid_argument(e.to_string()))?;
    }
    let dependencies = spec.sched.dependencies.len();
    if dependencies > MAX_DEPENDENCIES {
        return Err(Status::invalid_argument(format!(
            "job names {dependencies} dependencies, at most {MAX_DEPENDENCIES}: depend on fewer jobs (e.g. on an array, or on a job that waits for the others)"
        )));
    }
    let selectors = spec.sched.node_selector.len();
    if selectors > MAX_NODE_SELECTORS {
        return Err(Status::invalid_argument(format!(
            "job asks for {selectors} node labels (--partition/--constraint), at most {MAX_NODE_SELECTORS}"
        )));
    }
    Ok(spec)
}

/// Slurm's account and QOS of `spec` as the policy's `[slurm]` maps them: the account (else the
/// default account, for a job naming no tenant, when its tenant is one `who` may submit as)
/// sets the tenant, the QOS the priority class. An unknown name, or one contradicting an
/// explicit `--tenant`/`--priority`, is one line.
///
/// Without an accounts map an account names a tenant, and without a QOS map a QOS names a
/// class; a name that names none is what Slurm does with accounts it does not enforce (its
/// default, `AccountingStorageEnforce` unset): kept with the job (`SLURM_JOB_ACCOUNT`,
/// `corral show`), and the job's tenant or class is chosen as if it named none.
fn slurm_names(config: &ClusterConfig, who: &Principal, spec: &mut JobSpec) -> Result<(), String> {
    let naming = &config.slurm;
    let account = match (&spec.slurm.account, &naming.default_account) {
        (Some(account), _) => Some(account.clone()),
        (None, Some(default)) if spec.tenant.is_empty() => {
            let tenant = naming.tenant_of(default)?;
            who.may_access(tenant).then(|| default.clone())
        }
        _ => None,
    };
    if let Some(account) = account {
        let names_tenant = config.tenants.is_empty() || config.tenants.contains(&account);
        if !naming.accounts.is_empty() || names_tenant {
            let tenant = naming.tenant_of(&account)?.to_string();
            if !spec.tenant.is_empty() && spec.tenant != tenant {
                return Err(format!(
                    "account '{account}' is tenant '{tenant}', but the job names tenant '{}'",
                    spec.tenant
                ));
            }
            spec.tenant = tenant;
        }
        spec.slurm.account = Some(account);
    }
    if let Some(qos) = &spec.slurm.qos {
        let names_class = config.priority_classes.is_empty() || config.priority_classes.contains_key(qos);
        if !naming.qos.is_empty() || names_class {
            let class = naming.class_of(qos)?.to_string();
            if !spec.priority_class.is_empty() && spec.priority_class != class {
                return Err(format!(
                    "QOS '{qos}' is class '{class}', but the job names class '{}'",
                    spec.priority_class
                ));
            }
            spec.priority_class = class;
        }
    }
    Ok(())
}

/// `Corral.Submit`. Cost: one spec (at most the user message limit; its parts capped by
/// `JobSpec::validate`, its dependencies by `MAX_DEPENDENCIES`, each looked up once in the hot
/// state or the history), checked against the state under its read lock in time bounded by the
/// spec; then one place in the submit queue (`limits.max-queued-submits`, RESOURCE_EXHAUSTED
/// when full) and one log entry, shared with other submits by group commit.
pub(super) async fn submit(
    coord: &Coordinator,
    request: Request<pb::SubmitRequest>,
) -> Result<Response<pb::SubmitResponse>, Status> {
    let who = coord.principal(&request, "submit")?;
    let spec = request.get_ref().spec.clone().ok_or_else(|| Status::invalid_argument("missing job spec"))?;
    let spec = own_spec(coord, &request, &who, spec.try_into()?)?;
    let spec = ImagePinner::new(coord.registry()).pin(spec).await?;
    let snapshot = coord.snapshot();
    let spec = snapshot.settle_archived_dependencies(spec)?;
    let req = request.into_inner();
    // Fail fast on what the state machine would refuse anyway; apply() checks again.
    snapshot.read().state.check_submit(&spec).map_err(CoordError::from)?;
    let (job_id, duplicate) = coord.submits().submit(coord, req.request_id, spec).await?;
    Ok(Response::new(pb::SubmitResponse { job_id, duplicate }))
}

/// `Corral.SubmitBatch`. Cost: at most `MAX_BATCH` specs (together at most the user message
/// limit, naming at most `MAX_BATCH_DEPENDENCIES` dependencies), each checked as one `Submit`
/// is; the batch is admitted whole into the submit queue (`limits.max-queued-submits`) or
/// refused, and proposed in entries of about a megabyte. A batch over a limit is refused whole:
/// nothing of it is created.
pub(super) async fn submit_batch(
    coord: &Coordinator,
    request: Request<pb::SubmitBatchRequest>,
) -> Result<Response<pb::SubmitBatchResponse>, Status> {
    let who = coord.principal(&request, "submit")?;
    if request.get_ref().jobs.len() > MAX_BATCH {
        let req = request.get_ref();
        return Err(Status::invalid_argument(format!(
            "batch of {} jobs is too large: send at most {MAX_BATCH} per call",
            req.jobs.len()
        )));
    }
    let dependencies: usize = request
        .get_ref()
        .jobs
        .iter()
        .filter_map(|j| j.spec.as_ref())
        .map(|s| s.sched.as_ref().map_or(0, |o| o.dependencies.len()))
        .sum();
    if dependencies > MAX_BATCH_DEPENDENCIES {
        return Err(Status::invalid_argument(format!(
            "the jobs of this batch name {dependencies} dependencies, at most {MAX_BATCH_DEPENDENCIES} per call: send smaller batches"
        )));
    }
    let snapshot = coord.snapshot();
    let mut pinner = ImagePinner::new(coord.registry());
    let mut jobs = Vec::with_capacity(request.get_ref().jobs.len());
    for (i, job) in request.get_ref().jobs.iter().enumerate() {
        let spec =
            job.spec.clone().ok_or_else(|| Status::invalid_argument(format!("job {i} of the batch has no spec")))?;
        let spec = own_spec(coord, &request, &who, spec.try_into()?)?;
        let spec = pinner.pin(spec).await?;
        let spec = snapshot.settle_archived_dependencies(spec)?;
        jobs.push((job.request_id.clone(), spec));
    }
    let results = coord.submits().submit_batch(coord, jobs).await?;
    let results = results
        .into_iter()
        .map(|r| match r {
            Ok((job_id, duplicate)) => pb::SubmitResult { job_id, duplicate, error: String::new() },
            Err(e) => pb::SubmitResult { job_id: 0, duplicate: false, error: e.to_string() },
        })
        .collect();
    Ok(Response::new(pb::SubmitBatchResponse { results }))
}

/// `Corral.GetJob`. Cost: a lookup or two in the hot state or the history (the array's owner
/// first, for a task reference); the reply is one job.
pub(super) fn get_job(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::GetJobRequest>,
) -> Result<Response<pb::Job>, Status> {
    let who = coord.principal(&request, "show")?;
    let req = request.get_ref();
    let owned = |job: &corral_types::Job| coord.require_owner(&request, "show", "show", &who, job);
    let job = match snapshot.resolve(req.job_id, req.array_index, owned)? {
        Target::Job(job) => job,
        Target::Uncreated { array, index } => {
            return Err(Status::not_found(format!(
                "task {}_{index} was not created yet: it waits in array {} (corral show {})",
                array.id, array.id, array.id
            )));
        }
    };
    Ok(Response::new(snapshot.job_reply(&job)))
}

/// `Corral.ListJobs`. Cost: one page — at most `listing::MAX_PAGE` jobs or about
/// `listing::PAGE_BYTES` of them, after looking at most `listing::SCAN_BUDGET` jobs (then the
/// page ends short, with a token) — walked on a constant-time copy of the job map, so the state
/// lock is held for the copy only; the history is read only when finished states are asked for.
pub(super) fn list_jobs(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::ListJobsRequest>,
) -> Result<Response<pb::ListJobsResponse>, Status> {
    let who = coord.principal(&request, "list jobs")?;
    own_tenant_filter(coord, &request, "list jobs", &who, request.get_ref().tenant.as_deref())?;
    let req = request.into_inner();
    let after = listing::job_token(&req.page_token)?;
    let filter = JobFilter::of_list(&req, filter_tenant(&who, req.tenant.as_deref()))?;
    // The history is read after the copy: apply writes a job there before it leaves the hot
    // state, so a job that moves meanwhile is in both and comes once (`listing::merge_by_id`).
    let jobs = snapshot.read().state.jobs.clone();
    let (jobs, next_page_token) = listing::list_jobs(
        &jobs,
        |from| snapshot.store().archived_jobs_from(from),
        &filter,
        after,
        listing::page_size(req.limit),
    );
    let jobs = match req.brief {
        true => jobs.iter().map(|j| snapshot.brief_reply(j)).collect(),
        false => jobs.iter().map(|j| snapshot.job_reply(j)).collect(),
    };
    Ok(Response::new(pb::ListJobsResponse { jobs, next_page_token }))
}

/// `Corral.WatchJob` (`corral wait`, `corral logs -f`). Cost: one of the caller's
/// `limits.max-watches-per-principal` watches while it lasts; the job is read and sent again
/// at each applied change (or every `WATCH_REFRESH`), only when it changed, at most 4 replies
/// buffered, each without the script and environment (`Snapshot::brief_reply`).
pub(super) fn watch_job(
    coord: &Coordinator,
    watches: &Arc<Watches>,
    snapshot: &Snapshot,
    request: Request<pb::WatchJobRequest>,
) -> Result<Response<JobStream>, Status> {
    let who = coord.principal(&request, "watch")?;
    let job_id = request.get_ref().job_id;
    let job = snapshot.job(job_id)?;
    coord.require_owner(&request, "watch", "watch", &who, &job)?;
    let permit = watches.open(&who)?;
    let term = coord.leading_term().ok_or_else(|| coord.not_leader())?;
    let rx = watch_one(coord.clone(), job_id, term, permit);
    Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
}

/// Sends job `job_id` now and at every change until it ends, while this node leads in `term`.
fn watch_one(
    coord: Coordinator,
    job_id: u64,
    term: u64,
    permit: WatchPermit,
) -> tokio::sync::mpsc::Receiver<Result<pb::Job, Status>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let _permit = permit;
        let mut applied = coord.store().subscribe_applied();
        let mut last: Option<pb::Job> = None;
        loop {
            if coord.leading_term() != Some(term) {
                // Deposed: the stream ends before the job did, and the client asks the new leader.
                return;
            }
            let snapshot = coord.snapshot();
            let Some(job) = snapshot.find_job(job_id) else { return };
            let (reply, terminal) = (snapshot.brief_reply(&job), job.state.is_terminal());
            if last.as_ref() != Some(&reply) {
                if tx.send(Ok(reply.clone())).await.is_err() || terminal {
                    return;
                }
                last = Some(reply);
            }
            tokio::select! {
                changed = applied.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(WATCH_REFRESH) => {}
                _ = tx.closed() => return,
            }
        }
    });
    rx
}

/// `Corral.WatchJobs`. Cost: one of the caller's `limits.max-watches-per-principal` watches
/// while it lasts (the filter names at most `MAX_FILTER_JOB_IDS` jobs); events are built a
/// page or a window of changes at a time and at most `watch::BUFFER` wait for the client, which
/// is dropped (ABORTED, with its resume revision) once it falls more than half of
/// `raft.watch-history` job changes behind (see `watch.rs`).
pub(super) fn watch_jobs(
    coord: &Coordinator,
    watches: &Arc<Watches>,
    request: Request<pb::WatchJobsRequest>,
) -> Result<Response<JobEventStream>, Status> {
    let who = coord.principal(&request, "watch jobs")?;
    own_tenant_filter(coord, &request, "watch jobs", &who, request.get_ref().tenant.as_deref())?;
    let req = request.get_ref();
    let filter = JobFilter::of_watch(req, filter_tenant(&who, req.tenant.as_deref()))?;
    let permit = watches.open(&who)?;
    let term = coord.leading_term().ok_or_else(|| coord.not_leader())?;
    let events = crate::watch::watch_jobs(coord, filter, req.from_revision, term, permit)?;
    Ok(Response::new(events))
}

/// `Corral.ReadLogs`. Cost: the job is looked up and its owner checked; with `follow`, one of
/// the caller's `limits.max-watches-per-principal` watches while it lasts. The output is
/// relayed chunk by chunk from the worker agent (64 KiB chunks, a few in flight: gRPC's flow
/// control holds the agent back while the client reads slowly), never gathered here.
pub(super) async fn read_logs(
    coord: &Coordinator,
    watches: &Arc<Watches>,
    request: Request<pb::ReadLogsRequest>,
) -> Result<Response<LogStream>, Status> {
    let who = coord.principal(&request, "logs")?;
    let snapshot = coord.snapshot();
    let mut job = snapshot.job(request.get_ref().job_id)?;
    coord.require_owner(&request, "logs", "read the logs of", &who, &job)?;
    let permit = if request.get_ref().follow { Some(watches.open(&who)?) } else { None };
    let req = request.into_inner();
    let parts = job.spec.parts();
    if req.rank >= parts {
        return Err(Status::invalid_argument(match parts {
            1 => format!("job {} runs on one node: there is no rank {} (only rank 0)", job.id, req.rank),
            n => format!("job {} has {n} ranks (0-{}): there is no rank {}", job.id, n - 1, req.rank),
        }));
    }
    // With --follow, wait until the job is placed somewhere (or ends without running),
    // woken by every applied change.
    let mut applied = snapshot.store().subscribe_applied();
    while req.follow && job.allocation.is_none() && !job.state.is_terminal() {
        let _ = tokio::time::timeout(WATCH_REFRESH, applied.changed()).await;
        job = snapshot.job(req.job_id)?;
    }
    match coord.open_worker_logs(&job, req).await? {
        // The watch lasts as long as the stream: the permit goes with it.
        Some(upstream) => Ok(Response::new(Box::pin(upstream.map(move |chunk| {
            let _ = &permit;
            chunk
        })))),
        None => Ok(Response::new(Box::pin(tokio_stream::empty()))),
    }
}

/// `Corral.ListSegments`. Cost: one page of segments from the store (at most
/// `listing::MAX_PAGE`, after looking at most `listing::SCAN_BUDGET`), without the state lock;
/// the filter names at most `MAX_FILTER_JOB_IDS` jobs.
pub(super) fn list_segments(
    coord: &Coordinator,
    snapshot: &Snapshot,
    request: Request<pb::ListSegmentsRequest>,
) -> Result<Response<pb::ListSegmentsResponse>, Status> {
    let who = coord.principal(&request, "billing")?;
    own_tenant_filter(coord, &request, "billing", &who, request.get_ref().tenant.as_deref())?;
    let req = request.into_inner();
    if req.job_ids.len() > MAX_FILTER_JOB_IDS {
        return Err(Status::invalid_argument(format!(
            "the filter names {} jobs, at most {MAX_FILTER_JOB_IDS}: list by tenant and time instead",
            req.job_ids.len()
        )));
    }
    let after = listing::segment_token(&req.page_token)?;
    let filter = listing::SegmentFilter {
        tenant: filter_tenant(&who, req.tenant.as_deref()),
        job_ids: req.job_ids.into_iter().chain(req.job_id).collect(),
        since: req.since.map(Timestamp),
        until: req.until.map(Timestamp),
    };
    // Every segment is in the store (the hot state keeps recent ones only).
    let segments = snapshot.store().segments_from(after.map_or(0, |a| a.saturating_add(1)));
    let (segments, next_page_token) = listing::list_segments(segments, &filter, after, listing::page_size(req.limit));
    let segments = segments.iter().map(pb::Segment::from).collect();
    Ok(Response::new(pb::ListSegmentsResponse { segments, next_page_token }))
}

/// `Corral.GetTimestamps`. Cost: at most `MAX_TIMESTAMPS_PER_CALL` timestamps from the
/// oracle's window (a log entry when the window must grow).
pub(super) async fn get_timestamps(
    coord: &Coordinator,
    request: Request<pb::GetTimestampsRequest>,
) -> Result<Response<pb::GetTimestampsResponse>, Status> {
    coord.principal(&request, "timestamps")?;
    let count = request.into_inner().count;
    let first = coord.timestamps(u64::from(count)).await?;
    Ok(Response::new(pb::GetTimestampsResponse { first: first.0, count }))
}
