//! Server reflection (`grpc.reflection.v1` and `v1alpha`) over corral's descriptors and the
//! health service's: the one setup that every corral server (coordinators and worker agents)
//! serves, each naming the corral services it carries.

use tonic_reflection::server::{v1, v1alpha, Builder};

pub use tonic_reflection::server::Error as ReflectionError;

/// The standard health service, which every corral server carries next to reflection.
const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// The reflection services, v1 and v1alpha (grpcurl and older tools ask for either). Each lists
/// `served` (the full names of the corral services of this server, e.g.
/// `v1::corral_server::SERVICE_NAME`), `grpc.health.v1.Health` and itself.
#[allow(clippy::type_complexity)]
pub fn reflection_services(
    served: &[&str],
) -> Result<
    (
        v1::ServerReflectionServer<impl v1::ServerReflection>,
        v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>,
    ),
    ReflectionError,
> {
    let builder = |reflection: &str| {
        let builder = Builder::configure()
            .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(HEALTH_SERVICE)
            .with_service_name(reflection);
        served.iter().fold(builder, |builder, service| builder.with_service_name(*service))
    };
    Ok((
        builder("grpc.reflection.v1.ServerReflection").build_v1()?,
        builder("grpc.reflection.v1alpha.ServerReflection").build_v1alpha()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The descriptor sets decode, so a server that serves reflection starts.
    #[test]
    fn the_services_build_from_the_descriptor_sets() {
        let served = [crate::v1::corral_server::SERVICE_NAME, crate::v1::worker_agent_server::SERVICE_NAME];
        reflection_services(&served).expect("reflection services");
    }
}
