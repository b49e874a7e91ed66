//! The fleet key file (`kachedb serve --remote-key-file`, issue 41 item 2):
//! the real binary refuses to start unless the file is a regular file that
//! belongs to the daemon's user and that group and others can neither read
//! nor write, opened without following a symbolic link; the refusal names
//! the file, its owner and mode, and what to do. Nothing listens on the
//! `--remote` address: the tier connects in the background, so a daemon with
//! a good key file starts without a cluster.

mod common;

use common::{wait_timeout, Daemon, TempDir, BIN};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A key file of 64 hex digits at `dir/name`, mode `mode`.
fn key_file(dir: &Path, name: &str, mode: u32) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, "9c".repeat(32) + "\n").expect("write the key file");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod the key file");
    p
}

/// Runs `kachedb serve` with `key` as its fleet key, expecting a refusal at
/// start; its stderr.
fn refused(dir: &TempDir, key: &Path) -> String {
    let sock = dir.0.join("refused.sock");
    let mut child = Command::new(BIN)
        .args(["serve", "--size", "8MiB", "--socket"])
        .arg(&sock)
        .args(["--remote", "redis://127.0.0.1:1", "--remote-key-file"])
        .arg(key)
        .env_remove("KACHEDB_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kachedb serve");
    let status = wait_timeout(&mut child, Duration::from_secs(60));
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("kachedb serve started with the key file {} (it should have refused it)", key.display());
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err).expect("read stderr");
    assert!(!status.unwrap().success(), "{err}");
    assert!(!sock.exists(), "a refused daemon left its socket");
    assert!(err.contains("--remote-key-file") && err.contains(&key.display().to_string()), "{err}");
    err
}

/// A key file of another user (uid 65534) is refused at start, naming its
/// owner and the `chown` that fixes it.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: chowns the key file to uid 65534 (run as root, as CI does)")]
fn a_key_file_another_user_owns_is_refused_at_start() {
    common::need::root("a_key_file_another_user_owns_is_refused_at_start");
    let dir = TempDir::new("keyfile-owner");
    let me = rustix::process::geteuid().as_raw();
    let theirs = key_file(&dir.0, "theirs.key", 0o600);
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).expect("chown to 65534");
    let err = refused(&dir, &theirs);
    assert!(err.contains("owned by uid 65534") && err.contains("mode 600"), "{err}");
    assert!(err.contains(&format!("chown {me} {}", theirs.display())), "{err}");
}

#[test]
fn a_key_file_others_can_read_or_a_link_is_refused_at_start() {
    let dir = TempDir::new("keyfile");
    let me = rustix::process::geteuid().as_raw();

    let open = key_file(&dir.0, "open.key", 0o644);
    let err = refused(&dir, &open);
    assert!(err.contains(&format!("owned by uid {me}")) && err.contains("mode 644"), "{err}");
    assert!(err.contains(&format!("chmod 600 {}", open.display())), "{err}");

    let group = key_file(&dir.0, "group.key", 0o640);
    let err = refused(&dir, &group);
    assert!(err.contains("mode 640") && err.contains("chmod 600"), "{err}");

    // A link to a good key file: refused (it is not followed), naming the link.
    let good = key_file(&dir.0, "good.key", 0o600);
    let link = dir.0.join("link.key");
    std::os::unix::fs::symlink(&good, &link).expect("symlink");
    let err = refused(&dir, &link);
    assert!(err.contains("symbolic link"), "{err}");

    // The good file itself: the daemon starts and serves.
    let sock = dir.socket();
    let good_path = good.display().to_string();
    let mut d =
        Daemon::spawn_with(&sock, "8MiB", &["--remote", "redis://127.0.0.1:1", "--remote-key-file", &good_path]);
    d.wait_ready();
    let kc = kachedb_client::Client::connect(&d.opts()).expect("connect");
    let key = kachedb_client::Key::from_bytes(b"keyed");
    kc.put(key, &[1u8; 4096]).expect("put");
    assert_eq!(&*kc.get(key).expect("get").expect("present"), &[1u8; 4096][..]);
    drop(kc);
    d.signal(rustix::process::Signal::TERM);
    let s = d.wait_exit(Duration::from_secs(30)).expect("the daemon stops");
    assert!(s.success(), "{}", d.log());
}
