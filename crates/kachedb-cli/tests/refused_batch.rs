//! A refused request changes nothing (issue 41, item 1), against the real
//! `kachedb serve` binary through the real client's `put_many`: a batch
//! that cannot fit is refused whole, with nothing left reserved and no
//! block evicted — not the batch's own tenant's, not another tenant's. The
//! client sends a batch as reservation units (`docs/PROTOCOL.md`,
//! "Reservation units"); the daemon admits each whole or not at all. No
//! assertion on timings.

use kachedb_client::{Client, ClientError, ConnectOptions, Key};
use serde_json::Value;

mod common;
use common::*;

/// Bytes per block: 16 pages, so a page-aligned source makes an extent of
/// exactly this many bytes.
const BLOCK: usize = 64 << 10;

/// `keys.len()` blocks, block `i` at a page boundary holding the pattern of
/// `keys[i]`: (the buffer, where the first block starts in it).
fn blocks(keys: &[Key]) -> (Vec<u8>, usize) {
    let mut buf = vec![0u8; keys.len() * BLOCK + 4096];
    let start = (4096 - buf.as_ptr() as usize % 4096) % 4096;
    for (i, k) in keys.iter().enumerate() {
        fill(&mut buf[start + i * BLOCK..start + (i + 1) * BLOCK], seed_of(*k));
    }
    (buf, start)
}

/// `put_many` of `keys`, each block's bytes its key's pattern.
fn put_many(kc: &Client, keys: &[Key]) -> Result<(), ClientError> {
    let (buf, start) = blocks(keys);
    let items: Vec<(Key, &[u8])> =
        keys.iter().enumerate().map(|(i, k)| (*k, &buf[start + i * BLOCK..start + (i + 1) * BLOCK])).collect();
    kc.put_many(&items)
}

fn keys(name: &str, n: usize) -> Vec<Key> {
    (0..n).map(|i| Key::from_str(&format!("{name}-{i}"))).collect()
}

fn tenant_opts(d: &Daemon, tenant: &str) -> ConnectOptions {
    ConnectOptions { tenant: Some(tenant.into()), ..d.opts() }
}

fn tenant_blocks(v: &Value, name: &str) -> u64 {
    let rows = v["tenants"].as_array().unwrap_or_else(|| panic!("no tenants in {v}"));
    rows.iter().find(|t| t["name"] == name).map_or(0, |t| t["blocks"].as_u64().expect("blocks"))
}

/// Every key of `keys` is present, with its own bytes.
fn all_there(kc: &Client, keys: &[Key], what: &str) {
    for (i, k) in keys.iter().enumerate() {
        let v = kc.get(*k).expect("get").unwrap_or_else(|| panic!("{what}: block {i} of {} is gone", keys.len()));
        assert_pattern(&v, *k, BLOCK, what);
    }
}

/// The first repro: a tenant at its limit of 16 blocks sends a batch of 17.
/// Each RESERVE used to evict one of the tenant's blocks before the 17th was
/// refused, leaving it none of its 16.
#[test]
fn a_batch_past_the_tenant_limit_costs_the_tenant_nothing() {
    let dir = TempDir::new("refused-limit");
    let mut d = Daemon::spawn_with(&dir.socket(), "16MiB", &["--tenant-limit", "a=1MiB"]);
    d.wait_ready();
    let kc = Client::connect(&tenant_opts(&d, "a")).expect("connect as a");
    let held = keys("held", 16);
    put_many(&kc, &held).expect("16 blocks fit the limit");
    match put_many(&kc, &keys("more", 17)) {
        Err(ClientError::TenantLimit(limit)) => assert_eq!(limit, 1 << 20),
        other => panic!("a batch of 17 blocks past a limit of 16: {other:?}"),
    }
    let v = stats(&d.socket);
    assert!(invariants_ok(&v), "{v}");
    assert_eq!((tenant_blocks(&v, "a"), num(&v, "evictions"), num(&v, "reserved")), (16, 0, 0), "{v}");
    assert_eq!(num(&v, "bytes_used"), 16 * BLOCK as u64, "{v}");
    all_there(&kc, &held, "the tenant's blocks after its refused batch");
    // A batch that fits is admitted, evicting the tenant's own blocks.
    put_many(&kc, &keys("fits", 16)).expect("16 new blocks within the limit");
    let v = stats(&d.socket);
    assert_eq!((tenant_blocks(&v, "a"), num(&v, "evictions")), (16, 16), "{v}");
}

/// The second repro, without limits: tenant `b` fills the megaslab; a batch
/// of tenant `c` one block larger than the megaslab used to evict every one
/// of `b`'s blocks before it was refused, leaving the store empty. The batch
/// is longer than the daemon's 64 frames a pass: the daemon takes the rest
/// of the unit from the ring before it serves it.
#[test]
fn a_batch_larger_than_the_megaslab_costs_another_tenant_nothing() {
    let dir = TempDir::new("refused-room");
    let d = Daemon::start(&dir.socket(), "8MiB");
    let n = (num(&stats(&d.socket), "bytes_total") / BLOCK as u64) as usize;
    assert!(n > 64, "the megaslab holds {n} blocks");
    let b = Client::connect(&tenant_opts(&d, "b")).expect("connect as b");
    let c = Client::connect(&tenant_opts(&d, "c")).expect("connect as c");
    let held = keys("b", n);
    put_many(&b, &held).expect("b fills the megaslab");
    match put_many(&c, &keys("c", n + 1)) {
        Err(ClientError::OutOfMemory) => {}
        other => panic!("a batch larger than the megaslab: {other:?}"),
    }
    let v = stats(&d.socket);
    assert!(invariants_ok(&v), "{v}");
    assert_eq!((num(&v, "blocks"), num(&v, "evictions"), num(&v, "reserved")), (n as u64, 0, 0), "{v}");
    assert_eq!((tenant_blocks(&v, "b"), tenant_blocks(&v, "c")), (n as u64, 0), "{v}");
    all_there(&b, &held, "b's blocks after c's refused batch");
    // A batch as large as the megaslab fits, evicting all of b's.
    put_many(&c, &keys("c", n)).expect("a batch the size of the megaslab");
    assert_eq!(tenant_blocks(&stats(&d.socket), "c"), n as u64);
}

/// A batch longer than the ring is sent in units of the ring's capacity,
/// each admitted whole: a batch that fits the megaslab only by evicting is
/// stored whole, and a unit refused at its last RESERVE (a block larger than
/// the megaslab) after the others evicted changes nothing.
#[test]
fn a_batch_longer_than_the_ring_goes_in_units_of_its_capacity() {
    let dir = TempDir::new("refused-ring");
    let mut d = Daemon::spawn_with(&dir.socket(), "8MiB", &["--ring-capacity", "16"]);
    d.wait_ready();
    let n = (num(&stats(&d.socket), "bytes_total") / BLOCK as u64) as usize;
    let kc = Client::connect(&d.opts()).expect("connect");
    put_many(&kc, &keys("old", 40)).expect("40 blocks");
    let many = keys("many", n);
    put_many(&kc, &many).expect("a megaslab of blocks in units of 16, evicting the 40 before");
    all_there(&kc, &many, "a batch through a ring of 16");
    // One unit: 15 blocks that must evict, then one larger than the megaslab.
    let before = stats(&d.socket);
    let (buf, start) = blocks(&keys("late", 15));
    let huge = vec![2u8; 9 << 20];
    let mut items: Vec<(Key, &[u8])> = keys("late", 15)
        .into_iter()
        .enumerate()
        .map(|(i, k)| (k, &buf[start + i * BLOCK..start + (i + 1) * BLOCK]))
        .collect();
    items.push((Key::from_str("huge"), &huge));
    match kc.put_many(&items) {
        Err(ClientError::TooLarge(_)) => {}
        other => panic!("a unit with a block larger than the megaslab: {other:?}"),
    }
    let v = stats(&d.socket);
    assert!(invariants_ok(&v), "{v}");
    assert_eq!((num(&v, "blocks"), num(&v, "evictions"), num(&v, "reserved")), (n as u64, 40, 0), "{v}");
    assert_eq!(num(&v, "bytes_used"), num(&before, "bytes_used"), "{v}");
    all_there(&kc, &many, "the blocks after a refused unit");
}

/// Raw frames that bend the unit rule are answered, never wait for frames
/// that do not come: a flagged RESERVE followed by another op, or by
/// nothing, is a unit of what was there; a unit with a frame that fails
/// decoding is refused whole as INVALID, reserving nothing; other bits in a
/// RESERVE's `handle` are INVALID.
#[test]
fn units_cut_short_or_malformed_are_answered() {
    use kachedb_client::{DType, Shape};
    use kachedb_shm::{Op, Request, Status, TensorBlockDescriptor, RESERVE_CONTINUES};
    let dir = TempDir::new("refused-raw");
    let d = Daemon::start(&dir.socket(), "8MiB");
    let kc = Client::connect(&d.opts()).expect("connect");
    let reserve = |key: u128, flags: u64| {
        let shape = Shape::new(&[4096]).expect("shape");
        let mut f = Request::reserve(key, DType::U8, shape, 0).expect("reserve").encode(0);
        f.handle = flags;
        f
    };
    let status = |f: &TensorBlockDescriptor| Status::from_code(f.status).expect("a status");
    let get = TensorBlockDescriptor::request(Op::Get, 0, 77);
    // Flagged, then a GET: a unit of one, served; the GET answered NOT_FOUND.
    let done = kc.call_raw(&[reserve(1, RESERVE_CONTINUES), get]).expect("call_raw");
    assert_eq!(done.iter().map(status).collect::<Vec<_>>(), [Status::Ok, Status::NotFound]);
    // Flagged, then nothing: served.
    let done = kc.call_raw(&[reserve(2, RESERVE_CONTINUES)]).expect("call_raw");
    assert_eq!(status(&done[0]), Status::Ok);
    // A unit whose second frame has a bad dtype: both INVALID, nothing reserved.
    let mut bad = reserve(4, 0);
    bad.dtype = 200;
    let done = kc.call_raw(&[reserve(3, RESERVE_CONTINUES), bad]).expect("call_raw");
    assert_eq!(done.iter().map(status).collect::<Vec<_>>(), [Status::Invalid, Status::Invalid]);
    // Another bit in the handle.
    let done = kc.call_raw(&[reserve(5, 2)]).expect("call_raw");
    assert_eq!(status(&done[0]), Status::Invalid);
    let v = stats(&d.socket);
    assert!(invariants_ok(&v), "{v}");
    assert_eq!((num(&v, "reserved"), num(&v, "rejected_frames")), (2, 2), "{v}");
}
