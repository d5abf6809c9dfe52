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

/// One line describing why a config file does not parse: its kind and path, the line, and the
/// dotted key at `span` (the place the parser pointed at) when the message does not name it.
pub fn describe_config_error(
    kind: &str,
    path: &std::path::Path,
    text: &str,
    message: &str,
    span: Option<std::ops::Range<usize>>,
) -> String {
    let message = message.trim().replace('\n', " ");
    let Some(span) = span else {
        return format!("invalid {kind} {}: {message}", path.display());
    };
    let start = span.start.min(text.len());
    let line = text[..start].lines().count().max(1);
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_text = text[line_start..].lines().next().unwrap_or_default();
    let key = line_text.split_once('=').map(|(k, _)| k.trim().trim_matches('"')).filter(|k| !k.is_empty()).map(|k| {
        // The innermost table header above this line; `[[name]]` is element n of an array.
        let above = &text[..line_start];
        let table = above.lines().rev().map(str::trim).find(|l| l.starts_with('[')).map(|header| {
            let name = header.trim_matches(|c| c == '[' || c == ']').trim();
            if header.starts_with("[[") {
                let index = above.lines().map(str::trim).filter(|l| *l == header).count().saturating_sub(1);
                format!("{name}[{index}]")
            } else {
                name.to_string()
            }
        });
        match table {
            Some(table) if !table.is_empty() => format!("{table}.{k}"),
            _ => k.to_string(),
        }
    });
    match key {
        Some(key) if !message.starts_with(&key) && !message.contains(&format!("`{key}`")) => {
            format!("invalid {kind} {} (line {line}): {key}: {message}", path.display())
        }
        _ => format!("invalid {kind} {} (line {line}): {message}", path.display()),
    }
}

/// A duration in a config file, parsed once when the file is read: a string with a unit
/// (`"500ms"`, `"5s"`, `"2m"`, `"1h30m"`, `"7d"`). A bare number is refused: on the command
/// line (`--time 10`) it means minutes, as in Slurm, and in a config file it is surely a slip.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConfigDuration(pub Duration);

impl ConfigDuration {
    pub const fn from_millis(ms: u64) -> ConfigDuration {
        ConfigDuration(Duration::from_millis(ms))
    }

    pub const fn from_secs(secs: u64) -> ConfigDuration {
        ConfigDuration(Duration::from_secs(secs))
    }

    pub fn get(self) -> Duration {
        self.0
    }
}

impl std::str::FromStr for ConfigDuration {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let trimmed = value.trim();
        if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("'{value}' has no unit; write e.g. \"500ms\", \"5s\" or \"2m\""));
        }
        parse_duration(value).map(ConfigDuration).map_err(|e| e.to_string())
    }
}

impl std::fmt::Display for ConfigDuration {
    /// Exact and readable back: `500ms`, `5s`, `2m`, `3h`, `1d`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0.as_millis();
        let (value, unit) = [(86_400_000, "d"), (3_600_000, "h"), (60_000, "m"), (1_000, "s")]
            .into_iter()
            .find(|(size, _)| ms >= *size && ms.is_multiple_of(*size))
            .map_or((ms, "ms"), |(size, unit)| (ms / size, unit));
        write!(f, "{value}{unit}")
    }
}

impl serde::Serialize for ConfigDuration {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ConfigDuration {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ConfigDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration with a unit such as \"500ms\", \"5s\" or \"2m\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ConfigDuration, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ConfigDuration, E> {
                Err(E::custom(format!("{v} has no unit; write a string such as \"{v}s\" or \"{v}ms\"")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ConfigDuration, E> {
                Err(E::custom(format!("{v} has no unit; write a string such as \"{v}s\" or \"{v}ms\"")))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// A byte size in a config file, parsed once when the file is read: `"128MiB"`, `"16G"`, or a
/// whole number of bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConfigSize(pub u64);

impl ConfigSize {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl std::str::FromStr for ConfigSize {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        parse_size(value).map(ConfigSize).map_err(|e| e.to_string())
    }
}

impl std::fmt::Display for ConfigSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (value, unit) = [(1u64 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")]
            .into_iter()
            .find(|(size, _)| self.0 >= *size && self.0.is_multiple_of(*size))
            .map_or((self.0, "B"), |(size, unit)| (self.0 / size, unit));
        write!(f, "{value}{unit}")
    }
}

impl serde::Serialize for ConfigSize {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ConfigSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ConfigSize;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a size such as \"128MiB\" or \"16G\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ConfigSize, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ConfigSize, E> {
                Ok(ConfigSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ConfigSize, E> {
                u64::try_from(v).map(ConfigSize).map_err(|_| E::custom(format!("{v} is negative")))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_durations_need_a_unit_and_read_back_exactly() {
        assert_eq!("500ms".parse::<ConfigDuration>(), Ok(ConfigDuration::from_millis(500)));
        assert_eq!("1h30m".parse::<ConfigDuration>(), Ok(ConfigDuration::from_secs(5400)));
        let bare = "10".parse::<ConfigDuration>().expect_err("a bare number");
        assert!(bare.contains("'10' has no unit"), "{bare}");
        assert!("soon".parse::<ConfigDuration>().is_err());
        for text in ["500ms", "1500ms", "5s", "2m", "90s", "3h", "1d"] {
            let value: ConfigDuration = text.parse().expect(text);
            assert_eq!(value.to_string(), text);
            assert_eq!(value.to_string().parse::<ConfigDuration>(), Ok(value));
        }
        let json: Result<ConfigDuration, _> = serde_json::from_str("5");
        assert!(json.expect_err("a number").to_string().contains("has no unit"));
        assert_eq!(serde_json::from_str::<ConfigDuration>("\"2s\"").expect("string"), ConfigDuration::from_secs(2));
    }

    #[test]
    fn config_errors_name_the_key_and_line() {
        let path = std::path::Path::new("w.toml");
        let text = "node-name = \"a\"\nkill-grace = \"5\"\n[hygiene]\nsettle-time = \"soon\"\n";
        let at = |needle: &str| {
            let start = text.find(needle).expect(needle);
            Some(start..start + needle.len())
        };
        assert_eq!(
            describe_config_error("worker config", path, text, "'5' has no unit", at("\"5\"")),
            "invalid worker config w.toml (line 2): kill-grace: '5' has no unit"
        );
        assert_eq!(
            describe_config_error("worker config", path, text, "bad duration", at("\"soon\"")),
            "invalid worker config w.toml (line 4): hygiene.settle-time: bad duration"
        );
        let devices = "[[gpu.devices]]\nmemory = \"1G\"\n[[gpu.devices]]\nmemory = \"lots\"\n";
        let start = devices.find("\"lots\"").expect("lots");
        assert_eq!(
            describe_config_error("worker config", path, devices, "invalid size", Some(start..start + 6)),
            "invalid worker config w.toml (line 4): gpu.devices[1].memory: invalid size"
        );
        assert_eq!(
            describe_config_error("config", path, text, "missing field `x`", None),
            "invalid config w.toml: missing field `x`"
        );
    }

    #[test]
    fn config_sizes_read_units_and_bytes() {
        assert_eq!("128MiB".parse::<ConfigSize>(), Ok(ConfigSize(128 << 20)));
        assert_eq!(serde_json::from_str::<ConfigSize>("4096").expect("bytes"), ConfigSize(4096));
        assert_eq!(ConfigSize(128 << 20).to_string(), "128MiB");
        assert_eq!(ConfigSize(1000).to_string(), "1000B");
        assert!("lots".parse::<ConfigSize>().is_err());
    }

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
