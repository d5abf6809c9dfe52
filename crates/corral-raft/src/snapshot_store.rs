//! Snapshot files on disk, and `SnapshotFile`, the file-backed data openraft reads chunks from
//! when it sends a snapshot and writes chunks into when it receives one.
//!
//! A store's `snapshots/` directory holds:
//! - `CURRENT`: JSON naming the current snapshot: its meta, its body file, and whether the body
//!   carries the history or leaves it in the state machine's history store. Replaced by an atomic
//!   rename, and only ever names a whole, synced body.
//! - `<index>-<n>.body`: a snapshot body, one `StateSnapshot` message; never changed once named.
//! - `<index>-<n>.ids`: request ids (entries of `StateSnapshot.request_id_table`) of a
//!   snapshot this store built; never changed once named. A built body leaves its request ids
//!   out; CURRENT names the files that hold them: each build writes the ids recorded since the
//!   one before, and drops files whose ids all expired (see `request_ids.rs`).
//! - `send-<body>`: the body of a snapshot whose history is in the store, with its request ids
//!   and history added: made the first time a follower needs it, kept until the next snapshot.
//! - `*.tmp`: bodies being written or received, removed on open.
//! - `current.snap`: the single-file format of earlier versions (meta first, then a body with
//!   the history), converted on open.
//!
//! Invariant: CURRENT only moves forward. A build and an install can run at once; each writes
//! its own temporary file and publishes it only if CURRENT is not newer.

use crate::types::NodeId;
use openraft::SnapshotMeta;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::io::{Read, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};

pub(crate) type SnapshotMetaT = SnapshotMeta<NodeId, openraft::BasicNode>;

const CURRENT: &str = "CURRENT";
const LEGACY_FILE: &str = "current.snap";
const BODY_EXT: &str = "body";
const IDS_EXT: &str = "ids";
const TMP_EXT: &str = "tmp";
/// A file being written is synced every this many bytes, so a large one never leaves hundreds
/// of megabytes of dirty pages for the Raft log's next fsync to wait behind.
const SYNC_EVERY_BYTES: usize = 8 << 20;

/// What CURRENT says of the current snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Current {
    pub meta: SnapshotMetaT,
    /// The body's file name in the directory.
    pub body: String,
    /// The body holds the hot state only; the history is the store's, which was synced at
    /// least up to the snapshot's index before the body was published.
    #[serde(default)]
    pub history_in_store: bool,
    /// Files with the request ids of a body that leaves them out, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_ids: Vec<RequestIdFile>,
}

/// A file of request ids named by CURRENT.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RequestIdFile {
    pub name: String,
    /// Entries in it.
    pub entries: u64,
    /// The latest submit time of its entries: once request ids submitted before this later
    /// have expired, every one of them has.
    pub max_at: u64,
}

/// The request-id files a snapshot being published names: files of CURRENT it keeps, and
/// maybe a file just written (`tmp`, synced) with `entries` entries up to `max_at`.
pub(crate) struct IdFiles<'a> {
    pub keep: Vec<RequestIdFile>,
    pub new: Option<(&'a Path, u64, u64)>,
}

impl IdFiles<'_> {
    /// A body that holds its request ids itself.
    pub(crate) fn none() -> Self {
        IdFiles { keep: Vec::new(), new: None }
    }
}

/// The snapshot directory of one state machine store.
pub(crate) struct SnapshotDir {
    dir: PathBuf,
    /// Serializes publishing (a build and an install may race) and making send bodies.
    publish: Mutex<()>,
    pub(crate) send: Mutex<()>,
    next: AtomicU64,
}

impl SnapshotDir {
    /// Opens `dir`, removes what an interrupted write left, and converts a snapshot file of the
    /// earlier single-file format.
    pub(crate) fn open(dir: &Path) -> std::io::Result<SnapshotDir> {
        std::fs::create_dir_all(dir)?;
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == TMP_EXT) {
                std::fs::remove_file(&path)?;
            }
        }
        let snapshots = SnapshotDir {
            dir: dir.to_path_buf(),
            publish: Mutex::new(()),
            send: Mutex::new(()),
            next: AtomicU64::new(0),
        };
        snapshots.convert_legacy()?;
        Ok(snapshots)
    }

    fn convert_legacy(&self) -> std::io::Result<()> {
        let legacy = self.dir.join(LEGACY_FILE);
        let mut file = match std::fs::File::open(&legacy) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut len = [0u8; 8];
        file.read_exact(&mut len)?;
        let len = usize::try_from(u64::from_be_bytes(len))
            .ok()
            .filter(|l| *l < 64 << 20)
            .ok_or_else(|| invalid("corrupt snapshot file"))?;
        let mut meta = vec![0u8; len];
        file.read_exact(&mut meta)?;
        let meta: SnapshotMetaT = serde_json::from_slice(&meta).map_err(invalid)?;
        let tmp = self.temp_path("legacy");
        let mut out = SyncedWriter::create(&tmp)?;
        std::io::copy(&mut file, &mut out)?;
        out.finish()?;
        self.publish(&meta, &tmp, false, IdFiles::none())?;
        let _ = std::fs::remove_file(&tmp);
        std::fs::remove_file(&legacy)?;
        tracing::info!(snapshot = %meta.snapshot_id, "converted the snapshot file to the current format");
        Ok(())
    }

    /// The current snapshot, if any.
    pub(crate) fn current(&self) -> std::io::Result<Option<Current>> {
        match std::fs::read(self.dir.join(CURRENT)) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(invalid),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A fresh path for a file being written; `open` removes such files.
    pub(crate) fn temp_path(&self, what: &str) -> PathBuf {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{what}-{}-{n}.{TMP_EXT}", std::process::id()))
    }

    /// The name of the body with the history added, for the body named `body`.
    pub(crate) fn send_name(body: &str) -> String {
        format!("send-{body}")
    }

    /// Makes the synced file `tmp` the current snapshot, with the request-id files `ids`,
    /// unless CURRENT is newer. Returns what CURRENT now says, or None (and leaves the
    /// temporary files to the caller) when it is newer. Removes the bodies and request-id files
    /// it no longer names.
    pub(crate) fn publish(
        &self,
        meta: &SnapshotMetaT,
        tmp: &Path,
        history_in_store: bool,
        ids: IdFiles<'_>,
    ) -> std::io::Result<Option<Current>> {
        let _guard = self.publish.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.current().ok().flatten();
        if current.is_some_and(|c| c.meta.last_log_id > meta.last_log_id) {
            return Ok(None);
        }
        let index = meta.last_log_id.map_or(0, |l| l.index);
        let mut request_ids = ids.keep;
        if let Some((ids_tmp, entries, max_at)) = ids.new {
            let name = format!("{index}-{}.{IDS_EXT}", self.next.fetch_add(1, Ordering::Relaxed));
            std::fs::rename(ids_tmp, self.dir.join(&name))?;
            request_ids.push(RequestIdFile { name, entries, max_at });
        }
        let body = format!("{index}-{}.{BODY_EXT}", self.next.fetch_add(1, Ordering::Relaxed));
        std::fs::rename(tmp, self.dir.join(&body))?;
        // The renamed files are in the directory before CURRENT names them.
        std::fs::File::open(&self.dir)?.sync_all()?;
        let current = Current { meta: meta.clone(), body: body.clone(), history_in_store, request_ids };
        let pointer = self.temp_path("current");
        let mut out = SyncedWriter::create(&pointer)?;
        out.write_all(&serde_json::to_vec(&current).map_err(invalid)?)?;
        out.finish()?;
        std::fs::rename(&pointer, self.dir.join(CURRENT))?;
        std::fs::File::open(&self.dir)?.sync_all()?;
        // Readers that opened a replaced body keep reading it: the file lives while it is open.
        let send = Self::send_name(&body);
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let replaced = (name.ends_with(BODY_EXT) && name != body && name != send)
                || (name.ends_with(&format!(".{IDS_EXT}")) && !current.request_ids.iter().any(|f| f.name == name));
            if replaced {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(Some(current))
    }
}

/// A file written through a buffer and synced every [`SYNC_EVERY_BYTES`].
pub(crate) struct SyncedWriter {
    out: std::io::BufWriter<std::fs::File>,
    unsynced: usize,
}

impl SyncedWriter {
    pub(crate) fn create(path: &Path) -> std::io::Result<SyncedWriter> {
        let file = std::fs::File::create(path)?;
        Ok(SyncedWriter { out: std::io::BufWriter::with_capacity(1 << 20, file), unsynced: 0 })
    }

    /// Flushes and syncs what is left.
    pub(crate) fn finish(mut self) -> std::io::Result<()> {
        self.out.flush()?;
        self.out.get_ref().sync_all()
    }
}

impl Write for SyncedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        self.unsynced += n;
        if self.unsynced >= SYNC_EVERY_BYTES {
            self.out.flush()?;
            self.out.get_ref().sync_data()?;
            self.unsynced = 0;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

fn invalid<E: std::fmt::Display>(e: E) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

type Make = Box<dyn FnOnce() -> std::io::Result<std::fs::File> + Send>;

enum Inner {
    Open(tokio::fs::File),
    /// Made on first use, on a blocking thread.
    Pending {
        make: Option<Make>,
        task: Option<tokio::task::JoinHandle<std::io::Result<std::fs::File>>>,
    },
    Failed(std::io::ErrorKind, String),
}

/// Snapshot data: a file. openraft seeks and reads it in chunks to send a snapshot, and writes
/// chunks into a fresh one to receive a snapshot; nothing holds a whole snapshot in memory.
///
/// A snapshot whose history is in the store is sent as a body with the history added, which is
/// made when a follower first reads it (not when openraft only asks which snapshot is current).
pub struct SnapshotFile {
    inner: Inner,
    /// A seek asked for before the file was made.
    seek: Option<SeekFrom>,
    /// A received file not yet installed: removed when dropped.
    received: Option<PathBuf>,
}

impl std::fmt::Debug for SnapshotFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.inner {
            Inner::Open(_) => "open",
            Inner::Pending { .. } => "pending",
            Inner::Failed(..) => "failed",
        };
        f.debug_struct("SnapshotFile").field("state", &state).field("received", &self.received).finish()
    }
}

impl SnapshotFile {
    /// Data read from `file`, from its start.
    pub(crate) fn open(file: std::fs::File) -> SnapshotFile {
        SnapshotFile { inner: Inner::Open(tokio::fs::File::from_std(file)), seek: None, received: None }
    }

    /// A new, empty file at `path` that receives a snapshot; removed unless installed.
    pub(crate) fn receiving(path: PathBuf) -> std::io::Result<SnapshotFile> {
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        Ok(SnapshotFile { inner: Inner::Open(tokio::fs::File::from_std(file)), seek: None, received: Some(path) })
    }

    /// Data made by `make` (on a blocking thread) when first read or sought.
    pub(crate) fn lazy(make: impl FnOnce() -> std::io::Result<std::fs::File> + Send + 'static) -> SnapshotFile {
        SnapshotFile { inner: Inner::Pending { make: Some(Box::new(make)), task: None }, seek: None, received: None }
    }

    /// Data that fails every read: a snapshot built but superseded before it was published.
    pub(crate) fn failed(why: &str) -> SnapshotFile {
        SnapshotFile { inner: Inner::Failed(std::io::ErrorKind::NotFound, why.to_string()), seek: None, received: None }
    }

    /// The path of a received snapshot, now the caller's to keep or remove.
    pub(crate) fn take_received(&mut self) -> Option<PathBuf> {
        self.received.take()
    }

    fn poll_file(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<&mut tokio::fs::File>> {
        if let Inner::Pending { make, task } = &mut self.inner {
            let handle = match task {
                Some(handle) => handle,
                None => {
                    let make = make.take().expect("a pending snapshot file has a maker until it runs");
                    task.insert(tokio::task::spawn_blocking(make))
                }
            };
            self.inner = match ready!(Pin::new(handle).poll(cx)) {
                Ok(Ok(file)) => Inner::Open(tokio::fs::File::from_std(file)),
                Ok(Err(e)) => Inner::Failed(e.kind(), format!("making the snapshot to send failed: {e}")),
                Err(e) => {
                    Inner::Failed(std::io::ErrorKind::Other, format!("making the snapshot to send panicked: {e}"))
                }
            };
        }
        match &mut self.inner {
            Inner::Open(file) => Poll::Ready(Ok(file)),
            Inner::Failed(kind, why) => Poll::Ready(Err(std::io::Error::new(*kind, why.clone()))),
            Inner::Pending { .. } => unreachable!("a finished maker leaves an open or failed file"),
        }
    }
}

impl Drop for SnapshotFile {
    fn drop(&mut self) {
        if let Some(path) = self.received.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl AsyncRead for SnapshotFile {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let file = ready!(this.poll_file(cx))?;
        Pin::new(file).poll_read(cx, buf)
    }
}

impl AsyncSeek for SnapshotFile {
    fn start_seek(self: Pin<&mut Self>, position: SeekFrom) -> std::io::Result<()> {
        let this = self.get_mut();
        match &mut this.inner {
            Inner::Open(file) => Pin::new(file).start_seek(position),
            _ => {
                this.seek = Some(position);
                Ok(())
            }
        }
    }

    fn poll_complete(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<u64>> {
        let this = self.get_mut();
        let seek = this.seek.take();
        let file = match this.poll_file(cx) {
            Poll::Ready(Ok(file)) => file,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {
                this.seek = seek;
                return Poll::Pending;
            }
        };
        if let Some(position) = seek {
            Pin::new(&mut *file).start_seek(position)?;
        }
        Pin::new(file).poll_complete(cx)
    }
}

impl AsyncWrite for SnapshotFile {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let file = ready!(self.get_mut().poll_file(cx))?;
        Pin::new(file).poll_shutdown(cx)
    }
}

/// Reads the whole of `file` from its start (a hot-state body: bounded by the hot state).
pub(crate) fn read_all(file: &mut std::fs::File) -> std::io::Result<Vec<u8>> {
    use std::io::Seek;
    file.seek(SeekFrom::Start(0))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}
