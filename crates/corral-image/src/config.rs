//! An image's config (the JSON its manifest names) and what it means for a job's process:
//! the command (`Entrypoint` + `Cmd`, the job's command replacing `Cmd` as `docker run IMAGE
//! CMD` does), the environment (the image's `Env` under the job's), the working directory and
//! the user the image asks for.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use serde::Deserialize;

use crate::digest::{clip, Digest};
use crate::error::ImageError;

/// `PATH` of a job whose image sets none (Docker's default).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Largest `/etc/passwd` or `/etc/group` read from an image.
const MAX_ACCOUNTS_FILE: u64 = 4 << 20;

/// The parts of an image config that corral uses (OCI image-spec `config.json`, which Docker's
/// format shares); unknown fields are ignored, `null` is absent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
    #[serde(default)]
    pub config: Option<RunConfig>,
    #[serde(default)]
    pub rootfs: RootFs,
}

/// How a container of the image runs by default.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub stop_signal: Option<String>,
}

/// The layers' uncompressed digests, bottom first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct RootFs {
    #[serde(default)]
    pub diff_ids: Vec<Digest>,
}

/// What the job gives on top of the image.
#[derive(Clone, Copy, Debug)]
pub struct JobOverrides<'a> {
    /// The job's command; empty runs the image's `Cmd`.
    pub command: &'a [String],
    /// The job's environment (the worker's `CORRAL_*` variables included), over the image's.
    pub env: &'a BTreeMap<String, String>,
    /// `--container-workdir`, over the image's `WorkingDir`.
    pub working_dir: Option<&'a str>,
}

/// How to start the job's process in the image's root filesystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecConfig {
    /// `Entrypoint` followed by the job's command, or by the image's `Cmd` without one.
    pub argv: Vec<String>,
    /// The image's `Env`, the job's over it; `PATH` is [`DEFAULT_PATH`] when neither sets it.
    pub env: BTreeMap<String, String>,
    /// Absolute, inside the image; `/` when nothing says otherwise.
    pub working_dir: String,
    /// The image's `User` (`name`, `uid`, `name:group`, `uid:gid`), if it sets one: the worker
    /// uses it only where it allows image users (see [`resolve_user`]).
    pub user: Option<String>,
}

impl ImageConfig {
    /// Parses a config blob.
    pub fn parse(bytes: &[u8]) -> Result<ImageConfig, ImageError> {
        serde_json::from_slice(bytes).map_err(|e| ImageError::unsupported(format!("image config is not valid: {e}")))
    }

    /// The job's process in this image.
    pub fn exec(&self, job: JobOverrides<'_>) -> Result<ExecConfig, ImageError> {
        let run = self.config.clone().unwrap_or_default();
        let mut argv = run.entrypoint.unwrap_or_default();
        if job.command.is_empty() {
            argv.extend(run.cmd.unwrap_or_default());
        } else {
            argv.extend(job.command.iter().cloned());
        }
        if argv.is_empty() {
            return Err(ImageError::unsupported(
                "the image has no Entrypoint or Cmd and the job gives no command".to_string(),
            ));
        }
        let mut env = BTreeMap::new();
        for entry in run.env.unwrap_or_default() {
            if let Some((key, value)) = entry.split_once('=') {
                if !key.is_empty() {
                    env.insert(key.to_string(), value.to_string());
                }
            }
        }
        env.extend(job.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        env.entry("PATH".to_string()).or_insert_with(|| DEFAULT_PATH.to_string());
        let working_dir = job
            .working_dir
            .map(str::to_string)
            .or(run.working_dir.filter(|w| !w.is_empty()))
            .unwrap_or_else(|| "/".to_string());
        if !working_dir.starts_with('/') {
            return Err(ImageError::unsupported(format!("working directory '{}' is not absolute", clip(&working_dir))));
        }
        Ok(ExecConfig { argv, env, working_dir, user: run.user.filter(|u| !u.is_empty()) })
    }
}

/// The uid and gid an image's `User` names, looked up in the image's own `/etc/passwd` and
/// `/etc/group` (opened with every path, symlinks included, resolved inside `rootfs`, so an
/// image cannot make the worker read a host file). A numeric user without a group takes its
/// passwd entry's group, else gid 0, as Docker does.
pub fn resolve_user(rootfs: &Path, user: &str) -> Result<(u32, u32), ImageError> {
    let (name, group) = match user.split_once(':') {
        Some((name, group)) => (name, Some(group)),
        None => (user, None),
    };
    let passwd = read_in_root(rootfs, "etc/passwd").unwrap_or_default();
    // name:password:uid:gid:gecos:home:shell
    let entry = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|fields| fields.len() >= 4 && (fields[0] == name || (name.parse::<u32>().is_ok() && fields[2] == name)));
    let uid = match (name.parse::<u32>(), &entry) {
        (Ok(uid), _) => uid,
        (Err(_), Some(fields)) => fields[2].parse().map_err(|_| {
            ImageError::unsupported(format!("user '{}': bad uid in the image's /etc/passwd", clip(name)))
        })?,
        (Err(_), None) => {
            return Err(ImageError::unsupported(format!("user '{}' is not in the image's /etc/passwd", clip(name))))
        }
    };
    let gid = match group {
        Some(group) => match group.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => {
                let groups = read_in_root(rootfs, "etc/group").unwrap_or_default();
                groups
                    .lines()
                    .map(|l| l.split(':').collect::<Vec<_>>())
                    .find(|fields| fields.len() >= 3 && fields[0] == group)
                    .and_then(|fields| fields[2].parse().ok())
                    .ok_or_else(|| {
                        ImageError::unsupported(format!("group '{}' is not in the image's /etc/group", clip(group)))
                    })?
            }
        },
        None => entry.and_then(|fields| fields[3].parse().ok()).unwrap_or(0),
    };
    Ok((uid, gid))
}

/// Reads `rel` (at most [`MAX_ACCOUNTS_FILE`] bytes) with `rootfs` as the root of every path
/// lookup (`openat2` with `RESOLVE_IN_ROOT`, Linux 5.6).
fn read_in_root(rootfs: &Path, rel: &str) -> std::io::Result<String> {
    let root = std::fs::File::open(rootfs)?;
    let path = std::ffi::CString::new(Path::new(rel).as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `open_how` is plain integers; all zero is its "no flags" value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    use std::os::fd::AsRawFd;
    // SAFETY: openat2 reads `path` (a NUL-terminated string) and `how` (of the size given);
    // both outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let mut text = String::new();
    file.take(MAX_ACCOUNTS_FILE).read_to_string(&mut text)?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> ImageConfig {
        ImageConfig::parse(json.as_bytes()).expect("config")
    }

    /// `docker run` semantics: the job's command replaces Cmd and keeps Entrypoint.
    #[test]
    fn entrypoint_and_cmd_follow_docker_run() {
        let both = config(r#"{"config": {"Entrypoint": ["/entry.sh"], "Cmd": ["serve", "--port", "80"]}}"#);
        let none = BTreeMap::new();
        let job = |command: &'static [String]| JobOverrides { command, env: &none, working_dir: None };
        assert_eq!(both.exec(job(&[])).expect("default").argv, ["/entry.sh", "serve", "--port", "80"]);
        let cmd: &'static [String] = Box::leak(Box::new(["python".to_string(), "train.py".to_string()]));
        assert_eq!(both.exec(job(cmd)).expect("job").argv, ["/entry.sh", "python", "train.py"]);
        let cmd_only = config(r#"{"config": {"Cmd": ["/bin/sh"], "Entrypoint": null}}"#);
        assert_eq!(cmd_only.exec(job(&[])).expect("cmd").argv, ["/bin/sh"]);
        assert_eq!(cmd_only.exec(job(cmd)).expect("job").argv, ["python", "train.py"]);
        let empty = config(r#"{"config": null}"#);
        let e = empty.exec(job(&[])).expect_err("nothing to run");
        assert!(e.to_string().contains("no Entrypoint or Cmd"), "{e}");
    }

    #[test]
    fn env_workdir_and_user_are_taken_with_the_job_on_top() {
        let image = config(
            r#"{"architecture": "amd64", "os": "linux",
                "config": {"Env": ["PATH=/opt/conda/bin:/usr/bin", "LANG=C.UTF-8", "A=image", "NOEQUALS"],
                           "WorkingDir": "/workspace", "User": "1000:1000", "Cmd": ["bash"]},
                "rootfs": {"type": "layers", "diff_ids": ["sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"]}}"#,
        );
        assert_eq!(image.rootfs.diff_ids.len(), 1);
        let job_env =
            BTreeMap::from([("A".to_string(), "job".to_string()), ("CORRAL_JOB_ID".to_string(), "7".to_string())]);
        let exec = image.exec(JobOverrides { command: &[], env: &job_env, working_dir: None }).expect("exec");
        assert_eq!(exec.env["PATH"], "/opt/conda/bin:/usr/bin");
        assert_eq!(exec.env["LANG"], "C.UTF-8");
        assert_eq!(exec.env["A"], "job", "the job's environment wins");
        assert_eq!(exec.env["CORRAL_JOB_ID"], "7");
        assert!(!exec.env.contains_key("NOEQUALS"));
        assert_eq!(exec.working_dir, "/workspace");
        assert_eq!(exec.user.as_deref(), Some("1000:1000"));
        let moved = image.exec(JobOverrides { command: &[], env: &job_env, working_dir: Some("/data") }).expect("exec");
        assert_eq!(moved.working_dir, "/data");

        let bare = config(r#"{"config": {"Cmd": ["sh"]}}"#)
            .exec(JobOverrides { command: &[], env: &BTreeMap::new(), working_dir: None })
            .expect("bare");
        assert_eq!((bare.env["PATH"].as_str(), bare.working_dir.as_str(), bare.user), (DEFAULT_PATH, "/", None));
        assert!(ImageConfig::parse(b"[1]").is_err());
    }

    #[test]
    fn users_resolve_inside_the_image_only() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(root.path().join("etc")).expect("etc");
        std::fs::write(root.path().join("etc/passwd"), "root:x:0:0::/root:/bin/sh\nml:x:1000:1001::/home/ml:/bin/sh\n")
            .expect("passwd");
        std::fs::write(root.path().join("etc/group"), "root:x:0:\nml:x:1001:\nvideo:x:44:ml\n").expect("group");
        assert_eq!(resolve_user(root.path(), "ml").expect("name"), (1000, 1001));
        assert_eq!(resolve_user(root.path(), "ml:video").expect("name:group"), (1000, 44));
        assert_eq!(resolve_user(root.path(), "1000").expect("uid"), (1000, 1001));
        assert_eq!(resolve_user(root.path(), "4242").expect("unknown uid"), (4242, 0));
        assert_eq!(resolve_user(root.path(), "4242:7").expect("uid:gid"), (4242, 7));
        assert!(resolve_user(root.path(), "nobody")
            .expect_err("unknown")
            .to_string()
            .contains("not in the image's /etc/passwd"));
        assert!(resolve_user(root.path(), "ml:nogroup").is_err());

        // An image whose /etc/passwd points at the host's is read inside the image: nothing there.
        let evil = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(evil.path().join("etc")).expect("etc");
        std::os::unix::fs::symlink("/etc/passwd", evil.path().join("etc/passwd")).expect("symlink");
        assert!(resolve_user(evil.path(), "root").is_err(), "the host's /etc/passwd is not read");
    }
}
