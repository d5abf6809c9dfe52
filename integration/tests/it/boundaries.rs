//! The crate boundaries written in ARCHITECTURE.md, checked: reads every Cargo.toml of the
//! workspace and fails when a dependency appears in a crate that must not know it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Dependencies that only the listed crates may name (in any dependency table).
const ONLY_IN: &[(&str, &[&str])] = &[
    ("openraft", &["corral-raft"]),
    ("raft-log", &["corral-raft"]),
    ("sled", &["corral-raft"]),
    ("prost", &["corral-proto", "corral-raft"]),
    ("tonic-prost", &["corral-proto"]),
    ("tonic-prost-build", &["corral-proto"]),
    ("rustls", &["corral-security"]),
    ("tokio-rustls", &["corral-security"]),
    ("rcgen", &["corral-security"]),
    ("x509-parser", &["corral-security"]),
    ("nvml-wrapper", &["corral-worker"]),
    ("nvml-wrapper-sys", &["corral-worker"]),
    ("cgroups-rs", &["corral-worker"]),
    ("oci-spec", &["corral-worker"]),
];

/// Crates whose normal dependencies are limited to these (pure crates: no I/O, no runtime).
const PURE: &[(&str, &[&str])] =
    &[("corral-types", &["serde", "thiserror"]), ("corral-core", &["corral-types", "serde", "thiserror"])];

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
    bad
}

#[test]
fn every_crate_keeps_to_its_dependency_boundaries() {
    let members = members();
    for expected in ["corral-raft", "corral-coordinator", "corral-worker", "corral-core", "corral-cli"] {
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
    let bad = violations(&members);
    assert!(bad.iter().any(|b| b.contains("corral-coordinator") && b.contains("openraft")), "{bad:?}");
    assert!(bad.iter().any(|b| b.contains("corral-core") && b.contains("tokio")), "{bad:?}");
}
