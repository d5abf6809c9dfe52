//! Metrics of a `corral dev` pool: `/metrics` shows Raft, the queue and every GPU under the
//! names of the metrics contract, an injected overheat shows through, `corral top` sees the
//! pool, and a real Prometheus loading the alert rules fires GPUOverheat.

use corral_integration::{http_get, metric_value, DevPool};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Scrapes until `check` holds on the text (bounded); the failure shows the last scrape.
fn scrape_until(pool: &DevPool, what: &str, check: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = pool.scrape();
        if check(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "metrics never showed {what}; last scrape:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_value(text, name, labels).unwrap_or_else(|| panic!("no {name}{labels:?} in:\n{text}"))
}

#[test]
fn dev_pool_metrics_show_raft_jobs_gpus_and_an_injected_overheat() {
    let pool = DevPool::start_with_metrics(&["--gpus", "2"]);
    let text = pool.scrape();
    assert_eq!(value(&text, "corral_raft_is_leader", &[]), 1.0);
    assert_eq!(value(&text, "corral_raft_leader_id", &[]), 1.0);
    assert!(value(&text, "corral_raft_term", &[]) >= 1.0, "{text}");
    let applied = value(&text, "corral_raft_applied_index", &[]);
    assert!(applied > 0.0 && value(&text, "corral_raft_commit_index", &[]) >= applied, "{text}");
    assert!(value(&text, "corral_tso_timestamps_total", &[]) > 0.0, "{text}");
    assert_eq!(value(&text, "corral_node_up", &[("node", "dev-node")]), 1.0);
    assert_eq!(value(&text, "corral_pool_gpus", &[("state", "total")]), 2.0);
    for gpu in ["0", "1"] {
        let labels =
            [("gpu", gpu), ("device", &format!("nvidia{gpu}")), ("modelName", "RTX 5090"), ("Hostname", "dev-node")];
        assert_eq!(value(&text, "DCGM_FI_DEV_GPU_TEMP", &labels), 35.0, "an idle simulated gpu is at 35 C");
        assert!(text.contains(&format!("DCGM_FI_DEV_GPU_TEMP{{gpu=\"{gpu}\",UUID=\"GPU-")), "{text}");
        assert_eq!(value(&text, "corral_gpu_healthy", &[("gpu", gpu)]), 1.0);
    }

    // One job runs on one GPU; one waits for two.
    let running = pool.submit(&["--gpus", "1", "--", "sleep", "1000"]);
    pool.wait_for(running, "running", |d| d["state"] == "running");
    let waiting = pool.submit(&["--gpus", "2", "--", "true"]);
    let job_labels = |state: &'static str| [("tenant", "default"), ("priority_class", "normal"), ("state", state)];
    let text = scrape_until(&pool, "one running and one pending job", |t| {
        metric_value(t, "corral_jobs", &job_labels("running")) == Some(1.0)
            && metric_value(t, "corral_jobs", &job_labels("pending")) == Some(1.0)
            && metric_value(t, "corral_jobs_pending_by_reason", &[("reason", "resources")]) == Some(1.0)
            && metric_value(t, "corral_worker_jobs_running", &[("Hostname", "dev-node")]) == Some(1.0)
    });
    assert_eq!(value(&text, "corral_pool_gpus", &[("state", "allocated")]), 1.0);
    assert_eq!(value(&text, "corral_pool_gpus", &[("state", "free")]), 1.0);
    assert_eq!(value(&text, "corral_tenant_gpus_allocated", &[("tenant", "default")]), 1.0);
    assert!(value(&text, "corral_placements_total", &[]) >= 1.0, "{text}");
    assert!(value(&text, "corral_scheduling_pass_duration_seconds_count", &[]) >= 1.0, "{text}");
    let id = running.to_string();
    let job = [("job_id", id.as_str()), ("tenant", "default"), ("Hostname", "dev-node")];
    assert!(value(&text, "corral_job_memory_bytes", &job) >= 0.0);
    assert!(metric_value(&text, "corral_job_cpu_seconds_total", &job).is_some(), "{text}");

    // GPU 1 overheats: the temperature series shows the injected value and the GPU turns unhealthy.
    pool.write_faults("[[gpu]]\nindex = 1\ntemperature-c = 95\n");
    let text = scrape_until(&pool, "gpu 1 at 95 C and unhealthy", |t| {
        metric_value(t, "DCGM_FI_DEV_GPU_TEMP", &[("gpu", "1")]) == Some(95.0)
            && metric_value(t, "corral_gpu_healthy", &[("gpu", "1")]) == Some(0.0)
            && metric_value(t, "corral_pool_gpus", &[("state", "unhealthy")]) == Some(1.0)
    });
    assert_eq!(value(&text, "corral_gpu_healthy", &[("gpu", "0")]), 1.0, "the other gpu stays healthy");

    // corral top sees the same pool.
    let top = pool.json(&["top", "--once"]);
    let nodes = top["nodes"].as_array().unwrap_or_else(|| panic!("no nodes in {top}"));
    assert_eq!(nodes.len(), 1, "{top}");
    assert_eq!(nodes[0]["name"], "dev-node");
    let gpu1 = &nodes[0]["gpus"][1];
    assert_eq!((gpu1["temperature_c"].as_u64(), gpu1["state"].as_str()), (Some(95), Some("unhealthy")), "{top}");
    let queue: Vec<&Value> = top["queue"].as_array().expect("queue").iter().collect();
    assert_eq!(queue.len(), 1, "{top}");
    assert_eq!(
        (queue[0]["tenant"].as_str(), queue[0]["pending"].as_u64(), queue[0]["running"].as_u64()),
        (Some("default"), Some(1), Some(1))
    );
    assert_eq!(top["running"][0]["id"].as_u64(), Some(running), "{top}");

    for job in [running, waiting] {
        pool.ok(&["cancel", &job.to_string()]);
    }
}

/// The Prometheus binary, or `None` (with a loud message) where it is not installed outside CI.
fn prometheus_binary() -> Option<PathBuf> {
    let candidates = std::env::var_os("PROMETHEUS_BIN").map(PathBuf::from).into_iter().chain(
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).map(|d| d.join("prometheus")).collect::<Vec<_>>())
            .unwrap_or_default(),
    );
    if let Some(bin) = candidates.into_iter().find(|p| p.is_file()) {
        return Some(bin);
    }
    if std::env::var_os("CI").is_some() {
        panic!("prometheus is not installed: CI must install the Debian package `prometheus` (see .ci/run)");
    }
    eprintln!(
        "\n!!!!!!!!\n!!! SKIPPING prometheus_fires_gpu_overheat_from_the_alert_rules: no `prometheus` binary \
         (install the Debian package `prometheus`; in CI this test fails instead)\n!!!!!!!!\n"
    );
    None
}

/// The alert rules with every `for:` shortened to 2 s, so a test sees alerts fire within
/// seconds instead of minutes; the expressions are untouched.
fn rules_with_short_for(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let shortened: Vec<String> = text
        .lines()
        .map(|line| {
            let indent = &line[..line.len() - line.trim_start().len()];
            if line.trim_start().starts_with("for:") {
                format!("{indent}for: 2s")
            } else {
                line.to_string()
            }
        })
        .collect();
    shortened.join("\n") + "\n"
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Kills the Prometheus process when the test ends, passing or not.
struct Prometheus {
    child: Child,
    log: PathBuf,
}

impl Prometheus {
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GETs a Prometheus API path until `done` holds on its JSON answer (bounded by `within`).
fn poll_api(prom: &Prometheus, addr: &str, path: &str, within: Duration, what: &str, done: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + within;
    let mut last = String::from("(no answer yet)");
    loop {
        if let Ok((_, body)) = http_get(addr, path) {
            if serde_json::from_str::<Value>(&body).is_ok_and(|doc| done(&doc)) {
                return;
            }
            last = body;
        }
        assert!(
            Instant::now() < deadline,
            "{what} not seen within {within:?}; last answer of GET {path}:\n{last}\nprometheus log:\n{}",
            prom.log_tail()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn prometheus_fires_gpu_overheat_from_the_alert_rules() {
    let Some(bin) = prometheus_binary() else { return };
    let pool = DevPool::start_with_metrics(&["--gpus", "2"]);
    let metrics = pool.metrics_addr.clone().expect("metrics address");
    let dir = tempfile::tempdir().expect("tempdir");
    let rules_file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster-configs/prometheus/rules.yml");
    let rules = dir.path().join("rules.yml");
    std::fs::write(&rules, rules_with_short_for(&rules_file)).expect("write rules");
    // `corral dev` serves the coordinator's and the worker's series on one listener: both
    // scrape jobs of the contract read it, as they would read separate daemons.
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: corral-coordinator\n    static_configs:\n      - targets: ['{metrics}']\n\
             \x20 - job_name: corral-worker\n    static_configs:\n      - targets: ['{metrics}']\n",
            rules = rules.display()
        ),
    )
    .expect("write prometheus.yml");
    let web = format!("127.0.0.1:{}", free_port());
    let log = dir.path().join("prometheus.log");
    let child = Command::new(&bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--web.listen-address={web}"))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let prom = Prometheus { child, log };

    // The rules loaded and the target is scraped (so the alert below comes from fresh data).
    poll_api(&prom, &web, "/api/v1/rules", Duration::from_secs(60), "the GPUOverheat rule", |doc| {
        doc["data"]["groups"].as_array().is_some_and(|groups| {
            groups.iter().flat_map(|g| g["rules"].as_array().into_iter().flatten()).any(|r| r["name"] == "GPUOverheat")
        })
    });
    let temp_query = "/api/v1/query?query=DCGM_FI_DEV_GPU_TEMP";
    poll_api(&prom, &web, temp_query, Duration::from_secs(60), "a scraped GPU temperature", |doc| {
        doc["data"]["result"].as_array().is_some_and(|r| !r.is_empty())
    });
    let alerts = "/api/v1/alerts";
    let firing = |doc: &Value| {
        doc["data"]["alerts"].as_array().is_some_and(|alerts| {
            alerts.iter().any(|a| a["labels"]["alertname"] == "GPUOverheat" && a["state"] == "firing")
        })
    };
    let (_, before) = http_get(&web, alerts).expect("alerts");
    assert!(!firing(&serde_json::from_str(&before).expect("json")), "GPUOverheat fired before any overheat: {before}");

    pool.write_faults("[[gpu]]\nindex = 0\ntemperature-c = 95\n");
    poll_api(&prom, &web, alerts, Duration::from_secs(60), "GPUOverheat firing", firing);
}

/// `corral dev --nodes 2 --metrics-addr`: one document with every worker's series, each family
/// once (a second `# TYPE` line of a family is refused by Prometheus's parser).
#[test]
fn a_dev_pool_of_two_nodes_exports_both_workers_series() {
    let pool = DevPool::start_with_metrics(&["--gpus", "1", "--nodes", "2"]);
    let text = scrape_until(&pool, "both workers' GPUs", |t| {
        ["dev-node", "dev-node-2"]
            .iter()
            .all(|host| metric_value(t, "DCGM_FI_DEV_GPU_TEMP", &[("gpu", "0"), ("Hostname", host)]).is_some())
    });
    for host in ["dev-node", "dev-node-2"] {
        assert_eq!(value(&text, "corral_gpu_healthy", &[("gpu", "0"), ("Hostname", host)]), 1.0);
        assert!(metric_value(&text, "corral_worker_heartbeat_age_seconds", &[("Hostname", host)]).is_some(), "{text}");
    }
    for family in ["DCGM_FI_DEV_GPU_TEMP", "corral_gpu_healthy", "corral_worker_jobs_running"] {
        let types = text.lines().filter(|l| l.starts_with(&format!("# TYPE {family} "))).count();
        assert_eq!(types, 1, "{family} is declared {types} times:\n{text}");
    }
}
