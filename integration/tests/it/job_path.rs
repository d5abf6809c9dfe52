//! The whole path of a job on one `corral dev` node: submit, run in a cgroup, logs, exit codes,
//! limits, cancel, waiting for resources, and restart.

use corral_integration::{is_dead, DevPool};
use std::time::Duration;

#[test]
fn failing_job_reports_exit_code_and_logs() {
    let pool = DevPool::start(&[]);
    let job = pool.submit(&["--", "sh", "-c", "echo hi; echo to-stderr >&2; exit 3"]);
    let wait = pool.corral(&["wait", &job.to_string(), "--timeout", "60s"]);
    assert_eq!(wait.status.code(), Some(1), "wait exits 1 for a failed job");
    let doc = pool.show(job);
    assert_eq!(doc["state"], "failed", "{doc}");
    assert_eq!(doc["exit_code"], 3, "{doc}");
    assert_eq!(doc["tenant"], "default");
    assert_eq!(doc["node"], "dev-node");
    let logs = pool.corral(&["logs", &job.to_string()]);
    assert_eq!(String::from_utf8_lossy(&logs.stdout), "hi\n");
    assert_eq!(String::from_utf8_lossy(&logs.stderr), "to-stderr\n");
}

#[test]
fn succeeding_job_sees_its_gpus_and_wait_exits_zero() {
    let pool = DevPool::start(&["--gpus", "4"]);
    let job = pool.submit(&["--gpus", "2", "--", "sh", "-c", "echo cuda=$CUDA_VISIBLE_DEVICES job=$CORRAL_JOB_ID"]);
    let wait = pool.corral(&["wait", &job.to_string(), "--timeout", "60s"]);
    assert_eq!(wait.status.code(), Some(0));
    let doc = pool.show(job);
    assert_eq!(doc["state"], "succeeded");
    let gpus: Vec<u64> = doc["gpus"].as_array().expect("gpus").iter().filter_map(|g| g.as_u64()).collect();
    assert_eq!(gpus.len(), 2);
    let expected = format!("cuda={} job={job}\n", gpus.iter().map(u64::to_string).collect::<Vec<_>>().join(","));
    assert_eq!(pool.ok(&["logs", &job.to_string()]), expected);
}

/// The daemon ignores SIGPIPE (a peer closing a socket must not kill it); its jobs must not
/// inherit that: `producer | head` relies on the producer dying of SIGPIPE.
#[test]
fn jobs_start_with_default_signal_dispositions() {
    let pool = DevPool::start(&[]);
    let job = pool.submit(&["--", "sh", "-c", "grep -E '^Sig(Ign|Blk):' /proc/self/status"]);
    let wait = pool.corral(&["wait", &job.to_string(), "--timeout", "60s"]);
    assert_eq!(wait.status.code(), Some(0));
    let logs = pool.ok(&["logs", &job.to_string()]);
    for line in logs.lines() {
        let (name, mask) = line.split_once(':').expect("Name: mask");
        let mask = u64::from_str_radix(mask.trim(), 16).expect("hex mask");
        let sigpipe = 1u64 << (libc::SIGPIPE - 1);
        assert_eq!(mask & sigpipe, 0, "SIGPIPE is in the job's {name}: {logs}");
    }
    assert_eq!(logs.lines().count(), 2, "{logs}");
}

#[test]
fn memory_hog_is_killed_by_its_cgroup() {
    let pool = DevPool::start(&[]);
    // Holds ~300 MB in a shell variable: far above the 64 MiB limit.
    let hog = "x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo survived";
    let job = pool.submit(&["--mem", "64M", "--", "sh", "-c", hog]);
    let doc = pool.wait_for(job, "finished", |d| d["state"] != "pending" && d["state"] != "running");
    assert_eq!(doc["state"], "failed", "{doc}");
    assert!(doc["reason"].as_str().unwrap_or("").starts_with("oom-killed"), "{doc}");
    assert_eq!(doc["signal"], 9, "{doc}");
    assert!(!pool.ok(&["logs", &job.to_string()]).contains("survived"));
    // The same command with room to spare succeeds: the limit, not the command, killed it.
    let roomy = pool.submit(&["--mem", "2G", "--", "sh", "-c", hog]);
    let doc = pool.wait_for(roomy, "finished", |d| d["state"] != "pending" && d["state"] != "running");
    assert_eq!(doc["state"], "succeeded", "{doc}");
}

#[test]
fn cancel_kills_the_whole_process_tree() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let script = format!(
        "sleep 1000 & echo $! > {d}/a; sleep 1000 & echo $! > {d}/b; echo $$ > {d}/main; wait",
        d = dir.path().display()
    );
    let job = pool.submit(&["--", "sh", "-c", &script]);
    pool.wait_for(job, "running", |d| d["state"] == "running");
    let read_pids = || -> Option<Vec<u32>> {
        ["a", "b", "main"]
            .iter()
            .map(|f| std::fs::read_to_string(dir.path().join(f)).ok()?.trim().parse().ok())
            .collect()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let pids = loop {
        if let Some(p) = read_pids() {
            break p;
        }
        assert!(std::time::Instant::now() < deadline, "job never wrote its pids");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(pids.iter().all(|p| !is_dead(*p)), "all processes run before the cancel");
    pool.ok(&["cancel", &job.to_string()]);
    let doc = pool.wait_for(job, "cancelled", |d| d["state"] == "cancelled");
    assert_eq!(doc["reason"], "cancelled by user");
    for pid in pids {
        assert!(is_dead(pid), "process {pid} of the cancelled job survived");
    }
    // Cancelling again is harmless and says so.
    let again = pool.ok(&["cancel", &job.to_string()]);
    assert!(again.contains("cancelled"), "{again}");
}

#[test]
fn job_that_does_not_fit_waits_for_resources() {
    let pool = DevPool::start(&["--gpus", "2"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("go");
    let blocker = pool.submit(&[
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        &format!("while [ ! -e {} ]; do sleep 0.05; done", gate.display()),
    ]);
    pool.wait_for(blocker, "running", |d| d["state"] == "running");
    let waiter = pool.submit(&["--gpus", "1", "--", "true"]);
    // While the blocker holds both GPUs, the waiter stays pending, and the scheduler says why.
    let doc = pool.wait_for(waiter, "explained", |d| d["reason"].as_str().is_some_and(|r| r.starts_with("resources")));
    assert_eq!(doc["reason"], "resources: needs 1 gpu on one node, at most 0 free on any node", "{doc}");
    for _ in 0..10 {
        let doc = pool.show(waiter);
        assert_eq!(doc["state"], "pending", "{doc}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let queue = pool.json(&["queue"]);
    assert_eq!(queue.as_array().map(Vec::len), Some(2), "{queue}");
    std::fs::write(&gate, b"").expect("open the gate");
    let doc = pool.wait_for(waiter, "succeeded", |d| d["state"] == "succeeded");
    assert_eq!(doc["exit_code"], 0);
    assert_eq!(pool.show(blocker)["state"], "succeeded");
}

#[test]
fn restart_keeps_every_job() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let mut pool = DevPool::start_in(&data, &[]);
    let done = pool.submit(&["--name", "finished-before", "--", "sh", "-c", "echo kept; exit 0"]);
    pool.wait_for(done, "succeeded", |d| d["state"] == "succeeded");
    let long = pool.submit(&["--name", "long", "--", "sleep", "1000"]);
    pool.wait_for(long, "running", |d| d["state"] == "running");
    let before_done = pool.show(done);
    pool.stop();

    let mut pool = DevPool::start_in(&data, &[]);
    let after_done = pool.show(done);
    for key in ["id", "name", "state", "exit_code", "submitted_ts", "finished_ts"] {
        assert_eq!(before_done[key], after_done[key], "{key} changed across restart");
    }
    assert_eq!(pool.ok(&["logs", &done.to_string()]), "kept\n");
    // The job that was running when the pool stopped is requeued and runs again.
    let doc = pool.wait_for(long, "running again", |d| d["state"] == "running" && d["attempts"] == 2);
    assert_eq!(doc["name"], "long");
    let all = pool.json(&["jobs", "--all"]);
    assert_eq!(all.as_array().map(Vec::len), Some(2), "{all}");

    // A crash (SIGKILL) loses nothing either: every acknowledged job is still there.
    let acked = pool.submit(&["--name", "acked-before-crash", "--", "true"]);
    pool.crash();
    let pool = DevPool::start_in(&data, &[]);
    let doc = pool.wait_for(acked, "succeeded", |d| d["state"] == "succeeded");
    assert_eq!(doc["name"], "acked-before-crash");
    assert_eq!(pool.json(&["jobs", "--all"]).as_array().map(Vec::len), Some(3));
}

#[test]
fn logs_follow_streams_until_the_job_ends() {
    let pool = DevPool::start(&[]);
    let job = pool.submit(&["--", "sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.3; done"]);
    let out = pool.corral(&["logs", "-f", &job.to_string()]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "line1\nline2\nline3\n");
    assert_eq!(pool.show(job)["state"], "succeeded", "-f returns only once the job ended");
}

#[test]
fn nodes_report_simulated_gpus() {
    let pool = DevPool::start(&["--gpus", "3", "--gpu-model", "RTX 5090"]);
    let nodes = pool.json(&["nodes"]);
    let nodes = nodes.as_array().expect("array");
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0]["name"], "dev-node");
    assert_eq!(nodes[0]["state"], "up");
    let gpus = nodes[0]["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 3);
    for (i, gpu) in gpus.iter().enumerate() {
        assert_eq!(gpu["index"], i);
        assert_eq!(gpu["model"], "RTX 5090");
        assert_eq!(gpu["memory_mib"], 32768);
        assert_eq!(gpu["state"], "idle");
        assert!(gpu["uuid"].as_str().is_some_and(|u| u.starts_with("GPU-")));
        assert!(gpu["temperature_c"].as_u64().is_some());
    }
}

#[test]
fn high_priority_job_preempts_and_the_victim_is_requeued() {
    let pool = DevPool::start(&["--gpus", "2"]);
    let victim = pool.submit(&["--priority", "preemptible", "--gpus", "2", "--", "sleep", "1000"]);
    pool.wait_for(victim, "running", |d| d["state"] == "running" && d["started_ts"].is_u64());
    let urgent = pool.submit(&["--priority", "gpu-high-priority", "--gpus", "2", "--", "sh", "-c", "echo urgent"]);
    let doc = pool.wait_for(urgent, "succeeded", |d| d["state"] == "succeeded");
    assert_eq!(doc["attempts"], 1);
    assert_eq!(pool.ok(&["logs", &urgent.to_string()]), "urgent\n");
    // The victim went back to the queue (not failed) and runs again once the GPUs are free.
    let doc = pool.wait_for(victim, "running again", |d| d["state"] == "running" && d["attempts"] == 2);
    assert_eq!(doc["priority"], "preemptible");
    // Its first run was billed as preempted.
    let history = pool.json(&["billing", "report"]);
    let rows = history["rows"].as_array().expect("rows");
    assert!(rows.iter().any(|r| r["priority"] == "preemptible" && r["segments"] == 1), "{history}");
    pool.ok(&["cancel", &victim.to_string()]);
}

#[test]
fn mps_slices_share_a_gpu_with_the_assigned_limits() {
    let pool = DevPool::start(&["--gpus", "1"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("go");
    let script = format!(
        "echo $CUDA_VISIBLE_DEVICES $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; \
         while [ ! -e {} ]; do sleep 0.05; done",
        gate.display()
    );
    let a = pool.submit(&["--gpu-slice", "mps:50:8GiB", "--", "sh", "-c", &script]);
    let b = pool.submit(&["--gpu-slice", "mps:50:8GiB", "--", "sh", "-c", &script]);
    // Both halves run at once on the one GPU, each with its share and memory cap.
    for job in [a, b] {
        let doc = pool.wait_for(job, "running", |d| d["state"] == "running" && d["started_ts"].is_u64());
        assert_eq!(doc["gpus"], serde_json::json!([0]), "{doc}");
    }
    // The GPU is fully shared: a 60% share must wait, never over-commit.
    let c = pool.submit(&["--gpu-slice", "mps:60", "--", "true"]);
    let doc = pool.wait_for(c, "explained", |d| d["reason"].as_str().is_some_and(|r| r.starts_with("resources")));
    assert_eq!(doc["state"], "pending", "{doc}");
    std::fs::write(&gate, b"").expect("open the gate");
    for job in [a, b, c] {
        pool.wait_for(job, "succeeded", |d| d["state"] == "succeeded");
    }
    for job in [a, b] {
        assert_eq!(pool.ok(&["logs", &job.to_string()]), "0 50 0=8192M\n");
    }
}
