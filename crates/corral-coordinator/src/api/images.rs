//! The user API's image calls (`corral image ls|pull|rm|load`, admin only): each is relayed to
//! the worker agents of the nodes it names — one node, or every node that is up — and their
//! answers gathered; a node that fails is named in the reply, the others still answer.
//!
//! Bounds: one agent call per node of the cluster; a listing or removal waits at most
//! `AGENT_CALL` per node; a pull's events pass through a channel of `EVENTS` (a slow client
//! holds the pulls' reporting back, not their downloads); a load's chunks (each at most the user
//! message size) are relayed to every target through channels of `CHUNKS_IN_FLIGHT`, so the
//! coordinator holds at most that many chunks per node whatever the archive's size, and each
//! worker refuses an archive larger than its store's `max-size`.

use crate::Coordinator;
use corral_proto::v1::{self as pb};
use futures::future::join_all;
use std::pin::Pin;
use std::time::Duration;
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status, Streaming};

/// How long one node's agent may take to list or remove.
const AGENT_CALL: Duration = Duration::from_secs(30);
/// Pull events waiting for the client.
const EVENTS: usize = 32;
/// Load chunks waiting for each node's agent.
const CHUNKS_IN_FLIGHT: usize = 4;

pub(super) type PullStream = Pin<Box<dyn Stream<Item = Result<pb::ImagePullEvent, Status>> + Send>>;

/// The nodes a call names: `node`, which must be registered, or (empty) every node that is up.
fn targets(coord: &Coordinator, node: &str) -> Result<Vec<String>, Status> {
    let snapshot = coord.snapshot();
    let state = &snapshot.read().state;
    if !node.is_empty() {
        return match state.nodes.get(node) {
            Some(_) => Ok(vec![node.to_string()]),
            None => Err(Status::not_found(format!("node {node} is not registered"))),
        };
    }
    Ok(state
        .nodes
        .iter()
        .filter(|(_, n)| n.state == corral_types::NodeState::Up)
        .map(|(name, _)| name.clone())
        .collect())
}

/// `Corral.ListImages`. Cost: one agent call per node named, each bounded by `AGENT_CALL`.
pub(super) async fn list_images(
    coord: &Coordinator,
    request: Request<pb::ListImagesRequest>,
) -> Result<Response<pb::ListImagesResponse>, Status> {
    let who = coord.principal(&request, "image ls")?;
    coord.require_admin(&request, "image ls", &who)?;
    coord.linearizable().await?;
    let nodes = targets(coord, &request.get_ref().node)?;
    let answers = join_all(nodes.iter().map(|node| async move {
        let mut agent = coord.node_agent(node).await?;
        let call = agent.list_images(pb::ListImagesRequest { node: node.clone() });
        match tokio::time::timeout(AGENT_CALL, call).await {
            Ok(Ok(reply)) => Ok(reply.into_inner().images),
            Ok(Err(status)) => Err(status.message().to_string()),
            Err(_) => Err(format!("no answer within {AGENT_CALL:?}")),
        }
    }))
    .await;
    let mut reply = pb::ListImagesResponse::default();
    for (node, answer) in nodes.iter().zip(answers) {
        match answer {
            Ok(images) => reply.images.extend(images),
            Err(e) => reply.unreachable.push(format!("{node}: {e}")),
        }
    }
    Ok(Response::new(reply))
}

/// `Corral.PullImage`. Cost: one agent pull per node named (each node runs a bounded number of
/// them at once); the events go through one bounded channel.
pub(super) async fn pull_image(
    coord: &Coordinator,
    request: Request<pb::PullImageRequest>,
) -> Result<Response<PullStream>, Status> {
    let who = coord.principal(&request, "image pull")?;
    coord.require_admin(&request, "image pull", &who)?;
    let req = request.get_ref().clone();
    if req.reference.trim().is_empty() {
        return Err(Status::invalid_argument("name the image to pull"));
    }
    if req.node.is_empty() != req.all {
        return Err(Status::invalid_argument("give either --node NODE or --all"));
    }
    coord.linearizable().await?;
    let nodes = targets(coord, &req.node)?;
    coord.audit_admin(&request, "image pull", &who, format!("{} on {}", req.reference, nodes.join(",")));
    let (tx, rx) = tokio::sync::mpsc::channel(EVENTS);
    for node in nodes {
        let (coord, tx, reference) = (coord.clone(), tx.clone(), req.reference.clone());
        tokio::spawn(async move {
            let failed =
                |error: String| pb::ImagePullEvent { node: node.clone(), done: true, error, ..Default::default() };
            let mut agent = match coord.node_agent(&node).await {
                Ok(agent) => agent,
                Err(e) => {
                    let _ = tx.send(Ok(failed(e))).await;
                    return;
                }
            };
            let call = pb::PullImageRequest { reference, node: node.clone(), all: false };
            let mut events = match agent.pull_image(call).await {
                Ok(reply) => reply.into_inner(),
                Err(status) => {
                    let _ = tx.send(Ok(failed(status.message().to_string()))).await;
                    return;
                }
            };
            loop {
                match events.next().await {
                    Some(Ok(event)) => {
                        let done = event.done;
                        if tx.send(Ok(event)).await.is_err() || done {
                            return;
                        }
                    }
                    Some(Err(status)) => {
                        let _ = tx.send(Ok(failed(status.message().to_string()))).await;
                        return;
                    }
                    None => {
                        let _ = tx.send(Ok(failed("the agent ended the pull without an outcome".into()))).await;
                        return;
                    }
                }
            }
        });
    }
    Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
}

/// `Corral.RemoveImage`. Cost: one agent call per node named, each bounded by `AGENT_CALL`;
/// the jobs each node runs are read from the state (at most its running jobs).
pub(super) async fn remove_image(
    coord: &Coordinator,
    request: Request<pb::RemoveImageRequest>,
) -> Result<Response<pb::RemoveImageResponse>, Status> {
    let who = coord.principal(&request, "image rm")?;
    coord.require_admin(&request, "image rm", &who)?;
    let req = request.get_ref().clone();
    if req.reference.trim().is_empty() {
        return Err(Status::invalid_argument("name the image to remove"));
    }
    coord.linearizable().await?;
    let nodes = targets(coord, &req.node)?;
    // What the jobs placed on or running on each node need: the agent refuses those images.
    let needs: Vec<(Vec<String>, Vec<u64>)> = {
        let snapshot = coord.snapshot();
        let state = &snapshot.read().state;
        nodes
            .iter()
            .map(|node| {
                state.jobs_on_node(node).filter_map(|job| job.spec.image_digest.clone().map(|d| (d, job.id))).unzip()
            })
            .collect()
    };
    let answers = join_all(nodes.iter().zip(needs).map(|(node, (needed, needed_by))| {
        let reference = req.reference.clone();
        async move {
            let mut agent = coord.node_agent(node).await.map_err(|e| (Code::Unavailable, e))?;
            let call = agent.remove_image(pb::RemoveImageRequest { reference, node: node.clone(), needed, needed_by });
            match tokio::time::timeout(AGENT_CALL, call).await {
                Ok(Ok(reply)) => Ok(reply.into_inner()),
                Ok(Err(status)) => Err((status.code(), status.message().to_string())),
                Err(_) => Err((Code::DeadlineExceeded, format!("no answer within {AGENT_CALL:?}"))),
            }
        }
    }))
    .await;
    let mut reply = pb::RemoveImageResponse::default();
    for (node, answer) in nodes.iter().zip(answers) {
        match answer {
            Ok(one) => {
                reply.removed.extend(one.removed);
                reply.skipped.extend(one.skipped);
            }
            Err((Code::FailedPrecondition, e)) => reply.refused.push(e),
            Err((_, e)) => reply.skipped.push(format!("{node}: {e}")),
        }
    }
    let removed: Vec<&str> = reply.removed.iter().map(|i| i.node.as_str()).collect();
    coord.audit_admin(&request, "image rm", &who, format!("{} from {}", req.reference, removed.join(",")));
    Ok(Response::new(reply))
}

/// `Corral.LoadImage`. Cost: the archive passes through once, at most `CHUNKS_IN_FLIGHT`
/// chunks per node held at a time; each worker checks the size against its store.
pub(super) async fn load_image(
    coord: &Coordinator,
    request: Request<Streaming<pb::LoadImageChunk>>,
) -> Result<Response<pb::LoadImageResponse>, Status> {
    let who = coord.principal(&request, "image load")?;
    coord.require_admin(&request, "image load", &who)?;
    coord.linearizable().await?;
    let (metadata, extensions, mut chunks) = request.into_parts();
    let first = match chunks.next().await {
        Some(chunk) => chunk?,
        None => return Err(Status::invalid_argument("the archive is empty")),
    };
    let nodes = targets(coord, &first.node)?;
    let audit_request = Request::from_parts(metadata, extensions, ());
    coord.audit_admin(
        &audit_request,
        "image load",
        &who,
        format!("{} bytes to {}", first.total_bytes, nodes.join(",")),
    );
    let mut senders = Vec::new();
    let mut calls = Vec::new();
    for node in &nodes {
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::LoadImageChunk>(CHUNKS_IN_FLIGHT);
        let (coord, node) = (coord.clone(), node.clone());
        senders.push(Some(tx));
        calls.push(tokio::spawn(async move {
            let mut agent = coord.node_agent(&node).await?;
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
            match agent.load_image(stream).await {
                Ok(reply) => Ok(reply.into_inner().images),
                Err(status) => Err(status.message().to_string()),
            }
        }));
    }
    let mut next = Some(first);
    while let Some(chunk) = next.take() {
        for sender in senders.iter_mut() {
            // A node whose call ended (refused, unreachable) takes no more chunks.
            if let Some(tx) = sender {
                if tx.send(chunk.clone()).await.is_err() {
                    *sender = None;
                }
            }
        }
        next = match chunks.next().await {
            Some(chunk) => Some(chunk?),
            None => None,
        };
    }
    drop(senders);
    let mut reply = pb::LoadImageResponse::default();
    for (node, call) in nodes.iter().zip(calls) {
        match call.await {
            Ok(Ok(images)) => reply.images.extend(images),
            Ok(Err(e)) => reply.failed.push(format!("{node}: {e}")),
            Err(e) => reply.failed.push(format!("{node}: {e}")),
        }
    }
    Ok(Response::new(reply))
}
