//! The one place atomics and cells are imported from, so the same ring code runs
//! under the loom model checker (`RUSTFLAGS="--cfg loom"`), as tokio does.

#[cfg(not(loom))]
pub(crate) use core::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use core::hint::spin_loop;
#[cfg(loom)]
pub(crate) use loom::hint::spin_loop;

// A wait loop that yields must yield through loom under the model checker, or
// loom never schedules the other thread and reports a spin as a livelock.
#[cfg(loom)]
pub(crate) use loom::thread::yield_now;
#[cfg(not(loom))]
pub(crate) use std::thread::yield_now;

/// Words in a ring slot: slots are 64 bytes, copied as eight `u64`s.
#[cfg(not(loom))]
const SLOT_WORDS: usize = 8;

/// A ring slot: 64 bytes that the producer writes and the consumer reads,
/// never at the same time by the protocol (the cursors' Release/Acquire pairs
/// order the accesses) — but the peer is another process that may break the
/// protocol, so every access is one that stays defined under a concurrent write.
///
/// Without loom it is eight `AtomicU64` words, written and read with Relaxed
/// word copies: a peer scribbling on a slot makes the copy garbage (which
/// every reader validates), never undefined behaviour. Under loom it is loom's
/// cell, so the model checker sees every slot access and reports a race if the
/// cursors' orderings allowed one.
#[cfg(not(loom))]
#[derive(Debug, Default)]
#[repr(C)]
pub struct SlotCell<T> {
    words: [AtomicU64; SLOT_WORDS],
    frame: core::marker::PhantomData<T>,
}

/// A ring slot (see the non-loom definition); under loom, loom's cell.
#[cfg(loom)]
#[derive(Debug, Default)]
#[repr(transparent)]
pub struct SlotCell<T>(loom::cell::UnsafeCell<T>);

impl<T: bytemuck::Pod> SlotCell<T> {
    /// A slot holding `value`.
    pub fn new(value: T) -> Self {
        #[cfg(not(loom))]
        return Self {
            words: bytemuck::cast::<T, [u64; SLOT_WORDS]>(value).map(AtomicU64::new),
            frame: core::marker::PhantomData,
        };
        #[cfg(loom)]
        return Self(loom::cell::UnsafeCell::new(value));
    }

    /// Writes the slot.
    ///
    /// # Safety
    /// The caller owns the slot: the consumer does not read it concurrently
    /// (the producer owns slots in `[tail, head + capacity)`). Not needed for
    /// memory safety without loom (the words are atomic); it is the protocol,
    /// which loom checks.
    #[inline(always)]
    pub(crate) unsafe fn write(&self, value: T) {
        #[cfg(not(loom))]
        {
            let words = bytemuck::cast::<T, [u64; SLOT_WORDS]>(value);
            for (cell, word) in self.words.iter().zip(words) {
                // Relaxed: the slot is handed to the consumer by the Release
                // store of `tail` after these stores, which the consumer's
                // Acquire load of `tail` pairs with; a word needs no ordering
                // of its own.
                cell.store(word, Ordering::Relaxed);
            }
        }
        #[cfg(loom)]
        // SAFETY: exclusive access is the caller's contract (loom checks it).
        self.0.with_mut(|p| unsafe { p.write(value) });
    }

    /// Copies the slot out.
    ///
    /// # Safety
    /// The caller owns the slot: the producer does not write it concurrently
    /// (the consumer owns slots in `[head, tail)`). A hostile producer in another
    /// process may still scribble on it; the copy is then garbage, which every
    /// reader treats as untrusted input and validates.
    #[inline(always)]
    pub(crate) unsafe fn read(&self) -> T {
        #[cfg(not(loom))]
        {
            // Relaxed: the slot was handed over by the producer's Release store
            // of `tail`, which the caller's Acquire load of `tail` (before this
            // copy) pairs with; the caller's Release store of `head` (after it)
            // hands the slot back. A word needs no ordering of its own.
            let words = core::array::from_fn::<u64, SLOT_WORDS, _>(|i| self.words[i].load(Ordering::Relaxed));
            bytemuck::cast::<[u64; SLOT_WORDS], T>(words)
        }
        #[cfg(loom)]
        // SAFETY: see the function's contract (loom checks it).
        return self.0.with(|p| unsafe { p.read() });
    }
}
