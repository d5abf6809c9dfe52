//! `corral coordinator --config FILE`: a coordinator daemon (one Raft member) from TOML.

use crate::metrics_http::MetricsSource;
use anyhow::{bail, Context};
use corral_coordinator::{Coordinator, CoordinatorConfig};
use corral_raft::{RaftNode, RaftNodeConfig};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The coordinator's config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct CoordinatorFile {
    /// Raft node id: unique in the cluster, never reused.
    pub node_id: u64,
    /// Address to serve the API, the worker gateway and Raft on.
    pub listen: String,
    /// Address others reach this coordinator at (default: `listen`).
    pub advertise: Option<String>,
    /// Holds the Raft log, state machine and snapshots.
    pub data_dir: PathBuf,
    /// Address to serve Prometheus metrics on (`GET /metrics`); absent: no metrics listener.
    pub metrics_addr: Option<String>,
    #[serde(default)]
    pub raft: RaftSection,
    #[serde(default)]
    pub scheduler: SchedulerSection,
    /// Mutual TLS for every connection (Raft peers, workers, clients).
    pub tls: Option<TlsSection>,
    /// Serve plaintext on a non-loopback address (without [tls]): anyone who can reach the
    /// port is admin. Only for isolated networks.
    #[serde(default)]
    pub insecure: bool,
    #[serde(default)]
    pub auth: AuthSection,
}

/// PEM files of a coordinator or worker (`corral certs init` writes them).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TlsSection {
    /// The cluster CA: peers must present certificates it signed.
    pub ca: PathBuf,
    /// Our certificate (its role must match the daemon).
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsSection {
    pub fn files(&self) -> corral_security::TlsFiles {
        corral_security::TlsFiles { ca: self.ca.clone(), cert: self.cert.clone(), key: self.key.clone() }
    }

    pub fn validate(&self) -> Result<(), String> {
        for (key, path) in [("tls.ca", &self.ca), ("tls.cert", &self.cert), ("tls.key", &self.key)] {
            if path.as_os_str().is_empty() {
                return Err(format!("{key}: must not be empty"));
            }
        }
        Ok(())
    }

    /// Loads the files; our certificate must carry `role`.
    pub fn load(
        &self,
        role: corral_security::Role,
    ) -> anyhow::Result<(corral_security::ServerTls, tonic::transport::ClientTlsConfig)> {
        let files = self.files();
        let identity = corral_security::certificate_identity(&files.cert)?;
        if identity.role != role {
            bail!(
                "tls.cert: {} is a {} certificate; this daemon needs a {role} certificate",
                files.cert.display(),
                identity.role
            );
        }
        Ok((corral_security::ServerTls::load(&files)?, corral_security::client_tls_config(&files)?))
    }
}

/// Who may use the user API.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct AuthSection {
    /// Require a token on the user API even without TLS (TLS always requires one, unless the
    /// client holds an admin certificate).
    pub require_tokens: bool,
    /// Hex SHA-256 of a bootstrap admin token (`printf %s "$SECRET" | sha256sum`).
    pub admin_token_sha256: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct RaftSection {
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot after this many applied entries.
    pub snapshot_every: u64,
    /// Entries kept below a snapshot for lagging followers.
    pub keep_logs_after_snapshot: u64,
}

impl Default for RaftSection {
    fn default() -> Self {
        let d = RaftNodeConfig::new(0, PathBuf::new());
        RaftSection {
            heartbeat_interval_ms: d.heartbeat_interval_ms,
            election_timeout_min_ms: d.election_timeout_min_ms,
            election_timeout_max_ms: d.election_timeout_max_ms,
            snapshot_every: d.snapshot_every,
            keep_logs_after_snapshot: d.keep_logs_after_snapshot,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct SchedulerSection {
    /// A worker silent for this long is marked down and its jobs requeued, e.g. "10s".
    pub node_ttl: String,
    /// A worker that no leader answered for this long stops its jobs (fencing), so that they
    /// are dead before the node TTL gives them to other nodes. Default: half the node TTL;
    /// at most three quarters of it.
    pub fence_after: Option<String>,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        SchedulerSection { node_ttl: "10s".into(), fence_after: None }
    }
}

impl SchedulerSection {
    /// (node TTL, fence time), checked.
    pub fn lease(&self) -> Result<(Duration, Duration), String> {
        let ttl = corral_types::parse_duration(&self.node_ttl).map_err(|e| format!("scheduler.node-ttl: {e}"))?;
        if ttl < Duration::from_millis(500) {
            return Err(format!("scheduler.node-ttl: {} is shorter than 500ms", self.node_ttl));
        }
        let fence = match &self.fence_after {
            Some(f) => corral_types::parse_duration(f).map_err(|e| format!("scheduler.fence-after: {e}"))?,
            None => ttl / 2,
        };
        if fence.is_zero() || fence > ttl * 3 / 4 {
            return Err(format!(
                "scheduler.fence-after: must be greater than 0 and at most three quarters of scheduler.node-ttl ({}), so that a fenced worker's jobs are dead before the ttl gives them to other nodes",
                self.node_ttl
            ));
        }
        Ok((ttl, fence))
    }
}

/// Turns a toml error into one line naming the key and line.
pub fn toml_error(path: &Path, text: &str, e: &toml::de::Error) -> anyhow::Error {
    let line = e.span().map(|s| text[..s.start.min(text.len())].lines().count().max(1));
    let message = e.message().trim().replace('\n', " ");
    match line {
        Some(line) => anyhow::anyhow!("invalid config {} (line {line}): {message}", path.display()),
        None => anyhow::anyhow!("invalid config {}: {message}", path.display()),
    }
}

impl CoordinatorFile {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        let file: CoordinatorFile = toml::from_str(&text).map_err(|e| toml_error(path, &text, &e))?;
        file.validate().map_err(|e| anyhow::anyhow!("invalid config {}: {e}", path.display()))?;
        Ok(file)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.node_id == 0 {
            return Err("node-id: must be greater than 0".into());
        }
        self.listen.parse::<SocketAddr>().map_err(|_| format!("listen: '{}' is not IP:PORT", self.listen))?;
        if let Some(a) = &self.advertise {
            let ok = a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(format!("advertise: '{a}' is not host:port"));
            }
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err("data-dir: must not be empty".into());
        }
        if let Some(m) = &self.metrics_addr {
            crate::metrics_http::parse_addr("metrics-addr", m)?;
        }
        let r = &self.raft;
        if r.heartbeat_interval_ms == 0 || r.election_timeout_min_ms <= r.heartbeat_interval_ms {
            return Err("raft.election-timeout-min-ms: must be greater than raft.heartbeat-interval-ms".into());
        }
        if r.election_timeout_max_ms <= r.election_timeout_min_ms {
            return Err("raft.election-timeout-max-ms: must be greater than raft.election-timeout-min-ms".into());
        }
        if r.snapshot_every == 0 {
            return Err("raft.snapshot-every: must be greater than 0".into());
        }
        self.scheduler.lease()?;
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        let listen: SocketAddr =
            self.listen.parse().map_err(|_| format!("listen: '{}' is not IP:PORT", self.listen))?;
        if self.tls.is_none() && !self.insecure && !listen.ip().is_loopback() {
            return Err(format!(
                "listen: {listen} is not a loopback address: configure [tls] (see `corral certs init`), or set insecure = true to serve plaintext"
            ));
        }
        if let Some(hash) = &self.auth.admin_token_sha256 {
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                return Err("auth.admin-token-sha256: must be 64 lower-case hex digits (sha256sum of the token)".into());
            }
        }
        Ok(())
    }
}

/// Refuses to open a data dir written by another node id.
fn claim_data_dir(dir: &Path, node_id: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create data dir {}", dir.display()))?;
    let marker = dir.join("node-id");
    match std::fs::read_to_string(&marker) {
        Ok(text) => {
            let owner: u64 = text.trim().parse().with_context(|| format!("corrupt {}", marker.display()))?;
            if owner != node_id {
                bail!("data dir {} belongs to coordinator {owner}, not {node_id}: use another data-dir", dir.display());
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::write(&marker, format!("{node_id}\n"))?;
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

pub async fn run(config_path: &Path) -> anyhow::Result<()> {
    crate::dev::init_tracing();
    let file = CoordinatorFile::load(config_path)?;
    claim_data_dir(&file.data_dir, file.node_id)?;
    let tls = file.tls.as_ref().map(|t| t.load(corral_security::Role::Coordinator)).transpose()?;
    let security = corral_coordinator::SecurityConfig {
        server_tls: tls.as_ref().map(|(server, _)| server.clone()),
        client_tls: tls.as_ref().map(|(_, client)| client.clone()),
        require_tokens: file.auth.require_tokens,
        admin_token_sha256: file.auth.admin_token_sha256.clone(),
        audit: std::sync::Arc::new(corral_security::AuditLog::in_dir(&file.data_dir)),
    };
    let listen: SocketAddr = file.listen.parse()?;
    let listener = crate::listen::bind(listen, "for clients and peers").await?;
    let bound = listener.local_addr()?;
    let advertise = file.advertise.clone().unwrap_or_else(|| bound.to_string());

    let raft_config = RaftNodeConfig {
        node_id: file.node_id,
        data_dir: file.data_dir.clone(),
        heartbeat_interval_ms: file.raft.heartbeat_interval_ms,
        election_timeout_min_ms: file.raft.election_timeout_min_ms,
        election_timeout_max_ms: file.raft.election_timeout_max_ms,
        snapshot_every: file.raft.snapshot_every,
        keep_logs_after_snapshot: file.raft.keep_logs_after_snapshot,
        client_tls: tls.as_ref().map(|(_, client)| client.clone()),
    };
    let node =
        RaftNode::open(&raft_config).await.with_context(|| format!("cannot open {}", file.data_dir.display()))?;
    let (node_ttl, fence_after) = file.scheduler.lease().map_err(anyhow::Error::msg)?;
    let config =
        CoordinatorConfig { node_ttl, fence_after, advertise_addr: advertise.clone(), security, ..Default::default() };
    let coordinator = Coordinator::new(node.clone(), config);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    if let Some(m) = &file.metrics_addr {
        let addr = crate::metrics_http::parse_addr("metrics-addr", m).map_err(anyhow::Error::msg)?;
        let sources = vec![MetricsSource::Coordinator(coordinator.clone())];
        let bound = crate::metrics_http::start(addr, sources, stopped(stop_rx.clone())).await?;
        println!("corral coordinator {} serving metrics at http://{bound}/metrics", file.node_id);
    }
    let server = tokio::spawn(coordinator.serve(listener, stopped(stop_rx)));
    println!("corral coordinator {} listening on {bound} (advertised as {advertise})", file.node_id);
    crate::dev::termination().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    if let Err(e) = tokio::time::timeout(Duration::from_secs(10), node.shutdown()).await {
        tracing::warn!(error = %e, "raft shutdown timed out");
    }
    server.await??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_coordinator_config_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cluster-configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("cluster-configs/") {
            let path = entry.expect("entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            if name.starts_with("coordinator") && name.ends_with(".toml") {
                CoordinatorFile::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
                seen += 1;
            }
        }
        assert!(seen >= 3, "expected the 3-node example configs, found {seen}");
    }

    #[test]
    fn bad_configs_name_the_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases = [
            ("node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\nbogus = 1\n", "unknown field `bogus`"),
            ("listen = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n", "missing field `node-id`"),
            ("node-id = 0\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n", "node-id: must be greater than 0"),
            ("node-id = 1\nlisten = \"nowhere\"\ndata-dir = \"/x\"\n", "listen: 'nowhere' is not IP:PORT"),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\nmetrics-addr = \"localhost\"\n",
                "metrics-addr: 'localhost' is not IP:PORT",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[scheduler]\nnode-ttl = \"soon\"\n",
                "scheduler.node-ttl",
            ),
            ("node-id = 1\nlisten = \"0.0.0.0:1\"\ndata-dir = \"/x\"\n", "listen: 0.0.0.0:1 is not a loopback address"),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[tls]\nca = \"ca.pem\"\ncert = \"c.pem\"\n",
                "missing field `key`",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[auth]\nadmin-token-sha256 = \"abc\"\n",
                "auth.admin-token-sha256",
            ),
        ];
        for (text, expected) in cases {
            let path = dir.path().join("c.toml");
            std::fs::write(&path, text).expect("write");
            let err = CoordinatorFile::load(&path).expect_err(text).to_string();
            assert!(err.contains(expected), "{err} should mention {expected}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn data_dir_of_another_node_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        claim_data_dir(dir.path(), 1).expect("claim");
        claim_data_dir(dir.path(), 1).expect("same node again");
        let err = claim_data_dir(dir.path(), 2).expect_err("other node").to_string();
        assert!(err.contains("belongs to coordinator 1"), "{err}");
    }
}
