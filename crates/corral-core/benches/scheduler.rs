//! Benchmark of one scheduling pass: 1,250 nodes x 8 GPUs (10,000 GPUs; 1,000 RTX 5090 nodes for
//! MPS, 250 H100 nodes for MIG, with NUMA/PCIe topology), half of the GPUs busy, and 100,000 queued
//! jobs of 20 tenants (quotas, cohorts, weights), three priority classes and mixed shapes (1-8
//! GPUs, 16-GPU gangs across nodes, MIG and MPS slices, with and without time limits).
//!
//! `cargo bench -p corral-core --bench scheduler` runs 100k queued jobs on a half-busy cluster;
//! `-- --jobs 1000000` (or CORRAL_BENCH_JOBS) queues more, `-- --busy 0` starts from an idle
//! cluster (a placement-heavy pass), `-- --runs N` sets the number of timed runs.
//! Prints the median pass time (read-only, what the leader computes), the median end-to-end time
//! (pass + apply of its `Command::Schedule`, i.e. committed in the state machine) and placements/s.

use corral_core::{schedule, ClusterConfig, Command, Outcome, Request, State, TenantPolicy};
use corral_types::{GpuDevice, GpuSlice, JobSpec, NodeSpec, SchedOptions, Timestamp};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const NODES: usize = 1250;
const GPUS_PER_NODE: u32 = 8;
const TENANTS: usize = 20;

/// Deterministic xorshift, so every run schedules the same cluster.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn config() -> ClusterConfig {
    let mut c = ClusterConfig::dev_defaults();
    c.tenants = (0..TENANTS).map(|t| format!("t{t:02}")).collect();
    c.tenant_policies = (0..TENANTS)
        .map(|t| {
            let policy = TenantPolicy {
                // Tenants 0-14 in three cohorts of five; 15-19 unlimited.
                quota_milli_gpus: (t < 15).then_some(300_000 + 100_000 * (t as u64 % 5)),
                cohort: (t < 15).then(|| format!("c{}", t / 5)),
                fair_share_weight: 1 + (t as u32 % 3),
                ..TenantPolicy::default()
            };
            (format!("t{t:02}"), policy)
        })
        .collect();
    if let Some(n) = std::env::var("CORRAL_BENCH_PREEMPTORS").ok().and_then(|v| v.parse().ok()) {
        c.scheduler.max_preemptors_per_pass = n;
    }
    if let Some(n) = std::env::var("CORRAL_BENCH_RESERVATIONS").ok().and_then(|v| v.parse().ok()) {
        c.scheduler.backfill_reservations = n;
    }
    c
}

fn node(i: usize) -> NodeSpec {
    let h100 = i.is_multiple_of(5);
    let name = format!("node-{i:04}");
    NodeSpec {
        name: name.clone(),
        address: format!("10.0.{}.{}:7071", i / 250, i % 250),
        gpus: (0..GPUS_PER_NODE)
            .map(|g| GpuDevice {
                index: g,
                uuid: format!("GPU-{name}-{g}"),
                model: if h100 { "H100".into() } else { "RTX 5090".into() },
                memory_mib: if h100 { 81559 } else { 32768 },
                numa_node: Some(g / 4),
                pci_switch: Some(format!("{}", g / 2)),
                rdma_nic: g.is_multiple_of(4).then(|| format!("mlx5_{}", g / 4)),
                mig_capable: h100,
            })
            .collect(),
        cpu_millis: 128_000,
        memory_bytes: 1 << 40,
        labels: vec![],
        rendezvous_ports: None,
        lease_end: None,
    }
}

fn spec(rng: &mut Rng, preload: bool) -> JobSpec {
    let tenant = format!("t{:02}", rng.below(TENANTS as u64));
    let class = match rng.below(100) {
        0..=9 => "preemptible",
        10..=94 => "normal",
        _ if preload => "normal",
        _ => "gpu-high-priority",
    };
    let (gpus, slice, per_node) = match rng.below(100) {
        0..=44 => (1, None, None),
        45..=59 => (2, None, None),
        60..=69 => (4, None, None),
        70..=77 => (8, None, None),
        78..=79 if !preload => (16, None, Some(8)),
        78..=79 => (2, None, None),
        80..=84 => (0, Some("mps:25"), None),
        85..=89 => (0, Some("mps:50:12GiB"), None),
        90..=94 => (0, Some("mig:1g.10gb"), None),
        _ => (0, Some("mig:3g.40gb"), None),
    };
    let time_limit_secs = (rng.below(10) < 7).then(|| 600 + rng.below(24 * 3600));
    JobSpec {
        name: "bench".into(),
        tenant,
        priority_class: class.into(),
        gpus,
        gpu_slice: slice.map(|s| GpuSlice::parse(s).unwrap()),
        cpu_millis: 1000 * (1 + rng.below(8) as u32),
        memory_bytes: (4 + rng.below(60)) << 30,
        time_limit_secs,
        image: None,
        command: vec!["train".into()].into(),
        env: Default::default(),
        sched: SchedOptions { gpus_per_node: per_node, rdma: rng.below(10) == 0, ..SchedOptions::default() },
        ..Default::default()
    }
}

fn ts(secs: u64, seq: &mut u64) -> Timestamp {
    *seq += 1;
    Timestamp::compose(1_700_000_000_000 + secs * 1000, *seq)
}

fn build(queued: usize, busy_percent: u64) -> (State, Timestamp) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut seq = 0;
    let mut state = State::default();
    let mut apply = |state: &mut State, secs: u64, command: Command| {
        let ts = ts(secs, &mut seq);
        state.apply(&Request { ts, command })
    };
    apply(&mut state, 0, Command::Configure(config())).unwrap();
    for i in 0..NODES {
        apply(&mut state, 0, Command::RegisterNode { spec: node(i) }).unwrap();
    }
    // Half the GPUs busy: preload jobs placed by a pass, started an hour ago.
    let mut submitted = 0;
    let busy_target = NODES as u64 * u64::from(GPUS_PER_NODE) * 1000 * busy_percent / 100;
    while state.running_jobs().map(|j| corral_core::job_milli_gpus(&j.spec)).sum::<u64>() < busy_target {
        for _ in 0..500 {
            submitted += 1;
            let command = Command::SubmitJob { request_id: format!("p{submitted}"), spec: spec(&mut rng, true) };
            apply(&mut state, 0, command).unwrap();
        }
        let pass = schedule(&state, ts(0, &mut 0), &BTreeSet::new());
        if let Some(command) = pass.command() {
            apply(&mut state, 0, command).unwrap();
        }
        let placed: Vec<(u64, u64)> = state
            .running_jobs()
            .filter(|j| j.started_at.is_none())
            .map(|j| (j.id, j.allocation.as_ref().unwrap().epoch))
            .collect();
        for (job_id, epoch) in placed {
            apply(&mut state, 0, Command::JobStarted { job_id, epoch }).unwrap();
        }
        let stuck: Vec<u64> = state.pending_jobs().map(|j| j.id).collect();
        for job_id in stuck {
            apply(&mut state, 0, Command::CancelJob { job_id, reason: String::new() }).unwrap();
        }
    }
    for i in 0..queued {
        let command = Command::SubmitJob { request_id: format!("q{i}"), spec: spec(&mut rng, false) };
        match apply(&mut state, 3600, command) {
            Ok(Outcome::JobSubmitted { .. }) => {}
            other => panic!("submit failed: {other:?}"),
        }
    }
    (state, ts(3600, &mut seq))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let mut queued: usize = std::env::var("CORRAL_BENCH_JOBS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let mut runs = 7;
    let mut pass_only = false;
    let mut busy_percent = 50;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--jobs" => queued = args.next().and_then(|v| v.parse().ok()).expect("--jobs N"),
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--pass-only" => pass_only = true,
            "--busy" => busy_percent = args.next().and_then(|v| v.parse().ok()).expect("--busy PERCENT"),
            _ => {} // cargo bench passes --bench
        }
    }
    let started = Instant::now();
    let (state, now) = build(queued, busy_percent);
    let busy: u64 = state.running_jobs().map(|j| corral_core::job_milli_gpus(&j.spec)).sum();
    println!(
        "cluster: {NODES} nodes x {GPUS_PER_NODE} gpus, {:.0} gpu-equivalents busy ({} running jobs), {} queued jobs (built in {:.1?})",
        busy as f64 / 1000.0,
        state.running_jobs().count(),
        state.pending_count(),
        started.elapsed()
    );
    let none = BTreeSet::new();
    let mut pass_times = Vec::new();
    let mut pass = None;
    for _ in 0..runs {
        let t = Instant::now();
        let p = schedule(&state, now, &none);
        pass_times.push(t.elapsed());
        pass = Some(p);
    }
    let pass = pass.expect("at least one run");
    let mut e2e_times = Vec::new();
    let mut placed = 0;
    for _ in 0..if pass_only { 0 } else { runs } {
        let mut copy = state.clone();
        let t = Instant::now();
        let p = schedule(&copy, now, &none);
        if let Some(command) = p.command() {
            match copy.apply(&Request { ts: now, command }) {
                Ok(Outcome::Scheduled(o)) => {
                    assert!(o.rejected.is_empty(), "apply rejected decisions of a fresh pass: {:?}", &o.rejected[..1]);
                    placed = o.placed.len();
                }
                other => panic!("schedule command failed: {other:?}"),
            }
        }
        e2e_times.push(t.elapsed());
    }
    let pass_min = pass_times.iter().min().copied().unwrap_or_default();
    if pass_only {
        println!("pass: median {:?}, min {pass_min:?}", median(pass_times));
        return;
    }
    let e2e_min = e2e_times.iter().min().copied().unwrap_or_default();
    let (pass_median, e2e_median) = (median(pass_times), median(e2e_times));
    let s = pass.stats;
    let mut reasons: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &pass.pending {
        let text = p.reason.to_string();
        let kind = ["quota", "resources", "gang", "backfill", "priority", "preemption"]
            .into_iter()
            .find(|k| text.starts_with(k))
            .unwrap_or("other");
        *reasons.entry(kind).or_default() += 1;
    }
    println!(
        "pass: considered {} jobs, placed {}, preempted {}, {} reservations, {} preemption searches; pending reasons {reasons:?}",
        s.considered, s.placed, s.preempted, s.reservations, s.preemption_searches
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{runs} runs: pass median {:.2} ms (min {:.2}), pass + apply median {:.2} ms (min {:.2}); {placed} placements \
         committed: {:.0} placements/s end to end (median)",
        ms(pass_median),
        ms(pass_min),
        ms(e2e_median),
        ms(e2e_min),
        placed as f64 / e2e_median.as_secs_f64()
    );
}
