//! The worker's decisions as one pure function: `reconcile(&Local, &Desired, &Policy)` compares
//! what this worker runs and has reported with what the leader wants, and returns the actions
//! that close the gap. It does no I/O and reads no clock; the runtime (`runtime/`) carries the
//! actions out and records their effects in `Local`, so calling it again returns nothing new
//! (level-triggered and idempotent, like openraft's engine emitting commands).
//!
//! Invariants:
//! - nothing is launched unless the worker holds a lease (a leader answered within the fence
//!   time); with no lease every job is stopped;
//! - a job the leader wants stopped but that never ran here is reported "never started", so a
//!   cancel or a preemption that arrives before the launch still ends the job;
//! - an allocation epoch runs at most once per worker process: a local record is only forgotten
//!   once a desired state at or after the revision of its exit report no longer lists it;
//! - a job that does not appear in the desired state does not keep running;
//! - a run whose image is still being pulled is abandoned (reported never started) on a stop,
//!   a lost lease or when the desired state no longer lists it: nothing ever launches from an
//!   abandoned pull;
//! - every start and exit is reported until a leader accepts or rejects it; a worker that must
//!   register again first stops everything and forgets what is stale.

use corral_types::{Job, JobExitReport, JobId, StepId, StepNodeEnd};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// What the leader wants of one job allocated on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Want {
    Run,
    /// Stop it (cancel, preemption): `signal` first if any (a checkpoint signal), SIGTERM, and
    /// SIGKILL after `grace` (`None`: the worker's kill grace).
    Stop {
        grace: Option<Duration>,
        signal: Option<i32>,
    },
}

/// One job of the desired state.
#[derive(Debug, Clone, PartialEq)]
pub struct DesiredJob {
    pub job: Arc<Job>,
    /// Allocation epoch of the run the leader means.
    pub epoch: u64,
    pub want: Want,
    /// Where the run's parts are (for the rendezvous environment of a launch).
    pub addrs: crate::PartAddrs,
}

/// The node's desired state as a leader last pushed it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Desired {
    /// Applied log index it was read at; 0: none received since the registration.
    pub revision: u64,
    pub jobs: BTreeMap<JobId, DesiredJob>,
    /// This node's name: which tasks of a step are its own.
    pub node: String,
}

/// Where one report to the leaders stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Not due yet: a start report is held for a moment after the launch, so a job that ends
    /// at once reports only its exit (one commit instead of two; its run time is in the exit
    /// report). The runtime makes it `Pending` when the moment has passed.
    Held,
    /// To be sent.
    Pending,
    /// Being sent, and retried until a leader accepts or rejects it.
    InFlight,
    /// A leader judged it at this applied index.
    Done { revision: u64 },
    /// Not needed: the job ended before its start was sent (the exit report carries the run).
    Skipped,
}

/// Why the worker stops a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// The leader asked (cancel, preemption).
    Leader,
    /// The job is no longer allocated here (requeued elsewhere, or a newer epoch).
    Orphan,
    /// No leader answered within the fence time: the job must be dead before the leader gives
    /// the node up and runs it elsewhere.
    Fenced,
    /// The leader no longer knows this node's epoch: it registers again, empty.
    Reregister,
    /// The worker shuts down.
    Shutdown,
}

/// A job's local life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Its image is being pulled: nothing runs yet. A stop, a lost lease or the job leaving
    /// the desired state abandons the pull and the run is reported never started.
    Pulling,
    /// Its process tree runs; `stopping` once a stop was ordered, with why.
    Running { stopping: Option<StopCause> },
    /// The process tree is gone; GPU hygiene and MIG clean-up run before the exit is reported.
    Exiting,
    /// Over; `report` is what the leader learns.
    Ended { report: JobExitReport },
}

/// A job this worker process launched (or reports as never started).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalJob {
    pub epoch: u64,
    pub phase: Phase,
    pub start: Delivery,
    pub exit: Delivery,
    /// How many of the job's `corral signal` entries this run has had: the count at the launch
    /// (older ones were for earlier runs), then each delivered one.
    pub signals_sent: usize,
    /// The job's steps whose tasks this run launched here (or recorded as not launched).
    pub steps: BTreeMap<StepId, LocalStep>,
}

/// This node's tasks of one step of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalStep {
    pub phase: StepPhase,
    /// The report of their end (`Pending` until they ended).
    pub report: Delivery,
    /// How many of the step's signals the tasks have had.
    pub signals_sent: usize,
    /// `srun --wait`: the tasks were told a task of the step ended on another node.
    pub wait_started: bool,
}

/// Where this node's tasks of a step stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepPhase {
    /// They run; `killing` once the step is stopping.
    Running { killing: bool },
    /// Every one of them is gone: what the leader learns.
    Ended { end: StepNodeEnd },
}

/// The worker's standing with the leaders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Registering (at start, or again): nothing is launched yet.
    Unregistered,
    /// Registered, and a leader answered within the fence time.
    Leased,
    /// No leader answered within the fence time: stop everything, launch nothing; report what
    /// ended once a leader answers again.
    Fenced,
    /// A leader does not know this node's epoch: stop everything, then register again.
    MustReregister,
}

/// Everything the worker knows about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Local {
    pub standing: Standing,
    pub jobs: BTreeMap<JobId, LocalJob>,
}

/// The worker's settings that shape its decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// SIGTERM to SIGKILL for stops that do not name a grace (cancel, orphans).
    pub kill_grace: Duration,
    /// SIGTERM to SIGKILL when fenced or registering again: short, the leader is about to (or
    /// already did) give the jobs to other nodes.
    pub fence_grace: Duration,
}

/// One thing the runtime must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start this allocation here.
    Launch {
        job: Arc<Job>,
        epoch: u64,
    },
    /// The leader wants stopped a job that never ran here: record it as ended, never started.
    NeverStarted {
        job_id: JobId,
        epoch: u64,
    },
    /// `signal` (or SIGTERM) to the job's tree, SIGKILL after `grace`.
    Stop {
        job_id: JobId,
        epoch: u64,
        grace: Duration,
        signal: Option<i32>,
        cause: StopCause,
    },
    ReportStarted {
        job_id: JobId,
        epoch: u64,
    },
    ReportFinished {
        job_id: JobId,
        epoch: u64,
        report: JobExitReport,
    },
    /// Drop the record: the leader's state no longer names this run.
    Forget {
        job_id: JobId,
    },
    /// Register again (everything stale is stopped and forgotten).
    Reregister,
    /// Deliver `signals` (`corral signal`, in order) to the job's tree; afterwards the run has
    /// had `sent` of the job's signals.
    Signal {
        job_id: JobId,
        epoch: u64,
        signals: Vec<i32>,
        sent: usize,
    },
    /// Launch this node's tasks of step `step` of the run into its cgroup.
    LaunchTasks {
        job: Arc<Job>,
        epoch: u64,
        step: StepId,
    },
    /// The step stopped before its tasks were launched here: record them as never started.
    SkipTasks {
        job_id: JobId,
        epoch: u64,
        step: StepId,
    },
    /// Kill this node's tasks of the step (it is stopping: `--kill-on-bad-exit`, the run ends).
    KillTasks {
        job_id: JobId,
        epoch: u64,
        step: StepId,
    },
    /// A task of the step ended on another node: `srun --wait`'s time starts for the tasks here.
    StartWait {
        job_id: JobId,
        epoch: u64,
        step: StepId,
    },
    /// Deliver `signals` to the step's tasks; afterwards they have had `sent` of them.
    SignalTasks {
        job_id: JobId,
        epoch: u64,
        step: StepId,
        signals: Vec<i32>,
        sent: usize,
    },
    /// Report that this node's tasks of the step are gone.
    ReportStepEnded {
        job_id: JobId,
        epoch: u64,
        step: StepId,
        end: StepNodeEnd,
    },
    /// Drop the record of a step the leader no longer lists as live.
    ForgetStep {
        job_id: JobId,
        step: StepId,
    },
}

/// The actions that bring this worker to what the leader wants.
pub fn reconcile(local: &Local, desired: &Desired, policy: &Policy) -> Vec<Action> {
    let mut actions = Vec::new();
    match local.standing {
        Standing::Unregistered => {}
        Standing::Leased => follow(local, desired, policy, &mut actions),
        Standing::Fenced => stop_all(local, StopCause::Fenced, policy.fence_grace, &mut actions),
        Standing::MustReregister => {
            stop_all(local, StopCause::Reregister, policy.fence_grace, &mut actions);
            let busy = local.jobs.values().any(|j| !matches!(j.phase, Phase::Ended { .. }));
            if !busy {
                actions.push(Action::Reregister);
            }
            // Reports would be stale: the leader already requeued whatever ran here.
            return actions;
        }
    }
    report(local, desired, &mut actions);
    actions
}

/// Launches, stops and never-started reports that make the local jobs match `desired`.
fn follow(local: &Local, desired: &Desired, policy: &Policy, actions: &mut Vec<Action>) {
    if desired.revision == 0 {
        // Nothing heard since registering: no decision can be made yet.
        return;
    }
    for (&job_id, want) in &desired.jobs {
        let epoch = want.epoch;
        match (local.jobs.get(&job_id), &want.want) {
            (None, Want::Run) => actions.push(Action::Launch { job: want.job.clone(), epoch }),
            (None, Want::Stop { .. }) => actions.push(Action::NeverStarted { job_id, epoch }),
            (Some(l), Want::Stop { .. }) if l.epoch == epoch && l.phase == Phase::Pulling => {
                actions.push(Action::NeverStarted { job_id, epoch })
            }
            (Some(l), Want::Stop { grace, signal }) if l.epoch == epoch => {
                if matches!(l.phase, Phase::Running { stopping: None }) {
                    let grace = grace.unwrap_or(policy.kill_grace);
                    actions.push(Action::Stop { job_id, epoch, grace, signal: *signal, cause: StopCause::Leader });
                }
            }
            (Some(l), Want::Run)
                if l.epoch == epoch
                    && matches!(l.phase, Phase::Running { stopping: None })
                    && want.job.signals.len() > l.signals_sent =>
            {
                let signals = want.job.signals[l.signals_sent..].to_vec();
                actions.push(Action::Signal { job_id, epoch, signals, sent: want.job.signals.len() });
            }
            (Some(_), _) => {}
        }
        if let Some(l) = local.jobs.get(&job_id) {
            if l.epoch == epoch && want.want == Want::Run && matches!(l.phase, Phase::Running { stopping: None }) {
                follow_steps(job_id, l, want, &desired.node, actions);
            }
        }
    }
    for (&job_id, job) in &local.jobs {
        let listed = desired.jobs.get(&job_id).is_some_and(|d| d.epoch == job.epoch);
        if !listed && job.phase == Phase::Pulling {
            actions.push(Action::NeverStarted { job_id, epoch: job.epoch });
        } else if !listed && matches!(job.phase, Phase::Running { stopping: None }) {
            let (epoch, grace) = (job.epoch, policy.kill_grace);
            actions.push(Action::Stop { job_id, epoch, grace, signal: None, cause: StopCause::Orphan });
        }
    }
}

/// Launches, kills and signals of this node's tasks of the run's live steps.
fn follow_steps(job_id: JobId, l: &LocalJob, want: &DesiredJob, node: &str, actions: &mut Vec<Action>) {
    let epoch = want.epoch;
    for step in want.job.steps.steps.iter().filter(|s| s.epoch == epoch && s.state.is_live()) {
        if step.on_node(node).is_none_or(|n| n.tasks == 0) || step.node_ended(node) {
            continue;
        }
        let id = step.id;
        match l.steps.get(&id) {
            None if step.stopping => actions.push(Action::SkipTasks { job_id, epoch, step: id }),
            None => actions.push(Action::LaunchTasks { job: want.job.clone(), epoch, step: id }),
            Some(LocalStep { phase: StepPhase::Running { killing: false }, signals_sent, wait_started, .. }) => {
                if step.stopping {
                    actions.push(Action::KillTasks { job_id, epoch, step: id });
                    continue;
                }
                if step.signals.len() > *signals_sent {
                    let signals = step.signals[*signals_sent..].to_vec();
                    actions.push(Action::SignalTasks { job_id, epoch, step: id, signals, sent: step.signals.len() });
                }
                if !wait_started && step.spec.wait_secs.is_some_and(|w| w > 0) && !step.ended.is_empty() {
                    actions.push(Action::StartWait { job_id, epoch, step: id });
                }
            }
            Some(_) => {}
        }
    }
}

fn stop_all(local: &Local, cause: StopCause, grace: Duration, actions: &mut Vec<Action>) {
    for (&job_id, job) in &local.jobs {
        // A job stopping for another reason is stopped again, quicker: the lease is gone.
        let stoppable = match job.phase {
            Phase::Pulling => {
                actions.push(Action::NeverStarted { job_id, epoch: job.epoch });
                false
            }
            Phase::Running { stopping: None } => true,
            Phase::Running { stopping: Some(earlier) } => earlier != cause && earlier != StopCause::Shutdown,
            _ => false,
        };
        if stoppable {
            actions.push(Action::Stop { job_id, epoch: job.epoch, grace, signal: None, cause });
        }
    }
}

/// Start and exit reports due, and records the leader no longer needs.
fn report(local: &Local, desired: &Desired, actions: &mut Vec<Action>) {
    for (&job_id, job) in &local.jobs {
        let epoch = job.epoch;
        if job.start == Delivery::Pending && matches!(job.phase, Phase::Running { .. }) {
            actions.push(Action::ReportStarted { job_id, epoch });
        }
        if let Phase::Ended { report } = &job.phase {
            // Exits follow their start report, so a leader never sees them out of order.
            if job.exit == Delivery::Pending && job.start != Delivery::InFlight {
                actions.push(Action::ReportFinished { job_id, epoch, report: report.clone() });
            }
        }
        for (&step, s) in &job.steps {
            if let (StepPhase::Ended { end }, Delivery::Pending) = (&s.phase, s.report) {
                actions.push(Action::ReportStepEnded { job_id, epoch, step, end: end.clone() });
            }
            if let Delivery::Done { revision } = s.report {
                let live = desired.jobs.get(&job_id).is_some_and(|d| {
                    d.epoch == epoch && d.job.steps.steps.iter().any(|x| x.id == step && x.state.is_live())
                });
                if desired.revision >= revision && !live {
                    actions.push(Action::ForgetStep { job_id, step });
                }
            }
        }
        if let Delivery::Done { revision } = job.exit {
            let still_listed = desired.jobs.get(&job_id).is_some_and(|d| d.epoch == epoch);
            if desired.revision >= revision && !still_listed {
                actions.push(Action::Forget { job_id });
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use corral_types::{Allocation, JobSpec, JobState, Timestamp};

    const POLICY: Policy = Policy { kill_grace: Duration::from_secs(5), fence_grace: Duration::from_secs(1) };

    /// A one-GPU job on node `n1` with allocation `epoch` (also for the runtime's tests).
    pub(crate) fn job(id: JobId, epoch: u64) -> Arc<Job> {
        Arc::new(Job {
            id,
            spec: JobSpec { command: vec!["true".into()].into(), tenant: "default".into(), ..Default::default() },
            state: JobState::Running,
            request_id: String::new(),
            submitted_at: Timestamp(1),
            admitted_at: Some(Timestamp(2)),
            started_at: None,
            finished_at: None,
            allocation: Some(Allocation { node: "n1".into(), gpus: vec![0], epoch, ..Default::default() }),
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 1,
            worker_run_time_ms: None,
            preemption: None,
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: Default::default(),
        })
    }

    fn run(id: JobId, epoch: u64) -> (JobId, DesiredJob) {
        (id, DesiredJob { job: job(id, epoch), epoch, want: Want::Run, addrs: Default::default() })
    }

    fn stop(id: JobId, epoch: u64, grace: Option<u64>, signal: Option<i32>) -> (JobId, DesiredJob) {
        let want = Want::Stop { grace: grace.map(Duration::from_secs), signal };
        (id, DesiredJob { job: job(id, epoch), epoch, want, addrs: Default::default() })
    }

    fn desired(revision: u64, jobs: Vec<(JobId, DesiredJob)>) -> Desired {
        Desired { revision, jobs: jobs.into_iter().collect(), node: "n1".into() }
    }

    fn local(standing: Standing, jobs: Vec<(JobId, LocalJob)>) -> Local {
        Local { standing, jobs: jobs.into_iter().collect() }
    }

    fn running(epoch: u64, stopping: Option<StopCause>, start: Delivery) -> LocalJob {
        LocalJob {
            epoch,
            phase: Phase::Running { stopping },
            start,
            exit: Delivery::Pending,
            signals_sent: 0,
            steps: BTreeMap::new(),
        }
    }

    fn ended(epoch: u64, report: JobExitReport, start: Delivery, exit: Delivery) -> LocalJob {
        LocalJob { epoch, phase: Phase::Ended { report }, start, exit, signals_sent: 0, steps: BTreeMap::new() }
    }

    fn signalled(id: JobId, epoch: u64, signals: Vec<i32>) -> (JobId, DesiredJob) {
        let mut j = (*job(id, epoch)).clone();
        j.signals = signals;
        (id, DesiredJob { job: Arc::new(j), epoch, want: Want::Run, addrs: Default::default() })
    }

    fn exit0() -> JobExitReport {
        JobExitReport { exit_code: Some(0), run_time_ms: 10, ..Default::default() }
    }

    fn never() -> JobExitReport {
        JobExitReport { never_started: true, ..Default::default() }
    }

    /// Each row: what the worker has, what the leader wants, what must happen.
    #[test]
    fn table() {
        let done = Delivery::Done { revision: 7 };
        let pulling = LocalJob {
            epoch: 10,
            phase: Phase::Pulling,
            start: Delivery::Held,
            exit: Delivery::Pending,
            signals_sent: 0,
            steps: BTreeMap::new(),
        };
        let rows: Vec<(&str, Local, Desired, Vec<Action>)> = vec![
            (
                "a run pulling its image that is still wanted is left to pull: no report, no launch",
                local(Standing::Leased, vec![(1, pulling.clone())]),
                desired(5, vec![run(1, 10)]),
                vec![],
            ),
            (
                "a run stopped while it pulls is abandoned: never started",
                local(Standing::Leased, vec![(1, pulling.clone())]),
                desired(5, vec![stop(1, 10, None, None)]),
                vec![Action::NeverStarted { job_id: 1, epoch: 10 }],
            ),
            (
                "a run gone from the desired state while it pulls is abandoned",
                local(Standing::Leased, vec![(1, pulling.clone())]),
                desired(5, vec![]),
                vec![Action::NeverStarted { job_id: 1, epoch: 10 }],
            ),
            (
                "a run pulling when the lease is lost is abandoned",
                local(Standing::Fenced, vec![(1, pulling.clone())]),
                desired(5, vec![run(1, 10)]),
                vec![Action::NeverStarted { job_id: 1, epoch: 10 }],
            ),
            (
                "a run pulling when the worker must register again is abandoned before it does",
                local(Standing::MustReregister, vec![(1, pulling.clone())]),
                desired(5, vec![run(1, 10)]),
                vec![Action::NeverStarted { job_id: 1, epoch: 10 }],
            ),
            (
                "a new allocation is launched",
                local(Standing::Leased, vec![]),
                desired(5, vec![run(1, 10)]),
                vec![Action::Launch { job: job(1, 10), epoch: 10 }],
            ),
            (
                "nothing is decided before the first desired state",
                local(Standing::Leased, vec![]),
                desired(0, vec![]),
                vec![],
            ),
            (
                "a running job that is wanted is left alone once its start is reported",
                local(Standing::Leased, vec![(1, running(10, None, Delivery::Done { revision: 4 }))]),
                desired(5, vec![run(1, 10)]),
                vec![],
            ),
            (
                "a launched job reports its start",
                local(Standing::Leased, vec![(1, running(10, None, Delivery::Pending))]),
                desired(5, vec![run(1, 10)]),
                vec![Action::ReportStarted { job_id: 1, epoch: 10 }],
            ),
            (
                "a start report that is held is not sent yet",
                local(Standing::Leased, vec![(1, running(10, None, Delivery::Held))]),
                desired(5, vec![run(1, 10)]),
                vec![],
            ),
            (
                "cancelled before it was launched: reported never started, not launched",
                local(Standing::Leased, vec![]),
                desired(5, vec![stop(1, 10, None, None)]),
                vec![Action::NeverStarted { job_id: 1, epoch: 10 }],
            ),
            (
                "preempted before it was launched: reported never started",
                local(Standing::Leased, vec![]),
                desired(5, vec![stop(1, 10, Some(30), Some(10))]),
                vec![Action::NeverStarted { job_id: 1, epoch: 10 }],
            ),
            (
                "the never-started record is reported at once",
                local(Standing::Leased, vec![(1, ended(10, never(), Delivery::Skipped, Delivery::Pending))]),
                desired(5, vec![stop(1, 10, None, None)]),
                vec![Action::ReportFinished { job_id: 1, epoch: 10, report: never() }],
            ),
            (
                "a cancel stops a running job with the worker's grace",
                local(Standing::Leased, vec![(1, running(10, None, done))]),
                desired(8, vec![stop(1, 10, None, None)]),
                vec![Action::Stop {
                    job_id: 1,
                    epoch: 10,
                    grace: Duration::from_secs(5),
                    signal: None,
                    cause: StopCause::Leader,
                }],
            ),
            (
                "a preemption stops with the class's grace and checkpoint signal",
                local(Standing::Leased, vec![(1, running(10, None, done))]),
                desired(8, vec![stop(1, 10, Some(30), Some(10))]),
                vec![Action::Stop {
                    job_id: 1,
                    epoch: 10,
                    grace: Duration::from_secs(30),
                    signal: Some(10),
                    cause: StopCause::Leader,
                }],
            ),
            (
                "a job being stopped is not stopped twice",
                local(Standing::Leased, vec![(1, running(10, Some(StopCause::Leader), done))]),
                desired(8, vec![stop(1, 10, None, None)]),
                vec![],
            ),
            (
                "a job no longer allocated here is stopped",
                local(Standing::Leased, vec![(1, running(10, None, done))]),
                desired(8, vec![]),
                vec![Action::Stop {
                    job_id: 1,
                    epoch: 10,
                    grace: Duration::from_secs(5),
                    signal: None,
                    cause: StopCause::Orphan,
                }],
            ),
            (
                "an older epoch of a re-placed job is stopped; the new one waits for it",
                local(Standing::Leased, vec![(1, running(10, None, done))]),
                desired(9, vec![run(1, 12)]),
                vec![Action::Stop {
                    job_id: 1,
                    epoch: 10,
                    grace: Duration::from_secs(5),
                    signal: None,
                    cause: StopCause::Orphan,
                }],
            ),
            (
                "an exit is reported",
                local(Standing::Leased, vec![(1, ended(10, exit0(), done, Delivery::Pending))]),
                desired(8, vec![run(1, 10)]),
                vec![Action::ReportFinished { job_id: 1, epoch: 10, report: exit0() }],
            ),
            (
                "an exit waits for its start report in flight",
                local(Standing::Leased, vec![(1, ended(10, exit0(), Delivery::InFlight, Delivery::Pending))]),
                desired(8, vec![run(1, 10)]),
                vec![],
            ),
            (
                "an ended job is never launched again while the leader still lists it",
                local(Standing::Leased, vec![(1, ended(10, exit0(), done, Delivery::InFlight))]),
                desired(8, vec![run(1, 10)]),
                vec![],
            ),
            (
                "a reported exit is kept until a desired state as new as the report drops it",
                local(Standing::Leased, vec![(1, ended(10, exit0(), done, Delivery::Done { revision: 9 }))]),
                desired(8, vec![]),
                vec![],
            ),
            (
                "then it is forgotten",
                local(Standing::Leased, vec![(1, ended(10, exit0(), done, Delivery::Done { revision: 9 }))]),
                desired(9, vec![]),
                vec![Action::Forget { job_id: 1 }],
            ),
            (
                "placed here again under a new epoch: the old record is forgotten first, the launch follows",
                local(Standing::Leased, vec![(1, ended(10, exit0(), done, Delivery::Done { revision: 9 }))]),
                desired(11, vec![run(1, 12)]),
                vec![Action::Forget { job_id: 1 }],
            ),
            (
                "fenced: every running job is stopped quickly, nothing is launched",
                local(
                    Standing::Fenced,
                    vec![(1, running(10, None, done)), (2, running(11, Some(StopCause::Leader), done))],
                ),
                desired(8, vec![run(1, 10), stop(2, 11, Some(60), None), run(3, 12)]),
                vec![
                    Action::Stop {
                        job_id: 1,
                        epoch: 10,
                        grace: Duration::from_secs(1),
                        signal: None,
                        cause: StopCause::Fenced,
                    },
                    Action::Stop {
                        job_id: 2,
                        epoch: 11,
                        grace: Duration::from_secs(1),
                        signal: None,
                        cause: StopCause::Fenced,
                    },
                ],
            ),
            (
                "fenced: exits are still reported (they get through once a leader answers)",
                local(Standing::Fenced, vec![(1, ended(10, exit0(), done, Delivery::Pending))]),
                desired(8, vec![run(1, 10)]),
                vec![Action::ReportFinished { job_id: 1, epoch: 10, report: exit0() }],
            ),
            (
                "must register again: stop everything first",
                local(Standing::MustReregister, vec![(1, running(10, None, done))]),
                desired(8, vec![run(1, 10)]),
                vec![Action::Stop {
                    job_id: 1,
                    epoch: 10,
                    grace: Duration::from_secs(1),
                    signal: None,
                    cause: StopCause::Reregister,
                }],
            ),
            (
                "must register again: waits while a job is still exiting (stale reports are dropped)",
                local(
                    Standing::MustReregister,
                    vec![
                        (1, ended(10, exit0(), done, Delivery::Pending)),
                        (
                            2,
                            LocalJob {
                                epoch: 11,
                                phase: Phase::Exiting,
                                start: done,
                                exit: Delivery::Pending,
                                signals_sent: 0,
                                steps: BTreeMap::new(),
                            },
                        ),
                    ],
                ),
                desired(8, vec![]),
                vec![],
            ),
            (
                "must register again: once nothing runs, register",
                local(Standing::MustReregister, vec![(1, ended(10, exit0(), done, Delivery::Pending))]),
                desired(8, vec![]),
                vec![Action::Reregister],
            ),
            (
                "a signal asked for with corral signal is delivered",
                local(Standing::Leased, vec![(1, running(10, None, done))]),
                desired(8, vec![signalled(1, 10, vec![10])]),
                vec![Action::Signal { job_id: 1, epoch: 10, signals: vec![10], sent: 1 }],
            ),
            (
                "only signals not yet delivered to this run are",
                local(Standing::Leased, vec![(1, LocalJob { signals_sent: 1, ..running(10, None, done) })]),
                desired(8, vec![signalled(1, 10, vec![10, 12, 2])]),
                vec![Action::Signal { job_id: 1, epoch: 10, signals: vec![12, 2], sent: 3 }],
            ),
            (
                "a run that saw the signals at its launch gets none of them",
                local(Standing::Leased, vec![(1, LocalJob { signals_sent: 2, ..running(10, None, done) })]),
                desired(8, vec![signalled(1, 10, vec![10, 12])]),
                vec![],
            ),
            (
                "a stopping or ended job gets no signal",
                local(
                    Standing::Leased,
                    vec![
                        (1, running(10, Some(StopCause::Leader), done)),
                        (2, ended(11, exit0(), done, Delivery::InFlight)),
                    ],
                ),
                desired(8, vec![signalled(1, 10, vec![10]), signalled(2, 11, vec![10])]),
                vec![],
            ),
            (
                "registering: nothing is launched",
                local(Standing::Unregistered, vec![]),
                desired(8, vec![run(1, 10)]),
                vec![],
            ),
        ];
        for (what, local, desired, expected) in rows {
            assert_eq!(reconcile(&local, &desired, &POLICY), expected, "{what}");
        }
    }

    /// Carrying the actions out (as the runtime records them) and reconciling again yields
    /// nothing new: the function is level-triggered and idempotent.
    #[test]
    fn applying_the_actions_converges() {
        let mut local = local(Standing::Leased, vec![(2, running(11, None, Delivery::Done { revision: 3 }))]);
        let desired = desired(5, vec![run(1, 10), stop(2, 11, Some(10), Some(10)), stop(3, 12, None, None)]);
        for round in 0..3 {
            let actions = reconcile(&local, &desired, &POLICY);
            if round > 0 {
                assert!(
                    actions.iter().all(|a| matches!(a, Action::ReportStarted { .. } | Action::ReportFinished { .. }))
                        || actions.is_empty(),
                    "round {round}: {actions:?}"
                );
            }
            for action in actions {
                match action {
                    Action::Launch { epoch, job } => {
                        local.jobs.insert(job.id, running(epoch, None, Delivery::Pending));
                    }
                    Action::NeverStarted { job_id, epoch } => {
                        local.jobs.insert(job_id, ended(epoch, never(), Delivery::Skipped, Delivery::Pending));
                    }
                    Action::Stop { job_id, cause, .. } => {
                        local.jobs.get_mut(&job_id).unwrap().phase = Phase::Running { stopping: Some(cause) };
                    }
                    Action::ReportStarted { job_id, .. } => {
                        local.jobs.get_mut(&job_id).unwrap().start = Delivery::InFlight
                    }
                    Action::ReportFinished { job_id, .. } => {
                        local.jobs.get_mut(&job_id).unwrap().exit = Delivery::InFlight
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        assert!(reconcile(&local, &desired, &POLICY).is_empty());
        assert_eq!(local.jobs.len(), 3);
    }

    /// A job of run `epoch` on n1 with one step, as `edit` leaves it.
    fn with_step(id: JobId, epoch: u64, edit: impl FnOnce(&mut corral_types::JobStep)) -> (JobId, DesiredJob) {
        let mut j = (*job(id, epoch)).clone();
        let mut step = corral_types::JobStep {
            id: 0,
            epoch,
            nodes: vec![corral_types::StepNode { node: "n1".into(), first_task: 0, tasks: 2, gpus: vec![] }],
            ..Default::default()
        };
        edit(&mut step);
        j.steps.next_id = 1;
        j.steps.steps.push(step);
        (id, DesiredJob { job: Arc::new(j), epoch, want: Want::Run, addrs: Default::default() })
    }

    fn with_local_step(phase: StepPhase, report: Delivery) -> LocalJob {
        let mut l = running(10, None, Delivery::Done { revision: 4 });
        l.steps.insert(0, LocalStep { phase, report, signals_sent: 0, wait_started: false });
        l
    }

    /// This node's tasks of a step: launched once, killed when it stops, signalled, their end
    /// reported until accepted, and forgotten once the leader no longer lists the step as live.
    #[test]
    fn steps() {
        let end = StepNodeEnd { node: "n1".into(), ..Default::default() };
        let ended = StepPhase::Ended { end: end.clone() };
        let live = StepPhase::Running { killing: false };
        let leased = |l: LocalJob| local(Standing::Leased, vec![(1, l)]);
        let fresh = running(10, None, Delivery::Done { revision: 4 });
        let (_, d) = with_step(1, 10, |_| {});
        let rows: Vec<(&str, Local, Desired, Vec<Action>)> = vec![
            (
                "a live step with tasks here is launched",
                leased(fresh.clone()),
                desired(5, vec![with_step(1, 10, |_| {})]),
                vec![Action::LaunchTasks { job: d.job.clone(), epoch: 10, step: 0 }],
            ),
            (
                "a step with no tasks here is not",
                leased(fresh.clone()),
                desired(5, vec![with_step(1, 10, |s| s.nodes[0].node = "n2".into())]),
                vec![],
            ),
            (
                "a step of another run is not",
                leased(fresh.clone()),
                desired(5, vec![with_step(1, 10, |s| s.epoch = 9)]),
                vec![],
            ),
            (
                "a step this node already reported is not launched again",
                leased(fresh.clone()),
                desired(5, vec![with_step(1, 10, |s| s.ended.push(end.clone()))]),
                vec![],
            ),
            (
                "a step stopping before its launch is recorded as not launched",
                leased(fresh.clone()),
                desired(5, vec![with_step(1, 10, |s| s.stopping = true)]),
                vec![Action::SkipTasks { job_id: 1, epoch: 10, step: 0 }],
            ),
            (
                "running tasks of a stopping step are killed once",
                leased(with_local_step(live.clone(), Delivery::Pending)),
                desired(5, vec![with_step(1, 10, |s| s.stopping = true)]),
                vec![Action::KillTasks { job_id: 1, epoch: 10, step: 0 }],
            ),
            (
                "being killed: nothing more",
                leased(with_local_step(StepPhase::Running { killing: true }, Delivery::Pending)),
                desired(5, vec![with_step(1, 10, |s| s.stopping = true)]),
                vec![],
            ),
            (
                "srun --wait: another node's tasks ended, the wait starts here",
                leased(with_local_step(live.clone(), Delivery::Pending)),
                desired(
                    5,
                    vec![with_step(1, 10, |s| {
                        s.spec.wait_secs = Some(60);
                        s.ended.push(StepNodeEnd { node: "n2".into(), ..Default::default() });
                    })],
                ),
                vec![Action::StartWait { job_id: 1, epoch: 10, step: 0 }],
            ),
            (
                "without --wait another node's end changes nothing here",
                leased(with_local_step(live.clone(), Delivery::Pending)),
                desired(
                    5,
                    vec![with_step(1, 10, |s| s.ended.push(StepNodeEnd { node: "n2".into(), ..Default::default() }))],
                ),
                vec![],
            ),
            (
                "signals srun forwarded are delivered",
                leased(with_local_step(live, Delivery::Pending)),
                desired(5, vec![with_step(1, 10, |s| s.signals = vec![2])]),
                vec![Action::SignalTasks { job_id: 1, epoch: 10, step: 0, signals: vec![2], sent: 1 }],
            ),
            (
                "ended tasks are reported",
                leased(with_local_step(ended.clone(), Delivery::Pending)),
                desired(5, vec![with_step(1, 10, |_| {})]),
                vec![Action::ReportStepEnded { job_id: 1, epoch: 10, step: 0, end: end.clone() }],
            ),
            (
                "a report accepted at 7 is kept while a state older than it lists the step live",
                leased(with_local_step(ended.clone(), Delivery::Done { revision: 7 })),
                desired(6, vec![with_step(1, 10, |_| {})]),
                vec![],
            ),
            (
                "then forgotten",
                leased(with_local_step(ended, Delivery::Done { revision: 7 })),
                desired(7, vec![with_step(1, 10, |s| s.state = corral_types::StepState::Completed)]),
                vec![Action::ForgetStep { job_id: 1, step: 0 }],
            ),
        ];
        for (what, local, desired, expected) in rows {
            assert_eq!(reconcile(&local, &desired, &POLICY), expected, "{what}");
        }
    }
}
