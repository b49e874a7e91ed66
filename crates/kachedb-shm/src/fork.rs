//! What a process forked from one that attached regions may touch of them:
//! nothing. A forked child shares the parent's mappings but not its pins
//! (they belong to the parent's connection), so a view it inherited can
//! change under it as soon as the parent lets the block go. In the child,
//! every region attached in the parent is made inaccessible (`PROT_NONE`),
//! so reading an inherited view fails loudly (SIGSEGV) instead of reading
//! another block, and [`generation`] changes, which tells inherited
//! connections to stand down without touching the parent's rings.
//!
//! The child handler (`pthread_atfork`) runs in the child with one thread
//! left, while locks held by the parent's other threads stay locked forever:
//! it takes no lock, allocates nothing and only makes system calls
//! (`mprotect`) and atomic accesses. Regions are recorded in a fixed table
//! of atomics.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Regions attached at once that the child handler can protect; past that,
/// a region is not recorded (its inherited views stay readable in a child).
const MAX_REGIONS: usize = 256;
/// A slot's `base` while a thread is filling it in.
const CLAIMED: usize = 1;

struct Slot {
    /// Base address of a recorded mapping, 0 (free) or [`CLAIMED`].
    base: AtomicUsize,
    /// Its length in bytes.
    len: AtomicUsize,
}

static SLOTS: [Slot; MAX_REGIONS] =
    [const { Slot { base: AtomicUsize::new(0), len: AtomicUsize::new(0) } }; MAX_REGIONS];
/// Forks this process descends from (since it loaded this library).
static GENERATION: AtomicU64 = AtomicU64::new(0);
static HANDLER: std::sync::Once = std::sync::Once::new();

/// How many times this process's ancestry forked since this library was
/// loaded: a connection made at one generation was inherited through
/// `fork()` if the generation is no longer the same.
pub fn generation() -> u64 {
    // Relaxed: the value is written only in the child handler, before any
    // other code runs in the child; the parent never sees it change.
    GENERATION.load(Ordering::Relaxed)
}

/// A mapping recorded for the child handler; forgotten on drop, which must
/// happen before the mapping is unmapped.
#[derive(Debug)]
pub(crate) struct Recorded(Option<usize>);

impl Drop for Recorded {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            // Release: orders the slot's clearing before the caller's munmap,
            // so a fork from now on never protects an address that may be
            // reused by another mapping.
            SLOTS[i].base.store(0, Ordering::Release);
        }
    }
}

/// Records the mapping `base .. base + len` (mapped now, and unmapped only
/// after the result is dropped), so that it is made inaccessible in forked
/// children.
pub(crate) fn record(base: *mut u8, len: usize) -> Recorded {
    HANDLER.call_once(|| {
        // SAFETY: `in_child` is an `extern "C" fn()` that stays valid for the
        // life of the process (a static function); registering cannot fail
        // in a way that breaks anything (on failure children are unprotected).
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
    let base = base as usize;
    if base <= CLAIMED {
        return Recorded(None);
    }
    for (i, slot) in SLOTS.iter().enumerate() {
        // Relaxed on failure: the slot is someone else's, nothing is read.
        if slot.base.compare_exchange(0, CLAIMED, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            // Relaxed: published by the Release store of `base` below.
            slot.len.store(len, Ordering::Relaxed);
            // Release: pairs with the Acquire load in `in_child`, which then
            // sees this slot's `len`.
            slot.base.store(base, Ordering::Release);
            return Recorded(Some(i));
        }
    }
    Recorded(None)
}

/// The `pthread_atfork` child handler: see the module docs.
extern "C" fn in_child() {
    // Relaxed: the child has one thread; nothing else reads it yet.
    GENERATION.fetch_add(1, Ordering::Relaxed);
    for slot in &SLOTS {
        // Acquire: pairs with the Release store in `record` (the slot's `len`).
        let base = slot.base.load(Ordering::Acquire);
        if base > CLAIMED {
            let len = slot.len.load(Ordering::Relaxed);
            // SAFETY: the range was recorded while mapped and is cleared from
            // the table before it is unmapped, so it is this process's mapping
            // of a region (inherited from the parent); taking all access away
            // from it invalidates no Rust reference's guarantees beyond making
            // accesses fault, which is the point.
            unsafe { libc::mprotect(base as *mut libc::c_void, len, libc::PROT_NONE) };
        }
    }
}
