//! Joining the cluster with a single-use token (`corral worker --join ADDR --token T`), and the
//! credentials a joined worker keeps in its data dir (`<data-dir>/tls/`: `key.pem`, made here
//! and never sent, `cert.pem` signed by the cluster CA, `ca.pem`).
//!
//! The worker talks to the coordinator at ADDR over TLS verified against the CA whose hash the
//! token carries (corral-security's pinned verifier), sends its certificate request, checks
//! that what comes back is a worker certificate for its node name from that CA, and stores it.
//! A later start without `--join` finds the credentials there when its config has no `[tls]`,
//! and renews the certificate before it expires (`renew.rs`).

use crate::config::WorkerFile;
use crate::renew::write_file;
use anyhow::{bail, Context};
use corral_client::{Client, ClientConfig};
use corral_security::{CaPin, JoinToken, TlsFiles};
use std::path::Path;
use std::time::Duration;

/// Where a joined worker keeps its credentials, under its data dir.
pub const CREDENTIALS_DIR: &str = "tls";

/// How to join: a coordinator's address and the token `corral node join-token` printed.
#[derive(Clone)]
pub struct JoinOptions {
    pub addr: String,
    pub token: String,
}

impl std::fmt::Debug for JoinOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinOptions").field("addr", &self.addr).finish_non_exhaustive()
    }
}

pub(crate) fn credential_files(data_dir: &Path) -> TlsFiles {
    let dir = data_dir.join(CREDENTIALS_DIR);
    TlsFiles { ca: dir.join("ca.pem"), cert: dir.join("cert.pem"), key: dir.join("key.pem") }
}

/// The credentials a join stored in `data_dir`, if any (the certificate is written last).
pub fn stored_credentials(data_dir: &Path) -> Option<TlsFiles> {
    let files = credential_files(data_dir);
    files.cert.exists().then_some(files)
}

/// Joins the cluster unless this data dir holds credentials already; returns the credentials.
/// `advertise_host` is the host the coordinators reach this worker's agent at: the
/// certificate is valid for it (and for the node name).
pub async fn join(file: &WorkerFile, advertise_host: &str, options: &JoinOptions) -> anyhow::Result<TlsFiles> {
    if file.tls.is_some() {
        bail!("--join: the worker config has a [tls] section with its own certificate; remove it to join with a token");
    }
    let token = JoinToken::parse(&options.token).map_err(anyhow::Error::msg)?;
    if let Some(files) = stored_credentials(&file.data_dir) {
        if CaPin::of_file(&files.ca)? != token.ca() {
            bail!(
                "--join: {} holds the credentials of another cluster (its CA is not the token's): remove that directory to join this cluster",
                file.data_dir.join(CREDENTIALS_DIR).display()
            );
        }
        tracing::info!(dir = %file.data_dir.join(CREDENTIALS_DIR).display(), "already joined: --join and --token are not needed any more");
        return Ok(files);
    }
    let node = file.node_name();
    let request = corral_security::worker_request(&node, advertise_host)?;
    let mut config = ClientConfig::new(vec![options.addr.clone()]);
    config.ca_pin = Some(token.ca());
    config.retry_for = Duration::from_secs(15);
    let client = Client::new(config).map_err(|e| anyhow::anyhow!("--join: {e}"))?;
    let reply = client.join_node(token.secret(), request.csr_der).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    corral_security::check_issued(&reply.certificate, &reply.ca, &node, token.ca())
        .map_err(|e| anyhow::anyhow!("--join: {e}"))?;
    let files = credential_files(&file.data_dir);
    let dir = file.data_dir.join(CREDENTIALS_DIR);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    write_file(&files.key, &request.key_pem, 0o600)?;
    write_file(&files.ca, &reply.ca, 0o644)?;
    // Last: its presence says the join completed.
    write_file(&files.cert, &reply.certificate, 0o644)?;
    tracing::info!(node = %node, dir = %dir.display(), "joined the cluster: credentials stored");
    Ok(files)
}
