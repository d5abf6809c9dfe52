//! Start of a job from a cached registry image against a bare process job and against `runc run`
//! of the same image unpacked as a bundle: the wall time of `corral run -- true` (submit,
//! placement, launch, exit, the reply) with and without `--image REF` (its image already in the
//! worker's store), and of `runc run` of the bundle `umoci unpack` makes of the same image with
//! `true` as its process. Samples alternate; medians are printed, and the image job's median
//! over the bare one's (goal: at most 100 ms more).
//!
//! Run (as root, with docker-registry, skopeo, umoci and runc installed):
//! `cargo build -p corral-cli && cargo bench -p corral-integration --bench images`
//! Knobs: `CORRAL_BENCH_SAMPLES` (default 10), `CORRAL_BIN` (the `corral` binary).

use corral_integration::registry::{push, ready, umoci_busybox, TestRegistry};
use corral_integration::{corral_bin, DevPool};
use std::process::Command;
use std::time::{Duration, Instant};

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn timed(command: &mut Command) -> Duration {
    let started = Instant::now();
    let out = command.output().expect("spawn");
    let took = started.elapsed();
    assert!(out.status.success(), "{command:?}: {}", String::from_utf8_lossy(&out.stderr));
    took
}

fn main() {
    if !ready(&["docker-registry", "skopeo", "umoci", "runc"]) {
        return;
    }
    let samples: usize = std::env::var("CORRAL_BENCH_SAMPLES").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let registry = TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let layout = umoci_busybox(dir.path(), &[], "/", "bench");
    push(&layout, &registry, "start:1", &[]);
    let reference = format!("{}/start:1", registry.addr);

    // The same image as a runc bundle, its process `true`.
    let bundle = dir.path().join("bundle");
    let status = Command::new("umoci")
        .args(["unpack", "--image", &format!("{}:latest", layout.display())])
        .arg(&bundle)
        .status()
        .expect("umoci");
    assert!(status.success());
    let config_path = bundle.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).expect("config")).expect("json");
    config["process"]["args"] = serde_json::json!(["/bin/true"]);
    config["process"]["terminal"] = serde_json::json!(false);
    std::fs::write(&config_path, serde_json::to_vec(&config).expect("json")).expect("write");

    let pool = DevPool::start(&["--gpus", "1"]);
    // Warm-up: the image into the store, and one of each.
    pool.ok(&["run", "--image", &reference, "--", "true"]);
    pool.ok(&["run", "--", "true"]);
    let corral = |args: &[&str]| {
        let mut command = Command::new(corral_bin());
        command.args(["--endpoint", &pool.addr]).args(args);
        command
    };
    let (mut bare, mut image, mut runc) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..samples {
        let mut bare_run = corral(&["run", "--", "true"]);
        let mut image_run = corral(&["run", "--image", &reference, "--", "true"]);
        let mut runc_run = Command::new("runc");
        runc_run.args(["run", "-b"]).arg(&bundle).arg(format!("corral-bench-{i}"));
        if i % 2 == 0 {
            bare.push(timed(&mut bare_run));
            image.push(timed(&mut image_run));
        } else {
            image.push(timed(&mut image_run));
            bare.push(timed(&mut bare_run));
        }
        runc.push(timed(&mut runc_run));
    }
    let (b, m, r) = (median(bare.clone()), median(image.clone()), median(runc.clone()));
    println!("samples: {samples} each");
    println!("corral run -- true (bare process):           median {b:.1?}  runs {bare:.0?}");
    println!("corral run --image REF -- true (cached):     median {m:.1?}  runs {image:.0?}");
    println!("runc run of the same image's bundle (true):  median {r:.1?}  runs {runc:.0?}");
    println!(
        "cached image job over bare process job: {:+.1} ms (goal <= +100 ms); runc run alone: {:.1} ms",
        (m.as_secs_f64() - b.as_secs_f64()) * 1e3,
        r.as_secs_f64() * 1e3
    );
}
