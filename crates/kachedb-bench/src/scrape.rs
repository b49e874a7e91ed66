//! The cost of being watched: GET-hit round trips against a daemon serving
//! `--metrics-addr`, with and without a scraper reading `GET /metrics` at a
//! given rate, in the same run (`kachedb bench ops --scrape-hz 50`).
//!
//! The two conditions alternate in rounds (off, on, off, on, …) so that drift
//! in a shared machine's load falls on both; each condition's round trips are
//! pooled and their percentiles compared. The scraper is a thread of this
//! process doing what Prometheus does: a fresh connection, one request, the
//! whole body read.

use crate::spawn::DaemonProcess;
use kachedb_client::{Client, ConnectOptions, Key};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What [`compare`] measured.
#[derive(Debug)]
pub struct Comparison {
    /// Scrapes per second asked for.
    pub hz: f64,
    /// GET round trips without scrapes, ns, sorted.
    pub without: Vec<u64>,
    /// GET round trips while scraping, ns, sorted.
    pub with: Vec<u64>,
    /// Scrapes made, and their rate over the scraping rounds.
    pub scrapes: u64,
    /// Scrapes per second achieved while scraping.
    pub achieved_hz: f64,
    /// Bytes of the last scrape's response.
    pub scrape_bytes: u64,
}

/// GET round trips for `rounds` alternating rounds of `round` each per
/// condition (rounds long enough to hold many scrapes: at 50/s, 50 a second).
pub fn compare(hz: f64, round: Duration, rounds: usize) -> Result<Comparison, Box<dyn std::error::Error>> {
    // A free port: bind one, let it go, give it to the daemon.
    let addr: SocketAddr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let daemon = DaemonProcess::spawn(64 << 20, &["--metrics-addr", &addr.to_string()])?;
    let kc = Client::connect(&ConnectOptions { socket: Some(daemon.socket().to_path_buf()), ..Default::default() })?;
    let key = Key::from_bytes(b"bench/scrape");
    kc.put(key, &[7u8; 4096])?;
    for _ in 0..2000 {
        drop(kc.get(key)?);
    }
    scrape_once(addr)?; // the endpoint answers before anything is timed

    let on = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let (count, bytes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let scraper = {
        let (on, stop, count, bytes) = (on.clone(), stop.clone(), count.clone(), bytes.clone());
        let period = Duration::from_secs_f64(1.0 / hz);
        std::thread::spawn(move || {
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if on.load(Ordering::Relaxed) {
                    if let Ok(n) = scrape_once(addr) {
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
