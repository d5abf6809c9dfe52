//! Pulls from a distribution registry on loopback: an image built with umoci runs with its Env
//! and WorkingDir from an overlay root and comes from the store the second time; a tag moved
//! after resolution does not change what the pinned reference pulls; corrupted blobs, missing
//! images, refused credentials, escaping layers; one download per layer for ten pulls at once;
//! a broken download resumed; indexes, mirrors, whiteouts, garbage collection around a running
//! job's image and roots left by a dead worker.

use base64::Engine as _;
use corral_image::{Credentials, ErrorKind, ImageRef, JobOverrides, PullProgress, RegistryConfig, RootsDir};
use std::collections::BTreeMap;

use crate::support::*;

fn image(registry: &TestRegistry, name: &str) -> ImageRef {
    ImageRef::parse(&format!("{}/{name}", registry.addr)).expect("reference")
}

/// Writes a one-image layout and pushes it as `name`.
fn push(registry: &TestRegistry, dir: &std::path::Path, name: &str, spec: ImageSpec<'_>) -> corral_image::Digest {
    let layout = dir.join(name.replace(['/', ':'], "_"));
    let digest = write_layout(&layout, "t", &[spec]);
    skopeo_copy(&format!("oci:{}:t", layout.display()), &format!("docker://{}/{name}", registry.addr), &[]);
    digest
}

fn one_layer(entries: &[Entry<'_>]) -> ImageSpec<'static> {
    ImageSpec { layers: vec![(tar(entries), Compress::Gzip)], ..ImageSpec::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pulled_image_runs_with_its_env_and_workdir_and_is_then_cached() {
    if !ready(&["docker-registry", "skopeo", "umoci"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    let layout = umoci_busybox(work.path(), &[("GREETING", "hello from the image")], "/work");
    skopeo_copy(
        &format!("oci:{}:latest", layout.display()),
        &format!("docker://{}/test/busybox:1", registry.addr),
        &[],
    );

    let node = node(u64::MAX, registry_config(), 3);
    let pinned = node.images.registry().resolve(&image(&registry, "test/busybox:1")).await.expect("resolve");
    assert!(pinned.is_pinned() && pinned.tag() == Some("1"), "{pinned}");
    let pin = node.images.pin(&pinned).expect("pin");
    let progress = PullProgress::new();
    let record = node.images.pull(&pinned, &progress).await.expect("pull");
    let seen = progress.snapshot();
    assert_eq!((seen.bytes_done, seen.layers_done), (seen.bytes_total, seen.layers_total), "{seen:?}");
    assert!(seen.bytes_total > 400_000 && seen.layers_total == record.layers.len(), "{seen:?}");
    assert_eq!(record.id, *pinned.digest().expect("digest"));
    assert!(record.names.contains(&format!("{}/test/busybox:1", registry.addr)));

    let config = record.config().expect("config");
    let job_env = BTreeMap::from([("CORRAL_JOB_ID".to_string(), "7".to_string())]);
    let command =
        ["/bin/sh", "-c", "echo \"$GREETING\"; pwd; echo $CORRAL_JOB_ID; echo job > /written"].map(String::from);
    let exec = config.exec(JobOverrides { command: &command, env: &job_env, working_dir: None }).expect("exec");
    assert_eq!(exec.argv[0], "/bin/sh", "the job's command replaces Cmd");
    let root = node.images.mount(&pin, "7-1").expect("mount");
    assert_eq!(run_in(root.path(), &exec), "hello from the image\n/work\n7\n");
    assert!(root.upper().join("written").exists(), "the job writes into its own layer");
    for layer in &record.layers {
        assert!(!node.images.store().layer_dir(&layer.digest).join("written").exists(), "layers stay untouched");
    }
    let merged = root.path().to_path_buf();
    root.remove().expect("remove root");
    assert!(!merged.exists() && !mount_table().contains(&merged.display().to_string()));

    drop(registry); // a pinned image in the store asks the registry nothing
    let again = node.images.pull(&pinned, &PullProgress::new()).await.expect("cached pull");
    assert_eq!(again.id, record.id);
}

fn mount_table() -> String {
    std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_moved_after_resolution_does_not_change_what_is_pulled() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    // Each layer compressed its own way: gzip, zstd, none.
    let first = ImageSpec {
        layers: vec![
            (tar(&[Entry::Dir("etc"), Entry::File("etc/version", b"1")]), Compress::Gzip),
            (tar(&[Entry::File("zstd-layer", b"z")]), Compress::Zstd),
            (tar(&[Entry::File("plain-layer", b"p"), Entry::Symlink("link", "/etc/version")]), Compress::None),
        ],
        env: &["VERSION=1"],
        ..ImageSpec::default()
    };
    push(&registry, work.path(), "app:stable", first);
    let node = node(u64::MAX, registry_config(), 3);
    let stable = image(&registry, "app:stable");
    let submitted = node.images.registry().resolve(&stable).await.expect("resolve");

    push(&registry, work.path(), "app:stable", one_layer(&[Entry::Dir("etc"), Entry::File("etc/version", b"2")]));
    let moved = node.images.registry().resolve(&stable).await.expect("resolve again");
    assert_ne!(moved.digest(), submitted.digest(), "the tag moved");

    let record = node.images.pull(&submitted, &PullProgress::new()).await.expect("pull the pinned digest");
    let lowers = node.images.store().lower_dirs(&record);
    let files: BTreeMap<String, String> = lowers.iter().flat_map(|dir| tree(dir)).collect();
    assert_eq!(files["etc/version"], "1", "the bytes resolved at submit, not the tag's new ones");
    assert_eq!(files["zstd-layer"], "z");
    assert_eq!(files["plain-layer"], "p");
    assert_eq!(files["link"], "-> /etc/version");
    assert_eq!(record.config().expect("config").config.expect("run").env.expect("env"), ["VERSION=1"]);

    let missing = node.images.registry().resolve(&image(&registry, "app:nope")).await.expect_err("no such tag");
    assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");
    assert!(missing.is_permanent() && missing.to_string().contains("app:nope"), "{missing}");
    let unknown = image(&registry, "ghost/app").pinned(corral_image::Digest::of(b"no such manifest"));
    let e = node.images.pull(&unknown, &PullProgress::new()).await.expect_err("no such repository");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let down = ImageRef::parse("127.0.0.1:1/app:1").expect("reference");
    let e = node.images.registry().resolve(&down).await.expect_err("nothing listens");
    assert_eq!(e.kind(), ErrorKind::Unreachable, "{e}");
    assert!(!e.is_permanent());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_blob_is_refused() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    let noise = noise(200_000, 1);
    let manifest = push(&registry, work.path(), "corrupt:1", one_layer(&[Entry::File("data", &noise)]));
    let layer = layout_layers(&work.path().join("corrupt_1"), &manifest)[0].clone();
    let file = registry.blob_file(&layer);
    let mut bytes = std::fs::read(&file).expect("blob");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&file, bytes).expect("corrupt");

    let node = node(u64::MAX, registry_config(), 3);
    let e = node.images.pull(&image(&registry, "corrupt:1"), &PullProgress::new()).await.expect_err("corrupt");
    assert_eq!(e.kind(), ErrorKind::DigestMismatch, "{e}");
    assert!(!e.is_permanent(), "another node may get good bytes");
    assert!(e.to_string().contains(&layer.to_string()), "{e}");
    let store = node.images.store();
    assert_eq!((store.usage().layers, store.usage().images), (0, 0), "nothing of it is kept");
    assert!(std::fs::read_dir(store.root().join("tmp")).expect("tmp").next().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_required_and_given() {
    if !ready(&["docker-registry", "skopeo", "htpasswd"]) {
        return;
    }
    let registry = TestRegistry::start_with_auth("alice", "s3cret");
    let work = tempfile::tempdir().expect("tempdir");
    let layout = work.path().join("private");
    write_layout(&layout, "t", &[one_layer(&[Entry::File("secret", b"data")])]);
    skopeo_copy(
        &format!("oci:{}:t", layout.display()),
        &format!("docker://{}/private/app:1", registry.addr),
        &["--dest-creds", "alice:s3cret"],
    );
    let private = image(&registry, "private/app:1");

    let anonymous = node(u64::MAX, registry_config(), 3);
    let e = anonymous.images.pull(&private, &PullProgress::new()).await.expect_err("anonymous");
    assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
    assert!(e.is_permanent());

    let auth_file = |password: &str| {
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("alice:{password}"));
        Credentials::parse(&format!(r#"{{"auths": {{"http://{}/v2/": {{"auth": "{auth}"}}}}}}"#, registry.addr))
            .expect("auth file")
    };
    let wrong = node(u64::MAX, RegistryConfig { credentials: auth_file("guess"), ..registry_config() }, 3);
    let e = wrong.images.pull(&private, &PullProgress::new()).await.expect_err("wrong password");
    assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");

    let authorised = node(u64::MAX, RegistryConfig { credentials: auth_file("s3cret"), ..registry_config() }, 3);
    let record = authorised.images.pull(&private, &PullProgress::new()).await.expect("with credentials");
    let dir = authorised.images.store().layer_dir(&record.layers[0].digest);
    assert_eq!(std::fs::read(dir.join("secret")).expect("file"), b"data");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_pulls_at_once_fetch_each_layer_once() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    let (a, b, c) = (noise(400_000, 1), noise(300_000, 2), noise(200_000, 3));
    let spec = ImageSpec {
        layers: vec![
            (tar(&[Entry::File("a", &a)]), Compress::Gzip),
            (tar(&[Entry::File("b", &b)]), Compress::Gzip),
            (tar(&[Entry::File("c", &c)]), Compress::Zstd),
        ],
        ..ImageSpec::default()
    };
    let manifest = push(&registry, work.path(), "shared:1", spec);
    let layers = layout_layers(&work.path().join("shared_1"), &manifest);
    let sizes: Vec<u64> =
        layers.iter().map(|d| std::fs::metadata(registry.blob_file(d)).expect("blob").len()).collect();

    // Two downloads at a time for the whole node.
    let node = node(u64::MAX, registry_config(), 2);
    let pinned = node.images.registry().resolve(&image(&registry, "shared:1")).await.expect("resolve");
    let pulls: Vec<_> = (0..10)
        .map(|_| {
            let images = node.images.clone();
            let pinned = pinned.clone();
            tokio::spawn(async move {
                let progress = PullProgress::new();
                let record = images.pull(&pinned, &progress).await;
                (record, progress.snapshot())
            })
        })
        .collect();
    let mut ids = Vec::new();
    for pull in pulls {
        let (record, seen) = pull.await.expect("task");
        let record = record.expect("pull");
        let stored: Vec<_> = record.layers.iter().map(|l| l.digest.clone()).collect();
        assert_eq!(stored, layers, "layers are kept under the blob digests their manifest names");
        ids.push(record.id);
        assert_eq!(seen.bytes_done, seen.bytes_total, "{seen:?}");
        assert!(seen.bytes_total <= sizes.iter().sum::<u64>(), "{seen:?}");
    }
    ids.dedup();
    assert_eq!(ids.len(), 1);
    assert_eq!(registry.wait_blob_bytes(&layers, 1), sizes, "each layer fetched exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_download_resumes_where_it_stopped() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    let data = noise(3_000_000, 9);
    let manifest = push(&registry, work.path(), "big:1", one_layer(&[Entry::File("data", &data)]));
    let layer = layout_layers(&work.path().join("big_1"), &manifest)[0].clone();
    let size = std::fs::metadata(registry.blob_file(&layer)).expect("blob").len();

    let proxy = cutting_proxy(registry.addr.clone(), 1_000_000).await;
    let node = node(u64::MAX, registry_config(), 3);
    let through_proxy = ImageRef::parse(&format!("{proxy}/big:1")).expect("reference");
    let record = node.images.pull(&through_proxy, &PullProgress::new()).await.expect("pull resumes");
    let dir = node.images.store().layer_dir(&record.layers[0].digest);
    assert_eq!(std::fs::read(dir.join("data")).expect("data"), data);

    let is_get = |s: &Served| s.method == "GET" && s.path.ends_with(&format!("/blobs/{layer}"));
    let gets = registry.wait_for("two GETs of the blob", |log| log.iter().filter(|s| is_get(s)).count() >= 2);
    let gets: Vec<Served> = gets.into_iter().filter(is_get).collect();
    assert_eq!(gets.len(), 2, "one broken download and one resume: {gets:?}");
    assert!(gets.iter().all(|g| g.status == 206), "ranges: {gets:?}");
    assert!(gets[1].bytes < size, "the resume fetched only the rest: {gets:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_resolves_to_this_nodes_platform() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    let layout = work.path().join("multi");
    let other = if host_arch() == "amd64" { "arm64" } else { "amd64" };
    let specs = [
        ImageSpec {
            layers: vec![(tar(&[Entry::File("arch", other.as_bytes())]), Compress::Gzip)],
            architecture: other,
            ..ImageSpec::default()
        },
        ImageSpec {
            layers: vec![(tar(&[Entry::File("arch", host_arch().as_bytes())]), Compress::Gzip)],
            ..ImageSpec::default()
        },
    ];
    let index = write_layout(&layout, "t", &specs);
    skopeo_copy(&format!("oci:{}:t", layout.display()), &format!("docker://{}/multi:1", registry.addr), &["--all"]);
    let node = node(u64::MAX, registry_config(), 3);
    let pinned = node.images.registry().resolve(&image(&registry, "multi:1")).await.expect("resolve");
    assert_eq!(pinned.digest(), Some(&index), "a tag pins the index");
    let record = node.images.pull(&pinned, &PullProgress::new()).await.expect("pull");
    assert_eq!(record.index.as_ref(), Some(&index));
    assert_ne!(record.id, index);
    let dir = node.images.store().layer_dir(&record.layers[0].digest);
    assert_eq!(std::fs::read_to_string(dir.join("arch")).expect("arch"), host_arch());
    assert_eq!(node.images.store().get(&index).expect("found by the index digest").id, record.id);
    // What a coordinator learns at submit for placement: the layers nodes report.
    let layers = node.images.registry().layers(&pinned).await.expect("layers");
    let held: Vec<_> = node.images.store().layers().into_iter().map(|l| l.digest).collect();
    assert_eq!(layers.iter().map(|l| l.digest.clone()).collect::<Vec<_>>(), held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirrors_are_asked_first_and_the_registry_after() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let (upstream, mirror) = (TestRegistry::start(), TestRegistry::start());
    let work = tempfile::tempdir().expect("tempdir");
    push(&mirror, work.path(), "mirrored:1", one_layer(&[Entry::File("from", b"mirror")]));
    push(&upstream, work.path(), "only-upstream:1", one_layer(&[Entry::File("from", b"upstream")]));
    let config = RegistryConfig {
        mirrors: BTreeMap::from([(upstream.addr.clone(), vec![mirror.addr.clone()])]),
        ..registry_config()
    };
    let node = node(u64::MAX, config, 3);
    let from = |record: &corral_image::ImageRecord| {
        std::fs::read(node.images.store().layer_dir(&record.layers[0].digest).join("from")).expect("file")
    };
    // The mirror lacks this one: the registry itself answers.
    let record =
        node.images.pull(&image(&upstream, "only-upstream:1"), &PullProgress::new()).await.expect("from upstream");
    assert_eq!(from(&record), b"upstream");
    // With the registry gone, what the mirror has still pulls: it is asked first.
    let upstream_ref = image(&upstream, "mirrored:1");
    drop(upstream);
    let record = node.images.pull(&upstream_ref, &PullProgress::new()).await.expect("from the mirror");
    assert_eq!(from(&record), b"mirror");
    assert!(record.names.contains(&upstream_ref.tagged_name()), "named as asked, not as the mirror's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whiteouts_and_opaque_directories_hide_lower_files_in_the_job_root() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    let spec = ImageSpec {
        layers: vec![
            (
                tar(&[
                    Entry::Dir("a"),
                    Entry::File("a/gone", b"x"),
                    Entry::File("a/kept", b"k"),
                    Entry::Dir("b"),
                    Entry::File("b/old", b"o"),
                    Entry::File("shared", b"base"),
                    Entry::Hardlink("shared-link", "shared"),
                ]),
                Compress::Gzip,
            ),
            (
                tar(&[Entry::File("a/.wh.gone", b""), Entry::File("b/.wh..wh..opq", b""), Entry::File("b/new", b"n")]),
                Compress::Gzip,
            ),
        ],
        ..ImageSpec::default()
    };
    push(&registry, work.path(), "layered:1", spec);
    let node = node(u64::MAX, registry_config(), 3);
    let pinned = node.images.registry().resolve(&image(&registry, "layered:1")).await.expect("resolve");
    let pin = node.images.pin(&pinned).expect("pin");
    node.images.pull(&pinned, &PullProgress::new()).await.expect("pull");
    let root = node.images.mount(&pin, "layered-1").expect("mount");
    let files = tree(root.path());
    let want: BTreeMap<String, String> =
        [("a/", ""), ("a/kept", "k"), ("b/", ""), ("b/new", "n"), ("shared", "base"), ("shared-link", "base")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    assert_eq!(files, want, "the whiteout and the opaque directory hide the lower layer's files");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_escaping_its_directory_is_refused_and_named() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    push(&registry, work.path(), "evil:1", one_layer(&[Entry::Dir("etc"), Entry::File("../../../evil", b"pwned")]));
    push(&registry, work.path(), "evil:2", one_layer(&[Entry::Hardlink("shadow", "/etc/shadow")]));
    let node = node(u64::MAX, registry_config(), 3);
    for (tag, needle) in [
        ("evil:1", "entry '../../../evil' leaves the layer directory"),
        ("evil:2", "hard link 'shadow' points to the absolute path '/etc/shadow'"),
    ] {
        let e = node.images.pull(&image(&registry, tag), &PullProgress::new()).await.expect_err(tag);
        assert_eq!(e.kind(), ErrorKind::InvalidLayer, "{e}");
        assert!(e.is_permanent() && e.to_string().contains(needle), "{e}");
    }
    for dir in [
        node.dir.path().to_path_buf(),
        node.images.store().root().to_path_buf(),
        node.images.store().root().join("tmp"),
    ] {
        assert!(!dir.join("evil").exists(), "nothing written outside the layer");
    }
    assert_eq!(node.images.store().usage().layers, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_larger_than_the_store_fails_with_what_it_needs() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    // One layer of 300 kB; and two of 100 kB each, which fit alone but not together.
    push(&registry, work.path(), "big:1", one_layer(&[Entry::File("data", &noise(300_000, 7))]));
    let two = ImageSpec {
        layers: vec![
            (tar(&[Entry::File("a", &noise(100_000, 8))]), Compress::Gzip),
            (tar(&[Entry::File("b", &noise(100_000, 9))]), Compress::Gzip),
        ],
        ..ImageSpec::default()
    };
    push(&registry, work.path(), "two:1", two);
    let node = node(120_000, registry_config(), 3);

    let e = node.images.pull(&image(&registry, "big:1"), &PullProgress::new()).await.expect_err("too large");
    assert_eq!(e.kind(), ErrorKind::TooLarge, "{e}");
    assert!(e.is_permanent(), "{e}");
    let text = e.to_string();
    assert!(text.contains("its layer sha256:") && text.ends_with("needs 0.3 MB, store max-size is 0.1 MB"), "{text}");
    assert_eq!(e.needs().map(|n| (n.bytes > 300_000, n.max_size, n.more)), Some((true, 120_000, false)), "{e}");

    let e = node.images.pull(&image(&registry, "two:1"), &PullProgress::new()).await.expect_err("too large");
    assert_eq!(e.kind(), ErrorKind::TooLarge, "{e}");
    assert!(e.to_string().ends_with("needs 0.2 MB, store max-size is 0.1 MB"), "{e}");
    assert_eq!(e.needs().map(|n| n.bytes), Some(200_000), "{e}");
    let usage = node.images.store().usage();
    assert!(usage.images == 0 && usage.bytes <= 120_000, "the image is not kept, the store within max-size: {usage:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_collection_never_removes_a_running_jobs_image() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    for (name, seed) in [("gc-a:1", 1), ("gc-b:1", 2), ("gc-c:1", 3)] {
        push(&registry, work.path(), name, one_layer(&[Entry::File("data", &noise(100_000, seed))]));
    }
    // A budget that holds one of the three images (100 kB each), not two.
    let node = node(150_000, registry_config(), 3);
    let running = node.images.registry().resolve(&image(&registry, "gc-a:1")).await.expect("resolve");
    let pin = node.images.pin(&running).expect("pin");
    let a = node.images.pull(&running, &PullProgress::new()).await.expect("pull a");
    let root = node.images.mount(&pin, "job-a").expect("mount");
    drop(pin); // the job's root keeps the image pinned while it is mounted

    let b = node.images.pull(&image(&registry, "gc-b:1"), &PullProgress::new()).await.expect("pull b");
    assert!(node.images.store().get(&b.id).is_some(), "an image survives the collection of its own pull");
    let c = node.images.pull(&image(&registry, "gc-c:1"), &PullProgress::new()).await.expect("pull c");
    let store = node.images.store();
    assert!(store.get(&b.id).is_none(), "the least recently used unpinned image went");
    assert!(store.get(&a.id).is_some() && store.get(&c.id).is_some());
    assert_eq!(std::fs::read(root.path().join("data")).expect("the running job still reads its image").len(), 100_000);

    // The job ends: its image was used last (the end of a use counts), so the other goes.
    root.remove().expect("job ends");
    let report = node.images.gc().await;
    assert_eq!(report.removed, std::slice::from_ref(&c.id), "{report:?}");
    assert!(store.get(&a.id).is_some());
    assert_eq!(store.usage().images, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roots_left_by_a_dead_worker_are_unmounted_at_start() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");
    push(&registry, work.path(), "stale:1", one_layer(&[Entry::File("f", b"x")]));
    let node = node(u64::MAX, registry_config(), 3);
    let pinned = node.images.registry().resolve(&image(&registry, "stale:1")).await.expect("resolve");
    let pin = node.images.pin(&pinned).expect("pin");
    node.images.pull(&pinned, &PullProgress::new()).await.expect("pull");
    let roots_dir = node.images.store().root().join("roots");
    let mut merged = Vec::new();
    for key in ["1-1", "2-1"] {
        let root = node.images.mount(&pin, key).expect("mount");
        std::fs::write(root.path().join("scratch"), b"job data").expect("write");
        merged.push(root.path().to_path_buf());
        std::mem::forget(root); // the worker dies without cleaning up
    }
    assert!(merged.iter().all(|m| mount_table().contains(&m.display().to_string())));

    let reopened = RootsDir::open(&roots_dir).expect("a new worker opens the roots");
    for m in &merged {
        assert!(!mount_table().contains(&m.display().to_string()), "{} still mounted", m.display());
        assert!(!m.parent().expect("root dir").exists());
    }
    let again = reopened.mount(
        "1-1",
        &node.images.store().lower_dirs(&node.images.store().get(pinned.digest().expect("d")).expect("record")),
        None,
    );
    assert!(again.expect("the key is free again").path().join("f").exists());
    drop(pin);
}
