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
        }
    }
}
