//! The decoder of state format 5, the format before this build's: postcard
//! (serde's data model) of the types below, in field order, read into the
//! current types ([`super::state::ServeState`]). The types are format 5's
//! as its builds wrote them (the store's and the serve loop's types of
//! those builds, `docs/takeover.md`, "Format 5"), frozen here: nothing else
//! in the daemon decodes into them, and the committed state of format 5
//! (`crate::state_format`) pins them. Of the store, the tables format 6
//! derives (keys, eviction lists, chain links, the allocator, the sessions'
//! pins and reservations, the tenant names' index) are read and dropped:
//! the receiving store derives them again and checks them.

use super::state::{self, ServeCounters};
use serde::Deserialize;

/// `ServeState` of format 5, field by field.
#[derive(Deserialize)]
struct ServeState {
    region_generation: u64,
    layout: [u64; 7],
    store: Store,
    channels: Vec<ChannelState>,
    waits: Vec<(u32, u128, u32, Option<u64>)>,
    counters: [u64; 7],
    uptime_ms: u64,
    tier_writes: Vec<(u128, Option<u128>)>,
    tier_unremoved: Vec<u128>,
    tier_fds: Vec<(String, u32)>,
}

/// `ChannelState` of format 5: its keys asked of a tier are a set.
#[derive(Deserialize)]
struct ChannelState {
    channel: u32,
    session: u64,
    pid: i32,
    uid: u32,
    backlog: Vec<Vec<u8>>,
    held: Vec<Vec<u8>>,
    waiting: bool,
    kicked: bool,
    tier_asked: std::collections::HashSet<u128>,
}

/// The serve loop's state of format 5, in the current types.
pub(super) fn decode_serve(bytes: &[u8]) -> Result<state::ServeState, String> {
    let v5: ServeState = postcard::from_bytes(bytes).map_err(|e| e.to_string())?;
    Ok(state::ServeState {
        region_generation: v5.region_generation,
        layout: {
            // channel_count and ring_capacity are u32 varints, the rest u64: the same bytes.
            let [channel_count, ring_capacity, channel_offset, channel_stride, slab_offset, slab_len, region_len] =
                v5.layout;
            state::RegionLayout {
                channel_count: u32::try_from(channel_count).map_err(|_| "channel count past u32")?,
                ring_capacity: u32::try_from(ring_capacity).map_err(|_| "ring capacity past u32")?,
                channel_offset,
                channel_stride,
                slab_offset,
                slab_len,
                region_len,
            }
        },
        channels: v5
            .channels
            .into_iter()
            .map(|c| state::ChannelState {
                channel: c.channel,
                session: c.session,
                pid: c.pid,
                uid: c.uid,
                backlog: c.backlog,
                held: c.held,
                waiting: c.waiting,
                kicked: c.kicked,
                tier_asked: c.tier_asked.into_iter().collect(),
            })
            .collect(),
        waits: v5
            .waits
            .into_iter()
            .map(|(channel, key, request_id, left_ms)| state::ParkedWait { channel, key, request_id, left_ms })
            .collect(),
        counters: ServeCounters { figures: v5.counters },
        uptime_ms: v5.uptime_ms,
        tier_writes: v5.tier_writes.into_iter().map(|(key, parent)| state::TierWrite { key, parent }).collect(),
        tier_unremoved: v5.tier_unremoved,
        tier_fds: v5.tier_fds,
        store: v5.store.into_state()?,
    })
}

/// The store of format 5.
#[derive(Deserialize)]
struct Store {
    _alloc: Alloc,
    slab_len: u64,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    pin_slots: Vec<PinSlot>,
    free_pin_slots: Vec<u32>,
    _keys: Vec<(u128, u32)>,
    _lru: Vec<(u64, u32)>,
    _links: Vec<(u32, u32)>,
    policy: Policy,
    tick: u64,
    evictable_bytes: u64,
    sessions: Vec<(u64, Session)>,
    next_session: u64,
    counters: Counters,
    max_session_bytes: Option<u64>,
    _limit_hit: Option<u64>,
    tenants: Tenants,
    reachable_bytes: u64,
    orphaned_bytes: u64,
}

/// The extent allocator (derived again from the slots' extents).
#[derive(Deserialize)]
struct Alloc {
    _base_offset: u64,
    _total_len: u64,
    _free_by_offset: Vec<(u64, u64)>,
    _free_by_len: Vec<(u64, u64)>,
    _allocated: Vec<(u64, u64)>,
    _free_len: u64,
}

#[derive(Deserialize)]
struct Slot {
    generation: u32,
    state: SlotState,
}

#[derive(Deserialize)]
enum SlotState {
    Free,
    Reserved {
        owner: u64,
        tensor: Tensor,
    },
    Block {
        tensor: Tensor,
        linked: bool,
        pins: u64,
        foreign_pins: u64,
        lru_tick: Option<u64>,
        last_use: u64,
        counted: bool,
        parent: Option<u32>,
        children: u32,
        holding_children: u32,
        rooted: bool,
    },
}

#[derive(Deserialize)]
struct Tensor {
    key: u128,
    dtype: u8,
    shape: Vec<u64>,
    len: u64,
    data_offset: u64,
    extent: (u64, u64),
    tenant: u8,
}

#[derive(Deserialize)]
struct PinSlot {
    generation: u32,
    pin: Option<(u64, u32, u64, bool)>,
}

#[derive(Deserialize)]
enum Policy {
    Chain,
    Lru,
}

/// A session; its pins and reservations are derived again from the slots.
#[derive(Deserialize)]
struct Session {
    _pins: Vec<(u32, u32)>,
    _reservations: Vec<u32>,
    held_bytes: u64,
    tenant: u8,
}

#[derive(Deserialize)]
struct Counters {
    requests: [u64; 16],
    ok: [u64; 16],
    errors: [u64; 16],
    evictions: u64,
    evicted_bytes: u64,
    replaced: u64,
    pins_held: u64,
    reservations_live: u64,
    stored_bytes: u64,
    hit_bytes: [u64; 16],
    client_limit_hits: u64,
    tenant_limit_hits: u64,
    parents_missing: u64,
    links_cut: u64,
    links_cut_by_eviction: u64,
    unheld_links_cut_by_eviction: u64,
}

#[derive(Deserialize)]
struct Tenants {
    rows: Vec<Tenant>,
    _by_name: Vec<(String, u8)>,
    accounting: bool,
    default_limit: Option<u64>,
    limited_evictable_bytes: u64,
}

/// A tenant row; its eviction list is derived again from the slots.
#[derive(Deserialize)]
struct Tenant {
    name: String,
    limit: Option<u64>,
    pinned_row: bool,
    sessions: u64,
    figures: [u64; 12],
    _list: Vec<(u64, u32)>,
    evictable_bytes: u64,
    lent_bytes: u64,
    borrowed_bytes: u64,
}

impl Store {
    /// As format 6 carries it.
    fn into_state(self) -> Result<state::StoreState, String> {
        let slots = self
            .slots
            .into_iter()
            .enumerate()
            .map(|(i, slot)| slot_record(slot).map_err(|e| format!("slot {i}: {e}")))
            .collect::<Result<_, _>>()?;
        let pin_slots = self
            .pin_slots
            .into_iter()
            .map(|ps| match ps.pin {
                None => state::PinRecord { generation: ps.generation, ..Default::default() },
                Some((session, block_index, count, foreign)) => state::PinRecord {
                    generation: ps.generation,
                    block_index,
                    session,
                    count,
                    flags: state::PIN_LIVE | if foreign { state::PIN_FOREIGN } else { 0 },
                },
            })
            .collect();
        let c = self.counters;
        let t = self.tenants;
        let meta = state::StoreMeta {
            slab_len: self.slab_len,
            policy: match self.policy {
                Policy::Chain => 0,
                Policy::Lru => 1,
            },
            tick: self.tick,
            next_session: self.next_session,
            evictable_bytes: self.evictable_bytes,
            reachable_bytes: self.reachable_bytes,
            orphaned_bytes: self.orphaned_bytes,
            max_session_bytes: self.max_session_bytes,
            counters: state::StoreCounters {
                requests: c.requests.to_vec(),
                ok: c.ok.to_vec(),
                errors: c.errors.to_vec(),
                hit_bytes: c.hit_bytes.to_vec(),
                figures: [
                    c.evictions,
                    c.evicted_bytes,
                    c.replaced,
                    c.pins_held,
                    c.reservations_live,
                    c.stored_bytes,
                    c.client_limit_hits,
                    c.tenant_limit_hits,
                    c.parents_missing,
                    c.links_cut,
                    c.links_cut_by_eviction,
                    c.unheld_links_cut_by_eviction,
                ],
            },
            sessions: self
                .sessions
                .into_iter()
                .map(|(id, s)| state::SessionRecord { id, tenant: s.tenant, held_bytes: s.held_bytes })
                .collect(),
            tenants: t
                .rows
                .into_iter()
                .map(|r| state::TenantRow {
                    name: r.name,
                    limit: r.limit,
                    pinned_row: r.pinned_row,
                    sessions: r.sessions,
                    figures: r.figures,
                    evictable_bytes: r.evictable_bytes,
                    lent_bytes: r.lent_bytes,
                    borrowed_bytes: r.borrowed_bytes,
                })
                .collect(),
            accounting: t.accounting,
            default_limit: t.default_limit,
            limited_evictable_bytes: t.limited_evictable_bytes,
        };
        Ok(state::StoreState {
            meta,
            slots,
            free_slots: self.free_slots,
            pin_slots,
            free_pin_slots: self.free_pin_slots,
        })
    }
}

/// A slot of format 5 as a record of format 6.
fn slot_record(slot: Slot) -> Result<state::SlotRecord, String> {
    let of = |t: &Tensor, kind: state::SlotKind| -> Result<state::SlotRecord, String> {
        if t.shape.len() > kachedb_shm::MAX_DIMS {
            return Err(format!("{} dims", t.shape.len()));
        }
        let mut dims = [0u32; kachedb_shm::MAX_DIMS];
        for (d, &x) in dims.iter_mut().zip(&t.shape) {
            *d = u32::try_from(x).map_err(|_| format!("a dim of {x}"))?;
        }
        let in_page = t
            .data_offset
            .checked_sub(t.extent.0)
            .and_then(|d| u16::try_from(d).ok())
            .ok_or_else(|| format!("data offset {} outside its extent's first page", t.data_offset))?;
        Ok(state::SlotRecord {
            key: t.key,
            extent_offset: t.extent.0,
            extent_len: t.extent.1,
            len: t.len,
            generation: slot.generation,
            parent: state::NO_PARENT,
            dims,
            data_in_page: in_page,
            kind: kind as u8,
            dtype: t.dtype,
            ndim: t.shape.len() as u8,
            tenant: t.tenant,
            ..Default::default()
        })
    };
    Ok(match &slot.state {
        SlotState::Free => state::SlotRecord::free(slot.generation),
        SlotState::Reserved { owner, tensor } => {
            state::SlotRecord { pins_or_owner: *owner, ..of(tensor, state::SlotKind::Reserved)? }
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
            rooted,
        } => state::SlotRecord {
            last_use: *last_use,
            pins_or_owner: *pins,
            foreign_pins: *foreign_pins,
            parent: parent.unwrap_or(state::NO_PARENT),
            children: *children,
            holding_children: *holding_children,
            flags: state::SlotRecord::block_flags(*linked, *counted, *rooted, lru_tick.is_some()),
            ..of(tensor, state::SlotKind::Block)?
        },
    })
}
