//! The standard gRPC services of a coordinator: `grpc.health.v1.Health` and server reflection
//! (v1 and v1alpha: corral-proto's `reflection_services`, listing [`SERVED`]).
//!
//! Health: the overall status ("") and the services that only a leader answers (`Corral`,
//! `WorkerGateway`, `NodeJoin`) are SERVING while this coordinator can serve writes and
//! linearizable reads: it leads and a quorum confirmed it within the leader lease (the rule of
//! the timestamp oracle). Otherwise NOT_SERVING. `Raft` and `ClusterAdmin`, which every member
//! answers, are always SERVING. Re-checked every `CHECK_EVERY`; watchers see each change.

use crate::Coordinator;
use corral_proto::v1 as pb;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often leadership is re-checked.
const CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Services that only a leader (within its lease) answers; "" is the overall status.
const LEADER_SERVICES: [&str; 4] =
    ["", pb::corral_server::SERVICE_NAME, pb::worker_gateway_server::SERVICE_NAME, pb::node_join_server::SERVICE_NAME];
/// Services every member answers.
const MEMBER_SERVICES: [&str; 2] =
    [corral_proto::raft::raft_server::SERVICE_NAME, pb::cluster_admin_server::SERVICE_NAME];

/// The corral services a coordinator serves, which reflection lists (with health and itself).
pub(crate) const SERVED: [&str; 5] = [
    pb::corral_server::SERVICE_NAME,
    pb::worker_gateway_server::SERVICE_NAME,
    pb::cluster_admin_server::SERVICE_NAME,
    pb::node_join_server::SERVICE_NAME,
    corral_proto::raft::raft_server::SERVICE_NAME,
];

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
