//! The corpus: batch scripts published by real projects (`tests/corpus/slurm/`, their origin
//! and licence in `SOURCES.md`) run unchanged under `corral sbatch` on a coordinator and four
//! simulated-GPU workers. Stand-ins for the programs they call (`python`, `torchrun`,
//! `accelerate`, `module`, `conda`, `uv`, `ray` ...) come first on the submitter's `PATH`
//! after corral's own in-job commands; each records its arguments and the environment a real
//! launcher reads. Every script is checked for what Slurm would do: the job ends as it would,
//! the batch part ran once on the allocation's first node, each `srun` launched the right
//! number of tasks with distinct ranks on the right nodes with the GPUs the directives give
//! them, and the output went where `--output` says. The node lists they read through
//! `scontrol` are checked against Slurm's own `scontrol` where slurm-wlm is installed.

use corral_integration::cluster::{free_port, Cluster, ClusterOptions};
use corral_integration::worker::WorkerProc;
use corral_integration::{corral_bin, one_line_stderr};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// GPUs of each simulated worker (the corpus asks for up to 8 a node).
const GPUS_PER_NODE: u32 = 8;
/// Programs the scripts call that the test stands in for.
const STAND_INS: [&str; 14] = [
    "python",
    "python3",
    "torchrun",
    "accelerate",
    "module",
    "conda",
    "uv",
    "kernprof",
    "nvidia-smi",
    "get_free_port",
    "dcgmi",
    "ray",
    "ml",
    "trl",
];
/// The variables each stand-in records.
const RECORDED: [&str; 22] = [
    "SLURM_JOB_GPUS",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "SLURMD_NODENAME",
    "SLURM_JOB_NODELIST",
    "SLURM_GPUS_ON_NODE",
    "SLURM_CPUS_PER_TASK",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_ARRAY_TASK_ID",
    "CUDA_VISIBLE_DEVICES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "PWD",
];

/// One run of a stand-in: its program, arguments and recorded variables (absent: unset).
#[derive(Debug, Clone)]
struct Record {
    prog: String,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
}

impl Record {
    fn var(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }

    fn in_step(&self) -> bool {
        self.var("SLURM_STEP_ID").is_some()
    }

    /// The value after `flag` (`--flag value` or `--flag=value`).
    fn arg(&self, flag: &str) -> Option<&str> {
        let prefix = format!("{flag}=");
        self.argv.iter().enumerate().find_map(|(i, a)| {
            if a == flag {
                self.argv.get(i + 1).map(String::as_str)
            } else {
                a.strip_prefix(&prefix)
            }
        })
    }

    fn gpus(&self) -> usize {
        self.var("CUDA_VISIBLE_DEVICES").map_or(0, |v| v.split(',').filter(|g| !g.is_empty()).count())
    }
}

/// What one `srun` of a script should launch: `tasks` tasks of `prog`, `per_node` a node, on
/// `nodes` nodes, each seeing `gpus` GPUs.
struct StepWant {
    prog: &'static str,
    tasks: usize,
    nodes: usize,
    gpus: usize,
}

/// One corpus script, how it is submitted and what Slurm would do with it.
struct Case {
    file: &'static str,
    /// Options before the script (as a user types them: `sbatch --nodes=2 x.slurm`).
    sbatch: &'static [&'static str],
    /// The script's own arguments.
    args: &'static [&'static str],
    /// Where the batch step's output goes (`{j}`: the job id), relative to the submit directory.
    output: &'static str,
    /// Nodes of the allocation.
    nodes: usize,
    /// Stand-ins the batch part runs, each once, on the first node.
    batch: &'static [&'static str],
    /// GPUs the batch part sees (checked on its first stand-in).
    batch_gpus: Option<usize>,
    /// Lines the batch part writes once each (prefix match).
    once: &'static [&'static str],
    steps: &'static [StepWant],
    /// Further checks of the launchers' arguments.
    extra: fn(&Run) -> Result<(), String>,
}

/// A finished job of the corpus as the test saw it.
struct Run {
    job: u64,
    nodes: Vec<String>,
    records: Vec<Record>,
    output: String,
}

impl Run {
    fn of(&self, prog: &str) -> Vec<&Record> {
        self.records.iter().filter(|r| r.prog == prog).collect()
    }
}

fn no_extra(_: &Run) -> Result<(), String> {
    Ok(())
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

/// Every task of `prog` was told the rendezvous at the head node (`flag`'s value starts with it).
fn rendezvous_at_head(run: &Run, prog: &str, flag: &str, want: &str) -> Result<(), String> {
    let records = run.of(prog);
    check(!records.is_empty(), || format!("{prog} never ran"))?;
    for r in records {
        let got = r.arg(flag).unwrap_or("");
        check(got.starts_with(want), || format!("{prog} {flag} {got:?}, want {want:?}..."))?;
    }
    Ok(())
}

const CASES: &[Case] = &[
    Case {
        file: "01-princeton-single-gpu.slurm",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 1,
        batch: &["module", "module", "conda", "kernprof"],
        batch_gpus: Some(1),
        once: &["Running on host"],
        steps: &[],
        extra: |run| {
            let k = &run.of("kernprof")[0];
            check(k.argv.first().map(String::as_str) == Some("-o"), || format!("{:?}", k.argv))?;
            check(k.argv.get(1) == Some(&format!("{}.lprof", run.job)), || format!("SLURM_JOBID: {:?}", k.argv))?;
            check(run.output.contains(&format!("SLURM_JOB_ID={}", run.job)), || "printenv lists the job".into())
        },
    },
    Case {
        file: "02-princeton-ddp-two-nodes.slurm",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 2,
        batch: &["get_free_port", "module", "module", "conda"],
        batch_gpus: Some(2),
        once: &["WORLD_SIZE=4", "MASTER_ADDR=w"],
        steps: &[StepWant { prog: "python", tasks: 4, nodes: 2, gpus: 2 }],
        extra: |run| {
            for r in run.of("python") {
                check(r.var("MASTER_ADDR") == Some(run.nodes[0].as_str()), || format!("MASTER_ADDR {r:?}"))?;
                check(r.var("MASTER_PORT") == Some("31337"), || format!("MASTER_PORT from get_free_port: {r:?}"))?;
                check(r.var("WORLD_SIZE") == Some("4"), || format!("WORLD_SIZE {r:?}"))?;
            }
            Ok(())
        },
    },
    Case {
        file: "03-princeton-lightning.slurm",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 1,
        batch: &["module", "module", "conda"],
        batch_gpus: Some(2),
        once: &[],
        steps: &[StepWant { prog: "python", tasks: 2, nodes: 1, gpus: 2 }],
        extra: no_extra,
    },
    Case {
        file: "04-mila-pytorch-setup.sh",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 1,
        batch: &["uv"],
        batch_gpus: Some(1),
        once: &["Date:", "Hostname:"],
        steps: &[],
        extra: |run| {
            let uv = &run.of("uv")[0];
            check(uv.argv == ["run", "python", "main.py"], || format!("{:?}", uv.argv))
        },
    },
    Case {
        file: "05-pytorch-ddp-tutorial.sh",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 4,
        batch: &[],
        batch_gpus: None,
        once: &["Node IP: 127.0.0.1"],
        steps: &[StepWant { prog: "torchrun", tasks: 4, nodes: 4, gpus: 1 }],
        extra: |run| rendezvous_at_head(run, "torchrun", "--rdzv_endpoint", "127.0.0.1:29500"),
    },
    Case {
        file: "06-pytorch-mingpt.sh",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 2,
        batch: &[],
        batch_gpus: None,
        once: &["Node IP: 127.0.0.1"],
        steps: &[StepWant { prog: "torchrun", tasks: 2, nodes: 2, gpus: 1 }],
        extra: |run| rendezvous_at_head(run, "torchrun", "--rdzv_endpoint", "127.0.0.1:29500"),
    },
    Case {
        file: "07-accelerate-multigpu.sh",
        sbatch: &[],
        args: &[],
        output: "O-multigpu.{j}",
        nodes: 1,
        batch: &["accelerate"],
        batch_gpus: Some(4),
        once: &[],
        steps: &[],
        extra: |run| {
            let a = &run.of("accelerate")[0];
            check(a.arg("--num_processes") == Some("4"), || format!("{:?}", a.argv))
        },
    },
    Case {
        file: "08-accelerate-multinode.sh",
        sbatch: &[],
        args: &[],
        output: "O-multinode.{j}",
        nodes: 4,
        batch: &[],
        batch_gpus: None,
        once: &[],
        steps: &[StepWant { prog: "accelerate", tasks: 4, nodes: 4, gpus: 4 }],
        extra: |run| {
            rendezvous_at_head(run, "accelerate", "--main_process_ip", &run.nodes[0])?;
            rendezvous_at_head(run, "accelerate", "--num_machines", "4")?;
            rendezvous_at_head(run, "accelerate", "--num_processes", "16")
        },
    },
    Case {
        file: "09-accelerate-multinode-fsdp.sh",
        sbatch: &[],
        args: &[],
        output: "O-multinode.{j}",
        nodes: 4,
        batch: &[],
        batch_gpus: None,
        once: &[],
        steps: &[StepWant { prog: "accelerate", tasks: 4, nodes: 4, gpus: 4 }],
        extra: |run| {
            rendezvous_at_head(run, "accelerate", "--main_process_ip", &run.nodes[0])?;
            rendezvous_at_head(run, "accelerate", "--config_file", "/accelerate/examples/slurm/fsdp_config.yaml")
        },
    },
    Case {
        file: "10-accelerate-multicpu.sh",
        sbatch: &[],
        args: &[],
        output: "O-multicpu.{j}",
        nodes: 2,
        batch: &["accelerate"],
        batch_gpus: None,
        // MASTER_PORT: corral sets the job's rendezvous port, which the script keeps.
        once: &["head_node_ip=w", "MASTER_PORT=", "CCL_WORKER_COUNT=2"],
        steps: &[],
        extra: |run| {
            let a = &run.of("accelerate")[0];
            check(a.arg("--main_process_ip") == Some(run.nodes[0].as_str()), || format!("{:?}", a.argv))?;
            check(a.arg("--num_machines") == Some("2"), || format!("{:?}", a.argv))?;
            check(a.arg("--mpirun_hostfile") == Some("hostfile"), || format!("{:?}", a.argv))?;
            let hosts = std::fs::read_to_string(a.var("PWD").unwrap_or_default().to_string() + "/hostfile");
            check(hosts.as_deref().ok() == Some(&*format!("{}\n{}\n", run.nodes[0], run.nodes[1])), || {
                format!("the hostfile lists the nodes: {hosts:?}")
            })
        },
    },
    Case {
        file: "11-ray-basic.sh",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 4,
        batch: &["python"],
        batch_gpus: None,
        once: &["IP Head: 127.0.0.1:6379", "Starting HEAD at w"],
        // Four steps of one task each, one a node (the head and three workers).
        steps: &[StepWant { prog: "ray", tasks: 1, nodes: 1, gpus: 0 }],
        extra: |run| {
            let rays = run.of("ray");
            let nodes: BTreeSet<&str> = rays.iter().filter_map(|r| r.var("SLURMD_NODENAME")).collect();
            check(rays.len() == 4 && nodes.len() == 4, || format!("one ray a node: {rays:?}"))?;
            let head = rays.iter().filter(|r| r.argv.iter().any(|a| a == "--head")).collect::<Vec<_>>();
            check(head.len() == 1 && head[0].var("SLURMD_NODENAME") == Some(run.nodes[0].as_str()), || {
                format!("the head on the first node: {head:?}")
            })?;
            for r in &rays {
                check(r.arg("--num-cpus") == Some("5"), || format!("SLURM_CPUS_PER_TASK: {:?}", r.argv))?;
            }
            let py = &run.of("python")[0];
            check(py.argv == ["-u", "simple-trainer.py", "5"], || format!("{:?}", py.argv))
        },
    },
    Case {
        file: "12-torchtitan-multinode.slurm",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 4,
        batch: &["dcgmi", "dcgmi"],
        batch_gpus: None,
        once: &["Node IP: 127.0.0.1"],
        steps: &[StepWant { prog: "torchrun", tasks: 4, nodes: 4, gpus: 8 }],
        extra: |run| rendezvous_at_head(run, "torchrun", "--rdzv_endpoint", "127.0.0.1:29500"),
    },
    Case {
        file: "13-alignment-handbook.slurm",
        sbatch: &[],
        args: &["--model", "zephyr-7b-beta", "--task", "sft", "--config", "demo", "--accelerator", "zero3"],
        output: "logs/handbook-{j}.out",
        nodes: 1,
        batch: &["module"],
        batch_gpus: Some(8),
        once: &["Gradient accumulation steps: 4", "TOTAL JOB TIME"],
        steps: &[StepWant { prog: "accelerate", tasks: 1, nodes: 1, gpus: 8 }],
        extra: |run| {
            rendezvous_at_head(run, "accelerate", "--main_process_ip", &run.nodes[0])?;
            rendezvous_at_head(run, "accelerate", "--num_processes", "8")?;
            rendezvous_at_head(run, "accelerate", "--config_file", "recipes/accelerate_configs/zero3.yaml")
        },
    },
    Case {
        file: "14-open-r1-train.slurm",
        sbatch: &["--nodes=2"],
        args: &["Qwen2.5-1.5B-Instruct", "sft", "demo", "zero3"],
        output: "logs/open-r1-sft-{j}.out",
        nodes: 2,
        batch: &["module"],
        batch_gpus: Some(8),
        once: &["Gradient accumulation steps: 4", "END TIME"],
        steps: &[StepWant { prog: "accelerate", tasks: 2, nodes: 2, gpus: 8 }],
        extra: |run| {
            rendezvous_at_head(run, "accelerate", "--main_process_ip", &run.nodes[0])?;
            rendezvous_at_head(run, "accelerate", "--num_processes", "16")?;
            let ranks: BTreeSet<&str> = run.of("accelerate").iter().filter_map(|r| r.arg("--machine_rank")).collect();
            check(ranks == BTreeSet::from(["0", "1"]), || format!("each node its machine rank: {ranks:?}"))
        },
    },
    Case {
        file: "15-princeton-tensorflow.slurm",
        sbatch: &[],
        args: &[],
        output: "slurm-{j}.out",
        nodes: 1,
        batch: &["module", "module", "conda", "python"],
        batch_gpus: Some(2),
        once: &[],
        steps: &[],
        extra: no_extra,
    },
];

/// A coordinator and workers w1..w4, 8 simulated L40S GPUs each, room for the CPUs and memory
/// the corpus asks for, and the partitions it names.
fn pool(dir: &Path) -> (Cluster, Vec<WorkerProc>) {
    let cluster = Cluster::start(1, ClusterOptions::default());
    let init = cluster.corral_at(0, &["cluster", "init"]);
    assert!(init.status.success(), "cluster init: {}", one_line_stderr(&init));
    let mut workers = Vec::new();
    for name in ["w1", "w2", "w3", "w4"] {
        let port = free_port();
        let mut w = WorkerProc::configure(dir, name, &cluster.endpoints(), GPUS_PER_NODE);
        w.edit_config(|c| {
            format!(
                "rendezvous-ports = \"{port}-{port}\"\npartitions = [\"hopper-prod\", \"train\"]\n{}\n\
                 [resources]\ncpus = 192\nmemory = \"1TiB\"\n",
                c.replace("RTX 5090", "NVIDIA L40S")
            )
        });
        w.start();
        w.wait_registered(&cluster);
        workers.push(w);
    }
    (cluster, workers)
}

/// A stand-in: records its variables (those set) and arguments, one file a run.
const STAND_IN: &str = r#"#!/bin/sh
# Stand-in for @PROG@: records its arguments and launcher variables.
f=@RECORDS@/@PROG@.$$.$(date +%s%N)
{
for v in@VARS@; do
  eval "set_=\${$v+x}"
  if [ -n "$set_" ]; then eval "printf '%s=%s\n' $v \"\$$v\""; fi
done
for a in "$@"; do printf 'arg=%s\n' "$a"; done
} > "$f.tmp" && mv "$f.tmp" "$f"
@BEHAVIOUR@"#;

/// Writes the stand-ins into `bin`, recording into `records`.
fn stand_ins(bin: &Path, records: &Path) {
    for prog in STAND_INS {
        let vars: String = RECORDED.iter().map(|v| format!(" {v}")).collect();
        let behaviour = match prog {
            "get_free_port" => "echo 31337\n",
            // A ray node blocks until its job ends.
            "ray" => "case \" $* \" in *\" --block \"*) exec sleep 600;; esac\n",
            "nvidia-smi" => "echo 'GPU 0: NVIDIA L40S (stand-in)'\n",
            _ => "",
        };
        let text = STAND_IN
            .replace("@PROG@", prog)
            .replace("@RECORDS@", &records.display().to_string())
            .replace("@VARS@", &vars)
            .replace("@BEHAVIOUR@", behaviour);
        let path = bin.join(prog);
        std::fs::write(&path, text).expect("write stand-in");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
}

fn read_records(records: &Path) -> Vec<Record> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(records).expect("records") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if name.ends_with(".tmp") {
            continue;
        }
        let prog = name.split('.').next().unwrap_or_default().to_string();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let mut r = Record { prog, argv: Vec::new(), env: BTreeMap::new() };
        for line in text.lines() {
            if let Some(a) = line.strip_prefix("arg=") {
                r.argv.push(a.to_string());
            } else if let Some((k, v)) = line.split_once('=') {
                r.env.insert(k.to_string(), v.to_string());
            }
        }
        out.push(r);
    }
    out
}

/// The submit directory a user of the corpus would have: the scripts' relative files.
fn submit_dir(root: &Path, bin: &Path) -> PathBuf {
    let work = root.join("work");
    std::fs::create_dir(&work).expect("mkdir");
    // The Hugging Face scripts source it by name: it puts the environment's programs on PATH.
    let activate = format!("export PATH={}:\"$PATH\"\n", bin.display());
    std::fs::write(work.join("activateEnvironment.sh"), activate).expect("write");
    for d in ["logs", "openr1/bin", "handbook/bin", "recipes/accelerate_configs"] {
        std::fs::create_dir_all(work.join(d)).expect("mkdir");
    }
    for venv in ["openr1", "handbook"] {
        std::fs::write(work.join(venv).join("bin/activate"), "# a virtual environment\n").expect("write");
    }
    let config = "model_name_or_path: org/model\nmodel_revision: main\ngradient_accumulation_steps: 4\n";
    for (model, task) in [("zephyr-7b-beta", "sft"), ("Qwen2.5-1.5B-Instruct", "sft")] {
        let d = work.join("recipes").join(model).join(task);
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("config_demo.yaml"), config).expect("write");
    }
    std::fs::write(work.join("recipes/accelerate_configs/zero3.yaml"), "distributed_type: DEEPSPEED\n").expect("write");
    chmod_tree(&work, 0o777);
    work
}

fn chmod_tree(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    if path.is_dir() {
        for entry in std::fs::read_dir(path).expect("read_dir") {
            chmod_tree(&entry.expect("entry").path(), mode);
        }
    }
}

/// Runs one case: submits the script from `work` and checks what Slurm would do.
fn run_case(cluster: &Cluster, case: &Case, env: &Env, workers: &[WorkerProc]) -> Result<(), String> {
    for entry in std::fs::read_dir(&env.records).expect("records") {
        let _ = std::fs::remove_file(entry.expect("entry").path());
    }
    let script = env.corpus.join(case.file);
    let mut cmd = Command::new(corral_bin());
    cmd.current_dir(&env.work)
        .env("PATH", format!("{}:{}", env.bin.display(), std::env::var("PATH").unwrap_or_default()))
        .env("HOME", &env.home)
        .env("TERM", "xterm")
        .env("USER", "ana")
        .args(["--endpoint", &cluster.nodes[0].addr, "sbatch", "--parsable"])
        .args(case.sbatch)
        .arg(&script)
        .args(case.args);
    let out = cmd.output().expect("run corral sbatch");
    if !out.status.success() {
        return Err(format!("sbatch refused it: {}", one_line_stderr(&out)));
    }
    let warnings = String::from_utf8_lossy(&out.stderr).to_string();
    let job: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("sbatch --parsable printed {:?}: {e}", String::from_utf8_lossy(&out.stdout)))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let doc = loop {
        let doc = cluster.show(job);
        if doc["state"] != "pending" && doc["state"] != "running" {
            break doc;
        }
        if std::time::Instant::now() > deadline {
            let _ = cluster.corral_at(0, &["cancel", &job.to_string()]);
            return Err(format!("job {job} did not end within 120 s: {doc}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output_path = env.work.join(case.output.replace("{j}", &job.to_string()));
    let output = std::fs::read_to_string(&output_path).unwrap_or_default();
    let logs = || {
        workers
            .iter()
            .map(WorkerProc::log)
            .map(|l| l.lines().rev().take(20).collect::<Vec<_>>().join("\n"))
            .collect::<Vec<_>>()
            .join("\n--\n")
    };
    if doc["state"] != "succeeded" {
        return Err(format!("job {job} {}: {}\noutput:\n{output}\n{}", doc["state"], doc["reason"], logs()));
    }
    check(output_path.exists(), || format!("no output file {}", output_path.display()))?;
    let records = read_records(&env.records);
    let nodelist = records.iter().find_map(|r| r.var("SLURM_JOB_NODELIST").map(str::to_string));
    let nodes = match nodelist {
        Some(list) => corral_types::hostlist::expand(&list).map_err(|e| format!("SLURM_JOB_NODELIST {list:?}: {e}"))?,
        None => doc["nodes"]
            .as_array()
            .map(|n| n.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
            .unwrap_or_default(),
    };
    let run = Run { job, nodes, records, output };
    if std::env::var_os("CORPUS_SHOW").is_some() {
        eprintln!("== {} (job {job}, nodes {:?})\nsbatch: {warnings}\n{}", case.file, run.nodes, run.output);
        for r in &run.records {
            eprintln!("   {} {:?} {:?}", r.prog, r.argv, r.env);
        }
    }
    let ctx = |e: String| format!("{e}\noutput:\n{}", run.output);
    check(run.nodes.len() == case.nodes, || format!("{} nodes, want {}: {:?}", run.nodes.len(), case.nodes, run.nodes))
        .map_err(ctx)?;
    // The batch part: once, on the first node.
    let batch: Vec<&Record> = run.records.iter().filter(|r| !r.in_step()).collect();
    let mut got: Vec<&str> = batch.iter().map(|r| r.prog.as_str()).collect();
    got.sort_unstable();
    let mut want: Vec<&str> = case.batch.to_vec();
    want.sort_unstable();
    check(got == want, || format!("the batch part ran {got:?}, want {want:?}")).map_err(ctx)?;
    for r in &batch {
        check(r.var("SLURMD_NODENAME") == run.nodes.first().map(String::as_str), || {
            format!("the batch part ran on {:?}, not the first node {:?}", r.var("SLURMD_NODENAME"), run.nodes.first())
        })
        .map_err(ctx)?;
        check(r.var("SLURM_JOB_ID") == Some(&job.to_string()), || format!("SLURM_JOB_ID {r:?}")).map_err(ctx)?;
    }
    if let (Some(gpus), Some(first)) = (case.batch_gpus, batch.first()) {
        check(first.gpus() == gpus, || format!("the batch part sees {} GPUs, want {gpus}: {first:?}", first.gpus()))
            .map_err(ctx)?;
        check(first.var("SLURM_JOB_GPUS") == first.var("CUDA_VISIBLE_DEVICES").filter(|_| gpus > 0), || {
            format!("SLURM_JOB_GPUS names the batch node's GPUs: {first:?}")
        })
        .map_err(ctx)?;
    }
    for line in case.once {
        // As a terminal shows the file: a script's `clear` leaves its escape sequence (no
        // newline) at the start of the next line written, as under Slurm.
        let n = run.output.lines().filter(|l| without_escapes(l).starts_with(line)).count();
        check(n == 1, || format!("{line:?} written {n} times, want once")).map_err(ctx)?;
    }
    // Each srun: its tasks, ranks, nodes and GPUs.
    for want in case.steps {
        let mut by_step: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
        for r in run.records.iter().filter(|r| r.in_step() && r.prog == want.prog) {
            by_step.entry(r.var("SLURM_STEP_ID").unwrap_or_default()).or_default().push(r);
        }
        check(!by_step.is_empty(), || format!("no srun step ran {}", want.prog)).map_err(ctx)?;
        for (step, tasks) in by_step {
            let what = |e: String| ctx(format!("step {job}.{step} of {}: {e}", want.prog));
            check(tasks.len() == want.tasks, || format!("{} tasks, want {}", tasks.len(), want.tasks)).map_err(what)?;
            let ranks: BTreeSet<usize> = tasks.iter().filter_map(|r| r.var("SLURM_PROCID")?.parse().ok()).collect();
            check(ranks == (0..want.tasks).collect(), || format!("SLURM_PROCID {ranks:?}")).map_err(what)?;
            let mut per_node: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
            for t in &tasks {
                check(t.var("SLURM_NTASKS") == Some(&want.tasks.to_string()), || format!("SLURM_NTASKS {t:?}"))
                    .map_err(what)?;
                check(t.gpus() == want.gpus, || format!("{} GPUs, want {}: {t:?}", t.gpus(), want.gpus))
                    .map_err(what)?;
                per_node.entry(t.var("SLURMD_NODENAME").unwrap_or_default()).or_default().push(t);
            }
            check(per_node.len() == want.nodes, || {
                format!("tasks on {:?}, want {} nodes", per_node.keys(), want.nodes)
            })
            .map_err(what)?;
            for (node, tasks) in per_node {
                check(run.nodes.iter().any(|n| n == node), || format!("a task on {node}, outside the allocation"))
                    .map_err(what)?;
                let local: BTreeSet<usize> =
                    tasks.iter().filter_map(|r| r.var("SLURM_LOCALID")?.parse().ok()).collect();
                check(local == (0..tasks.len()).collect(), || format!("SLURM_LOCALID on {node}: {local:?}"))
                    .map_err(what)?;
                let node_id = run.nodes.iter().position(|n| n == node).map(|i| i.to_string());
                for t in &tasks {
                    check(t.var("SLURM_NODEID").map(str::to_string) == node_id, || format!("SLURM_NODEID {t:?}"))
                        .map_err(what)?;
                }
                if want.gpus > 0 && tasks.len() > 1 && want.gpus * tasks.len() <= GPUS_PER_NODE as usize {
                    // Bound per task: distinct GPUs; else every task sees the node's.
                    let all: BTreeSet<&str> =
                        tasks.iter().filter_map(|t| t.var("CUDA_VISIBLE_DEVICES")).flat_map(|v| v.split(',')).collect();
                    check(all.len() == want.gpus * tasks.len() || all.len() == want.gpus, || {
                        format!("GPUs on {node}: {all:?}")
                    })
                    .map_err(what)?;
                }
            }
        }
    }
    (case.extra)(&run).map_err(ctx)
}

/// `line` without its terminal escape sequences (`ESC [ ... final byte`).
fn without_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Where a case's files are.
struct Env {
    corpus: PathBuf,
    work: PathBuf,
    bin: PathBuf,
    home: PathBuf,
    records: PathBuf,
}

/// Scripts that do not yet run as Slurm runs them, each with why; the test checks they still
/// fail, so that one that starts working is taken off this list.
const KNOWN_GAPS: &[(&str, &str)] = &[];

#[test]
fn published_batch_scripts_run_as_slurm_runs_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/slurm");
    let bin = dir.path().join("bin");
    let home = dir.path().join("home");
    let records = dir.path().join("records");
    for d in [&bin, &home, &records] {
        std::fs::create_dir(d).expect("mkdir");
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    }
    std::fs::write(home.join(".bashrc"), "# an interactive shell's settings\n").expect("write");
    std::fs::set_permissions(home.join(".bashrc"), std::fs::Permissions::from_mode(0o644)).expect("chmod");
    stand_ins(&bin, &records);
    let work = submit_dir(dir.path(), &bin);
    let env = Env { corpus: corpus.clone(), work, bin, home, records };
    let listed: BTreeSet<String> = std::fs::read_dir(&corpus)
        .expect("corpus")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n != "SOURCES.md")
        .collect();
    let cased: BTreeSet<String> = CASES.iter().map(|c| c.file.to_string()).collect();
    assert_eq!(listed, cased, "every corpus script has a case");
    let only = std::env::var("CORPUS_ONLY").ok();
    let (cluster, workers) = pool(dir.path());
    let mut ran = 0;
    let mut failures = Vec::new();
    for case in CASES {
        if only.as_deref().is_some_and(|o| !case.file.contains(o)) {
            continue;
        }
        let result = run_case(&cluster, case, &env, &workers);
        let gap = KNOWN_GAPS.iter().find(|(f, _)| *f == case.file);
        match (result, gap) {
            (Ok(()), None) => {
                ran += 1;
                eprintln!("corpus: {} ran as Slurm runs it", case.file);
            }
            (Ok(()), Some(_)) => failures.push(format!("{}: runs now; take it off KNOWN_GAPS", case.file)),
            (Err(e), Some((_, why))) => eprintln!("corpus: {} is a known gap ({why}): {e}", case.file),
            (Err(e), None) => failures.push(format!("{}: {e}", case.file)),
        }
    }
    eprintln!("corpus: {ran} of {} scripts ran as Slurm runs them", CASES.len());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Node lists as the corpus scripts read them, side by side with Slurm's own `scontrol` (from
/// slurm-wlm, with a minimal slurm.conf: these subcommands need no controller): corral's
/// `scontrol show hostnames|hostlist` answers exactly as Slurm's does. Without Slurm's
/// `scontrol` the test skips loudly (fails under `CI=true`).
#[test]
fn scontrol_node_lists_match_slurms() {
    let Some(slurm) = ["/usr/bin/scontrol", "/usr/local/bin/scontrol"].into_iter().map(Path::new).find(|p| p.exists())
    else {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "Slurm's scontrol is missing (install slurm-wlm)");
        eprintln!("SKIPPED scontrol_node_lists_match_slurms: Slurm's scontrol is not installed (slurm-wlm)");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("slurm.conf");
    std::fs::write(
        &conf,
        "ClusterName=c\nSlurmctldHost=localhost\nNodeName=w[1-4] CPUs=1\nPartitionName=p Nodes=ALL\n",
    )
    .expect("write");
    let ours = dir.path().join("scontrol");
    std::os::unix::fs::symlink(corral_bin(), &ours).expect("symlink");
    let run = |program: &Path, what: &str, list: &str| {
        let out = Command::new(program)
            .args(["show", what, list])
            .env("SLURM_CONF", &conf)
            .env_remove("CORRAL_RUN_SECRET")
            .output()
            .expect("scontrol");
        assert!(out.status.success(), "{} show {what} {list}: {}", program.display(), one_line_stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let lists = [
        "w[1-4]",
        "gpu-[01-04,07],cpu1",
        "n[001-010]",
        "node[9-11]",
        "x1,x2,x10,x3",
        "a[1-2]-b[1-2]",
        "h[08-11]",
        "w4,w3,w1",
        "rack1-n[1-2],rack2-n[1-2]",
        "dev-node,dev-node-2",
    ];
    for list in lists {
        assert_eq!(run(&ours, "hostnames", list), run(slurm, "hostnames", list), "show hostnames {list}");
        let names = run(slurm, "hostnames", list).lines().collect::<Vec<_>>().join(",");
        assert_eq!(run(&ours, "hostlist", &names), run(slurm, "hostlist", &names), "show hostlist {names}");
    }
}
