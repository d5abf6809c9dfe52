//! Slurm's output-file patterns (`--output`/`--error`: `%j %J %s %A %a %x %u %N %n %t %%`) and
//! their defaults. Pure: the worker expands them where a file is opened (the batch step, a
//! gang's node, a step's task), each caller saying where that is.

use crate::Job;

/// Slurm's `%a` of a job that is not an array task (its `NO_VAL`).
pub const NO_ARRAY_INDEX: u32 = u32::MAX - 1;

/// Where an output file is opened: what `%N`, `%n`, `%t` and `%J` stand for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputPlace<'a> {
    /// The node's name (`%N`).
    pub node: &'a str,
    /// The node's position in the allocation, from 0 (`%n`).
    pub node_index: u32,
    /// The task's rank in its step, from 0 (`%t`; the batch step is task 0).
    pub task: u32,
    /// The step (`%J` is `JOB.STEP`); `None`: the batch step or a whole job (`%J` is the id).
    pub step: Option<&'a str>,
}

/// Slurm's output file of a batch job given no `--output`: `slurm-%j.out`, or
/// `slurm-%A_%a.out` for a job array, relative to the working directory.
pub fn default_output_pattern(array: bool) -> &'static str {
    if array {
        "slurm-%A_%a.out"
    } else {
        "slurm-%j.out"
    }
}

/// Expands a Slurm output pattern for `job` at `place`: `%j` job id, `%J` job id and step,
/// `%A` array job id (else the job id), `%a` array task index (else 4294967294 as Slurm),
/// `%x` job name (`/` made `_`), `%u` user (the submitter as recorded, else the tenant), `%N`
/// node name, `%n` node index, `%t` task rank, `%s` step (`batch` for the batch step), `%%` a `%`. A width between `%` and the letter
/// pads numbers with zeros as Slurm does (`%4a`: `0007`); other `%` sequences stay as written.
/// A width is capped at 10 digits.
pub fn expand_output_pattern(pattern: &str, job: &Job, place: &OutputPlace<'_>) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut digits = String::new();
        while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            digits.push(*d);
            chars.next();
        }
        let width: usize = digits.parse::<usize>().unwrap_or(0).min(10);
        let number = |n: u64| format!("{n:0width$}");
        match chars.next() {
            Some('j') => out.push_str(&number(job.id)),
            Some('J') => {
                out.push_str(&number(job.id));
                if let Some(step) = place.step {
                    out.push('.');
                    out.push_str(step);
                }
            }
            Some('A') => out.push_str(&number(job.array_task.map_or(job.id, |t| t.array))),
            Some('a') => out.push_str(&number(u64::from(job.array_task.map_or(NO_ARRAY_INDEX, |t| t.index)))),
            Some('x') => out.push_str(&job.spec.name.replace('/', "_")),
            Some('u') => out.push_str(&job.spec.slurm.user.as_deref().unwrap_or(&job.spec.tenant).replace('/', "_")),
            Some('N') => out.push_str(place.node),
            Some('n') => out.push_str(&number(u64::from(place.node_index))),
            Some('t') => out.push_str(&number(u64::from(place.task))),
            Some('s') => out.push_str(place.step.unwrap_or("batch")),
            Some('%') if digits.is_empty() => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push_str(&digits);
                out.push(other);
            }
            None => {
                out.push('%');
                out.push_str(&digits);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ArrayTask, JobSpec, SlurmNames, Timestamp};

    fn job() -> Job {
        let spec = JobSpec {
            name: "train/ddp".into(),
            tenant: "team-a".into(),
            slurm: SlurmNames { user: Some("ana".into()), ..Default::default() },
            ..Default::default()
        };
        Job::pending(42, spec, String::new(), Timestamp(1))
    }

    #[test]
    fn every_slurm_pattern_expands() {
        let mut j = job();
        let place = OutputPlace { node: "gpu-02", node_index: 1, task: 3, step: Some("0") };
        assert_eq!(
            expand_output_pattern("%j %J %A %a %x %u %N %n %t %% %q %", &j, &place),
            "42 42.0 42 4294967294 train_ddp ana gpu-02 1 3 % %q %"
        );
        j.array_task = Some(ArrayTask { array: 40, index: 7 });
        assert_eq!(expand_output_pattern("%A_%a-%4a.%3t", &j, &OutputPlace::default()), "40_7-0007.000");
        assert_eq!(expand_output_pattern("slurm-%J.out", &j, &OutputPlace::default()), "slurm-42.out");
        assert_eq!(expand_output_pattern("%s", &j, &OutputPlace::default()), "batch", "Slurm's batch step");
        assert_eq!(expand_output_pattern("%s", &j, &place), "0");
        j.spec.slurm.user = None;
        assert_eq!(expand_output_pattern("%u", &j, &OutputPlace::default()), "team-a", "the tenant without a user");
        assert_eq!(expand_output_pattern("%99j", &j, &OutputPlace::default()), "0000000042", "width capped");
    }

    #[test]
    fn defaults_are_slurms() {
        assert_eq!(default_output_pattern(false), "slurm-%j.out");
        assert_eq!(default_output_pattern(true), "slurm-%A_%a.out");
    }
}
