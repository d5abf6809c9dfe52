//! Leader-memory view of workers: last heartbeat and GPU health. Never replicated.
//!
//! Invariant: the entries belong to one leadership term. A node that becomes leader (again)
//! starts from nothing, so every worker gets a full TTL from the start of the term before it
//! can be marked down: what an earlier term of this node saw says nothing about now.

use corral_types::GpuHealth;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub(crate) struct NodeLive {
    pub last_seen: Instant,
    pub gpus: Vec<GpuHealth>,
    /// True once a real heartbeat arrived (false: grace entry made when first looked at).
    pub heard: bool,
}

#[derive(Debug, Default)]
struct Entries {
    /// The leadership term the entries belong to.
    term: Option<u64>,
    nodes: BTreeMap<String, NodeLive>,
}

#[derive(Debug, Default)]
pub(crate) struct Liveness {
    entries: Mutex<Entries>,
}

impl Liveness {
    /// The entries of `term`: those of another term are dropped first.
    fn lock(&self, term: u64) -> std::sync::MutexGuard<'_, Entries> {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.term != Some(term) {
            if entries.term.is_some() {
                tracing::info!(term, "new leadership term: every worker gets a full ttl from now");
            }
            *entries = Entries { term: Some(term), nodes: BTreeMap::new() };
        }
        entries
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a heartbeat (or registration) of `node` heard while leading in `term`.
    pub fn heartbeat(&self, term: u64, node: &str, gpus: Vec<GpuHealth>) {
        self.lock(term).nodes.insert(node.to_string(), NodeLive { last_seen: Instant::now(), gpus, heard: true });
    }

    /// Drops a removed node's entry (its GPUs leave the metrics and views).
    pub fn forget(&self, node: &str) {
        self.current().nodes.remove(node);
    }

    pub fn get(&self, node: &str) -> Option<NodeLive> {
        self.current().nodes.get(node).cloned()
    }

    /// Every node's entry, for metrics.
    pub fn snapshot(&self) -> BTreeMap<String, NodeLive> {
        self.current().nodes.clone()
    }

    /// Nodes among `up` not heard from within `ttl` in leadership `term`. A node not heard from
    /// yet in this term gets a grace period of one `ttl` from now.
    pub fn expired<'a>(&self, term: u64, up: impl Iterator<Item = &'a str>, ttl: Duration) -> Vec<String> {
        let now = Instant::now();
        let mut entries = self.lock(term);
        up.filter(|name| {
            let live = entries.nodes.entry(name.to_string()).or_insert_with(|| NodeLive {
                last_seen: now,
                gpus: Vec::new(),
                heard: false,
            });
            now.duration_since(live.last_seen) > ttl
        })
        .map(str::to_string)
        .collect()
    }

    /// (node, gpu index) pairs that must not be scheduled: dirty or unhealthy devices.
    pub fn unschedulable(&self) -> BTreeSet<(String, u32)> {
        self.current()
            .nodes
            .iter()
            .flat_map(|(name, live)| {
                live.gpus.iter().filter(|g| !g.schedulable()).map(move |g| (name.clone(), g.index))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leader that lost leadership and wins it again later must not judge workers by the
    /// heartbeats of its earlier term: they all look expired by then.
    #[test]
    fn a_new_term_starts_with_a_full_ttl_for_every_node() {
        let liveness = Liveness::default();
        let ttl = Duration::from_millis(50);
        liveness.heartbeat(3, "w1", Vec::new());
        std::thread::sleep(ttl * 2);
        assert_eq!(liveness.expired(3, ["w1"].into_iter(), ttl), vec!["w1".to_string()], "silent in term 3");
        // Term 5: the same node leads again after someone else did.
        assert!(liveness.expired(5, ["w1"].into_iter(), ttl).is_empty(), "a grace ttl from the start of term 5");
        assert!(liveness.get("w1").is_some_and(|l| !l.heard), "nothing heard in term 5 yet");
        std::thread::sleep(ttl * 2);
        assert_eq!(liveness.expired(5, ["w1"].into_iter(), ttl), vec!["w1".to_string()]);
    }
}
