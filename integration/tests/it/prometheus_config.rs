//! The monitoring files in cluster-configs/: promtool accepts the scrape config and the rules,
//! the rules' unit tests pass, every alert has a firing and a quiet unit test, and the rules,
//! their tests and the Grafana dashboard query only metrics of the metrics contract (or the
//! recording rules). Needs `promtool` (Debian package `prometheus`); without it the promtool
//! checks are skipped loudly, except under CI (`CI` set), where they fail.

use serde_json::Value;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Every series name the coordinators and workers export, as scraped (counters with `_total`).
const CONTRACT: &[&str] = &[
    "corral_raft_term",
    "corral_raft_is_leader",
    "corral_raft_leader_id",
    "corral_raft_commit_index",
    "corral_raft_applied_index",
    "corral_tso_timestamps_total",
    "corral_jobs",
    "corral_jobs_pending_by_reason",
    "corral_job_oldest_pending_seconds",
    "corral_placements_total",
    "corral_preemptions_total",
    "corral_node_up",
    "corral_pool_gpus",
    "corral_tenant_gpus_allocated",
    "corral_billing_cost_micros",
    "corral_billing_gpu_seconds",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_XID_ERRORS",
    "corral_gpu_dirty",
    "corral_gpu_healthy",
    "corral_worker_heartbeat_age_seconds",
    "corral_worker_jobs_running",
    "corral_job_memory_bytes",
    "corral_job_cpu_seconds_total",
];

/// Histograms of the contract; they are scraped as `_bucket`, `_sum` and `_count` series.
const HISTOGRAMS: &[&str] = &["corral_scheduling_pass_duration_seconds"];

/// Series Prometheus itself writes for every target.
const PROMETHEUS_SERIES: &[&str] = &["up"];

fn prometheus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster-configs/prometheus")
}

fn grafana_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster-configs/grafana")
}

/// Files of `dir` whose name ends with `suffix`, sorted.
fn files_ending(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("dir entry").path())
        .filter(|path| path.is_file() && path.to_string_lossy().ends_with(suffix))
        .collect();
    files.sort();
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whether promtool is installed. Missing, it says so on the terminal (past the test harness's
/// capture) once, or fails under CI.
fn have_promtool() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    let found = *FOUND.get_or_init(|| {
        let problem = match Command::new("promtool").arg("--version").output() {
            Ok(output) if output.status.success() => return true,
            Ok(output) => format!("`promtool --version` failed ({})", output.status),
            Err(e) => format!("promtool: {e}"),
        };
        let banner = "!".repeat(78);
        let _ = writeln!(
            std::io::stderr(),
            "\n{banner}\nSKIPPING the promtool checks of cluster-configs/prometheus: {problem}\n\
             Install it with `apt-get install prometheus` (.ci/run does).\n{banner}\n"
        );
        false
    });
    assert!(found || std::env::var_os("CI").is_none(), "promtool is required under CI (Debian package prometheus)");
    found
}

/// Runs promtool with `args`, fails with its whole output unless it succeeds, and returns it.
fn promtool(args: &[&str]) -> String {
    let output = Command::new("promtool").args(args).output().expect("run promtool");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "promtool {} failed ({}):\n{text}", args.join(" "), output.status);
    text
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// The rules of a Prometheus rules file, read line by line (the files here keep to this shape):
/// `- alert: NAME` or `- record: NAME`, and an `expr:` on one line or as a `|`/`>` block.
#[derive(Debug)]
struct Rule {
    name: String,
    alert: bool,
    expr: String,
}

fn parse_rules(text: &str) -> Vec<Rule> {
    let mut rules: Vec<Rule> = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            rules.push(Rule { name: name.trim().to_string(), alert: true, expr: String::new() });
        } else if let Some(name) = trimmed.strip_prefix("- record:") {
            rules.push(Rule { name: name.trim().to_string(), alert: false, expr: String::new() });
        } else if let Some(value) = trimmed.strip_prefix("expr:") {
            let rule = rules.last_mut().unwrap_or_else(|| panic!("expr outside a rule: {line}"));
            let value = value.trim();
            rule.expr = if value.starts_with('|') || value.starts_with('>') {
                let mut block = Vec::new();
                while let Some(next) = lines.next_if(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                {
                    block.push(next.trim());
                }
                block.join(" ")
            } else {
                value.trim_matches(|c| c == '"' || c == '\'').to_string()
            };
        }
    }
    for rule in &rules {
        assert!(!rule.expr.is_empty(), "rule {} has no expr", rule.name);
    }
    rules
}

fn rules() -> Vec<Rule> {
    parse_rules(&read(&prometheus_dir().join("rules.yml")))
}

/// The metric names a PromQL expression selects: identifiers outside strings, label matchers,
/// range selectors and grouping labels that are not function names, keywords or numbers.
fn metric_names(expr: &str) -> Vec<String> {
    // Operators and aggregations (which may take `by (...)` before their parenthesis).
    const KEYWORDS: &str = "and or unless bool offset atan2 inf nan \
        sum min max avg group stddev stdvar count count_values bottomk topk quantile";
    const GROUPING: &str = "by without on ignoring group_left group_right";
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    // From an opening quote to just past its match.
    let skip_string = |mut i: usize| -> usize {
        let quote = chars[i];
        i += 1;
        while i < chars.len() && chars[i] != quote {
            i += if chars[i] == '\\' { 2 } else { 1 };
        }
        assert!(i < chars.len(), "unterminated string in {expr}");
        i + 1
    };
    // From an opening bracket to just past its match, stepping over quoted strings.
    let skip_group = |mut i: usize, open: char, close: char| -> usize {
        let mut depth = 0;
        while i < chars.len() {
            match chars[i] {
                '"' | '\'' | '`' => {
                    i = skip_string(i);
                    continue;
                }
                c if c == open => depth += 1,
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return i + 1;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        panic!("unbalanced {open} in {expr}");
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '{' {
            i = skip_group(i, '{', '}');
        } else if c == '[' {
            i = skip_group(i, '[', ']');
        } else if c == '"' || c == '\'' || c == '`' {
            i = skip_string(i);
        } else if c == '$' || c.is_ascii_digit() || c == '.' {
            // A Grafana variable or a number (1e6, 0.99): not a metric.
            i += 1;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let called = next < chars.len() && chars[next] == '(';
            if GROUPING.split_whitespace().any(|g| g == word) {
                if called {
                    i = skip_group(next, '(', ')');
                }
            } else if !called && !KEYWORDS.split_whitespace().any(|k| k.eq_ignore_ascii_case(&word)) {
                names.push(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Names a query may use: the contract's series, Prometheus' own, and the recording rules.
fn known_names() -> BTreeSet<String> {
    let mut known: BTreeSet<String> = CONTRACT.iter().chain(PROMETHEUS_SERIES).map(|n| n.to_string()).collect();
    for histogram in HISTOGRAMS {
        for suffix in ["_bucket", "_sum", "_count"] {
            known.insert(format!("{histogram}{suffix}"));
        }
    }
    known.extend(rules().into_iter().filter(|rule| !rule.alert).map(|rule| rule.name));
    known
}

/// Names in `expr` that are not known, each with where it was found.
fn unknown_names(expr: &str, known: &BTreeSet<String>, place: &str, problems: &mut Vec<String>) {
    let names = metric_names(expr);
    if names.is_empty() {
        problems.push(format!("{place}: no metric found in `{expr}`"));
    }
    for name in names.into_iter().filter(|name| !known.contains(name)) {
        problems.push(format!("{place}: `{name}` is not in the metrics contract nor a recording rule (`{expr}`)"));
    }
}

/// Every panel of a dashboard, rows and the panels inside collapsed rows included.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    let mut panels = Vec::new();
    let mut stack: Vec<&Value> = dashboard["panels"].as_array().expect("panels").iter().collect();
    while let Some(panel) = stack.pop() {
        stack.extend(panel["panels"].as_array().into_iter().flatten());
        panels.push(panel);
    }
    panels
}

/// Every query of a dashboard: (where, PromQL). Variable queries give their metric selector.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    for panel in all_panels(dashboard).into_iter().filter(|panel| panel["type"] != "row") {
        let title = panel["title"].as_str().unwrap_or("untitled");
        let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
        assert!(!targets.is_empty(), "panel '{title}' has no query");
        for target in targets {
            let expr = target["expr"].as_str().unwrap_or_else(|| panic!("panel '{title}': a target without expr"));
            queries.push((format!("panel '{title}'"), expr.to_string()));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().expect("templating.list") {
        if variable["type"] != "query" {
            continue;
        }
        let query = variable["query"]["query"].as_str().or(variable["query"].as_str()).expect("variable query");
        let selector = query
            .strip_prefix("label_values(")
            .and_then(|rest| rest.rsplit_once(','))
            .map_or(query, |(selector, _label)| selector);
        queries.push((format!("variable '{}'", variable["name"].as_str().unwrap_or_default()), selector.to_string()));
    }
    queries
}

fn dashboards() -> Vec<(PathBuf, Value)> {
    let files = files_ending(&grafana_dir(), ".json");
    assert!(!files.is_empty(), "no dashboard in cluster-configs/grafana");
    files
        .into_iter()
        .map(|path| {
            let value = serde_json::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, value)
        })
        .collect()
}

#[test]
fn metric_names_skips_functions_labels_and_variables() {
    let expr = r#"histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="{y}", le=~"$v"}[$__rate_interval])))
        / on (instance) group_left (node) b_total * 1e6 and on() max(c:rec) == bool 1 unless $var
        or label_replace(d, "dst", "$1 (x", "src", "(.*)") or sum without (gpu) (e offset 5m)"#;
    assert_eq!(metric_names(expr), ["a_bucket", "b_total", "c:rec", "d", "e"]);
}

#[test]
fn every_monitoring_file_is_checked() {
    // What the tests below read; anything else would be a file no test parses.
    let mut unchecked = Vec::new();
    for entry in std::fs::read_dir(prometheus_dir()).expect("cluster-configs/prometheus") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if !["prometheus.yml", "rules.yml", "README.md", "tests"].contains(&name.as_str()) {
            unchecked.push(path);
        }
    }
    for dir in [prometheus_dir().join("tests"), grafana_dir()] {
        let suffix = if dir == grafana_dir() { ".json" } else { ".yml" };
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("dir entry").path();
            if !(path.is_file() && path.to_string_lossy().ends_with(suffix)) {
                unchecked.push(path);
            }
        }
    }
    assert!(unchecked.is_empty(), "files no test checks (add a check to prometheus_config.rs): {unchecked:?}");
}

#[test]
fn promtool_accepts_config_rules_and_unit_tests() {
    if !have_promtool() {
        return;
    }
    let dir = prometheus_dir();
    promtool(&["check", "config", path_arg(&dir.join("prometheus.yml"))]);
    let output = promtool(&["check", "rules", path_arg(&dir.join("rules.yml"))]);
    // The line reader above sees the same rules as Prometheus does.
    let count = rules().len();
    assert!(output.contains(&format!("SUCCESS: {count} rules found")), "expected {count} rules:\n{output}");
    let tests = files_ending(&dir.join("tests"), ".yml");
    assert!(!tests.is_empty(), "no promtool unit tests in cluster-configs/prometheus/tests");
    for test in tests {
        promtool(&["test", "rules", path_arg(&test)]);
    }
}

#[test]
fn dcgm_exporter_example_is_valid_once_uncommented() {
    if !have_promtool() {
        return;
    }
    let dir = prometheus_dir();
    let text = read(&dir.join("prometheus.yml"));
    let (before, rest) = text.split_once("# BEGIN dcgm-exporter example").expect("BEGIN dcgm-exporter marker");
    let (example, after) = rest.split_once("# END dcgm-exporter example").expect("END dcgm-exporter marker");
    let uncommented: String = example.lines().skip(1).map(|line| format!("{}\n", line.replacen("# ", "", 1))).collect();
    assert!(uncommented.contains("job_name: dcgm-exporter"), "{uncommented}");
    let rules = dir.join("rules.yml").canonicalize().expect("rules.yml");
    let config = format!("{}{uncommented}{after}", before.trim_end_matches(' '))
        .replace("  - rules.yml", &format!("  - {}", rules.display()));
    let temp = tempfile::tempdir().expect("tempdir");
    let path = temp.path().join("prometheus.yml");
    std::fs::write(&path, config).expect("write config");
    let output = promtool(&["check", "config", path_arg(&path)]);
    assert!(output.contains("is valid prometheus config file syntax"), "{output}");
}

#[test]
fn every_alert_has_a_firing_and_a_quiet_unit_test() {
    // In the test files, an `alertname:` line is followed by its `exp_alerts:`; `[]` is a case
    // where the alert must not fire, anything else (a list, an alias to one) one where it fires.
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for test in files_ending(&prometheus_dir().join("tests"), ".yml") {
        let mut alert = None;
        for line in read(&test).lines().map(str::trim) {
            if let Some(name) = line.strip_prefix("alertname:") {
                alert = Some(name.trim().to_string());
            } else if let Some(expected) = line.strip_prefix("exp_alerts:") {
                let name = alert.take().unwrap_or_else(|| panic!("{}: exp_alerts before alertname", test.display()));
                if expected.trim() == "[]" { &mut quiet } else { &mut firing }.insert(name);
            }
        }
    }
    let mut missing = Vec::new();
    for rule in rules().into_iter().filter(|rule| rule.alert) {
        if !firing.contains(&rule.name) {
            missing.push(format!("{}: no case where it fires", rule.name));
        }
        if !quiet.contains(&rule.name) {
            missing.push(format!("{}: no case where it stays quiet", rule.name));
        }
    }
    assert!(
        missing.is_empty(),
        "alerts without promtool unit tests in cluster-configs/prometheus/tests:\n{}",
        missing.join("\n")
    );
}

#[test]
fn rules_and_their_tests_use_contract_metrics() {
    let known = known_names();
    let mut problems = Vec::new();
    for rule in rules() {
        unknown_names(&rule.expr, &known, &format!("rules.yml {}", rule.name), &mut problems);
    }
    for test in files_ending(&prometheus_dir().join("tests"), ".yml") {
        for line in read(&test).lines().map(str::trim) {
            if let Some(series) = line.strip_prefix("- series:") {
                let series = series.trim().trim_matches(|c| c == '\'' || c == '"');
                let name = series.split('{').next().unwrap_or_default();
                if !known.contains(name) {
                    problems.push(format!("{}: input series `{name}` is not in the metrics contract", test.display()));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn dashboard_queries_use_contract_metrics_and_the_datasource_variable() {
    let known = known_names();
    let mut problems = Vec::new();
    for (path, dashboard) in dashboards() {
        let file = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        let variables: Vec<&Value> =
            dashboard["templating"]["list"].as_array().expect("templating.list").iter().collect();
        let ds = variables.iter().find(|v| v["name"] == "DS_PROMETHEUS").expect("a DS_PROMETHEUS variable");
        assert_eq!((&ds["type"], &ds["query"]), (&Value::from("datasource"), &Value::from("prometheus")), "{file}");
        for (place, expr) in dashboard_queries(&dashboard) {
            unknown_names(&expr, &known, &format!("{file} {place}"), &mut problems);
        }
        let mut ids = BTreeSet::new();
        for panel in all_panels(&dashboard) {
            let title = panel["title"].as_str().unwrap_or("untitled");
            assert!(ids.insert(panel["id"].as_u64().expect("panel id")), "{file}: duplicate id of panel '{title}'");
            if panel["type"] != "row" {
                let targets = panel["targets"].as_array().into_iter().flatten();
                for source in std::iter::once(&panel["datasource"]).chain(targets.map(|t| &t["datasource"])) {
                    if source["uid"] != "${DS_PROMETHEUS}" {
                        problems.push(format!("{file} panel '{title}': datasource {source} is not ${{DS_PROMETHEUS}}"));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn dashboard_queries_parse() {
    if !have_promtool() {
        return;
    }
    // promtool parses PromQL when it checks rules: one recording rule per query, with Grafana's
    // variables replaced by what they expand to.
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (path, dashboard) in dashboards() {
        for (place, expr) in dashboard_queries(&dashboard) {
            let expr = expr.replace("$__rate_interval", "5m").replace("$Hostname", ".*").replace("$tenant", ".*");
            let record = format!("{}: {place}", path.display());
            file.push_str(&format!(
                "      - record: dashboard_query\n        labels: {{ query: {} }}\n",
                Value::from(record)
            ));
            file.push_str(&format!("        expr: {}\n", Value::from(expr)));
        }
    }
    let temp = tempfile::tempdir().expect("tempdir");
    let path = temp.path().join("dashboard-queries.yml");
    std::fs::write(&path, file).expect("write");
    promtool(&["check", "rules", path_arg(&path)]);
}
