//! The disk tier's index: which blocks are on disk, their chain links, the
//! bytes they take, and which to evict when a write needs room.
//!
//! Eviction takes leaves first, least recently used first, as the megaslab's
//! chain policy does (docs/eviction.md): a block that a block on disk names
//! as its parent is not on the eviction list until that child is gone, so a
//! chain on disk never has a hole in front of a block. Links here are the
//! parents the clients named at commit, whether or not the parent is on
//! disk; a block written while its parent is not on disk is a leaf and a
//! root at once. Should links ever form a cycle (two commits naming each
//! other), no block of it is a leaf; when no leaf is left, the least recently
//! used block of all goes.
//!
//! Room is planned before a write ([`Index::make_room`]): the bytes of writes
//! in flight are held as reserved, so concurrent writers never pass the
//! bound together. The parent of the block being written is never evicted
//! for it (it may be a leaf until its child lands).

use std::collections::{BTreeMap, HashMap};

/// File-system bytes a block file takes: its length rounded up to 4 KiB.
pub fn disk_bytes(file_len: u64) -> u64 {
    file_len.div_ceil(4096).saturating_mul(4096)
}

/// One block on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The parent its client named, if any.
    pub parent: Option<u128>,
    /// Bytes it takes ([`disk_bytes`]).
    pub bytes: u64,
    /// Its last use (written or filled); larger is more recent.
    tick: u64,
}

/// The index (see the module docs). Not thread-safe by itself: the tier
/// holds it in a mutex.
#[derive(Debug, Default)]
pub struct Index {
    entries: HashMap<u128, Entry>,
    /// How many entries name the key as their parent (keys on disk or not).
    children: HashMap<u128, u32>,
    /// Entries without children, by last use.
    leaves: BTreeMap<u64, u128>,
    /// Every entry, by last use (for the no-leaf case).
    all: BTreeMap<u64, u128>,
    tick: u64,
    /// Bytes of the entries.
    used: u64,
    /// Bytes of writes in flight (planned, not yet inserted).
    reserved: u64,
    /// The bound on `used + reserved`.
    capacity: u64,
}

impl Index {
    /// An empty index bounded by `capacity` bytes.
    pub fn new(capacity: u64) -> Index {
        Index { capacity, ..Index::default() }
    }

    /// Blocks on disk.
    pub fn blocks(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Bytes the blocks take.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The bound.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The entry of `key`.
    pub fn get(&self, key: u128) -> Option<Entry> {
        self.entries.get(&key).copied()
    }

    /// Whether `key` is on disk.
    pub fn contains(&self, key: u128) -> bool {
        self.entries.contains_key(&key)
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn is_leaf(&self, key: u128) -> bool {
        self.children.get(&key).copied().unwrap_or(0) == 0
    }

    /// Adds (or replaces) the block `key` taking `bytes`, naming `parent`,
    /// as just used.
    pub fn insert(&mut self, key: u128, parent: Option<u128>, bytes: u64) {
        self.remove(key);
        let parent = parent.filter(|&p| p != key);
        let tick = self.next_tick();
        if let Some(p) = parent {
            let n = self.children.entry(p).or_insert(0);
            *n += 1;
            if *n == 1 {
                if let Some(e) = self.entries.get(&p) {
                    self.leaves.remove(&e.tick);
                }
            }
        }
        self.entries.insert(key, Entry { parent, bytes, tick });
        self.all.insert(tick, key);
        if self.is_leaf(key) {
            self.leaves.insert(tick, key);
        }
        self.used += bytes;
    }

    /// Takes the block `key` out; its entry, if it was there.
    pub fn remove(&mut self, key: u128) -> Option<Entry> {
        let e = self.entries.remove(&key)?;
        self.all.remove(&e.tick);
        self.leaves.remove(&e.tick);
        self.used -= e.bytes;
        if let Some(p) = e.parent {
            if let Some(n) = self.children.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.children.remove(&p);
                    if let Some(pe) = self.entries.get(&p) {
                        self.leaves.insert(pe.tick, p);
                    }
                }
            }
        }
        Some(e)
    }

    /// Marks `key` as just used (a fill read it).
    pub fn touch(&mut self, key: u128) {
        let Some(e) = self.entries.get(&key).copied() else { return };
        let tick = self.next_tick();
        self.all.remove(&e.tick);
        self.all.insert(tick, key);
        if self.leaves.remove(&e.tick).is_some() {
            self.leaves.insert(tick, key);
        }
        if let Some(e) = self.entries.get_mut(&key) {
            e.tick = tick;
        }
    }

    /// Plans room for a write of `bytes` (of a block naming `protect` as
    /// its parent): takes the victims out of the index (the caller deletes
    /// their files) and holds `bytes` as reserved until
    /// [`unreserve`](Self::unreserve). `None` (nothing taken out) if even an
    /// empty disk could not hold it.
    pub fn make_room(&mut self, bytes: u64, protect: Option<u128>) -> Option<Vec<(u128, Entry)>> {
        if bytes > self.capacity.saturating_sub(self.reserved) {
            return None;
        }
        let mut victims = Vec::new();
        while self.used + self.reserved + bytes > self.capacity {
            let pick = |m: &BTreeMap<u64, u128>| m.values().copied().find(|&k| Some(k) != protect);
            let Some(key) = pick(&self.leaves).or_else(|| pick(&self.all)) else { break };
            if let Some(e) = self.remove(key) {
                victims.push((key, e));
            }
        }
        self.reserved += bytes;
        Some(victims)
    }

    /// Lets go of `bytes` reserved by [`make_room`](Self::make_room) (the
    /// write is over: inserted, or failed).
    pub fn unreserve(&mut self, bytes: u64) {
        self.reserved = self.reserved.saturating_sub(bytes);
    }

    /// Blocks to evict so that the blocks fit the bound again (after a
    /// start with a smaller `--disk-size` than the blocks found), taken out.
    pub fn shrink_to_fit(&mut self) -> Vec<(u128, Entry)> {
        let mut victims = Vec::new();
        while self.used + self.reserved > self.capacity {
            let key = self.leaves.values().next().or_else(|| self.all.values().next()).copied();
            let Some(key) = key else { break };
            if let Some(e) = self.remove(key) {
                victims.push((key, e));
            }
        }
        victims
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_takes_leaves_first_so_a_parent_outlives_its_child() {
        let mut ix = Index::new(4 * 4096);
        // A chain a <- b <- c, written oldest first, then a lone block d.
        ix.insert(1, None, 4096);
        ix.insert(2, Some(1), 4096);
        ix.insert(3, Some(2), 4096);
        ix.insert(4, None, 4096);
        // Room for one more: the least recently used leaf is c (3), not a.
        let v = ix.make_room(4096, None).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![3]);
        ix.unreserve(4096);
        // Then b, which became a leaf at its own last use, then a, then d.
        let v = ix.make_room(3 * 4096, None).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!(ix.contains(4));
        assert_eq!(ix.used() + 3 * 4096, ix.capacity());
    }

    #[test]
    fn the_parent_of_the_block_being_written_is_not_evicted_for_it() {
        let mut ix = Index::new(2 * 4096);
        ix.insert(1, None, 4096);
        ix.insert(2, None, 4096);
        // Block 3 names 1: 2 goes although 1 is older.
        let v = ix.make_room(4096, Some(1)).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn a_touched_leaf_goes_last_and_a_too_large_write_evicts_nothing() {
        let mut ix = Index::new(2 * 4096);
        ix.insert(1, None, 4096);
        ix.insert(2, None, 4096);
        ix.touch(1);
        let v = ix.make_room(4096, None).unwrap();
        assert_eq!(v[0].0, 2);
        assert!(ix.make_room(3 * 4096, None).is_none());
        assert!(ix.contains(1));
    }

    #[test]
    fn a_cycle_of_links_is_still_evictable() {
        let mut ix = Index::new(2 * 4096);
        ix.insert(1, Some(2), 4096);
        ix.insert(2, Some(1), 4096);
        let v = ix.make_room(4096, None).unwrap();
        assert_eq!(v.len(), 1);
        ix.unreserve(4096);
        assert_eq!(ix.blocks(), 1);
    }

    #[test]
    fn replacing_a_block_keeps_the_counts_right() {
        let mut ix = Index::new(10 * 4096);
        ix.insert(1, None, 4096);
        ix.insert(2, Some(1), 4096);
        ix.insert(2, Some(1), 8192);
        assert_eq!(ix.used(), 3 * 4096);
        ix.remove(2);
        // 1 is a leaf again: it is evicted when room is needed.
        ix.capacity = 4096;
        let v = ix.shrink_to_fit();
        assert!(v.is_empty());
        let v = ix.make_room(4096, None).unwrap();
        assert_eq!(v[0].0, 1);
    }
}
