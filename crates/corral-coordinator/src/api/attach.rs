//! `Corral.Attach` (`corral attach`): a process inside a running job's cgroup on one of its
//! nodes, for the job's owner (its tenant or an admin; an admin's attach is audited). The first
//! message names the job, the node (a name of its allocation or its index there; the first by
//! default) and what to run; the coordinator pins the run (epoch) and relays the call both ways
//! to that node's agent (`WorkerAgent.Attach`), as it proxies logs.
//!
//! Cost: one job lookup in a snapshot, then one proxied stream, counted against the caller's
//! open watches.

use crate::watch::Watches;
use crate::Coordinator;
use corral_proto::v1::{self as pb};
use corral_types::JobState;
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

pub(super) type AttachStream = Pin<Box<dyn Stream<Item = Result<pb::AttachOutput, Status>> + Send>>;

pub(super) async fn attach(
    coord: &Coordinator,
    watches: &Arc<Watches>,
    mut request: Request<Streaming<pb::AttachInput>>,
) -> Result<Response<AttachStream>, Status> {
    let who = coord.principal(&request, "attach")?;
    let first = request.get_mut().message().await?;
    let Some(pb::AttachInput { input: Some(pb::attach_input::Input::Start(mut start)) }) = first else {
        return Err(Status::invalid_argument("attach: the first message must name the job and what to run"));
    };
    let job = coord.snapshot().job(start.job_id)?;
    coord.require_owner(&request, "attach", "attach to", &who, &job)?;
    let allocation = job.allocation.as_ref().filter(|_| job.state == JobState::Running).ok_or_else(|| {
        Status::failed_precondition(format!(
            "job {} is {}: attach reaches the processes of a running job",
            job.id,
            job.state.as_str()
        ))
    })?;
    let nodes: Vec<&str> = allocation.parts().map(|(n, _)| n).collect();
    let node = match start.node.as_str() {
        "" => nodes.first().copied(),
        name if nodes.contains(&name) => Some(name),
        index => index.parse::<usize>().ok().and_then(|i| nodes.get(i).copied()),
    };
    let node = node.ok_or_else(|| {
        Status::invalid_argument(format!(
            "job {} has no node '{}': its nodes are {} (a name, or its index from 0)",
            job.id,
            start.node,
            nodes.join(",")
        ))
    })?;
    if allocation.part_ended(node) {
        return Err(Status::failed_precondition(format!("job {}'s part on {node} has ended", job.id)));
    }
    let node = node.to_owned();
    if who.is_admin() && coord.security().auth_enabled() {
        coord.audit_admin(&request, "attach", &who, format!("job {} of tenant {} on {node}", job.id, job.spec.tenant));
    }
    let permit = watches.open(&who)?;
    start.node = node.clone();
    start.epoch = allocation.epoch;
    let first = pb::AttachInput { input: Some(pb::attach_input::Input::Start(start)) };
    // The rest of the caller's messages as they come; its stream ending ends the agent's input.
    let rest = request.into_inner().map_while(Result::ok);
    let input = tokio_stream::once(first).chain(rest);
    let upstream = coord.open_worker_attach(&job, &node, input).await?;
    // The watch lasts as long as the stream: the permit goes with it.
    Ok(Response::new(Box::pin(upstream.map(move |output| {
        let _ = &permit;
        output
    }))))
}
