//! The worker's runtime: one task owns the book-keeping (`state.rs`: registration, lease,
//! `reconcile::Local`), asks `reconcile` what to do and carries it out. Everything that waits
//! runs in tasks that report back as events: the link's (`link.rs`: registration, heartbeats,
//! the desired-state stream, report deliveries) and each run's (`pull.rs`: its image before
//! the launch; `task.rs`: its process, its stop). Job and stop tasks live in a `JoinSet` that shutdown drains, report deliveries in one
//! that shutdown flushes for a few seconds only, and blocking cgroup kills run on the blocking
//! pool. The lease is explained in `state.rs`; the fence guard (`fence.rs`) enforces it.

mod pull;
mod state;
mod task;
mod tasks;

use crate::config::WorkerConfig;
use crate::devices::Devices;
use crate::executor::{Executor, LaunchSpec, RunningJob, DEFAULT_PATH, LEASE_ENDED};
use crate::fence::FenceGuard;
use crate::jobs::{JobTable, RunInfo, StartedRun};
use crate::launch::{launch_spec, pick_mig_instance, MigPick, Prepared};
use crate::link::{self, Link, Report};
use crate::reconcile::Action;
use corral_image::{Images, PullProgress};
use corral_types::{Job, JobId, StepId};
use nix::sys::signal::Signal;
use state::{steps, Event, RuntimeState, Step};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use task::{Owners, TimeLimit};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// How long a start report is held after the launch: a job that ends within it reports only
/// its exit.
const START_REPORT_HOLD: Duration = Duration::from_millis(50);
/// How long shutdown waits for killed jobs to be reaped.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(30);
/// How long shutdown then keeps trying to deliver pending reports. What is not delivered is not
/// lost for the cluster: the worker registers again with a new epoch when it comes back, and the
/// leader requeues whatever the old epoch still held.
const SHUTDOWN_REPORT_FLUSH: Duration = Duration::from_secs(3);

/// A run whose image is being pulled.
struct Pull {
    epoch: u64,
    task: tokio::task::AbortHandle,
    /// Keeps the pull's progress in the heartbeats while the pull is under way.
    _shown: crate::link::PullShown,
}

/// This node's part of an image gang, its image ready here, waiting until every part's is.
struct ReadyPart {
    epoch: u64,
    prepared: Prepared,
    /// Telling the leader it is ready, until one answered.
    report: tokio::task::AbortHandle,
}

pub(crate) struct Runtime {
    config: Arc<WorkerConfig>,
    executor: Arc<dyn Executor>,
    /// The node's image store; `None`: registry images are refused at launch.
    images: Option<Images>,
    pulls: HashMap<JobId, Pull>,
    /// Image gang parts ready here that wait for the other parts (`Allocation::ready`).
    gang_ready: HashMap<JobId, ReadyPart>,
    owners: Owners,
    state: RuntimeState,
    guard: Option<FenceGuard>,
    events: mpsc::UnboundedSender<Event>,
    inbox: mpsc::UnboundedReceiver<Event>,
    /// Job processes and stops: drained at shutdown.
    tasks: JoinSet<()>,
    /// Report deliveries: given a short flush at shutdown (a coordinator may be gone for good).
    reports: JoinSet<()>,
    /// Heartbeats, the desired-state stream and registration: aborted at shutdown.
    daemons: JoinSet<()>,
    /// Orders to the waiters of this node's tasks of each step that runs.
    step_orders: BTreeMap<(JobId, u64, StepId), mpsc::UnboundedSender<tasks::Order>>,
    /// The latest desired state, for the in-job service (`srun` follows its step there).
    desired: tokio::sync::watch::Sender<crate::reconcile::Desired>,
}

impl Runtime {
    pub(crate) fn new(
        config: Arc<WorkerConfig>,
        executor: Arc<dyn Executor>,
        images: Option<Images>,
        jobs: Arc<JobTable>,
        devices: Arc<Devices>,
        link: Arc<Link>,
        desired: tokio::sync::watch::Sender<crate::reconcile::Desired>,
    ) -> Runtime {
        let (events, inbox) = mpsc::unbounded_channel();
        Runtime {
            config,
            executor,
            images,
            pulls: HashMap::new(),
            gang_ready: HashMap::new(),
            owners: Owners { jobs, devices, link, desired: desired.subscribe() },
            state: RuntimeState::new(),
            guard: None,
            events,
            inbox,
            tasks: JoinSet::new(),
            reports: JoinSet::new(),
            daemons: JoinSet::new(),
            step_orders: BTreeMap::new(),
            desired,
        }
    }

    pub(crate) async fn run(mut self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        self.guard = match self.config.fence_guard.clone() {
            Some(command) => {
                Some(FenceGuard::start(command).map_err(|e| anyhow::anyhow!("cannot start the fence guard: {e}"))?)
            }
            None => {
                tracing::warn!("no fence guard: jobs of this worker keep running if it freezes or dies");
                None
            }
        };
        let Owners { jobs, devices, link, .. } = self.owners.clone();
        self.daemons.spawn(link::heartbeats(link.clone(), devices, jobs, self.events.clone()));
        self.daemons.spawn(link::watch_desired(link, self.events.clone()));
        self.register();
        tokio::pin!(shutdown);
        loop {
            let lease_check = self.state.lease_deadline();
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
            self.state.check_lease(Instant::now());
            match event {
                Some(Event::Pulled { job_id, epoch, outcome }) => self.pulled(job_id, epoch, *outcome),
                Some(event) => {
                    let is_desired = matches!(event, Event::Link(link::LinkEvent::Desired { .. }));
                    self.handle(event);
                    if is_desired {
                        let desired = self.state.desired().clone();
                        self.desired.send_replace(desired);
                    }
                }
                None => {}
            }
            self.converge();
            if self.start_ready_gangs() {
                self.converge();
            }
            self.owners.link.set_serving(self.state.leased());
        }
        self.shutdown().await;
        Ok(())
    }

    fn handle(&mut self, event: Event) {
        let follow_up = self.state.handle(event, Instant::now());
        if let (Some(guard), Some(deadline)) = (&mut self.guard, follow_up.guard_deadline) {
            guard.renew(deadline);
        }
        if let Some(node_epoch) = follow_up.registered {
            self.owners.link.registered(node_epoch);
        }
    }

    /// Reconciles and acts until nothing is left to do.
    fn converge(&mut self) {
        for _ in 0..8 {
            let actions = self.state.actions(self.config.kill_grace);
            if actions.is_empty() {
                return;
            }
            for step in steps(actions) {
                match step {
                    Step::Launches(jobs) => self.launch_all(jobs),
                    Step::Act(action) => self.act(action),
                }
            }
        }
        tracing::warn!("reconcile did not settle in 8 rounds; continuing at the next event");
    }

    /// Launches whole-GPU jobs, their cgroup set-up and fork/exec in parallel.
    fn launch_all(&mut self, jobs: Vec<(Arc<Job>, u64)>) {
        // Registry images are pulled first, each in a task of its own.
        let (pulled, jobs): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|(job, _)| job.spec.image_digest.is_some());
        for (job, epoch) in pulled {
            self.launch(&job, epoch);
        }
        if jobs.len() <= 1 {
            for (job, epoch) in jobs {
                self.launch(&job, epoch);
            }
            return;
        }
        let mut prepared = Vec::new();
        for (job, epoch) in jobs {
            let Some(gpus) = self.begin_launch(&job, epoch) else { continue };
            let addrs = self.state.part_addrs(job.id, epoch);
            let spec = launch_spec(&self.config, &self.owners.devices, &job, epoch, &gpus, None, &addrs, None)
                .map(|spec| self.with_run_secret(spec));
            prepared.push((job, epoch, gpus, spec));
        }
        let executor = &self.executor;
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
            self.launched(&job, epoch, gpus, result.map(|running| (running, None)), None);
        }
    }

    fn act(&mut self, action: Action) {
        self.state.record(&action);
        match action {
            Action::Launch { job, epoch } => self.launch(&job, epoch),
            Action::NeverStarted { job_id, epoch } => {
                if let Some(pull) = self.pulls.remove(&job_id) {
                    // Dropping the pull drops its pin; layers other pulls wait on go on.
                    pull.task.abort();
                    tracing::info!(job_id, epoch = pull.epoch, "image pull abandoned");
                }
                tracing::info!(job_id, epoch, "stopped before it was launched: reporting it never started");
            }
            Action::Stop { job_id, epoch, grace, signal, cause } => {
                if let Some(handle) = self.owners.jobs.handle(job_id, epoch) {
                    tracing::info!(job_id, epoch, ?cause, grace_ms = grace.as_millis() as u64, signal, "stopping job");
                    self.tasks.spawn(task::stop(self.owners.jobs.clone(), job_id, epoch, handle, grace, signal));
                }
            }
            Action::ReportStarted { job_id, epoch } => self.deliver(job_id, epoch, Report::Started),
            Action::ReportFinished { job_id, epoch, report } => self.deliver(job_id, epoch, Report::Finished(report)),
            Action::Forget { .. } => {}
            Action::Signal { job_id, epoch, signals, .. } => {
                if let Some(handle) = self.owners.jobs.handle(job_id, epoch) {
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
                self.owners.link.unregistered();
                self.register();
            }
            Action::LaunchTasks { job, epoch, step } => self.launch_tasks(&job, epoch, step),
            Action::SkipTasks { job_id, epoch, step } => {
                tracing::info!(job_id, epoch, step, "step stopped before its tasks launched here");
            }
            Action::KillTasks { job_id, epoch, step } => {
                if let Some(orders) = self.step_orders.get(&(job_id, epoch, step)) {
                    tracing::info!(job_id, epoch, step, "the step is stopping: killing its tasks here");
                    let _ = orders.send(tasks::Order::Kill { grace: self.config.kill_grace });
                }
            }
            Action::StartWait { job_id, epoch, step } => {
                if let Some(orders) = self.step_orders.get(&(job_id, epoch, step)) {
                    tracing::info!(job_id, epoch, step, "a task of the step ended on another node: --wait starts here");
                    let _ = orders.send(tasks::Order::StartWait);
                }
            }
            Action::SignalTasks { job_id, epoch, step, signals, .. } => {
                if let Some(orders) = self.step_orders.get(&(job_id, epoch, step)) {
                    for signal in signals {
                        let _ = orders.send(tasks::Order::Signal(signal));
                    }
                }
            }
            Action::ReportStepEnded { job_id, epoch, step, end } => {
                self.step_orders.remove(&(job_id, epoch, step));
                if let Some(info) = self.owners.jobs.info(job_id, epoch) {
                    // Before the report: once the step has ended, readers of its output here
                    // stop after what its tasks wrote.
                    mark_step_done(&info.work_dir, step);
                }
                let link = self.owners.link.clone();
                self.reports.spawn(link::deliver_step_end(link, self.events.clone(), job_id, epoch, step, end));
            }
            Action::ForgetStep { .. } => {}
        }
    }

    /// Mints the run's in-job secret into its environment (with where the in-job service
    /// listens) and records what its step tasks inherit. The secret is never logged.
    fn with_run_secret(&self, mut spec: LaunchSpec) -> LaunchSpec {
        spec.not_after = Some(self.state.launch_deadline());
        let secret = crate::in_job::mint_secret();
        spec.env.insert(crate::in_job::SECRET_ENV.into(), secret.clone());
        // A container sees its work dir, and the in-job socket, at their own places.
        let in_container = spec.image.is_some();
        let (socket, home) = if in_container {
            (crate::in_job_bin::CONTAINER_SOCKET.into(), std::path::PathBuf::from(crate::executor::CONTAINER_WORK_DIR))
        } else {
            (self.config.in_job_socket().display().to_string(), spec.work_dir.clone())
        };
        spec.env.insert(crate::in_job::SOCKET_ENV.into(), socket);
        let mut env = BTreeMap::from([
            ("PATH".to_owned(), DEFAULT_PATH.to_owned()),
            ("HOME".to_owned(), home.display().to_string()),
            ("LANG".to_owned(), "C".to_owned()),
        ]);
        env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let info = RunInfo {
            secret,
            env,
            cwd: spec.files.cwd.clone().unwrap_or(home),
            work_dir: spec.work_dir.clone(),
            uid: spec.uid,
            gid: spec.gid,
            open_files: spec.limits.open_files,
            in_container,
        };
        self.owners.jobs.set_info(spec.job_id, spec.attempt, info);
        spec
    }

    /// Launches this node's tasks of `step` of run `epoch` into the run's cgroup, and the task
    /// that waits for them and reports their end. A failure ends them with the launch error.
    fn launch_tasks(&mut self, job: &Job, epoch: u64, step_id: StepId) {
        let node = self.config.node_name.clone();
        let started = tasks::start(&self.owners.jobs, job, epoch, step_id, &node, &self.config.in_job_bin_dir());
        match started {
            Ok(started) => {
                let (orders, inbox) = mpsc::unbounded_channel();
                self.step_orders.insert((job.id, epoch, step_id), orders);
                self.tasks.spawn(tasks::wait(started, inbox, self.events.clone(), self.config.kill_grace));
            }
            Err(end) => {
                tracing::warn!(job_id = job.id, epoch, step = step_id, error = ?end.launch_error, "cannot launch the step's tasks");
                let _ = self.events.send(Event::TasksEnded { job_id: job.id, epoch, step: step_id, end });
            }
        }
    }

    fn register(&mut self) {
        let Owners { devices, link, .. } = self.owners.clone();
        self.daemons.spawn(link::register(link, devices, self.events.clone()));
    }

    fn deliver(&mut self, job_id: u64, epoch: u64, report: Report) {
        let link = self.owners.link.clone();
        self.reports.spawn(link::deliver(link, self.events.clone(), job_id, epoch, report));
    }

    /// Starts allocation `epoch` of `job`: its image pulled first when it is a registry
    /// reference (`pull.rs`), then its MIG instance, the process in its cgroup, and the task
    /// that waits for it. A failure is recorded as an ended run with the launch error.
    fn launch(&mut self, job: &Arc<Job>, epoch: u64) {
        if job.spec.image_digest.is_none() {
            return self.launch_prepared(job, epoch, None);
        }
        let node = &self.config.node_name;
        let Some(images) = self.images.clone() else {
            let error = format!("node {node}: this worker has no image store: it runs no registry images");
            return self.state.launch_failed(job.id, epoch, error);
        };
        if let Err(e) = pull::pinned_reference(job) {
            return self.state.launch_failed(job.id, epoch, format!("node {node}: {e}"));
        }
        // A mount this node refuses fails the run before anything is fetched.
        if let Err(e) = crate::launch::checked_mounts(&self.config, job) {
            return self.state.launch_failed(job.id, epoch, format!("node {node}: {e}"));
        }
        tracing::info!(job_id = job.id, epoch, image = ?job.spec.image, digest = ?job.spec.image_digest, "pulling the job's image");
        self.state.pulling(job.id, epoch);
        let progress = PullProgress::new();
        let image = job.spec.image.clone().unwrap_or_default();
        let shown = self.owners.link.show_pull(job.id, epoch, image, progress.clone());
        let task = self.tasks.spawn(pull::run(images, job.clone(), epoch, progress, self.events.clone()));
        if let Some(old) = self.pulls.insert(job.id, Pull { epoch, task, _shown: shown }) {
            old.task.abort();
        }
    }

    /// A pull ended: launch from what it prepared while the run still wants it; a failure
    /// that another node would share (not found, unauthorized, a bad layer) ends the run with
    /// it, any other is reported as a run that did not start here, which the leader requeues.
    fn pulled(&mut self, job_id: JobId, epoch: u64, outcome: state::Outcome) {
        if self.pulls.get(&job_id).is_some_and(|p| p.epoch == epoch) {
            self.pulls.remove(&job_id);
        }
        let job = self.state.desired_job(job_id, epoch);
        let (true, Some(job)) = (self.state.still_pulling(job_id, epoch), job) else {
            if let Ok(prepared) = outcome {
                pull::remove_root(prepared.root);
            }
            return;
        };
        let node = &self.config.node_name;
        match outcome {
            Ok(prepared) if job.allocation.as_ref().is_some_and(|a| a.is_gang()) => {
                // A gang starts together: this part waits until every part has its image.
                tracing::info!(job_id, epoch, root = %prepared.root.path().display(), "image ready: waiting for every part of the gang");
                let report = self.reports.spawn(link::deliver_part_ready(self.owners.link.clone(), job_id, epoch));
                if let Some(old) = self.gang_ready.insert(job_id, ReadyPart { epoch, prepared, report }) {
                    old.report.abort();
                    pull::remove_root(old.prepared.root);
                }
            }
            Ok(prepared) => {
                tracing::info!(job_id, epoch, root = %prepared.root.path().display(), "image ready");
                self.launch_prepared(&job, epoch, Some(prepared));
            }
            Err(e) if e.is_permanent() => {
                tracing::warn!(job_id, epoch, error = %e, "image pull failed");
                self.state.launch_failed(job_id, epoch, format!("node {node}: {e}"));
            }
            Err(e) => {
                tracing::warn!(job_id, epoch, error = %e, "image pull failed here: the run goes back to the queue");
                self.state.not_started(job_id, epoch);
            }
        }
    }

    /// Starts the image gang parts waiting here whose every part is ready, as the desired state
    /// says; drops (unmounts) those whose run was abandoned. Returns whether one started.
    fn start_ready_gangs(&mut self) -> bool {
        let mut started = false;
        let waiting: Vec<(JobId, u64)> = self.gang_ready.iter().map(|(id, part)| (*id, part.epoch)).collect();
        for (job_id, epoch) in waiting {
            let job = self.state.desired_running(job_id, epoch).filter(|_| self.state.still_pulling(job_id, epoch));
            let Some(job) = job else {
                if let Some(part) = self.gang_ready.remove(&job_id) {
                    tracing::info!(job_id, epoch, "the gang's run was abandoned before every part was ready");
                    part.report.abort();
                    pull::remove_root(part.prepared.root);
                }
                continue;
            };
            if job.allocation.as_ref().is_some_and(|a| a.all_ready()) {
                if let Some(part) = self.gang_ready.remove(&job_id) {
                    tracing::info!(job_id, epoch, "every part of the gang has its image: starting");
                    self.launch_prepared(&job, epoch, Some(part.prepared));
                    started = true;
                }
            }
        }
        started
    }

    fn launch_prepared(&mut self, job: &Job, epoch: u64, image: Option<Prepared>) {
        let Some(gpus) = self.begin_launch(job, epoch) else {
            if let Some(image) = image {
                pull::remove_root(image.root);
            }
            return;
        };
        let devices = &self.owners.devices;
        let taken = self.owners.jobs.taken_mig_instances();
        let launched = pick_mig_instance(devices, self.config.mig_manage, job, &gpus, &taken).and_then(|mig| {
            let mig_uuid = mig.as_ref().map(|m| m.uuid.as_str());
            let addrs = self.state.part_addrs(job.id, epoch);
            let spec = launch_spec(&self.config, devices, job, epoch, &gpus, mig_uuid, &addrs, image.as_ref())
                .map(|s| self.with_run_secret(s));
            match spec.and_then(|spec| self.executor.launch(&spec).map_err(|e| e.to_string())) {
                Ok(running) => Ok((running, mig)),
                Err(e) => {
                    if let (Some(MigPick { uuid, created: true }), Some(&gpu)) = (mig, gpus.first()) {
                        devices.destroy_mig_instance(gpu, &uuid);
                    }
                    Err(e)
                }
            }
        });
        let root = image.map(|i| i.root);
        match (&launched, root) {
            (Ok(_), root) => self.launched(job, epoch, gpus, launched, root),
            (Err(_), Some(root)) => {
                pull::remove_root(root);
                self.launched(job, epoch, gpus, launched, None)
            }
            (Err(_), None) => self.launched(job, epoch, gpus, launched, None),
        }
    }

    /// The GPUs of `job` on this node, with the run marked as launching; None (logged) when the
    /// desired state names a job with no part here.
    fn begin_launch(&self, job: &Job, epoch: u64) -> Option<Vec<u32>> {
        let node = &self.config.node_name;
        let Some(gpus) = job.allocation.as_ref().and_then(|a| a.gpus_on(node)).map(<[u32]>::to_vec) else {
            tracing::warn!(job_id = job.id, epoch, "desired state names a job with no part on this node");
            return None;
        };
        self.owners.jobs.launching(job.id, epoch);
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
        root: Option<corral_image::JobRoot>,
    ) {
        let job_id = job.id;
        let (running, mig) = match launched {
            Ok(launched) => launched,
            Err(error) if error == LEASE_ENDED => {
                // Stopped (frozen, stalled) between deciding to launch and the exec: the leader
                // may have given the run to another node meanwhile. It never started here.
                self.owners.jobs.launch_failed(job_id, epoch);
                tracing::warn!(job_id, epoch, "not started: this worker's lease ran out before the exec");
                self.state.not_started(job_id, epoch);
                return;
            }
            Err(error) => {
                self.owners.jobs.launch_failed(job_id, epoch);
                tracing::warn!(job_id, epoch, error = %error, "launch failed");
                // The user reads it in `corral show`: say where it failed.
                self.state.launch_failed(job_id, epoch, format!("node {}: {error}", self.config.node_name));
                return;
            }
        };
        tracing::info!(job_id, epoch, pid = running.pid(), gpus = ?gpus, image = ?job.spec.image, "job started");
        let process = StartedRun {
            tenant: job.spec.tenant.clone(),
            gpus: gpus.clone(),
            handle: running.handle(),
            mig_uuid: mig.as_ref().map(|m| m.uuid.clone()),
        };
        self.owners.jobs.started(job_id, epoch, process);
        self.state.launched(job, epoch);
        let events = self.events.clone();
        tokio::spawn(async move {
            tokio::time::sleep(START_REPORT_HOLD).await;
            let _ = events.send(Event::StartDue { job_id, epoch });
        });
        let idle = task::IdleRule::of(job, &gpus);
        let run = task::Launched { job_id, epoch, running, time_limit: TimeLimit::of(job), idle, gpus, mig, root };
        self.tasks.spawn(task::run_job(self.owners.clone(), self.events.clone(), run));
    }

    /// Kills every job, waits for the job tasks, stops the guard.
    async fn shutdown(mut self) {
        for (_, pull) in self.pulls.drain() {
            pull.task.abort();
        }
        for (job_id, handle) in self.owners.jobs.running_handles() {
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

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}

/// Marks this node's tasks of `step` gone in the run's directory (`executor::step_done_marker`);
/// made again harmlessly when the report is retried.
fn mark_step_done(work_dir: &std::path::Path, step: StepId) {
    use std::os::unix::fs::OpenOptionsExt;
    let path = crate::executor::step_done_marker(work_dir, step);
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path);
    if let Err(e) = made {
        tracing::warn!(path = %path.display(), error = %e, "cannot mark the step's tasks gone: readers of their output wait for the job's end");
    }
}
