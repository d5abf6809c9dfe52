//! The crate boundaries written in ARCHITECTURE.md, checked: reads every Cargo.toml of the
//! workspace and fails when a dependency appears in a crate that must not know it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Dependencies that only the listed crates may name (in any dependency table).
const ONLY_IN: &[(&str, &[&str])] = &[
    ("openraft", &["corral-raft"]),
    ("raft-log", &["corral-raft"]),
    ("sled", &["corral-raft"]),
    ("redb", &["corral-raft"]),
    ("prost", &["corral-proto", "corral-raft"]),
    ("tonic-prost", &["corral-proto"]),
    ("tonic-prost-build", &["corral-proto"]),
    ("prost-build", &["corral-raft"]),
    // corral-image installs ring as the process's rustls provider for registry HTTPS (reqwest
    // inside oci-client asks for the default one); it builds no TLS configuration.
    ("rustls", &["corral-security", "corral-image"]),
    ("tokio-rustls", &["corral-security"]),
    ("rcgen", &["corral-security"]),
    ("x509-parser", &["corral-security"]),
    ("nvml-wrapper", &["corral-worker"]),
    ("nvml-wrapper-sys", &["corral-worker"]),
    ("cgroups-rs", &["corral-worker"]),
    ("oci-spec", &["corral-worker"]),
    ("oci-client", &["corral-image"]),
    ("tar", &["corral-image"]),
    ("flate2", &["corral-image"]),
    ("zstd", &["corral-image"]),
];

/// Crates whose normal dependencies are limited to these (pure crates: no I/O, no runtime; imbl
/// is persistent data structures only, sha2 a pure function that keys request ids).
const PURE: &[(&str, &[&str])] = &[
    ("corral-types", &["serde", "thiserror"]),
    ("corral-core", &["corral-types", "serde", "thiserror", "imbl", "sha2"]),
];

/// Workspace crates that must not reach these others through their normal dependencies, directly
/// or through another member: the wire protocol and its client do not compile the scheduler.
/// The image library sits below the daemons: it knows references, registries and layers, not
/// jobs, Raft or the wire protocol.
const NEVER_REACHES: &[(&str, &[&str])] = &[
    ("corral-proto", &["corral-core"]),
    ("corral-client", &["corral-core"]),
    ("corral-image", &["corral-core", "corral-raft", "corral-proto", "corral-worker", "corral-coordinator"]),
];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Every member's name and its dependencies per table (`dependencies`, `dev-dependencies`,
/// `build-dependencies`, and target-specific ones).
fn members() -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let root = workspace_root();
    let workspace: toml::Table =
        std::fs::read_to_string(root.join("Cargo.toml")).expect("read Cargo.toml").parse().expect("parse Cargo.toml");
    let paths = workspace["workspace"]["members"].as_array().expect("workspace.members");
    let mut out = BTreeMap::new();
    for path in paths {
        let dir = root.join(path.as_str().expect("member path"));
        let manifest: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .parse()
            .unwrap_or_else(|e| panic!("parse {}: {e}", dir.display()));
        let name = manifest["package"]["name"].as_str().expect("package.name").to_string();
        let mut tables = BTreeMap::new();
        let mut collect = |label: String, table: &toml::Table| {
            for kind in ["dependencies", "dev-dependencies", "build-dependencies"] {
                if let Some(deps) = table.get(kind).and_then(|d| d.as_table()) {
                    tables.insert(format!("{label}{kind}"), deps.keys().cloned().collect::<Vec<_>>());
                }
            }
        };
        collect(String::new(), &manifest);
        if let Some(targets) = manifest.get("target").and_then(|t| t.as_table()) {
            for (target, table) in targets {
                if let Some(table) = table.as_table() {
                    collect(format!("target.{target}."), table);
                }
            }
        }
        out.insert(name, tables);
    }
    out
}

fn violations(members: &BTreeMap<String, BTreeMap<String, Vec<String>>>) -> Vec<String> {
    let mut bad = Vec::new();
    for (krate, tables) in members {
        for (table, deps) in tables {
            for dep in deps {
                if let Some((_, allowed)) = ONLY_IN.iter().find(|(name, _)| name == dep) {
                    if !allowed.contains(&krate.as_str()) {
                        bad.push(format!("{krate} [{table}] names {dep}, which only {allowed:?} may use"));
                    }
                }
            }
            if let Some((_, allowed)) = PURE.iter().find(|(name, _)| name == krate) {
                if table == "dependencies" {
                    for dep in deps.iter().filter(|d| !allowed.contains(&d.as_str())) {
                        bad.push(format!("{krate} must stay pure (only {allowed:?}) but depends on {dep}"));
                    }
                }
            }
        }
    }
    for (krate, forbidden) in NEVER_REACHES {
        for target in *forbidden {
            if let Some(path) = dependency_path(members, krate, target) {
                bad.push(format!("{krate} must not depend on {target}, but does: {}", path.join(" -> ")));
            }
        }
    }
    bad
}

/// The normal dependencies of a member (`dependencies`, also target-specific ones): what a user
/// of the crate compiles.
fn normal_dependencies(tables: &BTreeMap<String, Vec<String>>) -> impl Iterator<Item = &String> {
    tables
        .iter()
        .filter(|(table, _)| table.as_str() == "dependencies" || table.ends_with(".dependencies"))
        .flat_map(|(_, deps)| deps)
}

/// A chain of normal dependencies among the members from `from` to `to`, if there is one.
fn dependency_path(
    members: &BTreeMap<String, BTreeMap<String, Vec<String>>>,
    from: &str,
    to: &str,
) -> Option<Vec<String>> {
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([from]);
    while let Some(krate) = queue.pop_front() {
        if krate == to {
            let mut path = vec![to.to_string()];
            let mut at = to;
            while let Some(prev) = came_from.get(at) {
                path.push(prev.to_string());
                at = prev;
            }
            path.reverse();
            return Some(path);
        }
        let Some(tables) = members.get(krate) else { continue };
        for dep in normal_dependencies(tables) {
            if dep != from && members.contains_key(dep) && !came_from.contains_key(dep.as_str()) {
                came_from.insert(dep, krate);
                queue.push_back(dep);
            }
        }
    }
    None
}

#[test]
fn every_crate_keeps_to_its_dependency_boundaries() {
    let members = members();
    for expected in ["corral-raft", "corral-coordinator", "corral-worker", "corral-core", "corral-cli", "corral-image"]
    {
        assert!(members.contains_key(expected), "{expected} not found among {:?}", members.keys());
    }
    let bad = violations(&members);
    assert!(bad.is_empty(), "crate boundaries of ARCHITECTURE.md broken:\n{}", bad.join("\n"));
}

#[test]
fn the_boundary_check_catches_a_crossing() {
    // The check itself must be able to fail: openraft in the coordinator, tokio in the core.
    let mut members = members();
    members
        .get_mut("corral-coordinator")
        .expect("coordinator")
        .entry("dependencies".into())
        .or_default()
        .push("openraft".into());
    members.get_mut("corral-core").expect("core").entry("dependencies".into()).or_default().push("tokio".into());
    members
        .get_mut("corral-worker")
        .expect("worker")
        .entry("dependencies".into())
        .or_default()
        .push("oci-client".into());
    members
        .get_mut("corral-image")
        .expect("image")
        .entry("dependencies".into())
        .or_default()
        .push("corral-proto".into());
    let bad = violations(&members);
    assert!(bad.iter().any(|b| b.contains("corral-worker") && b.contains("oci-client")), "{bad:?}");
    assert!(bad.iter().any(|b| b.starts_with("corral-image must not depend on corral-proto")), "{bad:?}");
    assert!(bad.iter().any(|b| b.contains("corral-coordinator") && b.contains("openraft")), "{bad:?}");
    assert!(bad.iter().any(|b| b.contains("corral-core") && b.contains("tokio")), "{bad:?}");
}

#[test]
fn the_boundary_check_catches_a_client_that_compiles_the_scheduler() {
    // The workspace's manifests with one more dependency: what the check says of them.
    let violations_with = |krate: &str, table: &str, dep: &str| {
        let mut members = members();
        members.get_mut(krate).expect(krate).entry(table.into()).or_default().push(dep.into());
        violations(&members)
    };
    // corral-core in the wire protocol: the client reaches it through corral-proto.
    let bad = violations_with("corral-proto", "dependencies", "corral-core");
    assert!(bad.iter().any(|b| b.starts_with("corral-proto must not depend on corral-core")), "{bad:?}");
    assert!(bad.iter().any(|b| b.contains("corral-client -> corral-proto -> corral-core")), "{bad:?}");
    // Through another crate the client uses.
    let bad = violations_with("corral-security", "dependencies", "corral-core");
    assert!(bad.iter().any(|b| b.contains("corral-client -> corral-security -> corral-core")), "{bad:?}");
    assert!(!bad.iter().any(|b| b.starts_with("corral-proto")), "{bad:?}");
    // A crate's dev-dependencies are not compiled by its users.
    let bad = violations_with("corral-client", "dev-dependencies", "corral-core");
    assert!(bad.is_empty(), "{bad:?}");
}
