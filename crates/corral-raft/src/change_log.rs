//! Which jobs changed at which revision (applied log index): a bounded, in-memory log of the
//! last applied entries' job ids, fed by the state machine's apply, that `WatchJobs` replays to
//! a client resuming from a revision.
//!
//! Invariant: `changed_since(r)` is complete for every `r >= floor()`: each job changed by an
//! entry after `r` (up to the last recorded revision) is in it. The floor rises when old entries
//! are evicted (more than `capacity` job changes held) and is the applied index at open or
//! after a snapshot install (changes before that were never seen by this process).

use std::collections::{BTreeMap, VecDeque};

/// Job changes kept by default (about 16 bytes each).
pub const DEFAULT_CHANGE_LOG_CAPACITY: usize = 1_000_000;

/// The last applied entries that changed jobs, oldest first.
#[derive(Debug)]
pub struct ChangeLog {
    /// (revision, jobs changed by the entry at that revision), revisions increasing.
    entries: VecDeque<(u64, Vec<u64>)>,
    /// Job changes held in `entries`.
    held: usize,
    capacity: usize,
    /// A resume from a revision below this one may miss changes.
    floor: u64,
    /// The last revision recorded (or the floor).
    last: u64,
}

/// A resume from a revision whose changes were already evicted (or never seen).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("revision {asked} is too old to resume from: the oldest is {oldest}")]
pub struct Compacted {
    pub asked: u64,
    /// The oldest revision a resume may start from.
    pub oldest: u64,
}

impl Default for ChangeLog {
    fn default() -> Self {
        ChangeLog::new(DEFAULT_CHANGE_LOG_CAPACITY, 0)
    }
}

impl ChangeLog {
    /// An empty log of at most `capacity` job changes (at least one entry is always kept),
    /// complete from revision `floor` on.
    pub fn new(capacity: usize, floor: u64) -> Self {
        ChangeLog { entries: VecDeque::new(), held: 0, capacity: capacity.max(1), floor, last: floor }
    }

    /// Changes the capacity, evicting what no longer fits.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        self.evict();
    }

    /// Forgets everything: the state jumped to `revision` (a snapshot was installed).
    pub fn reset(&mut self, revision: u64) {
        self.entries.clear();
        self.held = 0;
        self.floor = revision;
        self.last = revision;
    }

    /// Records that the entry at `revision` changed `jobs` (revisions only increase).
    pub fn record(&mut self, revision: u64, jobs: impl IntoIterator<Item = u64>) {
        if revision <= self.last {
            return;
        }
        self.last = revision;
        let jobs: Vec<u64> = jobs.into_iter().collect();
        if jobs.is_empty() {
            return;
        }
        self.held += jobs.len();
        self.entries.push_back((revision, jobs));
        self.evict();
    }

    fn evict(&mut self) {
        while self.held > self.capacity && self.entries.len() > 1 {
            if let Some((revision, jobs)) = self.entries.pop_front() {
                self.held -= jobs.len();
                self.floor = revision;
            }
        }
    }

    /// The oldest revision a resume may start from.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// The last revision recorded.
    pub fn last(&self) -> u64 {
        self.last
    }

    /// Every job changed after `revision`, with the revision of its latest change.
    pub fn changed_since(&self, revision: u64) -> Result<BTreeMap<u64, u64>, Compacted> {
        if revision < self.floor {
            return Err(Compacted { asked: revision, oldest: self.floor });
        }
        let start = self.entries.partition_point(|(r, _)| *r <= revision);
        let mut changed = BTreeMap::new();
        for (r, jobs) in self.entries.range(start..) {
            for job in jobs {
                changed.insert(*job, *r);
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(u64, u64)]) -> BTreeMap<u64, u64> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn changes_after_a_revision_carry_their_latest_revision() {
        let mut log = ChangeLog::new(100, 0);
        log.record(3, [1, 2]);
        log.record(5, [2]);
        log.record(6, []);
        log.record(8, [3, 1]);
        assert_eq!(log.changed_since(0), Ok(map(&[(1, 8), (2, 5), (3, 8)])));
        assert_eq!(log.changed_since(3), Ok(map(&[(1, 8), (2, 5), (3, 8)])));
        assert_eq!(log.changed_since(5), Ok(map(&[(1, 8), (3, 8)])));
        assert_eq!(log.changed_since(8), Ok(map(&[])));
        assert_eq!(log.changed_since(100), Ok(map(&[])));
        assert_eq!(log.last(), 8);
    }

    #[test]
    fn eviction_raises_the_floor_and_refuses_older_resumes() {
        let mut log = ChangeLog::new(3, 0);
        log.record(1, [1]);
        log.record(2, [2, 3]);
        assert_eq!(log.floor(), 0);
        log.record(4, [4]);
        // 4 changes held, capacity 3: revision 1 goes, a resume from before it cannot be served.
        assert_eq!(log.floor(), 1);
        assert_eq!(log.changed_since(0), Err(Compacted { asked: 0, oldest: 1 }));
        assert_eq!(log.changed_since(1), Ok(map(&[(2, 2), (3, 2), (4, 4)])));
        log.set_capacity(1);
        assert_eq!(log.floor(), 2);
        assert_eq!(log.changed_since(2), Ok(map(&[(4, 4)])));
        assert!(log.changed_since(1).is_err());
    }

    #[test]
    fn one_entry_larger_than_the_capacity_is_kept() {
        let mut log = ChangeLog::new(2, 0);
        log.record(7, [1, 2, 3, 4]);
        assert_eq!(log.floor(), 0);
        assert_eq!(log.changed_since(0).map(|c| c.len()), Ok(4));
        log.record(9, [5]);
        assert_eq!(log.floor(), 7);
        assert_eq!(log.changed_since(7), Ok(map(&[(5, 9)])));
    }

    #[test]
    fn a_fresh_or_reset_log_is_complete_only_from_its_floor() {
        let mut log = ChangeLog::new(10, 40);
        assert_eq!(log.changed_since(39), Err(Compacted { asked: 39, oldest: 40 }));
        assert_eq!(log.changed_since(40), Ok(map(&[])));
        // Entries re-applied at or below the last revision (a restart's replay) are ignored.
        log.record(40, [1]);
        log.record(41, [2]);
        assert_eq!(log.changed_since(40), Ok(map(&[(2, 41)])));
        log.reset(90);
        assert_eq!(log.changed_since(41), Err(Compacted { asked: 41, oldest: 90 }));
        assert_eq!(log.changed_since(90), Ok(map(&[])));
        assert_eq!(log.last(), 90);
    }
}
