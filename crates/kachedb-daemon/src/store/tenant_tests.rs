//! Unit tests of tenants (`tenants.rs`): limits evict the tenant's own
//! blocks leaves first, a block that cannot fit within its limit changes
//! nothing, other tenants' limited and pinned blocks are never taken, rows
//! fold into `_other` past the bound, per-tenant figures add up to the
//! totals, reachable and orphaned bytes follow cuts.

use super::tests::{reserve_req, SLAB_OFFSET};
use super::*;
use crate::alloc::PAGE_LEN;
use kachedb_shm::control::{MAX_TENANTS, OTHER_TENANT};
use kachedb_shm::OutOfMemoryCause;

fn ok(st: &mut Store, s: SessionId, req: Request) -> Completion {
    let c = st.handle(s, 1, &req);
    st.check_invariants().unwrap();
    assert_eq!(c.status, Status::Ok, "{req:?}");
    c
}

/// A one-page block `key` of session `s` following `parent`; the answer to its RESERVE.
fn put(st: &mut Store, s: SessionId, key: u128, parent: Option<u128>) -> Completion {
    let r = st.handle(s, 1, &reserve_req(key, 100, 0));
    st.check_invariants().unwrap();
    if r.status == Status::Ok {
        ok(st, s, Request::Commit { handle: r.handle, parent });
    }
    r
}

fn row(st: &Store, name: &str) -> TenantStats {
    st.tenant_stats().into_iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tenant {name}"))
}

fn totals_add_up(st: &Store) {
    let all = st.stats();
    let rows = st.tenant_stats();
    let sum = |f: fn(&TenantStats) -> u64| rows.iter().map(f).sum::<u64>();
    assert_eq!(sum(|t| t.bytes), all.bytes_used);
    assert_eq!(sum(|t| t.blocks), all.blocks);
    assert_eq!(sum(|t| t.evictions), all.evictions);
    assert_eq!(sum(|t| t.evicted_bytes), all.evicted_bytes);
    assert_eq!(sum(|t| t.get_hits), all.get_hits);
    assert_eq!(sum(|t| t.lookup_hits), all.lookup_hits);
    assert_eq!(sum(|t| t.reachable_bytes), all.reachable_bytes);
    assert_eq!(sum(|t| t.orphaned_bytes), all.orphaned_bytes);
}

use kachedb_shm::control::TenantStats;

/// Two tenants with limits of 4 and 12 pages on a 16-page megaslab, both
/// writing chains: each stays within its limit, evicts only its own
/// blocks, leaves first; the other's pinned block is never touched.
#[test]
fn a_tenant_at_its_limit_evicts_its_own_leaves_and_nobody_elses() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[("a".into(), 4 * PAGE_LEN), ("b".into(), 12 * PAGE_LEN)], true);
    let (a, b) = (st.open_session(), st.open_session());
    assert_eq!(st.set_session_tenant(a, "a"), "a");
    assert_eq!(st.set_session_tenant(b, "b"), "b");
    // b pins its first block, then both write far past their limits.
    put(&mut st, b, 1000, None);
    let pin = ok(&mut st, b, Request::Get { key: 1000 });
    for i in 0..40u128 {
        assert_eq!(put(&mut st, a, i, (i > 0).then(|| i - 1)).status, Status::Ok);
        assert_eq!(put(&mut st, b, 1001 + i, Some(1000 + i)).status, Status::Ok);
        assert!(row(&st, "a").bytes <= 4 * PAGE_LEN);
        assert!(row(&st, "b").bytes <= 12 * PAGE_LEN);
        assert!(st.peek(1000).is_some(), "b's pinned block is there");
        totals_add_up(&st);
    }
    assert_eq!(row(&st, "a").blocks, 4);
    assert_eq!(row(&st, "b").blocks, 12);
    assert!(row(&st, "a").evictions > 0 && row(&st, "b").evictions > 0);
    ok(&mut st, b, Request::Release { handle: pin.handle });
    totals_add_up(&st);
}

/// A block that cannot fit within its tenant's limit even after evicting
/// the tenant's own evictable blocks is refused with the tenant-limit cause
/// and nothing is evicted; the other tenant and the megaslab are untouched.
#[test]
fn a_block_that_cannot_fit_within_the_limit_changes_nothing() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[("a".into(), 3 * PAGE_LEN)], true);
    let a = st.open_session();
    st.set_session_tenant(a, "a");
    put(&mut st, a, 1, None);
    put(&mut st, a, 2, None);
    let pins = [ok(&mut st, a, Request::Get { key: 1 }), ok(&mut st, a, Request::Get { key: 2 })];
    put(&mut st, a, 3, None);
    // 1 and 2 are pinned, 3 is evictable: a 2-page block needs 4 pages of 3.
    let before = (st.stats(), st.tenant_stats());
    let c = st.handle(a, 9, &reserve_req(4, PAGE_LEN + 1, 0));
    st.check_invariants().unwrap();
    assert_eq!(c.status, Status::OutOfMemory);
    assert_eq!(
        kachedb_shm::OutOfMemoryCause::of(c.handle, c.offset),
        kachedb_shm::OutOfMemoryCause::TenantLimit(3 * PAGE_LEN)
    );
    let after = st.stats();
    assert_eq!((after.blocks, after.evictions, after.bytes_used), (before.0.blocks, 0, before.0.bytes_used));
    assert_eq!((after.tenant_limit_hits, after.out_of_memory), (1, 1));
    assert_eq!(row(&st, "a").limit_refusals, 1);
    assert!(st.peek(3).is_some());
    // Larger than the limit itself: refused the same way.
    let c = st.handle(a, 9, &reserve_req(5, 3 * PAGE_LEN + 1, 0));
    assert_eq!(
        kachedb_shm::OutOfMemoryCause::of(c.handle, c.offset),
        kachedb_shm::OutOfMemoryCause::TenantLimit(3 * PAGE_LEN)
    );
    // A one-page block fits by evicting 3.
    assert_eq!(put(&mut st, a, 6, None).status, Status::Ok);
    assert!(st.peek(3).is_none() && st.peek(6).is_some());
    for p in pins {
        ok(&mut st, a, Request::Release { handle: p.handle });
    }
    totals_add_up(&st);
}

/// Under `chain`, a tenant's blocks held by children of its own are not
/// leaves: the dry run sees that evicting the tenant's own list cannot free
/// them, and refuses without evicting anything.
#[test]
fn the_dry_run_follows_the_chain_policy() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[("a".into(), 4 * PAGE_LEN)], true);
    let a = st.open_session();
    st.set_session_tenant(a, "a");
    // a: chain 1 <- 2 <- 3 <- 4, its leaf 4 pinned by a itself.
    for k in 1..=4 {
        put(&mut st, a, k, (k > 1).then(|| k - 1));
    }
    let pin = ok(&mut st, a, Request::Get { key: 4 });
    let c = st.handle(a, 1, &reserve_req(5, 100, 0));
    st.check_invariants().unwrap();
    assert_eq!(c.status, Status::OutOfMemory, "a's chain is held by its own pinned leaf");
    assert_eq!(st.stats().evictions, 0);
    // Released, the chain is evictable tail first.
    ok(&mut st, a, Request::Release { handle: pin.handle });
    assert_eq!(put(&mut st, a, 5, None).status, Status::Ok);
    assert!(st.peek(4).is_none() && st.peek(1).is_some() && st.peek(3).is_some());
}

/// Another tenant's child does not hold a parent: a tenant at its limit
/// evicts its own block although `b` stored a block naming it as parent;
/// `b`'s block stays, without its parent (a cut link, counted).
#[test]
fn another_tenants_child_does_not_hold_a_parent() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[("a".into(), 3 * PAGE_LEN)], true);
    let (a, b) = (st.open_session(), st.open_session());
    st.set_session_tenant(a, "a");
    st.set_session_tenant(b, "b");
    // a: chain 1 <- 2 <- 3; b's block 10 follows a's 3 (a shared prefix).
    put(&mut st, a, 1, None);
    put(&mut st, a, 2, Some(1));
    put(&mut st, a, 3, Some(2));
    put(&mut st, b, 10, Some(3));
    assert_eq!(put(&mut st, a, 4, None).status, Status::Ok);
    assert!(st.peek(3).is_none() && st.peek(1).is_some() && st.peek(2).is_some() && st.peek(10).is_some());
    let s = st.stats();
    assert_eq!((s.links_cut, s.links_cut_by_eviction, s.chained_blocks), (1, 1, 1));
    assert_eq!((row(&st, "b").orphaned_bytes, row(&st, "a").evictions), (PAGE_LEN, 1));
    totals_add_up(&st);
}

/// Issue 41's parent attack, both ways a victim stores: with a limit, and on
/// the shared list (no limits). The attacker stores a tiny block naming each
/// of the victim's blocks as its parent, pins them, and leaves (its session
/// closes: its blocks stay). The victim keeps storing.
#[test]
fn another_tenants_children_cannot_refuse_a_tenant() {
    for limited in [true, false] {
        let mut st = Store::new(SLAB_OFFSET, 48 * PAGE_LEN);
        if limited {
            st.set_tenant_limits(None, &[("v".into(), 16 * PAGE_LEN)], true);
        }
        let (v, x) = (st.open_session(), st.open_session());
        st.set_session_tenant(v, "v");
        st.set_session_tenant(x, "x");
        let victim_blocks = if limited { 16 } else { 24 };
        for k in 0..victim_blocks {
            put(&mut st, v, k, None);
        }
        for k in 0..victim_blocks {
            put(&mut st, x, 1000 + k, Some(k));
            if !limited {
                ok(&mut st, x, Request::Get { key: 1000 + k });
            }
        }
        if limited {
            st.close_session(x);
        }
        st.check_invariants().unwrap();
        for k in 100..140 {
            assert_eq!(put(&mut st, v, k, None).status, Status::Ok, "victim put {k} (limited {limited})");
        }
        assert!(row(&st, "v").evictions > 0);
        assert_eq!(row(&st, "x").blocks, victim_blocks as u64, "the attacker's blocks stay, without parents");
        totals_add_up(&st);
    }
}

/// A pin is charged to the tenant that made it: `x` pinning all of `v`'s
/// blocks does not make `v`'s puts fail (they are `v`'s bytes but lent, not
/// charged to `v`); `x`'s pins count against `x`'s limit, where a GET past
/// it evicts `x`'s own blocks first, or (none left) is refused and changes
/// nothing.
#[test]
fn a_pin_of_another_tenants_block_is_charged_to_the_reader() {
    let mut st = Store::new(SLAB_OFFSET, 64 * PAGE_LEN);
    st.set_tenant_limits(None, &[("v".into(), 8 * PAGE_LEN), ("x".into(), 10 * PAGE_LEN)], true);
    let (v, x) = (st.open_session(), st.open_session());
    st.set_session_tenant(v, "v");
    st.set_session_tenant(x, "x");
    for k in 0..8 {
        put(&mut st, v, k, None);
    }
    put(&mut st, x, 500, None);
    put(&mut st, x, 501, None);
    let pins: Vec<Completion> = (0..8).map(|k| ok(&mut st, x, Request::Get { key: k })).collect();
    // x: 2 own + 8 borrowed = its limit of 10.
    assert_eq!((st.tenants.get(1).lent_bytes, st.charged_bytes(2)), (8 * PAGE_LEN, 10 * PAGE_LEN));
    // v stores on: its 8 pinned blocks are x's charge.
    for k in 10..20 {
        assert_eq!(put(&mut st, v, k, None).status, Status::Ok, "v's put {k}");
    }
    assert!((0..8).all(|k| st.peek(k).is_some()), "the pinned blocks stay");
    // x pins one more of v's: past its limit, its own 500 goes first.
    ok(&mut st, x, Request::Get { key: 19 });
    assert!(st.peek(500).is_none() && st.peek(501).is_some());
    ok(&mut st, x, Request::Get { key: 18 });
    assert!(st.peek(501).is_none());
    // Nothing of its own left to evict: refused, naming its limit, nothing changed.
    let before = super::unit_tests::fingerprint(&st);
    let c = st.handle(x, 1, &Request::Get { key: 17 });
    st.check_invariants().unwrap();
    assert_eq!(c.status, Status::OutOfMemory);
    assert_eq!(OutOfMemoryCause::of(c.handle, c.offset), OutOfMemoryCause::TenantLimit(10 * PAGE_LEN));
    assert_eq!(super::unit_tests::fingerprint(&st), before);
    // A second GET of a block it pins already costs nothing more.
    ok(&mut st, x, Request::Get { key: 0 });
    // Released (or x gone), v's blocks are v's charge again.
    ok(&mut st, x, Request::Release { handle: pins[1].handle });
    st.close_session(x);
    assert_eq!((st.tenants.get(1).lent_bytes, st.tenants.get(2).borrowed_bytes), (0, 0));
    totals_add_up(&st);
}

/// A leaf of `v`'s chain pinned by `x` holds none of `v`'s chain: `v`
/// evicts its ancestors (its link is cut) and stores on. A pin by `v`
/// itself, or by the daemon's own session (a tier's write-behind), holds
/// the chain as before.
#[test]
fn a_pinned_leaf_of_another_tenant_holds_no_chain() {
    let mut st = Store::new(SLAB_OFFSET, 64 * PAGE_LEN);
    st.set_tenant_limits(None, &[("v".into(), 8 * PAGE_LEN)], true);
    let (v, x, daemon) = (st.open_session(), st.open_session(), st.open_internal_session());
    st.set_session_tenant(v, "v");
    st.set_session_tenant(x, "x");
    for k in 0..8 {
        put(&mut st, v, k, (k > 0).then(|| k - 1));
    }
    // The daemon's pin of the leaf holds the chain: v is refused as before.
    let tier_pin = st.handle_internal(daemon, &Request::Get { key: 7 });
    assert_eq!(tier_pin.status, Status::Ok);
    assert_eq!(st.handle(v, 1, &reserve_req(50, 100, 0)).status, Status::OutOfMemory);
    assert_eq!(st.handle_internal(daemon, &Request::Release { handle: tier_pin.handle }).status, Status::Ok);
    st.check_invariants().unwrap();
    // x's pin of the leaf holds nothing.
    ok(&mut st, x, Request::Get { key: 7 });
    for k in 100..120 {
        assert_eq!(put(&mut st, v, k, None).status, Status::Ok, "v's put {k}");
    }
    assert!(st.peek(7).is_some() && st.peek(6).is_none());
    assert_eq!(st.stats().links_cut_by_eviction, 1);
    totals_add_up(&st);
}

/// A tenant without a limit is evicted by anyone (as before tenants); a
/// limited tenant's blocks are not, even when the megaslab is full.
#[test]
fn only_unlimited_tenants_are_evicted_by_others() {
    let mut st = Store::new(SLAB_OFFSET, 8 * PAGE_LEN);
    st.set_tenant_limits(None, &[("a".into(), 4 * PAGE_LEN)], true);
    let (a, free) = (st.open_session(), st.open_session());
    st.set_session_tenant(a, "a");
    st.set_session_tenant(free, "free");
    for k in 0..4 {
        put(&mut st, a, k, None);
    }
    for k in 10..14 {
        put(&mut st, free, k, None);
    }
    // The megaslab is full; `free` writes on and evicts only its own.
    for k in 20..30 {
        assert_eq!(put(&mut st, free, k, None).status, Status::Ok);
        assert_eq!(row(&st, "a").blocks, 4);
    }
    // `a`, within its limit with the megaslab full, evicts the least
    // recently used of its own and `free`'s blocks: here `free`'s.
    ok(&mut st, a, Request::Delete { key: 0 });
    put(&mut st, free, 30, None);
    for k in 1..4 {
        ok(&mut st, a, Request::Lookup { key: k });
    }
    let before = row(&st, "free").evictions;
    assert_eq!(put(&mut st, a, 5, None).status, Status::Ok);
    assert_eq!((row(&st, "a").blocks, row(&st, "a").evictions), (4, 0));
    assert_eq!(row(&st, "free").evictions, before + 1);
    totals_add_up(&st);
}

/// Past `MAX_TENANTS` rows, new names are counted in `_other`; a row whose
/// tenant has left with nothing held goes to the next new name.
#[test]
fn tenants_past_the_bound_fold_into_other() {
    let mut st = Store::new(SLAB_OFFSET, 256 * PAGE_LEN);
    let mut sessions = Vec::new();
    for i in 0..MAX_TENANTS - 2 {
        let s = st.open_session();
        assert_eq!(st.set_session_tenant(s, &format!("t{i}")), format!("t{i}"));
        put(&mut st, s, i as u128, None);
        sessions.push(s);
    }
    let late = st.open_session();
    assert_eq!(st.set_session_tenant(late, "late"), OTHER_TENANT);
    put(&mut st, late, 999, None);
    assert_eq!(row(&st, OTHER_TENANT).blocks, 1);
    assert_eq!(st.tenant_stats().len(), MAX_TENANTS);
    totals_add_up(&st);
    // t0 leaves and its block goes: its row is free for the next name.
    st.close_session(sessions[0]);
    ok(&mut st, late, Request::Delete { key: 0 });
    let next = st.open_session();
    assert_eq!(st.set_session_tenant(next, "next"), "next");
    assert!(st.tenant_stats().iter().all(|t| t.name != "t0"));
    assert_eq!(row(&st, "next").evictions, 0);
    st.check_invariants().unwrap();
}

/// Reachable and orphaned bytes: a chain is reachable; deleting a middle
/// block orphans its descendants (of any tenant); a block whose named
/// parent is absent is orphaned from its commit; under `lru` an evicted
/// head orphans its chain.
#[test]
fn reachable_and_orphaned_bytes_follow_the_chains() {
    let mut st = Store::new(SLAB_OFFSET, 6 * PAGE_LEN);
    let (a, b) = (st.open_session(), st.open_session());
    st.set_session_tenant(b, "b");
    put(&mut st, a, 1, None);
    put(&mut st, a, 2, Some(1));
    put(&mut st, b, 3, Some(2));
    put(&mut st, b, 4, Some(3));
    assert_eq!((st.stats().reachable_bytes, st.stats().orphaned_bytes), (4 * PAGE_LEN, 0));
    ok(&mut st, a, Request::Delete { key: 2 });
    assert_eq!((st.stats().reachable_bytes, st.stats().orphaned_bytes), (PAGE_LEN, 2 * PAGE_LEN));
    assert_eq!((row(&st, "b").reachable_bytes, row(&st, "b").orphaned_bytes), (0, 2 * PAGE_LEN));
    put(&mut st, a, 5, Some(77));
    assert_eq!(st.stats().orphaned_bytes, 3 * PAGE_LEN);
    totals_add_up(&st);

    let mut st = Store::new(SLAB_OFFSET, 3 * PAGE_LEN);
    st.set_eviction_policy(EvictionPolicy::Lru);
    let a = st.open_session();
    put(&mut st, a, 1, None);
    put(&mut st, a, 2, Some(1));
    put(&mut st, a, 3, Some(2));
    ok(&mut st, a, Request::Lookup { key: 3 });
    ok(&mut st, a, Request::Lookup { key: 2 });
    put(&mut st, a, 4, None); // evicts the head 1: 2 and 3 are orphaned
    assert_eq!((st.stats().reachable_bytes, st.stats().orphaned_bytes), (PAGE_LEN, 2 * PAGE_LEN));
}

/// Hits, misses and the request window per tenant; off, every client is
/// the default tenant's and no window is kept.
#[test]
fn hits_misses_and_the_window_per_tenant() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    let (a, b) = (st.open_session(), st.open_session());
    st.set_session_tenant(a, "a");
    put(&mut st, a, 1, None);
    for _ in 0..3 {
        ok(&mut st, b, Request::Lookup { key: 1 });
    }
    assert_eq!(st.handle(a, 1, &Request::Get { key: 2 }).status, Status::NotFound);
    let g = ok(&mut st, a, Request::Get { key: 1 });
    ok(&mut st, a, Request::Release { handle: g.handle });
    let (ra, rd) = (row(&st, "a"), row(&st, "default"));
    assert_eq!((ra.get_hits, ra.get_misses, rd.lookup_hits), (1, 1, 3));
    assert_eq!((ra.window_key_requests, ra.window_distinct_keys), (2, 2));
    assert_eq!((rd.window_key_requests, rd.window_distinct_keys), (3, 1));
    assert_eq!(st.window(), (2, 5));
    let s = st.stats();
    assert!((s.hit_ratio_ceiling - (1.0 - 2.0 / 5.0)).abs() < 1e-9);
    st.restart_window();
    assert_eq!(st.window(), (0, 0));
    totals_add_up(&st);

    let mut off = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    off.set_tenant_limits(None, &[], false);
    let a = off.open_session();
    assert_eq!(off.set_session_tenant(a, "a"), "default");
    put(&mut off, a, 1, None);
    ok(&mut off, a, Request::Lookup { key: 1 });
    assert_eq!(off.window(), (0, 0));
    assert_eq!(off.tenant_stats().len(), 2);
}

/// A store carried through its serialized form keeps its tenants, and a
/// new limit applied to it moves the blocks to the right lists.
#[test]
fn tenants_survive_a_handover() {
    let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
    st.set_tenant_limits(None, &[("a".into(), 8 * PAGE_LEN)], true);
    let a = st.open_session();
    st.set_session_tenant(a, "a");
    for k in 0..6 {
        put(&mut st, a, k, (k > 0).then(|| k - 1));
    }
    let mut back = st.carried(SLAB_OFFSET, 16 * PAGE_LEN).unwrap();
    assert_eq!(back.tenant_stats(), st.tenant_stats());
    back.set_tenant_limits(Some(2 * PAGE_LEN), &[], true);
    back.check_invariants().unwrap();
    back.set_tenant_limits(None, &[("a".into(), 3 * PAGE_LEN)], true);
    back.check_invariants().unwrap();
    assert_eq!(put(&mut back, a, 10, None).status, Status::Ok);
    assert!(row(&back, "a").bytes <= 3 * PAGE_LEN);
}
