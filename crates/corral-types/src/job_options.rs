//! Parsers of the Slurm-style job options `--array SPEC` and `--dependency SPEC`: pure, shared by
//! the CLI (which sends the parsed values) and the coordinator (which may check them again).

use crate::job::{
    ArrayRange, ArraySpec, Dependency, DependencyKind, JobId, JobSpecError, MAX_ARRAY_RANGES, MAX_ARRAY_TASKS,
    MAX_ARRAY_WINDOW,
};

fn invalid(field: &str, reason: String) -> JobSpecError {
    JobSpecError::Invalid { field: field.into(), reason }
}

/// `input` as an error message quotes it: its first 40 characters or so.
fn quoted(input: &str) -> String {
    const SHOWN: usize = 40;
    if input.len() <= SHOWN {
        return format!("'{input}'");
    }
    let mut end = SHOWN;
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    format!("'{}...' ({} bytes)", &input[..end], input.len())
}

impl ArraySpec {
    /// Parses Slurm's `--array` syntax: comma-separated indices and inclusive ranges with an
    /// optional step (`1,3,5-9`, `0-15:4`), then an optional `%N` limit of tasks unfinished at
    /// once (`0-999%16`). The indices are sorted and merged into as few ranges as they allow
    /// (`3,0,1,2` is `0-3`, `0,2,4` is `0-4:2`). Refused, with the reason: an index listed
    /// twice or ranges that overlap, an index of `MAX_ARRAY_TASKS` or more, more than
    /// `MAX_ARRAY_RANGES` ranges once merged, a `%N` of 0 or above `MAX_ARRAY_WINDOW`.
    pub fn parse(input: &str) -> Result<ArraySpec, JobSpecError> {
        let err = |why: &str| {
            invalid("array", format!("{}: {why} (expected e.g. 0-999%16, 1,3,5-9 or 0-15:4)", quoted(input)))
        };
        let s = input.trim();
        let (list, limit) = match s.split_once('%') {
            Some((list, limit)) => (list, Some(limit)),
            None => (s, None),
        };
        let max_running = match limit {
            Some(l) => match l.parse::<u32>() {
                Ok(n) if (1..=MAX_ARRAY_WINDOW).contains(&n) => Some(n),
                Ok(n) if n > MAX_ARRAY_WINDOW => {
                    return Err(err(&format!("the %limit is at most {MAX_ARRAY_WINDOW} tasks at once")))
                }
                _ => return Err(err("the %limit must be a number of at least 1")),
            },
            None => None,
        };
        if list.is_empty() {
            return Err(err("no index given"));
        }
        let index = |text: &str| -> Result<u32, JobSpecError> {
            match text.parse::<u32>() {
                Ok(i) if i < MAX_ARRAY_TASKS => Ok(i),
                Ok(_) => Err(err(&format!("index {text} is above {}", MAX_ARRAY_TASKS - 1))),
                Err(_) => Err(err(&format!("'{text}' is not an index"))),
            }
        };
        let mut ranges = Vec::new();
        for item in list.split(',') {
            let (span, step) = match item.split_once(':') {
                Some((span, step)) => match step.parse::<u32>() {
                    Ok(n) if n >= 1 => (span, n),
                    _ => return Err(err(&format!("step '{step}' must be a number of at least 1"))),
                },
                None => (item, 1),
            };
            let (first, last) = match span.split_once('-') {
                Some((a, b)) => (index(a)?, index(b)?),
                None if step != 1 => return Err(err("a step needs a range (e.g. 0-15:4)")),
                None => {
                    let i = index(span)?;
                    (i, i)
                }
            };
            if first > last {
                return Err(err(&format!("range {first}-{last} runs backwards")));
            }
            ranges.push(ArrayRange { first, last, step });
        }
        let mut spec = ArraySpec { ranges, max_running };
        spec.normalize().map_err(|why| err(&why))?;
        Ok(spec)
    }

    /// Puts ranges as written (or as a client sent them) in the form `parse` gives: each range
    /// ends on one of its indices, a single index has step 1, ranges sorted and merged into as
    /// few as they allow. Refuses a backward range or zero step, an index listed twice or
    /// ranges that overlap, and more than `MAX_ARRAY_RANGES` ranges once merged; more ranges
    /// than an array may have tasks are refused before any work. O(r log r) for r ranges.
    pub fn normalize(&mut self) -> Result<(), String> {
        if self.ranges.len() > MAX_ARRAY_TASKS as usize {
            return Err(format!("{} ranges, more than an array may have tasks", self.ranges.len()));
        }
        for r in &mut self.ranges {
            if r.step == 0 || r.first > r.last {
                return Err(format!("bad range {}-{}:{}", r.first, r.last, r.step));
            }
            // The range as its indices are: `0-10:4` is `0-8:4`, a single index has step 1.
            r.last = r.first + (r.last - r.first) / r.step * r.step;
            if r.first == r.last {
                r.step = 1;
            }
        }
        self.ranges = merged(std::mem::take(&mut self.ranges))?;
        if self.ranges.len() > MAX_ARRAY_RANGES {
            return Err(format!(
                "{} ranges even once consecutive and evenly spaced indices are merged, at most {MAX_ARRAY_RANGES}",
                self.ranges.len()
            ));
        }
        Ok(())
    }
}

/// `ranges` (each as its indices are: `last` is an index, a single index has step 1) sorted and
/// merged into as few as they allow; refuses an index listed twice and ranges that overlap.
fn merged(mut ranges: Vec<ArrayRange>) -> Result<Vec<ArrayRange>, String> {
    ranges.sort_unstable_by_key(|r| (r.first, r.last));
    for pair in ranges.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if b.first <= a.last {
            return Err(if a == b && a.first == a.last {
                format!("index {} is listed twice", a.first)
            } else {
                format!("{a} and {b} overlap: list each index once")
            });
        }
    }
    let single = |r: &ArrayRange| r.first == r.last;
    let mut out: Vec<ArrayRange> = Vec::with_capacity(ranges.len());
    for (i, r) in ranges.iter().enumerate() {
        if let Some(last) = out.last_mut() {
            let gap = r.first - last.last;
            // The step the two would share: a range's own; two single indices take theirs
            // when consecutive, or when a third index goes on with the same gap.
            let step = if !single(last) {
                last.step
            } else if !single(r) {
                r.step
            } else if gap == 1 || ranges.get(i + 1).is_some_and(|next| single(next) && next.first - r.first == gap) {
                gap
            } else {
                0
            };
            if step != 0 && gap == step && (single(r) || r.step == step) {
                last.last = r.last;
                last.step = step;
                continue;
            }
        }
        out.push(*r);
    }
    Ok(out)
}

/// Parses Slurm's `--dependency` syntax: comma-separated `afterok:ID[:ID...]`,
/// `afterany:ID[:ID...]`, `afternotok:ID[:ID...]`, `singleton`, and bare ids `ID[:ID...]`
/// (Slurm's default kind, `afterany`). Returns the dependencies in order and whether
/// `singleton` was given. `?` (any of) and the other kinds are refused.
pub fn parse_dependencies(input: &str) -> Result<(Vec<Dependency>, bool), JobSpecError> {
    let err = |why: String| {
        invalid(
            "dependency",
            format!("'{input}': {why} (expected e.g. afterok:12:13,afterany:14,afternotok:15,singleton)"),
        )
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("nothing given".into()));
    }
    if s.contains('?') {
        return Err(err("'?' (any of) is not supported: all dependencies must be met".into()));
    }
    let mut dependencies = Vec::new();
    let mut singleton = false;
    for item in s.split(',') {
        if item == "singleton" {
            singleton = true;
            continue;
        }
        let mut parts = item.split(':').peekable();
        // A bare id is Slurm's `afterany`.
        let bare = parts.peek().is_some_and(|first| first.bytes().all(|b| b.is_ascii_digit()) && !first.is_empty());
        let kind = match if bare { "afterany" } else { parts.next().unwrap_or("") } {
            "afterok" => DependencyKind::AfterOk,
            "afterany" => DependencyKind::AfterAny,
            "afternotok" => DependencyKind::AfterNotOk,
            "" => return Err(err("an empty item".into())),
            other => return Err(err(format!("'{other}' is not supported (afterok, afterany, afternotok, singleton)"))),
        };
        let mut any = false;
        for id in parts {
            let job_id: JobId = match id.parse() {
                Ok(n) if n >= 1 => n,
                _ => return Err(err(format!("'{id}' is not a job id"))),
            };
            any = true;
            dependencies.push(Dependency { kind, job_id });
        }
        if !any {
            return Err(err(format!("{} needs at least one job id", kind.as_str())));
        }
    }
    Ok((dependencies, singleton))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u32, last: u32, step: u32) -> ArrayRange {
        ArrayRange { first, last, step }
    }

    #[test]
    fn arrays_parse() {
        let a = ArraySpec::parse("0-999%16").unwrap();
        assert_eq!(a, ArraySpec { ranges: vec![range(0, 999, 1)], max_running: Some(16) });
        assert_eq!(a.len(), 1000);
        let a = ArraySpec::parse("1,3,5-9").unwrap();
        assert_eq!(a.ranges, vec![range(1, 1, 1), range(3, 3, 1), range(5, 9, 1)]);
        assert_eq!((a.max_running, a.len()), (None, 7));
        let a = ArraySpec::parse("0-15:4").unwrap();
        assert_eq!(a.ranges, vec![range(0, 12, 4)], "the last index of the range, not what was written");
        assert_eq!(a.len(), 4);
        assert_eq!(ArraySpec::parse("7").unwrap().len(), 1);
        for spec in ["0-999%16", "1,3,5-9", "0-12:4", "7", "0-4:2,7%3"] {
            assert_eq!(ArraySpec::parse(spec).unwrap().to_string(), spec, "Display writes what parse reads");
        }
    }

    #[test]
    fn arrays_are_sorted_and_merged_into_few_ranges() {
        let ranges = |s: &str| ArraySpec::parse(s).unwrap().ranges;
        assert_eq!(ranges("3,0,2,1"), vec![range(0, 3, 1)]);
        assert_eq!(ranges("0,2,4,6"), vec![range(0, 6, 2)]);
        assert_eq!(ranges("0-9,10-19,20"), vec![range(0, 20, 1)]);
        assert_eq!(ranges("0-8:4,12,16-20:4"), vec![range(0, 20, 4)]);
        assert_eq!(ranges("3,17"), vec![range(3, 3, 1), range(17, 17, 1)], "two indices alone stay apart");
        assert_eq!(ranges("0-9:2,11"), vec![range(0, 8, 2), range(11, 11, 1)]);
        let every: Vec<String> = (0..20_000).map(|i| i.to_string()).collect();
        let a = ArraySpec::parse(&every.join(",")).unwrap();
        assert_eq!((a.ranges.clone(), a.len()), (vec![range(0, 19_999, 1)], 20_000), "one range");
        let evens: Vec<String> = (0..50_000).map(|i| (2 * i).to_string()).collect();
        assert_eq!(ArraySpec::parse(&evens.join(",")).unwrap().ranges, vec![range(0, 99_998, 2)]);
        // As many ranges as allowed, and one more.
        // Gaps of 13 and 7 in turn: nothing merges.
        let apart = |n: usize| (0..n).map(|i| (i * 10 + (i % 2) * 3).to_string()).collect::<Vec<_>>().join(",");
        assert_eq!(ArraySpec::parse(&apart(MAX_ARRAY_RANGES)).unwrap().ranges.len(), MAX_ARRAY_RANGES);
        let e = ArraySpec::parse(&apart(MAX_ARRAY_RANGES + 1)).unwrap_err().to_string();
        assert!(e.contains("ranges even once") && e.contains("bytes)"), "{e}");
        assert!(e.len() < 300, "one short line, the input cut: {e}");
    }

    #[test]
    fn lookups_are_by_position() {
        let a = ArraySpec::parse("1,3,5-9,20-40:10").unwrap();
        let all: Vec<u32> = a.indices_from(0).collect();
        assert_eq!(all, vec![1, 3, 5, 6, 7, 8, 9, 20, 30, 40]);
        for (n, index) in all.iter().enumerate() {
            assert_eq!(a.index_at(n as u64), Some(*index));
            assert_eq!(a.position_of(*index), Some(n as u64));
            assert!(a.contains(*index));
            assert_eq!(a.indices_from(n as u64).collect::<Vec<_>>(), all[n..]);
        }
        assert_eq!(a.index_at(10), None);
        for absent in [0, 2, 4, 10, 25, 41] {
            assert!(!a.contains(absent) && a.position_of(absent).is_none(), "{absent}");
        }
        // A record of an earlier version, out of order with an index twice: found first.
        let old = ArraySpec { ranges: vec![range(5, 5, 1), range(0, 5, 1)], max_running: None };
        assert_eq!((old.position_of(5), old.position_of(0), old.len()), (Some(0), Some(1), 7));
        assert!(old.validate().unwrap_err().contains("overlap or are out of order"));
    }

    #[test]
    fn bad_arrays_are_refused_with_the_reason() {
        for (bad, why) in [
            ("", "no index"),
            ("5-1", "backwards"),
            ("0-9%0", "%limit"),
            ("0-9%x", "%limit"),
            ("0-9%10001", "at most 10000 tasks at once"),
            ("a-3", "not an index"),
            ("0-15:0", "step"),
            ("3:2", "needs a range"),
            ("1,,2", "not an index"),
            ("0-100000", "above"),
            ("0,0", "index 0 is listed twice"),
            ("5,1-9", "1-9 and 5 overlap"),
            ("0-99999,0-99999", "overlap"),
            ("0-10:2,1-11:2", "overlap"),
        ] {
            let e = ArraySpec::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("invalid array: ") && e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn dependencies_parse() {
        let (deps, singleton) = parse_dependencies("afterok:12:13,afterany:14,afternotok:15,singleton").unwrap();
        assert!(singleton);
        assert_eq!(
            deps,
            vec![
                Dependency { kind: DependencyKind::AfterOk, job_id: 12 },
                Dependency { kind: DependencyKind::AfterOk, job_id: 13 },
                Dependency { kind: DependencyKind::AfterAny, job_id: 14 },
                Dependency { kind: DependencyKind::AfterNotOk, job_id: 15 },
            ]
        );
        assert_eq!(parse_dependencies("singleton").unwrap(), (vec![], true));
        let any = |job_id| Dependency { kind: DependencyKind::AfterAny, job_id };
        assert_eq!(parse_dependencies("12").unwrap(), (vec![any(12)], false), "a bare id is afterany");
        assert_eq!(parse_dependencies("12:13,afterok:14").unwrap().0[..2], [any(12), any(13)]);
    }

    #[test]
    fn bad_dependencies_are_refused_with_the_reason() {
        for (bad, why) in [
            ("", "nothing"),
            ("afterok", "at least one job id"),
            ("afterok:", "not a job id"),
            ("afterok:x", "not a job id"),
            ("afterok:0", "not a job id"),
            ("after:3", "'after' is not supported"),
            ("afterok:1?afterany:2", "'?'"),
            ("afterok:1,", "empty item"),
            ("12:x", "not a job id"),
            ("0", "not a job id"),
        ] {
            let e = parse_dependencies(bad).unwrap_err().to_string();
            assert!(e.starts_with("invalid dependency: ") && e.contains(why), "{bad}: {e}");
        }
    }
}
