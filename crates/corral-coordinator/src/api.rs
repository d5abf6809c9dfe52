//! The user-facing `Corral` gRPC service: submit, show, list, cancel, logs, nodes.

use crate::auth::Principal;
use crate::{listing, policy, CoordError, Coordinator};
use corral_core::{Command, Outcome};
use corral_proto::v1::corral_server::{Corral, CorralServer};
use corral_proto::v1::{self as pb};
use corral_types::{Job, JobSpec, JobState, NodeMode, Timestamp};
use std::pin::Pin;
use std::time::Duration;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub(crate) fn server(coord: Coordinator) -> CorralServer<Api> {
    CorralServer::new(Api { coord })
        // Requests are untrusted input; replies (e.g. `jobs --all` on a big cluster) may be larger.
        .max_decoding_message_size(corral_proto::MAX_USER_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
}

/// Jobs one `CancelJobs` command cancels at most.
const CANCEL_CHUNK: usize = 10_000;

pub(crate) struct Api {
    coord: Coordinator,
}

impl Api {
    /// The job `job_id`, or task `array_index` of array `job_id`.
    fn resolve(&self, job_id: u64, array_index: Option<u32>) -> Result<Target, CoordError> {
        let Some(index) = array_index else { return self.job(job_id).map(Target::Job) };
        let store = &self.coord.inner.node.state;
        let data = store.read();
        let Some(array) = data.state.jobs.get(&job_id) else {
            drop(data);
            // An array that ended long ago: it and its tasks are in the history.
            let array =
                store.archived_job(job_id).ok_or_else(|| CoordError::NotFound(format!("job {job_id} not found")))?;
            if array.spec.array.is_none() {
                return Err(CoordError::InvalidArgument(format!(
                    "job {job_id} is not an array: write {job_id}, not {job_id}_{index}"
                )));
            }
            return store.archived_task(job_id, index).map(Target::Job).ok_or_else(|| {
                CoordError::NotFound(format!("array {job_id} ended without a task {index} (or it left the history)"))
            });
        };
        let Some(spec) = &array.spec.array else {
            return Err(CoordError::InvalidArgument(format!(
                "job {job_id} is not an array: write {job_id}, not {job_id}_{index}"
            )));
        };
        if let Some(task) = data.state.array_task(job_id, index) {
            return data
                .state
                .jobs
                .get(&task)
                .cloned()
                .map(Target::Job)
                .ok_or_else(|| CoordError::NotFound(format!("job {task} not found")));
        }
        if !(0..spec.len()).any(|n| spec.index_at(n) == Some(index)) {
            return Err(CoordError::NotFound(format!("array {job_id} has no task {index}")));
        }
        Ok(Target::Uncreated { array: array.clone(), index })
    }

    /// Job `job_id`, from the hot state or else the history of finished jobs.
    fn job(&self, job_id: u64) -> Result<Job, CoordError> {
        self.coord.find_job(job_id).ok_or_else(|| CoordError::NotFound(format!("job {job_id} not found")))
    }

    /// The spec as `who` may submit it: a tenant submits only as itself (an empty tenant becomes
    /// the token's tenant, or `default` for an admin).
    fn own_spec<T>(&self, request: &Request<T>, who: &Principal, mut spec: JobSpec) -> Result<JobSpec, Status> {
        if spec.tenant.is_empty() {
            spec.tenant = who.tenant().unwrap_or("default").to_string();
        }
        if !who.may_access(&spec.tenant) {
            return Err(self.coord.deny(
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
        Ok(spec)
    }

    /// Refuses a tenant's filter naming another tenant.
    fn own_tenant_filter<T>(
        &self,
        request: &Request<T>,
        action: &str,
        who: &Principal,
        tenant: Option<&str>,
    ) -> Result<(), Status> {
        match tenant {
            Some(t) if !who.may_access(t) => Err(self.coord.deny(
                request,
                action,
                &who.describe(),
                Status::permission_denied(format!(
                    "permission denied: tenant {} cannot see tenant {t}",
                    who.tenant().unwrap_or_default()
                )),
            )),
            _ => Ok(()),
        }
    }
}

/// What a job reference (`12` or `12_7`) names.
enum Target {
    Job(Job),
    /// A task of an array not created yet.
    Uncreated {
        array: Job,
        index: u32,
    },
}

/// The filter of a `ListJobs` request, and its limit.
fn job_filter(req: pb::ListJobsRequest) -> Result<(listing::JobFilter, u32), CoordError> {
    let mut states = std::collections::BTreeSet::new();
    for state in &req.states {
        let state = match pb::JobState::try_from(*state) {
            Ok(pb::JobState::Pending) => JobState::Pending,
            Ok(pb::JobState::Running) => JobState::Running,
            Ok(pb::JobState::Succeeded) => JobState::Succeeded,
            Ok(pb::JobState::Failed) => JobState::Failed,
            Ok(pb::JobState::Cancelled) => JobState::Cancelled,
            Ok(pb::JobState::Preempted) => JobState::Preempted,
            _ => return Err(CoordError::InvalidArgument(format!("unknown job state {state} in the filter"))),
        };
        states.insert(state);
    }
    if states.is_empty() && req.all {
        states = listing::JobFilter::all_states();
    }
    let name = match (req.name, req.name_prefix) {
        (Some(_), Some(_)) => {
            return Err(CoordError::InvalidArgument("give a name or a name prefix, not both".into()));
        }
        (Some(name), None) => listing::NameMatch::Exact(name),
        (None, Some(prefix)) => listing::NameMatch::Prefix(prefix),
        (None, None) => listing::NameMatch::Any,
    };
    let filter = listing::JobFilter {
        states,
        tenant: req.tenant,
        name,
        submitted_since: req.submitted_since.map(Timestamp),
        submitted_until: req.submitted_until.map(Timestamp),
    };
    Ok((filter, req.limit))
}

/// Most jobs one `SubmitBatch` call may carry.
const MAX_BATCH: usize = 10_000;

/// A job as the API returns it: a pending job without a reason of its own shows why the
/// leader's last scheduling pass left it waiting.
pub(crate) fn job_reply(job: &Job, pending_reasons: &std::collections::BTreeMap<u64, String>) -> pb::Job {
    let mut reply = pb::Job::from(job);
    if job.state == corral_types::JobState::Pending && reply.reason.is_none() {
        reply.reason = pending_reasons.get(&job.id).cloned();
    }
    reply
}

fn token_info(t: &corral_core::TokenRecord) -> pb::TokenInfo {
    pb::TokenInfo {
        id: t.id,
        tenant: t.tenant.clone(),
        admin: t.admin,
        created: t.created.0,
        expires_at_ms: t.expires_at_ms,
        revoked: t.revoked,
    }
}

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;
type JobStream = Pin<Box<dyn Stream<Item = Result<pb::Job, Status>> + Send>>;
type JobEventStream = Pin<Box<dyn Stream<Item = Result<pb::JobEvent, Status>> + Send>>;

/// A watched job is sent again at least this often while it waits, so that the reason of the
/// leader's latest scheduling pass reaches the watcher.
const WATCH_REFRESH: Duration = Duration::from_millis(500);

/// Sends job `job_id` now and at every change until it ends, while this node leads in `term`.
fn watch_job(coord: Coordinator, job_id: u64, term: u64) -> tokio::sync::mpsc::Receiver<Result<pb::Job, Status>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let mut applied = coord.inner.node.state.subscribe_applied();
        let mut last: Option<pb::Job> = None;
        loop {
            if coord.leading_term() != Some(term) {
                // Deposed: the stream ends before the job did, and the client asks the new leader.
                return;
            }
            let reply = {
                let Some(job) = coord.find_job(job_id) else { return };
                let reasons = coord.inner.pending_reasons.lock().unwrap_or_else(|p| p.into_inner());
                (job_reply(&job, &reasons), job.state.is_terminal())
            };
            let (reply, terminal) = reply;
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

#[tonic::async_trait]
impl Corral for Api {
    async fn submit(&self, request: Request<pb::SubmitRequest>) -> Result<Response<pb::SubmitResponse>, Status> {
        let who = self.coord.principal(&request, "submit")?;
        let spec = request.get_ref().spec.clone().ok_or_else(|| Status::invalid_argument("missing job spec"))?;
        let spec = self.own_spec(&request, &who, spec.try_into()?)?;
        let spec = self.coord.settle_archived_dependencies(spec)?;
        let req = request.into_inner();
        // Fail fast on what the state machine would refuse anyway; apply() checks again.
        self.coord.inner.node.state.read().state.check_submit(&spec).map_err(CoordError::from)?;
        let (job_id, duplicate) = self.coord.submit(req.request_id, spec).await?;
        Ok(Response::new(pb::SubmitResponse { job_id, duplicate }))
    }

    async fn submit_batch(
        &self,
        request: Request<pb::SubmitBatchRequest>,
    ) -> Result<Response<pb::SubmitBatchResponse>, Status> {
        let who = self.coord.principal(&request, "submit")?;
        if request.get_ref().jobs.len() > MAX_BATCH {
            let req = request.get_ref();
            return Err(Status::invalid_argument(format!(
                "batch of {} jobs is too large: send at most {MAX_BATCH} per call",
                req.jobs.len()
            )));
        }
        let mut jobs = Vec::with_capacity(request.get_ref().jobs.len());
        for (i, job) in request.get_ref().jobs.iter().enumerate() {
            let spec = job
                .spec
                .clone()
                .ok_or_else(|| Status::invalid_argument(format!("job {i} of the batch has no spec")))?;
            let spec = self.own_spec(&request, &who, spec.try_into()?)?;
            let spec = self.coord.settle_archived_dependencies(spec)?;
            jobs.push((job.request_id.clone(), spec));
        }
        let proposed = {
            // Waiting for a pipeline slot counts against the bound on queued submits.
            let admitted = self.coord.inner.submit_queue.admit(jobs.len())?;
            let _slot = self
                .coord
                .inner
                .batch_slots
                .acquire()
                .await
                .map_err(|_| Status::unavailable("coordinator is shutting down"))?;
            drop(admitted);
            self.coord.hold_while_followers_lag().await;
            self.coord.propose(Command::SubmitJobs { jobs }).await?
        };
        let results = match proposed {
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
        let who = self.coord.principal(&request, "show")?;
        let req = request.get_ref();
        let job = match self.resolve(req.job_id, req.array_index)? {
            Target::Job(job) => job,
            Target::Uncreated { array, index } => {
                self.coord.require_owner(&request, "show", "show", &who, &array)?;
                return Err(Status::not_found(format!(
                    "task {}_{index} was not created yet: it waits in array {} (corral show {})",
                    array.id, array.id, array.id
                )));
            }
        };
        self.coord.require_owner(&request, "show", "show", &who, &job)?;
        let reasons = self.coord.inner.pending_reasons.lock().unwrap_or_else(|p| p.into_inner());
        Ok(Response::new(job_reply(&job, &reasons)))
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "list jobs")?;
        self.own_tenant_filter(&request, "list jobs", &who, request.get_ref().tenant.as_deref())?;
        let mut req = request.into_inner();
        if req.tenant.is_none() {
            req.tenant = who.tenant().map(String::from);
        }
        let after = listing::job_token(&req.page_token)?;
        let (filter, limit) = job_filter(req)?;
        let (jobs, next_page_token) = {
            let store = &self.coord.inner.node.state;
            // The history is read under the state lock: a job moving there is seen once.
            let data = store.read();
            listing::list_jobs(
                &data.state,
                |from| store.archived_jobs_from(from),
                &filter,
                after,
                listing::page_size(limit),
            )
        };
        let reasons = self.coord.inner.pending_reasons.lock().unwrap_or_else(|p| p.into_inner());
        let jobs = jobs.iter().map(|j| job_reply(j, &reasons)).collect();
        Ok(Response::new(pb::ListJobsResponse { jobs, next_page_token }))
    }

    async fn cancel_job(&self, request: Request<pb::CancelJobRequest>) -> Result<Response<pb::Job>, Status> {
        let who = self.coord.principal(&request, "cancel")?;
        let req = request.get_ref();
        let job = match self.resolve(req.job_id, req.array_index)? {
            Target::Job(job) => job,
            Target::Uncreated { array, index } => {
                self.coord.require_owner(&request, "cancel", "cancel", &who, &array)?;
                let command = Command::CancelArrayTask { array: array.id, index, reason: "cancelled by user".into() };
                return match self.coord.propose(command).await? {
                    Outcome::Job(job) => Ok(Response::new((&*job).into())),
                    other => Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
                };
            }
        };
        let job_id = job.id;
        self.coord.require_owner(&request, "cancel", "cancel", &who, &job)?;
        if job.state.is_terminal() {
            // Nothing to stop (and a job in the history is no longer in the state machine).
            return Ok(Response::new((&job).into()));
        }
        if who.is_admin() && self.coord.security().auth_enabled() {
            self.coord.audit_admin(&request, "cancel", &who, format!("job {job_id} of tenant {}", job.spec.tenant));
        }
        match self.coord.propose(Command::CancelJob { job_id, reason: "cancelled by user".into() }).await? {
            Outcome::Job(job) => Ok(Response::new((&*job).into())),
            other => Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
        }
    }

    type WatchJobStream = JobStream;

    async fn watch_job(&self, request: Request<pb::WatchJobRequest>) -> Result<Response<JobStream>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "watch")?;
        let job_id = request.get_ref().job_id;
        let job = self.job(job_id)?;
        self.coord.require_owner(&request, "watch", "watch", &who, &job)?;
        let term = self.coord.leading_term().ok_or_else(|| self.coord.not_leader())?;
        let rx = watch_job(self.coord.clone(), job_id, term);
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    type WatchJobsStream = JobEventStream;

    async fn watch_jobs(&self, request: Request<pb::WatchJobsRequest>) -> Result<Response<JobEventStream>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "watch jobs")?;
        self.own_tenant_filter(&request, "watch jobs", &who, request.get_ref().tenant.as_deref())?;
        let req = request.get_ref();
        let tenant = req.tenant.clone().or_else(|| who.tenant().map(String::from));
        let filter = crate::watch::JobFilter::of(req, tenant)?;
        let term = self.coord.leading_term().ok_or_else(|| self.coord.not_leader())?;
        let rx = self.coord.watch_jobs(filter, req.from_revision, term)?;
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    type ReadLogsStream = LogStream;

    async fn read_logs(&self, request: Request<pb::ReadLogsRequest>) -> Result<Response<LogStream>, Status> {
        let who = self.coord.principal(&request, "logs")?;
        let mut job = self.job(request.get_ref().job_id)?;
        self.coord.require_owner(&request, "logs", "read the logs of", &who, &job)?;
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
        let mut applied = self.coord.inner.node.state.subscribe_applied();
        while req.follow && job.allocation.is_none() && !job.state.is_terminal() {
            let _ = tokio::time::timeout(WATCH_REFRESH, applied.changed()).await;
            job = self.job(req.job_id)?;
        }
        match self.coord.open_worker_logs(&job, req).await? {
            Some(upstream) => Ok(Response::new(Box::pin(upstream))),
            None => Ok(Response::new(Box::pin(tokio_stream::empty()))),
        }
    }

    async fn list_segments(
        &self,
        request: Request<pb::ListSegmentsRequest>,
    ) -> Result<Response<pb::ListSegmentsResponse>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "billing")?;
        self.own_tenant_filter(&request, "billing", &who, request.get_ref().tenant.as_deref())?;
        let req = request.into_inner();
        let after = listing::segment_token(&req.page_token)?;
        let filter = listing::SegmentFilter {
            tenant: req.tenant.or_else(|| who.tenant().map(String::from)),
            job_ids: req.job_ids.into_iter().chain(req.job_id).collect(),
            since: req.since.map(Timestamp),
            until: req.until.map(Timestamp),
        };
        // Every segment is in the store (the hot state keeps recent ones only).
        let segments = self.coord.inner.node.state.segments_from(after.map_or(0, |a| a.saturating_add(1)));
        let (segments, next_page_token) =
            listing::list_segments(segments, &filter, after, listing::page_size(req.limit));
        let segments = segments.iter().map(pb::Segment::from).collect();
        Ok(Response::new(pb::ListSegmentsResponse { segments, next_page_token }))
    }

    async fn get_timestamps(
        &self,
        request: Request<pb::GetTimestampsRequest>,
    ) -> Result<Response<pb::GetTimestampsResponse>, Status> {
        self.coord.principal(&request, "timestamps")?;
        let count = request.into_inner().count;
        let first = self.coord.timestamps(u64::from(count)).await?;
        Ok(Response::new(pb::GetTimestampsResponse { first: first.0, count }))
    }

    async fn create_token(
        &self,
        request: Request<pb::CreateTokenRequest>,
    ) -> Result<Response<pb::CreateTokenResponse>, Status> {
        let who = self.coord.principal(&request, "token create")?;
        self.coord.require_admin(&request, "token create", &who)?;
        let req = request.get_ref().clone();
        if req.admin != req.tenant.is_empty() {
            return Err(Status::invalid_argument("give either a tenant or --admin, not both"));
        }
        let ts = self.coord.timestamps(1).await?;
        let expires_at_ms = match req.ttl_secs {
            Some(0) => return Err(Status::invalid_argument("--ttl must be greater than zero")),
            Some(secs) => Some(ts.physical_ms().saturating_add(secs.saturating_mul(1000))),
            None => None,
        };
        let secret = crate::auth::new_token_secret();
        let command = Command::CreateToken {
            tenant: req.tenant.clone(),
            admin: req.admin,
            sha256: crate::auth::token_sha256(&secret),
            expires_at_ms,
        };
        let token_id = match self.coord.propose_at(ts, command).await? {
            Outcome::TokenCreated { token_id } => token_id,
            other => return Err(Status::internal(format!("unexpected outcome of token create: {other:?}"))),
        };
        let whom = if req.admin { "admin".to_string() } else { format!("tenant {}", req.tenant) };
        self.coord.audit_admin(&request, "token create", &who, format!("token {token_id} for {whom}"));
        let token = self.coord.inner.node.state.read().state.tokens.get(&token_id).map(token_info);
        Ok(Response::new(pb::CreateTokenResponse { token, secret }))
    }

    async fn list_tokens(
        &self,
        request: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "token list")?;
        self.coord.require_admin(&request, "token list", &who)?;
        let tokens = self.coord.inner.node.state.read().state.tokens.values().map(token_info).collect();
        Ok(Response::new(pb::ListTokensResponse { tokens }))
    }

    async fn revoke_token(&self, request: Request<pb::RevokeTokenRequest>) -> Result<Response<pb::TokenInfo>, Status> {
        let who = self.coord.principal(&request, "token revoke")?;
        self.coord.require_admin(&request, "token revoke", &who)?;
        let token_id = request.get_ref().token_id;
        self.coord.propose(Command::RevokeToken { token_id }).await?;
        self.coord.audit_admin(&request, "token revoke", &who, format!("token {token_id}"));
        let token = self.coord.inner.node.state.read().state.tokens.get(&token_id).map(token_info);
        token.map(Response::new).ok_or_else(|| Status::not_found(format!("token {token_id} not found")))
    }

    async fn get_policy(&self, request: Request<pb::GetPolicyRequest>) -> Result<Response<pb::PolicyFile>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "policy show")?;
        self.coord.require_admin(&request, "policy show", &who)?;
        let data = self.coord.inner.node.state.read();
        let version = data.state.policy_version;
        Ok(Response::new(pb::PolicyFile { version, toml: policy::render_policy(&data.state.config, version) }))
    }

    async fn apply_policy(
        &self,
        request: Request<pb::ApplyPolicyRequest>,
    ) -> Result<Response<pb::ApplyPolicyResponse>, Status> {
        let action = if request.get_ref().dry_run { "policy diff" } else { "policy apply" };
        let who = self.coord.principal(&request, action)?;
        self.coord.require_admin(&request, action, &who)?;
        let req = request.get_ref();
        let source = if req.source.is_empty() { "policy" } else { req.source.as_str() };
        let config = policy::parse_policy(source, &req.toml).map_err(Status::invalid_argument)?;
        self.coord.linearizable().await?;
        let (plan, version) = {
            let data = self.coord.inner.node.state.read();
            (data.state.plan_policy(&config).map_err(CoordError::Rejected)?, data.state.policy_version)
        };
        let stranded = |ids: &[(u64, corral_types::JobState, String)]| {
            ids.iter()
                .map(|(id, state, why)| pb::StrandedJob { job_id: *id, state: state.to_string(), reason: why.clone() })
                .collect::<Vec<_>>()
        };
        if req.dry_run {
            return Ok(Response::new(pb::ApplyPolicyResponse {
                version,
                changes: plan.changes,
                applied: false,
                stranded: stranded(&plan.stranded),
            }));
        }
        let command = Command::ApplyPolicy { config, by: who.describe(), force: req.force };
        let (version, changes, cancelled) = match self.coord.propose(command).await? {
            Outcome::PolicyApplied { version, changes, cancelled } => (version, changes, cancelled),
            other => return Err(Status::internal(format!("unexpected outcome of policy apply: {other:?}"))),
        };
        if !changes.is_empty() {
            let mut detail = format!("version {version}: {}", changes.join("; "));
            if !cancelled.is_empty() {
                detail.push_str(&format!("; cancelled jobs {cancelled:?}"));
            }
            self.coord.audit_admin(&request, "policy apply", &who, detail);
        }
        let gone: Vec<_> = plan.stranded.iter().filter(|(id, ..)| cancelled.contains(id)).cloned().collect();
        Ok(Response::new(pb::ApplyPolicyResponse {
            version,
            applied: !changes.is_empty(),
            changes,
            stranded: stranded(&gone),
        }))
    }

    async fn policy_history(
        &self,
        request: Request<pb::PolicyHistoryRequest>,
    ) -> Result<Response<pb::PolicyHistoryResponse>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "policy history")?;
        self.coord.require_admin(&request, "policy history", &who)?;
        let data = self.coord.inner.node.state.read();
        let changes = data
            .state
            .policy_history
            .iter()
            .map(|r| pb::PolicyChange {
                version: r.version,
                ts: r.ts.0,
                by: r.by.clone(),
                changes: r.changes.clone(),
                cancelled: r.cancelled.clone(),
            })
            .collect();
        Ok(Response::new(pb::PolicyHistoryResponse { changes }))
    }

    async fn control_job(&self, request: Request<pb::ControlJobRequest>) -> Result<Response<pb::Job>, Status> {
        let req = request.get_ref().clone();
        let action = req.action.as_str();
        if !matches!(action, "hold" | "release" | "requeue" | "signal" | "update") {
            return Err(Status::invalid_argument(format!(
                "unknown job action '{action}' (hold, release, requeue, signal or update)"
            )));
        }
        let who = self.coord.principal(&request, action)?;
        let job = match self.resolve(req.job_id, req.array_index)? {
            Target::Job(job) => job,
            Target::Uncreated { array, index } => {
                return Err(Status::failed_precondition(format!(
                    "task {}_{index} was not created yet: {action} the array {} instead",
                    array.id, array.id
                )))
            }
        };
        self.coord.require_owner(&request, action, action, &who, &job)?;
        if job.state.is_terminal() && !self.coord.inner.node.state.read().state.jobs.contains_key(&job.id) {
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
                    return Err(Status::invalid_argument(
                        "nothing to update: give --time, --priority, --gpus or --name",
                    ));
                }
                Command::UpdateJob { job_id: job.id, update, admin: who.is_admin() }
            }
        };
        let outcome = self.coord.propose(command).await?;
        self.coord.audit_admin(
            &request,
            &format!("job {action}"),
            &who,
            format!("job {} of tenant {}", job.display_id(), job.spec.tenant),
        );
        let job = match outcome {
            Outcome::Job(job) => *job,
            _ => self.job(job.id)?,
        };
        let reasons = self.coord.inner.pending_reasons.lock().unwrap_or_else(|p| p.into_inner());
        Ok(Response::new(job_reply(&job, &reasons)))
    }

    async fn cancel_jobs(
        &self,
        request: Request<pb::CancelJobsRequest>,
    ) -> Result<Response<pb::CancelJobsResponse>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "cancel")?;
        self.own_tenant_filter(&request, "cancel", &who, request.get_ref().tenant.as_deref())?;
        let mut req = request.get_ref().clone();
        if req.tenant.is_none() {
            req.tenant = who.tenant().map(String::from);
        }
        let (mut pending, mut running) = (req.states.is_empty(), req.states.is_empty());
        for state in &req.states {
            match state.as_str() {
                "pending" => pending = true,
                "running" => running = true,
                other => {
                    return Err(Status::invalid_argument(format!(
                        "cannot cancel jobs in state '{other}': pending or running"
                    )))
                }
            }
        }
        let ids: Vec<u64> = {
            let data = self.coord.inner.node.state.read();
            data.state
                .live_jobs()
                .filter(|j| req.tenant.as_ref().is_none_or(|t| *t == j.spec.tenant))
                .filter(|j| req.name.as_ref().is_none_or(|n| *n == j.spec.name))
                .filter(|j| (pending && j.state == JobState::Pending) || (running && j.state == JobState::Running))
                .filter(|j| !j.cancel_requested)
                .map(|j| j.id)
                .collect()
        };
        if who.is_admin() && self.coord.security().auth_enabled() {
            let scope = req.tenant.as_deref().map_or("every tenant".to_string(), |t| format!("tenant {t}"));
            self.coord.audit_admin(&request, "cancel", &who, format!("{} jobs of {scope}", ids.len()));
        }
        // In bounded commands: each is one log entry of at most CANCEL_CHUNK jobs.
        let mut job_ids = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(CANCEL_CHUNK) {
            let command = Command::CancelJobs { job_ids: chunk.to_vec(), reason: "cancelled by user".into() };
            match self.coord.propose(command).await? {
                Outcome::JobsCancelled(done) => job_ids.extend(done),
                other => return Err(Status::internal(format!("unexpected outcome of cancel: {other:?}"))),
            }
        }
        Ok(Response::new(pb::CancelJobsResponse { job_ids }))
    }

    async fn set_node_mode(
        &self,
        request: Request<pb::SetNodeModeRequest>,
    ) -> Result<Response<pb::NodeModeResponse>, Status> {
        let req = request.get_ref().clone();
        let (mode, action) = match req.mode.as_str() {
            "active" => (NodeMode::Active, "node resume"),
            "cordoned" => (NodeMode::Cordoned, "node cordon"),
            "draining" => (NodeMode::Draining, "node drain"),
            other => {
                return Err(Status::invalid_argument(format!(
                    "unknown node mode '{other}' (active, cordoned or draining)"
                )))
            }
        };
        let who = self.coord.principal(&request, action)?;
        self.coord.require_admin(&request, action, &who)?;
        if req.deadline_secs.is_some() && mode != NodeMode::Draining {
            return Err(Status::invalid_argument("--deadline goes with drain only"));
        }
        let ts = self.coord.timestamps(1).await?;
        let drain_deadline = req
            .deadline_secs
            .map(|secs| Timestamp::compose(ts.physical_ms().saturating_add(secs.saturating_mul(1000)), 0));
        let command = Command::SetNodeMode { node: req.node.clone(), mode, reason: req.reason.clone(), drain_deadline };
        self.coord.propose_at(ts, command).await?;
        let detail = match (&drain_deadline, req.reason.is_empty()) {
            (Some(_), _) => {
                format!("node {} ({}; deadline in {}s)", req.node, req.reason, req.deadline_secs.unwrap_or(0))
            }
            (None, false) => format!("node {} ({})", req.node, req.reason),
            (None, true) => format!("node {}", req.node),
        };
        self.coord.audit_admin(&request, action, &who, detail);
        let data = self.coord.inner.node.state.read();
        let node = data
            .state
            .nodes
            .get(&req.node)
            .ok_or_else(|| Status::not_found(format!("node '{}' is not registered", req.node)))?;
        let running = data.state.jobs_on_node(&req.node).count();
        Ok(Response::new(pb::NodeModeResponse {
            node: req.node.clone(),
            state: node.display_state(running).to_string(),
            reason: node.mode_reason.clone(),
            drain_deadline: node.drain_deadline.map(|t| t.0),
            running_jobs: running as u32,
        }))
    }

    async fn remove_node(
        &self,
        request: Request<pb::RemoveNodeRequest>,
    ) -> Result<Response<pb::RemoveNodeResponse>, Status> {
        let who = self.coord.principal(&request, "node remove")?;
        self.coord.require_admin(&request, "node remove", &who)?;
        let node = request.get_ref().node.clone();
        let gpus = self.coord.inner.node.state.read().state.nodes.get(&node).map_or(0, |n| n.spec.gpus.len() as u32);
        self.coord.propose(Command::RemoveNode { node: node.clone(), revoke_certificates: true }).await?;
        self.coord.inner.liveness.forget(&node);
        self.coord.audit_admin(&request, "node remove", &who, format!("node {node} ({gpus} gpus)"));
        Ok(Response::new(pb::RemoveNodeResponse { gpus }))
    }

    async fn list_nodes(
        &self,
        request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        self.coord.linearizable().await?;
        let who = self.coord.principal(&request, "nodes")?;
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
                            .filter(|j| {
                                j.allocation
                                    .as_ref()
                                    .and_then(|a| a.gpus_on(&n.spec.name))
                                    .is_some_and(|gs| gs.contains(&g.index))
                            })
                            .collect();
                        let busy = !on_gpu.is_empty();
                        // A tenant sees that a GPU is busy, but only its own job ids and slices.
                        let visible: Vec<&&Job> =
                            on_gpu.iter().copied().filter(|j| who.may_access(&j.spec.tenant)).collect();
                        let job_ids: Vec<u64> = visible.iter().map(|j| j.id).collect();
                        let slices = visible
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
                        } else if busy {
                            "allocated"
                        } else if n.accepts_jobs() {
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
                            dirty_job_id: health
                                .and_then(|h| h.dirty_job_id)
                                .filter(|id| data.state.jobs.get(id).is_none_or(|j| who.may_access(&j.spec.tenant))),
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
                    state: n.display_state(jobs.len()).to_string(),
                    epoch: n.epoch,
                    gpus,
                    cpu_millis: n.spec.cpu_millis,
                    memory_bytes: n.spec.memory_bytes,
                    heartbeat_age_ms: live.map(|l| l.last_seen.elapsed().as_millis() as u64),
                    reason: n.mode_reason.clone(),
                    labels: n.spec.labels.iter().cloned().collect(),
                    drain_deadline: n.drain_deadline.map(|t| t.0),
                    running_jobs: jobs.len() as u32,
                }
            })
            .collect();
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }
}
