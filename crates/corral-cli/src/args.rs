//! Command-line arguments (the public CLI contract: keep names stable).

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "corral",
    version,
    about = "corral: a distributed GPU-pool scheduler",
    long_about = "corral schedules jobs onto a pool of GPU hosts.\n\nTry it locally:\n  corral dev &\n  corral submit --gpus 1 -- sh -c 'echo hello from GPU $CUDA_VISIBLE_DEVICES'\n  corral jobs"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Coordinator address(es), comma-separated host:port.
    #[arg(long, global = true, env = "CORRAL_ENDPOINT", default_value = "127.0.0.1:7070", value_delimiter = ',')]
    pub endpoint: Vec<String>,
    /// Access token of the tenant or admin.
    #[arg(long, global = true, env = "CORRAL_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// CA certificate (PEM) of the cluster: talk mutual TLS (with --cert and --key).
    #[arg(long, global = true, env = "CORRAL_CA")]
    pub ca: Option<PathBuf>,
    /// Our client certificate (PEM) signed by the cluster CA.
    #[arg(long, global = true, env = "CORRAL_CERT")]
    pub cert: Option<PathBuf>,
    /// The private key (PEM) of --cert.
    #[arg(long, global = true, env = "CORRAL_KEY")]
    pub key: Option<PathBuf>,
    /// Output format.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

/// Every subcommand enum here defers its arguments (`defer = true`): a run builds the flags of
/// the command it runs only, not of all of them (most of a client command's start was clap
/// building the whole tree). Names and help text stay eager, so `--help` lists every command.
#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum Command {
    /// Run a single-process pool: one coordinator plus a worker (--nodes: several) with simulated
    /// GPUs. Jobs run as the user running it (started as root: as root, without capabilities;
    /// see --run-as).
    Dev(DevArgs),
    /// Run a coordinator daemon (one Raft member) from its TOML config file.
    Coordinator(ConfigArg),
    /// Run a worker daemon (GPU host) from its TOML config file; `--join ADDR --token T` the
    /// first time, to get its certificate with a token from `corral node join-token`.
    Worker(WorkerArgs),
    /// Manage the coordinator cluster: init, join, leave, status.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Submit a job; prints its id.
    Submit(SubmitArgs),
    /// Show one job.
    Show(ShowArgs),
    /// Wait until a job ends; exit 0 if it succeeded, 1 if it ended otherwise.
    Wait(WaitArgs),
    /// List pending and running jobs (with --all, finished ones too).
    Jobs(JobsArgs),
    /// The queue: pending and running jobs, with why pending jobs wait.
    Queue(JobsArgs),
    /// Cancel a job (kills its whole process tree if it runs), or with --all every matching job.
    Cancel(CancelArgs),
    /// Keep a pending job (an array: and its pending tasks) from starting, until released.
    Hold(JobArg),
    /// Let a held job start.
    Release(JobArg),
    /// Stop a running job (checkpoint signal, grace) and put it back in the queue.
    Requeue(JobArg),
    /// Send a signal to a running job (an array: to its running tasks), e.g. `corral signal 12 USR1`.
    Signal(SignalArgs),
    /// Change a pending job: time limit (a tenant may only shorten it), priority class, GPUs, name.
    Update(UpdateArgs),
    /// Print a job's output.
    Logs(LogsArgs),
    /// List worker nodes and their GPUs.
    Nodes,
    /// Live view of the pool: nodes, GPUs (temperature, utilization, state), queue by tenant,
    /// running jobs. Redraws every --interval until Ctrl-C.
    Top(TopArgs),
    /// Billing: what each tenant's GPU use cost.
    #[command(subcommand)]
    Billing(BillingCommand),
    /// Accounting history (like Slurm's sacct): job, tenant, GPUs, start, end, elapsed, state, cost.
    History(HistoryArgs),
    /// A certificate authority and role certificates for mutual TLS: create them, renew them.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Access tokens of tenants and admins (admin only): create, list, revoke.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Cluster policy (admin): tenants and quotas, priority classes, prices, as a TOML file.
    #[command(subcommand)]
    Admin(AdminCommand),
    /// Node lifecycle (admin): cordon, drain, resume, remove; join tokens for new workers.
    #[command(subcommand)]
    Node(NodeCommand),
    /// Images in the workers' layer stores (admin): list, pre-pull, remove, load an archive.
    #[command(subcommand)]
    Image(ImageCommand),
    /// The fence guard a worker starts beside itself (internal): kills the worker's jobs when
    /// its lease runs out or the worker dies.
    #[command(hide = true)]
    WorkerGuard(WorkerGuardArgs),
    /// Print a cluster-wide timestamp from the leader's timestamp oracle (TSO).
    Ts {
        /// Take a contiguous range of this many and print the first.
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    // Slurm-style commands.
    /// Submit a batch script: `#SBATCH` and `#CORRAL` directives at its top set the job's
    /// options (flags given here win); prints the job id. Options before the script also take
    /// Slurm's sbatch forms (`--job-name`, `-J`, `-t 1-00:00:00`, `--gres=gpu:2`, `--mem=4000`
    /// in MB, `-o FILE`, `-e FILE`); everything after the script is its arguments.
    Sbatch(SbatchArgs),
    /// Submit a job, wait for it and stream its output (like srun); exits with the job's exit
    /// code (128+N when killed by signal N). Ctrl-C cancels the job.
    Run(RunArgs),
    /// An interactive allocation (like salloc): submit flags, wait until it is granted, then run
    /// $SHELL (or the command after `--`) here with the allocation's environment, so `srun` in it
    /// runs steps on the allocation. When the shell or command exits the allocation is
    /// relinquished, and alloc exits with its status.
    Alloc(AllocArgs),
    /// A shell (or the command after `--`) inside a running job's cgroup on one of its nodes,
    /// as the job's user in its working directory (like srun --jobid=J --overlap --pty bash):
    /// a terminal when stdin is one, else plain pipes. Exits with the command's status.
    Attach(AttachArgs),
    /// Relinquishes a `corral alloc` session's job when the alloc that started it dies
    /// (internal: started by alloc, it cancels the job once its stdin closes).
    #[command(hide = true)]
    AllocGuard { job: u64 },
}

#[derive(Debug, Args)]
pub struct WorkerGuardArgs {
    /// The worker's cgroup root: every job cgroup under it is killed when the lease runs out.
    #[arg(long)]
    pub cgroup_root: String,
}

#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum CertsCommand {
    /// Write ca.pem and certificates carrying their role (coordinator, worker, admin, client).
    /// The certificates are valid for --days (365 by default), the CA for ten years.
    Init(CertsInitArgs),
    /// Issue the certificates in DIR again with the same CA, names, roles and keys, valid from
    /// now for --days (never past the CA's expiry); ca.pem and the keys stay as they are.
    ///
    /// Copy the new files where the daemons and users read them, then restart each coordinator
    /// and each worker whose certificate is in DIR (a daemon reads its certificate at start);
    /// clients (the CLI, the Python client) read theirs at each start. Workers that joined with
    /// a token renew their own certificates.
    Renew(CertsRenewArgs),
}

#[derive(Debug, Args)]
pub struct CertsRenewArgs {
    /// The directory `corral certs init` wrote (ca.pem and ca-key.pem, and the certificates).
    #[arg(long)]
    pub dir: PathBuf,
    /// Days the renewed certificates are valid (at most 3650).
    #[arg(long, default_value_t = corral_security::DEFAULT_CERT_DAYS)]
    pub days: u32,
}

#[derive(Debug, Args)]
pub struct CertsInitArgs {
    /// Directory to write the PEM files to (refuses to replace an existing CA).
    #[arg(long)]
    pub dir: PathBuf,
    /// Coordinator certificates coordinator-1 .. coordinator-N.
    #[arg(long, default_value_t = 3)]
    pub coordinators: u32,
    /// Extra host names or IPs the coordinator and worker certificates are valid for
    /// (127.0.0.1, ::1 and localhost always are).
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// Worker node names, one certificate each (worker-NAME.pem).
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Client certificates for users (client-NAME.pem); admin.pem is always written.
    #[arg(long, value_delimiter = ',', default_value = "user")]
    pub clients: Vec<String>,
    /// Days the certificates are valid (at most 3650; the CA is valid ten years). Renew them
    /// before they expire with `corral certs renew`.
    #[arg(long, default_value_t = corral_security::DEFAULT_CERT_DAYS)]
    pub days: u32,
}

#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum ImageCommand {
    /// Each node's images: reference, digest, size, last use, whether a job uses it.
    Ls {
        /// Only this node's.
        #[arg(long)]
        node: Option<String>,
    },
    /// Pull an image into a node's store before jobs need it (progress as it goes, then one
    /// line per node).
    Pull {
        /// [REGISTRY/]NAME[:TAG|@sha256:DIGEST]
        reference: String,
        /// The node to pull on.
        #[arg(long, required_unless_present = "all", conflicts_with = "all")]
        node: Option<String>,
        /// Every node that is up.
        #[arg(long)]
        all: bool,
    },
    /// Remove an image from the stores (refused where a placed or running job needs it).
    Rm {
        /// A reference or digest, as `corral image ls` shows it.
        reference: String,
        /// Only from this node (default: every node that has it).
        #[arg(long)]
        node: Option<String>,
    },
    /// Load a `docker save` or OCI archive into the stores, for nodes without registry
    /// access: sent through the coordinator to each node's worker, at most its store's
    /// max-size.
    Load {
        /// The archive (a tar file).
        file: std::path::PathBuf,
        /// Only into this node's store (default: every node that is up).
        #[arg(long)]
        node: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum TokenCommand {
    /// Issue a token and print its secret (shown once; only its SHA-256 is stored).
    Create {
        /// The tenant the token acts as.
        #[arg(long, required_unless_present = "admin", conflicts_with = "admin")]
        tenant: Option<String>,
        /// An admin token: every tenant, tokens and the cluster.
        #[arg(long)]
        admin: bool,
        /// Lifetime, e.g. 12h or 30d (default: no expiry).
        #[arg(long, value_parser = parse_duration)]
        ttl: Option<std::time::Duration>,
    },
    /// List tokens (never their secrets).
    List,
    /// Revoke a token for good.
    Revoke {
        /// Token id (from `corral token list`).
        id: u64,
    },
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Path of the TOML config file.
    #[arg(long)]
    pub config: PathBuf,
    /// Join the cluster through the coordinator at this address (host:port) with the
    /// single-use --token from `corral node join-token`: the worker gets its certificate and
    /// keeps it in its data dir, so later starts need neither flag.
    #[arg(long, value_name = "ADDR")]
    pub join: Option<String>,
}

#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum BillingCommand {
    /// Cost and GPU-hours per tenant and priority class, from the ledger's segments.
    Report(BillingArgs),
    /// One tenant's bill: each billed run and why it ended, each credit (a negative line
    /// naming the run and the cause; the policy's `[billing.credits]`), then the totals.
    Invoice(InvoiceArgs),
}

#[derive(Debug, Args)]
pub struct InvoiceArgs {
    /// The tenant billed.
    #[arg(long)]
    pub tenant: String,
    /// Only runs that ended after this: a date (2026-12-01, 2026-12-01T08:00:00Z) or an age (24h, 7d).
    #[arg(long)]
    pub since: Option<String>,
    /// Only runs that started before this (same forms as --since).
    #[arg(long)]
    pub until: Option<String>,
    /// Invoice format (--output json also selects json).
    #[arg(long, value_enum, default_value_t = ReportFormat::Table)]
    pub format: ReportFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    Table,
    Csv,
    Json,
}

#[derive(Debug, Args)]
pub struct BillingArgs {
    /// Only this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only use that ended after this: a date (2026-12-01, 2026-12-01T08:00:00Z) or an age (24h, 7d).
    #[arg(long)]
    pub since: Option<String>,
    /// Only use that started before this (same forms as --since).
    #[arg(long)]
    pub until: Option<String>,
    /// Only this job, listing each of its segments (a run that spans a price change has one per
    /// piece, each with the policy version whose prices it used).
    #[arg(long, value_name = "JOB")]
    pub job: Option<u64>,
    /// Report format (--output json also selects json).
    #[arg(long, value_enum, default_value_t = ReportFormat::Table)]
    pub format: ReportFormat,
    /// With --limit N: a report of the first N segments (oldest first) only.
    #[command(flatten)]
    pub page: PageArgs,
}

#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// Only this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only jobs submitted at or after this: a date, an age or a TSO timestamp (see `jobs
    /// --since`).
    #[arg(long)]
    pub since: Option<String>,
    /// Only jobs submitted before this (same forms as --since).
    #[arg(long)]
    pub until: Option<String>,
    #[command(flatten)]
    pub page: PageArgs,
}

#[derive(Debug, Args)]
pub struct ConfigArg {
    /// Path of the TOML config file.
    #[arg(long)]
    pub config: PathBuf,
}

#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum NodeCommand {
    /// Take no new jobs on NODE; at --deadline its running jobs get their checkpoint signal,
    /// then their class's grace, then are requeued onto other nodes. Without --deadline they
    /// run to their end. The node shows as draining, then drained once empty.
    Drain {
        node: String,
        /// Why (shown by `corral nodes`).
        #[arg(long, default_value = "")]
        reason: String,
        /// Stop and requeue running jobs after this long (e.g. 30m, 0s for now).
        #[arg(long, value_parser = parse_duration)]
        deadline: Option<std::time::Duration>,
    },
    /// Take no new jobs on NODE; running jobs stay.
    Cordon {
        node: String,
        /// Why (shown by `corral nodes`).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Let a cordoned or draining NODE take jobs again.
    Resume { node: String },
    /// Forget NODE (only when it is empty and down, cordoned or drained): its GPUs leave the pool,
    /// and every worker certificate issued to it so far is revoked (coordinators refuse it). Stop
    /// its worker first. It comes back only with a new certificate: join it with a new token (or
    /// issue one with `corral certs renew`).
    Remove { node: String },
    /// Issue a single-use token a worker joins the cluster with (admin only, TLS clusters):
    /// `corral worker --config FILE --join ADDR --token TOKEN`.
    JoinToken {
        /// Lifetime, e.g. 30m or 24h (at most 7 days).
        #[arg(long, value_parser = parse_duration, default_value = "1h")]
        ttl: std::time::Duration,
    },
    /// Set when NODE's lease ends (the host goes back to its owner), or clear it (admin). No job
    /// whose time limit plus its class's grace would run past it is placed there (nor one without
    /// a limit within the policy's lease-guard of it); at the lease end minus their grace,
    /// running jobs get their checkpoint signal and are requeued (cause lease-ended); at the lease
    /// end the node drains. The lease end set here wins over the worker's `lease-end` until
    /// --clear, which goes back to the worker's (if any).
    #[command(group(clap::ArgGroup::new("lease").required(true).args(["until", "clear"])))]
    Lease {
        node: String,
        /// When the lease ends: UTC (2026-12-31T18:00:00Z), a duration from now (8h), or a TSO
        /// timestamp.
        #[arg(long)]
        until: Option<String>,
        /// Remove the lease end set here.
        #[arg(long)]
        clear: bool,
    },
}

#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum AdminCommand {
    /// Print the live policy as a file that `apply` accepts back (with its version).
    Show,
    /// Apply a policy file: one replicated change, no restart; prints what changed. A change
    /// that removes the tenant or class of unfinished jobs is refused unless --force.
    Apply(PolicyFileArgs),
    /// Say what applying a policy file would change, and which jobs it would strand.
    Diff {
        /// The policy file (TOML; see cluster-configs/cluster.toml).
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: PathBuf,
    },
    /// The applied policy versions: when, by whom, what changed.
    History,
}

#[derive(Debug, Args)]
pub struct PolicyFileArgs {
    /// The policy file (TOML; see cluster-configs/cluster.toml).
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: PathBuf,
    /// Apply even if it removes the tenant or class of unfinished jobs: they are cancelled
    /// (running ones get SIGTERM, then SIGKILL after their class's grace) and billed up to then.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum ClusterCommand {
    /// Make the coordinator at --endpoint the first member of a new cluster (idempotent) and
    /// install its first policy.
    Init {
        /// The first cluster policy (TOML; see cluster-configs/cluster.toml). Default: the dev
        /// pool's (cluster-configs/dev-policy.toml).
        #[arg(long, value_name = "FILE")]
        policy: Option<PathBuf>,
    },
    /// Add the running, empty coordinator at ADDR: as learner until it caught up, then as voter.
    Join {
        /// API address of the coordinator to add, host:port.
        addr: String,
    },
    /// Remove coordinator NODE_ID from the cluster (its id is never reused).
    Leave {
        /// Node id of the coordinator to remove.
        node_id: u64,
    },
    /// Members, leader, term, commit and applied index as the coordinator at --endpoint sees them.
    Status {
        /// Also print the digest of its state machine (equal on coordinators that applied the
        /// same log prefix; costly on a large state: it encodes all of it).
        #[arg(long)]
        digest: bool,
    },
    /// Build a snapshot of the state machine of the coordinator at --endpoint now (a restart
    /// then applies only the log entries after it again; the log before it may be purged), and
    /// print its status once the snapshot is written. Snapshots are also built every
    /// `raft.snapshot-every` entries.
    Snapshot,
}

#[derive(Debug, Args)]
pub struct DevArgs {
    /// Where the coordinator and the workers keep their data.
    #[arg(long, default_value = "./corral-data")]
    pub data_dir: PathBuf,
    /// Address of the API (and Raft) endpoint.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: String,
    /// Number of simulated GPUs (of each node).
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
    /// Number of simulated worker nodes: `dev-node`, `dev-node-2` ... `dev-node-N` (a gang
    /// needs two or more).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub nodes: u32,
    /// Labels of a node, e.g. `partition=train,zone=a`: the first --node-labels is the first
    /// node's, the second the second's... (`partition=P` puts it in partition P).
    #[arg(long, value_name = "KEY=VALUE,...")]
    pub node_labels: Vec<String>,
    /// Simulate MIG-capable GPUs with MIG mode on: each `--gpu-slice mig:...` job gets an
    /// instance made for it (as a worker with `[mig] manage = true`).
    #[arg(long)]
    pub mig: bool,
    /// Model name of the simulated GPUs.
    #[arg(long, default_value = "RTX 5090")]
    pub gpu_model: String,
    /// Memory of each simulated GPU.
    #[arg(long, default_value = "32GiB", value_parser = parse_size)]
    pub gpu_memory: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (loopback only): the coordinator's and
    /// the (first) worker's series on one listener; the web view of the pool at http://ADDR/.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// Cluster policy to start with (TOML; see cluster-configs/cluster.toml). Default: the dev
    /// policy (cluster-configs/dev-policy.toml). Given again on a restart, a changed file is
    /// applied as a new policy version.
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// Run jobs as this user (name or uid) instead of the user running `corral dev`. Started
    /// as root without it, jobs run as root, though without any capability.
    #[arg(long, value_name = "USER")]
    pub run_as: Option<String>,
    /// Host directory that --container-mounts may bind from, as a worker's `[images]
    /// mount-allow` (repeatable; none: every container mount is refused).
    #[arg(long, value_name = "DIR")]
    pub mount_allow: Vec<PathBuf>,
    /// Unpacked image layers the worker's store keeps before the least recently used images
    /// no placed or running job needs are removed, as a worker's `[images] max-size`.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub image_max_size: Option<u64>,
}

#[derive(Debug, Args)]
pub struct TopArgs {
    /// Time between two refreshes, e.g. 2s or 500ms.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub interval: std::time::Duration,
    /// Print one frame and exit (with --output json: one JSON document).
    #[arg(long)]
    pub once: bool,
}

// The flags that describe a job, shared by `submit`, `sbatch` and `run` (and the `#CORRAL`
// directives of a batch script). Unset options are `None` so that command-line flags can
// override a script's directives. (A plain comment: clap would take a doc comment of a
// flattened struct for the about text of the commands that flatten it.)
#[derive(Debug, Clone, Default, Args)]
pub struct JobFlags {
    /// Tenant to run and bill the job as (default: the token's tenant, else `default`).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Priority class (default: the cluster's default class).
    #[arg(long)]
    pub priority: Option<String>,
    /// Slurm account (`-A`): the tenant the policy's `[slurm] accounts` maps it to (without
    /// that map, the tenant of that name); unknown accounts are refused.
    #[arg(long, short = 'A', value_name = "ACCOUNT")]
    pub account: Option<String>,
    /// Slurm QOS (`-q`): the priority class the policy's `[slurm] qos` maps it to (without that
    /// map, the class of that name); unknown QOS are refused.
    #[arg(long, short = 'q', value_name = "QOS")]
    pub qos: Option<String>,
    /// Whole GPUs (default 0).
    #[arg(long)]
    pub gpus: Option<u32>,
    /// A GPU slice instead of whole GPUs: mig:<profile> (e.g. mig:1g.10gb) or mps:<percent>[:<memory>].
    #[arg(long)]
    pub gpu_slice: Option<String>,
    /// CPU cores (fractions allowed, e.g. 0.5); the job's cgroup is capped to them.
    #[arg(long, allow_negative_numbers = true)]
    pub cpus: Option<f64>,
    /// Memory limit, e.g. 512M or 16GiB; the job is OOM-killed above it.
    #[arg(long, value_parser = parse_size)]
    pub mem: Option<u64>,
    /// Time limit, e.g. 90s, 30m, 2h, 1:30:00 (a bare number is minutes, as in Slurm; 0: no
    /// limit).
    #[arg(long, value_parser = parse_duration)]
    pub time: Option<std::time::Duration>,
    /// Job name (default: the program name).
    #[arg(long)]
    pub name: Option<String>,
    /// Run the command in a container (runc): an image reference [REGISTRY/]NAME[:TAG|@sha256:DIGEST]
    /// (no registry: Docker Hub; no tag: latest), pinned to its digest at submit, or the absolute
    /// path of an unpacked root filesystem on every worker.
    #[arg(long, visible_alias = "container-image", value_name = "REF|DIR")]
    pub image: Option<String>,
    /// Bind mounts into the --image container, SRC[:DST[:ro|rw]], comma-separated (repeatable).
    /// SRC is a path on the worker, below a directory its `[images] mount-allow` lists, else
    /// the job fails naming the mount.
    #[arg(long, value_name = "SRC[:DST[:ro]],...")]
    pub container_mounts: Vec<String>,
    /// Working directory in the --image container (default: the image's WorkingDir).
    #[arg(long, value_name = "DIR")]
    pub container_workdir: Option<String>,
    /// Variables of this shell set in the --image container over the image's values, even
    /// with --export NONE (comma-separated, repeatable).
    #[arg(long, value_name = "VAR[,VAR]", value_delimiter = ',')]
    pub container_env: Vec<String>,
    /// Gang across nodes: whole GPUs per node (--gpus must be a multiple); all parts start together.
    #[arg(long)]
    pub gpus_per_node: Option<u32>,
    /// The job uses GPUDirect RDMA: prefer GPUs near an RDMA NIC.
    #[arg(long)]
    pub rdma: bool,
    /// If preempted, end as `preempted` instead of going back to the queue.
    #[arg(long)]
    pub no_requeue: bool,
    /// Signal sent first when the job is preempted, so it can checkpoint (name or number, e.g.
    /// USR1); with @DUR also DUR before its time limit (USR1@300: 300 seconds, USR1@5m).
    #[arg(long, value_parser = parse_signal_spec, value_name = "SIG[@DUR]")]
    pub signal: Option<SignalSpec>,
    /// Extra environment variable KEY=VALUE (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    // Slurm-style options (`corral sbatch` directives map onto these same flags).
    /// Working directory of the job on the worker (default: the current directory; it must
    /// exist there, e.g. on a shared file system). A relative program (./train.sh) is found in it.
    #[arg(long, short = 'D', value_name = "DIR")]
    pub chdir: Option<PathBuf>,
    /// Which variables of this shell the job gets: ALL (the default; without the credentials
    /// CORRAL_TOKEN, CORRAL_CA, CORRAL_CERT, CORRAL_KEY, CORRAL_ENDPOINT, SSH_AUTH_SOCK,
    /// SSH_AGENT_PID, GPG_AGENT_INFO, KRB5CCNAME, XAUTHORITY, DBUS_SESSION_BUS_ADDRESS,
    /// VAULT_TOKEN, CORRAL_RUN_SECRET, CORRAL_IN_JOB_SOCKET; submitted from inside a job, without
    /// that job's own CORRAL_*, SLURM_* and SLURMD_* variables), NONE, or a list
    /// VAR[,VAR=value...] (ALL,VAR=value adds to ALL). Jobs with --image get NONE unless given.
    #[arg(long, value_name = "ALL|NONE|VARS")]
    pub export: Option<String>,
    /// Also write the job's stdout to this file on the worker (relative to the working
    /// directory); %j job id, %J job id and step, %A array job id, %a array task id, %x name,
    /// %u user, %N node, %n node index, %t task, %% a % (%4a: zero-padded). Without --stderr,
    /// stderr goes there too. `corral logs` keeps working. `corral sbatch` defaults to
    /// slurm-%j.out (slurm-%A_%a.out for an array).
    #[arg(long = "stdout", value_name = "PATTERN")]
    pub stdout: Option<String>,
    /// Also write the job's stderr to this file (same patterns as --stdout).
    #[arg(long = "stderr", value_name = "PATTERN")]
    pub stderr: Option<String>,
    /// A job array: task indices and at most how many run at once (0-999%16, 1,3,5-9, 0-15:4).
    ///
    /// Each index once (0,0 and overlapping ranges are refused), from 0 to 99999, in at most
    /// 4096 ranges once consecutive and evenly spaced indices are merged (0,1,2,3 is 0-3). %N
    /// caps how many tasks are pending or running at once (at most 10000; without it, 1024).
    /// A pool may admit less: its coordinators' limits.max-array-window (default 1024) and
    /// limits.max-array-size (default 100000 tasks). Every task not started yet counts against
    /// the tenant's max-pending-jobs.
    #[arg(long, value_name = "SPEC")]
    pub array: Option<String>,
    /// Start only after other jobs: afterok:ID[:ID...], afterany:ID, afternotok:ID, singleton,
    /// or a bare ID (afterany), comma-separated: all must hold (at most 256 jobs).
    #[arg(long, short = 'd', value_name = "SPEC")]
    pub dependency: Option<String>,
    /// Run only on nodes labelled partition=P.
    #[arg(long, short = 'p', value_name = "P")]
    pub partition: Option<String>,
    /// Node labels the job needs, comma-separated: key=value, or a bare label name (repeatable;
    /// at most 64 with --partition).
    #[arg(long, short = 'C', value_name = "LABELS", value_delimiter = ',')]
    pub constraint: Vec<String>,
    /// Submit held: it does not start until `corral release`.
    #[arg(long, short = 'H')]
    pub hold: bool,
    /// Requeue a failed run up to N times before the job fails.
    #[arg(long, value_name = "N")]
    pub max_restarts: Option<u32>,
    /// Nodes of the allocation (Slurm's -N): --gpus-per-node GPUs on each (--gpus defaults to
    /// nodes x gpus-per-node), or --gpus split evenly over them, or none.
    #[arg(long, short = 'N', value_name = "N")]
    pub nodes: Option<u32>,
    /// Tasks of the allocation (Slurm's -n), spread over its nodes as Slurm's block distribution
    /// does; each gets --cpus-per-task CPUs (default 1).
    #[arg(long, short = 'n', value_name = "N")]
    pub ntasks: Option<u32>,
    /// Tasks on each node (with --ntasks: at most this many).
    #[arg(long, value_name = "N")]
    pub ntasks_per_node: Option<u32>,
    /// N tasks for each GPU (with --gpus-per-node: on each node; with --gpus: in all); with 1,
    /// each task is bound to its GPU (Slurm's implied --gpu-bind=single:1).
    #[arg(long, value_name = "N")]
    pub ntasks_per_gpu: Option<u32>,
    /// Whole CPUs of each task (Slurm's -c): the job's CPUs on a node are its tasks there times this.
    #[arg(long, short = 'c', value_name = "N")]
    pub cpus_per_task: Option<u32>,
    /// Whole GPUs of each task, bound to it: a node's GPUs are its tasks there times this.
    /// With --ntasks and none of --nodes, --ntasks-per-node, --gpus, --gpus-per-node, the tasks
    /// spread over the fewest nodes that hold them when the job is placed (as Slurm).
    #[arg(long, value_name = "N")]
    pub gpus_per_task: Option<u32>,
    /// Whole CPUs for each GPU of the job.
    #[arg(long, value_name = "N")]
    pub cpus_per_gpu: Option<u32>,
    /// Memory for each CPU of the job on a node, e.g. 4G (the node's limit is CPUs times this).
    #[arg(long, value_parser = parse_size)]
    pub mem_per_cpu: Option<u64>,
    /// Memory for each GPU of the job on a node, e.g. 40G (the node's limit is GPUs times this).
    #[arg(long, value_parser = parse_size)]
    pub mem_per_gpu: Option<u64>,
    /// Whole nodes: no other job runs on the allocation's nodes, and the job gets all their CPUs
    /// and memory.
    #[arg(long)]
    pub exclusive: bool,
    /// Only GPUs of this model (Slurm's gpu:TYPE:N): a100 matches "NVIDIA A100-SXM4-80GB".
    #[arg(long, value_name = "TYPE")]
    pub gpu_type: Option<String>,
    /// Output files (--stdout, --stderr) are truncated when the job starts (the default) or
    /// appended to.
    #[arg(long, value_name = "MODE", value_parser = ["truncate", "append"])]
    pub open_mode: Option<String>,
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub job: JobFlags,
    /// The program and its arguments, after `--`.
    #[arg(last = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct SbatchArgs {
    #[command(flatten)]
    pub job: JobFlags,
    /// Refuse a script with a directive corral does not support (default: warn and ignore it).
    #[arg(long)]
    pub strict: bool,
    /// Print only the job id (what scripts read; corral's table output is that already).
    #[arg(long)]
    pub parsable: bool,
    /// Return only when the job has ended, with its exit code (1 for a job that did not
    /// succeed without one), as `sbatch --wait`.
    #[arg(long, short = 'W')]
    pub wait: bool,
    /// A one-line job instead of a script, as `sbatch --wrap`: the command run by `/bin/sh`.
    #[arg(long, value_name = "COMMAND", conflicts_with = "script")]
    pub wrap: Option<String>,
    /// The batch script (at most 1 MiB): `#SBATCH` / `#CORRAL` directives up to the first
    /// command line; stored with the job and run on the worker. Without one (and without
    /// --wrap) the script is read from standard input, as Slurm's sbatch reads it
    /// (`sbatch <<EOF ... EOF`).
    pub script: Option<PathBuf>,
    /// Arguments of the script.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub job: JobFlags,
    /// The program and its arguments, after `--`.
    #[arg(last = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct AllocArgs {
    #[command(flatten)]
    pub job: JobFlags,
    /// End the session when its GPUs' utilisation stays under --min-gpu-util for this long
    /// (e.g. 30m; default: the priority class's idle-timeout, else 30m; 0: never).
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub idle_timeout: Option<std::time::Duration>,
    /// The utilisation (percent, of each GPU of the session) under which a GPU counts as idle
    /// (default 1).
    #[arg(long, value_name = "PCT", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub min_gpu_util: Option<u32>,
    /// The program and its arguments, after `--` (default: $SHELL, else /bin/sh).
    #[arg(last = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct AttachArgs {
    /// The running job.
    pub job: u64,
    /// The node of the job: a name of its allocation, or its index there (default: the first).
    #[arg(long, value_name = "N")]
    pub node: Option<String>,
    /// The program and its arguments, after `--` (default: the job's $SHELL, else /bin/sh).
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// Most job ids one `corral cancel` takes (more: `--all` with filters, or several calls).
pub const MAX_CANCEL_IDS: usize = 1000;

#[derive(Debug, Args)]
pub struct CancelArgs {
    /// Job ids (`12`), or tasks of a job array (`12_7`), as many as given (`scancel 73 74`).
    #[arg(required_unless_present = "all", conflicts_with = "all", num_args = 1..=MAX_CANCEL_IDS)]
    pub jobs: Vec<corral_types::JobRef>,
    /// Cancel every pending and running job that matches --tenant, --state and --name (a
    /// tenant token: only its own), like `scancel -u`.
    #[arg(long)]
    pub all: bool,
    /// With --all: only this tenant's jobs.
    #[arg(long, requires = "all")]
    pub tenant: Option<String>,
    /// With --all: only jobs in this state (pending or running; repeat for both).
    #[arg(long, requires = "all", value_parser = ["pending", "running"])]
    pub state: Vec<String>,
    /// With --all: only jobs with exactly this name.
    #[arg(long, requires = "all")]
    pub name: Option<String>,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// Job id (`12`), or a task of a job array (`12_7`).
    pub job: corral_types::JobRef,
    /// Slurm's `scontrol show job` format (`Key=Value` pairs): what `scontrol show job` inside a
    /// job prints.
    #[arg(long, hide = true)]
    pub scontrol: bool,
    /// With --scontrol: every pair on one line (`scontrol --oneliner`).
    #[arg(long, hide = true, requires = "scontrol")]
    pub oneliner: bool,
    /// Slurm's sacct rows (the job's, its batch step's, its steps') in these columns
    /// (`JobID,JobName,Elapsed`): what `sacct` inside a job prints.
    #[arg(long, hide = true, value_name = "FIELDS", conflicts_with = "scontrol")]
    pub sacct: Option<String>,
    /// With --sacct: no header lines (`sacct -n`).
    #[arg(long, hide = true, requires = "sacct")]
    pub noheader: bool,
    /// With --sacct: fields ended by `|` (`sacct -p`).
    #[arg(long, hide = true, requires = "sacct", conflicts_with = "parsable2")]
    pub parsable: bool,
    /// With --sacct: fields separated by `|` (`sacct -P`).
    #[arg(long, hide = true, requires = "sacct")]
    pub parsable2: bool,
    /// With --sacct: the job's row only (`sacct -X`).
    #[arg(long, hide = true, requires = "sacct")]
    pub allocations: bool,
    /// With --sacct: more jobs after JOB (`sacct -j 12,13`); a job not found prints nothing,
    /// as sacct prints nothing for it.
    #[arg(long, hide = true, requires = "sacct", value_delimiter = ',', value_name = "JOB")]
    pub jobs: Vec<corral_types::JobRef>,
}

#[derive(Debug, Args)]
pub struct JobArg {
    /// Job id (`12`), or a task of a job array (`12_7`).
    pub job: corral_types::JobRef,
}

#[derive(Debug, Args)]
pub struct SignalArgs {
    /// Job id, or `12_7` for a task of an array.
    pub job: corral_types::JobRef,
    /// Signal name or number: USR1, SIGUSR2, TERM, 10.
    #[arg(value_parser = parse_signal)]
    pub signal: i32,
}

#[derive(Debug, Args)]
pub struct UpdateArgs {
    /// Job id, or `12_7` for a task of an array.
    pub job: corral_types::JobRef,
    /// New time limit (a tenant may only shorten it; an admin may lengthen it).
    #[arg(long, value_parser = parse_duration)]
    pub time: Option<std::time::Duration>,
    /// New priority class.
    #[arg(long)]
    pub priority: Option<String>,
    /// New number of whole GPUs.
    #[arg(long)]
    pub gpus: Option<u32>,
    /// New name.
    #[arg(long)]
    pub name: Option<String>,
}

#[derive(Debug, Args)]
pub struct WaitArgs {
    /// Job id (`12`), or a task of a job array (`12_7`).
    pub job: corral_types::JobRef,
    /// Give up after this long (exit 2): a duration with its unit, e.g. 30s, 10m or 1h (a bare
    /// number is refused: seconds or minutes would be a guess).
    #[arg(long, value_parser = parse_timeout)]
    pub timeout: Option<std::time::Duration>,
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    /// Include finished jobs.
    #[arg(long)]
    pub all: bool,
    /// Only jobs of this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only jobs in these states, comma-separated: pending, running, succeeded, failed,
    /// cancelled, preempted (finished states need no --all).
    #[arg(long, value_delimiter = ',', value_parser = parse_job_state, value_name = "STATE")]
    pub state: Vec<corral_types::JobState>,
    /// Only jobs with exactly this name; end it with `*` for the jobs whose name starts with
    /// the rest (`--name 'train-*'`).
    #[arg(long)]
    pub name: Option<String>,
    /// Only jobs submitted at or after this: a date (2026-12-01, 2026-12-01T08:00:00Z), an age
    /// (24h, 7d) or a TSO timestamp (as `corral ts` prints).
    #[arg(long)]
    pub since: Option<String>,
    /// Only jobs submitted before this (same forms as --since).
    #[arg(long)]
    pub until: Option<String>,
    /// Only jobs submitted by this user (login name, as Slurm's `squeue --user`).
    #[arg(long, short = 'u', value_name = "USER", conflicts_with = "me")]
    pub user: Option<String>,
    /// Only my jobs: those submitted by the user running this (`squeue --me`).
    #[arg(long)]
    pub me: bool,
    #[command(flatten)]
    pub page: PageArgs,
    /// Print as Slurm's squeue does, in this `-o` format (`%.18i %.8j %L`): what `squeue`
    /// inside a job prints.
    #[arg(long, hide = true, value_name = "FORMAT")]
    pub squeue_format: Option<String>,
    /// With --squeue-format: no header line (`squeue -h`).
    #[arg(long, hide = true, requires = "squeue_format")]
    pub noheader: bool,
    /// With --squeue-format: these jobs, whatever their state (`squeue -j 12,13_4`).
    #[arg(long, hide = true, value_delimiter = ',', requires = "squeue_format", value_name = "JOB")]
    pub jobs: Vec<corral_types::JobRef>,
}

// Paging of a listing. (A plain comment: see `JobFlags`.)
#[derive(Debug, Args)]
pub struct PageArgs {
    /// Print at most N, in id order, and say on stderr (with --output json: in
    /// "next_page_token") how to get the rest. Without it every page is printed.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
    /// Start where an earlier listing with --limit stopped: the token it gave.
    #[arg(long, value_name = "TOKEN")]
    pub page_token: Option<String>,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// Job id (`12`), or a task of a job array (`12_7`).
    pub job: corral_types::JobRef,
    /// Keep printing output until the job ends.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// The part of a gang whose output to print (0 is the first node's, where the gang meets).
    #[arg(long, default_value_t = 0, conflicts_with = "all_ranks")]
    pub rank: u32,
    /// Print the output of every part of a gang, each line prefixed with `[rank N] `.
    #[arg(long)]
    pub all_ranks: bool,
}

pub fn parse_job_state(s: &str) -> Result<corral_types::JobState, String> {
    corral_types::JobState::parse(s.trim()).ok_or_else(|| {
        format!("unknown job state '{s}': expected pending, running, succeeded, failed, cancelled or preempted")
    })
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    corral_types::parse_size(s).map_err(|e| e.to_string())
}

pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    corral_types::parse_duration(s).map_err(|e| e.to_string())
}

/// A duration that must carry its unit (`30s`, `10m`, `1:30`): for options with no Slurm
/// counterpart, where a bare number would be read as seconds by some and minutes by others.
pub fn parse_timeout(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("'{s}' has no unit: write {t}s for seconds or {t}m for minutes"));
    }
    parse_duration(s)
}

pub fn parse_signal(s: &str) -> Result<i32, String> {
    let name = s.trim().trim_start_matches("SIG").to_ascii_uppercase();
    let known = [("HUP", 1), ("INT", 2), ("QUIT", 3), ("USR1", 10), ("USR2", 12), ("TERM", 15), ("CONT", 18)];
    if let Some((_, n)) = known.iter().find(|(k, _)| *k == name) {
        return Ok(*n);
    }
    match name.parse::<i32>() {
        Ok(n) if (1..=64).contains(&n) => Ok(n),
        _ => Err(format!("invalid signal '{s}': expected a name such as USR1 or a number from 1 to 64")),
    }
}

/// A signal, and optionally how long before the time limit it is sent too (`--signal SIG[@DUR]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignalSpec {
    pub signal: i32,
    pub before_end: Option<std::time::Duration>,
}

/// `USR1`, `10`, `USR1@300` (seconds, as Slurm) or `USR1@5m`.
pub fn parse_signal_spec(s: &str) -> Result<SignalSpec, String> {
    let (sig, before) = match s.split_once('@') {
        Some((sig, before)) => (sig, Some(before.trim())),
        None => (s, None),
    };
    let signal = parse_signal(sig)?;
    let before_end = match before {
        None => None,
        Some(b) if !b.is_empty() && b.bytes().all(|c| c.is_ascii_digit()) => {
            Some(std::time::Duration::from_secs(b.parse().map_err(|_| format!("invalid time '{b}' in --signal"))?))
        }
        Some(b) => Some(parse_duration(b).map_err(|e| format!("invalid time in --signal {s}: {e}"))?),
    };
    Ok(SignalSpec { signal, before_end })
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("invalid environment variable '{s}': expected KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn wait_timeout_needs_its_unit() {
        assert_eq!(parse_timeout("30s"), Ok(std::time::Duration::from_secs(30)));
        assert_eq!(parse_timeout("2m"), Ok(std::time::Duration::from_secs(120)));
        let err = parse_timeout("2").unwrap_err();
        assert!(err.contains("2s") && err.contains("2m"), "{err}");
    }

    /// clap checks a command's definition when it builds it; with deferred subcommands a run
    /// builds one, so this builds and checks them all.
    #[test]
    fn every_command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    /// A deferred command's flags are added after its about text: a flattened struct with a
    /// doc comment would replace that text (`JobFlags` and `PageArgs` have plain comments).
    #[test]
    fn building_a_deferred_command_keeps_its_about_text() {
        fn check(command: &clap::Command, path: &str) {
            for sub in command.get_subcommands() {
                let path = format!("{path} {}", sub.get_name());
                let mut built = sub.clone();
                built.build();
                let texts = |c: &clap::Command| {
                    (c.get_about().map(ToString::to_string), c.get_long_about().map(ToString::to_string))
                };
                assert_eq!(texts(&built), texts(sub), "`{path}` changes its about text when built");
                check(&built, &path);
            }
        }
        check(&Cli::command(), "corral");
    }

    #[test]
    fn a_deferred_command_parses_its_flags_and_the_global_ones() {
        let cli = Cli::try_parse_from(["corral", "queue", "--endpoint", "h:1", "--limit", "5", "-o", "json"])
            .expect("parses");
        assert_eq!(cli.global.endpoint, ["h:1"]);
        assert_eq!(cli.global.output, OutputFormat::Json);
        let Command::Queue(args) = cli.command else { panic!("not queue: {:?}", cli.command) };
        assert_eq!(args.page.limit, Some(5));
        let cli =
            Cli::try_parse_from(["corral", "--token", "t", "node", "drain", "n1", "--reason", "r"]).expect("parses");
        assert_eq!(cli.global.token.as_deref(), Some("t"));
        let Command::Node(NodeCommand::Drain { node, reason, .. }) = cli.command else {
            panic!("not node drain: {:?}", cli.command)
        };
        assert_eq!((node.as_str(), reason.as_str()), ("n1", "r"));
    }
}
