//! The `kachedb-bench` binary: its commands, and the demo end to end — a
//! daemon started from this binary (`serve`, hidden), a tensor put by one
//! child process and read back, every byte checked, by another.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kachedb-bench");

#[test]
fn help_lists_the_benchmarks_and_the_demo_and_hides_the_children() {
    let out = Command::new(BIN).arg("--help").output().expect("run kachedb-bench");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in ["ring", "ops", "remote", "disk", "demo"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(cmd)), "{cmd} missing: {help}");
    }
    for hidden in ["serve", "bench-child", "demo-child"] {
        assert!(!help.contains(hidden), "{hidden} listed: {help}");
    }
}

#[test]
fn an_unknown_command_is_a_usage_error() {
    let out = Command::new(BIN).arg("nope").output().expect("run kachedb-bench");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
}

#[test]
fn the_demo_puts_in_one_process_and_reads_every_byte_back_in_another() {
    let out = Command::new(BIN).args(["demo", "--bytes", "8MiB"]).output().expect("run kachedb-bench demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("bytes match: true"), "{stdout}\n{stderr}");
    assert!(stdout.contains("demo: done — daemon holds 1 block(s)"), "{stdout}\n{stderr}");
}
