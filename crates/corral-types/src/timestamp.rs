//! TSO timestamps: `physical_ms << 18 | logical`, one cluster-wide strictly increasing clock.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A timestamp issued by the coordinator's timestamp oracle.
///
/// Invariant: the leader never issues the same value twice and never goes backwards, even when
/// its wall clock does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// Bits reserved for the logical counter.
    pub const LOGICAL_BITS: u32 = 18;
    /// Largest logical value inside one millisecond.
    pub const MAX_LOGICAL: u64 = (1 << Self::LOGICAL_BITS) - 1;
    /// The zero timestamp, older than everything the oracle issues.
    pub const ZERO: Timestamp = Timestamp(0);

    pub fn compose(physical_ms: u64, logical: u64) -> Self {
        debug_assert!(logical <= Self::MAX_LOGICAL);
        Timestamp((physical_ms << Self::LOGICAL_BITS) | (logical & Self::MAX_LOGICAL))
    }

    pub fn physical_ms(self) -> u64 {
        self.0 >> Self::LOGICAL_BITS
    }

    pub fn logical(self) -> u64 {
        self.0 & Self::MAX_LOGICAL
    }

    /// Milliseconds between two timestamps (zero if `earlier` is not earlier).
    pub fn millis_since(self, earlier: Timestamp) -> u64 {
        self.physical_ms().saturating_sub(earlier.physical_ms())
    }

    /// Seconds since the Unix epoch as a float, for display only.
    pub fn unix_secs_f64(self) -> f64 {
        self.physical_ms() as f64 / 1000.0
    }
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC) for the physical part of a timestamp.
pub fn format_utc(ts: Timestamp) -> String {
    let ms = ts.physical_ms();
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil-from-days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        ms % 1000
    )
}

/// Days from 1970-01-01 to the proleptic Gregorian date `y-m-d` (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses a UTC date, `2026-12-01` or `2026-12-01T08:00[:00][Z]` (the one reading of a date for
/// the CLI's times and the worker's `lease-end`); `None`: not such a date.
pub fn parse_utc(input: &str) -> Option<Timestamp> {
    let s = input.trim().trim_end_matches('Z');
    let (date, time) = s.split_once('T').unwrap_or((s, "00:00:00"));
    let d: Vec<i64> = date.split('-').map(|p| p.parse().ok()).collect::<Option<_>>()?;
    let t: Vec<i64> = time.split(':').map(|p| p.parse().ok()).collect::<Option<_>>()?;
    let valid = d.len() == 3 && (1..=12).contains(&d[1]) && (1..=31).contains(&d[2]) && (2..=3).contains(&t.len());
    if !valid
        || !(0..=23).contains(&t[0])
        || !(0..=59).contains(&t[1])
        || t.get(2).is_some_and(|s| !(0..=59).contains(s))
    {
        return None;
    }
    let secs = days_from_civil(d[0], d[1], d[2]) * 86_400 + t[0] * 3600 + t[1] * 60 + t.get(2).copied().unwrap_or(0);
    // Past the timestamp's range (2^46 ms, about the year 4199): not a date it can hold.
    let ms = u64::try_from(secs).ok()?.checked_mul(1000).filter(|ms| ms >> (64 - Timestamp::LOGICAL_BITS) == 0)?;
    Some(Timestamp::compose(ms, 0))
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formatting() {
        assert_eq!(format_utc(Timestamp::compose(0, 0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_utc(Timestamp::compose(1_796_299_512_345, 7)), "2026-12-03T12:05:12.345Z");
        assert_eq!(format_utc(Timestamp::compose(951_782_400_000, 0)), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn compose_round_trips() {
        let ts = Timestamp::compose(1_700_000_000_123, 42);
        assert_eq!(ts.physical_ms(), 1_700_000_000_123);
        assert_eq!(ts.logical(), 42);
        assert!(Timestamp::compose(5, 0) > Timestamp::compose(4, Timestamp::MAX_LOGICAL));
    }

    #[test]
    fn millis_since_saturates() {
        let a = Timestamp::compose(1000, 3);
        let b = Timestamp::compose(1500, 0);
        assert_eq!(b.millis_since(a), 500);
        assert_eq!(a.millis_since(b), 0);
    }
}
