//! Tests of `unit.rs`: a refused RESERVE, GET or reservation unit leaves the
//! store exactly as it was (the same keys at the same extents in the same
//! slots, the same links, lists, figures and counters but for the counts of
//! requests and answers), and an admitted unit is the same as its RESERVEs
//! one by one.

use super::tests::{reserve_req, SLAB_OFFSET};
use super::*;
use crate::alloc::PAGE_LEN;
use proptest::prelude::*;

/// The store's whole serialized state, but for what counts requests and
/// answers (and refusals) and the last request's limit: what a refusal must
/// leave as it was.
pub(super) fn fingerprint(st: &Store) -> serde_json::Value {
    let mut v = serde_json::to_value(st).expect("a store serializes");
    let o = v.as_object_mut().expect("an object");
    o.remove("limit_hit");
    let c = o.get_mut("counters").and_then(|c| c.as_object_mut()).expect("counters");
    for k in ["requests", "ok", "errors", "client_limit_hits", "tenant_limit_hits"] {
        c.remove(k).unwrap_or_else(|| panic!("no counter {k}"));
    }
    let rows = v["tenants"]["rows"].as_array_mut().expect("tenant rows");
    for r in rows {
        r["figures"].as_object_mut().expect("figures").remove("limit_refusals");
    }
    v
}

fn ok(st: &mut Store, s: SessionId, req: Request) -> Completion {
    let c = st.handle(s, 1, &req);
    st.check_invariants().unwrap();
    assert_eq!(c.status, Status::Ok, "{req:?}");
    c
}

/// A block of `pages` pages, `key`, following `parent`.
fn put(st: &mut Store, s: SessionId, key: u128, pages: u64, parent: Option<u128>) {
    let r = ok(st, s, reserve_req(key, pages * PAGE_LEN, 0));
    ok(st, s, Request::Commit { handle: r.handle, parent });
}

/// `unit` as RESERVEs with request ids from 100.
fn unit_of(keys_pages: &[(u128, u64)]) -> Vec<(u32, Request)> {
    keys_pages
        .iter()
        .enumerate()
        .map(|(i, &(k, pages))| (100 + i as u32, reserve_req(k, pages * PAGE_LEN, 0)))
        .collect()
}

fn run_unit(st: &mut Store, s: SessionId, unit: &[(u32, Request)]) -> Vec<Completion> {
    let mut out = Vec::new();
    st.handle_unit(s, unit, &mut out);
    st.check_invariants().unwrap();
    assert_eq!(out.len(), unit.len());
    for (c, (id, _)) in out.iter().zip(unit) {
        assert_eq!((c.request_id, c.op), (*id, kachedb_shm::Op::Reserve));
    }
    out
}

/// The first repro of issue 41: a tenant at its limit of 16 pages, holding
/// 16 one-page blocks, sends a batch of 17: one by one each RESERVE evicted
/// one of its blocks and the 17th was refused, leaving it none. As a unit it
/// is refused whole and the 16 blocks stay.
#[test]
fn a_batch_past_the_tenant_limit_evicts_nothing() {
    let mut st = Store::new(SLAB_OFFSET, 64 * PAGE_LEN);
    st.set_tenant_limits(None, &[("a".into(), 16 * PAGE_LEN)], true);
    let a = st.open_session();
    st.set_session_tenant(a, "a");
    for k in 0..16 {
        put(&mut st, a, k, 1, None);
    }
    let (before, s0) = (fingerprint(&st), st.stats());
    let unit = unit_of(&(100..117).map(|k| (k, 1)).collect::<Vec<_>>());
    let out = run_unit(&mut st, a, &unit);
    for c in &out {
        assert_eq!(c.status, Status::OutOfMemory);
        assert_eq!(OutOfMemoryCause::of(c.handle, c.offset), OutOfMemoryCause::TenantLimit(16 * PAGE_LEN));
    }
    assert_eq!(fingerprint(&st), before);
    let s = st.stats();
    assert_eq!((s.blocks, s.evictions, s.reserved, s.reserves - s0.reserves, s.out_of_memory), (16, 0, 0, 17, 17));
    assert_eq!(s.tenant_limit_hits, 1);
    // 16 of them fit: admitted, each evicting one of the tenant's own blocks.
    let out = run_unit(&mut st, a, &unit[..16]);
    assert!(out.iter().all(|c| c.status == Status::Ok));
    assert_eq!((st.stats().reserved, st.stats().evictions), (16, 16));
}

/// The second repro: no limits, tenant `b` fills the megaslab with 40
/// one-page blocks; tenant `c` sends 41 pages as a batch. One by one each
/// RESERVE evicted one of `b`'s blocks and the last was refused, leaving the
/// store empty. As a unit, nothing of `b`'s goes.
#[test]
fn a_batch_larger_than_the_megaslab_costs_another_tenant_nothing() {
    let mut st = Store::new(SLAB_OFFSET, 40 * PAGE_LEN);
    let (b, c) = (st.open_session(), st.open_session());
    st.set_session_tenant(b, "b");
    st.set_session_tenant(c, "c");
    for k in 0..40 {
        put(&mut st, b, k, 1, (k > 0).then(|| k - 1));
    }
    let before = fingerprint(&st);
    let out = run_unit(&mut st, c, &unit_of(&(100..141).map(|k| (k, 1)).collect::<Vec<_>>()));
    assert!(out.iter().all(|x| x.status == Status::OutOfMemory && x.offset == 0));
    assert_eq!(fingerprint(&st), before);
    assert_eq!(st.stats().blocks, 40);
}

/// A single RESERVE that evicts and then finds no room (fragmentation by a
/// pinned block) changes nothing: the blocks it evicted come back.
#[test]
fn a_reserve_refused_after_evicting_changes_nothing() {
    // [1][2 pinned][3] and a 2-page request: enough bytes, no contiguous room.
    let mut st = Store::new(SLAB_OFFSET, 3 * PAGE_LEN);
    let s = st.open_session();
    for k in 1..=3 {
        put(&mut st, s, k, 1, None);
    }
    ok(&mut st, s, Request::Get { key: 2 });
    let before = fingerprint(&st);
    let c = st.handle(s, 9, &reserve_req(9, 2 * PAGE_LEN, 0));
    st.check_invariants().unwrap();
    assert_eq!(c.status, Status::OutOfMemory);
    assert_eq!(fingerprint(&st), before);
    assert!(st.peek(1).is_some() && st.peek(3).is_some());
    assert_eq!(st.stats().evictions, 0);
}

/// Under the chain policy the list runs empty while unpinned ancestors of a
/// pinned block remain: the leaves evicted on the way come back, links,
/// rooted bytes and list places included.
#[test]
fn a_reserve_refused_when_the_list_runs_empty_changes_nothing() {
    for policy in [EvictionPolicy::Chain, EvictionPolicy::Lru] {
        let mut st = Store::new(SLAB_OFFSET, 8 * PAGE_LEN);
        st.set_eviction_policy(policy);
        let s = st.open_session();
        // A chain 1 <- 2 <- 3 <- 4 with 4 pinned, and two chains of two.
        for k in 1..=4 {
            put(&mut st, s, k, 1, (k > 1).then(|| k - 1));
        }
        ok(&mut st, s, Request::Get { key: 4 });
        put(&mut st, s, 10, 1, None);
        put(&mut st, s, 11, 1, Some(10));
        put(&mut st, s, 20, 1, None);
        put(&mut st, s, 21, 1, Some(20));
        ok(&mut st, s, Request::Lookup { key: 1 });
        let before = fingerprint(&st);
        // 5 pages: under chain only 10, 11, 20, 21 may go (4 pages); under lru
        // 1..3 as well, but never 4 contiguous with the pinned 4 in between.
        let c = st.handle(s, 9, &reserve_req(9, 5 * PAGE_LEN, 0));
        st.check_invariants().unwrap();
        assert_eq!(c.status, Status::OutOfMemory, "{policy:?}");
        assert_eq!(fingerprint(&st), before, "{policy:?}");
    }
}

/// A unit whose last RESERVE is refused after the first ones evicted a chain
/// (under LRU, cutting links and orphaning blocks) puts everything back.
#[test]
fn a_unit_refused_late_undoes_cuts_and_orphans() {
    let mut st = Store::new(SLAB_OFFSET, 10 * PAGE_LEN);
    st.set_eviction_policy(EvictionPolicy::Lru);
    let (a, b) = (st.open_session(), st.open_session());
    st.set_session_tenant(b, "b");
    for k in 1..=5 {
        put(&mut st, a, k, 1, (k > 1).then(|| k - 1));
    }
    put(&mut st, b, 6, 2, Some(5));
    ok(&mut st, b, Request::Get { key: 6 });
    for k in [3, 4, 5] {
        ok(&mut st, a, Request::Lookup { key: k });
    }
    let before = fingerprint(&st);
    let s0 = st.stats();
    // 2 + 2 pages fit by evicting 1 and 2 (cutting 2's and 3's links); then
    // 7 pages cannot (6 is pinned).
    let out = run_unit(&mut st, b, &unit_of(&[(100, 2), (101, 2), (102, 7)]));
    assert!(out.iter().all(|c| c.status == Status::OutOfMemory));
    assert_eq!(fingerprint(&st), before);
    let s1 = st.stats();
    assert_eq!((s1.links_cut, s1.links_cut_by_eviction, s1.orphaned_bytes), (0, 0, 0));
    assert_eq!((s1.reserves, s1.out_of_memory), (s0.reserves + 3, s0.out_of_memory + 3));
    // The same first two alone are admitted, and they do evict.
    let out = run_unit(&mut st, b, &unit_of(&[(100, 2), (101, 2)]));
    assert!(out.iter().all(|c| c.status == Status::Ok));
    assert!(st.stats().links_cut_by_eviction > 0);
}

/// An admitted unit gives the same answers and leaves the same store as
/// its RESERVEs one by one; a unit with another op is refused whole.
#[test]
fn an_admitted_unit_is_its_reserves_one_by_one() {
    let mut st = Store::new(SLAB_OFFSET, 12 * PAGE_LEN);
    let s = st.open_session();
    for k in 1..=10 {
        put(&mut st, s, k, 1, (k % 3 != 1).then(|| k - 1));
    }
    let mut twin = st.clone();
    let unit = unit_of(&[(50, 3), (51, 1), (52, 4)]);
    let out = run_unit(&mut st, s, &unit);
    let one_by_one: Vec<Completion> = unit.iter().map(|(id, r)| twin.handle(s, *id, r)).collect();
    assert_eq!(out, one_by_one);
    assert_eq!(serde_json::to_value(&st).unwrap(), serde_json::to_value(&twin).unwrap());
    let before = fingerprint(&st);
    let mixed = vec![(1, reserve_req(60, 10, 0)), (2, Request::Delete { key: 1 })];
    let out = run_unit(&mut st, s, &mixed);
    assert!(out.iter().all(|c| c.status == Status::Invalid));
    assert_eq!(fingerprint(&st), before);
}

/// Steps that build a store: blocks of three sessions (tenants `a` with a
/// limit, `b` and the default without), chains, pins, deletes, lookups.
#[derive(Clone, Debug)]
enum Setup {
    Put { s: usize, key: u8, pages: u64, parent: Option<u8> },
    Get { s: usize, key: u8 },
    Delete { key: u8 },
    Lookup { key: u8 },
    Reserve { s: usize, key: u8, pages: u64 },
}

fn setup() -> impl Strategy<Value = Setup> {
    prop_oneof![
        6 => (0..3usize, 0..24u8, 1..4u64, proptest::option::weighted(0.6, 0..24u8))
            .prop_map(|(s, key, pages, parent)| Setup::Put { s, key, pages, parent }),
        2 => (0..3usize, 0..24u8).prop_map(|(s, key)| Setup::Get { s, key }),
        1 => (0..24u8).prop_map(|key| Setup::Delete { key }),
        2 => (0..24u8).prop_map(|key| Setup::Lookup { key }),
        1 => (0..3usize, 0..24u8, 1..3u64).prop_map(|(s, key, pages)| Setup::Reserve { s, key, pages }),
    ]
}

const PAGES: u64 = 40;

fn build(steps: &[Setup], lru: bool) -> (Store, [SessionId; 3]) {
    let mut st = Store::new(SLAB_OFFSET, PAGES * PAGE_LEN);
    st.set_eviction_policy(if lru { EvictionPolicy::Lru } else { EvictionPolicy::Chain });
    st.set_tenant_limits(None, &[("a".into(), 16 * PAGE_LEN)], true);
    let ss = [st.open_session(), st.open_session(), st.open_session()];
    st.set_session_tenant(ss[0], "a");
    st.set_session_tenant(ss[1], "b");
    for step in steps {
        match *step {
            Setup::Put { s, key, pages, parent } => {
                let r = st.handle(ss[s], 1, &reserve_req(u128::from(key), pages * PAGE_LEN, 0));
                if r.status == Status::Ok {
                    let parent = parent.map(u128::from);
                    st.handle(ss[s], 1, &Request::Commit { handle: r.handle, parent });
                }
            }
            Setup::Get { s, key } => {
                st.handle(ss[s], 1, &Request::Get { key: u128::from(key) });
            }
            Setup::Delete { key } => {
                st.handle(ss[0], 1, &Request::Delete { key: u128::from(key) });
            }
            Setup::Lookup { key } => {
                st.handle(ss[0], 1, &Request::Lookup { key: u128::from(key) });
            }
            Setup::Reserve { s, key, pages } => {
                st.handle(ss[s], 1, &reserve_req(u128::from(key), pages * PAGE_LEN, 0));
            }
        }
    }
    st.check_invariants().unwrap();
    (st, ss)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// On any store, a reservation unit is either admitted, answering and
    /// leaving the store as its RESERVEs one by one would, or refused whole,
    /// leaving the store as it was: same keys, extents, slots, links, lists,
    /// tenant figures and counters but for requests and answers.
    #[test]
    fn a_unit_is_admitted_whole_or_changes_nothing(
        steps in proptest::collection::vec(setup(), 0..60),
        lru in any::<bool>(),
        who in 0..3usize,
        unit in proptest::collection::vec((100..120u8, 1..12u64), 1..8),
    ) {
        let (mut st, ss) = build(&steps, lru);
        let before = fingerprint(&st);
        let mut twin = st.clone();
        let reqs = unit_of(&unit.iter().map(|&(k, p)| (u128::from(k), p)).collect::<Vec<_>>());
        let mut out = Vec::new();
        st.handle_unit(ss[who], &reqs, &mut out);
        st.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(out.len(), reqs.len());
        let one_by_one: Vec<Completion> = reqs.iter().map(|(id, r)| twin.handle(ss[who], *id, r)).collect();
        if one_by_one.iter().all(|c| c.status == Status::Ok) {
            prop_assert_eq!(&out, &one_by_one);
            prop_assert_eq!(serde_json::to_value(&st).unwrap(), serde_json::to_value(&twin).unwrap());
        } else {
            let first = one_by_one.iter().find(|c| c.status != Status::Ok).unwrap();
            for c in &out {
                prop_assert_eq!((c.status, c.handle, c.offset), (first.status, first.handle, first.offset));
            }
            prop_assert_eq!(fingerprint(&st), before);
            let s = st.stats();
            prop_assert_eq!(s.internal, 0);
        }
    }

    /// A single RESERVE on any store is served, or refused leaving the store
    /// as it was; and it is refused only if evicting everything eviction
    /// could take for it still would not make room.
    #[test]
    fn a_refused_reserve_changes_nothing(
        steps in proptest::collection::vec(setup(), 0..60),
        lru in any::<bool>(),
        who in 0..3usize,
        pages in 1..20u64,
    ) {
        let (mut st, ss) = build(&steps, lru);
        let before = fingerprint(&st);
        let probe = st.clone();
        let c = st.handle(ss[who], 7, &reserve_req(200, pages * PAGE_LEN, 0));
        st.check_invariants().map_err(TestCaseError::fail)?;
        if c.status != Status::Ok {
            prop_assert_eq!(fingerprint(&st), before);
            if OutOfMemoryCause::of(c.handle, c.offset) == OutOfMemoryCause::NoRoom {
                prop_assert!(!probe.fits_after_evicting_all(ss[who], pages * PAGE_LEN));
            }
        }
    }
}

impl Store {
    /// Whether an extent of `need_len` bytes would fit for session `s` after
    /// evicting every block eviction could take for it, in the order it
    /// would (parents joining the list as their holding children go).
    pub(super) fn fits_after_evicting_all(&self, s: SessionId, need_len: u64) -> bool {
        let mut st = self.clone();
        let t = st.sessions.get(&s).map_or(tenants::DEFAULT_ROW, |x| x.tenant);
        let own = st.tenants.limited(t);
        loop {
            if st.alloc.largest_free() >= need_len {
                return true;
            }
            let shared = st.lru.first_key_value().map(|(&k, &v)| (k, v));
            let mine = if own { st.tenants.get(t).list.first_key_value().map(|(&k, &v)| (k, v)) } else { None };
            let Some((tick, index)) = shared.into_iter().chain(mine).min() else { return false };
            st.evict(index, tick).expect("evict");
        }
    }
}
