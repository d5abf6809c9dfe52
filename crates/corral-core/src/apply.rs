//! `State::apply`: the deterministic transition function of the replicated state machine.

use crate::place::gpus_needed;
use crate::{ApplyError, ClusterConfig, Command, CoordinatorRecord, Outcome, Request, Response, State};
use corral_types::{
    format_size, Allocation, Job, JobExitReport, JobId, JobSpec, JobState, NodeSpec, NodeState, NodeStatus, Timestamp,
};
use std::collections::BTreeSet;

/// What one applied request changed, so a store can persist only that.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Touched {
    pub jobs: BTreeSet<JobId>,
    pub nodes: BTreeSet<String>,
}

impl State {
    /// Applies one request and reports which jobs and nodes it may have changed.
    pub fn apply_tracked(&mut self, request: &Request) -> (Response, Touched) {
        let mut touched = Touched::default();
        match &request.command {
            Command::PlaceJob { job_id, .. }
            | Command::JobStarted { job_id, .. }
            | Command::JobFinished { job_id, .. }
            | Command::CancelJob { job_id, .. } => {
                touched.jobs.insert(*job_id);
            }
            Command::RegisterNode { spec: NodeSpec { name, .. } } | Command::SetNodeState { node: name, .. } => {
                touched.jobs.extend(self.jobs_on_node(name).map(|j| j.id));
                touched.nodes.insert(name.clone());
            }
            Command::SubmitJob { .. }
            | Command::SubmitJobs { .. }
            | Command::Configure(_)
            | Command::Noop
            | Command::AddCoordinator { .. }
            | Command::ExtendTso { .. }
            | Command::RemoveCoordinator { .. } => {}
        }
        let response = self.apply(request);
        match &response {
            Ok(Outcome::JobSubmitted { job_id, duplicate: false }) => {
                touched.jobs.insert(*job_id);
            }
            Ok(Outcome::JobsSubmitted(results)) => {
                touched.jobs.extend(results.iter().filter_map(|r| match r {
                    Ok((id, false)) => Some(*id),
                    _ => None,
                }));
            }
            _ => {}
        }
        (response, touched)
    }

    /// Applies one request. Refused commands leave the state untouched (except `last_ts`).
    pub fn apply(&mut self, request: &Request) -> Response {
        let ts = request.ts;
        self.last_ts = self.last_ts.max(ts);
        match &request.command {
            Command::SubmitJob { request_id, spec } => self
                .submit(ts, request_id, spec)
                .map(|(job_id, duplicate)| Outcome::JobSubmitted { job_id, duplicate }),
            Command::SubmitJobs { jobs } => Ok(Outcome::JobsSubmitted(
                jobs.iter().map(|(request_id, spec)| self.submit(ts, request_id, spec)).collect(),
            )),
            Command::PlaceJob { job_id, node, gpus } => self.place_job(ts, *job_id, node, gpus),
            Command::JobStarted { job_id, epoch } => self.job_started(ts, *job_id, *epoch),
            Command::JobFinished { job_id, epoch, report } => self.job_finished(ts, *job_id, *epoch, report),
            Command::CancelJob { job_id, reason } => self.cancel(ts, *job_id, reason),
            Command::RegisterNode { spec } => Ok(self.register_node(ts, spec)),
            Command::SetNodeState { node, state, reason } => self.set_node_state(ts, node, *state, reason),
            Command::Configure(config) => self.configure(config),
            Command::Noop => Ok(Outcome::Done),
            Command::AddCoordinator { node_id, addr } => self.add_coordinator(*node_id, addr),
            Command::ExtendTso { upper_ms } => {
                self.tso_window_end_ms = self.tso_window_end_ms.max(*upper_ms);
                Ok(Outcome::Done)
            }
            Command::RemoveCoordinator { node_id } => {
                match self.coordinators.get_mut(node_id) {
                    Some(record) => record.removed = true,
                    None => {
                        self.coordinators.insert(*node_id, CoordinatorRecord { addr: String::new(), removed: true });
                    }
                }
                Ok(Outcome::Done)
            }
        }
    }

    /// Validates a spec against the cluster (tenant, class, capacity) without changing anything.
    /// The API calls it before proposing, apply() calls it again.
    pub fn check_submit(&self, spec: &JobSpec) -> Result<JobSpec, ApplyError> {
        spec.validate()?;
        let mut spec = spec.clone();
        if !self.config.tenants.is_empty() && !self.config.tenants.contains(&spec.tenant) {
            return Err(ApplyError::UnknownTenant { tenant: spec.tenant, known: self.config.tenants.join(", ") });
        }
        if spec.priority_class.is_empty() {
            if let Some(class) = self.config.default_class() {
                spec.priority_class = class.name.clone();
            }
        } else if !self.config.priority_classes.is_empty()
            && !self.config.priority_classes.contains_key(&spec.priority_class)
        {
            let known: Vec<&str> = self.config.priority_classes.keys().map(String::as_str).collect();
            return Err(ApplyError::UnknownPriorityClass { class: spec.priority_class, known: known.join(", ") });
        }
        // Capacity checks only once nodes exist: before the first registration a job simply waits.
        if !self.nodes.is_empty() {
            let largest_gpus = self.nodes.values().map(|n| n.spec.gpus.len() as u32).max().unwrap_or(0);
            let needed = if spec.gpu_slice.is_some() { 1 } else { spec.gpus };
            if needed > largest_gpus {
                return Err(ApplyError::TooManyGpus { requested: needed, largest: largest_gpus });
            }
            let largest_mem = self.nodes.values().map(|n| n.spec.memory_bytes).max().unwrap_or(0);
            if spec.memory_bytes > largest_mem {
                return Err(ApplyError::TooMuchMemory {
                    requested: format_size(spec.memory_bytes),
                    largest: format_size(largest_mem),
                });
            }
            let largest_cpu = self.nodes.values().map(|n| n.spec.cpu_millis).max().unwrap_or(0);
            if u64::from(spec.cpu_millis) > largest_cpu {
                return Err(ApplyError::TooManyCpus {
                    requested: format!("{:.1}", f64::from(spec.cpu_millis) / 1000.0),
                    largest: format!("{:.1}", largest_cpu as f64 / 1000.0),
                });
            }
        }
        Ok(spec)
    }

    /// Returns the job id and whether the request id was seen before.
    fn submit(&mut self, ts: Timestamp, request_id: &str, spec: &JobSpec) -> Result<(JobId, bool), ApplyError> {
        if let Some(&job_id) = self.request_ids.get(request_id) {
            return Ok((job_id, true));
        }
        let spec = self.check_submit(spec)?;
        let id = self.next_job_id;
        self.next_job_id += 1;
        let job = Job {
            id,
            spec,
            state: JobState::Pending,
            request_id: request_id.to_string(),
            submitted_at: ts,
            admitted_at: None,
            started_at: None,
            finished_at: None,
            allocation: None,
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 0,
            worker_run_time_ms: None,
        };
        if !request_id.is_empty() {
            self.request_ids.insert(request_id.to_string(), id);
        }
        self.jobs.insert(id, job);
        self.set_job_state_index(id, JobState::Pending);
        Ok((id, false))
    }

    fn place_job(&mut self, ts: Timestamp, job_id: JobId, node_name: &str, gpus: &[u32]) -> Response {
        let reject = |reason: &str| ApplyError::PlacementRejected { job_id, reason: reason.to_string() };
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if job.state != JobState::Pending {
            return Ok(Outcome::Stale);
        }
        let node = self.nodes.get(node_name).ok_or_else(|| ApplyError::NoSuchNode(node_name.to_string()))?;
        if node.state != NodeState::Up {
            return Err(reject("node is not up"));
        }
        if gpus.len() != gpus_needed(job) {
            return Err(reject("wrong number of gpus"));
        }
        let mut unique = gpus.to_vec();
        unique.sort_unstable();
        unique.dedup();
        if unique.len() != gpus.len() || !gpus.iter().all(|g| node.spec.gpus.iter().any(|d| d.index == *g)) {
            return Err(reject("unknown or repeated gpu index"));
        }
        let allocated = self.allocated_gpus(node_name);
        if gpus.iter().any(|g| allocated.contains(g)) {
            return Err(reject("gpu already allocated"));
        }
        let (used_cpu, used_mem) = self
            .jobs_on_node(node_name)
            .fold((0u64, 0u64), |(c, m), j| (c + u64::from(j.spec.cpu_millis), m + j.spec.memory_bytes));
        if used_cpu + u64::from(job.spec.cpu_millis) > node.spec.cpu_millis
            || used_mem + job.spec.memory_bytes > node.spec.memory_bytes
        {
            return Err(reject("not enough cpu or memory left on the node"));
        }
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        job.state = JobState::Running;
        job.allocation = Some(Allocation { node: node_name.to_string(), gpus: gpus.to_vec(), epoch });
        job.attempts += 1;
        job.admitted_at = Some(ts);
        job.reason = None;
        Ok(Outcome::Done)
    }

    /// The running job with this allocation epoch, if the report is current.
    fn current_run(&mut self, job_id: JobId, epoch: u64) -> Result<Option<&mut Job>, ApplyError> {
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let current = job.state == JobState::Running && job.allocation.as_ref().is_some_and(|a| a.epoch == epoch);
        Ok(current.then_some(job))
    }

    fn job_started(&mut self, ts: Timestamp, job_id: JobId, epoch: u64) -> Response {
        match self.current_run(job_id, epoch)? {
            Some(job) if job.started_at.is_none() => {
                job.started_at = Some(ts);
                Ok(Outcome::Done)
            }
            _ => Ok(Outcome::Stale),
        }
    }

    fn job_finished(&mut self, ts: Timestamp, job_id: JobId, epoch: u64, report: &JobExitReport) -> Response {
        let Some(job) = self.current_run(job_id, epoch)? else {
            return Ok(Outcome::Stale);
        };
        let (state, reason) = if job.cancel_requested {
            (JobState::Cancelled, job.reason.clone().unwrap_or_else(|| "cancelled".into()))
        } else if let Some(err) = &report.launch_error {
            (JobState::Failed, format!("launch failed: {err}"))
        } else if report.oom_killed {
            (
                JobState::Failed,
                format!("oom-killed: exceeded its memory limit of {}", format_size(job.spec.memory_bytes)),
            )
        } else if report.timed_out {
            (JobState::Failed, "timeout: killed at its time limit".to_string())
        } else if report.exit_code == Some(0) {
            (JobState::Succeeded, "exit code 0".to_string())
        } else if let Some(code) = report.exit_code {
            (JobState::Failed, format!("exit code {code}"))
        } else if let Some(sig) = report.signal {
            (JobState::Failed, format!("killed by signal {sig}"))
        } else {
            (JobState::Failed, "ended without an exit status".to_string())
        };
        job.state = state;
        job.reason = Some(reason);
        job.exit_code = report.exit_code;
        job.signal = report.signal;
        job.finished_at = Some(ts);
        job.started_at.get_or_insert(ts);
        job.worker_run_time_ms = Some(report.run_time_ms);
        self.set_job_state_index(job_id, state);
        Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())))
    }

    fn cancel(&mut self, ts: Timestamp, job_id: JobId, reason: &str) -> Response {
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let reason = if reason.is_empty() { "cancelled".to_string() } else { reason.to_string() };
        match job.state {
            JobState::Pending | JobState::Preempted => {
                job.state = JobState::Cancelled;
                job.finished_at = Some(ts);
                job.reason = Some(reason);
                self.set_job_state_index(job_id, JobState::Cancelled);
            }
            JobState::Running if !job.cancel_requested => {
                // The worker kills the process tree and reports; the job ends as cancelled then.
                job.cancel_requested = true;
                job.reason = Some(reason);
            }
            _ => {}
        }
        Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())))
    }

    fn register_node(&mut self, ts: Timestamp, spec: &NodeSpec) -> Outcome {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        // A (re-)registering worker starts empty: whatever ran there under an older epoch is gone.
        self.requeue_jobs_on(ts, &spec.name, &format!("requeued: node {} restarted", spec.name));
        self.nodes.insert(spec.name.clone(), NodeStatus { spec: spec.clone(), state: NodeState::Up, epoch });
        Outcome::NodeRegistered { epoch }
    }

    fn set_node_state(&mut self, ts: Timestamp, node: &str, state: NodeState, reason: &str) -> Response {
        let status = self.nodes.get_mut(node).ok_or_else(|| ApplyError::NoSuchNode(node.to_string()))?;
        if status.state == state {
            return Ok(Outcome::Stale);
        }
        status.state = state;
        if state == NodeState::Down {
            let why = if reason.is_empty() { format!("node {node} down") } else { reason.to_string() };
            self.requeue_jobs_on(ts, node, &format!("requeued: {why}"));
        }
        Ok(Outcome::Done)
    }

    /// Puts every running job of `node` back in the queue (cancel requests end them instead).
    fn requeue_jobs_on(&mut self, ts: Timestamp, node: &str, reason: &str) {
        let ids: Vec<JobId> = self.jobs_on_node(node).map(|j| j.id).collect();
        for id in ids {
            let Some(job) = self.jobs.get_mut(&id) else { continue };
            job.allocation = None;
            job.admitted_at = None;
            job.started_at = None;
            if job.cancel_requested {
                job.state = JobState::Cancelled;
                job.finished_at = Some(ts);
            } else {
                job.state = JobState::Pending;
                job.reason = Some(reason.to_string());
            }
            let state = job.state;
            self.set_job_state_index(id, state);
        }
    }

    /// Idempotent for a retried join of the same node at the same address; refuses an id that
    /// was removed or belongs to another address.
    fn add_coordinator(&mut self, node_id: u64, addr: &str) -> Response {
        match self.coordinators.get(&node_id) {
            Some(r) if !r.removed && r.addr == addr => Ok(Outcome::Stale),
            Some(_) => Err(ApplyError::NodeIdReused(node_id)),
            None => {
                self.coordinators.insert(node_id, CoordinatorRecord { addr: addr.to_string(), removed: false });
                Ok(Outcome::Done)
            }
        }
    }

    fn configure(&mut self, config: &ClusterConfig) -> Response {
        if config.priority_classes.values().filter(|c| c.is_default).count() > 1 {
            return Err(ApplyError::InvalidConfig("more than one default priority class".into()));
        }
        self.config = config.clone();
        Ok(Outcome::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::place;
    use corral_types::GpuDevice;
    use std::collections::BTreeMap;

    fn req(ts: u64, command: Command) -> Request {
        Request { ts: Timestamp(ts), command }
    }

    fn node(name: &str, gpus: u32) -> NodeSpec {
        NodeSpec {
            name: name.into(),
            address: "127.0.0.1:1".into(),
            gpus: (0..gpus)
                .map(|i| GpuDevice {
                    index: i,
                    uuid: format!("GPU-{name}-{i}"),
                    model: "RTX 5090".into(),
                    memory_mib: 32768,
                })
                .collect(),
            cpu_millis: 16_000,
            memory_bytes: 64 << 30,
            labels: vec![],
        }
    }

    fn spec(gpus: u32) -> JobSpec {
        JobSpec {
            name: "j".into(),
            tenant: "default".into(),
            priority_class: String::new(),
            gpus,
            gpu_slice: None,
            cpu_millis: 1000,
            memory_bytes: 1 << 30,
            time_limit_secs: None,
            image: None,
            command: vec!["true".into()],
            env: BTreeMap::new(),
        }
    }

    fn cluster() -> State {
        let mut s = State::default();
        s.apply(&req(1, Command::Configure(ClusterConfig::dev_defaults()))).unwrap();
        s.apply(&req(2, Command::RegisterNode { spec: node("n1", 8) })).unwrap();
        s
    }

    fn submit(s: &mut State, ts: u64, rid: &str, spec: JobSpec) -> Response {
        s.apply(&req(ts, Command::SubmitJob { request_id: rid.into(), spec }))
    }

    fn schedule(s: &mut State, ts: u64) -> Vec<place::Placement> {
        let placements = place(s, &BTreeSet::new());
        for p in &placements {
            s.apply(&req(ts, Command::PlaceJob { job_id: p.job_id, node: p.node.clone(), gpus: p.gpus.clone() }))
                .unwrap();
        }
        placements
    }

    #[test]
    fn submit_is_idempotent_per_request_id() {
        let mut s = cluster();
        assert_eq!(submit(&mut s, 3, "r1", spec(1)), Ok(Outcome::JobSubmitted { job_id: 1, duplicate: false }));
        assert_eq!(submit(&mut s, 4, "r1", spec(1)), Ok(Outcome::JobSubmitted { job_id: 1, duplicate: true }));
        assert_eq!(submit(&mut s, 5, "r2", spec(1)), Ok(Outcome::JobSubmitted { job_id: 2, duplicate: false }));
        assert_eq!(s.jobs.len(), 2);
        assert_eq!(s.jobs[&1].spec.priority_class, "normal", "default class filled in");
    }

    #[test]
    fn submit_rejects_what_could_never_run() {
        let mut s = cluster();
        assert!(matches!(submit(&mut s, 3, "r", spec(9)), Err(ApplyError::TooManyGpus { requested: 9, largest: 8 })));
        let mut bad = spec(1);
        bad.tenant = "nobody".into();
        let err = submit(&mut s, 4, "r", bad).unwrap_err();
        assert_eq!(err.to_string(), "unknown tenant 'nobody' (known tenants: default, team-a, team-b)");
        let mut bad = spec(1);
        bad.priority_class = "urgent".into();
        assert!(matches!(submit(&mut s, 5, "r", bad), Err(ApplyError::UnknownPriorityClass { .. })));
        let mut bad = spec(1);
        bad.memory_bytes = 1 << 40;
        assert!(matches!(submit(&mut s, 6, "r", bad), Err(ApplyError::TooMuchMemory { .. })));
        assert!(s.jobs.is_empty(), "refused submits leave nothing behind");
        assert!(s.request_ids.is_empty());
    }

    #[test]
    fn jobs_that_do_not_fit_wait_and_run_later() {
        let mut s = cluster();
        submit(&mut s, 3, "a", spec(6)).unwrap();
        submit(&mut s, 4, "b", spec(4)).unwrap();
        submit(&mut s, 5, "c", spec(2)).unwrap();
        let placed = schedule(&mut s, 6);
        assert_eq!(placed.iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(s.jobs[&2].state, JobState::Pending);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let report = JobExitReport { exit_code: Some(0), ..Default::default() };
        s.apply(&req(7, Command::JobFinished { job_id: 1, epoch, report })).unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Succeeded);
        assert_eq!(schedule(&mut s, 8).iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn placement_is_revalidated_at_apply() {
        let mut s = cluster();
        submit(&mut s, 3, "a", spec(8)).unwrap();
        submit(&mut s, 4, "b", spec(1)).unwrap();
        s.apply(&req(5, Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: (0..8).collect() })).unwrap();
        let err = s.apply(&req(6, Command::PlaceJob { job_id: 2, node: "n1".into(), gpus: vec![3] })).unwrap_err();
        assert!(matches!(err, ApplyError::PlacementRejected { job_id: 2, .. }));
        assert_eq!(s.jobs[&2].state, JobState::Pending);
    }

    #[test]
    fn exit_reports_map_to_states_and_stale_epochs_are_ignored() {
        let mut s = cluster();
        for (i, rid) in ["a", "b", "c"].iter().enumerate() {
            submit(&mut s, 3 + i as u64, rid, spec(1)).unwrap();
        }
        schedule(&mut s, 10);
        let epoch = |s: &State, id| s.jobs[&id].allocation.as_ref().unwrap().epoch;
        let e1 = epoch(&s, 1);
        s.apply(&req(11, Command::JobStarted { job_id: 1, epoch: e1 })).unwrap();
        let fail = JobExitReport { exit_code: Some(3), run_time_ms: 5, ..Default::default() };
        assert_eq!(
            s.apply(&req(12, Command::JobFinished { job_id: 1, epoch: e1 + 100, report: fail.clone() })),
            Ok(Outcome::Stale)
        );
        s.apply(&req(13, Command::JobFinished { job_id: 1, epoch: e1, report: fail.clone() })).unwrap();
        let j = &s.jobs[&1];
        assert_eq!(
            (j.state, j.exit_code, j.started_at, j.finished_at),
            (JobState::Failed, Some(3), Some(Timestamp(11)), Some(Timestamp(13)))
        );
        // A duplicate report of the same run changes nothing.
        assert_eq!(s.apply(&req(14, Command::JobFinished { job_id: 1, epoch: e1, report: fail })), Ok(Outcome::Stale));
        assert_eq!(s.jobs[&1].finished_at, Some(Timestamp(13)));

        let oom = JobExitReport { signal: Some(9), oom_killed: true, ..Default::default() };
        let e2 = epoch(&s, 2);
        s.apply(&req(15, Command::JobFinished { job_id: 2, epoch: e2, report: oom })).unwrap();
        assert_eq!(s.jobs[&2].state, JobState::Failed);
        assert!(s.jobs[&2].reason.as_deref().unwrap().starts_with("oom-killed"));

        s.apply(&req(16, Command::CancelJob { job_id: 3, reason: "cancelled by user".into() })).unwrap();
        assert_eq!(s.jobs[&3].state, JobState::Running, "running job ends only when the worker reports");
        let killed = JobExitReport { signal: Some(9), ..Default::default() };
        let e3 = epoch(&s, 3);
        s.apply(&req(17, Command::JobFinished { job_id: 3, epoch: e3, report: killed })).unwrap();
        assert_eq!(s.jobs[&3].state, JobState::Cancelled);
        assert_eq!(s.jobs[&3].reason.as_deref(), Some("cancelled by user"));
    }

    #[test]
    fn node_restart_or_loss_requeues_its_jobs() {
        let mut s = cluster();
        submit(&mut s, 3, "a", spec(2)).unwrap();
        schedule(&mut s, 4);
        assert_eq!(s.jobs[&1].state, JobState::Running);
        s.apply(&req(5, Command::RegisterNode { spec: node("n1", 8) })).unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Pending);
        assert!(s.jobs[&1].allocation.is_none());
        schedule(&mut s, 6);
        assert_eq!(s.jobs[&1].attempts, 2);
        s.apply(&req(7, Command::SetNodeState { node: "n1".into(), state: NodeState::Down, reason: String::new() }))
            .unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Pending);
        assert!(place(&s, &BTreeSet::new()).is_empty(), "nothing placed on a down node");
    }

    #[test]
    fn cancel_pending_is_immediate() {
        let mut s = cluster();
        submit(&mut s, 3, "a", spec(1)).unwrap();
        let out = s.apply(&req(4, Command::CancelJob { job_id: 1, reason: String::new() })).unwrap();
        let Outcome::Job(job) = out else { panic!("expected job") };
        assert_eq!(job.state, JobState::Cancelled);
        assert_eq!(s.pending_jobs().count(), 0);
        assert_eq!(
            s.apply(&req(5, Command::CancelJob { job_id: 9, reason: String::new() })),
            Err(ApplyError::NoSuchJob(9))
        );
    }

    #[test]
    fn batch_submits_answer_each_job_and_dedup_like_single_ones() {
        let mut s = cluster();
        let mut bad = spec(1);
        bad.tenant = "nobody".into();
        let jobs = vec![("a".to_string(), spec(1)), ("b".to_string(), bad), ("a".to_string(), spec(1))];
        let out = s.apply(&req(3, Command::SubmitJobs { jobs })).unwrap();
        let Outcome::JobsSubmitted(results) = out else { panic!("expected batch outcome") };
        assert_eq!(results[0], Ok((1, false)));
        assert!(matches!(results[1], Err(ApplyError::UnknownTenant { .. })));
        assert_eq!(results[2], Ok((1, true)), "a repeated request id in the batch is a duplicate");
        assert_eq!(submit(&mut s, 4, "a", spec(1)), Ok(Outcome::JobSubmitted { job_id: 1, duplicate: true }));
        assert_eq!(s.jobs.len(), 1);
    }

    #[test]
    fn coordinator_ids_are_never_reused() {
        let mut s = State::default();
        let add = |id, addr: &str| Command::AddCoordinator { node_id: id, addr: addr.into() };
        assert_eq!(s.apply(&req(1, add(1, "a:1"))), Ok(Outcome::Done));
        assert_eq!(s.apply(&req(2, add(1, "a:1"))), Ok(Outcome::Stale), "a retried join is fine");
        assert_eq!(s.apply(&req(3, add(1, "b:1"))), Err(ApplyError::NodeIdReused(1)));
        s.apply(&req(4, Command::RemoveCoordinator { node_id: 1 })).unwrap();
        assert_eq!(s.apply(&req(5, add(1, "a:1"))), Err(ApplyError::NodeIdReused(1)), "not even after leaving");
    }

    #[test]
    fn higher_priority_is_placed_first() {
        let mut s = cluster();
        submit(&mut s, 3, "low", spec(8)).unwrap();
        let mut high = spec(8);
        high.priority_class = "gpu-high-priority".into();
        submit(&mut s, 4, "high", high).unwrap();
        assert_eq!(schedule(&mut s, 5).iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![2]);
    }
}
