//! Tenants: whose bytes these are. Every reservation and block belongs to
//! the tenant of the session that reserved it (a client names its tenant in
//! its hello; the daemon's own sessions, and clients that name none, are the
//! [`DEFAULT_TENANT`]'s). The store counts per tenant what it counts in
//! total — bytes, blocks, hits, misses, evictions, reachable and orphaned
//! bytes, the request window — so the rows add up to the totals exactly.
//!
//! # Rows
//!
//! At most [`MAX_TENANTS`] rows: row 0 is the default tenant, the last row
//! [`OTHER_TENANT`], the rest are given to tenant names as clients bring
//! them (the names of `--tenant-limit` first, for good). A name that finds
//! every row taken is counted in `_other` (it is served as any client, and
//! `_other` has the default limit, shared by all it holds): an operator
//! keeps a bounded `tenant` label and every client keeps its cache. A row
//! whose tenant has no client, no bytes and no limit of its own is given to
//! the next new name (its counters start from zero again).
//!
//! # Limits
//!
//! A tenant with a limit (`--tenant-limit NAME=SIZE`, else
//! `--tenant-limit-default`) keeps its evictable blocks on an eviction list
//! of its own; the blocks of tenants without one are on the store's list
//! (`Store::lru`). The limit bounds the tenant's **charged bytes**
//! ([`Store::charged_bytes`]): the extent bytes of its reservations and
//! blocks, less its *lent* blocks (pinned, and only by other tenants'
//! clients), plus the other tenants' blocks its clients pin (*borrowed*,
//! each block once per client session). So a pin is charged to the tenant
//! that made it: the daemon's own sessions (the tiers' write-behind pins)
//! pin for the block's tenant. A RESERVE of tenant T (see `evict.rs`):
//!
//! 1. if T's charged bytes plus the new extent pass T's limit, evicts from
//!    T's own list (least recently used leaves first, as the policy says)
//!    until they do not; if even that could not make it fit (checked first
//!    by a dry run of the same order), the answer is OUT_OF_MEMORY with
//!    [`OutOfMemoryCause::TenantLimit`](kachedb_shm::OutOfMemoryCause) and
//!    nothing is evicted;
//! 2. if the megaslab has no room, evicts the least recently used of the
//!    heads of the store's list and (if T has a limit) T's own list.
//!
//! A GET (or WAIT) by T's client that pins another tenant's block for that
//! session the first time does step 1 for the block's extent: it evicts T's
//! own blocks to make room within T's limit, or is refused the same way.
//!
//! Chain links (`evict.rs`): under the chain policy a block is held off its
//! list only by its *holding* children, those of its own tenant that are
//! not lent. Another tenant's child, or a child pinned only by another
//! tenant's client, does not keep it cached: its eviction cuts that link.
//!
//! So a tenant's blocks are evicted only by itself, or, for a tenant without
//! a limit, by anyone: never another tenant's pinned or limited blocks; and
//! no tenant's pins or children make another tenant's blocks count against
//! that tenant's limit or stay cached for it. Limits that add up to more
//! than the megaslab can leave a tenant under its limit with OUT_OF_MEMORY
//! (the others hold their share); a tenant without a limit can pin or hold
//! as much as the megaslab has.

use super::slots::SlotState;
use super::{SessionId, Store};
use cardinality_estimator::CardinalityEstimator;
use kachedb_shm::control::{TenantStats, DEFAULT_TENANT, MAX_TENANTS, OTHER_TENANT};
use kachedb_shm::Op;
use std::collections::BTreeMap;

/// A row of the tenant table (`u8`: [`MAX_TENANTS`] fits).
pub type TenantId = u8;
const _: () = assert!(MAX_TENANTS <= u8::MAX as usize + 1 && MAX_TENANTS >= 2);

/// Row of the default tenant.
pub const DEFAULT_ROW: TenantId = 0;
/// Row of `_other`.
pub const OTHER_ROW: TenantId = (MAX_TENANTS - 1) as TenantId;

/// A distinct-count sketch of a request window: HyperLogLog++ with 2^14
/// registers for the whole store (~0.8 % standard error), 2^12 per tenant
/// (~1.6 %; 3 KiB each).
type TotalSketch = CardinalityEstimator<u64, wyhash::WyHash, 14, 6>;
type TenantSketch = CardinalityEstimator<u64, wyhash::WyHash, 12, 6>;

/// The keys asked for in the current request window.
#[derive(Clone, Debug, Default)]
pub(super) struct Window<S> {
    sketch: S,
    /// Keys asked for (GET, LOOKUP), misses included.
    pub(super) requests: u64,
}

/// A 128-bit key folded and mixed to 64 uniform bits (murmur3's finalizer):
/// clients' keys are usually hashes already, but sequential test keys must
/// not skew the sketch.
#[inline]
fn mix(key: u128) -> u64 {
    let mut x = (key as u64) ^ ((key >> 64) as u64).rotate_left(31);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// One tenant's figures (see [`TenantStats`] for each).
#[derive(Clone, Debug, Default)]
#[cfg_attr(test, derive(serde::Serialize))]
pub struct TenantFigures {
    /// Extent bytes of its reservations and blocks (linked or not).
    pub bytes: u64,
    /// Its linked blocks.
    pub blocks: u64,
    /// Extent bytes of its linked blocks whose chain is whole.
    pub reachable_bytes: u64,
    /// Extent bytes of its other linked blocks.
    pub orphaned_bytes: u64,
    /// GET hits and misses, LOOKUP hits and misses of its clients.
    pub get_hits: u64,
    /// See above.
    pub get_misses: u64,
    /// See above.
    pub lookup_hits: u64,
    /// See above.
    pub lookup_misses: u64,
    /// Its blocks evicted, and their extent bytes.
    pub evictions: u64,
    /// See above.
    pub evicted_bytes: u64,
    /// Tensor bytes committed by its clients.
    pub stored_bytes: u64,
    /// RESERVEs refused by its limit.
    pub limit_refusals: u64,
}

/// One row of the tenant table.
#[derive(Clone, Debug, Default)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) struct Tenant {
    /// Its name; empty for a row not in use.
    pub(super) name: String,
    /// Limit on `figures.bytes`; fixed while the row is in use.
    pub(super) limit: Option<u64>,
    /// Named by `--tenant-limit` or bound (or the default or `_other` row):
    /// never given to another name.
    pub(super) pinned_row: bool,
    /// Bound to uids or gids (`--tenant-uid`, `--tenant-gid`): only its own
    /// sessions and the daemon's replace or delete its blocks
    /// ([`Store::set_bound_tenants`]). Set from the command line, also after
    /// a takeover (not in the handed-over state).
    #[cfg_attr(test, serde(skip))]
    pub(super) bound: bool,
    /// Sessions of this tenant open now.
    pub(super) sessions: u64,
    pub(super) figures: TenantFigures,
    /// With a limit: its blocks eviction may take now, last-use tick -> slot
    /// index (as `Store::lru`); empty without one.
    pub(super) list: BTreeMap<u64, u32>,
    /// Extent bytes of its linked unpinned blocks.
    pub(super) evictable_bytes: u64,
    /// Extent bytes of its blocks that are lent: pinned, and only by other
    /// tenants' clients. Not charged to its limit ([`Store::charged_bytes`]).
    pub(super) lent_bytes: u64,
    /// Extent bytes of other tenants' blocks that its clients pin, each block
    /// once per client session that pins it. Charged to its limit.
    pub(super) borrowed_bytes: u64,
    #[cfg_attr(test, serde(skip))]
    window: Window<TenantSketch>,
}

/// The tenant table and the store-wide request window.
#[derive(Clone, Debug)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) struct Tenants {
    pub(super) rows: Vec<Tenant>,
    /// Name -> row, for the rows in use.
    by_name: BTreeMap<String, TenantId>,
    /// Per-tenant accounting (names, hits, misses, windows) is on; off
    /// (`--tenant-accounting off`), every session is the default tenant's
    /// and no window is kept.
    pub(super) accounting: bool,
    /// The default limit (`--tenant-limit-default`), for rows given later.
    default_limit: Option<u64>,
    /// Sum of the rows' `evictable_bytes` over the rows with a limit.
    pub(super) limited_evictable_bytes: u64,
    /// Rows whose figures changed since [`Store::take_dirty_tenants`].
    #[cfg_attr(test, serde(skip))]
    dirty: u64,
    #[cfg_attr(test, serde(skip))]
    window: Window<TotalSketch>,
}

const _: () = assert!(MAX_TENANTS <= 64, "the dirty mask is a u64");

impl Default for Tenants {
    fn default() -> Self {
        let mut rows: Vec<Tenant> = (0..MAX_TENANTS).map(|_| Tenant::default()).collect();
        rows[DEFAULT_ROW as usize] = Tenant { name: DEFAULT_TENANT.into(), pinned_row: true, ..Tenant::default() };
        rows[OTHER_ROW as usize] = Tenant { name: OTHER_TENANT.into(), pinned_row: true, ..Tenant::default() };
        let by_name = [(DEFAULT_TENANT.to_string(), DEFAULT_ROW), (OTHER_TENANT.to_string(), OTHER_ROW)].into();
        Tenants {
            rows,
            by_name,
            accounting: true,
            default_limit: None,
            limited_evictable_bytes: 0,
            dirty: 0,
            window: Window::default(),
        }
    }
}

impl Tenants {
    #[inline]
    pub(super) fn row(&mut self, t: TenantId) -> &mut Tenant {
        self.dirty |= 1u64 << (t as u32 % 64);
        // `t` comes from a slot or session, which only hold valid rows; the
        // modulo keeps a corrupt one in range rather than panicking.
        let n = self.rows.len();
        &mut self.rows[t as usize % n]
    }

    #[inline]
    pub(super) fn get(&self, t: TenantId) -> &Tenant {
        &self.rows[t as usize % self.rows.len()]
    }

    /// Whether tenant `t` has a limit (its blocks are on its own list).
    #[inline]
    pub(super) fn limited(&self, t: TenantId) -> bool {
        self.get(t).limit.is_some()
    }

    /// The row named `name`, giving it a row (or `_other`) if it has none.
    fn resolve(&mut self, name: &str) -> TenantId {
        if let Some(&t) = self.by_name.get(name) {
            return t;
        }
        let free = self.rows.iter().enumerate().position(|(i, r)| {
            i != DEFAULT_ROW as usize
                && i != OTHER_ROW as usize
                && !r.pinned_row
                && r.sessions == 0
                && r.figures.bytes == 0
                && r.list.is_empty()
        });
        let Some(i) = free else { return OTHER_ROW };
        let old = std::mem::take(&mut self.rows[i].name);
        if !old.is_empty() {
            self.by_name.remove(&old);
        }
        let t = i as TenantId;
        *self.row(t) = Tenant { name: name.to_owned(), limit: self.default_limit, ..Tenant::default() };
        self.by_name.insert(name.to_owned(), t);
        t
    }

    /// Counts a key asked for by tenant `t` in the request windows.
    #[inline]
    pub(super) fn requested(&mut self, t: TenantId, key: u128) {
        let h = mix(key);
        self.window.sketch.insert_hash(h);
        self.window.requests += 1;
        let w = &mut self.row(t).window;
        w.sketch.insert_hash(h);
        w.requests += 1;
    }
}

impl Store {
    /// Sets the tenant limits (`kachedb serve --tenant-limit NAME=SIZE`,
    /// `--tenant-limit-default SIZE`) and whether tenants are counted apart
    /// at all (`--tenant-accounting`). The named tenants get rows now, kept
    /// for good. Call before serving, or on a restored store before it
    /// serves (every block moves to the list its tenant's limit now says).
    pub fn set_tenant_limits(&mut self, default: Option<u64>, named: &[(String, u64)], accounting: bool) {
        let before: Vec<Option<u64>> = self.tenants.rows.iter().map(|r| r.limit).collect();
        let tenants = &mut self.tenants;
        tenants.accounting = accounting;
        tenants.default_limit = default;
        for t in 0..MAX_TENANTS {
            let row = tenants.row(t as TenantId);
            if !row.name.is_empty() {
                row.limit = default;
            }
        }
        for (name, limit) in named {
            let t = tenants.resolve(name);
            let row = tenants.row(t);
            row.limit = Some(*limit);
            row.pinned_row = true;
        }
        // Which list a block is on follows only whether its tenant has a
        // limit: when no row changed that, every block is where it belongs.
        let after: Vec<Option<u64>> = self.tenants.rows.iter().map(|r| r.limit).collect();
        if before.iter().map(Option::is_some).eq(after.iter().map(Option::is_some)) {
            return;
        }
        // Off every list under the limits it was listed by, then on again.
        for (row, limit) in self.tenants.rows.iter_mut().zip(&before) {
            row.limit = *limit;
        }
        let blocks: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&i| matches!(self.slots.get(i as usize).map(|s| &s.state), Some(SlotState::Block { .. })))
            .collect();
        for &i in &blocks {
            if self.unlist(i).is_err() {
                self.counters.internal_error();
            }
        }
        for (row, limit) in self.tenants.rows.iter_mut().zip(after) {
            row.limit = limit;
        }
        for &i in &blocks {
            if self.resync(i).is_err() {
                self.counters.internal_error();
            }
        }
    }

    /// Marks tenants `names` bound to uids or gids (`kachedb serve
    /// --tenant-uid`, `--tenant-gid`; which peer acts as which is the control
    /// socket's, `crate::binding`): from now on only their own sessions and
    /// the daemon's replace or delete their blocks (`DENIED` otherwise). They
    /// get rows now, kept for good; every other row is unbound. Call after
    /// [`set_tenant_limits`](Self::set_tenant_limits), before serving (also
    /// on a restored store: the marker is not in the handed-over state).
    /// `Err` (nothing bound) without tenant accounting, or when a name finds
    /// no row of its own.
    pub fn set_bound_tenants(&mut self, names: &[String]) -> Result<(), String> {
        for t in 0..MAX_TENANTS {
            self.tenants.rows[t].bound = false;
        }
        if names.is_empty() {
            return Ok(());
        }
        if !self.tenants.accounting {
            return Err("binding tenants to uids or gids needs tenant accounting on (--tenant-accounting on)".into());
        }
        let mut rows = Vec::with_capacity(names.len());
        for name in names {
            if name == DEFAULT_TENANT || name == OTHER_TENANT {
                return Err(format!("tenant {name:?} cannot be bound: bind a tenant of a name of its own"));
            }
            let t = self.tenants.resolve(name);
            if t == OTHER_ROW {
                return Err(format!(
                    "tenant {name:?} cannot be bound: all {MAX_TENANTS} tenant rows are in use (bind fewer tenants, or restart rather than take over)"
                ));
            }
            // Pinned at once, so that the next name cannot be given this row.
            self.tenants.row(t).pinned_row = true;
            rows.push(t);
        }
        for t in rows {
            self.tenants.row(t).bound = true;
        }
        Ok(())
    }

    /// Whether tenant row `t` is bound to uids or gids.
    #[inline]
    pub(super) fn tenant_bound(&self, t: TenantId) -> bool {
        self.tenants.get(t).bound
    }

    /// The name of session `s`'s tenant, if `s` is open.
    pub fn session_tenant(&self, s: SessionId) -> Option<&str> {
        let t = self.sessions.get(&s)?.tenant;
        Some(&self.tenants.get(t).name)
    }

    /// Says that session `s` is a client of tenant `name` (checked by the
    /// caller with `kachedb_shm::control::check_tenant_name`); its
    /// reservations and requests count for that tenant from now on. Returns
    /// the tenant it was counted in (`_other` once every row is taken; the
    /// default tenant with accounting off). Call before its first request.
    pub fn set_session_tenant(&mut self, s: SessionId, name: &str) -> String {
        let t = if self.tenants.accounting { self.tenants.resolve(name) } else { DEFAULT_ROW };
        if let Some(session) = self.sessions.get_mut(&s) {
            let old = std::mem::replace(&mut session.tenant, t);
            let tenants = &mut self.tenants;
            tenants.row(old).sessions = tenants.get(old).sessions.saturating_sub(1);
            tenants.row(t).sessions += 1;
        }
        self.tenants.get(t).name.clone()
    }

    /// Says whose block session `s` (one of the daemon's own: a tier's)
    /// reserves next: tenant `name` (a name a block file gave; `None`, or
    /// with accounting off: the default tenant). A fill reserved so counts
    /// for its tenant, within its limit (evicting its own blocks, or refused
    /// as its client's RESERVE would be); a fill for the default tenant
    /// (`None`) is not held to a limit, as before tenants reached the tiers.
    pub fn set_fill_tenant(&mut self, s: SessionId, name: Option<&str>) {
        let t = match name {
            Some(n) if self.tenants.accounting => self.tenants.resolve(n),
            _ => DEFAULT_ROW,
        };
        if let Some(session) = self.sessions.get_mut(&s).filter(|x| x.internal) {
            session.tenant = t;
            session.fills_for_tenant = name.is_some() && self.tenants.accounting;
        }
    }

    /// Says whether session `s` (one of the daemon's own: a tier's) takes
    /// only free megaslab space for its next reservations: on, a reservation
    /// that does not fit in a free extent (or within its tenant's limit)
    /// is refused `OUT_OF_MEMORY` and evicts nothing (a tier's read-ahead:
    /// never a resident block for a guess).
    pub fn set_fill_no_evict(&mut self, s: SessionId, on: bool) {
        if let Some(session) = self.sessions.get_mut(&s).filter(|x| x.internal) {
            session.no_evict = on;
        }
    }

    /// The name of the tenant row block `key` is counted in, if it is a block.
    pub fn block_tenant(&self, key: u128) -> Option<&str> {
        let &index = self.keys.get(&key)?;
        match &self.slots.get(index as usize)?.state {
            SlotState::Block { tensor, .. } => Some(&self.tenants.get(tensor.tenant).name),
            _ => None,
        }
    }

    /// The name and megaslab limit of the tenant row block `key` is counted
    /// in, if it is a block.
    pub fn block_tenant_limit(&self, key: u128) -> Option<(&str, Option<u64>)> {
        let &index = self.keys.get(&key)?;
        match &self.slots.get(index as usize)?.state {
            SlotState::Block { tensor, .. } => {
                let row = self.tenants.get(tensor.tenant);
                Some((&row.name, row.limit))
            }
            _ => None,
        }
    }

    /// The rows whose figures changed since the last call, as a bit mask
    /// (bit `t` for row `t`), cleared; for the serve loop to publish only those.
    pub fn take_dirty_tenants(&mut self) -> u64 {
        std::mem::take(&mut self.tenants.dirty)
    }

    /// Row `t`'s name (empty when not in use), limit and figures.
    pub fn tenant_figures(&self, t: TenantId) -> (&str, Option<u64>, &TenantFigures, (u64, u64)) {
        let r = self.tenants.get(t);
        (&r.name, r.limit, &r.figures, (r.window.sketch.estimate() as u64, r.window.requests))
    }

    /// Clients connected as tenant row `t` now.
    pub fn tenant_clients(&self, t: TenantId) -> u64 {
        self.tenants.get(t).sessions
    }

    /// The store-wide request window: (distinct keys estimated, keys asked for).
    pub fn window(&self) -> (u64, u64) {
        (self.tenants.window.sketch.estimate() as u64, self.tenants.window.requests)
    }

    /// Starts a new request window (the serve loop's clock says when).
    pub fn restart_window(&mut self) {
        self.tenants.window = Window::default();
        for t in 0..MAX_TENANTS {
            if !self.tenants.get(t as TenantId).name.is_empty() {
                self.tenants.row(t as TenantId).window = Window::default();
            }
        }
    }

    /// Every tenant row in use, as stats (the default tenant first).
    pub fn tenant_stats(&self) -> Vec<TenantStats> {
        self.tenants
            .rows
            .iter()
            .filter(|r| !r.name.is_empty())
            .map(|r| {
                let f = &r.figures;
                TenantStats {
                    name: r.name.clone(),
                    limit_bytes: r.limit,
                    clients: r.sessions,
                    bytes: f.bytes,
                    blocks: f.blocks,
                    reachable_bytes: f.reachable_bytes,
                    orphaned_bytes: f.orphaned_bytes,
                    get_hits: f.get_hits,
                    get_misses: f.get_misses,
                    lookup_hits: f.lookup_hits,
                    lookup_misses: f.lookup_misses,
                    evictions: f.evictions,
                    evicted_bytes: f.evicted_bytes,
                    stored_bytes: f.stored_bytes,
                    limit_refusals: f.limit_refusals,
                    window_distinct_keys: r.window.sketch.estimate() as u64,
                    window_key_requests: r.window.requests,
                    ..TenantStats::default()
                }
            })
            .collect()
    }

    /// Counts the outcome of a GET or LOOKUP of session `s` for its tenant,
    /// and the key in the request windows.
    #[inline]
    pub(super) fn count_request(&mut self, t: TenantId, op: Op, key: u128, hit: bool) {
        if !self.tenants.accounting {
            return;
        }
        self.tenants.requested(t, key);
        let f = &mut self.tenants.row(t).figures;
        match (op, hit) {
            (Op::Get, true) => f.get_hits += 1,
            (Op::Get, false) => f.get_misses += 1,
            (_, true) => f.lookup_hits += 1,
            (_, false) => f.lookup_misses += 1,
        }
    }

    /// What tenant `t`'s limit bounds: the extent bytes of its reservations
    /// and blocks, less those lent to other tenants (pinned only by their
    /// clients), plus those it borrows (other tenants' blocks its clients pin).
    pub(super) fn charged_bytes(&self, t: TenantId) -> u64 {
        let r = self.tenants.get(t);
        r.figures.bytes.saturating_sub(r.lent_bytes).saturating_add(r.borrowed_bytes)
    }

    /// Whether evicting from tenant `t`'s own list, in the order eviction
    /// would, frees at least `over` bytes: a dry run of the chain policy
    /// (a parent of `t`'s whose last holding child goes joins the list at
    /// its own last use). `O(k log n)` in the blocks it would evict.
    pub(super) fn tenant_can_free(&self, t: TenantId, over: u64) -> bool {
        let row = self.tenants.get(t);
        if row.evictable_bytes < over {
            return false;
        }
        let mut listed = row.list.iter().map(|(&tick, &i)| (tick, i)).peekable();
        let mut joined: BTreeMap<u64, u32> = BTreeMap::new();
        let mut children_gone: BTreeMap<u32, u32> = BTreeMap::new();
        let mut freed = 0u64;
        while freed < over {
            let next = match (listed.peek().copied(), joined.first_key_value().map(|(&k, &v)| (k, v))) {
                (Some(a), Some(b)) if b.0 < a.0 => joined.pop_first(),
                (Some(_), _) => listed.next(),
                (None, Some(_)) => joined.pop_first(),
                (None, None) => return false,
            };
            let Some((_, i)) = next else { return false };
            let Some(SlotState::Block { tensor, parent, .. }) = self.slots.get(i as usize).map(|s| &s.state) else {
                return false;
            };
            freed += tensor.extent.len;
            let Some(p) = *parent else { continue };
            // Each block the run evicts is `t`'s and unpinned: a holding child of a parent of `t`'s.
            if let Some(SlotState::Block { tensor: pt, pins: 0, linked: true, holding_children, last_use, .. }) =
                self.slots.get(p as usize).map(|s| &s.state)
            {
                if pt.tenant == t && self.policy == super::EvictionPolicy::Chain {
                    let gone = children_gone.entry(p).or_insert(0);
                    *gone += 1;
                    if *gone == *holding_children {
                        joined.insert(*last_use, p);
                    }
                }
            }
        }
        true
    }
}

impl TenantFigures {
    /// In the order of [`TenantRow::figures`](crate::takeover::state::TenantRow).
    fn to_array(&self) -> [u64; 12] {
        [
            self.bytes,
            self.blocks,
            self.reachable_bytes,
            self.orphaned_bytes,
            self.get_hits,
            self.get_misses,
            self.lookup_hits,
            self.lookup_misses,
            self.evictions,
            self.evicted_bytes,
            self.stored_bytes,
            self.limit_refusals,
        ]
    }

    fn from_array(f: [u64; 12]) -> TenantFigures {
        let [bytes, blocks, reachable_bytes, orphaned_bytes, get_hits, get_misses, lookup_hits, lookup_misses, evictions, evicted_bytes, stored_bytes, limit_refusals] =
            f;
        TenantFigures {
            bytes,
            blocks,
            reachable_bytes,
            orphaned_bytes,
            get_hits,
            get_misses,
            lookup_hits,
            lookup_misses,
            evictions,
            evicted_bytes,
            stored_bytes,
            limit_refusals,
        }
    }
}

impl Tenants {
    /// The rows as the takeover state carries them (their eviction lists
    /// are in the slot records).
    pub(super) fn to_rows(&self) -> Vec<crate::takeover::state::TenantRow> {
        self.rows
            .iter()
            .map(|r| crate::takeover::state::TenantRow {
                name: r.name.clone(),
                limit: r.limit,
                pinned_row: r.pinned_row,
                sessions: r.sessions,
                figures: r.figures.to_array(),
                evictable_bytes: r.evictable_bytes,
                lent_bytes: r.lent_bytes,
                borrowed_bytes: r.borrowed_bytes,
            })
            .collect()
    }

    /// The table of `rows` (exactly [`MAX_TENANTS`]), with the eviction
    /// lists `lists` (by row); names index the rows that have one.
    pub(super) fn from_rows(
        rows: &[crate::takeover::state::TenantRow],
        lists: Vec<BTreeMap<u64, u32>>,
        accounting: bool,
        default_limit: Option<u64>,
        limited_evictable_bytes: u64,
    ) -> Result<Tenants, String> {
        if rows.len() != MAX_TENANTS {
            return Err(format!("{} tenant rows, this build has {MAX_TENANTS}", rows.len()));
        }
        let mut by_name = BTreeMap::new();
        for (i, r) in rows.iter().enumerate() {
            if !r.name.is_empty() && by_name.insert(r.name.clone(), i as TenantId).is_some() {
                return Err(format!("tenant {:?} has two rows", r.name));
            }
        }
        let rows = rows
            .iter()
            .zip(lists)
            .map(|(r, list)| Tenant {
                name: r.name.clone(),
                limit: r.limit,
                pinned_row: r.pinned_row,
                bound: false,
                sessions: r.sessions,
                figures: TenantFigures::from_array(r.figures),
                list,
                evictable_bytes: r.evictable_bytes,
                lent_bytes: r.lent_bytes,
                borrowed_bytes: r.borrowed_bytes,
                window: Window::default(),
            })
            .collect();
        Ok(Tenants {
            rows,
            by_name,
            accounting,
            default_limit,
            limited_evictable_bytes,
            dirty: 0,
            window: Window::default(),
        })
    }

    /// `accounting`, `default_limit` and `limited_evictable_bytes`.
    pub(super) fn settings(&self) -> (bool, Option<u64>, u64) {
        (self.accounting, self.default_limit, self.limited_evictable_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sketch_counts_distinct_keys_within_two_percent() {
        let mut w = Window::<TotalSketch>::default();
        for _ in 0..3 {
            for k in 0..100_000u128 {
                w.sketch.insert_hash(mix(k * 7));
            }
        }
        let est = w.sketch.estimate() as f64;
        assert!((est / 100_000.0 - 1.0).abs() < 0.02, "{est}");
    }
}
