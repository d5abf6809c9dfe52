//! Every fenced block of README.md runs as written, or is excluded with its reason in one
//! table (`README_BLOCKS`, checked against the README's blocks by count and first line, so a
//! new block fails the tests until it is run or excluded). `sh` blocks run line by line
//! through `sh`, with the `corral` under test first in PATH, against real processes: the
//! `corral dev` pools the "Try it" blocks start themselves (their `cargo run ... -- dev` or
//! `corral dev ...` lines start one on a free port, with a data dir of the test's: the rest of
//! the line's flags as written), or the coordinators, workers and pools a block's own lines or
//! text name, with their fixed ports and paths substituted by free ports and temp dirs. The
//! job programs the examples name (`train.py`, `./urgent.sh`, `torchrun`...) are trivial
//! stand-ins. Every line must exit 0; every job a block submitted must end as the README says.
//! `toml` blocks are given to a real coordinator; the Python example runs with `CORRAL_PYTHON`.

use corral_integration::cluster::free_port;
use corral_integration::{corral_bin, DevPool};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Lines not run (matched by prefix), with why. Keep it empty where possible.
const SKIPPED: &[(&str, &str)] = &[];

/// Commands that run until Ctrl-C: run for two seconds, then interrupted; they pass if they
/// had not ended with an error by then.
const UNTIL_INTERRUPTED: &[&str] = &["corral top"];

/// Stand-ins for the programs the examples run.
const STAND_INS: &[&str] =
    &["train.py", "sweep.py", "eval.py", "urgent.sh", "train.sh", "infer.sh", "ckpt.sh", "alert.sh", "nightly.sh"];

/// How long one line may take.
const LINE_LIMIT: Duration = Duration::from_secs(90);

/// The commands of each `sh` block of the section `heading` (`## Try it`): backslash
/// continuations joined, blank lines left out.
fn section_blocks(readme: &str, heading: &str) -> Vec<Vec<String>> {
    let start = readme.find(&format!("\n{heading}\n")).unwrap_or_else(|| panic!("README has no '{heading}'"));
    let rest = &readme[start + heading.len() + 2..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    let mut pending = String::new();
    for line in section.lines() {
        match (&mut current, line.trim_start()) {
            (None, "```sh") => current = Some(Vec::new()),
            (Some(_), "```") => blocks.push(current.take().expect("in a block")),
            (Some(block), text) => {
                if let Some(head) = text.strip_suffix('\\') {
                    pending.push_str(head);
                    continue;
                }
                pending.push_str(text);
                if !pending.trim().is_empty() {
                    block.push(std::mem::take(&mut pending));
                }
                pending.clear();
            }
            (None, _) => {}
        }
    }
    assert!(current.is_none(), "an unterminated block in '{heading}'");
    blocks
}

/// The flags of a line that starts a dev pool (`cargo run ... -- dev FLAGS`, `corral dev FLAGS`).
fn dev_flags(line: &str) -> Option<Vec<String>> {
    let code = line.split(" #").next().unwrap_or_default();
    let words: Vec<&str> = code.split_whitespace().collect();
    let at = match words.as_slice() {
        ["corral", "dev", ..] => 2,
        ["cargo", "run", ..] => words.iter().position(|w| *w == "--").filter(|i| words.get(i + 1) == Some(&"dev"))? + 2,
        _ => return None,
    };
    Some(words[at..].iter().map(|w| w.to_string()).collect())
}

fn write_stand_ins(dir: &Path) {
    for name in STAND_INS {
        let text = if name.ends_with(".py") {
            format!("print('{name}: done')\n")
        } else {
            format!("#!/bin/sh\necho \"{name} on $CORRAL_NODE with GPUs $CUDA_VISIBLE_DEVICES\"\n")
        };
        let path = dir.join(name);
        std::fs::write(&path, text).expect("stand-in");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
}

/// PATH for the examples: the `corral` under test first, and a `python` that runs python3
/// where the machine has no `python` (the examples say `python train.py`).
fn example_path(tmp: &Path) -> String {
    let bin_dir = corral_bin().parent().expect("bin dir").to_path_buf();
    let mut path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    // A `python` the jobs' users can run too (a root-only one, e.g. pyenv's, is not theirs).
    let has_python = Path::new("/usr/bin/python").exists();
    if !has_python {
        let shim_dir = tmp.join("python-shim");
        std::fs::create_dir_all(&shim_dir).expect("shim dir");
        let shim = shim_dir.join("python");
        std::fs::write(&shim, "#!/bin/sh\nexec python3 \"$@\"\n").expect("python shim");
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path = format!("{}:{path}", shim_dir.display());
    }
    path
}

/// Runs `line` through `sh` in `dir` with `env`, its output kept in files under `out`;
/// returns (exit ok, stdout, stderr).
fn run_line(line: &str, dir: &Path, env: &[(String, String)], out: &Path) -> (bool, String, String) {
    let until_interrupted = UNTIL_INTERRUPTED.iter().any(|c| line.starts_with(c));
    let out_file = out.join("line.out");
    let err_file = out.join("line.err");
    let mut child = Command::new("sh")
        .args(["-c", line])
        .current_dir(dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        // Its own process group: an interrupt or a kill reaches the command under `sh` too.
        .process_group(0)
        .stdout(std::fs::File::create(&out_file).expect("stdout file"))
        .stderr(std::fs::File::create(&err_file).expect("stderr file"))
        .spawn()
        .expect("spawn sh");
    let limit = if until_interrupted { Duration::from_secs(2) } else { LINE_LIMIT };
    let status = corral_integration::wait_until(&mut child, Instant::now() + limit);
    let group = child.id() as libc::pid_t;
    let signal_group = |signal| {
        // SAFETY: kill(2) of our own child's process group.
        unsafe { libc::kill(-group, signal) };
    };
    let ok = match status {
        Some(status) => status.success(),
        None if until_interrupted => {
            signal_group(libc::SIGINT);
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().expect("wait").is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            // Ended by the interrupt, as Ctrl-C ends it.
            let ended = child.try_wait().expect("wait").is_some();
            signal_group(libc::SIGKILL);
            let _ = child.wait();
            ended
        }
        None => {
            signal_group(libc::SIGKILL);
            let _ = child.wait();
            false
        }
    };
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    (ok, read(&out_file), read(&err_file))
}

#[test]
fn every_try_it_example_of_the_readme_runs_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let blocks = section_blocks(&readme, "## Try it");
    assert!(blocks.len() >= 3, "the Try it section lost its examples: {blocks:?}");
    let tmp = tempfile::tempdir().expect("tempdir");
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    write_stand_ins(&work);
    let bin = corral_bin();
    let path = example_path(tmp.path());

    let mut pool: Option<DevPool> = None;
    let mut pools = 0;
    let mut ran = 0;
    for block in &blocks {
        let mut jobs: Vec<u64> = Vec::new();
        for line in block {
            if let Some((_, why)) = SKIPPED.iter().find(|(prefix, _)| line.starts_with(prefix)) {
                eprintln!("SKIPPED README line `{line}`: {why}");
                continue;
            }
            if let Some(flags) = dev_flags(line) {
                drop(pool.take());
                pools += 1;
                let data_dir = tmp.path().join(format!("pool-{pools}"));
                let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
                pool = Some(DevPool::start_in(&data_dir, &flags));
                ran += 1;
                continue;
            }
            let mut env = vec![("PATH".to_string(), path.clone())];
            let mut dir: PathBuf = work.clone();
            if line.starts_with("./scripts/") {
                // The quickstart builds nothing and starts its own pool, on a free port.
                dir = root.clone();
                env.push(("CORRAL_BIN".into(), bin.display().to_string()));
                env.push(("CORRAL_ENDPOINT".into(), format!("127.0.0.1:{}", free_port())));
                env.push(("CORRAL_DATA_DIR".into(), tmp.path().join("quickstart").display().to_string()));
            } else {
                let pool = pool.as_ref().unwrap_or_else(|| panic!("`{line}` comes before any pool was started"));
                env.push(("CORRAL_ENDPOINT".into(), pool.addr.clone()));
            }
            eprintln!("README line: {line}");
            let (ok, stdout, stderr) = run_line(line, &dir, &env, tmp.path());
            let logs = pool.as_ref().map(DevPool::logs).unwrap_or_default();
            assert!(ok, "README line `{line}` failed:\nstdout: {stdout}\nstderr: {stderr}\npool log:\n{logs}");
            if line.starts_with("corral submit") {
                let id = stdout.trim().parse().unwrap_or_else(|_| panic!("`{line}` printed no job id: {stdout}"));
                jobs.push(id);
            }
            ran += 1;
        }
        // Every job the block submitted runs to success (a stand-in ends at once).
        if let Some(pool) = &pool {
            for job in jobs {
                let doc = pool.wait_for(job, "ended", |d| {
                    ["succeeded", "failed", "cancelled", "timeout"].contains(&d["state"].as_str().unwrap_or_default())
                });
                let output = pool.corral(&["logs", &job.to_string()]);
                assert_eq!(
                    doc["state"],
                    "succeeded",
                    "job {job} of the README: {doc}\noutput: {}",
                    String::from_utf8_lossy(&output.stdout)
                );
            }
        }
    }
    assert!(pools >= 2 && ran > 15, "ran {ran} lines on {pools} pools: the README's blocks changed shape?");
}

/// The text of the `sh` block of README.md that starts with `first_line`.
fn block_starting_with(readme: &str, first_line: &str) -> String {
    let start =
        readme.find(&format!("```sh\n{first_line}")).unwrap_or_else(|| panic!("no README block starts `{first_line}`"));
    let body = &readme[start + "```sh\n".len()..];
    body[..body.find("\n```").expect("an unterminated block")].to_string()
}

/// "Coming from Slurm": the `#SBATCH` script example runs as one script, as written (its
/// heredoc spans lines), and its job's output lands in the `--output` file it names.
#[test]
fn the_readme_sbatch_example_runs_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let script = block_starting_with(&readme, "cat > train.sbatch <<'EOF'");
    let pool = DevPool::start(&[]);
    let tmp = tempfile::tempdir().expect("tempdir");
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    write_stand_ins(&work);
    let path = example_path(tmp.path());
    let env = [("PATH".to_string(), path), ("CORRAL_ENDPOINT".to_string(), pool.addr.clone())];
    let (ok, stdout, stderr) = run_line(&format!("set -e\n{script}"), &work, &env, tmp.path());
    assert!(ok, "the sbatch example failed:\nstdout: {stdout}\nstderr: {stderr}\npool log:\n{}", pool.logs());
    assert!(stdout.contains("train.py: done"), "`corral logs -f` printed the job's output: {stdout}");
    let outputs: Vec<_> = std::fs::read_dir(work.join("logs")).expect("logs/").filter_map(Result::ok).collect();
    assert_eq!(outputs.len(), 1, "one output file in logs/");
    let name = outputs[0].file_name().to_string_lossy().into_owned();
    assert!(name.starts_with("resnet-") && name.ends_with(".out"), "--output=logs/%x-%j.out: {name}");
}

#[test]
fn readme_blocks_are_read_line_by_line_with_continuations() {
    let text = "x\n## Try it\n\n```sh\na \\\n  b   # c\n\nd\n```\nprose\n```sh\ncargo run -p corral-cli -- dev --nodes 2\n```\n## Next\n```sh\nnot\n```\n";
    let blocks = section_blocks(text, "## Try it");
    assert_eq!(
        blocks,
        vec![vec!["a b   # c".to_string(), "d".into()], vec!["cargo run -p corral-cli -- dev --nodes 2".into()]]
    );
    assert_eq!(dev_flags(&blocks[1][0]), Some(vec!["--nodes".to_string(), "2".into()]));
    assert_eq!(dev_flags("corral dev   # a pool"), Some(vec![]));
    assert_eq!(dev_flags("corral devices"), None);
    assert_eq!(dev_flags("corral submit -- dev"), None);
}

/// A fenced block of README.md: its language, the heading above it, its text (dedented by the
/// fence's indentation) and its first line.
#[derive(Debug)]
struct Fenced {
    lang: String,
    heading: String,
    text: String,
}

impl Fenced {
    fn first_line(&self) -> &str {
        self.text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default()
    }
}

/// Every fenced block of `readme`, in order.
fn fenced_blocks(readme: &str) -> Vec<Fenced> {
    let mut blocks = Vec::new();
    let mut heading = String::new();
    let mut open: Option<(usize, String, Vec<&str>)> = None;
    for line in readme.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &mut open {
            None if trimmed.starts_with("```") => open = Some((indent, trimmed[3..].trim().to_string(), Vec::new())),
            None if line.starts_with('#') => heading = line.to_string(),
            None => {}
            Some(_) if trimmed == "```" => {
                let (_, lang, lines) = open.take().expect("open block");
                let text = lines.join("\n");
                blocks.push(Fenced { lang, heading: heading.clone(), text });
            }
            Some((indent_of_fence, _, lines)) => {
                let cut = indent.min(*indent_of_fence);
                lines.push(&line[cut..]);
            }
        }
    }
    assert!(open.is_none(), "README.md ends inside a fenced block");
    blocks
}

/// How each fenced block of README.md is checked, found by the start of its first line. A
/// block is run by the test named, or excluded here with the reason it cannot run in these
/// tests. A block not in this table fails `every_readme_block_is_run_or_excluded`: a new
/// example is run, or its exclusion written down, in the commit that adds it.
const README_BLOCKS: &[(&str, Check)] = &[
    ("./scripts/quickstart.sh", Check::Run("every_try_it_example_of_the_readme_runs_as_written")),
    ("cargo run --release -p corral-cli -- dev  ", Check::Run("every_try_it_example_of_the_readme_runs_as_written")),
    (
        "cargo run --release -p corral-cli -- dev --nodes 2 --mig",
        Check::Run("every_try_it_example_of_the_readme_runs_as_written"),
    ),
    ("cargo build --release -p corral-cli && export PATH", Check::Run("the_readme_cluster_example_runs_as_written")),
    (
        "cargo build --release -p corral-cli && cargo bench -p corral-integration --bench cluster",
        Check::Excluded(BENCH),
    ),
    (
        "corral cluster init --policy cluster-configs/cluster.toml",
        Check::Run("the_readme_policy_example_runs_as_written"),
    ),
    ("corral node cordon gpu-07", Check::Run("the_readme_drain_example_runs_as_written")),
    ("[tls]", Check::Run("the_readme_tls_examples_run_as_written")),
    ("TOKEN=$(corral --ca ca.pem", Check::Run("the_readme_tls_examples_run_as_written")),
    ("corral worker --config /etc/corral/worker.toml --join", Check::Run("the_readme_tls_examples_run_as_written")),
    ("cat > train.sbatch <<'EOF'", Check::Run("the_readme_sbatch_example_runs_as_written")),
    ("cargo build --release -p corral-cli && cargo bench -p corral-integration --bench srun", Check::Excluded(BENCH)),
    (
        "corral submit --image nvcr.io/nvidia/pytorch:24.01-py3",
        Check::Excluded(
            "pulls NVIDIA's PyTorch image from nvcr.io, and the tests reach no registry but their own on \
             loopback (the `images` tests run image jobs with --container-mounts, -workdir and -env)",
        ),
    ),
    ("cargo bench -p corral-image --bench pull", Check::Excluded(BENCH)),
    (
        "corral submit --array 0-999%16 -- python sweep.py",
        Check::Run("the_readme_array_and_dependency_example_runs_as_written"),
    ),
    (
        "corral submit --gpus 16 --gpus-per-node 8 --max-restarts 3",
        Check::Run("the_readme_gang_example_runs_as_written"),
    ),
    ("corral alloc -N 2 --gpus-per-node 1", Check::Run("the_readme_alloc_example_runs_as_written")),
    ("[scheduler]", Check::Run("the_readme_coordinator_config_sections_are_accepted")),
    ("[limits]", Check::Run("the_readme_coordinator_config_sections_are_accepted")),
    ("[history]", Check::Run("the_readme_coordinator_config_sections_are_accepted")),
    ("[autoscale]", Check::Run("the_readme_coordinator_config_sections_are_accepted")),
    (
        "cargo build --release -p corral-cli && cargo bench -p corral-integration --bench lifecycle",
        Check::Excluded(BENCH),
    ),
    (
        "pip install ./python",
        Check::Excluded(
            "installs the client into the running Python; .ci/run makes the CORRAL_PYTHON venv with \
             `pip install ./python`, and the Python example runs with it",
        ),
    ),
    ("from corral_client import Client", Check::Run("the_readme_python_example_runs_as_written")),
    ("corral certs init --dir tls --coordinators 3", Check::Run("the_readme_tls_examples_run_as_written")),
    ("corral certs renew --dir tls --days 365", Check::Run("the_readme_tls_examples_run_as_written")),
    ("cargo test --workspace", Check::Excluded(TEST_SUITE)),
    ("CORRAL_SOAK_SECS=1800 cargo test", Check::Excluded(TEST_SUITE)),
    ("cargo build -p corral-cli && cargo test -p corral-integration --test it -- corpus", Check::Excluded(TEST_SUITE)),
    ("python3 -m venv .ci/venv", Check::Excluded(TEST_SUITE)),
    ("corral CLI ──gRPC──▶", Check::Excluded("a diagram, not a command")),
];

const BENCH: &str = "a benchmark: `cargo bench` measures speed, the tests do not (the bench harness runs it)";
const TEST_SUITE: &str = "runs the test suite (or makes its Python venv) that this test is part of";

#[derive(Debug)]
enum Check {
    /// Run by the test of this name.
    Run(&'static str),
    /// Not run, for this reason.
    Excluded(&'static str),
}

#[test]
fn every_readme_block_is_run_or_excluded() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let blocks = fenced_blocks(&readme);
    for block in &blocks {
        let matches: Vec<_> = README_BLOCKS.iter().filter(|(start, _)| block.first_line().starts_with(start)).collect();
        assert_eq!(
            matches.len(),
            1,
            "README block under '{}' (```{}) starting `{}` must match exactly one entry of README_BLOCKS \
             (run it in a test, or exclude it there with the reason): {matches:?}",
            block.heading,
            block.lang,
            block.first_line()
        );
        match matches[0].1 {
            Check::Excluded(why) => {
                eprintln!("README block `{}` ({}) not run: {why}", block.first_line(), block.heading)
            }
            Check::Run(test) => assert!(
                include_str!("readme.rs").contains(&format!("#[test]\nfn {test}()")),
                "README_BLOCKS names `{test}`, which is no test of readme.rs"
            ),
        }
    }
    for (start, check) in README_BLOCKS {
        let n = blocks.iter().filter(|b| b.first_line().starts_with(start)).count();
        assert_eq!(n, 1, "README_BLOCKS entry `{start}` ({check:?}) matches {n} README blocks, not one");
    }
    assert_eq!(blocks.len(), README_BLOCKS.len(), "README.md has {} fenced blocks", blocks.len());
}

#[test]
fn fenced_blocks_are_found_with_their_headings_and_indentation() {
    let text = "# t\n```sh\na\n```\n## H\n1. x\n   ```toml\n   [k]\n     v = 1\n   ```\n```\nart\n```\n";
    let blocks = fenced_blocks(text);
    assert_eq!(blocks.len(), 3);
    assert_eq!((blocks[0].lang.as_str(), blocks[0].heading.as_str(), blocks[0].text.as_str()), ("sh", "# t", "a"));
    assert_eq!(
        (blocks[1].lang.as_str(), blocks[1].heading.as_str(), blocks[1].text.as_str()),
        ("toml", "## H", "[k]\n  v = 1")
    );
    assert_eq!((blocks[2].lang.as_str(), blocks[2].first_line()), ("", "art"));
}

/// A shell session for a README block: each line runs in its own `sh` in `dir`, with `set -a`
/// so that its assignments and exports reach the lines after it (the environment is carried
/// from one line to the next), after the `subs` replacements (ports, paths). A line ending in
/// `&` keeps running until the session ends; when it names a `--config` with a `listen`
/// address, the session waits until that address accepts connections, as a user waits for
/// the daemon to come up before the next command.
struct Session {
    dir: PathBuf,
    out: PathBuf,
    env: Vec<(String, String)>,
    subs: Vec<(String, String)>,
    lines: usize,
    background: Vec<libc::pid_t>,
}

impl Session {
    /// A session in `dir` with the test's environment, `PATH` from [`example_path`], and `env`
    /// over it; its lines' output goes to files in `out`.
    fn new(dir: &Path, out: &Path, env: &[(&str, String)]) -> Session {
        let mut all: Vec<(String, String)> = std::env::vars().filter(|(k, _)| k != "PATH").collect();
        all.push(("PATH".into(), example_path(out)));
        for (k, v) in env {
            all.retain(|(name, _)| name != k);
            all.push((k.to_string(), v.clone()));
        }
        std::fs::create_dir_all(out).expect("out dir");
        Session {
            dir: dir.to_path_buf(),
            out: out.to_path_buf(),
            env: all,
            subs: Vec::new(),
            lines: 0,
            background: Vec::new(),
        }
    }

    fn sub(&mut self, from: &str, to: &str) {
        self.subs.push((from.to_string(), to.to_string()));
    }

    fn substituted(&self, text: &str) -> String {
        self.subs.iter().fold(text.to_string(), |t, (from, to)| t.replace(from, to))
    }

    /// Runs `line` (substituted); it must exit 0. Returns its stdout.
    fn run(&mut self, line: &str) -> String {
        let (ok, stdout, stderr) = self.try_run(line);
        assert!(ok, "README line `{line}` failed:\nstdout: {stdout}\nstderr: {stderr}");
        stdout
    }

    /// Runs `line` (substituted): (exit 0, stdout, stderr).
    fn try_run(&mut self, line: &str) -> (bool, String, String) {
        let line = self.substituted(line);
        eprintln!("README line: {line}");
        self.lines += 1;
        let n = self.lines;
        let env_file = self.out.join(format!("env-{n}"));
        let out_file = self.out.join(format!("line-{n}.out"));
        let err_file = self.out.join(format!("line-{n}.err"));
        let script = format!("set -a\n{line}\nrc=$?\nenv -0 > '{}'\nexit $rc\n", env_file.display());
        let background = line.split(" #").next().unwrap_or_default().trim_end().ends_with('&');
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .current_dir(&self.dir)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .process_group(0)
            .stdout(std::fs::File::create(&out_file).expect("stdout file"))
            .stderr(std::fs::File::create(&err_file).expect("stderr file"))
            .spawn()
            .expect("spawn sh");
        let group = child.id() as libc::pid_t;
        if background {
            self.background.push(group);
        }
        let status = corral_integration::wait_until(&mut child, Instant::now() + LINE_LIMIT);
        if status.is_none() {
            // SAFETY: kill(2) of our own child's process group.
            unsafe { libc::kill(-group, libc::SIGKILL) };
            let _ = child.wait();
        }
        if let Ok(text) = std::fs::read(&env_file) {
            self.env = text
                .split(|b| *b == 0)
                .filter_map(|entry| {
                    let entry = String::from_utf8_lossy(entry);
                    let (k, v) = entry.split_once('=')?;
                    Some((k.to_string(), v.to_string()))
                })
                .collect();
        }
        let ok = status.is_some_and(|s| s.success());
        if ok && background {
            self.wait_listening(&line);
        }
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        (ok, read(&out_file), read(&err_file))
    }

    /// After a background line with `--config FILE`: waits until FILE's `listen` accepts.
    fn wait_listening(&self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(config) = words.iter().position(|w| *w == "--config").and_then(|i| words.get(i + 1)) else {
            return;
        };
        let text = std::fs::read_to_string(self.dir.join(config)).expect("the line's config");
        let table: toml::Table = text.parse().expect("the line's config is TOML");
        let Some(listen) = table.get("listen").and_then(|v| v.as_str()) else { return };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(listen).is_err() {
            assert!(Instant::now() < deadline, "`{line}` did not listen on {listen} within 60s:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The output of the background lines, for failure messages.
    fn logs(&self) -> String {
        let mut text = String::new();
        for n in 1..=self.lines {
            let err = std::fs::read_to_string(self.out.join(format!("line-{n}.err"))).unwrap_or_default();
            if !err.is_empty() {
                text.push_str(&format!("--- line {n} stderr:\n{}\n", tail(&err, 4000)));
            }
        }
        text
    }

    /// `corral show JOB --output json` with the session's environment, until `done` holds.
    fn wait_for(&mut self, job: &str, done: impl Fn(&str) -> bool) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let output = Command::new(corral_bin())
                .args(["show", job, "--output", "json"])
                .current_dir(&self.dir)
                .env_clear()
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .output()
                .expect("corral show");
            if let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&output.stdout) {
                if done(doc["state"].as_str().unwrap_or_default()) {
                    return doc;
                }
                assert!(Instant::now() < deadline, "job {job} did not end within 180s: {doc}\n{}", self.logs());
            } else {
                assert!(
                    Instant::now() < deadline,
                    "corral show {job}: {}\n{}",
                    String::from_utf8_lossy(&output.stderr),
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until `job` ends, and asserts it ended `state`.
    fn assert_ends(&mut self, job: &str, state: &str) {
        let doc = self.wait_for(job, |s| ["succeeded", "failed", "cancelled", "timeout"].contains(&s));
        assert_eq!(doc["state"], state, "README job {job}: {doc}\n{}", self.logs());
    }
}

impl Drop for Session {
    /// Stops the background lines: SIGTERM, then SIGKILL for what still runs 20 s later.
    fn drop(&mut self) {
        // SAFETY: kill(2) of process groups this session started.
        let alive = |g: libc::pid_t| unsafe { libc::kill(-g, 0) } == 0;
        for &group in &self.background {
            unsafe { libc::kill(-group, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.background.iter().any(|&g| alive(g)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        for &group in &self.background {
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
    }
}

fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The commands of a block: backslash continuations joined, blank lines left out.
fn commands(block: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut pending = String::new();
    for line in block.lines() {
        let text = line.trim_start();
        if let Some(head) = text.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        pending.push_str(text);
        if !pending.trim().is_empty() {
            lines.push(std::mem::take(&mut pending));
        }
        pending.clear();
    }
    lines
}

/// A temp dir the jobs' users can enter (workers run jobs as `nobody` without a `[users]`
/// entry), with a `work` dir holding the stand-ins; returns (tmp, work).
fn open_workdir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    for dir in [tmp.path(), &work] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    write_stand_ins(&work);
    (tmp, work)
}

fn readme() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join("README.md")).expect("README.md")
}

/// The block whose first line starts with `start`.
fn readme_block(start: &str) -> String {
    let blocks = fenced_blocks(&readme());
    let block = blocks
        .iter()
        .find(|b| b.first_line().starts_with(start))
        .unwrap_or_else(|| panic!("no README block `{start}`"));
    block.text.clone()
}

/// Copies `cluster-configs/*.toml` into `dir/cluster-configs/` with `subs` applied.
fn copy_configs(dir: &Path, subs: &[(String, String)]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let to = dir.join("cluster-configs");
    std::fs::create_dir_all(&to).expect("configs dir");
    for entry in std::fs::read_dir(root.join("cluster-configs")).expect("cluster-configs") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).expect("config");
            let text = subs.iter().fold(text, |t, (from, to)| t.replace(from, to));
            std::fs::write(to.join(path.file_name().expect("name")), text).expect("write config");
        }
    }
}

/// "Run a cluster": three coordinators from `cluster-configs/`, `cluster init` and `join`, a
/// simulated worker and a job, line by line, on free ports instead of 7071-7073, 7181, 9471-9473
/// and 9481 (in the lines and in copies of the configs), in a temp dir (the configs' data
/// dirs are relative), with the `corral` under test for the release build.
#[test]
fn the_readme_cluster_example_runs_as_written() {
    let block = readme_block("cargo build --release -p corral-cli && export PATH");
    let (tmp, work) = open_workdir();
    let bin_dir = corral_bin().parent().expect("bin dir").display().to_string();
    let mut session = Session::new(&work, &tmp.path().join("out"), &[]);
    session.sub("cargo build --release -p corral-cli && ", "");
    session.sub("$PWD/target/release", &bin_dir);
    for port in [7071, 7072, 7073, 7181, 9471, 9472, 9473, 9481] {
        session.sub(&format!("127.0.0.1:{port}"), &format!("127.0.0.1:{}", free_port()));
    }
    copy_configs(&work, &session.subs);
    let lines = commands(&block);
    let mut last = String::new();
    for line in &lines {
        last = session.run(line);
    }
    assert!(lines.last().is_some_and(|l| l.starts_with("corral submit")), "the block ends with a submit: {lines:?}");
    let job = last.trim().to_string();
    session.assert_ends(&job, "succeeded");
    let logs = session.run(&format!("corral logs {job}"));
    assert!(logs.contains("hello from GPU"), "the job's output: {logs}");
}

/// The `toml` sections the README gives for a coordinator's config (`[scheduler]`, `[limits]`,
/// `[history]`, `[autoscale]`) are accepted by a real coordinator, without a warning.
#[test]
fn the_readme_coordinator_config_sections_are_accepted() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let listen = format!("127.0.0.1:{}", free_port());
    let mut config =
        format!("node-id = 1\nlisten = \"{listen}\"\ndata-dir = \"{}\"\n", tmp.path().join("data").display());
    for start in ["[scheduler]", "[limits]", "[history]", "[autoscale]"] {
        config.push_str(&format!("\n{}\n", readme_block(start)));
    }
    let path = tmp.path().join("coordinator.toml");
    std::fs::write(&path, &config).expect("config");
    let mut session = Session::new(tmp.path(), &tmp.path().join("out"), &[]);
    session.run("corral coordinator --config coordinator.toml &");
    let log = std::fs::read_to_string(tmp.path().join("out/line-1.err")).unwrap_or_default();
    assert!(!log.to_lowercase().contains("warn"), "the README's config sections gave a warning:\n{config}\n{log}");
}

/// "Policy as a file": on a coordinator not initialised yet (a `corral coordinator` on a free
/// port), every line as written, in a copy of `cluster-configs/`'s directory.
#[test]
fn the_readme_policy_example_runs_as_written() {
    let block = readme_block("corral cluster init --policy cluster-configs/cluster.toml");
    let (tmp, work) = open_workdir();
    copy_configs(&work, &[]);
    let listen = format!("127.0.0.1:{}", free_port());
    let config = format!("node-id = 1\nlisten = \"{listen}\"\ndata-dir = \"{}\"\n", tmp.path().join("data").display());
    std::fs::write(work.join("coordinator.toml"), config).expect("config");
    let mut session = Session::new(&work, &tmp.path().join("out"), &[("CORRAL_ENDPOINT", listen)]);
    session.run("corral coordinator --config coordinator.toml &");
    for line in commands(&block) {
        session.run(&line);
    }
    let history = session.run("corral admin history");
    assert!(history.lines().count() >= 2, "the applied policy is in the history: {history}");
}

/// "Drain, cordon, remove" on a `corral dev --nodes 2` pool, its second node standing in for
/// `gpu-07` (its simulated worker is not stopped before the remove: it may register again).
#[test]
fn the_readme_drain_example_runs_as_written() {
    let block = readme_block("corral node cordon gpu-07");
    let pool = DevPool::start(&["--nodes", "2"]);
    let (tmp, work) = open_workdir();
    let mut session = Session::new(&work, &tmp.path().join("out"), &[("CORRAL_ENDPOINT", pool.addr.clone())]);
    session.sub("gpu-07", "dev-node-2");
    for line in commands(&block) {
        let (ok, stdout, stderr) = session.try_run(&line);
        assert!(ok, "README line `{line}` failed:\nstdout: {stdout}\nstderr: {stderr}\npool log:\n{}", pool.logs());
    }
}

/// Arrays and dependencies ("Coming from Slurm") on the pool the block's comment names
/// (`corral dev --node-labels partition=train,zone=a`), with the array's id for `12` and 32
/// tasks for its 1000 (as fast on a small machine as the rest of the tests). Every
/// job succeeds, but the `afternotok` one: its dependency can never be met once the array
/// succeeded, so it is cancelled.
#[test]
fn the_readme_array_and_dependency_example_runs_as_written() {
    let block = readme_block("corral submit --array 0-999%16 -- python sweep.py");
    let pool = DevPool::start(&["--node-labels", "partition=train,zone=a"]);
    let (tmp, work) = open_workdir();
    let mut session = Session::new(&work, &tmp.path().join("out"), &[("CORRAL_ENDPOINT", pool.addr.clone())]);
    // 1000 Python processes take minutes on a small CI machine: the same array, 32 tasks.
    session.sub("--array 0-999%16", "--array 0-31%16");
    let mut jobs = Vec::new();
    for line in commands(&block) {
        let stdout = session.run(&line);
        if line.starts_with("corral submit") {
            let id = stdout.trim().to_string();
            if jobs.is_empty() {
                session.sub(":12", &format!(":{id}"));
            }
            let expected = if line.contains("afternotok") { "cancelled" } else { "succeeded" };
            jobs.push((id, expected));
        }
    }
    assert_eq!(jobs.len(), 6, "the block's submits: {jobs:?}");
    for (job, expected) in jobs {
        session.assert_ends(&job, expected);
    }
}

/// "Distributed training on gangs" on a `corral dev --nodes 2` pool (two nodes of 8 GPUs),
/// with a `torchrun` stand-in that prints its arguments, and the gang's id for `12`.
#[test]
fn the_readme_gang_example_runs_as_written() {
    let block = readme_block("corral submit --gpus 16 --gpus-per-node 8 --max-restarts 3");
    let pool = DevPool::start(&["--nodes", "2"]);
    let (tmp, work) = open_workdir();
    let shims = tmp.path().join("torchrun-shim");
    std::fs::create_dir_all(&shims).expect("shim dir");
    let torchrun = shims.join("torchrun");
    std::fs::write(&torchrun, "#!/bin/sh\necho \"torchrun $*\"\n").expect("torchrun stand-in");
    std::fs::set_permissions(&torchrun, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!("{}:{}", shims.display(), example_path(tmp.path()));
    let mut session =
        Session::new(&work, &tmp.path().join("out"), &[("CORRAL_ENDPOINT", pool.addr.clone()), ("PATH", path)]);
    let lines = commands(&block);
    assert_eq!(lines.len(), 2, "a submit and a logs: {lines:?}");
    let job = session.run(&lines[0]).trim().to_string();
    session.assert_ends(&job, "succeeded");
    session.sub("logs 12 ", &format!("logs {job} "));
    let rank1 = session.run(&lines[1]);
    assert!(rank1.contains("--nnodes 2 --node-rank 1 --nproc-per-node 8"), "rank 1's output: {rank1}");
}

/// The `corral alloc` example: a session of two nodes on `corral dev --nodes 2` whose `srun -l`
/// runs a task on each (an `nvidia-smi` stand-in that names the task's GPUs), then relinquishes.
#[test]
fn the_readme_alloc_example_runs_as_written() {
    let block = readme_block("corral alloc -N 2 --gpus-per-node 1");
    let pool = DevPool::start(&["--nodes", "2"]);
    let (tmp, work) = open_workdir();
    let shims = tmp.path().join("smi-shim");
    std::fs::create_dir_all(&shims).expect("shim dir");
    let smi = shims.join("nvidia-smi");
    std::fs::write(&smi, "#!/bin/sh\necho \"GPU $CUDA_VISIBLE_DEVICES on $(hostname) ($*)\"\n").expect("stand-in");
    for path in [&shims, &smi] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let path = format!("{}:{}", shims.display(), example_path(tmp.path()));
    let mut session =
        Session::new(&work, &tmp.path().join("out"), &[("CORRAL_ENDPOINT", pool.addr.clone()), ("PATH", path)]);
    let lines = commands(&block);
    assert_eq!(lines.len(), 1, "one alloc: {lines:?}");
    let out = session.run(&lines[0]);
    for rank in ["0: GPU", "1: GPU"] {
        assert!(out.contains(rank) && out.contains("(-L)"), "task {rank} of the session's step: {out}");
    }
}

/// The Python client's example, with the interpreter in `CORRAL_PYTHON` (skipped loudly without
/// it, except under CI), against a `corral dev` pool for `127.0.0.1:7070`, in a directory with
/// a `train.py` stand-in.
#[test]
fn the_readme_python_example_runs_as_written() {
    let Some(python) = std::env::var_os("CORRAL_PYTHON") else {
        assert!(std::env::var_os("CI").is_none(), "CORRAL_PYTHON is required under CI (.ci/run makes it)");
        let banner = "!".repeat(78);
        eprintln!("\n{banner}\nSKIPPING the README's Python example: CORRAL_PYTHON is not set.\n{banner}\n");
        return;
    };
    let block = readme_block("from corral_client import Client");
    let pool = DevPool::start(&[]);
    let (tmp, work) = open_workdir();
    std::fs::write(work.join("example.py"), block.replace("127.0.0.1:7070", &pool.addr)).expect("example.py");
    let output = Command::new(&python)
        .arg("example.py")
        .current_dir(&work)
        .env("PATH", example_path(tmp.path()))
        .output()
        .expect("run CORRAL_PYTHON");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the Python example failed:\n{stdout}\n{}\npool log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        pool.logs()
    );
    assert_eq!(stdout.lines().collect::<Vec<_>>(), ["succeeded", "train.py: done"], "the example's output");
}

/// "Secure a cluster" and "Add a worker with a join token", in a temp dir: the certificates of
/// the block's `corral certs init`; one coordinator whose config is the README's `[tls]`
/// section (its `/etc/corral/tls/` the block's `tls/`) on a free port for the coordinators'
/// addresses; the secure block line by line, `certs renew`, then the join token (the admin
/// files under `tls/`) and a worker from the example `worker-sim.toml` joining with it (in
/// the background, as a daemon runs, at the coordinator's address for
/// `coord-1.example.internal:7070`), which must register and run a job.
#[test]
fn the_readme_tls_examples_run_as_written() {
    let secure = commands(&readme_block("corral certs init --dir tls --coordinators 3"));
    let renew = commands(&readme_block("corral certs renew --dir tls --days 365"));
    let tls_section = readme_block("[tls]");
    let token_line = commands(&readme_block("TOKEN=$(corral --ca ca.pem"));
    let join_line = commands(&readme_block("corral worker --config /etc/corral/worker.toml --join"));
    let (tmp, work) = open_workdir();
    let listen = format!("127.0.0.1:{}", free_port());
    let mut session = Session::new(&work, &tmp.path().join("out"), &[("CORRAL_ENDPOINT", listen.clone())]);
    session.run(&secure[0]);

    let tls_dir = format!("{}/tls/", work.display());
    let config = format!(
        "node-id = 1\nlisten = \"{listen}\"\ndata-dir = \"{}\"\n\n{}\n",
        tmp.path().join("coordinator").display(),
        tls_section.replace("/etc/corral/tls/", &tls_dir)
    );
    std::fs::write(work.join("coordinator.toml"), config).expect("coordinator config");
    session.run("corral coordinator --config coordinator.toml &");
    for line in &secure[1..] {
        let (ok, stdout, stderr) = session.try_run(line);
        assert!(ok, "README line `{line}` failed:\nstdout: {stdout}\nstderr: {stderr}\n{}", session.logs());
    }
    for line in &renew {
        session.run(line);
    }

    // The worker of the example, joining this coordinator.
    let worker_subs: Vec<(String, String)> = vec![
        (
            "coordinators = [\"127.0.0.1:7071\", \"127.0.0.1:7072\", \"127.0.0.1:7073\"]".into(),
            format!("coordinators = [\"{listen}\"]"),
        ),
        ("127.0.0.1:7181".into(), format!("127.0.0.1:{}", free_port())),
        ("127.0.0.1:9481".into(), format!("127.0.0.1:{}", free_port())),
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let worker = std::fs::read_to_string(root.join("cluster-configs/worker-sim.toml")).expect("worker-sim.toml");
    let worker = worker_subs.iter().fold(worker, |t, (from, to)| t.replace(from, to));
    assert!(worker.contains(&listen) && !worker.contains("[tls]"), "worker config:\n{worker}");
    std::fs::write(work.join("worker.toml"), worker).expect("worker config");
    for file in ["ca.pem", "admin.pem", "admin-key.pem"] {
        session.sub(&format!(" {file}"), &format!(" tls/{file}"));
    }
    session.sub("/etc/corral/worker.toml", "worker.toml");
    session.sub("coord-1.example.internal:7070", &listen);
    for line in &token_line {
        session.run(line);
    }
    assert_eq!(join_line.len(), 1, "{join_line:?}");
    let (ok, stdout, stderr) = session.try_run(&format!("{} &", join_line[0]));
    assert!(ok, "the join line failed:\nstdout: {stdout}\nstderr: {stderr}\n{}", session.logs());

    // The joined worker runs jobs: the team-a job the secure block submitted (as nobody).
    let jobs = session.run("corral jobs --all --output json");
    let jobs: serde_json::Value = serde_json::from_str(&jobs).expect("jobs json");
    let job = jobs.as_array().and_then(|j| j.first()).expect("the secure block's job")["id"].to_string();
    session.assert_ends(job.trim_matches('"'), "succeeded");
}
