//! Slurm users' path on a `corral dev` node: `corral sbatch` with `#SBATCH` directives, jobs in
//! the submit directory with the submit environment, output files, `corral run` passing the
//! exit code through, `--strict`, a signal before the time limit, Slurm's variables, output
//! patterns and default file, bare dependencies, `--parsable`, `logs ID_TASK`, `cancel ID ID`,
//! Slurm's commands inside a job reaching the cluster, `sbatch` inside a job.

use corral_integration::{corral_bin, one_line_stderr, DevPool};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

/// `corral <args>` against the pool, run in `dir` with extra environment variables.
fn corral_in(pool: &DevPool, dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    Command::new(corral_bin())
        .current_dir(dir)
        .envs(env.iter().copied())
        .args(["--endpoint", &pool.addr])
        .args(args)
        .output()
        .expect("run corral")
}

fn submitted_id(out: &Output) -> u64 {
    assert!(out.status.success(), "submit failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("a job id")
}

fn ended(pool: &DevPool, job: u64) -> serde_json::Value {
    pool.wait_for(job, "ended", |d| d["state"] != "pending" && d["state"] != "running")
}

fn executable(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn sbatch_script_runs_with_its_directives() {
    let pool = DevPool::start(&["--gpus", "4"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("mkdir");
    let script = format!(
        "#!/bin/sh\n\
         #SBATCH --gpus=2\n\
         #SBATCH --time=10\n\
         #SBATCH -J trainer\n\
         #SBATCH --output=out-%j.txt\n\
         #SBATCH --chdir={}\n\
         \n\
         echo \"name=$SLURM_JOB_NAME id=$SLURM_JOB_ID gpus=$CUDA_VISIBLE_DEVICES pwd=$(pwd) args=$*\"\n",
        work.display()
    );
    std::fs::write(dir.path().join("train.sbatch"), script).expect("write");
    let out = corral_in(&pool, dir.path(), &[], &["sbatch", "train.sbatch", "a", "b"]);
    let job = submitted_id(&out);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!(doc["name"], "trainer");
    assert_eq!(doc["time_limit_secs"], 600);
    let gpus: Vec<String> = doc["gpus"].as_array().expect("gpus").iter().map(|g| g.to_string()).collect();
    assert_eq!(gpus.len(), 2, "{doc}");
    let expected = format!("name=trainer id={job} gpus={} pwd={} args=a b\n", gpus.join(","), work.display());
    assert_eq!(pool.ok(&["logs", &job.to_string()]), expected, "corral logs keeps working");
    let file = std::fs::read_to_string(work.join(format!("out-{job}.txt"))).expect("the --output file");
    assert_eq!(file, expected);
}

/// The options a user types before the script mean what they mean to Slurm's `sbatch` and win
/// over the script's directives (`sbatch --job-name=x -t 5 -o out-%j.txt --mem=100 job.sh`,
/// as projects' documentation writes them); corral's own flags and the script's arguments
/// keep theirs.
#[test]
fn sbatch_reads_slurms_options_on_its_command_line() {
    let pool = DevPool::start(&["--gpus", "4"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "#!/bin/sh\n#SBATCH -J from-script\n#SBATCH --time=10\necho \"name=$SLURM_JOB_NAME args=$*\"\n";
    std::fs::write(dir.path().join("job.sh"), script).expect("write");
    let args = [
        "sbatch",
        "--job-name=from-line",
        "-t",
        "0-00:05:00",
        "-o",
        "out-%j.txt",
        "--mem=100",
        "--gres=gpu:2",
        "--requeue",
        "--mail-type=END",
        "--parsable",
        "job.sh",
        "-o",
        "x",
    ];
    let out = corral_in(&pool, dir.path(), &[], &args);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("warning"), "{}", one_line_stderr(&out));
    let job = submitted_id(&out);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!((doc["name"].as_str(), doc["time_limit_secs"].as_u64()), (Some("from-line"), Some(300)), "{doc}");
    assert_eq!(doc["gpus"].as_array().map(Vec::len), Some(2), "{doc}");
    let shown = pool.ok(&["show", &job.to_string()]);
    assert!(shown.contains("100MiB") || shown.contains("100 MiB"), "--mem=100 is 100 MB: {shown}");
    let file = std::fs::read_to_string(dir.path().join(format!("out-{job}.txt"))).expect("the -o file");
    assert_eq!(file, "name=from-line args=-o x\n");

    // `--wrap`: a one-line job, named `wrap`, as Slurm writes it.
    let out =
        corral_in(&pool, dir.path(), &[], &["sbatch", "--wrap", "echo wrapped $SLURM_JOB_NAME", "-o", "w-%j.out"]);
    let job = submitted_id(&out);
    assert_eq!(ended(&pool, job)["state"], "succeeded");
    let file = std::fs::read_to_string(dir.path().join(format!("w-{job}.out"))).expect("the wrap job's -o file");
    assert_eq!(file, "wrapped wrap\n");

    // No script: it is read from standard input (`sbatch <<EOF`), directives and all, and the
    // job is named `sbatch`, as by Slurm's sbatch.
    let piped = |input: &str, args: &[&str]| {
        let mut child = Command::new(corral_bin())
            .current_dir(dir.path())
            .args(["--endpoint", &pool.addr, "sbatch"])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run corral sbatch");
        std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), input.as_bytes()).expect("write stdin");
        child.wait_with_output().expect("wait")
    };
    let heredoc =
        "#!/bin/bash\n#SBATCH --time=5\n#SBATCH --output=here-%j.out\necho \"from stdin: $SLURM_JOB_NAME $1\"\n";
    let job = submitted_id(&piped(heredoc, &["--parsable"]));
    let doc = ended(&pool, job);
    assert_eq!((doc["state"].as_str(), doc["name"].as_str()), (Some("succeeded"), Some("sbatch")), "{doc}");
    assert_eq!(doc["time_limit_secs"].as_u64(), Some(300), "the piped script's directives apply: {doc}");
    let file = std::fs::read_to_string(dir.path().join(format!("here-{job}.out"))).expect("the piped job's output");
    assert_eq!(file, "from stdin: sbatch \n");
    let out = piped("  \n", &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(one_line_stderr(&out).contains("the script on standard input is empty"), "{out:?}");
    let out = piped(&"#".repeat(1024 * 1024 + 10), &[]);
    assert!(one_line_stderr(&out).contains("more than the 1024 KiB"), "{out:?}");

    // An option Slurm has and corral does not: one warning, the job is submitted.
    let out = corral_in(&pool, dir.path(), &[], &["sbatch", "--reservation=maint", "--hold", "job.sh"]);
    assert!(one_line_stderr(&out).contains("--reservation is not supported by corral: ignored"), "{out:?}");
    submitted_id(&out);
}

/// `--exclusive` without a GPU request: Slurm allocates such a job all the GRES of its nodes,
/// and launchers that start one process per GPU (AWS's and Megatron's examples) rely on it.
#[test]
fn an_exclusive_job_without_gpus_gets_every_gpu_of_its_node() {
    let pool = DevPool::start(&["--gpus", "4"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "#!/bin/sh\n#SBATCH --exclusive\n#SBATCH --output=x-%j.out\necho \"$CUDA_VISIBLE_DEVICES $SLURM_GPUS_ON_NODE\"\n";
    std::fs::write(dir.path().join("x.sh"), script).expect("write");
    let job = submitted_id(&corral_in(&pool, dir.path(), &[], &["sbatch", "x.sh"]));
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!(doc["gpus"].as_array().map(Vec::len), Some(4), "{doc}");
    let file = std::fs::read_to_string(dir.path().join(format!("x-{job}.out"))).expect("the output file");
    let fields: Vec<&str> = file.split_whitespace().collect();
    assert_eq!((fields[0].split(',').count(), fields.get(1).copied()), (4, Some("4")), "{file}");
}

#[test]
fn relative_program_runs_in_the_submit_directory() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    executable(&dir.path().join("train.sh"), "#!/bin/sh\necho \"trained in $(pwd) with $1\"\n");
    let out = corral_in(&pool, dir.path(), &[], &["submit", "--", "./train.sh", "lr=0.1"]);
    let job = submitted_id(&out);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!(pool.ok(&["logs", &job.to_string()]), format!("trained in {} with lr=0.1\n", dir.path().display()));
}

#[test]
fn the_submit_environment_is_exported_unless_none() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [("CORRAL_TEST_VAR", "hello"), ("SSH_AUTH_SOCK", "/tmp/agent.sock")];
    let show = "echo var=$CORRAL_TEST_VAR ssh=$SSH_AUTH_SOCK id=$CORRAL_JOB_ID";
    let default = submitted_id(&corral_in(&pool, dir.path(), &env, &["submit", "--", "sh", "-c", show]));
    let none =
        submitted_id(&corral_in(&pool, dir.path(), &env, &["submit", "--export", "NONE", "--", "sh", "-c", show]));
    let listed = submitted_id(&corral_in(
        &pool,
        dir.path(),
        &env,
        &["submit", "--export", "SSH_AUTH_SOCK,OTHER=1", "--", "sh", "-c", show],
    ));
    for job in [default, none, listed] {
        assert_eq!(ended(&pool, job)["state"], "succeeded");
    }
    assert_eq!(pool.ok(&["logs", &default.to_string()]), format!("var=hello ssh= id={default}\n"));
    assert_eq!(pool.ok(&["logs", &none.to_string()]), format!("var= ssh= id={none}\n"));
    assert_eq!(pool.ok(&["logs", &listed.to_string()]), format!("var= ssh=/tmp/agent.sock id={listed}\n"));
}

#[test]
fn a_missing_working_directory_fails_naming_node_and_path() {
    let pool = DevPool::start(&[]);
    let job = pool.submit(&["--chdir", "/nonexistent/corral-exp", "--", "true"]);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "failed", "{doc}");
    let reason = doc["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("node dev-node: working directory /nonexistent/corral-exp does not exist"), "{reason}");
}

#[test]
fn run_passes_the_exit_code_through() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let out = corral_in(&pool, dir.path(), &[], &["run", "--", "sh", "-c", "echo out; echo err >&2; exit 3"]);
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("err\n"));
    let out = corral_in(&pool, dir.path(), &[], &["run", "--", "sh", "-c", "echo fine"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "fine\n");
}

#[test]
fn strict_refuses_an_unsupported_directive_and_bad_input_submits_nothing() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("job.sh"), "#!/bin/sh\n#SBATCH --gpus=1\n#SBATCH --reservation=maint\necho hi\n")
        .expect("write");
    std::fs::write(dir.path().join("bad.sh"), "#!/bin/sh\n#SBATCH --time=soon\necho hi\n").expect("write");
    let refused = corral_in(&pool, dir.path(), &[], &["sbatch", "--strict", "job.sh"]);
    assert!(!refused.status.success());
    assert_eq!(
        one_line_stderr(&refused),
        "error: job.sh line 3: --reservation is not supported by corral (--strict): remove it, or submit without --strict to ignore it"
    );
    for args in [
        &["sbatch", "bad.sh"][..],
        &["sbatch", "missing.sh"],
        &["submit", "--array", "5-1", "--", "true"],
        &["submit", "--dependency", "afterok:x", "--", "true"],
    ] {
        let out = corral_in(&pool, dir.path(), &[], args);
        assert!(!out.status.success(), "{args:?}");
        let line = one_line_stderr(&out);
        assert!(line.starts_with("error: "), "{args:?}: {line}");
    }
    let bad = one_line_stderr(&corral_in(&pool, dir.path(), &[], &["sbatch", "bad.sh"]));
    assert!(bad.starts_with("error: bad.sh line 2: #SBATCH --time=soon: invalid time 'soon'"), "{bad}");
    let jobs = pool.json(&["jobs", "--all"]);
    assert_eq!(jobs.as_array().map(Vec::len), Some(0), "nothing was submitted: {jobs}");
    let warned = corral_in(&pool, dir.path(), &[], &["sbatch", "job.sh"]);
    let job = submitted_id(&warned);
    assert!(String::from_utf8_lossy(&warned.stderr).contains("warning: job.sh line 3: --reservation is not supported"));
    assert_eq!(ended(&pool, job)["state"], "succeeded");
}

#[test]
fn a_signal_before_the_time_limit_reaches_the_job() {
    let pool = DevPool::start(&[]);
    let trap = "trap 'echo got-usr1; exit 0' USR1; while :; do sleep 0.2; done";
    let job = pool.submit(&["--time", "1m", "--signal", "USR1@55s", "--", "sh", "-c", trap]);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    assert_eq!(pool.ok(&["logs", &job.to_string()]), "got-usr1\n");
}

#[test]
fn slurm_variables_and_the_default_output_file() {
    let pool = DevPool::start(&["--gpus", "4"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("mkdir");
    let script = format!(
        "#!/bin/bash\n\
         #SBATCH --job-name=vars\n\
         #SBATCH --ntasks=2 --cpus-per-task=1\n\
         #SBATCH --gres=gpu:2\n\
         #SBATCH --mem-per-gpu=1G\n\
         #SBATCH --mail-type=ALL --mail-user=ana@example.org\n\
         #SBATCH --chdir={}\n\
         echo \"ntasks=$SLURM_NTASKS nprocs=$SLURM_NPROCS tpn=$SLURM_TASKS_PER_NODE cpt=$SLURM_CPUS_PER_TASK\"\n\
         echo \"nodes=$SLURM_JOB_NUM_NODES list=$SLURM_JOB_NODELIST jobid=$SLURM_JOBID gpus=$SLURM_GPUS_ON_NODE\"\n\
         echo \"mem=$SLURM_MEM_PER_GPU submit=$SLURM_SUBMIT_DIR pwd=$(pwd)\"\n\
         [ \"$SLURM_TMPDIR\" = \"$CORRAL_JOB_DIR\" ] && [ -d \"$SLURM_TMPDIR\" ] || echo \"SLURM_TMPDIR=$SLURM_TMPDIR\"\n\
         now=$(date +%s); [ $((now - SLURM_JOB_START_TIME)) -lt 120 ] || echo \"start=$SLURM_JOB_START_TIME now=$now\"\n",
        work.display()
    );
    std::fs::write(dir.path().join("vars.sbatch"), script).expect("write");
    let out = corral_in(&pool, dir.path(), &[], &["sbatch", "--parsable", "vars.sbatch"]);
    assert!(String::from_utf8_lossy(&out.stderr).is_empty(), "mail directives are silent: {out:?}");
    let job = submitted_id(&out);
    let doc = ended(&pool, job);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let expected = format!(
        "ntasks=2 nprocs=2 tpn=2 cpt=1\nnodes=1 list=dev-node jobid={job} gpus=2\nmem=1024 submit={} pwd={}\n",
        dir.path().display(),
        work.display()
    );
    assert_eq!(pool.ok(&["logs", &job.to_string()]), expected);
    // No --output: slurm-%j.out in the working directory, as Slurm writes it.
    let file = std::fs::read_to_string(work.join(format!("slurm-{job}.out"))).expect("the default output file");
    assert_eq!(file, expected);
}

#[test]
fn arrays_write_user_patterns_and_logs_take_task_ids() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "#!/bin/sh\n#SBATCH --array=0-1\n#SBATCH -o logs-%u/%x_%A_%a.out\n\
                  echo task=$SLURM_ARRAY_TASK_ID of $SLURM_ARRAY_TASK_COUNT $SLURM_ARRAY_TASK_MIN-$SLURM_ARRAY_TASK_MAX:$SLURM_ARRAY_TASK_STEP\n";
    std::fs::create_dir(dir.path().join("logs-ana")).expect("mkdir");
    std::fs::write(dir.path().join("sweep.sh"), script).expect("write");
    let array = submitted_id(&corral_in(&pool, dir.path(), &[("USER", "ana")], &["sbatch", "sweep.sh"]));
    let doc = ended(&pool, array);
    assert_eq!(doc["array"]["succeeded"], 2, "{doc}");
    for task in 0..2 {
        let id = format!("{array}_{task}");
        let line = format!("task={task} of 2 0-1:1\n");
        assert_eq!(pool.ok(&["logs", &id]), line, "corral logs {id}");
        let file = dir.path().join(format!("logs-ana/sweep.sh_{array}_{task}.out"));
        assert_eq!(std::fs::read_to_string(&file).expect("the %u/%A_%a file"), line);
    }
}

#[test]
fn bare_dependencies_and_cancelling_several_jobs() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("first.sh"), "#!/bin/sh\nexit 3\n").expect("write");
    let first = submitted_id(&corral_in(&pool, dir.path(), &[], &["sbatch", "--parsable", "first.sh"]));
    // A bare id is Slurm's afterany: it runs after a failed job too.
    let then = format!("#!/bin/sh\n#SBATCH --dependency={first}\necho after\n");
    std::fs::write(dir.path().join("then.sh"), then).expect("write");
    let second = submitted_id(&corral_in(&pool, dir.path(), &[], &["sbatch", "then.sh"]));
    assert_eq!(ended(&pool, first)["state"], "failed");
    assert_eq!(ended(&pool, second)["state"], "succeeded");
    let held: Vec<u64> = (0..2).map(|_| pool.submit(&["--hold", "--", "true"])).collect();
    let ids: Vec<String> = held.iter().map(u64::to_string).collect();
    let out = pool.ok(&["cancel", &ids[0], &ids[1]]);
    assert_eq!(out, format!("job {} cancelled\njob {} cancelled\n", ids[0], ids[1]));
    for job in held {
        assert_eq!(ended(&pool, job)["state"], "cancelled");
    }
    let out = pool.corral(&["cancel", "999999", &ids[0]]);
    assert_eq!(out.status.code(), Some(1), "one unknown id fails the command");
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: job 999999: "), "{out:?}");
}

/// `corral queue --user`/`--me` (`squeue --me`), and Slurm's `squeue`, `scancel` and `scontrol
/// show job` inside a job, reaching the coordinator through the `CORRAL_ENDPOINT` it sets.
#[test]
fn queue_by_user_and_slurm_commands_inside_a_job() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let held = |user: &str, name: &str| {
        let args = ["--output", "json", "submit", "--hold", "--name", name, "--", "true"];
        let out = corral_in(&pool, dir.path(), &[("USER", user)], &args);
        assert!(out.status.success(), "submit: {}", one_line_stderr(&out));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        doc["id"].as_u64().expect("an id")
    };
    let (ana, bo) = (held("ana", "ana-held"), held("bo", "bo-held"));
    let queue = |env: &[(&str, &str)], args: &[&str]| {
        let out = corral_in(&pool, dir.path(), env, &[&["--output", "json", "queue"], args].concat());
        assert!(out.status.success(), "queue {args:?}: {}", one_line_stderr(&out));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        doc.as_array().expect("a list").iter().map(|j| j["id"].as_u64().expect("id")).collect::<Vec<u64>>()
    };
    assert_eq!(queue(&[], &["--user", "bo"]), [bo]);
    assert_eq!(queue(&[("USER", "ana")], &["--me"]), [ana]);
    assert_eq!(queue(&[("USER", "cy")], &["--me"]), Vec::<u64>::new());
    assert_eq!(queue(&[], &[]), [ana, bo]);

    let script = format!(
        "#!/bin/sh\n\
         #SBATCH -J inside\n\
         #SBATCH --output=inside.out\n\
         export CORRAL_ENDPOINT={endpoint}\n\
         squeue --me -t PD || echo squeue failed\n\
         scontrol show job > show.txt || echo show failed\n\
         sacct -j $SLURM_JOB_ID --format=JobID,JobName,Elapsed,State -X > sacct.txt || echo sacct failed\n\
         srun -n 2 true\n\
         sacct -n -P -o JobID,JobName,NTasks,State > steps.txt || echo sacct failed\n\
         sacct -o JobID,State --parsable2 -X -j {ana},$SLURM_JOB_ID,999999 > poll.txt || echo sacct failed\n\
         sinfo > sinfo.txt || echo sinfo failed\n\
         scancel {bo} || echo scancel failed\n\
         squeue -p gpu 2>&1 || echo refused\n\
         echo \"left=$(squeue -h -j $SLURM_JOB_ID -o %L) pending=$(squeue --me -h -t PD | wc -l)\"\n\
         squeue -j $SLURM_JOB_ID -O JobID:8,Name:10,State\n",
        endpoint = pool.addr
    );
    // `squeue -p` answers on stderr, sent to stdout here: the worker copies a job's stdout and
    // stderr into one `--output` file from two pipes, and does not keep their order between
    // them (Slurm writes both through one descriptor), so a refusal on stderr could land after
    // the `refused` that follows it on stdout.
    std::fs::write(dir.path().join("inside.sh"), script).expect("write");
    // The submitter's CORRAL_ENDPOINT is never exported: the script names the coordinator.
    let env = [("USER", "ana")];
    let job = submitted_id(&corral_in(&pool, dir.path(), &env, &["sbatch", "--parsable", "inside.sh"]));
    assert_eq!(ended(&pool, job)["state"], "succeeded");
    let output = std::fs::read_to_string(dir.path().join("inside.out")).expect("the output file");
    assert!(output.contains("ana-held") && !output.contains("bo-held"), "squeue --me lists my pending jobs: {output}");
    assert!(!output.contains("failed"), "{output}");
    let shown = std::fs::read_to_string(dir.path().join("show.txt")).expect("scontrol show job's output");
    assert!(shown.contains("inside") && shown.contains(&job.to_string()), "the job's own record: {shown}");
    let sacct = std::fs::read_to_string(dir.path().join("sacct.txt")).expect("sacct's output");
    assert!(sacct.contains("inside") && sacct.contains(&job.to_string()), "sacct shows the job: {sacct}");
    assert_eq!(sacct.lines().count(), 3, "a header, its dashes, the job's row (-X): {sacct}");
    let steps = std::fs::read_to_string(dir.path().join("steps.txt")).expect("sacct's steps");
    assert_eq!(
        steps,
        format!("{job}|inside||RUNNING\n{job}.batch|batch|1|RUNNING\n{job}.0|true|2|COMPLETED\n"),
        "the job, its batch step and its srun step, as sacct -n -P lists them"
    );
    // As submitit polls its jobs: several at once, one that does not exist left out.
    let poll = std::fs::read_to_string(dir.path().join("poll.txt")).expect("sacct's poll");
    assert_eq!(poll, format!("JobID|State\n{ana}|PENDING\n{job}|RUNNING\n"));
    let sinfo = std::fs::read_to_string(dir.path().join("sinfo.txt")).expect("sinfo's output");
    assert!(sinfo.contains("dev-node"), "sinfo lists the nodes: {sinfo}");
    assert!(output.contains("\nrefused\n") && output.contains("squeue: error: '-p' is not served here"), "{output}");
    // Slurm's columns: the time left of a job with the default limit (none: UNLIMITED), the
    // pending jobs of mine counted without the header, -O's fields as wide as asked.
    assert!(output.contains("\nleft=UNLIMITED pending=1\n"), "{output}");
    let header = format!("{:<8}{:<10}{:<20}\n{:<8}{:<10}{:<20}\n", "JOBID", "NAME", "STATE", job, "inside", "RUNNING");
    assert!(output.contains(&header), "{output}");
    assert_eq!(ended(&pool, bo)["state"], "cancelled", "scancel inside the job");
}

/// `#SBATCH --account`/`--qos` through the policy's `[slurm]` names: an account is its tenant, a
/// QOS its class, the default account that of a job naming none; an unknown name is refused
/// with one line listing the known ones, and `admin diff` names a change of them.
#[test]
fn accounts_and_qos_map_through_the_policy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = include_str!("../../../cluster-configs/dev-policy.toml");
    let naming = "\n[slurm]\naccounts = { \"proj_x\" = \"team-a\", \"proj_y\" = \"team-b\" }\n\
                  qos = { \"short\" = \"normal\", \"scavenger\" = \"preemptible\" }\n\
                  default-account = \"proj_y\"\n";
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, format!("{dev}{naming}")).expect("write");
    let pool = DevPool::start(&["--policy", policy.to_str().expect("utf-8")]);
    let sbatch = |directives: &str| {
        let script = format!("#!/bin/sh\n{directives}\necho \"account=$SLURM_JOB_ACCOUNT qos=$SLURM_JOB_QOS\"\n");
        std::fs::write(dir.path().join("job.sh"), script).expect("write");
        corral_in(&pool, dir.path(), &[], &["sbatch", "--parsable", "--hold", "job.sh"])
    };
    let job = submitted_id(&sbatch("#SBATCH -A proj_x\n#SBATCH --qos=scavenger"));
    let doc = pool.show(job);
    assert_eq!((doc["tenant"].as_str(), doc["priority"].as_str()), (Some("team-a"), Some("preemptible")), "{doc}");
    let job = submitted_id(&sbatch("#SBATCH --qos short"));
    let doc = pool.show(job);
    assert_eq!(
        (doc["tenant"].as_str(), doc["priority"].as_str()),
        (Some("team-b"), Some("normal")),
        "default account: {doc}"
    );
    for (directives, want) in [
        ("#SBATCH -A team-a", "unknown account 'team-a': the accounts are proj_x, proj_y"),
        ("#SBATCH -q long", "unknown QOS 'long': the QOS are scavenger, short"),
    ] {
        let out = sbatch(directives);
        assert!(!out.status.success(), "{directives} was accepted");
        let err = one_line_stderr(&out);
        assert!(err.contains(want), "{directives}: {err}");
    }
    // Without the names, the diff says what goes.
    let plain = dir.path().join("plain.toml");
    std::fs::write(&plain, dev).expect("write");
    let diff = pool.json(&["admin", "diff", "-f", plain.to_str().expect("utf-8")]);
    let changes: Vec<&str> = diff["changes"].as_array().expect("changes").iter().filter_map(|c| c.as_str()).collect();
    assert!(changes.contains(&"slurm.accounts: \"proj_x\" unset (was team-a)"), "{diff}");
    assert!(changes.contains(&"slurm: default-account unset (was proj_y)"), "{diff}");
}

/// Without `[slurm]` names in the policy, an account names a tenant and a QOS a class; a name
/// that names neither is kept as Slurm keeps accounts it does not enforce (its default): the job
/// runs as if it named none and still sees its account and QOS. Published scripts name their
/// site's accounts (`--account=project_2001659`) and QOS (`--qos=high`).
#[test]
fn unmapped_accounts_and_qos_are_kept_as_slurm_keeps_unenforced_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = DevPool::start(&["--gpus", "1"]);
    let sbatch = |directives: &str| {
        let script = format!(
            "#!/bin/sh\n{directives}\n#SBATCH --output=out-%j.txt\necho \"account=$SLURM_JOB_ACCOUNT qos=$SLURM_JOB_QOS\"\n"
        );
        std::fs::write(dir.path().join("job.sh"), script).expect("write");
        submitted_id(&corral_in(&pool, dir.path(), &[], &["sbatch", "--parsable", "job.sh"]))
    };
    let job = sbatch("#SBATCH --account=project_2001659\n#SBATCH --qos=high");
    assert_eq!(ended(&pool, job)["state"], "succeeded");
    let doc = pool.show(job);
    assert_eq!((doc["tenant"].as_str(), doc["priority"].as_str()), (Some("default"), Some("normal")), "{doc}");
    let output = std::fs::read_to_string(dir.path().join(format!("out-{job}.txt"))).expect("the output file");
    assert_eq!(output.trim(), "account=project_2001659 qos=high");
    // A name that is a tenant or a class is still that tenant or class.
    let job = sbatch("#SBATCH -A team-a\n#SBATCH -q preemptible");
    let doc = pool.show(job);
    assert_eq!((doc["tenant"].as_str(), doc["priority"].as_str()), (Some("team-a"), Some("preemptible")), "{doc}");
}

/// Inside a job `scontrol show job` and `squeue` reach the cluster without the script naming
/// it: a bare job's `CORRAL_ENDPOINT` is the coordinators its worker talks to. `scontrol show
/// job` prints Slurm's `Key=Value` lines, which scripts read with grep, awk and sed.
#[test]
fn slurm_commands_inside_a_job_find_the_cluster_themselves() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "#!/bin/sh\n\
                  #SBATCH -J unaided\n\
                  #SBATCH --output=unaided.out\n\
                  scontrol show job $SLURM_JOB_ID > show.txt || echo show failed\n\
                  squeue --me > queue.txt || echo squeue failed\n\
                  echo \"endpoint=$CORRAL_ENDPOINT\"\n\
                  # As published scripts read it: a copy of the script, the output file, the nodes.\n\
                  cp \"$(scontrol show job $SLURM_JOB_ID | awk -F= '/Command=/{print $2}')\" copy.sh || echo copy failed\n\
                  echo \"stdout=$(scontrol show job $SLURM_JOB_ID | grep -oP 'StdOut=\\K\\S+')\"\n\
                  echo \"one=$(scontrol -o show job | wc -l) $(scontrol show job -o | grep -o ' NodeList=[^ ]*')\"\n\
                  echo \"state=$(scontrol show job | sed -n 's/.*JobState=\\([A-Z]*\\).*/\\1/p')\"\n";
    std::fs::write(dir.path().join("job.sh"), script).expect("write");
    let job = submitted_id(&corral_in(&pool, dir.path(), &[("USER", "ana")], &["sbatch", "--parsable", "job.sh"]));
    assert_eq!(ended(&pool, job)["state"], "succeeded");
    let output = std::fs::read_to_string(dir.path().join("unaided.out")).expect("the output file");
    assert!(!output.contains("failed"), "{output}");
    assert!(output.contains(&format!("endpoint={}", pool.addr)), "the worker's coordinators: {output}");
    let shown = std::fs::read_to_string(dir.path().join("show.txt")).expect("scontrol show job's output");
    assert!(shown.starts_with(&format!("JobId={job} JobName=unaided\n")), "Slurm's format: {shown}");
    assert!(shown.contains("\n   NodeList=dev-node\n") && shown.contains("\n   BatchHost=dev-node\n"), "{shown}");
    let copy = std::fs::read_to_string(dir.path().join("copy.sh")).expect("the copy of the script");
    assert_eq!(copy, script, "Command= names the job's script");
    let stdout = dir.path().join("unaided.out").canonicalize().expect("canonical");
    let stdout_line = output.lines().find_map(|l| l.strip_prefix("stdout=")).expect("stdout= line");
    assert_eq!(Path::new(stdout_line).canonicalize().ok(), Some(stdout), "{output}");
    assert!(output.contains("\none=1  NodeList=dev-node\n"), "-o: one line: {output}");
    assert!(output.contains("\nstate=RUNNING\n"), "{output}");
    let queue = std::fs::read_to_string(dir.path().join("queue.txt")).expect("squeue's output");
    assert!(queue.contains(&job.to_string()), "squeue --me lists the running job: {queue}");
}

/// `sbatch` inside a job submits the next job of a chain (`--dependency=afterok:$SLURM_JOB_ID`):
/// it runs after its parent, with its own allocation's variables and no secret of the parent's.
#[test]
fn sbatch_inside_a_job_chains_the_next_one() {
    let pool = DevPool::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let first = "#!/bin/bash\n\
                 #SBATCH -J first\n\
                 #SBATCH --gpus-per-task=1\n\
                 #SBATCH --output=first.out\n\
                 next=$(sbatch --parsable --dependency=afterok:$SLURM_JOB_ID next.sh) || echo sbatch failed\n\
                 echo \"next=$next\"\n";
    let next = "#!/bin/bash\n\
                #SBATCH -J next\n\
                #SBATCH --output=next.out\n\
                echo \"job=$SLURM_JOB_ID name=$SLURM_JOB_NAME gpt=${SLURM_GPUS_PER_TASK-unset}\"\n";
    std::fs::write(dir.path().join("first.sh"), first).expect("write");
    std::fs::write(dir.path().join("next.sh"), next).expect("write");
    let job = submitted_id(&corral_in(&pool, dir.path(), &[], &["sbatch", "--parsable", "first.sh"]));
    assert_eq!(ended(&pool, job)["state"], "succeeded");
    let output = std::fs::read_to_string(dir.path().join("first.out")).expect("first's output");
    let next: u64 = output
        .lines()
        .find_map(|l| l.strip_prefix("next="))
        .and_then(|id| id.trim().parse().ok())
        .unwrap_or_else(|| panic!("the next job's id: {output:?}"));
    let doc = ended(&pool, next);
    assert_eq!(doc["state"], "succeeded", "{doc}");
    let shown = pool.ok(&["show", &next.to_string()]);
    assert!(!shown.contains("CORRAL_RUN_SECRET"), "no run secret in the next job: {shown}");
    let out = std::fs::read_to_string(dir.path().join("next.out")).expect("next's output");
    assert_eq!(out, format!("job={next} name=next gpt=unset\n"), "its own variables, none of the parent's");
}
