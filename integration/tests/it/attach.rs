//! `corral attach` on real processes (a coordinator and two workers): a command attached to a
//! running job runs inside the job's cgroup (the same `/proc/self/cgroup` as the job's own
//! process), in its working directory (it sees the job's files), as the job's user, on the node
//! `--node` names; stdin is piped through; alloc's status is the command's; a job that does not
//! run is refused with one line.

use corral_integration::cluster::{free_port, Cluster};
use corral_integration::worker::WorkerProc;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn pool() -> (Cluster, Vec<WorkerProc>, tempfile::TempDir) {
    corral_integration::worker::two_node_pool(free_port())
}

/// `corral attach ARGS` with `stdin` as its input.
fn attach(cluster: &Cluster, args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(corral_integration::corral_bin())
        .args(cluster.admin_tls_args())
        .args(["--endpoint", &cluster.endpoints(), "attach"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("corral attach");
    child.stdin.take().expect("stdin").write_all(stdin).expect("write stdin");
    child.wait_with_output().expect("corral attach")
}

fn read_when_there(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) if text.ends_with('\n') => return text,
            _ => assert!(Instant::now() < deadline, "{} never appeared", path.display()),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn attach_runs_inside_the_jobs_cgroup_and_directory_on_the_node_it_names() {
    let (cluster, _workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    // Each node's part writes its own cgroup into a file of the job's directory, then holds.
    let script = "cat /proc/self/cgroup > cgroup-$CORRAL_NODE; echo $CORRAL_NODE > marker-$CORRAL_NODE; exec sleep 600";
    let submitted = cluster.json(&[
        "submit",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "-D",
        &out.display().to_string(),
        "--",
        "sh",
        "-c",
        script,
    ]);
    let job = submitted["id"].as_u64().expect("job id");
    cluster.wait_for(job, Duration::from_secs(60), "running", |d| d["state"] == "running");
    let first_cgroup = read_when_there(&out.join("cgroup-w1"));
    let second_cgroup = read_when_there(&out.join("cgroup-w2"));

    let id = job.to_string();
    let seen = attach(&cluster, &[&id, "--", "sh", "-c", "cat marker-w1; pwd; cat /proc/self/cgroup"], b"");
    let stdout = String::from_utf8_lossy(&seen.stdout);
    assert!(seen.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&seen.stderr));
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("w1"), "the job's file, from its working directory: {stdout}");
    assert_eq!(lines.next(), Some(out.display().to_string().as_str()), "{stdout}");
    let cgroup: String = lines.map(|l| format!("{l}\n")).collect();
    assert_eq!(cgroup, first_cgroup, "the job's cgroup on its first node");

    let second =
        attach(&cluster, &[&id, "--node", "1", "--", "sh", "-c", "echo $CORRAL_NODE; cat /proc/self/cgroup"], b"");
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert_eq!(stdout, format!("w2\n{second_cgroup}"), "--node 1: {}", String::from_utf8_lossy(&second.stderr));
    let by_name = attach(&cluster, &[&id, "--node", "w2", "--", "sh", "-c", "echo $CORRAL_NODE"], b"");
    assert_eq!(String::from_utf8_lossy(&by_name.stdout), "w2\n");

    // Piped stdin, stderr apart, and the command's status.
    let piped = attach(&cluster, &[&id, "--", "sh", "-c", "cat; echo oops >&2; exit 7"], b"through the pipe\n");
    assert_eq!(String::from_utf8_lossy(&piped.stdout), "through the pipe\n");
    assert_eq!(String::from_utf8_lossy(&piped.stderr), "oops\n");
    assert_eq!(piped.status.code(), Some(7));

    // A node the job does not have, and a job that no longer runs: one line each.
    let nowhere = attach(&cluster, &[&id, "--node", "5", "--", "true"], b"");
    assert_eq!(nowhere.status.code(), Some(1));
    let err = corral_integration::one_line_stderr(&nowhere);
    assert!(err.contains("has no node '5'") && err.contains("w1,w2"), "{err}");
    let cancelled = cluster.corral_at(0, &["cancel", &id]);
    assert!(cancelled.status.success());
    cluster.wait_for(job, Duration::from_secs(30), "cancelled", |d| d["state"] == "cancelled");
    let ended = attach(&cluster, &[&id, "--", "true"], b"");
    let err = corral_integration::one_line_stderr(&ended);
    assert!(err.contains("attach reaches the processes of a running job"), "{err}");
}
