//! Names both sides agree on: the control socket path and the region name.

use std::path::PathBuf;

/// Environment variable that overrides the control socket path.
pub const SOCKET_ENV: &str = "KACHEDB_SOCKET";

/// The region's memfd name for `instance` (`kachedb_<instance>`).
pub fn region_name(instance: u32) -> String {
    format!("kachedb_{instance}")
}

/// The default control socket path for `instance`, the one rule the daemon,
/// the CLI, the Rust client and the Python package (through this function)
/// apply: `$KACHEDB_SOCKET` if set (instance 0 only: another instance is
/// another daemon, which never shares instance 0's socket), else
/// `$XDG_RUNTIME_DIR/kachedb/kachedb_<instance>.sock` if that directory exists,
/// else `/tmp/kachedb-<uid>/kachedb_<instance>.sock`.
pub fn default_socket_path(instance: u32) -> PathBuf {
    if instance == 0 {
        if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
            return PathBuf::from(p);
        }
    }
    let file = format!("kachedb_{instance}.sock");
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        let dir = PathBuf::from(xdg);
        if dir.is_dir() {
            return dir.join("kachedb").join(file);
        }
    }
    let uid = rustix::process::getuid().as_raw();
    PathBuf::from(format!("/tmp/kachedb-{uid}")).join(file)
}
