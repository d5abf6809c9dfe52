//! The `WorkerGateway` gRPC service: registration, heartbeats, the pushed desired state and job
//! reports from workers; the step calls are in `gateway/steps.rs`.
//!
//! Invariant: only a leader that may answer workers (`Coordinator::worker_term`: leading, lease
//! confirmed, its own term applied) answers; everyone else redirects or asks to retry. So no
//! report is judged, no worker is told to re-register and no lease is granted from a state that
//! lags or from a deposed leader.

mod steps;

use crate::{CoordError, Coordinator};
use corral_core::{ApplyError, Command, Outcome};
use corral_proto::v1::worker_gateway_server::{WorkerGateway, WorkerGatewayServer};
use corral_proto::v1::{self as pb};
use corral_types::{GpuFaultMark, GpuHealth, NodeState, NodeStatus};
use std::pin::Pin;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub(crate) fn server(coord: Coordinator) -> WorkerGatewayServer<Gateway> {
    WorkerGatewayServer::new(Gateway { coord })
        .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
}

pub(crate) struct Gateway {
    coord: Coordinator,
}

/// The fault marks a heartbeat of worker process `node_epoch` changes: a card fault it shows
/// that no mark records yet, and a marked GPU it shows schedulable after the marked fault.
pub(crate) fn gpu_fault_changes(node: &NodeStatus, node_epoch: u64, gpus: &[GpuHealth]) -> Vec<Command> {
    let mut changes = Vec::new();
    for gpu in gpus.iter().filter(|g| node.spec.gpus.iter().any(|d| d.index == g.index)) {
        let mark = node.gpu_faults.iter().find(|m| m.gpu == gpu.index);
        let seen =
            GpuFaultMark { gpu: gpu.index, reason: gpu.card_fault.clone(), node_epoch, seq: gpu.fault_seq, job_id: 0 };
        if !gpu.card_fault.is_empty() {
            if mark.is_none_or(|m| (node_epoch, gpu.fault_seq) > (m.node_epoch, m.seq)) {
                changes.push(Command::SetGpuFault { node: node.spec.name.clone(), mark: seen, clear: false });
            }
        } else if mark.is_some_and(|m| gpu.schedulable() && m.cleared_by(node_epoch, gpu.fault_seq)) {
            changes.push(Command::SetGpuFault { node: node.spec.name.clone(), mark: seen, clear: true });
        }
    }
    changes
}

type DesiredStream = Pin<Box<dyn Stream<Item = Result<pb::DesiredState, Status>> + Send>>;

impl Gateway {
    /// Over TLS a worker speaks only for the node its certificate names.
    fn require_node<T>(&self, request: &Request<T>, action: &str, node: &str) -> Result<(), Status> {
        match self.coord.worker_identity(request) {
            Some(name) if name != node => Err(self.coord.deny(
                request,
                action,
                &format!("worker {name}"),
                Status::permission_denied(format!(
                    "permission denied: the certificate of worker {name} cannot act for node {node}"
                )),
            )),
            _ => Ok(()),
        }
    }

    /// Over TLS a worker reports only jobs placed on its own node; a report about another
    /// node's job is audited and answered as stale (not accepted, nothing changes), so that a
    /// late report from a node the job has left is not retried forever. Judged on the state of
    /// a leader that answers workers; returns the applied index it was judged at.
    fn job_on_own_node<T>(&self, request: &Request<T>, action: &str, job_id: u64) -> Result<(), u64> {
        let Some(name) = self.coord.worker_identity(request) else { return Ok(()) };
        let (placed_here, revision) = {
            let data = self.coord.store().read();
            let placed = data
                .state
                .jobs
                .get(&job_id)
                .and_then(|j| j.allocation.as_ref())
                .is_some_and(|a| a.gpus_on(&name).is_some());
            (placed, data.applied_index())
        };
        if placed_here {
            return Ok(());
        }
        self.coord.deny(
            request,
            action,
            &format!("worker {name}"),
            Status::permission_denied(format!("permission denied: job {job_id} is not placed on node {name}")),
        );
        Err(revision)
    }

    /// Proposes a worker's report; a stale epoch or an unknown job is answered "not accepted".
    async fn report(&self, command: Command) -> Result<Response<pb::ReportResponse>, Status> {
        let ts = self.coord.timestamps(1).await?;
        match self.coord.propose_indexed(ts, command).await {
            Ok((outcome, revision)) => {
                if let Outcome::Job(job) = &outcome {
                    tracing::info!(job_id = job.id, state = %job.state, reason = job.reason.as_deref().unwrap_or(""), "job finished");
                }
                Ok(Response::new(pb::ReportResponse { accepted: outcome != Outcome::Stale, revision }))
            }
            Err(CoordError::Rejected(ApplyError::NoSuchJob(_))) => {
                let revision = self.coord.store().read().applied_index();
                Ok(Response::new(pb::ReportResponse { accepted: false, revision }))
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// The node a worker's report is for: over TLS the certificate names it (`identity`); without
/// it, the request does (`claimed`), and must.
fn reporting_node(identity: Option<String>, claimed: String, whose: &str) -> Result<String, Status> {
    let node = identity.unwrap_or(claimed);
    if node.is_empty() {
        return Err(Status::invalid_argument(format!("missing node: name the node {whose}")));
    }
    Ok(node)
}

#[tonic::async_trait]
impl WorkerGateway for Gateway {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let spec: corral_types::NodeSpec =
            request.get_ref().spec.clone().ok_or_else(|| Status::invalid_argument("missing node spec"))?.into();
        self.require_node(&request, "register", &spec.name)?;
        if spec.name.is_empty() {
            return Err(Status::invalid_argument("node name must not be empty"));
        }
        let term = self.coord.worker_term()?;
        let name = spec.name.clone();
        // A restarted worker process says when it stopped its predecessor's jobs: their runs
        // are billed until then, not until this registration got through.
        let command = match request.get_ref().stale_jobs_stopped_ms_ago {
            Some(stale_jobs_stopped_ms_ago) => Command::RegisterRestartedNode { spec, stale_jobs_stopped_ms_ago },
            None => Command::RegisterNode { spec },
        };
        match self.coord.propose(command).await? {
            Outcome::NodeRegistered { epoch } => {
                self.coord.liveness().heartbeat(term, &name, Vec::new());
                tracing::info!(node = %name, epoch, "node registered");
                Ok(Response::new(pb::RegisterResponse { node_epoch: epoch, lease: Some(self.coord.worker_lease()) }))
            }
            other => Err(Status::internal(format!("unexpected outcome of register: {other:?}"))),
        }
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.require_node(&request, "heartbeat", &request.get_ref().node)?;
        let hb = request.into_inner();
        let gpus: Vec<GpuHealth> = hb.gpus.into_iter().map(Into::into).collect();
        let term = match self.coord.worker_term() {
            Ok(term) => term,
            Err(e) => {
                // The worker is alive even if this leader cannot vouch for itself right now:
                // remember that, but grant no lease.
                if let Some(term) = self.coord.leading_term() {
                    self.coord.liveness().heartbeat(term, &hb.node, gpus);
                }
                return Err(e.into());
            }
        };
        let (current, fault_changes) = {
            let data = self.coord.store().read();
            match data.state.nodes.get(&hb.node).filter(|n| n.epoch == hb.node_epoch && n.state == NodeState::Up) {
                Some(node) => (true, gpu_fault_changes(node, hb.node_epoch, &gpus)),
                None => (false, Vec::new()),
            }
        };
        self.coord.liveness().heartbeat(term, &hb.node, gpus);
        self.coord.pulls().report(&hb.node, hb.pulls);
        if hb.images_reported {
            self.coord.held_images().report(&hb.node, hb.images);
        }
        // A card fault the heartbeat shows first (no run ended with it) leaves placement for
        // good, whatever leader comes next; a GPU clean after its fault comes back.
        for command in fault_changes {
            if let Err(e) = self.coord.propose(command).await {
                tracing::warn!(node = %hb.node, error = %e, "cannot record a gpu's card fault or recovery; the next heartbeat retries");
            }
        }
        // Unknown, down, or registered again since: the worker stops its jobs and registers again.
        Ok(Response::new(pb::HeartbeatResponse { reregister: !current, lease: Some(self.coord.worker_lease()), term }))
    }

    type WatchDesiredStream = DesiredStream;

    async fn watch_desired(
        &self,
        request: Request<pb::WatchDesiredRequest>,
    ) -> Result<Response<DesiredStream>, Status> {
        self.require_node(&request, "watch desired state", &request.get_ref().node)?;
        let term = self.coord.worker_term()?;
        let req = request.into_inner();
        let rx = crate::desired::stream(self.coord.clone(), req.node, req.node_epoch, term);
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn report_started(
        &self,
        request: Request<pb::ReportStartedRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.coord.worker_term()?;
        if let Err(revision) = self.job_on_own_node(&request, "report started", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false, revision }));
        }
        let r = request.into_inner();
        self.report(Command::JobStarted { job_id: r.job_id, epoch: r.epoch }).await
    }

    async fn report_finished(
        &self,
        request: Request<pb::ReportFinishedRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.coord.worker_term()?;
        if let Err(revision) = self.job_on_own_node(&request, "report finished", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false, revision }));
        }
        // Over TLS the certificate names the node; without it, the request does.
        let identity = self.coord.worker_identity(&request);
        let r = request.into_inner();
        let node = reporting_node(identity, r.node, "whose part of the job ended")?;
        let report = r.report.ok_or_else(|| Status::invalid_argument("missing exit report"))?.into();
        self.report(Command::JobFinished { job_id: r.job_id, epoch: r.epoch, node, report }).await
    }

    async fn report_part_ready(
        &self,
        request: Request<pb::ReportStartedRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.coord.worker_term()?;
        if let Err(revision) = self.job_on_own_node(&request, "report part ready", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false, revision }));
        }
        let identity = self.coord.worker_identity(&request);
        let r = request.into_inner();
        let node = reporting_node(identity, r.node, "whose part is ready")?;
        self.report(Command::PartReady { job_id: r.job_id, epoch: r.epoch, node }).await
    }

    async fn report_part_idle(
        &self,
        request: Request<pb::ReportPartIdleRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.coord.worker_term()?;
        if let Err(revision) = self.job_on_own_node(&request, "report part idle", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false, revision }));
        }
        let identity = self.coord.worker_identity(&request);
        let r = request.into_inner();
        let node = reporting_node(identity, r.node, "whose part is idle")?;
        self.report(Command::PartIdle { job_id: r.job_id, epoch: r.epoch, node, idle: r.idle }).await
    }

    async fn create_step(
        &self,
        request: Request<pb::CreateStepRequest>,
    ) -> Result<Response<pb::CreateStepResponse>, Status> {
        self.create_step_call(request).await
    }

    async fn report_step_ended(
        &self,
        request: Request<pb::ReportStepEndedRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.report_step_ended_call(request).await
    }

    async fn signal_step(
        &self,
        request: Request<pb::SignalStepRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.signal_step_call(request).await
    }

    type ReadStepOutputStream = steps::OutputStream;

    async fn read_step_output(
        &self,
        request: Request<pb::ReadStepOutputRequest>,
    ) -> Result<Response<steps::OutputStream>, Status> {
        self.read_step_output_call(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{GpuDevice, NodeMode, NodeSpec};

    fn node(marks: Vec<GpuFaultMark>) -> NodeStatus {
        let gpus = (0..2).map(|index| GpuDevice { index, ..Default::default() }).collect();
        NodeStatus {
            spec: NodeSpec {
                name: "w1".into(),
                address: String::new(),
                gpus,
                cpu_millis: 0,
                memory_bytes: 0,
                labels: Vec::new(),
                rendezvous_ports: None,
                lease_end: None,
            },
            state: NodeState::Up,
            epoch: 5,
            mode: NodeMode::Active,
            mode_reason: String::new(),
            drain_deadline: None,
            gpu_faults: marks,
            lease_end_set: None,
        }
    }

    fn mark(seq: u64) -> GpuFaultMark {
        GpuFaultMark { gpu: 1, reason: "XID 79".into(), node_epoch: 5, seq, job_id: 3 }
    }

    /// A heartbeat marks a card fault it shows first, never one already marked; it clears a mark
    /// only when it was read after the fault and the GPU is schedulable.
    #[test]
    fn heartbeats_mark_new_card_faults_and_clear_only_after_them() {
        let faulty = GpuHealth { index: 1, card_fault: "XID 79".into(), fault_seq: 1, ..Default::default() };
        let set = gpu_fault_changes(&node(vec![]), 5, std::slice::from_ref(&faulty));
        assert!(matches!(&set[..], [Command::SetGpuFault { clear: false, mark, .. }] if mark.seq == 1), "{set:?}");
        assert!(gpu_fault_changes(&node(vec![mark(1)]), 5, &[faulty]).is_empty(), "already marked");

        let clean_before = GpuHealth { index: 1, fault_seq: 0, ..Default::default() };
        assert!(gpu_fault_changes(&node(vec![mark(1)]), 5, &[clean_before]).is_empty(), "read before the fault");
        let dirty_after = GpuHealth { index: 1, fault_seq: 1, dirty: true, ..Default::default() };
        assert!(gpu_fault_changes(&node(vec![mark(1)]), 5, &[dirty_after]).is_empty(), "not schedulable");
        let clean_after = GpuHealth { index: 1, fault_seq: 1, ..Default::default() };
        let clear = gpu_fault_changes(&node(vec![mark(1)]), 5, &[clean_after]);
        assert!(matches!(&clear[..], [Command::SetGpuFault { clear: true, .. }]), "{clear:?}");
        let restarted = GpuHealth { index: 1, ..Default::default() };
        assert_eq!(gpu_fault_changes(&node(vec![mark(1)]), 6, &[restarted]).len(), 1, "a new worker process");
        let unknown = GpuHealth { index: 9, card_fault: "XID 79".into(), fault_seq: 1, ..Default::default() };
        assert!(gpu_fault_changes(&node(vec![]), 5, &[unknown]).is_empty(), "no such gpu");
    }
}
