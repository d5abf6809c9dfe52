//! Content digests (`sha256:<64 hex>`), the one identity of every blob, layer and image, and
//! the hashers that check bytes against them as they stream by.

use std::fmt;
use std::io::{self, Read};

use sha2::{Digest as _, Sha256};

use crate::error::ImageError;

/// A SHA-256 content digest in OCI form, `sha256:` and 64 lowercase hex digits. Other
/// algorithms are refused when parsed: every registry and tool in use writes sha256.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    const PREFIX: &'static str = "sha256:";

    /// Parses `sha256:<64 hex>` (hex digits in either case, kept lowercase).
    pub fn parse(text: &str) -> Result<Digest, ImageError> {
        let Some(hex) = text.strip_prefix(Self::PREFIX) else {
            let algorithm = text.split_once(':').map_or(text, |(a, _)| a);
            return Err(ImageError::unsupported(format!(
                "digest '{}': algorithm '{}' is not supported (only sha256)",
                clip(text),
                clip(algorithm)
            )));
        };
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ImageError::invalid_reference(format!(
                "digest '{}' is not sha256 followed by 64 hex digits",
                clip(text)
            )));
        }
        Ok(Digest(format!("{}{}", Self::PREFIX, hex.to_ascii_lowercase())))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        let mut hasher = Hasher::new();
        hasher.update(bytes);
        hasher.finish()
    }

    /// The 64 hex digits, the name of the digest's files in the store.
    pub fn hex(&self) -> &str {
        &self.0[Self::PREFIX.len()..]
    }

    /// The first 12 hex digits, as `docker images` shows ids.
    pub fn short(&self) -> &str {
        &self.hex()[..12]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// At most 80 characters of untrusted text in an error message.
pub(crate) fn clip(text: &str) -> String {
    let mut out: String = text.chars().take(80).filter(|c| !c.is_control()).collect();
    if text.chars().count() > 80 {
        out.push('…');
    }
    out
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Digest {
    type Error = ImageError;

    fn try_from(text: String) -> Result<Digest, ImageError> {
        Digest::parse(&text)
    }
}

impl From<Digest> for String {
    fn from(digest: Digest) -> String {
        digest.0
    }
}

impl std::str::FromStr for Digest {
    type Err = ImageError;

    fn from_str(text: &str) -> Result<Digest, ImageError> {
        Digest::parse(text)
    }
}

/// Computes a [`Digest`] incrementally.
#[derive(Clone, Default)]
pub struct Hasher(Sha256);

impl Hasher {
    pub fn new() -> Hasher {
        Hasher(Sha256::new())
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(self) -> Digest {
        let bytes = self.0.finalize();
        let mut hex = String::with_capacity(Digest::PREFIX.len() + 64);
        hex.push_str(Digest::PREFIX);
        for byte in bytes {
            hex.push(char::from_digit(u32::from(byte >> 4), 16).expect("nibble"));
            hex.push(char::from_digit(u32::from(byte & 0xf), 16).expect("nibble"));
        }
        Digest(hex)
    }
}

/// A reader that hashes and counts what passes through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Hasher,
    count: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader { inner, hasher: Hasher::new(), count: 0 }
    }

    /// Reads what is left (so the digest covers the whole stream), then returns the digest
    /// and the number of bytes read in all.
    pub(crate) fn finish(mut self) -> io::Result<(Digest, u64)> {
        io::copy(&mut self, &mut io::sink())?;
        Ok((self.hasher.finish(), self.count))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_print_and_hash() {
        let empty = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(Digest::of(b"").as_str(), empty);
        assert_eq!(Digest::parse(&empty.to_uppercase().replace("SHA256", "sha256")).expect("upper").as_str(), empty);
        let d = Digest::parse(empty).expect("parse");
        assert_eq!(d.hex().len(), 64);
        assert_eq!(d.short(), "e3b0c44298fc");
        assert_eq!(serde_json::to_string(&d).expect("json"), format!("\"{empty}\""));
        assert_eq!(serde_json::from_str::<Digest>(&format!("\"{empty}\"")).expect("json"), d);

        let sha512 = Digest::parse("sha512:abcd").expect_err("sha512");
        assert_eq!(sha512.kind(), crate::ErrorKind::Unsupported);
        assert!(sha512.to_string().contains("only sha256"), "{sha512}");
        for bad in
            ["sha256:abc", "sha256:", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "sha256:zz"]
        {
            assert!(Digest::parse(bad).is_err(), "{bad}");
        }

        let mut reader = HashingReader::new(&b"hello"[..]);
        let mut first = [0u8; 2];
        reader.read_exact(&mut first).expect("read");
        let (digest, count) = reader.finish().expect("finish");
        assert_eq!((digest, count), (Digest::of(b"hello"), 5));
    }
}
