//! Choosing preemption victims: the running jobs whose loss costs the least GPU work (GPU
//! equivalents x time run so far), among those the preemptor may take: lower priority when its
//! class preempts lower ones, or jobs of tenants that borrowed quota from the preemptor's cohort
//! while the preemptor's tenant is within its own quota (reclaim, never past what was borrowed).

use super::cluster::{fit, Cluster, GpuUse, NodeCap};
use super::{Book, Demand};
use crate::quota::{self, Limit};
use crate::resources::{job_milli_gpus, MigShape};
use crate::State;
use corral_types::{Job, JobId, SliceAssignment};
use std::collections::{BTreeMap, BTreeSet};

/// A running job that could be preempted, with what it holds.
pub(crate) struct Candidate<'s> {
    pub job: &'s Job,
    pub tenant: usize,
    pub class: usize,
    pub milli: u64,
    /// GPU work lost if it is stopped now: milli GPU-equivalents x seconds run.
    pub cost: u64,
}

/// Running jobs that may be preempted at all (not already stopping), built once per pass.
pub(crate) struct Candidates<'s> {
    pub list: Vec<Candidate<'s>>,
    by_node: BTreeMap<u32, Vec<usize>>,
}

impl<'s> Candidates<'s> {
    pub fn build(state: &'s State, book: &mut Book<'s>, cluster: &Cluster<'s>) -> Candidates<'s> {
        let mut list = Vec::new();
        let mut by_node: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        let now_ms = cluster.now_ms;
        for job in state.running_jobs() {
            if job.preemption.is_some() || job.cancel_requested {
                continue;
            }
            let Some(alloc) = &job.allocation else { continue };
            let milli = job_milli_gpus(&job.spec);
            let ran_secs = job.started_at.map(|t| now_ms.saturating_sub(t.physical_ms()) / 1000).unwrap_or(0);
            let i = list.len();
            for n in alloc.parts().filter_map(|(n, _)| cluster.by_name.get(n)) {
                by_node.entry(*n).or_default().push(i);
            }
            list.push(Candidate {
                job,
                tenant: book.tenant_of(&job.spec.tenant),
                class: book.class_of(&job.spec.priority_class),
                milli,
                cost: milli.saturating_mul(ran_secs.max(1)),
            });
        }
        Candidates { list, by_node }
    }
}

/// What a preemptor needs freed, and who it is.
pub(crate) struct Preemptor<'a> {
    pub id: JobId,
    pub tenant: usize,
    pub class: usize,
    pub need: u64,
    pub demand: &'a Demand,
}

/// The victims chosen for a preemptor and the nodes it will run on.
#[derive(Debug)]
pub(crate) struct Plan {
    pub victims: Vec<usize>,
    pub nodes: Vec<u32>,
}

/// Whether `c` may be preempted for `p`, given what was freed from each tenant so far.
fn eligible(book: &Book, p: &Preemptor, c: &Candidate, freed: &BTreeMap<usize, u64>) -> bool {
    if c.job.id == p.id {
        return false;
    }
    let (pc, vc) = (&book.classes[p.class], &book.classes[c.class]);
    if pc.preempts_lower && vc.value < pc.value {
        return true;
    }
    // Reclaim: only what the victim's tenant borrowed from the preemptor's cohort.
    let (pt, vt) = (&book.tenants[p.tenant], &book.tenants[c.tenant]);
    let same_cohort = pt.cohort.is_some() && pt.cohort == vt.cohort && p.tenant != c.tenant;
    let (Some(p_quota), Some(v_quota)) = (pt.quota(), vt.quota()) else { return false };
    let still_borrowing = vt.used - freed.get(&c.tenant).copied().unwrap_or(0) > v_quota;
    same_cohort && still_borrowing && pt.used + p.need <= p_quota
}

/// Order of victims: least GPU work lost, then lowest priority, then most recently started.
fn victim_order(book: &Book, list: &[Candidate], a: usize, b: usize) -> std::cmp::Ordering {
    let (x, y) = (&list[a], &list[b]);
    x.cost
        .cmp(&y.cost)
        .then(book.classes[x.class].value.cmp(&book.classes[y.class].value))
        .then(y.job.started_at.cmp(&x.job.started_at))
        .then(y.job.id.cmp(&x.job.id))
}

/// A node's free capacity with some jobs taken off it.
fn without(node: &NodeCap, victims: &[&Candidate]) -> (Vec<GpuUse>, u64, u64) {
    let mut usage: Vec<GpuUse> = node.gpus.iter().map(|g| g.usage).collect();
    let (mut cpu, mut mem) = (node.cpu_free, node.mem_free);
    for v in victims {
        let Some(alloc) = &v.job.allocation else { continue };
        let Some(gpus) = alloc.gpus_on(node.name) else { continue };
        cpu += u64::from(v.job.spec.cpu_millis);
        mem += v.job.spec.memory_bytes;
        for index in gpus {
            let Some(pos) = node.gpus.iter().position(|g| g.dev.index == *index) else { continue };
            usage[pos] = match (usage[pos], &alloc.slice) {
                (
                    GpuUse::Mig { used, compute },
                    Some(SliceAssignment::Mig { start, memory_slices, compute_slices, .. }),
                ) => {
                    let mask = MigShape { memory_slices: *memory_slices, compute_slices: *compute_slices }.mask(*start);
                    let (used, compute) = (used & !mask, compute - compute_slices);
                    if used == 0 {
                        GpuUse::Free
                    } else {
                        GpuUse::Mig { used, compute }
                    }
                }
                (GpuUse::Mps { threads, memory_mib }, Some(SliceAssignment::Mps { thread_percent, memory_mib: m })) => {
                    if threads == *thread_percent {
                        GpuUse::Free
                    } else {
                        GpuUse::Mps { threads: threads - thread_percent, memory_mib: memory_mib - m }
                    }
                }
                _ => GpuUse::Free,
            };
        }
    }
    (usage, cpu, mem)
}

/// Whether one part of the demand fits a node in the given state.
fn fits(node: &NodeCap, usage: &[GpuUse], cpu: u64, mem: u64, d: &Demand) -> bool {
    if cpu < d.cpu || mem < d.mem || !super::cluster::selects(&node.status.spec.labels, &d.selector) {
        return false;
    }
    let usable = |p: usize| !node.gpus[p].blocked;
    match d.slice {
        Some(req) => (0..usage.len()).any(|p| usable(p) && fit(&node.gpus[p], usage[p], req).is_some()),
        None => (0..usage.len()).filter(|p| usable(*p) && usage[*p] == GpuUse::Free).count() >= d.per_node as usize,
    }
}

/// The cheapest set of victims on node `n` that makes room for one part of the demand.
fn plan_node(
    book: &Book,
    cands: &Candidates,
    cluster: &Cluster,
    p: &Preemptor,
    n: u32,
    taken: &BTreeSet<JobId>,
) -> Option<(u64, Vec<usize>)> {
    let node = &cluster.nodes[n as usize];
    if !node.up() || node.reservation.is_some() || node.lease_blocks(p.demand) {
        return None;
    }
    let mut order: Vec<usize> =
        cands.by_node.get(&n)?.iter().copied().filter(|i| !taken.contains(&cands.list[*i].job.id)).collect();
    order.sort_by(|a, b| victim_order(book, &cands.list, *a, *b));
    let mut chosen: Vec<usize> = Vec::new();
    let mut freed: BTreeMap<usize, u64> = BTreeMap::new();
    let fits_with = |chosen: &[usize]| {
        let victims: Vec<&Candidate> = chosen.iter().map(|i| &cands.list[*i]).collect();
        let (usage, cpu, mem) = without(node, &victims);
        fits(node, &usage, cpu, mem, p.demand)
    };
    for i in order {
        let c = &cands.list[i];
        if !eligible(book, p, c, &freed) {
            continue;
        }
        chosen.push(i);
        *freed.entry(c.tenant).or_default() += c.milli;
        if fits_with(&chosen) {
            break;
        }
    }
    if chosen.is_empty() || !fits_with(&chosen) {
        return None;
    }
    // Drop victims that turned out unnecessary, most expensive first.
    let mut by_cost = chosen.clone();
    by_cost.sort_by(|a, b| victim_order(book, &cands.list, *b, *a));
    for i in by_cost {
        let rest: Vec<usize> = chosen.iter().copied().filter(|c| *c != i).collect();
        if fits_with(&rest) {
            chosen = rest;
        }
    }
    Some((chosen.iter().map(|i| cands.list[*i].cost).sum(), chosen))
}

/// Finds victims for a preemptor: room on its node(s) (unless `free_nodes` already has room),
/// then, if a quota still blocks, more victims that free that quota. `None` if nothing works.
pub(crate) fn plan(
    book: &Book,
    cands: &Candidates,
    cluster: &Cluster,
    p: &Preemptor,
    free_nodes: Vec<u32>,
    taken: &BTreeSet<JobId>,
) -> Option<Plan> {
    let d = p.demand;
    let mut victims: Vec<usize> = Vec::new();
    let mut nodes = free_nodes;
    if nodes.len() < d.parts as usize {
        let mut options: Vec<(u64, u32, Vec<usize>)> = cands
            .by_node
            .keys()
            .filter(|n| !nodes.contains(n))
            .filter_map(|n| plan_node(book, cands, cluster, p, *n, taken).map(|(cost, v)| (cost, *n, v)))
            .collect();
        options.sort_by(|a, b| a.0.cmp(&b.0).then(a.2.len().cmp(&b.2.len())).then(a.1.cmp(&b.1)));
        for (_, n, v) in options {
            if nodes.len() == d.parts as usize {
                break;
            }
            nodes.push(n);
            for i in v {
                if !victims.contains(&i) {
                    victims.push(i);
                }
            }
        }
        if nodes.len() < d.parts as usize {
            return None;
        }
    }
    // Quota: free more (cheapest first) while a limit still blocks.
    let freed_numbers = |victims: &[usize]| {
        let mut n = book.numbers(p.tenant, p.class);
        let pt = &book.tenants[p.tenant];
        for v in victims.iter().map(|i| &cands.list[*i]) {
            if v.tenant == p.tenant {
                n.tenant_used -= v.milli;
                if v.class == p.class {
                    if let Some((used, _)) = &mut n.class {
                        *used -= v.milli;
                    }
                }
            }
            if let (Some((used, _)), Some(_)) = (&mut n.cohort, pt.cohort) {
                if book.tenants[v.tenant].cohort == pt.cohort {
                    *used -= v.milli;
                }
            }
        }
        n
    };
    let mut extra: Option<Vec<usize>> = None;
    loop {
        let limit = match quota::check(&freed_numbers(&victims), p.need) {
            Ok(()) => break,
            Err(limit) => limit,
        };
        let pt = &book.tenants[p.tenant];
        let pool = extra.get_or_insert_with(|| {
            let mut all: Vec<usize> =
                (0..cands.list.len()).filter(|i| !taken.contains(&cands.list[*i].job.id)).collect();
            all.sort_by(|a, b| victim_order(book, &cands.list, *a, *b));
            all
        });
        let mut freed: BTreeMap<usize, u64> = BTreeMap::new();
        for v in &victims {
            *freed.entry(cands.list[*v].tenant).or_default() += cands.list[*v].milli;
        }
        let helps = |c: &Candidate| match limit {
            Limit::Tenant | Limit::Borrowing => c.tenant == p.tenant,
            Limit::Class => c.tenant == p.tenant && c.class == p.class,
            Limit::Cohort { .. } => pt.cohort.is_some() && book.tenants[c.tenant].cohort == pt.cohort,
        };
        let next = pool.iter().copied().find(|i| {
            let c = &cands.list[*i];
            !victims.contains(i) && helps(c) && eligible(book, p, c, &freed)
        })?;
        victims.push(next);
    }
    Some(Plan { victims, nodes })
}
