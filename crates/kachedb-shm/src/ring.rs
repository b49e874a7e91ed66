//! The single-producer single-consumer ring of 64-byte [`TensorBlockDescriptor`]
//! frames, living in shared memory.
//!
//! Layout: a 192-byte [`RingHeader`] in three isolated 64-byte cache lines
//! (consumer / producer / capacity and flags) followed by `capacity` slots of 64
//! bytes. Cursors are free-running `u64` slot counts (`slot = cursor & mask`); the
//! ring holds `tail - head` frames.
//!
//! Each side keeps its own cursor and a *cached* copy of the other side's in
//! private memory, and touches the other side's cache line only when its copy
//! says the ring is full (producer) or empty (consumer). Batches publish the
//! cursor once. The peer is untrusted: a cursor read from shared memory that is
//! out of range makes the operation fail with [`RingError::Corrupt`], never an
//! out-of-bounds slot access.

use crate::descriptor::TensorBlockDescriptor;
use crate::sync::{AtomicU32, AtomicU64, Ordering, SlotCell};
use crate::wait::{SpinThenPark, Tick, WaitCell};
use std::ptr::NonNull;
use std::sync::Arc;

/// Bytes of one slot.
pub const SLOT_LEN: usize = 64;
/// Bytes of the ring header.
pub const RING_HEADER_LEN: usize = 192;
/// The `closed` flag bit in line 2.
const FLAG_CLOSED: u32 = 1;

/// Cache line 0: written by the consumer only.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct ConsumerLine {
    /// Next slot the consumer reads (free-running). Written by the consumer.
    head: AtomicU64,
    /// The consumer parks on this cell when the ring is empty.
    pub wait: WaitCell,
}

/// Cache line 1: written by the producer only.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct ProducerLine {
    /// Next slot the producer writes (free-running). Written by the producer.
    tail: AtomicU64,
    /// The producer parks on this cell when the ring is full.
    pub wait: WaitCell,
}

/// Cache line 2: set at initialisation, read rarely.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct ConfigLine {
    /// Slots (power of two). Informational: each side uses its trusted copy.
    capacity: AtomicU32,
    /// Bit 0: closed.
    flags: AtomicU32,
}

/// The 192-byte ring header: three isolated cache lines.
#[repr(C)]
#[derive(Debug, Default)]
pub struct RingHeader {
    /// Line 0: consumer cursor and consumer state.
    pub consumer: ConsumerLine,
    /// Line 1: producer cursor and producer state.
    pub producer: ProducerLine,
    /// Line 2: capacity and flags.
    pub config: ConfigLine,
}

#[cfg(not(loom))]
const _: () = {
    assert!(core::mem::size_of::<RingHeader>() == RING_HEADER_LEN);
    assert!(core::mem::align_of::<RingHeader>() == 64);
    assert!(core::mem::offset_of!(RingHeader, consumer) == 0);
    assert!(core::mem::offset_of!(RingHeader, producer) == 64);
    assert!(core::mem::offset_of!(RingHeader, config) == 128);
    assert!(core::mem::size_of::<SlotCell<TensorBlockDescriptor>>() == SLOT_LEN);
};

impl RingHeader {
    /// (Re)initialises a header in place: cursors 0, cells running, not closed.
    /// Only the ring's owner (the daemon) does this, while no peer uses the ring.
    pub fn init(&self, capacity: u32) {
        self.consumer.head.store(0, Ordering::Relaxed);
        self.consumer.wait.reset();
        self.producer.tail.store(0, Ordering::Relaxed);
        self.producer.wait.reset();
        self.config.capacity.store(capacity, Ordering::Relaxed);
        // Release: pairs with the Acquire in `is_closed`, so a peer that sees the
        // ring open also sees the cursors reset.
        self.config.flags.store(0, Ordering::Release);
    }

    /// Marks the ring closed; both sides see it on their slow path.
    pub fn close(&self) {
        self.config.flags.fetch_or(FLAG_CLOSED, Ordering::Release);
    }

    /// Whether either side closed the ring.
    pub fn is_closed(&self) -> bool {
        // Acquire: pairs with the Release in `close`/`init`.
        self.config.flags.load(Ordering::Acquire) & FLAG_CLOSED != 0
    }

    /// Capacity as written in shared memory (untrusted, informational).
    pub fn capacity_in_shm(&self) -> u32 {
        self.config.capacity.load(Ordering::Relaxed)
    }
}

/// Bytes one ring of `capacity` slots takes (header + slots).
pub const fn ring_len(capacity: u32) -> usize {
    RING_HEADER_LEN + capacity as usize * SLOT_LEN
}

/// Why a ring operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The peer's cursor in shared memory is impossible (it jumped backwards or
    /// past capacity): the peer is corrupt or hostile. Stop using this ring.
    #[error("ring peer cursor is out of range (own cursor {own}, peer cursor {peer}, capacity {capacity}): the peer is corrupt; disconnect it")]
    Corrupt {
        /// This side's cursor.
        own: u64,
        /// The peer's cursor as read.
        peer: u64,
        /// Slots.
        capacity: u64,
    },
    /// The ring was closed.
    #[error("ring is closed")]
    Closed,
}

/// Where a ring lives and what keeps that memory alive.
#[derive(Clone)]
struct RingMem {
    header: NonNull<RingHeader>,
    slots: NonNull<SlotCell<TensorBlockDescriptor>>,
    capacity: u64,
    /// Keeps the mapping (or heap buffer) alive as long as a handle exists.
    _owner: Arc<dyn Send + Sync>,
}

impl std::fmt::Debug for RingMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMem").field("header", &self.header).field("capacity", &self.capacity).finish()
    }
}

impl RingMem {
    /// # Safety
    /// `header` points to an initialised `RingHeader` followed by `capacity`
    /// slots (or `slots` points to `capacity` slots), valid and suitably aligned
    /// for as long as `owner` lives; `capacity` is a power of two.
    unsafe fn new(
        header: NonNull<RingHeader>,
        slots: NonNull<SlotCell<TensorBlockDescriptor>>,
        capacity: u32,
        owner: Arc<dyn Send + Sync>,
    ) -> Self {
        debug_assert!(capacity.is_power_of_two());
        debug_assert_eq!(header.as_ptr() as usize % 64, 0);
        Self { header, slots, capacity: u64::from(capacity), _owner: owner }
    }

    #[inline(always)]
    fn header(&self) -> &RingHeader {
        // SAFETY: `new`'s contract: valid while `_owner` lives, which is as long as self.
        unsafe { self.header.as_ref() }
    }

    #[inline(always)]
    fn slot(&self, cursor: u64) -> &SlotCell<TensorBlockDescriptor> {
        let index = (cursor & (self.capacity - 1)) as usize;
        // SAFETY: index < capacity by the mask; the slot array has `capacity`
        // entries and lives as long as `_owner` (`new`'s contract).
        unsafe { &*self.slots.as_ptr().add(index) }
    }
}

/// The producing end. Not `Clone`: exactly one producer per ring.
#[derive(Debug)]
pub struct Producer {
    mem: RingMem,
    /// Our cursor; authoritative (the copy in shared memory is only published).
    tail: u64,
    /// Last seen consumer cursor. Can be stale (behind the real one), which only
    /// makes the ring look fuller than it is; refreshed when it looks full.
    /// Always `tail.wrapping_sub(cached_head)` in `0..=capacity`.
    cached_head: u64,
}

/// The consuming end. Not `Clone`: exactly one consumer per ring.
#[derive(Debug)]
pub struct Consumer {
    mem: RingMem,
    /// Our cursor; authoritative.
    head: u64,
    /// Last seen producer cursor. Can be stale (behind the real one), which only
    /// makes the ring look emptier than it is; refreshed when it looks empty.
    /// Always `cached_tail.wrapping_sub(head)` in `0..=capacity`.
    cached_tail: u64,
}

// SAFETY: a Producer/Consumer is the single owner of its side of the ring; the
// shared parts are atomics or slots whose ownership the cursors hand over, and
// the memory is kept alive by the `Send + Sync` owner.
unsafe impl Send for Producer {}
// SAFETY: as above.
unsafe impl Send for Consumer {}

/// Attaches both ends of a ring at `base`.
///
/// # Safety
/// `base` points to `ring_len(capacity)` bytes, 64-byte aligned, holding a
/// `RingHeader` initialised with [`RingHeader::init`], valid for as long as
/// `owner` lives; `capacity` is a non-zero power of two. At most one `Producer`
/// and one `Consumer` exist for a ring across all processes (the peer process
/// is allowed to misbehave: that is detected, not undefined).
pub unsafe fn attach(base: NonNull<u8>, capacity: u32, owner: Arc<dyn Send + Sync>) -> (Producer, Consumer) {
    // SAFETY: forwarded contract.
    let mem = unsafe { ring_mem(base, capacity, owner) };
    let head = mem.header().consumer.head.load(Ordering::Acquire);
    let tail = mem.header().producer.tail.load(Ordering::Acquire);
    // The cursors come from shared memory and may be corrupt. A producer that
    // finds them inconsistent starts with a cached head that makes the ring look
    // full, so its first operation re-reads `head` and reports
    // `RingError::Corrupt` (and no `tail - cached_head` underflows).
    let consistent = head <= tail && tail - head <= mem.capacity;
    let cached_head = if consistent { head } else { tail.wrapping_sub(mem.capacity) };
    (Producer { mem: mem.clone(), tail, cached_head }, Consumer { mem, head, cached_tail: head })
}

/// Attaches the producing end of a ring at `base`.
///
/// # Safety
/// As [`attach`]; this process is the ring's only producer.
pub unsafe fn producer(base: NonNull<u8>, capacity: u32, owner: Arc<dyn Send + Sync>) -> Producer {
    // SAFETY: forwarded contract.
    let (p, _) = unsafe { attach(base, capacity, owner) };
    p
}

/// Attaches the consuming end of a ring at `base`.
///
/// # Safety
/// As [`attach`]; this process is the ring's only consumer.
pub unsafe fn consumer(base: NonNull<u8>, capacity: u32, owner: Arc<dyn Send + Sync>) -> Consumer {
    // SAFETY: forwarded contract.
    let (_, c) = unsafe { attach(base, capacity, owner) };
    c
}

/// # Safety
/// As [`attach`].
unsafe fn ring_mem(base: NonNull<u8>, capacity: u32, owner: Arc<dyn Send + Sync>) -> RingMem {
    assert!(capacity.is_power_of_two(), "ring capacity must be a power of two");
    let header = base.cast::<RingHeader>();
    // SAFETY: the slots start RING_HEADER_LEN bytes after the header, inside the
    // `ring_len(capacity)` bytes the caller vouches for.
    let slots = unsafe { base.add(RING_HEADER_LEN) }.cast::<SlotCell<TensorBlockDescriptor>>();
    // SAFETY: forwarded contract.
    unsafe { RingMem::new(header, slots, capacity, owner) }
}

impl Producer {
    /// Slots.
    pub fn capacity(&self) -> usize {
        self.mem.capacity as usize
    }

    /// The ring header (for wait cells and flags).
    pub fn header(&self) -> &RingHeader {
        self.mem.header()
    }

    /// Frames in the ring as far as this side knows (`0..=capacity`). Cursors
    /// are free-running and never wrap in practice (2^64 frames); the wrapping
    /// arithmetic only keeps hostile cursor values from panicking debug builds.
    #[inline(always)]
    fn queued(&self) -> u64 {
        self.tail.wrapping_sub(self.cached_head)
    }

    /// Re-reads the consumer cursor and validates it.
    #[inline]
    fn refresh_head(&mut self) -> Result<(), RingError> {
        // SYNC POINT: Acquire pairs with the consumer's Release store of `head`:
        // every slot before it has been read, so we may overwrite it.
        let head = self.mem.header().consumer.head.load(Ordering::Acquire);
        if head > self.tail || self.tail - head > self.mem.capacity {
            return Err(RingError::Corrupt { own: self.tail, peer: head, capacity: self.mem.capacity });
        }
        self.cached_head = head;
        Ok(())
    }

    /// Free slots as far as this side knows, refreshing the consumer cursor
    /// only if the cached copy says the ring is full.
    #[inline]
    pub fn free_slots(&mut self) -> Result<usize, RingError> {
        if self.queued() == self.mem.capacity {
            self.refresh_head()?;
        }
        Ok((self.mem.capacity - self.queued()) as usize)
    }

    /// Free slots, refreshing the consumer cursor first if the cached copy
    /// says fewer than `want` are free (as [`push_batch`](Self::push_batch)
    /// does): for a producer that pushes only whole groups of frames.
    #[inline]
    pub fn free_slots_for(&mut self, want: usize) -> Result<usize, RingError> {
        if ((self.mem.capacity - self.queued()) as usize) < want {
            self.refresh_head()?;
        }
        Ok((self.mem.capacity - self.queued()) as usize)
    }

    /// Pushes one frame and publishes it. `Ok(false)` if the ring is full.
    #[inline]
    pub fn try_push(&mut self, frame: &TensorBlockDescriptor) -> Result<bool, RingError> {
        if self.queued() == self.mem.capacity {
            self.refresh_head()?;
            if self.queued() == self.mem.capacity {
                return if self.mem.header().is_closed() { Err(RingError::Closed) } else { Ok(false) };
            }
        }
        // SAFETY: slot `tail` is ours: tail - head < capacity, so the consumer is
        // done with it (it published head past it) and will not read it until we
        // publish tail past it.
        unsafe { self.mem.slot(self.tail).write(*frame) };
        self.tail = self.tail.wrapping_add(1);
        // SYNC POINT: Release pairs with the consumer's Acquire load of `tail`: the
        // slot write above is visible before the cursor that hands it over.
        self.mem.header().producer.tail.store(self.tail, Ordering::Release);
        Ok(true)
    }

    /// Pushes as many of `frames` as fit, publishing the cursor once. Returns
    /// how many were pushed (0 if full).
    #[inline]
    pub fn push_batch(&mut self, frames: &[TensorBlockDescriptor]) -> Result<usize, RingError> {
        let mut free = self.mem.capacity - self.queued();
        if (free as usize) < frames.len() {
            self.refresh_head()?;
            free = self.mem.capacity - self.queued();
        }
        let n = frames.len().min(free as usize);
        if n == 0 {
            return if self.mem.header().is_closed() { Err(RingError::Closed) } else { Ok(0) };
        }
        for (i, frame) in frames[..n].iter().enumerate() {
            // SAFETY: slots tail..tail+n are ours (n <= free), as in `try_push`.
            unsafe { self.mem.slot(self.tail.wrapping_add(i as u64)).write(*frame) };
        }
        self.tail = self.tail.wrapping_add(n as u64);
        // SYNC POINT: Release pairs with the consumer's Acquire load of `tail`.
        self.mem.header().producer.tail.store(self.tail, Ordering::Release);
        Ok(n)
    }

    /// Wakes the consumer if it parked on its own line-0 cell.
    #[inline]
    pub fn notify_consumer(&self) -> bool {
        self.mem.header().consumer.wait.notify()
    }

    /// Whether the consumer has taken every frame published so far
    /// (reads the consumer's cursor).
    pub fn is_drained(&self) -> bool {
        // Acquire: pairs with the consumer's Release store of head.
        self.mem.header().consumer.head.load(Ordering::Acquire) == self.tail
    }
}

impl Consumer {
    /// Slots.
    pub fn capacity(&self) -> usize {
        self.mem.capacity as usize
    }

    /// The ring header (for wait cells and flags).
    pub fn header(&self) -> &RingHeader {
        self.mem.header()
    }

    /// Frames ready as far as this side knows (`0..=capacity`); see
    /// `Producer::queued` on the wrapping arithmetic.
    #[inline(always)]
    fn ready(&self) -> u64 {
        self.cached_tail.wrapping_sub(self.head)
    }

    #[inline]
    fn refresh_tail(&mut self) -> Result<(), RingError> {
        // SYNC POINT: Acquire pairs with the producer's Release store of `tail`:
        // the slots before it are written and visible.
        let tail = self.mem.header().producer.tail.load(Ordering::Acquire);
        if tail < self.head || tail - self.head > self.mem.capacity {
            return Err(RingError::Corrupt { own: self.head, peer: tail, capacity: self.mem.capacity });
        }
        self.cached_tail = tail;
        Ok(())
    }

    /// Frames available, refreshing the producer cursor only if the cached copy
    /// says the ring is empty.
    #[inline]
    pub fn available(&mut self) -> Result<usize, RingError> {
        if self.cached_tail == self.head {
            self.refresh_tail()?;
        }
        Ok(self.ready() as usize)
    }

    /// Re-reads the producer cursor and checks it (for a consumer that is not
    /// popping for a while but must still notice a corrupt peer); frames
    /// available.
    pub fn check(&mut self) -> Result<usize, RingError> {
        self.refresh_tail()?;
        Ok(self.ready() as usize)
    }

    /// Whether a frame is ready (refreshes the producer cursor).
    pub fn has_data(&mut self) -> bool {
        !matches!(self.available(), Ok(0))
    }

    /// Pops one frame. `Ok(None)` if the ring is empty.
    #[inline]
    pub fn try_pop(&mut self) -> Result<Option<TensorBlockDescriptor>, RingError> {
        if self.cached_tail == self.head {
            self.refresh_tail()?;
            if self.cached_tail == self.head {
                return if self.mem.header().is_closed() { Err(RingError::Closed) } else { Ok(None) };
            }
        }
        // SAFETY: slot `head` is ours: head < tail, the producer published it and
        // will not rewrite it until we publish head past it.
        let frame = unsafe { self.mem.slot(self.head).read() };
        self.head = self.head.wrapping_add(1);
        // SYNC POINT: Release pairs with the producer's Acquire load of `head`: our
        // read of the slot happens before the producer may reuse it.
        self.mem.header().consumer.head.store(self.head, Ordering::Release);
        Ok(Some(frame))
    }

    /// Pops up to `out.len()` frames, publishing the cursor once. Returns how
    /// many were popped (0 if empty).
    #[inline]
    pub fn pop_batch(&mut self, out: &mut [TensorBlockDescriptor]) -> Result<usize, RingError> {
        let mut avail = self.ready();
        if (avail as usize) < out.len() {
            self.refresh_tail()?;
            avail = self.ready();
        }
        let n = out.len().min(avail as usize);
        if n == 0 {
            return if self.mem.header().is_closed() { Err(RingError::Closed) } else { Ok(0) };
        }
        for (i, o) in out[..n].iter_mut().enumerate() {
            // SAFETY: slots head..head+n are ours (n <= avail), as in `try_pop`.
            *o = unsafe { self.mem.slot(self.head.wrapping_add(i as u64)).read() };
        }
        self.head = self.head.wrapping_add(n as u64);
        // SYNC POINT: Release pairs with the producer's Acquire load of `head`.
        self.mem.header().consumer.head.store(self.head, Ordering::Release);
        Ok(n)
    }

    /// This side's wait cell (line 0), on which it parks when empty.
    pub fn wait_cell(&self) -> &WaitCell {
        &self.mem.header().consumer.wait
    }

    /// Waits with `policy` on this side's wait cell (line 0) until `poll`,
    /// which gets this consumer, returns `Some`; `tick` runs after each park
    /// and may stop the wait (see [`SpinThenPark::wait`]).
    ///
    /// [`Consumer::wait_cell`] borrows the consumer, so it cannot be passed to
    /// [`SpinThenPark::wait`] together with a `poll` that pops from the same
    /// consumer; this method does both. The producer must call
    /// [`Producer::notify_consumer`] after publishing.
    ///
    /// ```
    /// use kachedb_shm::{HeapRing, SpinThenPark, TensorBlockDescriptor, Tick};
    /// let (mut p, mut c) = HeapRing::with_capacity(4);
    /// p.try_push(&TensorBlockDescriptor::default()).unwrap();
    /// p.notify_consumer();
    /// let got = c.wait_with(&SpinThenPark::default(), |c| c.try_pop().transpose(), || Tick::<()>::Continue);
    /// assert!(matches!(got, Ok(Ok(_))));
    /// ```
    pub fn wait_with<T, E>(
        &mut self,
        policy: &SpinThenPark,
        mut poll: impl FnMut(&mut Self) -> Option<T>,
        tick: impl FnMut() -> Tick<E>,
    ) -> Result<T, E> {
        let header = self.mem.header;
        // SAFETY: `header` points to the ring header, valid for as long as
        // `self.mem._owner` lives (`RingMem::new`'s contract); `self` is
        // borrowed for this whole call, so it outlives the reference. The cell
        // is atomics only, so the shared reference may coexist with `poll`'s
        // `&mut self` (which never touches the header through a `&mut`).
        let cell = unsafe { &(*header.as_ptr()).consumer.wait };
        policy.wait(cell, || poll(self), tick)
    }
}

/// A ring over heap memory in this process (tests, Miri, loom).
pub struct HeapRing {
    header: Box<RingHeader>,
    slots: Box<[SlotCell<TensorBlockDescriptor>]>,
}

impl std::fmt::Debug for HeapRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapRing").field("capacity", &self.slots.len()).finish()
    }
}

// SAFETY: the header is atomics; slots are handed between the one producer and
// the one consumer by the cursors' Release/Acquire pairs.
unsafe impl Sync for HeapRing {}
// SAFETY: as above; the boxes own plain memory.
unsafe impl Send for HeapRing {}

impl HeapRing {
    /// Both ends of a new heap ring of `capacity` slots (a power of two).
    pub fn with_capacity(capacity: u32) -> (Producer, Consumer) {
        assert!(capacity.is_power_of_two(), "ring capacity must be a power of two");
        let header = Box::new(RingHeader::default());
        header.init(capacity);
        let slots: Box<[SlotCell<TensorBlockDescriptor>]> =
            (0..capacity).map(|_| SlotCell::new(TensorBlockDescriptor::default())).collect();
        let ring = Arc::new(HeapRing { header, slots });
        let header = NonNull::from(&*ring.header);
        let slots = NonNull::new(ring.slots.as_ptr() as *mut SlotCell<TensorBlockDescriptor>)
            .expect("boxed slice pointer is non-null");
        // SAFETY: header and slots are owned by `ring`, which both ends keep alive;
        // the header was initialised above; capacity is a power of two.
        let mem = unsafe { RingMem::new(header, slots, capacity, ring) };
        (Producer { mem: mem.clone(), tail: 0, cached_head: 0 }, Consumer { mem, head: 0, cached_tail: 0 })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn frame(i: u64) -> TensorBlockDescriptor {
        let mut d = TensorBlockDescriptor::request(crate::Op::Ping, i as u32, u128::from(i) * 3);
        d.offset = i;
        d
    }

    #[test]
    fn fifo_across_wraparound() {
        let (mut p, mut c) = HeapRing::with_capacity(4);
        let mut next_in = 0u64;
        let mut next_out = 0u64;
        for round in 0..50 {
            let k = round % 5;
            for _ in 0..k {
                if p.try_push(&frame(next_in)).unwrap() {
                    next_in += 1;
                }
            }
            while let Some(f) = c.try_pop().unwrap() {
                assert_eq!(f, frame(next_out));
                next_out += 1;
            }
        }
        assert_eq!(next_in, next_out);
        assert!(next_in > 50);
    }

    #[test]
    fn full_and_empty() {
        let (mut p, mut c) = HeapRing::with_capacity(2);
        assert_eq!(c.try_pop().unwrap(), None);
        assert!(p.try_push(&frame(1)).unwrap());
        assert!(p.try_push(&frame(2)).unwrap());
        assert!(!p.try_push(&frame(3)).unwrap());
        assert_eq!(p.free_slots().unwrap(), 0);
        assert_eq!(c.try_pop().unwrap(), Some(frame(1)));
        assert_eq!(p.free_slots().unwrap(), 1);
    }

    #[test]
    fn batches_publish_partial_when_short_of_space() {
        let (mut p, mut c) = HeapRing::with_capacity(8);
        let frames: Vec<_> = (0..12).map(frame).collect();
        assert_eq!(p.push_batch(&frames).unwrap(), 8);
        let mut out = [TensorBlockDescriptor::default(); 5];
        assert_eq!(c.pop_batch(&mut out).unwrap(), 5);
        assert_eq!(out.to_vec(), frames[..5].to_vec());
        assert_eq!(p.push_batch(&frames[8..]).unwrap(), 4);
        let mut out = [TensorBlockDescriptor::default(); 16];
        assert_eq!(c.pop_batch(&mut out).unwrap(), 7);
        assert_eq!(out[..7].to_vec(), frames[5..].to_vec());
    }

    #[test]
    fn corrupt_peer_cursor_is_detected() {
        let (mut p, mut c) = HeapRing::with_capacity(4);
        // A hostile producer publishes a tail far past capacity.
        p.mem.header().producer.tail.store(1000, Ordering::Release);
        assert!(matches!(c.try_pop(), Err(RingError::Corrupt { peer: 1000, .. })));
        // A hostile consumer moves head backwards below... past our tail.
        p.mem.header().consumer.head.store(7, Ordering::Release);
        for _ in 0..4 {
            let _ = p.try_push(&frame(0));
        }
        assert!(matches!(p.try_push(&frame(0)), Err(RingError::Corrupt { .. })));
    }

    #[test]
    fn closed_ring_reports_closed_when_empty() {
        let (mut p, mut c) = HeapRing::with_capacity(4);
        assert!(p.try_push(&frame(1)).unwrap());
        p.header().close();
        assert_eq!(c.try_pop().unwrap(), Some(frame(1)));
        assert_eq!(c.try_pop(), Err(RingError::Closed));
    }

    #[test]
    fn threads_move_a_million_frames_in_order() {
        let (mut p, mut c) = HeapRing::with_capacity(64);
        let n = if cfg!(miri) { 2_000 } else { 1_000_000u64 };
        let t = std::thread::spawn(move || {
            let mut i = 0;
            let mut batch = Vec::with_capacity(16);
            while i < n {
                batch.clear();
                batch.extend((i..(i + 16).min(n)).map(frame));
                let pushed = p.push_batch(&batch).unwrap();
                i += pushed as u64;
                if pushed == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let mut expect = 0;
        let mut out = [TensorBlockDescriptor::default(); 32];
        while expect < n {
            let k = c.pop_batch(&mut out).unwrap();
            for f in &out[..k] {
                assert_eq!(*f, frame(expect));
                expect += 1;
            }
            if k == 0 {
                std::thread::yield_now();
            }
        }
        t.join().unwrap();
    }
}
