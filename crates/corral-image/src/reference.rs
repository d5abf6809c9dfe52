//! What `--image` names: an image reference `[REGISTRY/]NAME[:TAG][@sha256:DIGEST]`, normalised
//! with Docker's rules (no registry is Docker Hub, a one-part name on Docker Hub is under
//! `library/`, no tag is `latest`), or the absolute path of an unpacked root filesystem.
//!
//! Parsing is the distribution project's grammar as the `oci-spec` crate implements it; this
//! module adds the rootfs case, sha256-only digests, a length bound and pinning.

use std::fmt;
use std::net::IpAddr;
use std::path::{Component, Path, PathBuf};

use crate::digest::{clip, Digest};
use crate::error::ImageError;

/// Longest `--image` text accepted (the job spec's bound on paths).
pub const MAX_REFERENCE_LEN: usize = 4096;

/// Docker Hub's registry name in normalised references.
pub const DOCKER_HUB: &str = "docker.io";

/// What a job's `--image` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageSpec {
    /// An unpacked root filesystem that exists on every worker (an absolute path).
    Rootfs(PathBuf),
    /// An image in a registry (or loaded into the node's store).
    Registry(ImageRef),
}

impl ImageSpec {
    /// A text starting with `/` is a rootfs path (absolute, without `..`); anything else is
    /// parsed as an image reference.
    pub fn parse(text: &str) -> Result<ImageSpec, ImageError> {
        if text.len() > MAX_REFERENCE_LEN {
            return Err(ImageError::invalid_reference(format!(
                "image '{}' is longer than {MAX_REFERENCE_LEN} bytes",
                clip(text)
            )));
        }
        if text.starts_with('/') {
            let path = Path::new(text);
            if path.components().any(|c| c == Component::ParentDir) {
                return Err(ImageError::invalid_reference(format!(
                    "rootfs path '{}' contains '..'; give it without",
                    clip(text)
                )));
            }
            return Ok(ImageSpec::Rootfs(path.to_path_buf()));
        }
        if text.starts_with('.') || text.starts_with('~') {
            return Err(ImageError::invalid_reference(format!(
                "image '{}': a root filesystem directory must be given as an absolute path",
                clip(text)
            )));
        }
        ImageRef::parse(text).map(ImageSpec::Registry)
    }
}

impl fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageSpec::Rootfs(path) => write!(f, "{}", path.display()),
            ImageSpec::Registry(image) => image.fmt(f),
        }
    }
}

/// A normalised image reference. It names bytes only once it is pinned (has a digest): a tag
/// is resolved to a digest when a job is submitted, so every part, retry and step of the job
/// runs the same image even if the tag moves.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ImageRef {
    registry: String,
    repository: String,
    tag: Option<String>,
    digest: Option<Digest>,
}

impl ImageRef {
    /// Parses and normalises a reference: `busybox` is `docker.io/library/busybox:latest`,
    /// `localhost:5000/x@sha256:…` keeps its registry and digest (and no tag), `x:1@sha256:…`
    /// keeps both (the digest decides what runs).
    pub fn parse(text: &str) -> Result<ImageRef, ImageError> {
        if text.len() > MAX_REFERENCE_LEN {
            return Err(ImageError::invalid_reference(format!(
                "image '{}' is longer than {MAX_REFERENCE_LEN} bytes",
                clip(text)
            )));
        }
        let parsed: oci_client::Reference =
            text.parse().map_err(|e| ImageError::invalid_reference(format!("image '{}': {e}", clip(text))))?;
        let digest =
            parsed.digest().map(Digest::parse).transpose().map_err(|e| e.context(format!("image '{}'", clip(text))))?;
        Ok(ImageRef {
            registry: parsed.registry().to_string(),
            repository: parsed.repository().to_string(),
            tag: parsed.tag().map(str::to_string),
            digest,
        })
    }

    /// The registry host (and port): `docker.io`, `ghcr.io`, `localhost:5000`.
    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// The repository path in the registry: `library/busybox`.
    pub fn repository(&self) -> &str {
        &self.repository
    }

    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    pub fn digest(&self) -> Option<&Digest> {
        self.digest.as_ref()
    }

    /// Whether the reference names bytes (has a digest).
    pub fn is_pinned(&self) -> bool {
        self.digest.is_some()
    }

    /// The same reference pinned to `digest` (the tag is kept for people to read).
    pub fn pinned(&self, digest: Digest) -> ImageRef {
        ImageRef { digest: Some(digest), ..self.clone() }
    }

    /// `registry/repository[:tag]`, without the digest: the name a tag resolves through.
    pub fn tagged_name(&self) -> String {
        match &self.tag {
            Some(tag) => format!("{}/{}:{tag}", self.registry, self.repository),
            None => format!("{}/{}", self.registry, self.repository),
        }
    }

    /// Docker's short form: `busybox:1.36` for `docker.io/library/busybox:1.36`.
    pub fn familiar(&self) -> String {
        let full = self.to_string();
        let short = full.strip_prefix("docker.io/").map(|rest| rest.strip_prefix("library/").unwrap_or(rest));
        short.unwrap_or(&full).to_string()
    }

    /// Whether the registry is on this host (`localhost`, 127.0.0.0/8, ::1): plain HTTP is
    /// allowed there, as Docker allows it.
    pub fn is_loopback_registry(&self) -> bool {
        is_loopback_host(&self.registry)
    }

    /// The reference in the distribution client's form, pointed at `endpoint` (a mirror) when
    /// it is not the registry itself.
    pub(crate) fn to_oci(&self, endpoint: &str) -> oci_client::Reference {
        let mut reference = match (&self.tag, &self.digest) {
            (Some(tag), Some(digest)) => oci_client::Reference::with_tag_and_digest(
                self.registry.clone(),
                self.repository.clone(),
                tag.clone(),
                digest.to_string(),
            ),
            (_, Some(digest)) => {
                oci_client::Reference::with_digest(self.registry.clone(), self.repository.clone(), digest.to_string())
            }
            (Some(tag), None) => {
                oci_client::Reference::with_tag(self.registry.clone(), self.repository.clone(), tag.clone())
            }
            (None, None) => {
                oci_client::Reference::with_tag(self.registry.clone(), self.repository.clone(), "latest".into())
            }
        };
        if endpoint != self.registry {
            reference.set_mirror_registry(endpoint.to_string());
        }
        reference
    }
}

/// Whether `host` (`name[:port]`, `[v6]:port`) is this machine.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl fmt::Display for ImageRef {
    /// The full normalised form, `registry/repository[:tag][@digest]`, which parses back to the
    /// same reference.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::str::FromStr for ImageRef {
    type Err = ImageError;

    fn from_str(text: &str) -> Result<ImageRef, ImageError> {
        ImageRef::parse(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    const D: &str = "sha256:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff";

    /// Written the way Docker users write them, normalised as `docker pull` does.
    #[test]
    fn references_normalise_like_docker() {
        let cases = [
            ("busybox", "docker.io/library/busybox:latest"),
            ("busybox:1.36", "docker.io/library/busybox:1.36"),
            ("library/busybox", "docker.io/library/busybox:latest"),
            ("docker.io/busybox", "docker.io/library/busybox:latest"),
            ("index.docker.io/library/busybox:1", "docker.io/library/busybox:1"),
            (
                "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                "docker.io/pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
            ),
            ("nvcr.io/nvidia/pytorch:24.10-py3", "nvcr.io/nvidia/pytorch:24.10-py3"),
            ("ghcr.io/org/team/tool", "ghcr.io/org/team/tool:latest"),
            ("localhost/app", "localhost/app:latest"),
            ("localhost:5000/app:v2", "localhost:5000/app:v2"),
            ("127.0.0.1:5000/ns/app", "127.0.0.1:5000/ns/app:latest"),
            // A first part without a dot, colon or "localhost" is a Docker Hub namespace.
            ("myhost/app", "docker.io/myhost/app:latest"),
            // A port-like tag on a one-part name is a tag.
            ("test.com:5000", "docker.io/library/test.com:5000"),
        ];
        for (input, want) in cases {
            let image = ImageRef::parse(input).unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(image.to_string(), want, "{input}");
            assert_eq!(ImageRef::parse(&image.to_string()).expect("round trip"), image, "{input}");
            assert!(!image.is_pinned());
        }

        let pinned = ImageRef::parse(&format!("busybox@{D}")).expect("digest");
        assert_eq!(pinned.to_string(), format!("docker.io/library/busybox@{D}"));
        assert_eq!(pinned.tag(), None);
        assert!(pinned.is_pinned());
        let both = ImageRef::parse(&format!("busybox:1.36@{D}")).expect("tag and digest");
        assert_eq!(both.to_string(), format!("docker.io/library/busybox:1.36@{D}"));
        assert_eq!(both.tagged_name(), "docker.io/library/busybox:1.36");
        assert_eq!(both.familiar(), format!("busybox:1.36@{D}"));

        let tagged = ImageRef::parse("localhost:5000/app:v2").expect("tagged");
        let digest = Digest::parse(D).expect("digest");
        assert_eq!(tagged.pinned(digest.clone()).to_string(), format!("localhost:5000/app:v2@{D}"));
        assert_eq!(tagged.pinned(digest).familiar(), format!("localhost:5000/app:v2@{D}"));
    }

    #[test]
    fn bad_references_say_why() {
        for (input, needle) in [
            ("", "at least one component"),
            ("Busybox", "invalid reference format"),
            ("busybox:", "invalid reference format"),
            ("a//b", "invalid reference format"),
            ("busybox@sha256:0123456789abcdef0123456789abcdef01234567", "invalid checksum digest length"),
            ("busybox@md5:0123456789abcdef0123456789abcdef", "unsupported digest algorithm"),
        ] {
            let e = ImageRef::parse(input).expect_err(input);
            assert_eq!(e.kind(), ErrorKind::InvalidReference, "{input}: {e}");
            assert!(e.to_string().contains(needle), "{input}: {e}");
        }
        let long = "a".repeat(MAX_REFERENCE_LEN + 1);
        assert!(ImageRef::parse(&long).expect_err("long").to_string().contains("longer than 4096"));
    }

    #[test]
    fn rootfs_paths_and_references_are_told_apart() {
        assert_eq!(ImageSpec::parse("/srv/rootfs").expect("path"), ImageSpec::Rootfs("/srv/rootfs".into()));
        assert!(matches!(ImageSpec::parse("busybox").expect("ref"), ImageSpec::Registry(_)));
        let dotdot = ImageSpec::parse("/srv/../etc").expect_err("dotdot");
        assert!(dotdot.to_string().contains("'..'"), "{dotdot}");
        let relative = ImageSpec::parse("./rootfs").expect_err("relative");
        assert!(relative.to_string().contains("absolute path"), "{relative}");
        assert_eq!(ImageSpec::parse("/srv/rootfs").expect("path").to_string(), "/srv/rootfs");
    }

    #[test]
    fn loopback_registries_are_recognised() {
        for host in ["localhost", "localhost:5000", "127.0.0.1:5000", "127.1.2.3", "[::1]:5000", "LOCALHOST:1"] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in ["docker.io", "10.0.0.1:5000", "registry.local:5000", "[fe80::1]:5000"] {
            assert!(!is_loopback_host(host), "{host}");
        }
        assert!(ImageRef::parse("localhost:5000/a").expect("ref").is_loopback_registry());
    }
}
