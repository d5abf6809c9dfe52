//! Slurm's commands inside a job, served by the corral binary when it is called by their name:
//! the worker puts a directory of links named after them first on every job's `PATH`, so a
//! batch script's `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1` finds its head
//! node as under Slurm.
//!
//! Served here: `srun` (`srun.rs`), `scontrol show hostnames [LIST]` (one name a line; `LIST` defaults to
//! `SLURM_JOB_NODELIST`, as in Slurm) and `scontrol show hostlist LIST` (Slurm's compressed
//! form), answered without the coordinator; and, as the corral commands they translate to,
//! `scontrol [-o] show job [ID]` (`corral show --scontrol`: Slurm's `Key=Value` lines, `ID` defaulting to `SLURM_JOB_ID`), `squeue`
//! (`corral queue` in Slurm's columns: `--me`, `-u/--user`, `-n/--name`, `-t/--states`, `-j`,
//! `-h`, `-o`, `-O`, `-l`) and `scancel ID...`
//! (`corral cancel`), `sacct` (`corral show --sacct`: sacct's columns), and `sbatch` (`corral sbatch`: a job submitted from a job, e.g. the next
//! of a chain with `--dependency=afterok:$SLURM_JOB_ID`). Those reach the coordinator as `corral` does: `CORRAL_ENDPOINT`,
//! `CORRAL_TOKEN` and `CORRAL_CA`/`CORRAL_CERT`/`CORRAL_KEY` from the job's environment.
//! Anything else is a one-line error naming what is served.

use corral_types::hostlist;
use std::process::ExitCode;

/// What the binary does when called by an in-job command's name.
#[derive(Debug, PartialEq)]
pub enum InJob {
    /// Not one of Slurm's commands: the corral CLI as usual.
    Cli,
    /// Answered here: exit with this code.
    Exit(ExitCode),
    /// Run the corral CLI with these arguments (the first is the program name).
    Corral(Vec<String>),
}

/// Runs the in-job command `name` when the binary was called by it.
pub fn dispatch(name: &str, args: &[String]) -> InJob {
    let result = match name {
        "srun" => return InJob::Exit(crate::srun::main(args)),
        "scontrol" if is_show_job(args) => show_job(args, std::env::var("SLURM_JOB_ID").ok().as_deref()).map(corral),
        "scontrol" if matches!(args.first().map(String::as_str), Some("requeue" | "hold" | "release")) => {
            job_control(args).map(corral)
        }
        "scontrol" => scontrol(args, std::env::var("SLURM_JOB_NODELIST").ok().as_deref()).map(Answer::Print),
        "sacct" => sacct(args, std::env::var("SLURM_JOB_ID").ok().as_deref()).map(corral),
        // The pool's nodes; sinfo's options only shape its columns.
        "sinfo" => Ok(corral(vec!["nodes".to_string()])),
        "squeue" => squeue(args).map(corral),
        "scancel" => scancel(args).map(corral),
        // `corral sbatch`: the new job gets its own allocation's variables (see `--export`).
        "sbatch" => Ok(corral(std::iter::once("sbatch".to_string()).chain(args.iter().cloned()).collect())),
        _ => return InJob::Cli,
    };
    match result {
        Ok(Answer::Print(out)) => {
            print!("{out}");
            InJob::Exit(ExitCode::SUCCESS)
        }
        Ok(Answer::Corral(args)) => InJob::Corral(args),
        Err(e) => {
            eprintln!("{name}: error: {e}");
            InJob::Exit(ExitCode::from(1))
        }
    }
}

/// What one in-job command answers.
enum Answer {
    Print(String),
    Corral(Vec<String>),
}

/// The corral command line of translated arguments.
fn corral(args: Vec<String>) -> Answer {
    Answer::Corral(std::iter::once("corral".to_string()).chain(args).collect())
}

/// `scontrol ARGS` other than `show job`: its output, or a one-line error. `job_nodelist` is
/// the job's `SLURM_JOB_NODELIST`.
pub fn scontrol(args: &[String], job_nodelist: Option<&str>) -> Result<String, String> {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let (what, rest) = match words.as_slice() {
        ["show", what, rest @ ..] => (*what, rest),
        _ => {
            return Err(format!(
                "'scontrol {}' is not served here: use `scontrol show hostnames|hostlist|job` or `scontrol requeue|hold|release JOB`",
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
        other => Err(format!("'show {other}' is not served here: use `scontrol show hostnames|hostlist|job`")),
    }
}

/// scontrol's options that only shape its output: `--oneliner`, `--details` (the job's
/// details are all there is), `--quiet`, `--all`.
fn scontrol_option(word: &str) -> Option<bool> {
    match word {
        "-o" | "--oneliner" => Some(true),
        "-d" | "--details" | "-dd" | "-Q" | "--quiet" | "-a" | "--all" => Some(false),
        _ => None,
    }
}

/// `scontrol [OPTIONS] show job|jobid [OPTIONS] [ID]`.
fn is_show_job(args: &[String]) -> bool {
    let mut words = args.iter().filter(|w| scontrol_option(w).is_none());
    words.next().is_some_and(|w| w == "show") && words.next().is_some_and(|w| w == "job" || w == "jobid")
}

/// `scontrol show job [ID]` as `corral show ID` in Slurm's `Key=Value` format (`-o`: on one
/// line); `ID` defaults to the job's own.
fn show_job(args: &[String], own_job: Option<&str>) -> Result<Vec<String>, String> {
    let oneliner = args.iter().any(|w| scontrol_option(w) == Some(true));
    let rest: Vec<&String> = args.iter().filter(|w| scontrol_option(w).is_none()).skip(2).collect();
    let id = match rest.as_slice() {
        [] => own_job.ok_or("no job id given and SLURM_JOB_ID is not set: give one, e.g. `scontrol show job 12`")?,
        [id] => id.as_str(),
        _ => return Err(format!("show job takes one job id, got {}", rest.len())),
    };
    let mut out = vec!["show".to_string(), id.to_string(), "--scontrol".to_string()];
    if oneliner {
        out.push("--oneliner".into());
    }
    Ok(out)
}

/// The value of option `long`/`short` at `args[*i]`: `--long=V`, `-sV`, or the next argument.
fn option_value(args: &[String], i: &mut usize, long: &str, short: &str) -> Option<Result<String, String>> {
    let arg = &args[*i];
    if let Some(v) = arg.strip_prefix(&format!("{long}=")) {
        return Some(Ok(v.to_string()));
    }
    if arg == long || arg == short {
        *i += 1;
        return Some(args.get(*i).cloned().ok_or_else(|| format!("{arg} needs a value")));
    }
    match arg.strip_prefix(short) {
        Some(value) if !value.is_empty() && !arg.starts_with("--") => Some(Ok(value.to_string())),
        _ => None,
    }
}

/// Slurm's job state names (`-t`) as corral's: pending and running are all a queue holds.
fn queue_states(states: &str) -> Result<String, String> {
    states
        .split(',')
        .map(|s| match s.to_ascii_uppercase().as_str() {
            "PD" | "PENDING" => Ok("pending"),
            "R" | "RUNNING" => Ok("running"),
            _ => Err(format!("state '{s}' is not served here: PENDING (PD) or RUNNING (R)")),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|s| s.join(","))
}

/// squeue's `--long` columns.
const LONG_FORMAT: &str = "%.18i %.9P %.8j %.8u %.8T %.10M %.9l %.6D %R";

/// `squeue ARGS` as `corral queue`, printed in Slurm's columns (`-o/--format`, `-O/--Format`,
/// `-l/--long`, else squeue's default), `-h/--noheader`, `-j/--jobs`.
fn squeue(args: &[String]) -> Result<Vec<String>, String> {
    let mut out = vec!["queue".to_string()];
    let mut format = crate::squeue_format::DEFAULT_FORMAT.to_string();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        if arg == "--me" {
            out.push("--me".into());
        } else if arg == "-h" || arg == "--noheader" {
            out.push("--noheader".into());
        } else if arg == "-l" || arg == "--long" {
            format = LONG_FORMAT.into();
        } else if let Some(user) = option_value(args, &mut i, "--user", "-u") {
            out.extend(["--user".into(), user?]);
        } else if let Some(name) = option_value(args, &mut i, "--name", "-n") {
            out.extend(["--name".into(), name?]);
        } else if let Some(states) = option_value(args, &mut i, "--states", "-t") {
            out.extend(["--state".into(), queue_states(&states?)?]);
        } else if let Some(jobs) = option_value(args, &mut i, "--jobs", "-j") {
            out.extend(["--jobs".into(), jobs?]);
        } else if let Some(f) = option_value(args, &mut i, "--format", "-o") {
            format = f?;
        } else if let Some(fields) = option_value(args, &mut i, "--Format", "-O") {
            format = crate::squeue_format::format_of_fields(&fields?)?;
        } else {
            return Err(format!(
                "'{arg}' is not served here: squeue takes --me, -u/--user, -n/--name, -t/--states, -j/--jobs, -h/--noheader, -o/--format, -O/--Format, -l/--long"
            ));
        }
        i += 1;
    }
    crate::squeue_format::check_format(&format)?;
    out.extend(["--squeue-format".into(), format]);
    Ok(out)
}

/// `scontrol requeue|hold|release ID...` as `corral requeue|hold|release ID` (Lightning's
/// auto-requeue and `trap ... USR1` handlers call `scontrol requeue $SLURM_JOB_ID`).
fn job_control(args: &[String]) -> Result<Vec<String>, String> {
    match args {
        [what, id] if !id.starts_with('-') => Ok(vec![what.clone(), id.clone()]),
        [what, ..] => Err(format!("scontrol {what} takes one job id, e.g. `scontrol {what} $SLURM_JOB_ID`")),
        [] => Err("scontrol needs a command".into()),
    }
}

/// `sacct [-j ID,...] [-o FIELDS] [-n] [-p|-P] [-X] [-b]` as `corral show ID --sacct FIELDS`:
/// the jobs' rows and their steps' in sacct's columns (`ID` defaults to the job's own; a step
/// such as `12.batch` names its job). Its other options select jobs by time, user or state and
/// are not read: scripts end with `sacct -j $SLURM_JOB_ID --format=...` to log the job's
/// record, and submitit polls `sacct -o JobID,State,NodeList --parsable2 -j 12,13`.
fn sacct(args: &[String], own_job: Option<&str>) -> Result<Vec<String>, String> {
    let mut jobs: Vec<String> = Vec::new();
    let mut format = crate::sacct_format::DEFAULT_FIELDS.to_string();
    let mut flags: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        // Switches, alone or together (`-nPX`).
        let switches = arg.strip_prefix('-').filter(|s| !s.is_empty() && s.chars().all(|c| "npPXb".contains(c)));
        if let Some(switches) = switches {
            for c in switches.chars() {
                match c {
                    'n' => flags.push("--noheader"),
                    'p' => flags.push("--parsable"),
                    'P' => flags.push("--parsable2"),
                    'X' => flags.push("--allocations"),
                    _ => format = "JobID,State,ExitCode".into(),
                }
            }
        } else if let Some(flag) = match arg {
            "--noheader" => Some("--noheader"),
            "--parsable" => Some("--parsable"),
            "--parsable2" => Some("--parsable2"),
            "--allocations" => Some("--allocations"),
            _ => None,
        } {
            flags.push(flag);
        } else if arg == "--brief" {
            format = "JobID,State,ExitCode".into();
        } else if let Some(list) = option_value(args, &mut i, "--jobs", "-j") {
            for id in list?.split(',').map(|j| j.split('.').next().unwrap_or_default()).filter(|j| !j.is_empty()) {
                if !jobs.iter().any(|j| j == id) {
                    jobs.push(id.to_string());
                }
            }
        } else if let Some(fields) = option_value(args, &mut i, "--format", "-o") {
            format = fields?;
        }
        i += 1;
    }
    crate::sacct_format::check_format(&format)?;
    let (first, more) = match jobs.split_first() {
        Some((first, more)) => (first.clone(), more.to_vec()),
        None => (own_job.map(str::to_string).ok_or(
            "no job given and SLURM_JOB_ID is not set: give one with -j, or see `corral history` for the finished jobs",
        )?, Vec::new()),
    };
    let mut out = vec!["show".into(), first, "--sacct".into(), format];
    if !more.is_empty() {
        out.extend(["--jobs".into(), more.join(",")]);
    }
    // `-p` and `-P` together: `-P`, the last one sacct reads.
    if flags.contains(&"--parsable2") {
        flags.retain(|f| *f != "--parsable");
    }
    for flag in flags {
        if !out.iter().any(|f| f == flag) {
            out.push(flag.into());
        }
    }
    Ok(out)
}

/// `scancel ID...` as `corral cancel`.
fn scancel(args: &[String]) -> Result<Vec<String>, String> {
    if args.is_empty() {
        return Err("give the job ids to cancel, e.g. `scancel 12 13_4`".into());
    }
    if let Some(flag) = args.iter().find(|a| a.starts_with('-')) {
        return Err(format!("'{flag}' is not served here: scancel takes job ids (12, 12_4)"));
    }
    Ok(std::iter::once("cancel".to_string()).chain(args.iter().cloned()).collect())
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
        // `srun` is served by `srun.rs` (its own tests; run here it would start a step).
        for name in corral_worker::IN_JOB_COMMANDS.into_iter().filter(|n| *n != "srun") {
            assert_ne!(dispatch(name, &["show".into(), "hostnames".into(), "n1".into()]), InJob::Cli, "{name}");
        }
        assert_eq!(dispatch("corral", &[]), InJob::Cli);
    }

    /// `scontrol requeue|hold|release`, `sacct` and `sinfo` as the corral commands that do
    /// what scripts call them for.
    #[test]
    fn job_control_accounting_and_nodes_as_corral_commands() {
        let w = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        assert_eq!(job_control(&w("requeue 12")).unwrap(), w("requeue 12"));
        assert_eq!(job_control(&w("hold 12_3")).unwrap(), w("hold 12_3"));
        assert!(job_control(&w("release")).unwrap_err().contains("takes one job id"));
        let default = crate::sacct_format::DEFAULT_FIELDS;
        assert_eq!(
            sacct(&w("-j 12 --format=JobID,Elapsed -X"), None).unwrap(),
            w("show 12 --sacct JobID,Elapsed --allocations")
        );
        assert_eq!(
            sacct(&w("--jobs=12.batch,13,12 -n -P"), None).unwrap(),
            [w("show 12 --sacct"), vec![default.into()], w("--jobs 13 --noheader --parsable2")].concat()
        );
        assert_eq!(
            sacct(&w("-o JobID,State,NodeList --parsable2 -j 12,13_4 -j 14"), None).unwrap(),
            w("show 12 --sacct JobID,State,NodeList --jobs 13_4,14 --parsable2"),
            "as submitit polls its jobs"
        );
        assert_eq!(sacct(&w("--format=JobID,State"), Some("40")).unwrap(), w("show 40 --sacct JobID,State"));
        assert_eq!(
            sacct(&w("-nPX -j 7 -o State -S 2026-01-01"), None).unwrap(),
            w("show 7 --sacct State --noheader --parsable2 --allocations")
        );
        assert_eq!(sacct(&w("-b -p"), Some("3")).unwrap(), w("show 3 --sacct JobID,State,ExitCode --parsable"));
        assert_eq!(
            sacct(&w("-n -X -n -pP"), Some("3")).unwrap(),
            [w("show 3 --sacct"), vec![default.into()], w("--noheader --allocations --parsable2")].concat(),
            "each flag once, -P over -p"
        );
        assert!(sacct(&w("-o JobID,Bogus"), Some("3")).unwrap_err().contains("field 'Bogus' is not served here"));
        assert!(sacct(&[], None).unwrap_err().contains("SLURM_JOB_ID is not set"));
        let as_corral = |name: &str, args: &str| match dispatch(name, &w(args)) {
            InJob::Corral(argv) => argv.join(" "),
            other => panic!("{name} {args}: {other:?}"),
        };
        assert_eq!(as_corral("sinfo", "-N -l"), "corral nodes");
        assert_eq!(as_corral("scontrol", "requeue 7"), "corral requeue 7");
    }

    fn words(args: &str) -> Vec<String> {
        args.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn squeue_scancel_and_show_job_become_the_corral_commands() {
        let squeue = |args: &str| squeue(&words(args));
        let with_format =
            |line: &str, format: &str| [words(line), vec!["--squeue-format".into(), format.into()]].concat();
        let default = crate::squeue_format::DEFAULT_FORMAT;
        assert_eq!(squeue("").unwrap(), with_format("queue", default));
        assert_eq!(squeue("--me").unwrap(), with_format("queue --me", default));
        assert_eq!(squeue("-u ana -n train").unwrap(), with_format("queue --user ana --name train", default));
        assert_eq!(
            squeue("--user=ana -tPD,R").unwrap(),
            with_format("queue --user ana --state pending,running", default)
        );
        assert_eq!(squeue("-uana --states=RUNNING").unwrap(), with_format("queue --user ana --state running", default));
        assert_eq!(squeue("-h -j 12 -o %L").unwrap(), with_format("queue --noheader --jobs 12", "%L"));
        assert_eq!(
            squeue("--jobs=12,13_4 --Format=JobID,TimeLeft:8").unwrap(),
            with_format("queue --jobs 12,13_4", "%20i%8L")
        );
        assert_eq!(squeue("-l").unwrap(), with_format("queue", LONG_FORMAT));
        assert_eq!(scancel(&words("12 13_4")).unwrap(), words("cancel 12 13_4"));
        assert_eq!(show_job(&words("show job"), Some("12")).unwrap(), words("show 12 --scontrol"));
        assert_eq!(show_job(&words("show job 13"), Some("12")).unwrap(), words("show 13 --scontrol"));
        assert_eq!(show_job(&words("-o show jobid -d 13"), None).unwrap(), words("show 13 --scontrol --oneliner"));
        assert!(is_show_job(&words("--oneliner show job")) && is_show_job(&words("show jobid 4")));
        assert!(!is_show_job(&words("show hostnames")) && !is_show_job(&words("-o show")));
        let Answer::Corral(args) = corral(words("show 12")) else { panic!("not translated") };
        assert_eq!(args, words("corral show 12"), "the program name comes first");
        for (result, want) in [
            (squeue("-p gpu"), "'-p' is not served here"),
            (squeue("-o %w"), "'%w' is not served here"),
            (squeue("-O Bogus"), "field 'Bogus' is not served here"),
            (squeue("-u"), "-u needs a value"),
            (squeue("-t CD"), "state 'CD' is not served here"),
            (scancel(&[]), "give the job ids"),
            (scancel(&words("-u ana")), "'-u' is not served here"),
            (show_job(&words("show job"), None), "SLURM_JOB_ID is not set"),
            (show_job(&words("show job 1 2"), None), "takes one job id"),
        ] {
            let err = result.expect_err(want);
            assert!(err.contains(want) && !err.contains('\n'), "{want}: {err}");
        }
    }

    #[test]
    fn what_is_not_served_is_a_one_line_error() {
        for (args, want) in [
            ("show hostnames", "SLURM_JOB_NODELIST is not set"),
            ("show partition gpu", "not served here"),
            ("update job 12", "not served here"),
            ("show hostnames a b", "takes one host list"),
            ("show hostnames gpu-[01-", "invalid hostlist"),
        ] {
            let err = run(args, None).expect_err(args);
            assert!(err.contains(want) && !err.contains('\n'), "{args}: {err}");
        }
    }
}
