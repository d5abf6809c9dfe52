//! The stored form of job steps (`state.proto`'s `JobSteps` in a `Job`, and the commands
//! `CreateStep`, `StepEnded`, `SignalStep`): both directions of each conversion.
//!
//! A job without steps stores no `steps` field, so the bytes of jobs written before steps
//! existed do not change (the golden tests).

use super::{pb, CodecError};
use corral_types::{JobStep, JobSteps, StepNode, StepNodeEnd, StepSpec, StepState, TaskExit, Timestamp};

pub(super) fn steps_to_pb(steps: &JobSteps) -> Option<pb::JobSteps> {
    (!steps.is_empty()).then(|| pb::JobSteps {
        next_id: steps.next_id,
        steps: steps.steps.iter().map(step_to_pb).collect(),
        dropped: steps.dropped,
    })
}

pub(super) fn steps_from_pb(steps: Option<pb::JobSteps>) -> Result<JobSteps, CodecError> {
    let Some(s) = steps else { return Ok(JobSteps::default()) };
    Ok(JobSteps {
        next_id: s.next_id,
        steps: s.steps.into_iter().map(step_from_pb).collect::<Result<_, _>>()?,
        dropped: s.dropped,
    })
}

fn step_to_pb(s: &JobStep) -> pb::JobStep {
    pb::JobStep {
        id: s.id,
        epoch: s.epoch,
        request_id: s.request_id.clone(),
        spec: Some(spec_to_pb(&s.spec)),
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
        ended: s.ended.iter().map(node_end_to_pb).collect(),
        signals: s.signals.clone(),
        stopping: s.stopping,
    }
}

fn step_from_pb(s: pb::JobStep) -> Result<JobStep, CodecError> {
    let state = state_from_pb(s.state)?;
    Ok(JobStep {
        id: s.id,
        epoch: s.epoch,
        request_id: s.request_id,
        spec: spec_from_pb(s.spec.ok_or(CodecError::Missing("job_step.spec"))?),
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
        ended: s.ended.into_iter().map(node_end_from_pb).collect(),
        signals: s.signals,
        stopping: s.stopping,
    })
}

pub(super) fn spec_to_pb(s: &StepSpec) -> pb::StepSpec {
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

pub(super) fn spec_from_pb(s: pb::StepSpec) -> StepSpec {
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

pub(super) fn node_end_to_pb(e: &StepNodeEnd) -> pb::StepNodeEnd {
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

pub(super) fn node_end_from_pb(e: pb::StepNodeEnd) -> StepNodeEnd {
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

fn state_to_pb(s: StepState) -> pb::StepState {
    match s {
        StepState::Running => pb::StepState::Running,
        StepState::Completed => pb::StepState::Completed,
        StepState::Failed => pb::StepState::Failed,
        StepState::Cancelled => pb::StepState::Cancelled,
    }
}

fn state_from_pb(value: i32) -> Result<StepState, CodecError> {
    match pb::StepState::try_from(value) {
        Ok(pb::StepState::Running) => Ok(StepState::Running),
        Ok(pb::StepState::Completed) => Ok(StepState::Completed),
        Ok(pb::StepState::Failed) => Ok(StepState::Failed),
        Ok(pb::StepState::Cancelled) => Ok(StepState::Cancelled),
        Err(_) => Err(CodecError::Invalid { field: "job_step.state", value: value.to_string() }),
    }
}
