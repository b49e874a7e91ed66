//! The megaslab gate: a tier's only way into the region's bytes.
//!
//! Every copy a tier makes into a fill's reservation and every read of a
//! block it pinned runs inside [`SlabGate::with`]; [`SlabGate::close`]
//! (stopping the tier) waits for those in progress and refuses later ones.
//! After it nothing of the tier touches the megaslab, whatever its threads
//! are still doing, so the serve loop may drop the tier's session (its pins
//! and reservations) and reuse those extents. A tier never touches bytes it
//! does not own (a reservation made for it) or pin (a block it writes
//! behind); the serve loop keeps them so until the tier reports back, and
//! the gate keeps them so across a stop. A copy is a memcpy, a hash or a
//! file read of at most one block, so closing waits milliseconds.

use kachedb_shm::Region;
use std::ptr::NonNull;
use std::sync::{Arc, PoisonError, RwLock};

/// Why [`SlabGate::with`] did not run its closure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The gate is closed: the tier is stopping.
    Closed,
    /// The range is not inside the megaslab.
    Outside,
}

/// See the module docs.
#[derive(Debug)]
pub struct SlabGate {
    region: Arc<Region>,
    /// Whether copies may start. Read-locked for each copy, write-locked to
    /// close or reopen.
    open: RwLock<bool>,
}

impl SlabGate {
    /// An open gate into `region`'s megaslab.
    pub fn new(region: Arc<Region>) -> SlabGate {
        SlabGate { region, open: RwLock::new(true) }
    }

    /// The region (to hand to a tier started again).
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Runs `f` on the `len` bytes of megaslab at `offset` (bytes from the
    /// region base) unless the gate is closed or the range is outside the
    /// megaslab. The gate cannot close while `f` runs.
    pub fn with<R>(&self, offset: u64, len: u64, f: impl FnOnce(NonNull<u8>) -> R) -> Result<R, Refused> {
        let open = self.open.read().unwrap_or_else(PoisonError::into_inner);
        if !*open {
            return Err(Refused::Closed);
        }
        let ptr = self.region.slab_ptr(offset, len).ok_or(Refused::Outside)?;
        Ok(f(ptr))
    }

    /// Closes the gate: waits for the copies in progress, refuses later ones.
    pub fn close(&self) {
        *self.open.write().unwrap_or_else(PoisonError::into_inner) = false;
    }

    /// Opens the gate again (a tier resumed after a takeover that did not
    /// happen: its session, pins and reservations are its own again).
    pub fn reopen(&self) {
        *self.open.write().unwrap_or_else(PoisonError::into_inner) = true;
    }
}
