//! What one tenant can do to another's blocks (issue 41, item 2), against
//! the real `kachedb serve` binary with two client processes of two tenants
//! (the victim is this test process, the other a child process: this test
//! binary run again, `tests/common`): reading and pinning another tenant's
//! blocks is allowed and charged to the reader; storing blocks that name
//! them as parents is allowed and does not keep them cached. Neither can
//! make the victim's puts fail. No assertion on timings.

use kachedb_client::{chain_parents, Client, ConnectOptions, Key};
use serde_json::Value;
use std::time::Duration;

mod common;
use common::*;

const BLOCK: usize = 64 << 10;

fn key(name: &str, i: u64) -> Key {
    Key::from_str(&format!("{name}-{i}"))
}

fn pattern(k: Key, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed_of(k));
    v
}

/// Blocks of [`BLOCK`] bytes with the patterns of `keys`, each at a page
/// boundary (so each one's extent is exactly `BLOCK` bytes): the buffer and
/// where the first block starts in it.
fn aligned(keys: &[Key]) -> (Vec<u8>, usize) {
    let mut buf = vec![0u8; keys.len() * BLOCK + 4096];
    let start = (4096 - buf.as_ptr() as usize % 4096) % 4096;
    for (i, k) in keys.iter().enumerate() {
        fill(&mut buf[start + i * BLOCK..start + (i + 1) * BLOCK], seed_of(*k));
    }
    (buf, start)
}

fn tenant_opts(socket: &std::path::Path, tenant: &str) -> ConnectOptions {
    ConnectOptions { tenant: Some(tenant.into()), ..opts(socket) }
}

fn tenant_row<'a>(v: &'a Value, name: &str) -> &'a Value {
    let rows = v["tenants"].as_array().unwrap_or_else(|| panic!("no tenants in {v}"));
    rows.iter().find(|t| t["name"] == name).unwrap_or_else(|| panic!("no tenant {name} in {v}"))
}

/// Entry point of every child process; a no-op in a normal test run.
#[test]
fn child_process() {
    let Ok(role) = std::env::var(ROLE_VAR) else { return };
    let socket = std::path::PathBuf::from(std::env::var(SOCKET_VAR).expect("socket var"));
    let tenant = std::env::var("KDB_TENANT").expect("KDB_TENANT");
    let kc = Client::connect(&tenant_opts(&socket, &tenant)).unwrap_or_else(|e| panic!("child {role}: connect: {e}"));
    let victims = env_u64("KDB_VICTIMS");
    match role.as_str() {
        // Pins every one of the victim's blocks until told to exit.
        "pinner" => {
            let keys: Vec<Key> = (0..victims).map(|i| key("v", i)).collect();
            let views = kc.get_many(&keys).expect("get_many");
            let pinned = views.iter().filter(|v| v.is_some()).count();
            say("PINNED", pinned);
            await_order("exit");
            drop(views);
        }
        // Stores a one-page block naming each of the victim's blocks as its
        // parent; with KDB_HOLD=1 pins them and waits to be told to exit,
        // else exits at once (its blocks stay).
        "child-maker" => {
            let hold = env_u64("KDB_HOLD") == 1;
            let mut views = Vec::new();
            for i in 0..victims {
                let k = key("x", i);
                kc.put(k, kachedb_client::Value::bytes(&pattern(k, 4096)).parent(Some(key("v", i))))
                    .expect("put a child");
                if hold {
                    views.push(kc.get(k).expect("get").expect("present"));
                }
            }
            say("STORED", victims);
            if hold {
                await_order("exit");
            }
            drop(views);
        }
        other => panic!("unknown child role {other}"),
    }
}

fn spawn(role: &str, d: &Daemon, tenant: &str, victims: u64, hold: bool) -> Proc {
    let env = [
        ("KDB_TENANT", tenant.to_string()),
        ("KDB_VICTIMS", victims.to_string()),
        ("KDB_HOLD", u64::from(hold).to_string()),
    ];
    spawn_child(role, &d.socket, &env)
}

/// `v` stores `n` blocks of its own, as one chain.
fn store_victim_chain(v: &Client, n: u64) {
    let keys: Vec<Key> = (0..n).map(|i| key("v", i)).collect();
    let (buf, start) = aligned(&keys);
    let parents = chain_parents(&keys, None);
    let items: Vec<(Key, kachedb_client::Value<'_>)> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            (*k, kachedb_client::Value::bytes(&buf[start + i * BLOCK..start + (i + 1) * BLOCK]).parent(parents[i]))
        })
        .collect();
    v.put_many(&items).expect("the victim's chain");
}

/// `v` stores `count` more blocks, one by one: every put must succeed.
fn victim_stores_on(v: &Client, count: u64, what: &str) {
    let keys: Vec<Key> = (0..count).map(|i| key("v-new", i)).collect();
    let (buf, start) = aligned(&keys);
    for (i, k) in keys.iter().enumerate() {
        v.put(*k, &buf[start + i * BLOCK..start + (i + 1) * BLOCK])
            .unwrap_or_else(|e| panic!("{what}: the victim's put {i} of {count}: {e}"));
    }
}

/// A tenant at its limit (16 blocks) whose every block another tenant's
/// process pins: the pins are the reader's charge, so the victim stores on
/// (evicting its newer blocks); the pinned blocks stay, intact.
#[test]
fn pins_of_another_tenant_cannot_refuse_a_tenant() {
    let dir = TempDir::new("iso-pins");
    let mut d = Daemon::spawn_with(&dir.socket(), "16MiB", &["--tenant-limit", "v=1MiB", "--tenant-limit", "x=2MiB"]);
    d.wait_ready();
    let v = Client::connect(&tenant_opts(&d.socket, "v")).expect("connect as v");
    store_victim_chain(&v, 16);
    let mut x = spawn("pinner", &d, "x", 16, false);
    assert_eq!(x.expect("PINNED", Duration::from_secs(60)), "16");
    victim_stores_on(&v, 32, "every block pinned by another tenant");
    let st = stats(&d.socket);
    assert!(invariants_ok(&st), "{st}");
    assert!(num(tenant_row(&st, "v"), "evictions") >= 16, "{st}");
    for i in 0..16 {
        let view = v.get(key("v", i)).expect("get").unwrap_or_else(|| panic!("pinned block {i} is gone"));
        assert_pattern(&view, key("v", i), BLOCK, "a block the other tenant pins");
    }
    x.send("exit");
    x.finish(Duration::from_secs(30));
}

/// Another tenant's process stores a tiny block naming each of the victim's
/// blocks as its parent and exits: its blocks outlive its connection, but
/// they do not keep the victim's blocks cached, so the victim (at its limit)
/// stores on, evicting them. The other tenant's blocks stay, without a
/// parent.
#[test]
fn children_of_another_tenant_cannot_refuse_a_tenant_at_its_limit() {
    let dir = TempDir::new("iso-parents");
    let mut d = Daemon::spawn_with(&dir.socket(), "16MiB", &["--tenant-limit", "v=1MiB"]);
    d.wait_ready();
    let v = Client::connect(&tenant_opts(&d.socket, "v")).expect("connect as v");
    store_victim_chain(&v, 16);
    let x = spawn("child-maker", &d, "x", 16, false);
    let out = x.finish(Duration::from_secs(60));
    assert_eq!(tagged(&out, "STORED"), ["16"]);
    victim_stores_on(&v, 32, "children of another tenant (gone)");
    let st = stats(&d.socket);
    assert!(invariants_ok(&st), "{st}");
    assert_eq!(num(tenant_row(&st, "x"), "blocks"), 16, "{st}");
    assert_eq!(num(tenant_row(&st, "v"), "blocks"), 16, "{st}");
    assert_eq!(num(&st, "links_cut_by_eviction"), 16, "{st}");
}

/// Without limits (one shared eviction list): another tenant's process
/// pins a tiny child of each of the victim's blocks, which fill the
/// megaslab. The children do not keep their parents cached: the victim's
/// puts evict its own blocks.
#[test]
fn pinned_children_of_another_tenant_cannot_hold_a_tenants_blocks() {
    let dir = TempDir::new("iso-shared");
    let d = Daemon::start(&dir.socket(), "4MiB");
    let total = num(&stats(&d.socket), "bytes_total");
    // The victim's blocks and the other tenant's one-page children fill it.
    let n = total / (BLOCK as u64 + 4096);
    let v = Client::connect(&tenant_opts(&d.socket, "v")).expect("connect as v");
    store_victim_chain(&v, n);
    let mut x = spawn("child-maker", &d, "x", n, true);
    assert_eq!(x.expect("STORED", Duration::from_secs(60)), n.to_string());
    victim_stores_on(&v, 8, "pinned children of another tenant");
    let st = stats(&d.socket);
    assert!(invariants_ok(&st), "{st}");
    assert_eq!(num(tenant_row(&st, "x"), "blocks"), n, "{st}");
    x.send("exit");
    x.finish(Duration::from_secs(30));
}
