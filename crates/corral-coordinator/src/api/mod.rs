//! The user-facing `Corral` gRPC service. The service only dispatches: each call goes to its
//! handler in `jobs.rs` (submit, show, list, watch, logs, billing, timestamps), `control.rs`
//! (cancel, hold, release, requeue, signal, update), `admin.rs` (tokens, policy, nodes) or
//! `images.rs` (`corral image`, relayed to worker agents) , `steps.rs` (`srun` in a `corral
//! alloc` session: steps of the caller's own job) or `attach.rs` (`corral attach`, relayed to
//! the worker agent of the job's node).
//!
//! A read (`GetJob`, `ListJobs`, `ListNodes`, ...) is linearizable: it waits until this
//! leader applied everything committed before it, then its handler reads a [`Snapshot`]
//! taken at that point and nothing else of the coordinator (it still authenticates and audits
//! through it). A write proposes through the coordinator and reads what it needs, after the
//! write, through a snapshot too.

mod admin;
mod attach;
mod control;
mod images;
mod jobs;
mod steps;

use crate::auth::Principal;
use crate::snapshot::Snapshot;
use crate::watch::Watches;
use crate::Coordinator;
use corral_proto::v1::corral_server::{Corral, CorralServer};
use corral_proto::v1::{self as pb};
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// Failpoint (test builds): a `ListJobs` handler waits this many milliseconds first, holding
/// its admission, so a test can fill `limits.max-client-requests` deterministically
/// (`FAILPOINTS=list-jobs-delay-ms=1*return(2000)`: the first listing only).
pub const LIST_JOBS_DELAY_FAILPOINT: &str = "list-jobs-delay-ms";

/// Test builds: the delay (ms) the failpoint asks for before a listing is served.
fn list_jobs_delay_ms() -> u64 {
    crate::failpoints::setup();
    fail::fail_point!(LIST_JOBS_DELAY_FAILPOINT, |v| v.and_then(|v| v.parse().ok()).unwrap_or(0));
    0
}

pub(crate) fn server(coord: Coordinator) -> CorralServer<Api> {
    let watches = Watches::new(coord.config().max_watches_per_principal);
    CorralServer::new(Api { coord, watches })
        // Requests are untrusted input; replies (e.g. `jobs --all` on a big cluster) may be larger.
        .max_decoding_message_size(corral_proto::MAX_USER_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
}

pub(crate) struct Api {
    coord: Coordinator,
    /// The watches each principal holds open (`limits.max-watches-per-principal`).
    watches: Arc<Watches>,
}

impl Api {
    /// The snapshot of a linearizable read: taken once this node, confirmed as the leader,
    /// applied everything committed before the call. A follower answers `NotLeader`.
    async fn linearizable(&self) -> Result<Snapshot, Status> {
        self.coord.linearizable().await?;
        Ok(self.coord.snapshot())
    }
}

/// Refuses (and audits) a tenant's filter naming another tenant.
fn own_tenant_filter<T>(
    coord: &Coordinator,
    request: &Request<T>,
    action: &str,
    who: &Principal,
    tenant: Option<&str>,
) -> Result<(), Status> {
    match tenant {
        Some(t) if !who.may_access(t) => Err(coord.deny(
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

/// The tenant a filter selects: the one it names, or else the caller's own (`None`: an admin,
/// every tenant).
fn filter_tenant(who: &Principal, named: Option<&str>) -> Option<String> {
    named.or(who.tenant()).map(String::from)
}

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;
type JobStream = Pin<Box<dyn Stream<Item = Result<pb::Job, Status>> + Send>>;
type JobEventStream = Pin<Box<dyn Stream<Item = Result<pb::JobEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Corral for Api {
    async fn submit(&self, request: Request<pb::SubmitRequest>) -> Result<Response<pb::SubmitResponse>, Status> {
        jobs::submit(&self.coord, request).await
    }

    async fn submit_batch(
        &self,
        request: Request<pb::SubmitBatchRequest>,
    ) -> Result<Response<pb::SubmitBatchResponse>, Status> {
        jobs::submit_batch(&self.coord, request).await
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::Job>, Status> {
        let snapshot = self.linearizable().await?;
        jobs::get_job(&self.coord, &snapshot, request)
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        let delay_ms = list_jobs_delay_ms();
        if delay_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
        }
        let snapshot = self.linearizable().await?;
        jobs::list_jobs(&self.coord, &snapshot, request)
    }

    async fn cancel_job(&self, request: Request<pb::CancelJobRequest>) -> Result<Response<pb::Job>, Status> {
        control::cancel_job(&self.coord, request).await
    }

    type WatchJobStream = JobStream;

    async fn watch_job(&self, request: Request<pb::WatchJobRequest>) -> Result<Response<JobStream>, Status> {
        let snapshot = self.linearizable().await?;
        jobs::watch_job(&self.coord, &self.watches, &snapshot, request)
    }

    type WatchJobsStream = JobEventStream;

    async fn watch_jobs(&self, request: Request<pb::WatchJobsRequest>) -> Result<Response<JobEventStream>, Status> {
        self.coord.linearizable().await?;
        jobs::watch_jobs(&self.coord, &self.watches, request)
    }

    type ReadLogsStream = LogStream;

    async fn read_logs(&self, request: Request<pb::ReadLogsRequest>) -> Result<Response<LogStream>, Status> {
        jobs::read_logs(&self.coord, &self.watches, request).await
    }

    async fn list_segments(
        &self,
        request: Request<pb::ListSegmentsRequest>,
    ) -> Result<Response<pb::ListSegmentsResponse>, Status> {
        let snapshot = self.linearizable().await?;
        jobs::list_segments(&self.coord, &snapshot, request)
    }

    async fn get_timestamps(
        &self,
        request: Request<pb::GetTimestampsRequest>,
    ) -> Result<Response<pb::GetTimestampsResponse>, Status> {
        jobs::get_timestamps(&self.coord, request).await
    }

    async fn create_token(
        &self,
        request: Request<pb::CreateTokenRequest>,
    ) -> Result<Response<pb::CreateTokenResponse>, Status> {
        admin::create_token(&self.coord, request).await
    }

    async fn list_tokens(
        &self,
        request: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        let snapshot = self.linearizable().await?;
        admin::list_tokens(&self.coord, &snapshot, request)
    }

    async fn revoke_token(&self, request: Request<pb::RevokeTokenRequest>) -> Result<Response<pb::TokenInfo>, Status> {
        admin::revoke_token(&self.coord, request).await
    }

    async fn get_policy(&self, request: Request<pb::GetPolicyRequest>) -> Result<Response<pb::PolicyFile>, Status> {
        let snapshot = self.linearizable().await?;
        admin::get_policy(&self.coord, &snapshot, request)
    }

    async fn apply_policy(
        &self,
        request: Request<pb::ApplyPolicyRequest>,
    ) -> Result<Response<pb::ApplyPolicyResponse>, Status> {
        admin::apply_policy(&self.coord, request).await
    }

    async fn policy_history(
        &self,
        request: Request<pb::PolicyHistoryRequest>,
    ) -> Result<Response<pb::PolicyHistoryResponse>, Status> {
        let snapshot = self.linearizable().await?;
        admin::policy_history(&self.coord, &snapshot, request)
    }

    async fn control_job(&self, request: Request<pb::ControlJobRequest>) -> Result<Response<pb::Job>, Status> {
        control::control_job(&self.coord, request).await
    }

    async fn cancel_jobs(
        &self,
        request: Request<pb::CancelJobsRequest>,
    ) -> Result<Response<pb::CancelJobsResponse>, Status> {
        let snapshot = self.linearizable().await?;
        control::cancel_jobs(&self.coord, &snapshot, request).await
    }

    async fn set_node_mode(
        &self,
        request: Request<pb::SetNodeModeRequest>,
    ) -> Result<Response<pb::NodeModeResponse>, Status> {
        admin::set_node_mode(&self.coord, request).await
    }

    async fn set_node_lease(
        &self,
        request: Request<pb::SetNodeLeaseRequest>,
    ) -> Result<Response<pb::NodeModeResponse>, Status> {
        admin::set_node_lease(&self.coord, request).await
    }

    async fn remove_node(
        &self,
        request: Request<pb::RemoveNodeRequest>,
    ) -> Result<Response<pb::RemoveNodeResponse>, Status> {
        admin::remove_node(&self.coord, request).await
    }

    async fn list_nodes(
        &self,
        request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let snapshot = self.linearizable().await?;
        admin::list_nodes(&self.coord, &snapshot, request)
    }

    async fn list_images(
        &self,
        request: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        images::list_images(&self.coord, request).await
    }

    type PullImageStream = images::PullStream;

    async fn pull_image(&self, request: Request<pb::PullImageRequest>) -> Result<Response<images::PullStream>, Status> {
        images::pull_image(&self.coord, request).await
    }

    async fn remove_image(
        &self,
        request: Request<pb::RemoveImageRequest>,
    ) -> Result<Response<pb::RemoveImageResponse>, Status> {
        images::remove_image(&self.coord, request).await
    }

    async fn load_image(
        &self,
        request: Request<tonic::Streaming<pb::LoadImageChunk>>,
    ) -> Result<Response<pb::LoadImageResponse>, Status> {
        images::load_image(&self.coord, request).await
    }

    async fn create_job_step(
        &self,
        request: Request<pb::CreateStepRequest>,
    ) -> Result<Response<pb::CreateStepResponse>, Status> {
        steps::create_job_step(&self.coord, request).await
    }

    async fn signal_job_step(
        &self,
        request: Request<pb::SignalStepRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        steps::signal_job_step(&self.coord, request).await
    }

    type ReadJobStepOutputStream = steps::StepOutputStream;

    async fn read_job_step_output(
        &self,
        request: Request<pb::ReadStepOutputRequest>,
    ) -> Result<Response<steps::StepOutputStream>, Status> {
        steps::read_job_step_output(&self.coord, &self.watches, request).await
    }

    type AttachStream = attach::AttachStream;

    async fn attach(
        &self,
        request: Request<tonic::Streaming<pb::AttachInput>>,
    ) -> Result<Response<attach::AttachStream>, Status> {
        attach::attach(&self.coord, &self.watches, request).await
    }
}
