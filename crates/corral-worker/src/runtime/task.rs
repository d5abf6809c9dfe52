//! The tasks of one run: `run_job` waits for the job's process (its time limit and the signal
//! before it), checks its GPUs, frees its MIG instance and tells the runtime; `stop` stops it
//! (a signal, SIGTERM, then SIGKILL after the grace period).
//!
//! An interactive session's idle clock runs here too, on this worker's monotonic clock: every
//! `IDLE_SAMPLE` it looks at the last reading of the run's GPUs on this node; once every one of
//! them has stayed under the session's `min-gpu-util` for its whole `idle-timeout`, the run is
//! killed and reported with `idle_end` (the job's reason), as a time-limit kill is reported.
//! Nothing of the clock is in the coordinators: a leader change or a lost heartbeat neither
//! restarts it nor ends a busy session, and the end is a report retried until a leader takes it.
//! A session on several nodes ends only when every node's GPUs are idle: each part tells the
//! leader when its GPUs have stayed idle for the timeout, and again when they are busy after
//! that (`Command::PartIdle`, the latest word wins), and ends once the desired state says
//! every part is idle (`Allocation::all_idle`).

use super::state::Event;
use crate::devices::Devices;
use crate::executor::{JobHandle, RunningJob};
use crate::jobs::JobTable;
use crate::launch::MigPick;
use crate::link::Link;
use corral_types::{GpuFaultMark, Job, JobExitReport, JobId};
use nix::sys::signal::Signal;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The owners of the state a run's task reaches.
#[derive(Clone)]
pub(crate) struct Owners {
    pub jobs: Arc<JobTable>,
    pub devices: Arc<Devices>,
    pub link: Arc<Link>,
    /// The desired state as the runtime last received it.
    pub desired: tokio::sync::watch::Receiver<crate::reconcile::Desired>,
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

/// How often a session's GPUs are looked at for its idle clock.
const IDLE_SAMPLE: Duration = Duration::from_secs(1);

/// An interactive session's idle rule on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IdleRule {
    pub timeout: Duration,
    pub min_util_pct: u32,
    /// The job's reason when it ends idle.
    pub reason: String,
    /// The session has parts on other nodes: it ends only once they are all idle.
    pub several_nodes: bool,
}

impl IdleRule {
    /// The rule of `job` on `gpus` of this node: none for a job that is not a session, a session
    /// whose timeout is 0 (never), or a part without GPUs (nothing to judge it by).
    pub(crate) fn of(job: &Job, gpus: &[u32]) -> Option<IdleRule> {
        let session = job.spec.session.as_ref()?;
        let secs = session.idle_timeout_secs.filter(|s| *s > 0)?;
        if gpus.is_empty() {
            return None;
        }
        Some(IdleRule {
            timeout: Duration::from_secs(secs),
            min_util_pct: session.min_gpu_util(),
            reason: session.idle_reason(secs),
            several_nodes: job.allocation.as_ref().is_some_and(|a| a.is_gang()),
        })
    }
}

/// Whether every one of `gpus` reads under `min_util_pct` in `readings`: a GPU without a
/// reading, or whose reading failed, is not idle (the clock never ends a session on what it
/// could not see).
pub(crate) fn all_idle(readings: &[crate::gpu::GpuReading], gpus: &[u32], min_util_pct: u32) -> bool {
    gpus.iter().all(|gpu| {
        readings
            .iter()
            .find(|r| r.index == *gpu)
            .is_some_and(|r| r.error.is_none() && r.utilization_percent < min_util_pct)
    })
}

/// A launched run: its process and what it holds.
pub(crate) struct Launched {
    pub job_id: JobId,
    pub epoch: u64,
    pub running: RunningJob,
    pub time_limit: TimeLimit,
    /// A session's idle rule (`None`: not a session, or never idle).
    pub idle: Option<IdleRule>,
    pub gpus: Vec<u32>,
    pub mig: Option<MigPick>,
    /// The run's image root (overlay and writable layer), removed when the run is over.
    pub root: Option<corral_image::JobRoot>,
}

/// Waits for a job process (signalling it before its time limit if it asked, killing it at the
/// limit), checks its GPUs, frees its MIG instance and reports the exit to the runtime.
pub(crate) async fn run_job(owners: Owners, events: mpsc::UnboundedSender<Event>, run: Launched) {
    let Launched { job_id, epoch, mut running, time_limit, idle, gpus, mig, root } = run;
    let handle = running.handle();
    let mut timed_out = false;
    let mut idle_end = None;
    let mut idle_since: Option<std::time::Instant> = None;
    let mut idle_tick = tokio::time::interval(IDLE_SAMPLE);
    idle_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A session on several nodes: whether this part is idle past the timeout, as told to the
    // leader by its own task (ended with the run).
    let part_idle = idle.as_ref().filter(|r| r.several_nodes).map(|_| {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (tx, tokio::spawn(crate::link::report_part_idle(owners.link.clone(), job_id, epoch, rx)))
    });
    let exit = {
        let wait = running.wait();
        tokio::pin!(wait);
        let limit = sleep_for(time_limit.limit);
        tokio::pin!(limit);
        let mut warning = time_limit.warning;
        let started = tokio::time::Instant::now();
        loop {
            // Made again at each turn (a session's idle clock turns every `IDLE_SAMPLE`): the
            // warning is due `at` after the start, not after this turn.
            let warn = sleep_for(warning.map(|(at, _)| at.saturating_sub(started.elapsed())));
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
                _ = idle_tick.tick(), if idle.is_some() => {
                    let Some(rule) = &idle else { continue };
                    let readings: Vec<_> = owners.devices.samples().into_iter().map(|s| s.reading).collect();
                    if !all_idle(&readings, &gpus, rule.min_util_pct) {
                        idle_since = None;
                        if let Some((tx, _)) = &part_idle {
                            tx.send_if_modified(|idle| std::mem::replace(idle, false));
                        }
                        continue;
                    }
                    let since = *idle_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() < rule.timeout {
                        continue;
                    }
                    if let Some((tx, _)) = &part_idle {
                        tx.send_if_modified(|idle| !std::mem::replace(idle, true));
                        let desired = owners.desired.borrow();
                        let run = desired.jobs.get(&job_id).filter(|d| d.epoch == epoch);
                        if !run.and_then(|d| d.job.allocation.as_ref()).is_some_and(|a| a.all_idle()) {
                            continue;
                        }
                    }
                    tracing::info!(job_id, epoch, reason = %rule.reason, "session idle: ending it");
                    idle_end = Some(rule.reason.clone());
                    let handle = handle.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        if let Err(e) = handle.kill_tree() {
                            tracing::warn!(job_id, error = %e, "kill failed");
                        }
                    })
                    .await;
                    break wait.await;
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
    if let Some((_, reporter)) = part_idle {
        reporter.abort();
    }
    tracing::info!(job_id, epoch, code = ?exit.exit_code, signal = ?exit.signal, oom = exit.oom_killed, "job exited");
    // A card fault of its GPUs during the run (or found as it ended) is the card's doing: the
    // run cannot have produced correct results, unless it finished with success on its own.
    let since = std::time::Instant::now().checked_sub(exit.run_time).unwrap_or_else(std::time::Instant::now);
    let gpu_faults = if exit.exit_code == Some(0) && !timed_out && idle_end.is_none() {
        Vec::new()
    } else {
        let node_epoch = owners.link.node_epoch();
        let faults = owners.devices.run_faults(&owners.jobs, &gpus, since).await;
        let marks = faults.into_iter().map(|(gpu, reason, seq)| GpuFaultMark { gpu, reason, node_epoch, seq, job_id });
        marks.collect()
    };
    if !gpu_faults.is_empty() {
        tracing::error!(job_id, epoch, faults = ?gpu_faults, "the run ended with a card fault of its gpus");
    }
    if let Some(root) = root {
        super::pull::remove_root(root);
    }
    let created = mig.as_ref().is_some_and(|m| m.created);
    owners.jobs.exited(job_id, epoch, created);
    let _ = events.send(Event::ProcessGone { job_id, epoch });
    // The job's cgroup is empty now (wait drained it): its GPUs must be clean too.
    if owners.devices.check_hygiene(&owners.jobs, job_id, epoch, &gpus).await {
        owners.link.heartbeat_now().await;
    }
    if let (Some(MigPick { uuid, created: true }), Some(&gpu)) = (mig, gpus.first()) {
        let devices = Arc::clone(&owners.devices);
        let _ = tokio::task::spawn_blocking(move || devices.destroy_mig_instance(gpu, &uuid)).await;
    }
    owners.jobs.remove(job_id, epoch);
    let report = JobExitReport {
        exit_code: exit.exit_code,
        signal: exit.signal,
        oom_killed: exit.oom_killed,
        run_time_ms: exit.run_time.as_millis() as u64,
        timed_out,
        gpu_faults,
        idle_end,
        ..Default::default()
    };
    let _ = events.send(Event::Exited { job_id, epoch, report });
}

/// Stops one job: `signal` first if any (SIGTERM then follows half-way through the grace
/// period), else SIGTERM at once; SIGKILL to the whole tree when the grace period is over.
pub(crate) async fn stop(
    jobs: Arc<JobTable>,
    job_id: JobId,
    epoch: u64,
    handle: JobHandle,
    grace: Duration,
    signal: Option<i32>,
) {
    let checkpoint = signal.and_then(|s| Signal::try_from(s).ok());
    if let Err(e) = handle.signal_tree(checkpoint.unwrap_or(Signal::SIGTERM)) {
        tracing::warn!(job_id, error = %e, "signal failed");
    }
    if checkpoint.is_some() {
        tokio::time::sleep(grace / 2).await;
        if jobs.runs(job_id, epoch) {
            if let Err(e) = handle.signal_tree(Signal::SIGTERM) {
                tracing::warn!(job_id, error = %e, "SIGTERM failed");
            }
        }
        tokio::time::sleep(grace - grace / 2).await;
    } else {
        tokio::time::sleep(grace).await;
    }
    if jobs.runs(job_id, epoch) {
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = handle.kill_tree() {
                tracing::warn!(job_id, error = %e, "kill failed");
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::tests::job;

    #[test]
    fn a_session_is_idle_only_when_every_gpu_reads_under_its_threshold() {
        use crate::gpu::GpuReading;
        let reading = |index, util| GpuReading { index, utilization_percent: util, ..Default::default() };
        assert!(all_idle(&[reading(0, 0), reading(1, 0)], &[0, 1], 1));
        assert!(!all_idle(&[reading(0, 0), reading(1, 50)], &[0, 1], 1), "one busy GPU keeps it busy");
        assert!(all_idle(&[reading(0, 4), reading(1, 60)], &[0], 5), "only the run's GPUs count");
        assert!(!all_idle(&[reading(1, 0)], &[0], 1), "a GPU without a reading is not idle");
        let failed = GpuReading { error: Some("lost".into()), ..reading(0, 0) };
        assert!(!all_idle(&[failed], &[0], 1), "nor one whose reading failed");
    }

    #[test]
    fn only_a_session_with_gpus_and_a_timeout_has_an_idle_clock() {
        let mut j = job(1, 1).as_ref().clone();
        assert_eq!(IdleRule::of(&j, &[0]), None, "not a session");
        j.spec.session = Some(corral_types::SessionOptions { idle_timeout_secs: Some(1800), min_gpu_util_pct: 0 });
        let rule = IdleRule::of(&j, &[0]).expect("a rule");
        assert_eq!((rule.timeout, rule.min_util_pct), (Duration::from_secs(1800), 1));
        assert_eq!(rule.reason, "idle: GPU utilisation under 1% for 30m");
        assert_eq!(IdleRule::of(&j, &[]), None, "no GPUs to judge it by");
        j.spec.session = Some(corral_types::SessionOptions { idle_timeout_secs: Some(0), min_gpu_util_pct: 5 });
        assert_eq!(IdleRule::of(&j, &[0]), None, "0: never");
    }

    #[test]
    fn the_signal_before_the_time_limit_comes_its_lead_before_the_limit() {
        let secs = Duration::from_secs;
        let cases = [
            // (time limit, --signal lead, signal) -> (limit, warning)
            ((None, None, None), (None, None)),
            ((Some(600), None, None), (Some(secs(600)), None)),
            ((Some(600), Some(60), Some(10)), (Some(secs(600)), Some((secs(540), 10)))),
            ((Some(600), Some(900), Some(10)), (Some(secs(600)), Some((secs(0), 10)))),
            // A signal without a limit, or a limit without a signal: nothing to warn of.
            ((None, Some(60), Some(10)), (None, None)),
            ((Some(600), Some(60), None), (Some(secs(600)), None)),
        ];
        for ((time_limit, before, signal), (limit, warning)) in cases {
            let mut j = job(1, 1).as_ref().clone();
            j.spec.time_limit_secs = time_limit;
            j.spec.sched.signal_before_end_secs = before;
            j.spec.sched.checkpoint_signal = signal;
            assert_eq!(TimeLimit::of(&j), TimeLimit { limit, warning }, "{time_limit:?} {before:?} {signal:?}");
        }
    }
}
