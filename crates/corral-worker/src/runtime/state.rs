//! The runtime's book-keeping, pure: its registration, its lease, what it runs and has reported
//! (`reconcile::Local`) and the desired state it follows, changed only by the events its tasks
//! send and by the actions it carries out. No I/O and no clock (time enters as `now`), so the
//! runtime's remaining decisions — when the lease runs out and comes back, when to register
//! again, which answers are stale, what an exit report says, which launches run together — are
//! table-tested here; `reconcile` decides the rest from `Local` and `Desired`.
//!
//! The lease: each answer from a leader (registration or heartbeat) lets the worker keep its
//! jobs until `fence_after` after the moment the answered request was *sent* (the leader heard
//! it later, so its TTL clock started later). Past that, the worker is fenced and stops every
//! job; its fence guard (`fence.rs`) kills what is left halfway to the node TTL, when the
//! leader may give the jobs to other nodes.

use crate::gang::PartAddrs;
use crate::launch::Prepared;
use crate::link::{LinkEvent, ReportKind, Terms};
use crate::reconcile::{
    reconcile, Action, Delivery, Desired, Local, LocalJob, LocalStep, Phase, Policy, Standing, StepPhase, StopCause,
};
use corral_image::ImageError;
use corral_types::{Job, JobExitReport, JobId, StepId, StepNodeEnd};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a run's `pulling` stage ends with: its image ready to launch from, or why not.
pub(crate) type Outcome = Result<Prepared, ImageError>;

/// What the runtime's tasks tell it.
#[derive(Debug)]
pub(crate) enum Event {
    /// What a leader answered.
    Link(LinkEvent),
    /// The job's process tree is gone; GPU hygiene runs next.
    ProcessGone { job_id: JobId, epoch: u64 },
    /// The run is over and cleaned up; `report` is its exit as the job task saw it.
    Exited { job_id: JobId, epoch: u64, report: JobExitReport },
    /// A launched job's start report is due (`START_REPORT_HOLD` passed).
    StartDue { job_id: JobId, epoch: u64 },
    /// This node's tasks of a step are all gone (or could not launch).
    TasksEnded { job_id: JobId, epoch: u64, step: StepId, end: StepNodeEnd },
    /// The image of a run is pulled and its root mounted, or the pull failed (the runtime
    /// handles it: it launches, or ends the run).
    Pulled { job_id: JobId, epoch: u64, outcome: Box<Outcome> },
}

impl From<LinkEvent> for Event {
    fn from(event: LinkEvent) -> Event {
        Event::Link(event)
    }
}

/// Until when a leader's answers let this worker's jobs run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Lease {
    /// The terms of the last answer.
    terms: Option<Terms>,
    until: Option<Instant>,
}

impl Lease {
    /// A leader answered a request sent at `sent_at`: jobs may run until the fence time after
    /// it. An answer to an older request never shortens the lease. Returns the fence guard's
    /// new deadline when the lease grew.
    fn renew(&mut self, sent_at: Instant, terms: Terms) -> Option<Instant> {
        self.terms = Some(terms);
        let until = sent_at + terms.fence_after;
        if self.until.is_some_and(|u| u >= until) {
            return None;
        }
        self.until = Some(until);
        Some(sent_at + terms.guard_after())
    }

    /// The settings of `reconcile`: stops when fenced or registering again take half the time
    /// between the fence and the guard, so they end before the guard kills (never more than
    /// `kill_grace`).
    fn policy(&self, kill_grace: Duration) -> Policy {
        let fence_grace = self
            .terms
            .map(|t| (t.guard_after().saturating_sub(t.fence_after) / 2).min(kill_grace))
            .unwrap_or(kill_grace);
        Policy { kill_grace, fence_grace }
    }
}

/// What an event asks of the runtime besides reconciling.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct FollowUp {
    /// Registration `node_epoch` was taken: the link follows it.
    pub registered: Option<u64>,
    /// The lease grew: the fence guard's new deadline.
    pub guard_deadline: Option<Instant>,
}

/// One step of carrying out a round of actions.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Launches of whole-GPU jobs next to each other: they run in parallel (a launch is mostly
    /// cgroup set-up and fork/exec).
    Launches(Vec<(Arc<Job>, u64)>),
    /// Any other action, in its order.
    Act(Action),
}

/// The steps that carry out `actions`: whole-GPU launches next to each other are batched,
/// everything else keeps its order.
pub(crate) fn steps(actions: Vec<Action>) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut batch = Vec::new();
    for action in actions {
        match action {
            Action::Launch { job, epoch } if job.spec.gpu_slice.is_none() => batch.push((job, epoch)),
            other => {
                if !batch.is_empty() {
                    steps.push(Step::Launches(std::mem::take(&mut batch)));
                }
                steps.push(Step::Act(other));
            }
        }
    }
    if !batch.is_empty() {
        steps.push(Step::Launches(batch));
    }
    steps
}

/// The runtime's book-keeping.
#[derive(Debug)]
pub(crate) struct RuntimeState {
    local: Local,
    desired: Desired,
    /// Epoch of the registration the runtime follows; 0 while (re-)registering.
    node_epoch: u64,
    lease: Lease,
    /// Why each stopping job is being stopped (a fenced stop is reported as such).
    causes: BTreeMap<JobId, StopCause>,
}

impl RuntimeState {
    /// Unregistered, running nothing.
    pub(crate) fn new() -> RuntimeState {
        RuntimeState {
            local: Local { standing: Standing::Unregistered, jobs: BTreeMap::new() },
            desired: Desired::default(),
            node_epoch: 0,
            lease: Lease::default(),
            causes: BTreeMap::new(),
        }
    }

    /// Registered, and a leader answered within the fence time.
    pub(crate) fn leased(&self) -> bool {
        self.local.standing == Standing::Leased
    }

    /// When the lease runs out, while leased: the runtime checks it then.
    pub(crate) fn lease_deadline(&self) -> Option<Instant> {
        self.lease.until.filter(|_| self.leased())
    }

    /// The moment after which no job may start here: the lease's end, or now when there is no
    /// lease (a launch then starts nothing).
    pub(crate) fn launch_deadline(&self) -> Instant {
        self.lease_deadline().unwrap_or_else(Instant::now)
    }

    /// Fences the worker when no leader answered within the fence time, as of `now`.
    pub(crate) fn check_lease(&mut self, now: Instant) {
        if self.lease_deadline().is_some_and(|until| now >= until) {
            let fence_after = self.lease.terms.map(|t| t.fence_after).unwrap_or_default();
            tracing::warn!(
                fence_after_ms = fence_after.as_millis() as u64,
                "no leader answered within the fence time: stopping every job before the leader gives them to other nodes"
            );
            self.local.standing = Standing::Fenced;
        }
    }

    /// The actions that bring the worker to what the leader wants (`reconcile`).
    pub(crate) fn actions(&self, kill_grace: Duration) -> Vec<Action> {
        reconcile(&self.local, &self.desired, &self.lease.policy(kill_grace))
    }

    /// Records an event that arrived at `now`; says what else the runtime must do.
    pub(crate) fn handle(&mut self, event: Event, now: Instant) -> FollowUp {
        let mut follow_up = FollowUp::default();
        match event {
            Event::Link(LinkEvent::Registered { node_epoch, sent_at, terms }) => {
                self.node_epoch = node_epoch;
                self.local = Local { standing: Standing::Leased, jobs: BTreeMap::new() };
                self.desired = Desired::default();
                self.lease.until = None;
                follow_up.guard_deadline = self.renew(sent_at, terms, now);
                follow_up.registered = Some(node_epoch);
            }
            Event::Link(LinkEvent::Answered { node_epoch, sent_at, terms, reregister })
                if node_epoch == self.node_epoch =>
            {
                follow_up.guard_deadline = self.renew(sent_at, terms, now);
                if reregister {
                    self.must_reregister("the leader does not know this node's epoch");
                }
            }
            Event::Link(LinkEvent::Desired { node_epoch, desired, reregister }) if node_epoch == self.node_epoch => {
                if reregister {
                    self.must_reregister("the leader does not know this node's epoch");
                } else if desired.revision >= self.desired.revision {
                    self.desired = desired;
                }
            }
            // Answers for an earlier registration.
            Event::Link(LinkEvent::Answered { .. } | LinkEvent::Desired { .. }) => {}
            Event::Link(LinkEvent::StepReported { job_id, epoch, step, revision }) => {
                if let Some(s) = self.job_mut(job_id, epoch).and_then(|j| j.steps.get_mut(&step)) {
                    s.report = Delivery::Done { revision };
                }
            }
            Event::TasksEnded { job_id, epoch, step, end } => {
                if let Some(s) = self.job_mut(job_id, epoch).and_then(|j| j.steps.get_mut(&step)) {
                    s.phase = StepPhase::Ended { end };
                }
            }
            Event::Link(LinkEvent::Reported { job_id, epoch, kind, revision }) => {
                if let Some(job) = self.job_mut(job_id, epoch) {
                    let delivery = Delivery::Done { revision };
                    match kind {
                        ReportKind::Start => job.start = delivery,
                        ReportKind::Exit => job.exit = delivery,
                    }
                }
            }
            Event::ProcessGone { job_id, epoch } => {
                if let Some(job) = self.job_mut(job_id, epoch) {
                    job.phase = Phase::Exiting;
                    if matches!(job.start, Delivery::Pending | Delivery::Held) {
                        job.start = Delivery::Skipped;
                    }
                }
            }
            Event::Exited { job_id, epoch, mut report } => {
                let cause = self.causes.get(&job_id).copied();
                if let Some(job) = self.job_mut(job_id, epoch) {
                    // Stopped because the worker lost its lease or its registration, or shut
                    // down: not the job's doing.
                    report.fenced =
                        matches!(cause, Some(StopCause::Fenced | StopCause::Reregister | StopCause::Shutdown));
                    if matches!(job.start, Delivery::Pending | Delivery::Held) {
                        job.start = Delivery::Skipped;
                    }
                    job.phase = Phase::Ended { report };
                }
            }
            // The runtime takes these before the book-keeping sees them.
            Event::Pulled { .. } => {}
            Event::StartDue { job_id, epoch } => {
                if let Some(job) = self.job_mut(job_id, epoch) {
                    if job.start == Delivery::Held {
                        job.start = Delivery::Pending;
                    }
                }
            }
        }
        follow_up
    }

    fn job_mut(&mut self, job_id: JobId, epoch: u64) -> Option<&mut LocalJob> {
        self.local.jobs.get_mut(&job_id).filter(|j| j.epoch == epoch)
    }

    /// A leader answered a request sent at `sent_at`; a fenced worker whose lease holds again at
    /// `now` is leased again. Returns the fence guard's new deadline when the lease grew.
    fn renew(&mut self, sent_at: Instant, terms: Terms, now: Instant) -> Option<Instant> {
        let guard_deadline = self.lease.renew(sent_at, terms)?;
        if self.local.standing == Standing::Fenced && self.lease.until.is_some_and(|until| now < until) {
            tracing::info!("a leader answers again: reporting what ended meanwhile");
            self.local.standing = Standing::Leased;
        }
        Some(guard_deadline)
    }

    fn must_reregister(&mut self, why: &str) {
        if matches!(self.local.standing, Standing::Leased | Standing::Fenced) {
            tracing::warn!(reason = why, "stopping every job and registering again");
            self.local.standing = Standing::MustReregister;
        }
    }

    /// Records what carrying out `action` changes in the book-keeping; the runtime does the
    /// rest (a launch is recorded by `launched` or `launch_failed`).
    pub(crate) fn record(&mut self, action: &Action) {
        match action {
            Action::Launch { .. } => {}
            Action::NeverStarted { job_id, epoch } => {
                let report = JobExitReport { never_started: true, ..Default::default() };
                self.local.jobs.insert(*job_id, ended(*epoch, report));
            }
            Action::Stop { job_id, cause, .. } => {
                if let Some(job) = self.local.jobs.get_mut(job_id) {
                    job.phase = Phase::Running { stopping: Some(*cause) };
                }
                self.causes.insert(*job_id, *cause);
            }
            Action::ReportStarted { job_id, .. } => {
                if let Some(job) = self.local.jobs.get_mut(job_id) {
                    job.start = Delivery::InFlight;
                }
            }
            Action::ReportFinished { job_id, .. } => {
                if let Some(job) = self.local.jobs.get_mut(job_id) {
                    job.exit = Delivery::InFlight;
                }
            }
            Action::Forget { job_id } => {
                self.local.jobs.remove(job_id);
                self.causes.remove(job_id);
            }
            Action::Signal { job_id, sent, .. } => {
                if let Some(job) = self.local.jobs.get_mut(job_id) {
                    job.signals_sent = *sent;
                }
            }
            Action::LaunchTasks { job, step, .. } => {
                if let Some(j) = self.local.jobs.get_mut(&job.id) {
                    let running = StepPhase::Running { killing: false };
                    let signals_sent =
                        job.steps.steps.iter().find(|s| s.id == *step).map(|s| s.signals.len()).unwrap_or(0);
                    let local =
                        LocalStep { phase: running, report: Delivery::Pending, signals_sent, wait_started: false };
                    j.steps.insert(*step, local);
                }
            }
            Action::SkipTasks { job_id, step, .. } => {
                if let Some(j) = self.local.jobs.get_mut(job_id) {
                    let end = StepNodeEnd {
                        launch_error: Some("the step stopped before its tasks launched here".into()),
                        ..Default::default()
                    };
                    let phase = StepPhase::Ended { end };
                    let local = LocalStep { phase, report: Delivery::Pending, signals_sent: 0, wait_started: false };
                    j.steps.insert(*step, local);
                }
            }
            Action::KillTasks { job_id, step, .. } => {
                if let Some(s) = self.local.jobs.get_mut(job_id).and_then(|j| j.steps.get_mut(step)) {
                    s.phase = StepPhase::Running { killing: true };
                }
            }
            Action::SignalTasks { job_id, step, sent, .. } => {
                if let Some(s) = self.local.jobs.get_mut(job_id).and_then(|j| j.steps.get_mut(step)) {
                    s.signals_sent = *sent;
                }
            }
            Action::StartWait { job_id, step, .. } => {
                if let Some(s) = self.local.jobs.get_mut(job_id).and_then(|j| j.steps.get_mut(step)) {
                    s.wait_started = true;
                }
            }
            Action::ReportStepEnded { job_id, step, .. } => {
                if let Some(s) = self.local.jobs.get_mut(job_id).and_then(|j| j.steps.get_mut(step)) {
                    s.report = Delivery::InFlight;
                }
            }
            Action::ForgetStep { job_id, step } => {
                if let Some(j) = self.local.jobs.get_mut(job_id) {
                    j.steps.remove(step);
                }
            }
            Action::Reregister => {
                self.local = Local { standing: Standing::Unregistered, jobs: BTreeMap::new() };
                self.desired = Desired::default();
                self.causes.clear();
                self.node_epoch = 0;
            }
        }
    }

    /// Allocation `epoch` of `job` runs: its start report is held for a moment; signals asked
    /// for before this run are not for it.
    pub(crate) fn launched(&mut self, job: &Job, epoch: u64) {
        let running = LocalJob {
            epoch,
            phase: Phase::Running { stopping: None },
            start: Delivery::Held,
            exit: Delivery::Pending,
            signals_sent: job.signals.len(),
            steps: BTreeMap::new(),
        };
        self.local.jobs.insert(job.id, running);
    }

    /// Allocation `epoch` of `job` waits for its image: nothing runs, nothing is reported yet.
    pub(crate) fn pulling(&mut self, job_id: JobId, epoch: u64) {
        let pulling = LocalJob {
            epoch,
            phase: Phase::Pulling,
            start: Delivery::Held,
            exit: Delivery::Pending,
            signals_sent: 0,
            steps: BTreeMap::new(),
        };
        self.local.jobs.insert(job_id, pulling);
    }

    /// Whether the pull of allocation `epoch` of a job is still wanted: the run is still
    /// pulling here (not abandoned) and the worker holds its lease.
    pub(crate) fn still_pulling(&self, job_id: JobId, epoch: u64) -> bool {
        self.leased() && self.local.jobs.get(&job_id).is_some_and(|j| j.epoch == epoch && j.phase == Phase::Pulling)
    }

    /// Allocation `epoch` of a job could not launch: it ended with `error`.
    pub(crate) fn launch_failed(&mut self, job_id: JobId, epoch: u64, error: String) {
        let report = JobExitReport { launch_error: Some(error), ..Default::default() };
        self.local.jobs.insert(job_id, ended(epoch, report));
    }

    /// The desired state the runtime follows.
    pub(crate) fn desired(&self) -> &Desired {
        &self.desired
    }

    /// Allocation `epoch` of a job did not start here for a reason another node may not have
    /// (its registry unreachable, its disk full): reported never started, so the leader
    /// requeues it.
    pub(crate) fn not_started(&mut self, job_id: JobId, epoch: u64) {
        let report = JobExitReport { never_started: true, ..Default::default() };
        self.local.jobs.insert(job_id, ended(epoch, report));
    }

    /// The job of run `epoch` as the desired state last had it.
    pub(crate) fn desired_job(&self, job_id: JobId, epoch: u64) -> Option<Arc<Job>> {
        self.desired.jobs.get(&job_id).filter(|d| d.epoch == epoch).map(|d| d.job.clone())
    }

    /// The job of run `epoch` while the desired state wants it to run.
    pub(crate) fn desired_running(&self, job_id: JobId, epoch: u64) -> Option<Arc<Job>> {
        self.desired
            .jobs
            .get(&job_id)
            .filter(|d| d.epoch == epoch && d.want == crate::reconcile::Want::Run)
            .map(|d| d.job.clone())
    }

    /// Where the parts of run `epoch` of a job are, as the desired state says.
    pub(crate) fn part_addrs(&self, job_id: JobId, epoch: u64) -> PartAddrs {
        self.desired.jobs.get(&job_id).filter(|d| d.epoch == epoch).map(|d| d.addrs.clone()).unwrap_or_default()
    }
}

/// A run that ended without running (launch failure, never started): only its exit is reported.
fn ended(epoch: u64, report: JobExitReport) -> LocalJob {
    LocalJob {
        epoch,
        phase: Phase::Ended { report },
        start: Delivery::Skipped,
        exit: Delivery::Pending,
        signals_sent: 0,
        steps: BTreeMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::tests::job;
    use crate::reconcile::{DesiredJob, Want};
    use corral_types::GpuSlice;

    const KILL_GRACE: Duration = Duration::from_secs(5);
    /// Fenced 4 s after the answered request was sent; the node TTL is 10 s, so the guard kills
    /// at 7 s.
    const TERMS: Terms = Terms { node_ttl: Duration::from_secs(10), fence_after: Duration::from_secs(4) };

    /// `s` seconds after the registration request was sent (negative: before it).
    fn at(s: f64) -> Instant {
        static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let origin = *ORIGIN.get_or_init(|| Instant::now() + Duration::from_secs(60));
        if s >= 0.0 {
            origin + Duration::from_secs_f64(s)
        } else {
            origin - Duration::from_secs_f64(-s)
        }
    }

    /// Registered with node epoch 3 by the answer to a request sent at `at(0.0)`.
    fn registered() -> RuntimeState {
        let mut state = RuntimeState::new();
        let event = LinkEvent::Registered { node_epoch: 3, sent_at: at(0.0), terms: TERMS };
        let follow_up = state.handle(event.into(), at(0.1));
        assert_eq!(follow_up, FollowUp { registered: Some(3), guard_deadline: Some(at(7.0)) });
        assert!(state.leased());
        state
    }

    fn answered(node_epoch: u64, sent_at: Instant, reregister: bool) -> Event {
        LinkEvent::Answered { node_epoch, sent_at, terms: TERMS, reregister }.into()
    }

    /// A desired state of registration 3 running `jobs` (allocation epoch 1).
    fn desired(revision: u64, jobs: &[JobId]) -> Event {
        let jobs = jobs
            .iter()
            .map(|&id| (id, DesiredJob { job: job(id, 1), epoch: 1, want: Want::Run, addrs: PartAddrs::default() }))
            .collect();
        LinkEvent::Desired { node_epoch: 3, desired: Desired { revision, jobs, node: "n1".into() }, reregister: false }
            .into()
    }

    fn local_job(state: &RuntimeState, job_id: JobId) -> &LocalJob {
        state.local.jobs.get(&job_id).expect("the job is recorded")
    }

    #[test]
    fn the_lease_runs_from_when_the_answered_request_was_sent() {
        let mut state = registered();
        assert_eq!(state.lease_deadline(), Some(at(4.0)));
        state.check_lease(at(3.9));
        assert!(state.leased());
        state.check_lease(at(4.0));
        assert_eq!(state.local.standing, Standing::Fenced);
        assert_eq!(state.lease_deadline(), None, "a fenced worker has no lease left to check");
        let mut unregistered = RuntimeState::new();
        unregistered.check_lease(at(100.0));
        assert_eq!(unregistered.local.standing, Standing::Unregistered, "no lease, nothing to fence");
    }

    #[test]
    fn heartbeat_answers_renew_the_lease_and_the_guard() {
        struct Case {
            case: &'static str,
            /// Fenced (at 4 s) before the answer arrives.
            fenced: bool,
            sent_at: f64,
            now: f64,
            guard: Option<f64>,
            leased: bool,
            until: f64,
        }
        let cases = [
            Case {
                case: "a later request extends the lease and the guard",
                fenced: false,
                sent_at: 1.0,
                now: 1.5,
                guard: Some(8.0),
                leased: true,
                until: 5.0,
            },
            Case {
                case: "an answer to an older request never shortens the lease",
                fenced: false,
                sent_at: -1.0,
                now: 1.5,
                guard: None,
                leased: true,
                until: 4.0,
            },
            Case {
                case: "an answer to a request sent at the same moment changes nothing",
                fenced: false,
                sent_at: 0.0,
                now: 1.5,
                guard: None,
                leased: true,
                until: 4.0,
            },
            Case {
                case: "a fenced worker whose new lease holds is leased again",
                fenced: true,
                sent_at: 3.0,
                now: 5.0,
                guard: Some(10.0),
                leased: true,
                until: 7.0,
            },
            Case {
                case: "a fenced worker whose new lease already ran out stays fenced, its guard moved",
                fenced: true,
                sent_at: 0.5,
                now: 5.0,
                guard: Some(7.5),
                leased: false,
                until: 4.5,
            },
        ];
        for c in cases {
            let mut state = registered();
            if c.fenced {
                state.check_lease(at(4.0));
                assert!(!state.leased(), "{}", c.case);
            }
            let follow_up = state.handle(answered(3, at(c.sent_at), false), at(c.now));
            assert_eq!(follow_up, FollowUp { registered: None, guard_deadline: c.guard.map(at) }, "{}", c.case);
            assert_eq!(state.leased(), c.leased, "{}", c.case);
            assert_eq!(state.lease.until, Some(at(c.until)), "{}", c.case);
        }
    }

    #[test]
    fn stops_without_a_lease_end_before_the_guard_kills() {
        let terms = |ttl: u64, fence: u64| Terms {
            node_ttl: Duration::from_secs(ttl),
            fence_after: Duration::from_secs(fence),
        };
        let cases = [
            (None, KILL_GRACE, KILL_GRACE),
            // Half the 3 s between the fence (4 s) and the guard (7 s).
            (Some(terms(10, 4)), KILL_GRACE, Duration::from_millis(1500)),
            (Some(terms(10, 4)), Duration::from_secs(1), Duration::from_secs(1)),
            // The guard kills at the fence time: no grace at all.
            (Some(terms(4, 4)), KILL_GRACE, Duration::ZERO),
        ];
        for (terms, kill_grace, fence_grace) in cases {
            let policy = Lease { terms, until: None }.policy(kill_grace);
            assert_eq!(policy, Policy { kill_grace, fence_grace }, "{terms:?} with kill grace {kill_grace:?}");
        }
    }

    #[test]
    fn answers_for_an_earlier_registration_are_ignored() {
        let mut state = registered();
        let follow_up = state.handle(answered(2, at(1.0), true), at(1.5));
        assert_eq!(follow_up, FollowUp::default());
        assert!(state.leased(), "an old epoch's reregister is not this registration's");
        assert_eq!(state.lease.until, Some(at(4.0)), "an old epoch's answer renews nothing");
        let old = LinkEvent::Desired {
            node_epoch: 2,
            desired: Desired { revision: 9, ..Default::default() },
            reregister: true,
        };
        state.handle(old.into(), at(1.5));
        assert!(state.leased());
        assert_eq!(state.desired.revision, 0);
    }

    #[test]
    fn an_older_desired_state_is_ignored() {
        let mut state = registered();
        state.handle(desired(5, &[1]), at(1.0));
        state.handle(desired(4, &[2]), at(1.0));
        assert_eq!(state.actions(KILL_GRACE), [Action::Launch { job: job(1, 1), epoch: 1 }]);
        state.handle(desired(5, &[2]), at(1.0));
        assert_eq!(
            state.actions(KILL_GRACE),
            [Action::Launch { job: job(2, 1), epoch: 1 }],
            "the same revision again replaces it"
        );
    }

    #[test]
    fn a_leader_that_does_not_know_the_epoch_has_the_worker_stop_everything_then_register_again() {
        // Before a registration there is nothing to give up.
        let mut unregistered = RuntimeState::new();
        let reregister = LinkEvent::Desired { node_epoch: 0, desired: Desired::default(), reregister: true };
        unregistered.handle(reregister.into(), at(0.0));
        assert_eq!(unregistered.local.standing, Standing::Unregistered);

        for event in [
            answered(3, at(1.0), true),
            LinkEvent::Desired { node_epoch: 3, desired: Desired::default(), reregister: true }.into(),
        ] {
            let mut state = registered();
            state.handle(desired(5, &[1]), at(1.0));
            state.launched(&job(1, 1), 1);
            state.handle(event, at(1.5));
            assert_eq!(state.local.standing, Standing::MustReregister);
            let stop = Action::Stop {
                job_id: 1,
                epoch: 1,
                grace: Duration::from_millis(1500),
                signal: None,
                cause: StopCause::Reregister,
            };
            assert_eq!(state.actions(KILL_GRACE), std::slice::from_ref(&stop), "stop everything first, register after");
            state.record(&stop);
            state.handle(Event::ProcessGone { job_id: 1, epoch: 1 }, at(2.0));
            state.handle(Event::Exited { job_id: 1, epoch: 1, report: JobExitReport::default() }, at(2.5));
            assert_eq!(state.actions(KILL_GRACE), [Action::Reregister], "the exit is stale: not reported");
            state.record(&Action::Reregister);
            assert_eq!(state.local, Local { standing: Standing::Unregistered, jobs: BTreeMap::new() });
            assert_eq!((state.node_epoch, state.desired.revision), (0, 0));
            assert!(state.causes.is_empty());
            assert_eq!(state.actions(KILL_GRACE), []);
            let again = LinkEvent::Registered { node_epoch: 4, sent_at: at(3.0), terms: TERMS };
            let follow_up = state.handle(again.into(), at(3.1));
            assert_eq!(follow_up, FollowUp { registered: Some(4), guard_deadline: Some(at(10.0)) });
            assert_eq!((state.leased(), state.node_epoch, state.lease_deadline()), (true, 4, Some(at(7.0))));
        }
    }

    #[test]
    fn an_exit_report_says_whether_the_worker_stopped_the_job_for_its_own_reasons() {
        let cases = [
            (None, false),
            (Some(StopCause::Leader), false),
            (Some(StopCause::Orphan), false),
            (Some(StopCause::Fenced), true),
            (Some(StopCause::Reregister), true),
            (Some(StopCause::Shutdown), true),
        ];
        for (cause, fenced) in cases {
            let mut state = registered();
            state.launched(&job(1, 1), 1);
            if let Some(cause) = cause {
                let grace = KILL_GRACE;
                state.record(&Action::Stop { job_id: 1, epoch: 1, grace, signal: None, cause });
                assert_eq!(local_job(&state, 1).phase, Phase::Running { stopping: Some(cause) });
            }
            let report = JobExitReport { exit_code: Some(143), run_time_ms: 20, ..Default::default() };
            state.handle(Event::Exited { job_id: 1, epoch: 1, report: report.clone() }, at(1.0));
            let expected = JobExitReport { fenced, ..report };
            assert_eq!(local_job(&state, 1).phase, Phase::Ended { report: expected }, "{cause:?}");
        }
    }

    #[test]
    fn a_start_report_is_held_a_moment_and_left_out_for_a_job_that_ended_meanwhile() {
        let mut state = registered();
        let mut ten = job(1, 1).as_ref().clone();
        ten.signals = vec![10, 12];
        state.launched(&ten, 1);
        let launched = local_job(&state, 1);
        assert_eq!((launched.start, launched.exit), (Delivery::Held, Delivery::Pending));
        assert_eq!(launched.signals_sent, 2, "signals asked for before this run are not for it");
        state.handle(Event::StartDue { job_id: 1, epoch: 1 }, at(1.0));
        assert_eq!(local_job(&state, 1).start, Delivery::Pending);
        state.handle(Event::ProcessGone { job_id: 1, epoch: 1 }, at(1.0));
        assert_eq!(
            (local_job(&state, 1).phase.clone(), local_job(&state, 1).start),
            (Phase::Exiting, Delivery::Skipped)
        );

        // One whose start report is under way keeps it.
        state.launched(&job(2, 1), 1);
        state.handle(Event::StartDue { job_id: 2, epoch: 1 }, at(1.0));
        state.record(&Action::ReportStarted { job_id: 2, epoch: 1 });
        state.handle(Event::Exited { job_id: 2, epoch: 1, report: JobExitReport::default() }, at(1.0));
        assert_eq!(local_job(&state, 2).start, Delivery::InFlight);
        state.handle(LinkEvent::Reported { job_id: 2, epoch: 1, kind: ReportKind::Start, revision: 7 }.into(), at(1.0));
        assert_eq!(local_job(&state, 2).start, Delivery::Done { revision: 7 });
    }

    #[test]
    fn events_of_another_run_of_the_job_change_nothing() {
        let mut state = registered();
        state.launched(&job(1, 2), 2);
        let before = local_job(&state, 1).clone();
        for event in [
            Event::StartDue { job_id: 1, epoch: 1 },
            Event::ProcessGone { job_id: 1, epoch: 1 },
            Event::Exited { job_id: 1, epoch: 1, report: JobExitReport::default() },
            LinkEvent::Reported { job_id: 1, epoch: 1, kind: ReportKind::Exit, revision: 3 }.into(),
        ] {
            state.handle(event, at(1.0));
            assert_eq!(local_job(&state, 1), &before);
        }
    }

    #[test]
    fn a_failed_launch_is_an_ended_run_reporting_its_error() {
        let mut state = registered();
        state.handle(desired(5, &[1]), at(1.0));
        state.launch_failed(1, 1, "node n1: no such program".into());
        let report = JobExitReport { launch_error: Some("node n1: no such program".into()), ..Default::default() };
        assert_eq!(state.actions(KILL_GRACE), [Action::ReportFinished { job_id: 1, epoch: 1, report }]);
        assert_eq!(local_job(&state, 1).start, Delivery::Skipped);
    }

    #[test]
    fn recorded_actions_change_the_book_keeping_as_the_runtime_carries_them_out() {
        let mut state = registered();
        state.launched(&job(1, 1), 1);
        state.record(&Action::Signal { job_id: 1, epoch: 1, signals: vec![10], sent: 1 });
        assert_eq!(local_job(&state, 1).signals_sent, 1);
        state.record(&Action::ReportFinished { job_id: 1, epoch: 1, report: JobExitReport::default() });
        assert_eq!(local_job(&state, 1).exit, Delivery::InFlight);
        state.record(&Action::Stop { job_id: 1, epoch: 1, grace: KILL_GRACE, signal: None, cause: StopCause::Leader });
        state.record(&Action::Forget { job_id: 1 });
        assert!(state.local.jobs.is_empty() && state.causes.is_empty());
        state.record(&Action::NeverStarted { job_id: 2, epoch: 4 });
        let never = JobExitReport { never_started: true, ..Default::default() };
        assert_eq!(local_job(&state, 2), &ended(4, never));
    }

    #[test]
    fn whole_gpu_launches_next_to_each_other_run_together_and_everything_else_keeps_its_order() {
        let launch = |id: JobId| Action::Launch { job: job(id, 1), epoch: 1 };
        let mut mps = job(3, 1).as_ref().clone();
        mps.spec.gpu_slice = Some(GpuSlice::Mps { thread_percent: 50, memory_mib: None });
        let fractional = Action::Launch { job: Arc::new(mps), epoch: 1 };
        let report = Action::ReportStarted { job_id: 9, epoch: 1 };
        let batch = |ids: &[JobId]| Step::Launches(ids.iter().map(|&id| (job(id, 1), 1)).collect());
        let cases = [
            (vec![], vec![]),
            (vec![launch(1)], vec![batch(&[1])]),
            (vec![launch(1), launch(2), report.clone()], vec![batch(&[1, 2]), Step::Act(report.clone())]),
            (
                vec![launch(1), fractional.clone(), launch(2), launch(4)],
                vec![batch(&[1]), Step::Act(fractional.clone()), batch(&[2, 4])],
            ),
            (vec![report.clone(), fractional.clone()], vec![Step::Act(report.clone()), Step::Act(fractional)]),
        ];
        for (actions, expected) in cases {
            assert_eq!(steps(actions.clone()), expected, "{actions:?}");
        }
    }
}
