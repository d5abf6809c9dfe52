//! Interactive sessions on real processes (a coordinator and two workers): `corral alloc` waits
//! for its allocation, runs its command here with the allocation's environment so that `srun`
//! in it runs steps on the allocation's nodes, relinquishes the allocation when the command
//! exits and exits with its status; an alloc killed outright still has its allocation
//! relinquished (its guard); `srun --pty` in a session gets a terminal on the first node.

use corral_integration::cluster::{free_port, Cluster};
use corral_integration::worker::WorkerProc;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

/// A coordinator and workers w1 and w2 (2 simulated GPUs each).
fn pool() -> (Cluster, Vec<WorkerProc>, tempfile::TempDir) {
    corral_integration::worker::two_node_pool(free_port())
}

fn alloc(cluster: &Cluster) -> Command {
    let mut command = Command::new(corral_integration::corral_bin());
    command.args(cluster.admin_tls_args()).args(["--endpoint", &cluster.endpoints(), "alloc"]);
    command
}

/// The one job of the pool, once it runs.
fn running_job(cluster: &Cluster, within: Duration) -> u64 {
    let deadline = Instant::now() + within;
    loop {
        let jobs = cluster.json(&["jobs"]);
        let running = jobs.as_array().and_then(|a| a.iter().find(|j| j["state"] == "running").cloned());
        if let Some(job) = running {
            return job["id"].as_u64().expect("job id");
        }
        assert!(Instant::now() < deadline, "no job ran within {within:?}: {jobs}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn alloc_runs_steps_on_its_allocation_and_relinquishes_it() {
    let (cluster, _workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let output = alloc(&cluster)
        .args(["-N", "2", "--ntasks-per-node", "1", "-D", &out.display().to_string(), "--"])
        .args(["sh", "-c", "echo nodes=$SLURM_JOB_NODELIST; srun -l sh -c 'echo task $SLURMD_NODENAME $SLURM_JOB_ID'; echo srun=$?; exit 3"])
        .output()
        .expect("corral alloc");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "alloc exits with its command's status: {stdout}\n{stderr}");
    let granted = stderr.lines().find_map(|l| l.strip_prefix("salloc: Granted job allocation "));
    let job: u64 = granted.and_then(|j| j.trim().parse().ok()).unwrap_or_else(|| panic!("no grant: {stderr}"));
    assert!(stdout.contains("nodes=w[1-2]"), "the allocation's node list: {stdout}");
    assert!(stdout.contains(&format!("0: task w1 {job}")), "task 0 on the first node: {stdout}\n{stderr}");
    assert!(stdout.contains(&format!("1: task w2 {job}")), "task 1 on the second node: {stdout}\n{stderr}");
    assert!(stdout.contains("srun=0"), "{stdout}");
    assert!(stderr.contains(&format!("salloc: Relinquishing job allocation {job}")), "{stderr}");
    let done = cluster.wait_for(job, Duration::from_secs(30), "relinquished", |d| d["state"] == "cancelled");
    let step = done["steps"].as_array().and_then(|s| s.iter().find(|s| s["id"] == format!("{job}.0")).cloned());
    let step = step.unwrap_or_else(|| panic!("the session's srun made step {job}.0: {done}"));
    assert_eq!((step["state"].as_str(), step["nodes"].as_str()), (Some("completed"), Some("w[1-2]")), "{done}");
}

#[test]
fn a_killed_alloc_still_relinquishes_its_allocation() {
    let (cluster, _workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let mut child = alloc(&cluster)
        .args(["-D", &out.display().to_string(), "--", "sleep", "600"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("corral alloc");
    let job = running_job(&cluster, Duration::from_secs(60));
    // Give alloc the moment between the grant and its shell.
    std::thread::sleep(Duration::from_secs(1));
    // alloc and its command die at once, as when their terminal's process group is killed.
    let group = i32::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) on the process group of the child this test started.
    unsafe { libc::kill(-group, libc::SIGKILL) };
    let _ = child.wait();
    let done =
        cluster.wait_for(job, Duration::from_secs(30), "relinquished by the guard", |d| d["state"] == "cancelled");
    assert_eq!(done["state"], "cancelled");
}

/// `srun --pty` in a session runs its command on the allocation's first node with a terminal
/// of its own (here under `script`, which gives the session one), in the job's directory.
#[test]
fn srun_pty_in_a_session_gets_a_terminal_on_the_first_node() {
    let (cluster, _workers, dir) = pool();
    let out = corral_integration::worker::out_dir(&dir);
    let mut words: Vec<String> = vec![corral_integration::corral_bin().display().to_string()];
    words.extend(cluster.admin_tls_args());
    words.extend(["--endpoint".into(), cluster.endpoints(), "alloc".into(), "-N".into(), "2".into()]);
    words.extend(["-D".into(), out.display().to_string(), "--".into(), "srun".into(), "--pty".into()]);
    words.extend(["sh".into(), "-c".into(), "tty; echo node=$SLURMD_NODENAME cwd=$(pwd); exit 5".into()]);
    let line: Vec<String> = words.iter().map(|w| format!("'{}'", w.replace('\'', "'\\''"))).collect();
    let output = Command::new("script").args(["-qec", &line.join(" "), "/dev/null"]).output().expect("script");
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(5), "srun's status is the command's, and alloc's srun's: {text}");
    assert!(text.contains("/dev/pts/"), "the command has a terminal: {text}");
    assert!(
        text.contains(&format!("node=w1 cwd={}", out.display())),
        "on the first node, in the job's directory: {text}"
    );
}
