//! `Store`: the block index of the daemon — 128-bit keys to committed blocks
//! in the megaslab, two-phase writes, per-session pins, LRU eviction.
//!
//! Pure logic: no shared memory, sockets or threads. The serve loop decodes a
//! frame into a [`Request`], calls [`Store::handle`] with the session of the
//! channel it came from, and encodes the [`Completion`]. [`Store::handle`]
//! never panics: a request it cannot honour gets an error status.
//!
//! # Objects
//!
//! * A **reservation** (RESERVE) owns an extent and belongs to one session. It is
//!   invisible to GET/LOOKUP/DELETE until that session COMMITs it; ABORT or the
//!   session closing frees it. Reservations are never evicted.
//! * A **block** is a committed reservation. It is *linked* while it is the
//!   block of its key. DELETE, or a COMMIT of a newer block of the same key,
//!   unlinks it: it is freed at once when unpinned, else when its last pin goes.
//! * A **pin** (GET) keeps a block's extent from being evicted, moved or reused.
//!   A session holds one pin record per block it pinned, with a count: every
//!   GET of that block by that session returns the *same* handle and adds one,
//!   every RELEASE of it drops one. Different sessions pinning the same block
//!   get different handles.
//!
//! # Handles
//!
//! A handle is `kind << 62 | generation << 32 | index` (2-bit kind, 30-bit
//! generation, 32-bit slot index). Kind 1 is a reservation (index into the
//! block slots), kind 2 a pin (index into the pin slots); 0 and 3 are never
//! issued, so the zero handle is always bad. A slot's generation is bumped every
//! time it is freed, so a stale handle (its object gone, the slot reused) no
//! longer matches; the slot also records the owning session, so a handle that
//! another session learnt is refused. Either way the answer is `BAD_HANDLE`. The
//! generation wraps after 2^30 reuses of one slot; a handle kept that long
//! could then alias a new object of the same session.
//!
//! # Eviction
//!
//! When a RESERVE does not fit in any free extent, linked unpinned blocks are
//! evicted in least-recently-used order, one at a time (each freed extent
//! coalesces with its neighbours), until the reservation fits. "Used" means
//! committed, found by GET or LOOKUP, or released by its last pin. Pinned
//! blocks, unlinked-but-pinned blocks and reservations are not in the LRU
//! list, so they are never evicted. If even freeing every evictable block could
//! not give enough bytes (`free + evictable < needed`) the answer is
//! `OUT_OF_MEMORY` and **nothing is evicted**. Otherwise eviction proceeds; if
//! fragmentation by pinned blocks or reservations still leaves no large enough
//! extent once the LRU list is empty, the answer is `OUT_OF_MEMORY` and the
//! blocks evicted on the way stay evicted (they were the least recently used).
//!
//! # Cost
//!
//! Every request is `O(log n)` (B-tree indexes for free extents, the LRU list
//! and per-session records; a hash map for keys), except a RESERVE that evicts,
//! which is `O(log n)` per block evicted. `close_session` is `O(p log n)` in the
//! session's pins and reservations.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kachedb_shm::{Completion, DType, Op, Request, Shape, Status};

use crate::alloc::{round_up_to_pages, Extent, ExtentAllocator, PAGE_LEN};

/// Identifies a client session (one per control-socket connection). Ids are
/// never reused within one [`Store`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(u64);

impl SessionId {
    /// The id as a number (for logs and stats).
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// A committed block as [`Store::peek`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Key.
    pub key: u128,
    /// Element type.
    pub dtype: DType,
    /// Dims.
    pub shape: Shape,
    /// Tensor bytes.
    pub len: u64,
    /// Start of the tensor bytes, bytes from the region base.
    pub data_offset: u64,
    /// The page extent holding it.
    pub extent: Extent,
    /// Pins held on it, all sessions together.
    pub pins: u64,
}

/// Counters and gauges of a [`Store`]; `kachedb stats --json` prints them.
#[derive(serde::Serialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Open sessions.
    pub sessions: u64,
    /// Committed blocks linked under their key (what GET can find).
    pub blocks: u64,
    /// Deleted or replaced blocks still held by pins.
    pub unlinked_blocks: u64,
    /// Live reservations (not yet committed or aborted).
    pub reserved: u64,
    /// Pins held, all sessions and blocks together.
    pub pins: u64,
    /// Bytes in allocated extents (blocks, unlinked blocks, reservations).
    pub bytes_used: u64,
    /// Bytes in free extents.
    pub bytes_free: u64,
    /// Bytes of the megaslab under management.
    pub bytes_total: u64,
    /// Largest free extent, bytes.
    pub largest_free_bytes: u64,
    /// Bytes held by linked unpinned blocks (what eviction could free).
    pub evictable_bytes: u64,
    /// Free extents (a fragmentation measure).
    pub free_extents: u64,
    /// Blocks evicted since start.
    pub evictions: u64,
    /// Extent bytes freed by eviction since start.
    pub evicted_bytes: u64,
    /// Committed blocks that replaced an older block of the same key.
    pub replaced: u64,
    /// PING requests.
    pub pings: u64,
    /// RESERVE requests (any outcome).
    pub reserves: u64,
    /// COMMIT requests (any outcome).
    pub commits: u64,
    /// ABORT requests (any outcome).
    pub aborts: u64,
    /// GET requests (any outcome).
    pub gets: u64,
    /// GET requests that found their key.
    pub get_hits: u64,
    /// RELEASE requests (any outcome).
    pub releases: u64,
    /// LOOKUP requests (any outcome).
    pub lookups: u64,
    /// LOOKUP requests that found their key.
    pub lookup_hits: u64,
    /// DELETE requests (any outcome).
    pub deletes: u64,
    /// DELETE requests that found their key.
    pub delete_hits: u64,
    /// STATS requests.
    pub stats_requests: u64,
    /// Completions with status `NOT_FOUND`.
    pub not_found: u64,
    /// Completions with status `OUT_OF_MEMORY`.
    pub out_of_memory: u64,
    /// Completions with status `INVALID`.
    pub invalid: u64,
    /// Completions with status `BAD_HANDLE`.
    pub bad_handle: u64,
    /// Completions with status `TOO_LARGE`.
    pub too_large: u64,
    /// Completions with status `INTERNAL`, plus internal errors met while
    /// closing sessions (each one is a bug).
    pub internal: u64,
}

/// Handle kinds; the top two bits of a handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HandleKind {
    Reservation = 1,
    Pin = 2,
}

const GEN_BITS: u32 = 30;
const GEN_MASK: u32 = (1 << GEN_BITS) - 1;
/// Slot indexes are `u32`; at most this many slots of each table.
const MAX_SLOTS: usize = u32::MAX as usize;
/// RESERVE page offsets are multiples of this (`docs/PROTOCOL.md`).
const PAGE_OFFSET_ALIGN: u64 = 64;
const _: () = assert!(PAGE_OFFSET_ALIGN.is_power_of_two());

fn encode_handle(kind: HandleKind, index: u32, generation: u32) -> u64 {
    ((kind as u64) << 62) | (u64::from(generation & GEN_MASK) << 32) | u64::from(index)
}

fn decode_handle(handle: u64) -> Option<(HandleKind, u32, u32)> {
    let kind = match handle >> 62 {
        1 => HandleKind::Reservation,
        2 => HandleKind::Pin,
        _ => return None,
    };
    Some((kind, handle as u32, (handle >> 32) as u32 & GEN_MASK))
}

fn next_generation(generation: u32) -> u32 {
    generation.wrapping_add(1) & GEN_MASK
}

/// What a reservation or block holds.
#[derive(Clone, Copy, Debug)]
struct Tensor {
    key: u128,
    dtype: DType,
    shape: Shape,
    /// Tensor bytes.
    len: u64,
    /// Start of the tensor bytes, bytes from the region base; inside `extent`,
    /// less than one page past its start.
    data_offset: u64,
    extent: Extent,
}

#[derive(Clone, Debug)]
enum SlotState {
    Free,
    Reserved {
        owner: SessionId,
        tensor: Tensor,
    },
    Block {
        tensor: Tensor,
        /// The block of its key in `keys`.
        linked: bool,
        /// Pins, all sessions together.
        pins: u64,
        /// Its key in `lru`; `Some` exactly when linked and unpinned.
        lru_tick: Option<u64>,
    },
}

#[derive(Clone, Debug)]
struct Slot {
    /// Bumped each time the slot is freed.
    generation: u32,
    state: SlotState,
}

#[derive(Clone, Copy, Debug)]
struct Pin {
    session: SessionId,
    block_index: u32,
    /// GETs not yet released; > 0.
    count: u64,
}

#[derive(Clone, Debug)]
struct PinSlot {
    /// Bumped each time the slot is freed.
    generation: u32,
    pin: Option<Pin>,
}

#[derive(Clone, Debug, Default)]
struct Session {
    /// block slot index -> pin slot index.
    pins: BTreeMap<u32, u32>,
    /// Block slot indexes of this session's reservations.
    reservations: BTreeSet<u32>,
}

/// What a successful request answers besides `OK`.
#[derive(Clone, Copy, Debug, Default)]
struct Reply {
    handle: u64,
    offset: u64,
    tensor: Option<(DType, Shape, u64)>,
}

/// The block store. See the [module docs](self) for the semantics.
#[derive(Clone, Debug)]
pub struct Store {
    alloc: ExtentAllocator,
    /// Megaslab bytes as given to `new` (before rounding to pages).
    slab_len: u64,
    /// Reservations and blocks; freed slots are reused.
    slots: Vec<Slot>,
    /// Indexes of `Free` slots.
    free_slots: Vec<u32>,
    pin_slots: Vec<PinSlot>,
    /// Indexes of empty pin slots.
    free_pin_slots: Vec<u32>,
    /// Linked blocks: key -> slot index.
    keys: HashMap<u128, u32>,
    /// Linked unpinned blocks: last-use tick -> slot index; first = least recent.
    lru: BTreeMap<u64, u32>,
    /// Last tick handed out; each use takes a fresh one.
    tick: u64,
    /// Sum of the extent lengths of the blocks in `lru`, bytes.
    evictable_bytes: u64,
    sessions: BTreeMap<SessionId, Session>,
    next_session: u64,
    /// Counter fields only; gauges are filled in by `stats`.
    counters: StoreStats,
}

impl Store {
    /// A store for the megaslab `[slab_offset, slab_offset + slab_len)`
    /// (bytes from the region base; `slab_offset` page aligned, `slab_len`
    /// used in whole pages).
    pub fn new(slab_offset: u64, slab_len: u64) -> Store {
        Store {
            alloc: ExtentAllocator::new(slab_offset, slab_len),
            slab_len,
            slots: Vec::new(),
            free_slots: Vec::new(),
            pin_slots: Vec::new(),
            free_pin_slots: Vec::new(),
            keys: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            evictable_bytes: 0,
            sessions: BTreeMap::new(),
            next_session: 1,
            counters: StoreStats::default(),
        }
    }

    /// Opens a session; requests are made on behalf of one.
    pub fn open_session(&mut self) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session = self.next_session.wrapping_add(1);
        self.sessions.insert(id, Session::default());
        id
    }

    /// Whether `s` is open.
    pub fn is_open(&self, s: SessionId) -> bool {
        self.sessions.contains_key(&s)
    }

    /// Closes `s`: drops all its pins and aborts all its reservations at once
    /// (the client is gone). Blocks left unpinned become evictable again, or are
    /// freed if they were deleted or replaced meanwhile. Closing an unknown or
    /// closed session does nothing.
    pub fn close_session(&mut self, s: SessionId) {
        let Some(session) = self.sessions.remove(&s) else {
            return;
        };
        for (&block_index, &pin_index) in &session.pins {
            let r = self.take_pin_slot(pin_index).and_then(|count| self.drop_block_pins(block_index, count));
            if r.is_err() {
                self.counters.internal += 1;
            }
        }
        for &index in &session.reservations {
            if self.free_reservation(index).is_err() {
                self.counters.internal += 1;
            }
        }
    }

    /// Answers one request of session `s`. Never panics. A request of a session
    /// that is not open gets `INTERNAL` (the serve loop must not do that).
    pub fn handle(&mut self, s: SessionId, request_id: u32, req: &Request) -> Completion {
        let op = self.count_request(req);
        let result = if self.sessions.contains_key(&s) {
            match *req {
                Request::Ping => Ok(Reply::default()),
                Request::Reserve { key, dtype, shape, len, page_offset } => {
                    self.reserve(s, key, dtype, shape, len, page_offset)
                }
                Request::Commit { handle } => self.commit(s, handle),
                Request::Abort { handle } => self.abort(s, handle),
                Request::Get { key } => self.get(s, key),
                Request::Release { handle } => self.release(s, handle),
                Request::Lookup { key } => self.lookup(key),
                Request::Delete { key } => self.delete(key),
                Request::Stats => {
                    Ok(Reply { handle: self.keys.len() as u64, offset: self.alloc.used_bytes(), tensor: None })
                }
            }
        } else {
            Err(Status::Internal)
        };
        match result {
            Ok(reply) => {
                match op {
                    Op::Get => self.counters.get_hits += 1,
                    Op::Lookup => self.counters.lookup_hits += 1,
                    Op::Delete => self.counters.delete_hits += 1,
                    _ => {}
                }
                Completion {
                    request_id,
                    op,
                    status: Status::Ok,
                    handle: reply.handle,
                    offset: reply.offset,
                    tensor: reply.tensor,
                }
            }
            Err(status) => {
                let c = &mut self.counters;
                match status {
                    Status::Ok => {}
                    Status::NotFound => c.not_found += 1,
                    Status::OutOfMemory => c.out_of_memory += 1,
                    Status::Invalid => c.invalid += 1,
                    Status::BadHandle => c.bad_handle += 1,
                    Status::TooLarge => c.too_large += 1,
                    Status::Internal => c.internal += 1,
                }
                Completion { request_id, op, status, handle: 0, offset: 0, tensor: None }
            }
        }
    }

    /// The committed block of `key`, without marking it used.
    pub fn peek(&self, key: u128) -> Option<BlockInfo> {
        let &index = self.keys.get(&key)?;
        match &self.slots.get(index as usize)?.state {
            SlotState::Block { tensor: t, pins, .. } => Some(BlockInfo {
                key: t.key,
                dtype: t.dtype,
                shape: t.shape,
                len: t.len,
                data_offset: t.data_offset,
                extent: t.extent,
                pins: *pins,
            }),
            _ => None,
        }
    }

    /// Counters and gauges.
    pub fn stats(&self) -> StoreStats {
        let mut st = self.counters.clone();
        st.sessions = self.sessions.len() as u64;
        st.blocks = self.keys.len() as u64;
        st.unlinked_blocks = 0;
        st.reserved = 0;
        for slot in &self.slots {
            match slot.state {
                SlotState::Reserved { .. } => st.reserved += 1,
                SlotState::Block { linked: false, .. } => st.unlinked_blocks += 1,
                _ => {}
            }
        }
        st.pins = self.pin_slots.iter().filter_map(|p| p.pin).map(|p| p.count).sum();
        st.bytes_used = self.alloc.used_bytes();
        st.bytes_free = self.alloc.free_bytes();
        st.bytes_total = self.alloc.total_bytes();
        st.largest_free_bytes = self.alloc.largest_free();
        st.evictable_bytes = self.evictable_bytes;
        st.free_extents = self.alloc.free_extent_count() as u64;
        st
    }

    fn count_request(&mut self, req: &Request) -> Op {
        let c = &mut self.counters;
        match req {
            Request::Ping => {
                c.pings += 1;
                Op::Ping
            }
            Request::Reserve { .. } => {
                c.reserves += 1;
                Op::Reserve
            }
            Request::Commit { .. } => {
                c.commits += 1;
                Op::Commit
            }
            Request::Abort { .. } => {
                c.aborts += 1;
                Op::Abort
            }
            Request::Get { .. } => {
                c.gets += 1;
                Op::Get
            }
            Request::Release { .. } => {
                c.releases += 1;
                Op::Release
            }
            Request::Lookup { .. } => {
                c.lookups += 1;
                Op::Lookup
            }
            Request::Delete { .. } => {
                c.deletes += 1;
                Op::Delete
            }
            Request::Stats => {
                c.stats_requests += 1;
                Op::Stats
            }
        }
    }

    // ---- operations -------------------------------------------------------

    fn reserve(
        &mut self,
        s: SessionId,
        key: u128,
        dtype: DType,
        shape: Shape,
        len: u64,
        page_offset: u64,
    ) -> Result<Reply, Status> {
        // `Request::decode` guarantees these; a hand-built request may not.
        if page_offset >= PAGE_LEN || page_offset & (PAGE_OFFSET_ALIGN - 1) != 0 {
            return Err(Status::Invalid);
        }
        if shape.len_bytes(dtype) != Some(len) {
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
        let extent = self.alloc_evicting(need_len)?;
        let tensor = Tensor { key, dtype, shape, len, data_offset: extent.offset + page_offset, extent };
        let Some(index) = self.take_slot(SlotState::Reserved { owner: s, tensor }) else {
            // Unreachable after the check above; give the extent back.
            let _ = self.alloc.try_free(extent);
            return Err(Status::Internal);
        };
        let generation = self.slots.get(index as usize).map(|slot| slot.generation).ok_or(Status::Internal)?;
        self.sessions.get_mut(&s).ok_or(Status::Internal)?.reservations.insert(index);
        Ok(Reply {
            handle: encode_handle(HandleKind::Reservation, index, generation),
            offset: tensor.data_offset,
            tensor: None,
        })
    }

    /// The slot index of `s`'s live reservation named by `handle`.
    fn own_reservation(&self, s: SessionId, handle: u64) -> Result<u32, Status> {
        let (kind, index, generation) = decode_handle(handle).ok_or(Status::BadHandle)?;
        if kind != HandleKind::Reservation {
            return Err(Status::BadHandle);
        }
        let slot = self.slots.get(index as usize).ok_or(Status::BadHandle)?;
        match slot.state {
            SlotState::Reserved { owner, .. } if owner == s && slot.generation == generation => Ok(index),
            _ => Err(Status::BadHandle),
        }
    }

    fn commit(&mut self, s: SessionId, handle: u64) -> Result<Reply, Status> {
        let index = self.own_reservation(s, handle)?;
        let slot = self.slots.get_mut(index as usize).ok_or(Status::Internal)?;
        let SlotState::Reserved { tensor, .. } = slot.state else {
            return Err(Status::Internal);
        };
        slot.state = SlotState::Block { tensor, linked: true, pins: 0, lru_tick: None };
        if let Some(session) = self.sessions.get_mut(&s) {
            session.reservations.remove(&index);
        }
        if let Some(old) = self.keys.insert(tensor.key, index) {
            self.counters.replaced += 1;
            self.unlink(old)?;
        }
        self.lru_touch(index)?;
        Ok(Reply::default())
    }

    fn abort(&mut self, s: SessionId, handle: u64) -> Result<Reply, Status> {
        let index = self.own_reservation(s, handle)?;
        if let Some(session) = self.sessions.get_mut(&s) {
            session.reservations.remove(&index);
        }
        self.free_reservation(index)?;
        Ok(Reply::default())
    }

    fn get(&mut self, s: SessionId, key: u128) -> Result<Reply, Status> {
        let &index = self.keys.get(&key).ok_or(Status::NotFound)?;
        let tensor = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { tensor, linked: true, .. }) => *tensor,
            _ => return Err(Status::Internal),
        };
        let existing = self.sessions.get(&s).ok_or(Status::Internal)?.pins.get(&index).copied();
        let pin_index = match existing {
            Some(p) => {
                let pin = self.pin_slots.get_mut(p as usize).and_then(|ps| ps.pin.as_mut()).ok_or(Status::Internal)?;
                pin.count += 1;
                p
            }
            None => {
                let p = self
                    .take_pin_slot_for(Pin { session: s, block_index: index, count: 1 })
                    .ok_or(Status::OutOfMemory)?;
                self.sessions.get_mut(&s).ok_or(Status::Internal)?.pins.insert(index, p);
                p
            }
        };
        let generation = self.pin_slots.get(pin_index as usize).ok_or(Status::Internal)?.generation;
        let first_pin = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { pins, .. }) => {
                *pins += 1;
                *pins == 1
            }
            _ => return Err(Status::Internal),
        };
        if first_pin {
            self.lru_remove(index)?;
        }
        Ok(Reply {
            handle: encode_handle(HandleKind::Pin, pin_index, generation),
            offset: tensor.data_offset,
            tensor: Some((tensor.dtype, tensor.shape, tensor.len)),
        })
    }

    fn release(&mut self, s: SessionId, handle: u64) -> Result<Reply, Status> {
        let (kind, pin_index, generation) = decode_handle(handle).ok_or(Status::BadHandle)?;
        if kind != HandleKind::Pin {
            return Err(Status::BadHandle);
        }
        let ps = self.pin_slots.get_mut(pin_index as usize).ok_or(Status::BadHandle)?;
        let pin = match ps.pin.as_mut() {
            Some(pin) if pin.session == s && ps.generation == generation => pin,
            _ => return Err(Status::BadHandle),
        };
        let block_index = pin.block_index;
        pin.count = pin.count.saturating_sub(1);
        if pin.count == 0 {
            self.take_pin_slot(pin_index)?;
            if let Some(session) = self.sessions.get_mut(&s) {
                session.pins.remove(&block_index);
            }
        }
        self.drop_block_pins(block_index, 1)?;
        Ok(Reply::default())
    }

    fn lookup(&mut self, key: u128) -> Result<Reply, Status> {
        let &index = self.keys.get(&key).ok_or(Status::NotFound)?;
        self.lru_touch(index)?;
        Ok(Reply::default())
    }

    fn delete(&mut self, key: u128) -> Result<Reply, Status> {
        let &index = self.keys.get(&key).ok_or(Status::NotFound)?;
        self.unlink(index)?;
        Ok(Reply::default())
    }

    // ---- helpers ------------------------------------------------------------

    /// An extent of `need_len` bytes (a page multiple), evicting LRU blocks
    /// if needed (see the module docs).
    fn alloc_evicting(&mut self, need_len: u64) -> Result<Extent, Status> {
        if let Some(e) = self.alloc.alloc(need_len) {
            return Ok(e);
        }
        if self.alloc.free_bytes().saturating_add(self.evictable_bytes) < need_len {
            return Err(Status::OutOfMemory);
        }
        loop {
            let Some((&tick, &index)) = self.lru.first_key_value() else {
                return Err(Status::OutOfMemory);
            };
            let extent_len = match self.slots.get(index as usize).map(|slot| &slot.state) {
                Some(SlotState::Block { tensor, .. }) => tensor.extent.len,
                _ => return Err(Status::Internal),
            };
            self.unlink(index)?;
            if self.lru.contains_key(&tick) {
                // `unlink` must take it off the list; never loop forever.
                return Err(Status::Internal);
            }
            self.counters.evictions += 1;
            self.counters.evicted_bytes += extent_len;
            if let Some(e) = self.alloc.alloc(need_len) {
                return Ok(e);
            }
        }
    }

    /// Puts `state` in a free slot (reusing one if any); `None` when the table is full.
    fn take_slot(&mut self, state: SlotState) -> Option<u32> {
        if let Some(index) = self.free_slots.pop() {
            match self.slots.get_mut(index as usize) {
                Some(slot) => {
                    slot.state = state;
                    return Some(index);
                }
                None => return None,
            }
        }
        if self.slots.len() >= MAX_SLOTS {
            return None;
        }
        let index = u32::try_from(self.slots.len()).ok()?;
        self.slots.push(Slot { generation: 0, state });
        Some(index)
    }

    /// Marks slot `index` free and bumps its generation.
    fn release_slot(&mut self, index: u32) -> Result<(), Status> {
        let slot = self.slots.get_mut(index as usize).ok_or(Status::Internal)?;
        slot.state = SlotState::Free;
        slot.generation = next_generation(slot.generation);
        self.free_slots.push(index);
        Ok(())
    }

    fn take_pin_slot_for(&mut self, pin: Pin) -> Option<u32> {
        if let Some(index) = self.free_pin_slots.pop() {
            let ps = self.pin_slots.get_mut(index as usize)?;
            ps.pin = Some(pin);
            return Some(index);
        }
        if self.pin_slots.len() >= MAX_SLOTS {
            return None;
        }
        let index = u32::try_from(self.pin_slots.len()).ok()?;
        self.pin_slots.push(PinSlot { generation: 0, pin: Some(pin) });
        Some(index)
    }

    /// Empties pin slot `index` (bumping its generation); returns the count it held.
    fn take_pin_slot(&mut self, index: u32) -> Result<u64, Status> {
        let ps = self.pin_slots.get_mut(index as usize).ok_or(Status::Internal)?;
        let pin = ps.pin.take().ok_or(Status::Internal)?;
        ps.generation = next_generation(ps.generation);
        self.free_pin_slots.push(index);
        Ok(pin.count)
    }

    /// Drops `count` pins of block `index`; at zero the block becomes
    /// evictable (linked) or is freed (unlinked).
    fn drop_block_pins(&mut self, index: u32, count: u64) -> Result<(), Status> {
        let (now_unpinned, linked) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { pins, linked, .. }) => {
                *pins = pins.checked_sub(count).ok_or(Status::Internal)?;
                (*pins == 0, *linked)
            }
            _ => return Err(Status::Internal),
        };
        if now_unpinned {
            if linked {
                self.lru_touch(index)?;
            } else {
                self.free_block(index)?;
            }
        }
        Ok(())
    }

    /// Marks linked block `index` as just used: if unpinned it moves to the
    /// most-recent end of the LRU list. Pinned blocks are not on the list.
    fn lru_touch(&mut self, index: u32) -> Result<(), Status> {
        self.tick = self.tick.wrapping_add(1);
        let tick = self.tick;
        let (old, extent_len) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, linked: true, pins: 0, lru_tick }) => {
                (lru_tick.replace(tick), tensor.extent.len)
            }
            Some(SlotState::Block { linked: true, .. }) => return Ok(()),
            _ => return Err(Status::Internal),
        };
        match old {
            Some(old) => {
                self.lru.remove(&old);
            }
            None => self.evictable_bytes += extent_len,
        }
        self.lru.insert(tick, index);
        Ok(())
    }

    /// Takes block `index` off the LRU list if it is on it.
    fn lru_remove(&mut self, index: u32) -> Result<(), Status> {
        let (old, extent_len) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, lru_tick, .. }) => (lru_tick.take(), tensor.extent.len),
            _ => return Err(Status::Internal),
        };
        if let Some(old) = old {
            self.lru.remove(&old);
            self.evictable_bytes = self.evictable_bytes.checked_sub(extent_len).ok_or(Status::Internal)?;
        }
        Ok(())
    }

    /// Unlinks block `index` from its key (if it is still the key's block) and
    /// the LRU list; frees it now if unpinned, else its last RELEASE will.
    fn unlink(&mut self, index: u32) -> Result<(), Status> {
        let (key, pins) = match self.slots.get_mut(index as usize).map(|slot| &mut slot.state) {
            Some(SlotState::Block { tensor, linked, pins, .. }) if *linked => {
                *linked = false;
                (tensor.key, *pins)
            }
            _ => return Err(Status::Internal),
        };
        if self.keys.get(&key) == Some(&index) {
            self.keys.remove(&key);
        }
        self.lru_remove(index)?;
        if pins == 0 {
            self.free_block(index)?;
        }
        Ok(())
    }

    /// Frees the extent and slot of unlinked, unpinned block `index`.
    fn free_block(&mut self, index: u32) -> Result<(), Status> {
        let extent = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Block { tensor, linked: false, pins: 0, lru_tick: None }) => tensor.extent,
            _ => return Err(Status::Internal),
        };
        self.alloc.try_free(extent).map_err(|_| Status::Internal)?;
        self.release_slot(index)
    }

    /// Frees the extent and slot of reservation `index` (the caller updates
    /// the owning session's set).
    fn free_reservation(&mut self, index: u32) -> Result<(), Status> {
        let extent = match self.slots.get(index as usize).map(|slot| &slot.state) {
            Some(SlotState::Reserved { tensor, .. }) => tensor.extent,
            _ => return Err(Status::Internal),
        };
        self.alloc.try_free(extent).map_err(|_| Status::Internal)?;
        self.release_slot(index)
    }

    // ---- invariants -----------------------------------------------------------

    /// Checks every structural invariant; `Err` names the first one broken.
    ///
    /// The allocator's own invariants; every allocated extent belongs to
    /// exactly one live reservation or block and vice versa; each tensor lies
    /// in its extent; `keys` and linked blocks agree; the LRU list holds
    /// exactly the linked unpinned blocks and `evictable_bytes` their bytes;
    /// unlinked blocks are pinned; pin counts agree between blocks, pin
    /// records and sessions; reservations agree with their sessions; free-slot
    /// lists hold exactly the free slots. `O(n log n)`.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.alloc.check_invariants()?;

        let free_slots: BTreeSet<u32> = self.free_slots.iter().copied().collect();
        if free_slots.len() != self.free_slots.len() {
            return Err("a slot is twice on the free list".into());
        }
        let mut extents: BTreeMap<u64, u64> = BTreeMap::new();
        let mut linked_count = 0usize;
        let mut lru_count = 0usize;
        let mut evictable = 0u64;
        let mut block_pins: BTreeMap<u32, u64> = BTreeMap::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let index = u32::try_from(i).map_err(|_| "slot index past u32".to_string())?;
            let on_free_list = free_slots.contains(&index);
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
                SlotState::Block { tensor, linked, pins, lru_tick } => {
                    if *linked {
                        linked_count += 1;
                        if self.keys.get(&tensor.key) != Some(&index) {
                            return Err(format!("linked block {index} is not the block of its key"));
                        }
                    } else if *pins == 0 {
                        return Err(format!("unlinked block {index} is unpinned but not freed"));
                    }
                    match (*linked && *pins == 0, lru_tick) {
                        (true, Some(tick)) => {
                            if self.lru.get(tick) != Some(&index) {
                                return Err(format!("block {index} has LRU tick {tick} but is not there"));
                            }
                            lru_count += 1;
                            evictable += tensor.extent.len;
                        }
                        (false, None) => {}
                        (should, _) => {
                            return Err(format!(
                                "block {index}: on LRU list {}, should be {should}",
                                lru_tick.is_some()
                            ));
                        }
                    }
                    block_pins.insert(index, *pins);
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
            if t.shape.len_bytes(t.dtype) != Some(t.len) {
                return Err(format!("slot {index}: len {} does not match its shape", t.len));
            }
            let need = t.len.checked_add(page_offset).and_then(round_up_to_pages);
            if need != Some(t.extent.len) {
                return Err(format!(
                    "slot {index}: extent len {} for {} bytes at page offset {page_offset}",
                    t.extent.len, t.len
                ));
            }
            if extents.insert(t.extent.offset, t.extent.len).is_some() {
                return Err(format!("extent at {} is held by two slots", t.extent.offset));
            }
        }
        if free_slots.iter().any(|&i| i as usize >= self.slots.len()) {
            return Err("free list names a slot that does not exist".into());
        }
        if !extents.iter().map(|(&o, &l)| Extent { offset: o, len: l }).eq(self.alloc.allocated_extents()) {
            return Err("allocated extents differ from the extents of live slots".into());
        }
        if linked_count != self.keys.len() {
            return Err(format!("{} keys but {linked_count} linked blocks", self.keys.len()));
        }
        if lru_count != self.lru.len() {
            return Err(format!("LRU list has {} entries, {lru_count} blocks are on it", self.lru.len()));
        }
        if evictable != self.evictable_bytes {
            return Err(format!("evictable_bytes {} but LRU blocks hold {evictable}", self.evictable_bytes));
        }

        // Pins: records agree with sessions and with block counts.
        let free_pins: BTreeSet<u32> = self.free_pin_slots.iter().copied().collect();
        if free_pins.len() != self.free_pin_slots.len() {
            return Err("a pin slot is twice on the free list".into());
        }
        let mut pin_sums: BTreeMap<u32, u64> = BTreeMap::new();
        for (i, ps) in self.pin_slots.iter().enumerate() {
            let index = u32::try_from(i).map_err(|_| "pin index past u32".to_string())?;
            match ps.pin {
                None if free_pins.contains(&index) => {}
                None => return Err(format!("empty pin slot {index} is not on the free list")),
                Some(pin) => {
                    if free_pins.contains(&index) {
                        return Err(format!("live pin slot {index} is on the free list"));
                    }
                    if pin.count == 0 {
                        return Err(format!("pin slot {index} has count 0"));
                    }
                    let listed = self.sessions.get(&pin.session).and_then(|s| s.pins.get(&pin.block_index));
                    if listed != Some(&index) {
                        return Err(format!("pin slot {index} is not listed by its session"));
                    }
                    *pin_sums.entry(pin.block_index).or_default() += pin.count;
                }
            }
        }
        if free_pins.iter().any(|&i| i as usize >= self.pin_slots.len()) {
            return Err("pin free list names a slot that does not exist".into());
        }
        for (&block, &sum) in &pin_sums {
            if block_pins.get(&block) != Some(&sum) {
                return Err(format!(
                    "block {block}: pin records sum to {sum}, block says {:?}",
                    block_pins.get(&block)
                ));
            }
        }
        for (&block, &pins) in &block_pins {
            if pins != pin_sums.get(&block).copied().unwrap_or(0) {
                return Err(format!("block {block} counts {pins} pins that no record holds"));
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
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kachedb_shm::TensorBlockDescriptor;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const SLAB_OFFSET: u64 = 2 << 20;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn reserve_req(key: u128, len: u64, page_offset: u64) -> Request {
        Request::Reserve { key, dtype: DType::U8, shape: Shape::for_bytes(len).unwrap(), len, page_offset }
    }

    struct T {
        st: Store,
        next_id: u32,
    }

    impl T {
        fn new(pages: u64) -> T {
            T { st: Store::new(SLAB_OFFSET, pages * PAGE_LEN), next_id: 0 }
        }
        fn req(&mut self, s: SessionId, req: Request) -> Completion {
            self.next_id += 1;
            let c = self.st.handle(s, self.next_id, &req);
            assert_eq!(c.request_id, self.next_id);
            self.st.check_invariants().unwrap();
            c
        }
        fn reserve(&mut self, s: SessionId, key: u128, len: u64) -> Completion {
            self.req(s, reserve_req(key, len, 0))
        }
        /// RESERVE + COMMIT, asserting both succeed; returns the data offset.
        fn put(&mut self, s: SessionId, key: u128, len: u64) -> u64 {
            let c = self.reserve(s, key, len);
            assert_eq!(c.status, Status::Ok, "reserve {key}");
            assert_eq!(self.req(s, Request::Commit { handle: c.handle }).status, Status::Ok);
            c.offset
        }
        fn get(&mut self, s: SessionId, key: u128) -> Completion {
            self.req(s, Request::Get { key })
        }
        fn status(&mut self, s: SessionId, req: Request) -> Status {
            self.req(s, req).status
        }
    }

    #[test]
    fn ping_and_stats() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        let c = t.req(s, Request::Ping);
        assert_eq!((c.op, c.status), (Op::Ping, Status::Ok));
        let c = t.req(s, Request::Stats);
        assert_eq!((c.op, c.status, c.handle, c.offset), (Op::Stats, Status::Ok, 0, 0));
        t.put(s, 1, 5000);
        let c = t.req(s, Request::Stats);
        assert_eq!((c.handle, c.offset), (1, 2 * PAGE_LEN));
        let st = t.st.stats();
        assert_eq!(st.blocks, 1);
        assert_eq!(st.bytes_used, 2 * PAGE_LEN);
        assert_eq!(st.bytes_total, 16 * PAGE_LEN);
        assert_eq!(st.bytes_free, 14 * PAGE_LEN);
        assert_eq!(st.largest_free_bytes, 14 * PAGE_LEN);
        assert_eq!(st.evictable_bytes, 2 * PAGE_LEN);
        assert_eq!(st.pings, 1);
        assert_eq!(st.stats_requests, 2);
        let json = serde_json::to_string(&st).unwrap();
        assert!(json.contains("\"largest_free_bytes\":57344"), "{json}");
    }

    #[test]
    fn reserve_commit_get_release() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        let shape = Shape::new(&[2, 3, 100]).unwrap();
        let req = Request::Reserve { key: 42, dtype: DType::F16, shape, len: 1200, page_offset: 192 };
        let r = t.req(s, req);
        assert_eq!((r.op, r.status), (Op::Reserve, Status::Ok));
        assert_eq!(r.offset % PAGE_LEN, 192);
        assert!(r.offset >= SLAB_OFFSET && r.offset + 1200 <= SLAB_OFFSET + 16 * PAGE_LEN);
        assert_ne!(r.handle, 0);
        assert_eq!(t.st.stats().reserved, 1);
        // Invisible until commit.
        assert_eq!(t.get(s, 42).status, Status::NotFound);
        assert_eq!(t.status(s, Request::Lookup { key: 42 }), Status::NotFound);
        assert_eq!(t.status(s, Request::Delete { key: 42 }), Status::NotFound);
        assert_eq!(t.req(s, Request::Stats).handle, 0);
        assert_eq!(t.st.peek(42), None);

        assert_eq!(t.status(s, Request::Commit { handle: r.handle }), Status::Ok);
        assert_eq!(t.st.stats().reserved, 0);
        assert_eq!(t.status(s, Request::Lookup { key: 42 }), Status::Ok);
        let g = t.get(s, 42);
        assert_eq!((g.op, g.status, g.offset), (Op::Get, Status::Ok, r.offset));
        assert_eq!(g.tensor, Some((DType::F16, shape, 1200)));
        assert_eq!(t.st.peek(42).unwrap().pins, 1);
        assert_eq!(t.st.stats().pins, 1);
        assert_eq!(t.st.stats().evictable_bytes, 0);
        // The completion survives the wire.
        assert_eq!(Completion::decode(&g.encode()).unwrap(), g);

        let rel = t.req(s, Request::Release { handle: g.handle });
        assert_eq!((rel.op, rel.status), (Op::Release, Status::Ok));
        assert_eq!(t.st.stats().pins, 0);
        assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::BadHandle);
        assert_eq!(t.st.stats().get_hits, 1);
        assert_eq!(t.st.stats().gets, 2);
    }

    #[test]
    fn zero_length_tensor_takes_one_page() {
        let mut t = T::new(4);
        let s = t.st.open_session();
        let shape = Shape::new(&[0, 8]).unwrap();
        let r = t.req(s, Request::Reserve { key: 1, dtype: DType::F32, shape, len: 0, page_offset: 0 });
        assert_eq!(r.status, Status::Ok);
        assert_eq!(t.st.stats().bytes_used, PAGE_LEN);
        assert_eq!(t.status(s, Request::Commit { handle: r.handle }), Status::Ok);
        assert_eq!(t.get(s, 1).tensor, Some((DType::F32, shape, 0)));
    }

    #[test]
    fn too_large() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        assert_eq!(t.reserve(s, 1, 16 * PAGE_LEN + 1).status, Status::TooLarge);
        // Fits exactly without a page offset, not with one.
        assert_eq!(t.status(s, reserve_req(1, 16 * PAGE_LEN, 64)), Status::TooLarge);
        let c = t.reserve(s, 1, 16 * PAGE_LEN);
        assert_eq!(c.status, Status::Ok);
        assert_eq!(t.status(s, Request::Abort { handle: c.handle }), Status::Ok);
        // len + page_offset overflows u64.
        let shape = Shape::new(&[64, (1 << 29) - 1, (1 << 29) + 1]).unwrap();
        let len = shape.len_bytes(DType::U8).unwrap();
        assert_eq!(len, u64::MAX - 63);
        let req = Request::Reserve { key: 1, dtype: DType::U8, shape, len, page_offset: 128 };
        assert_eq!(t.status(s, req), Status::TooLarge);
        // A slab that is not a page multiple: the last partial page is unusable.
        let mut st = Store::new(SLAB_OFFSET, 2 * PAGE_LEN + 100);
        let s2 = st.open_session();
        assert_eq!(st.handle(s2, 1, &reserve_req(1, 2 * PAGE_LEN + 50, 0)).status, Status::TooLarge);
        assert_eq!(st.stats().too_large, 1);
        assert_eq!(t.st.stats().too_large, 3);
    }

    #[test]
    fn invalid_hand_built_reserves() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        assert_eq!(t.status(s, reserve_req(1, 10, 4096)), Status::Invalid);
        assert_eq!(t.status(s, reserve_req(1, 10, 65)), Status::Invalid);
        assert_eq!(t.status(s, reserve_req(1, 10, u64::MAX)), Status::Invalid);
        // len disagrees with the shape.
        let req =
            Request::Reserve { key: 1, dtype: DType::F32, shape: Shape::new(&[4]).unwrap(), len: 4, page_offset: 0 };
        assert_eq!(t.status(s, req), Status::Invalid);
        assert_eq!(t.st.stats().invalid, 4);
        assert_eq!(t.st.stats().bytes_used, 0);
    }

    #[test]
    fn two_gib_block_in_three_gib_slab() {
        let mut st = Store::new(SLAB_OFFSET, 3 * GIB);
        let s = st.open_session();
        let c = st.handle(s, 1, &reserve_req(1, 2 * GIB, 0));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(st.handle(s, 2, &Request::Commit { handle: c.handle }).status, Status::Ok);
        let g = st.handle(s, 3, &Request::Get { key: 1 });
        assert_eq!(g.tensor.unwrap().2, 2 * GIB);
        st.check_invariants().unwrap();
    }

    #[test]
    fn commit_and_abort_check_ownership_and_staleness() {
        let mut t = T::new(16);
        let a = t.st.open_session();
        let b = t.st.open_session();
        let r = t.reserve(a, 1, 100);
        // Other session, forged values, a pin handle used as a reservation.
        assert_eq!(t.status(b, Request::Commit { handle: r.handle }), Status::BadHandle);
        assert_eq!(t.status(b, Request::Abort { handle: r.handle }), Status::BadHandle);
        for forged in [0, 1, u64::MAX, r.handle ^ 1, r.handle ^ (1 << 32), r.handle ^ (3 << 62)] {
            assert_eq!(t.status(a, Request::Commit { handle: forged }), Status::BadHandle, "{forged:#x}");
            assert_eq!(t.status(a, Request::Abort { handle: forged }), Status::BadHandle, "{forged:#x}");
        }
        assert_eq!(t.status(a, Request::Commit { handle: r.handle }), Status::Ok);
        // Committed: the reservation handle is spent.
        assert_eq!(t.status(a, Request::Commit { handle: r.handle }), Status::BadHandle);
        assert_eq!(t.status(a, Request::Abort { handle: r.handle }), Status::BadHandle);
        let g = t.get(a, 1);
        assert_eq!(t.status(a, Request::Commit { handle: g.handle }), Status::BadHandle);
        assert_eq!(t.status(a, Request::Abort { handle: g.handle }), Status::BadHandle);
        // A reservation handle is not a pin handle.
        let r2 = t.reserve(a, 2, 100);
        assert_eq!(t.status(a, Request::Release { handle: r2.handle }), Status::BadHandle);
        assert_eq!(t.status(a, Request::Abort { handle: r2.handle }), Status::Ok);
        assert_eq!(t.status(a, Request::Abort { handle: r2.handle }), Status::BadHandle);
        assert_eq!(t.st.stats().bad_handle, 20);
    }

    #[test]
    fn stale_handle_after_slot_reuse() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        let r1 = t.reserve(s, 1, 100);
        assert_eq!(t.status(s, Request::Abort { handle: r1.handle }), Status::Ok);
        let r2 = t.reserve(s, 1, 100);
        // Same slot and same extent, new generation.
        assert_eq!(r1.handle as u32, r2.handle as u32);
        assert_eq!(r1.offset, r2.offset);
        assert_ne!(r1.handle, r2.handle);
        assert_eq!(t.status(s, Request::Commit { handle: r1.handle }), Status::BadHandle);
        assert_eq!(t.status(s, Request::Commit { handle: r2.handle }), Status::Ok);
        // Pins too: release to zero, pin again, the old pin handle is stale.
        let g1 = t.get(s, 1);
        assert_eq!(t.status(s, Request::Release { handle: g1.handle }), Status::Ok);
        let g2 = t.get(s, 1);
        assert_ne!(g1.handle, g2.handle);
        assert_eq!(t.status(s, Request::Release { handle: g1.handle }), Status::BadHandle);
        assert_eq!(t.status(s, Request::Release { handle: g2.handle }), Status::Ok);
    }

    #[test]
    fn abort_frees_the_extent() {
        let mut t = T::new(4);
        let s = t.st.open_session();
        let r = t.reserve(s, 1, 4 * PAGE_LEN);
        assert_eq!(t.st.stats().bytes_free, 0);
        assert_eq!(t.reserve(s, 2, 1).status, Status::OutOfMemory);
        let c = t.req(s, Request::Abort { handle: r.handle });
        assert_eq!((c.op, c.status), (Op::Abort, Status::Ok));
        assert_eq!(t.st.stats().bytes_free, 4 * PAGE_LEN);
        assert_eq!(t.get(s, 1).status, Status::NotFound);
    }

    #[test]
    fn pins_count_per_session_and_block() {
        let mut t = T::new(16);
        let a = t.st.open_session();
        let b = t.st.open_session();
        t.put(a, 7, 100);
        let g1 = t.get(a, 7);
        let g2 = t.get(a, 7);
        let gb = t.get(b, 7);
        // One handle per (session, block), counted; another session's differs.
        assert_eq!(g1.handle, g2.handle);
        assert_ne!(g1.handle, gb.handle);
        assert_eq!(t.st.peek(7).unwrap().pins, 3);
        // Each session may only release its own.
        assert_eq!(t.status(b, Request::Release { handle: g1.handle }), Status::BadHandle);
        assert_eq!(t.status(a, Request::Release { handle: gb.handle }), Status::BadHandle);
        assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::Ok);
        assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::Ok);
        assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::BadHandle);
        assert_eq!(t.st.peek(7).unwrap().pins, 1);
        assert_eq!(t.status(b, Request::Release { handle: gb.handle }), Status::Ok);
        assert_eq!(t.st.stats().pins, 0);
        for forged in [0, 2 << 62, (2 << 62) | 12345, u64::MAX] {
            assert_eq!(t.status(a, Request::Release { handle: forged }), Status::BadHandle);
        }
    }

    #[test]
    fn delete_unpinned_frees_at_once() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        t.put(s, 1, 3 * PAGE_LEN);
        let c = t.req(s, Request::Delete { key: 1 });
        assert_eq!((c.op, c.status), (Op::Delete, Status::Ok));
        assert_eq!(t.st.stats().bytes_used, 0);
        assert_eq!(t.status(s, Request::Delete { key: 1 }), Status::NotFound);
        assert_eq!(t.get(s, 1).status, Status::NotFound);
        let st = t.st.stats();
        assert_eq!((st.deletes, st.delete_hits, st.not_found), (2, 1, 2));
    }

    #[test]
    fn delete_pinned_frees_on_last_release() {
        let mut t = T::new(16);
        let a = t.st.open_session();
        let b = t.st.open_session();
        let data_offset = t.put(a, 1, 3 * PAGE_LEN);
        let ga = t.get(a, 1);
        let gb = t.get(b, 1);
        assert_eq!(t.status(a, Request::Delete { key: 1 }), Status::Ok);
        assert_eq!(t.get(a, 1).status, Status::NotFound);
        assert_eq!(t.status(a, Request::Lookup { key: 1 }), Status::NotFound);
        let st = t.st.stats();
        assert_eq!((st.blocks, st.unlinked_blocks, st.bytes_used), (0, 1, 3 * PAGE_LEN));
        // The extent is not reused while pinned.
        let r = t.reserve(a, 2, 13 * PAGE_LEN);
        assert_eq!(r.status, Status::Ok);
        assert!(r.offset >= data_offset + 3 * PAGE_LEN);
        assert_eq!(t.status(a, Request::Abort { handle: r.handle }), Status::Ok);
        assert_eq!(t.status(a, Request::Release { handle: ga.handle }), Status::Ok);
        assert_eq!(t.st.stats().bytes_used, 3 * PAGE_LEN);
        assert_eq!(t.status(b, Request::Release { handle: gb.handle }), Status::Ok);
        assert_eq!(t.st.stats().bytes_used, 0);
        assert_eq!(t.st.stats().unlinked_blocks, 0);
    }

    #[test]
    fn commit_replaces_an_older_block() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        let first = t.put(s, 1, 100);
        let second = t.put(s, 1, 200);
        assert_ne!(first, second);
        assert_eq!(t.st.stats().bytes_used, PAGE_LEN, "the unpinned old block is freed");
        assert_eq!(t.get(s, 1).offset, second);
        // Pinned old block: kept until released.
        let g = t.get(s, 1);
        let third = t.put(s, 1, 300);
        assert_eq!(t.st.stats().bytes_used, 2 * PAGE_LEN);
        assert_eq!(t.st.stats().replaced, 2);
        let now = t.get(s, 1);
        assert_eq!(now.offset, third);
        assert_eq!(now.tensor.unwrap().2, 300);
        // g was taken twice on the same block (handle reused), release both.
        assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
        assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
        assert_eq!(t.st.stats().bytes_used, PAGE_LEN);
        assert_eq!(t.status(s, Request::Release { handle: now.handle }), Status::Ok);
    }

    #[test]
    fn two_reservations_of_one_key_commit_in_order() {
        let mut t = T::new(16);
        let s = t.st.open_session();
        let r1 = t.reserve(s, 9, 10);
        let r2 = t.reserve(s, 9, 20);
        assert_eq!(t.status(s, Request::Commit { handle: r2.handle }), Status::Ok);
        assert_eq!(t.status(s, Request::Commit { handle: r1.handle }), Status::Ok);
        // Last commit wins.
        assert_eq!(t.get(s, 9).offset, r1.offset);
        assert_eq!(t.st.stats().bytes_used, PAGE_LEN, "r2's block was replaced and freed");
    }

    #[test]
    fn eviction_is_lru_and_lookup_get_count_as_use() {
        let mut t = T::new(4);
        let s = t.st.open_session();
        for key in 1..=4 {
            t.put(s, key, PAGE_LEN);
        }
        // Use order now: 1 2 3 4. Touch 1 (LOOKUP) and 2 (GET + RELEASE).
        assert_eq!(t.status(s, Request::Lookup { key: 1 }), Status::Ok);
        let g = t.get(s, 2);
        assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
        // Order: 3 4 1 2. One page evicts 3.
        t.put(s, 5, 1);
        assert!(t.st.peek(3).is_none());
        let st = t.st.stats();
        assert_eq!((st.evictions, st.evicted_bytes), (1, PAGE_LEN));
        // Two pages: 4 (page 3) then 1 (page 0) free two pages that are not
        // adjacent, so 2 (page 1) goes too; 6 lands on pages 0-1.
        let six = t.put(s, 6, 2 * PAGE_LEN);
        assert_eq!(six, SLAB_OFFSET);
        for key in [1, 2, 3, 4] {
            assert!(t.st.peek(key).is_none(), "{key}");
        }
        assert!(t.st.peek(5).is_some() && t.st.peek(6).is_some());
        assert_eq!(t.st.stats().evictions, 4);
    }

    #[test]
    fn eviction_coalesces_until_it_fits() {
        let mut t = T::new(8);
        let s = t.st.open_session();
        let offsets: Vec<u64> = (1..=8).map(|key| t.put(s, key, PAGE_LEN)).collect();
        assert!(offsets.windows(2).all(|w| w[1] == w[0] + PAGE_LEN));
        // Pin 2; a 3-page request evicts 1 (no fit: 2 is pinned), 3, 4, 5.
        let g = t.get(s, 2);
        let r = t.reserve(s, 9, 3 * PAGE_LEN);
        assert_eq!(r.status, Status::Ok);
        assert_eq!(r.offset, offsets[2]);
        for key in [1, 3, 4, 5] {
            assert!(t.st.peek(key).is_none(), "{key}");
        }
        for key in [2, 6, 7, 8] {
            assert!(t.st.peek(key).is_some(), "{key}");
        }
        assert_eq!(t.st.stats().evictions, 4);
        assert_eq!(t.status(s, Request::Release { handle: g.handle }), Status::Ok);
    }

    #[test]
    fn eviction_never_takes_pinned_blocks_or_reservations() {
        let mut t = T::new(6);
        let a = t.st.open_session();
        let b = t.st.open_session();
        // Pages: [1 pinned][2][4 4][3 reserved, reserved].
        t.put(a, 1, PAGE_LEN);
        t.put(a, 2, PAGE_LEN);
        t.put(a, 4, 2 * PAGE_LEN);
        let res = t.reserve(b, 3, 2 * PAGE_LEN);
        let pinned = t.get(b, 1);
        assert_eq!(t.st.stats().bytes_free, 0);
        // 1 is the least recently committed but pinned; 3 is only reserved.
        let r = t.reserve(a, 5, 3 * PAGE_LEN);
        assert_eq!(r.status, Status::Ok);
        assert_eq!(r.offset, SLAB_OFFSET + PAGE_LEN);
        assert!(t.st.peek(1).is_some());
        // Nothing else can go: everything left is pinned or reserved.
        assert_eq!(t.reserve(a, 6, 1).status, Status::OutOfMemory);
        assert!(t.st.peek(2).is_none() && t.st.peek(4).is_none());
        assert_eq!(t.status(b, Request::Commit { handle: res.handle }), Status::Ok);
        assert_eq!(t.get(a, 1).offset, pinned.offset);
        assert_eq!(t.st.stats().reserved, 1);
    }

    #[test]
    fn out_of_memory_when_everything_is_pinned() {
        let mut t = T::new(4);
        let s = t.st.open_session();
        for key in 1..=3 {
            t.put(s, key, PAGE_LEN);
            t.get(s, key);
        }
        let res = t.reserve(s, 9, 1);
        assert_eq!(res.status, Status::Ok);
        let c = t.reserve(s, 4, 1);
        assert_eq!((c.op, c.status, c.handle, c.offset), (Op::Reserve, Status::OutOfMemory, 0, 0));
        assert_eq!(t.st.stats().evictions, 0);
        assert_eq!(t.st.stats().out_of_memory, 1);
        for key in 1..=3 {
            assert!(t.st.peek(key).is_some());
        }
    }

    #[test]
    fn out_of_memory_evicts_nothing_when_bytes_cannot_suffice() {
        let mut t = T::new(4);
        let s = t.st.open_session();
        t.put(s, 1, PAGE_LEN);
        t.put(s, 2, PAGE_LEN);
        t.get(s, 2);
        t.put(s, 3, 2 * PAGE_LEN);
        t.get(s, 3);
        // Free 0 + evictable 1 page < 2 pages: refused without evicting 1.
        assert_eq!(t.reserve(s, 9, 2 * PAGE_LEN).status, Status::OutOfMemory);
        assert!(t.st.peek(1).is_some());
        assert_eq!(t.st.stats().evictions, 0);
    }

    #[test]
    fn out_of_memory_after_evicting_when_fragmented() {
        // [1][2 pinned][3] and a 2-page request: enough bytes, no contiguous room.
        let mut t = T::new(3);
        let s = t.st.open_session();
        t.put(s, 1, PAGE_LEN);
        t.put(s, 2, PAGE_LEN);
        t.put(s, 3, PAGE_LEN);
        t.get(s, 2);
        assert_eq!(t.reserve(s, 9, 2 * PAGE_LEN).status, Status::OutOfMemory);
        // Documented: the LRU blocks tried are gone.
        assert!(t.st.peek(1).is_none() && t.st.peek(3).is_none());
        assert!(t.st.peek(2).is_some());
        assert_eq!(t.st.stats().largest_free_bytes, PAGE_LEN);
    }

    #[test]
    fn close_session_releases_pins_and_aborts_reservations() {
        let mut t = T::new(16);
        let a = t.st.open_session();
        let b = t.st.open_session();
        t.put(a, 1, PAGE_LEN);
        t.put(a, 2, PAGE_LEN);
        let g1 = t.get(b, 1);
        t.get(b, 1);
        t.get(b, 2);
        let ga = t.get(a, 2);
        let res = t.reserve(b, 3, 4 * PAGE_LEN);
        // 2 is deleted while pinned by both.
        assert_eq!(t.status(a, Request::Delete { key: 2 }), Status::Ok);
        let st = t.st.stats();
        assert_eq!((st.pins, st.reserved, st.bytes_used), (4, 1, 6 * PAGE_LEN));

        t.st.close_session(b);
        t.st.check_invariants().unwrap();
        assert!(!t.st.is_open(b));
        let st = t.st.stats();
        assert_eq!((st.pins, st.reserved, st.sessions), (1, 0, 1));
        assert_eq!(st.bytes_used, 2 * PAGE_LEN, "reservation aborted, 2 still pinned by a");
        assert_eq!(st.evictable_bytes, PAGE_LEN, "1 is evictable again");
        // Requests of a closed session are refused; its handles are dead.
        assert_eq!(t.status(b, Request::Ping), Status::Internal);
        assert_eq!(t.status(a, Request::Release { handle: g1.handle }), Status::BadHandle);
        assert_eq!(t.status(a, Request::Commit { handle: res.handle }), Status::BadHandle);
        assert_eq!(t.status(a, Request::Release { handle: ga.handle }), Status::Ok);
        assert_eq!(t.st.stats().bytes_used, PAGE_LEN);
        t.st.close_session(b);
        t.st.close_session(a);
        t.st.check_invariants().unwrap();
        assert_eq!(t.st.stats().sessions, 0);
        assert!(t.st.peek(1).is_some(), "committed blocks outlive sessions");
        assert_eq!(t.st.stats().internal, 1);
    }

    #[test]
    fn unknown_session_is_internal() {
        let mut st = Store::new(SLAB_OFFSET, MIB);
        let c = st.handle(SessionId(999), 5, &Request::Ping);
        assert_eq!((c.status, c.request_id), (Status::Internal, 5));
        assert_eq!(st.stats().internal, 1);
    }

    #[test]
    fn handle_encoding_round_trips() {
        for (kind, index, generation) in
            [(HandleKind::Reservation, 0, 0), (HandleKind::Pin, u32::MAX, GEN_MASK), (HandleKind::Pin, 7, 12345)]
        {
            let h = encode_handle(kind, index, generation);
            assert_ne!(h, 0);
            assert_eq!(decode_handle(h), Some((kind, index, generation)));
        }
        assert_eq!(decode_handle(0), None);
        assert_eq!(decode_handle(u64::MAX), None);
        assert_eq!(next_generation(GEN_MASK), 0);
    }

    // ---- property tests ---------------------------------------------------------

    const SESSIONS: usize = 3;
    const PAGES: u64 = 32;
    const KEYS: u8 = 8;

    #[derive(Clone, Debug)]
    enum Step {
        Reserve {
            s: usize,
            key: u8,
            len: u64,
            page_offset: u64,
        },
        /// `how`: 0 own live, 1 another session's live, 2 a dead handle, 3 random.
        Commit {
            s: usize,
            pick: usize,
            how: u8,
            random: u64,
        },
        Abort {
            s: usize,
            pick: usize,
            how: u8,
            random: u64,
        },
        Get {
            s: usize,
            key: u8,
        },
        Release {
            s: usize,
            pick: usize,
            how: u8,
            random: u64,
        },
        Lookup {
            s: usize,
            key: u8,
        },
        Delete {
            s: usize,
            key: u8,
        },
        Stats {
            s: usize,
        },
        Close {
            s: usize,
        },
    }

    fn step() -> impl Strategy<Value = Step> {
        let s = 0..SESSIONS;
        let key = 0..KEYS;
        let how = prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)];
        prop_oneof![
            6 => (s.clone(), key.clone(), 0u64..7 * PAGE_LEN, 0u64..64)
                .prop_map(|(s, key, len, po)| Step::Reserve { s, key, len, page_offset: po * 64 }),
            1 => (s.clone(), key.clone()).prop_map(|(s, key)| Step::Reserve { s, key, len: 40 * PAGE_LEN, page_offset: 0 }),
            5 => (s.clone(), any::<usize>(), how.clone(), any::<u64>())
                .prop_map(|(s, pick, how, random)| Step::Commit { s, pick, how, random }),
            2 => (s.clone(), any::<usize>(), how.clone(), any::<u64>())
                .prop_map(|(s, pick, how, random)| Step::Abort { s, pick, how, random }),
            4 => (s.clone(), key.clone()).prop_map(|(s, key)| Step::Get { s, key }),
            4 => (s.clone(), any::<usize>(), how, any::<u64>())
                .prop_map(|(s, pick, how, random)| Step::Release { s, pick, how, random }),
            2 => (s.clone(), key.clone()).prop_map(|(s, key)| Step::Lookup { s, key }),
            2 => (s.clone(), key).prop_map(|(s, key)| Step::Delete { s, key }),
            1 => s.clone().prop_map(|s| Step::Stats { s }),
            1 => s.prop_map(|s| Step::Close { s }),
        ]
    }

    /// A live object's data region, for the overlap check.
    #[derive(Clone, Copy, Debug)]
    struct Region {
        data_offset: u64,
        len: u64,
    }

    impl Region {
        fn end(&self) -> u64 {
            self.data_offset + self.len.max(1)
        }
        fn overlaps(&self, o: &Region) -> bool {
            self.data_offset < o.end() && o.data_offset < self.end()
        }
    }

    #[derive(Clone, Debug)]
    struct MRes {
        handle: u64,
        key: u128,
        region: Region,
    }

    #[derive(Clone, Debug)]
    struct MPin {
        handle: u64,
        region: Region,
    }

    #[derive(Clone, Debug)]
    struct MSession {
        id: SessionId,
        res: Vec<MRes>,
        /// One entry per successful GET not yet released.
        pins: Vec<MPin>,
    }

    struct Model {
        st: Store,
        sessions: Vec<MSession>,
        committed: HashMap<u128, Region>,
        /// Handles whose object is gone; they must stay bad for every session.
        dead: Vec<u64>,
        next_id: u32,
    }

    impl Model {
        fn new() -> Model {
            let mut st = Store::new(SLAB_OFFSET, PAGES * PAGE_LEN);
            let sessions =
                (0..SESSIONS).map(|_| MSession { id: st.open_session(), res: Vec::new(), pins: Vec::new() }).collect();
            Model { st, sessions, committed: HashMap::new(), dead: Vec::new(), next_id: 0 }
        }

        fn send(&mut self, s: usize, req: Request) -> Completion {
            self.next_id = self.next_id.wrapping_add(1);
            let c = self.st.handle(self.sessions[s].id, self.next_id, &req);
            assert_eq!(c.request_id, self.next_id);
            assert_ne!(c.status, Status::Internal, "{req:?}");
            c
        }

        fn live_regions(&self) -> Vec<Region> {
            let mut v: Vec<Region> = self.committed.values().copied().collect();
            for s in &self.sessions {
                v.extend(s.res.iter().map(|r| r.region));
                v.extend(s.pins.iter().map(|p| p.region));
            }
            v
        }

        fn is_pinned(&self, region: &Region) -> bool {
            self.sessions.iter().any(|s| s.pins.iter().any(|p| p.region.data_offset == region.data_offset))
        }

        /// A handle for a Commit/Abort/Release step and whether it must succeed.
        fn pick_handle(&self, s: usize, pick: usize, how: u8, random: u64, pin: bool) -> (u64, bool) {
            let own: Vec<u64> = if pin {
                self.sessions[s].pins.iter().map(|p| p.handle).collect()
            } else {
                self.sessions[s].res.iter().map(|r| r.handle).collect()
            };
            let others: Vec<u64> = self
                .sessions
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != s)
                .flat_map(|(_, m)| {
                    if pin {
                        m.pins.iter().map(|p| p.handle).collect::<Vec<_>>()
                    } else {
                        m.res.iter().map(|r| r.handle).collect()
                    }
                })
                .collect();
            let h = match how {
                0 if !own.is_empty() => own[pick % own.len()],
                1 if !others.is_empty() => others[pick % others.len()],
                2 if !self.dead.is_empty() => self.dead[pick % self.dead.len()],
                _ => random,
            };
            (h, own.contains(&h))
        }

        fn run(&mut self, step: &Step) -> Result<(), TestCaseError> {
            let evictions_before = self.st.stats().evictions;
            match *step {
                Step::Reserve { s, key, len, page_offset } => {
                    let key = u128::from(key);
                    let c = self.send(s, reserve_req(key, len, page_offset));
                    let need = round_up_to_pages(len + page_offset).unwrap();
                    prop_assert_eq!(c.status == Status::TooLarge, len + page_offset > PAGES * PAGE_LEN);
                    match c.status {
                        Status::Ok => {
                            let region = Region { data_offset: c.offset, len };
                            prop_assert_eq!(c.offset % PAGE_LEN, page_offset);
                            prop_assert!(c.offset >= SLAB_OFFSET);
                            prop_assert!(c.offset + len <= SLAB_OFFSET + PAGES * PAGE_LEN);
                            // Evictions happened first; drop what they took from the model.
                            self.reconcile(true)?;
                            for live in self.live_regions() {
                                prop_assert!(!region.overlaps(&live), "{:?} overlaps live {:?}", region, live);
                            }
                            prop_assert!(!self.dead.contains(&c.handle));
                            self.sessions[s].res.push(MRes { handle: c.handle, key, region });
                        }
                        Status::TooLarge => prop_assert!(len + page_offset > PAGES * PAGE_LEN),
                        Status::OutOfMemory => {
                            self.reconcile(true)?;
                            let st = self.st.stats();
                            prop_assert!(st.largest_free_bytes < need);
                            prop_assert!(
                                st.evictable_bytes == 0 || st.bytes_free + st.evictable_bytes < need,
                                "OOM with evictable blocks left: {:?}",
                                st
                            );
                        }
                        other => prop_assert!(false, "reserve -> {:?}", other),
                    }
                }
                Step::Commit { s, pick, how, random } => {
                    let (h, own) = self.pick_handle(s, pick, how, random, false);
                    let c = self.send(s, Request::Commit { handle: h });
                    if own {
                        prop_assert_eq!(c.status, Status::Ok);
                        let i = self.sessions[s].res.iter().position(|r| r.handle == h).unwrap();
                        let r = self.sessions[s].res.swap_remove(i);
                        self.committed.insert(r.key, r.region);
                        self.dead.push(h);
                    } else {
                        prop_assert_eq!(c.status, Status::BadHandle);
                    }
                }
                Step::Abort { s, pick, how, random } => {
                    let (h, own) = self.pick_handle(s, pick, how, random, false);
                    let c = self.send(s, Request::Abort { handle: h });
                    if own {
                        prop_assert_eq!(c.status, Status::Ok);
                        self.sessions[s].res.retain(|r| r.handle != h);
                        self.dead.push(h);
                    } else {
                        prop_assert_eq!(c.status, Status::BadHandle);
                    }
                }
                Step::Get { s, key } => {
                    let key = u128::from(key);
                    let c = self.send(s, Request::Get { key });
                    match self.committed.get(&key).copied() {
                        Some(region) => {
                            prop_assert_eq!(c.status, Status::Ok);
                            prop_assert_eq!(c.offset, region.data_offset);
                            let (dtype, shape, len) = c.tensor.unwrap();
                            prop_assert_eq!((dtype, len), (DType::U8, region.len));
                            prop_assert_eq!(shape.len_bytes(dtype), Some(len));
                            // Same handle as this session's earlier pins of this block, distinct from others'.
                            for (i, m) in self.sessions.iter().enumerate() {
                                for p in &m.pins {
                                    let same_block = p.region.data_offset == region.data_offset;
                                    prop_assert_eq!(p.handle == c.handle, i == s && same_block);
                                }
                            }
                            prop_assert!(!self.dead.contains(&c.handle));
                            self.sessions[s].pins.push(MPin { handle: c.handle, region });
                        }
                        None => prop_assert_eq!(c.status, Status::NotFound),
                    }
                }
                Step::Release { s, pick, how, random } => {
                    let (h, own) = self.pick_handle(s, pick, how, random, true);
                    let c = self.send(s, Request::Release { handle: h });
                    if own {
                        prop_assert_eq!(c.status, Status::Ok);
                        let pins = &mut self.sessions[s].pins;
                        let i = pins.iter().position(|p| p.handle == h).unwrap();
                        pins.swap_remove(i);
                        if !pins.iter().any(|p| p.handle == h) {
                            self.dead.push(h);
                        }
                    } else {
                        prop_assert_eq!(c.status, Status::BadHandle);
                    }
                }
                Step::Lookup { s, key } => {
                    let key = u128::from(key);
                    let c = self.send(s, Request::Lookup { key });
                    let want = if self.committed.contains_key(&key) { Status::Ok } else { Status::NotFound };
                    prop_assert_eq!(c.status, want);
                }
                Step::Delete { s, key } => {
                    let key = u128::from(key);
                    let c = self.send(s, Request::Delete { key });
                    let want = if self.committed.remove(&key).is_some() { Status::Ok } else { Status::NotFound };
                    prop_assert_eq!(c.status, want);
                }
                Step::Stats { s } => {
                    let c = self.send(s, Request::Stats);
                    prop_assert_eq!(c.status, Status::Ok);
                    prop_assert_eq!(c.handle, self.committed.len() as u64);
                    prop_assert_eq!(c.offset, self.st.stats().bytes_used);
                }
                Step::Close { s } => {
                    let m = &mut self.sessions[s];
                    self.st.close_session(m.id);
                    self.dead.extend(m.res.drain(..).map(|r| r.handle));
                    self.dead.extend(m.pins.drain(..).map(|p| p.handle));
                    m.id = self.st.open_session();
                }
            }
            if !matches!(step, Step::Reserve { .. }) {
                prop_assert_eq!(self.st.stats().evictions, evictions_before);
            }
            self.reconcile(false)?;
            self.check()
        }

        /// Drops evicted keys from the model (only allowed after a RESERVE) and
        /// checks that every model key is in the store with the same region.
        fn reconcile(&mut self, evictions_allowed: bool) -> Result<(), TestCaseError> {
            let keys: Vec<u128> = self.committed.keys().copied().collect();
            for key in keys {
                let region = self.committed[&key];
                match self.st.peek(key) {
                    Some(info) => {
                        prop_assert_eq!(info.data_offset, region.data_offset);
                        prop_assert_eq!(info.len, region.len);
                    }
                    None => {
                        prop_assert!(evictions_allowed, "key {} vanished", key);
                        prop_assert!(!self.is_pinned(&region), "pinned key {} was evicted", key);
                        self.committed.remove(&key);
                    }
                }
            }
            Ok(())
        }

        fn check(&self) -> Result<(), TestCaseError> {
            self.st.check_invariants().map_err(TestCaseError::fail)?;
            for key in 0..u128::from(KEYS) {
                prop_assert_eq!(self.st.peek(key).is_some(), self.committed.contains_key(&key));
            }
            // Distinct live objects never share bytes (pins of one block share its region).
            let mut regions: Vec<(u64, u64)> = self.live_regions().iter().map(|r| (r.data_offset, r.end())).collect();
            regions.sort_unstable();
            regions.dedup();
            for w in regions.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "live regions {:?} and {:?} overlap", w[0], w[1]);
            }
            let st = self.st.stats();
            prop_assert_eq!(st.blocks, self.committed.len() as u64);
            prop_assert_eq!(st.reserved, self.sessions.iter().map(|m| m.res.len() as u64).sum::<u64>());
            prop_assert_eq!(st.pins, self.sessions.iter().map(|m| m.pins.len() as u64).sum::<u64>());
            prop_assert_eq!(st.bytes_used + st.bytes_free, st.bytes_total);
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Random op sequences from several sessions against a model: visible
        /// keys, regions, pins, handle checks, eviction rules, invariants.
        #[test]
        fn random_sessions_match_the_model(steps in proptest::collection::vec(step(), 1..200)) {
            let mut m = Model::new();
            for step in &steps {
                m.run(step)?;
            }
            // Tear down: everything returns to one free extent.
            for s in 0..SESSIONS {
                m.st.close_session(m.sessions[s].id);
            }
            let s = m.st.open_session();
            for key in 0..u128::from(KEYS) {
                m.st.handle(s, 0, &Request::Delete { key });
            }
            m.st.check_invariants().map_err(TestCaseError::fail)?;
            let st = m.st.stats();
            prop_assert_eq!(st.bytes_used, 0);
            prop_assert_eq!(st.largest_free_bytes, st.bytes_total);
            prop_assert_eq!(st.internal, 0);
        }

        /// Arbitrary frames and arbitrary hand-built requests never panic, never
        /// report INTERNAL, and keep every invariant.
        #[test]
        fn arbitrary_requests_never_break_the_store(
            frames in proptest::collection::vec((any::<[u8; 64]>(), 1u8..=9, 0usize..2, any::<bool>()), 1..100),
        ) {
            let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
            let sessions = [st.open_session(), st.open_session()];
            let mut handles: Vec<u64> = Vec::new();
            for (bytes, op, s, small) in frames {
                let mut d = TensorBlockDescriptor::from_bytes(&bytes);
                d.op = op;
                d.status = 0;
                if small {
                    // Mostly well-formed: small keys and shapes, recent handles.
                    d.key_hi = 0;
                    d.key_lo %= 4;
                    d.dtype = d.dtype % 12 + 1;
                    d.ndim %= 3;
                    for (i, dim) in d.shape.iter_mut().enumerate() {
                        *dim = if i < usize::from(d.ndim) { *dim % 5000 } else { 0 };
                    }
                    d.offset = (d.offset % 64) * 64;
                    if let Some(&h) = handles.get(d.handle as usize % handles.len().max(1)) {
                        d.handle = h;
                    }
                }
                let req = match Request::decode(&d) {
                    Ok(req) => req,
                    Err(_) => continue,
                };
                let c = st.handle(sessions[s], d.request_id, &req);
                prop_assert_ne!(c.status, Status::Internal);
                if c.status == Status::Ok && c.handle != 0 && c.op != Op::Stats {
                    handles.push(c.handle);
                }
                st.check_invariants().map_err(TestCaseError::fail)?;
            }
            // Hand-built requests that bypass the decoder's checks.
            for (len, page_offset) in [(u64::MAX, 0), (0, u64::MAX), (u64::MAX, 4032), (1, 4095)] {
                let shape = Shape::new(&[7]).unwrap();
                let req = Request::Reserve { key: 1, dtype: DType::U8, shape, len, page_offset };
                let c = st.handle(sessions[0], 0, &req);
                prop_assert!(matches!(c.status, Status::Invalid | Status::TooLarge));
            }
            st.close_session(sessions[0]);
            st.close_session(sessions[1]);
            st.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}
