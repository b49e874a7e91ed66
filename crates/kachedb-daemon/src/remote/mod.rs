//! The remote tier: a Redis Cluster (or a standalone Redis) behind the
//! megaslab, shared by every daemon of a fleet (docs/remote.md).
//!
//! The serve loop never touches the network. It hands work to this module's
//! [`RemoteTier`], whose tasks run on their own tokio runtime
//! (`kachedb-remote` threads), and hears back through its ordinary event
//! queue ([`RemoteEvent`] inside [`Event::Remote`]), which rings the doorbell:
//!
//! * **Write-behind** ([`writer`]): for each block a client commits, the serve
//!   loop takes a pin for the tier's own session and queues a [`WriteJob`]
//!   (or drops it, counted, when the queue's bytes would pass
//!   `--remote-queue-bytes`). A worker reads the pinned block in place (a
//!   committed block is immutable and a pinned one is never evicted or
//!   reused), writes it in chunks, and sends [`RemoteEvent::Written`]; the
//!   serve loop then drops the pin. Pinning instead of copying keeps the
//!   serve loop's cost per commit at a few map operations whatever the block
//!   size; the queue bound caps the megaslab bytes so held.
//! * **Fill** ([`reader`]): a GET or LOOKUP that misses locally parks its
//!   channel (like a WAIT) and the serve loop starts one [`FetchJob`] for
//!   the local-miss tail of that batch. A worker reads every block of the
//!   tail at once, verifies them ([`format`]), asks the serve loop to reserve
//!   room ([`RemoteEvent::Reserve`]), copies the bytes into the reservations
//!   and sends [`RemoteEvent::Filled`]; the serve loop commits them (ordinary
//!   blocks from then on) and serves the parked frames again.
//!
//! Client: the `redis` crate (redis-rs): its `cluster-async` client discovers
//! the cluster from any node, follows MOVED/ASK and reconnects, and its
//! connections are multiplexed, so requests sent together go out pipelined,
//! one round trip per shard. TLS (`rediss://`) through rustls with the ring
//! provider.

pub mod format;
mod reader;
mod writer;

use crate::events::{Event, EventSender};
use crate::metrics::{Metrics, RemoteCells};
use kachedb_shm::{DType, Region, Shape};
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
/// Blocks written at once.
const WRITE_CONCURRENCY: usize = 4;
/// Chunks of one block in flight at once (reads and writes).
const CHUNK_WINDOW: usize = 16;
/// Least time between two attempts to connect.
const RECONNECT_EVERY: Duration = Duration::from_millis(500);

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

/// A block to fill: what the serve loop needs to reserve room for it.
#[derive(Clone, Copy, Debug)]
pub struct FillSpec {
    /// Key.
    pub key: u128,
    /// Element type.
    pub dtype: DType,
    /// Dims.
    pub shape: Shape,
    /// Tensor bytes.
    pub len: u64,
}

/// A reservation the serve loop made for a fill.
#[derive(Clone, Copy, Debug)]
pub struct Reserved {
    /// The reservation handle (of the tier's session).
    pub handle: u64,
    /// Where its tensor bytes go, bytes from the region base.
    pub data_offset: u64,
}

/// What the remote workers tell the serve loop.
#[derive(Debug)]
pub enum RemoteEvent {
    /// Fetch `fetch` verified these blocks: reserve room for each (`None`
    /// where not: present locally by now, or no room) and answer on `reply`.
    /// If the reply cannot be delivered, the serve loop aborts them.
    Reserve {
        /// Fetch id.
        fetch: u64,
        /// The blocks.
        blocks: Vec<FillSpec>,
        /// Where the answer goes (one entry per block).
        reply: tokio::sync::oneshot::Sender<Vec<Option<Reserved>>>,
    },
    /// Fetch `fetch` is over: these reservations hold their bytes, commit
    /// them; then serve the frames its channel held.
    Filled {
        /// Fetch id.
        fetch: u64,
        /// Reservation handles to commit, with their tensor bytes.
        filled: Vec<(u64, u64)>,
    },
    /// A write-behind job is over: drop its pin.
    Written {
        /// The pin handle (of the tier's session).
        pin: u64,
    },
}

/// One block to write, pinned by the tier's session.
#[derive(Clone, Copy, Debug)]
pub struct WriteJob {
    /// Key.
    pub key: u128,
    /// The pin to drop when done.
    pub pin: u64,
    /// Where the tensor bytes are, bytes from the region base.
    pub data_offset: u64,
    /// Tensor bytes.
    pub len: u64,
    /// Element type.
    pub dtype: DType,
    /// Dims.
    pub shape: Shape,
}

/// The local-miss tail of one batch, to read.
#[derive(Clone, Debug)]
pub struct FetchJob {
    /// Fetch id (the serve loop matches the answer to the parked channel by it).
    pub id: u64,
    /// Keys, in chain order.
    pub keys: Vec<u128>,
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

/// What the workers share.
struct Ctx {
    cfg: RemoteConfig,
    link: Link,
    region: Arc<Region>,
    events: EventSender,
    metrics: Arc<Metrics>,
    /// Blocks written at once.
    write_slots: tokio::sync::Semaphore,
}

impl Ctx {
    fn cells(&self) -> &RemoteCells {
        &self.metrics.remote
    }

    fn send(&self, ev: RemoteEvent) {
        self.events.send(Event::Remote(ev));
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
        events: EventSender,
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
        // TLS: the process-wide rustls provider (a second install is refused, harmlessly).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kachedb-remote")
            .enable_io()
            .enable_time()
            .build()?;
        metrics.remote.enabled.store(true, Relaxed);
        let ctx = Arc::new(Ctx {
            link: Link { cfg: cfg.clone(), state: tokio::sync::Mutex::new((None, None)) },
            cfg,
            region,
            events,
            metrics,
            write_slots: tokio::sync::Semaphore::new(WRITE_CONCURRENCY),
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

    /// Whether a block of `len` bytes fits in the write-behind queue; if so,
    /// it is counted in it (the worker takes it out when done).
    pub fn admit(&self, len: u64) -> bool {
        let q = &self.ctx.cells().queue_bytes;
        let max = self.ctx.cfg.queue_bytes;
        // One writer of increments (the serve loop), workers only subtract:
        // this load-then-add never lets the sum pass `max`.
        if q.load(Relaxed).saturating_add(len) > max {
            RemoteCells::add(&self.ctx.cells().dropped_writes, 1);
            return false;
        }
        q.fetch_add(len, Relaxed);
        RemoteCells::add(&self.ctx.cells().queue_blocks, 1);
        true
    }

    /// Takes back what [`admit`](Self::admit) counted, for a job not queued after all.
    pub fn unadmit(&self, len: u64) {
        self.ctx.cells().queue_bytes.fetch_sub(len, Relaxed);
        self.ctx.cells().queue_blocks.fetch_sub(1, Relaxed);
        RemoteCells::add(&self.ctx.cells().dropped_writes, 1);
    }

    /// Queues a write of a pinned block (admitted first).
    pub fn write(&self, job: WriteJob) {
        if let Some(rt) = &self.rt {
            rt.spawn(writer::write(self.ctx.clone(), job));
        }
    }

    /// Starts a fetch; its [`RemoteEvent::Filled`] comes back on the event queue.
    pub fn fetch(&self, job: FetchJob) {
        RemoteCells::add(&self.ctx.cells().fetches, 1);
        if let Some(rt) = &self.rt {
            rt.spawn(reader::fetch(self.ctx.clone(), job));
        }
    }

    /// The longest a fetch can take before the serve loop stops waiting for
    /// it: two rounds of requests, the connect, and slack for the local part.
    pub fn fetch_bound(&self) -> Duration {
        self.ctx.cfg.timeout * 4 + Duration::from_secs(1)
    }
}

/// A tier stopped for a takeover: what it needs to start again if the
/// takeover fails.
pub struct StoppedTier {
    cfg: RemoteConfig,
    region: Arc<Region>,
    events: EventSender,
    metrics: Arc<Metrics>,
}

impl RemoteTier {
    /// Stops the tier's threads, waiting for a copy in progress to finish, so
    /// nothing of the tier touches the megaslab afterwards. Queued writes are
    /// dropped (counted in `remote_dropped_writes`); the caller drops their
    /// pins and the fills' reservations by closing the tier's session.
    pub fn stop(mut self) -> StoppedTier {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
        let cells = self.ctx.cells();
        RemoteCells::add(&cells.dropped_writes, cells.queue_blocks.swap(0, Relaxed));
        cells.queue_bytes.store(0, Relaxed);
        StoppedTier {
            cfg: self.ctx.cfg.clone(),
            region: self.ctx.region.clone(),
            events: self.ctx.events.clone(),
            metrics: self.ctx.metrics.clone(),
        }
    }
}

impl std::fmt::Debug for StoppedTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoppedTier").field("cfg", &self.cfg).finish()
    }
}

impl StoppedTier {
    /// Starts the tier again (a takeover that did not happen).
    pub fn start(self) -> Result<RemoteTier, RemoteError> {
        RemoteTier::start(self.cfg, self.region, self.events, self.metrics)
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_millis(500));
        }
    }
}
