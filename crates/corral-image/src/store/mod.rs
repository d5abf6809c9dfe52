//! The node's content-addressed layer store: each layer unpacked once into a directory named by
//! its blob digest (the bytes its manifest names, checked as they arrived), image records naming
//! their layers, pins held for the jobs placed on or running on the node, and garbage collection
//! of the least recently used images not pinned once the store passes its size budget.
//!
//! Layers are keyed by what was verified: the blob's digest. (A key taken from the config's
//! `diff_ids` unverified would let one tenant's image claim another's base layer; verifying it
//! would hash every layer a second time, uncompressed.) The manifests a coordinator sees name
//! the same digests, so the layers a worker reports compare with them directly. A layer
//! published in two compressions is stored twice.
//!
//! Layout under the root:
//!
//! ```text
//! layers/<hex>        an unpacked layer, an overlayfs lower directory (read-only by use)
//! layers/<hex>.json   its record: digest and unpacked size
//! images/<hex>.json   an image record (manifest digest, names, config, layers)
//! tmp/                layers being unpacked (emptied at open)
//! trash/              layers being deleted (emptied at open)
//! ```
//!
//! A layer is unpacked into `tmp/` and renamed into `layers/` only after its digests matched,
//! then its record is written; an image record is written after all its layers. At open, a
//! layer directory without a record is removed and an image whose layers are missing is
//! forgotten, so a crash at any point leaves nothing half-made in use.
//! Records are JSON with a `format` number, as the OCI files they come from: this is a cache
//! of what registries hold, not replicated state.
//!
//! Invariant: a layer is removed only when no image record names it and no pull holds a lease
//! on it; an image is removed only when it is not pinned.

pub(crate) mod archive;
pub(crate) mod unpack;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::config::ImageConfig;
use crate::digest::Digest;
use crate::error::{ErrorKind, ImageError};
use crate::reference::ImageRef;
use unpack::Unpacked;

/// The version of the record files; a record of another version is not read (the image is
/// pulled again).
const RECORD_FORMAT: u32 = 1;

/// An image in the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ImageRecord {
    /// The image's identity: its manifest's digest, or its config's digest for an image loaded
    /// from a `docker save` archive (which has no manifest).
    pub id: Digest,
    /// The image index (manifest list) it was chosen from for this node's platform, if any:
    /// jobs pinned to the index digest find it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<Digest>,
    /// Normalised tagged names (`docker.io/library/busybox:1.36`) it was pulled or loaded as.
    #[serde(default)]
    pub names: BTreeSet<String>,
    pub config_digest: Digest,
    /// The config blob as fetched (JSON text).
    pub config: String,
    /// Bottom layer first.
    pub layers: Vec<LayerRef>,
    /// Unix milliseconds.
    pub pulled_ms: u64,
    /// Unix milliseconds of the last pull, pin or unpin: the order of garbage collection (two
    /// uses never get the same value, so the order is strict).
    pub last_used_ms: u64,
}

/// One layer of an image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct LayerRef {
    /// The blob digest its manifest names (for a layer of an old `docker save` archive, the
    /// digest of the tar in the archive, which is its diff_id).
    pub digest: Digest,
    /// Unpacked bytes.
    pub size: u64,
}

impl ImageRecord {
    /// The parsed config.
    pub fn config(&self) -> Result<ImageConfig, ImageError> {
        ImageConfig::parse(self.config.as_bytes())
    }

    /// Unpacked bytes of all its layers (shared layers counted in each image).
    pub fn size(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }

    /// Whether `digest` names this image: its manifest, index or config digest.
    pub fn is_named_by(&self, digest: &Digest) -> bool {
        &self.id == digest || self.index.as_ref() == Some(digest) || &self.config_digest == digest
    }
}

/// A layer held by the store, as a worker reports it for placement: the blob digest manifests
/// name and the bytes it takes here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct StoredLayer {
    pub digest: Digest,
    /// Unpacked bytes.
    pub size: u64,
}

/// An image and whether jobs hold it, for `corral image ls`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageEntry {
    pub record: ImageRecord,
    /// Pins held on it (jobs placed or running here).
    pub pins: usize,
}

/// How full the store is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreUsage {
    /// Unpacked bytes of every layer held.
    pub bytes: u64,
    pub max_size: u64,
    pub images: usize,
    pub layers: usize,
}

/// What one garbage collection did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Images removed, least recently used first.
    pub removed: Vec<Digest>,
    pub layers_removed: usize,
    pub freed_bytes: u64,
    /// The store's size after it: above `max-size` when pinned images hold more.
    pub bytes_after: u64,
}

#[derive(Serialize, Deserialize)]
struct OnDisk<T> {
    format: u32,
    #[serde(flatten)]
    item: T,
}

#[derive(Default)]
struct State {
    images: BTreeMap<Digest, ImageRecord>,
    layers: BTreeMap<Digest, StoredLayer>,
    /// Pins per digest (an image's id, index or config digest).
    pins: BTreeMap<Digest, usize>,
    /// Leases per layer digest, held by pulls and loads in progress.
    leases: BTreeMap<Digest, usize>,
    /// The last use given out.
    clock: u64,
}

impl State {
    /// A use time: now, or just after the last one given.
    fn tick(&mut self) -> u64 {
        self.clock = now_ms().max(self.clock + 1);
        self.clock
    }

    fn pins_of(&self, record: &ImageRecord) -> usize {
        [Some(&record.id), record.index.as_ref(), Some(&record.config_digest)]
            .into_iter()
            .flatten()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(|d| self.pins.get(d).copied().unwrap_or(0))
            .sum()
    }

    fn referenced_layers(&self) -> BTreeSet<Digest> {
        self.images.values().flat_map(|r| r.layers.iter().map(|l| l.digest.clone())).collect()
    }

    fn find(&self, digest: &Digest) -> Option<&ImageRecord> {
        self.images.get(digest).or_else(|| self.images.values().find(|r| r.is_named_by(digest)))
    }

    fn bytes(&self) -> u64 {
        self.layers.values().map(|l| l.size).sum()
    }
}

/// The layer store of one node. Cheap to share (`Arc`); every method is short and blocking
/// (file renames, small record writes) except [`ImageStore::load`], which unpacks.
pub struct ImageStore {
    root: PathBuf,
    max_size: u64,
    state: Mutex<State>,
    seq: AtomicU64,
}

impl std::fmt::Debug for ImageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore").field("root", &self.root).field("max_size", &self.max_size).finish()
    }
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl ImageStore {
    /// Opens (creating) the store at `root`, whose unpacked layers may take `max_size` bytes
    /// before garbage collection removes images. Leftovers of a crash are removed.
    pub fn open(root: &Path, max_size: u64) -> Result<Arc<ImageStore>, ImageError> {
        for dir in ["", "layers", "images", "tmp", "trash"] {
            let path = root.join(dir);
            fs::create_dir_all(&path).map_err(|e| ImageError::io(format!("create {}", path.display()), &e))?;
        }
        fs::set_permissions(root, fs::Permissions::from_mode(0o700))
            .map_err(|e| ImageError::io(format!("chmod {}", root.display()), &e))?;
        for dir in ["tmp", "trash"] {
            empty_dir(&root.join(dir))?;
        }
        let mut state = State::default();
        let layers_dir = root.join("layers");
        let mut dirs = BTreeSet::new();
        for entry in read_dir(&layers_dir)? {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if let Some(hex) = name.strip_suffix(".json") {
                match read_record::<StoredLayer>(&path) {
                    Some(layer) if layer.digest.hex() == hex => {
                        state.layers.insert(layer.digest.clone(), layer);
                    }
                    _ => {
                        warn!(path = %path.display(), "unreadable layer record removed");
                        let _ = fs::remove_file(&path);
                    }
                }
            } else {
                dirs.insert(name);
            }
        }
        state.layers.retain(|digest, _| {
            let present = dirs.contains(digest.hex());
            if !present {
                let _ = fs::remove_file(layers_dir.join(format!("{}.json", digest.hex())));
            }
            present
        });
        for name in dirs {
            if !state.layers.keys().any(|d| d.hex() == name) {
                info!(layer = name, "removing a layer whose unpacking did not finish");
                let _ = fs::remove_dir_all(layers_dir.join(&name));
            }
        }
        for entry in read_dir(&root.join("images"))? {
            let path = entry.path();
            let record = read_record::<ImageRecord>(&path)
                .filter(|r| path.file_name().is_some_and(|n| n.to_string_lossy() == format!("{}.json", r.id.hex())));
            match record {
                Some(record) if record.layers.iter().all(|l| state.layers.contains_key(&l.digest)) => {
                    state.images.insert(record.id.clone(), record);
                }
                _ => {
                    warn!(path = %path.display(), "image record unreadable or missing layers: forgotten");
                    let _ = fs::remove_file(&path);
                }
            }
        }
        info!(root = %root.display(), images = state.images.len(), layers = state.layers.len(), bytes = state.bytes(), "image store open");
        state.clock = state.images.values().map(|r| r.last_used_ms).max().unwrap_or(0);
        Ok(Arc::new(ImageStore {
            root: root.to_path_buf(),
            max_size,
            state: Mutex::new(state),
            seq: AtomicU64::new(0),
        }))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn max_size(&self) -> u64 {
        self.max_size
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The image a reference names: by digest (manifest, index or config digest) when it has
    /// one, else by its tagged name (the one pulled or loaded last under it).
    pub fn find(&self, image: &ImageRef) -> Option<ImageRecord> {
        let state = self.lock();
        match image.digest() {
            Some(digest) => state.find(digest).cloned(),
            None => {
                let name = image.tagged_name();
                state.images.values().filter(|r| r.names.contains(&name)).max_by_key(|r| r.pulled_ms).cloned()
            }
        }
    }

    /// The image `digest` names (manifest, index or config digest).
    pub fn get(&self, digest: &Digest) -> Option<ImageRecord> {
        self.lock().find(digest).cloned()
    }

    /// Every image, with the pins held on it.
    pub fn images(&self) -> Vec<ImageEntry> {
        let state = self.lock();
        state.images.values().map(|r| ImageEntry { record: r.clone(), pins: state.pins_of(r) }).collect()
    }

    /// Every layer held: what a worker reports so placement can prefer nodes that hold an
    /// image's layers.
    pub fn layers(&self) -> Vec<StoredLayer> {
        self.lock().layers.values().cloned().collect()
    }

    pub fn usage(&self) -> StoreUsage {
        let state = self.lock();
        StoreUsage {
            bytes: state.bytes(),
            max_size: self.max_size,
            images: state.images.len(),
            layers: state.layers.len(),
        }
    }

    /// The directory of a layer (held or not).
    pub fn layer_dir(&self, digest: &Digest) -> PathBuf {
        self.root.join("layers").join(digest.hex())
    }

    /// The overlayfs lower directories of an image, top layer first (overlayfs's order).
    pub fn lower_dirs(&self, record: &ImageRecord) -> Vec<PathBuf> {
        record.layers.iter().rev().map(|l| self.layer_dir(&l.digest)).collect()
    }

    /// Pins the image `digest` names (it need not be in the store yet: a job placed here pins
    /// its image before the pull), so garbage collection keeps it until the pin is dropped.
    pub fn pin(self: &Arc<Self>, digest: Digest) -> ImagePin {
        let mut state = self.lock();
        *state.pins.entry(digest.clone()).or_insert(0) += 1;
        let id = state.find(&digest).map(|r| r.id.clone());
        drop(state);
        if let Some(id) = id {
            self.touch(&id);
        }
        ImagePin { store: Arc::clone(self), digest }
    }

    fn unpin(&self, digest: &Digest) {
        let mut state = self.lock();
        if let Some(count) = state.pins.get_mut(digest) {
            *count -= 1;
            if *count == 0 {
                state.pins.remove(digest);
            }
        }
        let id = state.find(digest).map(|r| r.id.clone());
        drop(state);
        if let Some(id) = id {
            self.touch(&id);
        }
    }

    /// Marks an image used now (the least recently used go first).
    pub fn touch(&self, id: &Digest) {
        let mut state = self.lock();
        let used = state.tick();
        if let Some(record) = state.images.get_mut(id) {
            record.last_used_ms = used;
            let record = record.clone();
            if let Err(e) = self.write_image(&record) {
                warn!(image = %id, error = %e, "could not record the image's last use");
            }
        }
    }

    /// Removes an image that no job holds (`corral image rm`); its layers go unless another
    /// image or a pull in progress uses them.
    pub fn remove(&self, image: &ImageRef) -> Result<ImageRecord, ImageError> {
        let record =
            self.find(image).ok_or_else(|| ImageError::not_found(format!("{image} is not in this node's store")))?;
        let mut trash = Vec::new();
        {
            let mut state = self.lock();
            let pins = state.pins_of(&record);
            if pins > 0 {
                return Err(ImageError::new(
                    ErrorKind::InUse,
                    format!("{image} is used by {pins} job(s) on this node"),
                ));
            }
            self.drop_image(&mut state, &record.id, &mut trash);
        }
        self.empty_trash(trash);
        Ok(record)
    }

    /// Removes the least recently used images that are not pinned, and layers no image uses,
    /// until the store is within `max-size` (or nothing more can go).
    pub fn gc(&self) -> GcReport {
        self.collect(self.max_size)
    }

    fn collect(&self, limit: u64) -> GcReport {
        let mut report = GcReport::default();
        let mut trash = Vec::new();
        {
            let mut state = self.lock();
            let before = state.bytes();
            if before > limit {
                let referenced = state.referenced_layers();
                let orphans: Vec<Digest> = state
                    .layers
                    .keys()
                    .filter(|d| !referenced.contains(*d) && !state.leases.contains_key(*d))
                    .cloned()
                    .collect();
                for digest in orphans {
                    if state.bytes() <= limit {
                        break;
                    }
                    report.layers_removed += 1;
                    self.drop_layer(&mut state, &digest, &mut trash);
                }
                let mut candidates: Vec<(u64, Digest)> = state
                    .images
                    .values()
                    .filter(|r| state.pins_of(r) == 0)
                    .map(|r| (r.last_used_ms, r.id.clone()))
                    .collect();
                candidates.sort();
                for (_, id) in candidates {
                    if state.bytes() <= limit {
                        break;
                    }
                    report.layers_removed += self.drop_image(&mut state, &id, &mut trash);
                    report.removed.push(id);
                }
            }
            report.bytes_after = state.bytes();
            report.freed_bytes = before - report.bytes_after;
        }
        if !report.removed.is_empty() || report.layers_removed > 0 {
            info!(
                images = report.removed.len(),
                layers = report.layers_removed,
                freed = report.freed_bytes,
                bytes = report.bytes_after,
                "image store garbage collected"
            );
        }
        self.empty_trash(trash);
        report
    }

    /// Forgets an image and moves its layers that nothing else uses to the trash; returns
    /// the number of layers removed.
    fn drop_image(&self, state: &mut State, id: &Digest, trash: &mut Vec<PathBuf>) -> usize {
        let Some(record) = state.images.remove(id) else { return 0 };
        let _ = fs::remove_file(self.image_path(id));
        let referenced = state.referenced_layers();
        let mut removed = 0;
        for layer in &record.layers {
            if !referenced.contains(&layer.digest)
                && !state.leases.contains_key(&layer.digest)
                && state.layers.contains_key(&layer.digest)
            {
                self.drop_layer(state, &layer.digest, trash);
                removed += 1;
            }
        }
        removed
    }

    fn drop_layer(&self, state: &mut State, digest: &Digest, trash: &mut Vec<PathBuf>) {
        state.layers.remove(digest);
        let _ = fs::remove_file(self.layer_record_path(digest));
        let to = self.root.join("trash").join(format!("{}-{}", digest.hex(), self.seq.fetch_add(1, Ordering::Relaxed)));
        match fs::rename(self.layer_dir(digest), &to) {
            Ok(()) => trash.push(to),
            Err(e) => warn!(layer = %digest, error = %e, "could not move a removed layer to the trash"),
        }
    }

    fn empty_trash(&self, trash: Vec<PathBuf>) {
        for path in trash {
            if let Err(e) = fs::remove_dir_all(&path) {
                warn!(path = %path.display(), error = %e, "could not delete a removed layer");
            }
        }
    }

    /// Takes leases on layers a pull is about to use, so garbage collection keeps those
    /// already held until the image record names them.
    pub(crate) fn lease(self: &Arc<Self>, digests: &[Digest]) -> LayerLease {
        let mut state = self.lock();
        for d in digests {
            *state.leases.entry(d.clone()).or_insert(0) += 1;
        }
        LayerLease { store: Arc::clone(self), digests: digests.to_vec() }
    }

    pub(crate) fn has_layer(&self, digest: &Digest) -> bool {
        self.lock().layers.contains_key(digest)
    }

    /// Unpacked bytes of a layer held.
    pub(crate) fn layer_size(&self, digest: &Digest) -> Option<u64> {
        self.lock().layers.get(digest).map(|l| l.size)
    }

    /// A fresh directory under `tmp/`, removed when the guard drops unless committed.
    pub(crate) fn tmp_dir(&self) -> Result<TmpDir, ImageError> {
        let path =
            self.root.join("tmp").join(format!("{}-{}", std::process::id(), self.seq.fetch_add(1, Ordering::Relaxed)));
        fs::create_dir(&path).map_err(|e| ImageError::io(format!("create {}", path.display()), &e))?;
        Ok(TmpDir(Some(path)))
    }

    /// Makes an unpacked layer whose blob matched `digest` part of the store. If another pull
    /// committed the same layer first, this copy is deleted.
    pub(crate) fn commit_layer(&self, mut tmp: TmpDir, digest: &Digest, unpacked: &Unpacked) -> Result<(), ImageError> {
        let mut state = self.lock();
        if state.layers.contains_key(digest) {
            return Ok(()); // `tmp` is deleted on drop
        }
        let path = tmp.0.take().expect("tmp dir");
        let dest = self.layer_dir(digest);
        if let Err(e) = fs::rename(&path, &dest) {
            tmp.0 = Some(path);
            return Err(ImageError::io(format!("move layer {digest} into the store"), &e));
        }
        let layer = StoredLayer { digest: digest.clone(), size: unpacked.size };
        if let Err(e) = self.write_layer(&layer) {
            let _ = fs::remove_dir_all(&dest);
            return Err(e);
        }
        state.layers.insert(layer.digest.clone(), layer);
        Ok(())
    }

    /// Records an image whose layers are all in the store. An image already recorded gains
    /// the names; a name moves from any other image to this one.
    pub(crate) fn put_image(&self, mut record: ImageRecord) -> Result<ImageRecord, ImageError> {
        let mut state = self.lock();
        if let Some(missing) = record.layers.iter().find(|l| !state.layers.contains_key(&l.digest)) {
            return Err(ImageError::new(
                ErrorKind::Io,
                format!("layer {} of {} is not in the store", missing.digest, record.id),
            ));
        }
        record.last_used_ms = state.tick();
        if let Some(existing) = state.images.get(&record.id) {
            record.names.extend(existing.names.iter().cloned());
            record.index = record.index.or_else(|| existing.index.clone());
            record.pulled_ms = existing.pulled_ms.min(record.pulled_ms);
        }
        let moved: Vec<ImageRecord> = state
            .images
            .values_mut()
            .filter(|other| other.id != record.id && other.names.iter().any(|n| record.names.contains(n)))
            .map(|other| {
                other.names.retain(|n| !record.names.contains(n));
                other.clone()
            })
            .collect();
        for other in &moved {
            let _ = self.write_image(other);
        }
        self.write_image(&record)?;
        state.images.insert(record.id.clone(), record.clone());
        Ok(record)
    }

    fn image_path(&self, id: &Digest) -> PathBuf {
        self.root.join("images").join(format!("{}.json", id.hex()))
    }

    fn layer_record_path(&self, digest: &Digest) -> PathBuf {
        self.root.join("layers").join(format!("{}.json", digest.hex()))
    }

    fn write_image(&self, record: &ImageRecord) -> Result<(), ImageError> {
        self.write_record(&self.image_path(&record.id), record)
    }

    fn write_layer(&self, layer: &StoredLayer) -> Result<(), ImageError> {
        self.write_record(&self.layer_record_path(&layer.digest), layer)
    }

    /// Writes a record next to its place and renames it there: readers see the old or the new.
    fn write_record<T: Serialize>(&self, path: &Path, item: &T) -> Result<(), ImageError> {
        let text = serde_json::to_vec(&OnDisk { format: RECORD_FORMAT, item }).expect("records serialise");
        let tmp = path.with_extension(format!("tmp-{}", self.seq.fetch_add(1, Ordering::Relaxed)));
        fs::write(&tmp, text).and_then(|()| fs::rename(&tmp, path)).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            ImageError::io(format!("write {}", path.display()), &e)
        })
    }

    /// Loads the images of a `docker save` archive, an OCI archive (tar) or an OCI layout
    /// directory (`corral image load`, for hosts without registry access). Blocking: it unpacks
    /// every layer the store lacks.
    pub fn load(self: &Arc<Self>, path: &Path) -> Result<Vec<ImageRecord>, ImageError> {
        let loaded = archive::load(self, path)?;
        self.gc();
        Ok(loaded)
    }
}

/// Keeps an image from garbage collection while a job placed or running on the node needs it.
/// Dropping it releases the pin (and counts as a use of the image).
pub struct ImagePin {
    store: Arc<ImageStore>,
    digest: Digest,
}

impl ImagePin {
    /// The digest pinned.
    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    /// The pinned image's record, once it is in the store.
    pub fn record(&self) -> Option<ImageRecord> {
        self.store.get(&self.digest)
    }

    pub fn store(&self) -> &Arc<ImageStore> {
        &self.store
    }
}

impl std::fmt::Debug for ImagePin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ImagePin({})", self.digest)
    }
}

impl Drop for ImagePin {
    fn drop(&mut self) {
        self.store.unpin(&self.digest);
    }
}

/// Leases on layers while a pull or load uses them.
pub(crate) struct LayerLease {
    store: Arc<ImageStore>,
    digests: Vec<Digest>,
}

impl Drop for LayerLease {
    fn drop(&mut self) {
        let mut state = self.store.lock();
        for d in &self.digests {
            if let Some(count) = state.leases.get_mut(d) {
                *count -= 1;
                if *count == 0 {
                    state.leases.remove(d);
                }
            }
        }
    }
}

/// A directory under the store's `tmp/`, deleted on drop unless committed.
pub(crate) struct TmpDir(Option<PathBuf>);

impl TmpDir {
    pub(crate) fn path(&self) -> &Path {
        self.0.as_deref().expect("tmp dir")
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = fs::remove_dir_all(path);
        }
    }
}

fn read_dir(dir: &Path) -> Result<Vec<fs::DirEntry>, ImageError> {
    fs::read_dir(dir)
        .and_then(|entries| entries.collect::<io::Result<Vec<_>>>())
        .map_err(|e| ImageError::io(format!("read {}", dir.display()), &e))
}

fn empty_dir(dir: &Path) -> Result<(), ImageError> {
    for entry in read_dir(dir)? {
        let path = entry.path();
        let removed = if entry.file_type().is_ok_and(|t| t.is_dir()) {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        removed.map_err(|e| ImageError::io(format!("remove {}", path.display()), &e))?;
    }
    Ok(())
}

fn read_record<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    let bytes = fs::read(path).ok()?;
    let record: OnDisk<T> = serde_json::from_slice(&bytes).ok()?;
    (record.format == RECORD_FORMAT).then_some(record.item)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(store: &ImageStore, content: &[u8]) -> Digest {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(content.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append_data(&mut header, "file", content).expect("append");
        let tar = builder.into_inner().expect("tar");
        let tmp = store.tmp_dir().expect("tmp");
        let unpacked = unpack::unpack_layer(&tar[..], tmp.path(), false, u64::MAX).expect("unpack");
        let digest = Digest::of(&tar);
        store.commit_layer(tmp, &digest, &unpacked).expect("commit");
        digest
    }

    fn image(store: &ImageStore, name: &str, layers: &[&Digest], used: u64) -> ImageRecord {
        let config = format!(r#"{{"rootfs": {{"diff_ids": []}}, "name": "{name}"}}"#);
        let record = ImageRecord {
            id: Digest::of(name.as_bytes()),
            index: None,
            names: BTreeSet::from([format!("docker.io/library/{name}:latest")]),
            config_digest: Digest::of(config.as_bytes()),
            config,
            layers: layers
                .iter()
                .map(|d| LayerRef { digest: (*d).clone(), size: store.lock().layers[*d].size })
                .collect(),
            pulled_ms: used,
            last_used_ms: used,
        };
        store.put_image(record).expect("put")
    }

    #[test]
    fn gc_removes_least_recently_used_unpinned_images_and_keeps_shared_layers() {
        if !crate::test_needs_root() {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ImageStore::open(dir.path(), 3000).expect("open");
        let base = layer(&store, &[1u8; 1000]);
        let a_top = layer(&store, &[2u8; 1000]);
        let b_top = layer(&store, &[3u8; 1000]);
        let c_top = layer(&store, &[4u8; 1000]);
        let a = image(&store, "a", &[&base, &a_top], 1);
        let b = image(&store, "b", &[&base, &b_top], 2);
        let c = image(&store, "c", &[&c_top], 3);
        assert_eq!(store.usage().bytes, 4000);

        let pin = store.pin(a.id.clone());
        let report = store.gc();
        // a is pinned (and so the most recently used); b is the least recently used of the
        // rest: removing it frees its top layer, not the base a shares.
        assert_eq!(report.removed, vec![b.id.clone()]);
        assert_eq!((report.layers_removed, report.freed_bytes, report.bytes_after), (1, 1000, 3000));
        assert_eq!(store.gc(), GcReport { bytes_after: 3000, ..GcReport::default() }, "within max-size: nothing goes");

        let report = store.collect(0);
        assert_eq!(report.removed, vec![c.id.clone()], "a pinned image stays even above the budget");
        assert_eq!(report.bytes_after, 2000);
        assert!(store.layer_dir(&base).exists() && store.layer_dir(&a_top).exists());
        assert!(!store.layer_dir(&b_top).exists() && !store.layer_dir(&c_top).exists());

        let e = store.remove(&ImageRef::parse("a").expect("ref")).expect_err("pinned");
        assert_eq!(e.kind(), ErrorKind::InUse);
        assert!(e.to_string().contains("used by 1 job(s)"), "{e}");
        drop(pin);
        store.remove(&ImageRef::parse("a").expect("ref")).expect("unpinned");
        assert_eq!(store.usage(), StoreUsage { bytes: 0, max_size: 3000, images: 0, layers: 0 });
        assert!(fs::read_dir(dir.path().join("layers")).expect("layers").next().is_none());
        assert!(fs::read_dir(dir.path().join("trash")).expect("trash").next().is_none());
    }

    #[test]
    fn leased_layers_survive_gc_and_records_survive_reopen() {
        if !crate::test_needs_root() {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ImageStore::open(dir.path(), 0).expect("open");
        let leased = layer(&store, b"pulling");
        let lease = store.lease(std::slice::from_ref(&leased));
        let orphan = layer(&store, b"orphan");
        store.gc();
        assert!(store.has_layer(&leased), "a pull's layer stays");
        assert!(!store.has_layer(&orphan), "an orphan goes");
        drop(lease);

        let kept = image(&store, "kept", &[&leased], 5);
        let _pin = store.pin(kept.config_digest.clone());
        assert_eq!(store.gc().removed, Vec::<Digest>::new(), "pinned by its config digest");
        assert_eq!(store.images()[0].pins, 1);
        drop(store);

        // A crash left a half-unpacked layer, a layer without record and a torn image record.
        fs::create_dir(dir.path().join("tmp/1-1")).expect("tmp");
        fs::create_dir(dir.path().join("layers").join("ab".repeat(32))).expect("unrecorded layer");
        fs::write(dir.path().join("images").join(format!("{}.json", "cd".repeat(32))), b"{\"format\": 1, \"id\"")
            .expect("torn");
        let store = ImageStore::open(dir.path(), 0).expect("reopen");
        let found = store.find(&ImageRef::parse("kept").expect("ref")).expect("found by name");
        assert_eq!(found.id, kept.id);
        assert!(store.get(&kept.config_digest).is_some());
        assert_eq!(store.usage().layers, 1);
        assert!(!dir.path().join("layers").join("ab".repeat(32)).exists());
        assert!(fs::read_dir(dir.path().join("tmp")).expect("tmp").next().is_none());
        assert_eq!(fs::read_dir(dir.path().join("images")).expect("images").count(), 1);
    }

    #[test]
    fn a_name_moves_to_the_image_pulled_last() {
        if !crate::test_needs_root() {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ImageStore::open(dir.path(), u64::MAX).expect("open");
        let l = layer(&store, b"x");
        let first = image(&store, "first", &[&l], 1);
        let mut second = first.clone();
        second.id = Digest::of(b"second");
        second.pulled_ms = 2;
        store.put_image(second.clone()).expect("put");
        assert_eq!(store.find(&ImageRef::parse("first").expect("ref")).expect("by name").id, second.id);
        assert!(store.get(&first.id).expect("still there by digest").names.is_empty());
    }
}
