//! The worker's runtime: one task owns the local state (`reconcile::Local`), asks `reconcile`
//! what to do and carries it out. Everything that waits (job processes, stops, reports,
//! heartbeats, registration, the desired-state stream) runs in tasks that report back as
//! events; job and stop tasks live in a `JoinSet` that shutdown drains, report deliveries in
//! one that shutdown flushes for a few seconds only, and blocking cgroup kills run on the
//! blocking pool.
//!
//! The lease: each answer from a leader (registration or heartbeat) lets the worker keep its
//! jobs until `fence_after` after the moment the answered request was *sent* (the leader heard
//! it later, so its TTL clock started later). Past that, the worker is fenced and stops every
//! job; its fence guard (`fence.rs`) kills what is left halfway to the node TTL, when the
//! leader may give the jobs to other nodes.

use crate::executor::RunningJob;
use crate::fence::FenceGuard;
use crate::launch::{launch_spec, pick_mig_instance, MigPick};
use crate::reconcile::{
    reconcile, Action, Delivery, Desired, DesiredJob, Local, LocalJob, Phase, Policy, Standing, StopCause, Want,
};
use crate::worker::{RunningView, WorkerShared};
use corral_proto::v1::{self as pb};
use corral_types::{GpuHealth, Job, JobExitReport, JobId};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// A desired-state stream silent for this long is dead (the leader resends every 2 s).
const WATCH_SILENCE: Duration = Duration::from_secs(6);
/// Longest pause between two attempts of a report, a registration or a stream.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a start report is held after the launch: a job that ends within it reports only
/// its exit.
const START_REPORT_HOLD: Duration = Duration::from_millis(50);
/// How long shutdown waits for killed jobs to be reaped.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(30);
/// How long shutdown then keeps trying to deliver pending reports. What is not delivered is not
/// lost for the cluster: the worker registers again with a new epoch when it comes back, and the
/// leader requeues whatever the old epoch still held.
const SHUTDOWN_REPORT_FLUSH: Duration = Duration::from_secs(3);

/// The lease terms a leader grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Terms {
    pub node_ttl: Duration,
    pub fence_after: Duration,
}

impl Terms {
    fn of(lease: Option<pb::Lease>) -> Terms {
        let lease = lease.unwrap_or_default();
        let node_ttl = Duration::from_millis(lease.node_ttl_ms.max(1));
        let fence_after = Duration::from_millis(lease.fence_after_ms).min(node_ttl);
        Terms { node_ttl, fence_after }
    }

    /// When the guard kills: halfway between the worker's own fence time and the node TTL.
    fn guard_after(&self) -> Duration {
        self.fence_after + (self.node_ttl.saturating_sub(self.fence_after)) / 2
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReportKind {
    Start,
    Exit,
}

/// What the runtime's tasks tell it.
enum Event {
    Registered {
        node_epoch: u64,
        sent_at: Instant,
        terms: Terms,
    },
    /// A leader answered a heartbeat sent at `sent_at`.
    Answered {
        node_epoch: u64,
        sent_at: Instant,
        terms: Terms,
        reregister: bool,
    },
    Desired {
        node_epoch: u64,
        desired: Desired,
        reregister: bool,
    },
    /// The job's process tree is gone; GPU hygiene runs next.
    ProcessGone {
        job_id: JobId,
        epoch: u64,
    },
    Exited {
        job_id: JobId,
        epoch: u64,
        report: JobExitReport,
    },
    /// A launched job's start report is due (`START_REPORT_HOLD` passed).
    StartDue {
        job_id: JobId,
        epoch: u64,
    },
    Reported {
        job_id: JobId,
        epoch: u64,
        kind: ReportKind,
        revision: u64,
    },
}

pub(crate) struct Runtime {
    shared: Arc<WorkerShared>,
    local: Local,
    desired: Desired,
    node_epoch: u64,
    terms: Option<Terms>,
    /// Until when a leader's answer lets jobs run.
    lease_until: Option<Instant>,
    /// Why each stopping job is being stopped (a fenced stop is reported as such).
    causes: BTreeMap<JobId, StopCause>,
    guard: Option<FenceGuard>,
    events: mpsc::UnboundedSender<Event>,
    inbox: mpsc::UnboundedReceiver<Event>,
    /// Job processes and stops: drained at shutdown.
    tasks: JoinSet<()>,
    /// Report deliveries: given a short flush at shutdown (a coordinator may be gone for good).
    reports: JoinSet<()>,
    /// Heartbeats, the desired-state stream and registration: aborted at shutdown.
    daemons: JoinSet<()>,
}

impl Runtime {
    pub(crate) fn new(shared: Arc<WorkerShared>) -> Runtime {
        let (events, inbox) = mpsc::unbounded_channel();
        Runtime {
            shared,
            local: Local { standing: Standing::Unregistered, jobs: BTreeMap::new() },
            desired: Desired::default(),
            node_epoch: 0,
            terms: None,
            lease_until: None,
            causes: BTreeMap::new(),
            guard: None,
            events,
            inbox,
            tasks: JoinSet::new(),
            reports: JoinSet::new(),
            daemons: JoinSet::new(),
        }
    }

    pub(crate) async fn run(mut self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        self.guard = match self.shared.config().fence_guard.clone() {
            Some(command) => {
                Some(FenceGuard::start(command).map_err(|e| anyhow::anyhow!("cannot start the fence guard: {e}"))?)
            }
            None => {
                tracing::warn!("no fence guard: jobs of this worker keep running if it freezes or dies");
                None
            }
        };
        self.daemons.spawn(heartbeats(self.shared.clone(), self.events.clone()));
        self.daemons.spawn(watch_desired(self.shared.clone(), self.events.clone()));
        self.register();
        tokio::pin!(shutdown);
        loop {
            let lease_check = self.lease_until.filter(|_| self.local.standing == Standing::Leased);
            let event = tokio::select! {
                _ = &mut shutdown => break,
                event = self.inbox.recv() => event,
                _ = sleep_until(lease_check) => None,
                Some(done) = self.tasks.join_next() => {
                    log_panic(done);
                    None
                }
                Some(done) = self.reports.join_next() => {
                    log_panic(done);
                    None
                }
            };
            // The lease first: after a freeze, what happened meanwhile happened without one.
            self.check_lease();
            if let Some(event) = event {
                self.handle(event);
            }
            self.converge();
            let leased = self.local.standing == Standing::Leased;
            self.shared.serving.send_if_modified(|serving| std::mem::replace(serving, leased) != leased);
        }
        self.shutdown().await;
        Ok(())
    }

    fn policy(&self) -> Policy {
        let kill_grace = self.shared.config().kill_grace;
        // Short enough to end before the guard's deadline.
        let fence_grace = self
            .terms
            .map(|t| (t.guard_after().saturating_sub(t.fence_after) / 2).min(kill_grace))
            .unwrap_or(kill_grace);
        Policy { kill_grace, fence_grace }
    }

    fn check_lease(&mut self) {
        if self.local.standing == Standing::Leased && self.lease_until.is_some_and(|until| Instant::now() >= until) {
            let fence_after = self.terms.map(|t| t.fence_after).unwrap_or_default();
            tracing::warn!(
                fence_after_ms = fence_after.as_millis() as u64,
                "no leader answered within the fence time: stopping every job before the leader gives them to other nodes"
            );
            self.local.standing = Standing::Fenced;
        }
    }

    /// A leader answered a request sent at `sent_at`: jobs may run until the fence time after it.
    fn renew(&mut self, sent_at: Instant, terms: Terms) {
        self.terms = Some(terms);
        let until = sent_at + terms.fence_after;
        if self.lease_until.is_some_and(|u| u >= until) {
            return;
        }
        self.lease_until = Some(until);
        if let Some(guard) = &mut self.guard {
            guard.renew(sent_at + terms.guard_after());
        }
        if self.local.standing == Standing::Fenced && Instant::now() < until {
            tracing::info!("a leader answers again: reporting what ended meanwhile");
            self.local.standing = Standing::Leased;
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Registered { node_epoch, sent_at, terms } => {
                self.node_epoch = node_epoch;
                self.local = Local { standing: Standing::Leased, jobs: BTreeMap::new() };
                self.desired = Desired::default();
                self.lease_until = None;
                self.renew(sent_at, terms);
                self.shared.node_epoch.store(node_epoch, Ordering::SeqCst);
                self.shared.watch_reset.notify_one();
                self.shared.wake_heartbeat.notify_one();
            }
            Event::Answered { node_epoch, sent_at, terms, reregister } if node_epoch == self.node_epoch => {
                self.renew(sent_at, terms);
                if reregister {
                    self.must_reregister("the leader does not know this node's epoch");
                }
            }
            Event::Desired { node_epoch, desired, reregister } if node_epoch == self.node_epoch => {
                if reregister {
                    self.must_reregister("the leader does not know this node's epoch");
                } else if desired.revision >= self.desired.revision {
                    self.desired = desired;
                }
            }
            Event::Answered { .. } | Event::Desired { .. } => {}
            Event::ProcessGone { job_id, epoch } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id).filter(|j| j.epoch == epoch) {
                    job.phase = Phase::Exiting;
                    if matches!(job.start, Delivery::Pending | Delivery::Held) {
                        job.start = Delivery::Skipped;
                    }
                }
            }
            Event::Exited { job_id, epoch, mut report } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id).filter(|j| j.epoch == epoch) {
                    let cause = self.causes.get(&job_id).copied();
                    report.fenced =
                        matches!(cause, Some(StopCause::Fenced | StopCause::Reregister | StopCause::Shutdown));
                    if matches!(job.start, Delivery::Pending | Delivery::Held) {
                        job.start = Delivery::Skipped;
                    }
                    job.phase = Phase::Ended { report };
                }
            }
            Event::StartDue { job_id, epoch } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id).filter(|j| j.epoch == epoch) {
                    if job.start == Delivery::Held {
                        job.start = Delivery::Pending;
                    }
                }
            }
            Event::Reported { job_id, epoch, kind, revision } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id).filter(|j| j.epoch == epoch) {
                    let delivery = Delivery::Done { revision };
                    match kind {
                        ReportKind::Start => job.start = delivery,
                        ReportKind::Exit => job.exit = delivery,
                    }
                }
            }
        }
    }

    fn must_reregister(&mut self, why: &str) {
        if matches!(self.local.standing, Standing::Leased | Standing::Fenced) {
            tracing::warn!(reason = why, "stopping every job and registering again");
            self.local.standing = Standing::MustReregister;
        }
    }

    /// Reconciles and acts until nothing is left to do.
    fn converge(&mut self) {
        for _ in 0..8 {
            let actions = reconcile(&self.local, &self.desired, &self.policy());
            if actions.is_empty() {
                return;
            }
            // Launches of whole-GPU jobs next to each other run in parallel (a launch is mostly
            // cgroup set-up and fork/exec); everything else keeps its order.
            let mut batch = Vec::new();
            for action in actions {
                match action {
                    Action::Launch { job, epoch } if job.spec.gpu_slice.is_none() => batch.push((job, epoch)),
                    other => {
                        self.launch_all(std::mem::take(&mut batch));
                        self.act(other);
                    }
                }
            }
            self.launch_all(batch);
        }
        tracing::warn!("reconcile did not settle in 8 rounds; continuing at the next event");
    }

    /// Launches whole-GPU jobs, their cgroup set-up and fork/exec in parallel.
    fn launch_all(&mut self, jobs: Vec<(Arc<Job>, u64)>) {
        if jobs.len() <= 1 {
            for (job, epoch) in jobs {
                self.launch(&job, epoch);
            }
            return;
        }
        let mut prepared = Vec::new();
        for (job, epoch) in jobs {
            let Some(gpus) = self.begin_launch(&job, epoch) else { continue };
            let spec = launch_spec(&self.shared, &job, epoch, &gpus, None, &self.part_addrs(job.id, epoch));
            prepared.push((job, epoch, gpus, spec));
        }
        let executor = &self.shared.executor;
        // A launch spawns the job's output tasks: each thread enters this runtime.
        let runtime = tokio::runtime::Handle::current();
        let results: Vec<Result<RunningJob, String>> = std::thread::scope(|scope| {
            let launches: Vec<_> = prepared
                .iter()
                .map(|(_, _, _, spec)| {
                    let runtime = runtime.clone();
                    scope.spawn(move || {
                        let _entered = runtime.enter();
                        match spec {
                            Ok(spec) => executor.launch(spec).map_err(|e| e.to_string()),
                            Err(e) => Err(e.clone()),
                        }
                    })
                })
                .collect();
            launches.into_iter().map(|l| l.join().unwrap_or_else(|_| Err("the launch panicked".into()))).collect()
        });
        for ((job, epoch, gpus, _), result) in prepared.into_iter().zip(results) {
            self.launched(&job, epoch, gpus, result.map(|running| (running, None)));
        }
    }

    fn act(&mut self, action: Action) {
        match action {
            Action::Launch { job, epoch } => self.launch(&job, epoch),
            Action::NeverStarted { job_id, epoch } => {
                tracing::info!(job_id, epoch, "stopped before it was launched: reporting it never started");
                let report = JobExitReport { never_started: true, ..Default::default() };
                self.local.jobs.insert(job_id, ended(epoch, report));
            }
            Action::Stop { job_id, epoch, grace, signal, cause } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id) {
                    job.phase = Phase::Running { stopping: Some(cause) };
                }
                self.causes.insert(job_id, cause);
                if let Some(handle) = self.shared.handle(job_id, epoch) {
                    tracing::info!(job_id, epoch, ?cause, grace_ms = grace.as_millis() as u64, signal, "stopping job");
                    self.tasks.spawn(stop(self.shared.clone(), job_id, epoch, handle, grace, signal));
                }
            }
            Action::ReportStarted { job_id, epoch } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id) {
                    job.start = Delivery::InFlight;
                }
                let req = pb::ReportStartedRequest { node: self.shared.config().node_name.clone(), job_id, epoch };
                self.reports.spawn(deliver(
                    self.shared.clone(),
                    self.events.clone(),
                    job_id,
                    epoch,
                    Report::Start(req),
                ));
            }
            Action::ReportFinished { job_id, epoch, report } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id) {
                    job.exit = Delivery::InFlight;
                }
                let req = pb::ReportFinishedRequest {
                    node: self.shared.config().node_name.clone(),
                    job_id,
                    epoch,
                    report: Some((&report).into()),
                };
                self.reports.spawn(deliver(self.shared.clone(), self.events.clone(), job_id, epoch, Report::Exit(req)));
            }
            Action::Forget { job_id } => {
                self.local.jobs.remove(&job_id);
                self.causes.remove(&job_id);
            }
            Action::Signal { job_id, epoch, signals, sent } => {
                if let Some(job) = self.local.jobs.get_mut(&job_id) {
                    job.signals_sent = sent;
                }
                if let Some(handle) = self.shared.handle(job_id, epoch) {
                    tracing::info!(job_id, epoch, ?signals, "delivering signals asked for with corral signal");
                    self.tasks.spawn_blocking(move || {
                        for signal in signals {
                            match Signal::try_from(signal) {
                                Ok(signal) => {
                                    if let Err(e) = handle.signal_tree(signal) {
                                        tracing::warn!(job_id, error = %e, "signal failed");
                                    }
                                }
                                Err(_) => tracing::warn!(job_id, signal, "not a signal: ignored"),
                            }
                        }
                    });
                }
            }
            Action::Reregister => {
                self.local = Local { standing: Standing::Unregistered, jobs: BTreeMap::new() };
                self.desired = Desired::default();
                self.causes.clear();
                self.node_epoch = 0;
                self.shared.node_epoch.store(0, Ordering::SeqCst);
                self.shared.watch_reset.notify_one();
                self.register();
            }
        }
    }

    fn register(&mut self) {
        self.daemons.spawn(register(self.shared.clone(), self.events.clone()));
    }

    /// Starts allocation `epoch` of `job`: its MIG instance, the process in its cgroup, and the
    /// task that waits for it. A failure is recorded as an ended run with the launch error.
    fn launch(&mut self, job: &Job, epoch: u64) {
        let Some(gpus) = self.begin_launch(job, epoch) else { return };
        let launched =
            pick_mig_instance(&self.shared, job, &gpus, &self.shared.taken_mig_instances()).and_then(|mig| {
                let mig_uuid = mig.as_ref().map(|m| m.uuid.as_str());
                let spec = launch_spec(&self.shared, job, epoch, &gpus, mig_uuid, &self.part_addrs(job.id, epoch));
                match spec.and_then(|spec| self.shared.executor.launch(&spec).map_err(|e| e.to_string())) {
                    Ok(running) => Ok((running, mig)),
                    Err(e) => {
                        if let (Some(MigPick { uuid, created: true }), Some(&gpu)) = (mig, gpus.first()) {
                            self.shared.destroy_mig_instance(gpu, uuid);
                        }
                        Err(e)
                    }
                }
            });
        self.launched(job, epoch, gpus, launched);
    }

    /// Where the parts of run `epoch` of a job are, as the desired state says.
    fn part_addrs(&self, job_id: JobId, epoch: u64) -> crate::PartAddrs {
        self.desired.jobs.get(&job_id).filter(|d| d.epoch == epoch).map(|d| d.addrs.clone()).unwrap_or_default()
    }

    /// The GPUs of `job` on this node, with the job marked as launching; None (logged) when the
    /// desired state names a job with no part here.
    fn begin_launch(&self, job: &Job, epoch: u64) -> Option<Vec<u32>> {
        let node = &self.shared.config().node_name;
        let Some(gpus) = job.allocation.as_ref().and_then(|a| a.gpus_on(node)).map(<[u32]>::to_vec) else {
            tracing::warn!(job_id = job.id, epoch, "desired state names a job with no part on this node");
            return None;
        };
        self.shared.set_launching(job.id, true);
        Some(gpus)
    }

    /// Records the outcome of a launch: the running job and the task that waits for it, or the
    /// ended run with the launch error.
    fn launched(
        &mut self,
        job: &Job,
        epoch: u64,
        gpus: Vec<u32>,
        launched: Result<(RunningJob, Option<MigPick>), String>,
    ) {
        let job_id = job.id;
        let (running, mig) = match launched {
            Ok(launched) => launched,
            Err(error) => {
                self.shared.set_launching(job_id, false);
                tracing::warn!(job_id, epoch, error = %error, "launch failed");
                // The user reads it in `corral show`: say where it failed.
                let error = format!("node {}: {error}", self.shared.config().node_name);
                let report = JobExitReport { launch_error: Some(error), ..Default::default() };
                self.local.jobs.insert(job_id, ended(epoch, report));
                return;
            }
        };
        tracing::info!(job_id, epoch, pid = running.pid(), gpus = ?gpus, image = ?job.spec.image, "job started");
        self.shared.add_running(
            job_id,
            RunningView {
                epoch,
                tenant: job.spec.tenant.clone(),
                gpus: gpus.clone(),
                handle: running.handle(),
                mig_uuid: mig.as_ref().map(|m| m.uuid.clone()),
                exited: false,
            },
        );
        self.shared.set_launching(job_id, false);
        self.local.jobs.insert(
            job_id,
            LocalJob {
                epoch,
                phase: Phase::Running { stopping: None },
                start: Delivery::Held,
                exit: Delivery::Pending,
                // Signals asked for before this run are not for it.
                signals_sent: job.signals.len(),
            },
        );
        let events = self.events.clone();
        tokio::spawn(async move {
            tokio::time::sleep(START_REPORT_HOLD).await;
            let _ = events.send(Event::StartDue { job_id, epoch });
        });
        let limit = TimeLimit::of(job);
        let task = run_job(self.shared.clone(), self.events.clone(), job_id, epoch, running, limit, gpus, mig);
        self.tasks.spawn(task);
    }

    /// Kills every job, waits for the job tasks, stops the guard.
    async fn shutdown(mut self) {
        for (job_id, handle) in self.shared.running_handles() {
            tracing::info!(job_id, "killing job: the worker shuts down");
            let _ = tokio::task::spawn_blocking(move || handle.kill_tree()).await;
        }
        let drained =
            tokio::time::timeout(SHUTDOWN_DRAIN, async { while self.tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            tracing::warn!("some job tasks did not finish within {SHUTDOWN_DRAIN:?}");
            self.tasks.abort_all();
        }
        let flushed =
            tokio::time::timeout(SHUTDOWN_REPORT_FLUSH, async { while self.reports.join_next().await.is_some() {} })
                .await;
        if flushed.is_err() {
            tracing::warn!(
                pending = self.reports.len(),
                "no leader took the last reports within {SHUTDOWN_REPORT_FLUSH:?}: the leader settles these jobs when this node registers again"
            );
            self.reports.abort_all();
        }
        self.daemons.abort_all();
        if let Some(guard) = self.guard.take() {
            let _ = tokio::task::spawn_blocking(move || guard.stop()).await;
        }
    }
}

fn log_panic(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        if e.is_panic() {
            tracing::error!(error = %e, "a worker task panicked");
        }
    }
}

fn ended(epoch: u64, report: JobExitReport) -> LocalJob {
    LocalJob {
        epoch,
        phase: Phase::Ended { report },
        start: Delivery::Skipped,
        exit: Delivery::Pending,
        signals_sent: 0,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}

/// A job's time limit, and the signal it asked for some time before it (`--signal SIG@DUR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimeLimit {
    pub limit: Option<Duration>,
    /// (when after the start, signal)
    pub warning: Option<(Duration, i32)>,
}

impl TimeLimit {
    pub(crate) fn of(job: &Job) -> TimeLimit {
        let limit = job.spec.time_limit_secs.map(Duration::from_secs);
        let sched = &job.spec.sched;
        let warning = match (limit, sched.signal_before_end_secs, sched.checkpoint_signal) {
            (Some(limit), Some(before), Some(signal)) => {
                Some((limit.saturating_sub(Duration::from_secs(u64::from(before))), signal))
            }
            _ => None,
        };
        TimeLimit { limit, warning }
    }
}

async fn sleep_for(duration: Option<Duration>) {
    match duration {
        Some(t) => tokio::time::sleep(t).await,
        None => std::future::pending().await,
    }
}

/// Waits for a job process (signalling it before its time limit if it asked, killing it at the
/// limit), checks its GPUs, frees its MIG instance and reports the exit to the runtime.
#[allow(clippy::too_many_arguments)]
async fn run_job(
    shared: Arc<WorkerShared>,
    events: mpsc::UnboundedSender<Event>,
    job_id: JobId,
    epoch: u64,
    mut running: RunningJob,
    time_limit: TimeLimit,
    gpus: Vec<u32>,
    mig: Option<MigPick>,
) {
    let handle = running.handle();
    let mut timed_out = false;
    let exit = {
        let wait = running.wait();
        tokio::pin!(wait);
        let limit = sleep_for(time_limit.limit);
        tokio::pin!(limit);
        let mut warning = time_limit.warning;
        loop {
            let warn = sleep_for(warning.map(|(at, _)| at));
            tokio::select! {
                exit = &mut wait => break exit,
                _ = warn => {
                    if let Some((_, signal)) = warning.take() {
                        tracing::info!(job_id, signal, "time limit near: sending the job its signal");
                        let handle = handle.clone();
                        let _ = tokio::task::spawn_blocking(move || {
                            match Signal::try_from(signal) {
                                Ok(signal) => {
                                    if let Err(e) = handle.signal_tree(signal) {
                                        tracing::warn!(job_id, error = %e, "signal failed");
                                    }
                                }
                                Err(_) => tracing::warn!(job_id, signal, "not a signal: ignored"),
                            }
                        })
                        .await;
                    }
                }
                _ = &mut limit => {
                tracing::info!(job_id, "time limit reached: killing job");
                timed_out = true;
                let handle = handle.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    if let Err(e) = handle.kill_tree() {
                        tracing::warn!(job_id, error = %e, "kill failed");
                    }
                })
                .await;
                    break wait.await;
                }
            }
        }
    };
    tracing::info!(job_id, epoch, code = ?exit.exit_code, signal = ?exit.signal, oom = exit.oom_killed, "job exited");
    let created = mig.as_ref().is_some_and(|m| m.created);
    shared.mark_exited(job_id, epoch, created);
    let _ = events.send(Event::ProcessGone { job_id, epoch });
    // The job's cgroup is empty now (wait drained it): its GPUs must be clean too.
    if shared.check_hygiene(job_id, epoch, &gpus).await {
        shared.heartbeat_now().await;
    }
    if let (Some(MigPick { uuid, created: true }), Some(&gpu)) = (mig, gpus.first()) {
        let cleanup = Arc::clone(&shared);
        let _ = tokio::task::spawn_blocking(move || cleanup.destroy_mig_instance(gpu, uuid)).await;
    }
    shared.remove_running(job_id, epoch);
    let report = JobExitReport {
        exit_code: exit.exit_code,
        signal: exit.signal,
        oom_killed: exit.oom_killed,
        run_time_ms: exit.run_time.as_millis() as u64,
        timed_out,
        ..Default::default()
    };
    let _ = events.send(Event::Exited { job_id, epoch, report });
}

/// Stops one job: `signal` first if any (SIGTERM then follows half-way through the grace
/// period), else SIGTERM at once; SIGKILL to the whole tree when the grace period is over.
async fn stop(
    shared: Arc<WorkerShared>,
    job_id: JobId,
    epoch: u64,
    handle: crate::executor::JobHandle,
    grace: Duration,
    signal: Option<i32>,
) {
    let checkpoint = signal.and_then(|s| Signal::try_from(s).ok());
    if let Err(e) = handle.signal_tree(checkpoint.unwrap_or(Signal::SIGTERM)) {
        tracing::warn!(job_id, error = %e, "signal failed");
    }
    if checkpoint.is_some() {
        tokio::time::sleep(grace / 2).await;
        if shared.runs(job_id, epoch) {
            if let Err(e) = handle.signal_tree(Signal::SIGTERM) {
                tracing::warn!(job_id, error = %e, "SIGTERM failed");
            }
        }
        tokio::time::sleep(grace - grace / 2).await;
    } else {
        tokio::time::sleep(grace).await;
    }
    if shared.runs(job_id, epoch) {
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = handle.kill_tree() {
                tracing::warn!(job_id, error = %e, "kill failed");
            }
        })
        .await;
    }
}

enum Report {
    Start(pb::ReportStartedRequest),
    Exit(pb::ReportFinishedRequest),
}

/// Sends a report until a leader accepts or rejects it.
async fn deliver(
    shared: Arc<WorkerShared>,
    events: mpsc::UnboundedSender<Event>,
    job_id: JobId,
    epoch: u64,
    report: Report,
) {
    let mut backoff = Duration::from_millis(50);
    let mut failures = 0u32;
    loop {
        let (kind, answer) = match &report {
            Report::Start(req) => (ReportKind::Start, shared.gateway.report_started(req.clone()).await),
            Report::Exit(req) => (ReportKind::Exit, shared.gateway.report_finished(req.clone()).await),
        };
        match answer {
            Ok(reply) => {
                if !reply.accepted {
                    tracing::info!(job_id, epoch, ?kind, "report was for a stale placement: ignored by the leader");
                }
                let _ = events.send(Event::Reported { job_id, epoch, kind, revision: reply.revision });
                return;
            }
            Err(e) => {
                failures += 1;
                if failures == 1 || failures.is_multiple_of(10) {
                    tracing::warn!(job_id, epoch, ?kind, attempts = failures, error = %e, "cannot report to a leader yet; retrying");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Registers (again) until a leader answers.
async fn register(shared: Arc<WorkerShared>, events: mpsc::UnboundedSender<Event>) {
    let spec = shared.node_spec();
    let mut backoff = Duration::from_millis(100);
    loop {
        let sent_at = Instant::now();
        match shared.gateway.register(pb::RegisterRequest { spec: Some((&spec).into()) }).await {
            Ok(reply) => {
                tracing::info!(node = %spec.name, epoch = reply.node_epoch, gpus = spec.gpus.len(),
                    backend = shared.gpus().name(), "registered with the leader");
                let terms = Terms::of(reply.lease);
                let _ = events.send(Event::Registered { node_epoch: reply.node_epoch, sent_at, terms });
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "registration failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Sends a heartbeat every interval (or when woken) while registered: GPU health for the
/// scheduler, liveness for the leader, and the lease for this worker.
async fn heartbeats(shared: Arc<WorkerShared>, events: mpsc::UnboundedSender<Event>) {
    let mut failures = 0u32;
    loop {
        let node_epoch = shared.node_epoch.load(Ordering::SeqCst);
        if node_epoch != 0 {
            let id = shared.heartbeats_started.fetch_add(1, Ordering::SeqCst) + 1;
            let sent_at = Instant::now();
            let request = heartbeat_request(&shared, node_epoch).await;
            match shared.gateway.heartbeat(request).await {
                Ok(reply) => {
                    failures = 0;
                    *shared.last_heartbeat_ok.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                    shared.heartbeat_accepted.fetch_max(id, Ordering::SeqCst);
                    shared.heartbeat_sent.notify_waiters();
                    if shared.leader_term.fetch_max(reply.term, Ordering::SeqCst) < reply.term {
                        shared.watch_reset.notify_one();
                    }
                    let terms = Terms::of(reply.lease);
                    let reregister = reply.reregister;
                    let _ = events.send(Event::Answered { node_epoch, sent_at, terms, reregister });
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(20) {
                        tracing::warn!(error = %e, failures, "heartbeat failed");
                    }
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(shared.config().heartbeat_interval) => {}
            _ = shared.wake_heartbeat.notified() => {}
        }
    }
}

/// The GPU health and hygiene a heartbeat carries (also kept for the metrics).
async fn heartbeat_request(shared: &WorkerShared, node_epoch: u64) -> pb::HeartbeatRequest {
    let readings = shared.read_gpus().await;
    if shared.hygiene.recheck_due() {
        shared.hygiene.recheck(&readings);
    }
    let gpus = {
        let leaks = shared.hygiene.leaks();
        let mut health = shared.health.lock().unwrap_or_else(|p| p.into_inner());
        health.update(&readings);
        readings
            .iter()
            .map(|r| {
                let leak = leaks.iter().find(|l| l.finding.gpu == r.index);
                let gpu = GpuHealth {
                    problems: health.problems(r.index).to_vec(),
                    dirty_reason: leak.map(|l| l.finding.reason.clone()).unwrap_or_default(),
                    dirty_job_id: leak.and_then(|l| l.job_id),
                    ..r.to_health(shared.hygiene.is_dirty(r.index))
                };
                pb::GpuHealth::from(&gpu)
            })
            .collect()
    };
    *shared.last_readings.lock().unwrap_or_else(|p| p.into_inner()) = readings;
    pb::HeartbeatRequest { node: shared.config().node_name.clone(), node_epoch, gpus }
}

/// Keeps a desired-state stream open to the leader for the current registration and forwards
/// what it pushes; reconnects when it ends, stays silent, or a heartbeat met a newer leader.
async fn watch_desired(shared: Arc<WorkerShared>, events: mpsc::UnboundedSender<Event>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let node_epoch = shared.node_epoch.load(Ordering::SeqCst);
        if node_epoch == 0 {
            let _ = tokio::time::timeout(Duration::from_millis(200), shared.watch_reset.notified()).await;
            continue;
        }
        let request = pb::WatchDesiredRequest { node: shared.config().node_name.clone(), node_epoch };
        let mut stream = match shared.gateway.watch_desired(request).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "cannot watch the desired state yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        let mut term = 0;
        loop {
            tokio::select! {
                message = tokio::time::timeout(WATCH_SILENCE, stream.message()) => match message {
                    Ok(Ok(Some(state))) => {
                        backoff = Duration::from_millis(50);
                        term = state.term;
                        let reregister = state.reregister;
                        match desired_of(state) {
                            Ok(desired) => {
                                let _ = events.send(Event::Desired { node_epoch, desired, reregister });
                            }
                            Err(e) => tracing::warn!(error = %e, "malformed desired state: ignored"),
                        }
                        if reregister {
                            break;
                        }
                    }
                    Ok(Ok(None)) | Ok(Err(_)) => break,
                    Err(_) => {
                        tracing::warn!("the desired-state stream went silent: reconnecting");
                        break;
                    }
                },
                _ = shared.watch_reset.notified() => {
                    let epoch_changed = shared.node_epoch.load(Ordering::SeqCst) != node_epoch;
                    if epoch_changed || shared.leader_term.load(Ordering::SeqCst) > term {
                        break;
                    }
                }
            }
        }
    }
}

/// The runtime's view of a pushed desired state.
fn desired_of(state: pb::DesiredState) -> Result<Desired, corral_proto::ProtoError> {
    let mut jobs = BTreeMap::new();
    for d in state.jobs {
        let job = Job::try_from(d.job.ok_or(corral_proto::ProtoError::Missing("job"))?)?;
        let epoch = job.allocation.as_ref().map_or(0, |a| a.epoch);
        let want = match pb::DesiredAction::try_from(d.action) {
            Ok(pb::DesiredAction::Stop) => Want::Stop {
                grace: (d.grace_secs > 0).then(|| Duration::from_secs(u64::from(d.grace_secs))),
                signal: d.checkpoint_signal,
            },
            _ => Want::Run,
        };
        let addrs = crate::PartAddrs { master_addr: d.master_addr, part_addrs: d.part_addrs };
        jobs.insert(job.id, DesiredJob { job: Arc::new(job), epoch, want, addrs });
    }
    Ok(Desired { revision: state.revision, jobs })
}
