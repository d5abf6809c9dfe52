//! The job table: every run (a job's allocation epoch) this worker process launches, from the
//! start of its launch until its clean-up is over, as the runtime's job tasks, the log agent,
//! GPU hygiene and the metrics see it. One `Mutex<State>` behind methods; no lock is held across
//! a blocking call or an `.await`.
//!
//! What the runtime has reported to the leaders is not here but in its own `reconcile::Local`:
//! this table only says which processes exist and what they hold (GPUs, a MIG device).

use crate::executor::{CgroupUsage, JobHandle};
use corral_types::JobId;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

/// A run's key: the job and its allocation epoch.
type RunKey = (JobId, u64);

/// A started run's process, as `JobTable::started` records it.
#[derive(Clone)]
pub(crate) struct StartedRun {
    pub tenant: String,
    /// The node's GPU indices the run holds.
    pub gpus: Vec<u32>,
    pub handle: JobHandle,
    /// The MIG device it holds: until its exit, or until destroyed if made for it.
    pub mig_uuid: Option<String>,
}

/// One running job as the metrics export it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct JobSample {
    pub job_id: u64,
    pub tenant: String,
    pub usage: CgroupUsage,
}

/// Where one run of the table stands.
enum Run {
    /// Its launch is under way: its log directory may exist before its process.
    Launching,
    /// Its process was started; `exited` once the process tree is gone (GPU hygiene and
    /// clean-up may still run).
    Started { process: StartedRun, exited: bool },
}

impl Run {
    /// Its process tree runs.
    fn running(&self) -> Option<&StartedRun> {
        match self {
            Run::Started { process, exited: false } => Some(process),
            _ => None,
        }
    }
}

/// What a run's step tasks inherit from it, and the secret its in-job commands present.
/// The secret is never logged (`Debug` leaves it out).
pub(crate) struct RunInfo {
    pub secret: String,
    /// The run's whole environment (the secret included).
    pub env: BTreeMap<String, String>,
    /// The run's working directory.
    pub cwd: PathBuf,
    /// The run's own directory (its logs; its tasks' output files).
    pub work_dir: PathBuf,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub open_files: Option<u64>,
    /// The run is a container: its tasks run in it (`env`, `cwd` as the container sees them).
    pub in_container: bool,
}

impl std::fmt::Debug for RunInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunInfo").field("work_dir", &self.work_dir).finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    runs: BTreeMap<RunKey, Run>,
    infos: BTreeMap<RunKey, Arc<RunInfo>>,
}

/// The runs of this worker process.
#[derive(Default)]
pub(crate) struct JobTable {
    state: Mutex<State>,
}

impl JobTable {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the start of allocation `epoch`'s launch.
    pub(crate) fn launching(&self, job_id: JobId, epoch: u64) {
        self.state().runs.insert((job_id, epoch), Run::Launching);
    }

    /// Records what the run's tasks inherit (before its process starts).
    pub(crate) fn set_info(&self, job_id: JobId, epoch: u64, info: RunInfo) {
        self.state().infos.insert((job_id, epoch), Arc::new(info));
    }

    /// What allocation `epoch`'s tasks inherit, while the run is known.
    pub(crate) fn info(&self, job_id: JobId, epoch: u64) -> Option<Arc<RunInfo>> {
        self.state().infos.get(&(job_id, epoch)).cloned()
    }

    /// The running run whose in-job secret is `secret`: the one run an in-job command acts for.
    pub(crate) fn run_of_secret(&self, secret: &str) -> Option<(JobId, u64)> {
        if secret.is_empty() {
            // A run whose secret could not be minted holds an empty one: it names no run.
            return None;
        }
        let state = self.state();
        let mut found = None;
        for (key, info) in &state.infos {
            // Every entry is compared in full, whatever matches first.
            if constant_time_eq(info.secret.as_bytes(), secret.as_bytes()) {
                found = Some(*key);
            }
        }
        found.filter(|key| state.runs.get(key).is_some_and(|run| run.running().is_some()))
    }

    /// The launch failed: the run leaves the table.
    pub(crate) fn launch_failed(&self, job_id: JobId, epoch: u64) {
        let mut state = self.state();
        state.infos.remove(&(job_id, epoch));
        if matches!(state.runs.get(&(job_id, epoch)), Some(Run::Launching)) {
            state.runs.remove(&(job_id, epoch));
        }
    }

    /// The run's process started.
    pub(crate) fn started(&self, job_id: JobId, epoch: u64, process: StartedRun) {
        self.state().runs.insert((job_id, epoch), Run::Started { process, exited: false });
    }

    /// The run's process tree is gone: its GPUs are no longer in use; an instance the operator
    /// laid out is free again, one made for it stays taken (`keep_mig`) until destroyed.
    pub(crate) fn exited(&self, job_id: JobId, epoch: u64, keep_mig: bool) {
        if let Some(Run::Started { process, exited }) = self.state().runs.get_mut(&(job_id, epoch)) {
            *exited = true;
            if !keep_mig {
                process.mig_uuid = None;
            }
        }
    }

    /// The run's clean-up is over: it leaves the table.
    pub(crate) fn remove(&self, job_id: JobId, epoch: u64) {
        let mut state = self.state();
        state.runs.remove(&(job_id, epoch));
        state.infos.remove(&(job_id, epoch));
    }

    /// True while a run of the job is being launched or its process tree runs here.
    pub(crate) fn is_running(&self, job_id: JobId) -> bool {
        let state = self.state();
        let mut runs = state.runs.range((job_id, 0)..=(job_id, u64::MAX)).map(|(_, run)| run);
        runs.any(|run| matches!(run, Run::Launching) || run.running().is_some())
    }

    /// True while allocation `epoch` of the job runs here.
    pub(crate) fn runs(&self, job_id: JobId, epoch: u64) -> bool {
        self.state().runs.get(&(job_id, epoch)).is_some_and(|run| run.running().is_some())
    }

    /// The handle of allocation `epoch`'s process while it runs.
    pub(crate) fn handle(&self, job_id: JobId, epoch: u64) -> Option<JobHandle> {
        self.state().runs.get(&(job_id, epoch)).and_then(Run::running).map(|p| p.handle.clone())
    }

    /// The handles of every job process that runs.
    pub(crate) fn running_handles(&self) -> Vec<(JobId, JobHandle)> {
        let state = self.state();
        state.runs.iter().filter_map(|((job_id, _), run)| Some((*job_id, run.running()?.handle.clone()))).collect()
    }

    /// MIG devices held by runs (running, or made for one and not destroyed yet).
    pub(crate) fn taken_mig_instances(&self) -> Vec<String> {
        let state = self.state();
        let processes = state.runs.values().filter_map(|run| match run {
            Run::Started { process, .. } => Some(process),
            Run::Launching => None,
        });
        processes.filter_map(|p| p.mig_uuid.clone()).collect()
    }

    /// The runs whose processes run on `gpu`, with their handles.
    pub(crate) fn running_on_gpu(&self, gpu: u32) -> Vec<(JobId, u64, JobHandle)> {
        let state = self.state();
        let on_gpu = state.runs.iter().filter_map(|(key, run)| Some((key, run.running()?)));
        on_gpu.filter(|(_, p)| p.gpus.contains(&gpu)).map(|(&(job, epoch), p)| (job, epoch, p.handle.clone())).collect()
    }

    /// GPU indices of runs whose processes still run.
    pub(crate) fn busy_gpus(&self) -> Vec<u32> {
        self.state().runs.values().filter_map(Run::running).flat_map(|p| p.gpus.iter().copied()).collect()
    }

    /// The cgroup usage of every job that runs, read after the table's lock is released.
    pub(crate) fn samples(&self) -> Vec<JobSample> {
        let running: Vec<(JobId, String, JobHandle)> = {
            let state = self.state();
            let running = state.runs.iter().filter_map(|((job_id, _), run)| Some((*job_id, run.running()?)));
            running.map(|(job_id, p)| (job_id, p.tenant.clone(), p.handle.clone())).collect()
        };
        running
            .into_iter()
            .map(|(job_id, tenant, handle)| JobSample { job_id, tenant, usage: handle.usage() })
            .collect()
    }
}

/// Compares two byte strings in time that depends on their lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(gpus: &[u32], mig_uuid: Option<&str>) -> StartedRun {
        StartedRun {
            tenant: "team-a".into(),
            gpus: gpus.to_vec(),
            handle: JobHandle::detached(1),
            mig_uuid: mig_uuid.map(str::to_owned),
        }
    }

    #[test]
    fn a_run_is_running_from_its_launch_until_its_process_is_gone() {
        let jobs = JobTable::default();
        assert!(!jobs.is_running(1));
        jobs.launching(1, 4);
        assert!(jobs.is_running(1), "its log directory may exist before its process");
        assert!(!jobs.runs(1, 4) && jobs.handle(1, 4).is_none(), "no process yet");
        jobs.started(1, 4, started(&[0, 1], None));
        assert!(jobs.is_running(1) && jobs.runs(1, 4) && !jobs.runs(1, 3));
        assert!(jobs.handle(1, 4).is_some());
        assert_eq!(jobs.busy_gpus(), [0, 1]);
        assert_eq!(jobs.running_handles().len(), 1);
        let samples = jobs.samples();
        assert_eq!((samples.len(), samples[0].job_id, samples[0].tenant.as_str()), (1, 1, "team-a"));
        jobs.exited(1, 4, false);
        assert!(!jobs.is_running(1) && !jobs.runs(1, 4) && jobs.handle(1, 4).is_none());
        assert_eq!((jobs.busy_gpus(), jobs.running_handles().len(), jobs.samples()), (vec![], 0, vec![]));
        jobs.remove(1, 4);
        assert!(jobs.state().runs.is_empty());
    }

    #[test]
    fn a_failed_launch_leaves_the_table() {
        let jobs = JobTable::default();
        jobs.launching(1, 4);
        jobs.launch_failed(1, 4);
        assert!(!jobs.is_running(1) && jobs.state().runs.is_empty());
        jobs.started(1, 5, started(&[0], None));
        jobs.launch_failed(1, 5);
        assert!(jobs.runs(1, 5), "only a launch under way fails");
    }

    #[test]
    fn a_mig_device_made_for_a_run_stays_taken_until_the_run_leaves_the_table() {
        let jobs = JobTable::default();
        jobs.started(1, 1, started(&[0], Some("MIG-made")));
        jobs.started(2, 1, started(&[0], Some("MIG-laid-out")));
        assert_eq!(jobs.taken_mig_instances(), ["MIG-made", "MIG-laid-out"]);
        jobs.exited(1, 1, true);
        jobs.exited(2, 1, false);
        assert_eq!(jobs.taken_mig_instances(), ["MIG-made"], "an instance the operator laid out is free at the exit");
        jobs.remove(1, 1);
        assert!(jobs.taken_mig_instances().is_empty());
    }

    #[test]
    fn the_runs_of_one_job_are_apart() {
        let jobs = JobTable::default();
        jobs.started(1, 1, started(&[0], None));
        jobs.exited(1, 1, false);
        jobs.launching(1, 2);
        assert!(jobs.is_running(1), "the next run is being launched");
        jobs.remove(1, 1);
        assert!(jobs.is_running(1), "the clean-up of the previous run does not end the next one");
        jobs.exited(1, 2, false);
        assert!(jobs.is_running(1), "only a started run exits");
    }
}
