//! What the leader wants of each worker: every job allocated on the node with run or stop, pushed
//! to the worker as it changes (`WorkerGateway.WatchDesired`).
//!
//! Invariant: each message is complete (level-triggered): a job that is allocated on the node is
//! in it (also when it is being cancelled or preempted, so that a job stopped before its worker
//! launched it is reported "never started" instead of being forgotten), and a job missing from
//! it must not run there. Messages are computed from the applied state of a leader that answers
//! workers (`Coordinator::worker_term`) and carry the applied index, so a worker can order them.

use crate::Coordinator;
use corral_proto::v1::{self as pb};
use corral_raft::StateMachineData;
use corral_types::{JobId, NodeState};
use std::time::Duration;
use tokio::sync::mpsc;

/// A worker's stream gets the full state at least this often, also when nothing changed: the
/// worker reconnects a stream that stays silent for a few of these.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(2);

/// How soon a leader whose lease is unconfirmed looks again.
const LEASE_RETRY: Duration = Duration::from_millis(50);

/// What a message says, without the job bodies: two equal keys make the same message.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    reregister: bool,
    jobs: Vec<(JobId, u64, i32, u32, Option<i32>)>,
}

/// The node's desired state as the worker registered with `node_epoch` must see it.
fn desired<'a>(
    data: &'a StateMachineData,
    node: &'a str,
    node_epoch: u64,
    term: u64,
) -> (Key, impl FnOnce() -> pb::DesiredState + 'a) {
    let state = &data.state;
    let revision = data.last_applied.map(|l| l.index).unwrap_or(0);
    let current = state.nodes.get(node).is_some_and(|n| n.epoch == node_epoch && n.state == NodeState::Up);
    let wants: Vec<(&corral_types::Job, pb::DesiredAction, u32, Option<i32>)> = if current {
        state
            .jobs_on_node(node)
            .map(|job| {
                if job.cancel_requested {
                    (job, pb::DesiredAction::Stop, 0, None)
                } else if let Some(p) = &job.preemption {
                    (job, pb::DesiredAction::Stop, p.grace_secs, p.checkpoint_signal)
                } else {
                    (job, pb::DesiredAction::Run, 0, None)
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let key = Key {
        reregister: !current,
        jobs: wants
            .iter()
            .map(|(job, action, grace, signal)| {
                let epoch = job.allocation.as_ref().map_or(0, |a| a.epoch);
                (job.id, epoch, *action as i32, *grace, *signal)
            })
            .collect(),
    };
    let message = move || pb::DesiredState {
        revision,
        term,
        reregister: !current,
        jobs: wants
            .into_iter()
            .map(|(job, action, grace_secs, checkpoint_signal)| pb::DesiredJob {
                job: Some(job.into()),
                action: action as i32,
                grace_secs,
                checkpoint_signal,
            })
            .collect(),
    };
    (key, message)
}

/// Streams the desired state of `node` to the worker registered with `node_epoch`, from this
/// leader in `term`, until the leadership ends, the node must register again, or the worker
/// goes away.
pub(crate) fn stream(
    coord: Coordinator,
    node: String,
    node_epoch: u64,
    term: u64,
) -> mpsc::Receiver<Result<pb::DesiredState, tonic::Status>> {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        let mut applied = coord.inner.node.state.subscribe_applied();
        let mut last: Option<Key> = None;
        let mut last_sent = tokio::time::Instant::now();
        loop {
            if coord.leading_term() != Some(term) {
                // Deposed: the stream ends and the worker finds the new leader.
                return;
            }
            let mut wait = KEEPALIVE.saturating_sub(last_sent.elapsed());
            match coord.worker_term() {
                Ok(_) => {
                    let message = {
                        let data = coord.inner.node.state.read();
                        let (key, message) = desired(&data, &node, node_epoch, term);
                        let due = last.as_ref() != Some(&key) || last_sent.elapsed() >= KEEPALIVE;
                        let reregister = key.reregister;
                        last = Some(key);
                        due.then(|| (message(), reregister))
                    };
                    if let Some((message, reregister)) = message {
                        if tx.send(Ok(message)).await.is_err() {
                            return;
                        }
                        last_sent = tokio::time::Instant::now();
                        if reregister {
                            return;
                        }
                        wait = KEEPALIVE;
                    }
                }
                // The lease lapsed for a moment (a slow quorum): send nothing it cannot vouch for.
                Err(crate::CoordError::Unavailable(_)) => wait = LEASE_RETRY,
                Err(_) => return,
            }
            tokio::select! {
                changed = applied.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(wait) => {}
                _ = tx.closed() => return,
            }
        }
    });
    rx
}
