//! The `corral` binary: parses arguments, installs tracing, and calls the libraries.

mod admin_cmd;
mod alloc;
#[cfg(not(feature = "system-allocator"))]
mod allocator;
mod args;
mod attach;
mod billing;
mod cluster_cmd;
mod commands;
mod connect;
mod coordinator_cmd;
mod daemon;
mod dev;
mod image_cmd;
mod in_job;
mod invoice;
mod jobspec;
mod listen;
mod logs;
mod metrics_http;
mod node_cmd;
mod output;
mod paging;
mod sacct_format;
mod sbatch;
mod scontrol_job;
mod security_cmd;
mod squeue_format;
mod srun;
mod times;
mod top;
mod worker_cmd;

use args::{Cli, Command};
use clap::Parser;
use std::process::ExitCode;

/// mimalloc for the daemons, glibc's malloc for the client commands (see `allocator.rs`).
/// Feature `system-allocator` leaves glibc's malloc everywhere, for heap profilers.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: allocator::ByRole = allocator::ByRole;

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of our output goes away
    // (`corral jobs | head`), instead of panicking on a broken pipe.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Called as one of Slurm's commands inside a job (a link in the job's PATH).
    let mut argv = std::env::args();
    let name = argv.next().and_then(|a| std::path::Path::new(&a).file_name().map(|n| n.to_string_lossy().into_owned()));
    let in_job = name.map_or(in_job::InJob::Cli, |name| in_job::dispatch(&name, &argv.collect::<Vec<_>>()));
    let args: Vec<std::ffi::OsString> = match in_job {
        in_job::InJob::Cli => std::env::args_os().collect(),
        in_job::InJob::Exit(code) => return code,
        // `squeue`, `scancel`, `scontrol show job`, `sbatch`: the corral command they translate to.
        in_job::InJob::Corral(args) => args.into_iter().map(Into::into).collect(),
    };
    // `corral sbatch` reads Slurm's options before the script as Slurm's sbatch does (a command
    // line that is not UTF-8 is left to clap as it is).
    let args = match args.iter().map(|a| a.to_str().map(String::from)).collect::<Option<Vec<String>>>() {
        Some(text) => match sbatch::command_line(text) {
            Ok((text, warnings)) => {
                for warning in warnings {
                    eprintln!("warning: {warning}");
                }
                text.into_iter().map(Into::into).collect()
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        },
        None => args,
    };
    let parsed = Cli::try_parse_from(args);
    let cli = match parsed {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::from(2);
            }
            eprintln!("{}", parse_error_line(&e.render().to_string()));
            return ExitCode::from(2);
        }
    };
    if let Command::WorkerGuard(args) = &cli.command {
        // A plain blocking loop, no async runtime: it must keep working when nothing else does.
        return match corral_worker::run_guard(&args.cgroup_root) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: corral fence guard: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let daemon = matches!(cli.command, Command::Dev(_) | Command::Coordinator(_) | Command::Worker(_));
    // A daemon must never die of a peer closing its socket (a killed coordinator, a worker that
    // went away): every write to it is an EPIPE error, on every thread.
    if daemon {
        // SAFETY: setting a signal disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    }
    // Sockets are written on the runtime's threads: there a peer that closed its end (a TLS
    // server refusing us, a client going away) must be an EPIPE error, not a silent death by
    // SIGPIPE. Children get a clean signal mask from std's spawn.
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if !daemon {
        // A client command waits on one coordinator at a time: one worker thread (its sockets'
        // thread; the main thread prints) instead of one per core, each a thread to start.
        runtime.worker_threads(1);
    }
    let runtime = runtime.enable_all().on_thread_start(block_sigpipe).build();
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(cli));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// Blocks SIGPIPE on the calling thread (it stays fatal on the main thread, which prints).
fn block_sigpipe() {
    // SAFETY: sigset operations on a local set, then pthread_sigmask on the current thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Renders an error chain on one line.
/// clap's error in one line: the problem, what it lists under it (the missing arguments),
/// its tips ("a similar argument exists", "to pass '-x' as a value, use '-- -x'"), and the
/// help of the subcommand its usage names.
fn parse_error_line(rendered: &str) -> String {
    let mut lines = rendered.lines();
    let mut out = lines.next().unwrap_or("error: invalid arguments").trim_end().to_string();
    let mut listed = Vec::new();
    let mut tips = Vec::new();
    let mut help = "corral --help".to_string();
    let mut in_list = true;
    for line in lines {
        let trimmed = line.trim();
        if trimmed.is_empty() {
            in_list = false;
        } else if let Some(tip) = trimmed.strip_prefix("tip:") {
            tips.push(tip.trim().to_string());
        } else if let Some(usage) = trimmed.strip_prefix("Usage:") {
            let words: Vec<&str> =
                usage.split_whitespace().take_while(|w| !w.starts_with(['[', '<', '-', '.'])).collect();
            if !words.is_empty() {
                help = format!("{} --help", words.join(" "));
            }
        } else if in_list {
            listed.push(trimmed.to_string());
        }
    }
    if !listed.is_empty() {
        out = format!("{out} {}", listed.join(", "));
    }
    let mut notes = tips;
    notes.push(format!("see `{help}`"));
    format!("{out} ({})", notes.join("; "))
}

fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ").replace('\n', " ")
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let global = cli.global;
    match cli.command {
        Command::Dev(args) => dev::run(args).await.map(|()| ExitCode::SUCCESS),
        Command::Coordinator(args) => coordinator_cmd::run(&args.config).await.map(|()| ExitCode::SUCCESS),
        Command::Worker(args) => {
            worker_cmd::run(&args.config, args.join, global.token.clone()).await.map(|()| ExitCode::SUCCESS)
        }
        Command::Node(command) => node_cmd::run(&global, command).await,
        Command::Image(command) => image_cmd::run(&global, command).await,
        Command::Cluster(command) => cluster_cmd::run(&global, command).await,
        Command::Submit(args) => commands::submit(&global, args).await,
        Command::Show(args) => commands::show(&global, args).await,
        Command::Wait(args) => commands::wait(&global, args).await,
        Command::Jobs(args) => commands::jobs(&global, args, false).await,
        Command::Queue(args) => commands::jobs(&global, args, true).await,
        Command::Cancel(args) => commands::cancel(&global, args).await,
        Command::Hold(args) => commands::control(&global, args.job, "hold", Default::default()).await,
        Command::Release(args) => commands::control(&global, args.job, "release", Default::default()).await,
        Command::Requeue(args) => commands::control(&global, args.job, "requeue", Default::default()).await,
        Command::Signal(args) => {
            let request = corral_proto::v1::ControlJobRequest { signal: args.signal, ..Default::default() };
            commands::control(&global, args.job, "signal", request).await
        }
        Command::Update(args) => {
            if args.time.is_some_and(|t| t.is_zero()) {
                anyhow::bail!("update --time 0: a time limit cannot be removed from a submitted job; give a duration");
            }
            let request = corral_proto::v1::ControlJobRequest {
                time_limit_secs: args.time.map(|t| t.as_secs().max(1)),
                priority_class: args.priority,
                gpus: args.gpus,
                name: args.name,
                ..Default::default()
            };
            commands::control(&global, args.job, "update", request).await
        }
        Command::Logs(args) => commands::logs(&global, args).await,
        Command::Nodes => commands::nodes(&global).await,
        Command::Top(args) => top::run(&global, args).await,
        Command::Certs(args::CertsCommand::Init(args)) => security_cmd::certs_init(&global, args),
        Command::Certs(args::CertsCommand::Renew(args)) => security_cmd::certs_renew(&global, args),
        Command::Token(command) => security_cmd::token(&global, command).await,
        Command::Admin(command) => admin_cmd::run(&global, command).await,
        Command::Ts { count } => commands::ts(&global, count).await,
        Command::WorkerGuard(_) => unreachable!("the fence guard runs before the async runtime starts"),
        Command::Billing(args::BillingCommand::Report(args)) => billing::report(&global, args).await,
        Command::Billing(args::BillingCommand::Invoice(args)) => invoice::invoice(&global, args).await,
        Command::History(args) => billing::history(&global, args).await,
        Command::Sbatch(args) => commands::sbatch(&global, args).await,
        Command::Run(args) => commands::run(&global, args).await,
        Command::Alloc(args) => alloc::alloc(&global, args).await,
        Command::AllocGuard { job } => alloc::guard(&global, job).await,
        Command::Attach(args) => attach::attach(&global, args).await,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    fn parse_error(args: &[&str]) -> String {
        use clap::Parser;
        let e = crate::args::Cli::try_parse_from(args).expect_err("a parse error");
        super::parse_error_line(&e.render().to_string())
    }

    #[test]
    fn parse_errors_keep_clap_hints_on_one_line() {
        let line = parse_error(&["corral", "submit", "--gpu", "1", "--", "true"]);
        assert!(line.contains("'--gpu'") && line.contains("'--gpus'"), "{line}");
        assert!(line.contains("see `corral submit --help`"), "{line}");
        let line = parse_error(&["corral", "submit", "-x"]);
        assert!(line.contains("'-- -x'"), "{line}");
        let line = parse_error(&["corral", "wait"]);
        assert!(line.contains("<JOB>"), "{line}");
        for line in [parse_error(&["corral", "submit", "--gpu", "1"]), parse_error(&["corral", "wait"])] {
            assert!(!line.contains('\n'), "{line:?}");
        }
    }

    /// The modules each module of this crate names (`crate::x`, `use crate::{x, y::z}`).
    fn module_imports() -> BTreeMap<String, BTreeSet<String>> {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut graph = BTreeMap::new();
        for entry in std::fs::read_dir(&src).expect("read src") {
            let path = entry.expect("entry").path();
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let module = path.file_stem().expect("stem").to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&path).expect("read module");
            let mut names = BTreeSet::new();
            for (i, _) in text.match_indices("crate::") {
                let rest = &text[i + "crate::".len()..];
                // `crate::{a, b::c}` names a and b; `crate::a::b` names a.
                let items = match rest.strip_prefix('{') {
                    Some(group) => group[..group.find('}').expect("closed use group")].split(',').collect(),
                    None => vec![rest],
                };
                for item in items {
                    let name: String =
                        item.trim().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    if !name.is_empty() && name != module {
                        names.insert(name);
                    }
                }
            }
            graph.insert(module, names);
        }
        // Names that are no module of this crate (items of nested groups, examples in docs).
        let modules: BTreeSet<String> = graph.keys().cloned().collect();
        for names in graph.values_mut() {
            names.retain(|n| modules.contains(n));
        }
        graph
    }

    /// A path of imports from `from` back to `to`, if there is one.
    fn path_back(graph: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> Option<Vec<String>> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![vec![from.to_string()]];
        while let Some(path) = stack.pop() {
            let last = path.last().expect("non-empty path");
            for next in graph.get(last).into_iter().flatten() {
                if next == to {
                    return Some(path);
                }
                if seen.insert(next.clone()) {
                    stack.push([path.clone(), vec![next.clone()]].concat());
                }
            }
        }
        None
    }

    /// Shared helpers live in modules of their own, so that no two modules import each other,
    /// directly or around a circle.
    #[test]
    fn no_module_imports_itself_around_a_circle() {
        let graph = module_imports();
        assert!(graph["commands"].contains("connect"), "the import scan finds imports: {graph:?}");
        for (module, imports) in &graph {
            for import in imports {
                if let Some(back) = path_back(&graph, import, module) {
                    panic!(
                        "{module} -> {} -> {module}: move what they share into a module of its own",
                        back.join(" -> ")
                    );
                }
            }
        }
    }
}
