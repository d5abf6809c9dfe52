//! Pre-vote and corral's election timer. openraft 0.9 has no pre-vote, so its own timer is off
//! and this one campaigns: a voter that heard from no leader for a randomized election timeout
//! first asks the other voters whether they would vote for it (`PreVote`, which changes nothing
//! on the receiver), and triggers openraft's election only once a majority of every voter set
//! said yes. A member cut off from a healthy leader (partitioned, or too busy to read its
//! heartbeats) is refused by the members that still hear the leader, so it never raises the
//! term, and when it comes back it cannot depose the leader.

use crate::log_store::LogStore;
use crate::network::GrpcNetworkFactory;
use crate::raft_wire;
use crate::types::{NodeId, Raft, TypeConfig};
use openraft::storage::RaftLogStorage;
use openraft::{LogId, RaftMetrics, ServerState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// When this node last heard from a leader, and when its election timer last started.
#[derive(Debug)]
pub(crate) struct ElectionClock {
    /// (last heard from a leader, timer started)
    at: Mutex<(Instant, Instant)>,
}

impl ElectionClock {
    pub(crate) fn new() -> Self {
        let now = Instant::now();
        ElectionClock { at: Mutex::new((now, now)) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Instant, Instant)> {
        self.at.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request of the current leader (AppendEntries, a snapshot chunk) arrived.
    pub(crate) fn leader_heard(&self) {
        let now = Instant::now();
        *self.lock() = (now, now);
    }

    /// This node granted a vote or campaigned: its timer starts again (it still has heard from
    /// no leader).
    pub(crate) fn restart_timer(&self) {
        self.lock().1 = Instant::now();
    }

    fn since_leader(&self) -> Duration {
        self.lock().0.elapsed()
    }

    fn since_timer_start(&self) -> Duration {
        self.lock().1.elapsed()
    }
}

/// What a node asked for a pre-vote knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PreVoteView {
    /// Since it last heard from a leader; for a leader, since a quorum last acknowledged it.
    pub quiet_for: Duration,
    /// The last entry of its log.
    pub last_log_id: Option<LogId<NodeId>>,
}

/// Whether a node that knows `view` would vote for a candidate whose log ends at
/// `candidate_last_log`: only if it has heard from no leader within `min_election_timeout` (a
/// leader that hears from its followers, and every follower that hears from it, refuses) and
/// the candidate's log is at least as up to date as its own (Raft's vote rule: a candidate
/// without every committed entry can never win, so it is not let to raise the term).
pub(crate) fn grant_pre_vote(
    view: &PreVoteView,
    candidate_last_log: Option<LogId<NodeId>>,
    min_election_timeout: Duration,
) -> bool {
    view.quiet_for >= min_election_timeout && candidate_last_log >= view.last_log_id
}

/// Whether `granted` holds a majority of every voter set in `configs` (two during a joint
/// membership change).
pub(crate) fn is_quorum(configs: &[BTreeSet<NodeId>], granted: &BTreeSet<NodeId>) -> bool {
    !configs.is_empty() && configs.iter().all(|voters| voters.intersection(granted).count() * 2 > voters.len())
}

/// How long this node has heard from no leader, as a pre-vote judges it: a leader counts from
/// the last acknowledgement of a quorum (none yet: it was just elected, and counts as heard).
pub(crate) fn quiet_for(metrics: &RaftMetrics<NodeId, openraft::BasicNode>, clock: &ElectionClock) -> Duration {
    match metrics.state {
        ServerState::Leader => Duration::from_millis(metrics.millis_since_quorum_ack.unwrap_or(0)),
        _ => clock.since_leader(),
    }
}

/// A duration drawn uniformly from `[min, max)` (`min` if the range is empty).
fn random_between(min: Duration, max: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let span = max.saturating_sub(min).as_micros() as u64;
    if span == 0 {
        return min;
    }
    // Each `RandomState` is keyed anew; hashing the time mixes it further.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    min + Duration::from_micros(hasher.finish() % span)
}

/// The election timer of one node.
pub(crate) struct Elections {
    pub id: NodeId,
    pub raft: Raft,
    pub log: LogStore<TypeConfig>,
    pub clock: Arc<ElectionClock>,
    pub network: GrpcNetworkFactory,
    pub min_timeout: Duration,
    pub max_timeout: Duration,
}

impl Elections {
    /// Runs until the Raft core stops: each time the timer runs out (a random time between the
    /// two election timeouts since it last heard from a leader, voted or campaigned), a voter
    /// that does not lead asks for pre-votes, and campaigns if a majority granted them.
    pub(crate) async fn run(self) {
        let mut metrics = self.raft.metrics();
        let mut peers: BTreeMap<NodeId, (String, crate::network::GrpcNetwork)> = BTreeMap::new();
        loop {
            let timeout = random_between(self.min_timeout, self.max_timeout);
            loop {
                let elapsed = self.clock.since_timer_start();
                if elapsed >= timeout {
                    break;
                }
                tokio::time::sleep(timeout - elapsed).await;
            }
            if metrics.has_changed().is_err() {
                return;
            }
            let (state, voter, configs, nodes, term) = {
                let m = metrics.borrow_and_update();
                if m.running_state.is_err() {
                    return;
                }
                let membership = m.membership_config.membership();
                let configs: Vec<BTreeSet<NodeId>> = membership.get_joint_config().clone();
                let nodes: BTreeMap<NodeId, String> = membership.nodes().map(|(id, n)| (*id, n.addr.clone())).collect();
                (m.state, membership.voter_ids().any(|v| v == self.id), configs, nodes, m.current_term)
            };
            if state == ServerState::Shutdown {
                return;
            }
            if state == ServerState::Leader || !voter {
                self.clock.restart_timer();
                continue;
            }
            if self.pre_vote(&mut peers, &configs, &nodes, term + 1).await {
                tracing::info!(
                    term = term + 1,
                    "no leader heard for {timeout:?} and a majority granted a pre-vote: campaigning"
                );
                if self.raft.trigger().elect().await.is_err() {
                    return;
                }
            }
            self.clock.restart_timer();
        }
    }

    /// Asks every other voter for a pre-vote at `term`; true once a majority of every voter
    /// set (this node included) granted it. Each request waits at most the minimum election
    /// timeout.
    async fn pre_vote(
        &self,
        peers: &mut BTreeMap<NodeId, (String, crate::network::GrpcNetwork)>,
        configs: &[BTreeSet<NodeId>],
        nodes: &BTreeMap<NodeId, String>,
        term: u64,
    ) -> bool {
        let mut granted = BTreeSet::from([self.id]);
        if is_quorum(configs, &granted) {
            return true;
        }
        let last_log_id = match self.log.clone().get_log_state().await {
            Ok(state) => state.last_log_id,
            Err(e) => {
                tracing::warn!("no pre-vote: cannot read the log's state: {e}");
                return false;
            }
        };
        let request = raft_wire::pre_vote_request_to_pb(self.id, term, last_log_id);
        let voters: BTreeSet<NodeId> = configs.iter().flatten().copied().filter(|v| *v != self.id).collect();
        peers.retain(|id, (addr, _)| nodes.get(id) == Some(addr));
        let mut asked = tokio::task::JoinSet::new();
        for target in voters {
            let Some(addr) = nodes.get(&target) else { continue };
            let (_, network) =
                peers.entry(target).or_insert_with(|| (addr.clone(), self.network.client_for(target, addr)));
            let Ok(client) = network.client() else { continue };
            let ttl = self.min_timeout;
            asked.spawn(async move { (target, crate::network::pre_vote(client, request, ttl).await) });
        }
        let mut refused = Vec::new();
        while let Some(answer) = asked.join_next().await {
            let Ok((target, answer)) = answer else { continue };
            match answer {
                Ok(true) => {
                    granted.insert(target);
                }
                Ok(false) => refused.push(target),
                Err(e) => {
                    tracing::debug!(target_node = target, "pre-vote not answered: {e}");
                    // Reconnected on the next round.
                    peers.remove(&target);
                }
            }
            if is_quorum(configs, &granted) {
                asked.abort_all();
                return true;
            }
        }
        tracing::debug!(term, ?granted, ?refused, "pre-vote refused: not campaigning");
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;

    fn log(term: u64, index: u64) -> Option<LogId<NodeId>> {
        Some(LogId::new(CommittedLeaderId::new(term, 1), index))
    }

    const MIN: Duration = Duration::from_millis(150);

    #[test]
    fn a_node_that_hears_a_leader_refuses_a_pre_vote() {
        let heard = PreVoteView { quiet_for: Duration::from_millis(40), last_log_id: log(3, 10) };
        // However up to date the candidate is.
        assert!(!grant_pre_vote(&heard, log(9, 100), MIN));
        // Just under the minimum election timeout: still refused.
        let almost = PreVoteView { quiet_for: MIN - Duration::from_millis(1), ..heard };
        assert!(!grant_pre_vote(&almost, log(3, 10), MIN));
        // Silent for the minimum election timeout: granted to an up-to-date candidate.
        let silent = PreVoteView { quiet_for: MIN, ..heard };
        assert!(grant_pre_vote(&silent, log(3, 10), MIN));
    }

    #[test]
    fn a_candidate_whose_log_is_behind_is_refused() {
        let silent = PreVoteView { quiet_for: Duration::from_secs(5), last_log_id: log(3, 10) };
        assert!(!grant_pre_vote(&silent, log(3, 9), MIN), "a shorter log of the same term");
        assert!(!grant_pre_vote(&silent, log(2, 50), MIN), "a longer log of an older term");
        assert!(!grant_pre_vote(&silent, None, MIN), "an empty log");
        assert!(grant_pre_vote(&silent, log(3, 11), MIN), "a longer log");
        assert!(grant_pre_vote(&silent, log(4, 2), MIN), "a newer term");
        let empty = PreVoteView { quiet_for: Duration::from_secs(5), last_log_id: None };
        assert!(grant_pre_vote(&empty, None, MIN), "two empty logs");
    }

    #[test]
    fn a_quorum_is_a_majority_of_every_voter_set() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<_>>();
        let three = vec![set(&[1, 2, 3])];
        assert!(!is_quorum(&three, &set(&[1])));
        assert!(is_quorum(&three, &set(&[1, 2])));
        assert!(is_quorum(&three, &set(&[1, 2, 3])));
        assert!(!is_quorum(&three, &set(&[1, 4, 5])), "votes of non-voters do not count");
        assert!(is_quorum(&[set(&[1])], &set(&[1])), "a single voter elects itself");
        let four = vec![set(&[1, 2, 3, 4])];
        assert!(!is_quorum(&four, &set(&[1, 2])), "half is not a majority");
        // A joint change from {1,2,3} to {3,4,5}: a majority of both.
        let joint = vec![set(&[1, 2, 3]), set(&[3, 4, 5])];
        assert!(!is_quorum(&joint, &set(&[1, 2])));
        assert!(!is_quorum(&joint, &set(&[4, 5])));
        assert!(is_quorum(&joint, &set(&[1, 3, 4])));
        assert!(!is_quorum(&[], &set(&[1])), "no membership, no quorum");
    }

    #[test]
    fn a_leader_counts_from_its_last_quorum_acknowledgement() {
        let clock = ElectionClock::new();
        let mut m = RaftMetrics::<NodeId, openraft::BasicNode>::new_initial(1);
        m.state = ServerState::Leader;
        m.millis_since_quorum_ack = Some(20);
        assert_eq!(quiet_for(&m, &clock), Duration::from_millis(20));
        m.millis_since_quorum_ack = Some(900);
        assert_eq!(quiet_for(&m, &clock), Duration::from_millis(900));
        m.millis_since_quorum_ack = None;
        assert_eq!(quiet_for(&m, &clock), Duration::ZERO, "just elected: counts as heard");
        m.state = ServerState::Follower;
        std::thread::sleep(Duration::from_millis(5));
        assert!(quiet_for(&m, &clock) >= Duration::from_millis(5));
        clock.leader_heard();
        assert!(quiet_for(&m, &clock) < Duration::from_millis(5));
    }

    #[test]
    fn a_granted_vote_restarts_the_timer_but_is_not_a_leader_heard() {
        let clock = ElectionClock::new();
        std::thread::sleep(Duration::from_millis(20));
        clock.restart_timer();
        assert!(clock.since_timer_start() < Duration::from_millis(20));
        assert!(clock.since_leader() >= Duration::from_millis(20));
    }

    #[test]
    fn election_timeouts_are_drawn_from_the_range() {
        let (min, max) = (Duration::from_millis(150), Duration::from_millis(300));
        let drawn: Vec<Duration> = (0..200).map(|_| random_between(min, max)).collect();
        assert!(drawn.iter().all(|d| *d >= min && *d < max), "{drawn:?}");
        let distinct: BTreeSet<Duration> = drawn.iter().copied().collect();
        assert!(distinct.len() > 100, "not random: {} distinct of 200", distinct.len());
        assert_eq!(random_between(min, min), min);
    }
}
