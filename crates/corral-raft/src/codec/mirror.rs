//! The stored format and the wire protocol mirror each other on purpose: `state.proto`'s job,
//! node and segment messages (this codec) and `corral.proto`'s (corral-proto's `wire.rs`)
//! convert the same domain types of corral-types, field for field. This test keeps them from
//! drifting apart.
//!
//! What "agree" means, for arbitrary values of every domain type both sides convert (`Job` and
//! what it holds: `JobSpec`, `GpuSlice`, `JobExitReport`; `NodeSpec`; `Segment`):
//! - each side round-trips the value: the codec to the same value, the wire to the same value
//!   except for what the API leaves out on purpose (an allocation's `price_breaks`: the billing
//!   segments carry pricing to users);
//! - the two messages share field numbers and types: the wire's bytes of a value are the
//!   codec's bytes of that value less what the API leaves out, byte for byte, so the bytes of
//!   either decode as the other's message to the same value (what the reader's side keeps of it).
//!
//! A field added to a domain type is added to both conversions (they name every field, or
//! they do not compile) and to the strategies below (which build values field by field); a
//! field that one message carries and the other does not, or a number the two use for
//! different things, fails the byte comparison unless it is named here as left out.

use super::pb as state;
use corral_proto::v1 as wire;
use corral_types::{
    Allocation, ArrayProgress, ArrayRange, ArraySpec, ArrayTask, Dependency, DependencyKind, EndCause, GpuDevice,
    GpuSlice, Job, JobExitReport, JobSpec, JobState, NodeGpus, NodeSpec, PartEnd, PreemptionNotice, PriceBreak,
    SchedOptions, Segment, SliceAssignment, Timestamp,
};
use proptest::collection::{btree_map, vec};
use proptest::option::of;
use proptest::prelude::*;
use prost::Message;

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,12}"
}

fn timestamp() -> impl Strategy<Value = Timestamp> {
    any::<u64>().prop_map(Timestamp)
}

fn gpu_slice() -> impl Strategy<Value = GpuSlice> {
    prop_oneof![
        (text(), any::<u32>()).prop_map(|(profile, compute_slices)| GpuSlice::Mig { profile, compute_slices }),
        (any::<u32>(), of(any::<u64>()))
            .prop_map(|(thread_percent, memory_mib)| GpuSlice::Mps { thread_percent, memory_mib }),
    ]
}

fn sched_options() -> impl Strategy<Value = SchedOptions> {
    let kind =
        prop_oneof![Just(DependencyKind::AfterOk), Just(DependencyKind::AfterAny), Just(DependencyKind::AfterNotOk)];
    let dependency = (kind, any::<u64>()).prop_map(|(kind, job_id)| Dependency { kind, job_id });
    (
        (of(any::<u32>()), any::<bool>(), any::<bool>(), of(any::<i32>()), of(any::<u32>())),
        (vec(dependency, 0..3), any::<bool>(), of(any::<u32>()), vec(text(), 0..3), any::<bool>()),
    )
        .prop_map(
            |(
                (gpus_per_node, rdma, no_requeue, checkpoint_signal, signal_before_end_secs),
                (dependencies, singleton, max_restarts, node_selector, hold),
            )| SchedOptions {
                gpus_per_node,
                rdma,
                no_requeue,
                checkpoint_signal,
                signal_before_end_secs,
                dependencies,
                singleton,
                max_restarts,
                node_selector,
                hold,
            },
        )
}

fn array_spec() -> impl Strategy<Value = ArraySpec> {
    let range =
        (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(first, last, step)| ArrayRange { first, last, step });
    (vec(range, 0..3), of(any::<u32>())).prop_map(|(ranges, max_running)| ArraySpec { ranges, max_running })
}

fn job_spec() -> impl Strategy<Value = JobSpec> {
    (
        (text(), text(), text(), any::<u32>(), of(gpu_slice()), any::<u32>(), any::<u64>(), of(any::<u64>())),
        (
            of(text()),
            vec(text(), 0..3),
            btree_map(text(), text(), 0..3),
            prop_oneof![Just(SchedOptions::default()), sched_options()],
        ),
        (of(text()), of(text()), of(text()), of(text()), of(array_spec()), of(text())),
        (
            any::<bool>(),
            any::<bool>(),
            (any::<(u32, u32, u32, u64)>(), of(any::<(u32, u32, u64)>())),
            any::<bool>(),
            of(text()),
            of(text()),
            of(text()),
            container_options(),
            of(session_options()),
        ),
    )
        .prop_map(
            |(
                (name, tenant, priority_class, gpus, gpu_slice, cpu_millis, memory_bytes, time_limit_secs),
                (image, command, env, sched),
                (workdir, script, stdout_path, stderr_path, array, image_digest),
                (
                    batch_step,
                    append_output,
                    ((nodes, ntasks, gpus_per_task, mem_per_gpu), submitted_shape),
                    exclusive,
                    gpu_type,
                    account,
                    user,
                    container,
                    session,
                ),
            )| JobSpec {
                name,
                tenant,
                priority_class,
                gpus,
                gpu_slice,
                cpu_millis,
                memory_bytes,
                time_limit_secs,
                image,
                command: command.into(),
                env: env.into(),
                sched,
                workdir,
                script: script.map(Into::into),
                stdout_path,
                stderr_path,
                array,
                image_digest,
                layout: corral_types::TaskLayout {
                    nodes,
                    ntasks,
                    gpus_per_task,
                    mem_per_gpu,
                    exclusive,
                    gpu_type,
                    submitted_shape: submitted_shape.map(|(gpus, cpu_millis, memory_bytes)| {
                        corral_types::SubmittedShape { gpus, cpu_millis, memory_bytes }
                    }),
                    ..Default::default()
                },
                batch_step,
                slurm: corral_types::SlurmNames { account, user, ..Default::default() },
                append_output,
                container,
                session,
            },
        )
}

fn session_options() -> impl Strategy<Value = corral_types::SessionOptions> {
    (of(any::<u64>()), any::<u32>()).prop_map(|(idle_timeout_secs, min_gpu_util_pct)| corral_types::SessionOptions {
        idle_timeout_secs,
        min_gpu_util_pct,
    })
}

fn container_options() -> impl Strategy<Value = corral_types::ContainerOptions> {
    let mount = (text(), text(), any::<bool>()).prop_map(|(source, target, read_only)| corral_types::ContainerMount {
        source,
        target,
        read_only,
    });
    prop_oneof![
        Just(corral_types::ContainerOptions::default()),
        (vec(mount, 0..3), of(text()), vec(text(), 0..3))
            .prop_map(|(mounts, workdir, env)| corral_types::ContainerOptions { mounts, workdir, env }),
    ]
}

fn gpu_fault_mark() -> impl Strategy<Value = corral_types::GpuFaultMark> {
    (any::<u32>(), text(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
        |(gpu, reason, node_epoch, seq, job_id)| corral_types::GpuFaultMark { gpu, reason, node_epoch, seq, job_id },
    )
}

fn exit_report() -> impl Strategy<Value = JobExitReport> {
    (
        of(any::<i32>()),
        of(any::<i32>()),
        any::<bool>(),
        any::<u64>(),
        any::<bool>(),
        of(text()),
        any::<bool>(),
        any::<bool>(),
        vec(gpu_fault_mark(), 0..2),
        of(text()),
    )
        .prop_map(
            |(
                exit_code,
                signal,
                oom_killed,
                run_time_ms,
                timed_out,
                launch_error,
                never_started,
                fenced,
                gpu_faults,
                idle_end,
            )| {
                JobExitReport {
                    exit_code,
                    signal,
                    oom_killed,
                    run_time_ms,
                    timed_out,
                    launch_error,
                    never_started,
                    fenced,
                    gpu_faults,
                    idle_end,
                }
            },
        )
}

fn slice_assignment() -> impl Strategy<Value = SliceAssignment> {
    prop_oneof![
        (text(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(profile, start, memory_slices, compute_slices)| SliceAssignment::Mig {
                profile,
                start,
                memory_slices,
                compute_slices
            }
        ),
        (any::<u32>(), any::<u64>())
            .prop_map(|(thread_percent, memory_mib)| SliceAssignment::Mps { thread_percent, memory_mib }),
    ]
}

fn allocation() -> impl Strategy<Value = Allocation> {
    let node_gpus = (text(), vec(any::<u32>(), 0..3)).prop_map(|(node, gpus)| NodeGpus { node, gpus });
    let part_end = (text(), of(exit_report())).prop_map(|(node, report)| PartEnd { node, report });
    let price_break = (timestamp(), any::<u64>(), any::<u32>(), any::<u64>()).prop_map(
        |(at, price_micros_per_gpu_hour, multiplier_milli, policy_version)| PriceBreak {
            at,
            price_micros_per_gpu_hour,
            multiplier_milli,
            policy_version,
        },
    );
    (
        (text(), vec(any::<u32>(), 0..4), any::<u64>(), vec(node_gpus, 0..3)),
        (of(slice_assignment()), of(any::<u32>()), vec(part_end, 0..3), vec(price_break, 0..3), vec(text(), 0..3)),
        vec(text(), 0..3),
    )
        .prop_map(|((node, gpus, epoch, more_nodes), (slice, master_port, ended, price_breaks, ready), idle)| {
            Allocation { node, gpus, epoch, more_nodes, slice, master_port, ended, price_breaks, ready, idle }
        })
}

fn job() -> impl Strategy<Value = Job> {
    let state = prop_oneof![
        Just(JobState::Pending),
        Just(JobState::Running),
        Just(JobState::Succeeded),
        Just(JobState::Failed),
        Just(JobState::Cancelled),
        Just(JobState::Preempted),
    ];
    let preemption = (any::<u64>(), timestamp(), any::<u32>(), of(any::<i32>()))
        .prop_map(|(by, at, grace_secs, checkpoint_signal)| PreemptionNotice { by, at, grace_secs, checkpoint_signal });
    let array_task = (any::<u64>(), any::<u32>()).prop_map(|(array, index)| ArrayTask { array, index });
    let array_progress = (any::<u32>(), any::<u32>(), any::<u32>(), vec(any::<u32>(), 0..3)).prop_map(
        |(created, succeeded, unsuccessful, skipped)| ArrayProgress { created, succeeded, unsuccessful, skipped },
    );
    (
        (any::<u64>(), job_spec(), state, text(), timestamp(), of(timestamp()), of(timestamp()), of(timestamp())),
        (
            of(allocation()),
            of(any::<i32>()),
            of(any::<i32>()),
            of(text()),
            any::<bool>(),
            any::<u32>(),
            of(any::<u64>()),
        ),
        (of(preemption), any::<bool>(), vec(any::<u64>(), 0..3), of(array_task), of(array_progress), any::<u32>()),
        vec(any::<i32>(), 0..3),
    )
        .prop_map(
            |(
                (id, spec, state, request_id, submitted_at, admitted_at, started_at, finished_at),
                (allocation, exit_code, signal, reason, cancel_requested, attempts, worker_run_time_ms),
                (preemption, held, waiting_on, array_task, array_progress, restarts),
                signals,
            )| Job {
                id,
                spec,
                state,
                request_id,
                submitted_at,
                admitted_at,
                started_at,
                finished_at,
                allocation,
                exit_code,
                signal,
                reason,
                cancel_requested,
                attempts,
                worker_run_time_ms,
                preemption,
                held,
                waiting_on,
                array_task,
                array_progress,
                restarts,
                signals,
                // Steps round-trip in the codec's own tests (`codec/step.rs`, `mod.rs`).
                steps: Default::default(),
            },
        )
}

fn node_spec() -> impl Strategy<Value = NodeSpec> {
    let gpu = ((any::<u32>(), text(), text(), any::<u64>()), (of(any::<u32>()), of(text()), of(text()), any::<bool>()))
        .prop_map(|((index, uuid, model, memory_mib), (numa_node, pci_switch, rdma_nic, mig_capable))| GpuDevice {
            index,
            uuid,
            model,
            memory_mib,
            numa_node,
            pci_switch,
            rdma_nic,
            mig_capable,
        });
    (
        text(),
        text(),
        vec(gpu, 0..3),
        any::<u64>(),
        any::<u64>(),
        vec((text(), text()), 0..3),
        of((any::<u32>(), any::<u32>())),
        of(any::<u64>().prop_map(Timestamp)),
    )
        .prop_map(|(name, address, gpus, cpu_millis, memory_bytes, labels, rendezvous_ports, lease_end)| {
            NodeSpec { name, address, gpus, cpu_millis, memory_bytes, labels, rendezvous_ports, lease_end }
        })
}

fn segment() -> impl Strategy<Value = Segment> {
    (
        (any::<u64>(), any::<u64>(), any::<u64>(), text(), text(), text(), any::<u32>(), any::<u32>(), text()),
        (any::<u32>(), any::<u64>(), timestamp(), timestamp(), any::<u64>(), any::<bool>(), text(), any::<u64>()),
        (any::<u64>(), proptest::option::of(proptest::sample::select(EndCause::ALL.to_vec())), any::<Option<u64>>()),
    )
        .prop_map(
            |(
                (id, job_id, epoch, tenant, node, gpu_model, gpus, gpu_milli, priority_class),
                (multiplier_milli, price_micros_per_gpu_hour, start, end, duration_ms, lost, end_state, cost_micros),
                (policy_version, cause, credit_for),
            )| Segment {
                id,
                job_id,
                epoch,
                tenant,
                node,
                gpu_model,
                gpus,
                gpu_milli,
                priority_class,
                multiplier_milli,
                price_micros_per_gpu_hour,
                start,
                end,
                duration_ms,
                lost,
                end_state,
                cost_micros,
                policy_version,
                cause,
                credit_for,
            },
        )
}

/// What the wire keeps of a job: all of it but its allocation's price breaks.
fn as_the_api_shows(job: &Job) -> Job {
    let mut job = job.clone();
    if let Some(allocation) = &mut job.allocation {
        allocation.price_breaks.clear();
    }
    job
}

/// Checks that the codec's message `S` and the wire's message `W` agree on `value` (see the
/// module docs); `shown` is what the wire keeps of it.
fn agree<T, S, W>(value: &T, shown: &T)
where
    T: PartialEq + std::fmt::Debug,
    for<'a> S: Message + Default + From<&'a T>,
    for<'a> W: Message + Default + From<&'a T>,
    T: TryFrom<S> + TryFrom<W>,
    <T as TryFrom<S>>::Error: std::fmt::Debug,
    <T as TryFrom<W>>::Error: std::fmt::Debug,
{
    let stored = S::from(value).encode_to_vec();
    let sent = W::from(value).encode_to_vec();
    let decode_stored =
        |bytes: &[u8]| T::try_from(S::decode(bytes).expect("decodes as the stored message")).expect("converts");
    let decode_sent =
        |bytes: &[u8]| T::try_from(W::decode(bytes).expect("decodes as the wire message")).expect("converts");
    assert_eq!(&decode_stored(&stored), value, "the codec round-trips it");
    assert_eq!(&decode_sent(&sent), shown, "the wire round-trips what it shows");
    assert_eq!(sent, S::from(shown).encode_to_vec(), "the wire's bytes are the codec's of what it shows");
    assert_eq!(&decode_stored(&sent), shown, "the wire's bytes read as stored");
    assert_eq!(&decode_sent(&stored), shown, "the stored bytes read as the wire's");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn jobs_agree(job in job()) {
        agree::<Job, state::Job, wire::Job>(&job, &as_the_api_shows(&job));
    }

    #[test]
    fn job_specs_agree(spec in job_spec()) {
        agree::<JobSpec, state::JobSpec, wire::JobSpec>(&spec, &spec);
    }

    #[test]
    fn gpu_slices_agree(slice in gpu_slice()) {
        agree::<GpuSlice, state::GpuSlice, wire::GpuSlice>(&slice, &slice);
    }

    #[test]
    fn exit_reports_agree(report in exit_report()) {
        agree::<JobExitReport, state::JobExitReport, wire::JobExitReport>(&report, &report);
    }

    #[test]
    fn node_specs_agree(node in node_spec()) {
        agree::<NodeSpec, state::NodeSpec, wire::NodeSpec>(&node, &node);
    }

    #[test]
    fn segments_agree(segment in segment()) {
        agree::<Segment, state::Segment, wire::Segment>(&segment, &segment);
    }
}
