//! The standard gRPC services of a worker's agent listener: `grpc.health.v1.Health` and server
//! reflection (v1 and v1alpha: corral-proto's `reflection_services`, listing [`SERVED`]). The
//! overall status ("") and `corral.v1.WorkerAgent` are SERVING while the worker is registered
//! and leased by a leader, NOT_SERVING otherwise.

use std::sync::Arc;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// Over TLS, any certificate of the cluster CA may ask (every role).
pub(crate) fn guard(tls: bool, audit: Arc<corral_security::AuditLog>) -> corral_security::RoleGuard {
    use corral_security::Role;
    const ALL: &[Role] = &[Role::Coordinator, Role::Worker, Role::Client, Role::Admin];
    corral_security::RoleGuard::new("health and reflection", ALL, tls, audit)
}

/// The corral service a worker agent serves, which reflection lists (with health and itself).
const SERVED: [&str; 1] = [corral_proto::v1::worker_agent_server::SERVICE_NAME];

/// The reflection services (v1 and v1alpha: grpcurl and older tools ask for either).
#[allow(clippy::type_complexity)]
pub(crate) fn reflection() -> anyhow::Result<(
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
    tonic_reflection::server::v1alpha::ServerReflectionServer<impl tonic_reflection::server::v1alpha::ServerReflection>,
)> {
    Ok(corral_proto::reflection_services(&SERVED)?)
}

/// Keeps `reporter` true to `serving` (the runtime's registration) until the task is aborted.
pub(crate) async fn report(mut serving: tokio::sync::watch::Receiver<bool>, reporter: HealthReporter) {
    loop {
        let status = if *serving.borrow_and_update() { ServingStatus::Serving } else { ServingStatus::NotServing };
        for service in ["", corral_proto::v1::worker_agent_server::SERVICE_NAME] {
            reporter.set_service_status(service, status).await;
        }
        if serving.changed().await.is_err() {
            return;
        }
    }
}
