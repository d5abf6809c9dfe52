//! README.md's "Try it" section runs as written: every `sh` block, line by line, through `sh`
//! with the `corral` under test first in PATH, against the `corral dev` pool the block itself
//! starts (its `cargo run ... -- dev` or `corral dev ...` line starts one on a free port, with
//! a data dir of the test's: the rest of the line's flags as written). The job programs the
//! examples name (`train.py`, `./urgent.sh`...) are trivial stand-ins in the working directory.
//! Every line must exit 0; every job a block submitted must succeed. Only the lines in
//! `SKIPPED` are not run, each with its reason, printed. The "Coming from Slurm" `#SBATCH`
//! example runs too, as one script.

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
    let has_python = Command::new("python").arg("--version").output().is_ok_and(|o| o.status.success());
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
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
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
