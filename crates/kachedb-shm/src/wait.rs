//! The cross-process spin-then-park wait cell.
//!
//! A [`WaitCell`] is one `u32` futex word in shared memory owned by the side that
//! waits (the consumer of a ring, or the daemon's doorbell). The waiter spins for
//! fast hand-offs, then announces `PARKED` and sleeps on the futex; the other side
//! calls [`WaitCell::notify`] after publishing and makes the wake syscall only when
//! it sees `PARKED`. The fast path has no syscall.
//!
//! No lost wake-up: the waiter stores `PARKED`, runs a `SeqCst` fence, then
//! re-checks its condition; the notifier publishes, runs a `SeqCst` fence, then
//! loads the state. By the fence rules at least one of them sees the other's
//! store: either the waiter sees the new data and does not sleep, or the notifier
//! sees `PARKED` and wakes it (and `FUTEX_WAIT` returns at once if the word is no
//! longer `PARKED` when the waiter enters the kernel).

use crate::sync::{fence, spin_loop, yield_now, AtomicU32, Ordering};
use std::time::{Duration, Instant};

const RUNNING: u32 = 0;
const PARKED: u32 = 1;

/// One futex word in shared memory. All bit patterns are harmless: any value
/// other than `PARKED` reads as running.
#[repr(C)]
#[derive(Debug, Default)]
pub struct WaitCell {
    state: AtomicU32,
}

impl WaitCell {
    /// A cell in the running state.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self { state: AtomicU32::new(RUNNING) }
    }

    /// A cell in the running state.
    #[cfg(loom)]
    pub fn new() -> Self {
        Self { state: AtomicU32::new(RUNNING) }
    }

    /// Resets the cell to running (used when a ring is (re)initialised).
    pub fn reset(&self) {
        self.state.store(RUNNING, Ordering::Relaxed);
    }

    /// Whether the waiter has announced that it is parked.
    pub fn is_parked(&self) -> bool {
        self.state.load(Ordering::Relaxed) == PARKED
    }

    /// Wakes the waiter if it is parked. Call after publishing what it waits for.
    /// Returns whether a wake syscall was made.
    #[inline]
    pub fn notify(&self) -> bool {
        // SYNC POINT: this fence pairs with the fence in `park`; it orders the
        // caller's publish (a Release cursor store) before the load of `state`.
        fence(Ordering::SeqCst);
        if self.state.load(Ordering::Relaxed) != PARKED {
            return false;
        }
        // Only the notifier that flips PARKED -> RUNNING makes the syscall.
        if self.state.swap(RUNNING, Ordering::Relaxed) == PARKED {
            futex_wake(&self.state);
            return true;
        }
        false
    }

    /// Parks the calling thread until notified, `timeout` passes, or (checked
    /// after announcing) `ready()` is already true. Returns `ready()`'s last value
    /// when it was checked before sleeping, else `false`.
    pub fn park(&self, mut ready: impl FnMut() -> bool, timeout: Duration) -> bool {
        self.state.store(PARKED, Ordering::Relaxed);
        // SYNC POINT: pairs with the fence in `notify`: either `ready()` below sees
        // the other side's publish, or the other side sees PARKED and wakes us.
        fence(Ordering::SeqCst);
        if ready() {
            self.state.store(RUNNING, Ordering::Relaxed);
            return true;
        }
        futex_wait(&self.state, PARKED, timeout);
        self.state.store(RUNNING, Ordering::Relaxed);
        false
    }
}

#[cfg(not(loom))]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    use rustix::thread::futex;
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // Not PRIVATE: the word lives in memory shared between processes.
    // EAGAIN (word changed), EINTR and ETIMEDOUT all mean "look again".
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

#[cfg(not(loom))]
fn futex_wake(word: &AtomicU32) {
    use rustix::thread::futex;
    let _ = futex::wake(word, futex::Flags::empty(), u32::MAX);
}

#[cfg(loom)]
fn futex_wait(word: &AtomicU32, expected: u32, _timeout: Duration) {
    // Loom has no futex; a bounded wait is modelled as yielding until the word
    // changes. Correctness must not depend on the timeout.
    while word.load(Ordering::Relaxed) == expected {
        loom::thread::yield_now();
    }
}

#[cfg(loom)]
fn futex_wake(_word: &AtomicU32) {}

/// The adaptive wait policy: spin, then spin with yields, then park.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinThenPark {
    /// Pure spinning (no syscalls) for this long.
    pub spin: Duration,
    /// After `spin`, keep polling with `sched_yield` between polls until this
    /// much time has passed in total, then park (the seed's ~100 µs).
    pub park_after: Duration,
    /// How long one park lasts at most before `tick` runs and polling resumes.
    pub park_timeout: Duration,
}

impl Default for SpinThenPark {
    fn default() -> Self {
        Self {
            spin: Duration::from_micros(20),
            park_after: Duration::from_micros(100),
            park_timeout: Duration::from_millis(50),
        }
    }
}

/// What a wait loop decides after a park timed out or was woken.
#[derive(Debug, PartialEq, Eq)]
pub enum Tick<E> {
    /// Keep waiting.
    Continue,
    /// Stop with this error (peer gone, shutdown…).
    Stop(E),
}

impl SpinThenPark {
    /// A policy that never parks (pure spin, for benchmarks).
    pub fn spin_only() -> Self {
        Self { spin: Duration::MAX, park_after: Duration::MAX, park_timeout: Duration::from_millis(50) }
    }

    /// A policy that parks immediately after one empty poll.
    pub fn park_immediately() -> Self {
        Self { spin: Duration::ZERO, park_after: Duration::ZERO, park_timeout: Duration::from_millis(50) }
    }

    /// Waits until `poll` yields a value. `cell` is the waiter's own wait cell;
    /// `tick` runs after each park (woken or timed out) and may stop the wait.
    pub fn wait<T, E>(
        &self,
        cell: &WaitCell,
        mut poll: impl FnMut() -> Option<T>,
        mut tick: impl FnMut() -> Tick<E>,
    ) -> Result<T, E> {
        if let Some(v) = poll() {
            return Ok(v);
        }
        let start = Instant::now();
        let mut spins: u32 = 0;
        loop {
            // `park_after == 0` ("park immediately"): the empty poll above is
            // the one poll; do not spin 64 polls before the first clock read.
            if !self.park_after.is_zero() {
                if let Some(v) = poll() {
                    return Ok(v);
                }
                spins = spins.wrapping_add(1);
                if spins & 63 != 0 {
                    spin_loop();
                    continue;
                }
                let waited = start.elapsed();
                if waited < self.spin {
                    spin_loop();
                    continue;
                }
                if waited < self.park_after {
                    yield_now();
                    continue;
                }
            }
            let mut found = None;
            cell.park(
                || {
                    found = poll();
                    found.is_some()
                },
                self.park_timeout,
            );
            if let Some(v) = found {
                return Ok(v);
            }
            if let Some(v) = poll() {
                return Ok(v);
            }
            if let Tick::Stop(e) = tick() {
                return Err(e);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn notify_without_waiter_makes_no_syscall() {
        let c = WaitCell::new();
        assert!(!c.notify());
    }

    #[test]
    fn parked_thread_is_woken() {
        let cell = Arc::new(WaitCell::new());
        let flag = Arc::new(AtomicBool::new(false));
        let (c2, f2) = (cell.clone(), flag.clone());
        let t = std::thread::spawn(move || {
            let policy = SpinThenPark { park_timeout: Duration::from_secs(30), ..SpinThenPark::park_immediately() };
            policy.wait(&c2, || f2.load(std::sync::atomic::Ordering::Acquire).then_some(()), || Tick::<()>::Continue)
        });
        while !cell.is_parked() {
            std::thread::yield_now();
        }
        flag.store(true, std::sync::atomic::Ordering::Release);
        assert!(cell.notify());
        assert_eq!(t.join().unwrap(), Ok(()));
    }

    #[test]
    fn tick_can_stop_a_wait() {
        let cell = WaitCell::new();
        let policy = SpinThenPark { park_timeout: Duration::from_millis(1), ..SpinThenPark::park_immediately() };
        let mut ticks = 0;
        let r: Result<(), &str> = policy.wait(
            &cell,
            || None,
            || {
                ticks += 1;
                if ticks == 3 {
                    Tick::Stop("gone")
                } else {
                    Tick::Continue
                }
            },
        );
        assert_eq!(r, Err("gone"));
    }
}
