//! Unit tests of the ownership rule (`blocks.rs` `may_change`): a block of a
//! bound tenant is replaced or deleted only by that tenant's sessions and the
//! daemon's own; anyone reads it; a refused request changes nothing and
//! leaves the reservation open; unbound tenants' blocks stay open to all.

use super::tests::{reserve_req, SLAB_OFFSET};
use super::*;
use crate::alloc::PAGE_LEN;

fn answer(st: &mut Store, s: SessionId, req: Request) -> Completion {
    let c = st.handle(s, 1, &req);
    st.check_invariants().unwrap();
    c
}

fn ok(st: &mut Store, s: SessionId, req: Request) -> Completion {
    let c = answer(st, s, req);
    assert_eq!(c.status, Status::Ok, "{req:?}");
    c
}

/// A RESERVE of one page under `key` by `s`; its handle.
fn reserve(st: &mut Store, s: SessionId, key: u128) -> u64 {
    ok(st, s, reserve_req(key, 100, 0)).handle
}

/// A store of 16 pages where tenant `a` is bound, with a session of `a`, of
/// the unbound `b`, of the default tenant, and the daemon's own.
fn store() -> (Store, [SessionId; 4]) {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[], true);
    st.set_bound_tenants(&["a".into()]).unwrap();
    let (a, b, d) = (st.open_session(), st.open_session(), st.open_session());
    st.set_session_tenant(a, "a");
    st.set_session_tenant(b, "b");
    let internal = st.open_internal_session();
    (st, [a, b, d, internal])
}

/// What the store holds, for "nothing changed".
fn snapshot(st: &Store, key: u128) -> (Option<BlockInfo>, Option<String>, u64, u64, u64) {
    let s = st.stats();
    (st.peek(key), st.block_tenant(key).map(str::to_owned), s.blocks, s.bytes_used, s.reserved)
}

#[test]
fn another_tenant_cannot_delete_or_replace_a_bound_tenants_block_but_reads_it() {
    let (mut st, [a, b, d, _]) = store();
    let h = reserve(&mut st, a, 7);
    ok(&mut st, a, Request::Commit { handle: h, parent: None });
    let before = snapshot(&st, 7);
    for s in [b, d] {
        // Read: yes.
        let pin = ok(&mut st, s, Request::Get { key: 7 });
        ok(&mut st, s, Request::Lookup { key: 7 });
        ok(&mut st, s, Request::Release { handle: pin.handle });
        // Delete: DENIED, nothing changed.
        assert_eq!(answer(&mut st, s, Request::Delete { key: 7 }).status, Status::Denied);
        assert_eq!(snapshot(&st, 7), before);
        // Replace, by each COMMIT: DENIED, the reservation still open (then aborted).
        for pin in [false, true] {
            let h = reserve(&mut st, s, 7);
            let commit = if pin {
                Request::CommitPin { handle: h, parent: None }
            } else {
                Request::Commit { handle: h, parent: None }
            };
            assert_eq!(answer(&mut st, s, commit).status, Status::Denied);
            assert_eq!(st.stats().reserved, 1, "the refused COMMIT left the reservation open");
            assert_eq!(st.reservation_key(s, h), Some(7));
            ok(&mut st, s, Request::Abort { handle: h });
            assert_eq!(snapshot(&st, 7), before);
        }
        // COMMIT_NAMES_KEY onto the bound block: DENIED, still open under its own key.
        let h = reserve(&mut st, s, 8);
        for pin in [false, true] {
            assert_eq!(
                answer(&mut st, s, Request::CommitAs { handle: h, key: 7, parent: None, pin }).status,
                Status::Denied
            );
            assert_eq!(st.reservation_key(s, h), Some(8));
        }
        assert_eq!((st.peek(7), st.block_tenant(7).map(str::to_owned)), (before.0, before.1.clone()));
        ok(&mut st, s, Request::Commit { handle: h, parent: None });
        ok(&mut st, s, Request::Delete { key: 8 });
    }
    assert_eq!(st.stats().denied, 2 * 5);
}

#[test]
fn the_bound_tenant_and_the_daemon_change_its_blocks() {
    let (mut st, [a, b, _, internal]) = store();
    let h = reserve(&mut st, a, 7);
    ok(&mut st, a, Request::Commit { handle: h, parent: None });
    // Its own session replaces and deletes it.
    let h = reserve(&mut st, a, 7);
    ok(&mut st, a, Request::Commit { handle: h, parent: None });
    assert_eq!(st.stats().replaced, 1);
    ok(&mut st, a, Request::Delete { key: 7 });
    assert!(st.peek(7).is_none());
    // The daemon's own session (a tier's fill) is not held to it.
    let h = reserve(&mut st, a, 7);
    ok(&mut st, a, Request::Commit { handle: h, parent: None });
    let h = reserve(&mut st, internal, 7);
    ok(&mut st, internal, Request::Commit { handle: h, parent: None });
    ok(&mut st, internal, Request::Delete { key: 7 });
    // A key the bound tenant does not hold is anyone's to store; once
    // another tenant holds it, the bound tenant may replace it too.
    let h = reserve(&mut st, b, 9);
    ok(&mut st, b, Request::Commit { handle: h, parent: None });
    assert_eq!(st.block_tenant(9), Some("b"));
    let h = reserve(&mut st, a, 9);
    ok(&mut st, a, Request::Commit { handle: h, parent: None });
    assert_eq!(st.block_tenant(9), Some("a"));
    assert_eq!(answer(&mut st, b, Request::Delete { key: 9 }).status, Status::Denied);
    assert_eq!(st.stats().denied, 1);
}

#[test]
fn unbound_tenants_blocks_are_open_to_every_session() {
    let (mut st, [a, b, d, _]) = store();
    for (owner, other) in [(b, d), (d, b), (b, a)] {
        let h = reserve(&mut st, owner, 3);
        ok(&mut st, owner, Request::Commit { handle: h, parent: None });
        // Another session deletes it, or replaces it and the owner deletes
        // the new block (unbound too, unless the bound tenant replaced it).
        ok(&mut st, other, Request::Delete { key: 3 });
        let h = reserve(&mut st, owner, 3);
        ok(&mut st, owner, Request::Commit { handle: h, parent: None });
        let h = reserve(&mut st, other, 3);
        ok(&mut st, other, Request::Commit { handle: h, parent: None });
        let deleted = answer(&mut st, owner, Request::Delete { key: 3 }).status;
        assert_eq!(deleted, if other == a { Status::Denied } else { Status::Ok });
        if other == a {
            ok(&mut st, a, Request::Delete { key: 3 });
        }
    }
    assert_eq!(st.stats().denied, 1);
}

#[test]
fn binding_pins_a_row_and_survives_a_handover_by_being_set_again() {
    let (mut st, [a, b, _, internal]) = store();
    // The daemon's own sessions are closed before a handover.
    st.close_session(internal);
    let h = reserve(&mut st, a, 7);
    ok(&mut st, a, Request::Commit { handle: h, parent: None });
    // Carried through the serialized form (which has no marker), then bound
    // again from the new daemon's command line, as `Daemon::take_over` does.
    let mut back = st.carried(SLAB_OFFSET, 16 * PAGE_LEN).unwrap();
    assert_eq!(back.session_tenant(a), Some("a"), "the session keeps its tenant");
    assert_eq!(back.session_tenant(b), Some("b"));
    back.set_tenant_limits(None, &[], true);
    back.set_bound_tenants(&["a".into()]).unwrap();
    assert_eq!(answer(&mut back, b, Request::Delete { key: 7 }).status, Status::Denied);
    ok(&mut back, a, Request::Delete { key: 7 });
}

#[test]
fn binding_needs_accounting_and_a_name_of_its_own() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[], false);
    assert!(st.set_bound_tenants(&["a".into()]).unwrap_err().contains("--tenant-accounting on"));
    st.set_tenant_limits(None, &[], true);
    assert!(st.set_bound_tenants(&["default".into()]).is_err());
    // Every row taken by a tenant with a client: no row for a new bound name.
    let sessions: Vec<SessionId> = (0..MAX_TENANTS).map(|_| st.open_session()).collect();
    for (i, &s) in sessions.iter().enumerate() {
        st.set_session_tenant(s, &format!("t{i}"));
    }
    assert!(st.set_bound_tenants(&["late".into()]).unwrap_err().contains("rows are in use"));
    assert!(st.set_bound_tenants(&["t3".into()]).is_ok(), "a name with a row of its own binds");
}

#[test]
fn every_bound_tenant_gets_a_row_of_its_own() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[], true);
    st.set_bound_tenants(&["a".into(), "b".into(), "c".into()]).unwrap();
    let s: Vec<SessionId> = (0..4).map(|_| st.open_session()).collect();
    for (i, (&x, name)) in s.iter().zip(["a", "b", "c", "d"]).enumerate() {
        assert_eq!(st.set_session_tenant(x, name), name);
        let h = reserve(&mut st, x, 10 + i as u128);
        ok(&mut st, x, Request::Commit { handle: h, parent: None });
        assert_eq!(st.block_tenant(10 + i as u128), Some(name));
    }
    // Each bound tenant's block is denied to the three others; d's is not.
    for (i, &owner) in s[..3].iter().enumerate() {
        for &y in s.iter().filter(|&&y| y != owner) {
            assert_eq!(answer(&mut st, y, Request::Delete { key: 10 + i as u128 }).status, Status::Denied);
        }
    }
    ok(&mut st, s[0], Request::Delete { key: 13 });
}

use kachedb_shm::control::MAX_TENANTS;
