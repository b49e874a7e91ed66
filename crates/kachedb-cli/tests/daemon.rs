//! Integration tests: the real `kachedb` daemon binary and real client processes.
//!
//! Each test starts its own daemon (`kachedb serve --socket <tmp>/s.sock --size …`)
//! and stops it with SIGKILL when the test ends, also when it panics (the
//! [`Daemon`] guard). Client processes are this test binary run again
//! (`current_exe() --exact child_process --nocapture --test-threads=1`) with
//! `KDB_CHILD_ROLE` naming what the child does; a child talks to the test on
//! stdout with lines `KDB <TAG> <text>` and takes orders on stdin. Stats are
//! read with the real `kachedb stats --json --socket …`.
//!
//! Block contents are derived from their key (a seeded pattern), so any process
//! can verify any block it gets; checksums are position-sensitive 64-bit
//! hashes compared across processes.

use kachedb_client::{BlockView, Client, ClientError, ConnectOptions, DType, Key, Shape, Value};
use kachedb_shm::{Op, SpinThenPark, Status, TensorBlockDescriptor};
use std::collections::{BTreeMap, VecDeque};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::*;

const GIB: usize = 1 << 30;

/// The checkers used below do catch corruption (so a passing test means something).
#[test]
fn checkers_detect_corruption() {
    let seed = 42;
    let mut a = pattern_vec(10_007, seed);
    let sum = checksum(&a);
    assert_eq!(first_mismatch(&a, seed), None);
    assert_eq!(first_mismatch(&a, seed + 1), Some(0), "another key's pattern differs");
    for i in [0, 4095, 4096, 9_999, 10_006] {
        a[i] ^= 0x10;
        assert_eq!(first_mismatch(&a, seed), Some(i));
        assert_ne!(checksum(&a), sum, "one flipped bit at {i}");
        a[i] ^= 0x10;
    }
    // Moved data: words swapped within a lane and across lanes, a block shifted.
    for (x, y) in [(0, 32), (0, 8), (64, 4096)] {
        let mut b = a.clone();
        for k in 0..8 {
            b.swap(x + k, y + k);
        }
        assert_ne!(checksum(&b), sum, "words {x} and {y} swapped");
    }
    let mut shifted = a.clone();
    shifted.copy_within(0..4096, 64);
    assert_ne!(checksum(&shifted), sum);
    assert_ne!(checksum(&a[..10_006]), sum, "length counts");
    assert_eq!(checksum(&a), sum);
}

/// Entry point of every child process; a no-op in a normal test run.
#[test]
fn child_process() {
    let Ok(role) = std::env::var(ROLE_VAR) else { return };
    let socket = PathBuf::from(std::env::var(SOCKET_VAR).expect("socket var"));
    let kc = Client::connect(&opts(&socket)).unwrap_or_else(|e| panic!("child {role}: connect: {e}"));
    match role.as_str() {
        "rt_write" => rt_write(&kc, &rt_cases(&std::env::var("KDB_SET").expect("KDB_SET"))),
        "rt_read" => rt_read(&kc, &rt_cases(&std::env::var("KDB_SET").expect("KDB_SET"))),
        "mixer" => mixer(&kc, env_u64("KDB_ID"), env_u64("KDB_OPS")),
        "pinner" => pinner(&kc),
        "flooder" => flooder(&kc),
        "kill_committer" => kill_committer(&kc),
        "kill_victim" => kill_victim(&kc),
        other => panic!("unknown child role {other}"),
    }
}

// ---------------------------------------------------------------------------
// 1. Round trips, 1 byte to 2 GiB
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    Put,
    PutTensor,
    Reserve { page_offset: u64 },
    PutMany,
}

#[derive(Clone, Debug)]
struct RtCase {
    name: String,
    len: usize,
    method: Method,
}

impl RtCase {
    fn key(&self) -> Key {
        Key::from_str(&format!("rt/{}", self.name))
    }
    /// The dtype and shape the block is stored with.
    fn layout(&self) -> (DType, Shape) {
        match self.method {
            Method::Put | Method::PutMany => (DType::U8, Shape::for_bytes(self.len as u64).expect("flat shape")),
            Method::PutTensor | Method::Reserve { .. } => tensor_layout(self.len as u64),
        }
    }
}

/// A typed layout of `len` bytes: the widest dtype that divides it, 2-D when even.
fn tensor_layout(len: u64) -> (DType, Shape) {
    let dtype = [DType::F64, DType::F32, DType::BF16, DType::I8]
        .into_iter()
        .find(|d| len & (d.itemsize() - 1) == 0) // itemsizes are powers of two
        .expect("i8 divides everything");
    let numel = len / dtype.itemsize();
    let shape = if numel & 1 == 0 && numel > 0 { Shape::new(&[2, numel / 2]) } else { Shape::new(&[numel]) };
    (dtype, shape.expect("fits"))
}

fn rt_cases(set: &str) -> Vec<RtCase> {
    match set {
        "small" => {
            let sizes = [1usize, 4095, 4096, 4097, MIB + 3, 64 * MIB];
            let page_offsets = [0u64, 192, 4032, 64, 0, 1024];
            let mut v = Vec::new();
            for (i, &len) in sizes.iter().enumerate() {
                v.push(RtCase { name: format!("put/{len}"), len, method: Method::Put });
                v.push(RtCase { name: format!("tensor/{len}"), len, method: Method::PutTensor });
                v.push(RtCase {
                    name: format!("reserve/{len}"),
                    len,
                    method: Method::Reserve { page_offset: page_offsets[i] },
                });
                if len <= MIB + 3 {
                    v.push(RtCase { name: format!("many/{len}"), len, method: Method::PutMany });
                }
            }
            v
        }
        "2gib" => vec![RtCase { name: "put/2GiB".into(), len: 2 * GIB, method: Method::Put }],
        other => panic!("unknown case set {other}"),
    }
}

fn pattern_vec(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed);
    v
}

fn rt_write(kc: &Client, cases: &[RtCase]) {
    let mut many: Vec<(Key, Vec<u8>, &RtCase)> = Vec::new();
    for c in cases {
        let key = c.key();
        let seed = seed_of(key);
        let t = Instant::now();
        let sum = match c.method {
            Method::Put => {
                let src = pattern_vec(c.len, seed);
                let sum = checksum(&src);
                kc.put(key, &src).unwrap_or_else(|e| panic!("{}: put: {e}", c.name));
                sum
            }
            Method::PutTensor => {
                let src = pattern_vec(c.len, seed);
                let sum = checksum(&src);
                let (dtype, shape) = c.layout();
                kc.put(key, Value::tensor(dtype, shape, &src))
                    .unwrap_or_else(|e| panic!("{}: put of a tensor: {e}", c.name));
                sum
            }
            Method::Reserve { page_offset } => {
                let (dtype, shape) = c.layout();
                let mut r =
                    kc.reserve(key, dtype, &shape, page_offset).unwrap_or_else(|e| panic!("{}: reserve: {e}", c.name));
                assert_eq!(r.len(), c.len, "{}: reservation length", c.name);
                assert_eq!(
                    r.as_mut_ptr() as usize % 4096,
                    page_offset as usize,
                    "{}: page offset not honoured",
                    c.name
                );
                fill(r.as_mut_slice(), seed);
                let sum = checksum(r.as_mut_slice());
                r.commit().unwrap_or_else(|e| panic!("{}: commit: {e}", c.name));
                sum
            }
            Method::PutMany => {
                let src = pattern_vec(c.len, seed);
                many.push((key, src, c));
                continue;
            }
        };
        say("SUM", format!("{} {sum:016x} {:.1}ms", c.name, t.elapsed().as_secs_f64() * 1e3));
    }
    if !many.is_empty() {
        let items: Vec<(Key, &[u8])> = many.iter().map(|(k, v, _)| (*k, v.as_slice())).collect();
        kc.put_many(&items).unwrap_or_else(|e| panic!("put_many: {e}"));
        for (_, v, c) in &many {
            say("SUM", format!("{} {:016x}", c.name, checksum(v)));
        }
    }
    say("WROTE", cases.len());
}

fn rt_read(kc: &Client, cases: &[RtCase]) {
    let keys: Vec<Key> = cases.iter().map(RtCase::key).collect();
    assert_eq!(kc.lookup(&keys).expect("lookup"), cases.len(), "every written block is present");
    let check = |c: &RtCase, view: &BlockView, how: &str| {
        let (dtype, shape) = c.layout();
        assert_eq!(view.dtype(), dtype, "{}: dtype", c.name);
        assert_eq!(view.shape().dims(), shape.dims(), "{}: shape", c.name);
        if let Method::Reserve { page_offset } = c.method {
            assert_eq!(view.offset() % 4096, page_offset, "{}: data offset within its page", c.name);
        }
        assert_pattern(view, c.key(), c.len, &c.name);
        say("SUM", format!("{} {:016x} {how}", c.name, checksum(view)));
    };
    let (batched, single): (Vec<&RtCase>, Vec<&RtCase>) = cases.iter().partition(|c| c.method == Method::PutMany);
    for c in single {
        let t = Instant::now();
        let view = kc.get(c.key()).expect("get").unwrap_or_else(|| panic!("{}: not found", c.name));
        let got = t.elapsed();
        check(c, &view, &format!("get={:.1}us", got.as_secs_f64() * 1e6));
    }
    if !batched.is_empty() {
        let keys: Vec<Key> = batched.iter().map(|c| c.key()).collect();
        let views = kc.get_many(&keys).expect("get_many");
        for (c, v) in batched.iter().zip(&views) {
            check(c, v.as_ref().unwrap_or_else(|| panic!("{}: not found by get_many", c.name)), "get_many");
        }
    }
    say("READ", cases.len());
}

/// Writes `set` in one process, reads it in another; compares checksums.
fn round_trip(set: &str, size: &str) {
    let dir = TempDir::new(&format!("rt-{set}"));
    let t0 = Instant::now();
    let daemon = Daemon::start(&dir.socket(), size);
    let t_start = t0.elapsed();
    let cases = rt_cases(set);
    let t = Instant::now();
    let w = spawn_child("rt_write", &daemon.socket, &[("KDB_SET", set.to_string())]).finish(Duration::from_secs(120));
    let t_write = t.elapsed();
    let t = Instant::now();
    let r = spawn_child("rt_read", &daemon.socket, &[("KDB_SET", set.to_string())]).finish(Duration::from_secs(120));
    let t_read = t.elapsed();
    let sums = |out: &str| -> BTreeMap<String, String> {
        tagged(out, "SUM")
            .into_iter()
            .map(|l| {
                let mut it = l.split_whitespace();
                (it.next().expect("name").to_string(), it.next().expect("sum").to_string())
            })
            .collect()
    };
    let (ws, rs) = (sums(&w), sums(&r));
    assert_eq!(ws.len(), cases.len(), "writer reported every case:\n{w}");
    assert_eq!(ws, rs, "checksums written vs read");
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "blocks"), cases.len() as u64, "{v}");
    assert_eq!(num(&v, "evictions"), 0, "{v}");
    assert!(num(&v, "bytes_used") >= cases.iter().map(|c| c.len as u64).sum::<u64>(), "{v}");
    assert!(invariants_ok(&v), "{v}");
    let (_, _) = poll_stats(&daemon.socket, Duration::from_secs(3), "readers' pins released", |v| {
        num(v, "pins") == 0 && num(v, "clients_connected") == 0
    });
    eprintln!(
        "round trip {set}: {} blocks, daemon start {t_start:.2?}, writer process {t_write:.2?}, reader process {t_read:.2?}\n{}",
        cases.len(),
        tagged(&r, "SUM").join("\n")
    );
}

/// 1 B, 4095, 4096, 4097, 1 MiB + 3 and 64 MiB, each by put, put_tensor and
/// reserve+commit (with page offsets), the small ones also by put_many; read
/// back with get / get_many in another process.
#[test]
fn round_trip_1b_to_64mib_across_processes() {
    round_trip("small", "512MiB");
}

/// One 2 GiB block in a daemon with a 3 GiB megaslab, written by one process and
/// read by another.
#[test]
fn round_trip_2gib_block_in_3gib_daemon() {
    round_trip("2gib", "3GiB");
}

// ---------------------------------------------------------------------------
// 2. Many clients, mixed ops, every result checked
// ---------------------------------------------------------------------------

const MIX_OWN: u64 = 48;
const MIX_SHARED: u64 = 32;

fn mix_own(id: u64, j: u64) -> Key {
    Key::from_str(&format!("mix/own/{id}/{j}"))
}

fn mix_shared(j: u64) -> Key {
    Key::from_str(&format!("mix/shared/{j}"))
}

fn mix_len(k: Key) -> usize {
    const BASE: [usize; 8] = [1, 63, 4095, 4096, 4097, 12288, 40000, 65536];
    BASE[(k.hi() % 8) as usize] + (k.lo() % 13) as usize
}

fn mix_content(k: Key) -> Vec<u8> {
    pattern_vec(mix_len(k), seed_of(k))
}

/// A view of `k` must hold exactly `k`'s content.
fn mix_check(k: Key, v: &BlockView, what: &str) {
    assert!(matches!(v.dtype(), DType::U8 | DType::I8), "{what}: dtype {:?}", v.dtype());
    assert_eq!(v.shape().numel(), Some(mix_len(k) as u64), "{what}: shape {:?}", v.shape());
    assert_pattern(v, k, mix_len(k), what);
}

/// Writes `k` one of four ways; returns whether the key now holds a block.
fn mix_write(kc: &Client, k: Key, how: u64, rng: &mut Rng) -> bool {
    let len = mix_len(k);
    match how {
        0 => kc.put(k, &mix_content(k)).expect("put"),
        1 => kc
            .put(k, Value::tensor(DType::I8, Shape::new(&[len as u64]).expect("shape"), &mix_content(k)))
            .expect("put of a tensor"),
        2 => {
            let mut r = kc
                .reserve(k, DType::U8, &Shape::for_bytes(len as u64).expect("shape"), 64 * rng.below(64))
                .expect("reserve");
            fill(r.as_mut_slice(), seed_of(k));
            r.commit().expect("commit");
        }
        _ => {
            // Reserve, scribble, abort: must leave no trace.
            let mut r = kc.reserve(k, DType::U8, &Shape::for_bytes(len as u64).expect("shape"), 0).expect("reserve");
            r.as_mut_slice().fill(0xEE);
            r.abort().expect("abort");
            return false;
        }
    }
    true
}

fn mixer(kc: &Client, id: u64, ops: u64) {
    say("READY", id);
    await_order("go");
    let mut rng = Rng::new(0x5EED ^ id);
    let mut present = vec![false; MIX_OWN as usize];
    let mut held: VecDeque<(Key, BlockView)> = VecDeque::new();
    let (mut hits, mut misses, mut done) = (0u64, 0u64, 0u64);
    let t = Instant::now();
    for step in 0..ops {
        let r = rng.below(100);
        let j = rng.below(MIX_OWN);
        let own = mix_own(id, j);
        let shared = mix_shared(rng.below(MIX_SHARED));
        let ctx = |what: &str| format!("client {id} step {step} {what}");
        match r {
            0..=17 => {
                let how = rng.below(4);
                if mix_write(kc, own, how, &mut rng) {
                    present[j as usize] = true;
                }
            }
            18..=27 => {
                let how = rng.below(3);
                mix_write(kc, shared, how, &mut rng);
            }
            28..=45 => match kc.get(own).expect("get own") {
                Some(v) => {
                    assert!(present[j as usize], "{}: got a block that should not exist", ctx("get own"));
                    mix_check(own, &v, &ctx("get own"));
                    hits += 1;
                }
                None => {
                    assert!(!present[j as usize], "{}: own block missing", ctx("get own"));
                    misses += 1;
                }
            },
            46..=55 => match kc.get(shared).expect("get shared") {
                Some(v) => {
                    mix_check(shared, &v, &ctx("get shared"));
                    hits += 1;
                }
                None => misses += 1,
            },
            56..=62 => {
                let start = rng.below(MIX_OWN - 5);
                let keys: Vec<Key> = (start..start + 5).map(|x| mix_own(id, x)).collect();
                let want = (start..start + 5).take_while(|&x| present[x as usize]).count();
                assert_eq!(kc.lookup(&keys).expect("lookup"), want, "{}", ctx("lookup chain"));
            }
            63..=69 => {
                assert_eq!(kc.delete(own).expect("delete own"), present[j as usize], "{}", ctx("delete own"));
                present[j as usize] = false;
            }
            70..=72 => {
                kc.delete(shared).expect("delete shared");
            }
            73..=82 => {
                // Duplicates on purpose: one session pinning one block twice.
                let picks: Vec<(Key, Option<u64>)> = (0..6)
                    .map(|_| {
                        if rng.below(2) == 0 {
                            let x = rng.below(MIX_OWN);
                            (mix_own(id, x), Some(x))
                        } else {
                            (mix_shared(rng.below(MIX_SHARED)), None)
                        }
                    })
                    .collect();
                let keys: Vec<Key> = picks.iter().map(|p| p.0).collect();
                let views = kc.get_many(&keys).expect("get_many");
                assert_eq!(views.len(), keys.len());
                for ((k, own_j), v) in picks.iter().zip(&views) {
                    if let Some(x) = own_j {
                        assert_eq!(v.is_some(), present[*x as usize], "{}", ctx("get_many own"));
                    }
                    if let Some(v) = v {
                        mix_check(*k, v, &ctx("get_many"));
                    }
                }
            }
            83..=89 => {
                let mut js: Vec<u64> = (0..4).map(|_| rng.below(MIX_OWN)).collect();
                js.sort_unstable();
                js.dedup();
                let mut keys: Vec<Key> = js.iter().map(|&x| mix_own(id, x)).collect();
                keys.push(shared);
                let contents: Vec<Vec<u8>> = keys.iter().map(|&k| mix_content(k)).collect();
                let items: Vec<(Key, &[u8])> = keys.iter().zip(&contents).map(|(k, c)| (*k, c.as_slice())).collect();
                kc.put_many(&items).expect("put_many");
                for x in js {
                    present[x as usize] = true;
                }
            }
            90..=95 => {
                // Keep a view: its bytes must survive other clients' replaces and deletes.
                if let Some(v) = kc.get(shared).expect("get to hold") {
                    mix_check(shared, &v, &ctx("hold"));
                    held.push_back((shared, v));
                }
                if held.len() > 8 {
                    let (k, v) = held.pop_front().expect("non-empty");
                    mix_check(k, &v, &ctx("held view re-checked"));
                }
            }
            _ => assert_eq!(kc.contains(own).expect("contains"), present[j as usize], "{}", ctx("contains")),
        }
        done += 1;
    }
    for (k, v) in held.drain(..) {
        mix_check(k, &v, "held view at the end");
    }
    let bits: String = present.iter().map(|&p| if p { '1' } else { '0' }).collect();
    say("FINAL", format!("{id} {bits}"));
    say("DONE", format!("{id} ops={done} hits={hits} misses={misses} secs={:.2}", t.elapsed().as_secs_f64()));
}

/// 8 client processes, 6000 mixed ops each (put/put_tensor/reserve+commit/
/// reserve+abort/get/lookup/delete/get_many/put_many/contains) on their own keys
/// and on keys shared by all, with every result checked; then another process
/// checks every key's final state.
#[test]
fn eight_clients_thousands_of_mixed_ops() {
    const CLIENTS: u64 = 8;
    const OPS: u64 = 6000;
    let dir = TempDir::new("mix");
    let daemon = Daemon::start(&dir.socket(), "128MiB");
    let mut procs: Vec<Proc> = (0..CLIENTS)
        .map(|id| spawn_child("mixer", &daemon.socket, &[("KDB_ID", id.to_string()), ("KDB_OPS", OPS.to_string())]))
        .collect();
    for p in &mut procs {
        p.expect("READY", Duration::from_secs(30));
    }
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "clients_connected"), CLIENTS, "{v}");
    let t = Instant::now();
    for p in &mut procs {
        p.send("go");
    }
    let outs: Vec<String> = procs.into_iter().map(|p| p.finish(Duration::from_secs(120))).collect();
    let elapsed = t.elapsed();
    let mut finals = BTreeMap::new();
    for out in &outs {
        for f in tagged(out, "FINAL") {
            let (id, bits) = f.split_once(' ').expect("id bits");
            finals.insert(id.parse::<u64>().expect("id"), bits.to_string());
        }
    }
    assert_eq!(finals.len() as u64, CLIENTS);
    // Another process (this one) checks every own key's final state and bytes.
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let mut present = 0;
    for (id, bits) in &finals {
        for (j, b) in bits.chars().enumerate() {
            let k = mix_own(*id, j as u64);
            let got = kc.get(k).expect("get");
            assert_eq!(got.is_some(), b == '1', "final state of own key {id}/{j}");
            if let Some(v) = got {
                mix_check(k, &v, "final check");
                present += 1;
            }
        }
    }
    for j in 0..MIX_SHARED {
        if let Some(v) = kc.get(mix_shared(j)).expect("get shared") {
            mix_check(mix_shared(j), &v, "final shared check");
        }
    }
    drop(kc);
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(3), "all clients gone", |v| {
        num(v, "clients_connected") == 0 && num(v, "pins") == 0
    });
    assert_eq!(num(&v, "evictions"), 0, "no eviction, so own keys' presence was exact: {v}");
    assert_eq!(num(&v, "reserved"), 0, "{v}");
    assert_eq!(num(&v, "unlinked_blocks"), 0, "{v}");
    assert_eq!(num(&v, "internal"), 0, "{v}");
    assert_eq!(num(&v, "bad_handle"), 0, "{v}");
    assert_eq!(num(&v, "rejected_frames"), 0, "{v}");
    assert!(num(&v, "ops") >= CLIENTS * OPS, "{v}");
    assert!(num(&v, "clients_total") > CLIENTS, "{v}");
    assert!(invariants_ok(&v), "{v}");
    eprintln!(
        "mixed ops: {CLIENTS} processes x {OPS} ops in {elapsed:.2?}; daemon ops {}; {present} own keys present at the end\n{}",
        num(&v, "ops"),
        outs.iter().flat_map(|o| tagged(o, "DONE")).collect::<Vec<_>>().join("\n")
    );
}

// ---------------------------------------------------------------------------
// 3. Eviction never touches a pinned block; OUT_OF_MEMORY, not a hang
// ---------------------------------------------------------------------------

const PIN_BLOCKS: u64 = 6;
const FLOOD_BLOCK: usize = 2 * MIB;
const FLOOD_COUNT: u64 = 256; // 512 MiB through a 64 MiB daemon
const OOM_CHUNK: usize = 4 * MIB;

fn pin_key(j: u64) -> Key {
    Key::from_str(&format!("ev/pin/{j}"))
}

fn pin_len(j: u64) -> usize {
    MIB + 17 * j as usize + 1
}

fn pinner(kc: &Client) {
    let mut views = Vec::new();
    for j in 0..PIN_BLOCKS {
        kc.put(pin_key(j), &pattern_vec(pin_len(j), seed_of(pin_key(j)))).expect("put");
        let v = kc.get(pin_key(j)).expect("get").expect("just put");
        views.push((j, v.offset(), v));
    }
    // A second pin of block 2 by this session (same handle, count 2).
    let extra = kc.get(pin_key(2)).expect("get").expect("present");
    assert_eq!(extra.handle(), views[2].2.handle(), "one session pins one block with one handle");
    say("PINNED", views.iter().map(|(j, off, _)| format!("{j}@{off}")).collect::<Vec<_>>().join(","));
    await_order("verify");
    for (j, off, v) in &views {
        assert_eq!(v.offset(), *off);
        assert_pattern(v, pin_key(*j), pin_len(*j), &format!("pinned view {j} after the flood"));
    }
    assert_pattern(&extra, pin_key(2), pin_len(2), "second pin of block 2");
    // Pinned blocks were never evicted: still findable, at the same place.
    // Block 0 was deleted by the flooder while pinned: gone from the index.
    assert!(kc.get(pin_key(0)).expect("get").is_none(), "a deleted block is not found");
    for j in 1..PIN_BLOCKS {
        let v = kc.get(pin_key(j)).expect("get").unwrap_or_else(|| panic!("pinned block {j} was evicted"));
        assert_eq!(v.offset(), views[j as usize].1, "pinned block {j} moved");
        assert_pattern(&v, pin_key(j), pin_len(j), &format!("pinned block {j} fetched again"));
    }
    say("INTACT", PIN_BLOCKS);
}

fn flooder(kc: &Client) {
    let mut src = vec![0u8; FLOOD_BLOCK];
    for n in 0..FLOOD_COUNT {
        let k = Key::from_str(&format!("ev/flood/{n}"));
        fill(&mut src, seed_of(k));
        kc.put(k, &src).unwrap_or_else(|e| panic!("flood put {n}: {e}"));
        if n % 16 == 0 {
            let v = kc.get(k).expect("get").expect("just put");
            assert_pattern(&v, k, FLOOD_BLOCK, &format!("flood block {n}"));
        }
    }
    assert!(kc.delete(pin_key(0)).expect("delete"), "the pinned block 0 is linked, so delete finds it");
    say("FLOODED", FLOOD_COUNT);
    await_order("reserve");
    // Reserve (and scribble over) everything that can be had.
    let shape = Shape::for_bytes(OOM_CHUNK as u64).expect("shape");
    let mut held = Vec::new();
    let t = Instant::now();
    let err = loop {
        match kc.reserve(Key::from_str(&format!("ev/oom/{}", held.len())), DType::U8, &shape, 0) {
            Ok(mut r) => {
                r.as_mut_slice().fill(0xA5);
                held.push(r);
                assert!(held.len() <= 64 / 4, "more 4 MiB reservations than fit in 64 MiB");
            }
            Err(e) => break e,
        }
    };
    assert!(matches!(err, ClientError::OutOfMemory), "expected OutOfMemory, got {err:?}");
    say("OOM", format!("{} {:.1}ms", held.len(), t.elapsed().as_secs_f64() * 1e3));
    await_order("exit");
    drop(held);
}

/// A 64 MiB daemon; one process pins 6 blocks (one twice) while another writes
/// 512 MiB through it, deletes one pinned block, then reserves 4 MiB extents
/// (scribbling over them) until it gets OUT_OF_MEMORY; the pinned views' bytes,
/// offsets and index entries stay intact throughout.
#[test]
fn eviction_never_touches_pinned_blocks() {
    let dir = TempDir::new("evict");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let mut pinner = spawn_child("pinner", &daemon.socket, &[]);
    pinner.expect("PINNED", Duration::from_secs(30));
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "pins"), PIN_BLOCKS + 1, "{v}");
    let t = Instant::now();
    let mut flooder = spawn_child("flooder", &daemon.socket, &[]);
    flooder.expect("FLOODED", Duration::from_secs(60));
    let t_flood = t.elapsed();
    let v = stats(&daemon.socket);
    assert!(num(&v, "evictions") > 0, "writing 8x the megaslab evicts: {v}");
    assert_eq!(num(&v, "pins"), PIN_BLOCKS + 1, "{v}");
    assert_eq!(num(&v, "unlinked_blocks"), 1, "deleted-but-pinned block 0: {v}");
    assert!(invariants_ok(&v), "{v}");
    let evictions = num(&v, "evictions");
    flooder.send("reserve");
    let oom = flooder.expect("OOM", Duration::from_secs(20));
    let n: u64 = oom.split_whitespace().next().and_then(|s| s.parse().ok()).expect("count");
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "reserved"), n, "{v}");
    assert!(num(&v, "out_of_memory") >= 1, "{v}");
    assert!(
        num(&v, "largest_free_bytes") + num(&v, "evictable_bytes") < OOM_CHUNK as u64,
        "OUT_OF_MEMORY although a 4 MiB extent could be had: {v}"
    );
    assert!(num(&v, "pins") == PIN_BLOCKS + 1 && invariants_ok(&v), "{v}");
    // Verify the pinned bytes while the reservations around them are scribbled on.
    pinner.send("verify");
    pinner.expect("INTACT", Duration::from_secs(20));
    flooder.send("exit");
    flooder.finish(Duration::from_secs(20));
    pinner.finish(Duration::from_secs(20));
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(3), "pins and reservations released", |v| {
        num(v, "pins") == 0 && num(v, "reserved") == 0 && num(v, "clients_connected") == 0
    });
    assert_eq!(num(&v, "unlinked_blocks"), 0, "block 0 freed with its last pin: {v}");
    assert!(invariants_ok(&v), "{v}");
    eprintln!(
        "eviction: flood of {} MiB in {t_flood:.2?}, {evictions} evictions, OOM after {oom} (n reservations, time)",
        FLOOD_COUNT as usize * FLOOD_BLOCK / MIB
    );
}

// ---------------------------------------------------------------------------
// 4. A client killed with SIGKILL leaves nothing behind
// ---------------------------------------------------------------------------

fn kill_key(j: u64) -> Key {
    Key::from_str(&format!("kill/committed/{j}"))
}

fn kill_len(j: u64) -> usize {
    [5000, 3 * MIB + 7, 4096, 1][j as usize]
}

fn kill_committer(kc: &Client) {
    for j in 0..4 {
        kc.put(kill_key(j), &pattern_vec(kill_len(j), seed_of(kill_key(j)))).expect("put");
    }
    say("COMMITTED", 4);
}

fn kill_victim(kc: &Client) {
    let mut views = Vec::new();
    for j in [0, 0, 1, 2, 3] {
        let v = kc.get(kill_key(j)).expect("get").expect("committed");
        assert_pattern(&v, kill_key(j), kill_len(j), "victim's view");
        views.push(v);
    }
    let len = 8 * MIB;
    let mut r = kc
        .reserve(Key::from_str("kill/reserved/0"), DType::U8, &Shape::for_bytes(len as u64).expect("shape"), 0)
        .expect("reserve");
    fill(&mut r.as_mut_slice()[..len / 2], 7);
    let r2 = kc
        .reserve(Key::from_str("kill/reserved/1"), DType::F16, &Shape::new(&[512, 1024]).expect("shape"), 128)
        .expect("reserve");
    say("HOLDING", format!("channel={} pins={} reservations=2", kc.channel(), views.len()));
    std::thread::sleep(Duration::from_secs(600));
    drop((views, r, r2));
}

/// A client holding 5 pins (one block twice) and two reservations (one half
/// written) is SIGKILLed: the daemon releases its pins, aborts its reservations
/// and recycles its channel at once; every frame the victim held is free again.
#[test]
fn sigkilled_client_leaves_no_pins_or_reservations() {
    let dir = TempDir::new("kill");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    spawn_child("kill_committer", &daemon.socket, &[]).finish(Duration::from_secs(30));
    let (base, _) =
        poll_stats(&daemon.socket, Duration::from_secs(3), "committer gone", |v| num(v, "clients_connected") == 0);
    assert_eq!(num(&base, "blocks"), 4, "{base}");
    let committed_bytes = num(&base, "bytes_used");
    assert!(committed_bytes >= (0..4).map(|j| kill_len(j) as u64).sum::<u64>(), "{base}");

    let mut victim = spawn_child("kill_victim", &daemon.socket, &[]);
    let holding = victim.expect("HOLDING", Duration::from_secs(30));
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "pins"), 5, "{v}");
    assert_eq!(num(&v, "reserved"), 2, "{v}");
    assert_eq!(num(&v, "clients_connected"), 1, "{v}");
    assert!(num(&v, "bytes_used") >= committed_bytes + 8 * MIB as u64 + MIB as u64, "{v}");
    let t = Instant::now();
    let status = victim.kill9();
    assert!(!status.success(), "the victim was killed: {status}");
    let (v, detach) =
        poll_stats(&daemon.socket, Duration::from_secs(3), "the killed client's pins and reservations released", |v| {
            num(v, "pins") == 0
                && num(v, "reserved") == 0
                && num(v, "clients_connected") == 0
                && num(v, "bytes_used") == committed_bytes
        });
    let since_kill = t.elapsed();
    assert!(invariants_ok(&v), "{v}");
    assert_eq!(num(&v, "blocks"), 4, "{v}");
    assert_eq!(num(&v, "unlinked_blocks"), 0, "{v}");
    assert_eq!(num(&v, "internal"), 0, "{v}");

    // The daemon serves on; the half-written reservation never became visible.
    let kc = Client::connect(&daemon.opts()).expect("connect after the kill");
    assert!(kc.get(Key::from_str("kill/reserved/0")).expect("get").is_none(), "an aborted reservation is not visible");
    assert!(kc.get(Key::from_str("kill/reserved/1")).expect("get").is_none());
    for j in 0..4 {
        let v = kc.get(kill_key(j)).expect("get").expect("committed block survives");
        assert_pattern(&v, kill_key(j), kill_len(j), "committed block after the kill");
    }
    // Every frame free: delete the committed blocks, the megaslab is one free extent.
    for j in 0..4 {
        assert!(kc.delete(kill_key(j)).expect("delete"));
    }
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "bytes_used"), 0, "{v}");
    assert_eq!(num(&v, "bytes_free"), num(&v, "bytes_total"), "{v}");
    assert_eq!(num(&v, "free_extents"), 1, "{v}");
    assert!(invariants_ok(&v), "{v}");
    eprintln!(
        "sigkill: victim {holding}; clean stats {detach:.2?} after the first poll ({since_kill:.2?} after SIGKILL)"
    );
}

// ---------------------------------------------------------------------------
// 5. Malformed frames
// ---------------------------------------------------------------------------

fn frame(op: u8) -> TensorBlockDescriptor {
    let mut f = TensorBlockDescriptor::request(Op::Ping, 0, 0x1234_5678_9abc_def0_u128 << 3);
    f.op = op;
    f
}

fn reserve_frame(dtype: u8, ndim: u8, shape: [u32; 6], offset: u64) -> TensorBlockDescriptor {
    let mut f = frame(Op::Reserve as u8);
    f.dtype = dtype;
    f.ndim = ndim;
    f.shape = shape;
    f.offset = offset;
    f
}

fn with_handle(op: Op, handle: u64) -> TensorBlockDescriptor {
    let mut f = frame(op as u8);
    f.handle = handle;
    f
}

fn raw1(kc: &Client, f: TensorBlockDescriptor) -> TensorBlockDescriptor {
    let mut v = kc.call_raw(&[f]).expect("call_raw");
    assert_eq!(v.len(), 1);
    v.pop().expect("one completion")
}

/// Malformed frames (decode failures) get INVALID and are counted in
/// `rejected_frames`; forged, foreign and stale handles get BAD_HANDLE; a
/// storm of random frames is survived; the daemon serves on.
#[test]
fn malformed_frames_get_error_status_and_daemon_serves_on() {
    let dir = TempDir::new("malformed");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let other = Client::connect(&daemon.opts()).expect("connect a second client");
    let u8c = DType::U8 as u8;
    let f64c = DType::F64 as u8;
    let invalid: Vec<(&str, TensorBlockDescriptor)> = vec![
        ("unknown op 0", frame(0)),
        ("unknown op 12 (one past the last)", frame(12)),
        ("unknown op 255", frame(255)),
        ("non-zero status in a request", {
            let mut f = frame(Op::Get as u8);
            f.status = Status::Ok as u8 + 3;
            f
        }),
        ("dtype 0", reserve_frame(0, 1, [16, 0, 0, 0, 0, 0], 0)),
        ("dtype 99", reserve_frame(99, 1, [16, 0, 0, 0, 0, 0], 0)),
        ("ndim 7", reserve_frame(u8c, 7, [1; 6], 0)),
        ("ndim 255", reserve_frame(u8c, 255, [1; 6], 0)),
        ("unused dim non-zero", reserve_frame(u8c, 1, [16, 0, 0, 5, 0, 0], 0)),
        ("unused last dim non-zero", reserve_frame(u8c, 0, [0, 0, 0, 0, 0, 1], 0)),
        ("overflowing shape", reserve_frame(f64c, 6, [u32::MAX; 6], 0)),
        ("overflowing itemsize", reserve_frame(f64c, 3, [u32::MAX, u32::MAX, 1 << 30, 0, 0, 0], 0)),
        ("page offset not a multiple of 64", reserve_frame(u8c, 1, [16, 0, 0, 0, 0, 0], 65)),
        ("page offset 4096", reserve_frame(u8c, 1, [16, 0, 0, 0, 0, 0], 4096)),
        ("page offset u64::MAX", reserve_frame(u8c, 1, [16, 0, 0, 0, 0, 0], u64::MAX)),
    ];
    let n_invalid = invalid.len() as u64;
    // One at a time, then all in one batch.
    for (what, f) in &invalid {
        let c = raw1(&kc, *f);
        assert_eq!(c.status, Status::Invalid as u8, "{what}: {c:?}");
    }
    let batch: Vec<TensorBlockDescriptor> = invalid.iter().map(|x| x.1).collect();
    let done = kc.call_raw(&batch).expect("call_raw batch");
    assert_eq!(done.len(), batch.len());
    for ((what, _), c) in invalid.iter().zip(&done) {
        assert_eq!(c.status, Status::Invalid as u8, "{what} (batched): {c:?}");
    }
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "rejected_frames"), 2 * n_invalid, "{v}");

    // Well-formed but refused: too large.
    let c = raw1(&kc, reserve_frame(u8c, 2, [1 << 20, 1 << 10, 0, 0, 0, 0], 0));
    assert_eq!(c.status, Status::TooLarge as u8, "1 GiB in a 64 MiB daemon: {c:?}");

    // Forged handles.
    let forged: Vec<u64> =
        vec![0, 1, 0xdead_beef, u64::MAX, 1 << 62, (1 << 62) | 999_999, (2 << 62) | 12345, (3 << 62) | 1];
    let mut n_bad = 0u64;
    for &h in &forged {
        for op in [Op::Commit, Op::Abort, Op::Release] {
            let c = raw1(&kc, with_handle(op, h));
            assert_eq!(c.status, Status::BadHandle as u8, "{op:?} of forged handle {h:#x}: {c:?}");
            n_bad += 1;
        }
    }
    // Stale reservation handle: committed, then used again.
    let mut good = reserve_frame(u8c, 1, [100, 0, 0, 0, 0, 0], 0);
    good.set_key(77);
    let c = raw1(&kc, good);
    assert_eq!(c.status, Status::Ok as u8, "{c:?}");
    let h = c.handle;
    assert_eq!(raw1(&kc, with_handle(Op::Commit, h)).status, Status::Ok as u8);
    for op in [Op::Commit, Op::Abort, Op::Release] {
        let c = raw1(&kc, with_handle(op, h));
        assert_eq!(c.status, Status::BadHandle as u8, "{op:?} of a committed reservation's handle: {c:?}");
        n_bad += 1;
    }
    // Stale pin handle: released, then used again; a pin handle is no reservation.
    let mut get = frame(Op::Get as u8);
    get.set_key(77);
    let c = raw1(&kc, get);
    assert_eq!(c.status, Status::Ok as u8, "{c:?}");
    let p = c.handle;
    assert_eq!(raw1(&kc, with_handle(Op::Release, p)).status, Status::Ok as u8);
    for op in [Op::Release, Op::Commit, Op::Abort] {
        let c = raw1(&kc, with_handle(op, p));
        assert_eq!(c.status, Status::BadHandle as u8, "{op:?} of a released pin: {c:?}");
        n_bad += 1;
    }
    // Another client's handles.
    let mut theirs = reserve_frame(u8c, 1, [100, 0, 0, 0, 0, 0], 0);
    theirs.set_key(78);
    let rh = raw1(&other, theirs).handle;
    let ph = raw1(&other, get).handle;
    for (op, h) in [(Op::Commit, rh), (Op::Abort, rh), (Op::Release, ph)] {
        let c = raw1(&kc, with_handle(op, h));
        assert_eq!(c.status, Status::BadHandle as u8, "{op:?} of another client's handle: {c:?}");
        n_bad += 1;
    }
    assert_eq!(raw1(&other, with_handle(Op::Commit, rh)).status, Status::Ok as u8, "the owner still commits");
    assert_eq!(raw1(&other, with_handle(Op::Release, ph)).status, Status::Ok as u8, "the owner still releases");
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "bad_handle"), n_bad, "{v}");
    assert_eq!(num(&v, "rejected_frames"), 2 * n_invalid, "handle errors are not decode errors: {v}");

    // A storm of random frames, in batches larger than the ring.
    let mut rng = Rng::new(0xBAD);
    let storm: Vec<TensorBlockDescriptor> = (0..3000)
        .map(|_| {
            let mut b = [0u8; 64];
            for chunk in b.chunks_mut(8) {
                chunk.copy_from_slice(&rng.next().to_le_bytes());
            }
            let mut f = TensorBlockDescriptor::from_bytes(&b);
            // Mostly plausible headers, so frames get past the first checks.
            if rng.below(4) != 0 {
                f.status = 0;
                f.op = rng.below(12) as u8;
                f.dtype = rng.below(14) as u8;
                f.ndim = rng.below(8) as u8;
                for d in f.shape.iter_mut() {
                    *d %= 1 << rng.below(20);
                }
                f.offset = if rng.below(2) == 0 { rng.below(4096) & !63 } else { f.offset };
            }
            if f.op == Op::Wait as u8 && f.status == 0 {
                // A WAIT's `handle` is its timeout: a random one would (rightly)
                // park this channel for ages. Time 0: answered at once.
                f.handle = 0;
            }
            f
        })
        .collect();
    let done = kc.call_raw(&storm).expect("the storm gets answers");
    assert_eq!(done.len(), storm.len());
    for c in &done {
        assert!(Status::from_code(c.status).is_some(), "completion with an unknown status: {c:?}");
    }
    let v = stats(&daemon.socket);
    assert!(num(&v, "rejected_frames") > 2 * n_invalid, "{v}");
    assert!(invariants_ok(&v), "{v}");
    drop(kc);

    // It keeps serving, a fresh client and the old one alike.
    let kc = Client::connect(&daemon.opts()).expect("connect after the storm");
    for c in [&kc, &other] {
        let key = Key::from_str("after/malformed");
        let data = pattern_vec(10_000, seed_of(key));
        c.put(key, &data).expect("put after malformed frames");
        let got = c.get(key).expect("get").expect("present");
        assert_pattern(&got, key, data.len(), "block after malformed frames");
    }
    drop((kc, other));
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(3), "clients gone", |v| {
        num(v, "clients_connected") == 0 && num(v, "pins") == 0 && num(v, "reserved") == 0
    });
    assert!(invariants_ok(&v), "{v}");
    assert_eq!(num(&v, "clients_kicked"), 0, "no client was kicked: {v}");
    eprintln!(
        "malformed: {} rejected frames, {} bad handles; daemon serving",
        num(&v, "rejected_frames"),
        num(&v, "bad_handle")
    );
}

// ---------------------------------------------------------------------------
// 6. Start-up: too large, already running, stale socket after SIGKILL
// ---------------------------------------------------------------------------

/// `--size 100TiB` exits non-zero naming `--size`, leaving no socket; a second
/// daemon on a served socket is refused ("already serves") and the first serves
/// on; a SIGKILLed daemon's socket is reclaimed by the next one, which serves a
/// fresh (empty) region.
#[test]
fn startup_refusals_and_stale_socket_reclaim() {
    let dir = TempDir::new("startup");
    let sock = dir.socket();

    // Too large.
    let t = Instant::now();
    let mut big = Daemon::spawn(&sock, "100TiB");
    let status =
        big.wait_exit(Duration::from_secs(30)).unwrap_or_else(|| panic!("--size 100TiB did not exit:\n{}", big.log()));
    let log = big.log();
    assert!(!status.success(), "--size 100TiB must fail:\n{log}");
    assert!(log.contains("--size"), "the error names the fix (--size):\n{log}");
    assert!(!sock.exists(), "no socket file is left behind");
    let t_big = t.elapsed();
    drop(big);

    // Already running.
    let mut first = Daemon::start(&sock, "64MiB");
    let kc = Client::connect(&first.opts()).expect("connect");
    let key = Key::from_str("startup/k");
    kc.put(key, b"first daemon").expect("put");
    let mut second = Daemon::spawn(&sock, "64MiB");
    let status = second
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("the second daemon did not exit:\n{}", second.log()));
    let log2 = second.log();
    assert!(!status.success(), "a second daemon on the same socket must fail:\n{log2}");
    assert!(log2.contains("already serves"), "clear error:\n{log2}");
    assert!(log2.contains(&sock.display().to_string()), "the error names the socket:\n{log2}");
    assert!(sock.exists(), "the refused daemon left the first one's socket alone");
    let v = kc.get(key).expect("the first daemon still serves").expect("present");
    assert_eq!(&*v, b"first daemon");
    drop(v);
    let kc2 = Client::connect(&first.opts()).expect("new clients still connect to the first daemon");
    kc2.ping().expect("ping");
    drop((kc, kc2));

    // SIGKILL: the socket file stays behind, stale.
    first.signal(rustix::process::Signal::KILL);
    first.wait_exit(Duration::from_secs(10)).expect("killed");
    assert!(sock.exists(), "a SIGKILLed daemon cannot remove its socket");
    match Client::connect(&opts(&sock)) {
        Err(ClientError::Disconnected(msg)) => assert!(msg.contains("kachedb serve"), "says how to fix: {msg}"),
        other => panic!("connecting to a dead daemon's socket: {other:?}"),
    }
    drop(first);
    let t = Instant::now();
    let restarted = Daemon::start(&sock, "64MiB");
    let t_restart = t.elapsed();
    let kc = Client::connect(&restarted.opts()).expect("connect to the restarted daemon");
    assert!(kc.get(key).expect("get").is_none(), "the new daemon serves a fresh region, nothing stale");
    kc.put(key, b"second daemon").expect("put");
    assert_eq!(&*kc.get(key).expect("get").expect("present"), b"second daemon");
    let v = stats(&sock);
    assert_eq!(num(&v, "daemon_pid"), u64::from(restarted.pid()), "{v}");
    eprintln!(
        "startup: 100TiB refused in {t_big:.2?}; restart on a stale socket ready in {t_restart:.2?}\n{}",
        log.trim()
    );
}

// ---------------------------------------------------------------------------
// 7. Daemon death and SIGTERM
// ---------------------------------------------------------------------------

/// A client blocked in an op when the daemon dies gets `Disconnected` within
/// 1 s (with the default wait policy and with a spin-only one), and so does its
/// next op; dropping views and reservations of a dead
/// daemon takes no time (41 views + 1 reservation within 1 s).
#[test]
fn client_blocked_when_daemon_dies_gets_disconnected() {
    let dir = TempDir::new("death");
    let mut daemon = Daemon::start(&dir.socket(), "64MiB");
    let kc = Arc::new(Client::connect(&daemon.opts()).expect("connect"));
    let key = Key::from_str("death/k");
    kc.put(key, &[1, 2, 3]).expect("put");
    let view = kc.get(key).expect("get").expect("present");
    // More live pins and a reservation: dropping them after the daemon died must not
    // wait on the dead daemon one by one.
    let more: Vec<Key> = (0..40).map(|i| Key::from_str(&format!("death/more/{i}"))).collect();
    for k in &more {
        kc.put(*k, &[7; 100]).expect("put");
    }
    let views: Vec<BlockView> = more.iter().map(|k| kc.get(*k).expect("get").expect("present")).collect();
    let resv =
        kc.reserve(Key::from_str("death/r"), DType::U8, &Shape::for_bytes(4096).expect("shape"), 0).expect("reserve");
    // Freeze the daemon so the next op blocks, then kill it.
    // Two blocked clients: the default wait policy (spin, then park), and one that
    // never parks (`SpinThenPark::spin_only`, a public option).
    let spinner = Arc::new(
        Client::connect(&ConnectOptions { wait: SpinThenPark::spin_only(), ..daemon.opts() })
            .expect("connect spin-only"),
    );
    spinner.ping().expect("ping");
    daemon.signal(rustix::process::Signal::STOP);
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let blocked: Vec<_> = [kc.clone(), spinner.clone()]
        .into_iter()
        .map(|c| {
            let killed = killed_at.clone();
            std::thread::spawn(move || {
                let r = c.lookup(&[key]);
                let after_kill = killed.lock().expect("lock").map(|t| t.elapsed());
                (r, after_kill)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert!(blocked.iter().all(|t| !t.is_finished()), "an op completed although the daemon is stopped");
    *killed_at.lock().expect("lock") = Some(Instant::now());
    daemon.signal(rustix::process::Signal::KILL);
    let mut after_kills = Vec::new();
    for (t, policy) in blocked.into_iter().zip(["default", "spin-only"]) {
        let deadline = Instant::now() + Duration::from_secs(3);
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        // A hung thread is left behind (the process exits at the end of the run).
        assert!(t.is_finished(), "{policy} client still blocked 3 s after the daemon was killed");
        let (r, after_kill) = t.join().expect("join");
        let after_kill = after_kill.expect("returned after the kill");
        assert!(matches!(r, Err(ClientError::Disconnected(_))), "{policy} client's blocked op: {r:?}");
        assert!(after_kill < Duration::from_secs(1), "{policy} client: Disconnected took {after_kill:?}");
        after_kills.push(after_kill);
    }
    let after_kill = after_kills[0];
    let spin_after_kill = after_kills[1];
    daemon.wait_exit(Duration::from_secs(10)).expect("the daemon died");
    let t = Instant::now();
    let r = kc.get(key);
    let next_op = t.elapsed();
    assert!(matches!(r, Err(ClientError::Disconnected(_))), "next op: {r:?}");
    assert!(next_op < Duration::from_secs(1), "next op took {next_op:?}");
    let t = Instant::now();
    assert_eq!(&*view, &[1, 2, 3], "a view's mapping outlives the daemon");
    drop(view);
    drop(views);
    drop(resv);
    let drop_views = t.elapsed();
    assert!(drop_views < Duration::from_secs(1), "dropping 41 views and a reservation took {drop_views:?}");
    eprintln!("daemon death: blocked op Disconnected {after_kill:.2?} after SIGKILL (spin-only client {spin_after_kill:.2?}); next op {next_op:.2?}; 41 views + 1 reservation dropped in {drop_views:.2?}");
}

/// SIGTERM: the daemon exits 0 and removes its socket (and lock), even with a
/// client connected and holding a pin; that client then gets `Disconnected`.
#[test]
fn sigterm_exits_zero_and_removes_socket() {
    let dir = TempDir::new("term");
    let sock = dir.socket();
    let mut daemon = Daemon::start(&sock, "64MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let key = Key::from_str("term/k");
    kc.put(key, &[9; 100]).expect("put");
    let view = kc.get(key).expect("get").expect("present");
    let t = Instant::now();
    daemon.signal(rustix::process::Signal::TERM);
    let status =
        daemon.wait_exit(Duration::from_secs(10)).unwrap_or_else(|| panic!("no exit after SIGTERM:\n{}", daemon.log()));
    let t_exit = t.elapsed();
    assert_eq!(status.code(), Some(0), "SIGTERM exits 0:\n{}", daemon.log());
    assert!(!sock.exists(), "the socket file is removed");
    assert!(!PathBuf::from(format!("{}.lock", sock.display())).exists(), "the lock file is removed");
    let t = Instant::now();
    let r = kc.lookup(&[key]);
    assert!(matches!(r, Err(ClientError::Disconnected(_))), "op after shutdown: {r:?}");
    assert!(t.elapsed() < Duration::from_secs(1));
    drop(view);
    eprintln!("sigterm: exit 0 in {t_exit:.2?}");
}

// ---------------------------------------------------------------------------
// Beyond the list: channel exhaustion, a client that corrupts its ring
// ---------------------------------------------------------------------------

/// With `--channels 2`, a third client is refused with a message naming the fix,
/// and admitted once a channel is recycled.
#[test]
fn channels_exhausted_then_recycled() {
    let dir = TempDir::new("channels");
    let mut daemon = Daemon::spawn_with(&dir.socket(), "64MiB", &["--channels", "2"]);
    daemon.wait_ready();
    let a = Client::connect(&daemon.opts()).expect("first");
    let b = Client::connect(&daemon.opts()).expect("second");
    match Client::connect(&daemon.opts()) {
        Err(ClientError::Disconnected(msg)) => {
            assert!(msg.contains("channels are in use") && msg.contains("--channels"), "{msg}")
        }
        other => panic!("a third client with 2 channels: {other:?}"),
    }
    drop(a);
    let t = Instant::now();
    let c = loop {
        match Client::connect(&daemon.opts()) {
            Ok(c) => break c,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(2), "channel not recycled: {e}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let key = Key::from_str("channels/k");
    c.put(key, &[5; 5000]).expect("put on a recycled channel");
    assert_eq!(&*b.get(key).expect("get").expect("present"), &[5; 5000][..]);
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "clients_connected"), 2, "{v}");
    assert!(invariants_ok(&v), "{v}");
}

/// A client whose submission ring cursor is garbage is disconnected by the
/// daemon (which does not panic); its pin and reservation are dropped, its next
/// op gets `Disconnected`, and other clients are served on.
#[test]
fn client_with_corrupt_ring_is_kicked_and_others_served() {
    let dir = TempDir::new("corrupt");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let honest = Client::connect(&daemon.opts()).expect("connect");
    let key = Key::from_str("corrupt/k");
    let data = pattern_vec(70_000, seed_of(key));
    honest.put(key, &data).expect("put");
    let evil = Client::connect(&daemon.opts()).expect("connect");
    let view = evil.get(key).expect("get").expect("present");
    let resv = evil
        .reserve(Key::from_str("corrupt/r"), DType::U8, &Shape::for_bytes(MIB as u64).expect("shape"), 0)
        .expect("reserve");
    let v = stats(&daemon.socket);
    assert!(num(&v, "pins") == 1 && num(&v, "reserved") == 1, "{v}");
    // Line 1 of the submission ring's header holds the producer cursor
    // (docs/PROTOCOL.md); move it far past the consumer's.
    let (sub, _) = evil.region().layout().ring_offsets(evil.channel()).expect("channel in range");
    let p = evil.region().base().wrapping_add(sub as usize + 64).cast::<u64>();
    // SAFETY: `p` is 8-byte aligned (ring headers are 64-byte aligned) and inside
    // the shared mapping, which `evil` keeps mapped; the cursor is only ever
    // accessed atomically, by this process and the daemon.
    let tail = unsafe { AtomicU64::from_ptr(p) };
    tail.store(1 << 40, Ordering::SeqCst);
    evil.region().doorbell().notify();
    let (v, t_kick) = poll_stats(&daemon.socket, Duration::from_secs(3), "corrupt client kicked and cleaned up", |v| {
        num(v, "clients_kicked") == 1
            && num(v, "clients_connected") == 1
            && num(v, "pins") == 0
            && num(v, "reserved") == 0
    });
    assert!(invariants_ok(&v), "{v}");
    let t = Instant::now();
    let r = evil.lookup(&[key]);
    assert!(matches!(r, Err(ClientError::Disconnected(_))), "the kicked client's next op: {r:?}");
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_pattern(&view, key, data.len(), "a kicked client's view still maps the bytes");
    drop((resv, view, evil));
    let got = honest.get(key).expect("the honest client is served on").expect("present");
    assert_pattern(&got, key, data.len(), "block after the kick");
    let fresh = Client::connect(&daemon.opts()).expect("new clients are admitted");
    fresh.put(Key::from_str("corrupt/after"), &[1; 10]).expect("put");
    let v = stats(&daemon.socket);
    assert!(invariants_ok(&v) && num(&v, "internal") == 0, "{v}");
    eprintln!("corrupt ring: kicked and cleaned up within {t_kick:.2?}");
}

// ---------------------------------------------------------------------------
// 8. Same-uid authentication
// ---------------------------------------------------------------------------

/// A client of the daemon's own uid is admitted (SO_PEERCRED) and gets a
/// channel; the socket is private (0600).
#[test]
fn same_uid_client_is_admitted() {
    let dir = TempDir::new("auth");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let mode = std::fs::metadata(&daemon.socket).expect("socket metadata").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    let kc = Client::connect(&daemon.opts()).expect("same-uid connect");
    kc.ping().expect("ping");
    let v = serde_json::to_value(kc.stats().expect("stats over the control socket")).expect("stats as JSON");
    assert_eq!(num(&v, "clients_connected"), 1, "{v}");
    assert_eq!(num(&v, "sessions"), 1, "{v}");
    let t = Instant::now();
    while !daemon.log().contains("client connected") {
        assert!(t.elapsed() < Duration::from_secs(5), "the daemon logs the connection:\n{}", daemon.log());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `$KACHEDB_SOCKET` has one rule everywhere (`naming::default_socket_path`):
/// it names instance 0's socket, and no other instance's. The daemon, `kachedb
/// stats` and the Rust client agree on both instances; before, `serve` and
/// `stats` applied it to every instance while the clients applied it to
/// instance 0 only, so `KACHEDB_SOCKET=/x kachedb serve --instance 1` served
/// on `/x` where `connect(instance=1)` never looked.
#[test]
fn kachedb_socket_names_instance_0_for_every_binary_and_client() {
    let dir = TempDir::new("socket-rule");
    let xdg = dir.0.join("run");
    std::fs::create_dir_all(&xdg).unwrap();
    std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o700)).unwrap();
    let env_socket = dir.0.join("env.sock");
    let serve = |instance: u32| {
        let mut cmd = std::process::Command::new(daemon_bin());
        cmd.args(["serve", "--size", "64MiB", "--instance", &instance.to_string()])
            .env("XDG_RUNTIME_DIR", &xdg)
            .env("KACHEDB_SOCKET", &env_socket)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd
    };
    let stats_of = |instance: u32| -> serde_json::Value {
        let out = std::process::Command::new(BIN)
            .args(["stats", "--json", "--instance", &instance.to_string()])
            .env("XDG_RUNTIME_DIR", &xdg)
            .env("KACHEDB_SOCKET", &env_socket)
            .output()
            .expect("kachedb stats");
        assert!(out.status.success(), "kachedb stats --instance {instance}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("stats JSON")
    };
    let instance1 = xdg.join("kachedb").join("kachedb_1.sock");
    let mut one = Daemon::launch(serve(1), &instance1);
    one.wait_ready();
    assert!(!env_socket.exists(), "instance 1 must not serve on $KACHEDB_SOCKET");
    let mut zero = Daemon::launch(serve(0), &env_socket);
    zero.wait_ready();
    assert!(!xdg.join("kachedb").join("kachedb_0.sock").exists(), "instance 0 serves on $KACHEDB_SOCKET");
    // Each instance's stats, found by instance number alone, come from its own daemon.
    let (s0, s1) = (stats_of(0), stats_of(1));
    assert_eq!(s0["socket"].as_str(), Some(env_socket.to_str().unwrap()), "{s0}");
    assert_eq!(s1["socket"].as_str(), Some(instance1.to_str().unwrap()), "{s1}");
    zero.signal(rustix::process::Signal::TERM);
    one.signal(rustix::process::Signal::TERM);
    assert!(zero.wait_exit(Duration::from_secs(20)).is_some_and(|s| s.success()), "{}", zero.log());
    assert!(one.wait_exit(Duration::from_secs(20)).is_some_and(|s| s.success()), "{}", one.log());
}

/// META (docs/PROTOCOL.md, "META and block metadata") against the real
/// daemon: a record that does not decode, lies outside its scratch block or
/// names what is not this client's open reservation is refused (INVALID,
/// BAD_HANDLE) and leaves the reservation as it was (it commits); a good one
/// is taken; the client refuses a record out of bounds before sending.
#[test]
fn meta_frames_bad_records_are_refused_and_change_nothing() {
    use kachedb_shm::BlockMeta;
    let dir = TempDir::new("meta");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let other = Client::connect(&daemon.opts()).expect("connect a second client");
    let shape = Shape::new(&[4096]).unwrap();
    let block = kc.reserve(Key(5), DType::U8, &shape, 0).expect("reserve the block");
    let mut scratch = kc.reserve(Key(0), DType::U8, &shape, 0).expect("reserve the scratch");
    let foreign = other.reserve(Key(6), DType::U8, &shape, 0).expect("another client's reservation");
    let good = BlockMeta { block_hash: 9, block_size: 2, token_ids: vec![4, 5], ..BlockMeta::default() };
    let mut rec = Vec::new();
    good.encode(&mut rec).unwrap();
    let n = rec.len();
    scratch.as_mut_slice()[..n].copy_from_slice(&rec);
    scratch.as_mut_slice()[n] = 2; // a second copy with version 2
    scratch.as_mut_slice()[n + 1..2 * n].copy_from_slice(&rec[1..]);
    let meta = |handle: u64, scratch: u64, offset: u64, len: u64| {
        let mut f = frame(Op::Meta as u8);
        f.handle = handle;
        f.key_lo = scratch;
        f.key_hi = len;
        f.offset = offset;
        f
    };
    let (b, s) = (block.handle(), scratch.handle());
    let cases = [
        ("a length below the header", meta(b, s, 0, 8), Status::Invalid),
        ("a length past MAX_META_LEN", meta(b, s, 0, 1 << 20), Status::Invalid),
        ("a record of version 2", meta(b, s, n as u64, n as u64), Status::Invalid),
        ("a record cut short", meta(b, s, 0, n as u64 - 1), Status::Invalid),
        ("a record past the scratch's end", meta(b, s, 4096 - 8, n as u64), Status::Invalid),
        ("the block as its own scratch", meta(b, b, 0, n as u64), Status::Invalid),
        ("another client's reservation", meta(foreign.handle(), s, 0, n as u64), Status::BadHandle),
        ("another client's scratch", meta(b, foreign.handle(), 0, n as u64), Status::BadHandle),
        ("a forged handle", meta(0xdead_beef, s, 0, n as u64), Status::BadHandle),
        ("a good record", meta(b, s, 0, n as u64), Status::Ok),
    ];
    for (what, f, want) in cases {
        let c = raw1(&kc, f);
        assert_eq!(c.status, want as u8, "{what}: {c:?}");
    }
    // Out of bounds: refused by the client before anything is sent.
    let too_many = BlockMeta { token_ids: vec![1; 3], ..good.clone() };
    let e = kc.attach_meta(std::slice::from_ref(&block), &[Some(too_many)]).unwrap_err();
    assert!(matches!(&e, ClientError::Invalid(m) if m.contains("token ids")), "{e}");
    let e = kc.attach_meta(std::slice::from_ref(&block), &[]).unwrap_err();
    assert!(matches!(&e, ClientError::Invalid(_)), "{e}");
    // Through the client: one scratch and one META per record.
    kc.attach_meta(std::slice::from_ref(&block), &[Some(good)]).expect("attach");
    scratch.abort().expect("abort the scratch");
    block.commit().expect("the block commits after the refusals");
    foreign.abort().expect("abort");
    assert!(kc.contains(Key(5)).unwrap());
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "blocks"), 1, "{v}");
    assert_eq!(num(&v, "reserved"), 0, "{v}");
}
