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
//!
//! # Layout
//!
//! Built to cost what a tight hash table entry costs per block (the disk may
//! hold millions): the entries lie in one slab of fixed-size `Slot`s (48
//! bytes), found by a hash table of `u32` slot indices (5 bytes a bucket).
//! A parent link is the parent's slot index; a key named as a parent by
//! blocks on disk but not on disk itself has a slot of its own (a
//! *phantom*: its child count, in no list), so that the count is there when
//! it is written. Each tenant row keeps two lists threaded through the
//! slots, by last use (a tick per slot): its leaves and its other entries
//! ("inner"). A write or a use moves an entry to its list's recent end
//! (`O(1)`); an entry that becomes a leaf, or stops being one, joins the
//! other list at its own last use, found by walking that list from both
//! ends: `O(1)` for a chain evicted tail first or written head first (the
//! parent is the list's oldest or newest entry), else as many steps as the
//! nearer end is away.
//!
//! # Children (read-ahead)
//!
//! Each slot keeps the slot of its child used last (`Slot::child`, a
//! *hint*: set when a block naming it as parent is written or filled, never
//! cleared; the last use is kept in 48 bits so that it fits the 48 bytes). A hint is checked where it is read — the slot it names is a
//! present block whose parent is this slot, or the hint says nothing — so a
//! stale one (its child removed, the slot reused) is harmless.
//! [`Index::chain_after`] follows the hints from a block to the blocks a
//! client walking the chain asks for next: what the tier reads ahead.

use hashbrown::HashTable;
use kachedb_shm::control::{DEFAULT_TENANT, MAX_TENANTS, OTHER_TENANT};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};

/// Bytes of the file-system block, the unit the index counts bytes in.
const PAGE: u64 = 4096;

/// File-system bytes a block file takes: its length rounded up to 4 KiB.
pub fn disk_bytes(file_len: u64) -> u64 {
    file_len.div_ceil(PAGE).saturating_mul(PAGE)
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
    /// Bytes it takes ([`disk_bytes`]: whole 4 KiB pages, at most 16 TiB).
    pub bytes: u64,
    /// Its tenant's row.
    pub tenant: TenantRow,
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

/// A slot index: `u32` (the slab holds at most `u32::MAX` slots).
type SlotIndex = u32;
/// No slot (an empty list's ends, a slot without a parent).
const NIL: SlotIndex = u32::MAX;

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing: on the free list (`next`).
    Free,
    /// A block on disk, on its row's `leaves` (no children) or `inner` list.
    Present,
    /// A key not on disk that blocks on disk name as their parent
    /// (`children > 0`); in no list.
    Phantom,
}

/// One key of the index (see "Layout" in the module docs).
#[derive(Clone, Copy, Debug)]
struct Slot {
    key: u128,
    /// Its last use (written or filled); larger is more recent. Present only.
    tick: Tick,
    /// The slot of its child used last, or [`NIL`]: a hint, checked where
    /// it is read (see "Children" in the module docs).
    child: SlotIndex,
    /// The slot of the parent its client named (present or phantom), or [`NIL`].
    parent: SlotIndex,
    /// How many present entries name it as their parent.
    children: u32,
    /// Bytes it takes, in 4 KiB pages. Present only.
    pages: u32,
    /// Its neighbours in its list (older, newer); `next` chains the free list.
    prev: SlotIndex,
    next: SlotIndex,
    tenant: TenantRow,
    state: State,
}
const _: () = assert!(std::mem::size_of::<Slot>() == 48);

/// A last use in 48 bits (2.8 × 10¹⁴ writes and fills: the index's tick
/// stops there), as three `u16`s: two bytes less than a `u64` in a [`Slot`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tick([u16; 3]);

/// The largest tick a slot holds.
const TICK_MAX: u64 = (1 << 48) - 1;

impl Tick {
    fn new(t: u64) -> Tick {
        let t = t.min(TICK_MAX);
        Tick([t as u16, (t >> 16) as u16, (t >> 32) as u16])
    }

    fn get(self) -> u64 {
        u64::from(self.0[0]) | u64::from(self.0[1]) << 16 | u64::from(self.0[2]) << 32
    }
}

/// A list of slots threaded through `prev`/`next`, by tick, oldest first.
#[derive(Clone, Copy, Debug)]
struct List {
    head: SlotIndex,
    tail: SlotIndex,
}

impl Default for List {
    fn default() -> List {
        List { head: NIL, tail: NIL }
    }
}

impl List {
    /// Takes slot `i` (on this list) off it.
    fn unlink(&mut self, slots: &mut [Slot], i: SlotIndex) {
        let Slot { prev, next, .. } = slots[i as usize];
        match prev {
            NIL => self.head = next,
            p => slots[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => slots[n as usize].prev = prev,
        }
        slots[i as usize].prev = NIL;
        slots[i as usize].next = NIL;
    }

    /// Puts slot `i` (on no list) in at its own tick, walking from both ends
    /// (the ticks of a list's slots are distinct).
    fn insert_by_tick(&mut self, slots: &mut [Slot], i: SlotIndex) {
        let tick = slots[i as usize].tick.get();
        let (mut newer, mut older) = (self.head, self.tail);
        loop {
            // `newer`: the oldest slot not yet passed from the old end.
            if newer == NIL || slots[newer as usize].tick.get() > tick {
                let prev = if newer == NIL { self.tail } else { slots[newer as usize].prev };
                return self.link_between(slots, i, prev, newer);
            }
            // `older`: the newest slot not yet passed from the new end.
            if slots[older as usize].tick.get() < tick {
                let next = slots[older as usize].next;
                return self.link_between(slots, i, older, next);
            }
            newer = slots[newer as usize].next;
            older = slots[older as usize].prev;
        }
    }

    fn link_between(&mut self, slots: &mut [Slot], i: SlotIndex, prev: SlotIndex, next: SlotIndex) {
        slots[i as usize].prev = prev;
        slots[i as usize].next = next;
        match prev {
            NIL => self.head = i,
            p => slots[p as usize].next = i,
        }
        match next {
            NIL => self.tail = i,
            n => slots[n as usize].prev = i,
        }
    }

    /// The oldest slot that is not `protect`.
    fn first_except(&self, slots: &[Slot], protect: SlotIndex) -> SlotIndex {
        match self.head {
            h if h == protect && h != NIL => slots[h as usize].next,
            h => h,
        }
    }
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
    leaves: List,
    /// Its entries with children, by last use (with `leaves`: all of them).
    inner: List,
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

/// An entry taken out, with its last use (to put it back where it was).
type Taken = (u128, Entry, u64);

/// The index (see the module docs). Not thread-safe by itself: the tier
/// holds it in a mutex.
#[derive(Debug)]
pub struct Index {
    /// The slab: present, phantom and free slots.
    slots: Vec<Slot>,
    /// The free slots, chained through `next`.
    free: SlotIndex,
    /// Present and phantom slots, by key.
    table: HashTable<SlotIndex>,
    hasher: RandomState,
    /// Present slots.
    present: u64,
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
            slots: Vec::new(),
            free: NIL,
            table: HashTable::new(),
            hasher: RandomState::new(),
            present: 0,
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

    /// Makes room for `additional` more keys without growing (the rebuild,
    /// which knows how many it indexes).
    pub fn reserve(&mut self, additional: usize) {
        let free = self.slots.capacity() - self.slots.len();
        self.slots.reserve_exact(additional.saturating_sub(free));
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.table.reserve(additional, |&i| hasher.hash_one(slots[i as usize].key));
    }

    /// Heap bytes the index's tables of keys take (the slab and the hash
    /// table, at their capacities; the tenant table aside).
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>() + self.table.allocation_size()
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
        self.present
    }

    /// Bytes the blocks take.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The bound.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The slot of `key` (present or phantom).
    fn find(&self, key: u128) -> Option<SlotIndex> {
        let slots = &self.slots;
        self.table.find(self.hasher.hash_one(key), |&i| slots[i as usize].key == key).copied()
    }

    /// The slot of `key` if it is on disk.
    fn find_present(&self, key: u128) -> Option<SlotIndex> {
        self.find(key).filter(|&i| self.slots[i as usize].state == State::Present)
    }

    /// The slot of `key`, a new phantom without children if it had none.
    fn slot_of(&mut self, key: u128) -> SlotIndex {
        if let Some(i) = self.find(key) {
            return i;
        }
        let slot = Slot {
            key,
            tick: Tick::default(),
            child: NIL,
            parent: NIL,
            children: 0,
            pages: 0,
            prev: NIL,
            next: NIL,
            tenant: 0,
            state: State::Phantom,
        };
        let i = match self.free {
            NIL => {
                if self.slots.len() == self.slots.capacity() {
                    // Grown by an eighth (not doubled): the slab is most of
                    // the index's bytes.
                    self.slots.reserve_exact((self.slots.len() / 8).max(64));
                }
                assert!(self.slots.len() < NIL as usize, "disk index: more than 2^32 - 1 keys");
                self.slots.push(slot);
                (self.slots.len() - 1) as SlotIndex
            }
            f => {
                self.free = self.slots[f as usize].next;
                self.slots[f as usize] = slot;
                f
            }
        };
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.table.insert_unique(hasher.hash_one(key), i, |&j| hasher.hash_one(slots[j as usize].key));
        i
    }

    /// Frees slot `i` (in no list, no children): out of the table, onto the free list.
    fn release(&mut self, i: SlotIndex) {
        let key = self.slots[i as usize].key;
        let hash = self.hasher.hash_one(key);
        if let Ok(e) = self.table.find_entry(hash, |&j| j == i) {
            e.remove();
        }
        let s = &mut self.slots[i as usize];
        s.state = State::Free;
        s.next = self.free;
        self.free = i;
    }

    /// The entry of slot `i` (present).
    fn entry_of(&self, i: SlotIndex) -> Entry {
        let s = &self.slots[i as usize];
        let parent = (s.parent != NIL).then(|| self.slots[s.parent as usize].key);
        Entry { parent, bytes: u64::from(s.pages) * PAGE, tenant: s.tenant }
    }

    /// Every block's key and the parent its client named (for the KV
    /// events' snapshot of the tier); `O(slots)`.
    pub fn entries(&self) -> Vec<(u128, Option<u128>)> {
        let mut out = Vec::with_capacity(self.present as usize);
        for (i, s) in self.slots.iter().enumerate() {
            if s.state == State::Present {
                out.push((s.key, self.entry_of(i as SlotIndex).parent));
            }
        }
        out
    }

    /// The entry of `key`.
    pub fn get(&self, key: u128) -> Option<Entry> {
        self.find_present(key).map(|i| self.entry_of(i))
    }

    /// Whether `key` is on disk.
    pub fn contains(&self, key: u128) -> bool {
        self.find_present(key).is_some()
    }

    fn row(&mut self, t: TenantRow) -> &mut Row {
        let n = self.rows.len();
        &mut self.rows[t as usize % n]
    }

    /// The list slot `i` (present) is on.
    fn list_of(&mut self, i: SlotIndex) -> &mut List {
        let s = self.slots[i as usize];
        let row = self.row(s.tenant);
        if s.children == 0 {
            &mut row.leaves
        } else {
            &mut row.inner
        }
    }

    /// Takes slot `i` (present) off its list.
    fn unlist(&mut self, i: SlotIndex) {
        let mut list = *self.list_of(i);
        list.unlink(&mut self.slots, i);
        *self.list_of(i) = list;
    }

    /// Puts slot `i` (present, on no list) on its list at its own tick.
    fn list_by_tick(&mut self, i: SlotIndex) {
        let mut list = *self.list_of(i);
        list.insert_by_tick(&mut self.slots, i);
        *self.list_of(i) = list;
    }

    /// Adds (or replaces) the block `key` of tenant row `tenant` taking
    /// `bytes`, naming `parent`, as just used.
    pub fn insert(&mut self, key: u128, parent: Option<u128>, bytes: u64, tenant: TenantRow) {
        self.remove(key);
        let parent = parent.filter(|&p| p != key);
        self.tick = (self.tick + 1).min(TICK_MAX);
        self.put(key, Entry { parent, bytes, tenant }, self.tick);
    }

    /// Puts `e` in as the entry of `key` (not on disk), used at `tick`.
    fn put(&mut self, key: u128, e: Entry, tick: u64) {
        let tenant = e.tenant % self.rows.len() as TenantRow;
        let parent = match e.parent {
            Some(p) => {
                let pi = self.slot_of(p);
                self.add_child(pi, 1);
                pi
            }
            None => NIL,
        };
        let i = self.slot_of(key);
        if parent != NIL {
            self.slots[parent as usize].child = i;
        }
        let pages = u32::try_from(e.bytes.div_ceil(PAGE)).unwrap_or(u32::MAX);
        let s = &mut self.slots[i as usize];
        (s.tick, s.parent, s.pages, s.tenant, s.state) = (Tick::new(tick), parent, pages, tenant, State::Present);
        self.list_by_tick(i);
        let bytes = u64::from(pages) * PAGE;
        let row = self.row(tenant);
        row.figures.bytes += bytes;
        row.figures.blocks += 1;
        self.used += bytes;
        self.present += 1;
    }

    /// Adds one child (`+1`) to slot `pi` or takes one off (`-1`): a
    /// present slot moves between its leaves and its inner list (at its own
    /// last use) as it gains its first child or loses its last; a phantom
    /// without children goes.
    fn add_child(&mut self, pi: SlotIndex, delta: i32) {
        let s = self.slots[pi as usize];
        let children = s.children.checked_add_signed(delta).expect("disk index: child count out of range");
        let moves = s.state == State::Present && (s.children == 0) != (children == 0);
        if moves {
            self.unlist(pi);
        }
        self.slots[pi as usize].children = children;
        if moves {
            self.list_by_tick(pi);
        } else if s.state == State::Phantom && children == 0 {
            self.release(pi);
        }
    }

    /// Takes the block `key` out; its entry, if it was there.
    pub fn remove(&mut self, key: u128) -> Option<Entry> {
        self.take(key).map(|(_, e, _)| e)
    }

    /// Takes the block `key` out, with its last use.
    fn take(&mut self, key: u128) -> Option<Taken> {
        let i = self.find_present(key)?;
        let e = self.entry_of(i);
        self.unlist(i);
        let s = self.slots[i as usize];
        let row = self.row(s.tenant);
        row.figures.bytes -= e.bytes;
        row.figures.blocks -= 1;
        self.used -= e.bytes;
        self.present -= 1;
        if s.parent != NIL {
            self.add_child(s.parent, -1);
        }
        let slot = &mut self.slots[i as usize];
        slot.parent = NIL;
        slot.state = State::Phantom;
        if s.children == 0 {
            self.release(i);
        }
        Some((key, e, s.tick.get()))
    }

    /// Marks `key` as just used (a fill read it): its parent's child used last.
    pub fn touch(&mut self, key: u128) {
        let Some(i) = self.find_present(key) else { return };
        self.unlist(i);
        self.tick = (self.tick + 1).min(TICK_MAX);
        self.slots[i as usize].tick = Tick::new(self.tick);
        self.list_by_tick(i);
        let parent = self.slots[i as usize].parent;
        if parent != NIL {
            self.slots[parent as usize].child = i;
        }
    }

    /// The present child of slot `p` its hint names, if the hint still holds.
    fn hinted_child(&self, p: SlotIndex) -> Option<SlotIndex> {
        let c = self.slots.get(p as usize)?.child;
        let s = self.slots.get(c as usize)?;
        (s.state == State::Present && s.parent == p && c != p).then_some(c)
    }

    /// The blocks after `key` in its chain, as a client walking it asks for
    /// them: its child used last, that one's, and so on, at most `max_blocks`
    /// of them and `max_bytes` of file-system bytes (the first always, if
    /// there is one), each with the bytes it takes; stops at a block with no
    /// present child (or at a link back into the list: a cycle). `key` need
    /// not be on disk itself (a phantom names its children too).
    pub fn chain_after(&self, key: u128, max_blocks: usize, max_bytes: u64) -> Vec<(u128, u64)> {
        let mut out: Vec<(u128, u64)> = Vec::new();
        let Some(mut at) = self.find(key) else { return out };
        let mut bytes = 0u64;
        while out.len() < max_blocks {
            let Some(c) = self.hinted_child(at) else { break };
            let s = &self.slots[c as usize];
            let b = u64::from(s.pages) * PAGE;
            if (!out.is_empty() && bytes.saturating_add(b) > max_bytes)
                || s.key == key
                || out.iter().any(|o| o.0 == s.key)
            {
                break;
            }
            bytes += b;
            out.push((s.key, b));
            at = c;
        }
        out
    }

    /// Whether eviction for a write of tenant `t` may take tenant `u`'s blocks.
    fn may_take(&self, t: TenantRow, u: usize) -> bool {
        u == t as usize || self.rows[u].figures.limit.is_none()
    }

    /// The least recently used of slots `a` and `b` (either may be [`NIL`]).
    fn older(&self, a: SlotIndex, b: SlotIndex) -> SlotIndex {
        match (a, b) {
            (NIL, x) | (x, NIL) => x,
            (a, b) if self.slots[a as usize].tick.get() <= self.slots[b as usize].tick.get() => a,
            (_, b) => b,
        }
    }

    /// Row `u`'s least recently used entry that is not `protect`: a leaf, or
    /// (`leaves_only` false) any.
    fn oldest_in(&self, u: usize, protect: SlotIndex, leaves_only: bool) -> SlotIndex {
        let r = &self.rows[u];
        let leaf = r.leaves.first_except(&self.slots, protect);
        if leaves_only {
            leaf
        } else {
            self.older(leaf, r.inner.first_except(&self.slots, protect))
        }
    }

    /// The least recently used block a write of tenant `t` (`None`: of no
    /// tenant, anyone's) may evict to make room on the disk: a leaf if there
    /// is one, else any.
    fn pick_for_room(&self, t: Option<TenantRow>, protect: SlotIndex) -> Option<u128> {
        let best = |leaves_only: bool| {
            (0..self.rows.len())
                .filter(|&u| t.is_none_or(|t| self.may_take(t, u)))
                .map(|u| self.oldest_in(u, protect, leaves_only))
                .fold(NIL, |a, b| self.older(a, b))
        };
        let i = match best(true) {
            NIL => best(false),
            i => i,
        };
        (i != NIL).then(|| self.slots[i as usize].key)
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
        let protect = protect.and_then(|p| self.find_present(p)).unwrap_or(NIL);
        let mut victims: Vec<Taken> = Vec::new();
        if let Some(limit) = self.rows[t as usize].figures.limit {
            loop {
                let r = &self.rows[t as usize];
                if r.figures.bytes + r.reserved + bytes <= limit {
                    break;
                }
                let pick = if bytes > limit { NIL } else { r.leaves.first_except(&self.slots, protect) };
                if pick == NIL {
                    self.undo(victims);
                    self.row(t).figures.limit_refusals += 1;
                    return Err(NoRoom::TenantLimit);
                }
                victims.extend(self.take(self.slots[pick as usize].key));
            }
        }
        while self.used + self.reserved + bytes > self.capacity {
            let Some(key) = self.pick_for_room(Some(t), protect) else {
                self.undo(victims);
                return Err(NoRoom::Full);
            };
            victims.extend(self.take(key));
        }
        for (_, e, _) in &victims {
            self.row(e.tenant).figures.evictions += 1;
        }
        self.reserved += bytes;
        self.row(t).reserved += bytes;
        Ok(victims.into_iter().map(|(k, e, _)| (k, e)).collect())
    }

    /// Puts the entries taken out back, last out first in, each at its own
    /// last use.
    fn undo(&mut self, victims: Vec<Taken>) {
        for (key, e, tick) in victims.into_iter().rev() {
            self.put(key, e, tick);
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
                let i = match self.oldest_in(t, NIL, true) {
                    NIL => self.oldest_in(t, NIL, false),
                    i => i,
                };
                if i == NIL {
                    break;
                }
                let key = self.slots[i as usize].key;
                victims.extend(self.remove(key).map(|e| (key, e)));
            }
        }
        while self.used + self.reserved > self.capacity {
            let Some(key) = self.pick_for_room(None, NIL) else { break };
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
        let n = self.rows.len();
        let (mut bytes, mut blocks) = (vec![0u64; n], vec![0u64; n]);
        let mut children = vec![0u32; self.slots.len()];
        let mut in_table = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.state == State::Free {
                continue;
            }
            in_table += 1;
            assert_eq!(self.find(s.key), Some(i as SlotIndex), "slot {i} in the table");
            if s.state == State::Present {
                bytes[s.tenant as usize] += u64::from(s.pages) * PAGE;
                blocks[s.tenant as usize] += 1;
                if s.parent != NIL {
                    children[s.parent as usize] += 1;
                }
            } else {
                assert_eq!(s.parent, NIL, "a phantom names no parent");
            }
        }
        assert_eq!(in_table, self.table.len());
        for (i, s) in self.slots.iter().enumerate() {
            if s.state != State::Free {
                assert_eq!(s.children, children[i], "children of slot {i}");
                assert!(s.state == State::Present || s.children > 0, "a phantom without children");
            }
        }
        let mut listed = 0u64;
        for (t, r) in self.rows.iter().enumerate() {
            for (list, leaves) in [(&r.leaves, true), (&r.inner, false)] {
                let (mut i, mut prev, mut tick) = (list.head, NIL, 0);
                while i != NIL {
                    let s = &self.slots[i as usize];
                    assert!(s.state == State::Present && s.tenant as usize == t && (s.children == 0) == leaves);
                    assert!(s.prev == prev && s.tick.get() > tick, "list order of row {t}");
                    (prev, tick, i) = (i, s.tick.get(), s.next);
                    listed += 1;
                }
                assert_eq!(list.tail, prev);
            }
            assert_eq!((r.figures.bytes, r.figures.blocks), (bytes[t], blocks[t]), "row {t}");
        }
        assert_eq!(listed, self.present);
        assert_eq!(self.present, blocks.iter().sum::<u64>());
        assert_eq!(self.used, bytes.iter().sum::<u64>());
    }
}

/// A model of the index for the property test: the same rules, written
/// the plain way (a list of entries in order of last use, leaves found by
/// looking at every entry, a refused plan undone by restoring a copy).
#[cfg(test)]
mod model {
    use super::{Entry, NoRoom, TenantRow};

    #[derive(Clone, Debug)]
    pub struct Model {
        /// Key and entry, least recently used first.
        pub entries: Vec<(u128, Entry)>,
        /// Each row's limit.
        pub limits: Vec<Option<u64>>,
        pub reserved_by_row: Vec<u64>,
        pub evictions: Vec<u64>,
        pub refusals: Vec<u64>,
        pub reserved: u64,
        pub capacity: u64,
    }

    impl Model {
        pub fn new(capacity: u64, limits: Vec<Option<u64>>) -> Model {
            let n = limits.len();
            Model {
                entries: Vec::new(),
                limits,
                reserved_by_row: vec![0; n],
                evictions: vec![0; n],
                refusals: vec![0; n],
                reserved: 0,
                capacity,
            }
        }

        fn pos(&self, key: u128) -> Option<usize> {
            self.entries.iter().position(|e| e.0 == key)
        }

        pub fn used(&self) -> u64 {
            self.entries.iter().map(|e| e.1.bytes).sum()
        }

        pub fn row_bytes(&self, t: TenantRow) -> u64 {
            self.entries.iter().filter(|e| e.1.tenant == t).map(|e| e.1.bytes).sum()
        }

        fn is_leaf(&self, key: u128) -> bool {
            !self.entries.iter().any(|e| e.1.parent == Some(key))
        }

        pub fn insert(&mut self, key: u128, parent: Option<u128>, bytes: u64, tenant: TenantRow) {
            self.remove(key);
            self.entries.push((key, Entry { parent: parent.filter(|&p| p != key), bytes, tenant }));
        }

        pub fn remove(&mut self, key: u128) -> Option<Entry> {
            self.pos(key).map(|i| self.entries.remove(i).1)
        }

        pub fn touch(&mut self, key: u128) {
            if let Some(i) = self.pos(key) {
                let e = self.entries.remove(i);
                self.entries.push(e);
            }
        }

        /// The oldest entry passing `f` that is not `protect`: a leaf first
        /// if `leaves_first`, else (or if none) any.
        fn oldest(&self, protect: Option<u128>, leaves_first: bool, f: impl Fn(&Entry) -> bool) -> Option<u128> {
            let ok = |e: &&(u128, Entry)| f(&e.1) && Some(e.0) != protect;
            let leaf = self.entries.iter().filter(ok).find(|e| self.is_leaf(e.0));
            let any = || self.entries.iter().find(ok);
            if leaves_first { leaf.or_else(any) } else { any() }.map(|e| e.0)
        }

        pub fn make_room(&mut self, bytes: u64, protect: Option<u128>, t: TenantRow) -> Result<Vec<u128>, NoRoom> {
            if bytes > self.capacity.saturating_sub(self.reserved) {
                return Err(NoRoom::Full);
            }
            let before = self.clone();
            let mut victims = Vec::new();
            if let Some(limit) = self.limits[t as usize] {
                while self.row_bytes(t) + self.reserved_by_row[t as usize] + bytes > limit {
                    let pick =
                        self.entries.iter().find(|e| e.1.tenant == t && Some(e.0) != protect && self.is_leaf(e.0));
                    match pick.map(|e| e.0).filter(|_| bytes <= limit) {
                        Some(k) => {
                            self.remove(k);
                            victims.push(k);
                        }
                        None => {
                            *self = before;
                            self.refusals[t as usize] += 1;
                            return Err(NoRoom::TenantLimit);
                        }
                    }
                }
            }
            while self.used() + self.reserved + bytes > self.capacity {
                let limits = self.limits.clone();
                let may = |e: &Entry| e.tenant == t || limits[e.tenant as usize].is_none();
                let Some(k) = self.oldest(protect, true, may) else {
                    *self = before;
                    return Err(NoRoom::Full);
                };
                let e = self.remove(k).unwrap();
                victims.push(k);
                let _ = e;
            }
            for &k in &victims {
                let tenant = before.entries[before.pos(k).unwrap()].1.tenant;
                self.evictions[tenant as usize] += 1;
            }
            self.reserved += bytes;
            self.reserved_by_row[t as usize] += bytes;
            Ok(victims)
        }

        pub fn unreserve(&mut self, bytes: u64, t: TenantRow) {
            self.reserved = self.reserved.saturating_sub(bytes);
            let r = &mut self.reserved_by_row[t as usize];
            *r = r.saturating_sub(bytes);
        }

        pub fn shrink_to_fit(&mut self) -> Vec<u128> {
            let mut victims = Vec::new();
            for t in 0..self.limits.len() {
                let tr = t as TenantRow;
                while let Some(limit) = self.limits[t] {
                    if self.row_bytes(tr) + self.reserved_by_row[t] <= limit {
                        break;
                    }
                    let Some(k) = self.oldest(None, true, |e| e.tenant == tr) else { break };
                    let e = self.remove(k).unwrap();
                    self.evictions[e.tenant as usize] += 1;
                    victims.push(k);
                }
            }
            while self.used() + self.reserved > self.capacity {
                let Some(k) = self.oldest(None, true, |_| true) else { break };
                let e = self.remove(k).unwrap();
                self.evictions[e.tenant as usize] += 1;
                victims.push(k);
            }
            victims
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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

    /// One step of the property test (keys, parents and pages small, so
    /// that chains, cycles, replacements and full disks all happen).
    #[derive(Clone, Debug)]
    enum Op {
        Insert { key: u8, parent: Option<u8>, pages: u8, tenant: usize },
        Remove(u8),
        Touch(u8),
        MakeRoom { pages: u8, protect: Option<u8>, tenant: usize, keep: bool },
        Unreserve,
        Shrink { capacity_pages: u8 },
    }

    fn op() -> impl Strategy<Value = Op> {
        let key = 0u8..14;
        prop_oneof![
            6 => (key.clone(), proptest::option::weighted(0.7, key.clone()), 1u8..4, 0usize..4)
                .prop_map(|(key, parent, pages, tenant)| Op::Insert { key, parent, pages, tenant }),
            1 => key.clone().prop_map(Op::Remove),
            2 => key.clone().prop_map(Op::Touch),
            3 => (1u8..6, proptest::option::of(key), 0usize..4, any::<bool>())
                .prop_map(|(pages, protect, tenant, keep)| Op::MakeRoom { pages, protect, tenant, keep }),
            1 => Just(Op::Unreserve),
            1 => (2u8..20).prop_map(|capacity_pages| Op::Shrink { capacity_pages }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

        /// The index evicts what the model does, in the same order, and
        /// counts what it counts, over any sequence of operations.
        #[test]
        fn the_index_does_what_the_plain_model_does(
            capacity_pages in 4u64..24,
            la in 2u64..10,
            lb in 2u64..10,
            default_limit in proptest::option::weighted(0.3, 3u64..12),
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            const B: u64 = 4096;
            let mut ix = Index::new(capacity_pages * B, &limits(&[("a", la * B), ("b", lb * B)], default_limit.map(|l| l * B)));
            let rows = [DEFAULT_ROW, ix.tenant("a"), ix.tenant("b"), ix.tenant("c")];
            let mut row_limits = vec![default_limit.map(|l| l * B); MAX_TENANTS];
            row_limits[rows[1] as usize] = Some(la * B);
            row_limits[rows[2] as usize] = Some(lb * B);
            let mut m = model::Model::new(capacity_pages * B, row_limits);
            let mut held: Vec<(u64, TenantRow)> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert { key, parent, pages, tenant } => {
                        let (p, b, t) = (parent.map(u128::from), u64::from(pages) * B, rows[tenant]);
                        ix.insert(key.into(), p, b, t);
                        m.insert(key.into(), p, b, t);
                    }
                    Op::Remove(k) => prop_assert_eq!(ix.remove(k.into()), m.remove(k.into())),
                    Op::Touch(k) => {
                        ix.touch(k.into());
                        m.touch(k.into());
                    }
                    Op::MakeRoom { pages, protect, tenant, keep } => {
                        let (b, p, t) = (u64::from(pages) * B, protect.map(u128::from), rows[tenant]);
                        let got = ix.make_room(b, p, t).map(|v| v.iter().map(|v| v.0).collect::<Vec<_>>());
                        prop_assert_eq!(&got, &m.make_room(b, p, t));
                        if got.is_ok() {
                            if keep {
                                held.push((b, t));
                            } else {
                                ix.unreserve(b, t);
                                m.unreserve(b, t);
                            }
                        }
                    }
                    Op::Unreserve => {
                        if let Some((b, t)) = held.pop() {
                            ix.unreserve(b, t);
                            m.unreserve(b, t);
                        }
                    }
                    Op::Shrink { capacity_pages } => {
                        ix.capacity = u64::from(capacity_pages) * B;
                        m.capacity = ix.capacity;
                        let got: Vec<u128> = ix.shrink_to_fit().iter().map(|v| v.0).collect();
                        prop_assert_eq!(got, m.shrink_to_fit());
                    }
                }
                ix.check();
                prop_assert_eq!(ix.blocks(), m.entries.len() as u64);
                prop_assert_eq!(ix.used(), m.used());
                for &(k, e) in &m.entries {
                    prop_assert_eq!(ix.get(k), Some(e));
                }
                for &t in &rows {
                    let f = &ix.rows[t as usize].figures;
                    let u = t as usize;
                    prop_assert_eq!(
                        (f.bytes, f.evictions, f.limit_refusals, ix.rows[u].reserved),
                        (m.row_bytes(t), m.evictions[u], m.refusals[u], m.reserved_by_row[u])
                    );
                }
            }
        }
    }

    #[test]
    fn chain_after_follows_the_child_used_last_within_its_bounds() {
        let mut ix = Index::new(u64::MAX, &Limits::default());
        // 1 <- 2 <- 3 <- 4, and a branch 2 <- 5 written last.
        ix.insert(1, None, 4096, 0);
        ix.insert(2, Some(1), 4096, 0);
        ix.insert(3, Some(2), 8192, 0);
        ix.insert(4, Some(3), 4096, 0);
        ix.insert(5, Some(2), 4096, 0);
        let keys = |v: Vec<(u128, u64)>| v.into_iter().map(|e| e.0).collect::<Vec<_>>();
        assert_eq!(keys(ix.chain_after(1, 8, u64::MAX)), vec![2, 5], "the child written last");
        // A fill of 3 makes it 2's child used last.
        ix.touch(3);
        assert_eq!(ix.chain_after(1, 8, u64::MAX), vec![(2, 4096), (3, 8192), (4, 4096)]);
        assert_eq!(keys(ix.chain_after(1, 2, u64::MAX)), vec![2, 3], "at most two blocks");
        assert_eq!(keys(ix.chain_after(1, 8, 12288)), vec![2, 3], "at most 12 KiB");
        assert_eq!(keys(ix.chain_after(1, 8, 1)), vec![2], "the first one always");
        // A removed child's hint says nothing; a phantom parent still names its child.
        ix.remove(3);
        assert!(ix.chain_after(2, 8, u64::MAX).is_empty());
        ix.remove(1);
        assert_eq!(keys(ix.chain_after(1, 8, u64::MAX)), vec![2]);
        assert!(ix.chain_after(99, 8, u64::MAX).is_empty());
        // A cycle ends the walk.
        ix.insert(10, Some(11), 4096, 0);
        ix.insert(11, Some(10), 4096, 0);
        assert_eq!(keys(ix.chain_after(10, 8, u64::MAX)), vec![11]);
        ix.check();
    }

    #[test]
    fn heap_bytes_per_block_of_a_million_blocks_in_chains_is_at_most_64() {
        const N: u64 = 1_000_000;
        let mut ix = Index::new(u64::MAX, &Limits::default());
        ix.reserve(N as usize);
        for k in 0..N {
            // Chains of 16, as a rebuild finds them.
            ix.insert(k.into(), (!k.is_multiple_of(16)).then(|| (k - 1).into()), 8192, DEFAULT_ROW);
        }
        let per_block = ix.heap_bytes() as f64 / N as f64;
        assert!(per_block <= 64.0, "{per_block:.1} bytes per block");
        // Grown one insert at a time (no reserve), it stays within the goal too.
        let mut ix = Index::new(u64::MAX, &Limits::default());
        for k in 0..N {
            ix.insert(k.into(), None, 8192, DEFAULT_ROW);
        }
        let per_block = ix.heap_bytes() as f64 / N as f64;
        assert!(per_block <= 64.0, "{per_block:.1} bytes per block grown");
    }
}
