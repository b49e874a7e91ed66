//! All or nothing: a request that is refused changes nothing, and a
//! **reservation unit** (a batch of RESERVEs a client marked as one,
//! `kachedb_shm::RESERVE_CONTINUES`) is admitted whole or not at all.
//!
//! A RESERVE may evict blocks before it finds it cannot be served (the
//! eviction list ran empty first: fragmentation, or under the chain policy
//! unpinned ancestors of pinned blocks), and a unit's later RESERVE may be
//! refused after its earlier ones reserved and evicted. So while a request
//! or unit is being served the store keeps an **undo journal**: every
//! reservation made and every block evicted (with everything eviction
//! changed: the block's slot and state, the links it cut, the blocks that
//! stopped being rooted). A refusal undoes the journal in reverse: the
//! reservations are freed and every evicted block comes back exactly as it
//! was — same slot and generation, same extent (`ExtentAllocator::alloc_at`),
//! same key, links to its parent and children, place on its eviction list,
//! rooted state, tenant figures and counters — so the tables are as if the
//! request had never come, but for the counts of requests and answers
//! (and of limit refusals). A request that is served drops the journal.
//!
//! Putting an evicted block back is sound because its bytes are untouched:
//! an extent freed by eviction is written only by the client of a new
//! reservation, which learns of the extent from the answer, and a refused
//! request or unit is answered only after it is undone.
//!
//! Cost: the journal holds one entry per reservation, evicted block and
//! block orphaned, so undoing costs what doing did, `O(log n)` each (plus
//! the children of an evicted parent under the LRU policy).

use super::slots::{Slot, SlotState};
use super::{SessionId, Store};
use kachedb_shm::BlockMeta;
use kachedb_shm::{Completion, Op, Request, Status};
use std::sync::Arc;

/// One change a request made, as the journal records it to undo it.
#[derive(Clone, Debug)]
pub(super) enum Undo {
    /// A RESERVE of `session` took slot `index` (`fresh`: appended to the
    /// slot table; else popped from the free list), whose generation was
    /// `generation`.
    Reserved { session: SessionId, index: u32, fresh: bool, generation: u32 },
    /// Block `index` was evicted: its slot's generation and state before,
    /// and the children whose links its eviction cut, in that order.
    Evicted { index: u32, generation: u32, state: SlotState, children: Vec<u32>, meta: Option<Arc<BlockMeta>> },
    /// Block `index` stopped being rooted (a link above it was cut).
    Orphaned { index: u32 },
}

/// The undo journal: open while a request or unit is served, closed and
/// empty between them. Its vector keeps its capacity from one request to
/// the next, so a RESERVE that journals allocates nothing in the steady state.
#[derive(Clone, Debug, Default)]
pub(super) struct Journal {
    open: bool,
    entries: Vec<Undo>,
}

impl Journal {
    /// Records `change` if the journal is open.
    #[inline]
    pub(super) fn note(&mut self, change: Undo) {
        if self.open {
            self.entries.push(change);
        }
    }

    pub(super) fn is_open(&self) -> bool {
        self.open
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl Store {
    /// Opens the journal if it is closed; whether this call opened it.
    fn open_journal(&mut self) -> bool {
        if self.journal.open {
            return false;
        }
        self.journal.open = true;
        self.journal.entries.clear();
        self.changes.mark();
        true
    }

    /// Closes the journal, undoing what it recorded first if `undo`.
    fn close_journal(&mut self, undo: bool) {
        self.journal.open = false;
        let mut entries = std::mem::take(&mut self.journal.entries);
        if undo {
            self.undo(&mut entries);
            self.changes.forget_since_mark();
        }
        entries.clear();
        self.journal.entries = entries;
    }

    /// Runs `f` (a RESERVE or GET) so that if it fails, nothing it did
    /// remains: with the journal opened for it, unless it is open already
    /// (a unit's, whose refusal undoes everything).
    pub(super) fn atomically<T>(&mut self, f: impl FnOnce(&mut Store) -> Result<T, Status>) -> Result<T, Status> {
        let own = self.open_journal();
        let r = f(self);
        if own {
            self.close_journal(r.is_err());
        }
        r
    }

    /// Answers a reservation unit of session `s`: `unit` is its RESERVEs with
    /// their request ids, in order. Either every one is served, or (one is
    /// refused) none is: every RESERVE of the unit is answered with the first
    /// refusal (its status and, for OUT_OF_MEMORY, its cause fields), the
    /// reservations made for the unit are freed and the blocks evicted for it
    /// put back. The completions are appended to `out`, one per request. A
    /// unit holding another op than RESERVE is refused whole as `INVALID`
    /// (the serve loop forms units of RESERVEs only). Never panics.
    pub fn handle_unit(&mut self, s: SessionId, unit: &[(u32, Request)], out: &mut Vec<Completion>) {
        let start = out.len();
        let answer_all = |out: &mut Vec<Completion>, status: Status, handle: u64, offset: u64| {
            out.truncate(start);
            out.extend(unit.iter().map(|&(request_id, _)| Completion {
                request_id,
                op: Op::Reserve,
                status,
                handle,
                offset,
                tensor: None,
            }));
        };
        if unit.iter().any(|(_, r)| !matches!(r, Request::Reserve { .. })) {
            self.counters.answered_unserved(Op::Reserve, Status::Invalid, unit.len() as u64);
            answer_all(out, Status::Invalid, 0, 0);
            return;
        }
        if !self.open_journal() {
            // Units do not nest (the serve loop serves one at a time).
            self.counters.answered_unserved(Op::Reserve, Status::Internal, unit.len() as u64);
            answer_all(out, Status::Internal, 0, 0);
            return;
        }
        let mut refusal = None;
        for &(request_id, ref req) in unit {
            let c = self.handle(s, request_id, req);
            if c.status != Status::Ok {
                refusal = Some(c);
                break;
            }
            out.push(c);
        }
        self.close_journal(refusal.is_some());
        let Some(refusal) = refusal else { return };
        let served = (out.len() - start) as u64;
        self.counters.reanswered(Op::Reserve, refusal.status, served);
        self.counters.answered_unserved(Op::Reserve, refusal.status, unit.len() as u64 - served - 1);
        answer_all(out, refusal.status, refusal.handle, refusal.offset);
    }

    /// Undoes the changes in `journal` (emptying it), last change first. A
    /// step that finds the tables not as the journal left them is counted as
    /// an internal error and skipped.
    fn undo(&mut self, journal: &mut Vec<Undo>) {
        while let Some(entry) = journal.pop() {
            let r = match entry {
                Undo::Reserved { session, index, fresh, generation } => {
                    self.unreserve(session, index, fresh, generation)
                }
                Undo::Evicted { index, generation, state, children, meta } => {
                    let r = self.unevict(index, generation, state, &children);
                    if let (Ok(()), Some(meta)) = (&r, meta) {
                        self.metas.insert(index, meta);
                    }
                    r
                }
                Undo::Orphaned { index } => self.unorphan(index),
            };
            if r.is_err() {
                self.counters.internal_error();
            }
        }
    }

    /// Frees reservation `index` of `session` and gives its slot back as it was.
    fn unreserve(&mut self, session: SessionId, index: u32, fresh: bool, generation: u32) -> Result<(), Status> {
        let len = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Reserved { tensor, owner }) if *owner == session => tensor.extent.len,
            _ => return Err(Status::Internal),
        };
        if let Some(x) = self.sessions.get_mut(&session) {
            x.reservations.remove(&index);
        }
        self.hold(session, len, false);
        self.free_reservation(index)?;
        self.slots.get_mut(index as usize).ok_or(Status::Internal)?.generation = generation;
        if fresh {
            // Appended by the RESERVE: the last slot, now on top of the free list.
            if self.free_slots.last() != Some(&index) || self.slots.len() != index as usize + 1 {
                return Err(Status::Internal);
            }
            self.free_slots.pop();
            self.slots.pop();
        }
        Ok(())
    }

    /// Puts evicted block `index` back: `state` (as it was when evicted) in
    /// its slot, of `generation`, its extent, key, links to its parent and to
    /// `children`, its place on its list, its tenant's figures and the
    /// counters eviction moved.
    fn unevict(&mut self, index: u32, generation: u32, state: SlotState, children: &[u32]) -> Result<(), Status> {
        let SlotState::Block { tensor, parent, rooted, .. } = state else { return Err(Status::Internal) };
        // Freed by the eviction and taken by nothing since (that is undone):
        // on top of the free list.
        if self.free_slots.last() != Some(&index)
            || !matches!(self.slots.get(index as usize).map(|slot| &slot.state), Some(SlotState::Free))
        {
            return Err(Status::Internal);
        }
        if !self.alloc.alloc_at(tensor.extent) {
            return Err(Status::Internal);
        }
        self.free_slots.pop();
        let (t, len) = (tensor.tenant, tensor.extent.len);
        self.tenants.row(t).figures.bytes += len;
        let mut state = state;
        if let SlotState::Block { lru_tick, counted, .. } = &mut state {
            // `resync` below puts it on its list and in the evictable bytes.
            *lru_tick = None;
            *counted = false;
        }
        *self.slots.get_mut(index as usize).ok_or(Status::Internal)? = Slot { generation, state };
        self.keys.insert(tensor.key, index);
        self.resident(t, len, rooted, true)?;
        if let Some(p) = parent {
            self.links.insert((p, index));
            let held = self.holds(p, index)?;
            match self.slots.get_mut(p as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { children, holding_children, linked: true, .. }) => {
                    *children += 1;
                    if held {
                        *holding_children += 1;
                    }
                }
                _ => return Err(Status::Internal),
            }
            self.resync(p)?;
        }
        for &c in children {
            self.links.insert((index, c));
            match self.slots.get_mut(c as usize).map(|slot| &mut slot.state) {
                Some(SlotState::Block { parent, linked: true, .. }) if parent.is_none() => *parent = Some(index),
                _ => return Err(Status::Internal),
            }
            let held = self.holds(index, c)?;
            self.counters.link_uncut(true, held);
        }
        self.resync(index)?;
        self.counters.unevicted(len);
        let f = &mut self.tenants.row(t).figures;
        f.evictions = f.evictions.saturating_sub(1);
        f.evicted_bytes = f.evicted_bytes.saturating_sub(len);
        Ok(())
    }

    /// Block `index`, orphaned by a cut that is being undone, is rooted again.
    fn unorphan(&mut self, index: u32) -> Result<(), Status> {
        let (t, len) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { rooted, tensor, linked: true, .. }) if !*rooted => {
                *rooted = true;
                (tensor.tenant, tensor.extent.len)
            }
            _ => return Err(Status::Internal),
        };
        self.resident(t, len, false, false)?;
        self.resident(t, len, true, true)
    }
}
