//! Free capacity during one pass, indexed so that finding room for a job costs O(log nodes), not
//! O(nodes): nodes by free whole-GPU count (best fit: the fullest node that still fits, which keeps
//! empty nodes for big jobs), partially used MIG and MPS GPUs by their free share. Reservations
//! (backfill) hold nodes for a blocked job from its estimated start.

use super::topology;
use super::Demand;
use crate::resources::{mps_memory_mib, GpuLoad, MigShape, SliceReq, MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES};
use crate::State;
use corral_types::{gpu_type_matches, GpuDevice, GpuSlice, JobId, JobState, NodeStatus, SliceAssignment};
use std::collections::{BTreeMap, BTreeSet};

/// Candidates looked at before giving up (nodes that fit by GPUs but not by CPU or memory).
const PROBE: usize = 64;
/// "Never": the release time of a job without a time limit.
pub(crate) const NEVER: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GpuUse {
    Free,
    Whole,
    Mig { used: u8, compute: u32 },
    Mps { threads: u32, memory_mib: u64 },
}

#[derive(Debug, Clone)]
pub(crate) struct GpuCap<'s> {
    pub dev: &'s GpuDevice,
    pub usage: GpuUse,
    /// Dirty or unhealthy: nothing new goes on it.
    pub blocked: bool,
    pub mig: bool,
}

/// Resources a running (or just placed) job gives back, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Release {
    pub at_ms: u64,
    pub gpus: u32,
    pub cpu: u64,
    pub mem: u64,
}

/// A node held for a blocked job from `start_ms`: jobs that end before then may use it freely,
/// others only the surplus (what is left at `start_ms` once the holder has its share).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reservation {
    pub job: JobId,
    pub start_ms: u64,
    pub gpus: u32,
    pub cpu: u64,
    pub mem: u64,
    /// Held for a preemptor waiting for its victims (rather than a backfill reservation).
    pub for_preemption: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct NodeCap<'s> {
    pub name: &'s str,
    pub status: &'s NodeStatus,
    pub gpus: Vec<GpuCap<'s>>,
    pub cpu_free: u64,
    pub mem_free: u64,
    /// Free, unblocked GPUs (and how many of them are MIG-capable).
    pub free: u32,
    pub free_mig: u32,
    pub reservation: Option<Reservation>,
    pub releases: Vec<Release>,
    /// Some job runs (or was placed in this pass) on the node: an `--exclusive` job skips it.
    pub busy: bool,
    /// An `--exclusive` job holds the whole node: no other job is placed on it.
    pub taken_whole: bool,
    /// When the node's lease ends (unix ms); `None`: no lease.
    pub lease_end_ms: Option<u64>,
}

impl NodeCap<'_> {
    /// Up and taking new jobs (not cordoned or draining).
    pub fn up(&self) -> bool {
        self.status.accepts_jobs()
    }

    /// Free GPU positions, optionally only MIG-capable or only plain ones.
    pub fn free_positions(&self, mig: Option<bool>) -> Vec<usize> {
        (0..self.gpus.len())
            .filter(|p| {
                let g = &self.gpus[*p];
                g.usage == GpuUse::Free && !g.blocked && mig.is_none_or(|m| g.mig == m)
            })
            .collect()
    }

    /// Index keys: free GPUs a job that does not end before the reservation may use.
    fn usable(&self) -> (u32, u32, u32) {
        let cap = self.reservation.map(|r| r.gpus).unwrap_or(u32::MAX);
        let plain = self.free - self.free_mig;
        (self.free.min(cap), self.free_mig.min(cap), plain.min(cap))
    }

    /// Whether the node takes a job that needs `gpus` fresh GPUs, `cpu` and `mem` (reservations
    /// included).
    pub fn admits(&self, d: &Demand, gpus: u32) -> bool {
        if !self.up() || self.cpu_free < d.cpu || self.mem_free < d.mem || self.free < gpus {
            return false;
        }
        if !selects(&self.status.spec.labels, &d.selector) || !self.suits(d) {
            return false;
        }
        match self.reservation {
            None => true,
            Some(r) => d.ends_by(r.start_ms) || (gpus <= r.gpus && d.cpu <= r.cpu && d.mem <= r.mem),
        }
    }
}

impl NodeCap<'_> {
    /// Whether the node is of the kind `d` asks for, whatever is free: not held whole by an
    /// `--exclusive` job, idle for one, and with GPUs of the model asked for.
    pub fn suits(&self, d: &Demand) -> bool {
        self.of_kind(d) && !self.lease_blocks(d)
    }

    /// Whether the node's lease ends before `d`, started now, would give it back.
    pub fn lease_blocks(&self, d: &Demand) -> bool {
        self.lease_end_ms.is_some_and(|end| d.lease_need_ms > end)
    }

    /// `suits`, the lease aside.
    fn of_kind(&self, d: &Demand) -> bool {
        if self.taken_whole || (d.exclusive && self.busy) {
            return false;
        }
        match &d.gpu_type {
            Some(wanted) => !self.gpus.is_empty() && self.gpus.iter().all(|g| gpu_type_matches(&g.dev.model, wanted)),
            None => true,
        }
    }
}

/// Whether a node with `labels` has every label `selector` asks for: `key=value`, or a bare word
/// that names a label's key or value (`--constraint a100`).
pub(crate) fn selects(labels: &[(String, String)], selector: &[String]) -> bool {
    selector.iter().all(|term| match term.split_once('=') {
        Some((k, v)) => labels.iter().any(|(lk, lv)| lk == k && lv == v),
        None => labels.iter().any(|(lk, lv)| lk == term || lv == term),
    })
}

/// Where a slice lands on a GPU (a `SliceAssignment` without the profile name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SliceFit {
    Mig { start: u32, memory_slices: u32, compute_slices: u32 },
    Mps { thread_percent: u32, memory_mib: u64 },
}

impl SliceFit {
    /// The assignment for the job's `slice` (its MIG profile name).
    pub fn assignment(self, slice: Option<&GpuSlice>) -> Option<SliceAssignment> {
        Some(match (self, slice?) {
            (SliceFit::Mig { start, memory_slices, compute_slices }, GpuSlice::Mig { profile, .. }) => {
                SliceAssignment::Mig { profile: profile.clone(), start, memory_slices, compute_slices }
            }
            (SliceFit::Mps { thread_percent, memory_mib }, GpuSlice::Mps { .. }) => {
                SliceAssignment::Mps { thread_percent, memory_mib }
            }
            _ => return None,
        })
    }
}

/// The room a slice job gets: a node, a GPU position on it, and the slice.
pub(crate) struct SliceSpot {
    pub node: u32,
    pub pos: usize,
    pub fit: SliceFit,
}

pub(crate) struct Cluster<'s> {
    pub nodes: Vec<NodeCap<'s>>,
    pub by_name: BTreeMap<&'s str, u32>,
    /// (usable free GPUs, node) of up nodes; and the same counting only MIG-capable / plain GPUs.
    whole: BTreeSet<(u32, u32)>,
    whole_mig: BTreeSet<(u32, u32)>,
    whole_plain: BTreeSet<(u32, u32)>,
    /// (free memory slices, node, position) of MIG GPUs in use.
    mig_partial: BTreeSet<(u32, u32, usize)>,
    /// (free thread percent, node, position) of MPS GPUs in use.
    mps_partial: BTreeSet<(u32, u32, usize)>,
    /// Nodes with a reservation, and the same by free GPUs.
    pub reserved: Vec<u32>,
    pub reserved_by_free: BTreeSet<(u32, u32)>,
    /// Up nodes with a lease end.
    leased: Vec<u32>,
    pub now_ms: u64,
}

/// When a running job is expected to give its resources back.
pub(crate) fn expected_end(job: &corral_types::Job, now_ms: u64) -> u64 {
    if let Some(p) = &job.preemption {
        return p.at.physical_ms() + u64::from(p.grace_secs) * 1000;
    }
    match job.spec.time_limit_secs {
        Some(limit) => {
            let start = job.started_at.map(|t| t.physical_ms()).unwrap_or(now_ms);
            start.saturating_add(limit.saturating_mul(1000)).max(now_ms)
        }
        None => NEVER,
    }
}

impl<'s> Cluster<'s> {
    pub fn build(state: &'s State, now_ms: u64, unschedulable: &BTreeSet<(String, u32)>) -> Cluster<'s> {
        let mut blocked: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
        for (node, gpu) in unschedulable {
            blocked.entry(node.as_str()).or_default().insert(*gpu);
        }
        // GPUs out for a card fault (replicated), whatever the last heartbeat said.
        for (name, status) in state.nodes.iter().filter(|(_, s)| !s.gpu_faults.is_empty()) {
            blocked.entry(name.as_str()).or_default().extend(status.gpu_faults.iter().map(|m| m.gpu));
        }
        let mut cluster = Cluster {
            nodes: Vec::with_capacity(state.nodes.len()),
            by_name: BTreeMap::new(),
            whole: BTreeSet::new(),
            whole_mig: BTreeSet::new(),
            whole_plain: BTreeSet::new(),
            mig_partial: BTreeSet::new(),
            mps_partial: BTreeSet::new(),
            reserved: Vec::new(),
            reserved_by_free: BTreeSet::new(),
            leased: Vec::new(),
            now_ms,
        };
        // Node loads are keyed like `state.nodes` (a subset): walk both in order, no lookups.
        let mut loads = state.index.nodes.iter().peekable();
        for (i, (name, status)) in state.nodes.iter().enumerate() {
            let idx = cluster.nodes.len() as u32;
            let load = loads.next_if(|(n, _)| *n == name).map(|(_, l)| l);
            let mig_flags = state.index.caps.mig_gpus.get(i);
            let node_blocked = blocked.get(name.as_str());
            let mut gpus = Vec::with_capacity(status.spec.gpus.len());
            let mut slice_ends: BTreeMap<usize, u64> = BTreeMap::new();
            for (pos, dev) in status.spec.gpus.iter().enumerate() {
                let usage = match load.and_then(|l| l.gpus.get(&dev.index)) {
                    None => GpuUse::Free,
                    Some(GpuLoad::Whole(_)) => GpuUse::Whole,
                    Some(GpuLoad::Mig { used, compute, jobs }) => {
                        let end = jobs.iter().filter_map(|j| state.jobs.get(j)).map(|j| expected_end(j, now_ms));
                        slice_ends.insert(pos, end.max().unwrap_or(now_ms));
                        GpuUse::Mig { used: *used, compute: *compute }
                    }
                    Some(GpuLoad::Mps { threads, memory_mib, jobs }) => {
                        let end = jobs.iter().filter_map(|j| state.jobs.get(j)).map(|j| expected_end(j, now_ms));
                        slice_ends.insert(pos, end.max().unwrap_or(now_ms));
                        GpuUse::Mps { threads: *threads, memory_mib: *memory_mib }
                    }
                };
                let is_blocked = node_blocked.is_some_and(|b| b.contains(&dev.index));
                let mig = mig_flags.and_then(|f| f.get(pos).copied()).unwrap_or_else(|| dev.supports_mig());
                gpus.push(GpuCap { dev, usage, blocked: is_blocked, mig });
            }
            let (used_cpu, used_mem) = load.map(|l| (l.cpu_millis, l.memory_bytes)).unwrap_or((0, 0));
            let busy = load.is_some_and(|l| !l.jobs.is_empty());
            let mut taken_whole = false;
            let mut releases = Vec::new();
            for job in load.into_iter().flat_map(|l| l.jobs.iter()).filter_map(|id| state.jobs.get(id)) {
                if job.state != JobState::Running {
                    continue;
                }
                taken_whole |= job.spec.layout.exclusive;
                let at_ms = expected_end(job, now_ms);
                let whole = if job.spec.gpu_slice.is_some() {
                    0
                } else {
                    let held = job.allocation.as_ref().and_then(|a| a.gpus_on(name)).unwrap_or(&[]);
                    held.iter().filter(|g| !node_blocked.is_some_and(|b| b.contains(g))).count() as u32
                };
                let (cpu, mem) = (u64::from(job.spec.cpu_millis), job.spec.memory_bytes);
                releases.push(Release { at_ms, gpus: whole, cpu, mem });
            }
            for (pos, at_ms) in slice_ends {
                if !gpus[pos].blocked {
                    releases.push(Release { at_ms, gpus: 1, cpu: 0, mem: 0 });
                }
            }
            let free = gpus.iter().filter(|g| g.usage == GpuUse::Free && !g.blocked).count() as u32;
            let free_mig = gpus.iter().filter(|g| g.usage == GpuUse::Free && !g.blocked && g.mig).count() as u32;
            let node = NodeCap {
                name,
                status,
                gpus,
                cpu_free: status.spec.cpu_millis.saturating_sub(used_cpu),
                mem_free: status.spec.memory_bytes.saturating_sub(used_mem),
                free,
                free_mig,
                reservation: None,
                releases,
                busy,
                taken_whole,
                lease_end_ms: status.lease_end().map(|t| t.physical_ms()),
            };
            cluster.by_name.insert(name, idx);
            if node.lease_end_ms.is_some() && node.up() {
                cluster.leased.push(idx);
            }
            cluster.nodes.push(node);
            if cluster.nodes[idx as usize].up() {
                cluster.index_node(idx);
                for pos in 0..cluster.nodes[idx as usize].gpus.len() {
                    cluster.index_partial(idx, pos);
                }
            }
        }
        cluster
    }

    fn index_node(&mut self, n: u32) {
        let (all, mig, plain) = self.nodes[n as usize].usable();
        self.whole.insert((all, n));
        self.whole_mig.insert((mig, n));
        self.whole_plain.insert((plain, n));
    }

    fn unindex_node(&mut self, n: u32) {
        let (all, mig, plain) = self.nodes[n as usize].usable();
        self.whole.remove(&(all, n));
        self.whole_mig.remove(&(mig, n));
        self.whole_plain.remove(&(plain, n));
    }

    fn partial_key(&self, n: u32, pos: usize) -> Option<(bool, (u32, u32, usize))> {
        let g = &self.nodes[n as usize].gpus[pos];
        if g.blocked {
            return None;
        }
        match g.usage {
            GpuUse::Mig { used, .. } => Some((true, (MIG_MEMORY_SLICES - used.count_ones(), n, pos))),
            GpuUse::Mps { threads, .. } => Some((false, (100 - threads, n, pos))),
            _ => None,
        }
    }

    fn index_partial(&mut self, n: u32, pos: usize) {
        match self.partial_key(n, pos) {
            Some((true, key)) => self.mig_partial.insert(key),
            Some((false, key)) => self.mps_partial.insert(key),
            None => false,
        };
    }

    fn unindex_partial(&mut self, n: u32, pos: usize) {
        match self.partial_key(n, pos) {
            Some((true, key)) => self.mig_partial.remove(&key),
            Some((false, key)) => self.mps_partial.remove(&key),
            None => false,
        };
    }

    /// Changes a node through `f`, keeping the indexes in step.
    fn update_node(&mut self, n: u32, f: impl FnOnce(&mut NodeCap<'s>)) {
        let indexed = self.nodes[n as usize].up();
        if indexed {
            self.unindex_node(n);
        }
        let node = &self.nodes[n as usize];
        if node.reservation.is_some() {
            self.reserved_by_free.remove(&(node.free, n));
        }
        f(&mut self.nodes[n as usize]);
        let node = &self.nodes[n as usize];
        if node.reservation.is_some() {
            self.reserved_by_free.insert((node.free, n));
        }
        if indexed {
            self.index_node(n);
        }
    }

    /// Largest number of free GPUs on any up node (reservations ignored).
    pub fn largest_free(&self) -> u32 {
        let indexed = self.whole.iter().next_back().map(|(c, _)| *c).unwrap_or(0);
        let reserved = self.reserved_by_free.iter().next_back().map(|(c, _)| *c).unwrap_or(0);
        indexed.max(reserved)
    }

    pub fn any_up(&self) -> bool {
        !self.whole.is_empty()
    }

    /// A leased node (of the first `PROBE`) that has room for one part of `d` now, of the kind it
    /// asks for, but whose lease ends before `d` would give it back.
    pub fn lease_blocked(&self, d: &Demand, k: u32) -> Option<&'s str> {
        self.leased.iter().take(PROBE).map(|n| &self.nodes[*n as usize]).find_map(|n| {
            let room = n.free >= k && n.cpu_free >= d.cpu && n.mem_free >= d.mem;
            let fits = room && selects(&n.status.spec.labels, &d.selector) && n.of_kind(d);
            (fits && n.lease_blocks(d)).then_some(n.name)
        })
    }

    /// Up nodes with at least `k` free GPUs and the CPU and memory of `d`, reservations ignored
    /// (counted up to `limit`).
    pub fn count_free_nodes(&self, d: &Demand, k: u32, limit: usize) -> usize {
        let fits = |n: &NodeCap| {
            n.up()
                && n.free >= k
                && n.cpu_free >= d.cpu
                && n.mem_free >= d.mem
                && selects(&n.status.spec.labels, &d.selector)
                && n.suits(d)
        };
        let reserved = self.reserved_by_free.range((k, 0)..).filter(|(_, n)| fits(&self.nodes[*n as usize])).count();
        let free = self
            .whole
            .range((k, 0)..)
            .filter(|(_, n)| self.nodes[*n as usize].reservation.is_none() && fits(&self.nodes[*n as usize]))
            .take(limit)
            .count();
        (reserved + free).min(limit)
    }

    /// Nodes (best fit first) that can take `per_node` whole GPUs of `d`, at most `want` of them.
    pub fn find_nodes(&self, d: &Demand, want: usize) -> Vec<u32> {
        let k = d.per_node;
        let mut out: Vec<u32> = Vec::new();
        if d.end_ms.is_some() {
            // Backfill: a job that ends before a reservation starts may use the held node.
            let mut holes: Vec<(u32, u32)> = self
                .reserved
                .iter()
                .map(|n| (self.nodes[*n as usize].free, *n))
                .filter(|(_, n)| {
                    let node = &self.nodes[*n as usize];
                    node.reservation.is_some_and(|r| d.ends_by(r.start_ms)) && node.admits(d, k)
                })
                .collect();
            holes.sort_unstable();
            out.extend(holes.into_iter().map(|(_, n)| n).take(want));
        }
        // A job that needs labelled nodes looks at every node: the first ones may lack the labels.
        let probe = if d.selector.is_empty() { PROBE + want } else { usize::MAX };
        for (probed, &(_, n)) in self.whole.range((k, 0)..).enumerate() {
            if out.len() >= want || probed >= probe {
                break;
            }
            if !out.contains(&n) && self.nodes[n as usize].admits(d, k) {
                out.push(n);
            }
        }
        out
    }

    /// Takes `d.per_node` whole GPUs on node `n` (topology-aware); returns their indices.
    pub fn take_whole(&mut self, n: u32, d: &Demand) -> Vec<u32> {
        let node = &self.nodes[n as usize];
        let devices: Vec<&GpuDevice> = node.gpus.iter().map(|g| g.dev).collect();
        let free = node.free_positions(None);
        // An exclusive job that asked for no GPUs gets every GPU of its idle node, as in Slurm.
        let want = if d.takes_whole_nodes_gpus() { free.len() } else { d.per_node as usize };
        let Some(chosen) = topology::choose(&devices, &free, want, d.rdma) else {
            return Vec::new();
        };
        let indices: Vec<u32> = chosen.iter().map(|p| node.gpus[*p].dev.index).collect();
        let end = d.end_ms.unwrap_or(NEVER);
        let count = chosen.len() as u32;
        self.update_node(n, |node| {
            for p in &chosen {
                node.gpus[*p].usage = GpuUse::Whole;
                node.free -= 1;
                if node.gpus[*p].mig {
                    node.free_mig -= 1;
                }
            }
            node.consume(d, count);
            node.releases.push(Release { at_ms: end, gpus: count, cpu: d.cpu, mem: d.mem });
        });
        indices
    }

    /// Finds room for a slice job: a partly used GPU of the same kind first (fullest first), else
    /// a free GPU on the fullest node that has one (MPS prefers cards without MIG).
    pub fn find_slice(&self, d: &Demand) -> Option<SliceSpot> {
        let req = d.slice?;
        let (partial, lower, fresh): (_, u32, &[&BTreeSet<(u32, u32)>]) = match req {
            SliceReq::Mig { .. } => (&self.mig_partial, 1, &[&self.whole_mig]),
            SliceReq::Mps { threads, .. } => (&self.mps_partial, threads, &[&self.whole_plain, &self.whole_mig]),
            SliceReq::Invalid => return None,
        };
        for &(_, n, pos) in partial.range((lower, 0, 0)..).take(PROBE) {
            let node = &self.nodes[n as usize];
            if !node.admits(d, 0) {
                continue;
            }
            let gpu = &node.gpus[pos];
            if let Some(fit) = fit(gpu, gpu.usage, req) {
                return Some(SliceSpot { node: n, pos, fit });
            }
        }
        // A fresh GPU: backfill holes first for short jobs, then the index.
        let holes = self.reserved.iter().copied().filter(|n| {
            d.end_ms.is_some() && self.nodes[*n as usize].reservation.is_some_and(|r| d.ends_by(r.start_ms))
        });
        let indexed = fresh.iter().flat_map(|set| set.range((1, 0)..).take(PROBE).map(|(_, n)| *n));
        let kinds: &[bool] = match req {
            SliceReq::Mig { .. } => &[true],
            _ => &[false, true],
        };
        for n in holes.chain(indexed) {
            let node = &self.nodes[n as usize];
            if !node.admits(d, 1) {
                continue;
            }
            let devices: Vec<&GpuDevice> = node.gpus.iter().map(|g| g.dev).collect();
            for &kind in kinds {
                let free = |p: usize| {
                    let g = &node.gpus[p];
                    g.usage == GpuUse::Free && !g.blocked && g.mig == kind
                };
                let Some(pos) = topology::choose_one(&devices, free, d.rdma) else { continue };
                if let Some(fit) = fit(&node.gpus[pos], GpuUse::Free, req) {
                    return Some(SliceSpot { node: n, pos, fit });
                }
            }
        }
        None
    }

    /// Takes the slice found by `find_slice`; returns the GPU index.
    pub fn take_slice(&mut self, spot: &SliceSpot, d: &Demand) -> u32 {
        let (n, pos) = (spot.node, spot.pos);
        let was_free = self.nodes[n as usize].gpus[pos].usage == GpuUse::Free;
        self.unindex_partial(n, pos);
        let end = d.end_ms.unwrap_or(NEVER);
        let slice = spot.fit;
        self.update_node(n, |node| {
            let gpu = &mut node.gpus[pos];
            gpu.usage = match (gpu.usage, slice) {
                (GpuUse::Mig { used, compute }, SliceFit::Mig { start, memory_slices, compute_slices }) => {
                    let shape = MigShape { memory_slices, compute_slices };
                    GpuUse::Mig { used: used | shape.mask(start), compute: compute + compute_slices }
                }
                (GpuUse::Free, SliceFit::Mig { start, memory_slices, compute_slices }) => {
                    let shape = MigShape { memory_slices, compute_slices };
                    GpuUse::Mig { used: shape.mask(start), compute: compute_slices }
                }
                (GpuUse::Mps { threads, memory_mib }, SliceFit::Mps { thread_percent, memory_mib: m }) => {
                    GpuUse::Mps { threads: threads + thread_percent, memory_mib: memory_mib + m }
                }
                (_, SliceFit::Mps { thread_percent, memory_mib }) => {
                    GpuUse::Mps { threads: thread_percent, memory_mib }
                }
                (other, _) => other,
            };
            let fresh = u32::from(was_free);
            if was_free {
                node.free -= 1;
                if gpu.mig {
                    node.free_mig -= 1;
                }
            }
            node.consume(d, fresh);
            node.releases.push(Release { at_ms: end, gpus: fresh, cpu: d.cpu, mem: d.mem });
        });
        self.index_partial(n, pos);
        self.nodes[n as usize].gpus[pos].dev.index
    }

    /// Holds node `n` for `job` from `start_ms`, leaving `surplus` to jobs that end later.
    pub fn reserve(&mut self, n: u32, reservation: Reservation) {
        if self.nodes[n as usize].reservation.is_none() {
            self.reserved.push(n);
        }
        self.update_node(n, |node| node.reservation = Some(reservation));
    }
}

impl NodeCap<'_> {
    /// Books what a placed job takes; a job that outlives the reservation eats its surplus.
    fn consume(&mut self, d: &Demand, fresh_gpus: u32) {
        self.cpu_free -= d.cpu;
        self.mem_free -= d.mem;
        self.busy = true;
        self.taken_whole |= d.exclusive;
        if let Some(r) = &mut self.reservation {
            if !d.ends_by(r.start_ms) {
                r.gpus = r.gpus.saturating_sub(fresh_gpus);
                r.cpu = r.cpu.saturating_sub(d.cpu);
                r.mem = r.mem.saturating_sub(d.mem);
            }
        }
    }

    /// Earliest time this node has `gpus` free GPUs, `cpu` and `mem`, and what it has then.
    pub fn available_at(&self, gpus: u32, cpu: u64, mem: u64, now_ms: u64) -> Option<(u64, Release)> {
        let mut have = Release { at_ms: now_ms, gpus: self.free, cpu: self.cpu_free, mem: self.mem_free };
        let fits = |h: &Release| h.gpus >= gpus && h.cpu >= cpu && h.mem >= mem;
        if fits(&have) {
            return Some((now_ms, have));
        }
        let mut releases: Vec<&Release> = self.releases.iter().filter(|r| r.at_ms != NEVER).collect();
        releases.sort_by_key(|r| r.at_ms);
        for r in releases {
            have.gpus += r.gpus;
            have.cpu += r.cpu;
            have.mem += r.mem;
            have.at_ms = r.at_ms;
            if fits(&have) {
                return Some((r.at_ms, have));
            }
        }
        None
    }

    /// What the node has free at `at_ms` (releases up to then included).
    pub fn free_at(&self, at_ms: u64) -> Release {
        let mut have = Release { at_ms, gpus: self.free, cpu: self.cpu_free, mem: self.mem_free };
        for r in self.releases.iter().filter(|r| r.at_ms <= at_ms) {
            have.gpus += r.gpus;
            have.cpu += r.cpu;
            have.mem += r.mem;
        }
        have
    }
}

/// Where a slice request would land on `gpu` if it were in state `usage`.
pub(crate) fn fit(gpu: &GpuCap, usage: GpuUse, req: SliceReq) -> Option<SliceFit> {
    match req {
        SliceReq::Mig { compute, gb } => {
            let (used, used_compute) = match usage {
                GpuUse::Free if gpu.mig => (0, 0),
                GpuUse::Mig { used, compute } => (used, compute),
                _ => return None,
            };
            let shape = MigShape::for_card(compute, gb, gpu.dev.memory_mib)?;
            if used_compute + shape.compute_slices > MIG_COMPUTE_SLICES {
                return None;
            }
            let start = shape.best_start(used)?;
            Some(SliceFit::Mig { start, memory_slices: shape.memory_slices, compute_slices: shape.compute_slices })
        }
        SliceReq::Mps { threads, memory_mib } => {
            let memory = mps_memory_mib(threads, memory_mib, gpu.dev.memory_mib);
            let (used_threads, used_memory) = match usage {
                GpuUse::Free => (0, 0),
                GpuUse::Mps { threads, memory_mib } => (threads, memory_mib),
                _ => return None,
            };
            (used_threads + threads <= 100 && used_memory + memory <= gpu.dev.memory_mib)
                .then_some(SliceFit::Mps { thread_percent: threads, memory_mib: memory })
        }
        SliceReq::Invalid => None,
    }
}
