//! [`Images`]: what a worker holds to run jobs from images — pulls into the node's store with
//! observable progress, each layer fetched once however many jobs want it at once, at most
//! `max-concurrent-downloads` blobs at a time; pins for jobs placed or running; per-job overlay
//! roots; `image load`; garbage collection after each pull.
//!
//! A layer download streams the blob into a decompressing, unpacking thread while hashing
//! every byte; a broken stream resumes from the last byte received (a `Range` request; a
//! registry that ignores ranges sends it again from the start and the bytes already had are
//! skipped). The layer joins the store, under its blob digest, only when the digest matched
//! every byte received.

use std::collections::HashMap;
use std::future::Future;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use tokio::sync::{mpsc, Semaphore};
use tracing::{info, warn};

use crate::config::ImageConfig;
use crate::digest::{Digest, Hasher};
use crate::error::{ErrorKind, ImageError, Needs};
use crate::manifest::{layer_blobs, LayerBlob, MAX_CONFIG};
use crate::reference::ImageRef;
use crate::registry::{backoff, Registry};
use crate::rootfs::{JobRoot, RootsDir};
use crate::settings::ImagesSettings;
use crate::store::unpack::unpack_layer;
use crate::store::{now_ms, ImagePin, ImageRecord, ImageStore, LayerRef, TmpDir};

/// Bytes of a blob gathered before they are handed to the unpacking thread: the HTTP client
/// hands over small chunks, and each hand-over may wake a thread.
const BATCH_BYTES: usize = 256 * 1024;
/// Batches in flight between a download and its unpacking thread (so at most 4 MiB per
/// download in memory).
const CHANNEL_BATCHES: usize = 16;

/// Bytes of one blob moved so far; shared by every pull waiting on that blob.
#[derive(Debug)]
pub struct Transfer {
    size: u64,
    done: AtomicU64,
}

/// A pull's progress, readable from another task while the pull runs: the bytes of the blobs
/// it has to fetch (layers already in the store count for nothing; a layer another pull is
/// fetching counts with that download's progress).
#[derive(Clone, Debug, Default)]
pub struct PullProgress(Arc<Mutex<Vec<Arc<Transfer>>>>);

/// What [`PullProgress::snapshot`] reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgressSnapshot {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub layers_done: usize,
    pub layers_total: usize,
}

impl PullProgress {
    pub fn new() -> PullProgress {
        PullProgress::default()
    }

    pub fn snapshot(&self) -> ProgressSnapshot {
        let transfers = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut snapshot = ProgressSnapshot { layers_total: transfers.len(), ..ProgressSnapshot::default() };
        for t in transfers.iter() {
            let done = t.done.load(Ordering::Relaxed).min(t.size);
            snapshot.bytes_done += done;
            snapshot.bytes_total += t.size;
            snapshot.layers_done += usize::from(done == t.size);
        }
        snapshot
    }

    fn add(&self, transfer: Arc<Transfer>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(transfer);
    }
}

type LayerFuture = Shared<BoxFuture<'static, Result<(), ImageError>>>;

struct Inflight {
    done: LayerFuture,
    transfer: Arc<Transfer>,
}

/// Downloads in progress, by blob digest.
type InflightMap = Arc<Mutex<HashMap<Digest, Inflight>>>;

/// A node's images: store, registry client, download limits and job roots.
#[derive(Clone)]
pub struct Images {
    store: Arc<ImageStore>,
    registry: Registry,
    roots: Arc<RootsDir>,
    downloads: Arc<Semaphore>,
    inflight: InflightMap,
}

impl std::fmt::Debug for Images {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Images").field("store", &self.store).finish()
    }
}

impl Images {
    /// Opens the store and the job roots directory (unmounting roots a dead worker left) and
    /// builds the registry client, from the worker's `[images]` settings.
    pub fn open(settings: &ImagesSettings) -> Result<Images, ImageError> {
        let store = ImageStore::open(&settings.store, settings.max_size)?;
        let roots = RootsDir::open(&settings.store.join("roots"))?;
        Ok(Images::new(store, Registry::new(settings.registry.clone()), roots, settings.max_concurrent_downloads))
    }

    pub fn new(store: Arc<ImageStore>, registry: Registry, roots: RootsDir, max_concurrent_downloads: usize) -> Images {
        Images {
            store,
            registry,
            roots: Arc::new(roots),
            downloads: Arc::new(Semaphore::new(max_concurrent_downloads.max(1))),
            inflight: Arc::default(),
        }
    }

    pub fn store(&self) -> &Arc<ImageStore> {
        &self.store
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Pins the image a pinned reference names (see [`ImageStore::pin`]): a job placed on the
    /// node pins its image before pulling it, and drops the pin when it is gone.
    pub fn pin(&self, image: &ImageRef) -> Result<ImagePin, ImageError> {
        let digest = image
            .digest()
            .ok_or_else(|| ImageError::invalid_reference(format!("{image} is not pinned to a digest")))?;
        Ok(self.store.pin(digest.clone()))
    }

    /// Makes the image `image` names present in the store and returns its record. A pinned
    /// reference already in the store asks nothing of the registry; a tag is resolved first.
    /// `progress` follows the bytes fetched. The first error of any layer ends the pull (layers
    /// other pulls wait on go on downloading).
    pub async fn pull(&self, image: &ImageRef, progress: &PullProgress) -> Result<ImageRecord, ImageError> {
        let pinned = self.registry.resolve(image).await?;
        let digest = pinned.digest().expect("resolved").clone();
        if let Some(record) = self.store.get(&digest) {
            self.store.touch(&record.id);
            return Ok(record);
        }
        let resolved = self.registry.image_manifest(&pinned).await?;
        let names = image.tag().map(|_| image.tagged_name()).into_iter().collect();
        if let Some(mut record) = self.store.get(&resolved.digest) {
            // The same image reached through another index (or by its own digest).
            record.index = record.index.or(resolved.index);
            record.names.extend(names);
            return self.store.put_image(record);
        }
        let config_digest = Digest::parse(&resolved.manifest.config.digest)?;
        let config = self.registry.small_blob(&pinned, &config_digest, MAX_CONFIG).await?;
        let diff_ids = ImageConfig::parse(&config).map_err(|e| e.context(&pinned))?.rootfs.diff_ids;
        let blobs = layer_blobs(&resolved.manifest, &diff_ids).map_err(|e| e.context(&pinned))?;
        let digests: Vec<Digest> = blobs.iter().map(|b| b.digest.clone()).collect();
        let lease = self.store.lease(&digests);
        let waits: Vec<LayerFuture> = blobs.iter().filter_map(|blob| self.layer(&pinned, blob, progress)).collect();
        futures::future::try_join_all(waits).await?;
        let size: u64 = digests.iter().map(|d| self.store.layer_size(d).unwrap_or(0)).sum();
        if size > self.store.max_size() {
            // Every layer fits but not all of them: the image is not recorded, and its layers,
            // named by no image once the lease goes, leave with the next collection.
            drop(lease);
            self.gc().await;
            let needs = Needs { bytes: size, max_size: self.store.max_size(), more: false };
            return Err(ImageError::too_large(format!("image {pinned}"), needs));
        }
        let now = now_ms();
        let record = ImageRecord {
            id: resolved.digest,
            index: resolved.index,
            names,
            config_digest,
            config: String::from_utf8(config)
                .map_err(|_| ImageError::unsupported(format!("{pinned}: config is not UTF-8")))?,
            layers: digests
                .into_iter()
                .map(|digest| LayerRef { size: self.store.layer_size(&digest).unwrap_or(0), digest })
                .collect(),
            pulled_ms: now,
            last_used_ms: now,
        };
        // Pinned before it is recorded: the image just pulled survives the collections that
        // run meanwhile and the one its own pull starts.
        let _pulled = self.store.pin(record.id.clone());
        let record = self.store.put_image(record)?;
        drop(lease);
        info!(image = %pinned, id = %record.id, bytes = record.size(), "image pulled");
        self.gc().await;
        Ok(record)
    }

    /// The download of one layer, started unless it is in the store (`None`) or another pull
    /// is fetching it (whose download is joined).
    fn layer(&self, image: &ImageRef, blob: &LayerBlob, progress: &PullProgress) -> Option<LayerFuture> {
        let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        // Checked under the lock: a download commits its layer before leaving the map.
        if self.store.has_layer(&blob.digest) {
            return None;
        }
        if let Some(running) = inflight.get(&blob.digest) {
            progress.add(Arc::clone(&running.transfer));
            return Some(running.done.clone());
        }
        let transfer = Arc::new(Transfer { size: blob.size, done: AtomicU64::new(0) });
        progress.add(Arc::clone(&transfer));
        let download = LayerDownload {
            registry: self.registry.clone(),
            store: Arc::clone(&self.store),
            downloads: Arc::clone(&self.downloads),
            inflight: Arc::clone(&self.inflight),
            image: image.clone(),
            blob: blob.clone(),
            transfer: Arc::clone(&transfer),
        };
        // Spawned: it finishes for the others even if the pull that started it is dropped.
        let task = tokio::spawn(download.run());
        let done: Pin<Box<dyn Future<Output = Result<(), ImageError>> + Send>> = Box::pin(async move {
            task.await.unwrap_or_else(|e| Err(ImageError::new(ErrorKind::Io, format!("layer download failed: {e}"))))
        });
        let done = done.shared();
        inflight.insert(blob.digest.clone(), Inflight { done: done.clone(), transfer });
        Some(done)
    }

    /// Mounts a job's root filesystem: the pinned image's layers under a writable layer of the
    /// job's own, at `<store>/roots/<key>/merged`. The root pins the image until it is removed.
    /// Blocking (one mount).
    pub fn mount(&self, pin: &ImagePin, key: &str) -> Result<JobRoot, ImageError> {
        let record =
            pin.record().ok_or_else(|| ImageError::not_found(format!("image {} is not in the store", pin.digest())))?;
        let lowers = self.store.lower_dirs(&record);
        self.roots.mount(key, &lowers, Some(self.store.pin(record.id.clone())))
    }

    /// Loads a `docker save` / OCI archive or OCI layout directory into the store.
    pub async fn load(&self, path: &Path) -> Result<Vec<ImageRecord>, ImageError> {
        let store = Arc::clone(&self.store);
        let path: PathBuf = path.to_path_buf();
        tokio::task::spawn_blocking(move || store.load(&path))
            .await
            .unwrap_or_else(|e| Err(ImageError::new(ErrorKind::Io, format!("load failed: {e}"))))
    }

    /// A fresh directory under the store's `tmp/` where an archive sent over the network is
    /// written before [`Images::load`]; deleted with everything in it when dropped.
    pub fn upload_dir(&self) -> Result<UploadDir, ImageError> {
        Ok(UploadDir(self.store.tmp_dir()?))
    }

    /// Garbage collection on a blocking thread (it deletes directories).
    pub async fn gc(&self) -> crate::store::GcReport {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || store.gc()).await.unwrap_or_default()
    }
}

/// See [`Images::upload_dir`].
pub struct UploadDir(TmpDir);

impl UploadDir {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// One layer's download and unpacking.
struct LayerDownload {
    registry: Registry,
    store: Arc<ImageStore>,
    downloads: Arc<Semaphore>,
    inflight: InflightMap,
    image: ImageRef,
    blob: LayerBlob,
    transfer: Arc<Transfer>,
}

impl LayerDownload {
    async fn run(self) -> Result<(), ImageError> {
        let result = self.fetch().await;
        if let Err(e) = &result {
            warn!(layer = %self.blob.digest, image = %self.image, error = %e, "layer download failed");
        }
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.blob.digest);
        result
    }

    async fn fetch(&self) -> Result<(), ImageError> {
        let _permit = self.downloads.acquire().await.expect("the download semaphore is never closed");
        let tmp = self.store.tmp_dir()?;
        let (tx, rx) = mpsc::channel(CHANNEL_BATCHES);
        let (dest, limit) = (tmp.path().to_path_buf(), self.store.max_size());
        let unpacker = tokio::task::spawn_blocking(move || {
            unpack_layer(ChannelReader { rx, current: Bytes::new() }, &dest, false, limit)
        });
        let downloaded = self.download(tx).await;
        let unpacked = unpacker
            .await
            .unwrap_or_else(|e| Err(ImageError::new(ErrorKind::Io, format!("unpacking thread failed: {e}"))));
        downloaded?;
        let unpacked = unpacked.map_err(|e| match e.needs() {
            // One layer alone is more than the store holds: say what the image needs.
            Some(needs) => {
                ImageError::too_large(format!("image {} (its layer {} alone)", self.image, self.blob.digest), needs)
            }
            None => e.context(format!("layer {} of {}", self.blob.digest, self.image)),
        })?;
        let store = Arc::clone(&self.store);
        let digest = self.blob.digest.clone();
        tokio::task::spawn_blocking(move || store.commit_layer(tmp, &digest, &unpacked))
            .await
            .unwrap_or_else(|e| Err(ImageError::new(ErrorKind::Io, format!("commit failed: {e}"))))
    }

    /// Streams the blob into `tx`, resuming after transient failures, and checks its size and
    /// digest. When the unpacker stops early (a refused entry) the rest is still read and
    /// hashed: a blob that does not match its digest is reported as that, not as a bad layer.
    async fn download(&self, tx: mpsc::Sender<Bytes>) -> Result<(), ImageError> {
        let digest = &self.blob.digest;
        let mut hasher = Hasher::new();
        let mut received = 0u64;
        let mut unpacking = true;
        let mut batch = BytesMut::with_capacity(BATCH_BYTES);
        let attempts = self.registry.config().attempts.max(1);
        let mut attempt = 1;
        loop {
            let pass: Result<(), ImageError> = async {
                let mut blob = self.registry.blob(&self.image, digest, received).await?;
                while let Some(chunk) = blob.stream.next().await {
                    let mut chunk =
                        chunk.map_err(|e| ImageError::unreachable(format!("blob {digest} of {}: {e}", self.image)))?;
                    if blob.skip > 0 {
                        let skip = usize::try_from(blob.skip).unwrap_or(usize::MAX).min(chunk.len());
                        blob.skip -= skip as u64;
                        chunk = chunk.slice(skip..);
                        if chunk.is_empty() {
                            continue;
                        }
                    }
                    received += chunk.len() as u64;
                    if received > self.blob.size {
                        return Err(ImageError::digest_mismatch(format!(
                            "blob {digest} of {} is longer than the {} bytes its manifest says",
                            self.image, self.blob.size
                        )));
                    }
                    hasher.update(&chunk);
                    self.transfer.done.store(received, Ordering::Relaxed);
                    if unpacking {
                        batch.extend_from_slice(&chunk);
                        if batch.len() >= BATCH_BYTES
                            && tx
                                .send(std::mem::replace(&mut batch, BytesMut::with_capacity(BATCH_BYTES)).freeze())
                                .await
                                .is_err()
                        {
                            unpacking = false;
                        }
                    }
                }
                Ok(())
            }
            .await;
            match pass {
                Ok(()) if received < self.blob.size && attempt < attempts => {
                    warn!(blob = %digest, received, size = self.blob.size, "blob stream ended early; resuming");
                }
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::Unreachable && attempt < attempts => {
                    warn!(blob = %digest, received, attempt, error = %e, "blob download broke off; resuming");
                }
                Err(e) => return Err(e),
            }
            tokio::time::sleep(backoff(attempt)).await;
            attempt += 1;
        }
        if unpacking && !batch.is_empty() {
            let _ = tx.send(batch.freeze()).await;
        }
        drop(tx);
        if received != self.blob.size {
            return Err(ImageError::digest_mismatch(format!(
                "blob {digest} of {}: {received} bytes where its manifest says {}",
                self.image, self.blob.size
            )));
        }
        let actual = hasher.finish();
        if &actual != digest {
            return Err(ImageError::digest_mismatch(format!("blob {digest} of {} has digest {actual}", self.image)));
        }
        Ok(())
    }
}

/// The unpacking thread's end of the download: blocking reads of the chunks sent.
struct ChannelReader {
    rx: mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.current = chunk,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current = self.current.slice(n..);
        Ok(n)
    }
}
