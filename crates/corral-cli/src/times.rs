//! Times on the command line: `--since` and `--until` as UTC dates, ages or TSO timestamps.

use anyhow::bail;
use corral_types::{parse_duration, Timestamp};
use std::time::{SystemTime, UNIX_EPOCH};

/// Days from 1970-01-01 to the proleptic Gregorian date `y-m-d` (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

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
    let s = s.trim_end_matches('Z');
    let (date, time) = s.split_once('T').unwrap_or((s, "00:00:00"));
    let d: Vec<i64> = date.split('-').map(|p| p.parse().map_err(|_| invalid())).collect::<Result<_, _>>()?;
    let t: Vec<i64> = time.split(':').map(|p| p.parse().map_err(|_| invalid())).collect::<Result<_, _>>()?;
    let valid = d.len() == 3 && (1..=12).contains(&d[1]) && (1..=31).contains(&d[2]) && (2..=3).contains(&t.len());
    if !valid || t[0] > 23 || t[1] > 59 || t.get(2).is_some_and(|s| *s > 59) {
        return Err(invalid());
    }
    let secs = days_from_civil(d[0], d[1], d[2]) * 86_400 + t[0] * 3600 + t[1] * 60 + t.get(2).copied().unwrap_or(0);
    if secs < 0 {
        return Err(invalid());
    }
    Ok(Timestamp::compose(secs as u64 * 1000, 0))
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
        let tso = Timestamp::compose(1_796_299_512_000, 7);
        assert_eq!(parse_time(&tso.0.to_string()).unwrap(), tso);
        let ten_minutes_ago = parse_time("10").unwrap().physical_ms();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        assert!(now - ten_minutes_ago >= 600_000 && now - ten_minutes_ago < 660_000);
    }
}
