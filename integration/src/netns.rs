//! Test hosts in network namespaces this test creates: one namespace per coordinator, joined by a
//! bridge in the root namespace, and nftables rules inside a namespace to cut it off.
//!
//! Needs root, `ip` (iproute2) and `nft` (nftables); everything is removed on drop.

use std::process::Command;

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{args:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// A set of namespaces `<prefix>-<i>` with addresses `10.213.<subnet>.<i>` on one bridge.
pub struct NetHosts {
    prefix: String,
    bridge: String,
    /// Prefix of the veth names (an interface name has at most 15 bytes).
    short: String,
    subnet: u8,
    count: usize,
}

/// Sets created by this process so far: tests run as threads of one process, and two sets
/// alive at once must not share a name or a subnet (creating one tears down any of its name).
static CREATED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl NetHosts {
    /// Creates `count` namespaces. Panics with the failing command if the host lacks support.
    pub fn create(count: usize) -> NetHosts {
        let pid = std::process::id();
        let n = CREATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10;
        let tag = format!("{}x{n}", pid % 100_000);
        // A subnet no interface of this host has: one left by a run that was killed (its
        // bridge outlives it) would take this set's traffic.
        let in_use = std::process::Command::new("ip")
            .args(["-o", "-4", "addr", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let subnet = (0..250)
            .map(|k| ((pid + 37 * n + k) % 250) as u8 + 1)
            .find(|s| !in_use.contains(&format!(" 10.213.{s}.")))
            .unwrap_or(((pid + 37 * n) % 250) as u8 + 1);
        let hosts = NetHosts {
            prefix: format!("crl{pid}x{n}"),
            bridge: format!("crlbr{tag}"),
            short: format!("c{tag}"),
            subnet,
            count,
        };
        hosts.teardown();
        hosts.setup().unwrap_or_else(|e| panic!("cannot create test network namespaces (needs root, iproute2): {e}"));
        hosts
    }

    fn setup(&self) -> Result<(), String> {
        let gateway = format!("10.213.{}.254/24", self.subnet);
        run(&["ip", "link", "add", &self.bridge, "type", "bridge"])?;
        run(&["ip", "addr", "add", &gateway, "dev", &self.bridge])?;
        run(&["ip", "link", "set", &self.bridge, "up"])?;
        for i in 1..=self.count {
            let ns = self.namespace(i);
            let host_if = format!("{}h{i}", self.short);
            let ns_if = format!("{}n{i}", self.short);
            run(&["ip", "netns", "add", &ns])?;
            run(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if])?;
            run(&["ip", "link", "set", &host_if, "master", &self.bridge])?;
            run(&["ip", "link", "set", &host_if, "up"])?;
            run(&["ip", "link", "set", &ns_if, "netns", &ns])?;
            let addr = format!("{}/24", self.addr(i));
            run(&["ip", "-n", &ns, "addr", "add", &addr, "dev", &ns_if])?;
            run(&["ip", "-n", &ns, "link", "set", &ns_if, "up"])?;
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    fn teardown(&self) {
        for i in 1..=self.count {
            let _ = run(&["ip", "netns", "del", &self.namespace(i)]);
            let _ = run(&["ip", "link", "del", &format!("{}h{i}", self.short)]);
        }
        let _ = run(&["ip", "link", "del", &self.bridge]);
    }

    /// Name of namespace `i` (1-based).
    pub fn namespace(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    /// Address of host `i` (1-based).
    pub fn addr(&self, i: usize) -> String {
        format!("10.213.{}.{i}", self.subnet)
    }

    /// Drops every packet in and out of host `i`.
    pub fn isolate(&self, i: usize) {
        let ns = self.namespace(i);
        let rules = "table inet corral_partition {\n\
                     chain input { type filter hook input priority 0; policy drop; iif lo accept; }\n\
                     chain output { type filter hook output priority 0; policy drop; oif lo accept; }\n\
                     }\n";
        let path = std::env::temp_dir().join(format!("{ns}.nft"));
        std::fs::write(&path, rules).expect("write nft rules");
        run(&["ip", "netns", "exec", &ns, "nft", "-f", &path.display().to_string()])
            .unwrap_or_else(|e| panic!("cannot partition host {i} (needs nftables): {e}"));
    }

    /// Removes the partition of host `i`.
    pub fn heal(&self, i: usize) {
        run(&["ip", "netns", "exec", &self.namespace(i), "nft", "delete", "table", "inet", "corral_partition"])
            .unwrap_or_else(|e| panic!("cannot heal host {i}: {e}"));
    }
}

impl Drop for NetHosts {
    fn drop(&mut self) {
        self.teardown();
    }
}
