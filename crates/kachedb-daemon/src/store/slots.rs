//! The slot tables behind handles: block slots (a reservation or a block
//! each) and pin slots (one session's pins of one block each). Freed slots
//! are reused; each one's generation is bumped when it is freed, so a stale
//! handle no longer matches.

use super::handles::next_generation;
use super::{SessionId, Store, Tensor};
use kachedb_shm::Status;

/// Slot indexes are `u32`; at most this many slots of each table.
pub(super) const MAX_SLOTS: usize = u32::MAX as usize;

#[derive(Clone, Debug)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) enum SlotState {
    Free,
    Reserved {
        owner: SessionId,
        tensor: Tensor,
    },
    Block {
        tensor: Tensor,
        /// The block of its key in `keys`.
        linked: bool,
        /// Pins, all sessions together.
        pins: u64,
        /// Of `pins`, those held by clients of another tenant than its own
        /// (not by the daemon's own sessions). When they are all its pins the
        /// block is **lent** ([`is_lent`]): charged to those tenants' limits
        /// instead of its own, and it holds no parent.
        foreign_pins: u64,
        /// Its key on its eviction list (its `last_use`); `Some` exactly when
        /// eviction may take it now ([`Store::resync`]).
        lru_tick: Option<u64>,
        /// Tick of its last use (commit, GET, LOOKUP, last RELEASE).
        last_use: u64,
        /// Whether its extent is counted in `evictable_bytes` (linked and unpinned).
        counted: bool,
        /// The linked block it follows in its chain (named at COMMIT); `None`
        /// for a block without one, and for every unlinked block.
        parent: Option<u32>,
        /// Linked blocks that name it as parent (0 when unlinked).
        children: u32,
        /// Of `children`, those that hold it off the eviction list under
        /// [`EvictionPolicy::Chain`](super::EvictionPolicy::Chain): the ones
        /// of its own tenant that are not lent. Another tenant's child, or one
        /// pinned only by other tenants' clients, does not keep it cached.
        holding_children: u32,
        /// Linked, and its chain back to its root is whole: it was committed
        /// naming no parent, or linked to a rooted parent, and no link above
        /// it has been cut since (false when unlinked). A rooted block's
        /// parent is rooted.
        rooted: bool,
    },
}

#[derive(Clone, Debug)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) struct Slot {
    /// Bumped each time the slot is freed.
    pub(super) generation: u32,
    pub(super) state: SlotState,
}

#[derive(Clone, Copy, Debug)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) struct Pin {
    pub(super) session: SessionId,
    pub(super) block_index: u32,
    /// GETs not yet released; > 0.
    pub(super) count: u64,
    /// The session is a client of another tenant than the block's (the
    /// daemon's own sessions never are): the pin counts in the block's
    /// `foreign_pins`, and the block's extent in that tenant's borrowed bytes.
    pub(super) foreign: bool,
}

/// Whether a block with `pins` pins, `foreign_pins` of them held by other
/// tenants' clients, is lent: pinned, and only by other tenants' clients.
pub(super) fn is_lent(pins: u64, foreign_pins: u64) -> bool {
    pins > 0 && foreign_pins == pins
}

#[derive(Clone, Debug)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) struct PinSlot {
    /// Bumped each time the slot is freed.
    pub(super) generation: u32,
    pub(super) pin: Option<Pin>,
}

impl Store {
    /// Puts `state` in a free slot (reusing one if any); `None` when the table is full.
    pub(super) fn take_slot(&mut self, state: SlotState) -> Option<u32> {
        if let Some(index) = self.free_slots.pop() {
            match self.slots.get_mut(index as usize) {
                Some(slot) => {
                    slot.state = state;
                    return Some(index);
                }
                None => return None,
            }
        }
        if self.slots.len() >= MAX_SLOTS {
            return None;
        }
        let index = u32::try_from(self.slots.len()).ok()?;
        self.slots.push(Slot { generation: 0, state });
        Some(index)
    }

    /// Marks slot `index` free and bumps its generation.
    pub(super) fn release_slot(&mut self, index: u32) -> Result<(), Status> {
        let slot = self.slots.get_mut(index as usize).ok_or(Status::Internal)?;
        slot.state = SlotState::Free;
        slot.generation = next_generation(slot.generation);
        if !self.metas.is_empty() {
            self.metas.remove(&index);
        }
        self.free_slots.push(index);
        Ok(())
    }

    pub(super) fn take_pin_slot_for(&mut self, pin: Pin) -> Option<u32> {
        if let Some(index) = self.free_pin_slots.pop() {
            let ps = self.pin_slots.get_mut(index as usize)?;
            ps.pin = Some(pin);
            return Some(index);
        }
        if self.pin_slots.len() >= MAX_SLOTS {
            return None;
        }
        let index = u32::try_from(self.pin_slots.len()).ok()?;
        self.pin_slots.push(PinSlot { generation: 0, pin: Some(pin) });
        Some(index)
    }

    /// Empties pin slot `index` (bumping its generation); returns the pin it held.
    pub(super) fn take_pin_slot(&mut self, index: u32) -> Result<Pin, Status> {
        let ps = self.pin_slots.get_mut(index as usize).ok_or(Status::Internal)?;
        let pin = ps.pin.take().ok_or(Status::Internal)?;
        ps.generation = next_generation(ps.generation);
        self.free_pin_slots.push(index);
        Ok(pin)
    }
}
