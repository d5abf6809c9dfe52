//! The OCI distribution API through the `oci-client` crate: resolving a tag to a digest (the
//! small, bounded call a coordinator makes at submit), manifests (an index resolved to this
//! node's platform), configs and layer blobs from an offset (to resume a broken download).
//!
//! Bearer-token and basic auth are `oci-client`'s, with the credentials of a Docker
//! `config.json`. Plain HTTP is used for loopback registries and the configured insecure ones,
//! HTTPS (rustls with ring, as the rest of corral) for the others. Mirrors of a registry are
//! tried in order before it. `oci-client` hands blob bodies over as a stream without checking
//! them when a range is asked for; the caller ([`crate::Images`]) hashes every byte itself and
//! trusts nothing before the digest matches. Manifests are read whole by `oci-client`; their
//! size is bounded only by the request's time.

use std::collections::BTreeMap;
use std::sync::{Arc, Once};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::OciImageManifest;
use oci_client::Client;
use tracing::{debug, warn};

use crate::auth::Credentials;
use crate::digest::Digest;
use crate::error::{ErrorKind, ImageError};
use crate::manifest::{layer_blob, LayerBlob, Manifest, Platform, MAX_MANIFEST};
use crate::reference::{is_loopback_host, ImageRef};

/// Media types a manifest request accepts.
const MANIFEST_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// How the node (or coordinator) talks to registries.
#[derive(Clone, Debug)]
pub struct RegistryConfig {
    pub credentials: Credentials,
    /// Registries (`host[:port]`, or `host` for every port) reached over plain HTTP, besides
    /// loopback ones.
    pub insecure_registries: Vec<String>,
    /// Per registry (`docker.io`, `nvcr.io`), mirrors (`host[:port]`) tried in order before it.
    pub mirrors: BTreeMap<String, Vec<String>>,
    /// The platform chosen from image indexes.
    pub platform: Platform,
    pub connect_timeout: Duration,
    /// A response that sends nothing for this long is broken off (and a blob resumed).
    pub read_timeout: Duration,
    /// The whole of [`Registry::resolve`].
    pub resolve_timeout: Duration,
    /// Tries of a manifest, config or blob fetch that fails for a transient reason.
    pub attempts: u32,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        RegistryConfig {
            credentials: Credentials::none(),
            insecure_registries: Vec::new(),
            mirrors: BTreeMap::new(),
            platform: Platform::host(),
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            resolve_timeout: Duration::from_secs(10),
            attempts: 5,
        }
    }
}

/// A registry client (cheap to clone).
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

struct Inner {
    https: Client,
    http: Client,
    config: RegistryConfig,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("config", &self.inner.config).finish()
    }
}

/// A manifest resolved to one image.
#[derive(Debug)]
pub(crate) struct ImageManifest {
    pub manifest: OciImageManifest,
    pub digest: Digest,
    /// The index it was chosen from.
    pub index: Option<Digest>,
}

/// A blob's bytes from an offset.
pub(crate) struct BlobStream {
    pub stream: BoxStream<'static, std::io::Result<bytes::Bytes>>,
    /// Bytes to drop first: the registry ignored the range and sends the blob from its start.
    pub skip: u64,
}

/// Installs ring as the process's rustls provider (reqwest asks for the default one); a
/// provider installed before is kept.
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl Registry {
    pub fn new(config: RegistryConfig) -> Registry {
        install_crypto_provider();
        let client = |protocol| {
            Client::new(ClientConfig {
                protocol,
                platform_resolver: None,
                connect_timeout: Some(config.connect_timeout),
                read_timeout: Some(config.read_timeout),
                user_agent: concat!("corral/", env!("CARGO_PKG_VERSION")),
                ..ClientConfig::default()
            })
        };
        Registry {
            inner: Arc::new(Inner { https: client(ClientProtocol::Https), http: client(ClientProtocol::Http), config }),
        }
    }

    pub fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    /// Whether `endpoint` is reached over plain HTTP.
    pub fn is_insecure(&self, endpoint: &str) -> bool {
        let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h);
        is_loopback_host(endpoint)
            || self.inner.config.insecure_registries.iter().any(|entry| entry == endpoint || entry == host)
    }

    fn client(&self, endpoint: &str) -> &Client {
        if self.is_insecure(endpoint) {
            &self.inner.http
        } else {
            &self.inner.https
        }
    }

    /// Where to ask for an image: its registry's mirrors, then the registry.
    fn endpoints<'a>(&'a self, image: &'a ImageRef) -> Vec<&'a str> {
        let mut endpoints: Vec<&str> = self
            .inner
            .config
            .mirrors
            .get(image.registry())
            .map(|m| m.iter().map(String::as_str).collect())
            .unwrap_or_default();
        endpoints.push(image.registry());
        endpoints
    }

    /// The reference pinned to the digest its tag names now (a reference with a digest is
    /// returned as it is, without asking). Bounded by `resolve_timeout` in all, one request
    /// per endpoint (a `HEAD` of the manifest; a `GET` where the registry sends no digest).
    pub async fn resolve(&self, image: &ImageRef) -> Result<ImageRef, ImageError> {
        if image.is_pinned() {
            return Ok(image.clone());
        }
        let timeout = self.inner.config.resolve_timeout;
        let work = async {
            let endpoints = self.endpoints(image);
            let mut last = None;
            for endpoint in &endpoints {
                let auth = self.inner.config.credentials.auth_for(endpoint);
                match self.client(endpoint).fetch_manifest_digest(&image.to_oci(endpoint), &auth).await {
                    Ok(digest) => return Ok(image.pinned(Digest::parse(&digest)?)),
                    Err(e) => {
                        let e = ImageError::from_registry(image, e);
                        debug!(endpoint, error = %e, "resolve failed at this endpoint");
                        last = Some(e);
                    }
                }
            }
            Err(last.expect("at least the registry itself"))
        };
        tokio::time::timeout(timeout, work)
            .await
            .unwrap_or_else(|_| Err(ImageError::unreachable(format!("{image}: no answer within {timeout:?}"))))
    }

    /// The layers of the image a reference names (resolved to this client's platform): what
    /// placement compares with the layers nodes hold ([`crate::ImageStore::layers`]). Bounded
    /// by `resolve_timeout` in all, as [`Registry::resolve`].
    pub async fn layers(&self, image: &ImageRef) -> Result<Vec<LayerBlob>, ImageError> {
        let timeout = self.inner.config.resolve_timeout;
        let work = async {
            let pinned = self.resolve(image).await?;
            let resolved = self.image_manifest(&pinned).await?;
            resolved.manifest.layers.iter().map(layer_blob).collect()
        };
        tokio::time::timeout(timeout, work)
            .await
            .unwrap_or_else(|_| Err(ImageError::unreachable(format!("{image}: no answer within {timeout:?}"))))
    }

    /// The image manifest a pinned reference names; an index is resolved to the node's
    /// platform. Every manifest is checked against the digest that named it.
    pub(crate) async fn image_manifest(&self, image: &ImageRef) -> Result<ImageManifest, ImageError> {
        let digest =
            image.digest().ok_or_else(|| ImageError::invalid_reference(format!("{image} is not pinned")))?.clone();
        match self.manifest(image, &digest).await? {
            Manifest::Image(manifest) => Ok(ImageManifest { manifest: *manifest, digest, index: None }),
            Manifest::Index(index) => {
                let entry = self.inner.config.platform.choose(&index.manifests).map_err(|e| e.context(image))?;
                let chosen = Digest::parse(&entry.digest)?;
                match self.manifest(image, &chosen).await? {
                    Manifest::Image(manifest) => {
                        Ok(ImageManifest { manifest: *manifest, digest: chosen, index: Some(digest) })
                    }
                    Manifest::Index(_) => {
                        Err(ImageError::unsupported(format!("{image}: {chosen} is an index inside an index")))
                    }
                }
            }
        }
    }

    async fn manifest(&self, image: &ImageRef, digest: &Digest) -> Result<Manifest, ImageError> {
        let by_digest = image.pinned(digest.clone());
        let bytes = self
            .with_retries(&format!("manifest {digest}"), || async {
                let mut last = None;
                for endpoint in self.endpoints(image) {
                    let auth = self.inner.config.credentials.auth_for(endpoint);
                    match self
                        .client(endpoint)
                        .pull_manifest_raw(&by_digest.to_oci(endpoint), &auth, MANIFEST_TYPES)
                        .await
                    {
                        Ok((bytes, _)) => return Ok(bytes),
                        Err(e) => {
                            let e = ImageError::from_registry(&by_digest, e);
                            debug!(endpoint, error = %e, "manifest fetch failed at this endpoint");
                            last = Some(e);
                        }
                    }
                }
                Err(last.expect("at least the registry itself"))
            })
            .await?;
        if bytes.len() as u64 > MAX_MANIFEST {
            return Err(ImageError::unsupported(format!("{by_digest}: manifest larger than {MAX_MANIFEST} bytes")));
        }
        let actual = Digest::of(&bytes);
        if &actual != digest {
            return Err(ImageError::digest_mismatch(format!("manifest {digest} of {image} has digest {actual}")));
        }
        Manifest::parse(&bytes).map_err(|e| e.context(&by_digest))
    }

    /// A small blob (a config) of at most `max` bytes, checked against its digest.
    pub(crate) async fn small_blob(&self, image: &ImageRef, digest: &Digest, max: u64) -> Result<Vec<u8>, ImageError> {
        let bytes = self
            .with_retries(&format!("blob {digest}"), || async {
                let mut blob = self.blob(image, digest, 0).await?;
                let mut bytes = Vec::new();
                while let Some(chunk) = blob.stream.next().await {
                    let chunk = chunk.map_err(|e| ImageError::unreachable(format!("blob {digest}: {e}")))?;
                    let skip = usize::try_from(blob.skip).unwrap_or(usize::MAX).min(chunk.len());
                    blob.skip -= skip as u64;
                    bytes.extend_from_slice(&chunk[skip..]);
                    if bytes.len() as u64 > max {
                        return Err(ImageError::unsupported(format!("blob {digest} is larger than {max} bytes")));
                    }
                }
                Ok(bytes)
            })
            .await?;
        let actual = Digest::of(&bytes);
        if &actual != digest {
            return Err(ImageError::digest_mismatch(format!("blob {digest} of {image} has digest {actual}")));
        }
        Ok(bytes)
    }

    /// A blob's bytes from `offset` (a `Range` request), from the first endpoint that has it.
    pub(crate) async fn blob(&self, image: &ImageRef, digest: &Digest, offset: u64) -> Result<BlobStream, ImageError> {
        let mut last = None;
        for endpoint in self.endpoints(image) {
            let client = self.client(endpoint);
            let reference = image.to_oci(endpoint);
            client
                .store_auth_if_needed(reference.resolve_registry(), &self.inner.config.credentials.auth_for(endpoint))
                .await;
            match client.pull_blob_stream_partial(&reference, digest.as_str(), offset, None).await {
                Ok(oci_client::client::BlobResponse::Full(s)) => {
                    return Ok(BlobStream { stream: s.stream, skip: offset })
                }
                Ok(oci_client::client::BlobResponse::Partial(s)) => {
                    return Ok(BlobStream { stream: s.stream, skip: 0 })
                }
                Err(e) => {
                    let e = ImageError::from_registry(format!("blob {digest} of {}", image.tagged_name()), e);
                    debug!(endpoint, error = %e, "blob fetch failed at this endpoint");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least the registry itself"))
    }

    /// Runs `work` up to `attempts` times while it fails as unreachable.
    pub(crate) async fn with_retries<T, F, Fut>(&self, what: &str, mut work: F) -> Result<T, ImageError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ImageError>>,
    {
        let attempts = self.inner.config.attempts.max(1);
        let mut attempt = 1;
        loop {
            match work().await {
                Err(e) if e.kind() == ErrorKind::Unreachable && attempt < attempts => {
                    warn!(what, attempt, error = %e, "retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}

/// 250 ms doubling per try, at most 4 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(250u64 << attempt.clamp(1, 5).saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_configured_registries_use_plain_http() {
        let registry = Registry::new(RegistryConfig {
            insecure_registries: vec!["registry.lab:5000".into(), "10.1.2.3".into()],
            ..RegistryConfig::default()
        });
        for endpoint in ["localhost:5000", "127.0.0.1:41234", "registry.lab:5000", "10.1.2.3:5000", "10.1.2.3"] {
            assert!(registry.is_insecure(endpoint), "{endpoint}");
        }
        for endpoint in ["docker.io", "registry.lab:5001", "registry.lab", "ghcr.io"] {
            assert!(!registry.is_insecure(endpoint), "{endpoint}");
        }
    }

    #[test]
    fn mirrors_come_before_their_registry() {
        let registry = Registry::new(RegistryConfig {
            mirrors: BTreeMap::from([("docker.io".to_string(), vec!["mirror.lab:5000".to_string()])]),
            ..RegistryConfig::default()
        });
        let hub = ImageRef::parse("busybox").expect("ref");
        assert_eq!(registry.endpoints(&hub), ["mirror.lab:5000", "docker.io"]);
        let other = ImageRef::parse("ghcr.io/a/b").expect("ref");
        assert_eq!(registry.endpoints(&other), ["ghcr.io"]);
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        assert_eq!(backoff(1), Duration::from_millis(250));
        assert_eq!(backoff(2), Duration::from_millis(500));
        assert_eq!(backoff(5), Duration::from_secs(4));
        assert_eq!(backoff(50), Duration::from_secs(4));
    }
}
