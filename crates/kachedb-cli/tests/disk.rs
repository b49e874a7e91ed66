//! The disk tier (`kachedb serve --disk DIR --disk-size SIZE`, docs/disk.md)
//! with real daemon processes and real files: crashes (`kill -9`) at random
//! points of a write stream, the directory lock, chains across tiers, and
//! faults on file systems the test makes (a size-limited tmpfs, a
//! loop-mounted ext4 image; those need root: `cargo test` lists them as
//! ignored, with the reason, without it).
//!
//! `KACHEDB_DISK_KILLS=N` sets the number of kills of the crash test
//! (default 200; `KACHEDB_SOAK=1`: 1000).

mod common;

use common::disk::*;
use common::*;
use kachedb_client::{Client, ConnectOptions, Key};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Kills the daemon at random points of a stream of writes (`kill -9`,
/// hundreds of times, one directory throughout) and restarts it on the same
/// directory each time: every block the daemon had reported on disk before
/// the kill is found again at the restart (`disk_recovered` ≥ the
/// `disk_blocks` read just before the kill), only unfinished writes are
/// thrown away (the torn files at start are exactly the temporary files the
/// kill left), and every block served is the one put, byte for byte.
#[test]
fn crash_at_random_points_of_a_write_stream_loses_nothing_reported_written() {
    let kills = std::env::var("KACHEDB_DISK_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if std::env::var_os("KACHEDB_SOAK").is_some() { 1000 } else { 200 });
    let tmp = TempDir::new("disk-crash");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let mut rng = Rng::new(0x26);
    // Every key put and acknowledged, with its length.
    let mut put: Vec<(Key, usize)> = Vec::new();
    let mut reported_before_kill = 0u64;
    let (mut total_written, mut total_torn, mut total_checked) = (0u64, 0u64, 0u64);
    for round in 0..=kills {
        let tmp_files = unfinished_writes(&disk);
        // The normal class: the writes this test counts must not wait for
        // an idle core (other suites may run beside it).
        let d = disk_daemon(&tmp, "16MiB", &disk, "4GiB", &["--disk-worker-class", "normal"]);
        let s = indexed(&socket);
        let (recovered, torn) = (num(&s, "disk_recovered"), num(&s, "disk_torn"));
        assert!(
            recovered >= reported_before_kill,
            "round {round}: {recovered} blocks recovered, but {reported_before_kill} were reported on disk before the kill"
        );
        assert_eq!(torn, tmp_files as u64, "round {round}: torn blocks other than the unfinished writes the kill left");
        assert_eq!(unfinished_writes(&disk), 0, "round {round}: unfinished writes not cleaned up");
        total_torn += torn;
        // A sample of what was ever put (all of it in the last round): absent, or the very bytes.
        let c = Client::connect(&d.opts()).expect("connect");
        let sample: Vec<(Key, usize)> = if round == kills {
            put.clone()
        } else {
            (0..put.len().min(24)).map(|_| put[rng.below(put.len() as u64) as usize]).collect()
        };
        let mut present = 0u64;
        for &(key, len) in &sample {
            if let Some(v) = c.get(key).expect("get") {
                assert_pattern(&v, key, len, &format!("round {round}, a block filled from disk"));
                present += 1;
            }
        }
        total_checked += sample.len() as u64;
        if round == kills {
            // Every block on disk is one the test put (and was found above).
            assert_eq!(present, recovered, "blocks on disk vs blocks put and found");
            assert_eq!(num(&stats_fast(&socket), "disk_torn"), torn, "a block refused at fill time");
            break;
        }
        // A stream of writes (chains of 4 KiB … 128 KiB blocks) from a client
        // thread, and a kill -9 at a random moment of it.
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let writer = {
            let (stop, acked, opts) = (stop.clone(), acked.clone(), d.opts());
            let mut r = Rng::new(round as u64 + 1);
            std::thread::spawn(move || {
                let Ok(c) = Client::connect(&opts) else { return };
                let mut parent = None;
                for j in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let key = tkey(round as u64 + 1, j);
                    let len = 4096 * (1 + r.below(32) as usize) - r.below(64) as usize;
                    if c.put(key, kachedb_client::Value::bytes(&pattern(key, len)).parent(parent)).is_err() {
                        break;
                    }
                    acked.lock().unwrap().push((key, len));
                    parent = Some(key);
                }
            })
        };
        std::thread::sleep(Duration::from_micros(2000 + rng.below(60_000)));
        reported_before_kill = num(&stats_fast(&socket), "disk_blocks");
        total_written += num(&stats_fast(&socket), "disk_writes");
        d.signal(rustix::process::Signal::KILL);
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("writer thread");
        drop(d);
        put.extend(acked.lock().unwrap().drain(..));
    }
    say(
        "disk-crash",
        format!(
            "{kills} kills; {} blocks put, {total_written} reported written, {total_torn} unfinished writes thrown away, {total_checked} reads checked: 0 wrong bytes, 0 reported blocks lost",
            put.len()
        ),
    );
    assert!(total_written > kills as u64, "too few writes completed to mean anything ({total_written})");
}

/// A second daemon on a directory in use is refused with an error naming
/// the first one's pid; the first keeps serving.
#[test]
fn a_second_daemon_on_the_same_disk_dir_is_refused_naming_the_first_ones_pid() {
    let (a, b) = (TempDir::new("disk-lock-a"), TempDir::new("disk-lock-b"));
    let disk = a.0.join("disk");
    let first = disk_daemon(&a, "8MiB", &disk, "64MiB", &[]);
    let mut second =
        Daemon::spawn_with(&b.socket(), "8MiB", &["--disk", disk.to_str().unwrap(), "--disk-size", "64MiB"]);
    let status = second.wait_exit(Duration::from_secs(30)).expect("the second daemon exits");
    assert!(!status.success());
    let log = second.log();
    assert!(
        log.contains("in use by another kachedb daemon") && log.contains(&format!("pid {}", first.pid())),
        "the refusal does not name the first daemon's pid {}:\n{log}",
        first.pid()
    );
    assert_eq!(num(&stats_fast(&a.socket()), "disk_capacity_bytes"), 64 << 20);
    // --disk without --disk-size, and the reverse, are refused.
    for args in [&["--disk", "/nonexistent-kdb"][..], &["--disk-size", "1GiB"][..]] {
        let mut d = Daemon::spawn_with(&b.socket(), "8MiB", args);
        assert!(!d.wait_exit(Duration::from_secs(30)).expect("exits").success(), "{args:?} accepted");
        assert!(d.log().contains("--disk"), "{args:?}: {}", d.log());
    }
}

/// Chains hold on every tier: blocks evicted from the megaslab come back
/// from disk with their parents (a LOOKUP of the chain reads it whole, the
/// links are made again), and the disk evicts leaves first: after many
/// chains were written through a disk too small for them, a restarted
/// daemon finds of each chain a leading run and nothing behind a hole.
#[test]
fn chains_come_back_from_disk_whole_and_the_disk_evicts_leaves_first() {
    let tmp = TempDir::new("disk-chain");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    // 12 chains of 8 blocks of 64 KiB (+4 KiB header each on disk): 6.4 MiB
    // through a 2.5 MiB disk.
    let chains: Vec<Vec<Key>> = (0..12).map(|c| (0..8).map(|j| tkey(100 + c, j)).collect()).collect();
    let len = 64 << 10;
    {
        let d = disk_daemon(&tmp, "8MiB", &disk, "2560KiB", &["--disk-queue-bytes", "1MiB"]);
        indexed(&socket);
        let c = Client::connect(&d.opts()).expect("connect");
        for chain in &chains {
            let mut parent = None;
            for &k in chain {
                c.put(k, kachedb_client::Value::bytes(&pattern(k, len)).parent(parent)).expect("put");
                parent = Some(k);
                // One block at a time to disk, so that none is dropped.
                drained(&socket);
            }
        }
        let s = stats_fast(&socket);
        assert_eq!(num(&s, "disk_dropped_writes"), 0);
        assert!(num(&s, "disk_evictions") > 0, "the disk never had to evict: {s}");
        assert!(num(&s, "disk_bytes") <= 2560 << 10);
        d.signal(rustix::process::Signal::KILL);
    }
    let d = disk_daemon(&tmp, "64MiB", &disk, "2560KiB", &[]);
    indexed(&socket);
    let c = Client::connect(&d.opts()).expect("connect");
    let mut whole = 0;
    for (n, chain) in chains.iter().enumerate() {
        // Which blocks of the chain are on disk, each asked alone.
        let on_disk: Vec<bool> = chain.iter().map(|&k| block_file(&disk, k).exists()).collect();
        let lead = on_disk.iter().take_while(|&&p| p).count();
        assert!(on_disk[lead..].iter().all(|&p| !p), "chain {n}: a block on disk behind a hole: {on_disk:?}");
        // A LOOKUP of the chain (RAM empty) fills the leading run from disk
        // in one fetch and counts it whole.
        assert_eq!(c.lookup(chain).expect("lookup"), lead, "chain {n}");
        let views = c.get_prefix(chain).expect("get_prefix");
        assert_eq!(views.len(), lead);
        for (v, &k) in views.iter().zip(chain) {
            assert_pattern(v, k, len, &format!("chain {n}"));
        }
        whole += usize::from(lead == chain.len());
    }
    assert!(whole >= 2, "the last chains written should be whole on disk");
    let s = stats_fast(&socket);
    // Every block filled named its parent, and each parent was local by then.
    assert_eq!(num(&s, "parents_missing"), 0, "a parent link lost on the way: {s}");
    assert!(invariants_ok(&s));
}

/// A block file corrupted or truncated under the daemon is refused, never
/// served: truncated before a start (found by the index rebuild), a payload
/// byte flipped while it runs (found by the fill's checksum); both deleted,
/// counted in `disk_torn`; a whole block next to them is served.
#[test]
fn a_corrupted_or_truncated_block_file_is_a_miss_never_wrong_bytes() {
    let tmp = TempDir::new("disk-corrupt");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let keys: Vec<Key> = (0..3).map(|j| tkey(7, j)).collect();
    let len = 100_000;
    {
        let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &[]);
        indexed(&socket);
        let c = Client::connect(&d.opts()).expect("connect");
        for &k in &keys {
            c.put(k, &pattern(k, len)).expect("put");
        }
        assert_eq!(num(&drained(&socket), "disk_writes"), 3);
        d.signal(rustix::process::Signal::KILL);
    }
    // Truncated: the last 10 bytes gone (and the catalog, so that the start
    // reads the headers; with it, the fill finds the file short:
    // disk_trust.rs, the catalog's test).
    let f = std::fs::OpenOptions::new().write(true).open(block_file(&disk, keys[0])).unwrap();
    f.set_len(f.metadata().unwrap().len() - 10).unwrap();
    drop(f);
    forget_catalog(&disk);
    let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &[]);
    let s = indexed(&socket);
    assert_eq!((num(&s, "disk_recovered"), num(&s, "disk_torn")), (2, 1), "{s}");
    assert!(!block_file(&disk, keys[0]).exists(), "the truncated file was not deleted");
    // A payload byte flipped under the running daemon.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(block_file(&disk, keys[1])).unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, 4096 + 5000).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], 4096 + 5000).unwrap();
    }
    let c = Client::connect(&d.opts()).expect("connect");
    assert!(c.get(keys[0]).expect("get").is_none());
    assert!(c.get(keys[1]).expect("get").is_none(), "a corrupted block was served");
    let v = c.get(keys[2]).expect("get").expect("the whole block is served");
    assert_pattern(&v, keys[2], len, "a whole block next to corrupt ones");
    let s = stats_fast(&socket);
    assert_eq!(num(&s, "disk_torn"), 2, "{s}");
    assert_eq!(num(&s, "disk_fills"), 1, "{s}");
    assert!(!block_file(&disk, keys[1]).exists(), "the corrupted file was not deleted");
    assert_eq!(num(&s, "disk_blocks"), 1, "{s}");
}

/// Disk full (ENOSPC) on a 4 MiB tmpfs under a 64 MiB `--disk-size`: the
/// writes that do not fit fail, counted in `disk_errors`, their temporary
/// files removed; the daemon serves on, and after a restart every block on
/// disk is a whole one.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: mounts a tmpfs (run as root, as CI does)")]
fn a_full_disk_is_write_errors_and_misses_not_a_dead_daemon() {
    need::root("a_full_disk_is_write_errors_and_misses_not_a_dead_daemon");
    let tmp = TempDir::new("disk-full");
    let mnt = Mount::tmpfs(&tmp.0.join("mnt"), "4m");
    let disk = mnt.at.join("disk");
    let socket = tmp.socket();
    let keys: Vec<Key> = (0..32).map(|j| tkey(9, j)).collect();
    let len = 256 << 10;
    {
        let d = disk_daemon(&tmp, "32MiB", &disk, "64MiB", &[]);
        indexed(&socket);
        let c = Client::connect(&d.opts()).expect("connect");
        for &k in &keys {
            c.put(k, &pattern(k, len)).expect("put");
            drained(&socket);
        }
        let s = stats_fast(&socket);
        assert!(num(&s, "disk_errors") > 0, "no write failed on a full disk: {s}");
        assert!(num(&s, "disk_writes") > 0, "nothing was written: {s}");
        assert_eq!(unfinished_writes(&disk), 0, "a failed write left its temporary file");
        // Still serving, from RAM.
        for &k in &keys {
            assert_pattern(&c.get(k).expect("get").expect("in RAM"), k, len, "after ENOSPC");
        }
        assert!(invariants_ok(&stats_fast(&socket)));
        d.signal(rustix::process::Signal::KILL);
    }
    let d = disk_daemon(&tmp, "32MiB", &disk, "64MiB", &[]);
    let s = indexed(&socket);
    assert_eq!(num(&s, "disk_torn"), 0, "{s}");
    let c = Client::connect(&d.opts()).expect("connect");
    let mut found = 0;
    for &k in &keys {
        if let Some(v) = c.get(k).expect("get") {
            assert_pattern(&v, k, len, "after a restart on a full disk");
            found += 1;
        }
    }
    assert_eq!(found as u64, num(&s, "disk_recovered"));
    drop(d);
    drop(mnt);
}

/// The disk's file system goes read-only under the daemon, then away (an
/// ext4 image remounted read-only, then detached): writes fail (counted),
/// fills keep working while the files are readable and are misses once they
/// are gone; the daemon serves throughout, and its invariants hold.
#[test]
#[cfg_attr(not(kdb_ext4), ignore = "needs root and mkfs.ext4: loop-mounts an ext4 image (run as root, as CI does)")]
fn a_read_only_then_vanished_disk_turns_into_errors_and_misses() {
    need::root("a_read_only_then_vanished_disk_turns_into_errors_and_misses");
    need::tool("a_read_only_then_vanished_disk_turns_into_errors_and_misses", "mkfs.ext4");
    let tmp = TempDir::new("disk-ro");
    let mnt = Mount::ext4(&tmp.0.join("mnt"), 32);
    let disk = mnt.at.join("disk");
    let socket = tmp.socket();
    let len = 512 << 10;
    let first: Vec<Key> = (0..8).map(|j| tkey(11, j)).collect();
    let later: Vec<Key> = (0..24).map(|j| tkey(12, j)).collect();
    let mut d = disk_daemon(&tmp, "8MiB", &disk, "16MiB", &["--disk-queue-bytes", "1MiB"]);
    indexed(&socket);
    let c = Client::connect(&d.opts()).expect("connect");
    for &k in &first {
        c.put(k, &pattern(k, len)).expect("put");
        drained(&socket);
    }
    assert_eq!(num(&stats_fast(&socket), "disk_writes"), 8);
    mnt.remount_ro();
    // These push the first blocks out of the 8 MiB megaslab; none reaches the disk.
    for &k in &later {
        c.put(k, &pattern(k, len)).expect("put");
        drained(&socket);
    }
    let s = stats_fast(&socket);
    assert_eq!(num(&s, "disk_writes"), 8, "{s}");
    assert!(num(&s, "disk_errors") >= 1, "{s}");
    // Read-only: the first blocks still come back from disk.
    for &k in &first {
        let v = c.get(k).expect("get").expect("filled from a read-only disk");
        assert_pattern(&v, k, len, "from a read-only disk");
    }
    // Vanished: push them out of RAM again, detach the file system.
    for &k in &later {
        drop(c.get(k).expect("get"));
    }
    mnt.detach();
    for (i, &k) in first.iter().chain(&later).enumerate() {
        if let Some(v) = c.get(k).expect("get") {
            assert_pattern(&v, k, len, "after the disk vanished");
        }
        c.put(tkey(13, i as u64), &[1u8; 4096]).expect("puts still work");
    }
    drained(&socket);
    let s = stats_fast(&socket);
    assert!(invariants_ok(&s), "{s}");
    assert!(d.child.try_wait().expect("try_wait").is_none(), "the daemon died:\n{}", d.log());
    drop(c);
    drop(d);
}

/// A takeover hands the disk tier over: the old daemon stops its tier and
/// lets go of the directory's lock, the new one (`--takeover --disk` on the
/// same directory) locks it, indexes what is there and fills from it; a
/// third daemon is refused naming the new daemon's pid.
#[test]
fn a_takeover_hands_the_disk_tier_over() {
    let (tmp, other) = (TempDir::new("disk-takeover"), TempDir::new("disk-takeover-3"));
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let args = ["--disk", disk.to_str().unwrap(), "--disk-size", "64MiB"];
    let mut old = disk_daemon(&tmp, "16MiB", &disk, "64MiB", &[]);
    indexed(&socket);
    // A tenant's client: its blocks keep their tenant on disk across the takeover.
    let c = Client::connect(&ConnectOptions { tenant: Some("team-t".into()), ..old.opts() }).expect("connect");
    let keys: Vec<Key> = (0..6).map(|j| tkey(21, j)).collect();
    let len = 300_000;
    let mut parent = None;
    for &k in &keys {
        c.put(k, kachedb_client::Value::bytes(&pattern(k, len)).parent(parent)).expect("put");
        parent = Some(k);
    }
    assert_eq!(num(&drained(&socket), "disk_writes"), 6);
    let mut new = Daemon::spawn_with(&socket, "16MiB", &[&["--takeover"][..], &args[..]].concat());
    let t = std::time::Instant::now();
    while !new.log().contains("took over") {
        if let Ok(Some(s)) = new.child.try_wait() {
            new.wait_exit(Duration::from_secs(5));
            panic!("the new daemon exited ({s}):\n{}", new.log());
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no takeover:\n{}", new.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(old.wait_exit(Duration::from_secs(30)).expect("the old daemon exits").success(), "{}", old.log());
    let s = indexed(&socket);
    assert_eq!(num(&s, "disk_recovered"), 6, "{s}");
    let team = |s: &Value| s["tenants"].as_array().and_then(|a| a.iter().find(|t| t["name"] == "team-t")).cloned();
    let t = team(&s).unwrap_or_else(|| panic!("no row of team-t after the takeover: {s}"));
    assert_eq!((num(&t, "disk_blocks"), num(&t, "disk_bytes")), (6, num(&s, "disk_bytes")), "{s}");
    assert_eq!(std::fs::read_to_string(disk.join("lock")).unwrap().trim(), new.pid().to_string());
    // The client kept its connection; its blocks pushed out of RAM come back from disk, chained.
    push_out_of_ram(&c, &socket, 23, 20);
    assert_eq!(c.lookup(&keys).expect("lookup"), 6);
    for &k in &keys {
        assert_pattern(&c.get(k).expect("get").expect("filled"), k, len, "after the takeover");
    }
    let s = stats_fast(&socket);
    assert_eq!((num(&s, "disk_fills"), num(&s, "parents_missing")), (6, 0), "{s}");
    // Filled back for their tenant, not for `default` (the only client is team-t's).
    let default = s["tenants"].as_array().and_then(|a| a.iter().find(|t| t["name"] == "default")).cloned();
    assert_eq!(default.map(|d| num(&d, "blocks")), Some(0), "{s}");
    // The new daemon writes behind as the old one did.
    let before = num(&s, "disk_writes");
    c.put(tkey(22, 0), &pattern(tkey(22, 0), 5000)).expect("put");
    assert_eq!(num(&drained(&socket), "disk_writes"), before + 1);
    let mut third = Daemon::spawn_with(&other.socket(), "8MiB", &args);
    assert!(!third.wait_exit(Duration::from_secs(30)).expect("exits").success());
    assert!(third.log().contains(&format!("pid {}", new.pid())), "{}", third.log());
}

/// The page cache is not a second copy: after blocks are written behind
/// and filled back, the kernel's page cache holds none of the tier's block
/// files (`fincore`). Skips when `fincore` (util-linux) is missing.
#[test]
#[cfg_attr(not(kdb_fincore), ignore = "needs fincore (util-linux) on PATH")]
fn the_page_cache_keeps_no_copy_of_the_blocks_written_or_filled() {
    need::tool("the_page_cache_keeps_no_copy_of_the_blocks_written_or_filled", "fincore");
    let tmp = TempDir::new("disk-pagecache");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let d = disk_daemon(&tmp, "32MiB", &disk, "256MiB", &[]);
    indexed(&socket);
    let c = Client::connect(&d.opts()).expect("connect");
    let keys: Vec<Key> = (0..16).map(|j| tkey(31, j)).collect();
    for &k in &keys {
        c.put(k, &pattern(k, 1 << 20)).expect("put");
        drained(&socket);
    }
    assert_eq!(num(&stats_fast(&socket), "disk_writes"), 16);
    let cached = || -> u64 {
        let files: Vec<PathBuf> = keys.iter().map(|&k| block_file(&disk, k)).collect();
        let out = Command::new("fincore")
            .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
            .args(&files)
            .output()
            .expect("fincore");
        assert!(out.status.success(), "fincore: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim().parse::<u64>().expect("a number")).sum()
    };
    assert_eq!(cached(), 0, "written blocks left in the page cache");
    push_out_of_ram(&c, &socket, 32, 40);
    assert_eq!(c.lookup(&keys).expect("lookup"), 16);
    assert_eq!(num(&stats_fast(&socket), "disk_fills"), 16);
    assert_eq!(cached(), 0, "filled blocks left in the page cache");
}

/// A WAIT for a key that is on disk and not in RAM is answered by a fill
/// (issue 26: GET, `get_prefix`, LOOKUP *and WAIT* consult the tiers): a
/// daemon started again with its RAM empty answers WAITs on a chain's
/// blocks with their bytes, chained again, where each WAIT's own timeout
/// (20 s) is far off; a WAIT on a key on no tier still times out.
#[test]
fn a_wait_on_a_key_on_disk_is_answered_by_a_fill() {
    let tmp = TempDir::new("disk-wait");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let keys: Vec<Key> = (0..3).map(|j| tkey(41, j)).collect();
    let len = 200_000;
    {
        let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &[]);
        indexed(&socket);
        let c = Client::connect(&d.opts()).expect("connect");
        let mut parent = None;
        for &k in &keys {
            c.put(k, kachedb_client::Value::bytes(&pattern(k, len)).parent(parent)).expect("put");
            parent = Some(k);
        }
        assert_eq!(num(&drained(&socket), "disk_writes"), 3);
        d.signal(rustix::process::Signal::KILL);
    }
    let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &[]);
    indexed(&socket);
    let c = Client::connect(&d.opts()).expect("connect");
    for &k in &keys {
        let v = c
            .wait_for(k, Some(Duration::from_secs(20)))
            .unwrap_or_else(|e| panic!("a WAIT on a block on disk was not answered by a fill: {e}"));
        assert_pattern(&v, k, len, "a WAIT answered from disk");
    }
    let s = stats_fast(&socket);
    assert_eq!((num(&s, "disk_fills"), num(&s, "parents_missing")), (3, 0), "{s}");
    let missing = tkey(41, 99);
    assert!(c.wait_for(missing, Some(Duration::from_millis(300))).is_err(), "a WAIT on a key on no tier was answered");
    let s = stats_fast(&socket);
    assert!(num(&s, "disk_misses") >= 1, "{s}");
    assert!(invariants_ok(&s));
}

/// DELETE goes through to the disk: the key's file and index entry go, and
/// neither a later miss nor a daemon started again on the directory brings
/// the block back, whether the key was in RAM when deleted or only on disk
/// (after a restart). Blocks put and deleted at once, while their writes
/// are queued, do not land either.
#[test]
fn a_deleted_key_never_comes_back_from_disk() {
    let tmp = TempDir::new("disk-delete");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let keys: Vec<Key> = (0..4).map(|j| tkey(42, j)).collect();
    let len = 100_000;
    // The key's file removed and counted (`deletes` so far by this daemon).
    let gone = |k: Key, deletes: u64| {
        poll_stats_fast(&socket, Duration::from_secs(30), "the deleted file removed", |s| {
            num(s, "disk_deletes") == deletes && !block_file(&disk, k).exists()
        })
    };
    {
        let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &[]);
        indexed(&socket);
        let c = Client::connect(&d.opts()).expect("connect");
        for &k in &keys {
            c.put(k, &pattern(k, len)).expect("put");
        }
        assert_eq!(num(&drained(&socket), "disk_writes"), 4);
        assert!(c.delete(keys[0]).expect("delete"), "the key was in RAM");
        assert!(c.get(keys[0]).expect("get").is_none(), "a deleted key came back from disk");
        gone(keys[0], 1);
        let s = stats_fast(&socket);
        assert_eq!((num(&s, "disk_deletes"), num(&s, "disk_blocks")), (1, 3), "{s}");
        d.signal(rustix::process::Signal::KILL);
    }
    let d = disk_daemon(&tmp, "32MiB", &disk, "64MiB", &["--disk-queue-bytes", "64MiB"]);
    let s = indexed(&socket);
    assert_eq!(num(&s, "disk_recovered"), 3, "{s}");
    let c = Client::connect(&d.opts()).expect("connect");
    assert!(c.get(keys[0]).expect("get").is_none(), "a deleted key came back after a restart");
    // Only on disk (RAM empty): DELETE finds nothing local, and still deletes it there.
    assert!(!c.delete(keys[1]).expect("delete"));
    assert!(c.get(keys[1]).expect("get").is_none(), "a key deleted while only on disk was filled back");
    gone(keys[1], 1);
    assert_pattern(&c.get(keys[2]).expect("get").expect("filled"), keys[2], len, "a block next to deleted ones");
    // Put and deleted at once: the DELETE overtakes the queued write.
    let stream: Vec<Key> = (0..64).map(|j| tkey(43, j)).collect();
    for &k in &stream {
        c.put(k, &pattern(k, 128 << 10)).expect("put");
        assert!(c.delete(k).expect("delete"));
    }
    let s = drained(&socket);
    for &k in &stream {
        assert!(c.get(k).expect("get").is_none(), "a deleted key came back");
    }
    let s2 = poll_stats_fast(&socket, Duration::from_secs(30), "deletes done", |s| num(s, "disk_blocks") == 2).0;
    assert!(stream.iter().all(|&k| !block_file(&disk, k).exists()), "a deleted key's file is on disk: {s} {s2}");
    assert!(invariants_ok(&s2));
}

/// `--disk-admit second`: a block committed and never requested again is
/// not written to disk; one requested again while in RAM (GET, LOOKUP or
/// WAIT) is written at that request, once; one committed a second time is
/// written then. With `first` (the default) every block is written.
#[test]
fn disk_admit_second_writes_only_blocks_requested_again() {
    let tmp = TempDir::new("disk-admit");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let len = 50_000;
    let [once, by_get, by_lookup, by_wait, twice] = [0, 1, 2, 3, 4].map(|j| tkey(44, j));
    let d = disk_daemon(&tmp, "16MiB", &disk, "64MiB", &["--disk-admit", "second"]);
    indexed(&socket);
    let c = Client::connect(&d.opts()).expect("connect");
    for k in [once, by_get, by_lookup, by_wait, twice] {
        c.put(k, &pattern(k, len)).expect("put");
    }
    let s = drained(&socket);
    assert_eq!(num(&s, "disk_writes"), 0, "a block was written at its commit: {s}");
    drop(c.get(by_get).expect("get").expect("in RAM"));
    assert_eq!(c.lookup(&[by_lookup]).expect("lookup"), 1);
    drop(c.wait_for(by_wait, Some(Duration::from_secs(5))).expect("wait"));
    c.put(twice, &pattern(twice, len)).expect("put again");
    let s = drained(&socket);
    assert_eq!(num(&s, "disk_writes"), 4, "{s}");
    for (k, on_disk) in [(once, false), (by_get, true), (by_lookup, true), (by_wait, true), (twice, true)] {
        assert_eq!(block_file(&disk, k).exists(), on_disk, "block {k:?}");
    }
    // Asked for again: written once only.
    drop(c.get(by_get).expect("get").expect("in RAM"));
    assert_eq!(num(&drained(&socket), "disk_writes"), 4);
    drop(c);
    drop(d);
    // The default writes every block at its commit.
    let tmp = TempDir::new("disk-admit-first");
    let disk = tmp.0.join("disk");
    let d = disk_daemon(&tmp, "16MiB", &disk, "64MiB", &[]);
    indexed(&tmp.socket());
    let c = Client::connect(&d.opts()).expect("connect");
    c.put(once, &pattern(once, len)).expect("put");
    assert_eq!(num(&drained(&tmp.socket()), "disk_writes"), 1);
}

/// A disk that stalls (an ext4 image on a loop device whose reads the
/// daemon's cgroup may do at 512 bytes a second): GETs of blocks in RAM and
/// puts are served throughout; GETs, LOOKUPs and WAITs of blocks on the
/// stalled disk are misses once `--disk-timeout-ms` passes, counted in
/// `disk_fetches_timed_out`, also with both reader threads stuck and
/// fetches queued behind them. A write queued while the disk's index
/// rebuild is stalled loses to a DELETE that comes after it. Once the
/// disk is back, fills work again and the daemon stops cleanly.
#[test]
#[cfg_attr(
    not(kdb_blkio),
    ignore = "needs root, mkfs.ext4 and a blkio (cgroup v1) or io (cgroup v2) controller: throttles a loop-mounted ext4 image"
)]
fn a_stalled_disk_is_misses_while_blocks_in_ram_are_served() {
    let name = "a_stalled_disk_is_misses_while_blocks_in_ram_are_served";
    need::root(name);
    need::tool(name, "mkfs.ext4");
    let tmp = TempDir::new("disk-stall");
    let mnt = Mount::ext4(&tmp.0.join("mnt"), 64);
    let throttle = ReadThrottle::new("disk-stall", device_of(&mnt.at));
    let disk = mnt.at.join("disk");
    let socket = tmp.socket();
    let keys: Vec<Key> = (0..8).map(|j| tkey(45, j)).collect();
    let len = 1 << 20;
    {
        let d = disk_daemon(&tmp, "16MiB", &disk, "48MiB", &[]);
        indexed(&socket);
        let c = Client::connect(&d.opts()).expect("connect");
        for &k in &keys {
            c.put(k, &pattern(k, len)).expect("put");
            drained(&socket);
        }
        assert_eq!(num(&drained(&socket), "disk_writes"), 8);
        d.signal(rustix::process::Signal::KILL);
    }
    uncache_blocks(&disk);
    let timeout = ["--disk-timeout-ms", "300"];
    let mut d = throttle.daemon(
        &socket,
        "16MiB",
        &[&["--disk", disk.to_str().unwrap(), "--disk-size", "48MiB"][..], &timeout[..]].concat(),
    );
    indexed(&socket);
    let c = Client::connect(&d.opts()).expect("connect");
    let hot = tkey(46, 0);
    c.put(hot, &pattern(hot, 4096)).expect("put");
    throttle.limit(512);
    // Fetches that stall: two take both reader threads, more queue behind them.
    assert!(c.get(keys[0]).expect("get").is_none(), "a fill from a stalled disk");
    assert_eq!(c.lookup(&keys[1..3]).expect("lookup"), 0);
    assert!(c.wait_for(keys[3], Some(Duration::from_secs(1))).is_err(), "a WAIT answered from a stalled disk");
    assert!(c.get(keys[4]).expect("get").is_none());
    let s = stats_fast(&socket);
    assert_eq!(num(&s, "disk_fills"), 0, "the disk did not stall: {s}");
    assert!(num(&s, "disk_fetches_timed_out") >= 3, "{s}");
    // Meanwhile, and from other clients, RAM is served.
    let other = Client::connect(&d.opts()).expect("connect");
    for i in 0..500 {
        assert_pattern(&other.get(hot).expect("get").expect("in RAM"), hot, 4096, "a RAM block while the disk stalls");
        if i % 100 == 0 {
            c.put(tkey(46, 1 + i), &[1u8; 8192]).expect("a put while the disk stalls");
        }
    }
    assert!(d.child.try_wait().expect("try_wait").is_none(), "the daemon died:\n{}", d.log());
    assert!(invariants_ok(&stats_fast(&socket)));
    // The disk comes back: the stalled reads finish, fills work again.
    throttle.limit(0);
    let v = c.get(keys[5]).expect("get").expect("filled once the disk is back");
    assert_pattern(&v, keys[5], len, "a fill after the stall");
    drop(v);
    d.signal(rustix::process::Signal::TERM);
    let status = d.wait_exit(Duration::from_secs(60)).expect("the daemon stops");
    assert!(status.success(), "{status}:\n{}", d.log());
    drop(c);
    drop(other);

    // The index rebuild stalls, so writes queue: a DELETE after a queued write
    // wins. (Without the catalog, the rebuild reads each file's header.)
    forget_catalog(&disk);
    uncache_blocks(&disk);
    throttle.limit(512);
    let d = throttle.daemon(
        &socket,
        "16MiB",
        &[&["--disk", disk.to_str().unwrap(), "--disk-size", "48MiB"][..], &timeout[..]].concat(),
    );
    let c = Client::connect(&d.opts()).expect("connect");
    let (deleted, kept) = (tkey(47, 0), tkey(47, 1));
    c.put(deleted, &pattern(deleted, 8192)).expect("put");
    c.put(kept, &pattern(kept, 8192)).expect("put");
    assert!(c.delete(deleted).expect("delete"));
    let s = stats_fast(&socket);
    assert!(s["disk_indexed"] == false && num(&s, "disk_queue_blocks") == 2, "the index rebuild did not stall: {s}");
    throttle.limit(0);
    indexed(&socket);
    let s = drained(&socket);
    assert!(block_file(&disk, kept).exists(), "{s}");
    assert!(!block_file(&disk, deleted).exists(), "a write queued before a DELETE landed after it: {s}");
    assert!(c.get(deleted).expect("get").is_none());
    drop(c);
    drop(d);
    drop(throttle);
    drop(mnt);
}

/// The scheduling policies (`/proc/PID/task/TID/stat`, field 41) of the
/// daemon `pid`'s disk-tier threads named `name`.
fn disk_thread_policies(pid: u32, name: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the daemon's threads").flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // After the ")" that ends the name: field 3 onwards; the policy is field 41.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        out.push(rest.split_whitespace().nth(41 - 3).and_then(|p| p.parse().ok()).expect("a policy"));
    }
    out
}

/// The disk tier's threads run `SCHED_IDLE` (policy 5) by default, so that
/// its copies, checksums and syscalls take only CPU the serve loop and the
/// clients leave free; `--disk-worker-class normal` keeps them in the
/// normal class (policy 0) at `--disk-worker-nice`; a bad class is refused.
#[test]
fn the_disk_tiers_threads_run_sched_idle_unless_told_otherwise() {
    let tmp = TempDir::new("disk-class");
    let disk = tmp.0.join("disk");
    {
        let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &[]);
        indexed(&tmp.socket());
        let p = disk_thread_policies(d.pid(), "kachedb-disk");
        assert!(p.len() >= 4, "the tier's threads: {p:?}");
        assert!(p.iter().all(|&p| p == 5), "not all SCHED_IDLE (5): {p:?}");
        // The remover (a client's DELETE waits for it) stays in the normal class.
        assert_eq!(disk_thread_policies(d.pid(), "kachedb-disk-rm"), vec![0]);
    }
    {
        let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &["--disk-worker-class", "normal"]);
        indexed(&tmp.socket());
        let p = disk_thread_policies(d.pid(), "kachedb-disk");
        assert!(p.len() >= 4 && p.iter().all(|&p| p == 0), "not all SCHED_OTHER (0): {p:?}");
    }
    let mut bad = Daemon::spawn_with(
        &tmp.socket(),
        "8MiB",
        &["--disk", disk.to_str().expect("utf-8"), "--disk-size", "64MiB", "--disk-worker-class", "realtime"],
    );
    assert!(!bad.wait_exit(Duration::from_secs(30)).expect("exits").success());
    assert!(bad.log().contains("--disk-worker-class"), "{}", bad.log());
}

/// Read-ahead along a chain (`--disk-read-ahead`, docs/disk.md): after a
/// restart, a GET of a chain's first block fills the blocks after it into
/// free megaslab space, and a GET of one of those moves the window on; those
/// nobody asked for are the first blocks eviction takes; once the megaslab
/// has no free room a read-ahead evicts nothing (the files go to the page
/// cache instead); and every byte a walk of the chains reads is right.
#[test]
fn read_ahead_fills_the_next_blocks_into_free_room_only_and_goes_first() {
    let tmp = TempDir::new("disk-read-ahead");
    let disk = tmp.0.join("disk");
    let socket = tmp.socket();
    let len = 64 << 10;
    let chain = |tag: u64| (0..8).map(|j| tkey(tag, j)).collect::<Vec<Key>>();
    let (x, y) = (chain(300), chain(301));
    {
        let d = disk_daemon(&tmp, "8MiB", &disk, "64MiB", &["--disk-read-ahead", "0"]);
        indexed(&socket);
        let c = Client::connect(&d.opts()).expect("connect");
        for ch in [&x, &y] {
            let mut parent = None;
            for &k in ch {
                c.put(k, kachedb_client::Value::bytes(&pattern(k, len)).parent(parent)).expect("put");
                parent = Some(k);
            }
        }
        drained(&socket);
        d.signal(rustix::process::Signal::KILL);
    }
    let d = disk_daemon(&tmp, "2MiB", &disk, "64MiB", &["--disk-read-ahead", "4"]);
    indexed(&socket);
    let c = Client::connect(&d.opts()).expect("connect");
    let wait = |what: &str, pred: &dyn Fn(&Value) -> bool| {
        poll_stats_fast(&socket, Duration::from_secs(30), what, |v| pred(v)).0
    };

    // Free room: the miss of x0 fills x0 and reads x1..x4 ahead; the GET
    // of x1 (a hit) moves the window on to x5.
    assert_pattern(&c.get(x[0]).expect("get").expect("x0 from disk"), x[0], len, "x0");
    wait("x1..x4 read ahead", &|v| num(v, "blocks") == 5 && num(v, "disk_read_ahead") == 4);
    let fetches = num(&stats_fast(&socket), "disk_fetches");
    assert_pattern(&c.get(x[1]).expect("get").expect("x1 read ahead"), x[1], len, "x1");
    wait("x5 read ahead", &|v| num(v, "blocks") == 6 && num(v, "disk_read_ahead") == 5);
    let s = stats_fast(&socket);
    assert_eq!(num(&s, "disk_fetches"), fetches, "x1 was not a hit");
    // Read on two threads, committed in chain order: each names its parent.
    assert_eq!((num(&s, "parents_missing"), num(&s, "chained_blocks")), (0, 5), "{s}");

    // Fill the free room with a client's blocks (from page-aligned bytes:
    // 64 KiB extents, as the fills'): nothing evicted. Two more take the
    // read-ahead blocks nobody asked for, the chain's tail first (x5, x4),
    // before any block a client used.
    let mut buf = vec![0u8; len + 4096];
    let at = buf.as_ptr().align_offset(4096);
    let mut put = |k: Key| {
        buf[at..at + len].copy_from_slice(&pattern(k, len));
        c.put(k, &buf[at..at + len]).expect("put");
    };
    let mut z: Vec<Key> = Vec::new();
    while num(&stats_fast(&socket), "bytes_free") >= len as u64 {
        let k = tkey(302, z.len() as u64);
        put(k);
        z.push(k);
        assert_eq!(num(&stats_fast(&socket), "evictions"), 0, "the free room held them");
    }
    for j in 0..2 {
        let k = tkey(303, j);
        put(k);
        z.push(k);
    }
    let s = drained(&socket);
    assert_eq!(num(&s, "evictions"), 2, "{s}");
    assert_eq!(num(&s, "blocks") as usize, z.len() + 4, "{s}");
    let fetches = num(&s, "disk_fetches");
    for (n, &k) in z.iter().enumerate() {
        assert_eq!(c.lookup(&[k]).expect("lookup"), 1);
        assert_eq!(num(&stats_fast(&socket), "disk_fetches"), fetches, "block {n} of {} was evicted", z.len());
    }
    // x0 and x1 (asked for) and every block of the client's are there, and
    // x2, x3 (the LOOKUP of x3 reads ahead after it: x4 and x5 were read
    // ahead already, x6 and x7 find no free room).
    assert_eq!(c.lookup(&x[..4]).expect("lookup"), 4, "a block a client used was evicted before a guess");
    let s = stats_fast(&socket);
    assert_eq!(num(&s, "blocks") as usize, z.len() + 4, "{s}");
    assert_eq!(num(&s, "disk_fetches"), fetches, "a block was evicted for a guess");
    wait("x6, x7 read into the page cache", &|v| num(v, "disk_read_ahead_cached") == 2);

    // No free room: the miss of y0 evicts one block for itself; the
    // read-ahead of y1..y4 evicts nothing and goes to the page cache.
    let s = stats_fast(&socket);
    let (blocks, evictions, cached) = (num(&s, "blocks"), num(&s, "evictions"), num(&s, "disk_read_ahead_cached"));
    assert!(num(&s, "bytes_free") < len as u64, "the megaslab still has room: {s}");
    assert_pattern(&c.get(y[0]).expect("get").expect("y0 from disk"), y[0], len, "y0");
    let s = wait("y1..y4 read into the page cache", &|v| num(v, "disk_read_ahead_cached") == cached + 4);
    assert_eq!(num(&s, "evictions"), evictions + 1, "a read-ahead evicted a resident block: {s}");
    assert_eq!(num(&s, "blocks"), blocks, "{s}");
    assert_eq!(num(&s, "disk_read_ahead"), 5);

    // A walk of both chains, block after block: every byte right.
    for (n, &k) in x.iter().chain(&y).enumerate() {
        assert_pattern(&c.get(k).expect("get").expect("on disk"), k, len, &format!("block {n} of the walk"));
    }
    assert!(invariants_ok(&stats_fast(&socket)));
}
