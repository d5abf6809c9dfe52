//! `corral node ...`: the node lifecycle (`drain`, `cordon`, `resume`, `remove`, `lease`) and
//! `join-token`, which issues a single-use token that a new worker joins the cluster with
//! (`corral worker --config FILE --join ADDR --token T`).

use crate::args::{GlobalArgs, NodeCommand, OutputFormat};
use crate::connect::client;
use crate::output::format_utc;
use corral_types::Timestamp;
use serde_json::json;
use std::process::ExitCode;

pub async fn run(global: &GlobalArgs, command: NodeCommand) -> anyhow::Result<ExitCode> {
    match command {
        NodeCommand::JoinToken { ttl } => join_token(global, ttl).await,
        other => lifecycle(global, other).await,
    }
}

async fn join_token(global: &GlobalArgs, ttl: std::time::Duration) -> anyhow::Result<ExitCode> {
    let reply = client(global)?.create_join_token(ttl).await?;
    let expires = crate::output::format_utc(corral_types::Timestamp::compose(reply.expires_at_ms, 0));
    match global.output {
        OutputFormat::Json => {
            let doc = json!({
                "id": reply.id,
                "token": reply.token,
                "expires_at_ms": reply.expires_at_ms,
                "expires": expires,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        OutputFormat::Table => {
            // The token alone on stdout, so `TOKEN=$(corral node join-token)` works.
            println!("{}", reply.token);
            let endpoint = global.endpoint.first().map(String::as_str).unwrap_or("COORDINATOR:7070");
            eprintln!(
                "join token {} (single use, expires {expires}): corral worker --config FILE --join {endpoint} --token TOKEN",
                reply.id
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn lifecycle(global: &GlobalArgs, command: NodeCommand) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    let json = global.output == OutputFormat::Json;
    let reply = match command {
        NodeCommand::Remove { node } => {
            let reply = client.remove_node(&node).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"node": node, "removed": true, "gpus": reply.gpus}))?
                );
            } else {
                println!("removed node {node}: {} gpu(s) left the pool", reply.gpus);
            }
            return Ok(ExitCode::SUCCESS);
        }
        NodeCommand::Drain { node, reason, deadline } => {
            let secs = deadline.map(|d| d.as_secs_f64().ceil() as u64);
            client.set_node_mode(&node, "draining", &reason, secs).await?
        }
        NodeCommand::Cordon { node, reason } => client.set_node_mode(&node, "cordoned", &reason, None).await?,
        NodeCommand::Resume { node } => client.set_node_mode(&node, "active", "", None).await?,
        NodeCommand::Lease { node, until, clear } => {
            let until = match (until, clear) {
                (Some(t), false) => Some(crate::times::parse_future_time(&t)?.physical_ms()),
                _ => None,
            };
            client.set_node_lease(&node, until).await?
        }
        NodeCommand::JoinToken { ttl } => return join_token(global, ttl).await,
    };
    if json {
        let doc = json!({
            "node": reply.node,
            "state": reply.state,
            "reason": reply.reason,
            "drain_deadline": reply.drain_deadline.map(|t| format_utc(Timestamp(t))),
            "running_jobs": reply.running_jobs,
            "lease_end": reply.lease_end.map(|t| format_utc(Timestamp(t))),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    let jobs = match reply.running_jobs {
        0 => "no job runs there".to_string(),
        1 => "1 job runs there".to_string(),
        n => format!("{n} jobs run there"),
    };
    let when = match (reply.state.as_str(), reply.drain_deadline) {
        ("draining", Some(t)) => format!("; they are stopped and requeued at {}", format_utc(Timestamp(t))),
        ("draining", None) => "; they run to their end (add --deadline to requeue them)".to_string(),
        _ => String::new(),
    };
    let lease = match reply.lease_end {
        Some(t) => format!("; its lease ends at {}", format_utc(Timestamp(t))),
        None => String::new(),
    };
    println!("node {} is {}: {jobs}{when}{lease}", reply.node, reply.state);
    Ok(ExitCode::SUCCESS)
}
