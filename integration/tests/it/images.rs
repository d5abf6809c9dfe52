//! Container images at submit, against a real distribution registry on loopback: `--image`
//! with a tag is pinned to the digest the tag names then (`corral show` shows both), a tag
//! moved later does not change what a submitted job runs, and a reference that does not
//! resolve (not found, unauthorized, unreachable) is refused with one line. Registry
//! credentials are the coordinator's `[images] auth-file`. On the worker: a job runs in its
//! image (Env, WorkingDir, the job's command), the bytes pinned at submit, from the node's
//! store once pulled; an image gone from the registry fails the job with "not found". Pyxis's
//! flags (`--container-mounts` within the node's allow-list, `--container-workdir`,
//! `--container-env`) shape the container, and a batch script naming its image with
//! `#SBATCH --container-image` runs in it (its `--output` file written on the host), with `srun`, `scontrol` and `corral attach` working
//! inside its container. While a run's image is pulled, `corral show` and
//! `corral queue` say so with its progress (the worker's heartbeats carry it to the leader); an
//! image gang's parts start only once every part has its image.
//! Garbage collection under a small `max-size` never removes a running job's image.
//! `corral image` pre-pulls onto the nodes, lists each node's images (in use or not), refuses
//! to remove an image a running job needs (naming the job) and loads a `docker save` archive.

use corral_integration::cluster::{free_port, Cluster, ClusterOptions};
use corral_integration::registry::{auth_file, push, ready, skopeo_copy, umoci_busybox, SlowProxy, TestRegistry};
use corral_integration::{corral_bin, one_line_stderr, DevPool};
use std::process::Command;

const TOOLS: &[&str] = &["docker-registry", "skopeo", "umoci"];

/// The digest a tag names now, as skopeo reads it.
fn digest_of(reference: &str, extra: &[&str]) -> String {
    let out = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false", "--format", "{{.Digest}}"])
        .args(extra)
        .arg(format!("docker://{reference}"))
        .output()
        .expect("skopeo inspect");
    assert!(out.status.success(), "skopeo inspect {reference}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf8").trim().to_string()
}

#[test]
fn a_tag_is_pinned_to_its_digest_at_submit() {
    if !ready(TOOLS) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let one = umoci_busybox(dir.path(), &[("STAGE", "one")], "/work", "one");
    push(&one, &registry, "train:v1", &[]);
    let reference = format!("{}/train:v1", registry.addr);
    let first = digest_of(&reference, &[]);
    let pool = DevPool::start(&["--gpus", "1"]);

    let held = pool.submit(&["--hold", "--image", &reference, "--", "cat", "/etc/marker"]);
    let doc = pool.show(held);
    assert_eq!(doc["image"], reference.as_str(), "{doc}");
    assert_eq!(doc["image_digest"], first.as_str(), "{doc}");
    let table = pool.ok(&["show", &held.to_string()]);
    assert!(table.contains(&format!("image:      {reference}\n")), "{table}");
    assert!(table.contains(&format!("digest:     {first}\n")), "{table}");

    // The tag moves: the held job keeps the bytes it was submitted with, a new job gets the new.
    let two = umoci_busybox(dir.path(), &[("STAGE", "two")], "/work", "two");
    push(&two, &registry, "train:v1", &[]);
    let second = digest_of(&reference, &[]);
    assert_ne!(first, second);
    assert_eq!(pool.show(held)["image_digest"], first.as_str());
    let later = pool.submit(&["--hold", "--container-image", &reference, "--", "true"]);
    assert_eq!(pool.show(later)["image_digest"], second.as_str());

    // A digest is kept as given, without a tag; a rootfs directory keeps today's meaning.
    let by_digest = format!("{}/train@{first}", registry.addr);
    let pinned = pool.submit(&["--hold", "--image", &by_digest, "--", "true"]);
    let doc = pool.show(pinned);
    assert_eq!((doc["image"].as_str(), doc["image_digest"].as_str()), (Some(by_digest.as_str()), Some(first.as_str())));
    let rootfs = pool.submit(&["--hold", "--image", "/srv/rootfs", "--", "true"]);
    let doc = pool.show(rootfs);
    assert_eq!((doc["image"].as_str(), doc["image_digest"].as_str()), (Some("/srv/rootfs"), None));

    // What does not resolve is refused with one line, and nothing is queued.
    let missing = pool.corral(&["submit", "--image", &format!("{}/train:nope", registry.addr), "--", "true"]);
    assert!(!missing.status.success());
    let line = one_line_stderr(&missing);
    assert!(line.contains("not found"), "{line}");
    let closed = pool.corral(&["submit", "--image", &format!("127.0.0.1:{}/train:v1", free_port()), "--", "true"]);
    assert!(!closed.status.success());
    let line = one_line_stderr(&closed);
    assert!(line.contains("registry unreachable"), "{line}");
    let bad = pool.corral(&["submit", "--image", "Not/A:Ref:At:All", "--", "true"]);
    assert!(!bad.status.success());
    let line = one_line_stderr(&bad);
    assert!(line.contains("invalid image reference"), "{line}");
    let jobs = pool.json(&["jobs", "--all"]);
    assert_eq!(jobs.as_array().map(Vec::len), Some(4), "{jobs}");
}

#[test]
fn private_registries_need_the_coordinators_credentials() {
    if !ready(&[TOOLS, &["htpasswd"]].concat()) {
        return;
    }
    let registry = TestRegistry::start_with_auth("ml", "s3cret");
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[], "/", "private");
    push(&image, &registry, "private:1", &["--dest-creds", "ml:s3cret"]);
    let reference = format!("{}/private:1", registry.addr);
    let digest = digest_of(&reference, &["--creds", "ml:s3cret"]);

    // Without credentials: refused, and the reason says so.
    let pool = DevPool::start(&["--gpus", "1"]);
    let out = pool.corral(&["submit", "--image", &reference, "--", "true"]);
    assert!(!out.status.success());
    let line = one_line_stderr(&out);
    assert!(line.contains("unauthorized"), "{line}");

    // With the coordinator's auth file: pinned.
    let auth = auth_file(dir.path(), &registry.addr, "ml", "s3cret");
    let options = ClusterOptions {
        extra_config: format!("[images]\nauth-file = \"{}\"\nresolve-timeout = \"20s\"\n", auth.display()),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(1, options);
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "{}", one_line_stderr(&init));
    let doc = cluster.json(&["submit", "--hold", "--image", &reference, "--", "true"]);
    let job = doc["id"].as_u64().expect("id");
    assert_eq!(cluster.show(job)["image_digest"], digest.as_str());
}

/// Waits for `job` to end; returns its document.
fn ended(pool: &DevPool, job: u64) -> serde_json::Value {
    pool.wait_for(job, "ended", |d| ["succeeded", "failed", "cancelled"].contains(&d["state"].as_str().unwrap_or("")))
}

#[test]
fn image_jobs_run_in_their_image_pinned_at_submit_and_from_the_store_once_pulled() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let one = umoci_busybox(dir.path(), &[("STAGE", "one")], "/work", "one");
    push(&one, &registry, "train:v1", &[]);
    let reference = format!("{}/train:v1", registry.addr);
    let pool = DevPool::start(&["--gpus", "1"]);
    let script = "echo stage=$STAGE; echo cwd=$(pwd); echo marker=$(cat /etc/marker); touch /written";

    // The image's Env and WorkingDir, the job's command; the root is the job's to write.
    let first = pool.submit(&["--image", &reference, "--", "sh", "-c", script]);
    let doc = ended(&pool, first);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let out = pool.ok(&["logs", &first.to_string()]);
    assert!(out.contains("stage=one\ncwd=/work\nmarker=one\n"), "{out}");

    // A held job keeps the bytes it was submitted with when the tag moves.
    let held = pool.submit(&["--hold", "--image", &reference, "--", "sh", "-c", script]);
    let two = umoci_busybox(dir.path(), &[("STAGE", "two")], "/work", "two");
    push(&two, &registry, "train:v1", &[]);
    pool.ok(&["release", &held.to_string()]);
    let doc = ended(&pool, held);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let out = pool.ok(&["logs", &held.to_string()]);
    assert!(out.contains("stage=one\n") && out.contains("marker=one\n"), "{out}");

    // An image the registry no longer has fails the job with "not found", on one line.
    let gone = pool.submit(&["--hold", "--image", &reference, "--", "true"]);
    let digest = pool.show(gone)["image_digest"].as_str().expect("digest").to_string();
    let out = Command::new("skopeo")
        .args(["delete", "--tls-verify=false"])
        .arg(format!("docker://{}/train@{digest}", registry.addr))
        .output()
        .expect("skopeo delete");
    assert!(out.status.success(), "skopeo delete: {}", String::from_utf8_lossy(&out.stderr));
    pool.ok(&["release", &gone.to_string()]);
    let doc = ended(&pool, gone);
    assert_eq!(doc["state"], "failed", "{doc}");
    let reason = doc["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("not found") && !reason.contains('\n'), "{doc}");

    // With the registry gone, the image pulled before still runs: from the store, no fetch.
    let by_digest = pool.show(first)["image_digest"].as_str().expect("digest").to_string();
    let pinned = format!("{}/train@{by_digest}", registry.addr);
    let cached = pool.submit(&["--hold", "--image", &pinned, "--", "sh", "-c", script]);
    drop(registry);
    pool.ok(&["release", &cached.to_string()]);
    let doc = ended(&pool, cached);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let out = pool.ok(&["logs", &cached.to_string()]);
    assert!(out.contains("stage=one\ncwd=/work\nmarker=one\n"), "{out}");
}

#[test]
fn two_jobs_of_one_image_arriving_together_fetch_each_layer_once() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[("STAGE", "both")], "/", "both");
    push(&image, &registry, "shared:1", &[]);
    let reference = format!("{}/shared:1", registry.addr);
    let out = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false", "--raw"])
        .arg(format!("docker://{reference}"))
        .output()
        .expect("skopeo inspect");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let manifest: serde_json::Value = serde_json::from_slice(&out.stdout).expect("manifest");
    let layers: Vec<String> = manifest["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["digest"].as_str().expect("digest").to_string())
        .collect();
    assert!(!layers.is_empty(), "{manifest}");
    let pool = DevPool::start(&["--gpus", "2"]);
    let jobs: Vec<u64> =
        (0..2).map(|_| pool.submit(&["--image", &reference, "--", "sh", "-c", "echo stage=$STAGE"])).collect();
    for &job in &jobs {
        let doc = ended(&pool, job);
        assert_eq!(doc["state"], "succeeded", "{doc}");
        assert!(pool.ok(&["logs", &job.to_string()]).contains("stage=both\n"));
    }
    // The access log is written as each request completes: give the last line a moment.
    std::thread::sleep(std::time::Duration::from_millis(200));
    for layer in &layers {
        assert_eq!(registry.blob_gets("shared", layer), 1, "layer {layer} fetched once for both jobs");
    }
}

#[test]
fn pyxis_container_flags_bind_allowed_mounts_set_the_workdir_and_pass_variables() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[("STAGE", "image"), ("TOKEN", "image")], "/work", "flags");
    push(&image, &registry, "flags:1", &[]);
    let reference = format!("{}/flags:1", registry.addr);
    let allowed = dir.path().join("allowed");
    std::fs::create_dir_all(allowed.join("set")).expect("mkdir");
    std::fs::create_dir_all(allowed.join("out")).expect("mkdir");
    std::fs::write(allowed.join("set/input"), "data-in\n").expect("write");
    let private = dir.path().join("private");
    std::fs::create_dir_all(&private).expect("mkdir");
    let pool = DevPool::start(&["--gpus", "1", "--mount-allow", allowed.to_str().expect("utf8")]);

    // Read-only and read-write mounts, the working directory, a variable of the submit's shell.
    let mounts = format!("{}:/data:ro,{}:/results", allowed.join("set").display(), allowed.join("out").display());
    let script = "echo cwd=$(pwd) token=$TOKEN stage=$STAGE; cat input; echo done > /results/out; \
                  touch /data/new 2>/dev/null && echo ro-written || echo ro-refused";
    let out = Command::new(corral_bin())
        .args(["--endpoint", &pool.addr, "--output", "json", "submit", "--image", &reference])
        .args(["--container-mounts", &mounts, "--container-workdir", "/data", "--container-env", "TOKEN"])
        .args(["--", "sh", "-c", script])
        .env("TOKEN", "host")
        .output()
        .expect("corral submit");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let job = serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("json")["id"].as_u64().expect("id");
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let expected_mounts =
        [format!("{}:/data:ro", allowed.join("set").display()), format!("{}:/results", allowed.join("out").display())];
    assert_eq!(doc["container_mounts"], serde_json::json!(expected_mounts), "{doc}");
    assert_eq!(
        (doc["container_workdir"].as_str(), &doc["container_env"]),
        (Some("/data"), &serde_json::json!(["TOKEN"]))
    );
    let logs = pool.ok(&["logs", &job.to_string()]);
    assert!(logs.contains("cwd=/data token=host stage=image\ndata-in\nro-refused\n"), "{logs}");
    assert_eq!(std::fs::read_to_string(allowed.join("out/out")).expect("written through the mount"), "done\n");
    assert!(!allowed.join("set/new").exists());

    // A mount outside the node's allow-list fails the job, named on one line.
    let refused = format!("{}:/secret", private.display());
    let job = pool.submit(&["--image", &reference, "--container-mounts", &refused, "--", "true"]);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "failed", "{doc}");
    let reason = doc["reason"].as_str().unwrap_or_default();
    assert!(reason.contains(&format!("container mount {refused} refused")) && reason.contains("mount-allow"), "{doc}");
    assert!(!reason.contains('\n'), "{reason}");
    let logs = pool.corral(&["logs", &job.to_string()]);
    let said = format!("{}{}", String::from_utf8_lossy(&logs.stdout), String::from_utf8_lossy(&logs.stderr));
    assert!(said.contains(&refused), "{said}");

    // Container flags without an image, or a relative mount, are refused at submit.
    for (args, needle) in [
        (vec!["submit", "--container-mounts", "/a:/b", "--", "true"], "need --image"),
        (vec!["submit", "--image", &reference, "--container-mounts", "a:/b", "--", "true"], "must be an absolute path"),
    ] {
        let out = pool.corral(&args);
        assert!(!out.status.success(), "{args:?}");
        let line = one_line_stderr(&out);
        assert!(line.contains(needle), "{args:?}: {line}");
    }
}

#[test]
fn a_batch_script_with_a_container_image_directive_runs_in_the_image() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[("STAGE", "batch")], "/work", "batch");
    push(&image, &registry, "batch:1", &[]);
    let reference = format!("{}/batch:1", registry.addr);
    let pool = DevPool::start(&["--gpus", "1"]);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = corral_integration::worker::out_dir(&dir);
    let script = dir.path().join("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n#SBATCH --container-image={reference}\n#SBATCH --container-workdir=/etc\n#SBATCH --job-name=inimage\n\
             #SBATCH --output={}/%x-%j.out\n\
             echo stage=$STAGE marker=$(cat marker) args=$* cwd=$(pwd) job=$SLURM_JOB_ID\n",
            out.display()
        ),
    )
    .expect("script");
    let doc = pool.json(&["sbatch", script.to_str().expect("utf8"), "a", "b"]);
    let job = doc["id"].as_u64().unwrap_or_else(|| panic!("no id in {doc}"));
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!((doc["image"].as_str(), doc["name"].as_str()), (Some(reference.as_str()), Some("inimage")));
    assert!(doc["image_digest"].as_str().is_some_and(|d| d.starts_with("sha256:")), "{doc}");
    let logs = pool.ok(&["logs", &job.to_string()]);
    let line = format!("stage=batch marker=batch args=a b cwd=/etc job={job}\n");
    assert!(logs.contains(&line), "{logs}");
    // `--output` is a file of the host, named from the submit side, as with pyxis.
    let file = out.join(format!("inimage-{job}.out"));
    let written = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    assert_eq!(written, line);
}

/// Slurm's in-job commands work inside an image job, and what they start runs in the job's
/// container: `srun`'s tasks see the image's files and Env and the step's Slurm variables, a
/// failing task's status is `srun`'s, and `corral attach` runs in the container too.
#[test]
fn srun_and_attach_in_an_image_job_run_in_its_container() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[("STAGE", "steps")], "/work", "in-image");
    push(&image, &registry, "steps:1", &[]);
    let reference = format!("{}/steps:1", registry.addr);
    let pool = DevPool::start(&["--gpus", "1"]);
    let script = dir.path().join("steps.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n#SBATCH --container-image={reference}\n#SBATCH --ntasks=2\n#SBATCH --job-name=steps\n\
             echo batch stage=$STAGE\n\
             srun sh -c 'echo task=$SLURM_PROCID of=$SLURM_NTASKS stage=$STAGE marker=$(cat /etc/marker) cwd=$(pwd)'\n\
             srun -n 1 sh -c 'exit 3'\n\
             echo srun-exit=$?\n\
             echo hosts=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\")\n\
             exec sleep 600\n"
        ),
    )
    .expect("script");
    let doc = pool.json(&["sbatch", script.to_str().expect("utf8")]);
    let job = doc["id"].as_u64().unwrap_or_else(|| panic!("no id in {doc}"));
    let id = job.to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let logs = loop {
        let logs = pool.ok(&["logs", &id]);
        if logs.contains("hosts=") {
            break logs;
        }
        let doc = pool.show(job);
        assert_eq!(doc["state"], "running", "the job ended early: {doc}\n{logs}");
        assert!(std::time::Instant::now() < deadline, "no hosts= line within 120 s: {logs}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(logs.contains("batch stage=steps\n"), "{logs}");
    for task in 0..2 {
        let line = format!("task={task} of=2 stage=steps marker=in-image cwd=/work\n");
        assert!(logs.contains(&line), "no {line:?} in {logs}");
    }
    assert!(logs.contains("srun-exit=3\n"), "{logs}");
    let attached = pool.corral(&["attach", &id, "--", "sh", "-c", "cat /etc/marker; echo \" $STAGE $(pwd)\"; exit 4"]);
    assert_eq!(attached.status.code(), Some(4), "{attached:?}");
    assert_eq!(String::from_utf8_lossy(&attached.stdout), "in-image steps /work\n", "{attached:?}");
    pool.ok(&["cancel", &id]);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "cancelled", "{doc}");
}

#[test]
fn a_run_pulling_its_image_shows_its_progress_in_show_queue_and_top() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[("STAGE", "slow")], "/", "slow");
    push(&image, &registry, "slow:1", &[]);
    // About 1 MB of layers at 150 kB/s: several heartbeats see the pull under way.
    let proxy = SlowProxy::start(&registry.addr, 150_000);
    let reference = format!("{}/slow:1", proxy.addr);
    let pool = DevPool::start(&["--gpus", "1"]);
    let job = pool.submit(&["--image", &reference, "--", "sh", "-c", "echo stage=$STAGE"]);
    let doc = pool.wait_for(job, "a pulling reason", |d| d["reason"].as_str().is_some_and(|r| r.contains(" layers, ")));
    let reason = doc["reason"].as_str().expect("reason").to_string();
    assert!(reason.starts_with(&format!("pulling image {reference}: ")) && reason.ends_with(" MB"), "{reason}");
    assert_eq!((doc["state"].as_str(), doc["started_at"].is_null()), (Some("running"), true), "{doc}");
    let queue = pool.ok(&["queue"]);
    assert!(queue.contains(&format!("pulling image {reference}")), "{queue}");
    let top = pool.ok(&["top", "--once"]);
    assert!(top.contains(&format!("pulling image {reference}")), "corral top shows the pull too: {top}");
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert!(!doc["reason"].as_str().unwrap_or_default().contains("pulling"), "{doc}");
    assert!(pool.ok(&["logs", &job.to_string()]).contains("stage=slow\n"));
}

/// Whether the worker's store holds the image record of `digest` (`sha256:...`).
fn stored(pool: &DevPool, digest: &str) -> bool {
    let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
    pool.data_dir.join("worker/images/images").join(format!("{hex}.json")).exists()
}

#[test]
fn collection_under_a_small_max_size_never_removes_a_running_jobs_image() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, marker) in [("one", "one"), ("two", "two"), ("three", "three")] {
        let image = umoci_busybox(dir.path(), &[], "/", marker);
        push(&image, &registry, &format!("{name}:1"), &[]);
    }
    let reference = |name: &str| format!("{}/{name}:1", registry.addr);
    // Room for one image (busybox, about 2 MB unpacked), not two: each pull past the first
    // collects what nothing pins.
    let pool = DevPool::start(&["--gpus", "2", "--image-max-size", "3MiB"]);

    // Job one runs until the test lets it go (a file in its work dir, /work in the container).
    let wait_go = "echo started; while [ ! -e /work/go ]; do sleep 0.1; done; echo marker=$(cat /etc/marker)";
    let running = pool.submit(&["--image", &reference("one"), "--", "sh", "-c", wait_go]);
    let doc = pool.wait_for(running, "job one started", |d| !d["started_at"].is_null());
    assert_eq!(doc["state"], "running", "{doc}");
    let one = pool.show(running)["image_digest"].as_str().expect("digest").to_string();
    assert!(stored(&pool, &one), "pulled into the store");

    // Another image is pulled meanwhile: its collection keeps the running job's image.
    let other = pool.submit(&["--image", &reference("two"), "--", "cat", "/etc/marker"]);
    let doc = ended(&pool, other);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let two = doc["image_digest"].as_str().expect("digest").to_string();
    assert!(stored(&pool, &one), "the running job's image survives a collection over max-size");

    let jobs = pool.data_dir.join("worker/jobs").join(running.to_string());
    let epoch_dir = std::fs::read_dir(&jobs).expect("job dir").next().expect("an epoch").expect("entry").path();
    std::fs::write(epoch_dir.join("go"), "").expect("go");
    let doc = ended(&pool, running);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert!(pool.ok(&["logs", &running.to_string()]).contains("marker=one\n"), "its root was intact to the end");

    // Once nothing needs them, the next pull's collection removes both.
    let third = pool.submit(&["--image", &reference("three"), "--", "true"]);
    assert_eq!(ended(&pool, third)["state"], "succeeded");
    assert!(!stored(&pool, &one) && !stored(&pool, &two), "unpinned images over max-size are collected");
}

#[test]
fn corral_image_pulls_lists_refuses_to_remove_what_a_job_needs_and_loads_archives() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[], "/", "tools");
    push(&image, &registry, "tools:1", &[]);
    let reference = format!("{}/tools:1", registry.addr);
    let digest = digest_of(&reference, &[]);
    let pool = DevPool::start(&["--gpus", "1"]);

    // A pre-pull: one line per node at the end.
    let out = pool.ok(&["image", "pull", &reference, "--all"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(lines[0].contains(&format!(": pulled {reference} ({digest}, ")), "{out}");
    let listed = pool.json(&["image", "ls"]);
    let images = listed["images"].as_array().expect("images");
    assert_eq!(images.len(), 1, "{listed}");
    assert_eq!(images[0]["digest"], digest.as_str(), "{listed}");
    assert_eq!(images[0]["names"][0], reference.as_str(), "{listed}");
    assert_eq!(images[0]["in_use"], false, "{listed}");
    assert!(images[0]["size_bytes"].as_u64().unwrap_or(0) > 500_000, "{listed}");
    let node = images[0]["node"].as_str().expect("node").to_string();
    let table = pool.ok(&["image", "ls", "--node", &node]);
    assert!(table.starts_with("NODE") && table.contains(&reference), "{table}");

    // A running job needs it: rm is refused and names the job; the job still runs from it.
    let wait_go = "echo started; while [ ! -e /work/go ]; do sleep 0.1; done; echo done";
    let running = pool.submit(&["--image", &reference, "--", "sh", "-c", wait_go]);
    pool.wait_for(running, "the job started", |d| !d["started_at"].is_null());
    let listed = pool.json(&["image", "ls"]);
    assert_eq!(listed["images"][0]["in_use"], true, "{listed}");
    let refused = pool.corral(&["image", "rm", &reference]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains(&format!("needed by job {running} on node {node}")), "{stderr}");
    assert_eq!(pool.json(&["image", "ls"])["images"].as_array().map(Vec::len), Some(1));
    let jobs = pool.data_dir.join("worker/jobs").join(running.to_string());
    let epoch_dir = std::fs::read_dir(&jobs).expect("job dir").next().expect("an epoch").expect("entry").path();
    std::fs::write(epoch_dir.join("go"), "").expect("go");
    assert_eq!(ended(&pool, running)["state"], "succeeded");

    // Once the job is gone (its worker unmounts its root just after it ends), rm removes it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while pool.json(&["image", "ls"])["images"][0]["in_use"] == true {
        assert!(std::time::Instant::now() < deadline, "the ended job's root still pins the image");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let removed = pool.json(&["image", "rm", &reference]);
    assert_eq!(removed["removed"][0]["digest"], digest.as_str(), "{removed}");
    assert_eq!(pool.json(&["image", "ls"])["images"].as_array().map(Vec::len), Some(0));
    let again = pool.corral(&["image", "rm", &reference]);
    assert!(!again.status.success(), "nothing left to remove");

    // A `docker save` archive, sent through the coordinator to the node.
    let archive = dir.path().join("tools.tar");
    skopeo_copy(
        &format!("oci:{}:latest", image.display()),
        &format!("docker-archive:{}:lab/tools:2", archive.display()),
        &[],
    );
    let loaded = pool.json(&["image", "load", archive.to_str().expect("utf8")]);
    assert_eq!(loaded["failed"].as_array().map(Vec::len), Some(0), "{loaded}");
    assert_eq!(loaded["loaded"][0]["node"], node.as_str(), "{loaded}");
    let listed = pool.json(&["image", "ls"]);
    let names = listed["images"][0]["names"].to_string();
    assert!(names.contains("lab/tools:2"), "{listed}");

    // Bad input: one line, nothing lost.
    let missing = pool.corral(&["image", "load", dir.path().join("nothing.tar").to_str().expect("utf8")]);
    assert!(!missing.status.success());
    assert!(one_line_stderr(&missing).contains("nothing.tar"), "{}", one_line_stderr(&missing));
    let junk = dir.path().join("junk.tar");
    std::fs::write(&junk, b"not an archive").expect("junk");
    let bad = pool.corral(&["image", "load", junk.to_str().expect("utf8")]);
    assert!(!bad.status.success());
    assert_eq!(pool.json(&["image", "ls"])["images"].as_array().map(Vec::len), Some(1), "the loaded image stays");
}

#[test]
fn a_job_is_placed_on_the_node_that_holds_its_image() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[], "/", "placed");
    push(&image, &registry, "placed:1", &[]);
    let reference = format!("{}/placed:1", registry.addr);
    let pool = DevPool::start(&["--nodes", "2", "--gpus", "1"]);

    // Best fit alone would take the first node (both are idle and alike): the image is on the
    // second one.
    let out = pool.ok(&["image", "pull", &reference, "--node", "dev-node-2"]);
    assert!(out.contains("node dev-node-2: pulled"), "{out}");
    // Workers report their images every tenth heartbeat.
    std::thread::sleep(std::time::Duration::from_secs(6));
    let job = pool.submit(&["--gpus", "1", "--image", &reference, "--", "cat", "/etc/marker"]);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!(doc["node"], "dev-node-2", "{doc}");
    let listed = pool.json(&["image", "ls", "--node", "dev-node"]);
    assert_eq!(listed["images"].as_array().map(Vec::len), Some(0), "nothing was pulled on the other node: {listed}");
}

/// The parts of an image gang start together: the part whose node already holds the image
/// waits, unstarted, while the other part pulls it, then both run.
#[test]
fn an_image_gang_starts_only_once_every_part_has_its_image() {
    if !ready(&[TOOLS, &["runc"]].concat()) {
        return;
    }
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let image = umoci_busybox(dir.path(), &[], "/", "gang");
    push(&image, &registry, "gang:1", &[]);
    // About 1 MB of layers at 150 kB/s through the proxy: the first node pulls for seconds.
    let proxy = SlowProxy::start(&registry.addr, 150_000);
    let reference = format!("{}/gang:1", proxy.addr);
    let pool = DevPool::start(&["--nodes", "2", "--gpus", "1"]);
    let out = pool.ok(&["image", "pull", &format!("{}/gang:1", registry.addr), "--node", "dev-node-2"]);
    assert!(out.contains("node dev-node-2: pulled"), "{out}");
    let job = pool.submit(&["--nodes", "2", "--gpus-per-node", "1", "--image", &reference, "--", "cat", "/etc/marker"]);
    pool.wait_for(job, "a pulling reason", |d| d["reason"].as_str().is_some_and(|r| r.contains(" layers, ")));
    // dev-node-2 had the image all along: alone, its part would have started at once.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let doc = pool.show(job);
    assert!(doc["reason"].as_str().is_some_and(|r| r.contains("pulling image")), "still pulling: {doc}");
    assert!(doc["started_at"].is_null(), "no part starts before every part has its image: {doc}");
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert!(pool.ok(&["logs", &job.to_string()]).contains("gang"));
}
