//! Times on the command line: `--since` and `--until` as UTC dates, ages or TSO timestamps.

use anyhow::bail;
use corral_types::{parse_duration, Timestamp};
use std::time::{SystemTime, UNIX_EPOCH};

/// Bare numbers at least this large are TSO timestamps (smaller ones are ages in minutes);
/// every TSO timestamp since 1970-01-01T00:00:04Z is.
const MIN_BARE_TSO: u64 = 1_000_000_000;

/// Parses `2026-12-01`, `2026-12-01T08:00[:00][Z]` (UTC), an age such as `24h` (that long ago)
/// or a TSO timestamp (as `corral ts` prints).
pub fn parse_time(input: &str) -> anyhow::Result<Timestamp> {
    let s = input.trim();
    if let Some(tso) = s.parse::<u64>().ok().filter(|n| *n >= MIN_BARE_TSO) {
        return Ok(Timestamp(tso));
    }
    if let Ok(age) = parse_duration(s) {
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.saturating_sub(age);
        return Ok(Timestamp::compose(now.as_millis() as u64, 0));
    }
    let invalid = || {
        anyhow::anyhow!(
            "invalid time '{input}': expected a date such as 2026-12-01 or 2026-12-01T08:00:00Z, an age such as 24h, or a TSO timestamp"
        )
    };
    corral_types::parse_utc(s).ok_or_else(invalid)
}

/// A time to come (`corral node lease --until`): a date as [`parse_time`] reads it, a TSO
/// timestamp, or a duration such as `2h` (that long from now).
pub fn parse_future_time(input: &str) -> anyhow::Result<Timestamp> {
    if let Ok(ahead) = parse_duration(input.trim()) {
        let then = SystemTime::now().duration_since(UNIX_EPOCH)?.saturating_add(ahead);
        return Ok(Timestamp::compose(then.as_millis() as u64, 0));
    }
    parse_time(input).map_err(|_| {
        anyhow::anyhow!(
            "invalid time '{input}': expected a date such as 2026-12-31T18:00:00Z, a duration from now such as 2h, or a TSO timestamp"
        )
    })
}

/// `--since` and `--until`, parsed and checked.
pub fn time_range(since: Option<&str>, until: Option<&str>) -> anyhow::Result<(Option<Timestamp>, Option<Timestamp>)> {
    let since = since.map(parse_time).transpose()?;
    let until = until.map(parse_time).transpose()?;
    if let (Some(s), Some(u)) = (since, until) {
        if s >= u {
            bail!("--since must be before --until");
        }
    }
    Ok((since, until))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_utc_dates_or_ages() {
        assert_eq!(parse_time("2026-12-03T12:05:12Z").unwrap().physical_ms(), 1_796_299_512_000);
        assert_eq!(parse_time("2000-02-29").unwrap().physical_ms(), 951_782_400_000);
        let ago = parse_time("1h").unwrap().physical_ms();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        assert!(now - ago >= 3_600_000 && now - ago < 3_660_000);
        for bad in ["yesterday", "2026-13-01", "2026-12-01T25:00", "2026-12"] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
        // A TSO timestamp as `corral ts` prints it; a small bare number stays an age in minutes.
        let ahead = parse_future_time("1h").unwrap().physical_ms();
        assert!(ahead - now >= 3_590_000 && ahead - now < 3_660_000, "a duration is from now");
        assert_eq!(parse_future_time("2026-12-31T18:00:00Z").unwrap().physical_ms(), 1_798_740_000_000);
        assert!(parse_future_time("soon").is_err());
        let tso = Timestamp::compose(1_796_299_512_000, 7);
        assert_eq!(parse_time(&tso.0.to_string()).unwrap(), tso);
        let ten_minutes_ago = parse_time("10").unwrap().physical_ms();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        assert!(now - ten_minutes_ago >= 600_000 && now - ten_minutes_ago < 660_000);
    }
}
