//! One channel to the daemon: its pair of rings, the exchange of frames for
//! completions, the queue of releases (RELEASE is fire-and-forget), and the
//! liveness checks that turn a dead daemon into `Disconnected` instead of a hang.
//!
//! Completions come in request order. Request ids are stamped here as frames
//! are pushed; a completion that does not carry the next expected id puts the
//! channel out of step for good (the client closes).

use crate::error::{ClientError, Result};
use kachedb_shm::{
    Completion, Consumer, Producer, Region, Request, RingError, SpinThenPark, TensorBlockDescriptor, Tick, WaitState,
};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// While spinning for a completion, how often to check that the daemon lives.
const LIVENESS_EVERY: Duration = Duration::from_millis(10);

/// What [`Channel::exchange`] pushes: frame `i` with its request id.
pub(crate) trait Frames {
    /// How many frames.
    fn count(&self) -> usize;
    /// Frame `i`, carrying `request_id`.
    fn frame(&self, i: usize, request_id: u32) -> TensorBlockDescriptor;
}

impl Frames for [Request] {
    fn count(&self) -> usize {
        self.len()
    }
    #[inline]
    fn frame(&self, i: usize, request_id: u32) -> TensorBlockDescriptor {
        self[i].encode(request_id)
    }
}

/// Raw frames, sent as they are but for the request id (tests of the daemon).
impl Frames for [TensorBlockDescriptor] {
    fn count(&self) -> usize {
        self.len()
    }
    fn frame(&self, i: usize, request_id: u32) -> TensorBlockDescriptor {
        TensorBlockDescriptor { request_id, ..self[i] }
    }
}

/// The rings, used by one thread at a time (behind [`Channel::io`]).
pub(crate) struct Io {
    sub: Producer,
    comp: Consumer,
    /// Request id of the next frame pushed.
    next_request_id: u32,
    /// Request id the next completion must carry (completions come in order).
    next_expected_id: u32,
    /// Fire-and-forget frames (RELEASEs) pushed but not yet acknowledged;
    /// their completions come before any later request's and are discarded.
    unacked: usize,
    /// The frames of the exchange in progress, request ids stamped.
    frames: Vec<TensorBlockDescriptor>,
    /// When a fire-and-forget push (`post`) last woke the daemon from its
    /// park, until the next exchange takes it: that exchange's answer may
    /// still wait for the daemon's wake-up.
    posted_wake: Option<Instant>,
}

/// A channel and the connection that holds it; shared by the client and its
/// views and reservations (which keep it alive).
pub(crate) struct Channel {
    pub(crate) region: Arc<Region>,
    io: Mutex<Io>,
    /// Pins dropped while `io` was busy; released by the next holder.
    pending_release: Mutex<Vec<u64>>,
    /// Whether `pending_release` may be non-empty: set (Release) after a push
    /// under its lock, cleared under its lock when taken; read (Acquire)
    /// before taking the lock, so the common case takes no second lock.
    release_pending: AtomicBool,
    pub(crate) closed: AtomicBool,
    /// Set in a process that inherited this client through `fork()`: the rings
    /// and the connection belong to the parent; touch neither.
    forked: AtomicBool,
    /// [`kachedb_shm::fork::generation`] when the channel was made: another
    /// value means this process inherited it through `fork()` (the region is
    /// inaccessible here then), whether or not `forget_after_fork` was called.
    fork_generation: u64,
    /// The control connection; its EOF tells the daemon we are gone. Taken out
    /// (closed) by `forget_after_fork` in a forked child.
    stream: Mutex<Option<UnixStream>>,
    /// Set once the daemon is known to be gone (its end of the connection hung
    /// up, or it closed the channel): it has dropped this client's pins and
    /// reservations, so nothing more is sent (a release of a view dropped after
    /// that would otherwise wait out a park timeout on a dead daemon, and could
    /// land in the channel after the daemon recycled it).
    gone: AtomicBool,
    wait: SpinThenPark,
    /// The spin budget learnt from this channel's waits (yield at once when the
    /// daemon shares our core).
    wait_state: WaitState,
    pub(crate) index: u32,
    pub(crate) socket_path: PathBuf,
}

impl Channel {
    /// Channel `index` of `region`, held by the connection `stream`.
    pub(crate) fn new(
        region: Arc<Region>,
        index: u32,
        stream: UnixStream,
        wait: SpinThenPark,
        socket_path: PathBuf,
    ) -> Result<Channel> {
        let (sub, comp) = region
            .client_channel(index)
            .ok_or_else(|| ClientError::Protocol(format!("channel {index} is outside the region")))?;
        Ok(Channel {
            region,
            io: Mutex::new(Io {
                sub,
                comp,
                next_request_id: 1,
                next_expected_id: 1,
                unacked: 0,
                frames: Vec::new(),
                posted_wake: None,
            }),
            pending_release: Mutex::new(Vec::new()),
            release_pending: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            forked: AtomicBool::new(false),
            fork_generation: kachedb_shm::fork::generation(),
            stream: Mutex::new(Some(stream)),
            gone: AtomicBool::new(false),
            wait,
            wait_state: WaitState::new(),
            index,
            socket_path,
        })
    }

    /// See `Client::forget_after_fork`. Takes no lock that a thread of the
    /// parent may have held at the fork (it may run in an at-fork handler):
    /// if the connection's lock is taken, this process's copy of the socket
    /// is closed when the client is dropped instead.
    pub(crate) fn forget_after_fork(&self) {
        self.forked.store(true, Ordering::Release);
        self.closed.store(true, Ordering::Release);
        if let Ok(mut s) = self.stream.try_lock() {
            s.take();
        }
    }

    /// Whether this process inherited the channel through `fork()`.
    fn inherited(&self) -> bool {
        // Acquire: pairs with the Release store in `forget_after_fork`.
        self.forked.load(Ordering::Acquire) || kachedb_shm::fork::generation() != self.fork_generation
    }

    fn forked_error() -> ClientError {
        ClientError::Disconnected("this client was inherited through fork(): connect again in this process".into())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Io>> {
        if self.closed.load(Ordering::Acquire) && !self.inherited() {
            return Err(ClientError::Disconnected("the client is closed: connect again".into()));
        }
        self.lock_even_closed()
    }

    fn lock_even_closed(&self) -> Result<MutexGuard<'_, Io>> {
        // Checked before locking: in a forked child the lock may be held
        // forever by a thread of the parent that does not exist here.
        if self.inherited() {
            return Err(Self::forked_error());
        }
        self.io.lock().map_err(|_| ClientError::Disconnected("a thread panicked while using this client".into()))
    }

    /// One request, its completion.
    pub(crate) fn call1(&self, req: Request) -> Result<Completion> {
        let mut v = self.call(std::slice::from_ref(&req))?;
        v.pop().ok_or_else(|| ClientError::Protocol("no completion".into()))
    }

    /// Requests, one publish per ring-full; their completions in order.
    pub(crate) fn call(&self, reqs: &[Request]) -> Result<Vec<Completion>> {
        let raw = self.call_frames(reqs)?;
        raw.iter().map(decode_completion).collect()
    }

    /// RESERVEs as reservation units (`kachedb_shm::mark_unit`): each run of
    /// [`unit_len`](Self::unit_len) of them (the last run shorter) is marked
    /// as one unit and published in one push, so the daemon admits each
    /// whole or not at all. Their completions, in order.
    pub(crate) fn call_units(&self, reqs: &[Request]) -> Result<Vec<Completion>> {
        let mut io = self.lock()?;
        let out = self.exchange_in(&mut io, reqs, true, self.unit_len());
        if matches!(out, Err(ClientError::Protocol(_) | ClientError::Disconnected(_))) {
            self.closed.store(true, Ordering::Release);
        }
        self.flush_releases(&mut io);
        drop(io);
        self.after_unlock();
        out?.iter().map(decode_completion).collect()
    }

    /// The most RESERVEs one reservation unit holds: the ring's capacity
    /// (the daemon takes a unit's frames from its ring whole; a longer batch
    /// is admitted in units of this size, each whole or not at all).
    pub(crate) fn unit_len(&self) -> usize {
        self.region.layout().ring_capacity as usize
    }

    /// Raw frames (no validation); the raw completions.
    #[cfg(feature = "testing")]
    pub(crate) fn call_raw(&self, frames: &[TensorBlockDescriptor]) -> Result<Vec<TensorBlockDescriptor>> {
        self.call_frames(frames)
    }

    fn call_frames<F: Frames + ?Sized>(&self, frames: &F) -> Result<Vec<TensorBlockDescriptor>> {
        let mut io = self.lock()?;
        let out = self.exchange(&mut io, frames, true);
        if matches!(out, Err(ClientError::Protocol(_) | ClientError::Disconnected(_))) {
            // Frames may still be in flight: the channel is out of step for good.
            self.closed.store(true, Ordering::Release);
        }
        self.flush_releases(&mut io);
        drop(io);
        self.after_unlock();
        out
    }

    /// COMMIT or ABORT of a reservation: allowed on a closed client, which
    /// still ends what it started.
    pub(crate) fn finish(&self, req: Request) -> Result<Completion> {
        let mut io = self.lock_even_closed()?;
        let r = self.exchange(&mut io, std::slice::from_ref(&req), true);
        self.flush_releases(&mut io);
        drop(io);
        self.after_unlock();
        let d = r?.pop().ok_or_else(|| ClientError::Protocol("no completion".into()))?;
        decode_completion(&d)
    }

    /// COMMITs or ABORTs of many reservations, as [`finish`](Self::finish).
    pub(crate) fn finish_many(&self, reqs: &[Request]) -> Result<Vec<Completion>> {
        let mut io = self.lock_even_closed()?;
        let r = self.exchange(&mut io, reqs, true);
        self.flush_releases(&mut io);
        drop(io);
        self.after_unlock();
        r?.iter().map(decode_completion).collect()
    }

    /// Pushes `frames` (request ids assigned here) and collects one completion
    /// each, in order; `keep = false` discards them.
    fn exchange<F: Frames + ?Sized>(&self, io: &mut Io, frames: &F, keep: bool) -> Result<Vec<TensorBlockDescriptor>> {
        self.exchange_in(io, frames, keep, 1)
    }

    /// [`exchange`](Self::exchange) of frames in groups of `unit` (the last
    /// one shorter): with `unit` above 1 each group is marked as a
    /// reservation unit (`kachedb_shm::mark_unit`) and pushed only whole,
    /// never split across two publishes. `unit` is at most the ring's
    /// capacity.
    fn exchange_in<F: Frames + ?Sized>(
        &self,
        io: &mut Io,
        frames: &F,
        keep: bool,
        unit: usize,
    ) -> Result<Vec<TensorBlockDescriptor>> {
        if self.inherited() {
            return Err(Self::forked_error());
        }
        if self.gone.load(Ordering::Acquire) {
            return Err(self.gone_error());
        }
        let count = frames.count();
        let mut out = Vec::with_capacity(if keep { count } else { 0 });
        let mut sent = 0usize;
        let mut received = 0usize;
        let first_id = io.next_request_id;
        io.frames.clear();
        io.frames.extend((0..count).map(|i| frames.frame(i, first_id.wrapping_add(i as u32))));
        io.next_request_id = first_id.wrapping_add(count as u32);
        let unit = unit.clamp(1, self.region.layout().ring_capacity.max(1) as usize);
        if unit > 1 {
            for group in io.frames.chunks_mut(unit) {
                kachedb_shm::mark_unit(group);
            }
        }
        let mut buf = [TensorBlockDescriptor::default(); 64];
        // Whether a push of this exchange woke the daemon from its park: its
        // answer then waits for its wake-up first, and our wait polls through
        // that (`SpinThenPark::in_wake_window`) instead of parking too.
        let mut woke_daemon = io.posted_wake.take().is_some_and(|t| t.elapsed() < self.wait.wake_window);
        while received < count || io.unacked > 0 {
            if sent < count {
                let Io { sub, frames: fr, .. } = &mut *io;
                // Whole groups only: up to the last group boundary that fits.
                let mut end = count;
                if unit > 1 {
                    let room = sub.free_slots_for(count - sent).map_err(|e| self.ring_err(e))?;
                    if sent + room < count {
                        end = (sent + room) / unit * unit;
                    }
                }
                if end > sent {
                    let n = sub.push_batch(&fr[sent..end]).map_err(|e| self.ring_err(e))?;
                    if n > 0 {
                        sent += n;
                        woke_daemon |= self.region.doorbell().notify();
                    }
                }
            }
            let in_flight = io.unacked + sent - received;
            let want = in_flight.min(buf.len());
            if want == 0 {
                // Nothing in flight yet the ring had no room: only a daemon that
                // stopped consuming does that. Check it is alive, then retry.
                if let Tick::Stop(e) = self.liveness() {
                    return Err(e);
                }
                std::thread::yield_now();
                continue;
            }
            // Wait for at least one completion.
            let comp = &mut io.comp;
            // `tick` (the liveness check) runs only after a park; a policy that
            // spins for long (`SpinThenPark::spin_only`) may never park, so
            // polling also checks liveness every LIVENESS_EVERY of waiting.
            let mut polls: u32 = 0;
            let mut last_check: Option<Instant> = None;
            let mut dead = None;
            let policy = if woke_daemon { self.wait.in_wake_window() } else { self.wait };
            let got = policy.wait_adaptive(
                &self.wait_state,
                // The completion ring's line-0 cell: the daemon notifies it.
                self.region
                    .completion_wait_cell(self.index)
                    .ok_or_else(|| ClientError::Protocol("channel outside the region".into()))?,
                || {
                    match comp.pop_batch(&mut buf[..want]) {
                        Ok(0) => {}
                        other => return Some(other),
                    }
                    polls = polls.wrapping_add(1);
                    if polls & 1023 == 0 {
                        let now = Instant::now();
                        if now.duration_since(*last_check.get_or_insert(now)) >= LIVENESS_EVERY {
                            last_check = Some(now);
                            if let Tick::Stop(e) = self.liveness() {
                                dead = Some(e);
                                return Some(Ok(0));
                            }
                        }
                    }
                    None
                },
                || self.liveness(),
                || {},
            )?;
            if let Some(e) = dead {
                return Err(e);
            }
            let got = got.map_err(|e| self.ring_err(e))?;
            if got > 0 && in_flight >= self.region.layout().ring_capacity as usize {
                // Our completion ring may have been full: the daemon does not
                // poll a channel without completion room, so tell it there is.
                self.region.doorbell().notify();
            }
            for d in &buf[..got] {
                check_order(io, d)?;
                if io.unacked > 0 {
                    // The acknowledgement of an earlier fire-and-forget RELEASE.
                    io.unacked -= 1;
                    continue;
                }
                received += 1;
                if keep {
                    out.push(*d);
                }
            }
        }
        debug_assert_eq!(io.next_expected_id, first_id.wrapping_add(count as u32));
        Ok(out)
    }

    /// Pushes fire-and-forget requests (RELEASEs): no wait for their
    /// completions, which later calls discard. Falls back to waiting when the
    /// ring is full.
    fn post(&self, io: &mut Io, reqs: &[Request]) -> Result<()> {
        if self.inherited() || self.gone.load(Ordering::Acquire) {
            return Ok(()); // nothing to release: the parent's, or a dead daemon's
        }
        // Discard acknowledgements that are already there (no waiting), once
        // a quarter of the completion ring is owed: reading the ring's cursor
        // after every RELEASE would pull the cache line the daemon is writing.
        // The next exchange discards the rest before its own completions.
        let mut buf = [TensorBlockDescriptor::default(); 64];
        let drain_at = (self.region.layout().ring_capacity as usize / 4).max(1);
        while io.unacked >= drain_at {
            let want = io.unacked.min(buf.len());
            let n = io.comp.pop_batch(&mut buf[..want]).map_err(|e| self.ring_err(e))?;
            if n == 0 {
                break;
            }
            for d in &buf[..n] {
                check_order(io, d)?;
            }
            io.unacked -= n;
        }
        let first_id = io.next_request_id;
        io.frames.clear();
        io.frames.extend(reqs.iter().enumerate().map(|(i, r)| r.encode(first_id.wrapping_add(i as u32))));
        let Io { sub, frames: fr, .. } = &mut *io;
        let n = sub.push_batch(fr).map_err(|e| self.ring_err(e))?;
        io.next_request_id = first_id.wrapping_add(n as u32);
        io.unacked += n;
        if n > 0 && self.region.doorbell().notify() {
            io.posted_wake = Some(Instant::now());
        }
        if n < reqs.len() {
            // The ring is full: wait for room the ordinary way.
            self.exchange(io, &reqs[n..], false)?;
        }
        Ok(())
    }

    fn gone_error(&self) -> ClientError {
        ClientError::Disconnected(format!(
            "the daemon at {} went away: restart it and connect again",
            self.socket_path.display()
        ))
    }

    fn ring_err(&self, e: RingError) -> ClientError {
        match e {
            RingError::Closed => {
                self.gone.store(true, Ordering::Release);
                ClientError::Disconnected("the daemon closed this channel (it is shutting down)".into())
            }
            RingError::Corrupt { .. } => ClientError::Disconnected(format!("channel corrupt: {e}")),
        }
    }

    /// Runs after each park: is the daemon still there?
    fn liveness(&self) -> Tick<ClientError> {
        use rustix::event::{PollFd, PollFlags};
        let guard = match self.stream.lock() {
            Ok(g) => g,
            Err(_) => return Tick::Continue,
        };
        let Some(stream) = guard.as_ref() else {
            return Tick::Stop(ClientError::Disconnected("the connection was closed".into()));
        };
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(n) if n > 0 => {
                // Readable or hung up: the daemon never sends unprompted, so this
                // is EOF (or an error): it is gone.
                self.gone.store(true, Ordering::Release);
                Tick::Stop(self.gone_error())
            }
            _ => Tick::Continue,
        }
    }

    /// Drops the pin `handle` (a view went away): sent now if the rings are
    /// free, else queued for the thread that holds them.
    pub(crate) fn release(&self, handle: u64) {
        self.release_many(std::slice::from_ref(&handle));
    }

    /// Drops the pins `handles` as [`release`](Self::release) does, all in one
    /// post (one publish, one doorbell) when the rings are free.
    pub(crate) fn release_many(&self, handles: &[u64]) {
        if handles.is_empty() || self.inherited() {
            // The pin is the parent's; and no lock here, which a thread of
            // the parent may have held at the fork.
            return;
        }
        // A closed client still releases the pins of its live views.
        match self.io.try_lock() {
            Ok(mut io) => {
                let posted = match handles {
                    [handle] => self.post(&mut io, &[Request::Release { handle: *handle }]),
                    _ => {
                        let reqs: Vec<Request> = handles.iter().map(|&handle| Request::Release { handle }).collect();
                        self.post(&mut io, &reqs)
                    }
                };
                if posted.is_err() {
                    self.closed.store(true, Ordering::Release);
                }
                self.flush_releases(&mut io);
                drop(io);
                self.after_unlock();
            }
            Err(_) => {
                if let Ok(mut p) = self.pending_release.lock() {
                    p.extend_from_slice(handles);
                    self.release_pending.store(true, Ordering::Release);
                }
                self.after_unlock();
            }
        }
    }

    fn flush_releases(&self, io: &mut Io) {
        if !self.release_pending.load(Ordering::Acquire) {
            return;
        }
        let handles = match self.pending_release.lock() {
            Ok(mut p) if !p.is_empty() => {
                self.release_pending.store(false, Ordering::Relaxed);
                std::mem::take(&mut *p)
            }
            _ => return,
        };
        let reqs: Vec<Request> = handles.iter().map(|&handle| Request::Release { handle }).collect();
        if self.post(io, &reqs).is_err() {
            self.closed.store(true, Ordering::Release);
        }
    }

    /// A release queued while we held the lock would otherwise wait for the
    /// next operation: take the lock again if it is free and flush.
    fn after_unlock(&self) {
        loop {
            // SYNC POINT: a release that found `io` taken pushed its handle and
            // then set the flag; we dropped `io` before this load (SeqCst
            // fence: the store-load pair below, as in `WaitCell`): either we
            // see the flag, or the pusher's try_lock sees `io` free and it
            // flushes itself.
            std::sync::atomic::fence(Ordering::SeqCst);
            if !self.release_pending.load(Ordering::Acquire) {
                return;
            }
            match self.io.try_lock() {
                Ok(mut io) => self.flush_releases(&mut io),
                Err(_) => return, // the holder flushes before it unlocks
            }
        }
    }
}

/// Checks that `d` answers the next request in order.
fn check_order(io: &mut Io, d: &TensorBlockDescriptor) -> Result<()> {
    let expect = io.next_expected_id;
    if d.request_id != expect {
        return Err(ClientError::Protocol(format!(
            "completion for request {} arrived when {expect} was expected",
            d.request_id
        )));
    }
    io.next_expected_id = expect.wrapping_add(1);
    Ok(())
}

fn decode_completion(d: &TensorBlockDescriptor) -> Result<Completion> {
    Completion::decode(d).map_err(|e| ClientError::Protocol(format!("daemon sent a bad completion: {e}")))
}
