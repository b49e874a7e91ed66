//! `kachedb serve` under a service manager (deploy/kachedb.service): readiness
//! and its pid over `$NOTIFY_SOCKET`, `STOPPING=1`, and `--on-sighup
//! takeover` (`systemctl reload`): a successor started from the same path takes
//! the region, socket, clients and store over, and the main pid moves to it.
//! The notify socket is a datagram socket of this test, as systemd's is.

mod common;

use common::{Daemon, TempDir};
use kachedb_client::{Client, Key};
use rustix::process::Signal;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::{Duration, Instant};

/// The notify socket: every datagram the daemon (or its successor) sends.
struct Notify(UnixDatagram);

impl Notify {
    fn bind(path: &Path) -> Notify {
        let s = UnixDatagram::bind(path).expect("bind the notify socket");
        s.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
        Notify(s)
    }

    /// The next message in which `pred` holds (others are skipped), within 30 s.
    fn expect(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while start.elapsed() < Duration::from_secs(30) {
            if let Ok(n) = self.0.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                if pred(&msg) {
                    return msg;
                }
                seen.push(msg);
            }
        }
        panic!("no notify message {what} within 30 s; got {seen:?}");
    }
}

fn main_pid(msg: &str) -> Option<u32> {
    msg.lines().find_map(|l| l.strip_prefix("MAINPID=")).and_then(|p| p.parse().ok())
}

fn alive(pid: u32) -> bool {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("pid");
    rustix::process::test_kill_process(pid).is_ok()
}

#[test]
fn ready_reload_by_sighup_and_stopping_reach_the_service_manager() {
    let dir = TempDir::new("sd");
    let notify_path = dir.0.join("notify.sock");
    let notify = Notify::bind(&notify_path);
    let socket = dir.socket();
    let mut cmd = Daemon::command(&socket, "32MiB", &["--on-sighup", "takeover"]);
    cmd.env("NOTIFY_SOCKET", &notify_path);
    let mut d = Daemon::launch(cmd, &socket);
    let ready = notify.expect("READY=1 from the daemon", |m| m.lines().any(|l| l == "READY=1"));
    assert_eq!(main_pid(&ready), Some(d.pid()), "{ready}");
    assert!(ready.contains("STATUS=serving on"), "{ready}");

    let key = Key::from_parts(0x5d, 1);
    let client = Client::connect(&d.opts()).expect("connect");
    let bytes: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    client.put(key, &bytes).expect("put");

    // systemctl reload: SIGHUP to the main pid.
    d.signal(Signal::HUP);
    let old = d.pid();
    let moved = notify.expect("READY=1 from the successor", |m| {
        m.lines().any(|l| l == "READY=1") && main_pid(m).is_some_and(|p| p != old)
    });
    let new = main_pid(&moved).expect("MAINPID");
    let status = common::wait_timeout(&mut d.child, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("the old daemon did not exit after the handover:\n{}", d.log()));
    assert!(status.success(), "old daemon: {status}\n{}", d.log());
    assert!(alive(new), "the successor {new} is not running:\n{}", d.log());

    // The client kept its connection and the block, now served by the successor.
    let view = client.get(key).expect("get after the reload").expect("the block survived the reload");
    assert_eq!(&view[..], &bytes[..]);
    drop(view);
    let stats = common::stats(&socket);
    assert_eq!(common::num(&stats, "daemon_pid"), u64::from(new));
    drop(client);

    // systemctl stop: SIGTERM to the (new) main pid; it says STOPPING=1 and exits.
    common::signal(new, Signal::TERM);
    notify.expect("STOPPING=1", |m| m.lines().any(|l| l == "STOPPING=1"));
    let start = Instant::now();
    while alive(new) {
        assert!(start.elapsed() < Duration::from_secs(30), "the successor did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sighup_stops_the_daemon_by_default() {
    let dir = TempDir::new("hup");
    let socket = dir.socket();
    let mut d = Daemon::start(&socket, "16MiB");
    d.signal(Signal::HUP);
    let status = d.wait_exit(Duration::from_secs(30)).unwrap_or_else(|| panic!("SIGHUP did not stop it:\n{}", d.log()));
    assert!(status.success(), "{status}\n{}", d.log());
    assert!(d.log().contains("stopped"), "{}", d.log());
    assert!(!socket.exists(), "the stopped daemon left its socket");
}
