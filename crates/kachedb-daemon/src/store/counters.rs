//! What the store counts: requests by op, answers by status, hits, evictions.
//! The gauges (blocks, bytes, pins…) are computed when asked; the live pins and
//! reservations are also counted here, so that [`Store::gauges`](super::Store::gauges) is `O(1)`.

use kachedb_shm::control::StoreStats;
use kachedb_shm::{Op, Status};

/// Table index of an op or status code (codes are below 16).
const CODES: usize = 16;
const _: () = assert!(
    (Op::Stats as usize) < CODES && (Status::Internal as usize) < CODES && (Status::NotDurable as usize) < CODES
);

/// Counters of a [`Store`](super::Store), indexed by wire code.
#[derive(Clone, Debug, Default)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) struct Counters {
    /// Requests by op code, any outcome.
    requests: [u64; CODES],
    /// OK answers by op code (for GET, LOOKUP and DELETE: hits).
    ok: [u64; CODES],
    /// Error answers by status code, plus internal errors met outside requests.
    errors: [u64; CODES],
    /// Blocks evicted.
    evictions: u64,
    /// Extent bytes freed by eviction.
    evicted_bytes: u64,
    /// Committed blocks that replaced an older block of the same key.
    replaced: u64,
    /// Pins held now (counted where pin records change).
    pins_held: u64,
    /// Reservations live now (counted where reservation slots are taken and freed).
    reservations_live: u64,
    /// Tensor bytes of committed blocks.
    stored_bytes: u64,
    /// Tensor bytes of the blocks found, by op code (GET, LOOKUP).
    hit_bytes: [u64; CODES],
    /// OUT_OF_MEMORY answers because of the per-client limit.
    client_limit_hits: u64,
    /// OUT_OF_MEMORY answers because of the tenant limit.
    tenant_limit_hits: u64,
    /// COMMITs whose parent was not linked.
    parents_missing: u64,
    /// Chain links cut because the parent was unlinked.
    links_cut: u64,
    /// Of those, cut by eviction.
    links_cut_by_eviction: u64,
    /// Of those, links whose child did not hold its parent (another
    /// tenant's child, or one pinned only by other tenants' clients): the
    /// only links eviction cuts under the chain policy.
    unheld_links_cut_by_eviction: u64,
}

impl Counters {
    /// A request of `op` arrived.
    #[inline]
    pub(super) fn request(&mut self, op: Op) {
        self.requests[op as usize] += 1;
    }

    /// A request of `op` was answered `status`.
    #[inline]
    pub(super) fn answer(&mut self, op: Op, status: Status) {
        match status {
            Status::Ok => self.ok[op as usize] += 1,
            s => self.errors[s as usize] += 1,
        }
    }

    /// Puts back the requests, answers and hit bytes counted since `saved`
    /// was taken (a request the daemon made for itself); `INTERNAL` answers
    /// stay counted (each is a bug, whoever asked).
    pub(super) fn restore_requests(&mut self, saved: &Counters) {
        self.requests = saved.requests;
        self.ok = saved.ok;
        let internal = self.errors[Status::Internal as usize];
        self.errors = saved.errors;
        self.errors[Status::Internal as usize] = internal;
        self.hit_bytes = saved.hit_bytes;
    }

    /// A reservation was made.
    pub(super) fn reservation_opened(&mut self) {
        self.reservations_live += 1;
    }

    /// A reservation was committed or freed.
    pub(super) fn reservation_closed(&mut self) {
        self.reservations_live = self.reservations_live.saturating_sub(1);
    }

    /// A block got one more pin.
    pub(super) fn pinned(&mut self) {
        self.pins_held += 1;
    }

    /// `n` pins went.
    pub(super) fn unpinned(&mut self, n: u64) {
        self.pins_held = self.pins_held.saturating_sub(n);
    }

    /// A block of `len` tensor bytes was committed.
    pub(super) fn stored(&mut self, len: u64) {
        self.stored_bytes += len;
    }

    /// `op` (GET or LOOKUP) found a block of `len` tensor bytes.
    pub(super) fn hit(&mut self, op: Op, len: u64) {
        self.hit_bytes[op as usize] += len;
    }

    pub(super) fn pins_held(&self) -> u64 {
        self.pins_held
    }

    pub(super) fn reservations_live(&self) -> u64 {
        self.reservations_live
    }

    pub(super) fn evictions(&self) -> u64 {
        self.evictions
    }

    pub(super) fn evicted_bytes(&self) -> u64 {
        self.evicted_bytes
    }

    pub(super) fn replaced(&self) -> u64 {
        self.replaced
    }

    pub(super) fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }

    pub(super) fn hit_bytes(&self, op: Op) -> u64 {
        self.hit_bytes[op as usize]
    }

    /// An internal error outside a request (while closing a session): a bug.
    pub(super) fn internal_error(&mut self) {
        self.errors[Status::Internal as usize] += 1;
    }

    /// A request was refused by the per-client byte limit.
    pub(super) fn client_limit_hit(&mut self) {
        self.client_limit_hits += 1;
    }

    /// A RESERVE was refused by its tenant's limit.
    pub(super) fn tenant_limit_hit(&mut self) {
        self.tenant_limit_hits += 1;
    }

    /// A COMMIT named a parent that is not linked.
    pub(super) fn parent_missing(&mut self) {
        self.parents_missing += 1;
    }

    /// A chain link was cut (its parent unlinked; `by_eviction`: evicted;
    /// `held`: the child held its parent).
    pub(super) fn link_cut(&mut self, by_eviction: bool, held: bool) {
        self.links_cut += 1;
        if by_eviction {
            self.links_cut_by_eviction += 1;
            if !held {
                self.unheld_links_cut_by_eviction += 1;
            }
        }
    }

    /// Takes back a [`link_cut`](Self::link_cut) with the same arguments (a
    /// refused unit put the evicted parent back).
    pub(super) fn link_uncut(&mut self, by_eviction: bool, held: bool) {
        self.links_cut = self.links_cut.saturating_sub(1);
        if by_eviction {
            self.links_cut_by_eviction = self.links_cut_by_eviction.saturating_sub(1);
            if !held {
                self.unheld_links_cut_by_eviction = self.unheld_links_cut_by_eviction.saturating_sub(1);
            }
        }
    }

    pub(super) fn links_cut_by_eviction(&self) -> u64 {
        self.links_cut_by_eviction
    }

    pub(super) fn unheld_links_cut_by_eviction(&self) -> u64 {
        self.unheld_links_cut_by_eviction
    }

    /// A committed block replaced an older block of its key.
    pub(super) fn block_replaced(&mut self) {
        self.replaced += 1;
    }

    /// A block of `extent_len` bytes was evicted.
    pub(super) fn evicted(&mut self, extent_len: u64) {
        self.evictions += 1;
        self.evicted_bytes += extent_len;
    }

    /// Takes back an [`evicted`](Self::evicted) (a refused unit put the block back).
    pub(super) fn unevicted(&mut self, extent_len: u64) {
        self.evictions = self.evictions.saturating_sub(1);
        self.evicted_bytes = self.evicted_bytes.saturating_sub(extent_len);
    }

    /// `n` more answers of `op`, each `status` (the RESERVEs of a refused
    /// unit that were not served, answered with its refusal).
    pub(super) fn answered_unserved(&mut self, op: Op, status: Status, n: u64) {
        self.requests[op as usize] += n;
        match status {
            Status::Ok => self.ok[op as usize] += n,
            s => self.errors[s as usize] += n,
        }
    }

    /// `n` answers of `op` counted `Ok` become `status` (the RESERVEs of a
    /// refused unit admitted before its refusal).
    pub(super) fn reanswered(&mut self, op: Op, status: Status, n: u64) {
        self.ok[op as usize] = self.ok[op as usize].saturating_sub(n);
        match status {
            Status::Ok => self.ok[op as usize] += n,
            s => self.errors[s as usize] += n,
        }
    }

    /// Writes the counter fields of `st` (the gauges are the caller's).
    pub(super) fn fill(&self, st: &mut StoreStats) {
        let req = |op: Op| self.requests[op as usize];
        let hits = |op: Op| self.ok[op as usize];
        let err = |s: Status| self.errors[s as usize];
        st.evictions = self.evictions;
        st.evicted_bytes = self.evicted_bytes;
        st.replaced = self.replaced;
        st.pings = req(Op::Ping);
        st.reserves = req(Op::Reserve);
        st.commits = req(Op::Commit) + req(Op::CommitPin);
        st.aborts = req(Op::Abort);
        st.gets = req(Op::Get);
        st.get_hits = hits(Op::Get);
        st.releases = req(Op::Release);
        st.lookups = req(Op::Lookup);
        st.lookup_hits = hits(Op::Lookup);
        st.deletes = req(Op::Delete);
        st.delete_hits = hits(Op::Delete);
        st.stats_requests = req(Op::Stats);
        st.not_found = err(Status::NotFound);
        st.out_of_memory = err(Status::OutOfMemory);
        st.client_limit_hits = self.client_limit_hits;
        st.tenant_limit_hits = self.tenant_limit_hits;
        st.parents_missing = self.parents_missing;
        st.links_cut = self.links_cut;
        st.links_cut_by_eviction = self.links_cut_by_eviction;
        st.invalid = err(Status::Invalid);
        st.bad_handle = err(Status::BadHandle);
        st.too_large = err(Status::TooLarge);
        st.denied = err(Status::Denied);
        st.internal = err(Status::Internal);
    }
}

impl Counters {
    /// As the takeover state carries them.
    pub(super) fn to_state(&self) -> crate::takeover::state::StoreCounters {
        crate::takeover::state::StoreCounters {
            requests: self.requests.to_vec(),
            ok: self.ok.to_vec(),
            errors: self.errors.to_vec(),
            hit_bytes: self.hit_bytes.to_vec(),
            figures: [
                self.evictions,
                self.evicted_bytes,
                self.replaced,
                self.pins_held,
                self.reservations_live,
                self.stored_bytes,
                self.client_limit_hits,
                self.tenant_limit_hits,
                self.parents_missing,
                self.links_cut,
                self.links_cut_by_eviction,
                self.unheld_links_cut_by_eviction,
            ],
        }
    }

    /// What [`to_state`](Self::to_state) gave; `Err` on tables of another length.
    pub(super) fn from_state(c: &crate::takeover::state::StoreCounters) -> Result<Counters, String> {
        let table = |v: &[u64], what: &str| -> Result<[u64; CODES], String> {
            <[u64; CODES]>::try_from(v).map_err(|_| format!("{} counters of {what}, this build has {CODES}", v.len()))
        };
        let [evictions, evicted_bytes, replaced, pins_held, reservations_live, stored_bytes, client_limit_hits, tenant_limit_hits, parents_missing, links_cut, links_cut_by_eviction, unheld_links_cut_by_eviction] =
            c.figures;
        Ok(Counters {
            requests: table(&c.requests, "requests")?,
            ok: table(&c.ok, "answers")?,
            errors: table(&c.errors, "errors")?,
            hit_bytes: table(&c.hit_bytes, "hit bytes")?,
            evictions,
            evicted_bytes,
            replaced,
            pins_held,
            reservations_live,
            stored_bytes,
            client_limit_hits,
            tenant_limit_hits,
            parents_missing,
            links_cut,
            links_cut_by_eviction,
            unheld_links_cut_by_eviction,
        })
    }
}
