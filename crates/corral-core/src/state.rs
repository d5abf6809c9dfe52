//! The replicated state held by every coordinator.

use crate::ClusterConfig;
use corral_types::{Job, JobId, JobState, NodeStatus, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A coordinator that was added to the Raft cluster at some point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorRecord {
    pub addr: String,
    pub removed: bool,
}

/// Everything the coordinators replicate. Only `apply()` changes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub jobs: BTreeMap<JobId, Job>,
    pub nodes: BTreeMap<String, NodeStatus>,
    /// Client request id -> job: makes submit idempotent across retries and leader changes.
    pub request_ids: BTreeMap<String, JobId>,
    pub next_job_id: JobId,
    /// Next allocation / node registration epoch.
    pub next_epoch: u64,
    /// Highest TSO timestamp applied so far.
    pub last_ts: Timestamp,
    pub config: ClusterConfig,
    /// Every coordinator ever added to the Raft cluster, by node id.
    pub coordinators: BTreeMap<u64, CoordinatorRecord>,
    /// Persisted upper bound (physical milliseconds) of timestamps any leader may have issued.
    pub tso_window_end_ms: u64,
    /// Derived index: live (pending or running) jobs. Rebuilt on load, not persisted.
    #[serde(skip)]
    live: BTreeSet<JobId>,
}

impl Default for State {
    fn default() -> Self {
        State {
            jobs: BTreeMap::new(),
            nodes: BTreeMap::new(),
            request_ids: BTreeMap::new(),
            next_job_id: 1,
            next_epoch: 1,
            last_ts: Timestamp::ZERO,
            config: ClusterConfig::default(),
            coordinators: BTreeMap::new(),
            tso_window_end_ms: 0,
            live: BTreeSet::new(),
        }
    }
}

impl State {
    /// Builds a state from its persisted parts and rebuilds derived indexes.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        jobs: BTreeMap<JobId, Job>,
        nodes: BTreeMap<String, NodeStatus>,
        request_ids: BTreeMap<String, JobId>,
        next_job_id: JobId,
        next_epoch: u64,
        last_ts: Timestamp,
        config: ClusterConfig,
        coordinators: BTreeMap<u64, CoordinatorRecord>,
        tso_window_end_ms: u64,
    ) -> Self {
        let live = jobs.values().filter(|j| !j.state.is_terminal()).map(|j| j.id).collect();
        State { jobs, nodes, request_ids, next_job_id, next_epoch, last_ts, config, coordinators, tso_window_end_ms, live }
    }

    pub(crate) fn set_job_state_index(&mut self, job_id: JobId, state: JobState) {
        if state.is_terminal() {
            self.live.remove(&job_id);
        } else {
            self.live.insert(job_id);
        }
    }

    /// Pending and running jobs in id order.
    pub fn live_jobs(&self) -> impl Iterator<Item = &Job> {
        self.live.iter().filter_map(|id| self.jobs.get(id))
    }

    /// Pending jobs in id (submit) order.
    pub fn pending_jobs(&self) -> impl Iterator<Item = &Job> {
        self.live_jobs().filter(|j| j.state == JobState::Pending)
    }

    /// Running jobs placed on `node`.
    pub fn jobs_on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Job> + 'a {
        self.live_jobs()
            .filter(move |j| j.state == JobState::Running && j.allocation.as_ref().is_some_and(|a| a.node == node))
    }

    /// GPU indices of `node` held by running jobs.
    pub fn allocated_gpus(&self, node: &str) -> BTreeSet<u32> {
        self.jobs_on_node(node).flat_map(|j| j.allocation.iter().flat_map(|a| a.gpus.iter().copied())).collect()
    }
}
