//! Parsing and formatting of human sizes (`16GiB`, `512M`) and durations (`90s`, `1h30m`, `2:00:00`).

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("invalid size '{0}': expected a number with an optional unit such as 512M, 16GiB or 1T")]
    Size(String),
    #[error("invalid duration '{0}': expected e.g. 90s, 30m, 1h30m, 2d or HH:MM:SS (a bare number means minutes)")]
    Duration(String),
}

/// Parses a byte size. Units are powers of 1024 (`K`, `M`, `G`, `T`, optionally followed by `i`
/// and/or `B`); a bare number is bytes.
pub fn parse_size(input: &str) -> Result<u64, ParseError> {
    let err = || ParseError::Size(input.to_string());
    let s = input.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() {
        return Err(err());
    }
    let unit = unit.trim().to_ascii_lowercase();
    let multiplier: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "ki" | "kib" => 1 << 10,
        "m" | "mb" | "mi" | "mib" => 1 << 20,
        "g" | "gb" | "gi" | "gib" => 1 << 30,
        "t" | "tb" | "ti" | "tib" => 1 << 40,
        _ => return Err(err()),
    };
    let bytes = if number.contains('.') {
        let value: f64 = number.parse().map_err(|_| err())?;
        let bytes = value * multiplier as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(err());
        }
        bytes.round() as u64
    } else {
        let value: u64 = number.parse().map_err(|_| err())?;
        value.checked_mul(multiplier).ok_or_else(err)?
    };
    Ok(bytes)
}

/// Formats a byte size with a binary unit, e.g. `16GiB`, `512MiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, size) in UNITS {
        if bytes >= size {
            return if bytes.is_multiple_of(size) {
                format!("{}{}", bytes / size, name)
            } else {
                format!("{:.1}{}", bytes as f64 / size as f64, name)
            };
        }
    }
    format!("{bytes}B")
}

/// Parses a duration: `90s`, `30m`, `1h30m`, `2d`, `HH:MM:SS`, `MM:SS`, or a bare number of
/// minutes (as Slurm's `--time` does).
pub fn parse_duration(input: &str) -> Result<Duration, ParseError> {
    let err = || ParseError::Duration(input.to_string());
    let s = input.trim();
    if s.is_empty() {
        return Err(err());
    }
    if s.contains(':') {
        let parts: Vec<&str> = s.split(':').collect();
        if parts.len() > 3 || parts.iter().any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
            return Err(err());
        }
        let mut secs: u64 = 0;
        for part in parts {
            let value: u64 = part.parse().map_err(|_| err())?;
            secs = secs.checked_mul(60).and_then(|s| s.checked_add(value)).ok_or_else(err)?;
        }
        return Ok(Duration::from_secs(secs));
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        let minutes: u64 = s.parse().map_err(|_| err())?;
        return minutes.checked_mul(60).map(Duration::from_secs).ok_or_else(err);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(err)?;
        if digits == 0 {
            return Err(err());
        }
        let value: u64 = rest[..digits].parse().map_err(|_| err())?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let part = match unit {
            "ms" => Duration::from_millis(value),
            "s" | "sec" | "secs" => Duration::from_secs(value),
            "m" | "min" | "mins" => Duration::from_secs(value.checked_mul(60).ok_or_else(err)?),
            "h" | "hr" | "hours" => Duration::from_secs(value.checked_mul(3600).ok_or_else(err)?),
            "d" | "days" => Duration::from_secs(value.checked_mul(86_400).ok_or_else(err)?),
            _ => return Err(err()),
        };
        total = total.checked_add(part).ok_or_else(err)?;
    }
    Ok(total)
}

/// Formats a duration as `1h02m03s`, `4m05s` or `12s`.
pub fn format_duration(duration: Duration) -> String {
    let secs = duration.as_secs();
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    if h > 0 {
        format!("{h}h{m:02}m{s:02}s")
    } else if m > 0 {
        format!("{m}m{s:02}s")
    } else if secs > 0 {
        format!("{s}s")
    } else {
        format!("{}ms", duration.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("2 gb"), Ok(2 << 30));
        for bad in ["", "G", "12X", "-1G", "1.2.3G", "99999999999999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad} should be rejected");
        }
        assert_eq!(format_size(16 << 30), "16GiB");
        assert_eq!(format_size(1536 << 20), "1.5GiB");
        assert_eq!(format_size(12), "12B");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2:00:00"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1:30"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["", "h", "5x", "1:2:3:4", "::", "1h-3m"] {
            assert!(parse_duration(bad).is_err(), "{bad} should be rejected");
        }
        assert_eq!(format_duration(Duration::from_secs(3723)), "1h02m03s");
    }
}
