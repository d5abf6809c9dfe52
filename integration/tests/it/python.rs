//! The Python client's pytest suite (`python/tests`), run with the interpreter named by
//! `CORRAL_PYTHON` (a venv with `pip install ./python pytest`, which `.ci/run` makes) against
//! the `corral` binary these tests use. Without `CORRAL_PYTHON` it is skipped loudly, except
//! under CI (`CI` set), where it fails.

use corral_integration::corral_bin;
use std::io::Write;
use std::path::Path;
use std::process::Command;

#[test]
fn the_python_client_passes_its_tests_against_real_pools() {
    let Some(python) = std::env::var_os("CORRAL_PYTHON") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CORRAL_PYTHON is required under CI: a Python with `pip install ./python pytest` (.ci/run makes one)"
        );
        let banner = "!".repeat(78);
        let _ = writeln!(
            std::io::stderr(),
            "\n{banner}\nSKIPPING the Python client's tests: CORRAL_PYTHON is not set.\n\
             python3 -m venv .ci/venv && .ci/venv/bin/pip install ./python pytest, then\n\
             CORRAL_PYTHON=.ci/venv/bin/python (.ci/run does this).\n{banner}\n"
        );
        return;
    };
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "python/tests"])
        .current_dir(&repo)
        .env("CORRAL_BIN", corral_bin())
        .output()
        .unwrap_or_else(|e| panic!("cannot run CORRAL_PYTHON={}: {e}", python.to_string_lossy()));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "pytest failed ({}):\n{text}", output.status);
    assert!(text.contains(" passed"), "pytest ran no test:\n{text}");
}
