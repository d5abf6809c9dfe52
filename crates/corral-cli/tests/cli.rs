//! The binary's argument handling: help works, errors are one line (also makes `cargo test`
//! build the `corral` binary that integration/ spawns).

use std::process::Command;

fn corral(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_corral")).args(args).output().expect("run corral")
}

#[test]
fn help_lists_the_commands() {
    let out = corral(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for command in ["dev", "submit", "show", "wait", "jobs", "queue", "cancel", "logs", "nodes"] {
        assert!(help.contains(command), "--help lacks {command}: {help}");
    }
}

#[test]
fn unknown_subcommand_is_a_one_line_error() {
    let out = corral(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("frobnicate"));
}
