//! The coordinator's config file (`corral coordinator --config FILE`): its schema, kebab-case
//! with unknown keys refused, durations parsed once into [`ConfigDuration`], validation whose
//! errors name the key, and opening the coordinator it describes ([`Coordinator::open`]).

use crate::{Coordinator, CoordinatorConfig, SecurityConfig};
use anyhow::{bail, Context};
use corral_raft::{RaftNode, RaftNodeConfig};
use corral_security::TlsFiles;
use corral_types::{describe_config_error, ArrayLimits, ConfigDuration, ConfigSize, MAX_ARRAY_TASKS, MAX_ARRAY_WINDOW};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
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
    /// Address to serve Prometheus metrics on (`GET /metrics`) and the web view (every other
    /// path); absent: no such listener.
    pub metrics_addr: Option<String>,
    #[serde(default)]
    pub raft: RaftSection,
    #[serde(default)]
    pub scheduler: SchedulerSection,
    /// Mutual TLS for every connection (Raft peers, workers, clients).
    pub tls: Option<TlsSection>,
    /// Serve plaintext on a non-loopback address (without [tls]): anyone who can reach the
    /// port is admin. Only for isolated networks. Also serves the web view's pages on a
    /// non-loopback `metrics-addr` without TLS or tokens (otherwise it serves `/metrics` only).
    #[serde(default)]
    pub insecure: bool,
    #[serde(default)]
    pub auth: AuthSection,
    #[serde(default)]
    pub history: HistorySection,
    #[serde(default)]
    pub limits: LimitsSection,
    #[serde(default)]
    pub images: ImagesSection,
    /// Nodes powered on for waiting work and off when idle (Slurm's power saving).
    #[serde(default)]
    pub autoscale: crate::autoscale::AutoscaleSection,
}

/// The `[images]` section: how the coordinator reaches registries to pin an image tag to its
/// digest at submit. The same keys as in a worker's `[images]` table; the other keys of that
/// table are the worker's only.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct ImagesSection {
    /// Registries (`host[:port]`; `host` for every port) reached over plain HTTP. Loopback
    /// registries always are.
    pub insecure_registries: Vec<String>,
    /// A Docker `config.json` whose `auths` hold registry credentials.
    pub auth_file: Option<PathBuf>,
    /// Per registry, mirrors (`host[:port]`) asked in order before it.
    pub mirrors: std::collections::BTreeMap<String, Vec<String>>,
    /// The whole of resolving one tag (default 10s): a submit naming a tag waits at most this
    /// long for its registry.
    pub resolve_timeout: Option<ConfigDuration>,
}

impl ImagesSection {
    /// The registry client's settings (reads `auth-file`); errors name the key.
    pub fn registry_config(&self) -> Result<corral_image::RegistryConfig, String> {
        let defaults = corral_image::ImagesSection::default();
        corral_image::ImagesSection {
            insecure_registries: self.insecure_registries.clone(),
            auth_file: self.auth_file.clone(),
            mirrors: self.mirrors.clone(),
            resolve_timeout: self.resolve_timeout.unwrap_or(defaults.resolve_timeout),
            // A submit waits for one answer: no retries.
            download_attempts: 1,
            ..defaults
        }
        .registry_config()
    }
}

/// The `[limits]` section: backpressure on clients, and what one submit may ask for.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct LimitsSection {
    /// Most jobs waiting on the leader to be proposed through Raft (single submits and
    /// batches); past it submits are refused with RESOURCE_EXHAUSTED and a retry-after, which
    /// corral's client honours (default 100000).
    pub max_queued_submits: usize,
    /// Most tasks of a job array unfinished at once: a larger `%N` is refused, an array without
    /// one gets this when it is less than 1024 (default 1024, at most `MAX_ARRAY_WINDOW`).
    pub max_array_window: u32,
    /// Most tasks of one job array (default and at most `MAX_ARRAY_TASKS`, 100000).
    pub max_array_size: u32,
    /// Most client requests (other than submits, which the submit queue admits) served at
    /// once; past it a request is refused with RESOURCE_EXHAUSTED and a retry-after (default
    /// 256).
    pub max_client_requests: usize,
    /// Most watches one principal (a token, an admin certificate; everyone, without auth)
    /// holds open at once: `WatchJobs` streams, `corral wait` and `corral logs -f`; one more is
    /// refused with RESOURCE_EXHAUSTED naming this key (default 64).
    pub max_watches_per_principal: usize,
}

impl Default for LimitsSection {
    fn default() -> Self {
        let arrays = ArrayLimits::default();
        LimitsSection {
            max_queued_submits: crate::group_commit::DEFAULT_MAX_QUEUED_SUBMITS,
            max_array_window: arrays.max_window,
            max_array_size: arrays.max_size,
            max_client_requests: crate::client_work::DEFAULT_MAX_CLIENT_REQUESTS,
            max_watches_per_principal: crate::watch::DEFAULT_MAX_WATCHES_PER_PRINCIPAL,
        }
    }
}

/// A retention: a duration with a unit, or "forever".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention(pub Option<ConfigDuration>);

impl<'de> Deserialize<'de> for Retention {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text.trim() == "forever" {
            return Ok(Retention(None));
        }
        text.parse::<ConfigDuration>()
            .map(|v| Retention(Some(v)))
            .map_err(|e| serde::de::Error::custom(format!("{e} (or \"forever\")")))
    }
}

/// The `[history]` section: what stays in memory and how long finished jobs and billing
/// segments are kept on disk. Every coordinator should have the same values: the leader's
/// apply.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct HistorySection {
    /// Finished jobs stay in memory this long, then move to the on-disk history, e.g. "10m".
    pub archive_after: ConfigDuration,
    /// A retried submit with the same request id within this window returns the first job.
    pub request_id_window: ConfigDuration,
    /// Finished jobs are deleted from the history this long after their submit ("forever").
    pub job_retention: Retention,
    /// Billing segments are deleted this long after they ended (default "forever").
    pub segment_retention: Retention,
    /// How often the leader compacts, e.g. "30s".
    pub compact_every: ConfigDuration,
    /// Finished jobs kept in memory weigh at most about this much, e.g. "128MiB": past it the
    /// oldest finished move to the history before `archive-after` ("0": none are kept).
    pub max_finished_bytes: ConfigSize,
}

impl Default for HistorySection {
    fn default() -> Self {
        let d = crate::HistoryConfig::default();
        let cd = |d: std::time::Duration| ConfigDuration::from_millis(d.as_millis() as u64);
        HistorySection {
            archive_after: cd(d.archive_after),
            request_id_window: cd(d.request_id_window),
            job_retention: Retention(d.job_retention.map(cd)),
            segment_retention: Retention(d.segment_retention.map(cd)),
            compact_every: cd(d.compact_every),
            max_finished_bytes: ConfigSize(
                d.max_finished_bytes.unwrap_or(crate::compaction::DEFAULT_MAX_FINISHED_BYTES),
            ),
        }
    }
}

impl HistorySection {
    /// The checked values.
    pub fn config(&self) -> Result<crate::HistoryConfig, String> {
        let compact_every = self.compact_every.get();
        if compact_every < std::time::Duration::from_millis(100) {
            return Err(format!("history.compact-every: {} is shorter than 100ms", self.compact_every));
        }
        if self.request_id_window.get() < std::time::Duration::from_secs(60) {
            return Err(format!(
                "history.request-id-window: {} is shorter than 1m: a client's retries must find their first submit",
                self.request_id_window
            ));
        }
        let config = crate::HistoryConfig {
            archive_after: self.archive_after.get(),
            request_id_window: self.request_id_window.get(),
            job_retention: self.job_retention.0.map(ConfigDuration::get),
            segment_retention: self.segment_retention.0.map(ConfigDuration::get),
            compact_every,
            max_finished_bytes: Some(self.max_finished_bytes.bytes()),
        };
        if config.job_retention.is_some_and(|r| r < config.archive_after) {
            return Err("history.job-retention: must be at least history.archive-after".into());
        }
        Ok(config)
    }
}

/// The `[tls]` section: the files every daemon has (`ca`, `cert`, `key`) and, on coordinators
/// that sign the certificates of workers joining with a token, the CA's key.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TlsSection {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Private key of the CA certificate `ca` (`ca-key.pem` of `corral certs init`): lets
    /// this coordinator sign worker certificates for `corral worker --join`. Give it to every
    /// coordinator (the leader signs). Absent: `corral node join-token` is refused.
    pub ca_key: Option<PathBuf>,
    /// How long the worker certificates it signs (joins, renewals) are valid (default 30 days,
    /// at least 10s, at most 10 years); a worker renews its own when two thirds of it have
    /// passed, so a short lifetime means frequent renewals (each a signature on the leader).
    pub worker_cert_lifetime: Option<ConfigDuration>,
}

/// The longest `tls.worker-cert-lifetime`: no certificate corral issues lives longer (its deny
/// list keeps a revocation that long, `corral_core::REVOCATION_RETENTION_S`).
const MAX_WORKER_CERT_LIFETIME: Duration = Duration::from_secs(corral_security::MAX_CERT_DAYS as u64 * 24 * 3600);

impl TlsSection {
    /// The files every daemon has.
    pub fn files(&self) -> TlsFiles {
        TlsFiles { ca: self.ca.clone(), cert: self.cert.clone(), key: self.key.clone() }
    }

    /// `worker-cert-lifetime`, or its default; the error names the key.
    pub fn worker_cert_lifetime(&self) -> Result<Duration, String> {
        let lifetime = self.worker_cert_lifetime.map_or(corral_security::DEFAULT_WORKER_CERT_LIFETIME, |d| d.get());
        if lifetime < Duration::from_secs(10) || lifetime > MAX_WORKER_CERT_LIFETIME {
            return Err(format!(
                "tls.worker-cert-lifetime: must be between 10s and {}d",
                MAX_WORKER_CERT_LIFETIME.as_secs() / 86_400
            ));
        }
        Ok(lifetime)
    }
}

impl From<TlsFiles> for TlsSection {
    fn from(files: TlsFiles) -> Self {
        TlsSection { ca: files.ca, cert: files.cert, key: files.key, ca_key: None, worker_cert_lifetime: None }
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

/// Raft timing and log compaction.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct RaftSection {
    /// Between the leader's heartbeats to its followers (default 50ms).
    heartbeat_interval: Option<ConfigDuration>,
    /// A follower that heard no leader for a random time between these two campaigns, if a
    /// majority grants it a pre-vote (default 250ms to 500ms). One that heard a leader within
    /// the minimum refuses pre-votes and votes.
    election_timeout_min: Option<ConfigDuration>,
    election_timeout_max: Option<ConfigDuration>,
    /// Build a snapshot every this many applied entries (the coordinators of a cluster take
    /// turns: each builds at its own third of the interval, by node id).
    pub snapshot_every: u64,
    /// Entries kept below a snapshot for lagging followers.
    pub keep_logs_after_snapshot: u64,
    /// Job changes kept in memory for `WatchJobs` clients that resume from a revision; an
    /// older revision is refused (the client lists again).
    pub watch_history: usize,
    /// Earlier spellings in integer milliseconds, read for one release with a warning.
    heartbeat_interval_ms: Option<u64>,
    election_timeout_min_ms: Option<u64>,
    election_timeout_max_ms: Option<u64>,
}

impl Default for RaftSection {
    fn default() -> Self {
        let d = RaftNodeConfig::new(0, PathBuf::new());
        RaftSection {
            heartbeat_interval: None,
            election_timeout_min: None,
            election_timeout_max: None,
            snapshot_every: d.snapshot_every,
            keep_logs_after_snapshot: d.keep_logs_after_snapshot,
            watch_history: d.watch_history,
            heartbeat_interval_ms: None,
            election_timeout_min_ms: None,
            election_timeout_max_ms: None,
        }
    }
}

impl RaftSection {
    pub fn heartbeat_interval(&self) -> ConfigDuration {
        let d = RaftNodeConfig::new(0, PathBuf::new());
        self.heartbeat_interval.unwrap_or(ConfigDuration::from_millis(d.heartbeat_interval_ms))
    }

    pub fn election_timeout_min(&self) -> ConfigDuration {
        let d = RaftNodeConfig::new(0, PathBuf::new());
        self.election_timeout_min.unwrap_or(ConfigDuration::from_millis(d.election_timeout_min_ms))
    }

    pub fn election_timeout_max(&self) -> ConfigDuration {
        let d = RaftNodeConfig::new(0, PathBuf::new());
        self.election_timeout_max.unwrap_or(ConfigDuration::from_millis(d.election_timeout_max_ms))
    }

    /// Moves the values of the old `*-ms` keys to the new ones; returns the old keys used (to
    /// warn about). Giving both spellings of one setting is an error.
    fn adopt_legacy_keys(&mut self) -> Result<Vec<&'static str>, String> {
        let mut used = Vec::new();
        for (old, new, value, legacy) in [
            (
                "raft.heartbeat-interval-ms",
                "raft.heartbeat-interval",
                &mut self.heartbeat_interval,
                self.heartbeat_interval_ms.take(),
            ),
            (
                "raft.election-timeout-min-ms",
                "raft.election-timeout-min",
                &mut self.election_timeout_min,
                self.election_timeout_min_ms.take(),
            ),
            (
                "raft.election-timeout-max-ms",
                "raft.election-timeout-max",
                &mut self.election_timeout_max,
                self.election_timeout_max_ms.take(),
            ),
        ] {
            let Some(ms) = legacy else { continue };
            if value.is_some() {
                return Err(format!("{old}: {new} is also set; keep only {new} (e.g. \"{ms}ms\")"));
            }
            *value = Some(ConfigDuration::from_millis(ms));
            used.push(old);
        }
        Ok(used)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct SchedulerSection {
    /// A worker silent for this long is marked down and its jobs requeued, e.g. "10s".
    pub node_ttl: ConfigDuration,
    /// A worker that no leader answered for this long stops its jobs (fencing), so that they
    /// are dead before the node TTL gives them to other nodes. Default: half the node TTL;
    /// at most three quarters of it.
    pub fence_after: Option<ConfigDuration>,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        SchedulerSection { node_ttl: ConfigDuration::from_secs(10), fence_after: None }
    }
}

impl SchedulerSection {
    /// (node TTL, fence time), checked.
    pub fn lease(&self) -> Result<(Duration, Duration), String> {
        let ttl = self.node_ttl.get();
        if ttl < Duration::from_millis(500) {
            return Err(format!("scheduler.node-ttl: {} is shorter than 500ms", self.node_ttl));
        }
        let fence = self.fence_after.map_or(ttl / 2, ConfigDuration::get);
        if fence.is_zero() || fence > ttl * 3 / 4 {
            return Err(format!(
                "scheduler.fence-after: must be greater than 0 and at most three quarters of scheduler.node-ttl ({}), so that a fenced worker's jobs are dead before the ttl gives them to other nodes",
                self.node_ttl
            ));
        }
        Ok((ttl, fence))
    }
}

impl CoordinatorFile {
    /// A config with every default: what a file with only these keys says.
    pub fn new(node_id: u64, listen: SocketAddr, data_dir: PathBuf) -> CoordinatorFile {
        CoordinatorFile {
            node_id,
            listen: listen.to_string(),
            advertise: None,
            data_dir,
            metrics_addr: None,
            raft: RaftSection::default(),
            scheduler: SchedulerSection::default(),
            tls: None,
            insecure: false,
            auth: AuthSection::default(),
            history: HistorySection::default(),
            limits: LimitsSection::default(),
            images: ImagesSection::default(),
            autoscale: Default::default(),
        }
    }

    /// Reads, parses and validates `path`; errors are one line naming the file and the key.
    /// Old `raft.*-ms` keys are read with a warning.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        let mut file: CoordinatorFile = toml::from_str(&text)
            .map_err(|e| anyhow::anyhow!(describe_config_error("config", path, &text, e.message(), e.span())))?;
        let legacy =
            file.raft.adopt_legacy_keys().map_err(|e| anyhow::anyhow!("invalid config {}: {e}", path.display()))?;
        for key in legacy {
            tracing::warn!(
                config = %path.display(),
                key,
                "deprecated key: write the duration with a unit under the name without -ms (e.g. heartbeat-interval = \"50ms\"); the old key goes away in the next release"
            );
        }
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
            m.parse::<SocketAddr>().map_err(|_| format!("metrics-addr: '{m}' is not IP:PORT"))?;
        }
        let r = &self.raft;
        if r.heartbeat_interval().get().is_zero() {
            return Err("raft.heartbeat-interval: must be greater than 0".into());
        }
        if r.election_timeout_min() <= r.heartbeat_interval() {
            return Err("raft.election-timeout-min: must be greater than raft.heartbeat-interval".into());
        }
        if r.election_timeout_max() <= r.election_timeout_min() {
            return Err("raft.election-timeout-max: must be greater than raft.election-timeout-min".into());
        }
        if r.snapshot_every == 0 {
            return Err("raft.snapshot-every: must be greater than 0".into());
        }
        if r.watch_history == 0 {
            return Err("raft.watch-history: must be greater than 0 (job changes kept for watch resumes)".into());
        }
        self.scheduler.lease()?;
        if self.limits.max_queued_submits == 0 {
            return Err("limits.max-queued-submits: must be greater than 0".into());
        }
        if self.limits.max_client_requests == 0 {
            return Err("limits.max-client-requests: must be greater than 0".into());
        }
        if !(1..=MAX_ARRAY_WINDOW).contains(&self.limits.max_array_window) {
            return Err(format!("limits.max-array-window: must be 1 to {MAX_ARRAY_WINDOW}"));
        }
        if !(1..=MAX_ARRAY_TASKS).contains(&self.limits.max_array_size) {
            return Err(format!("limits.max-array-size: must be 1 to {MAX_ARRAY_TASKS}"));
        }
        if self.limits.max_watches_per_principal == 0 {
            return Err("limits.max-watches-per-principal: must be greater than 0".into());
        }
        self.history.config()?;
        self.images.registry_config()?;
        self.autoscale.config()?;
        if let Some(tls) = &self.tls {
            tls.files().validate()?;
            if tls.ca_key.as_ref().is_some_and(|k| k.as_os_str().is_empty()) {
                return Err("tls.ca-key: must not be empty (leave it out to sign no worker certificates)".into());
            }
            tls.worker_cert_lifetime()?;
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

/// A daemon warns at start when its certificate expires within this.
pub(crate) const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 24 * 3600);

/// Refuses to open a data dir written by another node id.
pub(crate) fn claim_data_dir(dir: &Path, node_id: u64) -> anyhow::Result<()> {
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

impl Coordinator {
    /// Opens the coordinator a validated config file describes: claims its data dir, loads its
    /// TLS files, opens its Raft node. `bound` is the address its listener is bound to.
    pub async fn open(file: &CoordinatorFile, bound: SocketAddr) -> anyhow::Result<Coordinator> {
        claim_data_dir(&file.data_dir, file.node_id)?;
        let role = corral_security::Role::Coordinator;
        let (tls, cluster_ca) = match &file.tls {
            None => (None, None),
            Some(section @ TlsSection { ca_key: None, .. }) => (Some(section.files().load_for(role)?), None),
            Some(section @ TlsSection { ca_key: Some(ca_key), .. }) => {
                let lifetime = section.worker_cert_lifetime().map_err(anyhow::Error::msg)?;
                let ca = corral_security::ClusterCa::load(&section.ca, ca_key)?.with_worker_lifetime(lifetime);
                (Some(section.files().load_accepting_joins(role)?), Some(Arc::new(ca)))
            }
        };
        if let Some(warning) = file.tls.as_ref().and_then(|t| corral_security::expiry_warning(&t.cert, EXPIRY_WARNING))
        {
            tracing::warn!("tls.cert: {warning}");
        }
        let security = SecurityConfig {
            cluster_ca,
            server_tls: tls.as_ref().map(|(server, _)| server.clone()),
            client_tls: tls.as_ref().map(|(_, client)| client.clone()),
            require_tokens: file.auth.require_tokens,
            insecure: file.insecure,
            admin_token_sha256: file.auth.admin_token_sha256.clone(),
            audit: Arc::new(corral_security::AuditLog::in_dir(&file.data_dir)),
        };
        let raft_config = RaftNodeConfig {
            node_id: file.node_id,
            data_dir: file.data_dir.clone(),
            heartbeat_interval_ms: file.raft.heartbeat_interval().get().as_millis() as u64,
            election_timeout_min_ms: file.raft.election_timeout_min().get().as_millis() as u64,
            election_timeout_max_ms: file.raft.election_timeout_max().get().as_millis() as u64,
            snapshot_every: file.raft.snapshot_every,
            keep_logs_after_snapshot: file.raft.keep_logs_after_snapshot,
            watch_history: file.raft.watch_history,
            client_tls: tls.as_ref().map(|(_, client)| client.clone()),
        };
        let node =
            RaftNode::open(&raft_config).await.with_context(|| format!("cannot open {}", file.data_dir.display()))?;
        let (node_ttl, fence_after) = file.scheduler.lease().map_err(anyhow::Error::msg)?;
        let advertise_addr = file.advertise.clone().unwrap_or_else(|| bound.to_string());
        let history = file.history.config().map_err(anyhow::Error::msg)?;
        let registries = file.images.registry_config().map_err(anyhow::Error::msg)?;
        let autoscale = file.autoscale.config().map_err(anyhow::Error::msg)?;
        let config = CoordinatorConfig {
            autoscale,
            node_ttl,
            fence_after,
            advertise_addr,
            security,
            history,
            max_queued_submits: file.limits.max_queued_submits,
            max_client_requests: file.limits.max_client_requests,
            array_limits: ArrayLimits {
                max_window: file.limits.max_array_window,
                max_size: file.limits.max_array_size,
            },
            registries,
            max_watches_per_principal: file.limits.max_watches_per_principal,
            // No longer than Raft's own lease, the minimum election timeout (see `RaftNode`):
            // a deposed leader stops serving before another can be elected.
            leader_lease: CoordinatorConfig::default().leader_lease.min(file.raft.election_timeout_min().get()),
            ..Default::default()
        };
        Ok(Coordinator::new(node, config))
    }
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
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[scheduler]\nnode-ttl = \"10\"\n",
                "scheduler.node-ttl: '10' has no unit",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[raft]\nheartbeat-interval = \"50ms\"\nheartbeat-interval-ms = 40\n",
                "raft.heartbeat-interval-ms: raft.heartbeat-interval is also set",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[tls]\nca = \"ca.pem\"\ncert = \"c.pem\"\n",
                "missing field `key`",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[auth]\nadmin-token-sha256 = \"abc\"\n",
                "auth.admin-token-sha256",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[limits]\nmax-queued-submits = 0\n",
                "limits.max-queued-submits: must be greater than 0",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[limits]\nmax-array-window = 10001\n",
                "limits.max-array-window: must be 1 to 10000",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[limits]\nmax-array-size = 0\n",
                "limits.max-array-size: must be 1 to 100000",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[images]\ninsecure-registries = [\"http://r\"]\n",
                "images.insecure-registries: 'http://r' must be host[:port]",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[images]\nauth-file = \"/nonexistent/auth.json\"\n",
                "images.auth-file: ",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[limits]\nmax-watches-per-principal = 0\n",
                "limits.max-watches-per-principal: must be greater than 0",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[history]\njob-retention = \"soon\"\n",
                "history.job-retention",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[history]\nrequest-id-window = \"5s\"\n",
                "history.request-id-window: 5s is shorter than 1m",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[history]\narchive-after = \"1h\"\njob-retention = \"10m\"\n",
                "history.job-retention: must be at least history.archive-after",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[tls]\nca = \"a\"\ncert = \"c\"\nkey = \"k\"\nca-key = \"\"\n",
                "tls.ca-key: must not be empty",
            ),
            (
                "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[tls]\nca = \"a\"\ncert = \"c\"\nkey = \"k\"\nca_key = \"x\"\n",
                "unknown field `ca_key`",
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
    fn old_millisecond_raft_keys_still_work() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("c.toml");
        let base = "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"/x\"\n[raft]\n";
        std::fs::write(&path, format!("{base}heartbeat-interval-ms = 40\nelection-timeout-min-ms = 200\n"))
            .expect("write");
        let old = CoordinatorFile::load(&path).expect("old keys");
        std::fs::write(&path, format!("{base}heartbeat-interval = \"40ms\"\nelection-timeout-min = \"200ms\"\n"))
            .expect("write");
        let new = CoordinatorFile::load(&path).expect("new keys");
        assert_eq!(old.raft.heartbeat_interval(), ConfigDuration::from_millis(40));
        assert_eq!(old.raft.election_timeout_min(), ConfigDuration::from_millis(200));
        assert_eq!(
            (old.raft.heartbeat_interval(), old.raft.election_timeout_min(), old.raft.election_timeout_max()),
            (new.raft.heartbeat_interval(), new.raft.election_timeout_min(), new.raft.election_timeout_max())
        );
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
