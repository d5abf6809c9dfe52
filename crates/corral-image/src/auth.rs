//! Registry credentials from a Docker `config.json` (`auths`), the file `docker login` writes:
//! per registry a base64 `auth` (`user:password`), or `username` and `password`, or a
//! `registrytoken` (a bearer token sent as is). Keys are normalised as Docker does, so
//! `https://index.docker.io/v1/` is Docker Hub and `http://host:5000/v2/` is `host:5000`.
//! Credential helpers (`credsStore`, `credHelpers`) run programs and are not followed.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use base64::Engine as _;
use oci_client::secrets::RegistryAuth;
use serde::Deserialize;
use tracing::warn;

use crate::reference::DOCKER_HUB;

/// Largest credentials file read.
const MAX_AUTH_FILE: u64 = 1 << 20;

/// One registry's credentials.
#[derive(Clone, PartialEq, Eq)]
pub enum Credential {
    Basic { username: String, password: String },
    Bearer(String),
}

impl std::fmt::Debug for Credential {
    /// Never prints a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Basic { username, .. } => write!(f, "Basic({username}, ***)"),
            Credential::Bearer(_) => f.write_str("Bearer(***)"),
        }
    }
}

/// Credentials per registry host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Credentials {
    by_registry: BTreeMap<String, Credential>,
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
    #[serde(default, rename = "credsStore")]
    creds_store: Option<String>,
    #[serde(default, rename = "credHelpers")]
    cred_helpers: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct DockerAuth {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    registrytoken: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

impl Credentials {
    /// No credentials: every pull is anonymous.
    pub fn none() -> Credentials {
        Credentials::default()
    }

    /// Reads a Docker `config.json`.
    pub fn load(path: &Path) -> Result<Credentials, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut text = String::new();
        file.take(MAX_AUTH_FILE + 1).read_to_string(&mut text).map_err(|e| format!("{}: {e}", path.display()))?;
        if text.len() as u64 > MAX_AUTH_FILE {
            return Err(format!("{}: larger than {MAX_AUTH_FILE} bytes", path.display()));
        }
        Credentials::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses the text of a Docker `config.json`.
    pub fn parse(text: &str) -> Result<Credentials, String> {
        let config: DockerConfig = serde_json::from_str(text).map_err(|e| format!("not a Docker config.json: {e}"))?;
        if let Some(store) = &config.creds_store {
            warn!(store, "the credentials file names a credential helper; corral reads only its `auths`");
        }
        if !config.cred_helpers.is_empty() {
            warn!("the credentials file names credential helpers; corral reads only its `auths`");
        }
        let mut by_registry = BTreeMap::new();
        for (key, entry) in config.auths {
            let registry = normalise_registry_key(&key);
            let credential = if let Some(token) = entry.registrytoken.filter(|t| !t.is_empty()) {
                Credential::Bearer(token)
            } else if let Some(auth) = entry.auth.filter(|a| !a.is_empty()) {
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(auth.trim())
                    .map_err(|e| format!("auths.{key}.auth: not base64: {e}"))?;
                let decoded = String::from_utf8(decoded).map_err(|_| format!("auths.{key}.auth: not UTF-8"))?;
                let (username, password) =
                    decoded.split_once(':').ok_or_else(|| format!("auths.{key}.auth: not base64 of user:password"))?;
                Credential::Basic { username: username.to_string(), password: password.to_string() }
            } else if let (Some(username), Some(password)) = (entry.username, entry.password) {
                Credential::Basic { username, password }
            } else {
                if entry.identitytoken.is_some() {
                    warn!(
                        registry,
                        "an identity token (OAuth refresh token) is not supported; use a password or access token"
                    );
                }
                continue;
            };
            by_registry.insert(registry, credential);
        }
        Ok(Credentials { by_registry })
    }

    /// Credentials for a registry host, if any.
    pub fn get(&self, registry: &str) -> Option<&Credential> {
        self.by_registry.get(&normalise_registry_key(registry))
    }

    /// The registries with credentials.
    pub fn registries(&self) -> impl Iterator<Item = &str> {
        self.by_registry.keys().map(String::as_str)
    }

    /// What the distribution client sends to `registry`.
    pub(crate) fn auth_for(&self, registry: &str) -> RegistryAuth {
        match self.get(registry) {
            Some(Credential::Basic { username, password }) => RegistryAuth::Basic(username.clone(), password.clone()),
            Some(Credential::Bearer(token)) => RegistryAuth::Bearer(token.clone()),
            None => RegistryAuth::Anonymous,
        }
    }
}

/// `https://index.docker.io/v1/` → `docker.io`; `http://host:5000/v2/` → `host:5000`.
fn normalise_registry_key(key: &str) -> String {
    let key = key.trim();
    let without_scheme = key.strip_prefix("https://").or_else(|| key.strip_prefix("http://")).unwrap_or(key);
    let host = without_scheme.split('/').next().unwrap_or(without_scheme).to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => DOCKER_HUB.to_string(),
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As `docker login` writes it, plus the forms other tools write.
    #[test]
    fn docker_config_auths_are_read() {
        let text = r#"{
            "auths": {
                "https://index.docker.io/v1/": {"auth": "aHViOnNlY3JldDpwYXJ0"},
                "localhost:5000": {"username": "alice", "password": "pw"},
                "http://LOCAL.example:5001/v2/": {"auth": "Ym9iOmI="},
                "ghcr.io": {"registrytoken": "tok"},
                "quay.io": {"identitytoken": "refresh"},
                "empty.io": {}
            },
            "credsStore": "desktop"
        }"#;
        let creds = Credentials::parse(text).expect("parse");
        assert_eq!(
            creds.get("docker.io"),
            Some(&Credential::Basic { username: "hub".into(), password: "secret:part".into() })
        );
        assert_eq!(creds.get("index.docker.io"), creds.get("docker.io"));
        assert_eq!(
            creds.get("localhost:5000"),
            Some(&Credential::Basic { username: "alice".into(), password: "pw".into() })
        );
        assert_eq!(
            creds.get("local.example:5001"),
            Some(&Credential::Basic { username: "bob".into(), password: "b".into() })
        );
        assert_eq!(creds.get("ghcr.io"), Some(&Credential::Bearer("tok".into())));
        assert_eq!(creds.get("quay.io"), None);
        assert_eq!(creds.get("empty.io"), None);
        assert!(matches!(creds.auth_for("nowhere.io"), RegistryAuth::Anonymous));
        assert!(!format!("{:?}", creds).contains("secret"), "secrets are not printed");

        let bad = Credentials::parse(r#"{"auths": {"x.io": {"auth": "!!"}}}"#).expect_err("bad base64");
        assert!(bad.contains("auths.x.io.auth: not base64"), "{bad}");
        let bad = Credentials::parse(r#"{"auths": {"x.io": {"auth": "bm9jb2xvbg=="}}}"#).expect_err("no colon");
        assert!(bad.contains("user:password"), "{bad}");
        assert!(Credentials::parse("\"auths\"").expect_err("not an object").contains("not a Docker config.json"));
        assert_eq!(Credentials::parse("{}").expect("empty"), Credentials::none());
    }
}
