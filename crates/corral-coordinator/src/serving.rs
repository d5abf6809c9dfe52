//! A witness of a leader that cannot serve: Raft says this node leads, but it has not applied
//! an entry of its own term, or no quorum acknowledged it within the lease, so workers and
//! clients are turned away. Said once it lasts, with what Raft reports (no state lock is
//! taken: the lock may be what it waits for), and again when it ends.

use crate::Coordinator;
use corral_raft::LeaderHealth;
use std::time::{Duration, Instant};

/// How often the leader's health is looked at.
const EVERY: Duration = Duration::from_millis(500);
/// How long a leader may not serve before it is said.
const SAY_AFTER: Duration = Duration::from_secs(2);
/// Least time between two reports of one spell.
const SAY_EVERY: Duration = Duration::from_secs(5);

/// Why a leader with `health` cannot serve, if it cannot; `lease_ms` as the coordinator's.
pub(crate) fn why_not_serving(health: &LeaderHealth, lease_ms: u64) -> Option<String> {
    if health.applied.map(|(term, _)| term) != Some(health.term) {
        return Some(format!(
            "no entry of term {} applied yet (applied {:?} of log {:?})",
            health.term, health.applied, health.last_log_index
        ));
    }
    let fresh = health.millis_since_quorum_ack.is_some_and(|ms| ms < lease_ms);
    if health.voters > 1 && !fresh {
        return Some(format!(
            "no quorum acknowledged it within the lease ({:?} ms ago)",
            health.millis_since_quorum_ack
        ));
    }
    None
}

/// Runs until the coordinator stops.
pub(crate) async fn watch(coord: Coordinator) {
    let lease_ms = coord.config().leader_lease.as_millis() as u64;
    let mut since: Option<(u64, Instant)> = None;
    let mut said: Option<Instant> = None;
    loop {
        tokio::time::sleep(EVERY).await;
        let health = coord.leader_health();
        let why = health.as_ref().and_then(|h| why_not_serving(h, lease_ms));
        match (why, health) {
            (Some(why), Some(health)) => {
                let (term, started) = *since.get_or_insert((health.term, Instant::now()));
                if term != health.term {
                    since = Some((health.term, Instant::now()));
                    said = None;
                    continue;
                }
                let lasting = started.elapsed();
                if lasting >= SAY_AFTER && said.is_none_or(|at| at.elapsed() >= SAY_EVERY) {
                    said = Some(Instant::now());
                    tracing::warn!(
                        term,
                        for_ms = lasting.as_millis() as u64,
                        matched = ?health.matched,
                        "leading but not serving: {why}"
                    );
                }
            }
            _ => {
                if let (Some((term, started)), Some(_)) = (since.take(), said.take()) {
                    tracing::info!(term, after_ms = started.elapsed().as_millis() as u64, "leading and serving again");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(applied_term: u64, ack: Option<u64>, voters: usize) -> LeaderHealth {
        LeaderHealth {
            term: 5,
            applied: Some((applied_term, 10)),
            last_log_index: Some(12),
            millis_since_quorum_ack: ack,
            voters,
            matched: vec![(1, Some(10)), (2, Some(9)), (3, None)],
        }
    }

    #[test]
    fn a_leader_serves_only_with_an_entry_of_its_term_applied_and_a_fresh_quorum() {
        assert_eq!(why_not_serving(&health(5, Some(100), 3), 1000), None);
        assert!(why_not_serving(&health(4, Some(100), 3), 1000).unwrap().contains("no entry of term 5"));
        assert!(why_not_serving(&health(5, Some(1500), 3), 1000).unwrap().contains("no quorum"));
        assert!(why_not_serving(&health(5, None, 3), 1000).unwrap().contains("no quorum"));
        assert_eq!(why_not_serving(&health(5, None, 1), 1000), None, "a single voter needs no quorum");
    }
}
