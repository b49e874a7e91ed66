//! What one client (or a stats poller, or a connection flood) may cost the
//! others (issue 12, items 8–10), against real `kachedb serve` processes.

mod common;

use common::{num, stats_fast, Daemon, TempDir};
use kachedb_client::{Client, Key};
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
    assert!(p99_polled < Duration::from_millis(30), "GET p99 {p99_polled:?} while stats are polled (alone {p99_alone:?})");
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
    let e = greedy.reserve(Key::from_bytes(b"x3"), DType::U8, &shape, 0).err().expect("over the limit");
    assert!(matches!(e, ClientError::ClientLimit(LIMIT)), "{e:?}");
    // The same block pinned twice counts once.
    let again = greedy.get(Key::from_bytes(b"b0")).expect("a second pin of a held block").expect("found");
    // The other client pins all 8 blocks too.
    let theirs: Vec<_> = (0..8).map(|i| other.get(Key::from_bytes(format!("b{i}").as_bytes())).unwrap().unwrap()).collect();
    drop((r1, r2, again, theirs));
    let v = stats_fast(&d.socket);
    assert!(num(&v, "client_limit_hits") >= 2 && v["invariants_ok"] == true, "{v}");
    drop(views);
    let r = greedy.reserve(Key::from_bytes(b"x4"), DType::U8, &shape, 0).expect("room again");
    r.abort().unwrap();
}
