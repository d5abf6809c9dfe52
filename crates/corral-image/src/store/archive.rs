//! `corral image load`: images from a `docker save` archive (`manifest.json`, configs, layer
//! tars), an OCI archive (a tar of an OCI image layout, as `docker save` writes since Docker 25
//! and `skopeo copy … oci-archive:` writes) or an OCI layout directory. Every blob is checked
//! against its digest before the store keeps it, as a pull is (a layer of an older `docker
//! save`, which names none, against its config's diff_id).
//!
//! An archive is read in place: its members are indexed once (name, offset, size) and each blob
//! is read from its offset, so nothing is extracted to disk but the unpacked layers. Paths in
//! `manifest.json` are looked up among the members, never opened on the host.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::{now_ms, ImageRecord, ImageStore, LayerRef};
use crate::config::ImageConfig;
use crate::digest::{clip, Digest, HashingReader};
use crate::error::ImageError;
use crate::manifest::{self, Manifest, Platform, MAX_CONFIG, MAX_MANIFEST};
use crate::reference::ImageRef;
use crate::store::unpack::{unpack_layer, Compression};

/// Most members an archive may have.
const MAX_MEMBERS: usize = 1_000_000;

/// Where the blobs of an archive are.
enum Source {
    Dir(PathBuf),
    Tar { file: PathBuf, members: BTreeMap<String, (u64, u64)> },
}

impl Source {
    fn open(path: &Path) -> Result<Source, ImageError> {
        let meta = std::fs::metadata(path).map_err(|e| ImageError::io(format!("{}", path.display()), &e))?;
        if meta.is_dir() {
            return Ok(Source::Dir(path.to_path_buf()));
        }
        let mut file = File::open(path).map_err(|e| ImageError::io(format!("{}", path.display()), &e))?;
        let mut magic = [0u8; 4];
        let got = file.read(&mut magic).map_err(|e| ImageError::io(format!("read {}", path.display()), &e))?;
        if Compression::sniff(&magic[..got]) != Compression::None {
            return Err(ImageError::unsupported(format!(
                "{} is compressed: decompress it first (gunzip or zstd -d), then load the tar",
                path.display()
            )));
        }
        file.seek(SeekFrom::Start(0)).map_err(|e| ImageError::io(format!("read {}", path.display()), &e))?;
        let mut archive = tar::Archive::new(BufReader::new(file));
        let mut members = BTreeMap::new();
        let bad = |e: io::Error| ImageError::unsupported(format!("{} is not a tar archive: {e}", path.display()));
        for entry in archive.entries().map_err(bad)? {
            let entry = entry.map_err(bad)?;
            if !matches!(entry.header().entry_type(), tar::EntryType::Regular | tar::EntryType::Continuous) {
                continue;
            }
            if members.len() >= MAX_MEMBERS {
                return Err(ImageError::unsupported(format!("{} has more than {MAX_MEMBERS} members", path.display())));
            }
            if let Some(name) = member_name(&entry.path_bytes()) {
                members.insert(name, (entry.raw_file_position(), entry.size()));
            }
        }
        Ok(Source::Tar { file: path.to_path_buf(), members })
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Source::Dir(dir) => dir.join(name).is_file(),
            Source::Tar { members, .. } => members.contains_key(name),
        }
    }

    /// The member `name` (a relative path without `..`).
    fn reader(&self, name: &str) -> Result<Box<dyn Read + Send>, ImageError> {
        let missing = || ImageError::not_found(format!("the archive has no '{}'", clip(name)));
        match self {
            Source::Dir(dir) => {
                let name = member_name(name.as_bytes()).ok_or_else(missing)?;
                let file = File::open(dir.join(&name)).map_err(|_| missing())?;
                Ok(Box::new(BufReader::with_capacity(256 * 1024, file)))
            }
            Source::Tar { file, members } => {
                let (offset, size) = *members.get(name).ok_or_else(missing)?;
                let mut f = File::open(file).map_err(|e| ImageError::io(format!("{}", file.display()), &e))?;
                f.seek(SeekFrom::Start(offset)).map_err(|e| ImageError::io(format!("read {}", file.display()), &e))?;
                Ok(Box::new(BufReader::with_capacity(256 * 1024, f.take(size))))
            }
        }
    }

    fn read_small(&self, name: &str, max: u64) -> Result<Vec<u8>, ImageError> {
        let mut bytes = Vec::new();
        self.reader(name)?
            .take(max + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| ImageError::io(format!("read '{}' of the archive", clip(name)), &e))?;
        if bytes.len() as u64 > max {
            return Err(ImageError::unsupported(format!("'{}' of the archive is larger than {max} bytes", clip(name))));
        }
        Ok(bytes)
    }

    /// A blob of an OCI layout, checked against its digest.
    fn blob(&self, digest: &Digest, max: u64) -> Result<Vec<u8>, ImageError> {
        let bytes = self.read_small(&blob_path(digest), max)?;
        let actual = Digest::of(&bytes);
        if &actual != digest {
            return Err(ImageError::digest_mismatch(format!("blob {digest} of the archive has digest {actual}")));
        }
        Ok(bytes)
    }
}

fn blob_path(digest: &Digest) -> String {
    format!("blobs/sha256/{}", digest.hex())
}

/// A member's name as `manifest.json` and layouts write it: `./` and `/` dropped, `..` refused.
fn member_name(raw: &[u8]) -> Option<String> {
    let path = Path::new(OsStr::from_bytes(raw));
    let mut parts = Vec::new();
    for part in path.components() {
        match part {
            Component::Normal(p) => parts.push(p.to_str()?.to_string()),
            Component::CurDir | Component::RootDir => {}
            _ => return None,
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifestEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

pub(crate) fn load(store: &Arc<ImageStore>, path: &Path) -> Result<Vec<ImageRecord>, ImageError> {
    let source = Source::open(path)?;
    if source.has("index.json") && source.has("oci-layout") {
        load_oci(store, &source)
    } else if source.has("manifest.json") {
        load_docker(store, &source)
    } else {
        Err(ImageError::unsupported(format!(
            "{} is neither an OCI layout or archive (index.json, oci-layout) nor a docker save archive (manifest.json)",
            path.display()
        )))
    }
}

fn load_oci(store: &Arc<ImageStore>, source: &Source) -> Result<Vec<ImageRecord>, ImageError> {
    let bytes = source.read_small("index.json", MAX_MANIFEST)?;
    let Manifest::Index(index) = Manifest::parse(&bytes)? else {
        return Err(ImageError::unsupported("index.json is not an image index"));
    };
    let platform = Platform::host();
    let mut loaded = Vec::new();
    for entry in &index.manifests {
        let annotations = entry.annotations.clone().unwrap_or_default();
        let names: BTreeSet<String> = ["io.containerd.image.name", "org.opencontainers.image.ref.name"]
            .iter()
            .filter_map(|key| annotations.get(*key))
            // A bare tag ("latest") names nothing by itself.
            .filter(|name| name.contains(['/', ':']))
            .filter_map(|name| ImageRef::parse(name).ok())
            .map(|r| r.tagged_name())
            .collect();
        let digest = Digest::parse(&entry.digest)?;
        let (manifest, manifest_digest, index_digest) = match Manifest::parse(&source.blob(&digest, MAX_MANIFEST)?)? {
            Manifest::Image(manifest) => (*manifest, digest, None),
            Manifest::Index(nested) => {
                let chosen = Digest::parse(&platform.choose(&nested.manifests)?.digest)?;
                let Manifest::Image(manifest) = Manifest::parse(&source.blob(&chosen, MAX_MANIFEST)?)? else {
                    return Err(ImageError::unsupported(format!("{chosen} is an index inside an index")));
                };
                (*manifest, chosen, Some(digest))
            }
        };
        let config_digest = Digest::parse(&manifest.config.digest)?;
        let config = source.blob(&config_digest, MAX_CONFIG)?;
        let diff_ids = ImageConfig::parse(&config)?.rootfs.diff_ids;
        let layers = manifest::layer_blobs(&manifest, &diff_ids)?
            .into_iter()
            .map(|b| Layer { member: blob_path(&b.digest), expect: Expect::Blob(b.digest) })
            .collect();
        let record = store_image(
            store,
            source,
            layers,
            ImageRecordParts { id: manifest_digest, index: index_digest, names, config_digest, config },
        )?;
        loaded.push(record);
    }
    Ok(loaded)
}

fn load_docker(store: &Arc<ImageStore>, source: &Source) -> Result<Vec<ImageRecord>, ImageError> {
    let bytes = source.read_small("manifest.json", MAX_MANIFEST)?;
    let entries: Vec<DockerManifestEntry> = serde_json::from_slice(&bytes)
        .map_err(|e| ImageError::unsupported(format!("manifest.json of the archive is not valid: {e}")))?;
    let mut loaded = Vec::new();
    for entry in entries {
        let config = source.read_small(&entry.config, MAX_CONFIG)?;
        let config_digest = Digest::of(&config);
        if let Some(named) = digest_in_name(&entry.config) {
            if named != config_digest {
                return Err(ImageError::digest_mismatch(format!(
                    "config '{}' has digest {config_digest}",
                    clip(&entry.config)
                )));
            }
        }
        let diff_ids = ImageConfig::parse(&config)?.rootfs.diff_ids;
        if diff_ids.len() != entry.layers.len() {
            return Err(ImageError::unsupported(format!(
                "manifest.json lists {} layers but the config {} diff_ids",
                entry.layers.len(),
                diff_ids.len()
            )));
        }
        let layers = entry
            .layers
            .iter()
            .zip(diff_ids)
            .map(|(member, diff_id)| Layer {
                member: member.clone(),
                // Docker 25 names layers by their blob digest; earlier versions write
                // uncompressed `<id>/layer.tar`, checked against the config's diff_id.
                expect: digest_in_name(member).map_or(Expect::DiffId(diff_id), Expect::Blob),
            })
            .collect();
        let names = entry
            .repo_tags
            .unwrap_or_default()
            .iter()
            .filter_map(|t| ImageRef::parse(t).ok())
            .map(|r| r.tagged_name())
            .collect();
        loaded.push(store_image(
            store,
            source,
            layers,
            ImageRecordParts { id: config_digest.clone(), index: None, names, config_digest, config },
        )?);
    }
    Ok(loaded)
}

/// The digest a member's name carries (`blobs/sha256/<hex>`, `<hex>.json`, `<hex>.tar`).
fn digest_in_name(name: &str) -> Option<Digest> {
    let base = name.rsplit('/').next()?;
    let hex = base.strip_suffix(".json").or_else(|| base.strip_suffix(".tar")).unwrap_or(base);
    if name.starts_with("blobs/sha256/") || base != hex {
        Digest::parse(&format!("sha256:{hex}")).ok()
    } else {
        None
    }
}

struct ImageRecordParts {
    id: Digest,
    index: Option<Digest>,
    names: BTreeSet<String>,
    config_digest: Digest,
    config: Vec<u8>,
}

/// A layer of an archive and what its bytes must match.
struct Layer {
    member: String,
    expect: Expect,
}

enum Expect {
    /// The blob's digest: the layer is stored under it.
    Blob(Digest),
    /// The uncompressed tar's digest (no blob digest is known): the layer is stored under the
    /// digest of its member's bytes, the same for an uncompressed tar.
    DiffId(Digest),
}

impl Expect {
    fn key(&self) -> &Digest {
        match self {
            Expect::Blob(d) | Expect::DiffId(d) => d,
        }
    }
}

/// Unpacks the layers the store lacks, each checked against its digest, and records the image.
fn store_image(
    store: &Arc<ImageStore>,
    source: &Source,
    layers: Vec<Layer>,
    parts: ImageRecordParts,
) -> Result<ImageRecord, ImageError> {
    let keys: Vec<Digest> = layers.iter().map(|l| l.expect.key().clone()).collect();
    let _lease = store.lease(&keys);
    let mut refs = Vec::new();
    for layer in &layers {
        let name = &layer.member;
        let mut digest = layer.expect.key().clone();
        if !store.has_layer(&digest) {
            let tmp = store.tmp_dir()?;
            let mut reader = HashingReader::new(source.reader(name)?);
            let diff_id = matches!(layer.expect, Expect::DiffId(_));
            let unpacked = unpack_layer(&mut reader, tmp.path(), diff_id, store.max_size());
            let (actual, _) =
                reader.finish().map_err(|e| ImageError::io(format!("read '{}' of the archive", clip(name)), &e))?;
            if let Expect::Blob(blob) = &layer.expect {
                if &actual != blob {
                    return Err(ImageError::digest_mismatch(format!(
                        "layer '{}' of the archive has digest {actual}",
                        clip(name)
                    )));
                }
            }
            let unpacked = unpacked.map_err(|e| e.context(format!("layer '{}'", clip(name))))?;
            if let (Expect::DiffId(diff_id), Some(got)) = (&layer.expect, &unpacked.diff_id) {
                if got != diff_id {
                    return Err(ImageError::digest_mismatch(format!(
                        "layer '{}' unpacks to {got} but the config says {diff_id}",
                        clip(name)
                    )));
                }
            }
            digest = actual;
            store.commit_layer(tmp, &digest, &unpacked)?;
        }
        refs.push(LayerRef { size: store.layer_size(&digest).unwrap_or(0), digest });
    }
    let now = now_ms();
    let config =
        String::from_utf8(parts.config).map_err(|_| ImageError::unsupported("the image config is not UTF-8"))?;
    store.put_image(ImageRecord {
        id: parts.id,
        index: parts.index,
        names: parts.names,
        config_digest: parts.config_digest,
        config,
        layers: refs,
        pulled_ms: now,
        last_used_ms: now,
    })
}
