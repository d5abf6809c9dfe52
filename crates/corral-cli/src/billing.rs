//! `corral billing report` and `corral history`: the billing ledger for people and scripts,
//! read page by page.

use crate::args::{BillingArgs, GlobalArgs, HistoryArgs, OutputFormat, PageArgs, ReportFormat};
use crate::connect::client;
use crate::output::{self, format_utc, StreamTable};
use crate::paging;
use crate::times::time_range;
use corral_client::{JobQuery, SegmentQuery};
use corral_types::format_duration;
use serde_json::json;
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

/// Exact decimal rendering of micro-units: 5340000 -> "5.340000".
pub fn money(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

/// A ledger entry's amount: its cost, or a credit as `-0.890000`.
pub fn entry_amount(g: &corral_types::Segment) -> String {
    if g.is_credit() {
        format!("-{}", money(g.cost_micros))
    } else {
        money(g.cost_micros)
    }
}

#[derive(Default)]
struct Row {
    segments: u64,
    gpu_milli_ms: u128,
    cost_micros: u64,
    /// Credits against those segments (`corral billing invoice` lists them).
    credited_micros: u64,
}

pub async fn report(global: &GlobalArgs, args: BillingArgs) -> anyhow::Result<ExitCode> {
    let (since, until) = time_range(args.since.as_deref(), args.until.as_deref())?;
    let query = SegmentQuery { tenant: args.tenant.clone(), job_ids: args.job.into_iter().collect(), since, until };
    let client = client(global)?;
    let mut segments = Vec::new();
    let next = paging::follow(
        args.page.page_token.clone(),
        args.page.limit,
        |token, limit| {
            let (client, query) = (&client, &query);
            async move { client.segments_page(query, &token, limit).await }
        },
        |page| {
            segments.extend(page);
            Ok(())
        },
    )
    .await?;
    let mut rows: BTreeMap<(String, String), Row> = BTreeMap::new();
    for g in &segments {
        let row = rows.entry((g.tenant.clone(), g.priority_class.clone())).or_default();
        if g.is_credit() {
            row.credited_micros += g.cost_micros;
            continue;
        }
        row.segments += 1;
        row.gpu_milli_ms += u128::from(g.duration_ms()) * u128::from(g.gpu_milli);
        row.cost_micros += g.cost_micros;
    }
    let gpu_hours = |r: &Row| r.gpu_milli_ms as f64 / 3_600_000_000.0;
    let total: u64 = rows.values().map(|r| r.cost_micros).sum();
    let credited: u64 = rows.values().map(|r| r.credited_micros).sum();
    let format = if global.output == OutputFormat::Json { ReportFormat::Json } else { args.format };
    match format {
        ReportFormat::Json => {
            let doc = json!({
                "rows": rows.iter().map(|((tenant, class), r)| json!({
                    "tenant": tenant,
                    "priority": class,
                    "segments": r.segments,
                    "gpu_hours": gpu_hours(r),
                    "cost": money(r.cost_micros),
                    "cost_micros": r.cost_micros,
                    "credited": money(r.credited_micros),
                    "credited_micros": r.credited_micros,
                })).collect::<Vec<_>>(),
                "total_cost": money(total),
                "total_cost_micros": total,
                "total_credited": money(credited),
                "total_credited_micros": credited,
                "total_net": money(total.saturating_sub(credited)),
                "total_net_micros": total.saturating_sub(credited),
            });
            let mut doc = doc;
            if args.job.is_some() {
                doc["segments"] = segments.iter().map(segment_json).collect();
            }
            if args.page.limit.is_some() {
                doc["next_page_token"] = json!(next);
            }
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        ReportFormat::Csv => {
            println!("tenant,priority,segments,gpu_hours,cost,credited");
            for ((tenant, class), r) in &rows {
                let (segments, hours, cost, credited) =
                    (r.segments, gpu_hours(r), money(r.cost_micros), money(r.credited_micros));
                println!("{tenant},{class},{segments},{hours:.6},{cost},{credited}");
            }
        }
        ReportFormat::Table => {
            let mut table: Vec<Vec<String>> = rows
                .iter()
                .map(|((tenant, class), r)| {
                    vec![
                        tenant.clone(),
                        class.clone(),
                        r.segments.to_string(),
                        format!("{:.4}", gpu_hours(r)),
                        money(r.cost_micros),
                        money(r.credited_micros),
                    ]
                })
                .collect();
            let blank = String::new;
            table.push(vec!["total".into(), blank(), blank(), blank(), money(total), money(credited)]);
            println!("{}", output::table(&["TENANT", "PRIORITY", "RUNS", "GPU-HOURS", "COST", "CREDITED"], &table));
            if args.job.is_some() {
                let pieces: Vec<Vec<String>> = segments
                    .iter()
                    .map(|g| {
                        vec![
                            g.id.to_string(),
                            g.epoch.to_string(),
                            format_utc(g.start),
                            format_utc(g.end),
                            format_duration(Duration::from_millis(g.duration_ms())),
                            money(g.price_micros_per_gpu_hour),
                            format!("x{}", corral_core::format_multiplier(g.multiplier_milli)),
                            g.policy_version.to_string(),
                            entry_amount(g),
                            g.cause.map_or("-", |c| c.as_str()).to_string(),
                        ]
                    })
                    .collect();
                println!();
                println!(
                    "{}",
                    output::table(
                        &["SEGMENT", "RUN", "START", "END", "BILLED", "PRICE/H", "MULT", "POLICY", "COST", "CAUSE"],
                        &pieces
                    )
                );
            }
        }
    }
    if let (Some(next), false) = (&next, format == ReportFormat::Json) {
        paging::more_hint("segments", next);
    }
    Ok(ExitCode::SUCCESS)
}

fn segment_json(g: &corral_types::Segment) -> serde_json::Value {
    json!({
        "id": g.id,
        "job_id": g.job_id,
        "epoch": g.epoch,
        "node": g.node,
        "gpu_model": g.gpu_model,
        "gpus": g.gpus,
        "start": format_utc(g.start),
        "end": format_utc(g.end),
        "duration_ms": g.duration_ms(),
        "price_micros_per_gpu_hour": g.price_micros_per_gpu_hour,
        "multiplier_milli": g.multiplier_milli,
        "policy_version": g.policy_version,
        "end_state": g.end_state,
        "cause": g.cause.map(|c| c.as_str()),
        "credit_for": g.credit_for,
        "cost_micros": g.cost_micros,
    })
}

const HISTORY_HEADER: &[&str] = &["JOB", "NAME", "TENANT", "GPUS", "START", "END", "ELAPSED", "STATE", "COST"];

pub async fn history(global: &GlobalArgs, args: HistoryArgs) -> anyhow::Result<ExitCode> {
    let (submitted_since, submitted_until) = time_range(args.since.as_deref(), args.until.as_deref())?;
    // The history shows no job's script or environment.
    let query = JobQuery {
        all: true,
        tenant: args.tenant.clone(),
        submitted_since,
        submitted_until,
        brief: true,
        ..Default::default()
    };
    let client = client(global)?;
    let fetch = |token: String, limit: u32| {
        let (client, query) = (&client, &query);
        async move { client.list_jobs_page(query, &token, limit).await }
    };
    let json = global.output == OutputFormat::Json;
    let PageArgs { limit, page_token } = args.page;
    let mut cost: BTreeMap<u64, u64> = BTreeMap::new();
    let add_costs = |cost: &mut BTreeMap<u64, u64>, segments: Vec<corral_types::Segment>| {
        for g in segments {
            let cost = cost.entry(g.job_id).or_default();
            // What the job costs its tenant: its runs less their credits.
            *cost = if g.is_credit() { cost.saturating_sub(g.cost_micros) } else { *cost + g.cost_micros };
        }
    };
    let (jobs, next) = match limit {
        // One page: then the costs of its jobs only.
        Some(_) => {
            let mut jobs = Vec::new();
            let next = paging::follow(page_token, limit, fetch, |page| {
                jobs.extend(page);
                Ok(())
            })
            .await?;
            if !jobs.is_empty() {
                let segments = SegmentQuery {
                    tenant: args.tenant.clone(),
                    job_ids: jobs.iter().map(|j| j.id).collect(),
                    ..Default::default()
                };
                add_costs(&mut cost, client.all_segments(&segments).await?);
            }
            (jobs, next)
        }
        // Everything: the costs first, then the jobs, printed page by page as they arrive.
        None => {
            let segments = SegmentQuery { tenant: args.tenant.clone(), ..Default::default() };
            add_costs(&mut cost, client.all_segments(&segments).await?);
            let mut jobs = Vec::new();
            let mut table = StreamTable::new(HISTORY_HEADER);
            paging::follow(page_token, None, fetch, |page| {
                if json {
                    jobs.extend(page);
                } else {
                    table.print(&page.iter().flat_map(|j| history_rows(j, &cost)).collect::<Vec<_>>());
                }
                Ok(())
            })
            .await?;
            if !json {
                table.finish();
                return Ok(ExitCode::SUCCESS);
            }
            (jobs, None)
        }
    };
    if json {
        let doc: Vec<_> = jobs.iter().map(|j| history_json(j, &cost)).collect();
        let doc = match limit {
            Some(_) => json!({ "jobs": doc, "next_page_token": next }),
            None => serde_json::Value::Array(doc),
        };
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = jobs.iter().flat_map(|j| history_rows(j, &cost)).collect();
    println!("{}", output::table(HISTORY_HEADER, &rows));
    if let Some(next) = next {
        paging::more_hint("jobs", &next);
    }
    Ok(ExitCode::SUCCESS)
}

fn history_json(j: &corral_types::Job, cost: &BTreeMap<u64, u64>) -> serde_json::Value {
    json!({
        "id": j.id,
        "name": j.spec.name,
        "tenant": j.spec.tenant,
        "priority": j.spec.priority_class,
        "gpus": output::resources(j),
        "state": j.state.as_str(),
        "start": j.started_at.map(format_utc),
        "end": j.finished_at.map(format_utc),
        "elapsed_secs": output::elapsed(j).map(|d| d.as_secs_f64()),
        "cost": money(cost.get(&j.id).copied().unwrap_or(0)),
        "cost_micros": cost.get(&j.id).copied().unwrap_or(0),
        "attempts": j.attempts,
        "steps": output::steps_json(j),
    })
}

/// A job's row, then one per step (`12.batch`, `12.0`, …) as `sacct` lists them.
fn history_rows(j: &corral_types::Job, cost: &BTreeMap<u64, u64>) -> Vec<Vec<String>> {
    let mut rows = vec![history_row(j, cost)];
    rows.extend(output::step_rows(j).into_iter().map(|step| {
        vec![
            step.id,
            step.command,
            j.spec.tenant.clone(),
            String::new(),
            String::new(),
            String::new(),
            step.elapsed.map(format_duration).unwrap_or_else(|| "-".into()),
            match step.exit_code {
                Some(code) if step.state != "running" => format!("{} ({code})", step.state),
                _ => step.state,
            },
            String::new(),
        ]
    }));
    rows
}

fn history_row(j: &corral_types::Job, cost: &BTreeMap<u64, u64>) -> Vec<String> {
    vec![
        j.id.to_string(),
        j.spec.name.clone(),
        j.spec.tenant.clone(),
        output::resources(j),
        j.started_at.map(format_utc).unwrap_or_else(|| "-".into()),
        j.finished_at.map(format_utc).unwrap_or_else(|| "-".into()),
        output::elapsed(j).map(format_duration).unwrap_or_else(|| format_duration(Duration::ZERO)),
        j.state.to_string(),
        money(cost.get(&j.id).copied().unwrap_or(0)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn money_is_exact() {
        assert_eq!(money(5_340_000), "5.340000");
        assert_eq!(money(7), "0.000007");
        assert_eq!(money(0), "0.000000");
    }
}
