//! What a job asks of its container besides the image, with pyxis's names: bind mounts
//! (`--container-mounts SRC[:DST[:ro|rw]][,...]`), the working directory
//! (`--container-workdir`) and the variables of the submitting shell that override the
//! image's (`--container-env VAR[,VAR]`). Checked here for shape only; each worker checks the
//! mounts against its own allow-list at launch.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Most bind mounts one job may ask for.
pub const MAX_CONTAINER_MOUNTS: usize = 64;
/// Most variables `--container-env` may name.
pub const MAX_CONTAINER_ENV: usize = 256;
/// Longest path a mount or working directory may name.
const MAX_CONTAINER_PATH: usize = 4096;

/// A bind mount of a host path into the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerMount {
    /// Absolute path on the worker.
    pub source: String,
    /// Absolute path in the container.
    pub target: String,
    pub read_only: bool,
}

impl ContainerMount {
    /// Parses one mount, `SRC[:DST[:ro|rw]]` (no `DST`: the same path in the container).
    pub fn parse(text: &str) -> Result<ContainerMount, String> {
        let mut parts = text.split(':');
        let source = parts.next().unwrap_or_default().to_string();
        let target = parts.next().map_or_else(|| source.clone(), str::to_string);
        let read_only = match parts.next() {
            None | Some("rw") => false,
            Some("ro") => true,
            Some(other) => return Err(format!("container mount '{text}': unknown option '{other}' (ro or rw)")),
        };
        if parts.next().is_some() {
            return Err(format!("container mount '{text}': write SRC[:DST[:ro|rw]]"));
        }
        let mount = ContainerMount { source, target, read_only };
        mount.validate()?;
        Ok(mount)
    }

    /// Parses a comma-separated list (empty entries skipped).
    pub fn parse_list(text: &str) -> Result<Vec<ContainerMount>, String> {
        text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(ContainerMount::parse).collect()
    }

    /// Both paths absolute, without `..`, and the target not the root.
    pub fn validate(&self) -> Result<(), String> {
        for (what, path) in [("source", &self.source), ("target", &self.target)] {
            check_path(&format!("container mount '{self}': the {what}"), path)?;
        }
        if self.target.trim_end_matches('/').is_empty() {
            return Err(format!("container mount '{self}': cannot mount over the image's root"));
        }
        Ok(())
    }
}

impl fmt::Display for ContainerMount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.source, self.target)?;
        if self.read_only {
            f.write_str(":ro")?;
        }
        Ok(())
    }
}

fn check_path(what: &str, path: &str) -> Result<(), String> {
    if !path.starts_with('/') || path.split('/').any(|c| c == "..") || path.contains('\0') {
        return Err(format!("{what} must be an absolute path without '..'"));
    }
    if path.len() > MAX_CONTAINER_PATH {
        return Err(format!("{what} is longer than {MAX_CONTAINER_PATH} bytes"));
    }
    Ok(())
}

/// The container options of a job (all empty: the image's own).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerOptions {
    /// `--container-mounts`, in order.
    #[serde(default)]
    pub mounts: Vec<ContainerMount>,
    /// `--container-workdir`: the process's directory in the container, over the image's.
    #[serde(default)]
    pub workdir: Option<String>,
    /// `--container-env`: variables the submit took from its shell, set over the image's.
    #[serde(default)]
    pub env: Vec<String>,
}

impl ContainerOptions {
    pub fn is_default(&self) -> bool {
        self.mounts.is_empty() && self.workdir.is_none() && self.env.is_empty()
    }

    /// Shape and bounds; the error is `(flag, reason)`.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.mounts.len() > MAX_CONTAINER_MOUNTS {
            return Err(("container-mounts", format!("{} mounts, at most {MAX_CONTAINER_MOUNTS}", self.mounts.len())));
        }
        for mount in &self.mounts {
            mount.validate().map_err(|e| ("container-mounts", e))?;
        }
        if let Some(dir) = &self.workdir {
            check_path(&format!("'{dir}'"), dir).map_err(|e| ("container-workdir", e))?;
        }
        if self.env.len() > MAX_CONTAINER_ENV {
            return Err(("container-env", format!("{} variables, at most {MAX_CONTAINER_ENV}", self.env.len())));
        }
        for name in &self.env {
            if name.is_empty() || name.len() > 256 || name.contains(['=', '\0', ',']) {
                return Err(("container-env", format!("bad variable name '{name}'")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_parse_as_pyxis_writes_them() {
        let mounts = ContainerMount::parse_list("/data/set:/data:ro, /scratch,/a:/b:rw").expect("parse");
        assert_eq!(
            mounts,
            [
                ContainerMount { source: "/data/set".into(), target: "/data".into(), read_only: true },
                ContainerMount { source: "/scratch".into(), target: "/scratch".into(), read_only: false },
                ContainerMount { source: "/a".into(), target: "/b".into(), read_only: false },
            ]
        );
        assert_eq!(mounts[0].to_string(), "/data/set:/data:ro");
        for (bad, needle) in [
            ("data:/x", "the source must be an absolute path"),
            ("/x:y", "the target must be an absolute path"),
            ("/x/../etc:/x", "without '..'"),
            ("/x:/", "over the image's root"),
            ("/x:/y:rx", "unknown option 'rx'"),
            ("/x:/y:ro:z", "write SRC[:DST[:ro|rw]]"),
        ] {
            let e = ContainerMount::parse_list(bad).expect_err(bad);
            assert!(e.contains(needle) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn options_are_bounded() {
        let mut o = ContainerOptions::default();
        assert!(o.is_default() && o.validate().is_ok());
        o.workdir = Some("rel".into());
        assert_eq!(o.validate().unwrap_err().0, "container-workdir");
        o.workdir = Some("/w".into());
        o.env = vec!["A=B".into()];
        assert_eq!(o.validate().unwrap_err().0, "container-env");
        o.env = vec!["HF_TOKEN".into()];
        assert!(o.validate().is_ok());
        o.mounts = vec![ContainerMount { source: "/d".into(), target: "/d".into(), read_only: false }; 65];
        assert_eq!(o.validate().unwrap_err().0, "container-mounts");
    }
}
