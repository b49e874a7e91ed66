//! The serve loop: one thread serves every channel.
//!
//! Each pass handles the control [`Event`]s queued, then pops a batch of
//! submissions from each ring that has work (as many as the client's
//! completion ring has room for), answers them from the [`Store`], publishes
//! the completions once per batch and wakes the client only if it parked;
//! then it does one slice of the remote tier's queued fill work (reservations
//! and commits, [`REMOTE_SLICE`] blocks), so a long fill never holds the rings.
//! With no work it waits by the daemon's [`SpinThenPark`] policy on the region
//! doorbell, which the clients ring after publishing and the control thread
//! after queueing an event (idle CPU ~0 %).

use crate::channels::Channels;
use crate::events::Event;
use crate::metrics::{Health, Metrics, MetricsWriter, RemoteCells};
use crate::remote::{FetchJob, FillSpec, RemoteEvent, RemoteTier, Reserved, WriteJob};
use crate::store::{SessionId, Store};
use crate::takeover::{ChannelState, ParkedWait, ServeState};
use crate::waits::{Waiter, Waits};
use kachedb_shm::control::ServeStats;
use kachedb_shm::{
    Completion, Consumer, Op, Producer, Region, Request, RingError, SpinThenPark, Stats, Status, TensorBlockDescriptor,
    Tick, WaitState, WAIT_FOREVER,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Frames handled per channel per pass (bounds latency for the others).
const BATCH: usize = 64;

/// Remote-fill blocks reserved or committed per pass: the serve loop polls
/// the rings between slices, so a fill of a long chain delays a ring
/// request by at most one slice (about a microsecond per block).
const REMOTE_SLICE: usize = 8;

/// One connected client's channel, as the serve loop holds it.
struct Session {
    session: SessionId,
    sub: Consumer,
    comp: Producer,
    stream: Arc<UnixStream>,
    pid: i32,
    uid: u32,
    /// Frames popped whose completions are not yet pushed (completion ring full).
    backlog: Vec<TensorBlockDescriptor>,
    kicked: bool,
    /// A WAIT of this channel is parked ([`Waits`]): nothing more of it is
    /// served until it is answered, so completions stay in request order.
    waiting: bool,
    /// Request frames popped after a WAIT that parked, served (before any
    /// newer frame) once it is answered.
    held: Vec<TensorBlockDescriptor>,
    /// The remote fetch this channel is parked on (`waiting` is set too).
    fetch: Option<PendingFetch>,
    /// Keys the remote tier was asked for while this channel's held frames
    /// are served: a local miss of one of them is answered, not fetched again.
    remote_asked: HashSet<u128>,
    /// Since when requests of this channel wait for room in its completion
    /// ring (the client does not drain it); `None` while it does.
    stuck_since: Option<Instant>,
}

/// A remote fetch a channel is parked on.
struct PendingFetch {
    id: u64,
    keys: Vec<u128>,
    started: Instant,
}

/// The serve loop's side of the remote tier (`crate::remote`).
struct RemoteSide {
    tier: RemoteTier,
    /// The tier's own session: its write-behind pins and fill reservations.
    session: SessionId,
    next_fetch: u64,
    /// Fetches channels are parked on: id -> (channel, when to stop waiting).
    pending: HashMap<u64, (u32, Instant)>,
    /// Fill work queued, done [`REMOTE_SLICE`] blocks per pass, in order.
    work: VecDeque<RemoteWork>,
}

/// Fill work the serve loop does in slices between ring polls.
enum RemoteWork {
    /// Reservations asked for by a fetch: `answers` holds those made so far;
    /// all of them go back on `reply` once the last is made.
    Reserve {
        blocks: Vec<FillSpec>,
        answers: Vec<Option<Reserved>>,
        reply: tokio::sync::oneshot::Sender<Vec<Option<Reserved>>>,
    },
    /// A fetch's filled reservations, committed from `next` on; once all
    /// are, its channel is unparked and WAITs on `committed` answered.
    Commit { fetch: u64, filled: Vec<(u64, u64)>, next: usize, committed: Vec<u128> },
}

impl RemoteSide {
    /// Queues the block of `key` (just committed by a client) for writing,
    /// pinned; or drops it, counted, when the queue is full.
    fn queue_write(&mut self, store: &mut Store, key: u128) {
        let Some(b) = store.peek(key) else { return };
        if !self.tier.admit(b.len) {
            return;
        }
        let c = store.handle_internal(self.session, &Request::Get { key });
        if c.status != Status::Ok {
            self.tier.unadmit(b.len);
            return;
        }
        self.tier.write(WriteJob {
            key,
            pin: c.handle,
            data_offset: b.data_offset,
            len: b.len,
            dtype: b.dtype,
            shape: b.shape,
        });
    }

    /// Starts a fetch of `keys` for `channel`; its id.
    fn start_fetch(&mut self, channel: u32, keys: Vec<u128>) -> u64 {
        self.next_fetch += 1;
        let id = self.next_fetch;
        self.pending.insert(id, (channel, Instant::now() + self.tier.fetch_bound()));
        self.tier.fetch(FetchJob { id, keys });
        id
    }
}

impl Session {
    /// Whether a pass would find something to do on this channel. Nothing
    /// while its completion ring is full: a client that stopped draining it
    /// (SIGSTOP, a debugger, throttling) would otherwise make the idle loop
    /// spin on frames it cannot answer. Once the client drains, the next
    /// check (at the latest one park timeout later) sees room. A corrupt
    /// ring counts as work, so that the pass reports it.
    fn has_work(&mut self) -> bool {
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
    fn blocked(&mut self) -> bool {
        if self.kicked {
            return false;
        }
        let pending = !self.backlog.is_empty() || (!self.waiting && (!self.held.is_empty() || self.sub.has_data()));
        pending && self.comp.free_slots().is_ok_and(|room| room == 0)
    }

    /// Notes whether the channel is [`blocked`](Self::blocked) now, keeping
    /// the time it started.
    fn note_blocked(&mut self, now: Instant) {
        if !self.blocked() {
            self.stuck_since = None;
        } else if self.stuck_since.is_none() {
            self.stuck_since = Some(now);
        }
    }
}

/// What woke an idle serve loop.
enum Wake {
    /// The oldest queued control event (the rest wait for the next pass).
    Event(Event),
    /// Frames or completions waiting on a channel.
    Rings,
}

/// The serve loop's state; [`run`](Serve::run) consumes it.
pub(crate) struct Serve {
    region: Arc<Region>,
    store: Store,
    events: Receiver<Event>,
    channels: Arc<Channels>,
    shutdown: Arc<AtomicBool>,
    wait: SpinThenPark,
    socket_path: PathBuf,
    started: Instant,
    /// Indexed by channel.
    sessions: Vec<Option<Session>>,
    counters: ServeStats,
    /// The only writer of the metrics the serve loop owns.
    metrics: MetricsWriter,
    rate: RateWindow,
    /// Stats requests, answered at the end of the pass that saw them.
    stats_waiting: Vec<Sender<Stats>>,
    req: [TensorBlockDescriptor; BATCH],
    out: Vec<TensorBlockDescriptor>,
    /// Parked WAITs.
    waits: Waits,
    /// The spin budget learnt from the idle waits (yield at once when clients
    /// share the daemon's core).
    wait_state: WaitState,
    /// The remote tier, if the daemon has one.
    remote: Option<RemoteSide>,
    /// Run the store's full `O(n log n)` invariant check for every stats
    /// answer (`kachedb serve --check-invariants`, tests); otherwise stats
    /// make only the `O(1)` cross-checks of [`Store::check_counters`], so a
    /// stats poll never stalls the data path.
    full_checks: bool,
    /// How long a channel may stay [`blocked`](Session::blocked) before its
    /// client is disconnected (`kachedb serve --stuck-client-timeout-ms`;
    /// `None`: never).
    stuck_timeout: Option<Duration>,
    /// A new daemon took over: stop at once, leaving channels and
    /// connections as they are.
    handed_over: bool,
}

impl Serve {
    #[allow(clippy::too_many_arguments)] // the daemon's parts, handed over once
    pub(crate) fn new(
        region: Arc<Region>,
        store: Store,
        events: Receiver<Event>,
        channels: Arc<Channels>,
        shutdown: Arc<AtomicBool>,
        wait: SpinThenPark,
        socket_path: PathBuf,
        started: Instant,
        metrics: Arc<Metrics>,
    ) -> Serve {
        let sessions = (0..region.layout().channel_count).map(|_| None).collect();
        let waits = Waits::new(region.layout().channel_count);
        Serve {
            region,
            store,
            events,
            channels,
            shutdown,
            wait,
            socket_path,
            started,
            sessions,
            counters: ServeStats::default(),
            metrics: MetricsWriter::new(metrics),
            rate: RateWindow::default(),
            stats_waiting: Vec::new(),
            req: [TensorBlockDescriptor::default(); BATCH],
            out: Vec::with_capacity(BATCH),
            waits,
            wait_state: WaitState::new(),
            remote: None,
            full_checks: false,
            stuck_timeout: None,
            handed_over: false,
        }
    }

    /// Takes up the sessions, parked WAITs and counters of the daemon taken
    /// over (`crate::takeover`); `streams` are the channels' connections.
    /// A session whose connection did not come along is closed.
    pub(crate) fn restore(
        mut self,
        channels: Vec<ChannelState>,
        waits: Vec<ParkedWait>,
        counters: ServeStats,
        streams: &HashMap<u32, Arc<UnixStream>>,
    ) -> Serve {
        let frames = |v: Vec<Vec<u8>>| -> Vec<TensorBlockDescriptor> {
            v.iter()
                .filter_map(|b| <&[u8; 64]>::try_from(b.as_slice()).ok().map(TensorBlockDescriptor::from_bytes))
                .collect()
        };
        self.counters = counters;
        for c in channels {
            let (Some(slot), Some(stream), Some((sub, comp))) = (
                self.sessions.get_mut(c.channel as usize),
                streams.get(&c.channel),
                self.region.daemon_channel(c.channel),
            ) else {
                self.store.close_session(c.session);
                continue;
            };
            self.store.set_session_uid(c.session, c.uid);
            *slot = Some(Session {
                session: c.session,
                sub,
                comp,
                stream: stream.clone(),
                pid: c.pid,
                uid: c.uid,
                backlog: frames(c.backlog),
                kicked: c.kicked,
                waiting: c.waiting,
                held: frames(c.held),
                fetch: None,
                remote_asked: c.remote_asked,
                stuck_since: None,
            });
        }
        let now = Instant::now();
        for w in waits {
            if self.sessions.get(w.channel as usize).is_some_and(Option::is_some) {
                let deadline = w.left_ms.map(|ms| now + Duration::from_millis(ms));
                self.waits.park(w.channel, Waiter { key: w.key, request_id: w.request_id, deadline });
            }
        }
        self
    }

    /// Stops for a takeover: stops the remote tier (dropping its session),
    /// ends remote fetches channels are parked on, sends the serialized
    /// state on `state` and waits for `outcome`. Resumes (restarting the
    /// tier) unless told to stop for good.
    fn hand_over(&mut self, state: Sender<Result<Vec<u8>, String>>, outcome: Receiver<bool>) {
        self.metrics.set_health(Health::HandingOver);
        let stopped = self.remote.take().map(|r| {
            let tier = r.tier.stop();
            self.store.close_session(r.session);
            (tier, r.next_fetch)
        });
        for s in self.sessions.iter_mut().flatten() {
            if s.fetch.is_some() {
                unpark_fetch(s);
            }
        }
        let bytes = crate::takeover::encode(&self.state());
        let ok = bytes.is_ok();
        let _ = state.send(bytes);
        if ok && outcome.recv().unwrap_or(false) {
            self.handed_over = true;
            self.metrics.set_health(Health::HandedOver);
            return;
        }
        tracing::info!("takeover did not happen; serving on");
        self.metrics.set_health(Health::Serving);
        if let Some((tier, next_fetch)) = stopped {
            match tier.start() {
                Ok(tier) => {
                    self.remote = Some(RemoteSide {
                        tier,
                        session: self.store.open_internal_session(),
                        next_fetch,
                        pending: HashMap::new(),
                        work: VecDeque::new(),
                    })
                }
                Err(e) => tracing::error!("the remote tier did not restart after a failed takeover: {e}"),
            }
        }
    }

    /// The serve loop's state for a takeover.
    fn state(&self) -> ServeState<&Store> {
        let frames = |v: &[TensorBlockDescriptor]| v.iter().map(|d| d.as_bytes().to_vec()).collect();
        let now = Instant::now();
        ServeState {
            region_generation: self.region.generation(),
            store: &self.store,
            channels: self
                .sessions
                .iter()
                .enumerate()
                .filter_map(|(ch, s)| {
                    let s = s.as_ref()?;
                    Some(ChannelState {
                        channel: ch as u32,
                        session: s.session,
                        pid: s.pid,
                        uid: s.uid,
                        backlog: frames(&s.backlog),
                        held: frames(&s.held),
                        waiting: s.waiting,
                        kicked: s.kicked,
                        remote_asked: s.remote_asked.clone(),
                    })
                })
                .collect(),
            waits: self
                .waits
                .parked()
                .map(|(channel, w)| ParkedWait {
                    channel,
                    key: w.key,
                    request_id: w.request_id,
                    left_ms: w.deadline.map(|d| d.saturating_duration_since(now).as_millis() as u64),
                })
                .collect(),
            counters: self.counters.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
        }
    }

    /// Serves with the remote tier `tier` behind the store (a session of
    /// its own holds its pins and reservations).
    pub(crate) fn with_remote(mut self, tier: Option<RemoteTier>) -> Serve {
        self.remote = tier.map(|tier| RemoteSide {
            tier,
            session: self.store.open_internal_session(),
            next_fetch: 0,
            pending: HashMap::new(),
            work: VecDeque::new(),
        });
        self
    }

    /// Disconnects clients that leave their completion ring full for longer
    /// than `timeout` (see `stuck_timeout`).
    pub(crate) fn with_stuck_client_timeout(mut self, timeout: Option<Duration>) -> Serve {
        self.stuck_timeout = timeout;
        self
    }

    /// When the first blocked channel's client passes the stuck timeout.
    fn next_stuck_deadline(&self) -> Option<Instant> {
        let timeout = self.stuck_timeout?;
        self.sessions.iter().flatten().filter_map(|s| s.stuck_since).min().and_then(|t| t.checked_add(timeout))
    }

    /// Notes which channels are blocked, and disconnects the clients blocked
    /// for longer than the stuck timeout (their socket's EOF brings the
    /// Detach that drops their pins and reservations); whether any was.
    fn kick_stuck(&mut self) -> bool {
        let Some(timeout) = self.stuck_timeout else { return false };
        let now = Instant::now();
        let mut kicked = false;
        for s in self.sessions.iter_mut().flatten() {
            s.note_blocked(now);
            if s.stuck_since.is_some_and(|t| now.duration_since(t) >= timeout) {
                tracing::warn!(
                    event = "client_kicked",
                    pid = s.pid,
                    uid = s.uid,
                    "disconnecting a client that left its completion ring full for {timeout:?} (--stuck-client-timeout-ms)"
                );
                self.counters.clients_kicked += 1;
                s.kicked = true;
                s.stuck_since = None;
                let _ = s.stream.shutdown(std::net::Shutdown::Both);
                kicked = true;
            }
        }
        kicked
    }

    /// Whether every stats answer runs the full invariant check (see `full_checks`).
    pub(crate) fn with_full_checks(mut self, on: bool) -> Serve {
        self.full_checks = on;
        self
    }

    /// Serves until the shutdown flag is set, then closes every channel; or
    /// until a new daemon took over (then returns `true`, touching nothing).
    pub(crate) fn run(mut self) -> bool {
        let region = self.region.clone();
        let doorbell = region.doorbell();
        let mut passes: u64 = 0;
        self.metrics.publish_store(&self.store.gauges());
        self.metrics.set_health(Health::Serving);
        while !self.shutdown.load(Ordering::Relaxed) && !self.handed_over {
            if self.pass() {
                passes = passes.wrapping_add(1);
                if passes.is_multiple_of(1024) {
                    self.rate.tick(self.counters.ops);
                }
                continue;
            }
            self.rate.tick(self.counters.ops);
            // Idle: wait by the policy on the doorbell, parking no later than
            // the next WAIT deadline.
            let ops = self.counters.ops;
            let deadline = [self.waits.next_deadline(), self.next_fetch_deadline(), self.next_stuck_deadline()]
                .into_iter()
                .flatten()
                .min();
            let mut policy = self.wait;
            if let Some(d) = deadline {
                policy.park_timeout = policy.park_timeout.min(d.saturating_duration_since(Instant::now()));
            }
            let (events, sessions, rate, shutdown) = (&self.events, &mut self.sessions, &mut self.rate, &self.shutdown);
            let parks = &mut self.counters.parks;
            let woke = policy.wait_adaptive(
                &self.wait_state,
                doorbell,
                // The control thread rings the doorbell after queueing an
                // event, so this looks at the queue too.
                // SYNC POINT: inside `park`, this runs after the SeqCst fence
                // that follows storing PARKED; it pairs with the fence in
                // `notify` after a client's Release publish of `tail` or the
                // control thread's `send`: either this sees the frame or the
                // event, or the notifier sees PARKED and wakes us.
                || match events.try_recv() {
                    Ok(ev) => Some(Wake::Event(ev)),
                    Err(_) => (sessions.iter_mut().flatten().any(Session::has_work)
                        || deadline.is_some_and(|d| Instant::now() >= d))
                    .then_some(Wake::Rings),
                },
                || {
                    rate.tick(ops);
                    if shutdown.load(Ordering::Relaxed) {
                        Tick::Stop(())
                    } else {
                        Tick::Continue
                    }
                },
                || *parks += 1,
            );
            self.metrics.publish_serve(&self.counters);
            match woke {
                Ok(Wake::Event(ev)) => self.on_event(ev),
                Ok(Wake::Rings) => {}
                Err(()) => break,
            }
        }
        if self.handed_over {
            return true;
        }
        self.metrics.set_health(Health::Stopped);
        tracing::info!("shutting down: closing {} client channel(s)", self.sessions.iter().flatten().count());
        for (ch, s) in self.sessions.iter_mut().enumerate() {
            if let Some(s) = s.take() {
                self.region.close_channel(ch as u32);
                s.comp.notify_consumer();
                let _ = s.stream.shutdown(std::net::Shutdown::Both);
            }
        }
        false
    }

    /// Control events, then every channel once; whether anything was done.
    fn pass(&mut self) -> bool {
        let mut did_work = false;
        while let Ok(ev) = self.events.try_recv() {
            did_work = true;
            self.on_event(ev);
            if self.handed_over {
                return true;
            }
        }
        did_work |= self.serve_all();
        if !self.waits.is_empty() {
            did_work |= self.expire_waits();
        }
        if self.remote.as_ref().is_some_and(|r| !r.pending.is_empty()) {
            did_work |= self.expire_fetches();
        }
        did_work |= self.remote_slice();
        did_work |= self.kick_stuck();
        if !self.stats_waiting.is_empty() {
            // Answer stats only after serving every frame published before
            // the request (e.g. a fire-and-forget RELEASE), so a client that
            // releases and then asks sees its release counted.
            for _ in 0..256 {
                if !self.serve_all() {
                    break;
                }
            }
            let stats = self.stats();
            for tx in self.stats_waiting.drain(..) {
                let _ = tx.send(stats.clone());
            }
        }
        if did_work {
            // Events (sessions closed, clients kicked) change gauges outside batches.
            self.metrics.publish_store(&self.store.gauges());
            self.metrics.publish_serve(&self.counters);
        }
        did_work
    }

    fn serve_all(&mut self) -> bool {
        serve_all(
            &mut self.store,
            &mut self.sessions,
            &mut self.req,
            &mut self.out,
            &mut self.counters,
            &mut self.metrics,
            &mut self.waits,
            &mut self.remote,
        )
    }

    /// The earliest time the serve loop stops waiting for a remote fetch.
    fn next_fetch_deadline(&self) -> Option<Instant> {
        self.remote.as_ref()?.pending.values().map(|&(_, d)| d).min()
    }

    /// Unparks the channels whose remote fetch never came back in time (their
    /// held frames are then answered from what is local); whether any.
    fn expire_fetches(&mut self) -> bool {
        let Some(r) = self.remote.as_mut() else { return false };
        let now = Instant::now();
        let expired: Vec<u64> = r.pending.iter().filter(|(_, &(_, d))| d <= now).map(|(&id, _)| id).collect();
        for id in &expired {
            if let Some((ch, _)) = r.pending.remove(id) {
                if let Some(s) = self.sessions.get_mut(ch as usize).and_then(Option::as_mut) {
                    if s.fetch.as_ref().is_some_and(|f| f.id == *id) {
                        unpark_fetch(s);
                    }
                }
            }
        }
        !expired.is_empty()
    }

    /// What the remote tier's workers report. A write's pin is dropped at
    /// once; reservations and commits of a fill are queued and done
    /// [`REMOTE_SLICE`] blocks per pass ([`remote_slice`](Self::remote_slice)).
    fn on_remote(&mut self, ev: RemoteEvent) {
        let Some(r) = self.remote.as_mut() else { return };
        match ev {
            RemoteEvent::Written { pin } => {
                self.store.handle_internal(r.session, &Request::Release { handle: pin });
            }
            RemoteEvent::Reserve { fetch: _, blocks, reply } => {
                let answers = Vec::with_capacity(blocks.len());
                r.work.push_back(RemoteWork::Reserve { blocks, answers, reply });
            }
            RemoteEvent::Filled { fetch, filled } => {
                r.work.push_back(RemoteWork::Commit { fetch, filled, next: 0, committed: Vec::new() });
            }
        }
    }

    /// Does up to [`REMOTE_SLICE`] blocks of the queued fill work (and
    /// finishes the piece of work they end); whether any was done.
    fn remote_slice(&mut self) -> bool {
        let Some(r) = self.remote.as_mut() else { return false };
        let mut budget = REMOTE_SLICE;
        let mut did = false;
        while budget > 0 {
            let Some(work) = r.work.pop_front() else { break };
            did = true;
            match work {
                RemoteWork::Reserve { blocks, mut answers, reply } => {
                    let from = answers.len();
                    let to = blocks.len().min(from + budget);
                    budget -= to - from;
                    for b in &blocks[from..to] {
                        // Committed by a client meanwhile: that block stands.
                        let answer = if self.store.peek(b.key).is_some() {
                            None
                        } else {
                            let c = self.store.handle_internal(
                                r.session,
                                &Request::Reserve {
                                    key: b.key,
                                    dtype: b.dtype,
                                    shape: b.shape,
                                    len: b.len,
                                    page_offset: 0,
                                },
                            );
                            (c.status == Status::Ok).then_some(Reserved { handle: c.handle, data_offset: c.offset })
                        };
                        answers.push(answer);
                    }
                    if answers.len() < blocks.len() {
                        r.work.push_front(RemoteWork::Reserve { blocks, answers, reply });
                        break;
                    }
                    if let Err(answers) = reply.send(answers) {
                        for a in answers.into_iter().flatten() {
                            self.store.handle_internal(r.session, &Request::Abort { handle: a.handle });
                        }
                    }
                }
                RemoteWork::Commit { fetch, filled, mut next, mut committed } => {
                    let cells = &self.metrics.metrics().remote;
                    let to = filled.len().min(next + budget);
                    budget -= to - next;
                    for &(handle, len) in &filled[next..to] {
                        let key = self.store.reservation_key(r.session, handle);
                        // Committed by a client while the fill ran: that block is newer
                        // (and may have chain links); the fill's copy is dropped.
                        if key.is_some_and(|k| self.store.peek(k).is_some()) {
                            self.store.handle_internal(r.session, &Request::Abort { handle });
                            continue;
                        }
                        if self.store.handle_internal(r.session, &Request::Commit { handle, parent: None }).status
                            == Status::Ok
                        {
                            RemoteCells::add(&cells.fills, 1);
                            RemoteCells::add(&cells.fill_bytes, len);
                            committed.extend(key);
                        }
                    }
                    next = to;
                    if next < filled.len() {
                        r.work.push_front(RemoteWork::Commit { fetch, filled, next, committed });
                        break;
                    }
                    // Every block of the fetch is in: serve its channel's frames again.
                    if let Some((ch, _)) = r.pending.remove(&fetch) {
                        if let Some(s) = self.sessions.get_mut(ch as usize).and_then(Option::as_mut) {
                            if s.fetch.as_ref().is_some_and(|f| f.id == fetch) {
                                let started = unpark_fetch(s);
                                if !committed.is_empty() {
                                    self.metrics.remote_fill(started.elapsed().as_micros() as u64);
                                }
                            }
                        }
                    }
                    if !committed.is_empty() && !self.waits.is_empty() {
                        wake_waits(
                            &mut self.store,
                            &mut self.sessions,
                            &mut self.waits,
                            &mut committed,
                            &mut self.counters,
                        );
                    }
                    // An empty fetch still takes a turn: at most one per block of budget.
                    budget = budget.saturating_sub(1);
                }
            }
        }
        did
    }

    /// Answers `TIMED_OUT` to the WAITs whose deadline passed; whether any.
    fn expire_waits(&mut self) -> bool {
        let expired = self.waits.take_expired(Instant::now());
        for &(ch, w) in &expired {
            let Some(s) = self.sessions.get_mut(ch as usize).and_then(Option::as_mut) else { continue };
            let c = Completion {
                request_id: w.request_id,
                op: Op::Wait,
                status: Status::TimedOut,
                handle: 0,
                offset: 0,
                tensor: None,
            };
            answer_wait(s, c, &mut self.counters);
        }
        !expired.is_empty()
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Attach { channel, stream, pid, uid } => {
                let Some(slot) = self.sessions.get_mut(channel as usize) else { return };
                let Some((sub, comp)) = self.region.daemon_channel(channel) else { return };
                let session = self.store.open_session();
                self.store.set_session_uid(session, uid);
                *slot = Some(Session {
                    session,
                    sub,
                    comp,
                    stream,
                    pid,
                    uid,
                    backlog: Vec::new(),
                    kicked: false,
                    waiting: false,
                    held: Vec::new(),
                    fetch: None,
                    remote_asked: HashSet::new(),
                    stuck_since: None,
                });
                self.counters.clients_connected += 1;
                self.counters.clients_total += 1;
            }
            Event::Detach { channel, closed_by_daemon } => {
                if let Some(s) = self.sessions.get_mut(channel as usize).and_then(Option::take) {
                    self.waits.remove_channel(channel);
                    self.store.close_session(s.session);
                    self.counters.clients_connected = self.counters.clients_connected.saturating_sub(1);
                    let (kicked, pid) = (s.kicked, s.pid);
                    drop(s);
                    self.region.reset_channel(channel);
                    if kicked || closed_by_daemon {
                        // Its process may still write the rings: not for a new client yet.
                        self.channels.quarantine(channel, pid);
                    } else {
                        self.channels.put_back(channel);
                    }
                }
            }
            Event::Stats(reply) => self.stats_waiting.push(reply),
            Event::Remote(ev) => self.on_remote(ev),
            Event::Takeover { state, outcome } => {
                self.hand_over(state, outcome);
                if self.handed_over {
                    return;
                }
            }
        }
        // Sessions opened and closed change the gauges outside any batch.
        self.metrics.publish_store(&self.store.gauges());
        self.metrics.publish_serve(&self.counters);
    }

    fn stats(&self) -> Stats {
        let l = self.region.layout();
        self.channels.release_exited();
        let store = self.store.stats();
        let invariants_ok = if self.full_checks {
            self.store.check_invariants().is_ok()
        } else {
            self.store.check_counters(&store).is_ok()
        };
        Stats {
            store,
            serve: self.counters.clone(),
            remote: self.metrics.metrics().remote_stats(),
            ops_per_s: self.rate.per_second(),
            region_bytes: l.region_len,
            slab_bytes: l.slab_len,
            channels: l.channel_count,
            ring_capacity: l.ring_capacity,
            uptime_s: self.started.elapsed().as_secs_f64(),
            daemon_pid: std::process::id(),
            socket: self.socket_path.display().to_string(),
            invariants_ok,
            invariants_full: self.full_checks,
            channels_quarantined: self.channels.quarantined() as u64,
        }
    }
}

/// One pass over every live channel; whether any frame was served.
#[allow(clippy::too_many_arguments)] // the serve loop's parts
fn serve_all(
    store: &mut Store,
    sessions: &mut [Option<Session>],
    req: &mut [TensorBlockDescriptor; BATCH],
    out: &mut Vec<TensorBlockDescriptor>,
    counters: &mut ServeStats,
    metrics: &mut MetricsWriter,
    waits: &mut Waits,
    remote: &mut Option<RemoteSide>,
) -> bool {
    let mut did_work = false;
    let mut committed = Vec::new();
    for ch in 0..sessions.len() {
        let Some(s) = sessions[ch].as_mut() else { continue };
        if s.kicked {
            continue;
        }
        let served = serve_channel(store, s, ch as u32, req, out, counters, metrics, waits, remote, &mut committed);
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
fn wake_waits(
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

/// Ends the remote fetch `s` is parked on: its held frames are served again
/// from the next pass on, answering the keys it asked for from what is local
/// now. When it started.
fn unpark_fetch(s: &mut Session) -> Instant {
    s.waiting = false;
    match s.fetch.take() {
        Some(f) => {
            s.remote_asked.extend(f.keys);
            f.started
        }
        None => Instant::now(),
    }
}

/// Sends the completion of the parked WAIT of `s`; its held frames are served
/// from the next pass on.
fn answer_wait(s: &mut Session, c: Completion, counters: &mut ServeStats) {
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

/// Handles what one channel has, bounded by room in its completion ring.
/// A WAIT for an absent key parks (in `waits`; the frames after it are held),
/// and the keys of the COMMITs served are added to `committed` while any WAIT
/// is parked. With a remote tier, each block committed is queued for writing,
/// and a GET or LOOKUP that misses locally parks the channel the same way
/// while the remote tier fetches the batch's local-miss tail.
#[allow(clippy::too_many_arguments)] // the serve loop's parts
fn serve_channel(
    store: &mut Store,
    s: &mut Session,
    channel: u32,
    req: &mut [TensorBlockDescriptor; BATCH],
    out: &mut Vec<TensorBlockDescriptor>,
    counters: &mut ServeStats,
    metrics: &mut MetricsWriter,
    waits: &mut Waits,
    remote: &mut Option<RemoteSide>,
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
    let n = if !from_held {
        s.sub.pop_batch(&mut req[..room])?
    } else {
        let k = s.held.len().min(room);
        req[..k].copy_from_slice(&s.held[..k]);
        s.held.drain(..k);
        k
    };
    if n == 0 {
        return Ok(0);
    }
    out.clear();
    let timer = metrics.batch_start();
    for (i, frame) in req[..n].iter().enumerate() {
        counters.ops += 1;
        let c = match Request::decode(frame) {
            Ok(r @ (Request::Commit { handle, .. } | Request::CommitPin { handle, .. }))
                if !waits.is_empty() || remote.is_some() =>
            {
                let key = store.reservation_key(s.session, handle);
                let c = store.handle(s.session, frame.request_id, &r);
                if let (Some(key), Status::Ok) = (key, c.status) {
                    if !waits.is_empty() {
                        committed.push(key);
                    }
                    if let Some(tier) = remote.as_mut() {
                        tier.queue_write(store, key);
                    }
                }
                c
            }
            Ok(r @ (Request::Get { key } | Request::Lookup { key }))
                if remote.is_some() && !s.remote_asked.contains(&key) && store.peek(key).is_none() =>
            {
                // A local miss: ask the remote tier for it and for every
                // other local miss of this batch after it (a chain's tail,
                // read in one round), and serve this frame and the rest of
                // the batch again once the fill is in.
                let mut keys = vec![key];
                for f in &req[i + 1..n] {
                    if let Ok(Request::Get { key: k } | Request::Lookup { key: k }) = Request::decode(f) {
                        if !s.remote_asked.contains(&k) && store.peek(k).is_none() && !keys.contains(&k) {
                            keys.push(k);
                        }
                    }
                }
                if let Some(rs) = remote.as_mut() {
                    let id = rs.start_fetch(channel, keys.clone());
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
                        let rest = &req[i + 1..n];
                        s.held.splice(0..0, rest.iter().copied());
                        metrics.frame(frame.op, c.status);
                        break;
                    }
                } else {
                    c
                }
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
        out.push(c.encode());
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
        s.remote_asked.clear();
    }
    if s.comp.notify_consumer() {
        counters.wakeups_sent += 1;
    }
    Ok(n)
}

/// Ops per second over the last whole second.
#[derive(Debug, Default)]
struct RateWindow {
    window_start: Option<Instant>,
    ops_at_start: u64,
    last_rate: f64,
    last_at: Option<Instant>,
}

impl RateWindow {
    fn tick(&mut self, ops: u64) {
        let now = Instant::now();
        let start = *self.window_start.get_or_insert(now);
        let dt = now.duration_since(start);
        if dt >= Duration::from_secs(1) {
            self.last_rate = (ops - self.ops_at_start) as f64 / dt.as_secs_f64();
            self.last_at = Some(now);
            self.window_start = Some(now);
            self.ops_at_start = ops;
        }
    }
    fn per_second(&self) -> f64 {
        match self.last_at {
            Some(t) if t.elapsed() < Duration::from_secs(3) => self.last_rate,
            _ => 0.0,
        }
    }
}
