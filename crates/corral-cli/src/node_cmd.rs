//! `corral node ...`: operations on worker nodes; `join-token` issues a single-use token that a
//! new worker joins the cluster with (`corral worker --config FILE --join ADDR --token T`).

use crate::args::{GlobalArgs, NodeCommand, OutputFormat};
use crate::commands::client;
use serde_json::json;
use std::process::ExitCode;

pub async fn run(global: &GlobalArgs, command: NodeCommand) -> anyhow::Result<ExitCode> {
    match command {
        NodeCommand::JoinToken { ttl } => join_token(global, ttl).await,
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
