//! The operations on reservations and blocks: RESERVE, COMMIT, ABORT, GET,
//! RELEASE, LOOKUP, DELETE, and the unlinking and freeing they lead to.

use super::evict::Unlink;
use super::handles::{decode_handle, encode_handle, HandleKind};
use super::slots::{is_lent, Pin, SlotState, MAX_SLOTS};
use super::unit::Undo;
use super::{IndexChange, Reply, SessionId, Store, Tensor};
use crate::alloc::round_up_to_pages;
use kachedb_shm::{page_offset_is_valid, DType, Op, Shape, Status};

impl Store {
    /// RESERVE. On an error the blocks evicted on the way are evicted still:
    /// the caller undoes them (`unit.rs`).
    pub(super) fn reserve(
        &mut self,
        s: SessionId,
        key: u128,
        dtype: DType,
        shape: Shape,
        len: u64,
        page_offset: u64,
    ) -> Result<Reply, Status> {
        // `Request::decode` guarantees these; a hand-built request may not.
        if !page_offset_is_valid(page_offset) || shape.check_len(dtype, len).is_err() {
            return Err(Status::Invalid);
        }
        let need = len.checked_add(page_offset).ok_or(Status::TooLarge)?;
        if need > self.slab_len {
            return Err(Status::TooLarge);
        }
        let need_len = round_up_to_pages(need).ok_or(Status::TooLarge)?;
        if need_len > self.alloc.total_bytes() {
            return Err(Status::TooLarge);
        }
        if self.free_slots.is_empty() && self.slots.len() >= MAX_SLOTS {
            return Err(Status::OutOfMemory);
        }
        self.within_limit(s, need_len)?;
        let (tenant, limit_applies, no_evict) = self
            .sessions
            .get(&s)
            .map_or((0, true, false), |x| (x.tenant, !x.internal || x.fills_for_tenant, x.internal && x.no_evict));
        let extent = if no_evict {
            self.alloc_free_only(need_len, tenant, limit_applies)?
        } else {
            self.alloc_evicting(need_len, tenant, limit_applies)?
        };
        let tensor = Tensor { key, dtype, shape, len, data_offset: extent.offset + page_offset, extent, tenant };
        let fresh = self.free_slots.is_empty();
        let Some(index) = self.take_slot(SlotState::Reserved { owner: s, tensor }) else {
            // Unreachable after the check above; give the extent back.
            let _ = self.alloc.try_free(extent);
            return Err(Status::Internal);
        };
        let generation = self.slots.get(index as usize).map(|slot| slot.generation).ok_or(Status::Internal)?;
        self.journal.note(Undo::Reserved { session: s, index, fresh, generation });
        self.counters.reservation_opened();
        self.tenants.row(tenant).figures.bytes += extent.len;
        self.sessions.get_mut(&s).ok_or(Status::Internal)?.reservations.insert(index);
        self.hold(s, extent.len, true);
        Ok(Reply {
            handle: encode_handle(HandleKind::Reservation, index, generation),
            offset: tensor.data_offset,
            tensor: None,
        })
    }

    /// COMMIT of session `s`'s reservation `handle`. A COMMIT that would
    /// replace a block session `s` may not change ([`may_change`](Self::may_change))
    /// is `DENIED` and changes nothing: the reservation stays open, for the
    /// client to ABORT (or COMMIT under another key).
    pub(super) fn commit(&mut self, s: SessionId, handle: u64, parent: Option<u128>) -> Result<Reply, Status> {
        let index = self.own_reservation(s, handle)?;
        let key = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Reserved { tensor, .. }) => tensor.key,
            _ => return Err(Status::Internal),
        };
        self.may_change(s, key)?;
        let slot = self.slots.get_mut(index as usize).ok_or(Status::Internal)?;
        let SlotState::Reserved { tensor, .. } = slot.state else {
            return Err(Status::Internal);
        };
        slot.state = SlotState::Block {
            tensor,
            linked: true,
            pins: 0,
            foreign_pins: 0,
            holding_children: 0,
            lru_tick: None,
            last_use: 0,
            counted: false,
            parent: None,
            children: 0,
            rooted: false,
        };
        self.counters.reservation_closed();
        self.counters.stored(tensor.len);
        self.tenants.row(tensor.tenant).figures.stored_bytes += tensor.len;
        if let Some(session) = self.sessions.get_mut(&s) {
            session.reservations.remove(&index);
        }
        self.hold(s, tensor.extent.len, false);
        let replaced = self.keys.insert(tensor.key, index);
        if let Some(old) = replaced {
            self.counters.block_replaced();
            self.unlink(old, Unlink::Dropped)?;
        }
        if let Some(parent) = parent {
            self.link_parent(index, parent)?;
        }
        let linked_parent = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { parent: Some(p), .. }) => self.key_of(*p),
            _ => None,
        };
        if self.changes.is_on() {
            let meta = self.metas.get(&index).cloned();
            self.changes.push(IndexChange::Stored {
                key: tensor.key,
                parent: linked_parent,
                replaced: replaced.is_some(),
                meta,
            });
        }
        self.linked_now(index, parent.is_none())?;
        self.lru_touch(index)?;
        Ok(Reply::default())
    }

    /// COMMIT, then a GET of the key by the same session within this one
    /// request: the pin is on the block just committed (the key names it until
    /// another request runs), so nothing can evict, replace-and-free or reuse
    /// its extent in between. A pin slot is checked first, so an
    /// OUT_OF_MEMORY answer leaves the reservation open (as a `DENIED` one does).
    pub(super) fn commit_pin(&mut self, s: SessionId, handle: u64, parent: Option<u128>) -> Result<Reply, Status> {
        let index = self.own_reservation(s, handle)?;
        if self.free_pin_slots.is_empty() && self.pin_slots.len() >= MAX_SLOTS {
            return Err(Status::OutOfMemory);
        }
        let key = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Reserved { tensor, .. }) => tensor.key,
            _ => return Err(Status::Internal),
        };
        self.commit(s, handle, parent)?;
        // The reservation's bytes were held until the commit above; the pin
        // holds the same extent, so the per-client limit cannot refuse it.
        self.get(s, key)
    }

    /// COMMIT (`pin`: COMMIT_PIN) of session `s`'s reservation `handle` under
    /// `key`, the key it was reserved with set aside (`COMMIT_NAMES_KEY`):
    /// from here on exactly a COMMIT (COMMIT_PIN) of a reservation made
    /// with `key`, naming `parent`. An unknown or finished handle is
    /// `BAD_HANDLE` and changes nothing; an OUT_OF_MEMORY (no pin slot) or a
    /// `DENIED` (`key`'s block is one `s` may not replace) leaves the
    /// reservation open under its old key.
    pub(super) fn commit_as(
        &mut self,
        s: SessionId,
        handle: u64,
        key: u128,
        parent: Option<u128>,
        pin: bool,
    ) -> Result<Reply, Status> {
        let index = self.own_reservation(s, handle)?;
        if pin && self.free_pin_slots.is_empty() && self.pin_slots.len() >= MAX_SLOTS {
            return Err(Status::OutOfMemory);
        }
        self.may_change(s, key)?;
        match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Reserved { tensor, .. }) => tensor.key = key,
            _ => return Err(Status::Internal),
        }
        if pin {
            self.commit_pin(s, handle, parent)
        } else {
            self.commit(s, handle, parent)
        }
    }

    pub(super) fn abort(&mut self, s: SessionId, handle: u64) -> Result<Reply, Status> {
        let index = self.own_reservation(s, handle)?;
        if let Some(session) = self.sessions.get_mut(&s) {
            session.reservations.remove(&index);
        }
        if let Some(SlotState::Reserved { tensor, .. }) = self.slots.get(index as usize).map(|slot| &slot.state) {
            let len = tensor.extent.len;
            self.hold(s, len, false);
        }
        self.free_reservation(index)?;
        Ok(Reply::default())
    }

    /// GET: a pin of the block of `key` for session `s`. The first pin of a
    /// block by a client of another tenant is charged to that client's
    /// tenant (`tenants.rs`, "Limits"): it may evict that tenant's own
    /// blocks first, or be refused. On an error the blocks evicted on the
    /// way are evicted still: the caller undoes them (`unit.rs`).
    pub(super) fn get(&mut self, s: SessionId, key: u128) -> Result<Reply, Status> {
        let &index = self.keys.get(&key).ok_or(Status::NotFound)?;
        let tensor = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { tensor, linked: true, .. }) => *tensor,
            _ => return Err(Status::Internal),
        };
        let session = self.sessions.get(&s).ok_or(Status::Internal)?;
        let (reader, internal, existing) = (session.tenant, session.internal, session.pins.get(&index).copied());
        let (pin_index, foreign) = match existing {
            Some(p) => {
                let pin = self.pin_slots.get_mut(p as usize).and_then(|ps| ps.pin.as_mut()).ok_or(Status::Internal)?;
                pin.count += 1;
                (p, pin.foreign)
            }
            None => {
                let foreign = !internal && reader != tensor.tenant;
                self.within_limit(s, tensor.extent.len)?;
                if foreign {
                    self.within_tenant_limit(reader, tensor.extent.len)?;
                }
                let p = self
                    .take_pin_slot_for(Pin { session: s, block_index: index, count: 1, foreign })
                    .ok_or(Status::OutOfMemory)?;
                self.sessions.get_mut(&s).ok_or(Status::Internal)?.pins.insert(index, p);
                self.hold(s, tensor.extent.len, true);
                if foreign {
                    self.tenants.row(reader).borrowed_bytes += tensor.extent.len;
                }
                (p, foreign)
            }
        };
        let generation = self.pin_slots.get(pin_index as usize).ok_or(Status::Internal)?.generation;
        let (first_pin, was_lent) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { pins, foreign_pins, .. }) => {
                let was_lent = is_lent(*pins, *foreign_pins);
                *pins += 1;
                if foreign {
                    *foreign_pins += 1;
                }
                self.counters.pinned();
                (*pins == 1, was_lent)
            }
            _ => return Err(Status::Internal),
        };
        if first_pin {
            self.resync(index)?;
        }
        self.lent_changed(index, was_lent)?;
        self.counters.hit(Op::Get, tensor.len);
        Ok(Reply {
            handle: encode_handle(HandleKind::Pin, pin_index, generation),
            offset: tensor.data_offset,
            tensor: Some((tensor.dtype, tensor.shape, tensor.len)),
        })
    }

    pub(super) fn release(&mut self, s: SessionId, handle: u64) -> Result<Reply, Status> {
        let (kind, pin_index, generation) = decode_handle(handle).ok_or(Status::BadHandle)?;
        if kind != HandleKind::Pin {
            return Err(Status::BadHandle);
        }
        let ps = self.pin_slots.get_mut(pin_index as usize).ok_or(Status::BadHandle)?;
        let pin = match ps.pin.as_mut() {
            Some(pin) if pin.session == s && ps.generation == generation => pin,
            _ => return Err(Status::BadHandle),
        };
        let (block_index, foreign) = (pin.block_index, pin.foreign);
        pin.count = pin.count.saturating_sub(1);
        self.counters.unpinned(1);
        if pin.count == 0 {
            self.take_pin_slot(pin_index)?;
            let reader = match self.sessions.get_mut(&s) {
                Some(session) => {
                    session.pins.remove(&block_index);
                    session.tenant
                }
                None => return Err(Status::Internal),
            };
            if let Some(SlotState::Block { tensor, .. }) = self.slots.get(block_index as usize).map(|slot| &slot.state)
            {
                let len = tensor.extent.len;
                self.hold(s, len, false);
                if foreign {
                    self.returned(reader, len)?;
                }
            }
        }
        self.drop_block_pins(block_index, 1, foreign)?;
        Ok(Reply::default())
    }

    /// Tenant `t`'s client dropped its last pin of another tenant's block of
    /// `len` extent bytes: `t` borrows it no more.
    pub(super) fn returned(&mut self, t: super::TenantId, len: u64) -> Result<(), Status> {
        let row = self.tenants.row(t);
        row.borrowed_bytes = row.borrowed_bytes.checked_sub(len).ok_or(Status::Internal)?;
        Ok(())
    }

    /// Block `index`'s pins changed, and it was lent (`was_lent`) before:
    /// if that changed, its tenant's lent bytes follow, and so does whether
    /// it holds its parent (`evict.rs`).
    pub(super) fn lent_changed(&mut self, index: u32, was_lent: bool) -> Result<(), Status> {
        let (now_lent, tenant, len, parent) = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { tensor, pins, foreign_pins, parent, .. }) => {
                (is_lent(*pins, *foreign_pins), tensor.tenant, tensor.extent.len, *parent)
            }
            _ => return Err(Status::Internal),
        };
        if now_lent == was_lent {
            return Ok(());
        }
        let row = self.tenants.row(tenant);
        row.lent_bytes =
            if now_lent { row.lent_bytes + len } else { row.lent_bytes.checked_sub(len).ok_or(Status::Internal)? };
        let Some(p) = parent else { return Ok(()) };
        match self.slots.get_mut(p as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, holding_children, .. }) if tensor.tenant == tenant => {
                *holding_children = if now_lent {
                    holding_children.checked_sub(1).ok_or(Status::Internal)?
                } else {
                    *holding_children + 1
                };
            }
            Some(SlotState::Block { .. }) => return Ok(()),
            _ => return Err(Status::Internal),
        }
        self.resync(p)
    }

    pub(super) fn lookup(&mut self, key: u128) -> Result<Reply, Status> {
        let &index = self.keys.get(&key).ok_or(Status::NotFound)?;
        self.lru_touch(index)?;
        if let Some(SlotState::Block { tensor, .. }) = self.slots.get(index as usize).map(|slot| &slot.state) {
            self.counters.hit(Op::Lookup, tensor.len);
        }
        Ok(Reply::default())
    }

    /// DELETE of `key` by session `s`: `DENIED`, changing nothing, for a
    /// block `s` may not change ([`may_change`](Self::may_change)).
    pub(super) fn delete(&mut self, s: SessionId, key: u128) -> Result<Reply, Status> {
        let &index = self.keys.get(&key).ok_or(Status::NotFound)?;
        self.may_change(s, key)?;
        self.unlink(index, Unlink::Dropped)?;
        Ok(Reply::default())
    }

    /// Whether session `s` may replace or delete the block of `key` (`Ok`
    /// when there is none): a block of a bound tenant (`--tenant-uid`,
    /// `--tenant-gid`) only that tenant's sessions and the daemon's own (a
    /// tier's fills) may; any other block, any session. Reading is open to
    /// all: keys are shared across tenants on purpose (the same prefix is
    /// the same KV).
    pub(super) fn may_change(&self, s: SessionId, key: u128) -> Result<(), Status> {
        let Some(&index) = self.keys.get(&key) else { return Ok(()) };
        let owner = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { tensor, .. }) => tensor.tenant,
            _ => return Err(Status::Internal),
        };
        if !self.tenant_bound(owner) {
            return Ok(());
        }
        match self.sessions.get(&s) {
            Some(x) if x.internal || x.tenant == owner => Ok(()),
            _ => Err(Status::Denied),
        }
    }

    /// Drops `count` pins of block `index` (`foreign`: held by a client of
    /// another tenant); at zero the block becomes evictable (linked) or is
    /// freed (unlinked).
    pub(super) fn drop_block_pins(&mut self, index: u32, count: u64, foreign: bool) -> Result<(), Status> {
        let (now_unpinned, linked, was_lent) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { pins, foreign_pins, linked, .. }) => {
                let was_lent = is_lent(*pins, *foreign_pins);
                *pins = pins.checked_sub(count).ok_or(Status::Internal)?;
                if foreign {
                    *foreign_pins = foreign_pins.checked_sub(count).ok_or(Status::Internal)?;
                }
                (*pins == 0, *linked, was_lent)
            }
            _ => return Err(Status::Internal),
        };
        self.lent_changed(index, was_lent)?;
        if now_unpinned {
            if linked {
                self.lru_touch(index)?;
            } else {
                self.free_block(index)?;
            }
        }
        Ok(())
    }

    /// Unlinks block `index` from its key (if it is still the key's block),
    /// the eviction list and its chain links; frees it now if unpinned, else
    /// its last RELEASE will.
    pub(super) fn unlink(&mut self, index: u32, why: Unlink) -> Result<(), Status> {
        let (key, pins, tenant, len, rooted) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, linked, pins, rooted, .. }) if *linked => {
                *linked = false;
                (tensor.key, *pins, tensor.tenant, tensor.extent.len, std::mem::take(rooted))
            }
            _ => return Err(Status::Internal),
        };
        self.resident(tenant, len, rooted, false)?;
        if self.keys.get(&key) == Some(&index) {
            self.keys.remove(&key);
            self.changes.push(IndexChange::Removed { key });
        }
        self.resync(index)?;
        self.cut_links(index, why)?;
        if pins == 0 {
            self.free_block(index)?;
        }
        Ok(())
    }

    /// Frees the extent and slot of unlinked, unpinned block `index`.
    pub(super) fn free_block(&mut self, index: u32) -> Result<(), Status> {
        let extent = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block {
                tensor,
                linked: false,
                pins: 0,
                foreign_pins: 0,
                lru_tick: None,
                counted: false,
                parent: None,
                children: 0,
                holding_children: 0,
                ..
            }) => (tensor.extent, tensor.tenant),
            _ => return Err(Status::Internal),
        };
        let (extent, tenant) = extent;
        self.alloc.try_free(extent).map_err(|_| Status::Internal)?;
        self.tenant_bytes_freed(tenant, extent.len)?;
        self.release_slot(index)
    }

    /// Tenant `tenant`'s extent of `len` bytes was freed.
    pub(super) fn tenant_bytes_freed(&mut self, tenant: super::TenantId, len: u64) -> Result<(), Status> {
        let f = &mut self.tenants.row(tenant).figures;
        f.bytes = f.bytes.checked_sub(len).ok_or(Status::Internal)?;
        Ok(())
    }

    /// Block `index` was just linked under its key (and to its parent, if
    /// the COMMIT named one that is linked): counts it for its tenant, as
    /// reachable if it names no parent or its parent is rooted.
    fn linked_now(&mut self, index: u32, no_parent: bool) -> Result<(), Status> {
        let parent = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { parent, linked: true, .. }) => *parent,
            _ => return Err(Status::Internal),
        };
        let parent_rooted = parent.is_some_and(|p| {
            matches!(self.slots.get(p as usize).map(|slot| &slot.state), Some(SlotState::Block { rooted: true, .. }))
        });
        let is_rooted = no_parent || parent_rooted;
        let (tenant, len) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, rooted, .. }) => {
                *rooted = is_rooted;
                (tensor.tenant, tensor.extent.len)
            }
            _ => return Err(Status::Internal),
        };
        self.resident(tenant, len, is_rooted, true)
    }

    /// A linked block of `len` extent bytes of `tenant`, `rooted` or not,
    /// is `added` to (or taken from) the linked blocks.
    pub(super) fn resident(
        &mut self,
        tenant: super::TenantId,
        len: u64,
        rooted: bool,
        added: bool,
    ) -> Result<(), Status> {
        let total = if rooted { &mut self.reachable_bytes } else { &mut self.orphaned_bytes };
        let f = &mut self.tenants.row(tenant).figures;
        let (row, blocks) = (if rooted { &mut f.reachable_bytes } else { &mut f.orphaned_bytes }, &mut f.blocks);
        if added {
            *total += len;
            *row += len;
            *blocks += 1;
        } else {
            *total = total.checked_sub(len).ok_or(Status::Internal)?;
            *row = row.checked_sub(len).ok_or(Status::Internal)?;
            *blocks = blocks.checked_sub(1).ok_or(Status::Internal)?;
        }
        Ok(())
    }

    /// Frees the extent and slot of reservation `index` (the caller updates
    /// the owning session's set).
    pub(super) fn free_reservation(&mut self, index: u32) -> Result<(), Status> {
        let (extent, tenant) = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Reserved { tensor, .. }) => (tensor.extent, tensor.tenant),
            _ => return Err(Status::Internal),
        };
        self.alloc.try_free(extent).map_err(|_| Status::Internal)?;
        self.tenant_bytes_freed(tenant, extent.len)?;
        self.release_slot(index)?;
        self.counters.reservation_closed();
        Ok(())
    }
}
