//! `corral certs init`: a dev CA and the certificates of a small cluster, each carrying its
//! role; `corral certs renew`: the same certificates issued again by the same CA; the warning a
//! daemon logs when its certificate expires soon.
//!
//! Every certificate is valid for a finite time: the leaf certificates `days` days (365 by
//! default), the CA ten years ([`CA_DAYS`]); no certificate outlives its CA. Each one's
//! notBefore lies [`crate::CERT_BACKDATE`] before its issue, for clocks that lag.

use crate::{identity_of, Role, TlsError};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    PublicKeyData, SanType,
};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How long the certificates of `corral certs init` and `corral certs renew` are valid by
/// default, in days.
pub const DEFAULT_CERT_DAYS: u32 = 365;
/// The longest validity `--days` may ask for (ten years), and the validity of the CA.
pub const MAX_CERT_DAYS: u32 = 3650;
/// How long the CA of `corral certs init` is valid, in days.
pub const CA_DAYS: u32 = MAX_CERT_DAYS;

const DAY: u64 = 24 * 3600;

/// What `generate_dev_certs` creates.
#[derive(Debug, Clone)]
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
    /// How long the certificates (not the CA) are valid, in days (1 to [`MAX_CERT_DAYS`]).
    pub days: u32,
}

impl Default for DevCerts {
    fn default() -> Self {
        DevCerts {
            coordinators: 0,
            hosts: Vec::new(),
            workers: Vec::new(),
            clients: Vec::new(),
            days: DEFAULT_CERT_DAYS,
        }
    }
}

/// Checks a number of days a certificate is to be valid for; the error names `--days`.
pub(crate) fn check_days(days: u32) -> Result<(), TlsError> {
    if days == 0 || days > MAX_CERT_DAYS {
        return Err(TlsError::Generate(format!("--days must be between 1 and {MAX_CERT_DAYS}, not {days}")));
    }
    Ok(())
}

/// Seconds since the Unix epoch, now.
pub(crate) fn now_s() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Sets a certificate issued at `issued_at_s` to be valid from [`crate::CERT_BACKDATE`] before
/// that until `not_after_s` (seconds since the Unix epoch).
pub(crate) fn set_validity(params: &mut CertificateParams, issued_at_s: u64, not_after_s: u64) {
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    params.not_before = epoch + Duration::from_secs(issued_at_s.saturating_sub(crate::CERT_BACKDATE.as_secs()));
    params.not_after = epoch + Duration::from_secs(not_after_s);
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

/// Replaces `path` with `text` through a synced temporary file renamed over it: a reader (or
/// a crash) sees the old file or the new one, never a part.
fn replace(path: &Path, text: &str, mode: u32) -> Result<(), TlsError> {
    let tmp = path.with_extension("pem.tmp");
    write(&tmp, text, mode)?;
    let synced = std::fs::File::open(&tmp).and_then(|f| f.sync_all());
    synced
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|source| TlsError::Write { path: path.to_path_buf(), source })
}

/// The parameters of a leaf certificate for `name` with `role`, valid for `hosts` as a server
/// too, issued now and valid until `not_after_s`.
fn leaf_params(name: &str, role: Role, hosts: &[SanType], not_after_s: u64) -> Result<CertificateParams, TlsError> {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.distinguished_name.push(DnType::OrganizationalUnitName, role.as_str());
    params.subject_alt_names.push(SanType::URI(role.uri().try_into().map_err(gen_err)?));
    params.subject_alt_names.extend(hosts.iter().cloned());
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    set_validity(&mut params, now_s(), not_after_s);
    Ok(params)
}

/// The CA that issues certificates, with its notAfter (seconds since the epoch), and how many
/// days the certificates it issues are valid.
struct DevCa {
    issuer: Issuer<'static, KeyPair>,
    not_after_s: u64,
    days: u32,
}

impl DevCa {
    /// When a certificate issued now expires: `days` from now, never after the CA.
    fn not_after(&self) -> u64 {
        now_s().saturating_add(u64::from(self.days) * DAY).min(self.not_after_s)
    }
}

/// Issues one leaf certificate for `name` with `role`, valid for `hosts` as a server too.
fn issue(
    dir: &Path,
    file: &str,
    name: &str,
    role: Role,
    hosts: &[String],
    ca: &DevCa,
    written: &mut Vec<PathBuf>,
) -> Result<(), TlsError> {
    let hosts = hosts.iter().map(|h| san(h)).collect::<Result<Vec<_>, _>>()?;
    let params = leaf_params(name, role, &hosts, ca.not_after())?;
    let key = KeyPair::generate().map_err(gen_err)?;
    let cert = params.signed_by(&key, &ca.issuer).map_err(gen_err)?;
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
    check_days(spec.days)?;
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
    let issued_at_s = now_s();
    let ca_not_after_s = issued_at_s + u64::from(CA_DAYS) * DAY;
    set_validity(&mut ca_params, issued_at_s, ca_not_after_s);
    let ca_key = KeyPair::generate().map_err(gen_err)?;
    let ca_cert = ca_params.self_signed(&ca_key).map_err(gen_err)?;
    let mut written = Vec::new();
    write(&ca_path, &ca_cert.pem(), 0o644)?;
    let ca_key_path = dir.join("ca-key.pem");
    write(&ca_key_path, &ca_key.serialize_pem(), 0o600)?;
    written.push(ca_path);
    written.push(ca_key_path);
    let ca = DevCa { issuer: Issuer::new(ca_params, ca_key), not_after_s: ca_not_after_s, days: spec.days };

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

/// Issues again, with the CA of `dir` (`ca.pem`, `ca-key.pem`), every certificate in `dir`
/// that this CA signed and whose key lies beside it (`NAME.pem` and `NAME-key.pem`): the same
/// name, role, host names and key, valid from now for `days` days (never past the CA's
/// expiry). Each certificate file is replaced atomically; keys and the CA are untouched.
/// Returns the certificate files written.
pub fn renew_dev_certs(dir: &Path, days: u32) -> Result<Vec<PathBuf>, TlsError> {
    check_days(days)?;
    let ca_path = dir.join("ca.pem");
    let ca_der = crate::server::load_certs(&ca_path)?.remove(0);
    let ca_key_path = dir.join("ca-key.pem");
    let ca = crate::ClusterCa::load(&ca_path, &ca_key_path)?;
    let (_, ca_cert) = x509_parser::parse_x509_certificate(ca_der.as_ref())
        .map_err(|e| TlsError::Pem { path: ca_path.clone(), what: format!("unreadable certificate: {e}") })?;
    let ca_not_after_s = u64::try_from(ca_cert.validity().not_after.timestamp()).unwrap_or(0);
    if ca_not_after_s <= now_s() {
        return Err(TlsError::Generate(format!(
            "the CA {} expired: create a new one with `corral certs init` in another --dir",
            ca_path.display()
        )));
    }
    let ca = DevCa { issuer: ca.into_issuer(), not_after_s: ca_not_after_s, days };
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| TlsError::Read { path: dir.to_path_buf(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.ends_with(".pem") && !name.ends_with("-key.pem") && name != "ca.pem"
        })
        .collect();
    entries.sort();
    let mut written = Vec::new();
    for cert_path in entries {
        let der = crate::server::load_certs(&cert_path)?.remove(0);
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else { continue };
        if cert.issuer() != ca_cert.subject() || cert.verify_signature(Some(ca_cert.public_key())).is_err() {
            continue;
        }
        let identity = identity_of(der.as_ref()).map_err(|what| TlsError::Pem { path: cert_path.clone(), what })?;
        let stem = cert_path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let key_path = dir.join(format!("{stem}-key.pem"));
        let key_pem = String::from_utf8(crate::read(&key_path)?)
            .map_err(|_| TlsError::Pem { path: key_path.clone(), what: "not a PEM text file".into() })?;
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| TlsError::Pem { path: key_path.clone(), what: format!("no usable PEM private key: {e}") })?;
        if cert.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(TlsError::Pem { path: key_path, what: format!("not the key of {}", cert_path.display()) });
        }
        let hosts = host_names(&cert).map_err(|what| TlsError::Pem { path: cert_path.clone(), what })?;
        let params = leaf_params(&identity.name, identity.role, &hosts, ca.not_after())?;
        let renewed = params.signed_by(&key, &ca.issuer).map_err(gen_err)?;
        replace(&cert_path, &renewed.pem(), 0o644)?;
        written.push(cert_path);
    }
    Ok(written)
}

/// The DNS names and IP addresses a certificate is valid for as a server, in its order.
fn host_names(cert: &x509_parser::certificate::X509Certificate<'_>) -> Result<Vec<SanType>, String> {
    use x509_parser::extensions::GeneralName;
    let san = cert.subject_alternative_name().map_err(|e| format!("bad subject alternative names: {e}"))?;
    let mut hosts = Vec::new();
    for name in san.into_iter().flat_map(|s| s.value.general_names.iter()) {
        match name {
            GeneralName::DNSName(dns) => hosts.push(san_of(dns)?),
            GeneralName::IPAddress(bytes) => {
                let ip = match bytes.len() {
                    4 => IpAddr::from(<[u8; 4]>::try_from(*bytes).map_err(|_| "bad IP address")?),
                    16 => IpAddr::from(<[u8; 16]>::try_from(*bytes).map_err(|_| "bad IP address")?),
                    _ => return Err("an IP address of neither 4 nor 16 bytes".into()),
                };
                hosts.push(SanType::IpAddress(ip));
            }
            _ => {}
        }
    }
    Ok(hosts)
}

fn san_of(host: &str) -> Result<SanType, String> {
    san(host).map_err(|e| e.to_string())
}

/// A warning to log when the certificate in `cert` expires within `within` (or has expired):
/// what, when, and how to renew it. `None` when it is valid longer, or unreadable (loading it
/// reports that).
pub fn expiry_warning(cert: &Path, within: Duration) -> Option<String> {
    let der = crate::server::load_certs(cert).ok()?.into_iter().next()?;
    let identity = identity_of(der.as_ref()).ok()?;
    let now = now_s();
    if identity.not_after_s > now.saturating_add(within.as_secs()) {
        return None;
    }
    let (_, parsed) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let when = parsed.validity().not_after.to_string();
    let what = format!("{} certificate {} ({})", identity.role, cert.display(), identity.name);
    let renew = "renew it with `corral certs renew` (a worker that joined with a token renews its own)";
    Some(if identity.not_after_s <= now {
        format!("the {what} expired on {when}: {renew}")
    } else {
        let days = (identity.not_after_s - now) / DAY;
        format!("the {what} expires on {when}, in {days} day(s): {renew}")
    })
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
            ..Default::default()
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

    fn validity(path: &Path) -> (u64, u64) {
        let identity = identity(path);
        (identity.not_before_s, identity.not_after_s)
    }

    #[test]
    fn certificates_live_the_days_asked_and_the_ca_ten_years() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = DevCerts { coordinators: 1, days: 30, ..Default::default() };
        generate_dev_certs(dir.path(), &spec).expect("generate");
        let now = now_s();
        let backdate = crate::CERT_BACKDATE.as_secs();
        let (from, until) = validity(&dir.path().join("coordinator-1.pem"));
        assert!(from + backdate <= now && now <= from + backdate + 60, "notBefore {from}, now {now}");
        assert!(until.abs_diff(now + 30 * DAY) <= 60, "notAfter {until}, now {now}");
        let der = CertificateDer::from_pem_file(dir.path().join("ca.pem")).expect("ca");
        let (_, ca) = x509_parser::parse_x509_certificate(der.as_ref()).expect("ca");
        let ca_until = u64::try_from(ca.validity().not_after.timestamp()).expect("after 1970");
        assert!(ca_until.abs_diff(now + u64::from(CA_DAYS) * DAY) <= 60, "CA notAfter {ca_until}");
        for days in [0, MAX_CERT_DAYS + 1] {
            let other = tempfile::tempdir().expect("tempdir");
            let err = generate_dev_certs(other.path(), &DevCerts { days, ..Default::default() }).expect_err("days");
            assert!(err.to_string().contains("--days must be between 1 and 3650"), "{err}");
        }
    }

    #[test]
    fn renewal_issues_the_same_names_and_keys_again_for_longer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = DevCerts {
            coordinators: 1,
            hosts: vec!["10.0.0.5".into(), "coord.example".into()],
            workers: vec!["gpu-1".into()],
            clients: vec!["user".into()],
            days: 1,
        };
        generate_dev_certs(dir.path(), &spec).expect("generate");
        let read = |name: &str| std::fs::read(dir.path().join(name)).expect("read");
        let (ca, keys) = (read("ca.pem"), read("coordinator-1-key.pem"));
        let before = identity(&dir.path().join("worker-gpu-1.pem"));
        assert!(expiry_warning(&dir.path().join("worker-gpu-1.pem"), Duration::from_secs(14 * DAY))
            .expect("expires within 14 days")
            .contains("worker certificate"));
        // A stray file that is not a certificate of this CA is left alone.
        let foreign = tempfile::tempdir().expect("tempdir");
        generate_dev_certs(foreign.path(), &DevCerts::default()).expect("foreign");
        std::fs::copy(foreign.path().join("admin.pem"), dir.path().join("stranger.pem")).expect("copy");

        let renewed = renew_dev_certs(dir.path(), 90).expect("renew");
        let names: Vec<String> =
            renewed.iter().map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["admin.pem", "client-user.pem", "coordinator-1.pem", "worker-gpu-1.pem"].map(String::from));
        let after = identity(&dir.path().join("worker-gpu-1.pem"));
        assert_eq!((after.role, after.name.as_str()), (before.role, before.name.as_str()));
        assert!(after.not_after_s.abs_diff(now_s() + 90 * DAY) <= 60, "{after:?}");
        assert_eq!(read("ca.pem"), ca, "the CA is kept");
        assert_eq!(read("coordinator-1-key.pem"), keys, "keys are kept");
        assert_eq!(expiry_warning(&dir.path().join("worker-gpu-1.pem"), Duration::from_secs(14 * DAY)), None);
        // The host names are the same, and the key is the certificate's.
        let files = crate::TlsFiles {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("coordinator-1.pem"),
            key: dir.path().join("coordinator-1-key.pem"),
        };
        crate::ClientTls::load(&files).expect("the renewed certificate and its key");
        let der = CertificateDer::from_pem_file(&files.cert).expect("pem");
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).expect("parse");
        let hosts: Vec<String> = host_names(&cert)
            .expect("names")
            .into_iter()
            .map(|h| match h {
                SanType::DnsName(d) => d.as_str().to_string(),
                SanType::IpAddress(ip) => ip.to_string(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(hosts, ["127.0.0.1", "::1", "localhost", "10.0.0.5", "coord.example"]);
        assert!(renew_dev_certs(dir.path(), 0).is_err());
    }
}
