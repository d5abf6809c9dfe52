//! `corral certs init`: a dev CA and the certificates of a small cluster, each carrying its role.

use crate::{Role, TlsError};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType,
};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// What `generate_dev_certs` creates.
#[derive(Debug, Clone, Default)]
pub struct DevCerts {
    /// Coordinators `coordinator-1` .. `coordinator-N`.
    pub coordinators: u32,
    /// Extra host names or IP addresses every coordinator and worker certificate is valid for
    /// (127.0.0.1, ::1 and localhost always are).
    pub hosts: Vec<String>,
    /// Worker node names: `worker-<name>.pem`, valid for the name as a host too.
    pub workers: Vec<String>,
    /// Client names (role client) besides `admin` (role admin): `client-<name>.pem`.
    pub clients: Vec<String>,
}

pub(crate) fn gen_err(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

pub(crate) fn san(host: &str) -> Result<SanType, TlsError> {
    match host.parse::<IpAddr>() {
        Ok(ip) => Ok(SanType::IpAddress(ip)),
        Err(_) => Ok(SanType::DnsName(
            host.try_into().map_err(|_| TlsError::Generate(format!("'{host}' is not a valid host name")))?,
        )),
    }
}

fn write(path: &Path, text: &str, mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
    options
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|source| TlsError::Write { path: path.to_path_buf(), source })
}

/// Issues one leaf certificate for `name` with `role`, valid for `hosts` as a server too.
fn issue(
    dir: &Path,
    file: &str,
    name: &str,
    role: Role,
    hosts: &[String],
    ca: &Issuer<'_, KeyPair>,
    written: &mut Vec<PathBuf>,
) -> Result<(), TlsError> {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.distinguished_name.push(DnType::OrganizationalUnitName, role.as_str());
    params.subject_alt_names.push(SanType::URI(role.uri().try_into().map_err(gen_err)?));
    for host in hosts {
        params.subject_alt_names.push(san(host)?);
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().map_err(gen_err)?;
    let cert = params.signed_by(&key, ca).map_err(gen_err)?;
    let cert_path = dir.join(format!("{file}.pem"));
    let key_path = dir.join(format!("{file}-key.pem"));
    write(&cert_path, &cert.pem(), 0o644)?;
    write(&key_path, &key.serialize_pem(), 0o600)?;
    written.push(cert_path);
    written.push(key_path);
    Ok(())
}

/// Creates `dir/ca.pem` and the certificates `spec` names; refuses to replace an existing CA.
/// Returns the files written.
pub fn generate_dev_certs(dir: &Path, spec: &DevCerts) -> Result<Vec<PathBuf>, TlsError> {
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Write { path: dir.to_path_buf(), source })?;
    let ca_path = dir.join("ca.pem");
    if ca_path.exists() {
        return Err(TlsError::Generate(format!(
            "{} exists: use another --dir, or delete the old CA and every certificate it signed",
            ca_path.display()
        )));
    }
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name.push(DnType::CommonName, "corral dev CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().map_err(gen_err)?;
    let ca_cert = ca_params.self_signed(&ca_key).map_err(gen_err)?;
    let mut written = Vec::new();
    write(&ca_path, &ca_cert.pem(), 0o644)?;
    let ca_key_path = dir.join("ca-key.pem");
    write(&ca_key_path, &ca_key.serialize_pem(), 0o600)?;
    written.push(ca_path);
    written.push(ca_key_path);
    let ca = Issuer::new(ca_params, ca_key);

    let mut server_hosts: Vec<String> = vec!["127.0.0.1".into(), "::1".into(), "localhost".into()];
    server_hosts.extend(spec.hosts.iter().cloned());
    for n in 1..=spec.coordinators {
        let name = format!("coordinator-{n}");
        issue(dir, &name, &name, Role::Coordinator, &server_hosts, &ca, &mut written)?;
    }
    for worker in &spec.workers {
        let mut hosts = server_hosts.clone();
        hosts.push(worker.clone());
        issue(dir, &format!("worker-{worker}"), worker, Role::Worker, &hosts, &ca, &mut written)?;
    }
    issue(dir, "admin", "admin", Role::Admin, &[], &ca, &mut written)?;
    for client in &spec.clients {
        issue(dir, &format!("client-{client}"), client, Role::Client, &[], &ca, &mut written)?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity_of;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::CertificateDer;

    fn identity(path: &Path) -> crate::PeerIdentity {
        let der = CertificateDer::from_pem_file(path).expect("pem");
        identity_of(der.as_ref()).expect("identity")
    }

    #[test]
    fn every_certificate_carries_its_role_and_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = DevCerts {
            coordinators: 2,
            hosts: vec!["10.0.0.5".into(), "coord.example".into()],
            workers: vec!["gpu-1".into()],
            clients: vec!["alice".into()],
        };
        let files = generate_dev_certs(dir.path(), &spec).expect("generate");
        assert_eq!(files.len(), 2 * (1 + 2 + 1 + 1 + 1));
        let c2 = identity(&dir.path().join("coordinator-2.pem"));
        assert_eq!((c2.role, c2.name.as_str()), (Role::Coordinator, "coordinator-2"));
        let w = identity(&dir.path().join("worker-gpu-1.pem"));
        assert_eq!((w.role, w.name.as_str()), (Role::Worker, "gpu-1"));
        assert_eq!(identity(&dir.path().join("admin.pem")).role, Role::Admin);
        assert_eq!(identity(&dir.path().join("client-alice.pem")).role, Role::Client);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("ca-key.pem")).expect("key").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = generate_dev_certs(dir.path(), &spec).expect_err("existing CA");
        assert!(again.to_string().contains("exists"), "{again}");
    }

    #[test]
    fn a_certificate_without_a_role_is_refused() {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        params.distinguished_name.push(DnType::CommonName, "nobody");
        let cert = params.self_signed(&key).expect("cert");
        let err = identity_of(cert.der()).expect_err("no role");
        assert!(err.contains("no corral://role/"), "{err}");
    }
}
