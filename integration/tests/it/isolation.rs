//! Jobs of different tenants on one worker cannot reach each other: each runs as its tenant's
//! uid without capabilities and with no_new_privs, in a private 0700 work dir with 0600 logs;
//! a fork bomb stops at the job's pids limit and a memory hog is OOM-killed alone, while the
//! node and other jobs keep running.

use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::corral_bin;
use corral_integration::worker::WorkerProc;
use serde_json::Value;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const PIDS_MAX: u32 = 64;

struct Pool {
    cluster: Cluster,
    worker: WorkerProc,
    _dir: tempfile::TempDir,
}

fn pool() -> Pool {
    let cluster = Cluster::start(1, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let dir = tempfile::tempdir().expect("tempdir");
    // Tenant users must be able to walk to their work dirs under the worker's data dir.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let worker = WorkerProc::configure(dir.path(), "w1", &cluster.endpoints(), 2);
    worker.edit_config(|config| config.replace("runc = \"\"\n", &format!("runc = \"\"\npids-max = {PIDS_MAX}\n")));
    worker
        .append_config("\n[users.tenants]\nteam-a = { uid = 2001, gid = 2001 }\nteam-b = { uid = 2002, gid = 2002 }\n");
    let mut worker = worker;
    worker.start();
    worker.wait_registered(&cluster);
    Pool { cluster, worker, _dir: dir }
}

impl Pool {
    fn submit(&self, tenant: &str, extra: &[&str], script: &str) -> u64 {
        let mut args = vec!["submit", "--tenant", tenant];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", script]);
        self.cluster.json(&args)["id"].as_u64().expect("job id")
    }

    fn wait(&self, job: u64, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let doc = self.cluster.json(&["show", &job.to_string()]);
            if pred(&doc) {
                return doc;
            }
            assert!(Instant::now() < deadline, "job {job} never became {what}: {doc}\n{}", self.worker.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn finished(&self, job: u64) -> Value {
        self.wait(job, "finished", |d| d["state"] != "pending" && d["state"] != "running")
    }

    fn logs(&self, job: u64) -> String {
        let out = Command::new(corral_bin())
            .args(["--endpoint", &self.cluster.endpoints(), "logs", &job.to_string()])
            .output()
            .expect("corral logs");
        assert!(out.status.success(), "logs: {}", String::from_utf8_lossy(&out.stderr));
        // The job's stdout, then its stderr (which `corral logs` writes to stderr).
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    /// Waits until the job's log contains `text`.
    fn wait_log(&self, job: u64, text: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let log = self.logs(job);
            if log.contains(text) {
                return log;
            }
            assert!(Instant::now() < deadline, "job {job} never logged '{text}': {log}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `<worker data>/jobs/<job>/<epoch>` of the job's run.
    fn work_dir(&self, job: u64) -> PathBuf {
        let dir = self.worker.data_dir.join("jobs").join(job.to_string());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(entry) = std::fs::read_dir(&dir).ok().and_then(|mut d| d.next()).and_then(Result::ok) {
                return entry.path();
            }
            assert!(Instant::now() < deadline, "no work dir under {}", dir.display());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn assert_node_up(&self) {
        let nodes = self.cluster.json(&["nodes"]);
        assert!(nodes.as_array().is_some_and(|n| n.iter().any(|n| n["name"] == "w1" && n["state"] == "up")), "{nodes}");
    }
}

#[test]
fn jobs_of_different_tenants_cannot_read_each_others_files() {
    let p = pool();
    let a = p.submit(
        "team-a",
        &[],
        "cd \"$CORRAL_JOB_DIR\"; echo secret-a > secret.txt; echo log-secret-a; id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; sleep 30",
    );
    let log = p.wait_log(a, "NoNewPrivs");
    // Tenant uid, no capabilities at all, no new privileges.
    assert!(log.contains("\n2001\n"), "{log}");
    assert!(log.contains("CapEff:\t0000000000000000") && log.contains("CapBnd:\t0000000000000000"), "{log}");
    assert!(log.contains("NoNewPrivs:\t1"), "{log}");
    let dir = p.work_dir(a);
    let meta = std::fs::metadata(&dir).expect("work dir");
    assert_eq!((meta.mode() & 0o777, meta.uid()), (0o700, 2001), "work dir {}", dir.display());
    let log_meta = std::fs::metadata(dir.join("stdout.log")).expect("stdout.log");
    assert_eq!((log_meta.mode() & 0o777, log_meta.uid()), (0o600, 2001));

    let b = p.submit(
        "team-b",
        &[],
        &format!("cd \"$CORRAL_JOB_DIR\"; id -u; cat ../../{a}/*/secret.txt ../../{a}/*/stdout.log; ls ../../{a}/*/; echo tried"),
    );
    let doc = p.finished(b);
    let log = p.logs(b);
    assert!(log.contains("2002") && log.contains("tried"), "{doc} {log}");
    assert!(!log.contains("secret-a"), "team-b read team-a's files: {log}");
    assert!(log.contains("Permission denied"), "{log}");
    let _ = p.cluster.json(&["cancel", &a.to_string()]);
}

#[test]
fn a_fork_bomb_stops_at_the_pids_limit_and_a_memory_hog_dies_alone() {
    let p = pool();
    let bomb = p.submit(
        "team-a",
        &[],
        "exec perl -e '$|=1; my $n=0; for (1..1000) { my $p=fork(); last unless defined $p; if ($p==0) { sleep 60; exit 0 } $n++ } print \"forked $n\\n\"; sleep 60'",
    );
    let log = p.wait_log(bomb, "forked");
    let forked: u32 = log.trim().trim_start_matches("forked ").parse().expect("count");
    assert!(forked > 0 && forked < PIDS_MAX, "the bomb forked {forked} processes with pids.max {PIDS_MAX}");

    // The node and other jobs carry on: a memory hog next to the bomb is killed alone, and a
    // third job runs to completion.
    let hog = p.submit("team-b", &["--mem", "64M"], "x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo survived");
    let calm = p.submit("team-b", &[], "sleep 1; echo calm");
    let doc = p.finished(hog);
    assert_eq!(doc["state"], "failed", "{doc}");
    assert!(doc["reason"].as_str().unwrap_or("").starts_with("oom-killed"), "{doc}");
    let doc = p.finished(calm);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert!(p.logs(calm).contains("calm"));
    let doc = p.cluster.json(&["show", &bomb.to_string()]);
    assert_eq!(doc["state"], "running", "the bomb itself keeps running within its limit: {doc}");
    p.assert_node_up();
    p.cluster.json(&["cancel", &bomb.to_string()]);
    assert_eq!(p.finished(bomb)["state"], "cancelled");
}
