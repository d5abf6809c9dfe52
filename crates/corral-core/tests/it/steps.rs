//! Property: whatever sequence of submits (single-node jobs and gangs, batch jobs among them),
//! scheduling passes, step creations (retried ones among them, and ones for stale runs), step
//! reports from any node, step signals, job exits, cancels, requeues, lost and restarted nodes
//! and compactions goes through apply(), no step outlives the run it was made in, no batch job
//! runs on once its batch step ended, a job's steps stay within their bounds, step ids only
//! grow, and live steps that took GPUs of their own never share one.

use corral_core::{schedule, ClusterConfig, Command, CompactCutoffs, Outcome, Request, State};
use corral_types::{
    GpuDevice, Job, JobExitReport, JobId, JobSpec, JobState, NodeSpec, NodeState, SchedOptions, StepNodeEnd, StepSpec,
    TaskExit, Timestamp, MAX_KEPT_STEPS, MAX_LIVE_STEPS,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const NODES: [&str; 3] = ["a", "b", "c"];

#[derive(Debug, Clone)]
enum Op {
    /// `batch`: a batch job (`corral sbatch`), which ends with its batch step on its first node.
    Submit {
        gang: bool,
        batch: bool,
    },
    Schedule,
    Step {
        pick: usize,
        ntasks: Option<u32>,
        gpus_per_task: Option<u32>,
        overlap: bool,
        retry: bool,
        stale: bool,
    },
    StepEnded {
        pick: usize,
        step: u32,
        node: usize,
        code: i32,
    },
    Signal {
        pick: usize,
        step: u32,
    },
    Finish {
        pick: usize,
        node: usize,
        code: i32,
    },
    Cancel {
        pick: usize,
    },
    Requeue {
        pick: usize,
    },
    NodeDown {
        node: usize,
    },
    Register {
        node: usize,
    },
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (any::<bool>(), any::<bool>()).prop_map(|(gang, batch)| Op::Submit { gang, batch }),
        2 => Just(Op::Schedule),
        6 => (
            any::<usize>(),
            proptest::option::of(1..6u32),
            proptest::option::weighted(0.4, 1..3u32),
            any::<bool>(),
            proptest::bool::weighted(0.2),
            proptest::bool::weighted(0.1)
        )
            .prop_map(|(pick, ntasks, gpus_per_task, overlap, retry, stale)| Op::Step {
                pick,
                ntasks,
                gpus_per_task,
                overlap,
                retry,
                stale
            }),
        6 => (any::<usize>(), 0..8u32, 0..3usize, -1..2i32)
            .prop_map(|(pick, step, node, code)| Op::StepEnded { pick, step, node, code }),
        1 => (any::<usize>(), 0..8u32).prop_map(|(pick, step)| Op::Signal { pick, step }),
        2 => (any::<usize>(), 0..3usize, 0..2i32).prop_map(|(pick, node, code)| Op::Finish { pick, node, code }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Requeue { pick }),
        1 => (0..3usize).prop_map(|node| Op::NodeDown { node }),
        1 => (0..3usize).prop_map(|node| Op::Register { node }),
        1 => Just(Op::Compact),
    ]
}

fn node_spec(name: &str) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        address: "127.0.0.1:1".into(),
        gpus: (0..4)
            .map(|g| GpuDevice {
                index: g,
                uuid: format!("GPU-{name}-{g}"),
                model: "RTX 5090".into(),
                memory_mib: 32768,
                ..Default::default()
            })
            .collect(),
        cpu_millis: 16_000,
        memory_bytes: 64 << 30,
        labels: vec![],
        rendezvous_ports: None,
        lease_end: None,
    }
}

struct Sim {
    state: State,
    seq: u64,
    submitted: u64,
    steps_asked: u64,
    archive: BTreeMap<JobId, Job>,
}

impl Sim {
    fn apply(&mut self, command: Command) -> Option<Outcome> {
        self.seq += 1;
        let ts = Timestamp::compose(1_000 + self.seq * 1_000, 0);
        let (response, touched) = self.state.apply_tracked(&Request { ts, command });
        for job in touched.archived {
            self.archive.insert(job.id, job);
        }
        response.ok()
    }

    fn running(&self, pick: usize) -> Option<(JobId, u64)> {
        let jobs: Vec<(JobId, u64)> =
            self.state.running_jobs().filter_map(|j| Some((j.id, j.allocation.as_ref()?.epoch))).collect();
        (!jobs.is_empty()).then(|| jobs[pick % jobs.len()])
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Submit { gang, batch } => {
                self.submitted += 1;
                let spec = JobSpec {
                    name: "s".into(),
                    tenant: "default".into(),
                    gpus: if *gang { 4 } else { 2 },
                    command: vec!["true".into()].into(),
                    sched: SchedOptions { gpus_per_node: gang.then_some(2), ..Default::default() },
                    script: batch.then(|| "#!/bin/sh\nsrun true\n".into()),
                    ..Default::default()
                };
                self.apply(Command::SubmitJob { request_id: format!("j{}", self.submitted), spec });
            }
            Op::Schedule => {
                let now = Timestamp::compose(1_000 + self.seq * 1_000, 0);
                if let Some(command) = schedule(&self.state, now, &BTreeSet::new()).command() {
                    self.apply(command);
                }
            }
            Op::Step { pick, ntasks, gpus_per_task, overlap, retry, stale } => {
                let Some((job_id, epoch)) = self.running(*pick) else { return };
                if !retry {
                    self.steps_asked += 1;
                }
                let spec = StepSpec {
                    command: vec!["python".into(), "train.py".into()],
                    env: [("SLURM_JOB_ID".to_string(), job_id.to_string())].into(),
                    ntasks: *ntasks,
                    gpus_per_task: *gpus_per_task,
                    overlap: *overlap,
                    ..Default::default()
                };
                let request_id = format!("srun-{}", self.steps_asked);
                let epoch = if *stale { epoch.saturating_sub(1) } else { epoch };
                let before = self.state.jobs[&job_id].steps.clone();
                if let Some(Outcome::Step { step, duplicate }) =
                    self.apply(Command::CreateStep { job_id, epoch, request_id: request_id.clone(), spec })
                {
                    assert_eq!(step.request_id, request_id);
                    if duplicate {
                        assert_eq!(before, self.state.jobs[&job_id].steps, "a retried create changes nothing");
                    } else {
                        assert_eq!(step.id, before.next_id, "steps are numbered in order");
                    }
                }
            }
            Op::StepEnded { pick, step, node, code } => {
                let Some((job_id, epoch)) = self.running(*pick) else { return };
                let tasks = (0..8).map(|task| TaskExit { task, exit_code: Some(*code), signal: None }).collect();
                let end = StepNodeEnd { node: NODES[*node].into(), tasks, launch_error: None };
                self.apply(Command::StepEnded { job_id, epoch, step: *step, end });
            }
            Op::Signal { pick, step } => {
                let Some((job_id, _)) = self.running(*pick) else { return };
                self.apply(Command::SignalStep { job_id, step: *step, signal: 2 });
            }
            Op::Finish { pick, node, code } => {
                let Some((job_id, epoch)) = self.running(*pick) else { return };
                let report = JobExitReport { exit_code: Some(*code), run_time_ms: 1_000, ..Default::default() };
                let node = NODES[*node].to_string();
                self.apply(Command::JobFinished { job_id, epoch, node, report });
            }
            Op::Cancel { pick } => {
                let Some((job_id, _)) = self.running(*pick) else { return };
                self.apply(Command::CancelJob { job_id, reason: String::new() });
            }
            Op::Requeue { pick } => {
                let Some((job_id, _)) = self.running(*pick) else { return };
                self.apply(Command::RequeueJob { job_id });
            }
            Op::NodeDown { node } => {
                let node = NODES[*node].to_string();
                self.apply(Command::SetNodeState { node, state: NodeState::Down, reason: String::new() });
            }
            Op::Register { node } => {
                self.apply(Command::RegisterNode { spec: node_spec(NODES[*node]) });
            }
            Op::Compact => {
                let at = Timestamp::compose(1_000 + self.seq * 1_000, 0);
                let cutoffs = CompactCutoffs {
                    archive_before: at,
                    request_ids_before: at,
                    jobs_before: None,
                    segments_before: None,
                    max_finished_bytes: None,
                };
                self.apply(Command::Compact(cutoffs));
            }
        }
    }
}

fn check(state: &State, archive: &BTreeMap<JobId, Job>) {
    for job in state.jobs.values().chain(archive.values()) {
        if let (true, JobState::Running, Some(alloc)) = (job.runs_batch_once(), job.state, &job.allocation) {
            assert!(!alloc.part_ended(&alloc.node), "batch job {} runs on after its batch step ended", job.id);
        }
        let steps = &job.steps;
        let epoch = job.allocation.as_ref().map(|a| a.epoch).filter(|_| job.state == JobState::Running);
        for step in steps.live() {
            assert_eq!(
                Some(step.epoch),
                epoch,
                "job {} ({:?}) has live step {} of another run",
                job.id,
                job.state,
                step.id
            );
            let alloc = job.allocation.as_ref().expect("running");
            for part in &step.nodes {
                let gpus = alloc.gpus_on(&part.node).expect("a step runs on the job's nodes");
                assert!(
                    part.gpus.iter().all(|g| gpus.contains(g)),
                    "step {}.{} on gpus not the job's",
                    job.id,
                    step.id
                );
            }
        }
        assert!(steps.live().count() <= MAX_LIVE_STEPS);
        assert!(steps.steps.len() <= MAX_KEPT_STEPS);
        let ids: Vec<u32> = steps.steps.iter().map(|s| s.id).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]) && ids.last().is_none_or(|last| *last < steps.next_id));
        let mut held: BTreeSet<(&str, u32)> = BTreeSet::new();
        for step in steps.live().filter(|s| !s.spec.overlap) {
            for part in &step.nodes {
                for g in &part.gpus {
                    assert!(held.insert((part.node.as_str(), *g)), "two live steps of job {} hold gpu {g}", job.id);
                }
            }
        }
        for step in steps.steps.iter().filter(|s| !s.state.is_live()) {
            assert!(
                step.ended_at.is_some() && step.spec.env.is_empty(),
                "ended step {}.{} keeps too much",
                job.id,
                step.id
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn no_step_outlives_its_run(ops in proptest::collection::vec(op(), 1..120)) {
        let mut sim = Sim { state: State::default(), seq: 0, submitted: 0, steps_asked: 0, archive: BTreeMap::new() };
        sim.apply(Command::Configure(ClusterConfig::dev_defaults()));
        for name in NODES {
            sim.apply(Command::RegisterNode { spec: node_spec(name) });
        }
        for op in &ops {
            sim.step(op);
            check(&sim.state, &sim.archive);
        }
    }
}
