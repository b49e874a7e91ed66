//! `kachedb-bench disk`: the disk tier (`serve --disk`) against plain file
//! I/O of the same bytes on the same file system, in the same run.
//!
//! * **Write-behind**: a daemon with `--disk` takes blocks of 64 KiB, 2 MiB
//!   and 64 MiB; timed from the commit of the first block (its bytes in RAM,
//!   as the baseline's are) until the tier reports the last one written.
//!   Baseline: one thread writing the same bytes to new files of the same
//!   sizes in a directory next to the tier's (same file system), each
//!   `fdatasync`ed, and the directory `fsync`ed once at the end (the
//!   durability the tier gives: data and name). Rounds alternate (a fresh
//!   set of keys each), medians.
//! * **Fill**: a second daemon on the same directory (RAM empty) fills them
//!   with LOOKUPs (a batch of keys per LOOKUP, one per 64 MiB block); each
//!   round starts a daemon of its own (a DELETE would delete the disk copies
//!   too), so each round fills again from disk. Baseline: a plain sequential read (`pread`) of the same payload
//!   bytes from the same files into one buffer. Both start from a cold page
//!   cache for those files (`POSIX_FADV_DONTNEED` before each round);
//!   rounds alternate, medians.
//! * **Page cache**: what the same reads and writes cost with `O_DIRECT`
//!   next to buffered I/O with `POSIX_FADV_DONTNEED` (the tier's choice), and
//!   how many bytes of the tier's files the page cache holds after the fills.
//! * **GET latency**: the round trip of a RAM-resident block, in windows
//!   alternating idle and while another client keeps the tier busy (fills
//!   and write-behind; an idle window starts once that client has paused
//!   and the write-behind queue is empty); medians over the windows. That daemon's megaslab
//!   holds half of the 64 KiB blocks, so the busy client's LOOKUPs, going
//!   round them in order, miss and fill (least recently used evicted).
//! * **Priority**: the plain baselines run on a thread as much nicer than
//!   the benchmark as the tier's threads are than the daemon
//!   (`--worker-nice`), so that under CPU load both sides of a ratio get the
//!   same share of it.
//! * **Chain walk** (`--only walk`, not run by default): chains of 20
//!   blocks (`--walk-bytes`, 600 MiB, of `--walk-block` 1 MiB blocks) on
//!   disk, written in the tier's format; a daemon with a megaslab of
//!   `--walk-slab` (256 MiB) indexes them and is `kill -9`ed; then, per round,
//!   a daemon started again on them with `--disk-read-ahead 0` and one with
//!   `--disk-read-ahead` `--walk-read-ahead` (8), each after the page cache is
//!   dropped (`/proc/sys/vm/drop_caches`, root; else each file's pages), GET
//!   the chains block after block, one GET waiting for the one before;
//!   baseline: a plain sequential read (`pread`) of the same files' payloads
//!   in the same order, page cache dropped too, on a thread at the tier
//!   threads' priority (as the fill's). Rounds alternate, medians.
//! * **Restart**: 100 000 block files on disk (written in the tier's format
//!   by the benchmark itself, `--restart-blocks`), a daemon started on them
//!   (it reads their headers and writes the catalog), `kill -9`ed once
//!   indexed, and started again, three times, each `kill -9`ed once indexed:
//!   with the catalog (the page cache as the crash left it), with the
//!   catalog and the page cache dropped, and without the catalog (every
//!   header read; page cache dropped): seconds to its first GET served from
//!   disk and to its whole index.

use crate::spawn::TempDir;
use clap::Args;
use kachedb_client::{Client, ConnectOptions, Key};
use kachedb_daemon::disk::cells::DiskStats;
use kachedb_daemon::disk::format::{self, Header};
use serde_json::json;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Options of `kachedb-bench disk`.
#[derive(Debug, Args)]
pub struct DiskArgs {
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A short run (fewer blocks and rounds).
    #[arg(long)]
    pub quick: bool,
    /// Where to put the disk tier's directory (a temporary directory there;
    /// default: the system temp dir). Use the file system you mean to use.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Blocks on disk for the restart measurement (0: skip it).
    #[arg(long, default_value_t = 100_000, value_name = "N")]
    pub restart_blocks: u64,
    /// `--disk-worker-nice` of the daemons (how much nicer than the serve
    /// loop the tier's threads run; the plain baselines run at the
    /// benchmark's own priority).
    #[arg(long, default_value_t = kachedb_daemon::disk::DEFAULT_WORKER_NICE, value_name = "N")]
    pub worker_nice: u8,
    /// `--disk-worker-class` of the daemons; the plain baselines and the
    /// floor load run in the same class.
    #[arg(long, value_enum, default_value_t = WorkerClass::Idle, value_name = "CLASS")]
    pub worker_class: WorkerClass,
    /// Run only some parts (comma-separated: write, fill, get, restart,
    /// walk; fill and get write their blocks first, unmeasured unless write
    /// is named; walk runs only when named).
    #[arg(long, value_delimiter = ',', value_name = "PARTS")]
    pub only: Vec<Part>,
    /// Chain walk: bytes of blocks on disk.
    #[arg(long, default_value = "600MiB", value_parser = kachedb_shm::units::parse_size, value_name = "SIZE")]
    pub walk_bytes: u64,
    /// Chain walk: bytes of each block.
    #[arg(long, default_value = "1MiB", value_parser = kachedb_shm::units::parse_size, value_name = "SIZE")]
    pub walk_block: u64,
    /// Chain walk: blocks per chain.
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub walk_chain: u64,
    /// Chain walk: the daemons' megaslab (`serve --size`).
    #[arg(long, default_value = "256MiB", value_parser = kachedb_shm::units::parse_size, value_name = "SIZE")]
    pub walk_slab: u64,
    /// Chain walk: `--disk-read-ahead` of the daemon that reads ahead.
    #[arg(long, default_value_t = kachedb_daemon::disk::DEFAULT_READ_AHEAD, value_name = "BLOCKS")]
    pub walk_read_ahead: usize,
    /// The executable whose `serve` the daemons run (default: this one's).
    /// With `--restart-dir`, two builds' restarts compare on the same files
    /// in one run.
    #[arg(long, value_name = "PATH")]
    pub daemon: Option<PathBuf>,
    /// The restart's directory: its `--restart-blocks` block files are
    /// written there if `DIR/blocks` has none, and kept afterwards (by
    /// default they are written in the run's temporary directory and go
    /// with it).
    #[arg(long, value_name = "DIR")]
    pub restart_dir: Option<PathBuf>,
}

/// The scheduling class of the tier's threads (`--worker-class`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkerClass {
    /// `SCHED_IDLE`.
    Idle,
    /// `SCHED_OTHER` at the nice value.
    Normal,
}

impl WorkerClass {
    /// Its value for `serve --disk-worker-class`.
    pub fn arg(self) -> &'static str {
        match self {
            WorkerClass::Idle => "idle",
            WorkerClass::Normal => "normal",
        }
    }
}

/// A part of `kachedb-bench disk` (`--only`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// Write-behind vs plain write.
    Write,
    /// Fill vs plain read, and the page cache after the fills.
    Fill,
    /// GET latency of a RAM block, idle vs during disk I/O.
    Get,
    /// Restart after `kill -9`.
    Restart,
    /// A chain walk after `kill -9`, read-ahead on and off, vs a plain read.
    Walk,
}

/// Gives the calling thread the tier threads' priority: its nice value
/// raised by `by` (capped at 19), in `class`.
fn lower_priority(by: u8, class: WorkerClass) {
    if by > 0 {
        let own = rustix::process::getpriority_process(None).unwrap_or(0);
        let _ = rustix::process::setpriority_process(None, (own + i32::from(by)).min(19));
    }
    if class == WorkerClass::Idle {
        let _ = kachedb_daemon::tier::threads::set_sched_idle();
    }
}

/// Runs `f` on a thread at the priority the tier's threads get
/// ([`lower_priority`]).
fn at_nice<T: Send>(by: u8, class: WorkerClass, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|sc| {
        sc.spawn(|| {
            lower_priority(by, class);
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// A `kachedb serve` child with the disk tier; SIGKILLed when dropped.
struct Serve {
    child: Child,
    socket: PathBuf,
}

impl Serve {
    fn start(dir: &Path, name: &str, size: u64, disk: &Path, a: &DiskArgs) -> Res<Serve> {
        Serve::start_with_queue(dir, name, size, size, disk, a, "warn", &[])
    }

    /// As [`start`](Self::start), with `--disk-queue-bytes` `queue`, logging
    /// what `log` lets through (`RUST_LOG`), and the flags `extra`.
    #[allow(clippy::too_many_arguments)] // a daemon's command line, flag by flag
    fn start_with_queue(
        dir: &Path,
        name: &str,
        size: u64,
        queue: u64,
        disk: &Path,
        a: &DiskArgs,
        log: &str,
        extra: &[String],
    ) -> Res<Serve> {
        let socket = dir.join(format!("{name}.sock"));
        let exe = match &a.daemon {
            Some(p) => p.clone(),
            None => std::env::current_exe()?,
        };
        let child = Command::new(exe)
            .args(["serve", "--size", &size.to_string(), "--socket"])
            .arg(&socket)
            .arg("--disk")
            .arg(disk)
            .args(["--disk-size", "64GiB", "--disk-queue-bytes", &queue.to_string()])
            .args(["--disk-worker-nice", &a.worker_nice.to_string()])
            .args(["--disk-worker-class", a.worker_class.arg()])
            .args(extra)
            .env("RUST_LOG", log)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?;
        let mut s = Serve { child, socket };
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&s.socket).is_err() {
            if let Some(st) = s.child.try_wait()? {
                return Err(format!("the daemon exited during start ({st})").into());
            }
            if t.elapsed() > Duration::from_secs(60) {
                return Err("the daemon did not start within 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(s)
    }

    fn opts(&self) -> ConnectOptions {
        ConnectOptions { socket: Some(self.socket.clone()), ..Default::default() }
    }

    fn client(&self) -> Res<Client> {
        Ok(Client::connect(&self.opts())?)
    }

    fn stats(&self) -> Res<kachedb_shm::Stats> {
        Ok(kachedb_client::daemon_stats(&self.opts())?)
    }

    /// Waits until `ok` holds for the stats.
    fn until(&self, what: &str, ok: impl Fn(&kachedb_shm::Stats) -> bool) -> Res<kachedb_shm::Stats> {
        let t = Instant::now();
        loop {
            let s = self.stats()?;
            if ok(&s) {
                return Ok(s);
            }
            if t.elapsed() > Duration::from_secs(600) {
                return Err(format!("timed out waiting for {what}").into());
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted.get(((sorted.len().max(1) - 1) as f64 * p).round() as usize).copied().unwrap_or(0)
}

/// Drops `path`'s pages from the page cache.
fn uncache(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
    }
}

/// Bytes of the files under `dir` the page cache holds (`mincore` over a mapping of each).
fn cached_bytes(dir: &Path) -> u64 {
    let files: Vec<PathBuf> =
        std::fs::read_dir(dir).map(|rd| rd.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    let mut out = Command::new("fincore");
    out.args(["--bytes", "--noheadings", "--raw", "--output", "RES"]).args(files);
    out.output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().filter_map(|l| l.trim().parse::<u64>().ok()).sum())
        .unwrap_or(0)
}

/// A 4 KiB-aligned buffer of `len` bytes (for `O_DIRECT`).
struct Aligned {
    v: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let v = vec![0x5au8; len + 4096];
        let at = v.as_ptr().align_offset(4096);
        Aligned { v, at, len }
    }
    fn get(&self) -> &[u8] {
        &self.v[self.at..self.at + self.len]
    }
    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.at..self.at + self.len]
    }
}

/// Writes `n` new files of `len` bytes under `dir`, each `fdatasync`ed
/// (buffered + DONTNEED, or `O_DIRECT`), then `fsync`s `dir`; seconds.
fn plain_write(dir: &Path, n: usize, len: usize, direct: bool) -> Res<f64> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let buf = Aligned::new(len.next_multiple_of(4096));
    let t = Instant::now();
    for i in 0..n {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(true);
        if direct {
            o.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
        }
        let f = o.open(dir.join(format!("{i}.plain")))?;
        f.write_all_at(buf.get(), 0)?;
        f.sync_data()?;
        if !direct {
            let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
        }
    }
    // The new files' names are durable too.
    std::fs::File::open(dir)?.sync_all()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Reads the payloads of `files` (`len` bytes after the header) into one
/// buffer, buffered or `O_DIRECT`; seconds.
fn plain_read(files: &[PathBuf], len: usize, direct: bool) -> Res<f64> {
    let mut buf = Aligned::new(len.next_multiple_of(4096));
    for f in files {
        uncache(f);
    }
    let t = Instant::now();
    for p in files {
        let mut o = std::fs::OpenOptions::new();
        o.read(true);
        if direct {
            o.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
        }
        let f = o.open(p)?;
        if direct {
            // Whole pages: the file's tail is short of one (read what is there).
            let mut at = 0;
            while at < len {
                let n = f.read_at(&mut buf.get_mut()[at..], format::HEADER_AREA + at as u64)?;
                if n == 0 {
                    break;
                }
                at += n;
            }
        } else {
            f.read_exact_at(&mut buf.get_mut()[..len], format::HEADER_AREA)?;
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Runs the benchmark.
pub fn run(a: &DiskArgs) -> Res<()> {
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let tmp = TempDir::new(&base.join("kachedb-bench-disk").display().to_string())?;
    let disk = tmp.0.join("disk");
    let emit = |v: serde_json::Value, human: String| {
        if a.json {
            println!("{v}");
        } else {
            println!("{human}");
        }
    };
    let rounds = if a.quick { 3 } else { 5 };
    // (label, block bytes, blocks, blocks per LOOKUP)
    let sizes: Vec<(&str, usize, usize, usize)> = if a.quick {
        vec![("64KiB", 64 << 10, 256, 64), ("2MiB", 2 << 20, 16, 16), ("64MiB", 64 << 20, 2, 1)]
    } else {
        vec![("64KiB", 64 << 10, 2048, 64), ("2MiB", 2 << 20, 64, 32), ("64MiB", 64 << 20, 6, 1)]
    };
    let total: usize = sizes.iter().map(|s| s.1 * s.2).sum();
    let slab = (total as u64 + (256 << 20)).next_multiple_of(1 << 20);
    if !a.json && a.only != [Part::Walk] {
        println!(
            "kachedb-bench disk — {} ({} of blocks, megaslab {} MiB, tier threads at nice +{}, class {}), {rounds} rounds, medians; load {}",
            disk.display(),
            kachedb_shm::units::human_bytes(total as u64),
            slab >> 20,
            a.worker_nice,
            a.worker_class.arg(),
            std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
        );
    }
    let part = |p: Part| (a.only.is_empty() && p != Part::Walk) || a.only.contains(&p);
    let mut keys: Vec<Vec<Key>> = Vec::new();
    if part(Part::Write) || part(Part::Fill) || part(Part::Get) {
        let a_node = Serve::start(&tmp.0, "a", slab, &disk, a)?;
        let c = a_node.client()?;
        let write_rounds = if part(Part::Write) { rounds } else { 1 };
        let plain_dir = disk.join("plain");
        let mut written = 0;
        for (si, &(label, len, n, _)) in sizes.iter().enumerate() {
            let data = vec![si as u8 + 1; len];
            let (mut tier, mut plain, mut direct) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..write_rounds {
                // A fresh set of keys each round; the first round's are filled below.
                let ks: Vec<Key> = (0..n as u64)
                    .map(|j| Key::from_parts(j, 0xd15c_0000 + si as u64 + ((round as u64) << 8)))
                    .collect();
                c.put(ks[0], &data)?;
                let t = Instant::now();
                for &k in &ks[1..] {
                    c.put(k, &data)?;
                }
                written += n as u64;
                a_node.until("the writes", |s| {
                    let d = DiskStats::of(s);
                    d.disk_writes >= written && d.disk_queue_blocks == 0
                })?;
                tier.push(t.elapsed().as_secs_f64());
                if part(Part::Write) {
                    let file_len = len + format::HEADER_AREA as usize;
                    plain.push(at_nice(a.worker_nice, a.worker_class, || {
                        plain_write(&plain_dir, n, file_len, false).map_err(|e| e.to_string())
                    })?);
                    direct.push(at_nice(a.worker_nice, a.worker_class, || {
                        plain_write(&plain_dir, n, file_len, true).map_err(|e| e.to_string())
                    })?);
                }
                if round == 0 {
                    keys.push(ks);
                }
            }
            if part(Part::Write) {
                let bytes = (len * n) as f64;
                let (t, p, d) = (median(tier), median(plain), median(direct));
                emit(
                    json!({"bench":"disk_write_behind","block":label,"blocks":n,"rounds":write_rounds,"tier_gb_s":bytes/t/1e9,
                           "plain_gb_s":bytes/p/1e9,"ratio":p/t,"plain_direct_gb_s":bytes/d/1e9}),
                    format!(
                        "write-behind {label:>6} x {n:<5} {:.2} GB/s vs plain write+fdatasync {:.2} GB/s ({:.0} %); O_DIRECT plain {:.2} GB/s",
                        bytes / t / 1e9,
                        bytes / p / 1e9,
                        100.0 * p / t,
                        bytes / d / 1e9
                    ),
                );
            }
        }
        let _ = std::fs::remove_dir_all(&plain_dir);
    }
    // Node B: the same directory, RAM empty (a daemon of its own each round).
    let fill_sizes = if part(Part::Fill) { &sizes[..] } else { &[] };
    for (si, &(label, len, n, per)) in fill_sizes.iter().enumerate() {
        let ks = &keys[si];
        let files: Vec<PathBuf> = ks.iter().map(|k| format::block_path(&disk.join("blocks"), k.0)).collect();
        let (mut fill, mut plain, mut direct) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let b = Serve::start(&tmp.0, "b", slab, &disk, a)?;
            b.until("the index", |s| DiskStats::of(s).disk_indexed)?;
            let c = b.client()?;
            for f in &files {
                uncache(f);
            }
            let t = Instant::now();
            for ch in ks.chunks(per) {
                let got = c.lookup(ch)?;
                if got != ch.len() {
                    return Err(format!("a fill found {got} of {} blocks", ch.len()).into());
                }
            }
            fill.push(t.elapsed().as_secs_f64());
            drop(c);
            drop(b);
            plain.push(at_nice(a.worker_nice, a.worker_class, || {
                plain_read(&files, len, false).map_err(|e| e.to_string())
            })?);
            direct.push(at_nice(a.worker_nice, a.worker_class, || {
                plain_read(&files, len, true).map_err(|e| e.to_string())
            })?);
        }
        let bytes = (len * n) as f64;
        let (f, p, d) = (median(fill), median(plain), median(direct));
        emit(
            json!({"bench":"disk_fill","block":label,"blocks":n,"fill_gb_s":bytes/f/1e9,"plain_read_gb_s":bytes/p/1e9,
                   "ratio":p/f,"plain_direct_gb_s":bytes/d/1e9}),
            format!(
                "fill         {label:>6} x {n:<5} {:.2} GB/s vs plain read {:.2} GB/s ({:.0} %); O_DIRECT plain {:.2} GB/s",
                bytes / f / 1e9,
                bytes / p / 1e9,
                100.0 * p / f,
                bytes / d / 1e9
            ),
        );
    }
    if part(Part::Fill) {
        let cached = cached_bytes(&disk.join("blocks"));
        emit(
            json!({"bench":"disk_page_cache","cached_bytes":cached,"block_bytes":total}),
            format!(
                "page cache   {} of the tier's {} of block files cached after the fills",
                kachedb_shm::units::human_bytes(cached),
                kachedb_shm::units::human_bytes(total as u64)
            ),
        );
    }
    if part(Part::Get) {
        get_during_io(a, &tmp.0, &disk, &sizes, &keys, &emit)?;
    }
    if a.restart_blocks > 0 && part(Part::Restart) {
        restart(a, &tmp.0, &emit)?;
    }
    if part(Part::Walk) {
        walk(a, &tmp.0, rounds, &emit)?;
    }
    Ok(())
}

/// Scheduler counters of one thread (`/proc/PID/task/TID/{schedstat,status}`).
#[derive(Clone, Copy, Debug, Default)]
struct Sched {
    /// Nanoseconds on a CPU.
    run_ns: u64,
    /// Nanoseconds runnable but waiting for a CPU.
    queued_ns: u64,
    /// Switches away while runnable (preempted, or a yield that gave the CPU away).
    involuntary: u64,
}

impl Sched {
    fn read(task: &Path) -> Sched {
        let ss = std::fs::read_to_string(task.join("schedstat")).unwrap_or_default();
        let mut f = ss.split_whitespace().map(|x| x.parse::<u64>().unwrap_or(0));
        let (run_ns, queued_ns) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
        let involuntary = std::fs::read_to_string(task.join("status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:").map(|v| v.trim().parse().unwrap_or(0)))
            .unwrap_or(0);
        Sched { run_ns, queued_ns, involuntary }
    }

    fn add(&mut self, o: Sched) {
        self.run_ns += o.run_ns;
        self.queued_ns += o.queued_ns;
        self.involuntary += o.involuntary;
    }

    fn since(self, before: Sched) -> Sched {
        Sched {
            run_ns: self.run_ns.saturating_sub(before.run_ns),
            queued_ns: self.queued_ns.saturating_sub(before.queued_ns),
            involuntary: self.involuntary.saturating_sub(before.involuntary),
        }
    }
}

/// The scheduler counters of the threads a GET's latency depends on: the
/// GET client (this thread), the daemon's serve loop (its main thread) and
/// the disk tier's threads (together).
#[derive(Clone, Copy, Debug, Default)]
struct Threads {
    client: Sched,
    serve: Sched,
    tier: Sched,
}

impl Threads {
    fn read(daemon: u32, client_tid: i32) -> Threads {
        let client = Sched::read(&PathBuf::from(format!("/proc/self/task/{client_tid}")));
        let serve = Sched::read(&PathBuf::from(format!("/proc/{daemon}/task/{daemon}")));
        let mut tier = Sched::default();
        if let Ok(rd) = std::fs::read_dir(format!("/proc/{daemon}/task")) {
            for e in rd.flatten() {
                let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
                if comm.trim() == kachedb_daemon::disk::THREAD_NAME {
                    tier.add(Sched::read(&e.path()));
                }
            }
        }
        Threads { client, serve, tier }
    }

    fn since(self, before: Threads) -> Threads {
        Threads {
            client: self.client.since(before.client),
            serve: self.serve.since(before.serve),
            tier: self.tier.since(before.tier),
        }
    }
}

/// What a kind of window measured: GET p50/p99 per window, and the
/// threads' scheduler counters summed over the windows.
#[derive(Default)]
struct Windows {
    lat: Vec<(u64, u64)>,
    threads: Vec<Threads>,
    wall_s: f64,
}

impl Windows {
    fn push(&mut self, v: &[u64], t: Threads, wall_s: f64) {
        self.lat.push((percentile(v, 0.5), percentile(v, 0.99)));
        self.threads.push(t);
        self.wall_s += wall_s;
    }

    /// Median p50 and p99 over the windows.
    fn medians(&self) -> (f64, f64) {
        let (p50, p99): (Vec<u64>, Vec<u64>) = self.lat.iter().copied().unzip();
        (median(p50.iter().map(|&x| x as f64).collect()), median(p99.iter().map(|&x| x as f64).collect()))
    }

    /// Per second of window: microseconds the GET client and the serve loop
    /// waited runnable for a CPU, their involuntary switches, and the tier
    /// threads' CPU milliseconds.
    fn per_s(&self) -> serde_json::Value {
        let mut sum = Threads::default();
        for t in &self.threads {
            sum.client.add(t.client);
            sum.serve.add(t.serve);
            sum.tier.add(t.tier);
        }
        let s = self.wall_s.max(1e-9);
        json!({
            "client_queued_us_per_s": sum.client.queued_ns as f64 / 1e3 / s,
            "client_involuntary_per_s": sum.client.involuntary as f64 / s,
            "serve_queued_us_per_s": sum.serve.queued_ns as f64 / 1e3 / s,
            "serve_involuntary_per_s": sum.serve.involuntary as f64 / s,
            "serve_cpu_ms_per_s": sum.serve.run_ns as f64 / 1e6 / s,
            "tier_cpu_ms_per_s": sum.tier.run_ns as f64 / 1e6 / s,
        })
    }
}

/// The floor load: the disk I/O and the copies of a busy window without
/// the tier. Each round reads `per` of `files`' payloads (a fill: open, read
/// into a buffer, hash, drop from the page cache), writes `writes_per` new
/// 64 KiB files (a write-behind: `fdatasync`, drop from the page cache,
/// rename into place, directory `fsync`) and copies as many 64 KiB blocks
/// as the busy client puts; rounds paced to `rounds_per_s` (as fast as it
/// can go if that is more than it does).
fn floor_load(
    files: &[PathBuf],
    per: usize,
    writes_per: usize,
    dir: &Path,
    rounds_per_s: &std::sync::atomic::AtomicU64,
    on: &AtomicBool,
    stop: &AtomicBool,
) -> Res<()> {
    let len = 64 << 10;
    let mut buf = vec![0u8; len];
    let src = vec![9u8; len];
    let mut dst = vec![0u8; len];
    let payload = vec![5u8; len + format::HEADER_AREA as usize];
    std::fs::create_dir_all(dir)?;
    let (mut at, mut w) = (0usize, 0u64);
    while !stop.load(Ordering::Relaxed) {
        if !on.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        let t = Instant::now();
        for _ in 0..per {
            let p = &files[at % files.len()];
            at += 1;
            let f = std::fs::File::open(p)?;
            f.read_exact_at(&mut buf, format::HEADER_AREA)?;
            std::hint::black_box(format::checksum(&buf));
            let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
        }
        for _ in 0..writes_per {
            w += 1;
            let tmp = dir.join(format!("{}.tmp", w % 64));
            let f = std::fs::File::create(&tmp)?;
            f.write_all_at(&payload, 0)?;
            f.sync_data()?;
            let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
            std::fs::rename(&tmp, dir.join(format!("{}.plain", w % 64)))?;
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
        }
        std::fs::File::open(dir)?.sync_all()?;
        let rate = f64::from_bits(rounds_per_s.load(Ordering::Relaxed));
        if rate > 0.0 {
            let due = Duration::from_secs_f64(1.0 / rate);
            if let Some(rest) = due.checked_sub(t.elapsed()) {
                std::thread::sleep(rest);
            }
        }
    }
    Ok(())
}

/// The GET latency measurement (see the module docs): windows of idle,
/// busy (the tier filling and writing for another client) and floor (the
/// same daemon idle but for the GETs, while a plain thread of this process
/// does the disk I/O and copies of a busy window at the tier's priority).
fn get_during_io(
    a: &DiskArgs,
    tmp: &Path,
    disk: &Path,
    sizes: &[(&str, usize, usize, usize)],
    keys: &[Vec<Key>],
    emit: &dyn Fn(serde_json::Value, String),
) -> Res<()> {
    // On a daemon whose megaslab holds half of the 64 KiB blocks.
    let small_bytes = (sizes[0].1 * sizes[0].2) as u64;
    let b_slab = (small_bytes / 2).max(4 << 20).next_multiple_of(1 << 20);
    let b = Serve::start_with_queue(tmp, "b", b_slab, b_slab / 8, disk, a, "warn", &[])?;
    b.until("the index", |s| DiskStats::of(s).disk_indexed)?;
    let c = b.client()?;
    let hot = Key::from_parts(1, 0x4_07);
    c.put(hot, &[7u8; 4096])?;
    let small = keys[0].clone();
    let busy = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    // Set by the busy client while it waits for `busy` (nothing of its in flight).
    let paused = Arc::new(AtomicBool::new(true));
    const LOOKUP_KEYS: usize = 64;
    const PUTS_PER_LOOKUP: usize = 4;
    let worker = {
        let (busy, stop, paused, opts) = (busy.clone(), stop.clone(), paused.clone(), b.opts());
        std::thread::spawn(move || -> Result<(), String> {
            let c = Client::connect(&opts).map_err(|e| e.to_string())?;
            let data = vec![9u8; 64 << 10];
            let mut j = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if !busy.load(Ordering::Relaxed) {
                    paused.store(true, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                paused.store(false, Ordering::Relaxed);
                for ch in small.chunks(LOOKUP_KEYS) {
                    // Evicted since the last round: filled from disk.
                    c.lookup(ch).map_err(|e| e.to_string())?;
                    for _ in 0..PUTS_PER_LOOKUP {
                        j += 1;
                        c.put(Key::from_parts(j, 0x3717e), &data).map_err(|e| e.to_string())?;
                    }
                    if !busy.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
            Ok(())
        })
    };
    // The floor load's thread, at the tier threads' priority; paced to the
    // fills per second the busy windows saw.
    let floor_on = Arc::new(AtomicBool::new(false));
    let floor_rate = Arc::new(std::sync::atomic::AtomicU64::new(0f64.to_bits()));
    let floor = {
        let (on, stop, rate) = (floor_on.clone(), stop.clone(), floor_rate.clone());
        let files: Vec<PathBuf> = keys[0].iter().map(|k| format::block_path(&disk.join("blocks"), k.0)).collect();
        let dir = tmp.join("floor");
        let (nice, class) = (a.worker_nice, a.worker_class);
        std::thread::spawn(move || -> Result<(), String> {
            lower_priority(nice, class);
            floor_load(&files, LOOKUP_KEYS, PUTS_PER_LOOKUP, &dir, &rate, &on, &stop).map_err(|e| e.to_string())
        })
    };
    let client_tid = rustix::thread::gettid().as_raw_nonzero().get();
    let daemon = b.child.id();
    // Many short windows, alternating, so that other load on the machine
    // falls on every kind alike.
    let (windows, iters) = if a.quick { (9, 5_000) } else { (15, 20_000) };
    let time_gets = |w: &mut Windows| -> Res<()> {
        let mut v = Vec::with_capacity(iters);
        let before = Threads::read(daemon, client_tid);
        let t0 = Instant::now();
        for _ in 0..iters {
            let t = Instant::now();
            drop(c.get(hot)?);
            v.push(t.elapsed().as_nanos() as u64);
        }
        let wall = t0.elapsed().as_secs_f64();
        let th = Threads::read(daemon, client_tid).since(before);
        v.sort_unstable();
        w.push(&v, th, wall);
        Ok(())
    };
    let (mut idle, mut during, mut floor_w) = (Windows::default(), Windows::default(), Windows::default());
    let s0 = DiskStats::of(&b.stats()?);
    let mut fills_seen = 0u64;
    for _ in 0..windows {
        // Idle: the busy client paused and the write-behind queue empty.
        busy.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1));
        while !paused.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(1));
        }
        b.until("the write-behind queue to drain", |s| DiskStats::of(s).disk_queue_blocks == 0)?;
        std::thread::sleep(Duration::from_millis(5));
        time_gets(&mut idle)?;
        // Busy.
        let f0 = DiskStats::of(&b.stats()?).disk_fills;
        busy.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        time_gets(&mut during)?;
        let f1 = DiskStats::of(&b.stats()?).disk_fills;
        fills_seen += f1 - f0;
        // Fills per second of busy time so far (with the 50 ms lead-ins).
        let rounds_per_s = (fills_seen as f64 / LOOKUP_KEYS as f64) / (during.wall_s + 0.05 * during.lat.len() as f64);
        // Floor: the busy client paused, the queue drained, the plain load on.
        busy.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1));
        while !paused.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(1));
        }
        b.until("the write-behind queue to drain", |s| DiskStats::of(s).disk_queue_blocks == 0)?;
        floor_rate.store(rounds_per_s.to_bits(), Ordering::Relaxed);
        floor_on.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        time_gets(&mut floor_w)?;
        floor_on.store(false, Ordering::Relaxed);
    }
    stop.store(true, Ordering::Relaxed);
    busy.store(false, Ordering::Relaxed);
    worker.join().map_err(|_| "the busy client panicked")??;
    floor.join().map_err(|_| "the floor load panicked")??;
    let s1 = DiskStats::of(&b.stats()?);
    let ((i50, i99), (b50, b99), (f50, f99)) = (idle.medians(), during.medians(), floor_w.medians());
    let (fills, writes) = (s1.disk_fills - s0.disk_fills, s1.disk_writes - s0.disk_writes);
    emit(
        json!({"bench":"disk_get_during_io","iters":iters,"windows":windows,"idle_p50_ns":i50,"idle_p99_ns":i99,
               "busy_p50_ns":b50,"busy_p99_ns":b99,"busy_vs_idle_p99":b99/i99.max(1.0),
               "floor_p50_ns":f50,"floor_p99_ns":f99,"floor_vs_idle_p99":f99/i99.max(1.0),
               "worker_nice":a.worker_nice,"worker_class":a.worker_class.arg(),"fills":fills,"writes":writes,
               "sched_idle":idle.per_s(),"sched_busy":during.per_s(),"sched_floor":floor_w.per_s()}),
        format!(
            "GET of a RAM block  p50 {i50:.0} / p99 {i99:.0} ns idle; p50 {b50:.0} / p99 {b99:.0} ns during {fills} fills and {writes} writes ({:.2}x p99); \
             floor (the same disk I/O and copies by a plain thread, no tier): p50 {f50:.0} / p99 {f99:.0} ns ({:.2}x p99)",
            b99 / i99.max(1.0),
            f99 / i99.max(1.0)
        ),
    );
    if !a.json {
        for (what, w) in [("idle", &idle), ("busy", &during), ("floor", &floor_w)] {
            let v = w.per_s();
            let g = |k: &str| v[k].as_f64().unwrap_or(0.0);
            println!(
                "  {what:<5} per second: GET client waited {:.0} µs for a CPU ({:.0} preemptions/yields away), serve loop {:.0} µs ({:.0}), serve loop CPU {:.0} ms, tier threads CPU {:.0} ms",
                g("client_queued_us_per_s"),
                g("client_involuntary_per_s"),
                g("serve_queued_us_per_s"),
                g("serve_involuntary_per_s"),
                g("serve_cpu_ms_per_s"),
                g("tier_cpu_ms_per_s")
            );
        }
    }
    drop(c);
    drop(b);
    Ok(())
}

/// Writes `n` block files of `len` bytes under `blocks_dir`, in the tier's
/// format (`format::Header`, then the payload): keys `Key::from_parts(j,
/// salt)`, `j` in `0..n`, in chains of 16 (each block's parent the one
/// before it, except at every 16th). What a daemon with `--disk` indexes at
/// its start as if it had written them.
pub fn write_block_files(blocks_dir: &Path, n: u64, salt: u64, len: usize) -> Res<()> {
    write_chains(blocks_dir, n, salt, len, 16, |_, _| {})
}

/// Writes `n` block files as [`write_block_files`] does, in chains of
/// `chain` blocks, block `j`'s payload made by `fill(j, payload)` (from
/// bytes of 3s).
fn write_chains(
    blocks_dir: &Path,
    n: u64,
    salt: u64,
    len: usize,
    chain: u64,
    mut fill: impl FnMut(u64, &mut [u8]),
) -> Res<()> {
    let mut payload = vec![3u8; len];
    for j in 0..n {
        fill(j, &mut payload);
        let key = Key::from_parts(j, salt);
        let h = Header {
            tenant: None,
            key: key.0,
            parent: (!j.is_multiple_of(chain)).then(|| Key::from_parts(j - 1, salt).0),
            dtype: kachedb_shm::DType::U8,
            shape: kachedb_shm::Shape::new(&[len as u64]).ok_or("shape")?,
            len: len as u64,
            written_ms: 0,
            checksum: format::checksum(&payload),
        };
        let mut b = h.encode();
        b.extend_from_slice(&payload);
        std::fs::write(format::block_path(blocks_dir, key.0), &b)?;
    }
    Ok(())
}

/// The restart measurement (see the module docs).
fn restart(a: &DiskArgs, tmp: &Path, emit: &dyn Fn(serde_json::Value, String)) -> Res<()> {
    let disk = a.restart_dir.clone().unwrap_or_else(|| tmp.join("restart"));
    let blocks_dir = disk.join("blocks");
    std::fs::create_dir_all(&blocks_dir)?;
    let n = a.restart_blocks;
    let t = Instant::now();
    if a.restart_dir.is_none() || std::fs::read_dir(&blocks_dir)?.next().is_none() {
        write_block_files(&blocks_dir, n, 0x5e57a47, 4096)?;
        rustix::fs::sync();
    }
    let made_s = t.elapsed().as_secs_f64();
    let first = Key::from_parts(n / 2, 0x5e57a47);
    // A first daemon indexes them (and writes the catalog), then dies.
    let d = Serve::start(tmp, "r1", 64 << 20, &disk, a)?;
    d.until("the index", |s| DiskStats::of(s).disk_indexed)?;
    drop(d);
    // A restart after kill -9: seconds to the first GET served from disk
    // and to the whole index, its stats.
    let restart_once = |name: &str| -> Res<(f64, f64, DiskStats)> {
        let t = Instant::now();
        // Its log line of the rebuild says where the time went.
        let d =
            Serve::start_with_queue(tmp, name, 64 << 20, 64 << 20, &disk, a, "warn,kachedb_daemon::disk=info", &[])?;
        let c = d.client()?;
        loop {
            if c.get(first)?.is_some() {
                break;
            }
            if t.elapsed() > Duration::from_secs(600) {
                return Err("the first GET was never served".into());
            }
        }
        let first_get_s = t.elapsed().as_secs_f64();
        let s = DiskStats::of(&d.until("the index", |s| DiskStats::of(s).disk_indexed)?);
        Ok((first_get_s, t.elapsed().as_secs_f64(), s))
    };
    let catalog = disk.join("tmp").join("catalog");
    // With the catalog: the page cache as a daemon's crash leaves it, then
    // dropped (as after a reboot); without it (every header read, as before
    // the catalog: the files of an older build), the page cache dropped.
    for (how, name) in [("catalog", "r2"), ("catalog, page cache dropped", "r3"), ("headers read", "r4")] {
        if name != "r2" {
            if name == "r4" {
                std::fs::remove_file(&catalog)?;
            }
            drop_page_cache(std::slice::from_ref(&catalog));
        }
        let (first_get_s, all_s, s) = restart_once(name)?;
        emit(
            json!({"bench":"disk_restart","how":how,"blocks":n,"recovered":s.disk_recovered,
                   "catalogued":s.disk_catalogued,"first_get_s":first_get_s,
                   "indexed_s":all_s,"index_rebuild_s":s.disk_index_s,"files_made_s":made_s}),
            format!(
                "restart after kill -9 with {n} blocks on disk ({how}): first GET served after {first_get_s:.3} s, all indexed after {all_s:.3} s (rebuild {:.3} s, {} recovered, {} from the catalog)",
                s.disk_index_s, s.disk_recovered, s.disk_catalogued
            ),
        );
    }
    Ok(())
}

/// Drops the page cache: all of it (`/proc/sys/vm/drop_caches`, as root),
/// else the pages of `files`.
fn drop_page_cache(files: &[PathBuf]) -> &'static str {
    rustix::fs::sync();
    if std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok() {
        return "drop_caches";
    }
    for f in files {
        uncache(f);
    }
    "fadvise"
}

/// The chain walk (see the module docs).
fn walk(a: &DiskArgs, tmp: &Path, rounds: usize, emit: &dyn Fn(serde_json::Value, String)) -> Res<()> {
    let disk = tmp.join("walk");
    let blocks_dir = disk.join("blocks");
    std::fs::create_dir_all(&blocks_dir)?;
    let len = a.walk_block as usize;
    let n = (a.walk_bytes / a.walk_block).max(1);
    let per = a.walk_chain.max(1);
    let salt = 0x3a1c_0000u64;
    let keys: Vec<Key> = (0..n).map(|j| Key::from_parts(j, salt)).collect();
    write_chains(&blocks_dir, n, salt, len, per, |j, payload| {
        for (i, w) in payload.chunks_mut(8).enumerate() {
            let v = j.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64;
            w.copy_from_slice(&v.to_le_bytes()[..w.len()]);
        }
    })?;
    let files: Vec<PathBuf> = keys.iter().map(|k| format::block_path(&blocks_dir, k.0)).collect();
    let flag = |ahead: usize| vec!["--disk-read-ahead".to_string(), ahead.to_string()];
    // A daemon indexes them and dies.
    {
        let d = Serve::start_with_queue(tmp, "w0", a.walk_slab, 64 << 20, &disk, a, "warn", &flag(0))?;
        d.until("the index", |s| DiskStats::of(s).disk_indexed)?;
    }
    let mut how = "";
    // The blocks that fit the megaslab: a walk reads those into free room,
    // the rest into a full one (each part timed on its own too).
    let split = ((a.walk_slab / a.walk_block) as usize).min(n as usize);
    // One walk by a daemon started again (read-ahead `ahead`): seconds in
    // all and for the first `split` blocks, and its disk stats.
    let tier_walk = |ahead: usize, how: &mut &'static str| -> Res<(f64, f64, DiskStats)> {
        let d = Serve::start_with_queue(tmp, "w", a.walk_slab, 64 << 20, &disk, a, "warn", &flag(ahead))?;
        d.until("the index", |s| DiskStats::of(s).disk_indexed)?;
        let c = d.client()?;
        *how = drop_page_cache(&files);
        let t = Instant::now();
        let mut first = 0.0;
        for (j, &k) in keys.iter().enumerate() {
            if j == split {
                first = t.elapsed().as_secs_f64();
            }
            let v = c.get(k)?.ok_or_else(|| format!("block {j} of the walk is missing"))?;
            if v.len() != len {
                return Err(format!("block {j}: {} bytes", v.len()).into());
            }
        }
        let s = t.elapsed().as_secs_f64();
        let st = DiskStats::of(&d.stats()?);
        Ok((s, if split == keys.len() { s } else { first }, st))
    };
    // Seconds in all and for the first `split` blocks, per round.
    let (mut plain, mut off, mut on) = (Vec::new(), Vec::new(), Vec::new());
    let mut last_on = DiskStats::default();
    for _ in 0..rounds {
        how = drop_page_cache(&files);
        // At the tier threads' priority, as the fill baselines.
        let (p1, p2) = at_nice(a.worker_nice, a.worker_class, || -> Result<(f64, f64), String> {
            let p1 = plain_read(&files[..split], len, false).map_err(|e| e.to_string())?;
            let p2 = if split < files.len() {
                plain_read(&files[split..], len, false).map_err(|e| e.to_string())?
            } else {
                0.0
            };
            Ok((p1, p2))
        })?;
        plain.push((p1 + p2, p1));
        let (s, first, _) = tier_walk(0, &mut how)?;
        off.push((s, first));
        let (s, first, st) = tier_walk(a.walk_read_ahead, &mut how)?;
        on.push((s, first));
        last_on = st;
    }
    let bytes = (n as usize * len) as f64;
    let (first_bytes, rest_bytes) = ((split * len) as f64, ((n as usize - split) * len) as f64);
    let all = |v: &[(f64, f64)]| median(v.iter().map(|x| x.0).collect());
    let first = |v: &[(f64, f64)]| median(v.iter().map(|x| x.1).collect());
    let rest = |v: &[(f64, f64)]| median(v.iter().map(|x| x.0 - x.1).collect());
    let per_round: Vec<String> =
        (0..rounds).map(|r| format!("{:.2}x/{:.2}x", plain[r].0 / on[r].0, plain[r].0 / off[r].0)).collect();
    let (p, f, o) = (all(&plain), all(&off), all(&on));
    emit(
        json!({"bench":"disk_chain_walk","blocks":n,"block_bytes":len,"chain":per,"slab_bytes":a.walk_slab,
               "rounds":rounds,"read_ahead":a.walk_read_ahead,"plain_gb_s":bytes/p/1e9,"off_gb_s":bytes/f/1e9,
               "on_gb_s":bytes/o/1e9,"ratio_on":p/o,"ratio_off":p/f,"cache_dropped_by":how,
               "read_ahead_blocks":last_on.disk_read_ahead,"read_ahead_cached":last_on.disk_read_ahead_cached,
               "split_blocks":split,"plain_first_gb_s":first_bytes/first(&plain)/1e9,"on_first_gb_s":first_bytes/first(&on)/1e9,
               "off_first_gb_s":first_bytes/first(&off)/1e9,"plain_rest_gb_s":rest_bytes/rest(&plain)/1e9,
               "on_rest_gb_s":rest_bytes/rest(&on)/1e9,"off_rest_gb_s":rest_bytes/rest(&off)/1e9,
               "ratios_on_off_by_round":per_round,
               "load":std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()}),
        format!(
            "chain walk   {} of {per}-block chains of {}, megaslab {}, GET after GET after kill -9 ({how}): \
             read-ahead {} {:.2} GB/s ({:.2}x), off {:.2} GB/s ({:.2}x), plain read {:.2} GB/s; \
             read ahead {} blocks into the megaslab, {} into the page cache (last round); \
             the first {split} blocks (free room) {:.2}x / {:.2}x, the rest (megaslab full) {:.2}x / {:.2}x (on / off vs plain); \
             by round (on/off): {}",
            kachedb_shm::units::human_bytes(bytes as u64),
            kachedb_shm::units::human_bytes(len as u64),
            kachedb_shm::units::human_bytes(a.walk_slab),
            a.walk_read_ahead,
            bytes / o / 1e9,
            p / o,
            bytes / f / 1e9,
            p / f,
            bytes / p / 1e9,
            last_on.disk_read_ahead,
            last_on.disk_read_ahead_cached,
            first(&plain) / first(&on),
            first(&plain) / first(&off),
            rest(&plain) / rest(&on),
            rest(&plain) / rest(&off),
            per_round.join(" ")
        ),
    );
    let _ = std::fs::remove_dir_all(&disk);
    Ok(())
}
