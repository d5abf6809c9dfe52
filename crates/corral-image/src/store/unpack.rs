//! Unpacks one layer tar (plain, gzip or zstd, told apart by their first bytes) into a fresh
//! directory that will be an overlayfs lower directory, and returns the bytes it holds (and,
//! when asked, the digest of the uncompressed tar: the layer's `diff_id`).
//!
//! OCI whiteouts become overlayfs ones: `.wh.NAME` a character device 0/0 named `NAME`, an
//! opaque marker `.wh..wh..opq` the `trusted.overlay.opaque=y` attribute on its directory.
//! Modes (set-id bits included), owners, modification times, symlinks, hard links, device
//! nodes and FIFOs are kept; extended attributes of entries are not (jobs run without
//! capabilities, so file capabilities would do nothing).
//!
//! Nothing is written outside the directory: an entry whose path has `..`, a hard link to an
//! absolute or `..` path, or an entry below a symlink (or a file) of the layer is refused, and
//! the error names the entry. The directory is written by this function alone, so checking each
//! parent with `lstat` before writing is enough.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc;

use filetime::FileTime;
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use tar::EntryType;

use crate::digest::{clip, Digest, Hasher};
use crate::error::{ErrorKind, ImageError, Needs};

/// The prefix of a whiteout entry's name.
const WHITEOUT_PREFIX: &str = ".wh.";
/// The name of an opaque-directory marker.
const OPAQUE_MARKER: &str = ".wh..wh..opq";
/// The attribute overlayfs reads to hide a lower directory's contents.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// A layer over the store's `max-size` is still counted (not written) up to this many times
/// `max-size`, so its error can say what it needs; past that it needs "more than" the count.
const COUNT_PAST_LIMIT: u64 = 4;

/// The buffer between the decompressor and the files.
const COPY_BUFFER: usize = 256 * 1024;

/// What one unpacked layer holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Unpacked {
    /// Bytes of file contents and symlink targets: what the layer costs the store.
    pub size: u64,
    /// The digest of the uncompressed tar, when asked for.
    pub diff_id: Option<Digest>,
}

/// How a layer blob is compressed, from its first bytes (as Docker tells them apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub(crate) fn sniff(magic: &[u8]) -> Compression {
        if magic.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// Unpacks the layer read from `input` into `dest` (an empty directory), reading `input` to its
/// end unless an entry is refused or the data is corrupt. `diff_id` asks for the digest of the
/// uncompressed tar (a pull needs none: the blob's own digest identifies the layer). A layer
/// that unpacks to more than `limit` bytes (file contents, and 512 bytes per entry) is refused
/// as it goes, with [`ErrorKind::TooLarge`]: a small blob cannot fill the disk. The rest of
/// such a layer is counted without being written, up to `COUNT_PAST_LIMIT` times `limit`, so
/// the error says how much it needs.
///
/// Decompression runs on a thread of its own, ahead of the thread that writes the files (as
/// Docker and containerd hand gzip to `unpigz`): a large layer is unpacked at the pace of the
/// slower of the two rather than of both in turn.
pub(crate) fn unpack_layer(
    mut input: impl Read + Send,
    dest: &Path,
    diff_id: bool,
    limit: u64,
) -> Result<Unpacked, ImageError> {
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match input.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(corrupt(&e)),
        }
    }
    let compression = Compression::sniff(&magic[..got]);
    let input = io::Cursor::new(magic[..got].to_vec()).chain(input);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel(DECODED_BATCHES);
        let decoder = scope.spawn(move || decode(input, compression, diff_id, tx));
        let size = unpack_tar(PipeReader { rx, current: Vec::new(), at: 0 }, dest, limit);
        // The pipe is closed now: a decoder still sending stops.
        let decoded = decoder.join().unwrap_or_else(|_| Err(io::Error::other("the decompressing thread panicked")));
        let size = size?;
        let diff_id = decoded.map_err(|e| corrupt(&e))?;
        Ok(Unpacked { size, diff_id })
    })
}

/// Decompressed bytes handed from the decoding thread to the unpacking one at a time.
const DECODED_BATCH: usize = 256 * 1024;
/// Batches in flight between them.
const DECODED_BATCHES: usize = 8;

/// The decoding thread: decompresses `input` to its end in batches (hashing them when the
/// diff_id is wanted). An error is sent down the pipe; a closed pipe ends it early.
fn decode(
    input: impl Read,
    compression: Compression,
    diff_id: bool,
    tx: mpsc::SyncSender<io::Result<Vec<u8>>>,
) -> io::Result<Option<Digest>> {
    let mut decoded: Box<dyn Read> = match compression {
        Compression::None => Box::new(input),
        Compression::Gzip => {
            Box::new(flate2::read::MultiGzDecoder::new(io::BufReader::with_capacity(COPY_BUFFER, input)))
        }
        Compression::Zstd => match zstd::stream::read::Decoder::new(input) {
            Ok(decoder) => Box::new(decoder),
            Err(e) => {
                let _ = tx.send(Err(io::Error::new(e.kind(), e.to_string())));
                return Err(e);
            }
        },
    };
    let mut hasher = diff_id.then(Hasher::new);
    loop {
        let mut batch = vec![0u8; DECODED_BATCH];
        let mut filled = 0;
        while filled < batch.len() {
            match decoded.read(&mut batch[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = tx.send(Err(io::Error::new(e.kind(), e.to_string())));
                    return Err(e);
                }
            }
        }
        if filled == 0 {
            return Ok(hasher.map(Hasher::finish));
        }
        batch.truncate(filled);
        if let Some(hasher) = hasher.as_mut() {
            hasher.update(&batch);
        }
        if tx.send(Ok(batch)).is_err() {
            return Err(io::Error::other("the unpacking stopped"));
        }
    }
}

/// The unpacking thread's end of the pipe.
struct PipeReader {
    rx: mpsc::Receiver<io::Result<Vec<u8>>>,
    current: Vec<u8>,
    at: usize,
}

impl Read for PipeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.current.len() {
            match self.rx.recv() {
                Ok(batch) => {
                    self.current = batch?;
                    self.at = 0;
                }
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len() - self.at);
        buf[..n].copy_from_slice(&self.current[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Writes the entries of an uncompressed tar; returns the bytes they hold. The rest of the
/// stream (the tar's end blocks, padding) is read too, so the decoder sees it all.
fn unpack_tar(input: PipeReader, dest: &Path, limit: u64) -> Result<u64, ImageError> {
    let mut archive = tar::Archive::new(input);
    let mut unpacker =
        Unpacker { root: dest, dirs: BTreeMap::new(), size: 0, charged: 0, limit, buffer: vec![0; COPY_BUFFER] };
    let mut entries = archive.entries().map_err(|e| corrupt(&e))?;
    while let Some(entry) = entries.next() {
        let mut entry = entry.map_err(|e| corrupt(&e))?;
        let before = unpacker.charged;
        match unpacker.entry(&mut entry) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::TooLarge => {
                return Err(count_the_rest(before.saturating_add(counted(&mut entry)), entries, limit))
            }
            Err(e) => return Err(e),
        }
    }
    unpacker.finish_dirs()?;
    io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(|e| corrupt(&e))?;
    Ok(unpacker.size)
}

/// The error of a layer found larger than `limit`: what it needs, its entries after the one that
/// passed the limit counted (their contents skipped, not written) up to `COUNT_PAST_LIMIT`
/// times the limit. A corrupt rest ends the count where it is.
fn count_the_rest<R: Read>(mut needs: u64, entries: tar::Entries<'_, R>, limit: u64) -> ImageError {
    let cap = limit.saturating_mul(COUNT_PAST_LIMIT);
    let mut more = needs > cap;
    if !more {
        for entry in entries {
            let Ok(mut entry) = entry else { break };
            needs = needs.saturating_add(counted(&mut entry));
            if needs > cap {
                more = true;
                break;
            }
        }
    }
    ImageError::too_large("the layer", Needs { bytes: needs, max_size: limit, more })
}

/// What an entry costs the store, as `Unpacker::charge` counts it: a header's 512 bytes and its
/// contents (a symlink: its target).
fn counted<R: Read>(entry: &mut tar::Entry<'_, R>) -> u64 {
    let contents = match entry.header().entry_type() {
        EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => entry.size(),
        EntryType::Symlink => entry.link_name_bytes().map_or(0, |t| t.len() as u64),
        _ => 0,
    };
    512u64.saturating_add(contents)
}

fn corrupt(error: &io::Error) -> ImageError {
    ImageError::invalid_layer(format!("corrupt layer archive: {error}"))
}

/// The metadata of one entry, PAX records applied.
struct Meta {
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: i64,
}

struct Unpacker<'a> {
    root: &'a Path,
    /// Directories whose owner, mode and time are set at the end (their contents change their
    /// time), by path.
    dirs: BTreeMap<PathBuf, Meta>,
    size: u64,
    /// What the layer has cost so far against `limit`: `size` and a header's worth per entry.
    charged: u64,
    limit: u64,
    buffer: Vec<u8>,
}

impl Unpacker<'_> {
    fn charge(&mut self, bytes: u64, rel: &Path) -> Result<(), ImageError> {
        self.charged = self.charged.saturating_add(bytes);
        if self.charged > self.limit {
            return Err(ImageError::new(
                ErrorKind::TooLarge,
                format!("the layer unpacks to more than the store's max-size, at entry '{}'", shown(rel)),
            ));
        }
        Ok(())
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), ImageError> {
        let raw_path = entry.path_bytes().into_owned();
        let rel = relative_path(&raw_path)?;
        let meta = entry_meta(entry)?;
        let kind = entry.header().entry_type();
        self.charge(512, &rel)?;
        if rel.as_os_str().is_empty() && kind != EntryType::Directory {
            return Err(ImageError::invalid_layer(format!(
                "entry '{}' names the layer's root but is not a directory",
                clip(&String::from_utf8_lossy(&raw_path))
            )));
        }

        let name = rel.file_name().map(OsStr::as_bytes).unwrap_or_default();
        if name == OPAQUE_MARKER.as_bytes() {
            let dir = rel.parent().unwrap_or(Path::new(""));
            self.prepare(dir, true, &rel)?;
            let path = self.root.join(dir);
            if fs::symlink_metadata(&path).is_err() {
                fs::create_dir(&path).map_err(|e| ImageError::io(format!("create {}", shown(dir)), &e))?;
            }
            return xattr::set(&path, OPAQUE_XATTR, b"y")
                .map_err(|e| ImageError::io(format!("mark {} opaque", shown(dir)), &e));
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            if hidden.starts_with(WHITEOUT_PREFIX.as_bytes()) || hidden.is_empty() {
                return Ok(()); // aufs metadata (.wh..wh.plnk, ...): nothing to do in overlayfs
            }
            let target = rel.with_file_name(OsStr::from_bytes(hidden));
            self.prepare(&target, false, &rel)?;
            let path = self.root.join(&target);
            mknod(&path, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0))
                .map_err(|e| ImageError::io(format!("whiteout {}", shown(&target)), &io::Error::from(e)))?;
            return self.own(&path, &meta, false, &target);
        }

        match kind {
            EntryType::Directory => {
                self.prepare(&rel, true, &rel)?;
                let path = self.root.join(&rel);
                if !path.is_dir() {
                    fs::create_dir(&path).map_err(|e| ImageError::io(format!("create {}", shown(&rel)), &e))?;
                }
                self.dirs.insert(rel, meta);
                Ok(())
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                self.prepare(&rel, false, &rel)?;
                let path = self.root.join(&rel);
                let mut file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&path)
                    .map_err(|e| ImageError::io(format!("create {}", shown(&rel)), &e))?;
                loop {
                    let n = match entry.read(&mut self.buffer) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(corrupt(&e).context(format!("entry '{}'", shown(&rel)))),
                    };
                    self.charge(n as u64, &rel)?;
                    file.write_all(&self.buffer[..n])
                        .map_err(|e| ImageError::io(format!("write {}", shown(&rel)), &e))?;
                    self.size += n as u64;
                }
                set_file_meta(&file, &meta).map_err(|e| ImageError::io(format!("set owner of {}", shown(&rel)), &e))
            }
            EntryType::Symlink => {
                let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                if target.is_empty() {
                    return Err(ImageError::invalid_layer(format!("symlink '{}' has no target", shown(&rel))));
                }
                self.prepare(&rel, false, &rel)?;
                let path = self.root.join(&rel);
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), &path)
                    .map_err(|e| ImageError::io(format!("symlink {}", shown(&rel)), &e))?;
                self.size += target.len() as u64;
                self.own(&path, &meta, true, &rel)
            }
            EntryType::Link => {
                let raw_target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                let target = link_target(&rel, &raw_target)?;
                self.check_parents(&target, &rel)?;
                let source = self.root.join(&target);
                match fs::symlink_metadata(&source) {
                    Ok(m) if m.is_dir() => {
                        return Err(ImageError::invalid_layer(format!(
                            "hard link '{}' points to the directory '{}'",
                            shown(&rel),
                            shown(&target)
                        )))
                    }
                    Ok(_) => {}
                    Err(_) => {
                        return Err(ImageError::invalid_layer(format!(
                            "hard link '{}' points to '{}', which is not in the layer before it",
                            shown(&rel),
                            shown(&target)
                        )))
                    }
                }
                if target == rel {
                    return Ok(());
                }
                self.prepare(&rel, false, &rel)?;
                fs::hard_link(&source, self.root.join(&rel))
                    .map_err(|e| ImageError::io(format!("hard link {}", shown(&rel)), &e))
            }
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                self.prepare(&rel, false, &rel)?;
                let path = self.root.join(&rel);
                let (flag, dev) = match kind {
                    EntryType::Char => (SFlag::S_IFCHR, device(entry)?),
                    EntryType::Block => (SFlag::S_IFBLK, device(entry)?),
                    _ => (SFlag::S_IFIFO, 0),
                };
                mknod(&path, flag, Mode::from_bits_truncate(meta.mode & 0o777), dev)
                    .map_err(|e| ImageError::io(format!("create node {}", shown(&rel)), &io::Error::from(e)))?;
                self.own(&path, &meta, false, &rel)
            }
            // Extension headers are consumed by the tar reader; anything else has no file form.
            _ => Ok(()),
        }
    }

    /// Makes `rel`'s parents directories of this layer (creating missing ones) and removes
    /// what is at `rel` unless both it and the new entry are directories. `entry` names the
    /// entry in errors.
    fn prepare(&mut self, rel: &Path, is_dir: bool, entry: &Path) -> Result<(), ImageError> {
        if rel.as_os_str().is_empty() {
            return Ok(());
        }
        if let Some(parent) = rel.parent() {
            let mut at = PathBuf::new();
            for part in parent.components() {
                at.push(part);
                let path = self.root.join(&at);
                match fs::symlink_metadata(&path) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        return Err(ImageError::invalid_layer(format!(
                            "entry '{}' would be written through '{}', which is not a directory of the layer",
                            shown(entry),
                            shown(&at)
                        )))
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        fs::create_dir(&path).map_err(|e| ImageError::io(format!("create {}", shown(&at)), &e))?;
                        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
                            .map_err(|e| ImageError::io(format!("chmod {}", shown(&at)), &e))?;
                    }
                    Err(e) => return Err(ImageError::io(format!("stat {}", shown(&at)), &e)),
                }
            }
        }
        let path = self.root.join(rel);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() && is_dir => Ok(()),
            Ok(m) if m.is_dir() => {
                self.dirs.retain(|dir, _| !dir.starts_with(rel));
                fs::remove_dir_all(&path).map_err(|e| ImageError::io(format!("replace {}", shown(rel)), &e))
            }
            Ok(_) => fs::remove_file(&path).map_err(|e| ImageError::io(format!("replace {}", shown(rel)), &e)),
            Err(_) => Ok(()),
        }
    }

    /// Refuses a hard link target below a symlink or file of the layer.
    fn check_parents(&self, target: &Path, entry: &Path) -> Result<(), ImageError> {
        let mut at = PathBuf::new();
        for part in target.parent().unwrap_or(Path::new("")).components() {
            at.push(part);
            match fs::symlink_metadata(self.root.join(&at)) {
                Ok(m) if m.is_dir() => {}
                _ => {
                    return Err(ImageError::invalid_layer(format!(
                        "hard link '{}' points through '{}', which is not a directory of the layer",
                        shown(entry),
                        shown(&at)
                    )))
                }
            }
        }
        Ok(())
    }

    /// Owner, then mode (a chown clears set-id bits), then time, of a non-directory that is
    /// not a regular file.
    fn own(&self, path: &Path, meta: &Meta, symlink: bool, rel: &Path) -> Result<(), ImageError> {
        let error = |e: io::Error| ImageError::io(format!("set owner of {}", shown(rel)), &e);
        std::os::unix::fs::lchown(path, Some(id(meta.uid)), Some(id(meta.gid))).map_err(error)?;
        let time = FileTime::from_unix_time(meta.mtime, 0);
        if symlink {
            filetime::set_symlink_file_times(path, time, time).map_err(error)
        } else {
            fs::set_permissions(path, fs::Permissions::from_mode(meta.mode & 0o7777)).map_err(error)?;
            filetime::set_symlink_file_times(path, time, time).map_err(error)
        }
    }

    /// Owners, modes and times of the directories, deepest first.
    fn finish_dirs(&mut self) -> Result<(), ImageError> {
        for (rel, meta) in self.dirs.iter().rev() {
            let path = self.root.join(rel);
            let error = |e: io::Error| ImageError::io(format!("set owner of {}", shown(rel)), &e);
            std::os::unix::fs::lchown(&path, Some(id(meta.uid)), Some(id(meta.gid))).map_err(error)?;
            fs::set_permissions(&path, fs::Permissions::from_mode(meta.mode & 0o7777)).map_err(error)?;
            let time = FileTime::from_unix_time(meta.mtime, 0);
            filetime::set_symlink_file_times(&path, time, time).map_err(error)?;
        }
        Ok(())
    }
}

fn set_file_meta(file: &File, meta: &Meta) -> io::Result<()> {
    std::os::unix::fs::fchown(file, Some(id(meta.uid)), Some(id(meta.gid)))?;
    file.set_permissions(fs::Permissions::from_mode(meta.mode & 0o7777))?;
    let time = FileTime::from_unix_time(meta.mtime, 0);
    filetime::set_file_handle_times(file, Some(time), Some(time))
}

/// Ids beyond 32 bits do not exist on Linux; such an entry is owned by `nobody`'s id.
fn id(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(65534)
}

fn device<R: Read>(entry: &tar::Entry<'_, R>) -> Result<libc::dev_t, ImageError> {
    let header = entry.header();
    let major = header.device_major().ok().flatten().unwrap_or(0);
    let minor = header.device_minor().ok().flatten().unwrap_or(0);
    Ok(makedev(u64::from(major), u64::from(minor)))
}

/// The entry's metadata: the ustar/GNU header, with PAX `uid`, `gid` and `mtime` records on
/// top (Go's archive/tar writes large ids and sub-second times there).
fn entry_meta<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<Meta, ImageError> {
    let header = entry.header();
    let mut meta = Meta {
        mode: header.mode().unwrap_or(0o644),
        uid: header.uid().unwrap_or(0),
        gid: header.gid().unwrap_or(0),
        mtime: header.mtime().map_or(0, |t| i64::try_from(t).unwrap_or(0)),
    };
    if let Ok(Some(extensions)) = entry.pax_extensions() {
        for extension in extensions.flatten() {
            let Ok(value) = extension.value() else { continue };
            match extension.key() {
                Ok("uid") => meta.uid = value.parse().unwrap_or(meta.uid),
                Ok("gid") => meta.gid = value.parse().unwrap_or(meta.gid),
                Ok("mtime") => {
                    let seconds = value.split('.').next().unwrap_or(value);
                    meta.mtime = seconds.parse().unwrap_or(meta.mtime);
                }
                _ => {}
            }
        }
    }
    Ok(meta)
}

/// An entry's path inside the layer: a leading `/` and `.` parts dropped (as tar and Docker
/// do); `..` refused.
fn relative_path(raw: &[u8]) -> Result<PathBuf, ImageError> {
    let mut out = PathBuf::new();
    for part in Path::new(OsStr::from_bytes(raw)).components() {
        match part {
            Component::Normal(name) => out.push(name),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                return Err(ImageError::invalid_layer(format!(
                    "entry '{}' leaves the layer directory ('..')",
                    clip(&String::from_utf8_lossy(raw))
                )))
            }
        }
    }
    Ok(out)
}

/// A hard link's target inside the layer; absolute targets and `..` are refused.
fn link_target(rel: &Path, raw: &[u8]) -> Result<PathBuf, ImageError> {
    let text = String::from_utf8_lossy(raw);
    if raw.is_empty() {
        return Err(ImageError::invalid_layer(format!("hard link '{}' has no target", shown(rel))));
    }
    if raw.starts_with(b"/") {
        return Err(ImageError::invalid_layer(format!(
            "hard link '{}' points to the absolute path '{}'",
            shown(rel),
            clip(&text)
        )));
    }
    let target = relative_path(raw).map_err(|_| {
        ImageError::invalid_layer(format!("hard link '{}' points outside the layer ('{}')", shown(rel), clip(&text)))
    })?;
    if target.as_os_str().is_empty() {
        return Err(ImageError::invalid_layer(format!("hard link '{}' points to the layer's root", shown(rel))));
    }
    Ok(target)
}

fn shown(path: &Path) -> String {
    clip(&path.to_string_lossy())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    /// One tar entry of a test layer.
    enum E<'a> {
        Dir(&'a str, u32),
        File(&'a str, &'a [u8], u32),
        Symlink(&'a str, &'a str),
        Hardlink(&'a str, &'a str),
    }

    fn tar(entries: &[E<'_>]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for entry in entries {
            let mut header = tar::Header::new_gnu();
            header.set_uid(1000);
            header.set_gid(1001);
            header.set_mtime(1_600_000_000);
            let (path, data): (&str, &[u8]) = match entry {
                E::Dir(path, mode) => {
                    header.set_entry_type(EntryType::Directory);
                    header.set_mode(*mode);
                    (path, &[])
                }
                E::File(path, data, mode) => {
                    header.set_entry_type(EntryType::Regular);
                    header.set_mode(*mode);
                    (path, data)
                }
                E::Symlink(path, target) | E::Hardlink(path, target) => {
                    header.set_entry_type(if matches!(entry, E::Symlink(..)) {
                        EntryType::Symlink
                    } else {
                        EntryType::Link
                    });
                    header.set_mode(0o777);
                    // Written raw: the builder's own checks would refuse the hostile cases.
                    let name = header.as_old_mut();
                    name.linkname[..target.len()].copy_from_slice(target.as_bytes());
                    (path, &[])
                }
            };
            header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
            header.set_size(data.len() as u64);
            header.set_cksum();
            builder.append(&header, data).expect("append");
        }
        builder.into_inner().expect("tar")
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(data).expect("gzip");
        encoder.finish().expect("gzip")
    }

    #[test]
    fn layers_unpack_with_modes_owners_links_and_whiteouts() {
        if !crate::test_needs_root() {
            return;
        }
        let layer = tar(&[
            E::Dir("./", 0o755),
            E::Dir("etc/", 0o750),
            E::File("etc/app.conf", b"k=v\n", 0o640),
            E::File("usr/bin/tool", b"#!/bin/sh\n", 0o4755),
            E::Symlink("usr/bin/alias", "/usr/bin/tool"),
            E::Hardlink("usr/bin/tool2", "usr/bin/tool"),
            E::File("old/.wh.gone", b"", 0o644),
            E::File("hidden/.wh..wh..opq", b"", 0o644),
            E::File("hidden/kept", b"x", 0o644),
        ]);
        for compressed in [layer.clone(), gzip(&layer), zstd::encode_all(&layer[..], 1).expect("zstd")] {
            let dir = tempfile::tempdir().expect("tempdir");
            let out = unpack_layer(&compressed[..], dir.path(), true, u64::MAX).expect("unpack");
            assert_eq!(out.diff_id, Some(Digest::of(&layer)), "the diff id is the uncompressed tar's digest");
            assert_eq!(out.size, 4 + 10 + "/usr/bin/tool".len() as u64 + 1);
            let root = dir.path();
            let conf = fs::metadata(root.join("etc/app.conf")).expect("conf");
            assert_eq!(
                (conf.mode() & 0o7777, conf.uid(), conf.gid(), conf.mtime()),
                (0o640, 1000, 1001, 1_600_000_000)
            );
            assert_eq!(fs::metadata(root.join("etc")).expect("etc").mode() & 0o7777, 0o750);
            assert_eq!(fs::metadata(root.join("etc")).expect("etc").mtime(), 1_600_000_000, "dir times are set last");
            assert_eq!(fs::metadata(root.join("usr/bin/tool")).expect("tool").mode() & 0o7777, 0o4755, "set-id kept");
            assert_eq!(fs::read_link(root.join("usr/bin/alias")).expect("link"), Path::new("/usr/bin/tool"));
            assert_eq!(
                fs::metadata(root.join("usr/bin/tool2")).expect("hardlink").ino(),
                fs::metadata(root.join("usr/bin/tool")).expect("tool").ino()
            );
            let whiteout = fs::symlink_metadata(root.join("old/gone")).expect("whiteout");
            assert!(whiteout.file_type().is_char_device() && whiteout.rdev() == 0, "whiteout is a 0/0 char device");
            assert!(!root.join("old/.wh.gone").exists());
            assert_eq!(xattr::get(root.join("hidden"), OPAQUE_XATTR).expect("xattr"), Some(b"y".to_vec()));
            assert!(root.join("hidden/kept").exists());
            assert!(!root.join("hidden/.wh..wh..opq").exists());
        }
    }

    #[test]
    fn escaping_entries_are_refused_and_named() {
        if !crate::test_needs_root() {
            return;
        }
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (tar(&[E::File("../evil", b"x", 0o644)]), "entry '../evil' leaves the layer directory"),
            (tar(&[E::File("a/../../evil", b"x", 0o644)]), "entry 'a/../../evil' leaves the layer"),
            (
                tar(&[E::Hardlink("passwd", "/etc/passwd")]),
                "hard link 'passwd' points to the absolute path '/etc/passwd'",
            ),
            (tar(&[E::Hardlink("passwd", "../../etc/passwd")]), "hard link 'passwd' points outside the layer"),
            (
                tar(&[E::Symlink("etc", "/etc"), E::File("etc/passwd", b"x", 0o644)]),
                "entry 'etc/passwd' would be written through 'etc'",
            ),
            (
                tar(&[E::Symlink("up", "../../.."), E::File("up/x/evil", b"x", 0o644)]),
                "entry 'up/x/evil' would be written through 'up'",
            ),
            (
                tar(&[E::Dir("d", 0o755), E::Symlink("d/l", "/"), E::Hardlink("h", "d/l/etc/shadow")]),
                "hard link 'h' points through 'd/l'",
            ),
            (tar(&[E::Hardlink("h", "missing")]), "points to 'missing', which is not in the layer before it"),
        ];
        for (layer, needle) in cases {
            let dir = tempfile::tempdir().expect("tempdir");
            let root = dir.path().join("root");
            fs::create_dir(&root).expect("root");
            let e = unpack_layer(&layer[..], &root, false, u64::MAX).expect_err(needle);
            assert_eq!(e.kind(), ErrorKind::InvalidLayer, "{e}");
            assert!(e.to_string().contains(needle), "{e} does not say {needle}");
            assert!(!dir.path().join("evil").exists() && !dir.path().join("root/evil").exists());
        }
    }

    #[test]
    fn corrupt_archives_are_invalid_layers() {
        if !crate::test_needs_root() {
            return;
        }
        let layer = gzip(&tar(&[E::File("a", &[7u8; 4096], 0o644)]));
        let cut = &layer[..layer.len() / 2];
        let dir = tempfile::tempdir().expect("tempdir");
        let e = unpack_layer(cut, dir.path(), false, u64::MAX).expect_err("truncated");
        assert_eq!(e.kind(), ErrorKind::InvalidLayer, "{e}");
        assert!(e.to_string().contains("corrupt"), "{e}");
        // An empty blob is an empty tar: some images have one.
        let empty =
            unpack_layer(&[][..], tempfile::tempdir().expect("tempdir").path(), false, u64::MAX).expect("empty");
        assert_eq!(empty.size, 0);
    }

    #[test]
    fn later_entries_replace_earlier_ones() {
        if !crate::test_needs_root() {
            return;
        }
        let layer = tar(&[
            E::Dir("d", 0o755),
            E::File("d/f", b"1", 0o644),
            E::File("d", b"now a file", 0o644),
            E::File("x", b"first", 0o644),
            E::Symlink("x", "elsewhere"),
        ]);
        let dir = tempfile::tempdir().expect("tempdir");
        unpack_layer(&layer[..], dir.path(), false, u64::MAX).expect("unpack");
        assert_eq!(fs::read(dir.path().join("d")).expect("d"), b"now a file");
        assert_eq!(fs::read_link(dir.path().join("x")).expect("x"), Path::new("elsewhere"));
    }

    #[test]
    fn a_layer_larger_unpacked_than_the_store_allows_is_refused() {
        if !crate::test_needs_root() {
            return;
        }
        // 4 MB of zeros compress to a few kilobytes.
        let bomb = gzip(&tar(&[E::File("zeros", &vec![0u8; 4 << 20], 0o644)]));
        assert!(bomb.len() < 64 << 10);
        let dir = tempfile::tempdir().expect("tempdir");
        let e = unpack_layer(&bomb[..], dir.path(), false, 2 << 20).expect_err("too big");
        assert_eq!(e.kind(), ErrorKind::TooLarge, "{e}");
        // The whole layer is counted: its 4 MiB file and its header.
        assert_eq!(e.needs(), Some(Needs { bytes: (4 << 20) + 512, max_size: 2 << 20, more: false }), "{e}");
        assert_eq!(e.reason(), "the layer needs 4.2 MB, store max-size is 2.1 MB");
        // Past four times max-size the count stops: the cost of a bomb stays bounded.
        let e = unpack_layer(&bomb[..], tempfile::tempdir().expect("tempdir").path(), false, 100 << 10)
            .expect_err("too big");
        let needs = e.needs().expect("needs");
        assert!(needs.more && needs.bytes > 400 << 10, "{e}");
        assert!(e.reason().starts_with("the layer needs more than "), "{e}");
        let many = tar(&(0..100)
            .map(|i| format!("f{i}"))
            .collect::<Vec<_>>()
            .iter()
            .map(|n| E::File(n, b"", 0o644))
            .collect::<Vec<_>>());
        assert!(unpack_layer(&many[..], dir.path(), false, 10 * 512).is_err(), "entries count too");
        let root_file = tar(&[E::File("./", b"x", 0o644)]);
        let e = unpack_layer(&root_file[..], tempfile::tempdir().expect("tempdir").path(), false, u64::MAX)
            .expect_err("root");
        assert!(e.to_string().contains("names the layer's root but is not a directory"), "{e}");
    }
}
