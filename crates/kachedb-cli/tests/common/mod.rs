//! Helpers shared by the fault-injection suite (`tests/fault.rs`): seeded
//! patterns, temp dirs, the daemon guard, child processes (this test binary
//! re-run with `KDB_CHILD_ROLE`), `kachedb stats --json`.
//!
//! Copied from `tests/daemon.rs` (owned by another suite) and extended; kept
//! separate so the two suites can evolve independently.
#![allow(dead_code)]

use kachedb_client::{BlockView, ClientError, ConnectOptions, Key};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub mod disk;
pub mod need;

pub const BIN: &str = env!("CARGO_BIN_EXE_kachedb");

/// The `kachedb` the daemons of these suites run: this build's, or the one
/// `KDB_DAEMON_BIN` names (to run a suite against another build, such as
/// the commit before a fix: the test must fail there).
pub fn daemon_bin() -> String {
    std::env::var("KDB_DAEMON_BIN").unwrap_or_else(|_| BIN.to_string())
}
pub const ROLE_VAR: &str = "KDB_CHILD_ROLE";
pub const SOCKET_VAR: &str = "KDB_CHILD_SOCKET";
pub const MIB: usize = 1 << 20;

// Content: seeded patterns and checksums
// ---------------------------------------------------------------------------

/// Word `i` of the pattern of `seed` (splitmix64 of seed + i).
#[inline]
pub fn word(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `buf` with the pattern of `seed` (little-endian words, the tail cut from the next word).
pub fn fill(buf: &mut [u8], seed: u64) {
    let n = (buf.len() / 8) as u64;
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&word(seed, i as u64).to_le_bytes());
    }
    let rem = chunks.into_remainder();
    let last = word(seed, n).to_le_bytes();
    rem.copy_from_slice(&last[..rem.len()]);
}

/// The first byte of `data` that differs from the pattern of `seed`.
pub fn first_mismatch(data: &[u8], seed: u64) -> Option<usize> {
    let n = (data.len() / 8) as u64;
    let chunks = data.chunks_exact(8);
    let rem = chunks.remainder();
    for (i, c) in chunks.enumerate() {
        let want = word(seed, i as u64).to_le_bytes();
        if c != want {
            return Some(i * 8 + c.iter().zip(want).position(|(a, b)| *a != b).unwrap_or(0));
        }
    }
    let last = word(seed, n).to_le_bytes();
    rem.iter().zip(last).position(|(a, b)| *a != b).map(|p| n as usize * 8 + p)
}

/// A position-sensitive 64-bit checksum (4 independent multiply-rotate lanes
/// over 32-byte blocks, then the length and the tail bytes).
pub fn checksum(data: &[u8]) -> u64 {
    const P: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut lanes = [0x243F_6A88_85A3_08D3u64, 0x1319_8A2E_0370_7344, 0xA409_3822_299F_31D0, 0x082E_FA98_EC4E_6C89];
    let mut blocks = data.chunks_exact(32);
    for b in &mut blocks {
        for (j, lane) in lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(b[j * 8..j * 8 + 8].try_into().expect("8 bytes"));
            *lane = (*lane ^ w).wrapping_mul(P).rotate_left(29);
        }
    }
    let mut h = data.len() as u64;
    for l in lanes {
        h = (h ^ l).wrapping_mul(P).rotate_left(31);
    }
    for &b in blocks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(P).rotate_left(7);
    }
    h ^ (h >> 33)
}

pub fn seed_of(key: Key) -> u64 {
    key.lo() ^ key.hi().rotate_left(17)
}

/// Panics unless `view` holds exactly the pattern of `key`'s seed, `len` bytes.
pub fn assert_pattern(view: &BlockView, key: Key, len: usize, what: &str) {
    assert_eq!(view.len(), len, "{what}: length");
    if let Some(i) = first_mismatch(view, seed_of(key)) {
        panic!("{what}: byte {i} of {len} differs from the pattern (block at offset {})", view.offset());
    }
}

/// A small, fast PRNG (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------------------
// Processes: temp dirs, the daemon guard, child processes, stats
// ---------------------------------------------------------------------------

/// A private directory, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        use std::os::unix::fs::DirBuilderExt;
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "kdbt-{}-{name}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&p).expect("create temp dir");
        TempDir(p)
    }
    pub fn socket(&self) -> PathBuf {
        self.0.join("s.sock")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Collects a child's output: every line into `sink`, and into `lines` if given.
pub fn drain(r: impl Read + Send + 'static, sink: Arc<Mutex<String>>, lines: Option<Sender<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if let Ok(mut s) = sink.lock() {
                s.push_str(&line);
                s.push('\n');
            }
            if let Some(tx) = &lines {
                let _ = tx.send(line);
            }
        }
    })
}

pub fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("non-zero pid");
    rustix::process::kill_process(pid, sig).expect("kill");
}

pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return Some(s);
        }
        if start.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A `kachedb serve` process; SIGKILLed and reaped when dropped (also on panic).
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub log: Arc<Mutex<String>>,
    pub readers: Vec<JoinHandle<()>>,
}

impl Daemon {
    /// Starts a daemon on `socket` and waits until the socket accepts.
    pub fn start(socket: &Path, size: &str) -> Daemon {
        let mut d = Daemon::spawn(socket, size);
        d.wait_ready();
        d
    }

    /// Spawns a daemon without waiting.
    pub fn spawn(socket: &Path, size: &str) -> Daemon {
        Daemon::spawn_with(socket, size, &[])
    }

    /// Spawns a daemon with extra `serve` arguments, without waiting.
    pub fn spawn_with(socket: &Path, size: &str, extra: &[&str]) -> Daemon {
        Daemon::launch(Daemon::command(socket, size, extra), socket)
    }

    /// The `kachedb serve` command line [`spawn_with`](Self::spawn_with) runs
    /// (to add a `pre_exec` before [`launch`](Self::launch)).
    pub fn command(socket: &Path, size: &str, extra: &[&str]) -> Command {
        let mut cmd = Command::new(daemon_bin());
        cmd.args(["serve", "--size", size, "--socket"])
            .arg(socket)
            .args(extra)
            .env("RUST_LOG", "info")
            // Every stats answer runs the store's full invariant check (`invariants_ok`).
            .env("KACHEDB_CHECK_INVARIANTS", "1")
            .env_remove("KACHEDB_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Spawns `cmd` (from [`command`](Self::command)) without waiting.
    pub fn launch(mut cmd: Command, socket: &Path) -> Daemon {
        let mut child = cmd.spawn().expect("spawn kachedb serve");
        let log = Arc::new(Mutex::new(String::new()));
        let readers = vec![
            drain(child.stdout.take().expect("stdout"), log.clone(), None),
            drain(child.stderr.take().expect("stderr"), log.clone(), None),
        ];
        Daemon { child, socket: socket.to_path_buf(), log, readers }
    }

    pub fn wait_ready(&mut self) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                self.wait_exit(Duration::from_secs(5));
                panic!("the daemon exited during start ({s}):\n{}", self.log());
            }
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the daemon did not accept connections within 60 s:\n{}", self.log());
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn signal(&self, sig: rustix::process::Signal) {
        signal(self.pid(), sig);
    }

    /// Waits for the daemon to exit; then its whole output is in `log()`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let status = wait_timeout(&mut self.child, limit)?;
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        Some(status)
    }

    pub fn opts(&self) -> ConnectOptions {
        opts(&self.socket)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn opts(socket: &Path) -> ConnectOptions {
    ConnectOptions { socket: Some(socket.to_path_buf()), ..Default::default() }
}

/// `kachedb stats --json --socket <socket>`, parsed.
pub fn stats(socket: &Path) -> Value {
    let out = Command::new(BIN)
        .args(["stats", "--json", "--socket"])
        .arg(socket)
        .env_remove("KACHEDB_SOCKET")
        .output()
        .expect("run kachedb stats");
    assert!(out.status.success(), "kachedb stats failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("kachedb stats --json printed no JSON ({e}): {}", String::from_utf8_lossy(&out.stdout))
    })
}

pub fn num(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or_else(|| panic!("stats have no integer {k:?}: {v}"))
}

pub fn invariants_ok(v: &Value) -> bool {
    v.get("invariants_ok") == Some(&Value::Bool(true))
}

/// Polls `kachedb stats` until `pred` holds; returns the stats and how long it took.
pub fn poll_stats(socket: &Path, limit: Duration, what: &str, pred: impl Fn(&Value) -> bool) -> (Value, Duration) {
    let start = Instant::now();
    loop {
        let v = stats(socket);
        if pred(&v) {
            return (v, start.elapsed());
        }
        if start.elapsed() > limit {
            panic!("{what}: not reached within {limit:?}; last stats: {v}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client process (this test binary in a child role).
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub lines: Receiver<String>,
    pub out: Arc<Mutex<String>>,
    pub err: Arc<Mutex<String>>,
    pub readers: Vec<JoinHandle<()>>,
}

pub fn spawn_child(role: &str, socket: &Path, env: &[(&str, String)]) -> Proc {
    spawn_child_with(role, socket, env, |_| {})
}

/// As [`spawn_child`], with `customize` applied to the command before it is
/// spawned (e.g. a `pre_exec` that drops privileges).
pub fn spawn_child_with(
    role: &str,
    socket: &Path,
    env: &[(&str, String)],
    customize: impl FnOnce(&mut Command),
) -> Proc {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child_process", "--nocapture", "--test-threads=1"])
        .env(ROLE_VAR, role)
        .env(SOCKET_VAR, socket)
        .env_remove("KACHEDB_SOCKET")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    customize(&mut cmd);
    let mut child = cmd.spawn().expect("spawn a child process");
    let (tx, rx) = mpsc::channel();
    let out = Arc::new(Mutex::new(String::new()));
    let err = Arc::new(Mutex::new(String::new()));
    let readers = vec![
        drain(child.stdout.take().expect("stdout"), out.clone(), Some(tx)),
        drain(child.stderr.take().expect("stderr"), err.clone(), None),
    ];
    let stdin = child.stdin.take();
    Proc { name: format!("{role} (pid {})", child.id()), child, stdin, lines: rx, out, err, readers }
}

impl Proc {
    pub fn dump(&self) -> String {
        format!(
            "--- stdout of {} ---\n{}--- stderr ---\n{}",
            self.name,
            self.out.lock().map(|s| s.clone()).unwrap_or_default(),
            self.err.lock().map(|s| s.clone()).unwrap_or_default()
        )
    }

    /// Waits for a line `KDB <tag> <rest>` and returns `rest`.
    pub fn expect(&mut self, tag: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(msg) = line.find("KDB ").map(|p| &line[p + 4..]) {
                        if let Some(rest) = msg.strip_prefix(tag) {
                            if rest.is_empty() || rest.starts_with(' ') {
                                return rest.trim().to_string();
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("{}: no `KDB {tag}` within {limit:?}\n{}", self.name, self.dump())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = wait_timeout(&mut self.child, Duration::from_secs(5));
                    for r in self.readers.drain(..) {
                        let _ = r.join();
                    }
                    panic!("{} ended ({status:?}) before `KDB {tag}`\n{}", self.name, self.dump())
                }
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .unwrap_or_else(|e| panic!("{}: write stdin: {e}\n{}", self.name, self.dump()));
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a successful exit; returns the whole stdout.
    pub fn finish(mut self, limit: Duration) -> String {
        self.stdin.take();
        let status = wait_timeout(&mut self.child, limit);
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        match status {
            Some(s) if s.success() => self.out.lock().map(|s| s.clone()).unwrap_or_default(),
            Some(s) => panic!("{} failed ({s})\n{}", self.name, self.dump()),
            None => panic!("{} did not exit within {limit:?}\n{}", self.name, self.dump()),
        }
    }

    /// SIGKILL, then reap.
    pub fn kill9(mut self) -> ExitStatus {
        signal(self.pid(), rustix::process::Signal::KILL);
        let s = wait_timeout(&mut self.child, Duration::from_secs(10)).expect("a SIGKILLed child exits");
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        s
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// All `KDB <tag> …` payloads in `out`, in order.
pub fn tagged<'a>(out: &'a str, tag: &str) -> Vec<&'a str> {
    out.lines()
        .filter_map(|l| l.find("KDB ").map(|p| &l[p + 4..]))
        .filter_map(|m| m.strip_prefix(tag))
        .filter(|r| r.is_empty() || r.starts_with(' '))
        .map(str::trim)
        .collect()
}

// ---------------------------------------------------------------------------
// The child side
// ---------------------------------------------------------------------------

/// One line to the test, on stdout.
pub fn say(tag: &str, msg: impl std::fmt::Display) {
    let mut o = std::io::stdout().lock();
    // The leading newline keeps the line clear of the test harness's own output.
    let _ = writeln!(o, "\nKDB {tag} {msg}");
    let _ = o.flush();
}

/// Blocks until the test writes `want` on stdin.
pub fn await_order(want: &str) {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("read stdin");
    assert_eq!(line.trim(), want, "unexpected order on stdin");
}

pub fn env_u64(name: &str) -> u64 {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set")).parse().expect("a number")
}

/// The daemon's stats through the client library (the code path of `kachedb
/// stats`, without spawning the CLI): for polls in tight loops.
pub fn stats_fast(socket: &Path) -> Value {
    let s =
        kachedb_client::daemon_stats(&opts(socket)).unwrap_or_else(|e| panic!("stats of {}: {e}", socket.display()));
    serde_json::to_value(s).expect("stats as JSON")
}

/// Polls [`stats_fast`] until `pred` holds; returns the stats and how long it took.
pub fn poll_stats_fast(socket: &Path, limit: Duration, what: &str, pred: impl Fn(&Value) -> bool) -> (Value, Duration) {
    let start = Instant::now();
    loop {
        let v = stats_fast(socket);
        if pred(&v) {
            return (v, start.elapsed());
        }
        if start.elapsed() > limit {
            panic!("{what}: not reached within {limit:?}; last stats: {v}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: comparable across processes (unlike `Instant`).
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Whether a `ClientError` is `Disconnected`.
pub fn is_disconnected(e: &ClientError) -> bool {
    matches!(e, ClientError::Disconnected(_))
}

/// `<socket>.lock`.
pub fn lock_path(socket: &Path) -> PathBuf {
    PathBuf::from(format!("{}.lock", socket.display()))
}

/// A key of test `tag`: `j` in the low half, `tag` in the high half.
pub fn tkey(tag: u64, j: u64) -> Key {
    Key::from_parts(j, tag)
}
