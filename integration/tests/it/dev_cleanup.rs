//! `corral dev` and `corral worker` leave no cgroup behind: a worker's cgroup root (one per data
//! dir) goes when it exits.

use corral_integration::DevPool;
use std::path::PathBuf;

/// The cgroup directory of the job's root (the parent of its job cgroup), from the job's own
/// `/proc/self/cgroup`: the memory hierarchy under cgroup v1, the unified one under v2.
fn root_dir(proc_cgroup: &str) -> Option<PathBuf> {
    let job_path = |line: &str| line.rsplit_once(':').map(|(_, p)| p.to_string()).filter(|p| p.contains("/job-"));
    let (mount, path) =
        match proc_cgroup.lines().find(|l| l.split(':').nth(1).is_some_and(|c| c.split(',').any(|c| c == "memory"))) {
            Some(line) => ("/sys/fs/cgroup/memory", job_path(line)?),
            None => ("/sys/fs/cgroup", job_path(proc_cgroup.lines().find(|l| l.starts_with("0::"))?)?),
        };
    let root = path.rsplit_once('/')?.0.to_string();
    Some(PathBuf::from(format!("{mount}{root}")))
}

#[test]
fn dev_removes_its_cgroup_root_on_exit() {
    let mut pool = DevPool::start(&[]);
    let id = pool.submit(&["--", "cat", "/proc/self/cgroup"]);
    pool.wait_for(id, "succeeded", |j| j["state"] == "succeeded");
    let text = pool.ok(&["logs", &id.to_string()]);
    let Some(root) = root_dir(&text) else {
        assert!(std::env::var_os("CI").is_none(), "no job cgroup in the job's /proc/self/cgroup: {text}");
        eprintln!("SKIPPED dev_removes_its_cgroup_root_on_exit: no job cgroup found in {text}");
        return;
    };
    assert!(root.is_dir(), "{} should exist while the pool runs", root.display());
    pool.stop();
    assert!(!root.exists(), "corral dev left {} behind", root.display());
}

/// A `corral worker` stopped with SIGTERM removes its cgroup root too, as `corral dev` does:
/// every stop of a worker would otherwise leave one behind.
#[test]
fn a_stopped_worker_removes_its_cgroup_root() {
    let (cluster, mut workers, _dir) =
        corral_integration::worker::two_node_pool(corral_integration::cluster::free_port());
    let out = cluster.corral_at(0, &["submit", "--", "cat", "/proc/self/cgroup"]);
    assert!(out.status.success(), "{}", corral_integration::one_line_stderr(&out));
    let id: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("a job id");
    let job = cluster.wait_for(id, std::time::Duration::from_secs(60), "succeeded", |j| j["state"] == "succeeded");
    let node = job["node"].as_str().expect("the job's node").to_string();
    let logs = cluster.corral_at(0, &["logs", &id.to_string()]);
    let text = String::from_utf8_lossy(&logs.stdout).to_string();
    let Some(root) = root_dir(&text) else {
        assert!(std::env::var_os("CI").is_none(), "no job cgroup in the job's /proc/self/cgroup: {text}");
        eprintln!("SKIPPED a_stopped_worker_removes_its_cgroup_root: no job cgroup found in {text}");
        return;
    };
    assert!(root.is_dir(), "{} should exist while the worker runs", root.display());
    let ran_it = workers.iter().position(|w| w.name == node).expect("the job's worker");
    drop(workers.remove(ran_it)); // SIGTERM, then waits for the exit
    assert!(!root.exists(), "the stopped worker left {} behind", root.display());
}
