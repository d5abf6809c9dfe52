//! OCI images for corral jobs: image references with Docker's rules ([`reference`]), pulls
//! through the OCI distribution API ([`registry`], [`Images::pull`]), a content-addressed store
//! of unpacked layers with pins and LRU garbage collection ([`store`]), per-job overlayfs root
//! filesystems ([`rootfs`]), and an image config turned into the job's process ([`config`]).
//!
//! How the rest of corral uses it:
//! - at submit, a coordinator parses `--image` ([`ImageSpec::parse`]) and pins a tag to the
//!   digest it names now ([`Registry::resolve`]): the job runs bytes, not names; the image's
//!   layers ([`Registry::layers`]) are what placement compares with what nodes hold;
//! - a worker opens [`Images`] from its `[images]` table ([`ImagesSection`]); for a job placed
//!   on it, it pins the image ([`Images::pin`]), pulls it ([`Images::pull`], progress in
//!   [`PullProgress`]), mounts the job's root ([`Images::mount`], a [`JobRoot`]) and builds the
//!   process from the image config ([`ImageConfig::exec`]); it reports the layers it holds
//!   ([`ImageStore::layers`]) so placement can prefer it;
//! - every failure is an [`ImageError`] whose [`ErrorKind`] says whether the job fails
//!   (not found, unauthorized, a bad layer) or is requeued elsewhere (digest mismatch, disk
//!   full, registry unreachable).

pub mod auth;
pub mod config;
pub mod digest;
pub mod error;
mod images;
pub mod manifest;
pub mod reference;
pub mod registry;
pub mod rootfs;
pub mod settings;
pub mod store;

pub use auth::{Credential, Credentials};
pub use config::{resolve_user, ExecConfig, ImageConfig, JobOverrides};
pub use digest::Digest;
pub use error::{ErrorKind, ImageError, Needs};
pub use images::{Images, ProgressSnapshot, PullProgress, Transfer, UploadDir};
pub use manifest::{LayerBlob, Platform};
pub use reference::{ImageRef, ImageSpec};
pub use registry::{Registry, RegistryConfig};
pub use rootfs::{JobRoot, RootsDir};
pub use settings::{ContainerMount, ImagesSection, ImagesSettings, MountAllow};
pub use store::{GcReport, ImageEntry, ImagePin, ImageRecord, ImageStore, LayerRef, StoreUsage, StoredLayer};

/// Unpacking keeps owners and makes whiteout devices: the unit tests that do need root. Without
/// it they skip loudly, except under CI (`CI` set), where they fail.
#[cfg(test)]
pub(crate) fn test_needs_root() -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "the image store tests need root under CI");
    eprintln!("\n!!!!!!!!\n!!! SKIPPED: this test needs root (owners, whiteout devices)\n!!!!!!!!\n");
    false
}
