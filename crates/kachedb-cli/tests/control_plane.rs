//! The control socket, the takeover handshake and the metrics endpoint
//! against peers that misbehave without breaking any rule of the wire
//! (issue 25, items 10 to 15): real `kachedb serve` processes, peers
//! written here as raw `UnixStream`s and `TcpStream`s, and clients.
//!
//! Time bounds are generous bounds of liveness ("answers within 5 s"), never
//! measurements.

mod common;

use common::{num, poll_stats_fast, stats_fast, Daemon, TempDir};
use kachedb_client::{Client, Key};
use kachedb_shm::control::{self, ControlRequest};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Whether the daemon closed `s` (EOF) within `limit`.
fn closed_within(s: &UnixStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let deadline = Instant::now() + limit;
    loop {
        match (&*s).read(&mut [0u8; 4096]) {
            Ok(0) => return true,
            // Lines the daemon wrote before closing.
            Ok(_) if Instant::now() < deadline => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            _ => return false,
        }
    }
}

/// Sends one control request on `s`.
fn send(s: &UnixStream, req: &ControlRequest) {
    let line = control::to_line(req).expect("encode");
    (&*s).write_all(&line).expect("write a control request");
}

/// The next control line on `r`, parsed (within `r`'s read timeout).
fn answer(r: &mut BufReader<&UnixStream>) -> Value {
    let mut line = String::new();
    r.read_line(&mut line).expect("read a control answer");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a control answer ({e}): {line:?}"))
}

/// Item 10: a peer that says hello and then asks for a takeover on the same
/// connection (or asks for a takeover and says hello in the same write) is
/// refused and closed, and the session and channel it got go with the
/// connection: five such peers in a row on a daemon of 4 channels leave no
/// client behind, and a real client still gets a channel.
#[test]
fn takeover_asked_on_a_client_connection_is_refused_and_the_session_goes() {
    let dir = TempDir::new("hello-takeover");
    let mut d = Daemon::spawn_with(&dir.socket(), "8MiB", &["--channels", "4"]);
    d.wait_ready();
    let takeover = |versions: Vec<u32>| ControlRequest::Takeover { state_versions: versions };
    let mut peers = Vec::new();
    for round in 0..5 {
        let s = UnixStream::connect(&d.socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = BufReader::new(&s);
        if round % 2 == 0 {
            send(&s, &ControlRequest::hello());
            let hello = answer(&mut r);
            assert_eq!(hello["ok"], true, "round {round}: hello refused: {hello}");
            send(&s, &takeover(vec![kachedb_daemon::takeover::STATE_VERSION]));
        } else {
            // One write: the takeover (a format nobody writes) and a hello.
            let mut both = control::to_line(&takeover(vec![999])).unwrap();
            both.extend(control::to_line(&ControlRequest::hello()).unwrap());
            (&s).write_all(&both).expect("write");
        }
        let refusal = answer(&mut r);
        assert_eq!(refusal["ok"], false, "round {round}: the takeover was not refused: {refusal}");
        drop(r);
        // The daemon closes the connection (the peer itself keeps it open).
        assert!(closed_within(&s, Duration::from_secs(10)), "round {round}: the refused connection stays open");
        peers.push(s);
    }
    let (s, _) = poll_stats_fast(&d.socket, Duration::from_secs(10), "the refused peers' sessions to go", |s| {
        num(s, "clients_connected") == 0
    });
    assert_eq!((num(&s, "pins"), num(&s, "reserved")), (0, 0), "{s}");
    let kc = Client::connect(&d.opts()).expect("a real client after the refused takeovers");
    kc.put(Key::from_bytes(b"after"), &[1u8; 64]).expect("put");
    assert_eq!(num(&stats_fast(&d.socket), "clients_connected"), 1);
    drop(peers);
}

/// Item 13: a peer of the daemon's uid that asks for a takeover, says go,
/// takes the offer and then trickles its verdict one byte every 300 ms (so
/// that no single read waits long) holds the running daemon's clients for
/// the pause as a whole (`--takeover-pause-ms 1500`), not for as long as it
/// trickles: a client blocked in a GET meanwhile is answered while the peer
/// still trickles, by the same daemon.
#[test]
fn a_trickling_takeover_peer_holds_the_daemon_one_step_at_most() {
    let dir = TempDir::new("trickle-takeover");
    let mut d =
        Daemon::spawn_with(&dir.socket(), "8MiB", &["--takeover-timeout-ms", "1500", "--takeover-pause-ms", "1500"]);
    d.wait_ready();
    let kc = Client::connect(&d.opts()).expect("connect");
    kc.put(Key::from_bytes(b"held"), &[7u8; 4096]).expect("put");
    let peer = UnixStream::connect(&d.socket).expect("connect");
    peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    send(&peer, &ControlRequest::Takeover { state_versions: vec![kachedb_daemon::takeover::STATE_VERSION] });
    let mut r = BufReader::new(&peer);
    let prepare = answer(&mut r);
    assert_eq!(prepare["pause_ms"], 1500, "no prepare: {prepare}");
    send(&peer, &ControlRequest::TakeoverGo);
    let offer = answer(&mut r);
    assert_eq!(offer["ok"], true, "no offer: {offer}");
    drop(r);
    // From here the daemon waits for a verdict line that never ends.
    let stop = Arc::new(AtomicBool::new(false));
    let trickled = Arc::new(Mutex::new(0u32));
    let trickler = {
        let (stop, trickled, peer) = (stop.clone(), trickled.clone(), peer.try_clone().unwrap());
        std::thread::spawn(move || {
            let t = Instant::now();
            while !stop.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(30) {
                if (&peer).write_all(b" ").is_err() {
                    break;
                }
                *trickled.lock().unwrap() += 1;
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let (tx, rx) = mpsc::channel();
    let t = Instant::now();
    let getter = std::thread::spawn(move || {
        let got = kc.get(Key::from_bytes(b"held")).map(|v| v.map(|v| v.to_vec()));
        let _ = tx.send(got);
        kc
    });
    let got = rx.recv_timeout(Duration::from_secs(10));
    let waited = t.elapsed();
    let bytes = *trickled.lock().unwrap();
    stop.store(true, Ordering::Relaxed);
    let got = got.unwrap_or_else(|_| {
        panic!("a GET was not answered within 10 s while a takeover peer trickled ({bytes} bytes):\n{}", d.log())
    });
    assert_eq!(got.expect("get").expect("present"), vec![7u8; 4096]);
    println!(
        "figures: {}",
        serde_json::json!({"test": "trickling_takeover_peer", "get_waited_ms": waited.as_millis(), "bytes_trickled": bytes})
    );
    trickler.join().unwrap();
    let kc = getter.join().unwrap();
    let log = d.log();
    assert!(log.contains("takeover failed, serving on"), "{log}");
    assert!(log.contains("did not finish this step"), "{log}");
    // The same daemon serves on.
    let s = stats_fast(&d.socket);
    assert_eq!(num(&s, "daemon_pid"), u64::from(d.pid()), "{s}");
    kc.put(Key::from_bytes(b"after"), &[1u8; 64]).expect("put after");
}

/// Item 14: control connections that are not clients' are closed once they
/// have sent no request for `--hello-timeout-ms` (1 s here), after a request
/// as before one: 15 connections that asked for stats once and stay open,
/// beside one client, fill `--max-connections 16`; once they are closed new
/// clients and stats get in, and the client's own connection, idle all
/// along, stays.
#[test]
fn idle_stats_connections_time_out_and_do_not_lock_clients_out() {
    let dir = TempDir::new("idle-stats");
    let mut d = Daemon::spawn_with(&dir.socket(), "8MiB", &["--max-connections", "16", "--hello-timeout-ms", "1000"]);
    d.wait_ready();
    std::thread::sleep(Duration::from_millis(1100)); // wait_ready's probes time out first
    let kc = Client::connect(&d.opts()).expect("connect");
    kc.put(Key::from_bytes(b"k"), &[3u8; 4096]).expect("put");
    let idle: Vec<UnixStream> = (0..15)
        .map(|_| {
            let s = UnixStream::connect(&d.socket).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            send(&s, &ControlRequest::Stats);
            let a = answer(&mut BufReader::new(&s));
            assert_eq!(a["ok"], true, "{a}");
            s
        })
        .collect();
    // Full: one more is closed at once.
    let extra = UnixStream::connect(&d.socket).expect("connect");
    assert!(closed_within(&extra, Duration::from_millis(500)), "a connection past --max-connections was kept");
    let t = Instant::now();
    let by = t + Duration::from_secs(10);
    let closed = idle
        .iter()
        .filter(|s| closed_within(s, by.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
        .count();
    assert_eq!(closed, 15, "idle stats connections kept open ({:?} after the last answer)", t.elapsed());
    // The client, idle meanwhile, is still served; a new client and stats get in.
    assert_eq!(&*kc.get(Key::from_bytes(b"k")).expect("get").expect("present"), &[3u8; 4096][..]);
    let kc2 = Client::connect(&d.opts()).expect("a new client after the idle connections");
    kc2.put(Key::from_bytes(b"k2"), &[4u8; 64]).expect("put");
    assert_eq!(num(&stats_fast(&d.socket), "clients_connected"), 2);
}

/// The metrics address a daemon prints (`metrics at http://ADDR/metrics`).
fn metrics_addr(d: &Daemon) -> SocketAddr {
    let t = Instant::now();
    loop {
        let log = d.log();
        if let Some(rest) = log.split("metrics at http://").nth(1) {
            let addr = rest.split('/').next().unwrap_or_default();
            return addr.parse().unwrap_or_else(|e| panic!("metrics address {addr:?}: {e}"));
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no metrics address in the log:\n{log}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `GET path` on a fresh connection; the whole answer, or why none came within `limit`.
fn http_get(addr: SocketAddr, path: &str, limit: Duration) -> Result<String, String> {
    let mut c = TcpStream::connect_timeout(&addr, limit).map_err(|e| format!("connect: {e}"))?;
    c.set_read_timeout(Some(limit)).unwrap();
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes()).map_err(|e| format!("write: {e}"))?;
    let mut out = String::new();
    c.read_to_string(&mut out).map_err(|e| format!("read: {e} (got {out:?})"))?;
    Ok(out)
}

/// Item 15: four peers (one per metrics worker) that scrape `/metrics`,
/// read the answer and then trickle a byte every 90 ms hold a worker for a
/// bounded time per connection, not per read: `/healthz` and another scrape
/// answer within 5 s while they trickle.
#[test]
fn healthz_and_metrics_answer_while_four_peers_trickle_bytes() {
    let dir = TempDir::new("http-trickle");
    let mut d = Daemon::spawn_with(&dir.socket(), "8MiB", &["--metrics-addr", "127.0.0.1:0"]);
    d.wait_ready();
    let addr = metrics_addr(&d);
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = mpsc::channel();
    let tricklers: Vec<_> = (0..4)
        .map(|_| {
            let (stop, ready) = (stop.clone(), ready_tx.clone());
            std::thread::spawn(move || {
                let mut c = TcpStream::connect(addr).expect("connect");
                c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n").expect("write");
                // The answer, up to the server's half close: it drains now.
                let mut out = Vec::new();
                let _ = c.read_to_end(&mut out);
                let _ = ready.send(out.starts_with(b"HTTP/1.1 200 "));
                let t = Instant::now();
                while !stop.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(60) {
                    if c.write_all(b"x").is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(90));
                }
            })
        })
        .collect();
    for _ in 0..4 {
        let ok = ready_rx.recv_timeout(Duration::from_secs(10)).expect("a trickler's answer");
        assert!(ok, "a trickler's /metrics was not answered 200");
    }
    std::thread::sleep(Duration::from_millis(300));
    let asked = [("/healthz", "ok\n"), ("/metrics", "kachedb_blocks"), ("/healthz", "ok\n")];
    let answers: Vec<_> = asked.iter().map(|(path, _)| (path, http_get(addr, path, Duration::from_secs(5)))).collect();
    stop.store(true, Ordering::Relaxed);
    for t in tricklers {
        t.join().unwrap();
    }
    for ((path, r), (_, want)) in answers.into_iter().zip(asked) {
        let r = r.unwrap_or_else(|e| panic!("{path} did not answer within 5 s while 4 peers trickled: {e}"));
        assert!(r.starts_with("HTTP/1.1 200 ") && r.contains(want), "{path}: {r}");
    }
}

/// Item 15: request heads are read by one thread for every connection at
/// once, and `/healthz` is answered there, so slow heads hold no worker: 40
/// peers that each send a request line and then a header byte every 90 ms,
/// reconnecting as soon as they are closed (more than the 4 workers and 16
/// queued scrapes together), keep neither `/healthz` nor a scrape of
/// `/metrics` from answering 200 within 5 s.
#[test]
fn healthz_and_metrics_answer_while_forty_peers_send_slow_heads() {
    let dir = TempDir::new("http-slowloris");
    let mut d = Daemon::spawn_with(&dir.socket(), "8MiB", &["--metrics-addr", "127.0.0.1:0"]);
    d.wait_ready();
    let addr = metrics_addr(&d);
    let stop = Arc::new(AtomicBool::new(false));
    let (open_tx, open_rx) = mpsc::channel();
    let peers: Vec<_> = (0..40)
        .map(|_| {
            let (stop, open) = (stop.clone(), open_tx.clone());
            std::thread::spawn(move || {
                let t = Instant::now();
                while !stop.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(60) {
                    let Ok(mut c) = TcpStream::connect(addr) else { continue };
                    if c.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ").is_err() {
                        continue;
                    }
                    let _ = open.send(());
                    while !stop.load(Ordering::Relaxed) && c.write_all(b"a").is_ok() {
                        std::thread::sleep(Duration::from_millis(90));
                    }
                }
            })
        })
        .collect();
    for _ in 0..40 {
        open_rx.recv_timeout(Duration::from_secs(10)).expect("a slow peer connected");
    }
    std::thread::sleep(Duration::from_millis(500));
    let asked = [("/healthz", "ok\n"), ("/metrics", "kachedb_blocks"), ("/healthz", "ok\n")];
    let answers: Vec<_> = asked.iter().map(|(path, _)| (path, http_get(addr, path, Duration::from_secs(5)))).collect();
    stop.store(true, Ordering::Relaxed);
    for p in peers {
        p.join().unwrap();
    }
    for ((path, r), (_, want)) in answers.into_iter().zip(asked) {
        let r = r.unwrap_or_else(|e| panic!("{path} did not answer within 5 s while 40 peers sent slow heads: {e}"));
        assert!(r.starts_with("HTTP/1.1 200 ") && r.contains(want), "{path}: {r}");
    }
}

/// Item 15: `/healthz` never says the node is unhealthy during a takeover:
/// polled without pause on fresh connections while the daemon is taken over
/// six times (the metrics listener moving to each new daemon), every answer
/// is 200 and a client's block stays readable.
#[test]
fn healthz_stays_healthy_through_takeovers() {
    let dir = TempDir::new("http-takeover");
    let sock = dir.socket();
    let mut cur = Daemon::spawn_with(&sock, "8MiB", &["--metrics-addr", "127.0.0.1:0"]);
    cur.wait_ready();
    let addr = metrics_addr(&cur);
    let kc = Client::connect(&cur.opts()).expect("connect");
    kc.put(Key::from_bytes(b"kept"), &[9u8; 4096]).expect("put");
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut answers, mut bad) = (0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match http_get(addr, "/healthz", Duration::from_secs(10)) {
                    Ok(r) if r.starts_with("HTTP/1.1 200 ") => answers += 1,
                    Ok(r) => bad.push(r),
                    Err(e) => bad.push(e),
                }
            }
            (answers, bad)
        })
    };
    for round in 0..6 {
        let mut next = Daemon::spawn_with(&sock, "8MiB", &["--takeover"]);
        let t = Instant::now();
        while !next.log().contains("took over") {
            if let Ok(Some(s)) = next.child.try_wait() {
                next.wait_exit(Duration::from_secs(5));
                panic!("round {round}: the new daemon exited ({s}):\n{}", next.log());
            }
            assert!(t.elapsed() < Duration::from_secs(30), "round {round}: no takeover:\n{}", next.log());
            std::thread::sleep(Duration::from_millis(10));
        }
        let s = cur.wait_exit(Duration::from_secs(30)).expect("the old daemon exits");
        assert!(s.success(), "round {round}: the old daemon exited {s}:\n{}", cur.log());
        cur = next;
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    let (answers, bad) = poller.join().unwrap();
    println!(
        "figures: {}",
        serde_json::json!({"test": "healthz_through_takeovers", "answers": answers, "bad": bad.len()})
    );
    assert!(bad.is_empty(), "{} of {} /healthz answers were not 200; first: {:?}", bad.len(), answers, bad.first());
    assert!(answers > 0);
    assert_eq!(&*kc.get(Key::from_bytes(b"kept")).expect("get").expect("present"), &[9u8; 4096][..]);
}

/// A daemon asked to take over that must refuse: waits for `next` to exit,
/// asserts it failed saying `why`, and that `old` is still running and
/// logged that it serves on.
fn refused_takeover(next: &mut Daemon, old: &mut Daemon, why: &str) {
    let s = next.wait_exit(Duration::from_secs(60)).expect("the new daemon exits");
    let log = next.log();
    assert!(!s.success(), "the new daemon took over (it should have refused):\n{log}\nold:\n{}", old.log());
    assert!(log.contains(why), "the new daemon's error does not say {why:?}:\n{log}");
    assert!(log.contains("the running daemon keeps serving"), "{log}");
    let t = Instant::now();
    while !old.log().contains("takeover failed, serving on") {
        assert!(old.child.try_wait().unwrap().is_none(), "the old daemon exited:\n{}", old.log());
        assert!(t.elapsed() < Duration::from_secs(30), "the old daemon did not resume:\n{}", old.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(old.child.try_wait().unwrap().is_none(), "the old daemon exited:\n{}", old.log());
}

/// The old daemon serves the client connected before the takeover and a new
/// one: `kc`'s block `key` is readable from both, and `kc` still writes.
fn still_serves(old: &Daemon, kc: &Client, key: Key, round: u8) {
    let again = Key::from_bytes(&[b'r', round]);
    kc.put(again, &[round; 4096]).expect("the old client writes after the refused takeover");
    assert_eq!(&*kc.get(again).expect("get").expect("present"), &[round; 4096][..]);
    let other = Client::connect(&old.opts()).expect("a new client after the refused takeover");
    assert_eq!(&*other.get(key).expect("get").expect("present"), &[7u8; 4096][..]);
    let v = stats_fast(&old.socket);
    assert_eq!(v["daemon_pid"].as_u64(), Some(u64::from(old.child.id())), "{v}");
}

/// The geometry words of the region header, as a client reads them
/// through its mapping: (channel count, ring capacity, channel stride).
fn header_geometry(region: &kachedb_shm::Region) -> (u32, u32, u64) {
    use kachedb_shm::region::RegionHeader;
    use std::mem::offset_of;
    use std::sync::atomic::{AtomicU32, AtomicU64};
    let base = region.base();
    // SAFETY: the header page is mapped (shared) while `region` lives; these
    // offsets are in it and aligned for their widths, and every access to the
    // header's words is atomic (the daemon copies and restores it with
    // atomic loads and stores).
    unsafe {
        let at32 = |off: usize| (*base.add(off).cast::<AtomicU32>()).load(Ordering::Relaxed);
        let at64 = |off: usize| (*base.add(off).cast::<AtomicU64>()).load(Ordering::Relaxed);
        (
            at32(offset_of!(RegionHeader, channel_count)),
            at32(offset_of!(RegionHeader, ring_capacity)),
            at64(offset_of!(RegionHeader, channel_stride)),
        )
    }
}

/// Another geometry than `l` that the header's own checks accept: the same
/// megaslab offset and length and the same region length, another channel
/// count or ring capacity.
fn other_geometry(l: &kachedb_shm::region::Layout) -> kachedb_shm::region::Layout {
    use kachedb_shm::region::Layout;
    (1..=l.channel_count * 2)
        .flat_map(|ch| (1..=20).map(move |p| (ch, 1u32 << p)))
        .filter(|&(ch, cap)| (ch, cap) != (l.channel_count, l.ring_capacity))
        .filter_map(|(ch, cap)| Layout::new(ch, cap, l.slab_len).ok())
        .find(|o| o.slab_offset == l.slab_offset && o.region_len == l.region_len)
        .expect("another layout with the same megaslab offset")
}

/// Writes `to`'s channel count, ring capacity and channel stride into the
/// region header through `region`'s mapping, as a hostile client can.
fn write_geometry(region: &kachedb_shm::Region, to: &kachedb_shm::region::Layout) {
    use kachedb_shm::region::RegionHeader;
    use std::mem::offset_of;
    use std::sync::atomic::{AtomicU32, AtomicU64};
    let base = region.base();
    // SAFETY: as in `header_geometry`.
    unsafe {
        let at32 = |off: usize| &*base.add(off).cast::<AtomicU32>();
        let at64 = |off: usize| &*base.add(off).cast::<AtomicU64>();
        at32(offset_of!(RegionHeader, channel_count)).store(to.channel_count, Ordering::Relaxed);
        at32(offset_of!(RegionHeader, ring_capacity)).store(to.ring_capacity, Ordering::Relaxed);
        at64(offset_of!(RegionHeader, channel_stride)).store(to.channel_stride, Ordering::Relaxed);
    }
}

/// Issue 25, item 11: the region header is writable by every client, and a
/// takeover must not trust it. A client writes another valid geometry (same
/// megaslab offset and length, other channel count or ring capacity) into
/// the header; the new daemon compares the header with the geometry the
/// handed-over state carries, refuses with a message naming both, and the
/// old daemon serves on: its clients (old and new) are served.
#[test]
fn takeover_is_refused_when_a_client_wrote_the_region_header() {
    let dir = TempDir::new("tampered-header");
    let sock = dir.socket();
    let mut old = Daemon::spawn_with(&sock, "8MiB", &[]);
    old.wait_ready();
    let kc = Client::connect(&old.opts()).expect("connect");
    let key = Key::from_bytes(b"before");
    kc.put(key, &[7u8; 4096]).expect("put");
    let region = kc.region().clone();
    let l = *region.layout();
    let other = other_geometry(&l);
    write_geometry(&region, &other);
    let mut next = Daemon::spawn_with(&sock, "8MiB", &["--takeover"]);
    refused_takeover(&mut next, &mut old, "the region header says");
    let log = next.log();
    let said = format!("{} channels x {} slots", other.channel_count, other.ring_capacity);
    let serves = format!("{} channels x {} slots", l.channel_count, l.ring_capacity);
    assert!(log.contains(&said) && log.contains(&serves), "the refusal names neither geometry:\n{log}");
    still_serves(&old, &kc, key, 1);
    old.signal(rustix::process::Signal::TERM);
    old.wait_exit(Duration::from_secs(30)).expect("the old daemon stops");
}

/// Issue 41, item 4: after the takeover above is refused, the header a
/// client wrote does not stay in the region. The old daemon keeps the header
/// words it wrote when it made the region and writes them back when a
/// takeover fails: read through the scribbling client's own mapping (no
/// other client says hello in between), the header holds the daemon's
/// geometry again. A client connecting afterwards maps that geometry and
/// round-trips a block; the old daemon logged the restore.
#[test]
fn a_header_a_client_wrote_is_restored_when_the_takeover_is_refused() {
    let dir = TempDir::new("restored-header");
    let sock = dir.socket();
    let mut old = Daemon::spawn_with(&sock, "8MiB", &[]);
    old.wait_ready();
    let kc = Client::connect(&old.opts()).expect("connect");
    let key = Key::from_bytes(b"before");
    kc.put(key, &[7u8; 4096]).expect("put");
    let region = kc.region().clone();
    let l = *region.layout();
    let want = (l.channel_count, l.ring_capacity, l.channel_stride);
    let other = other_geometry(&l);
    write_geometry(&region, &other);
    assert_ne!(header_geometry(&region), want);
    let mut next = Daemon::spawn_with(&sock, "8MiB", &["--takeover"]);
    refused_takeover(&mut next, &mut old, "the region header says");
    let t = Instant::now();
    while header_geometry(&region) != want {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the header still says {:?} after the refused takeover (the daemon serves {want:?}):\n{}",
            header_geometry(&region),
            old.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let later = Client::connect(&old.opts()).expect("a client after the refused takeover");
    assert_eq!(*later.region().layout(), l, "a later client mapped another geometry than the daemon serves");
    let k2 = Key::from_bytes(b"after the refusal");
    later.put(k2, &[3u8; 8192]).expect("put after the refusal");
    assert_eq!(&*later.get(k2).expect("get").expect("present"), &[3u8; 8192][..]);
    assert_eq!(&*later.get(key).expect("get").expect("present"), &[7u8; 4096][..]);
    assert!(old.log().contains("region header restored after a takeover that did not happen"), "{}", old.log());
    still_serves(&old, &kc, key, 1);
    old.signal(rustix::process::Signal::TERM);
    old.wait_exit(Duration::from_secs(30)).expect("the old daemon stops");
}

/// Issue 41, item 4: a client writes another geometry into the region
/// header (no takeover at all); the daemon restores its own header words
/// before it answers the next hello, so the next client maps the geometry
/// the daemon serves and round-trips a block.
#[test]
fn a_header_a_client_wrote_is_restored_before_the_next_hello_is_answered() {
    let dir = TempDir::new("hello-header");
    let sock = dir.socket();
    let mut d = Daemon::spawn_with(&sock, "8MiB", &[]);
    d.wait_ready();
    let kc = Client::connect(&d.opts()).expect("connect");
    let region = kc.region().clone();
    let l = *region.layout();
    write_geometry(&region, &other_geometry(&l));
    let later = Client::connect(&d.opts()).expect("a client after the header was written");
    assert_eq!(*later.region().layout(), l, "a later client mapped the geometry a client wrote");
    let key = Key::from_bytes(b"hello-restored");
    later.put(key, &[9u8; 4096]).expect("put");
    assert_eq!(&*kc.get(key).expect("get").expect("present"), &[9u8; 4096][..]);
    assert_eq!(header_geometry(&region), (l.channel_count, l.ring_capacity, l.channel_stride));
    d.signal(rustix::process::Signal::TERM);
    d.wait_exit(Duration::from_secs(30)).expect("the daemon stops");
}

/// Issue 25, item 12: a takeover whose new daemon cannot start (a remote
/// namespace the tier refuses; a metrics address already in use) fails
/// before the new daemon says `ready`: it exits with a clear error, and the
/// old daemon serves on, its clients unaffected.
#[test]
fn takeover_that_cannot_start_leaves_the_old_daemon_serving() {
    let dir = TempDir::new("bad-successor");
    let sock = dir.socket();
    let mut old = Daemon::spawn_with(&sock, "8MiB", &[]);
    old.wait_ready();
    let kc = Client::connect(&old.opts()).expect("connect");
    let key = Key::from_bytes(b"before");
    kc.put(key, &[7u8; 4096]).expect("put");
    // Nothing listens on port 1: the tier connects in the background, so only
    // its options can fail, and they do.
    let mut next = Daemon::spawn_with(
        &sock,
        "8MiB",
        &["--takeover", "--remote", "redis://127.0.0.1:1", "--remote-namespace", "has space"],
    );
    refused_takeover(&mut next, &mut old, "namespace \"has space\" must be printable ASCII");
    still_serves(&old, &kc, key, 1);
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let mut next = Daemon::spawn_with(&sock, "8MiB", &["--takeover", "--metrics-addr", &addr]);
    refused_takeover(&mut next, &mut old, &format!("cannot serve metrics on {addr}"));
    still_serves(&old, &kc, key, 2);
    old.signal(rustix::process::Signal::TERM);
    old.wait_exit(Duration::from_secs(30)).expect("the old daemon stops");
}
