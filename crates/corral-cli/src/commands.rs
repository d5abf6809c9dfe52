//! User commands: submit, sbatch, run, show, wait, jobs/queue, cancel, logs, nodes.

use crate::args::{
    CancelArgs, GlobalArgs, JobsArgs, LogsArgs, OutputFormat, PageArgs, RunArgs, SbatchArgs, ShowArgs, SubmitArgs,
    WaitArgs,
};
use crate::connect::client;
use crate::{jobspec, output, paging, sbatch, times};
use anyhow::{bail, Context};
use corral_client::JobQuery;
use corral_types::{JobSpec, JobState};
use std::io::IsTerminal;
use std::process::ExitCode;

fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

pub async fn submit(global: &GlobalArgs, args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let default_name = args.command.first().map(|p| p.rsplit('/').next().unwrap_or("job").to_string());
    let input = job_input(args.command, None, default_name.unwrap_or_default())?;
    let spec = build_spec(args.job, input)?;
    let submitted = client(global)?.submit(&spec).await?;
    print_submitted(global, submitted.job_id)
}

/// The submit directory and environment, with the command or script.
pub(crate) fn job_input(
    command: Vec<String>,
    script: Option<String>,
    default_name: String,
) -> anyhow::Result<JobInputOwned> {
    let cwd = std::env::current_dir().context("cannot read the current directory (give --chdir)")?;
    Ok(JobInputOwned { command, script, default_name, cwd, environment: jobspec::current_environment() })
}

pub(crate) struct JobInputOwned {
    command: Vec<String>,
    script: Option<String>,
    default_name: String,
    cwd: std::path::PathBuf,
    environment: Vec<(String, String)>,
}

/// The spec of `flags`; prints its warnings on stderr.
pub(crate) fn build_spec(flags: crate::args::JobFlags, input: JobInputOwned) -> anyhow::Result<JobSpec> {
    let (spec, warnings) = jobspec::job_spec(
        flags,
        jobspec::JobInput {
            command: input.command,
            script: input.script,
            default_name: input.default_name,
            cwd: &input.cwd,
            environment: input.environment,
            host: std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default(),
        },
    )?;
    for warning in warnings {
        eprintln!("warning: {warning}");
    }
    Ok(spec)
}

fn print_submitted(global: &GlobalArgs, job_id: u64) -> anyhow::Result<ExitCode> {
    match global.output {
        OutputFormat::Json => print_json(&serde_json::json!({ "id": job_id }))?,
        OutputFormat::Table => println!("{job_id}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `corral sbatch`: the script's directives under the command line's flags.
pub async fn sbatch(global: &GlobalArgs, args: SbatchArgs) -> anyhow::Result<ExitCode> {
    let (text, shown, default_name) = match (&args.script, args.wrap) {
        (Some(script), _) => (
            sbatch::read_script(script)?,
            script.display().to_string(),
            script.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "sbatch".into()),
        ),
        // As Slurm's sbatch writes it, and names the job.
        (None, Some(command)) => (sbatch::wrapped(&command), "--wrap".to_string(), "wrap".to_string()),
        // As Slurm's sbatch: the script from standard input, named `sbatch`.
        (None, None) => (sbatch::read_script_stdin(std::io::stdin().lock())?, "standard input".into(), "sbatch".into()),
    };
    let directives = sbatch::parse_directives(&shown, &text, args.strict).map_err(anyhow::Error::msg)?;
    for warning in &directives.warnings {
        eprintln!("warning: {warning}");
    }
    let input = job_input(args.args, Some(text), default_name)?;
    let spec = build_spec(args.job.over(directives.flags), input)?;
    let submitted = client(global)?.submit(&spec).await?;
    // --parsable: the id alone, which the table output already is.
    let printed = print_submitted(global, submitted.job_id)?;
    if !args.wait {
        return Ok(printed);
    }
    let job = client(global)?.wait_job(submitted.job_id, |_| {}).await?;
    Ok(match (job.state, job.exit_code) {
        (JobState::Succeeded, _) => ExitCode::SUCCESS,
        (_, Some(code)) if code > 0 => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        _ => ExitCode::from(1),
    })
}

/// How often `corral run` repeats why its job still waits.
const RUN_PENDING_NOTE: std::time::Duration = std::time::Duration::from_secs(5);

/// `corral run`: submit, say why it waits, stream its output, exit with its exit code.
pub async fn run(global: &GlobalArgs, args: RunArgs) -> anyhow::Result<ExitCode> {
    let default_name = args.command.first().map(|p| p.rsplit('/').next().unwrap_or("job").to_string());
    let input = job_input(args.command, None, default_name.unwrap_or_default())?;
    let spec = build_spec(args.job, input)?;
    let client = client(global)?;
    let job_id = client.submit(&spec).await?.job_id;
    eprintln!("corral: job {job_id} submitted");
    let follow = async {
        // Say why the job waits, on a change and every few seconds, until it starts or ends.
        let mut watch = client.watch_job(job_id).await?;
        let mut last: Option<(String, std::time::Instant)> = None;
        loop {
            let next = tokio::time::timeout(RUN_PENDING_NOTE, watch.message()).await;
            let job = match next {
                Ok(Ok(Some(job))) => corral_types::Job::try_from(job)?,
                // A leader change ends the stream: the log stream below waits for the start too.
                Ok(Ok(None)) | Ok(Err(_)) => break,
                Err(_) => {
                    if let Some((reason, at)) = &mut last {
                        eprintln!("corral: job {job_id} pending: {reason}");
                        *at = std::time::Instant::now();
                    }
                    continue;
                }
            };
            if job.state != JobState::Pending {
                break;
            }
            let reason = output::reason(&job);
            let changed = last.as_ref().is_none_or(|(r, at)| *r != reason || at.elapsed() >= RUN_PENDING_NOTE);
            if changed {
                eprintln!("corral: job {job_id} pending: {reason}");
                last = Some((reason, std::time::Instant::now()));
            }
        }
        crate::logs::copy(client.read_logs(job_id, true).await?).await?;
        anyhow::Ok(client.wait_job(job_id, |_| {}).await?)
    };
    let job = tokio::select! {
        job = follow => job?,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("corral: interrupted: cancelling job {job_id}");
            match client.cancel(job_id).await {
                Ok(_) => eprintln!("corral: job {job_id} cancelled"),
                Err(e) => eprintln!("corral: cannot cancel job {job_id}: {e}"),
            }
            return Ok(ExitCode::from(130));
        }
    };
    if job.state != JobState::Succeeded {
        eprintln!("{}", ended_note(&job));
    }
    Ok(ExitCode::from(run_exit_code(&job)))
}

/// The exit status of `corral run` for an ended job: its exit code, 128+N when signal N killed
/// it, else 1 (and 0 only for a success).
fn run_exit_code(job: &corral_types::Job) -> u8 {
    match (job.state, job.exit_code, job.signal) {
        (JobState::Succeeded, _, _) => 0,
        (_, _, Some(signal)) => u8::try_from(128 + signal.clamp(1, 127)).unwrap_or(255),
        (_, Some(code), _) if code != 0 => u8::try_from(code.clamp(1, 255)).unwrap_or(1),
        _ => 1,
    }
}

pub async fn show(global: &GlobalArgs, args: ShowArgs) -> anyhow::Result<ExitCode> {
    if let Some(format) = &args.sacct {
        return sacct(global, &args, format).await;
    }
    let job = client(global)?.get_job_ref(args.job).await?;
    if args.scontrol {
        print!(
            "{}",
            crate::scontrol_job::show_job(
                &job,
                own_script(&job).as_deref(),
                std::time::SystemTime::now(),
                args.oneliner
            )
        );
        if args.oneliner {
            println!();
        }
        return Ok(ExitCode::SUCCESS);
    }
    match global.output {
        OutputFormat::Json => print_json(&output::job_json(&job))?,
        OutputFormat::Table => println!("{}", output::job_details(&job)),
    }
    Ok(ExitCode::SUCCESS)
}

/// The jobs of `sacct -j` in sacct's rows: each looked up in turn (at most as many as the
/// command line names), one not found left out as sacct leaves it out.
async fn sacct(global: &GlobalArgs, args: &ShowArgs, format: &str) -> anyhow::Result<ExitCode> {
    crate::sacct_format::check_format(format).map_err(anyhow::Error::msg)?;
    let client = client(global)?;
    let mut jobs = Vec::new();
    for job in std::iter::once(&args.job).chain(&args.jobs) {
        match client.get_job_ref(*job).await {
            Ok(job) => jobs.push(job),
            Err(e) if e.code() == Some(tonic::Code::NotFound) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let parsable = (args.parsable || args.parsable2).then_some(args.parsable);
    let layout = crate::sacct_format::Layout { noheader: args.noheader, parsable, allocations: args.allocations };
    let text =
        crate::sacct_format::render(&jobs, format, layout, std::time::SystemTime::now()).map_err(anyhow::Error::msg)?;
    print!("{text}");
    Ok(ExitCode::SUCCESS)
}

/// Where the batch script of `job` can be read here: inside that job's own run, its copy in
/// the run's directory on this node (`CORRAL_JOB_DIR`), as Slurm's `Command=` names a file.
fn own_script(job: &corral_types::Job) -> Option<String> {
    let own = std::env::var("SLURM_JOB_ID").ok()? == job.id.to_string();
    let path = std::path::Path::new(&std::env::var_os("CORRAL_JOB_DIR")?).join(corral_worker::executor::SCRIPT_FILE);
    (own && job.spec.script.is_some() && path.is_file()).then(|| path.display().to_string())
}

/// `corral hold | release | requeue | signal | update`.
pub async fn control(
    global: &GlobalArgs,
    job: corral_types::JobRef,
    action: &str,
    mut request: corral_proto::v1::ControlJobRequest,
) -> anyhow::Result<ExitCode> {
    request.action = action.to_string();
    let signal = request.signal;
    let done = client(global)?.control_job(job, request).await?;
    match global.output {
        OutputFormat::Json => print_json(&output::job_json(&done))?,
        OutputFormat::Table => {
            let id = done.display_id();
            match action {
                "hold" => println!("job {id} held: it does not start until `corral release {id}`"),
                "release" => println!("job {id} released"),
                "requeue" => println!("job {id} is being stopped and goes back to the queue"),
                "signal" => println!("signal {signal} sent to job {id}"),
                _ => println!("job {id} updated\n{}", output::job_details(&done)),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn wait(global: &GlobalArgs, args: WaitArgs) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    let progress = std::io::stderr().is_terminal();
    let mut last_state = None;
    // The leader pushes every change of the job: no polling interval in the latency.
    // A task of an array is waited for by its own id.
    let job_id = if args.job.task.is_some() { client.get_job_ref(args.job).await?.id } else { args.job.id };
    let follow = client.wait_job(job_id, |job| {
        if progress && last_state != Some(job.state) {
            eprintln!("job {}: {} {}", job.id, job.state, output::reason(job));
            last_state = Some(job.state);
        }
    });
    let job = match args.timeout {
        Some(timeout) => match tokio::time::timeout(timeout, follow).await {
            Ok(job) => job?,
            Err(_) => {
                let state =
                    client.get_job(job_id).await.map(|j| j.state.to_string()).unwrap_or_else(|_| "unknown".into());
                eprintln!(
                    "error: timed out after {} waiting for job {} (still {state})",
                    corral_types::format_duration(timeout),
                    args.job,
                );
                return Ok(ExitCode::from(2));
            }
        },
        None => follow.await?,
    };
    match global.output {
        OutputFormat::Json => print_json(&output::job_json(&job))?,
        OutputFormat::Table => println!("job {} {} ({})", job.id, job.state, output::reason(&job)),
    }
    Ok(if job.state == JobState::Succeeded { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// The server-side filter of `corral jobs` / `corral queue`.
fn job_query(args: &JobsArgs, queue_only: bool) -> anyhow::Result<JobQuery> {
    if queue_only && args.state.iter().any(|s| s.is_terminal()) {
        bail!("the queue holds pending and running jobs only: list finished ones with `corral jobs --state ...`");
    }
    let (name, name_prefix) = match args.name.as_deref().map(|n| n.strip_suffix('*').ok_or(n)) {
        None => (None, None),
        Some(Ok(prefix)) => (None, Some(prefix.to_string())),
        Some(Err(name)) => (Some(name.to_string()), None),
    };
    let (submitted_since, submitted_until) = times::time_range(args.since.as_deref(), args.until.as_deref())?;
    Ok(JobQuery {
        all: args.all && !queue_only,
        tenant: args.tenant.clone(),
        states: args.state.clone(),
        name,
        name_prefix,
        submitted_since,
        submitted_until,
        user: match (&args.user, args.me) {
            (Some(user), _) => Some(user.clone()),
            (None, true) => Some(login_name()?),
            (None, false) => None,
        },
        // Neither the table nor the JSON shows a job's script or environment.
        brief: true,
    })
}

/// The login name of the user running this, as a submit records it (`USER`, else `LOGNAME`,
/// else the password database's name of our uid).
pub fn login_name() -> anyhow::Result<String> {
    for var in ["USER", "LOGNAME"] {
        if let Some(name) = std::env::var(var).ok().filter(|n| !n.is_empty()) {
            return Ok(name);
        }
    }
    // SAFETY: getpwuid returns a pointer into static storage or null; we copy the name at once
    // (no other thread calls it here).
    let name = unsafe {
        let pw = libc::getpwuid(libc::getuid());
        if pw.is_null() || (*pw).pw_name.is_null() {
            None
        } else {
            Some(std::ffi::CStr::from_ptr((*pw).pw_name).to_string_lossy().into_owned())
        }
    };
    name.ok_or_else(|| {
        anyhow::anyhow!("--me: who you are is unknown (USER unset, uid not in the password database): use --user NAME")
    })
}

pub async fn jobs(global: &GlobalArgs, args: JobsArgs, queue_only: bool) -> anyhow::Result<ExitCode> {
    if let Some(format) = &args.squeue_format {
        return squeue(global, &args, format, queue_only).await;
    }
    let query = job_query(&args, queue_only)?;
    let client = client(global)?;
    let fetch = |token: String, limit: u32| {
        let (client, query) = (&client, &query);
        async move { client.list_jobs_page(query, &token, limit).await }
    };
    let PageArgs { limit, page_token } = args.page;
    match global.output {
        OutputFormat::Json => {
            let mut jobs = Vec::new();
            let next = paging::follow(page_token, limit, fetch, |page| {
                jobs.extend(page.iter().map(output::job_json));
                Ok(())
            })
            .await?;
            // Without --limit the document stays the array it always was.
            match limit {
                Some(_) => print_json(&serde_json::json!({ "jobs": jobs, "next_page_token": next }))?,
                None => print_json(&serde_json::Value::Array(jobs))?,
            }
        }
        OutputFormat::Table => {
            let mut table = output::JobsTableStream::default();
            let next = paging::follow(page_token, limit, fetch, |page| {
                table.push(page);
                Ok(())
            })
            .await?;
            table.finish();
            if let Some(next) = next {
                paging::more_hint("jobs", &next);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The listing in Slurm's squeue format: the jobs `--jobs` names (each looked up, whatever its
/// state), else those the filters select, printed a page at a time (`--limit` bounds them).
async fn squeue(global: &GlobalArgs, args: &JobsArgs, format: &str, queue_only: bool) -> anyhow::Result<ExitCode> {
    let squeue = crate::squeue_format::Squeue::new(format).map_err(anyhow::Error::msg)?;
    let client = client(global)?;
    if !args.noheader {
        print!("{}", squeue.header());
    }
    if args.jobs.is_empty() {
        let query = job_query(args, queue_only)?;
        let fetch = |token: String, limit: u32| {
            let (client, query) = (&client, &query);
            async move { client.list_jobs_page(query, &token, limit).await }
        };
        paging::follow(args.page.page_token.clone(), args.page.limit, fetch, |page| {
            print!("{}", squeue.rows(&page, std::time::SystemTime::now()));
            Ok(())
        })
        .await?;
    } else {
        for job in &args.jobs {
            let job = client.get_job_ref(*job).await?;
            print!("{}", squeue.rows(&[job], std::time::SystemTime::now()));
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn cancel(global: &GlobalArgs, args: CancelArgs) -> anyhow::Result<ExitCode> {
    if args.jobs.len() > 1 {
        return cancel_several(global, &args.jobs).await;
    }
    let Some(&job_ref) = args.jobs.first() else {
        let request = corral_proto::v1::CancelJobsRequest { tenant: args.tenant, states: args.state, name: args.name };
        let ids = client(global)?.cancel_jobs(request).await?;
        match global.output {
            OutputFormat::Json => print_json(&serde_json::json!({ "cancelled": ids.len(), "job_ids": ids }))?,
            OutputFormat::Table => println!("{} jobs cancelled (running ones are being stopped)", ids.len()),
        }
        return Ok(ExitCode::SUCCESS);
    };
    let job = client(global)?.cancel_ref(job_ref).await?;
    // A task not created yet is answered with its array.
    let not_created = job_ref.task.is_some() && job.is_array();
    let id = job.display_id();
    match global.output {
        OutputFormat::Json => print_json(&output::job_json(&job))?,
        OutputFormat::Table if not_created => println!("task {job_ref} cancelled: it will not start"),
        OutputFormat::Table if job.state == JobState::Cancelled => println!("job {id} cancelled"),
        OutputFormat::Table if job.state.is_terminal() => {
            println!("job {id} already ended ({}): nothing to cancel", job.state)
        }
        OutputFormat::Table if job.is_array() => {
            println!("array {id} cancelling: its running tasks are being killed, no new task starts")
        }
        OutputFormat::Table => println!("job {id} cancelling: its processes are being killed"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `corral cancel 73 74 75`: each in turn, as `scancel` does; one that cannot be cancelled is
/// named on stderr and the others are still cancelled (exit 1 if any failed).
async fn cancel_several(global: &GlobalArgs, jobs: &[corral_types::JobRef]) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    let mut failed = false;
    let mut docs = Vec::new();
    for job_ref in jobs {
        match client.cancel_ref(*job_ref).await {
            Ok(job) => match global.output {
                OutputFormat::Json => docs.push(output::job_json(&job)),
                OutputFormat::Table if job.state.is_terminal() && job.state != JobState::Cancelled => {
                    println!("job {job_ref} already ended ({}): nothing to cancel", job.state)
                }
                OutputFormat::Table if job.state == JobState::Cancelled => println!("job {job_ref} cancelled"),
                OutputFormat::Table => println!("job {job_ref} cancelling: its processes are being killed"),
            },
            Err(e) => {
                failed = true;
                eprintln!("error: job {job_ref}: {e}");
            }
        }
    }
    if global.output == OutputFormat::Json {
        print_json(&serde_json::Value::Array(docs))?;
    }
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

pub async fn logs(global: &GlobalArgs, args: LogsArgs) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    // Fails with "not found" for unknown jobs before any streaming starts. A task of an array
    // has its own job (and output) once it was created.
    let job = client.get_job_ref(args.job).await?;
    if args.job.task.is_some() && job.is_array() {
        bail!("task {} has not started yet: it has no output", args.job);
    }
    // A job without output says why: still pending (and what `-f` waits for), or ended
    // without starting (the launch error), on stderr so that the output stays the job's.
    if job.state == JobState::Pending {
        let what = if args.follow { "following its output once it starts" } else { "no output yet" };
        eprintln!("corral: job {} pending: {} ({what})", job.id, output::reason(&job));
    }
    let code = if args.all_ranks {
        crate::logs::all_ranks(&client, &job, args.follow).await?
    } else {
        crate::logs::copy(client.read_rank_logs(job.id, args.rank, args.follow).await?).await?;
        ExitCode::SUCCESS
    };
    // A job whose program ran has its output (and its exit code in `show`); one that never ran
    // it (its launch failed) says why here, after any output.
    let ended = if job.state.is_terminal() { job } else { client.get_job(job.id).await? };
    let never_ran = ended.exit_code.is_none() && ended.signal.is_none();
    if ended.state.is_terminal() && !matches!(ended.state, JobState::Succeeded | JobState::Cancelled) && never_ran {
        eprintln!("{}", ended_note(&ended));
    }
    Ok(code)
}

/// "corral: job N failed: <reason>" for a job that ended without success; the reason of a
/// job that never started is its launch error (or why it was cancelled while pending).
fn ended_note(job: &corral_types::Job) -> String {
    let reason = output::reason(job);
    let never = if job.started_at.is_none() { " before it started" } else { "" };
    format!(
        "corral: job {} {}{never}{}",
        job.id,
        job.state,
        if reason.is_empty() { String::new() } else { format!(": {reason}") }
    )
}

pub async fn nodes(global: &GlobalArgs) -> anyhow::Result<ExitCode> {
    let nodes = client(global)?.list_nodes().await?;
    match global.output {
        OutputFormat::Json => print_json(&serde_json::Value::Array(nodes.iter().map(output::node_json).collect()))?,
        OutputFormat::Table => println!("{}", output::nodes_table(&nodes)),
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn ts(global: &GlobalArgs, count: u32) -> anyhow::Result<ExitCode> {
    let first = client(global)?.timestamps(count).await?;
    match global.output {
        OutputFormat::Json => print_json(&serde_json::json!({
            "ts": first.0,
            "count": count,
            "physical_ms": first.physical_ms(),
            "logical": first.logical(),
            "utc": output::format_utc(first),
        }))?,
        OutputFormat::Table => println!("{}", first.0),
    }
    Ok(ExitCode::SUCCESS)
}
