//! The batch calls and WAIT against the real `kachedb` daemon binary:
//! `get_prefix`, `reserve_many` / `commit_many` / `abort_many`, `delete_many`,
//! `put_many` of tensors, and `wait_for` across real processes (committed before,
//! during, never). No assertion on timings (deadlines are only upper bounds
//! that a broken WAIT would blow through).
//!
//! Child processes are this test binary run again (`tests/common`), with
//! `KDB_CHILD_ROLE` naming what the child does.

use kachedb_client::{Client, ClientError, DType, Key, Shape, Value};
use std::time::Duration;

mod common;
use common::*;

fn k(name: &str, i: usize) -> Key {
    Key::from_str(&format!("{name}-{i}"))
}

fn pattern(key: Key, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed_of(key));
    v
}

/// Entry point of every child process; a no-op in a normal test run.
#[test]
fn child_process() {
    let Ok(role) = std::env::var(ROLE_VAR) else { return };
    let socket = std::path::PathBuf::from(std::env::var(SOCKET_VAR).expect("socket var"));
    let kc = Client::connect(&opts(&socket)).unwrap_or_else(|e| panic!("child {role}: connect: {e}"));
    match role.as_str() {
        // Waits for "wait-key" (deadline from KDB_TIMEOUT_MS, 0 = none) and reports.
        "waiter" => {
            let ms = env_u64("KDB_TIMEOUT_MS");
            let timeout = (ms > 0).then(|| Duration::from_millis(ms));
            say("WAITING", "");
            match kc.wait_for(Key::from_str("wait-key"), timeout) {
                Ok(v) => {
                    assert_pattern(&v, Key::from_str("wait-key"), 4096, "waited block");
                    say("GOT", checksum(&v));
                }
                Err(ClientError::TimedOut(_)) => say("TIMEDOUT", ""),
                Err(e) => panic!("wait_for: {e}"),
            }
        }
        // Commits "wait-key" when told to.
        "committer" => {
            await_order("commit");
            let key = Key::from_str("wait-key");
            kc.put(key, &pattern(key, 4096)).expect("put");
            say("COMMITTED", "");
        }
        other => panic!("unknown child role {other}"),
    }
}

#[test]
fn get_prefix_pins_the_leading_present_keys() {
    let dir = TempDir::new("prefix");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let keys: Vec<Key> = (0..8).map(|i| k("p", i)).collect();
    for &key in &keys[..5] {
        kc.put(key, &pattern(key, 10_000)).expect("put");
    }
    // Key 6 exists too, past the gap at 5: not part of the prefix.
    kc.put(keys[6], &pattern(keys[6], 10_000)).expect("put");
    let views = kc.get_prefix(&keys).expect("get_prefix");
    assert_eq!(views.len(), 5);
    for (v, &key) in views.iter().zip(&keys) {
        assert_pattern(v, key, 10_000, "prefix view");
    }
    // Exactly the 5 prefix pins are held (the pin of key 6 was released).
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(5), "pins of the prefix", |v| num(v, "pins") == 5);
    assert!(invariants_ok(&v), "{v}");
    // A pinned block survives delete (and eviction) while its view lives.
    assert_eq!(kc.delete_many(&keys[..2]).expect("delete_many"), 2);
    assert_pattern(&views[0], keys[0], 10_000, "view of a deleted block");
    assert_eq!(kc.get_prefix(&keys).expect("get_prefix").len(), 0, "key 0 is gone");
    assert!(kc.get_prefix(&[]).expect("empty").is_empty());
    drop(views);
    poll_stats(&daemon.socket, Duration::from_secs(5), "pins released", |v| num(v, "pins") == 0);
}

#[test]
fn delete_many_counts_the_present_keys() {
    let dir = TempDir::new("delmany");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let keys: Vec<Key> = (0..6).map(|i| k("d", i)).collect();
    for &key in keys.iter().step_by(2) {
        kc.put(key, b"x").expect("put");
    }
    assert_eq!(kc.delete_many(&keys).expect("delete_many"), 3);
    assert_eq!(kc.delete_many(&keys).expect("again"), 0);
    assert_eq!(kc.delete_many(&[]).expect("none"), 0);
    assert_eq!(num(&stats(&daemon.socket), "blocks"), 0);
}

#[test]
fn reserve_many_commits_together_and_is_all_or_nothing() {
    let dir = TempDir::new("resmany");
    let daemon = Daemon::start(&dir.socket(), "16MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let shape = Shape::new(&[16, 1024]).unwrap();
    let items: Vec<_> = (0..4).map(|i| (k("r", i), DType::F32, shape, 0u64)).collect();
    let mut rs = kc.reserve_many(&items).expect("reserve_many");
    assert_eq!(rs.len(), 4);
    for (r, (key, ..)) in rs.iter_mut().zip(&items) {
        assert_eq!((r.len(), r.dtype(), *r.shape()), (64 * 1024, DType::F32, shape));
        fill(r.as_mut_slice(), seed_of(*key));
    }
    assert_eq!(kc.lookup(&[items[0].0]).expect("lookup"), 0, "invisible before commit");
    kc.commit_many(rs).expect("commit_many");
    let keys: Vec<Key> = items.iter().map(|i| i.0).collect();
    for v in kc.get_prefix(&keys).expect("prefix") {
        assert_eq!(v.shape(), &shape);
    }
    assert_eq!(kc.lookup(&keys).expect("lookup"), 4);

    // Abort: nothing visible, nothing left reserved.
    let more: Vec<_> = (10..13).map(|i| (k("r", i), DType::U8, Shape::new(&[100]).unwrap(), 64u64)).collect();
    let rs = kc.reserve_many(&more).expect("reserve_many");
    kc.abort_many(rs).expect("abort_many");
    // Dropping reservations aborts them too.
    drop(kc.reserve_many(&more).expect("reserve_many"));
    let v = stats(&daemon.socket);
    assert_eq!((num(&v, "reserved"), num(&v, "blocks")), (0, 4), "{v}");

    // All or nothing: the third of three 6 MiB blocks cannot fit in 16 MiB with
    // the first two reserved; none stays reserved, nothing is committed.
    let big = Shape::new(&[6 << 20]).unwrap();
    let too_many: Vec<_> = (20..23).map(|i| (k("r", i), DType::U8, big, 0u64)).collect();
    let e = kc.reserve_many(&too_many).expect_err("does not fit");
    assert!(matches!(e, ClientError::OutOfMemory), "{e}");
    let v = stats(&daemon.socket);
    assert_eq!(num(&v, "reserved"), 0, "{v}");
    assert_eq!(kc.lookup(&[too_many[0].0]).expect("lookup"), 0);
    // Bad arguments are refused before anything is sent.
    let e = kc.reserve_many(&[(k("r", 30), DType::U8, big, 65)]).expect_err("bad page offset");
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert!(kc.reserve_many(&[]).expect("empty").is_empty());
    kc.commit_many(Vec::new()).expect("empty commit");
    // put_many of tensors is all or nothing too (one block's length does not match).
    let ok = pattern(k("pm", 0), 100);
    let e = kc
        .put_many(&[
            (k("pm", 0), Value::tensor(DType::U8, Shape::new(&[100]).unwrap(), &ok[..])),
            (k("pm", 1), Value::tensor(DType::F32, Shape::new(&[100]).unwrap(), &ok[..])),
        ])
        .expect_err("length mismatch");
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert_eq!(kc.lookup(&[k("pm", 0)]).expect("lookup"), 0);
    assert!(invariants_ok(&stats(&daemon.socket)));
}

#[test]
fn put_many_of_a_large_batch_copies_every_block() {
    let dir = TempDir::new("putmany");
    let daemon = Daemon::start(&dir.socket(), "256MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    // 600 x 64 KiB = 37.5 MiB: above the parallel-copy threshold.
    let keys: Vec<Key> = (0..600).map(|i| k("pm", i)).collect();
    let data: Vec<Vec<u8>> = keys.iter().map(|&key| pattern(key, 64 << 10)).collect();
    let items: Vec<(Key, &[u8])> = keys.iter().zip(&data).map(|(&key, d)| (key, &d[..])).collect();
    kc.put_many(&items).expect("put_many");
    let views = kc.get_prefix(&keys).expect("prefix");
    assert_eq!(views.len(), 600);
    for (v, &key) in views.iter().zip(&keys) {
        assert_pattern(v, key, 64 << 10, "put_many block");
    }
}

/// Blocks gathered from many ranges and scattered back into others: byte
/// equal, in order; the pins released; uneven or mis-sized ranges refused
/// before anything is reserved; a block of another size ends the prefix.
#[test]
fn put_ranges_and_get_prefix_into_move_ranges_in_order() {
    let dir = TempDir::new("gather");
    let daemon = Daemon::start(&dir.socket(), "256MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    // 40 blocks of 16 ranges of 64 KiB: 40 MiB, above the parallel-copy threshold.
    let (blocks, per, range) = (40usize, 16usize, 64usize << 10);
    let keys: Vec<Key> = (0..blocks).map(|i| k("g", i)).collect();
    let pool = pattern(Key::from_str("pool"), blocks * per * range);
    // Block i's ranges taken from the pool out of order (strided, like a
    // layer-first KV pool's pages): range j of block i at slot j * blocks + i.
    let slot = |i: usize, j: usize| (j * blocks + i) * range;
    let sources: Vec<&[u8]> = (0..blocks)
        .flat_map(|i| (0..per).map(move |j| (i, j)))
        .map(|(i, j)| &pool[slot(i, j)..slot(i, j) + range])
        .collect();
    let shape = Shape::new(&[(per * range) as u64]).expect("shape");
    kc.put_ranges(&keys, DType::U8, &shape, &sources, &[]).expect("put_ranges");
    let views = kc.get_prefix(&keys).expect("prefix");
    assert_eq!(views.len(), blocks);
    for (i, v) in views.iter().enumerate() {
        for j in 0..per {
            assert!(v[j * range..(j + 1) * range] == pool[slot(i, j)..slot(i, j) + range], "block {i} range {j}");
        }
    }
    drop(views);
    // Scattered into a second pool the same way: equal to the first.
    let mut out = vec![0u8; pool.len()];
    let mut dests: Vec<&mut [u8]> = out.chunks_mut(range).collect();
    // chunk c is slot c: reorder to block-major (block i, range j) = chunk j * blocks + i
    let mut by_slot: Vec<Option<&mut [u8]>> = dests.drain(..).map(Some).collect();
    let mut ordered: Vec<&mut [u8]> = (0..blocks)
        .flat_map(|i| (0..per).map(move |j| j * blocks + i))
        .map(|c| by_slot[c].take().expect("once"))
        .collect();
    let n = kc.get_prefix_into(&keys, DType::U8, per * range, &mut ordered).expect("get_prefix_into");
    assert_eq!(n, blocks);
    drop(ordered);
    assert!(out == pool, "scattered bytes differ from the gathered ones");
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(5), "pins released", |v| num(v, "pins") == 0);
    assert!(invariants_ok(&v), "{v}");
    // Refused before anything is reserved: uneven ranges, a short block.
    let before = num(&stats(&daemon.socket), "blocks");
    let e = kc.put_ranges(&[k("x", 0), k("x", 1)], DType::U8, &shape, &sources[..3], &[]).unwrap_err();
    assert!(matches!(e, ClientError::Invalid(ref m) if m.contains("3 byte ranges for 2 blocks")), "{e}");
    let e = kc.put_ranges(&[k("x", 0)], DType::U8, &shape, &sources[..per - 1], &[]).unwrap_err();
    assert!(matches!(e, ClientError::Invalid(ref m) if m.contains("add up to")), "{e}");
    assert_eq!(num(&stats(&daemon.socket), "blocks"), before);
    // A block of another size ends the prefix: only the ones before it are copied.
    let odd = k("g", blocks);
    kc.put(odd, &pattern(odd, 4096)).expect("put");
    let mut small = vec![0u8; 2 * per * range];
    let mut d2: Vec<&mut [u8]> = small.chunks_mut(range).collect();
    let n = kc.get_prefix_into(&[keys[blocks - 1], odd], DType::U8, per * range, &mut d2).expect("scatter");
    assert_eq!(n, 1);
    assert!(small[per * range..].iter().all(|&b| b == 0), "the odd block's ranges were written");
    let (v, _) = poll_stats(&daemon.socket, Duration::from_secs(5), "pins released", |v| num(v, "pins") == 0);
    assert!(invariants_ok(&v), "{v}");
}

#[test]
fn wait_for_a_block_committed_before() {
    let dir = TempDir::new("waitbefore");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let key = Key::from_str("wait-key");
    kc.put(key, &pattern(key, 4096)).expect("put");
    let w = spawn_child("waiter", &daemon.socket, &[("KDB_TIMEOUT_MS", "0".into())]);
    let out = w.finish(Duration::from_secs(60));
    assert_eq!(tagged(&out, "GOT").len(), 1, "{out}");
    // A zero timeout answers at once, present or not.
    assert_pattern(&kc.wait_for(key, Some(Duration::ZERO)).expect("present"), key, 4096, "wait 0");
    let e = kc.wait_for(Key::from_str("absent"), Some(Duration::ZERO)).expect_err("absent");
    assert!(matches!(e, ClientError::TimedOut(_)), "{e}");
}

#[test]
fn wait_for_a_block_committed_during_the_wait_by_another_process() {
    let dir = TempDir::new("waitduring");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let mut w = spawn_child("waiter", &daemon.socket, &[("KDB_TIMEOUT_MS", "0".into())]);
    w.expect("WAITING", Duration::from_secs(30));
    // Let the WAIT reach the daemon and park (if it did not yet, the test still
    // passes, as "committed before").
    std::thread::sleep(Duration::from_millis(300));
    // Another client keeps being served while the WAIT is parked.
    let kc = Client::connect(&daemon.opts()).expect("connect");
    for i in 0..100 {
        kc.put(k("busy", i), b"abc").expect("put while a WAIT is parked");
    }
    assert_eq!(kc.lookup(&(0..100).map(|i| k("busy", i)).collect::<Vec<_>>()).expect("lookup"), 100);
    let mut c = spawn_child("committer", &daemon.socket, &[]);
    c.send("commit");
    c.expect("COMMITTED", Duration::from_secs(30));
    let got = w.expect("GOT", Duration::from_secs(30));
    let key = Key::from_str("wait-key");
    assert_eq!(got, checksum(&pattern(key, 4096)).to_string());
    c.finish(Duration::from_secs(30));
    w.finish(Duration::from_secs(30));
    poll_stats(&daemon.socket, Duration::from_secs(5), "waiter's pin released", |v| num(v, "pins") == 0);
}

#[test]
fn wait_for_a_block_never_committed_times_out_and_a_dead_waiter_is_forgotten() {
    let dir = TempDir::new("waitnever");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let w = spawn_child("waiter", &daemon.socket, &[("KDB_TIMEOUT_MS", "200".into())]);
    let out = w.finish(Duration::from_secs(60));
    assert_eq!(tagged(&out, "TIMEDOUT").len(), 1, "{out}");
    // A waiter killed while parked: the daemon forgets its WAIT; a later commit
    // of the key and other clients are unaffected.
    let mut w = spawn_child("waiter", &daemon.socket, &[("KDB_TIMEOUT_MS", "0".into())]);
    w.expect("WAITING", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(50));
    w.kill9();
    poll_stats(&daemon.socket, Duration::from_secs(10), "killed waiter gone", |v| num(v, "clients_connected") == 0);
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let key = Key::from_str("wait-key");
    kc.put(key, &pattern(key, 4096)).expect("put");
    let v = kc.wait_for(key, Some(Duration::from_secs(5))).expect("present now");
    assert_pattern(&v, key, 4096, "after a dead waiter");
    assert!(invariants_ok(&stats(&daemon.socket)));
}

#[test]
fn chains_name_their_parent_at_commit_and_lose_their_tail_first() {
    for policy in ["chain", "lru"] {
        let dir = TempDir::new(&format!("chain-{policy}"));
        let mut daemon = Daemon::spawn_with(&dir.socket(), "1MiB", &["--eviction", policy]);
        daemon.wait_ready();
        let kc = Client::connect(&daemon.opts()).expect("connect");
        // A chain of 8 one-page blocks (page offset 0: exactly one page each).
        let keys: Vec<Key> = (0..8).map(|i| k("c", i)).collect();
        let shape = Shape::new(&[4096]).unwrap();
        let items: Vec<_> = keys.iter().map(|&key| (key, DType::U8, shape, 0)).collect();
        let parents = kachedb_client::chain_parents(&keys, None);
        assert!(matches!(kc.reserve_many_with_parents(&items, &parents[..3]), Err(ClientError::Invalid(_))));
        let rs = kc.reserve_many_with_parents(&items, &parents).expect("reserve_many");
        assert_eq!(rs[0].parent(), None);
        assert_eq!(rs[7].parent(), Some(keys[6]));
        kc.commit_many(rs).expect("commit_many");
        let v = stats(&daemon.socket);
        assert_eq!(v.get("eviction_policy").and_then(|p| p.as_str()), Some(policy));
        assert_eq!((num(&v, "chained_blocks"), num(&v, "parents_missing")), (7, 0));
        // A put naming an absent parent: committed, the link dropped.
        kc.put(k("lone", 0), Value::bytes(&[1u8; 100]).parent(Some(k("absent", 0)))).expect("put with a parent");
        assert_eq!(num(&stats(&daemon.socket), "parents_missing"), 1);
        // Fill the 256 pages with unrelated chains until 3 blocks were evicted.
        let mut i = 0;
        while num(&stats(&daemon.socket), "evictions") < 3 {
            let pair = [
                (k("f", 2 * i), Value::bytes(&[0u8; 4096])),
                (k("f", 2 * i + 1), Value::bytes(&[0u8; 4096]).parent(Some(k("f", 2 * i)))),
            ];
            kc.put_many(&pair).expect("put a chain");
            i += 1;
            assert!(i < 1000, "never evicted");
        }
        let v = stats(&daemon.socket);
        assert!(invariants_ok(&v), "{v}");
        let present: Vec<bool> = kc.get_many(&keys).expect("get_many").iter().map(Option::is_some).collect();
        if policy == "chain" {
            // Tail first: what is left of the chain is a prefix of it, all reachable.
            assert!(present[0], "{present:?}");
            assert!(present.windows(2).all(|w| w[0] || !w[1]), "a hole: {present:?}");
            assert_eq!(kc.lookup(&keys).expect("lookup"), present.iter().filter(|&&p| p).count());
            assert_eq!(num(&v, "links_cut_by_eviction"), 0);
        } else {
            // The head (least recently used) went first; the rest is unreachable.
            assert!(!present[0] && present[7], "{present:?}");
            assert_eq!(kc.lookup(&keys).expect("lookup"), 0);
            assert!(num(&v, "links_cut_by_eviction") >= 1);
        }
        // A COMMIT frame with an unknown flag bit, or with both COMMIT_HAS_PARENT
        // and COMMIT_NAMES_KEY, is refused.
        let r = kc.reserve(k("raw", 0), DType::U8, &shape, 0).expect("reserve");
        for flags in [4, 3] {
            let mut f = kachedb_shm::Request::Commit { handle: r.handle(), parent: None }.encode(0);
            f.offset = flags;
            let c = kc.call_raw(&[f]).expect("raw commit");
            assert_eq!(c[0].status, kachedb_shm::Status::Invalid as u8, "flags {flags}");
        }
        r.abort().expect("abort");
    }
}

/// The put and get names deprecated by one name per operation
/// (`docs/PROTOCOL.md`, "Operations and their names") still do what they did,
/// through their successors: each one's blocks, bytes, dtypes, shapes and
/// parent links as the daemon records them.
#[test]
#[allow(deprecated)]
fn deprecated_names_forward_to_their_successors() {
    let dir = TempDir::new("deprecated");
    let daemon = Daemon::start(&dir.socket(), "64MiB");
    let kc = Client::connect(&daemon.opts()).expect("connect");
    let b = |key: Key| pattern(key, 4096);
    let shape = Shape::new(&[2, 1024]).expect("shape");
    kc.put_tensor(k("d", 0), DType::F16, &shape, &b(k("d", 0))).expect("put_tensor");
    kc.put_with_parent(k("d", 1), Some(k("d", 0)), &b(k("d", 1))).expect("put_with_parent");
    kc.put_tensor_with_parent(k("d", 2), Some(k("d", 1)), DType::F32, &Shape::new(&[1024]).unwrap(), &b(k("d", 2)))
        .expect("put_tensor_with_parent");
    let (c0, c1) = (b(k("c", 0)), b(k("c", 1)));
    kc.put_chain(&[(k("c", 0), &c0[..]), (k("c", 1), &c1[..])], Some(k("d", 2))).expect("put_chain");
    let t0 = b(k("t", 0));
    kc.put_many_tensors(&[(k("t", 0), DType::I8, Shape::new(&[4096]).unwrap(), &t0[..])]).expect("put_many_tensors");
    let t1 = b(k("t", 1));
    kc.put_many_tensors_with_parents(
        &[(k("t", 1), DType::U8, Shape::new(&[4096]).unwrap(), &t1[..])],
        &[Some(k("t", 0))],
    )
    .expect("put_many_tensors_with_parents");
    let g = b(k("g", 0));
    kc.put_many_gathered(&[k("g", 0)], DType::U8, &Shape::new(&[4096]).unwrap(), &[&g[..2048], &g[2048..]], &[])
        .expect("put_many_gathered");
    let expect = [
        (k("d", 0), DType::F16, vec![2, 1024]),
        (k("d", 1), DType::U8, vec![4096]),
        (k("d", 2), DType::F32, vec![1024]),
        (k("c", 0), DType::U8, vec![4096]),
        (k("c", 1), DType::U8, vec![4096]),
        (k("t", 0), DType::I8, vec![4096]),
        (k("t", 1), DType::U8, vec![4096]),
        (k("g", 0), DType::U8, vec![4096]),
    ];
    for (key, dtype, dims) in &expect {
        let v = kc.get(*key).expect("get").unwrap_or_else(|| panic!("{key:?} missing"));
        assert_eq!((v.dtype(), v.shape().dims()), (*dtype, &dims[..]), "{key:?}");
        assert!(v[..] == b(*key)[..], "{key:?} bytes");
    }
    // Links: d0 <- d1 <- d2 <- c0 <- c1 and t0 <- t1: five blocks name a present parent.
    assert_eq!((num(&stats(&daemon.socket), "chained_blocks"), num(&stats(&daemon.socket), "parents_missing")), (5, 0));
    let mut dest = vec![0u8; 4096];
    let n = kc.get_prefix_scattered(&[k("g", 0)], DType::U8, 4096, &mut [&mut dest[..]]).expect("get_prefix_scattered");
    assert_eq!(n, 1);
    assert!(dest == g);
}
