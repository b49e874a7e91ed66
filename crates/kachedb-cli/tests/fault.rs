//! Fault injection and hostile peers (`RELIABILITY.md` states the promises and
//! quotes the figures these tests print).
//!
//! * client kill loop: ≥ 1000 client processes SIGKILLed mid-reserve, mid-write,
//!   mid-commit, holding pins, inside `put_many`/`get_many` batches, at random
//!   moments; readers verify every block they get;
//! * daemon kill loop: the daemon SIGKILLed under load ≥ 50 times; every client
//!   call returns `Disconnected` within 1 s; restarts are clean; nothing is
//!   left in `/dev/shm` or mapped anywhere;
//! * a hostile client scribbling on its rings, the doorbell and with forged
//!   handles while good clients work;
//! * security: seals, other uids, socket and directory modes, forged handles;
//! * resource limits: memory, cgroup, a full store;
//! * a proptest of the frame handler lives in `crates/kachedb-daemon/tests/`.
//!
//! Sizes: the CI setting keeps this file within a few minutes on a 2-core
//! machine; `KACHEDB_SOAK=1` selects the soak setting. Single knobs can be
//! overridden (`KDB_CLIENT_KILLS`, `KDB_DAEMON_KILLS`, `KDB_HOSTILE_SECS`).
//! Every test prints one `figures: {json}` line (and appends it to
//! `$KDB_FIGURES_FILE` if set).
//!
//! Child processes are this test binary run again with `KDB_CHILD_ROLE` (see
//! `common::spawn_child`).

mod common;

use common::*;
use kachedb_client::{BlockView, Client, ClientError, DType, Key, Shape};
use kachedb_shm::{Op, Region, Status, TensorBlockDescriptor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::io::{BufRead, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// Settings and figures
// ---------------------------------------------------------------------------

fn soak() -> bool {
    std::env::var("KACHEDB_SOAK").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// `name` from the environment, else the CI or the soak value.
fn knob(name: &str, ci: u64, soak_value: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(if soak() { soak_value } else { ci })
}

/// Prints `figures: {...}` and appends the line to `$KDB_FIGURES_FILE`.
fn figures(test: &str, mut v: Value) {
    if let Some(m) = v.as_object_mut() {
        m.insert("test".into(), test.into());
        m.insert("soak".into(), soak().into());
    }
    let line = v.to_string();
    eprintln!("figures: {line}");
    if let Ok(path) = std::env::var("KDB_FIGURES_FILE") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(f, "{line}");
        }
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e5).round() / 100.0
}

fn env_str(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// An instance number no other daemon on this machine uses (names the memfd
/// `kachedb_<instance>`, so a scan of `/proc` finds only ours).
fn unique_instance() -> u32 {
    static N: AtomicU32 = AtomicU32::new(0);
    0x4000_0000 | ((std::process::id() & 0x3_FFFF) << 8) | (N.fetch_add(1, Ordering::Relaxed) & 0xFF)
}

// ---------------------------------------------------------------------------
// Self-describing blocks: [magic, key_lo, version, len] + a pattern seeded by
// all three. Any process can tell a whole block from a torn or foreign one and
// learn which version it holds.
// ---------------------------------------------------------------------------

const HDR: usize = 32;
const BLK_MAGIC: u64 = 0x4B44_425F_4641_554C;

fn body_seed(key: Key, version: u64, len: u64) -> u64 {
    seed_of(key) ^ version.rotate_left(23) ^ len.wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

fn write_header(buf: &mut [u8], key: Key, version: u64) {
    let len = buf.len() as u64;
    for (i, w) in [BLK_MAGIC, key.lo(), version, len].into_iter().enumerate() {
        buf[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
}

/// Writes the whole block (`buf.len() >= HDR`).
fn write_block(buf: &mut [u8], key: Key, version: u64) {
    write_header(buf, key, version);
    let seed = body_seed(key, version, buf.len() as u64);
    fill(&mut buf[HDR..], seed);
}

fn block_vec(key: Key, version: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    write_block(&mut v, key, version);
    v
}

/// The version a whole block of `key` holds, or what is wrong with it.
fn check_block(data: &[u8], key: Key) -> Result<u64, String> {
    if data.len() < HDR {
        return Err(format!("{} bytes, shorter than the header", data.len()));
    }
    let w = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    if w(0) != BLK_MAGIC {
        return Err(format!("bad magic {:#x}", w(0)));
    }
    if w(1) != key.lo() {
        return Err(format!("block of key {} found under key {}", w(1), key.lo()));
    }
    if w(3) != data.len() as u64 {
        return Err(format!("header says {} bytes, the view has {}", w(3), data.len()));
    }
    let version = w(2);
    if let Some(i) = first_mismatch(&data[HDR..], body_seed(key, version, data.len() as u64)) {
        return Err(format!("byte {} of {} differs from version {version:#x}", HDR + i, data.len()));
    }
    Ok(version)
}

fn verify(view: &BlockView, key: Key, what: &str) -> u64 {
    check_block(view, key)
        .unwrap_or_else(|e| panic!("{what}: key {}: {e} (block at offset {})", key.lo(), view.offset()))
}

/// A byte length: mostly small, some page-sized, some up to 256 KiB.
fn block_len(rng: &mut Rng) -> usize {
    match rng.below(10) {
        0 => HDR,
        1 => 4096,
        2 => 4097,
        3..=6 => HDR + rng.below(16 * 1024) as usize,
        7 | 8 => HDR + rng.below(64 * 1024) as usize,
        _ => 64 * 1024 + rng.below(192 * 1024) as usize,
    }
}

/// A dtype and shape of exactly `len` bytes.
fn layout_of(len: usize, rng: &mut Rng) -> (DType, Shape) {
    let len = len as u64;
    match rng.below(3) {
        0 if len.is_multiple_of(4) => (DType::F32, Shape::new(&[len / 4]).expect("shape")),
        1 if len.is_multiple_of(4) => (DType::BF16, Shape::new(&[2, len / 4]).expect("shape")),
        _ => (DType::U8, Shape::for_bytes(len).expect("shape")),
    }
}

/// Writes one block of `key` with a fresh version, by `put` or by reserve +
/// in-place write + commit; `announce` runs just before the commit is sent.
/// `Ok(None)`: the store was full (OUT_OF_MEMORY).
fn write_one(
    kc: &Client,
    key: Key,
    len: usize,
    rng: &mut Rng,
    announce: &mut dyn FnMut(Key, u64),
) -> Result<Option<u64>, ClientError> {
    let version = rng.next() | 1;
    let r = if rng.below(2) == 0 {
        let data = block_vec(key, version, len);
        announce(key, version);
        kc.put(key, &data)
    } else {
        let (dtype, shape) = layout_of(len, rng);
        match kc.reserve(key, dtype, &shape, 64 * rng.below(64)) {
            Ok(mut r) => {
                write_block(r.as_mut_slice(), key, version);
                announce(key, version);
                r.commit()
            }
            Err(e) => Err(e),
        }
    };
    match r {
        Ok(()) => Ok(Some(version)),
        Err(ClientError::OutOfMemory) => Ok(None),
        Err(e) => Err(e),
    }
}

// ---------------------------------------------------------------------------
// A verified workload for clients that own their keys (daemon kill loop, good
// clients next to a hostile one): every result is checked against a model.
// ---------------------------------------------------------------------------

struct Owned {
    tag: u64,
    /// Latest committed version of each key (None: absent or never written).
    present: Vec<Option<u64>>,
    held: VecDeque<(Key, u64, BlockView)>,
    ops: u64,
}

impl Owned {
    fn new(tag: u64, keys: u64) -> Owned {
        Owned { tag, present: vec![None; keys as usize], held: VecDeque::new(), ops: 0 }
    }

    fn key(&self, j: usize) -> Key {
        tkey(self.tag, j as u64)
    }

    /// What a view of `j` may hold: the latest version (the store may also
    /// have evicted it, which `get` reports as absent).
    fn check(&self, j: usize, v: &BlockView, what: &str) -> u64 {
        let got = verify(v, self.key(j), what);
        assert_eq!(
            Some(got),
            self.present[j],
            "{what}: key {j} holds version {got:#x}, the last committed is {:?}",
            self.present[j]
        );
        got
    }

    /// One random op; `Err` only for an error the caller should see
    /// (`Disconnected` and the like); everything else is asserted here.
    fn step(&mut self, kc: &Client, rng: &mut Rng) -> Result<(), ClientError> {
        let n = self.present.len();
        let j = rng.below(n as u64) as usize;
        let key = self.key(j);
        self.ops += 1;
        match rng.below(20) {
            0..=4 => {
                let len = block_len(rng);
                if let Some(v) = write_one(kc, key, len, rng, &mut |_, _| {})? {
                    self.present[j] = Some(v);
                }
            }
            5..=9 => match kc.get(key)? {
                Some(v) => {
                    let ver = self.check(j, &v, "get");
                    if rng.below(3) == 0 {
                        self.held.push_back((key, ver, v));
                    }
                }
                None => self.present[j] = None, // evicted (or never written)
            },
            10 | 11 => {
                let js: Vec<usize> = (0..1 + rng.below(12)).map(|_| rng.below(n as u64) as usize).collect();
                let keys: Vec<Key> = js.iter().map(|&j| self.key(j)).collect();
                let views = kc.get_many(&keys)?;
                for (&j, v) in js.iter().zip(views) {
                    match v {
                        Some(v) => {
                            self.check(j, &v, "get_many");
                        }
                        None => self.present[j] = None,
                    }
                }
            }
            12 => {
                let mut js: Vec<usize> = (0..1 + rng.below(8)).map(|_| rng.below(n as u64) as usize).collect();
                js.sort_unstable();
                js.dedup();
                let versions: Vec<u64> = js.iter().map(|_| rng.next() | 1).collect();
                let bufs: Vec<Vec<u8>> = js
                    .iter()
                    .zip(&versions)
                    .map(|(&j, &ver)| block_vec(self.key(j), ver, HDR + rng.below(8192) as usize))
                    .collect();
                let items: Vec<(Key, &[u8])> =
                    js.iter().zip(&bufs).map(|(&j, b)| (self.key(j), b.as_slice())).collect();
                match kc.put_many(&items) {
                    Ok(()) => {
                        for (&j, &ver) in js.iter().zip(&versions) {
                            self.present[j] = Some(ver);
                        }
                    }
                    Err(ClientError::OutOfMemory) => {}
                    Err(e) => return Err(e),
                }
            }
            13 => {
                let want = usize::from(self.present[j].is_some());
                let got = kc.lookup(&[key])?;
                assert!(got <= want, "lookup of key {j} found a block the model does not have");
                if got == 0 {
                    self.present[j] = None;
                }
            }
            14 => {
                let was = kc.delete(key)?;
                assert!(!was || self.present[j].is_some(), "delete of key {j} found a block the model does not have");
                self.present[j] = None;
            }
            15 => {
                // Reserve, scribble, abort: leaves no trace.
                match kc.reserve(key, DType::U8, &Shape::for_bytes(4096).expect("shape"), 0) {
                    Ok(mut r) => {
                        r.as_mut_slice().fill(0xEE);
                        r.abort()?;
                    }
                    Err(ClientError::OutOfMemory) => {}
                    Err(e) => return Err(e),
                }
            }
            _ => {
                // Re-check held views: their bytes never change while pinned.
                while self.held.len() > 4 {
                    let (k, ver, v) = self.held.pop_front().expect("non-empty");
                    assert_eq!(verify(&v, k, "held view"), ver, "a pinned block changed");
                }
            }
        }
        if self.held.len() > 12 {
            let (k, ver, v) = self.held.pop_front().expect("non-empty");
            assert_eq!(verify(&v, k, "held view"), ver, "a pinned block changed");
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Shared-memory access for the hostile and raw-frame roles
// ---------------------------------------------------------------------------

/// The atomic `u64` at byte `off` of the region.
fn shm_u64(region: &Region, off: u64) -> &AtomicU64 {
    assert!(off.is_multiple_of(8) && off + 8 <= region.layout().region_len);
    // SAFETY: `off` is 8-byte aligned and inside the mapping (asserted), which
    // `region` keeps mapped for the borrow; the word is plain memory shared with
    // the daemon, which accesses ring cursors atomically and validates them.
    unsafe { AtomicU64::from_ptr(region.base().add(off as usize).cast::<u64>()) }
}

/// The atomic `u32` at byte `off` of the region.
fn shm_u32(region: &Region, off: u64) -> &AtomicU32 {
    assert!(off.is_multiple_of(4) && off + 4 <= region.layout().region_len);
    // SAFETY: as in `shm_u64`, for a 4-byte aligned word.
    unsafe { AtomicU32::from_ptr(region.base().add(off as usize).cast::<u32>()) }
}

/// Writes a 64-byte frame into slot `cursor` of the ring at `ring_off`.
fn write_slot(region: &Region, ring_off: u64, cursor: u64, f: &TensorBlockDescriptor) {
    let cap = u64::from(region.layout().ring_capacity);
    let off = ring_off + 192 + (cursor & (cap - 1)) * 64;
    assert!(off + 64 <= region.layout().region_len);
    // SAFETY: the slot is 64-byte aligned and inside the mapping (ring slots
    // follow the 192-byte header of a ring of the trusted layout); the daemon
    // copies slots out with volatile reads and validates every frame.
    unsafe { std::ptr::write_volatile(region.base().add(off as usize).cast::<TensorBlockDescriptor>(), *f) };
}

// Byte offsets inside a ring (docs/PROTOCOL.md): line 0 consumer, line 1
// producer, line 2 config.
const R_HEAD: u64 = 0;
const R_CONS_WAIT: u64 = 8;
const R_TAIL: u64 = 64;
const R_PROD_WAIT: u64 = 72;
const R_CAPACITY: u64 = 128;
const R_FLAGS: u64 = 132;
/// The doorbell word in the region header.
const DOORBELL: u64 = 128;

fn random_frame(rng: &mut Rng, handles: &[u64]) -> TensorBlockDescriptor {
    let mut b = [0u8; 64];
    for c in b.chunks_mut(8) {
        c.copy_from_slice(&rng.next().to_le_bytes());
    }
    let mut f = TensorBlockDescriptor::from_bytes(&b);
    if rng.below(4) != 0 {
        // Plausible enough to get past the first checks.
        f.status = if rng.below(8) == 0 { 1 + rng.below(255) as u8 } else { 0 };
        f.op = rng.below(12) as u8;
        f.dtype = rng.below(14) as u8;
        f.ndim = rng.below(8) as u8;
        for d in f.shape.iter_mut() {
            *d = match rng.below(4) {
                0 => 0,
                1 => u32::MAX,
                _ => *d % (1 << rng.below(22)),
            };
        }
        f.offset = match rng.below(6) {
            0 => 0,
            1 => 64 * rng.below(64),
            2 => u64::MAX,
            3 => 4095,
            4 => 1 << 40,
            _ => f.offset,
        };
        f.key_hi = 0;
        f.key_lo %= 16;
        if !handles.is_empty() && rng.below(2) == 0 {
            f.handle = handles[rng.below(handles.len() as u64) as usize];
        }
    }
    if f.op == Op::Wait as u8 && f.status == 0 {
        // A WAIT's `handle` is its timeout: a random one would (rightly) park
        // the channel for ages. At most 1 ms.
        f.handle %= 1000;
    }
    f
}

// ---------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------

/// SIGKILLs this process (what an OOM kill or `kill -9` does).
fn die() -> ! {
    let _ = std::io::stdout().flush();
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A thread that SIGKILLs this process after `after`.
fn killer(after: Duration) {
    std::thread::spawn(move || {
        let t = Instant::now();
        if after > Duration::from_micros(200) {
            std::thread::sleep(after);
        }
        while t.elapsed() < after {
            std::hint::spin_loop();
        }
        die()
    });
}

fn connect_child() -> Client {
    let socket = PathBuf::from(env_str(SOCKET_VAR));
    Client::connect(&opts(&socket)).unwrap_or_else(|e| panic!("child: connect: {e}"))
}

/// Entry point of every child process; a no-op in a normal test run.
#[test]
fn child_process() {
    let Ok(role) = std::env::var(ROLE_VAR) else { return };
    match role.as_str() {
        "kl_victim" => kl_victim(connect_child(), env_u64("KDB_SEED"), env_u64("KDB_MODE")),
        "kl_reader" => kl_reader(connect_child(), env_u64("KDB_SEED")),
        "dk_client" => dk_client(env_u64("KDB_ID")),
        "good" => good_client(connect_child(), env_u64("KDB_ID")),
        "hostile" => hostile(),
        "other_uid" => other_uid(),
        "oom_reader" => oom_reader(connect_child()),
        other => panic!("unknown child role {other}"),
    }
}

// ---------------------------------------------------------------------------
// 1. Client kill loop
// ---------------------------------------------------------------------------

const KL_TAG: u64 = 0x4B4C_4B4C;
const KL_KEYS: u64 = 256;
/// How each victim dies (index = `KDB_MODE`).
const KL_MODES: [&str; 10] = [
    "holding_reservations",
    "mid_write",
    "written_not_committed",
    "holding_pins",
    "in_put_many",
    "in_get_many",
    "random_ops",
    "parent_kill",
    "frames_in_flight",
    "mid_commit",
];

fn kl_key(j: u64) -> Key {
    tkey(KL_TAG, j)
}

/// Tells the test that `version` of `key` may be committed from now on.
fn kl_announce(key: Key, version: u64) {
    say("C", format!("{} {version:x}", key.lo()))
}

fn kl_write(kc: &Client, rng: &mut Rng) {
    let key = kl_key(rng.below(KL_KEYS));
    let len = block_len(rng);
    write_one(kc, key, len, rng, &mut kl_announce).unwrap_or_else(|e| panic!("victim write: {e}"));
}

fn kl_random_keys(rng: &mut Rng, n: u64) -> Vec<Key> {
    (0..n).map(|_| kl_key(rng.below(KL_KEYS))).collect()
}

/// Random verified ops until the process is killed.
fn kl_random_ops(kc: &Client, rng: &mut Rng) -> ! {
    let mut held: VecDeque<(Key, u64, BlockView)> = VecDeque::new();
    loop {
        match rng.below(12) {
            0..=3 => kl_write(kc, rng),
            4..=6 => {
                let k = kl_key(rng.below(KL_KEYS));
                if let Some(v) = kc.get(k).expect("victim get") {
                    let ver = verify(&v, k, "victim get");
                    if rng.below(2) == 0 {
                        held.push_back((k, ver, v));
                    }
                }
            }
            7 => {
                let keys = kl_random_keys(rng, 8);
                for (k, v) in keys.iter().zip(kc.get_many(&keys).expect("victim get_many")) {
                    if let Some(v) = v {
                        verify(&v, *k, "victim get_many");
                    }
                }
            }
            8 => {
                kc.lookup(&kl_random_keys(rng, 4)).expect("victim lookup");
            }
            9 => {
                if rng.below(3) == 0 {
                    kc.delete(kl_key(rng.below(KL_KEYS))).expect("victim delete");
                }
            }
            10 => match kc.reserve(kl_key(rng.below(KL_KEYS)), DType::U8, &Shape::for_bytes(8192).expect("shape"), 0) {
                Ok(mut r) => {
                    r.as_mut_slice().fill(0xEE);
                    r.abort().expect("abort");
                }
                Err(ClientError::OutOfMemory) => {}
                Err(e) => panic!("victim reserve: {e}"),
            },
            _ => {
                while held.len() > 2 {
                    let (k, ver, v) = held.pop_front().expect("non-empty");
                    assert_eq!(verify(&v, k, "victim held view"), ver, "a pinned block changed");
                }
            }
        }
        if held.len() > 16 {
            let (k, ver, v) = held.pop_front().expect("non-empty");
            assert_eq!(verify(&v, k, "victim held view"), ver, "a pinned block changed");
        }
    }
}

fn kl_reserve(kc: &Client, key: Key, len: usize) -> Option<kachedb_client::Reservation> {
    match kc.reserve(key, DType::U8, &Shape::for_bytes(len as u64).expect("shape"), 0) {
        Ok(r) => Some(r),
        Err(ClientError::OutOfMemory) => None,
        Err(e) => panic!("victim reserve: {e}"),
    }
}

/// A client that does some complete writes, then dies the way `mode` says.
fn kl_victim(kc: Client, seed: u64, mode: u64) {
    let mut rng = Rng::new(seed);
    for _ in 0..rng.below(3) {
        kl_write(&kc, &mut rng);
    }
    match mode {
        0 => {
            // Reservations held (some with a header written) when killed.
            let mut held = Vec::new();
            for _ in 0..1 + rng.below(4) {
                let key = kl_key(rng.below(KL_KEYS));
                let len = block_len(&mut rng);
                if let Some(mut r) = kl_reserve(&kc, key, len) {
                    if rng.below(2) == 0 {
                        write_header(r.as_mut_slice(), key, rng.next() | 1);
                    }
                    held.push(r);
                }
            }
            die()
        }
        1 => {
            // Killed while writing into a reserved block.
            let key = kl_key(rng.below(KL_KEYS));
            let len = 64 * 1024 + rng.below(1 << 20) as usize;
            let version = rng.next() | 1;
            let Some(mut r) = kl_reserve(&kc, key, len) else { die() };
            let buf = r.as_mut_slice();
            if rng.below(2) == 0 {
                // At a chosen byte: the header and part of the body.
                let full = block_vec(key, version, len);
                let cut = HDR + rng.below((len - HDR) as u64) as usize;
                buf[..cut].copy_from_slice(&full[..cut]);
                die()
            }
            // At a random moment of a write that keeps going.
            killer(Duration::from_micros(rng.below(400)));
            loop {
                write_block(buf, key, version);
            }
        }
        2 => {
            // The whole block written, the commit never sent.
            let key = kl_key(rng.below(KL_KEYS));
            let len = block_len(&mut rng);
            if let Some(mut r) = kl_reserve(&kc, key, len) {
                write_block(r.as_mut_slice(), key, rng.next() | 1);
            }
            die()
        }
        3 => {
            // Holding many pins (one batch, plus single gets, some twice).
            let keys = {
                let n = 16 + rng.below(112);
                kl_random_keys(&mut rng, n)
            };
            let views = kc.get_many(&keys).expect("get_many");
            for (k, v) in keys.iter().zip(&views) {
                if let Some(v) = v {
                    verify(v, *k, "pinned");
                }
            }
            let _more: Vec<BlockView> =
                (0..rng.below(8)).filter_map(|_| kc.get(kl_key(rng.below(KL_KEYS))).expect("get")).collect();
            die()
        }
        4 => {
            // Inside put_many batches (reserve batch, copies, commit batch).
            killer(Duration::from_micros(rng.below(4000)));
            loop {
                let keys = {
                    let n = 8 + rng.below(56);
                    kl_random_keys(&mut rng, n)
                };
                let versions: Vec<u64> = keys.iter().map(|_| rng.next() | 1).collect();
                let bufs: Vec<Vec<u8>> = keys
                    .iter()
                    .zip(&versions)
                    .map(|(k, v)| block_vec(*k, *v, HDR + rng.below(4096) as usize))
                    .collect();
                for (k, v) in keys.iter().zip(&versions) {
                    kl_announce(*k, *v);
                }
                let items: Vec<(Key, &[u8])> = keys.iter().zip(&bufs).map(|(k, b)| (*k, b.as_slice())).collect();
                match kc.put_many(&items) {
                    Ok(()) | Err(ClientError::OutOfMemory) => {}
                    Err(e) => panic!("put_many: {e}"),
                }
            }
        }
        5 => {
            // Inside get_many batches.
            killer(Duration::from_micros(rng.below(4000)));
            loop {
                let keys = {
                    let n = 32 + rng.below(128);
                    kl_random_keys(&mut rng, n)
                };
                for (k, v) in keys.iter().zip(kc.get_many(&keys).expect("get_many")) {
                    if let Some(v) = v {
                        verify(&v, *k, "get_many");
                    }
                }
            }
        }
        6 => {
            killer(Duration::from_micros(rng.below(15_000)));
            kl_random_ops(&kc, &mut rng)
        }
        7 => kl_random_ops(&kc, &mut rng), // the test kills it
        8 => {
            // RESERVE and GET frames published on the ring; nobody waits for them.
            let region = kc.region().clone();
            let (mut sub, _comp) = region.client_channel(kc.channel()).expect("own channel");
            let frames: Vec<TensorBlockDescriptor> = (0..1 + rng.below(64))
                .map(|_| {
                    let key = kl_key(rng.below(KL_KEYS));
                    if rng.below(3) == 0 {
                        TensorBlockDescriptor::request(Op::Get, 0, key.0)
                    } else {
                        let mut f = TensorBlockDescriptor::request(Op::Reserve, 0, key.0);
                        f.set_shape(DType::U8, &Shape::for_bytes(block_len(&mut rng) as u64).expect("shape"));
                        f
                    }
                })
                .collect();
            let _ = sub.push_batch(&frames);
            region.doorbell().notify();
            let t = Instant::now();
            let wait = Duration::from_micros(rng.below(300));
            while t.elapsed() < wait {
                std::hint::spin_loop();
            }
            die()
        }
        _ => {
            // Killed around a commit.
            let key = kl_key(rng.below(KL_KEYS));
            let len = block_len(&mut rng);
            let Some(mut r) = kl_reserve(&kc, key, len) else { die() };
            let version = rng.next() | 1;
            write_block(r.as_mut_slice(), key, version);
            kl_announce(key, version);
            killer(Duration::from_micros(rng.below(150)));
            let _ = r.commit();
            kl_random_ops(&kc, &mut rng)
        }
    }
}

/// A stop flag set when the test writes a line (or closes stdin).
fn stop_on_stdin() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        let mut l = String::new();
        let _ = std::io::stdin().read_line(&mut l);
        s.store(true, Ordering::SeqCst);
    });
    stop
}

/// Gets and holds blocks while victims die around it; verifies every one.
fn kl_reader(kc: Client, seed: u64) {
    let stop = stop_on_stdin();
    let mut rng = Rng::new(seed);
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut held: VecDeque<(Key, u64, BlockView)> = VecDeque::new();
    let (mut gets, mut hits, mut bytes, mut rechecks) = (0u64, 0u64, 0u64, 0u64);
    say("READY", "");
    while !stop.load(Ordering::Relaxed) {
        let n = if rng.below(3) == 0 { 1 } else { 1 + rng.below(24) };
        let keys = kl_random_keys(&mut rng, n);
        let views = if n == 1 {
            vec![kc.get(keys[0]).expect("reader get")]
        } else {
            kc.get_many(&keys).expect("reader get_many")
        };
        gets += n;
        for (k, v) in keys.iter().zip(views) {
            let Some(v) = v else { continue };
            let ver = verify(&v, *k, "reader");
            hits += 1;
            bytes += v.len() as u64;
            seen.insert((k.lo(), ver));
            if rng.below(4) == 0 {
                held.push_back((*k, ver, v));
            }
        }
        while held.len() > 32 {
            let (k, ver, v) = held.pop_front().expect("non-empty");
            assert_eq!(verify(&v, k, "reader held view"), ver, "a pinned block changed while held");
            rechecks += 1;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    for (k, ver, v) in held.drain(..) {
        assert_eq!(verify(&v, k, "reader held view"), ver, "a pinned block changed while held");
        rechecks += 1;
    }
    let mut line = String::new();
    for (j, ver) in &seen {
        line.push_str(&format!("{j}:{ver:x},"));
        if line.len() > 4000 {
            say("SEEN", &line);
            line.clear();
        }
    }
    if !line.is_empty() {
        say("SEEN", &line);
    }
    say("DONE", json!({"gets": gets, "hits": hits, "bytes": bytes, "rechecks": rechecks, "distinct": seen.len()}));
}

fn round_up_page(x: u64) -> u64 {
    x.div_ceil(4096).max(1) * 4096
}

struct Victim {
    p: Proc,
    mode: usize,
    kill_at: Option<Instant>,
    parent_killed: bool,
    spawned: Instant,
}

/// 2000 client processes (20 000 in the soak) are SIGKILLed at every point of their work (see
/// `KL_MODES`), 8 at a time, while 3 reader processes get, hold and verify
/// blocks; every block a reader got was whole and announced for commit by its
/// writer; afterwards no pin or reservation is left, every invariant holds and
/// `bytes_used` is exactly the extents of the committed blocks.
#[test]
fn client_kill_loop() {
    let target = knob("KDB_CLIENT_KILLS", 2000, 20_000);
    let conc = knob("KDB_KILL_CONCURRENCY", 8, 12) as usize;
    let dir = TempDir::new("killloop");
    // Small enough that victims' writes evict and sometimes find the store full.
    let daemon = Daemon::start(&dir.socket(), "8MiB");
    let sock = daemon.socket.clone();
    let mut rng = Rng::new(mono_ns());
    let mut announced: HashSet<(u64, u64)> = HashSet::new();
    {
        let kc = Client::connect(&daemon.opts()).expect("connect");
        for j in 0..KL_KEYS {
            let len = block_len(&mut rng);
            write_one(&kc, kl_key(j), len, &mut rng, &mut |k, v| {
                announced.insert((k.lo(), v));
            })
            .expect("seed write")
            .expect("room for the seed blocks");
        }
    }
    let mut readers: Vec<Proc> =
        (0..3).map(|_| spawn_child("kl_reader", &sock, &[("KDB_SEED", rng.next().to_string())])).collect();
    for r in &mut readers {
        r.expect("READY", Duration::from_secs(30));
    }

    let mut live: Vec<Victim> = Vec::new();
    let mut by_mode = [0u64; KL_MODES.len()];
    let (mut kills, mut parent_kills, mut spawned) = (0u64, 0u64, 0u64);
    let mut lifetime_total = Duration::ZERO;
    let limit = Duration::from_secs(knob("KDB_CLIENT_KILL_LIMIT_S", 300, 7200));
    let start = Instant::now();
    while kills < target {
        assert!(start.elapsed() < limit, "only {kills} of {target} kills within {limit:?}");
        while live.len() < conc && kills + (live.len() as u64) < target {
            let mode = rng.below(KL_MODES.len() as u64) as usize;
            let p = spawn_child(
                "kl_victim",
                &sock,
                &[("KDB_SEED", rng.next().to_string()), ("KDB_MODE", mode.to_string())],
            );
            let now = Instant::now();
            let kill_at = if KL_MODES[mode] == "parent_kill" {
                Some(now + Duration::from_micros(5_000 + rng.below(80_000)))
            } else if rng.below(4) == 0 {
                Some(now + Duration::from_micros(rng.below(60_000)))
            } else {
                None
            };
            live.push(Victim { p, mode, kill_at, parent_killed: false, spawned: now });
            spawned += 1;
        }
        let mut i = 0;
        while i < live.len() {
            let status = live[i].p.child.try_wait().expect("try_wait");
            let Some(status) = status else {
                let v = &mut live[i];
                if v.kill_at.is_some_and(|t| Instant::now() >= t) && !v.parent_killed {
                    signal(v.p.pid(), rustix::process::Signal::KILL);
                    v.parent_killed = true;
                }
                i += 1;
                continue;
            };
            let v = live.swap_remove(i);
            lifetime_total += v.spawned.elapsed();
            let (out, dump) = reap_output(v.p);
            for c in tagged(&out, "C") {
                let mut it = c.split_whitespace();
                let (Some(j), Some(ver)) = (it.next(), it.next()) else { continue }; // cut by the kill
                if let (Ok(j), Ok(ver)) = (j.parse::<u64>(), u64::from_str_radix(ver, 16)) {
                    announced.insert((j, ver));
                }
            }
            assert_eq!(
                status.signal(),
                Some(9),
                "victim ({}) ended with {status}, not SIGKILL:\n{dump}",
                KL_MODES[v.mode]
            );
            kills += 1;
            by_mode[v.mode] += 1;
            parent_kills += u64::from(v.parent_killed);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let kill_secs = start.elapsed().as_secs_f64();

    // Readers: every block they got was whole (checked as they went) and committed.
    let mut reader_figs = Vec::new();
    let mut seen_pairs = 0u64;
    for mut r in readers {
        r.send("stop");
        let out = r.finish(Duration::from_secs(60));
        for chunk in tagged(&out, "SEEN") {
            for pair in chunk.split(',').filter(|p| !p.is_empty()) {
                let (j, ver) = pair.split_once(':').expect("j:ver");
                let pair = (j.parse::<u64>().expect("j"), u64::from_str_radix(ver, 16).expect("ver"));
                assert!(
                    announced.contains(&pair),
                    "a reader got version {:#x} of key {}, which no writer committed",
                    pair.1,
                    pair.0
                );
                seen_pairs += 1;
            }
        }
        let done: Value = serde_json::from_str(tagged(&out, "DONE").first().expect("DONE")).expect("json");
        reader_figs.push(done);
    }

    // Nothing is left of the dead clients.
    let t = Instant::now();
    let (v, _) = poll_stats(&sock, Duration::from_secs(10), "every victim's pins and reservations released", |v| {
        num(v, "clients_connected") == 0 && num(v, "pins") == 0 && num(v, "reserved") == 0
    });
    let settle = t.elapsed();
    assert!(invariants_ok(&v), "{v}");
    assert_eq!(num(&v, "internal"), 0, "{v}");
    assert_eq!(num(&v, "unlinked_blocks"), 0, "{v}");
    assert_eq!(num(&v, "clients_kicked"), 0, "no killed client looked corrupt: {v}");
    assert_eq!(num(&v, "bytes_used") + num(&v, "bytes_free"), num(&v, "bytes_total"), "{v}");

    // bytes_used is exactly the committed blocks' extents: look at every key.
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let (mut found, mut extent_bytes) = (0u64, 0u64);
    {
        let views = kc.get_many(&(0..KL_KEYS).map(kl_key).collect::<Vec<_>>()).expect("get_many");
        for (j, v) in views.iter().enumerate() {
            let Some(v) = v else { continue };
            let ver = verify(v, kl_key(j as u64), "final check");
            assert!(announced.contains(&(j as u64, ver)), "key {j} holds version {ver:#x}, which no writer committed");
            found += 1;
            extent_bytes += round_up_page(v.len() as u64 + v.offset() % 4096);
        }
    }
    drop(kc);
    let (v, _) = poll_stats(&sock, Duration::from_secs(5), "the checker's pins released", |v| {
        num(v, "clients_connected") == 0 && num(v, "pins") == 0
    });
    assert_eq!(num(&v, "blocks"), found, "{v}");
    assert_eq!(num(&v, "bytes_used"), extent_bytes, "bytes_used is the committed blocks' extents: {v}");
    assert!(invariants_ok(&v), "{v}");
    assert!(daemon_alive(&daemon), "the daemon survived");
    let log = daemon.log();
    assert!(!log.contains("panicked"), "daemon log:\n{log}");

    figures(
        "client_kill_loop",
        json!({
            "kills": kills,
            "by_mode": KL_MODES.iter().zip(by_mode).map(|(m, n)| (m.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "killed_by_test": parent_kills,
            "killed_themselves": kills - parent_kills,
            "spawned": spawned,
            "concurrency": conc,
            "kill_phase_s": (kill_secs * 10.0).round() / 10.0,
            "kills_per_s": (kills as f64 / kill_secs).round(),
            "mean_victim_life_ms": ms(lifetime_total / spawned.max(1) as u32),
            "readers": reader_figs,
            "reader_versions_checked_committed": seen_pairs,
            "announced_versions": announced.len(),
            "settle_ms": ms(settle),
            "blocks_at_end": found,
            "bytes_used": extent_bytes,
            "daemon": {
                "ops": num(&v, "ops"), "clients_total": num(&v, "clients_total"), "reserves": num(&v, "reserves"),
                "commits": num(&v, "commits"), "aborts": num(&v, "aborts"), "gets": num(&v, "gets"),
                "evictions": num(&v, "evictions"), "out_of_memory": num(&v, "out_of_memory")
            },
            "lost": 0
        }),
    );
}

fn daemon_alive(d: &Daemon) -> bool {
    rustix::process::test_kill_process(rustix::process::Pid::from_raw(d.pid() as i32).expect("pid")).is_ok() && {
        // Not a zombie: its stats still answer.
        kachedb_client::daemon_stats(&d.opts()).is_ok()
    }
}

/// Waits for an exited child's output; returns (stdout, a dump of both streams).
fn reap_output(mut p: Proc) -> (String, String) {
    p.stdin.take();
    let _ = wait_timeout(&mut p.child, Duration::from_secs(10));
    for r in p.readers.drain(..) {
        let _ = r.join();
    }
    let out = p.out.lock().map(|s| s.clone()).unwrap_or_default();
    (out, p.dump())
}

// ---------------------------------------------------------------------------
// 2. Daemon kill loop
// ---------------------------------------------------------------------------

const DK_TAG: u64 = 0x444B_0000_0000_0000;
const DK_KEYS: u64 = 32;

fn dk_tag(owner: u64, round: u64) -> u64 {
    DK_TAG | (owner << 24) | round
}

/// Verified ops until one fails; returns the failure, when it came
/// (`Instant` and `CLOCK_MONOTONIC` ns) and the client's state (its held views).
fn dk_load(kc: &Client, owner: u64, round: u64, rng: &mut Rng) -> (ClientError, Instant, u64, Owned) {
    let mut m = Owned::new(dk_tag(owner, round), DK_KEYS);
    loop {
        if let Err(e) = m.step(kc, rng) {
            return (e, Instant::now(), mono_ns(), m);
        }
    }
}

/// A client process living across daemon restarts: on `go <round>` it
/// connects, checks the daemon is fresh, loads it until an op fails, checks
/// the failure and the next op are `Disconnected`, drops everything and
/// reports `DISC <round> <error ns> <next-op ns> <drop ns> <held views> <ops>`.
fn dk_client(id: u64) {
    let socket = PathBuf::from(env_str(SOCKET_VAR));
    let mut rng = Rng::new(mono_ns() ^ id);
    let owner = 100 + id;
    say("READY", id);
    let stdin = std::io::stdin();
    loop {
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).expect("stdin") == 0 {
            return;
        }
        let Some(round) = line.trim().strip_prefix("go ").map(|r| r.parse::<u64>().expect("round")) else { return };
        let kc = Client::connect(&opts(&socket)).unwrap_or_else(|e| panic!("round {round}: connect: {e}"));
        if round > 0 {
            for j in 0..DK_KEYS {
                assert!(
                    !kc.contains(tkey(dk_tag(owner, round - 1), j)).expect("contains"),
                    "round {round}: a block of the killed daemon is still there"
                );
            }
        }
        say("CONNECTED", round);
        let (err, _, at_ns, m) = dk_load(&kc, owner, round, &mut rng);
        assert!(is_disconnected(&err), "round {round}: the daemon's death gave {err:?}");
        let t = Instant::now();
        let next = kc.ping();
        let next_ns = t.elapsed().as_nanos();
        assert!(matches!(next, Err(ClientError::Disconnected(_))), "round {round}: next op after the death: {next:?}");
        let (held, ops) = (m.held.len(), m.ops);
        let t = Instant::now();
        drop(m);
        drop(kc);
        say("DISC", format!("{round} {at_ns} {next_ns} {} {held} {ops}", t.elapsed().as_nanos()));
    }
}

/// Whether `s` names the memfd `needle` (`memfd:kachedb_7`, not `…_71`).
fn names_memfd(s: &str, needle: &str) -> bool {
    s.match_indices(needle).any(|(i, _)| {
        let rest = &s[i + needle.len()..];
        rest.is_empty() || rest.starts_with(' ') || rest.starts_with('(')
    })
}

/// Every process that maps (`/proc/*/maps`) or holds open (`/proc/*/fd`)
/// the memfd `needle`.
fn memfd_holders(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else { return found };
    for e in procs.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().filter(|s| s.bytes().all(|b| b.is_ascii_digit())) else { continue };
        if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            found.extend(maps.lines().filter(|l| names_memfd(l, needle)).map(|l| format!("pid {pid} maps {l}")));
        }
        if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            for fd in fds.flatten() {
                if let Ok(t) = std::fs::read_link(fd.path()) {
                    let t = t.to_string_lossy();
                    if names_memfd(&t, needle) {
                        found.push(format!("pid {pid} fd {} -> {t}", fd.file_name().to_string_lossy()));
                    }
                }
            }
        }
    }
    found
}

/// `holders` with each process's parent, state and command line.
fn describe_holders(holders: &[String]) -> String {
    holders
        .iter()
        .map(|h| {
            let pid = h.split_whitespace().nth(1).unwrap_or("?");
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).unwrap_or("?").trim().to_string();
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .unwrap_or_default();
            format!(
                "{h} [ppid {} state {} (this test is pid {}): {cmd}]",
                field("PPid:"),
                field("State:"),
                std::process::id()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Names in `/dev/shm` that contain "kachedb".
fn dev_shm_kachedb() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.to_ascii_lowercase().contains("kachedb"))
                .collect()
        })
        .unwrap_or_default()
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The daemon is SIGKILLed under load 50 times (200 in the soak), on the same
/// socket: 3 client threads of this process and 2 client processes are in the
/// middle of verified ops each time. Every one gets `Disconnected` within 1 s
/// of the kill, and so does its next op; dropping its views takes no time; no
/// process maps or holds the region any more and `/dev/shm` has nothing new;
/// the stale socket file is reclaimed by the next daemon, which starts empty.
#[test]
fn daemon_kill_loop() {
    let rounds = knob("KDB_DAEMON_KILLS", 50, 200);
    const THREADS: u64 = 3;
    const PROCS: u64 = 2;
    let inst = unique_instance();
    let needle = format!("memfd:kachedb_{inst}");
    let dir = TempDir::new("dkill");
    let sock = dir.socket();
    let lock = lock_path(&sock);
    let shm_before = dev_shm_kachedb();
    let mut procs: Vec<Proc> =
        (0..PROCS).map(|i| spawn_child("dk_client", &sock, &[("KDB_ID", i.to_string())])).collect();
    for p in &mut procs {
        p.expect("READY", Duration::from_secs(30));
    }
    let mut rng = Rng::new(mono_ns());
    let (mut lat, mut next_ops, mut drops, mut restarts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut load_ops, mut held_views, mut stale_reclaimed, mut transient_holders) = (0u64, 0u64, 0u64, 0u64);
    let inst_arg = inst.to_string();
    let extra = ["--instance", inst_arg.as_str(), "--channels", "8"];
    for round in 0..rounds {
        if round > 0 {
            assert!(sock.exists(), "round {round}: the SIGKILLed daemon's socket file is left behind (stale)");
        }
        let t = Instant::now();
        let mut d = Daemon::spawn_with(&sock, "32MiB", &extra);
        d.wait_ready();
        restarts.push(t.elapsed());
        stale_reclaimed += u64::from(round > 0);
        let v = stats_fast(&sock);
        assert_eq!(num(&v, "daemon_pid"), u64::from(d.pid()), "{v}");
        for k in ["blocks", "bytes_used", "clients_connected", "pins", "reserved", "clients_total"] {
            assert_eq!(num(&v, k), 0, "round {round}: the restarted daemon starts clean ({k}): {v}");
        }
        for p in &mut procs {
            p.send(&format!("go {round}"));
        }
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let loaders: Vec<_> = (0..THREADS)
            .map(|t| {
                let (tx, sock, seed) = (ready_tx.clone(), sock.clone(), rng.next());
                std::thread::spawn(move || {
                    let kc = Client::connect(&opts(&sock)).expect("connect");
                    let mut rng = Rng::new(seed);
                    tx.send(()).expect("ready");
                    let (err, at, _, m) = dk_load(&kc, t, round, &mut rng);
                    let t2 = Instant::now();
                    let next = kc.get(tkey(dk_tag(t, round), 0));
                    let next_d = t2.elapsed();
                    let (held, ops) = (m.held.len() as u64, m.ops);
                    let t3 = Instant::now();
                    drop(m);
                    drop(kc);
                    (err, at, next.err(), next_d, t3.elapsed(), held, ops)
                })
            })
            .collect();
        for _ in 0..THREADS {
            ready_rx.recv_timeout(Duration::from_secs(30)).expect("loader connected");
        }
        for p in &mut procs {
            p.expect("CONNECTED", Duration::from_secs(30));
        }
        std::thread::sleep(Duration::from_millis(20 + rng.below(130)));
        let killed = Instant::now();
        let kill_ns = mono_ns();
        d.signal(rustix::process::Signal::KILL);
        for h in &loaders {
            while !h.is_finished() {
                // A hung thread is left behind (the process exits at the end of the run).
                assert!(
                    killed.elapsed() < Duration::from_secs(5),
                    "round {round}: a client is still blocked 5 s after the daemon was killed"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        for h in loaders {
            let (err, at, next, next_d, drop_d, held, ops) = h.join().expect("loader thread");
            assert!(is_disconnected(&err), "round {round}: the daemon's death gave {err:?}");
            assert!(at >= killed, "round {round}: Disconnected before the kill: {err}");
            assert!(matches!(next, Some(ClientError::Disconnected(_))), "round {round}: next op: {next:?}");
            lat.push(at - killed);
            next_ops.push(next_d);
            drops.push(drop_d);
            held_views += held;
            load_ops += ops;
        }
        for p in &mut procs {
            let line = p.expect("DISC", Duration::from_secs(5));
            let f: Vec<u64> = line.split_whitespace().map(|x| x.parse().expect("number")).collect();
            assert_eq!(f[0], round);
            assert!(f[1] >= kill_ns, "round {round}: a client process saw Disconnected before the kill");
            lat.push(Duration::from_nanos(f[1] - kill_ns));
            next_ops.push(Duration::from_nanos(f[2]));
            drops.push(Duration::from_nanos(f[3]));
            held_views += f[4];
            load_ops += f[5];
        }
        let status = d.wait_exit(Duration::from_secs(10)).expect("the killed daemon is reaped");
        assert_eq!(status.signal(), Some(9), "{status}");
        // What a SIGKILL leaves: the socket file and the lock file (reclaimed by
        // the next daemon); no shared memory anywhere.
        assert!(sock.exists() && lock.exists(), "round {round}: socket and lock files stay until the next start");
        // A process this test forks for another test (e.g. a client_kill_loop
        // victim) holds copies of this process's fds between fork and exec:
        // such a copy goes away on exec (the fds are close-on-exec). So a
        // holder must persist to count.
        let t = Instant::now();
        let holders = loop {
            let h = memfd_holders(&needle);
            if h.is_empty() || t.elapsed() > Duration::from_secs(3) {
                break h;
            }
            transient_holders += 1;
            eprintln!("round {round}: transient holders:\n{}", describe_holders(&h));
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            holders.is_empty(),
            "round {round}: the dead daemon's region is still held:\n{}",
            describe_holders(&holders)
        );
        let shm_now = dev_shm_kachedb();
        assert!(
            shm_now.is_subset(&shm_before),
            "round {round}: new /dev/shm entries: {:?}",
            shm_now.difference(&shm_before).collect::<Vec<_>>()
        );
    }
    let worst = lat.iter().max().copied().unwrap_or_default();
    assert!(worst < Duration::from_secs(1), "a client took {worst:?} to get Disconnected");
    let worst_next = next_ops.iter().max().copied().unwrap_or_default();
    assert!(worst_next < Duration::from_secs(1), "a next op took {worst_next:?}");
    let worst_drop = drops.iter().max().copied().unwrap_or_default();
    assert!(worst_drop < Duration::from_secs(1), "dropping a dead daemon's views took {worst_drop:?}");

    // A last restart reclaims the stale socket; SIGTERM then removes socket and lock.
    let mut d = Daemon::spawn_with(&sock, "32MiB", &extra);
    d.wait_ready();
    let kc = Client::connect(&d.opts()).expect("connect");
    kc.put(tkey(DK_TAG, 1), &block_vec(tkey(DK_TAG, 1), 1, 100)).expect("put");
    drop(kc);
    d.signal(rustix::process::Signal::TERM);
    let status = d.wait_exit(Duration::from_secs(10)).expect("exit on SIGTERM");
    assert_eq!(status.code(), Some(0), "{}", d.log());
    assert!(!sock.exists() && !lock.exists(), "SIGTERM removes socket and lock");
    assert!(memfd_holders(&needle).is_empty());
    for mut p in procs {
        p.send("exit");
        p.finish(Duration::from_secs(10));
    }
    let n = lat.len();
    figures(
        "daemon_kill_loop",
        json!({
            "kills": rounds,
            "clients_per_kill": THREADS + PROCS,
            "disconnected_calls": n,
            "disconnected_ms": {"p50": ms(percentile(&mut lat, 0.5)), "p99": ms(percentile(&mut lat, 0.99)), "max": ms(worst)},
            "next_op_max_ms": ms(worst_next),
            "drop_views_max_ms": ms(worst_drop),
            "views_held_at_kill": held_views,
            "load_ops": load_ops,
            "restart_ms": {"p50": ms(percentile(&mut restarts, 0.5)), "max": ms(restarts.iter().max().copied().unwrap_or_default())},
            "stale_sockets_reclaimed": stale_reclaimed + 1,
            "memfd_holders_after_kill": 0,
            "transient_fork_copies_seen": transient_holders,
            "new_dev_shm_entries": 0,
            "lost": 0
        }),
    );
}

// ---------------------------------------------------------------------------
// 3. A hostile client
// ---------------------------------------------------------------------------

const GOOD_TAG: u64 = 0x474F_4F44_0000_0000;
const CHURN_TAG: u64 = 0x4348_5552_0000_0000;
const VICTIM_TAG: u64 = 0x5649_4354_0000_0000;

/// A well-behaved client: verified ops on its own keys until told to stop.
fn good_client(kc: Client, id: u64) {
    let stop = stop_on_stdin();
    let mut rng = Rng::new(mono_ns() ^ id);
    let mut m = Owned::new(GOOD_TAG | id, 48);
    say("READY", id);
    while !stop.load(Ordering::Relaxed) {
        m.step(&kc, &mut rng).unwrap_or_else(|e| panic!("good client {id}, op {}: {e}", m.ops));
        if m.ops.is_multiple_of(16) {
            std::thread::sleep(Duration::from_micros(300));
        }
    }
    say("DONE", json!({"id": id, "ops": m.ops}));
}

/// Connects, abuses the channel it got in every way it can, makes it
/// clearly corrupt, waits for the kick, keeps scribbling on the old channel
/// for a while, and starts again, for `KDB_SECS` seconds.
fn hostile() {
    let socket = PathBuf::from(env_str(SOCKET_VAR));
    let secs = env_u64("KDB_SECS");
    let victim: Vec<u64> =
        env_str("KDB_VICTIM_HANDLES").split(',').map(|h| u64::from_str_radix(h, 16).expect("hex handle")).collect();
    let pin_key = Key(u128::from_str_radix(&env_str("KDB_PIN_KEY"), 16).expect("hex key"));
    let mut rng = Rng::new(env_u64("KDB_SEED"));
    let end = Instant::now() + Duration::from_secs(secs);
    let (mut conns, mut via_client, mut victim_frames, mut raw_frames, mut scribbles, mut stale) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut kick_ms: Vec<f64> = Vec::new();
    let mut how: BTreeMap<&str, u64> = BTreeMap::new();
    let mut next_op: BTreeMap<&str, u64> = BTreeMap::new();
    while Instant::now() < end {
        let kc = loop {
            match Client::connect(&opts(&socket)) {
                Ok(c) => break c,
                Err(e) => {
                    assert!(Instant::now() < end + Duration::from_secs(10), "hostile: cannot connect: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        conns += 1;
        let kicked0 = num(&stats_fast(&socket), "clients_kicked");
        let region = kc.region().clone();
        let (sub, comp) = region.layout().ring_offsets(kc.channel()).expect("own channel");
        let cap = u64::from(region.layout().ring_capacity);
        let mut handles = victim.clone();

        // A: through the client: random frames, the victim's handles, a pin
        // and reservations for the kick to clean up.
        let mut frames: Vec<TensorBlockDescriptor> =
            (0..1 + rng.below(200)).map(|_| random_frame(&mut rng, &handles)).collect();
        frames.push(TensorBlockDescriptor::request(Op::Get, 0, pin_key.0));
        for _ in 0..2 {
            let mut f = TensorBlockDescriptor::request(Op::Reserve, 0, u128::from(rng.next()));
            f.set_shape(DType::U8, &Shape::for_bytes(4096 + rng.below(100_000)).expect("shape"));
            frames.push(f);
        }
        for &h in &victim {
            for op in [Op::Commit, Op::Abort, Op::Release] {
                let mut f = TensorBlockDescriptor::request(op, 0, 0);
                f.handle = h;
                frames.push(f);
            }
        }
        let done = kc.call_raw(&frames).expect("the daemon answers every frame of a connected client");
        assert_eq!(done.len(), frames.len());
        via_client += frames.len() as u64;
        for (f, c) in frames.iter().zip(&done) {
            assert!(Status::from_code(c.status).is_some(), "completion with an unknown status: {c:?}");
            if let Ok(
                kachedb_shm::Request::Commit { handle, .. }
                | kachedb_shm::Request::Abort { handle }
                | kachedb_shm::Request::Release { handle },
            ) = kachedb_shm::Request::decode(f)
            {
                if victim.contains(&handle) {
                    assert_eq!(
                        c.status,
                        Status::BadHandle as u8,
                        "another client's handle was accepted: {f:?} -> {c:?}"
                    );
                    victim_frames += 1;
                }
            }
            if c.status == Status::Ok as u8 && c.handle != 0 && c.op != Op::Stats as u8 {
                handles.push(c.handle);
            }
        }

        // B: raw scribbles on its own rings and the doorbell.
        let cursor = |off: u64| shm_u64(&region, off);
        for _ in 0..rng.below(300) {
            scribbles += 1;
            match rng.below(12) {
                0..=3 => {
                    // Frames published on the submission ring.
                    let k = 1 + rng.below(32);
                    let head = cursor(sub + R_HEAD).load(Ordering::Acquire);
                    let tail = cursor(sub + R_TAIL).load(Ordering::Relaxed);
                    if tail >= head && tail - head + k <= cap {
                        for i in 0..k {
                            write_slot(&region, sub, tail + i, &random_frame(&mut rng, &handles));
                        }
                        cursor(sub + R_TAIL).store(tail + k, Ordering::Release);
                        raw_frames += k;
                    }
                }
                4 => {
                    // Consume (discard) the completions.
                    let t = cursor(comp + R_TAIL).load(Ordering::Acquire);
                    cursor(comp + R_HEAD).store(t, Ordering::Release);
                }
                5 => {
                    let w = [0, 1, 2, u32::MAX, rng.next() as u32][rng.below(5) as usize];
                    shm_u32(&region, DOORBELL).store(w, Ordering::Relaxed);
                }
                6 => {
                    shm_u32(&region, comp + R_CONS_WAIT).store(rng.next() as u32 % 3, Ordering::Relaxed);
                    shm_u32(&region, sub + R_PROD_WAIT).store(rng.next() as u32, Ordering::Relaxed);
                }
                7 => write_slot(&region, comp, rng.next(), &random_frame(&mut rng, &handles)),
                8 => {
                    shm_u32(&region, sub + R_CAPACITY).store(rng.next() as u32, Ordering::Relaxed);
                    shm_u32(&region, comp + R_CAPACITY).store(rng.next() as u32, Ordering::Relaxed);
                }
                9 => {
                    // The daemon's own cursors: it never reads them back.
                    let off = if rng.below(2) == 0 { sub + R_HEAD } else { comp + R_TAIL };
                    cursor(off).store(rng.next(), Ordering::Relaxed);
                }
                10 => {
                    // Small jumps of the producer cursor, either way.
                    let tail = cursor(sub + R_TAIL).load(Ordering::Relaxed);
                    cursor(sub + R_TAIL).store(tail.wrapping_add(rng.below(7)).wrapping_sub(3), Ordering::Release);
                }
                _ => std::thread::sleep(Duration::from_micros(rng.below(500))),
            }
            region.doorbell().notify();
        }

        // C: clearly corrupt; then wait for the kick (completions drained so
        // the daemon gets to look at the submission ring).
        let drain_comp = || {
            let t = cursor(comp + R_TAIL).load(Ordering::Acquire);
            cursor(comp + R_HEAD).store(t, Ordering::Release);
        };
        drain_comp();
        let head = cursor(sub + R_HEAD).load(Ordering::Acquire);
        let what = match rng.below(4) {
            0 => {
                cursor(sub + R_TAIL).store(head.wrapping_add(cap + 1 + rng.below(1000)), Ordering::Release);
                "tail_past_capacity"
            }
            1 => {
                cursor(sub + R_TAIL).store(head.wrapping_sub(1 + rng.below(1000)), Ordering::Release);
                "tail_backwards"
            }
            2 => {
                cursor(sub + R_TAIL).store(u64::MAX, Ordering::Release);
                "tail_max"
            }
            _ => {
                shm_u32(&region, sub + R_FLAGS).fetch_or(1, Ordering::Release);
                "closed_flag"
            }
        };
        *how.entry(what).or_default() += 1;
        region.doorbell().notify();
        let t0 = Instant::now();
        loop {
            drain_comp();
            region.doorbell().notify();
            if num(&stats_fast(&socket), "clients_kicked") > kicked0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "hostile: not disconnected 5 s after making its ring corrupt ({what})"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        kick_ms.push(ms(t0.elapsed()));
        // Its next op returns, without hanging: usually Disconnected; it may
        // also read back the garbage it wrote into its own completion ring
        // (nothing is promised to a client about its own scribbles).
        let t = Instant::now();
        let r = kc.ping();
        assert!(t.elapsed() < Duration::from_secs(2), "a kicked client's next op took {:?}", t.elapsed());
        let kind = match r {
            Err(ClientError::Disconnected(_)) => "disconnected",
            Err(ClientError::Protocol(_)) => "protocol_error",
            Ok(()) => "ok",
            Err(_) => "other_error",
        };
        *next_op.entry(kind).or_default() += 1;

        // D: it does not notice and keeps writing its old channel.
        let until = Instant::now() + Duration::from_millis(rng.below(200));
        while Instant::now() < until {
            stale += 1;
            match rng.below(3) {
                0 => write_slot(&region, sub, rng.next(), &random_frame(&mut rng, &handles)),
                1 => cursor(sub + R_TAIL).store(rng.next(), Ordering::Release),
                _ => write_slot(&region, comp, rng.below(cap), &random_frame(&mut rng, &handles)),
            }
            region.doorbell().notify();
            std::thread::sleep(Duration::from_micros(100));
        }
        drop(kc);
    }
    kick_ms.sort_by(f64::total_cmp);
    say(
        "DONE",
        json!({
            "connections": conns, "frames_via_client": via_client, "victim_handle_frames": victim_frames,
            "raw_frames": raw_frames, "scribbles": scribbles, "stale_writes_after_kick": stale,
            "corruption": how, "next_op_after_kick": next_op, "kick_ms_max": kick_ms.last().copied().unwrap_or(0.0),
            "kick_ms_p50": kick_ms.get(kick_ms.len() / 2).copied().unwrap_or(0.0)
        }),
    );
}

/// For `KDB_HOSTILE_SECS` (8 s; 120 in the soak) a hostile process scribbles
/// on its rings' cursors, slots, wait cells and flags and on the doorbell,
/// sends garbage frames and another client's handles, gets disconnected for a
/// clearly corrupt ring, keeps scribbling on its old channel, reconnects, and
/// so on; meanwhile 2 good client processes and a stream of short-lived good
/// clients in this process run verified ops. Every good result is correct,
/// the victim's reservation and pin are untouched, every hostile connection
/// is counted as kicked (and nothing else is), rejects are counted.
#[test]
fn hostile_client_is_contained() {
    let secs = knob("KDB_HOSTILE_SECS", 8, 120);
    let dir = TempDir::new("hostile");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let sock = daemon.socket.clone();
    let victim = Client::connect(&daemon.opts()).expect("connect");
    let rkey = tkey(VICTIM_TAG, 1);
    let mut res = victim.reserve(rkey, DType::U8, &Shape::for_bytes(65_536).expect("shape"), 0).expect("reserve");
    write_block(res.as_mut_slice(), rkey, 0xABC);
    let pkey = tkey(VICTIM_TAG, 2);
    victim.put(pkey, &block_vec(pkey, 0xDEF, 10_000)).expect("put");
    let pin = victim.get(pkey).expect("get").expect("present");
    let handles = format!("{:x},{:x}", res.handle(), pin.handle());

    let mut goods: Vec<Proc> = (0..2).map(|i| spawn_child("good", &sock, &[("KDB_ID", i.to_string())])).collect();
    for g in &mut goods {
        g.expect("READY", Duration::from_secs(30));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (stop, sock) = (stop.clone(), sock.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new(mono_ns());
            let (mut n, mut ops) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let kc = Client::connect(&opts(&sock))
                    .unwrap_or_else(|e| panic!("short-lived good client {n}: connect: {e}"));
                let mut m = Owned::new(CHURN_TAG | n, 16);
                for _ in 0..20 {
                    m.step(&kc, &mut rng)
                        .unwrap_or_else(|e| panic!("short-lived good client {n} (channel {}): {e}", kc.channel()));
                }
                ops += m.ops;
                n += 1;
            }
            (n, ops)
        })
    };
    let hostile = spawn_child(
        "hostile",
        &sock,
        &[
            ("KDB_SECS", secs.to_string()),
            ("KDB_VICTIM_HANDLES", handles),
            ("KDB_PIN_KEY", format!("{:x}", pkey.0)),
            ("KDB_SEED", mono_ns().to_string()),
        ],
    );
    let out = hostile.finish(Duration::from_secs(secs + 120));
    let h: Value = serde_json::from_str(tagged(&out, "DONE").first().expect("hostile DONE")).expect("json");
    stop.store(true, Ordering::Relaxed);
    let (churn_clients, churn_ops) = churn.join().expect("the short-lived good clients saw only correct results");
    let mut good_ops = 0;
    for mut g in goods {
        g.send("stop");
        let out = g.finish(Duration::from_secs(30));
        let d: Value = serde_json::from_str(tagged(&out, "DONE").first().expect("DONE")).expect("json");
        good_ops += d["ops"].as_u64().expect("ops");
    }
    assert!(daemon_alive(&daemon), "the daemon survived the hostile client");

    // The victim's reservation and pin were never touched.
    let v = stats(&sock);
    assert_eq!(num(&v, "pins"), 1, "only the victim's pin is left: {v}");
    assert_eq!(num(&v, "reserved"), 1, "only the victim's reservation is left: {v}");
    res.commit().expect("the victim's reservation still commits");
    drop(pin);
    let got = victim.get(rkey).expect("get").expect("committed");
    assert_eq!(verify(&got, rkey, "victim's block"), 0xABC);
    drop(got);
    drop(victim);

    let conns = h["connections"].as_u64().expect("connections");
    let (v, _) = poll_stats(&sock, Duration::from_secs(5), "everyone gone", |v| {
        num(v, "clients_connected") == 0 && num(v, "pins") == 0 && num(v, "reserved") == 0
    });
    assert_eq!(num(&v, "clients_kicked"), conns, "every hostile connection was kicked, and no good client: {v}");
    assert!(num(&v, "rejected_frames") > 0, "{v}");
    assert!(num(&v, "bad_handle") >= h["victim_handle_frames"].as_u64().expect("n"), "{v}");
    assert_eq!(num(&v, "internal"), 0, "{v}");
    assert!(invariants_ok(&v), "{v}");
    let log = daemon.log();
    assert!(!log.contains("panicked"), "daemon log:\n{log}");
    assert_eq!(log.matches("disconnecting a corrupt client").count() as u64, conns, "one log line per kick");
    figures(
        "hostile_client_is_contained",
        json!({
            "seconds": secs,
            "hostile": h,
            "daemon": {"rejected_frames": num(&v, "rejected_frames"), "bad_handle": num(&v, "bad_handle"),
                       "clients_kicked": num(&v, "clients_kicked"), "invalid": num(&v, "invalid"), "ops": num(&v, "ops")},
            "good_processes_ops": good_ops,
            "short_lived_good_clients": churn_clients,
            "short_lived_good_ops": churn_ops,
            "wrong_results": 0
        }),
    );
}

// ---------------------------------------------------------------------------
// 4. Security
// ---------------------------------------------------------------------------

/// A peer cannot shrink, grow or reseal the region through the fd it received
/// (nor through a fresh open of it): EPERM; the daemon never takes SIGBUS and
/// serves on. Punching holes is *not* prevented by seals (documented in
/// RELIABILITY.md): it zeroes pages, and the daemon still never faults.
#[test]
fn region_cannot_be_resized_or_resealed() {
    use rustix::fs::{fallocate, fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, FallocateFlags, SealFlags};
    use rustix::io::Errno;
    use std::os::fd::AsRawFd;
    let dir = TempDir::new("seals");
    let daemon = Daemon::start(&dir.socket(), "32MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let key = tkey(VICTIM_TAG, 9);
    kc.put(key, &block_vec(key, 7, 100_000)).expect("put");
    let region = kc.region().clone();
    let fd = region.fd();
    let len = region.layout().region_len;
    let seals = fcntl_get_seals(fd).expect("get seals");
    assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL), "seals {seals:?}");
    let reopened = rustix::fs::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(),
        rustix::fs::OFlags::RDWR,
        rustix::fs::Mode::empty(),
    )
    .expect("reopen");
    let mut attempts = Vec::new();
    for (what, r) in [
        ("ftruncate to 0", ftruncate(fd, 0)),
        ("ftruncate by one page less", ftruncate(fd, len - 4096)),
        ("ftruncate by one page more", ftruncate(fd, len + 4096)),
        ("ftruncate to 1 TiB", ftruncate(fd, 1 << 40)),
        ("ftruncate of a fresh open to 0", ftruncate(&reopened, 0)),
        ("fallocate past the end", fallocate(fd, FallocateFlags::empty(), len, 1 << 20)),
        ("add F_SEAL_WRITE", fcntl_add_seals(fd, SealFlags::WRITE)),
        ("add F_SEAL_FUTURE_WRITE", fcntl_add_seals(fd, SealFlags::FUTURE_WRITE)),
    ] {
        assert_eq!(r, Err(Errno::PERM), "{what}");
        attempts.push(what);
    }
    assert_eq!(fstat(fd).expect("fstat").st_size as u64, len, "the size never changed");
    let got = kc.get(key).expect("get").expect("present");
    assert_eq!(verify(&got, key, "after the resize attempts"), 7);
    drop(got);
    // Punch a hole over the whole megaslab: allowed by the seals; the daemon
    // never touches the megaslab and does not fault; data is zeroed.
    let l = *region.layout();
    let punch = fallocate(fd, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, l.slab_offset, l.slab_len);
    let got = kc.get(key).expect("get after a punch").expect("still indexed");
    let zeroed = got.iter().all(|&b| b == 0);
    drop(got);
    kc.put(key, &block_vec(key, 8, 100_000)).expect("put after a punch");
    assert_eq!(verify(&kc.get(key).expect("get").expect("present"), key, "rewritten after a punch"), 8);
    drop(kc);
    let other = Client::connect(&daemon.opts()).expect("a new client after the punch");
    other.ping().expect("ping");
    drop(other);
    assert!(daemon_alive(&daemon), "the daemon is alive (no SIGBUS)");
    let v = stats(&daemon.socket);
    assert!(invariants_ok(&v) && num(&v, "internal") == 0, "{v}");
    figures(
        "region_cannot_be_resized_or_resealed",
        json!({"refused_with_eperm": attempts, "punch_hole": format!("{punch:?}"), "punched_block_read_as_zeros": zeroed, "daemon_sigbus": 0}),
    );
}

/// `pre_exec`: become `uid`/`gid` with supplementary `groups` (in the forked
/// child, before exec; raw syscalls only).
fn drop_privileges(cmd: &mut std::process::Command, uid: u32, gid: u32, groups: &[u32]) {
    use std::os::unix::process::CommandExt;
    let groups: Vec<rustix::process::Gid> = groups.iter().map(|&g| rustix::process::Gid::from_raw(g)).collect();
    let (uid, gid) = (rustix::process::Uid::from_raw(uid), rustix::process::Gid::from_raw(gid));
    // SAFETY: the closure runs in the forked child before exec and makes only
    // async-signal-safe system calls (no allocation: `groups` is built above).
    unsafe {
        cmd.pre_exec(move || {
            rustix::thread::set_thread_groups(&groups)?;
            rustix::thread::set_thread_res_gid(gid, gid, gid)?;
            rustix::thread::set_thread_res_uid(uid, uid, uid)?;
            Ok(())
        });
    }
}

/// Runs as another uid: tries to connect, to get stats, and to reach the
/// region by name through `/proc/<daemon>/fd` and `map_files`.
fn other_uid() {
    let socket = PathBuf::from(env_str(SOCKET_VAR));
    let daemon_pid = env_u64("KDB_DAEMON_PID");
    say("UID", format!("{} {}", rustix::process::getuid().as_raw(), rustix::process::getgid().as_raw()));
    match Client::connect(&opts(&socket)) {
        Ok(kc) => {
            let key = tkey(VICTIM_TAG, 77);
            kc.put(key, &block_vec(key, 5, 5000)).expect("put");
            let v = kc.get(key).expect("get").expect("present");
            assert_eq!(verify(&v, key, "other uid"), 5);
            say("CONNECT", "ok");
        }
        Err(e) => say("CONNECT", format!("err {e}")),
    }
    match kachedb_client::daemon_stats(&opts(&socket)) {
        Ok(_) => say("STATS", "ok"),
        Err(e) => say("STATS", format!("err {e}")),
    }
    // Again and again: every refusal must carry the reason (the daemon answers
    // and closes at once, which races with the client's first write).
    let (mut n, mut clear) = (0, 0);
    for _ in 0..200 {
        for r in [Client::connect(&opts(&socket)).map(drop), kachedb_client::daemon_stats(&opts(&socket)).map(drop)] {
            n += 1;
            match r {
                Ok(()) => clear += 1,
                Err(e) if e.to_string().contains("uid 65534") || e.to_string().contains("ermission denied") => {
                    clear += 1
                }
                Err(e) => say("UNCLEAR", e),
            }
        }
    }
    say("REPEATS", format!("{clear}/{n}"));
    for dir in ["fd", "map_files"] {
        let path = format!("/proc/{daemon_pid}/{dir}");
        match std::fs::read_dir(&path) {
            Ok(_) => say("LIST", format!("{dir} ok")),
            Err(e) => say("LIST", format!("{dir} err {}", e.kind())),
        }
        for n in 0..64 {
            let p = format!("{path}/{n}");
            if std::fs::OpenOptions::new().read(true).write(true).open(&p).is_ok() {
                say("OPENED", p);
            }
        }
    }
    say("SHM", dev_shm_kachedb().len());
}

/// `s` without ANSI colour sequences (the daemon's log has them).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            for d in it.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn run_as_nobody(socket: &Path, daemon_pid: u32, groups: &[u32]) -> String {
    let p = spawn_child_with("other_uid", socket, &[("KDB_DAEMON_PID", daemon_pid.to_string())], |cmd| {
        drop_privileges(cmd, 65534, 65534, groups)
    });
    p.finish(Duration::from_secs(30))
}

fn first(out: &str, tag: &str) -> String {
    tagged(out, tag).first().unwrap_or_else(|| panic!("no KDB {tag} in:\n{out}")).to_string()
}

/// A process of another uid (65534) is refused: by the socket's mode 0600
/// with a clear "permission denied" (daemon default), and by `SO_PEERCRED`
/// with the daemon's own message, logged by the daemon, when the socket's
/// group lets it reach the socket (`--allow-gid` of another group); it is
/// admitted with `--allow-gid 65534`. It cannot reach the region by name
/// (`/proc/<daemon>/fd`, `map_files`) and finds nothing in `/dev/shm`.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs clients as uid 65534 (run as root, as CI does)")]
fn other_uid_is_refused_at_connect() {
    need::root("other_uid_is_refused_at_connect");
    let dir = TempDir::new("uid");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o711)).expect("chmod");

    // A: the default: socket 0600.
    let sa = dir.0.join("a.sock");
    let a = Daemon::start(&sa, "16MiB");
    assert_eq!(std::fs::metadata(&sa).expect("socket").permissions().mode() & 0o777, 0o600);
    let out = run_as_nobody(&sa, a.pid(), &[]);
    assert_eq!(first(&out, "UID"), "65534 65534");
    let ca = first(&out, "CONNECT");
    assert!(ca.starts_with("err ") && ca.contains("ermission denied"), "{ca}");
    assert!(first(&out, "STATS").starts_with("err "), "{out}");
    assert!(tagged(&out, "LIST").iter().all(|l| l.contains(" err ")), "another uid can list the daemon's fds: {out}");
    assert!(tagged(&out, "OPENED").is_empty(), "another uid opened the daemon's fd: {out}");
    assert_eq!(first(&out, "SHM"), "0");
    assert_eq!(num(&stats(&sa), "clients_total"), 0);

    // B: the socket is reachable (group 0, mode 0660) but the peer's uid and
    // gid are not admitted: refused by SO_PEERCRED, with the daemon's message.
    let sb = dir.0.join("b.sock");
    let mut b = Daemon::spawn_with(&sb, "16MiB", &["--allow-gid", "4242"]);
    b.wait_ready();
    assert_eq!(std::fs::metadata(&sb).expect("socket").permissions().mode() & 0o777, 0o660);
    let out = run_as_nobody(&sb, b.pid(), &[0]);
    let cb = first(&out, "CONNECT");
    assert!(cb.starts_with("err ") && cb.contains("uid 65534") && cb.contains("--allow-gid"), "{cb}");
    assert!(first(&out, "STATS").contains("uid 65534"), "{out}");
    assert!(tagged(&out, "UNCLEAR").is_empty(), "refusals without their reason: {out}");
    assert_eq!(first(&out, "REPEATS"), "400/400");
    let t = Instant::now();
    while !b.log().contains("refusing a client of another user") {
        assert!(t.elapsed() < Duration::from_secs(5), "the daemon logs the refusal:\n{}", b.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(num(&stats(&sb), "clients_total"), 0);

    // C: admitted with --allow-gid 65534 (the positive control).
    let sc = dir.0.join("c.sock");
    let mut c = Daemon::spawn_with(&sc, "16MiB", &["--allow-gid", "65534"]);
    c.wait_ready();
    let out = run_as_nobody(&sc, c.pid(), &[0]);
    assert_eq!(first(&out, "CONNECT"), "ok", "{out}");
    assert!(tagged(&out, "OPENED").is_empty(), "{out}");
    b.signal(rustix::process::Signal::TERM);
    b.wait_exit(Duration::from_secs(10));
    let log_b: String = strip_ansi(&b.log()).lines().filter(|l| l.contains("refusing")).collect::<Vec<_>>().join("\n");
    figures(
        "other_uid_is_refused_at_connect",
        json!({"default_0600": ca, "peercred": cb, "daemon_log": log_b, "allow_gid_admits": true, "region_reachable_by_name": false}),
    );
}

/// The socket is 0600 and the directories the daemon creates for it are
/// 0700; a daemon refuses a socket directory another user could write to or
/// owns (someone could swap the socket under it), naming the fix; a sticky
/// world-writable directory like /tmp is fine.
#[test]
fn socket_and_directory_are_private() {
    let dir = TempDir::new("private");
    let sock = dir.0.join("made/by/daemon/s.sock");
    let d = Daemon::start(&sock, "16MiB");
    for p in ["made", "made/by", "made/by/daemon"] {
        let mode = std::fs::metadata(dir.0.join(p)).expect("dir").permissions().mode() & 0o7777;
        assert_eq!(mode, 0o700, "{p}: mode {mode:o}");
    }
    assert_eq!(std::fs::metadata(&sock).expect("socket").permissions().mode() & 0o777, 0o600);
    drop(d);

    let mut refused = Vec::new();
    for (name, mode, owner) in
        [("world-writable", 0o777, None), ("group-writable", 0o770, None), ("foreign", 0o700, Some(65534))]
    {
        let p = dir.0.join(name);
        std::fs::create_dir(&p).expect("mkdir");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        if let Some(uid) = owner {
            if std::os::unix::fs::chown(&p, Some(uid), None).is_err() {
                continue; // not root: cannot make a foreign directory
            }
        }
        let s = p.join("s.sock");
        let mut d = Daemon::spawn(&s, "16MiB");
        let status = d
            .wait_exit(Duration::from_secs(30))
            .unwrap_or_else(|| panic!("{name}: the daemon started in an unsafe directory:\n{}", d.log()));
        let log = d.log();
        assert!(!status.success(), "{name}: must be refused:\n{log}");
        assert!(
            log.contains(&p.display().to_string()) && log.contains("--socket"),
            "{name}: the error names the directory and the fix:\n{log}"
        );
        assert!(!s.exists(), "{name}: no socket was created");
        refused.push(log.lines().find(|l| l.contains("error")).unwrap_or_default().to_string());
    }
    let sticky = dir.0.join("sticky");
    std::fs::create_dir(&sticky).expect("mkdir");
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let d = Daemon::start(&sticky.join("s.sock"), "16MiB");
    Client::connect(&d.opts()).expect("connect").ping().expect("ping");
    figures(
        "socket_and_directory_are_private",
        json!({"created_dirs_mode": "0700", "socket_mode": "0600", "refused": refused}),
    );
}

/// One client cannot commit, abort or release another client's reservation
/// or pin by forging handles (every handle of every kind, index and
/// generation near the live ones, and the exact handles themselves): all
/// BAD_HANDLE; it cannot see the reservation by key either; the victim's
/// reservation commits with its bytes intact and its pin releases.
#[test]
fn forged_handles_cannot_touch_another_clients_reservation() {
    let dir = TempDir::new("forge");
    let daemon = Daemon::start(&dir.socket(), "32MiB");
    let victim = Client::connect(&daemon.opts()).expect("victim");
    let attacker = Client::connect(&daemon.opts()).expect("attacker");
    let rkey = tkey(VICTIM_TAG, 21);
    let mut res = victim.reserve(rkey, DType::U8, &Shape::for_bytes(200_000).expect("shape"), 0).expect("reserve");
    write_block(res.as_mut_slice(), rkey, 0x1234);
    let pkey = tkey(VICTIM_TAG, 22);
    victim.put(pkey, &block_vec(pkey, 0x5678, 3000)).expect("put");
    let pin = victim.get(pkey).expect("get").expect("present");
    let mine = attacker
        .reserve(tkey(VICTIM_TAG, 23), DType::U8, &Shape::for_bytes(100).expect("shape"), 0)
        .expect("attacker's own");
    let before = stats(&daemon.socket);

    let mut forged: Vec<u64> = vec![res.handle(), pin.handle(), 0, u64::MAX];
    for kind in 0..4u64 {
        for index in 0..32u64 {
            for generation in 0..8u64 {
                forged.push(kind << 62 | generation << 32 | index);
            }
        }
    }
    forged.sort_unstable();
    forged.dedup();
    forged.retain(|&h| h != mine.handle());
    let frames: Vec<TensorBlockDescriptor> = forged
        .iter()
        .flat_map(|&h| {
            [Op::Commit, Op::Abort, Op::Release].map(|op| {
                let mut f = TensorBlockDescriptor::request(op, 0, 0);
                f.handle = h;
                f
            })
        })
        .collect();
    let done = attacker.call_raw(&frames).expect("call_raw");
    for (f, c) in frames.iter().zip(&done) {
        assert_eq!(c.status, Status::BadHandle as u8, "forged {:?} {:#x} -> {c:?}", Op::from_code(f.op), f.handle);
    }
    // The reservation is invisible to the attacker by key.
    assert!(attacker.get(rkey).expect("get").is_none(), "a reservation is not readable before commit");
    assert!(!attacker.contains(rkey).expect("lookup"));
    assert!(!attacker.delete(rkey).expect("delete"), "an uncommitted reservation cannot be deleted");
    let after = stats(&daemon.socket);
    assert_eq!(num(&after, "bad_handle") - num(&before, "bad_handle"), frames.len() as u64, "{after}");
    assert_eq!(
        (num(&after, "pins"), num(&after, "reserved")),
        (num(&before, "pins"), num(&before, "reserved")),
        "nothing released or aborted"
    );

    res.commit().expect("the victim's reservation still commits");
    drop(pin);
    mine.abort().expect("the attacker's own reservation is still its own");
    let got = attacker.get(rkey).expect("get").expect("committed now");
    assert_eq!(verify(&got, rkey, "the victim's block"), 0x1234);
    drop(got);
    drop((victim, attacker));
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(3), "clients gone", |v| {
        num(v, "clients_connected") == 0 && num(v, "pins") == 0 && num(v, "reserved") == 0
    });
    assert!(invariants_ok(&v), "{v}");
    figures(
        "forged_handles_cannot_touch_another_clients_reservation",
        json!({"forged_frames": frames.len(), "all_bad_handle": true}),
    );
}

// ---------------------------------------------------------------------------
// 5. Resource limits
// ---------------------------------------------------------------------------

/// A region larger than `MemAvailable` fails at start, exit status 1, with a
/// message naming the limit and `--size`; no socket is left.
#[test]
fn region_larger_than_memory_fails_at_start() {
    let avail_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .expect("meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("MemAvailable");
    let dir = TempDir::new("bigmem");
    let sock = dir.socket();
    let size = format!("{}MiB", avail_kib / 1024 * 2);
    let t = Instant::now();
    let mut d = Daemon::spawn(&sock, &size);
    let status = d.wait_exit(Duration::from_secs(30)).expect("exits");
    let log = d.log();
    assert_eq!(status.code(), Some(1), "an error exit, not a crash or a kill:\n{log}");
    assert!(log.contains("MemAvailable") && log.contains("--size"), "names the limit and the fix:\n{log}");
    assert!(!sock.exists());
    let msg = log.lines().find(|l| l.contains("--size") && l.contains("error")).unwrap_or_default().to_string();
    figures("region_larger_than_memory_fails_at_start", json!({"asked": size, "ms": ms(t.elapsed()), "message": msg}));
}

/// A memory cgroup made for the test (v2, or v1's memory controller); removed on drop.
struct Cgroup {
    dir: PathBuf,
    procs: std::ffi::CString,
}

impl Cgroup {
    /// A child cgroup of ours limited to `limit` bytes, or why none can be made.
    fn new(limit: u64) -> Result<Cgroup, String> {
        static N: AtomicU32 = AtomicU32::new(0);
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        let name = format!("kdbt-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let v1 = own.lines().find_map(|l| {
            let mut it = l.splitn(3, ':');
            let (_, ctrls, path) = (it.next()?, it.next()?, it.next()?);
            ctrls.split(',').any(|c| c == "memory").then(|| path.to_string())
        });
        let (parent, limit_file) = match v1 {
            Some(path) if Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() => {
                (PathBuf::from(format!("/sys/fs/cgroup/memory{path}")), "memory.limit_in_bytes")
            }
            _ => {
                let path = own.lines().find_map(|l| l.strip_prefix("0::")).ok_or("no cgroup v2 path")?;
                let parent = PathBuf::from(format!("/sys/fs/cgroup{path}"));
                let ctl = std::fs::read_to_string(parent.join("cgroup.subtree_control"))
                    .map_err(|e| format!("cgroup v2: {e}"))?;
                if !ctl.split_whitespace().any(|c| c == "memory") {
                    std::fs::write(parent.join("cgroup.subtree_control"), "+memory")
                        .map_err(|e| format!("cgroup v2: enabling memory in {}: {e}", parent.display()))?;
                }
                (parent, "memory.max")
            }
        };
        let dir = parent.join(name);
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let cg = Cgroup {
            procs: std::ffi::CString::new(dir.join("cgroup.procs").into_os_string().into_encoded_bytes())
                .expect("path"),
            dir,
        };
        std::fs::write(cg.dir.join(limit_file), limit.to_string()).map_err(|e| format!("{limit_file}: {e}"))?;
        Ok(cg)
    }

    /// Makes `cmd`'s process join this cgroup before it execs.
    fn enter(&self, cmd: &mut std::process::Command) {
        use std::os::unix::process::CommandExt;
        let procs = self.procs.clone();
        // SAFETY: runs in the forked child before exec; open and write of a
        // prepared C string only (no allocation).
        unsafe {
            cmd.pre_exec(move || {
                let fd = rustix::fs::open(procs.as_c_str(), rustix::fs::OFlags::WRONLY, rustix::fs::Mode::empty())?;
                rustix::io::write(&fd, b"0")?;
                Ok(())
            });
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// In a memory cgroup limited to 256 MiB, a 512 MiB region fails at start
/// with exit status 1 and a message naming the cgroup limit and `--size`
/// (rather than being OOM-killed while reserving the memory); a 64 MiB one
/// starts and serves. Needs root and a memory cgroup controller.
#[test]
#[cfg_attr(not(kdb_memcg), ignore = "needs root and a memory cgroup controller (run as root, as CI does)")]
fn region_larger_than_cgroup_fails_at_start() {
    need::root("region_larger_than_cgroup_fails_at_start");
    let cg = Cgroup::new(256 << 20)
        .unwrap_or_else(|e| panic!("region_larger_than_cgroup_fails_at_start: cannot make a memory cgroup: {e}"));
    let dir = TempDir::new("cgroup");
    let sock = dir.socket();
    let mut cmd = Daemon::command(&sock, "512MiB", &["--headroom", "0"]);
    cg.enter(&mut cmd);
    let mut d = Daemon::launch(cmd, &sock);
    let status = d.wait_exit(Duration::from_secs(60)).expect("exits");
    let log = d.log();
    assert_ne!(
        status.signal(),
        Some(9),
        "the daemon was OOM-killed while reserving memory instead of refusing to start:\n{log}"
    );
    assert_eq!(status.code(), Some(1), "{status}:\n{log}");
    assert!(log.contains("cgroup") && log.contains("--size"), "names the cgroup limit and the fix:\n{log}");
    assert!(!sock.exists());
    let msg = log.lines().find(|l| l.contains("--size") && l.contains("error")).unwrap_or_default().to_string();
    drop(d);
    let mut cmd = Daemon::command(&sock, "64MiB", &["--headroom", "16MiB"]);
    cg.enter(&mut cmd);
    let mut d = Daemon::launch(cmd, &sock);
    d.wait_ready();
    let kc = Client::connect(&d.opts()).expect("connect");
    let key = tkey(VICTIM_TAG, 31);
    kc.put(key, &block_vec(key, 3, 1 << 20)).expect("put");
    assert_eq!(verify(&kc.get(key).expect("get").expect("present"), key, "cgroup daemon"), 3);
    drop(kc);
    d.signal(rustix::process::Signal::TERM);
    d.wait_exit(Duration::from_secs(10)).expect("exit");
    figures(
        "region_larger_than_cgroup_fails_at_start",
        json!({"cgroup": cg.dir.display().to_string(), "limit_mib": 256, "asked_mib": 512, "message": msg, "64mib_in_cgroup_serves": true}),
    );
}

const OOM_TAG: u64 = 0x4F4F_4D00_0000_0000;
const OOM_PINNED: u64 = 8;
const OOM_LEN: usize = 512 * 1024;

/// Puts and pins `OOM_PINNED` blocks, then gets, verifies and counts them in
/// a loop; `mark` prints the count so far; `stop` ends.
fn oom_reader(kc: Client) {
    let mut pins = Vec::new();
    for j in 0..OOM_PINNED {
        let k = tkey(OOM_TAG, j);
        kc.put(k, &block_vec(k, j + 1, OOM_LEN)).expect("put");
        pins.push(kc.get(k).expect("get").expect("present"));
    }
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (count, stop) = (count.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new(mono_ns());
            while !stop.load(Ordering::Relaxed) {
                let j = rng.below(OOM_PINNED);
                let k = tkey(OOM_TAG, j);
                let v = kc
                    .get(k)
                    .unwrap_or_else(|e| panic!("a reader's get failed while the store was full: {e}"))
                    .expect("a pinned block is present");
                assert_eq!(verify(&v, k, "reader during OOM"), j + 1);
                assert_eq!(kc.lookup(&[k]).expect("lookup"), 1);
                count.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(100));
            }
            drop(pins);
        })
    };
    say("READY", "");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        if line == "stop" {
            break;
        }
        say("COUNT", count.load(Ordering::Relaxed));
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("reader thread");
    say("DONE", count.load(Ordering::Relaxed));
}

/// A full store (every free byte reserved by a writer, the rest pinned by a
/// reader) answers OUT_OF_MEMORY to reserve, put and put_many at once (put_many
/// leaves nothing behind), while a reader process keeps getting and verifying
/// its blocks; after the writer lets go, writes succeed again.
#[test]
fn full_store_returns_oom_and_keeps_serving_readers() {
    let dir = TempDir::new("full");
    let daemon = Daemon::start(&dir.socket(), "32MiB");
    let mut reader = spawn_child("oom_reader", &daemon.socket, &[]);
    reader.expect("READY", Duration::from_secs(30));
    let count = |r: &mut Proc| -> u64 {
        r.send("mark");
        r.expect("COUNT", Duration::from_secs(10)).parse().expect("count")
    };
    let writer = Client::connect(&daemon.opts()).expect("writer");
    let shape = Shape::for_bytes(1 << 20).expect("shape");
    let mut held = Vec::new();
    // Reserve (and scribble over) every free byte: 1 MiB pieces, then 64 KiB, then pages.
    for piece in [1u64 << 20, 64 << 10, 4096] {
        let err = loop {
            match writer.reserve(
                tkey(OOM_TAG, 1000 + held.len() as u64),
                DType::U8,
                &Shape::for_bytes(piece).expect("shape"),
                0,
            ) {
                Ok(mut r) => {
                    r.as_mut_slice().fill(0x5A);
                    held.push(r);
                    assert!(held.len() <= 32 * 256, "more reservations than fit in 32 MiB");
                }
                Err(e) => break e,
            }
        };
        assert!(matches!(err, ClientError::OutOfMemory), "{err:?}");
    }
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "bytes_free"), 0, "the store is full: {v}");
    let c0 = count(&mut reader);
    let (mut ooms, mut worst) = (0u64, Duration::ZERO);
    let t_phase = Instant::now();
    while t_phase.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        let k = tkey(OOM_TAG, 5000 + ooms);
        let r = match ooms % 3 {
            0 => writer.reserve(k, DType::U8, &shape, 0).map(drop),
            1 => writer.put(k, &block_vec(k, 1, 300_000)),
            _ => {
                let bufs: Vec<Vec<u8>> = (0..4).map(|i| block_vec(tkey(OOM_TAG, 9000 + i), 1, 400_000)).collect();
                let items: Vec<(Key, &[u8])> =
                    bufs.iter().enumerate().map(|(i, b)| (tkey(OOM_TAG, 9000 + i as u64), b.as_slice())).collect();
                writer.put_many(&items)
            }
        };
        worst = worst.max(t.elapsed());
        assert!(matches!(r, Err(ClientError::OutOfMemory)), "a write into a full store: {r:?}");
        ooms += 1;
    }
    let c1 = count(&mut reader);
    assert!(c1 > c0, "the reader was served while the store was full ({c0} -> {c1})");
    for i in 0..4 {
        assert!(!writer.contains(tkey(OOM_TAG, 9000 + i)).expect("lookup"), "a failed put_many left a block behind");
    }
    let v = stats(&daemon.socket);
    assert!(num(&v, "out_of_memory") >= ooms && invariants_ok(&v), "{v}");
    assert!(num(&v, "pins") >= OOM_PINNED, "the reader's pins held: {v}");
    let n_held = held.len();
    drop(held);
    let k = tkey(OOM_TAG, 7777);
    writer.put(k, &block_vec(k, 9, 4 << 20)).expect("a put succeeds once the writer let go");
    let c2 = count(&mut reader);
    assert!(c2 > c1);
    reader.send("stop");
    let total: u64 = first(&reader.finish(Duration::from_secs(30)), "DONE").parse().expect("n");
    drop(writer);
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(3), "clients gone", |v| {
        num(v, "clients_connected") == 0 && num(v, "pins") == 0 && num(v, "reserved") == 0
    });
    assert!(invariants_ok(&v), "{v}");
    figures(
        "full_store_returns_oom_and_keeps_serving_readers",
        json!({"reservations_1mib_until_full": n_held, "oom_answers": ooms, "oom_max_ms": ms(worst),
               "reader_gets_while_full": c1 - c0, "reader_gets_total": total, "reader_errors": 0}),
    );
}
