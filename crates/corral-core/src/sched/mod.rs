//! The scheduling pass: a pure function of the replicated state, the leader's clock reading (`now`,
//! a TSO timestamp) and the GPUs the leader knows to be unusable. It runs on the leader and
//! proposes its decisions as one `Command::Schedule`; apply() re-validates each of them.
//!
//! One pass, job by job in queue order (priority, then fair share, then submit order):
//! 1. quota: tenant quota (borrowing within a cohort), class caps;
//! 2. resources: best-fit node(s) and topology-aware GPUs, or a slice on a GPU (all-or-nothing
//!    for gangs across nodes), respecting backfill reservations;
//! 3. otherwise preemption (a class that preempts lower ones, or reclaiming borrowed quota):
//!    victims that lose the least GPU work, the preemptor then waits for them to exit;
//! 4. otherwise a backfill reservation for the first blocked jobs (jobs behind them may start
//!    only if they end before the reserved start), and a pending reason for every job left.
//!
//! Invariant: deterministic (BTreeMap/Vec order, no clock, no RNG); cost O(jobs log nodes).

mod cluster;
mod order;
mod preempt;
mod reason;
mod topology;

#[cfg(test)]
mod testkit;
#[cfg(test)]
mod tests;

pub(crate) use cluster::selects;
pub use reason::PendingReason;

use crate::config::TenantPolicy;
use crate::gang;
use crate::quota::{self, QuotaBlock, QuotaNumbers};
use crate::resources::{job_milli_gpus, spread_shapes, SliceReq, MILLI_PER_GPU};
use crate::state::QueuedJob;
use crate::{Command, Placement, Preemption, State};
use cluster::{Cluster, Reservation};
use corral_types::{format_duration, Job, JobId, NodeGpus, Timestamp};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What one pass decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulingPass {
    /// The clock reading the pass ran with.
    pub now: Timestamp,
    pub placements: Vec<Placement>,
    pub preemptions: Vec<Preemption>,
    /// Every pending job that was not placed, in queue order, with its reason.
    pub pending: Vec<PendingJob>,
    pub stats: PassStats,
}

/// A job left pending, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingJob {
    pub job_id: JobId,
    pub reason: PendingReason,
}

/// Counters of one pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassStats {
    pub considered: usize,
    pub placed: usize,
    pub preempted: usize,
    pub reservations: usize,
    pub preemption_searches: usize,
}

impl SchedulingPass {
    /// The command to propose, or `None` when the pass decided nothing.
    pub fn command(&self) -> Option<Command> {
        if self.placements.is_empty() && self.preemptions.is_empty() {
            return None;
        }
        Some(Command::Schedule { placements: self.placements.clone(), preemptions: self.preemptions.clone() })
    }

    /// Pending reasons by job id.
    pub fn reasons(&self) -> BTreeMap<JobId, &PendingReason> {
        self.pending.iter().map(|p| (p.job_id, &p.reason)).collect()
    }
}

/// Runs one scheduling pass. `now`: the leader's current TSO timestamp (or the last applied one);
/// `unschedulable`: (node, gpu index) pairs that must not get new work (dirty or unhealthy
/// devices, known only to the leader's memory).
pub fn schedule(state: &State, now: Timestamp, unschedulable: &BTreeSet<(String, u32)>) -> SchedulingPass {
    schedule_with_images(state, now, unschedulable, &ImageHints::default())
}

/// [`schedule`], preferring for each job with a registry image, among the nodes that fit, the
/// ones with the fewest of its image's bytes missing from their layer stores (`images`, the
/// leader's memory of what workers hold). Whole-GPU and CPU-only jobs; a GPU slice goes where
/// the slice fits best.
pub fn schedule_with_images(
    state: &State,
    now: Timestamp,
    unschedulable: &BTreeSet<(String, u32)>,
    images: &ImageHints,
) -> SchedulingPass {
    let mut pass = Pass::new(state, now, unschedulable);
    pass.images = images;
    pass.run()
}

/// Nodes of the best-fit order looked at beyond the ones a job needs, for the one holding most
/// of its image: a bounded look, whatever the cluster's size.
const IMAGE_PROBE: usize = 8;

/// What the workers' layer stores hold, as the leader last heard (never replicated): the layers
/// of each image some worker holds, and the layers each node holds. A job's image that no
/// worker holds is missing everywhere alike (no preference).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageHints {
    /// Layers (digest, unpacked bytes) of each image, by every digest that names it (its
    /// manifest's, its index's).
    pub images: BTreeMap<String, Arc<Vec<(String, u64)>>>,
    /// The layer digests each node holds.
    pub nodes: BTreeMap<String, BTreeSet<String>>,
}

impl ImageHints {
    /// Bytes of `image` that `node` lacks; `None` when no worker reported the image.
    pub fn missing(&self, image: &str, node: &str) -> Option<u64> {
        let layers = self.images.get(image)?;
        let held = self.nodes.get(node);
        Some(layers.iter().filter(|(d, _)| !held.is_some_and(|h| h.contains(d))).map(|(_, size)| size).sum())
    }
}

/// Placements of one pass (compatibility wrapper over [`schedule`] at the last applied time).
/// Gang placements across nodes are left out: they need `Command::Schedule`; preemptions too.
pub fn place(state: &State, unschedulable: &BTreeSet<(String, u32)>) -> Vec<Placement> {
    schedule(state, state.last_ts, unschedulable).placements.into_iter().filter(|p| p.more_nodes.is_empty()).collect()
}

/// What one job asks for, resolved for the pass.
#[derive(Debug, Clone)]
pub(crate) struct Demand {
    /// Nodes, and whole GPUs on each (1 for a slice job, 0 for a CPU-only job).
    pub parts: u32,
    pub per_node: u32,
    pub cpu: u64,
    pub mem: u64,
    pub slice: Option<SliceReq>,
    /// When it would end if started now (`None`: no time limit).
    pub end_ms: Option<u64>,
    pub rdma: bool,
    /// Node labels it needs (empty: any node).
    pub selector: Vec<String>,
    /// Whole nodes (`--exclusive`): only idle ones, and nothing else on them afterwards.
    pub exclusive: bool,
    /// Only nodes whose GPUs are of this model.
    pub gpu_type: Option<String>,
    /// The latest moment it may hold a node, started now (`leases::lease_need_ms`): a leased
    /// node whose lease ends earlier does not take it.
    pub lease_need_ms: u64,
}

impl Demand {
    /// `grace_secs`: the job's class's; `guard_secs`: the policy's `lease-guard`.
    pub fn of(q: &QueuedJob, now_ms: u64, grace_secs: u32, guard_secs: u64) -> Demand {
        Demand {
            parts: q.parts,
            per_node: q.per_node,
            cpu: q.cpu,
            mem: q.mem,
            slice: q.slice,
            end_ms: q.time_limit_secs.map(|s| now_ms.saturating_add(s.saturating_mul(1000))),
            rdma: q.rdma,
            selector: q.selector.clone(),
            exclusive: q.exclusive,
            gpu_type: q.gpu_type.clone(),
            lease_need_ms: crate::leases::lease_need_ms(q.time_limit_secs, grace_secs, guard_secs, now_ms),
        }
    }

    /// An `--exclusive` job that asked for no GPUs: it takes every GPU of its idle nodes
    /// (`JobSpec::takes_whole_nodes_gpus`).
    pub fn takes_whole_nodes_gpus(&self) -> bool {
        self.exclusive && self.per_node == 0 && self.slice.is_none()
    }

    /// A job that needs certain nodes (labels, GPU model, idle ones): a failure says nothing
    /// about its shape on other nodes.
    pub fn picky(&self) -> bool {
        !self.selector.is_empty() || self.exclusive || self.gpu_type.is_some()
    }

    /// Whether the job, started now, ends by `t`.
    pub fn ends_by(&self, t: u64) -> bool {
        self.end_ms.is_some_and(|e| e <= t)
    }
}

/// A priority class as the pass uses it.
#[derive(Debug, Clone)]
pub(crate) struct ClassInfo {
    pub value: i64,
    pub preempts_lower: bool,
    pub grace_secs: u32,
    pub billing_milli: u64,
}

/// A tenant's quota use and fair-share standing during the pass.
#[derive(Debug, Clone)]
pub(crate) struct TenantInfo<'s> {
    pub name: &'s str,
    pub shared_name: Arc<str>,
    pub policy: Option<&'s TenantPolicy>,
    pub used: u64,
    pub by_class: BTreeMap<usize, u64>,
    pub cohort: Option<usize>,
    /// Decayed past usage, in weighted milli GPU-equivalents (held on average).
    pub history: f64,
    /// Weighted milli GPU-equivalents held now (grows as the pass places jobs).
    pub held: f64,
    pub weight: f64,
    /// Running jobs, counting the ones this pass placed.
    pub running: u32,
}

impl TenantInfo<'_> {
    pub fn quota(&self) -> Option<u64> {
        self.policy.and_then(|p| p.quota_milli_gpus)
    }
}

/// Quota and fair-share books of the pass, by dense tenant/class/cohort indices.
pub(crate) struct Book<'s> {
    state: &'s State,
    pub classes: Vec<ClassInfo>,
    class_names: Vec<&'s str>,
    class_idx: BTreeMap<&'s str, usize>,
    pub tenants: Vec<TenantInfo<'s>>,
    tenant_idx: BTreeMap<&'s str, usize>,
    /// (used, sum of quotas) per cohort.
    cohorts: Vec<(u64, u64)>,
    cohort_names: Vec<Arc<str>>,
    class_shared: Vec<Arc<str>>,
    /// Shared display names of slice requests (for pending reasons).
    slice_names: BTreeMap<SliceReq, Arc<str>>,
    cohort_idx: BTreeMap<&'s str, usize>,
    now_ms: u64,
}

const UNKNOWN_CLASS: ClassInfo =
    ClassInfo { value: i64::MIN, preempts_lower: false, grace_secs: 0, billing_milli: 1000 };

impl<'s> Book<'s> {
    fn new(state: &'s State, now_ms: u64) -> Book<'s> {
        let config = &state.config;
        let mut book = Book {
            state,
            classes: Vec::new(),
            class_names: Vec::new(),
            class_idx: BTreeMap::new(),
            tenants: Vec::new(),
            tenant_idx: BTreeMap::new(),
            cohorts: Vec::new(),
            cohort_names: Vec::new(),
            class_shared: Vec::new(),
            slice_names: BTreeMap::new(),
            cohort_idx: BTreeMap::new(),
            now_ms,
        };
        for (name, c) in &config.priority_classes {
            book.class_idx.insert(name, book.classes.len());
            book.class_names.push(name);
            book.classes.push(ClassInfo {
                value: c.value,
                preempts_lower: c.preempts_lower,
                grace_secs: c.grace_secs(),
                billing_milli: u64::from(c.billing_multiplier_milli),
            });
        }
        book.class_names.push("");
        book.classes.push(UNKNOWN_CLASS);
        book.class_shared = book.class_names.iter().map(|n| Arc::from(*n)).collect();
        for tenant in config.tenants.iter().chain(config.tenant_policies.keys()) {
            book.tenant_of(tenant);
        }
        // What running jobs hold, and their share of fair-share history.
        let half_life = config.scheduler.usage_half_life_secs.max(1) as f64;
        for job in state.running_jobs() {
            let t = book.tenant_of(&job.spec.tenant);
            let c = book.class_of(&job.spec.priority_class);
            let milli = job_milli_gpus(&job.spec);
            let weighted = (milli * book.classes[c].billing_milli / 1000) as f64;
            let tenant = &mut book.tenants[t];
            tenant.used += milli;
            *tenant.by_class.entry(c).or_default() += milli;
            tenant.held += weighted;
            tenant.running += 1;
            if let Some(start) = job.started_at {
                let age = now_ms.saturating_sub(start.physical_ms()) as f64 / 1000.0;
                tenant.history += weighted * (1.0 - (-age / half_life).exp2());
            }
        }
        for t in 0..book.tenants.len() {
            let tenant = &mut book.tenants[t];
            let past = state.usage.decayed(tenant.name, now_ms, half_life as u64);
            tenant.history += past * std::f64::consts::LN_2 / half_life;
            if let Some(c) = tenant.cohort {
                book.cohorts[c].0 += tenant.used;
            }
        }
        book
    }

    /// Dense index of a tenant (added on first sight).
    pub fn tenant_of(&mut self, name: &'s str) -> usize {
        if let Some(i) = self.tenant_idx.get(name) {
            return *i;
        }
        let policy = self.state.config.tenant_policy(name);
        let cohort = policy.and_then(|p| p.cohort.as_deref()).map(|c| match self.cohort_idx.get(c) {
            Some(i) => *i,
            None => {
                self.cohort_idx.insert(c, self.cohorts.len());
                self.cohorts.push((0, self.state.config.cohort_quota(c)));
                self.cohort_names.push(c.into());
                self.cohorts.len() - 1
            }
        });
        let i = self.tenants.len();
        self.tenant_idx.insert(name, i);
        self.tenants.push(TenantInfo {
            name,
            shared_name: name.into(),
            policy,
            used: 0,
            by_class: BTreeMap::new(),
            cohort,
            history: 0.0,
            held: 0.0,
            weight: f64::from(policy.map(|p| p.fair_share_weight).unwrap_or(1).max(1)),
            running: 0,
        });
        i
    }

    /// Dense index of a class (unknown classes share the lowest one).
    pub fn class_of(&self, name: &str) -> usize {
        self.class_idx.get(name).copied().unwrap_or(self.classes.len() - 1)
    }

    /// Fair-share key: lower goes first.
    pub fn share_key(&self, t: usize) -> f64 {
        let tenant = &self.tenants[t];
        (tenant.history + tenant.held) / tenant.weight
    }

    pub fn numbers(&self, t: usize, c: usize) -> QuotaNumbers {
        let tenant = &self.tenants[t];
        let policy = tenant.policy;
        QuotaNumbers {
            tenant_used: tenant.used,
            tenant_quota: tenant.quota(),
            borrowing_limit: policy.and_then(|p| p.borrowing_limit_milli_gpus),
            cohort: tenant.cohort.map(|i| self.cohorts[i]),
            class: policy
                .filter(|p| !p.class_quotas.is_empty())
                .and_then(|p| p.class_quotas.get(self.class_names[c]))
                .map(|cap| (tenant.by_class.get(&c).copied().unwrap_or(0), *cap)),
        }
    }

    /// The quota reason of a blocked job, sharing the names.
    fn describe(&self, t: usize, c: usize, numbers: &QuotaNumbers, need: u64, limit: quota::Limit) -> QuotaBlock {
        let tenant = &self.tenants[t];
        quota::describe_named(
            numbers,
            need,
            limit,
            || tenant.shared_name.clone(),
            || self.class_shared[c].clone(),
            || tenant.cohort.map(|i| self.cohort_names[i].clone()).unwrap_or_else(|| Arc::from("")),
        )
    }

    /// Books a placement.
    fn charge(&mut self, t: usize, c: usize, milli: u64) {
        let weighted = (milli * self.classes[c].billing_milli / 1000) as f64;
        let tenant = &mut self.tenants[t];
        tenant.used += milli;
        *tenant.by_class.entry(c).or_default() += milli;
        tenant.held += weighted;
        tenant.running += 1;
        if let Some(i) = tenant.cohort {
            self.cohorts[i].0 += milli;
        }
    }

    fn secs_until(&self, t_ms: u64) -> u64 {
        t_ms.saturating_sub(self.now_ms).div_ceil(1000)
    }
}

/// Shapes that found no room in this pass. Free capacity only shrinks during a pass (placements
/// take it, reservations hold it), so a job of the same shape that needs at least as much CPU and
/// memory and runs at least as long cannot fit either: it fails in O(1) instead of searching.
#[derive(Default)]
struct Infeasible {
    /// Shape -> minimal failed (cpu, memory, end, lease need) points.
    points: BTreeMap<Shape, Vec<(u64, u64, u64, u64)>>,
}

/// (nodes, gpus per node, slice).
type Shape = (u32, u32, Option<SliceReq>);

impl Infeasible {
    const MAX_POINTS: usize = 32;

    fn key(d: &Demand) -> Shape {
        (d.parts, d.per_node, d.slice)
    }

    fn point(d: &Demand) -> (u64, u64, u64, u64) {
        (d.cpu, d.mem, d.end_ms.unwrap_or(u64::MAX), d.lease_need_ms)
    }

    fn known(&self, d: &Demand) -> bool {
        // A job that needs certain nodes says nothing about the shape on other nodes.
        if d.picky() {
            return false;
        }
        let (cpu, mem, end, lease) = Infeasible::point(d);
        self.points
            .get(&Infeasible::key(d))
            .is_some_and(|ps| ps.iter().any(|p| p.0 <= cpu && p.1 <= mem && p.2 <= end && p.3 <= lease))
    }

    fn record(&mut self, d: &Demand) {
        if d.picky() {
            return;
        }
        let new = Infeasible::point(d);
        let points = self.points.entry(Infeasible::key(d)).or_default();
        points.retain(|p| !(new.0 <= p.0 && new.1 <= p.1 && new.2 <= p.2 && new.3 <= p.3));
        if points.len() < Infeasible::MAX_POINTS {
            points.push(new);
        }
    }
}

struct Pass<'s> {
    state: &'s State,
    infeasible: Infeasible,
    cluster: Cluster<'s>,
    book: Book<'s>,
    candidates: Option<preempt::Candidates<'s>>,
    victims_taken: BTreeSet<JobId>,
    reservations_left: u32,
    searches_left: u32,
    /// Free rendezvous ports of nodes (by index) that a gang may start on, less the ones this
    /// pass gave (computed when first needed).
    ports_left: BTreeMap<u32, u32>,
    /// Set by `try_place` when the gang fits but none of its nodes has a rendezvous port free.
    port_blocked: Option<PendingReason>,
    /// What the workers' layer stores hold.
    images: &'s ImageHints,
    out: SchedulingPass,
}

/// No layer held anywhere: [`schedule`]'s hints.
static NO_IMAGES: std::sync::LazyLock<ImageHints> = std::sync::LazyLock::new(ImageHints::default);

impl<'s> Pass<'s> {
    fn new(state: &'s State, now: Timestamp, unschedulable: &BTreeSet<(String, u32)>) -> Pass<'s> {
        let now_ms = now.physical_ms();
        let config = &state.config.scheduler;
        Pass {
            state,
            infeasible: Infeasible::default(),
            cluster: Cluster::build(state, now_ms, unschedulable),
            book: Book::new(state, now_ms),
            candidates: None,
            victims_taken: BTreeSet::new(),
            reservations_left: config.backfill_reservations,
            searches_left: config.max_preemptors_per_pass,
            ports_left: BTreeMap::new(),
            images: &NO_IMAGES,
            port_blocked: None,
            out: SchedulingPass { now, ..SchedulingPass::default() },
        }
    }

    fn run(mut self) -> SchedulingPass {
        let state = self.state;
        let mut groups = Vec::with_capacity(state.index.queue.len());
        for ((tenant, class), jobs) in &state.index.queue {
            let t = self.book.tenant_of(tenant);
            let c = self.book.class_of(class);
            groups.push((self.book.classes[c].value, t, c, jobs));
        }
        self.out.pending.reserve(state.pending_count());
        let mut queue = order::Queue::build(groups.into_iter(), &self.book);
        while let Some((t, (c, id, q))) = queue.next(&self.book) {
            self.out.stats.considered += 1;
            if let Err(reason) = self.consider(t, c, id, q) {
                self.out.pending.push(PendingJob { job_id: id, reason });
            }
        }
        self.out.stats.placed = self.out.placements.len();
        self.out.stats.preempted = self.out.preemptions.len();
        self.out
    }

    /// Places a job, or says why not (after trying preemption and a reservation).
    fn consider(&mut self, t: usize, c: usize, id: JobId, q: &QueuedJob) -> Result<(), PendingReason> {
        let tenant = &self.book.tenants[t];
        if let Some(max) = tenant.policy.and_then(|p| p.max_running_jobs).filter(|max| tenant.running >= *max) {
            return Err(PendingReason::JobLimit { tenant: tenant.shared_name.clone(), max });
        }
        // Tasks that spread over nodes: each node count in turn, fewest nodes first; the first
        // stands for the job in preemption, reservation and its pending reason.
        let (grace, guard) = (self.book.classes[c].grace_secs, self.state.config.scheduler.lease_guard_secs);
        let mut shapes = if q.spread { self.spread_demands(id, q, grace, guard) } else { Vec::new() };
        if shapes.is_empty() {
            shapes.push((Demand::of(q, self.cluster.now_ms, grace, guard), q.milli));
        }
        let numbers = self.book.numbers(t, c);
        let quota = quota::check(&numbers, shapes[0].1);
        if !self.cluster.any_up() {
            return Err(PendingReason::NoNodes);
        }
        let mut free_nodes = Vec::new();
        for (i, (shape, shape_need)) in shapes.iter().enumerate() {
            if quota::check(&numbers, *shape_need).is_err() {
                continue;
            }
            match self.try_place(t, c, id, shape, *shape_need) {
                Ok(()) => {
                    self.port_blocked = None;
                    return Ok(());
                }
                Err(nodes) if i == 0 => free_nodes = nodes,
                Err(_) => {}
            }
        }
        let (d, need) = shapes.swap_remove(0);
        if let Some(reason) = self.port_blocked.take() {
            return Err(reason);
        }
        // Waiting for its victims: hold their nodes, do not preempt more.
        if let Some(victims) = self.state.index.preemptors.get(&id) {
            return Err(self.hold_for_victims(id, &d, victims));
        }
        let preemptor_class = &self.book.classes[c];
        let tenant = &self.book.tenants[t];
        let reclaims = tenant.cohort.is_some() && tenant.quota().is_some_and(|q| tenant.used + need <= q);
        if (preemptor_class.preempts_lower || reclaims) && self.searches_left > 0 {
            self.searches_left -= 1;
            self.out.stats.preemption_searches += 1;
            if let Some(reason) = self.try_preempt(t, c, id, &d, need, free_nodes) {
                return Err(reason);
            }
        }
        if let Err(limit) = quota {
            return Err(PendingReason::Quota(self.book.describe(t, c, &numbers, need, limit)));
        }
        // An exclusive job waits for idle nodes, which GPU release times do not tell.
        if self.reservations_left > 0 && d.slice.is_none() && d.per_node > 0 && !d.exclusive {
            if let Some(start_ms) = self.reserve(id, &d) {
                self.reservations_left -= 1;
                self.out.stats.reservations += 1;
                let starts_in_secs = Some(self.book.secs_until(start_ms));
                return Err(self.explain(&d, starts_in_secs));
            }
        }
        Err(self.explain(&d, None))
    }

    /// The demands of a job whose tasks spread over nodes, one per node count the registered
    /// nodes allow (`spread_shapes`, at most `MAX_SPREAD_SHAPES`), fewest nodes first, with
    /// the quota each needs.
    fn spread_demands(&self, id: JobId, q: &QueuedJob, grace_secs: u32, lease_guard_secs: u64) -> Vec<(Demand, u64)> {
        let Some(job) = self.state.jobs.get(&id) else { return Vec::new() };
        let caps = &self.state.index.caps;
        spread_shapes(&job.spec, caps.largest_gpus(), |g| caps.nodes_with(g))
            .into_iter()
            .map(|nodes| {
                let (per_node, cpu, mem) = job.spec.spread_shape(nodes);
                let mut d = Demand::of(q, self.cluster.now_ms, grace_secs, lease_guard_secs);
                (d.parts, d.per_node, d.cpu, d.mem) = (nodes, per_node, u64::from(cpu), mem);
                (d, u64::from(per_node) * u64::from(nodes) * MILLI_PER_GPU)
            })
            .collect()
    }

    /// Places the job if it fits now; otherwise returns the nodes that fit (fewer than needed).
    fn try_place(&mut self, t: usize, c: usize, job_id: JobId, d: &Demand, mut need: u64) -> Result<(), Vec<u32>> {
        if self.infeasible.known(d) {
            return Err(Vec::new());
        }
        let placement = if d.slice.is_some() {
            let Some(spot) = self.cluster.find_slice(d) else {
                self.infeasible.record(d);
                return Err(Vec::new());
            };
            let spec_slice = self.state.jobs.get(&job_id).and_then(|j| j.spec.gpu_slice.as_ref());
            let Some(slice) = spot.fit.assignment(spec_slice) else { return Err(Vec::new()) };
            let gpu = self.cluster.take_slice(&spot, d);
            let node = self.cluster.nodes[spot.node as usize].name.to_string();
            Placement { job_id, node, gpus: vec![gpu], more_nodes: Vec::new(), slice: Some(slice) }
        } else {
            let image = self.state.jobs.get(&job_id).and_then(|j| j.spec.image_digest.as_deref());
            let image = image.filter(|i| self.images.images.contains_key(*i));
            let want = d.parts as usize + if image.is_some() { IMAGE_PROBE } else { 0 };
            let mut nodes = self.cluster.find_nodes(d, want);
            if nodes.len() < d.parts as usize {
                self.infeasible.record(d);
                return Err(nodes);
            }
            if let Some(image) = image {
                // Fewest bytes missing first; best fit among equals (the sort is stable).
                let cluster = &self.cluster;
                nodes.sort_by_cached_key(|n| self.images.missing(image, cluster.nodes[*n as usize].name));
            }
            nodes.truncate(d.parts as usize);
            if d.takes_whole_nodes_gpus() {
                // Every GPU of its (idle) nodes counts against its quota.
                let gpus: u64 = nodes.iter().map(|n| u64::from(self.cluster.nodes[*n as usize].free)).sum();
                need = gpus * MILLI_PER_GPU;
                if quota::check(&self.book.numbers(t, c), need).is_err() {
                    return Err(Vec::new());
                }
            }
            if d.parts > 1 && !self.first_with_port(&mut nodes) {
                let names: Vec<&str> = nodes.iter().map(|n| self.cluster.nodes[*n as usize].name).collect();
                self.port_blocked = Some(PendingReason::RendezvousPorts { nodes: names.join(", ").into() });
                return Err(Vec::new());
            }
            let mut parts: Vec<NodeGpus> = nodes
                .iter()
                .map(|n| {
                    let gpus = self.cluster.take_whole(*n, d);
                    NodeGpus { node: self.cluster.nodes[*n as usize].name.to_string(), gpus }
                })
                .collect();
            let first = parts.remove(0);
            Placement { job_id, node: first.node, gpus: first.gpus, more_nodes: parts, slice: None }
        };
        self.book.charge(t, c, need);
        self.out.placements.push(placement);
        Ok(())
    }

    /// Puts first a node of the gang's that has a rendezvous port free (apply gives the gang
    /// the lowest one of its first node) and counts the port as taken; false when none has one.
    fn first_with_port(&mut self, nodes: &mut [u32]) -> bool {
        let (state, cluster) = (self.state, &self.cluster);
        for i in 0..nodes.len() {
            let n = nodes[i];
            let left = self
                .ports_left
                .entry(n)
                .or_insert_with(|| gang::free_port_count(state, cluster.nodes[n as usize].name));
            if *left > 0 {
                *left -= 1;
                nodes[..=i].rotate_right(1);
                return true;
            }
        }
        false
    }

    fn try_preempt(
        &mut self,
        t: usize,
        c: usize,
        id: JobId,
        d: &Demand,
        need: u64,
        free_nodes: Vec<u32>,
    ) -> Option<PendingReason> {
        if self.candidates.is_none() {
            self.candidates = Some(preempt::Candidates::build(self.state, &mut self.book, &self.cluster));
        }
        let cands = self.candidates.as_ref()?;
        // Resources are there (only quota blocked): find them without preempting for room.
        let free_nodes = if d.slice.is_some() {
            self.cluster.find_slice(d).map(|s| vec![s.node]).unwrap_or_default()
        } else if free_nodes.is_empty() {
            self.cluster.find_nodes(d, d.parts as usize)
        } else {
            free_nodes
        };
        let preemptor = preempt::Preemptor { id, tenant: t, class: c, need, demand: d };
        let plan = preempt::plan(&self.book, cands, &self.cluster, &preemptor, free_nodes, &self.victims_taken)?;
        if plan.victims.is_empty() {
            return None;
        }
        let mut grace_end = self.cluster.now_ms;
        for i in &plan.victims {
            let victim = &cands.list[*i];
            let grace_secs = self.book.classes[victim.class].grace_secs;
            grace_end = grace_end.max(self.cluster.now_ms + u64::from(grace_secs) * 1000);
            self.victims_taken.insert(victim.job.id);
            self.out.preemptions.push(Preemption { job_id: victim.job.id, by: id, grace_secs });
        }
        let victims: Vec<&Job> = plan.victims.iter().map(|i| cands.list[*i].job).collect();
        self.hold_nodes(id, d, &plan.nodes, &victims, grace_end);
        Some(PendingReason::Preempting {
            victims: plan.victims.len() as u32,
            grace_left_secs: self.book.secs_until(grace_end),
        })
    }

    /// Reserves the nodes a preemptor will use once its victims are gone.
    fn hold_nodes(&mut self, job: JobId, d: &Demand, nodes: &[u32], victims: &[&Job], start_ms: u64) {
        for &n in nodes {
            let node = &self.cluster.nodes[n as usize];
            if node.reservation.is_some() || !node.up() {
                continue;
            }
            let (mut gpus, mut cpu, mut mem) = (node.free, node.cpu_free, node.mem_free);
            for v in victims {
                if let Some(held) = v.allocation.as_ref().and_then(|a| a.gpus_on(node.name)) {
                    if v.spec.gpu_slice.is_none() {
                        gpus += held.len() as u32;
                    }
                    cpu += u64::from(v.spec.cpu_millis);
                    mem += v.spec.memory_bytes;
                }
            }
            let reservation = Reservation {
                job,
                start_ms,
                gpus: gpus.saturating_sub(d.per_node),
                cpu: cpu.saturating_sub(d.cpu),
                mem: mem.saturating_sub(d.mem),
                for_preemption: true,
            };
            self.cluster.reserve(n, reservation);
        }
    }

    fn hold_for_victims(&mut self, job: JobId, d: &Demand, victims: &BTreeSet<JobId>) -> PendingReason {
        let victims: Vec<&Job> = victims.iter().filter_map(|v| self.state.jobs.get(v)).collect();
        let grace_end = victims
            .iter()
            .filter_map(|v| v.preemption.as_ref())
            .map(|p| p.at.physical_ms() + u64::from(p.grace_secs) * 1000)
            .max()
            .unwrap_or(self.cluster.now_ms);
        let mut nodes: Vec<u32> = Vec::new();
        for v in &victims {
            for (name, _) in v.allocation.iter().flat_map(|a| a.parts()) {
                if let Some(n) = self.cluster.by_name.get(name) {
                    if !nodes.contains(n) {
                        nodes.push(*n);
                    }
                }
            }
        }
        self.hold_nodes(job, d, &nodes, &victims, grace_end.max(self.cluster.now_ms));
        PendingReason::Preempting { victims: victims.len() as u32, grace_left_secs: self.book.secs_until(grace_end) }
    }

    /// Backfill reservation: the nodes where the job can start earliest (from the time limits of
    /// what runs there), held from that time. Returns the reserved start.
    fn reserve(&mut self, job: JobId, d: &Demand) -> Option<u64> {
        let now_ms = self.cluster.now_ms;
        let mut options: Vec<(u64, u32)> = self
            .cluster
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.up() && n.reservation.is_none() && n.suits(d))
            .filter_map(|(i, n)| n.available_at(d.per_node, d.cpu, d.mem, now_ms).map(|(at, _)| (at, i as u32)))
            .collect();
        if options.len() < d.parts as usize {
            return None;
        }
        options.sort_unstable();
        options.truncate(d.parts as usize);
        let start_ms = options.iter().map(|(at, _)| *at).max()?;
        for (_, n) in options {
            let have = self.cluster.nodes[n as usize].free_at(start_ms);
            let reservation = Reservation {
                job,
                start_ms,
                gpus: have.gpus.saturating_sub(d.per_node),
                cpu: have.cpu.saturating_sub(d.cpu),
                mem: have.mem.saturating_sub(d.mem),
                for_preemption: false,
            };
            self.cluster.reserve(n, reservation);
        }
        Some(start_ms)
    }

    /// Why a job that needs nodes of a kind (idle ones, a GPU model) is waiting: how many of
    /// them have room now.
    fn explain_kind(&self, d: &Demand, k: u32, starts_in_secs: Option<u64>) -> PendingReason {
        let available = self.cluster.count_free_nodes(d, k, d.parts as usize);
        let kind = match (&d.gpu_type, d.exclusive) {
            (Some(t), true) => format!("idle node(s) with {t} gpus"),
            (Some(t), false) => format!("node(s) with {t} gpus"),
            (None, _) => "idle node(s) (--exclusive)".into(),
        };
        let gpus = if k == 1 { "1 gpu".to_string() } else { format!("{k} gpus") };
        let mut what = format!("needs {} {kind}, {gpus} free on each; {available} have them now", d.parts);
        if let Some(s) = starts_in_secs {
            what.push_str(&format!("; reserved to start in {}", format_duration(std::time::Duration::from_secs(s))));
        }
        PendingReason::NodeKind { what: what.into() }
    }

    /// Why a job that fits no quota-free room is waiting.
    fn explain(&mut self, d: &Demand, starts_in_secs: Option<u64>) -> PendingReason {
        let k = if d.slice.is_some() { 1 } else { d.per_node };
        if starts_in_secs.is_none() {
            // It would fit a leased node now, but would outlast the lease.
            if let Some(node) = self.cluster.lease_blocked(d, k) {
                return PendingReason::Lease { node: node.into() };
            }
        }
        if starts_in_secs.is_none() && d.parts == 1 {
            // Free resources it would fit are held: for a job that starts later (it could use
            // them with a shorter time limit), or for a preemptor waiting for its victims.
            let mut priority = None;
            for &(_, n) in self.cluster.reserved_by_free.range((k, 0)..) {
                let node = &self.cluster.nodes[n as usize];
                let Some(r) = node.reservation else { continue };
                if node.cpu_free < d.cpu || node.mem_free < d.mem {
                    continue;
                }
                if node.free >= k && !r.for_preemption {
                    let starts_in_secs = self.book.secs_until(r.start_ms);
                    return PendingReason::Backfill { reserved_for: r.job, starts_in_secs };
                }
                if r.for_preemption && node.free >= k && priority.is_none() {
                    priority = Some(PendingReason::Priority { waiting_for: r.job });
                }
            }
            if let Some(reason) = priority {
                return reason;
            }
        }
        if let Some(slice) = d.slice {
            let name = self.book.slice_names.entry(slice).or_insert_with(|| slice.to_string().into());
            return PendingReason::Slice { slice: name.clone() };
        }
        if d.exclusive || d.gpu_type.is_some() {
            return self.explain_kind(d, k, starts_in_secs);
        }
        let largest_free = self.cluster.largest_free();
        if d.parts > 1 {
            let available = self.cluster.count_free_nodes(d, k, d.parts as usize) as u32;
            return PendingReason::Gang { nodes: d.parts, gpus_per_node: d.per_node, available, starts_in_secs };
        }
        if largest_free >= d.per_node && starts_in_secs.is_none() {
            return PendingReason::CpuMemory;
        }
        PendingReason::Gpus { needed: d.per_node, largest_free, starts_in_secs }
    }
}
