//! Randomized fault harness: 3 coordinators and 2 workers, each in its own network namespace,
//! under a seeded schedule of submits (whole GPUs, gangs, 2-node batch jobs whose script runs
//! once, on their first node, MPS slices, preemptible and
//! gpu-high-priority), cancels (some right after the submit), SIGKILL and SIGSTOP of the
//! leader, a follower and a worker, partitions, small job arrays, `corral requeue` of running
//! jobs, and operators' actions: drains of a worker with a
//! short deadline (its jobs are stopped and requeued), host lease ends a few seconds away (its
//! runs end `lease-ended` at once, the class's grace reaching past the lease end, and are
//! requeued; the node drains at the lease end), price changes (running runs are billed
//! in pieces) and card faults (an XID 79 on a worker's GPU: its runs are requeued and credited,
//! the GPU comes back after the workers' 2 s `recover-after`). Finished jobs move to the on-disk history after 3 s. Every job appends what it sees to a file the test owns; after healing, the test
//! checks the lifecycle invariants against those lines, the replicated state and the billing
//! ledger (every segment has one end cause; the policy credits card faults, lost nodes and lease
//! ends in full and drains by half, and a credit never exceeds the run it credits).
//!
//! Beside the schedule, an abusive tenant (`corral_integration::abuse`) uses every per-request
//! limit at once: the largest arrays and scripts, the longest index lists, listings of every job,
//! and the most slow watches a principal may hold. Two more invariants hold under it: no healthy
//! worker's lease lapses (a run ends `node-lost` only on a worker that was killed, frozen or cut
//! off around then, or while two coordinators were out at once; checked in runs of their own, `CORRAL_SOAK_SECS` set, and only reported
//! inside the whole suite, whose other tests share the cores), and no coordinator's resident
//! memory passes [`RSS_BOUND_MIB`].
//!
//! `CORRAL_SEED=N` replays a schedule (the seed is printed at the start and in every failure);
//! `CORRAL_SOAK_SECS=N` runs the schedule for N seconds instead of the default 60.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::netns::NetHosts;
use corral_integration::worker::WorkerProc;
use corral_types::{GpuSlice, Job, JobSpec, JobState};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Node TTL of the cluster; workers fence after half of it.
const TTL: Duration = Duration::from_secs(4);

/// The longest a worker stays killed, stopped or partitioned.
const WORKER_FAULT_MAX: Duration = Duration::from_secs(6);

/// How long a restarted or healed coordinator may take to catch up with the leader.
const CATCH_UP: Duration = Duration::from_secs(5);

/// How far the stamps of a new leader may run ahead of the clock (the ledger's allowance).
const TSO_LEAD: Duration = Duration::from_secs(5);

/// Most resident memory a coordinator may reach under the schedule and the abusive tenant (a
/// debug build; its arrays' tasks and scripts included).
const RSS_BOUND_MIB: u64 = 512;

/// The credits the run's policy gives (appended to the dev policy).
const CREDITS: &str = "\n[billing.credits]\ngpu-fault = 1.0\nnode-lost = 1.0\ndrained = 0.5\nlease-ended = 1.0\n";

/// xorshift64*: a small, seedable generator, so one seed always gives one schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from + 1))
    }
}

/// What a submitted job asks for, to judge GPU sharing from the jobs' own lines.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Whole {
        gpus: u32,
    },
    Gang,
    /// A 2-node batch job (`corral sbatch`): its script runs once, on its first node.
    BatchGang,
    Mps {
        percent: u32,
    },
}

impl Kind {
    /// Share of each GPU it holds, in percent.
    fn share(self) -> u32 {
        match self {
            Kind::Mps { percent } => percent,
            _ => 100,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Target {
    Coordinator(usize),
    Worker(usize),
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill(Target),
    Stop(Target),
    Partition(Target),
    /// A card fault (one more XID 79) on a worker's GPU; the GPU comes back by itself after
    /// the workers' `recover-after`.
    Gpu {
        worker: usize,
        gpu: u32,
    },
}

struct Pool {
    cluster: Cluster,
    workers: Vec<WorkerProc>,
    hosts: Arc<NetHosts>,
    client: Client,
    rt: tokio::runtime::Runtime,
    lines: PathBuf,
    /// Wall-clock windows (seconds) during which each worker was frozen.
    frozen: Vec<(String, f64, f64)>,
    frozen_since: BTreeMap<usize, f64>,
    /// Wall-clock windows (seconds) during which each worker was killed, frozen or cut off.
    faulted: Vec<(String, f64, f64)>,
    faulted_since: BTreeMap<usize, f64>,
    /// The same for each coordinator (by index): killed, frozen or cut off.
    coordinators_out: Vec<(usize, f64, f64)>,
    coordinators_out_since: BTreeMap<usize, f64>,
    /// XID 79s injected so far per (worker, GPU): the faults file lists them all.
    xids: BTreeMap<(usize, u32), usize>,
    dir: tempfile::TempDir,
}

fn wall_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl Pool {
    fn start() -> Pool {
        let hosts = Arc::new(NetHosts::create(5));
        let node_ttl = format!("{}s", TTL.as_secs());
        // Finished jobs leave memory for the history within seconds, under the faults too.
        let extra_config = "\n[history]\narchive-after = \"3s\"\ncompact-every = \"500ms\"\n".to_string();
        // Snapshots every 100 entries: a killed coordinator restarts from a snapshot and the log
        // after it, and one that was away long enough is sent a snapshot.
        let options = ClusterOptions {
            hosts: Some(hosts.clone()),
            node_ttl,
            extra_config,
            snapshot_every: 100,
            keep_logs_after_snapshot: 20,
            ..Default::default()
        };
        let cluster = Cluster::start(3, options);
        cluster.init_and_join_all();
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let lines = dir.path().join("lines");
        std::fs::write(&lines, "").expect("lines file");
        std::fs::set_permissions(&lines, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        let mut workers = Vec::new();
        for (i, name) in ["w1", "w2"].into_iter().enumerate() {
            let host = 4 + i;
            let mut worker = WorkerProc::configure(dir.path(), name, &cluster.endpoints(), 2);
            worker.in_namespace(hosts.namespace(host), &hosts.addr(host));
            worker.append_config("\n[health]\nrecover-after = \"2s\"\n");
            worker.start();
            worker.wait_registered(&cluster);
            workers.push(worker);
        }
        let endpoints = cluster.endpoints().split(',').map(String::from).collect();
        let mut config = ClientConfig::new(endpoints);
        config.connect_timeout = Duration::from_millis(500);
        config.request_timeout = Duration::from_secs(2);
        config.retry_for = Duration::from_secs(3);
        let client = Client::new(config).expect("client");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        Pool {
            cluster,
            workers,
            hosts,
            client,
            rt,
            lines,
            frozen: Vec::new(),
            frozen_since: BTreeMap::new(),
            faulted: Vec::new(),
            faulted_since: BTreeMap::new(),
            coordinators_out: Vec::new(),
            coordinators_out_since: BTreeMap::new(),
            xids: BTreeMap::new(),
            dir,
        }
    }

    /// Host (1-based) of a target.
    fn host(target: Target) -> usize {
        match target {
            Target::Coordinator(i) => i + 1,
            Target::Worker(i) => 4 + i,
        }
    }

    fn inject(&mut self, fault: Fault) {
        if let Fault::Kill(Target::Worker(i)) | Fault::Stop(Target::Worker(i)) | Fault::Partition(Target::Worker(i)) =
            fault
        {
            self.faulted_since.insert(i, wall_now());
        }
        if let Fault::Kill(Target::Coordinator(i))
        | Fault::Stop(Target::Coordinator(i))
        | Fault::Partition(Target::Coordinator(i)) = fault
        {
            self.coordinators_out_since.insert(i, wall_now());
        }
        match fault {
            Fault::Kill(Target::Coordinator(i)) => self.cluster.kill(i),
            Fault::Kill(Target::Worker(i)) => self.workers[i].kill(),
            Fault::Stop(Target::Coordinator(i)) => self.cluster.signal(i, libc::SIGSTOP),
            Fault::Stop(Target::Worker(i)) => {
                self.frozen_since.insert(i, wall_now());
                self.workers[i].signal(libc::SIGSTOP);
            }
            Fault::Partition(target) => self.hosts.isolate(Self::host(target)),
            Fault::Gpu { worker, gpu } => {
                *self.xids.entry((worker, gpu)).or_default() += 1;
                let mut text = String::new();
                for (&(_, index), &count) in self.xids.range((worker, 0)..=(worker, u32::MAX)) {
                    text.push_str(&format!("[[gpu]]\nindex = {index}\nxid = {:?}\n", vec![79; count]));
                }
                let dir = &self.workers[worker].data_dir;
                std::fs::write(dir.join("faults.toml.tmp"), text).expect("write faults");
                std::fs::rename(dir.join("faults.toml.tmp"), dir.join("faults.toml")).expect("rename faults");
            }
        }
    }

    fn heal(&mut self, fault: Fault) {
        if let Fault::Kill(Target::Worker(i)) | Fault::Stop(Target::Worker(i)) | Fault::Partition(Target::Worker(i)) =
            fault
        {
            let since = self.faulted_since.remove(&i).unwrap_or_else(wall_now);
            self.faulted.push((self.workers[i].name.clone(), since, wall_now()));
        }
        if let Fault::Kill(Target::Coordinator(i))
        | Fault::Stop(Target::Coordinator(i))
        | Fault::Partition(Target::Coordinator(i)) = fault
        {
            let since = self.coordinators_out_since.remove(&i).unwrap_or_else(wall_now);
            self.coordinators_out.push((i, since, wall_now()));
        }
        match fault {
            Fault::Kill(Target::Coordinator(i)) => self.cluster.restart(i),
            Fault::Kill(Target::Worker(i)) => self.workers[i].start(),
            Fault::Stop(Target::Coordinator(i)) => self.cluster.signal(i, libc::SIGCONT),
            Fault::Stop(Target::Worker(i)) => {
                self.workers[i].signal(libc::SIGCONT);
                let since = self.frozen_since.remove(&i).unwrap_or_else(wall_now);
                self.frozen.push((self.workers[i].name.clone(), since, wall_now()));
            }
            Fault::Partition(target) => self.hosts.heal(Self::host(target)),
            // The card checks clean for `recover-after` and comes back by itself.
            Fault::Gpu { .. } => {}
        }
    }

    /// Cordons, drains or resumes a worker's node; whether the cluster took it.
    fn set_mode(&self, worker: usize, mode: &str, deadline_secs: Option<u64>) -> bool {
        let client = self.client.clone();
        let node = self.workers[worker].name.clone();
        let mode = mode.to_string();
        self.rt.block_on(async move { client.set_node_mode(&node, &mode, "chaos", deadline_secs).await }).is_ok()
    }

    /// Sets (`Some`, unix ms) or clears a worker's lease end as an operator does; whether the
    /// cluster took it.
    fn set_lease(&self, worker: usize, lease_end_ms: Option<u64>) -> bool {
        let client = self.client.clone();
        let node = self.workers[worker].name.clone();
        self.rt.block_on(async move { client.set_node_lease(&node, lease_end_ms).await }).is_ok()
    }

    /// Takes a drained or leased worker back: clears the lease end it was given, if any, and
    /// resumes it; whether both took.
    fn take_back(&self, worker: usize, leased: bool) -> bool {
        (!leased || self.set_lease(worker, None)) && self.set_mode(worker, "active", None)
    }

    fn spec(&self, id_hint: u64, kind: Kind, priority: &str, ticks: u64) -> JobSpec {
        // The last line is written just before the exit (no sleep after it), so the span the
        // lines show ends where the run does, even when a loaded machine starves the job.
        let script = format!(
            "i=0; while :; do echo \"$CORRAL_JOB_ID $CORRAL_EPOCH $CORRAL_NODE $$ $CUDA_VISIBLE_DEVICES $(date +%s.%N)\" >> {}; i=$((i+1)); [ $i -lt {ticks} ] || break; sleep 0.1; done",
            self.lines.display()
        );
        let mut spec = JobSpec {
            name: format!("chaos-{id_hint}"),
            tenant: "default".into(),
            priority_class: priority.into(),
            command: vec!["sh".into(), "-c".into(), script].into(),
            ..Default::default()
        };
        match kind {
            Kind::Whole { gpus } => spec.gpus = gpus,
            Kind::Gang => {
                spec.gpus = 2;
                spec.sched.gpus_per_node = Some(1);
            }
            Kind::BatchGang => {
                spec.gpus = 2;
                spec.sched.gpus_per_node = Some(1);
                let script = spec.command.last().cloned().unwrap_or_default();
                spec.script = Some(format!("#!/bin/sh\n{script}\n").into());
                spec.command = Vec::new().into();
                spec.batch_step = true;
            }
            Kind::Mps { percent } => spec.gpu_slice = Some(GpuSlice::Mps { thread_percent: percent, memory_mib: None }),
        }
        spec
    }
}

/// One line a job wrote: job, epoch, node, pid, GPUs, wall time.
struct Line {
    job: u64,
    epoch: u64,
    node: String,
    pid: u32,
    gpus: Vec<String>,
    at: f64,
}

fn read_lines(path: &Path) -> Vec<Line> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() != 6 {
                return None; // a line cut by a kill mid-write
            }
            Some(Line {
                job: f[0].parse().ok()?,
                epoch: f[1].parse().ok()?,
                node: f[2].to_string(),
                pid: f[3].parse().ok()?,
                gpus: f[4].split(',').map(String::from).collect(),
                at: f[5].parse().ok()?,
            })
        })
        .collect()
}

/// One process of one attempt, as seen through its lines.
#[derive(Debug)]
#[expect(dead_code, reason = "`pid` is shown in violations through Debug")]
struct Run {
    job: u64,
    epoch: u64,
    node: String,
    pid: u32,
    gpus: Vec<String>,
    first: f64,
    last: f64,
}

fn runs(lines: &[Line]) -> Vec<Run> {
    let mut by: BTreeMap<(u64, u64, String, u32), Run> = BTreeMap::new();
    for l in lines {
        let run = by.entry((l.job, l.epoch, l.node.clone(), l.pid)).or_insert_with(|| Run {
            job: l.job,
            epoch: l.epoch,
            node: l.node.clone(),
            pid: l.pid,
            gpus: l.gpus.clone(),
            first: l.at,
            last: l.at,
        });
        run.first = run.first.min(l.at);
        run.last = run.last.max(l.at);
    }
    by.into_values().collect()
}

/// Freeze windows per node with back-to-back ones joined: a worker thawed and frozen again at
/// once sees nothing in between.
fn merge_freezes(frozen: &[(String, f64, f64)]) -> Vec<(String, f64, f64)> {
    let mut sorted = frozen.to_vec();
    sorted.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut merged: Vec<(String, f64, f64)> = Vec::new();
    for (node, from, to) in sorted {
        match merged.last_mut() {
            Some(last) if last.0 == node && from <= last.2 + 0.05 => last.2 = last.2.max(to),
            _ => merged.push((node, from, to)),
        }
    }
    merged
}

/// Every invariant the harness checks, as a list of violations.
fn check(
    frozen: &[(String, f64, f64)],
    jobs: &BTreeMap<u64, Job>,
    acked: &BTreeMap<u64, Kind>,
    runs: &[Run],
    segments: &[corral_types::Segment],
    tso: &[u64],
) -> Vec<String> {
    let mut bad = Vec::new();
    // Every acknowledged job survived and ended.
    for id in acked.keys() {
        match jobs.get(id) {
            None => bad.push(format!("acknowledged job {id} is gone")),
            Some(job) if !job.state.is_terminal() => {
                bad.push(format!("job {id} is still {} after healing: {:?}", job.state, job.reason))
            }
            Some(_) => {}
        }
    }
    // No two processes of one job at once, except the parts of one gang attempt.
    let mut per_job: BTreeMap<u64, Vec<&Run>> = BTreeMap::new();
    for run in runs {
        per_job.entry(run.job).or_default().push(run);
    }
    for (job, runs) in &per_job {
        for (i, a) in runs.iter().enumerate() {
            for b in &runs[i + 1..] {
                let gang_parts = a.epoch == b.epoch && a.node != b.node;
                if !gang_parts && a.first <= b.last && b.first <= a.last {
                    bad.push(format!("job {job} ran twice at once: {a:?} and {b:?}"));
                }
            }
        }
    }
    // A batch job's script runs once per attempt, on one node (its first): the other node only
    // holds its part.
    for (job, runs) in &per_job {
        if !matches!(acked.get(job), Some(Kind::BatchGang)) {
            continue;
        }
        for (i, a) in runs.iter().enumerate() {
            if let Some(b) = runs[i + 1..].iter().find(|b| b.epoch == a.epoch && b.node != a.node) {
                bad.push(format!("batch job {job} ran its script on two nodes: {a:?} and {b:?}"));
            }
        }
    }
    // No GPU shared beyond 100%: at each process start, the shares of the processes that
    // wrote a line around it on the same GPU. A job whose submit was not acknowledged (its
    // reply lost in a leader change) may run too: its share is its spec's, as listed.
    let share_of = |job: u64| match (acked.get(&job), jobs.get(&job).map(|j| &j.spec.gpu_slice)) {
        (Some(kind), _) => kind.share(),
        (None, Some(Some(corral_types::GpuSlice::Mps { thread_percent, .. }))) => *thread_percent,
        (None, _) => 100,
    };
    for run in runs {
        for gpu in &run.gpus {
            let share: u32 = runs
                .iter()
                .filter(|o| o.node == run.node && o.gpus.contains(gpu) && o.first <= run.first && run.first <= o.last)
                .map(|o| share_of(o.job))
                .sum();
            if share > 100 {
                bad.push(format!(
                    "GPU {gpu} of {} was held {share}% at {:.3} (by job {} and others)",
                    run.node, run.first, run.job
                ));
            }
        }
    }
    // Billing: every attempt that ran is billed once (one segment covers all nodes of a gang),
    // and a segment's length matches what the attempt's processes showed (a gang: its longest
    // part): within 1 s for a run
    // the worker reported; for a run whose node was lost (TSO interval), within the TTL above
    // and one TSO window below (the stamps of a new leader may run that far ahead of the clock).
    // A run that spans a price change is billed in pieces: they must meet end to start, each
    // with a later policy version, and count as one segment of their summed length.
    // Causes and credits: see `check_credits`.
    let mut pieces: BTreeMap<(u64, u64), Vec<&corral_types::Segment>> = BTreeMap::new();
    for s in segments.iter().filter(|s| s.credit_for.is_none()) {
        pieces.entry((s.job_id, s.epoch)).or_default().push(s);
    }
    let mut whole_runs: BTreeMap<(u64, u64), corral_types::Segment> = BTreeMap::new();
    for (&(job, epoch), parts) in &pieces {
        let mut run = parts[0].clone();
        for pair in parts.windows(2) {
            if pair[0].end != pair[1].start || pair[0].policy_version >= pair[1].policy_version {
                bad.push(format!("job {job} epoch {epoch} was billed twice: {:?} and {:?}", pair[0], pair[1]));
            }
            run.duration_ms += pair[1].duration_ms;
        }
        whole_runs.insert((job, epoch), run);
    }
    let billed: BTreeMap<(u64, u64), &corral_types::Segment> = whole_runs.iter().map(|(k, v)| (*k, v)).collect();
    // A gang's attempt is billed for its longest part: spans are per (job, epoch, node).
    let mut spans: BTreeMap<(u64, u64, &str), (f64, f64)> = BTreeMap::new();
    // A worker measures a run until it sees the exit: one frozen when its job ended (or when
    // its guard killed it) sees it only when thawed, and bills the run up to then (README).
    let mut frozen_at_end: BTreeMap<(u64, u64), f64> = BTreeMap::new();
    // A freeze healed and injected again in the same step is one freeze to the worker.
    let frozen = merge_freezes(frozen);
    for run in runs {
        let span = spans.entry((run.job, run.epoch, run.node.as_str())).or_insert((run.first, run.last));
        span.0 = span.0.min(run.first);
        span.1 = span.1.max(run.last);
        let late: f64 = frozen
            .iter()
            .filter(|(node, from, to)| *node == run.node && *from <= run.last + 0.2 && *to >= run.last)
            .map(|(_, from, to)| to - from.max(run.last))
            .sum::<f64>()
            // Frozen right after it spawned the job (the first line comes after the thaw): the
            // worker's clock ran from the spawn, through the freeze (seed 1796587899080802032).
            + frozen_at_spawn(&frozen, &run.node, run.first);
        let entry = frozen_at_end.entry((run.job, run.epoch)).or_default();
        *entry = entry.max(late);
    }
    let mut seen: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    for ((job, epoch, _), (first, last)) in &spans {
        let ms = seen.entry((*job, *epoch)).or_default();
        *ms = (*ms).max(((last - first) * 1000.0) as u64);
    }
    for (&(job, epoch), &seen_ms) in &seen {
        let Some(segment) = billed.get(&(job, epoch)) else {
            bad.push(format!("job {job} epoch {epoch} ran but was never billed"));
            continue;
        };
        // A lost run is billed until the leader declares the loss (a TTL after the last
        // heartbeat it saw) or until the node's restarted worker stopped it, whichever is first:
        // a killed worker is back within the longest worker fault, however long its
        // registration then takes to get through. Plus one TSO lead allowance (the stamps of a
        // new leader may run ahead of the clock).
        let late_ms = (frozen_at_end.get(&(job, epoch)).copied().unwrap_or(0.0) * 1000.0) as u64;
        let lost_above = (TTL + WORKER_FAULT_MAX + TSO_LEAD).as_millis() as u64;
        let (below, above) = if segment.lost { (4_000, lost_above) } else { (1_000, 1_200 + late_ms) };
        if segment.duration_ms + below < seen_ms || segment.duration_ms > seen_ms + above {
            bad.push(format!(
                "job {job} epoch {epoch} was billed {} ms ({}{}) for a run seen for {seen_ms} ms (worker measured {:?} ms)",
                segment.duration_ms,
                segment.end_state,
                if segment.lost { ", node lost" } else { "" },
                jobs.get(&job).and_then(|j| j.worker_run_time_ms)
            ));
        }
    }
    for ((job, epoch), s) in &billed {
        if !seen.contains_key(&(*job, *epoch)) && !s.lost && s.duration_ms > 1_000 {
            bad.push(format!("job {job} epoch {epoch} was billed {} ms without a line", s.duration_ms));
        }
    }
    // The TSO never went backwards.
    for pair in tso.windows(2) {
        if pair[1] <= pair[0] {
            bad.push(format!("TSO went from {} to {}", pair[0], pair[1]));
        }
    }
    bad
}

/// Credits: every billed piece has exactly one end cause; every credit names a piece of the same
/// run, carries that piece's cause, is stamped when the run ended (at or after the piece's end), and never exceeds what the
/// piece cost; a piece is credited at most once.
fn check_credits(segments: &[corral_types::Segment]) -> Vec<String> {
    let mut bad = Vec::new();
    let pieces: BTreeMap<u64, &corral_types::Segment> =
        segments.iter().filter(|s| s.credit_for.is_none()).map(|s| (s.id, s)).collect();
    for s in pieces.values() {
        if s.cause.is_none() {
            bad.push(format!("job {} epoch {} was billed without an end cause: {s:?}", s.job_id, s.epoch));
        }
    }
    let mut credited: BTreeMap<u64, u64> = BTreeMap::new();
    for credit in segments.iter().filter(|s| s.credit_for.is_some()) {
        let of = credit.credit_for.unwrap_or_default();
        *credited.entry(of).or_default() += 1;
        let Some(piece) = pieces.get(&of) else {
            bad.push(format!("credit {} names no billed piece: {credit:?}", credit.id));
            continue;
        };
        if (credit.job_id, credit.epoch) != (piece.job_id, piece.epoch)
            || credit.cause != piece.cause
            || credit.cost_micros > piece.cost_micros
            || credit.start < piece.end
        {
            bad.push(format!("credit {credit:?} does not match the piece it credits: {piece:?}"));
        }
    }
    for (piece, count) in credited {
        if count > 1 {
            bad.push(format!("billed piece {piece} was credited {count} times"));
        }
    }
    bad
}

/// Lease lapses of healthy workers: a run that ended `node-lost` must have been billed to a moment
/// its worker was killed, frozen or cut off, or within a TTL (and the TSO's lead) after it healed.
/// One coordinator's kill, freeze or partition, the leader's included, excuses nothing: a healthy
/// worker finds the new leader before its lease ends. Two coordinators out within a TTL of the
/// lapse (a restarted one counts as out for [`CATCH_UP`] after, while it replays and catches up)
/// may have left no majority, and no leader to renew any lease.
/// A gang's run is billed under its first node: a fault of any of the pool's workers excuses it.
fn lapses(
    faulted: &[(String, f64, f64)],
    coordinators_out: &[(usize, f64, f64)],
    acked: &BTreeMap<u64, Kind>,
    segments: &[corral_types::Segment],
) -> Vec<String> {
    let slack = 1.0;
    let after = (TTL + TSO_LEAD).as_secs_f64();
    let no_majority = |at: f64| {
        let window = (at - after - slack, at + slack);
        let out: std::collections::BTreeSet<usize> = coordinators_out
            .iter()
            .filter(|(_, from, to)| *from <= window.1 && to + CATCH_UP.as_secs_f64() >= window.0)
            .map(|(i, _, _)| *i)
            .collect();
        out.len() >= 2
    };
    segments
        .iter()
        .filter(|s| s.credit_for.is_none() && s.cause == Some(corral_types::EndCause::NodeLost))
        .filter_map(|s| {
            let billed_to = (s.start.physical_ms() + s.duration_ms) as f64 / 1000.0;
            let excused = faulted
                .iter()
                .filter(|(node, _, _)| *node == s.node || matches!(acked.get(&s.job_id), Some(Kind::Gang | Kind::BatchGang)))
                .any(|(_, from, to)| from - slack <= billed_to && billed_to <= to + after + slack)
                || no_majority(billed_to);
            (!excused).then(|| {
                format!(
                    "the lease of healthy worker {} lapsed: job {} epoch {} ended node-lost, billed to {billed_to:.3}, with no fault of {} around then",
                    s.node, s.job_id, s.epoch, s.node
                )
            })
        })
        .collect()
}

/// How long `node` was frozen in a freeze that ended just before a run's first line at `first`:
/// the worker spawned the job, then froze, and its clock counted the freeze.
fn frozen_at_spawn(frozen: &[(String, f64, f64)], node: &str, first: f64) -> f64 {
    frozen
        .iter()
        .filter(|(n, _, to)| n == node && (first - 0.2..=first).contains(to))
        .map(|(_, from, to)| to - from)
        .sum()
}

/// The seed that found this (1796587899080802032): w1 frozen from 51.047 to 53.680, the job's
/// only line at 53.700, the worker measured 2 679 ms from the spawn before the freeze.
#[test]
fn a_freeze_right_after_the_spawn_counts_as_late() {
    let frozen = vec![("w1".to_string(), 51.047, 53.680), ("w2".to_string(), 51.0, 53.69)];
    let late = frozen_at_spawn(&frozen, "w1", 53.700);
    assert!((late - 2.633).abs() < 1e-6, "{late}");
    assert_eq!(frozen_at_spawn(&frozen, "w1", 60.0), 0.0);
}

fn soak_secs() -> u64 {
    std::env::var("CORRAL_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60)
}

/// The seed that found this (1796408456587908161): w1 was frozen at 56.426, thawed and frozen
/// again at 58.756, thawed at 62.546; its job ended at 56.4 and was billed until 62.5.
#[test]
fn back_to_back_freezes_are_one_freeze() {
    let frozen = vec![
        ("w1".to_string(), 58.756, 62.546),
        ("w2".to_string(), 57.0, 58.0),
        ("w1".to_string(), 56.426, 58.756),
        ("w1".to_string(), 70.0, 71.0),
    ];
    assert_eq!(
        merge_freezes(&frozen),
        vec![("w1".to_string(), 56.426, 62.546), ("w1".to_string(), 70.0, 71.0), ("w2".to_string(), 57.0, 58.0)]
    );
}

#[test]
fn lifecycle_invariants_hold_under_random_faults() {
    let _alone = crate::alone();
    let seed: u64 = std::env::var("CORRAL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    eprintln!("chaos seed: {seed} (replay with CORRAL_SEED={seed})");
    let mut rng = Rng(seed);
    let mut pool = Pool::start();
    let mut acked: BTreeMap<u64, Kind> = BTreeMap::new();
    let mut tso = Vec::new();
    let mut coordinator_fault: Option<(Instant, Fault)> = None;
    let mut worker_fault: Option<(Instant, Fault)> = None;
    // A worker being drained or given a lease end, when it is taken back, and whether a lease.
    let mut drain: Option<(Instant, usize, bool)> = None;
    let dev_policy =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster-configs/dev-policy.toml"))
            .expect("dev policy");
    let dev_policy = format!("{dev_policy}{CREDITS}");
    {
        let client = pool.client.clone();
        let text = dev_policy.clone();
        pool.rt
            .block_on(async move { client.apply_policy("chaos.toml", &text, false, false).await })
            .expect("the run's policy (credits) applies");
    }
    let mut dearer = false;
    // The test process's own stalls (a thread that should wake every 50 ms): when every daemon
    // of the run goes quiet at once, this tells a stall of the machine from one of corral's.
    let stalls: Arc<std::sync::Mutex<Vec<(f64, f64)>>> = Arc::default();
    let stall_watch = {
        let stalls = stalls.clone();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = done.clone();
        let thread = std::thread::spawn(move || {
            let mut last = wall_now();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
                let now = wall_now();
                if now - last > 1.0 {
                    stalls.lock().expect("stalls").push((last, now));
                }
                last = now;
            }
        });
        (done, thread)
    };
    // A step that never returns (a call without a bound, a fault never healed because of it)
    // would hang the suite until CI's limit: past HUNG without a step, the test process's
    // stacks are printed and it aborts, so the run fails and says where it was.
    const HUNG: Duration = Duration::from_secs(300);
    let progress = Arc::new(std::sync::atomic::AtomicU64::new(wall_now() as u64));
    // The daemons' pids as of the last step, for the watchdog's stacks.
    let daemons: Arc<std::sync::Mutex<Vec<(String, u32)>>> = Arc::default();
    /// Ends the watch when the test returns or panics.
    struct EndWatch(Arc<std::sync::atomic::AtomicU64>);
    impl Drop for EndWatch {
        fn drop(&mut self) {
            self.0.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let _end_watch = EndWatch(progress.clone());
    let _hang_watch = {
        let progress = progress.clone();
        let daemons = daemons.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs(5));
            let last = progress.load(std::sync::atomic::Ordering::Relaxed);
            if last == u64::MAX {
                return;
            }
            if (wall_now() as u64).saturating_sub(last) > HUNG.as_secs() {
                // Straight to the process's stderr: the test harness's capture (which eprintln!
                // writes to, from this thread too) is lost when the process aborts.
                let mut message = format!(
                    "chaos seed {seed} (replay with CORRAL_SEED={seed}): no step for {} s (since {last}): the test process's stacks:\n{}\n",
                    HUNG.as_secs(),
                    corral_integration::thread_dump(std::process::id())
                );
                for (name, pid) in daemons.lock().map(|d| d.clone()).unwrap_or_default() {
                    message.push_str(&format!("{name}'s stacks:\n{}\n", corral_integration::thread_dump(pid)));
                }
                let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), message.as_bytes());
                // The abort runs no destructor: the daemons would outlive the test and load the
                // tests after it.
                for (_, pid) in daemons.lock().map(|d| d.clone()).unwrap_or_default() {
                    // SAFETY: kill(2) has no memory-safety preconditions.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                }
                std::process::abort();
            }
        })
    };
    let abuser =
        corral_integration::abuse::Abuser::start(pool.cluster.endpoints().split(',').map(String::from).collect(), seed);
    let mut rss_max_kib: BTreeMap<usize, u64> = BTreeMap::new();
    let mut rss_shown = Instant::now();
    let mut faults = Vec::new();
    // When each fault ended (wall clock, like the jobs' lines): for the post-mortem.
    let mut healed = Vec::new();
    let end = Instant::now() + Duration::from_secs(soak_secs());
    let mut step = 0u64;

    while Instant::now() < end {
        step += 1;
        progress.store(wall_now() as u64, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut d) = daemons.lock() {
            d.clear();
            d.extend((0..3).filter_map(|i| pool.cluster.pid(i).map(|p| (format!("coordinator {}", i + 1), p))));
            d.extend(pool.workers.iter().filter_map(|w| w.pid().map(|p| (format!("worker {}", w.name), p))));
        }
        std::thread::sleep(rng.millis(50, 500));
        for i in 0..3 {
            if let Some(kib) = pool.cluster.pid(i).and_then(corral_integration::rss_kib) {
                let max = rss_max_kib.entry(i).or_default();
                *max = (*max).max(kib);
            }
        }
        if rss_shown.elapsed() >= Duration::from_secs(60) {
            rss_shown = Instant::now();
            let now: Vec<u64> =
                (0..3).filter_map(|i| pool.cluster.pid(i).and_then(corral_integration::rss_kib)).collect();
            eprintln!("chaos seed {seed}: step {step}: coordinators' RSS now (KiB) {now:?}, largest {rss_max_kib:?}");
        }
        for slot in [&mut coordinator_fault, &mut worker_fault] {
            if let Some((at, fault)) = *slot {
                if Instant::now() >= at {
                    *slot = None;
                    pool.heal(fault);
                    healed.push(format!("{:.3} healed {fault:?}", wall_now()));
                }
            }
        }
        if let Some((at, worker, leased)) = drain {
            if Instant::now() >= at && pool.take_back(worker, leased) {
                drain = None;
                healed.push(format!("{:.3} resumed w{}", wall_now(), worker + 1));
            }
        }
        let roll = rng.below(100);
        if roll < 50 {
            let kind = match rng.below(11) {
                0..=4 => Kind::Whole { gpus: 1 },
                5 => Kind::Whole { gpus: 2 },
                6 => Kind::Gang,
                7 => Kind::BatchGang,
                _ => Kind::Mps { percent: [25, 50, 75][rng.below(3) as usize] },
            };
            let priority = ["preemptible", "normal", "normal", "gpu-high-priority"][rng.below(4) as usize];
            let mut spec = pool.spec(step, kind, priority, 2 + rng.below(25));
            if matches!(kind, Kind::Whole { gpus: 1 }) && rng.chance(15) {
                // A small job array: its tasks are created as they may run, two at a time.
                let ranges = vec![corral_types::ArrayRange { first: 0, last: 2, step: 1 }];
                spec.array = Some(corral_types::ArraySpec { ranges, max_running: Some(2) });
            }
            let cancel_at_once = rng.chance(20);
            let client = pool.client.clone();
            let submitted = pool.rt.block_on(async move {
                let job = client.submit(&spec).await?;
                if cancel_at_once {
                    let _ = client.cancel(job.job_id).await;
                }
                Ok::<_, corral_client::ClientError>(job.job_id)
            });
            if let Ok(id) = submitted {
                acked.insert(id, kind);
            }
        } else if roll < 65 {
            if !acked.is_empty() {
                let ids: Vec<u64> = acked.keys().copied().collect();
                let id = ids[rng.below(ids.len() as u64) as usize];
                let client = pool.client.clone();
                if rng.chance(70) {
                    let _ = pool.rt.block_on(async move { client.cancel(id).await });
                } else {
                    // `corral requeue`: stopped like a preemption, back in the queue.
                    let job = corral_types::JobRef { id, task: None };
                    let request =
                        corral_proto::v1::ControlJobRequest { action: "requeue".into(), ..Default::default() };
                    let _ = pool.rt.block_on(async move { client.control_job(job, request).await });
                }
            }
        } else if roll < 80 {
            if coordinator_fault.is_none() {
                let leader = pool.cluster.leader();
                let index = if rng.chance(60) { leader } else { (leader + 1 + rng.below(2) as usize) % 3 };
                let target = Target::Coordinator(index);
                let (fault, lasts) = match rng.below(3) {
                    0 => (Fault::Kill(target), rng.millis(300, 3_000)),
                    1 => (Fault::Stop(target), rng.millis(300, 3_000)),
                    _ => (Fault::Partition(target), rng.millis(1_000, 5_000)),
                };
                faults.push(format!("{:.3} {fault:?} for {lasts:?} (leader was {leader})", wall_now()));
                pool.inject(fault);
                coordinator_fault = Some((Instant::now() + lasts, fault));
            }
        } else if roll < 92 {
            if worker_fault.is_none() {
                let worker = rng.below(2) as usize;
                let target = Target::Worker(worker);
                let (fault, lasts) = match rng.below(4) {
                    0 => (Fault::Kill(target), rng.millis(500, WORKER_FAULT_MAX.as_millis() as u64)),
                    1 => (Fault::Stop(target), rng.millis(500, WORKER_FAULT_MAX.as_millis() as u64)),
                    2 => (Fault::Partition(target), rng.millis(1_000, WORKER_FAULT_MAX.as_millis() as u64)),
                    _ => (Fault::Gpu { worker, gpu: rng.below(2) as u32 }, rng.millis(500, 2_000)),
                };
                faults.push(format!("{:.3} {fault:?} for {lasts:?}", wall_now()));
                pool.inject(fault);
                worker_fault = Some((Instant::now() + lasts, fault));
            }
        } else if roll < 95 {
            let client = pool.client.clone();
            if let Ok(ts) = pool.rt.block_on(async move { client.timestamps(1).await }) {
                tso.push(ts.0);
            }
        } else if roll < 98 {
            if drain.is_none() {
                let worker = rng.below(2) as usize;
                if rng.chance(50) {
                    let deadline_secs = rng.below(3);
                    if pool.set_mode(worker, "draining", Some(deadline_secs)) {
                        let lasts = rng.millis(1_000, 5_000);
                        faults.push(format!(
                            "{:.3} drain w{} (deadline {deadline_secs}s) for {lasts:?}",
                            wall_now(),
                            worker + 1
                        ));
                        drain = Some((Instant::now() + lasts, worker, false));
                    }
                } else {
                    // The host goes back to its owner soon: its runs end `lease-ended` now (the
                    // class's grace reaches past the lease end), the node drains at the end.
                    let ends_in = rng.millis(500, 4_000);
                    let lease_end_ms = (wall_now() * 1000.0) as u64 + ends_in.as_millis() as u64;
                    if pool.set_lease(worker, Some(lease_end_ms)) {
                        let lasts = ends_in + rng.millis(500, 3_000);
                        faults.push(format!(
                            "{:.3} lease of w{} ends in {ends_in:?}, taken back after {lasts:?}",
                            wall_now(),
                            worker + 1
                        ));
                        drain = Some((Instant::now() + lasts, worker, true));
                    }
                }
            }
        } else {
            let text = if dearer { dev_policy.clone() } else { dev_policy.replace("0.89", "1.78") };
            let client = pool.client.clone();
            let applied = pool.rt.block_on(async move { client.apply_policy("chaos.toml", &text, false, false).await });
            if let Ok(reply) = applied {
                dearer = !dearer;
                faults.push(format!("{:.3} policy version {}: {:?}", wall_now(), reply.version, reply.changes));
            }
        }
    }
    // Heal first: the abuser's last calls (and its clean-up) may wait on a frozen coordinator.
    for slot in [&mut coordinator_fault, &mut worker_fault] {
        if let Some((_, fault)) = slot.take() {
            pool.heal(fault);
            healed.push(format!("{:.3} healed {fault:?}", wall_now()));
        }
    }
    let abuse = abuser.stop();
    progress.store(wall_now() as u64, std::sync::atomic::Ordering::Relaxed);
    stall_watch.0.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = stall_watch.1.join();
    let stalls = stalls.lock().expect("stalls").clone();
    if !stalls.is_empty() {
        let shown: Vec<String> = stalls.iter().map(|(from, to)| format!("{from:.3}+{:.1}s", to - from)).collect();
        eprintln!("chaos seed {seed}: the test process itself stalled over 1 s: {}", shown.join(", "));
    }
    eprintln!("chaos seed {seed}: abusive tenant: {abuse:?}");
    eprintln!("chaos seed {seed}: coordinators' largest RSS (KiB): {rss_max_kib:?}");
    // Every worker takes jobs again (retried through any leader change).
    let resume_by = Instant::now() + Duration::from_secs(60);
    while let Some((_, worker, leased)) = drain {
        if pool.take_back(worker, leased) {
            drain = None;
            healed.push(format!("{:.3} resumed w{}", wall_now(), worker + 1));
        }
        assert!(Instant::now() < resume_by, "chaos seed {seed}: the healed cluster refused to resume w{}", worker + 1);
    }
    eprintln!("chaos seed {seed}: {step} steps, {} acknowledged jobs, {} faults", acked.len(), faults.len());
    progress.store(wall_now() as u64, std::sync::atomic::Ordering::Relaxed);

    // Healed: every acknowledged job must end (the longest runs 2.7 s), and so must every other
    // job of the schedule: a submit whose every retry failed still made a job when one of them
    // committed, and the billing check below looks at every run, a late one of such a job
    // included (seed 798393790777709111: it started 80 s after the heal, behind the queue, and
    // was still running when only the acknowledged jobs were waited for). The schedule's jobs
    // are tenant `default`'s: listing the abusive tenant's too would page through every
    // archived array and its 1 MiB script, hundreds of megabytes per listing after ten minutes.
    let deadline = Instant::now() + Duration::from_secs(180);
    let jobs = loop {
        let client = pool.client.clone();
        let jobs: BTreeMap<u64, Job> = pool
            .rt
            .block_on(async move { client.list_jobs(true, Some("default".into())).await })
            .map(|all| all.into_iter().map(|j| (j.id, j)).collect())
            .unwrap_or_default();
        let every_acked_ended = acked.keys().all(|id| jobs.get(id).is_some_and(|j| j.state.is_terminal()));
        if !jobs.is_empty() && every_acked_ended && jobs.values().all(|j| j.state.is_terminal()) {
            break jobs;
        }
        if Instant::now() > deadline {
            break jobs;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    progress.store(wall_now() as u64, std::sync::atomic::Ordering::Relaxed);
    for ts in [1, 2] {
        let client = pool.client.clone();
        if let Ok(t) = pool.rt.block_on(async move { client.timestamps(ts).await }) {
            tso.push(t.0);
        }
    }
    let client = pool.client.clone();
    let segments = pool.rt.block_on(async move { client.segments(None, None, None, None).await }).expect("segments");
    let runs = runs(&read_lines(&pool.lines));
    let mut bad = check(&pool.frozen, &jobs, &acked, &runs, &segments, &tso);
    bad.extend(check_credits(&segments));
    // A lapse needs a healthy worker starved of its heartbeats; inside the whole test suite the
    // other tests share the machine's cores with this one, so there it is reported, and it fails
    // only a run of its own (`CORRAL_SOAK_SECS` set).
    let lapsed = lapses(&pool.faulted, &pool.coordinators_out, &acked, &segments);
    if std::env::var_os("CORRAL_SOAK_SECS").is_some() {
        bad.extend(lapsed);
    } else if !lapsed.is_empty() {
        eprintln!("chaos seed {seed}: not counted in a run beside other tests:\n{}", lapsed.join("\n"));
    }
    for (i, kib) in &rss_max_kib {
        if *kib > RSS_BOUND_MIB * 1024 {
            bad.push(format!("coordinator {} reached {} MiB resident (bound {RSS_BOUND_MIB} MiB)", i + 1, kib / 1024));
        }
    }

    // No ended job still holds a GPU: a gang over all four GPUs runs.
    let mut last = pool.spec(0, Kind::Gang, "normal", 1);
    last.gpus = 4;
    last.sched.gpus_per_node = Some(2);
    let client = pool.client.clone();
    let finished = pool.rt.block_on(async move {
        let job = client.submit(&last).await?;
        tokio::time::timeout(Duration::from_secs(60), client.wait_job(job.job_id, |_| {}))
            .await
            .map_err(|_| corral_client::ClientError::Protocol("timed out after 60 s".into()))?
    });
    match finished {
        Ok(job) if job.state == JobState::Succeeded => {}
        Ok(job) => bad.push(format!("a job on every GPU ended {}: {:?}", job.state, job.reason)),
        Err(e) => bad.push(format!("a job on every GPU never ran: some GPU is still held ({e})")),
    }

    let states: BTreeMap<String, usize> = jobs.values().fold(BTreeMap::new(), |mut m, j| {
        *m.entry(j.state.to_string()).or_default() += 1;
        m
    });
    let causes: BTreeMap<String, usize> = segments.iter().fold(BTreeMap::new(), |mut m, g| {
        let cause = g.cause.map_or("none", |c| c.as_str());
        *m.entry(if g.credit_for.is_some() { format!("credit {cause}") } else { cause.to_string() }).or_default() += 1;
        m
    });
    eprintln!(
        "chaos seed {seed}: {} processes seen, {} segments ({causes:?}), end states {states:?}",
        runs.len(),
        segments.len()
    );
    if !bad.is_empty() {
        // Keep the daemons' logs and the jobs' lines for the post-mortem.
        let kept = std::env::temp_dir().join(format!("corral-chaos-{seed}"));
        let _ = std::fs::create_dir_all(&kept);
        for dir in [pool.cluster.dir(), pool.dir.path()] {
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if entry.path().is_file() {
                    let _ = std::fs::copy(entry.path(), kept.join(entry.file_name()));
                }
            }
        }
        let stalled: Vec<String> = stalls
            .iter()
            .map(|(from, to)| format!("{from:.3} the test process stalled for {:.1}s", to - from))
            .collect();
        let _ =
            std::fs::write(kept.join("faults"), [faults.join("\n"), healed.join("\n"), stalled.join("\n")].join("\n"));
        // A cluster that did not settle: where each daemon's threads are now.
        for i in 0..3 {
            if let Some(pid) = pool.cluster.pid(i) {
                let _ =
                    std::fs::write(kept.join(format!("coordinator-{i}.stacks")), corral_integration::thread_dump(pid));
            }
        }
        for worker in &pool.workers {
            if let Some(pid) = worker.pid() {
                let _ = std::fs::write(
                    kept.join(format!("worker-{}.stacks", worker.name)),
                    corral_integration::thread_dump(pid),
                );
            }
        }
        panic!(
            "chaos seed {seed} (replay with CORRAL_SEED={seed}) broke {} invariant(s) (logs kept in {}):\n{}\nfaults (wall-clock seconds at injection; heal times in {}/faults):\n{}",
            bad.len(),
            kept.display(),
            bad.join("\n"),
            kept.display(),
            faults.join("\n")
        );
    }
}
