//! The one error of image work: a category a scheduler can act on (a permanent one fails the
//! job, a transient one requeues it on another node) and a one-line reason for people.

use std::fmt;
use std::io;

use crate::digest::clip;

/// What went wrong, as far as the job is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorKind {
    /// The registry has no such repository, tag or manifest (permanent).
    NotFound,
    /// The registry refused the credentials, or asked for some and none were configured
    /// (permanent).
    Unauthorized,
    /// The text is not an image reference or rootfs path (permanent).
    InvalidReference,
    /// A layer is not a tar this store can unpack safely: an entry escapes its directory, a
    /// hard link points outside it, the archive is corrupt although its digest matched
    /// (permanent).
    InvalidLayer,
    /// A manifest, media type, platform or digest algorithm this store does not handle
    /// (permanent).
    Unsupported,
    /// Bytes did not match the digest that names them (transient: another node, another
    /// mirror or another try may get the right bytes).
    DigestMismatch,
    /// The store's disk is full (transient: another node may have room).
    DiskFull,
    /// The registry could not be reached, timed out or failed (transient).
    Unreachable,
    /// A local file operation failed (transient).
    Io,
    /// The image is pinned by jobs on the node and cannot be removed now.
    InUse,
    /// The image (or one of its layers alone) unpacks to more than the store's `max-size`
    /// (permanent: the scheduler keeps no memory of the nodes that refused a job, so a requeue
    /// would place it here again and again; the reason says how much it needs).
    TooLarge,
}

impl ErrorKind {
    /// A permanent error fails the job: pulling the same reference elsewhere gives the same
    /// answer. A transient one requeues it.
    pub fn is_permanent(self) -> bool {
        matches!(
            self,
            ErrorKind::NotFound
                | ErrorKind::Unauthorized
                | ErrorKind::InvalidReference
                | ErrorKind::InvalidLayer
                | ErrorKind::Unsupported
                | ErrorKind::TooLarge
        )
    }

    /// The category in words, the start of every message.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::InvalidReference => "invalid image reference",
            ErrorKind::InvalidLayer => "invalid layer",
            ErrorKind::Unsupported => "unsupported image",
            ErrorKind::DigestMismatch => "digest mismatch",
            ErrorKind::DiskFull => "disk full",
            ErrorKind::Unreachable => "registry unreachable",
            ErrorKind::Io => "image store error",
            ErrorKind::InUse => "image in use",
            ErrorKind::TooLarge => "image too large for this node",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an image or layer needs in the store, of a [`ErrorKind::TooLarge`] error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// Bytes it unpacks to (or at least, see `more`).
    pub bytes: u64,
    /// The store's `max-size`.
    pub max_size: u64,
    /// Counting stopped early (a bounded count): it needs more than `bytes`.
    pub more: bool,
}

impl Needs {
    /// `"needs 312.4 MB, store max-size is 100.0 MB"`.
    pub fn describe(&self) -> String {
        format!(
            "needs {}{} MB, store max-size is {} MB",
            if self.more { "more than " } else { "" },
            megabytes(self.bytes),
            megabytes(self.max_size)
        )
    }
}

/// Bytes as decimal megabytes with one decimal, as pull progress shows them.
fn megabytes(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

/// An image error: its [`ErrorKind`] and a one-line reason (`"not found: docker.io/library/x:1
/// (manifest unknown)"`). Cloneable, so every job waiting on one shared download gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageError {
    kind: ErrorKind,
    reason: String,
    needs: Option<Needs>,
}

impl ImageError {
    /// An error of `kind`; the reason is folded onto one line.
    pub fn new(kind: ErrorKind, reason: impl Into<String>) -> ImageError {
        let reason: String = reason.into();
        let reason = if reason.contains(['\n', '\r']) {
            reason.split(['\n', '\r']).map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ")
        } else {
            reason
        };
        ImageError { kind, reason, needs: None }
    }

    /// [`ErrorKind::TooLarge`]: `what` (`"image reg/x@sha256:…"`) needs more than the store
    /// holds; the reason is `"<what> needs N MB, store max-size is M MB"`.
    pub fn too_large(what: impl fmt::Display, needs: Needs) -> ImageError {
        ImageError {
            needs: Some(needs),
            ..ImageError::new(ErrorKind::TooLarge, format!("{what} {}", needs.describe()))
        }
    }

    /// What a [`ErrorKind::TooLarge`] error's image or layer needs.
    pub fn needs(&self) -> Option<Needs> {
        self.needs
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The reason without the category.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// See [`ErrorKind::is_permanent`].
    pub fn is_permanent(&self) -> bool {
        self.kind.is_permanent()
    }

    /// The same error with `context` in front of its reason (`"layer sha256:…: …"`).
    pub fn context(self, context: impl fmt::Display) -> ImageError {
        ImageError { reason: format!("{context}: {}", self.reason), ..self }
    }

    pub fn not_found(reason: impl Into<String>) -> ImageError {
        ImageError::new(ErrorKind::NotFound, reason)
    }
    pub fn unauthorized(reason: impl Into<String>) -> ImageError {
        ImageError::new(ErrorKind::Unauthorized, reason)
    }
    pub fn invalid_reference(reason: impl Into<String>) -> ImageError {
        ImageError::new(ErrorKind::InvalidReference, reason)
    }
    pub fn invalid_layer(reason: impl Into<String>) -> ImageError {
        ImageError::new(ErrorKind::InvalidLayer, reason)
    }
    pub fn unsupported(reason: impl Into<String>) -> ImageError {
        ImageError::new(ErrorKind::Unsupported, reason)
    }
    pub fn digest_mismatch(reason: impl Into<String>) -> ImageError {
        ImageError::new(ErrorKind::DigestMismatch, reason)
    }
    pub fn unreachable(reason: impl Into<String>) -> ImageError {
        ImageError::new(ErrorKind::Unreachable, reason)
    }

    /// A local I/O error: `ENOSPC` and `EDQUOT` are [`ErrorKind::DiskFull`], the rest
    /// [`ErrorKind::Io`]; `what` says what was being done.
    pub fn io(what: impl fmt::Display, error: &io::Error) -> ImageError {
        let kind = match error.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::DiskFull,
            _ if error.kind() == io::ErrorKind::StorageFull => ErrorKind::DiskFull,
            _ => ErrorKind::Io,
        };
        ImageError::new(kind, format!("{what}: {error}"))
    }

    /// Maps an error of the distribution client onto a category; `what` names the reference
    /// or blob asked for.
    pub(crate) fn from_registry(
        what: impl fmt::Display,
        error: oci_client::errors::OciDistributionError,
    ) -> ImageError {
        use oci_client::errors::{OciDistributionError as E, OciErrorCode as C};
        let kind = match &error {
            E::AuthenticationFailure(_) | E::UnauthorizedError { .. } => ErrorKind::Unauthorized,
            E::ImageManifestNotFoundError(_) => ErrorKind::NotFound,
            E::RegistryError { envelope, .. } => match envelope.errors.first().map(|e| &e.code) {
                Some(C::ManifestUnknown | C::NameUnknown | C::BlobUnknown | C::NotFound | C::ManifestBlobUnknown) => {
                    ErrorKind::NotFound
                }
                Some(C::Unauthorized | C::Denied) => ErrorKind::Unauthorized,
                Some(C::NameInvalid | C::TagInvalid) => ErrorKind::InvalidReference,
                Some(C::Unsupported) => ErrorKind::Unsupported,
                _ => ErrorKind::Unreachable,
            },
            E::ServerError { code: 404, .. } => ErrorKind::NotFound,
            E::ServerError { code: 401 | 403, .. } => ErrorKind::Unauthorized,
            E::DigestError(_) => ErrorKind::DigestMismatch,
            E::ManifestParsingError(_)
            | E::VersionedParsingError(_)
            | E::UnsupportedMediaTypeError(_)
            | E::UnsupportedSchemaVersionError(_)
            | E::IncompatibleLayerMediaTypeError(_)
            | E::ManifestEncodingError(_) => ErrorKind::Unsupported,
            E::IoError(e) => return ImageError::io(what, e),
            _ => ErrorKind::Unreachable,
        };
        let detail = match &error {
            E::RegistryError { envelope, .. } => envelope
                .errors
                .iter()
                .map(|e| if e.message.is_empty() { format!("{:?}", e.code) } else { e.message.clone() })
                .collect::<Vec<_>>()
                .join("; "),
            E::ServerError { code, message, .. } => format!("HTTP {code} {}", clip(message)),
            E::RequestError(e) => request_error_chain(e),
            other => other.to_string(),
        };
        ImageError::new(kind, format!("{what} ({detail})"))
    }
}

/// A reqwest error with its causes ("error sending request: connection refused").
fn request_error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.reason)
    }
}

impl std::error::Error for ImageError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_say_whether_a_job_fails_or_moves() {
        for kind in [
            ErrorKind::NotFound,
            ErrorKind::Unauthorized,
            ErrorKind::InvalidReference,
            ErrorKind::InvalidLayer,
            ErrorKind::Unsupported,
            ErrorKind::TooLarge,
        ] {
            assert!(kind.is_permanent(), "{kind}");
        }
        for kind in
            [ErrorKind::DigestMismatch, ErrorKind::DiskFull, ErrorKind::Unreachable, ErrorKind::Io, ErrorKind::InUse]
        {
            assert!(!kind.is_permanent(), "{kind}");
        }
    }

    #[test]
    fn reasons_are_one_line_and_start_with_the_category() {
        let e = ImageError::not_found("docker.io/library/x:1\n(manifest unknown)\n");
        assert_eq!(e.to_string(), "not found: docker.io/library/x:1; (manifest unknown)");
        let e = e.context("pull");
        assert_eq!(e.reason(), "pull: docker.io/library/x:1; (manifest unknown)");
        let full = ImageError::io("unpack", &io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(full.kind(), ErrorKind::DiskFull);
        assert!(full.to_string().starts_with("disk full: unpack: "), "{full}");
        assert_eq!(ImageError::io("x", &io::Error::from_raw_os_error(libc::EIO)).kind(), ErrorKind::Io);
        let needs = Needs { bytes: 312_400_000, max_size: 100 << 20, more: false };
        let big = ImageError::too_large("image reg:5000/x@sha256:ab", needs);
        assert_eq!(
            big.to_string(),
            "image too large for this node: image reg:5000/x@sha256:ab needs 312.4 MB, store max-size is 104.9 MB"
        );
        assert_eq!(big.needs(), Some(needs));
        assert_eq!(big.context("pull").needs(), Some(needs), "the figures survive context");
    }
}
