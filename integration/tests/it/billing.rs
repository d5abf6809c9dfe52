//! Billing from a real pool: the ledger charges each run once, exactly, for the worker's
//! monotonic run time clipped to the TSO interval since its placement.

use corral_integration::DevPool;

/// Same integer formula as the ledger: ms x milli-GPUs x price per GPU-hour x multiplier.
fn expected_cost(duration_ms: u64, gpu_milli: u64, price: u64, multiplier_milli: u64) -> u64 {
    (u128::from(duration_ms) * u128::from(gpu_milli) * u128::from(price) * u128::from(multiplier_milli)
        / (3_600_000u128 * 1_000_000)) as u64
}

#[test]
fn report_and_history_charge_runs_exactly_at_their_rates() {
    let pool = DevPool::start(&["--gpus", "4"]);
    let high = pool.submit(&["--gpus", "2", "--priority", "gpu-high-priority", "--", "sleep", "0.5"]);
    let cheap = pool.submit(&["--tenant", "team-a", "--gpus", "1", "--priority", "preemptible", "--", "sleep", "0.3"]);
    let cpu_only = pool.submit(&["--", "true"]);
    let mut total = 0;
    let mut per_job = Vec::new();
    for (job, gpu_milli, multiplier) in [(high, 2000, 2000), (cheap, 1000, 400)] {
        let doc = pool.wait_for(job, "succeeded", |d| d["state"] == "succeeded");
        let admitted = doc["admitted_ts"].as_u64().expect("admitted_ts") >> 18;
        let start = doc["started_ts"].as_u64().expect("started_ts") >> 18;
        let end = doc["finished_ts"].as_u64().expect("finished_ts") >> 18;
        assert!(end > start && start >= admitted, "{doc}");
        let worker_ms = doc["worker_run_time_ms"].as_u64().expect("worker_run_time_ms");
        assert!(worker_ms >= 300, "the worker measured the whole sleep: {doc}");
        let cost = expected_cost(worker_ms.min(end - admitted), gpu_milli, 890_000, multiplier);
        assert!(cost > 0);
        total += cost;
        per_job.push((job, cost));
    }
    pool.wait_for(cpu_only, "succeeded", |d| d["state"] == "succeeded");

    let report = pool.json(&["billing", "report"]);
    assert_eq!(report["total_cost_micros"], total, "{report}");
    let rows = report["rows"].as_array().expect("rows");
    let row = |tenant: &str| rows.iter().find(|r| r["tenant"] == tenant).cloned().unwrap_or_default();
    assert_eq!(row("default")["priority"], "gpu-high-priority");
    assert_eq!(row("default")["cost_micros"], per_job[0].1, "{report}");
    assert_eq!(row("team-a")["cost_micros"], per_job[1].1, "{report}");
    assert_eq!(row("default")["segments"], 1, "the CPU-only job costs nothing and adds no GPU segment");

    let only_a = pool.json(&["billing", "report", "--tenant", "team-a"]);
    assert_eq!(only_a["total_cost_micros"], per_job[1].1);
    let future = pool.json(&["billing", "report", "--since", "2999-01-01"]);
    assert_eq!(future["total_cost_micros"], 0);

    let csv = pool.ok(&["billing", "report", "--format", "csv"]);
    // The credits against each row's runs last (none here: the policy credits nothing).
    assert!(csv.starts_with("tenant,priority,segments,gpu_hours,cost,credited\n"), "{csv}");
    assert_eq!(csv.lines().count(), 3, "{csv}");
    assert!(csv.lines().skip(1).all(|l| l.ends_with(",0.000000")), "{csv}");
    assert_eq!(report["total_net_micros"], total, "{report}");

    let history = pool.json(&["history"]);
    let entry =
        |id: u64| history.as_array().and_then(|h| h.iter().find(|e| e["id"] == id).cloned()).unwrap_or_default();
    assert_eq!(entry(high)["cost_micros"], per_job[0].1);
    assert_eq!(entry(high)["gpus"], "2");
    assert_eq!(entry(cpu_only)["cost_micros"], 0);
    assert_eq!(entry(cheap)["state"], "succeeded");

    let bad = pool.corral(&["billing", "report", "--since", "yesterday"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid time 'yesterday'"));
}
