//! Times scrapes of running daemons' `/metrics` after filling each with
//! `BLOCKS` blocks of 4 KiB spread over `TENANTS` tenants: `N` scrapes per
//! daemon, each on a fresh connection (request to last byte), taking turns
//! between the daemons scrape by scrape, so that a burst of other work on the
//! machine falls on all of them alike. Prints one line per daemon, in the
//! order given: the median, 99th percentile, min and max, and how many took
//! over 1 ms.
//!
//! With `--busy`, every tenant puts a new block and reads it back before each
//! scrape (untimed), so the per-tenant figures change between scrapes as on
//! a busy node; without it the daemons are idle while they are scraped.
//! `benchmarks/scrape_old_vs_new.sh` runs it against two builds of the
//! daemon.
//!
//! usage: scrape_latency [--busy] BLOCKS TENANTS N SOCKET METRICS_ADDR [SOCKET METRICS_ADDR]...
use kachedb_client::{Client, ConnectOptions, Key};
use std::io::{Read, Write};
use std::time::Instant;

const USAGE: &str = "usage: scrape_latency [--busy] BLOCKS TENANTS N SOCKET METRICS_ADDR [SOCKET METRICS_ADDR]...";

/// One daemon under test.
struct Target {
    addr: String,
    /// One client per tenant, kept connected with `--busy`.
    clients: Vec<Client>,
    times_us: Vec<u64>,
    bytes: usize,
}

fn main() {
    let mut a: Vec<String> = std::env::args().skip(1).collect();
    let busy = a.first().is_some_and(|x| x == "--busy");
    if busy {
        a.remove(0);
    }
    if a.len() < 5 || !(a.len() - 3).is_multiple_of(2) {
        eprintln!("{USAGE}");
        std::process::exit(2);
    }
    let num = |i: usize| -> u64 {
        a[i].parse().unwrap_or_else(|_| panic!("argument {i} is not a number: {}\n{USAGE}", a[i]))
    };
    let (blocks, tenants, n) = (num(0), num(1).max(1), num(2).max(1) as usize);
    let page = [7u8; 4096];
    let mut targets: Vec<Target> = a[3..]
        .chunks(2)
        .map(|pair| {
            let mut clients = Vec::new();
            for t in 0..tenants {
                let opts = ConnectOptions {
                    socket: Some(pair[0].clone().into()),
                    tenant: Some(format!("t{t}")),
                    ..Default::default()
                };
                let kc = Client::connect(&opts).expect("connect");
                let keys: Vec<Key> =
                    (t * blocks / tenants..(t + 1) * blocks / tenants).map(|i| Key::from_parts(i, 0x5ca1e)).collect();
                for batch in keys.chunks(1000) {
                    let items: Vec<(Key, &[u8])> = batch.iter().map(|&k| (k, &page[..])).collect();
                    kc.put_many(&items).expect("put");
                }
                if busy {
                    clients.push(kc);
                }
            }
            Target { addr: pair[1].clone(), clients, times_us: Vec::with_capacity(n), bytes: 0 }
        })
        .collect();
    for i in 0..n as u64 {
        for target in &mut targets {
            for (t, kc) in target.clients.iter().enumerate() {
                let key = Key::from_parts(blocks + i, t as u64);
                kc.put(key, &page[..]).expect("put");
                let _ = kc.get(key).expect("get");
            }
            let t = Instant::now();
            let mut c = std::net::TcpStream::connect(&target.addr).expect("connect to the metrics address");
            c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n").expect("send");
            let mut out = Vec::new();
            c.read_to_end(&mut out).expect("read");
            target.times_us.push(t.elapsed().as_micros() as u64);
            assert!(
                out.starts_with(b"HTTP/1.1 200 "),
                "not a 200: {:?}",
                String::from_utf8_lossy(&out[..out.len().min(80)])
            );
            target.bytes = out.len();
        }
    }
    for target in &mut targets {
        let times = &mut target.times_us;
        times.sort_unstable();
        println!(
            "scrapes={n} bytes={} p50_us={} p99_us={} min_us={} max_us={} over_1ms={}",
            target.bytes,
            times[n / 2],
            times[n * 99 / 100],
            times[0],
            times[n - 1],
            times.iter().filter(|&&t| t > 1000).count()
        );
    }
}
