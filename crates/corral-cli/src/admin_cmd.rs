//! `corral admin show | apply -f FILE [--force] | diff -f FILE | history`: the cluster policy.

use crate::args::{AdminCommand, GlobalArgs, OutputFormat};
use crate::connect::client;
use crate::output::format_utc;
use anyhow::Context;
use corral_proto::v1 as pb;
use corral_types::Timestamp;
use serde_json::json;
use std::path::Path;
use std::process::ExitCode;

/// Largest policy file accepted (a policy is a few kilobytes; this catches a wrong file).
const MAX_POLICY_BYTES: u64 = 1 << 20;

/// Reads a policy file, with an error naming it.
pub fn read_policy(path: &Path) -> anyhow::Result<String> {
    let len = std::fs::metadata(path).with_context(|| format!("cannot read policy {}", path.display()))?.len();
    if len > MAX_POLICY_BYTES {
        anyhow::bail!("policy {} is {len} bytes: a policy file is at most 1 MiB", path.display());
    }
    std::fs::read_to_string(path).with_context(|| format!("cannot read policy {}", path.display()))
}

fn stranded_json(s: &pb::StrandedJob) -> serde_json::Value {
    json!({"job_id": s.job_id, "state": s.state, "reason": s.reason})
}

pub async fn run(global: &GlobalArgs, command: AdminCommand) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    let json = global.output == OutputFormat::Json;
    match command {
        AdminCommand::Show => {
            let policy = client.get_policy().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&json!({"version": policy.version, "toml": policy.toml}))?);
            } else {
                print!("{}", policy.toml);
            }
        }
        AdminCommand::Diff { file } => {
            let text = read_policy(&file)?;
            let plan = client.apply_policy(&file.display().to_string(), &text, false, true).await?;
            if json {
                let doc = json!({
                    "version": plan.version,
                    "changes": plan.changes,
                    "stranded": plan.stranded.iter().map(stranded_json).collect::<Vec<_>>(),
                });
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else if plan.changes.is_empty() {
                println!("no change: {} is the policy in force (version {})", file.display(), plan.version);
            } else {
                println!("applying {} would make policy version {}:", file.display(), plan.version + 1);
                for change in &plan.changes {
                    println!("  {change}");
                }
                if !plan.stranded.is_empty() {
                    println!("it removes the tenant or class of {} unfinished job(s); apply refuses it without --force, which cancels them:", plan.stranded.len());
                    for s in &plan.stranded {
                        println!("  job {} ({}): {}", s.job_id, s.state, s.reason);
                    }
                }
            }
        }
        AdminCommand::Apply(args) => {
            let text = read_policy(&args.file)?;
            let reply = client.apply_policy(&args.file.display().to_string(), &text, args.force, false).await?;
            if json {
                let doc = json!({
                    "version": reply.version,
                    "applied": reply.applied,
                    "changes": reply.changes,
                    "cancelled": reply.stranded.iter().map(stranded_json).collect::<Vec<_>>(),
                });
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else if !reply.applied {
                println!("no change: {} is the policy in force (version {})", args.file.display(), reply.version);
            } else {
                println!("applied policy version {}:", reply.version);
                for change in &reply.changes {
                    println!("  {change}");
                }
                for s in &reply.stranded {
                    println!("  cancelled job {} ({}): {}", s.job_id, s.state, s.reason);
                }
            }
        }
        AdminCommand::History => {
            let changes = client.policy_history().await?;
            if json {
                let doc: Vec<_> = changes
                    .iter()
                    .map(|c| {
                        json!({
                            "version": c.version,
                            "time": format_utc(Timestamp(c.ts)),
                            "by": c.by,
                            "changes": c.changes,
                            "cancelled": c.cancelled,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else if changes.is_empty() {
                println!("no policy was applied yet (the cluster runs with its initial config)");
            } else {
                for c in &changes {
                    println!("version {}  {}  by {}", c.version, format_utc(Timestamp(c.ts)), c.by);
                    for change in &c.changes {
                        println!("  {change}");
                    }
                    if !c.cancelled.is_empty() {
                        let ids: Vec<String> = c.cancelled.iter().map(u64::to_string).collect();
                        println!("  cancelled jobs: {}", ids.join(", "));
                    }
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
