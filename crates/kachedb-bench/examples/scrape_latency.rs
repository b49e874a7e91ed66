//! Times scrapes of a running daemon's `/metrics` after filling it with
//! `BLOCKS` blocks of 4 KiB spread over `TENANTS` tenants; prints the median,
//! min and max of `N` scrapes, each on a fresh connection (request to last
//! byte). `benchmarks/scrape_old_vs_new.sh` runs it against two builds of
//! the daemon in alternation, so the two are measured in the same run.
//!
//! usage: scrape_latency SOCKET METRICS_ADDR BLOCKS TENANTS N
use kachedb_client::{Client, ConnectOptions, Key};
use std::io::{Read, Write};
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 6 {
        eprintln!("usage: scrape_latency SOCKET METRICS_ADDR BLOCKS TENANTS N");
        std::process::exit(2);
    }
    let (sock, addr) = (a[1].clone(), a[2].clone());
    let num = |i: usize| -> u64 { a[i].parse().unwrap_or_else(|_| panic!("argument {i} is not a number: {}", a[i])) };
    let (blocks, tenants, n) = (num(3), num(4).max(1), num(5).max(1) as usize);
    let page = [7u8; 4096];
    for t in 0..tenants {
        let opts =
            ConnectOptions { socket: Some(sock.clone().into()), tenant: Some(format!("t{t}")), ..Default::default() };
        let kc = Client::connect(&opts).expect("connect");
        let keys: Vec<Key> =
            (t * blocks / tenants..(t + 1) * blocks / tenants).map(|i| Key::from_parts(i, 0x5ca1e)).collect();
        for batch in keys.chunks(1000) {
            let items: Vec<(Key, &[u8])> = batch.iter().map(|&k| (k, &page[..])).collect();
            kc.put_many(&items).expect("put");
        }
    }
    let mut times_us = Vec::with_capacity(n);
    let mut bytes = 0;
    for _ in 0..n {
        let t = Instant::now();
        let mut c = std::net::TcpStream::connect(&addr).expect("connect to the metrics address");
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n").expect("send");
        let mut out = Vec::new();
        c.read_to_end(&mut out).expect("read");
        times_us.push(t.elapsed().as_micros() as u64);
        assert!(
            out.starts_with(b"HTTP/1.1 200 "),
            "not a 200: {:?}",
            String::from_utf8_lossy(&out[..out.len().min(80)])
        );
        bytes = out.len();
    }
    times_us.sort_unstable();
    println!("scrapes={n} bytes={bytes} p50_us={} min_us={} max_us={}", times_us[n / 2], times_us[0], times_us[n - 1]);
}
