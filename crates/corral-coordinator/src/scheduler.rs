//! The leader's scheduling loop: place pending jobs, mark silent nodes down; and the leader's
//! memory of its last pass (`LeaderView`: why each pending job waits, in which order the pass
//! considered them), which only this module writes.

use crate::liveness::NodeLive;
use crate::Coordinator;
use corral_core::{schedule_with_images, Command, Outcome, PendingJob};
use corral_types::{JobId, NodeState};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The leader's memory of its last scheduling pass. Never replicated; written only by the
/// scheduling loop (`schedule_once`), read by the user API, watches, the web view and the
/// metrics.
///
/// A reader takes the whole pass as one `Arc` ([`LeaderView::pending`]): it copies nothing,
/// sees the reasons and the order of the same pass, and never holds up the next pass.
#[derive(Debug, Default)]
pub(crate) struct LeaderView {
    last_pass: Mutex<Arc<PendingJobs>>,
}

impl LeaderView {
    /// The pending jobs of the last scheduling pass this node ran.
    pub(crate) fn pending(&self) -> Arc<PendingJobs> {
        self.last_pass.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the last pass's pending jobs (the last pass wins); a job in `waiting` waits for
    /// that reason instead of the pass's (nodes being powered on for it).
    fn record(&self, pending: &[PendingJob], waiting: &BTreeMap<JobId, String>) {
        let pass = Arc::new(PendingJobs::of_pass(
            pending.iter().map(|p| (p.job_id, waiting.get(&p.job_id).cloned().unwrap_or_else(|| p.reason.to_string()))),
        ));
        *self.last_pass.lock().unwrap_or_else(|p| p.into_inner()) = pass;
    }
}

/// The pending jobs of one scheduling pass: why each waits, and the order the pass considered
/// them in.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct PendingJobs {
    reasons: BTreeMap<JobId, String>,
    order: Vec<JobId>,
}

impl PendingJobs {
    /// The jobs a pass left pending, in the order it considered them, each with its reason.
    pub(crate) fn of_pass(pending: impl IntoIterator<Item = (JobId, String)>) -> PendingJobs {
        let mut jobs = PendingJobs::default();
        for (job_id, reason) in pending {
            jobs.order.push(job_id);
            jobs.reasons.insert(job_id, reason);
        }
        jobs
    }

    /// Why the pass left `job_id` pending (`None`: the pass did not look at it).
    pub(crate) fn reason(&self, job_id: JobId) -> Option<&str> {
        self.reasons.get(&job_id).map(String::as_str)
    }

    /// The pending jobs in the order the pass considered them.
    pub(crate) fn order(&self) -> &[JobId] {
        &self.order
    }
}

/// What only the leader knows (its memory, never replicated), as a page or a scrape reads it.
pub(crate) struct LeaderMemory<'a> {
    /// The pending jobs of the last scheduling pass.
    pub pending: &'a PendingJobs,
    /// Heartbeats and GPU readings per node (entries without a real heartbeat are ignored).
    pub live: &'a BTreeMap<String, NodeLive>,
    /// The image pulls workers reported last.
    pub pulls: &'a crate::pulls::PullBoard,
}

/// Runs forever; does work only while this node is the leader.
pub(crate) async fn run(coord: Coordinator) {
    let mut applied = coord.store().subscribe_applied();
    let interval = coord.config().schedule_interval;
    loop {
        tokio::select! {
            _ = applied.changed() => {}
            _ = tokio::time::sleep(interval) => {}
        }
        let Some(term) = coord.leading_term() else { continue };
        mark_silent_nodes_down(&coord, term).await;
        evict_at_drain_deadlines(&coord).await;
        end_leases(&coord).await;
        // Before the pass: it then shows why a job waits for a node being resumed for it.
        crate::autoscale::tick(&coord, term).await;
        let computed = schedule_once(&coord).await;
        // Coalesce: under a stream of submits, one pass covers every change applied meanwhile
        // instead of one pass per applied entry. The pause follows the pass's own cost, so a
        // short queue (each freed GPU matters) is served at once and a long one (a pass over
        // thousands of jobs) never takes more than a third of a core.
        tokio::time::sleep(pass_gap(computed)).await;
    }
}

/// Least and most time between two scheduling passes.
const MIN_PASS_GAP: Duration = Duration::from_millis(2);
const MAX_PASS_GAP: Duration = Duration::from_millis(25);

/// The pause after a pass that computed for `computed`: twice that, within the bounds.
fn pass_gap(computed: Duration) -> Duration {
    (computed * 2).clamp(MIN_PASS_GAP, MAX_PASS_GAP)
}

/// Marks down the up nodes not heard from within the TTL in this leadership term (a node that
/// leads again starts its TTLs afresh: see `liveness`).
async fn mark_silent_nodes_down(coord: &Coordinator, term: u64) {
    let up: Vec<String> = {
        let data = coord.store().read();
        data.state.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| n.spec.name.clone()).collect()
    };
    let ttl = coord.config().node_ttl;
    for node in coord.liveness().expired(term, up.iter().map(String::as_str), ttl) {
        tracing::warn!(node = %node, ttl_ms = ttl.as_millis() as u64, "no heartbeat within the ttl: marking node down");
        let reason = format!("node {node} lost (no heartbeat for {}s)", ttl.as_secs());
        if let Err(e) = coord.propose(Command::SetNodeState { node, state: NodeState::Down, reason }).await {
            tracing::warn!(error = %e, "could not mark node down");
        }
    }
}

/// Stops the running jobs of draining nodes whose deadline passed (checkpoint signal, grace,
/// requeue). The check here uses the wall clock; apply checks the deadline against the
/// command's timestamp, so an early proposal changes nothing.
async fn evict_at_drain_deadlines(coord: &Coordinator) {
    let now_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let now = corral_types::Timestamp::compose(now_ms, 0);
    let due: Vec<String> = {
        let data = coord.store().read();
        data.state
            .nodes
            .values()
            .filter(|n| n.drain_deadline.is_some())
            .filter(|n| !data.state.jobs_to_evict(&n.spec.name, now).is_empty())
            .map(|n| n.spec.name.clone())
            .collect()
    };
    for node in due {
        tracing::info!(node = %node, "drain deadline passed: stopping the node's jobs for requeue");
        if let Err(e) = coord.propose(Command::EvictDrainedJobs { node }).await {
            tracing::warn!(error = %e, "could not stop the jobs of a drained node");
        }
    }
}

/// Stops the runs of leased nodes that their lease end reaches (at the lease end minus each
/// job's class grace: checkpoint signal, grace, requeue as `lease-ended`) and drains nodes whose
/// lease ended. Judged here with a fresh oracle timestamp, as time limits and drain deadlines
/// are; apply judges again with the command's own timestamp and stops only runs not yet told to,
/// so a proposal repeated by this leader or the next changes nothing more.
async fn end_leases(coord: &Coordinator) {
    let any_lease = coord.store().read().state.nodes.values().any(|n| n.lease_end().is_some());
    if !any_lease {
        return;
    }
    let Ok(now) = coord.timestamps(1).await else { return };
    let due: Vec<String> = {
        let data = coord.store().read();
        data.state
            .nodes
            .values()
            .filter(|n| data.state.lease_due(&n.spec.name, now))
            .map(|n| n.spec.name.clone())
            .collect()
    };
    for node in due {
        tracing::info!(node = %node, "lease ends: stopping the node's jobs for requeue, draining it at the end");
        if let Err(e) = coord.propose(Command::EndLease { node }).await {
            tracing::warn!(error = %e, "could not act on a lease end");
        }
    }
}

/// One scheduling pass: compute placements and preemptions on the current state and propose
/// them as one `Command::Schedule` (one log entry); apply re-validates each decision. Returns
/// how long the pass computed (not counting the wait for its commit).
pub(crate) async fn schedule_once(coord: &Coordinator) -> Duration {
    let unschedulable = coord.liveness().unschedulable();
    // The pass's clock (backfill windows, fair-share decay): a fresh oracle timestamp.
    let now = match coord.timestamps(1).await {
        Ok(ts) => ts,
        Err(e) => {
            tracing::debug!(error = %e, "no timestamp for a scheduling pass");
            return Duration::ZERO;
        }
    };
    let started = std::time::Instant::now();
    let images = coord.held_images().hints();
    let pass = {
        let data = coord.store().read();
        // Nothing can be placed without a node: skip the pass over a long queue (unless nodes
        // may be powered on: then the pass says why each job waits, the resume included).
        let autoscaled = coord.autoscaler().declared().next().is_some();
        if !autoscaled && !data.state.nodes.values().any(|n| n.state == NodeState::Up) {
            return Duration::ZERO;
        }
        schedule_with_images(&data.state, now, &unschedulable, &images)
    };
    let computed = started.elapsed();
    // Every waiting job's reason, for `corral queue`, and their order, for the web view's queue.
    coord.leader_view().record(&pass.pending, &coord.autoscaler().waiting());
    let metrics = &coord.scheduler_metrics();
    let Some(command) = pass.command() else {
        metrics.pass_duration.observe(started.elapsed().as_secs_f64());
        return computed;
    };
    let proposed = coord.propose(command).await;
    metrics.pass_duration.observe(started.elapsed().as_secs_f64());
    match proposed {
        Ok(Outcome::Scheduled(out)) => {
            metrics.placements.inc_by(out.placed.len() as u64);
            metrics.preemptions.inc_by(out.preempted.len() as u64);
            for (job_id, reason) in &out.rejected {
                tracing::debug!(job_id, reason = %reason, "decision not applied");
            }
            if !out.preempted.is_empty() {
                tracing::info!(preempted = ?out.preempted, "preempting jobs");
            }
            tracing::info!(placed = out.placed.len(), "scheduling pass applied");
        }
        Ok(other) => tracing::warn!(outcome = ?other, "unexpected outcome of a scheduling pass"),
        Err(e) => tracing::warn!(error = %e, "scheduling pass not applied"),
    }
    computed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_replaces_the_last_one_whole() {
        let view = LeaderView::default();
        assert!(view.pending().order().is_empty(), "no pass yet");
        let waiting = |job_id, reason| PendingJob { job_id, reason };
        let (no_nodes, cpu) = (corral_core::PendingReason::NoNodes, corral_core::PendingReason::CpuMemory);
        view.record(&[waiting(7, no_nodes.clone()), waiting(3, cpu.clone())], &BTreeMap::new());
        let first = view.pending();
        assert_eq!(first.order(), &[7, 3]);
        assert_eq!(first.reason(7), Some(no_nodes.to_string().as_str()));
        assert_eq!(first.reason(3), Some(cpu.to_string().as_str()));
        // A job a node is being powered on for waits for that.
        let resuming = BTreeMap::from([(3, "autoscale: waiting for gpu-05 to resume".to_string())]);
        view.record(&[waiting(3, cpu)], &resuming);
        assert_eq!(view.pending().order(), &[3]);
        assert_eq!(view.pending().reason(7), None, "the last pass wins");
        assert_eq!(view.pending().reason(3), Some("autoscale: waiting for gpu-05 to resume"));
        assert_eq!(first.order(), &[7, 3], "a reader keeps the pass it took");
    }

    #[test]
    fn the_pause_between_passes_follows_their_cost() {
        assert_eq!(pass_gap(Duration::ZERO), MIN_PASS_GAP);
        assert_eq!(pass_gap(Duration::from_millis(4)), Duration::from_millis(8));
        assert_eq!(pass_gap(Duration::from_millis(400)), MAX_PASS_GAP);
    }
}
