//! Who a client trusts (issue 12, item 1): fake daemons ("squatters") served
//! by this test process or by a child of another uid, never by `kachedb
//! serve`. A client must refuse a socket in a directory others can write or
//! that another user owns, a socket served by another uid unless trusted,
//! and must not wait for a first answer that never comes.

mod common;

use common::{TempDir, BIN};
use kachedb_client::{Client, ClientError, ConnectOptions};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Accepts every connection on `socket`, keeps it open and never answers;
/// counts the bytes clients sent.
fn squatter(socket: &Path) -> Arc<AtomicUsize> {
    let listener = UnixListener::bind(socket).expect("bind the squatter socket");
    let heard = Arc::new(AtomicUsize::new(0));
    let h = heard.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            let h = h.clone();
            let mut r = s.try_clone().expect("clone");
            std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while let Ok(n) = r.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    h.fetch_add(n, Ordering::Relaxed);
                }
            });
            held.push(s);
        }
    });
    heard
}

fn opts(socket: &Path) -> ConnectOptions {
    ConnectOptions { socket: Some(socket.to_path_buf()), ..Default::default() }
}

fn untrusted(r: Result<Client, ClientError>) -> String {
    match r {
        Err(ClientError::Untrusted(why)) => why,
        Err(e) => panic!("expected an Untrusted refusal, got {e:?}"),
        Ok(_) => panic!("the client accepted a squatter"),
    }
}

/// A squatter of our own uid that accepts and never answers: `connect` and
/// `kachedb stats` fail after the answer timeout instead of hanging.
#[test]
fn squatter_that_never_answers_does_not_hang_connect() {
    let dir = TempDir::new("mute");
    let sock = dir.socket();
    let heard = squatter(&sock);
    let t = Instant::now();
    let why =
        untrusted(Client::connect(&ConnectOptions { answer_timeout: Some(Duration::from_millis(400)), ..opts(&sock) }));
    let took = t.elapsed();
    assert!(why.contains("did not answer hello"), "{why}");
    assert!(took >= Duration::from_millis(350) && took < Duration::from_secs(3), "took {took:?}");
    // The default deadline applies without options too (10 s), also to the CLI's stats.
    let t = Instant::now();
    let out = Command::new(BIN)
        .args(["stats", "--json", "--socket"])
        .arg(&sock)
        .env_remove("KACHEDB_SOCKET")
        .stdin(Stdio::null())
        .output()
        .expect("run kachedb stats");
    assert!(!out.status.success());
    assert!(t.elapsed() < Duration::from_secs(20), "kachedb stats took {:?}", t.elapsed());
    assert!(heard.load(Ordering::Relaxed) > 0, "the squatter of our own uid did get a hello");
}

/// A socket in a directory that others can write (no sticky bit) is refused
/// before a single byte is sent.
#[test]
fn squatter_in_a_directory_others_control_is_refused() {
    let dir = TempDir::new("wdir");
    let sock = dir.socket();
    let heard = squatter(&sock);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    let why = untrusted(Client::connect(&opts(&sock)));
    assert!(why.contains("mode 777 lets everyone write to it"), "{why}");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o770)).unwrap();
    let why = untrusted(Client::connect(&opts(&sock)));
    assert!(why.contains("lets its group write"), "{why}");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(heard.load(Ordering::Relaxed), 0, "a hello went to a socket in an unsafe directory");
    // Sticky and world-writable (like /tmp) is fine: the next refusal is the mute squatter's.
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let r = Client::connect(&ConnectOptions { answer_timeout: Some(Duration::from_millis(200)), ..opts(&sock) });
    assert!(untrusted(r).contains("did not answer"));
}

/// A socket in a directory another user owns is refused before a single
/// byte is sent, unless that uid is trusted.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: chowns the socket's directory to uid 65534 (run as root, as CI does)")]
fn squatter_in_a_directory_of_another_user_is_refused_unless_trusted() {
    common::need::root("squatter_in_a_directory_of_another_user_is_refused_unless_trusted");
    let dir = TempDir::new("odir");
    let sock = dir.socket();
    let heard = squatter(&sock);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&dir.0, Some(65534), Some(65534)).unwrap();
    let why = untrusted(Client::connect(&opts(&sock)));
    assert!(why.contains("belongs to uid 65534"), "{why}");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(heard.load(Ordering::Relaxed), 0, "a hello went to a socket in another user's directory");
    // Unless that uid is trusted.
    let r = Client::connect(&ConnectOptions {
        trust_uid: Some(65534),
        answer_timeout: Some(Duration::from_millis(200)),
        ..opts(&sock)
    });
    assert!(untrusted(r).contains("did not answer"));
}

/// A squatter process of another uid (65534) in a sticky shared directory:
/// refused by `SO_PEERCRED` with a message naming the uid and the way to
/// trust it; trusted through `trust_uid` or `KACHEDB_TRUST_UID` it gets as
/// far as the hello (which it never answers). Needs root.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs a process of uid 65534 (run as root, as CI does)")]
fn squatter_of_another_uid_is_refused_unless_trusted() {
    use std::os::unix::process::CommandExt;
    common::need::root("squatter_of_another_uid_is_refused_unless_trusted");
    let dir = TempDir::new("ouid");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let sock = dir.socket();
    let script = "import socket,sys,time\ns=socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(64)\nprint('ready',flush=True)\nheld=[]\nwhile True:\n    c,_=s.accept()\n    held.append(c)\n";
    let mut child = Command::new("python3")
        .args(["-c", script])
        .arg(&sock)
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn python3 as uid 65534");
    let mut ready = [0u8; 6];
    child.stdout.take().unwrap().read_exact(&mut ready).expect("squatter ready");
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).ok();
    let why = untrusted(Client::connect(&opts(&sock)));
    assert!(why.contains("runs as uid 65534") && why.contains("KACHEDB_TRUST_UID=65534"), "{why}");
    let r = Client::connect(&ConnectOptions {
        trust_uid: Some(65534),
        answer_timeout: Some(Duration::from_millis(300)),
        ..opts(&sock)
    });
    assert!(untrusted(r).contains("did not answer hello"));
    // The CLI, with and without the environment variable.
    let run = |trust: Option<&str>| {
        let mut c = Command::new(BIN);
        c.args(["stats", "--json", "--socket"]).arg(&sock).env_remove("KACHEDB_SOCKET").env_remove("KACHEDB_TRUST_UID");
        if let Some(t) = trust {
            c.env("KACHEDB_TRUST_UID", t);
        }
        let out = c.output().expect("run kachedb stats");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = run(None);
    assert!(e.contains("runs as uid 65534"), "{e}");
    let e = run(Some("12345, 65534"));
    assert!(!e.contains("runs as uid 65534"), "{e}");
    let e = run(Some("nobody"));
    assert!(e.contains("is not a uid"), "{e}");
    let _ = child.kill();
    let _ = child.wait();
}

/// Issue 12, item 2: a daemon in its own PID namespace sees its clients with
/// pid 0 (`SO_PEERCRED`); it admits and serves them, and logs them without a
/// pid. Needs `unshare --pid` (root).
#[test]
#[cfg_attr(not(kdb_pidns), ignore = "needs root and unshare (util-linux): a daemon in its own PID namespace")]
fn daemon_in_another_pid_namespace_serves_pid0_clients() {
    common::need::root("daemon_in_another_pid_namespace_serves_pid0_clients");
    assert!(
        Command::new("unshare").args(["--pid", "--fork", "true"]).status().is_ok_and(|s| s.success()),
        "daemon_in_another_pid_namespace_serves_pid0_clients needs `unshare --pid --fork` to work here"
    );
    let dir = TempDir::new("pidns");
    let sock = dir.socket();
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child", BIN, "serve", "--size", "8MiB", "--socket"])
        .arg(&sock)
        .env("RUST_LOG", "info")
        .env_remove("KACHEDB_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut d = common::Daemon::launch(cmd, &sock);
    d.wait_ready();
    for _ in 0..3 {
        let kc = Client::connect(&opts(&sock)).expect("connect to the daemon in another PID namespace");
        let key = kachedb_client::Key::from_bytes(b"pidns");
        kc.put(key, &[7u8; 4096]).expect("put");
        let v = kc.get(key).expect("get").expect("found");
        assert_eq!(&v[..], &[7u8; 4096][..]);
    }
    common::poll_stats(&sock, Duration::from_secs(5), "the pid-0 clients gone", |v| {
        common::num(v, "clients_connected") == 0 && common::num(v, "pins") == 0 && common::num(v, "clients_total") == 3
    });
    // unshare does not forward SIGTERM; --kill-child takes the daemon with it.
    d.signal(rustix::process::Signal::KILL);
    d.wait_exit(Duration::from_secs(10));
    let log = strip_ansi(&d.log());
    assert!(log.contains("client connected") && log.contains("pid=0"), "{log}");
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
