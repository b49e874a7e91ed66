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

/// A `sched_yield` that took at least this long gave the CPU to another task:
/// a bare `sched_yield` with nothing else runnable on the core returns in a few
/// hundred nanoseconds, a switch to another process and back takes longer.
const YIELD_SWITCHED: Duration = Duration::from_micros(1);

/// A `sched_yield` that took this long or longer gave the CPU to something that
/// ran a whole time slice (a compile job sharing the core, say), not to the
/// other side, whose turn is a few microseconds: it says nothing about where the
/// other side runs.
const YIELD_PEER_MAX: Duration = Duration::from_micros(250);

/// After a `sched_yield` that gave the CPU to another task for a time slice
/// (at least [`YIELD_PEER_MAX`]), waits skip their yield phase for this long:
/// on a contended core a yield costs a slice of someone else's job (ms), a
/// park costs one wake-up, which preempts that job.
const SLOW_YIELD_MEMORY: Duration = Duration::from_millis(100);

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

/// What one waiter learnt from its recent waits: how long to spin before it
/// yields. Process-local (never in shared memory); one per waiting side (a
/// client channel, the daemon's serve loop).
///
/// Spinning only helps when the other side runs on another core. When both
/// share a core (`taskset -c 0` for both, or a busy node), every microsecond
/// spent spinning is a microsecond the other side cannot run: the answer comes
/// only after we yield. So:
/// * a wait answered right after a `sched_yield` that gave the CPU away for a
///   short turn (at least [`YIELD_SWITCHED`], less than [`YIELD_PEER_MAX`])
///   means the other side ran on *our* core: the next waits yield at once
///   (spin budget 0);
/// * a wait answered while yielding without the CPU changing hands (or after a
///   whole time slice of another task) means the other side runs elsewhere but
///   was slower than the budget: back to the policy's full spin;
/// * a wait answered while spinning, or after a park, changes nothing.
///
/// And whether yielding is cheap: a `sched_yield` that took a whole time slice
/// ([`YIELD_PEER_MAX`] or more: a job of another process runs on this core)
/// ends the wait's yield phase at once (it parks), and the waits of the next
/// [`SLOW_YIELD_MEMORY`] go from spinning straight to parking: a yield on a
/// contended core gives the CPU away for a slice even when the answer comes a
/// microsecond later, while a parked waiter's wake-up preempts that job.
#[derive(Debug)]
pub struct WaitState {
    /// Spin budget in nanoseconds; `u64::MAX` = not learnt yet (the policy's `spin`).
    spin_ns: std::sync::atomic::AtomicU64,
    /// When a yield last took a time slice, in ns after [`epoch`] (0: never).
    slow_yield_at_ns: std::sync::atomic::AtomicU64,
}

/// The origin of [`WaitState`]'s timestamps (process-local).
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Default for WaitState {
    fn default() -> Self {
        Self::new()
    }
}

impl WaitState {
    /// Nothing learnt yet: the first wait spins for the policy's `spin`.
    pub const fn new() -> Self {
        Self {
            spin_ns: std::sync::atomic::AtomicU64::new(u64::MAX),
            slow_yield_at_ns: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Notes that a yield at `now` took a time slice.
    fn note_slow_yield(&self, now: Instant) {
        let ns = u64::try_from(now.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX).max(1);
        // Relaxed: a hint, as `spin_ns`.
        self.slow_yield_at_ns.store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether waits at `now` skip yielding (a yield took a slice within
    /// [`SLOW_YIELD_MEMORY`]).
    pub fn yields_are_slow(&self, now: Instant) -> bool {
        match self.slow_yield_at_ns.load(std::sync::atomic::Ordering::Relaxed) {
            0 => false,
            ns => now.saturating_duration_since(epoch() + Duration::from_nanos(ns)) < SLOW_YIELD_MEMORY,
        }
    }

    /// The spin budget the next wait uses under `policy`.
    pub fn spin_budget(&self, policy: &SpinThenPark) -> Duration {
        // Relaxed: a hint; a stale value only costs one wait's latency.
        match self.spin_ns.load(std::sync::atomic::Ordering::Relaxed) {
            u64::MAX => policy.spin,
            ns => Duration::from_nanos(ns).min(policy.spin),
        }
    }

    fn set(&self, budget: Duration) {
        let ns = u64::try_from(budget.as_nanos()).unwrap_or(u64::MAX - 1).min(u64::MAX - 1);
        self.spin_ns.store(ns, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The adaptive wait policy: spin, then spin with yields, then park. The spin
/// phase adapts to where the other side runs ([`WaitState`]).
///
/// A wait right after a wake-up — this side's notify woke the parked peer, or
/// this side was itself just woken from a park — polls for [`wake_window`]
/// instead of `park_after` (see [`in_wake_window`]): the peer that was parked
/// needs a wake-up of its own (a futex wake, and on a VM the wake of a halted
/// vCPU: tens of µs to a few ms), and parking meanwhile would put a second
/// wake-up, ours, on the path of the answer.
///
/// [`wake_window`]: Self::wake_window
/// [`in_wake_window`]: Self::in_wake_window
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinThenPark {
    /// Pure spinning (no syscalls) for this long.
    pub spin: Duration,
    /// After `spin`, keep polling with `sched_yield` between polls until this
    /// much time has passed in total, then park (100 µs by default).
    pub park_after: Duration,
    /// How long one park lasts at most before `tick` runs and polling resumes.
    pub park_timeout: Duration,
    /// How long a wait that follows a wake-up polls before it parks, when
    /// that is longer than `park_after` (1 ms by default: a parked peer's
    /// wake-up, vCPU included, on a loaded 2-vCPU guest; `ZERO`: as any wait).
    pub wake_window: Duration,
}

impl Default for SpinThenPark {
    fn default() -> Self {
        Self {
            spin: Duration::from_micros(20),
            park_after: Duration::from_micros(100),
            park_timeout: Duration::from_millis(50),
            wake_window: Duration::from_millis(1),
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
        Self {
            spin: Duration::MAX,
            park_after: Duration::MAX,
            park_timeout: Duration::from_millis(50),
            wake_window: Duration::ZERO,
        }
    }

    /// A policy that parks immediately after one empty poll (also right
    /// after a wake-up: its `wake_window` is zero).
    pub fn park_immediately() -> Self {
        Self {
            spin: Duration::ZERO,
            park_after: Duration::ZERO,
            park_timeout: Duration::from_millis(50),
            wake_window: Duration::ZERO,
        }
    }

    /// The policy for a wait that follows a wake-up: this side's
    /// [`WaitCell::notify`] woke the peer (it returned `true`), or this side
    /// was woken from a park by work. It polls (spins for the learnt budget,
    /// then yields) until `max(park_after, wake_window)` before parking, so
    /// the peer's wake-up is the only one on the answer's path.
    pub fn in_wake_window(self) -> Self {
        Self { park_after: self.park_after.max(self.wake_window), ..self }
    }

    /// Waits until `poll` yields a value. `cell` is the waiter's own wait cell;
    /// `tick` runs after each park that found nothing (woken or timed out) and
    /// may stop the wait.
    #[inline]
    pub fn wait<T, E>(
        &self,
        cell: &WaitCell,
        poll: impl FnMut() -> Option<T>,
        tick: impl FnMut() -> Tick<E>,
    ) -> Result<T, E> {
        self.wait_observed(cell, poll, tick, || {})
    }

    /// [`wait`](Self::wait), calling `on_park` just before each park (to count
    /// parks: `tick` does not run after a park that found work).
    pub fn wait_observed<T, E>(
        &self,
        cell: &WaitCell,
        poll: impl FnMut() -> Option<T>,
        tick: impl FnMut() -> Tick<E>,
        on_park: impl FnMut(),
    ) -> Result<T, E> {
        self.wait_adaptive(&WaitState::new(), cell, poll, tick, on_park)
    }

    /// [`wait_observed`](Self::wait_observed) with a spin budget learnt from
    /// this waiter's earlier waits (`state`, see [`WaitState`]): when the other
    /// side shares this core, the wait yields at once instead of spinning.
    pub fn wait_adaptive<T, E>(
        &self,
        state: &WaitState,
        cell: &WaitCell,
        mut poll: impl FnMut() -> Option<T>,
        mut tick: impl FnMut() -> Tick<E>,
        mut on_park: impl FnMut(),
    ) -> Result<T, E> {
        if let Some(v) = poll() {
            return Ok(v);
        }
        let budget = state.spin_budget(self);
        let start = Instant::now();
        let mut spins: u32 = 0;
        // Yields so far, and whether the last one gave the CPU away.
        let mut yields: u32 = 0;
        let mut switched = false;
        loop {
            // `park_after == 0` ("park immediately"): the empty poll above is
            // the one poll; do not spin 64 polls before the first clock read.
            if !self.park_after.is_zero() {
                if let Some(v) = poll() {
                    if switched {
                        state.set(Duration::ZERO);
                    } else if yields > 0 {
                        state.set(self.spin);
                    }
                    return Ok(v);
                }
                spins = spins.wrapping_add(1);
                if !budget.is_zero() && spins & 63 != 0 {
                    spin_loop();
                    continue;
                }
                let waited = start.elapsed();
                if waited < budget {
                    spin_loop();
                    continue;
                }
                if waited < self.park_after && !state.yields_are_slow(start + waited) {
                    let before = Instant::now();
                    yield_now();
                    let took = before.elapsed();
                    switched = (YIELD_SWITCHED..YIELD_PEER_MAX).contains(&took);
                    yields = yields.saturating_add(1);
                    if took >= YIELD_PEER_MAX {
                        // Another job had the core for a slice: poll once
                        // more, then park rather than yield again.
                        state.note_slow_yield(before + took);
                    }
                    continue;
                }
            }
            on_park();
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
    fn parks_are_observed() {
        let cell = WaitCell::new();
        let policy = SpinThenPark { park_timeout: Duration::from_millis(1), ..SpinThenPark::park_immediately() };
        let (mut parks, mut ticks, mut polls) = (0, 0, 0);
        let r: Result<(), ()> = policy.wait_observed(
            &cell,
            || {
                polls += 1;
                (polls == 8).then_some(())
            },
            || {
                ticks += 1;
                Tick::Continue
            },
            || parks += 1,
        );
        assert_eq!(r, Ok(()));
        // One poll before the first park; per park: one inside it, one after.
        assert_eq!((parks, ticks), (4, 3));
    }

    #[test]
    fn spin_budget_starts_at_the_policy_and_never_exceeds_it() {
        let policy = SpinThenPark::default();
        let state = WaitState::new();
        assert_eq!(state.spin_budget(&policy), policy.spin);
        state.set(Duration::ZERO);
        assert_eq!(state.spin_budget(&policy), Duration::ZERO);
        state.set(Duration::from_secs(1));
        assert_eq!(state.spin_budget(&policy), policy.spin);
        // A wait answered while spinning leaves the budget as it was.
        state.set(Duration::from_micros(3));
        let mut polls = 0;
        let r: Result<(), ()> = policy.wait_adaptive(
            &state,
            &WaitCell::new(),
            || {
                polls += 1;
                (polls == 3).then_some(())
            },
            || Tick::Continue,
            || {},
        );
        assert_eq!(r, Ok(()));
        assert_eq!(state.spin_budget(&policy), Duration::from_micros(3));
    }

    #[test]
    fn the_wake_window_lengthens_polling_only() {
        let p = SpinThenPark::default();
        let w = p.in_wake_window();
        assert_eq!(w.park_after, p.wake_window);
        assert!(w.park_after > p.park_after);
        assert_eq!((w.spin, w.park_timeout, w.wake_window), (p.spin, p.park_timeout, p.wake_window));
        // Never shorter than the policy's own polling.
        let long = SpinThenPark { park_after: Duration::from_millis(5), ..p };
        assert_eq!(long.in_wake_window().park_after, Duration::from_millis(5));
        // The policies that promise a behaviour keep it.
        assert_eq!(SpinThenPark::park_immediately().in_wake_window(), SpinThenPark::park_immediately());
        assert_eq!(SpinThenPark::spin_only().in_wake_window(), SpinThenPark::spin_only());
    }

    #[test]
    fn a_wait_in_the_wake_window_polls_instead_of_parking() {
        // An answer 60 ms into the wait (a peer's slow wake-up): the plain
        // policy parks after 100 us, the wake-window one polls for 30 ms
        // first (unless a yield took a time slice: then it parks at once).
        let answer_after = Duration::from_millis(60);
        let policy = SpinThenPark {
            wake_window: Duration::from_millis(30),
            park_timeout: Duration::from_millis(1),
            ..SpinThenPark::default()
        };
        // The time of the first park, if any; and whether yields were slow.
        let first_park = |p: SpinThenPark| {
            let state = WaitState::new();
            let start = Instant::now();
            let mut first = None;
            let r: Result<(), ()> = p.wait_adaptive(
                &state,
                &WaitCell::new(),
                || (start.elapsed() >= answer_after).then_some(()),
                || Tick::Continue,
                || {
                    first.get_or_insert(start.elapsed());
                },
            );
            assert_eq!(r, Ok(()));
            (first, state.yields_are_slow(Instant::now()))
        };
        assert!(first_park(policy).0.is_some());
        // Parking early is allowed only once yields were found slow.
        if let (Some(at), false) = first_park(policy.in_wake_window()) {
            assert!(at >= policy.wake_window, "parked after {at:?}");
        }
    }

    #[test]
    fn a_slow_yield_is_remembered_for_a_while() {
        let state = WaitState::new();
        let now = epoch() + Duration::from_secs(1);
        assert!(!state.yields_are_slow(now));
        state.note_slow_yield(now);
        assert!(state.yields_are_slow(now));
        assert!(state.yields_are_slow(now + SLOW_YIELD_MEMORY / 2));
        assert!(!state.yields_are_slow(now + SLOW_YIELD_MEMORY));
    }

    #[test]
    fn after_a_slow_yield_a_wait_parks_instead_of_yielding() {
        // An answer 20 ms into the wait, with a yield phase of 10 s: a wait
        // after a slow yield parks after its spin instead of yielding.
        let answer_after = Duration::from_millis(20);
        let policy = SpinThenPark {
            park_after: Duration::from_secs(10),
            park_timeout: Duration::from_millis(1),
            ..SpinThenPark::default()
        };
        let waits = |state: &WaitState| {
            let start = Instant::now();
            let mut parks = 0;
            let r: Result<(), ()> = policy.wait_adaptive(
                state,
                &WaitCell::new(),
                || (start.elapsed() >= answer_after).then_some(()),
                || Tick::Continue,
                || parks += 1,
            );
            assert_eq!(r, Ok(()));
            parks
        };
        let state = WaitState::new();
        state.note_slow_yield(Instant::now());
        assert!(waits(&state) > 0);
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
