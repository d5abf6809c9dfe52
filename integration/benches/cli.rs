//! Command-line benchmark: what a user or a script waits for per `corral` process against an idle
//! `corral dev` pool: the start of a client command (`corral --version`), submits one at a time
//! (`corral sbatch --hold` of a small script, one process after the other, as a submit loop in a
//! shell runs them), and `corral queue` over 1000 pending jobs. Every figure is the wall time of
//! whole processes, start to exit; the submits are held so that no job runs beside the
//! measurement.
//!
//! Run: `cargo build --release -p corral-cli && cargo bench -p corral-integration --bench cli`
//! Knobs: `CORRAL_BENCH_ONLY=start|submit|queue` runs one phase; `CORRAL_BENCH_SAMPLES`
//! (processes per figure, default 300), `CORRAL_BENCH_PENDING` (jobs in the queue, default 1000),
//! `CORRAL_BENCH_BASELINE` (a second `corral` binary measured in turns with the first, against
//! the same pools: a before and after on one host under one load), `CORRAL_BENCH_SLURM=1`
//! (Slurm's `sbatch --hold` and `squeue` measured in turns with corral's, against the Slurm
//! that `SLURM_CONF` names: `scripts/slurm-local.sh start DIR` starts one on this host).
//!
//! The queued jobs carry the bench's own environment, as `corral sbatch` sends its caller's (and
//! Slurm's `sbatch` exports it too).

use corral_client::{Client, ClientConfig};
use corral_integration::DevPool;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// One process's wall time, start to exit, and the CPU time it used (user and system).
struct Run {
    wall: Duration,
    cpu: Duration,
}

/// Median, p10 and p90 of the wall times of `runs`, how many such processes run per second back
/// to back, and the median CPU time of one (the figure least moved by other load on the host).
fn summary(runs: &[Run]) -> String {
    let mut wall: Vec<Duration> = runs.iter().map(|r| r.wall).collect();
    let mut cpu: Vec<Duration> = runs.iter().map(|r| r.cpu).collect();
    wall.sort();
    cpu.sort();
    let total: Duration = wall.iter().sum();
    format!(
        "wall median {:>8.2?}  p10 {:>8.2?}  p90 {:>8.2?}  {:>5.0}/s  cpu median {:>8.2?}  (n={})",
        percentile(&wall, 0.5),
        percentile(&wall, 0.1),
        percentile(&wall, 0.9),
        wall.len() as f64 / total.as_secs_f64(),
        percentile(&cpu, 0.5),
        wall.len()
    )
}

/// Runs `bin args` once with stdout to /dev/null; reaps it with `wait4` for its CPU time.
fn run_once(bin: &Path, args: &[&str]) -> Run {
    let started = Instant::now();
    // Reaped below by `wait4` on its pid (for its rusage), which clippy cannot see.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(bin).args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start corral");
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, writing into the two locals.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    let wall = started.elapsed();
    assert_eq!(pid, child.id() as libc::pid_t, "wait4: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{} {args:?} failed (status {status}): run it by hand to see why",
        bin.display()
    );
    let time = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    Run { wall, cpu: time(usage.ru_utime) + time(usage.ru_stime) }
}

/// The binaries measured: the one under test, then `CORRAL_BENCH_BASELINE` if set.
fn binaries() -> Vec<PathBuf> {
    let mut bins = vec![corral_integration::corral_bin()];
    bins.extend(std::env::var_os("CORRAL_BENCH_BASELINE").map(PathBuf::from));
    bins
}

/// A program measured with its arguments, under a name.
struct Contestant {
    name: String,
    program: PathBuf,
    args: Vec<String>,
}

/// Each corral binary with `args`, then Slurm's `program slurm_args` when `CORRAL_BENCH_SLURM`
/// is set.
fn contestants(args: &[&str], slurm: Option<(&str, &[&str])>) -> Vec<Contestant> {
    let mut all: Vec<Contestant> = binaries()
        .into_iter()
        .map(|bin| Contestant {
            name: bin.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            program: bin,
            args: args.iter().map(|a| a.to_string()).collect(),
        })
        .collect();
    if let Some((program, args)) = slurm.filter(|_| with_slurm()) {
        all.push(Contestant {
            name: format!("slurm {program}"),
            program: program.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
        });
    }
    all
}

/// `CORRAL_BENCH_SLURM=1`: Slurm's commands are measured beside corral's.
fn with_slurm() -> bool {
    std::env::var("CORRAL_BENCH_SLURM").is_ok_and(|v| v == "1")
}

/// Runs each contestant `samples` times, one process after the other, after a few unmeasured
/// runs; they take turns every ten runs, so that a change in the load of the host falls on
/// each alike. Prints one line per contestant.
fn measure(what: &str, contestants: &[Contestant], samples: usize) {
    let mut runs: Vec<Vec<Run>> = contestants.iter().map(|_| Vec::with_capacity(samples)).collect();
    let once = |c: &Contestant| run_once(&c.program, &c.args.iter().map(String::as_str).collect::<Vec<_>>());
    for c in contestants {
        for _ in 0..10 {
            once(c);
        }
    }
    while runs[0].len() < samples {
        for (c, runs) in contestants.iter().zip(&mut runs) {
            for _ in 0..10.min(samples - runs.len()) {
                runs.push(once(c));
            }
        }
    }
    for (c, runs) in contestants.iter().zip(&runs) {
        println!("{what:<40} {:<14} {}", c.name, summary(runs));
    }
}

/// The environment a submit from the bench's shell sends: its own variables.
fn caller_env() -> std::sync::Arc<std::collections::BTreeMap<String, String>> {
    std::sync::Arc::new(std::env::vars().collect())
}

/// Cancels every Slurm job of this user (the held ones a phase left).
fn slurm_cancel_all() {
    if with_slurm() {
        let status = Command::new("scancel").args(["--user", "root"]).status().expect("scancel");
        assert!(status.success(), "scancel failed");
        // scancel returns before slurmctld has purged them from squeue's view.
        for _ in 0..100 {
            let out = Command::new("squeue").args(["-h", "-t", "PD"]).output().expect("squeue");
            if out.stdout.is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn start_phase(samples: usize) {
    measure("corral --version", &contestants(&["--version"], Some(("sbatch", &["--version"]))), samples);
    measure("corral submit --help", &contestants(&["submit", "--help"], None), samples);
}

fn submit_phase(samples: usize) {
    let pool = DevPool::start(&["--gpus", "8"]);
    let script = pool.data_dir.join("job.sbatch");
    // The script Slurm's `sbatch --hold` takes as it is, for a comparison on one host.
    std::fs::write(&script, "#!/bin/sh\n#SBATCH --job-name=bench\ntrue\n").expect("write script");
    let script = script.display().to_string();
    slurm_cancel_all();
    let runs =
        contestants(&["--endpoint", &pool.addr, "sbatch", "--hold", &script], Some(("sbatch", &["--hold", &script])));
    measure("corral sbatch --hold, one at a time", &runs, samples);
    slurm_cancel_all();
}

fn queue_phase(samples: usize, pending: usize) {
    let pool = DevPool::start(&["--gpus", "8"]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let client = Client::new(ClientConfig::new(vec![pool.addr.clone()])).expect("client");
    let env = caller_env();
    println!("queued jobs carry {} environment variables each", env.len());
    let specs: Vec<(String, corral_types::JobSpec)> = (0..pending)
        .map(|i| {
            let mut spec = corral_integration::trivial_job(&format!("queued-{i}"));
            spec.gpus = 1;
            spec.sched.hold = true;
            spec.env = env.clone();
            (format!("queue-bench-{}-{i}", std::process::id()), spec)
        })
        .collect();
    for chunk in specs.chunks(500) {
        let results = rt.block_on(client.submit_batch(chunk)).expect("batch submit");
        assert!(results.iter().all(Result::is_ok), "every held job is accepted: {results:?}");
    }
    slurm_cancel_all();
    if with_slurm() {
        let script = pool.data_dir.join("queued.sbatch");
        std::fs::write(&script, "#!/bin/sh\n#SBATCH --job-name=queued\ntrue\n").expect("write script");
        for _ in 0..pending {
            let out = Command::new("sbatch").arg("--hold").arg(&script).output().expect("sbatch");
            assert!(out.status.success(), "sbatch: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    let queue = contestants(&["--endpoint", &pool.addr, "queue"], Some(("squeue", &[])));
    measure(&format!("corral queue, {pending} pending"), &queue, samples);
    let json = contestants(&["--endpoint", &pool.addr, "--output", "json", "queue"], Some(("squeue", &["--json"])));
    measure(&format!("corral queue -o json, {pending} pending"), &json, samples);
    slurm_cancel_all();
}

fn main() {
    for bin in binaries() {
        assert!(bin.exists(), "{} not found: cargo build --release -p corral-cli", bin.display());
    }
    let only = std::env::var("CORRAL_BENCH_ONLY").unwrap_or_default();
    let samples: usize = env_or("CORRAL_BENCH_SAMPLES", 300);
    let pending: usize = env_or("CORRAL_BENCH_PENDING", 1000);
    for bin in binaries() {
        println!("binary: {}", bin.display());
    }
    if only.is_empty() || only == "start" {
        start_phase(samples);
    }
    if only.is_empty() || only == "submit" {
        submit_phase(samples);
    }
    if only.is_empty() || only == "queue" {
        queue_phase(samples, pending);
    }
}
