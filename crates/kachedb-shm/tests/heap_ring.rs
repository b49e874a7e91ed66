//! The ring over heap memory, between threads: order and content across
//! wrap-around, batches, parking, corrupt peers, and the raw `ring::attach`
//! path. Everything here also runs under Miri (sizes shrink under `cfg(miri)`):
//!
//! ```text
//! cargo +nightly miri test -p kachedb-shm --test heap_ring
//! ```
#![cfg(not(loom))]

use kachedb_shm::ring::{self, RingHeader, RING_HEADER_LEN, SLOT_LEN};
use kachedb_shm::{HeapRing, Op, RingError, SpinThenPark, TensorBlockDescriptor, Tick};
use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn frame(i: u64) -> TensorBlockDescriptor {
    let mut d =
        TensorBlockDescriptor::request(Op::Get, i as u32, u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15) << 3);
    d.handle = !i;
    d.offset = i.rotate_left(17);
    d.ndim = (i % 7) as u8;
    d.shape = [i as u32, (i >> 32) as u32, 1, 2, 3, 4];
    d
}

const N: u64 = if cfg!(miri) { 600 } else { 300_000 };

/// Per-message pushes against batch pops of an odd size, capacity 8.
#[test]
fn single_pushes_batch_pops() {
    let (mut p, mut c) = HeapRing::with_capacity(8);
    let t = std::thread::spawn(move || {
        let mut i = 0;
        while i < N {
            if p.try_push(&frame(i)).unwrap() {
                i += 1;
            } else {
                std::thread::yield_now();
            }
        }
    });
    let mut next = 0;
    let mut out = [TensorBlockDescriptor::default(); 5];
    while next < N {
        let k = c.pop_batch(&mut out).unwrap();
        for f in &out[..k] {
            assert_eq!(*f, frame(next));
            next += 1;
        }
        if k == 0 {
            std::thread::yield_now();
        }
    }
    t.join().unwrap();
}

/// Batches of every size from 1 to 13 (some larger than the ring) against
/// single pops, capacity 4.
#[test]
fn batch_pushes_single_pops() {
    let (mut p, mut c) = HeapRing::with_capacity(4);
    let t = std::thread::spawn(move || {
        let mut i = 0;
        let mut size = 1;
        while i < N {
            let batch: Vec<_> = (i..(i + size).min(N)).map(frame).collect();
            let k = p.push_batch(&batch).unwrap();
            i += k as u64;
            size = size % 13 + 1;
            if k == 0 {
                std::thread::yield_now();
            }
        }
    });
    let mut next = 0;
    while next < N {
        match c.try_pop().unwrap() {
            Some(f) => {
                assert_eq!(f, frame(next));
                next += 1;
            }
            None => std::thread::yield_now(),
        }
    }
    t.join().unwrap();
}

/// The consumer parks after one empty poll and is woken by `notify_consumer`
/// for every frame (the timeout is long, so a lost wake-up hangs the test).
#[test]
fn parked_consumer_is_woken_for_every_frame() {
    let n = if cfg!(miri) { 20 } else { 2_000 };
    let (mut p, mut c) = HeapRing::with_capacity(2);
    let t = std::thread::spawn(move || {
        for i in 0..n {
            while !p.try_push(&frame(i)).unwrap() {
                std::thread::yield_now();
            }
            p.notify_consumer();
            if i & 7 == 0 {
                std::thread::yield_now();
            }
        }
    });
    let policy = SpinThenPark { park_timeout: Duration::from_secs(60), ..SpinThenPark::park_immediately() };
    for i in 0..n {
        let f = c.wait_with(&policy, |c| c.try_pop().transpose(), || Tick::<()>::Continue).unwrap().unwrap();
        assert_eq!(f, frame(i));
    }
    t.join().unwrap();
    assert!(!c.wait_cell().is_parked());
}

/// `tick` stops a wait on a ring nobody produces into.
#[test]
fn wait_with_stops_on_tick() {
    let (_p, mut c) = HeapRing::with_capacity(2);
    let policy = SpinThenPark { park_timeout: Duration::from_millis(1), ..SpinThenPark::park_immediately() };
    let mut ticks = 0;
    let r = c.wait_with(
        &policy,
        |c| c.try_pop().transpose(),
        || {
            ticks += 1;
            if ticks == 2 {
                Tick::Stop("peer gone")
            } else {
                Tick::Continue
            }
        },
    );
    assert_eq!(r, Err("peer gone"));
}

/// Either end may be dropped first; the memory lives until both are gone.
#[test]
fn ends_outlive_each_other() {
    let (mut p, mut c) = HeapRing::with_capacity(4);
    assert!(p.try_push(&frame(1)).unwrap());
    drop(p);
    assert_eq!(c.try_pop().unwrap(), Some(frame(1)));
    assert_eq!(c.try_pop().unwrap(), None);
    let (mut p, c) = HeapRing::with_capacity(4);
    drop(c);
    assert!(p.try_push(&frame(2)).unwrap());
}

/// Ring memory laid out as in a region: header then slots, 64-byte aligned.
/// The slots are written through shared pointers, hence the `UnsafeCell`.
#[repr(C, align(64))]
struct RawRing {
    header: RingHeader,
    slots: UnsafeCell<[[u64; SLOT_LEN / 8]; 4]>,
}

// SAFETY: the header is atomics; the slots are only accessed by the ring's one
// producer and one consumer, whose cursors' Release/Acquire pairs order them.
unsafe impl Sync for RawRing {}

fn raw_ring() -> (Arc<RawRing>, NonNull<u8>) {
    assert_eq!(std::mem::size_of::<RawRing>(), RING_HEADER_LEN + 4 * SLOT_LEN);
    let mem = Arc::new(RawRing { header: RingHeader::default(), slots: UnsafeCell::new([[0; 8]; 4]) });
    mem.header.init(4);
    let base = NonNull::from(&*mem).cast::<u8>();
    (mem, base)
}

/// `ring::attach` over memory the caller owns, as `Region` does.
#[test]
fn attach_over_raw_memory() {
    let (mem, base) = raw_ring();
    // SAFETY: `base` points to a 64-byte aligned header initialised for 4 slots,
    // followed by 4 slots, kept alive by the `owner` Arc; one producer and one
    // consumer are created.
    let (mut p, mut c) = unsafe { ring::attach(base, 4, mem) };
    for i in 0..10 {
        assert!(p.try_push(&frame(i)).unwrap());
        assert_eq!(c.try_pop().unwrap(), Some(frame(i)));
    }
    assert_eq!(p.capacity(), 4);
    assert_eq!(c.header().capacity_in_shm(), 4);
}

/// A hostile peer's write of the cursors in shared memory: `head` at offset 0
/// (line 0), `tail` at offset 64 (line 1), as in `docs/PROTOCOL.md`.
fn forge_cursors(mem: &RawRing, head: u64, tail: u64) {
    let base = (&mem.header as *const RingHeader).cast::<u8>();
    // SAFETY: offsets 0 and 64 of a `RingHeader` hold the consumer and producer
    // cursors, 8-byte aligned `AtomicU64`s (the layout `kachedb_shm::ring`
    // asserts at compile time); `mem` keeps them alive, and they are only ever
    // accessed atomically.
    let (h, t) = unsafe { (&*base.cast::<AtomicU64>(), &*base.add(64).cast::<AtomicU64>()) };
    h.store(head, Ordering::Release);
    t.store(tail, Ordering::Release);
}

/// Cursors that a hostile peer left inconsistent before we attached are
/// reported as `Corrupt`: never a panic (this runs in debug builds, where an
/// underflowing `tail - head` would panic), never an out-of-bounds slot.
#[test]
fn corrupt_cursors_at_attach_are_reported_not_panicked() {
    // head ahead of tail; tail more than a ring ahead of head.
    for (head, tail) in [(5, 2), (0, 100), (u64::MAX, 0)] {
        let (mem, base) = raw_ring();
        forge_cursors(&mem, head, tail);
        // SAFETY: as in `attach_over_raw_memory` (only the cursor values are
        // hostile, which `attach` must tolerate).
        let (mut p, mut c) = unsafe { ring::attach(base, 4, mem.clone()) };
        assert!(matches!(c.try_pop(), Err(RingError::Corrupt { .. })), "head {head} tail {tail}");
        let mut out = [TensorBlockDescriptor::default(); 2];
        assert!(matches!(c.pop_batch(&mut out), Err(RingError::Corrupt { .. })));
        // The producer may fill what it believes is free, then must see it.
        let mut pushed = 0u64;
        let err = loop {
            match p.try_push(&frame(pushed)) {
                Ok(true) => pushed += 1,
                Ok(false) => panic!("a corrupt ring must not look merely full (head {head} tail {tail})"),
                Err(e) => break e,
            }
            assert!(pushed <= 4, "the producer must detect corruption within one ring");
        };
        assert!(matches!(err, RingError::Corrupt { .. }), "{err:?}");
        assert!(matches!(p.push_batch(&[frame(0)]), Err(RingError::Corrupt { .. })));
    }
}

/// A hostile peer that writes the slots while the consumer copies them out
/// (issue 12, item 13): the slot copies are atomic word copies, so the
/// consumer gets some mix of words — garbage it validates — and the program
/// stays defined (under Miri, a plain slot copy racing these writes is
/// reported as a data race). Here the scribbler rewrites every slot word with
/// atomic stores while frames go through; every frame popped is either the
/// one pushed or has scribbled words in it, and nothing panics.
#[test]
fn slots_scribbled_while_popping_give_garbage_not_undefined_behaviour() {
    const SCRIBBLE: u64 = 0x5c5c_5c5c_5c5c_5c5c;
    let n: u64 = if cfg!(miri) { 200 } else { 100_000 };
    let (mem, base) = raw_ring();
    // SAFETY: as in `attach_over_raw_memory`.
    let (mut p, mut c) = unsafe { ring::attach(base, 4, mem.clone()) };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scribbler = {
        let (mem, stop) = (mem.clone(), stop.clone());
        std::thread::spawn(move || {
            let words = mem.slots.get().cast::<AtomicU64>();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: the slots are 4 × 8 aligned u64 words owned by `mem`;
                // the ring only ever accesses them as `AtomicU64`s, so these
                // concurrent atomic stores are a (hostile) peer's, not a data race.
                unsafe { (*words.add(i % 32)).store(SCRIBBLE, Ordering::Relaxed) };
                i = i.wrapping_add(7);
                if cfg!(miri) {
                    std::thread::yield_now();
                }
            }
        })
    };
    let producer = std::thread::spawn(move || {
        for i in 0..n {
            while !p.try_push(&frame(i)).unwrap() {
                std::hint::spin_loop();
            }
        }
    });
    let (mut whole, mut scribbled) = (0u64, 0u64);
    while whole + scribbled < n {
        if let Some(f) = c.try_pop().unwrap() {
            let words: [u64; 8] = bytemuck::cast(f);
            if f == frame(whole + scribbled) {
                whole += 1;
            } else {
                assert!(words.contains(&SCRIBBLE), "a frame neither pushed nor scribbled: {words:x?}");
                scribbled += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    producer.join().unwrap();
    scribbler.join().unwrap();
    assert_eq!(whole + scribbled, n);
}
