//! The remote tier: a Redis Cluster (or a standalone Redis) behind the
//! megaslab, shared by every daemon of a fleet (docs/remote.md).
//!
//! The serve loop never touches the network. It hands work to this module's
//! [`RemoteTier`] through the tier interface ([`Tier`], `crate::tier`); its
//! tasks run on their own tokio runtime (`kachedb-remote` threads, nicer than
//! the serve loop by [`RemoteConfig::worker_nice`], so that local traffic wins
//! the CPU) and report [`TierEvent`]s on the loop's ordinary event queue,
//! which rings the doorbell:
//!
//! * **Write-behind** ([`writer`]): for each block a client commits, the serve
//!   loop takes a pin for the tier's own session and queues a [`WriteJob`]
//!   (or drops it, counted, when the queue's bytes would pass
//!   `--remote-queue-bytes`). A worker reads the pinned block in place (a
//!   committed block is immutable and a pinned one is never evicted or
//!   reused), writes it in chunks, and sends [`TierEvent::Written`]; the
//!   serve loop then drops the pin. Pinning instead of copying keeps the
//!   serve loop's cost per commit at a few map operations whatever the block
//!   size; the queue bound caps the megaslab bytes so held.
//! * **Fill** ([`reader`]): a GET or LOOKUP that misses locally parks its
//!   channel (like a WAIT) and the serve loop starts one [`FetchJob`] for
//!   the local-miss tail of that batch. A worker reads every block of the
//!   tail at once, verifies them ([`format`]), asks the serve loop to reserve
//!   room ([`TierEvent::Reserve`]), copies the bytes into the reservations
//!   and sends [`TierEvent::Filled`]; the serve loop commits them (ordinary
//!   blocks from then on) and serves the parked frames again. At most
//!   [`MAX_FETCHES`] fetches run at once, the bytes they download are bounded
//!   ([`FILL_BUDGET_BYTES`]), and a fetch past its deadline is cancelled.
//! * **Authentication** ([`format::FleetKey`]): with a fleet key
//!   (`--remote-key-file`) values are written with keyed tags and only values
//!   with valid tags are read; without one, every writer is trusted.
//! * **The megaslab** is touched only through [`SlabGate`]: stopping the tier
//!   closes the gate, which waits for the copies in progress, so no extent the
//!   serve loop frees afterwards is still being written or read by the tier.
//!
//! Client: the `redis` crate (redis-rs): its `cluster-async` client discovers
//! the cluster from any node, follows MOVED/ASK and reconnects, and its
//! connections are multiplexed, so requests sent together go out pipelined,
//! one round trip per shard. TLS (`rediss://`) through rustls with the ring
//! provider.

pub mod cells;
pub mod format;
mod hints;
mod reader;
pub mod setup;
mod writer;

use crate::metrics::Metrics;
use crate::tier::gate::SlabGate;
use crate::tier::metrics::add;
use crate::tier::threads::{enter_worker_class, worker_nice_value, WriteQueue};
use crate::tier::{
    FetchJob, FillSpec, Handover, Offer, PendingWrite, Removal, StoppedTier, Tier, TierError, TierEvent, TierEvents,
    WriteJob,
};
use cells::RemoteCells;
use kachedb_shm::Region;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, IntoConnectionInfo};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use format::DEFAULT_CHUNK_BYTES;

/// Default time one remote request may take before it counts as failed.
pub const DEFAULT_TIMEOUT_MS: u64 = 1000;
/// Default bound of the write-behind queue, bytes.
pub const DEFAULT_QUEUE_BYTES: u64 = 1 << 30;
/// Default of `--remote-read-ahead`: blocks read ahead along a chain.
pub const DEFAULT_READ_AHEAD: usize = 8;
/// Most `--remote-read-ahead` allows (the serve loop walks that many hints
/// on a miss).
pub const MAX_READ_AHEAD: usize = 64;
/// Default of how much nicer than the daemon the tier's threads run.
pub const DEFAULT_WORKER_NICE: u8 = 19;
/// Most the tier's threads can be made nicer by (Linux nice values run -20..=19).
pub const MAX_WORKER_NICE: u8 = 19;
/// Threads of the tier's runtime.
const WORKER_THREADS: usize = 2;
/// Blocks written at once.
const WRITE_CONCURRENCY: usize = 4;
/// Chunks of one block in flight at once (reads and writes).
const CHUNK_WINDOW: usize = 16;
/// Least time between two attempts to connect.
const RECONNECT_EVERY: Duration = Duration::from_millis(500);
/// Fetches running at once; later ones wait (within their deadline).
pub const MAX_FETCHES: usize = 16;
/// Bytes of blocks the fetches download at once, beyond their first reads
/// (a block larger than this is downloaded alone).
pub const FILL_BUDGET_BYTES: u64 = 1 << 30;
/// Bytes of chunk 0 (header included) the first round reads per key; the
/// rest of a larger chunk 0 comes with the other chunks.
pub const FIRST_READ_BYTES: usize = format::HEADER_LEN + (256 << 10);

/// How the remote tier is set up (`kachedb serve --remote …`).
#[derive(Clone)]
pub struct RemoteConfig {
    /// `redis://HOST:PORT` or `rediss://HOST:PORT` of any node.
    pub url: String,
    /// Password (from a file or the environment, never the command line).
    pub password: Option<String>,
    /// Key prefix; deployments with different namespaces share nothing.
    pub namespace: String,
    /// Longest wait for one round of remote requests.
    pub timeout: Duration,
    /// Expiry of the values written (`None`: none).
    pub ttl: Option<Duration>,
    /// Most tensor bytes queued for writing (beyond: writes are dropped).
    pub queue_bytes: u64,
    /// Payload bytes per chunk.
    pub chunk_bytes: u32,
    /// How much nicer (`setpriority`) than the thread that starts the tier
    /// its threads run, capped at nice 19; 0: the same priority. The serve
    /// loop then wins the CPU over the tier's copying and parsing when both
    /// want it, so fills do not slow local traffic down.
    pub worker_nice: u8,
    /// The fleet key (`--remote-key-file`): values are written with keyed
    /// tags and only values with valid tags are read. `None`: every writer
    /// to the namespace is trusted.
    pub key: Option<format::FleetKey>,
    /// Whether blocks' metadata records are read with the blocks (the daemon
    /// publishes KV events; set when the tier starts).
    pub records: bool,
    /// Blocks read ahead along a chain after a fill (`--remote-read-ahead`;
    /// 0: none; the hints of blocks read in two rounds are read all the same,
    /// to link them).
    pub read_ahead: usize,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("url", &self.url)
            .field("password", &self.password.as_ref().map(|_| "<hidden>"))
            .field("namespace", &self.namespace)
            .field("timeout", &self.timeout)
            .field("ttl", &self.ttl)
            .field("queue_bytes", &self.queue_bytes)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("worker_nice", &self.worker_nice)
            .field("read_ahead", &self.read_ahead)
            .field("key", &self.key.as_ref().map(|_| "<hidden>"))
            .finish()
    }
}

/// Why the remote tier could not start.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The URL or an option is wrong.
    #[error("remote tier: {0}")]
    Config(String),
    /// The runtime's threads could not be started.
    #[error("remote tier: starting its threads: {0}")]
    Io(#[from] std::io::Error),
}

/// An open connection: to a cluster (routing by slot) or to one server.
#[derive(Clone)]
enum Conn {
    Cluster(ClusterConnection),
    Single(MultiplexedConnection),
}

impl Conn {
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        match self {
            Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Single(c) => cmd.query_async(&mut c.clone()).await,
        }
    }
}

/// The connection, made on first use and again after a standalone server's
/// connection broke (a cluster connection reconnects to its nodes itself).
struct Link {
    cfg: RemoteConfig,
    state: tokio::sync::Mutex<(Option<Conn>, Option<Instant>)>,
}

impl Link {
    /// The connection, connecting if there is none (at most once per
    /// [`RECONNECT_EVERY`]; in between: an error at once).
    async fn conn(&self) -> Result<Conn, String> {
        let mut st = self.state.lock().await;
        if let Some(c) = &st.0 {
            return Ok(c.clone());
        }
        if st.1.is_some_and(|next| Instant::now() < next) {
            return Err("not connected (retrying shortly)".into());
        }
        match tokio::time::timeout(self.cfg.timeout, connect(&self.cfg)).await {
            Ok(Ok(c)) => {
                tracing::info!(url = %self.cfg.url, cluster = matches!(c, Conn::Cluster(_)), "remote tier connected");
                st.0 = Some(c.clone());
                Ok(c)
            }
            Ok(Err(e)) => {
                st.1 = Some(Instant::now() + RECONNECT_EVERY);
                Err(format!("connecting to {}: {e}", self.cfg.url))
            }
            Err(_) => {
                st.1 = Some(Instant::now() + RECONNECT_EVERY);
                Err(format!("connecting to {}: timed out", self.cfg.url))
            }
        }
    }

    /// A request on `conn` failed with `e`: forget a standalone connection
    /// that broke, so the next request connects again.
    async fn failed(&self, e: &redis::RedisError) {
        if e.is_unrecoverable_error() || e.is_connection_dropped() || e.is_io_error() {
            let mut st = self.state.lock().await;
            if matches!(st.0, Some(Conn::Single(_))) {
                st.0 = None;
            }
        }
    }
}

/// Connects to the server of `cfg.url` and, if it runs in cluster mode, to
/// the cluster it belongs to.
async fn connect(cfg: &RemoteConfig) -> redis::RedisResult<Conn> {
    let mut info = cfg.url.as_str().into_connection_info()?;
    if let Some(pw) = &cfg.password {
        let settings = info.redis_settings().clone().set_password(pw);
        info = info.set_redis_settings(settings);
    }
    let client = redis::Client::open(info.clone())?;
    let acfg =
        AsyncConnectionConfig::new().set_connection_timeout(Some(cfg.timeout)).set_response_timeout(Some(cfg.timeout));
    let mut single = client.get_multiplexed_async_connection_with_config(&acfg).await?;
    let cluster_info: String = redis::cmd("INFO").arg("cluster").query_async(&mut single).await?;
    if !cluster_info.contains("cluster_enabled:1") {
        return Ok(Conn::Single(single));
    }
    let cc = redis::cluster::ClusterClientBuilder::new(vec![info])
        .connection_timeout(cfg.timeout)
        .response_timeout(cfg.timeout)
        .retries(1)
        .build()?;
    Ok(Conn::Cluster(cc.get_async_connection().await?))
}

/// The name of the tier's threads.
pub const THREAD_NAME: &str = "kachedb-remote";

/// What the workers share.
struct Ctx {
    cfg: RemoteConfig,
    link: Link,
    slab: SlabGate,
    events: TierEvents,
    metrics: Arc<Metrics>,
    /// The tier's counters (`Metrics::tier`).
    cells: Arc<RemoteCells>,
    /// What a header may claim (the megaslab's size).
    limits: format::Limits,
    /// The namespace and fleet key values are read and written in.
    scope: Arc<format::Scope>,
    /// Blocks written at once.
    write_slots: tokio::sync::Semaphore,
    /// Fetches running at once ([`MAX_FETCHES`]).
    fetch_slots: tokio::sync::Semaphore,
    /// KiB of blocks being downloaded ([`FILL_BUDGET_BYTES`]).
    fill_budget: tokio::sync::Semaphore,
    /// The writes taken and not finished, by pin: what a stop hands over.
    pending: std::sync::Mutex<std::collections::HashMap<u64, PendingWrite>>,
    /// The next-block hints read ([`hints`]); held for a few map operations
    /// at a time, never across an await.
    hints: std::sync::Mutex<hints::Hints>,
}

impl Ctx {
    fn cells(&self) -> &RemoteCells {
        &self.cells
    }

    /// The write-behind queue (`--remote-queue-bytes`).
    fn queue(&self) -> WriteQueue<'_> {
        WriteQueue { bytes: &self.cells.queue_bytes, blocks: &self.cells.queue_blocks, bound: self.cfg.queue_bytes }
    }

    fn send(&self, ev: TierEvent) {
        self.events.send(ev);
    }

    fn hints(&self) -> std::sync::MutexGuard<'_, hints::Hints> {
        self.hints.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The serve loop's handle on the remote tier. Dropping it stops its
/// threads (a write in flight is lost; the daemon is going away).
pub struct RemoteTier {
    rt: Option<tokio::runtime::Runtime>,
    ctx: Arc<Ctx>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier").field("cfg", &self.ctx.cfg).finish()
    }
}

impl RemoteTier {
    /// Checks `cfg` and starts the tier's threads. Connecting happens in the
    /// background: a cluster that is down at start turns into misses (and
    /// errors, counted) until it is up.
    pub fn start(
        cfg: RemoteConfig,
        region: Arc<Region>,
        events: TierEvents,
        metrics: Arc<Metrics>,
    ) -> Result<RemoteTier, RemoteError> {
        cfg.url
            .as_str()
            .into_connection_info()
            .map_err(|e| RemoteError::Config(format!("bad URL {}: {e}", cfg.url)))?;
        if let Some(why) = format::namespace_problem(&cfg.namespace) {
            return Err(RemoteError::Config(format!("namespace {:?} {why}", cfg.namespace)));
        }
        if !format::chunk_bytes_ok(u64::from(cfg.chunk_bytes)) {
            return Err(RemoteError::Config(format!(
                "chunk bytes {} outside {}..={}",
                cfg.chunk_bytes,
                format::MIN_CHUNK_BYTES,
                format::MAX_CHUNK_BYTES
            )));
        }
        if cfg.timeout.is_zero() {
            return Err(RemoteError::Config("the timeout must be above zero".into()));
        }
        if cfg.worker_nice > MAX_WORKER_NICE {
            return Err(RemoteError::Config(format!("worker nice {} above {MAX_WORKER_NICE}", cfg.worker_nice)));
        }
        let worker_nice = worker_nice_value(cfg.worker_nice);
        match &cfg.key {
            Some(_) => tracing::info!(
                namespace = %cfg.namespace,
                "remote tier: values are authenticated with the fleet key (keyed tags over the namespace, the header and the bytes); values without a valid tag are refused"
            ),
            None => tracing::warn!(
                namespace = %cfg.namespace,
                "remote tier: no --remote-key-file: values are not authenticated, the tier trusts every writer to its namespace"
            ),
        }
        // TLS: the process-wide rustls provider (a second install is refused, harmlessly).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_THREADS)
            .thread_name(THREAD_NAME)
            .on_thread_start(move || enter_worker_class("remote", worker_nice, false))
            .enable_io()
            .enable_time()
            .build()?;
        let cells = metrics.tier::<RemoteCells>();
        cells.enabled.store(true, Relaxed);
        let limits = format::Limits { max_len: region.layout().slab_len };
        let scope = Arc::new(format::Scope::new(&cfg.namespace, cfg.key.clone()));
        let ctx = Arc::new(Ctx {
            link: Link { cfg: cfg.clone(), state: tokio::sync::Mutex::new((None, None)) },
            cfg,
            slab: SlabGate::new(region),
            events,
            metrics,
            cells,
            limits,
            scope,
            write_slots: tokio::sync::Semaphore::new(WRITE_CONCURRENCY),
            fetch_slots: tokio::sync::Semaphore::new(MAX_FETCHES),
            fill_budget: tokio::sync::Semaphore::new((FILL_BUDGET_BYTES >> 10) as usize),
            pending: Default::default(),
            hints: std::sync::Mutex::new(hints::Hints::new(hints::HINTS_MAX)),
        });
        // Connect now, so the first miss does not pay for it.
        let c = ctx.clone();
        rt.spawn(async move {
            if let Err(e) = c.link.conn().await {
                tracing::warn!("remote tier: {e}; retrying on use");
            }
        });
        Ok(RemoteTier { rt: Some(rt), ctx })
    }
}

impl Tier for RemoteTier {
    /// Takes the block if the write-behind queue's bytes stay within
    /// `--remote-queue-bytes`; otherwise counts it in `remote_dropped_writes`.
    fn write_behind(&self, offer: Offer<'_>, pinned: &mut dyn FnMut() -> Option<WriteJob>) {
        let len = offer.len;
        let cells = self.ctx.cells();
        // One writer of increments (the serve loop), workers only subtract:
        // this load-then-add never lets the sum pass the bound.
        if self.ctx.queue().fits(len).is_err() {
            add(&cells.dropped_writes, 1);
            return;
        }
        let Some(job) = pinned() else {
            add(&cells.dropped_writes, 1);
            return;
        };
        self.ctx.queue().push(len);
        self.ctx
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(job.pin, PendingWrite { key: job.key, parent: job.parent });
        if let Some(rt) = &self.rt {
            rt.spawn(writer::write(self.ctx.clone(), job));
        }
    }

    /// Starts a fetch; its [`TierEvent::Filled`] comes back on the event
    /// queue, at the latest soon after its deadline ([`fill_deadline`]), when
    /// the fetch is cancelled.
    fn fetch(&self, job: FetchJob) {
        add(&self.ctx.cells().fetches, 1);
        if let Some(rt) = &self.rt {
            let deadline = tokio::time::Instant::now() + fill_deadline(self.ctx.cfg.timeout);
            rt.spawn(reader::fetch(self.ctx.clone(), job, deadline));
        }
    }

    /// Up to `--remote-read-ahead` blocks after `key` along the next-block
    /// hints this node has read (`hints`); nothing it has not read yet.
    fn chain_after(&self, key: u128) -> Vec<u128> {
        match self.ctx.cfg.read_ahead {
            0 => Vec::new(),
            n => self.ctx.hints().chain_after(key, n),
        }
    }

    /// The longest a fetch can take before the serve loop stops waiting for
    /// it: the fetch's own deadline ([`fill_deadline`], where the worker
    /// cancels it), and slack for the local part.
    fn fetch_bound(&self) -> Duration {
        fill_deadline(self.ctx.cfg.timeout) + Duration::from_secs(1)
    }

    fn landed(&self, len: u64) {
        add(&self.ctx.cells().fills, 1);
        add(&self.ctx.cells().fill_bytes, len);
    }

    fn filled_after(&self, us: u64) {
        self.ctx.cells().fill.observe(us);
    }

    /// Keeps the remote copy: the cluster is the fleet's cache, shared by
    /// every node under the same key (a content hash); one node's DELETE is
    /// about its own copies (docs/remote.md, "DELETE").
    fn remove(&self, _key: u128) -> Removal {
        Removal::Done
    }

    /// Stops the tier's threads, waiting for a copy in progress to finish, so
    /// nothing of the tier touches the megaslab afterwards. The writes queued
    /// or in flight are handed back, for whichever daemon serves next to
    /// write again (a write cut short is written whole then: chunk 0 goes
    /// last, so a reader never takes a half-written block for one); the
    /// caller drops their pins and the fills' reservations by closing the
    /// tier's session.
    fn stop(self: Box<Self>) -> (Box<dyn StoppedTier>, Handover) {
        // Writes in flight need not finish: they are handed over.
        (*self).stop_within(Duration::from_millis(200))
    }
}

/// How long a fetch may run before it is cancelled (its downloads dropped,
/// its keys misses): the connect, two rounds of requests, and waiting for a
/// fetch slot or download budget, each about the request timeout, and a
/// second of slack for a busy node (the tier's threads run nicer than the
/// serve loop).
fn fill_deadline(timeout: Duration) -> Duration {
    timeout * 4 + Duration::from_secs(1)
}

impl RemoteTier {
    /// [`Tier::stop`], giving the runtime's tasks `grace` to end. The gate
    /// closes first: whatever the runtime still runs after `grace`, no copy
    /// into or out of the megaslab does.
    fn stop_within(mut self, grace: Duration) -> (Box<dyn StoppedTier>, Handover) {
        self.ctx.slab.close();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(grace);
        }
        self.ctx.queue().clear();
        let pending = std::mem::take(&mut *self.ctx.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let stopped = Box::new(StoppedRemote {
            cfg: self.ctx.cfg.clone(),
            region: self.ctx.slab.region().clone(),
            events: self.ctx.events.clone(),
            metrics: self.ctx.metrics.clone(),
        });
        (stopped, Handover { pending: pending.into_values().collect(), ..Handover::default() })
    }
}

/// The remote tier stopped for a takeover: what it needs to start again.
struct StoppedRemote {
    cfg: RemoteConfig,
    region: Arc<Region>,
    events: TierEvents,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for StoppedRemote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoppedRemote").field("cfg", &self.cfg).finish()
    }
}

impl StoppedTier for StoppedRemote {
    fn resume(self: Box<Self>) -> Result<Box<dyn Tier>, TierError> {
        Ok(Box::new(RemoteTier::start(self.cfg, self.region, self.events, self.metrics)?))
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        self.ctx.slab.close();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_millis(500));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kachedb_shm::{CreateOptions, DType, Layout, Shape};

    fn config(worker_nice: u8) -> RemoteConfig {
        RemoteConfig {
            // Nothing listens there: the background connect fails, which
            // these tests do not look at.
            url: "redis://127.0.0.1:1".into(),
            password: None,
            namespace: "t".into(),
            timeout: Duration::from_millis(100),
            ttl: None,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            read_ahead: DEFAULT_READ_AHEAD,
            worker_nice,
            key: None,
            records: false,
        }
    }

    fn start(worker_nice: u8) -> Result<RemoteTier, RemoteError> {
        start_named("kachedb_remote_test", worker_nice)
    }

    fn start_named(name: &str, worker_nice: u8) -> Result<RemoteTier, RemoteError> {
        let layout = Layout::new(2, 16, 1 << 20).unwrap();
        let region =
            Region::create(&CreateOptions { name: name.into(), layout, headroom_bytes: 0 }, |_, _| {}).unwrap();
        let (tx, _rx) = crate::events::queue(region.clone());
        RemoteTier::start(config(worker_nice), region, tx.tier_events(0), Metrics::new(2, 16))
    }

    /// The `len` bytes of megaslab at `offset`, copied out.
    fn slab_bytes(region: &Region, offset: u64, len: usize) -> Vec<u8> {
        let ptr = region.slab_ptr(offset, len as u64).unwrap();
        // SAFETY: the range is inside the megaslab (checked by `slab_ptr`) and
        // the region stays mapped while `region` lives; a racing copy into it
        // would show as wrong bytes, which is what the caller looks for.
        unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) }.to_vec()
    }

    /// Stopping the tier (takeover, shutdown) waits for a fill's copy into
    /// the megaslab that is in progress, however long the runtime's own
    /// shutdown grace: when `stop` returns the copy is whole and no copy of
    /// the tier runs any more, so the serve loop may free the extent. The
    /// copy here blocks inside the gate after its first piece until the test
    /// releases it, long after the 100 ms grace.
    #[test]
    fn stopping_the_tier_waits_for_a_copy_into_the_megaslab() {
        let _one = ONE_TIER_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        use std::sync::mpsc;
        let tier = start_named(&format!("kachedb_remote_gate_test_{}", std::process::id()), 0).unwrap();
        let ctx = tier.ctx.clone();
        let region = ctx.slab.region().clone();
        let len = 3 * format::MIN_CHUNK_BYTES as usize + 5;
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
        let header =
            format::Header::new(9, DType::U8, Shape::new(&[len as u64]).unwrap(), len as u64, format::MIN_CHUNK_BYTES)
                .unwrap()
                .sealed(&data, &ctx.scope);
        let block = reader::Verified {
            header,
            chunk0: header.chunk0(&data, &ctx.scope),
            rest: (1..header.chunk_count)
                .map(|i| data[header.piece(i).start as usize..header.piece(i).end as usize].to_vec())
                .collect(),
            meta: None,
        };
        let offset = region.layout().slab_offset;
        assert_ne!(slab_bytes(&region, offset, len), data);

        let (started_tx, started_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        *reader::LAND_HOOK.lock().unwrap() = Some(Box::new(move || {
            let _ = started_tx.send(());
            // Blocks until the test drops `release_tx` (then returns at once).
            let _ = release_rx.recv_timeout(Duration::from_secs(60));
        }));
        let landed = Arc::new(AtomicBool::new(false));
        let (c, l) = (ctx.clone(), landed.clone());
        let block = Arc::new(block);
        let b = block.clone();
        tier.rt.as_ref().unwrap().spawn(async move { l.store(reader::land(&c, &b, offset), SeqCst) });
        started_rx.recv_timeout(Duration::from_secs(30)).expect("the copy started");

        let (stopped_tx, stopped_rx) = mpsc::channel();
        let r = region.clone();
        let stopper = std::thread::spawn(move || {
            let stopped = tier.stop_within(Duration::from_millis(100));
            // What the megaslab holds the moment stop returns.
            let _ = stopped_tx.send(slab_bytes(&r, offset, len));
            stopped
        });
        let early = stopped_rx.recv_timeout(Duration::from_secs(2));
        assert!(early.is_err(), "stop returned while a copy into the megaslab was still running");
        drop(release_tx);
        let at_stop = stopped_rx.recv_timeout(Duration::from_secs(30)).expect("stop returned once the copy ended");
        assert!(at_stop == data, "when stop returned, the copy into the extent was not whole");
        drop(stopper.join().unwrap());
        *reader::LAND_HOOK.lock().unwrap() = None;
        assert!(landed.load(SeqCst), "the copy in progress completed");
        // After stop, the gate refuses copies.
        assert!(!reader::land(&ctx, &block, offset));
    }

    /// The nice values of this process's threads named [`THREAD_NAME`].
    fn tier_thread_nices() -> Vec<i32> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            let tid = entry.file_name().to_str().and_then(|t| t.parse::<i32>().ok());
            let Some(tid) = tid.and_then(rustix::process::Pid::from_raw) else { continue };
            if comm.trim_end() == THREAD_NAME {
                if let Ok(nice) = rustix::process::getpriority_process(Some(tid)) {
                    out.push(nice);
                }
            }
        }
        out
    }

    /// Polls until `ok` holds for the tier's threads' nice values (a thread
    /// sets its own when it starts); panics after 30 s.
    fn until(what: &str, ok: impl Fn(&[i32]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let nices = tier_thread_nices();
            if ok(&nices) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: the tier's threads have nice values {nices:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Tests that start a tier run one at a time: the nice test looks at all
    /// threads of the process by name.
    static ONE_TIER_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    // One test for every case: each looks at all threads of the process by name.
    #[test]
    fn the_tiers_threads_run_nicer_than_the_daemon_by_worker_nice() {
        let _one = ONE_TIER_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let own = rustix::process::getpriority_process(None).unwrap();
        until("no tier yet", <[i32]>::is_empty);

        let tier = start(0).unwrap();
        until("worker nice 0", |n| n.len() >= WORKER_THREADS && n.iter().all(|&v| v == own));
        drop(tier);
        until("tier stopped", <[i32]>::is_empty);

        let want = (own + 7).min(19);
        let tier = start(7).unwrap();
        until("worker nice 7", |n| n.len() >= WORKER_THREADS && n.iter().all(|&v| v == want));
        // The thread that started the tier (the serve loop's) keeps its own.
        assert_eq!(rustix::process::getpriority_process(None).unwrap(), own);
        drop(tier);
        until("tier stopped", <[i32]>::is_empty);

        let err = start(MAX_WORKER_NICE + 1).unwrap_err();
        assert!(err.to_string().contains("worker nice"), "{err}");
        assert!(tier_thread_nices().is_empty(), "a refused config starts no threads");
    }
}
