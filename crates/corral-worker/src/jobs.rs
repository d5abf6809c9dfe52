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
use std::sync::{Mutex, MutexGuard};

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

#[derive(Default)]
struct State {
    runs: BTreeMap<RunKey, Run>,
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

    /// The launch failed: the run leaves the table.
    pub(crate) fn launch_failed(&self, job_id: JobId, epoch: u64) {
        let mut state = self.state();
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
        self.state().runs.remove(&(job_id, epoch));
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
