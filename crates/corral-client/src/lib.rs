//! Typed corral gRPC client: endpoint failover, leader redirects, and retries that reuse the
//! same request id so a retried submit never creates a second job. Calls refused by a busy
//! coordinator (RESOURCE_EXHAUSTED with `retry-after-ms`: a full submit queue, or
//! `limits.max-client-requests` handlers at work) are retried after that long, with jitter,
//! within `ClientConfig::overload_retry_for`. Listings come one page at a time
//! (`*_page`) or followed to the end.

use corral_proto::v1::cluster_admin_client::ClusterAdminClient;
use corral_proto::v1::corral_client::CorralClient as RawCorral;
use corral_proto::v1::worker_gateway_client::WorkerGatewayClient;
use corral_proto::v1::{self as pb};
use corral_proto::{LEADER_ADDR_METADATA, RETRY_AFTER_METADATA};
use corral_types::{Job, JobRef, JobSpec, JobState, Segment, Timestamp};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach any coordinator at {endpoints}: {last_error} (is `corral dev` or a coordinator running? set --endpoint or CORRAL_ENDPOINT)")]
    Unreachable { endpoints: String, last_error: String },
    #[error("{}", .0.message())]
    Status(Status),
    #[error("invalid endpoint '{0}': expected host:port")]
    InvalidEndpoint(String),
    #[error("{0}")]
    Protocol(String),
    #[error("gave up after {}s: the cluster stayed overloaded ({message}); try again later", .waited.as_secs())]
    Overloaded { waited: Duration, message: String },
}

impl ClientError {
    /// gRPC code of a server-side refusal, if this is one.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Status(s) => Some(s.code()),
            ClientError::Overloaded { .. } => Some(Code::ResourceExhausted),
            _ => None,
        }
    }
}

impl From<corral_proto::ProtoError> for ClientError {
    fn from(e: corral_proto::ProtoError) -> Self {
        ClientError::Protocol(format!("malformed reply from coordinator: {e}"))
    }
}

/// How a client finds and talks to coordinators.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `host:port` of one or more coordinators.
    pub endpoints: Vec<String>,
    pub token: Option<String>,
    /// Mutual TLS: the cluster CA and our certificate; `None`: plaintext. Every server must
    /// present a coordinator certificate, or nothing is sent to it.
    pub tls: Option<corral_security::ClientTls>,
    /// TLS without a client certificate, trusting only servers whose chain verifies against the
    /// CA with this hash (a worker joining with a token); used instead of `tls`.
    pub ca_pin: Option<corral_security::CaPin>,
    pub connect_timeout: Duration,
    /// Longest one attempt of a unary call may take before it is retried (with the same
    /// request id): a partitioned or deposed coordinator must not hang the caller.
    pub request_timeout: Duration,
    /// Total time spent retrying an unavailable cluster before giving up.
    pub retry_for: Duration,
    /// Total time a call keeps waiting out a busy coordinator (RESOURCE_EXHAUSTED with a
    /// retry-after: a full submit queue or client-request limit) before giving up.
    pub overload_retry_for: Duration,
}

impl ClientConfig {
    pub fn new(endpoints: Vec<String>) -> Self {
        ClientConfig {
            endpoints,
            token: None,
            tls: None,
            ca_pin: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            retry_for: Duration::from_secs(5),
            overload_retry_for: Duration::from_secs(60),
        }
    }
}

/// How long `cluster_join` waits for the new coordinator to catch up as a learner: it receives
/// the cluster's whole state and history first (tens of seconds for a million jobs).
pub const JOIN_PATIENCE: Duration = Duration::from_secs(30 * 60);
/// How long `cluster_snapshot` waits for the snapshot (the coordinator waits up to 5 minutes).
pub const SNAPSHOT_PATIENCE: Duration = Duration::from_secs(330);

/// A connection pool over the configured coordinators. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    config: Arc<ClientConfig>,
    state: Arc<Mutex<Pool>>,
}

struct Pool {
    /// Address that answered last (the leader, after a redirect).
    preferred: Option<String>,
    channels: BTreeMap<String, Channel>,
}

/// A TLS failure hidden in a transport error status, explained.
fn tls_refusal(status: &Status) -> Option<String> {
    if !matches!(status.code(), Code::Unavailable | Code::Unknown) {
        return None;
    }
    let mut chain = status.message().to_string();
    let mut source = std::error::Error::source(status);
    while let Some(s) = source {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    corral_security::describe_tls_error(&chain)
}

/// An HTTP server that is not a gRPC service answered (e.g. the metrics listener): tonic reads
/// its HTML body as a gRPC frame or maps its HTTP status.
fn answers_plain_http(status: &Status) -> bool {
    let message = status.message();
    message.contains("invalid compression flag")
        || message.contains("while receiving response with status")
        || message.contains("mapped from HTTP status")
}

/// The pause between rounds over the coordinators while none answers, for the first
/// `FAST_POLL_FOR` of a call: a failover is over about when an election is, not a backoff later.
const FAST_POLL: Duration = Duration::from_millis(10);
const FAST_POLL_FOR: Duration = Duration::from_secs(1);
/// The longest pause between rounds after that.
const SLOW_POLL: Duration = Duration::from_millis(100);

/// The longest single wait after a full submit queue's refusal, whatever it asks.
const MAX_OVERLOAD_WAIT: Duration = Duration::from_secs(5);

/// How long a refusal of a full submit queue asks to wait; `None` for any other error (a
/// tenant's pending-job quota is RESOURCE_EXHAUSTED too, but nothing a retry fixes soon).
fn retry_after(status: &Status) -> Option<Duration> {
    if status.code() != Code::ResourceExhausted {
        return None;
    }
    let ms: u64 = status.metadata().get(RETRY_AFTER_METADATA)?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// `wait`, capped at MAX_OVERLOAD_WAIT, plus up to half of it at random, so that refused
/// clients do not all come back at the same instant.
fn jittered(wait: Duration) -> Duration {
    let wait = wait.min(MAX_OVERLOAD_WAIT);
    let random = (uuid::Uuid::new_v4().as_u128() % 1000) as u32;
    wait + wait / 2 * random / 1000
}

/// Which jobs a listing returns (`Client::list_jobs_page`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobQuery {
    /// Every state (finished jobs too) when `states` is empty.
    pub all: bool,
    pub tenant: Option<String>,
    /// Only these states; empty: pending and running (every state with `all`).
    pub states: Vec<JobState>,
    /// Only jobs named exactly this.
    pub name: Option<String>,
    /// Only jobs whose name starts with this.
    pub name_prefix: Option<String>,
    /// Submitted at or after this.
    pub submitted_since: Option<Timestamp>,
    /// Submitted before this.
    pub submitted_until: Option<Timestamp>,
    /// Only jobs submitted by this user (the login name recorded at submit).
    pub user: Option<String>,
    /// Each job without its script and environment (`ListJobsRequest.brief`): a listing that
    /// shows neither decodes a fraction of the bytes.
    pub brief: bool,
}

/// Which billing segments a listing returns (`Client::segments_page`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SegmentQuery {
    pub tenant: Option<String>,
    /// Only segments of these jobs; empty: any job.
    pub job_ids: Vec<u64>,
    /// Segments that end at or after this.
    pub since: Option<Timestamp>,
    /// Segments that start before this.
    pub until: Option<Timestamp>,
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Where the next page starts; `None`: this was the last one. A page may be shorter than
    /// asked for (even empty) and still have a next one.
    pub next_page_token: Option<String>,
}

fn retryable(status: &Status) -> bool {
    matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded)
        && !status.message().starts_with("logs of job")
}

impl Client {
    pub fn new(config: ClientConfig) -> Result<Self, ClientError> {
        if config.endpoints.is_empty() {
            return Err(ClientError::InvalidEndpoint(String::new()));
        }
        for e in &config.endpoints {
            let valid = e.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !valid {
                return Err(ClientError::InvalidEndpoint(e.clone()));
            }
        }
        Ok(Client {
            config: Arc::new(config),
            state: Arc::new(Mutex::new(Pool { preferred: None, channels: BTreeMap::new() })),
        })
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Addresses to try, the preferred (last known good / leader) first.
    fn candidates(&self) -> Vec<String> {
        let pool = self.pool();
        let mut out: Vec<String> = pool.preferred.iter().cloned().collect();
        out.extend(self.config.endpoints.iter().filter(|e| Some(*e) != pool.preferred.as_ref()).cloned());
        out
    }

    async fn channel(&self, addr: &str) -> Result<Channel, String> {
        if let Some(c) = self.pool().channels.get(addr) {
            return Ok(c.clone());
        }
        // Over TLS the connector does the handshake (and checks the server's role): the URI
        // stays http:// so tonic adds none of its own.
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| e.to_string())?
            .connect_timeout(self.config.connect_timeout)
            .timeout(self.config.request_timeout)
            .tcp_nodelay(true);
        let channel = if let Some(pin) = self.config.ca_pin {
            corral_security::pinned_channel(addr, pin, endpoint).await?
        } else if let Some(tls) = &self.config.tls {
            tls.connect(endpoint, addr, corral_security::ExpectedServer::Coordinator).await?
        } else {
            endpoint.connect().await.map_err(|e| {
                let mut msg = e.to_string();
                let mut chain = msg.clone();
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    msg = s.to_string();
                    chain.push_str(": ");
                    chain.push_str(&msg);
                    source = s.source();
                }
                corral_security::describe_tls_error(&chain).unwrap_or(msg)
            })?
        };
        self.pool().channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }

    fn forget(&self, addr: &str) {
        let mut pool = self.pool();
        pool.channels.remove(addr);
        if pool.preferred.as_deref() == Some(addr) {
            pool.preferred = None;
        }
    }

    /// Runs `call` against coordinators until one answers, following leader redirects and
    /// retrying unavailability for up to `retry_for`. `call` must be safe to repeat.
    pub async fn with_retry<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        // A refusal with a retry-after (a full submit queue, or `limits.max-client-requests`
        // handlers busy) comes before the coordinator did anything: safe to repeat, any call.
        self.with_overload_retry(|| self.with_failover(&call)).await
    }

    /// Runs `call` on the preferred coordinator, failing over to the others and following
    /// leader hints while they are unavailable, for up to `retry_for`.
    async fn with_failover<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let started = Instant::now();
        let deadline = started + self.config.retry_for;
        let mut backoff = FAST_POLL;
        let mut last_error = String::from("no endpoint tried");
        // Addresses that refused a connection during this call: a stale leader hint naming one
        // of them (followers keep naming a dead leader until they elect a new one) is ignored.
        let mut unreachable: BTreeSet<String> = BTreeSet::new();
        loop {
            // A redirect makes the leader the preferred endpoint and restarts the round at once.
            let mut redirected = false;
            for addr in self.candidates() {
                let channel = match self.channel(&addr).await {
                    Ok(c) => c,
                    Err(e) if e.starts_with("TLS:") && e.contains(&addr) => return Err(ClientError::Protocol(e)),
                    Err(e) if e.starts_with("TLS:") => return Err(ClientError::Protocol(format!("{e} ({addr})"))),
                    Err(e) => {
                        last_error = e;
                        self.forget(&addr);
                        unreachable.insert(addr);
                        continue;
                    }
                };
                // The channel's timeout ends at the answer's headers: a coordinator frozen
                // mid-answer (its process stopped, its kernel still holding the connection) left
                // the body waited for forever. The whole answer gets the same bound.
                let answer =
                    tokio::time::timeout(self.config.request_timeout, call(channel)).await.unwrap_or_else(|_| {
                        Err(Status::deadline_exceeded(format!(
                            "no whole answer from {addr} within {} ms",
                            self.config.request_timeout.as_millis()
                        )))
                    });
                match answer {
                    Ok(v) => {
                        self.pool().preferred = Some(addr);
                        return Ok(v);
                    }
                    Err(status) if self.config.tls.is_some() && tls_refusal(&status).is_some() => {
                        let message = tls_refusal(&status).unwrap_or_default();
                        return Err(ClientError::Status(Status::new(Code::Unauthenticated, message)));
                    }
                    Err(status)
                        if self.config.tls.is_none()
                            && status.code() == Code::Internal
                            && status.message().contains("h2 protocol error") =>
                    {
                        return Err(ClientError::Protocol(format!(
                            "the coordinator at {addr} did not answer in plaintext: it probably requires TLS (pass --ca, --cert and --key)"
                        )));
                    }
                    Err(status) if answers_plain_http(&status) => {
                        return Err(ClientError::Protocol(format!(
                            "{addr}: that address answers HTTP, not corral's gRPC (is it the metrics port?): give the coordinator's API address to --endpoint"
                        )));
                    }
                    Err(status) if retryable(&status) => {
                        let leader =
                            status.metadata().get(LEADER_ADDR_METADATA).and_then(|v| v.to_str().ok()).map(String::from);
                        last_error = status.message().to_string();
                        if let Some(leader) = leader.filter(|l| *l != addr && !unreachable.contains(l)) {
                            self.pool().preferred = Some(leader);
                            redirected = true;
                            break;
                        }
                        if status.code() != Code::Unavailable || status.message().contains("transport") {
                            self.forget(&addr);
                        }
                    }
                    Err(status) => return Err(ClientError::Status(status)),
                }
            }
            if redirected && Instant::now() < deadline {
                continue;
            }
            if Instant::now() + backoff > deadline {
                return Err(ClientError::Unreachable { endpoints: self.config.endpoints.join(","), last_error });
            }
            tokio::time::sleep(backoff).await;
            // An election takes a few hundred milliseconds, and the survivors name the new
            // leader as soon as they know it: poll them at FAST_POLL for the first
            // FAST_POLL_FOR (a few cheap refusals per round), then back off to SLOW_POLL.
            if started.elapsed() >= FAST_POLL_FOR {
                backoff = (backoff * 2).min(SLOW_POLL);
            }
            // A node that refused may be back (restarted) by the next round.
            unreachable.clear();
        }
    }

    /// Runs `call` again while the coordinator refuses it with a retry-after (a full submit
    /// queue, or as many client requests as it serves at once), after the wait it asks for
    /// (capped, with jitter), for up to `overload_retry_for`.
    async fn with_overload_retry<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let started = Instant::now();
        loop {
            let status = match call().await {
                Err(ClientError::Status(status)) => status,
                other => return other,
            };
            let Some(wait) = retry_after(&status) else { return Err(ClientError::Status(status)) };
            let wait = jittered(wait);
            if started.elapsed() + wait > self.config.overload_retry_for {
                return Err(ClientError::Overloaded {
                    waited: started.elapsed(),
                    message: status.message().to_string(),
                });
            }
            tracing::debug!(wait_ms = wait.as_millis() as u64, "coordinator busy: retrying");
            tokio::time::sleep(wait).await;
        }
    }

    fn authorize<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = &self.config.token {
            if let Ok(v) = format!("Bearer {token}").parse() {
                request.metadata_mut().insert("authorization", v);
            }
        }
        request
    }

    fn corral(channel: Channel) -> RawCorral<Channel> {
        RawCorral::new(channel)
            .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
    }

    /// Submits a job. The request id is generated once, so retries after a timeout or a leader
    /// change return the same job instead of creating a second one.
    pub async fn submit(&self, spec: &JobSpec) -> Result<Submitted, ClientError> {
        self.submit_with_id(&uuid::Uuid::new_v4().to_string(), spec).await
    }

    /// Submits with a caller-chosen request id (idempotent per id).
    pub async fn submit_with_id(&self, request_id: &str, spec: &JobSpec) -> Result<Submitted, ClientError> {
        let msg = pb::SubmitRequest { request_id: request_id.to_string(), spec: Some(spec.into()) };
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(msg.clone());
                async move { Self::corral(ch).submit(req).await }
            })
            .await?
            .into_inner();
        Ok(Submitted { job_id: reply.job_id, duplicate: reply.duplicate })
    }

    /// Submits many jobs in one call (one Raft entry). Each `(request id, spec)` is answered on
    /// its own: the job (and whether it existed already) or why it was refused.
    pub async fn submit_batch(
        &self,
        jobs: &[(String, JobSpec)],
    ) -> Result<Vec<Result<Submitted, String>>, ClientError> {
        let msg = pb::SubmitBatchRequest {
            jobs: jobs
                .iter()
                .map(|(rid, spec)| pb::SubmitRequest { request_id: rid.clone(), spec: Some(spec.into()) })
                .collect(),
        };
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(msg.clone());
                async move { Self::corral(ch).submit_batch(req).await }
            })
            .await?
            .into_inner();
        Ok(reply
            .results
            .into_iter()
            .map(|r| {
                if r.error.is_empty() {
                    Ok(Submitted { job_id: r.job_id, duplicate: r.duplicate })
                } else {
                    Err(r.error)
                }
            })
            .collect())
    }

    /// The first of `count` consecutive cluster-wide timestamps from the leader's oracle.
    pub async fn timestamps(&self, count: u32) -> Result<corral_types::Timestamp, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::GetTimestampsRequest { count });
                async move { Self::corral(ch).get_timestamps(req).await }
            })
            .await?;
        Ok(corral_types::Timestamp(reply.into_inner().first))
    }

    /// Billing segments, filtered by tenant, job and TSO time range: every page.
    pub async fn segments(
        &self,
        tenant: Option<String>,
        job_id: Option<u64>,
        since: Option<corral_types::Timestamp>,
        until: Option<corral_types::Timestamp>,
    ) -> Result<Vec<Segment>, ClientError> {
        let query = SegmentQuery { tenant, job_ids: job_id.into_iter().collect(), since, until };
        self.all_segments(&query).await
    }

    /// Every segment `query` selects, oldest first (follows the pages).
    pub async fn all_segments(&self, query: &SegmentQuery) -> Result<Vec<Segment>, ClientError> {
        let mut segments = Vec::new();
        let mut token = String::new();
        loop {
            let page = self.segments_page(query, &token, 0).await?;
            segments.extend(page.items);
            match page.next_page_token {
                Some(next) => token = next,
                None => return Ok(segments),
            }
        }
    }

    /// One page of the segments `query` selects, oldest first, starting at `page_token`
    /// (empty: the first); `limit` 0 is the server's default page.
    pub async fn segments_page(
        &self,
        query: &SegmentQuery,
        page_token: &str,
        limit: u32,
    ) -> Result<Page<Segment>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::ListSegmentsRequest {
                    tenant: query.tenant.clone(),
                    since: query.since.map(|t| t.0),
                    until: query.until.map(|t| t.0),
                    job_id: None,
                    page_token: page_token.to_string(),
                    limit,
                    job_ids: query.job_ids.clone(),
                });
                async move { Self::corral(ch).list_segments(req).await }
            })
            .await?
            .into_inner();
        Ok(Page {
            items: reply.segments.into_iter().map(Segment::from).collect(),
            next_page_token: Some(reply.next_page_token).filter(|t| !t.is_empty()),
        })
    }

    pub async fn get_job(&self, job_id: u64) -> Result<Job, ClientError> {
        self.get_job_ref(JobRef { id: job_id, task: None }).await
    }

    /// A job or a task of an array (`12_7`).
    pub async fn get_job_ref(&self, job: JobRef) -> Result<Job, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::GetJobRequest { job_id: job.id, array_index: job.task });
                async move { Self::corral(ch).get_job(req).await }
            })
            .await?;
        Ok(reply.into_inner().try_into()?)
    }

    /// Pending and running jobs (every job with `all`), of `tenant` if given: every page.
    pub async fn list_jobs(&self, all: bool, tenant: Option<String>) -> Result<Vec<Job>, ClientError> {
        self.all_jobs(&JobQuery { all, tenant, ..Default::default() }).await
    }

    /// Every job `query` selects, in job id order (follows the pages).
    pub async fn all_jobs(&self, query: &JobQuery) -> Result<Vec<Job>, ClientError> {
        let mut jobs = Vec::new();
        let mut token = String::new();
        loop {
            let page = self.list_jobs_page(query, &token, 0).await?;
            jobs.extend(page.items);
            match page.next_page_token {
                Some(next) => token = next,
                None => return Ok(jobs),
            }
        }
    }

    /// One page of the jobs `query` selects, in job id order, starting at `page_token` (empty:
    /// the first); `limit` 0 is the server's default page.
    pub async fn list_jobs_page(
        &self,
        query: &JobQuery,
        page_token: &str,
        limit: u32,
    ) -> Result<Page<Job>, ClientError> {
        let states: Vec<i32> = query.states.iter().map(|s| pb::JobState::from(*s) as i32).collect();
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::ListJobsRequest {
                    all: query.all,
                    tenant: query.tenant.clone(),
                    page_token: page_token.to_string(),
                    limit,
                    states: states.clone(),
                    name: query.name.clone(),
                    name_prefix: query.name_prefix.clone(),
                    submitted_since: query.submitted_since.map(|t| t.0),
                    submitted_until: query.submitted_until.map(|t| t.0),
                    user: query.user.clone(),
                    brief: query.brief,
                });
                async move { Self::corral(ch).list_jobs(req).await }
            })
            .await?
            .into_inner();
        let items = reply.jobs.into_iter().map(Job::try_from).collect::<Result<Vec<_>, _>>()?;
        Ok(Page { items, next_page_token: Some(reply.next_page_token).filter(|t| !t.is_empty()) })
    }

    pub async fn cancel(&self, job_id: u64) -> Result<Job, ClientError> {
        self.cancel_ref(JobRef { id: job_id, task: None }).await
    }

    /// Job control: `action` is hold, release, requeue, signal (with `request.signal`) or update
    /// (with the fields to change); the job's tenant or an admin.
    pub async fn control_job(&self, job: JobRef, mut request: pb::ControlJobRequest) -> Result<Job, ClientError> {
        request.job_id = job.id;
        request.array_index = job.task;
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(request.clone());
                async move { Self::corral(ch).control_job(req).await }
            })
            .await?;
        Ok(reply.into_inner().try_into()?)
    }

    /// Cancels a job, a whole array, or one task of an array (`12_7`, created or not).
    pub async fn cancel_ref(&self, job: JobRef) -> Result<Job, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::CancelJobRequest { job_id: job.id, array_index: job.task });
                async move { Self::corral(ch).cancel_job(req).await }
            })
            .await?;
        Ok(reply.into_inner().try_into()?)
    }

    /// Cancels every live job matching `request` (tenant, states, name); returns their ids.
    /// Safe to retry: jobs already cancelled are not counted again.
    pub async fn cancel_jobs(&self, request: pb::CancelJobsRequest) -> Result<Vec<u64>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(request.clone());
                async move { Self::corral(ch).cancel_jobs(req).await }
            })
            .await?;
        Ok(reply.into_inner().job_ids)
    }

    /// The job now and at each change until it ends, from the leader (one stream; it ends
    /// early when the leadership changes).
    pub async fn watch_job(&self, job_id: u64) -> Result<tonic::Streaming<pb::Job>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::WatchJobRequest { job_id });
                async move { Self::corral(ch).watch_job(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// The jobs `request` selects, then each change of one (`Corral.WatchJobs`), from the leader.
    /// The stream ends when the leadership changes: call again with `from_revision` set to the
    /// last `resume_revision` received to get every change since. A revision the leader no
    /// longer remembers is refused with `OutOfRange` (list the jobs again).
    pub async fn watch_jobs(
        &self,
        request: pb::WatchJobsRequest,
    ) -> Result<tonic::Streaming<pb::JobEvent>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(request.clone());
                async move { Self::corral(ch).watch_jobs(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Follows job `job_id` until it ends and returns it; `on_change` sees every state the
    /// leader sends. Follows leader changes; fails only when no coordinator answers for
    /// `retry_for` or the job is unknown.
    pub async fn wait_job(&self, job_id: u64, mut on_change: impl FnMut(&Job)) -> Result<Job, ClientError> {
        loop {
            let mut stream = self.watch_job(job_id).await?;
            loop {
                match stream.message().await {
                    Ok(Some(job)) => {
                        let job = Job::try_from(job)?;
                        on_change(&job);
                        if job.state.is_terminal() {
                            return Ok(job);
                        }
                    }
                    // The leader changed or the connection broke: watch again from the new one.
                    Ok(None) => break,
                    Err(status) if retryable(&status) => break,
                    Err(status) => return Err(ClientError::Status(status)),
                }
            }
        }
    }

    /// Streams a job's output (of its first part); with `follow`, until the job ends.
    pub async fn read_logs(&self, job_id: u64, follow: bool) -> Result<tonic::Streaming<pb::LogChunk>, ClientError> {
        self.read_rank_logs(job_id, 0, follow).await
    }

    /// A new step of run `epoch` of job `job_id` (the caller's own), as `srun` in a `corral
    /// alloc` session asks for it; a retry with the same `request_id` returns the step it made.
    pub async fn create_job_step(
        &self,
        job_id: u64,
        epoch: u64,
        request_id: &str,
        spec: &corral_types::StepSpec,
    ) -> Result<corral_types::JobStep, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::CreateStepRequest {
                    node: String::new(),
                    job_id,
                    epoch,
                    request_id: request_id.to_owned(),
                    spec: Some(spec.into()),
                });
                async move { Self::corral(ch).create_job_step(req).await }
            })
            .await?;
        let step = reply
            .into_inner()
            .step
            .ok_or_else(|| ClientError::Protocol("malformed reply from coordinator: missing step".into()))?;
        Ok(step.try_into()?)
    }

    /// `signal` to every task of step `step` of job `job_id` (the caller's own).
    pub async fn signal_job_step(&self, job_id: u64, step: u32, signal: i32) -> Result<bool, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::SignalStepRequest { node: String::new(), job_id, step, signal });
                async move { Self::corral(ch).signal_job_step(req).await }
            })
            .await?;
        Ok(reply.into_inner().accepted)
    }

    /// Streams task `task`'s output of step `step` of job `job_id` (the caller's own), until its
    /// node's tasks of the step are gone.
    pub async fn read_job_step_output(
        &self,
        job_id: u64,
        step: u32,
        task: u32,
    ) -> Result<tonic::Streaming<pb::LogChunk>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req =
                    self.authorize(pb::ReadStepOutputRequest { node: String::new(), job_id, step, task, epoch: 0 });
                async move { Self::corral(ch).read_job_step_output(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// `corral attach`: `input` (its start, then stdin) to a process inside a running job, its
    /// output back. Not retried once the coordinator took the input (it cannot be replayed).
    pub async fn attach(
        &self,
        input: impl tokio_stream::Stream<Item = pb::AttachInput> + Send + 'static,
    ) -> Result<tonic::Streaming<pb::AttachOutput>, ClientError> {
        let input = std::sync::Mutex::new(Some(input));
        let reply = self
            .with_retry(|ch| {
                let taken = input.lock().unwrap_or_else(|p| p.into_inner()).take();
                let req = taken.map(|i| self.authorize(i));
                async move {
                    match req {
                        Some(req) => Self::corral(ch).attach(req).await,
                        None => Err(Status::aborted("attach: the coordinator went away while starting it; try again")),
                    }
                }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Streams the output of part `rank` of a job (a gang's part index; 0 for any job).
    pub async fn read_rank_logs(
        &self,
        job_id: u64,
        rank: u32,
        follow: bool,
    ) -> Result<tonic::Streaming<pb::LogChunk>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::ReadLogsRequest { job_id, follow, rank, tail_bytes: None });
                async move { Self::corral(ch).read_logs(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// The images in the workers' stores: one node's, or (empty `node`) every node's (admin).
    pub async fn list_images(&self, node: &str) -> Result<pb::ListImagesResponse, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::ListImagesRequest { node: node.to_string() });
                async move { Self::corral(ch).list_images(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Pulls `reference` into one node's store, or (`all`) every node's that is up (admin):
    /// progress events of each node, then one final event per node.
    pub async fn pull_image(
        &self,
        reference: &str,
        node: Option<&str>,
        all: bool,
    ) -> Result<tonic::Streaming<pb::ImagePullEvent>, ClientError> {
        let request =
            pb::PullImageRequest { reference: reference.to_string(), node: node.unwrap_or_default().to_string(), all };
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(request.clone());
                async move { Self::corral(ch).pull_image(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Removes `reference` from one node's store, or every node's that has it (admin); nodes
    /// where a job needs it refuse.
    pub async fn remove_image(
        &self,
        reference: &str,
        node: Option<&str>,
    ) -> Result<pb::RemoveImageResponse, ClientError> {
        let request = pb::RemoveImageRequest {
            reference: reference.to_string(),
            node: node.unwrap_or_default().to_string(),
            ..Default::default()
        };
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(request.clone());
                async move { Self::corral(ch).remove_image(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Loads the archive at `path` (a `docker save` or OCI archive) into one node's store, or
    /// every node's that is up (admin). The file is sent in chunks of `LOAD_CHUNK` bytes, read
    /// as they are sent (a retry sends it again from its start: loading is idempotent).
    pub async fn load_image(
        &self,
        path: &std::path::Path,
        node: Option<&str>,
    ) -> Result<pb::LoadImageResponse, ClientError> {
        let total =
            std::fs::metadata(path).map_err(|e| ClientError::Protocol(format!("{}: {e}", path.display())))?.len();
        let node = node.unwrap_or_default().to_string();
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(file_chunks(path.to_path_buf(), node.clone(), total));
                async move { Self::corral(ch).load_image(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn list_nodes(&self) -> Result<Vec<pb::NodeView>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::ListNodesRequest {});
                async move { Self::corral(ch).list_nodes(req).await }
            })
            .await?;
        Ok(reply.into_inner().nodes)
    }

    fn admin(channel: Channel) -> ClusterAdminClient<Channel> {
        ClusterAdminClient::new(channel)
            .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
    }

    /// Issues a token (admin only); the reply carries the secret, shown once.
    pub async fn create_token(
        &self,
        tenant: Option<String>,
        admin: bool,
        ttl: Option<Duration>,
    ) -> Result<pb::CreateTokenResponse, ClientError> {
        let msg = pb::CreateTokenRequest {
            tenant: tenant.unwrap_or_default(),
            admin,
            ttl_secs: ttl.map(|d| d.as_secs().max(1)),
        };
        // A retry after a lost reply issues a second token, whose secret nobody saw: it shows
        // in `token list` and can be revoked.
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(msg.clone());
                async move { Self::corral(ch).create_token(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn list_tokens(&self) -> Result<Vec<pb::TokenInfo>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::ListTokensRequest {});
                async move { Self::corral(ch).list_tokens(req).await }
            })
            .await?;
        Ok(reply.into_inner().tokens)
    }

    pub async fn revoke_token(&self, token_id: u64) -> Result<pb::TokenInfo, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::RevokeTokenRequest { token_id });
                async move { Self::corral(ch).revoke_token(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Issues a single-use join token for a worker (admin certificate only); the reply carries
    /// the token, shown once.
    pub async fn create_join_token(&self, ttl: Duration) -> Result<pb::CreateJoinTokenResponse, ClientError> {
        let msg = pb::CreateJoinTokenRequest { ttl_ms: (ttl.as_millis() as u64).max(1) };
        // A retry after a lost reply issues a second token nobody saw; it expires unused.
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(msg);
                async move { Self::admin(ch).create_join_token(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Joins a worker: spends the token's `secret` for a certificate of the request `csr`
    /// (DER). Call it on a client with `ca_pin` set. A retry with the same request is answered
    /// again (the coordinators know the key), so a lost reply does not burn the token.
    pub async fn join_node(&self, secret: &str, csr: Vec<u8>) -> Result<pb::JoinNodeResponse, ClientError> {
        let msg = pb::JoinNodeRequest { secret: secret.to_string(), csr };
        let reply = self
            .with_retry(|ch| {
                let req = tonic::Request::new(msg.clone());
                async move {
                    corral_proto::v1::node_join_client::NodeJoinClient::new(ch)
                        .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
                        .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
                        .join(req)
                        .await
                }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Renews the certificate this client presents (a worker's): `csr` (DER) asks for the same
    /// node name. Answers the new certificate and the CA. A retry asks again (a lost reply
    /// costs one more certificate, nothing else).
    pub async fn renew_certificate(&self, csr: Vec<u8>) -> Result<pb::JoinNodeResponse, ClientError> {
        let msg = pb::RenewCertificateRequest { csr };
        let reply = self
            .with_retry(|ch| {
                let req = tonic::Request::new(msg.clone());
                async move {
                    corral_proto::v1::node_join_client::NodeJoinClient::new(ch)
                        .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
                        .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
                        .renew(req)
                        .await
                }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// The cluster policy as a file (admin).
    pub async fn get_policy(&self) -> Result<pb::PolicyFile, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::GetPolicyRequest {});
                async move { Self::corral(ch).get_policy(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Applies a policy file (`source` names it in errors), or with `dry_run` says what it would
    /// change (admin). A retry after a lost reply changes nothing more: the same policy again is
    /// no change.
    pub async fn apply_policy(
        &self,
        source: &str,
        toml: &str,
        force: bool,
        dry_run: bool,
    ) -> Result<pb::ApplyPolicyResponse, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::ApplyPolicyRequest {
                    toml: toml.to_string(),
                    source: source.to_string(),
                    force,
                    dry_run,
                });
                async move { Self::corral(ch).apply_policy(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Cordons (`cordoned`), drains (`draining`, optionally stopping jobs after `deadline_secs`)
    /// or resumes (`active`) a node (admin).
    pub async fn set_node_mode(
        &self,
        node: &str,
        mode: &str,
        reason: &str,
        deadline_secs: Option<u64>,
    ) -> Result<pb::NodeModeResponse, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::SetNodeModeRequest {
                    node: node.to_string(),
                    mode: mode.to_string(),
                    reason: reason.to_string(),
                    deadline_secs,
                });
                async move { Self::corral(ch).set_node_mode(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Sets (`Some`: unix ms) or clears (`None`) the operator's lease end of a node (admin).
    pub async fn set_node_lease(
        &self,
        node: &str,
        lease_end_ms: Option<u64>,
    ) -> Result<pb::NodeModeResponse, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::SetNodeLeaseRequest { node: node.to_string(), lease_end_ms });
                async move { Self::corral(ch).set_node_lease(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Forgets an empty node that is down, cordoned or drained (admin).
    pub async fn remove_node(&self, node: &str) -> Result<pb::RemoveNodeResponse, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::RemoveNodeRequest { node: node.to_string() });
                async move { Self::corral(ch).remove_node(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// The applied policy versions, oldest first (admin).
    pub async fn policy_history(&self) -> Result<Vec<pb::PolicyChange>, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::PolicyHistoryRequest {});
                async move { Self::corral(ch).policy_history(req).await }
            })
            .await?;
        Ok(reply.into_inner().changes)
    }

    /// Bootstraps a cluster on the first configured endpoint (not forwarded anywhere else), with
    /// `policy` (file name, TOML) as its first policy, or the dev pool's.
    pub async fn cluster_init(&self, policy: Option<(&str, &str)>) -> Result<pb::ClusterStatus, ClientError> {
        let only = self.single(0)?;
        let (source, policy_toml) = policy.unwrap_or_default();
        let reply = only
            .with_retry(|ch| {
                let req = self.authorize(pb::ClusterInitRequest {
                    policy_toml: policy_toml.to_string(),
                    source: source.to_string(),
                });
                async move { Self::admin(ch).init(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// The view of the first configured endpoint (not forwarded).
    pub async fn cluster_status(&self) -> Result<pb::ClusterStatus, ClientError> {
        self.cluster_status_with(false).await
    }

    /// The view of the first configured endpoint; with `digest`, also the digest of its state
    /// machine (costly on a large state: it encodes all of it).
    pub async fn cluster_status_with(&self, digest: bool) -> Result<pb::ClusterStatus, ClientError> {
        // A digest encodes the whole state, as a snapshot does: seconds for a large one.
        let only = if digest { self.single(0)?.patient(SNAPSHOT_PATIENCE)? } else { self.single(0)? };
        let reply = only
            .with_retry(|ch| {
                let req = self.authorize(pb::ClusterStatusRequest { digest });
                async move { Self::admin(ch).status(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Builds a snapshot on the first configured endpoint now; its status once written (a large
    /// state takes seconds: the call waits up to [`SNAPSHOT_PATIENCE`]).
    pub async fn cluster_snapshot(&self) -> Result<pb::ClusterStatus, ClientError> {
        let only = self.single(0)?.patient(SNAPSHOT_PATIENCE)?;
        let reply = only
            .with_retry(|ch| {
                let req = self.authorize(pb::ClusterSnapshotRequest {});
                async move { Self::admin(ch).snapshot(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Adds the coordinator running at `addr` (asked for its node id first) to the cluster.
    pub async fn cluster_join(&self, addr: &str) -> Result<pb::ClusterStatus, ClientError> {
        let newcomer = Client::new(ClientConfig { endpoints: vec![addr.to_string()], ..(*self.config).clone() })?;
        let status = newcomer.cluster_status().await?;
        if status.initialized && !status.members.iter().all(|m| m.node_id == status.node_id) {
            return Err(ClientError::Protocol(format!(
                "coordinator {} at {addr} already belongs to a cluster of {} members: join only empty coordinators",
                status.node_id,
                status.members.len()
            )));
        }
        let node_id = status.node_id;
        // The newcomer is a learner until it caught up: it receives the whole state first.
        let patient = self.patient(JOIN_PATIENCE)?;
        let reply = patient
            .with_retry(|ch| {
                let req = patient.authorize(pb::JoinRequest { node_id, addr: addr.to_string() });
                async move { Self::admin(ch).join(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// Removes coordinator `node_id` from the cluster.
    pub async fn cluster_leave(&self, node_id: u64) -> Result<pb::ClusterStatus, ClientError> {
        let reply = self
            .with_retry(|ch| {
                let req = self.authorize(pb::LeaveRequest { node_id });
                async move { Self::admin(ch).leave(req).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// A client whose calls may each take up to `limit` (one slow call, not a hung peer).
    fn patient(&self, limit: Duration) -> Result<Client, ClientError> {
        Client::new(ClientConfig { request_timeout: limit, ..(*self.config).clone() })
    }

    /// A client that talks to endpoint `index` only.
    fn single(&self, index: usize) -> Result<Client, ClientError> {
        let endpoint =
            self.config.endpoints.get(index).cloned().ok_or_else(|| ClientError::InvalidEndpoint(String::new()))?;
        Client::new(ClientConfig { endpoints: vec![endpoint], ..(*self.config).clone() })
    }

    /// The worker-side protocol, on the same failover and leader redirects.
    pub fn gateway(&self) -> GatewayClient {
        GatewayClient { client: self.clone(), attempt_timeout: None }
    }
}

/// Result of a submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    pub job_id: u64,
    pub duplicate: bool,
}

/// What workers call on the coordinators.
#[derive(Clone)]
pub struct GatewayClient {
    client: Client,
    /// Longest one attempt may take before the next coordinator is tried.
    attempt_timeout: Option<std::time::Duration>,
}

/// Runs one attempt of a call, bounded by `limit`: a frozen coordinator answers nothing.
async fn bounded<T>(limit: Option<Duration>, call: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
    match limit {
        Some(limit) => tokio::time::timeout(limit, call)
            .await
            .unwrap_or_else(|_| Err(Status::deadline_exceeded(format!("no answer within {limit:?}")))),
        None => call.await,
    }
}

impl GatewayClient {
    /// The same client, giving up on a coordinator that does not answer one attempt within
    /// `limit` and trying the next (a worker's lease depends on hearing from a leader quickly).
    pub fn with_attempt_timeout(mut self, limit: Duration) -> Self {
        self.attempt_timeout = Some(limit);
        self
    }

    fn raw(channel: Channel) -> WorkerGatewayClient<Channel> {
        WorkerGatewayClient::new(channel)
            .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
    }

    pub async fn register(&self, req: pb::RegisterRequest) -> Result<pb::RegisterResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).register(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn heartbeat(&self, req: pb::HeartbeatRequest) -> Result<pb::HeartbeatResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).heartbeat(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// The node's desired state, pushed by the leader at every change (see
    /// `WorkerGateway.WatchDesired`); the stream ends when the leadership changes.
    pub async fn watch_desired(
        &self,
        req: pb::WatchDesiredRequest,
    ) -> Result<tonic::Streaming<pb::DesiredState>, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).watch_desired(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn report_started(&self, req: pb::ReportStartedRequest) -> Result<pb::ReportResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).report_started(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// This node's part of an image gang has its image ready (`job_id`, `epoch`, `node`).
    pub async fn report_part_ready(&self, req: pb::ReportStartedRequest) -> Result<pb::ReportResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).report_part_ready(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// This node's part of a session on several nodes is idle past its timeout, or busy again.
    pub async fn report_part_idle(&self, req: pb::ReportPartIdleRequest) -> Result<pb::ReportResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).report_part_idle(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn report_finished(&self, req: pb::ReportFinishedRequest) -> Result<pb::ReportResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).report_finished(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn create_step(&self, req: pb::CreateStepRequest) -> Result<pb::CreateStepResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).create_step(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn report_step_ended(&self, req: pb::ReportStepEndedRequest) -> Result<pb::ReportResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).report_step_ended(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    /// One task's output of a step, as it comes (`srun` relaying other nodes' tasks).
    pub async fn read_step_output(
        &self,
        req: pb::ReadStepOutputRequest,
    ) -> Result<tonic::Streaming<pb::LogChunk>, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).read_step_output(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }

    pub async fn signal_step(&self, req: pb::SignalStepRequest) -> Result<pb::ReportResponse, ClientError> {
        let limit = self.attempt_timeout;
        let reply = self
            .client
            .with_retry(|ch| {
                let req = req.clone();
                async move { bounded(limit, Self::raw(ch).signal_step(req)).await }
            })
            .await?;
        Ok(reply.into_inner())
    }
}

/// Bytes of an archive per `LoadImage` chunk.
pub const LOAD_CHUNK: usize = 1 << 20;

/// The chunks of the file at `path`, read on a thread of their own as the call takes them (at
/// most four chunks read ahead); the first names `node` and the file's `total` size. A read
/// error ends the stream early (the worker then refuses the short archive).
fn file_chunks(
    path: std::path::PathBuf,
    node: String,
    total: u64,
) -> tokio_stream::wrappers::ReceiverStream<pb::LoadImageChunk> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    std::thread::spawn(move || {
        use std::io::Read;
        let Ok(mut file) = std::fs::File::open(&path) else { return };
        let mut first = true;
        loop {
            let mut data = vec![0u8; LOAD_CHUNK];
            let mut filled = 0;
            while filled < data.len() {
                match file.read(&mut data[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
            if filled == 0 && !first {
                return;
            }
            data.truncate(filled);
            let chunk = pb::LoadImageChunk {
                node: if first { node.clone() } else { String::new() },
                total_bytes: if first { total } else { 0 },
                data,
            };
            first = false;
            if tx.blocking_send(chunk).is_err() || filled < LOAD_CHUNK {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A coordinator frozen mid-answer (headers sent, then nothing, the connection held): the
    /// call gives up after the request timeout and fails over, instead of waiting forever.
    #[tokio::test]
    async fn an_answer_frozen_after_its_headers_times_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(mut conn) = h2::server::handshake(socket).await else { return };
                    while let Some(Ok((_request, mut respond))) = conn.accept().await {
                        let headers = http::Response::builder()
                            .status(200)
                            .header("content-type", "application/grpc")
                            .body(())
                            .expect("response");
                        let Ok(mut body) = respond.send_response(headers, false) else { return };
                        // The start of a 100-byte message, and no more.
                        let _ = body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 100]), false);
                        tokio::spawn(async move {
                            let _held = body;
                            std::future::pending::<()>().await
                        });
                    }
                });
            }
        });
        let mut config = ClientConfig::new(vec![addr.to_string()]);
        config.request_timeout = Duration::from_millis(300);
        config.retry_for = Duration::from_millis(500);
        let client = Client::new(config).expect("client");
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(20), client.timestamps(1))
            .await
            .expect("the client gave up by itself");
        assert!(answer.is_err(), "{answer:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "gave up after {:?}", started.elapsed());
    }

    #[test]
    fn only_a_full_queue_with_a_retry_after_is_waited_out() {
        let mut full = Status::resource_exhausted("the leader's submit queue is full");
        full.metadata_mut().insert(RETRY_AFTER_METADATA, "250".parse().expect("metadata"));
        assert_eq!(retry_after(&full), Some(Duration::from_millis(250)));
        let quota = Status::resource_exhausted("tenant a has 10 pending jobs");
        assert_eq!(retry_after(&quota), None, "a quota refusal is final");
        let mut other = Status::unavailable("x");
        other.metadata_mut().insert(RETRY_AFTER_METADATA, "250".parse().expect("metadata"));
        assert_eq!(retry_after(&other), None);
    }

    #[test]
    fn waits_are_capped_and_jittered_upwards() {
        for _ in 0..100 {
            let wait = jittered(Duration::from_millis(200));
            assert!(wait >= Duration::from_millis(200) && wait <= Duration::from_millis(300), "{wait:?}");
            let long = jittered(Duration::from_secs(60));
            assert!(long >= MAX_OVERLOAD_WAIT && long <= MAX_OVERLOAD_WAIT * 3 / 2, "{long:?}");
        }
    }

    #[tokio::test]
    async fn a_submit_refused_for_a_full_queue_is_retried_until_it_lands_or_the_patience_ends() {
        let mut config = ClientConfig::new(vec!["127.0.0.1:1".into()]);
        config.overload_retry_for = Duration::from_secs(2);
        let client = Client::new(config).expect("client");
        let refusal = || {
            let mut s = Status::resource_exhausted("the leader's submit queue is full");
            s.metadata_mut().insert(RETRY_AFTER_METADATA, "10".parse().expect("metadata"));
            ClientError::Status(s)
        };
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let landed = client
            .with_overload_retry(|| {
                let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let result = if n < 3 { Err(refusal()) } else { Ok(n) };
                async move { result }
            })
            .await
            .expect("lands on the fourth call");
        assert_eq!(landed, 3);
        let given_up = client.with_overload_retry(|| async { Err::<(), _>(refusal()) }).await.expect_err("gives up");
        assert!(matches!(given_up, ClientError::Overloaded { .. }), "{given_up:?}");
        assert!(given_up.to_string().contains("overloaded"), "{given_up}");
        let final_error = client
            .with_overload_retry(|| async { Err::<(), _>(ClientError::Status(Status::invalid_argument("bad"))) })
            .await
            .expect_err("not retried");
        assert_eq!(final_error.code(), Some(Code::InvalidArgument));
    }
}
