//! `kachedb-bench scale`: how the store's costs grow with the number of
//! blocks it holds (issue 44's goal: per-operation costs within 1.5× from
//! 10³ to 10⁶ blocks), against real daemon processes.
//!
//! For each count N of `--counts` (blocks of `--block-size` bytes, in chains
//! of `--chain` blocks, each naming the one before it as its parent):
//!
//! * **RAM**: a fresh daemon whose megaslab holds N blocks plus room for the
//!   timed PUTs; filled with `put_many`, then: GET and single-key LOOKUP of
//!   random stored keys, PUT of new chained blocks into free space, one
//!   request at a time, in five rounds of the three in turn (each figure the
//!   median over the rounds of that round's p50 or p99, µs); `stats` over the client's
//!   channel; the daemon's own RAM (`RssAnon` of `/proc/PID/status`: the
//!   megaslab is shared memory, `RssShmem`, and not counted) minus what it
//!   was before the fill, per block.
//! * **Takeover** (unless `--takeover false`): `serve --takeover` on the
//!   same socket while a client thread keeps GETting; the handover the new
//!   daemon reports ("in X ms" on its stdout) and the client's longest GET.
//! * **Eviction**: the megaslab filled to the brim (untimed), then new
//!   chained blocks PUT one at a time, each making room by evicting (chain
//!   eviction, the default policy): the time of those PUTs divided by the
//!   blocks evicted (the daemon's `evictions` counter), median of five rounds.
//! * **Disk** (with `--disk DIR`): N block files written in the tier's format
//!   under DIR, a daemon (`--disk`) started on them: its `RssAnon` once
//!   indexed minus that of a daemon on an empty tier, per block (the index's
//!   RAM); then `kill -9` and a restart: seconds to the first GET served from
//!   disk and to the whole index (`disk_indexed` in stats). The files are
//!   removed after each N.
//!
//! The table has one row per N and, for each cost, its ratio to the first
//! count's (`×(N₀)`); `--json` writes the figures, `--png` a chart of them
//! against N (log x).

use crate::scale_costs::{fmt_figure, Cost, Row, COSTS};
use crate::spawn::{DaemonProcess, TempDir};
use clap::Args;
use kachedb_client::{Client, ConnectOptions, Key, Value};
use kachedb_daemon::disk::cells::DiskStats;
use kachedb_shm::units::parse_size;
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Options of `kachedb-bench scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Block counts to measure at (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,100000,1000000", value_name = "N,…")]
    pub counts: Vec<u64>,
    /// Bytes of each block.
    #[arg(long, value_parser = parse_size, default_value = "4KiB", value_name = "SIZE")]
    pub block_size: u64,
    /// Blocks per chain (each names the one before it as its parent).
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub chain: u64,
    /// Timed requests per operation and count (fewer at small counts: at
    /// most N).
    #[arg(long, default_value_t = 20_000, value_name = "N")]
    pub samples: usize,
    /// Milliseconds of untimed GETs before the timed requests at each count
    /// (without them, the first count measured in a run had GETs of 24–45 µs
    /// instead of 1–2 µs on the machine of docs/benchmarks.md's first run,
    /// whichever count came first).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub warmup_ms: u64,
    /// Also measure the disk tier, its files in a temporary directory under
    /// DIR (removed after each count).
    #[arg(long, value_name = "DIR")]
    pub disk: Option<PathBuf>,
    /// `--disk-worker-class` of the disk tier's daemons. `normal` here by
    /// default: in the `idle` class (the daemon's default) the index rebuild
    /// gets no CPU while anything else runs, so on a shared machine it
    /// measures the other processes' load.
    #[arg(long, value_enum, default_value_t = crate::disk::WorkerClass::Normal, value_name = "CLASS")]
    pub disk_worker_class: crate::disk::WorkerClass,
    /// Block counts for the disk tier (default: `--counts`).
    #[arg(long, value_delimiter = ',', value_name = "N,…")]
    pub disk_counts: Vec<u64>,
    /// Measure the takeover pause.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub takeover: bool,
    /// Write the figures as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write the chart to PATH (PNG).
    #[arg(long, default_value = "docs/scale.png", value_name = "PATH")]
    pub png: PathBuf,
    /// Measure nothing: print the table and draw the chart of the figures a
    /// run wrote with `--json` to PATH.
    #[arg(long, value_name = "PATH")]
    pub from_json: Option<PathBuf>,
    /// TrueType font for the chart's text (default: the first of a few usual
    /// system paths, e.g. DejaVu Sans).
    #[arg(long, value_name = "PATH")]
    pub font: Option<PathBuf>,
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted.get(((sorted.len().max(1) - 1) as f64 * p).round() as usize).copied().unwrap_or(0)
}

/// p50 and p99 of `ns` (sorted here), in µs.
fn p50_p99_us(ns: &mut [u64]) -> (f64, f64) {
    ns.sort_unstable();
    (percentile(ns, 0.5) as f64 / 1e3, percentile(ns, 0.99) as f64 / 1e3)
}

/// Rounds of the timed requests (see [`round_medians`]).
const ROUNDS: usize = 5;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The medians over `rounds` (request times in ns) of each round's p50 and
/// p99, in µs.
pub fn round_medians(rounds: &mut [Vec<u64>]) -> (f64, f64) {
    let (mut p50, mut p99): (Vec<f64>, Vec<f64>) = rounds.iter_mut().map(|r| p50_p99_us(r)).unzip();
    (median(&mut p50), median(&mut p99))
}

/// A small xorshift generator: the random keys of the timed requests.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Bytes of a field (`RssAnon`, `RssShmem`, `VmRSS`, …) of `/proc/PID/status`.
pub fn proc_status_bytes(pid: u32, field: &str) -> Res<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_status_bytes(&s, field).ok_or_else(|| format!("no {field} in /proc/{pid}/status").into())
}

/// The value of `field` in the text of a `/proc/PID/status`, in bytes (the
/// file says kB: KiB).
pub fn parse_status_bytes(status: &str, field: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.split(':').next() == Some(field))?;
    let kib: u64 = line.split(':').nth(1)?.split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

/// The key of block `i` of the blocks salted `salt`, and its parent (chains of `chain`).
fn chained(i: u64, salt: u64, chain: u64) -> (Key, Option<Key>) {
    (Key::from_parts(i, salt), (!i.is_multiple_of(chain)).then(|| Key::from_parts(i - 1, salt)))
}

/// PUTs blocks `from..to` salted `salt` in batches.
fn fill(kc: &Client, payload: &[u8], from: u64, to: u64, salt: u64, chain: u64) -> Res<()> {
    let mut i = from;
    while i < to {
        let end = (i + 1024).min(to);
        let items: Vec<(Key, Value)> = (i..end)
            .map(|j| {
                let (k, p) = chained(j, salt, chain);
                (k, Value::bytes(payload).parent(p))
            })
            .collect();
        kc.put_many(&items)?;
        i = end;
    }
    Ok(())
}

const STORED: u64 = 0x5ca1e;
const FRESH: u64 = 0xf8e5;
const EVICT: u64 = 0xe71c7;
const ON_DISK: u64 = 0xd15c;

/// Runs the benchmark.
pub fn run(a: &ScaleArgs) -> Res<()> {
    if a.counts.is_empty() || a.counts.contains(&0) {
        return Err("--counts: give one or more counts above 0".into());
    }
    if a.block_size == 0 || a.chain == 0 {
        return Err("--block-size and --chain must be above 0".into());
    }
    // The font is looked for before anything is measured: a run that cannot
    // draw its chart says so at once.
    crate::scale_chart::use_font(font_bytes(a.font.as_deref())?)?;
    let (rows, block_bytes) = match &a.from_json {
        Some(p) => {
            let doc: Json = serde_json::from_str(&std::fs::read_to_string(p)?)?;
            let rows: Vec<Row> = doc["rows"]
                .as_array()
                .ok_or("no rows in the JSON")?
                .iter()
                .filter_map(|r| r.as_object().cloned())
                .collect();
            (rows, doc["block_bytes"].as_u64().ok_or("no block_bytes in the JSON")?)
        }
        None => (measure(a)?, a.block_size),
    };
    println!("{}", table(&rows, block_bytes));
    crate::scale_chart::draw(&a.png, &rows, block_bytes)?;
    eprintln!("scale: chart written to {}", a.png.display());
    Ok(())
}

/// Writes the figures so far to `--json` (after each count: a run cut short keeps what it measured).
fn save(a: &ScaleArgs, rows: &[Row]) -> Res<()> {
    if let Some(p) = &a.json {
        let doc = json!({"bench":"scale","block_bytes":a.block_size,"chain":a.chain,"rows":rows});
        std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    Ok(())
}

/// Measures at every count; the rows, by count.
fn measure(a: &ScaleArgs) -> Res<Vec<Row>> {
    // Page-aligned: a PUT places the block at its source's offset in a page,
    // so an unaligned 4 KiB source would take two pages of the megaslab.
    let bs = a.block_size as usize;
    let buf = vec![0x5au8; bs + 4096];
    let at = buf.as_ptr().align_offset(4096);
    let payload = &buf[at..at + bs];
    let mut rows: Vec<Row> = Vec::new();
    for &n in &a.counts {
        eprintln!("scale: {n} blocks in RAM …");
        let mut row = Row::new();
        row.insert("blocks".into(), json!(n));
        ram(a, n, payload, &mut row)?;
        rows.push(row);
        save(a, &rows)?;
    }
    if let Some(dir) = &a.disk {
        let counts = if a.disk_counts.is_empty() { &a.counts } else { &a.disk_counts };
        for &n in counts {
            eprintln!("scale: {n} blocks on disk …");
            let at = match rows.iter().position(|r| r["blocks"] == json!(n)) {
                Some(i) => i,
                None => {
                    let mut row = Row::new();
                    row.insert("blocks".into(), json!(n));
                    rows.push(row);
                    rows.len() - 1
                }
            };
            let files = disk(a, dir, n, &mut rows[at])?;
            save(a, &rows)?;
            // Removing a million files can take minutes (a file system
            // mounted with `discard` trims each one): the figures are saved first.
            eprintln!("scale: removing the {n} block files …");
            drop(files);
        }
    }
    rows.sort_by_key(|r| r["blocks"].as_u64());
    save(a, &rows)?;
    Ok(rows)
}

/// The RAM measurements at `n` blocks (see the module docs).
fn ram(a: &ScaleArgs, n: u64, payload: &[u8], row: &mut Row) -> Res<()> {
    let samples = a.samples.min(n as usize).max(100);
    let bs = a.block_size;
    // Room for the N stored blocks and the timed PUTs, and the allocator's
    // rounding of each block to whole pages.
    let stride = bs.next_multiple_of(4096);
    let size = ((n + samples as u64 + 8) * stride) * 9 / 8 + (64 << 20);
    let mut daemon = DaemonProcess::spawn(size, &["--takeover-pause-ms", "120000"])?;
    let pid = daemon.pid();
    let kc = Client::connect(&ConnectOptions { socket: Some(daemon.socket().to_path_buf()), ..Default::default() })?;
    let anon_before = proc_status_bytes(pid, "RssAnon")?;
    fill(&kc, payload, 0, n, STORED, a.chain)?;
    let st = kc.stats()?;
    if st.store.blocks < n {
        return Err(format!("the store holds {} blocks of the {n} put (megaslab too small?)", st.store.blocks).into());
    }
    let anon_after = proc_status_bytes(pid, "RssAnon")?;
    row.insert("rss_anon_bytes".into(), json!(anon_after));
    row.insert("rss_shmem_bytes".into(), json!(proc_status_bytes(pid, "RssShmem")?));
    row.insert("rss_bytes_per_block".into(), json!(anon_after.saturating_sub(anon_before) as f64 / n as f64));

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ n);
    // Warm up: GETs for `--warmup-ms` (at least 2000).
    let t = Instant::now();
    let mut warm = 0;
    while warm < 2000 || t.elapsed() < Duration::from_millis(a.warmup_ms) {
        drop(kc.get(Key::from_parts(rng.below(n), STORED))?);
        warm += 1;
    }
    // Rounds, each of GETs, LOOKUPs and PUTs in turn; each figure is the
    // median over the rounds of that round's percentile, so that a busy
    // spell of a shared machine spoils one round, not the figure.
    let per = samples.div_ceil(ROUNDS);
    let mut rounds: [Vec<Vec<u64>>; 3] = Default::default();
    let mut fresh = 0u64;
    for _ in 0..ROUNDS {
        let (mut get, mut lookup, mut put) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..per {
            let k = Key::from_parts(rng.below(n), STORED);
            let t = Instant::now();
            let v = kc.get(k)?;
            get.push(t.elapsed().as_nanos() as u64);
            if v.is_none() {
                return Err("a stored block was missing".into());
            }
        }
        for _ in 0..per {
            let k = [Key::from_parts(rng.below(n), STORED)];
            let t = Instant::now();
            let hits = kc.lookup(&k)?;
            lookup.push(t.elapsed().as_nanos() as u64);
            if hits != 1 {
                return Err("LOOKUP missed a stored block".into());
            }
        }
        for _ in 0..per {
            let (k, p) = chained(fresh, FRESH, a.chain);
            fresh += 1;
            let v = Value::bytes(payload).parent(p);
            let t = Instant::now();
            kc.put(k, v)?;
            put.push(t.elapsed().as_nanos() as u64);
        }
        for (r, v) in rounds.iter_mut().zip([get, lookup, put]) {
            r.push(v);
        }
    }
    if kc.stats()?.store.evictions > 0 {
        return Err("the timed PUTs evicted (megaslab too small)".into());
    }
    let mut stats = Vec::new();
    for _ in 0..(samples / 50).clamp(50, 200) {
        let t = Instant::now();
        std::hint::black_box(kc.stats()?);
        stats.push(t.elapsed().as_nanos() as u64);
    }
    for (name, r) in ["get", "lookup", "put"].into_iter().zip(&mut rounds) {
        let (p50, p99) = round_medians(r);
        row.insert(format!("{name}_p50_us"), json!(p50));
        row.insert(format!("{name}_p99_us"), json!(p99));
    }
    let (s50, s99) = p50_p99_us(&mut stats);
    row.insert("stats_p50_ms".into(), json!(s50 / 1e3));
    row.insert("stats_p99_ms".into(), json!(s99 / 1e3));

    // The takeover: the successor is the daemon from here on.
    let mut successor = None;
    if a.takeover {
        let (took_ms, stall_ms, child) = takeover(&daemon, n, row)?;
        row.insert("takeover_ms".into(), json!(took_ms));
        row.insert("takeover_stall_ms".into(), json!(stall_ms));
        successor = Some(child);
        daemon.kill9(); // Already gone: reaps it.
    }

    // Eviction: fill to the brim, then time PUTs that each evict.
    let mut j = 0u64;
    let st = kc.stats()?;
    let (e0, most) = (st.store.evictions, 2 * st.store.bytes_total / stride + 1024);
    loop {
        fill(&kc, payload, j, j + 256, EVICT, a.chain)?;
        j += 256;
        if kc.stats()?.store.evictions > e0 {
            break;
        }
        if j > most {
            return Err("PUTs past the megaslab's size evicted nothing".into());
        }
    }
    let m = per as u64;
    let (mut per_block_us, mut evicted) = (Vec::new(), 0);
    for _ in 0..ROUNDS {
        let e1 = kc.stats()?.store.evictions;
        let t = Instant::now();
        for i in j..j + m {
            let (k, p) = chained(i, EVICT, a.chain);
            kc.put(k, Value::bytes(payload).parent(p))?;
        }
        let took = t.elapsed().as_secs_f64();
        j += m;
        let e = kc.stats()?.store.evictions - e1;
        if e > 0 {
            per_block_us.push(took * 1e6 / e as f64);
        }
        evicted += e;
    }
    if per_block_us.len() == ROUNDS {
        row.insert("evict_us_per_block".into(), json!(median(&mut per_block_us)));
        row.insert("evicted_blocks".into(), json!(evicted));
    }
    drop(kc);
    if let Some(mut c) = successor {
        stop(&mut c);
    }
    drop(daemon);
    Ok(())
}

/// Stops a daemon child: SIGTERM, then SIGKILL after 10 s.
fn stop(child: &mut std::process::Child) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Takes `daemon` over (`serve --takeover` on its socket) while a client
/// thread GETs stored blocks: the handover the new daemon reports (ms), the
/// longest GET while it ran (ms), and the new daemon.
fn takeover(daemon: &DaemonProcess, n: u64, row: &mut Row) -> Res<(f64, f64, std::process::Child)> {
    let socket = daemon.socket().to_path_buf();
    let dir = TempDir::new("kachedb-scale-takeover")?;
    let out_path = dir.0.join("stdout");
    let stop_flag = Arc::new(AtomicBool::new(false));
    let longest_ns = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let worker = {
        let (stop_flag, longest_ns, measuring, socket) =
            (stop_flag.clone(), longest_ns.clone(), measuring.clone(), socket.clone());
        std::thread::spawn(move || -> Result<u64, String> {
            let kc = Client::connect(&ConnectOptions { socket: Some(socket), ..Default::default() })
                .map_err(|e| e.to_string())?;
            let mut rng = Rng(0x1234_5678 ^ n);
            let mut ops = 0u64;
            while !stop_flag.load(Ordering::Relaxed) {
                let k = Key::from_parts(rng.below(n), STORED);
                let t = Instant::now();
                let v = kc.get(k).map_err(|e| format!("a GET during the takeover failed: {e}"))?;
                let ns = t.elapsed().as_nanos() as u64;
                if v.is_none() {
                    return Err("a stored block was missing during the takeover".into());
                }
                drop(v);
                if measuring.load(Ordering::Relaxed) {
                    longest_ns.fetch_max(ns, Ordering::Relaxed);
                }
                ops += 1;
            }
            Ok(ops)
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    measuring.store(true, Ordering::Relaxed);
    let child = std::process::Command::new(std::env::current_exe()?)
        .args(["serve", "--takeover", "--socket"])
        .arg(&socket)
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::process::Stdio::inherit())
        .env("RUST_LOG", "warn")
        .spawn()?;
    let mut child = Some(child);
    let t = Instant::now();
    let took_ms = loop {
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        if let Some(ms) = handover_ms(&text) {
            // Its parts, as the new daemon reports them.
            for (key, what) in [("takeover_state_ms", "state received "), ("takeover_rebuild_ms", "store rebuilt ")] {
                if let Some(v) = ms_after(&text, what) {
                    row.insert(key.into(), json!(v));
                }
            }
            break Ok(ms);
        }
        if let Some(c) = child.as_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                break Err(format!("the takeover failed: the new daemon exited ({st}): {text}"));
            }
        }
        if t.elapsed() > Duration::from_secs(300) {
            break Err("the takeover did not finish within 300 s".to_string());
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    // The old daemon leaves once the new one serves.
    let t = Instant::now();
    while rustix::process::test_kill_process(rustix::process::Pid::from_raw(daemon.pid() as i32).ok_or("pid")?).is_ok()
        && t.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(5));
        // A zombie (our child, not yet reaped) still answers; its state says it is gone.
        let st = std::fs::read_to_string(format!("/proc/{}/stat", daemon.pid())).unwrap_or_default();
        if st.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')) {
            break;
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    measuring.store(false, Ordering::Relaxed);
    stop_flag.store(true, Ordering::Relaxed);
    let ops = worker.join().map_err(|_| "the GET thread panicked")?;
    let mut child = child.take().ok_or("no child")?;
    let took_ms = match (took_ms, ops) {
        (Ok(ms), Ok(_)) => ms,
        (Err(e), _) | (_, Err(e)) => {
            stop(&mut child);
            return Err(e.into());
        }
    };
    Ok((took_ms, longest_ns.load(Ordering::Relaxed) as f64 / 1e6, child))
}

/// The handover in the new daemon's first line ("took over … in X ms").
pub fn handover_ms(stdout: &str) -> Option<f64> {
    ms_after(stdout, " in ")
}

/// The milliseconds after `what` in the new daemon's "took over" line.
pub fn ms_after(stdout: &str, what: &str) -> Option<f64> {
    let line = stdout.lines().find(|l| l.contains("took over"))?;
    let rest = &line[line.find(what)? + what.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// The disk measurements at `n` blocks (see the module docs); the directory
/// of the block files, removed when dropped.
fn disk(a: &ScaleArgs, base: &Path, n: u64, row: &mut Row) -> Res<TempDir> {
    let tmp = TempDir::new(&base.join("kachedb-scale-disk").display().to_string())?;
    let empty = tmp.0.join("empty");
    let full = tmp.0.join("full");
    std::fs::create_dir_all(empty.join("blocks"))?;
    std::fs::create_dir_all(full.join("blocks"))?;
    let t = Instant::now();
    crate::disk::write_block_files(&full.join("blocks"), n, ON_DISK, a.block_size as usize)?;
    rustix::fs::sync();
    row.insert("disk_files_made_s".into(), json!(t.elapsed().as_secs_f64()));
    let disk_size = format!("{}", (n * (a.block_size + 8192)) * 2 + (1 << 30));
    let args = |d: &Path| -> Vec<String> {
        vec![
            "--disk".into(),
            d.display().to_string(),
            "--disk-size".into(),
            disk_size.clone(),
            "--disk-worker-class".into(),
            a.disk_worker_class.arg().into(),
        ]
    };
    let spawn = |d: &Path| -> Res<DaemonProcess> {
        let v = args(d);
        let refs: Vec<&str> = v.iter().map(String::as_str).collect();
        DaemonProcess::spawn(64 << 20, &refs)
    };
    let indexed = |d: &DaemonProcess| -> Res<kachedb_shm::Stats> {
        let opts = ConnectOptions { socket: Some(d.socket().to_path_buf()), ..Default::default() };
        let t = Instant::now();
        loop {
            let s = kachedb_client::daemon_stats(&opts)?;
            if DiskStats::of(&s).disk_indexed {
                return Ok(s);
            }
            if t.elapsed() > Duration::from_secs(1800) {
                return Err("the disk index was not built within 30 min".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // The same daemon on an empty tier: the RAM that is not the index.
    let e = spawn(&empty)?;
    indexed(&e)?;
    std::thread::sleep(Duration::from_millis(300));
    let anon_empty = proc_status_bytes(e.pid(), "RssAnon")?;
    drop(e);
    let mut d = spawn(&full)?;
    let s = indexed(&d)?;
    if DiskStats::of(&s).disk_blocks < n {
        return Err(format!("the tier indexed {} of the {n} block files", DiskStats::of(&s).disk_blocks).into());
    }
    std::thread::sleep(Duration::from_millis(300));
    let anon_full = proc_status_bytes(d.pid(), "RssAnon")?;
    row.insert("disk_index_bytes_per_block".into(), json!(anon_full.saturating_sub(anon_empty) as f64 / n as f64));
    row.insert("disk_rss_anon_bytes".into(), json!(anon_full));
    d.kill9();
    drop(d);
    // The restart after kill -9.
    let first = Key::from_parts(n / 2, ON_DISK);
    let t = Instant::now();
    let d = spawn(&full)?;
    let kc = Client::connect(&ConnectOptions { socket: Some(d.socket().to_path_buf()), ..Default::default() })?;
    loop {
        if kc.get(first)?.is_some() {
            break;
        }
        if t.elapsed() > Duration::from_secs(1800) {
            return Err("the first GET was never served".into());
        }
    }
    row.insert("restart_first_get_ms".into(), json!(t.elapsed().as_secs_f64() * 1e3));
    let s = indexed(&d)?;
    row.insert("restart_indexed_ms".into(), json!(t.elapsed().as_secs_f64() * 1e3));
    row.insert("restart_index_rebuild_s".into(), json!(DiskStats::of(&s).disk_index_s));
    drop(kc);
    drop(d);
    Ok(tmp)
}

/// Ratio of `v` to `base`, if both are there and `base` is above 0.
pub fn ratio(v: Option<f64>, base: Option<f64>) -> Option<f64> {
    match (v, base) {
        (Some(v), Some(b)) if b > 0.0 => Some(v / b),
        _ => None,
    }
}

/// The table: one row per count, for each cost with a figure at some count
/// its value and its ratio to the first count's (markdown).
pub fn table(rows: &[Row], block_bytes: u64) -> String {
    let Some(first) = rows.first() else { return String::new() };
    let n0 = first["blocks"].as_u64().unwrap_or(0);
    let get = |r: &Row, k: &str| r.get(k).and_then(Json::as_f64);
    let used: Vec<&Cost> = COSTS.iter().filter(|c| rows.iter().any(|r| r.contains_key(c.key))).collect();
    let mut out = format!("Block size {block_bytes} B; ×({}) = the cost over the cost at {n0} blocks.\n\n", n0);
    // Groups of at most four costs, one table each, so that a table fits a screen.
    for group in used.chunks(4) {
        let mut head = "| blocks |".to_string();
        let mut rule = "| ---: |".to_string();
        for c in group {
            head += &format!(" {} | ×({n0}) |", c.label);
            rule += " ---: | ---: |";
        }
        out += &format!("{head}\n{rule}\n");
        for r in rows {
            out += &format!("| {} |", r["blocks"]);
            for c in group {
                let (v, x) = (get(r, c.key), ratio(get(r, c.key), get(first, c.key)));
                out += &format!(
                    " {} | {} |",
                    v.map_or("–".into(), fmt_figure),
                    x.map_or("–".into(), |x| format!("{x:.2}"))
                );
            }
            out += "\n";
        }
        out += "\n";
    }
    out
}

/// The font's bytes, read once and kept for the process's life (the chart
/// library keeps a reference).
fn font_bytes(path: Option<&Path>) -> Res<&'static [u8]> {
    const USUAL: &[&str] = &[
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    ];
    let p = match path {
        Some(p) => p.to_path_buf(),
        None => USUAL.iter().map(PathBuf::from).find(|p| p.exists()).ok_or(
            "no font for the chart at the usual paths (Debian: apt-get install fonts-dejavu-core); give one with --font",
        )?,
    };
    let bytes = std::fs::read(&p).map_err(|e| format!("--font {}: {e}", p.display()))?;
    Ok(Box::leak(bytes.into_boxed_slice()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read_in_bytes() {
        let s = "Name:\tkachedb\nVmRSS:\t  5000 kB\nRssAnon:\t    1200 kB\nRssShmem:\t  3000 kB\n";
        assert_eq!(parse_status_bytes(s, "RssAnon"), Some(1200 * 1024));
        assert_eq!(parse_status_bytes(s, "RssShmem"), Some(3000 * 1024));
        assert_eq!(parse_status_bytes(s, "RssFile"), None);
        // A field whose name another begins with is not taken for it.
        assert_eq!(parse_status_bytes("VmRSSx:\t1 kB\n", "VmRSS"), None);
    }

    #[test]
    fn the_handover_is_read_from_the_new_daemons_line() {
        let line = "kachedb: took over instance 0 on /tmp/s.sock from pid 12 in 14.4 ms (state received 3.0 ms, store rebuilt 1.0 ms) — 5 block(s)\n";
        assert_eq!(handover_ms(line), Some(14.4));
        assert_eq!(ms_after(line, "state received "), Some(3.0));
        assert_eq!(ms_after(line, "store rebuilt "), Some(1.0));
        assert_eq!(handover_ms("kachedb: serving instance 0\n"), None);
    }

    #[test]
    fn one_slow_round_does_not_move_the_figures() {
        // p50 / p99 per round (µs): 2 / 3, 9 / 9, 1.5 / 100.
        let mut rounds = vec![vec![1000, 2000, 3000], vec![9000, 9000, 9000], vec![1500, 1500, 100_000]];
        assert_eq!(round_medians(&mut rounds), (2.0, 9.0));
    }

    #[test]
    fn the_table_gives_each_cost_its_ratio_to_the_first_count() {
        let mk = |n: u64, get: f64| {
            let mut r = Row::new();
            r.insert("blocks".into(), json!(n));
            r.insert("get_p50_us".into(), json!(get));
            r
        };
        let t = table(&[mk(1000, 2.0), mk(10_000, 3.0)], 4096);
        assert!(t.contains("| GET p50 µs | ×(1000) |"), "{t}");
        assert!(t.contains("| 1000 | 2.00 | 1.00 |"), "{t}");
        assert!(t.contains("| 10000 | 3.00 | 1.50 |"), "{t}");
        // Costs measured at no count have no column.
        assert!(!t.contains("PUT p50"), "{t}");
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
    }
}
