//! A newcomer's failures say why: a job that failed to launch prints its reason in `corral
//! logs`, `corral wait` and `corral run`; `logs` of a pending job says what it waits for;
//! `--time 0` is no limit (as in Slurm); a unit-less `wait --timeout` and the metrics port
//! given as `--endpoint` are refused with what to do.

use corral_integration::{corral_bin, corral_raw, one_line_stderr, DevPool};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

fn corral_in(dir: &Path, pool: &DevPool, args: &[&str]) -> Output {
    Command::new(corral_bin())
        .current_dir(dir)
        .args(["--endpoint", &pool.addr])
        .args(args)
        .output()
        .expect("run corral")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_failed_launch_says_why_in_logs_wait_and_run() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path();
    std::fs::write(work.join("noexec.sh"), "#!/bin/sh\necho hi\n").expect("write");
    std::fs::write(work.join("noshebang.sh"), "echo hi\n").expect("write");
    std::fs::set_permissions(work.join("noshebang.sh"), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let cases: &[(&[&str], &str)] = &[
        (&["--", "./noexec.sh"], "noexec.sh is not executable (permission denied)"),
        (&["--", "./noshebang.sh"], "it has no #! line"),
        // As in Slurm, a missing output directory fails the job.
        (&["--stdout", "logs/out-%j.txt", "--", "echo", "hi"], "cannot open output file"),
    ];
    for (args, why) in cases {
        let mut submit = vec!["--output", "json", "submit"];
        submit.extend(*args);
        let out = corral_in(work, &pool, &submit);
        assert!(out.status.success(), "submit {args:?}: {}", text(&out.stderr));
        let id = serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("json")["id"].to_string();
        let wait = corral_in(work, &pool, &["wait", &id, "--timeout", "60s"]);
        assert_eq!(wait.status.code(), Some(1), "wait {args:?}: {}", text(&wait.stderr));
        assert!(text(&wait.stdout).contains(why), "wait {args:?}: {why:?} not in {}", text(&wait.stdout));
        let logs = corral_in(work, &pool, &["logs", &id]);
        let said = text(&logs.stderr);
        assert!(said.contains(&format!("job {id} failed")) && said.contains(why), "logs {args:?}: {said}");
        let mut run = vec!["run"];
        run.extend(*args);
        let out = corral_in(work, &pool, &run);
        assert!(!out.status.success(), "run {args:?} succeeded");
        assert!(text(&out.stderr).contains(why), "run {args:?}: {why:?} not in {}", text(&out.stderr));
    }
    assert!(!work.join("logs").exists(), "the job must not create its output directory");
}

#[test]
fn logs_of_a_pending_job_say_what_they_wait_for() {
    let pool = DevPool::start(&[]);
    let id = pool.submit(&["--hold", "--", "echo", "hi"]).to_string();
    let out = pool.corral(&["logs", &id]);
    assert!(out.status.success());
    assert!(out.stdout.is_empty());
    let said = one_line_stderr(&out);
    assert!(said.contains(&format!("job {id} pending: held")) && said.contains("no output yet"), "{said}");
    let endpoint = pool.addr.clone();
    let bin = corral_bin();
    let follow = Command::new("timeout")
        .args(["2"])
        .arg(&bin)
        .args(["--endpoint", &endpoint, "logs", "-f", &id])
        .output()
        .expect("run timeout");
    let said = text(&follow.stderr);
    assert!(said.contains("following its output once it starts"), "{said}");
}

#[test]
fn time_zero_is_no_limit_and_wait_timeouts_carry_their_unit() {
    let pool = DevPool::start_with_metrics(&[]);
    let id = pool.submit(&["--time", "0", "--", "true"]);
    assert!(pool.show(id)["time_limit_secs"].is_null(), "{}", pool.show(id));
    let done = pool.wait_for(id, "succeeded", |j| j["state"] == "succeeded");
    assert!(done["time_limit_secs"].is_null());
    let out = pool.corral(&["wait", &id.to_string(), "--timeout", "2"]);
    assert!(one_line_stderr(&out).contains("'2' has no unit: write 2s for seconds or 2m for minutes"));
    let metrics = pool.metrics_addr.clone().expect("metrics");
    let out = corral_raw(&["--endpoint", &metrics, "jobs"]);
    assert!(!out.status.success());
    let said = one_line_stderr(&out);
    assert!(said.contains("answers HTTP, not corral's gRPC (is it the metrics port?)"), "{said}");
}
