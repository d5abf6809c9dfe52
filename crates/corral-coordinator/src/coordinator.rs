//! The `Coordinator` handle: one Raft member and what each part of the coordinator owns,
//! behind methods. Its fields are private to this module: every other module reaches the
//! replicated state through [`Coordinator::store`] or a [`Snapshot`], the leader's memory
//! through its owner (`LeaderView`, `Liveness`, `Submits`), and writes through `propose`.
//!
//! Here too: the timestamp oracle's serving side (`timestamps`, windows persisted through
//! Raft) and the leadership checks every service answers by (`leader_term_within_lease`,
//! `worker_term`, `linearizable`).

use crate::client_work::ClientWork;
use crate::group_commit::Submits;
use crate::liveness::Liveness;
use crate::metrics::SchedulerMetrics;
use crate::pulls::{HeldImages, PullBoard};
use crate::scheduler::LeaderView;
use crate::snapshot::Snapshot;
use crate::tso::{self, Allocation, Tso};
use crate::{group_commit, CoordError, HistoryConfig, SecurityConfig};
use corral_core::{Command, Outcome, Request};
use corral_raft::{RaftNode, StateMachineStore};
use corral_types::Timestamp;
use std::sync::Arc;
use std::time::Duration;

/// Client writes wait while a live follower lags the leader by more entries than this (a full
/// batch entry is about a megabyte: a new leader's catch-up stays a fraction of a second).
const MAX_FOLLOWER_LAG: u64 = 8;
/// The longest one client write waits for a lagging follower.
const FOLLOWER_LAG_PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);

/// Most threads of the client runtime (at most one per core).
const CLIENT_THREADS: usize = 4;

/// Tunables of a coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// A node whose last heartbeat is older than this is marked down and its jobs requeued.
    pub node_ttl: Duration,
    /// A worker whose last answered heartbeat was sent this long ago stops its jobs (its
    /// fence guard kills what is left halfway between this and `node_ttl`), so that a job
    /// never runs on two nodes at once. Less than `node_ttl`.
    pub fence_after: Duration,
    /// Scheduling passes run at least this often on the leader (and on every applied change).
    pub schedule_interval: Duration,
    /// Address other coordinators, workers and clients reach this one at (API and Raft).
    pub advertise_addr: String,
    /// The leader serves timestamps only while a quorum acknowledged it within this time; keep
    /// it below the Raft election timeout so a deposed leader stops before another is elected.
    pub leader_lease: Duration,
    /// TLS, tokens and the audit log; the default serves plaintext and lets everyone in.
    pub security: SecurityConfig,
    /// What stays in memory, and for how long the history is kept.
    pub history: HistoryConfig,
    /// Most jobs waiting to be proposed (queued submits and batches waiting for the Raft
    /// pipeline); further submits are refused with RESOURCE_EXHAUSTED and a retry-after.
    pub max_queued_submits: usize,
    /// What a submit may ask of a job array (`[limits]` max-array-window, max-array-size).
    pub array_limits: corral_types::ArrayLimits,
    /// Most client requests (submits aside) served at once (`client_work.rs`).
    pub max_client_requests: usize,
    /// How image tags are resolved to digests at submit (`[images]`: insecure registries,
    /// credentials, mirrors, the resolve timeout).
    pub registries: corral_image::RegistryConfig,
    /// Most watches (`WatchJobs`, `WatchJob`, `ReadLogs` with follow) one principal holds open
    /// at once; one more is refused with RESOURCE_EXHAUSTED.
    pub max_watches_per_principal: usize,
    /// `[autoscale]`: the nodes powered on for waiting work and off when idle, and the
    /// programs that do it (`None`: no such nodes).
    pub autoscale: Option<crate::autoscale::AutoscaleConfig>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            node_ttl: Duration::from_secs(10),
            fence_after: Duration::from_secs(5),
            schedule_interval: Duration::from_millis(500),
            advertise_addr: String::new(),
            leader_lease: Duration::from_millis(150),
            security: SecurityConfig::default(),
            history: HistoryConfig::default(),
            max_queued_submits: group_commit::DEFAULT_MAX_QUEUED_SUBMITS,
            array_limits: corral_types::ArrayLimits::default(),
            max_client_requests: crate::client_work::DEFAULT_MAX_CLIENT_REQUESTS,
            registries: corral_image::RegistryConfig::default(),
            max_watches_per_principal: crate::watch::DEFAULT_MAX_WATCHES_PER_PRINCIPAL,
            autoscale: None,
        }
    }
}

/// A coordinator process: one Raft member plus the services on top of it.
#[derive(Clone)]
pub struct Coordinator {
    inner: Arc<Inner>,
}

struct Inner {
    node: RaftNode,
    /// The leader's last scheduling pass (written by `scheduler.rs` only).
    leader_view: LeaderView,
    /// Group commit, batch admission and the bound on queued submits.
    submits: Submits,
    tso: Tso,
    liveness: Liveness,
    /// The image pulls workers reported last (leader memory, shown in job replies).
    pulls: Arc<PullBoard>,
    /// The images workers' stores hold (leader memory, for placement).
    held_images: HeldImages,
    /// Scheduler counters and pass latency, exported while this node leads.
    scheduler_metrics: SchedulerMetrics,
    /// The runtime client requests are served on, apart from the control loop.
    client_work: Arc<ClientWork>,
    /// Resolves image tags at submit (built from `config.registries`).
    registry: corral_image::Registry,
    /// The declared nodes' power decisions (leader memory; `config.autoscale`).
    autoscaler: crate::autoscale::Autoscaler,
    config: CoordinatorConfig,
}

impl Coordinator {
    /// A coordinator over `node`. Its control loop runs on the caller's runtime; client
    /// requests get a runtime of their own (`client_work.rs`), started here.
    pub fn new(node: RaftNode, config: CoordinatorConfig) -> Self {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(CLIENT_THREADS));
        let client_work = ClientWork::new(threads, config.max_client_requests).expect("the client runtime starts");
        Coordinator {
            inner: Arc::new(Inner {
                node,
                leader_view: LeaderView::default(),
                submits: Submits::new(config.max_queued_submits),
                tso: Tso::default(),
                liveness: Liveness::default(),
                pulls: Arc::default(),
                held_images: HeldImages::default(),
                scheduler_metrics: SchedulerMetrics::default(),
                client_work: Arc::new(client_work),
                registry: corral_image::Registry::new(config.registries.clone()),
                autoscaler: crate::autoscale::Autoscaler::new(config.autoscale.clone()),
                config,
            }),
        }
    }

    pub fn raft_node(&self) -> &RaftNode {
        &self.inner.node
    }

    /// The applied state and the history. Never hold its read guard across an `.await`.
    pub(crate) fn store(&self) -> &StateMachineStore {
        &self.inner.node.state
    }

    /// What a request handler reads: the applied state and the leader's last scheduling pass
    /// as of now. Cheap: two `Arc`s.
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot::new(self.inner.node.state.clone(), self.inner.leader_view.pending(), self.inner.pulls.clone())
    }

    /// Whether this node, if it leads, can serve: from Raft's metrics, without the state lock.
    pub(crate) fn leader_health(&self) -> Option<corral_raft::LeaderHealth> {
        self.inner.node.leader_health()
    }

    pub(crate) fn config(&self) -> &CoordinatorConfig {
        &self.inner.config
    }

    /// The registry client that pins image tags at submit.
    pub(crate) fn registry(&self) -> &corral_image::Registry {
        &self.inner.registry
    }

    /// The leader's memory of its last scheduling pass.
    pub(crate) fn leader_view(&self) -> &LeaderView {
        &self.inner.leader_view
    }

    /// The image pulls workers reported in their last heartbeats.
    pub(crate) fn pulls(&self) -> &PullBoard {
        &self.inner.pulls
    }

    /// The images workers' stores hold, as their heartbeats last said.
    pub(crate) fn held_images(&self) -> &HeldImages {
        &self.inner.held_images
    }

    /// The declared nodes of `[autoscale]` and the leader's power decisions.
    pub(crate) fn autoscaler(&self) -> &crate::autoscale::Autoscaler {
        &self.inner.autoscaler
    }

    /// The leader's memory of the workers: heartbeats and GPU health.
    pub(crate) fn liveness(&self) -> &Liveness {
        &self.inner.liveness
    }

    /// The submit path: group commit, batch admission and the bound on queued submits.
    pub(crate) fn submits(&self) -> &Submits {
        &self.inner.submits
    }

    /// The runtime and admission of client requests.
    pub(crate) fn client_work(&self) -> &Arc<ClientWork> {
        &self.inner.client_work
    }

    /// Scheduler counters and pass latency, exported while this node leads.
    pub(crate) fn scheduler_metrics(&self) -> &SchedulerMetrics {
        &self.inner.scheduler_metrics
    }

    /// Timestamps this coordinator's oracle handed out (exported).
    pub(crate) fn timestamps_served(&self) -> &prometheus_client::metrics::counter::Counter {
        &self.inner.tso.served
    }

    /// Stamps `command` with a TSO timestamp and replicates it; returns the state machine's outcome.
    pub async fn propose(&self, command: Command) -> Result<Outcome, CoordError> {
        let ts = self.timestamps(1).await?;
        self.propose_at(ts, command).await
    }

    /// Flow control before a client write: holds it (at most `FOLLOWER_LAG_PATIENCE`) while a
    /// live follower lags more than `MAX_FOLLOWER_LAG` entries, so that a leader failure never
    /// leaves the next leader waiting for a long catch-up before it can commit (see
    /// `RaftNode::wait_for_followers`). Workers' reports and scheduling passes are not held.
    pub(crate) async fn hold_while_followers_lag(&self) {
        self.inner.node.wait_for_followers(MAX_FOLLOWER_LAG, FOLLOWER_LAG_PATIENCE).await;
    }

    /// Replicates `command` stamped with `ts` (which must come from the oracle, or be at most the
    /// last applied timestamp for commands that carry no event time).
    pub(crate) async fn propose_at(&self, ts: Timestamp, command: Command) -> Result<Outcome, CoordError> {
        self.propose_indexed(ts, command).await.map(|(outcome, _)| outcome)
    }

    /// Like [`Coordinator::propose_at`], also returning the log index the command was applied at.
    pub(crate) async fn propose_indexed(&self, ts: Timestamp, command: Command) -> Result<(Outcome, u64), CoordError> {
        let name = command.name();
        let stranded = stranded_by_failpoint(name);
        let proposed = async {
            let answer = self.inner.node.propose(Request { ts, command }).await;
            if stranded {
                // As openraft 0.9 strands it: proposed, maybe applied, never answered.
                tracing::warn!("failpoint: the proposal of {name} is never answered");
                std::future::pending::<()>().await;
            }
            answer
        };
        let (response, index) = bounded_wait(|| format!("proposal of {name}"), proposed)
            .await
            .map_err(|waited| CoordError::Raft(format!("the proposal of {name} was not answered within {waited}s: its outcome is unknown (retry: commands are idempotent)")))??;
        response.map(|outcome| (outcome, index)).map_err(CoordError::Rejected)
    }

    /// The first of `count` consecutive, cluster-wide strictly increasing timestamps.
    pub async fn timestamps(&self, count: u64) -> Result<Timestamp, CoordError> {
        if count == 0 || count > tso::MAX_COUNT {
            return Err(CoordError::InvalidArgument(format!(
                "ask for 1 to {} timestamps per call, not {count}",
                tso::MAX_COUNT
            )));
        }
        let tso = &self.inner.tso;
        loop {
            let term = self.leader_term_within_lease()?;
            let allocation = {
                let mut state = tso.lock();
                (state.term == Some(term)).then(|| (state.allocate(tso.clock.now_ms(), count), state.window_end_ms))
            };
            match allocation {
                Some((Allocation::Granted(first), window_end)) => {
                    tso.served.inc_by(count);
                    // Keep the window one WINDOW_MS ahead of the clock (not of the stamps, which
                    // may already run ahead after a failover: the lead must not grow).
                    let now = tso.clock.now_ms();
                    if now + tso::WINDOW_MS / 2 > window_end && tso.begin_prefetch() {
                        let coord = self.clone();
                        tokio::spawn(async move {
                            let _ = coord.extend_tso(term, now + tso::WINDOW_MS / 2).await;
                            coord.inner.tso.end_prefetch();
                        });
                    }
                    return Ok(first);
                }
                Some((Allocation::NeedsWindow(needed), _)) => {
                    said_while_slow(|| format!("timestamp window of term {term}"), self.extend_tso(term, needed))
                        .await?
                }
                None => said_while_slow(|| format!("timestamp oracle of term {term}"), self.init_tso(term)).await?,
            }
        }
    }

    /// The current term if this node leads and a quorum acknowledged it within the lease.
    pub(crate) fn leader_term_within_lease(&self) -> Result<u64, CoordError> {
        let leadership = self.inner.node.leadership();
        if leadership.leader != Some(self.inner.node.id) {
            return Err(self.not_leader());
        }
        let single_voter = leadership.voters == 1;
        let lease_ms = self.inner.config.leader_lease.as_millis() as u64;
        let fresh = leadership.millis_since_quorum_ack.is_some_and(|ms| ms < lease_ms);
        if !single_voter && !fresh {
            return Err(CoordError::Unavailable(format!(
                "leader lease not confirmed (last quorum ack {:?} ms ago): retry shortly",
                leadership.millis_since_quorum_ack
            )));
        }
        Ok(leadership.term)
    }

    /// The term in which this node may answer workers: it leads, a quorum confirmed it within
    /// the lease (a deposed leader stops answering before another is elected, so a worker's
    /// lease never outlives the leadership that granted it), and it applied an entry of its own
    /// term (everything earlier terms committed is in its state: no job is judged, killed or
    /// hidden from a worker on a state that lags).
    pub(crate) fn worker_term(&self) -> Result<u64, CoordError> {
        let term = self.leader_term_within_lease()?;
        let applied_term = self.inner.node.state.read().applied_term();
        if applied_term != Some(term) {
            return Err(CoordError::Unavailable(format!(
                "this coordinator became leader in term {term} and is still applying what earlier terms committed: retry shortly"
            )));
        }
        Ok(term)
    }

    /// The lease this coordinator grants workers with each answer.
    pub(crate) fn worker_lease(&self) -> corral_proto::v1::Lease {
        let config = &self.inner.config;
        corral_proto::v1::Lease {
            node_ttl_ms: config.node_ttl.as_millis() as u64,
            fence_after_ms: config.fence_after.as_millis() as u64,
        }
    }

    /// The current term if this node believes it leads.
    pub(crate) fn leading_term(&self) -> Option<u64> {
        let leadership = self.inner.node.leadership();
        (leadership.leader == Some(self.inner.node.id)).then_some(leadership.term)
    }

    /// Makes this node's oracle serve in `term`: starts above everything committed so far and
    /// persists a new window.
    async fn init_tso(&self, term: u64) -> Result<(), CoordError> {
        let tso = &self.inner.tso;
        let _guard = tso.extending.lock().await;
        if tso.lock().term == Some(term) {
            return Ok(());
        }
        // Everything earlier leaders committed (every window they served in) is applied here.
        self.linearizable().await?;
        let (window_end, last_ts) = {
            let data = self.inner.node.state.read();
            (data.state.tso_window_end_ms, data.state.last_ts)
        };
        let floor = Timestamp::compose(window_end, Timestamp::MAX_LOGICAL).max(last_ts);
        // At most one window ahead of the clock, or a short step above the previous window: a
        // run of failovers does not push the stamps further and further ahead of the clocks.
        let upper = (tso.clock.now_ms() + tso::WINDOW_MS).max(window_end + tso::STEP_MS);
        self.propose_at(last_ts, Command::ExtendTso { upper_ms: upper }).await?;
        let mut state = tso.lock();
        *state = tso::TsoState { term: Some(term), last: floor, window_end_ms: upper, warned_at_ms: 0 };
        tracing::info!(term, window_end_ms = upper, "timestamp oracle serving");
        Ok(())
    }

    /// Persists a window reaching at least `needed` (physical ms) for `term`.
    async fn extend_tso(&self, term: u64, needed: u64) -> Result<(), CoordError> {
        let tso = &self.inner.tso;
        let _guard = tso.extending.lock().await;
        {
            let state = tso.lock();
            if state.term != Some(term) || state.window_end_ms >= needed {
                return Ok(());
            }
        }
        let upper = (tso.clock.now_ms() + tso::WINDOW_MS).max(needed + tso::STEP_MS);
        let last_ts = self.inner.node.state.read().state.last_ts;
        self.propose_at(last_ts, Command::ExtendTso { upper_ms: upper }).await?;
        let mut state = tso.lock();
        if state.term == Some(term) {
            state.window_end_ms = state.window_end_ms.max(upper);
        }
        Ok(())
    }

    /// The "not the leader" error, naming the leader when one is known.
    pub(crate) fn not_leader(&self) -> CoordError {
        let status = self.inner.node.status();
        CoordError::NotLeader { leader_id: status.leader, leader_addr: status.leader_addr }
    }

    /// Waits until this node may serve a linearizable read: it is the leader, a quorum confirmed
    /// it, and everything committed before the read is applied. Followers answer `NotLeader`.
    pub(crate) async fn linearizable(&self) -> Result<(), CoordError> {
        let read = bounded_wait(|| "linearizable read".into(), self.inner.node.ensure_linearizable())
            .await
            .map_err(|waited| CoordError::Raft(format!("no read barrier within {waited}s: retry")))?;
        match read {
            Err(corral_raft::RaftError::Failed(e)) => {
                Err(CoordError::Unavailable(format!("cannot confirm leadership: {e}")))
            }
            other => Ok(other?),
        }
    }

    /// True if this node currently believes it leads the cluster.
    pub fn is_leader(&self) -> bool {
        self.leading_term().is_some()
    }
}

/// How long a wait of the control path may last before it is said.
const SLOW_WAIT: Duration = Duration::from_secs(5);

/// The longest a proposal or a read barrier is waited for. openraft 0.9 never answers a write a
/// leader proposed if it lost leadership and a snapshot install then replaced the entry (the
/// responder is stranded: databendlabs/openraft#1762, fixed in 0.10 only). Its waiter waited
/// forever: the timestamp oracle's extension that held the oracle's lock did, and the node,
/// leader again terms later, answered heartbeats but no report, submit or scheduling pass.
/// Past this the caller gets UNAVAILABLE and retries; every command is idempotent.
pub const MAX_RAFT_WAIT: Duration = Duration::from_secs(10);

/// Strands proposals as openraft 0.9 can (see [`MAX_RAFT_WAIT`]): the failpoint
/// `raft-propose-stranded-<Command>` (e.g. `raft-propose-stranded-ExtendTso=1*off->1*return`)
/// counts and strands the proposals of that command only.
pub const STRANDED_PROPOSAL_FAILPOINT: &str = "raft-propose-stranded";

/// Test builds: whether the [`STRANDED_PROPOSAL_FAILPOINT`] strands this proposal of `name`.
fn stranded_by_failpoint(name: &str) -> bool {
    #[cfg(feature = "failpoints")]
    {
        crate::failpoints::setup();
        fail::eval(&format!("{STRANDED_PROPOSAL_FAILPOINT}-{name}"), |_| ()).is_some()
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        false
    }
}

/// Awaits `fut` for at most [`MAX_RAFT_WAIT`], saying every [`SLOW_WAIT`] that it has not
/// finished; `Err` holds the seconds waited.
pub(crate) async fn bounded_wait<T>(
    what: impl Fn() -> String,
    fut: impl std::future::Future<Output = T>,
) -> Result<T, u64> {
    let limit = MAX_RAFT_WAIT;
    match tokio::time::timeout(limit, said_while_slow(&what, fut)).await {
        Ok(value) => Ok(value),
        Err(_) => {
            tracing::warn!(waited_ms = limit.as_millis() as u64, "{} not answered: given up", what());
            Err(limit.as_secs())
        }
    }
}

/// Awaits `fut`, warning every [`SLOW_WAIT`] that it has not finished, with `what` waits: a wait
/// that never ends (a proposal, a read barrier, the timestamp oracle) says where it is.
pub(crate) async fn said_while_slow<T>(what: impl Fn() -> String, fut: impl std::future::Future<Output = T>) -> T {
    tokio::pin!(fut);
    let started = std::time::Instant::now();
    loop {
        match tokio::time::timeout(SLOW_WAIT, &mut fut).await {
            Ok(value) => {
                if started.elapsed() >= SLOW_WAIT {
                    tracing::info!(waited_ms = started.elapsed().as_millis() as u64, "{} finished", what());
                }
                return value;
            }
            Err(_) => {
                tracing::warn!(waited_ms = started.elapsed().as_millis() as u64, "{} has not finished yet", what())
            }
        }
    }
}
