//! The serve loop's side of the tiers behind the megaslab (`crate::tier`):
//! each tier's own session (its write-behind pins and fill reservations),
//! the fetches channels wait for, and the fill work (reservations and
//! commits) done in slices between ring polls. Every tier gets every block
//! committed to write behind; a local miss asks the first tier, and the keys
//! a tier did not fill go to the next one, under the same fetch id (disk,
//! then remote). What a fetch's end means for its channel is the loop's
//! business: this side reports it ([`FetchDone`]).
//!
//! A client's DELETE, and its COMMIT of a newer block of a key, go to every
//! tier ([`Tier::remove`]), and no fill of a fetch started before commits
//! the key afterwards ([`Tiers::remove`]). A tier that must make the older
//! copy's removal durable answers with a token; the client's answer waits
//! for it ([`Removals`]: the serve loop holds the answer, up to the tier's
//! bound, then answers `NOT_DURABLE`).
//! A tier with [`Admission::Second`] is offered a block only once it is
//! requested again after its commit ([`Candidates`]).
//!
//! **Read-ahead** ([`Ahead`]): a client's local miss of a key, and its first
//! request of a block read ahead, ask the tiers in order for the blocks
//! after that key in its chain ([`Tier::chain_after`]); the first tier that
//! knows some reads them ahead: each one not in the megaslab, not being
//! read and not read ahead already gets a fetch of its own at that tier
//! ([`FetchJob::ahead`]) that no channel waits for. Its reservation takes
//! free megaslab space only (`Store::set_fill_no_evict`: a guess never
//! evicts a resident block), and its block is committed cold
//! (`Store::make_cold`): eviction takes it before any block a client used,
//! until a client uses it. A client's miss of a key being read ahead waits
//! for that fetch instead of reading it again; a batch's fetch reads only its
//! keys not being read ahead, and the others are asked for again when its
//! channel is served again ([`Tiers::start_fetch`]). A read-ahead's block is
//! committed only once the fill of its parent asked for before it is over
//! (fetches end in any order), so that it links to its parent.

use crate::store::{SessionId, Store};
use crate::tier::{
    Admission, FetchJob, FillSpec, Handover, Offer, PendingWrite, Removal, Reserved, StoppedTier, Tier, TierEvent,
    TierId, WriteJob,
};
use kachedb_shm::control::DEFAULT_TENANT;
use kachedb_shm::{Request, Status};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Instant;

/// Fill blocks reserved or committed per pass: the serve loop polls the
/// rings between slices, so a fill of a long chain delays a ring request by
/// at most one slice (about a microsecond per block).
pub(super) const TIER_SLICE: usize = 8;

/// Most keys a tier with [`Admission::Second`] remembers as committed once
/// and not requested since (oldest forgotten first): about 50 bytes each.
const ADMIT_CANDIDATES: usize = 1 << 18;

/// Most read-ahead fetches open at once (a tier that stalls holds no more).
const AHEAD_OPEN: usize = 256;
/// Most keys remembered as read ahead and not requested since (oldest
/// forgotten first).
const AHEAD_TRIED: usize = 1 << 16;

/// The daemon's tiers, in order (the first is asked for local misses).
#[derive(Default)]
pub(super) struct Tiers {
    sides: Vec<TierSide>,
    /// The last fetch id given out (ids are unique across tiers).
    next_fetch: u64,
    /// The fetches a tier still works on (each ends with its last tier's
    /// `Filled`, waited for or not).
    open: BTreeSet<u64>,
    /// Keys a client deleted while fetches were open, with the last fetch
    /// id given out then: a fill of such a key by a fetch of that id or an
    /// earlier one is not committed (its tier read the block before the
    /// DELETE). Dropped once no such fetch is open.
    deleted: HashMap<u128, u64>,
    /// Removals a client's answer waits for.
    removals: HashMap<(TierId, u64), Waiting>,
    /// The tiers' read-ahead.
    ahead: Ahead,
}

/// The read-ahead's state (see the module docs).
#[derive(Default)]
struct Ahead {
    /// The read-ahead fetches open: id -> key.
    fetches: HashMap<u64, u128>,
    /// The keys they read: key -> (id, index of the tier reading it).
    reading: HashMap<u128, (u64, usize)>,
    /// Keys read ahead (filled or not: no free room) and not requested by a
    /// client since: not read ahead again; a client's first request of one
    /// moves the window on.
    tried: Candidates,
    /// Read-ahead commits held until the fill of their block's parent, asked
    /// for earlier, is over (so that the block links to it: fills of one
    /// chain on several threads end in any order), with the index of their
    /// tier, that parent and the read-ahead's fetch id.
    held: Vec<(usize, u128, u64, FillWork)>,
}

/// A removal a client's answer waits for ([`Removal::Pending`]).
#[derive(Clone, Copy, Debug)]
struct Waiting {
    channel: u32,
    session: SessionId,
    key: u128,
    /// When the loop stops waiting (the tier's bound) and answers `NOT_DURABLE`.
    deadline: Instant,
}

/// A removal a held answer waited for is over.
#[derive(Clone, Copy, Debug)]
pub(super) struct Resolved {
    pub(super) channel: u32,
    pub(super) session: SessionId,
    /// The tier and token.
    pub(super) id: (TierId, u64),
    /// It is durable.
    pub(super) durable: bool,
}

/// The blocks a tier with [`Admission::Second`] was not offered yet:
/// committed once and not requested since, with the parent each was
/// committed with; bounded by [`ADMIT_CANDIDATES`], oldest out first.
#[derive(Default)]
struct Candidates {
    parents: HashMap<u128, Option<u128>>,
    /// Insertion order (may hold keys taken out since; compacted).
    order: VecDeque<u128>,
}

impl Candidates {
    fn insert(&mut self, key: u128, parent: Option<u128>) {
        if self.parents.insert(key, parent).is_none() {
            self.order.push_back(key);
        }
        while self.parents.len() > ADMIT_CANDIDATES {
            let Some(old) = self.order.pop_front() else { break };
            self.parents.remove(&old);
        }
        if self.order.len() > 2 * ADMIT_CANDIDATES.max(self.parents.len()) {
            let parents = &self.parents;
            self.order.retain(|k| parents.contains_key(k));
        }
    }

    fn take(&mut self, key: u128) -> Option<Option<u128>> {
        self.parents.remove(&key)
    }

    fn insert_bounded(&mut self, key: u128, bound: usize) {
        if self.parents.insert(key, None).is_none() {
            self.order.push_back(key);
        }
        while self.parents.len() > bound {
            let Some(old) = self.order.pop_front() else { break };
            self.parents.remove(&old);
        }
        if self.order.len() > 2 * bound.max(self.parents.len()) {
            let parents = &self.parents;
            self.order.retain(|k| parents.contains_key(k));
        }
    }
}

/// One tier as the serve loop drives it.
struct TierSide {
    id: TierId,
    tier: Box<dyn Tier>,
    /// The tier's own session: its write-behind pins and fill reservations.
    session: SessionId,
    /// Fetches channels are parked on, by id.
    pending: HashMap<u64, Pending>,
    /// The fill reservations made and not yet committed or aborted: handle
    /// -> (fetch id, the parent to commit the block with).
    fills: HashMap<u64, (u64, Option<u128>)>,
    /// Fill work queued, done [`TIER_SLICE`] blocks per pass, in order.
    work: VecDeque<FillWork>,
    /// With [`Admission::Second`]: the blocks not offered yet.
    candidates: Option<Candidates>,
}

/// A fetch a channel is parked on, at one tier.
struct Pending {
    channel: u32,
    /// The tenant of the channel's client ([`FetchJob::tenant`]).
    tenant: String,
    /// When the loop stops waiting for this tier.
    deadline: Instant,
    /// The keys asked for.
    keys: Vec<u128>,
}

/// Fill work the serve loop does in slices between ring polls.
enum FillWork {
    /// Reservations asked for by a fetch: `answers` holds those made so far;
    /// all of them go back on `reply` once the last is made.
    Reserve {
        fetch: u64,
        blocks: Vec<FillSpec>,
        answers: Vec<Option<Reserved>>,
        reply: crate::tier::reply::Sender<Vec<Option<Reserved>>>,
    },
    /// A fetch's filled reservations, committed from `next` on; once all
    /// are, its channel is unparked and WAITs on `committed` answered.
    Commit { fetch: u64, filled: Vec<(u64, u64)>, next: usize, committed: Vec<u128> },
}

/// A fetch that is over: its blocks are committed (or it ran out of time).
pub(super) struct FetchDone {
    pub(super) fetch: u64,
    /// The tier whose fill (or timeout) this is.
    pub(super) tier: TierId,
    /// The channel waiting for it, if one still is.
    pub(super) channel: Option<u32>,
    /// The keys it committed.
    pub(super) committed: Vec<u128>,
}

/// Tiers stopped for a takeover, with their ids, and what they hand on.
#[derive(Default)]
pub(crate) struct Stopped {
    pub(super) tiers: Vec<(TierId, Box<dyn StoppedTier>)>,
    /// Writes taken and not finished, by any tier (each key once).
    pub(crate) pending: Vec<PendingWrite>,
    /// Keys whose older copy a tier could not remove.
    pub(crate) unremoved: Vec<u128>,
}

impl TierSide {
    fn new(id: TierId, tier: Box<dyn Tier>, store: &mut Store) -> TierSide {
        let candidates = (tier.admission() == Admission::Second).then(Candidates::default);
        TierSide {
            id,
            tier,
            session: store.open_internal_session(),
            pending: HashMap::new(),
            fills: HashMap::new(),
            work: VecDeque::new(),
            candidates,
        }
    }

    /// Offers the block of `key` (in `store`) to this tier for writing behind.
    fn write_behind(&self, store: &mut Store, key: u128, parent: Option<u128>) {
        let Some(b) = store.peek(key) else { return };
        let Some((tenant, tenant_limit)) = store.block_tenant_limit(key).map(|(n, l)| (n.to_owned(), l)) else {
            return;
        };
        let session = self.session;
        let offer = Offer { len: b.len, tenant: &tenant, tenant_limit };
        self.tier.write_behind(offer, &mut || {
            let tenant = tenant.clone();
            let c = store.handle_internal(session, &Request::Get { key });
            (c.status == Status::Ok).then(|| WriteJob {
                tenant,
                key,
                parent,
                pin: c.handle,
                data_offset: b.data_offset,
                len: b.len,
                dtype: b.dtype,
                shape: b.shape,
                meta: store.block_meta(key),
            })
        });
    }
}

impl Tiers {
    /// `tiers`, in order, each with a session of its own in `store` for its
    /// pins and reservations; each reports as its index.
    pub(super) fn new(tiers: Vec<Box<dyn Tier>>, store: &mut Store) -> Tiers {
        let sides = tiers.into_iter().enumerate().map(|(id, tier)| TierSide::new(id, tier, store)).collect();
        Tiers { sides, ..Tiers::default() }
    }

    /// Whether the daemon has no tier behind the megaslab.
    pub(super) fn is_empty(&self) -> bool {
        self.sides.is_empty()
    }

    /// Offers the block of `key` (just committed by a client, naming
    /// `parent`) to every tier for writing behind; each that takes it gets a
    /// pin of its own session. A tier with [`Admission::Second`] is offered
    /// it only if it was committed before (and not requested since);
    /// otherwise it becomes a candidate, offered at its next request.
    pub(super) fn write_behind(&mut self, store: &mut Store, key: u128, parent: Option<u128>) {
        for t in &mut self.sides {
            if let Some(c) = &mut t.candidates {
                if c.take(key).is_none() {
                    c.insert(key, parent);
                    continue;
                }
            }
            t.write_behind(store, key, parent);
        }
    }

    /// Whether a tier wants to hear of requests that hit ([`requested`](Self::requested)).
    pub(super) fn wants_requests(&self) -> bool {
        !self.ahead.tried.parents.is_empty()
            || self.sides.iter().any(|t| t.candidates.as_ref().is_some_and(|c| !c.parents.is_empty()))
    }

    /// A client's GET, LOOKUP or WAIT found `key` in the megaslab: a tier
    /// with [`Admission::Second`] that was not offered the block yet is
    /// offered it now; a block read ahead moves the read-ahead on (for the
    /// tenant of the client's `session`).
    pub(super) fn requested(&mut self, store: &mut Store, key: u128, session: SessionId) {
        for t in &mut self.sides {
            if let Some(parent) = t.candidates.as_mut().and_then(|c| c.take(key)) {
                t.write_behind(store, key, parent);
            }
        }
        if self.ahead.tried.take(key).is_some() {
            let tenant = store.session_tenant(session).unwrap_or(DEFAULT_TENANT).to_owned();
            self.read_ahead(store, key, &tenant);
        }
    }

    /// Asks the tiers in order for the blocks after `key` in its chain and,
    /// at the first that knows some, starts a read-ahead fetch of each that
    /// is not local, not being read and not read ahead already (see the
    /// module docs).
    fn read_ahead(&mut self, store: &Store, key: u128, tenant: &str) {
        let found = self.sides.iter().enumerate().find_map(|(i, t)| {
            let chain = t.tier.chain_after(key);
            (!chain.is_empty()).then_some((i, chain))
        });
        let Some((side, chain)) = found else { return };
        let t = &self.sides[side];
        for k in chain {
            if self.ahead.fetches.len() >= AHEAD_OPEN {
                break;
            }
            let a = &mut self.ahead;
            if store.peek(k).is_some() || a.reading.contains_key(&k) || a.tried.parents.contains_key(&k) {
                continue;
            }
            self.next_fetch += 1;
            let id = self.next_fetch;
            self.open.insert(id);
            a.fetches.insert(id, k);
            a.reading.insert(k, (id, side));
            a.tried.insert_bounded(k, AHEAD_TRIED);
            t.tier.fetch(FetchJob { id, tenant: tenant.to_owned(), keys: vec![k], ahead: true });
        }
    }

    /// A client of `channel` (`session`) deleted `key` (served already):
    /// every tier is told, and no fill of a fetch open now commits it
    /// afterwards. The removals the client's answer must wait for (none:
    /// answer now).
    pub(super) fn remove(&mut self, channel: u32, session: SessionId, key: u128) -> Vec<(TierId, u64)> {
        if !self.open.is_empty() {
            self.deleted.insert(key, self.next_fetch);
        }
        let mut waits = Vec::new();
        for t in &mut self.sides {
            if let Some(c) = &mut t.candidates {
                c.take(key);
            }
            if let Removal::Pending(token) = t.tier.remove(key) {
                let deadline = Instant::now() + t.tier.fetch_bound();
                self.removals.insert((t.id, token), Waiting { channel, session, key, deadline });
                waits.push((t.id, token));
            }
        }
        waits
    }

    /// A client of `channel` (`session`) committed a block of `key` (served
    /// already, naming `parent`): an older copy a tier holds must go first
    /// (a replacement; the tier says whether it may hold one), then the
    /// block is offered for writing behind. The removals the client's
    /// answer must wait for.
    pub(super) fn committed(
        &mut self,
        store: &mut Store,
        channel: u32,
        session: SessionId,
        key: u128,
        parent: Option<u128>,
    ) -> Vec<(TierId, u64)> {
        let mut waits = Vec::new();
        for t in &mut self.sides {
            if let Removal::Pending(token) = t.tier.remove(key) {
                let deadline = Instant::now() + t.tier.fetch_bound();
                self.removals.insert((t.id, token), Waiting { channel, session, key, deadline });
                waits.push((t.id, token));
            }
        }
        self.write_behind(store, key, parent);
        waits
    }

    /// Offers the block of `key` again to every tier for writing behind,
    /// as taken already (a write a stopped tier handed back): no admission
    /// rule applies.
    pub(super) fn rewrite(&mut self, store: &mut Store, w: PendingWrite) {
        for t in &self.sides {
            t.write_behind(store, w.key, w.parent);
        }
    }

    /// Removes `key` from every tier with nobody waiting for the answer (a
    /// removal a stopped tier could not finish).
    pub(super) fn remove_unanswered(&mut self, key: u128) {
        for t in &self.sides {
            t.tier.remove(key);
        }
    }

    /// Asks the first tier to fill `keys` for `channel`, whose client is
    /// counted as `tenant`: the fetch's id and the keys it covers, or `None`
    /// without a tier. A key being read ahead (no channel waiting for that
    /// fetch yet) is not read again: the fetch covers the others, or, when
    /// every key is being read ahead, the channel waits for the first one's
    /// read-ahead at the tier reading it; the keys left out are asked for
    /// again when the channel is served again (landed by then, or waited
    /// for in turn). Then the tiers read ahead after the last key.
    pub(super) fn start_fetch(
        &mut self,
        store: &Store,
        channel: u32,
        tenant: &str,
        keys: Vec<u128>,
    ) -> Option<(u64, Vec<u128>)> {
        let last = *keys.last()?;
        for k in &keys {
            self.ahead.tried.take(*k);
        }
        let sides = &self.sides;
        let ahead = |k: &u128| {
            self.ahead
                .reading
                .get(k)
                .copied()
                .filter(|&(id, side)| sides.get(side).is_some_and(|t| !t.pending.contains_key(&id)))
        };
        let (read_ahead, rest): (Vec<u128>, Vec<u128>) = keys.iter().partition(|k| ahead(k).is_some());
        let (id, covered) = match (read_ahead.first().and_then(|k| Some((*k, ahead(k)?))), rest.is_empty()) {
            (Some((k, (id, side))), true) => {
                let t = &mut self.sides[side];
                let deadline = Instant::now() + t.tier.fetch_bound();
                t.pending.insert(id, Pending { channel, tenant: tenant.to_owned(), deadline, keys: vec![k] });
                (id, vec![k])
            }
            _ => {
                let t = self.sides.first_mut()?;
                let deadline = Instant::now() + t.tier.fetch_bound();
                self.next_fetch += 1;
                let id = self.next_fetch;
                self.open.insert(id);
                t.pending.insert(id, Pending { channel, tenant: tenant.to_owned(), deadline, keys: rest.clone() });
                t.tier.fetch(FetchJob { id, tenant: tenant.to_owned(), keys: rest.clone(), ahead: false });
                (id, rest)
            }
        };
        self.read_ahead(store, last, tenant);
        Some((id, covered))
    }

    /// Whether a fetch or a removal is being waited for.
    pub(super) fn fetching(&self) -> bool {
        self.sides.iter().any(|t| !t.pending.is_empty()) || !self.removals.is_empty()
    }

    /// The earliest time the serve loop stops waiting for a fetch or a removal.
    pub(super) fn next_fetch_deadline(&self) -> Option<Instant> {
        let fetches = self.sides.iter().flat_map(|t| t.pending.values().map(|p| p.deadline));
        fetches.chain(self.removals.values().map(|w| w.deadline)).min()
    }

    /// The removals whose time ran out by `now`: not durable (as far as the
    /// client's answer goes; the tier goes on trying).
    pub(super) fn expire_removals(&mut self, now: Instant) -> Vec<Resolved> {
        let mut out = Vec::new();
        let sides = &self.sides;
        self.removals.retain(|&id, w| {
            let keep = w.deadline > now;
            if !keep {
                if let Some(t) = sides.iter().find(|t| t.id == id.0) {
                    t.tier.unconfirmed();
                }
                out.push(Resolved { channel: w.channel, session: w.session, id, durable: false });
            }
            keep
        });
        out
    }

    /// The fetches whose time ran out by `now` (nothing committed): the
    /// loop stops waiting for them.
    pub(super) fn expire(&mut self, now: Instant) -> Vec<FetchDone> {
        let mut out = Vec::new();
        for t in &mut self.sides {
            t.pending.retain(|&fetch, p| {
                let keep = p.deadline > now;
                if !keep {
                    t.tier.timed_out();
                    out.push(FetchDone { fetch, tier: t.id, channel: Some(p.channel), committed: Vec::new() });
                }
                keep
            });
        }
        out
    }

    /// A fetch of tier `id` committed blocks `us` microseconds after its
    /// local miss (for that tier's fill latency).
    pub(super) fn filled_after(&self, id: TierId, us: u64) {
        if let Some(t) = self.sides.iter().find(|t| t.id == id) {
            t.tier.filled_after(us);
        }
    }

    /// What tier `id` reports. A write's pin is dropped at once;
    /// reservations and commits of a fill are queued and done
    /// [`TIER_SLICE`] blocks per pass ([`slice`](Self::slice)); a removal
    /// a client's answer waits for is returned.
    pub(super) fn on_event(&mut self, store: &mut Store, id: TierId, ev: TierEvent) -> Option<Resolved> {
        let t = self.sides.iter_mut().find(|t| t.id == id)?;
        match ev {
            TierEvent::Written { pin } => {
                store.handle_internal(t.session, &Request::Release { handle: pin });
            }
            TierEvent::Removed { token, result } => {
                let w = self.removals.remove(&(id, token))?;
                if let Err(why) = &result {
                    t.tier.unconfirmed();
                    tracing::warn!(
                        event = "removal_not_durable",
                        key = %format_args!("{:032x}", w.key),
                        "a delete or replacement is answered NOT_DURABLE: {why}"
                    );
                }
                return Some(Resolved {
                    channel: w.channel,
                    session: w.session,
                    id: (id, token),
                    durable: result.is_ok(),
                });
            }
            TierEvent::Reserve { fetch, blocks, reply } => {
                let answers = Vec::with_capacity(blocks.len());
                t.work.push_back(FillWork::Reserve { fetch, blocks, answers, reply });
            }
            TierEvent::Filled { fetch, filled } => {
                t.work.push_back(FillWork::Commit { fetch, filled, next: 0, committed: Vec::new() });
            }
        }
        None
    }

    /// Does up to [`TIER_SLICE`] blocks of the tiers' queued fill work (and
    /// finishes the piece of work they end), adding the fetches it completes
    /// to `done`; whether any work was done.
    pub(super) fn slice(&mut self, store: &mut Store, done: &mut Vec<FetchDone>) -> bool {
        let mut budget = TIER_SLICE;
        let mut did = false;
        // Fetches over at one tier with keys left for the next: (tier index, id, the fetch).
        let mut forward: Vec<(usize, u64, Pending)> = Vec::new();
        let n_sides = self.sides.len();
        let Tiers { sides, open, deleted, ahead, .. } = self;
        // Whether a fill of `key` by fetch `fetch` lost to a client's DELETE.
        let lost = |deleted: &HashMap<u128, u64>, key: u128, fetch: u64| deleted.get(&key).is_some_and(|&f| fetch <= f);
        // Whether a fill of `key` asked for before fetch `fetch` is still open
        // at the first tier (a read-ahead's, or a client's).
        let filling = |ahead: &Ahead, pending: &HashMap<u64, Pending>, key: u128, fetch: u64| {
            ahead.reading.get(&key).is_some_and(|&(id, _)| id < fetch)
                || pending.iter().any(|(&id, p)| id < fetch && p.keys.contains(&key))
        };
        // Held read-ahead commits whose parent's fill is over go on.
        let mut h = 0;
        while h < ahead.held.len() {
            let (side, parent, fetch, _) = ahead.held[h];
            match sides.get_mut(side) {
                Some(r) if !filling(ahead, &r.pending, parent, fetch) => {
                    r.work.push_back(ahead.held.swap_remove(h).3);
                }
                Some(_) => h += 1,
                None => drop(ahead.held.swap_remove(h)),
            }
        }
        for (i, r) in sides.iter_mut().enumerate() {
            while budget > 0 {
                let Some(work) = r.work.pop_front() else { break };
                did = true;
                match work {
                    FillWork::Reserve { fetch, blocks, mut answers, reply } => {
                        let from = answers.len();
                        let to = blocks.len().min(from + budget);
                        budget -= to - from;
                        for b in &blocks[from..to] {
                            // Committed by a client meanwhile: that block stands;
                            // deleted by a client meanwhile: it stays deleted.
                            let answer = if store.peek(b.key).is_some() || lost(deleted, b.key, fetch) {
                                None
                            } else {
                                // Counted for the block's tenant, within its limit;
                                // a read-ahead into free space only.
                                store.set_fill_tenant(r.session, b.tenant.as_deref());
                                // (A read-ahead a client waits for by now is no guess.)
                                let guess = ahead.fetches.contains_key(&fetch) && !r.pending.contains_key(&fetch);
                                store.set_fill_no_evict(r.session, guess);
                                let c = store.handle_internal(
                                    r.session,
                                    &Request::Reserve {
                                        key: b.key,
                                        dtype: b.dtype,
                                        shape: b.shape,
                                        len: b.len,
                                        page_offset: 0,
                                    },
                                );
                                (c.status == Status::Ok).then(|| {
                                    if let Some(m) = &b.meta {
                                        // Published with the block once committed.
                                        store.attach_internal_meta(r.session, c.handle, m.clone());
                                    }
                                    r.fills.insert(c.handle, (fetch, b.parent));
                                    Reserved { handle: c.handle, data_offset: c.offset }
                                })
                            };
                            answers.push(answer);
                        }
                        if answers.len() < blocks.len() {
                            r.work.push_front(FillWork::Reserve { fetch, blocks, answers, reply });
                            break;
                        }
                        if let Err(answers) = reply.send(answers) {
                            for a in answers.into_iter().flatten() {
                                r.fills.remove(&a.handle);
                                store.handle_internal(r.session, &Request::Abort { handle: a.handle });
                            }
                        }
                    }
                    FillWork::Commit { fetch, filled, mut next, mut committed } => {
                        // A read-ahead's block waits for its parent's fill to end.
                        let parent = filled.first().and_then(|(h, _)| r.fills.get(h)).and_then(|&(_, p)| p);
                        if let Some(p) = parent.filter(|&p| {
                            next == 0
                                && ahead.fetches.contains_key(&fetch)
                                && store.peek(p).is_none()
                                && filling(ahead, &r.pending, p, fetch)
                        }) {
                            ahead.held.push((i, p, fetch, FillWork::Commit { fetch, filled, next, committed }));
                            continue;
                        }
                        let to = filled.len().min(next + budget);
                        budget -= to - next;
                        for &(handle, len) in &filled[next..to] {
                            // Only this fetch's own reservations (a handle it names
                            // twice, or another's, is not committed).
                            let parent = match r.fills.get(&handle) {
                                Some(&(f, parent)) if f == fetch => {
                                    r.fills.remove(&handle);
                                    parent
                                }
                                _ => continue,
                            };
                            let key = store.reservation_key(r.session, handle);
                            // Committed by a client while the fill ran: that block is newer
                            // (and may have chain links); the fill's copy is dropped. Deleted
                            // by a client while it ran: the copy is dropped too.
                            if key.is_some_and(|k| store.peek(k).is_some() || lost(deleted, k, fetch)) {
                                store.handle_internal(r.session, &Request::Abort { handle });
                                continue;
                            }
                            if store.handle_internal(r.session, &Request::Commit { handle, parent }).status
                                == Status::Ok
                            {
                                r.tier.landed(len);
                                if let Some(k) = key.filter(|_| ahead.fetches.contains_key(&fetch)) {
                                    // A guess: evicted first until a client uses it.
                                    store.make_cold(k);
                                }
                                committed.extend(key);
                            }
                        }
                        next = to;
                        if next < filled.len() {
                            r.work.push_front(FillWork::Commit { fetch, filled, next, committed });
                            break;
                        }
                        // Every block of the fetch is in; the reservations it
                        // did not fill go.
                        let session = r.session;
                        r.fills.retain(|&handle, &mut (f, _)| {
                            if f == fetch {
                                store.handle_internal(session, &Request::Abort { handle });
                            }
                            f != fetch
                        });
                        // Keys still missing go to the next tier, if any (or, for a
                        // read-ahead that found no free room and that a client
                        // waits for by now, to this tier again, as the client's
                        // fetch); a fetch no longer waited for (expired) still
                        // wakes WAITs on its keys.
                        let was_ahead = ahead.fetches.remove(&fetch).inspect(|k| {
                            ahead.reading.remove(k);
                        });
                        let mut channel = None;
                        let mut forwarded = false;
                        if let Some(p) = r.pending.remove(&fetch) {
                            let missing = p.keys.iter().any(|&k| store.peek(k).is_none());
                            if missing && was_ahead.is_some() {
                                forward.push((i, fetch, p));
                                forwarded = true;
                            } else if missing && i + 1 < n_sides {
                                forward.push((i + 1, fetch, p));
                                forwarded = true;
                            } else {
                                channel = Some(p.channel);
                            }
                        }
                        if !forwarded {
                            open.remove(&fetch);
                            let oldest = open.first().copied().unwrap_or(u64::MAX);
                            deleted.retain(|_, &mut f| f >= oldest);
                        }
                        if channel.is_some() || !committed.is_empty() {
                            done.push(FetchDone { fetch, tier: r.id, channel, committed });
                        }
                        // An empty fetch still takes a turn: at most one per block of budget.
                        budget = budget.saturating_sub(1);
                    }
                }
            }
        }
        for (to, fetch, mut p) in forward {
            let Some(t) = self.sides.get_mut(to) else {
                self.open.remove(&fetch);
                continue;
            };
            p.keys.retain(|&k| store.peek(k).is_none());
            p.deadline = Instant::now() + t.tier.fetch_bound();
            let job = FetchJob { id: fetch, tenant: p.tenant.clone(), keys: p.keys.clone(), ahead: false };
            t.pending.insert(fetch, p);
            t.tier.fetch(job);
        }
        did
    }

    /// Stops every tier for a takeover, closing their sessions (which drops
    /// their pins and reservations). Every removal a client's answer waits
    /// for is over then (returned); the writes the tiers had taken and not
    /// finished, and the keys whose removal failed, are handed back with the
    /// stopped tiers, for the daemon that serves next.
    pub(super) fn stop(&mut self, store: &mut Store) -> (Stopped, Vec<Resolved>) {
        self.open.clear();
        self.deleted.clear();
        self.ahead = Ahead::default();
        let mut stopped = Stopped::default();
        let mut resolved = Vec::new();
        for t in self.sides.drain(..) {
            let (tier, Handover { pending, removed, unremoved }) = t.tier.stop();
            store.close_session(t.session);
            let removed: HashMap<u64, bool> = removed.into_iter().map(|(token, r)| (token, r.is_ok())).collect();
            self.removals.retain(|&(id, token), w| {
                if id != t.id {
                    return true;
                }
                let durable = removed.get(&token).copied().unwrap_or(!unremoved.contains(&w.key));
                resolved.push(Resolved { channel: w.channel, session: w.session, id: (id, token), durable });
                false
            });
            for w in pending {
                if !stopped.pending.contains(&w) {
                    stopped.pending.push(w);
                }
            }
            stopped.unremoved.extend(unremoved);
            stopped.tiers.push((t.id, tier));
        }
        (stopped, resolved)
    }

    /// Starts the tiers of `stopped` again (a takeover that did not happen)
    /// and offers them the writes they had not finished.
    pub(super) fn resume(&mut self, stopped: Stopped, store: &mut Store) {
        for (id, t) in stopped.tiers {
            match t.resume() {
                Ok(tier) => self.sides.push(TierSide::new(id, tier, store)),
                Err(e) => tracing::error!("tier {id} did not restart after a failed takeover: {e}"),
            }
        }
        for w in stopped.pending {
            self.rewrite(store, w);
        }
    }

    /// Lets every tier touch its storage (the daemon serves from now on).
    pub(super) fn release(&self) {
        for t in &self.sides {
            t.tier.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kachedb_shm::{DType, Shape};
    use std::time::Duration;

    /// A tier that does nothing by itself: the test plays its part through
    /// [`Tiers::on_event`], deterministically.
    #[derive(Debug)]
    struct Scripted;

    impl Tier for Scripted {
        fn write_behind(&self, _offer: Offer<'_>, _pinned: &mut dyn FnMut() -> Option<WriteJob>) {}
        fn fetch(&self, _job: FetchJob) {}
        fn fetch_bound(&self) -> Duration {
            Duration::from_secs(60)
        }
        fn landed(&self, _len: u64) {}
        fn filled_after(&self, _us: u64) {}
        fn remove(&self, _key: u128) -> Removal {
            Removal::Done
        }
        fn stop(self: Box<Self>) -> (Box<dyn StoppedTier>, Handover) {
            unreachable!("not stopped in these tests")
        }
    }

    /// A tier that records the fetches it is asked for and does nothing else.
    #[derive(Debug, Default)]
    struct Recording(std::sync::Arc<std::sync::Mutex<Vec<FetchJob>>>);

    impl Tier for Recording {
        fn write_behind(&self, _offer: Offer<'_>, _pinned: &mut dyn FnMut() -> Option<WriteJob>) {}
        fn fetch(&self, job: FetchJob) {
            self.0.lock().unwrap().push(job);
        }
        fn fetch_bound(&self) -> Duration {
            Duration::from_secs(60)
        }
        fn landed(&self, _len: u64) {}
        fn filled_after(&self, _us: u64) {}
        fn remove(&self, _key: u128) -> Removal {
            Removal::Done
        }
        fn stop(self: Box<Self>) -> (Box<dyn StoppedTier>, Handover) {
            unreachable!("not stopped in these tests")
        }
    }

    /// Issue 41, item 3: a fetch names the tenant of the client whose miss
    /// started it, at the first tier and at the next one its missing keys
    /// go to, so a tier that keeps no tenant fills for that one.
    #[test]
    fn a_fetch_names_the_asking_tenant_at_every_tier() {
        let mut store = Store::new(0, 64 * 4096);
        let (first, second) = (Recording::default(), Recording::default());
        let (asked_first, asked_second) = (first.0.clone(), second.0.clone());
        let mut tiers = Tiers::new(vec![Box::new(first), Box::new(second)], &mut store);
        let fetch = tiers.start_fetch(&store, 3, "team-a", vec![5, 6]).unwrap().0;
        let jobs = asked_first.lock().unwrap().clone();
        assert_eq!(jobs.len(), 1);
        assert_eq!((jobs[0].id, jobs[0].tenant.as_str(), jobs[0].keys.clone()), (fetch, "team-a", vec![5, 6]));
        // The first tier has neither key: both go on to the second tier.
        tiers.on_event(&mut store, 0, TierEvent::Filled { fetch, filled: vec![] });
        drain(&mut tiers, &mut store);
        let jobs = asked_second.lock().unwrap().clone();
        assert_eq!(jobs.len(), 1);
        assert_eq!((jobs[0].id, jobs[0].tenant.as_str(), jobs[0].keys.clone()), (fetch, "team-a", vec![5, 6]));
    }

    /// A tier that records its fetches and names `next` as the blocks
    /// after any key (its read-ahead).
    #[derive(Debug, Default)]
    struct Chained {
        jobs: std::sync::Arc<std::sync::Mutex<Vec<FetchJob>>>,
        next: Vec<u128>,
    }

    impl Tier for Chained {
        fn write_behind(&self, _offer: Offer<'_>, _pinned: &mut dyn FnMut() -> Option<WriteJob>) {}
        fn fetch(&self, job: FetchJob) {
            self.jobs.lock().unwrap().push(job);
        }
        fn chain_after(&self, _key: u128) -> Vec<u128> {
            self.next.clone()
        }
        fn fetch_bound(&self) -> Duration {
            Duration::from_secs(60)
        }
        fn landed(&self, _len: u64) {}
        fn filled_after(&self, _us: u64) {}
        fn remove(&self, _key: u128) -> Removal {
            Removal::Done
        }
        fn stop(self: Box<Self>) -> (Box<dyn StoppedTier>, Handover) {
            unreachable!("not stopped in these tests")
        }
    }

    fn spec_of(key: u128, len: u64) -> FillSpec {
        FillSpec {
            key,
            dtype: DType::U8,
            shape: Shape::for_bytes(len).unwrap(),
            len,
            parent: None,
            tenant: None,
            meta: None,
        }
    }

    /// Read-ahead: a miss of key 1 starts a read-ahead fetch of key 2; with
    /// the megaslab full of a client's blocks it gets no room (nothing
    /// evicted for a guess). A client's miss of key 2 then waits for that
    /// fetch, and when it ends without the block the client gets a fill of
    /// its own (which may evict), not a miss. With room, a read-ahead's block
    /// is committed cold: evicted before the client's blocks.
    #[test]
    fn a_read_ahead_takes_free_room_only_and_a_client_waiting_on_one_gets_its_block() {
        let mut store = Store::new(0, 4 * 4096);
        let tier = Chained { next: vec![2], ..Chained::default() };
        let jobs = tier.jobs.clone();
        let mut tiers = Tiers::new(vec![Box::new(tier)], &mut store);
        let client = store.open_session();
        for k in 10..14u128 {
            let c = store.handle_internal(client, &reserve(k, 4096));
            store.handle_internal(client, &Request::Commit { handle: c.handle, parent: None });
        }
        assert_eq!(store.stats().bytes_free, 0);
        tiers.start_fetch(&store, 0, "default", vec![1]).unwrap();
        let ahead = {
            let j = jobs.lock().unwrap();
            assert_eq!(
                j.iter().map(|j| (j.keys.clone(), j.ahead)).collect::<Vec<_>>(),
                [(vec![1], false), (vec![2], true)]
            );
            j[1].id
        };
        let (tx, mut rx) = crate::tier::reply::channel();
        tiers.on_event(&mut store, 0, TierEvent::Reserve { fetch: ahead, blocks: vec![spec_of(2, 4096)], reply: tx });
        drain(&mut tiers, &mut store);
        assert!(rx.try_recv().unwrap().unwrap()[0].is_none(), "a guess got room");
        assert_eq!(store.stats().evictions, 0, "a guess evicted a block");
        // The client's miss of key 2 waits for the read-ahead (no second read)...
        assert_eq!(tiers.start_fetch(&store, 1, "default", vec![2]), Some((ahead, vec![2])));
        assert_eq!(jobs.lock().unwrap().len(), 2);
        // ...which ends without it: the key is read again, for the client.
        tiers.on_event(&mut store, 0, TierEvent::Filled { fetch: ahead, filled: vec![] });
        assert!(drain(&mut tiers, &mut store).is_empty(), "the client was answered a miss");
        let job = jobs.lock().unwrap()[2].clone();
        assert_eq!((job.id, job.keys, job.ahead), (ahead, vec![2], false));
        let (tx, mut rx) = crate::tier::reply::channel();
        tiers.on_event(&mut store, 0, TierEvent::Reserve { fetch: ahead, blocks: vec![spec_of(2, 4096)], reply: tx });
        drain(&mut tiers, &mut store);
        let r = rx.try_recv().unwrap().unwrap()[0].expect("room for the client's fill");
        tiers.on_event(&mut store, 0, TierEvent::Filled { fetch: ahead, filled: vec![(r.handle, 4096)] });
        let done = drain(&mut tiers, &mut store);
        assert_eq!((done.len(), done[0].channel, done[0].committed.clone()), (1, Some(1), vec![2]));
        assert_eq!(store.stats().evictions, 1);

        // With room (a block deleted): a read-ahead of key 3 is committed
        // cold, and the next eviction takes it before the client's blocks.
        let victim = (10..14u128).find(|&k| store.peek(k).is_some()).unwrap();
        store.handle_internal(client, &Request::Delete { key: victim });
        let mut tiers_b = {
            let tier = Chained { next: vec![3], ..Chained::default() };
            let jobs = tier.jobs.clone();
            let t = Tiers::new(vec![Box::new(tier)], &mut store);
            (t, jobs)
        };
        tiers_b.0.start_fetch(&store, 0, "default", vec![4]).unwrap();
        let ahead = tiers_b.1.lock().unwrap()[1].id;
        let (tx, mut rx) = crate::tier::reply::channel();
        tiers_b.0.on_event(
            &mut store,
            0,
            TierEvent::Reserve { fetch: ahead, blocks: vec![spec_of(3, 4096)], reply: tx },
        );
        drain(&mut tiers_b.0, &mut store);
        let r = rx.try_recv().unwrap().unwrap()[0].expect("free room for the read-ahead");
        tiers_b.0.on_event(&mut store, 0, TierEvent::Filled { fetch: ahead, filled: vec![(r.handle, 4096)] });
        assert_eq!(drain(&mut tiers_b.0, &mut store)[0].committed, vec![3]);
        let c = store.handle_internal(client, &reserve(20, 4096));
        assert_eq!(c.status, Status::Ok);
        assert!(store.peek(3).is_none(), "the guess was not the first evicted");
        assert_eq!((10..14u128).filter(|&k| store.peek(k).is_some()).count(), 2);
        assert!(store.peek(2).is_some());
        store.check_invariants().unwrap();
    }

    /// Read-ahead at the tier that knows the chain: the first tier (a disk
    /// without these blocks) names none after key 1, the second (the remote
    /// tier, from its hints) names 2 and 3, so their read-ahead fetches go to
    /// the second tier. A client's miss of key 2 waits for that fetch there
    /// and gets its block from it; key 3, read ahead after 2 was filled,
    /// links to it.
    #[test]
    fn a_read_ahead_goes_to_the_tier_that_knows_the_chain_and_a_client_waits_for_it_there() {
        let mut store = Store::new(0, 16 * 4096);
        let first = Recording::default();
        let second = Chained { next: vec![2, 3], ..Chained::default() };
        let (asked_first, asked_second) = (first.0.clone(), second.jobs.clone());
        let mut tiers = Tiers::new(vec![Box::new(first), Box::new(second)], &mut store);
        let fetch = tiers.start_fetch(&store, 0, "default", vec![1]).unwrap().0;
        let first_jobs = asked_first.lock().unwrap().clone();
        assert_eq!(first_jobs.iter().map(|j| (j.id, j.ahead)).collect::<Vec<_>>(), [(fetch, false)]);
        let ahead: Vec<(u64, Vec<u128>, bool)> =
            asked_second.lock().unwrap().iter().map(|j| (j.id, j.keys.clone(), j.ahead)).collect();
        assert_eq!(ahead.iter().map(|a| (a.1.clone(), a.2)).collect::<Vec<_>>(), [(vec![2], true), (vec![3], true)]);
        let (ahead2, ahead3) = (ahead[0].0, ahead[1].0);
        // The client's miss of key 2 waits for the second tier's read-ahead.
        assert_eq!(tiers.start_fetch(&store, 7, "default", vec![2]), Some((ahead2, vec![2])));
        assert_eq!(asked_second.lock().unwrap().len(), 2, "key 2 read a second time");
        let land = |tiers: &mut Tiers, store: &mut Store, fetch: u64, key: u128, parent: Option<u128>| {
            let (tx, mut rx) = crate::tier::reply::channel();
            let spec = FillSpec { parent, ..spec_of(key, 4096) };
            tiers.on_event(store, 1, TierEvent::Reserve { fetch, blocks: vec![spec], reply: tx });
            drain(tiers, store);
            let r = rx.try_recv().unwrap().unwrap()[0].expect("free room");
            tiers.on_event(store, 1, TierEvent::Filled { fetch, filled: vec![(r.handle, 4096)] });
            drain(tiers, store)
        };
        // Key 3's fill ends first: held until its parent's (key 2's) is over.
        assert!(land(&mut tiers, &mut store, ahead3, 3, Some(2)).is_empty());
        assert!(store.peek(3).is_none(), "committed before its parent");
        let done = land(&mut tiers, &mut store, ahead2, 2, None);
        assert_eq!(
            done.iter().map(|d| (d.channel, d.committed.clone())).collect::<Vec<_>>(),
            [(Some(7), vec![2]), (None, vec![3])],
            "the client's block, then the one held for it"
        );
        assert!(store.peek(2).is_some() && store.peek(3).is_some());
        assert_eq!(store.stats().chained_blocks, 1, "key 3 did not link to key 2");
        store.check_invariants().unwrap();
    }

    /// A client's batch never reads a key a second time while a read-ahead
    /// reads it: its fetch covers the other keys; a batch of keys all being
    /// read ahead waits for the first one's read-ahead, and the keys left
    /// out are asked for again when its channel is served again.
    #[test]
    fn a_batch_reads_no_key_being_read_ahead_again() {
        let mut store = Store::new(0, 16 * 4096);
        let tier = Chained { next: vec![2, 3], ..Chained::default() };
        let jobs = tier.jobs.clone();
        let mut tiers = Tiers::new(vec![Box::new(tier)], &mut store);
        let keys_of = |jobs: &std::sync::Arc<std::sync::Mutex<Vec<FetchJob>>>| -> Vec<(Vec<u128>, bool)> {
            jobs.lock().unwrap().iter().map(|j| (j.keys.clone(), j.ahead)).collect()
        };
        let (first, covered) = tiers.start_fetch(&store, 0, "default", vec![1]).unwrap();
        assert_eq!(covered, [1]);
        assert_eq!(keys_of(&jobs), [(vec![1], false), (vec![2], true), (vec![3], true)]);
        let ahead2 = jobs.lock().unwrap()[1].id;
        // Keys 2 and 3 are being read ahead: a batch of 2, 3, 4 reads key 4 only.
        let (batch, covered) = tiers.start_fetch(&store, 1, "default", vec![2, 3, 4]).unwrap();
        assert_eq!(covered, [4]);
        assert_eq!(keys_of(&jobs)[3], (vec![4], false));
        assert_eq!(jobs.lock().unwrap().len(), 4, "a key being read ahead was read again");
        assert!(batch != first && batch != ahead2);
        // A batch of keys all being read ahead waits for the first one's.
        let (waited, covered) = tiers.start_fetch(&store, 2, "default", vec![2, 3]).unwrap();
        assert_eq!((waited, covered), (ahead2, vec![2]));
        assert_eq!(jobs.lock().unwrap().len(), 4, "a key being read ahead was read again");
        // Key 2's read-ahead now has a channel waiting: a fourth channel's
        // batch reads key 2 itself (one channel waits for a fetch).
        let (_, covered) = tiers.start_fetch(&store, 3, "default", vec![2, 3]).unwrap();
        assert_eq!(covered, [2]);
    }

    fn reserve(key: u128, len: u64) -> Request {
        Request::Reserve { key, dtype: DType::U8, shape: Shape::for_bytes(len).unwrap(), len, page_offset: 0 }
    }

    /// Runs the tiers' queued fill work to the end.
    fn drain(tiers: &mut Tiers, store: &mut Store) -> Vec<FetchDone> {
        let mut done = Vec::new();
        while tiers.slice(store, &mut done) {}
        done
    }

    /// Issue 25, item 7: a client commits K (naming its parent) while a fill
    /// of K is in flight, between the fill's reservation and its commit. The
    /// client's block stands, with its chain link; the fill's copy is dropped
    /// and its reservation freed. (Across processes the window is about a
    /// millisecond; here the test holds it open.)
    #[test]
    fn a_fill_never_replaces_a_block_a_client_committed_while_it_ran() {
        let mut store = Store::new(0, 64 * 4096);
        let mut tiers = Tiers::new(vec![Box::new(Scripted)], &mut store);
        let (parent, key) = (7u128, 8u128);
        let client = store.open_session();
        let c = store.handle_internal(client, &reserve(parent, 100));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(
            store.handle_internal(client, &Request::Commit { handle: c.handle, parent: None }).status,
            Status::Ok
        );

        // The fetch asks for room for K, which is missing.
        let fetch = tiers.start_fetch(&store, 0, "default", vec![key]).unwrap().0;
        let (tx, mut rx) = crate::tier::reply::channel();
        let spec = FillSpec {
            key,
            dtype: DType::U8,
            shape: Shape::for_bytes(300).unwrap(),
            len: 300,
            parent: None,
            tenant: None,
            meta: None,
        };
        tiers.on_event(&mut store, 0, TierEvent::Reserve { fetch, blocks: vec![spec], reply: tx });
        drain(&mut tiers, &mut store);
        let reserved = rx.try_recv().unwrap().unwrap()[0].expect("room for the fill");

        // Meanwhile a client commits K after its parent.
        let c = store.handle_internal(client, &reserve(key, 200));
        assert_eq!(c.status, Status::Ok);
        let client_offset = c.offset;
        assert_eq!(
            store.handle_internal(client, &Request::Commit { handle: c.handle, parent: Some(parent) }).status,
            Status::Ok
        );
        assert_eq!(store.stats().chained_blocks, 1);

        // The fill's copy lands and the tier reports it filled.
        tiers.on_event(&mut store, 0, TierEvent::Filled { fetch, filled: vec![(reserved.handle, 300)] });
        let done = drain(&mut tiers, &mut store);
        assert_eq!(done.len(), 1);
        assert!(done[0].committed.is_empty(), "the fill committed {:?}", done[0].committed);

        let b = store.peek(key).expect("K is there");
        assert_eq!((b.data_offset, b.len), (client_offset, 200), "the fill's older copy replaced the client's block");
        let st = store.stats();
        assert_eq!(st.chained_blocks, 1, "K's link to its parent was cut");
        assert_eq!((st.reserved, st.blocks), (0, 2));
        store.check_invariants().unwrap();
    }

    /// A client deletes K while a fill of K is in flight (its tier read the
    /// block before the DELETE): the fill's copy is not committed, whether
    /// the DELETE comes before the fill's reservation or between it and the
    /// commit; a fetch started after the DELETE fills K again (the tier
    /// decides whether it still has it).
    #[test]
    fn a_fill_in_flight_never_brings_back_a_key_deleted_meanwhile() {
        let mut store = Store::new(0, 64 * 4096);
        let mut tiers = Tiers::new(vec![Box::new(Scripted)], &mut store);
        let spec = |key| FillSpec {
            key,
            dtype: DType::U8,
            shape: Shape::for_bytes(300).unwrap(),
            len: 300,
            parent: None,
            tenant: None,
            meta: None,
        };
        let (a, b) = (1u128, 2u128);
        let client = store.open_session();
        // A: deleted before the reservation; B: after it.
        let fa = tiers.start_fetch(&store, 0, "default", vec![a]).unwrap().0;
        let fb = tiers.start_fetch(&store, 1, "default", vec![b]).unwrap().0;
        tiers.remove(0, client, a);
        let (tx, mut rx) = crate::tier::reply::channel();
        tiers.on_event(&mut store, 0, TierEvent::Reserve { fetch: fa, blocks: vec![spec(a)], reply: tx });
        drain(&mut tiers, &mut store);
        assert!(rx.try_recv().unwrap().unwrap()[0].is_none(), "room reserved for a deleted key");
        tiers.on_event(&mut store, 0, TierEvent::Filled { fetch: fa, filled: vec![] });
        let (tx, mut rx) = crate::tier::reply::channel();
        tiers.on_event(&mut store, 0, TierEvent::Reserve { fetch: fb, blocks: vec![spec(b)], reply: tx });
        drain(&mut tiers, &mut store);
        let r = rx.try_recv().unwrap().unwrap()[0].expect("room for B");
        tiers.remove(0, client, b);
        tiers.on_event(&mut store, 0, TierEvent::Filled { fetch: fb, filled: vec![(r.handle, 300)] });
        let done = drain(&mut tiers, &mut store);
        assert!(done.iter().all(|d| d.committed.is_empty()), "a deleted key was filled back");
        assert!(store.peek(a).is_none() && store.peek(b).is_none());
        assert_eq!(store.stats().reserved, 0);
        // Every fetch of then is over: the DELETEs are forgotten, and a new fetch fills B.
        assert!(tiers.open.is_empty() && tiers.deleted.is_empty());
        let fc = tiers.start_fetch(&store, 0, "default", vec![b]).unwrap().0;
        let (tx, mut rx) = crate::tier::reply::channel();
        tiers.on_event(&mut store, 0, TierEvent::Reserve { fetch: fc, blocks: vec![spec(b)], reply: tx });
        drain(&mut tiers, &mut store);
        let r = rx.try_recv().unwrap().unwrap()[0].expect("room for B");
        tiers.on_event(&mut store, 0, TierEvent::Filled { fetch: fc, filled: vec![(r.handle, 300)] });
        let done = drain(&mut tiers, &mut store);
        assert_eq!(done.iter().flat_map(|d| d.committed.clone()).collect::<Vec<_>>(), vec![b]);
        store.check_invariants().unwrap();
    }
}
