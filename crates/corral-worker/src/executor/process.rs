//! Starting a job's main process: work dir and log files, a minimal environment, PATH lookup,
//! and the confinement the child applies before exec (new session, join the job cgroup,
//! no_new_privs, drop to the job's uid/gid) so the job is confined before its first
//! instruction runs.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::spawn::{self, JobProcess};
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
    };
    spawn::spawn(&plan.program, &spec.argv, &plan.env, &spec.work_dir, &plan.stdout, &plan.stderr, &confinement)
        .map_err(|source| ExecError::Spawn { program: plan.program.display().to_string(), source })
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
