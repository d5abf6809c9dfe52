//! `corral certs init` (a dev CA and role certificates), `corral certs renew` and `corral token
//! create|list|revoke`.

use crate::args::{CertsInitArgs, CertsRenewArgs, GlobalArgs, OutputFormat, TokenCommand};
use crate::connect::client;
use corral_proto::v1 as pb;
use serde_json::json;
use std::process::ExitCode;

pub fn certs_init(global: &GlobalArgs, args: CertsInitArgs) -> anyhow::Result<ExitCode> {
    let spec = corral_security::DevCerts {
        coordinators: args.coordinators,
        hosts: args.hosts.into_iter().filter(|h| !h.is_empty()).collect(),
        workers: args.workers.into_iter().filter(|w| !w.is_empty()).collect(),
        clients: args.clients.into_iter().filter(|c| !c.is_empty()).collect(),
        days: args.days,
    };
    for name in spec.workers.iter().chain(&spec.clients) {
        if !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            anyhow::bail!("invalid name '{name}': use letters, digits, '-', '_' or '.'");
        }
    }
    let files = corral_security::generate_dev_certs(&args.dir, &spec)?;
    match global.output {
        OutputFormat::Json => {
            let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            println!("{}", serde_json::to_string_pretty(&json!({ "files": files }))?);
        }
        OutputFormat::Table => {
            for f in &files {
                println!("{}", f.display());
            }
            eprintln!(
                "dev CA written to {}: keep ca-key.pem and the *-key.pem files private; the certificates expire in {} days (renew them with `corral certs renew --dir {0}`)",
                args.dir.display(),
                args.days
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn certs_renew(global: &GlobalArgs, args: CertsRenewArgs) -> anyhow::Result<ExitCode> {
    let files = corral_security::renew_dev_certs(&args.dir, args.days)?;
    if files.is_empty() {
        anyhow::bail!("no certificate of the CA {} in {}", args.dir.join("ca.pem").display(), args.dir.display());
    }
    match global.output {
        OutputFormat::Json => {
            let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            println!("{}", serde_json::to_string_pretty(&json!({ "files": files, "days": args.days }))?);
        }
        OutputFormat::Table => {
            for f in &files {
                println!("{}", f.display());
            }
            eprintln!(
                "{} certificate(s) renewed for {} days: restart the coordinators and workers that use them",
                files.len(),
                args.days
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn token_json(t: &pb::TokenInfo) -> serde_json::Value {
    json!({
        "id": t.id,
        "tenant": t.tenant,
        "role": if t.admin { "admin" } else { "tenant" },
        "created": crate::output::format_utc(corral_types::Timestamp(t.created)),
        "expires_at_ms": t.expires_at_ms,
        "revoked": t.revoked,
    })
}

fn expiry(t: &pb::TokenInfo) -> String {
    t.expires_at_ms
        .map(|ms| crate::output::format_utc(corral_types::Timestamp::compose(ms, 0)))
        .unwrap_or_else(|| "never".into())
}

pub async fn token(global: &GlobalArgs, command: TokenCommand) -> anyhow::Result<ExitCode> {
    let client = client(global)?;
    match command {
        TokenCommand::Create { tenant, admin, ttl } => {
            let reply = client.create_token(tenant, admin, ttl).await?;
            let info = reply.token.unwrap_or_default();
            match global.output {
                OutputFormat::Json => {
                    let mut doc = token_json(&info);
                    doc["secret"] = json!(reply.secret);
                    println!("{}", serde_json::to_string_pretty(&doc)?);
                }
                OutputFormat::Table => {
                    // The secret alone on stdout, so `TOKEN=$(corral token create ...)` works.
                    println!("{}", reply.secret);
                    let whom = if info.admin { "admin".to_string() } else { format!("tenant {}", info.tenant) };
                    eprintln!(
                        "token {} for {whom} (expires {}): the secret is shown only this once",
                        info.id,
                        expiry(&info)
                    );
                }
            }
        }
        TokenCommand::List => {
            let tokens = client.list_tokens().await?;
            match global.output {
                OutputFormat::Json => {
                    let docs: Vec<serde_json::Value> = tokens.iter().map(token_json).collect();
                    println!("{}", serde_json::to_string_pretty(&docs)?);
                }
                OutputFormat::Table => {
                    let rows: Vec<Vec<String>> = tokens
                        .iter()
                        .map(|t| {
                            vec![
                                t.id.to_string(),
                                if t.admin { "-".into() } else { t.tenant.clone() },
                                if t.admin { "admin" } else { "tenant" }.to_string(),
                                crate::output::format_utc(corral_types::Timestamp(t.created)),
                                expiry(t),
                                if t.revoked { "revoked" } else { "active" }.to_string(),
                            ]
                        })
                        .collect();
                    println!(
                        "{}",
                        crate::output::table(&["ID", "TENANT", "ROLE", "CREATED", "EXPIRES", "STATE"], &rows)
                    );
                }
            }
        }
        TokenCommand::Revoke { id } => {
            let info = client.revoke_token(id).await?;
            match global.output {
                OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&token_json(&info))?),
                OutputFormat::Table => println!("token {} revoked", info.id),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
