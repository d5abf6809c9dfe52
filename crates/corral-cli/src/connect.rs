//! The client of every user and admin command, from the global flags: endpoints, token and TLS.

use crate::args::GlobalArgs;
use anyhow::bail;
use corral_client::{Client, ClientConfig};

/// A client for `global`'s endpoints; mutual TLS when `--ca`, `--cert` and `--key` are all given.
pub fn client(global: &GlobalArgs) -> anyhow::Result<Client> {
    let endpoints: Vec<String> =
        global.endpoint.iter().map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect();
    let mut config = ClientConfig::new(endpoints);
    config.token = global.token.clone();
    config.tls = match (&global.ca, &global.cert, &global.key) {
        (None, None, None) => None,
        (Some(ca), Some(cert), Some(key)) => {
            let files = corral_security::TlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() };
            Some(corral_security::ClientTls::load(&files)?)
        }
        _ => bail!("TLS needs all of --ca, --cert and --key (or CORRAL_CA, CORRAL_CERT and CORRAL_KEY)"),
    };
    Ok(Client::new(config)?)
}
