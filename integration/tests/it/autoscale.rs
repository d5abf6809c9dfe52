//! Elastic capacity on real processes (Slurm's power saving): a node declared in the
//! coordinator's `[autoscale]` section is off until a job waits that only it can take; the
//! resume program (here a script that starts a simulated worker) powers it on, the job runs,
//! and after `suspend-after` without a job the suspend program (a script that stops the
//! worker) powers it off again, and it is resumed for the next job. A node whose worker never
//! registers within `resume-timeout` is marked failed and not tried again until an operator
//! resumes it.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::corral_bin;
use corral_integration::worker::WorkerProc;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The pool's directory, and the workers the resume script started: killed when the test ends.
struct Power {
    dir: tempfile::TempDir,
}

impl Drop for Power {
    fn drop(&mut self) {
        for entry in std::fs::read_dir(self.dir.path()).into_iter().flatten().flatten() {
            if entry.path().extension().is_some_and(|e| e == "pid") {
                if let Some(pid) = std::fs::read_to_string(entry.path()).ok().and_then(|p| p.trim().parse::<i32>().ok())
                {
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }
}

impl Power {
    fn log(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("power.log"))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }
}

fn script(path: &Path, body: &str) -> PathBuf {
    std::fs::write(path, format!("#!/bin/sh\n{body}")).expect("write script");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path.to_path_buf()
}

/// One coordinator with an `[autoscale]` section declaring `declared` (TOML of
/// `[[autoscale.nodes]]`), a resume script that starts the worker of each node that has a
/// config in the directory, and a suspend script that stops it.
fn setup(declared: &str, suspend_after: &str, resume_timeout: &str) -> (Cluster, Power) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let d = dir.path().display().to_string();
    let bin = corral_bin().display().to_string();
    // As a site's scripts would: one line per node in a log, the worker started in the
    // background with its output to a file of its own.
    let resume = script(
        &dir.path().join("resume.sh"),
        &format!(
            "for n in $CORRAL_NODES; do\n  echo \"resume $n ($1)\" >> {d}/power.log\n  \
             [ -f {d}/worker-$n.toml ] || continue\n  \
             cd {d} && {bin} worker --config worker-$n.toml >> {d}/worker-$n.log 2>&1 < /dev/null &\n  \
             echo $! > {d}/$n.pid\ndone\n"
        ),
    );
    let suspend = script(
        &dir.path().join("suspend.sh"),
        &format!(
            "for n in $CORRAL_NODES; do\n  echo \"suspend $n\" >> {d}/power.log\n  kill $(cat {d}/$n.pid)\ndone\n"
        ),
    );
    let extra_config = format!(
        "\n[autoscale]\nresume-program = \"{}\"\nsuspend-program = \"{}\"\nsuspend-after = \"{suspend_after}\"\n\
         resume-timeout = \"{resume_timeout}\"\n{declared}",
        resume.display(),
        suspend.display()
    );
    let cluster = Cluster::start(1, ClusterOptions { node_ttl: "2s".into(), extra_config, ..Default::default() });
    cluster.init_and_join_all();
    (cluster, Power { dir })
}

fn node(cluster: &Cluster, name: &str) -> Value {
    let nodes = cluster.json(&["nodes"]);
    nodes.as_array().and_then(|n| n.iter().find(|n| n["name"] == name)).cloned().unwrap_or(Value::Null)
}

fn wait_node(cluster: &Cluster, name: &str, within: Duration, state: &str) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let shown = node(cluster, name);
        if shown["state"] == state {
            return shown;
        }
        assert!(Instant::now() < deadline, "node {name} not {state} within {within:?}: {shown}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn wait_log(power: &Power, within: Duration, lines: usize) -> Vec<String> {
    let deadline = Instant::now() + within;
    loop {
        let log = power.log();
        if log.len() >= lines {
            return log;
        }
        assert!(Instant::now() < deadline, "not {lines} power actions within {within:?}: {log:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Submits a one-GPU job and follows it to its end; whether it was seen waiting for the
/// node's resume.
fn run_job(cluster: &Cluster) -> bool {
    let id = cluster.json(&["submit", "--gpus", "1", "--", "echo", "hi"])["id"].as_u64().expect("job id");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut saw_reason = false;
    loop {
        let job = cluster.show(id);
        saw_reason |= job["reason"].as_str().is_some_and(|r| r.contains("autoscale: waiting for w1 to resume"));
        if job["state"] == "succeeded" {
            return saw_reason;
        }
        assert!(Instant::now() < deadline, "job {id} did not succeed: {job}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const W1: &str =
    "[[autoscale.nodes]]\nnames = \"w1\"\ngpus = 2\ngpu-model = \"RTX 5090\"\ncpus = 1\nmemory = \"1GiB\"\n";

#[test]
fn a_declared_node_is_resumed_for_waiting_work_and_suspended_when_idle() {
    let (cluster, power) = setup(W1, "3s", "60s");
    let _worker = WorkerProc::configure(power.dir.path(), "w1", &cluster.endpoints(), 2);
    // Declared, never started: off, and the state knows what it offers.
    let off = wait_node(&cluster, "w1", Duration::from_secs(10), "off");
    assert_eq!(off["gpus"].as_array().map(Vec::len), Some(2), "{off}");
    assert!(power.log().is_empty(), "nothing waits: nothing resumed: {:?}", power.log());

    // A job waits: the node is resumed for it, the job says so while it waits, and runs.
    assert!(run_job(&cluster), "the job said it waits for the resume");
    assert_eq!(power.log(), ["resume w1 (w1)"]);
    assert_eq!(node(&cluster, "w1")["state"], "up");

    // Idle for suspend-after: suspended, and off once its worker is gone.
    let log = wait_log(&power, Duration::from_secs(30), 2);
    assert_eq!(log, ["resume w1 (w1)", "suspend w1"]);
    let off = wait_node(&cluster, "w1", Duration::from_secs(20), "off");
    assert!(off["reason"].as_str().is_some_and(|r| r.contains("autoscale")), "{off}");

    // The next job powers it on again.
    run_job(&cluster);
    let log = power.log();
    assert_eq!(&log[..3], ["resume w1 (w1)", "suspend w1", "resume w1 (w1)"]);
    assert_eq!(log.iter().filter(|l| l.starts_with("resume")).count(), 2, "one resume per need: {log:?}");
}

#[test]
fn a_resume_that_times_out_fails_the_node_until_an_operator_resumes_it() {
    // w9's host never comes up: the script finds no worker config for it.
    let declared = W1.replace("w1", "w9");
    let (cluster, power) = setup(&declared, "1m", "2s");
    wait_node(&cluster, "w9", Duration::from_secs(10), "off");
    let id = cluster.json(&["submit", "--gpus", "1", "--", "true"])["id"].as_u64().expect("job id");
    wait_log(&power, Duration::from_secs(20), 1);
    let failed = wait_node(&cluster, "w9", Duration::from_secs(20), "resume-failed");
    assert!(failed["reason"].as_str().is_some_and(|r| r.contains("not registered within 2s")), "{failed}");
    // Not tried again while it is marked: the job waits.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(power.log(), ["resume w9 (w9)"]);
    assert_eq!(cluster.show(id)["state"], "pending");
    let table = String::from_utf8_lossy(&cluster.corral_at(0, &["nodes", "--output", "table"]).stdout).to_string();
    assert!(table.contains("resume-failed"), "{table}");

    // The operator resumes it: tried once more.
    let out = cluster.corral_at(0, &["node", "resume", "w9"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = wait_log(&power, Duration::from_secs(20), 2);
    assert_eq!(log, ["resume w9 (w9)", "resume w9 (w9)"]);
    let out = cluster.corral_at(0, &["cancel", &id.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_bad_autoscale_section_stops_the_coordinator_with_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("c.toml");
    let text = format!(
        "node-id = 1\nlisten = \"127.0.0.1:1\"\ndata-dir = \"{}\"\n[autoscale]\nresume-program = \"resume.sh\"\n{W1}",
        dir.path().join("data").display()
    );
    std::fs::write(&config, text).expect("write");
    let out = std::process::Command::new(corral_bin())
        .args(["coordinator", "--config"])
        .arg(&config)
        .output()
        .expect("run coordinator");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("autoscale.resume-program: 'resume.sh' is not an absolute path"), "{err}");
}
