//! Image fixtures of the integration tests, as the image library's own tests have them: a
//! distribution registry (Debian's `docker-registry`) started on a loopback port, optionally
//! with htpasswd auth; busybox images built with `umoci` from busybox-static, with the `Env`
//! and `WorkingDir` a test asks for; pushes with `skopeo`; a Docker `config.json` of
//! credentials; a throttling TCP proxy (`SlowProxy`) for pulls slow enough to watch.
//!
//! A test that lacks a tool or root skips with a loud message, except under CI (`CI` set), where
//! it fails: `.ci/run` installs the packages and runs as root.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The Debian package of each tool.
const PACKAGES: &[(&str, &str)] =
    &[("docker-registry", "docker-registry"), ("skopeo", "skopeo"), ("umoci", "umoci"), ("htpasswd", "apache2-utils")];

/// Where busybox-static puts its binary.
pub const BUSYBOX: &str = "/bin/busybox";

fn skip(what: &str) -> bool {
    assert!(std::env::var_os("CI").is_none(), "{what}: CI must provide it (see .ci/run)");
    eprintln!("\n!!!!!!!!\n!!! SKIPPED: {what} (in CI this test fails instead)\n!!!!!!!!\n");
    false
}

/// Whether the tools are installed and the test runs as root (umoci keeps owners); otherwise
/// the test is skipped loudly (fails under CI).
pub fn ready(tools: &[&str]) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("the image tests need root (image layers keep their owners)");
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

/// A distribution registry on a loopback port, with its own storage directory.
pub struct TestRegistry {
    child: Child,
    /// The registry's log lines so far (its access log among them).
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    pub dir: tempfile::TempDir,
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
        let (tx, rx) = mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for stream in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let tx = tx.clone();
            let log = log.clone();
            // Reads the log to its end, so that the registry never blocks on a full pipe.
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if line.contains("\"GET /v2/") {
                        log.lock().unwrap_or_else(|p| p.into_inner()).push(line.clone());
                    }
                    if let Some(at) = line.find("listening on ") {
                        let addr =
                            line[at + "listening on ".len()..].split(['"', ' ']).next().unwrap_or_default().to_string();
                        let _ = tx.send(addr);
                    }
                }
            });
        }
        let addr = rx.recv_timeout(Duration::from_secs(30)).expect("docker-registry did not report its address");
        TestRegistry { child, log, addr, dir }
    }
}

impl TestRegistry {
    /// How many times the blob `digest` of `repository` was fetched (`GET`, from its access log).
    pub fn blob_gets(&self, repository: &str, digest: &str) -> usize {
        let wanted = format!("\"GET /v2/{repository}/blobs/{digest} ");
        self.log.lock().unwrap_or_else(|p| p.into_inner()).iter().filter(|l| l.contains(&wanted)).count()
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Copies an image with skopeo (no TLS checks on loopback registries); `extra` e.g.
/// `--dest-creds user:password`.
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
/// applets, `/etc/passwd`, the file `/etc/marker` holding `marker`, `Env`, `WorkingDir` and
/// `Cmd` set. Returns the layout dir (`oci:<dir>:latest`).
pub fn umoci_busybox(dir: &Path, env: &[(&str, &str)], workdir: &str, marker: &str) -> PathBuf {
    let layout = dir.join(format!("busybox-layout-{}", crate::unique()));
    let bundle = layout.with_extension("bundle");
    let image = format!("{}:latest", layout.display());
    run(Command::new("umoci").args(["init", "--layout"]).arg(&layout));
    run(Command::new("umoci").args(["new", "--image", &image]));
    run(Command::new("umoci").args(["unpack", "--image", &image]).arg(&bundle));
    let rootfs = bundle.join("rootfs");
    for sub in ["bin", "etc", workdir.trim_start_matches('/')] {
        std::fs::create_dir_all(rootfs.join(sub)).expect("mkdir");
    }
    std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).expect("busybox");
    for applet in ["sh", "echo", "cat", "pwd", "env", "ls", "id", "touch", "sleep", "true"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).expect("applet");
    }
    std::fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\nml:x:1000:1000::/work:/bin/sh\n")
        .expect("passwd");
    std::fs::write(rootfs.join("etc/marker"), marker).expect("marker");
    run(Command::new("umoci").args(["repack", "--image", &image]).arg(&bundle));
    let mut config = Command::new("umoci");
    config.args(["config", "--image", &image, "--config.workingdir", workdir, "--config.cmd", "/bin/sh"]);
    for (key, value) in env {
        config.arg("--config.env").arg(format!("{key}={value}"));
    }
    run(&mut config);
    let _ = std::fs::remove_dir_all(&bundle);
    layout
}

/// Pushes the `latest` image of an OCI layout to `registry` as `name` (`repo:tag`).
pub fn push(layout: &Path, registry: &TestRegistry, name: &str, extra: &[&str]) {
    skopeo_copy(&format!("oci:{}:latest", layout.display()), &format!("docker://{}/{name}", registry.addr), extra);
}

/// Writes a Docker `config.json` holding `user`/`password` for `registry`; returns its path.
pub fn auth_file(dir: &Path, registry: &str, user: &str, password: &str) -> PathBuf {
    let path = dir.join(format!("auth-{}.json", crate::unique()));
    let auth = base64(format!("{user}:{password}").as_bytes());
    std::fs::write(&path, serde_json::json!({ "auths": { registry: { "auth": auth } } }).to_string())
        .expect("auth file");
    path
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(TABLE[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A TCP proxy on loopback in front of `upstream` that passes what `upstream` sends at most
/// `bytes_per_sec` (what the client sends goes through as it comes): a pull slow enough to
/// be watched. Stops accepting when dropped.
pub struct SlowProxy {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl SlowProxy {
    pub fn start(upstream: &str, bytes_per_sec: u64) -> SlowProxy {
        use std::io::{Read, Write};
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().expect("addr").to_string();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (flag, upstream) = (stop.clone(), upstream.to_string());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if flag.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(&upstream) else { continue };
                let (mut to_server, mut from_client) =
                    (server.try_clone().expect("clone"), client.try_clone().expect("clone"));
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from_client, &mut to_server);
                    let _ = to_server.shutdown(std::net::Shutdown::Write);
                });
                let (mut from_server, mut to_client) = (server, client);
                std::thread::spawn(move || {
                    // 20 slices a second.
                    let mut buf = vec![0u8; (bytes_per_sec / 20).max(1) as usize];
                    loop {
                        match from_server.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if to_client.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                                std::thread::sleep(Duration::from_millis(50));
                            }
                        }
                    }
                    let _ = to_client.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        SlowProxy { addr, stop }
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        // Wakes the accept loop so that it sees the flag.
        let _ = std::net::TcpStream::connect(&self.addr);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_pads() {
        assert_eq!(super::base64(b"user:pw"), "dXNlcjpwdw==");
        assert_eq!(super::base64(b"ab"), "YWI=");
        assert_eq!(super::base64(b"abc"), "YWJj");
    }
}
