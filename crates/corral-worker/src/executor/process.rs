//! Starting a job's main process: work dir and log files, a minimal environment, PATH lookup,
//! and the confinement the child applies before exec (new session, join the job cgroup,
//! no_new_privs, drop to the job's uid/gid) so the job is confined before its first
//! instruction runs.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use std::time::Instant;

use tracing::{info, warn};

use super::cgroup::{self, CgroupVersion, JobCgroup};
use super::job::{MainProcess, Shared};
use super::output::tee;
use super::spawn::{self, JobProcess};
use super::{ExecError, Executor, LaunchSpec, RunningJob};

/// PATH given to jobs that do not set their own.
pub(crate) const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// File in the work dir receiving the job's stdout.
pub const STDOUT_LOG: &str = "stdout.log";
/// File in the work dir receiving the job's stderr.
pub const STDERR_LOG: &str = "stderr.log";
/// File in the work dir holding a batch job's script.
pub const SCRIPT_FILE: &str = "job-script";

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
/// paths (relative ones against the work dir), others are looked up in each PATH entry
/// (relative entries against the work dir too).
/// A file that is there but cannot be run says so, rather than "not found".
pub(crate) fn resolve_program(program: &str, path_var: &str, work_dir: &Path) -> Result<PathBuf, ExecError> {
    let not_found = || ExecError::ProgramNotFound { program: program.to_owned(), path: path_var.to_owned() };
    let not_executable = |path: PathBuf| ExecError::NotExecutable { program: program.to_owned(), path };
    let is_file = |path: &Path| fs::metadata(path).is_ok_and(|m| m.is_file());
    if program.contains('/') {
        let path = work_dir.join(program);
        return match which::which_in(program, None::<&str>, work_dir) {
            Ok(found) => Ok(found),
            Err(_) if is_file(&path) => Err(not_executable(path)),
            Err(_) => Err(ExecError::NoSuchProgram { program: program.to_owned(), path }),
        };
    }
    let dirs: Vec<PathBuf> = path_var.split(':').filter(|dir| !dir.is_empty()).map(|dir| work_dir.join(dir)).collect();
    let paths = std::env::join_paths(&dirs).map_err(|_| not_found())?;
    which::which_in(program, Some(paths), work_dir).map_err(|_| {
        match dirs.iter().map(|dir| dir.join(program)).find(|p| is_file(p)) {
            Some(path) => not_executable(path),
            None => not_found(),
        }
    })
}

/// Finds one of the worker's own helper programs (runc, the MPS control daemon): a path as
/// given, else a name in the worker's PATH and then in `also`.
pub(crate) fn find_program(program: &Path, also: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path).chain(also.iter().map(PathBuf::from));
    let paths = std::env::join_paths(dirs).ok()?;
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    which::which_in(program, Some(paths), cwd).ok()
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
    let mut owned = vec![dir.clone(), dir.join(STDOUT_LOG), dir.join(STDERR_LOG)];
    for (name, contents) in &spec.work_files {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(ExecError::InvalidSpec(format!("work file name {name:?} is not a plain file name")));
        }
        let path = dir.join(name);
        OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|mut f| f.write_all(contents.as_bytes()))
            .map_err(|e| work_dir_error(&path, e))?;
        owned.push(path);
    }
    if spec.uid.is_some() || spec.gid.is_some() {
        // A work dir that already existed is the job's own: only what was written now is chowned.
        let skip = if created { 0 } else { 3 };
        for path in &owned[skip..] {
            std::os::unix::fs::chown(path, spec.uid, spec.gid).map_err(|e| work_dir_error(path, e))?;
        }
    }
    if let Some(script) = &spec.files.script {
        let path = dir.join(SCRIPT_FILE);
        let write = || -> io::Result<()> {
            // A fresh file of the job's user that only it may read and run.
            let _ = fs::remove_file(&path);
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o700)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)?;
            io::Write::write_all(&mut file, script.as_bytes())?;
            if spec.uid.is_some() || spec.gid.is_some() {
                std::os::unix::fs::fchown(&file, spec.uid, spec.gid)?;
            }
            Ok(())
        };
        write().map_err(|e| work_dir_error(&path, e))?;
    }
    Ok((stdout, stderr))
}

/// The files a job opens outside its own directory, opened as its user.
#[derive(Debug, Default)]
pub(crate) struct UserFiles {
    pub(crate) stdout: Option<File>,
    pub(crate) stderr: Option<File>,
}

/// Checks that the job's working directory exists and that its user may enter it, and opens its
/// output files as that user (see [`as_job_user`]): the worker's privileges never reach a path
/// the user chose, so what a launch reports about such a path (it does not exist, or it is not
/// accessible) is what the user could learn anyway — a path under a directory only root may
/// enter is "not accessible" whether it exists or not.
pub(crate) fn open_user_files(spec: &LaunchSpec) -> Result<UserFiles, ExecError> {
    let files = &spec.files;
    if files.cwd.is_none() && files.stdout.is_none() && files.stderr.is_none() {
        return Ok(UserFiles::default());
    }
    let what = files.cwd.clone().unwrap_or_else(|| spec.work_dir.clone());
    as_job_user(spec, &what, || open_as_current_user(files, spec.uid))
}

/// Opens a container job's output files (`files.stdout`, `files.stderr`: absolute paths of the
/// host) as the job's user; its `cwd` is the container's, not entered here.
pub(crate) fn open_host_output_files(spec: &LaunchSpec) -> Result<UserFiles, ExecError> {
    let files = super::JobFiles { cwd: None, script: None, ..spec.files.clone() };
    let Some(first) = files.stdout.clone().or_else(|| files.stderr.clone()) else { return Ok(UserFiles::default()) };
    let what = first.parent().map_or_else(|| first.clone(), Path::to_path_buf);
    as_job_user(spec, &what, || open_as_current_user(&files, spec.uid))
}

/// Runs `f` with the job's file-system identity: on a thread of its own whose fs uid and gid
/// are the job's (`setfsuid`, `setfsgid`, `setgroups` through raw system calls change only the
/// calling thread). A worker that is not root, or a job that runs as root, runs it with the
/// worker's identity, the job's own. Either way `unshare(CLONE_FS)` gives the thread its own
/// current directory, so `f` may enter the job's directory without moving the worker's.
/// `path` names what is checked, in the error of a thread that cannot take the identity.
fn as_job_user<T: Send>(
    spec: &LaunchSpec,
    path: &Path,
    f: impl FnOnce() -> Result<T, ExecError> + Send,
) -> Result<T, ExecError> {
    // Only root can take another identity; a worker running as a user runs jobs as itself.
    let switch =
        nix::unistd::geteuid().is_root() && (spec.uid.is_some_and(|u| u != 0) || spec.gid.is_some_and(|g| g != 0));
    let (uid, gid) = (spec.uid, spec.gid);
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let cannot = |e: io::Error| ExecError::WorkingDir {
                    path: path.to_path_buf(),
                    reason: format!("cannot be checked as the job's user: {e}"),
                };
                own_fs_context().map_err(cannot)?;
                if switch {
                    become_fs_user(uid, gid).map_err(cannot)?;
                }
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(ExecError::InvalidSpec("checking the job's files panicked".to_owned())))
    })
}

/// Runs `f` on a thread of its own whose file-system identity is `uid`/`gid` (as
/// [`as_job_user`]; a worker that is not root, or root's own ids, keep the worker's): what `f`
/// finds on the host is what that user could find.
pub(crate) fn as_fs_user<T: Send>(
    uid: Option<u32>,
    gid: Option<u32>,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    let switch = nix::unistd::geteuid().is_root() && (uid.is_some_and(|u| u != 0) || gid.is_some_and(|g| g != 0));
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                own_fs_context()?;
                if switch {
                    become_fs_user(uid, gid)?;
                }
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the check as the job's user panicked")))
    })
}

/// Gives the calling thread its own current directory and umask (see [`as_job_user`]).
fn own_fs_context() -> io::Result<()> {
    // SAFETY: a system call that changes only the calling thread's fs context.
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the calling thread's file-system identity the job's (see [`as_job_user`]).
fn become_fs_user(uid: Option<u32>, gid: Option<u32>) -> io::Result<()> {
    // SAFETY: system calls that change the calling thread's own credentials.
    unsafe {
        if let Some(gid) = gid {
            let groups = [gid];
            if libc::syscall(libc::SYS_setgroups, 1 as libc::c_long, groups.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            libc::syscall(libc::SYS_setfsgid, gid);
            if libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32 != gid {
                return Err(io::Error::other("setfsgid did not take"));
            }
        }
        if let Some(uid) = uid {
            libc::syscall(libc::SYS_setfsuid, uid);
            if libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 != uid {
                return Err(io::Error::other("setfsuid did not take"));
            }
        }
    }
    Ok(())
}

fn open_as_current_user(files: &super::JobFiles, uid: Option<u32>) -> Result<UserFiles, ExecError> {
    if let Some(cwd) = &files.cwd {
        if let Err(e) = nix::unistd::chdir(cwd.as_path()) {
            let who = uid.map_or_else(|| "the job's user".to_owned(), |u| format!("the job's user (uid {u})"));
            let reason = match e {
                nix::errno::Errno::ENOENT => "does not exist".to_owned(),
                nix::errno::Errno::ENOTDIR => "is not a directory".to_owned(),
                nix::errno::Errno::EACCES => format!("is not accessible to {who}: permission denied"),
                e => format!("cannot be entered by {who}: {}", e.desc()),
            };
            return Err(ExecError::WorkingDir { path: cwd.clone(), reason });
        }
    }
    let open = |path: &Path| {
        let mut options = OpenOptions::new();
        options.write(true).create(true).mode(0o644).custom_flags(libc::O_NOFOLLOW);
        if files.truncate {
            options.truncate(true);
        } else {
            options.append(true);
        }
        options.open(path).map_err(|source| ExecError::OutputFile { path: path.to_path_buf(), source })
    };
    let stdout = files.stdout.as_deref().map(open).transpose()?;
    let stderr = match (&files.stderr, &stdout) {
        (Some(e), Some(out)) if Some(e) == files.stdout.as_ref() => {
            Some(out.try_clone().map_err(|source| ExecError::OutputFile { path: e.clone(), source })?)
        }
        (Some(e), _) => Some(open(e)?),
        (None, _) => None,
    };
    Ok(UserFiles { stdout, stderr })
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

/// Spawns the main process (see [`spawn::spawn`]). In the child, before exec: `setsid()`,
/// write `0` to each `cgroup.procs` (moves the child itself, so nothing it forks can start
/// outside the cgroup), `PR_SET_NO_NEW_PRIVS`, an empty capability bounding set, then
/// `setgroups`/`setgid`/`setuid` when the spec asks for them.
pub(crate) fn spawn(plan: SpawnPlan<'_>) -> Result<JobProcess, ExecError> {
    let spec = plan.spec;
    let confinement = spawn::Confinement {
        cgroup_procs: &plan.cgroup_procs,
        open_files: spec.limits.open_files,
        uid: spec.uid,
        gid: spec.gid,
        not_after: spec.not_after,
    };
    let dir = spec.files.cwd.as_deref().unwrap_or(&spec.work_dir);
    spawn::spawn(&plan.program, &spec.argv, &plan.env, dir, &plan.stdout, &plan.stderr, &confinement).map_err(
        |source| {
            let program = plan.program.display().to_string();
            // The child reports exec's errno in the message ("cannot exec the program: ...").
            let errno = |code: i32| source.to_string().ends_with(&io::Error::from_raw_os_error(code).to_string());
            if source.kind() == io::ErrorKind::TimedOut {
                ExecError::LeaseEnded
            } else if errno(libc::ENOEXEC) && !starts_like_a_program(&plan.program) {
                ExecError::NoShebang { program }
            } else if errno(libc::EACCES) {
                ExecError::NotExecutable { program, path: plan.program.clone() }
            } else {
                ExecError::Spawn { program, source }
            }
        },
    )
}

/// Starts with `#!` or an ELF header: when exec refuses such a file, a missing `#!` is not why.
fn starts_like_a_program(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 4];
    let read = File::open(path).and_then(|mut f| f.read(&mut head)).unwrap_or(0);
    head[..read].starts_with(b"#!") || head[..read].starts_with(b"\x7fELF")
}

/// Runs each job as a plain process in its own cgroup under a common root cgroup.
#[derive(Clone, Debug)]
pub struct ProcessExecutor {
    cgroup_root: String,
    version: CgroupVersion,
}

impl Default for ProcessExecutor {
    /// Root cgroup `corral`, cgroup version detected from the host.
    fn default() -> Self {
        Self { cgroup_root: Self::DEFAULT_CGROUP_ROOT.to_owned(), version: CgroupVersion::detect() }
    }
}

impl ProcessExecutor {
    /// Root cgroup under which job cgroups are created by default.
    pub const DEFAULT_CGROUP_ROOT: &'static str = "corral";

    /// An executor putting job cgroups under `cgroup_root` (relative to each hierarchy's root,
    /// e.g. `corral` or `corral/worker-3`), with the cgroup version detected from the host.
    pub fn new(cgroup_root: impl Into<String>) -> Result<Self, ExecError> {
        let cgroup_root = cgroup_root.into();
        if !cgroup::validate_relative_name(&cgroup_root) {
            return Err(ExecError::InvalidCgroupRoot(cgroup_root));
        }
        Ok(Self { cgroup_root: cgroup_root.trim_end_matches('/').to_owned(), version: CgroupVersion::detect() })
    }

    pub fn cgroup_root(&self) -> &str {
        &self.cgroup_root
    }

    pub fn cgroup_version(&self) -> CgroupVersion {
        self.version
    }

    /// The cgroup path of one attempt of a job, relative to the hierarchy root(s).
    pub fn job_cgroup_name(&self, job_id: u64, attempt: u64) -> String {
        format!("{}/job-{job_id}-{attempt}", self.cgroup_root)
    }

    /// Removes the root cgroup itself (e.g. at worker shutdown). Fails while job cgroups remain
    /// under it; succeeds when it does not exist.
    pub fn remove_root_cgroup(&self) -> Result<(), ExecError> {
        cgroup::remove_empty_cgroup(self.version, &self.cgroup_root)
    }
}

impl Executor for ProcessExecutor {
    /// Kills and removes job cgroups left under the root by an earlier worker process (one that
    /// was killed before it could clean up). Call once at start-up, before launching anything.
    fn reap_leftovers(&self) -> Result<Vec<String>, ExecError> {
        cgroup::reap_job_cgroups(self.version, &self.cgroup_root)
    }

    fn launch(&self, spec: &LaunchSpec) -> Result<RunningJob, ExecError> {
        if let Some(image) = &spec.image {
            return Err(ExecError::NoContainerRuntime(image.display().to_string()));
        }
        validate(spec)?;
        let env = environment(spec);
        let user_files = open_user_files(spec)?;
        let (stdout, stderr) = prepare_work_dir(spec)?;
        let path_var = env.get("PATH").map_or(DEFAULT_PATH, String::as_str);
        let argv0 = spec.argv.first().map_or("", String::as_str);
        let dir = spec.files.cwd.as_deref().unwrap_or(&spec.work_dir);
        // As the job's user: whether a program exists under a directory it may not enter is
        // not the worker's to tell.
        let program = as_job_user(spec, dir, || resolve_program(argv0, path_var, dir))?;
        let mut copiers = Vec::new();
        let mut with_copy = |log: File, extra: Option<File>| match extra {
            Some(extra) => tee(spec.job_id, log, extra).map(|(write_end, copier)| {
                copiers.push(copier);
                write_end
            }),
            None => Ok(log),
        };
        let stdout = with_copy(stdout, user_files.stdout)?;
        let stderr = with_copy(stderr, user_files.stderr)?;

        let name = self.job_cgroup_name(spec.job_id, spec.attempt);
        let cgroup = JobCgroup::create(self.version, &name, &spec.limits)?;
        let cgroup_procs = match cgroup.open_procs_files() {
            Ok(files) => files,
            Err(e) => {
                cgroup.remove_quietly();
                return Err(e);
            }
        };
        let started = Instant::now();
        let plan = SpawnPlan { spec, program, env, stdout, stderr, cgroup_procs };
        let child = match spawn(plan) {
            Ok(child) => child,
            Err(e) => {
                // The child may have joined the cgroup before failing to exec.
                if let Err(kill) = cgroup.kill_all() {
                    warn!(cgroup = %name, error = %kill, "cannot kill a failed launch");
                }
                cgroup.remove_quietly();
                return Err(e);
            }
        };
        let pid = child.id();
        info!(
            job_id = spec.job_id,
            attempt = spec.attempt,
            pid,
            cgroup = %name,
            "job started"
        );
        Ok(RunningJob::new(MainProcess::Job(child), started, Shared::new(spec.job_id, spec.attempt, pid, cgroup, None))
            .with_copiers(copiers))
    }
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
        let err = resolve_program("./run.sh", DEFAULT_PATH, dir.path()).unwrap_err();
        assert!(err.to_string().contains("is not executable (permission denied)"), "{err}");
        let bin = dir.path().join("bin");
        fs::create_dir(&bin).expect("mkdir");
        fs::write(bin.join("tool"), "#!/bin/sh\n").expect("write");
        let err = resolve_program("tool", "bin", dir.path()).unwrap_err();
        assert!(matches!(err, ExecError::NotExecutable { .. }), "{err}");
        let err = resolve_program("./missing.sh", DEFAULT_PATH, dir.path()).unwrap_err();
        assert!(err.to_string().contains("no such file"), "{err}");
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod");
        assert_eq!(
            resolve_program("./run.sh", DEFAULT_PATH, dir.path()).expect("relative"),
            dir.path().join("./run.sh")
        );
    }
}
