//! Manifests as registries and archives hold them: an image manifest (OCI or Docker schema 2)
//! or an image index / manifest list, from which the node's platform is chosen.

use oci_client::manifest::{ImageIndexEntry, OciDescriptor, OciImageIndex, OciImageManifest};
use serde::Deserialize;

use crate::digest::{clip, Digest};
use crate::error::ImageError;

/// Largest manifest or index read from an archive (the distribution registry's own limit).
pub(crate) const MAX_MANIFEST: u64 = 4 << 20;
/// Largest image config read.
pub(crate) const MAX_CONFIG: u64 = 8 << 20;

/// Media types of filesystem layers (compression is told from the bytes, as Docker does).
const LAYER_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd",
];

/// A parsed manifest.
#[derive(Debug)]
pub(crate) enum Manifest {
    Image(Box<OciImageManifest>),
    Index(OciImageIndex),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Probe {
    schema_version: Option<i64>,
    media_type: Option<String>,
    manifests: Option<serde_json::Value>,
}

impl Manifest {
    pub(crate) fn parse(bytes: &[u8]) -> Result<Manifest, ImageError> {
        let probe: Probe =
            serde_json::from_slice(bytes).map_err(|e| ImageError::unsupported(format!("manifest is not JSON: {e}")))?;
        if probe.schema_version != Some(2) {
            return Err(ImageError::unsupported(format!(
                "manifest schema version {} (only 2: Docker schema 2 or OCI)",
                probe.schema_version.map_or("missing".to_string(), |v| v.to_string())
            )));
        }
        let is_index = match probe.media_type.as_deref() {
            Some(
                "application/vnd.oci.image.index.v1+json" | "application/vnd.docker.distribution.manifest.list.v2+json",
            ) => true,
            Some(
                "application/vnd.oci.image.manifest.v1+json" | "application/vnd.docker.distribution.manifest.v2+json",
            ) => false,
            Some(other) => return Err(ImageError::unsupported(format!("manifest media type '{}'", clip(other)))),
            None => probe.manifests.is_some(),
        };
        if is_index {
            serde_json::from_slice(bytes)
                .map(Manifest::Index)
                .map_err(|e| ImageError::unsupported(format!("image index is not valid: {e}")))
        } else {
            serde_json::from_slice(bytes)
                .map(|m| Manifest::Image(Box::new(m)))
                .map_err(|e| ImageError::unsupported(format!("image manifest is not valid: {e}")))
        }
    }
}

/// A manifest's layer, checked: a filesystem layer with a sha256 digest, and its compressed
/// size. The store keeps layers under these digests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerBlob {
    pub digest: Digest,
    pub size: u64,
}

/// The layers of an image manifest, checked against its config's diff_ids (one each).
pub(crate) fn layer_blobs(manifest: &OciImageManifest, diff_ids: &[Digest]) -> Result<Vec<LayerBlob>, ImageError> {
    if manifest.layers.len() != diff_ids.len() {
        return Err(ImageError::unsupported(format!(
            "the manifest has {} layers but the config {} diff_ids",
            manifest.layers.len(),
            diff_ids.len()
        )));
    }
    manifest.layers.iter().map(layer_blob).collect()
}

pub(crate) fn layer_blob(descriptor: &OciDescriptor) -> Result<LayerBlob, ImageError> {
    if !LAYER_MEDIA_TYPES.contains(&descriptor.media_type.as_str()) {
        return Err(ImageError::unsupported(format!(
            "layer media type '{}' is not a filesystem layer",
            clip(&descriptor.media_type)
        )));
    }
    let digest = Digest::parse(&descriptor.digest)?;
    let size = u64::try_from(descriptor.size)
        .map_err(|_| ImageError::unsupported(format!("layer {digest} has a negative size")))?;
    Ok(LayerBlob { digest, size })
}

/// The platform images are chosen for: Linux and the CPU this node runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    /// Go's name (`amd64`, `arm64`), as image indexes write it.
    pub architecture: String,
    /// `v8` on arm64, `v7` on 32-bit arm; `None` elsewhere.
    pub variant: Option<String>,
}

impl Platform {
    /// Linux on this machine's architecture.
    pub fn host() -> Platform {
        let (architecture, variant) = match std::env::consts::ARCH {
            "x86_64" => ("amd64", None),
            "aarch64" => ("arm64", Some("v8")),
            "arm" => ("arm", Some("v7")),
            "x86" => ("386", None),
            "powerpc64" => ("ppc64le", None),
            "riscv64" => ("riscv64", None),
            "s390x" => ("s390x", None),
            other => (other, None),
        };
        Platform { os: "linux".into(), architecture: architecture.into(), variant: variant.map(str::to_string) }
    }

    /// The entry of an index for this platform: same OS and architecture, and the same variant
    /// where the entry names one (an exact variant match preferred). Attestation manifests are
    /// skipped.
    pub(crate) fn choose<'a>(&self, entries: &'a [ImageIndexEntry]) -> Result<&'a ImageIndexEntry, ImageError> {
        let candidates: Vec<(&ImageIndexEntry, bool)> = entries
            .iter()
            .filter_map(|entry| {
                let platform = entry.platform.as_ref()?;
                if platform.os.to_string() != self.os || platform.architecture.to_string() != self.architecture {
                    return None;
                }
                match (&platform.variant, &self.variant) {
                    (None, _) => Some((entry, false)),
                    (Some(theirs), Some(ours)) if theirs == ours => Some((entry, true)),
                    _ => None,
                }
            })
            .collect();
        if let Some((entry, _)) = candidates.iter().find(|(_, exact)| *exact).or_else(|| candidates.first()) {
            return Ok(entry);
        }
        let offered: Vec<String> = entries
            .iter()
            .filter_map(|e| e.platform.as_ref())
            .map(|p| match &p.variant {
                Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                None => format!("{}/{}", p.os, p.architecture),
            })
            .filter(|p| p != "unknown/unknown")
            .collect();
        Err(ImageError::unsupported(format!(
            "no {} image in the index (it has {})",
            self,
            if offered.is_empty() { "none with a platform".to_string() } else { offered.join(", ") }
        )))
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(variant) = &self.variant {
            write!(f, "/{variant}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn index(platforms: &[(&str, &str, Option<&str>)]) -> Vec<ImageIndexEntry> {
        let json = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": platforms.iter().enumerate().map(|(i, (os, arch, variant))| {
                let mut platform = serde_json::json!({"os": os, "architecture": arch});
                if let Some(v) = variant { platform["variant"] = serde_json::json!(v); }
                serde_json::json!({
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": format!("sha256:{}", format!("{i:x}").repeat(64).chars().take(64).collect::<String>()),
                    "size": 100, "platform": platform})
            }).collect::<Vec<_>>(),
        });
        match Manifest::parse(json.to_string().as_bytes()).expect("index") {
            Manifest::Index(index) => index.manifests,
            Manifest::Image(_) => panic!("not an index"),
        }
    }

    #[test]
    fn the_node_platform_is_chosen_from_an_index() {
        let entries = index(&[("linux", "arm64", Some("v8")), ("linux", "amd64", None), ("unknown", "unknown", None)]);
        let amd = Platform { os: "linux".into(), architecture: "amd64".into(), variant: None };
        assert_eq!(amd.choose(&entries).expect("amd64").digest, entries[1].digest);
        let arm = Platform { os: "linux".into(), architecture: "arm64".into(), variant: Some("v8".into()) };
        assert_eq!(arm.choose(&entries).expect("arm64").digest, entries[0].digest);
        let arm_v7 = Platform { os: "linux".into(), architecture: "arm".into(), variant: Some("v7".into()) };
        let e = arm_v7.choose(&entries).expect_err("none");
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert_eq!(e.reason(), "no linux/arm/v7 image in the index (it has linux/arm64/v8, linux/amd64)");
        assert_eq!(Platform::host().os, "linux");
    }

    #[test]
    fn manifests_are_told_apart_and_old_ones_refused() {
        let docker = br#"{"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "size": 2},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "digest": "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "size": 10}]}"#;
        let Manifest::Image(image) = Manifest::parse(docker).expect("docker v2") else { panic!("image") };
        let diff = Digest::of(b"");
        assert_eq!(layer_blobs(&image, std::slice::from_ref(&diff)).expect("layers")[0].size, 10);
        assert!(layer_blobs(&image, &[]).expect_err("count").to_string().contains("1 layers but the config 0"));
        let schema1 = br#"{"schemaVersion": 1, "name": "x", "fsLayers": []}"#;
        assert!(Manifest::parse(schema1).expect_err("v1").to_string().contains("schema version 1"));
        let helm = br#"{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.cncf.helm.config.v1+json", "digest": "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "size": 2},
            "layers": [{"mediaType": "application/vnd.cncf.helm.chart.content.v1.tar+gzip", "digest": "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "size": 10}]}"#;
        let Manifest::Image(chart) = Manifest::parse(helm).expect("helm") else { panic!("image") };
        assert!(layer_blobs(&chart, &[diff]).expect_err("chart").to_string().contains("not a filesystem layer"));
    }
}
