//! `corral sbatch`: the directives of a batch script (`#CORRAL <flag>` and the common `#SBATCH`
//! options), read up to the first command line as Slurm does, and mapped onto the same job
//! flags `corral submit` takes.

use crate::args::JobFlags;
use clap::Parser;
use corral_types::{parse_dependencies, ArraySpec, MAX_SCRIPT_BYTES};
use std::path::Path;

/// One directive line as corral flags.
#[derive(Debug, Parser)]
#[command(no_binary_name = true, disable_help_flag = true, disable_version_flag = true)]
struct DirectiveLine {
    #[command(flatten)]
    job: JobFlags,
}

/// What a script's directives ask for.
#[derive(Debug, Default)]
pub struct Directives {
    pub flags: JobFlags,
    /// One per directive that is not supported (ignored).
    pub warnings: Vec<String>,
}

/// Reads a batch script: at most `MAX_SCRIPT_BYTES`, UTF-8.
pub fn read_script(path: &Path) -> anyhow::Result<String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| anyhow::anyhow!("cannot read script {shown}: {e}"))?;
    if !meta.is_file() {
        anyhow::bail!("script {shown} is not a file");
    }
    if meta.len() > MAX_SCRIPT_BYTES as u64 {
        anyhow::bail!(
            "script {shown} is {} bytes, more than the {} KiB a batch script may have: move data into files it reads",
            meta.len(),
            MAX_SCRIPT_BYTES / 1024
        );
    }
    let file = std::fs::File::open(path).map_err(|e| anyhow::anyhow!("cannot read script {shown}: {e}"))?;
    read_script_from(file, &shown.to_string())
}

/// The batch script on standard input (`sbatch <<EOF`, `generate | sbatch`): up to
/// `MAX_SCRIPT_BYTES` read, no more. A terminal is refused rather than waited on.
pub fn read_script_stdin(input: impl std::io::Read + std::os::fd::AsFd) -> anyhow::Result<String> {
    if std::io::IsTerminal::is_terminal(&input.as_fd()) {
        anyhow::bail!(
            "no batch script given: name a script file, give a command with --wrap, or pipe the script in (`sbatch <<EOF ... EOF`)"
        );
    }
    read_script_from(input, "on standard input")
}

/// A script from `input`, read up to one byte past the limit (the cost of a reader that never
/// ends is bounded): `shown` names it in errors.
fn read_script_from(input: impl std::io::Read, shown: &str) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut input.take(MAX_SCRIPT_BYTES as u64 + 1), &mut bytes)
        .map_err(|e| anyhow::anyhow!("cannot read the script {shown}: {e}"))?;
    if bytes.len() > MAX_SCRIPT_BYTES {
        anyhow::bail!(
            "the script {shown} is more than the {} KiB a batch script may have: move data into files it reads",
            MAX_SCRIPT_BYTES / 1024
        );
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        anyhow::bail!("the script {shown} is empty");
    }
    String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("the script {shown} is not UTF-8 text"))
}

/// Parses the directives of `text` (named `script` in messages). With `strict`, an unsupported
/// directive is an error instead of a warning. Later lines override earlier ones.
pub fn parse_directives(script: &str, text: &str, strict: bool) -> Result<Directives, String> {
    let mut out = Directives::default();
    for (i, line) in text.lines().enumerate() {
        let number = i + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if !trimmed.starts_with('#') {
            break;
        }
        let (kind, rest) = if let Some(rest) = directive_body(line, "#SBATCH") {
            ("#SBATCH", rest)
        } else if let Some(rest) = directive_body(line, "#CORRAL") {
            ("#CORRAL", rest)
        } else {
            continue;
        };
        let at = |why: &str| format!("{script} line {number}: {kind}{rest}: {why}");
        let words = split_words(rest).map_err(|why| at(&why))?;
        let tokens = if kind == "#SBATCH" {
            let mut unsupported = Vec::new();
            let tokens = translate_sbatch(&words, &mut unsupported).map_err(|why| at(&why))?;
            for what in unsupported {
                let message = format!("{script} line {number}: {what} is not supported by corral");
                if strict {
                    return Err(format!("{message} (--strict): remove it, or submit without --strict to ignore it"));
                }
                out.warnings.push(format!("{message}: ignored"));
            }
            tokens
        } else {
            words
        };
        if tokens.is_empty() {
            continue;
        }
        let parsed = DirectiveLine::try_parse_from(&tokens).map_err(|e| {
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or("invalid directive").trim_start_matches("error: ");
            at(first)
        })?;
        let flags = parsed.job;
        if let Some(array) = &flags.array {
            ArraySpec::parse(array).map_err(|e| at(&e.to_string()))?;
        }
        if let Some(dependency) = &flags.dependency {
            parse_dependencies(dependency).map_err(|e| at(&e.to_string()))?;
        }
        out.flags = flags.over(std::mem::take(&mut out.flags));
    }
    Ok(out)
}

/// `corral sbatch`'s command line as Slurm's `sbatch` reads it: the options before the script
/// have Slurm's meaning, as in `#SBATCH` lines (`--job-name`, `-J`, `-t 1-00:00:00`, `--gres`,
/// `--mem=4000` in MB, `-o slurm-%j.out`, `-e`, `--requeue` ...), translated to corral's flags
/// where they are Slurm's; corral's own flags pass as they are (`--tenant`, `--image`,
/// `--endpoint`, `--strict`, `--parsable`, `--wait`, `-o json`). A value Slurm does not read
/// but corral does stays corral's (`--time 1h30m`, `--mem 16GiB`). Anything else of `argv`
/// (another command, the script and its arguments) is unchanged.
///
/// Returns the new argv and one warning per Slurm option corral does not support (an error
/// with `--strict`).
pub fn command_line(argv: Vec<String>) -> Result<(Vec<String>, Vec<String>), String> {
    // Every other command starts without building any of clap's definitions here.
    if !argv.iter().any(|a| a == "sbatch") {
        return Ok((argv, Vec::new()));
    }
    let Some(at) = subcommand_at(&argv) else { return Ok((argv, Vec::new())) };
    if argv[at] != "sbatch" {
        return Ok((argv, Vec::new()));
    }
    let corral = CorralOptions::of_sbatch();
    let strict = argv[at + 1..].iter().take_while(|w| w.starts_with('-')).any(|w| w == "--strict");
    let mut out: Vec<String> = argv[..=at].to_vec();
    let mut warnings = Vec::new();
    let mut i = at + 1;
    while i < argv.len() {
        let word = &argv[i];
        if word == "--" || !word.starts_with('-') || word == "-" {
            break;
        }
        i += 1;
        let (slurm, name, inline) = match word.strip_prefix("--") {
            Some(long) => {
                let (name, inline) = match long.split_once('=') {
                    Some((n, v)) => (n.to_string(), Some(v.to_string())),
                    None => (long.to_string(), None),
                };
                // One of Slurm's options (or an abbreviation of one), unless it is a corral flag
                // of that exact name that Slurm has not; anything else is left to clap (which
                // names what it is close to).
                let canonical = long_option(&name);
                let slurm = SLURM_LONG.contains(&canonical.as_str())
                    && (SLURM_LONG.contains(&name.as_str()) || !corral.has_long(&name));
                (slurm.then_some(canonical), format!("--{name}"), inline)
            }
            None => {
                let mut chars = word[1..].chars();
                let c = chars.next().unwrap_or('-');
                let rest: String = chars.collect();
                let slurm = SHORT
                    .iter()
                    .find(|(s, _)| *s == c)
                    .map(|(_, l)| l.to_string())
                    .or_else(|| SWITCHES.iter().find(|(s, _)| *s == Some(c)).map(|(_, l)| l.to_string()));
                (slurm, format!("-{c}"), (!rest.is_empty()).then(|| rest.trim_start_matches('=').to_string()))
            }
        };
        // What the command line itself decides: help, the output format, how the submit
        // prints and waits.
        let keep = match slurm.as_deref() {
            None => true,
            Some("help" | "version" | "parsable" | "wait" | "usage" | "wrap") => true,
            Some("output") => {
                let value = inline.as_deref().or(argv.get(i).map(String::as_str));
                matches!(value, Some("json" | "table"))
            }
            Some(_) => false,
        };
        if keep {
            out.push(word.clone());
            let takes_value = match name.strip_prefix("--") {
                Some(long) => corral.long_value.iter().any(|l| l == long),
                None => name[1..].chars().next().is_some_and(|c| corral.short_value.contains(&c)),
            };
            if takes_value && inline.is_none() && i < argv.len() {
                out.push(argv[i].clone());
                i += 1;
            }
            continue;
        }
        let long = slurm.unwrap_or_default();
        let switch = SWITCHES.iter().any(|(_, l)| *l == long);
        let mut words = vec![word.clone()];
        if !switch && inline.is_none() && i < argv.len() {
            words.push(argv[i].clone());
            i += 1;
        }
        let mut unsupported = Vec::new();
        let translated = translate_sbatch(&words, &mut unsupported);
        // A value Slurm does not read of one of corral's own flags (`--time 1h30m`, `--mem
        // 16GiB`), or `--priority`, which corral's is and Slurm's (a number for operators) is
        // not: corral's meaning.
        let corrals = (translated.is_err() && corral.has(&name)) || (long == "priority" && !unsupported.is_empty());
        if corrals {
            out.extend(words);
            continue;
        }
        match translated {
            Ok(flags) => {
                for what in unsupported {
                    let message = format!("{what} is not supported by corral");
                    if strict {
                        return Err(format!(
                            "{message} (--strict): remove it, or submit without --strict to ignore it"
                        ));
                    }
                    warnings.push(format!("{message}: ignored"));
                }
                out.extend(flags);
            }
            Err(why) => return Err(format!("{}: {why}", words.join(" "))),
        }
    }
    // Everything from the script on is the script's (`job.sh -o x` passes `-o x` to it), as
    // for Slurm's sbatch: clap reads it so after `--`.
    if argv.get(i).is_some_and(|w| w != "--") {
        out.push("--".into());
    }
    out.extend(argv[i..].iter().cloned());
    Ok((out, warnings))
}

/// The batch script of `sbatch --wrap COMMAND`, as Slurm's sbatch writes it.
pub fn wrapped(command: &str) -> String {
    format!("#!/bin/sh\n# This script was created by sbatch --wrap.\n\n{command}\n")
}

/// Where the subcommand is in `argv`: the first word that is neither an option of the root
/// command nor the value of one.
fn subcommand_at(argv: &[String]) -> Option<usize> {
    let root = CorralOptions::of_root();
    let mut i = 1;
    while i < argv.len() {
        let word = &argv[i];
        if word == "--" {
            return None;
        }
        if !word.starts_with('-') {
            return Some(i);
        }
        let takes_value = match word.strip_prefix("--") {
            Some(long) => !long.contains('=') && root.long_value.contains(&long.to_string()),
            None => word.len() == 2 && word[1..].chars().next().is_some_and(|c| root.short_value.contains(&c)),
        };
        i += if takes_value { 2 } else { 1 };
    }
    None
}

/// corral's own option names of a command, from its clap definition: which take a value.
struct CorralOptions {
    long_value: Vec<String>,
    long_switch: Vec<String>,
    short_value: Vec<char>,
    short_switch: Vec<char>,
}

impl CorralOptions {
    /// `--name` or `-c` is one of these options.
    fn has(&self, option: &str) -> bool {
        match option.strip_prefix("--") {
            Some(long) => self.has_long(long),
            None => option[1..]
                .chars()
                .next()
                .is_some_and(|c| self.short_value.contains(&c) || self.short_switch.contains(&c)),
        }
    }

    fn has_long(&self, long: &str) -> bool {
        self.long_value.iter().chain(&self.long_switch).any(|l| l == long)
    }

    fn of(command: &clap::Command) -> CorralOptions {
        let mut options = CorralOptions {
            long_value: Vec::new(),
            long_switch: Vec::new(),
            short_value: Vec::new(),
            short_switch: Vec::new(),
        };
        for arg in command.get_arguments() {
            let takes_value = arg.get_action().takes_values();
            let longs = arg.get_long().into_iter().chain(arg.get_all_aliases().unwrap_or_default());
            for long in longs {
                match takes_value {
                    true => options.long_value.push(long.to_string()),
                    false => options.long_switch.push(long.to_string()),
                }
            }
            match (arg.get_short(), takes_value) {
                (Some(short), true) => options.short_value.push(short),
                (Some(short), false) => options.short_switch.push(short),
                (None, _) => {}
            }
        }
        options
    }

    /// The root command's options (the global ones).
    fn of_root() -> CorralOptions {
        use clap::Args;
        CorralOptions::of(&crate::args::GlobalArgs::augment_args(clap::Command::new("corral")))
    }

    /// `corral sbatch`'s options, the global ones included.
    fn of_sbatch() -> CorralOptions {
        use clap::Args;
        let command = crate::args::SbatchArgs::augment_args(clap::Command::new("sbatch"));
        CorralOptions::of(&crate::args::GlobalArgs::augment_args(command))
    }
}

/// The text after `#SBATCH` (or `#CORRAL`) when the line is such a directive.
fn directive_body<'a>(line: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(prefix)?;
    (rest.is_empty() || rest.starts_with([' ', '\t'])).then_some(rest)
}

/// Splits a directive into words as a shell would (quotes, backslashes); a word starting with
/// `#` starts a comment.
fn split_words(text: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '#' if !in_word => break,
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => return Err("unterminated ' quote".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => word.push(chars.next().ok_or("unterminated \" quote")?),
                        Some(c) => word.push(c),
                        None => return Err("unterminated \" quote".into()),
                    }
                }
            }
            '\\' => {
                in_word = true;
                word.push(chars.next().ok_or("a trailing backslash")?);
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

/// Slurm's short options that take a value, with their long names.
const SHORT: &[(char, &str)] = &[
    ('A', "account"),
    ('a', "array"),
    ('C', "constraint"),
    ('c', "cpus-per-task"),
    ('D', "chdir"),
    ('d', "dependency"),
    ('e', "error"),
    ('G', "gpus"),
    ('J', "job-name"),
    ('L', "licenses"),
    ('M', "clusters"),
    ('m', "distribution"),
    ('N', "nodes"),
    ('n', "ntasks"),
    ('o', "output"),
    ('p', "partition"),
    ('q', "qos"),
    ('t', "time"),
    ('w', "nodelist"),
    ('x', "exclude"),
];

/// Slurm options without a value.
const SWITCHES: &[(Option<char>, &str)] = &[
    (Some('H'), "hold"),
    (None, "requeue"),
    (None, "no-requeue"),
    (None, "exclusive"),
    (None, "overcommit"),
    (Some('O'), "overcommit"),
    (None, "parsable"),
    (None, "wait"),
    (Some('W'), "wait"),
    (None, "contiguous"),
    (None, "spread-job"),
    (None, "test-only"),
    (None, "ignore-pbs"),
    (None, "get-user-env"),
    (Some('k'), "no-kill"),
    (Some('s'), "oversubscribe"),
    (Some('Q'), "quiet"),
    (Some('v'), "verbose"),
    (None, "use-min-nodes"),
    (None, "reboot"),
];

/// Slurm's `sbatch` long options (22.05, with its aliases) and corral's own, for
/// `long_option`: Slurm reads an option through `getopt_long`, which takes any unambiguous
/// abbreviation (`--err=` for `--error=`).
const SLURM_LONG: &[&str] = &[
    "account",
    "acctg-freq",
    "array",
    "batch",
    "bb",
    "bbf",
    "begin",
    "chdir",
    "cluster",
    "cluster-constraint",
    "clusters",
    "comment",
    "constraint",
    "container",
    "container-env",
    "container-image",
    "container-mounts",
    "container-workdir",
    "contiguous",
    "core-spec",
    "cores-per-socket",
    "cpu-freq",
    "cpus-per-gpu",
    "cpus-per-task",
    "deadline",
    "delay-boot",
    "dependency",
    "distribution",
    "error",
    "exclude",
    "exclusive",
    "export",
    "export-file",
    "extra-node-info",
    "get-user-env",
    "gid",
    "gpu-bind",
    "gpu-freq",
    "gpus",
    "gpus-per-node",
    "gpus-per-socket",
    "gpus-per-task",
    "gres",
    "gres-flags",
    "help",
    "hint",
    "hold",
    "ignore-pbs",
    "input",
    "job-name",
    "kill-on-invalid-dep",
    "licenses",
    "mail-type",
    "mail-user",
    "max-restarts",
    "mcs-label",
    "mem",
    "mem-bind",
    "mem-per-cpu",
    "mem-per-gpu",
    "mincpus",
    "network",
    "nice",
    "no-kill",
    "no-requeue",
    "nodefile",
    "nodelist",
    "nodes",
    "ntasks",
    "ntasks-per-core",
    "ntasks-per-gpu",
    "ntasks-per-node",
    "ntasks-per-socket",
    "open-mode",
    "output",
    "overcommit",
    "oversubscribe",
    "parsable",
    "partition",
    "power",
    "priority",
    "profile",
    "propagate",
    "qos",
    "quiet",
    "reboot",
    "requeue",
    "reservation",
    "signal",
    "sockets-per-node",
    "spread-job",
    "switches",
    "tasks-per-node",
    "test-only",
    "thread-spec",
    "threads-per-core",
    "time",
    "time-min",
    "tmp",
    "tres-per-task",
    "uid",
    "usage",
    "use-min-nodes",
    "verbose",
    "version",
    "wait",
    "wckey",
    "wrap",
];

/// The one option of `options` that `name` names, as getopt_long reads long options: itself
/// when it is one, else the only option it begins (an abbreviation); else `name` as it is.
pub(crate) fn unabbreviated(name: &str, options: &[&str]) -> String {
    if name.is_empty() || options.contains(&name) {
        return name.to_owned();
    }
    let mut matching = options.iter().filter(|o| o.starts_with(name));
    match (matching.next(), matching.next()) {
        (Some(one), None) => (*one).to_owned(),
        _ => name.to_owned(),
    }
}

/// The long option `name` stands for, as Slurm reads it: itself when it is one, Slurm's alias
/// resolved (`tasks-per-node`), or the one option an abbreviation begins; else `name`.
fn long_option(name: &str) -> String {
    let name = unabbreviated(name, SLURM_LONG);
    match name.as_str() {
        "tasks-per-node" => "ntasks-per-node".to_string(),
        _ => name,
    }
}

/// `#SBATCH` words to corral flags; options corral does not support are named in `unsupported`.
fn translate_sbatch(words: &[String], unsupported: &mut Vec<String>) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let word = &words[i];
        i += 1;
        // (long name, value)
        let (name, inline): (String, Option<String>) = if let Some(long) = word.strip_prefix("--") {
            match long.split_once('=') {
                Some((n, v)) => (long_option(n), Some(v.to_string())),
                None => (long_option(long), None),
            }
        } else if let Some(short) = word.strip_prefix('-').filter(|s| !s.is_empty()) {
            let mut chars = short.chars();
            let c = chars.next().unwrap_or('-');
            let rest: String = chars.collect();
            if let Some((_, long)) = SHORT.iter().find(|(s, _)| *s == c) {
                (long.to_string(), (!rest.is_empty()).then(|| rest.trim_start_matches('=').to_string()))
            } else if let Some((_, long)) = SWITCHES.iter().find(|(s, _)| *s == Some(c)) {
                if !rest.is_empty() {
                    return Err(format!("-{c} takes no value"));
                }
                (long.to_string(), None)
            } else {
                unsupported.push(format!("option -{c}"));
                // Skip its value if it has one.
                if rest.is_empty() && words.get(i).is_some_and(|w| !w.starts_with('-')) {
                    i += 1;
                }
                continue;
            }
        } else {
            return Err(format!("'{word}' is not an option (expected e.g. --gpus=2)"));
        };
        if SWITCHES.iter().any(|(_, long)| *long == name) {
            // Slurm's optional values: `--exclusive[=user|mcs|topo]` (corral's whole nodes are
            // exclusive to the job, which satisfies each), `--get-user-env[=TIMEOUT]`.
            if inline.is_some() && !matches!(name.as_str(), "exclusive" | "get-user-env") {
                return Err(format!("--{name} takes no value"));
            }
            match name.as_str() {
                "hold" => out.push("--hold".into()),
                "no-requeue" => out.push("--no-requeue".into()),
                "exclusive" => out.push("--exclusive".into()),
                // What the submit prints and whether it waits are the command line's business.
                "parsable" | "wait" => {}
                // Preempted jobs go back to the queue anyway.
                "requeue" => {}
                _ => unsupported.push(format!("--{name}")),
            }
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => match words.get(i) {
                // An option corral does not know may take no value: the next option is not its.
                Some(v) if KNOWN_WITH_VALUE.contains(&name.as_str()) || !v.starts_with('-') => {
                    i += 1;
                    v.clone()
                }
                None if KNOWN_WITH_VALUE.contains(&name.as_str()) => return Err(format!("--{name} needs a value")),
                _ => {
                    unsupported.push(format!("--{name}"));
                    continue;
                }
            },
        };
        let mut flag = |f: &str, v: String| {
            out.push(f.to_string());
            out.push(v);
        };
        let mut typed = |f: &str, (kind, count): (Option<String>, String)| {
            flag(f, count);
            if let Some(kind) = kind {
                flag("--gpu-type", kind);
            }
        };
        match name.as_str() {
            // Slurm counts --gpus over the job, --gres and --gpus-per-node on each node.
            "gpus" => typed("--gpus", gpu_count(&value)?),
            "gres" => {
                // Resources other than GPUs are named in `unsupported` by `gres_gpus`.
                if let Some(gpus) = gres_gpus(&value, unsupported)? {
                    typed("--gpus-per-node", gpus);
                }
            }
            "gpus-per-node" => typed("--gpus-per-node", gpu_count(&value)?),
            "gpus-per-task" => typed("--gpus-per-task", gpu_count(&value)?),
            "nodes" => match value.split_once('-') {
                Some((a, b)) if a == b => flag("--nodes", a.to_string()),
                // Slurm may start such a job on its minimum (a range's largest count only when
                // the nodes are free): corral always does.
                Some((a, _)) => flag("--nodes", a.to_string()),
                None => flag("--nodes", value),
            },
            "time" => {
                if let Some(secs) = slurm_time(&value)? {
                    flag("--time", format!("{secs}s"));
                }
            }
            "mem" | "mem-per-cpu" | "mem-per-gpu" => {
                if let Some(bytes) = slurm_mem(&value)? {
                    flag(&format!("--{name}"), bytes.to_string());
                }
            }
            "cpus-per-task" | "cpus-per-gpu" | "ntasks" | "ntasks-per-node" | "ntasks-per-gpu" | "open-mode" => {
                flag(&format!("--{name}"), value)
            }
            // Mail is not sent; accepted silently as Slurm sites without mail do.
            "mail-type" | "mail-user" => {}
            "job-name" => flag("--name", value),
            "output" => flag("--stdout", value),
            "error" => flag("--stderr", value),
            "array" => flag("--array", value),
            "dependency" => flag("--dependency", value),
            "signal" => flag("--signal", slurm_signal(&value)),
            "chdir" => flag("--chdir", value),
            // Pyxis's name.
            "container-image" => flag("--image", value),
            "container-mounts" | "container-workdir" | "container-env" => flag(&format!("--{name}"), value),
            "export" => flag("--export", value),
            "partition" => flag("--partition", value),
            "constraint" => {
                // Slurm's AND is `&` or `,`; OR and counts have no equivalent.
                if value.contains(['|', '[', '*']) {
                    unsupported.push(format!("--constraint={value} (only labels joined with & or ,)"));
                } else {
                    flag("--constraint", value.replace('&', ","));
                }
            }
            "account" => flag("--account", value),
            "qos" => flag("--qos", value),
            "max-restarts" => flag("--max-restarts", value),
            _ => unsupported.push(format!("--{name}")),
        }
    }
    Ok(out)
}

/// Supported options that need a value (a missing one is an error, not "unsupported").
const KNOWN_WITH_VALUE: &[&str] = &[
    "gpus",
    "gres",
    "gpus-per-node",
    "nodes",
    "time",
    "mem",
    "cpus-per-task",
    "cpus-per-gpu",
    "gpus-per-task",
    "mem-per-cpu",
    "mem-per-gpu",
    "ntasks",
    "ntasks-per-node",
    "ntasks-per-gpu",
    "open-mode",
    "mail-type",
    "mail-user",
    "job-name",
    "output",
    "error",
    "array",
    "dependency",
    "signal",
    "chdir",
    "container-image",
    "container-mounts",
    "container-workdir",
    "container-env",
    "export",
    "partition",
    "constraint",
    "account",
    "qos",
    "max-restarts",
];

/// `N` or `TYPE:N`: the GPU count, and the type when given.
fn gpu_count(value: &str) -> Result<(Option<String>, String), String> {
    let (kind, count) = match value.rsplit_once(':') {
        Some((kind, count)) => (Some(kind.to_string()), count),
        None => (None, value),
    };
    if count.parse::<u32>().is_err() || kind.as_deref().is_some_and(|k| k.is_empty() || k.contains(':')) {
        return Err(format!("'{value}' is not a GPU count (expected e.g. 2 or a100:2)"));
    }
    Ok((kind, count.to_string()))
}

/// The GPUs of a `--gres` list (`gpu:N`, `gpu:TYPE:N`, `gpu` for one, with other resources
/// named in `unsupported`), or `None` without a `gpu` entry.
fn gres_gpus(value: &str, unsupported: &mut Vec<String>) -> Result<Option<(Option<String>, String)>, String> {
    let mut gpus = None;
    for item in value.split(',') {
        // Slurm's `gpu:a100:2(S:0)` socket binding is a hint: dropped.
        let item = item.split('(').next().unwrap_or(item);
        let mut parts = item.splitn(2, ':');
        match (parts.next(), parts.next()) {
            (Some("gpu"), None) => gpus = Some((None, "1".to_string())),
            (Some("gpu"), Some(rest)) if rest.parse::<u32>().is_ok() => gpus = Some((None, rest.to_string())),
            (Some("gpu"), Some(rest)) => {
                gpus = Some(match rest.split_once(':') {
                    Some(_) => gpu_count(rest)?,
                    None => (Some(rest.to_string()), "1".to_string()),
                })
            }
            _ => unsupported.push(format!("--gres={item} (only gpu[:TYPE]:N)")),
        }
    }
    Ok(gpus)
}

/// Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; UNLIMITED/INFINITE → None.
fn slurm_time(value: &str) -> Result<Option<u64>, String> {
    let bad = || format!("invalid time '{value}' (expected minutes, MM:SS, HH:MM:SS or D-HH:MM:SS)");
    if matches!(value.to_ascii_lowercase().as_str(), "unlimited" | "infinite") {
        return Ok(None);
    }
    let num = |s: &str| s.parse::<u64>().map_err(|_| bad());
    let (days, rest) = match value.split_once('-') {
        Some((d, rest)) => (Some(num(d)?), rest),
        None => (None, value),
    };
    let parts: Vec<u64> = rest.split(':').map(num).collect::<Result<_, _>>()?;
    let secs = match (days, parts.as_slice()) {
        (None, [m]) => m * 60,
        (None, [m, s]) => m * 60 + s,
        (None, [h, m, s]) => h * 3600 + m * 60 + s,
        (Some(d), [h]) => d * 86400 + h * 3600,
        (Some(d), [h, m]) => d * 86400 + h * 3600 + m * 60,
        (Some(d), [h, m, s]) => d * 86400 + h * 3600 + m * 60 + s,
        _ => return Err(bad()),
    };
    if secs == 0 {
        return Err(format!("invalid time '{value}': must be greater than zero"));
    }
    Ok(Some(secs))
}

/// Slurm's memory: a number in MB or with K/M/G/T (powers of 1024); 0 → no limit.
fn slurm_mem(value: &str) -> Result<Option<u64>, String> {
    let bad = || format!("invalid memory '{value}' (expected e.g. 16G or 4000 for MB)");
    let split = value.find(|c: char| !c.is_ascii_digit()).unwrap_or(value.len());
    let number: u64 = value[..split].parse().map_err(|_| bad())?;
    let shift = match value[split..].to_ascii_uppercase().trim_end_matches('B') {
        "K" => 10,
        "" | "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(bad()),
    };
    if number == 0 {
        return Ok(None);
    }
    number.checked_mul(1 << shift).map(Some).ok_or_else(bad)
}

/// `[B:|R:]SIG[@SECS]` → `SIG@SECS`; Slurm sends it 60 seconds before the end by default.
fn slurm_signal(value: &str) -> String {
    let value = value.strip_prefix("B:").or_else(|| value.strip_prefix("R:")).unwrap_or(value);
    if value.contains('@') {
        value.to_string()
    } else {
        format!("{value}@60")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn line(words: &str) -> Result<(Vec<String>, Vec<String>), String> {
        command_line(words.split(' ').map(String::from).collect())
    }

    fn rewritten(words: &str) -> String {
        let (argv, warnings) = line(words).unwrap_or_else(|e| panic!("{words}: {e}"));
        assert!(warnings.is_empty(), "{words}: {warnings:?}");
        argv.join(" ")
    }

    /// The options before the script mean what they mean to Slurm's sbatch, as `#SBATCH` lines
    /// do; the script's own arguments are untouched.
    #[test]
    fn the_command_line_reads_slurms_options_before_the_script() {
        assert_eq!(
            rewritten("corral sbatch --job-name=train -t 1-00:00:00 --gres=gpu:a100:2 --mem=4000 -o logs/%x-%j.out -e err-%j --requeue --mail-type=END job.sh -o x --mem 1"),
            "corral sbatch --name train --time 86400s --gpus-per-node 2 --gpu-type a100 --mem 4194304000 --stdout logs/%x-%j.out --stderr err-%j -- job.sh -o x --mem 1"
        );
        assert_eq!(
            rewritten("corral sbatch -J x -N2 --ntasks-per-node 4 -G 8 j.sh"),
            "corral sbatch --name x --nodes 2 --ntasks-per-node 4 --gpus 8 -- j.sh"
        );
        assert_eq!(
            rewritten("corral sbatch --nodes=2-4 --time=30 --signal=B:USR1@90 j.sh"),
            "corral sbatch --nodes 2 --time 1800s --signal USR1@90 -- j.sh"
        );
        // Abbreviations, as Slurm's getopt_long takes them.
        assert_eq!(
            rewritten("corral sbatch --err=e.txt --job=n j.sh"),
            "corral sbatch --stderr e.txt --name n -- j.sh"
        );
    }

    #[test]
    fn a_script_read_from_a_stream_is_bounded_and_must_be_utf8_text() {
        let read = |bytes: &[u8]| super::read_script_from(bytes, "on standard input").map_err(|e| e.to_string());
        assert_eq!(read(b"#!/bin/sh\ntrue\n").unwrap(), "#!/bin/sh\ntrue\n");
        assert_eq!(read(&vec![b'#'; MAX_SCRIPT_BYTES]).map(|s| s.len()), Ok(MAX_SCRIPT_BYTES));
        assert!(read(&vec![b'#'; MAX_SCRIPT_BYTES + 1]).unwrap_err().contains("more than the 1024 KiB"));
        assert!(read(b"\n \t\n").unwrap_err().contains("is empty"), "Slurm refuses an empty batch script");
        assert!(read(b"#!/bin/sh\n\xff\n").unwrap_err().contains("not UTF-8"));
    }

    /// corral's own flags pass as they are, the global ones before and after `sbatch` included.
    #[test]
    fn corrals_own_flags_keep_their_meaning() {
        let same = [
            "corral --endpoint h:1 -o json sbatch --tenant t --priority high --image /srv/root --parsable --wait job.sh",
            "corral sbatch -o json --strict -W --env A=1 --stdout out.txt --gpu-slice mig:1g.10gb job.sh",
            // Values Slurm does not read but corral does.
            "corral sbatch --time 1h30m --mem 16GiB job.sh",
            "corral submit --mem 4000 --name x -- true",
            "corral sbatch",
            "corral --output table",
        ];
        for words in same {
            assert_eq!(rewritten(words), words.replace(" job.sh", " -- job.sh"));
        }
        assert_eq!(
            rewritten("corral sbatch -o table --output=slurm-%j.out j.sh"),
            "corral sbatch -o table --stdout slurm-%j.out -- j.sh"
        );
        assert_eq!(rewritten("corral sbatch -- j.sh -- a"), "corral sbatch -- j.sh -- a", "one -- is enough");
        assert_eq!(
            rewritten("corral sbatch -J w --wrap=hostname -t 5"),
            "corral sbatch --name w --wrap=hostname --time 300s",
            "a --wrap job has no script"
        );
        // Not an option of either: left to clap, which refuses it naming what is close.
        assert!(rewritten("corral sbatch --gpuss 2 job.sh").starts_with("corral sbatch --gpuss "));
    }

    /// Slurm's options without a value, and options corral does not know followed by another
    /// option, take no word of the line with them.
    #[test]
    fn options_without_a_value_take_nothing_with_them() {
        let text = "#!/bin/sh\n#SBATCH --no-kill --gpus=2 --oversubscribe -N 2\n#SBATCH --frobnicate --time=5\ntrue\n";
        let parsed = parse_directives("job.sh", text, false).expect("parsed");
        assert_eq!((parsed.flags.gpus, parsed.flags.nodes), (Some(2), Some(2)));
        assert_eq!(parsed.flags.time, Some(Duration::from_secs(300)));
        assert_eq!(parsed.warnings.len(), 3, "{:?}", parsed.warnings);
        assert!(parsed.warnings[2].contains("--frobnicate is not supported"), "{:?}", parsed.warnings);
    }

    #[test]
    fn slurm_options_corral_lacks_warn_or_refuse_under_strict() {
        let (argv, warnings) = line("corral sbatch --reservation=maint --gpus 2 j.sh").expect("warned");
        assert_eq!(argv.join(" "), "corral sbatch --gpus 2 -- j.sh");
        assert_eq!(warnings, ["--reservation is not supported by corral: ignored"]);
        let err = line("corral sbatch --strict --reservation maint j.sh").expect_err("refused");
        assert!(err.contains("--reservation is not supported by corral (--strict)"), "{err}");
        let err = line("corral sbatch --gres=gpu:x:y j.sh").expect_err("a bad value of Slurm's");
        assert!(err.starts_with("--gres=gpu:x:y: "), "{err}");
    }

    const SCRIPT: &str = r#"#!/bin/bash
# a comment
#SBATCH --job-name="my job"
#SBATCH --gres=gpu:2
#SBATCH -t 1-02:00:00
#SBATCH --mem=16G
#SBATCH -c 4
#SBATCH -o slurm-%j.out
#SBATCH --error=err-%x.txt   # trailing comment
#SBATCH --array=0-9%2
#SBATCH --dependency=afterok:3
#SBATCH --signal=B:USR1@120
#SBATCH -D /scratch/exp -p gpu -C a100&nvlink
#SBATCH --hold --requeue --mail-type=END --mail-user=ana@example.org
#SBATCH --export=NONE
#CORRAL --max-restarts 2 --rdma
# SBATCH --gpus=99 (disabled: a space after #)

#SBATCH --reservation=maint
python train.py
#SBATCH --gpus=7 (after the first command: not a directive)
"#;

    #[test]
    fn directives_map_to_flags() {
        let d = parse_directives("train.sh", SCRIPT, false).unwrap();
        let f = &d.flags;
        assert_eq!(f.name.as_deref(), Some("my job"));
        assert_eq!((f.gpus, f.gpus_per_node), (None, Some(2)), "--gres counts on each node");
        assert_eq!(f.time, Some(Duration::from_secs(86400 + 7200)));
        assert_eq!(f.mem, Some(16 << 30));
        assert_eq!((f.cpus, f.cpus_per_task), (None, Some(4)));
        assert_eq!(f.stdout.as_deref(), Some("slurm-%j.out"));
        assert_eq!(f.stderr.as_deref(), Some("err-%x.txt"));
        assert_eq!(f.array.as_deref(), Some("0-9%2"));
        assert_eq!(f.dependency.as_deref(), Some("afterok:3"));
        let signal = f.signal.unwrap();
        assert_eq!((signal.signal, signal.before_end), (10, Some(Duration::from_secs(120))));
        assert_eq!(f.chdir.as_deref(), Some(Path::new("/scratch/exp")));
        assert_eq!(f.partition.as_deref(), Some("gpu"));
        assert_eq!(f.constraint, ["a100", "nvlink"]);
        assert!(f.hold && f.rdma);
        assert_eq!(f.export.as_deref(), Some("NONE"));
        assert_eq!(f.max_restarts, Some(2));
        assert_eq!(d.warnings, ["train.sh line 19: --reservation is not supported by corral: ignored"]);
    }

    #[test]
    fn strict_refuses_unsupported_directives() {
        let e = parse_directives("train.sh", SCRIPT, true).unwrap_err();
        assert_eq!(
            e,
            "train.sh line 19: --reservation is not supported by corral (--strict): remove it, or submit without --strict to ignore it"
        );
    }

    #[test]
    fn later_lines_and_slurm_defaults() {
        let d = parse_directives(
            "s",
            "#SBATCH --gpus=1\n#SBATCH -G 3\n#SBATCH --signal=USR2\n#SBATCH --nodes=2 --gpus-per-node=4\n",
            false,
        )
        .unwrap();
        assert_eq!(d.flags.gpus, Some(3));
        assert_eq!(d.flags.signal.unwrap().before_end, Some(Duration::from_secs(60)), "Slurm's default is 60 s");
        assert_eq!((d.flags.nodes, d.flags.gpus_per_node), (Some(2), Some(4)));
        let d = parse_directives("s", "#SBATCH --time=30 --mem=4000 -J x\n#SBATCH --time=5:00\n", false).unwrap();
        assert_eq!(d.flags.time, Some(Duration::from_secs(300)));
        assert_eq!(d.flags.mem, Some(4000 << 20));
        let d = parse_directives("s", "#SBATCH --gpus=a100:2\n#SBATCH --ntasks=1\n", false).unwrap();
        assert_eq!((d.flags.gpus, d.flags.gpu_type.as_deref(), d.flags.ntasks), (Some(2), Some("a100"), Some(1)));
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
    }

    #[test]
    fn multi_node_directives_keep_slurms_meaning() {
        let text = "#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4 -n 8
#SBATCH --gres=gpu:a100:4,nvme:1
#SBATCH --gpus-per-task=1 --cpus-per-gpu=8
#SBATCH --mem-per-gpu=40G --mem-per-cpu=4000
#SBATCH --exclusive --open-mode=append
#SBATCH --parsable
";
        let d = parse_directives("s", text, false).unwrap();
        let f = &d.flags;
        assert_eq!((f.nodes, f.ntasks, f.ntasks_per_node), (Some(2), Some(8), Some(4)));
        assert_eq!((f.gpus, f.gpus_per_node, f.gpu_type.as_deref()), (None, Some(4), Some("a100")));
        assert_eq!((f.gpus_per_task, f.cpus_per_gpu), (Some(1), Some(8)));
        assert_eq!((f.mem_per_gpu, f.mem_per_cpu), (Some(40 << 30), Some(4000 << 20)));
        assert!(f.exclusive);
        assert_eq!(f.open_mode.as_deref(), Some("append"));
        assert_eq!(d.warnings, ["s line 4: --gres=nvme:1 (only gpu[:TYPE]:N) is not supported by corral: ignored"]);
        for (gres, expected) in [
            ("gpu", (None, "1")),
            ("gpu:2", (None, "2")),
            ("gpu:v100", (Some("v100"), "1")),
            ("gpu:h100:8(S:0-1)", (Some("h100"), "8")),
        ] {
            let got = gres_gpus(gres, &mut Vec::new()).unwrap().unwrap();
            assert_eq!((got.0.as_deref(), got.1.as_str()), expected, "{gres}");
        }
        assert!(gres_gpus("gpu:a:b:2", &mut Vec::new()).is_err());
    }

    /// Slurm's `--exclusive=user` (and mcs, topo) is met by whole nodes.
    #[test]
    fn exclusive_takes_slurms_optional_value() {
        let d = parse_directives("s", "#SBATCH --exclusive=user\n", false).unwrap();
        assert!(d.flags.exclusive && d.warnings.is_empty(), "{:?}", d.warnings);
        assert!(parse_directives("s", "#SBATCH --hold=1\n", false).is_err());
    }

    /// `--nodes=MIN-MAX`: the job gets MIN nodes, a start Slurm may give it too.
    #[test]
    fn a_range_of_nodes_is_its_minimum() {
        let d = parse_directives("s", "#SBATCH --nodes=2-4\n", false).unwrap();
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        assert_eq!(d.flags.nodes, Some(2));
    }

    /// Slurm reads options with getopt_long: an unambiguous abbreviation and Slurm's aliases
    /// are the options they stand for; an ambiguous one is named, not guessed.
    #[test]
    fn abbreviations_and_aliases_are_slurms() {
        let d = parse_directives("s", "#SBATCH --err=e-%j --out=o-%j\n#SBATCH --tasks-per-node=2 --job=x\n", false)
            .unwrap();
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        assert_eq!(d.flags.stderr.as_deref(), Some("e-%j"));
        assert_eq!(d.flags.stdout.as_deref(), Some("o-%j"));
        assert_eq!(d.flags.ntasks_per_node, Some(2));
        assert_eq!(d.flags.name.as_deref(), Some("x"));
        let d = parse_directives("s", "#SBATCH --ntasks-per=2\n", false).unwrap();
        assert_eq!(d.warnings, ["s line 1: --ntasks-per is not supported by corral: ignored"]);
    }

    #[test]
    fn malformed_directives_name_the_line() {
        for (text, expected) in [
            ("#!/bin/sh\n#SBATCH --time=abc\n", "s line 2: #SBATCH --time=abc: invalid time 'abc'"),
            ("#SBATCH --gpus=two\n", "s line 1: #SBATCH --gpus=two: 'two' is not a GPU count"),
            ("#SBATCH --array=5-1\n", "s line 1: #SBATCH --array=5-1: invalid array: '5-1': range 5-1 runs backwards"),
            ("#SBATCH --dependency=after:1\n", "s line 1: #SBATCH --dependency=after:1: invalid dependency"),
            ("#SBATCH --job-name=\"x\n", "s line 1: #SBATCH --job-name=\"x: unterminated \" quote"),
            ("#SBATCH --time\n", "s line 1: #SBATCH --time: --time needs a value"),
            ("#SBATCH gpus=2\n", "s line 1: #SBATCH gpus=2: 'gpus=2' is not an option"),
            ("#CORRAL --gpus x\n", "s line 1: #CORRAL --gpus x: invalid value 'x' for '--gpus"),
            ("#CORRAL --bogus\n", "s line 1: #CORRAL --bogus: unexpected argument '--bogus'"),
        ] {
            let e = parse_directives("s", text, false).unwrap_err();
            assert!(e.starts_with(expected), "{text:?}: {e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }

    #[test]
    fn scripts_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.sh");
        std::fs::write(&big, vec![b'#'; MAX_SCRIPT_BYTES + 1]).unwrap();
        let e = read_script(&big).unwrap_err().to_string();
        assert!(e.contains("more than the 1024 KiB"), "{e}");
        let e = read_script(&dir.path().join("missing.sh")).unwrap_err().to_string();
        assert!(e.starts_with("cannot read script") && e.contains("No such file"), "{e}");
        let ok = dir.path().join("ok.sh");
        std::fs::write(&ok, "#!/bin/sh\necho hi\n").unwrap();
        assert_eq!(read_script(&ok).unwrap(), "#!/bin/sh\necho hi\n");
    }

    #[test]
    fn container_image_directives_name_the_image() {
        for script in [
            "#SBATCH --container-image=nvcr.io/nvidia/pytorch:24.01-py3\n",
            "#CORRAL --container-image nvcr.io/nvidia/pytorch:24.01-py3\n",
        ] {
            let d = parse_directives("s", script, true).unwrap();
            assert_eq!(d.flags.image.as_deref(), Some("nvcr.io/nvidia/pytorch:24.01-py3"), "{script}");
        }
        let d = parse_directives(
            "s",
            "#SBATCH --container-mounts=/data:/data:ro\n#SBATCH --container-workdir=/w\n#CORRAL --container-env A,B\n#SBATCH --container-mounts=/s\n",
            true,
        )
        .unwrap();
        assert_eq!(d.flags.container_mounts, ["/data:/data:ro", "/s"]);
        assert_eq!(
            (d.flags.container_workdir.as_deref(), d.flags.container_env.as_slice()),
            (Some("/w"), &["A".to_string(), "B".to_string()][..])
        );
        assert_eq!(
            parse_directives("s", "#SBATCH --container-image\n", false).unwrap_err(),
            "s line 1: #SBATCH --container-image: --container-image needs a value"
        );
    }
}
