//! The replicated state held by every coordinator, with derived indexes (free capacity, quota use)
//! that make apply() and the scheduling pass independent of the number of queued jobs.

use crate::history::{Archive, RequestKey, RequestRecord};
use crate::jobs::Jobs;
use crate::join_tokens::JoinTokenRecord;
use crate::policy::PolicyRecord;
use crate::resources::{gang_shape, job_milli_gpus, GpuLoad, SliceReq};
use crate::tokens::TokenRecord;
use crate::usage::UsageLedger;
use crate::ClusterConfig;
use corral_types::{Job, JobId, JobSpec, JobState, NodeStatus, Segment, Timestamp};
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
    pub jobs: Jobs,
    pub nodes: BTreeMap<String, NodeStatus>,
    /// Client request id (by its key) -> job: makes submit idempotent across retries and
    /// leader changes, for the request-id window (`Command::Compact` expires older ones). A
    /// persistent map: a snapshot shares it instead of copying up to a day of ids under the
    /// state's lock.
    pub request_ids: imbl::OrdMap<RequestKey, RequestRecord>,
    pub next_job_id: JobId,
    /// Request ids submitted before this have expired (the largest cutoff a `Compact` applied):
    /// a request id recorded elsewhere with an earlier submit time is not in `request_ids`.
    #[serde(default)]
    pub request_ids_expired_before: Timestamp,
    /// Next allocation / node registration epoch.
    pub next_epoch: u64,
    /// Highest TSO timestamp applied so far.
    pub last_ts: Timestamp,
    pub config: ClusterConfig,
    /// Every coordinator ever added to the Raft cluster, by node id.
    pub coordinators: BTreeMap<u64, CoordinatorRecord>,
    /// Persisted upper bound (physical milliseconds) of timestamps any leader may have issued.
    pub tso_window_end_ms: u64,
    /// The hot part of the billing ledger, by segment id: segments with an id of at least
    /// `segments_archived_below` (older ones are only in the store's history).
    pub ledger: BTreeMap<u64, Segment>,
    /// Segments with a smaller id left the hot ledger. Persist with the scalar state.
    #[serde(default)]
    pub segments_archived_below: u64,
    /// Billing totals per tenant of the segments that left the hot ledger. Persist with the
    /// scalar state.
    #[serde(default)]
    pub archived_billed: BTreeMap<String, BilledTotal>,
    pub next_segment_id: u64,
    /// Fair-share usage history, charged when runs end. Replicated: persist it with the scalar
    /// state (set it after `from_parts`).
    #[serde(default)]
    pub usage: UsageLedger,
    /// Access tokens by id (hashes only). Persist them with the scalar state.
    #[serde(default)]
    pub tokens: BTreeMap<u64, TokenRecord>,
    #[serde(default)]
    pub next_token_id: u64,
    /// Version of `config` (0: never set through `ApplyPolicy`). Persist with the scalar state.
    #[serde(default)]
    pub policy_version: u64,
    /// The policy changes, oldest first (at most `MAX_POLICY_HISTORY`). Persist with the scalar
    /// state.
    #[serde(default)]
    pub policy_history: Vec<PolicyRecord>,
    /// Single-use join tokens of worker nodes by id (hashes only). Persist them with the
    /// scalar state.
    #[serde(default)]
    pub join_tokens: BTreeMap<u64, JoinTokenRecord>,
    /// Next join token id (0 means 1: a state that never issued one encodes as before).
    #[serde(default)]
    pub next_join_token_id: u64,
    /// The deny list of worker certificates: node name -> the second (since the Unix epoch)
    /// before which its certificates were issued that are refused (`revocations.rs`). Persist
    /// it with the scalar state.
    #[serde(default)]
    pub revoked_workers: BTreeMap<String, u64>,
    /// Derived indexes. Rebuilt on load, not persisted.
    #[serde(skip)]
    pub(crate) index: Index,
    /// Jobs whose change has consequences handled after the current command (dependents,
    /// arrays); empty between commands.
    #[serde(skip)]
    pub(crate) follow_ups: Vec<JobId>,
    /// Jobs changed by those consequences, for `apply_tracked`; empty between commands.
    #[serde(skip)]
    pub(crate) followed: BTreeSet<JobId>,
    /// What the last `Compact` took out, for `apply_tracked`; empty between commands.
    #[serde(skip)]
    pub(crate) archive: Archive,
    /// `request_ids` in the order they expire (submit time, then key). Derived.
    #[serde(skip)]
    pub(crate) request_order: BTreeSet<(Timestamp, RequestKey)>,
    /// Request ids the current command added, for `apply_tracked`; empty between commands.
    #[serde(skip)]
    pub(crate) added_request_ids: Vec<(RequestKey, RequestRecord)>,
}

/// Billing totals of one tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BilledTotal {
    /// Sum of the segments' costs, micro-units.
    pub cost_micros: u64,
    /// Sum of the credits against them, micro-units (the bill is the cost less these).
    #[serde(default)]
    pub credited_micros: u64,
    /// Sum of duration (ms) x GPU-equivalents (milli) of the segments.
    pub gpu_milli_ms: u128,
}

impl BilledTotal {
    /// Adds one segment.
    pub fn add(&mut self, segment: &Segment) {
        if segment.is_credit() {
            self.credited_micros = self.credited_micros.saturating_add(segment.cost_micros);
            return;
        }
        self.cost_micros = self.cost_micros.saturating_add(segment.cost_micros);
        self.gpu_milli_ms += u128::from(segment.duration_ms()) * u128::from(segment.gpu_milli);
    }
}

/// Load of one node: the running jobs with a part on it and what they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NodeLoad {
    pub jobs: BTreeSet<JobId>,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub gpus: BTreeMap<u32, GpuLoad>,
}

/// What a pass needs to know about a pending job, kept next to its id so that a pass reads
/// small contiguous records instead of every job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QueuedJob {
    pub milli: u64,
    pub parts: u32,
    pub per_node: u32,
    pub cpu: u64,
    pub mem: u64,
    pub slice: Option<SliceReq>,
    pub time_limit_secs: Option<u64>,
    pub rdma: bool,
    /// Node labels it needs (`--partition`, `--constraint`).
    pub selector: Vec<String>,
    /// `--exclusive`: only idle nodes, and nothing else on them while it runs.
    pub exclusive: bool,
    /// Only GPUs of this model (`--gres=gpu:TYPE:N`).
    pub gpu_type: Option<String>,
    /// Its tasks spread over nodes (`JobSpec::spreads`): the pass tries node counts.
    pub spread: bool,
}

impl QueuedJob {
    fn of(spec: &JobSpec) -> QueuedJob {
        let (parts, per_node) = gang_shape(spec);
        QueuedJob {
            milli: job_milli_gpus(spec),
            parts,
            per_node,
            cpu: u64::from(spec.cpu_millis),
            mem: spec.memory_bytes,
            slice: spec.gpu_slice.as_ref().map(SliceReq::of),
            time_limit_secs: spec.time_limit_secs,
            rdma: spec.sched.rdma,
            selector: spec.sched.node_selector.clone(),
            exclusive: spec.layout.exclusive,
            gpu_type: spec.layout.gpu_type.clone(),
            spread: spec.spreads(),
        }
    }
}

/// Quota use of one tenant (running jobs, including those being preempted).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TenantLoad {
    pub milli_gpus: u64,
    pub by_class: BTreeMap<String, u64>,
}

/// Derived from `jobs` and `nodes`; `State::from_parts` rebuilds it, apply() maintains it.
/// Invariant: equal to a rebuild from scratch (no empty entries are kept).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Index {
    /// Pending and running jobs.
    pub live: BTreeSet<JobId>,
    pub pending: BTreeSet<JobId>,
    /// Pending jobs by (tenant, priority class): a pass reads each name once per group.
    pub queue: BTreeMap<(String, String), BTreeMap<JobId, QueuedJob>>,
    pub running: BTreeSet<JobId>,
    /// Number of running jobs per tenant (tenants with none are absent).
    pub running_by_tenant: BTreeMap<String, u32>,
    /// Jobs not started yet per tenant, what `max-pending-jobs` limits: pending jobs, held and
    /// waiting ones included, and the tasks of unfinished arrays not created yet (an array
    /// itself is not one).
    pub pending_by_tenant: BTreeMap<String, u64>,
    /// Unfinished array -> its tasks still to be created (`uncreated_tasks`), as counted in
    /// `pending_by_tenant` (arrays with none are absent).
    pub array_uncreated: BTreeMap<JobId, u64>,
    /// Pending jobs kept out of the queue: held, or waiting on dependencies.
    pub blocked: BTreeSet<JobId>,
    /// Jobs of the hot state that ended: what a compaction looks at.
    pub ended: BTreeSet<JobId>,
    /// Job -> pending jobs waiting for it to end.
    pub dependents: BTreeMap<JobId, BTreeSet<JobId>>,
    /// (array, index, task's job id) of every task in the hot state: an index that an earlier
    /// version created twice has both.
    pub array_tasks: BTreeSet<(JobId, u32, JobId)>,
    /// Array -> its unfinished tasks.
    pub array_live: BTreeMap<JobId, u32>,
    pub nodes: BTreeMap<String, NodeLoad>,
    pub tenants: BTreeMap<String, TenantLoad>,
    /// Preemptor -> its victims that have not exited yet.
    pub preemptors: BTreeMap<JobId, BTreeSet<JobId>>,
    pub caps: Caps,
}

/// What the registered nodes (up or down) offer at most: what a job may ask for at all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Caps {
    pub largest_cpu_millis: u64,
    pub largest_memory_bytes: u64,
    /// Number of nodes by GPU count.
    pub nodes_by_gpus: BTreeMap<u32, u32>,
    /// Memory sizes (MiB) of MIG-capable GPUs.
    pub mig_cards: BTreeSet<u64>,
    /// Per node (in name order, like `State::nodes`), which GPUs support MIG.
    pub mig_gpus: Vec<Vec<bool>>,
    pub largest_gpu_memory_mib: u64,
}

impl Caps {
    pub(crate) fn of(nodes: &BTreeMap<String, NodeStatus>) -> Caps {
        let flags = nodes.values().map(|n| n.spec.gpus.iter().map(|g| g.supports_mig()).collect()).collect();
        Caps::aggregate(nodes, flags)
    }

    /// After `name` registered (again): recomputes its MIG flags only, then the totals.
    pub(crate) fn registered(&mut self, nodes: &BTreeMap<String, NodeStatus>, name: &str, new: bool) {
        let mut flags = std::mem::take(&mut self.mig_gpus);
        let pos = nodes.keys().take_while(|n| n.as_str() < name).count();
        let node_flags = nodes[name].spec.gpus.iter().map(|g| g.supports_mig()).collect();
        if new {
            flags.insert(pos, node_flags);
        } else {
            flags[pos] = node_flags;
        }
        *self = Caps::aggregate(nodes, flags);
    }

    fn aggregate(nodes: &BTreeMap<String, NodeStatus>, mig_gpus: Vec<Vec<bool>>) -> Caps {
        let mut caps = Caps::default();
        for (node, flags) in nodes.values().zip(&mig_gpus) {
            let spec = &node.spec;
            caps.largest_cpu_millis = caps.largest_cpu_millis.max(spec.cpu_millis);
            caps.largest_memory_bytes = caps.largest_memory_bytes.max(spec.memory_bytes);
            *caps.nodes_by_gpus.entry(spec.gpus.len() as u32).or_default() += 1;
            for (gpu, mig) in spec.gpus.iter().zip(flags) {
                caps.largest_gpu_memory_mib = caps.largest_gpu_memory_mib.max(gpu.memory_mib);
                if *mig {
                    caps.mig_cards.insert(gpu.memory_mib);
                }
            }
        }
        caps.mig_gpus = mig_gpus;
        caps
    }

    pub(crate) fn largest_gpus(&self) -> u32 {
        self.nodes_by_gpus.keys().next_back().copied().unwrap_or(0)
    }

    /// Nodes with at least `gpus` GPUs.
    pub(crate) fn nodes_with(&self, gpus: u32) -> u32 {
        self.nodes_by_gpus.range(gpus..).map(|(_, n)| n).sum()
    }
}

impl Default for State {
    fn default() -> Self {
        State {
            jobs: Jobs::new(),
            nodes: BTreeMap::new(),
            request_ids: imbl::OrdMap::new(),
            request_ids_expired_before: Timestamp::ZERO,
            next_job_id: 1,
            next_epoch: 1,
            last_ts: Timestamp::ZERO,
            config: ClusterConfig::default(),
            coordinators: BTreeMap::new(),
            tso_window_end_ms: 0,
            ledger: BTreeMap::new(),
            segments_archived_below: 0,
            archived_billed: BTreeMap::new(),
            next_segment_id: 1,
            usage: UsageLedger::default(),
            tokens: BTreeMap::new(),
            next_token_id: 1,
            policy_version: 0,
            policy_history: Vec::new(),
            join_tokens: BTreeMap::new(),
            next_join_token_id: 0,
            revoked_workers: BTreeMap::new(),
            index: Index::default(),
            follow_ups: Vec::new(),
            followed: BTreeSet::new(),
            archive: Archive::default(),
            request_order: BTreeSet::new(),
            added_request_ids: Vec::new(),
        }
    }
}

impl State {
    /// A copy of the replicated fields only, to encode (a snapshot, a digest) after a lock is
    /// released: the derived indexes are left empty, so the copy must not be applied to. Jobs
    /// are shared with this state, not copied (see [`Jobs`]).
    pub fn replicated_copy(&self) -> State {
        State {
            jobs: self.jobs.clone(),
            nodes: self.nodes.clone(),
            request_ids: self.request_ids.clone(),
            request_ids_expired_before: self.request_ids_expired_before,
            next_job_id: self.next_job_id,
            next_epoch: self.next_epoch,
            last_ts: self.last_ts,
            config: self.config.clone(),
            coordinators: self.coordinators.clone(),
            tso_window_end_ms: self.tso_window_end_ms,
            ledger: self.ledger.clone(),
            segments_archived_below: self.segments_archived_below,
            archived_billed: self.archived_billed.clone(),
            next_segment_id: self.next_segment_id,
            usage: self.usage.clone(),
            tokens: self.tokens.clone(),
            next_token_id: self.next_token_id,
            policy_version: self.policy_version,
            policy_history: self.policy_history.clone(),
            join_tokens: self.join_tokens.clone(),
            next_join_token_id: self.next_join_token_id,
            revoked_workers: self.revoked_workers.clone(),
            index: Index::default(),
            follow_ups: Vec::new(),
            followed: BTreeSet::new(),
            archive: Archive::default(),
            request_order: BTreeSet::new(),
            added_request_ids: Vec::new(),
        }
    }
}

fn request_order(request_ids: &imbl::OrdMap<RequestKey, RequestRecord>) -> BTreeSet<(Timestamp, RequestKey)> {
    request_ids.iter().map(|(key, r)| (r.at, *key)).collect()
}

/// Tasks of array `job` (in `state`) still to be created as pending jobs: none once it ended or
/// was cancelled, and none for an index cancelled before its task was created. O(ranges).
fn uncreated_tasks(job: &Job, state: JobState) -> u64 {
    let (Some(spec), Some(progress)) = (&job.spec.array, &job.array_progress) else { return 0 };
    if !job.is_array() || state.is_terminal() || job.cancel_requested {
        return 0;
    }
    // Indices are created in increasing order: the skipped ones still to come are those from
    // the next index on (an earlier version's record may list created ones too).
    let skipped = match spec.index_at(u64::from(progress.created)) {
        Some(next) => progress.skipped.len() - progress.skipped.partition_point(|&i| i < next),
        None => 0,
    };
    spec.len().saturating_sub(u64::from(progress.created) + skipped as u64)
}

/// Takes `n` off `key`'s count, dropping it at zero.
fn count_down_by<K: Ord>(counts: &mut BTreeMap<K, u64>, key: &K, n: u64) {
    if let Some(c) = counts.get_mut(key) {
        *c = c.saturating_sub(n);
        if *c == 0 {
            counts.remove(key);
        }
    }
}

fn count_down<K: Ord>(counts: &mut BTreeMap<K, u32>, key: &K) {
    if let Some(n) = counts.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            counts.remove(key);
        }
    }
}

impl Index {
    /// Files `job` under `state`. A pending job that is held or waits on dependencies is kept
    /// out of the queue (`blocked`); a job array is neither queued nor running (its tasks are).
    pub(crate) fn set_state(&mut self, job: &Job, state: JobState) {
        let (id, spec) = (job.id, &job.spec);
        let was_live = self.live.contains(&id);
        let array = job.is_array();
        if let Some(n) = self.array_uncreated.remove(&id) {
            count_down_by(&mut self.pending_by_tenant, &spec.tenant, n);
        }
        if self.pending.remove(&id) {
            let key = (spec.tenant.clone(), spec.priority_class.clone());
            if let Some(group) = self.queue.get_mut(&key) {
                group.remove(&id);
                if group.is_empty() {
                    self.queue.remove(&key);
                }
            }
            self.blocked.remove(&id);
            if !array {
                count_down_by(&mut self.pending_by_tenant, &spec.tenant, 1);
            }
        }
        if self.running.remove(&id) {
            count_down(&mut self.running_by_tenant, &spec.tenant);
        }
        for target in &job.waiting_on {
            if let Some(waiters) = self.dependents.get_mut(target) {
                waiters.remove(&id);
                if waiters.is_empty() {
                    self.dependents.remove(target);
                }
            }
        }
        match state {
            JobState::Pending => {
                self.pending.insert(id);
                if !array {
                    *self.pending_by_tenant.entry(spec.tenant.clone()).or_default() += 1;
                }
                for target in &job.waiting_on {
                    self.dependents.entry(*target).or_default().insert(id);
                }
                if array {
                } else if job.held || !job.waiting_on.is_empty() {
                    self.blocked.insert(id);
                } else {
                    let group = self.queue.entry((spec.tenant.clone(), spec.priority_class.clone())).or_default();
                    group.insert(id, QueuedJob::of(spec));
                }
            }
            JobState::Running if !array => {
                self.running.insert(id);
                *self.running_by_tenant.entry(spec.tenant.clone()).or_default() += 1;
            }
            _ => {}
        }
        let uncreated = uncreated_tasks(job, state);
        if uncreated > 0 {
            self.array_uncreated.insert(id, uncreated);
            *self.pending_by_tenant.entry(spec.tenant.clone()).or_default() += uncreated;
        }
        let live = !state.is_terminal();
        if live {
            self.live.insert(id);
            self.ended.remove(&id);
        } else {
            self.live.remove(&id);
            self.ended.insert(id);
        }
        if let Some(task) = job.array_task {
            self.array_tasks.insert((task.array, task.index, id));
            match (was_live, live) {
                (false, true) => *self.array_live.entry(task.array).or_default() += 1,
                (true, false) => count_down(&mut self.array_live, &task.array),
                _ => {}
            }
        }
    }

    /// Forgets a terminal job that leaves the hot state (`Command::Compact`).
    pub(crate) fn forget(&mut self, job: &Job) {
        debug_assert!(job.state.is_terminal());
        self.ended.remove(&job.id);
        if let Some(task) = job.array_task {
            self.array_tasks.remove(&(task.array, task.index, job.id));
        }
    }

    /// Records what a running job holds.
    pub(crate) fn add_allocation(&mut self, job: &Job) {
        let Some(alloc) = &job.allocation else { return };
        for (node, gpus) in alloc.parts() {
            let load = self.nodes.entry(node.to_string()).or_default();
            load.jobs.insert(job.id);
            load.cpu_millis += u64::from(job.spec.cpu_millis);
            load.memory_bytes += job.spec.memory_bytes;
            for g in gpus {
                let old = load.gpus.remove(g);
                load.gpus.insert(*g, GpuLoad::add(old, job.id, alloc.slice.as_ref()));
            }
        }
        let milli = job_milli_gpus(&job.spec);
        if milli > 0 {
            let tenant = self.tenants.entry(job.spec.tenant.clone()).or_default();
            tenant.milli_gpus += milli;
            *tenant.by_class.entry(job.spec.priority_class.clone()).or_default() += milli;
        }
        if let Some(p) = &job.preemption {
            self.preemptors.entry(p.by).or_default().insert(job.id);
        }
    }

    /// Forgets what a job held (call before its allocation is cleared).
    pub(crate) fn remove_allocation(&mut self, job: &Job) {
        let Some(alloc) = &job.allocation else { return };
        for (node, gpus) in alloc.parts() {
            let Some(load) = self.nodes.get_mut(node) else { continue };
            load.jobs.remove(&job.id);
            load.cpu_millis -= u64::from(job.spec.cpu_millis);
            load.memory_bytes -= job.spec.memory_bytes;
            for g in gpus {
                if let Some(old) = load.gpus.remove(g) {
                    if let Some(rest) = old.remove(job.id, alloc.slice.as_ref()) {
                        load.gpus.insert(*g, rest);
                    }
                }
            }
            if load.jobs.is_empty() {
                self.nodes.remove(node);
            }
        }
        let milli = job_milli_gpus(&job.spec);
        if let Some(tenant) = self.tenants.get_mut(&job.spec.tenant).filter(|_| milli > 0) {
            tenant.milli_gpus -= milli;
            if let Some(c) = tenant.by_class.get_mut(&job.spec.priority_class) {
                *c -= milli;
                if *c == 0 {
                    tenant.by_class.remove(&job.spec.priority_class);
                }
            }
            if tenant.by_class.is_empty() && tenant.milli_gpus == 0 {
                self.tenants.remove(&job.spec.tenant);
            }
        }
        if let Some(p) = &job.preemption {
            self.remove_victim(p.by, job.id);
        }
    }

    pub(crate) fn remove_victim(&mut self, preemptor: JobId, victim: JobId) {
        if let Some(victims) = self.preemptors.get_mut(&preemptor) {
            victims.remove(&victim);
            if victims.is_empty() {
                self.preemptors.remove(&preemptor);
            }
        }
    }

    fn rebuild(jobs: &Jobs, nodes: &BTreeMap<String, NodeStatus>) -> Index {
        let mut index = Index { caps: Caps::of(nodes), ..Index::default() };
        for job in jobs.values() {
            index.set_state(job, job.state);
            if job.state == JobState::Running {
                index.add_allocation(job);
            }
        }
        index
    }
}

impl State {
    /// Builds a state from its persisted parts and rebuilds derived indexes. The usage ledger and
    /// the billing ledger start empty: set `usage`, `ledger` and `next_segment_id` afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        jobs: BTreeMap<JobId, Job>,
        nodes: BTreeMap<String, NodeStatus>,
        request_ids: impl IntoIterator<Item = (RequestKey, RequestRecord)>,
        next_job_id: JobId,
        next_epoch: u64,
        last_ts: Timestamp,
        config: ClusterConfig,
        coordinators: BTreeMap<u64, CoordinatorRecord>,
        tso_window_end_ms: u64,
    ) -> Self {
        let jobs = Jobs::from(jobs);
        let index = Index::rebuild(&jobs, &nodes);
        let request_ids: imbl::OrdMap<RequestKey, RequestRecord> = request_ids.into_iter().collect();
        let request_order = request_order(&request_ids);
        State {
            jobs,
            nodes,
            request_ids,
            request_ids_expired_before: Timestamp::ZERO,
            next_job_id,
            next_epoch,
            last_ts,
            config,
            coordinators,
            tso_window_end_ms,
            ledger: BTreeMap::new(),
            segments_archived_below: 0,
            archived_billed: BTreeMap::new(),
            next_segment_id: 1,
            usage: UsageLedger::default(),
            tokens: BTreeMap::new(),
            next_token_id: 1,
            policy_version: 0,
            policy_history: Vec::new(),
            join_tokens: BTreeMap::new(),
            next_join_token_id: 0,
            revoked_workers: BTreeMap::new(),
            index,
            follow_ups: Vec::new(),
            followed: BTreeSet::new(),
            archive: Archive::default(),
            request_order,
            added_request_ids: Vec::new(),
        }
    }

    /// Adds request ids read from a snapshot, leaving out those that expired (submitted before
    /// `request_ids_expired_before`): a snapshot may keep them in files written before they
    /// expired.
    pub fn add_request_ids(&mut self, entries: impl IntoIterator<Item = (RequestKey, RequestRecord)>) {
        for (key, record) in entries {
            if record.at < self.request_ids_expired_before {
                continue;
            }
            if let Some(old) = self.request_ids.insert(key, record) {
                self.request_order.remove(&(old.at, key));
            }
            self.request_order.insert((record.at, key));
        }
    }

    /// Rebuilds the derived indexes (after changing `jobs` by hand, e.g. a serde decode).
    pub fn rebuild_indexes(&mut self) {
        self.index = Index::rebuild(&self.jobs, &self.nodes);
        self.request_order = request_order(&self.request_ids);
    }

    pub(crate) fn set_job_state_index(&mut self, job_id: JobId, state: JobState) {
        let Some(job) = self.jobs.get(&job_id) else { return };
        self.index.set_state(job, state);
        // What follows from it (dependents, the job's array) is handled after the command.
        if state.is_terminal() || (job.array_task.is_some() && state == JobState::Running) {
            self.follow_ups.push(job_id);
        }
    }

    /// Pending and running jobs in id order.
    pub fn live_jobs(&self) -> impl Iterator<Item = &Job> {
        self.index.live.iter().filter_map(|id| self.jobs.get(id))
    }

    /// Pending jobs in id (submit) order.
    pub fn pending_jobs(&self) -> impl Iterator<Item = &Job> {
        self.index.pending.iter().filter_map(|id| self.jobs.get(id))
    }

    /// Number of pending jobs.
    pub fn pending_count(&self) -> usize {
        self.index.pending.len()
    }

    /// Jobs of `tenant` not started yet, what its `max-pending-jobs` limits: pending jobs (held
    /// and waiting ones included) and the tasks of its unfinished arrays not created yet.
    pub fn pending_count_of(&self, tenant: &str) -> u64 {
        self.index.pending_by_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// The task `index` of job array `array`, once it was created (the newest, should an
    /// earlier version have created two). O(log jobs).
    pub fn array_task(&self, array: JobId, index: u32) -> Option<JobId> {
        self.array_tasks_at(array, index).next_back()
    }

    /// Every task of job array `array` with `index`, oldest first: one, or two an earlier
    /// version created for an index it listed twice.
    pub fn array_tasks_at(&self, array: JobId, index: u32) -> impl DoubleEndedIterator<Item = JobId> + '_ {
        self.index.array_tasks.range((array, index, 0)..=(array, index, JobId::MAX)).map(|t| t.2)
    }

    /// Every task of job array `array` in the hot state, in index order.
    pub fn array_tasks(&self, array: JobId) -> impl DoubleEndedIterator<Item = JobId> + '_ {
        self.index.array_tasks.range((array, 0, 0)..=(array, u32::MAX, JobId::MAX)).map(|t| t.2)
    }

    /// Unfinished tasks of job array `array`.
    pub fn array_live_tasks(&self, array: JobId) -> u32 {
        self.index.array_live.get(&array).copied().unwrap_or(0)
    }

    /// Pending jobs that wait on dependencies or are held, in id order.
    pub fn blocked_jobs(&self) -> impl Iterator<Item = &Job> {
        self.index.blocked.iter().filter_map(|id| self.jobs.get(id))
    }

    /// Number of running jobs of `tenant`.
    pub fn running_count_of(&self, tenant: &str) -> u32 {
        self.index.running_by_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Running jobs in id order.
    pub fn running_jobs(&self) -> impl Iterator<Item = &Job> {
        self.index.running.iter().filter_map(|id| self.jobs.get(id))
    }

    /// Running jobs with a part on `node` (gang jobs appear on each of their nodes).
    pub fn jobs_on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Job> + 'a {
        self.index.nodes.get(node).into_iter().flat_map(|l| l.jobs.iter()).filter_map(|id| self.jobs.get(id))
    }

    /// GPU indices of `node` held (whole or in part) by running jobs.
    pub fn allocated_gpus(&self, node: &str) -> BTreeSet<u32> {
        self.index.nodes.get(node).map(|l| l.gpus.keys().copied().collect()).unwrap_or_default()
    }

    /// Running jobs being preempted (the worker must stop them: checkpoint signal and SIGTERM,
    /// SIGKILL after the grace period), in id order.
    pub fn preempting_jobs(&self) -> impl Iterator<Item = &Job> {
        self.index
            .preemptors
            .values()
            .flatten()
            .copied()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter_map(|id| self.jobs.get(&id))
    }

    /// What the billing ledger holds per tenant: total cost and GPU time of its segments.
    pub fn billed_by_tenant(&self) -> BTreeMap<String, BilledTotal> {
        let mut billed = self.archived_billed.clone();
        for segment in self.ledger.values() {
            billed.entry(segment.tenant.clone()).or_default().add(segment);
        }
        billed
    }

    /// Milli GPU-equivalents used by a tenant's running jobs (its quota use).
    pub fn tenant_usage(&self, tenant: &str) -> u64 {
        self.index.tenants.get(tenant).map(|t| t.milli_gpus).unwrap_or(0)
    }

    /// Milli GPU-equivalents used by the running jobs of a cohort's members.
    pub fn cohort_usage(&self, cohort: &str) -> u64 {
        self.config
            .tenant_policies
            .iter()
            .filter(|(_, p)| p.cohort.as_deref() == Some(cohort))
            .map(|(t, _)| self.tenant_usage(t))
            .sum()
    }
}
