//! The store as the takeover state carries it ([`StoreState`], format 6,
//! `crate::takeover::state`): [`Store::to_state`] writes every table in one
//! pass — slots with their generations, pin slots, free lists, sessions,
//! counters, tenants — so the handles clients hold (slot index and
//! generation) name the same reservations and pins in the new daemon;
//! [`Store::from_state`] builds a store from it in one pass over the records
//! with pre-sized tables (the key index and the allocator each on a thread
//! of its own meanwhile), deriving the indexes (keys, chain links, eviction
//! lists, the allocator's free extents, each session's pins and
//! reservations), and checks the whole store before it is served from.

use super::session::Session;
use super::slots::{PinSlot, Slot, SlotState, MAX_SLOTS};
use super::{tenants, Counters, EvictionPolicy, SessionId, Store, Tensor};
use crate::alloc::{Extent, ExtentAllocator};
use crate::takeover::state::{
    PinRecord, SessionRecord, SlotKind, SlotRecord, StoreMeta, StoreState, FLAG_COUNTED, FLAG_LINKED, FLAG_LISTED,
    FLAG_ROOTED, NO_PARENT, PIN_FOREIGN, PIN_LIVE,
};
use kachedb_shm::{DType, Shape};
use std::collections::{BTreeMap, BTreeSet, HashMap};

impl Store {
    /// The store as the takeover state carries it.
    pub(crate) fn to_state(&self) -> StoreState {
        let slots = self.slots.iter().map(slot_record).collect();
        let pin_slots = self
            .pin_slots
            .iter()
            .map(|ps| match ps.pin {
                None => PinRecord { generation: ps.generation, ..PinRecord::default() },
                Some(p) => PinRecord {
                    generation: ps.generation,
                    block_index: p.block_index,
                    session: p.session.0,
                    count: p.count,
                    flags: PIN_LIVE | if p.foreign { PIN_FOREIGN } else { 0 },
                },
            })
            .collect();
        let (accounting, default_limit, limited_evictable_bytes) = self.tenants.settings();
        let meta = StoreMeta {
            slab_len: self.slab_len,
            policy: match self.policy {
                EvictionPolicy::Chain => 0,
                EvictionPolicy::Lru => 1,
            },
            tick: self.tick,
            next_session: self.next_session,
            evictable_bytes: self.evictable_bytes,
            reachable_bytes: self.reachable_bytes,
            orphaned_bytes: self.orphaned_bytes,
            max_session_bytes: self.max_session_bytes,
            counters: self.counters.to_state(),
            sessions: self
                .sessions
                .iter()
                .map(|(id, s)| SessionRecord { id: id.0, tenant: s.tenant, held_bytes: s.held_bytes })
                .collect(),
            tenants: self.tenants.to_rows(),
            accounting,
            default_limit,
            limited_evictable_bytes,
        };
        StoreState {
            meta,
            slots,
            free_slots: self.free_slots.clone(),
            pin_slots,
            free_pin_slots: self.free_pin_slots.clone(),
        }
    }

    /// The store `st` describes, for the megaslab of `slab_len` bytes at
    /// `slab_offset`, if it manages that megaslab and passes the full
    /// invariant check; otherwise why not. Nothing in `st` is trusted
    /// further than that check.
    pub(crate) fn from_state(st: StoreState, slab_offset: u64, slab_len: u64) -> Result<Store, String> {
        let StoreState { meta, slots: records, free_slots, pin_slots: pin_records, free_pin_slots } = st;
        if meta.slab_len != slab_len {
            return Err(format!(
                "the store manages a megaslab of {} bytes, the region's is {slab_len} bytes",
                meta.slab_len
            ));
        }
        if records.len() > MAX_SLOTS || pin_records.len() > MAX_SLOTS {
            return Err("more slots than a store holds".into());
        }
        let policy = match meta.policy {
            0 => EvictionPolicy::Chain,
            1 => EvictionPolicy::Lru,
            p => return Err(format!("eviction policy code {p}")),
        };
        let rows = &meta.tenants;
        let mut sessions: BTreeMap<SessionId, Session> = meta
            .sessions
            .iter()
            .map(|s| (SessionId(s.id), Session { tenant: s.tenant, held_bytes: s.held_bytes, ..Session::default() }))
            .collect();
        // The key index and the allocator are built beside the slots, each
        // on a thread of its own: they read only the records.
        // (Where a thread cannot start, its part is built here after the slots.)
        let allocator = || {
            let extents = records
                .iter()
                .filter(|r| r.kind != SlotKind::Free as u8)
                .map(|r| Extent { offset: r.extent_offset, len: r.extent_len })
                .collect();
            ExtentAllocator::with_allocated(slab_offset, slab_len, extents)
        };
        let (slots, links, lru, lists, keys, alloc) = std::thread::scope(|scope| {
            let spawn = |name: &str| std::thread::Builder::new().name(format!("kachedb-restore-{name}"));
            let keys = spawn("keys").spawn_scoped(scope, || key_index(&records)).ok();
            let alloc = spawn("alloc").spawn_scoped(scope, allocator).ok();
            let built = build_slots(&records, rows, &mut sessions);
            let keys = match keys {
                Some(t) => t.join().map_err(|_| "building the key index failed".to_string())?,
                None => key_index(&records),
            };
            let alloc = match alloc {
                Some(t) => t.join().map_err(|_| "building the allocator failed".to_string())?,
                None => allocator(),
            };
            let (slots, links, lru, lists) = built?;
            Ok::<_, String>((slots, links, lru, lists, keys?, alloc?))
        })?;
        let mut pin_slots = Vec::with_capacity(pin_records.len());
        for (i, p) in pin_records.iter().enumerate() {
            let pin = if p.flags & PIN_LIVE == 0 {
                None
            } else {
                let session = SessionId(p.session);
                let s = sessions.get_mut(&session).ok_or_else(|| format!("pin slot {i} of no session"))?;
                if s.pins.insert(p.block_index, i as u32).is_some() {
                    return Err(format!("pin slot {i}: a second pin record of its session for one block"));
                }
                Some(super::slots::Pin {
                    session,
                    block_index: p.block_index,
                    count: p.count,
                    foreign: p.flags & PIN_FOREIGN != 0,
                })
            };
            pin_slots.push(PinSlot { generation: p.generation, pin });
        }
        let to_list = |v: Vec<(u64, u32)>| -> BTreeMap<u64, u32> { v.into_iter().collect() };
        let tenants = tenants::Tenants::from_rows(
            rows,
            lists.into_iter().map(to_list).collect(),
            meta.accounting,
            meta.default_limit,
            meta.limited_evictable_bytes,
        )?;
        let mut store = Store::new(slab_offset, slab_len);
        store.alloc = alloc;
        store.slots = slots;
        store.free_slots = free_slots;
        store.pin_slots = pin_slots;
        store.free_pin_slots = free_pin_slots;
        store.keys = keys;
        store.lru = to_list(lru);
        store.links = links.into_iter().collect::<BTreeSet<_>>();
        store.policy = policy;
        store.tick = meta.tick;
        // Ticks of another build may lie below the cold ones: checked once, at the first read-ahead (`evict.rs`).
        store.cold_ok = None;
        store.evictable_bytes = meta.evictable_bytes;
        store.sessions = sessions;
        store.next_session = meta.next_session;
        store.counters = Counters::from_state(&meta.counters)?;
        store.max_session_bytes = meta.max_session_bytes;
        store.tenants = tenants;
        store.reachable_bytes = meta.reachable_bytes;
        store.orphaned_bytes = meta.orphaned_bytes;
        store.check_invariants()?;
        Ok(store)
    }
}

/// The slots of `records`, their chain links (parent, child), the blocks on
/// the store's eviction list and on each tenant's (tick, slot); each
/// reservation listed by its session in `sessions`.
type Built = (Vec<Slot>, Vec<(u32, u32)>, Vec<(u64, u32)>, Vec<Vec<(u64, u32)>>);

fn build_slots(
    records: &[SlotRecord],
    rows: &[crate::takeover::state::TenantRow],
    sessions: &mut BTreeMap<SessionId, Session>,
) -> Result<Built, String> {
    let mut slots = Vec::with_capacity(records.len());
    let mut links = Vec::new();
    let mut lru = Vec::new();
    let mut lists: Vec<Vec<(u64, u32)>> = vec![Vec::new(); rows.len()];
    for (i, r) in records.iter().enumerate() {
        let index = i as u32;
        let state = if r.kind == SlotKind::Free as u8 {
            SlotState::Free
        } else {
            let tensor = tensor_of(r).map_err(|e| format!("slot {index}: {e}"))?;
            if usize::from(r.tenant) >= rows.len() {
                return Err(format!("slot {index}: tenant row {}", r.tenant));
            }
            if r.kind == SlotKind::Reserved as u8 {
                let owner = SessionId(r.pins_or_owner);
                let s = sessions.get_mut(&owner).ok_or_else(|| format!("reservation {index} of no session"))?;
                s.reservations.insert(index);
                SlotState::Reserved { owner, tensor }
            } else if r.kind == SlotKind::Block as u8 {
                let linked = r.flags & FLAG_LINKED != 0;
                let parent = (r.parent != NO_PARENT).then_some(r.parent);
                if let Some(p) = parent {
                    links.push((p, index));
                }
                let listed = r.flags & FLAG_LISTED != 0;
                if listed {
                    if rows[usize::from(r.tenant)].limit.is_some() {
                        lists[usize::from(r.tenant)].push((r.last_use, index));
                    } else {
                        lru.push((r.last_use, index));
                    }
                }
                SlotState::Block {
                    tensor,
                    linked,
                    pins: r.pins_or_owner,
                    foreign_pins: r.foreign_pins,
                    lru_tick: listed.then_some(r.last_use),
                    last_use: r.last_use,
                    counted: r.flags & FLAG_COUNTED != 0,
                    parent,
                    children: r.children,
                    holding_children: r.holding_children,
                    rooted: r.flags & FLAG_ROOTED != 0,
                }
            } else {
                return Err(format!("slot {index}: kind code {}", r.kind));
            }
        };
        slots.push(Slot { generation: r.generation, state });
    }
    Ok((slots, links, lru, lists))
}

/// The linked blocks' keys, key -> slot; `Err` on a key linked twice.
fn key_index(records: &[SlotRecord]) -> Result<HashMap<u128, u32>, String> {
    let mut keys = HashMap::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        if r.kind == SlotKind::Block as u8 && r.flags & FLAG_LINKED != 0 && keys.insert(r.key, i as u32).is_some() {
            return Err(format!("slot {i}: a second linked block of its key"));
        }
    }
    Ok(keys)
}

#[cfg(test)]
impl Store {
    /// `self` carried through the takeover state's encoding into a new store.
    pub(super) fn carried(&self, slab_offset: u64, slab_len: u64) -> Result<Store, String> {
        let serve = crate::takeover::state::ServeState { store: self.to_state(), ..Default::default() };
        let bytes = crate::takeover::state::encode(&serve)?;
        Store::from_state(crate::takeover::state::decode(&bytes)?.store, slab_offset, slab_len)
    }
}

/// A slot as its record.
fn slot_record(slot: &Slot) -> SlotRecord {
    let of = |t: &Tensor, kind: SlotKind| {
        let mut dims = [0u32; kachedb_shm::MAX_DIMS];
        dims[..t.shape.ndim()].copy_from_slice(t.shape.dims());
        SlotRecord {
            key: t.key,
            extent_offset: t.extent.offset,
            extent_len: t.extent.len,
            len: t.len,
            generation: slot.generation,
            parent: NO_PARENT,
            dims,
            // Less than a page (the store's invariant; the reader checks it).
            data_in_page: (t.data_offset - t.extent.offset) as u16,
            kind: kind as u8,
            dtype: t.dtype as u8,
            ndim: t.shape.ndim() as u8,
            tenant: t.tenant,
            ..SlotRecord::default()
        }
    };
    match &slot.state {
        SlotState::Free => SlotRecord::free(slot.generation),
        SlotState::Reserved { owner, tensor } => {
            SlotRecord { pins_or_owner: owner.0, ..of(tensor, SlotKind::Reserved) }
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
        } => SlotRecord {
            last_use: *last_use,
            pins_or_owner: *pins,
            foreign_pins: *foreign_pins,
            parent: parent.unwrap_or(NO_PARENT),
            children: *children,
            holding_children: *holding_children,
            flags: SlotRecord::block_flags(*linked, *counted, *rooted, lru_tick.is_some()),
            ..of(tensor, SlotKind::Block)
        },
    }
}

/// The tensor of a reservation's or block's record; `Err` on a dtype code,
/// shape or offset no tensor has.
fn tensor_of(r: &SlotRecord) -> Result<Tensor, String> {
    let dtype = DType::from_code(r.dtype).ok_or_else(|| format!("dtype code {}", r.dtype))?;
    let dims = r.dims.get(..usize::from(r.ndim)).ok_or_else(|| format!("{} dims", r.ndim))?;
    let mut wide = [0u64; kachedb_shm::MAX_DIMS];
    for (w, &d) in wide.iter_mut().zip(dims) {
        *w = u64::from(d);
    }
    let shape = Shape::new(&wide[..dims.len()]).ok_or_else(|| format!("shape {dims:?}"))?;
    let data_offset =
        r.extent_offset.checked_add(u64::from(r.data_in_page)).ok_or_else(|| "data offset past u64".to_string())?;
    Ok(Tensor {
        key: r.key,
        dtype,
        shape,
        len: r.len,
        data_offset,
        extent: Extent { offset: r.extent_offset, len: r.extent_len },
        tenant: r.tenant,
    })
}

/// A [`DType`] as its wire code, in the store's serialized form (the
/// tests compare stores by it).
#[cfg(test)]
pub(super) fn dtype_code<S: serde::Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u8(*d as u8)
}

/// A [`Shape`] as its list of dims, in the store's serialized form.
#[cfg(test)]
pub(super) fn shape_dims<S: serde::Serializer>(shape: &Shape, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(shape.dims())
}

#[cfg(test)]
mod tests {
    use super::super::{EvictionPolicy, SessionId, StoreStats};
    use super::*;
    use kachedb_shm::{Request, Status};

    fn reserve(st: &mut Store, s: SessionId, key: u128, len: u64) -> u64 {
        let shape = Shape::for_bytes(len).unwrap();
        let c = st.handle(s, 1, &Request::Reserve { key, dtype: DType::U8, shape, len, page_offset: 0 });
        assert_eq!(c.status, Status::Ok);
        c.handle
    }

    /// A store carried through its serialized form answers every request as
    /// the original does: the same handles work, pins and reservations are
    /// the same, eviction takes the same blocks next.
    #[test]
    fn a_restored_store_behaves_as_the_original() {
        let mut a = Store::new(4096, 64 * 4096);
        a.set_eviction_policy(EvictionPolicy::Chain);
        let (s1, s2) = (a.open_session(), a.open_session());
        for k in 1..=10u128 {
            let h = reserve(&mut a, s1, k, 4096 * 2);
            let parent = (k > 1).then_some(k - 1);
            assert_eq!(a.handle(s1, 2, &Request::Commit { handle: h, parent }).status, Status::Ok);
        }
        let pin = a.handle(s2, 3, &Request::Get { key: 5 });
        assert_eq!(pin.status, Status::Ok);
        let open = reserve(&mut a, s2, 99, 4096);
        let mut b = Store::from_state(carried(&a), 4096, 64 * 4096).unwrap();
        // The request window starts again in the new daemon (its sketch does not travel).
        let no_window = |mut st: StoreStats| {
            (st.window_distinct_keys, st.window_key_requests, st.working_set_bytes) = (0, 0, 0);
            st.hit_ratio_ceiling = 0.0;
            st
        };
        assert_eq!(no_window(a.stats()), b.stats());
        a.restart_window();
        // The same requests give the same answers from here on.
        let script = [
            (s2, Request::Release { handle: pin.handle }),
            (s2, Request::Commit { handle: open, parent: Some(10) }),
            (
                s1,
                Request::Reserve {
                    key: 50,
                    dtype: DType::U8,
                    shape: Shape::for_bytes(40 * 4096).unwrap(),
                    len: 40 * 4096,
                    page_offset: 0,
                },
            ),
            (s1, Request::Lookup { key: 1 }),
            (s1, Request::Get { key: 10 }),
            (s2, Request::Release { handle: pin.handle }),
        ];
        for (s, r) in &script {
            let (x, y) = (a.handle(*s, 7, r), b.handle(*s, 7, r));
            assert_eq!((x.status, x.handle, x.offset), (y.status, y.handle, y.offset), "{r:?}");
        }
        b.check_invariants().unwrap();
        assert_eq!(a.stats(), b.stats());
    }

    /// `st` through the takeover state's encoding and back.
    fn carried(st: &Store) -> StoreState {
        let serve = crate::takeover::state::ServeState { store: st.to_state(), ..Default::default() };
        let bytes = crate::takeover::state::encode(&serve).unwrap();
        crate::takeover::state::decode(&bytes).unwrap().store
    }

    /// A state for another megaslab, or one whose tables disagree, is
    /// refused with the reason.
    #[test]
    fn a_state_for_another_megaslab_or_broken_is_refused() {
        let mut a = Store::new(4096, 64 * 4096);
        let s = a.open_session();
        for key in [1, 2] {
            let h = reserve(&mut a, s, key, 4096);
            assert_eq!(a.handle(s, 2, &Request::Commit { handle: h, parent: None }).status, Status::Ok);
        }
        let st = carried(&a);
        assert!(Store::from_state(st.clone(), 4096, 32 * 4096).unwrap_err().contains("megaslab"));
        // Two blocks on one extent.
        let mut c = st.clone();
        c.slots[1].extent_offset = c.slots[0].extent_offset;
        assert!(Store::from_state(c, 4096, 64 * 4096).unwrap_err().contains("overlaps"));
        // An extent past the megaslab.
        let mut c = st.clone();
        c.slots[0].extent_offset = 4096 + 64 * 4096;
        assert!(Store::from_state(c, 4096, 64 * 4096).is_err());
        // Two linked blocks of one key.
        let mut c = st.clone();
        c.slots[1].key = c.slots[0].key;
        assert!(Store::from_state(c, 4096, 64 * 4096).unwrap_err().contains("key"));
        // A block counted as a child it does not have.
        let mut c = st.clone();
        c.slots[0].children = 1;
        assert!(Store::from_state(c, 4096, 64 * 4096).is_err());
        // A dtype code no tensor has.
        let mut c = st.clone();
        c.slots[0].dtype = 200;
        assert!(Store::from_state(c, 4096, 64 * 4096).unwrap_err().contains("dtype"));
        // The original is taken as it is.
        assert!(Store::from_state(st, 4096, 64 * 4096).is_ok());
    }
}

/// The takeover's store work at a size (`KDB_TAKEOVER_BLOCKS`, 100 000 by
/// default), phase by phase, in wall and thread CPU time: a measurement,
/// run by hand (`cargo test --release -p kachedb-daemon --lib
/// takeover_phases -- --ignored --nocapture`); it asserts only that the
/// store comes back whole.
#[cfg(test)]
mod scale {
    use super::*;
    use kachedb_shm::{Request, Status};
    use std::time::Instant;

    fn cpu_ms() -> f64 {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 / 1e6
    }

    #[test]
    #[ignore = "a measurement: run by hand"]
    fn takeover_phases() {
        let n: u64 = std::env::var("KDB_TAKEOVER_BLOCKS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
        let slab = (n + 64) * 4096;
        let mut st = Store::new(4096, slab);
        let s = st.open_session();
        let shape = Shape::for_bytes(4096).unwrap();
        for k in 0..n {
            let key = u128::from(k) + 1;
            let r = st.handle(s, 1, &Request::Reserve { key, dtype: DType::U8, shape, len: 4096, page_offset: 0 });
            assert_eq!(r.status, Status::Ok);
            let parent = (k % 16 != 0).then_some(key - 1);
            assert_eq!(st.handle(s, 2, &Request::Commit { handle: r.handle, parent }).status, Status::Ok);
        }
        let phase = |name: &str, t: (Instant, f64)| {
            eprintln!(
                "{n} blocks: {name:<28} {:8.1} ms wall {:8.1} ms cpu",
                t.0.elapsed().as_secs_f64() * 1e3,
                cpu_ms() - t.1
            );
        };
        let now = || (Instant::now(), cpu_ms());
        let t = now();
        let state = st.to_state();
        phase("to_state (old daemon)", t);
        let t = now();
        let bytes =
            crate::takeover::state::encode(&crate::takeover::state::ServeState { store: state, ..Default::default() })
                .unwrap();
        phase("encode (old daemon)", t);
        let t = now();
        let back = crate::takeover::state::decode(&bytes).unwrap();
        phase("decode (new daemon)", t);
        let t = now();
        let restored = Store::from_state(back.store, 4096, slab).unwrap();
        phase("from_state, check included", t);
        let t = now();
        restored.check_invariants().unwrap();
        phase("of which the check", t);
        assert_eq!(restored.stats().blocks, n);
        eprintln!("{n} blocks: {} bytes of state", bytes.len());
    }
}
