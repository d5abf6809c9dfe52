//! `corral billing invoice`: one tenant's bill, line by line — each billed run (job, GPUs,
//! model, class, start, end, billed length, price, cost, why it ended) and each credit against
//! one (a negative amount naming the run and the cause) — then the totals. Printed a ledger
//! page at a time as the pages arrive, so neither the coordinator nor the CLI holds the whole
//! history at once.

use crate::args::{GlobalArgs, InvoiceArgs, OutputFormat, ReportFormat};
use crate::billing::{entry_amount as amount, money};
use crate::connect::client;
use crate::output::{format_utc, StreamTable};
use crate::paging;
use crate::times::time_range;
use corral_client::SegmentQuery;
use corral_types::{format_duration, Segment};
use serde_json::json;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

const HEADER: &[&str] =
    &["ENTRY", "JOB", "GPUS", "MODEL", "CLASS", "START", "END", "BILLED", "PRICE/H", "AMOUNT", "CAUSE"];
const CSV_HEADER: &str =
    "entry,kind,job,gpus,gpu_model,class,start,end,billed_ms,price_per_gpu_hour,amount,cause,credit_for";

/// The sums an invoice ends with, micro-units.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    pub runs: u64,
    pub charged_micros: u64,
    pub credits: u64,
    pub credited_micros: u64,
}

impl Totals {
    pub fn add(&mut self, g: &Segment) {
        if g.is_credit() {
            self.credits += 1;
            self.credited_micros = self.credited_micros.saturating_add(g.cost_micros);
        } else {
            self.runs += 1;
            self.charged_micros = self.charged_micros.saturating_add(g.cost_micros);
        }
    }

    /// What is owed: the charges less the credits (a credit never exceeds what it credits).
    pub fn net_micros(&self) -> u64 {
        self.charged_micros.saturating_sub(self.credited_micros)
    }
}

/// GPU-equivalents as a number: `2`, `0.25`.
fn gpus(milli: u32) -> String {
    corral_core::format_multiplier(milli)
}

fn cause(g: &Segment) -> String {
    let cause = g.cause.map_or("-", |c| c.as_str());
    match g.credit_for {
        Some(of) => format!("credit: {cause}, entry {of}"),
        None => cause.to_string(),
    }
}

fn row(g: &Segment) -> Vec<String> {
    if g.is_credit() {
        let blank = String::new;
        return vec![
            g.id.to_string(),
            g.job_id.to_string(),
            blank(),
            blank(),
            blank(),
            format_utc(g.start),
            blank(),
            blank(),
            blank(),
            amount(g),
            cause(g),
        ];
    }
    vec![
        g.id.to_string(),
        g.job_id.to_string(),
        gpus(g.gpu_milli),
        g.gpu_model.clone(),
        g.priority_class.clone(),
        format_utc(g.start),
        format_utc(g.end),
        format_duration(Duration::from_millis(g.duration_ms())),
        money(g.price_micros_per_gpu_hour),
        amount(g),
        cause(g),
    ]
}

fn csv_field(value: &str) -> String {
    if value.contains([',', '"', '\n']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.to_string()
    }
}

fn csv_row(g: &Segment) -> String {
    let kind = if g.is_credit() { "credit" } else { "charge" };
    let fields = [
        g.id.to_string(),
        kind.to_string(),
        g.job_id.to_string(),
        gpus(g.gpu_milli),
        csv_field(&g.gpu_model),
        csv_field(&g.priority_class),
        format_utc(g.start),
        format_utc(g.end),
        g.duration_ms().to_string(),
        money(g.price_micros_per_gpu_hour),
        amount(g),
        g.cause.map_or("", |c| c.as_str()).to_string(),
        g.credit_for.map(|id| id.to_string()).unwrap_or_default(),
    ];
    fields.join(",")
}

fn entry_json(g: &Segment) -> serde_json::Value {
    json!({
        "entry": g.id,
        "kind": if g.is_credit() { "credit" } else { "charge" },
        "job_id": g.job_id,
        "run": g.epoch,
        "node": g.node,
        "gpus": gpus(g.gpu_milli),
        "gpu_model": g.gpu_model,
        "priority": g.priority_class,
        "start": format_utc(g.start),
        "end": format_utc(g.end),
        "billed_ms": g.duration_ms(),
        "price_per_gpu_hour": money(g.price_micros_per_gpu_hour),
        "amount": amount(g),
        "amount_micros": i64::try_from(g.signed_micros()).unwrap_or(i64::MIN),
        "cause": g.cause.map(|c| c.as_str()),
        "credit_for": g.credit_for,
        "end_state": g.end_state,
    })
}

fn totals_json(t: &Totals) -> serde_json::Value {
    json!({
        "runs": t.runs,
        "charged": money(t.charged_micros),
        "charged_micros": t.charged_micros,
        "credits": t.credits,
        "credited": format!("-{}", money(t.credited_micros)),
        "credited_micros": t.credited_micros,
        "total": money(t.net_micros()),
        "total_micros": t.net_micros(),
    })
}

pub async fn invoice(global: &GlobalArgs, args: InvoiceArgs) -> anyhow::Result<ExitCode> {
    let (since, until) = time_range(args.since.as_deref(), args.until.as_deref())?;
    let query = SegmentQuery { tenant: Some(args.tenant.clone()), job_ids: Vec::new(), since, until };
    let client = client(global)?;
    let format = if global.output == OutputFormat::Json { ReportFormat::Json } else { args.format };
    let mut totals = Totals::default();
    let mut table = StreamTable::new(HEADER);
    let mut first = true;
    let stdout = std::io::stdout();
    match format {
        ReportFormat::Csv => println!("{CSV_HEADER}"),
        ReportFormat::Json => print!("{{\"tenant\":{},\"entries\":[", serde_json::to_string(&args.tenant)?),
        ReportFormat::Table => {}
    }
    paging::follow(
        None,
        None,
        |token, limit| {
            let (client, query) = (&client, &query);
            async move { client.segments_page(query, &token, limit).await }
        },
        |page| {
            let mut out = stdout.lock();
            for g in &page {
                totals.add(g);
            }
            match format {
                ReportFormat::Table => table.print(&page.iter().map(row).collect::<Vec<_>>()),
                ReportFormat::Csv => {
                    for g in &page {
                        writeln!(out, "{}", csv_row(g))?;
                    }
                }
                ReportFormat::Json => {
                    for g in &page {
                        write!(out, "{}{}", if first { "" } else { "," }, entry_json(g))?;
                        first = false;
                    }
                }
            }
            out.flush()?;
            Ok(())
        },
    )
    .await?;
    match format {
        ReportFormat::Table => {
            table.finish();
            println!();
            println!("runs     {:>16}  ({} run(s))", money(totals.charged_micros), totals.runs);
            println!("credits  {:>16}  ({} credit(s))", format!("-{}", money(totals.credited_micros)), totals.credits);
            println!("total    {:>16}", money(totals.net_micros()));
        }
        ReportFormat::Csv => {
            println!(",charged,,,,,,,,,{},,", money(totals.charged_micros));
            println!(",credited,,,,,,,,,-{},,", money(totals.credited_micros));
            println!(",total,,,,,,,,,{},,", money(totals.net_micros()));
        }
        ReportFormat::Json => println!("],\"totals\":{}}}", totals_json(&totals)),
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{EndCause, Timestamp};

    fn charge(id: u64, cost: u64, cause: EndCause) -> Segment {
        Segment {
            id,
            job_id: 7,
            epoch: 1,
            tenant: "team-a".into(),
            node: "gpu-01".into(),
            gpu_model: "RTX 5090".into(),
            gpus: 1,
            gpu_milli: 250,
            priority_class: "normal".into(),
            multiplier_milli: 1000,
            price_micros_per_gpu_hour: 890_000,
            start: Timestamp::compose(1_700_000_000_000, 0),
            end: Timestamp::compose(1_700_003_600_000, 0),
            duration_ms: 3_600_000,
            lost: false,
            end_state: "requeued".into(),
            cost_micros: cost,
            policy_version: 0,
            cause: Some(cause),
            credit_for: None,
        }
    }

    #[test]
    fn credits_are_negative_lines_naming_their_run_and_the_totals_subtract_them() {
        let run = charge(1, 222_500, EndCause::NodeLost);
        let credit = Segment { id: 2, credit_for: Some(1), duration_ms: 0, start: run.end, ..run.clone() };
        let mut totals = Totals::default();
        for g in [&run, &credit, &charge(3, 100, EndCause::Exited)] {
            totals.add(g);
        }
        assert_eq!((totals.runs, totals.credits), (2, 1));
        assert_eq!((totals.charged_micros, totals.credited_micros, totals.net_micros()), (222_600, 222_500, 100));
        assert_eq!(amount(&credit), "-0.222500");
        assert_eq!(cause(&credit), "credit: node-lost, entry 1");
        assert_eq!(row(&run)[2], "0.25", "a quarter GPU");
        assert_eq!(row(&run)[10], "node-lost");
        assert_eq!(
            csv_row(&credit),
            "2,credit,7,0.25,RTX 5090,normal,2023-11-14T23:13:20.000Z,2023-11-14T23:13:20.000Z,0,0.890000,-0.222500,node-lost,1"
        );
        assert_eq!(entry_json(&credit)["amount_micros"], -222_500);
        assert_eq!(csv_field("a,b\"c"), "\"a,b\"\"c\"");
    }
}
