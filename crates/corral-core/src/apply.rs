//! `State::apply`: the deterministic transition function of the replicated state machine.
//!
//! Invariant: apply never trusts a proposal. Every placement is re-validated against the state at
//! apply time (node up, GPUs free or with room for the slice, CPU and memory, quotas), so a stale
//! or wrong leader can never over-commit a GPU, a slice or a quota; preemptions are re-checked
//! against the priority and reclaim rules.

use crate::gang;
use crate::history::{CompactCutoffs, RequestKey, RequestRecord};
use crate::ledger::{billed_ms, RunLength};
use crate::policy::format_secs;
use crate::quota::{self, QuotaNumbers};
use crate::resources::{fit_slice, gang_shape, job_milli_gpus, spread_shapes, MigShape};
use crate::{
    ApplyError, ClusterConfig, Command, CoordinatorRecord, Outcome, Placement, Preemption, Request, Response,
    ScheduleOutcome, State,
};
use corral_types::{
    format_size, Allocation, EndCause, GpuFaultMark, GpuSlice, Job, JobExitReport, JobId, JobSpec, JobState, NodeMode,
    NodeSpec, NodeState, NodeStatus, PartEnd, PreemptionNotice, Segment, SliceAssignment, Timestamp, DRAIN_PREEMPTOR,
};
use std::collections::BTreeSet;

/// Why a run stopped by `by` (a job, or a drain of `node`) goes back to the queue.
fn preempted_reason(by: JobId, node: &str) -> String {
    if by == DRAIN_PREEMPTOR {
        format!("requeued: node {node} was drained")
    } else if by == corral_types::REQUEUE_PREEMPTOR {
        "requeued: by request (corral requeue)".to_string()
    } else if by == corral_types::LEASE_PREEMPTOR {
        format!("requeued: the lease of node {node} ended")
    } else {
        format!("requeued: preempted by job {by}")
    }
}

/// What one applied request changed, so a store can persist only that.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Touched {
    pub jobs: BTreeSet<JobId>,
    /// Ledger segments created.
    pub segments: BTreeSet<u64>,
    /// Jobs that left the hot state for the history (`Command::Compact`).
    pub archived: Vec<Job>,
    /// Segments that left the hot ledger: the store writes those created in the same batch
    /// (their id is in `segments`), which are no longer in the state when it persists.
    pub archived_segments: Vec<Segment>,
    /// Retention to apply to the history (the last compaction's cutoffs).
    pub history_cutoffs: Option<CompactCutoffs>,
    /// Request ids recorded, in apply order: a store that keeps them apart from the rest of the
    /// state writes only these.
    pub request_ids: Vec<(RequestKey, RequestRecord)>,
}

impl Touched {
    /// Adds what `other` touched (a batch of applied entries persists once).
    pub fn merge(&mut self, other: Touched) {
        self.jobs.extend(other.jobs);
        self.segments.extend(other.segments);
        // A job archived and then changed again in one batch cannot happen: only terminal jobs
        // of the hot state are archived, and nothing changes a job that left it.
        self.archived.extend(other.archived);
        self.archived_segments.extend(other.archived_segments);
        self.history_cutoffs = other.history_cutoffs.or(self.history_cutoffs);
        self.request_ids.extend(other.request_ids);
    }
}

impl State {
    /// Applies one request and reports which jobs and nodes it may have changed.
    pub fn apply_tracked(&mut self, request: &Request) -> (Response, Touched) {
        let mut touched = Touched::default();
        match &request.command {
            Command::PlaceJob { job_id, .. }
            | Command::JobStarted { job_id, .. }
            | Command::PartReady { job_id, .. }
            | Command::PartIdle { job_id, .. }
            | Command::JobFinished { job_id, .. }
            | Command::CancelJob { job_id, .. }
            | Command::PreemptJob { job_id, .. }
            | Command::HoldJob { job_id, .. }
            | Command::RequeueJob { job_id }
            | Command::SignalJob { job_id, .. }
            | Command::UpdateJob { job_id, .. }
            | Command::CancelArrayTask { array: job_id, .. }
            | Command::CreateStep { job_id, .. }
            | Command::StepEnded { job_id, .. }
            | Command::SignalStep { job_id, .. } => {
                touched.jobs.insert(*job_id);
            }
            Command::CancelJobs { job_ids, .. } => touched.jobs.extend(job_ids.iter().copied()),
            Command::Schedule { placements, preemptions } => {
                touched.jobs.extend(placements.iter().map(|p| p.job_id));
                touched.jobs.extend(preemptions.iter().map(|p| p.job_id));
            }
            Command::RegisterNode { spec: NodeSpec { name, .. } }
            | Command::RegisterRestartedNode { spec: NodeSpec { name, .. }, .. }
            | Command::SetNodeState { node: name, .. }
            | Command::SetNodeMode { node: name, .. }
            | Command::EvictDrainedJobs { node: name }
            | Command::EndLease { node: name }
            | Command::RemoveNode { node: name, .. } => {
                touched.jobs.extend(self.jobs_on_node(name).map(|j| j.id));
            }
            Command::SubmitJob { .. }
            | Command::SubmitJobs { .. }
            | Command::Configure(_)
            | Command::Noop
            | Command::AddCoordinator { .. }
            | Command::ExtendTso { .. }
            | Command::RemoveCoordinator { .. }
            | Command::CreateToken { .. }
            | Command::RevokeToken { .. }
            | Command::CreateJoinToken { .. }
            | Command::ConsumeJoinToken { .. }
            | Command::SetGpuFault { .. }
            | Command::SetNodeLease { .. }
            | Command::Compact(_) => {}
            Command::ApplyPolicy { .. } => {
                // Running runs may get a price break, stranded jobs are cancelled.
                touched.jobs.extend(self.index.live.iter().copied());
            }
        }
        let segments_before = self.next_segment_id;
        let response = self.apply_inner(request);
        touched.segments.extend(segments_before..self.next_segment_id);
        touched.jobs.extend(std::mem::take(&mut self.followed));
        let archive = std::mem::take(&mut self.archive);
        touched.archived = archive.jobs;
        touched.archived_segments = archive.segments;
        touched.history_cutoffs = archive.cutoffs;
        touched.request_ids = std::mem::take(&mut self.added_request_ids);
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
        let response = self.apply_inner(request);
        self.followed.clear();
        self.archive = Default::default();
        self.added_request_ids.clear();
        response
    }

    /// Applies one request and what follows from it (dependents, arrays), noting the jobs the
    /// consequences changed in `followed`.
    fn apply_inner(&mut self, request: &Request) -> Response {
        let response = self.apply_command(request);
        self.follow_up(request.ts);
        response
    }

    fn apply_command(&mut self, request: &Request) -> Response {
        let ts = request.ts;
        self.last_ts = self.last_ts.max(ts);
        match &request.command {
            Command::SubmitJob { request_id, spec } => {
                self.submit(ts, request_id, spec).map(|(job_id, duplicate)| Outcome::JobSubmitted { job_id, duplicate })
            }
            Command::SubmitJobs { jobs } => Ok(Outcome::JobsSubmitted(
                jobs.iter().map(|(request_id, spec)| self.submit(ts, request_id, spec)).collect(),
            )),
            Command::PlaceJob { job_id, node, gpus } => self.place(
                ts,
                &Placement {
                    job_id: *job_id,
                    node: node.clone(),
                    gpus: gpus.clone(),
                    more_nodes: Vec::new(),
                    slice: None,
                },
            ),
            Command::PreemptJob { job_id, by, grace_secs } => self.preempt(ts, *job_id, *by, *grace_secs),
            Command::Schedule { placements, preemptions } => Ok(self.schedule(ts, placements, preemptions)),
            Command::JobStarted { job_id, epoch } => self.job_started(ts, *job_id, *epoch),
            Command::PartReady { job_id, epoch, node } => self.part_ready(*job_id, *epoch, node),
            Command::PartIdle { job_id, epoch, node, idle } => self.part_idle(*job_id, *epoch, node, *idle),
            Command::JobFinished { job_id, epoch, node, report } => {
                self.job_finished(ts, *job_id, *epoch, node, report)
            }
            Command::CancelJob { job_id, reason } => self.cancel(ts, *job_id, reason),
            Command::CancelJobs { job_ids, reason } => {
                let mut cancelled = Vec::new();
                for id in job_ids {
                    let live = self.jobs.get(id).is_some_and(|j| !j.state.is_terminal() && !j.cancel_requested);
                    if live && self.cancel(ts, *id, reason).is_ok() {
                        cancelled.push(*id);
                    }
                }
                Ok(Outcome::JobsCancelled(cancelled))
            }
            Command::RegisterNode { spec } => Ok(self.register_node(ts, spec, None)),
            Command::RegisterRestartedNode { spec, stale_jobs_stopped_ms_ago } => {
                Ok(self.register_node(ts, spec, Some(*stale_jobs_stopped_ms_ago)))
            }
            Command::SetNodeState { node, state, reason } => self.set_node_state(ts, node, *state, reason),
            Command::SetGpuFault { node, mark, clear } => self.set_gpu_fault(node, mark, *clear),
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
            Command::CreateToken { tenant, admin, sha256, expires_at_ms } => {
                self.create_token(ts, tenant, *admin, sha256, *expires_at_ms)
            }
            Command::RevokeToken { token_id } => self.revoke_token(*token_id),
            Command::ApplyPolicy { config, by, force } => self.apply_policy(ts, config, by, *force),
            Command::SetNodeMode { node, mode, reason, drain_deadline } => {
                self.set_node_mode(ts, node, *mode, reason, *drain_deadline)
            }
            Command::EvictDrainedJobs { node } => self.evict_drained_jobs(ts, node),
            Command::SetNodeLease { node, lease_end } => self.set_node_lease(node, *lease_end),
            Command::EndLease { node } => self.end_lease(ts, node),
            Command::RemoveNode { node, revoke_certificates } => {
                let removed = self.remove_node(node)?;
                if *revoke_certificates {
                    self.revoke_worker_certificates(ts, node);
                }
                Ok(removed)
            }
            Command::HoldJob { job_id, hold } => self.hold(*job_id, *hold),
            Command::RequeueJob { job_id } => self.requeue_request(ts, *job_id),
            Command::SignalJob { job_id, signal } => self.signal_job(*job_id, *signal),
            Command::UpdateJob { job_id, update, admin } => self.update_job(*job_id, update, *admin),
            Command::CancelArrayTask { array, index, reason } => self.cancel_array_task(ts, *array, *index, reason),
            Command::CreateJoinToken { sha256, ttl_ms } => self.create_join_token(ts, sha256, *ttl_ms),
            Command::ConsumeJoinToken { sha256, node, public_key_sha256 } => {
                self.consume_join_token(ts, sha256, node, public_key_sha256)
            }
            Command::Compact(cutoffs) => self.compact(ts, cutoffs),
            Command::CreateStep { job_id, epoch, request_id, spec } => {
                self.create_step(ts, *job_id, *epoch, request_id, spec)
            }
            Command::StepEnded { job_id, epoch, step, end } => self.step_ended(ts, *job_id, *epoch, *step, end),
            Command::SignalStep { job_id, step, signal } => self.signal_step(*job_id, *step, *signal),
        }
    }

    /// Validates a spec against the cluster (tenant, class, capacity) without changing anything.
    /// The API calls it before proposing, apply() calls it again.
    pub fn check_submit(&self, spec: &JobSpec) -> Result<JobSpec, ApplyError> {
        spec.validate()?;
        if spec.layout.submitted_shape.is_some() {
            // What a requeue restores: a submit naming it could swap in another shape later.
            let reason = "set by a placement, never by a submit".into();
            return Err(corral_types::JobSpecError::Invalid { field: "layout.submitted_shape".into(), reason }.into());
        }
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
        if let Some(class) = self.config.priority_classes.get(&spec.priority_class) {
            match (spec.time_limit_secs, class.max_time_secs) {
                (Some(asked), Some(max)) if asked > max => {
                    return Err(ApplyError::TimeAboveClassMax {
                        class: class.name.clone(),
                        requested: format_secs(asked),
                        max: format_secs(max),
                    });
                }
                (None, _) => spec.time_limit_secs = class.default_time_secs.or(class.max_time_secs),
                _ => {}
            }
        }
        // A session without its own idle timeout gets its class's, else the default.
        if let Some(session) = spec.session.as_mut().filter(|s| s.idle_timeout_secs.is_none()) {
            let class = self.config.priority_classes.get(&spec.priority_class);
            let default = class.and_then(|c| c.idle_timeout_secs).unwrap_or(corral_types::DEFAULT_IDLE_TIMEOUT_SECS);
            session.idle_timeout_secs = Some(default);
        }
        // Capacity checks only once nodes exist: before the first registration a job simply waits.
        if !self.nodes.is_empty() && !spec.sched.node_selector.is_empty() {
            let matching =
                self.nodes.values().any(|n| crate::sched::selects(&n.spec.labels, &spec.sched.node_selector));
            if !matching {
                return Err(ApplyError::JobControl(format!(
                    "no registered node has the labels {} (from --partition/--constraint; `corral nodes` lists the labels)",
                    spec.sched.node_selector.join(",")
                )));
            }
        }
        if !self.nodes.is_empty() {
            let caps = &self.index.caps;
            let largest_gpus = caps.largest_gpus();
            // Tasks that spread over nodes: refused only when no node count holds them.
            let (parts, per_node) = match spec.spreads() {
                true => match spread_shapes(&spec, largest_gpus, |g| caps.nodes_with(g)).first() {
                    Some(nodes) => gang_shape(&spec.spread_over(*nodes)),
                    None => {
                        let per_task = spec.layout.gpus_per_task;
                        let nodes = spec.layout.ntasks;
                        match per_task > largest_gpus {
                            true => (1, per_task),
                            false => (nodes, per_task),
                        }
                    }
                },
                false => gang_shape(&spec),
            };
            if per_node > largest_gpus {
                return Err(ApplyError::TooManyGpus { requested: per_node, largest: largest_gpus });
            }
            if parts > 1 && caps.nodes_with(per_node) < parts {
                return Err(ApplyError::GangTooLarge { nodes: parts, per_node, available: caps.nodes_with(per_node) });
            }
            match &spec.gpu_slice {
                Some(GpuSlice::Mig { profile, compute_slices })
                    if !caps.mig_cards.iter().any(|m| MigShape::resolve(profile, *compute_slices, *m).is_some()) =>
                {
                    return Err(ApplyError::NoMigGpu { profile: profile.clone() });
                }
                Some(GpuSlice::Mps { memory_mib: Some(mib), .. }) if *mib > caps.largest_gpu_memory_mib => {
                    return Err(ApplyError::SliceTooLarge {
                        requested: format_size(mib << 20),
                        largest: format_size(caps.largest_gpu_memory_mib << 20),
                    });
                }
                _ => {}
            }
            if spec.memory_bytes > caps.largest_memory_bytes {
                return Err(ApplyError::TooMuchMemory {
                    requested: format_size(spec.memory_bytes),
                    largest: format_size(caps.largest_memory_bytes),
                });
            }
            if u64::from(spec.cpu_millis) > caps.largest_cpu_millis {
                return Err(ApplyError::TooManyCpus {
                    requested: format!("{:.1}", f64::from(spec.cpu_millis) / 1000.0),
                    largest: format!("{:.1}", caps.largest_cpu_millis as f64 / 1000.0),
                });
            }
        }
        Ok(spec)
    }

    /// Returns the job id and whether the request id was seen before.
    pub(crate) fn submit(
        &mut self,
        ts: Timestamp,
        request_id: &str,
        spec: &JobSpec,
    ) -> Result<(JobId, bool), ApplyError> {
        let key = (!request_id.is_empty()).then(|| RequestKey::of(request_id));
        if let Some(record) = key.and_then(|key| self.request_ids.get(&key)) {
            return Ok((record.job_id, true));
        }
        let spec = self.check_submit(spec)?;
        if let Some(max) = self.config.tenant_policy(&spec.tenant).and_then(|p| p.max_pending_jobs) {
            // An array counts as its tasks, created or not (as Slurm's MaxSubmitJobs does).
            let adding = spec.array.as_ref().map_or(1, |a| a.len());
            let pending = self.pending_count_of(&spec.tenant);
            if pending + adding > u64::from(max) {
                return Err(ApplyError::TooManyPendingJobs { tenant: spec.tenant, pending, adding, max });
            }
        }
        let waiting_on = self.dependencies_of(&spec)?;
        let held = spec.sched.hold;
        let array_progress = spec.array.as_ref().map(|_| corral_types::ArrayProgress::default());
        let reason = if held {
            Some("held: corral release lets it run".to_string())
        } else {
            crate::jobctl::waiting_reason(&waiting_on)
        };
        let id = self.next_job_id;
        self.next_job_id += 1;
        let job =
            Job { reason, held, waiting_on, array_progress, ..Job::pending(id, spec, request_id.to_string(), ts) };
        if let Some(key) = key {
            let record = RequestRecord { job_id: id, at: ts };
            self.request_ids.insert(key, record);
            self.request_order.insert((ts, key));
            self.added_request_ids.push((key, record));
        }
        let array = job.is_array();
        self.jobs.insert(id, job);
        self.set_job_state_index(id, JobState::Pending);
        if array {
            // Its first tasks are created in this command.
            self.follow_ups.push(id);
        }
        Ok((id, false))
    }

    /// Quota numbers of `tenant` for a job of `class`, from the running jobs.
    pub(crate) fn quota_numbers(&self, tenant: &str, class: &str) -> QuotaNumbers {
        let policy = self.config.tenant_policy(tenant);
        let load = self.index.tenants.get(tenant);
        QuotaNumbers {
            tenant_used: load.map(|l| l.milli_gpus).unwrap_or(0),
            tenant_quota: policy.and_then(|p| p.quota_milli_gpus),
            borrowing_limit: policy.and_then(|p| p.borrowing_limit_milli_gpus),
            cohort: policy
                .and_then(|p| p.cohort.as_deref())
                .map(|c| (self.cohort_usage(c), self.config.cohort_quota(c))),
            class: policy
                .and_then(|p| p.class_quotas.get(class))
                .map(|cap| (load.and_then(|l| l.by_class.get(class)).copied().unwrap_or(0), *cap)),
        }
    }

    /// Checks a placement against the state; returns the slice the job gets (for a slice job).
    fn validate_placement(&self, job: &Job, p: &Placement) -> Result<Option<SliceAssignment>, String> {
        let parts = p.parts().count();
        // Tasks that spread over nodes: the placement chooses the count, the job's shape follows.
        let spread = job.spec.spreads().then(|| job.spec.spread_over(parts as u32));
        let spec = spread.as_ref().unwrap_or(&job.spec);
        if spread.is_some() && !(1..=job.spec.layout.ntasks as usize).contains(&parts) {
            return Err(format!("{} tasks cannot spread over {parts} node(s)", job.spec.layout.ntasks));
        }
        let (parts_needed, per_node) = gang_shape(spec);
        if parts != parts_needed as usize {
            return Err(format!("the job runs on {parts_needed} node(s), the placement names {parts}"));
        }
        if spec.gpu_slice.is_none() && p.slice.is_some() {
            return Err("a whole-gpu job cannot take a slice".into());
        }
        let mut nodes = BTreeSet::new();
        let mut slice = None;
        // `--exclusive` without GPUs: every GPU of its nodes (`JobSpec::takes_whole_nodes_gpus`).
        let whole = spec.takes_whole_nodes_gpus();
        for (name, gpus) in p.parts() {
            if !nodes.insert(name) {
                return Err(format!("node {name} appears twice"));
            }
            let node = self.nodes.get(name).ok_or_else(|| format!("node '{name}' is not registered"))?;
            if node.state != NodeState::Up {
                return Err(format!("node {name} is not up"));
            }
            if node.mode != NodeMode::Active {
                return Err(format!("node {name} is {} and takes no new jobs", node.mode.as_str()));
            }
            if !crate::sched::selects(&node.spec.labels, &spec.sched.node_selector) {
                return Err(format!(
                    "node {name} lacks the labels the job needs ({})",
                    spec.sched.node_selector.join(",")
                ));
            }
            if whole {
                let healthy =
                    node.spec.gpus.iter().filter(|d| !node.gpu_faults.iter().any(|m| m.gpu == d.index)).count();
                if gpus.len() != healthy {
                    return Err(format!(
                        "an --exclusive job that asks for no GPUs takes every GPU of node {name} ({healthy}), the placement names {}",
                        gpus.len()
                    ));
                }
            } else if gpus.len() != per_node as usize {
                return Err(format!("wrong number of gpus on {name}: the job needs {per_node}"));
            }
            let unique: BTreeSet<u32> = gpus.iter().copied().collect();
            if unique.len() != gpus.len() || !gpus.iter().all(|g| node.spec.gpus.iter().any(|d| d.index == *g)) {
                return Err("unknown or repeated gpu index".into());
            }
            if let Some(mark) = node.gpu_faults.iter().find(|m| gpus.contains(&m.gpu)) {
                return Err(format!("gpu {} of node {name} is out for a card fault: {}", mark.gpu, mark.reason));
            }
            let load = self.index.nodes.get(name);
            let (used_cpu, used_mem) = load.map(|l| (l.cpu_millis, l.memory_bytes)).unwrap_or((0, 0));
            if used_cpu + u64::from(spec.cpu_millis) > node.spec.cpu_millis
                || used_mem + spec.memory_bytes > node.spec.memory_bytes
            {
                return Err(format!("not enough cpu or memory left on node {name}"));
            }
            let gpu_load = |g: &u32| load.and_then(|l| l.gpus.get(g));
            match &spec.gpu_slice {
                None => {
                    if gpus.iter().any(|g| gpu_load(g).is_some()) {
                        return Err("gpu already allocated".into());
                    }
                }
                Some(wanted) => {
                    let device = node.spec.gpus.iter().find(|d| d.index == gpus[0]).ok_or("unknown gpu index")?;
                    slice = Some(fit_slice(device, gpu_load(&gpus[0]), wanted, p.slice.as_ref())?);
                }
            }
        }
        if let Some(max) = self.config.tenant_policy(&spec.tenant).and_then(|p| p.max_running_jobs) {
            if self.running_count_of(&spec.tenant) >= max {
                return Err(format!("tenant {} runs {max} jobs, its limit (max-running-jobs)", spec.tenant));
            }
        }
        let numbers = self.quota_numbers(&spec.tenant, &spec.priority_class);
        let need = match whole {
            true => job_milli_gpus(&spec.with_whole_nodes_gpus(p.gpu_count())),
            false => job_milli_gpus(spec),
        };
        if let Err(limit) = quota::check(&numbers, need) {
            return Err(
                quota::describe(&self.config, &spec.tenant, &spec.priority_class, &numbers, need, limit).to_string()
            );
        }
        Ok(slice)
    }

    /// Applies one placement, all-or-nothing.
    fn place(&mut self, ts: Timestamp, p: &Placement) -> Response {
        let job_id = p.job_id;
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if job.state != JobState::Pending {
            return Ok(Outcome::Stale);
        }
        // Only queued jobs run: an array runs as its tasks; a held job or one waiting on a
        // dependency waits, whatever a proposal says.
        if job.is_array() || job.held || !job.waiting_on.is_empty() {
            let why = if job.is_array() {
                "it is a job array (its tasks run)"
            } else {
                "it is held or waits on a dependency"
            };
            return Err(ApplyError::PlacementRejected { job_id, reason: why.to_string() });
        }
        let slice =
            self.validate_placement(job, p).map_err(|reason| ApplyError::PlacementRejected { job_id, reason })?;
        if let Some(reason) = p.parts().find_map(|(node, _)| self.lease_refusal(&job.spec, node, ts)) {
            return Err(ApplyError::PlacementRejected { job_id, reason });
        }
        // A gang's parts meet on a port of its first node: apply chooses it, so there is no
        // proposal to trust.
        let master_port = match p.more_nodes.is_empty() {
            true => None,
            false => Some(
                gang::free_port(self, &p.node).map_err(|reason| ApplyError::PlacementRejected { job_id, reason })?,
            ),
        };
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if job.spec.spreads() {
            // From here on a gang of the nodes chosen (`requeue` lets it spread again).
            job.spec = job.spec.spread_over(p.parts().count() as u32);
        } else if job.spec.takes_whole_nodes_gpus() {
            // Holds, and is billed for, every GPU of its nodes (`requeue` asks for none again).
            job.spec = job.spec.with_whole_nodes_gpus(p.gpu_count());
        }
        job.state = JobState::Running;
        job.allocation = Some(Allocation {
            node: p.node.clone(),
            gpus: p.gpus.clone(),
            epoch,
            more_nodes: p.more_nodes.clone(),
            slice,
            ended: Vec::new(),
            price_breaks: Vec::new(),
            ready: Vec::new(),
            idle: Vec::new(),
            master_port,
        });
        job.attempts += 1;
        job.admitted_at = Some(ts);
        job.reason = None;
        job.preemption = None;
        self.index.add_allocation(&self.jobs[&job_id]);
        self.set_job_state_index(job_id, JobState::Running);
        Ok(Outcome::Done)
    }

    /// Whether `victim` may be preempted for `preemptor`: a lower priority and a class that
    /// preempts lower ones, or quota the victim's tenant borrowed from the preemptor's cohort
    /// while the preemptor's tenant is within its own quota (reclaim).
    pub(crate) fn preemption_allowed(&self, victim: &Job, preemptor: &Job) -> Result<(), String> {
        let config = &self.config;
        let by_priority = config.priority_classes.get(&preemptor.spec.priority_class).is_some_and(|c| c.preempts_lower)
            && config.priority_value(&victim.spec.priority_class)
                < config.priority_value(&preemptor.spec.priority_class);
        if by_priority {
            return Ok(());
        }
        let (vt, pt) = (&victim.spec.tenant, &preemptor.spec.tenant);
        let (vp, pp) = (config.tenant_policy(vt), config.tenant_policy(pt));
        let reclaim = vt != pt
            && matches!((vp.and_then(|p| p.cohort.as_ref()), pp.and_then(|p| p.cohort.as_ref())), (Some(a), Some(b)) if a == b)
            && vp.and_then(|p| p.quota_milli_gpus).is_some_and(|q| self.tenant_usage(vt) > q)
            && pp
                .and_then(|p| p.quota_milli_gpus)
                .is_some_and(|q| self.tenant_usage(pt) + job_milli_gpus(&preemptor.spec) <= q);
        if reclaim {
            return Ok(());
        }
        Err(format!(
            "job {} neither has a higher priority that preempts lower ones nor reclaims quota that job {}'s tenant borrowed",
            preemptor.id, victim.id
        ))
    }

    fn preempt(&mut self, ts: Timestamp, job_id: JobId, by: JobId, grace_secs: u32) -> Response {
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let preemptor = self.jobs.get(&by).ok_or(ApplyError::NoSuchJob(by))?;
        if job.state != JobState::Running
            || job.cancel_requested
            || job.preemption.is_some()
            || preemptor.state != JobState::Pending
        {
            return Ok(Outcome::Stale);
        }
        self.preemption_allowed(job, preemptor).map_err(|reason| ApplyError::PreemptionRejected { job_id, reason })?;
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        job.preemption =
            Some(PreemptionNotice { by, at: ts, grace_secs, checkpoint_signal: job.spec.sched.checkpoint_signal });
        self.index.preemptors.entry(by).or_default().insert(job_id);
        Ok(Outcome::Done)
    }

    /// Applies a pass: each placement and preemption on its own, in order.
    fn schedule(&mut self, ts: Timestamp, placements: &[Placement], preemptions: &[Preemption]) -> Outcome {
        let mut out = ScheduleOutcome::default();
        for p in placements {
            match self.place(ts, p) {
                Ok(Outcome::Done) => out.placed.push(p.job_id),
                Ok(_) => out.rejected.push((p.job_id, "job is no longer pending".into())),
                Err(e) => out.rejected.push((p.job_id, e.to_string())),
            }
        }
        for p in preemptions {
            match self.preempt(ts, p.job_id, p.by, p.grace_secs) {
                Ok(Outcome::Done) => out.preempted.push(p.job_id),
                Ok(_) => {
                    out.rejected.push((p.job_id, "job is no longer running or its preemptor no longer waits".into()))
                }
                Err(e) => out.rejected.push((p.job_id, e.to_string())),
            }
        }
        Outcome::Scheduled(out)
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

    /// Records that `node`'s part of run `epoch` has its image ready, once. A node with no part
    /// in the run, or whose part already ended, is stale.
    fn part_ready(&mut self, job_id: JobId, epoch: u64, node: &str) -> Response {
        let Some(alloc) = self.current_run(job_id, epoch)?.and_then(|job| job.allocation.as_mut()) else {
            return Ok(Outcome::Stale);
        };
        let is_part = alloc.parts().any(|(n, _)| n == node);
        if !is_part || alloc.ended.iter().any(|e| e.node == node) {
            return Ok(Outcome::Stale);
        }
        if !alloc.ready.iter().any(|n| n == node) {
            alloc.ready.push(node.to_owned());
        }
        Ok(Outcome::Done)
    }

    /// Records that the GPUs of `node`'s part of run `epoch` of a session stayed idle past its
    /// idle timeout (`idle`), or were busy again (not `idle`). A node with no part in the run,
    /// or whose part already ended, is stale.
    fn part_idle(&mut self, job_id: JobId, epoch: u64, node: &str, idle: bool) -> Response {
        let Some(alloc) = self.current_run(job_id, epoch)?.and_then(|job| job.allocation.as_mut()) else {
            return Ok(Outcome::Stale);
        };
        let is_part = alloc.parts().any(|(n, _)| n == node);
        if !is_part || alloc.ended.iter().any(|e| e.node == node) {
            return Ok(Outcome::Stale);
        }
        let listed = alloc.idle.iter().any(|n| n == node);
        match (idle, listed) {
            (true, false) => alloc.idle.push(node.to_owned()),
            (false, true) => alloc.idle.retain(|n| n != node),
            _ => {}
        }
        Ok(Outcome::Done)
    }

    /// Ends the current run of a job: ends its live steps, charges fair-share usage, writes its
    /// billing segment (labelled `end_state`, ended by `cause`) and frees its resources in the
    /// indexes. `length` is `None` for a run that never started (nothing to bill or charge).
    fn end_run(&mut self, ts: Timestamp, job_id: JobId, end_state: &str, cause: EndCause, length: Option<RunLength>) {
        // No step outlives the run it was made in.
        self.end_live_steps(ts, job_id, end_state);
        if let Some(length) = length {
            self.close_segment(job_id, ts, end_state, cause, length);
        }
        let Some(job) = self.jobs.get(&job_id) else { return };
        let placed = job.admitted_at.or(job.started_at);
        if let (Some(length), Some(placed)) = (length, placed) {
            let billed = billed_ms(placed, job.started_at.unwrap_or(placed), ts, length);
            let multiplier = self
                .config
                .priority_classes
                .get(&job.spec.priority_class)
                .map(|c| u64::from(c.billing_multiplier_milli))
                .unwrap_or(1000);
            let weighted = job_milli_gpus(&job.spec) * multiplier / 1000;
            let half_life = self.config.scheduler.usage_half_life_secs;
            let end_ms = ts.physical_ms();
            self.usage.charge(&job.spec.tenant, end_ms.saturating_sub(billed), end_ms, weighted, half_life);
        }
        self.index.remove_allocation(job);
    }

    /// Puts a job whose run ended back in the queue.
    fn requeue(&mut self, job_id: JobId, reason: String) {
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        // The node count or GPUs a placement chose were its run's: the next run chooses anew
        // (`JobSpec::restore_submitted_shape`, before the index reads the spec).
        job.spec.restore_submitted_shape();
        job.state = JobState::Pending;
        job.allocation = None;
        job.admitted_at = None;
        job.started_at = None;
        job.preemption = None;
        job.reason = Some(reason);
        self.set_job_state_index(job_id, JobState::Pending);
    }

    /// A worker's exit report. A single-node job's run ends with it; a gang's part ends, and the
    /// run ends once every part has ended (`finish_gang`).
    fn job_finished(
        &mut self,
        ts: Timestamp,
        job_id: JobId,
        epoch: u64,
        node: &str,
        report: &JobExitReport,
    ) -> Response {
        let Some(job) = self.current_run(job_id, epoch)? else {
            return Ok(Outcome::Stale);
        };
        let batch_once = job.runs_batch_once();
        let Some(alloc) = job.allocation.as_mut() else { return Ok(Outcome::Stale) };
        // The card faults of the run's GPUs leave placement in this same command, before the
        // run is requeued: no later pass can put it back on them.
        let part_node = if node.is_empty() { alloc.node.clone() } else { node.to_string() };
        let held = alloc.gpus_on(&part_node).unwrap_or(&[]);
        let faults: Vec<GpuFaultMark> = report
            .gpu_faults
            .iter()
            .filter(|m| held.contains(&m.gpu))
            .map(|m| GpuFaultMark { job_id, ..m.clone() })
            .collect();
        // Only faults of the GPUs the run held count.
        let owned;
        let report = if faults.len() == report.gpu_faults.len() {
            report
        } else {
            owned = JobExitReport { gpu_faults: faults.clone(), ..report.clone() };
            &owned
        };
        if alloc.is_gang() && !node.is_empty() {
            if alloc.gpus_on(node).is_none() || alloc.part_ended(node) {
                return Ok(Outcome::Stale);
            }
            alloc.ended.push(PartEnd { node: node.to_string(), report: Some(report.clone()) });
            if let Some(status) = self.nodes.get_mut(&part_node) {
                mark_gpu_faults(status, &faults);
            }
            let Some(alloc) = self.jobs.get_mut(&job_id).and_then(|j| j.allocation.as_mut()) else {
                return Ok(Outcome::Stale);
            };
            // A batch job ends with its batch step, on the first node, as in Slurm: the other
            // parts only held the allocation, and leave with it.
            let batch_step_ended = batch_once && alloc.part_ended(&alloc.node);
            if !alloc.all_parts_ended() && !batch_step_ended {
                return Ok(Outcome::Done);
            }
            return self.finish_gang(ts, job_id);
        }
        if let Some(status) = self.nodes.get_mut(&part_node) {
            mark_gpu_faults(status, &faults);
        }
        let node = part_node;
        let length = ran(report).then_some(RunLength::Reported { worker_ms: report.run_time_ms });
        self.finish_reported(ts, job_id, &node, report, length)
    }

    /// Ends a gang's run once every part has ended (a batch job: once its batch step, on the
    /// first node, has). The first part that did not exit 0 decides how (a part lost with its
    /// node: as a lost node), else the run succeeded; the run lasted as long as its longest
    /// part (a lost part: the TSO interval), a batch job as long as its batch step.
    fn finish_gang(&mut self, ts: Timestamp, job_id: JobId) -> Response {
        let ended = match self.jobs.get(&job_id).and_then(|j| j.allocation.as_ref()) {
            Some(alloc) => alloc.ended.clone(),
            None => return Ok(Outcome::Stale),
        };
        let Some(decisive) = ended.iter().find(|e| !e.succeeded()).or(ended.first()) else {
            return Ok(Outcome::Stale);
        };
        let Some(report) = &decisive.report else {
            let reason = format!("requeued: node {} was lost while it ran part of the job", decisive.node);
            self.finish_lost(ts, job_id, &reason, RunLength::Lost);
            return Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())));
        };
        // A batch job ran as long as its batch step (the first node's part): its other parts
        // only held the allocation for steps, which run inside the batch step's time.
        let (first_node, batch_once) = match self.jobs.get(&job_id) {
            Some(job) => (job.allocation.as_ref().map(|a| a.node.clone()), job.runs_batch_once()),
            None => return Ok(Outcome::Stale),
        };
        let billed: Vec<&PartEnd> = ended
            .iter()
            .filter(|e| !batch_once || e.report.is_none() || Some(&e.node) == first_node.as_ref())
            .collect();
        let reports: Vec<&JobExitReport> = billed.iter().filter_map(|e| e.report.as_ref()).collect();
        let mut combined = report.clone();
        combined.run_time_ms = reports.iter().map(|r| r.run_time_ms).max().unwrap_or(0);
        combined.never_started = reports.iter().all(|r| r.never_started);
        let length = if reports.len() < billed.len() {
            Some(RunLength::Lost)
        } else if !reports.iter().any(|r| ran(r)) {
            None
        } else {
            Some(RunLength::Reported { worker_ms: combined.run_time_ms })
        };
        let node = decisive.node.clone();
        self.finish_reported(ts, job_id, &node, &combined, length)
    }

    /// Ends the current run as `report` (from `node`) says, billed for `length` (`None`: it
    /// never started).
    fn finish_reported(
        &mut self,
        ts: Timestamp,
        job_id: JobId,
        node: &str,
        report: &JobExitReport,
        length: Option<RunLength>,
    ) -> Response {
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let preempted_by = job.preemption.as_ref().map(|p| p.by).filter(|_| !job.cancel_requested);
        let (cancelled, no_requeue) = (job.cancel_requested, job.spec.sched.no_requeue);
        // Whose doing the end was, for the bill: a request (cancel, preemption, drain) first, then
        // a lost node or worker (a gang part that never reported, a worker cut off from the
        // coordinators), then the job itself.
        let cause = if cancelled {
            EndCause::Cancelled
        } else if let Some(by) = preempted_by {
            if by == DRAIN_PREEMPTOR {
                EndCause::Drained
            } else if by == corral_types::LEASE_PREEMPTOR {
                EndCause::LeaseEnded
            } else {
                EndCause::Preempted
            }
        } else if !report.gpu_faults.is_empty() {
            EndCause::GpuFault
        } else if report.fenced || length == Some(RunLength::Lost) {
            EndCause::NodeLost
        } else if report.idle_end.is_some() {
            // The pool's own rule ended the session (its state is `cancelled`, as if cancelled).
            EndCause::Idle
        } else if report.timed_out {
            EndCause::TimeLimit
        } else {
            EndCause::Exited
        };
        if length.is_some() && !report.never_started {
            job.worker_run_time_ms = Some(report.run_time_ms);
            if job.started_at.is_none() {
                // No start report (skipped for a short job, or lost): the worker's run time says
                // when it started.
                let placed = job.admitted_at.unwrap_or(ts);
                let estimate = Timestamp::compose(ts.physical_ms().saturating_sub(report.run_time_ms), 0);
                job.started_at = Some(estimate.clamp(placed.min(ts), ts));
            }
        }
        // A run that did not end on its own goes back to the queue, unless it was cancelled (it
        // ends cancelled) or preempted with requeueing opted out (it ends preempted).
        let requeue_reason = if cancelled {
            None
        } else if let Some(by) = preempted_by {
            // However the process ended after the notice (a checkpointing job often exits 0),
            // the work is not done.
            (!no_requeue).then(|| preempted_reason(by, node))
        } else if let Some(fault) = report.gpu_faults.first() {
            // The card's fault, not the job's: no restart is counted.
            Some(format!("requeued: gpu {} of node {node} faulted: {}", fault.gpu, fault.reason))
        } else if report.fenced {
            Some(format!("requeued: node {node} lost contact with the coordinators and stopped the job"))
        } else if report.never_started {
            Some(format!("requeued: node {node} did not start the job"))
        } else {
            // A failed run is restarted (a gang as a whole) up to `max_restarts` times.
            gang::restart_reason(job, node, report).inspect(|_| job.restarts += 1)
        };
        if let Some(reason) = requeue_reason {
            let label = if preempted_by.is_some() { "preempted" } else { "requeued" };
            self.end_run(ts, job_id, label, cause, length);
            self.requeue(job_id, reason);
            return Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())));
        }
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let (state, reason) = if cancelled {
            let reason = job.reason.clone().unwrap_or_else(|| "cancelled".into());
            let reason = if report.never_started { format!("{reason} (before it started)") } else { reason };
            (JobState::Cancelled, reason)
        } else if let Some(by) = preempted_by {
            (JobState::Preempted, format!("preempted by job {by} (the job opted out of requeueing)"))
        } else if let Some(idle) = &report.idle_end {
            (JobState::Cancelled, idle.clone())
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
        let reason = if job.allocation.as_ref().is_some_and(Allocation::is_gang) && state == JobState::Failed {
            format!("{reason} (on node {node})")
        } else {
            reason
        };
        let reason = match (state, job.restarts) {
            (JobState::Failed, 1) => format!("{reason}, after 1 restart"),
            (JobState::Failed, n) if n > 1 => format!("{reason}, after {n} restarts"),
            _ => reason,
        };
        self.end_run(ts, job_id, state.as_str(), cause, length);
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        job.state = state;
        job.reason = Some(reason);
        job.exit_code = report.exit_code;
        job.signal = report.signal;
        job.finished_at = Some(ts);
        self.set_job_state_index(job_id, state);
        Ok(Outcome::Job(Box::new(self.jobs[&job_id].clone())))
    }

    pub(crate) fn cancel(&mut self, ts: Timestamp, job_id: JobId, reason: &str) -> Response {
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let reason = if reason.is_empty() { "cancelled".to_string() } else { reason.to_string() };
        if job.is_array() {
            return self.cancel_array(ts, job_id, &reason);
        }
        match job.state {
            JobState::Pending => {
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

    /// Registers `spec` under a new epoch. `stale_jobs_stopped_ms_ago`: a restarted worker
    /// process stopped the runs of the old registration that long before this entry's ts, so
    /// they are billed until then, however long its registration took to get through.
    fn register_node(&mut self, ts: Timestamp, spec: &NodeSpec, stale_jobs_stopped_ms_ago: Option<u64>) -> Outcome {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let length = match stale_jobs_stopped_ms_ago {
            Some(ago) => RunLength::LostStoppedBy(Timestamp::compose(ts.physical_ms().saturating_sub(ago), 0)),
            None => RunLength::Lost,
        };
        // A (re-)registering worker starts empty: whatever ran there under an older epoch is gone.
        self.requeue_jobs_on(ts, &spec.name, &format!("requeued: node {} restarted", spec.name), length);
        // A cordon or drain outlives the worker's restart.
        let (mode, mode_reason, drain_deadline) =
            self.nodes.get(&spec.name).map(|n| (n.mode, n.mode_reason.clone(), n.drain_deadline)).unwrap_or_default();
        // So do GPU fault marks: the new process clears them once it reads the GPUs clean.
        let gpu_faults = self.nodes.get(&spec.name).map(|n| n.gpu_faults.clone()).unwrap_or_default();
        // And an operator's lease end (it wins over the worker's until cleared).
        let lease_end_set = self.nodes.get(&spec.name).and_then(|n| n.lease_end_set);
        let status = NodeStatus {
            spec: spec.clone(),
            state: NodeState::Up,
            epoch,
            mode,
            mode_reason,
            drain_deadline,
            gpu_faults,
            lease_end_set,
        };
        let new = self.nodes.insert(spec.name.clone(), status);
        self.index.caps.registered(&self.nodes, &spec.name, new.is_none());
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
            self.requeue_jobs_on(ts, node, &format!("requeued: {why}"), RunLength::Lost);
        }
        Ok(Outcome::Done)
    }

    /// Sets or clears a GPU's fault mark (see `Command::SetGpuFault`). A mark is only replaced by
    /// a later one (a newer worker process, or more faults counted by the same one), so a
    /// retried or reordered command changes nothing.
    fn set_gpu_fault(&mut self, node: &str, mark: &GpuFaultMark, clear: bool) -> Response {
        let status = self.nodes.get_mut(node).ok_or_else(|| ApplyError::NoSuchNode(node.to_string()))?;
        if !status.spec.gpus.iter().any(|g| g.index == mark.gpu) {
            return Err(ApplyError::NoSuchGpu { node: node.to_string(), gpu: mark.gpu });
        }
        let pos = status.gpu_faults.iter().position(|m| m.gpu == mark.gpu);
        match (pos, clear) {
            (Some(i), true) if status.gpu_faults[i].cleared_by(mark.node_epoch, mark.seq) => {
                status.gpu_faults.remove(i);
                Ok(Outcome::Done)
            }
            (None, false) => {
                mark_gpu_faults(status, std::slice::from_ref(mark));
                Ok(Outcome::Done)
            }
            (Some(i), false)
                if (mark.node_epoch, mark.seq) > (status.gpu_faults[i].node_epoch, status.gpu_faults[i].seq) =>
            {
                status.gpu_faults[i] = mark.clone();
                Ok(Outcome::Done)
            }
            _ => Ok(Outcome::Stale),
        }
    }

    /// Ends the run of every job with a part on `node`: back in the queue, except cancel requests
    /// (cancelled) and preempted jobs that opted out of requeueing (preempted). A gang's part on
    /// `node` ends as lost; its run ends once its other parts have ended too (they are told to
    /// stop), or at once for a batch job's first node (its batch step). A single-node run is
    /// billed as `length` says (a lost run, maybe stopped earlier); a gang's as `finish_gang` says.
    fn requeue_jobs_on(&mut self, ts: Timestamp, node: &str, reason: &str, length: RunLength) {
        let ids: Vec<JobId> = self.jobs_on_node(node).map(|j| j.id).collect();
        for id in ids {
            let batch_once = self.jobs.get(&id).is_some_and(Job::runs_batch_once);
            let gang = self.jobs.get_mut(&id).and_then(|j| j.allocation.as_mut()).filter(|a| a.is_gang());
            if let Some(alloc) = gang {
                if alloc.part_ended(node) {
                    continue;
                }
                alloc.ended.push(PartEnd { node: node.to_string(), report: None });
                // A batch job whose first node was lost lost its batch step: its run is over.
                if alloc.all_parts_ended() || (batch_once && alloc.part_ended(&alloc.node)) {
                    let _ = self.finish_gang(ts, id);
                }
                continue;
            }
            self.finish_lost(ts, id, reason, length);
        }
    }

    /// Ends a run whose node was lost: billed for the TSO interval (to when the node's next worker
    /// process stopped it at the latest, as `length` says), then requeued with `reason`
    /// (cancelled if a cancel was requested, preempted if it was preempted and opted out of
    /// requeueing).
    fn finish_lost(&mut self, ts: Timestamp, id: JobId, reason: &str, length: RunLength) {
        let (label, cause) = match self.jobs.get(&id) {
            Some(j) if j.cancel_requested => ("cancelled", EndCause::Cancelled),
            Some(j) if j.preemption.as_ref().is_some_and(|p| p.by == DRAIN_PREEMPTOR) => {
                ("preempted", EndCause::Drained)
            }
            Some(j) if j.preemption.as_ref().is_some_and(|p| p.by == corral_types::LEASE_PREEMPTOR) => {
                ("preempted", EndCause::LeaseEnded)
            }
            Some(j) if j.preemption.is_some() => ("preempted", EndCause::Preempted),
            _ => ("requeued", EndCause::NodeLost),
        };
        self.end_run(ts, id, label, cause, Some(length));
        let Some(job) = self.jobs.get_mut(&id) else { return };
        let end = if job.cancel_requested {
            Some(JobState::Cancelled)
        } else if job.preemption.is_some() && job.spec.sched.no_requeue {
            Some(JobState::Preempted)
        } else {
            None
        };
        match end {
            Some(state) => {
                job.state = state;
                job.finished_at = Some(ts);
                if state == JobState::Preempted {
                    let by = job.preemption.as_ref().map(|p| p.by).unwrap_or_default();
                    let node = job.allocation.as_ref().map(|a| a.node.clone()).unwrap_or_default();
                    job.reason = Some(format!(
                        "{} (the job opted out of requeueing)",
                        preempted_reason(by, &node).trim_start_matches("requeued: ")
                    ));
                }
                self.set_job_state_index(id, state);
            }
            None => self.requeue(id, reason.to_string()),
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
        config.validate().map_err(ApplyError::InvalidConfig)?;
        self.config = config.clone();
        Ok(Outcome::Done)
    }
}

/// Marks `marks` on the node's GPUs (one mark per GPU, in index order): a mark replaces an
/// earlier one of its GPU, never a later one (`GpuFaultMark::cleared_by`).
fn mark_gpu_faults(status: &mut NodeStatus, marks: &[GpuFaultMark]) {
    for mark in marks {
        if !status.spec.gpus.iter().any(|g| g.index == mark.gpu) {
            continue;
        }
        match status.gpu_faults.binary_search_by_key(&mark.gpu, |m| m.gpu) {
            Ok(i) if (mark.node_epoch, mark.seq) > (status.gpu_faults[i].node_epoch, status.gpu_faults[i].seq) => {
                status.gpu_faults[i] = mark.clone();
            }
            Ok(i) => {
                // The same fault, first marked from a heartbeat: the run it ended is known now.
                let same = &mut status.gpu_faults[i];
                if (same.node_epoch, same.seq, same.job_id) == (mark.node_epoch, mark.seq, 0) {
                    same.job_id = mark.job_id;
                }
            }
            Err(i) => status.gpu_faults.insert(i, mark.clone()),
        }
    }
}

/// Whether the run a report ends ran at all: a run stopped before its launch, or whose launch
/// failed, never started (no start time, no segment, nothing billed or charged).
fn ran(report: &JobExitReport) -> bool {
    !report.never_started && report.launch_error.is_none()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{place, Placement, ScheduleOutcome};
    use corral_types::{GpuDevice, GpuSlice, NodeGpus};

    pub(crate) fn req(ts: u64, command: Command) -> Request {
        Request { ts: Timestamp(ts), command }
    }

    pub(crate) fn node(name: &str, gpus: u32) -> NodeSpec {
        NodeSpec {
            name: name.into(),
            address: "127.0.0.1:1".into(),
            gpus: (0..gpus)
                .map(|i| GpuDevice {
                    index: i,
                    uuid: format!("GPU-{name}-{i}"),
                    model: "RTX 5090".into(),
                    memory_mib: 32768,
                    ..Default::default()
                })
                .collect(),
            cpu_millis: 16_000,
            memory_bytes: 64 << 30,
            labels: vec![],
            rendezvous_ports: None,
            lease_end: None,
        }
    }

    pub(crate) fn spec(gpus: u32) -> JobSpec {
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
            command: vec!["true".into()].into(),
            env: Default::default(),
            sched: Default::default(),
            ..Default::default()
        }
    }

    pub(crate) fn cluster() -> State {
        let mut s = State::default();
        s.apply(&req(1, Command::Configure(ClusterConfig::dev_defaults()))).unwrap();
        s.apply(&req(2, Command::RegisterNode { spec: node("n1", 8) })).unwrap();
        s
    }

    pub(crate) fn submit(s: &mut State, ts: u64, rid: &str, spec: JobSpec) -> Response {
        s.apply(&req(ts, Command::SubmitJob { request_id: rid.into(), spec }))
    }

    fn schedule(s: &mut State, ts: u64) -> Vec<Placement> {
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
        s.apply(&req(7, Command::JobFinished { job_id: 1, epoch, node: String::new(), report })).unwrap();
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
            s.apply(&req(
                12,
                Command::JobFinished { job_id: 1, epoch: e1 + 100, node: String::new(), report: fail.clone() }
            )),
            Ok(Outcome::Stale)
        );
        s.apply(&req(13, Command::JobFinished { job_id: 1, epoch: e1, node: String::new(), report: fail.clone() }))
            .unwrap();
        let j = &s.jobs[&1];
        assert_eq!(
            (j.state, j.exit_code, j.started_at, j.finished_at),
            (JobState::Failed, Some(3), Some(Timestamp(11)), Some(Timestamp(13)))
        );
        // A duplicate report of the same run changes nothing.
        assert_eq!(
            s.apply(&req(14, Command::JobFinished { job_id: 1, epoch: e1, node: String::new(), report: fail })),
            Ok(Outcome::Stale)
        );
        assert_eq!(s.jobs[&1].finished_at, Some(Timestamp(13)));

        let oom = JobExitReport { signal: Some(9), oom_killed: true, ..Default::default() };
        let e2 = epoch(&s, 2);
        s.apply(&req(15, Command::JobFinished { job_id: 2, epoch: e2, node: String::new(), report: oom })).unwrap();
        assert_eq!(s.jobs[&2].state, JobState::Failed);
        assert!(s.jobs[&2].reason.as_deref().unwrap().starts_with("oom-killed"));

        s.apply(&req(16, Command::CancelJob { job_id: 3, reason: "cancelled by user".into() })).unwrap();
        assert_eq!(s.jobs[&3].state, JobState::Running, "running job ends only when the worker reports");
        let killed = JobExitReport { signal: Some(9), ..Default::default() };
        let e3 = epoch(&s, 3);
        s.apply(&req(17, Command::JobFinished { job_id: 3, epoch: e3, node: String::new(), report: killed })).unwrap();
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
    fn ledger_charges_each_run_once_at_its_rates() {
        let mut s = cluster();
        let mut high = spec(2);
        high.priority_class = "gpu-high-priority".into();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", high).unwrap();
        schedule(&mut s, Timestamp::compose(1_100, 0).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let started = Timestamp::compose(2_000, 0);
        s.apply(&Request { ts: started, command: Command::JobStarted { job_id: 1, epoch } }).unwrap();
        // 90 minutes later (the worker measured as much); it reports twice (retry after a timeout).
        let done = JobExitReport { exit_code: Some(0), run_time_ms: 5_400_000, ..Default::default() };
        let end = Timestamp::compose(2_000 + 5_400_000, 3);
        let finish = Command::JobFinished { job_id: 1, epoch, node: String::new(), report: done };
        s.apply(&Request { ts: end, command: finish.clone() }).unwrap();
        assert_eq!(s.apply(&Request { ts: Timestamp::compose(9_999_999, 0), command: finish }), Ok(Outcome::Stale));
        assert_eq!(s.ledger.len(), 1, "a duplicate report charges once");
        let seg = &s.ledger[&1];
        assert_eq!((seg.start, seg.end, seg.duration_ms()), (started, end, 5_400_000));
        assert_eq!((seg.gpus, seg.gpu_milli, seg.multiplier_milli), (2, 2000, 2000));
        assert_eq!(seg.gpu_model, "RTX 5090");
        // 1.5 h x 2 GPUs x 0.89 x2 = 5.34
        assert_eq!(seg.cost_micros, 5_340_000);
        assert_eq!(seg.end_state, "succeeded");
    }

    #[test]
    fn a_requeued_run_is_billed_and_the_next_run_is_a_new_segment() {
        let mut s = cluster();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(1_000, 1).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&Request { ts: Timestamp::compose(1_000, 2), command: Command::JobStarted { job_id: 1, epoch } })
            .unwrap();
        // The node is lost 1 hour in: the hour is billed, the job requeued.
        let lost = Command::SetNodeState { node: "n1".into(), state: NodeState::Down, reason: String::new() };
        s.apply(&Request { ts: Timestamp::compose(3_601_000, 0), command: lost }).unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Pending);
        assert_eq!(s.ledger[&1].cost_micros, 890_000);
        assert_eq!(s.ledger[&1].end_state, "requeued");
        s.apply(&req(Timestamp::compose(3_602_000, 0).0, Command::RegisterNode { spec: node("n1", 8) })).unwrap();
        schedule(&mut s, Timestamp::compose(3_603_000, 0).0);
        let epoch2 = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        assert_ne!(epoch, epoch2);
        s.apply(&Request {
            ts: Timestamp::compose(3_603_000, 1),
            command: Command::JobStarted { job_id: 1, epoch: epoch2 },
        })
        .unwrap();
        let done = JobExitReport { exit_code: Some(1), run_time_ms: 1_800_000, ..Default::default() };
        let finish = Command::JobFinished { job_id: 1, epoch: epoch2, node: String::new(), report: done };
        s.apply(&Request { ts: Timestamp::compose(3_603_000 + 1_800_000, 0), command: finish }).unwrap();
        assert_eq!(s.ledger.len(), 2);
        assert_eq!(s.ledger[&2].cost_micros, 445_000);
        assert_eq!(s.ledger[&2].end_state, "failed");
        let total: u64 = s.ledger.values().map(|g| g.cost_micros).sum();
        let expected: u64 =
            s.ledger.values().map(|g| crate::cost_micros(g.duration_ms(), g.gpu_milli, 890_000, 1000)).sum();
        assert_eq!(total, expected);
        assert_eq!(total, 1_335_000);
    }

    /// Every segment says why its run ended, and a cause the policy credits gets a credit entry
    /// of its own right after the segment: its share of the cost, rounded down, tied to the
    /// segment and stamped when the run ended. The job's own failure is not credited.
    #[test]
    fn each_segment_records_its_end_cause_and_credited_causes_get_a_credit_entry() {
        let mut s = cluster();
        s.config.credits = [(EndCause::NodeLost, 1000), (EndCause::TimeLimit, 333)].into();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(1_000, 1).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&Request { ts: Timestamp::compose(1_000, 2), command: Command::JobStarted { job_id: 1, epoch } })
            .unwrap();
        // The node is lost an hour in: the hour is billed and credited in full.
        let lost_at = Timestamp::compose(3_601_000, 0);
        let lost = Command::SetNodeState { node: "n1".into(), state: NodeState::Down, reason: String::new() };
        s.apply(&Request { ts: lost_at, command: lost }).unwrap();
        assert_eq!((s.ledger[&1].cause, s.ledger[&1].cost_micros), (Some(EndCause::NodeLost), 890_000));
        let credit = &s.ledger[&2];
        assert_eq!((credit.credit_for, credit.cost_micros, credit.cause), (Some(1), 890_000, Some(EndCause::NodeLost)));
        assert_eq!((credit.start, credit.end, credit.duration_ms, credit.job_id), (lost_at, lost_at, 0, 1));
        // The next run fails on its own: billed, not credited.
        s.apply(&req(Timestamp::compose(3_602_000, 0).0, Command::RegisterNode { spec: node("n1", 8) })).unwrap();
        schedule(&mut s, Timestamp::compose(3_603_000, 0).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let failed = JobExitReport { exit_code: Some(1), run_time_ms: 1_800_000, ..Default::default() };
        let finish = Command::JobFinished { job_id: 1, epoch, node: String::new(), report: failed };
        s.apply(&Request { ts: Timestamp::compose(3_603_000 + 1_800_000, 0), command: finish }).unwrap();
        assert_eq!(s.ledger.len(), 3, "no credit for the job's own failure");
        assert_eq!((s.ledger[&3].cause, s.ledger[&3].credit_for), (Some(EndCause::Exited), None));
        // A run killed at its time limit, credited a third (rounded down).
        submit(&mut s, Timestamp::compose(5_500_000, 0).0, "b", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(5_500_000, 1).0);
        let epoch = s.jobs[&2].allocation.as_ref().unwrap().epoch;
        let timed_out = JobExitReport { timed_out: true, signal: Some(9), run_time_ms: 600_000, ..Default::default() };
        let finish = Command::JobFinished { job_id: 2, epoch, node: String::new(), report: timed_out };
        s.apply(&Request { ts: Timestamp::compose(6_100_001, 0), command: finish }).unwrap();
        assert_eq!((s.ledger[&4].cause, s.ledger[&4].cost_micros), (Some(EndCause::TimeLimit), 148_333));
        assert_eq!((s.ledger[&5].credit_for, s.ledger[&5].cost_micros), (Some(4), 148_333 * 333 / 1000));
        // Every credit is at most what it credits, and the totals keep charges and credits apart.
        for credit in s.ledger.values().filter(|g| g.is_credit()) {
            assert!(credit.cost_micros <= s.ledger[&credit.credit_for.unwrap()].cost_micros);
        }
        let total = s.billed_by_tenant()[&s.jobs[&1].spec.tenant];
        assert_eq!(total.cost_micros, 890_000 + 445_000 + 148_333);
        assert_eq!(total.credited_micros, 890_000 + 49_394);
    }

    /// A session takes its class's idle timeout (else the default) at submit; a run its worker
    /// ended idle ends cancelled with the worker's reason, billed, never restarted.
    #[test]
    fn an_idle_session_ends_cancelled_with_its_reason_and_is_not_restarted() {
        let mut s = cluster();
        let mut config = ClusterConfig::dev_defaults();
        config.priority_classes.get_mut("preemptible").unwrap().idle_timeout_secs = Some(120);
        s.apply(&req(3, Command::Configure(config))).unwrap();
        let session = |class: &str, timeout: Option<u64>| JobSpec {
            priority_class: class.into(),
            session: Some(corral_types::SessionOptions { idle_timeout_secs: timeout, min_gpu_util_pct: 0 }),
            sched: corral_types::SchedOptions { max_restarts: Some(3), ..Default::default() },
            ..spec(1)
        };
        submit(&mut s, 10, "a", session("preemptible", None)).unwrap();
        submit(&mut s, 11, "b", session("normal", None)).unwrap();
        submit(&mut s, 12, "c", session("normal", Some(5))).unwrap();
        let timeout = |id: u64| s.jobs[&id].spec.session.as_ref().and_then(|o| o.idle_timeout_secs);
        assert_eq!(
            (timeout(1), timeout(2), timeout(3)),
            (Some(120), Some(corral_types::DEFAULT_IDLE_TIMEOUT_SECS), Some(5))
        );
        assert_eq!(s.jobs[&3].spec.session.as_ref().map(|o| o.min_gpu_util()), Some(1));
        schedule(&mut s, 20);
        let epoch = s.jobs[&3].allocation.as_ref().unwrap().epoch;
        let reason = s.jobs[&3].spec.session.as_ref().unwrap().idle_reason(5);
        assert_eq!(reason, "idle: GPU utilisation under 1% for 5s");
        let idle =
            JobExitReport { signal: Some(9), run_time_ms: 6_000, idle_end: Some(reason.clone()), ..Default::default() };
        let finish = Command::JobFinished { job_id: 3, epoch, node: String::new(), report: idle };
        s.apply(&req(Timestamp::compose(7_000, 0).0, finish)).unwrap();
        let job = &s.jobs[&3];
        assert_eq!((job.state, job.reason.as_deref(), job.restarts), (JobState::Cancelled, Some(reason.as_str()), 0));
        let segment = s.ledger.values().find(|g| g.job_id == 3).expect("billed");
        assert_eq!(segment.cause, Some(EndCause::Idle), "billed as ended idle, not as cancelled by its owner");
    }

    /// A cancelled run, a preempted one and one stopped by a drain each say so.
    #[test]
    fn cancels_preemptions_and_drains_are_their_own_causes() {
        for (by, want) in
            [(None, EndCause::Cancelled), (Some(7), EndCause::Preempted), (Some(DRAIN_PREEMPTOR), EndCause::Drained)]
        {
            let mut s = cluster();
            submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
            schedule(&mut s, Timestamp::compose(1_000, 1).0);
            let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
            match by {
                None => {
                    s.apply(&req(
                        Timestamp::compose(2_000, 0).0,
                        Command::CancelJob { job_id: 1, reason: String::new() },
                    ))
                    .unwrap();
                }
                Some(by) => s.stop_for_requeue(Timestamp::compose(2_000, 0), 1, by),
            }
            let killed = JobExitReport { signal: Some(15), run_time_ms: 60_000, ..Default::default() };
            let finish = Command::JobFinished { job_id: 1, epoch, node: String::new(), report: killed };
            s.apply(&Request { ts: Timestamp::compose(61_001, 0), command: finish }).unwrap();
            assert_eq!(s.ledger[&1].cause, Some(want), "{by:?}");
        }
    }

    fn card_fault(gpu: u32, node_epoch: u64, seq: u64) -> GpuFaultMark {
        GpuFaultMark { gpu, reason: "XID 79 (GPU has fallen off the bus)".into(), node_epoch, seq, job_id: 0 }
    }

    /// A card fault ends the run with cause gpu-fault (credited per policy), requeues it without
    /// counting a restart and takes the GPU out of placement in the same command; a retried
    /// report changes nothing; only a reading made after the fault brings the GPU back.
    #[test]
    fn a_card_fault_requeues_the_run_uncounted_credits_it_and_keeps_its_gpu_out() {
        let mut s = cluster();
        s.config.credits = [(EndCause::GpuFault, 1000)].into();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(1_000, 1).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let gpu = s.jobs[&1].allocation.as_ref().unwrap().gpus[0];
        let node_epoch = s.nodes["n1"].epoch;
        s.apply(&Request { ts: Timestamp::compose(1_000, 2), command: Command::JobStarted { job_id: 1, epoch } })
            .unwrap();
        let faulted = JobExitReport {
            signal: Some(9),
            run_time_ms: 60_000,
            gpu_faults: vec![card_fault(gpu, node_epoch, 1), card_fault(7 - gpu.min(6), node_epoch, 1)],
            ..Default::default()
        };
        let finish = Command::JobFinished { job_id: 1, epoch, node: String::new(), report: faulted };
        let at = Timestamp::compose(61_001, 0);
        s.apply(&Request { ts: at, command: finish.clone() }).unwrap();
        let job = &s.jobs[&1];
        assert_eq!((job.state, job.restarts), (JobState::Pending, 0), "requeued, no restart counted");
        assert!(
            job.reason.as_deref().unwrap_or_default().contains(&format!("gpu {gpu} of node n1 faulted")),
            "{job:?}"
        );
        assert_eq!(s.ledger[&1].cause, Some(EndCause::GpuFault));
        assert_eq!((s.ledger[&2].credit_for, s.ledger[&2].cost_micros), (Some(1), s.ledger[&1].cost_micros));
        let marks = &s.nodes["n1"].gpu_faults;
        assert_eq!(marks.len(), 1, "only the run's own GPUs are marked: {marks:?}");
        assert_eq!((marks[0].gpu, marks[0].job_id), (gpu, 1));
        // The report retried (a lost reply): nothing changes.
        assert_eq!(s.apply(&Request { ts: Timestamp::compose(62_000, 0), command: finish }).unwrap(), Outcome::Stale);
        assert_eq!(s.ledger.len(), 2);
        // The requeued run goes to another GPU; a placement on the faulted one is refused.
        let forced = Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: vec![gpu] };
        let refused = s.apply(&req(Timestamp::compose(63_000, 0).0, forced)).unwrap_err();
        assert!(refused.to_string().contains("card fault"), "{refused}");
        schedule(&mut s, Timestamp::compose(63_000, 1).0);
        let again = s.jobs[&1].allocation.as_ref().expect("placed again");
        assert!(!again.gpus.contains(&gpu), "{again:?}");
        // A heartbeat read before the fault cannot clear it; one read after it can.
        let stale = Command::SetGpuFault { node: "n1".into(), mark: card_fault(gpu, node_epoch, 0), clear: true };
        assert_eq!(s.apply(&req(Timestamp::compose(64_000, 0).0, stale)).unwrap(), Outcome::Stale);
        let clean = Command::SetGpuFault { node: "n1".into(), mark: card_fault(gpu, node_epoch, 1), clear: true };
        assert_eq!(s.apply(&req(Timestamp::compose(65_000, 0).0, clean)).unwrap(), Outcome::Done);
        assert!(s.nodes["n1"].gpu_faults.is_empty());
        let unknown = Command::SetGpuFault { node: "n1".into(), mark: card_fault(99, node_epoch, 1), clear: false };
        assert!(s.apply(&req(Timestamp::compose(66_000, 0).0, unknown)).is_err());
    }

    /// The job's own GPU error (XID 13) is its exit like any other: billed, not credited, its
    /// GPU stays in the pool. A cancel that arrives with a card fault ends the run cancelled,
    /// but the GPU still leaves placement.
    #[test]
    fn the_jobs_own_gpu_error_is_not_credited_and_a_cancel_wins_over_a_card_fault() {
        for cancel in [false, true] {
            let mut s = cluster();
            s.config.credits = [(EndCause::GpuFault, 1000)].into();
            submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
            schedule(&mut s, Timestamp::compose(1_000, 1).0);
            let alloc = s.jobs[&1].allocation.clone().unwrap();
            let node_epoch = s.nodes["n1"].epoch;
            let report = if cancel {
                s.apply(&req(Timestamp::compose(2_000, 0).0, Command::CancelJob { job_id: 1, reason: String::new() }))
                    .unwrap();
                let gpu_faults = vec![card_fault(alloc.gpus[0], node_epoch, 1)];
                JobExitReport { signal: Some(9), run_time_ms: 60_000, gpu_faults, ..Default::default() }
            } else {
                JobExitReport { exit_code: Some(1), run_time_ms: 60_000, ..Default::default() }
            };
            let finish = Command::JobFinished { job_id: 1, epoch: alloc.epoch, node: String::new(), report };
            s.apply(&Request { ts: Timestamp::compose(61_001, 0), command: finish }).unwrap();
            let want =
                if cancel { (JobState::Cancelled, EndCause::Cancelled) } else { (JobState::Failed, EndCause::Exited) };
            assert_eq!((s.jobs[&1].state, s.ledger[&1].cause.unwrap()), want);
            assert_eq!(s.ledger.len(), 1, "no credit");
            assert_eq!(s.nodes["n1"].gpu_faults.len(), usize::from(cancel));
        }
    }

    /// A worker killed 1.7 s into a run restarts, stops what its predecessor left running, and
    /// gets through to a leader only 78 s later (the leadership churned): the run is billed until
    /// the new process stopped it, not until its registration. A node declared lost before its
    /// worker came back is billed until the declaration, and the late registration bills nothing.
    #[test]
    fn a_lost_run_is_billed_until_the_node_was_declared_lost_or_its_worker_came_back() {
        let mut s = cluster();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(1_000, 1).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&Request { ts: Timestamp::compose(2_000, 0), command: Command::JobStarted { job_id: 1, epoch } })
            .unwrap();
        // Killed at 3.7 s; the new process stopped the old jobs at 8 s and registered at 86 s.
        let back = Command::RegisterRestartedNode { spec: node("n1", 8), stale_jobs_stopped_ms_ago: 78_000 };
        s.apply(&Request { ts: Timestamp::compose(86_000, 0), command: back }).unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Pending);
        let seg = &s.ledger[&1];
        assert_eq!((seg.start, seg.end), (Timestamp::compose(2_000, 0), Timestamp::compose(8_000, 0)));
        assert_eq!((seg.duration_ms(), seg.lost, seg.end_state.as_str()), (6_000, true, "requeued"));
        assert_eq!(seg.cost_micros, crate::cost_micros(6_000, 1000, 890_000, 1000));

        // The next run: the node is declared lost at 100 s, its worker registers at 150 s saying
        // it stopped the old jobs at 120 s. The declaration bills; the registration finds nothing.
        schedule(&mut s, Timestamp::compose(90_000, 0).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&Request { ts: Timestamp::compose(91_000, 0), command: Command::JobStarted { job_id: 1, epoch } })
            .unwrap();
        let lost = Command::SetNodeState { node: "n1".into(), state: NodeState::Down, reason: String::new() };
        s.apply(&Request { ts: Timestamp::compose(100_000, 0), command: lost }).unwrap();
        let back = Command::RegisterRestartedNode { spec: node("n1", 8), stale_jobs_stopped_ms_ago: 30_000 };
        s.apply(&Request { ts: Timestamp::compose(150_000, 0), command: back }).unwrap();
        assert_eq!(s.ledger.len(), 2, "the registration after the declaration bills nothing more");
        assert_eq!((s.ledger[&2].end, s.ledger[&2].duration_ms()), (Timestamp::compose(100_000, 0), 9_000));

        // A plain re-registration (same worker process) still ends the old runs at its own time.
        schedule(&mut s, Timestamp::compose(151_000, 0).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&Request { ts: Timestamp::compose(152_000, 0), command: Command::JobStarted { job_id: 1, epoch } })
            .unwrap();
        s.apply(&req(Timestamp::compose(160_000, 0).0, Command::RegisterNode { spec: node("n1", 8) })).unwrap();
        assert_eq!(s.ledger[&3].duration_ms(), 8_000);
        // Usage follows the bill: 6 + 9 + 8 s at one GPU.
        let billed: u64 = s.ledger.values().map(|g| g.duration_ms()).sum();
        assert_eq!(billed, 23_000);
    }

    /// A start report that never arrived (lost, or skipped for a short job) no longer bills the
    /// run as zero length: the worker's run time is billed.
    #[test]
    fn a_run_without_a_start_report_bills_its_worker_run_time() {
        let mut s = cluster();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(1_000, 1).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let done = JobExitReport { exit_code: Some(0), run_time_ms: 600_000, ..Default::default() };
        let end = Timestamp::compose(601_500, 0);
        s.apply(&Request {
            ts: end,
            command: Command::JobFinished { job_id: 1, epoch, node: String::new(), report: done },
        })
        .unwrap();
        let seg = &s.ledger[&1];
        assert_eq!(seg.duration_ms(), 600_000);
        assert_eq!(seg.cost_micros, 148_333, "10 minutes of one RTX 5090 at 0.89/h");
        let job = &s.jobs[&1];
        assert_eq!(job.started_at, Some(Timestamp::compose(1_500, 0)), "the start is estimated from the run time");
        assert_eq!(job.state, JobState::Succeeded);
    }

    /// A run that ends under a leader whose clock is an hour ahead is billed what the worker
    /// measured, not an extra hour (the TSO interval only bounds it from above).
    #[test]
    fn a_leader_clock_an_hour_ahead_does_not_change_what_a_run_costs() {
        let mut s = cluster();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(1_000, 1).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&Request { ts: Timestamp::compose(1_010, 0), command: Command::JobStarted { job_id: 1, epoch } })
            .unwrap();
        let done = JobExitReport { exit_code: Some(0), run_time_ms: 120_000, ..Default::default() };
        let skewed_end = Timestamp::compose(1_010 + 120_000 + 3_600_000, 0);
        s.apply(&Request {
            ts: skewed_end,
            command: Command::JobFinished { job_id: 1, epoch, node: String::new(), report: done },
        })
        .unwrap();
        assert_eq!(s.ledger[&1].duration_ms(), 120_000);
        assert_eq!(s.ledger[&1].cost_micros, crate::cost_micros(120_000, 1000, 890_000, 1000));
    }

    /// A run whose launch failed (its image too large for the node, a missing program) never
    /// started: the job fails with the launch error, without a start time or a bill.
    #[test]
    fn a_failed_launch_leaves_no_start_and_no_bill() {
        let mut s = cluster();
        submit(&mut s, 3, "a", spec(8)).unwrap();
        schedule(&mut s, 4);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let failed = JobExitReport { launch_error: Some("node n1: no such program".into()), ..Default::default() };
        s.apply(&req(9_000, Command::JobFinished { job_id: 1, epoch, node: String::new(), report: failed })).unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Failed);
        assert_eq!(job.reason.as_deref(), Some("launch failed: node n1: no such program"));
        assert_eq!(job.started_at, None, "it never started");
        assert!(s.ledger.is_empty(), "nothing ran, nothing is billed");
        assert!(s.allocated_gpus("n1").is_empty(), "the gpus are free again");
    }

    /// A job cancelled or preempted after its placement but before its worker launched it is
    /// reported "never started": it ends (cancelled) or goes back to the queue (preempted) at
    /// once, bills nothing and frees its GPU, so the next job does not wait for ever.
    #[test]
    fn a_job_stopped_before_it_launched_ends_without_running() {
        let mut s = cluster();
        submit(&mut s, 3, "a", spec(8)).unwrap();
        schedule(&mut s, 4);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&req(5, Command::CancelJob { job_id: 1, reason: "cancelled by user".into() })).unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Running, "a placed job waits for its worker to stop it");
        let never = JobExitReport { never_started: true, ..Default::default() };
        s.apply(&req(6, Command::JobFinished { job_id: 1, epoch, node: String::new(), report: never.clone() }))
            .unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Cancelled);
        assert_eq!(job.reason.as_deref(), Some("cancelled by user (before it started)"));
        assert_eq!(job.started_at, None);
        assert!(s.ledger.is_empty(), "nothing ran, nothing is billed");
        assert!(s.allocated_gpus("n1").is_empty(), "the gpus are free again");

        let mut low = spec(8);
        low.priority_class = "preemptible".into();
        submit(&mut s, 7, "low", low).unwrap();
        schedule(&mut s, 8);
        let mut high = spec(8);
        high.priority_class = "gpu-high-priority".into();
        submit(&mut s, 9, "high", high).unwrap();
        let epoch = s.jobs[&2].allocation.as_ref().unwrap().epoch;
        s.apply(&req(10, Command::PreemptJob { job_id: 2, by: 3, grace_secs: 30 })).unwrap();
        s.apply(&req(11, Command::JobFinished { job_id: 2, epoch, node: String::new(), report: never })).unwrap();
        assert_eq!(s.jobs[&2].state, JobState::Pending, "the victim is requeued");
        assert_eq!(s.jobs[&2].reason.as_deref(), Some("requeued: preempted by job 3"));
        assert_eq!(schedule(&mut s, 12).iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![3]);
        assert!(s.ledger.is_empty());
    }

    /// A worker that lost every coordinator kills its jobs and reports them fenced once it is
    /// back: they did not end on their own, so they are requeued, and billed what they ran.
    #[test]
    fn a_fenced_run_is_requeued_and_billed_its_run_time() {
        let mut s = cluster();
        submit(&mut s, Timestamp::compose(1_000, 0).0, "a", spec(1)).unwrap();
        schedule(&mut s, Timestamp::compose(1_000, 1).0);
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let fenced = JobExitReport { signal: Some(9), fenced: true, run_time_ms: 7_000, ..Default::default() };
        let ts = Timestamp::compose(20_000, 0);
        s.apply(&Request {
            ts,
            command: Command::JobFinished { job_id: 1, epoch, node: String::new(), report: fenced },
        })
        .unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Pending);
        assert_eq!(
            job.reason.as_deref(),
            Some("requeued: node n1 lost contact with the coordinators and stopped the job")
        );
        assert_eq!((s.ledger[&1].duration_ms(), s.ledger[&1].end_state.as_str()), (7_000, "requeued"));
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

    fn gang_spec(gpus: u32, per_node: u32) -> JobSpec {
        let mut s = spec(gpus);
        s.sched.gpus_per_node = Some(per_node);
        s
    }

    fn placement(job_id: JobId, parts: &[(&str, &[u32])], slice: Option<SliceAssignment>) -> Placement {
        let mut parts: Vec<NodeGpus> =
            parts.iter().map(|(n, g)| NodeGpus { node: n.to_string(), gpus: g.to_vec() }).collect();
        let first = parts.remove(0);
        Placement { job_id, node: first.node, gpus: first.gpus, more_nodes: parts, slice }
    }

    fn run(s: &mut State, ts: u64, placements: Vec<Placement>) -> ScheduleOutcome {
        match s.apply(&req(ts, Command::Schedule { placements, preemptions: vec![] })) {
            Ok(Outcome::Scheduled(o)) => o,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn gang_placements_are_all_or_nothing_at_apply() {
        let mut s = cluster();
        s.apply(&req(3, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        submit(&mut s, 4, "a", spec(1)).unwrap();
        submit(&mut s, 5, "g", gang_spec(16, 8)).unwrap();
        run(&mut s, 6, vec![placement(1, &[("n2", &[3])], None)]);
        let all: Vec<u32> = (0..8).collect();
        let out = run(&mut s, 7, vec![placement(2, &[("n1", &all), ("n2", &all)], None)]);
        assert_eq!(out.placed, Vec::<JobId>::new());
        assert!(out.rejected[0].1.contains("gpu already allocated"), "{out:?}");
        assert!(s.allocated_gpus("n1").is_empty(), "the part on n1 was not kept");
        // Wrong shapes are refused too.
        let out = run(&mut s, 8, vec![placement(2, &[("n1", &all)], None)]);
        assert!(out.rejected[0].1.contains("runs on 2 node(s)"), "{out:?}");
        let out = run(&mut s, 9, vec![placement(2, &[("n1", &all), ("n1", &all)], None)]);
        assert!(out.rejected[0].1.contains("appears twice"), "{out:?}");
        // Once the gpu is free the same placement is accepted, on both nodes at once.
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        let done = JobExitReport { exit_code: Some(0), ..Default::default() };
        s.apply(&req(10, Command::JobFinished { job_id: 1, epoch, node: String::new(), report: done })).unwrap();
        let out = run(&mut s, 11, vec![placement(2, &[("n1", &all), ("n2", &all)], None)]);
        assert_eq!(out.placed, vec![2]);
        assert_eq!(s.jobs_on_node("n2").map(|j| j.id).collect::<Vec<_>>(), vec![2]);
        assert_eq!(s.allocated_gpus("n1").len() + s.allocated_gpus("n2").len(), 16);
    }

    #[test]
    fn slices_are_revalidated_and_never_over_commit() {
        let mut s = cluster();
        let mut mps = spec(0);
        mps.gpu_slice = Some(GpuSlice::Mps { thread_percent: 60, memory_mib: None });
        submit(&mut s, 3, "a", mps.clone()).unwrap();
        submit(&mut s, 4, "b", mps).unwrap();
        // A legacy PlaceJob lets apply choose the slice.
        s.apply(&req(5, Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: vec![0] })).unwrap();
        let slice = s.jobs[&1].allocation.as_ref().unwrap().slice.clone();
        assert_eq!(slice, Some(SliceAssignment::Mps { thread_percent: 60, memory_mib: 19660 }));
        let err = s.apply(&req(6, Command::PlaceJob { job_id: 2, node: "n1".into(), gpus: vec![0] })).unwrap_err();
        assert!(err.to_string().contains("not enough mps thread share left"), "{err}");
        // A lying proposal (a smaller share than the job asked for) is refused.
        let lie = SliceAssignment::Mps { thread_percent: 40, memory_mib: 100 };
        let out = run(&mut s, 7, vec![placement(2, &[("n1", &[0])], Some(lie))]);
        assert!(out.rejected[0].1.contains("does not match"), "{out:?}");
        // A whole-gpu job cannot land on a shared gpu, a slice cannot land on a whole one.
        submit(&mut s, 8, "c", spec(1)).unwrap();
        assert!(s.apply(&req(9, Command::PlaceJob { job_id: 3, node: "n1".into(), gpus: vec![0] })).is_err());
        s.apply(&req(10, Command::PlaceJob { job_id: 3, node: "n1".into(), gpus: vec![1] })).unwrap();
        assert!(s.apply(&req(11, Command::PlaceJob { job_id: 2, node: "n1".into(), gpus: vec![1] })).is_err());
        s.apply(&req(12, Command::PlaceJob { job_id: 2, node: "n1".into(), gpus: vec![2] })).unwrap();
        // MIG on a card without MIG is refused at submit.
        let mut mig = spec(0);
        mig.gpu_slice = Some(GpuSlice::parse("mig:1g.10gb").unwrap());
        assert!(matches!(submit(&mut s, 13, "d", mig), Err(ApplyError::NoMigGpu { .. })));
    }

    #[test]
    fn quotas_are_revalidated_at_apply() {
        let mut s = cluster();
        let mut a = spec(3);
        a.tenant = "team-a".into();
        submit(&mut s, 3, "a1", a.clone()).unwrap();
        submit(&mut s, 4, "a2", a.clone()).unwrap();
        submit(&mut s, 5, "a3", a).unwrap();
        // team-a: quota 4, may borrow team-b's 4 (cohort dev): 3 + 3 fit, the third 3 does not.
        let out = run(
            &mut s,
            6,
            vec![
                placement(1, &[("n1", &[0, 1, 2])], None),
                placement(2, &[("n1", &[3, 4, 5])], None),
                placement(3, &[("n1", &[6, 7])], None),
            ],
        );
        assert_eq!(out.placed, vec![1, 2]);
        assert_eq!(s.tenant_usage("team-a"), 6000);
        assert_eq!(s.cohort_usage("dev"), 6000);
        s.apply(&req(7, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        let err = s.apply(&req(8, Command::PlaceJob { job_id: 3, node: "n2".into(), gpus: vec![0, 1, 2] }));
        let err = err.unwrap_err().to_string();
        assert_eq!(err, "placement of job 3 rejected: quota: cohort dev uses 6 of its 8 gpus and the job needs 3");
    }

    #[test]
    fn preemption_is_revalidated_and_requeues_the_victim() {
        let mut s = cluster();
        let mut low = spec(8);
        low.priority_class = "preemptible".into();
        submit(&mut s, 3, "low", low).unwrap();
        submit(&mut s, 4, "normal", spec(8)).unwrap();
        let mut high = spec(8);
        high.priority_class = "gpu-high-priority".into();
        submit(&mut s, 5, "high", high).unwrap();
        s.apply(&req(6, Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: (0..8).collect() })).unwrap();
        let epoch = s.jobs[&1].allocation.as_ref().unwrap().epoch;
        s.apply(&req(7, Command::JobStarted { job_id: 1, epoch })).unwrap();
        // A normal job may not preempt (its class does not preempt lower ones).
        let err = s.apply(&req(8, Command::PreemptJob { job_id: 1, by: 2, grace_secs: 5 })).unwrap_err();
        assert!(matches!(err, ApplyError::PreemptionRejected { job_id: 1, .. }), "{err}");
        // The high-priority job may.
        s.apply(&req(9, Command::PreemptJob { job_id: 1, by: 3, grace_secs: 5 })).unwrap();
        assert_eq!(s.preempting_jobs().map(|j| j.id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(s.apply(&req(10, Command::PreemptJob { job_id: 1, by: 3, grace_secs: 5 })), Ok(Outcome::Stale));
        // Stopped by SIGTERM at 10 s: requeued, its run charged to fair-share usage.
        let ts = Timestamp::compose(10_000, 0).0;
        let killed = JobExitReport { signal: Some(15), run_time_ms: 9_000, ..Default::default() };
        s.apply(&req(ts, Command::JobFinished { job_id: 1, epoch, node: String::new(), report: killed })).unwrap();
        let j = &s.jobs[&1];
        assert_eq!((j.state, j.reason.as_deref()), (JobState::Pending, Some("requeued: preempted by job 3")));
        assert!(j.allocation.is_none() && j.preemption.is_none() && j.started_at.is_none());
        assert_eq!(s.preempting_jobs().count(), 0);
        assert!(s.usage.tenants.contains_key("default"), "the run was charged");
        assert_eq!(schedule(&mut s, ts + 1).iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![3]);
        assert_eq!(s.jobs[&1].attempts, 1);
    }

    /// A two-node gang placed on n1 and n2 with 8 GPUs each; returns its epoch.
    fn running_gang(s: &mut State) -> u64 {
        s.apply(&req(3, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        submit(s, 4, "g", gang_spec(16, 8)).unwrap();
        let all: Vec<u32> = (0..8).collect();
        assert_eq!(run(s, 5, vec![placement(1, &[("n1", &all), ("n2", &all)], None)]).placed, vec![1]);
        s.jobs[&1].allocation.as_ref().unwrap().epoch
    }

    fn part_end(s: &mut State, ts: u64, epoch: u64, node: &str, report: JobExitReport) -> Response {
        s.apply(&Request {
            ts: Timestamp::compose(ts, 0),
            command: Command::JobFinished { job_id: 1, epoch, node: node.into(), report },
        })
    }

    /// A gang's run ends when its last part ends, not its first: until then it keeps every part's
    /// GPUs, so no next attempt can start beside a part still running. It lasted as long as its
    /// longest part.
    #[test]
    fn a_gang_succeeds_when_its_last_part_exits() {
        let mut s = cluster();
        let epoch = running_gang(&mut s);
        let ok = |ms| JobExitReport { exit_code: Some(0), run_time_ms: ms, ..Default::default() };
        assert_eq!(part_end(&mut s, 10_000, epoch, "n2", ok(9_000)), Ok(Outcome::Done));
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Running, "the part on n1 still runs");
        assert!(!job.allocation.as_ref().unwrap().stops_remaining_parts(), "a clean exit lets the rest go on");
        assert_eq!(s.allocated_gpus("n2").len(), 8, "the ended part keeps its gpus until the gang ends");
        assert!(s.ledger.is_empty());
        // A retried report of the same part changes nothing.
        assert_eq!(part_end(&mut s, 10_500, epoch, "n2", ok(9_000)), Ok(Outcome::Stale));
        // A node without a part cannot end one.
        s.apply(&req(6, Command::RegisterNode { spec: node("n3", 8) })).unwrap();
        assert_eq!(part_end(&mut s, 10_600, epoch, "n3", ok(1)), Ok(Outcome::Stale));

        assert!(matches!(part_end(&mut s, 20_000, epoch, "n1", ok(19_000)), Ok(Outcome::Job(_))));
        let job = &s.jobs[&1];
        assert_eq!((job.state, job.exit_code), (JobState::Succeeded, Some(0)));
        assert_eq!(job.worker_run_time_ms, Some(19_000));
        assert_eq!(s.ledger[&1].duration_ms(), 19_000, "billed for its longest part");
        assert!(s.allocated_gpus("n1").is_empty() && s.allocated_gpus("n2").is_empty());
    }

    /// A part that fails stops the others (the desired state says stop); the run fails with the
    /// first failure once the stopped parts have reported, and only then frees the GPUs.
    #[test]
    fn a_gang_fails_as_a_whole_with_its_first_failure() {
        let mut s = cluster();
        let epoch = running_gang(&mut s);
        let failed = JobExitReport { exit_code: Some(3), run_time_ms: 4_000, ..Default::default() };
        part_end(&mut s, 5_000, epoch, "n1", failed).unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Running, "the part on n2 has not stopped yet");
        assert!(job.allocation.as_ref().unwrap().stops_remaining_parts());
        assert_eq!(s.allocated_gpus("n1").len(), 8);
        let killed = JobExitReport { signal: Some(15), run_time_ms: 5_500, ..Default::default() };
        part_end(&mut s, 6_000, epoch, "n2", killed).unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Failed);
        assert_eq!(job.reason.as_deref(), Some("exit code 3 (on node n1)"));
        assert_eq!(job.exit_code, Some(3));
        assert_eq!(s.ledger[&1].duration_ms(), 5_500);
        assert!(s.allocated_gpus("n2").is_empty());
    }

    /// Losing one part's node neither requeues the gang at once (its other part still runs) nor
    /// leaves it running: the other part is told to stop, and the gang is requeued once it has.
    #[test]
    fn a_gang_that_loses_a_node_is_requeued_once_its_other_parts_stopped() {
        let mut s = cluster();
        let epoch = running_gang(&mut s);
        s.apply(&req(6, Command::SetNodeState { node: "n2".into(), state: NodeState::Down, reason: String::new() }))
            .unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Running, "the part on n1 still runs: no second attempt yet");
        assert!(job.allocation.as_ref().unwrap().stops_remaining_parts());
        let gangs = |s: &State| crate::schedule(s, s.last_ts, &BTreeSet::new()).placements.len();
        assert_eq!(gangs(&s), 0, "the gang is not placed again while a part runs");
        // The node coming back (a new worker epoch) does not end the part twice.
        s.apply(&req(7, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        assert_eq!(s.jobs[&1].allocation.as_ref().unwrap().ended.len(), 1);
        let killed = JobExitReport { signal: Some(15), run_time_ms: 5_000, ..Default::default() };
        part_end(&mut s, 8_000, epoch, "n1", killed).unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Pending);
        assert_eq!(job.reason.as_deref(), Some("requeued: node n2 was lost while it ran part of the job"));
        assert_eq!(s.ledger[&1].end_state, "requeued");
        assert!(s.allocated_gpus("n1").is_empty() && s.allocated_gpus("n2").is_empty());
        assert_eq!(gangs(&s), 1, "now it can run again");
    }

    /// Tasks that spread over nodes (`-n 4 --gpus-per-task 1`, no `--nodes`) take the node count
    /// the pass finds for each run: placed over two half-busy nodes, then requeued when one is
    /// lost, the job asks for what it was submitted with again and runs on the one node that
    /// now holds it, not on two because its first run had two.
    #[test]
    fn a_requeued_spreading_job_chooses_its_node_count_again() {
        let mut s = cluster();
        s.apply(&req(3, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        let mut spreading = spec(4);
        spreading.layout = corral_types::TaskLayout { ntasks: 4, gpus_per_task: 1, ..Default::default() };
        spreading.priority_class = "normal".into();
        let submitted = spreading.clone();
        let mut forged = spreading.clone().spread_over(1);
        forged.layout.submitted_shape = Some(corral_types::SubmittedShape { gpus: 64, ..Default::default() });
        let err = submit(&mut s, 4, "forged", forged).unwrap_err().to_string();
        assert!(err.contains("layout.submitted_shape"), "{err}");
        submit(&mut s, 4, "busy-1", spec(6)).unwrap();
        submit(&mut s, 5, "busy-2", spec(6)).unwrap();
        submit(&mut s, 6, "spread", spreading).unwrap();
        run(&mut s, 7, vec![placement(1, &[("n1", &[0, 1, 2, 3, 4, 5])], None)]);
        run(&mut s, 8, vec![placement(2, &[("n2", &[0, 1, 2, 3, 4, 5])], None)]);
        let pass = crate::schedule(&s, s.last_ts, &BTreeSet::new());
        assert_eq!(run(&mut s, 9, pass.placements).placed, vec![3], "{:?}", pass.pending);
        let job = &s.jobs[&3];
        let alloc = job.allocation.as_ref().unwrap();
        assert_eq!((job.spec.layout.nodes, alloc.parts().count()), (2, 2), "two tasks on each half-free node");
        let epoch = alloc.epoch;

        for (id, node) in [(1, "n1"), (2, "n2")] {
            let done = JobExitReport { exit_code: Some(0), run_time_ms: 1_000, ..Default::default() };
            let epoch = s.jobs[&id].allocation.as_ref().unwrap().epoch;
            s.apply(&req(10, Command::JobFinished { job_id: id, epoch, node: node.into(), report: done })).unwrap();
        }
        s.apply(&req(11, Command::SetNodeState { node: "n2".into(), state: NodeState::Down, reason: String::new() }))
            .unwrap();
        let killed = JobExitReport { signal: Some(15), run_time_ms: 2_000, ..Default::default() };
        s.apply(&req(12, Command::JobFinished { job_id: 3, epoch, node: "n1".into(), report: killed })).unwrap();
        let job = &s.jobs[&3];
        assert_eq!(job.state, JobState::Pending, "{:?}", job.reason);
        assert_eq!(job.spec, submitted, "requeued as it was submitted");
        assert!(job.spec.spreads());
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index, "the queue holds it as submitted");

        let placed = crate::schedule(&s, s.last_ts, &BTreeSet::new()).placements;
        assert_eq!(placed.len(), 1, "n1 alone holds the four tasks now, n2 is down");
        assert_eq!((placed[0].node.as_str(), placed[0].gpus.len(), placed[0].more_nodes.len()), ("n1", 4, 0));
        run(&mut s, 13, placed);
        let job = &s.jobs[&3];
        assert_eq!((job.state, job.spec.layout.nodes, job.spec.gpus), (JobState::Running, 1, 4));
    }

    /// `--exclusive` without GPUs holds, and is billed for, every GPU of its node, as Slurm
    /// allocates such a job all the GRES of its nodes; within its tenant's quota; a requeue asks
    /// for none again; a placement naming fewer is refused.
    #[test]
    fn an_exclusive_job_without_gpus_holds_every_gpu_of_its_node() {
        let mut s = cluster();
        let mut whole = spec(0);
        whole.layout.exclusive = true;
        whole.priority_class = "normal".into();
        let submitted = whole.clone();
        submit(&mut s, 3, "whole", whole.clone()).unwrap();
        let short = run(&mut s, 4, vec![placement(1, &[("n1", &[0, 1])], None)]);
        assert!(short.placed.is_empty(), "two of eight GPUs: {short:?}");
        let pass = crate::schedule(&s, s.last_ts, &BTreeSet::new());
        assert_eq!(pass.placements.len(), 1, "{:?}", pass.pending);
        assert_eq!(pass.placements[0].gpus, (0..8).collect::<Vec<u32>>());
        assert_eq!(run(&mut s, 5, pass.placements).placed, vec![1]);
        let job = &s.jobs[&1];
        assert_eq!((job.spec.gpus, job.spec.layout.exclusive), (8, true));
        assert_eq!(s.tenant_usage("default"), 8000, "its quota use is the node's GPUs");
        let mut rebuilt = s.clone();
        rebuilt.rebuild_indexes();
        assert_eq!(s.index, rebuilt.index);
        let epoch = job.allocation.as_ref().unwrap().epoch;
        s.apply(&req(6, Command::SetNodeState { node: "n1".into(), state: NodeState::Down, reason: String::new() }))
            .unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Pending, "requeued: {:?}", job.reason);
        assert_eq!(job.spec, submitted, "asks for no GPUs again");
        assert_eq!(s.ledger[&1].gpus, 8, "the run was billed for the node's eight GPUs");
        assert_eq!(s.ledger[&1].epoch, epoch);

        // A tenant whose quota (with what its cohort lends) is less than an idle node's GPUs
        // waits: team-a's 4, and team-b's 4 lent, against 16.
        let mut s = cluster();
        s.apply(&req(3, Command::RegisterNode { spec: node("big", 16) })).unwrap();
        submit(&mut s, 4, "busy", spec(1)).unwrap();
        run(&mut s, 5, vec![placement(1, &[("n1", &[0])], None)]);
        let mut team = submitted.clone();
        team.tenant = "team-a".into();
        submit(&mut s, 6, "team", team).unwrap();
        let pass = crate::schedule(&s, s.last_ts, &BTreeSet::new());
        assert!(pass.placements.is_empty(), "16 GPUs over team-a's quota: {:?}", pass.placements);
        let forced = run(&mut s, 7, vec![placement(2, &[("big", &(0..16).collect::<Vec<u32>>())], None)]);
        assert!(forced.placed.is_empty(), "apply checks the quota of the node's GPUs too: {forced:?}");
    }

    /// A cancelled gang ends cancelled when its last part stopped; a part that never started
    /// (stopped before its worker launched it) bills nothing of its own.
    #[test]
    fn a_cancelled_gang_ends_when_every_part_stopped() {
        let mut s = cluster();
        let epoch = running_gang(&mut s);
        s.apply(&req(6, Command::CancelJob { job_id: 1, reason: "cancelled by user".into() })).unwrap();
        let never = JobExitReport { never_started: true, ..Default::default() };
        part_end(&mut s, 7_000, epoch, "n2", never.clone()).unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Running);
        let killed = JobExitReport { signal: Some(15), run_time_ms: 2_000, ..Default::default() };
        part_end(&mut s, 8_000, epoch, "n1", killed).unwrap();
        let job = &s.jobs[&1];
        assert_eq!((job.state, job.reason.as_deref()), (JobState::Cancelled, Some("cancelled by user")));
        assert_eq!(s.ledger[&1].duration_ms(), 2_000);

        // Every part stopped before launch: nothing ran, nothing is billed.
        submit(&mut s, 9, "g2", gang_spec(16, 8)).unwrap();
        let all: Vec<u32> = (0..8).collect();
        run(&mut s, 10, vec![placement(2, &[("n1", &all), ("n2", &all)], None)]);
        let epoch = s.jobs[&2].allocation.as_ref().unwrap().epoch;
        s.apply(&req(11, Command::CancelJob { job_id: 2, reason: "cancelled by user".into() })).unwrap();
        for node in ["n1", "n2"] {
            s.apply(&Request {
                ts: Timestamp::compose(12_000, 0),
                command: Command::JobFinished { job_id: 2, epoch, node: node.into(), report: never.clone() },
            })
            .unwrap();
        }
        assert_eq!(s.jobs[&2].state, JobState::Cancelled);
        assert_eq!(s.jobs[&2].reason.as_deref(), Some("cancelled by user (before it started)"));
        assert_eq!(s.ledger.len(), 1, "the second gang never ran");
    }

    /// A two-node batch job (`corral sbatch`) placed on n1 and n2; returns its epoch.
    fn running_batch_gang(s: &mut State) -> u64 {
        s.apply(&req(3, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        let mut spec = gang_spec(16, 8);
        spec.script = Some("#!/bin/sh\nsrun hostname\n".into());
        submit(s, 4, "b", spec).unwrap();
        let all: Vec<u32> = (0..8).collect();
        assert_eq!(run(s, 5, vec![placement(1, &[("n1", &all), ("n2", &all)], None)]).placed, vec![1]);
        s.jobs[&1].allocation.as_ref().unwrap().epoch
    }

    /// Slurm's batch step: a batch job ends when its script, on the first node, ends, with its
    /// exit code; the other node only held the allocation and reports nothing.
    #[test]
    fn a_batch_job_ends_with_its_batch_step_on_the_first_node() {
        for code in [0, 4] {
            let mut s = cluster();
            let epoch = running_batch_gang(&mut s);
            let report = JobExitReport { exit_code: Some(code), run_time_ms: 3_000, ..Default::default() };
            assert!(matches!(part_end(&mut s, 4_000, epoch, "n1", report.clone()), Ok(Outcome::Job(_))));
            let job = &s.jobs[&1];
            let want = if code == 0 { JobState::Succeeded } else { JobState::Failed };
            assert_eq!((job.state, job.exit_code), (want, Some(code)));
            assert!(s.allocated_gpus("n1").is_empty() && s.allocated_gpus("n2").is_empty());
            assert_eq!(s.ledger[&1].duration_ms(), 3_000, "billed once, for the batch step");
            // The other node's part, killed as the allocation ended, is a report of an ended run.
            let killed = JobExitReport { signal: Some(15), run_time_ms: 3_100, ..Default::default() };
            assert_eq!(part_end(&mut s, 4_100, epoch, "n2", killed), Ok(Outcome::Stale));
        }
    }

    /// The other node's part ending (its worker lost it) stops the batch step, and the job
    /// fails with that first failure once the batch step has stopped, as a gang does.
    #[test]
    fn a_batch_job_whose_other_part_fails_stops_its_batch_step() {
        let mut s = cluster();
        let epoch = running_batch_gang(&mut s);
        let lost = JobExitReport { signal: Some(9), run_time_ms: 1_000, ..Default::default() };
        assert_eq!(part_end(&mut s, 2_000, epoch, "n2", lost), Ok(Outcome::Done));
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Running, "the batch step has not stopped yet");
        assert!(job.allocation.as_ref().unwrap().stops_remaining_parts());
        let killed = JobExitReport { signal: Some(15), run_time_ms: 2_000, ..Default::default() };
        part_end(&mut s, 3_000, epoch, "n1", killed).unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Failed);
        assert_eq!(job.reason.as_deref(), Some("killed by signal 9 (on node n2)"));
    }

    /// A batch job runs as long as its batch step: cancelled before the first node launched
    /// it, it bills nothing, however long the other node held its part.
    #[test]
    fn a_batch_job_is_billed_for_its_batch_step() {
        let mut s = cluster();
        let epoch = running_batch_gang(&mut s);
        s.apply(&req(6, Command::CancelJob { job_id: 1, reason: "cancelled by user".into() })).unwrap();
        let held = JobExitReport { signal: Some(15), run_time_ms: 2_400, ..Default::default() };
        assert_eq!(part_end(&mut s, 7_000, epoch, "n2", held), Ok(Outcome::Done));
        let never = JobExitReport { never_started: true, ..Default::default() };
        part_end(&mut s, 8_000, epoch, "n1", never).unwrap();
        let job = &s.jobs[&1];
        assert_eq!(
            (job.state, job.reason.as_deref()),
            (JobState::Cancelled, Some("cancelled by user (before it started)"))
        );
        assert!(s.ledger.is_empty(), "{:?}", s.ledger);
    }

    /// Losing the first node loses the batch step: the job is requeued at once (no report can
    /// come from there); losing another node stops the batch step first.
    #[test]
    fn a_batch_job_that_loses_its_first_node_is_requeued_at_once() {
        let mut s = cluster();
        running_batch_gang(&mut s);
        s.apply(&req(6, Command::SetNodeState { node: "n1".into(), state: NodeState::Down, reason: String::new() }))
            .unwrap();
        let job = &s.jobs[&1];
        assert_eq!(job.state, JobState::Pending);
        assert_eq!(job.reason.as_deref(), Some("requeued: node n1 was lost while it ran part of the job"));
        assert!(s.allocated_gpus("n2").is_empty());

        let mut s = cluster();
        running_batch_gang(&mut s);
        s.apply(&req(6, Command::SetNodeState { node: "n2".into(), state: NodeState::Down, reason: String::new() }))
            .unwrap();
        assert_eq!(s.jobs[&1].state, JobState::Running, "the batch step on n1 is told to stop first");
    }

    /// `-n N --gpus-per-task G` without a node count: submit refuses only tasks no node count
    /// holds; apply takes a placement on any count from 1 to N whose parts hold the busiest
    /// node's GPUs, and from then on the job is that gang.
    #[test]
    fn spreading_tasks_take_the_node_count_their_placement_names() {
        let spreading = |tasks: u32, per_task: u32| {
            let mut js = spec(tasks * per_task);
            js.layout = corral_types::TaskLayout { ntasks: tasks, gpus_per_task: per_task, ..Default::default() };
            js
        };
        let mut s = cluster();
        let refused = submit(&mut s, 3, "big", spreading(3, 4)).unwrap_err();
        assert!(refused.to_string().contains("could never run"), "{refused}");
        assert!(matches!(submit(&mut s, 3, "huge", spreading(1, 9)), Err(ApplyError::TooManyGpus { .. })));
        s.apply(&req(4, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        let Ok(Outcome::JobSubmitted { job_id, .. }) = submit(&mut s, 5, "a", spreading(3, 4)) else { panic!() };
        let four: Vec<u32> = (0..4).collect();
        let eight: Vec<u32> = (0..8).collect();
        for (bad, why) in [
            (placement(job_id, &[("n1", &eight), ("n2", &four)], None), "wrong number of gpus on n2"),
            (placement(job_id, &[("n1", &four)], None), "wrong number of gpus on n1: the job needs 12"),
        ] {
            let out = run(&mut s, 6, vec![bad]);
            assert!(out.rejected[0].1.contains(why), "{out:?}");
        }
        // 3 tasks of 4 GPUs on two nodes: 2 + 1 tasks, 8 GPUs on each.
        let out = run(&mut s, 7, vec![placement(job_id, &[("n1", &eight), ("n2", &eight)], None)]);
        assert_eq!(out.placed, vec![job_id], "{out:?}");
        let job = &s.jobs[&job_id];
        assert_eq!((job.spec.layout.nodes, job.spec.gpus, job.spec.sched.gpus_per_node), (2, 16, Some(8)));
        assert_eq!(job.spec.tasks_on_nodes(), [2, 1]);
        assert!(!job.spec.spreads());
    }

    #[test]
    fn gang_submissions_are_checked_against_the_nodes() {
        let mut s = cluster();
        let refused = submit(&mut s, 3, "g", gang_spec(16, 8));
        assert!(matches!(refused, Err(ApplyError::GangTooLarge { nodes: 2, per_node: 8, available: 1 })));
        assert_eq!(
            refused.unwrap_err().to_string(),
            "job asks for 2 nodes with 8 gpus each but only 1 node has that many: it could never run"
        );
        s.apply(&req(4, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
        assert!(submit(&mut s, 5, "g", gang_spec(16, 8)).is_ok());
        let mut bad = spec(16);
        bad.sched.gpus_per_node = Some(5);
        assert!(matches!(submit(&mut s, 6, "b", bad), Err(ApplyError::InvalidSpec(_))));
    }
}
