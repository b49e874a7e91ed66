//! What one client (or a stats poller, or a connection flood) may cost the
//! others (issue 12, items 8–10), against real `kachedb serve` processes.

mod common;

use common::{num, stats_fast, Daemon, TempDir};
use kachedb_client::{Client, Key};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn fill(kc: &Client, n: u64) {
    let block = vec![5u8; 4096];
    for i in 0..n {
        kc.put(Key::from_bytes(format!("k{i}").as_bytes()), &block).expect("put");
    }
}

/// Item 8: without `--check-invariants`, a stats answer makes only `O(1)`
/// cross-checks: with 40 000 blocks it is several times faster than the full
/// check (which a daemon started with the flag still runs), and GETs issued
/// while stats are polled 20×/s keep their latency.
#[test]
fn stats_are_cheap_without_check_invariants() {
    const BLOCKS: u64 = 40_000;
    let (dir_full, dir_cheap) = (TempDir::new("full"), TempDir::new("cheap"));
    let full = Daemon::start(&dir_full.socket(), "400MiB");
    let mut cmd = Daemon::command(&dir_cheap.socket(), "400MiB", &[]);
    cmd.env_remove("KACHEDB_CHECK_INVARIANTS");
    let mut cheap = Daemon::launch(cmd, &dir_cheap.socket());
    cheap.wait_ready();
    let mut medians = Vec::new();
    for d in [&full, &cheap] {
        let kc = Client::connect(&d.opts()).expect("connect");
        fill(&kc, BLOCKS);
        let v = stats_fast(&d.socket);
        assert_eq!(num(&v, "blocks"), BLOCKS, "{v}");
        assert_eq!(v["invariants_ok"], true, "{v}");
        let times: Vec<Duration> = (0..15)
            .map(|_| {
                let t = Instant::now();
                stats_fast(&d.socket);
                t.elapsed()
            })
            .collect();
        medians.push(median(times));
    }
    assert_eq!(stats_fast(&full.socket)["invariants_full"], true);
    assert_eq!(stats_fast(&cheap.socket)["invariants_full"], false);
    let (m_full, m_cheap) = (medians[0], medians[1]);
    // GET latency on the cheap daemon, alone and while stats are polled 20×/s.
    let kc = Client::connect(&cheap.opts()).expect("connect");
    let gets = |kc: &Client| {
        let mut lat = Vec::new();
        let end = Instant::now() + Duration::from_millis(1000);
        let mut i = 0u64;
        while Instant::now() < end {
            let t = Instant::now();
            let v = kc.get(Key::from_bytes(format!("k{}", i % BLOCKS).as_bytes())).expect("get");
            lat.push(t.elapsed());
            drop(v);
            i += 1;
            std::thread::sleep(Duration::from_micros(200));
        }
        lat.sort();
        lat[lat.len() * 99 / 100]
    };
    let p99_alone = gets(&kc);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = {
        let (stop, sock) = (stop.clone(), cheap.socket.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                stats_fast(&sock);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let p99_polled = gets(&kc);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    poller.join().unwrap();
    println!(
        "figures: {}",
        serde_json::json!({
            "test": "stats_are_cheap_without_check_invariants",
            "blocks": BLOCKS,
            "stats_median_ms_full_check": m_full.as_secs_f64() * 1e3,
            "stats_median_ms_cheap": m_cheap.as_secs_f64() * 1e3,
            "get_p99_ms_alone": p99_alone.as_secs_f64() * 1e3,
            "get_p99_ms_stats_20_per_s": p99_polled.as_secs_f64() * 1e3,
        })
    );
    assert!(m_cheap * 3 < m_full, "stats with the full check {m_full:?}, without {m_cheap:?}");
    assert!(
        p99_polled < Duration::from_millis(30),
        "GET p99 {p99_polled:?} while stats are polled (alone {p99_alone:?})"
    );
}

/// Item 9: `--max-client-bytes 1MiB`: a greedy client's reserves and gets
/// answer OUT_OF_MEMORY naming the limit once it holds 1 MiB reserved and
/// pinned; another client reserves and pins on meanwhile; once the greedy one
/// lets go it may hold again.
#[test]
fn max_client_bytes_limits_one_client_only() {
    use kachedb_client::{ClientError, DType, Shape};
    const LIMIT: u64 = 1 << 20;
    let dir = TempDir::new("limit");
    let d = Daemon::spawn_with(&dir.socket(), "32MiB", &["--max-client-bytes", "1MiB"]);
    let mut d = d;
    d.wait_ready();
    let greedy = Client::connect(&d.opts()).expect("connect");
    let other = Client::connect(&d.opts()).expect("connect");
    let shape = Shape::new(&[100 * 1024]).expect("shape");
    // Reservations (100 KiB tensors: 25 pages each).
    let mut held = Vec::new();
    let err = loop {
        match greedy.reserve(Key::from_bytes(format!("r{}", held.len()).as_bytes()), DType::U8, &shape, 0) {
            Ok(r) => held.push(r),
            Err(e) => break e,
        }
        assert!(held.len() <= 16, "the limit never applied");
    };
    assert!(matches!(err, ClientError::ClientLimit(LIMIT)), "{err:?}");
    assert!(err.to_string().contains("1048576") && err.to_string().contains("--max-client-bytes"), "{err}");
    assert_eq!(held.len(), 10, "1 MiB holds ten 100 KiB extents");
    // The other client is not affected: it reserves and commits 8 blocks.
    for i in 0..8 {
        let r = other.reserve(Key::from_bytes(format!("b{i}").as_bytes()), DType::U8, &shape, 0).expect("reserve");
        r.commit().expect("the other client's commit");
    }
    // Letting go makes room again: abort them all; now pins count.
    for r in held.drain(..) {
        r.abort().expect("abort");
    }
    let mut views = Vec::new();
    for i in 0..8 {
        views.push(greedy.get(Key::from_bytes(format!("b{i}").as_bytes())).expect("get").expect("found"));
    }
    // 8 pinned extents: two more 100 KiB reservations fit, a third does not.
    let r1 = greedy.reserve(Key::from_bytes(b"x1"), DType::U8, &shape, 0).expect("within the limit");
    let r2 = greedy.reserve(Key::from_bytes(b"x2"), DType::U8, &shape, 0).expect("within the limit");
    let e = greedy.reserve(Key::from_bytes(b"x3"), DType::U8, &shape, 0).expect_err("over the limit");
    assert!(matches!(e, ClientError::ClientLimit(LIMIT)), "{e:?}");
    // The same block pinned twice counts once.
    let again = greedy.get(Key::from_bytes(b"b0")).expect("a second pin of a held block").expect("found");
    // The other client pins all 8 blocks too.
    let theirs: Vec<_> =
        (0..8).map(|i| other.get(Key::from_bytes(format!("b{i}").as_bytes())).unwrap().unwrap()).collect();
    drop((r1, r2, again, theirs));
    let v = stats_fast(&d.socket);
    assert!(num(&v, "client_limit_hits") >= 2 && v["invariants_ok"] == true, "{v}");
    drop(views);
    let r = greedy.reserve(Key::from_bytes(b"x4"), DType::U8, &shape, 0).expect("room again");
    r.abort().unwrap();
}

/// Seconds of CPU (user + system) `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/pid/stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

/// Whether the daemon closed `s` (EOF) within `limit`.
fn closed_within(s: &std::os::unix::net::UnixStream, limit: Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(limit)).unwrap();
    matches!((&*s).read(&mut [0u8; 64]), Ok(0) | Err(_)) && {
        // Err may be the timeout: tell them apart.
        s.set_nonblocking(true).unwrap();
        matches!((&*s).read(&mut [0u8; 64]), Ok(0))
    }
}

/// Item 10: connections are bounded (`--max-connections`: one more is closed
/// at once) and so is the time to the first request (`--hello-timeout-ms`:
/// silent connections are closed); a real client still gets in afterwards.
#[test]
fn connection_floods_are_bounded() {
    use std::os::unix::net::UnixStream;
    let dir = TempDir::new("flood");
    let mut d = Daemon::spawn_with(&dir.socket(), "8MiB", &["--max-connections", "16", "--hello-timeout-ms", "600"]);
    d.wait_ready();
    std::thread::sleep(Duration::from_millis(700)); // wait_ready's probes time out first
    let t0 = Instant::now();
    let flood: Vec<UnixStream> = (0..40).map(|_| UnixStream::connect(&d.socket).expect("connect")).collect();
    // Beyond 16, closed at once.
    let extra_closed = flood[16..].iter().filter(|s| closed_within(s, Duration::from_millis(300))).count();
    assert_eq!(extra_closed, 24, "connections beyond --max-connections were not closed at once");
    // The first 16 are closed once the hello timeout passes.
    let silent_closed = flood[..16].iter().filter(|s| closed_within(s, Duration::from_secs(3))).count();
    assert_eq!(silent_closed, 16);
    assert!(t0.elapsed() >= Duration::from_millis(550), "closed before the hello timeout: {:?}", t0.elapsed());
    let kc = Client::connect(&d.opts()).expect("a real client after the flood");
    kc.put(Key::from_bytes(b"after"), &[1u8; 64]).expect("put");
}

/// Item 10: a daemon out of file descriptors (`RLIMIT_NOFILE` 48, a flood of
/// 100 silent connections) neither spins nor floods its log: accepting pauses
/// 100 ms after each EMFILE, one log line per 10 s; once the silent
/// connections time out, a real client gets in.
#[test]
#[cfg_attr(not(kdb_prlimit), ignore = "needs prlimit (util-linux) on PATH")]
fn out_of_file_descriptors_does_not_spin_or_flood_the_log() {
    use std::os::unix::net::UnixStream;
    common::need::tool("out_of_file_descriptors_does_not_spin_or_flood_the_log", "prlimit");
    let dir = TempDir::new("emfile");
    let sock = dir.socket();
    let mut cmd = Command::new("prlimit");
    cmd.args(["--nofile=48:48", common::BIN, "serve", "--size", "8MiB", "--hello-timeout-ms", "1500", "--socket"])
        .arg(&sock)
        .env("RUST_LOG", "info")
        .env_remove("KACHEDB_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut d = Daemon::launch(cmd, &sock);
    d.wait_ready();
    std::thread::sleep(Duration::from_millis(1600)); // wait_ready's probes time out first
    let flood: Vec<UnixStream> = (0..100).map(|_| UnixStream::connect(&sock).expect("connect")).collect();
    std::thread::sleep(Duration::from_millis(100));
    let cpu0 = cpu_seconds(d.pid());
    std::thread::sleep(Duration::from_millis(1000));
    let cpu = cpu_seconds(d.pid()) - cpu0;
    let log = d.log();
    let lines = log.matches("accept failed").count();
    println!(
        "figures: {}",
        serde_json::json!({"test": "out_of_file_descriptors", "daemon_cpu_s_per_s": cpu, "accept_failed_lines": lines})
    );
    assert!(log.contains("accept failed"), "the flood never ran the daemon out of fds:\n{log}");
    assert!(cpu < 0.3, "the daemon used {cpu} s of CPU in 1 s while out of fds");
    assert!(lines <= 2, "{lines} 'accept failed' lines:\n{log}");
    drop(flood);
    // Room again once they are gone.
    let t = Instant::now();
    loop {
        match Client::connect(&common::opts(&sock)) {
            Ok(kc) => {
                kc.put(Key::from_bytes(b"after"), &[1u8; 64]).expect("put");
                break;
            }
            Err(e) if t.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("no client got in after the flood: {e}"),
        }
    }
}

/// Item 7: a client that stops draining its completion ring (here: this test
/// publishes 1536 PINGs on its raw rings and reads nothing) costs the daemon
/// ~0 CPU: a channel without completion room is not polled. Once the client
/// drains, every frame is answered; other clients are served throughout.
#[test]
fn client_with_full_completion_ring_costs_no_cpu() {
    use kachedb_shm::{Op, TensorBlockDescriptor};
    let dir = TempDir::new("fullcomp");
    let d = Daemon::start(&dir.socket(), "8MiB");
    let kc = Client::connect(&d.opts()).expect("connect");
    let region = kc.region().clone();
    let cap = region.layout().ring_capacity as usize;
    let (mut sub, mut comp) = region.client_channel(kc.channel()).expect("own channel");
    let total = cap + cap / 2;
    let frames: Vec<TensorBlockDescriptor> = (0..total)
        .map(|i| {
            let mut f = TensorBlockDescriptor::request(Op::Ping, 0, 0);
            f.request_id = i as u32;
            f
        })
        .collect();
    let mut sent = 0;
    let t = Instant::now();
    while sent < total {
        sent += sub.push_batch(&frames[sent..]).expect("push");
        region.doorbell().notify();
        assert!(t.elapsed() < Duration::from_secs(10), "the daemon never made room on the submission ring");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    let cpu0 = cpu_seconds(d.pid());
    // Another client is served meanwhile.
    let other = Client::connect(&d.opts()).expect("connect");
    other.put(Key::from_bytes(b"other"), &[3u8; 4096]).expect("the other client's put");
    std::thread::sleep(Duration::from_millis(1000));
    let cpu = cpu_seconds(d.pid()) - cpu0;
    println!("figures: {}", serde_json::json!({"test": "client_with_full_completion_ring", "daemon_cpu_s_per_s": cpu}));
    assert!(cpu < 0.2, "the daemon used {cpu} s of CPU in 1 s while a client's completion ring was full");
    // Drain: every frame answered, in order.
    let mut got = 0;
    let mut buf = [TensorBlockDescriptor::default(); 64];
    let t = Instant::now();
    while got < total {
        let n = comp.pop_batch(&mut buf).expect("pop");
        for f in &buf[..n] {
            assert_eq!(f.request_id as usize, got);
            got += 1;
        }
        if n > 0 {
            region.doorbell().notify();
        }
        assert!(t.elapsed() < Duration::from_secs(5), "only {got} of {total} answered after draining");
    }
}

/// Issue 12, item 7: a client that leaves its completion ring full for longer
/// than `--stuck-client-timeout-ms` is disconnected and its pins dropped,
/// while other clients are served; one whose ring is full for less is not.
#[test]
fn client_stuck_past_the_timeout_is_disconnected_and_loses_its_pins() {
    use common::poll_stats_fast;
    use kachedb_client::ClientError;
    use kachedb_shm::{Op, TensorBlockDescriptor};
    let dir = TempDir::new("stuck");
    let mut d = Daemon::spawn_with(&dir.socket(), "8MiB", &["--stuck-client-timeout-ms", "1500"]);
    d.wait_ready();
    let other = Client::connect(&d.opts()).expect("connect");
    other.put(Key::from_bytes(b"held"), &[7u8; 4096]).expect("put");
    let stuck = Client::connect(&d.opts()).expect("connect");
    let view = stuck.get(Key::from_bytes(b"held")).expect("get").expect("present");
    assert_eq!(num(&stats_fast(&dir.socket()), "pins"), 1);
    // More PINGs than the completion ring holds, and nothing read: stuck.
    let region = stuck.region().clone();
    let cap = region.layout().ring_capacity as usize;
    let (mut sub, _comp) = region.client_channel(stuck.channel()).expect("own channel");
    let total = cap + cap / 2;
    let frames: Vec<TensorBlockDescriptor> = (0..total)
        .map(|i| {
            let mut f = TensorBlockDescriptor::request(Op::Ping, 0, 0);
            f.request_id = i as u32 + 1_000_000;
            f
        })
        .collect();
    let mut sent = 0;
    let t = Instant::now();
    while sent < total {
        sent += sub.push_batch(&frames[sent..]).expect("push");
        region.doorbell().notify();
        assert!(t.elapsed() < Duration::from_secs(10), "the daemon never made room on the submission ring");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Well within the timeout: still connected, pin held, others served.
    std::thread::sleep(Duration::from_millis(300));
    other.put(Key::from_bytes(b"meanwhile"), &[1u8; 4096]).expect("the other client's put");
    let s = stats_fast(&dir.socket());
    // (Checked only if the machine was quick enough that less than the
    // timeout has passed since before the first frame was published.)
    if t.elapsed() < Duration::from_millis(1500) {
        assert_eq!((num(&s, "clients_kicked"), num(&s, "pins")), (0, 1), "kicked before the timeout: {s}");
    }
    // Past it: disconnected, its pin gone.
    let (s, _) = poll_stats_fast(&dir.socket(), Duration::from_secs(20), "the stuck client's disconnection", |s| {
        num(s, "clients_kicked") == 1 && num(s, "pins") == 0
    });
    assert_eq!(num(&s, "clients_connected"), 1, "{s}");
    assert!(d.log().contains("left its completion ring full"), "{}", d.log());
    // The stuck client learns it on its next call; the other serves on.
    drop(view);
    assert!(matches!(stuck.ping(), Err(ClientError::Disconnected(_))), "{:?}", stuck.ping());
    assert_eq!(&*other.get(Key::from_bytes(b"held")).expect("get").expect("present"), &[7u8; 4096][..]);
}

/// Issue 25, item 16: `--max-uid-bytes` bounds what the clients of one uid
/// hold together, so that opening more connections does not multiply
/// `--max-client-bytes`: with 1 MiB per client and 2 MiB per uid, two
/// clients of this process hold ten 100 KiB reservations each, a third
/// connection gets none (the limit named in the error); once the first lets
/// go, the third reserves.
#[test]
fn max_uid_bytes_bounds_the_clients_of_one_uid_together() {
    use kachedb_client::{ClientError, DType, Shape};
    const UID_LIMIT: u64 = 2 << 20;
    let dir = TempDir::new("uidlimit");
    let mut d = Daemon::spawn_with(&dir.socket(), "32MiB", &["--max-client-bytes", "1MiB", "--max-uid-bytes", "2MiB"]);
    d.wait_ready();
    let shape = Shape::new(&[100 * 1024]).expect("shape");
    let clients: Vec<Client> = (0..3).map(|_| Client::connect(&d.opts()).expect("connect")).collect();
    let fill = |kc: &Client, tag: &str| {
        let mut held = Vec::new();
        let err = loop {
            match kc.reserve(Key::from_bytes(format!("{tag}{}", held.len()).as_bytes()), DType::U8, &shape, 0) {
                Ok(r) => held.push(r),
                Err(e) => break e,
            }
            assert!(held.len() <= 32, "no limit applied");
        };
        (held, err)
    };
    let (a, _) = fill(&clients[0], "a");
    let (b, _) = fill(&clients[1], "b");
    assert_eq!((a.len(), b.len()), (10, 10), "each client holds up to --max-client-bytes");
    let (c, err) = fill(&clients[2], "c");
    assert_eq!(c.len(), 0, "a third connection of the uid got room past --max-uid-bytes");
    assert!(matches!(err, ClientError::ClientLimit(UID_LIMIT)), "{err:?}");
    assert!(err.to_string().contains("--max-uid-bytes"), "{err}");
    let v = stats_fast(&d.socket);
    assert!(v["invariants_ok"] == true && num(&v, "reserved") == 20, "{v}");
    for r in a {
        r.abort().expect("abort");
    }
    let (c, _) = fill(&clients[2], "c");
    assert_eq!(c.len(), 10, "room for the third once the first let go");
    drop((b, c));
    assert!(stats_fast(&d.socket)["invariants_ok"] == true);
}
