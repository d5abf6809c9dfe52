//! Which jobs changed at which revision (applied log index): a bounded, in-memory log of the
//! last applied entries' job ids, fed by the state machine's apply, that `WatchJobs` replays to
//! a client resuming from a revision.
//!
//! Invariant: `changed_since(r)` is complete for every `r >= floor()`: each job changed by an
//! entry after `r` (up to the last recorded revision) is in it, and so is the concatenation of
//! the windows `window_after` hands out from `r` on. The floor rises when old entries are
//! evicted (more than `capacity` job changes held) and is the applied index at open or after a
//! snapshot install (changes before that were never seen by this process).

use std::collections::{BTreeMap, VecDeque};

/// Job changes kept by default (about 16 bytes each).
pub const DEFAULT_CHANGE_LOG_CAPACITY: usize = 1_000_000;

/// The last applied entries that changed jobs, oldest first.
#[derive(Debug)]
pub struct ChangeLog {
    /// The entries, revisions increasing.
    entries: VecDeque<Entry>,
    /// Job changes held in `entries`.
    held: usize,
    /// Job changes ever recorded (what `Entry::recorded` counts).
    recorded: u64,
    capacity: usize,
    /// A resume from a revision below this one may miss changes.
    floor: u64,
    /// The last revision recorded (or the floor).
    last: u64,
}

/// The jobs one applied entry changed.
#[derive(Debug)]
struct Entry {
    revision: u64,
    jobs: Vec<u64>,
    /// Job changes recorded up to and including this entry's.
    recorded: u64,
}

/// A bounded part of the log (see [`ChangeLog::window_after`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeWindow {
    /// (revision of its latest change in the window, job), in increasing revision order, then
    /// by job id; each job once.
    pub changes: Vec<(u64, u64)>,
    /// Every change after the revision asked for, up to this one, is in `changes`.
    pub upto: u64,
    /// Whether later entries were left for the next window (from `upto`).
    pub more: bool,
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
        ChangeLog { entries: VecDeque::new(), held: 0, recorded: 0, capacity: capacity.max(1), floor, last: floor }
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
        self.recorded += jobs.len() as u64;
        self.entries.push_back(Entry { revision, jobs, recorded: self.recorded });
        self.evict();
    }

    fn evict(&mut self) {
        while self.held > self.capacity && self.entries.len() > 1 {
            if let Some(entry) = self.entries.pop_front() {
                self.held -= entry.jobs.len();
                self.floor = entry.revision;
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
        let start = self.entries.partition_point(|e| e.revision <= revision);
        let mut changed = BTreeMap::new();
        for entry in self.entries.range(start..) {
            for job in &entry.jobs {
                changed.insert(*job, entry.revision);
            }
        }
        Ok(changed)
    }

    /// The jobs changed after `revision`, from the whole entries that follow it as long as
    /// they hold at most `max` job changes together (at least one entry): what a reader goes
    /// through in memory bounded by `max` (and the largest entry), before it asks for the next
    /// window from `upto`. A job changed twice in the window comes once, at its latest revision.
    pub fn window_after(&self, revision: u64, max: usize) -> Result<ChangeWindow, Compacted> {
        if revision < self.floor {
            return Err(Compacted { asked: revision, oldest: self.floor });
        }
        let start = self.entries.partition_point(|e| e.revision <= revision);
        let mut latest: BTreeMap<u64, u64> = BTreeMap::new();
        let (mut taken, mut upto, mut more) = (0usize, self.last.max(revision), false);
        for (i, entry) in self.entries.range(start..).enumerate() {
            if i > 0 && taken + entry.jobs.len() > max {
                more = true;
                break;
            }
            taken += entry.jobs.len();
            upto = entry.revision;
            for job in &entry.jobs {
                latest.insert(*job, entry.revision);
            }
        }
        if !more {
            upto = self.last.max(revision);
        }
        let mut changes: Vec<(u64, u64)> = latest.into_iter().map(|(job, r)| (r, job)).collect();
        changes.sort_unstable();
        Ok(ChangeWindow { changes, upto, more })
    }

    /// How many job changes were recorded after `revision` (a job changed by two entries
    /// counts twice): how far a reader at `revision` is behind. Constant work.
    pub fn recorded_after(&self, revision: u64) -> Result<u64, Compacted> {
        if revision < self.floor {
            return Err(Compacted { asked: revision, oldest: self.floor });
        }
        let start = self.entries.partition_point(|e| e.revision <= revision);
        let before = match start {
            0 => self.entries.front().map_or(self.recorded, |e| e.recorded - e.jobs.len() as u64),
            n => self.entries[n - 1].recorded,
        };
        Ok(self.recorded - before)
    }

    /// Most job changes held (`raft.watch-history`).
    pub fn capacity(&self) -> usize {
        self.capacity
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
    fn windows_go_through_the_changes_in_bounded_steps() {
        let mut log = ChangeLog::new(100, 0);
        log.record(3, [1, 2]);
        log.record(5, [2]);
        log.record(8, [3, 1, 4]);
        log.record(9, []);
        let window = |after, max| log.window_after(after, max).expect("window");
        // Whole entries only: 2 changes fit, the third would split revision 5 from its window.
        assert_eq!(window(0, 2), ChangeWindow { changes: vec![(3, 1), (3, 2)], upto: 3, more: true });
        assert_eq!(window(3, 2), ChangeWindow { changes: vec![(5, 2)], upto: 5, more: true });
        // One entry larger than the window comes whole; the last window ends at the last revision.
        assert_eq!(window(5, 2), ChangeWindow { changes: vec![(8, 1), (8, 3), (8, 4)], upto: 9, more: false });
        // A job changed twice in one window comes once, at its latest revision.
        assert_eq!(window(0, 100).changes, vec![(5, 2), (8, 1), (8, 3), (8, 4)]);
        assert_eq!(window(9, 100), ChangeWindow { changes: vec![], upto: 9, more: false });
        assert_eq!(window(20, 100), ChangeWindow { changes: vec![], upto: 20, more: false });
        assert_eq!(log.recorded_after(0), Ok(6));
        assert_eq!(log.recorded_after(3), Ok(4));
        assert_eq!(log.recorded_after(4), Ok(4));
        assert_eq!(log.recorded_after(8), Ok(0));
        let mut small = ChangeLog::new(3, 0);
        small.record(1, [1]);
        small.record(2, [2, 3]);
        small.record(4, [4]);
        assert_eq!(small.window_after(0, 10), Err(Compacted { asked: 0, oldest: 1 }));
        assert_eq!(small.recorded_after(0), Err(Compacted { asked: 0, oldest: 1 }));
        assert_eq!(small.recorded_after(1), Ok(3));
        assert_eq!(small.recorded_after(2), Ok(1));
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
