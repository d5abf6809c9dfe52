//! The standard gRPC services of a coordinator: `grpc.health.v1.Health` and server reflection
//! (v1 and v1alpha, from corral-proto's file descriptor set).
//!
//! Health: the overall status ("") and the services that only a leader answers (`Corral`,
//! `WorkerGateway`, `NodeJoin`) are SERVING while this coordinator can serve writes and
//! linearizable reads: it leads and a quorum confirmed it within the leader lease (the rule of
//! the timestamp oracle). Otherwise NOT_SERVING. `Raft` and `ClusterAdmin`, which every member
//! answers, are always SERVING. Re-checked every `CHECK_EVERY`; watchers see each change.

use crate::Coordinator;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often leadership is re-checked.
const CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Services that only a leader (within its lease) answers.
const LEADER_SERVICES: [&str; 4] = ["", "corral.v1.Corral", "corral.v1.WorkerGateway", "corral.v1.NodeJoin"];
/// Services every member answers.
const MEMBER_SERVICES: [&str; 2] = ["corral.raft.v1.Raft", "corral.v1.ClusterAdmin"];

/// Services that reflection lists: the services a coordinator serves, health and reflection.
const SERVED: &[&str] = &[
    "corral.v1.Corral",
    "corral.v1.WorkerGateway",
    "corral.v1.ClusterAdmin",
    "corral.v1.NodeJoin",
    "corral.raft.v1.Raft",
];

/// The reflection services (v1 and v1alpha: grpcurl and older tools ask for either).
pub(crate) fn reflection() -> anyhow::Result<(
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
    tonic_reflection::server::v1alpha::ServerReflectionServer<impl tonic_reflection::server::v1alpha::ServerReflection>,
)> {
    let builder = |reflection: &str| {
        let mut builder = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(corral_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("grpc.health.v1.Health")
            .with_service_name(reflection);
        for service in SERVED {
            builder = builder.with_service_name(*service);
        }
        builder
    };
    Ok((
        builder("grpc.reflection.v1.ServerReflection").build_v1()?,
        builder("grpc.reflection.v1alpha.ServerReflection").build_v1alpha()?,
    ))
}

/// Keeps `reporter` true to this coordinator's leadership until the task is aborted.
pub(crate) async fn report(coord: Coordinator, reporter: HealthReporter) {
    for service in MEMBER_SERVICES {
        reporter.set_service_status(service, ServingStatus::Serving).await;
    }
    let mut last = None;
    loop {
        let serving = coord.leader_term_within_lease().is_ok();
        if last != Some(serving) {
            let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
            for service in LEADER_SERVICES {
                reporter.set_service_status(service, status).await;
            }
            last = Some(serving);
        }
        tokio::time::sleep(CHECK_EVERY).await;
    }
}
