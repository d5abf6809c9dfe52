//! `image load`: archives as `docker save` and skopeo write them, and OCI layouts, checked as
//! pulls are.

use std::collections::BTreeMap;

use corral_image::{ErrorKind, ImageRef, ImageStore, JobOverrides};

use crate::support::*;

#[test]
fn a_docker_save_archive_loads_and_runs() {
    if !ready(&["skopeo", "umoci"]) {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let layout = umoci_busybox(work.path(), &[("GREETING", "loaded")], "/srv");
    let archive = work.path().join("busybox.tar");
    skopeo_copy(
        &format!("oci:{}:latest", layout.display()),
        &format!("docker-archive:{}:test/busybox:1", archive.display()),
        &[],
    );

    let store = ImageStore::open(&work.path().join("store"), u64::MAX).expect("store");
    let loaded = store.load(&archive).expect("load");
    assert_eq!(loaded.len(), 1);
    let record = &loaded[0];
    assert_eq!(record.id, record.config_digest, "a docker archive's image is named by its config");
    assert!(record.names.contains("docker.io/test/busybox:1"), "{:?}", record.names);
    let found = store.find(&ImageRef::parse("test/busybox:1").expect("reference")).expect("found by name");
    assert_eq!(found.id, record.id);
    let exec = record
        .config()
        .expect("config")
        .exec(JobOverrides { command: &[], env: &BTreeMap::new(), working_dir: None })
        .expect("exec");
    assert_eq!(
        (exec.env["GREETING"].as_str(), exec.working_dir.as_str(), exec.argv[0].as_str()),
        ("loaded", "/srv", "/bin/sh")
    );

    // Its layers as the job's root: busybox runs.
    let roots = corral_image::RootsDir::open(&work.path().join("store/roots")).expect("roots");
    let root = roots.mount("load-1", &store.lower_dirs(record), None).expect("mount");
    let command = ["/bin/sh", "-c", "echo $GREETING from $(pwd)"].map(String::from);
    let exec = record
        .config()
        .expect("config")
        .exec(JobOverrides { command: &command, env: &BTreeMap::new(), working_dir: None })
        .expect("exec");
    assert_eq!(run_in(root.path(), &exec), "loaded from /srv\n");
    root.remove().expect("remove");

    let usage = store.usage();
    assert_eq!(store.load(&archive).expect("again")[0].id, record.id);
    assert_eq!(store.usage(), usage, "loading again adds nothing");
}

#[test]
fn an_oci_archive_and_an_oci_layout_load_with_their_manifest_digests() {
    if !ready(&["skopeo"]) {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let layout = work.path().join("layout");
    let spec =
        ImageSpec { layers: vec![(tar(&[Entry::File("hello", b"world")]), Compress::Zstd)], ..ImageSpec::default() };
    let manifest = write_layout(&layout, "v1", &[spec]);
    let archive = work.path().join("image.oci.tar");
    skopeo_copy(
        &format!("oci:{}:v1", layout.display()),
        &format!("oci-archive:{}:registry.lab/team/app:v1", archive.display()),
        &[],
    );

    let store = ImageStore::open(&work.path().join("store"), u64::MAX).expect("store");
    let loaded = store.load(&archive).expect("load archive");
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].id, manifest, "skopeo kept the manifest: the digest a registry would have");
    assert!(loaded[0].names.contains("registry.lab/team/app:v1"), "{:?}", loaded[0].names);
    let from_dir = store.load(&layout).expect("load layout dir");
    assert_eq!(from_dir[0].id, manifest);
    assert_eq!(std::fs::read(store.layer_dir(&loaded[0].layers[0].digest).join("hello")).expect("file"), b"world");
    let pinned = ImageRef::parse(&format!("registry.lab/team/app@{manifest}")).expect("reference");
    assert!(store.find(&pinned).is_some(), "a job pinned to the digest finds it");
}

#[test]
fn archives_with_bad_layers_are_refused() {
    if !ready(&[]) {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let store = ImageStore::open(&work.path().join("store"), u64::MAX).expect("store");

    let escaping = work.path().join("escaping");
    write_layout(
        &escaping,
        "t",
        &[ImageSpec {
            layers: vec![(tar(&[Entry::File("../../outside", b"x")]), Compress::Gzip)],
            ..ImageSpec::default()
        }],
    );
    let e = store.load(&escaping).expect_err("escaping layer");
    assert_eq!(e.kind(), ErrorKind::InvalidLayer, "{e}");
    assert!(e.to_string().contains("entry '../../outside' leaves the layer directory"), "{e}");

    let corrupt = work.path().join("corrupt");
    let manifest = write_layout(
        &corrupt,
        "t",
        &[ImageSpec {
            layers: vec![(tar(&[Entry::File("f", &noise(50_000, 4))]), Compress::Gzip)],
            ..ImageSpec::default()
        }],
    );
    let blob = corrupt.join("blobs/sha256").join(layout_layers(&corrupt, &manifest)[0].hex());
    let mut bytes = std::fs::read(&blob).expect("blob");
    let last = bytes.len() - 20;
    bytes[last] ^= 1;
    std::fs::write(&blob, bytes).expect("corrupt");
    let e = store.load(&corrupt).expect_err("corrupt layer");
    assert_eq!(e.kind(), ErrorKind::DigestMismatch, "{e}");

    let gzipped = work.path().join("image.tar.gz");
    std::fs::write(&gzipped, [0x1f, 0x8b, 8, 0]).expect("gzip");
    assert!(store.load(&gzipped).expect_err("compressed").to_string().contains("decompress it first"));
    let neither = work.path().join("empty-dir");
    std::fs::create_dir(&neither).expect("dir");
    assert!(store.load(&neither).expect_err("empty").to_string().contains("neither an OCI layout"));
    assert_eq!(store.usage().layers, 0);
    assert!(!work.path().join("outside").exists() && !work.path().join("store/outside").exists());
}
