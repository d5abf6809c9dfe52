//! Starting a job's main process: work dir and log files, a minimal environment, PATH lookup,
//! and the pre-exec steps in the child (new session, join the job cgroup, no_new_privs, drop to
//! the job's uid/gid) so the job is confined before its first instruction runs.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::process::{Child, Command};

use super::{ExecError, LaunchSpec};

/// PATH given to jobs that do not set their own.
pub(crate) const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// File in the work dir receiving the job's stdout.
pub const STDOUT_LOG: &str = "stdout.log";
/// File in the work dir receiving the job's stderr.
pub const STDERR_LOG: &str = "stderr.log";

/// Checks the parts of a spec that would otherwise fail late or confusingly.
pub(crate) fn validate(spec: &LaunchSpec) -> Result<(), ExecError> {
    let Some(program) = spec.argv.first() else {
        return Err(ExecError::InvalidSpec("argv is empty; give at least the program to run".to_owned()));
    };
    if program.is_empty() {
        return Err(ExecError::InvalidSpec("argv[0] is empty; give the program to run".to_owned()));
    }
    if spec.argv.iter().any(|a| a.contains('\0')) {
        return Err(ExecError::InvalidSpec("argv contains a NUL byte; remove it".to_owned()));
    }
    for (key, value) in &spec.env {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return Err(ExecError::InvalidSpec(format!(
                "environment variable {key:?} is invalid; names must be non-empty without '=' or NUL"
            )));
        }
    }
    if !spec.work_dir.is_absolute() {
        return Err(ExecError::InvalidSpec(format!(
            "work_dir {} is relative; give an absolute path",
            spec.work_dir.display()
        )));
    }
    if spec.limits.cpu_millis == Some(0) {
        return Err(ExecError::InvalidSpec(
            "cpu_millis is 0; give at least 10 (1000 = one core) or no cpu limit".to_owned(),
        ));
    }
    if spec.limits.memory_bytes == Some(0) || spec.limits.pids_max == Some(0) || spec.limits.open_files == Some(0) {
        return Err(ExecError::InvalidSpec(
            "memory_bytes, pids_max and open_files must be positive; leave them unset for no limit".to_owned(),
        ));
    }
    Ok(())
}

/// The job's environment: a minimal base (PATH, HOME = work dir, LANG=C) overlaid by `spec.env`.
pub(crate) fn environment(spec: &LaunchSpec) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".to_owned(), DEFAULT_PATH.to_owned());
    env.insert("HOME".to_owned(), spec.work_dir.display().to_string());
    env.insert("LANG".to_owned(), "C".to_owned());
    env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

/// Resolves `program` like execvp would with the job's PATH: names containing `/` are taken as
/// paths (relative ones against the work dir), others are looked up in each PATH entry.
pub(crate) fn resolve_program(program: &str, path_var: &str, work_dir: &Path) -> Result<PathBuf, ExecError> {
    let not_found = || ExecError::ProgramNotFound { program: program.to_owned(), path: path_var.to_owned() };
    if program.contains('/') {
        let candidate = work_dir.join(program);
        return if is_executable_file(&candidate) { Ok(candidate) } else { Err(not_found()) };
    }
    path_var
        .split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| work_dir.join(dir).join(program))
        .find(|candidate| is_executable_file(candidate))
        .ok_or_else(not_found)
}

fn is_executable_file(path: &Path) -> bool {
    fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Creates the work dir when missing (owned by the job's uid/gid when those are set) and opens
/// the two log files for appending.
pub(crate) fn prepare_work_dir(spec: &LaunchSpec) -> Result<(File, File), ExecError> {
    let dir = &spec.work_dir;
    let work_dir_error = |path: &Path, source: io::Error| ExecError::WorkDir { path: path.to_path_buf(), source };
    let created = !dir.exists();
    if created {
        fs::create_dir_all(dir).map_err(|e| work_dir_error(dir, e))?;
        // Private to the job's user: another tenant's job cannot list or read it.
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|e| work_dir_error(dir, e))?;
    } else if !dir.is_dir() {
        return Err(work_dir_error(
            dir,
            io::Error::new(io::ErrorKind::AlreadyExists, "it exists and is not a directory"),
        ));
    }
    let open_log = |name: &str| {
        let path = dir.join(name);
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| work_dir_error(&path, e))
    };
    let stdout = open_log(STDOUT_LOG)?;
    let stderr = open_log(STDERR_LOG)?;
    if created && (spec.uid.is_some() || spec.gid.is_some()) {
        for path in [dir.clone(), dir.join(STDOUT_LOG), dir.join(STDERR_LOG)] {
            std::os::unix::fs::chown(&path, spec.uid, spec.gid).map_err(|e| work_dir_error(&path, e))?;
        }
    }
    Ok((stdout, stderr))
}

/// Everything the child needs before exec, prepared in the parent.
pub(crate) struct SpawnPlan<'a> {
    pub(crate) spec: &'a LaunchSpec,
    pub(crate) program: PathBuf,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) stdout: File,
    pub(crate) stderr: File,
    /// `cgroup.procs` of every hierarchy of the job cgroup, opened for writing.
    pub(crate) cgroup_procs: Vec<File>,
}

/// Spawns the main process. In the forked child, before exec: `setsid()`, write `0` to each
/// `cgroup.procs` (moves the child itself, so nothing it forks can start outside the cgroup),
/// `PR_SET_NO_NEW_PRIVS`, an empty capability bounding set, then `setgroups`/`setgid`/`setuid`
/// when the spec asks for them.
pub(crate) fn spawn(plan: SpawnPlan<'_>) -> Result<Child, ExecError> {
    let spec = plan.spec;
    let mut command = Command::new(&plan.program);
    command
        .args(spec.argv.iter().skip(1))
        .env_clear()
        .envs(&plan.env)
        .current_dir(&spec.work_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(plan.stdout))
        .stderr(Stdio::from(plan.stderr));
    if let Some(argv0) = spec.argv.first() {
        command.arg0(argv0);
    }

    let procs_fds: Vec<RawFd> = plan.cgroup_procs.iter().map(|f| f.as_raw_fd()).collect();
    let uid = spec.uid;
    let gid = spec.gid;
    let open_files = spec.limits.open_files;
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // system calls (setsid, write, setrlimit, prctl, setgroups, setgid, setuid) on memory that was set up
    // before the fork; it neither allocates nor takes locks. The fds stay open until spawn
    // returns because `plan.cgroup_procs` lives until the end of this function, and they are
    // close-on-exec, so the job does not inherit them.
    unsafe {
        command.pre_exec(move || child_setup(&procs_fds, open_files, uid, gid));
    }
    let child =
        command.spawn().map_err(|source| ExecError::Spawn { program: plan.program.display().to_string(), source })?;
    drop(plan.cgroup_procs);
    Ok(child)
}

/// Empties the capability bounding set and the ambient set, so the job never holds a capability:
/// a job that stays root (no user mapping) execs with none, and one that switches to its
/// tenant's uid cannot regain any. Needs CAP_SETPCAP: a worker without it has none to give away.
/// Runs in the forked child; async-signal-safe only.
fn drop_capabilities() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    unsafe {
        if libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
        for cap in 0..64 as libc::c_ulong {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                match io::Error::last_os_error().raw_os_error() {
                    // Past the last capability this kernel knows.
                    Some(libc::EINVAL) => break,
                    // Not privileged: nothing to drop.
                    Some(libc::EPERM) => return Ok(()),
                    _ => return Err(io::Error::last_os_error()),
                }
            }
        }
    }
    Ok(())
}

/// Runs in the forked child; async-signal-safe only.
fn child_setup(procs_fds: &[RawFd], open_files: Option<u64>, uid: Option<u32>, gid: Option<u32>) -> io::Result<()> {
    // SAFETY (all blocks below): plain system calls with valid arguments; see `spawn`.
    if unsafe { libc::setsid() } == -1 {
        return Err(io::Error::last_os_error());
    }
    for &fd in procs_fds {
        // "0" means "the writing process" in cgroup.procs on v1 and v2.
        let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
        if written != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    if let Some(n) = open_files {
        let limit = libc::rlimit { rlim_cur: n as libc::rlim_t, rlim_max: n as libc::rlim_t };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    drop_capabilities()?;
    if let Some(gid) = gid {
        let groups = [gid as libc::gid_t];
        if unsafe { libc::setgroups(1, groups.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if unsafe { libc::setgid(gid as libc::gid_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    if let Some(uid) = uid {
        // Drop root's supplementary groups unless a gid already replaced them.
        if gid.is_none() && unsafe { libc::setgroups(0, std::ptr::null()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if unsafe { libc::setuid(uid as libc::uid_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_resolve_through_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let found = resolve_program("sh", "/nonexistent:/usr/bin:/bin", dir.path()).expect("sh");
        assert!(found.ends_with("sh"), "{}", found.display());
        assert!(matches!(
            resolve_program("no-such-program-corral", DEFAULT_PATH, dir.path()),
            Err(ExecError::ProgramNotFound { .. })
        ));
        assert_eq!(resolve_program("/bin/sh", "", dir.path()).expect("absolute"), PathBuf::from("/bin/sh"));
        let script = dir.path().join("run.sh");
        fs::write(&script, "#!/bin/sh\n").expect("write");
        assert!(resolve_program("./run.sh", DEFAULT_PATH, dir.path()).is_err());
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod");
        assert_eq!(
            resolve_program("./run.sh", DEFAULT_PATH, dir.path()).expect("relative"),
            dir.path().join("./run.sh")
        );
    }
}
