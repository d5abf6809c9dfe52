//! Tests of the process executor and of running jobs. They use real cgroups and processes, so
//! they need root (the worker's CI runs as root). Each test has its own cgroup root so they can
//! run in parallel.

use super::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Instant;

use cgroup::JobCgroup;
use nix::sys::signal::Signal;

const DEADLINE: Duration = Duration::from_secs(30);

type Fixture = testing::Fixture<ProcessExecutor>;

impl Fixture {
    /// A process executor under a cgroup root of its own, running job 7, attempt 0.
    fn new() -> Self {
        let executor = ProcessExecutor::new(testing::unique_cgroup_root("corral-test")).expect("valid root");
        Fixture::with(executor, tempfile::tempdir().expect("tempdir"), None, 7, 0)
    }
}

/// Polls until the job's cgroup holds `n` processes.
async fn wait_for_pids(job: &RunningJob, n: usize) -> Vec<u32> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let pids = job.pids().expect("pids");
        if pids.len() == n {
            return pids;
        }
        assert!(Instant::now() < deadline, "expected {n} processes, have {pids:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Gone, or a zombie nobody reaps yet (orphans are reparented to init): either way not running.
fn is_dead(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => {
            let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
            matches!(state.and_then(|s| s.chars().next()), Some('Z' | 'X'))
        }
    }
}

fn assert_cgroup_removed(dirs: &[PathBuf]) {
    for dir in dirs {
        assert!(!dir.exists(), "{} still exists", dir.display());
    }
}

#[tokio::test]
async fn exit_code_and_log_files() {
    let fx = Fixture::new();
    let spec = fx.spec(&["sh", "-c", "echo hi; echo err >&2; exit 3"]);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let dirs = job.cgroup_dirs();
    assert!(dirs.iter().all(|d| d.ends_with("job-7-0")), "{dirs:?}");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(3));
    assert_eq!(exit.signal, None);
    assert!(!exit.oom_killed);
    assert!(!exit.success());
    assert_eq!(fx.log(STDOUT_LOG), "hi\n");
    assert_eq!(fx.log(STDERR_LOG), "err\n");
    assert_cgroup_removed(&dirs);
    // A second wait returns the same result.
    assert_eq!(job.wait().await, exit);
}

#[tokio::test]
async fn logs_append_across_attempts() {
    let fx = Fixture::new();
    for attempt in 0..2 {
        let mut spec = fx.spec(&["echo", "run"]);
        spec.attempt = attempt;
        let mut job = fx.executor.launch(&spec).expect("launch");
        assert!(fx.wait_bounded(&mut job, DEADLINE).await.success());
    }
    assert_eq!(fx.log(STDOUT_LOG), "run\nrun\n");
}

#[tokio::test]
async fn process_joins_the_cgroup_before_exec() {
    let fx = Fixture::new();
    // cat is the main process itself: what it prints is where it was when it started.
    let spec = fx.spec(&["cat", "/proc/self/cgroup"]);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(0));
    let wanted = format!("/{}", fx.executor.job_cgroup_name(7, 0));
    let out = fx.log(STDOUT_LOG);
    let lines: Vec<&str> = out.lines().collect();
    match fx.executor.cgroup_version() {
        CgroupVersion::V2 => assert!(lines.contains(&format!("0::{wanted}").as_str()), "{out}"),
        CgroupVersion::V1 => {
            for controller in ["memory", "pids", "freezer"] {
                assert!(
                    lines.iter().any(|l| {
                        let mut parts = l.splitn(3, ':');
                        let _id = parts.next();
                        let names = parts.next().unwrap_or("");
                        let path = parts.next().unwrap_or("");
                        names.split(',').any(|n| n == controller) && path == wanted
                    }),
                    "{controller} not in {wanted}: {out}"
                );
            }
        }
    }
}

#[tokio::test]
async fn environment_cwd_and_identity() {
    let fx = Fixture::new();
    let mut spec = fx.spec(&[
        "sh",
        "-c",
        "pwd; echo \"$HOME\"; echo \"$LANG\"; echo \"$CORRAL_X\"; echo \"${CARGO_PKG_NAME-unset}\"; id -u; id -g; id -G; touch owned",
    ]);
    spec.env.insert("CORRAL_X".to_owned(), "42".to_owned());
    spec.uid = Some(65534);
    spec.gid = Some(65534);
    // Let the unprivileged job reach its work dir.
    fs::set_permissions(fx.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let mut job = fx.executor.launch(&spec).expect("launch");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(0), "stderr: {}", fx.log(STDERR_LOG));
    let work_dir = spec.work_dir.display().to_string();
    let expected = format!("{work_dir}\n{work_dir}\nC\n42\nunset\n65534\n65534\n65534\n");
    assert_eq!(fx.log(STDOUT_LOG), expected);
    use std::os::unix::fs::MetadataExt;
    let owned = fs::metadata(spec.work_dir.join("owned")).expect("file made by the job");
    assert_eq!((owned.uid(), owned.gid()), (65534, 65534));
}

#[tokio::test]
async fn memory_hog_is_oom_killed() {
    let fx = Fixture::new();
    // dash keeps the whole command substitution (200 MB) in its own heap, so the main
    // process itself is the biggest one and the OOM killer's victim.
    let mut spec = fx.spec(&["sh", "-c", "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived ${#x}"]);
    spec.limits.memory_bytes = Some(64 * 1024 * 1024);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let dirs = job.cgroup_dirs();
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert!(exit.oom_killed, "{exit:?}");
    assert_eq!(exit.signal, Some(libc::SIGKILL), "{exit:?}");
    assert_eq!(exit.exit_code, None);
    assert_eq!(fx.log(STDOUT_LOG), "");
    assert_cgroup_removed(&dirs);
}

#[tokio::test]
async fn small_job_under_memory_limit_is_not_oom_killed() {
    let fx = Fixture::new();
    let mut spec = fx.spec(&["sh", "-c", "x=$(head -c 1000000 /dev/zero | tr '\\0' a); echo ${#x}"]);
    spec.limits.memory_bytes = Some(64 * 1024 * 1024);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert!(exit.success(), "{exit:?}");
    assert_eq!(fx.log(STDOUT_LOG), "1000000\n");
}

#[tokio::test]
async fn kill_tree_kills_every_process_and_removes_the_cgroup() {
    let fx = Fixture::new();
    let spec = fx.spec(&["sh", "-c", "sleep 1000 & sleep 1000 & wait"]);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let pids = wait_for_pids(&job, 3).await;
    assert!(pids.contains(&job.pid()));
    let dirs = job.cgroup_dirs();
    let handle = job.handle();
    let waiter = tokio::spawn(async move { fx.wait_bounded(&mut job, DEADLINE).await });
    handle.kill_tree().expect("kill_tree");
    let exit = waiter.await.expect("wait task");
    assert_eq!(exit.signal, Some(libc::SIGKILL), "{exit:?}");
    assert!(!exit.oom_killed);
    for pid in pids {
        assert!(is_dead(pid), "pid {pid} survived");
    }
    assert_cgroup_removed(&dirs);
    // Killing a finished job is a no-op.
    handle.kill_tree().expect("kill_tree after exit");
    handle.signal_tree(Signal::SIGTERM).expect("signal_tree after exit");
}

#[tokio::test]
async fn reap_leftovers_kills_jobs_of_a_dead_worker() {
    let fx = Fixture::new();
    let spec = fx.spec(&["sh", "-c", "sleep 1000 & sleep 1000 & wait"]);
    let job = fx.executor.launch(&spec).expect("launch");
    let pids = wait_for_pids(&job, 3).await;
    let dirs = job.cgroup_dirs();
    // A worker killed with SIGKILL never runs its clean-up: forget the job like it would.
    std::mem::forget(job);
    let next_worker = ProcessExecutor::new(fx.executor.cgroup_root()).expect("same root");
    let reaped = next_worker.reap_leftovers().expect("reap");
    assert_eq!(reaped, vec![fx.executor.job_cgroup_name(7, 0)]);
    let deadline = Instant::now() + DEADLINE;
    while !pids.iter().all(|pid| is_dead(*pid)) {
        assert!(Instant::now() < deadline, "some of {pids:?} survived the reaping");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_cgroup_removed(&dirs);
    assert!(next_worker.reap_leftovers().expect("reap again").is_empty());
}

#[tokio::test]
async fn kill_tree_reaches_processes_that_left_the_session() {
    let fx = Fixture::new();
    // setsid puts the grandchild in its own session: a process-group kill would miss it.
    let spec = fx.spec(&["sh", "-c", "setsid sleep 1000 & wait"]);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let pids = wait_for_pids(&job, 2).await;
    job.kill_tree().expect("kill_tree");
    // kill_tree alone must do it: check before wait() gets a chance to kill leftovers.
    let deadline = Instant::now() + DEADLINE;
    while !pids.iter().all(|pid| is_dead(*pid)) {
        assert!(Instant::now() < deadline, "some of {pids:?} survived kill_tree");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.signal, Some(libc::SIGKILL));
}

#[tokio::test]
async fn wait_kills_leftovers_of_an_exited_main_process() {
    let fx = Fixture::new();
    let spec = fx.spec(&["sh", "-c", "sleep 1000 & echo $!"]);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let dirs = job.cgroup_dirs();
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(0));
    let orphan: u32 = fx.log(STDOUT_LOG).trim().parse().expect("pid");
    assert!(is_dead(orphan), "orphan {orphan} survived");
    assert_cgroup_removed(&dirs);
}

#[tokio::test]
async fn signal_tree_delivers_sigterm() {
    let fx = Fixture::new();
    let spec = fx.spec(&["sh", "-c", "trap 'exit 7' TERM; sleep 1000 & wait"]);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let pids = wait_for_pids(&job, 2).await;
    job.signal_tree(Signal::SIGTERM).expect("signal_tree");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(7), "{exit:?}");
    for pid in pids {
        assert!(is_dead(pid), "pid {pid} survived");
    }
}

/// A checkpoint signal reaches each process once: the process group and the cgroup pass do not
/// both deliver it (a second copy ran the job's handler twice). The job sleeps inside its
/// handler so that a second copy would run it again before it exits; a child in a process
/// group of its own, only reachable through the cgroup, gets it too.
#[tokio::test]
async fn a_signal_reaches_every_process_of_the_job_once() {
    let fx = Fixture::new();
    let script = "trap 'echo handled; sleep 0.3; exit 0' USR1; \
                  setsid sh -c 'trap \"echo child; exit 0\" USR1; sleep 1000 & wait' & sleep 1000 & wait";
    let spec = fx.spec(&["sh", "-c", script]);
    let mut job = fx.executor.launch(&spec).expect("launch");
    wait_for_pids(&job, 4).await;
    job.signal_tree(Signal::SIGUSR1).expect("signal_tree");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(0), "{exit:?}");
    let log = fx.log(STDOUT_LOG);
    assert_eq!(log.lines().filter(|l| *l == "handled").count(), 1, "{log}");
    assert_eq!(log.lines().filter(|l| *l == "child").count(), 1, "{log}");
}

#[tokio::test]
async fn pids_limit_stops_forks() {
    let fx = Fixture::new();
    let mut spec =
        fx.spec(&["sh", "-c", "i=0; while [ $i -lt 20 ]; do sleep 1000 & i=$((i+1)); done; echo all started; wait"]);
    spec.limits.pids_max = Some(5);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_ne!(exit.exit_code, Some(0), "{exit:?}");
    assert!(fx.log(STDERR_LOG).contains("fork"), "{}", fx.log(STDERR_LOG));
    assert_eq!(fx.log(STDOUT_LOG), "");
}

#[tokio::test]
async fn cpu_limit_sets_the_cfs_quota() {
    let fx = Fixture::new();
    let mut spec = fx.spec(&["sleep", "1000"]);
    spec.limits.cpu_millis = Some(250);
    let mut job = fx.executor.launch(&spec).expect("launch");
    let read = |dir: &Path, file: &str| -> Option<String> {
        fs::read_to_string(dir.join(file)).ok().map(|s| s.trim().to_owned())
    };
    let dirs = job.cgroup_dirs();
    let quota: Vec<String> = match fx.executor.cgroup_version() {
        CgroupVersion::V2 => dirs.iter().filter_map(|d| read(d, "cpu.max")).collect(),
        CgroupVersion::V1 => dirs
            .iter()
            .filter_map(|d| Some(format!("{} {}", read(d, "cpu.cfs_quota_us")?, read(d, "cpu.cfs_period_us")?)))
            .collect(),
    };
    job.kill_tree().expect("kill_tree");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(quota, vec!["25000 100000".to_owned()]);
    assert_eq!(exit.signal, Some(libc::SIGKILL));
}

#[tokio::test]
async fn open_files_limit_is_applied() {
    let fx = Fixture::new();
    let mut spec = fx.spec(&["sh", "-c", "ulimit -n"]);
    spec.limits.open_files = Some(321);
    let mut job = fx.executor.launch(&spec).expect("launch");
    assert!(fx.wait_bounded(&mut job, DEADLINE).await.success());
    assert_eq!(fx.log(STDOUT_LOG), "321\n");
}

#[tokio::test]
async fn a_process_executor_refuses_images() {
    let fx = Fixture::new();
    let mut spec = fx.spec(&["true"]);
    spec.image = Some(PathBuf::from("/srv/images/busybox"));
    let err = fx.executor.launch(&spec).map(|_| ()).expect_err("image");
    assert!(matches!(err, ExecError::NoContainerRuntime(_)), "{err}");
    assert!(err.to_string().contains("/srv/images/busybox"), "{err}");
}

#[tokio::test]
async fn a_busy_cgroup_is_not_reused() {
    let fx = Fixture::new();
    let spec = fx.spec(&["sleep", "1000"]);
    let mut first = fx.executor.launch(&spec).expect("launch");
    wait_for_pids(&first, 1).await;
    let second = fx.executor.launch(&spec);
    assert!(matches!(second, Err(ExecError::CgroupBusy { .. })), "{second:?}");
    first.kill_tree().expect("kill_tree");
    fx.wait_bounded(&mut first, DEADLINE).await;
}

#[tokio::test]
async fn dropping_an_unwaited_job_kills_it() {
    let fx = Fixture::new();
    let job = fx.executor.launch(&fx.spec(&["sleep", "1000"])).expect("launch");
    let pid = job.pid();
    let dirs = job.cgroup_dirs();
    drop(job);
    let deadline = Instant::now() + DEADLINE;
    while !(is_dead(pid) && dirs.iter().all(|d| !d.exists())) {
        assert!(Instant::now() < deadline, "dropped job {pid} or its cgroup survived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn bad_specs_are_refused_without_leaving_a_cgroup() {
    let fx = Fixture::new();
    let missing = fx.spec(&["no-such-program-corral"]);
    let err = fx.executor.launch(&missing).map(|_| ()).expect_err("missing program");
    assert!(matches!(err, ExecError::ProgramNotFound { .. }), "{err}");
    assert!(err.to_string().starts_with("program \"no-such-program-corral\" not found"));

    let empty = fx.spec(&[]);
    assert!(matches!(fx.executor.launch(&empty), Err(ExecError::InvalidSpec(_))));

    let mut relative = fx.spec(&["true"]);
    relative.work_dir = PathBuf::from("relative/dir");
    assert!(matches!(fx.executor.launch(&relative), Err(ExecError::InvalidSpec(_))));

    let file = fx.dir.path().join("file");
    fs::write(&file, "").expect("write");
    let mut under_file = fx.spec(&["true"]);
    under_file.work_dir = file.join("job");
    assert!(matches!(fx.executor.launch(&under_file), Err(ExecError::WorkDir { .. })));

    let name = fx.executor.job_cgroup_name(7, 0);
    let job = JobCgroup::load_for_tests(fx.executor.cgroup_version(), &name);
    assert!(!job.exists(), "a refused launch left cgroup {name}");

    assert!(matches!(ProcessExecutor::new("../escape"), Err(ExecError::InvalidCgroupRoot(_))));
    assert!(matches!(ProcessExecutor::new("/abs"), Err(ExecError::InvalidCgroupRoot(_))));
}

#[tokio::test]
async fn a_failed_exec_names_the_step_and_leaves_no_cgroup() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.dir.path().join("job")).expect("work dir");
    let bogus = fx.dir.path().join("job").join("bogus");
    fs::write(&bogus, [0x7f, b'E', b'L', b'F', 0, 1, 2, 3]).expect("write");
    fs::set_permissions(&bogus, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let err = fx.executor.launch(&fx.spec(&["./bogus"])).map(|_| ()).expect_err("not a program");
    let message = format!("{err}: {}", std::error::Error::source(&err).map(|s| s.to_string()).unwrap_or_default());
    assert!(message.contains("cannot exec the program"), "{message}");
    let name = fx.executor.job_cgroup_name(7, 0);
    let job = JobCgroup::load_for_tests(fx.executor.cgroup_version(), &name);
    assert!(!job.exists(), "a failed exec left cgroup {name}");
}

#[tokio::test]
async fn a_script_without_its_shebang_line_is_named_so() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.dir.path().join("job")).expect("work dir");
    let script = fx.dir.path().join("job").join("noshebang.sh");
    fs::write(&script, "echo hi\n").expect("write");
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let err = fx.executor.launch(&fx.spec(&["./noshebang.sh"])).map(|_| ()).expect_err("no #! line");
    assert!(matches!(err, ExecError::NoShebang { .. }), "{err}");
    assert!(err.to_string().contains("no #! line"), "{err}");
}

#[tokio::test]
async fn jobs_start_with_default_signals_and_the_worker_keeps_its_identity() {
    let fx = Fixture::new();
    // The worker ignores SIGPIPE (as every Rust program does): the job must not inherit it.
    let mut spec = fx.spec(&["grep", "-E", "^(SigBlk|SigIgn|Uid)", "/proc/self/status"]);
    spec.uid = Some(65534);
    spec.gid = Some(65534);
    fs::set_permissions(fx.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let mut job = fx.executor.launch(&spec).expect("launch");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(0), "stderr: {}", fx.log(STDERR_LOG));
    let status = fx.log(STDOUT_LOG);
    assert!(status.contains("SigBlk:\t0000000000000000"), "{status}");
    assert!(status.contains("SigIgn:\t0000000000000000"), "{status}");
    assert!(status.contains("Uid:\t65534"), "{status}");
    // The child switched its uid with raw system calls: no thread of this process changed.
    let me = fs::read_dir("/proc/self/task").expect("tasks");
    for task in me.flatten() {
        let status = fs::read_to_string(task.path().join("status")).unwrap_or_default();
        if let Some(uid) = status.lines().find(|l| l.starts_with("Uid:")) {
            assert!(uid.split_whitespace().skip(1).all(|id| id == "0"), "thread {:?}: {uid}", task.file_name());
        }
    }
}

#[tokio::test]
async fn batch_script_runs_in_its_working_directory_and_writes_output_files() {
    let fx = Fixture::new();
    let cwd = fx.dir.path().join("exp");
    fs::create_dir_all(&cwd).expect("mkdir");
    fs::write(cwd.join("input.txt"), "data\n").expect("write");
    let mut spec = fx.spec(&[]);
    let script_path = spec.work_dir.join(SCRIPT_FILE).display().to_string();
    spec.argv = vec![script_path, "arg1".into()];
    spec.files = JobFiles {
        cwd: Some(cwd.clone()),
        script: Some("#!/bin/sh\ncat input.txt; echo \"got $1 in $(pwd)\"; echo oops >&2\n".into()),
        stdout: Some(cwd.join("out.txt")),
        stderr: Some(cwd.join("out.txt")),
        truncate: true,
    };
    let mut job = fx.executor.launch(&spec).expect("launch");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert_eq!(exit.exit_code, Some(0));
    let expected = format!("data\ngot arg1 in {}\n", cwd.display());
    assert_eq!(fx.log(STDOUT_LOG), expected, "corral logs still sees the output");
    assert_eq!(fx.log(STDERR_LOG), "oops\n");
    let both = fs::read_to_string(cwd.join("out.txt")).expect("output file");
    assert!(both.contains("got arg1") && both.contains("oops"), "{both}");
    let mode = fs::metadata(spec.work_dir.join(SCRIPT_FILE)).expect("script").permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
}

#[tokio::test]
async fn relative_program_resolves_against_the_working_directory() {
    let fx = Fixture::new();
    let cwd = fx.dir.path().join("exp");
    fs::create_dir_all(&cwd).expect("mkdir");
    let script = cwd.join("train.sh");
    fs::write(&script, "#!/bin/sh\necho trained\n").expect("write");
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut spec = fx.spec(&["./train.sh"]);
    spec.files.cwd = Some(cwd);
    let worker_dir = std::env::current_dir().expect("cwd");
    let mut job = fx.executor.launch(&spec).expect("launch");
    assert_eq!(std::env::current_dir().expect("cwd"), worker_dir, "checking the job's directory moved the worker's");
    assert_eq!(fx.wait_bounded(&mut job, DEADLINE).await.exit_code, Some(0));
    assert_eq!(fx.log(STDOUT_LOG), "trained\n");
}

#[tokio::test]
async fn a_missing_working_directory_fails_the_launch_naming_it() {
    let fx = Fixture::new();
    let mut spec = fx.spec(&["true"]);
    spec.files.cwd = Some(PathBuf::from("/nonexistent/corral/exp"));
    let err = fx.executor.launch(&spec).expect_err("no such directory");
    assert_eq!(err.to_string(), "working directory /nonexistent/corral/exp does not exist");
}

/// A path under a directory only root may enter: the launch of a job of another user says the
/// same whether it exists or not, for a working directory and for a program alike, so a
/// tenant cannot probe the worker's file system through `--chdir` or its command.
#[tokio::test]
async fn a_job_cannot_tell_a_missing_root_only_path_from_an_existing_one() {
    if !testing::root_for("a_job_cannot_tell_a_missing_root_only_path_from_an_existing_one") {
        return;
    }
    let fx = Fixture::new();
    fs::set_permissions(fx.dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let secret = fx.dir.path().join("root-only");
    fs::create_dir_all(secret.join("exists")).expect("mkdir");
    let tool = secret.join("tool");
    fs::write(&tool, "#!/bin/sh\necho ran\n").expect("write");
    fs::set_permissions(&tool, fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o700)).expect("chmod");
    let refusal = |cwd: Option<PathBuf>, program: &Path| {
        let mut spec = fx.spec(&[program.to_str().expect("utf-8")]);
        spec.uid = Some(65534);
        spec.gid = Some(65534);
        spec.files.cwd = cwd;
        fx.executor.launch(&spec).expect_err("refused").to_string()
    };
    let true_bin = Path::new("/bin/true");
    let exists = refusal(Some(secret.join("exists")), true_bin);
    let missing = refusal(Some(secret.join("missing")), true_bin);
    assert!(exists.contains("is not accessible to the job's user (uid 65534)"), "{exists}");
    assert_eq!(exists.replace("exists", "X"), missing.replace("missing", "X"));
    let present = refusal(None, &tool);
    let absent = refusal(None, &secret.join("none"));
    assert!(present.contains("not found"), "{present}");
    assert_eq!(present.replace("tool", "X"), absent.replace("none", "X"));
}

#[tokio::test]
async fn a_working_directory_the_user_cannot_enter_fails_the_launch() {
    if !testing::root_for("a_working_directory_the_user_cannot_enter_fails_the_launch") {
        return;
    }
    let fx = Fixture::new();
    let cwd = fx.dir.path().join("private");
    fs::create_dir_all(&cwd).expect("mkdir");
    fs::set_permissions(&cwd, fs::Permissions::from_mode(0o700)).expect("chmod");
    let mut spec = fx.spec(&["true"]);
    // The job dir's parents must be enterable by the job's user.
    fs::set_permissions(fx.dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    spec.uid = Some(65534);
    spec.gid = Some(65534);
    spec.files.cwd = Some(cwd.clone());
    let err = fx.executor.launch(&spec).expect_err("not accessible");
    assert_eq!(
        err.to_string(),
        format!(
            "working directory {} is not accessible to the job's user (uid 65534): permission denied",
            cwd.display()
        )
    );
}

/// A worker stopped between deciding to launch and the exec (a SIGSTOP, a stall) may have lost
/// its lease, and the leader given the run to another node: the child checks the lease's end
/// right before exec, and a launch past it starts nothing (and leaves no cgroup behind).
#[tokio::test]
async fn a_launch_past_the_leases_end_starts_nothing() {
    let fx = Fixture::new();
    let marker = fx.dir.path().join("ran");
    let script = format!("touch {}", marker.display());
    let mut spec = fx.spec(&["sh", "-c", &script]);
    spec.not_after = Some(Instant::now());
    let err = fx.executor.launch(&spec).expect_err("the lease ended before the exec");
    assert!(matches!(err, ExecError::LeaseEnded), "{err:?}");
    assert_eq!(err.to_string(), LEASE_ENDED);
    assert!(!marker.exists(), "the job ran");
    let cgroup = JobCgroup::load_for_tests(fx.executor.cgroup_version(), &fx.executor.job_cgroup_name(7, 0));
    assert!(!cgroup.exists(), "the job's cgroup is left behind: {:?}", cgroup.dirs());

    // Within the lease, the same launch runs.
    spec.attempt = 1;
    spec.not_after = Some(Instant::now() + Duration::from_secs(60));
    let mut job = fx.executor.launch(&spec).expect("launch within the lease");
    let exit = fx.wait_bounded(&mut job, DEADLINE).await;
    assert!(exit.success(), "{exit:?}");
    assert!(marker.exists(), "the job ran");
}
