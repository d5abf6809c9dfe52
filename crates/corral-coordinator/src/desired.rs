//! What the leader wants of each worker: every job allocated on the node with run or stop, pushed
//! to the worker as it changes (`WorkerGateway.WatchDesired`).
//!
//! Invariant: each message is complete (level-triggered): a job that is allocated on the node is
//! in it (also when it is being cancelled or preempted, so that a job stopped before its worker
//! launched it is reported "never started" instead of being forgotten), except a gang's part
//! that already ended there, and a job missing from it must not run there. A gang's remaining
//! parts are told to stop once one part ended other than with exit code 0. A job carries its
//! steps, and any change a worker acts on (a new step, a stopping one, a signal, a node report,
//! an image gang's part ready, every part of a session idle) changes the message. Messages are computed from the applied
//! state of a leader that answers workers (`Coordinator::worker_term`) and carry the applied
//! index, so a worker can order them.

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
    jobs: Vec<JobKey>,
}

/// Job, epoch, action, grace, checkpoint signal, signals asked for so far, its steps, the parts
/// of an image gang with their image ready, whether every part of a session is idle.
type JobKey = (JobId, u64, i32, u32, Option<i32>, usize, StepsKey, usize, bool);

/// What the workers act on in a job's steps: steps made, live, stopping, signals and node reports
/// so far. Each only grows while a step lives, so a change to any step changes the key.
type StepsKey = (u32, usize, usize, usize, usize);

fn steps_key(job: &corral_types::Job) -> StepsKey {
    let live: Vec<&corral_types::JobStep> = job.steps.live().collect();
    (
        job.steps.next_id,
        live.len(),
        live.iter().filter(|s| s.stopping).count(),
        live.iter().map(|s| s.signals.len()).sum(),
        live.iter().map(|s| s.ended.len()).sum(),
    )
}

/// The host of a `host:port` address (`[v6]:port` gives `v6`).
fn host_of(addr: &str) -> String {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']').to_string()
}

/// The node's desired state as the worker registered with `node_epoch` must see it.
fn desired<'a>(
    data: &'a StateMachineData,
    node: &'a str,
    node_epoch: u64,
    term: u64,
) -> (Key, impl FnOnce() -> pb::DesiredState + 'a) {
    let state = &data.state;
    let revision = data.applied_index();
    let current = state.nodes.get(node).is_some_and(|n| n.epoch == node_epoch && n.state == NodeState::Up);
    let wants: Vec<(&corral_types::Job, pb::DesiredAction, u32, Option<i32>)> = if current {
        state
            .jobs_on_node(node)
            // A gang's part that ended here is done with this node (its GPUs stay held until
            // every part ended): the worker forgets it.
            .filter(|job| !job.allocation.as_ref().is_some_and(|a| a.part_ended(node)))
            .map(|job| {
                if job.cancel_requested {
                    (job, pb::DesiredAction::Stop, 0, None)
                } else if let Some(p) = &job.preemption {
                    (job, pb::DesiredAction::Stop, p.grace_secs, p.checkpoint_signal)
                } else if job.allocation.as_ref().is_some_and(|a| a.stops_remaining_parts()) {
                    // Another part failed or was lost: the gang fails (or is requeued) as a whole.
                    (job, pb::DesiredAction::Stop, 0, None)
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
                let (epoch, ready, idle) =
                    job.allocation.as_ref().map_or((0, 0, false), |a| (a.epoch, a.ready.len(), a.all_idle()));
                (job.id, epoch, *action as i32, *grace, *signal, job.signals.len(), steps_key(job), ready, idle)
            })
            .collect(),
    };
    let message = move || pb::DesiredState {
        revision,
        term,
        reregister: !current,
        jobs: wants
            .into_iter()
            .map(|(job, action, grace_secs, checkpoint_signal)| {
                // Where the parts of the run are: the first part's node is where a gang meets.
                let part_addrs: Vec<String> = job
                    .allocation
                    .iter()
                    .flat_map(|a| a.parts())
                    .map(|(part, _)| state.nodes.get(part).map(|n| host_of(&n.spec.address)).unwrap_or_default())
                    .collect();
                pb::DesiredJob {
                    job: Some(job.into()),
                    action: action as i32,
                    grace_secs,
                    checkpoint_signal,
                    master_addr: part_addrs.first().cloned().unwrap_or_default(),
                    part_addrs,
                }
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
        let mut applied = coord.store().subscribe_applied();
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
                        let data = coord.store().read();
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

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::{ClusterConfig, Command, Placement, Request, State};
    use corral_types::{GpuDevice, JobExitReport, JobSpec, NodeGpus, NodeSpec, SchedOptions, Timestamp};

    fn apply(data: &mut StateMachineData, ms: u64, command: Command) {
        data.state.apply(&Request { ts: Timestamp::compose(ms, 0), command }).expect("applied");
    }

    fn node(name: &str) -> NodeSpec {
        NodeSpec {
            name: name.into(),
            address: "127.0.0.1:1".into(),
            gpus: (0..2)
                .map(|i| GpuDevice {
                    index: i,
                    uuid: format!("GPU-{name}-{i}"),
                    model: "RTX 5090".into(),
                    memory_mib: 32768,
                    ..Default::default()
                })
                .collect(),
            cpu_millis: 8_000,
            memory_bytes: 32 << 30,
            labels: vec![],
            rendezvous_ports: None,
            lease_end: None,
        }
    }

    /// What the worker of `node` is told about `job`: `None` when it is not in the message.
    fn action_for(data: &StateMachineData, node: &str, job: u64) -> Option<pb::DesiredAction> {
        let epoch = data.state.nodes[node].epoch;
        let (_, message) = desired(data, node, epoch, 1);
        message().jobs.iter().find(|j| j.job.as_ref().is_some_and(|d| d.id == job)).map(|j| j.action())
    }

    /// Places gang `job_id` with two GPUs on each of `nodes`; returns its allocation epoch.
    fn place_gang(data: &mut StateMachineData, ms: u64, job_id: u64, nodes: [&str; 2]) -> u64 {
        let place = Placement {
            job_id,
            node: nodes[0].into(),
            gpus: vec![0, 1],
            more_nodes: vec![NodeGpus { node: nodes[1].into(), gpus: vec![0, 1] }],
            slice: None,
        };
        apply(data, ms, Command::Schedule { placements: vec![place], preemptions: vec![] });
        data.state.jobs[&job_id].allocation.as_ref().unwrap().epoch
    }

    /// A two-node gang on n1 and n2: a part that exited 0 is dropped from its node's message and
    /// the other part runs on; a part that failed makes the remaining parts stop.
    #[test]
    fn a_gang_part_that_ended_leaves_its_node_and_a_failure_stops_the_rest() {
        let mut data = StateMachineData::of(State::default());
        apply(&mut data, 1, Command::Configure(ClusterConfig::dev_defaults()));
        for name in ["n1", "n2", "n3"] {
            apply(&mut data, 2, Command::RegisterNode { spec: node(name) });
        }
        let gang = |id: &str| Command::SubmitJob {
            request_id: id.into(),
            spec: JobSpec {
                name: "g".into(),
                tenant: "default".into(),
                gpus: 4,
                command: vec!["true".into()].into(),
                sched: SchedOptions { gpus_per_node: Some(2), ..Default::default() },
                ..Default::default()
            },
        };
        apply(&mut data, 3, gang("a"));
        let epoch = place_gang(&mut data, 4, 1, ["n1", "n2"]);
        assert_eq!(action_for(&data, "n1", 1), Some(pb::DesiredAction::Run));
        assert_eq!(action_for(&data, "n2", 1), Some(pb::DesiredAction::Run));
        assert_eq!(action_for(&data, "n3", 1), None);

        let ok = JobExitReport { exit_code: Some(0), run_time_ms: 10, ..Default::default() };
        apply(&mut data, 5, Command::JobFinished { job_id: 1, epoch, node: "n2".into(), report: ok });
        assert_eq!(action_for(&data, "n2", 1), None, "the ended part is forgotten on its node");
        assert_eq!(action_for(&data, "n1", 1), Some(pb::DesiredAction::Run), "a clean exit lets the rest run");

        let ok = JobExitReport { exit_code: Some(0), ..Default::default() };
        apply(&mut data, 6, Command::JobFinished { job_id: 1, epoch, node: "n1".into(), report: ok });

        // Job 2: its first part fails, so its other part is told to stop.
        apply(&mut data, 7, gang("b"));
        let epoch = place_gang(&mut data, 8, 2, ["n2", "n3"]);
        let failed = JobExitReport { exit_code: Some(1), run_time_ms: 10, ..Default::default() };
        apply(&mut data, 9, Command::JobFinished { job_id: 2, epoch, node: "n3".into(), report: failed });
        assert_eq!(action_for(&data, "n3", 2), None);
        assert_eq!(action_for(&data, "n2", 2), Some(pb::DesiredAction::Stop), "a failed part stops the gang");
    }
}
