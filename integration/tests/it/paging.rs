//! Paged listings on a real `corral dev` pool: `corral jobs` with `--limit`, `--page-token`
//! and the server-side filters (state, name, submit time), and their bad input.

use corral_client::{Client, ClientConfig};
use corral_integration::{one_line_stderr, trivial_job, DevPool};
use serde_json::Value;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime")
}

fn held(name: &str) -> corral_types::JobSpec {
    let mut spec = trivial_job(name);
    spec.sched.hold = true;
    spec
}

fn ids(doc: &Value) -> Vec<u64> {
    doc.as_array().unwrap_or_else(|| panic!("not an array: {doc}")).iter().filter_map(|j| j["id"].as_u64()).collect()
}

#[test]
fn jobs_are_listed_page_by_page_with_server_side_filters() {
    let pool = DevPool::start(&[]);
    let rt = runtime();
    let client = Client::new(ClientConfig::new(vec![pool.addr.clone()])).expect("client");
    // Held jobs stay pending: the listing does not change under the test.
    let batch = |names: Vec<String>| {
        let jobs: Vec<(String, corral_types::JobSpec)> = names.iter().map(|n| (format!("rid-{n}"), held(n))).collect();
        let results = rt.block_on(client.submit_batch(&jobs)).expect("batch");
        results.into_iter().map(|r| r.expect("accepted").job_id).collect::<Vec<u64>>()
    };
    let early = batch((0..15).map(|i| format!("train-{i}")).collect());
    let between = pool.ok(&["ts"]).trim().to_string();
    let late = batch((0..10).map(|i| format!("eval-{i}")).collect());
    let every: Vec<u64> = early.iter().chain(&late).copied().collect();

    // Without --limit: every page, still one JSON array.
    assert_eq!(ids(&pool.json(&["jobs"])), every);

    // --limit pages through in id order; the tokens chain to the end exactly once.
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut args = vec!["jobs", "--limit", "10"];
        if let Some(t) = &token {
            args.extend(["--page-token", t.as_str()]);
        }
        let doc = pool.json(&args);
        let page = ids(&doc["jobs"]);
        assert!(page.len() <= 10, "{doc}");
        seen.extend(page);
        pages += 1;
        match doc["next_page_token"].as_str() {
            Some(next) => token = Some(next.to_string()),
            None => {
                assert!(doc["next_page_token"].is_null(), "{doc}");
                break;
            }
        }
    }
    assert_eq!(seen, every, "pages cover every job once, in id order");
    assert_eq!(pages, 3);

    // A table cut by --limit says on stderr how to go on.
    let out = pool.corral(&["jobs", "--limit", "4"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 5, "header and 4 rows: {stdout}");
    let hint = String::from_utf8_lossy(&out.stderr);
    assert!(hint.contains("--page-token"), "{hint}");
    // A whole listing as a table: header and every row, no hint.
    let out = pool.corral(&["jobs"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1 + every.len());
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));

    // Names: exact, or a prefix with a trailing `*`.
    assert_eq!(ids(&pool.json(&["jobs", "--name", "train-3"])), vec![early[3]]);
    assert_eq!(ids(&pool.json(&["jobs", "--name", "eval-*"])), late);
    // Submit time: a TSO timestamp between the two batches splits them.
    assert_eq!(ids(&pool.json(&["jobs", "--until", &between])), early);
    assert_eq!(ids(&pool.json(&["jobs", "--since", &between])), late);
    // States: finished ones without --all.
    pool.ok(&["cancel", &late[0].to_string()]);
    assert_eq!(ids(&pool.json(&["jobs", "--state", "cancelled"])), vec![late[0]]);
    assert_eq!(ids(&pool.json(&["jobs", "--state", "succeeded,failed"])), Vec::<u64>::new());
    assert_eq!(ids(&pool.json(&["jobs", "--name", "eval-*", "--state", "pending"])), late[1..].to_vec());

    // Bad input: one clear line each.
    for (args, expected) in [
        (vec!["jobs", "--page-token", "garbage"], "invalid page token"),
        (vec!["jobs", "--state", "sleeping"], "sleeping"),
        (vec!["jobs", "--limit", "0"], "0"),
        (vec!["queue", "--state", "cancelled"], "pending and running"),
        (vec!["jobs", "--since", &between, "--until", &between], "--since must be before --until"),
    ] {
        let out = pool.corral(&args);
        assert!(!out.status.success(), "{args:?} should fail");
        let line = one_line_stderr(&out);
        assert!(line.contains(expected), "{args:?}: {line}");
    }
    // The raw API refuses a malformed token with INVALID_ARGUMENT.
    let refused = rt.block_on(client.list_jobs_page(&Default::default(), "v1:job:x", 5)).expect_err("bad token");
    assert_eq!(refused.code(), Some(tonic::Code::InvalidArgument));
}
