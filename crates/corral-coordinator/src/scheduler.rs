//! The leader's scheduling loop: place pending jobs, mark silent nodes down.

use crate::Coordinator;
use corral_core::{schedule, Command, Outcome};
use corral_types::NodeState;

/// Runs forever; does work only while this node is the leader.
pub(crate) async fn run(coord: Coordinator) {
    let mut applied = coord.inner.node.state.subscribe_applied();
    let interval = coord.inner.config.schedule_interval;
    loop {
        tokio::select! {
            _ = applied.changed() => {}
            _ = tokio::time::sleep(interval) => {}
        }
        let Some(term) = coord.leading_term() else { continue };
        mark_silent_nodes_down(&coord, term).await;
        schedule_once(&coord).await;
        // Coalesce: under a stream of submits, one pass covers every change applied meanwhile
        // instead of one pass per applied entry.
        tokio::time::sleep(MIN_PASS_GAP).await;
    }
}

/// Least time between two scheduling passes.
const MIN_PASS_GAP: std::time::Duration = std::time::Duration::from_millis(25);

/// Marks down the up nodes not heard from within the TTL in this leadership term (a node that
/// leads again starts its TTLs afresh: see `liveness`).
async fn mark_silent_nodes_down(coord: &Coordinator, term: u64) {
    let up: Vec<String> = {
        let data = coord.inner.node.state.read();
        data.state.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| n.spec.name.clone()).collect()
    };
    let ttl = coord.inner.config.node_ttl;
    for node in coord.inner.liveness.expired(term, up.iter().map(String::as_str), ttl) {
        tracing::warn!(node = %node, ttl_ms = ttl.as_millis() as u64, "no heartbeat within the ttl: marking node down");
        let reason = format!("node {node} lost (no heartbeat for {}s)", ttl.as_secs());
        if let Err(e) = coord.propose(Command::SetNodeState { node, state: NodeState::Down, reason }).await {
            tracing::warn!(error = %e, "could not mark node down");
        }
    }
}

/// One scheduling pass: compute placements and preemptions on the current state and propose
/// them as one `Command::Schedule` (one log entry); apply re-validates each decision.
pub(crate) async fn schedule_once(coord: &Coordinator) -> usize {
    let unschedulable = coord.inner.liveness.unschedulable();
    // The pass's clock (backfill windows, fair-share decay): a fresh oracle timestamp.
    let now = match coord.timestamps(1).await {
        Ok(ts) => ts,
        Err(e) => {
            tracing::debug!(error = %e, "no timestamp for a scheduling pass");
            return 0;
        }
    };
    let started = std::time::Instant::now();
    let pass = {
        let data = coord.inner.node.state.read();
        // Nothing can be placed without a node: skip the pass over a long queue.
        if !data.state.nodes.values().any(|n| n.state == NodeState::Up) {
            return 0;
        }
        schedule(&data.state, now, &unschedulable)
    };
    // Every waiting job's reason, for `corral queue` (the leader's memory; the last pass wins).
    {
        let mut reasons = coord.inner.pending_reasons.lock().unwrap_or_else(|p| p.into_inner());
        *reasons = pass.pending.iter().map(|p| (p.job_id, p.reason.to_string())).collect();
    }
    let metrics = &coord.inner.scheduler_metrics;
    let Some(command) = pass.command() else {
        metrics.pass_duration.observe(started.elapsed().as_secs_f64());
        return 0;
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
            out.placed.len()
        }
        Ok(other) => {
            tracing::warn!(outcome = ?other, "unexpected outcome of a scheduling pass");
            0
        }
        Err(e) => {
            tracing::warn!(error = %e, "scheduling pass not applied");
            0
        }
    }
}
