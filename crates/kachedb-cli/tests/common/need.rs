//! What a privileged test needs, checked where it runs. Such a test is
//! `#[cfg_attr(not(kdb_<need>), ignore = "needs ...")]`: ignored, with the
//! reason, where `build.rs` found the need missing when the tests were built.
//! Built with the need but run without it (a binary built as root, run as
//! another user; `cargo test -- --ignored`), it fails here, saying what is
//! missing, instead of passing without having run.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

fn missing(test: &str, what: &str) -> ! {
    panic!(
        "{test} needs {what}, which this machine or user lacks (where the tests are built without it, \
         `cargo test` lists the test as ignored: crates/kachedb-cli/build.rs; this binary was built with it, \
         or run with --ignored): run as root after `make system-deps`, or rebuild as this user"
    )
}

/// Root with `CAP_SYS_ADMIN` (mounts, chown, other uids).
pub fn root(test: &str) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).map(str::trim);
    let sys_admin = cap_eff.and_then(|v| u64::from_str_radix(v, 16).ok()).is_some_and(|c| c & (1 << 21) != 0);
    if !(rustix::process::geteuid().is_root() && sys_admin) {
        missing(test, "root (euid 0 with CAP_SYS_ADMIN)");
    }
}

/// `name` runs (`name --version`).
pub fn tool(test: &str, name: &str) {
    if Command::new(name).arg("--version").output().is_err() {
        missing(test, &format!("{name} on PATH"));
    }
}

/// `path` exists (a cgroup controller, say).
pub fn file(test: &str, path: &str, what: &str) {
    if !Path::new(path).exists() {
        missing(test, &format!("{what} ({path})"));
    }
}
