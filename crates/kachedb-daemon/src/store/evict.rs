//! The LRU list and eviction: linked unpinned blocks, least recently used
//! first, and the allocation that evicts from its head until a reservation
//! fits (see the module docs of [`store`](super), "Eviction").

use super::slots::SlotState;
use super::Store;
use crate::alloc::Extent;
use kachedb_shm::Status;

impl Store {
    /// An extent of `need_len` bytes (a page multiple), evicting LRU blocks
    /// if needed (see the module docs).
    pub(super) fn alloc_evicting(&mut self, need_len: u64) -> Result<Extent, Status> {
        if let Some(e) = self.alloc.alloc(need_len) {
            return Ok(e);
        }
        if self.alloc.free_bytes().saturating_add(self.evictable_bytes) < need_len {
            return Err(Status::OutOfMemory);
        }
        loop {
            let Some((&tick, &index)) = self.lru.first_key_value() else {
                return Err(Status::OutOfMemory);
            };
            let extent_len = match self.slots.get(index as usize).map(|slot| &slot.state) {
                Some(SlotState::Block { tensor, .. }) => tensor.extent.len,
                _ => return Err(Status::Internal),
            };
            self.unlink(index)?;
            if self.lru.contains_key(&tick) {
                // `unlink` must take it off the list; never loop forever.
                return Err(Status::Internal);
            }
            self.counters.evicted(extent_len);
            if let Some(e) = self.alloc.alloc(need_len) {
                return Ok(e);
            }
        }
    }

    /// Marks linked block `index` as just used: if unpinned it moves to the
    /// most-recent end of the LRU list. Pinned blocks are not on the list.
    pub(super) fn lru_touch(&mut self, index: u32) -> Result<(), Status> {
        self.tick = self.tick.wrapping_add(1);
        let tick = self.tick;
        let (old, extent_len) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, linked: true, pins: 0, lru_tick }) => {
                (lru_tick.replace(tick), tensor.extent.len)
            }
            Some(SlotState::Block { linked: true, .. }) => return Ok(()),
            _ => return Err(Status::Internal),
        };
        match old {
            Some(old) => {
                self.lru.remove(&old);
            }
            None => self.evictable_bytes += extent_len,
        }
        self.lru.insert(tick, index);
        Ok(())
    }

    /// Takes block `index` off the LRU list if it is on it.
    pub(super) fn lru_remove(&mut self, index: u32) -> Result<(), Status> {
        let (old, extent_len) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, lru_tick, .. }) => (lru_tick.take(), tensor.extent.len),
            _ => return Err(Status::Internal),
        };
        if let Some(old) = old {
            self.lru.remove(&old);
            self.evictable_bytes = self.evictable_bytes.checked_sub(extent_len).ok_or(Status::Internal)?;
        }
        Ok(())
    }
}
