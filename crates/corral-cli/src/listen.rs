//! Binding the daemons' TCP listeners, with a short wait for an address that a process which
//! just stopped on this host still holds.

use anyhow::Context;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// How long a bind waits for an address in use to come free.
const PATIENCE: Duration = Duration::from_secs(10);

/// Binds `addr`. An address in use is retried for a few seconds: a daemon restarted right after
/// a crash can find its port still held by a child the old process was forking (it shares the
/// old process's sockets until it execs). `what` names the listener in the error.
pub async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    bind_within(addr, what, PATIENCE).await
}

async fn bind_within(addr: SocketAddr, what: &str, patience: Duration) -> anyhow::Result<TcpListener> {
    let deadline = Instant::now() + patience;
    let mut told = false;
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                if !told {
                    told = true;
                    tracing::warn!(%addr, "{what}: address in use; waiting up to {patience:?} for it to come free");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(e).with_context(|| {
                    format!(
                        "cannot listen {what} on {addr}: another process keeps it (is another corral daemon running?)"
                    )
                })
            }
            Err(e) => return Err(e).with_context(|| format!("cannot listen {what} on {addr}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_address_freed_while_waiting_is_bound() {
        let held = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = held.local_addr().expect("addr");
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(held);
        });
        let listener = bind_within(addr, "for tests", Duration::from_secs(10)).await.expect("bound once free");
        assert_eq!(listener.local_addr().expect("addr"), addr);
        release.await.expect("release");
    }

    #[tokio::test]
    async fn an_address_kept_in_use_is_named_in_the_error() {
        let held = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = held.local_addr().expect("addr");
        let err = bind_within(addr, "for tests", Duration::from_millis(150)).await.expect_err("still held");
        let message = format!("{err:#}");
        assert!(message.contains(&format!("cannot listen for tests on {addr}: another process keeps it")), "{message}");
    }
}
