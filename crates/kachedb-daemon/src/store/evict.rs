//! Eviction: the eviction list (the blocks eviction may take now, least
//! recently used first), the chain links that decide which blocks are on it,
//! and the allocation that evicts from its head until a reservation fits (see
//! the module docs of [`store`](super), "Eviction", and `docs/eviction.md`).

use super::slots::{is_lent, Slot, SlotState};
use super::unit::Undo;
use super::{Store, TenantId};
use crate::alloc::Extent;
use kachedb_shm::Status;

/// Which linked unpinned blocks eviction may take (`kachedb serve --eviction`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(test, derive(serde::Serialize))]
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

/// Ticks below this are cold: a block made cold ([`Store::make_cold`]) is
/// listed under its slot index (`< 2^32`, unique among the blocks), below
/// every tick a use hands out, so eviction takes it before any block a
/// client used (first among the cold ones: the lowest slot).
pub(super) const COLD_TICKS: u64 = 1 << 32;

impl Store {
    /// Marks the block of `key` as never used: eviction takes it before any
    /// block a client used, until a client uses it (GET, LOOKUP, its last
    /// pin released: a fresh tick as usual). A tier's read-ahead commits its
    /// guesses so. Whether it was made cold (not a block, or a store handed
    /// over whose ticks could collide: left as it is).
    pub fn make_cold(&mut self, key: u128) -> bool {
        let Some(&index) = self.keys.get(&key) else { return false };
        if self.cold_ok.is_none() {
            // Once per store handed over: a tick below `COLD_TICKS` that is
            // not its block's own slot index could equal a cold one.
            let ok = self.slots.iter().enumerate().all(|(i, slot)| match &slot.state {
                SlotState::Block { last_use, .. } => *last_use >= COLD_TICKS || *last_use == i as u64,
                _ => true,
            });
            self.cold_ok = Some(ok);
        }
        if self.cold_ok != Some(true) {
            return false;
        }
        match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { last_use, linked: true, .. }) => *last_use = u64::from(index),
            _ => return false,
        }
        self.resync(index).is_ok()
    }

    /// Makes room for `need_len` more bytes within tenant `t`'s limit, if it
    /// has one: evicts from `t`'s own list until its charged bytes plus
    /// `need_len` fit, or, if even that could not make them fit (a dry run in
    /// the same order decides first), refuses with OUT_OF_MEMORY naming the
    /// limit and evicts nothing (`tenants.rs`, "Limits").
    pub(super) fn within_tenant_limit(&mut self, t: TenantId, need_len: u64) -> Result<(), Status> {
        let Some(limit) = self.tenants.get(t).limit else { return Ok(()) };
        let wanted = self.charged_bytes(t).saturating_add(need_len);
        if wanted <= limit {
            return Ok(());
        }
        if need_len > limit || !self.tenant_can_free(t, wanted - limit) {
            self.limit_hit = Some(limit);
            self.tenant_limit_hit = true;
            self.tenants.row(t).figures.limit_refusals += 1;
            self.counters.tenant_limit_hit();
            return Err(Status::OutOfMemory);
        }
        while self.charged_bytes(t).saturating_add(need_len) > limit {
            // The dry run above says the list does not run empty first.
            let (&tick, &index) = self.tenants.get(t).list.first_key_value().ok_or(Status::Internal)?;
            self.evict(index, tick)?;
        }
        Ok(())
    }

    /// An extent of `need_len` bytes (a page multiple) for tenant `t` from
    /// free space only, within its limit when `limit_applies`; evicts nothing.
    pub(super) fn alloc_free_only(
        &mut self,
        need_len: u64,
        t: TenantId,
        limit_applies: bool,
    ) -> Result<Extent, Status> {
        let limit = if limit_applies { self.tenants.get(t).limit } else { None };
        if limit.is_some_and(|l| self.charged_bytes(t).saturating_add(need_len) > l) {
            return Err(Status::OutOfMemory);
        }
        self.alloc.alloc(need_len).ok_or(Status::OutOfMemory)
    }

    /// An extent of `need_len` bytes (a page multiple) for tenant `t`,
    /// evicting if needed (see the module docs, and `tenants.rs` for the
    /// tenant's limit, which applies when `limit_applies`). On an error the
    /// blocks evicted on the way are evicted still: the caller undoes them
    /// (`unit.rs`).
    pub(super) fn alloc_evicting(&mut self, need_len: u64, t: TenantId, limit_applies: bool) -> Result<Extent, Status> {
        if limit_applies {
            self.within_tenant_limit(t, need_len)?;
        }
        if let Some(e) = self.alloc.alloc(need_len) {
            return Ok(e);
        }
        // What eviction may take for `t`: the blocks of tenants without a
        // limit, and `t`'s own.
        let own = self.tenants.limited(t);
        let unlimited = self.evictable_bytes.saturating_sub(self.tenants.limited_evictable_bytes);
        let evictable = unlimited + if own { self.tenants.get(t).evictable_bytes } else { 0 };
        if self.alloc.free_bytes().saturating_add(evictable) < need_len {
            return Err(Status::OutOfMemory);
        }
        loop {
            let shared = self.lru.first_key_value().map(|(&k, &v)| (k, v));
            let mine = if own { self.tenants.get(t).list.first_key_value().map(|(&k, &v)| (k, v)) } else { None };
            let next = match (shared, mine) {
                (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
                (a, b) => a.or(b),
            };
            let Some((tick, index)) = next else {
                return Err(Status::OutOfMemory);
            };
            self.evict(index, tick)?;
            if let Some(e) = self.alloc.alloc(need_len) {
                return Ok(e);
            }
        }
    }

    /// Evicts block `index`, which is on its list under `tick`; noted in the
    /// open undo journal (`unit.rs`), so that a refusal can put it back.
    pub(super) fn evict(&mut self, index: u32, tick: u64) -> Result<(), Status> {
        let (extent_len, tenant) = match self.slots.get(index as usize) {
            Some(slot @ Slot { state: SlotState::Block { tensor, .. }, .. }) => {
                if self.journal.is_open() {
                    let children = self.links.range((index, 0)..=(index, u32::MAX)).map(|&(_, c)| c).collect();
                    let (generation, state) = (slot.generation, slot.state.clone());
                    let meta = self.metas.get(&index).cloned();
                    self.journal.note(Undo::Evicted { index, generation, state, children, meta });
                }
                (tensor.extent.len, tensor.tenant)
            }
            _ => return Err(Status::Internal),
        };
        self.unlink(index, Unlink::Evicted)?;
        if self.lru.get(&tick) == Some(&index) || self.tenants.get(tenant).list.get(&tick) == Some(&index) {
            // `unlink` must take it off the list; never loop forever.
            return Err(Status::Internal);
        }
        self.counters.evicted(extent_len);
        let f = &mut self.tenants.row(tenant).figures;
        f.evictions += 1;
        f.evicted_bytes += extent_len;
        Ok(())
    }

    /// Marks block `index` as just used (a fresh tick); if eviction may take
    /// it, it moves to the most-recent end of the list.
    pub(super) fn lru_touch(&mut self, index: u32) -> Result<(), Status> {
        self.tick = self.tick.max(COLD_TICKS).wrapping_add(1);
        let tick = self.tick;
        match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { last_use, linked: true, .. }) => *last_use = tick,
            _ => return Err(Status::Internal),
        }
        self.resync(index)
    }

    /// Puts block `index` where its state now says, after a change of
    /// `linked`, `pins` or `holding_children`: counted in `evictable_bytes`
    /// when linked and unpinned; on the eviction list of its tenant (its own
    /// with a limit, else the store's; under its `last_use`) when, besides,
    /// the policy is LRU or no child holds it.
    pub(super) fn resync(&mut self, index: u32) -> Result<(), Status> {
        let lru_policy = self.policy == EvictionPolicy::Lru;
        let Some(SlotState::Block { tensor, linked, pins, lru_tick, last_use, counted, holding_children, .. }) =
            self.slots.get_mut(index as usize).map(|slot| &mut slot.state)
        else {
            return Err(Status::Internal);
        };
        let (len, t) = (tensor.extent.len, tensor.tenant);
        let evictable = *linked && *pins == 0;
        let listed = evictable && (lru_policy || *holding_children == 0);
        let was_counted = std::mem::replace(counted, evictable);
        let old_tick = if listed { lru_tick.replace(*last_use) } else { lru_tick.take() };
        let new_tick = listed.then_some(*last_use);
        self.place(index, t, len, old_tick, new_tick, was_counted, evictable)
    }

    /// Takes block `index` off its eviction list and out of the evictable
    /// bytes (its state says it is on neither; `resync` puts it back).
    pub(super) fn unlist(&mut self, index: u32) -> Result<(), Status> {
        let Some(SlotState::Block { tensor, lru_tick, counted, .. }) =
            self.slots.get_mut(index as usize).map(|slot| &mut slot.state)
        else {
            return Err(Status::Internal);
        };
        let (len, t) = (tensor.extent.len, tensor.tenant);
        let old_tick = lru_tick.take();
        let was_counted = std::mem::take(counted);
        self.place(index, t, len, old_tick, None, was_counted, false)
    }

    /// Moves block `index` of tenant `t` (`len` extent bytes) on its
    /// eviction list from `old_tick` to `new_tick` and in or out of the
    /// evictable bytes.
    #[allow(clippy::too_many_arguments)] // one block's place, field by field
    fn place(
        &mut self,
        index: u32,
        t: TenantId,
        len: u64,
        old_tick: Option<u64>,
        new_tick: Option<u64>,
        was_counted: bool,
        evictable: bool,
    ) -> Result<(), Status> {
        let limited = self.tenants.limited(t);
        let list = if limited { &mut self.tenants.row(t).list } else { &mut self.lru };
        if let Some(old) = old_tick {
            if list.remove(&old) != Some(index) {
                return Err(Status::Internal);
            }
        }
        if let Some(tick) = new_tick {
            list.insert(tick, index);
        }
        if was_counted == evictable {
            return Ok(());
        }
        let tenants = &mut self.tenants;
        if evictable {
            self.evictable_bytes += len;
            tenants.row(t).evictable_bytes += len;
            if limited {
                tenants.limited_evictable_bytes += len;
            }
        } else {
            let sub = |x: &mut u64| -> Result<(), Status> {
                *x = x.checked_sub(len).ok_or(Status::Internal)?;
                Ok(())
            };
            sub(&mut self.evictable_bytes)?;
            sub(&mut tenants.row(t).evictable_bytes)?;
            if limited {
                sub(&mut tenants.limited_evictable_bytes)?;
            }
        }
        Ok(())
    }

    /// Links just-committed block `index` (no children yet) to the linked
    /// block of key `parent`; a parent that is not linked, or is the block
    /// itself, is counted and the block stays without one. A new block has no
    /// children, so no link can close a cycle. It holds its parent if it is
    /// of the parent's tenant (it is unpinned, so not lent).
    pub(super) fn link_parent(&mut self, index: u32, parent: u128) -> Result<(), Status> {
        let p = match self.keys.get(&parent) {
            Some(&p) if p != index => p,
            _ => {
                self.counters.parent_missing();
                return Ok(());
            }
        };
        let tenant = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { parent: own, children: 0, linked: true, tensor, .. }) if own.is_none() => {
                *own = Some(p);
                tensor.tenant
            }
            _ => return Err(Status::Internal),
        };
        match self.slots.get_mut(p as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { children, holding_children, linked: true, tensor, .. }) => {
                *children += 1;
                if tensor.tenant == tenant {
                    *holding_children += 1;
                }
            }
            _ => return Err(Status::Internal),
        }
        self.links.insert((p, index));
        self.resync(p)
    }

    /// Whether linked block `child` holds its parent `parent` off the
    /// eviction list (under the chain policy): of the parent's tenant, and
    /// not lent.
    pub(super) fn holds(&self, parent: u32, child: u32) -> Result<bool, Status> {
        let tenant_of = |i: u32| match self.slots.get(i as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { tensor, pins, foreign_pins, .. }) => {
                Ok((tensor.tenant, is_lent(*pins, *foreign_pins)))
            }
            _ => Err(Status::Internal),
        };
        let ((pt, _), (ct, lent)) = (tenant_of(parent)?, tenant_of(child)?);
        Ok(pt == ct && !lent)
    }

    /// Cuts the chain links of block `index`, which is being unlinked: its
    /// children become blocks without a parent (counted), and its parent
    /// loses a child (and may become a leaf).
    pub(super) fn cut_links(&mut self, index: u32, why: Unlink) -> Result<(), Status> {
        let kids: Vec<u32> = self.links.range((index, 0)..=(index, u32::MAX)).map(|&(_, c)| c).collect();
        for c in kids {
            let held = self.holds(index, c)?;
            self.links.remove(&(index, c));
            match self.slots.get_mut(c as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { parent, .. }) if *parent == Some(index) => *parent = None,
                _ => return Err(Status::Internal),
            }
            self.counters.link_cut(why == Unlink::Evicted, held);
            self.orphan_subtree(c)?;
        }
        let parent = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { parent, children, holding_children, .. }) => {
                *children = 0;
                *holding_children = 0;
                *parent
            }
            _ => return Err(Status::Internal),
        };
        if let Some(p) = parent {
            let held = self.holds(p, index)?;
            if !self.links.remove(&(p, index)) {
                return Err(Status::Internal);
            }
            match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { parent, .. }) => *parent = None,
                _ => return Err(Status::Internal),
            }
            match self.slots.get_mut(p as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { children, holding_children, .. }) => {
                    *children = children.checked_sub(1).ok_or(Status::Internal)?;
                    if held {
                        *holding_children = holding_children.checked_sub(1).ok_or(Status::Internal)?;
                    }
                }
                _ => return Err(Status::Internal),
            }
            self.resync(p)?;
        }
        Ok(())
    }

    /// Block `index`, whose link to its parent was cut, and every rooted
    /// block below it are rooted no more (their bytes move from reachable to
    /// orphaned). A block that is not rooted has no rooted descendant, so
    /// the walk stops there: each block is orphaned at most once in its life
    /// (unless a refused unit puts it back: `unit.rs`).
    fn orphan_subtree(&mut self, index: u32) -> Result<(), Status> {
        let mut stack = vec![index];
        while let Some(i) = stack.pop() {
            let (tenant, len) = match self.slots.get_mut(i as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { rooted, tensor, .. }) if *rooted => {
                    *rooted = false;
                    (tensor.tenant, tensor.extent.len)
                }
                Some(SlotState::Block { .. }) => continue,
                _ => return Err(Status::Internal),
            };
            self.journal.note(Undo::Orphaned { index: i });
            self.resident(tenant, len, true, false)?;
            self.resident(tenant, len, false, true)?;
            stack.extend(self.links.range((i, 0)..=(i, u32::MAX)).map(|&(_, c)| c));
        }
        Ok(())
    }

    /// Sets the eviction policy and rebuilds the eviction list for it (the
    /// list already is the policy's when it does not change).
    pub fn set_eviction_policy(&mut self, policy: EvictionPolicy) {
        if policy == self.policy {
            return;
        }
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
