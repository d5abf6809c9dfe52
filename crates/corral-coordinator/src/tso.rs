//! The timestamp oracle (TSO), as TiKV PD runs it: `physical_ms << 18 | logical`, served by the
//! leader from memory inside a window whose upper bound is persisted through Raft first.
//!
//! Invariants:
//! - a timestamp is served only if its physical part is at or below a window end that is
//!   committed in the Raft log, so a new leader, which starts above the committed window end,
//!   is above everything any earlier leader served;
//! - a leader serves only while a quorum acknowledged it within the lease, shorter than the time
//!   followers wait before electing another leader, so a deposed leader stops first;
//! - a wall clock that jumps backwards never makes timestamps go backwards (logged).

use corral_types::Timestamp;
use prometheus_client::metrics::counter::Counter;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// How far ahead of its clock a leader persists the window.
pub const WINDOW_MS: u64 = 3_000;
/// How far above the stamps a window reaches while the stamps run ahead of the clock (after a
/// failover): 100 ms of 2^18 stamps each.
pub const STEP_MS: u64 = 100;

// The ledger trusts a worker's run time up to the TSO interval plus this allowance, which
// must cover how far the stamps can run ahead of a leader's clock.
const _: () = assert!(corral_core::TSO_LEAD_ALLOWANCE_MS >= WINDOW_MS + 1_000);
/// Largest range one request may take.
pub const MAX_COUNT: u64 = 100_000;

/// Failpoint adding milliseconds (may be negative) to this process's wall clock, to test a
/// coordinator whose clock is wrong: `FAILPOINTS=clock-skew-ms=return(3600000)` in builds with
/// the `failpoints` feature.
pub const CLOCK_SKEW_FAILPOINT: &str = "clock-skew-ms";

/// Wall clock in Unix milliseconds, with the skew failpoint applied.
#[derive(Debug)]
pub struct Clock {
    skew_ms: i64,
}

impl Default for Clock {
    fn default() -> Self {
        let skew_ms = configured_skew_ms();
        if skew_ms != 0 {
            tracing::warn!(skew_ms, "clock-skew failpoint active");
        }
        Clock { skew_ms }
    }
}

fn configured_skew_ms() -> i64 {
    crate::failpoints::setup();
    fail::fail_point!(CLOCK_SKEW_FAILPOINT, |value| value.and_then(|v| v.parse().ok()).unwrap_or(0));
    0
}

impl Clock {
    pub fn now_ms(&self) -> u64 {
        let real = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        real.saturating_add_signed(self.skew_ms)
    }
}

/// The in-memory part of the oracle on one coordinator.
#[derive(Debug, Default)]
pub(crate) struct TsoState {
    /// Raft term this state was initialized for; `None` until a leader initialized it.
    pub term: Option<u64>,
    /// Last timestamp handed out (or the floor a new leader starts above).
    pub last: Timestamp,
    /// Committed upper bound of the physical part.
    pub window_end_ms: u64,
    /// When the clock-behind warning was last logged (rate limit).
    pub warned_at_ms: u64,
}

/// Outcome of an allocation attempt.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Allocation {
    /// First timestamp of the range.
    Granted(Timestamp),
    /// The range needs a physical time above the committed window: extend it to at least this.
    NeedsWindow(u64),
}

impl TsoState {
    /// Takes `count` consecutive timestamps, or says how far the window must grow first.
    pub fn allocate(&mut self, now_ms: u64, count: u64) -> Allocation {
        debug_assert!((1..=MAX_COUNT).contains(&count));
        let last_ms = self.last.physical_ms();
        // A new leader starts above the previous window (up to WINDOW_MS ahead of the clock), so
        // only a clock behind by more than a window means it jumped back; say so once a second.
        if now_ms + WINDOW_MS + 1_000 < last_ms && now_ms >= self.warned_at_ms + 1_000 {
            self.warned_at_ms = now_ms;
            tracing::warn!(now_ms, tso_ms = last_ms, "wall clock is behind the tso: timestamps keep increasing");
        }
        let mut physical = now_ms.max(last_ms);
        let mut logical = if physical == last_ms { self.last.logical() + 1 } else { 0 };
        if logical + count - 1 > Timestamp::MAX_LOGICAL {
            physical += 1;
            logical = 0;
        }
        if physical > self.window_end_ms {
            return Allocation::NeedsWindow(physical);
        }
        self.last = Timestamp::compose(physical, logical + count - 1);
        Allocation::Granted(Timestamp::compose(physical, logical))
    }
}

/// The oracle of one coordinator: state plus the clock.
#[derive(Debug, Default)]
pub(crate) struct Tso {
    pub clock: Clock,
    pub state: Mutex<TsoState>,
    /// Serializes initialization and window extensions (each a Raft proposal).
    pub extending: tokio::sync::Mutex<()>,
    /// An early extension is already on its way.
    pub prefetching: AtomicBool,
    /// Timestamps handed out by this node (`corral_tso_timestamps_total`).
    pub served: Counter,
}

impl Tso {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, TsoState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn begin_prefetch(&self) -> bool {
        !self.prefetching.swap(true, Ordering::SeqCst)
    }

    pub fn end_prefetch(&self) {
        self.prefetching.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(last: Timestamp, window_end_ms: u64) -> TsoState {
        TsoState { term: Some(1), last, window_end_ms, warned_at_ms: 0 }
    }

    #[test]
    fn ranges_are_contiguous_and_increasing() {
        let mut s = state(Timestamp::compose(1_000, 5), 5_000);
        assert_eq!(s.allocate(1_000, 3), Allocation::Granted(Timestamp::compose(1_000, 6)));
        assert_eq!(s.last, Timestamp::compose(1_000, 8));
        assert_eq!(s.allocate(2_000, 1), Allocation::Granted(Timestamp::compose(2_000, 0)));
    }

    #[test]
    fn a_clock_that_jumps_back_never_moves_timestamps_back() {
        let mut s = state(Timestamp::compose(10_000, 0), 20_000);
        let Allocation::Granted(a) = s.allocate(10_000, 1) else { panic!() };
        let Allocation::Granted(b) = s.allocate(3_000, 1) else { panic!() };
        assert!(b > a, "{b:?} after {a:?}");
        assert_eq!(b.physical_ms(), 10_000);
    }

    #[test]
    fn logical_overflow_moves_to_the_next_millisecond() {
        let mut s = state(Timestamp::compose(1_000, Timestamp::MAX_LOGICAL - 2), 5_000);
        let Allocation::Granted(t) = s.allocate(1_000, 10) else { panic!() };
        assert_eq!(t, Timestamp::compose(1_001, 0));
    }

    #[test]
    fn nothing_is_served_above_the_committed_window() {
        let mut s = state(Timestamp::compose(1_000, 0), 1_500);
        assert_eq!(s.allocate(1_600, 1), Allocation::NeedsWindow(1_600));
        assert_eq!(s.last, Timestamp::compose(1_000, 0), "a refused allocation changes nothing");
        s.window_end_ms = 5_000;
        assert_eq!(s.allocate(1_600, 1), Allocation::Granted(Timestamp::compose(1_600, 0)));
    }
}
