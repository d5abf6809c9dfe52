//! `srun` step launch benchmark: inside a 2-node batch job (a coordinator and two workers on
//! loopback, as the integration tests run them), `srun` of 4 tasks (2 a node), timed from just
//! before `srun` starts until the last of its 4 tasks runs (each task's first command records
//! the time; the nodes share this machine's clock), and a whole `srun hostname` (4 tasks), from
//! just before `srun` starts until it exited: a step's start to its end as the script sees it.
//! The first samples are warm-up.
//!
//! Run: `cargo build --release -p corral-cli && cargo bench -p corral-integration --bench srun`
//! Knobs: `CORRAL_BENCH_SAMPLES` (timed `srun`s, default 20), `CORRAL_BIN` (the `corral` binary),
//! `CORRAL_BENCH_SLURM=1` (the same script under Slurm's `sbatch` too, on the Slurm that
//! `SLURM_CONF` names: `scripts/slurm-local.sh start DIR` starts a one-node one here, so its 4
//! tasks run on one node).

use corral_integration::cluster::free_port;
use corral_integration::worker::two_node_pool;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

const WARMUP: usize = 3;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Nanoseconds since the epoch, as `date +%s%N` wrote them into `path`.
fn stamp(path: &Path) -> u128 {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim().parse().unwrap_or_else(|_| panic!("{}: not a time: {text:?}", path.display()))
}

fn main() {
    let samples: usize = env_or("CORRAL_BENCH_SAMPLES", 20);
    let (cluster, _workers, dir) = two_node_pool(free_port());
    let runs = WARMUP + samples;
    let corral_out = dir.path().join("corral");
    let script = bench_script(&corral_out, runs);
    let submitted = cluster.corral_at(0, &["sbatch", &script.display().to_string()]);
    assert!(submitted.status.success(), "sbatch: {}", String::from_utf8_lossy(&submitted.stderr));
    let job: u64 = String::from_utf8_lossy(&submitted.stdout).trim().parse().expect("a job id");
    let done = cluster
        .wait_for(job, Duration::from_secs(600), "ended", |d| d["state"] != "pending" && d["state"] != "running");
    assert_eq!(
        done["state"],
        "succeeded",
        "{done}\n{}",
        std::fs::read_to_string(corral_out.join(format!("slurm-{job}.out"))).unwrap_or_default()
    );
    report("corral: srun of 4 tasks on 2 nodes", &corral_out, runs);
    if std::env::var("CORRAL_BENCH_SLURM").is_ok_and(|v| v == "1") {
        let slurm_out = dir.path().join("slurm");
        let script = bench_script(&slurm_out, runs);
        // One node here: the 4 tasks on it (the command line overrides the script's directives).
        let submitted = std::process::Command::new("sbatch")
            .args(["--parsable", "--nodes=1", "--ntasks-per-node=4"])
            .arg(&script)
            .output()
            .expect("Slurm's sbatch");
        assert!(submitted.status.success(), "sbatch: {}", String::from_utf8_lossy(&submitted.stderr));
        let job = String::from_utf8_lossy(&submitted.stdout).trim().to_string();
        let started = std::time::Instant::now();
        loop {
            let queued = std::process::Command::new("squeue").args(["-h", "-j", &job]).output().expect("squeue");
            if queued.stdout.is_empty() {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(600), "Slurm job {job} did not end in 600 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        report("slurm: srun of 4 tasks on 1 node", &slurm_out, runs);
    }
}

/// The batch script: `runs` times, `srun` of a command that stamps the time in each task, and a
/// whole `srun hostname`; stamps before and after in `out` (made writable for the job's user).
fn bench_script(out: &Path, runs: usize) -> std::path::PathBuf {
    std::fs::create_dir_all(out).expect("mkdir");
    std::fs::set_permissions(out, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let script = out.join("bench.sbatch");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             #SBATCH --nodes=2\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             i=0\n\
             while [ $i -lt {runs} ]; do\n\
             i=$((i + 1))\n\
             date +%s%N > {out}/start-$i\n\
             srun sh -c \"date +%s%N > {out}/run-$i-\\$SLURM_PROCID\" || exit 1\n\
             date +%s%N > {out}/hostname-start-$i\n\
             srun hostname > /dev/null || exit 1\n\
             date +%s%N > {out}/hostname-end-$i\n\
             done\n",
            out = out.display()
        ),
    )
    .expect("write");
    script
}

/// Prints the two figures from the stamps a run of [`bench_script`] left in `out`.
fn report(what: &str, out: &Path, runs: usize) {
    let mut all: Vec<Duration> = (WARMUP + 1..=runs)
        .map(|i| {
            let start = stamp(&out.join(format!("start-{i}")));
            let last = (0..4).map(|t| stamp(&out.join(format!("run-{i}-{t}")))).max().expect("4 tasks");
            Duration::from_nanos(last.saturating_sub(start) as u64)
        })
        .collect();
    all.sort();
    let mut whole: Vec<Duration> = (WARMUP + 1..=runs)
        .map(|i| {
            let start = stamp(&out.join(format!("hostname-start-{i}")));
            let end = stamp(&out.join(format!("hostname-end-{i}")));
            Duration::from_nanos(end.saturating_sub(start) as u64)
        })
        .collect();
    whole.sort();
    println!(
        "{what}, srun start to every task running: median {:.1?}  p90 {:.1?}  min {:.1?}  max {:.1?}  (n={})",
        percentile(&all, 0.5),
        percentile(&all, 0.9),
        percentile(&all, 0.0),
        percentile(&all, 1.0),
        all.len()
    );
    println!(
        "{what}, srun hostname, srun start to its exit: median {:.1?}  p90 {:.1?}  min {:.1?}  max {:.1?}  (n={})",
        percentile(&whole, 0.5),
        percentile(&whole, 0.9),
        percentile(&whole, 0.0),
        percentile(&whole, 1.0),
        whole.len()
    );
}
