//! Golden bytes of the persisted encoding: every Raft log command kind, a snapshot, and the
//! state machine store's per-key records (job, node, segment, scalar meta), as format version 2
//! wrote them, and a snapshot as format version 3 writes it (version 2 snapshots still decode). The files under `tests/golden/` are what coordinators have on disk; the codec must
//! decode them to the values below and encode those values to the very same bytes.
//!
//! The values are spelled out field by field (no `dev_defaults`, no `apply`), so that only a
//! change of the encoding can fail these tests. A missing file is written when
//! `CORRAL_WRITE_GOLDEN=1` is set (for a new record kind); an existing file is never rewritten.

use corral_core::{
    ClusterConfig, Command, CoordinatorRecord, Placement, Preemption, PriorityClass, Request, RequestKey,
    RequestRecord, SchedulerConfig, State, TenantPolicy, TokenRecord, UsageLedger,
};
use corral_raft::codec::{
    command_from_bytes, command_to_bytes, job_from_bytes, job_to_bytes, meta_from_bytes, meta_to_bytes,
    node_from_bytes, node_to_bytes, segment_from_bytes, segment_to_bytes, snapshot_from_bytes, snapshot_to_bytes,
    StateMeta,
};
use corral_types::{
    Allocation, GpuDevice, GpuSlice, Job, JobExitReport, JobSpec, JobState, NodeGpus, NodeMode, NodeSpec, NodeState,
    NodeStatus, PartEnd, PreemptionNotice, SchedOptions, Segment, SliceAssignment, Timestamp,
};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::PathBuf;

/// Checks one golden file: it decodes to `value`, and `value` encodes to its bytes.
fn check<T, E>(name: &str, value: &T, encode: impl Fn(&T) -> Vec<u8>, decode: impl Fn(&[u8]) -> Result<T, E>)
where
    T: PartialEq + Debug,
    E: Debug,
{
    let bytes = golden(name, || encode(value));
    let decoded = decode(&bytes).unwrap_or_else(|e| panic!("golden {name} no longer decodes: {e:?}"));
    assert_eq!(&decoded, value, "golden {name} decodes to another value");
    assert!(encode(value) == bytes, "{name} no longer encodes to its golden bytes");
}

/// The bytes of `tests/golden/<name>.bin`; a missing file is written from `write` only when
/// `CORRAL_WRITE_GOLDEN` is set.
fn golden(name: &str, write: impl FnOnce() -> Vec<u8>) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(format!("{name}.bin"));
    if !path.exists() && std::env::var_os("CORRAL_WRITE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().expect("a parent dir")).expect("create tests/golden");
        std::fs::write(&path, write()).expect("write a golden file");
    }
    std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn ts(physical_ms: u64, logical: u64) -> Timestamp {
    Timestamp::compose(physical_ms, logical)
}

/// A spec with every field set.
fn full_spec() -> JobSpec {
    JobSpec {
        name: "train-llm".into(),
        tenant: "team-a".into(),
        priority_class: "gpu-high-priority".into(),
        gpus: 8,
        gpu_slice: None,
        cpu_millis: 32_000,
        memory_bytes: 256 << 30,
        time_limit_secs: Some(86_400),
        image: Some("registry.example/llm:1.4".into()),
        command: vec!["torchrun".into(), "--nproc-per-node=4".into(), "train.py".into()].into(),
        env: std::sync::Arc::new(
            [("NCCL_DEBUG".to_string(), "INFO".to_string()), ("SEED".to_string(), "7".to_string())].into(),
        ),
        sched: SchedOptions {
            gpus_per_node: Some(4),
            rdma: true,
            no_requeue: true,
            checkpoint_signal: Some(10),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn mig_spec() -> JobSpec {
    JobSpec {
        name: "notebook".into(),
        tenant: "team-b".into(),
        priority_class: "normal".into(),
        gpus: 0,
        gpu_slice: Some(GpuSlice::Mig { profile: "3g.40gb".into(), compute_slices: 3 }),
        cpu_millis: 2000,
        memory_bytes: 8 << 30,
        command: vec!["jupyter".into(), "lab".into()].into(),
        ..JobSpec::default()
    }
}

fn mps_spec() -> JobSpec {
    JobSpec {
        name: "infer".into(),
        tenant: "default".into(),
        priority_class: "preemptible".into(),
        gpu_slice: Some(GpuSlice::Mps { thread_percent: 25, memory_mib: Some(16_384) }),
        command: vec!["serve".into()].into(),
        ..JobSpec::default()
    }
}

fn full_report() -> JobExitReport {
    JobExitReport {
        exit_code: Some(137),
        signal: Some(9),
        oom_killed: true,
        run_time_ms: 3_600_123,
        timed_out: true,
        launch_error: Some("exec format error".into()),
        never_started: true,
        fenced: true,
        // Pinned before card faults were reported: none, so the pinned bytes stand.
        gpu_faults: Vec::new(),
        // Pinned before sessions ended idle: none, so the pinned bytes stand.
        idle_end: None,
    }
}

/// A gang job with every field set: two parts, one ended with a report, one on a lost node.
fn full_job() -> Job {
    Job {
        id: 42,
        spec: full_spec(),
        state: JobState::Failed,
        request_id: "req-42".into(),
        submitted_at: ts(1_700_000_000_000, 1),
        admitted_at: Some(ts(1_700_000_001_000, 0)),
        started_at: Some(ts(1_700_000_002_000, 3)),
        finished_at: Some(ts(1_700_000_900_000, 0)),
        allocation: Some(Allocation {
            node: "gpu-01".into(),
            gpus: vec![0, 1, 2, 3],
            epoch: 17,
            more_nodes: vec![NodeGpus { node: "gpu-02".into(), gpus: vec![4, 5, 6, 7] }],
            slice: None,
            ended: vec![
                PartEnd { node: "gpu-02".into(), report: Some(full_report()) },
                PartEnd { node: "gpu-01".into(), report: None },
            ],
            price_breaks: vec![],
            ready: vec![],
            idle: vec![],
            master_port: None,
        }),
        exit_code: Some(1),
        signal: Some(15),
        reason: Some("part on gpu-02 failed".into()),
        cancel_requested: true,
        attempts: 2,
        worker_run_time_ms: Some(898_000),
        preemption: Some(PreemptionNotice {
            by: 43,
            at: ts(1_700_000_800_000, 0),
            grace_secs: 30,
            checkpoint_signal: Some(12),
        }),
        held: false,
        waiting_on: Vec::new(),
        array_task: None,
        array_progress: None,
        restarts: 0,
        signals: Vec::new(),
        steps: Default::default(),
    }
}

fn pending_job() -> Job {
    Job {
        id: 44,
        spec: mps_spec(),
        state: JobState::Pending,
        request_id: "req-44".into(),
        submitted_at: ts(1_700_000_500_000, 0),
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
        preemption: None,
        held: false,
        waiting_on: Vec::new(),
        array_task: None,
        array_progress: None,
        restarts: 0,
        signals: Vec::new(),
        steps: Default::default(),
    }
}

fn mig_job() -> Job {
    Job {
        id: 43,
        spec: mig_spec(),
        state: JobState::Running,
        request_id: "req-43".into(),
        submitted_at: ts(1_700_000_400_000, 0),
        admitted_at: Some(ts(1_700_000_401_000, 0)),
        started_at: Some(ts(1_700_000_402_000, 0)),
        allocation: Some(Allocation {
            node: "gpu-01".into(),
            gpus: vec![0],
            epoch: 18,
            more_nodes: vec![],
            slice: Some(SliceAssignment::Mig {
                profile: "3g.40gb".into(),
                start: 4,
                memory_slices: 4,
                compute_slices: 3,
            }),
            ended: vec![],
            price_breaks: vec![],
            ready: vec![],
            idle: vec![],
            master_port: None,
        }),
        attempts: 1,
        ..pending_job()
    }
}

fn mps_job() -> Job {
    Job {
        id: 45,
        state: JobState::Running,
        request_id: "req-45".into(),
        allocation: Some(Allocation {
            node: "gpu-02".into(),
            gpus: vec![1],
            epoch: 19,
            more_nodes: vec![],
            slice: Some(SliceAssignment::Mps { thread_percent: 25, memory_mib: 16_384 }),
            ended: vec![],
            price_breaks: vec![],
            ready: vec![],
            idle: vec![],
            master_port: None,
        }),
        attempts: 1,
        ..pending_job()
    }
}

fn gpu(index: u32, node: &str) -> GpuDevice {
    GpuDevice {
        index,
        uuid: format!("GPU-{node}-{index}"),
        model: "H100 80GB HBM3".into(),
        memory_mib: 81_559,
        numa_node: Some(index / 4),
        pci_switch: Some(format!("0000:{:02x}", 0x18 + index / 2)),
        rdma_nic: Some(format!("mlx5_{}", index / 2)),
        mig_capable: true,
    }
}

/// A node with every field set.
fn full_node_spec() -> NodeSpec {
    NodeSpec {
        name: "gpu-01".into(),
        address: "10.0.0.11:7171".into(),
        gpus: (0..4).map(|i| gpu(i, "gpu-01")).collect(),
        cpu_millis: 96_000,
        memory_bytes: 1 << 40,
        labels: vec![("rack".into(), "r7".into()), ("zone".into(), "eu-1".into())],
        rendezvous_ports: None,
        lease_end: None,
    }
}

fn full_node() -> NodeStatus {
    NodeStatus { spec: full_node_spec(), state: NodeState::Up, epoch: 12, ..down_node() }
}

fn down_node() -> NodeStatus {
    let spec = NodeSpec {
        name: "gpu-02".into(),
        address: "10.0.0.12:7171".into(),
        gpus: vec![GpuDevice { index: 0, uuid: "GPU-gpu-02-0".into(), model: "RTX 5090".into(), ..Default::default() }],
        cpu_millis: 16_000,
        memory_bytes: 64 << 30,
        labels: vec![],
        rendezvous_ports: None,
        lease_end: None,
    };
    // Written before node modes existed: active, no reason, no deadline.
    NodeStatus {
        spec,
        state: NodeState::Down,
        epoch: 13,
        mode: NodeMode::Active,
        mode_reason: String::new(),
        drain_deadline: None,
        gpu_faults: Vec::new(),
        lease_end_set: None,
    }
}

/// A segment with every field set.
fn full_segment() -> Segment {
    Segment {
        id: 9,
        job_id: 42,
        epoch: 17,
        tenant: "team-a".into(),
        node: "gpu-01".into(),
        gpu_model: "H100 80GB HBM3".into(),
        gpus: 8,
        gpu_milli: 8000,
        priority_class: "gpu-high-priority".into(),
        multiplier_milli: 2000,
        price_micros_per_gpu_hour: 2_500_000,
        start: ts(1_700_000_002_000, 3),
        end: ts(1_700_000_900_000, 0),
        duration_ms: 897_998,
        lost: true,
        policy_version: 0,
        end_state: "failed".into(),
        cost_micros: 9_977_755,
        cause: None,
        credit_for: None,
    }
}

fn second_segment() -> Segment {
    Segment {
        id: 10,
        job_id: 43,
        epoch: 18,
        tenant: "team-b".into(),
        node: "gpu-01".into(),
        gpu_model: "H100 80GB HBM3".into(),
        gpus: 1,
        gpu_milli: 375,
        priority_class: "normal".into(),
        multiplier_milli: 1000,
        price_micros_per_gpu_hour: 2_500_000,
        start: ts(1_700_000_402_000, 0),
        end: ts(1_700_000_403_000, 0),
        duration_ms: 1000,
        lost: false,
        policy_version: 0,
        end_state: "requeued".into(),
        cost_micros: 260,
        cause: None,
        credit_for: None,
    }
}

/// A config with every field set.
fn full_config() -> ClusterConfig {
    let class =
        |name: &str, value: i64, preempts_lower: bool, multiplier: u32, is_default: bool, grace| PriorityClass {
            name: name.into(),
            value,
            preempts_lower,
            billing_multiplier_milli: multiplier,
            is_default,
            grace_secs: grace,
            default_time_secs: None,
            max_time_secs: None,
            idle_timeout_secs: None,
        };
    ClusterConfig {
        tenants: vec!["default".into(), "team-a".into(), "team-b".into()],
        priority_classes: [
            class("preemptible", 0, false, 400, false, Some(5)),
            class("normal", 1000, false, 1000, true, None),
            class("gpu-high-priority", 1_000_000, true, 2000, false, Some(60)),
        ]
        .into_iter()
        .map(|c| (c.name.clone(), c))
        .collect(),
        tenant_policies: [
            (
                "team-a".to_string(),
                TenantPolicy {
                    quota_milli_gpus: Some(8000),
                    class_quotas: [("gpu-high-priority".to_string(), 4000)].into(),
                    cohort: Some("research".into()),
                    borrowing_limit_milli_gpus: Some(2000),
                    fair_share_weight: 3,
                    max_running_jobs: None,
                    max_pending_jobs: None,
                },
            ),
            (
                "team-b".to_string(),
                TenantPolicy {
                    quota_milli_gpus: None,
                    class_quotas: BTreeMap::new(),
                    cohort: None,
                    borrowing_limit_milli_gpus: None,
                    fair_share_weight: 1,
                    max_running_jobs: None,
                    max_pending_jobs: None,
                },
            ),
        ]
        .into(),
        scheduler: SchedulerConfig {
            usage_half_life_secs: 3 * 24 * 3600,
            backfill_reservations: 2,
            max_preemptors_per_pass: 8,
            // Pinned before lease guards existed: the default, so the pinned bytes stand.
            lease_guard_secs: 3600,
        },
        gpu_prices: [("H100 80GB HBM3".to_string(), 2_500_000), ("RTX 5090".to_string(), 400_000)].into(),
        default_gpu_price: 1_000_000,
        // Left empty: the golden files predate it, and an empty mapping is not encoded.
        slurm: Default::default(),
        credits: Default::default(),
    }
}

/// A state with jobs (finished gang, running MIG and MPS slices, pending), an up and a down
/// node, request ids, coordinators (one removed), fair-share usage, segments and tokens.
fn full_state() -> State {
    let jobs = [full_job(), mig_job(), pending_job(), mps_job()].into_iter().map(|j| (j.id, j)).collect();
    let nodes = [full_node(), down_node()].into_iter().map(|n| (n.spec.name.clone(), n)).collect();
    // Written before request ids carried their submit time: `at` decodes as 0.
    let request_ids: Vec<_> = [42, 43, 44, 45]
        .into_iter()
        .map(|id| (RequestKey::of(&format!("req-{id}")), RequestRecord { job_id: id, at: Timestamp::ZERO }))
        .collect();
    let coordinators = [
        (1, CoordinatorRecord { addr: "10.0.0.1:7070".into(), removed: false }),
        (2, CoordinatorRecord { addr: "10.0.0.2:7070".into(), removed: true }),
        (3, CoordinatorRecord { addr: "10.0.0.3:7070".into(), removed: false }),
    ]
    .into();
    let mut state = State::from_parts(
        jobs,
        nodes,
        request_ids,
        46,
        20,
        ts(1_700_000_900_000, 5),
        full_config(),
        coordinators,
        1_700_000_903_000,
    );
    state.usage = UsageLedger {
        tenants: [
            ("team-a".to_string(), [(1_699_999_200_000, 5000), (1_700_000_000_000, 7_185_600)].into()),
            ("team-b".to_string(), [(1_700_000_400_000, 375)].into()),
        ]
        .into(),
    };
    state.ledger = [full_segment(), second_segment()].into_iter().map(|g| (g.id, g)).collect();
    state.next_segment_id = 11;
    state.tokens = [
        TokenRecord {
            id: 1,
            tenant: String::new(),
            admin: true,
            sha256: "a".repeat(64),
            created: ts(1_700_000_000_100, 0),
            expires_at_ms: None,
            revoked: false,
        },
        TokenRecord {
            id: 2,
            tenant: "team-a".into(),
            admin: false,
            sha256: "0123456789abcdef".repeat(4),
            created: ts(1_700_000_000_200, 0),
            expires_at_ms: Some(1_800_000_000_000),
            revoked: true,
        },
    ]
    .into_iter()
    .map(|t| (t.id, t))
    .collect();
    state.next_token_id = 3;
    state
}

/// One request of every command kind, with every field set, named for its golden file.
fn commands() -> Vec<(&'static str, Request)> {
    let at = |n: u64| ts(1_700_000_000_000 + n * 1000, n);
    let commands = [
        ("submit-job", Command::SubmitJob { request_id: "req-42".into(), spec: full_spec() }),
        (
            "submit-jobs",
            Command::SubmitJobs { jobs: vec![("req-43".into(), mig_spec()), ("req-44".into(), mps_spec())] },
        ),
        ("place-job", Command::PlaceJob { job_id: 42, node: "gpu-01".into(), gpus: vec![0, 1, 2, 3] }),
        ("job-started", Command::JobStarted { job_id: 42, epoch: 17 }),
        ("job-finished", Command::JobFinished { job_id: 42, epoch: 17, node: "gpu-02".into(), report: full_report() }),
        ("cancel-job", Command::CancelJob { job_id: 44, reason: "cancelled by alice".into() }),
        ("register-node", Command::RegisterNode { spec: full_node_spec() }),
        (
            "set-node-state",
            Command::SetNodeState { node: "gpu-02".into(), state: NodeState::Down, reason: "missed heartbeats".into() },
        ),
        ("configure", Command::Configure(full_config())),
        ("noop", Command::Noop),
        ("add-coordinator", Command::AddCoordinator { node_id: 3, addr: "10.0.0.3:7070".into() }),
        ("remove-coordinator", Command::RemoveCoordinator { node_id: 2 }),
        ("extend-tso", Command::ExtendTso { upper_ms: 1_700_000_903_000 }),
        ("preempt-job", Command::PreemptJob { job_id: 43, by: 42, grace_secs: 30 }),
        (
            "schedule",
            Command::Schedule {
                placements: vec![
                    Placement {
                        job_id: 42,
                        node: "gpu-01".into(),
                        gpus: vec![0, 1, 2, 3],
                        more_nodes: vec![NodeGpus { node: "gpu-02".into(), gpus: vec![4, 5, 6, 7] }],
                        slice: None,
                    },
                    Placement {
                        job_id: 43,
                        node: "gpu-01".into(),
                        gpus: vec![0],
                        more_nodes: vec![],
                        slice: Some(SliceAssignment::Mig {
                            profile: "3g.40gb".into(),
                            start: 4,
                            memory_slices: 4,
                            compute_slices: 3,
                        }),
                    },
                    Placement {
                        job_id: 45,
                        node: "gpu-02".into(),
                        gpus: vec![1],
                        more_nodes: vec![],
                        slice: Some(SliceAssignment::Mps { thread_percent: 25, memory_mib: 16_384 }),
                    },
                ],
                preemptions: vec![Preemption { job_id: 41, by: 42, grace_secs: 60 }],
            },
        ),
        (
            "create-token",
            Command::CreateToken {
                tenant: "team-a".into(),
                admin: false,
                sha256: "0123456789abcdef".repeat(4),
                expires_at_ms: Some(1_800_000_000_000),
            },
        ),
        ("revoke-token", Command::RevokeToken { token_id: 2 }),
    ];
    commands.into_iter().enumerate().map(|(i, (name, command))| (name, Request { ts: at(i as u64), command })).collect()
}

#[test]
fn every_command_kind_keeps_its_bytes() {
    let commands = commands();
    assert_eq!(commands.len(), 17, "one golden command per kind");
    for (name, request) in &commands {
        check(&format!("command-{name}"), request, command_to_bytes, command_from_bytes);
    }
}

/// [`full_state`] as format version 3 keeps it: request ids with their submit time, and when
/// the last ones expired.
fn full_state_v3() -> State {
    let mut state = full_state();
    state.request_ids_expired_before = ts(1_700_000_000_000, 0);
    state.request_ids.clear();
    state.rebuild_indexes();
    state.add_request_ids(
        [42, 43, 44, 45].map(|id| {
            (RequestKey::of(&format!("req-{id}")), RequestRecord { job_id: id, at: ts(1_700_000_000_000, id) })
        }),
    );
    state
}

#[test]
fn a_snapshot_keeps_its_bytes() {
    check("snapshot-v3", &full_state_v3(), snapshot_to_bytes, snapshot_from_bytes);
}

/// The deny list of worker certificates, added to format version 3 as new fields only: a
/// removal that revokes, and a snapshot that holds revocations (a state without any encodes as
/// before: `a_snapshot_keeps_its_bytes`).
#[test]
fn the_deny_list_keeps_its_bytes() {
    let command = Command::RemoveNode { node: "gpu-02".into(), revoke_certificates: true };
    let remove = Request { ts: ts(1_700_000_100_000, 0), command };
    check("command-remove-node-revoking", &remove, command_to_bytes, command_from_bytes);
    let mut state = full_state_v3();
    state.revoked_workers = [("gpu-02".to_string(), 1_700_000_101), ("gpu-09".to_string(), 1_690_000_000)].into();
    check("snapshot-deny-list", &state, snapshot_to_bytes, snapshot_from_bytes);
}

/// Version 2 wrote request ids as strings; they decode to the keys version 3 keeps.
#[test]
fn a_version_2_snapshot_still_decodes() {
    let bytes = golden("snapshot", || unreachable!("written by format version 2"));
    let decoded = snapshot_from_bytes(&bytes).expect("a version 2 snapshot decodes");
    assert_eq!(decoded, full_state());
    assert_eq!(decoded.request_ids.len(), 4);
    assert!(snapshot_to_bytes(&decoded) != bytes, "written again as version 3");
}

#[test]
fn store_records_keep_their_bytes() {
    check("job", &full_job(), job_to_bytes, job_from_bytes);
    check("job-mig", &mig_job(), job_to_bytes, job_from_bytes);
    check("node", &full_node(), node_to_bytes, node_from_bytes);
    check("segment", &full_segment(), segment_to_bytes, segment_from_bytes);
}

#[test]
fn the_scalar_meta_keeps_its_bytes() {
    let state = full_state();
    let meta = StateMeta {
        next_job_id: state.next_job_id,
        next_epoch: state.next_epoch,
        last_ts: state.last_ts,
        config: state.config.clone(),
        coordinators: state.coordinators.clone(),
        tso_window_end_ms: state.tso_window_end_ms,
        usage: state.usage.clone(),
        next_segment_id: state.next_segment_id,
        tokens: state.tokens.clone(),
        next_token_id: state.next_token_id,
        policy_version: 0,
        join_tokens: state.join_tokens.clone(),
        next_join_token_id: state.next_join_token_id,
        revoked_workers: BTreeMap::new(),
        segments_archived_below: 0,
        archived_billed: BTreeMap::new(),
    };
    let bytes = golden("meta", || meta_to_bytes(&state));
    assert_eq!(meta_from_bytes(&bytes).expect("golden meta decodes"), meta, "golden meta decodes to another value");
    assert!(meta_to_bytes(&state) == bytes, "meta no longer encodes to its golden bytes");
}
