//! `kachedb-bench ops`: operations against a real daemon process.

use crate::spawn::{cpu_seconds, DaemonProcess};
use clap::Args;
use kachedb_client::{Client, ConnectOptions, DType, Key, Shape, Value};
use kachedb_shm::units::{human_bytes, parse_size};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Options of `kachedb-bench ops`.
#[derive(Debug, Args)]
pub struct OpsArgs {
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A short run (small sizes, few repetitions).
    #[arg(long)]
    pub quick: bool,
    /// Use the daemon at this socket instead of starting one.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Bytes of the large PUT/GET block.
    #[arg(long, value_parser = parse_size)]
    pub big: Option<u64>,
    /// Also time GET round trips against a daemon with `--metrics-addr`, with
    /// and without a scraper reading /metrics this many times a second (0: skip).
    #[arg(long, default_value_t = 50.0, value_name = "HZ")]
    pub scrape_hz: f64,
    /// Also time GET round trips (paced every 200 µs) against a daemon holding
    /// `--stats-blocks` blocks, with and without `kachedb stats` polled this many
    /// times a second (0: skip).
    #[arg(long, default_value_t = 20.0, value_name = "HZ")]
    pub stats_hz: f64,
    /// Blocks in the store for the stats comparison.
    #[arg(long, default_value_t = 100_000, value_name = "N")]
    pub stats_blocks: usize,
    /// Also time GET round trips against two fresh daemons, one with
    /// per-tenant accounting (a named tenant with a limit, the request
    /// window) and one with `--tenant-accounting off`, in alternating
    /// rounds (same run).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub tenants: bool,
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Out {
    json: bool,
}

impl Out {
    fn emit(&self, v: serde_json::Value, human: String) {
        if self.json {
            println!("{v}");
        } else {
            println!("{human}");
        }
    }
}

/// Runs the benchmark.
pub fn run(a: &OpsArgs) -> Result<(), Box<dyn std::error::Error>> {
    let big = a.big.unwrap_or(if a.quick { 64 << 20 } else { 512 << 20 });
    let reps = if a.quick { 3 } else { 5 };
    let rtt_iters = if a.quick { 20_000 } else { 200_000 };
    let daemon = match &a.socket {
        Some(_) => None,
        None => Some(DaemonProcess::spawn(big * 3 + (256 << 20), &[])?),
    };
    let socket = a.socket.clone().or_else(|| daemon.as_ref().map(|d| d.socket().to_path_buf()));
    let kc = Client::connect(&ConnectOptions { socket, ..Default::default() })?;
    let out = Out { json: a.json };
    if !a.json {
        println!("kachedb-bench ops — client and daemon are separate processes; medians of {reps} runs");
    }

    // Round trips.
    let small = Key::from_bytes(b"bench/small");
    kc.put(small, &[7u8; 4096])?;
    for _ in 0..1000 {
        kc.ping()?;
    }
    let mut ping = Vec::with_capacity(rtt_iters);
    for _ in 0..rtt_iters {
        let t = Instant::now();
        kc.ping()?;
        ping.push(t.elapsed().as_nanos() as u64);
    }
    ping.sort_unstable();
    out.emit(
        json!({"bench":"ping_rtt","p50_ns":percentile(&ping,0.5),"p99_ns":percentile(&ping,0.99),"iters":rtt_iters}),
        format!(
            "PING round trip          p50 {:>7} ns   p99 {:>7} ns",
            percentile(&ping, 0.5),
            percentile(&ping, 0.99)
        ),
    );
    let mut get = Vec::with_capacity(rtt_iters);
    for _ in 0..rtt_iters {
        let t = Instant::now();
        let v = kc.get(small)?;
        get.push(t.elapsed().as_nanos() as u64);
        drop(v);
    }
    get.sort_unstable();
    out.emit(
        json!({"bench":"get_rtt","p50_ns":percentile(&get,0.5),"p99_ns":percentile(&get,0.99),"iters":rtt_iters}),
        format!(
            "GET-hit round trip       p50 {:>7} ns   p99 {:>7} ns (4 KiB block, pinned view; release not timed)",
            percentile(&get, 0.5),
            percentile(&get, 0.99)
        ),
    );

    // The GET round trip with and without a Prometheus scraper (fresh daemon).
    if a.socket.is_none() && a.scrape_hz > 0.0 {
        let (round, rounds) = if a.quick { (Duration::from_millis(300), 3) } else { (Duration::from_secs(1), 5) };
        let setup = crate::scrape::Setup {
            watcher: crate::scrape::Watcher::Scrape,
            hz: a.scrape_hz,
            round,
            rounds,
            blocks: 1,
            pace: None,
        };
        match crate::scrape::compare(setup) {
            Ok(c) => {
                let p = |v: &[u64]| (percentile(v, 0.5), percentile(v, 0.99));
                let ((b50, b99), (w50, w99)) = (p(&c.without), p(&c.with));
                out.emit(
                    json!({"bench":"get_rtt_scraped","scrape_hz":c.hz,"achieved_hz":c.achieved_hz,"scrapes":c.scrapes,
                           "scrape_bytes":c.scrape_bytes,"p50_ns_without":b50,"p99_ns_without":b99,
                           "p50_ns_with":w50,"p99_ns_with":w99,"iters_each":c.without.len()}),
                    format!(
                        "GET round trip, metrics  p99 {b99:>7} ns without / {w99:>7} ns with {:.0} scrapes/s ({:+.1} %); p50 {b50} / {w50} ns",
                        c.achieved_hz,
                        (w99 as f64 / b99.max(1) as f64 - 1.0) * 100.0
                    ),
                );
            }
            Err(e) => eprintln!("GET round trip while scraping /metrics: skipped ({e})"),
        }
    }

    // The GET round trip with and without `kachedb stats` polled, many blocks stored (fresh daemon).
    if a.socket.is_none() && a.stats_hz > 0.0 {
        let (round, rounds, blocks) = if a.quick {
            (Duration::from_millis(500), 3, a.stats_blocks.min(10_000))
        } else {
            (Duration::from_secs(3), 5, a.stats_blocks)
        };
        let setup = crate::scrape::Setup {
            watcher: crate::scrape::Watcher::Stats,
            hz: a.stats_hz,
            round,
            rounds,
            blocks,
            pace: Some(Duration::from_micros(200)),
        };
        match crate::scrape::compare(setup) {
            Ok(c) => {
                let p = |v: &[u64]| (percentile(v, 0.5), percentile(v, 0.99), v.last().copied().unwrap_or(0));
                let ((b50, b99, bmax), (w50, w99, wmax)) = (p(&c.without), p(&c.with));
                out.emit(
                    json!({"bench":"get_rtt_stats_polled","blocks":blocks,"stats_hz":c.hz,"achieved_hz":c.achieved_hz,
                           "stats_calls":c.scrapes,"slowest_stats_ns":c.slowest_watch_ns,"p50_ns_without":b50,
                           "p99_ns_without":b99,"max_ns_without":bmax,"p50_ns_with":w50,"p99_ns_with":w99,
                           "max_ns_with":wmax,"iters_each":c.without.len()}),
                    format!(
                        "GET round trip, stats    p99 {b99:>7} ns quiet / {w99:>7} ns with {:.0} stats/s ({:.2}x), {blocks} blocks, GETs every 200 us; p50 {b50} / {w50} ns, max {bmax} / {wmax} ns; slowest stats call {:.2} ms",
                        c.achieved_hz,
                        w99 as f64 / b99.max(1) as f64,
                        c.slowest_watch_ns as f64 / 1e6
                    ),
                );
            }
            Err(e) => eprintln!("GET round trip while polling stats: skipped ({e})"),
        }
    }

    // The GET round trip with per-tenant accounting on and off (two fresh
    // daemons, alternating rounds).
    if a.socket.is_none() && a.tenants {
        let (rounds, iters) = if a.quick { (4, 5_000) } else { (10, 20_000) };
        match tenant_get_rtt(rounds, iters) {
            Ok((on, off)) => {
                let p = |v: &[u64]| (percentile(v, 0.5), percentile(v, 0.99));
                let ((on50, on99), (off50, off99)) = (p(&on), p(&off));
                out.emit(
                    json!({"bench":"get_rtt_tenants","p50_ns_on":on50,"p99_ns_on":on99,"p50_ns_off":off50,
                           "p99_ns_off":off99,"iters_each":on.len(),"rounds":rounds}),
                    format!(
                        "GET round trip, tenants  p50 {on50:>7} ns on / {off50:>7} ns off ({:+.1} %); p99 {on99} / {off99} ns ({:+.1} %)",
                        (on50 as f64 / off50.max(1) as f64 - 1.0) * 100.0,
                        (on99 as f64 / off99.max(1) as f64 - 1.0) * 100.0
                    ),
                );
            }
            Err(e) => eprintln!("GET round trip with tenant accounting: skipped ({e})"),
        }
    }

    // The same GET round trip with the client and a fresh daemon pinned to one
    // core (the daemon sharing a busy node's core), then to two.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if a.socket.is_none() && cores >= 2 {
        let iters = if a.quick { 5_000 } else { 50_000 };
        for (name, daemon_cpu, client_cpu) in [("same core", 0, 0), ("separate cores", 1, 0)] {
            match pinned_get_rtt(daemon_cpu, client_cpu, iters) {
                Ok(v) => out.emit(
                    json!({"bench":"get_rtt_pinned","placement":name,"daemon_cpu":daemon_cpu,"client_cpu":client_cpu,
                           "p50_ns":percentile(&v,0.5),"p99_ns":percentile(&v,0.99),"iters":iters}),
                    format!(
                        "GET round trip, {name:<14} p50 {:>7} ns   p99 {:>7} ns (daemon on CPU {daemon_cpu}, client on CPU {client_cpu})",
                        percentile(&v, 0.5),
                        percentile(&v, 0.99)
                    ),
                ),
                Err(e) => eprintln!("GET round trip, {name}: skipped ({e})"),
            }
        }
    }

    // Small blocks in batches: put_many of 1000 x 64 KiB against copying the
    // same bytes into buffers of this process; get_prefix of 128 blocks.
    {
        let n = if a.quick { 200 } else { 1000 };
        let len = 64 << 10;
        let keys: Vec<Key> = (0..n).map(|i| Key::from_bytes(format!("bench/small-{i}").as_bytes())).collect();
        let srcs: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 251) as u8; len]).collect();
        let mut dsts: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; len]).collect();
        let items: Vec<(Key, &[u8])> = keys.iter().zip(&srcs).map(|(k, s)| (*k, &s[..])).collect();
        let (mut copy_s, mut put_s) = (Vec::new(), Vec::new());
        kc.put_many(&items)?;
        for _ in 0..reps {
            let t = Instant::now();
            for (d, s) in dsts.iter_mut().zip(&srcs) {
                d.copy_from_slice(s);
            }
            copy_s.push(t.elapsed().as_secs_f64());
            std::hint::black_box(&dsts);
            let t = Instant::now();
            kc.put_many(&items)?;
            put_s.push(t.elapsed().as_secs_f64());
        }
        let (c, p) = (median(&mut copy_s), median(&mut put_s));
        let over_us = (p - c) / n as f64 * 1e6;
        out.emit(
            json!({"bench":"put_many_small","blocks":n,"block_bytes":len,"put_many_s":p,"copy_s":c,
                   "overhead_per_block_us":over_us}),
            format!(
                "put_many {n} x 64 KiB      {:>8.2} ms vs copying the same bytes {:>8.2} ms: {over_us:+.2} us per block",
                p * 1e3,
                c * 1e3
            ),
        );
        let prefix = &keys[..128.min(n)];
        let rounds = if a.quick { 200 } else { 2000 };
        let (mut pre, mut many) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let t = Instant::now();
            for _ in 0..rounds {
                let v = kc.get_prefix(prefix)?;
                assert_eq!(v.len(), prefix.len());
            }
            pre.push(t.elapsed().as_secs_f64() / rounds as f64);
            let t = Instant::now();
            for _ in 0..rounds {
                drop(kc.get_many(prefix)?);
            }
            many.push(t.elapsed().as_secs_f64() / rounds as f64);
        }
        let (pr, gm) = (median(&mut pre), median(&mut many));
        out.emit(
            json!({"bench":"get_prefix","blocks":prefix.len(),"us":pr*1e6,"get_many_us":gm*1e6}),
            format!(
                "get_prefix of {} blocks   {:>8.1} us ({:.2} us per block; get_many of the same {:.1} us)",
                prefix.len(),
                pr * 1e6,
                pr * 1e6 / prefix.len() as f64,
                gm * 1e6
            ),
        );
        let gone = kc.delete_many(&keys)?;
        debug_assert_eq!(gone, keys.len());
    }

    // Batched ops.
    let keys: Vec<Key> = (0..64u32).map(|i| Key::from_bytes(format!("bench/batch-{i}").as_bytes())).collect();
    let payload = [1u8; 256];
    let items: Vec<(Key, &[u8])> = keys.iter().map(|k| (*k, &payload[..])).collect();
    kc.put_many(&items)?;
    let mut lookups = Vec::new();
    let mut gets = Vec::new();
    for _ in 0..reps {
        let rounds = if a.quick { 500 } else { 5000 };
        let t = Instant::now();
        for _ in 0..rounds {
            let n = kc.lookup(&keys)?;
            assert_eq!(n, keys.len());
        }
        lookups.push((rounds * keys.len()) as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..rounds {
            let views = kc.get_many(&keys)?;
            drop(views);
        }
        // Each round is 64 GETs and 64 RELEASEs.
        gets.push((rounds * keys.len() * 2) as f64 / t.elapsed().as_secs_f64());
    }
    let (l, g) = (median(&mut lookups), median(&mut gets));
    out.emit(
        json!({"bench":"lookup_batch","batch":64,"ops_per_s":l}),
        format!("LOOKUP batches of 64     {:>10.2} M ops/s", l / 1e6),
    );
    out.emit(
        json!({"bench":"get_many","batch":64,"ops_per_s":g}),
        format!("get_many(64)+release     {:>10.2} M ops/s (GET and RELEASE each counted)", g / 1e6),
    );

    // Large PUT against memcpy of the same bytes, and GET as a view.
    let src: Vec<u8> = (0..big as usize).map(|i| (i * 31 + 7) as u8).collect();
    let mut dst = vec![0u8; big as usize];
    let shape = Shape::for_bytes(big).ok_or("size not representable")?;
    let key = Key::from_bytes(b"bench/big");
    let mut memcpy = Vec::new();
    let mut put = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        memcpy.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
        let t = Instant::now();
        kc.put(key, Value::tensor(DType::U8, shape, &src))?;
        put.push(t.elapsed().as_secs_f64());
    }
    let (m, p) = (median(&mut memcpy), median(&mut put));
    let (mg, pg) = (big as f64 / m / 1e9, big as f64 / p / 1e9);
    out.emit(
        json!({"bench":"put","bytes":big,"gbps":pg,"memcpy_gbps":mg,"ratio":pg/mg,"put_s":p,"memcpy_s":m}),
        format!(
            "PUT {:<10}           {:>6.2} GB/s vs memcpy {:>6.2} GB/s = {:.0} %",
            human_bytes(big),
            pg,
            mg,
            100.0 * pg / mg
        ),
    );
    let mut views = Vec::new();
    for _ in 0..if a.quick { 50 } else { 200 } {
        let t = Instant::now();
        let v = kc.get(key)?.ok_or("big block missing")?;
        views.push(t.elapsed().as_nanos() as u64);
        std::hint::black_box(v.as_ptr());
        drop(v);
    }
    views.sort_unstable();
    let check = kc.get(key)?.ok_or("big block missing")?;
    if check[..] != src[..] {
        return Err("the large block read back differs from what was put".into());
    }
    drop(check);
    out.emit(
        json!({"bench":"get_view","bytes":big,"p50_ns":percentile(&views,0.5),"p99_ns":percentile(&views,0.99)}),
        format!(
            "GET {:<10} as a view   p50 {:>7} ns   p99 {:>7} ns",
            human_bytes(big),
            percentile(&views, 0.5),
            percentile(&views, 0.99)
        ),
    );

    // Idle daemon CPU.
    if let Some(d) = &daemon {
        let secs = if a.quick { 1.0 } else { 5.0 };
        std::thread::sleep(Duration::from_millis(300));
        let c0 = cpu_seconds(d.pid()).ok_or("cannot read the daemon's CPU time")?;
        std::thread::sleep(Duration::from_secs_f64(secs));
        let c1 = cpu_seconds(d.pid()).ok_or("cannot read the daemon's CPU time")?;
        let pct = 100.0 * (c1 - c0) / secs;
        out.emit(
            json!({"bench":"idle_cpu","seconds":secs,"percent":pct}),
            format!("idle daemon CPU          {pct:>6.2} % of one core over {secs} s (one client connected, idle)"),
        );
    }
    Ok(())
}

/// GET-hit round trips (ns, sorted), per-tenant accounting on and off: two
/// fresh daemons (on: the client is tenant `bench`, limited to 1 GiB, so its
/// blocks are on a list of their own and every GET is counted for it and in
/// the request windows; off: `--tenant-accounting off`), 1024 keys of 4 KiB
/// read in turn, `rounds` alternating rounds of `iters` GETs each.
fn tenant_get_rtt(rounds: usize, iters: usize) -> Result<(Vec<u64>, Vec<u64>), Box<dyn std::error::Error>> {
    let on = DaemonProcess::spawn(64 << 20, &["--tenant-limit", "bench=1GiB"])?;
    let off = DaemonProcess::spawn(64 << 20, &["--tenant-accounting", "off"])?;
    let connect = |d: &DaemonProcess| {
        Client::connect(&ConnectOptions {
            socket: Some(d.socket().to_path_buf()),
            tenant: Some("bench".into()),
            ..Default::default()
        })
    };
    let (kon, koff) = (connect(&on)?, connect(&off)?);
    let keys: Vec<Key> = (0..1024u32).map(|i| Key::from_bytes(format!("bench/tenant/{i}").as_bytes())).collect();
    for kc in [&kon, &koff] {
        for &k in &keys {
            kc.put(k, &[7u8; 4096])?;
        }
        for &k in keys.iter().cycle().take(4096) {
            drop(kc.get(k)?);
        }
    }
    let (mut v_on, mut v_off) = (Vec::with_capacity(rounds * iters), Vec::with_capacity(rounds * iters));
    for round in 0..rounds {
        // Alternate which goes first, so neither always follows the other.
        let order = if round % 2 == 0 { [(&kon, true), (&koff, false)] } else { [(&koff, false), (&kon, true)] };
        for (kc, is_on) in order {
            let v = if is_on { &mut v_on } else { &mut v_off };
            for &k in keys.iter().cycle().skip(round * 37).take(iters) {
                let t = Instant::now();
                let view = kc.get(k)?;
                v.push(t.elapsed().as_nanos() as u64);
                drop(view);
            }
        }
    }
    v_on.sort_unstable();
    v_off.sort_unstable();
    Ok((v_on, v_off))
}

/// GET-hit round trips (ns, sorted) of a client on `client_cpu` against a fresh
/// daemon whose every thread is on `daemon_cpu` (it inherits this thread's
/// affinity when spawned). This thread's affinity is restored after.
fn pinned_get_rtt(daemon_cpu: usize, client_cpu: usize, iters: usize) -> Result<Vec<u64>, Box<dyn std::error::Error>> {
    let original = sched_getaffinity(None)?;
    let only = |cpu: usize| {
        let mut s = CpuSet::new();
        s.set(cpu);
        s
    };
    let run = || -> Result<Vec<u64>, Box<dyn std::error::Error>> {
        sched_setaffinity(None, &only(daemon_cpu))?;
        let daemon = DaemonProcess::spawn(64 << 20, &[])?;
        sched_setaffinity(None, &only(client_cpu))?;
        let kc =
            Client::connect(&ConnectOptions { socket: Some(daemon.socket().to_path_buf()), ..Default::default() })?;
        let key = Key::from_bytes(b"bench/pinned");
        kc.put(key, &[7u8; 4096])?;
        for _ in 0..2000 {
            drop(kc.get(key)?);
        }
        let mut v = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let view = kc.get(key)?;
            v.push(t.elapsed().as_nanos() as u64);
            drop(view);
        }
        v.sort_unstable();
        Ok(v)
    };
    let r = run();
    sched_setaffinity(None, &original)?;
    r
}
