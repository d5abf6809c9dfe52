//! Slurm's in-job commands (`srun`, `scontrol`, ...), which the corral binary serves when called
//! by their names. A bare job finds them first on its `PATH`, in a directory of links to the
//! binary (`WorkerConfig::in_job_bin_dir`).
//!
//! An image job's container gets, read-only at
//! [`CONTAINER_DIR`], the corral binary, the host's shared libraries it was linked with (from
//! this process's own mappings: the worker is that binary) and one small `/bin/sh` wrapper per
//! command, which runs the binary through the host's dynamic loader with those libraries, so
//! `srun`, `scontrol`, ... work in any image with a shell, whatever its C library. The in-job
//! socket is bound into the same directory. The image's own files are untouched.
//!
//! Layout of the host directory (`WorkerConfig::in_image_dir`), written at worker start:
//! `bin/<command>` (wrappers) and `bin/corral-bash-env.sh`, `lib/` (the libraries), and two
//! empty files, `corral` and `in-job.sock`, that the binary and the socket are bound over.

use crate::executor::BindMount;
use std::io::BufRead;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Slurm's commands the corral binary serves inside a job when called by their name
/// (`corral-cli`'s `in_job.rs`): the worker links each, in its `in_job_bin_dir`, to itself.
pub const IN_JOB_COMMANDS: [&str; 7] = ["scontrol", "squeue", "scancel", "srun", "sbatch", "sacct", "sinfo"];

/// The file, next to the in-job commands, that a bare job's `BASH_ENV` names when the job sets
/// none. bash reads it after a login shell's profile (`#!/bin/bash -l`) has reset `PATH` to the
/// system's, and it puts the in-job commands first again: Slurm's own are installed on the
/// system's `PATH`, so a login shell reaches them too.
pub const BASH_ENV_FILE: &str = "corral-bash-env.sh";

/// The text of `BASH_ENV_FILE` in `dir`: `dir` first on `PATH` unless it is on it already.
pub(crate) fn bash_env_text(dir: &Path) -> String {
    let quoted = dir.display().to_string().replace('\'', "'\\''");
    format!(
        "# Written by the corral worker: Slurm's in-job commands on PATH again after a login\n\
         # shell's profile has reset it.\n\
         case \":$PATH:\" in *':{quoted}:'*) ;; *) PATH='{quoted}':\"$PATH\"; export PATH ;; esac\n"
    )
}

/// Links Slurm's in-job commands in `dir` to the running corral binary, replacing old links,
/// and writes `BASH_ENV_FILE` there. A worker running inside another program (a test harness)
/// has no corral binary to link: it links nothing, and jobs find no such command.
pub(crate) fn install_in_job_commands(dir: &Path) -> std::io::Result<()> {
    let exe = std::env::current_exe()?;
    if !exe.file_name().is_some_and(|n| n.to_string_lossy().starts_with("corral")) {
        tracing::debug!(exe = %exe.display(), "not the corral binary: no in-job commands");
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for name in IN_JOB_COMMANDS {
        let link = dir.join(name);
        match std::fs::remove_file(&link) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::os::unix::fs::symlink(&exe, &link)?;
    }
    let file = dir.join(BASH_ENV_FILE);
    std::fs::write(&file, bash_env_text(dir))?;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
    Ok(())
}

/// Where the directory appears in an image job's container.
pub const CONTAINER_DIR: &str = "/.corral";
/// The in-job commands in the container, first on its `PATH`.
pub const CONTAINER_IN_JOB_BIN: &str = "/.corral/bin";
/// The in-job socket in the container.
pub const CONTAINER_SOCKET: &str = "/.corral/in-job.sock";
/// The corral binary in the container.
const CONTAINER_EXE: &str = "/.corral/corral";
/// Libraries never copied: the GPU driver's, which the worker may have loaded (NVML) and the
/// in-job commands never use; CDI gives a container the driver's own when it needs them.
const NOT_COPIED: [&str; 3] = ["libnvidia", "libcuda", "libnvcuvid"];

/// Writes the directory `dir` for the running corral binary. Returns false (and writes nothing)
/// when this process is not the corral binary (a test harness): image jobs then have no in-job
/// commands.
pub(crate) fn install_for_images(dir: &Path) -> std::io::Result<bool> {
    let exe = std::env::current_exe()?;
    if !exe.file_name().is_some_and(|n| n.to_string_lossy().starts_with("corral")) {
        return Ok(false);
    }
    let libs = mapped_libraries()?;
    let (bin, lib) = (dir.join("bin"), dir.join("lib"));
    for d in [dir, &bin, &lib] {
        std::fs::create_dir_all(d)?;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    }
    // Libraries of an earlier binary go: the loader must find this one's.
    for entry in std::fs::read_dir(&lib)? {
        std::fs::remove_file(entry?.path())?;
    }
    let mut loader = None;
    for path in &libs {
        let Some(name) = path.file_name() else { continue };
        std::fs::copy(path, lib.join(name))?;
        if name.to_string_lossy().starts_with("ld-") {
            loader = Some(name.to_string_lossy().into_owned());
        }
    }
    for name in IN_JOB_COMMANDS {
        let path = bin.join(name);
        let _ = std::fs::remove_file(&path);
        match &loader {
            Some(loader) => {
                std::fs::write(&path, wrapper_text(loader, name))?;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
            }
            // A static binary needs no loader: a link is the command.
            None => std::os::unix::fs::symlink(CONTAINER_EXE, &path)?,
        }
    }
    let env_file = bin.join(BASH_ENV_FILE);
    std::fs::write(&env_file, bash_env_text(Path::new(CONTAINER_IN_JOB_BIN)))?;
    std::fs::set_permissions(&env_file, std::fs::Permissions::from_mode(0o644))?;
    for placeholder in ["corral", "in-job.sock"] {
        let path = dir.join(placeholder);
        if !path.exists() {
            std::fs::write(&path, b"")?;
        }
    }
    Ok(true)
}

/// The wrapper of in-job command `name`: the binary through the host's loader and libraries,
/// with `name` as its `argv[0]` (the binary dispatches on it).
fn wrapper_text(loader: &str, name: &str) -> String {
    format!(
        "#!/bin/sh\n# Written by the corral worker: Slurm's `{name}` for jobs in images (corral's binary,\n\
         # with the host's loader and libraries).\n\
         exec {CONTAINER_DIR}/lib/{loader} --library-path {CONTAINER_DIR}/lib --argv0 {name} {CONTAINER_EXE} \"$@\"\n"
    )
}

/// The shared libraries this process has mapped (the loader among them), from
/// `/proc/self/maps`, less the GPU driver's.
fn mapped_libraries() -> std::io::Result<Vec<PathBuf>> {
    let maps = std::io::BufReader::new(std::fs::File::open("/proc/self/maps")?);
    let mut libs = Vec::new();
    for line in maps.lines() {
        let line = line?;
        // address perms offset dev inode path
        let Some(path) = line.split_whitespace().nth(5).filter(|p| p.starts_with('/')) else { continue };
        let path = PathBuf::from(path);
        let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else { continue };
        if name.contains(".so") && !NOT_COPIED.iter().any(|p| name.starts_with(p)) && !libs.contains(&path) {
            libs.push(path);
        }
    }
    Ok(libs)
}

/// The binds that give an image job's container the directory `dir` (when it was installed),
/// the corral binary and the in-job socket `socket`.
pub(crate) fn mounts(dir: &Path, socket: &Path) -> Option<Vec<BindMount>> {
    if !dir.join("bin").join("srun").exists() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let bind = |source: PathBuf, target: &str, read_only| BindMount { source, target: target.into(), read_only };
    Some(vec![
        bind(dir.to_path_buf(), CONTAINER_DIR, true),
        bind(exe, CONTAINER_EXE, true),
        // connect(2) needs write access to the socket.
        bind(socket.to_path_buf(), CONTAINER_SOCKET, false),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A login shell (`#!/bin/bash -l`) resets PATH in its profile; the BASH_ENV file puts the
    /// in-job commands first again, once, whatever the directory's name.
    #[test]
    fn a_login_shell_finds_the_in_job_commands_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("it's slurm-bin");
        std::fs::create_dir(&bin).expect("mkdir");
        let file = bin.join(BASH_ENV_FILE);
        std::fs::write(&file, bash_env_text(&bin)).expect("write");
        let script = dir.path().join("job.sh");
        std::fs::write(&script, "#!/bin/bash -l\necho \"$PATH\"\nbash -c 'echo \"$PATH\"'\n").expect("write");
        let out = std::process::Command::new("bash")
            .args(["-l"])
            .arg(&script)
            .env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .env("HOME", dir.path())
            .env("BASH_ENV", &file)
            .output()
            .expect("bash");
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text:?} {}", String::from_utf8_lossy(&out.stderr));
        for line in lines {
            let first = line.split(':').next();
            assert_eq!(first, Some(bin.to_str().expect("utf-8")), "{line:?}");
            assert_eq!(line.matches("slurm-bin").count(), 1, "once: {line:?}");
        }
    }

    #[test]
    fn the_loader_and_the_c_library_are_among_the_mapped_libraries() {
        let libs = mapped_libraries().expect("maps");
        let names: Vec<String> =
            libs.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into()).collect();
        assert!(names.iter().any(|n| n.starts_with("ld-")), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("libc.so")), "{names:?}");
    }

    #[test]
    fn a_wrapper_runs_the_binary_through_the_loader_under_the_commands_name() {
        let text = wrapper_text("ld-linux-x86-64.so.2", "srun");
        assert!(text.starts_with("#!/bin/sh\n"));
        assert!(text.ends_with(
            "exec /.corral/lib/ld-linux-x86-64.so.2 --library-path /.corral/lib --argv0 srun /.corral/corral \"$@\"\n"
        ));
    }
}
