//! `corral image ls|pull|rm|load`: the workers' image stores, through the coordinator (admin).

use crate::args::{GlobalArgs, ImageCommand, OutputFormat};
use crate::connect::client;
use crate::output::{format_utc, table};
use corral_proto::v1::{self as pb};
use corral_types::Timestamp;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

pub async fn run(global: &GlobalArgs, command: ImageCommand) -> anyhow::Result<ExitCode> {
    let json = global.output == OutputFormat::Json;
    let client = client(global)?;
    match command {
        ImageCommand::Ls { node } => {
            let reply = client.list_images(node.as_deref().unwrap_or_default()).await?;
            if json {
                let doc = json!({
                    "images": reply.images.iter().map(image_json).collect::<Vec<_>>(),
                    "unreachable": reply.unreachable,
                });
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else {
                let rows: Vec<Vec<String>> = reply
                    .images
                    .iter()
                    .map(|i| {
                        vec![
                            i.node.clone(),
                            names(i),
                            short_digest(&i.digest),
                            megabytes(i.size_bytes),
                            format_utc(Timestamp::compose(i.last_used_ms, 0)),
                            if i.in_use { "yes" } else { "no" }.to_string(),
                        ]
                    })
                    .collect();
                println!("{}", table(&["NODE", "REFERENCE", "DIGEST", "SIZE", "LAST USED", "IN USE"], &rows));
                for line in &reply.unreachable {
                    eprintln!("unreachable: {line}");
                }
            }
            Ok(if reply.unreachable.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        ImageCommand::Pull { reference, node, all } => pull(&client, &reference, node.as_deref(), all, json).await,
        ImageCommand::Rm { reference, node } => {
            let reply = client.remove_image(&reference, node.as_deref()).await?;
            if json {
                let doc = json!({
                    "removed": reply.removed.iter().map(image_json).collect::<Vec<_>>(),
                    "skipped": reply.skipped,
                    "refused": reply.refused,
                });
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else {
                for i in &reply.removed {
                    println!("node {}: removed {} ({})", i.node, names(i), i.digest);
                }
                for line in &reply.skipped {
                    eprintln!("skipped {line}");
                }
                for line in &reply.refused {
                    eprintln!("refused: {line}");
                }
            }
            let ok = reply.refused.is_empty() && !reply.removed.is_empty();
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        ImageCommand::Load { file, node } => {
            let reply = client.load_image(&file, node.as_deref()).await?;
            if json {
                let doc = json!({
                    "loaded": reply.images.iter().map(image_json).collect::<Vec<_>>(),
                    "failed": reply.failed,
                });
                println!("{}", serde_json::to_string_pretty(&doc)?);
            } else {
                for i in &reply.images {
                    println!("node {}: loaded {} ({}, {} MB)", i.node, names(i), i.digest, megabytes(i.size_bytes));
                }
                for line in &reply.failed {
                    eprintln!("failed: {line}");
                }
            }
            let ok = reply.failed.is_empty() && !reply.images.is_empty();
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
    }
}

/// Follows a pull: on a terminal, one progress line rewritten in place; at the end one line per
/// node (or, with JSON, one document with each node's outcome).
async fn pull(
    client: &corral_client::Client,
    reference: &str,
    node: Option<&str>,
    all: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut events = client.pull_image(reference, node, all).await?;
    let live = !json && std::io::stderr().is_terminal();
    let mut progress: BTreeMap<String, pb::ImagePullEvent> = BTreeMap::new();
    let mut finals: BTreeMap<String, pb::ImagePullEvent> = BTreeMap::new();
    while let Some(event) = events.message().await? {
        if event.done {
            progress.remove(&event.node);
            finals.insert(event.node.clone(), event);
        } else {
            progress.insert(event.node.clone(), event);
        }
        if live {
            let (done, total) = progress.values().fold((0, 0), |(d, t), e| (d + e.bytes_done, t + e.bytes_total));
            eprint!(
                "\r\x1b[Kpulling {reference}: {} node(s) done, {} pulling, {}/{} MB",
                finals.len(),
                progress.len(),
                megabytes(done),
                megabytes(total)
            );
            let _ = std::io::stderr().flush();
        }
    }
    if live {
        eprint!("\r\x1b[K");
    }
    let failed = finals.values().filter(|e| !e.error.is_empty()).count();
    if json {
        let nodes: Vec<Value> = finals
            .values()
            .map(|e| {
                json!({
                    "node": e.node,
                    "ok": e.error.is_empty(),
                    "error": (!e.error.is_empty()).then_some(&e.error),
                    "image": e.image.as_ref().map(image_json),
                    "bytes_fetched": e.bytes_total,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "reference": reference, "nodes": nodes }))?);
    } else {
        for e in finals.values() {
            match &e.image {
                Some(i) if e.error.is_empty() => println!(
                    "node {}: pulled {reference} ({}, {} MB, {} MB fetched)",
                    e.node,
                    i.digest,
                    megabytes(i.size_bytes),
                    megabytes(e.bytes_total)
                ),
                _ => println!("node {}: failed: {}", e.node, e.error),
            }
        }
    }
    Ok(if failed == 0 && !finals.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn image_json(i: &pb::ImageInfo) -> Value {
    json!({
        "node": i.node,
        "names": i.names,
        "digest": i.digest,
        "size_bytes": i.size_bytes,
        "last_used": format_utc(Timestamp::compose(i.last_used_ms, 0)),
        "last_used_ms": i.last_used_ms,
        "in_use": i.in_use,
    })
}

fn names(i: &pb::ImageInfo) -> String {
    if i.names.is_empty() {
        "<none>".to_string()
    } else {
        i.names.join(",")
    }
}

/// `sha256:` and the first 12 hex digits, as Docker shows image ids.
fn short_digest(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    format!("sha256:{}", &hex[..hex.len().min(12)])
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}
