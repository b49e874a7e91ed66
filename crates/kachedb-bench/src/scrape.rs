//! The cost of being watched: GET-hit round trips against a daemon, with and
//! without a watcher at a given rate, in the same run: a scraper reading
//! `GET /metrics` (`kachedb-bench ops --scrape-hz 50`), or a poller asking for
//! `kachedb stats` over the control socket with a store of many blocks
//! (`--stats-hz 20 --stats-blocks 100000`).
//!
//! The two conditions alternate in rounds (off, on, off, on, …) so that drift
//! in a shared machine's load falls on both; each condition's round trips are
//! pooled and their percentiles compared. The watcher is a thread of this
//! process doing what Prometheus or `kachedb stats` does: a fresh connection,
//! one request, the whole answer read.

use crate::spawn::DaemonProcess;
use kachedb_client::{Client, ConnectOptions, Key};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Who watches the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watcher {
    /// `GET /metrics` on the daemon's `--metrics-addr`.
    Scrape,
    /// `kachedb stats` (the control socket's stats request).
    Stats,
}

/// What [`compare`] measured.
#[derive(Debug)]
pub struct Comparison {
    /// Watches (scrapes or stats calls) per second asked for.
    pub hz: f64,
    /// GET round trips without scrapes, ns, sorted.
    pub without: Vec<u64>,
    /// GET round trips while scraping, ns, sorted.
    pub with: Vec<u64>,
    /// Watches made, and their rate over the watched rounds.
    pub scrapes: u64,
    /// Watches per second achieved while watching.
    pub achieved_hz: f64,
    /// Bytes of the last answer.
    pub scrape_bytes: u64,
    /// Slowest single watch (the whole call), ns.
    pub slowest_watch_ns: u64,
}

/// How [`compare`] runs.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    /// Who watches, how often.
    pub watcher: Watcher,
    /// Watches per second while watching.
    pub hz: f64,
    /// Length of one round of each condition.
    pub round: Duration,
    /// Rounds of each condition.
    pub rounds: usize,
    /// Blocks stored before timing (4 KiB each; the GETs read one of them).
    pub blocks: usize,
    /// Pause between GETs (`None`: back to back).
    pub pace: Option<Duration>,
}

/// GET round trips for `rounds` alternating rounds of `round` each per
/// condition (rounds long enough to hold many watches: at 50/s, 50 a second).
pub fn compare(setup: Setup) -> Result<Comparison, Box<dyn std::error::Error>> {
    let Setup { watcher, hz, round, rounds, blocks, pace } = setup;
    // A free port: bind one, let it go, give it to the daemon.
    let addr: SocketAddr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let region = (blocks.max(1) as u64 * 4096 + (64 << 20)).next_multiple_of(1 << 20);
    let daemon = DaemonProcess::spawn(region, &["--metrics-addr", &addr.to_string()])?;
    let opts = ConnectOptions { socket: Some(daemon.socket().to_path_buf()), ..Default::default() };
    let kc = Client::connect(&opts)?;
    let page = [7u8; 4096];
    let keys: Vec<Key> = (0..blocks.max(1) as u64).map(|i| Key::from_parts(i, 0x5ca1e)).collect();
    for batch in keys.chunks(1000) {
        let items: Vec<(Key, &[u8])> = batch.iter().map(|&k| (k, &page[..])).collect();
        kc.put_many(&items)?;
    }
    let key = keys[keys.len() / 2];
    for _ in 0..2000 {
        drop(kc.get(key)?);
    }
    let watch = move || -> std::io::Result<u64> {
        match watcher {
            Watcher::Scrape => scrape_once(addr),
            Watcher::Stats => kachedb_client::daemon_stats(&opts)
                .map(|s| s.to_json().len() as u64)
                .map_err(|e| std::io::Error::other(e.to_string())),
        }
    };
    watch()?; // the watcher is answered before anything is timed

    let on = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let (count, bytes, slowest) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let scraper = {
        let (on, stop, count, bytes, slowest) =
            (on.clone(), stop.clone(), count.clone(), bytes.clone(), slowest.clone());
        let period = Duration::from_secs_f64(1.0 / hz);
        std::thread::spawn(move || {
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if on.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    if let Ok(n) = watch() {
                        slowest.fetch_max(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        count.fetch_add(1, Ordering::Relaxed);
                        bytes.store(n, Ordering::Relaxed);
                    }
                    next += period;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else {
                        next = now;
                    }
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                    next = Instant::now();
                }
            }
        })
    };
    let (mut without, mut with) = (Vec::with_capacity(1 << 20), Vec::with_capacity(1 << 20));
    let mut scraping_time = Duration::ZERO;
    let run = |v: &mut Vec<u64>| -> Result<(), Box<dyn std::error::Error>> {
        let start = Instant::now();
        while start.elapsed() < round {
            for _ in 0..256 {
                let t = Instant::now();
                let view = kc.get(key)?;
                v.push(t.elapsed().as_nanos() as u64);
                drop(view);
                if let Some(p) = pace {
                    std::thread::sleep(p);
                }
            }
        }
        Ok(())
    };
    let result = (|| -> Result<(), Box<dyn std::error::Error>> {
        for _ in 0..rounds.max(1) {
            run(&mut without)?;
            on.store(true, Ordering::Relaxed);
            let t = Instant::now();
            run(&mut with)?;
            scraping_time += t.elapsed();
            on.store(false, Ordering::Relaxed);
        }
        Ok(())
    })();
    stop.store(true, Ordering::Relaxed);
    let _ = scraper.join();
    result?;
    without.sort_unstable();
    with.sort_unstable();
    let scrapes = count.load(Ordering::Relaxed);
    Ok(Comparison {
        hz,
        without,
        with,
        scrapes,
        achieved_hz: scrapes as f64 / scraping_time.as_secs_f64().max(1e-9),
        scrape_bytes: bytes.load(Ordering::Relaxed),
        slowest_watch_ns: slowest.load(Ordering::Relaxed),
    })
}

/// One `GET /metrics` on a fresh connection; the response's bytes.
fn scrape_once(addr: SocketAddr) -> std::io::Result<u64> {
    let mut c = TcpStream::connect(addr)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept: text/plain\r\n\r\n")?;
    let mut body = Vec::with_capacity(32 * 1024);
    c.read_to_end(&mut body)?;
    if !body.starts_with(b"HTTP/1.1 200 ") {
        return Err(std::io::Error::other("the metrics endpoint did not answer 200"));
    }
    Ok(body.len() as u64)
}
