//! The `WorkerGateway` gRPC service: registration, heartbeats and job reports from workers.

use crate::{CoordError, Coordinator};
use corral_core::{Command, Outcome};
use corral_proto::v1::worker_gateway_server::{WorkerGateway, WorkerGatewayServer};
use corral_proto::v1::{self as pb};
use corral_types::{GpuHealth, JobState, NodeState};
use tonic::{Request, Response, Status};

pub(crate) fn server(coord: Coordinator) -> WorkerGatewayServer<Gateway> {
    WorkerGatewayServer::new(Gateway { coord })
        .max_decoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_MESSAGE_BYTES)
}

pub(crate) struct Gateway {
    coord: Coordinator,
}

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
    /// late report from a node the job has left is not retried forever.
    fn job_on_own_node<T>(&self, request: &Request<T>, action: &str, job_id: u64) -> bool {
        let Some(name) = self.coord.worker_identity(request) else { return true };
        let placed_here = {
            let data = self.coord.inner.node.state.read();
            data.state.jobs.get(&job_id).and_then(|j| j.allocation.as_ref()).is_some_and(|a| a.gpus_on(&name).is_some())
        };
        if !placed_here {
            self.coord.deny(
                request,
                action,
                &format!("worker {name}"),
                Status::permission_denied(format!("permission denied: job {job_id} is not placed on node {name}")),
            );
        }
        placed_here
    }

    /// Workers must talk to the leader: its memory holds heartbeats and it proposes changes.
    fn require_leader(&self) -> Result<(), CoordError> {
        if self.coord.is_leader() {
            return Ok(());
        }
        let metrics = self.coord.inner.node.raft.metrics().borrow().clone();
        let leader_addr = metrics
            .current_leader
            .and_then(|id| metrics.membership_config.membership().get_node(&id).map(|n| n.addr.clone()));
        Err(CoordError::NotLeader { leader_id: metrics.current_leader, leader_addr })
    }
}

#[tonic::async_trait]
impl WorkerGateway for Gateway {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        self.require_leader()?;
        let spec: corral_types::NodeSpec =
            request.get_ref().spec.clone().ok_or_else(|| Status::invalid_argument("missing node spec"))?.into();
        self.require_node(&request, "register", &spec.name)?;
        if spec.name.is_empty() {
            return Err(Status::invalid_argument("node name must not be empty"));
        }
        let name = spec.name.clone();
        match self.coord.propose(Command::RegisterNode { spec }).await? {
            Outcome::NodeRegistered { epoch } => {
                self.coord.inner.liveness.heartbeat(&name, Vec::new());
                tracing::info!(node = %name, epoch, "node registered");
                Ok(Response::new(pb::RegisterResponse { node_epoch: epoch }))
            }
            other => Err(Status::internal(format!("unexpected outcome of register: {other:?}"))),
        }
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.require_leader()?;
        self.require_node(&request, "heartbeat", &request.get_ref().node)?;
        let hb = request.into_inner();
        let data = self.coord.inner.node.state.read();
        let current = data.state.nodes.get(&hb.node).filter(|n| n.epoch == hb.node_epoch && n.state == NodeState::Up);
        if current.is_none() {
            // Unknown, down, or registered again since: the worker kills its jobs and re-registers.
            return Ok(Response::new(pb::HeartbeatResponse { reregister: true, ..Default::default() }));
        }
        let gpus = hb
            .gpus
            .iter()
            .map(|g| GpuHealth {
                index: g.index,
                temperature_c: g.temperature_c,
                utilization_percent: g.utilization_percent,
                memory_used_mib: g.memory_used_mib,
                power_mw: g.power_mw,
                xid_errors: g.xid_errors,
                dirty: g.dirty,
                dirty_reason: g.dirty_reason.clone(),
                dirty_job_id: (g.dirty_job_id != 0).then_some(g.dirty_job_id),
                problems: g.problems.clone(),
            })
            .collect();
        self.coord.inner.liveness.heartbeat(&hb.node, gpus);
        // Jobs placed here (a gang job on each of its nodes), unless being cancelled or preempted.
        let assignments: Vec<pb::Job> = data
            .state
            .jobs_on_node(&hb.node)
            .filter(|j| !j.cancel_requested && j.preemption.is_none())
            .map(Into::into)
            .collect();
        // What the worker runs but must stop: stale runs, cancelled jobs, preemption victims
        // (with the victim class's grace period and checkpoint signal).
        let kill = hb
            .running
            .into_iter()
            .filter_map(|r| {
                let job = data.state.jobs.get(&r.job_id);
                let current = job.is_some_and(|j| {
                    j.state == JobState::Running
                        && j.allocation.as_ref().is_some_and(|a| a.epoch == r.epoch && a.gpus_on(&hb.node).is_some())
                });
                match job {
                    Some(j) if current && j.cancel_requested => Some(pb::RunningJob { grace_secs: 0, ..r }),
                    Some(j) if current => j.preemption.as_ref().map(|p| pb::RunningJob {
                        grace_secs: p.grace_secs,
                        checkpoint_signal: p.checkpoint_signal,
                        ..r
                    }),
                    _ => Some(r),
                }
            })
            .collect();
        Ok(Response::new(pb::HeartbeatResponse { assignments, kill, reregister: false }))
    }

    async fn report_started(
        &self,
        request: Request<pb::ReportStartedRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        if !self.job_on_own_node(&request, "report started", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false }));
        }
        let r = request.into_inner();
        let outcome = self.coord.propose(Command::JobStarted { job_id: r.job_id, epoch: r.epoch }).await?;
        Ok(Response::new(pb::ReportResponse { accepted: outcome != Outcome::Stale }))
    }

    async fn report_finished(
        &self,
        request: Request<pb::ReportFinishedRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        if !self.job_on_own_node(&request, "report finished", request.get_ref().job_id) {
            return Ok(Response::new(pb::ReportResponse { accepted: false }));
        }
        let r = request.into_inner();
        let report = r.report.ok_or_else(|| Status::invalid_argument("missing exit report"))?.into();
        let outcome = self.coord.propose(Command::JobFinished { job_id: r.job_id, epoch: r.epoch, report }).await?;
        if let Outcome::Job(job) = &outcome {
            tracing::info!(job_id = job.id, state = %job.state, reason = job.reason.as_deref().unwrap_or(""), "job finished");
        }
        Ok(Response::new(pb::ReportResponse { accepted: outcome != Outcome::Stale }))
    }
}
