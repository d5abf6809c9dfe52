//! The link to the leader: this worker's registration (its node epoch), the highest leader term
//! heard, the heartbeats that renew its lease and carry GPU health, the desired-state stream and
//! the delivery of job reports. `Link` holds what these share (one `Mutex<State>` and the
//! `Notify`s that wake its tasks, behind methods); the tasks (`register`, `heartbeats`,
//! `watch_desired`, `deliver`) talk to coordinators through `corral_client::GatewayClient` only
//! and tell the runtime what the leaders answered as `LinkEvent`s. What to make of an answer
//! (the lease, registering again) is the runtime's.

use crate::devices::Devices;
use crate::jobs::JobTable;
use crate::reconcile::{Desired, DesiredJob, Want};
use corral_client::GatewayClient;
use corral_proto::v1::{self as pb};
use corral_types::{Job, JobExitReport, JobId, NodeSpec, StepId, StepNodeEnd};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch, Notify};

/// A desired-state stream silent for this long is dead (the leader resends every 2 s).
const WATCH_SILENCE: Duration = Duration::from_secs(6);
/// Longest pause between two attempts of a report, a registration or a stream.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The lease terms a leader grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Terms {
    pub node_ttl: Duration,
    pub fence_after: Duration,
}

impl Terms {
    /// The terms of a leader's answer: a TTL of at least 1 ms, and a fence time within it.
    pub(crate) fn of(lease: Option<pb::Lease>) -> Terms {
        let lease = lease.unwrap_or_default();
        let node_ttl = Duration::from_millis(lease.node_ttl_ms.max(1));
        let fence_after = Duration::from_millis(lease.fence_after_ms).min(node_ttl);
        Terms { node_ttl, fence_after }
    }

    /// When the guard kills: halfway between the worker's own fence time and the node TTL.
    pub(crate) fn guard_after(&self) -> Duration {
        self.fence_after + (self.node_ttl.saturating_sub(self.fence_after)) / 2
    }
}

/// Which report of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReportKind {
    Start,
    Exit,
}

/// A report of a run to deliver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Report {
    Started,
    Finished(JobExitReport),
}

/// What the link's tasks tell the runtime.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// A leader registered this node with `node_epoch`, answering a request sent at `sent_at`.
    Registered { node_epoch: u64, sent_at: Instant, terms: Terms },
    /// A leader answered a heartbeat sent at `sent_at`.
    Answered { node_epoch: u64, sent_at: Instant, terms: Terms, reregister: bool },
    /// A leader pushed the desired state of registration `node_epoch`.
    Desired { node_epoch: u64, desired: Desired, reregister: bool },
    /// A leader accepted or rejected a report at applied index `revision`.
    Reported { job_id: JobId, epoch: u64, kind: ReportKind, revision: u64 },
    /// A leader accepted or rejected the end of this node's tasks of a step.
    StepReported { job_id: JobId, epoch: u64, step: StepId, revision: u64 },
}

struct State {
    /// Epoch of the current registration; 0 while (re-)registering.
    node_epoch: u64,
    /// Highest Raft term a leader answered a heartbeat in.
    leader_term: u64,
    /// Number of heartbeats started; each one's id is the count after its start.
    heartbeats_started: u64,
    /// Highest id of a heartbeat a leader answered.
    heartbeat_answered: u64,
    /// When a leader last answered a heartbeat.
    last_answer: Option<Instant>,
}

/// What the link's tasks, the runtime and the metrics share.
pub(crate) struct Link {
    gateway: GatewayClient,
    /// What this node offers, its GPUs left out (they are read at each registration).
    node: NodeSpec,
    heartbeat_interval: Duration,
    state: Mutex<State>,
    /// Wakes the heartbeat task early.
    wake_heartbeat: Notify,
    /// Tells the desired-state stream to check its registration and term.
    watch_reset: Notify,
    /// Signalled at each answered heartbeat.
    heartbeat_answered: Notify,
    /// Registered and leased by a leader: what the health service reports.
    serving: watch::Sender<bool>,
    started: Instant,
    /// When this process stopped the jobs an earlier worker process of the node left running,
    /// until its first registration gets through (the leader bills their runs until then).
    stale_jobs_stopped: Mutex<Option<Instant>>,
    /// Runs whose image is being pulled, reported with each heartbeat (see [`PullShown`]).
    pulls: Mutex<BTreeMap<JobId, ShownPull>>,
    /// Tells one [`PullShown`] from another of the same job.
    pull_tokens: std::sync::atomic::AtomicU64,
    /// The node's image store, whose images every `IMAGES_EVERY`th heartbeat reports.
    images: Mutex<Option<corral_image::Images>>,
}

/// Every this many heartbeats (and the first) carry the images the store holds.
const IMAGES_EVERY: u64 = 10;
/// Images, and layers of each, a heartbeat reports at most (the most recently used first).
const MAX_REPORTED_IMAGES: usize = 64;
const MAX_REPORTED_LAYERS: usize = 256;

/// A pull as heartbeats report it.
struct ShownPull {
    token: u64,
    epoch: u64,
    image: String,
    progress: corral_image::PullProgress,
}

/// Keeps a run's pull in the heartbeats until dropped (the pull ended or was abandoned).
pub(crate) struct PullShown {
    link: Arc<Link>,
    job_id: JobId,
    token: u64,
}

impl Drop for PullShown {
    fn drop(&mut self) {
        let mut pulls = self.link.pulls.lock().unwrap_or_else(|p| p.into_inner());
        if pulls.get(&self.job_id).is_some_and(|p| p.token == self.token) {
            pulls.remove(&self.job_id);
        }
    }
}

impl Link {
    /// The link of node `node` (its `gpus` are filled in at each registration) through
    /// `gateway`, heartbeating every `heartbeat_interval`.
    pub(crate) fn new(gateway: GatewayClient, node: NodeSpec, heartbeat_interval: Duration) -> Link {
        Link {
            // Heartbeats must fail over quickly from a frozen coordinator: well within the fence time.
            gateway: gateway.with_attempt_timeout(heartbeat_interval.max(Duration::from_millis(250)) * 2),
            node,
            heartbeat_interval,
            state: Mutex::new(State {
                node_epoch: 0,
                leader_term: 0,
                heartbeats_started: 0,
                heartbeat_answered: 0,
                last_answer: None,
            }),
            wake_heartbeat: Notify::new(),
            watch_reset: Notify::new(),
            heartbeat_answered: Notify::new(),
            serving: watch::Sender::new(false),
            started: Instant::now(),
            stale_jobs_stopped: Mutex::new(None),
            pulls: Mutex::new(BTreeMap::new()),
            pull_tokens: std::sync::atomic::AtomicU64::new(0),
            images: Mutex::new(None),
        }
    }

    /// The store whose images heartbeats report (for image-aware placement).
    pub(crate) fn report_images(&self, images: corral_image::Images) {
        *self.images.lock().unwrap_or_else(|p| p.into_inner()) = Some(images);
    }

    /// The images of the store, for heartbeat `id`; `None` when this one carries none.
    fn image_reports(&self, id: u64) -> Option<Vec<pb::HeldImage>> {
        if id % IMAGES_EVERY != 1 {
            return None;
        }
        let images = self.images.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
        let mut held = images.store().images();
        held.sort_by_key(|e| std::cmp::Reverse(e.record.last_used_ms));
        let reports = held
            .iter()
            .take(MAX_REPORTED_IMAGES)
            .map(|e| pb::HeldImage {
                digest: e.record.id.to_string(),
                index: e.record.index.as_ref().map(ToString::to_string).unwrap_or_default(),
                layers: e
                    .record
                    .layers
                    .iter()
                    .take(MAX_REPORTED_LAYERS)
                    .map(|l| pb::HeldLayer { digest: l.digest.to_string(), size: l.size })
                    .collect(),
            })
            .collect();
        Some(reports)
    }

    /// Reports allocation `epoch` of `job_id` pulling `image` with each heartbeat while the
    /// returned guard lives.
    pub(crate) fn show_pull(
        self: &Arc<Self>,
        job_id: JobId,
        epoch: u64,
        image: String,
        progress: corral_image::PullProgress,
    ) -> PullShown {
        let token = self.pull_tokens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shown = ShownPull { token, epoch, image, progress };
        self.pulls.lock().unwrap_or_else(|p| p.into_inner()).insert(job_id, shown);
        PullShown { link: self.clone(), job_id, token }
    }

    /// The pulls under way, with their progress now.
    fn pull_reports(&self) -> Vec<pb::PullProgress> {
        let pulls = self.pulls.lock().unwrap_or_else(|p| p.into_inner());
        pulls
            .iter()
            .map(|(&job_id, p)| {
                let now = p.progress.snapshot();
                pb::PullProgress {
                    job_id,
                    epoch: p.epoch,
                    image: p.image.clone(),
                    layers_done: u32::try_from(now.layers_done).unwrap_or(u32::MAX),
                    layers_total: u32::try_from(now.layers_total).unwrap_or(u32::MAX),
                    bytes_done: now.bytes_done,
                    bytes_total: now.bytes_total,
                }
            })
            .collect()
    }

    /// The jobs of earlier worker processes of this node were stopped now: the first
    /// registration says so.
    pub(crate) fn stale_jobs_stopped(&self) {
        *self.stale_jobs_stopped.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Epoch of the current registration; 0 while (re-)registering.
    pub(crate) fn node_epoch(&self) -> u64 {
        self.state().node_epoch
    }

    /// The runtime took registration `node_epoch`: the stream follows it, a heartbeat goes now.
    pub(crate) fn registered(&self, node_epoch: u64) {
        self.state().node_epoch = node_epoch;
        self.watch_reset.notify_one();
        self.wake_heartbeat.notify_one();
    }

    /// The runtime registers again: heartbeats pause and the stream of the old epoch ends.
    pub(crate) fn unregistered(&self) {
        self.state().node_epoch = 0;
        self.watch_reset.notify_one();
    }

    /// Says whether the worker is registered and leased (the health service reports it).
    pub(crate) fn set_serving(&self, serving: bool) {
        self.serving.send_if_modified(|now| std::mem::replace(now, serving) != serving);
    }

    /// Follows `set_serving`.
    pub(crate) fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// Time since a leader last answered a heartbeat (since the worker started, if none did).
    pub(crate) fn heartbeat_age(&self) -> Duration {
        self.state().last_answer.unwrap_or(self.started).elapsed()
    }

    /// Triggers a heartbeat and waits (bounded) until one that started after this call was
    /// answered, so the leader knows about a dirty GPU before it learns the job ended.
    pub(crate) async fn heartbeat_now(&self) {
        let started_before = self.state().heartbeats_started;
        let answered = || self.state().heartbeat_answered > started_before;
        let limit = self.heartbeat_interval * 3 + Duration::from_secs(1);
        let waited = tokio::time::timeout(limit, async {
            while !answered() {
                let signalled = self.heartbeat_answered.notified();
                self.wake_heartbeat.notify_one();
                if answered() {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(100), signalled).await;
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!("no heartbeat got through in time; reporting the job anyway");
        }
    }
}

/// Registers (again) until a leader answers.
pub(crate) async fn register<E: From<LinkEvent>>(
    link: Arc<Link>,
    devices: Arc<Devices>,
    events: mpsc::UnboundedSender<E>,
) {
    let spec = NodeSpec { gpus: devices.offered(), ..link.node.clone() };
    let mut backoff = Duration::from_millis(100);
    loop {
        let sent_at = Instant::now();
        let stopped = *link.stale_jobs_stopped.lock().unwrap_or_else(|p| p.into_inner());
        let stale_jobs_stopped_ms_ago =
            stopped.map(|at| u64::try_from(sent_at.duration_since(at).as_millis()).unwrap_or(u64::MAX));
        let request = pb::RegisterRequest { spec: Some((&spec).into()), stale_jobs_stopped_ms_ago };
        match link.gateway.register(request).await {
            Ok(reply) => {
                // Later registrations of this process end runs it stopped itself (they report).
                *link.stale_jobs_stopped.lock().unwrap_or_else(|p| p.into_inner()) = None;
                tracing::info!(node = %spec.name, epoch = reply.node_epoch, gpus = spec.gpus.len(),
                    backend = devices.backend_name(), "registered with the leader");
                let terms = Terms::of(reply.lease);
                let _ = events.send(LinkEvent::Registered { node_epoch: reply.node_epoch, sent_at, terms }.into());
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
pub(crate) async fn heartbeats<E: From<LinkEvent>>(
    link: Arc<Link>,
    devices: Arc<Devices>,
    jobs: Arc<JobTable>,
    events: mpsc::UnboundedSender<E>,
) {
    let mut failures = 0u32;
    loop {
        let node_epoch = link.node_epoch();
        if node_epoch != 0 {
            let id = {
                let mut state = link.state();
                state.heartbeats_started += 1;
                state.heartbeats_started
            };
            let sent_at = Instant::now();
            let gpus = devices.heartbeat_health(&jobs).await.iter().map(pb::GpuHealth::from).collect();
            let pulls = link.pull_reports();
            let images = link.image_reports(id);
            let request = pb::HeartbeatRequest {
                node: link.node.name.clone(),
                node_epoch,
                gpus,
                pulls,
                images_reported: images.is_some(),
                images: images.unwrap_or_default(),
            };
            match link.gateway.heartbeat(request).await {
                Ok(reply) => {
                    failures = 0;
                    let newer_term = {
                        let mut state = link.state();
                        state.last_answer = Some(Instant::now());
                        state.heartbeat_answered = state.heartbeat_answered.max(id);
                        let newer_term = reply.term > state.leader_term;
                        state.leader_term = state.leader_term.max(reply.term);
                        newer_term
                    };
                    link.heartbeat_answered.notify_waiters();
                    if newer_term {
                        link.watch_reset.notify_one();
                    }
                    let terms = Terms::of(reply.lease);
                    let reregister = reply.reregister;
                    let _ = events.send(LinkEvent::Answered { node_epoch, sent_at, terms, reregister }.into());
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
            _ = tokio::time::sleep(link.heartbeat_interval) => {}
            _ = link.wake_heartbeat.notified() => {}
        }
    }
}

/// Keeps a desired-state stream open to the leader for the current registration and forwards
/// what it pushes; reconnects when it ends, stays silent, or a heartbeat met a newer leader.
pub(crate) async fn watch_desired<E: From<LinkEvent>>(link: Arc<Link>, events: mpsc::UnboundedSender<E>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let node_epoch = link.node_epoch();
        if node_epoch == 0 {
            let _ = tokio::time::timeout(Duration::from_millis(200), link.watch_reset.notified()).await;
            continue;
        }
        let request = pb::WatchDesiredRequest { node: link.node.name.clone(), node_epoch };
        let mut stream = match link.gateway.watch_desired(request).await {
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
                            Ok(mut desired) => {
                                desired.node = link.node.name.clone();
                                let _ = events.send(LinkEvent::Desired { node_epoch, desired, reregister }.into());
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
                _ = link.watch_reset.notified() => {
                    let (epoch_now, leader_term) = {
                        let state = link.state();
                        (state.node_epoch, state.leader_term)
                    };
                    if epoch_now != node_epoch || leader_term > term {
                        break;
                    }
                }
            }
        }
    }
}

/// Tells the leaders whether this node's part of run `epoch` of a session is idle past its
/// timeout, as `want` says: each change is sent, retried until a leader answers, the latest
/// value winning over one not sent yet. Runs until the run's task aborts it.
pub(crate) async fn report_part_idle(
    link: Arc<Link>,
    job_id: JobId,
    epoch: u64,
    mut want: tokio::sync::watch::Receiver<bool>,
) {
    let node = link.node.name.clone();
    // What the leaders know: a run is placed with no part idle.
    let mut told = false;
    loop {
        let idle = *want.borrow_and_update();
        if idle != told {
            let (mut backoff, mut failures) = (Duration::from_millis(50), 0u32);
            let sent = loop {
                let request = pb::ReportPartIdleRequest { node: node.clone(), job_id, epoch, idle };
                match link.gateway.report_part_idle(request).await {
                    Ok(_) => break true,
                    Err(e) => {
                        failures += 1;
                        if failures == 1 || failures.is_multiple_of(10) {
                            tracing::warn!(job_id, epoch, idle, attempts = failures, error = %e, "cannot report the part idle yet; retrying");
                        }
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        // The word changed meanwhile: send the new one instead.
                        if *want.borrow() != idle {
                            break false;
                        }
                    }
                }
            };
            if !sent {
                continue;
            }
            told = idle;
            tracing::info!(job_id, epoch, idle, "told the leader whether this part of the session is idle");
        }
        if want.changed().await.is_err() {
            return;
        }
    }
}

/// Tells a leader that this node's part of run `epoch` of an image gang has its image ready,
/// retrying until one answers (accepted, or stale: the run moved on). The runtime aborts it when
/// it abandons the run.
pub(crate) async fn deliver_part_ready(link: Arc<Link>, job_id: JobId, epoch: u64) {
    let node = link.node.name.clone();
    let mut backoff = Duration::from_millis(50);
    let mut failures = 0u32;
    loop {
        let request = pb::ReportStartedRequest { node: node.clone(), job_id, epoch };
        match link.gateway.report_part_ready(request).await {
            Ok(reply) => {
                if !reply.accepted {
                    tracing::info!(job_id, epoch, "part-ready report was for a stale placement: ignored by the leader");
                }
                return;
            }
            Err(e) => {
                failures += 1;
                if failures == 1 || failures.is_multiple_of(10) {
                    tracing::warn!(job_id, epoch, attempts = failures, error = %e, "cannot report the part ready yet; retrying");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Sends a report of allocation `epoch` of a job until a leader accepts or rejects it.
pub(crate) async fn deliver<E: From<LinkEvent>>(
    link: Arc<Link>,
    events: mpsc::UnboundedSender<E>,
    job_id: JobId,
    epoch: u64,
    report: Report,
) {
    let node = link.node.name.clone();
    let kind = match report {
        Report::Started => ReportKind::Start,
        Report::Finished(_) => ReportKind::Exit,
    };
    let mut backoff = Duration::from_millis(50);
    let mut failures = 0u32;
    loop {
        let answer = match &report {
            Report::Started => {
                link.gateway.report_started(pb::ReportStartedRequest { node: node.clone(), job_id, epoch }).await
            }
            Report::Finished(exit) => {
                let request =
                    pb::ReportFinishedRequest { node: node.clone(), job_id, epoch, report: Some(exit.into()) };
                link.gateway.report_finished(request).await
            }
        };
        match answer {
            Ok(reply) => {
                if !reply.accepted {
                    tracing::info!(job_id, epoch, ?kind, "report was for a stale placement: ignored by the leader");
                }
                let _ = events.send(LinkEvent::Reported { job_id, epoch, kind, revision: reply.revision }.into());
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

/// Sends the end of this node's tasks of a step until a leader accepts or rejects it.
pub(crate) async fn deliver_step_end<E: From<LinkEvent>>(
    link: Arc<Link>,
    events: mpsc::UnboundedSender<E>,
    job_id: JobId,
    epoch: u64,
    step: StepId,
    end: StepNodeEnd,
) {
    let node = link.node.name.clone();
    let mut backoff = Duration::from_millis(50);
    let mut failures = 0u32;
    loop {
        let request = pb::ReportStepEndedRequest { node: node.clone(), job_id, epoch, step, end: Some((&end).into()) };
        match link.gateway.report_step_ended(request).await {
            Ok(reply) => {
                if !reply.accepted {
                    tracing::info!(job_id, epoch, step, "step report was stale: ignored by the leader");
                }
                let _ = events.send(LinkEvent::StepReported { job_id, epoch, step, revision: reply.revision }.into());
                return;
            }
            Err(e) => {
                failures += 1;
                if failures == 1 || failures.is_multiple_of(10) {
                    tracing::warn!(job_id, epoch, step, attempts = failures, error = %e, "cannot report a step's end yet; retrying");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

impl Link {
    /// Forwards an in-job `srun`'s new step of run `epoch` of `job_id` to the leader.
    pub(crate) async fn create_step(
        &self,
        job_id: JobId,
        epoch: u64,
        request_id: String,
        spec: &corral_types::StepSpec,
    ) -> Result<corral_types::JobStep, String> {
        let request =
            pb::CreateStepRequest { node: self.node.name.clone(), job_id, epoch, request_id, spec: Some(spec.into()) };
        let reply = self.gateway.create_step(request).await.map_err(|e| e.to_string())?;
        let step = reply.step.ok_or("the leader answered without the step")?;
        corral_types::JobStep::try_from(step).map_err(|e| e.to_string())
    }

    /// The output of task `task` of a step of `job_id` on another node, through the leader's
    /// proxy, until that node's tasks of the step are gone.
    pub(crate) async fn read_step_output(
        &self,
        job_id: JobId,
        step: StepId,
        task: u32,
    ) -> Result<tonic::Streaming<pb::LogChunk>, String> {
        let request = pb::ReadStepOutputRequest { node: self.node.name.clone(), job_id, step, task, epoch: 0 };
        self.gateway.read_step_output(request).await.map_err(|e| e.to_string())
    }

    /// Forwards an in-job `srun`'s signal to every task of its step.
    pub(crate) async fn signal_step(&self, job_id: JobId, step: StepId, signal: i32) -> Result<bool, String> {
        let request = pb::SignalStepRequest { node: self.node.name.clone(), job_id, step, signal };
        let reply = self.gateway.signal_step(request).await.map_err(|e| e.to_string())?;
        Ok(reply.accepted)
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
        let addrs = crate::gang::PartAddrs { master_addr: d.master_addr, part_addrs: d.part_addrs };
        jobs.insert(job.id, DesiredJob { job: Arc::new(job), epoch, want, addrs });
    }
    Ok(Desired { revision: state.revision, jobs, node: String::new() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::tests::job;

    #[test]
    fn lease_terms_keep_the_fence_within_the_node_ttl() {
        let ms = Duration::from_millis;
        let cases = [
            // (node TTL ms, fence-after ms) as sent -> (node TTL, fence after, guard after)
            (Some((10_000, 4_000)), (ms(10_000), ms(4_000), ms(7_000))),
            (Some((10_000, 12_000)), (ms(10_000), ms(10_000), ms(10_000))),
            (Some((10_000, 0)), (ms(10_000), ms(0), ms(5_000))),
            (Some((0, 0)), (ms(1), ms(0), Duration::from_micros(500))),
            (None, (ms(1), ms(0), Duration::from_micros(500))),
        ];
        for (sent, (node_ttl, fence_after, guard_after)) in cases {
            let lease = sent.map(|(node_ttl_ms, fence_after_ms)| pb::Lease { node_ttl_ms, fence_after_ms });
            let terms = Terms::of(lease);
            assert_eq!(terms, Terms { node_ttl, fence_after }, "{sent:?}");
            assert_eq!(terms.guard_after(), guard_after, "{sent:?}");
        }
    }

    #[test]
    fn a_pushed_desired_state_becomes_the_runtimes_view() {
        let desired_job =
            |id: JobId, action: pb::DesiredAction, grace_secs: u32, checkpoint_signal: Option<i32>| pb::DesiredJob {
                job: Some(pb::Job::from(job(id, 3).as_ref())),
                action: action as i32,
                grace_secs,
                checkpoint_signal,
                master_addr: "10.0.0.1".into(),
                part_addrs: vec!["10.0.0.1:7000".into(), "10.0.0.2:7000".into()],
            };
        let state = pb::DesiredState {
            revision: 12,
            term: 2,
            reregister: false,
            jobs: vec![
                desired_job(1, pb::DesiredAction::Run, 0, None),
                desired_job(2, pb::DesiredAction::Stop, 0, None),
                desired_job(3, pb::DesiredAction::Stop, 30, Some(10)),
                desired_job(4, pb::DesiredAction::Unspecified, 0, None),
            ],
        };
        let desired = desired_of(state).expect("a well-formed state");
        assert_eq!(desired.revision, 12);
        let wants: Vec<(JobId, u64, Want)> =
            desired.jobs.values().map(|d| (d.job.id, d.epoch, d.want.clone())).collect();
        assert_eq!(
            wants,
            [
                (1, 3, Want::Run),
                (2, 3, Want::Stop { grace: None, signal: None }),
                (3, 3, Want::Stop { grace: Some(Duration::from_secs(30)), signal: Some(10) }),
                (4, 3, Want::Run),
            ]
        );
        let addrs = &desired.jobs[&1].addrs;
        assert_eq!((addrs.master_addr.as_str(), addrs.part_addrs.len()), ("10.0.0.1", 2));

        let missing = pb::DesiredState { jobs: vec![pb::DesiredJob::default()], ..Default::default() };
        assert!(desired_of(missing).is_err(), "a job entry without its job is malformed");
    }
}
