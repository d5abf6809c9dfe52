//! First pull of a ~200 MB multi-layer image from a distribution registry on loopback: corral's
//! pull (download, verify, unpack into the store) against `skopeo copy` of the same image to a
//! local directory (download and verify only), medians of a few runs each, alternating. Then
//! ten pulls of the uncached image arriving at once on one node (the bytes the registry served
//! against the image's size), and the start of a job root from a cached image (pin, cache-hit
//! pull, overlay mount, removal).
//!
//! Run (as root, with docker-registry and skopeo installed):
//! `cargo bench -p corral-image --bench pull`; `CORRAL_PULL_RUNS` sets the runs (default 3),
//! `CORRAL_PULL_MB` the image's size (default 200), `CORRAL_PULL_DOWNLOADS` corral's
//! `max-concurrent-downloads` (default 3, the setting's default and Docker's).

#[allow(dead_code)]
#[path = "../tests/it/support.rs"]
mod support;

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use corral_image::{ImageRef, PullProgress};
use support::*;

/// User and system CPU time of this process (`who` = `RUSAGE_SELF`) or of its waited-for
/// children (`RUSAGE_CHILDREN`).
fn cpu(who: libc::c_int) -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    time(usage.ru_utime) + time(usage.ru_stime)
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Text that compresses about as source trees and Python packages do.
fn text(len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut i = seed;
    while out.len() < len {
        writeln!(out, "def function_{i}(x, y):\n    return x * {} + y - {}  # line {i}", i % 97, i % 13)
            .expect("write");
        i += 1;
    }
    out.truncate(len);
    out
}

fn main() {
    if !ready(&["docker-registry", "skopeo"]) {
        return;
    }
    let runs: usize = std::env::var("CORRAL_PULL_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let total_mb: usize = std::env::var("CORRAL_PULL_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let downloads: usize = std::env::var("CORRAL_PULL_DOWNLOADS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let registry = TestRegistry::start();
    let work = tempfile::tempdir().expect("tempdir");

    // Six layers, largest first, as images are built (base OS, toolkits, the application): files
    // of 1 MiB, three quarters incompressible (wheels, shared objects), one quarter text.
    let started = Instant::now();
    let shares = [30, 25, 20, 12, 8, 5];
    let mut layers = Vec::new();
    for (n, share) in shares.iter().enumerate() {
        let files = (total_mb * share / 100).max(1);
        let contents: Vec<(String, Vec<u8>)> = (0..files)
            .map(|f| {
                let seed = (n * 10_000 + f) as u64;
                let data = if f % 4 == 3 { text(1 << 20, seed) } else { noise(1 << 20, seed) };
                (format!("layer{n}/file{f}"), data)
            })
            .collect();
        let dir = format!("layer{n}");
        let mut entries = vec![Entry::Dir(&dir)];
        entries.extend(contents.iter().map(|(path, data)| Entry::File(path, data)));
        layers.push((tar(&entries), Compress::Gzip));
    }
    let layout = work.path().join("layout");
    let manifest = write_layout(&layout, "t", &[ImageSpec { layers, ..ImageSpec::default() }]);
    skopeo_copy(&format!("oci:{}:t", layout.display()), &format!("docker://{}/bench:1", registry.addr), &[]);
    let blobs = layout_layers(&layout, &manifest);
    let bytes: u64 = blobs.iter().map(|d| std::fs::metadata(registry.blob_file(d)).expect("blob").len()).sum();
    let mb = bytes as f64 / 1e6;
    println!("image: {} layers, {mb:.1} MB compressed (built and pushed in {:.1?})", blobs.len(), started.elapsed());
    let image = ImageRef::parse(&format!("{}/bench:1", registry.addr)).expect("reference");

    let (mut corral, mut skopeo) = (Vec::new(), Vec::new());
    let (mut corral_cpu, mut skopeo_cpu) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let order: [bool; 2] = if run % 2 == 0 { [true, false] } else { [false, true] };
        for corral_first in order {
            if corral_first {
                let node = node(u64::MAX, registry_config(), downloads);
                let (started, cpu_before) = (Instant::now(), cpu(libc::RUSAGE_SELF));
                rt.block_on(node.images.pull(&image, &PullProgress::new())).expect("pull");
                corral.push(started.elapsed());
                corral_cpu.push(cpu(libc::RUSAGE_SELF) - cpu_before);
            } else {
                let dest = work.path().join(format!("skopeo-{run}"));
                let (started, cpu_before) = (Instant::now(), cpu(libc::RUSAGE_CHILDREN));
                let status = Command::new("skopeo")
                    .args(["copy", "--quiet", "--src-tls-verify=false"])
                    .arg(format!("docker://{}/bench:1", registry.addr))
                    .arg(format!("dir:{}", dest.display()))
                    .status()
                    .expect("skopeo");
                skopeo.push(started.elapsed());
                skopeo_cpu.push(cpu(libc::RUSAGE_CHILDREN) - cpu_before);
                assert!(status.success());
                std::fs::remove_dir_all(&dest).expect("remove");
            }
        }
    }
    let (c, s) = (median(corral.clone()), median(skopeo.clone()));
    println!("corral's max-concurrent-downloads: {downloads}");
    println!(
        "corral pull (download + verify + unpack): median {c:.2?} = {:.0} MB/s  runs {corral:.2?}",
        mb / c.as_secs_f64()
    );
    println!(
        "skopeo copy to dir (download + verify):   median {s:.2?} = {:.0} MB/s  runs {skopeo:.2?}",
        mb / s.as_secs_f64()
    );
    println!("corral throughput / skopeo throughput: {:.2}x (goal >= 0.9x)", s.as_secs_f64() / c.as_secs_f64());
    println!(
        "CPU time (user + system): corral median {:.2?}, skopeo median {:.2?} (the registry's own not counted)",
        median(corral_cpu),
        median(skopeo_cpu)
    );

    // Ten jobs of the uncached image at once on one node.
    // Each run fetched every blob twice (corral, skopeo).
    let before: u64 = registry.wait_blob_bytes(&blobs, 2 * runs).iter().sum();
    let node = node(u64::MAX, registry_config(), 3);
    let started = Instant::now();
    rt.block_on(async {
        let pulls: Vec<_> = (0..10)
            .map(|_| {
                let (images, image) = (node.images.clone(), image.clone());
                tokio::spawn(async move { images.pull(&image, &PullProgress::new()).await })
            })
            .collect();
        for pull in pulls {
            pull.await.expect("task").expect("pull");
        }
    });
    let fetched: u64 = registry.wait_blob_bytes(&blobs, 2 * runs + 1).iter().sum::<u64>() - before;
    println!(
        "10 pulls at once: {:.1} MB of layers fetched for a {mb:.1} MB image ({:.2}x), all done in {:.2?}",
        fetched as f64 / 1e6,
        fetched as f64 / bytes as f64,
        started.elapsed()
    );

    // A job root from the cached image.
    let pinned = rt.block_on(node.images.registry().resolve(&image)).expect("resolve");
    let mut starts = Vec::new();
    for i in 0..50 {
        let started = Instant::now();
        let pin = node.images.pin(&pinned).expect("pin");
        rt.block_on(node.images.pull(&pinned, &PullProgress::new())).expect("cached");
        let root = node.images.mount(&pin, &format!("bench-{i}")).expect("mount");
        starts.push(started.elapsed());
        root.remove().expect("remove");
    }
    println!("cached image job root (pin, cache-hit pull, overlay mount): median {:.2?} of 50", median(starts));
}
