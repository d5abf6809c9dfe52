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
use crate::link::{LinkEvent, ReportKind, Terms};
use crate::reconcile::{reconcile, Action, Delivery, Desired, Local, LocalJob, Phase, Policy, Standing, StopCause};
use corral_types::{Job, JobExitReport, JobId};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        };
        self.local.jobs.insert(job.id, running);
    }

    /// Allocation `epoch` of a job could not launch: it ended with `error`.
    pub(crate) fn launch_failed(&mut self, job_id: JobId, epoch: u64, error: String) {
        let report = JobExitReport { launch_error: Some(error), ..Default::default() };
        self.local.jobs.insert(job_id, ended(epoch, report));
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
    }
}
