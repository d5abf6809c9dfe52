//! Fixtures of the image tests: the tools they drive (Debian's `docker-registry`, `skopeo`,
//! `umoci`, `htpasswd`), a distribution registry started on loopback with its access log read
//! back, images written as OCI layouts (layers built here, so hostile ones can be too) or built
//! with umoci from a static busybox, and pushes with skopeo.
//!
//! A test that lacks a tool or root skips with a loud message, except under CI (`CI` set), where
//! it fails: `.ci/run` installs the packages and runs as root.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use corral_image::{Digest, ImageStore, Images, Registry, RegistryConfig, RootsDir};

/// The Debian package of each tool.
const PACKAGES: &[(&str, &str)] =
    &[("docker-registry", "docker-registry"), ("skopeo", "skopeo"), ("umoci", "umoci"), ("htpasswd", "apache2-utils")];

pub const BUSYBOX: &str = "/bin/busybox";

fn skip(what: &str) -> bool {
    if std::env::var_os("CI").is_some() {
        panic!("{what}: CI must provide it (see .ci/run)");
    }
    eprintln!("\n!!!!!!!!\n!!! SKIPPED: {what} (in CI this test fails instead)\n!!!!!!!!\n");
    false
}

/// Whether the tools are installed and the test runs as root (layers keep their owners and
/// device nodes, job roots are mounts); otherwise the test is skipped loudly (fails under CI).
pub fn ready(tools: &[&str]) -> bool {
    if !nix::unistd::Uid::effective().is_root() {
        return skip("the image tests need root (owners, whiteout devices, overlay mounts)");
    }
    for tool in tools {
        if which(tool).is_none() {
            let package = PACKAGES.iter().find(|(t, _)| t == tool).map_or(*tool, |(_, p)| *p);
            return skip(&format!("{tool} is not installed (Debian package {package})"));
        }
    }
    if tools.contains(&"umoci") && !Path::new(BUSYBOX).exists() {
        return skip(&format!("{BUSYBOX} not found (Debian package busybox-static)"));
    }
    true
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.is_file())
}

/// One request in the registry's access log.
#[derive(Clone, Debug)]
pub struct Served {
    pub method: String,
    pub path: String,
    pub status: u16,
    pub bytes: u64,
}

/// A distribution registry on a loopback port, with its own storage directory.
pub struct TestRegistry {
    child: Child,
    pub addr: String,
    pub dir: tempfile::TempDir,
    /// Requests logged so far, and a signal for each new one.
    log: Arc<(Mutex<Vec<Served>>, Condvar)>,
}

impl TestRegistry {
    pub fn start() -> TestRegistry {
        TestRegistry::spawn(None)
    }

    /// A registry that requires `user`/`password` (htpasswd, bcrypt).
    pub fn start_with_auth(user: &str, password: &str) -> TestRegistry {
        TestRegistry::spawn(Some((user, password)))
    }

    fn spawn(auth: Option<(&str, &str)>) -> TestRegistry {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:0\n",
            dir.path().join("data").display()
        );
        if let Some((user, password)) = auth {
            let out = Command::new("htpasswd").args(["-Bbn", user, password]).output().expect("htpasswd");
            assert!(out.status.success(), "htpasswd: {}", String::from_utf8_lossy(&out.stderr));
            std::fs::write(dir.path().join("htpasswd"), &out.stdout).expect("htpasswd file");
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: corral-test\n    path: {}\n",
                dir.path().join("htpasswd").display()
            ));
        }
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, config).expect("config");
        let mut child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start docker-registry");
        let log = Arc::new((Mutex::new(Vec::new()), Condvar::new()));
        let (tx, rx) = mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let (log, tx) = (Arc::clone(&log), tx.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Some(at) = line.find("listening on ") {
                        let addr =
                            line[at + "listening on ".len()..].split(['"', ' ']).next().unwrap_or_default().to_string();
                        let _ = tx.send(addr);
                    }
                    if let Some(served) = parse_access(&line) {
                        log.0.lock().expect("log").push(served);
                        log.1.notify_all();
                    }
                }
            });
        }
        let addr = rx.recv_timeout(Duration::from_secs(30)).expect("docker-registry did not report its address");
        TestRegistry { child, addr, dir, log }
    }

    /// Waits (at most 30 s) until the log of requests satisfies `done`, and returns it. The
    /// registry logs a request after answering it, so a client may be done before its line is.
    pub fn wait_for(&self, what: &str, done: impl Fn(&[Served]) -> bool) -> Vec<Served> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut log = self.log.0.lock().expect("log");
        while !done(&log) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "the registry never logged {what}: {:?}", *log);
            log = self.log.1.wait_timeout(log, left).expect("log").0;
        }
        log.clone()
    }

    /// Waits until every blob has been served `times` times (logged), then returns the body
    /// bytes of all successful GETs of each.
    pub fn wait_blob_bytes(&self, blobs: &[Digest], times: usize) -> Vec<u64> {
        let log = self.wait_for("the GETs of every blob", |log| blobs.iter().all(|d| blob_gets(log, d).len() >= times));
        blobs.iter().map(|d| blob_gets(&log, d).iter().sum()).collect()
    }

    /// The file the registry keeps a blob in.
    pub fn blob_file(&self, digest: &Digest) -> PathBuf {
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&digest.hex()[..2])
            .join(digest.hex())
            .join("data")
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Body bytes of each successful GET of a blob in a log.
pub fn blob_gets(log: &[Served], digest: &Digest) -> Vec<u64> {
    let suffix = format!("/blobs/{digest}");
    log.iter().filter(|s| s.method == "GET" && s.path.ends_with(&suffix) && s.status < 300).map(|s| s.bytes).collect()
}

/// `127.0.0.1 - - [date] "GET /v2/x/blobs/sha256:… HTTP/1.1" 200 1234 "" "agent"`
fn parse_access(line: &str) -> Option<Served> {
    let request = line.split('"').nth(1)?;
    let mut parts = request.split(' ');
    let (method, path) = (parts.next()?, parts.next()?);
    let rest = line.split('"').nth(2)?;
    let mut numbers = rest.split_whitespace();
    let status = numbers.next()?.parse().ok()?;
    let bytes = numbers.next()?.parse().ok()?;
    if !path.starts_with("/v2") {
        return None;
    }
    Some(Served { method: method.into(), path: path.split('?').next()?.into(), status, bytes })
}

/// Copies an image with skopeo (no TLS checks on loopback registries).
pub fn skopeo_copy(from: &str, to: &str, extra: &[&str]) {
    let out = Command::new("skopeo")
        .args(["copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"])
        .args(extra)
        .arg(from)
        .arg(to)
        .output()
        .expect("skopeo");
    assert!(out.status.success(), "skopeo copy {from} {to}: {}", String::from_utf8_lossy(&out.stderr));
}

fn run(command: &mut Command) {
    let out = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(out.status.success(), "{command:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A busybox image built with umoci as users build images: busybox-static in `/bin` with a few
/// applets, a file in `/etc`, `Env`, `WorkingDir` and `Cmd` set. Returns the layout dir
/// (`oci:<dir>:latest`).
pub fn umoci_busybox(dir: &Path, env: &[(&str, &str)], workdir: &str) -> PathBuf {
    let layout = dir.join("busybox-layout");
    let bundle = dir.join("busybox-bundle");
    let image = format!("{}:latest", layout.display());
    run(Command::new("umoci").args(["init", "--layout"]).arg(&layout));
    run(Command::new("umoci").args(["new", "--image", &image]));
    run(Command::new("umoci").args(["unpack", "--image", &image]).arg(&bundle));
    let rootfs = bundle.join("rootfs");
    for sub in ["bin", "etc", workdir.trim_start_matches('/')] {
        std::fs::create_dir_all(rootfs.join(sub)).expect("mkdir");
    }
    std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).expect("busybox");
    for applet in ["sh", "echo", "cat", "pwd", "env", "ls", "id", "touch"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).expect("applet");
    }
    std::fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\nml:x:1000:1000::/work:/bin/sh\n")
        .expect("passwd");
    run(Command::new("umoci").args(["repack", "--image", &image]).arg(&bundle));
    let mut config = Command::new("umoci");
    config.args(["config", "--image", &image, "--config.workingdir", workdir, "--config.cmd", "/bin/sh"]);
    for (key, value) in env {
        config.arg("--config.env").arg(format!("{key}={value}"));
    }
    run(&mut config);
    layout
}

/// One entry of a layer written here.
pub enum Entry<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8]),
    Symlink(&'a str, &'a str),
    /// A raw hard link (no checks, so hostile targets can be written).
    Hardlink(&'a str, &'a str),
}

/// A layer tar, the entries written raw (hostile paths included), owned by 0:0.
pub fn tar(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_mtime(1_700_000_000);
        let (path, data, kind, link): (&str, &[u8], tar::EntryType, &str) = match entry {
            Entry::Dir(p) => (p, &[], tar::EntryType::Directory, ""),
            Entry::File(p, d) => (p, d, tar::EntryType::Regular, ""),
            Entry::Symlink(p, t) => (p, &[], tar::EntryType::Symlink, t),
            Entry::Hardlink(p, t) => (p, &[], tar::EntryType::Link, t),
        };
        header.set_entry_type(kind);
        header.set_mode(if kind == tar::EntryType::Directory { 0o755 } else { 0o644 });
        header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
        header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        header.set_size(data.len() as u64);
        header.set_cksum();
        builder.append(&header, data).expect("append");
    }
    builder.into_inner().expect("tar")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compress {
    None,
    Gzip,
    Zstd,
}

/// An image to write as an OCI layout.
pub struct ImageSpec<'a> {
    pub layers: Vec<(Vec<u8>, Compress)>,
    pub env: &'a [&'a str],
    pub workdir: &'a str,
    pub architecture: &'a str,
}

impl Default for ImageSpec<'_> {
    fn default() -> Self {
        ImageSpec { layers: Vec::new(), env: &[], workdir: "/", architecture: host_arch() }
    }
}

pub fn host_arch() -> &'static str {
    corral_image::Platform::host().architecture.leak()
}

/// A blob written into an OCI layout: (digest, size).
fn put_blob(layout: &Path, bytes: &[u8]) -> (Digest, u64) {
    let digest = Digest::of(bytes);
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).expect("blobs");
    std::fs::write(dir.join(digest.hex()), bytes).expect("blob");
    (digest, bytes.len() as u64)
}

fn compress(tar: &[u8], how: Compress) -> (Vec<u8>, &'static str) {
    match how {
        Compress::None => (tar.to_vec(), "application/vnd.oci.image.layer.v1.tar"),
        Compress::Gzip => {
            let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(tar).expect("gzip");
            (encoder.finish().expect("gzip"), "application/vnd.oci.image.layer.v1.tar+gzip")
        }
        Compress::Zstd => (zstd::encode_all(tar, 3).expect("zstd"), "application/vnd.oci.image.layer.v1.tar+zstd"),
    }
}

/// Writes an image manifest (and its blobs) into an OCI layout; returns its descriptor JSON.
pub fn write_manifest(layout: &Path, spec: &ImageSpec<'_>) -> serde_json::Value {
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    for (tar, how) in &spec.layers {
        diff_ids.push(Digest::of(tar).to_string());
        let (bytes, media_type) = compress(tar, *how);
        let (digest, size) = put_blob(layout, &bytes);
        layers.push(serde_json::json!({"mediaType": media_type, "digest": digest.to_string(), "size": size}));
    }
    let config = serde_json::json!({
        "architecture": spec.architecture, "os": "linux",
        "config": {"Env": spec.env, "WorkingDir": spec.workdir, "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let (config_digest, config_size) = put_blob(layout, config.to_string().as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest.to_string(), "size": config_size},
        "layers": layers,
    });
    let (digest, size) = put_blob(layout, manifest.to_string().as_bytes());
    serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest.to_string(), "size": size,
        "platform": {"os": "linux", "architecture": spec.architecture},
    })
}

/// Writes an OCI layout holding one image (or an index of several, one per spec) under `tag`.
pub fn write_layout(layout: &Path, tag: &str, specs: &[ImageSpec<'_>]) -> Digest {
    std::fs::create_dir_all(layout).expect("layout");
    std::fs::write(layout.join("oci-layout"), r#"{"imageLayoutVersion": "1.0.0"}"#).expect("oci-layout");
    let mut descriptors: Vec<serde_json::Value> = specs.iter().map(|s| write_manifest(layout, s)).collect();
    let mut top = if descriptors.len() == 1 {
        descriptors.remove(0)
    } else {
        let index = serde_json::json!({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": descriptors,
        });
        let (digest, size) = put_blob(layout, index.to_string().as_bytes());
        serde_json::json!({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": digest.to_string(), "size": size})
    };
    top["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": tag});
    let digest = Digest::parse(top["digest"].as_str().expect("digest")).expect("digest");
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [top]});
    std::fs::write(layout.join("index.json"), index.to_string()).expect("index.json");
    digest
}

/// A node's images in a temp dir: store, roots and a registry client.
pub struct Node {
    pub images: Images,
    pub dir: tempfile::TempDir,
}

pub fn node(max_size: u64, config: RegistryConfig, max_downloads: usize) -> Node {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::open(&dir.path().join("store"), max_size).expect("store");
    let roots = RootsDir::open(&dir.path().join("store/roots")).expect("roots");
    Node { images: Images::new(store, Registry::new(config), roots, max_downloads), dir }
}

/// Test configs: short timeouts, so a failure shows fast.
pub fn registry_config() -> RegistryConfig {
    RegistryConfig {
        connect_timeout: Duration::from_secs(5),
        read_timeout: Duration::from_secs(5),
        resolve_timeout: Duration::from_secs(10),
        ..RegistryConfig::default()
    }
}

/// Files of a directory tree, relative, with their contents (symlinks as `-> target`).
pub fn tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir") {
            let entry = entry.expect("entry");
            let path = entry.path();
            let rel = path.strip_prefix(root).expect("prefix").display().to_string();
            let kind = entry.file_type().expect("type");
            if kind.is_dir() {
                out.insert(format!("{rel}/"), String::new());
                stack.push(path);
            } else if kind.is_symlink() {
                out.insert(rel, format!("-> {}", std::fs::read_link(&path).expect("link").display()));
            } else if kind.is_file() {
                out.insert(rel, String::from_utf8_lossy(&std::fs::read(&path).expect("read")).into_owned());
            } else {
                out.insert(rel, "<special>".into());
            }
        }
    }
    out
}

/// The layer blob digests of an image manifest in an OCI layout.
pub fn layout_layers(layout: &Path, manifest: &Digest) -> Vec<Digest> {
    let bytes = std::fs::read(layout.join("blobs/sha256").join(manifest.hex())).expect("manifest blob");
    let manifest: serde_json::Value = serde_json::from_slice(&bytes).expect("manifest");
    manifest["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| Digest::parse(l["digest"].as_str().expect("digest")).expect("digest"))
        .collect()
}

/// Deterministic bytes that do not compress (xorshift).
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// Runs a command of an image's exec config in a root filesystem (chroot, then its working
/// directory) and returns its stdout.
pub fn run_in(root: &Path, exec: &corral_image::ExecConfig) -> String {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    let root = CString::new(root.as_os_str().as_bytes()).expect("root");
    let workdir = CString::new(exec.working_dir.as_bytes()).expect("workdir");
    let mut command = Command::new(&exec.argv[0]);
    command.args(&exec.argv[1..]).env_clear().envs(&exec.env);
    // SAFETY: only async-signal-safe calls (chroot, chdir) on strings made before the fork.
    unsafe {
        command.pre_exec(move || {
            if libc::chroot(root.as_ptr()) != 0 || libc::chdir(workdir.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = command.output().expect("run in the image");
    assert!(out.status.success(), "{:?} failed: {}", exec.argv, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf8")
}

/// A TCP proxy to `upstream` that breaks off, once, the first connection after it has sent
/// `cut_after` bytes back: a download interrupted mid-blob.
pub async fn cutting_proxy(upstream: String, cut_after: u64) -> String {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let cut = Arc::new(AtomicBool::new(false));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            let cut = Arc::clone(&cut);
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else { return };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let up = tokio::spawn(async move { tokio::io::copy(&mut client_read, &mut server_write).await });
                let mut sent = 0u64;
                let mut buffer = vec![0u8; 16 * 1024];
                loop {
                    let n = match server_read.read(&mut buffer).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if client_write.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                    sent += n as u64;
                    if sent > cut_after && !cut.swap(true, Ordering::SeqCst) {
                        break; // both halves drop: the connection is reset mid-response
                    }
                }
                up.abort();
            });
        }
    });
    addr
}
