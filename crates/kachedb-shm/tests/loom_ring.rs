//! Loom model of the SPSC ring and of the wait cell's park/notify protocol.
//!
//! Loom runs each closure under every interleaving (and every store a relaxed
//! or acquire load may read) that the C11 memory model allows, and reports a
//! data race on a ring slot if the cursors' Release/Acquire pairs did not
//! order the producer's write before the consumer's read (the slots are
//! `loom::cell::UnsafeCell`s under `cfg(loom)`, see `kachedb_shm::sync`).
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p kachedb-shm --release --test loom_ring
//! ```
//!
//! Spin loops yield through `loom::thread::yield_now`, which loom needs to
//! schedule the other thread. A lost wake-up shows up as a waiter that spins
//! forever (loom's futex stand-in yields while the word reads PARKED), which
//! loom reports by exceeding its branch limit.
#![cfg(loom)]

use kachedb_shm::{Consumer, HeapRing, Op, Producer, SpinThenPark, TensorBlockDescriptor, Tick, WaitCell};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use std::time::Duration;

/// A frame whose every field depends on `i`, so a torn or stale slot read is
/// caught by the equality check.
fn frame(i: u64) -> TensorBlockDescriptor {
    let mut d =
        TensorBlockDescriptor::request(Op::Get, i as u32, u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    d.handle = !i;
    d.offset = i << 6;
    d.shape[0] = i as u32 ^ 0xa5a5;
    d
}

/// A bounded model: at most `preemptions` forced thread switches per
/// execution (3: the whole file runs in ~3 s on the 2-core dev machine;
/// `LOOM_MAX_PREEMPTIONS=4` explores more in ~13 s and overrides this).
fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(preemptions);
    }
    b.check(f);
}

fn push_all(p: &mut Producer, n: u64) {
    let mut i = 0;
    while i < n {
        if p.try_push(&frame(i)).unwrap() {
            i += 1;
        } else {
            thread::yield_now();
        }
    }
}

fn pop_all(c: &mut Consumer, n: u64) {
    let mut next = 0;
    while next < n {
        match c.try_pop().unwrap() {
            Some(f) => {
                assert_eq!(f, frame(next), "frame {next} out of order or torn");
                next += 1;
            }
            None => thread::yield_now(),
        }
    }
}

/// Capacity 2, three frames one at a time: the producer fills the ring, waits
/// on a full ring (refreshing the consumer cursor) and wraps around.
#[test]
fn per_message_capacity_2_wraps() {
    model(3, || {
        let (mut p, mut c) = HeapRing::with_capacity(2);
        let t = thread::spawn(move || push_all(&mut p, 3));
        pop_all(&mut c, 3);
        t.join().unwrap();
    });
}

/// Capacity 4, five frames one at a time (wraps once).
#[test]
fn per_message_capacity_4_wraps() {
    model(3, || {
        let (mut p, mut c) = HeapRing::with_capacity(4);
        let t = thread::spawn(move || push_all(&mut p, 5));
        pop_all(&mut c, 5);
        t.join().unwrap();
    });
}

/// Capacity 4: the producer pushes batches of 3 (the second batch can only be
/// published in part, and wraps), the consumer pops batches of 2.
#[test]
fn batches_capacity_4_partial_and_wrapping() {
    model(3, || {
        const N: u64 = 6;
        let (mut p, mut c) = HeapRing::with_capacity(4);
        let t = thread::spawn(move || {
            let mut i = 0;
            while i < N {
                let batch: Vec<_> = (i..(i + 3).min(N)).map(frame).collect();
                let k = p.push_batch(&batch).unwrap();
                assert!(k <= batch.len());
                i += k as u64;
                if k == 0 {
                    thread::yield_now();
                }
            }
        });
        let mut next = 0;
        let mut out = [TensorBlockDescriptor::default(); 2];
        while next < N {
            let k = c.pop_batch(&mut out).unwrap();
            for f in &out[..k] {
                assert_eq!(*f, frame(next));
                next += 1;
            }
            if k == 0 {
                thread::yield_now();
            }
        }
        t.join().unwrap();
    });
}

/// Capacity 2: batches larger than the ring on both sides, mixed with single
/// pushes and pops, and `free_slots` / `available` in between.
#[test]
fn mixed_single_and_batch_capacity_2() {
    model(3, || {
        const N: u64 = 4;
        let (mut p, mut c) = HeapRing::with_capacity(2);
        let t = thread::spawn(move || {
            let mut i = 0;
            while i < N {
                assert!(p.free_slots().unwrap() <= 2);
                let k = if i & 1 == 0 {
                    let batch: Vec<_> = (i..N).map(frame).collect();
                    p.push_batch(&batch).unwrap() as u64
                } else {
                    u64::from(p.try_push(&frame(i)).unwrap())
                };
                i += k;
                if k == 0 {
                    thread::yield_now();
                }
            }
        });
        let mut next = 0;
        let mut out = [TensorBlockDescriptor::default(); 3];
        while next < N {
            assert!(c.available().unwrap() <= 2);
            if next & 1 == 0 {
                let k = c.pop_batch(&mut out).unwrap();
                for f in &out[..k] {
                    assert_eq!(*f, frame(next));
                    next += 1;
                }
                if k == 0 {
                    thread::yield_now();
                }
            } else {
                match c.try_pop().unwrap() {
                    Some(f) => {
                        assert_eq!(f, frame(next));
                        next += 1;
                    }
                    None => thread::yield_now(),
                }
            }
        }
        t.join().unwrap();
    });
}

/// The bare wait-cell protocol: the waiter parks until a flag is set; the
/// notifier sets it (Release) then notifies. No interleaving may leave the
/// waiter asleep (a lost wake-up spins forever in loom's futex stand-in).
#[test]
fn wait_cell_no_lost_wakeup() {
    model(3, || {
        let cell = Arc::new(WaitCell::new());
        let flag = Arc::new(AtomicBool::new(false));
        let (cell2, flag2) = (cell.clone(), flag.clone());
        let waiter = thread::spawn(move || {
            while !flag2.load(Ordering::Acquire) {
                // Loom ignores the timeout: only a notify ends the park.
                cell2.park(|| flag2.load(Ordering::Acquire), Duration::from_secs(3600));
            }
        });
        flag.store(true, Ordering::Release);
        cell.notify();
        waiter.join().unwrap();
        assert!(!cell.is_parked());
    });
}

/// The ring's consumer waits with `SpinThenPark::park_immediately` on its own
/// line-0 cell (`Consumer::wait_with`); the producer pushes and notifies, twice,
/// so the consumer parks again after the first frame.
#[test]
fn ring_consumer_parks_and_is_woken() {
    model(3, || {
        let (mut p, mut c) = HeapRing::with_capacity(2);
        let t = thread::spawn(move || {
            for i in 0..2 {
                while !p.try_push(&frame(i)).unwrap() {
                    thread::yield_now();
                }
                p.notify_consumer();
            }
        });
        let policy = SpinThenPark { park_timeout: Duration::from_secs(3600), ..SpinThenPark::park_immediately() };
        for i in 0..2 {
            let f = c.wait_with(&policy, |c| c.try_pop().unwrap(), || Tick::<()>::Continue).unwrap();
            assert_eq!(f, frame(i));
        }
        t.join().unwrap();
        assert!(!c.wait_cell().is_parked());
    });
}

/// Control: the same protocol without the notifier's SeqCst fence (a plain
/// relaxed load of the state after the Release publish) loses wake-ups, and
/// loom finds the interleaving. This proves the model above can fail.
#[test]
#[should_panic(expected = "Model exceeded maximum number of branches")]
fn control_notify_without_fence_loses_a_wakeup() {
    use loom::sync::atomic::{fence, AtomicU32};
    const PARKED: u32 = 1;
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.max_branches = 10_000;
    b.check(|| {
        let state = Arc::new(AtomicU32::new(0));
        let flag = Arc::new(AtomicBool::new(false));
        let (state2, flag2) = (state.clone(), flag.clone());
        let waiter = thread::spawn(move || {
            state2.store(PARKED, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if !flag2.load(Ordering::Relaxed) {
                // futex_wait stand-in: sleep while the word reads PARKED.
                while state2.load(Ordering::Relaxed) == PARKED {
                    thread::yield_now();
                }
            }
        });
        flag.store(true, Ordering::Release);
        // BUG (deliberate): no fence(SeqCst) here, so this load may read the
        // state from before the waiter's PARKED store while the waiter's flag
        // load also reads the old value.
        if state.load(Ordering::Relaxed) == PARKED {
            state.store(0, Ordering::Relaxed);
        }
        waiter.join().unwrap();
    });
}
