//! The disk tier's index: which blocks are on disk, whose they are, their
//! chain links, the bytes they take, and which to evict when a write needs
//! room.
//!
//! Eviction takes leaves first, least recently used first, as the megaslab's
//! chain policy does (docs/eviction.md): a block that a block on disk names
//! as its parent is not on the eviction list until that child is gone, so a
//! chain on disk never has a hole in front of a block. Links here are the
//! parents the clients named at commit, whether or not the parent is on
//! disk; a block written while its parent is not on disk is a leaf and a
//! root at once. Should links ever form a cycle (two commits naming each
//! other), no block of it is a leaf; when no leaf is left, the least recently
//! used block that may go goes.
//!
//! # Tenants
//!
//! Every block belongs to a tenant (the one its file names, `format.rs`),
//! counted in a row of a table of at most [`MAX_TENANTS`] rows, as the
//! megaslab's (`store/tenants.rs`): row 0 `default`, the last `_other` (a
//! name that finds every row taken is counted there), rows for the names
//! with a limit given first and kept. A tenant with a limit (`--tenant-disk-limit`,
//! or its share of the disk by `--tenant-limit`, docs/disk.md) holds at most
//! that many bytes on disk: a write of its block evicts its own leaves
//! (least recently used first) until it fits, and is not done if they cannot
//! make it fit (nothing is evicted then). When the disk is full, a write
//! evicts the blocks of tenants without a limit and, if it has one, its own
//! tenant's: never another limited tenant's.
//!
//! Room is planned before a write ([`Index::make_room`]): the bytes of writes
//! in flight are held as reserved (in total and for their tenant), so
//! concurrent writers never pass a bound together. The parent of the block
//! being written is never evicted for it (it may be a leaf until its child
//! lands).

use kachedb_shm::control::{DEFAULT_TENANT, MAX_TENANTS, OTHER_TENANT};
use std::collections::{BTreeMap, HashMap};

/// File-system bytes a block file takes: its length rounded up to 4 KiB.
pub fn disk_bytes(file_len: u64) -> u64 {
    file_len.div_ceil(4096).saturating_mul(4096)
}

/// A row of the tenant table (`u8`: [`MAX_TENANTS`] fits).
pub type TenantRow = u8;
const _: () = assert!(MAX_TENANTS <= u8::MAX as usize + 1 && MAX_TENANTS >= 2);
/// Row of the default tenant.
pub const DEFAULT_ROW: TenantRow = 0;
/// Row of `_other`.
pub const OTHER_ROW: TenantRow = (MAX_TENANTS - 1) as TenantRow;

/// One block on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The parent its client named, if any.
    pub parent: Option<u128>,
    /// Bytes it takes ([`disk_bytes`]).
    pub bytes: u64,
    /// Its tenant's row.
    pub tenant: TenantRow,
    /// Its last use (written or filled); larger is more recent.
    tick: u64,
}

/// The tenant limits on disk bytes: by name, and for every other tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Bytes each named tenant may hold on disk.
    pub named: Vec<(String, u64)>,
    /// The limit of every other tenant (`default` and `_other` included).
    pub default: Option<u64>,
}

/// One tenant's figures on disk, as published (`kachedb stats`, `/metrics`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantDisk {
    /// Its name.
    pub name: String,
    /// Its limit on `bytes`, if any.
    pub limit: Option<u64>,
    /// File-system bytes of its blocks on disk.
    pub bytes: u64,
    /// Its blocks on disk.
    pub blocks: u64,
    /// Its blocks evicted from disk to make room (by its own writes, or, for
    /// a tenant without a limit, by anyone's).
    pub evictions: u64,
    /// Its writes not done because its own blocks could not make room within
    /// its limit.
    pub limit_refusals: u64,
}

/// One row of the tenant table.
#[derive(Debug, Default)]
struct Row {
    figures: TenantDisk,
    /// Named by a limit (or `default`, `_other`): never given to another name.
    pinned: bool,
    /// Bytes of its writes in flight.
    reserved: u64,
    /// Its entries without children, by last use.
    leaves: BTreeMap<u64, u128>,
    /// Its entries, by last use (for the no-leaf case).
    all: BTreeMap<u64, u128>,
}

/// Why a write gets no room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoRoom {
    /// Larger than the disk (what other writes hold reserved left of it), or
    /// nothing that may go for it would make it fit.
    Full,
    /// Its tenant's own blocks cannot make room within the tenant's limit.
    TenantLimit,
}

/// The index (see the module docs). Not thread-safe by itself: the tier
/// holds it in a mutex.
#[derive(Debug)]
pub struct Index {
    entries: HashMap<u128, Entry>,
    /// How many entries name the key as their parent (keys on disk or not).
    children: HashMap<u128, u32>,
    rows: Vec<Row>,
    /// Name -> row, for the rows in use.
    by_name: HashMap<String, TenantRow>,
    default_limit: Option<u64>,
    tick: u64,
    /// Bytes of the entries.
    used: u64,
    /// Bytes of writes in flight (planned, not yet inserted).
    reserved: u64,
    /// The bound on `used + reserved`.
    capacity: u64,
}

/// The first entry of `m` that is not `protect`, with its tick.
fn first_except(m: &BTreeMap<u64, u128>, protect: Option<u128>) -> Option<(u64, u128)> {
    m.iter().map(|(&t, &k)| (t, k)).find(|&(_, k)| Some(k) != protect)
}

impl Index {
    /// An empty index bounded by `capacity` bytes, its tenants by `limits`.
    pub fn new(capacity: u64, limits: &Limits) -> Index {
        let mut rows: Vec<Row> = (0..MAX_TENANTS).map(|_| Row::default()).collect();
        for (i, name) in [(DEFAULT_ROW, DEFAULT_TENANT), (OTHER_ROW, OTHER_TENANT)] {
            rows[i as usize].figures.name = name.into();
            rows[i as usize].figures.limit = limits.default;
            rows[i as usize].pinned = true;
        }
        let by_name = [(DEFAULT_TENANT.to_string(), DEFAULT_ROW), (OTHER_TENANT.to_string(), OTHER_ROW)].into();
        let mut ix = Index {
            entries: HashMap::new(),
            children: HashMap::new(),
            rows,
            by_name,
            default_limit: limits.default,
            tick: 0,
            used: 0,
            reserved: 0,
            capacity,
        };
        for (name, limit) in &limits.named {
            let t = ix.tenant(name);
            let row = &mut ix.rows[t as usize];
            row.figures.limit = Some(*limit);
            row.pinned = true;
        }
        ix
    }

    /// The row of tenant `name` (`None`: the default tenant), giving it one
    /// if it has none: a free row, else `_other`.
    pub fn tenant(&mut self, name: &str) -> TenantRow {
        if let Some(&t) = self.by_name.get(name) {
            return t;
        }
        // A row never used first (keeping the counters of those used), else
        // one whose tenant holds nothing on disk now.
        let unused = |r: &Row| !r.pinned && r.figures.name.is_empty();
        let free = |r: &Row| !r.pinned && r.figures.blocks == 0 && r.reserved == 0;
        let free = self.rows.iter().position(unused).or_else(|| self.rows.iter().position(free));
        let Some(i) = free else { return OTHER_ROW };
        let old = std::mem::take(&mut self.rows[i].figures.name);
        if !old.is_empty() {
            self.by_name.remove(&old);
        }
        self.rows[i] = Row {
            figures: TenantDisk { name: name.to_owned(), limit: self.default_limit, ..TenantDisk::default() },
            ..Row::default()
        };
        let t = i as TenantRow;
        self.by_name.insert(name.to_owned(), t);
        t
    }

    /// Every tenant row in use, the default tenant first.
    pub fn tenants(&self) -> Vec<TenantDisk> {
        self.rows.iter().filter(|r| !r.figures.name.is_empty()).map(|r| r.figures.clone()).collect()
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

    fn row(&mut self, t: TenantRow) -> &mut Row {
        let n = self.rows.len();
        &mut self.rows[t as usize % n]
    }

    /// Adds (or replaces) the block `key` of tenant row `tenant` taking
    /// `bytes`, naming `parent`, as just used.
    pub fn insert(&mut self, key: u128, parent: Option<u128>, bytes: u64, tenant: TenantRow) {
        self.remove(key);
        let parent = parent.filter(|&p| p != key);
        let tick = self.next_tick();
        self.put(key, Entry { parent, bytes, tenant, tick });
    }

    /// Puts `e` in as the entry of `key` (not in the index), at its own tick.
    fn put(&mut self, key: u128, e: Entry) {
        if let Some(p) = e.parent {
            let n = self.children.entry(p).or_insert(0);
            *n += 1;
            if *n == 1 {
                if let Some(pe) = self.entries.get(&p).copied() {
                    self.row(pe.tenant).leaves.remove(&pe.tick);
                }
            }
        }
        self.entries.insert(key, e);
        let leaf = self.is_leaf(key);
        let row = self.row(e.tenant);
        row.all.insert(e.tick, key);
        if leaf {
            row.leaves.insert(e.tick, key);
        }
        row.figures.bytes += e.bytes;
        row.figures.blocks += 1;
        self.used += e.bytes;
    }

    /// Takes the block `key` out; its entry, if it was there.
    pub fn remove(&mut self, key: u128) -> Option<Entry> {
        let e = self.entries.remove(&key)?;
        let row = self.row(e.tenant);
        row.all.remove(&e.tick);
        row.leaves.remove(&e.tick);
        row.figures.bytes -= e.bytes;
        row.figures.blocks -= 1;
        self.used -= e.bytes;
        if let Some(p) = e.parent {
            if let Some(n) = self.children.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.children.remove(&p);
                    if let Some(pe) = self.entries.get(&p).copied() {
                        self.row(pe.tenant).leaves.insert(pe.tick, p);
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
        let row = self.row(e.tenant);
        row.all.remove(&e.tick);
        row.all.insert(tick, key);
        if row.leaves.remove(&e.tick).is_some() {
            row.leaves.insert(tick, key);
        }
        if let Some(e) = self.entries.get_mut(&key) {
            e.tick = tick;
        }
    }

    /// Whether eviction for a write of tenant `t` may take tenant `u`'s blocks.
    fn may_take(&self, t: TenantRow, u: usize) -> bool {
        u == t as usize || self.rows[u].figures.limit.is_none()
    }

    /// The least recently used block a write of tenant `t` may evict to
    /// make room on the disk: a leaf if there is one, else any.
    fn pick_for_room(&self, t: TenantRow, protect: Option<u128>) -> Option<u128> {
        let best = |leaves: bool| {
            (0..self.rows.len())
                .filter(|&u| self.may_take(t, u))
                .filter_map(|u| {
                    let r = &self.rows[u];
                    first_except(if leaves { &r.leaves } else { &r.all }, protect)
                })
                .min()
                .map(|(_, k)| k)
        };
        best(true).or_else(|| best(false))
    }

    /// Plans room for a write of `bytes` of tenant `t` (of a block naming
    /// `protect` as its parent): takes the victims out of the index (the
    /// caller deletes their files) and holds `bytes` as reserved until
    /// [`unreserve`](Self::unreserve). Refused (nothing taken out) if the
    /// disk, or the tenant's limit, cannot make room for it.
    pub fn make_room(&mut self, bytes: u64, protect: Option<u128>, t: TenantRow) -> Result<Vec<(u128, Entry)>, NoRoom> {
        let t = t % self.rows.len() as TenantRow;
        if bytes > self.capacity.saturating_sub(self.reserved) {
            return Err(NoRoom::Full);
        }
        let mut victims: Vec<(u128, Entry)> = Vec::new();
        if let Some(limit) = self.rows[t as usize].figures.limit {
            loop {
                let r = &self.rows[t as usize];
                if r.figures.bytes + r.reserved + bytes <= limit {
                    break;
                }
                let pick = if bytes > limit { None } else { first_except(&r.leaves, protect) };
                let Some((_, key)) = pick else {
                    self.undo(victims);
                    self.row(t).figures.limit_refusals += 1;
                    return Err(NoRoom::TenantLimit);
                };
                victims.extend(self.remove(key).map(|e| (key, e)));
            }
        }
        while self.used + self.reserved + bytes > self.capacity {
            let Some(key) = self.pick_for_room(t, protect) else {
                self.undo(victims);
                return Err(NoRoom::Full);
            };
            victims.extend(self.remove(key).map(|e| (key, e)));
        }
        for (_, e) in &victims {
            self.row(e.tenant).figures.evictions += 1;
        }
        self.reserved += bytes;
        self.row(t).reserved += bytes;
        Ok(victims)
    }

    /// Puts the entries taken out back, last out first in.
    fn undo(&mut self, victims: Vec<(u128, Entry)>) {
        for (key, e) in victims.into_iter().rev() {
            self.put(key, e);
        }
    }

    /// Lets go of `bytes` of tenant `t` reserved by
    /// [`make_room`](Self::make_room) (the write is over: inserted, or failed).
    pub fn unreserve(&mut self, bytes: u64, t: TenantRow) {
        self.reserved = self.reserved.saturating_sub(bytes);
        let row = self.row(t);
        row.reserved = row.reserved.saturating_sub(bytes);
    }

    /// Blocks to evict so that the blocks fit the bounds again (after a
    /// start with a smaller `--disk-size` or tenant limit than the blocks
    /// found), taken out: each tenant's own leaves first down to its limit,
    /// then the disk's.
    pub fn shrink_to_fit(&mut self) -> Vec<(u128, Entry)> {
        let mut victims = Vec::new();
        for t in 0..self.rows.len() {
            while let Some(limit) = self.rows[t].figures.limit {
                let r = &self.rows[t];
                if r.figures.bytes + r.reserved <= limit {
                    break;
                }
                let key = r.leaves.values().next().or_else(|| r.all.values().next()).copied();
                let Some(key) = key else { break };
                victims.extend(self.remove(key).map(|e| (key, e)));
            }
        }
        while self.used + self.reserved > self.capacity {
            let pick = |leaves: bool| {
                self.rows
                    .iter()
                    .filter_map(|r| if leaves { &r.leaves } else { &r.all }.first_key_value())
                    .min()
                    .map(|(_, &k)| k)
            };
            let Some(key) = pick(true).or_else(|| pick(false)) else { break };
            victims.extend(self.remove(key).map(|e| (key, e)));
        }
        for (_, e) in &victims {
            self.row(e.tenant).figures.evictions += 1;
        }
        victims
    }

    /// Checks the tables against each other (tests).
    #[cfg(test)]
    fn check(&self) {
        let mut bytes = vec![0u64; self.rows.len()];
        let mut blocks = vec![0u64; self.rows.len()];
        for (k, e) in &self.entries {
            bytes[e.tenant as usize] += e.bytes;
            blocks[e.tenant as usize] += 1;
            let r = &self.rows[e.tenant as usize];
            assert_eq!(r.all.get(&e.tick), Some(k));
            assert_eq!(r.leaves.get(&e.tick) == Some(k), self.is_leaf(*k), "leaf status of {k}");
        }
        for (t, r) in self.rows.iter().enumerate() {
            assert_eq!((r.figures.bytes, r.figures.blocks), (bytes[t], blocks[t]), "row {t}");
            assert_eq!(r.all.len() as u64, r.figures.blocks);
        }
        assert_eq!(self.used, bytes.iter().sum::<u64>());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_takes_leaves_first_so_a_parent_outlives_its_child() {
        let mut ix = Index::new(4 * 4096, &Limits::default());
        // A chain a <- b <- c, written oldest first, then a lone block d.
        ix.insert(1, None, 4096, 0);
        ix.insert(2, Some(1), 4096, 0);
        ix.insert(3, Some(2), 4096, 0);
        ix.insert(4, None, 4096, 0);
        // Room for one more: the least recently used leaf is c (3), not a.
        let v = ix.make_room(4096, None, 0).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![3]);
        ix.unreserve(4096, 0);
        // Then b, which became a leaf at its own last use, then a, then d.
        let v = ix.make_room(3 * 4096, None, 0).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!(ix.contains(4));
        assert_eq!(ix.used() + 3 * 4096, ix.capacity());
    }

    #[test]
    fn the_parent_of_the_block_being_written_is_not_evicted_for_it() {
        let mut ix = Index::new(2 * 4096, &Limits::default());
        ix.insert(1, None, 4096, 0);
        ix.insert(2, None, 4096, 0);
        // Block 3 names 1: 2 goes although 1 is older.
        let v = ix.make_room(4096, Some(1), 0).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn a_touched_leaf_goes_last_and_a_too_large_write_evicts_nothing() {
        let mut ix = Index::new(2 * 4096, &Limits::default());
        ix.insert(1, None, 4096, 0);
        ix.insert(2, None, 4096, 0);
        ix.touch(1);
        let v = ix.make_room(4096, None, 0).unwrap();
        assert_eq!(v[0].0, 2);
        assert!(ix.make_room(3 * 4096, None, 0).is_err());
        assert!(ix.contains(1));
    }

    #[test]
    fn a_cycle_of_links_is_still_evictable() {
        let mut ix = Index::new(2 * 4096, &Limits::default());
        ix.insert(1, Some(2), 4096, 0);
        ix.insert(2, Some(1), 4096, 0);
        let v = ix.make_room(4096, None, 0).unwrap();
        assert_eq!(v.len(), 1);
        ix.unreserve(4096, 0);
        assert_eq!(ix.blocks(), 1);
    }

    #[test]
    fn replacing_a_block_keeps_the_counts_right() {
        let mut ix = Index::new(10 * 4096, &Limits::default());
        ix.insert(1, None, 4096, 0);
        ix.insert(2, Some(1), 4096, 0);
        ix.insert(2, Some(1), 8192, 0);
        assert_eq!(ix.used(), 3 * 4096);
        ix.remove(2);
        // 1 is a leaf again: it is evicted when room is needed.
        ix.capacity = 4096;
        let v = ix.shrink_to_fit();
        assert!(v.is_empty());
        let v = ix.make_room(4096, None, 0).unwrap();
        assert_eq!(v[0].0, 1);
    }

    fn limits(named: &[(&str, u64)], default: Option<u64>) -> Limits {
        Limits { named: named.iter().map(|&(n, l)| (n.to_string(), l)).collect(), default }
    }

    #[test]
    fn a_tenant_over_its_limit_evicts_its_own_leaves_never_anothers() {
        const B: u64 = 4096;
        let mut ix = Index::new(100 * B, &limits(&[("a", 3 * B), ("b", 2 * B)], None));
        let (a, b) = (ix.tenant("a"), ix.tenant("b"));
        let c = ix.tenant("c");
        assert!(a != b && b != c && c != DEFAULT_ROW && c != OTHER_ROW);
        // b: two blocks (its limit); a: a chain 1 <- 2 <- 3 (its limit).
        ix.insert(20, None, B, b);
        ix.insert(21, None, B, b);
        ix.insert(1, None, B, a);
        ix.insert(2, Some(1), B, a);
        ix.insert(3, Some(2), B, a);
        // a writes 4 (a child of 3): a's only leaf is 3, its parent: refused,
        // nothing evicted.
        assert_eq!(ix.make_room(B, Some(3), a), Err(NoRoom::TenantLimit));
        assert_eq!(ix.blocks(), 5);
        ix.check();
        // a writes a new root: its leaf 3 goes (not b's older blocks).
        let v = ix.make_room(B, None, a).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![3]);
        ix.insert(5, None, B, a);
        ix.unreserve(B, a);
        // Then 2 (a leaf once 3 is gone), then 1: leaves first, chains hold.
        let v = ix.make_room(2 * B, None, a).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![2, 1]);
        ix.unreserve(2 * B, a);
        assert!(ix.contains(20) && ix.contains(21));
        let figs = ix.tenants();
        let fig = |n: &str| figs.iter().find(|f| f.name == n).cloned().unwrap();
        assert_eq!((fig("a").bytes, fig("a").blocks, fig("a").evictions, fig("a").limit_refusals), (B, 1, 3, 1));
        assert_eq!((fig("b").bytes, fig("b").blocks, fig("b").evictions), (2 * B, 2, 0));
        assert!(ix.make_room(3 * B, None, b).is_err(), "more than b's limit");
        ix.check();
    }

    #[test]
    fn a_full_disk_evicts_unlimited_tenants_and_the_writers_own_only() {
        const B: u64 = 4096;
        let mut ix = Index::new(4 * B, &limits(&[("a", 2 * B)], None));
        let (a, c) = (ix.tenant("a"), ix.tenant("c"));
        ix.insert(1, None, B, a);
        ix.insert(2, None, B, a);
        ix.insert(3, None, B, c);
        ix.insert(4, None, B, DEFAULT_ROW);
        // c (no limit) needs room: the oldest unlimited block goes (3), not a's.
        let v = ix.make_room(B, None, c).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![3]);
        ix.insert(5, None, B, c);
        ix.unreserve(B, c);
        // c needs three blocks' room: only the unlimited blocks 4 and 5 may go: refused, nothing taken.
        assert_eq!(ix.make_room(3 * B, None, c), Err(NoRoom::Full));
        assert_eq!(ix.blocks(), 4);
        // a needs room: its own (oldest) block goes, within its limit.
        let v = ix.make_room(B, None, a).unwrap();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![1]);
        ix.unreserve(B, a);
        ix.check();
    }

    #[test]
    fn names_past_the_table_are_counted_in_other_and_a_smaller_limit_shrinks_its_tenant() {
        const B: u64 = 4096;
        let mut ix = Index::new(1000 * B, &Limits::default());
        for i in 0..MAX_TENANTS - 2 {
            let t = ix.tenant(&format!("t{i}"));
            assert_ne!(t, OTHER_ROW);
            ix.insert(i as u128, None, B, t);
        }
        assert_eq!(ix.tenant("one-too-many"), OTHER_ROW);
        // A row whose tenant holds nothing on disk any more is given to the next new name.
        let t0 = ix.tenant("t0");
        ix.remove(0);
        assert_eq!(ix.tenant("fresh"), t0);
        ix.insert(0, None, B, t0);
        assert_eq!(ix.tenant("t0"), OTHER_ROW);
        ix.check();
        // A restart with a limit below what a tenant holds.
        let mut ix = Index::new(1000 * B, &limits(&[("a", 2 * B)], None));
        let a = ix.tenant("a");
        for k in 0..5 {
            ix.insert(k, None, B, a);
        }
        ix.insert(9, None, B, DEFAULT_ROW);
        let v = ix.shrink_to_fit();
        assert_eq!(v.iter().map(|v| v.0).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(ix.blocks(), 3);
        ix.check();
    }
}
