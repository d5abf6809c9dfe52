//! Slurm's commands inside a job, served by the corral binary when it is called by their name:
//! the worker puts a directory of links named after them first on every job's `PATH`, so a
//! batch script's `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1` finds its head
//! node as under Slurm.
//!
//! Served so far: `srun` (`srun.rs`), `scontrol show hostnames [LIST]` (one name a line; `LIST` defaults to
//! `SLURM_JOB_NODELIST`, as in Slurm) and `scontrol show hostlist LIST` (Slurm's compressed
//! form). Anything else is a one-line error naming what is served.

use corral_types::hostlist;
use std::process::ExitCode;

/// Runs the in-job command `name` when the binary was called by it; `None` otherwise.
pub fn dispatch(name: &str, args: &[String]) -> Option<ExitCode> {
    let result = match name {
        "srun" => return Some(crate::srun::main(args)),
        "scontrol" => scontrol(args, std::env::var("SLURM_JOB_NODELIST").ok().as_deref()),
        _ => return None,
    };
    Some(match result {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("scontrol: error: {e}");
            ExitCode::from(1)
        }
    })
}

/// `scontrol ARGS`: its output, or a one-line error. `job_nodelist` is the job's
/// `SLURM_JOB_NODELIST`.
pub fn scontrol(args: &[String], job_nodelist: Option<&str>) -> Result<String, String> {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let (what, rest) = match words.as_slice() {
        ["show", what, rest @ ..] => (*what, rest),
        _ => {
            return Err(format!(
                "'scontrol {}' is not served here: use `scontrol show hostnames|hostlist`",
                words.join(" ")
            ))
        }
    };
    let list = match rest {
        [] => None,
        [list] => Some(*list),
        _ => return Err(format!("show {what} takes one host list, got {}", rest.len())),
    };
    match what {
        "hostnames" | "hostname" => {
            let list = list
                .or(job_nodelist)
                .ok_or("no host list given and SLURM_JOB_NODELIST is not set: give one, e.g. gpu-[01-04]")?;
            let names = hostlist::expand(list).map_err(|e| e.to_string())?;
            Ok(names.iter().map(|n| format!("{n}\n")).collect())
        }
        "hostlist" => {
            let list = list.ok_or("show hostlist needs a comma-separated list of names")?;
            let names = hostlist::expand(list).map_err(|e| e.to_string())?;
            Ok(format!("{}\n", hostlist::compress(&names)))
        }
        other => Err(format!("'show {other}' is not served here: use `scontrol show hostnames|hostlist`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &str, nodelist: Option<&str>) -> Result<String, String> {
        scontrol(&args.split_whitespace().map(str::to_string).collect::<Vec<_>>(), nodelist)
    }

    #[test]
    fn hostnames_and_hostlists_read_as_scontrol_writes_them() {
        assert_eq!(run("show hostnames gpu-[01-03]", None).unwrap(), "gpu-01\ngpu-02\ngpu-03\n");
        assert_eq!(run("show hostnames", Some("w[2,1]")).unwrap(), "w2\nw1\n", "the job's list, in its order");
        assert_eq!(run("show hostname n1", None).unwrap(), "n1\n");
        assert_eq!(run("show hostlist gpu-01,gpu-02,gpu-03,login", None).unwrap(), "gpu-[01-03],login\n");
    }

    #[test]
    fn every_command_the_worker_links_is_served() {
        for name in corral_worker::IN_JOB_COMMANDS {
            assert!(dispatch(name, &["show".into(), "hostnames".into(), "n1".into()]).is_some(), "{name}");
        }
        assert!(dispatch("corral", &[]).is_none());
    }

    #[test]
    fn what_is_not_served_is_a_one_line_error() {
        for (args, want) in [
            ("show hostnames", "SLURM_JOB_NODELIST is not set"),
            ("show job 12", "not served here"),
            ("update job 12", "not served here"),
            ("show hostnames a b", "takes one host list"),
            ("show hostnames gpu-[01-", "invalid hostlist"),
        ] {
            let err = run(args, None).expect_err(args);
            assert!(err.contains(want) && !err.contains('\n'), "{args}: {err}");
        }
    }
}
