//! Tenants bound to uids and gids (`kachedb serve --tenant-uid`,
//! `--tenant-gid`; docs/tenants.md) against real processes: a real `kachedb
//! serve`, and client processes (this test binary re-run in the
//! `tenant_client` role) that drop to other uids and groups before exec, as
//! `fault.rs::other_uid_is_refused_at_connect` does. Each client connects
//! naming a tenant (or none), reports how that went, then runs the commands
//! the test writes on its stdin and reports each result.
//!
//! Needs root (to run clients as other uids); without it `cargo test` lists
//! each test as ignored, with the reason. The uids and gids below need no
//! passwd or group entry.

mod common;

use common::*;
use kachedb_client::{Client, ClientError, ConnectOptions, Key};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// The group `--allow-gid` admits; every client below has it as its primary gid.
const GID_ADMITTED: u32 = 64_100;
/// A supplementary group, bound to a tenant with `--tenant-gid`.
const GID_BOUND: u32 = 64_200;
/// Team a's user; another admitted user; team b's user; two more.
const UID_A: u32 = 64_001;
const UID_B: u32 = 64_002;
const UID_C: u32 = 64_003;
const UID_D: u32 = 64_004;
const UID_E: u32 = 64_005;

const TAG: u64 = 0x7E7A_0001;
const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn child_process() {
    let Ok(role) = std::env::var(ROLE_VAR) else { return };
    match role.as_str() {
        "tenant_client" => tenant_client(),
        other => panic!("unknown child role {other}"),
    }
}

fn key(j: u64) -> Key {
    tkey(TAG, j)
}

// ---------------------------------------------------------------------------
// The child: a client of one tenant, driven over stdin
// ---------------------------------------------------------------------------

/// Says `IDS uid gid groups`, connects naming `KDB_TENANT` (if set), says
/// `CONNECT ok` or `CONNECT err <why>`; then answers each command on stdin
/// with `R <result>`:
/// `put J SEED LEN` (ok | denied | err …), `get J SEED LEN` (ok | missing |
/// differs at N | err …), `delete J` (deleted | absent | denied | err …).
fn tenant_client() {
    let socket = std::path::PathBuf::from(std::env::var(SOCKET_VAR).expect("socket"));
    let groups: Vec<String> =
        rustix::process::getgroups().expect("getgroups").iter().map(|g| g.as_raw().to_string()).collect();
    say(
        "IDS",
        format!("{} {} {}", rustix::process::getuid().as_raw(), rustix::process::getgid().as_raw(), groups.join(",")),
    );
    let tenant = std::env::var("KDB_TENANT").ok();
    let kc = match Client::connect(&ConnectOptions { tenant, ..opts(&socket) }) {
        Ok(kc) => kc,
        Err(e) => {
            say("CONNECT", format!("err {e}"));
            return;
        }
    };
    say("CONNECT", "ok");
    let err = |e: ClientError| match e {
        ClientError::Denied => "denied".to_string(),
        e => format!("err {e}"),
    };
    let mut line = String::new();
    while {
        line.clear();
        std::io::stdin().read_line(&mut line).expect("read stdin") > 0
    } {
        let w: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| -> u64 { w[i].parse().expect("a number") };
        let r = match w.as_slice() {
            ["put", ..] => {
                let mut bytes = vec![0u8; n(3) as usize];
                fill(&mut bytes, n(2));
                kc.put(key(n(1)), &bytes).map_or_else(err, |()| "ok".into())
            }
            ["get", ..] => match kc.get(key(n(1))) {
                Ok(Some(v)) if v.len() as u64 != n(3) => format!("differs in length: {}", v.len()),
                Ok(Some(v)) => first_mismatch(&v, n(2)).map_or("ok".into(), |i| format!("differs at {i}")),
                Ok(None) => "missing".into(),
                Err(e) => err(e),
            },
            ["delete", _] => match kc.delete(key(n(1))) {
                Ok(true) => "deleted".into(),
                Ok(false) => "absent".into(),
                Err(e) => err(e),
            },
            _ => panic!("unknown command {line:?}"),
        };
        say("R", r);
    }
}

// ---------------------------------------------------------------------------
// The test side
// ---------------------------------------------------------------------------

/// `pre_exec`: become `uid`/`gid` with supplementary `groups` (in the forked
/// child, before exec; raw syscalls only). As in `fault.rs`.
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

/// A directory other uids can pass through (0711) for the daemon's socket.
fn shared_dir(name: &str) -> TempDir {
    let dir = TempDir::new(name);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    dir
}

/// A daemon admitting [`GID_ADMITTED`] with `extra` arguments, its socket's
/// group set to that gid (mode 0660), so that the clients below reach it.
fn daemon(sock: &Path, extra: &[&str]) -> Daemon {
    let gid = GID_ADMITTED.to_string();
    let args: Vec<&str> = ["--allow-gid", gid.as_str()].into_iter().chain(extra.iter().copied()).collect();
    let mut d = Daemon::spawn_with(sock, "64MiB", &args);
    d.wait_ready();
    std::os::unix::fs::chown(sock, None, Some(GID_ADMITTED)).expect("chgrp the socket");
    d
}

/// A client process of `uid` (primary gid [`GID_ADMITTED`], supplementary
/// `groups`) naming `tenant`; returns it and what `CONNECT` said.
fn client(sock: &Path, uid: u32, groups: &[u32], tenant: Option<&str>) -> (Proc, String) {
    let env: Vec<(&str, String)> = tenant.map(|t| ("KDB_TENANT", t.to_string())).into_iter().collect();
    let mut p = spawn_child_with("tenant_client", sock, &env, |cmd| drop_privileges(cmd, uid, GID_ADMITTED, groups));
    let ids = p.expect("IDS", LIMIT);
    let mut want_groups = groups.to_vec();
    want_groups.sort_unstable();
    let mut got: Vec<&str> = ids.split(' ').collect();
    got.resize(3, "");
    let mut got_groups: Vec<u32> = got[2].split(',').filter(|g| !g.is_empty()).map(|g| g.parse().unwrap()).collect();
    got_groups.sort_unstable();
    assert_eq!(
        (got[0], got[1], got_groups),
        (uid.to_string().as_str(), GID_ADMITTED.to_string().as_str(), want_groups)
    );
    let said = p.expect("CONNECT", LIMIT);
    (p, said)
}

/// A client that must be admitted.
fn admitted(sock: &Path, uid: u32, groups: &[u32], tenant: Option<&str>) -> Proc {
    let (p, said) = client(sock, uid, groups, tenant);
    assert_eq!(said, "ok", "uid {uid} naming {tenant:?} was not admitted\n{}", p.dump());
    p
}

/// A client that must be refused; its message.
fn refused(sock: &Path, uid: u32, groups: &[u32], tenant: Option<&str>) -> String {
    let (p, said) = client(sock, uid, groups, tenant);
    assert!(said.starts_with("err "), "uid {uid} naming {tenant:?} was admitted: {said}");
    p.finish(LIMIT);
    said
}

/// Runs `cmd` in client `p`; its result.
fn ask(p: &mut Proc, cmd: &str) -> String {
    p.send(cmd);
    p.expect("R", LIMIT)
}

/// The `tenants` row `name` of `kachedb stats --json`.
fn tenant_row(v: &Value, name: &str) -> Value {
    v["tenants"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("no tenant {name:?} in the stats: {v}"))
}

fn row_num(v: &Value, name: &str, field: &str) -> u64 {
    num(&tenant_row(v, name), field)
}

/// Waits until the daemon's log has `what`; the log.
fn log_has(d: &Daemon, what: &str) -> String {
    let t = Instant::now();
    loop {
        let log = d.log();
        if log.contains(what) {
            return log;
        }
        assert!(t.elapsed() < LIMIT, "the daemon did not log {what:?}:\n{log}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The metrics address a daemon prints (`metrics at http://ADDR/metrics`).
fn metrics_addr(d: &Daemon) -> SocketAddr {
    let log = log_has(d, "metrics at http://");
    let rest = log.split("metrics at http://").nth(1).unwrap_or_default();
    let addr = rest.split('/').next().unwrap_or_default();
    addr.parse().unwrap_or_else(|e| panic!("metrics address {addr:?}: {e}"))
}

/// The value of the series `series` (name and labels, as written) in `/metrics`.
fn metric(addr: SocketAddr, series: &str) -> Option<f64> {
    let mut c = TcpStream::connect_timeout(&addr, LIMIT).expect("connect to /metrics");
    c.set_read_timeout(Some(LIMIT)).unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n").expect("write");
    let mut out = String::new();
    c.read_to_string(&mut out).expect("read /metrics");
    out.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

const MIB: u64 = 1 << 20;

/// The attack of issue 41, reproduced: a peer of another uid, admitted by
/// `--allow-gid`, names team-a in its hello. Unbound (as on every daemon
/// before bindings), it is admitted as team-a, counted in it and deletes
/// team-a's block. With `--tenant-uid team-a=<uid A>` it is refused at
/// connect, saying why; the refusal is logged and counted
/// (`kachedb_clients_refused_total{reason="tenant"}`), and team-a's client
/// and block are untouched.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs clients as other uids (run as root, as CI does)")]
fn another_uid_naming_a_bound_tenant_is_refused_at_connect() {
    need::root("another_uid_naming_a_bound_tenant_is_refused_at_connect");
    let dir = shared_dir("bound-hello");

    // Unbound: the attack works.
    let sock = dir.0.join("open.sock");
    let d = daemon(&sock, &["--tenant-limit", "team-a=8MiB"]);
    let mut a = admitted(&sock, UID_A, &[], Some("team-a"));
    assert_eq!(ask(&mut a, &format!("put 1 11 {MIB}")), "ok");
    let mut b = admitted(&sock, UID_B, &[], Some("team-a"));
    assert_eq!(ask(&mut b, &format!("put 2 22 {MIB}")), "ok");
    let v = stats(&sock);
    assert_eq!((row_num(&v, "team-a", "clients"), row_num(&v, "team-a", "blocks")), (2, 2), "{v}");
    assert_eq!(ask(&mut b, "delete 1"), "deleted", "unbound, another uid deletes team-a's block");
    b.finish(LIMIT);
    a.finish(LIMIT);
    drop(d);

    // Bound: refused at connect.
    let sock = dir.0.join("bound.sock");
    let uid_a = format!("team-a={UID_A}");
    let d = daemon(&sock, &["--tenant-limit", "team-a=8MiB", "--tenant-uid", &uid_a, "--metrics-addr", "127.0.0.1:0"]);
    let addr = metrics_addr(&d);
    log_has(&d, &format!("tenant \"team-a\" bound to uids [{UID_A}]"));
    let mut a = admitted(&sock, UID_A, &[], Some("team-a"));
    assert_eq!(ask(&mut a, &format!("put 1 11 {MIB}")), "ok");
    let why = refused(&sock, UID_B, &[], Some("team-a"));
    assert!(
        why.contains("tenant \"team-a\" is bound")
            && why.contains(&format!("uid {UID_B}"))
            && why.contains("--tenant-uid"),
        "{why}"
    );
    log_has(&d, "refusing a client: tenant \"team-a\" is bound");
    assert_eq!(metric(addr, r#"kachedb_clients_refused_total{reason="tenant"}"#), Some(1.0));
    let v = stats(&sock);
    assert_eq!((row_num(&v, "team-a", "clients"), row_num(&v, "team-a", "blocks")), (1, 1), "{v}");
    assert_eq!(num(&v, "clients_total"), 1, "{v}");
    assert_eq!(ask(&mut a, &format!("get 1 11 {MIB}")), "ok");
    a.finish(LIMIT);
    assert!(invariants_ok(&stats(&sock)));
}

/// Any client may read a bound tenant's block (keys are shared on purpose),
/// but one of another tenant can neither delete nor replace it: DENIED,
/// the block and its bytes unchanged, the refused put's reservation aborted
/// by the client (nothing left reserved), counted and logged. Team-a's own
/// client replaces and deletes it; team-a may delete an unbound tenant's block.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs clients as other uids (run as root, as CI does)")]
fn another_tenant_reads_a_bound_tenants_block_but_cannot_delete_or_replace_it() {
    need::root("another_tenant_reads_a_bound_tenants_block_but_cannot_delete_or_replace_it");
    let dir = shared_dir("bound-blocks");
    let sock = dir.0.join("s.sock");
    let uid_a = format!("team-a={UID_A}");
    let d = daemon(&sock, &["--tenant-uid", &uid_a]);
    let len = MIB + 123;
    let mut a = admitted(&sock, UID_A, &[], Some("team-a"));
    assert_eq!(ask(&mut a, &format!("put 1 11 {len}")), "ok");
    for (uid, tenant) in [(UID_B, None), (UID_C, Some("team-b"))] {
        let mut b = admitted(&sock, uid, &[], tenant);
        assert_eq!(ask(&mut b, &format!("get 1 11 {len}")), "ok", "reading is open to all");
        assert_eq!(ask(&mut b, "delete 1"), "denied");
        assert_eq!(ask(&mut b, &format!("put 1 22 {len}")), "denied");
        assert_eq!(ask(&mut b, &format!("put 1 22 {}", 3 * MIB)), "denied");
        assert_eq!(ask(&mut b, &format!("get 1 11 {len}")), "ok", "the block is intact");
        let v = stats(&sock);
        assert_eq!(num(&v, "reserved"), 0, "the refused puts' reservations were aborted: {v}");
        assert_eq!(row_num(&v, "team-a", "blocks"), 1, "{v}");
        // Its own block, under an unbound tenant: team-a may delete it.
        assert_eq!(ask(&mut b, &format!("put 2 33 {len}")), "ok");
        assert_eq!(ask(&mut a, "delete 2"), "deleted");
        b.finish(LIMIT);
    }
    let v = stats(&sock);
    assert_eq!(num(&v, "denied"), 6, "{v}");
    assert!(invariants_ok(&v), "{v}");
    log_has(&d, "denied a DELETE of a block of tenant \"team-a\"");
    assert_eq!(ask(&mut a, &format!("get 1 11 {len}")), "ok", "team-a's bytes are unchanged");
    assert_eq!(ask(&mut a, &format!("put 1 44 {len}")), "ok", "team-a replaces its own block");
    assert_eq!(ask(&mut a, &format!("get 1 44 {len}")), "ok");
    assert_eq!(ask(&mut a, "delete 1"), "deleted");
    a.finish(LIMIT);
}

/// A uid bound to team-a acts as team-a only: naming team-b (bound to
/// another uid) or an unbound tenant it is refused, naming none or
/// `default` it is put in team-a. Team-b's client cannot delete team-a's block.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs clients as other uids (run as root, as CI does)")]
fn a_bound_uid_acts_only_as_its_tenant() {
    need::root("a_bound_uid_acts_only_as_its_tenant");
    let dir = shared_dir("bound-uid");
    let sock = dir.0.join("s.sock");
    let (uid_a, uid_c) = (format!("team-a={UID_A}"), format!("team-b={UID_C}"));
    let _d = daemon(&sock, &["--tenant-uid", &uid_a, "--tenant-uid", &uid_c]);
    let why = refused(&sock, UID_A, &[], Some("team-b"));
    assert!(why.contains("tenant \"team-b\" is bound") && why.contains("your own tenant \"team-a\""), "{why}");
    let why = refused(&sock, UID_A, &[], Some("scratch"));
    assert!(why.contains("is bound to tenant \"team-a\"") && why.contains("\"scratch\""), "{why}");
    let mut a = admitted(&sock, UID_A, &[], None);
    assert_eq!(ask(&mut a, &format!("put 1 11 {MIB}")), "ok");
    let a2 = admitted(&sock, UID_A, &[], Some("default"));
    let v = stats(&sock);
    assert_eq!((row_num(&v, "team-a", "clients"), row_num(&v, "team-a", "blocks")), (2, 1), "{v}");
    assert_eq!((row_num(&v, "default", "clients"), row_num(&v, "default", "blocks")), (0, 0), "{v}");
    let mut c = admitted(&sock, UID_C, &[], None);
    assert_eq!(ask(&mut c, "delete 1"), "denied");
    assert_eq!(row_num(&stats(&sock), "team-b", "clients"), 1);
    // An unbound uid is as before: any unbound tenant, or none.
    let e = admitted(&sock, UID_E, &[], Some("scratch"));
    assert_eq!(row_num(&stats(&sock), "scratch", "clients"), 1);
    for p in [a, a2, c, e] {
        p.finish(LIMIT);
    }
}

/// `--tenant-gid` binds by group, supplementary ones included: a client in
/// the bound group (not its primary one) is put in the tenant naming none;
/// a client of the same primary group without it is refused naming the
/// tenant, and cannot delete its block.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs clients as other uids (run as root, as CI does)")]
fn a_gid_binding_takes_supplementary_groups() {
    need::root("a_gid_binding_takes_supplementary_groups");
    let dir = shared_dir("bound-gid");
    let sock = dir.0.join("s.sock");
    let gid = format!("team-g={GID_BOUND}");
    let _d = daemon(&sock, &["--tenant-gid", &gid]);
    let mut member = admitted(&sock, UID_D, &[GID_BOUND], None);
    assert_eq!(ask(&mut member, &format!("put 1 11 {MIB}")), "ok");
    let named = admitted(&sock, UID_D, &[GID_BOUND], Some("team-g"));
    let v = stats(&sock);
    assert_eq!((row_num(&v, "team-g", "clients"), row_num(&v, "team-g", "blocks")), (2, 1), "{v}");
    let why = refused(&sock, UID_E, &[], Some("team-g"));
    assert!(why.contains("tenant \"team-g\" is bound") && why.contains(&format!("uid {UID_E}")), "{why}");
    let mut other = admitted(&sock, UID_E, &[], None);
    assert_eq!(ask(&mut other, &format!("get 1 11 {MIB}")), "ok");
    assert_eq!(ask(&mut other, "delete 1"), "denied");
    assert_eq!(ask(&mut member, "delete 1"), "deleted");
    for p in [member, named, other] {
        p.finish(LIMIT);
    }
}

/// A takeover keeps each connected client's tenant (it is the store
/// session's, in the handed-over state) and the new daemon applies the
/// bindings of its own command line: team-a's client, connected before,
/// still deletes team-a's block; another client, connected before, still
/// cannot; a new connection naming team-a from another uid is refused.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs clients as other uids (run as root, as CI does)")]
fn a_takeover_keeps_each_clients_tenant_and_the_bindings() {
    need::root("a_takeover_keeps_each_clients_tenant_and_the_bindings");
    let dir = shared_dir("bound-takeover");
    let sock = dir.0.join("s.sock");
    let uid_a = format!("team-a={UID_A}");
    let gid = GID_ADMITTED.to_string();
    let mut old = daemon(&sock, &["--tenant-uid", &uid_a]);
    let mut a = admitted(&sock, UID_A, &[], Some("team-a"));
    assert_eq!(ask(&mut a, &format!("put 1 11 {MIB}")), "ok");
    assert_eq!(ask(&mut a, &format!("put 2 22 {MIB}")), "ok");
    let mut b = admitted(&sock, UID_B, &[], None);
    assert_eq!(ask(&mut b, "delete 1"), "denied");
    let mut new = Daemon::spawn_with(&sock, "64MiB", &["--takeover", "--allow-gid", &gid, "--tenant-uid", &uid_a]);
    log_has(&new, "took over");
    old.wait_exit(LIMIT).expect("the old daemon exits");
    assert_eq!(ask(&mut b, "delete 1"), "denied");
    assert_eq!(ask(&mut b, &format!("put 2 33 {MIB}")), "denied");
    assert_eq!(ask(&mut b, &format!("get 2 22 {MIB}")), "ok");
    assert_eq!(ask(&mut a, "delete 1"), "deleted", "team-a's client is still team-a's");
    let why = refused(&sock, UID_B, &[], Some("team-a"));
    assert!(why.contains("tenant \"team-a\" is bound"), "{why}");
    let v = stats(&sock);
    assert_eq!((row_num(&v, "team-a", "clients"), row_num(&v, "team-a", "blocks")), (1, 1), "{v}");
    assert!(invariants_ok(&v), "{v}");
    a.finish(LIMIT);
    b.finish(LIMIT);
    new.signal(rustix::process::Signal::TERM);
    new.wait_exit(LIMIT).expect("the new daemon stops");
}

/// With the disk tier: a DENIED delete does not reach the tier behind the
/// megaslab (the disk copy stays), and a bound tenant's block filled back
/// from disk after a restart is its tenant's again, bound again: another
/// client reads it but cannot delete it; team-a's client can, on disk too.
#[test]
#[cfg_attr(not(kdb_root), ignore = "needs root: runs clients as other uids (run as root, as CI does)")]
fn a_denied_delete_leaves_the_disk_copy_and_a_filled_block_stays_bound() {
    need::root("a_denied_delete_leaves_the_disk_copy_and_a_filled_block_stays_bound");
    let dir = shared_dir("bound-disk");
    let disk = TempDir::new("bound-disk-tier");
    let sock = dir.0.join("s.sock");
    let uid_a = format!("team-a={UID_A}");
    let args = ["--tenant-uid", uid_a.as_str(), "--disk", disk.0.to_str().expect("utf-8"), "--disk-size", "64MiB"];
    let written = |what: &str, n: u64| {
        poll_stats_fast(&sock, LIMIT, what, |v| {
            v["disk_indexed"] == true && num(v, "disk_queue_blocks") == 0 && num(v, "disk_blocks") == n
        })
        .0
    };
    let mut d = daemon(&sock, &args);
    let mut a = admitted(&sock, UID_A, &[], Some("team-a"));
    assert_eq!(ask(&mut a, &format!("put 1 11 {MIB}")), "ok");
    written("team-a's block on disk", 1);
    let mut b = admitted(&sock, UID_B, &[], None);
    assert_eq!(ask(&mut b, "delete 1"), "denied");
    a.finish(LIMIT);
    b.finish(LIMIT);
    d.signal(rustix::process::Signal::TERM);
    d.wait_exit(LIMIT).expect("the daemon stops");

    let _d = daemon(&sock, &args);
    written("team-a's disk copy, kept through the denied delete and the restart", 1);
    let mut b = admitted(&sock, UID_B, &[], None);
    assert_eq!(ask(&mut b, &format!("get 1 11 {MIB}")), "ok", "filled back from disk, bytes intact");
    assert_eq!(row_num(&stats(&sock), "team-a", "blocks"), 1, "filled back as team-a's");
    assert_eq!(ask(&mut b, "delete 1"), "denied");
    let mut a = admitted(&sock, UID_A, &[], Some("team-a"));
    assert_eq!(ask(&mut a, "delete 1"), "deleted");
    written("the disk copy deleted", 0);
    a.finish(LIMIT);
    b.finish(LIMIT);
}

/// A bad binding is a clear error at start, before anything is made: a
/// name in place of a number, the default tenant, a tenant named twice,
/// bindings without tenant accounting. `--help` explains both flags.
#[test]
fn a_bad_binding_is_refused_at_start() {
    let dir = TempDir::new("bad-binding");
    let sock = dir.socket();
    for (args, says) in [
        (&["--tenant-uid", "team-a=alice"][..], "not a numeric id"),
        (&["--tenant-gid", "team-a=1,x"][..], "not a numeric id"),
        (&["--tenant-uid", "team-a"][..], "give NAME=ID"),
        (&["--tenant-uid", "default=1000"][..], "cannot be bound"),
        (&["--tenant-uid", "_other=1000"][..], "tenant name"),
        (&["--tenant-uid", "team-a=1", "--tenant-uid", "team-a=2"][..], "named twice"),
        (&["--tenant-uid", "team-a=1", "--tenant-accounting", "off"][..], "need --tenant-accounting on"),
    ] {
        let out = std::process::Command::new(BIN)
            .args(["serve", "--size", "16MiB", "--socket"])
            .arg(&sock)
            .args(args)
            .env_remove("KACHEDB_SOCKET")
            .output()
            .expect("run kachedb serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {}\n{err}", out.status);
        assert!(!sock.exists(), "{args:?}: a socket was made");
    }
    let out = std::process::Command::new(BIN).args(["serve", "--help"]).output().expect("kachedb serve --help");
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--tenant-uid <NAME=UID[,UID…]>", "--tenant-gid <NAME=GID[,GID…]>", "DENIED"] {
        assert!(help.contains(flag), "--help does not say {flag:?}:\n{help}");
    }
}
