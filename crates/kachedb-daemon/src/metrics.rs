//! Prometheus metrics: what the serve loop and the control thread count, kept
//! in atomics that a scrape ([`crate::http`]) reads without touching the store
//! or waiting for the serve loop.
//!
//! # Who writes what
//!
//! * The serve loop owns the one [`MetricsWriter`]: operations by op and
//!   status, the store's gauges and byte counters (copied from
//!   [`Store::gauges`](crate::store::Store::gauges), `O(1)`), the serve loop's
//!   counters, the latency and batch-size histograms. It is their only writer,
//!   so an update is a relaxed load and a relaxed store ([`Cell`]): no locked
//!   instruction, the cost of a plain `+= 1` on a line the serve thread owns,
//!   plus one cache-line transfer after a scrape has read it (50 scrapes a
//!   second: nothing).
//! * The control thread counts refused clients ([`Metrics::client_refused`],
//!   `fetch_add`: a slow path).
//! * The daemon's [`Health`] (what `/healthz` answers) is set by the serve
//!   loop as it starts, hands over and stops, and by a daemon that took over
//!   before its metrics endpoint starts.
//! * A scrape loads every value relaxed and encodes the text with
//!   `prometheus-client`'s [`Collector`]. Each value is exact as of a recent
//!   moment; a scrape is not a snapshot across values (one counter may be a
//!   batch ahead of another), which `rate()` and dashboards tolerate.
//!   A histogram's `_count` is the sum of its buckets as loaded, so it always
//!   equals its `+Inf` bucket.
//!
//! # Freshness
//!
//! The serve loop publishes the store's gauges after handling each batch and
//! *before* pushing its completions: a client that has seen its completion
//! and then scrapes finds its operation counted. Pass-level counters (parks,
//! wake-ups, clients) are published at the end of each pass that did work and
//! after each park.
//!
//! # Latency
//!
//! `kachedb_op_duration_seconds` is the daemon's service time: from a batch's
//! frames popped to its completions pushed, divided evenly among the batch's
//! frames (exact for a batch of one, the latency-bound case). A clock read
//! costs ~28 ns here (`Instant::now`, vDSO, TSC), two per timed batch, so one
//! batch in [`SAMPLE_MEAN`] on average is timed, chosen by a xorshift
//! countdown (a fixed period could alias with a periodic workload, e.g.
//! RESERVE and COMMIT alternating). Quantiles and the mean (`_sum / _count`)
//! are those of the sample; `kachedb_ops_total` counts every frame.

mod tenants;

use crate::store::{Gauges, Store, TenantId};
use crate::tier::metrics::{Family, Kind, TierMetrics, Values};
use kachedb_shm::control::ServeStats;
use kachedb_shm::control::MAX_TENANTS;
use kachedb_shm::{Op, Status, TensorBlockDescriptor};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Op and status codes are below this; op code 0 (never an op) counts the
/// frames whose op code the decoder does not know.
const CODES: usize = 16;
const OPS: usize = CODES;
const STATUSES: usize = CODES;
const _: () = assert!(Op::ALL.len() < CODES && Status::ALL.len() <= CODES);
const GET: usize = Op::Get as usize;
const LOOKUP: usize = Op::Lookup as usize;

/// `NotFound` -> `not_found`.
fn snake_case(camel: &str) -> String {
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, ch) in camel.chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_lowercase());
    }
    out
}

/// The index of op code `code` in the tables: itself if it names an op, else 0.
#[inline]
fn op_index(code: u8) -> usize {
    match Op::from_code(code) {
        Some(op) if (op as usize) < OPS => op as usize,
        _ => 0,
    }
}

/// Upper bounds of the latency buckets, nanoseconds (service times run from
/// ~50 ns for a LOOKUP to milliseconds for a RESERVE that evicts a lot).
const DURATION_BOUNDS_NS: [u64; 15] = [
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    1_000_000,
    10_000_000,
    100_000_000,
    1_000_000_000,
];
/// Upper bounds of the batch-size buckets, frames (a batch is at most 64).
const BATCH_BOUNDS: [u64; 7] = [1, 2, 4, 8, 16, 32, 64];

/// One in this many batches is timed, on average.
pub const SAMPLE_MEAN: u32 = 8;

/// Why the control thread refused a client (the `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Another user, not admitted by `--allow-gid`.
    Permission = 0,
    /// Every channel was taken.
    ChannelsFull = 1,
    /// A control message it could not accept (bad JSON, wrong version, hello twice, too long).
    Protocol = 2,
    /// A hello naming a tenant the peer may not act as (`crate::binding`).
    Tenant = 3,
}
const REFUSAL_NAMES: [&str; 4] = ["permission", "channels_full", "protocol", "tenant"];

impl Refusal {
    /// The `reason` label value.
    pub fn name(self) -> &'static str {
        REFUSAL_NAMES[self as usize]
    }
}

/// A `u64` with one writer thread: [`add`](Cell::add) is a relaxed load and
/// store, never a locked read-modify-write. Relaxed is enough: the value is
/// read for itself, nothing else is published through it.
#[derive(Debug, Default)]
struct Cell(AtomicU64);

impl Cell {
    #[inline]
    fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }
    #[inline]
    fn set(&self, v: u64) {
        self.0.store(v, Relaxed);
    }
    #[inline]
    fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// A histogram with one writer: per-bucket counts (not cumulative; the last
/// bucket is `+Inf`) and the sum of the observed values, in integer units.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [u64],
    buckets: Box<[Cell]>,
    sum: Cell,
}

impl Histogram {
    fn new(bounds: &'static [u64]) -> Self {
        Self { bounds, buckets: (0..=bounds.len()).map(|_| Cell::default()).collect(), sum: Cell::default() }
    }

    /// Records `n` observations of `value`.
    #[inline]
    fn observe_n(&self, value: u64, n: u64) {
        // Prometheus buckets are `le`: the first bound >= value.
        let i = self.bounds.partition_point(|&b| b < value);
        self.buckets[i].add(n);
        self.sum.add(value.saturating_mul(n));
    }

    /// `(sum, count, [(upper bound, count in this bucket)])`, the bounds and
    /// the sum divided by `per_unit` (1e9: ns -> s; a division, so that
    /// 100 ns is exactly the double nearest 1e-7 and prints as such).
    fn load(&self, per_unit: f64) -> (f64, u64, Vec<(f64, u64)>) {
        let counts: Vec<u64> = self.buckets.iter().map(Cell::get).collect();
        let buckets = self
            .bounds
            .iter()
            .map(|&b| b as f64 / per_unit)
            .chain([f64::INFINITY])
            .zip(counts.iter().copied())
            .collect();
        (self.sum.get() as f64 / per_unit, counts.iter().sum(), buckets)
    }
}

/// The store's gauges and byte counters, as last published.
#[derive(Debug, Default)]
struct StoreCells {
    blocks: Cell,
    bytes_used: Cell,
    bytes_free: Cell,
    bytes_capacity: Cell,
    bytes_evictable: Cell,
    pins: Cell,
    reservations: Cell,
    evictions: Cell,
    evicted_bytes: Cell,
    replaced: Cell,
    stored_bytes: Cell,
    get_hit_bytes: Cell,
    lookup_hit_bytes: Cell,
    reachable_bytes: Cell,
    orphaned_bytes: Cell,
    window_distinct_keys: Cell,
    window_key_requests: Cell,
}

/// One tenant row's figures, as last published (`store/tenants.rs`).
#[derive(Debug, Default)]
struct TenantCells {
    /// The limit plus one (0: none).
    limit_plus_one: Cell,
    clients: Cell,
    bytes: Cell,
    blocks: Cell,
    reachable_bytes: Cell,
    orphaned_bytes: Cell,
    get_hits: Cell,
    get_misses: Cell,
    lookup_hits: Cell,
    lookup_misses: Cell,
    evictions: Cell,
    evicted_bytes: Cell,
    stored_bytes: Cell,
    limit_refusals: Cell,
    window_distinct_keys: Cell,
    window_key_requests: Cell,
}

/// The serve loop's counters, as last published.
#[derive(Debug, Default)]
struct ServeCells {
    rejected_frames: Cell,
    clients_connected: Cell,
    clients_total: Cell,
    clients_kicked: Cell,
    wakeups_sent: Cell,
    parks: Cell,
}

/// What the serve loop writes; on its own cache lines (away from the control
/// thread's counters).
#[derive(Debug)]
#[repr(align(128))]
struct ServeSide {
    /// Frames by op code and status code.
    ops: [[Cell; STATUSES]; OPS],
    store: StoreCells,
    serve: ServeCells,
    /// Service time per frame by op code, nanoseconds (sampled).
    op_ns: [Histogram; OPS],
    /// Frames per batch.
    batch_frames: Histogram,
    /// Per tenant row.
    tenants: Box<[TenantCells]>,
}

/// Where the daemon is in its life, as `/healthz` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Health {
    /// Not serving yet (the serve loop has not started).
    Starting = 0,
    /// The serve loop runs.
    Serving = 1,
    /// A takeover is under way: the old daemon has stopped answering for the
    /// handover (it resumes if the takeover fails), or the new one is about
    /// to start its serve loop. Healthy: clients wait, nothing is lost.
    HandingOver = 2,
    /// A new daemon took over and serves the node; this process exits.
    HandedOver = 3,
    /// The serve loop stopped (shutdown).
    Stopped = 4,
}

impl Health {
    fn from_code(code: u8) -> Health {
        match code {
            1 => Health::Serving,
            2 => Health::HandingOver,
            3 => Health::HandedOver,
            4 => Health::Stopped,
            _ => Health::Starting,
        }
    }

    /// Whether the node serves its cache (now, or again within a takeover):
    /// `/healthz` answers 200.
    pub fn healthy(self) -> bool {
        matches!(self, Health::Serving | Health::HandingOver | Health::HandedOver)
    }
}

/// A tier's cells as [`Metrics`] holds them: as `Any` (to hand back to the
/// tier) and as what a scrape reads.
type Registered = (Arc<dyn Any + Send + Sync>, Arc<dyn TierMetrics>);

/// Every metric of the daemon; shared (`Arc`) by the serve loop's
/// [`MetricsWriter`], the control thread and the HTTP threads.
#[derive(Debug)]
pub struct Metrics {
    serve: ServeSide,
    /// Each tier's cells, in the order the tiers first asked for them
    /// ([`Metrics::tier`]): as `Any` to hand back, and as what a scrape reads.
    tiers: Mutex<Vec<Registered>>,
    /// Clients refused, by [`Refusal`]; written by the control thread.
    refused: [AtomicU64; REFUSAL_NAMES.len()],
    /// A [`Health`] code (for `/healthz`).
    health: AtomicU8,
    channels: u32,
    ring_capacity: u32,
    start_time_s: f64,
    /// Label values of `op` by op code (`unknown` for codes that name none).
    op_names: [String; OPS],
    /// Label values of `status` by status code.
    status_names: [String; STATUSES],
    /// The `tenant` label of each tenant row. Written by the serve loop
    /// when a client brings a new tenant (a slow path), read by scrapes.
    tenant_names: Mutex<tenants::Names>,
}

impl Metrics {
    /// Metrics of a daemon with `channels` channels of `ring_capacity` slots.
    pub fn new(channels: u32, ring_capacity: u32) -> Arc<Metrics> {
        let start_time_s = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        Arc::new(Metrics {
            serve: ServeSide {
                ops: Default::default(),
                store: StoreCells::default(),
                serve: ServeCells::default(),
                op_ns: std::array::from_fn(|_| Histogram::new(&DURATION_BOUNDS_NS)),
                batch_frames: Histogram::new(&BATCH_BOUNDS),
                tenants: (0..MAX_TENANTS).map(|_| TenantCells::default()).collect(),
            },
            tenant_names: Mutex::new(tenants::Names { version: 0, names: vec![String::new(); MAX_TENANTS] }),
            tiers: Mutex::new(Vec::new()),
            refused: Default::default(),
            health: AtomicU8::new(Health::Starting as u8),
            channels,
            ring_capacity,
            start_time_s,
            op_names: std::array::from_fn(|i| match Op::from_code(i as u8) {
                Some(op) => snake_case(&format!("{op:?}")),
                None => "unknown".into(),
            }),
            status_names: std::array::from_fn(|i| match Status::from_code(i as u8) {
                Some(st) => snake_case(&format!("{st:?}")),
                None => format!("code_{i}"),
            }),
        })
    }

    /// The control thread refused a client.
    pub fn client_refused(&self, why: Refusal) {
        self.refused[why as usize].fetch_add(1, Relaxed);
    }

    /// Where the daemon is in its life (`/healthz`).
    pub fn health(&self) -> Health {
        // Relaxed: one value on its own; nothing else is read in its light.
        Health::from_code(self.health.load(Relaxed))
    }

    /// Sets what `/healthz` reports.
    pub fn set_health(&self, h: Health) {
        // Relaxed: see `health`.
        self.health.store(h as u8, Relaxed);
    }

    /// Frames with op `op` answered `status` so far.
    pub fn ops(&self, op: Op, status: Status) -> u64 {
        self.serve.ops[op as usize][status as usize].get()
    }

    /// The cells of the tier kind whose cells are of type `C`: made (and
    /// encoded in every scrape from then on) the first time a tier asks,
    /// the same ones after (a tier resumed after a failed takeover counts on).
    pub fn tier<C: TierMetrics + Default>(&self) -> Arc<C> {
        let mut tiers = self.tiers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = tiers.iter().find_map(|(any, _)| any.clone().downcast::<C>().ok()) {
            return c;
        }
        let c = Arc::new(C::default());
        tiers.push((c.clone(), c.clone()));
        c
    }

    /// Writes every tier's figures into `into` (`kachedb stats`; a tier
    /// that never started leaves its section at its default: off, zeros).
    pub fn tier_stats(&self, into: &mut kachedb_shm::control::Stats) {
        let tiers: Vec<Arc<dyn TierMetrics>> = match self.tiers.lock() {
            Ok(t) => t.iter().map(|(_, t)| t.clone()).collect(),
            Err(_) => return,
        };
        for t in tiers {
            t.fill_stats(into);
        }
    }

    /// A registry holding these metrics (prefix `kachedb_`) for
    /// `prometheus_client::encoding::prometheus_text::encode`; the
    /// per-tenant families come last. [`Exposition`] writes the same text,
    /// faster (what `/metrics` serves).
    pub fn registry(self: &Arc<Self>) -> Registry {
        let mut r = Registry::with_prefix("kachedb");
        r.register_collector(Box::new(Collect(self.clone())));
        r.register_collector(Box::new(tenants::Live(self.clone())));
        r
    }

    /// The Prometheus text exposition (format 0.0.4) of these metrics.
    pub fn render(registry: &Registry) -> String {
        let mut out = String::with_capacity(16 * 1024);
        // Writing to a String cannot fail; an encoder error would be a bug in
        // a label, and the text so far is still worth serving.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, registry);
        out
    }
}

/// The text `/metrics` serves: [`Metrics::render`] of
/// [`Metrics::registry`], written faster. Each per-tenant family's text is
/// kept with the figures it shows and encoded again only when they change
/// (`metrics/tenants.rs`), and the text is written into a buffer sized for
/// the last one.
#[derive(Debug)]
pub struct Exposition {
    metrics: Arc<Metrics>,
    /// Every family but the per-tenant ones.
    rest: Registry,
    tenants: Mutex<tenants::Text>,
    /// The length of the last text, bytes.
    last_len: AtomicUsize,
}

impl Exposition {
    /// The exposition of `metrics`.
    pub fn new(metrics: &Arc<Metrics>) -> Self {
        let mut rest = Registry::with_prefix("kachedb");
        rest.register_collector(Box::new(Collect(metrics.clone())));
        Self {
            metrics: metrics.clone(),
            rest,
            tenants: Mutex::new(tenants::Text::default()),
            last_len: AtomicUsize::new(16 * 1024),
        }
    }

    /// The Prometheus text exposition (format 0.0.4) of the metrics, as of now.
    pub fn render(&self) -> String {
        // Relaxed: a size hint, nothing is read in its light.
        let mut out = String::with_capacity(self.last_len.load(Relaxed) + 4096);
        // Writing to a String cannot fail (see `Metrics::render`).
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.rest);
        let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        tenants.write(&self.metrics, &mut out);
        drop(tenants);
        self.last_len.store(out.len(), Relaxed);
        out
    }
}

/// The serve loop's handle on [`Metrics`]: the only writer of its values (it
/// is not `Clone`, and the serve loop owns the one there is).
#[derive(Debug)]
pub struct MetricsWriter {
    m: Arc<Metrics>,
    /// Batches until the next timed one.
    countdown: u32,
    /// xorshift32 state (never 0).
    rng: u32,
}

impl MetricsWriter {
    /// The writer of `m` (make one per [`Metrics`]).
    pub fn new(m: Arc<Metrics>) -> Self {
        Self { m, countdown: 1, rng: 0x9E37_79B9 }
    }

    /// The metrics written.
    pub fn metrics(&self) -> &Metrics {
        &self.m
    }

    /// Sets what `/healthz` reports.
    pub fn set_health(&self, h: Health) {
        self.m.set_health(h);
    }

    /// One frame of op code `op_code` was answered `status`.
    #[inline]
    pub fn frame(&self, op_code: u8, status: Status) {
        self.m.serve.ops[op_index(op_code)][(status as usize) % STATUSES].add(1);
    }

    /// Call before handling a batch: the start time if this batch is timed.
    #[inline]
    pub fn batch_start(&mut self) -> Option<Instant> {
        self.countdown -= 1;
        if self.countdown > 0 {
            return None;
        }
        // xorshift32: a countdown uniform in 1..=2*SAMPLE_MEAN-1 (mean SAMPLE_MEAN).
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.rng = x;
        self.countdown = 1 + x % (2 * SAMPLE_MEAN - 1);
        Some(Instant::now())
    }

    /// Call after a batch's completions are pushed: records its size and, if
    /// it was timed, each frame's share of its service time under its op.
    #[inline]
    pub fn batch_end(&self, started: Option<Instant>, frames: &[TensorBlockDescriptor]) {
        let s = &self.m.serve;
        s.batch_frames.observe_n(frames.len() as u64, 1);
        let Some(t0) = started else { return };
        if frames.is_empty() {
            return;
        }
        let per_frame_ns = t0.elapsed().as_nanos() as u64 / frames.len() as u64;
        let mut by_op = [0u64; OPS];
        for f in frames {
            by_op[op_index(f.op)] += 1;
        }
        for (op, &n) in by_op.iter().enumerate() {
            if n > 0 {
                s.op_ns[op].observe_n(per_frame_ns, n);
            }
        }
    }

    /// Publishes the store's gauges (`O(1)`, a few stores).
    #[inline]
    pub fn publish_store(&self, g: &Gauges) {
        let c = &self.m.serve.store;
        c.blocks.set(g.blocks);
        c.bytes_used.set(g.bytes_used);
        c.bytes_free.set(g.bytes_free);
        c.bytes_capacity.set(g.bytes_capacity);
        c.bytes_evictable.set(g.bytes_evictable);
        c.pins.set(g.pins);
        c.reservations.set(g.reservations);
        c.evictions.set(g.evictions);
        c.evicted_bytes.set(g.evicted_bytes);
        c.replaced.set(g.replaced);
        c.stored_bytes.set(g.stored_bytes);
        c.get_hit_bytes.set(g.get_hit_bytes);
        c.lookup_hit_bytes.set(g.lookup_hit_bytes);
        c.reachable_bytes.set(g.reachable_bytes);
        c.orphaned_bytes.set(g.orphaned_bytes);
    }

    /// Publishes the figures of the tenant rows that changed since the last
    /// call (usually the one tenant of the batch just served: a dozen
    /// stores), and the request window's totals with them.
    #[inline]
    pub fn publish_tenants(&self, store: &mut Store) {
        let mut dirty = store.take_dirty_tenants();
        if dirty == 0 {
            return;
        }
        let c = &self.m.serve.store;
        let (distinct, requests) = store.window();
        c.window_distinct_keys.set(distinct);
        c.window_key_requests.set(requests);
        while dirty != 0 {
            let t = dirty.trailing_zeros() as usize;
            dirty &= dirty - 1;
            let Some(cells) = self.m.serve.tenants.get(t) else { continue };
            let (_, limit, f, (wd, wr)) = store.tenant_figures(t as TenantId);
            cells.limit_plus_one.set(limit.map_or(0, |l| l.saturating_add(1)));
            cells.bytes.set(f.bytes);
            cells.blocks.set(f.blocks);
            cells.reachable_bytes.set(f.reachable_bytes);
            cells.orphaned_bytes.set(f.orphaned_bytes);
            cells.get_hits.set(f.get_hits);
            cells.get_misses.set(f.get_misses);
            cells.lookup_hits.set(f.lookup_hits);
            cells.lookup_misses.set(f.lookup_misses);
            cells.evictions.set(f.evictions);
            cells.evicted_bytes.set(f.evicted_bytes);
            cells.stored_bytes.set(f.stored_bytes);
            cells.limit_refusals.set(f.limit_refusals);
            cells.window_distinct_keys.set(wd);
            cells.window_key_requests.set(wr);
            cells.clients.set(store.tenant_clients(t as TenantId));
        }
    }

    /// Copies the tenant rows' names (after a client brought a tenant; a
    /// slow path: takes the names' lock).
    pub fn tenants_renamed(&self, store: &Store) {
        let Ok(mut names) = self.m.tenant_names.lock() else { return };
        let mut renamed = false;
        for (t, name) in names.names.iter_mut().enumerate() {
            let now = store.tenant_figures(t as TenantId).0;
            if name != now {
                *name = now.to_owned();
                renamed = true;
            }
        }
        if renamed {
            names.version = names.version.wrapping_add(1);
        }
    }

    /// Publishes the serve loop's counters.
    #[inline]
    pub fn publish_serve(&self, st: &ServeStats) {
        let c = &self.m.serve.serve;
        c.rejected_frames.set(st.rejected_frames);
        c.clients_connected.set(st.clients_connected);
        c.clients_total.set(st.clients_total);
        c.clients_kicked.set(st.clients_kicked);
        c.wakeups_sent.set(st.wakeups_sent);
        c.parks.set(st.parks);
    }
}

/// The [`Collector`] a scrape runs.
#[derive(Debug)]
struct Collect(Arc<Metrics>);

/// Writes one of a tier's families.
fn encode_family(enc: &mut DescriptorEncoder, f: &Family) -> std::fmt::Result {
    let kind = match f.kind {
        Kind::Counter => MetricType::Counter,
        Kind::Gauge => MetricType::Gauge,
        Kind::Histogram => MetricType::Histogram,
    };
    match &f.values {
        Values::One(v) => single(enc, f.name, f.help, kind, *v),
        Values::Labelled(series) => {
            let mut e = enc.encode_descriptor(f.name, f.help, None, kind)?;
            for (labels, v) in series {
                let fam = e.encode_family(labels)?;
                match kind {
                    MetricType::Counter => ConstCounter::new(*v).encode(fam)?,
                    _ => ConstGauge::new(*v as i64).encode(fam)?,
                }
            }
            Ok(())
        }
        Values::Histogram { sum, count, buckets } => enc
            .encode_descriptor(f.name, f.help, None, kind)?
            .encode_histogram::<NoLabelSet>(*sum, *count, buckets, None),
    }
}

/// Writes one metric without labels.
fn single(enc: &mut DescriptorEncoder, name: &str, help: &str, kind: MetricType, v: u64) -> std::fmt::Result {
    let e = enc.encode_descriptor(name, help, None, kind)?;
    match kind {
        MetricType::Counter => ConstCounter::new(v).encode(e),
        _ => ConstGauge::new(v as i64).encode(e),
    }
}

/// Writes one metric with one label: `(label value, value)` pairs.
fn by_label(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    label: &str,
    values: &[(&str, u64)],
) -> std::fmt::Result {
    let mut e = enc.encode_descriptor(name, help, None, kind)?;
    for &(lv, v) in values {
        let labels = [(label, lv)];
        let fam = e.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(fam)?,
            _ => ConstGauge::new(v as i64).encode(fam)?,
        }
    }
    Ok(())
}

impl Collector for Collect {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        use MetricType::{Counter, Gauge, Histogram as Hist};
        let m = &*self.0;
        let (s, st, sv) = (&m.serve, &m.serve.store, &m.serve.serve);

        let mut e = enc.encode_descriptor(
            "ops",
            "Frames the daemon answered, by op and status (status=\"invalid\" with op=\"unknown\": an op code it does not know).",
            None,
            Counter,
        )?;
        for (op, row) in s.ops.iter().enumerate() {
            for (status, cell) in row.iter().enumerate() {
                let v = cell.get();
                // Every known op's `ok` series is always there (rate() needs a
                // first sample); other series appear once they are non-zero.
                if v == 0 && (op == 0 || status != 0 || Op::from_code(op as u8).is_none()) {
                    continue;
                }
                let labels = [("op", m.op_names[op].as_str()), ("status", m.status_names[status].as_str())];
                ConstCounter::new(v).encode(e.encode_family(&labels)?)?;
            }
        }
        let hits = |op: usize| s.ops[op][Status::Ok as usize].get();
        let misses = |op: usize| s.ops[op][Status::NotFound as usize].get();
        by_label(
            &mut enc,
            "hit_blocks",
            "Keys found, by op: GET (pinned and handed out) and LOOKUP.",
            Counter,
            "op",
            &[("get", hits(GET)), ("lookup", hits(LOOKUP))],
        )?;
        by_label(
            &mut enc,
            "miss_blocks",
            "Keys not found, by op (a miss has no size: the daemon never saw that block).",
            Counter,
            "op",
            &[("get", misses(GET)), ("lookup", misses(LOOKUP))],
        )?;
        by_label(
            &mut enc,
            "hit_bytes",
            "Tensor bytes of the blocks found, by op.",
            Counter,
            "op",
            &[("get", st.get_hit_bytes.get()), ("lookup", st.lookup_hit_bytes.get())],
        )?;
        for (name, help, kind, v) in [
            ("stored_bytes", "Tensor bytes committed (put) into the store.", Counter, st.stored_bytes.get()),
            ("served_bytes", "Tensor bytes handed out as zero-copy views (GET hits).", Counter, st.get_hit_bytes.get()),
            ("blocks", "Committed blocks that GET can find.", Gauge, st.blocks.get()),
            (
                "bytes_used",
                "Megaslab bytes in allocated extents (blocks, deleted-but-pinned blocks, reservations).",
                Gauge,
                st.bytes_used.get(),
            ),
            ("bytes_free", "Megaslab bytes in free extents.", Gauge, st.bytes_free.get()),
            ("bytes_capacity", "Megaslab bytes under management.", Gauge, st.bytes_capacity.get()),
            (
                "bytes_evictable",
                "Bytes of committed unpinned blocks (what eviction could free).",
                Gauge,
                st.bytes_evictable.get(),
            ),
            ("pins", "Pins held by clients (live GET views).", Gauge, st.pins.get()),
            ("reservations", "Reservations not yet committed or aborted.", Gauge, st.reservations.get()),
            ("evictions", "Blocks evicted (least recently used first) to make room.", Counter, st.evictions.get()),
            ("evicted_bytes", "Extent bytes freed by eviction.", Counter, st.evicted_bytes.get()),
            (
                "replaced_blocks",
                "Committed blocks that replaced an older block of the same key.",
                Counter,
                st.replaced.get(),
            ),
            ("clients_connected", "Clients connected now.", Gauge, sv.clients_connected.get()),
            ("client_connections", "Clients connected since start.", Counter, sv.clients_total.get()),
            (
                "clients_kicked",
                "Clients disconnected because their rings were corrupt.",
                Counter,
                sv.clients_kicked.get(),
            ),
        ] {
            single(&mut enc, name, help, kind, v)?;
        }
        let refused: Vec<(&str, u64)> =
            REFUSAL_NAMES.iter().zip(&m.refused).map(|(&n, c)| (n, c.load(Relaxed))).collect();
        by_label(
            &mut enc,
            "clients_refused",
            "Connections refused on the control socket, by reason.",
            Counter,
            "reason",
            &refused,
        )?;
        for (name, help, kind, v) in [
            ("rejected_frames", "Frames that failed validation (answered INVALID).", Counter, sv.rejected_frames.get()),
            ("serve_parks", "Times the serve loop parked on the doorbell (idle).", Counter, sv.parks.get()),
            (
                "client_wakeups",
                "Wake syscalls the serve loop made for clients parked on their completion ring.",
                Counter,
                sv.wakeups_sent.get(),
            ),
        ] {
            single(&mut enc, name, help, kind, v)?;
        }

        let mut e = enc.encode_descriptor(
            "op_duration_seconds",
            "Service time in the daemon per frame, by op: a batch's time from frames popped to completions pushed, shared evenly by its frames; one batch in 8 is timed (sampled).",
            None,
            Hist,
        )?;
        for (op, h) in s.op_ns.iter().enumerate() {
            let (sum, count, buckets) = h.load(1e9);
            if count == 0 {
                continue;
            }
            let labels = [("op", m.op_names[op].as_str())];
            e.encode_family(&labels)?.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        let (sum, count, buckets) = s.batch_frames.load(1.0);
        enc.encode_descriptor(
            "batch_size_frames",
            "Frames handled per batch (one channel, one pass; at most 64).",
            None,
            Hist,
        )?
        .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;

        let tiers: Vec<Arc<dyn TierMetrics>> = match m.tiers.lock() {
            Ok(t) => t.iter().map(|(_, t)| t.clone()).collect(),
            Err(_) => Vec::new(),
        };
        let mut families = Vec::new();
        for t in &tiers {
            t.families(&mut families);
        }
        for f in &families {
            encode_family(&mut enc, f)?;
        }
        for (name, help, kind, v) in [
            (
                "reachable_bytes",
                "Extent bytes of the blocks whose chain back to its root is whole in the megaslab (a LOOKUP from the head reaches them).",
                Gauge,
                st.reachable_bytes.get(),
            ),
            (
                "orphaned_bytes",
                "Extent bytes of the blocks a block before them in their chain is missing for (reachable + orphaned = the blocks' bytes).",
                Gauge,
                st.orphaned_bytes.get(),
            ),
            (
                "window_distinct_keys",
                "Distinct keys asked for (GET, LOOKUP) in the current request window (HyperLogLog estimate, ~0.8 % standard error).",
                Gauge,
                st.window_distinct_keys.get(),
            ),
            (
                "window_key_requests",
                "Keys asked for (GET, LOOKUP) in the current request window.",
                Gauge,
                st.window_key_requests.get(),
            ),
        ] {
            single(&mut enc, name, help, kind, v)?;
        }
        single(&mut enc, "channels", "Channels (clients connected at once) the region has.", Gauge, m.channels as u64)?;
        single(&mut enc, "ring_capacity_slots", "Slots per ring.", Gauge, m.ring_capacity as u64)?;
        let e = enc.encode_descriptor("start_time_seconds", "When the daemon started, Unix time.", None, Gauge)?;
        ConstGauge::new(m.start_time_s).encode(e)?;
        let mut e = enc.encode_descriptor("build_info", "The daemon's version (value 1).", None, Gauge)?;
        let labels = [("version", env!("CARGO_PKG_VERSION"))];
        ConstGauge::new(1i64).encode(e.encode_family(&labels)?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(m: &Arc<Metrics>) -> String {
        Metrics::render(&m.registry())
    }

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn counts_frames_by_op_and_status() {
        let m = Metrics::new(4, 64);
        let w = MetricsWriter::new(m.clone());
        for _ in 0..3 {
            w.frame(Op::Get as u8, Status::Ok);
        }
        w.frame(Op::Get as u8, Status::NotFound);
        w.frame(Op::Lookup as u8, Status::NotFound);
        w.frame(200, Status::Invalid);
        w.publish_store(&Gauges { blocks: 7, get_hit_bytes: 3 * 4096, bytes_capacity: 1 << 20, ..Gauges::default() });
        let t = scrape(&m);
        assert_eq!(value(&t, r#"kachedb_ops_total{op="get",status="ok"}"#), Some(3.0), "{t}");
        assert_eq!(value(&t, r#"kachedb_ops_total{op="get",status="not_found"}"#), Some(1.0));
        assert_eq!(value(&t, r#"kachedb_ops_total{op="unknown",status="invalid"}"#), Some(1.0));
        assert_eq!(value(&t, r#"kachedb_ops_total{op="ping",status="ok"}"#), Some(0.0));
        assert_eq!(value(&t, r#"kachedb_ops_total{op="ping",status="invalid"}"#), None);
        assert_eq!(value(&t, r#"kachedb_hit_blocks_total{op="get"}"#), Some(3.0));
        assert_eq!(value(&t, r#"kachedb_miss_blocks_total{op="lookup"}"#), Some(1.0));
        assert_eq!(value(&t, r#"kachedb_hit_bytes_total{op="get"}"#), Some(12288.0));
        assert_eq!(value(&t, "kachedb_served_bytes_total"), Some(12288.0));
        assert_eq!(value(&t, "kachedb_blocks"), Some(7.0));
        assert_eq!(value(&t, "kachedb_bytes_capacity"), Some(1048576.0));
        assert!(t.contains("# HELP kachedb_blocks "), "{t}");
        assert!(t.contains("# TYPE kachedb_ops_total counter"), "{t}");
        assert!(t.contains("# TYPE kachedb_op_duration_seconds histogram"), "{t}");
        assert!(t.contains(r#"kachedb_build_info{version=""#), "{t}");
    }

    #[test]
    fn every_sample_line_is_well_formed() {
        let m = Metrics::new(4, 64);
        let mut w = MetricsWriter::new(m.clone());
        let frames = [TensorBlockDescriptor { op: Op::Get as u8, ..Default::default() }; 3];
        for _ in 0..100 {
            let t = w.batch_start();
            w.batch_end(t, &frames);
        }
        m.client_refused(Refusal::ChannelsFull);
        let t = scrape(&m);
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let (name, v) = line.rsplit_once(' ').unwrap();
            assert!(name.starts_with("kachedb_"), "{line}");
            assert!(v.parse::<f64>().is_ok() || v == "+Inf", "{line}");
        }
        assert_eq!(value(&t, r#"kachedb_clients_refused_total{reason="channels_full"}"#), Some(1.0));
        assert_eq!(value(&t, r#"kachedb_batch_size_frames_bucket{le="2"}"#), Some(0.0), "{t}");
        assert_eq!(value(&t, r#"kachedb_batch_size_frames_bucket{le="4"}"#), Some(100.0), "{t}");
        assert!(
            t.contains(r#"kachedb_op_duration_seconds_bucket{op="get",le="1e-7"}"#) || t.contains(r#"le="1e-07""#),
            "{t}"
        );
        assert_eq!(value(&t, "kachedb_batch_size_frames_count"), Some(100.0));
        assert_eq!(value(&t, "kachedb_batch_size_frames_sum"), Some(300.0));
        // About one batch in SAMPLE_MEAN is timed; its frames all count.
        let timed = value(&t, r#"kachedb_op_duration_seconds_count{op="get"}"#).unwrap();
        assert!(timed > 0.0 && timed < 300.0 && timed % 3.0 == 0.0, "{timed}");
        let inf = value(&t, r#"kachedb_op_duration_seconds_bucket{op="get",le="+Inf"}"#).unwrap();
        assert_eq!(inf, timed);
    }

    /// Names tenant rows `0..names.len()` as a client bringing them would.
    fn name_tenants(m: &Metrics, names: &[&str]) {
        let mut n = m.tenant_names.lock().unwrap();
        for (row, name) in n.names.iter_mut().zip(names) {
            *row = name.to_string();
        }
        n.version += 1;
    }

    /// What `/metrics` serves (per-tenant families kept between scrapes) is
    /// the registry's text as of each scrape: after figures change, go back
    /// to earlier values, a limit comes and goes and tenants are renamed.
    #[test]
    fn the_exposition_is_the_registry_text_as_tenants_change() {
        let m = Metrics::new(4, 64);
        let (ex, r) = (Exposition::new(&m), m.registry());
        let same = |why: &str| {
            let (served, fresh) = (ex.render(), Metrics::render(&r));
            assert_eq!(served, fresh, "{why}");
            served
        };
        same("no tenant");
        name_tenants(&m, &["a", "b"]);
        let t = same("two tenants");
        assert_eq!(value(&t, r#"kachedb_tenant_blocks{tenant="b"}"#), Some(0.0), "{t}");
        let cells = &m.serve.tenants;
        cells[1].blocks.set(5);
        cells[0].get_hits.set(3);
        let t = same("figures changed");
        assert_eq!(value(&t, r#"kachedb_tenant_blocks{tenant="b"}"#), Some(5.0), "{t}");
        assert_eq!(value(&t, r#"kachedb_tenant_hit_blocks_total{tenant="a",op="get"}"#), Some(3.0), "{t}");
        assert_eq!(value(&t, r#"kachedb_tenant_limit_bytes{tenant="a"}"#), None, "{t}");
        cells[0].limit_plus_one.set(4097);
        let t = same("a limit");
        assert_eq!(value(&t, r#"kachedb_tenant_limit_bytes{tenant="a"}"#), Some(4096.0), "{t}");
        cells[0].limit_plus_one.set(0);
        cells[1].blocks.set(0);
        let t = same("back to earlier figures");
        assert_eq!(value(&t, r#"kachedb_tenant_limit_bytes{tenant="a"}"#), None, "{t}");
        assert_eq!(value(&t, r#"kachedb_tenant_blocks{tenant="b"}"#), Some(0.0), "{t}");
        name_tenants(&m, &["a", "c"]);
        let t = same("renamed");
        assert_eq!(value(&t, r#"kachedb_tenant_blocks{tenant="c"}"#), Some(0.0), "{t}");
        assert!(!t.contains(r#"tenant="b""#), "{t}");
        // The families other than the tenants' are read at every scrape.
        let w = MetricsWriter::new(m.clone());
        w.frame(Op::Get as u8, Status::Ok);
        w.frame(Op::Get as u8, Status::Ok);
        let t = same("ops counted");
        assert_eq!(value(&t, r#"kachedb_ops_total{op="get",status="ok"}"#), Some(2.0), "{t}");
    }

    #[test]
    fn histogram_buckets_are_le() {
        let h = Histogram::new(&BATCH_BOUNDS);
        h.observe_n(1, 1);
        h.observe_n(2, 1);
        h.observe_n(3, 2);
        h.observe_n(64, 1);
        h.observe_n(65, 1);
        let (sum, count, b) = h.load(1.0);
        assert_eq!((sum, count), (1.0 + 2.0 + 6.0 + 64.0 + 65.0, 6));
        let counts: Vec<u64> = b.iter().map(|x| x.1).collect();
        assert_eq!(counts, [1, 1, 2, 0, 0, 0, 1, 1]);
        assert_eq!(b.last().unwrap().0, f64::INFINITY);
    }
}
