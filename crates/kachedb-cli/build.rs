//! What this machine lets the privileged tests do, probed when they are built.
//!
//! Some tests mount file systems, chown files, run processes as other uids,
//! make cgroups or call a system tool. Each is annotated
//! `#[cfg_attr(not(kdb_<need>), ignore = "needs ...")]`, so where a need is
//! missing `cargo test` lists it as `ignored, needs ...` instead of passing a
//! test that did nothing. The cfgs set here:
//!
//! * `kdb_root`: effective uid 0 with `CAP_SYS_ADMIN` (mount, chown, setuid);
//! * `kdb_ext4`: `kdb_root` and `mkfs.ext4` on `PATH` (a loop-mounted ext4 image);
//! * `kdb_freezer`: `kdb_root` and the cgroup v1 freezer;
//! * `kdb_blkio`: `kdb_ext4` and a blkio (v1) or io (v2) cgroup controller;
//! * `kdb_memcg`: `kdb_root` and a memory cgroup controller;
//! * `kdb_pidns`: `kdb_root` and `unshare` on `PATH`;
//! * `kdb_fincore`, `kdb_prlimit`: the util-linux tool on `PATH`.
//!
//! `KACHEDB_REQUIRE_PRIVILEGED_TESTS=1` (CI, which runs as root) makes a
//! missing need a build error, so no privileged test can be ignored there.
//! A test that was built with its need but runs without it fails (it says
//! why) rather than skip: `tests/common/mod.rs`, `need_*`.

use std::path::{Path, PathBuf};

const NEEDS: [&str; 8] =
    ["kdb_root", "kdb_ext4", "kdb_freezer", "kdb_blkio", "kdb_memcg", "kdb_pidns", "kdb_fincore", "kdb_prlimit"];

fn main() {
    // Probed again whenever one of these changes: the switch, and who builds
    // (sudo, su and login shells set these). Not PATH: activating a virtual
    // environment would rebuild this crate and its tests.
    for var in ["KACHEDB_REQUIRE_PRIVILEGED_TESTS", "USER", "SUDO_UID"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rerun-if-changed=build.rs");
    for need in NEEDS {
        println!("cargo::rustc-check-cfg=cfg({need})");
    }

    let root = is_privileged_root();
    let tool = |name: &str| on_path(name);
    let cgroup_v2_has = |ctrl: &str| {
        std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|w| w == ctrl))
    };
    let ext4 = root && tool("mkfs.ext4").is_some();
    let have = [
        ("kdb_root", root, "root (euid 0 with CAP_SYS_ADMIN)"),
        ("kdb_ext4", ext4, "root and mkfs.ext4 (apt-get install e2fsprogs)"),
        ("kdb_freezer", root && Path::new("/sys/fs/cgroup/freezer/tasks").exists(), "root and the cgroup v1 freezer"),
        (
            "kdb_blkio",
            ext4 && (Path::new("/sys/fs/cgroup/blkio/cgroup.procs").exists() || cgroup_v2_has("io")),
            "root, mkfs.ext4 and a blkio (cgroup v1) or io (cgroup v2) controller",
        ),
        (
            "kdb_memcg",
            root && (Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() || cgroup_v2_has("memory")),
            "root and a memory cgroup controller",
        ),
        ("kdb_pidns", root && tool("unshare").is_some(), "root and unshare (util-linux)"),
        ("kdb_fincore", tool("fincore").is_some(), "fincore (util-linux)"),
        ("kdb_prlimit", tool("prlimit").is_some(), "prlimit (util-linux)"),
    ];
    // A tool found is watched: installed or removed, the probe runs again.
    for name in ["mkfs.ext4", "unshare", "fincore", "prlimit"] {
        if let Some(p) = tool(name) {
            println!("cargo::rerun-if-changed={}", p.display());
        }
    }

    let mut missing = Vec::new();
    for (cfg, ok, what) in have {
        if ok {
            println!("cargo::rustc-cfg={cfg}");
        } else {
            missing.push(what);
        }
    }
    if missing.is_empty() {
        return;
    }
    let list = missing.join("; ");
    if std::env::var("KACHEDB_REQUIRE_PRIVILEGED_TESTS").is_ok_and(|v| v == "1") {
        panic!(
            "KACHEDB_REQUIRE_PRIVILEGED_TESTS=1, but the privileged tests of kachedb-cli cannot run here: missing {list} \
             (run as root after `make system-deps`; unset the variable to let cargo test list them as ignored)"
        );
    }
    println!("cargo::warning=tests that need what this build lacks are ignored (cargo test lists each with its reason): {list}");
}

/// Effective uid 0 with `CAP_SYS_ADMIN` (bit 21 of `CapEff`), from `/proc/self/status`.
fn is_privileged_root() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return false };
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let euid = field("Uid:").and_then(|v| v.split_whitespace().nth(1)).and_then(|v| v.parse::<u32>().ok());
    let cap_eff = field("CapEff:").and_then(|v| u64::from_str_radix(v, 16).ok());
    euid == Some(0) && cap_eff.is_some_and(|c| c & (1 << 21) != 0)
}

/// Where `name` is found on `PATH` (as the tests' `Command::new(name)` finds it).
fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}
