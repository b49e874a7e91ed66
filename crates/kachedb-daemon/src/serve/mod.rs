//! The serve loop: one thread serves every channel.
//!
//! Each pass handles the control [`Event`]s queued (up to
//! [`EVENTS_PER_PASS`]), then pops a batch of
//! submissions from each ring that has work (as many as the client's
//! completion ring has room for), answers them from the [`Store`], publishes
//! the completions once per batch and wakes the client only if it parked;
//! then it does one slice of the tiers' queued fill work (reservations and
//! commits, [`tiers::TIER_SLICE`] blocks), so a long fill never holds the
//! rings. With no work it waits by the daemon's [`SpinThenPark`] policy on the
//! region doorbell, which the clients ring after publishing and the control
//! thread after queueing an event (idle CPU ~0 %). The first idle wait after a
//! client's frames woke it from a park polls through the policy's wake window
//! (1 ms by default) before parking again: a burst after idle then pays one
//! wake-up, not one per request.
//!
//! This file is the loop and its events; the rest, by what they hold:
//! * [`session`] — one channel's session and the serving of its requests;
//! * [`tiers`] — the tier side: write-behind, fills, their slices;
//! * [`handover`] — the state a takeover carries, saved and restored;
//! * [`denials`] — the log of the COMMITs and DELETEs answered `DENIED`.

mod denials;
mod handover;
mod session;
mod tiers;

use crate::channels::Channels;
use crate::events::Event;
use crate::metrics::{Health, Metrics, MetricsWriter};
use crate::store::Store;
use crate::waits::Waits;
use kachedb_shm::control::{ServeStats, DEFAULT_TENANT, MAX_TENANTS, OTHER_TENANT};
use kachedb_shm::{Completion, Op, Region, SpinThenPark, Stats, Status, TensorBlockDescriptor, Tick, WaitState};
use session::{answer_wait, removal_done, unpark_fetch, wake_waits, Session};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tiers::{FetchDone, Resolved, Tiers};

/// Frames handled per channel per pass (bounds latency for the others).
const BATCH: usize = 64;

/// The per-tenant metrics are published every this many busy passes, and
/// whenever the loop goes idle (each publish costs two sketch estimates and
/// a dozen stores per tenant that changed: too much for every batch of a
/// latency-bound client).
const TENANT_PUBLISH_PASSES: u64 = 64;
/// Most control and tier events a pass handles before it serves the rings.
const EVENTS_PER_PASS: usize = 16;

/// How soon an idle serve loop looks again for room in the KV event
/// publisher's queue when a snapshot waits for it.
const EVENTS_RETRY: Duration = Duration::from_millis(10);

/// How long a request window runs by default (`kachedb serve --request-window`).
pub const DEFAULT_REQUEST_WINDOW: Duration = Duration::from_secs(300);

/// What woke an idle serve loop.
enum Wake {
    /// The oldest queued control event (the rest wait for the next pass).
    Event(Event),
    /// Frames or completions waiting on a channel.
    Rings,
    /// The deadline of a parked WAIT, a fetch or a stuck client passed.
    Deadline,
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
    /// The frames of the channel being served (at most [`BATCH`], and the
    /// rest of a reservation unit they end in).
    req: Vec<TensorBlockDescriptor>,
    out: Vec<TensorBlockDescriptor>,
    /// Parked WAITs.
    waits: Waits,
    /// The spin budget learnt from the idle waits (yield at once when clients
    /// share the daemon's core).
    wait_state: WaitState,
    /// Whether the last idle wait parked and was woken by a client's frames:
    /// the next idle wait polls through the policy's wake window before it
    /// parks, since the client's next request of a burst after idle comes only
    /// once its own first answer has run its cold path.
    woken_by_client: bool,
    /// The tiers behind the megaslab (`crate::tier`), if any.
    tiers: Tiers,
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
    /// How long a request window runs (`kachedb serve --request-window`).
    window: Duration,
    /// When the current request window started.
    window_started: Instant,
    /// The KV event publisher's queue, if it runs (`crate::kv_events`):
    /// the store's index changes go there after each pass.
    kv_events: Option<crate::kv_events::EventSink>,
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
            req: Vec::with_capacity(BATCH),
            out: Vec::with_capacity(BATCH),
            waits,
            wait_state: WaitState::new(),
            woken_by_client: false,
            tiers: Tiers::default(),
            full_checks: false,
            stuck_timeout: None,
            handed_over: false,
            window: DEFAULT_REQUEST_WINDOW,
            window_started: Instant::now(),
            kv_events: None,
        }
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

    /// Restarts the request window every `window` (see `window`).
    pub(crate) fn with_request_window(mut self, window: Duration) -> Serve {
        self.window = window.max(Duration::from_secs(1));
        self
    }

    /// Starts a new request window if the current one has run its length
    /// (checked once a second at most, with the ops rate).
    fn roll_window(&mut self) {
        if self.window_started.elapsed() >= self.window {
            self.store.restart_window();
            self.window_started = Instant::now();
        }
    }

    /// Queues the store's index changes on `sink` after each pass (`kv_events`).
    pub(crate) fn with_kv_events(mut self, sink: Option<crate::kv_events::EventSink>) -> Serve {
        self.kv_events = sink;
        self.flush_kv_events();
        self
    }

    /// Queues the index changes of the pass for the KV event publisher.
    fn flush_kv_events(&mut self) {
        if let Some(sink) = &mut self.kv_events {
            sink.flush(&mut self.store);
        }
    }

    /// Whether every stats answer runs the full invariant check (see `full_checks`).
    pub(crate) fn with_full_checks(mut self, on: bool) -> Serve {
        self.full_checks = on;
        self
    }

    /// Serves with `tiers` behind the store, in order (`crate::tier`).
    pub(crate) fn with_tiers(mut self, tiers: Vec<Box<dyn crate::tier::Tier>>) -> Serve {
        self.tiers = Tiers::new(tiers, &mut self.store);
        // The daemon serves from here on (a takeover's tiers were held).
        self.tiers.release();
        self
    }

    /// Serves until the shutdown flag is set, then closes every channel; or
    /// until a new daemon took over (then returns `true`, touching nothing).
    pub(crate) fn run(mut self) -> bool {
        let region = self.region.clone();
        let doorbell = region.doorbell();
        let mut passes: u64 = 0;
        self.metrics.publish_store(&self.store.gauges());
        self.metrics.tenants_renamed(&self.store);
        self.metrics.publish_tenants(&mut self.store);
        self.metrics.set_health(Health::Serving);
        while !self.shutdown.load(Ordering::Relaxed) && !self.handed_over {
            if self.pass() {
                passes = passes.wrapping_add(1);
                if passes.is_multiple_of(TENANT_PUBLISH_PASSES) {
                    self.metrics.publish_tenants(&mut self.store);
                }
                if passes.is_multiple_of(1024) {
                    self.rate.tick(self.counters.ops);
                    self.roll_window();
                }
                continue;
            }
            self.rate.tick(self.counters.ops);
            self.roll_window();
            self.metrics.publish_tenants(&mut self.store);
            // Idle: wait by the policy on the doorbell, parking no later than
            // the next WAIT deadline.
            let ops = self.counters.ops;
            // A snapshot for the KV event publisher waits for room in its queue: look again soon.
            let events_retry =
                self.kv_events.as_ref().filter(|s| s.snapshot_due()).map(|_| Instant::now() + EVENTS_RETRY);
            let deadline = [
                self.waits.next_deadline(),
                self.tiers.next_fetch_deadline(),
                self.next_stuck_deadline(),
                events_retry,
            ]
            .into_iter()
            .flatten()
            .min();
            let mut policy = if self.woken_by_client { self.wait.in_wake_window() } else { self.wait };
            let parks_before = self.counters.parks;
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
                    Err(_) if sessions.iter_mut().flatten().any(Session::has_work) => Some(Wake::Rings),
                    Err(_) => deadline.is_some_and(|d| Instant::now() >= d).then_some(Wake::Deadline),
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
            self.woken_by_client = matches!(woke, Ok(Wake::Rings)) && self.counters.parks != parks_before;
            match woke {
                Ok(Wake::Event(ev)) => self.on_event(ev),
                Ok(Wake::Rings | Wake::Deadline) => {}
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
        // A bounded number per pass: a tier reports a batch of writes at once
        // (one event each), and the rings are served between the slices.
        for _ in 0..EVENTS_PER_PASS {
            let Ok(ev) = self.events.try_recv() else { break };
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
        if self.tiers.fetching() {
            did_work |= self.expire_fetches();
        }
        did_work |= self.tier_slice();
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
        self.flush_kv_events();
        if did_work {
            // Events (sessions closed, clients kicked) change gauges outside batches.
            self.metrics.publish_store(&self.store.gauges());
            self.metrics.publish_serve(&self.counters);
        }
        did_work
    }

    fn serve_all(&mut self) -> bool {
        session::serve_all(
            &self.region,
            &mut self.store,
            &mut self.sessions,
            &mut self.req,
            &mut self.out,
            &mut self.counters,
            &mut self.metrics,
            &mut self.waits,
            &mut self.tiers,
        )
    }

    /// Unparks the channels whose fetch never came back in time (their held
    /// frames are then answered from what is local), and answers those whose
    /// removals were not confirmed in time (`NOT_DURABLE`); whether any.
    fn expire_fetches(&mut self) -> bool {
        let now = Instant::now();
        let expired = self.tiers.expire(now);
        let removals = self.tiers.expire_removals(now);
        let any = !expired.is_empty() || !removals.is_empty();
        self.fetches_done(expired);
        self.removals_done(removals);
        any
    }

    /// Removals that held answers waited for are over: a channel none of
    /// whose held answers waits any more gets them.
    fn removals_done(&mut self, done: Vec<Resolved>) {
        for r in done {
            if let Some(s) = self.sessions.get_mut(r.channel as usize).and_then(Option::as_mut) {
                removal_done(&mut self.store, s, r, &mut self.counters);
            }
        }
    }

    /// Does a slice of the tiers' fill work and serves the channels of the
    /// fetches it completes; whether any work was done.
    fn tier_slice(&mut self) -> bool {
        let mut done = Vec::new();
        let did = self.tiers.slice(&mut self.store, &mut done);
        self.fetches_done(done);
        did
    }

    /// Unparks the channels of fetches that are over (their held frames are
    /// served again from the next pass on) and answers the WAITs on the keys
    /// they committed.
    fn fetches_done(&mut self, done: Vec<FetchDone>) {
        for FetchDone { fetch, tier, channel, mut committed } in done {
            let s = channel.and_then(|ch| self.sessions.get_mut(ch as usize)).and_then(Option::as_mut);
            if let Some(s) = s.filter(|s| s.fetch.as_ref().is_some_and(|f| f.id == fetch)) {
                let started = unpark_fetch(s);
                if !committed.is_empty() {
                    self.tiers.filled_after(tier, started.elapsed().as_micros() as u64);
                }
            }
            if !committed.is_empty() && !self.waits.is_empty() {
                wake_waits(&mut self.store, &mut self.sessions, &mut self.waits, &mut committed, &mut self.counters);
            }
        }
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
            Event::Attach { channel, stream, pid, uid, tenant } => {
                let Some(slot) = self.sessions.get_mut(channel as usize) else { return };
                let Some((sub, comp)) = self.region.daemon_channel(channel) else { return };
                let session = self.store.open_session();
                self.store.set_session_uid(session, uid);
                let named = tenant.as_deref().unwrap_or(DEFAULT_TENANT);
                let counted_as = self.store.set_session_tenant(session, named);
                if counted_as != named && counted_as == OTHER_TENANT {
                    tracing::warn!(
                        event = "tenant_folded",
                        pid,
                        tenant = named,
                        "tenant {named:?} is counted as {OTHER_TENANT:?}: the daemon already counts {MAX_TENANTS} tenants"
                    );
                }
                self.metrics.tenants_renamed(&self.store);
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
                    tier_asked: HashSet::new(),
                    stuck_since: None,
                    held_answers: Vec::new(),
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
            Event::Tier { tier, event } => {
                if let Some(r) = self.tiers.on_event(&mut self.store, tier, event) {
                    self.removals_done(vec![r]);
                }
            }
            Event::Takeover { state, outcome } => {
                self.hand_over(state, outcome);
                if self.handed_over {
                    return;
                }
            }
        }
        // Sessions opened and closed change the gauges outside any batch.
        self.metrics.publish_store(&self.store.gauges());
        self.metrics.publish_tenants(&mut self.store);
        self.metrics.publish_serve(&self.counters);
    }

    fn stats(&self) -> Stats {
        let l = self.region.layout();
        self.channels.release_exited();
        let mut store = self.store.stats();
        store.window_s = self.window_started.elapsed().as_secs_f64();
        let invariants_ok = if self.full_checks {
            self.store.check_invariants().is_ok()
        } else {
            self.store.check_counters(&store).is_ok()
        };
        let mut stats = Stats {
            store,
            serve: self.counters.clone(),
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
            tenants: self.store.tenant_stats(),
            ..Stats::default()
        };
        self.metrics.metrics().tier_stats(&mut stats);
        stats
    }
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
