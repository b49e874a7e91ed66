//! The next-block hints this node has read from the remote store
//! (`format`, "A block's next block"), kept in memory so that the serve
//! loop's [`Tier::chain_after`](crate::tier::Tier::chain_after) answers
//! without a network wait: a fill of a block reads its hint beside its
//! chunk 0 and records it here; read-ahead follows the chain recorded.
//!
//! Bounded: at most [`HINTS_MAX`] parents are remembered, the one learned
//! longest ago forgotten first. A hint only steers which blocks are read
//! next (they are verified like any other), and names the parent a filled
//! block is committed under, so that it links to its chain locally.

use std::collections::{HashMap, HashSet, VecDeque};

/// Most parents whose next block is remembered (about 100 bytes each).
pub const HINTS_MAX: usize = 1 << 16;

/// Parent → the child written last after it, and the reverse.
#[derive(Debug)]
pub(super) struct Hints {
    next: HashMap<u128, u128>,
    prev: HashMap<u128, u128>,
    /// Parents in the order they were learned (a parent learned again keeps
    /// its first place).
    order: VecDeque<u128>,
    max: usize,
}

impl Hints {
    /// Remembers at most `max` parents.
    pub(super) fn new(max: usize) -> Hints {
        Hints { next: HashMap::new(), prev: HashMap::new(), order: VecDeque::new(), max: max.max(1) }
    }

    /// Records that `child` is the block written last after `parent`.
    pub(super) fn learn(&mut self, parent: u128, child: u128) {
        if parent == child {
            return;
        }
        match self.next.insert(parent, child) {
            Some(old) if old != child => {
                if self.prev.get(&old) == Some(&parent) {
                    self.prev.remove(&old);
                }
            }
            Some(_) => {}
            None => {
                self.order.push_back(parent);
                while self.order.len() > self.max {
                    let Some(gone) = self.order.pop_front() else { break };
                    if let Some(c) = self.next.remove(&gone) {
                        if self.prev.get(&c) == Some(&gone) {
                            self.prev.remove(&c);
                        }
                    }
                }
            }
        }
        self.prev.insert(child, parent);
    }

    /// Up to `max` blocks after `key` along the hints, in order (never one
    /// twice, never `key`).
    pub(super) fn chain_after(&self, key: u128, max: usize) -> Vec<u128> {
        let mut out = Vec::new();
        let mut seen = HashSet::from([key]);
        let mut at = key;
        while out.len() < max {
            let Some(&c) = self.next.get(&at) else { break };
            if !seen.insert(c) {
                break;
            }
            out.push(c);
            at = c;
        }
        out
    }

    /// The parent a hint names for `key`, if one was read.
    pub(super) fn parent_of(&self, key: u128) -> Option<u128> {
        self.prev.get(&key).copied()
    }

    /// Parents remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.next.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_follows_the_child_learned_last_within_its_bound() {
        let mut h = Hints::new(16);
        h.learn(1, 2);
        h.learn(2, 3);
        h.learn(3, 4);
        assert_eq!(h.chain_after(1, 8), vec![2, 3, 4]);
        assert_eq!(h.chain_after(1, 2), vec![2, 3]);
        assert!(h.chain_after(4, 8).is_empty());
        assert_eq!(h.parent_of(3), Some(2));
        assert_eq!(h.parent_of(1), None);
        h.learn(2, 9);
        assert_eq!(h.chain_after(1, 8), vec![2, 9], "the child written last");
        assert_eq!(h.parent_of(3), None, "3 is no longer 2's child");
        assert_eq!(h.parent_of(9), Some(2));
    }

    #[test]
    fn a_cycle_ends_the_chain_and_the_oldest_parent_goes_first() {
        let mut h = Hints::new(3);
        h.learn(1, 2);
        h.learn(2, 1);
        assert_eq!(h.chain_after(1, 8), vec![2]);
        h.learn(5, 5);
        assert!(h.chain_after(5, 8).is_empty(), "a block is not its own child");
        h.learn(3, 4);
        h.learn(4, 6);
        assert_eq!(h.len(), 3);
        assert!(h.chain_after(1, 8).is_empty(), "parent 1 forgotten first");
        assert_eq!(h.parent_of(2), None);
        assert_eq!(h.chain_after(3, 8), vec![4, 6]);
    }
}
