//! Parsers of the Slurm-style job options `--array SPEC` and `--dependency SPEC`: pure, shared by
//! the CLI (which sends the parsed values) and the coordinator (which may check them again).

use crate::job::{ArrayRange, ArraySpec, Dependency, DependencyKind, JobId, JobSpecError, MAX_ARRAY_TASKS};

fn invalid(field: &str, reason: String) -> JobSpecError {
    JobSpecError::Invalid { field: field.into(), reason }
}

impl ArraySpec {
    /// Parses Slurm's `--array` syntax: comma-separated indices and inclusive ranges with an
    /// optional step (`1,3,5-9`, `0-15:4`), then an optional `%N` limit of tasks running at
    /// once (`0-999%16`). Indices are at most `MAX_ARRAY_TASKS - 1`, and so is the task count.
    pub fn parse(input: &str) -> Result<ArraySpec, JobSpecError> {
        let err = |why: &str| invalid("array", format!("'{input}': {why} (expected e.g. 0-999%16, 1,3,5-9 or 0-15:4)"));
        let s = input.trim();
        let (list, limit) = match s.split_once('%') {
            Some((list, limit)) => (list, Some(limit)),
            None => (s, None),
        };
        let max_running = match limit {
            Some(l) => match l.parse::<u32>() {
                Ok(n) if n >= 1 => Some(n),
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
        let spec = ArraySpec { ranges, max_running };
        let count = spec.task_count();
        if count > u64::from(MAX_ARRAY_TASKS) {
            return Err(err(&format!("{count} tasks, at most {MAX_ARRAY_TASKS}")));
        }
        Ok(spec)
    }

    /// How many task indices the ranges list (an index listed twice counts twice).
    pub fn task_count(&self) -> u64 {
        self.ranges.iter().map(|r| u64::from(r.last.saturating_sub(r.first) / r.step.max(1)) + 1).sum()
    }
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
        assert_eq!(a.task_count(), 1000);
        let a = ArraySpec::parse("1,3,5-9").unwrap();
        assert_eq!(a.ranges, vec![range(1, 1, 1), range(3, 3, 1), range(5, 9, 1)]);
        assert_eq!((a.max_running, a.task_count()), (None, 7));
        let a = ArraySpec::parse("0-15:4").unwrap();
        assert_eq!(a.ranges, vec![range(0, 15, 4)]);
        assert_eq!(a.task_count(), 4);
        assert_eq!(ArraySpec::parse("7").unwrap().task_count(), 1);
    }

    #[test]
    fn bad_arrays_are_refused_with_the_reason() {
        for (bad, why) in [
            ("", "no index"),
            ("5-1", "backwards"),
            ("0-9%0", "%limit"),
            ("0-9%x", "%limit"),
            ("a-3", "not an index"),
            ("0-15:0", "step"),
            ("3:2", "needs a range"),
            ("1,,2", "not an index"),
            ("0-100000", "above"),
            ("0-99999,0-99999", "tasks, at most"),
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
