//! A cluster of real `corral coordinator` processes on loopback, for failover tests.

use crate::{corral_bin, unsafe_kill};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Raft tuning written into each node's config.
#[derive(Clone)]
pub struct ClusterOptions {
    pub snapshot_every: u64,
    pub keep_logs_after_snapshot: u64,
    /// Run node `i` inside network namespace `i + 1` of these hosts instead of on loopback.
    pub hosts: Option<std::sync::Arc<crate::netns::NetHosts>>,
    /// A worker silent for this long is marked down, e.g. "2s".
    pub node_ttl: String,
    /// Extra environment of node `index` (e.g. a failpoint): (index, name, value).
    pub node_env: Vec<(usize, String, String)>,
    /// Mutual TLS from a `corral certs init` directory: node `i` uses `coordinator-<i+1>.pem`,
    /// and the fixture's CLI calls use `admin.pem`.
    pub tls: Option<PathBuf>,
    /// With `tls`: every coordinator gets the CA key (`tls.ca-key`), so workers can join
    /// with a token.
    pub sign_joins: bool,
    /// With `sign_joins`: `tls.worker-cert-lifetime` (e.g. "15s"; absent: the default).
    pub worker_cert_lifetime: Option<String>,
    /// `raft.election-timeout-min` and `-max` in milliseconds.
    pub election_timeout_ms: (u64, u64),
    /// More TOML appended to every node's config (e.g. a `[history]` section).
    pub extra_config: String,
    /// `raft.watch-history`: job changes kept for watch resumes (absent: the default).
    pub watch_history: Option<u64>,
    /// The body of an `[auth]` section (e.g. `require-tokens = true`).
    pub auth: Option<String>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            snapshot_every: 20_000,
            keep_logs_after_snapshot: 1_000,
            hosts: None,
            node_ttl: "10s".into(),
            node_env: Vec::new(),
            tls: None,
            sign_joins: false,
            worker_cert_lifetime: None,
            election_timeout_ms: (250, 500),
            extra_config: String::new(),
            watch_history: None,
            auth: None,
        }
    }
}

/// One coordinator process and its fixed address, kept across restarts.
pub struct CoordinatorProc {
    pub node_id: u64,
    pub addr: String,
    pub config: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

impl CoordinatorProc {
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

/// Coordinators in a temp dir; not a cluster until `init_and_join_all`.
pub struct Cluster {
    pub nodes: Vec<CoordinatorProc>,
    dir: tempfile::TempDir,
    options: ClusterOptions,
}

/// A free loopback port (bound then released; the kernel does not hand it out again soon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

impl Cluster {
    /// Starts `n` empty coordinators (ids 1..=n).
    pub fn start(n: u64, options: ClusterOptions) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cluster = Cluster { nodes: Vec::new(), dir, options };
        for id in 1..=n {
            cluster.add_node(id);
        }
        cluster
    }

    /// Writes the config of node `id` and starts it.
    pub fn add_node(&mut self, id: u64) -> usize {
        // Per process, not per id: a later node may reuse an id (to prove it is refused).
        let slot = self.nodes.len();
        let addr = match &self.options.hosts {
            Some(hosts) => format!("{}:7070", hosts.addr(slot + 1)),
            None => format!("127.0.0.1:{}", free_port()),
        };
        let config = self.dir.path().join(format!("coordinator-{slot}.toml"));
        let data = self.dir.path().join(format!("data-{slot}"));
        let text = format!(
            "node-id = {id}\nlisten = \"{addr}\"\ndata-dir = \"{}\"\n\n[raft]\nheartbeat-interval = \"50ms\"\n\
             election-timeout-min = \"{}ms\"\nelection-timeout-max = \"{}ms\"\nsnapshot-every = {}\n\
             keep-logs-after-snapshot = {}\n\n[scheduler]\nnode-ttl = \"{}\"\n",
            data.display(),
            self.options.election_timeout_ms.0,
            self.options.election_timeout_ms.1,
            self.options.snapshot_every,
            self.options.keep_logs_after_snapshot,
            self.options.node_ttl
        );
        let mut text = text;
        if let Some(n) = self.options.watch_history {
            text = text.replace("\n\n[scheduler]", &format!("\nwatch-history = {n}\n\n[scheduler]"));
        }
        if let Some(auth) = &self.options.auth {
            text.push_str(&format!("\n[auth]\n{auth}\n"));
        }
        if let Some(certs) = &self.options.tls {
            let n = slot + 1;
            text.push_str(&format!(
                "\n[tls]\nca = \"{0}/ca.pem\"\ncert = \"{0}/coordinator-{n}.pem\"\nkey = \"{0}/coordinator-{n}-key.pem\"\n",
                certs.display()
            ));
            if self.options.sign_joins {
                text.push_str(&format!("ca-key = \"{}/ca-key.pem\"\n", certs.display()));
            }
            if let Some(lifetime) = &self.options.worker_cert_lifetime {
                text.push_str(&format!("worker-cert-lifetime = \"{lifetime}\"\n"));
            }
        } else if self.options.hosts.is_some() {
            // Namespaced hosts are off loopback: plaintext must be asked for.
            text = format!("insecure = true\n{text}");
        }
        text.push_str(&self.options.extra_config);
        std::fs::write(&config, text).expect("write config");
        let log = self.dir.path().join(format!("coordinator-{slot}.log"));
        self.nodes.push(CoordinatorProc { node_id: id, addr, config, child: None, log });
        let index = self.nodes.len() - 1;
        self.restart(index);
        index
    }

    /// (Re)starts node `index` with its config and waits until it answers.
    pub fn restart(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        assert!(node.child.is_none(), "node {} is running", node.node_id);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&node.log).expect("log");
        let mut command = match &self.options.hosts {
            Some(hosts) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &hosts.namespace(index + 1)]).arg(corral_bin());
                c
            }
            None => Command::new(corral_bin()),
        };
        for (_, name, value) in self.options.node_env.iter().filter(|(i, _, _)| *i == index) {
            command.env(name, value);
        }
        let child = command
            .args(["coordinator", "--config"])
            .arg(&node.config)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn coordinator");
        node.child = Some(child);
        let addr = node.addr.clone();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(Instant::now() < deadline, "coordinator at {addr} did not start: {}", self.log_of(index));
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.nodes[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends a signal to node `index` (e.g. SIGSTOP / SIGCONT to freeze and thaw it).
    pub fn signal(&self, index: usize, signal: i32) {
        if let Some(child) = &self.nodes[index].child {
            unsafe_kill(child.id(), signal);
        }
    }

    /// SIGTERM and wait: an orderly stop.
    pub fn stop(&mut self, index: usize) {
        if let Some(mut child) = self.nodes[index].child.take() {
            unsafe_kill(child.id(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log_of(&self, index: usize) -> String {
        std::fs::read_to_string(&self.nodes[index].log).unwrap_or_default()
    }

    /// Comma-separated addresses of every node.
    pub fn endpoints(&self) -> String {
        self.nodes.iter().map(|n| n.addr.as_str()).collect::<Vec<_>>().join(",")
    }

    /// `--ca/--cert/--key` of the admin certificate when the cluster runs TLS.
    pub fn admin_tls_args(&self) -> Vec<String> {
        match &self.options.tls {
            Some(certs) => crate::tls_args(certs, "admin"),
            None => Vec::new(),
        }
    }

    /// Data directory of node `index` (holds `audit.jsonl`).
    pub fn data_dir(&self, index: usize) -> PathBuf {
        self.dir.path().join(format!("data-{index}"))
    }

    pub fn corral_at(&self, index: usize, args: &[&str]) -> Output {
        let mut command = Command::new(corral_bin());
        command.args(self.admin_tls_args()).args(["--endpoint", &self.nodes[index].addr]).args(args);
        crate::output_within(command, crate::CLI_PATIENCE)
    }

    /// Runs a CLI command against all endpoints, which must succeed; returns the JSON output.
    pub fn json(&self, args: &[&str]) -> Value {
        let mut command = Command::new(corral_bin());
        command.args(self.admin_tls_args()).args(["--endpoint", &self.endpoints(), "--output", "json"]).args(args);
        let out = crate::output_within(command, crate::CLI_PATIENCE);
        assert!(out.status.success(), "corral {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("json")
    }

    /// `corral show JOB` as JSON.
    pub fn show(&self, job: u64) -> Value {
        self.json(&["show", &job.to_string()])
    }

    /// Polls `show` until `pred` holds, for at most `within`; panics naming `what` otherwise.
    pub fn wait_for(&self, job: u64, within: Duration, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let doc = self.show(job);
            if pred(&doc) {
                return doc;
            }
            assert!(Instant::now() < deadline, "job {job} never became {what} within {within:?}: {doc}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `cluster status` of node `index`, if it answers.
    pub fn status(&self, index: usize) -> Option<Value> {
        self.status_of(index, &[])
    }

    /// `cluster status` of node `index` with the digest of its state machine.
    pub fn status_with_digest(&self, index: usize) -> Option<Value> {
        self.status_of(index, &["--digest"])
    }

    fn status_of(&self, index: usize, extra: &[&str]) -> Option<Value> {
        let mut args = vec!["--output", "json", "cluster", "status"];
        args.extend(extra);
        let out = self.corral_at(index, &args);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
    }

    /// Initializes node 0 and joins every other running node.
    pub fn init_and_join_all(&self) {
        let out = self.corral_at(0, &["cluster", "init"]);
        assert!(out.status.success(), "init: {}", String::from_utf8_lossy(&out.stderr));
        for node in &self.nodes[1..] {
            let out = self.corral_at(0, &["cluster", "join", &node.addr]);
            assert!(out.status.success(), "join {}: {}", node.addr, String::from_utf8_lossy(&out.stderr));
        }
    }

    /// Index of the node that a majority of running nodes name as leader, waiting for one.
    pub fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            for (i, node) in self.nodes.iter().enumerate() {
                if !node.is_running() {
                    continue;
                }
                if let Some(s) = self.status(i) {
                    if s["state"] == "leader" {
                        return i;
                    }
                }
            }
            assert!(Instant::now() < deadline, "no leader within 30s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every running node reports the same digest at the same applied index, one at
    /// least as high as the highest applied index of the first look (so everything
    /// acknowledged before the call is in it). A leader writes every second or so (it extends
    /// its timestamp window) and a digest of a large state takes a while: two nodes are rarely
    /// seen at the same index in one round, so every round's digests are kept, by node and
    /// index, and the nodes are asked at once.
    pub fn wait_converged(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen: BTreeMap<u64, BTreeMap<u64, String>> = BTreeMap::new();
        let mut floor = None;
        loop {
            let running: Vec<usize> = (0..self.nodes.len()).filter(|i| self.nodes[*i].is_running()).collect();
            let statuses: Vec<Value> = std::thread::scope(|scope| {
                let asked: Vec<_> = running.iter().map(|&i| scope.spawn(move || self.status_with_digest(i))).collect();
                asked.into_iter().filter_map(|h| h.join().ok().flatten()).collect()
            });
            if statuses.len() == running.len() {
                for s in &statuses {
                    if let (Some(id), Some(applied), Some(digest)) =
                        (s["node_id"].as_u64(), s["applied_index"].as_u64(), s["state_digest"].as_str())
                    {
                        seen.entry(id).or_default().insert(applied, digest.to_string());
                    }
                }
                let floor =
                    *floor.get_or_insert_with(|| statuses.iter().filter_map(|s| s["applied_index"].as_u64()).max());
                let ids: Vec<u64> = statuses.iter().filter_map(|s| s["node_id"].as_u64()).collect();
                let first = ids.first().and_then(|id| seen.get(id));
                let common =
                    first.into_iter().flat_map(|m| m.range(floor.unwrap_or(0)..).rev()).find(|(index, digest)| {
                        ids.iter().all(|id| seen.get(id).and_then(|m| m.get(*index)) == Some(*digest))
                    });
                if let Some((_, digest)) = common {
                    return digest.clone();
                }
            }
            if Instant::now() >= deadline {
                let silent: Vec<String> = (0..self.nodes.len())
                    .filter(|i| self.nodes[*i].is_running() && self.status(*i).is_none())
                    .map(|i| {
                        let log = self.log_of(i);
                        let tail: Vec<&str> = log.lines().rev().take(30).collect();
                        let pid = self.nodes[i].child.as_ref().map(Child::id).unwrap_or(0);
                        format!(
                            "node {} does not answer; its log ends:\n{}\n{}",
                            self.nodes[i].node_id,
                            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
                            crate::thread_dump(pid)
                        )
                    })
                    .collect();
                // Their logs say why one stopped following.
                let behind: Vec<String> = statuses
                    .iter()
                    .filter_map(|s| s["node_id"].as_u64())
                    .filter_map(|id| self.nodes.iter().position(|n| n.node_id == id))
                    .map(|i| {
                        let log = self.log_of(i);
                        let tail: Vec<&str> = log.lines().rev().take(40).collect();
                        let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
                        format!("node {}'s log ends:\n{tail}", self.nodes[i].node_id)
                    })
                    .collect();
                panic!(
                    "nodes did not converge: {statuses:?}\ndigests seen (node: index -> digest): {seen:?}\n{}\n{}",
                    silent.join("\n"),
                    behind.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Process id of node `index` while it runs.
    pub fn pid(&self, index: usize) -> Option<u32> {
        self.nodes[index].child.as_ref().map(Child::id)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}
