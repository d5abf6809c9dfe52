//! The persisted encoding of the replicated state: Raft log commands, snapshots, and the state
//! machine store's per-key records (jobs, nodes, billing segments, the scalar meta), as the
//! messages of `state.proto` with their format version.
//!
//! One file per record kind, each with both directions of its conversion: `job.rs` (jobs, their
//! specs, allocations and exit reports), `node.rs`, `segment.rs` (billing segments and the
//! totals of archived ones), `config.rs` (the cluster policy), `policy.rs` (its history),
//! `tokens.rs` (access and join tokens), `meta.rs` (the store's scalar record),
//! `request_id.rs` (the packed entries of the request-id table); `command.rs` is the Raft log's
//! payload and `snapshot.rs` the snapshot file format (streaming read, the history records
//! written after the hot state, `JobEncodings`). This file holds what they share: the format
//! versions, the generated messages and the error.
//!
//! Compatibility boundary: these bytes are on disk (raft-log, the history store, snapshot files) and in other
//! coordinators' logs. Fields are only added; a change that alters the bytes of an existing
//! value fails the golden tests (`tests/it/golden.rs`). This is the only place that knows the
//! persisted messages: the wire protocol (corral-proto) has its own, which mirrors the job, node
//! and segment messages field for field (`mirror.rs` tests that the two agree).

mod command;
mod config;
mod job;
mod meta;
#[cfg(test)]
mod mirror;
mod node;
mod policy;
mod request_id;
mod revocations;
mod segment;
mod snapshot;
mod step;
mod tokens;

pub use command::{command_from_bytes, command_to_bytes};
pub use job::{job_from_bytes, job_to_bytes};
pub use meta::{meta_from_bytes, meta_to_bytes, StateMeta};
pub use node::{node_from_bytes, node_to_bytes};
pub use policy::{policy_record_from_bytes, policy_record_to_bytes};
pub use request_id::{request_id_entries_from_bytes, request_id_entries_to_bytes, REQUEST_ID_ENTRY_BYTES};
pub use segment::{segment_from_bytes, segment_to_bytes};
pub use snapshot::{
    read_snapshot, request_id_table_key, snapshot_from_bytes, snapshot_to_bytes, snapshot_without_request_ids_to_bytes,
    write_snapshot_record, write_snapshot_without_request_ids, HistoryRecord, HotBounds, JobEncodings,
    SnapshotReadError,
};

/// Version of the persisted command encoding, written into every `Command` (and the store's
/// scalar record); a build refuses versions newer than [`SNAPSHOT_FORMAT_VERSION`].
/// 2: preemption, gang placements across nodes, GPU slices, quotas and fair-share usage.
pub const FORMAT_VERSION: u32 = 2;

/// Version of the snapshot encoding, written into every `StateSnapshot`: the newest version this
/// build reads. 3: request ids as a packed table of keys (`request_id_table`); a build of
/// version 2 would not see them, so it refuses such a snapshot instead. Version 2 snapshots
/// (request ids as strings) are still read. 4: array tasks may be written without the spec they
/// share with their array (`Job.spec_from_array`); a build of version 3 would read them with no
/// command and no script, so it refuses such a snapshot instead. A snapshot without such a task
/// is written as version 3.
pub const SNAPSHOT_FORMAT_VERSION: u32 = 4;

/// The version a snapshot with no task written without its array's spec is written as.
const SNAPSHOT_FORMAT_VERSION_UNSHARED: u32 = 3;

/// Generated code of package `corral.state.v1` (`proto/state.proto`).
mod pb {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/corral.state.v1.rs"));
}

/// Persisted bytes that do not decode into a valid domain value.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("missing field '{0}'")]
    Missing(&'static str),
    #[error("invalid value of '{field}': {value}")]
    Invalid { field: &'static str, value: String },
    #[error("unsupported format version {found} (this build reads up to {supported})")]
    Version { found: u32, supported: u32 },
    #[error("protobuf decode error: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// Refuses a top-level message of a format version this build does not read.
fn check_version(found: u32) -> Result<(), CodecError> {
    if found == 0 || found > SNAPSHOT_FORMAT_VERSION {
        return Err(CodecError::Version { found, supported: SNAPSHOT_FORMAT_VERSION });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step spec with every field set.
    fn test_step_spec() -> corral_types::StepSpec {
        corral_types::StepSpec {
            command: vec!["python".into(), "train.py".into()],
            env: [("SLURM_JOB_ID".to_string(), "4".to_string())].into(),
            cwd: Some("/home/ana".into()),
            ntasks: Some(4),
            nodes: Some(2),
            ntasks_per_node: Some(2),
            gpus_per_task: Some(1),
            cpus_per_task: Some(8),
            nodelist: vec!["n1".into(), "n2".into()],
            overlap: true,
            kill_on_bad_exit: true,
            gpus: Some(3),
            gpus_per_node: Some(2),
            wait_secs: Some(60),
        }
    }
    use corral_core::{ClusterConfig, Command, CompactCutoffs, JobUpdate, Placement, Preemption, Request, State};
    use corral_types::{
        Allocation, GpuDevice, GpuSlice, Job, JobExitReport, JobSpec, JobState, NodeGpus, NodeMode, NodeSpec, PartEnd,
        PriceBreak, SliceAssignment, Timestamp,
    };

    #[test]
    fn policies_and_node_modes_round_trip_through_commands_snapshots_and_meta() {
        let mut config = ClusterConfig::dev_defaults();
        let team = config.tenant_policies.get_mut("team-a").unwrap();
        team.max_running_jobs = Some(3);
        team.max_pending_jobs = Some(30);
        let normal = config.priority_classes.get_mut("normal").unwrap();
        normal.default_time_secs = Some(60);
        normal.max_time_secs = Some(3600);
        let node = NodeSpec {
            name: "n1".into(),
            address: "a:1".into(),
            gpus: vec![],
            cpu_millis: 1000,
            memory_bytes: 1 << 30,
            labels: vec![],
            rendezvous_ports: None,
            lease_end: Some(Timestamp(99 << 20)),
        };
        let commands = [
            Command::ApplyPolicy { config: ClusterConfig::dev_defaults(), by: "cluster init".into(), force: false },
            Command::RegisterNode { spec: node.clone() },
            Command::RegisterRestartedNode { spec: node, stale_jobs_stopped_ms_ago: 1_500 },
            Command::ApplyPolicy { config, by: "admin (token 1)".into(), force: true },
            Command::SetNodeMode {
                node: "n1".into(),
                mode: NodeMode::Draining,
                reason: "disk swap".into(),
                drain_deadline: Some(Timestamp(77)),
            },
            Command::EvictDrainedJobs { node: "n1".into() },
            Command::SetNodeMode {
                node: "n1".into(),
                mode: NodeMode::Cordoned,
                reason: "r".into(),
                drain_deadline: None,
            },
            Command::HoldJob { job_id: 4, hold: true },
            Command::RequeueJob { job_id: 4 },
            Command::SignalJob { job_id: 4, signal: 10 },
            Command::UpdateJob {
                job_id: 4,
                update: JobUpdate {
                    time_limit_secs: Some(60),
                    priority_class: Some("normal".into()),
                    gpus: Some(2),
                    name: Some("n".into()),
                },
                admin: true,
            },
            Command::CancelArrayTask { array: 4, index: 7, reason: "r".into() },
            Command::CancelJobs { job_ids: vec![1, 2], reason: "bulk".into() },
            Command::CreateStep { job_id: 4, epoch: 9, request_id: "srun-1".into(), spec: test_step_spec() },
            Command::StepEnded {
                job_id: 4,
                epoch: 9,
                step: 2,
                end: corral_types::StepNodeEnd {
                    node: "n2".into(),
                    tasks: vec![corral_types::TaskExit { task: 3, exit_code: None, signal: Some(9) }],
                    launch_error: Some("no python".into()),
                },
            },
            Command::SignalStep { job_id: 4, step: 2, signal: 2 },
            Command::SetGpuFault {
                node: "n1".into(),
                mark: corral_types::GpuFaultMark {
                    gpu: 3,
                    reason: "XID 79: the GPU has fallen off the bus".into(),
                    node_epoch: 7,
                    seq: 2,
                    job_id: 12,
                },
                clear: false,
            },
            Command::SetNodeLease { node: "n1".into(), lease_end: Some(Timestamp(5 << 20)) },
            Command::EndLease { node: "n1".into() },
            Command::PartReady { job_id: 4, epoch: 9, node: "n2".into() },
            Command::PartIdle { job_id: 4, epoch: 9, node: "n2".into(), idle: true },
            Command::SetNodeLease { node: "n1".into(), lease_end: None },
            Command::Compact(CompactCutoffs {
                archive_before: Timestamp(3),
                request_ids_before: Timestamp(2),
                jobs_before: Some(Timestamp(1)),
                segments_before: None,
                max_finished_bytes: Some(64 << 20),
            }),
        ];
        let mut state = State::default();
        for (i, command) in commands.into_iter().enumerate() {
            let request = Request { ts: Timestamp(i as u64 + 1), command };
            assert_eq!(command_from_bytes(&command_to_bytes(&request)).unwrap(), request);
            let _ = state.apply(&request);
        }
        assert_eq!((state.policy_version, state.policy_history.len()), (2, 2));
        assert_eq!(state.nodes["n1"].mode, NodeMode::Cordoned);
        assert_eq!(snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap(), state);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!(meta.policy_version, 2);
        for record in &state.policy_history {
            assert_eq!(&policy_record_from_bytes(&policy_record_to_bytes(record)).unwrap(), record);
        }
        assert_eq!(node_from_bytes(&node_to_bytes(&state.nodes["n1"])).unwrap(), state.nodes["n1"]);
        let remove =
            Request { ts: Timestamp(9), command: Command::RemoveNode { node: "n1".into(), revoke_certificates: true } };
        assert_eq!(command_from_bytes(&command_to_bytes(&remove)).unwrap(), remove);
    }

    #[test]
    fn tokens_round_trip_through_commands_snapshots_and_meta() {
        let hash: String = std::iter::repeat_n('e', 64).collect();
        let commands = [
            Command::Configure(ClusterConfig::dev_defaults()),
            Command::CreateToken { tenant: "team-a".into(), admin: false, sha256: hash, expires_at_ms: Some(99) },
            Command::CreateToken { tenant: String::new(), admin: true, sha256: "f".repeat(64), expires_at_ms: None },
            Command::RevokeToken { token_id: 2 },
        ];
        let mut state = State::default();
        for (i, command) in commands.into_iter().enumerate() {
            let request = Request { ts: Timestamp(i as u64 + 1), command };
            assert_eq!(command_from_bytes(&command_to_bytes(&request)).unwrap(), request);
            state.apply(&request).unwrap();
        }
        assert_eq!(state.tokens.len(), 2);
        assert_eq!(snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap(), state);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!((meta.tokens, meta.next_token_id), (state.tokens.clone(), state.next_token_id));
    }

    #[test]
    fn join_tokens_round_trip_through_commands_snapshots_and_meta() {
        let hour = 3_600_000;
        let commands = [
            Command::CreateJoinToken { sha256: "a".repeat(64), ttl_ms: hour },
            Command::CreateJoinToken { sha256: "b".repeat(64), ttl_ms: hour },
            Command::ConsumeJoinToken {
                sha256: "a".repeat(64),
                node: "gpu-1".into(),
                public_key_sha256: "c".repeat(64),
            },
        ];
        let mut state = State::default();
        for (i, command) in commands.into_iter().enumerate() {
            let request = Request { ts: Timestamp::compose(1_000 + i as u64, 0), command };
            assert_eq!(command_from_bytes(&command_to_bytes(&request)).unwrap(), request);
            state.apply(&request).unwrap();
        }
        assert!(state.join_tokens[&1].used.is_some() && state.join_tokens[&2].used.is_none());
        assert_eq!(snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap(), state);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!((meta.join_tokens, meta.next_join_token_id), (state.join_tokens.clone(), state.next_join_token_id));
    }

    #[test]
    fn scheduling_commands_and_state_round_trip() {
        let schedule = Request {
            ts: Timestamp(5),
            command: Command::Schedule {
                placements: vec![
                    Placement {
                        job_id: 1,
                        node: "n1".into(),
                        gpus: vec![0, 1],
                        more_nodes: vec![NodeGpus { node: "n2".into(), gpus: vec![2, 3] }],
                        slice: None,
                    },
                    Placement {
                        job_id: 2,
                        node: "n3".into(),
                        gpus: vec![4],
                        more_nodes: vec![],
                        slice: Some(SliceAssignment::Mig {
                            profile: "3g.40gb".into(),
                            start: 4,
                            memory_slices: 4,
                            compute_slices: 3,
                        }),
                    },
                ],
                preemptions: vec![Preemption { job_id: 7, by: 1, grace_secs: 30 }],
            },
        };
        assert_eq!(command_from_bytes(&command_to_bytes(&schedule)).unwrap(), schedule);
        let preempt = Request { ts: Timestamp(6), command: Command::PreemptJob { job_id: 7, by: 1, grace_secs: 9 } };
        assert_eq!(command_from_bytes(&command_to_bytes(&preempt)).unwrap(), preempt);
        let part = Request {
            ts: Timestamp(7),
            command: Command::JobFinished {
                job_id: 1,
                epoch: 3,
                node: "n2".into(),
                report: JobExitReport { exit_code: Some(0), run_time_ms: 10, ..Default::default() },
            },
        };
        assert_eq!(command_from_bytes(&command_to_bytes(&part)).unwrap(), part);
        // A gang whose parts ended apart keeps how each ended (a lost node has no report).
        let job = Job {
            id: 1,
            spec: JobSpec { name: "g".into(), command: vec!["true".into()].into(), ..JobSpec::default() },
            state: JobState::Running,
            request_id: "r".into(),
            submitted_at: Timestamp(1),
            admitted_at: None,
            started_at: None,
            finished_at: None,
            allocation: Some(Allocation {
                node: "n1".into(),
                gpus: vec![0],
                epoch: 3,
                more_nodes: vec![NodeGpus { node: "n2".into(), gpus: vec![1] }],
                slice: None,
                ended: vec![
                    PartEnd {
                        node: "n2".into(),
                        report: Some(JobExitReport { exit_code: Some(1), ..Default::default() }),
                    },
                    PartEnd { node: "n1".into(), report: None },
                ],
                price_breaks: vec![PriceBreak {
                    at: Timestamp(7),
                    price_micros_per_gpu_hour: 890_000,
                    multiplier_milli: 400,
                    policy_version: 2,
                }],
                ready: vec!["n2".into()],
                idle: vec!["n1".into()],
                master_port: None,
            }),
            preemption: None,
            held: false,
            waiting_on: Vec::new(),
            array_task: None,
            array_progress: None,
            restarts: 0,
            signals: Vec::new(),
            steps: corral_types::JobSteps {
                next_id: 7,
                dropped: 5,
                steps: vec![
                    corral_types::JobStep {
                        id: 5,
                        epoch: 3,
                        request_id: "srun-5".into(),
                        spec: corral_types::StepSpec { command: vec!["hostname".into()], ..Default::default() },
                        nodes: vec![corral_types::StepNode {
                            node: "n1".into(),
                            first_task: 0,
                            tasks: 2,
                            gpus: vec![],
                        }],
                        state: corral_types::StepState::Failed,
                        created_at: Timestamp(4),
                        ended_at: Some(Timestamp(6)),
                        exit_code: Some(137),
                        reason: Some("exit code 137".into()),
                        ended: vec![corral_types::StepNodeEnd {
                            node: "n1".into(),
                            tasks: vec![corral_types::TaskExit { task: 1, exit_code: None, signal: Some(9) }],
                            launch_error: None,
                        }],
                        signals: vec![2, 15],
                        stopping: true,
                    },
                    corral_types::JobStep {
                        id: 6,
                        epoch: 3,
                        request_id: "srun-6".into(),
                        spec: test_step_spec(),
                        nodes: vec![corral_types::StepNode {
                            node: "n1".into(),
                            first_task: 0,
                            tasks: 1,
                            gpus: vec![1, 0],
                        }],
                        created_at: Timestamp(5),
                        ..Default::default()
                    },
                ],
            },
            exit_code: None,
            signal: None,
            reason: None,
            cancel_requested: false,
            attempts: 1,
            worker_run_time_ms: None,
        };
        assert_eq!(Job::try_from(pb::Job::from(&job)).unwrap(), job);

        // A running MPS job being preempted, fair-share usage, quotas and topology survive a snapshot.
        let mut config = ClusterConfig::dev_defaults();
        config.tenant_policies.get_mut("team-a").unwrap().class_quotas.insert("normal".into(), 2000);
        config.scheduler.backfill_reservations = 2;
        config.scheduler.lease_guard_secs = 900;
        let node = NodeSpec {
            name: "n1".into(),
            address: "a:1".into(),
            gpus: vec![GpuDevice {
                index: 0,
                uuid: "GPU-0".into(),
                model: "RTX 5090".into(),
                memory_mib: 32768,
                numa_node: Some(1),
                pci_switch: Some("0000:3a".into()),
                rdma_nic: Some("mlx5_0".into()),
                mig_capable: false,
            }],
            cpu_millis: 8000,
            memory_bytes: 1 << 34,
            labels: vec![],
            rendezvous_ports: None,
            lease_end: None,
        };
        let mut state = State::default();
        let apply = |state: &mut State, ts: u64, command: Command| state.apply(&Request { ts: Timestamp(ts), command });
        apply(&mut state, 1, Command::Configure(config)).unwrap();
        apply(&mut state, 2, Command::RegisterNode { spec: node }).unwrap();
        let mut low = JobSpec {
            name: "low".into(),
            tenant: "team-a".into(),
            priority_class: "preemptible".into(),
            gpu_slice: Some(GpuSlice::Mps { thread_percent: 50, memory_mib: None }),
            command: vec!["true".into()].into(),
            ..JobSpec::default()
        };
        apply(&mut state, 3, Command::SubmitJob { request_id: "a".into(), spec: low.clone() }).unwrap();
        low.priority_class = "gpu-high-priority".into();
        low.gpu_slice = Some(GpuSlice::Mps { thread_percent: 80, memory_mib: None });
        apply(&mut state, 4, Command::SubmitJob { request_id: "b".into(), spec: low }).unwrap();
        apply(&mut state, 5, Command::PlaceJob { job_id: 1, node: "n1".into(), gpus: vec![0] }).unwrap();
        apply(&mut state, 6, Command::JobStarted { job_id: 1, epoch: 2 }).unwrap();
        apply(&mut state, 7, Command::PreemptJob { job_id: 1, by: 2, grace_secs: 30 }).unwrap();
        state.usage.tenants.insert("team-a".into(), [(0, 5000), (60_000, 7000)].into());
        let back = snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap();
        assert_eq!(back, state);
        assert!(back.jobs[&1].allocation.as_ref().unwrap().slice.is_some());
        assert_eq!(back.preempting_jobs().map(|j| j.id).collect::<Vec<_>>(), vec![1]);
        let meta = meta_from_bytes(&meta_to_bytes(&state)).unwrap();
        assert_eq!((meta.usage, meta.config), (state.usage.clone(), state.config.clone()));
        assert_eq!(job_from_bytes(&job_to_bytes(&state.jobs[&1])).unwrap(), state.jobs[&1]);
    }
}
