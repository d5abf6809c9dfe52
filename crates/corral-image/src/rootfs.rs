//! Per-job root filesystems: an overlayfs mount of an image's layers (read-only lower
//! directories) under a writable layer of the job's own, removed with the job. Nothing is
//! copied.
//!
//! Each root lives in `<dir>/<key>/` (`upper/`, `work/`, `merged/`). The layer directories are
//! handed to overlayfs as `/proc/self/fd/N` paths of descriptors opened for the call, so the
//! mount options stay short whatever the store's path: a page (4096 bytes) of options holds
//! about 200 layers, where Docker caps images at 128; more is refused with the count.
//!
//! Mount propagation is left as the directory inherits it (on systemd hosts, shared): an
//! unmount then propagates to every namespace that received the mount, whereas a private
//! directory would leave copies behind in namespaces created while a job ran. runc gives each
//! container its own namespace and detaches the host's tree from it.
//!
//! A worker that dies leaves its roots mounted; [`RootsDir::open`] finds every mount below the
//! directory in `/proc/self/mountinfo`, unmounts them (deepest first) and deletes what is left.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use tracing::{info, warn};

use crate::digest::clip;
use crate::error::{ErrorKind, ImageError};
use crate::store::ImagePin;

/// Longest job root key.
const MAX_KEY: usize = 128;

/// The directory of job roots.
#[derive(Debug)]
pub struct RootsDir {
    dir: PathBuf,
    /// An empty lower directory for images without layers.
    empty: PathBuf,
}

impl RootsDir {
    /// Opens (creating) the roots directory; unmounts and deletes the roots a dead worker left.
    pub fn open(dir: &Path) -> Result<RootsDir, ImageError> {
        fs::create_dir_all(dir).map_err(|e| ImageError::io(format!("create {}", dir.display()), &e))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| ImageError::io(format!("chmod {}", dir.display()), &e))?;
        let dir = dir.canonicalize().map_err(|e| ImageError::io(format!("resolve {}", dir.display()), &e))?;
        for stale in mounts_below(&dir).map_err(|e| ImageError::io("read /proc/self/mountinfo", &e))? {
            warn!(mount = %stale.display(), "unmounting a job root left by an earlier worker");
            if let Err(e) = umount2(&stale, MntFlags::MNT_DETACH) {
                warn!(mount = %stale.display(), error = %e, "could not unmount a stale job root");
            }
        }
        for entry in fs::read_dir(&dir).map_err(|e| ImageError::io(format!("read {}", dir.display()), &e))? {
            let entry = entry.map_err(|e| ImageError::io(format!("read {}", dir.display()), &e))?;
            info!(root = %entry.path().display(), "removing a stale job root");
            let path = entry.path();
            let removed = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            removed.map_err(|e| ImageError::io(format!("remove {}", path.display()), &e))?;
        }
        let empty = dir.join(".empty");
        fs::create_dir(&empty).map_err(|e| ImageError::io(format!("create {}", empty.display()), &e))?;
        Ok(RootsDir { dir, empty })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Mounts a root at `<dir>/<key>/merged` over `lowers` (top layer first). `key` names the
    /// job's run (`[A-Za-z0-9._-]`, not starting with a dot) and must not be in use. `pin`
    /// travels with the root, keeping its image in the store.
    pub fn mount(&self, key: &str, lowers: &[PathBuf], pin: Option<ImagePin>) -> Result<JobRoot, ImageError> {
        if key.is_empty()
            || key.len() > MAX_KEY
            || key.starts_with('.')
            || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(ImageError::invalid_reference(format!(
                "job root key '{}' must be 1-{MAX_KEY} of [A-Za-z0-9._-], not starting with '.'",
                clip(key)
            )));
        }
        let dir = self.dir.join(key);
        fs::create_dir(&dir).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                ImageError::new(ErrorKind::InUse, format!("job root {key} exists"))
            } else {
                ImageError::io(format!("create {}", dir.display()), &e)
            }
        })?;
        let mut root = JobRoot { merged: dir.join("merged"), dir, mounted: false, _pin: pin };
        for (name, mode) in [("upper", 0o755), ("work", 0o700), ("merged", 0o755)] {
            let path = root.dir.join(name);
            fs::create_dir(&path)
                .and_then(|()| fs::set_permissions(&path, fs::Permissions::from_mode(mode)))
                .map_err(|e| ImageError::io(format!("create {}", path.display()), &e))?;
        }
        let lowers: Vec<&Path> =
            if lowers.is_empty() { vec![&self.empty] } else { lowers.iter().map(PathBuf::as_path).collect() };
        let open = |path: &Path| {
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
                .open(path)
                .map_err(|e| ImageError::io(format!("open {}", path.display()), &e))
        };
        let lower_files = lowers.iter().map(|p| open(p)).collect::<Result<Vec<File>, _>>()?;
        let upper = open(&root.dir.join("upper"))?;
        let work = open(&root.dir.join("work"))?;
        let fd_path = |f: &File| format!("/proc/self/fd/{}", f.as_raw_fd());
        let mut options = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower_files.iter().map(fd_path).collect::<Vec<_>>().join(":"),
            fd_path(&upper),
            fd_path(&work)
        );
        // The inodes index ties an upper directory to its lowers; roots never share an upper,
        // so it is turned off where the kernel has it, as Docker does.
        if Path::new("/sys/module/overlay/parameters/index").exists() {
            options.push_str(",index=off");
        }
        let page = page_size();
        if options.len() >= page {
            return Err(ImageError::unsupported(format!(
                "the image has {} layers, more than one overlay mount takes here ({} bytes of options, at most {})",
                lowers.len(),
                options.len(),
                page - 1
            )));
        }
        let options = CString::new(options).expect("no NUL in fd paths");
        mount(
            Some("overlay"),
            &root.merged,
            Some("overlay"),
            MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
            Some(options.as_c_str()),
        )
        .map_err(|e| ImageError::io(format!("mount the job root {key} (overlayfs)"), &io::Error::from(e)))?;
        root.mounted = true;
        Ok(root)
    }
}

/// A job's mounted root filesystem. [`JobRoot::remove`] (or dropping it) unmounts it and
/// deletes the job's writable layer.
#[derive(Debug)]
pub struct JobRoot {
    dir: PathBuf,
    merged: PathBuf,
    mounted: bool,
    _pin: Option<ImagePin>,
}

impl JobRoot {
    /// The root filesystem to run the job in (runc's `root.path`).
    pub fn path(&self) -> &Path {
        &self.merged
    }

    /// The job's writable layer: what the job changed (its size is the job's disk use).
    pub fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }

    /// Unmounts the root (lazily, should a process still hold it) and deletes the job's layer.
    pub fn remove(mut self) -> Result<(), ImageError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), ImageError> {
        if self.mounted {
            match umount2(&self.merged, MntFlags::MNT_DETACH) {
                Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => {
                    return Err(ImageError::io(format!("unmount {}", self.merged.display()), &io::Error::from(e)))
                }
            }
            self.mounted = false;
        }
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ImageError::io(format!("remove {}", self.dir.display()), &e)),
        }
    }
}

impl Drop for JobRoot {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            warn!(root = %self.dir.display(), error = %e, "could not remove a job root");
        }
    }
}

fn page_size() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().map_or(4096, |p| p as usize)
}

/// Mount points strictly below `dir`, deepest first.
pub(crate) fn mounts_below(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    let mut found: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .filter(|point| point.starts_with(dir) && point != dir)
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    Ok(found)
}

/// Mountinfo writes space, tab, newline and backslash in paths as `\ooo` octal.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            let value = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape_mountinfo(r"/var/lib/a\040b"), "/var/lib/a b");
        assert_eq!(unescape_mountinfo(r"/x\134y"), r"/x\y");
        assert_eq!(unescape_mountinfo(r"/plain"), "/plain");
        assert_eq!(unescape_mountinfo(r"/end\04"), r"/end\04");
    }

    #[test]
    fn keys_are_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let roots = RootsDir { dir: dir.path().to_path_buf(), empty: dir.path().join(".empty") };
        for key in ["", ".hidden", "a/b", "a b", &"k".repeat(MAX_KEY + 1)] {
            let e = roots.mount(key, &[], None).expect_err(key);
            assert_eq!(e.kind(), ErrorKind::InvalidReference, "{key}: {e}");
        }
    }
}
