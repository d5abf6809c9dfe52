//! Bad input gets a clear one-line error and a non-zero exit, and loses nothing.

use corral_integration::{corral_raw, one_line_stderr, DevPool};

#[test]
fn refused_submits_explain_themselves_and_create_nothing() {
    let pool = DevPool::start(&["--gpus", "8"]);
    let cases: &[(&[&str], &str)] = &[
        (&["submit", "--gpus", "9", "--", "true"], "job asks for 9 gpus but the largest node has 8"),
        (&["submit", "--tenant", "nobody", "--", "true"], "unknown tenant 'nobody'"),
        (&["submit", "--priority", "urgent", "--", "true"], "unknown priority class 'urgent'"),
        (&["submit", "--mem", "12X", "--", "true"], "invalid size '12X'"),
        (&["submit", "--time", "soon", "--", "true"], "invalid duration 'soon'"),
        (&["submit"], "empty command"),
        (&["submit", "--gpu-slice", "half", "--", "true"], "invalid gpu slice 'half'"),
        (&["submit", "--cpus", "-2", "--", "true"], "--cpus"),
        (&["submit", "--bogus", "--", "true"], "unexpected argument '--bogus'"),
        (&["submit", "--signal", "SIGFOO", "--", "true"], "invalid signal 'SIGFOO'"),
        (&["submit", "--gpus", "3", "--gpus-per-node", "2", "--", "true"], "gpus"),
        (&["show", "999"], "job 999 not found"),
        (&["cancel", "999"], "job 999 not found"),
        (&["show", "abc"], "invalid value 'abc'"),
        (&["submit", "--array", "0,0", "--", "true"], "invalid array: '0,0': index 0 is listed twice"),
        (&["submit", "--array", "0-9,5", "--", "true"], "0-9 and 5 overlap"),
        (&["submit", "--array", "0-9%10001", "--", "true"], "the %limit is at most 10000 tasks at once"),
        (&["submit", "--array", "0-9%2000", "--", "true"], "this pool allows at most 1024 (limits.max-array-window)"),
        (&["submit", "--array", "0-100000", "--", "true"], "index 100000 is above 99999"),
    ];
    for (args, expected) in cases {
        let out = pool.corral(args);
        assert!(!out.status.success(), "corral {args:?} should fail");
        let line = one_line_stderr(&out);
        assert!(line.contains(expected), "corral {args:?}: expected {expected:?} in {line:?}");
        assert!(out.stdout.is_empty(), "corral {args:?} printed to stdout: {:?}", String::from_utf8_lossy(&out.stdout));
    }
    let all = pool.json(&["jobs", "--all"]);
    assert_eq!(all.as_array().map(Vec::len), Some(0), "refused submits must leave no job: {all}");
}

#[test]
fn unreachable_endpoint_is_one_clear_line() {
    // Port 1 on loopback: nothing listens there.
    let out = corral_raw(&["--endpoint", "127.0.0.1:1", "jobs"]);
    assert!(!out.status.success());
    let line = one_line_stderr(&out);
    assert!(line.contains("cannot reach any coordinator at 127.0.0.1:1"), "{line}");
    let out = corral_raw(&["--endpoint", "not-an-address", "jobs"]);
    assert!(!out.status.success());
    assert!(one_line_stderr(&out).contains("invalid endpoint 'not-an-address'"));
}

#[test]
fn dev_refuses_non_loopback_listen() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = corral_raw(&["dev", "--data-dir", &tmp.path().display().to_string(), "--listen", "0.0.0.0:0"]);
    assert!(!out.status.success());
    assert!(one_line_stderr(&out).contains("loopback only"));
}
