//! Distributed training on gangs, on real processes: a coordinator and two workers. The parts of
//! a 2-node gang meet over TCP at MASTER_ADDR:MASTER_PORT (from the first node's
//! `rendezvous-ports`) and exchange their RANKs; `corral logs --rank N` and `--all-ranks` read
//! each part's output from its own node. A part that fails stops the other and the gang is
//! restarted as a whole under `max-restarts`, then fails.

use corral_client::{Client, ClientConfig};
use corral_integration::cluster::{free_port, Cluster};
use corral_integration::one_line_stderr;
use corral_integration::worker::WorkerProc;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

/// A coordinator and workers w1 and w2 (2 simulated GPUs each) offering only `port` to gangs.
fn pool(port: u16) -> (Cluster, Vec<WorkerProc>, tempfile::TempDir) {
    corral_integration::worker::two_node_pool(port)
}

fn logs(cluster: &Cluster, args: &[&str]) -> String {
    let mut command = vec!["logs"];
    command.extend_from_slice(args);
    let out = cluster.corral_at(0, &command);
    assert!(out.status.success(), "logs {args:?}: {}", one_line_stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_parts_of_a_gang_meet_at_master_addr_and_port_and_each_rank_has_its_logs() {
    let port = free_port();
    let (cluster, workers, _dir) = pool(port);
    let probe = env!("CARGO_BIN_EXE_rendezvous_probe");
    let job = cluster.json(&["submit", "--gpus", "4", "--gpus-per-node", "2", "--", probe])["id"].as_u64().expect("id");
    let done =
        cluster.wait_for(job, Duration::from_secs(90), "ended", |d| d["state"] != "pending" && d["state"] != "running");
    let all = logs(&cluster, &[&job.to_string(), "--all-ranks"]);
    assert_eq!(done["state"], "succeeded", "{done}\n{all}\n{}\n{}", workers[0].log(), workers[1].log());

    // Rank 0 runs on the first node, where the gang meets, on the one port it offers.
    let rank0 = logs(&cluster, &[&job.to_string()]);
    let rank1 = logs(&cluster, &[&job.to_string(), "--rank", "1"]);
    assert!(rank0.contains(&format!("rank 0 node_rank 0 of 2 world 4 local 2 meets at 127.0.0.1:{port}")), "{rank0}");
    assert!(rank0.contains("rank 0 met rank 2"), "{rank0}");
    assert!(rank1.contains(&format!("rank 2 node_rank 1 of 2 world 4 local 2 meets at 127.0.0.1:{port}")), "{rank1}");
    assert!(rank1.contains("rank 2 met rank 0"), "{rank1}");
    assert!(!rank1.contains("node_rank 0"), "--rank 1 is only part 1's output: {rank1}");
    assert!(rank0.contains("hostfile: 127.0.0.1 slots=2\nhostfile: 127.0.0.1 slots=2\n"), "{rank0}");

    // --all-ranks: every line of both parts, with its rank.
    for line in rank0.lines() {
        assert!(all.contains(&format!("[rank 0] {line}\n")), "{line:?} in {all}");
    }
    for line in rank1.lines() {
        assert!(all.contains(&format!("[rank 1] {line}\n")), "{line:?} in {all}");
    }
    assert!(all.lines().all(|l| l.starts_with("[rank 0] ") || l.starts_with("[rank 1] ")), "{all}");
    let followed = logs(&cluster, &[&job.to_string(), "--all-ranks", "-f"]);
    assert_eq!(followed.lines().count(), all.lines().count(), "{followed}");

    // A rank beyond the parts is a one-line error.
    let out = cluster.corral_at(0, &["logs", &job.to_string(), "--rank", "2"]);
    assert!(!out.status.success());
    let err = one_line_stderr(&out);
    assert!(err.contains(&format!("job {job} has 2 ranks (0-1): there is no rank 2")), "{err}");
    let single = cluster.json(&["submit", "--gpus", "1", "--", "true"])["id"].as_u64().expect("id");
    let out = cluster.corral_at(0, &["logs", &single.to_string(), "--rank", "1"]);
    assert!(one_line_stderr(&out).contains("runs on one node: there is no rank 1"), "{}", one_line_stderr(&out));
}

#[test]
fn a_failed_part_stops_the_gang_which_restarts_as_a_whole_then_fails() {
    let (cluster, _workers, _dir) = pool(free_port());
    let client = Client::new(ClientConfig::new(vec![cluster.endpoints()])).expect("client");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    // Part 1 fails at once; part 0 would run for a minute unless it is stopped.
    let script = "echo attempt $CORRAL_ATTEMPT rank $NODE_RANK; if [ \"$NODE_RANK\" = 1 ]; then exit 1; fi; sleep 60";
    let mut spec = corral_integration::trivial_job("gang");
    spec.gpus = 4;
    spec.command = vec!["sh".into(), "-c".into(), script.into()].into();
    spec.sched.gpus_per_node = Some(2);
    spec.sched.max_restarts = Some(1);
    let job = rt.block_on(client.submit(&spec)).expect("submit").job_id;

    let failed = cluster.wait_for(job, Duration::from_secs(90), "failed", |d| d["state"] == "failed");
    let record = rt.block_on(client.get_job(job)).expect("job");
    assert_eq!((record.attempts, record.restarts), (2, 1), "{failed}");
    let reason = record.reason.clone().unwrap_or_default();
    assert!(reason.starts_with("exit code 1 (on node w") && reason.ends_with(", after 1 restart"), "{reason}");
    // The second attempt ran both parts, and part 0 was stopped long before its minute.
    let all = logs(&cluster, &[&job.to_string(), "--all-ranks"]);
    assert!(all.contains("[rank 0] attempt 2 rank 0\n") && all.contains("[rank 1] attempt 2 rank 1\n"), "{all}");
    let run_ms = record.worker_run_time_ms.unwrap_or(u64::MAX);
    assert!(run_ms < 30_000, "part 0 was stopped when part 1 failed, not after its sleep: {run_ms} ms");
}

/// Slurm's batch step: a 2-node batch job runs its script once, on the allocation's first node,
/// with the node list (first node first, as `scontrol show hostnames` reads it there), writes
/// its output file once, and ends with the script's exit code while the other node only held
/// its part.
#[test]
fn a_batch_script_runs_once_on_the_first_node_with_the_node_list() {
    let (cluster, workers, dir) = pool(free_port());
    for (name, code) in [("ok", 0), ("failing", 3)] {
        let out_dir = dir.path().join(name);
        std::fs::create_dir(&out_dir).expect("mkdir");
        std::fs::set_permissions(&out_dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let script = out_dir.join("train.sbatch");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\n\
                 #SBATCH --job-name={name}\n\
                 #SBATCH --nodes=2\n\
                 #SBATCH --gpus-per-node=2\n\
                 #SBATCH --output={out}/slurm-%j.out\n\
                 \n\
                 head=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n\
                 echo \"batch on $SLURMD_NODENAME of $SLURM_JOB_NODELIST ($SLURM_JOB_NUM_NODES nodes) head $head\"\n\
                 touch {out}/ran-on-$SLURMD_NODENAME\n\
                 exit {code}\n",
                out = out_dir.display()
            ),
        )
        .expect("write");
        let submitted = cluster.corral_at(0, &["sbatch", &script.display().to_string()]);
        assert!(submitted.status.success(), "{}", one_line_stderr(&submitted));
        let job: u64 = String::from_utf8_lossy(&submitted.stdout).trim().parse().expect("a job id");
        let done = cluster
            .wait_for(job, Duration::from_secs(90), "ended", |d| d["state"] != "pending" && d["state"] != "running");
        let want = if code == 0 { "succeeded" } else { "failed" };
        assert_eq!(done["state"], want, "{done}\n{}\n{}", workers[0].log(), workers[1].log());
        assert_eq!(done["exit_code"], code, "the batch step's exit code is the job's: {done}");

        let output = std::fs::read_to_string(out_dir.join(format!("slurm-{job}.out"))).expect("the output file");
        let lines: Vec<&str> = output.lines().collect();
        assert_eq!(lines.len(), 1, "the script ran once and only it wrote the file: {output:?}");
        let (line, head) = lines[0].split_once(" (2 nodes) head ").unwrap_or_else(|| panic!("{output:?}"));
        let (first, list) =
            line.strip_prefix("batch on ").and_then(|l| l.split_once(" of ")).unwrap_or_else(|| panic!("{output:?}"));
        assert_eq!(head, first, "scontrol show hostnames | head -n 1 is the batch node: {output:?}");
        let nodes = corral_types::hostlist::expand(list).expect("a hostlist");
        assert_eq!(nodes.len(), 2, "{list}");
        assert_eq!(nodes[0], first, "the batch step runs on the list's first node: {list}");
        assert!(nodes.contains(&"w1".to_string()) && nodes.contains(&"w2".to_string()), "{list}");
        let ran: Vec<String> = std::fs::read_dir(&out_dir)
            .expect("ls")
            .filter_map(|e| e.ok()?.file_name().into_string().ok()?.strip_prefix("ran-on-").map(str::to_string))
            .collect();
        assert_eq!(ran, [first.to_string()], "the script ran on the first node only");

        // Listed like sacct: the batch step, on the first node, with the script's exit code.
        let shown = cluster.json(&["show", &job.to_string()]);
        let batch = &shown["steps"][0];
        assert_eq!(batch["id"], format!("{job}.batch"), "{shown}");
        assert_eq!((&batch["nodes"], &batch["exit_code"]), (&serde_json::json!(first), &serde_json::json!(code)));
        let history = cluster.json(&["history"]);
        let row = history.as_array().and_then(|a| a.iter().find(|j| j["id"] == job)).expect("in the history");
        assert_eq!(row["steps"][0]["id"], format!("{job}.batch"), "{row}");
    }
}
