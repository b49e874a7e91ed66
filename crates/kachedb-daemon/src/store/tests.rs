//! Unit tests of the store: each rule of the module docs on a small slab.

use super::handles::{decode_handle, encode_handle, next_generation, HandleKind, GEN_MASK};
use super::*;
use crate::alloc::PAGE_LEN;
use kachedb_shm::Op;

pub(super) const SLAB_OFFSET: u64 = 2 << 20;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

pub(super) fn reserve_req(key: u128, len: u64, page_offset: u64) -> Request {
    Request::Reserve { key, dtype: DType::U8, shape: Shape::for_bytes(len).unwrap(), len, page_offset }
}

struct T {
    st: Store,
    next_id: u32,
}

impl T {
    fn new(pages: u64) -> T {
        T { st: Store::new(SLAB_OFFSET, pages * PAGE_LEN), next_id: 0 }
    }
    fn req(&mut self, s: SessionId, req: Request) -> Completion {
        self.next_id += 1;
        let c = self.st.handle(s, self.next_id, &req);
        assert_eq!(c.request_id, self.next_id);
        self.st.check_invariants().unwrap();
        c
    }
    fn reserve(&mut self, s: SessionId, key: u128, len: u64) -> Completion {
        self.req(s, reserve_req(key, len, 0))
    }
    /// RESERVE + COMMIT, asserting both succeed; returns the data offset.
    fn put(&mut self, s: SessionId, key: u128, len: u64) -> u64 {
        let c = self.reserve(s, key, len);
        assert_eq!(c.status, Status::Ok, "reserve {key}");
        assert_eq!(self.req(s, Request::Commit { handle: c.handle, parent: None }).status, Status::Ok);
        c.offset
    }
    fn get(&mut self, s: SessionId, key: u128) -> Completion {
        self.req(s, Request::Get { key })
    }
    fn status(&mut self, s: SessionId, req: Request) -> Status {
        self.req(s, req).status
    }
}

#[test]
fn ping_and_stats() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    let c = t.req(s, Request::Ping);
    assert_eq!((c.op, c.status), (Op::Ping, Status::Ok));
    let c = t.req(s, Request::Stats);
    assert_eq!((c.op, c.status, c.handle, c.offset), (Op::Stats, Status::Ok, 0, 0));
    t.put(s, 1, 5000);
    let c = t.req(s, Request::Stats);
    assert_eq!((c.handle, c.offset), (1, 2 * PAGE_LEN));
    let st = t.st.stats();
    assert_eq!(st.blocks, 1);
    assert_eq!(st.bytes_used, 2 * PAGE_LEN);
    assert_eq!(st.bytes_total, 16 * PAGE_LEN);
    assert_eq!(st.bytes_free, 14 * PAGE_LEN);
    assert_eq!(st.largest_free_bytes, 14 * PAGE_LEN);
    assert_eq!(st.evictable_bytes, 2 * PAGE_LEN);
    assert_eq!(st.pings, 1);
    assert_eq!(st.stats_requests, 2);
    let json = serde_json::to_string(&st).unwrap();
    assert!(json.contains("\"largest_free_bytes\":57344"), "{json}");
}

#[test]
fn reserve_commit_get_release() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    let shape = Shape::new(&[2, 3, 100]).unwrap();
    let req = Request::Reserve { key: 42, dtype: DType::F16, shape, len: 1200, page_offset: 192 };
    let r = t.req(s, req);
    assert_eq!((r.op, r.status), (Op::Reserve, Status::Ok));
    assert_eq!(r.offset % PAGE_LEN, 192);
    assert!(r.offset >= SLAB_OFFSET && r.offset + 1200 <= SLAB_OFFSET + 16 * PAGE_LEN);
    assert_ne!(r.handle, 0);
    assert_eq!(t.st.stats().reserved, 1);
    // Invisible until commit.
    assert_eq!(t.get(s, 42).status, Status::NotFound);
    assert_eq!(t.status(s, Request::Lookup { key: 42 }), Status::NotFound);
    assert_eq!(t.status(s, Request::Delete { key: 42 }), Status::NotFound);
    assert_eq!(t.req(s, Request::Stats).handle, 0);
    assert_eq!(t.st.peek(42), None);

    assert_eq!(t.status(s, Request::Commit { handle: r.handle, parent: None }), Status::Ok);
    assert_eq!(t.st.stats().reserved, 0);
    assert_eq!(t.status(s, Request::Lookup { key: 42 }), Status::Ok);
    let g = t.get(s, 42);
    assert_eq!((g.op, g.status, g.offset), (Op::Get, Status::Ok, r.offset));
    assert_eq!(g.tensor, Some((DType::F16, shape, 1200)));
    assert_eq!(t.st.peek(42).unwrap().pins, 1);
    assert_eq!(t.st.stats().pins, 1);
    assert_eq!(t.st.stats().evictable_bytes, 0);
    // The completion survives the wire.
    assert_eq!(Completion::decode(&g.encode()).unwrap(), g);

    let rel = t.req(s, Request::Release { handle: g.handle });
    assert_eq!((rel.op, rel.status), (Op::Release, Status::Ok));
    assert_eq!(t.st.stats().pins, 0);
    assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::BadHandle);
    assert_eq!(t.st.stats().get_hits, 1);
    assert_eq!(t.st.stats().gets, 2);
}

#[test]
fn zero_length_tensor_takes_one_page() {
    let mut t = T::new(4);
    let s = t.st.open_session();
    let shape = Shape::new(&[0, 8]).unwrap();
    let r = t.req(s, Request::Reserve { key: 1, dtype: DType::F32, shape, len: 0, page_offset: 0 });
    assert_eq!(r.status, Status::Ok);
    assert_eq!(t.st.stats().bytes_used, PAGE_LEN);
    assert_eq!(t.status(s, Request::Commit { handle: r.handle, parent: None }), Status::Ok);
    assert_eq!(t.get(s, 1).tensor, Some((DType::F32, shape, 0)));
}

#[test]
fn too_large() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    assert_eq!(t.reserve(s, 1, 16 * PAGE_LEN + 1).status, Status::TooLarge);
    // Fits exactly without a page offset, not with one.
    assert_eq!(t.status(s, reserve_req(1, 16 * PAGE_LEN, 64)), Status::TooLarge);
    let c = t.reserve(s, 1, 16 * PAGE_LEN);
    assert_eq!(c.status, Status::Ok);
    assert_eq!(t.status(s, Request::Abort { handle: c.handle }), Status::Ok);
    // len + page_offset overflows u64.
    let shape = Shape::new(&[64, (1 << 29) - 1, (1 << 29) + 1]).unwrap();
    let len = shape.len_bytes(DType::U8).unwrap();
    assert_eq!(len, u64::MAX - 63);
    let req = Request::Reserve { key: 1, dtype: DType::U8, shape, len, page_offset: 128 };
    assert_eq!(t.status(s, req), Status::TooLarge);
    // A slab that is not a page multiple: the last partial page is unusable.
    let mut st = Store::new(SLAB_OFFSET, 2 * PAGE_LEN + 100);
    let s2 = st.open_session();
    assert_eq!(st.handle(s2, 1, &reserve_req(1, 2 * PAGE_LEN + 50, 0)).status, Status::TooLarge);
    assert_eq!(st.stats().too_large, 1);
    assert_eq!(t.st.stats().too_large, 3);
}

#[test]
fn invalid_hand_built_reserves() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    assert_eq!(t.status(s, reserve_req(1, 10, 4096)), Status::Invalid);
    assert_eq!(t.status(s, reserve_req(1, 10, 65)), Status::Invalid);
    assert_eq!(t.status(s, reserve_req(1, 10, u64::MAX)), Status::Invalid);
    // len disagrees with the shape.
    let req = Request::Reserve { key: 1, dtype: DType::F32, shape: Shape::new(&[4]).unwrap(), len: 4, page_offset: 0 };
    assert_eq!(t.status(s, req), Status::Invalid);
    assert_eq!(t.st.stats().invalid, 4);
    assert_eq!(t.st.stats().bytes_used, 0);
}

#[test]
fn two_gib_block_in_three_gib_slab() {
    let mut st = Store::new(SLAB_OFFSET, 3 * GIB);
    let s = st.open_session();
    let c = st.handle(s, 1, &reserve_req(1, 2 * GIB, 0));
    assert_eq!(c.status, Status::Ok);
    assert_eq!(st.handle(s, 2, &Request::Commit { handle: c.handle, parent: None }).status, Status::Ok);
    let g = st.handle(s, 3, &Request::Get { key: 1 });
    assert_eq!(g.tensor.unwrap().2, 2 * GIB);
    st.check_invariants().unwrap();
}

#[test]
fn commit_and_abort_check_ownership_and_staleness() {
    let mut t = T::new(16);
    let a = t.st.open_session();
    let b = t.st.open_session();
    let r = t.reserve(a, 1, 100);
    // Other session, forged values, a pin handle used as a reservation.
    assert_eq!(t.status(b, Request::Commit { handle: r.handle, parent: None }), Status::BadHandle);
    assert_eq!(t.status(b, Request::Abort { handle: r.handle }), Status::BadHandle);
    for forged in [0, 1, u64::MAX, r.handle ^ 1, r.handle ^ (1 << 32), r.handle ^ (3 << 62)] {
        assert_eq!(t.status(a, Request::Commit { handle: forged, parent: None }), Status::BadHandle, "{forged:#x}");
        assert_eq!(t.status(a, Request::Abort { handle: forged }), Status::BadHandle, "{forged:#x}");
    }
    assert_eq!(t.status(a, Request::Commit { handle: r.handle, parent: None }), Status::Ok);
    // Committed: the reservation handle is spent.
    assert_eq!(t.status(a, Request::Commit { handle: r.handle, parent: None }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Abort { handle: r.handle }), Status::BadHandle);
    let g = t.get(a, 1);
    assert_eq!(t.status(a, Request::Commit { handle: g.handle, parent: None }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Abort { handle: g.handle }), Status::BadHandle);
    // A reservation handle is not a pin handle.
    let r2 = t.reserve(a, 2, 100);
    assert_eq!(t.status(a, Request::Release { handle: r2.handle }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Abort { handle: r2.handle }), Status::Ok);
    assert_eq!(t.status(a, Request::Abort { handle: r2.handle }), Status::BadHandle);
    assert_eq!(t.st.stats().bad_handle, 20);
}

#[test]
fn stale_handle_after_slot_reuse() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    let r1 = t.reserve(s, 1, 100);
    assert_eq!(t.status(s, Request::Abort { handle: r1.handle }), Status::Ok);
    let r2 = t.reserve(s, 1, 100);
    // Same slot and same extent, new generation.
    assert_eq!(r1.handle as u32, r2.handle as u32);
    assert_eq!(r1.offset, r2.offset);
    assert_ne!(r1.handle, r2.handle);
    assert_eq!(t.status(s, Request::Commit { handle: r1.handle, parent: None }), Status::BadHandle);
    assert_eq!(t.status(s, Request::Commit { handle: r2.handle, parent: None }), Status::Ok);
    // Pins too: release to zero, pin again, the old pin handle is stale.
    let g1 = t.get(s, 1);
    assert_eq!(t.status(s, Request::Release { handle: g1.handle }), Status::Ok);
    let g2 = t.get(s, 1);
    assert_ne!(g1.handle, g2.handle);
    assert_eq!(t.status(s, Request::Release { handle: g1.handle }), Status::BadHandle);
    assert_eq!(t.status(s, Request::Release { handle: g2.handle }), Status::Ok);
}

#[test]
fn abort_frees_the_extent() {
    let mut t = T::new(4);
    let s = t.st.open_session();
    let r = t.reserve(s, 1, 4 * PAGE_LEN);
    assert_eq!(t.st.stats().bytes_free, 0);
    assert_eq!(t.reserve(s, 2, 1).status, Status::OutOfMemory);
    let c = t.req(s, Request::Abort { handle: r.handle });
    assert_eq!((c.op, c.status), (Op::Abort, Status::Ok));
    assert_eq!(t.st.stats().bytes_free, 4 * PAGE_LEN);
    assert_eq!(t.get(s, 1).status, Status::NotFound);
}

#[test]
fn pins_count_per_session_and_block() {
    let mut t = T::new(16);
    let a = t.st.open_session();
    let b = t.st.open_session();
    t.put(a, 7, 100);
    let g1 = t.get(a, 7);
    let g2 = t.get(a, 7);
    let gb = t.get(b, 7);
    // One handle per (session, block), counted; another session's differs.
    assert_eq!(g1.handle, g2.handle);
    assert_ne!(g1.handle, gb.handle);
    assert_eq!(t.st.peek(7).unwrap().pins, 3);
    // Each session may only release its own.
    assert_eq!(t.status(b, Request::Release { handle: g1.handle }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Release { handle: gb.handle }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::Ok);
    assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::Ok);
    assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::BadHandle);
    assert_eq!(t.st.peek(7).unwrap().pins, 1);
    assert_eq!(t.status(b, Request::Release { handle: gb.handle }), Status::Ok);
    assert_eq!(t.st.stats().pins, 0);
    for forged in [0, 2 << 62, (2 << 62) | 12345, u64::MAX] {
        assert_eq!(t.status(a, Request::Release { handle: forged }), Status::BadHandle);
    }
}

#[test]
fn delete_unpinned_frees_at_once() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    t.put(s, 1, 3 * PAGE_LEN);
    let c = t.req(s, Request::Delete { key: 1 });
    assert_eq!((c.op, c.status), (Op::Delete, Status::Ok));
    assert_eq!(t.st.stats().bytes_used, 0);
    assert_eq!(t.status(s, Request::Delete { key: 1 }), Status::NotFound);
    assert_eq!(t.get(s, 1).status, Status::NotFound);
    let st = t.st.stats();
    assert_eq!((st.deletes, st.delete_hits, st.not_found), (2, 1, 2));
}

#[test]
fn delete_pinned_frees_on_last_release() {
    let mut t = T::new(16);
    let a = t.st.open_session();
    let b = t.st.open_session();
    let data_offset = t.put(a, 1, 3 * PAGE_LEN);
    let ga = t.get(a, 1);
    let gb = t.get(b, 1);
    assert_eq!(t.status(a, Request::Delete { key: 1 }), Status::Ok);
    assert_eq!(t.get(a, 1).status, Status::NotFound);
    assert_eq!(t.status(a, Request::Lookup { key: 1 }), Status::NotFound);
    let st = t.st.stats();
    assert_eq!((st.blocks, st.unlinked_blocks, st.bytes_used), (0, 1, 3 * PAGE_LEN));
    // The extent is not reused while pinned.
    let r = t.reserve(a, 2, 13 * PAGE_LEN);
    assert_eq!(r.status, Status::Ok);
    assert!(r.offset >= data_offset + 3 * PAGE_LEN);
    assert_eq!(t.status(a, Request::Abort { handle: r.handle }), Status::Ok);
    assert_eq!(t.status(a, Request::Release { handle: ga.handle }), Status::Ok);
    assert_eq!(t.st.stats().bytes_used, 3 * PAGE_LEN);
    assert_eq!(t.status(b, Request::Release { handle: gb.handle }), Status::Ok);
    assert_eq!(t.st.stats().bytes_used, 0);
    assert_eq!(t.st.stats().unlinked_blocks, 0);
}

#[test]
fn commit_replaces_an_older_block() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    let first = t.put(s, 1, 100);
    let second = t.put(s, 1, 200);
    assert_ne!(first, second);
    assert_eq!(t.st.stats().bytes_used, PAGE_LEN, "the unpinned old block is freed");
    assert_eq!(t.get(s, 1).offset, second);
    // Pinned old block: kept until released.
    let g = t.get(s, 1);
    let third = t.put(s, 1, 300);
    assert_eq!(t.st.stats().bytes_used, 2 * PAGE_LEN);
    assert_eq!(t.st.stats().replaced, 2);
    let now = t.get(s, 1);
    assert_eq!(now.offset, third);
    assert_eq!(now.tensor.unwrap().2, 300);
    // g was taken twice on the same block (handle reused), release both.
    assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
    assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
    assert_eq!(t.st.stats().bytes_used, PAGE_LEN);
    assert_eq!(t.status(s, Request::Release { handle: now.handle }), Status::Ok);
}

#[test]
fn two_reservations_of_one_key_commit_in_order() {
    let mut t = T::new(16);
    let s = t.st.open_session();
    let r1 = t.reserve(s, 9, 10);
    let r2 = t.reserve(s, 9, 20);
    assert_eq!(t.status(s, Request::Commit { handle: r2.handle, parent: None }), Status::Ok);
    assert_eq!(t.status(s, Request::Commit { handle: r1.handle, parent: None }), Status::Ok);
    // Last commit wins.
    assert_eq!(t.get(s, 9).offset, r1.offset);
    assert_eq!(t.st.stats().bytes_used, PAGE_LEN, "r2's block was replaced and freed");
}

#[test]
fn eviction_is_lru_and_lookup_get_count_as_use() {
    let mut t = T::new(4);
    let s = t.st.open_session();
    for key in 1..=4 {
        t.put(s, key, PAGE_LEN);
    }
    // Use order now: 1 2 3 4. Touch 1 (LOOKUP) and 2 (GET + RELEASE).
    assert_eq!(t.status(s, Request::Lookup { key: 1 }), Status::Ok);
    let g = t.get(s, 2);
    assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
    // Order: 3 4 1 2. One page evicts 3.
    t.put(s, 5, 1);
    assert!(t.st.peek(3).is_none());
    let st = t.st.stats();
    assert_eq!((st.evictions, st.evicted_bytes), (1, PAGE_LEN));
    // Two pages: 4 (page 3) then 1 (page 0) free two pages that are not
    // adjacent, so 2 (page 1) goes too; 6 lands on pages 0-1.
    let six = t.put(s, 6, 2 * PAGE_LEN);
    assert_eq!(six, SLAB_OFFSET);
    for key in [1, 2, 3, 4] {
        assert!(t.st.peek(key).is_none(), "{key}");
    }
    assert!(t.st.peek(5).is_some() && t.st.peek(6).is_some());
    assert_eq!(t.st.stats().evictions, 4);
}

#[test]
fn eviction_coalesces_until_it_fits() {
    let mut t = T::new(8);
    let s = t.st.open_session();
    let offsets: Vec<u64> = (1..=8).map(|key| t.put(s, key, PAGE_LEN)).collect();
    assert!(offsets.windows(2).all(|w| w[1] == w[0] + PAGE_LEN));
    // Pin 2; a 3-page request evicts 1 (no fit: 2 is pinned), 3, 4, 5.
    let g = t.get(s, 2);
    let r = t.reserve(s, 9, 3 * PAGE_LEN);
    assert_eq!(r.status, Status::Ok);
    assert_eq!(r.offset, offsets[2]);
    for key in [1, 3, 4, 5] {
        assert!(t.st.peek(key).is_none(), "{key}");
    }
    for key in [2, 6, 7, 8] {
        assert!(t.st.peek(key).is_some(), "{key}");
    }
    assert_eq!(t.st.stats().evictions, 4);
    assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
}

#[test]
fn eviction_never_takes_pinned_blocks_or_reservations() {
    let mut t = T::new(6);
    let a = t.st.open_session();
    let b = t.st.open_session();
    // Pages: [1 pinned][2][4 4][3 reserved, reserved].
    t.put(a, 1, PAGE_LEN);
    t.put(a, 2, PAGE_LEN);
    t.put(a, 4, 2 * PAGE_LEN);
    let res = t.reserve(b, 3, 2 * PAGE_LEN);
    let pinned = t.get(b, 1);
    assert_eq!(t.st.stats().bytes_free, 0);
    // 1 is the least recently committed but pinned; 3 is only reserved.
    let r = t.reserve(a, 5, 3 * PAGE_LEN);
    assert_eq!(r.status, Status::Ok);
    assert_eq!(r.offset, SLAB_OFFSET + PAGE_LEN);
    assert!(t.st.peek(1).is_some());
    // Nothing else can go: everything left is pinned or reserved.
    assert_eq!(t.reserve(a, 6, 1).status, Status::OutOfMemory);
    assert!(t.st.peek(2).is_none() && t.st.peek(4).is_none());
    assert_eq!(t.status(b, Request::Commit { handle: res.handle, parent: None }), Status::Ok);
    assert_eq!(t.get(a, 1).offset, pinned.offset);
    assert_eq!(t.st.stats().reserved, 1);
}

#[test]
fn out_of_memory_when_everything_is_pinned() {
    let mut t = T::new(4);
    let s = t.st.open_session();
    for key in 1..=3 {
        t.put(s, key, PAGE_LEN);
        t.get(s, key);
    }
    let res = t.reserve(s, 9, 1);
    assert_eq!(res.status, Status::Ok);
    let c = t.reserve(s, 4, 1);
    assert_eq!((c.op, c.status, c.handle, c.offset), (Op::Reserve, Status::OutOfMemory, 0, 0));
    assert_eq!(t.st.stats().evictions, 0);
    assert_eq!(t.st.stats().out_of_memory, 1);
    for key in 1..=3 {
        assert!(t.st.peek(key).is_some());
    }
}

#[test]
fn out_of_memory_evicts_nothing_when_bytes_cannot_suffice() {
    let mut t = T::new(4);
    let s = t.st.open_session();
    t.put(s, 1, PAGE_LEN);
    t.put(s, 2, PAGE_LEN);
    t.get(s, 2);
    t.put(s, 3, 2 * PAGE_LEN);
    t.get(s, 3);
    // Free 0 + evictable 1 page < 2 pages: refused without evicting 1.
    assert_eq!(t.reserve(s, 9, 2 * PAGE_LEN).status, Status::OutOfMemory);
    assert!(t.st.peek(1).is_some());
    assert_eq!(t.st.stats().evictions, 0);
}

#[test]
fn out_of_memory_after_evicting_when_fragmented_changes_nothing() {
    // [1][2 pinned][3] and a 2-page request: enough bytes, no contiguous room.
    let mut t = T::new(3);
    let s = t.st.open_session();
    t.put(s, 1, PAGE_LEN);
    t.put(s, 2, PAGE_LEN);
    t.put(s, 3, PAGE_LEN);
    t.get(s, 2);
    assert_eq!(t.reserve(s, 9, 2 * PAGE_LEN).status, Status::OutOfMemory);
    // The blocks evicted while trying are back (`unit.rs`).
    assert!(t.st.peek(1).is_some() && t.st.peek(2).is_some() && t.st.peek(3).is_some());
    assert_eq!((t.st.stats().evictions, t.st.stats().bytes_free), (0, 0));
}

#[test]
fn close_session_releases_pins_and_aborts_reservations() {
    let mut t = T::new(16);
    let a = t.st.open_session();
    let b = t.st.open_session();
    t.put(a, 1, PAGE_LEN);
    t.put(a, 2, PAGE_LEN);
    let g1 = t.get(b, 1);
    t.get(b, 1);
    t.get(b, 2);
    let ga = t.get(a, 2);
    let res = t.reserve(b, 3, 4 * PAGE_LEN);
    // 2 is deleted while pinned by both.
    assert_eq!(t.status(a, Request::Delete { key: 2 }), Status::Ok);
    let st = t.st.stats();
    assert_eq!((st.pins, st.reserved, st.bytes_used), (4, 1, 6 * PAGE_LEN));

    t.st.close_session(b);
    t.st.check_invariants().unwrap();
    assert!(!t.st.is_open(b));
    let st = t.st.stats();
    assert_eq!((st.pins, st.reserved, st.sessions), (1, 0, 1));
    assert_eq!(st.bytes_used, 2 * PAGE_LEN, "reservation aborted, 2 still pinned by a");
    assert_eq!(st.evictable_bytes, PAGE_LEN, "1 is evictable again");
    // Requests of a closed session are refused; its handles are dead.
    assert_eq!(t.status(b, Request::Ping), Status::Internal);
    assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Commit { handle: res.handle, parent: None }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Release { handle: ga.handle }), Status::Ok);
    assert_eq!(t.st.stats().bytes_used, PAGE_LEN);
    t.st.close_session(b);
    t.st.close_session(a);
    t.st.check_invariants().unwrap();
    assert_eq!(t.st.stats().sessions, 0);
    assert!(t.st.peek(1).is_some(), "committed blocks outlive sessions");
    assert_eq!(t.st.stats().internal, 1);
}

#[test]
fn unknown_session_is_internal() {
    let mut st = Store::new(SLAB_OFFSET, MIB);
    let c = st.handle(SessionId(999), 5, &Request::Ping);
    assert_eq!((c.status, c.request_id), (Status::Internal, 5));
    assert_eq!(st.stats().internal, 1);
}

#[test]
fn handle_encoding_round_trips() {
    for (kind, index, generation) in
        [(HandleKind::Reservation, 0, 0), (HandleKind::Pin, u32::MAX, GEN_MASK), (HandleKind::Pin, 7, 12345)]
    {
        let h = encode_handle(kind, index, generation);
        assert_ne!(h, 0);
        assert_eq!(decode_handle(h), Some((kind, index, generation)));
    }
    assert_eq!(decode_handle(0), None);
    assert_eq!(decode_handle(u64::MAX), None);
    assert_eq!(next_generation(GEN_MASK), 0);
}

#[test]
fn commit_pin_commits_and_pins_the_same_extent() {
    let mut t = T::new(8);
    let (a, b) = (t.st.open_session(), t.st.open_session());
    let r = t.reserve(a, 7, 4 * PAGE_LEN);
    assert_eq!(r.status, Status::Ok);
    let c = t.req(a, Request::CommitPin { handle: r.handle, parent: None });
    assert_eq!((c.op, c.status, c.offset), (Op::CommitPin, Status::Ok, r.offset));
    assert_eq!(c.tensor.map(|(_, _, len)| len), Some(4 * PAGE_LEN));
    assert_eq!(Completion::decode(&c.encode()).unwrap(), c);
    let st = t.st.stats();
    assert_eq!((st.reserved, st.pins, st.blocks, st.commits, st.evictable_bytes), (0, 1, 1, 1, 0));
    // Pinned: neither eviction nor a replacing commit frees the extent.
    assert_eq!(t.reserve(b, 8, 8 * PAGE_LEN).status, Status::OutOfMemory);
    let r2 = t.reserve(b, 7, 4 * PAGE_LEN);
    assert_eq!(r2.status, Status::Ok);
    assert_ne!(r2.offset, r.offset);
    assert_eq!(t.status(b, Request::Commit { handle: r2.handle, parent: None }), Status::Ok);
    // The new block of key 7 pinned too: only the replaced block's release can make room.
    let g = t.get(b, 7);
    assert_eq!((g.status, g.offset), (Status::Ok, r2.offset));
    assert_eq!(t.reserve(b, 9, 4 * PAGE_LEN).status, Status::OutOfMemory, "the replaced block is still pinned");
    assert_eq!(t.status(a, Request::Release { handle: c.handle }), Status::Ok);
    assert_eq!(t.reserve(b, 9, 4 * PAGE_LEN).status, Status::Ok, "freed by the last release");
    // The handle is spent, and another session's COMMIT_PIN is refused.
    assert_eq!(t.status(a, Request::CommitPin { handle: r.handle, parent: None }), Status::BadHandle);
    let r3 = t.reserve(a, 10, PAGE_LEN);
    assert_eq!(t.status(b, Request::CommitPin { handle: r3.handle, parent: None }), Status::BadHandle);
}

#[test]
fn commit_as_commits_under_the_named_key() {
    let mut t = T::new(16);
    let (a, b) = (t.st.open_session(), t.st.open_session());
    // Two open reservations made with the same placeholder key (0) do not clash.
    let r1 = t.reserve(a, 0, PAGE_LEN);
    let r2 = t.reserve(a, 0, PAGE_LEN);
    assert_eq!((r1.status, r2.status), (Status::Ok, Status::Ok));
    assert_eq!(t.status(a, Request::CommitAs { handle: r1.handle, key: 11, parent: None, pin: false }), Status::Ok);
    let c = t.req(a, Request::CommitAs { handle: r2.handle, key: 12, parent: None, pin: true });
    assert_eq!((c.op, c.status, c.offset), (Op::CommitPin, Status::Ok, r2.offset));
    assert_eq!(t.get(b, 11).offset, r1.offset);
    assert_eq!(t.get(b, 12).offset, r2.offset);
    assert_eq!(t.get(b, 0).status, Status::NotFound, "the placeholder key names nothing");
    let st = t.st.stats();
    assert_eq!((st.reserved, st.blocks, st.commits), (0, 2, 2));
    // The pin of the COMMIT_PIN form is on the committed block.
    assert_eq!(t.status(a, Request::Release { handle: c.handle }), Status::Ok);
}

#[test]
fn commit_as_refuses_what_is_not_an_open_reservation_of_the_session() {
    let mut t = T::new(16);
    let (a, b) = (t.st.open_session(), t.st.open_session());
    // An unknown handle: nothing changes.
    for pin in [false, true] {
        assert_eq!(t.status(a, Request::CommitAs { handle: 0, key: 5, parent: None, pin }), Status::BadHandle);
        assert_eq!(t.status(a, Request::CommitAs { handle: u64::MAX, key: 5, parent: None, pin }), Status::BadHandle);
    }
    // Another session's reservation: refused, and it stays open for its owner.
    let r = t.reserve(a, 0, PAGE_LEN);
    assert_eq!(
        t.status(b, Request::CommitAs { handle: r.handle, key: 5, parent: None, pin: false }),
        Status::BadHandle
    );
    assert_eq!(t.st.stats().reserved, 1);
    assert_eq!(t.get(b, 5).status, Status::NotFound);
    // A double commit: the second is refused and changes nothing.
    assert_eq!(t.status(a, Request::CommitAs { handle: r.handle, key: 5, parent: None, pin: false }), Status::Ok);
    assert_eq!(
        t.status(a, Request::CommitAs { handle: r.handle, key: 6, parent: None, pin: false }),
        Status::BadHandle
    );
    assert_eq!(t.status(a, Request::CommitAs { handle: r.handle, key: 6, parent: None, pin: true }), Status::BadHandle);
    assert_eq!(t.status(a, Request::Commit { handle: r.handle, parent: None }), Status::BadHandle);
    assert_eq!(t.get(b, 6).status, Status::NotFound);
    let st = t.st.stats();
    assert_eq!((st.reserved, st.blocks), (0, 1));
    // An aborted reservation cannot be committed under a key.
    let r = t.reserve(a, 0, PAGE_LEN);
    assert_eq!(t.status(a, Request::Abort { handle: r.handle }), Status::Ok);
    assert_eq!(
        t.status(a, Request::CommitAs { handle: r.handle, key: 7, parent: None, pin: false }),
        Status::BadHandle
    );
    assert_eq!(t.get(b, 7).status, Status::NotFound);
}

#[test]
fn commit_as_onto_a_present_key_replaces_it_as_any_commit() {
    let mut t = T::new(16);
    let (a, b) = (t.st.open_session(), t.st.open_session());
    let old = t.put(b, 9, PAGE_LEN);
    let reader = t.get(b, 9);
    assert_eq!(reader.offset, old);
    // Reserved under another key (its own key is not touched), committed as 9.
    let other = t.put(a, 3, PAGE_LEN);
    let r = t.reserve(a, 3, PAGE_LEN);
    assert_eq!(t.status(a, Request::CommitAs { handle: r.handle, key: 9, parent: None, pin: false }), Status::Ok);
    assert_eq!(t.get(a, 9).offset, r.offset, "the newer block of 9");
    assert_eq!(t.get(a, 3).offset, other, "the reserved-with key keeps its block");
    let st = t.st.stats();
    assert_eq!((st.blocks, st.replaced), (2, 1));
    // The replaced block stays pinned by its reader until released.
    assert_eq!(st.unlinked_blocks, 1);
    assert_eq!(t.status(b, Request::Release { handle: reader.handle }), Status::Ok);
    assert_eq!(t.st.stats().unlinked_blocks, 0);
}
