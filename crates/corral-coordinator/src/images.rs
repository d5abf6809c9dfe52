//! Images at submit: a job's `--image` is either the absolute path of a root filesystem (kept
//! as it is) or an image reference, normalised with Docker's rules and pinned to the digest
//! its tag names now ([`corral_image::Registry::resolve`], bounded by the `[images]`
//! `resolve-timeout`), so that every part, retry and step of the job runs the same bytes
//! whatever the tag names later. A reference that does not resolve is refused with one line.

use corral_image::{ErrorKind, ImageError, ImageRef, ImageSpec, Registry};
use corral_types::JobSpec;
use std::collections::HashMap;
use tonic::Status;

/// Most distinct unpinned references one submit call may name: each costs up to one
/// `resolve-timeout`, so a batch's cost stays bounded whatever it carries.
pub(crate) const MAX_RESOLVES_PER_CALL: usize = 8;

/// Pins the image references of one submit call, each distinct reference resolved once.
pub(crate) struct ImagePinner<'a> {
    registry: &'a Registry,
    resolved: HashMap<ImageRef, ImageRef>,
    /// Tags resolved so far (a pinned reference is not asked for).
    asked: usize,
}

impl<'a> ImagePinner<'a> {
    pub(crate) fn new(registry: &'a Registry) -> ImagePinner<'a> {
        ImagePinner { registry, resolved: HashMap::new(), asked: 0 }
    }

    /// `spec` with its image normalised and, for a reference, `image_digest` set to the digest
    /// it names (a digest a client sent is never trusted: it is replaced). A rootfs path and
    /// a job without an image get no digest.
    pub(crate) async fn pin(&mut self, mut spec: JobSpec) -> Result<JobSpec, Status> {
        spec.image_digest = None;
        let Some(text) = spec.image.as_deref() else {
            return Ok(spec);
        };
        let image = match ImageSpec::parse(text).map_err(|e| Status::invalid_argument(e.to_string()))? {
            ImageSpec::Rootfs(_) => return Ok(spec),
            ImageSpec::Registry(image) => image,
        };
        let pinned = match self.resolved.get(&image) {
            Some(pinned) => pinned.clone(),
            None => {
                if !image.is_pinned() {
                    if self.asked == MAX_RESOLVES_PER_CALL {
                        return Err(Status::invalid_argument(format!(
                            "one submit may name at most {MAX_RESOLVES_PER_CALL} image tags: pin the others to their digest (NAME@sha256:...)"
                        )));
                    }
                    self.asked += 1;
                }
                let pinned = self.registry.resolve(&image).await.map_err(refusal)?;
                self.resolved.insert(image.clone(), pinned.clone());
                pinned
            }
        };
        spec.image = Some(image.to_string());
        spec.image_digest = pinned.digest().map(ToString::to_string);
        Ok(spec)
    }
}

/// A reference that does not resolve, as the one line a submit is refused with.
fn refusal(e: ImageError) -> Status {
    // The reason names the image: `not found: docker.io/library/x:1 (manifest unknown)`.
    let message = e.to_string();
    match e.kind() {
        ErrorKind::NotFound => Status::not_found(message),
        ErrorKind::Unauthorized => Status::permission_denied(message),
        ErrorKind::InvalidReference | ErrorKind::Unsupported => Status::invalid_argument(message),
        _ => Status::failed_precondition(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_image::RegistryConfig;
    use std::time::Duration;

    fn registry() -> Registry {
        // A closed loopback port: nothing answers, quickly.
        Registry::new(RegistryConfig {
            resolve_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            attempts: 1,
            ..RegistryConfig::default()
        })
    }

    fn spec(image: Option<&str>) -> JobSpec {
        JobSpec { image: image.map(str::to_string), tenant: "t".into(), ..JobSpec::default() }
    }

    #[tokio::test]
    async fn rootfs_paths_and_bare_processes_get_no_digest() {
        let registry = registry();
        let mut pinner = ImagePinner::new(&registry);
        let mut sent = spec(Some("/srv/rootfs"));
        sent.image_digest = Some(format!("sha256:{}", "0".repeat(64)));
        let pinned = pinner.pin(sent).await.expect("rootfs");
        assert_eq!((pinned.image.as_deref(), pinned.image_digest), (Some("/srv/rootfs"), None));
        let pinned = pinner.pin(spec(None)).await.expect("bare");
        assert_eq!((pinned.image, pinned.image_digest), (None, None));
    }

    #[tokio::test]
    async fn a_pinned_reference_is_normalised_without_asking() {
        let registry = registry();
        let mut pinner = ImagePinner::new(&registry);
        let digest = format!("sha256:{}", "ab".repeat(32));
        let pinned = pinner.pin(spec(Some(&format!("busybox@{digest}")))).await.expect("pinned");
        assert_eq!(pinned.image.as_deref(), Some(format!("docker.io/library/busybox@{digest}").as_str()));
        assert_eq!(pinned.image_digest, Some(digest));
    }

    #[tokio::test]
    async fn bad_and_unreachable_references_are_refused_with_one_line() {
        let registry = registry();
        let mut pinner = ImagePinner::new(&registry);
        let bad = pinner.pin(spec(Some("Not A Ref"))).await.expect_err("bad");
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
        let relative = pinner.pin(spec(Some("./rootfs"))).await.expect_err("relative");
        assert!(relative.message().contains("absolute path"), "{relative:?}");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        drop(listener);
        let gone = pinner.pin(spec(Some(&format!("127.0.0.1:{port}/x:1")))).await.expect_err("unreachable");
        assert_eq!(gone.code(), tonic::Code::FailedPrecondition, "{gone:?}");
        assert!(gone.message().starts_with("registry unreachable: "), "{gone:?}");
        assert!(!gone.message().contains('\n'), "{gone:?}");
    }
}
