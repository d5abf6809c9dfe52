//! The standard gRPC services of a worker's agent listener: `grpc.health.v1.Health` and server
//! reflection (v1 and v1alpha). The overall status ("") and `corral.v1.WorkerAgent` are
//! SERVING while the worker is registered and leased by a leader, NOT_SERVING otherwise.

use std::sync::Arc;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// Over TLS, any certificate of the cluster CA may ask (every role).
pub(crate) fn guard(tls: bool, audit: Arc<corral_security::AuditLog>) -> corral_security::RoleGuard {
    use corral_security::Role;
    const ALL: &[Role] = &[Role::Coordinator, Role::Worker, Role::Client, Role::Admin];
    corral_security::RoleGuard::new("health and reflection", ALL, tls, audit)
}

/// Services that reflection lists: the service a worker serves, health and reflection.
const SERVED: &[&str] = &["corral.v1.WorkerAgent"];

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

/// Keeps `reporter` true to `serving` (the runtime's registration) until the task is aborted.
pub(crate) async fn report(mut serving: tokio::sync::watch::Receiver<bool>, reporter: HealthReporter) {
    loop {
        let status = if *serving.borrow_and_update() { ServingStatus::Serving } else { ServingStatus::NotServing };
        for service in ["", "corral.v1.WorkerAgent"] {
            reporter.set_service_status(service, status).await;
        }
        if serving.changed().await.is_err() {
            return;
        }
    }
}
