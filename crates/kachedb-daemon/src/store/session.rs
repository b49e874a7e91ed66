//! Client sessions: one per control connection. A session lists the pins and
//! reservations it holds, so that closing it (the client is gone) drops them
//! all at once, and so that a handle only works for the session it was given to.

use super::handles::{decode_handle, HandleKind};
use super::slots::SlotState;
use super::{SessionId, Store};
use kachedb_shm::Status;
use std::collections::{BTreeMap, BTreeSet};

/// What one session holds.
#[derive(Clone, Debug, Default)]
#[cfg_attr(test, derive(serde::Serialize))]
pub(super) struct Session {
    /// block slot index -> pin slot index.
    pub(super) pins: BTreeMap<u32, u32>,
    /// Block slot indexes of this session's reservations.
    pub(super) reservations: BTreeSet<u32>,
    /// Extent bytes this session holds: its reservations' extents and the
    /// extents of the blocks it pins (each block once, however many pins),
    /// what `--max-client-bytes` limits.
    pub(super) held_bytes: u64,
    /// The uid of the client (`SO_PEERCRED`), whose sessions together
    /// `--max-uid-bytes` limits; `None` for the daemon's own sessions. Not in
    /// the handed-over state: the serve loop sets it again from its channels.
    #[cfg_attr(test, serde(skip))]
    pub(super) uid: Option<u32>,
    /// A session of the daemon's own (the remote tier's write-behind pins
    /// and fill reservations): `--max-client-bytes` does not limit it; the
    /// tier bounds what it holds itself (`--remote-queue-bytes`, the fills of
    /// a fetch). Not in the handed-over state: the tier's session is closed
    /// before a handover and opened anew after it.
    #[cfg_attr(test, serde(skip))]
    pub(super) internal: bool,
    /// Its tenant's row (`tenants.rs`).
    pub(super) tenant: super::TenantId,
    /// A session of the daemon's own whose reservations are fills of a
    /// tenant's blocks (`Store::set_fill_tenant`): its tenant's limit applies.
    #[cfg_attr(test, serde(skip))]
    pub(super) fills_for_tenant: bool,
    /// A session of the daemon's own whose reservations take free megaslab
    /// space only, evicting nothing (`Store::set_fill_no_evict`: a tier's
    /// read-ahead).
    #[cfg_attr(test, serde(skip))]
    pub(super) no_evict: bool,
}

impl Store {
    /// Opens a session; requests are made on behalf of one.
    pub fn open_session(&mut self) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session = self.next_session.wrapping_add(1);
        self.sessions.insert(id, Session::default());
        self.tenants.row(super::tenants::DEFAULT_ROW).sessions += 1;
        id
    }

    /// Opens a session of the daemon's own, which no client limit applies to
    /// (see [`Session::internal`]).
    pub fn open_internal_session(&mut self) -> SessionId {
        let id = self.open_session();
        if let Some(x) = self.sessions.get_mut(&id) {
            x.internal = true;
            // Not a client of the default tenant (its blocks are the default tenant's).
            let row = self.tenants.row(super::tenants::DEFAULT_ROW);
            row.sessions = row.sessions.saturating_sub(1);
        }
        id
    }

    /// Whether `s` is open.
    pub fn is_open(&self, s: SessionId) -> bool {
        self.sessions.contains_key(&s)
    }

    /// Says that session `s` is a client of `uid`: its held bytes count
    /// toward that uid's total (`--max-uid-bytes`).
    pub fn set_session_uid(&mut self, s: SessionId, uid: u32) {
        let Some(session) = self.sessions.get_mut(&s) else { return };
        let held = session.held_bytes;
        if let Some(old) = session.uid.replace(uid) {
            self.uid_take(old, held, false);
        }
        self.uid_take(uid, held, true);
    }

    /// Closes `s`: drops all its pins and aborts all its reservations at once
    /// (the client is gone). Blocks left unpinned become evictable again, or are
    /// freed if they were deleted or replaced meanwhile. Closing an unknown or
    /// closed session does nothing.
    pub fn close_session(&mut self, s: SessionId) {
        let Some(session) = self.sessions.remove(&s) else {
            return;
        };
        if let Some(uid) = session.uid {
            self.uid_take(uid, session.held_bytes, false);
        }
        if !session.internal {
            let row = self.tenants.row(session.tenant);
            row.sessions = row.sessions.saturating_sub(1);
        }
        let mut pins = 0;
        for (&block_index, &pin_index) in &session.pins {
            let r = self.take_pin_slot(pin_index).and_then(|pin| {
                pins += pin.count;
                if pin.foreign {
                    let len = match self.slots.get(block_index as usize).map(|slot| &slot.state) {
                        Some(SlotState::Block { tensor, .. }) => tensor.extent.len,
                        _ => return Err(Status::Internal),
                    };
                    self.returned(session.tenant, len)?;
                }
                self.drop_block_pins(block_index, pin.count, pin.foreign)
            });
            if r.is_err() {
                self.counters.internal_error();
            }
        }
        self.counters.unpinned(pins);
        for &index in &session.reservations {
            if self.free_reservation(index).is_err() {
                self.counters.internal_error();
            }
        }
    }

    /// The slot index of `s`'s live reservation named by `handle`.
    pub(super) fn own_reservation(&self, s: SessionId, handle: u64) -> Result<u32, Status> {
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

    /// Whether session `s` may take `more` extent bytes under the per-client
    /// limit and its uid's; if not, remembers the limit for the OUT_OF_MEMORY
    /// answer.
    pub(super) fn within_limit(&mut self, s: SessionId, more: u64) -> Result<(), Status> {
        let (held, uid, internal) =
            self.sessions.get(&s).map_or((0, None, false), |x| (x.held_bytes, x.uid, x.internal));
        if internal {
            return Ok(());
        }
        let over = |max: Option<u64>, held: u64| max.filter(|&max| held.saturating_add(more) > max);
        let uid_held = uid.and_then(|u| self.uid_held.get(&u).copied()).unwrap_or(0);
        let hit = over(self.max_session_bytes, held).or_else(|| uid.and_then(|_| over(self.max_uid_bytes, uid_held)));
        if let Some(max) = hit {
            self.limit_hit = Some(max);
            self.counters.client_limit_hit();
            return Err(Status::OutOfMemory);
        }
        Ok(())
    }

    /// Adds `delta` (or takes `-delta`) to session `s`'s held bytes, and to
    /// its uid's.
    pub(super) fn hold(&mut self, s: SessionId, bytes: u64, taken: bool) {
        let Some(x) = self.sessions.get_mut(&s) else { return };
        x.held_bytes = if taken { x.held_bytes.saturating_add(bytes) } else { x.held_bytes.saturating_sub(bytes) };
        if let Some(uid) = x.uid {
            self.uid_take(uid, bytes, taken);
        }
    }

    /// Adds (or takes) `bytes` to what the sessions of `uid` hold together.
    fn uid_take(&mut self, uid: u32, bytes: u64, taken: bool) {
        let held = self.uid_held.entry(uid).or_insert(0);
        *held = if taken { held.saturating_add(bytes) } else { held.saturating_sub(bytes) };
        if *held == 0 {
            self.uid_held.remove(&uid);
        }
    }

    /// Sets the most extent bytes one session may hold reserved and pinned
    /// (`kachedb serve --max-client-bytes`); `None`: no limit.
    pub fn set_max_session_bytes(&mut self, max: Option<u64>) {
        self.max_session_bytes = max;
    }

    /// Sets the most extent bytes the sessions of one uid may hold reserved
    /// and pinned together (`kachedb serve --max-uid-bytes`); `None`: no limit.
    pub fn set_max_uid_bytes(&mut self, max: Option<u64>) {
        self.max_uid_bytes = max;
    }
}
