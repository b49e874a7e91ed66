//! Unit tests of the chain rules (module docs, "Chains" and "Eviction";
//! `docs/eviction.md`): eviction order under both policies, deletion and
//! replacement of a middle block, pinned leaves, missing parents, cycles a
//! hostile client names.

use super::tests::{reserve_req, SLAB_OFFSET};
use super::*;
use crate::alloc::PAGE_LEN;

/// A store of `pages` one-page blocks under `policy`, one session, the
/// invariants checked after every request.
struct C {
    st: Store,
    s: SessionId,
}

impl C {
    fn new(pages: u64, policy: EvictionPolicy) -> C {
        let mut st = Store::new(SLAB_OFFSET, pages * PAGE_LEN);
        st.set_eviction_policy(policy);
        let s = st.open_session();
        C { st, s }
    }
    fn req(&mut self, req: Request) -> Completion {
        let c = self.st.handle(self.s, 1, &req);
        self.st.check_invariants().unwrap();
        assert_ne!(c.status, Status::Internal, "{req:?}");
        c
    }
    /// A one-page block `key` following `parent`; the RESERVE's status.
    fn put(&mut self, key: u128, parent: Option<u128>) -> Status {
        let r = self.req(reserve_req(key, 100, 0));
        if r.status == Status::Ok {
            assert_eq!(self.req(Request::Commit { handle: r.handle, parent }).status, Status::Ok);
        }
        r.status
    }
    fn has(&self, key: u128) -> bool {
        self.st.peek(key).is_some()
    }
    /// Leading keys of `keys` present (what LOOKUP of a chain counts), without touching.
    fn leading(&self, keys: &[u128]) -> usize {
        keys.iter().take_while(|&&k| self.has(k)).count()
    }
    fn lookup(&mut self, key: u128) -> Status {
        self.req(Request::Lookup { key }).status
    }
}

/// Chain 1 <- 2 <- 3, then 10 and 11 without parents, then a LOOKUP of the
/// tail 3: the head 1 is the least recently used block.
fn three_chain_and_two_singles(policy: EvictionPolicy) -> C {
    let mut c = C::new(6, policy);
    assert_eq!(c.put(1, None), Status::Ok);
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    assert_eq!(c.put(3, Some(2)), Status::Ok);
    assert_eq!(c.put(10, None), Status::Ok);
    assert_eq!(c.put(11, None), Status::Ok);
    assert_eq!(c.lookup(3), Status::Ok);
    assert_eq!(c.st.stats().chained_blocks, 2);
    c
}

#[test]
fn chain_policy_evicts_leaves_first_and_parents_after_their_children() {
    let mut c = three_chain_and_two_singles(EvictionPolicy::Chain);
    assert_eq!(c.put(20, None), Status::Ok); // the sixth page: no eviction
                                             // Leaves by last use: 10, 11, 3, 20. Each new block evicts one.
    let mut evicted = Vec::new();
    for key in 30..36u128 {
        let before: Vec<u128> = [1, 2, 3, 10, 11, 20, 30, 31, 32, 33, 34].into_iter().filter(|&k| c.has(k)).collect();
        assert_eq!(c.put(key, None), Status::Ok);
        let gone: Vec<u128> = before.into_iter().filter(|&k| !c.has(k)).collect();
        assert_eq!(gone.len(), 1, "one eviction per block");
        evicted.push(gone[0]);
        // Never a hole: whatever is left of the chain is a prefix of it.
        assert_eq!(c.leading(&[1, 2, 3]), [1, 2, 3].iter().filter(|&&k| c.has(k)).count());
    }
    // 3 goes before its parents; then 2 and 1 (older than 20) as each becomes a leaf.
    assert_eq!(evicted, vec![10, 11, 3, 2, 1, 20]);
    let st = c.st.stats();
    assert_eq!((st.links_cut, st.links_cut_by_eviction, st.chained_blocks), (0, 0, 0));
    assert_eq!(st.eviction_policy, "chain");
}

#[test]
fn lru_policy_evicts_the_head_and_leaves_the_tail_unreachable() {
    let mut c = three_chain_and_two_singles(EvictionPolicy::Lru);
    assert_eq!(c.put(20, None), Status::Ok);
    assert_eq!(c.put(30, None), Status::Ok);
    // Plain LRU takes the head: 2 and 3 stay, but a LOOKUP of the chain stops at once.
    assert!(!c.has(1) && c.has(2) && c.has(3));
    assert_eq!(c.leading(&[1, 2, 3]), 0);
    let st = c.st.stats();
    assert_eq!((st.links_cut, st.links_cut_by_eviction, st.chained_blocks), (1, 1, 1));
    assert_eq!(st.eviction_policy, "lru");
}

#[test]
fn chain_policy_keeps_the_shared_head_of_many_chains() {
    // A shared first block touched once, then 4 two-block conversations on it.
    let mut c = C::new(8, EvictionPolicy::Chain);
    assert_eq!(c.put(1, None), Status::Ok);
    for conv in 0..3u128 {
        assert_eq!(c.put(100 + conv, Some(1)), Status::Ok);
        assert_eq!(c.put(200 + conv, Some(100 + conv)), Status::Ok);
    }
    assert_eq!(c.st.stats().chained_blocks, 6);
    for key in 300..306u128 {
        assert_eq!(c.put(key, None), Status::Ok);
        assert!(c.has(1), "the shared head went before a block that follows it");
        for conv in 0..3u128 {
            assert!(c.has(100 + conv) || !c.has(200 + conv), "hole in conversation {conv}");
        }
    }
}

#[test]
fn pinned_leaf_keeps_its_ancestors() {
    let mut c = C::new(4, EvictionPolicy::Chain);
    assert_eq!(c.put(1, None), Status::Ok);
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    assert_eq!(c.put(3, Some(2)), Status::Ok);
    let pin = c.req(Request::Get { key: 3 });
    assert_eq!(pin.status, Status::Ok);
    assert_eq!(c.put(10, None), Status::Ok); // the last free page
                                             // 1 and 2 are unpinned but each has a child: only 10 may go.
    assert_eq!(c.put(11, None), Status::Ok);
    assert!(!c.has(10) && c.has(1) && c.has(2) && c.has(3));
    // Two pages are more than the list (11 alone) frees: OUT_OF_MEMORY, the chain intact.
    assert_eq!(c.req(reserve_req(12, 2 * PAGE_LEN, 0)).status, Status::OutOfMemory);
    assert_eq!(c.leading(&[1, 2, 3]), 3);
    // Released, the leaf and then its parents may go, tail first.
    assert_eq!(c.req(Request::Release { handle: pin.handle }).status, Status::Ok);
    assert_eq!(c.req(reserve_req(12, 3 * PAGE_LEN, 0)).status, Status::Ok);
    assert!(c.has(1) && !c.has(2) && !c.has(3));
}

#[test]
fn pinned_middle_block_is_kept_and_its_leaf_may_go() {
    let mut c = C::new(3, EvictionPolicy::Chain);
    assert_eq!(c.put(1, None), Status::Ok);
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    assert_eq!(c.put(3, Some(2)), Status::Ok);
    assert_eq!(c.req(Request::Get { key: 2 }).status, Status::Ok);
    assert_eq!(c.put(10, None), Status::Ok);
    assert!(c.has(1) && c.has(2) && !c.has(3) && c.has(10));
    // 1 has a pinned child; 2 is pinned; 10 is the only choice.
    assert_eq!(c.put(11, None), Status::Ok);
    assert!(c.has(1) && c.has(2) && !c.has(10));
    assert_eq!(c.put(12, None), Status::Ok);
    assert!(c.has(1) && c.has(2) && c.has(12) && !c.has(11));
}

#[test]
fn deleting_a_middle_block_keeps_its_children_without_a_parent() {
    let mut c = C::new(8, EvictionPolicy::Chain);
    assert_eq!(c.put(1, None), Status::Ok);
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    assert_eq!(c.put(3, Some(2)), Status::Ok);
    assert_eq!(c.put(4, Some(3)), Status::Ok);
    assert_eq!(c.req(Request::Delete { key: 2 }).status, Status::Ok);
    assert!(c.has(1) && !c.has(2) && c.has(3) && c.has(4));
    let st = c.st.stats();
    assert_eq!((st.links_cut, st.links_cut_by_eviction, st.chained_blocks), (1, 0, 1));
    // The user made the hole: LOOKUP of the chain stops at it.
    assert_eq!(c.leading(&[1, 2, 3, 4]), 1);
    // 1 is a leaf again; 3 keeps its child 4, so eviction takes 1, then 4, then 3.
    for key in 20..25u128 {
        assert_eq!(c.put(key, None), Status::Ok);
    }
    assert_eq!(c.put(30, None), Status::Ok);
    assert!(!c.has(1) && c.has(3) && c.has(4));
    assert_eq!(c.put(31, None), Status::Ok);
    assert!(c.has(3) && !c.has(4));
    assert_eq!(c.put(32, None), Status::Ok);
    assert!(!c.has(3));
}

#[test]
fn replacing_a_block_cuts_the_links_of_its_children() {
    let mut c = C::new(8, EvictionPolicy::Chain);
    assert_eq!(c.put(1, None), Status::Ok);
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    assert_eq!(c.put(3, Some(2)), Status::Ok);
    // A newer block of 2, again after 1: 3 loses its parent, 2 is linked to 1.
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    let st = c.st.stats();
    assert_eq!((st.replaced, st.links_cut, st.chained_blocks), (1, 1, 1));
    assert_eq!(c.leading(&[1, 2, 3]), 3);
}

#[test]
fn a_parent_that_is_not_linked_is_dropped_and_counted() {
    let mut c = C::new(8, EvictionPolicy::Chain);
    // Absent.
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    // Reserved but not committed: not linked either.
    let r1 = c.req(reserve_req(1, 100, 0));
    assert_eq!(c.put(3, Some(1)), Status::Ok);
    assert_eq!(c.req(Request::Commit { handle: r1.handle, parent: None }).status, Status::Ok);
    // Its own key (the block it replaces is unlinked by this very COMMIT).
    assert_eq!(c.put(4, None), Status::Ok);
    assert_eq!(c.put(4, Some(4)), Status::Ok);
    let st = c.st.stats();
    assert_eq!((st.parents_missing, st.chained_blocks, st.commits), (3, 0, 5));
    // A parent committed later does not link retroactively: 1 is an ordinary leaf.
    for key in 10..14u128 {
        assert_eq!(c.put(key, None), Status::Ok);
    }
    assert_eq!(c.st.stats().evictions, 0);
    assert_eq!(c.put(14, None), Status::Ok);
    assert!(!c.has(2), "2 is the least recently used leaf");
    assert_eq!(c.put(15, None), Status::Ok);
    assert!(!c.has(3) && c.has(1));
}

#[test]
fn a_hostile_client_cannot_make_a_cycle() {
    let mut c = C::new(16, EvictionPolicy::Chain);
    // 1 <- 2 <- 3, then 1 again naming its own descendant 3 as parent.
    assert_eq!(c.put(1, None), Status::Ok);
    assert_eq!(c.put(2, Some(1)), Status::Ok);
    assert_eq!(c.put(3, Some(2)), Status::Ok);
    assert_eq!(c.put(1, Some(3)), Status::Ok);
    // The old 1 was unlinked first (2 lost its parent), then the new 1 linked
    // under 3: 2 <- 3 <- 1, no cycle (`check_invariants` walks every chain).
    assert_eq!(c.st.stats().chained_blocks, 2);
    // Two reservations of keys naming each other: the first COMMIT finds no
    // parent, the second links to the first.
    let ra = c.req(reserve_req(7, 100, 0));
    let rb = c.req(reserve_req(8, 100, 0));
    assert_eq!(c.req(Request::Commit { handle: ra.handle, parent: Some(8) }).status, Status::Ok);
    assert_eq!(c.req(Request::Commit { handle: rb.handle, parent: Some(7) }).status, Status::Ok);
    let st = c.st.stats();
    assert_eq!((st.parents_missing, st.chained_blocks), (1, 3));
    // Everything can still be evicted, leaf by leaf.
    assert_eq!(c.req(reserve_req(9, 16 * PAGE_LEN, 0)).status, Status::Ok);
    assert_eq!(c.st.stats().blocks, 0);
}

#[test]
fn switching_the_policy_rebuilds_the_list() {
    let mut c = three_chain_and_two_singles(EvictionPolicy::Chain);
    assert_eq!(c.st.stats().evictable_bytes, 5 * PAGE_LEN);
    c.st.set_eviction_policy(EvictionPolicy::Lru);
    c.st.check_invariants().unwrap();
    assert_eq!(c.st.eviction_policy(), EvictionPolicy::Lru);
    c.st.set_eviction_policy(EvictionPolicy::Chain);
    c.st.check_invariants().unwrap();
    assert_eq!(c.st.stats().evictable_bytes, 5 * PAGE_LEN);
}

#[test]
fn a_block_committed_under_a_named_key_links_the_parent_it_names() {
    // LMCache's in-place writer: every block reserved under the placeholder
    // key 0, committed as 1 <- 2 <- 3 (COMMIT_NAMES_KEY with a parent).
    let mut c = C::new(3, EvictionPolicy::Chain);
    for (key, parent, pin) in [(1, None, false), (2, Some(1), true), (3, Some(2), false)] {
        let r = c.req(reserve_req(0, 100, 0));
        assert_eq!(r.status, Status::Ok);
        let done = c.req(Request::CommitAs { handle: r.handle, key, parent, pin });
        assert_eq!(done.status, Status::Ok);
        if pin {
            assert_eq!(c.req(Request::Release { handle: done.handle }).status, Status::Ok);
        }
    }
    assert_eq!(c.st.stats().chained_blocks, 2);
    assert_eq!(c.lookup(1), Status::Ok, "the head is the most recently used block");
    // New blocks evict the chain from its tail (unlinked, 2 would go first:
    // the least recently used), never its head first.
    assert_eq!(c.put(10, None), Status::Ok);
    assert!(c.has(1) && c.has(2) && !c.has(3), "{:?}", [1, 2, 3].map(|k| c.has(k)));
    assert_eq!(c.put(11, None), Status::Ok);
    assert!(c.has(1) && !c.has(2), "{:?}", [1, 2, 3].map(|k| c.has(k)));
}
