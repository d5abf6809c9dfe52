//! A small line language for data-driven scheduler tests: a fixture sets up config, nodes and jobs
//! through apply(), runs passes, and prints their decisions; `check(fixture, expected)` compares
//! the printout. Every state change goes through `State::apply`, so fixtures test the re-validation
//! too.
//!
//! ```text
//! tenant team-a quota=4 cohort=c1 [borrow=2] [weight=2] [class-quota=gpu-high-priority:2]
//! class urgent value=5000 [preempts] [grace=10] [billing=1500]
//! config [reservations=1] [preemptors=4] [half-life=3600]
//! node n1 [gpus=8] [model=H100] [gpu-mem=81559] [cpu=64] [ram=512] [numa=0,0,1,1] [switch=a,a,b,b] [nic=x,-,-,-]
//! time 600                     # the clock, in seconds
//! submit team-a [gpus=2] [slice=mig:1g.10gb] [class=..] [time=1h] [per-node=8] [rdma] [no-requeue] [cpu=2] [ram=4] [image=I]
//! image I a:100,b:5            # image I's layers (digest:bytes), as some worker reported them
//! holds n1 a,b                 # the layers node n1's store holds
//! run team-a gpus=2 on=n1:0,1  # submit, place exactly there, start
//! schedule | apply | step      # a pass (prints it) | apply its command | both
//! start 3 | finish 3 [code=1] | exit 3 | cancel 3 | down n1 | block n1:3 | usage team-a 10 | show 3
//! ```
//!
//! Output: `place J n1:0,1[+n2:0,1] [slice]`, `preempt V by J grace Ns`, `pending J <reason>`,
//! `rejected J <reason>`, `job J <state> [where] [reason]`.

use super::{schedule_with_images, ImageHints, SchedulingPass};
use crate::config::TenantPolicy;
use crate::{ClusterConfig, Command, Outcome, Placement, PriorityClass, Request, State};
use corral_types::{
    parse_duration, GpuDevice, GpuSlice, JobExitReport, JobId, JobSpec, NodeGpus, NodeSpec, NodeState, SchedOptions,
    TaskLayout, Timestamp,
};
use std::collections::{BTreeMap, BTreeSet};

struct World {
    state: State,
    config: ClusterConfig,
    secs: u64,
    seq: u64,
    last: Option<SchedulingPass>,
    unschedulable: BTreeSet<(String, u32)>,
    images: ImageHints,
    out: Vec<String>,
}

/// The digest a fixture's image name stands for: `sha256:` and the name's bytes in hex, padded.
fn image_digest(name: &str) -> String {
    let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex:0<64}")
}

fn gpus_milli(s: &str) -> u64 {
    (s.parse::<f64>().unwrap_or_else(|_| panic!("bad gpu amount {s}")) * 1000.0).round() as u64
}

fn args(words: &[&str]) -> (Vec<String>, BTreeMap<String, String>) {
    let mut plain = Vec::new();
    let mut named = BTreeMap::new();
    for w in words {
        match w.split_once('=') {
            Some((k, v)) => {
                named.insert(k.to_string(), v.to_string());
            }
            None => plain.push(w.to_string()),
        }
    }
    (plain, named)
}

impl World {
    fn new() -> World {
        let mut config = ClusterConfig::dev_defaults();
        config.tenant_policies.clear();
        let mut world = World {
            state: State::default(),
            config,
            secs: 0,
            seq: 0,
            last: None,
            unschedulable: BTreeSet::new(),
            images: ImageHints::default(),
            out: Vec::new(),
        };
        world.configure();
        world
    }

    fn ts(&mut self) -> Timestamp {
        self.seq += 1;
        Timestamp::compose(self.secs * 1000, self.seq)
    }

    fn apply(&mut self, command: Command) -> crate::Response {
        let ts = self.ts();
        self.state.apply(&Request { ts, command })
    }

    fn configure(&mut self) {
        let config = self.config.clone();
        self.apply(Command::Configure(config)).expect("fixture config is valid");
    }

    fn job(&self, id: &str) -> JobId {
        id.parse().unwrap_or_else(|_| panic!("bad job id {id}"))
    }

    fn epoch(&self, id: JobId) -> u64 {
        self.state.jobs[&id].allocation.as_ref().map(|a| a.epoch).unwrap_or_else(|| panic!("job {id} is not placed"))
    }

    fn spec(&self, tenant: &str, named: &BTreeMap<String, String>, flags: &[String]) -> JobSpec {
        JobSpec {
            name: "job".into(),
            tenant: tenant.into(),
            priority_class: named.get("class").cloned().unwrap_or_default(),
            gpus: named.get("gpus").map(|g| g.parse().unwrap()).unwrap_or(0),
            gpu_slice: named.get("slice").map(|s| GpuSlice::parse(s).unwrap()),
            cpu_millis: named.get("cpu").map(|c| c.parse::<u32>().unwrap() * 1000).unwrap_or(1000),
            memory_bytes: named.get("ram").map(|r| r.parse::<u64>().unwrap() << 30).unwrap_or(1 << 30),
            time_limit_secs: named.get("time").map(|t| parse_duration(t).unwrap().as_secs()),
            image: named.get("image").map(|i| format!("reg.lab/{i}")),
            image_digest: named.get("image").map(|i| image_digest(i)),
            command: vec!["true".into()].into(),
            env: Default::default(),
            sched: SchedOptions {
                gpus_per_node: named.get("per-node").map(|g| g.parse().unwrap()),
                rdma: flags.iter().any(|f| f == "rdma"),
                no_requeue: flags.iter().any(|f| f == "no-requeue"),
                checkpoint_signal: named.get("signal").map(|s| s.parse().unwrap()),
                ..Default::default()
            },
            layout: TaskLayout {
                nodes: named.get("nodes").map(|n| n.parse().unwrap()).unwrap_or(0),
                ntasks: named.get("tasks").map(|n| n.parse().unwrap()).unwrap_or(0),
                gpus_per_task: named.get("per-task").map(|n| n.parse().unwrap()).unwrap_or(0),
                exclusive: flags.iter().any(|f| f == "exclusive"),
                gpu_type: named.get("gpu-type").cloned(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn submit(&mut self, spec: JobSpec) -> JobId {
        let rid = format!("r{}", self.state.next_job_id);
        match self.apply(Command::SubmitJob { request_id: rid, spec }) {
            Ok(Outcome::JobSubmitted { job_id, .. }) => job_id,
            other => panic!("submit failed: {other:?}"),
        }
    }

    fn line(&mut self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&cmd, rest)) = words.split_first() else { return };
        let (plain, named) = args(rest);
        match cmd {
            "image" => {
                let layers = plain[1]
                    .split(',')
                    .map(|l| {
                        let (digest, size) = l.split_once(':').expect("digest:bytes");
                        (digest.to_string(), size.parse().expect("bytes"))
                    })
                    .collect();
                self.images.images.insert(image_digest(&plain[0]), std::sync::Arc::new(layers));
            }
            "holds" => {
                let layers = plain[1].split(',').map(String::from).collect();
                self.images.nodes.insert(plain[0].clone(), layers);
            }
            "tenant" => {
                let name = plain[0].clone();
                if !self.config.tenants.contains(&name) {
                    self.config.tenants.push(name.clone());
                }
                let mut policy = TenantPolicy {
                    quota_milli_gpus: named.get("quota").map(|q| gpus_milli(q)),
                    cohort: named.get("cohort").cloned(),
                    borrowing_limit_milli_gpus: named.get("borrow").map(|b| gpus_milli(b)),
                    fair_share_weight: named.get("weight").map(|w| w.parse().unwrap()).unwrap_or(1),
                    ..TenantPolicy::default()
                };
                if let Some(cq) = named.get("class-quota") {
                    let (class, gpus) = cq.split_once(':').unwrap();
                    policy.class_quotas.insert(class.into(), gpus_milli(gpus));
                }
                self.config.tenant_policies.insert(name, policy);
                self.configure();
            }
            "class" => {
                let name = plain[0].clone();
                let class = PriorityClass {
                    name: name.clone(),
                    value: named["value"].parse().unwrap(),
                    preempts_lower: plain.iter().any(|p| p == "preempts"),
                    billing_multiplier_milli: named.get("billing").map(|b| b.parse().unwrap()).unwrap_or(1000),
                    is_default: false,
                    grace_secs: named.get("grace").map(|g| g.parse().unwrap()),
                    default_time_secs: None,
                    max_time_secs: None,
                    idle_timeout_secs: None,
                };
                self.config.priority_classes.insert(name, class);
                self.configure();
            }
            "config" => {
                let s = &mut self.config.scheduler;
                if let Some(v) = named.get("reservations") {
                    s.backfill_reservations = v.parse().unwrap();
                }
                if let Some(v) = named.get("preemptors") {
                    s.max_preemptors_per_pass = v.parse().unwrap();
                }
                if let Some(v) = named.get("half-life") {
                    s.usage_half_life_secs = v.parse().unwrap();
                }
                self.configure();
            }
            "node" => {
                let name = plain[0].clone();
                let count: u32 = named.get("gpus").map(|g| g.parse().unwrap()).unwrap_or(8);
                let list = |key: &str| -> Vec<Option<String>> {
                    named
                        .get(key)
                        .map(|v| v.split(',').map(|x| (x != "-").then(|| x.to_string())).collect())
                        .unwrap_or_default()
                };
                let (numa, switch, nic) = (list("numa"), list("switch"), list("nic"));
                let gpus = (0..count)
                    .map(|i| GpuDevice {
                        index: i,
                        uuid: format!("GPU-{name}-{i}"),
                        model: named.get("model").cloned().unwrap_or_else(|| "RTX 5090".into()),
                        memory_mib: named.get("gpu-mem").map(|m| m.parse().unwrap()).unwrap_or(32768),
                        numa_node: numa.get(i as usize).cloned().flatten().map(|n| n.parse().unwrap()),
                        pci_switch: switch.get(i as usize).cloned().flatten(),
                        rdma_nic: nic.get(i as usize).cloned().flatten(),
                        mig_capable: plain.iter().any(|p| p == "mig"),
                    })
                    .collect();
                let spec = NodeSpec {
                    name,
                    address: "127.0.0.1:1".into(),
                    gpus,
                    cpu_millis: named.get("cpu").map(|c| c.parse::<u64>().unwrap() * 1000).unwrap_or(64_000),
                    memory_bytes: named.get("ram").map(|r| r.parse::<u64>().unwrap() << 30).unwrap_or(512 << 30),
                    labels: vec![],
                    rendezvous_ports: None,
                    lease_end: None,
                };
                self.apply(Command::RegisterNode { spec }).unwrap();
            }
            "down" | "up" => {
                let state = if cmd == "down" { NodeState::Down } else { NodeState::Up };
                self.apply(Command::SetNodeState { node: plain[0].clone(), state, reason: String::new() }).unwrap();
            }
            "block" => {
                let (node, gpu) = plain[0].split_once(':').unwrap();
                self.unschedulable.insert((node.to_string(), gpu.parse().unwrap()));
            }
            "time" => {
                self.secs = plain[0].parse().unwrap_or_else(|_| parse_duration(&plain[0]).unwrap().as_secs());
            }
            "submit" => {
                let spec = self.spec(&plain[0], &named, &plain[1..]);
                self.submit(spec);
            }
            "run" => {
                let spec = self.spec(&plain[0], &named, &plain[1..]);
                let job_id = self.submit(spec);
                let mut parts: Vec<NodeGpus> = named["on"]
                    .split('+')
                    .map(|part| {
                        let (node, gpus) = part.split_once(':').unwrap();
                        NodeGpus { node: node.into(), gpus: gpus.split(',').map(|g| g.parse().unwrap()).collect() }
                    })
                    .collect();
                let first = parts.remove(0);
                let placement =
                    Placement { job_id, node: first.node, gpus: first.gpus, more_nodes: parts, slice: None };
                match self.apply(Command::Schedule { placements: vec![placement], preemptions: vec![] }) {
                    Ok(Outcome::Scheduled(o)) if o.placed == vec![job_id] => {}
                    other => panic!("run of job {job_id} failed: {other:?}"),
                }
                let epoch = self.epoch(job_id);
                self.apply(Command::JobStarted { job_id, epoch }).unwrap();
            }
            "start" => {
                let job_id = self.job(&plain[0]);
                let epoch = self.epoch(job_id);
                self.apply(Command::JobStarted { job_id, epoch }).unwrap();
            }
            "finish" | "exit" => {
                let job_id = self.job(&plain[0]);
                let epoch = self.epoch(job_id);
                let report = if cmd == "exit" {
                    JobExitReport { signal: Some(15), ..Default::default() }
                } else {
                    let code = named.get("code").map(|c| c.parse().unwrap()).unwrap_or(0);
                    JobExitReport { exit_code: Some(code), ..Default::default() }
                };
                // `node=` reports one part of a gang; without it the report ends the whole run.
                let node = named.get("node").map(|n| n.to_string()).unwrap_or_default();
                self.apply(Command::JobFinished { job_id, epoch, node, report }).unwrap();
            }
            "cancel" => {
                let job_id = self.job(&plain[0]);
                self.apply(Command::CancelJob { job_id, reason: String::new() }).unwrap();
            }
            "usage" => {
                let hours: f64 = plain[1].parse().unwrap();
                let end = self.secs * 1000;
                let half_life = self.config.scheduler.usage_half_life_secs;
                self.state.usage.charge(
                    &plain[0],
                    end.saturating_sub(3_600_000),
                    end,
                    (hours * 1000.0) as u64,
                    half_life,
                );
            }
            "schedule" => self.schedule(),
            "apply" => self.apply_last(),
            "step" => {
                self.schedule();
                self.apply_last();
            }
            "show" => {
                let job = &self.state.jobs[&self.job(&plain[0])];
                let mut line = format!("job {} {}", job.id, job.state);
                if let Some(a) = job.allocation.as_ref().filter(|_| job.state == corral_types::JobState::Running) {
                    line += &format!(" {}", render_parts(a.parts()));
                    if !a.ended.is_empty() {
                        let ended: Vec<String> = a
                            .ended
                            .iter()
                            .map(|e| match &e.report {
                                None => format!("{} lost", e.node),
                                Some(r) if r.succeeded() => format!("{} exited 0", e.node),
                                Some(_) => format!("{} failed", e.node),
                            })
                            .collect();
                        line += &format!(" [ended: {}]", ended.join(", "));
                    }
                }
                if let Some(r) = &job.reason {
                    line += &format!(" ({r})");
                }
                if let Some(p) = &job.preemption {
                    line += &format!(" [preempted by {} grace {}s]", p.by, p.grace_secs);
                }
                self.out.push(line);
            }
            other => panic!("unknown fixture command '{other}'"),
        }
    }

    fn schedule(&mut self) {
        let now = Timestamp::compose(self.secs * 1000, self.seq + 1);
        let pass = schedule_with_images(&self.state, now, &self.unschedulable, &self.images);
        for p in &pass.placements {
            let mut line = format!("place {} {}", p.job_id, render_parts(p.parts()));
            if let Some(s) = &p.slice {
                line += &format!(" {s}");
            }
            self.out.push(line);
        }
        for p in &pass.preemptions {
            self.out.push(format!("preempt {} by {} grace {}s", p.job_id, p.by, p.grace_secs));
        }
        for p in &pass.pending {
            self.out.push(format!("pending {} {}", p.job_id, p.reason));
        }
        self.last = Some(pass);
    }

    fn apply_last(&mut self) {
        let Some(command) = self.last.take().and_then(|p| p.command()) else { return };
        match self.apply(command) {
            Ok(Outcome::Scheduled(o)) => {
                for (job, reason) in o.rejected {
                    self.out.push(format!("rejected {job} {reason}"));
                }
            }
            other => panic!("schedule command failed: {other:?}"),
        }
    }
}

fn render_parts<'a>(parts: impl Iterator<Item = (&'a str, &'a [u32])>) -> String {
    parts
        .map(|(n, g)| format!("{n}:{}", g.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")))
        .collect::<Vec<_>>()
        .join("+")
}

/// Runs a fixture and returns what it printed, one decision per line.
pub(crate) fn run(fixture: &str) -> (String, State) {
    let mut world = World::new();
    for line in fixture.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if !line.is_empty() {
            world.line(line);
        }
    }
    (world.out.join("\n"), world.state)
}

fn normalize(text: &str) -> String {
    text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("\n")
}

/// Runs `fixture` and asserts its printout equals `expected` (lines trimmed, blank lines ignored).
/// Also checks that the state's derived indexes equal a rebuild from scratch.
pub(crate) fn check(fixture: &str, expected: &str) {
    let (got, state) = run(fixture);
    assert_eq!(normalize(&got), normalize(expected), "\n--- fixture ---\n{}", normalize(fixture));
    let mut rebuilt = state.clone();
    rebuilt.rebuild_indexes();
    assert_eq!(rebuilt, state, "derived indexes drifted from the jobs");
}
