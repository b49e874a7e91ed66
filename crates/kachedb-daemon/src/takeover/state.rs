//! The takeover state, format 6: the types a daemon hands its successor,
//! owned by this module and encoded by it alone, apart from the store's and
//! the serve loop's own types (`docs/takeover.md`, "The state format
//! (version 6)", describes every byte).
//!
//! The serve loop's part is a header (postcard: the channels, parked WAITs,
//! counters, the tiers' unfinished work, the store's small tables and the
//! lengths of what follows) and then the store's per-slot tables as
//! fixed-size little-endian records, written and read in bulk: one
//! [`SlotRecord`] of [`SLOT_RECORD_LEN`] bytes per block slot, the free
//! block slots (`u32` each), one [`PinRecord`] of [`PIN_RECORD_LEN`] bytes
//! per pin slot, the free pin slots. The store converts itself to and from
//! [`StoreState`] (`store/state.rs`); the receiving daemon derives the
//! indexes (keys, chain links, eviction lists, the allocator's free lists)
//! from the records and checks the whole store before it serves.

use serde::{Deserialize, Serialize};

/// Bytes of one [`SlotRecord`] in the encoding.
pub const SLOT_RECORD_LEN: usize = 112;
/// Bytes of one [`PinRecord`] in the encoding.
pub const PIN_RECORD_LEN: usize = 32;
/// [`SlotRecord::parent`] of a block without one.
pub const NO_PARENT: u32 = u32::MAX;

/// What a block slot holds ([`SlotRecord::kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    /// Free: only the generation counts.
    Free = 0,
    /// A reservation of session `owner`.
    Reserved = 1,
    /// A committed block.
    Block = 2,
}

/// [`SlotRecord::flags`]: the block is the block of its key.
pub const FLAG_LINKED: u8 = 1;
/// [`SlotRecord::flags`]: its extent is counted in the evictable bytes.
pub const FLAG_COUNTED: u8 = 2;
/// [`SlotRecord::flags`]: its chain back to its root is whole.
pub const FLAG_ROOTED: u8 = 4;
/// [`SlotRecord::flags`]: it is on its eviction list, under `last_use`.
pub const FLAG_LISTED: u8 = 8;
/// [`PinRecord::flags`]: the slot holds a pin.
pub const PIN_LIVE: u8 = 1;
/// [`PinRecord::flags`]: the pin is another tenant's client's.
pub const PIN_FOREIGN: u8 = 2;

/// One block slot: a free slot, a reservation or a block (by index: the
/// index in a client's handle).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotRecord {
    /// The key of its tensor.
    pub key: u128,
    /// Its extent: start, bytes from the region base, and bytes.
    pub extent_offset: u64,
    /// See above.
    pub extent_len: u64,
    /// Tensor bytes.
    pub len: u64,
    /// A block's last use (tick).
    pub last_use: u64,
    /// A block's pins, all sessions together; a reservation's owner session.
    pub pins_or_owner: u64,
    /// Of a block's pins, those of other tenants' clients.
    pub foreign_pins: u64,
    /// Bumped each time the slot is freed (a handle's generation).
    pub generation: u32,
    /// A linked block's parent slot, or [`NO_PARENT`].
    pub parent: u32,
    /// Linked blocks naming it as parent.
    pub children: u32,
    /// Of those, the ones that hold it off the eviction list.
    pub holding_children: u32,
    /// Dims; the first `ndim` count.
    pub dims: [u32; kachedb_shm::MAX_DIMS],
    /// Start of the tensor bytes, bytes after the start of its extent (< one page).
    pub data_in_page: u16,
    /// A [`SlotKind`] code.
    pub kind: u8,
    /// The descriptor's dtype code.
    pub dtype: u8,
    /// Dims used.
    pub ndim: u8,
    /// Its tenant's row.
    pub tenant: u8,
    /// `FLAG_*` bits.
    pub flags: u8,
}

impl SlotRecord {
    /// A free slot's record: only its generation counts.
    pub fn free(generation: u32) -> SlotRecord {
        SlotRecord { generation, parent: NO_PARENT, kind: SlotKind::Free as u8, ..SlotRecord::default() }
    }

    /// A block's `flags`.
    pub fn block_flags(linked: bool, counted: bool, rooted: bool, listed: bool) -> u8 {
        let flag = |on: bool, f: u8| if on { f } else { 0 };
        flag(linked, FLAG_LINKED) | flag(counted, FLAG_COUNTED) | flag(rooted, FLAG_ROOTED) | flag(listed, FLAG_LISTED)
    }
}

/// One pin slot: one session's pins of one block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinRecord {
    /// Bumped each time the slot is freed.
    pub generation: u32,
    /// The pinned block's slot.
    pub block_index: u32,
    /// The pinning session.
    pub session: u64,
    /// GETs not yet released.
    pub count: u64,
    /// `PIN_*` bits.
    pub flags: u8,
}

/// A client session as the store holds it: its pins and reservations are
/// in the records (a pin record's session, a reservation's owner).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// Its id.
    pub id: u64,
    /// Its tenant's row.
    pub tenant: u8,
    /// Extent bytes it holds (reservations, and blocks it pins once each).
    pub held_bytes: u64,
}

/// One row of the tenant table (its eviction list is in the slot records).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRow {
    /// Its name; empty for a row never used.
    pub name: String,
    /// Its limit, bytes.
    pub limit: Option<u64>,
    /// Never given to another name.
    pub pinned_row: bool,
    /// Its sessions open.
    pub sessions: u64,
    /// bytes, blocks, reachable_bytes, orphaned_bytes, get_hits,
    /// get_misses, lookup_hits, lookup_misses, evictions, evicted_bytes,
    /// stored_bytes, limit_refusals.
    pub figures: [u64; 12],
    /// Extent bytes of its linked unpinned blocks.
    pub evictable_bytes: u64,
    /// Extent bytes of its blocks pinned only by other tenants' clients.
    pub lent_bytes: u64,
    /// Extent bytes of other tenants' blocks its clients pin.
    pub borrowed_bytes: u64,
}

/// The store's counters (`kachedb stats`), by wire code where a table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreCounters {
    /// Requests by op code (16).
    pub requests: Vec<u64>,
    /// OK answers by op code (16).
    pub ok: Vec<u64>,
    /// Error answers by status code (16).
    pub errors: Vec<u64>,
    /// Tensor bytes found, by op code (16).
    pub hit_bytes: Vec<u64>,
    /// evictions, evicted_bytes, replaced, pins_held, reservations_live,
    /// stored_bytes, client_limit_hits, tenant_limit_hits, parents_missing,
    /// links_cut, links_cut_by_eviction, unheld_links_cut_by_eviction.
    pub figures: [u64; 12],
}

/// The store's tables that are not per slot.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreMeta {
    /// Megaslab bytes as given to the store.
    pub slab_len: u64,
    /// The eviction policy: 0 chain, 1 LRU.
    pub policy: u8,
    /// Last tick handed out.
    pub tick: u64,
    /// The next session id.
    pub next_session: u64,
    /// Extent bytes of the linked unpinned blocks.
    pub evictable_bytes: u64,
    /// Extent bytes of the linked blocks whose chain is whole, and of the others.
    pub reachable_bytes: u64,
    /// See above.
    pub orphaned_bytes: u64,
    /// `--max-client-bytes` of the daemon that wrote it.
    pub max_session_bytes: Option<u64>,
    /// What the store counts.
    pub counters: StoreCounters,
    /// Open sessions, by id.
    pub sessions: Vec<SessionRecord>,
    /// The tenant table, by row.
    pub tenants: Vec<TenantRow>,
    /// Per-tenant accounting is on.
    pub accounting: bool,
    /// `--tenant-limit-default` of the daemon that wrote it.
    pub default_limit: Option<u64>,
    /// Evictable bytes of the tenants with a limit.
    pub limited_evictable_bytes: u64,
}

/// The store, as handed over.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreState {
    /// The small tables.
    pub meta: StoreMeta,
    /// Block slots, by index.
    pub slots: Vec<SlotRecord>,
    /// Free block slots, in the order they are reused (last first).
    pub free_slots: Vec<u32>,
    /// Pin slots, by index.
    pub pin_slots: Vec<PinRecord>,
    /// Free pin slots, in the order they are reused (last first).
    pub free_pin_slots: Vec<u32>,
}

/// The region's geometry the writing daemon serves (checked against the
/// region header, which any client can write).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLayout {
    /// Channels.
    pub channel_count: u32,
    /// Slots per ring.
    pub ring_capacity: u32,
    /// Start of channel 0, bytes from the region base.
    pub channel_offset: u64,
    /// Bytes per channel.
    pub channel_stride: u64,
    /// Start of the megaslab, bytes from the region base.
    pub slab_offset: u64,
    /// Megaslab bytes.
    pub slab_len: u64,
    /// Region bytes.
    pub region_len: u64,
}

impl From<&kachedb_shm::Layout> for RegionLayout {
    fn from(l: &kachedb_shm::Layout) -> RegionLayout {
        RegionLayout {
            channel_count: l.channel_count,
            ring_capacity: l.ring_capacity,
            channel_offset: l.channel_offset,
            channel_stride: l.channel_stride,
            slab_offset: l.slab_offset,
            slab_len: l.slab_len,
            region_len: l.region_len,
        }
    }
}

impl std::fmt::Display for RegionLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} channels x {} slots, channel stride {} B, megaslab {} B at {}",
            self.channel_count, self.ring_capacity, self.channel_stride, self.slab_len, self.slab_offset
        )
    }
}

/// One connected channel's session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelState {
    /// The channel.
    pub channel: u32,
    /// Its store session's id.
    pub session: u64,
    /// The client's pid and uid.
    pub pid: i32,
    /// See above.
    pub uid: u32,
    /// Completions not yet pushed (64-byte frames).
    pub backlog: Vec<Vec<u8>>,
    /// Request frames popped behind a parked WAIT.
    pub held: Vec<Vec<u8>>,
    /// A WAIT of it is parked.
    pub waiting: bool,
    /// It was disconnected for a corrupt or stuck ring.
    pub kicked: bool,
    /// Keys already asked of a tier for the held frames.
    pub tier_asked: Vec<u128>,
}

/// A parked WAIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedWait {
    /// Its channel.
    pub channel: u32,
    /// The key waited for.
    pub key: u128,
    /// The request's id.
    pub request_id: u32,
    /// Milliseconds left before it times out; `None`: never.
    pub left_ms: Option<u64>,
}

/// The serve loop's counters, in the order of `kachedb_shm::control::ServeStats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServeCounters {
    /// ops, rejected_frames, clients_connected, clients_total,
    /// clients_kicked, wakeups_sent, parks.
    pub figures: [u64; 7],
}

impl ServeCounters {
    /// The serve loop's counters `s`.
    pub fn of(s: &kachedb_shm::control::ServeStats) -> ServeCounters {
        ServeCounters {
            figures: [
                s.ops,
                s.rejected_frames,
                s.clients_connected,
                s.clients_total,
                s.clients_kicked,
                s.wakeups_sent,
                s.parks,
            ],
        }
    }

    /// As the serve loop counts them.
    pub fn to_stats(self) -> kachedb_shm::control::ServeStats {
        let [ops, rejected_frames, clients_connected, clients_total, clients_kicked, wakeups_sent, parks] =
            self.figures;
        kachedb_shm::control::ServeStats {
            ops,
            rejected_frames,
            clients_connected,
            clients_total,
            clients_kicked,
            wakeups_sent,
            parks,
        }
    }
}

/// A write a tier had taken and not finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierWrite {
    /// The block's key.
    pub key: u128,
    /// The parent its client named.
    pub parent: Option<u128>,
}

/// The serve loop's part of the state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServeState {
    /// The region's generation.
    pub region_generation: u64,
    /// The geometry the writing daemon serves.
    pub layout: RegionLayout,
    /// Connected channels.
    pub channels: Vec<ChannelState>,
    /// Parked WAITs.
    pub waits: Vec<ParkedWait>,
    /// The serve loop's counters.
    pub counters: ServeCounters,
    /// The writing daemon's uptime.
    pub uptime_ms: u64,
    /// The tiers' writes taken and not finished.
    pub tier_writes: Vec<TierWrite>,
    /// Keys whose older tier copy is still to remove.
    pub tier_unremoved: Vec<u128>,
    /// Each stopped tier's name and how many descriptors it handed over,
    /// in the offer's order.
    pub tier_fds: Vec<(String, u32)>,
    /// The block store.
    pub store: StoreState,
}

/// What precedes the records: everything but them, and their counts.
#[derive(Serialize, Deserialize)]
struct Header {
    region_generation: u64,
    layout: RegionLayout,
    channels: Vec<ChannelState>,
    waits: Vec<ParkedWait>,
    counters: ServeCounters,
    uptime_ms: u64,
    tier_writes: Vec<TierWrite>,
    tier_unremoved: Vec<u128>,
    tier_fds: Vec<(String, u32)>,
    store: StoreMeta,
    slots: u64,
    free_slots: u64,
    pin_slots: u64,
    free_pin_slots: u64,
}

/// Encodes `st`: a `u32` little-endian header length, the header
/// (postcard), then the records.
pub fn encode(st: &ServeState) -> Result<Vec<u8>, String> {
    let s = &st.store;
    let header = Header {
        region_generation: st.region_generation,
        layout: st.layout,
        channels: st.channels.clone(),
        waits: st.waits.clone(),
        counters: st.counters,
        uptime_ms: st.uptime_ms,
        tier_writes: st.tier_writes.clone(),
        tier_unremoved: st.tier_unremoved.clone(),
        tier_fds: st.tier_fds.clone(),
        store: s.meta.clone(),
        slots: s.slots.len() as u64,
        free_slots: s.free_slots.len() as u64,
        pin_slots: s.pin_slots.len() as u64,
        free_pin_slots: s.free_pin_slots.len() as u64,
    };
    let head = postcard::to_stdvec(&header).map_err(|e| e.to_string())?;
    let head_len = u32::try_from(head.len()).map_err(|_| "the state's header passes 4 GiB".to_string())?;
    let total = 4
        + head.len()
        + s.slots.len() * SLOT_RECORD_LEN
        + s.pin_slots.len() * PIN_RECORD_LEN
        + (s.free_slots.len() + s.free_pin_slots.len()) * 4;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&head_len.to_le_bytes());
    out.extend_from_slice(&head);
    for r in &s.slots {
        out.extend_from_slice(&slot_bytes(r));
    }
    for &i in &s.free_slots {
        out.extend_from_slice(&i.to_le_bytes());
    }
    for p in &s.pin_slots {
        out.extend_from_slice(&pin_bytes(p));
    }
    for &i in &s.free_pin_slots {
        out.extend_from_slice(&i.to_le_bytes());
    }
    debug_assert_eq!(out.len(), total);
    Ok(out)
}

/// Decodes what [`encode`] wrote; `Err` on bytes that are not a whole state.
pub fn decode(bytes: &[u8]) -> Result<ServeState, String> {
    let short = || "the state ends early".to_string();
    let head_len = u32::from_le_bytes(bytes.get(..4).ok_or_else(short)?.try_into().map_err(|_| short())?) as usize;
    let head = bytes.get(4..4 + head_len).ok_or_else(short)?;
    let h: Header = postcard::from_bytes(head).map_err(|e| format!("the state's header: {e}"))?;
    let mut rest = &bytes[4 + head_len..];
    let mut take = |count: u64, each: usize| -> Result<&[u8], String> {
        let n = usize::try_from(count).ok().and_then(|c| c.checked_mul(each)).ok_or_else(short)?;
        if rest.len() < n {
            return Err(short());
        }
        let (a, b) = rest.split_at(n);
        rest = b;
        Ok(a)
    };
    let slots = take(h.slots, SLOT_RECORD_LEN)?.chunks_exact(SLOT_RECORD_LEN).map(slot_from).collect();
    let free_slots = take(h.free_slots, 4)?.chunks_exact(4).map(u32_at0).collect();
    let pin_slots = take(h.pin_slots, PIN_RECORD_LEN)?.chunks_exact(PIN_RECORD_LEN).map(pin_from).collect();
    let free_pin_slots = take(h.free_pin_slots, 4)?.chunks_exact(4).map(u32_at0).collect();
    if !rest.is_empty() {
        return Err(format!("{} bytes past the end of the state", rest.len()));
    }
    Ok(ServeState {
        region_generation: h.region_generation,
        layout: h.layout,
        channels: h.channels,
        waits: h.waits,
        counters: h.counters,
        uptime_ms: h.uptime_ms,
        tier_writes: h.tier_writes,
        tier_unremoved: h.tier_unremoved,
        tier_fds: h.tier_fds,
        store: StoreState { meta: h.store, slots, free_slots, pin_slots, free_pin_slots },
    })
}

fn u32_at0(b: &[u8]) -> u32 {
    u32_at(b, 0)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// A slot record's bytes: key 0..16, extent_offset 16, extent_len 24, len
/// 32, last_use 40, pins_or_owner 48, foreign_pins 56 (u64 each), then
/// generation 64, parent 68, children 72, holding_children 76 (u32 each),
/// dims 80..104 (6 × u32), data_in_page 104 (u16), kind 106, dtype 107,
/// ndim 108, tenant 109, flags 110, 0 at 111.
fn slot_bytes(r: &SlotRecord) -> [u8; SLOT_RECORD_LEN] {
    let mut b = [0u8; SLOT_RECORD_LEN];
    b[0..16].copy_from_slice(&r.key.to_le_bytes());
    for (i, v) in
        [r.extent_offset, r.extent_len, r.len, r.last_use, r.pins_or_owner, r.foreign_pins].into_iter().enumerate()
    {
        b[16 + 8 * i..24 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    for (i, v) in [r.generation, r.parent, r.children, r.holding_children].into_iter().enumerate() {
        b[64 + 4 * i..68 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    for (i, d) in r.dims.iter().enumerate() {
        b[80 + 4 * i..84 + 4 * i].copy_from_slice(&d.to_le_bytes());
    }
    b[104..106].copy_from_slice(&r.data_in_page.to_le_bytes());
    b[106..111].copy_from_slice(&[r.kind, r.dtype, r.ndim, r.tenant, r.flags]);
    b
}

fn slot_from(b: &[u8]) -> SlotRecord {
    let mut key = [0u8; 16];
    key.copy_from_slice(&b[0..16]);
    let mut dims = [0u32; kachedb_shm::MAX_DIMS];
    for (i, d) in dims.iter_mut().enumerate() {
        *d = u32_at(b, 80 + 4 * i);
    }
    SlotRecord {
        key: u128::from_le_bytes(key),
        extent_offset: u64_at(b, 16),
        extent_len: u64_at(b, 24),
        len: u64_at(b, 32),
        last_use: u64_at(b, 40),
        pins_or_owner: u64_at(b, 48),
        foreign_pins: u64_at(b, 56),
        generation: u32_at(b, 64),
        parent: u32_at(b, 68),
        children: u32_at(b, 72),
        holding_children: u32_at(b, 76),
        dims,
        data_in_page: u16::from_le_bytes([b[104], b[105]]),
        kind: b[106],
        dtype: b[107],
        ndim: b[108],
        tenant: b[109],
        flags: b[110],
    }
}

/// A pin record's bytes: generation 0, block_index 4 (u32 each), session 8,
/// count 16 (u64 each), flags 24, 0 at 25..32.
fn pin_bytes(p: &PinRecord) -> [u8; PIN_RECORD_LEN] {
    let mut b = [0u8; PIN_RECORD_LEN];
    b[0..4].copy_from_slice(&p.generation.to_le_bytes());
    b[4..8].copy_from_slice(&p.block_index.to_le_bytes());
    b[8..16].copy_from_slice(&p.session.to_le_bytes());
    b[16..24].copy_from_slice(&p.count.to_le_bytes());
    b[24] = p.flags;
    b
}

fn pin_from(b: &[u8]) -> PinRecord {
    PinRecord {
        generation: u32_at(b, 0),
        block_index: u32_at(b, 4),
        session: u64_at(b, 8),
        count: u64_at(b, 16),
        flags: b[24],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field lands where the docs say and comes back.
    #[test]
    fn a_state_comes_back_field_by_field() {
        let slot = SlotRecord {
            key: 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10,
            extent_offset: 8192,
            extent_len: 4096,
            len: 100,
            last_use: 7,
            pins_or_owner: 3,
            foreign_pins: 1,
            generation: 9,
            parent: NO_PARENT,
            children: 2,
            holding_children: 1,
            dims: [10, 10, 1, 0, 0, 0],
            data_in_page: 64,
            kind: SlotKind::Block as u8,
            dtype: 1,
            ndim: 3,
            tenant: 4,
            flags: FLAG_LINKED | FLAG_ROOTED,
        };
        let b = slot_bytes(&slot);
        assert_eq!(u64_at(&b, 16), 8192);
        assert_eq!(u32_at(&b, 68), NO_PARENT);
        assert_eq!((b[106], b[110], b[111]), (2, FLAG_LINKED | FLAG_ROOTED, 0));
        let pin = PinRecord { generation: 1, block_index: 0, session: 5, count: 2, flags: PIN_LIVE };
        let st = ServeState {
            region_generation: 3,
            uptime_ms: 5,
            tier_fds: vec![("a-tier".into(), 2)],
            store: StoreState {
                meta: StoreMeta { slab_len: 1 << 20, tick: 7, ..StoreMeta::default() },
                slots: vec![slot, SlotRecord { generation: 4, ..SlotRecord::default() }],
                free_slots: vec![1],
                pin_slots: vec![pin],
                free_pin_slots: vec![],
            },
            ..ServeState::default()
        };
        let bytes = encode(&st).unwrap();
        assert_eq!(decode(&bytes).unwrap(), st);
        // Cut short or with bytes past its end: refused.
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).unwrap_err().contains("past the end"));
    }
}
