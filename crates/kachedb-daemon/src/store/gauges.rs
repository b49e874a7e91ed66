//! [`Store::gauges`]: the store's gauges and byte counters in `O(1)`, for the
//! serve loop to publish to the metrics after every batch (the full
//! [`Store::stats`] walks every slot and is for the control socket only).

use super::Store;
use kachedb_shm::Op;

/// What [`Store::gauges`] reports; every field is kept up to date as the
/// store changes, so reading them costs a few loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Committed blocks linked under their key (what GET can find).
    pub blocks: u64,
    /// Bytes in allocated extents (blocks, unlinked blocks, reservations).
    pub bytes_used: u64,
    /// Bytes in free extents.
    pub bytes_free: u64,
    /// Bytes of the megaslab under management.
    pub bytes_capacity: u64,
    /// Bytes held by linked unpinned blocks (what eviction could free).
    pub bytes_evictable: u64,
    /// Pins held, all sessions and blocks together.
    pub pins: u64,
    /// Live reservations (not yet committed or aborted).
    pub reservations: u64,
    /// Blocks evicted since start.
    pub evictions: u64,
    /// Extent bytes freed by eviction since start.
    pub evicted_bytes: u64,
    /// Committed blocks that replaced an older block of the same key.
    pub replaced: u64,
    /// Tensor bytes of the blocks committed since start.
    pub stored_bytes: u64,
    /// Tensor bytes of the blocks GET found (and pinned) since start.
    pub get_hit_bytes: u64,
    /// Tensor bytes of the blocks LOOKUP found since start.
    pub lookup_hit_bytes: u64,
    /// Extent bytes of the linked blocks whose chain is whole.
    pub reachable_bytes: u64,
    /// Extent bytes of the other linked blocks.
    pub orphaned_bytes: u64,
}

impl Store {
    /// The gauges and byte counters; `O(1)`.
    pub fn gauges(&self) -> Gauges {
        let c = &self.counters;
        Gauges {
            blocks: self.keys.len() as u64,
            bytes_used: self.alloc.used_bytes(),
            bytes_free: self.alloc.free_bytes(),
            bytes_capacity: self.alloc.total_bytes(),
            bytes_evictable: self.evictable_bytes,
            pins: c.pins_held(),
            reservations: c.reservations_live(),
            evictions: c.evictions(),
            evicted_bytes: c.evicted_bytes(),
            replaced: c.replaced(),
            stored_bytes: c.stored_bytes(),
            get_hit_bytes: c.hit_bytes(Op::Get),
            lookup_hit_bytes: c.hit_bytes(Op::Lookup),
            reachable_bytes: self.reachable_bytes,
            orphaned_bytes: self.orphaned_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{reserve_req, SLAB_OFFSET};
    use super::*;
    use crate::alloc::PAGE_LEN;
    use kachedb_shm::{Request, Status};

    #[test]
    fn gauges_follow_every_change_and_agree_with_stats() {
        let mut st = Store::new(SLAB_OFFSET, 8 * PAGE_LEN);
        let (a, b) = (st.open_session(), st.open_session());
        let ok = |st: &mut Store, s, req: Request| {
            let c = st.handle(s, 1, &req);
            assert_eq!(c.status, Status::Ok, "{req:?}");
            st.check_invariants().unwrap();
            c
        };
        let r1 = ok(&mut st, a, reserve_req(1, 5000, 0));
        let _r2 = ok(&mut st, b, reserve_req(2, 100, 0));
        assert_eq!((st.gauges().reservations, st.gauges().bytes_used), (2, 3 * PAGE_LEN));
        ok(&mut st, a, Request::Commit { handle: r1.handle, parent: None });
        let p1 = ok(&mut st, a, Request::Get { key: 1 });
        ok(&mut st, b, Request::Get { key: 1 });
        ok(&mut st, b, Request::Get { key: 1 });
        ok(&mut st, a, Request::Lookup { key: 1 });
        let g = st.gauges();
        assert_eq!((g.blocks, g.pins, g.reservations), (1, 3, 1));
        assert_eq!((g.stored_bytes, g.get_hit_bytes, g.lookup_hit_bytes), (5000, 3 * 5000, 5000));
        ok(&mut st, a, Request::Release { handle: p1.handle });
        st.close_session(b); // drops b's 2 pins and its reservation
        let g = st.gauges();
        assert_eq!((g.pins, g.reservations, g.bytes_used, g.bytes_evictable), (0, 0, 2 * PAGE_LEN, 2 * PAGE_LEN));
        let full = st.stats();
        assert_eq!(
            (g.blocks, g.pins, g.reservations, g.bytes_used, g.bytes_free, g.bytes_capacity),
            (full.blocks, full.pins, full.reserved, full.bytes_used, full.bytes_free, full.bytes_total)
        );
        // Evicting: 7 one-page blocks into the 6 free pages push the oldest out.
        for k in 10..17u128 {
            let r = ok(&mut st, a, reserve_req(k, 10, 0));
            ok(&mut st, a, Request::Commit { handle: r.handle, parent: None });
        }
        let g = st.gauges();
        assert_eq!((g.evictions, g.evicted_bytes), (st.stats().evictions, st.stats().evicted_bytes));
        assert!(g.evictions > 0);
    }
}
