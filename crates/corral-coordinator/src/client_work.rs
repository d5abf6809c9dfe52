//! Client work runs apart from the control loop: on its own runtime, at a lower CPU priority,
//! admitted a bounded number at a time.
//!
//! A coordinator's control loop — the Raft core and its RPCs, the worker gateway with its
//! heartbeats, desired-state streams and leases, the leader's loops — runs on the runtime the
//! daemon was started on. Everything a client asks for (the user API, cluster admin, joins,
//! the web view) is executed on the client runtime instead: [`OnClientRuntime`] wraps a
//! service so that its handler, and the production of its response body (encoding a listing
//! page, following a watch), run there, while the connection itself is served where it was
//! accepted. So a burst of listings, a `show` of a large array or slow `WatchJobs` readers
//! queue behind each other, never in front of a vote or a heartbeat: the issue was a `show`
//! whose work kept the one runtime busy until every worker's lease lapsed.
//!
//! The client runtime's threads run at nice [`CLIENT_NICE`], as snapshot builds do, so that on
//! a small machine the control loop wins the CPU too, not only the queues. Admission:
//! at most `limits.max-client-requests` handlers at once (submits excepted: the submit queue
//! admits them, `group_commit.rs`); past it a request is refused with RESOURCE_EXHAUSTED and a
//! retry-after, before its body is read.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{mpsc, Semaphore};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::codegen::Bytes;
use tonic::server::NamedService;

use crate::CoordError;

/// The CPU priority of the client runtime's threads (snapshot builds use the same).
pub(crate) const CLIENT_NICE: i32 = 10;

/// Default of `limits.max-client-requests`.
pub const DEFAULT_MAX_CLIENT_REQUESTS: usize = 256;

/// What a refused request is told to wait before it tries again.
const BUSY_RETRY_AFTER: Duration = Duration::from_millis(100);

/// Methods admitted by the submit queue rather than by the count of client requests.
const SUBMITS: [&str; 2] = ["/corral.v1.Corral/Submit", "/corral.v1.Corral/SubmitBatch"];

/// Frames of a response body in flight between the client runtime and the connection.
const BODY_FRAMES_IN_FLIGHT: usize = 2;

/// The client runtime and its admission. Dropping the last handle shuts the runtime down in
/// the background (its tasks are cancelled).
pub(crate) struct ClientWork {
    runtime: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    admission: Arc<Semaphore>,
    capacity: usize,
}

impl ClientWork {
    /// A runtime of `threads` worker threads (nice [`CLIENT_NICE`]) admitting at most
    /// `max_requests` client handlers at once.
    pub(crate) fn new(threads: usize, max_requests: usize) -> std::io::Result<ClientWork> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("corral-client")
            .enable_all()
            .on_thread_start(lower_priority)
            .build()?;
        let handle = runtime.handle().clone();
        Ok(ClientWork {
            runtime: Some(runtime),
            handle,
            admission: Arc::new(Semaphore::new(max_requests)),
            capacity: max_requests,
        })
    }

    /// Runs `work` on the client runtime and waits for it; dropping the returned future
    /// cancels it there.
    pub(crate) async fn run<T: Send + 'static>(&self, work: impl Future<Output = T> + Send + 'static) -> Option<T> {
        AbortOnDrop(self.handle.spawn(work)).await
    }

    /// Wraps `service` so that its requests are admitted and served on the client runtime.
    pub(crate) fn wrap<S>(self: &Arc<Self>, service: S) -> OnClientRuntime<S> {
        OnClientRuntime { inner: service, work: self.clone() }
    }
}

impl Drop for ClientWork {
    fn drop(&mut self) {
        // Dropping a runtime blocks until its threads end, which is refused inside another
        // runtime; its tasks are only client requests, so they are abandoned instead.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Lowers the calling thread's CPU priority to [`CLIENT_NICE`].
fn lower_priority() {
    // SAFETY: gettid and setpriority on the calling thread (on Linux a thread id is a
    // PRIO_PROCESS target) with plain integer arguments; a failure only leaves the priority.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, CLIENT_NICE);
    }
}

/// A task of the client runtime, cancelled when its waiter goes away (a client that hung up
/// cancels its handler, as it would on the connection's own runtime).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Option<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        Pin::new(&mut self.0).poll(cx).map(Result::ok)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A service whose requests are admitted by [`ClientWork`] and served on its runtime.
#[derive(Clone)]
pub(crate) struct OnClientRuntime<S> {
    inner: S,
    work: Arc<ClientWork>,
}

impl<S: NamedService> NamedService for OnClientRuntime<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tonic::codegen::Service<http::Request<Body>> for OnClientRuntime<S>
where
    S: tonic::codegen::Service<http::Request<Body>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let permit = if SUBMITS.contains(&request.uri().path()) {
            None
        } else {
            match self.work.admission.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    let busy = CoordError::Busy { capacity: self.work.capacity, retry_after: BUSY_RETRY_AFTER };
                    let status: tonic::Status = busy.into();
                    return Box::pin(async move { Ok(status.into_http()) });
                }
            }
        };
        // The clone that was made ready serves this request (tower's rule); a fresh clone
        // waits for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let work = self.work.clone();
        Box::pin(async move {
            let served = work.run(async move {
                let Ok(response) = inner.call(request).await;
                drop(permit);
                // The body is produced here too: encoding a page, following a watch.
                let (parts, body) = response.into_parts();
                http::Response::from_parts(parts, forward(body))
            });
            Ok(served
                .await
                .unwrap_or_else(|| tonic::Status::unavailable("the coordinator is shutting down").into_http()))
        })
    }
}

/// A body whose frames are produced by a task of the current runtime (the client runtime)
/// and handed over one at a time; it stops when the receiver goes away.
fn forward<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    // An empty body (a refusal: the status is in the headers, "trailers-only") stays one the
    // connection can see is empty, so the HEADERS frame ends the stream. Forwarded, it would end
    // with an empty DATA frame instead, which gRPC clients other than tonic refuse.
    if body.is_end_stream() {
        return Body::empty();
    }
    let (tx, rx) = mpsc::channel(BODY_FRAMES_IN_FLIGHT);
    tokio::spawn(async move {
        let mut body = std::pin::pin!(body);
        loop {
            let frame = tokio::select! {
                frame = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)) => frame,
                _ = tx.closed() => return,
            };
            let Some(frame) = frame else { return };
            let frame = frame.map_err(|e| tonic::Status::from_error(e.into()));
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    Body::new(Forwarded { rx })
}

/// The receiving end of [`forward`].
struct Forwarded {
    rx: mpsc::Receiver<Result<http_body::Frame<Bytes>, tonic::Status>>,
}

impl http_body::Body for Forwarded {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.rx.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tonic::codegen::Service;

    /// Stands for a client service: notes the thread each request is handled on, and answers
    /// once `release` is notified.
    #[derive(Clone)]
    struct Held {
        threads: Arc<Mutex<Vec<String>>>,
        release: Arc<tokio::sync::Notify>,
    }

    impl Service<http::Request<Body>> for Held {
        type Response = http::Response<Body>;
        type Error = Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            let held = self.clone();
            Box::pin(async move {
                // Waiting starts before the test can see this handler: a `notify_waiters`
                // reaches a `Notified` from its creation, and only from it.
                let released = held.release.notified();
                let name = std::thread::current().name().unwrap_or_default().to_string();
                held.threads.lock().expect("threads").push(name);
                released.await;
                Ok(http::Response::new(Body::new("page".to_string())))
            })
        }
    }

    fn request(path: &str) -> http::Request<Body> {
        http::Request::builder().uri(format!("http://node{path}")).body(Body::default()).expect("request")
    }

    #[tokio::test]
    async fn client_requests_run_on_the_client_runtime_a_bounded_number_at_a_time() {
        let work = Arc::new(ClientWork::new(1, 1).expect("runtime"));
        let held = Held { threads: Arc::default(), release: Arc::default() };
        let mut service = work.wrap(held.clone());

        let first = tokio::spawn(service.call(request("/corral.v1.Corral/ListJobs")));
        while held.threads.lock().expect("threads").is_empty() {
            tokio::task::yield_now().await;
        }
        // The one admission is taken: a second read is refused at once, with a retry-after.
        let refused = service.call(request("/corral.v1.Corral/GetJob")).await.expect("infallible");
        let status = tonic::Status::from_header_map(refused.headers()).expect("a grpc status");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.metadata().get(corral_proto::RETRY_AFTER_METADATA).is_some(), "{status:?}");
        // A submit is admitted by the submit queue, not here.
        let submit = tokio::spawn(service.call(request("/corral.v1.Corral/Submit")));
        while held.threads.lock().expect("threads").len() < 2 {
            tokio::task::yield_now().await;
        }

        held.release.notify_waiters();
        let response = first.await.expect("join").expect("infallible");
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx)).await {
            bytes.extend_from_slice(frame.expect("frame").data_ref().expect("data"));
        }
        assert_eq!(bytes, b"page", "the body produced on the client runtime arrives whole");
        submit.await.expect("join").expect("infallible");
        for name in held.threads.lock().expect("threads").iter() {
            assert_eq!(name, "corral-client", "a client handler ran off the client runtime");
        }
        // The admission came back: the next read is served.
        let next = tokio::spawn(service.call(request("/corral.v1.Corral/GetJob")));
        while held.threads.lock().expect("threads").len() < 3 {
            tokio::task::yield_now().await;
        }
        held.release.notify_waiters();
        next.await.expect("join").expect("infallible");
    }

    #[tokio::test]
    async fn a_caller_that_goes_away_cancels_its_handler() {
        let work = Arc::new(ClientWork::new(1, 1).expect("runtime"));
        let held = Held { threads: Arc::default(), release: Arc::default() };
        let mut service = work.wrap(held.clone());
        let call = tokio::spawn(service.call(request("/corral.v1.Corral/ListJobs")));
        while held.threads.lock().expect("threads").is_empty() {
            tokio::task::yield_now().await;
        }
        call.abort();
        let _ = call.await;
        // The handler was cancelled and gave its admission back.
        tokio::time::timeout(Duration::from_secs(10), async {
            while work.admission.available_permits() == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the admission of a cancelled handler came back");
    }
}
