//! Leader-side timestamp source: strictly increasing `physical_ms << 18 | logical` stamps.

use corral_types::Timestamp;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Issues strictly increasing timestamps that also stay above every timestamp already applied,
/// so a wall clock that jumps backwards never makes them go backwards.
#[derive(Debug, Default)]
pub struct Tso {
    last: Mutex<Timestamp>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Tso {
    /// Next timestamp, above `floor` (the last applied timestamp of the state machine).
    pub fn next(&self, floor: Timestamp) -> Timestamp {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let wall = Timestamp::compose(now_ms(), 0);
        let prev = (*last).max(floor);
        if prev.physical_ms() > wall.physical_ms() + 1000 {
            tracing::warn!(wall_ms = wall.physical_ms(), tso_ms = prev.physical_ms(), "clock behind the tso");
        }
        let next = if wall > prev { wall } else { Timestamp(prev.0 + 1) };
        *last = next;
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strictly_increasing_and_above_floor() {
        let tso = Tso::default();
        let a = tso.next(Timestamp::ZERO);
        let b = tso.next(Timestamp::ZERO);
        assert!(b > a);
        let far = Timestamp::compose(now_ms() + 60_000, 5);
        let c = tso.next(far);
        assert!(c > far);
        assert!(tso.next(Timestamp::ZERO) > c);
    }
}
