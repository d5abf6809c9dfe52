//! Job steps in the replicated state: `srun` inside a job creates a step (`CreateStep`), each
//! node of it reports its tasks' end (`StepEnded`), `srun` forwards signals (`SignalStep`), and
//! the end of the run ends whatever step is still live (`end_live_steps`, from `end_run`).
//!
//! `plan_tasks` lays a step's tasks out over the allocation as Slurm's block distribution does:
//! consecutive ranks share a node, the first nodes take one more when the tasks do not divide
//! evenly, and with `--gpus-per-task` each task gets GPUs of its node that no other live step
//! holds (all of the node's, shared, with `--overlap`).
//!
//! Invariant: a step is live only while the run (allocation epoch) it was made in is; every
//! transition that ends a run goes through `end_run`, which ends its live steps. Invariant: at
//! most `MAX_LIVE_STEPS` live and `MAX_KEPT_STEPS` kept steps per job, each report and signal
//! list bounded by the step's own size, so a job's record stays bounded whatever its `srun`s.

use crate::{ApplyError, Outcome, Response, State};
use corral_types::hostlist;
use corral_types::{
    Allocation, JobId, JobSpecError, JobState, JobStep, StepId, StepNode, StepNodeEnd, StepSpec, StepState, TaskExit,
    Timestamp, MAX_KEPT_STEPS, MAX_LIVE_STEPS, MAX_STEP_SIGNALS, MAX_STEP_TASKS,
};
use std::collections::{BTreeMap, BTreeSet};

/// Longest launch error a step report keeps.
const MAX_STEP_ERROR_BYTES: usize = 1024;

fn refused(reason: String) -> ApplyError {
    ApplyError::JobControl(reason)
}

/// The tasks of `spec` on the nodes of `alloc` whose part has not ended; `taken` are the GPUs
/// each node's other live steps hold.
pub fn plan_tasks(
    spec: &StepSpec,
    alloc: &Allocation,
    taken: &BTreeMap<String, BTreeSet<u32>>,
) -> Result<Vec<StepNode>, String> {
    let parts: Vec<(&str, &[u32])> = alloc.parts().filter(|(node, _)| !alloc.part_ended(node)).collect();
    let names = || hostlist::compress(&parts.iter().map(|(n, _)| *n).collect::<Vec<_>>());
    let mut chosen: Vec<(&str, &[u32])> = if spec.nodelist.is_empty() {
        let wanted = match (spec.nodes, spec.ntasks, spec.ntasks_per_node) {
            (Some(n), _, _) => n as usize,
            (None, Some(tasks), Some(per_node)) => tasks.div_ceil(per_node) as usize,
            (None, Some(tasks), None) => (tasks as usize).min(parts.len()),
            (None, None, _) => parts.len(),
        };
        if wanted > parts.len() {
            return Err(format!("the step needs {wanted} nodes but the job has {} ({})", parts.len(), names()));
        }
        parts[..wanted].to_vec()
    } else {
        let mut chosen = Vec::new();
        for name in &spec.nodelist {
            let part = parts
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| format!("node {name} is not one of the job's nodes ({})", names()))?;
            if chosen.iter().any(|(n, _)| n == name) {
                return Err(format!("node {name} is named twice in --nodelist"));
            }
            chosen.push(*part);
        }
        if spec.nodes.is_some_and(|n| n as usize != chosen.len()) {
            return Err(format!("--nodes differs from the {} nodes of --nodelist", chosen.len()));
        }
        chosen
    };
    let ntasks = match spec.ntasks {
        Some(n) => n,
        None => (chosen.len() as u32).saturating_mul(spec.ntasks_per_node.unwrap_or(1)),
    };
    if ntasks == 0 || chosen.is_empty() {
        return Err("the step has no task to run".to_string());
    }
    if ntasks > MAX_STEP_TASKS {
        return Err(format!("{ntasks} tasks, at most {MAX_STEP_TASKS} per step"));
    }
    // As Slurm: fewer tasks than nodes runs on as many nodes as there are tasks.
    chosen.truncate(ntasks as usize);
    let nnodes = chosen.len() as u32;
    if let Some(per_node) = spec.ntasks_per_node {
        if per_node.saturating_mul(nnodes) < ntasks {
            return Err(format!("{ntasks} tasks do not fit {nnodes} nodes with --ntasks-per-node {per_node}"));
        }
    }
    let (base, extra) = (ntasks / nnodes, ntasks % nnodes);
    // Without --gpus-per-task, --gpus spreads over the nodes (the first ones one more) and
    // --gpus-per-node gives each its count; a node's tasks share them.
    let shared = |i: u32| match (spec.gpus_per_task.filter(|g| *g > 0), spec.gpus, spec.gpus_per_node) {
        (Some(_), _, _) => None,
        (None, Some(total), _) if total > 0 => Some((total / nnodes + u32::from(i < total % nnodes), "--gpus", total)),
        (None, _, Some(each)) if each > 0 => Some((each, "--gpus-per-node", each)),
        _ => None,
    };
    if let Some(total) = spec.gpus.filter(|g| *g > 0 && *g < nnodes && spec.gpus_per_task.is_none_or(|t| t == 0)) {
        return Err(format!("--gpus {total} is fewer than the step's {nnodes} nodes: each needs one"));
    }
    let mut first_task = 0;
    let mut nodes = Vec::with_capacity(chosen.len());
    for (i, (node, gpus)) in chosen.into_iter().enumerate() {
        let tasks = base + u32::from((i as u32) < extra);
        let wanted = match (spec.gpus_per_task, shared(i as u32)) {
            (_, Some((count, flag, given))) => Some((count as usize, format!("{flag} {given}"))),
            (None | Some(0), None) => None,
            (Some(per_task), None) => Some((
                (tasks as usize).saturating_mul(per_task as usize),
                format!("{tasks} tasks with --gpus-per-task {per_task}"),
            )),
        };
        let step_gpus = match wanted {
            None => Vec::new(),
            Some((needed, what)) => {
                let held = taken.get(node);
                let free: Vec<u32> =
                    gpus.iter().copied().filter(|g| spec.overlap || !held.is_some_and(|h| h.contains(g))).collect();
                if free.len() < needed {
                    let why = if free.len() < gpus.len() {
                        format!(
                            "{} of its {} are held by other steps: wait for them or use --overlap",
                            gpus.len() - free.len(),
                            gpus.len()
                        )
                    } else {
                        format!("the job has {} there", gpus.len())
                    };
                    return Err(format!("{what} need {needed} gpus on node {node}, but {why}"));
                }
                free[..needed].to_vec()
            }
        };
        nodes.push(StepNode { node: node.to_string(), first_task, tasks, gpus: step_gpus });
        first_task += tasks;
    }
    Ok(nodes)
}

/// What an ended step keeps: the first word of its command, none of its environment.
fn strip(step: &mut JobStep) {
    step.spec.command.truncate(1);
    step.spec.env.clear();
}

/// Ends `step` with the reports it has: Slurm's exit rule over every reported task.
fn finish(step: &mut JobStep, ts: Timestamp, cancelled: Option<&str>) {
    let highest = step.ended.iter().map(StepNodeEnd::status).max();
    step.exit_code = highest;
    step.ended_at = Some(ts);
    let (state, reason) = match (cancelled, highest) {
        (Some(why), _) => (StepState::Cancelled, why.to_string()),
        (None, Some(0)) => (StepState::Completed, "exit code 0".to_string()),
        (None, code) => {
            let failed = step.ended.iter().find(|e| e.launch_error.is_some());
            match failed.and_then(|e| e.launch_error.as_deref().map(|err| (e.node.as_str(), err))) {
                Some((node, err)) => (StepState::Failed, format!("launch failed on node {node}: {err}")),
                None => (StepState::Failed, format!("exit code {}", code.unwrap_or(1))),
            }
        }
    };
    step.state = state;
    step.reason = Some(reason);
    strip(step);
}

/// A node's report kept within its part of the step: its own tasks, once each, in rank order.
fn bounded_report(part: &StepNode, end: &StepNodeEnd) -> StepNodeEnd {
    let ranks = part.first_task..part.first_task + part.tasks;
    let mut tasks: BTreeMap<u32, TaskExit> = BTreeMap::new();
    for t in end.tasks.iter().filter(|t| ranks.contains(&t.task)) {
        tasks.entry(t.task).or_insert(*t);
    }
    let launch_error = end.launch_error.as_ref().map(|e| {
        let mut cut = e.len().min(MAX_STEP_ERROR_BYTES);
        while !e.is_char_boundary(cut) {
            cut -= 1;
        }
        e[..cut].to_string()
    });
    StepNodeEnd { node: part.node.clone(), tasks: tasks.into_values().collect(), launch_error }
}

impl State {
    /// `srun` in run `epoch` of `job_id`: lays its tasks out and records it as the next step.
    /// A retried `request_id` returns the step it made. Refused (one line) when the run is not
    /// current or is stopping, the job has `MAX_LIVE_STEPS` live steps, or the tasks do not fit.
    pub(crate) fn create_step(
        &mut self,
        ts: Timestamp,
        job_id: JobId,
        epoch: u64,
        request_id: &str,
        spec: &StepSpec,
    ) -> Response {
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if let Some(step) = job.steps.steps.iter().find(|s| !request_id.is_empty() && s.request_id == request_id) {
            return Ok(Outcome::Step { step: Box::new(step.clone()), duplicate: true });
        }
        spec.validate()
            .map_err(|reason| ApplyError::InvalidSpec(JobSpecError::Invalid { field: "step".into(), reason }))?;
        let alloc = match &job.allocation {
            Some(alloc) if job.state == JobState::Running && alloc.epoch == epoch => alloc,
            _ => return Err(refused(format!("job {job_id} no longer runs the allocation this step was made in"))),
        };
        if job.cancel_requested || job.preemption.is_some() || alloc.stops_remaining_parts() {
            return Err(refused(format!("job {job_id} is being stopped: no new step starts")));
        }
        let live: Vec<&JobStep> = job.steps.live().collect();
        if live.len() >= MAX_LIVE_STEPS {
            return Err(refused(format!(
                "job {job_id} has {} steps running, at most {MAX_LIVE_STEPS}: wait for one to end",
                live.len()
            )));
        }
        let mut taken: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
        for step in live.iter().filter(|s| !s.spec.overlap) {
            for part in &step.nodes {
                taken.entry(part.node.clone()).or_default().extend(part.gpus.iter().copied());
            }
        }
        let nodes = plan_tasks(spec, alloc, &taken).map_err(refused)?;
        let id = job.steps.next_id;
        let next = id.checked_add(1).ok_or_else(|| refused(format!("job {job_id} made all the steps it may")))?;
        let step = JobStep {
            id,
            epoch,
            request_id: request_id.to_string(),
            spec: spec.clone(),
            nodes,
            state: StepState::Running,
            created_at: ts,
            ..Default::default()
        };
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let steps = &mut job.steps;
        steps.next_id = next;
        steps.steps.push(step.clone());
        while steps.steps.len() > MAX_KEPT_STEPS {
            // At most MAX_LIVE_STEPS are live, fewer than MAX_KEPT_STEPS: an ended one is found.
            let Some(oldest) = steps.steps.iter().position(|s| !s.state.is_live()) else { break };
            steps.steps.remove(oldest);
            steps.dropped += 1;
        }
        Ok(Outcome::Step { step: Box::new(step), duplicate: false })
    }

    /// A node's report that its tasks of step `step_id` (run `epoch`) are gone. The step ends
    /// once every node reported; with `--kill-on-bad-exit`, a failed task stops the others.
    /// A report for another run, an ended step, a node without tasks of it or a node that
    /// already reported is `Stale`.
    pub(crate) fn step_ended(
        &mut self,
        ts: Timestamp,
        job_id: JobId,
        epoch: u64,
        step_id: StepId,
        end: &StepNodeEnd,
    ) -> Response {
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let current = job.steps.get(step_id).filter(|s| s.epoch == epoch && s.state.is_live());
        let Some(part) =
            current.and_then(|s| s.on_node(&end.node)).filter(|_| !current.is_some_and(|s| s.node_ended(&end.node)))
        else {
            return Ok(Outcome::Stale);
        };
        let report = bounded_report(part, end);
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        let Some(step) = job.steps.get_mut(step_id) else { return Ok(Outcome::Stale) };
        if step.spec.kill_on_bad_exit && report.status() != 0 {
            step.stopping = true;
        }
        step.ended.push(report);
        if step.nodes.iter().all(|n| step.ended.iter().any(|e| e.node == n.node)) {
            finish(step, ts, None);
        }
        Ok(Outcome::Done)
    }

    /// Forwards `signal` to every task of a live step (`srun` on Ctrl-C or SIGTERM, `scancel
    /// ID.STEP`); each worker delivers it once. At most `MAX_STEP_SIGNALS` per step.
    pub(crate) fn signal_step(&mut self, job_id: JobId, step_id: StepId, signal: i32) -> Response {
        if !(1..=64).contains(&signal) {
            return Err(refused(format!("{signal} is not a signal number")));
        }
        let job = self.jobs.get(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        match job.steps.get(step_id) {
            None => return Err(refused(format!("job {job_id} has no step {step_id}"))),
            Some(step) if !step.state.is_live() => return Ok(Outcome::Stale),
            Some(step) if step.signals.len() >= MAX_STEP_SIGNALS => {
                return Err(refused(format!(
                "step {job_id}.{step_id} was sent {MAX_STEP_SIGNALS} signals, the most one step takes: cancel the job"
            )))
            }
            Some(_) => {}
        }
        let job = self.jobs.get_mut(&job_id).ok_or(ApplyError::NoSuchJob(job_id))?;
        if let Some(step) = job.steps.get_mut(step_id) {
            step.signals.push(signal);
        }
        Ok(Outcome::Done)
    }

    /// The run of `job_id` ends (`end_run`): every step still live ends as cancelled, with the
    /// reports it had.
    pub(crate) fn end_live_steps(&mut self, ts: Timestamp, job_id: JobId, end_state: &str) {
        let has_live = self.jobs.get(&job_id).is_some_and(|j| j.steps.live().next().is_some());
        if !has_live {
            return;
        }
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        let why = format!("the job's run ended ({end_state}) before the step did");
        for step in job.steps.steps.iter_mut().filter(|s| s.state.is_live()) {
            finish(step, ts, Some(&why));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::NodeGpus;

    fn alloc() -> Allocation {
        Allocation {
            node: "gpu-01".into(),
            gpus: vec![0, 1],
            epoch: 5,
            more_nodes: vec![NodeGpus { node: "gpu-02".into(), gpus: vec![2, 3] }],
            ..Default::default()
        }
    }

    fn spec(ntasks: Option<u32>, nodes: Option<u32>, per_node: Option<u32>) -> StepSpec {
        StepSpec { command: vec!["python".into()], ntasks, nodes, ntasks_per_node: per_node, ..Default::default() }
    }

    fn layout(nodes: &[StepNode]) -> Vec<(String, u32, u32, Vec<u32>)> {
        nodes.iter().map(|n| (n.node.clone(), n.first_task, n.tasks, n.gpus.clone())).collect()
    }

    /// The expected layout: (node, first task, tasks, gpus).
    fn want(rows: &[(&str, u32, u32, &[u32])]) -> Vec<(String, u32, u32, Vec<u32>)> {
        rows.iter().map(|(n, f, t, g)| (n.to_string(), *f, *t, g.to_vec())).collect()
    }

    #[test]
    fn tasks_are_laid_out_in_blocks_as_slurm_does() {
        let none = BTreeMap::new();
        let plan = |s: StepSpec| plan_tasks(&s, &alloc(), &none).map(|n| layout(&n));
        // No count: one task per node of the allocation.
        assert_eq!(plan(spec(None, None, None)).unwrap(), want(&[("gpu-01", 0, 1, &[]), ("gpu-02", 1, 1, &[])]));
        assert_eq!(plan(spec(Some(4), None, None)).unwrap(), want(&[("gpu-01", 0, 2, &[]), ("gpu-02", 2, 2, &[])]));
        assert_eq!(plan(spec(Some(3), None, None)).unwrap(), want(&[("gpu-01", 0, 2, &[]), ("gpu-02", 2, 1, &[])]));
        assert_eq!(plan(spec(Some(2), None, Some(2))).unwrap(), want(&[("gpu-01", 0, 2, &[])]));
        assert_eq!(plan(spec(None, Some(2), Some(2))).unwrap(), want(&[("gpu-01", 0, 2, &[]), ("gpu-02", 2, 2, &[])]));
        assert_eq!(
            plan(spec(Some(1), Some(2), None)).unwrap(),
            want(&[("gpu-01", 0, 1, &[])]),
            "fewer tasks than nodes"
        );
        let mut w = spec(Some(2), None, None);
        w.nodelist = vec!["gpu-02".into()];
        assert_eq!(plan(w).unwrap(), want(&[("gpu-02", 0, 2, &[])]));
    }

    #[test]
    fn tasks_get_their_own_gpus_unless_they_overlap() {
        let mut s = spec(Some(4), None, None);
        s.gpus_per_task = Some(1);
        let none = BTreeMap::new();
        let nodes = plan_tasks(&s, &alloc(), &none).unwrap();
        assert_eq!(layout(&nodes), want(&[("gpu-01", 0, 2, &[0, 1]), ("gpu-02", 2, 2, &[2, 3])]));
        let taken: BTreeMap<String, BTreeSet<u32>> = [("gpu-01".to_string(), [0].into())].into();
        let err = plan_tasks(&s, &alloc(), &taken).unwrap_err();
        assert!(err.contains("1 of its 2 are held by other steps"), "{err}");
        s.overlap = true;
        assert_eq!(layout(&plan_tasks(&s, &alloc(), &taken).unwrap())[0], want(&[("gpu-01", 0, 2, &[0, 1])])[0]);
    }

    /// srun `--gpus N`: the step's GPUs spread over its nodes, shared by each node's tasks;
    /// `--gpus-per-node N`: N on each.
    #[test]
    fn a_steps_gpus_spread_over_its_nodes_and_its_tasks_share_them() {
        let none = BTreeMap::new();
        let plan = |s: StepSpec| plan_tasks(&s, &alloc(), &none).map(|n| layout(&n));
        let total = |tasks: u32, gpus: u32| StepSpec { gpus: Some(gpus), ..spec(Some(tasks), None, None) };
        assert_eq!(plan(total(4, 4)).unwrap(), want(&[("gpu-01", 0, 2, &[0, 1]), ("gpu-02", 2, 2, &[2, 3])]));
        assert_eq!(plan(total(4, 3)).unwrap(), want(&[("gpu-01", 0, 2, &[0, 1]), ("gpu-02", 2, 2, &[2])]));
        assert_eq!(plan(total(2, 1)).unwrap_err(), "--gpus 1 is fewer than the step's 2 nodes: each needs one");
        let each = StepSpec { gpus_per_node: Some(1), ..spec(Some(4), None, None) };
        assert_eq!(plan(each).unwrap(), want(&[("gpu-01", 0, 2, &[0]), ("gpu-02", 2, 2, &[2])]));
        let too_many = total(4, 6);
        assert!(plan(too_many).unwrap_err().contains("--gpus 6 need 3 gpus on node gpu-01"));
        // --gpus-per-task binds per task; a step's --gpus then changes nothing.
        let both = StepSpec { gpus_per_task: Some(1), ..total(2, 2) };
        assert_eq!(plan(both).unwrap(), want(&[("gpu-01", 0, 1, &[0]), ("gpu-02", 1, 1, &[2])]));
    }

    #[test]
    fn steps_that_cannot_fit_are_refused_with_one_line() {
        let none = BTreeMap::new();
        let cases = [
            (spec(None, Some(3), None), "needs 3 nodes but the job has 2 (gpu-[01-02])"),
            (spec(Some(5), Some(2), Some(2)), "5 tasks do not fit 2 nodes with --ntasks-per-node 2"),
            (StepSpec { nodelist: vec!["gpu-09".into()], ..spec(None, None, None) }, "node gpu-09 is not one of"),
            (StepSpec { gpus_per_task: Some(2), ..spec(Some(4), None, None) }, "need 4 gpus on node gpu-01"),
            (spec(Some(MAX_STEP_TASKS + 1), None, None), "at most 4096 per step"),
        ];
        for (s, want) in cases {
            let err = plan_tasks(&s, &alloc(), &none).unwrap_err();
            assert!(err.contains(want) && !err.contains('\n'), "{err}");
        }
    }

    mod through_apply {
        use super::*;
        use crate::apply::tests::{cluster, node, req, spec as job_spec, submit};
        use crate::{Command, Placement};
        use corral_types::JobExitReport;

        /// A 2-node gang (2 GPUs on each of n1, n2), placed and started: (state, job, epoch).
        fn running_gang() -> (State, JobId, u64) {
            let mut s = cluster();
            s.apply(&req(3, Command::RegisterNode { spec: node("n2", 8) })).unwrap();
            let mut js = job_spec(4);
            js.sched.gpus_per_node = Some(2);
            let Ok(Outcome::JobSubmitted { job_id, .. }) = submit(&mut s, 4, "r1", js) else { panic!() };
            let placement = Placement {
                job_id,
                node: "n1".into(),
                gpus: vec![0, 1],
                more_nodes: vec![NodeGpus { node: "n2".into(), gpus: vec![0, 1] }],
                slice: None,
            };
            s.apply(&req(5, Command::Schedule { placements: vec![placement], preemptions: vec![] })).unwrap();
            let epoch = s.jobs[&job_id].allocation.as_ref().unwrap().epoch;
            s.apply(&req(6, Command::JobStarted { job_id, epoch })).unwrap();
            (s, job_id, epoch)
        }

        fn create(
            s: &mut State,
            ts: u64,
            job_id: JobId,
            epoch: u64,
            rid: &str,
            spec: StepSpec,
        ) -> Result<JobStep, String> {
            match s.apply(&req(ts, Command::CreateStep { job_id, epoch, request_id: rid.into(), spec })) {
                Ok(Outcome::Step { step, .. }) => Ok(*step),
                Ok(other) => panic!("{other:?}"),
                Err(e) => Err(e.to_string()),
            }
        }

        fn report(
            s: &mut State,
            ts: u64,
            job_id: JobId,
            epoch: u64,
            step: StepId,
            node: &str,
            codes: &[(u32, i32)],
        ) -> Outcome {
            let tasks =
                codes.iter().map(|&(task, code)| TaskExit { task, exit_code: Some(code), signal: None }).collect();
            let end = StepNodeEnd { node: node.into(), tasks, launch_error: None };
            s.apply(&req(ts, Command::StepEnded { job_id, epoch, step, end })).unwrap()
        }

        #[test]
        fn a_step_is_made_once_per_request_and_ends_with_the_highest_task_status() {
            let (mut s, job, epoch) = running_gang();
            let step = create(&mut s, 10, job, epoch, "srun-1", spec(Some(4), None, None)).unwrap();
            assert_eq!((step.id, step.ntasks(), step.node_names()), (0, 4, vec!["n1", "n2"]));
            let again = create(&mut s, 11, job, epoch, "srun-1", spec(Some(4), None, None)).unwrap();
            assert_eq!(again, step, "a retried srun (lost reply) gets the same step");
            assert_eq!(s.jobs[&job].steps.next_id, 1);
            let second = create(&mut s, 12, job, epoch, "srun-2", spec(None, None, None)).unwrap();
            assert_eq!(second.id, 1);

            assert_eq!(report(&mut s, 13, job, epoch, 0, "n1", &[(0, 0), (1, 3)]), Outcome::Done);
            assert!(s.jobs[&job].steps.get(0).unwrap().state.is_live(), "n2 has not reported");
            assert_eq!(report(&mut s, 14, job, epoch, 0, "n1", &[(0, 9)]), Outcome::Stale, "n1 reported already");
            assert_eq!(report(&mut s, 14, job, epoch + 1, 0, "n2", &[(2, 0)]), Outcome::Stale, "another run");
            let end = StepNodeEnd {
                node: "n2".into(),
                tasks: vec![
                    TaskExit { task: 2, exit_code: None, signal: Some(2) },
                    TaskExit { task: 0, exit_code: Some(99), signal: None },
                ],
                launch_error: None,
            };
            s.apply(&req(15, Command::StepEnded { job_id: job, epoch, step: 0, end })).unwrap();
            let step = s.jobs[&job].steps.get(0).unwrap().clone();
            assert_eq!(
                (step.state, step.exit_code),
                (StepState::Failed, Some(130)),
                "128+SIGINT; task 0 is n1's, not n2's"
            );
            assert_eq!(step.ended_at, Some(Timestamp(15)));
            assert_eq!(step.ended[1].tasks.len(), 1, "a report keeps only the node's own tasks");
            assert!(step.spec.env.is_empty() && step.spec.command == ["python"]);
        }

        #[test]
        fn kill_on_bad_exit_stops_the_other_nodes() {
            let (mut s, job, epoch) = running_gang();
            let mut k = spec(Some(2), None, None);
            k.kill_on_bad_exit = true;
            create(&mut s, 10, job, epoch, "k", k).unwrap();
            report(&mut s, 11, job, epoch, 0, "n2", &[(1, 4)]);
            let step = s.jobs[&job].steps.get(0).unwrap();
            assert!(step.stopping && step.state.is_live());
            report(&mut s, 12, job, epoch, 0, "n1", &[(0, 143)]);
            assert_eq!(s.jobs[&job].steps.get(0).unwrap().exit_code, Some(143));
        }

        #[test]
        fn no_step_outlives_the_run_it_was_made_in() {
            let (mut s, job, epoch) = running_gang();
            create(&mut s, 10, job, epoch, "a", spec(Some(2), None, None)).unwrap();
            s.apply(&req(11, Command::CancelJob { job_id: job, reason: String::new() })).unwrap();
            let err = create(&mut s, 12, job, epoch, "b", spec(None, None, None)).unwrap_err();
            assert!(err.contains("is being stopped"), "{err}");
            assert!(s.jobs[&job].steps.get(0).unwrap().state.is_live(), "the cancel is not over yet");
            let killed = JobExitReport { signal: Some(15), run_time_ms: 10, ..Default::default() };
            for n in ["n1", "n2"] {
                let command = Command::JobFinished { job_id: job, epoch, node: n.into(), report: killed.clone() };
                s.apply(&req(13, command)).unwrap();
            }
            let step = s.jobs[&job].steps.get(0).unwrap();
            assert_eq!(step.state, StepState::Cancelled);
            assert!(step.reason.as_deref().unwrap().contains("the job's run ended (cancelled)"), "{:?}", step.reason);
            let err = create(&mut s, 14, job, epoch, "c", spec(None, None, None)).unwrap_err();
            assert!(err.contains("no longer runs the allocation"), "{err}");
            assert_eq!(report(&mut s, 15, job, epoch, 0, "n1", &[(0, 0)]), Outcome::Stale);
        }

        #[test]
        fn live_and_kept_steps_are_bounded() {
            let (mut s, job, epoch) = running_gang();
            for i in 0..MAX_LIVE_STEPS {
                create(&mut s, 10, job, epoch, &format!("r{i}"), spec(Some(1), None, None)).unwrap();
            }
            let err = create(&mut s, 11, job, epoch, "over", spec(Some(1), None, None)).unwrap_err();
            assert!(err.contains("at most 32: wait for one to end"), "{err}");
            let mut next = MAX_LIVE_STEPS as u32;
            for i in 0..MAX_KEPT_STEPS as u32 * 2 {
                report(&mut s, 12, job, epoch, i, "n1", &[(0, 0)]);
                create(&mut s, 13, job, epoch, &format!("r{next}"), spec(Some(1), None, None)).unwrap();
                next += 1;
            }
            let steps = &s.jobs[&job].steps;
            assert_eq!(steps.steps.len(), MAX_KEPT_STEPS);
            assert_eq!(steps.live().count(), MAX_LIVE_STEPS);
            assert_eq!(steps.dropped, next - MAX_KEPT_STEPS as u32);
            assert_eq!(steps.steps.last().unwrap().id, next - 1);
            for i in 0..MAX_STEP_SIGNALS {
                s.apply(&req(14, Command::SignalStep { job_id: job, step: next - 1, signal: 2 + i as i32 % 2 }))
                    .unwrap();
            }
            let err = s.apply(&req(15, Command::SignalStep { job_id: job, step: next - 1, signal: 15 })).unwrap_err();
            assert!(err.to_string().contains("the most one step takes"), "{err}");
            let err = s.apply(&req(15, Command::SignalStep { job_id: job, step: 0, signal: 0 })).unwrap_err();
            assert!(err.to_string().contains("not a signal"), "{err}");
        }

        #[test]
        fn gpus_per_task_steps_hold_their_gpus_until_they_end() {
            let (mut s, job, epoch) = running_gang();
            let mut g = spec(Some(2), None, None);
            g.gpus_per_task = Some(1);
            let first = create(&mut s, 10, job, epoch, "g1", g.clone()).unwrap();
            assert_eq!(first.nodes[0].gpus, [0]);
            let second = create(&mut s, 11, job, epoch, "g2", g.clone()).unwrap();
            assert_eq!(second.nodes[0].gpus, [1], "the next free gpu");
            let err = create(&mut s, 12, job, epoch, "g3", g.clone()).unwrap_err();
            assert!(err.contains("held by other steps"), "{err}");
            report(&mut s, 13, job, epoch, 0, "n1", &[(0, 0)]);
            report(&mut s, 13, job, epoch, 0, "n2", &[(1, 0)]);
            assert_eq!(create(&mut s, 14, job, epoch, "g3", g).unwrap().nodes[0].gpus, [0]);
        }
    }
}
