//! One channel's session as the serve loop holds it ([`Session`]) and the
//! serving of it: a pass over every channel ([`serve_all`]) answers each
//! one's batch of requests from the store ([`serve_channel`]), parks WAITs
//! and local misses, and answers the WAITs that commits wake.

use super::tiers::{Resolved, Tiers};
use super::BATCH;
use crate::metrics::MetricsWriter;
use crate::store::{SessionId, Store};
use crate::waits::{Waiter, Waits};
use kachedb_shm::control::{ServeStats, DEFAULT_TENANT};
use kachedb_shm::{
    continues_unit, unit_len, Completion, Consumer, Op, Producer, Region, Request, RingError, Status,
    TensorBlockDescriptor, WAIT_FOREVER,
};
use std::collections::HashSet;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One connected client's channel, as the serve loop holds it.
pub(super) struct Session {
    pub(super) session: SessionId,
    pub(super) sub: Consumer,
    pub(super) comp: Producer,
    pub(super) stream: Arc<UnixStream>,
    pub(super) pid: i32,
    pub(super) uid: u32,
    /// Frames popped whose completions are not yet pushed (completion ring full).
    pub(super) backlog: Vec<TensorBlockDescriptor>,
    pub(super) kicked: bool,
    /// A WAIT of this channel is parked ([`Waits`]): nothing more of it is
    /// served until it is answered, so completions stay in request order.
    pub(super) waiting: bool,
    /// Request frames popped after a WAIT that parked, served (before any
    /// newer frame) once it is answered.
    pub(super) held: Vec<TensorBlockDescriptor>,
    /// The fetch this channel is parked on (`waiting` is set too).
    pub(super) fetch: Option<PendingFetch>,
    /// Keys a tier was asked for while this channel's held frames
    /// are served: a local miss of one of them is answered, not fetched again.
    pub(super) tier_asked: HashSet<u128>,
    /// Since when requests of this channel wait for room in its completion
    /// ring (the client does not drain it); `None` while it does.
    pub(super) stuck_since: Option<Instant>,
    /// Answers held until the removals they wait for are over (a DELETE, or
    /// a COMMIT that replaced a block a tier holds, and the COMMITs and
    /// DELETEs served after it in the same batch), in request order;
    /// `waiting` is set meanwhile.
    pub(super) held_answers: Vec<HeldAnswer>,
}

/// An answer held for the removals it waits for.
pub(super) struct HeldAnswer {
    pub(super) c: Completion,
    /// The removals (tier, token) not over yet.
    pub(super) waits: Vec<(crate::tier::TierId, u64)>,
    /// Every removal it waited for was durable so far.
    pub(super) durable: bool,
}

/// A fetch (from a tier) a channel is parked on.
pub(super) struct PendingFetch {
    pub(super) id: u64,
    pub(super) keys: Vec<u128>,
    pub(super) started: Instant,
}

impl Session {
    /// Whether a pass would find something to do on this channel. Nothing
    /// while its completion ring is full: a client that stopped draining it
    /// (SIGSTOP, a debugger, throttling) would otherwise make the idle loop
    /// spin on frames it cannot answer. Once the client drains, the next
    /// check (at the latest one park timeout later) sees room. A corrupt
    /// ring counts as work, so that the pass reports it.
    pub(super) fn has_work(&mut self) -> bool {
        if self.kicked {
            return false;
        }
        if self.waiting && self.backlog.is_empty() {
            // Nothing is served while a WAIT is parked; only a corrupt ring
            // needs a pass (to kick its client).
            return self.sub.check().is_err();
        }
        let pending = !self.backlog.is_empty() || (!self.waiting && (!self.held.is_empty() || self.sub.has_data()));
        pending && self.comp.free_slots().map_or(true, |room| room > 0)
    }

    /// Whether requests (or completions) of this channel wait for room in
    /// its completion ring: the client is not draining it.
    pub(super) fn blocked(&mut self) -> bool {
        if self.kicked {
            return false;
        }
        let pending = !self.backlog.is_empty() || (!self.waiting && (!self.held.is_empty() || self.sub.has_data()));
        pending && self.comp.free_slots().is_ok_and(|room| room == 0)
    }

    /// Notes whether the channel is [`blocked`](Self::blocked) now, keeping
    /// the time it started.
    pub(super) fn note_blocked(&mut self, now: Instant) {
        if !self.blocked() {
            self.stuck_since = None;
        } else if self.stuck_since.is_none() {
            self.stuck_since = Some(now);
        }
    }
}

/// One pass over every live channel; whether any frame was served.
#[allow(clippy::too_many_arguments)] // the serve loop's parts
pub(super) fn serve_all(
    region: &Region,
    store: &mut Store,
    sessions: &mut [Option<Session>],
    req: &mut Vec<TensorBlockDescriptor>,
    out: &mut Vec<TensorBlockDescriptor>,
    counters: &mut ServeStats,
    metrics: &mut MetricsWriter,
    waits: &mut Waits,
    tiers: &mut Tiers,
) -> bool {
    let mut did_work = false;
    let mut committed = Vec::new();
    for ch in 0..sessions.len() {
        let Some(s) = sessions[ch].as_mut() else { continue };
        if s.kicked {
            continue;
        }
        let served =
            serve_channel(region, store, s, ch as u32, req, out, counters, metrics, waits, tiers, &mut committed);
        if !committed.is_empty() {
            wake_waits(store, sessions, waits, &mut committed, counters);
        }
        let Some(s) = sessions[ch].as_mut() else { continue };
        match served {
            Ok(n) => did_work |= n > 0,
            Err(e) => {
                tracing::warn!(
                    event = "client_kicked",
                    pid = s.pid,
                    uid = s.uid,
                    "disconnecting a corrupt client: {e}"
                );
                counters.clients_kicked += 1;
                s.kicked = true;
                // Its socket's EOF brings the Detach that cleans up.
                let _ = s.stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
    did_work
}

/// Answers the WAITs of the keys in `committed` (COMMITs just served) with a
/// pin of the new block; a WAIT whose key is gone again (deleted in the same
/// batch) stays parked.
pub(super) fn wake_waits(
    store: &mut Store,
    sessions: &mut [Option<Session>],
    waits: &mut Waits,
    committed: &mut Vec<u128>,
    counters: &mut ServeStats,
) {
    for key in committed.drain(..) {
        for (ch, w) in waits.take_key(key) {
            let Some(s) = sessions.get_mut(ch as usize).and_then(Option::as_mut) else { continue };
            let c = store.handle(s.session, w.request_id, &Request::Wait { key, timeout_us: 0 });
            if c.status == Status::NotFound {
                waits.park(ch, w);
                continue;
            }
            answer_wait(s, c, counters);
        }
    }
}

/// Ends the fetch `s` is parked on: its held frames are served again
/// from the next pass on, answering the keys it asked for from what is local
/// now. When it started.
pub(super) fn unpark_fetch(s: &mut Session) -> Instant {
    s.waiting = false;
    match s.fetch.take() {
        Some(f) => {
            s.tier_asked.extend(f.keys);
            f.started
        }
        None => Instant::now(),
    }
}

/// A removal that answers of `s` wait for is over: once none waits any
/// more, the held answers are sent in order — `NOT_DURABLE` for those whose
/// removals were not all durable (a COMMIT_PIN's pin is released first, as
/// its client, told the commit failed, never learns the handle) — and the
/// channel is served again.
pub(super) fn removal_done(store: &mut Store, s: &mut Session, r: Resolved, counters: &mut ServeStats) {
    if s.session != r.session {
        return;
    }
    for h in &mut s.held_answers {
        if let Some(at) = h.waits.iter().position(|&w| w == r.id) {
            h.waits.swap_remove(at);
            h.durable &= r.durable;
        }
    }
    if s.held_answers.iter().any(|h| !h.waits.is_empty()) {
        return;
    }
    for h in std::mem::take(&mut s.held_answers) {
        // A DELETE's NOT_FOUND says the key was not in RAM; a tier may
        // still have held it.
        let refused = h.c.status != Status::Ok && h.c.op != Op::Delete;
        let c = if h.durable || refused {
            h.c
        } else {
            if h.c.tensor.is_some() {
                store.handle_internal(s.session, &Request::Release { handle: h.c.handle });
            }
            Completion { status: Status::NotDurable, handle: 0, offset: 0, tensor: None, ..h.c }
        };
        answer_wait(s, c, counters);
    }
}

/// Sends the completion of the parked WAIT of `s`; its held frames are served
/// from the next pass on.
pub(super) fn answer_wait(s: &mut Session, c: Completion, counters: &mut ServeStats) {
    s.waiting = false;
    let d = c.encode();
    // Behind completions still waiting for room, or when the ring is full (or
    // corrupt: the next pass finds out): sent later, in order.
    if !s.backlog.is_empty() || !matches!(s.comp.push_batch(std::slice::from_ref(&d)), Ok(1)) {
        s.backlog.push(d);
    }
    if s.comp.notify_consumer() {
        counters.wakeups_sent += 1;
    }
}

/// Handles what one channel has, bounded by room in its completion ring
/// (but for the rest of a reservation unit, whose completions may go to
/// the backlog). A reservation unit (`kachedb_shm::unit_len`) is served
/// whole by [`Store::handle_unit`]: if the frames popped end inside one,
/// the rest of it is taken from the held frames or the ring first.
/// A WAIT for an absent key parks (in `waits`; the frames after it are held),
/// and the keys of the COMMITs served are added to `committed` while any WAIT
/// is parked. With tiers behind the megaslab, each block committed is offered
/// to them for writing behind, and a GET or LOOKUP that misses locally parks
/// the channel the same way while the first tier fetches the batch's
/// local-miss tail; a WAIT that misses locally parks as a WAIT and asks the
/// tiers for its key (a fill then answers it).
#[allow(clippy::too_many_arguments)] // the serve loop's parts
pub(super) fn serve_channel(
    region: &Region,
    store: &mut Store,
    s: &mut Session,
    channel: u32,
    req: &mut Vec<TensorBlockDescriptor>,
    out: &mut Vec<TensorBlockDescriptor>,
    counters: &mut ServeStats,
    metrics: &mut MetricsWriter,
    waits: &mut Waits,
    tiers: &mut Tiers,
    committed: &mut Vec<u128>,
) -> Result<usize, RingError> {
    // First flush completions that did not fit last time.
    if !s.backlog.is_empty() {
        let n = s.comp.push_batch(&s.backlog)?;
        s.backlog.drain(..n);
        if n > 0 && s.comp.notify_consumer() {
            counters.wakeups_sent += 1;
        }
        if !s.backlog.is_empty() {
            return Ok(n);
        }
    }
    if s.waiting {
        // Nothing is served while the WAIT is parked, but a corrupt ring is
        // still noticed (and its client kicked) now, not after the WAIT.
        s.sub.check()?;
        return Ok(0);
    }
    let room = s.comp.free_slots()?.min(BATCH);
    if room == 0 {
        return Ok(0);
    }
    let from_held = !s.held.is_empty();
    req.clear();
    if !from_held {
        req.resize(room, TensorBlockDescriptor::default());
        let n = s.sub.pop_batch(req)?;
        req.truncate(n);
    } else {
        let k = s.held.len().min(room);
        req.extend(s.held.drain(..k));
    }
    complete_unit(s, req)?;
    let n = req.len();
    if n == 0 {
        return Ok(0);
    }
    out.clear();
    let timer = metrics.batch_start();
    let unit_cap = s.sub.capacity();
    // Frames before this index were served as part of a reservation unit.
    let mut served_to = 0;
    for (i, frame) in req[..n].iter().enumerate() {
        if i < served_to {
            continue;
        }
        // Behind a held answer only COMMITs and DELETEs are served (their
        // answers held too, in order); the rest waits until it is sent.
        if !s.held_answers.is_empty()
            && !matches!(
                Request::decode(frame),
                Ok(Request::Commit { .. }
                    | Request::CommitPin { .. }
                    | Request::CommitAs { .. }
                    | Request::Delete { .. })
            )
        {
            s.held.splice(0..0, req[i..n].iter().copied());
            break;
        }
        if continues_unit(frame) {
            let len = unit_len(&req[i..n], unit_cap);
            serve_unit(store, s, &req[i..i + len], out, counters, metrics);
            served_to = i + len;
            continue;
        }
        counters.ops += 1;
        // The removals this frame's answer waits for (COMMIT, DELETE).
        let mut removals: Option<Vec<(crate::tier::TierId, u64)>> = None;
        let c = match Request::decode(frame) {
            Ok(r @ (Request::Commit { .. } | Request::CommitPin { .. } | Request::CommitAs { .. }))
                if !waits.is_empty() || !tiers.is_empty() =>
            {
                let (key, parent) = match r {
                    Request::Commit { handle, parent } | Request::CommitPin { handle, parent } => {
                        (store.reservation_key(s.session, handle), parent)
                    }
                    Request::CommitAs { key, parent, .. } => (Some(key), parent),
                    _ => (None, None),
                };
                let c = store.handle(s.session, frame.request_id, &r);
                if let (Some(key), Status::Ok) = (key, c.status) {
                    if !waits.is_empty() {
                        committed.push(key);
                    }
                    if !tiers.is_empty() {
                        // An older copy a tier holds goes first (a replacement).
                        removals = Some(tiers.committed(store, channel, s.session, key, parent));
                    }
                }
                c
            }
            Ok(r @ Request::Delete { key }) if !tiers.is_empty() => {
                // Through to the tiers, whether or not the key was local;
                // not when it was refused (another bound tenant's block).
                let c = store.handle(s.session, frame.request_id, &r);
                if c.status != Status::Denied {
                    removals = Some(tiers.remove(channel, s.session, key));
                }
                c
            }
            Ok(r @ (Request::Get { key } | Request::Lookup { key }))
                if !tiers.is_empty() && !s.tier_asked.contains(&key) && store.peek(key).is_none() =>
            {
                // A local miss: ask the first tier for it and for every
                // other local miss of this batch after it (a chain's tail,
                // read in one round), and serve this frame and the rest of
                // the batch again once the fill is in.
                let mut keys = vec![key];
                for f in &req[i + 1..n] {
                    if let Ok(Request::Get { key: k } | Request::Lookup { key: k }) = Request::decode(f) {
                        if !s.tier_asked.contains(&k) && store.peek(k).is_none() && !keys.contains(&k) {
                            keys.push(k);
                        }
                    }
                }
                if let Some((id, keys)) =
                    tiers.start_fetch(store, channel, store.session_tenant(s.session).unwrap_or(DEFAULT_TENANT), keys)
                {
                    s.fetch = Some(PendingFetch { id, keys, started: Instant::now() });
                    s.waiting = true;
                    s.held.splice(0..0, req[i..n].iter().copied());
                    // Counted when it is served again.
                    counters.ops -= 1;
                    break;
                }
                store.handle(s.session, frame.request_id, &r)
            }
            Ok(r @ Request::Wait { key, timeout_us }) => {
                let c = store.handle(s.session, frame.request_id, &r);
                if c.status == Status::NotFound {
                    if timeout_us == 0 {
                        Completion { status: Status::TimedOut, ..c }
                    } else {
                        // Park it; serve nothing more of this channel until it
                        // is answered (the rest of this batch is held).
                        let deadline = (timeout_us != WAIT_FOREVER)
                            .then(|| Instant::now().checked_add(Duration::from_micros(timeout_us)))
                            .flatten();
                        waits.park(channel, Waiter { key, request_id: frame.request_id, deadline });
                        s.waiting = true;
                        // The key may be on a tier behind the megaslab: ask for
                        // it. A fill commits it like a client's COMMIT, which
                        // answers this WAIT (`wake_waits`); a miss there leaves
                        // it parked for a COMMIT or its deadline. The channel
                        // waits on the WAIT, not on the fetch.
                        if !tiers.is_empty() && !s.tier_asked.contains(&key) {
                            tiers.start_fetch(
                                store,
                                channel,
                                store.session_tenant(s.session).unwrap_or(DEFAULT_TENANT),
                                vec![key],
                            );
                        }
                        let rest = &req[i + 1..n];
                        s.held.splice(0..0, rest.iter().copied());
                        metrics.frame(frame.op, c.status);
                        break;
                    }
                } else {
                    c
                }
            }
            Ok(r @ Request::Meta { .. }) => {
                store.handle_meta(s.session, frame.request_id, &r, |offset, len| region.copy_from_slab(offset, len))
            }
            Ok(r) => store.handle(s.session, frame.request_id, &r),
            Err(e) => {
                counters.rejected_frames += 1;
                tracing::debug!(pid = s.pid, "rejected frame: {e}");
                Completion {
                    request_id: frame.request_id,
                    op: Op::from_code(frame.op).unwrap_or(Op::Ping),
                    status: Status::Invalid,
                    handle: 0,
                    offset: 0,
                    tensor: None,
                }
            }
        };
        metrics.frame(frame.op, c.status);
        if c.status == Status::Denied {
            super::denials::denied(store, s.session, s.pid, s.uid, frame);
        }
        if c.status == Status::Ok && matches!(c.op, Op::Get | Op::Lookup | Op::Wait) && tiers.wants_requests() {
            if let Ok(Request::Get { key } | Request::Lookup { key } | Request::Wait { key, .. }) =
                Request::decode(frame)
            {
                tiers.requested(store, key, s.session);
            }
        }
        match removals {
            Some(waits) if !waits.is_empty() || !s.held_answers.is_empty() => {
                s.held_answers.push(HeldAnswer { c, waits, durable: true });
            }
            _ => out.push(c.encode()),
        }
    }
    if !s.held_answers.is_empty() {
        // Parked until the removals are over (`removal_done`).
        s.waiting = true;
    }
    // Before the completions go out: a client that saw its answer and then
    // scrapes finds it counted.
    metrics.publish_store(&store.gauges());
    let pushed = s.comp.push_batch(out)?;
    if pushed < out.len() {
        s.backlog.extend_from_slice(&out[pushed..]);
    }
    metrics.batch_end(timer, &req[..n]);
    if from_held && s.held.is_empty() && !s.waiting {
        s.tier_asked.clear();
    }
    if s.comp.notify_consumer() {
        counters.wakeups_sent += 1;
    }
    Ok(n)
}

/// If the frames in `req` end inside a reservation unit (their last frame
/// [continues](continues_unit) one that is shorter than the ring's
/// capacity), takes the rest of it: from the frames held for this channel
/// first, then from its ring, one frame at a time, until a frame ends the
/// unit or none is there (a client publishes a unit in one push, so the
/// rest is there unless the client broke that rule: the unit is then what
/// was there).
fn complete_unit(s: &mut Session, req: &mut Vec<TensorBlockDescriptor>) -> Result<(), RingError> {
    if !req.last().is_some_and(continues_unit) {
        return Ok(());
    }
    let cap = s.sub.capacity();
    // Where the last unit starts: walk the frames unit by unit.
    let (mut at, mut last) = (0, 0);
    while at < req.len() {
        last = at;
        at += unit_len(&req[at..], cap).max(1);
    }
    while req.len() - last < cap && req.last().is_some_and(continues_unit) {
        let next = if !s.held.is_empty() {
            Some(s.held.remove(0))
        } else {
            match s.sub.try_pop() {
                Ok(f) => f,
                // Closed (the daemon is stopping): the unit is what was there.
                Err(RingError::Closed) => None,
                Err(e) => return Err(e),
            }
        };
        let Some(f) = next else { break };
        req.push(f);
    }
    Ok(())
}

/// Serves the reservation unit `frames` of channel `s`: decoded, then
/// admitted whole or refused whole by [`Store::handle_unit`]. A unit with a
/// frame that fails decoding is refused whole with `INVALID` before any of
/// it reaches the store. One completion per frame goes to `out`.
fn serve_unit(
    store: &mut Store,
    s: &Session,
    frames: &[TensorBlockDescriptor],
    out: &mut Vec<TensorBlockDescriptor>,
    counters: &mut ServeStats,
    metrics: &mut MetricsWriter,
) {
    counters.ops += frames.len() as u64;
    let mut unit = Vec::with_capacity(frames.len());
    let mut invalid = false;
    for f in frames {
        match Request::decode(f) {
            Ok(r) => unit.push((f.request_id, r)),
            Err(e) => {
                counters.rejected_frames += 1;
                tracing::debug!(pid = s.pid, "rejected frame of a reservation unit: {e}");
                invalid = true;
            }
        }
    }
    let mut done = Vec::with_capacity(frames.len());
    if invalid {
        done.extend(frames.iter().map(|f| Completion {
            request_id: f.request_id,
            op: Op::Reserve,
            status: Status::Invalid,
            handle: 0,
            offset: 0,
            tensor: None,
        }));
    } else {
        store.handle_unit(s.session, &unit, &mut done);
    }
    for (f, c) in frames.iter().zip(&done) {
        metrics.frame(f.op, c.status);
        out.push(c.encode());
    }
}
