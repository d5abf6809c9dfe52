//! Leader-memory view of workers: last heartbeat and GPU health. Never replicated.

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
pub(crate) struct Liveness {
    nodes: Mutex<BTreeMap<String, NodeLive>>,
}

impl Liveness {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, NodeLive>> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn heartbeat(&self, node: &str, gpus: Vec<GpuHealth>) {
        self.lock().insert(node.to_string(), NodeLive { last_seen: Instant::now(), gpus, heard: true });
    }

    pub fn get(&self, node: &str) -> Option<NodeLive> {
        self.lock().get(node).cloned()
    }

    /// Every node's entry, for metrics.
    pub fn snapshot(&self) -> BTreeMap<String, NodeLive> {
        self.lock().clone()
    }

    /// Nodes among `up` not heard from within `ttl`. A node never seen by this leader gets a
    /// grace period of one `ttl` from now (a new leader has no heartbeat history).
    pub fn expired<'a>(&self, up: impl Iterator<Item = &'a str>, ttl: Duration) -> Vec<String> {
        let now = Instant::now();
        let mut nodes = self.lock();
        up.filter(|name| {
            let live = nodes.entry(name.to_string()).or_insert_with(|| NodeLive {
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
        self.lock()
            .iter()
            .flat_map(|(name, live)| {
                live.gpus.iter().filter(|g| !g.schedulable()).map(move |g| (name.clone(), g.index))
            })
            .collect()
    }
}
