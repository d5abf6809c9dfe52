//! The `[images]` table of a worker's config file (its registry keys also serve a coordinator
//! that resolves tags at submit), parsed once into [`ImagesSettings`]; and `--container-mounts`
//! checked against the table's `mount-allow` list.
//!
//! ```toml
//! [images]
//! store = "/var/lib/corral/images"     # default <data-dir>/images
//! max-size = "200GiB"                  # unpacked layers kept before LRU images go
//! auth-file = "/etc/corral/registry-auth.json"   # a Docker config.json (auths)
//! insecure-registries = ["registry.lab:5000"]    # plain HTTP (loopback always is)
//! max-concurrent-downloads = 3
//! mount-allow = ["/data", "/scratch"]  # host directories --container-mounts may name
//! allow-image-user = false             # run as the image's User instead of the tenant's uid
//! resolve-timeout = "10s"
//! read-timeout = "30s"
//! download-attempts = 5
//! [images.mirrors]
//! "docker.io" = ["mirror.lab:5000"]
//! ```

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use corral_types::{ConfigDuration, ConfigSize};
use serde::{Deserialize, Serialize};

use crate::auth::Credentials;
use crate::manifest::Platform;
use crate::registry::RegistryConfig;

/// Most concurrent blob downloads a node may be configured for.
const MAX_DOWNLOADS: u32 = 64;

/// The `[images]` table as written.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct ImagesSection {
    /// The layer store's directory; `None`: `<data-dir>/images`.
    pub store: Option<PathBuf>,
    /// Unpacked bytes the store keeps before garbage collection removes the least recently
    /// used images that no job placed or running here needs.
    pub max_size: ConfigSize,
    /// Registries (`host[:port]`; `host` for every port) reached over plain HTTP. Loopback
    /// registries always are.
    pub insecure_registries: Vec<String>,
    /// A Docker `config.json` whose `auths` hold registry credentials.
    pub auth_file: Option<PathBuf>,
    /// Host directories a job's `--container-mounts` may bind (below them only).
    pub mount_allow: Vec<PathBuf>,
    /// Per registry, mirrors (`host[:port]`) tried in order before it.
    pub mirrors: BTreeMap<String, Vec<String>>,
    /// Blobs downloaded at once on the node, all pulls together.
    pub max_concurrent_downloads: u32,
    /// Run a job as its image's `User` rather than its tenant's mapped user.
    pub allow_image_user: bool,
    /// The whole of resolving a tag to a digest.
    pub resolve_timeout: ConfigDuration,
    /// A registry response that sends nothing this long is broken off (a blob is resumed).
    pub read_timeout: ConfigDuration,
    /// Tries of a fetch that fails for a transient reason (a blob resumes where it broke).
    pub download_attempts: u32,
}

impl Default for ImagesSection {
    fn default() -> Self {
        ImagesSection {
            store: None,
            max_size: ConfigSize(100 << 30),
            insecure_registries: Vec::new(),
            auth_file: None,
            mount_allow: Vec::new(),
            mirrors: BTreeMap::new(),
            max_concurrent_downloads: 3,
            allow_image_user: false,
            resolve_timeout: ConfigDuration::from_secs(10),
            read_timeout: ConfigDuration::from_secs(30),
            download_attempts: 5,
        }
    }
}

/// The `[images]` table, checked and with its credentials read.
#[derive(Clone, Debug)]
pub struct ImagesSettings {
    pub store: PathBuf,
    pub max_size: u64,
    pub max_concurrent_downloads: usize,
    pub registry: RegistryConfig,
    pub mount_allow: MountAllow,
    pub allow_image_user: bool,
}

impl ImagesSection {
    /// Checks the table; errors name the key (`images.max-concurrent-downloads: …`).
    pub fn validate(&self) -> Result<(), String> {
        if self.max_size.bytes() == 0 {
            return Err("images.max-size: must be more than 0".into());
        }
        if !(1..=MAX_DOWNLOADS).contains(&self.max_concurrent_downloads) {
            return Err(format!("images.max-concurrent-downloads: must be between 1 and {MAX_DOWNLOADS}"));
        }
        if !(1..=20).contains(&self.download_attempts) {
            return Err("images.download-attempts: must be between 1 and 20".into());
        }
        for (key, value) in [("resolve-timeout", self.resolve_timeout), ("read-timeout", self.read_timeout)] {
            if value.get().is_zero() {
                return Err(format!("images.{key}: must be more than 0"));
            }
        }
        if let Some(store) = &self.store {
            check_absolute("images.store", store)?;
        }
        for dir in &self.mount_allow {
            check_absolute("images.mount-allow", dir)?;
        }
        for host in &self.insecure_registries {
            check_host("images.insecure-registries", host)?;
        }
        for (registry, mirrors) in &self.mirrors {
            check_host("images.mirrors", registry)?;
            for mirror in mirrors {
                check_host(&format!("images.mirrors.\"{registry}\""), mirror)?;
            }
        }
        Ok(())
    }

    /// How to reach registries (reads `auth-file`): what a coordinator needs to resolve tags.
    pub fn registry_config(&self) -> Result<RegistryConfig, String> {
        self.validate()?;
        let credentials = match &self.auth_file {
            Some(path) => Credentials::load(path).map_err(|e| format!("images.auth-file: {e}"))?,
            None => Credentials::none(),
        };
        Ok(RegistryConfig {
            credentials,
            insecure_registries: self.insecure_registries.clone(),
            mirrors: self.mirrors.clone(),
            platform: Platform::host(),
            connect_timeout: self.resolve_timeout.get(),
            read_timeout: self.read_timeout.get(),
            resolve_timeout: self.resolve_timeout.get(),
            attempts: self.download_attempts,
        })
    }

    /// A worker's settings, the store under `data_dir` unless `store` says otherwise.
    pub fn settings(&self, data_dir: &Path) -> Result<ImagesSettings, String> {
        Ok(ImagesSettings {
            registry: self.registry_config()?,
            store: self.store.clone().unwrap_or_else(|| data_dir.join("images")),
            max_size: self.max_size.bytes(),
            max_concurrent_downloads: self.max_concurrent_downloads as usize,
            mount_allow: MountAllow::new(self.mount_allow.clone()),
            allow_image_user: self.allow_image_user,
        })
    }
}

fn check_absolute(key: &str, path: &Path) -> Result<(), String> {
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err(format!("{key}: '{}' must be an absolute path without '..'", path.display()));
    }
    Ok(())
}

fn check_host(key: &str, host: &str) -> Result<(), String> {
    if host.is_empty() || host.contains("://") || host.contains('/') || host.chars().any(char::is_whitespace) {
        return Err(format!("{key}: '{host}' must be host[:port], without a scheme or path"));
    }
    Ok(())
}

/// A bind mount a job asks for: `SOURCE[:TARGET[:ro|rw]]`, as `--container-mounts` (and
/// Pyxis) write them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerMount {
    pub source: PathBuf,
    pub target: PathBuf,
    pub read_only: bool,
}

impl ContainerMount {
    /// Parses a comma-separated list.
    pub fn parse_list(text: &str) -> Result<Vec<ContainerMount>, String> {
        text.split(',').filter(|s| !s.trim().is_empty()).map(|s| ContainerMount::parse(s.trim())).collect()
    }

    pub fn parse(text: &str) -> Result<ContainerMount, String> {
        let mut parts = text.split(':');
        let source = PathBuf::from(parts.next().unwrap_or_default());
        let target = parts.next().map_or_else(|| source.clone(), PathBuf::from);
        let read_only = match parts.next() {
            None | Some("rw") => false,
            Some("ro") => true,
            Some(other) => return Err(format!("container mount '{text}': unknown option '{other}' (ro or rw)")),
        };
        if parts.next().is_some() {
            return Err(format!("container mount '{text}': write SOURCE[:TARGET[:ro|rw]]"));
        }
        for (what, path) in [("source", &source), ("target", &target)] {
            if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
                return Err(format!("container mount '{text}': the {what} must be an absolute path without '..'"));
            }
        }
        if target == Path::new("/") {
            return Err(format!("container mount '{text}': cannot mount over the image's root"));
        }
        Ok(ContainerMount { source, target, read_only })
    }
}

/// The host directories `--container-mounts` may bind, from `mount-allow`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MountAllow {
    dirs: Vec<PathBuf>,
}

impl MountAllow {
    pub fn new(dirs: Vec<PathBuf>) -> MountAllow {
        MountAllow { dirs }
    }

    /// The mount with its source resolved (symlinks followed on the host), if that lies in
    /// (or is) an allowed directory; the error says why not. See [`MountAllow::check_with`].
    pub fn check(&self, mount: &ContainerMount) -> Result<ContainerMount, String> {
        self.check_with(mount, |p| p.canonicalize())
    }

    /// [`MountAllow::check`] with the source resolved by `canonicalize` (the worker passes one
    /// that runs as the job's user). A source not below an allowed directory as written is
    /// refused before anything on the host is looked at, so the answer is the same whether it
    /// exists or not; only a source inside the list is resolved, and refused with the same line
    /// if a symlink leads it out.
    pub fn check_with(
        &self,
        mount: &ContainerMount,
        canonicalize: impl FnOnce(&Path) -> std::io::Result<PathBuf>,
    ) -> Result<ContainerMount, String> {
        let refused = || {
            format!(
                "container mount source {} is not below a directory this node allows (images.mount-allow)",
                mount.source.display()
            )
        };
        // The allowed directories are the operator's: resolving them reveals nothing.
        let allowed: Vec<PathBuf> =
            self.dirs.iter().flat_map(|d| [d.clone()].into_iter().chain(d.canonicalize().ok())).collect();
        if !allowed.iter().any(|dir| mount.source.starts_with(dir)) {
            return Err(refused());
        }
        let source = canonicalize(&mount.source).map_err(|e| {
            let reason = match e.kind() {
                std::io::ErrorKind::NotFound => "does not exist".to_string(),
                std::io::ErrorKind::PermissionDenied => "is not accessible to the job's user".to_string(),
                _ => e.to_string(),
            };
            format!("container mount source {}: {reason}", mount.source.display())
        })?;
        let inside = self.dirs.iter().filter_map(|d| d.canonicalize().ok()).any(|dir| source.starts_with(dir));
        if !inside {
            return Err(refused());
        }
        Ok(ContainerMount { source, ..mount.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_parses_with_defaults_and_names_bad_keys() {
        let section: ImagesSection = toml::from_str(
            r#"
            store = "/var/lib/corral/images"
            max-size = "20GiB"
            insecure-registries = ["registry.lab:5000"]
            mount-allow = ["/data"]
            max-concurrent-downloads = 4
            [mirrors]
            "docker.io" = ["mirror.lab:5000"]
            "#,
        )
        .expect("parse");
        section.validate().expect("valid");
        assert_eq!(section.max_size, ConfigSize(20 << 30));
        assert_eq!(section.read_timeout, ConfigDuration::from_secs(30));
        let settings = section.settings(Path::new("/data-dir")).expect("settings");
        assert_eq!(settings.store, Path::new("/var/lib/corral/images"));
        assert_eq!(settings.registry.mirrors["docker.io"], ["mirror.lab:5000"]);
        let defaults = ImagesSection::default().settings(Path::new("/data-dir")).expect("defaults");
        assert_eq!((defaults.store, defaults.max_concurrent_downloads), (PathBuf::from("/data-dir/images"), 3));

        assert!(toml::from_str::<ImagesSection>("max-sise = \"1G\"").is_err(), "unknown keys are refused");
        for (text, needle) in [
            ("max-concurrent-downloads = 0", "images.max-concurrent-downloads"),
            ("insecure-registries = [\"http://x:5000\"]", "images.insecure-registries: 'http://x:5000'"),
            ("mount-allow = [\"data\"]", "images.mount-allow: 'data' must be an absolute path"),
            ("[mirrors]\n\"docker.io\" = [\"https://m\"]", "images.mirrors.\"docker.io\""),
            ("max-size = 0", "images.max-size"),
            ("read-timeout = \"0s\"", "images.read-timeout"),
        ] {
            let section: ImagesSection = toml::from_str(text).expect(text);
            let e = section.validate().expect_err(text);
            assert!(e.contains(needle), "{text}: {e}");
        }
        let missing = ImagesSection { auth_file: Some("/nonexistent/auth.json".into()), ..ImagesSection::default() };
        assert!(missing
            .registry_config()
            .expect_err("missing")
            .starts_with("images.auth-file: /nonexistent/auth.json"));
    }

    #[test]
    fn container_mounts_are_parsed_and_checked_against_the_allow_list() {
        let mounts = ContainerMount::parse_list("/data/set:/data:ro, /scratch").expect("parse");
        assert_eq!(
            mounts,
            [
                ContainerMount { source: "/data/set".into(), target: "/data".into(), read_only: true },
                ContainerMount { source: "/scratch".into(), target: "/scratch".into(), read_only: false },
            ]
        );
        for (bad, needle) in [
            ("data:/x", "source must be an absolute path"),
            ("/a:/b:rx", "unknown option 'rx'"),
            ("/a:/b/../c", "target must be an absolute path"),
            ("/a:/", "over the image's root"),
            ("/a:/b:ro:x", "SOURCE[:TARGET[:ro|rw]]"),
        ] {
            assert!(ContainerMount::parse(bad).expect_err(bad).contains(needle), "{bad}");
        }

        let host = tempfile::tempdir().expect("tempdir");
        let allowed = host.path().join("allowed");
        std::fs::create_dir_all(allowed.join("sub")).expect("dirs");
        std::fs::create_dir_all(host.path().join("secret")).expect("dirs");
        std::os::unix::fs::symlink(host.path().join("secret"), allowed.join("escape")).expect("symlink");
        let allow = MountAllow::new(vec![allowed.clone()]);
        let ok = allow
            .check(&ContainerMount::parse(&format!("{}:/in", allowed.join("sub").display())).expect("m"))
            .expect("ok");
        assert_eq!(ok.source, allowed.join("sub").canonicalize().expect("canonical"));
        let escape = ContainerMount::parse(&format!("{}:/in", allowed.join("escape").display())).expect("m");
        assert!(allow.check(&escape).expect_err("symlink out").contains("not below a directory this node allows"));
        // Outside the list, an existing and a missing path get the same answer.
        let outside_existing =
            ContainerMount::parse(&format!("{}:/in", host.path().join("secret").display())).expect("m");
        let outside_missing =
            ContainerMount::parse(&format!("{}:/in", host.path().join("nothing").display())).expect("m");
        let answer = |m: &ContainerMount| {
            allow.check(m).expect_err("outside").replace(&m.source.display().to_string(), "SOURCE")
        };
        assert_eq!(answer(&outside_existing), answer(&outside_missing));
        assert_eq!(
            answer(&outside_missing),
            "container mount source SOURCE is not below a directory this node allows (images.mount-allow)"
        );
        let missing = ContainerMount::parse("/nonexistent/x:/in").expect("m");
        assert!(allow.check(&missing).expect_err("missing").contains("is not below a directory"));
        // Inside the list, the source is resolved by the caller's function only.
        let inside_missing = ContainerMount::parse(&format!("{}:/in", allowed.join("gone").display())).expect("m");
        assert!(allow.check(&inside_missing).expect_err("gone").ends_with("gone: does not exist"));
        let mut asked = Vec::new();
        let denied = allow.check_with(&inside_missing, |p| {
            asked.push(p.to_path_buf());
            Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
        });
        assert!(denied.expect_err("denied").ends_with("gone: is not accessible to the job's user"));
        assert_eq!(asked, [allowed.join("gone")]);
        let never = allow.check_with(&outside_existing, |_| panic!("a source outside the list is never resolved"));
        assert!(never.is_err());
        assert!(MountAllow::default()
            .check(&ContainerMount::parse(&allowed.display().to_string()).expect("m"))
            .is_err());
    }
}
