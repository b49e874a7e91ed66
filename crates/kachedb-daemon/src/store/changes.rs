//! The index's changes, in the order the store applied them: a key got a
//! block (COMMIT, a tier's fill) or lost its block (DELETE, eviction, a
//! replacement), for the KV event publisher (`crate::kv_events`).
//!
//! Off by default, and then free (one branch per change). On, each change
//! is appended to a vector the serve loop drains after each pass
//! ([`Store::take_changes`]). A refused request changes nothing (`unit.rs`),
//! and neither does it leave a change here: closing the undo journal with an
//! undo truncates the log to its length at the journal's opening, so the
//! evictions a refused RESERVE made and the puts-back that undid them never
//! show.

use super::slots::SlotState;
use super::Store;
use kachedb_shm::BlockMeta;
use std::sync::Arc;

/// One change of the index (the set of linked keys).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexChange {
    /// `key` has a (new) linked block; `parent` is the key of the block it
    /// is linked under in its chain, if any; `replaced`: the key had a
    /// block before, which this one replaced.
    Stored {
        /// The block's key.
        key: u128,
        /// The key of its chain parent, if linked to one.
        parent: Option<u128>,
        /// Whether an older block of the key was replaced.
        replaced: bool,
        /// What its writer told of it (META), if anything.
        meta: Option<Arc<BlockMeta>>,
    },
    /// `key` has no block any more (DELETE or eviction).
    Removed {
        /// The key.
        key: u128,
    },
}

/// The log: off, or the changes since the last drain.
#[derive(Clone, Debug, Default)]
pub(super) struct ChangeLog {
    on: bool,
    entries: Vec<IndexChange>,
    /// The log's length when the undo journal opened.
    mark: usize,
}

impl ChangeLog {
    /// Whether changes are logged.
    #[inline]
    pub(super) fn is_on(&self) -> bool {
        self.on
    }

    #[inline]
    pub(super) fn push(&mut self, change: IndexChange) {
        if self.on {
            self.entries.push(change);
        }
    }

    /// The journal opened: a refusal forgets what comes after this.
    pub(super) fn mark(&mut self) {
        self.mark = self.entries.len();
    }

    /// The journal's changes were undone.
    pub(super) fn forget_since_mark(&mut self) {
        self.entries.truncate(self.mark);
    }
}

impl Store {
    /// Starts (or stops) logging the index's changes for
    /// [`take_changes`](Self::take_changes).
    pub fn log_changes(&mut self, on: bool) {
        self.changes.on = on;
        self.changes.entries.clear();
    }

    /// Moves the changes logged since the last call into `out`, oldest first.
    pub fn take_changes(&mut self, out: &mut Vec<IndexChange>) {
        out.append(&mut self.changes.entries);
    }

    /// Every linked block as a [`IndexChange::Stored`], parents before
    /// their children (a snapshot of the index; `O(n log n)`).
    pub fn index_snapshot(&self) -> Vec<IndexChange> {
        let mut out = Vec::with_capacity(self.keys.len());
        let mut roots: Vec<u32> = Vec::new();
        for &index in self.keys.values() {
            if let Some(SlotState::Block { parent: None, .. }) = self.slots.get(index as usize).map(|s| &s.state) {
                roots.push(index);
            }
        }
        roots.sort_unstable();
        // Links form a forest (a block gets a parent only while childless):
        // walk it from the roots, parents first.
        let mut stack = roots;
        while let Some(index) = stack.pop() {
            let Some(SlotState::Block { tensor, parent, .. }) = self.slots.get(index as usize).map(|s| &s.state) else {
                continue;
            };
            let parent = parent.and_then(|p| self.key_of(p));
            let meta = self.metas.get(&index).cloned();
            out.push(IndexChange::Stored { key: tensor.key, parent, replaced: false, meta });
            stack.extend(self.links.range((index, 0)..=(index, u32::MAX)).map(|&(_, c)| c));
        }
        out
    }

    /// The key of linked block `index`.
    pub(super) fn key_of(&self, index: u32) -> Option<u128> {
        match self.slots.get(index as usize).map(|s| &s.state) {
            Some(SlotState::Block { tensor, linked: true, .. }) => Some(tensor.key),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{reserve_req, SLAB_OFFSET};
    use super::*;
    use crate::alloc::PAGE_LEN;
    use kachedb_shm::{Request, Status};
    use std::collections::BTreeSet;

    /// The index a subscriber keeps: the log applied in order.
    fn apply(index: &mut BTreeSet<u128>, log: &[IndexChange]) {
        for c in log {
            match *c {
                IndexChange::Stored { key, .. } => {
                    index.insert(key);
                }
                IndexChange::Removed { key } => {
                    index.remove(&key);
                }
            }
        }
    }

    fn held(st: &Store, keys: u128) -> BTreeSet<u128> {
        (0..keys).filter(|&k| st.peek(k).is_some()).collect()
    }

    /// Thousands of random puts (in chains, replacing), deletes, pins,
    /// releases and two-RESERVE units on a store of 12 pages, so that
    /// evictions, refusals undone and units refused whole all happen: after
    /// every request the log applied equals the store's keys, and a snapshot
    /// equals them too, parents before their children.
    #[test]
    fn the_log_applied_in_order_is_the_index_after_every_request() {
        let mut st = Store::new(SLAB_OFFSET, 12 * PAGE_LEN);
        st.log_changes(true);
        let s = st.open_session();
        let (mut index, mut log, mut pins) = (BTreeSet::new(), Vec::new(), Vec::new());
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut refused, mut removed) = (0, 0);
        for _ in 0..20_000 {
            let key = rand(40) as u128;
            match rand(10) {
                0..=4 => {
                    let pages = 1 + rand(3);
                    let r = st.handle(s, 1, &reserve_req(key, pages * PAGE_LEN - 100, 0));
                    if r.status == Status::Ok {
                        let parent = (rand(2) == 0).then(|| rand(40) as u128);
                        assert_eq!(st.handle(s, 2, &Request::Commit { handle: r.handle, parent }).status, Status::Ok);
                    } else {
                        refused += 1;
                    }
                }
                5 => {
                    let unit = [(1, reserve_req(key, 4 * PAGE_LEN, 0)), (2, reserve_req(key + 1, 5 * PAGE_LEN, 0))];
                    let mut out = Vec::new();
                    st.handle_unit(s, &unit, &mut out);
                    if out.iter().any(|c| c.status != Status::Ok) {
                        refused += 1;
                    }
                    for c in out.iter().filter(|c| c.status == Status::Ok) {
                        st.handle(s, 3, &Request::Abort { handle: c.handle });
                    }
                }
                6 => {
                    st.handle(s, 1, &Request::Delete { key });
                }
                7 if pins.len() < 3 => {
                    let r = st.handle(s, 1, &Request::Get { key });
                    if r.status == Status::Ok {
                        pins.push(r.handle);
                    }
                }
                _ => {
                    if let Some(handle) = pins.pop() {
                        st.handle(s, 1, &Request::Release { handle });
                    }
                }
            }
            let before = log.len();
            st.take_changes(&mut log);
            removed += log[before..].iter().filter(|c| matches!(c, IndexChange::Removed { .. })).count();
            apply(&mut index, &log[before..]);
            assert_eq!(index, held(&st, 41), "after {} changes", log.len());
        }
        assert!(refused > 0 && removed > 0, "refusals {refused}, removals {removed}");
        let snap = st.index_snapshot();
        let mut seen = BTreeSet::new();
        for c in &snap {
            let IndexChange::Stored { key, parent, .. } = *c else { panic!("{c:?}") };
            if let Some(p) = parent {
                assert!(seen.contains(&p), "parent {p} of {key} comes first");
            }
            seen.insert(key);
        }
        assert_eq!(seen, index);
    }

    #[test]
    fn off_it_logs_nothing() {
        let mut st = Store::new(SLAB_OFFSET, 4 * PAGE_LEN);
        let s = st.open_session();
        let r = st.handle(s, 1, &reserve_req(1, 100, 0));
        st.handle(s, 2, &Request::Commit { handle: r.handle, parent: None });
        let mut log = Vec::new();
        st.take_changes(&mut log);
        assert!(log.is_empty());
    }
}
