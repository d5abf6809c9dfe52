//! What a job asks for, in the units capacity and quotas are counted in: whole GPUs, MIG geometry
//! (eighths of memory, sevenths of compute) and MPS shares (thread percent, MiB of memory).
//!
//! Invariant: one GPU is either free, held whole by one job, split into MIG instances whose memory
//! slices do not overlap, or shared by MPS clients whose thread percentages sum to at most 100 and
//! whose memory limits sum to at most the card's memory. Never two modes at once.

use corral_types::{GpuDevice, GpuSlice, JobId, JobSpec, SliceAssignment};
use std::collections::BTreeSet;

/// Milli GPU-equivalents of a whole GPU.
pub const MILLI_PER_GPU: u64 = 1000;

/// Memory slices of a MIG-capable card (compute slices are 7).
pub const MIG_MEMORY_SLICES: u32 = 8;
/// Compute slices of a MIG-capable card.
pub const MIG_COMPUTE_SLICES: u32 = 7;

/// Quota weight of a job in milli GPU-equivalents: 1000 per whole GPU, the fraction for a slice.
pub fn job_milli_gpus(spec: &JobSpec) -> u64 {
    match &spec.gpu_slice {
        Some(slice) => u64::from(slice.milli_gpus()),
        None => u64::from(spec.gpus) * MILLI_PER_GPU,
    }
}

/// The node parts a job needs: `(nodes, gpus per node)`. A gang of `gpus / gpus_per_node`
/// nodes, or Slurm's `--nodes` (whole GPUs split evenly, maybe none).
///
/// A job whose tasks spread over nodes (`JobSpec::spreads`) has no shape until placed: this is
/// all its GPUs on one node, and the pass tries `spread_shapes` instead.
pub(crate) fn gang_shape(spec: &JobSpec) -> (u32, u32) {
    if spec.gpu_slice.is_some() {
        return (1, 1);
    }
    if spec.spreads() {
        return (1, spec.gpus);
    }
    match spec.sched.gpus_per_node {
        Some(per_node) if per_node > 0 && spec.layout.nodes == 0 => (spec.gpus / per_node, per_node),
        _ => {
            let parts = spec.parts();
            (parts, spec.gpus / parts)
        }
    }
}

/// A MIG profile resolved on a card of a given memory size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MigShape {
    pub memory_slices: u32,
    pub compute_slices: u32,
}

impl MigShape {
    /// Resolves `<c>g.<m>gb[+me]` on a card with `card_memory_mib`: the memory part is rounded to
    /// the nearest of 1, 2, 4 or 8 eighths of the card (NVIDIA's 1g.10gb on an 80 GB H100 is one
    /// eighth, 1g.18gb on a 141 GB H200 too). `None` if the profile cannot exist on this card.
    pub fn resolve(profile: &str, compute_slices: u32, card_memory_mib: u64) -> Option<MigShape> {
        MigShape::for_card(compute_slices, MigShape::profile_gb(profile)?, card_memory_mib)
    }

    /// The memory part of a profile name, in GB (`3g.40gb` -> 40).
    pub fn profile_gb(profile: &str) -> Option<u64> {
        let (_, rest) = profile.split_once("g.")?;
        rest.split('+').next()?.strip_suffix("gb")?.parse().ok()
    }

    /// [`MigShape::resolve`] with the profile already parsed.
    pub fn for_card(compute_slices: u32, gb: u64, card_memory_mib: u64) -> Option<MigShape> {
        if card_memory_mib == 0 || gb == 0 || compute_slices == 0 || compute_slices > MIG_COMPUTE_SLICES {
            return None;
        }
        // Smallest m in {1, 2, 4, 8} with m/8 of the card >= 90% of the profile's memory.
        let memory_slices = [1u64, 2, 4, 8].into_iter().find(|m| m * card_memory_mib * 10 >= gb * 1024 * 8 * 9)?;
        let shape = MigShape { memory_slices: memory_slices as u32, compute_slices };
        shape.starts().next().is_some().then_some(shape)
    }

    /// Valid start positions (memory slice index) on an empty card, highest first: a placement
    /// starts on a multiple of its memory size, and its compute must fit in the 7 compute slices.
    pub fn starts(self) -> impl Iterator<Item = u32> {
        let width = self.memory_slices.max(self.compute_slices);
        (0..MIG_MEMORY_SLICES)
            .rev()
            .filter(move |s| s % self.memory_slices == 0 && s + width <= MIG_MEMORY_SLICES)
            .filter(move |s| s + self.compute_slices <= MIG_COMPUTE_SLICES)
    }

    pub fn mask(self, start: u32) -> u8 {
        let width = self.memory_slices.max(self.compute_slices);
        (((1u16 << width) - 1) << start) as u8
    }

    /// The best free start on a card whose used memory slices are `used`: the highest one, which
    /// keeps low positions (the only ones big profiles may use) free.
    pub fn best_start(self, used: u8) -> Option<u32> {
        self.starts().find(|s| self.mask(*s) & used == 0)
    }

    pub fn is_valid_start(self, start: u32) -> bool {
        self.starts().any(|s| s == start)
    }
}

/// A slice request parsed once: what placement needs to know about a `GpuSlice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum SliceReq {
    Mig {
        compute: u32,
        gb: u64,
    },
    Mps {
        threads: u32,
        memory_mib: Option<u64>,
    },
    /// A MIG profile name that cannot be parsed: fits nowhere.
    Invalid,
}

impl SliceReq {
    pub fn of(slice: &GpuSlice) -> SliceReq {
        match slice {
            GpuSlice::Mig { profile, compute_slices } => match MigShape::profile_gb(profile) {
                Some(gb) => SliceReq::Mig { compute: *compute_slices, gb },
                None => SliceReq::Invalid,
            },
            GpuSlice::Mps { thread_percent, memory_mib } => {
                SliceReq::Mps { threads: *thread_percent, memory_mib: *memory_mib }
            }
        }
    }
}

impl std::fmt::Display for SliceReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SliceReq::Mig { compute, gb } => write!(f, "mig:{compute}g.{gb}gb"),
            SliceReq::Mps { threads, memory_mib: None } => write!(f, "mps:{threads}"),
            SliceReq::Mps { threads, memory_mib: Some(m) } => write!(f, "mps:{threads}:{m}MiB"),
            SliceReq::Invalid => write!(f, "unknown"),
        }
    }
}

/// MiB of device memory an MPS client may pin: its own limit, or its thread share of the card.
pub(crate) fn mps_memory_mib(thread_percent: u32, memory_mib: Option<u64>, card_memory_mib: u64) -> u64 {
    memory_mib.unwrap_or(card_memory_mib * u64::from(thread_percent) / 100)
}

/// What one GPU currently carries (derived from running jobs' allocations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuLoad {
    Whole(JobId),
    Mig { used: u8, compute: u32, jobs: BTreeSet<JobId> },
    Mps { threads: u32, memory_mib: u64, jobs: BTreeSet<JobId> },
}

impl GpuLoad {
    /// Adds a job to this GPU's load; `None` means the GPU was free.
    pub fn add(load: Option<GpuLoad>, job: JobId, slice: Option<&SliceAssignment>) -> GpuLoad {
        match (load, slice) {
            (None, None) => GpuLoad::Whole(job),
            (load, Some(SliceAssignment::Mig { start, memory_slices, compute_slices, .. })) => {
                let shape = MigShape { memory_slices: *memory_slices, compute_slices: *compute_slices };
                let (mut used, mut compute, mut jobs) = match load {
                    Some(GpuLoad::Mig { used, compute, jobs }) => (used, compute, jobs),
                    _ => (0, 0, BTreeSet::new()),
                };
                used |= shape.mask(*start);
                compute += compute_slices;
                jobs.insert(job);
                GpuLoad::Mig { used, compute, jobs }
            }
            (load, Some(SliceAssignment::Mps { thread_percent, memory_mib })) => {
                let (mut threads, mut memory, mut jobs) = match load {
                    Some(GpuLoad::Mps { threads, memory_mib, jobs }) => (threads, memory_mib, jobs),
                    _ => (0, 0, BTreeSet::new()),
                };
                threads += thread_percent;
                memory += memory_mib;
                jobs.insert(job);
                GpuLoad::Mps { threads, memory_mib: memory, jobs }
            }
            (Some(other), None) => other,
        }
    }

    /// Removes a job; `None` once the GPU is free.
    pub fn remove(self, job: JobId, slice: Option<&SliceAssignment>) -> Option<GpuLoad> {
        match (self, slice) {
            (GpuLoad::Whole(holder), _) if holder == job => None,
            (
                GpuLoad::Mig { mut used, mut compute, mut jobs },
                Some(SliceAssignment::Mig { start, memory_slices, compute_slices, .. }),
            ) if jobs.contains(&job) => {
                jobs.remove(&job);
                let shape = MigShape { memory_slices: *memory_slices, compute_slices: *compute_slices };
                used &= !shape.mask(*start);
                compute -= compute_slices;
                (!jobs.is_empty()).then_some(GpuLoad::Mig { used, compute, jobs })
            }
            (
                GpuLoad::Mps { mut threads, memory_mib: mut memory, mut jobs },
                Some(SliceAssignment::Mps { thread_percent, memory_mib }),
            ) if jobs.contains(&job) => {
                jobs.remove(&job);
                threads -= thread_percent;
                memory -= memory_mib;
                (!jobs.is_empty()).then_some(GpuLoad::Mps { threads, memory_mib: memory, jobs })
            }
            (load, _) => Some(load),
        }
    }
}

/// Finds room for `slice` on a GPU that carries `load` (`None`: free), or says why not.
pub(crate) fn fit_slice(
    device: &GpuDevice,
    load: Option<&GpuLoad>,
    slice: &GpuSlice,
    wanted: Option<&SliceAssignment>,
) -> Result<SliceAssignment, &'static str> {
    match slice {
        GpuSlice::Mig { profile, compute_slices } => {
            if !device.supports_mig() {
                return Err("gpu does not support mig");
            }
            let shape = MigShape::resolve(profile, *compute_slices, device.memory_mib)
                .ok_or("mig profile does not exist on this gpu")?;
            let (used, compute) = match load {
                None => (0, 0),
                Some(GpuLoad::Mig { used, compute, .. }) => (*used, *compute),
                Some(_) => return Err("gpu is not in mig mode"),
            };
            let start = match wanted {
                Some(SliceAssignment::Mig { profile: p, start, memory_slices, compute_slices: c }) => {
                    if p != profile || *memory_slices != shape.memory_slices || *c != shape.compute_slices {
                        return Err("slice does not match the job's mig profile");
                    }
                    if !shape.is_valid_start(*start) {
                        return Err("invalid mig start position");
                    }
                    if shape.mask(*start) & used != 0 {
                        return Err("mig position already in use");
                    }
                    *start
                }
                Some(SliceAssignment::Mps { .. }) => return Err("slice does not match the job's mig profile"),
                None => shape.best_start(used).ok_or("no free mig position for the profile")?,
            };
            if compute + shape.compute_slices > MIG_COMPUTE_SLICES {
                return Err("not enough mig compute slices left");
            }
            Ok(SliceAssignment::Mig {
                profile: profile.clone(),
                start,
                memory_slices: shape.memory_slices,
                compute_slices: shape.compute_slices,
            })
        }
        GpuSlice::Mps { thread_percent, memory_mib } => {
            let memory = mps_memory_mib(*thread_percent, *memory_mib, device.memory_mib);
            if let Some(w) = wanted {
                if *w != (SliceAssignment::Mps { thread_percent: *thread_percent, memory_mib: memory }) {
                    return Err("slice does not match the job's mps share");
                }
            }
            let (threads, used_memory) = match load {
                None => (0, 0),
                Some(GpuLoad::Mps { threads, memory_mib, .. }) => (*threads, *memory_mib),
                Some(_) => return Err("gpu is not shared by mps"),
            };
            if threads + thread_percent > 100 {
                return Err("not enough mps thread share left");
            }
            if used_memory + memory > device.memory_mib {
                return Err("not enough gpu memory left for the mps share");
            }
            Ok(SliceAssignment::Mps { thread_percent: *thread_percent, memory_mib: memory })
        }
    }
}

/// The node counts a job whose tasks spread over nodes may be placed on, fewest first, on nodes
/// of at most `largest` GPUs: those for which `nodes_with(per-node GPUs)` nodes exist.
pub(crate) fn spread_shapes(spec: &JobSpec, largest: u32, nodes_with: impl Fn(u32) -> u32) -> Vec<u32> {
    spec.spread_node_counts(largest)
        .into_iter()
        .filter(|k| {
            let per_node = spec.layout.gpus_per_task.saturating_mul(spec.layout.ntasks.div_ceil(*k));
            nodes_with(per_node) >= *k
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(profile: &str, card_mib: u64) -> Option<(u32, u32)> {
        let c: u32 = profile.split('g').next().unwrap().parse().unwrap_or(1);
        MigShape::resolve(profile, c, card_mib).map(|s| (s.memory_slices, s.compute_slices))
    }

    #[test]
    fn mig_profiles_resolve_on_real_cards() {
        // H100 80GB, H200 141GB, A100 40GB.
        for (profile, card, expected) in [
            ("1g.10gb", 81559, Some((1, 1))),
            ("1g.20gb", 81559, Some((2, 1))),
            ("2g.20gb", 81559, Some((2, 2))),
            ("3g.40gb", 81559, Some((4, 3))),
            ("4g.40gb", 81559, Some((4, 4))),
            ("7g.80gb", 81559, Some((8, 7))),
            ("1g.18gb", 143771, Some((1, 1))),
            ("3g.71gb", 143771, Some((4, 3))),
            ("7g.141gb", 143771, Some((8, 7))),
            ("1g.5gb", 40960, Some((1, 1))),
            ("1g.10gb+me", 81559, Some((1, 1))),
            ("7g.80gb", 40960, None),
            ("bogus", 40960, None),
        ] {
            assert_eq!(shape(profile, card), expected, "{profile} on {card} MiB");
        }
    }

    #[test]
    fn mig_start_positions_follow_nvidia_placements() {
        let starts = |m, c| MigShape { memory_slices: m, compute_slices: c }.starts().collect::<Vec<_>>();
        assert_eq!(starts(1, 1), vec![6, 5, 4, 3, 2, 1, 0]);
        assert_eq!(starts(2, 1), vec![6, 4, 2, 0]);
        assert_eq!(starts(2, 2), vec![4, 2, 0]);
        assert_eq!(starts(4, 3), vec![4, 0]);
        assert_eq!(starts(4, 4), vec![0]);
        assert_eq!(starts(8, 7), vec![0]);
        // A 1g at the top leaves room for a 4g and a 2g.
        let one = MigShape { memory_slices: 1, compute_slices: 1 };
        let used = one.mask(one.best_start(0).unwrap());
        assert_eq!(MigShape { memory_slices: 4, compute_slices: 4 }.best_start(used), Some(0));
        assert_eq!(MigShape { memory_slices: 2, compute_slices: 2 }.best_start(used | 0x0f), Some(4));
    }

    #[test]
    fn loads_add_and_remove_symmetrically() {
        let a = SliceAssignment::Mps { thread_percent: 30, memory_mib: 1000 };
        let b = SliceAssignment::Mps { thread_percent: 50, memory_mib: 2000 };
        let load = GpuLoad::add(None, 1, Some(&a));
        let load = GpuLoad::add(Some(load), 2, Some(&b));
        assert!(matches!(load, GpuLoad::Mps { threads: 80, memory_mib: 3000, .. }));
        let load = load.remove(1, Some(&a)).unwrap();
        assert_eq!(load, GpuLoad::add(None, 2, Some(&b)));
        assert_eq!(load.remove(2, Some(&b)), None);
        assert_eq!(GpuLoad::Whole(4).remove(5, None), Some(GpuLoad::Whole(4)));
    }
}
