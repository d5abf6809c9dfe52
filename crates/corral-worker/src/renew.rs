//! Renewing the certificate a worker got by joining (`<data-dir>/tls/`) before it expires:
//! once two thirds of its lifetime have passed, the worker asks the coordinators for a new one
//! (`NodeJoin.Renew`) over a connection made with the current certificate, no token needed,
//! with a certificate request for its node name and advertised address signed by the key it
//! holds. The new certificate replaces `cert.pem` atomically (the key file is never rewritten,
//! so the pair always belongs together) and is used for every new connection, the agent's
//! included; connections already open keep theirs. A failed attempt is retried, sooner as the
//! expiry nears.
//!
//! Certificates from the config's `[tls]` section are the operator's (`corral certs renew`):
//! the worker only warns when they expire soon.

use anyhow::Context;
use corral_client::Client;
use corral_security::{CaPin, ClientTls, TlsFiles};
use std::path::Path;
use std::time::{Duration, SystemTime};

/// What the renewal needs: the stored credentials, the worker's name and address, its client
/// (which presents the certificate) and the TLS to reload once a new certificate is stored.
#[derive(Clone)]
pub struct CertRenewal {
    pub files: TlsFiles,
    pub node: String,
    /// The host the coordinators reach the agent at (the certificate's second name).
    pub address: String,
    pub client: Client,
    pub tls: ClientTls,
}

impl std::fmt::Debug for CertRenewal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertRenewal").field("cert", &self.files.cert).field("node", &self.node).finish_non_exhaustive()
    }
}

/// The shortest wait between two failed attempts, and the longest wait of any kind (a clock
/// that jumps is noticed within it).
const MIN_RETRY: Duration = Duration::from_secs(5);
const MAX_WAIT: Duration = Duration::from_secs(3600);

fn now_s() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// When a certificate issued at `issued_s` and valid until `not_after_s` is due for renewal:
/// two thirds into its lifetime.
pub(crate) fn renewal_due_s(issued_s: u64, not_after_s: u64) -> u64 {
    issued_s + not_after_s.saturating_sub(issued_s) * 2 / 3
}

/// How long to wait after a failed attempt at `now_s`: a tenth of the time left (a worker
/// that keeps failing tries about ten times more before its certificate expires, more and
/// more often), between `MIN_RETRY` and `MAX_WAIT`.
pub(crate) fn retry_after(now_s: u64, not_after_s: u64) -> Duration {
    Duration::from_secs(not_after_s.saturating_sub(now_s) / 10).clamp(MIN_RETRY, MAX_WAIT)
}

/// Renews the certificate whenever it is due, for ever (the worker aborts the task when it stops).
pub async fn run(renewal: CertRenewal) {
    loop {
        let identity = match corral_security::certificate_identity(&renewal.files.cert) {
            Ok(identity) => identity,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the worker certificate to renew it");
                tokio::time::sleep(MAX_WAIT).await;
                continue;
            }
        };
        let now = now_s();
        let due = renewal_due_s(identity.issued_at_s(), identity.not_after_s);
        if now < due {
            tokio::time::sleep(Duration::from_secs(due - now).min(MAX_WAIT)).await;
            continue;
        }
        match renew(&renewal).await {
            Ok(not_after_s) if not_after_s > identity.not_after_s => {
                tracing::info!(node = %renewal.node, not_after_s, "renewed the worker certificate");
            }
            Ok(not_after_s) => {
                // Not valid any longer than the last one (the CA itself expires then): asking
                // again at once would not help.
                let wait = retry_after(now, not_after_s);
                tracing::warn!(node = %renewal.node, not_after_s, retry_in_s = wait.as_secs(), "the renewed worker certificate is valid no longer than the last one: the cluster CA expires then");
                tokio::time::sleep(wait).await;
            }
            Err(e) if identity.not_after_s <= now => {
                tracing::error!(error = %e, node = %renewal.node, "the worker certificate expired and cannot be renewed: join again with a new token (remove {} first)", renewal.files.cert.display());
                tokio::time::sleep(MAX_WAIT).await;
            }
            Err(e) => {
                let wait = retry_after(now, identity.not_after_s);
                tracing::warn!(error = %e, node = %renewal.node, retry_in_s = wait.as_secs(), "cannot renew the worker certificate yet");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// One renewal: asks, checks, stores, reloads. Returns the new certificate's expiry.
async fn renew(renewal: &CertRenewal) -> anyhow::Result<u64> {
    let files = &renewal.files;
    let key_pem =
        std::fs::read_to_string(&files.key).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", files.key.display()))?;
    let csr = corral_security::renewal_request(&renewal.node, &renewal.address, &key_pem)?;
    let reply = renewal.client.renew_certificate(csr).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let pin = CaPin::of_file(&files.ca)?;
    corral_security::check_renewed(&reply.certificate, &key_pem, &reply.ca, &renewal.node, pin)
        .map_err(anyhow::Error::msg)?;
    write_file(&files.cert, &reply.certificate, 0o644)?;
    renewal.tls.reload()?;
    Ok(corral_security::certificate_identity(&files.cert)?.not_after_s)
}

/// Writes `text` to `path` with `mode`, through a synced temporary file renamed over it (the
/// directory synced after), so a crash leaves the old file or the new one.
pub(crate) fn write_file(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
    let mut f = options.open(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("cannot sync {}", dir.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_is_renewed_two_thirds_into_its_life_and_retried_more_often_near_its_end() {
        let day = 24 * 3600;
        assert_eq!(renewal_due_s(1_000, 1_000 + 30 * day), 1_000 + 20 * day);
        assert_eq!(renewal_due_s(1_000, 1_030), 1_020);
        assert_eq!(renewal_due_s(1_000, 900), 1_000, "a certificate expired at issue is due at once");
        assert_eq!(retry_after(0, 10 * day), MAX_WAIT);
        assert_eq!(retry_after(0, 1_000), Duration::from_secs(100));
        assert_eq!(retry_after(0, 10), MIN_RETRY);
        assert_eq!(retry_after(100, 10), MIN_RETRY, "expired");
    }
}
