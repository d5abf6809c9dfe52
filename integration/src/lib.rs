//! Test support for multi-process tests: finds the built `corral` binary, runs `corral dev`
//! pools in temp dirs, and drives the CLI exactly as a user would.

pub mod abuse;
pub mod cluster;
pub mod netns;
pub mod registry;
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
        command: vec!["true".into()].into(),
        ..Default::default()
    }
}

/// Resident memory of process `pid` in KiB (`VmRSS`), if it is alive.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Resident memory of process `pid` in MiB (0 once it is gone).
pub fn rss_mib(pid: u32) -> f64 {
    rss_kib(pid).unwrap_or(0) as f64 / 1024.0
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
        // Cargo runs tests and benches in the package's directory: a relative path is taken
        // from the workspace root, where the README's commands run.
        let bin = PathBuf::from(bin);
        if bin.is_relative() {
            return Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(bin);
        }
        return bin;
    }
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> -> target/<profile>/corral
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    let bin = profile_dir.join("corral");
    assert!(
        bin.exists(),
        "{} not found: `cargo test --workspace` builds it (with the test failpoints); alone: \
         `cargo build -p corral-cli --features corral-coordinator/failpoints`",
        bin.display()
    );
    bin
}

/// A `corral dev` process on a free loopback port with its own data dir.
pub struct DevPool {
    child: Option<Child>,
    pub addr: String,
    /// `host:port` of the metrics listener, when started with [`DevPool::start_with_metrics`].
    pub metrics_addr: Option<String>,
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

    /// Starts a pool that also serves Prometheus metrics on a free loopback port.
    pub fn start_with_metrics(extra: &[&str]) -> DevPool {
        let mut all = vec!["--metrics-addr", "127.0.0.1:0"];
        all.extend(extra);
        let pool = DevPool::start(&all);
        assert!(pool.metrics_addr.is_some(), "corral dev did not say where it serves metrics");
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
        // (is the ready line, address): the metrics line comes before the ready line.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let first_word = |rest: &str| rest.split_whitespace().next().unwrap_or_default().to_string();
                if let Some(rest) = line.strip_prefix("corral dev metrics at http://") {
                    let _ = tx.send((false, first_word(rest).trim_end_matches("/metrics").to_string()));
                } else if let Some(rest) = line.strip_prefix("corral dev ready at ") {
                    let _ = tx.send((true, first_word(rest)));
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut metrics_addr = None;
        let addr = loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((true, addr)) => break addr,
                Ok((false, metrics)) => metrics_addr = Some(metrics),
                Err(_) => {
                    let _ = child.kill();
                    let log = std::fs::read_to_string(&stderr_log).unwrap_or_default();
                    panic!("corral dev did not get ready within 60s; its stderr:\n{log}");
                }
            }
        };
        DevPool { child: Some(child), addr, metrics_addr, data_dir: data_dir.to_path_buf(), _tmp: None, stderr_log }
    }

    /// Takes the pool's temp dir out of the pool, so that it outlives the pool: the caller
    /// decides when its files are deleted.
    pub fn take_dir(&mut self) -> Option<tempfile::TempDir> {
        self._tmp.take()
    }

    /// `GET /metrics` from the pool's metrics listener; panics unless it answers 200.
    pub fn scrape(&self) -> String {
        let addr = self.metrics_addr.as_deref().expect("pool started with metrics");
        let (status, body) = http_get(addr, "/metrics").unwrap_or_else(|e| panic!("scrape {addr}: {e}"));
        assert_eq!(status, 200, "GET /metrics answered {status}: {body}");
        body
    }

    /// Replaces the simulated GPUs' faults file (atomically, as the file's docs ask).
    pub fn write_faults(&self, toml: &str) {
        let path = self.data_dir.join("worker/faults.toml");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, toml).expect("write faults");
        std::fs::rename(&tmp, &path).expect("rename faults");
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

/// A minimal HTTP/1.0 GET on loopback: (status, body).
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

/// The value of the sample of metric `name` (exact name, e.g. `corral_placements_total`) whose
/// labels include every pair of `labels`, in OpenMetrics/Prometheus text `text`.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (label_text, value) = match rest.strip_prefix('{') {
            Some(inner) => {
                let (labels, value) = inner.rsplit_once('}')?;
                (labels, value)
            }
            None if rest.starts_with(' ') => ("", rest),
            None => return None,
        };
        let found = parse_labels(label_text);
        let matches = labels.iter().all(|(k, v)| found.iter().any(|(fk, fv)| fk == k && fv == v));
        let value = value.split_whitespace().next()?;
        matches.then(|| value.parse().ok()).flatten()
    })
}

/// `a="x",b="y"` into pairs (values unescaped).
fn parse_labels(text: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() || chars.next() != Some('"') {
            return pairs;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => {}
                },
                '"' => break,
                c => value.push(c),
            }
        }
        pairs.push((key.trim_start_matches(',').trim().to_string(), value));
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
}

/// Runs the binary without a pool (argument errors, unreachable endpoints).
pub fn corral_raw(args: &[&str]) -> Output {
    Command::new(corral_bin()).args(args).output().expect("run corral")
}

/// Waits for `child` to exit until `deadline`; `None` if it still runs then (it is left running).
pub fn wait_until(child: &mut Child, deadline: Instant) -> Option<std::process::ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().expect("wait for a child") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Longest a CLI command of the harness may run (`output_within`): a command that hangs fails
/// the test that ran it, naming itself, instead of holding the suite until CI's limit.
pub const CLI_PATIENCE: Duration = Duration::from_secs(240);

/// Runs `command` as `Command::output` does (stdout and stderr captured, stdin empty), but
/// kills it after `limit`: its output then ends with a line saying so, and its status is the
/// kill's.
pub fn output_within(mut command: Command, limit: Duration) -> Output {
    use std::io::Read;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let (status, timed_out) = match wait_until(&mut child, Instant::now() + limit) {
        Some(status) => (status, false),
        None => {
            let _ = child.kill();
            (child.wait().expect("wait for a killed command"), true)
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let mut stderr = stderr.join().unwrap_or_default();
    if timed_out {
        stderr
            .extend_from_slice(format!("\n{command:?} did not end within {} s: killed\n", limit.as_secs()).as_bytes());
    }
    Output { status, stdout, stderr }
}

/// stderr as text, asserting it is exactly one line.
pub fn one_line_stderr(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(text.trim_end().lines().count(), 1, "expected a one-line error, got: {text:?}");
    text.trim_end().to_string()
}

/// What every thread of a hung process is doing, for a test's failure message: the kernel's
/// view of each thread (state and wait channel) and, where gdb is installed, their stacks.
pub fn thread_dump(pid: u32) -> String {
    let mut out = format!("threads of pid {pid}:\n");
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.flatten().collect::<Vec<_>>());
    for task in tasks.unwrap_or_default() {
        let path = task.path();
        let read = |name: &str| std::fs::read_to_string(path.join(name)).unwrap_or_default().trim().to_owned();
        let stat = read("stat");
        // The state letter follows the parenthesised command name.
        let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next().unwrap_or('?')).unwrap_or('?');
        out.push_str(&format!(
            "  {} {:<16} state {state} wchan {}\n",
            task.file_name().to_string_lossy(),
            read("comm"),
            read("wchan")
        ));
    }
    let gdb = std::process::Command::new("gdb")
        .args(["-p", &pid.to_string(), "-batch", "-ex", "thread apply all bt 30"])
        .stdin(std::process::Stdio::null())
        .output();
    match gdb {
        Ok(o) if o.status.success() => out.push_str(&String::from_utf8_lossy(&o.stdout)),
        _ => out.push_str("(no gdb: stacks not shown)\n"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_values_are_found_by_name_and_labels() {
        let text = "# TYPE a gauge\na 1\na_total 9\nb{x=\"1\",y=\"a,b\\\"c\"} 2.5\nb{x=\"2\"} 3\n# EOF\n";
        assert_eq!(metric_value(text, "a", &[]), Some(1.0));
        assert_eq!(metric_value(text, "a_total", &[]), Some(9.0));
        assert_eq!(metric_value(text, "b", &[("x", "2")]), Some(3.0));
        assert_eq!(metric_value(text, "b", &[("y", "a,b\"c"), ("x", "1")]), Some(2.5));
        assert_eq!(metric_value(text, "b", &[("x", "3")]), None);
        assert_eq!(metric_value(text, "c", &[]), None);
    }
}
