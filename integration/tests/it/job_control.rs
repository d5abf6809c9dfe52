//! Slurm-style job control on a real `corral dev`: a job array of 20 with a `%4` throttle never
//! runs more than 4 tasks at once; an afterok chain runs in order and afternotok fires on a
//! failure; hold and release; cancelling one task and a whole array; `corral jobs` collapses an
//! array's pending tasks. The largest legal array (a 1 MiB script, 100 000 tasks, the largest
//! window) on a coordinator alone.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{Cluster, ClusterOptions};
use corral_integration::{one_line_stderr, DevPool};
use corral_types::{
    ArrayRange, ArraySpec, Dependency, DependencyKind, JobSpec, JobState, MAX_ARRAY_TASKS, MAX_ARRAY_WINDOW,
    MAX_SCRIPT_BYTES,
};
use std::time::{Duration, Instant};

fn client(pool: &DevPool) -> (Client, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let client = Client::new(ClientConfig::new(vec![pool.addr.clone()])).expect("client");
    (client, rt)
}

fn sh(script: &str) -> JobSpec {
    JobSpec {
        name: "slurm-test".into(),
        tenant: "default".into(),
        command: vec!["sh".into(), "-c".into(), script.into()].into(),
        ..Default::default()
    }
}

fn submit(rt: &tokio::runtime::Runtime, client: &Client, spec: &JobSpec) -> u64 {
    rt.block_on(client.submit(spec)).expect("submit").job_id
}

#[test]
fn an_array_of_20_with_a_throttle_of_4_never_runs_more_than_4_tasks() {
    let pool = DevPool::start(&["--gpus", "8"]);
    let (client, rt) = client(&pool);
    let dir = tempfile::tempdir().expect("tempdir");
    let lines = dir.path().join("tasks");
    // Each task writes its index and how many tasks run now (counted with marker files).
    let marks = dir.path().join("running");
    std::fs::create_dir(&marks).expect("marks dir");
    let script = format!(
        "touch {m}/$CORRAL_JOB_ID; sleep 0.3; echo \"$CORRAL_JOB_ID $(ls {m} | wc -l)\" >> {l}; rm {m}/$CORRAL_JOB_ID",
        m = marks.display(),
        l = lines.display()
    );
    let mut spec = sh(&script);
    spec.gpus = 1;
    spec.array = Some(ArraySpec { ranges: vec![ArrayRange { first: 0, last: 19, step: 1 }], max_running: Some(4) });
    let array = submit(&rt, &client, &spec);

    // While it runs, the table collapses the pending tasks into one row.
    let table = pool.ok(&["jobs"]);
    assert!(table.contains(&format!("{array}_[")), "{table}");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut most = 0;
    loop {
        let jobs = rt.block_on(client.list_jobs(false, None)).expect("jobs");
        let running = jobs.iter().filter(|j| j.array_task.is_some() && j.state == JobState::Running).count();
        most = most.max(running);
        let done = rt.block_on(client.get_job(array)).expect("array").state.is_terminal();
        if done {
            break;
        }
        assert!(Instant::now() < deadline, "the array did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(most <= 4, "{most} tasks ran at once");
    let text = std::fs::read_to_string(&lines).expect("task lines");
    let all = rt.block_on(client.list_jobs(true, None)).expect("jobs");
    let index_of = |id: u64| all.iter().find(|j| j.id == id).and_then(|j| j.array_task).map(|t| (t.array, t.index));
    let mut indices: Vec<u32> = text
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .map(|id: u64| match index_of(id) {
            Some((a, index)) if a == array => index,
            other => panic!("job {id} is not a task of array {array}: {other:?}"),
        })
        .collect();
    indices.sort_unstable();
    assert_eq!(indices, (0..20).collect::<Vec<_>>(), "every task ran once: {text}");
    for line in text.lines() {
        let running: u32 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(running <= 4, "a task saw {running} tasks running: {text}");
    }
    let shown = pool.json(&["show", &array.to_string()]);
    assert_eq!(shown["state"], "succeeded", "{shown}");
    let task = pool.json(&["show", &format!("{array}_7")]);
    assert_eq!((task["array_job_id"].as_u64(), task["array_task_id"].as_u64()), (Some(array), Some(7)), "{task}");
}

#[test]
fn dependencies_hold_release_and_cancelling_tasks() {
    let pool = DevPool::start(&["--gpus", "4"]);
    let (client, rt) = client(&pool);
    let dir = tempfile::tempdir().expect("tempdir");
    let order = dir.path().join("order");
    let step = |name: &str, code: i32| sh(&format!("echo {name} >> {}; sleep 0.2; exit {code}", order.display()));
    let after = |mut spec: JobSpec, kind, job_id| {
        spec.sched.dependencies = vec![Dependency { kind, job_id }];
        spec
    };
    let a = submit(&rt, &client, &step("a", 0));
    let b = submit(&rt, &client, &after(step("b", 0), DependencyKind::AfterOk, a));
    let c = submit(&rt, &client, &after(step("c", 3), DependencyKind::AfterOk, b));
    let on_failure = submit(&rt, &client, &after(step("rescue", 0), DependencyKind::AfterNotOk, c));
    let never = submit(&rt, &client, &after(step("never", 0), DependencyKind::AfterOk, c));
    let queue = pool.json(&["show", &c.to_string()]);
    assert_eq!(queue["reason"], format!("dependency: waits for job {b}"), "{queue}");
    pool.wait_for(on_failure, "succeeded", |d| d["state"] == "succeeded");
    assert_eq!(std::fs::read_to_string(&order).unwrap(), "a\nb\nc\nrescue\n");
    let never = pool.wait_for(never, "cancelled", |d| d["state"] == "cancelled");
    assert!(never["reason"].as_str().unwrap().contains(&format!("afterok:{c} can never be met")), "{never}");
    // A dependency on an unknown job is refused, nothing submitted.
    let unknown = rt.block_on(client.submit(&after(step("x", 0), DependencyKind::AfterAny, 999)));
    assert!(unknown.unwrap_err().to_string().contains("invalid dependency: job 999 not found"));

    // Hold and release.
    let mut held = step("held", 0);
    held.sched.hold = true;
    let held = submit(&rt, &client, &held);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(pool.show(held)["state"], "pending");
    assert!(pool.show(held)["reason"].as_str().unwrap().starts_with("held"));
    pool.ok(&["release", &held.to_string()]);
    pool.wait_for(held, "succeeded", |d| d["state"] == "succeeded");
    let running = submit(&rt, &client, &sh("sleep 30"));
    pool.wait_for(running, "running", |d| d["state"] == "running");
    let refused = pool.corral(&["hold", &running.to_string()]);
    assert!(one_line_stderr(&refused).contains("only pending jobs can be held"), "{}", one_line_stderr(&refused));
    pool.ok(&["cancel", &running.to_string()]);

    // One task of an array not created yet, then the whole array.
    let mut spec = sh("sleep 30");
    spec.gpus = 1;
    spec.array = Some(ArraySpec { ranges: vec![ArrayRange { first: 1, last: 9, step: 1 }], max_running: Some(2) });
    let array = submit(&rt, &client, &spec);
    pool.ok(&["cancel", &format!("{array}_8")]);
    let missing = pool.corral(&["show", &format!("{array}_8")]);
    assert!(one_line_stderr(&missing).contains("was not created yet"), "{}", one_line_stderr(&missing));
    pool.ok(&["cancel", &array.to_string()]);
    let ended = pool.wait_for(array, "cancelled", |d| d["state"] == "cancelled");
    assert_eq!(ended["array"]["tasks"], 9, "{ended}");
    let jobs = rt.block_on(client.list_jobs(false, None)).expect("jobs");
    assert!(jobs.iter().all(|j| j.array_task.is_none_or(|t| t.array != array)), "no task of the array is left");
    let bad = pool.corral(&["show", "12_x"]);
    assert!(one_line_stderr(&bad).contains("invalid job '12_x'"), "{}", one_line_stderr(&bad));
}

/// `corral cancel --all` with filters cancels exactly the matching live jobs (pending ones at
/// once, running ones after their processes die) and leaves the others; bad combinations of
/// flags are refused before anything is cancelled.
#[test]
fn cancel_all_cancels_exactly_the_matching_jobs() {
    let pool = DevPool::start(&["--gpus", "1"]);
    let (client, rt) = client(&pool);
    // One GPU each on a one-GPU pool: the first runs, the others wait.
    let named =
        |name: &str, tenant: &str| JobSpec { name: name.into(), tenant: tenant.into(), gpus: 1, ..sh("sleep 300") };
    let running = submit(&rt, &client, &named("a", "default"));
    pool.wait_for(running, "running", |j| j["state"] == "running");
    let pending_a: Vec<u64> = (0..2).map(|_| submit(&rt, &client, &named("a", "default"))).collect();
    let other = submit(&rt, &client, &named("b", "default"));
    let team = submit(&rt, &client, &named("a", "team-a"));

    let done = pool.json(&["cancel", "--all", "--name", "a", "--state", "pending", "--tenant", "default"]);
    let mut ids: Vec<u64> = done["job_ids"].as_array().expect("ids").iter().filter_map(|v| v.as_u64()).collect();
    ids.sort_unstable();
    assert_eq!(ids, pending_a, "{done}");
    assert_eq!(pool.show(running)["state"], "running");
    assert_eq!(pool.show(other)["state"], "pending");
    assert_eq!(pool.show(team)["state"], "pending");

    for bad in [
        vec!["cancel", "--all", "12"],
        vec!["cancel", "--tenant", "default"],
        vec!["cancel", "--all", "--state", "succeeded"],
        vec!["cancel"],
    ] {
        let out = pool.corral(&bad);
        assert!(!out.status.success(), "{bad:?} was accepted");
        assert!(!one_line_stderr(&out).is_empty(), "{bad:?} says why");
    }
    assert_eq!(pool.show(other)["state"], "pending", "a refused command cancels nothing");

    let text = pool.ok(&["cancel", "--all", "--tenant", "team-a"]);
    assert!(text.contains("1 jobs cancelled"), "{text}");
    assert_eq!(pool.show(team)["state"], "cancelled");
    let rest = pool.json(&["cancel", "--all"]);
    assert_eq!(rest["cancelled"], 2, "the running job and the last pending one: {rest}");
    pool.wait_for(running, "cancelled", |j| j["state"] == "cancelled");
    assert_eq!(pool.show(other)["state"], "cancelled");
    let again = pool.json(&["cancel", "--all"]);
    assert_eq!(again["cancelled"], 0, "nothing left: {again}");
}

/// The largest legal array through the real binary, on a coordinator without workers (every
/// task stays pending): a script of `MAX_SCRIPT_BYTES`, `MAX_ARRAY_TASKS` indices and the
/// largest window a pool may be configured with. Its window of tasks is created at submit,
/// the last task is answered as not created yet, and cancelling it and then the array reaches
/// every task.
#[test]
fn the_largest_array_is_submitted_shown_and_cancelled() {
    let options = ClusterOptions {
        extra_config: format!("\n[limits]\nmax-array-window = {MAX_ARRAY_WINDOW}\n"),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(1, options);
    cluster.init_and_join_all();
    cluster.leader();
    let script = cluster.dir().join("big.sh");
    let mut text = String::from("#!/bin/sh\n");
    text.push_str(&"#".repeat(MAX_SCRIPT_BYTES - text.len() - "\nexit 0\n".len()));
    text.push_str("\nexit 0\n");
    std::fs::write(&script, &text).expect("script");
    let spec = format!("0-{}%{MAX_ARRAY_WINDOW}", MAX_ARRAY_TASKS - 1);
    let out = cluster.corral_at(0, &["sbatch", "--array", &spec, script.to_str().expect("utf-8")]);
    assert!(out.status.success(), "sbatch: {}", String::from_utf8_lossy(&out.stderr));
    let array: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("job id");
    let status = cluster.status(0).expect("status");
    assert_eq!(status["jobs_in_memory"], u64::from(MAX_ARRAY_WINDOW) + 1, "the array and its window: {status}");
    let task = cluster.json(&["show", &format!("{array}_{}", MAX_ARRAY_WINDOW - 1)]);
    assert_eq!(task["state"], "pending", "{task}");
    let last = format!("{array}_{}", MAX_ARRAY_TASKS - 1);
    let out = cluster.corral_at(0, &["cancel", &last]);
    assert!(out.status.success(), "cancel {last}: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("it will not start"));
    let out = cluster.corral_at(0, &["cancel", &array.to_string()]);
    assert!(out.status.success(), "cancel {array}: {}", String::from_utf8_lossy(&out.stderr));
    cluster.wait_for(array, Duration::from_secs(30), "cancelled", |d| d["state"] == "cancelled");
    assert_eq!(cluster.json(&["show", &format!("{array}_0")])["state"], "cancelled");
    // Asking for more than this pool admits is one line naming the limit.
    let out = cluster.corral_at(0, &["sbatch", "--array", "0-9%10001", script.to_str().expect("utf-8")]);
    assert!(!out.status.success());
    assert!(one_line_stderr(&out).contains("at most 10000 tasks at once"), "{}", one_line_stderr(&out));
}
