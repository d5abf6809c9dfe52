//! A real `corral worker` process with simulated GPUs, for node-loss tests.

use crate::cluster::{Cluster, ClusterOptions};
use crate::{corral_bin, unsafe_kill};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub struct WorkerProc {
    pub name: String,
    pub config: PathBuf,
    pub data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Network namespace the worker runs in, if any.
    namespace: Option<String>,
    /// `--join ADDR --token T` of the next start.
    join: Option<(String, String)>,
}

impl WorkerProc {
    /// Writes a worker config under `dir` (simulated GPUs, fast heartbeats) without starting it.
    /// The data dir is given relative to `dir`, the worker's working directory, as operators
    /// often write it.
    /// Each worker gets its own cgroup root: a starting worker reaps every job cgroup under its
    /// root, so two test workers must never share one.
    pub fn configure(dir: &Path, name: &str, coordinators: &str, gpus: u32) -> WorkerProc {
        let data_dir = dir.join(format!("worker-{name}"));
        let config = dir.join(format!("worker-{name}.toml"));
        let endpoints: Vec<String> = coordinators.split(',').map(|e| format!("\"{e}\"")).collect();
        let text = format!(
            "node-name = \"{name}\"\ncoordinators = [{}]\ndata-dir = \"worker-{name}\"\nlisten = \"127.0.0.1:0\"\n\
             heartbeat-interval = \"200ms\"\nkill-grace = \"1s\"\n\n[gpu]\nbackend = \"simulated\"\n\n\
             [[gpu.devices]]\nmodel = \"RTX 5090\"\nmemory = \"32GiB\"\ncount = {gpus}\n\n\
             [executor]\ncgroup-root = \"corral-it/{name}-{}\"\nrunc = \"\"\n\n[hygiene]\nsettle-time = \"100ms\"\n",
            endpoints.join(", "),
            crate::unique()
        );
        std::fs::write(&config, text).expect("write worker config");
        let log = dir.join(format!("worker-{name}.log"));
        WorkerProc { name: name.to_string(), config, data_dir, log, child: None, namespace: None, join: None }
    }

    /// Runs the worker inside network namespace `namespace` (reached at `addr`), so that a test
    /// can cut it off from every coordinator. Call before `start`.
    pub fn in_namespace(&mut self, namespace: String, addr: &str) {
        // Off loopback, plaintext must be asked for.
        self.edit_config(|config| {
            format!(
                "insecure = true\n{}",
                config.replace("listen = \"127.0.0.1:0\"", &format!("listen = \"{addr}:0\""))
            )
        });
        self.namespace = Some(namespace);
    }

    /// The pid of the worker process, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Rewrites the config file (before `start`), e.g. to declare other devices.
    pub fn edit_config(&self, edit: impl FnOnce(String) -> String) {
        let text = std::fs::read_to_string(&self.config).expect("read worker config");
        std::fs::write(&self.config, edit(text)).expect("write worker config");
    }

    /// Talks mutual TLS with the worker certificate `worker-<name>.pem` of `certs`.
    pub fn use_tls(&self, certs: &Path) {
        self.append_config(&format!(
            "\n[tls]\nca = \"{0}/ca.pem\"\ncert = \"{0}/worker-{1}.pem\"\nkey = \"{0}/worker-{1}-key.pem\"\n",
            certs.display(),
            self.name
        ));
    }

    /// Starts next with `--join addr --token token` (`None`: without them).
    pub fn join_with(&mut self, join: Option<(&str, &str)>) {
        self.join = join.map(|(addr, token)| (addr.to_string(), token.to_string()));
    }

    /// Appends TOML (whole sections, e.g. `[users]`) to the config before `start`.
    pub fn append_config(&self, text: &str) {
        self.edit_config(|config| config + text);
    }

    /// Waits (up to 30 s) until `cluster` lists this worker's node as up.
    pub fn wait_registered(&self, cluster: &crate::cluster::Cluster) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let nodes = cluster.json(&["nodes"]);
            if nodes.as_array().is_some_and(|n| n.iter().any(|n| n["name"] == self.name.as_str() && n["state"] == "up"))
            {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "worker {} never registered: {}", self.name, self.log());
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn start(&mut self) {
        assert!(self.child.is_none(), "worker {} is running", self.name);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("log");
        let cwd = self.config.parent().expect("config dir").to_path_buf();
        let mut command = match &self.namespace {
            // nsenter switches the network namespace only: `ip netns exec` would remount /sys
            // and hide the cgroup hierarchies the worker runs its jobs in.
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/var/run/netns/{ns}")).arg("--").arg(corral_bin());
                c
            }
            None => Command::new(corral_bin()),
        };
        command.current_dir(cwd).args(["worker", "--config"]).arg(&self.config);
        if let Some((addr, token)) = &self.join {
            command.args(["--join", addr, "--token", token]);
        }
        let child = command.stdout(Stdio::null()).stderr(Stdio::from(log)).spawn().expect("spawn worker");
        self.child = Some(child);
    }

    /// SIGKILL: the worker dies without cleaning up its jobs.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends a signal (e.g. SIGSTOP / SIGCONT to freeze and thaw the worker).
    pub fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            unsafe_kill(child.id(), signal);
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            unsafe_kill(child.id(), libc::SIGCONT);
            unsafe_kill(child.id(), libc::SIGTERM);
        }
        if let Some(mut child) = self.child.take() {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A one-coordinator cluster, initialised, and workers `w1` and `w2` (2 simulated GPUs each)
/// offering only `port` to gangs, with a directory every job's user may write in.
pub fn two_node_pool(port: u16) -> (Cluster, Vec<WorkerProc>, tempfile::TempDir) {
    let cluster = Cluster::start(1, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "cluster init: {}", String::from_utf8_lossy(&init.stderr));
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut workers = Vec::new();
    for name in ["w1", "w2"] {
        let mut w = WorkerProc::configure(dir.path(), name, &cluster.endpoints(), 2);
        w.edit_config(|c| format!("rendezvous-ports = \"{port}-{port}\"\n{c}"));
        w.start();
        w.wait_registered(&cluster);
        workers.push(w);
    }
    (cluster, workers, dir)
}

/// A directory `out` under `dir` that every job's user may write in (a job's output files and
/// working directory in the tests).
pub fn out_dir(dir: &tempfile::TempDir) -> PathBuf {
    let out = dir.path().join("out");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    out
}
