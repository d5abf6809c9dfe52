//! Test support for multi-process tests: finds the built `corral` binary, runs `corral dev`
//! pools in temp dirs, and drives the CLI exactly as a user would.

pub mod cluster;
pub mod netns;
pub mod worker;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The smallest valid job (`true`, tenant `default`, no GPUs), for load and failover tests.
pub fn trivial_job(name: &str) -> corral_types::JobSpec {
    corral_types::JobSpec {
        name: name.to_string(),
        tenant: "default".into(),
        command: vec!["true".into()],
        ..Default::default()
    }
}

/// `--ca/--cert/--key` for the certificate `name` (e.g. "admin", "client-user") of a
/// `corral certs init` directory.
pub fn tls_args(certs: &Path, name: &str) -> Vec<String> {
    vec![
        "--ca".into(),
        certs.join("ca.pem").display().to_string(),
        "--cert".into(),
        certs.join(format!("{name}.pem")).display().to_string(),
        "--key".into(),
        certs.join(format!("{name}-key.pem")).display().to_string(),
    ]
}

/// Path of the `corral` binary: `$CORRAL_BIN`, else `target/<profile>/corral` next to the test binary.
pub fn corral_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("CORRAL_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> -> target/<profile>/corral
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    let bin = profile_dir.join("corral");
    assert!(
        bin.exists(),
        "{} not found: build it with `cargo build -p corral-cli` (cargo test --workspace does)",
        bin.display()
    );
    bin
}

/// A `corral dev` process on a free loopback port with its own data dir.
pub struct DevPool {
    child: Option<Child>,
    pub addr: String,
    pub data_dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    stderr_log: PathBuf,
}

impl DevPool {
    /// Starts a pool with `extra` arguments (e.g. `["--gpus", "2"]`) in a fresh temp dir.
    pub fn start(extra: &[&str]) -> DevPool {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data_dir = tmp.path().join("data");
        let mut pool = DevPool::start_in(&data_dir, extra);
        pool._tmp = Some(tmp);
        pool
    }

    /// Starts a pool on an existing data dir (restart).
    pub fn start_in(data_dir: &Path, extra: &[&str]) -> DevPool {
        let stderr_log = data_dir.with_extension(format!("stderr-{}.log", unique()));
        std::fs::create_dir_all(data_dir).expect("data dir");
        let stderr = std::fs::File::create(&stderr_log).expect("stderr log");
        let mut child = Command::new(corral_bin())
            .arg("dev")
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .expect("spawn corral dev");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("corral dev ready at ") {
                    let addr = rest.split_whitespace().next().unwrap_or_default().to_string();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let log = std::fs::read_to_string(&stderr_log).unwrap_or_default();
                panic!("corral dev did not get ready within 60s; its stderr:\n{log}");
            }
        };
        DevPool { child: Some(child), addr, data_dir: data_dir.to_path_buf(), _tmp: None, stderr_log }
    }

    /// Runs `corral --endpoint <addr> <args>`.
    pub fn corral(&self, args: &[&str]) -> Output {
        Command::new(corral_bin()).args(["--endpoint", &self.addr]).args(args).output().expect("run corral")
    }

    /// Runs a command that must succeed and returns its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.corral(args);
        assert!(
            out.status.success(),
            "corral {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8 stdout")
    }

    /// Runs a command with `--output json` that must succeed and parses its document.
    pub fn json(&self, args: &[&str]) -> Value {
        // Global flags go before the subcommand's `--` (after it they would belong to the job).
        let mut all = vec!["--output", "json"];
        all.extend(args);
        let stdout = self.ok(&all);
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("corral {args:?}: bad json ({e}): {stdout}"))
    }

    /// Submits and returns the job id.
    pub fn submit(&self, args: &[&str]) -> u64 {
        let mut all = vec!["submit"];
        all.extend(args);
        let doc = self.json(&all);
        doc["id"].as_u64().unwrap_or_else(|| panic!("no id in {doc}"))
    }

    pub fn show(&self, job: u64) -> Value {
        self.json(&["show", &job.to_string()])
    }

    /// Polls `corral show` until `pred` holds (bounded).
    pub fn wait_for(&self, job: u64, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let doc = self.show(job);
            if pred(&doc) {
                return doc;
            }
            assert!(Instant::now() < deadline, "job {job} never became {what}: {doc}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the pool with SIGTERM and waits for it (bounded), like an operator's Ctrl-C.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            unsafe_kill(child.id(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.wait();
        }
    }

    /// Kills the pool with SIGKILL (a crash).
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The pool's stderr so far (tracing logs), for failure messages.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }
}

impl Drop for DevPool {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.stderr_log);
    }
}

pub(crate) fn unique() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

pub(crate) fn unsafe_kill(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// True if `pid` no longer runs (gone, or a zombie nobody reaped).
pub fn is_dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) == Some("Z"),
    }
}

/// Runs the binary without a pool (argument errors, unreachable endpoints).
pub fn corral_raw(args: &[&str]) -> Output {
    Command::new(corral_bin()).args(args).output().expect("run corral")
}

/// stderr as text, asserting it is exactly one line.
pub fn one_line_stderr(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(text.trim_end().lines().count(), 1, "expected a one-line error, got: {text:?}");
    text.trim_end().to_string()
}
