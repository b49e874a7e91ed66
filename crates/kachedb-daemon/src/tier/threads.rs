//! The scheduling of a tier's threads and the bound of its write-behind
//! queue, the same for every tier.
//!
//! A tier's threads run below the serve loop, so that local traffic wins
//! the CPU: their nice value is the calling thread's raised by the tier's
//! `worker_nice` (capped at 19), and a tier may ask for `SCHED_IDLE` too
//! (the disk tier's `--disk-worker-class idle`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The nice value a tier's threads get: the calling thread's raised by
/// `by`, capped at 19; `None` when `by` is 0 (left as they are).
pub fn worker_nice_value(by: u8) -> Option<i32> {
    if by == 0 {
        return None;
    }
    // `None`: the calling thread (on Linux a nice value is per thread).
    let own = rustix::process::getpriority_process(None).unwrap_or(0);
    Some((own + i32::from(by)).min(19))
}

/// Puts the calling thread in the scheduling class of a tier's workers:
/// nice value `nice` (from [`worker_nice_value`]) and, if `idle`,
/// `SCHED_IDLE` (it runs only on a core no normal thread wants). On Linux
/// both apply to the calling thread only. Raising a nice value or entering
/// `SCHED_IDLE` needs no privilege; a failure is logged under `tier` and
/// leaves the thread as it was.
pub fn enter_worker_class(tier: &str, nice: Option<i32>, idle: bool) {
    if let Some(n) = nice {
        if let Err(e) = rustix::process::setpriority_process(None, n) {
            tracing::warn!("{tier} tier: setting its threads' nice value to {n}: {e}");
        }
    }
    if idle {
        if let Err(e) = set_sched_idle() {
            tracing::warn!("{tier} tier: running its threads SCHED_IDLE: {e}");
        }
    }
}

/// Puts the calling thread in the `SCHED_IDLE` class.
pub fn set_sched_idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: FFI call on the calling thread (pid 0) with a valid pointer to
    // a `sched_param` that lives across the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The bytes and blocks a tier's write-behind queue holds (the tier's
/// `*_queue_bytes` and `*_queue_blocks` gauges), and its bound.
#[derive(Clone, Copy, Debug)]
pub struct WriteQueue<'a> {
    /// Tensor bytes queued or being written.
    pub bytes: &'a AtomicU64,
    /// Blocks queued or being written.
    pub blocks: &'a AtomicU64,
    /// The most bytes it may hold.
    pub bound: u64,
}

impl WriteQueue<'_> {
    /// Whether a block of `len` bytes fits; `Err(bytes queued)` if not.
    /// The serve loop is the one writer of increments, workers only
    /// subtract: this check, then [`push`](Self::push), never lets the sum
    /// pass the bound.
    pub fn fits(&self, len: u64) -> Result<(), u64> {
        // Relaxed: the value is read for itself (`crate::tier::metrics`).
        let queued = self.bytes.load(Relaxed);
        if queued.saturating_add(len) > self.bound {
            return Err(queued);
        }
        Ok(())
    }

    /// Counts a block of `len` bytes queued.
    pub fn push(&self, len: u64) {
        super::metrics::add(self.bytes, len);
        super::metrics::add(self.blocks, 1);
    }

    /// Counts a block of `len` bytes done (written or not).
    pub fn pop(&self, len: u64) {
        super::metrics::sub(self.bytes, len);
        super::metrics::sub(self.blocks, 1);
    }

    /// Empties it (the tier stopped; its jobs are handed over).
    pub fn clear(&self) {
        // Relaxed: see `fits`.
        self.bytes.store(0, Relaxed);
        self.blocks.store(0, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_refuses_what_would_pass_its_bound() {
        let (bytes, blocks) = (AtomicU64::new(0), AtomicU64::new(0));
        let q = WriteQueue { bytes: &bytes, blocks: &blocks, bound: 100 };
        assert_eq!(q.fits(100), Ok(()));
        q.push(60);
        assert_eq!(q.fits(41), Err(60));
        assert_eq!(q.fits(40), Ok(()));
        q.pop(60);
        q.pop(60);
        assert_eq!((bytes.load(Relaxed), blocks.load(Relaxed)), (0, 0));
    }
}
