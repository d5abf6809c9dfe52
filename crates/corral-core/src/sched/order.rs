//! The order in which a pass considers pending jobs: priority value first (highest first); inside a
//! priority level, fair share between tenants; inside a tenant, submit order.
//!
//! Fair share (after Slurm's): a tenant's key is its decayed past usage plus what it holds now,
//! both in weighted GPU-equivalents, divided by its weight; the tenant with the lowest key goes
//! next, and every job placed during the pass raises its tenant's key, so tenants interleave.

use super::Book;
use crate::state::QueuedJob;
use corral_types::JobId;
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap};

/// A tenant's fair-share key, ordered by `f64::total_cmp` (deterministic, no NaN surprises).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key(f64);

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// A queued job: its class index, id and scheduling record.
type Entry<'s> = (usize, JobId, &'s QueuedJob);
/// Tenant -> its jobs of one level in submit order, and the next one to look at.
type TenantQueues<'s> = BTreeMap<usize, (Vec<Entry<'s>>, usize)>;

struct Level<'s> {
    queues: TenantQueues<'s>,
    heap: BinaryHeap<Reverse<(Key, usize)>>,
}

/// Pending jobs grouped for the pass.
pub(crate) struct Queue<'s> {
    levels: Vec<Level<'s>>,
    level: usize,
    /// The tenant whose job was handed out last, to put back with its new key.
    out: Option<usize>,
}

impl<'s> Queue<'s> {
    /// `groups`: (priority value, tenant index, class index, jobs in submit order).
    pub fn build(
        groups: impl Iterator<Item = (i64, usize, usize, &'s BTreeMap<JobId, QueuedJob>)>,
        book: &Book,
    ) -> Queue<'s> {
        let mut by_level: BTreeMap<Reverse<i64>, TenantQueues<'s>> = BTreeMap::new();
        for (value, tenant, class, jobs) in groups {
            let queue = &mut by_level.entry(Reverse(value)).or_default().entry(tenant).or_default().0;
            let merge = !queue.is_empty();
            queue.extend(jobs.iter().map(|(id, q)| (class, *id, q)));
            if merge {
                // Two classes of one value: back to submit order.
                queue.sort_by_key(|(_, id, _)| *id);
            }
        }
        let levels = by_level
            .into_values()
            .map(|queues| {
                let heap = queues.keys().map(|t| Reverse((Key(book.share_key(*t)), *t))).collect();
                Level { queues, heap }
            })
            .collect();
        Queue { levels, level: 0, out: None }
    }

    /// The next job with its tenant and class indices. Keys are read from `book` when a tenant
    /// goes back in the heap, so placements made meanwhile count.
    pub fn next(&mut self, book: &Book) -> Option<(usize, Entry<'s>)> {
        loop {
            let level = self.levels.get_mut(self.level)?;
            if let Some(t) = self.out.take() {
                let (jobs, next) = &level.queues[&t];
                if *next < jobs.len() {
                    level.heap.push(Reverse((Key(book.share_key(t)), t)));
                }
            }
            match level.heap.pop() {
                Some(Reverse((_, t))) => {
                    let entry = level.queues.get_mut(&t).expect("tenant queue of a heap entry");
                    let next = entry.0[entry.1];
                    entry.1 += 1;
                    self.out = Some(t);
                    return Some((t, next));
                }
                None => self.level += 1,
            }
        }
    }
}
