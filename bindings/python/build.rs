//! With the `bundle-bin` feature (every maturin build: pyproject.toml's
//! `[tool.maturin] features`): builds the `kachedb` executable (crate
//! `kachedb-cli`, the daemon and the CLI) and puts it at
//! `python/kachedb/bin/kachedb`, the path the wheel takes it from and where
//! `kachedb._daemon_bin` looks for it. So the wheel, the sdist, `pip install .`
//! and a git URL all give a package with its daemon, with no step before
//! `maturin build`/`pip install`.
//!
//! The executable is built by a second cargo, for the same target, with its own
//! target directory (`<target dir>/bundle-bin`: the outer cargo holds the lock
//! of its own), release profile, stripped. It inherits this process's
//! environment, so the linker and C compiler that maturin chose for the
//! extension (`--zig --compatibility manylinux_2_28`: zig's, for glibc 2.28) link
//! the executable too. Without the feature (`cargo build --workspace`, clippy,
//! the Rust tests) this script does nothing.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_BUNDLE_BIN");
    if env::var_os("CARGO_FEATURE_BUNDLE_BIN").is_none() {
        return;
    }
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.join("../..");
    let dest = manifest_dir.join("python/kachedb/bin/kachedb");
    // Again whenever a source of the executable changes, or the copy is gone.
    for watched in ["crates", "Cargo.lock", "Cargo.toml"] {
        println!("cargo:rerun-if-changed={}", workspace.join(watched).display());
    }
    println!("cargo:rerun-if-changed={}", dest.display());

    let target = env::var("TARGET").expect("cargo sets TARGET");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target_dir = bundle_target_dir(&out_dir);
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&workspace)
        .args(["build", "--release", "-p", "kachedb-cli", "--bin", "kachedb", "--target", &target])
        .arg("--target-dir")
        .arg(&target_dir)
        // The shipped executable: no debug info, no symbols (a few MB, not tens).
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
        // This script's own settings, which are not the inner build's.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_PRIMARY_PACKAGE")
        .status()
        .unwrap_or_else(|e| panic!("bundle-bin: cannot run cargo to build the kachedb executable: {e}"));
    assert!(status.success(), "bundle-bin: `cargo build -p kachedb-cli` (the kachedb executable) failed: {status}");

    let built = target_dir.join(&target).join("release/kachedb");
    install(&built, &dest);
}

/// `<target dir>/bundle-bin/<toolchain key>`: the outer target directory is the
/// ancestor of `OUT_DIR` that holds `CACHEDIR.TAG` (`OUT_DIR` itself if none
/// does). One directory per linker and C toolchain ([`toolchain_key`]): a build
/// linked by zig for manylinux_2_28 (`make wheel`) and one by the system's cc (`pip
/// install` of the source tree or an sdist) each keep their compiled crates
/// instead of rebuilding over each other.
fn bundle_target_dir(out_dir: &Path) -> PathBuf {
    let base = out_dir
        .ancestors()
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .map_or_else(|| out_dir.join("bundle-bin"), |d| d.join("bundle-bin"));
    base.join(toolchain_key())
}

/// A short name for the environment that decides how the executable is
/// compiled and linked: the variables naming linkers, C compilers, archivers
/// and Rust flags, sorted, hashed.
fn toolchain_key() -> String {
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};
    let mut vars: Vec<(String, String)> = env::vars()
        .filter(|(k, _)| {
            k.ends_with("_LINKER")
                || k == "RUSTFLAGS"
                || k == "CARGO_ENCODED_RUSTFLAGS"
                || ["CC", "CXX", "AR", "CFLAGS", "CXXFLAGS", "LDFLAGS"]
                    .iter()
                    .any(|p| k == p || k.starts_with(&format!("{p}_")))
        })
        .collect();
    vars.sort();
    let mut h = DefaultHasher::new();
    vars.hash(&mut h);
    for (k, _) in &vars {
        println!("cargo:rerun-if-env-changed={k}");
    }
    format!("{:016x}", h.finish())
}

/// Copies `built` to `dest` (mode 0755) by a rename, so a daemon running the
/// previous copy keeps its file.
fn install(built: &Path, dest: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let dir = dest.parent().expect("dest has a parent");
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("bundle-bin: mkdir {}: {e}", dir.display()));
    let tmp = dir.join(".kachedb.tmp");
    std::fs::copy(built, &tmp)
        .unwrap_or_else(|e| panic!("bundle-bin: copy {} -> {}: {e}", built.display(), tmp.display()));
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("bundle-bin: chmod {}: {e}", tmp.display()));
    std::fs::rename(&tmp, dest).unwrap_or_else(|e| panic!("bundle-bin: rename to {}: {e}", dest.display()));
}
