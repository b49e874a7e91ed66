//! Eviction: the eviction list (the blocks eviction may take now, least
//! recently used first), the chain links that decide which blocks are on it,
//! and the allocation that evicts from its head until a reservation fits (see
//! the module docs of [`store`](super), "Eviction", and `docs/eviction.md`).

use super::slots::SlotState;
use super::Store;
use crate::alloc::Extent;
use kachedb_shm::Status;

/// Which linked unpinned blocks eviction may take (`kachedb serve --eviction`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum EvictionPolicy {
    /// Leaves first: only blocks that no linked block names as parent are on
    /// the eviction list, least recently used first; evicting a leaf may make
    /// its parent one. A linked block's ancestors stay linked.
    #[default]
    Chain,
    /// Plain LRU: every linked unpinned block is on the list, parents or not.
    Lru,
}

impl EvictionPolicy {
    /// The policy's name in stats and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Chain => "chain",
            EvictionPolicy::Lru => "lru",
        }
    }
}

/// Why a block is unlinked (for the counts of chain links cut).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unlink {
    /// DELETE, or a COMMIT of a newer block of the same key.
    Dropped,
    /// Eviction.
    Evicted,
}

impl Store {
    /// An extent of `need_len` bytes (a page multiple), evicting from the head
    /// of the eviction list if needed (see the module docs).
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
            self.unlink(index, Unlink::Evicted)?;
            if self.lru.get(&tick) == Some(&index) {
                // `unlink` must take it off the list; never loop forever.
                return Err(Status::Internal);
            }
            self.counters.evicted(extent_len);
            if let Some(e) = self.alloc.alloc(need_len) {
                return Ok(e);
            }
        }
    }

    /// Marks block `index` as just used (a fresh tick); if eviction may take
    /// it, it moves to the most-recent end of the list.
    pub(super) fn lru_touch(&mut self, index: u32) -> Result<(), Status> {
        self.tick = self.tick.wrapping_add(1);
        let tick = self.tick;
        match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { last_use, linked: true, .. }) => *last_use = tick,
            _ => return Err(Status::Internal),
        }
        self.resync(index)
    }

    /// Puts block `index` where its state now says, after a change of
    /// `linked`, `pins` or `children`: counted in `evictable_bytes` when linked
    /// and unpinned; on the eviction list (under its `last_use`) when, besides,
    /// the policy is LRU or it has no children.
    pub(super) fn resync(&mut self, index: u32) -> Result<(), Status> {
        let lru_policy = self.policy == EvictionPolicy::Lru;
        let Some(SlotState::Block { tensor, linked, pins, lru_tick, last_use, counted, children, .. }) =
            self.slots.get_mut(index as usize).map(|slot| &mut slot.state)
        else {
            return Err(Status::Internal);
        };
        let len = tensor.extent.len;
        let evictable = *linked && *pins == 0;
        let listed = evictable && (lru_policy || *children == 0);
        let was_counted = std::mem::replace(counted, evictable);
        let old_tick = if listed { lru_tick.replace(*last_use) } else { lru_tick.take() };
        let new_tick = listed.then_some(*last_use);
        if let Some(old) = old_tick {
            if self.lru.remove(&old) != Some(index) {
                return Err(Status::Internal);
            }
        }
        if let Some(t) = new_tick {
            self.lru.insert(t, index);
        }
        match (was_counted, evictable) {
            (false, true) => self.evictable_bytes += len,
            (true, false) => {
                self.evictable_bytes = self.evictable_bytes.checked_sub(len).ok_or(Status::Internal)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Links just-committed block `index` (no children yet) to the linked
    /// block of key `parent`; a parent that is not linked, or is the block
    /// itself, is counted and the block stays without one. A new block has no
    /// children, so no link can close a cycle.
    pub(super) fn link_parent(&mut self, index: u32, parent: u128) -> Result<(), Status> {
        let p = match self.keys.get(&parent) {
            Some(&p) if p != index => p,
            _ => {
                self.counters.parent_missing();
                return Ok(());
            }
        };
        match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { parent: own, children: 0, linked: true, .. }) if own.is_none() => *own = Some(p),
            _ => return Err(Status::Internal),
        }
        match self.slots.get_mut(p as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { children, linked: true, .. }) => *children += 1,
            _ => return Err(Status::Internal),
        }
        self.links.insert((p, index));
        self.resync(p)
    }

    /// Cuts the chain links of block `index`, which is being unlinked: its
    /// children become blocks without a parent (counted), and its parent
    /// loses a child (and may become a leaf).
    pub(super) fn cut_links(&mut self, index: u32, why: Unlink) -> Result<(), Status> {
        let parent = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { parent, children, .. }) => {
                *children = 0;
                parent.take()
            }
            _ => return Err(Status::Internal),
        };
        let kids: Vec<u32> = self.links.range((index, 0)..=(index, u32::MAX)).map(|&(_, c)| c).collect();
        for c in kids {
            self.links.remove(&(index, c));
            match self.slots.get_mut(c as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { parent, .. }) if *parent == Some(index) => *parent = None,
                _ => return Err(Status::Internal),
            }
            self.counters.link_cut(why == Unlink::Evicted);
        }
        if let Some(p) = parent {
            if !self.links.remove(&(p, index)) {
                return Err(Status::Internal);
            }
            match self.slots.get_mut(p as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { children, .. }) => {
                    *children = children.checked_sub(1).ok_or(Status::Internal)?;
                }
                _ => return Err(Status::Internal),
            }
            self.resync(p)?;
        }
        Ok(())
    }

    /// Sets the eviction policy and rebuilds the eviction list for it.
    pub fn set_eviction_policy(&mut self, policy: EvictionPolicy) {
        self.policy = policy;
        for index in 0..self.slots.len() {
            let is_block = self.slots.get(index).is_some_and(|slot| matches!(slot.state, SlotState::Block { .. }));
            if is_block && self.resync(index as u32).is_err() {
                self.counters.internal_error();
            }
        }
    }

    /// The eviction policy.
    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.policy
    }
}
