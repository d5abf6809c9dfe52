//! Writes that only a leader can take are refused by a follower before their body is read.
//!
//! Around a failover every client retries its submits against the survivors, and a batch of a
//! few thousand jobs costs its receiver a fair share of a core to decode — only to be refused
//! because no leader is known yet. That CPU is what the survivors need for their election.
//! This layer answers `Submit` and `SubmitBatch` on a node that does not lead with the same
//! "not the leader" error the handlers give (leader hint included), without decoding them. It
//! sits inside the role check, so a caller is still authenticated first.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;

use crate::Coordinator;

/// Methods refused early by a node that does not lead.
const LEADER_WRITES: [&str; 2] = ["/corral.v1.Corral/Submit", "/corral.v1.Corral/SubmitBatch"];

/// Wraps the user API service.
#[derive(Clone)]
pub(crate) struct LeaderWrites<S> {
    inner: S,
    coord: Coordinator,
}

impl<S> LeaderWrites<S> {
    pub(crate) fn new(inner: S, coord: Coordinator) -> Self {
        LeaderWrites { inner, coord }
    }
}

impl<S: NamedService> NamedService for LeaderWrites<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<http::Request<Body>> for LeaderWrites<S>
where
    S: tonic::codegen::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if LEADER_WRITES.contains(&request.uri().path()) && !self.coord.is_leader() {
            let status: tonic::Status = self.coord.not_leader().into();
            return Box::pin(async move { Ok(status.into_http()) });
        }
        Box::pin(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CoordinatorConfig;
    use corral_raft::{RaftNode, RaftNodeConfig};
    use tonic::codegen::Service;

    /// Stands for the API: counts the requests that reach it.
    #[derive(Clone, Default)]
    struct Counting(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Service<http::Request<Body>> for Counting {
        type Response = http::Response<Body>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::ready(Ok(http::Response::new(Body::default())))
        }
    }

    fn request(path: &str) -> http::Request<Body> {
        http::Request::builder().uri(format!("http://node{path}")).body(Body::default()).expect("request")
    }

    #[tokio::test]
    async fn a_node_that_does_not_lead_refuses_submits_unread_and_passes_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Never initialized: no leader.
        let node = RaftNode::open(&RaftNodeConfig::new(1, dir.path().to_path_buf())).await.expect("raft");
        let api = Counting::default();
        let mut layer = LeaderWrites::new(api.clone(), Coordinator::new(node.clone(), CoordinatorConfig::default()));
        for path in LEADER_WRITES {
            let response = layer.call(request(path)).await.expect("infallible");
            let status = tonic::Status::from_header_map(response.headers()).expect("a grpc status");
            assert_eq!(status.code(), tonic::Code::Unavailable, "{path}");
            assert!(status.message().contains("not the leader"), "{}", status.message());
        }
        assert_eq!(api.0.load(std::sync::atomic::Ordering::SeqCst), 0, "a refused write reached the API");
        // Reads still reach the API (a follower serves or redirects them itself).
        layer.call(request("/corral.v1.Corral/ListJobs")).await.expect("infallible");
        assert_eq!(api.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        let _ = node.shutdown().await;
    }
}
