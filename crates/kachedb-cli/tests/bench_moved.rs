//! `kachedb` is the shipped binary: no benchmarks, no demo. `kachedb bench …`
//! and `kachedb demo …` are kept one release: they run the `kachedb-bench`
//! beside the binary with the same arguments, or, when there is none, say
//! where the benchmarks are and exit with a usage error.

mod common;

use common::{TempDir, BIN};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// This build's `kachedb`, hard-linked (or copied) into `dir`: a binary with
/// nothing beside it but what the test puts there.
fn kachedb_in(dir: &Path) -> PathBuf {
    let exe = dir.join("kachedb");
    if std::fs::hard_link(BIN, &exe).is_err() {
        std::fs::copy(BIN, &exe).expect("copy the kachedb binary");
    }
    exe
}

fn run(exe: &Path, args: &[&str]) -> Output {
    Command::new(exe).args(args).output().expect("run kachedb")
}

#[test]
fn the_binary_names_no_benchmark_and_says_where_they_are() {
    let dir = TempDir::new("bench-moved");
    let exe = kachedb_in(&dir.0);
    let help = String::from_utf8_lossy(&run(&exe, &["--help"]).stdout).into_owned();
    assert!(help.contains("serve") && help.contains("stats"), "{help}");
    assert!(!help.contains("bench") && !help.contains("demo"), "{help}");
    for args in [&["bench", "ops", "--json"][..], &["bench"], &["bench", "--help"], &["demo"]] {
        let out = run(&exe, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("kachedb-bench ring|ops|remote|disk|scale|demo"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn bench_and_demo_run_the_kachedb_bench_beside_the_binary_with_the_same_arguments() {
    let dir = TempDir::new("bench-forward");
    let exe = kachedb_in(&dir.0);
    // A stand-in `kachedb-bench`: writes its arguments, one a line, and exits 7.
    let stand_in = dir.0.join("kachedb-bench");
    std::fs::write(&stand_in, "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$(dirname \"$0\")/args\"\nexit 7\n")
        .expect("write the stand-in");
    std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755)).expect("chmod the stand-in");
    let args_file = dir.0.join("args");
    for (args, forwarded) in [
        (&["bench", "ops", "--json", "--socket", "/x y"][..], "ops\n--json\n--socket\n/x y\n"),
        (&["bench", "--help"], "--help\n"),
        (&["demo", "--bytes", "1MiB"], "demo\n--bytes\n1MiB\n"),
    ] {
        let _ = std::fs::remove_file(&args_file);
        let out = run(&exe, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(7), "{args:?}: {err}");
        assert!(err.contains("deprecated"), "{args:?}: {err}");
        assert_eq!(std::fs::read_to_string(&args_file).expect("the stand-in ran"), forwarded, "{args:?}");
    }
}
