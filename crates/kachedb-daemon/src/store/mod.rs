//! `Store`: the block index of the daemon — 128-bit keys to committed blocks
//! in the megaslab, two-phase writes, per-session pins, chain-aware LRU eviction.
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
//! * A block belongs to the **tenant** of the session that reserved it
//!   (`tenants.rs`). Any session may GET or LOOKUP any block (keys are shared
//!   across tenants on purpose), but a block of a tenant bound to uids or
//!   gids may be replaced (COMMIT of its key) or deleted only by that
//!   tenant's sessions and the daemon's own; anyone else gets `DENIED`, and
//!   nothing changes (a refused COMMIT leaves its reservation open).
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
//! # Chains
//!
//! A COMMIT may name a **parent**: the key of the block that precedes this
//! one in a prefix chain. The link is made if the parent's key has a linked
//! block (other than the one being committed); otherwise the block is
//! committed without a parent (counted in `parents_missing`) and stays so. A
//! link is between two linked blocks; when a parent is unlinked (DELETE, a
//! newer block of its key, or eviction under the LRU policy) its children stay,
//! as blocks without a parent (`links_cut`). A block is linked to a parent only
//! while it has no children (at its COMMIT), so links never form a cycle.
//!
//! # Eviction
//!
//! When a RESERVE does not fit in any free extent, blocks are evicted from the
//! head of the **eviction list**, one at a time (each freed extent coalesces
//! with its neighbours), until the reservation fits. The list holds linked
//! unpinned blocks in least-recently-used order; under
//! [`EvictionPolicy::Chain`] (the default) only those that no child *holds*
//! (the leaves; a child holds its parent when it is of the same tenant and
//! not pinned only by other tenants' clients, `tenants.rs`): evicting a leaf
//! may make its parent a leaf, which joins the list at its own last use. So
//! under `Chain` a linked block's ancestors of its own tenant stay linked
//! while it is unpinned or pinned by its own tenant: eviction never leaves a
//! hole in a tenant's own chain. Under [`EvictionPolicy::Lru`] every linked
//! unpinned block is on the list. "Used" means committed, found by GET or
//! LOOKUP, or released by its last pin. Pinned blocks, unlinked-but-pinned
//! blocks and reservations are never on the list. If even freeing every
//! linked unpinned block could not give enough bytes (`free + evictable <
//! needed`) the answer is `OUT_OF_MEMORY` at once. Otherwise eviction
//! proceeds; if the list runs empty first (fragmentation by pinned blocks or
//! reservations, or, under `Chain`, unpinned ancestors of pinned blocks) the
//! answer is `OUT_OF_MEMORY` too. **A refused request changes nothing**: the
//! blocks evicted on the way are put back as they were (`unit.rs`), and so
//! are those of a refused reservation unit.
//!
//! # Cost
//!
//! Every request is `O(log n)` (B-tree indexes for free extents, the LRU list
//! and per-session records; a hash map for keys), except a RESERVE that evicts,
//! which is `O(log n)` per block evicted, and an unlink of a block with `k`
//! children (DELETE, replacement, LRU eviction of a parent), `O(k log n)`.
//! `close_session` is `O(p log n)` in the session's pins and reservations.
//! Undoing a refused request or unit costs what it did.
//!
//! # Files
//!
//! `mod.rs` the [`Store`] and its request dispatch; `session` client sessions
//! (their pins and reservations, closing); `blocks` the operations on
//! reservations and blocks; `evict` the eviction list, chain links and
//! eviction; `slots` the
//! slot tables behind handles, `handles` the handle encoding; `counters` what
//! is counted; `check` the invariant check; `state` the store's serialized
//! form (handed to a new daemon by a takeover); `unit` reservation units and
//! the undo journal that makes a refused request change nothing; `changes`
//! the log of the index's changes that the KV event publisher reads.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use kachedb_shm::{BlockMeta, Completion, DType, Op, OutOfMemoryCause, Request, Shape, Status};

use crate::alloc::{Extent, ExtentAllocator};

mod blocks;
#[cfg(test)]
mod chain_tests;
mod changes;
mod check;
mod counters;
mod evict;
mod gauges;
mod handles;
mod meta;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod ownership_tests;
mod session;
mod slots;
mod state;
#[cfg(test)]
mod tenant_tests;
mod tenants;
#[cfg(test)]
mod tests;
mod unit;
#[cfg(test)]
mod unit_tests;

pub use changes::IndexChange;
pub use evict::EvictionPolicy;
pub use gauges::Gauges;
pub use kachedb_shm::control::StoreStats;
pub use tenants::{TenantFigures, TenantId};

use counters::Counters;
use session::Session;
use slots::{PinSlot, Slot, SlotState};

/// Identifies a client session (one per control-socket connection). Ids are
/// never reused within one [`Store`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(test, derive(serde::Serialize))]
pub struct SessionId(u64);

impl SessionId {
    /// The id as a number (for logs, stats and the takeover state).
    pub fn as_u64(self) -> u64 {
        self.0
    }

    /// The id `id` names (a session handed over by a takeover).
    pub(crate) fn from_u64(id: u64) -> SessionId {
        SessionId(id)
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

/// What a reservation or block holds.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(test, derive(serde::Serialize))]
struct Tensor {
    key: u128,
    #[cfg_attr(test, serde(serialize_with = "state::dtype_code"))]
    dtype: DType,
    #[cfg_attr(test, serde(serialize_with = "state::shape_dims"))]
    shape: Shape,
    /// Tensor bytes.
    len: u64,
    /// Start of the tensor bytes, bytes from the region base; inside `extent`,
    /// less than one page past its start.
    data_offset: u64,
    extent: Extent,
    /// The tenant it belongs to: the reserving session's.
    tenant: TenantId,
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
#[cfg_attr(test, derive(serde::Serialize))]
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
    /// The eviction list: the blocks eviction may take now (linked, unpinned,
    /// and under [`EvictionPolicy::Chain`] without children), last-use tick ->
    /// slot index; first = least recent.
    lru: BTreeMap<u64, u32>,
    /// Chain links between linked blocks: (parent, child) slot indexes.
    links: BTreeSet<(u32, u32)>,
    policy: EvictionPolicy,
    /// Last tick handed out; each use takes a fresh one, at least
    /// [`COLD_TICKS`] (the ticks below are the cold blocks': `evict.rs`).
    tick: u64,
    /// Whether every block's last use is a use's tick or its own cold tick,
    /// so that [`make_cold`](Store::make_cold) cannot collide with one:
    /// `Some(true)` for a new store; checked once (`None`) in a store handed
    /// over by a daemon that may have given out ticks below [`COLD_TICKS`].
    #[cfg_attr(test, serde(skip))]
    cold_ok: Option<bool>,
    /// Sum of the extent lengths of the linked unpinned blocks, bytes (under
    /// the chain policy more than the list holds: parents join it as their
    /// children go).
    evictable_bytes: u64,
    sessions: BTreeMap<SessionId, Session>,
    next_session: u64,
    /// What has happened; gauges are computed by `stats`.
    counters: Counters,
    /// Most extent bytes one session may hold (`None`: no limit).
    max_session_bytes: Option<u64>,
    /// Most extent bytes the sessions of one uid may hold together (`None`:
    /// no limit). Set from the command line, also after a takeover.
    #[cfg_attr(test, serde(skip))]
    max_uid_bytes: Option<u64>,
    /// Extent bytes held by the sessions of each uid (entries above 0 only);
    /// the sum of their `held_bytes`. Rebuilt by `set_session_uid`.
    #[cfg_attr(test, serde(skip))]
    uid_held: BTreeMap<u32, u64>,
    /// Set when the request being handled was refused by that limit: its
    /// OUT_OF_MEMORY answer then carries the limit in `offset`.
    limit_hit: Option<u64>,
    /// `limit_hit` is the tenant's limit (`tenants.rs`).
    #[cfg_attr(test, serde(skip))]
    tenant_limit_hit: bool,
    /// The tenant table, their limits and eviction lists (`tenants.rs`).
    tenants: tenants::Tenants,
    /// Extent bytes of the linked blocks whose chain is whole (`rooted`),
    /// and of the other linked blocks; the sums of the tenants' figures.
    reachable_bytes: u64,
    orphaned_bytes: u64,
    /// While a request or reservation unit is being served: what it changed,
    /// to undo if it is refused (`unit.rs`). Closed and empty between requests.
    #[cfg_attr(test, serde(skip))]
    journal: unit::Journal,
    /// The index's changes for the KV event publisher (`changes.rs`); off
    /// unless [`log_changes`](Store::log_changes) turned it on.
    #[cfg_attr(test, serde(skip))]
    changes: changes::ChangeLog,
    /// The block metadata records (META) of reservations and blocks, by
    /// slot index: an entry lives exactly as long as its slot is not free
    /// (`meta.rs`). Not handed over at a takeover.
    #[cfg_attr(test, serde(skip))]
    metas: HashMap<u32, Arc<BlockMeta>>,
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
            links: BTreeSet::new(),
            policy: EvictionPolicy::default(),
            tick: evict::COLD_TICKS,
            cold_ok: Some(true),
            evictable_bytes: 0,
            sessions: BTreeMap::new(),
            next_session: 1,
            counters: Counters::default(),
            max_session_bytes: None,
            max_uid_bytes: None,
            uid_held: BTreeMap::new(),
            limit_hit: None,
            tenant_limit_hit: false,
            tenants: tenants::Tenants::default(),
            reachable_bytes: 0,
            orphaned_bytes: 0,
            journal: unit::Journal::default(),
            changes: changes::ChangeLog::default(),
            metas: HashMap::new(),
        }
    }

    /// Answers one request of session `s`. Never panics. A request of a session
    /// that is not open gets `INTERNAL` (the serve loop must not do that).
    pub fn handle(&mut self, s: SessionId, request_id: u32, req: &Request) -> Completion {
        let op = req.op();
        self.counters.request(op);
        self.limit_hit = None;
        self.tenant_limit_hit = false;
        let (open, tenant, internal) = match self.sessions.get(&s) {
            Some(x) => (true, x.tenant, x.internal),
            None => (false, tenants::DEFAULT_ROW, false),
        };
        let result = if open {
            match *req {
                Request::Ping => Ok(Reply::default()),
                Request::Reserve { key, dtype, shape, len, page_offset } => {
                    self.atomically(|st| st.reserve(s, key, dtype, shape, len, page_offset))
                }
                Request::Commit { handle, parent } => self.commit(s, handle, parent),
                Request::CommitPin { handle, parent } => self.commit_pin(s, handle, parent),
                Request::CommitAs { handle, key, parent, pin } => self.commit_as(s, handle, key, parent, pin),
                Request::Abort { handle } => self.abort(s, handle),
                // The record is in shared memory, which the store does not
                // map: the serve loop answers META with `handle_meta`.
                Request::Meta { .. } => Err(Status::Invalid),
                // A WAIT is a GET here; the serve loop parks it while NOT_FOUND.
                Request::Get { key } => {
                    let r = self.atomically(|st| st.get(s, key));
                    if !internal && matches!(r, Ok(_) | Err(Status::NotFound)) {
                        self.count_request(tenant, Op::Get, key, r.is_ok());
                    }
                    r
                }
                Request::Wait { key, .. } => self.atomically(|st| st.get(s, key)),
                Request::Release { handle } => self.release(s, handle),
                Request::Lookup { key } => {
                    let r = self.lookup(key);
                    if !internal {
                        self.count_request(tenant, Op::Lookup, key, r.is_ok());
                    }
                    r
                }
                Request::Delete { key } => self.delete(s, key),
                Request::Stats => {
                    Ok(Reply { handle: self.keys.len() as u64, offset: self.alloc.used_bytes(), tensor: None })
                }
            }
        } else {
            Err(Status::Internal)
        };
        match result {
            Ok(reply) => {
                self.counters.answer(op, Status::Ok);
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
                self.counters.answer(op, status);
                // OUT_OF_MEMORY because of a limit: `handle` and `offset` say which.
                let (handle, offset) = match (status, self.limit_hit) {
                    (Status::OutOfMemory, Some(limit)) if self.tenant_limit_hit => {
                        OutOfMemoryCause::TenantLimit(limit).fields()
                    }
                    (Status::OutOfMemory, Some(limit)) => OutOfMemoryCause::ClientLimit(limit).fields(),
                    _ => (0, 0),
                };
                Completion { request_id, op, status, handle, offset, tensor: None }
            }
        }
    }

    /// Answers a request the daemon makes for itself (the remote tier's pins
    /// and fills, in its own session): as [`handle`](Self::handle), but not
    /// counted among the clients' requests, answers and hits.
    pub fn handle_internal(&mut self, s: SessionId, req: &Request) -> Completion {
        let saved = self.counters.clone();
        let c = self.handle(s, 0, req);
        self.counters.restore_requests(&saved);
        c
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

    /// The key of session `s`'s reservation `handle`, if it is one (the serve
    /// loop asks before a COMMIT, to wake the WAITs of that key).
    pub fn reservation_key(&self, s: SessionId, handle: u64) -> Option<u128> {
        let index = self.own_reservation(s, handle).ok()?;
        match &self.slots.get(index as usize)?.state {
            SlotState::Reserved { tensor, .. } => Some(tensor.key),
            _ => None,
        }
    }

    /// Counters and gauges, in `O(1)` (a stats answer costs the serve loop the
    /// same with a hundred blocks or a million).
    pub fn stats(&self) -> StoreStats {
        let mut st = StoreStats::default();
        self.counters.fill(&mut st);
        st.sessions = self.sessions.len() as u64;
        st.blocks = self.keys.len() as u64;
        st.reserved = self.counters.reservations_live();
        st.unlinked_blocks = self.unlinked_blocks();
        st.pins = self.counters.pins_held();
        st.bytes_used = self.alloc.used_bytes();
        st.bytes_free = self.alloc.free_bytes();
        st.bytes_total = self.alloc.total_bytes();
        st.largest_free_bytes = self.alloc.largest_free();
        st.evictable_bytes = self.evictable_bytes;
        st.free_extents = self.alloc.free_extent_count() as u64;
        st.eviction_policy = self.policy.name().to_string();
        st.chained_blocks = self.links.len() as u64;
        st.reachable_bytes = self.reachable_bytes;
        st.orphaned_bytes = self.orphaned_bytes;
        let (distinct, requests) = self.window();
        st.window_distinct_keys = distinct;
        st.window_key_requests = requests;
        if requests > 0 {
            st.hit_ratio_ceiling = 1.0 - (distinct.min(requests) as f64 / requests as f64);
        }
        let resident = self.reachable_bytes + self.orphaned_bytes;
        st.working_set_bytes = distinct.saturating_mul(resident.checked_div(self.keys.len() as u64).unwrap_or(0));
        st
    }

    /// Blocks no longer reachable by key but still pinned: the slots in use,
    /// less the reservations and the linked blocks (`keys`). `O(1)`;
    /// [`check_invariants`](Store::check_invariants) counts them by walking.
    pub(super) fn unlinked_blocks(&self) -> u64 {
        let in_use = self.slots.len() - self.free_slots.len();
        (in_use as u64).saturating_sub(self.counters.reservations_live() + self.keys.len() as u64)
    }
}
