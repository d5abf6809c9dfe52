//! `corral cluster init|join|leave|status|snapshot`.

use crate::args::{ClusterCommand, GlobalArgs, OutputFormat};
use crate::connect::client;
use corral_proto::v1 as pb;
use serde_json::json;
use std::process::ExitCode;

fn status_json(s: &pb::ClusterStatus) -> serde_json::Value {
    json!({
        "node_id": s.node_id,
        "state": s.state,
        "leader_id": s.leader_id,
        "leader_addr": s.leader_addr,
        "term": s.term,
        "last_log_index": s.last_log_index,
        "committed_index": s.committed_index,
        "applied_index": s.applied_index,
        "snapshot_index": s.snapshot_index,
        "purged_index": s.purged_index,
        // Computed only with --digest.
        "state_digest": (s.state_digest != 0).then(|| format!("{:016x}", s.state_digest)),
        "initialized": s.initialized,
        "jobs_in_memory": s.jobs_in_memory,
        "members": s.members.iter().map(|m| json!({"node_id": m.node_id, "addr": m.addr, "role": m.role})).collect::<Vec<_>>(),
    })
}

fn print_status(global: &GlobalArgs, s: &pb::ClusterStatus) -> anyhow::Result<()> {
    if global.output == OutputFormat::Json {
        println!("{}", serde_json::to_string_pretty(&status_json(s))?);
        return Ok(());
    }
    let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    println!("node:        {} ({})", s.node_id, s.state);
    match s.leader_id {
        Some(id) => println!("leader:      {id} at {}", s.leader_addr),
        None => println!("leader:      none"),
    }
    println!("term:        {}", s.term);
    println!(
        "log:         last {} committed {} applied {}",
        opt(s.last_log_index),
        opt(s.committed_index),
        opt(s.applied_index)
    );
    println!("snapshot:    {} (purged up to {})", opt(s.snapshot_index), opt(s.purged_index));
    if s.state_digest != 0 {
        println!("digest:      {:016x}", s.state_digest);
    }
    println!("jobs:        {} in memory (older finished jobs are in the history)", s.jobs_in_memory);
    let rows: Vec<Vec<String>> = s
        .members
        .iter()
        .map(|m| {
            let leader = if Some(m.node_id) == s.leader_id { "yes" } else { "" };
            vec![m.node_id.to_string(), m.addr.clone(), m.role.clone(), leader.to_string()]
        })
        .collect();
    println!("{}", crate::output::table(&["ID", "ADDRESS", "ROLE", "LEADER"], &rows));
    Ok(())
}

pub async fn run(global: &GlobalArgs, command: ClusterCommand) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    let status = match command {
        ClusterCommand::Init { policy: None } => client.cluster_init(None).await?,
        ClusterCommand::Init { policy: Some(path) } => {
            let text = crate::admin_cmd::read_policy(&path)?;
            client.cluster_init(Some((&path.display().to_string(), &text))).await?
        }
        ClusterCommand::Join { addr } => {
            eprintln!("adding the coordinator at {addr}: a learner until it has the cluster's state, then a voter");
            client.cluster_join(&addr).await?
        }
        ClusterCommand::Leave { node_id } => client.cluster_leave(node_id).await?,
        ClusterCommand::Status { digest } => client.cluster_status_with(digest).await?,
        ClusterCommand::Snapshot => {
            eprintln!("building a snapshot on the coordinator at {}", global.endpoint.first().map_or("", |e| e.trim()));
            client.cluster_snapshot().await?
        }
    };
    print_status(global, &status)?;
    Ok(ExitCode::SUCCESS)
}
