//! The wire form of job steps (`corral.proto`'s `JobSteps` in a `Job`, the step spec of
//! `CreateStep` and the node report of `ReportStepEnded`): both directions of each conversion.
//! It mirrors corral-raft's stored form on purpose; the two change apart.

use super::ProtoError;
use crate::v1 as pb;
use corral_types::{JobStep, JobSteps, StepNode, StepNodeEnd, StepSpec, StepState, TaskExit, Timestamp};

pub(super) fn steps_to_pb(steps: &JobSteps) -> Option<pb::JobSteps> {
    (!steps.is_empty()).then(|| pb::JobSteps {
        next_id: steps.next_id,
        steps: steps.steps.iter().map(pb::JobStep::from).collect(),
        dropped: steps.dropped,
    })
}

pub(super) fn steps_from_pb(steps: Option<pb::JobSteps>) -> Result<JobSteps, ProtoError> {
    let Some(s) = steps else { return Ok(JobSteps::default()) };
    Ok(JobSteps {
        next_id: s.next_id,
        steps: s.steps.into_iter().map(JobStep::try_from).collect::<Result<_, _>>()?,
        dropped: s.dropped,
    })
}

impl From<&JobStep> for pb::JobStep {
    fn from(s: &JobStep) -> Self {
        pb::JobStep {
            id: s.id,
            epoch: s.epoch,
            request_id: s.request_id.clone(),
            spec: Some((&s.spec).into()),
            nodes: s
                .nodes
                .iter()
                .map(|n| pb::StepNode {
                    node: n.node.clone(),
                    first_task: n.first_task,
                    tasks: n.tasks,
                    gpus: n.gpus.clone(),
                })
                .collect(),
            state: state_to_pb(s.state) as i32,
            created_at: s.created_at.0,
            ended_at: s.ended_at.map(|t| t.0),
            exit_code: s.exit_code,
            reason: s.reason.clone(),
            ended: s.ended.iter().map(pb::StepNodeEnd::from).collect(),
            signals: s.signals.clone(),
            stopping: s.stopping,
        }
    }
}

impl TryFrom<pb::JobStep> for JobStep {
    type Error = ProtoError;
    fn try_from(s: pb::JobStep) -> Result<Self, ProtoError> {
        let state = state_from_pb(s.state)?;
        Ok(JobStep {
            id: s.id,
            epoch: s.epoch,
            request_id: s.request_id,
            spec: s.spec.ok_or(ProtoError::Missing("job_step.spec"))?.into(),
            nodes: s
                .nodes
                .into_iter()
                .map(|n| StepNode { node: n.node, first_task: n.first_task, tasks: n.tasks, gpus: n.gpus })
                .collect(),
            state,
            created_at: Timestamp(s.created_at),
            ended_at: s.ended_at.map(Timestamp),
            exit_code: s.exit_code,
            reason: s.reason,
            ended: s.ended.into_iter().map(StepNodeEnd::from).collect(),
            signals: s.signals,
            stopping: s.stopping,
        })
    }
}

impl From<&StepSpec> for pb::StepSpec {
    fn from(s: &StepSpec) -> Self {
        pb::StepSpec {
            command: s.command.clone(),
            env: s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            cwd: s.cwd.clone(),
            ntasks: s.ntasks,
            nodes: s.nodes,
            ntasks_per_node: s.ntasks_per_node,
            gpus_per_task: s.gpus_per_task,
            cpus_per_task: s.cpus_per_task,
            nodelist: s.nodelist.clone(),
            overlap: s.overlap,
            kill_on_bad_exit: s.kill_on_bad_exit,
            gpus: s.gpus,
            gpus_per_node: s.gpus_per_node,
            wait_secs: s.wait_secs,
        }
    }
}

impl From<pb::StepSpec> for StepSpec {
    fn from(s: pb::StepSpec) -> Self {
        StepSpec {
            command: s.command,
            env: s.env.into_iter().collect(),
            cwd: s.cwd,
            ntasks: s.ntasks,
            nodes: s.nodes,
            ntasks_per_node: s.ntasks_per_node,
            gpus_per_task: s.gpus_per_task,
            cpus_per_task: s.cpus_per_task,
            nodelist: s.nodelist,
            overlap: s.overlap,
            kill_on_bad_exit: s.kill_on_bad_exit,
            gpus: s.gpus,
            gpus_per_node: s.gpus_per_node,
            wait_secs: s.wait_secs,
        }
    }
}

impl From<&StepNodeEnd> for pb::StepNodeEnd {
    fn from(e: &StepNodeEnd) -> Self {
        pb::StepNodeEnd {
            node: e.node.clone(),
            tasks: e
                .tasks
                .iter()
                .map(|t| pb::TaskExit { task: t.task, exit_code: t.exit_code, signal: t.signal })
                .collect(),
            launch_error: e.launch_error.clone(),
        }
    }
}

impl From<pb::StepNodeEnd> for StepNodeEnd {
    fn from(e: pb::StepNodeEnd) -> Self {
        StepNodeEnd {
            node: e.node,
            tasks: e
                .tasks
                .into_iter()
                .map(|t| TaskExit { task: t.task, exit_code: t.exit_code, signal: t.signal })
                .collect(),
            launch_error: e.launch_error,
        }
    }
}

fn state_to_pb(s: StepState) -> pb::StepState {
    match s {
        StepState::Running => pb::StepState::Running,
        StepState::Completed => pb::StepState::Completed,
        StepState::Failed => pb::StepState::Failed,
        StepState::Cancelled => pb::StepState::Cancelled,
    }
}

fn state_from_pb(value: i32) -> Result<StepState, ProtoError> {
    match pb::StepState::try_from(value) {
        Ok(pb::StepState::Running) => Ok(StepState::Running),
        Ok(pb::StepState::Completed) => Ok(StepState::Completed),
        Ok(pb::StepState::Failed) => Ok(StepState::Failed),
        Ok(pb::StepState::Cancelled) => Ok(StepState::Cancelled),
        Err(_) => Err(ProtoError::Invalid { field: "job_step.state", value: value.to_string() }),
    }
}
