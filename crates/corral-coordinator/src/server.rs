//! The one gRPC server of a coordinator, and the leader's loops that run alongside it.
//!
//! Its services come in groups, each service behind its role check (`auth.rs`):
//! - client-facing: the user API (`api/`, behind `leader_writes.rs`), which `watch.rs`,
//!   `listing.rs` and `log_proxy.rs` serve too;
//! - worker-facing: the worker gateway (`gateway.rs`, with `desired.rs`'s streams) and the join
//!   service (`join.rs`, the one service without a role check);
//! - the cluster's members: Raft and cluster admin (`cluster.rs`);
//! - health and reflection (`grpc_health.rs`), which every role may probe.
//!
//! The control loop — Raft, the worker gateway, health, the leader's loops and the
//! connections themselves — runs on the runtime `serve` is called on; the user API, cluster
//! admin and joins are served on the client runtime, admitted a bounded number at a time
//! (`client_work.rs`), so that no client load delays a vote, an append or a heartbeat.

use crate::auth::Service;
use crate::{api, cluster, compaction, gateway, grpc_health, join, leader_writes, scheduler, Coordinator};
use std::future::Future;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::service::RoutesBuilder;

/// The interceptor of `service`: the caller's certificate must carry a role it accepts.
fn guard(coord: &Coordinator, service: Service) -> impl tonic::service::Interceptor + Clone + Send + Sync + 'static {
    let guard = service.guard(coord.security());
    move |request: tonic::Request<()>| guard.check(request)
}

impl Coordinator {
    /// Serves the Raft, user API and worker gateway services on `listener` until `shutdown`
    /// resolves; the leader's scheduling loop runs alongside.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let scheduler = tokio::spawn(scheduler::run(self.clone()));
        let compactor = tokio::spawn(compaction::run(self.clone()));
        let serving = tokio::spawn(crate::serving::watch(self.clone()));
        let group_task = self.submits().start(self.clone());
        let (reporter, health) = tonic_health::server::health_reporter();
        let health_task = tokio::spawn(grpc_health::report(self.clone(), reporter));
        let (reflection, reflection_alpha) = corral_proto::reflection_services(&grpc_health::SERVED)?;

        let mut routes = RoutesBuilder::default();
        self.add_client_services(&mut routes);
        self.add_worker_services(&mut routes);
        self.add_member_services(&mut routes);
        // Health and reflection: any certificate of the cluster CA, whatever its role.
        routes
            .add_service(InterceptedService::new(health, guard(&self, Service::Standard)))
            .add_service(InterceptedService::new(reflection, guard(&self, Service::Standard)))
            .add_service(InterceptedService::new(reflection_alpha, guard(&self, Service::Standard)));

        let security = self.security();
        if let Some(tls) = &security.server_tls {
            tls.set_revocations(crate::join::revocations(self.store().clone()));
        }
        let incoming = corral_security::audited_incoming(listener, security.server_tls.clone(), security.audit.clone());
        let result = tonic::transport::Server::builder()
            .add_routes(routes.routes())
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await;
        scheduler.abort();
        compactor.abort();
        serving.abort();
        group_task.abort();
        health_task.abort();
        result.map_err(Into::into)
    }

    /// The user API, for clients and admins, on the client runtime.
    fn add_client_services(&self, routes: &mut RoutesBuilder) {
        let api = leader_writes::LeaderWrites::new(api::server(self.clone()), self.clone());
        routes.add_service(self.client_work().wrap(InterceptedService::new(api, guard(self, Service::Api))));
    }

    /// The worker gateway (on the control loop's runtime), and the join service of workers
    /// that have no certificate yet (client work).
    fn add_worker_services(&self, routes: &mut RoutesBuilder) {
        routes.add_service(InterceptedService::new(gateway::server(self.clone()), guard(self, Service::Gateway)));
        // The one service without a role check: a joining worker has no certificate yet. It
        // answers nothing but a valid, unused join token (see `join.rs`).
        routes.add_service(self.client_work().wrap(join::server(self.clone())));
    }

    /// Raft between the coordinators, and cluster admin (on the client runtime: its status
    /// digest and snapshots are client work).
    fn add_member_services(&self, routes: &mut RoutesBuilder) {
        let raft = self.raft_node().grpc_service();
        routes.add_service(InterceptedService::new(raft, guard(self, Service::Raft)));
        let admin = InterceptedService::new(cluster::server(self.clone()), guard(self, Service::ClusterAdmin));
        routes.add_service(self.client_work().wrap(admin));
    }
}
