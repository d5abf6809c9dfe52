//! `corral top`: a live view of the pool (nodes, GPUs with temperature, utilization and state,
//! the queue by tenant, running jobs) redrawn with plain ANSI escapes every `--interval`;
//! `--once` prints a single frame (as JSON with `--output json`).

use crate::args::{GlobalArgs, OutputFormat, TopArgs};
use crate::connect::client;
use crate::output;
use anyhow::bail;
use corral_client::Client;
use corral_proto::v1 as pb;
use corral_types::{Job, JobState, Timestamp};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

/// Clear the screen and move the cursor home.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// How many pending jobs a frame lists (the oldest); the QUEUE section counts them all.
const PENDING_SHOWN: usize = 10;

/// One picture of the pool.
struct Frame {
    nodes: Vec<pb::NodeView>,
    jobs: Vec<Job>,
}

/// Pending and running jobs of one tenant.
#[derive(Debug, Default, PartialEq, Eq)]
struct TenantQueue {
    pending: u32,
    running: u32,
    /// GPUs held by the running jobs, in thousandths (an MPS half is 500, a whole GPU 1000).
    running_milli_gpus: u64,
}

impl Frame {
    async fn fetch(client: &Client) -> anyhow::Result<Frame> {
        let nodes = client.list_nodes().await?;
        let jobs = client.list_jobs(false, None).await?;
        Ok(Frame { nodes, jobs })
    }

    fn queue(&self) -> BTreeMap<&str, TenantQueue> {
        let mut queue: BTreeMap<&str, TenantQueue> = BTreeMap::new();
        for job in &self.jobs {
            let q = queue.entry(job.spec.tenant.as_str()).or_default();
            match job.state {
                JobState::Pending => q.pending += 1,
                JobState::Running => {
                    q.running += 1;
                    let gpus: u64 = job.allocation.as_ref().map_or(0, |a| a.parts().map(|(_, g)| g.len() as u64).sum());
                    q.running_milli_gpus += match &job.spec.gpu_slice {
                        Some(slice) => u64::from(slice.milli_gpus()),
                        None => gpus * 1000,
                    };
                }
                _ => {}
            }
        }
        queue
    }

    fn running(&self) -> Vec<Job> {
        self.jobs.iter().filter(|j| j.state == JobState::Running).cloned().collect()
    }

    /// The jobs waiting longest, with why they wait.
    fn oldest_pending(&self) -> Vec<Job> {
        let mut pending: Vec<Job> = self.jobs.iter().filter(|j| j.state == JobState::Pending).cloned().collect();
        pending.sort_by_key(|j| (j.submitted_at, j.id));
        pending.truncate(PENDING_SHOWN);
        pending
    }

    fn json(&self) -> Value {
        json!({
            "nodes": self.nodes.iter().map(output::node_json).collect::<Vec<_>>(),
            "queue": self.queue().iter().map(|(tenant, q)| json!({
                "tenant": tenant,
                "pending": q.pending,
                "running": q.running,
                "running_gpus": q.running_milli_gpus as f64 / 1000.0,
            })).collect::<Vec<_>>(),
            "running": self.running().iter().map(output::job_json).collect::<Vec<_>>(),
        })
    }

    fn render(&self) -> String {
        let gpu_rows: Vec<Vec<String>> = self
            .nodes
            .iter()
            .flat_map(|n| {
                n.gpus.iter().map(move |g| {
                    let jobs = g.job_ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
                    vec![
                        n.name.clone(),
                        g.index.to_string(),
                        g.model.clone(),
                        g.state.clone(),
                        g.temperature_c.to_string(),
                        g.utilization_percent.to_string(),
                        format!("{}/{}", g.memory_used_mib, g.memory_mib),
                        format!("{:.0}", g.power_mw as f64 / 1000.0),
                        if jobs.is_empty() { "-".into() } else { jobs },
                    ]
                })
            })
            .collect();
        let queue_rows: Vec<Vec<String>> = self
            .queue()
            .iter()
            .map(|(tenant, q)| {
                vec![
                    tenant.to_string(),
                    q.pending.to_string(),
                    q.running.to_string(),
                    gpu_equivalents(q.running_milli_gpus),
                ]
            })
            .collect();
        let running = self.running();
        let pending = self.oldest_pending();
        let mut sections = vec![
            format!("NODES\n{}", output::nodes_table(&self.nodes)),
            format!(
                "GPUS\n{}",
                output::table(
                    &["NODE", "GPU", "MODEL", "STATE", "TEMP(C)", "UTIL(%)", "MEM(MiB)", "POWER(W)", "JOBS"],
                    &gpu_rows
                )
            ),
            format!("QUEUE\n{}", output::table(&["TENANT", "PENDING", "RUNNING", "GPUS"], &queue_rows)),
            format!("RUNNING\n{}", output::jobs_table(&running)),
        ];
        if !pending.is_empty() {
            sections.push(format!("PENDING (oldest {PENDING_SHOWN})\n{}", output::jobs_table(&pending)));
        }
        sections.join("\n\n")
    }
}

/// Thousandths of a GPU as GPU-equivalents: `2`, `0.5`, `1.428`.
fn gpu_equivalents(milli: u64) -> String {
    let text = format!("{}.{:03}", milli / 1000, milli % 1000);
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn now_utc() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    output::format_utc(Timestamp::compose(ms, 0))
}

pub async fn run(global: &GlobalArgs, args: TopArgs) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    if args.once {
        let frame = Frame::fetch(&client).await?;
        match global.output {
            OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&frame.json())?),
            OutputFormat::Table => println!("{}", frame.render()),
        }
        return Ok(ExitCode::SUCCESS);
    }
    if global.output == OutputFormat::Json {
        bail!("--output json prints one frame: use `corral top --once --output json`");
    }
    if args.interval.is_zero() {
        bail!("invalid --interval 0: give a time between refreshes such as 2s");
    }
    let endpoints = global.endpoint.join(",");
    let interval = corral_types::format_duration(args.interval);
    // One listener for the whole run: a Ctrl-C that arrives during a refresh is not lost.
    let stop = crate::daemon::termination();
    tokio::pin!(stop);
    loop {
        // A failed refresh (e.g. during a leader change) shows the error and tries again.
        let body = tokio::select! {
            fetched = Frame::fetch(&client) => match fetched {
                Ok(frame) => frame.render(),
                Err(e) => format!("error: {e}"),
            },
            _ = &mut stop => return Ok(ExitCode::SUCCESS),
        };
        let mut stdout = std::io::stdout().lock();
        write!(
            stdout,
            "{CLEAR}corral top  {endpoints}  {}  (every {interval}, Ctrl-C to quit)\n\n{body}\n",
            now_utc()
        )?;
        stdout.flush()?;
        drop(stdout);
        tokio::select! {
            _ = tokio::time::sleep(args.interval) => {}
            _ = &mut stop => return Ok(ExitCode::SUCCESS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{Allocation, JobSpec};

    fn job(id: u64, tenant: &str, state: JobState, gpus: Vec<u32>) -> Job {
        let spec = JobSpec {
            name: "j".into(),
            tenant: tenant.into(),
            command: vec!["true".into()].into(),
            ..Default::default()
        };
        let allocation =
            (!gpus.is_empty()).then(|| Allocation { node: "n1".into(), gpus, epoch: 1, ..Default::default() });
        Job {
            id,
            spec,
            state,
            request_id: String::new(),
            submitted_at: Timestamp::compose(1_000, 0),
            admitted_at: None,
            started_at: None,
            finished_at: None,
            allocation,
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 1,
            worker_run_time_ms: None,
            preemption: None,
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: Default::default(),
        }
    }

    #[test]
    fn fractional_jobs_count_as_their_share_of_a_gpu() {
        let mut half = job(4, "c", JobState::Running, vec![2]);
        half.spec.gpu_slice = Some(corral_types::GpuSlice::parse("mps:50").expect("slice"));
        let frame = Frame { nodes: Vec::new(), jobs: vec![half, job(5, "c", JobState::Running, vec![3])] };
        assert_eq!(frame.queue()["c"].running_milli_gpus, 1500);
        assert_eq!(frame.json()["queue"][0]["running_gpus"], 1.5);
        assert_eq!(gpu_equivalents(1500), "1.5");
        assert_eq!(gpu_equivalents(2000), "2");
        assert_eq!(gpu_equivalents(0), "0");
        assert_eq!(gpu_equivalents(1428), "1.428");
    }

    #[test]
    fn queue_counts_jobs_and_gpus_per_tenant() {
        let frame = Frame {
            nodes: Vec::new(),
            jobs: vec![
                job(1, "a", JobState::Running, vec![0, 1]),
                job(2, "a", JobState::Pending, vec![]),
                job(3, "b", JobState::Pending, vec![]),
            ],
        };
        let queue = frame.queue();
        assert_eq!(queue["a"], TenantQueue { pending: 1, running: 1, running_milli_gpus: 2000 });
        assert_eq!(queue["b"], TenantQueue { pending: 1, running: 0, running_milli_gpus: 0 });
        let doc = frame.json();
        assert_eq!(doc["running"][0]["id"], 1, "{doc}");
        assert_eq!(doc["queue"][1]["tenant"], "b", "{doc}");
        let text = frame.render();
        assert!(text.contains("QUEUE\nTENANT  PENDING  RUNNING  GPUS\na       1        1        2"), "{text}");
        let pending = text.split_once("PENDING (oldest 10)\n").expect("a pending section").1;
        let ids: Vec<&str> = pending.lines().skip(1).filter_map(|l| l.split_whitespace().next()).collect();
        assert_eq!(ids, ["2", "3"], "{text}");
    }
}
