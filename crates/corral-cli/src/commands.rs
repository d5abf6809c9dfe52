//! User commands: submit, show, wait, jobs/queue, cancel, logs, nodes.

use crate::args::{GlobalArgs, JobArg, JobsArgs, LogsArgs, OutputFormat, SubmitArgs, WaitArgs};
use crate::output;
use anyhow::{bail, Context};
use corral_client::{Client, ClientConfig};
use corral_proto::v1::LogStream;
use corral_types::{GpuSlice, JobSpec, JobState};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

pub fn client(global: &GlobalArgs) -> anyhow::Result<Client> {
    let endpoints: Vec<String> =
        global.endpoint.iter().map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect();
    let mut config = ClientConfig::new(endpoints);
    config.token = global.token.clone();
    config.tls = match (&global.ca, &global.cert, &global.key) {
        (None, None, None) => None,
        (Some(ca), Some(cert), Some(key)) => {
            let files = corral_security::TlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() };
            Some(corral_security::client_tls_config(&files)?)
        }
        _ => bail!("TLS needs all of --ca, --cert and --key (or CORRAL_CA, CORRAL_CERT and CORRAL_KEY)"),
    };
    Ok(Client::new(config)?)
}

fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

pub async fn submit(global: &GlobalArgs, args: SubmitArgs) -> anyhow::Result<ExitCode> {
    if args.command.is_empty() {
        bail!("empty command: give the program to run after `--`, e.g. `corral submit --gpus 1 -- python train.py`");
    }
    let cpu_millis = match args.cpus {
        Some(c) if !(c.is_finite() && c > 0.0 && c <= 4096.0) => {
            bail!("invalid --cpus {c}: expected a number of cores greater than 0, e.g. 2 or 0.5")
        }
        Some(c) => (c * 1000.0).round() as u32,
        None => 0,
    };
    let gpu_slice = args.gpu_slice.as_deref().map(GpuSlice::parse).transpose()?;
    let name = args.name.clone().unwrap_or_else(|| {
        let program = args.command[0].rsplit('/').next().unwrap_or("job");
        program.to_string()
    });
    let spec = JobSpec {
        name,
        // Empty: the coordinator fills in the token's tenant (or `default`).
        tenant: args.tenant.unwrap_or_default(),
        priority_class: args.priority.unwrap_or_default(),
        gpus: args.gpus,
        gpu_slice,
        cpu_millis,
        memory_bytes: args.mem.unwrap_or(0),
        time_limit_secs: args.time.map(|t| t.as_secs().max(1)),
        image: args.image,
        command: args.command,
        env: args.env.into_iter().collect(),
        sched: corral_types::SchedOptions {
            gpus_per_node: args.gpus_per_node,
            rdma: args.rdma,
            no_requeue: args.no_requeue,
            checkpoint_signal: args.signal,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut checked = spec.clone();
    if checked.tenant.is_empty() {
        checked.tenant = "default".into();
    }
    checked.validate()?;
    let submitted = client(global)?.submit(&spec).await?;
    match global.output {
        OutputFormat::Json => print_json(&serde_json::json!({ "id": submitted.job_id }))?,
        OutputFormat::Table => println!("{}", submitted.job_id),
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn show(global: &GlobalArgs, args: JobArg) -> anyhow::Result<ExitCode> {
    let job = client(global)?.get_job_ref(args.job).await?;
    match global.output {
        OutputFormat::Json => print_json(&output::job_json(&job))?,
        OutputFormat::Table => println!("{}", output::job_details(&job)),
    }
    Ok(ExitCode::SUCCESS)
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

pub async fn jobs(global: &GlobalArgs, args: JobsArgs, queue_only: bool) -> anyhow::Result<ExitCode> {
    let mut jobs = client(global)?.list_jobs(args.all && !queue_only, args.tenant).await?;
    if queue_only {
        jobs.retain(|j| !j.state.is_terminal());
    }
    match global.output {
        OutputFormat::Json => print_json(&serde_json::Value::Array(jobs.iter().map(output::job_json).collect()))?,
        OutputFormat::Table => println!("{}", output::jobs_table(&jobs)),
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn cancel(global: &GlobalArgs, args: JobArg) -> anyhow::Result<ExitCode> {
    let job = client(global)?.cancel_ref(args.job).await?;
    match global.output {
        OutputFormat::Json => print_json(&output::job_json(&job))?,
        OutputFormat::Table if job.state == JobState::Cancelled => println!("job {} cancelled", job.id),
        OutputFormat::Table if job.state.is_terminal() => {
            println!("job {} already ended ({}): nothing to cancel", job.id, job.state)
        }
        OutputFormat::Table => println!("job {} cancelling: its processes are being killed", job.id),
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn logs(global: &GlobalArgs, args: LogsArgs) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    // Fails with "not found" for unknown jobs before any streaming starts.
    let job = client.get_job(args.job).await?;
    if args.all_ranks {
        return crate::logs::all_ranks(&client, &job, args.follow).await;
    }
    let mut stream = client.read_rank_logs(args.job, args.rank, args.follow).await?;
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr();
    while let Some(chunk) = stream.message().await.context("log stream broke off")? {
        if chunk.stream == LogStream::Stderr as i32 {
            stderr.write_all(&chunk.data)?;
        } else {
            stdout.write_all(&chunk.data)?;
            stdout.flush()?;
        }
    }
    Ok(ExitCode::SUCCESS)
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
