//! Group commit of submits: concurrent `Submit` calls that arrive while a proposal is in flight
//! are carried by the next single Raft entry (`SubmitJobs`), so one fsync and one replication
//! round acknowledge many jobs. At low load a submit is proposed at once, alone.
//!
//! Invariant: a caller is answered only after its job's entry is committed and applied; each
//! job keeps its own request id, validation and answer.

use crate::{CoordError, Coordinator};
use corral_core::{Command, Outcome};
use corral_types::{JobId, JobSpec};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, Semaphore};

/// Most submits carried by one entry.
const MAX_GROUP: usize = 512;
/// Entries proposed concurrently: one being written while the next one fills up.
const IN_FLIGHT: usize = 2;

type Reply = oneshot::Sender<Result<(JobId, bool), CoordError>>;

struct Pending {
    request_id: String,
    spec: JobSpec,
    reply: Reply,
}

/// Handle to the group-commit task of one coordinator.
#[derive(Clone)]
pub(crate) struct GroupCommit {
    tx: mpsc::UnboundedSender<Pending>,
}

impl GroupCommit {
    pub(crate) fn start(coord: Coordinator) -> (GroupCommit, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (GroupCommit { tx }, tokio::spawn(run(coord, rx)))
    }

    /// Submits one job; resolves once its entry is applied.
    pub(crate) async fn submit(&self, request_id: String, spec: JobSpec) -> Result<(JobId, bool), CoordError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Pending { request_id, spec, reply })
            .map_err(|_| CoordError::Unavailable("coordinator is shutting down".into()))?;
        rx.await.map_err(|_| CoordError::Unavailable("coordinator is shutting down".into()))?
    }
}

async fn run(coord: Coordinator, mut rx: mpsc::UnboundedReceiver<Pending>) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        // Everything that queued up while we waited for a slot goes into this entry.
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(p) => group.push(p),
                Err(_) => break,
            }
        }
        let coord = coord.clone();
        tokio::spawn(async move {
            propose_group(&coord, group).await;
            drop(permit);
        });
    }
}

async fn propose_group(coord: &Coordinator, group: Vec<Pending>) {
    let (jobs, replies): (Vec<(String, JobSpec)>, Vec<Reply>) =
        group.into_iter().map(|p| ((p.request_id, p.spec), p.reply)).unzip();
    coord.hold_while_followers_lag().await;
    let command = if jobs.len() == 1 {
        let (request_id, spec) = jobs.into_iter().next().expect("one job");
        Command::SubmitJob { request_id, spec }
    } else {
        Command::SubmitJobs { jobs }
    };
    match coord.propose(command).await {
        Ok(Outcome::JobSubmitted { job_id, duplicate }) => {
            for reply in replies {
                let _ = reply.send(Ok((job_id, duplicate)));
            }
        }
        Ok(Outcome::JobsSubmitted(results)) => {
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result.map_err(CoordError::Rejected));
            }
        }
        Ok(other) => {
            for reply in replies {
                let _ = reply.send(Err(CoordError::Raft(format!("unexpected outcome of submit: {other:?}"))));
            }
        }
        Err(e) => {
            // Every caller gets the same failure (e.g. not the leader, with its address): each
            // client retries or follows the redirect with its own request id.
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}
