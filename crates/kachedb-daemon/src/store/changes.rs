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

/// One change of the index (the set of linked keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
            let Some(SlotState::Block { tensor, parent, .. }) = self.slots.get(index as usize).map(|s| &s.state)
            else {
                continue;
            };
            let parent = parent.and_then(|p| self.key_of(p));
            out.push(IndexChange::Stored { key: tensor.key, parent, replaced: false });
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
