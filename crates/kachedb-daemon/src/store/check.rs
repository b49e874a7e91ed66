//! The store's structural invariants, checked in full ([`Store::check_invariants`]):
//! by the tests after every step, and by the daemon for each stats answer when
//! started with `--check-invariants` ([`Store::check_counters`] otherwise).

use super::slots::{is_lent, SlotState};
use super::{EvictionPolicy, Store};
use crate::alloc::{round_up_to_pages, Extent, PAGE_LEN};
use std::collections::BTreeMap;

impl Store {
    /// The tenant figures the tables give (`tenants.rs`): each row's bytes,
    /// linked blocks, reachable and orphaned bytes, evictable bytes,
    /// clients, lent bytes (its blocks pinned only by other tenants' clients)
    /// and borrowed bytes (other tenants' blocks its clients pin, once per
    /// pin record); each pin record is foreign exactly when its session is a
    /// client of another tenant than the block's; the rows add up to the
    /// totals; `rooted` as recomputed from
    /// the chain links (a linked block is rooted when it names no parent and
    /// was committed naming none, or its parent is rooted: checked as "a
    /// rooted block's parent is rooted, and a block rooted without a parent
    /// never lost one").
    fn check_tenants(&self) -> Result<(), String> {
        let n = self.tenants.rows.len();
        let (mut bytes, mut blocks, mut reach, mut orph, mut evict) =
            (vec![0u64; n], vec![0u64; n], vec![0u64; n], vec![0u64; n], vec![0u64; n]);
        for slot in &self.slots {
            let (t, len) = match &slot.state {
                SlotState::Free => continue,
                SlotState::Reserved { tensor, .. } => (tensor.tenant as usize, tensor.extent.len),
                SlotState::Block { tensor, linked, pins, parent, rooted, .. } => {
                    let t = tensor.tenant as usize;
                    if t >= n || self.tenants.rows[t].name.is_empty() {
                        return Err(format!("block of tenant row {t}, which is not in use"));
                    }
                    if *linked {
                        blocks[t] += 1;
                        if *rooted {
                            reach[t] += tensor.extent.len;
                        } else {
                            orph[t] += tensor.extent.len;
                        }
                        if *pins == 0 {
                            evict[t] += tensor.extent.len;
                        }
                    } else if *rooted {
                        return Err("an unlinked block is rooted".into());
                    }
                    if let (true, Some(p)) = (*rooted, parent) {
                        let parent_rooted = matches!(
                            self.slots.get(*p as usize).map(|s| &s.state),
                            Some(SlotState::Block { rooted: true, .. })
                        );
                        if !parent_rooted {
                            return Err(format!("a rooted block's parent {p} is not rooted"));
                        }
                    }
                    (t, tensor.extent.len)
                }
            };
            if t >= n {
                return Err(format!("reservation of tenant row {t}, which does not exist"));
            }
            bytes[t] += len;
        }
        let mut clients = vec![0u64; n];
        for s in self.sessions.values().filter(|s| !s.internal) {
            clients[(s.tenant as usize) % n] += 1;
        }
        // Lent: blocks pinned only by other tenants' clients. Borrowed: each
        // foreign pin record's block, for the pinning session's tenant.
        let mut lent = vec![0u64; n];
        let mut borrowed = vec![0u64; n];
        for slot in &self.slots {
            if let SlotState::Block { tensor, pins, foreign_pins, .. } = &slot.state {
                if is_lent(*pins, *foreign_pins) {
                    lent[(tensor.tenant as usize) % n] += tensor.extent.len;
                }
            }
        }
        for pin in self.pin_slots.iter().filter_map(|ps| ps.pin) {
            let session =
                self.sessions.get(&pin.session).ok_or_else(|| format!("pin of a closed session {:?}", pin.session))?;
            let block = match self.slots.get(pin.block_index as usize).map(|slot| &slot.state) {
                Some(SlotState::Block { tensor, .. }) => tensor,
                _ => return Err(format!("pin of slot {}, not a block", pin.block_index)),
            };
            let foreign = !session.internal && session.tenant != block.tenant;
            if pin.foreign != foreign {
                return Err(format!(
                    "a pin of block {} by {:?} says foreign {}, the tenants say {foreign}",
                    pin.block_index, pin.session, pin.foreign
                ));
            }
            if foreign {
                borrowed[(session.tenant as usize) % n] += block.extent.len;
            }
        }
        let mut limited_evictable = 0;
        for (t, r) in self.tenants.rows.iter().enumerate() {
            let f = &r.figures;
            let have = (f.bytes, f.blocks, f.reachable_bytes, f.orphaned_bytes, r.evictable_bytes, r.sessions);
            let want = (bytes[t], blocks[t], reach[t], orph[t], evict[t], clients[t]);
            if have != want {
                return Err(format!(
                    "tenant row {t} ({:?}) counts (bytes, blocks, reachable, orphaned, evictable, clients) {have:?}, the tables hold {want:?}",
                    r.name
                ));
            }
            if (r.lent_bytes, r.borrowed_bytes) != (lent[t], borrowed[t]) {
                return Err(format!(
                    "tenant row {t} ({:?}) counts (lent, borrowed) bytes ({}, {}), the tables hold ({}, {})",
                    r.name, r.lent_bytes, r.borrowed_bytes, lent[t], borrowed[t]
                ));
            }
            if r.limit.is_none() && !r.list.is_empty() {
                return Err(format!("tenant row {t} has no limit but an eviction list of its own"));
            }
            if r.limit.is_some() {
                limited_evictable += r.evictable_bytes;
            }
        }
        if limited_evictable != self.tenants.limited_evictable_bytes {
            return Err("limited_evictable_bytes is not the limited tenants' evictable bytes".into());
        }
        if (reach.iter().sum::<u64>(), orph.iter().sum::<u64>()) != (self.reachable_bytes, self.orphaned_bytes) {
            return Err("reachable or orphaned bytes are not the sum of the tenants'".into());
        }
        Ok(())
    }

    /// Checks every structural invariant; `Err` names the first one broken.
    ///
    /// The allocator's own invariants; every allocated extent belongs to
    /// exactly one live reservation or block and vice versa; each tensor lies
    /// in its extent; `keys` and linked blocks agree; `evictable_bytes` is
    /// the bytes of the linked unpinned blocks, and the eviction list holds
    /// exactly those of them the policy lets eviction take (under `Chain`:
    /// those no child holds), each under its last use; chain links join
    /// linked blocks only, agree with the parent, child and holding-child
    /// counts of both ends and form no cycle, so a linked block's ancestors
    /// are linked; under `Chain` eviction cut no link whose child held its
    /// parent; unlinked blocks are pinned; pin counts (and those of other
    /// tenants' clients) agree between blocks, pin records and sessions;
    /// reservations agree with their sessions; free-slot lists hold exactly
    /// the free slots; no undo journal is open; the `O(1)`
    /// [`gauges`](Store::gauges) count the pins and reservations the tables
    /// hold. `O(n log n)`.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.alloc.check_invariants()?;
        if self.journal.is_open() || !self.journal.is_empty() {
            return Err("an undo journal is open between requests".into());
        }

        // Tables by slot index rather than maps: one pass each, no lookups
        // in a tree (the check runs on every takeover, over every block).
        let n = self.slots.len();
        let mut free_slots = vec![false; n];
        for &i in &self.free_slots {
            let seen = free_slots.get_mut(i as usize).ok_or("free list names a slot that does not exist")?;
            if std::mem::replace(seen, true) {
                return Err("a slot is twice on the free list".into());
            }
        }
        for &i in self.metas.keys() {
            if !matches!(
                self.slots.get(i as usize).map(|slot| &slot.state),
                Some(SlotState::Reserved { .. } | SlotState::Block { .. })
            ) {
                return Err(format!("slot {i} keeps a block metadata record but holds no reservation or block"));
            }
        }
        // Children and holding children of each slot, from the links.
        let mut links_out = vec![0u32; n];
        let mut holding_out = vec![0u32; n];
        for &(p, c) in &self.links {
            let out = links_out.get_mut(p as usize).ok_or_else(|| format!("link ({p}, {c}) names no block"))?;
            *out += 1;
            if self.holds(p, c).map_err(|_| format!("link ({p}, {c}) names no block"))? {
                holding_out[p as usize] += 1;
            }
        }
        let mut parents_named = 0usize;
        let mut extents: Vec<(u64, u64)> = Vec::with_capacity(n);
        let mut linked_count = 0usize;
        let mut lru_count = 0usize;
        let mut evictable = 0u64;
        // Pins each block counts (`None`: not a block), all and foreign.
        let mut block_pins: Vec<Option<(u64, u64)>> = vec![None; n];
        for (i, slot) in self.slots.iter().enumerate() {
            let index = u32::try_from(i).map_err(|_| "slot index past u32".to_string())?;
            let on_free_list = free_slots[i];
            let tensor = match &slot.state {
                SlotState::Free => {
                    if !on_free_list {
                        return Err(format!("free slot {index} is not on the free list"));
                    }
                    continue;
                }
                SlotState::Reserved { owner, tensor } => {
                    let listed = self.sessions.get(owner).is_some_and(|s| s.reservations.contains(&index));
                    if !listed {
                        return Err(format!("reservation {index} is not listed by its session {owner:?}"));
                    }
                    tensor
                }
                SlotState::Block {
                    tensor,
                    linked,
                    pins,
                    foreign_pins,
                    lru_tick,
                    last_use,
                    counted,
                    parent,
                    children,
                    holding_children,
                    ..
                } => {
                    if *linked {
                        // That it is the block of its key: from `keys`' side, below.
                        linked_count += 1;
                    } else if *pins == 0 {
                        return Err(format!("unlinked block {index} is unpinned but not freed"));
                    } else if parent.is_some() || *children != 0 {
                        return Err(format!("unlinked block {index} keeps chain links"));
                    }
                    let evictable_now = *linked && *pins == 0;
                    if *counted != evictable_now {
                        return Err(format!("block {index}: counted evictable {counted}, should be {evictable_now}"));
                    }
                    if evictable_now {
                        evictable += tensor.extent.len;
                    }
                    let listed = evictable_now && (self.policy == EvictionPolicy::Lru || *holding_children == 0);
                    match (listed, lru_tick) {
                        (true, Some(tick)) => {
                            let list = if self.tenants.limited(tensor.tenant) {
                                &self.tenants.get(tensor.tenant).list
                            } else {
                                &self.lru
                            };
                            if list.get(tick) != Some(&index) || tick != last_use {
                                return Err(format!("block {index} has list tick {tick} but is not there"));
                            }
                            lru_count += 1;
                        }
                        (false, None) => {}
                        (should, _) => {
                            return Err(format!(
                                "block {index}: on the eviction list {}, should be {should}",
                                lru_tick.is_some()
                            ));
                        }
                    }
                    if let Some(p) = parent {
                        // Each link names its child's parent (`check_chains`),
                        // so as many parents as links means one link each.
                        parents_named += 1;
                        let parent_linked = matches!(
                            self.slots.get(*p as usize).map(|slot| &slot.state),
                            Some(SlotState::Block { linked: true, .. })
                        );
                        if !parent_linked {
                            return Err(format!("block {index}: parent {p} is not a linked block"));
                        }
                    }
                    if links_out[i] != *children {
                        return Err(format!(
                            "block {index} counts {children} children, {} links name it",
                            links_out[i]
                        ));
                    }
                    let holding = holding_out[i];
                    if holding != *holding_children {
                        return Err(format!(
                            "block {index} counts {holding_children} holding children, {holding} of its children hold it"
                        ));
                    }
                    block_pins[i] = Some((*pins, *foreign_pins));
                    tensor
                }
            };
            if on_free_list {
                return Err(format!("live slot {index} is on the free list"));
            }
            let t = tensor;
            let in_page = t.data_offset.checked_sub(t.extent.offset).filter(|&d| d < PAGE_LEN);
            let Some(page_offset) = in_page else {
                return Err(format!(
                    "slot {index}: data offset {} outside the first page of its extent",
                    t.data_offset
                ));
            };
            if t.shape.check_len(t.dtype, t.len).is_err() {
                return Err(format!("slot {index}: len {} does not match its shape", t.len));
            }
            let need = t.len.checked_add(page_offset).and_then(round_up_to_pages);
            if need != Some(t.extent.len) {
                return Err(format!(
                    "slot {index}: extent len {} for {} bytes at page offset {page_offset}",
                    t.extent.len, t.len
                ));
            }
            extents.push((t.extent.offset, t.extent.len));
        }
        if parents_named != self.links.len() {
            return Err(format!("{parents_named} blocks name a parent, {} chain links", self.links.len()));
        }
        extents.sort_unstable();
        if let Some(w) = extents.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(format!("extent at {} is held by two slots", w[0].0));
        }
        if !extents.iter().map(|&(o, l)| Extent { offset: o, len: l }).eq(self.alloc.allocated_extents()) {
            return Err("allocated extents differ from the extents of live slots".into());
        }
        if linked_count != self.keys.len() {
            return Err(format!("{} keys but {linked_count} linked blocks", self.keys.len()));
        }
        // Each key names a linked block of that key: distinct keys name
        // distinct blocks, and as many as there are, so every linked block
        // is the block of its key. (The map in its own order, one look at a
        // slot each, rather than a lookup in the map per block.)
        for (&key, &index) in &self.keys {
            let ok = matches!(
                self.slots.get(index as usize).map(|slot| &slot.state),
                Some(SlotState::Block { linked: true, tensor, .. }) if tensor.key == key
            );
            if !ok {
                return Err(format!("key {key:#x} names slot {index}, not a linked block of that key"));
            }
        }
        let lists_len = self.lru.len() + self.tenants.rows.iter().map(|r| r.list.len()).sum::<usize>();
        if lru_count != lists_len {
            return Err(format!("LRU list has {} entries, {lru_count} blocks are on it", self.lru.len()));
        }
        if evictable != self.evictable_bytes {
            return Err(format!(
                "evictable_bytes {} but linked unpinned blocks hold {evictable}",
                self.evictable_bytes
            ));
        }
        self.check_chains()?;
        self.check_tenants()?;

        // Pins: records agree with sessions and with block counts.
        let mut free_pins = vec![false; self.pin_slots.len()];
        for &i in &self.free_pin_slots {
            let seen = free_pins.get_mut(i as usize).ok_or("pin free list names a slot that does not exist")?;
            if std::mem::replace(seen, true) {
                return Err("a pin slot is twice on the free list".into());
            }
        }
        // Pins the records hold of each block slot, all and foreign.
        let mut pin_sums = vec![(0u64, 0u64); n];
        for (i, ps) in self.pin_slots.iter().enumerate() {
            let index = u32::try_from(i).map_err(|_| "pin index past u32".to_string())?;
            match ps.pin {
                None if free_pins[i] => {}
                None => return Err(format!("empty pin slot {index} is not on the free list")),
                Some(pin) => {
                    if free_pins[i] {
                        return Err(format!("live pin slot {index} is on the free list"));
                    }
                    if pin.count == 0 {
                        return Err(format!("pin slot {index} has count 0"));
                    }
                    let listed = self.sessions.get(&pin.session).and_then(|s| s.pins.get(&pin.block_index));
                    if listed != Some(&index) {
                        return Err(format!("pin slot {index} is not listed by its session"));
                    }
                    let sum = pin_sums
                        .get_mut(pin.block_index as usize)
                        .ok_or_else(|| format!("pin slot {index} names slot {}, not a block", pin.block_index))?;
                    sum.0 += pin.count;
                    if pin.foreign {
                        sum.1 += pin.count;
                    }
                }
            }
        }
        for (block, (&(sum, foreign_sum), &counted)) in pin_sums.iter().zip(&block_pins).enumerate() {
            match counted {
                None if sum > 0 => {
                    return Err(format!("block {block}: pin records sum to {sum}, but it is not a block"));
                }
                None => {}
                Some((pins, _)) if pins != sum => {
                    return Err(format!("block {block}: pin records sum to {sum}, block says {pins}"));
                }
                Some((_, foreign)) if foreign != foreign_sum => {
                    return Err(format!(
                        "block {block} counts {foreign} pins of other tenants' clients, the records hold {foreign_sum}"
                    ));
                }
                Some(_) => {}
            }
        }
        for (&id, session) in &self.sessions {
            for (&block, &pin_index) in &session.pins {
                let ok = self
                    .pin_slots
                    .get(pin_index as usize)
                    .and_then(|ps| ps.pin)
                    .is_some_and(|p| p.session == id && p.block_index == block);
                if !ok {
                    return Err(format!("session {id:?} lists pin {pin_index} of block {block} it does not hold"));
                }
            }
            for &index in &session.reservations {
                let ok = matches!(
                    self.slots.get(index as usize).map(|slot| &slot.state),
                    Some(SlotState::Reserved { owner, .. }) if *owner == id
                );
                if !ok {
                    return Err(format!("session {id:?} lists reservation {index} it does not own"));
                }
            }
            // What the per-client limit counts: reserved and pinned extents, each block once.
            let extent_len = |index: u32| match self.slots.get(index as usize).map(|slot| &slot.state) {
                Some(SlotState::Reserved { tensor, .. }) | Some(SlotState::Block { tensor, .. }) => tensor.extent.len,
                _ => 0,
            };
            let held: u64 = session.pins.keys().chain(&session.reservations).map(|&i| extent_len(i)).sum();
            if held != session.held_bytes {
                return Err(format!("session {id:?} holds {held} bytes but counts {}", session.held_bytes));
            }
        }
        // What the per-uid limit counts: the sum over the uid's sessions.
        let mut by_uid: BTreeMap<u32, u64> = BTreeMap::new();
        for session in self.sessions.values() {
            if let Some(uid) = session.uid.filter(|_| session.held_bytes > 0) {
                *by_uid.entry(uid).or_insert(0) += session.held_bytes;
            }
        }
        if by_uid != self.uid_held {
            return Err(format!("uids hold {by_uid:?} in their sessions but count {:?}", self.uid_held));
        }

        // The O(1) gauges and stats agree with what the tables hold.
        let g = self.gauges();
        let pins: u64 = pin_sums.iter().map(|&(all, _)| all).sum();
        let reserved = self.slots.iter().filter(|slot| matches!(slot.state, SlotState::Reserved { .. })).count() as u64;
        if (g.pins, g.reservations) != (pins, reserved) {
            return Err(format!(
                "gauges count {} pins and {} reservations, the tables hold {pins} and {reserved}",
                g.pins, g.reservations
            ));
        }
        let unlinked =
            self.slots.iter().filter(|slot| matches!(slot.state, SlotState::Block { linked: false, .. })).count()
                as u64;
        if unlinked != self.unlinked_blocks() {
            return Err(format!("{unlinked} unlinked blocks in the tables, {} counted", self.unlinked_blocks()));
        }
        Ok(())
    }

    /// Chain links: each names a child whose parent is its parent, and
    /// following parents from any block ends (no cycle), at a linked root.
    /// Each block is walked once (`depth` memoises), so `O(n)`.
    fn check_chains(&self) -> Result<(), String> {
        let parent_of = |i: u32| match self.slots.get(i as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { parent, .. }) => Ok(*parent),
            _ => Err(format!("chain link names slot {i}, not a block")),
        };
        for &(p, c) in &self.links {
            if parent_of(c)? != Some(p) {
                return Err(format!("link ({p}, {c}) but block {c} names another parent"));
            }
        }
        // Depth of each slot's chain, 0 while not walked.
        let mut depth = vec![0usize; self.slots.len()];
        let linked = self.keys.len();
        let mut path = Vec::new();
        // The linked blocks in slot order: walks that touch memory in order.
        let starts = self.slots.iter().enumerate().filter_map(|(i, slot)| match slot.state {
            SlotState::Block { linked: true, .. } => Some(i as u32),
            _ => None,
        });
        for start in starts {
            path.clear();
            let mut at = start;
            let base = loop {
                match depth.get(at as usize) {
                    Some(&d) if d > 0 => break d,
                    Some(_) => {}
                    None => return Err(format!("chain link names slot {at}, not a block")),
                }
                path.push(at);
                if path.len() > linked {
                    return Err(format!("the chain above block {start} is a cycle"));
                }
                match parent_of(at)? {
                    Some(p) => at = p,
                    None => break 0,
                }
            };
            for (i, &b) in path.iter().rev().enumerate() {
                depth[b as usize] = base + i + 1;
            }
        }
        let cut = (self.counters.links_cut_by_eviction(), self.counters.unheld_links_cut_by_eviction());
        if self.policy == EvictionPolicy::Chain && cut.0 != cut.1 {
            return Err(format!(
                "{} chain links cut by eviction under the chain policy, only {} of them links that did not hold their parent",
                cut.0, cut.1
            ));
        }
        Ok(())
    }

    /// The `O(1)` cross-checks a stats answer makes when the full check is
    /// off: the byte counts of `st` (from [`Store::stats`]) against each other
    /// and the slots in use against the blocks and reservations counted. The
    /// counters against the tables, which takes a walk of them, is part of
    /// [`check_invariants`](Store::check_invariants).
    pub fn check_counters(&self, st: &super::StoreStats) -> Result<(), String> {
        if st.bytes_used + st.bytes_free != st.bytes_total {
            return Err(format!("bytes used {} + free {} != total {}", st.bytes_used, st.bytes_free, st.bytes_total));
        }
        let in_use = (self.slots.len() - self.free_slots.len()) as u64;
        if in_use < st.blocks + st.reserved {
            return Err(format!("{in_use} slots in use for {} blocks and {} reservations", st.blocks, st.reserved));
        }
        if st.evictable_bytes > st.bytes_used {
            return Err(format!("evictable {} > used {}", st.evictable_bytes, st.bytes_used));
        }
        Ok(())
    }
}
