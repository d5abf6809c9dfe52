//! Prometheus metrics of a coordinator (names fixed by the metrics contract, see README
//! "Metrics"): Raft and TSO series on every coordinator; scheduler counters and series derived
//! from the applied state and the leader's memory (heartbeat health, pending reasons) only on
//! the leader, computed when scraped.
//!
//! Boundary: this module only reads; it never proposes anything.

use crate::scheduler::LeaderMemory;
use crate::Coordinator;
use corral_core::State;
use corral_types::{JobState, NodeState};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

/// A gauge family labelled by name/value pairs.
type Labelled<N = i64, A = std::sync::atomic::AtomicI64> = Family<Vec<(String, String)>, Gauge<N, A>>;

/// The categories of `corral_jobs_pending_by_reason`, in the order they are exported.
pub(crate) const PENDING_REASONS: [&str; 6] = ["quota", "resources", "gang", "backfill", "priority", "other"];

/// Counters and histograms a coordinator keeps between scrapes (the rest is computed).
#[derive(Debug)]
pub(crate) struct SchedulerMetrics {
    pub placements: Counter,
    pub preemptions: Counter,
    pub pass_duration: Histogram,
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        SchedulerMetrics {
            placements: Counter::default(),
            preemptions: Counter::default(),
            // 0.5 ms .. ~16 s.
            pass_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
        }
    }
}

/// The category of a pending reason as the scheduler words it (`"quota: tenant ..."`): the
/// text before the first colon. A job waiting for its own preemption victims counts as
/// `priority`; a job no pass has looked at yet (or an unknown wording) as `other`.
pub(crate) fn reason_category(reason: Option<&str>) -> &'static str {
    let prefix = reason.and_then(|r| r.split_once(':')).map(|(p, _)| p.trim());
    match prefix {
        Some("quota") => "quota",
        Some("resources") => "resources",
        Some("gang") => "gang",
        Some("backfill reservation") | Some("backfill") => "backfill",
        Some("priority") | Some("preemption") => "priority",
        _ => "other",
    }
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Registers the state-derived series of the leader: the queue, nodes, GPUs, tenants and
/// billing. Tenants and priority classes of the cluster config are exported with 0 when idle,
/// so their series do not vanish. `now_ms`: the wall clock, Unix milliseconds.
pub(crate) fn register_state_series(registry: &mut Registry, state: &State, memory: &LeaderMemory<'_>, now_ms: u64) {
    let mut tenants: BTreeSet<&str> = state.config.tenants.iter().map(String::as_str).collect();
    tenants.extend(state.live_jobs().map(|j| j.spec.tenant.as_str()));
    let billed_totals = state.billed_by_tenant();
    tenants.extend(billed_totals.keys().map(String::as_str));

    // Queue by tenant, class and state.
    let jobs = Labelled::<i64>::default();
    for tenant in &tenants {
        for class in state.config.priority_classes.keys() {
            for s in ["pending", "running"] {
                jobs.get_or_create(&labels(&[("tenant", tenant), ("priority_class", class), ("state", s)])).set(0);
            }
        }
    }
    let mut oldest: BTreeMap<&str, u64> = tenants.iter().map(|t| (*t, now_ms)).collect();
    let mut by_reason: BTreeMap<&str, i64> = PENDING_REASONS.iter().map(|r| (*r, 0)).collect();
    for job in state.live_jobs() {
        let s = match job.state {
            JobState::Pending => "pending",
            JobState::Running => "running",
            _ => continue,
        };
        let key = labels(&[("tenant", &job.spec.tenant), ("priority_class", &job.spec.priority_class), ("state", s)]);
        jobs.get_or_create(&key).inc();
        if job.state == JobState::Pending {
            let reason = memory.pending.reason(job.id);
            *by_reason.entry(reason_category(reason)).or_default() += 1;
            let submitted = job.submitted_at.physical_ms();
            oldest.entry(job.spec.tenant.as_str()).and_modify(|o| *o = (*o).min(submitted)).or_insert(submitted);
        }
    }
    registry.register("corral_jobs", "Pending and running jobs by tenant, priority class and state", jobs);

    let pending = Labelled::<i64>::default();
    for (reason, n) in by_reason {
        pending.get_or_create(&labels(&[("reason", reason)])).set(n);
    }
    registry.register(
        "corral_jobs_pending_by_reason",
        "Pending jobs by why the last scheduling pass left them",
        pending,
    );

    let oldest_age = Labelled::<f64, AtomicU64>::default();
    for (tenant, submitted_ms) in oldest {
        let age = now_ms.saturating_sub(submitted_ms) as f64 / 1000.0;
        oldest_age.get_or_create(&labels(&[("tenant", tenant)])).set(age);
    }
    registry.register(
        "corral_job_oldest_pending_seconds",
        "Age of the oldest pending job per tenant (0 when none waits)",
        oldest_age,
    );

    // Nodes and the GPU pool.
    let node_up = Labelled::<i64>::default();
    let mut pool: BTreeMap<&str, i64> =
        ["total", "allocated", "free", "unhealthy", "dirty"].into_iter().map(|s| (s, 0)).collect();
    for node in state.nodes.values() {
        let up = node.state == NodeState::Up;
        node_up.get_or_create(&labels(&[("node", &node.spec.name)])).set(i64::from(up));
        if !up {
            continue;
        }
        let allocated = state.allocated_gpus(&node.spec.name);
        let live = memory.live.get(&node.spec.name).filter(|l| l.heard);
        for gpu in &node.spec.gpus {
            let health = live.and_then(|l| l.gpus.iter().find(|h| h.index == gpu.index));
            let dirty = health.is_some_and(|h| h.dirty);
            let unhealthy = health.is_some_and(|h| !h.problems.is_empty());
            let busy = allocated.contains(&gpu.index);
            *pool.entry("total").or_default() += 1;
            *pool.entry("allocated").or_default() += i64::from(busy);
            *pool.entry("dirty").or_default() += i64::from(dirty);
            *pool.entry("unhealthy").or_default() += i64::from(unhealthy);
            *pool.entry("free").or_default() += i64::from(!busy && !dirty && !unhealthy);
        }
    }
    registry.register("corral_node_up", "1 if the worker node is registered and up, 0 if lost or down", node_up);
    let pool_gpus = Labelled::<i64>::default();
    for (s, n) in pool {
        pool_gpus.get_or_create(&labels(&[("state", s)])).set(n);
    }
    registry.register(
        "corral_pool_gpus",
        "GPUs of up nodes: total, allocated (whole or in part), free (schedulable and unallocated), unhealthy, dirty",
        pool_gpus,
    );

    // Tenants: allocation and billing.
    let allocated = Labelled::<f64, AtomicU64>::default();
    for tenant in &tenants {
        let gpus = state.tenant_usage(tenant) as f64 / corral_core::MILLI_PER_GPU as f64;
        allocated.get_or_create(&labels(&[("tenant", tenant)])).set(gpus);
    }
    registry.register("corral_tenant_gpus_allocated", "GPU-equivalents held by each tenant's running jobs", allocated);
    let mut billed: BTreeMap<&str, (u64, u128)> = tenants.iter().map(|t| (*t, (0, 0))).collect();
    for (tenant, total) in &billed_totals {
        billed.insert(tenant.as_str(), (total.cost_micros, total.gpu_milli_ms));
    }
    let cost = Labelled::<i64>::default();
    let gpu_seconds = Labelled::<f64, AtomicU64>::default();
    for (tenant, (micros, milli_ms)) in billed {
        cost.get_or_create(&labels(&[("tenant", tenant)])).set(i64::try_from(micros).unwrap_or(i64::MAX));
        gpu_seconds.get_or_create(&labels(&[("tenant", tenant)])).set(milli_ms as f64 / 1_000_000.0);
    }
    registry.register("corral_billing_cost_micros", "Total cost in the billing ledger per tenant, micro-units", cost);
    registry.register(
        "corral_billing_gpu_seconds",
        "GPU-equivalent seconds in the billing ledger per tenant",
        gpu_seconds,
    );
}

fn gauge(registry: &mut Registry, name: &str, help: &str, value: i64) {
    let g = Gauge::<i64>::default();
    g.set(value);
    registry.register(name, help, g);
}

impl Coordinator {
    /// Registers this coordinator's series into `registry` (a fresh one per scrape): Raft and
    /// TSO on every coordinator, the rest only while this node leads.
    pub async fn collect_metrics(&self, registry: &mut Registry) {
        let raft = self.raft_node().status();
        let is_leader = raft.leader == Some(self.raft_node().id);
        let applied = raft.applied_index.unwrap_or(0);
        // openraft 0.9 does not publish the commit index; the persisted one may lag, and
        // everything applied is committed.
        let committed = self.raft_node().committed_index().await.unwrap_or(0).max(applied);
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        gauge(registry, "corral_raft_term", "Current Raft term", as_i64(raft.term));
        gauge(registry, "corral_raft_is_leader", "1 if this coordinator is the Raft leader", i64::from(is_leader));
        gauge(
            registry,
            "corral_raft_leader_id",
            "Node id of the known Raft leader (0: none known)",
            as_i64(raft.leader.unwrap_or(0)),
        );
        gauge(registry, "corral_raft_commit_index", "Highest Raft log index known committed", as_i64(committed));
        gauge(registry, "corral_raft_applied_index", "Highest Raft log index applied", as_i64(applied));
        registry.register(
            "corral_tso_timestamps",
            "Timestamps handed out by this coordinator's oracle",
            self.timestamps_served().clone(),
        );
        if !is_leader {
            return;
        }
        let sched = &self.scheduler_metrics();
        registry.register(
            "corral_placements",
            "Jobs placed by this leader's scheduling passes",
            sched.placements.clone(),
        );
        registry.register(
            "corral_preemptions",
            "Jobs preempted by this leader's scheduling passes",
            sched.preemptions.clone(),
        );
        registry.register(
            "corral_scheduling_pass_duration_seconds",
            "Duration of a scheduling pass, including its Raft proposal",
            sched.pass_duration.clone(),
        );
        let queue = self.submits().queue();
        gauge(
            registry,
            "corral_submit_queue_jobs",
            "Jobs waiting on this leader to be proposed (bounded by limits.max-queued-submits)",
            i64::try_from(queue.queued()).unwrap_or(i64::MAX),
        );
        registry.register(
            "corral_submits_refused",
            "Jobs refused with RESOURCE_EXHAUSTED because the submit queue was full",
            queue.refused.clone(),
        );
        let live = self.liveness().snapshot();
        let pending = self.leader_view().pending();
        let data = self.store().read();
        let memory = LeaderMemory { pending: &pending, live: &live, pulls: self.pulls() };
        register_state_series(registry, &data.state, &memory, now_ms());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::NodeLive;
    use crate::scheduler::PendingJobs;
    use crate::testing::{apply, dev_state_with_node};
    use corral_core::{schedule, Command};
    use corral_types::{GpuHealth, JobSpec, Timestamp};
    use std::time::Instant;

    fn encode(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).expect("encode");
        text
    }

    fn spec(tenant: &str, gpus: u32) -> JobSpec {
        JobSpec {
            name: "t".into(),
            tenant: tenant.into(),
            gpus,
            command: vec!["true".into()].into(),
            ..Default::default()
        }
    }

    #[test]
    fn reasons_map_to_the_contract_categories() {
        let cases = [
            (Some("quota: tenant a uses 4 of its 4 gpus"), "quota"),
            (Some("resources: no node is up"), "resources"),
            (Some("gang: needs 2 nodes"), "gang"),
            (Some("backfill reservation: the free resources are held"), "backfill"),
            (Some("priority: the free resources are held for job 3"), "priority"),
            (Some("preemption: waiting for 1 preempted job(s)"), "priority"),
            (Some("something new"), "other"),
            (None, "other"),
        ];
        for (reason, expected) in cases {
            assert_eq!(reason_category(reason), expected, "{reason:?}");
            assert!(PENDING_REASONS.contains(&expected));
        }
    }

    /// A dev-config state with node `n1` (two GPUs) and job 1 (team-a, 1 GPU) placed on it at
    /// 2.5 s, then job 2 (team-b, 2 GPUs) submitted at 3 s.
    fn one_running_one_pending() -> State {
        let mut state = dev_state_with_node();
        apply(&mut state, 2_000, Command::SubmitJob { request_id: "a".into(), spec: spec("team-a", 1) });
        let pass = schedule(&state, Timestamp::compose(2_500, 0), &BTreeSet::new());
        apply(&mut state, 2_500, pass.command().expect("a placement"));
        apply(&mut state, 3_000, Command::SubmitJob { request_id: "b".into(), spec: spec("team-b", 2) });
        state
    }

    fn series(state: &State, reasons: &BTreeMap<u64, String>, live: &BTreeMap<String, NodeLive>) -> String {
        let mut registry = Registry::default();
        let pending = PendingJobs::of_pass(reasons.iter().map(|(id, reason)| (*id, reason.clone())));
        let memory = LeaderMemory { pending: &pending, live, pulls: &crate::pulls::PullBoard::default() };
        register_state_series(&mut registry, state, &memory, 13_000);
        encode(&registry)
    }

    fn assert_line(text: &str, line: &str) {
        assert!(text.lines().any(|l| l == line), "missing `{line}` in:\n{text}");
    }

    /// One job runs on GPU 0, one waits for two GPUs; GPU 1 is dirty. Every series has the
    /// exact name and labels of the contract.
    #[test]
    fn state_series_follow_the_contract() {
        let state = one_running_one_pending();
        let reasons = BTreeMap::from([(2, "resources: needs 2 gpus on one node".to_string())]);
        let dirty = GpuHealth { index: 1, dirty: true, ..Default::default() };
        let live = BTreeMap::from([(
            "n1".to_string(),
            NodeLive {
                last_seen: Instant::now(),
                gpus: vec![GpuHealth { index: 0, ..Default::default() }, dirty],
                heard: true,
            },
        )]);
        let text = series(&state, &reasons, &live);
        let has = |line: &str| assert_line(&text, line);
        has("# TYPE corral_jobs gauge");
        has("corral_jobs{tenant=\"team-a\",priority_class=\"normal\",state=\"running\"} 1");
        has("corral_jobs{tenant=\"team-b\",priority_class=\"normal\",state=\"pending\"} 1");
        has("corral_jobs{tenant=\"default\",priority_class=\"normal\",state=\"pending\"} 0");
        has("corral_jobs_pending_by_reason{reason=\"resources\"} 1");
        has("corral_jobs_pending_by_reason{reason=\"quota\"} 0");
        has("corral_job_oldest_pending_seconds{tenant=\"team-b\"} 10.0");
        has("corral_job_oldest_pending_seconds{tenant=\"team-a\"} 0.0");
        has("corral_node_up{node=\"n1\"} 1");
        has("corral_pool_gpus{state=\"total\"} 2");
        has("corral_pool_gpus{state=\"allocated\"} 1");
        has("corral_pool_gpus{state=\"dirty\"} 1");
        has("corral_pool_gpus{state=\"unhealthy\"} 0");
        has("corral_pool_gpus{state=\"free\"} 0");
        has("corral_tenant_gpus_allocated{tenant=\"team-a\"} 1.0");
        has("corral_billing_cost_micros{tenant=\"team-a\"} 0");
        has("corral_billing_gpu_seconds{tenant=\"team-a\"} 0.0");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    /// A finished hour on one RTX 5090 (0.89 per GPU-hour, class multiplier 1) is billed to
    /// the tenant; a node that missed its heartbeats shows as down and leaves the pool.
    #[test]
    fn billing_totals_and_lost_nodes() {
        let mut state = one_running_one_pending();
        let epoch = state.jobs[&1].allocation.as_ref().expect("placed").epoch;
        apply(&mut state, 3_000, Command::JobStarted { job_id: 1, epoch });
        let report = corral_types::JobExitReport { exit_code: Some(0), run_time_ms: 3_600_000, ..Default::default() };
        apply(&mut state, 3_603_000, Command::JobFinished { job_id: 1, epoch, node: String::new(), report });
        apply(
            &mut state,
            3_604_000,
            Command::SetNodeState { node: "n1".into(), state: NodeState::Down, reason: "lost".into() },
        );
        let text = series(&state, &BTreeMap::new(), &BTreeMap::new());
        assert_line(&text, "corral_billing_cost_micros{tenant=\"team-a\"} 890000");
        assert_line(&text, "corral_billing_gpu_seconds{tenant=\"team-a\"} 3600.0");
        assert_line(&text, "corral_node_up{node=\"n1\"} 0");
        assert_line(&text, "corral_pool_gpus{state=\"total\"} 0");
        assert_line(&text, "corral_jobs_pending_by_reason{reason=\"other\"} 1");
    }
}
