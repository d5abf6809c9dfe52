//! Property: whatever sequence of submits (arrays, dependencies, held jobs among them),
//! scheduling passes, exits, preemptions, node losses, drains and cordons, policy changes, job
//! control (hold, release, requeue, update, cancels of tasks), compactions that move finished
//! jobs to the history, and deliberately wrong proposals goes through apply(), no GPU, MIG or MPS slice, node CPU/memory or quota is ever
//! over-committed, no job starts before its dependencies are met, no array has more unfinished
//! tasks than its window nor two tasks of one index (whatever index list, valid or not, it was
//! submitted with), a tenant's pending count is its pending jobs plus the tasks its arrays have
//! yet to create and a submit never takes it above `max-pending-jobs`, a run is billed once (in
//! contiguous pieces across price changes), the derived indexes match a rebuild, passes are
//! deterministic, and only terminal jobs (an array with all its tasks) leave the hot state,
//! never one a live job still waits on.

use corral_core::{
    job_milli_gpus, schedule, ClusterConfig, Command, JobUpdate, Placement, Preemption, Request, State, TenantPolicy,
};
use corral_types::{
    ArrayRange, ArraySpec, Dependency, DependencyKind, GpuDevice, GpuSlice, JobExitReport, JobId, JobSpec, JobState,
    NodeGpus, NodeMode, NodeSpec, NodeState, SchedOptions, SliceAssignment, Timestamp,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const TENANTS: [&str; 3] = ["default", "team-a", "team-b"];
/// team-b's `max-pending-jobs`.
const MAX_PENDING_B: u32 = 8;
const CLASSES: [&str; 3] = ["preemptible", "normal", "gpu-high-priority"];

#[derive(Debug, Clone)]
enum Op {
    Submit {
        tenant: usize,
        class: usize,
        shape: usize,
        time_limit: Option<u64>,
        no_requeue: bool,
        /// Bits: 1 an array (`array`), 2 held, 4 singleton; `dep`: a dependency on an earlier
        /// job (kind, pick).
        extra: u8,
        dep: Option<(u8, usize)>,
        /// The index list as written, (first, more, step) each, overlapping or out of order at
        /// times, and the `%N`.
        array: (Vec<(u32, u32, u32)>, Option<u32>),
    },
    /// Cordon (1), drain (2, with a deadline in seconds) or resume (0) a node.
    NodeMode {
        node: usize,
        mode: u8,
        deadline: Option<u64>,
    },
    EvictDrained {
        node: usize,
    },
    /// Set a node's lease end this many seconds ahead (`None`: clear it), or act on it.
    Lease {
        node: usize,
        ahead: Option<u64>,
    },
    EndLease {
        node: usize,
    },
    RemoveNode {
        node: usize,
    },
    Hold {
        pick: usize,
        hold: bool,
    },
    Requeue {
        pick: usize,
    },
    Update {
        pick: usize,
        time: Option<u64>,
        class: Option<usize>,
        admin: bool,
    },
    /// Compact with cutoffs this many seconds back (the request-id window twice as long).
    Compact {
        back_secs: u64,
    },
    CancelAny {
        pick: usize,
        index: Option<u32>,
    },
    /// A new policy version: another RTX 5090 price and team-a fair-share weight. (Quotas stay:
    /// a lowered quota rightly leaves running jobs above it, which the checks below would flag.)
    Policy {
        price: u64,
        weight: u32,
    },
    Schedule,
    Finish {
        pick: usize,
        code: i32,
    },
    ExitPreempted {
        pick: usize,
    },
    /// The worker reports a run that never started (stopped before launch) or that it killed
    /// after losing the coordinators (fenced), with its monotonic run time.
    ExitEarly {
        pick: usize,
        never_started: bool,
        run_secs: u64,
    },
    Cancel {
        pick: usize,
    },
    NodeDown {
        node: usize,
    },
    Register {
        node: usize,
    },
    Advance {
        secs: u64,
    },
    RawPlace {
        pick: usize,
        node: usize,
        gpus: u8,
        slice: Option<(u32, u32)>,
    },
    RawPreempt {
        victim: usize,
        by: usize,
        grace: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (
            (0..3usize, 0..3usize, 0..12usize, proptest::option::of(60..7200u64), proptest::bool::weighted(0.2)),
            (any::<u8>(), proptest::option::weighted(0.3, (0..3u8, any::<usize>()))),
            (
                proptest::collection::vec((0..12u32, 0..4u32, 1..3u32), 1..4),
                proptest::option::of(prop_oneof![1..5u32, Just(corral_types::MAX_ARRAY_WINDOW + 1)])
            )
        )
            .prop_map(|((tenant, class, shape, time_limit, no_requeue), (extra, dep), array)| {
                // Arrays, held jobs and singletons are the rarer cases.
                let extra = if extra % 3 == 0 { extra } else { 0 };
                Op::Submit { tenant, class, shape, time_limit, no_requeue, extra, dep, array }
            }),
        1 => (0..3usize, 0..3u8, proptest::option::of(0..120u64))
            .prop_map(|(node, mode, deadline)| Op::NodeMode { node, mode, deadline }),
        1 => (0..3usize).prop_map(|node| Op::EvictDrained { node }),
        1 => (0..3usize, proptest::option::of(0..7200u64)).prop_map(|(node, ahead)| Op::Lease { node, ahead }),
        1 => (0..3usize).prop_map(|node| Op::EndLease { node }),
        1 => (0..3usize).prop_map(|node| Op::RemoveNode { node }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, hold)| Op::Hold { pick, hold }),
        1 => any::<usize>().prop_map(|pick| Op::Requeue { pick }),
        1 => (any::<usize>(), proptest::option::of(60..7200u64), proptest::option::of(0..3usize), any::<bool>())
            .prop_map(|(pick, time, class, admin)| Op::Update { pick, time, class, admin }),
        1 => (any::<usize>(), proptest::option::of(0..4u32)).prop_map(|(pick, index)| Op::CancelAny { pick, index }),
        1 => (prop_oneof![Just(890_000u64), Just(1_780_000u64)], 1..4u32)
            .prop_map(|(price, weight)| Op::Policy { price, weight }),
        4 => Just(Op::Schedule),
        2 => (0..300u64).prop_map(|back_secs| Op::Compact { back_secs }),
        3 => (any::<usize>(), -1..2i32).prop_map(|(pick, code)| Op::Finish { pick, code }),
        2 => any::<usize>().prop_map(|pick| Op::ExitPreempted { pick }),
        2 => (any::<usize>(), any::<bool>(), 0..7200u64)
            .prop_map(|(pick, never_started, run_secs)| Op::ExitEarly { pick, never_started, run_secs }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => (0..3usize).prop_map(|node| Op::NodeDown { node }),
        1 => (0..3usize).prop_map(|node| Op::Register { node }),
        2 => (1..3600u64).prop_map(|secs| Op::Advance { secs }),
        3 => (any::<usize>(), 0..3usize, any::<u8>(), proptest::option::of((0..8u32, 1..101u32)))
            .prop_map(|(pick, node, gpus, slice)| Op::RawPlace { pick, node, gpus, slice }),
        1 => (any::<usize>(), any::<usize>(), 0..60u32).prop_map(|(victim, by, grace)| Op::RawPreempt { victim, by, grace }),
    ]
}

fn node_spec(i: usize) -> NodeSpec {
    // a: 4 RTX 5090 (MPS), b: 4 H100 with topology (MIG), c: 2 RTX 5090.
    let (name, count, model, mem, mig) =
        [("a", 4, "RTX 5090", 32768, false), ("b", 4, "H100", 81559, true), ("c", 2, "RTX 5090", 32768, false)][i];
    NodeSpec {
        name: name.into(),
        address: "127.0.0.1:1".into(),
        gpus: (0..count)
            .map(|g| GpuDevice {
                index: g,
                uuid: format!("GPU-{name}-{g}"),
                model: model.into(),
                memory_mib: mem,
                numa_node: Some(g / 2),
                pci_switch: Some(format!("{name}-{}", g / 2)),
                rdma_nic: g.is_multiple_of(2).then(|| "mlx5_0".to_string()),
                mig_capable: mig,
            })
            .collect(),
        cpu_millis: 8_000,
        memory_bytes: 32 << 30,
        labels: vec![],
        rendezvous_ports: None,
        lease_end: None,
    }
}

fn spec(tenant: usize, class: usize, shape: usize, time_limit: Option<u64>, no_requeue: bool) -> JobSpec {
    let (gpus, slice, per_node) = match shape {
        0 => (0, None, None),
        1 | 2 => (1, None, None),
        3 => (2, None, None),
        4 => (4, None, None),
        5 => (4, None, Some(2)),
        6 => (0, Some("mig:1g.10gb"), None),
        7 => (0, Some("mig:3g.40gb"), None),
        8 => (0, Some("mig:7g.80gb"), None),
        9 => (0, Some("mps:30"), None),
        10 => (0, Some("mps:50:20GiB"), None),
        _ => (0, Some("mps:25:4GiB"), None),
    };
    JobSpec {
        name: "p".into(),
        tenant: TENANTS[tenant].into(),
        priority_class: CLASSES[class].into(),
        gpus,
        gpu_slice: slice.map(|s| GpuSlice::parse(s).unwrap()),
        cpu_millis: 1000 + 500 * (shape as u32 % 3),
        memory_bytes: (1 + shape as u64 % 4) << 30,
        time_limit_secs: time_limit,
        image: None,
        command: vec!["true".into()].into(),
        env: Default::default(),
        sched: SchedOptions {
            gpus_per_node: per_node,
            rdma: shape == 3,
            no_requeue,
            checkpoint_signal: None,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn config() -> ClusterConfig {
    let mut c = ClusterConfig::dev_defaults();
    c.tenant_policies.get_mut("team-a").unwrap().class_quotas.insert("gpu-high-priority".into(), 2000);
    c.tenant_policies.get_mut("team-b").unwrap().borrowing_limit_milli_gpus = Some(2000);
    c.tenant_policies
        .insert("default".into(), TenantPolicy { quota_milli_gpus: Some(6000), ..TenantPolicy::default() });
    c.tenant_policies.get_mut("team-b").unwrap().max_pending_jobs = Some(MAX_PENDING_B);
    c.scheduler.backfill_reservations = 2;
    c.scheduler.max_preemptors_per_pass = 4;
    c.scheduler.usage_half_life_secs = 3600;
    c
}

struct Sim {
    state: State,
    secs: u64,
    seq: u64,
    submitted: u64,
    /// Jobs compactions moved out of the hot state (what the store keeps as history).
    archive: BTreeMap<JobId, corral_types::Job>,
}

impl Sim {
    fn apply(&mut self, command: Command) {
        self.seq += 1;
        let ts = Timestamp::compose(self.secs * 1000, self.seq);
        // Refusals are fine (that is the point of the wrong proposals); panics are not.
        let (_, touched) = self.state.apply_tracked(&Request { ts, command });
        // No run placed now outlasts the lease of a node it holds (plus its grace).
        for job in touched.jobs.iter().filter_map(|id| self.state.jobs.get(id)) {
            let Some(alloc) = job.allocation.as_ref().filter(|_| job.admitted_at == Some(ts)) else { continue };
            for (node, _) in alloc.parts() {
                let refusal = self.state.lease_refusal(&job.spec, node, ts);
                assert!(refusal.is_none(), "job {} placed past a lease: {refusal:?}", job.id);
            }
        }
        for job in touched.archived {
            assert!(job.state.is_terminal(), "job {} left the hot state unfinished", job.id);
            assert!(self.archive.insert(job.id, job).is_none(), "a job was archived twice");
        }
    }

    fn pick(&self, state: JobState, pick: usize, filter: impl Fn(&corral_types::Job) -> bool) -> Option<JobId> {
        // An array's own record is not a run: its tasks are (control commands reach arrays
        // through `CancelAny`).
        let ids: Vec<JobId> = self
            .state
            .jobs
            .values()
            .filter(|j| j.state == state && (state == JobState::Pending || !j.is_array()) && filter(j))
            .map(|j| j.id)
            .collect();
        (!ids.is_empty()).then(|| ids[pick % ids.len()])
    }

    /// The node of one part of a running job that has not ended yet (a gang ends part by part).
    fn live_part(&self, id: JobId, pick: usize) -> String {
        let alloc = self.state.jobs[&id].allocation.as_ref().expect("running");
        let live: Vec<&str> = alloc.parts().map(|(n, _)| n).filter(|n| !alloc.part_ended(n)).collect();
        live.get((pick / 7) % live.len().max(1)).map(|n| n.to_string()).unwrap_or_default()
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Submit { tenant, class, shape, time_limit, no_requeue, extra, dep, array } => {
                self.submitted += 1;
                let mut spec = spec(*tenant, *class, *shape, *time_limit, *no_requeue);
                if extra & 1 != 0 {
                    let ranges = array
                        .0
                        .iter()
                        .map(|&(first, more, step)| ArrayRange { first, last: first + more, step })
                        .collect();
                    spec.array = Some(ArraySpec { ranges, max_running: array.1 });
                }
                spec.sched.hold = extra & 2 != 0;
                spec.sched.singleton = extra & 4 != 0;
                if let Some((kind, pick)) = dep {
                    let ids: Vec<JobId> = self.state.jobs.keys().copied().collect();
                    if !ids.is_empty() {
                        let kind = [DependencyKind::AfterOk, DependencyKind::AfterAny, DependencyKind::AfterNotOk]
                            [*kind as usize % 3];
                        spec.sched.dependencies = vec![Dependency { kind, job_id: ids[pick % ids.len()] }];
                    }
                }
                let tenant = spec.tenant.clone();
                let before = self.state.pending_count_of(&tenant);
                self.apply(Command::SubmitJob { request_id: format!("r{}", self.submitted), spec });
                let after = self.state.pending_count_of(&tenant);
                if tenant == "team-b" && after > before {
                    assert!(after <= u64::from(MAX_PENDING_B), "a submit took team-b to {after} pending jobs");
                }
            }
            Op::NodeMode { node, mode, deadline } => {
                let mode = [NodeMode::Active, NodeMode::Cordoned, NodeMode::Draining][*mode as usize % 3];
                let drain_deadline = deadline.map(|d| Timestamp::compose((self.secs + d) * 1000, 0));
                let node = node_spec(*node).name;
                self.apply(Command::SetNodeMode { node, mode, reason: "prop".into(), drain_deadline });
            }
            Op::EvictDrained { node } => self.apply(Command::EvictDrainedJobs { node: node_spec(*node).name }),
            Op::Lease { node, ahead } => {
                let lease_end = ahead.map(|a| Timestamp::compose((self.secs + a) * 1000, 0));
                self.apply(Command::SetNodeLease { node: node_spec(*node).name, lease_end });
            }
            Op::EndLease { node } => self.apply(Command::EndLease { node: node_spec(*node).name }),
            Op::RemoveNode { node } => {
                self.apply(Command::RemoveNode { node: node_spec(*node).name, revoke_certificates: true })
            }
            Op::Hold { pick, hold } => {
                if let Some(id) = self.pick(JobState::Pending, *pick, |_| true) {
                    self.apply(Command::HoldJob { job_id: id, hold: *hold });
                }
            }
            Op::Requeue { pick } => {
                if let Some(id) = self.pick(JobState::Running, *pick, |_| true) {
                    self.apply(Command::RequeueJob { job_id: id });
                }
            }
            Op::Update { pick, time, class, admin } => {
                if let Some(id) = self.pick(JobState::Pending, *pick, |_| true) {
                    let update = JobUpdate {
                        time_limit_secs: *time,
                        priority_class: class.map(|c| CLASSES[c].to_string()),
                        ..Default::default()
                    };
                    self.apply(Command::UpdateJob { job_id: id, update, admin: *admin });
                }
            }
            Op::CancelAny { pick, index } => {
                let ids: Vec<JobId> = self.state.live_jobs().map(|j| j.id).collect();
                if ids.is_empty() {
                    return;
                }
                let id = ids[pick % ids.len()];
                match index {
                    Some(index) if self.state.jobs[&id].is_array() => {
                        self.apply(Command::CancelArrayTask { array: id, index: *index, reason: "prop".into() })
                    }
                    _ => self.apply(Command::CancelJob { job_id: id, reason: String::new() }),
                }
            }
            Op::Policy { price, weight } => {
                let mut c = config();
                c.gpu_prices.insert("RTX 5090".into(), *price);
                c.tenant_policies.get_mut("team-a").unwrap().fair_share_weight = *weight;
                self.apply(Command::ApplyPolicy { config: c, by: "prop".into(), force: false });
            }
            Op::Compact { back_secs } => {
                let at = |back: u64| Timestamp::compose(self.secs.saturating_sub(back) * 1000, 0);
                let cutoffs = corral_core::CompactCutoffs {
                    archive_before: at(*back_secs),
                    request_ids_before: at(back_secs * 2),
                    jobs_before: None,
                    segments_before: None,
                    max_finished_bytes: None,
                };
                self.apply(Command::Compact(cutoffs));
            }
            Op::Schedule => {
                let now = Timestamp::compose(self.secs * 1000, self.seq);
                let unusable = BTreeSet::from([("c".to_string(), 1)]);
                let pass = schedule(&self.state, now, &unusable);
                assert_eq!(pass, schedule(&self.state, now, &unusable), "a pass is deterministic");
                // Held jobs, jobs waiting on a dependency and arrays (their tasks are queued) are
                // not the scheduler's.
                let pending: BTreeSet<JobId> = self
                    .state
                    .pending_jobs()
                    .filter(|j| !j.held && j.waiting_on.is_empty() && !j.is_array())
                    .map(|j| j.id)
                    .collect();
                let decided: BTreeSet<JobId> =
                    pass.placements.iter().map(|p| p.job_id).chain(pass.pending.iter().map(|p| p.job_id)).collect();
                assert_eq!(decided, pending, "every pending job is placed or has a reason");
                if let Some(command) = pass.command() {
                    self.apply(command);
                }
                let placed: Vec<(JobId, u64)> = self
                    .state
                    .running_jobs()
                    .filter(|j| j.started_at.is_none())
                    .map(|j| (j.id, j.allocation.as_ref().unwrap().epoch))
                    .collect();
                for (job_id, epoch) in placed {
                    self.apply(Command::JobStarted { job_id, epoch });
                }
            }
            Op::Finish { pick, code } => {
                if let Some(id) = self.pick(JobState::Running, *pick, |_| true) {
                    let epoch = self.state.jobs[&id].allocation.as_ref().unwrap().epoch;
                    self.apply(Command::JobStarted { job_id: id, epoch });
                    let report = JobExitReport { exit_code: Some(*code), run_time_ms: 1_500, ..Default::default() };
                    let node = self.live_part(id, *pick);
                    self.apply(Command::JobFinished { job_id: id, epoch, node, report });
                }
            }
            Op::ExitPreempted { pick } => {
                if let Some(id) = self.pick(JobState::Running, *pick, |j| j.preemption.is_some()) {
                    let epoch = self.state.jobs[&id].allocation.as_ref().unwrap().epoch;
                    let report = JobExitReport { signal: Some(15), ..Default::default() };
                    let node = self.live_part(id, *pick);
                    self.apply(Command::JobFinished { job_id: id, epoch, node, report });
                }
            }
            Op::ExitEarly { pick, never_started, run_secs } => {
                if let Some(id) = self.pick(JobState::Running, *pick, |_| true) {
                    let epoch = self.state.jobs[&id].allocation.as_ref().unwrap().epoch;
                    let report = JobExitReport {
                        never_started: *never_started,
                        fenced: !*never_started,
                        signal: (!*never_started).then_some(9),
                        run_time_ms: if *never_started { 0 } else { run_secs * 1000 },
                        ..Default::default()
                    };
                    let node = self.live_part(id, *pick);
                    self.apply(Command::JobFinished { job_id: id, epoch, node, report });
                }
            }
            Op::Cancel { pick } => {
                if let Some(id) = self.pick(JobState::Running, *pick, |_| true) {
                    self.apply(Command::CancelJob { job_id: id, reason: String::new() });
                }
            }
            Op::NodeDown { node } => {
                let name = node_spec(*node).name;
                self.apply(Command::SetNodeState { node: name, state: NodeState::Down, reason: String::new() });
            }
            Op::Register { node } => self.apply(Command::RegisterNode { spec: node_spec(*node) }),
            Op::Advance { secs } => self.secs += secs,
            Op::RawPlace { pick, node, gpus, slice } => {
                let Some(id) = self.pick(JobState::Pending, *pick, |_| true) else { return };
                let spec = node_spec(*node);
                let indices: Vec<u32> = (0..8).filter(|b| gpus & (1 << b) != 0).collect();
                let slice = slice.map(|(a, b)| {
                    if a < 4 {
                        SliceAssignment::Mig {
                            profile: ["1g.10gb", "3g.40gb", "7g.80gb", "2g.20gb"][a as usize].into(),
                            start: b % 8,
                            memory_slices: [1, 4, 8, 2][a as usize],
                            compute_slices: [1, 3, 7, 2][a as usize],
                        }
                    } else {
                        SliceAssignment::Mps { thread_percent: b, memory_mib: u64::from(b) * 300 }
                    }
                });
                // Sometimes a gang-shaped proposal over two nodes.
                let more_nodes = if gpus & 0x80 != 0 {
                    vec![NodeGpus { node: node_spec((node + 1) % 3).name, gpus: indices.clone() }]
                } else {
                    vec![]
                };
                let placement = Placement { job_id: id, node: spec.name, gpus: indices, more_nodes, slice };
                self.apply(Command::Schedule { placements: vec![placement], preemptions: vec![] });
            }
            Op::RawPreempt { victim, by, grace } => {
                let (Some(v), Some(b)) =
                    (self.pick(JobState::Running, *victim, |_| true), self.pick(JobState::Pending, *by, |_| true))
                else {
                    return;
                };
                let preemptions = vec![Preemption { job_id: v, by: b, grace_secs: *grace }];
                self.apply(Command::Schedule { placements: vec![], preemptions });
            }
        }
    }
}

/// Checks every capacity and quota invariant from the public state and the archived jobs.
fn check_invariants(state: &State, archive: &BTreeMap<JobId, corral_types::Job>) {
    let find = |id: &JobId| state.jobs.get(id).or_else(|| archive.get(id)).expect("a job is hot or archived");
    for id in archive.keys() {
        assert!(!state.jobs.contains_key(id), "job {id} is both hot and archived");
    }
    for waiter in state.jobs.values() {
        for target in &waiter.waiting_on {
            assert!(!archive.contains_key(target), "job {} waits on archived job {target}", waiter.id);
        }
        if let Some(task) = waiter.array_task {
            assert!(!archive.contains_key(&task.array), "task {} is hot, its array archived", waiter.id);
        }
    }
    let config = &state.config;
    let mut holders: BTreeMap<(String, u32), Vec<JobId>> = BTreeMap::new();
    let mut node_use: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut tenant_use: BTreeMap<String, u64> = BTreeMap::new();
    let mut class_use: BTreeMap<(String, String), u64> = BTreeMap::new();
    for job in state.jobs.values().filter(|j| j.state == JobState::Running && !j.is_array()) {
        let alloc = job.allocation.as_ref().expect("a running job has an allocation");
        let parts: Vec<(&str, &[u32])> = alloc.parts().collect();
        assert!(!alloc.is_gang() || !alloc.all_parts_ended(), "job {} runs with every part ended", job.id);
        let (nodes, per_node) = match job.spec.sched.gpus_per_node {
            Some(g) => (job.spec.gpus / g, g as usize),
            None if job.spec.gpu_slice.is_some() => (1, 1),
            None => (1, job.spec.gpus as usize),
        };
        assert_eq!(parts.len(), nodes as usize, "job {} has the wrong number of nodes", job.id);
        let distinct: BTreeSet<&str> = parts.iter().map(|(n, _)| *n).collect();
        assert_eq!(distinct.len(), parts.len(), "job {} uses a node twice", job.id);
        for (node, gpus) in &parts {
            let status = &state.nodes[*node];
            // A gang's part that ended (its node lost, say) keeps its GPUs until every part ended.
            if !alloc.part_ended(node) {
                assert_eq!(status.state, NodeState::Up, "job {} runs on down node {node}", job.id);
            }
            assert_eq!(gpus.len(), per_node, "job {} has the wrong number of gpus on {node}", job.id);
            for g in *gpus {
                assert!(status.spec.gpus.iter().any(|d| d.index == *g), "job {} on unknown gpu {node}:{g}", job.id);
                holders.entry((node.to_string(), *g)).or_default().push(job.id);
            }
            let e = node_use.entry(node.to_string()).or_default();
            e.0 += u64::from(job.spec.cpu_millis);
            e.1 += job.spec.memory_bytes;
        }
        match (&job.spec.gpu_slice, &alloc.slice) {
            (None, None) => {}
            (Some(GpuSlice::Mig { profile, .. }), Some(SliceAssignment::Mig { profile: p, .. })) => {
                assert_eq!(profile, p)
            }
            (Some(GpuSlice::Mps { thread_percent, .. }), Some(SliceAssignment::Mps { thread_percent: t, .. })) => {
                assert_eq!(thread_percent, t)
            }
            other => panic!("job {} has a slice that does not match its spec: {other:?}", job.id),
        }
        let milli = job_milli_gpus(&job.spec);
        *tenant_use.entry(job.spec.tenant.clone()).or_default() += milli;
        *class_use.entry((job.spec.tenant.clone(), job.spec.priority_class.clone())).or_default() += milli;
    }
    for ((node, gpu), jobs) in &holders {
        let device = state.nodes[node].spec.gpus.iter().find(|d| d.index == *gpu).unwrap();
        let slices: Vec<&SliceAssignment> =
            jobs.iter().filter_map(|j| state.jobs[j].allocation.as_ref().unwrap().slice.as_ref()).collect();
        if slices.len() != jobs.len() {
            assert_eq!(jobs.len(), 1, "gpu {node}:{gpu} held whole by one job and shared: {jobs:?}");
            continue;
        }
        let (mut mask, mut compute, mut threads, mut memory, mut kinds) = (0u16, 0, 0, 0, BTreeSet::new());
        for s in slices {
            match s {
                SliceAssignment::Mig { start, memory_slices, compute_slices, .. } => {
                    kinds.insert("mig");
                    assert!(device.supports_mig(), "mig slice on {node}:{gpu}");
                    let width = (*memory_slices).max(*compute_slices);
                    assert!(start + width <= 8 && start % memory_slices == 0, "bad mig position on {node}:{gpu}");
                    let bits = ((1u16 << width) - 1) << start;
                    assert_eq!(mask & bits, 0, "overlapping mig instances on {node}:{gpu}");
                    mask |= bits;
                    compute += compute_slices;
                }
                SliceAssignment::Mps { thread_percent, memory_mib } => {
                    kinds.insert("mps");
                    threads += thread_percent;
                    memory += memory_mib;
                }
            }
        }
        assert!(kinds.len() <= 1, "mig and mps on one gpu {node}:{gpu}");
        assert!(compute <= 7, "mig compute over-committed on {node}:{gpu}");
        assert!(threads <= 100, "mps threads over-committed on {node}:{gpu}: {threads}");
        assert!(memory <= device.memory_mib, "mps memory over-committed on {node}:{gpu}");
    }
    for (node, (cpu, mem)) in &node_use {
        let spec = &state.nodes[node].spec;
        assert!(*cpu <= spec.cpu_millis && *mem <= spec.memory_bytes, "node {node} cpu/memory over-committed");
    }
    let mut cohorts: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for (tenant, policy) in &config.tenant_policies {
        let used = tenant_use.get(tenant).copied().unwrap_or(0);
        if let Some(quota) = policy.quota_milli_gpus {
            let limit = match (&policy.cohort, policy.borrowing_limit_milli_gpus) {
                (None, _) => quota,
                (Some(_), Some(borrow)) => quota + borrow,
                (Some(_), None) => u64::MAX,
            };
            assert!(used <= limit, "tenant {tenant} uses {used} over its limit {limit}");
            if let Some(c) = &policy.cohort {
                let e = cohorts.entry(c).or_default();
                e.0 += used;
                e.1 += quota;
            }
        }
        for (class, cap) in &policy.class_quotas {
            let used = class_use.get(&(tenant.clone(), class.clone())).copied().unwrap_or(0);
            assert!(used <= *cap, "tenant {tenant} class {class} uses {used} over its cap {cap}");
        }
    }
    for (cohort, (used, quota)) in cohorts {
        assert!(used <= quota, "cohort {cohort} uses {used} over its quota {quota}");
    }
    // The ledger: one segment per run at most, never longer than the job's TSO lifetime (plus
    // the allowance for stamps running ahead of the clock), and no job that ended holds anything.
    // A run spanning a price change is billed in pieces: they meet end to start, each with a later
    // policy version.
    let mut runs: BTreeMap<(JobId, u64), &corral_types::Segment> = BTreeMap::new();
    for segment in state.ledger.values() {
        if let Some(previous) = runs.insert((segment.job_id, segment.epoch), segment) {
            assert!(
                previous.end == segment.start && previous.policy_version < segment.policy_version,
                "run {}/{} billed twice: {previous:?} and {segment:?}",
                segment.job_id,
                segment.epoch
            );
        }
        assert!(segment.end >= segment.start, "segment {} ends before it starts", segment.id);
        let placed = find(&segment.job_id).submitted_at;
        assert!(
            segment.duration_ms() <= segment.end.millis_since(placed) + corral_core::TSO_LEAD_ALLOWANCE_MS,
            "segment {} bills {} ms, longer than the job existed",
            segment.id,
            segment.duration_ms()
        );
    }
    for job in state.jobs.values().filter(|j| j.state.is_terminal()) {
        let held = state.nodes.keys().any(|n| state.jobs_on_node(n).any(|j| j.id == job.id));
        assert!(!held, "terminal job {} still holds resources", job.id);
    }
    // No job runs before its dependencies are met, and no held job runs.
    for job in state.jobs.values().filter(|j| !j.is_array() && (j.state == JobState::Running || j.started_at.is_some()))
    {
        for dep in &job.spec.sched.dependencies {
            let target = find(&dep.job_id);
            let ok = target.state == JobState::Succeeded;
            let met = match dep.kind {
                DependencyKind::AfterOk => ok,
                DependencyKind::AfterAny => target.state.is_terminal(),
                DependencyKind::AfterNotOk => target.state.is_terminal() && !ok,
            };
            assert!(
                met,
                "job {} started before {}:{} was met ({})",
                job.id,
                dep.kind.as_str(),
                dep.job_id,
                target.state
            );
        }
        if job.state == JobState::Running {
            assert!(!job.held && job.waiting_on.is_empty(), "job {} runs held or waiting", job.id);
        }
    }
    // No array has more unfinished tasks than its window; a finished array has none.
    for array in state.jobs.values().filter(|j| j.is_array()) {
        let unfinished = state
            .jobs
            .values()
            .filter(|t| t.array_task.is_some_and(|a| a.array == array.id) && !t.state.is_terminal())
            .count();
        let spec = array.spec.array.as_ref().expect("an array has its index set");
        assert!(spec.validate().is_ok(), "array {} was created with a bad index set {spec:?}", array.id);
        let window = spec.max_running.unwrap_or(corral_types::DEFAULT_ARRAY_WINDOW) as usize;
        assert!(unfinished <= window, "array {} has {unfinished} unfinished tasks, window {window}", array.id);
        if array.state.is_terminal() {
            assert_eq!(unfinished, 0, "array {} ended with unfinished tasks", array.id);
        }
    }
    // No two tasks of an array, hot or archived, have the same index, and each is one of its.
    let mut indices = BTreeSet::new();
    for task in state.jobs.values().chain(archive.values()).filter_map(|j| j.array_task) {
        assert!(indices.insert((task.array, task.index)), "array {} has task {} twice", task.array, task.index);
        let spec = find(&task.array).spec.array.as_ref().expect("a task's array has its index set");
        assert!(spec.contains(task.index), "array {} has no index {}", task.array, task.index);
    }
    // A tenant's pending count: its pending jobs (not arrays) and the tasks its unfinished,
    // uncancelled arrays have yet to create, cancelled indices aside.
    for tenant in TENANTS {
        let mut expected = 0;
        for job in state.jobs.values().filter(|j| j.spec.tenant == tenant) {
            if !job.is_array() {
                expected += u64::from(job.state == JobState::Pending);
            } else if !job.state.is_terminal() && !job.cancel_requested {
                let (spec, progress) = (job.spec.array.as_ref().unwrap(), job.array_progress.as_ref().unwrap());
                expected +=
                    spec.indices_from(u64::from(progress.created)).filter(|i| !progress.skipped.contains(i)).count()
                        as u64;
            }
        }
        assert_eq!(state.pending_count_of(tenant), expected, "pending jobs of {tenant}");
    }
    // Placements only on active nodes: a running job whose node is cordoned or draining was
    // placed before (it started earlier than the mode change); nothing to check statelessly.
    let mut rebuilt = state.clone();
    rebuilt.rebuild_indexes();
    assert_eq!(&rebuilt, state, "derived indexes drifted from the jobs");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn nothing_is_ever_over_committed(ops in proptest::collection::vec(op(), 1..60)) {
        let mut sim = Sim { state: State::default(), secs: 1, seq: 0, submitted: 0, archive: BTreeMap::new() };
        sim.apply(Command::Configure(config()));
        for i in 0..3 {
            sim.apply(Command::RegisterNode { spec: node_spec(i) });
        }
        let mut twin =
            Sim { state: sim.state.clone(), secs: sim.secs, seq: sim.seq, submitted: 0, archive: BTreeMap::new() };
        for op in &ops {
            sim.step(op);
            twin.step(op);
            check_invariants(&sim.state, &sim.archive);
        }
        prop_assert_eq!(&sim.state, &twin.state, "replicas applying the same commands agree");
        prop_assert_eq!(&sim.archive, &twin.archive, "replicas archive the same jobs");
    }
}
