//! The daemon's life: [`Daemon::start`] takes the instance lock, creates the
//! region, binds the control socket and starts the control thread;
//! [`Daemon::run`] runs the serve loop until shutdown, then closes the
//! channels and removes the socket.

use crate::channels::Channels;
use crate::control::{self, Access};
use crate::events::{self, Event};
use crate::metrics::Metrics;
use crate::serve::Serve;
use crate::store::Store;
use crate::takeover::state::RegionLayout;
use crate::tier::{Tier, TierError};
use crate::tier_kind::{Start, TierSetup};
use kachedb_shm::region::{CreateOptions, Layout};
use kachedb_shm::{Region, RegionError, SpinThenPark};
use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

/// How the daemon is set up.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Instance number (names the region `kachedb_<instance>`).
    pub instance: u32,
    /// Control socket path.
    pub socket_path: PathBuf,
    /// Megaslab bytes.
    pub slab_bytes: u64,
    /// Channels (clients connected at once).
    pub channels: u32,
    /// Slots per ring.
    pub ring_capacity: u32,
    /// Groups allowed besides the daemon's uid.
    pub allow_gids: Vec<u32>,
    /// Memory to leave free beside the region (bytes).
    pub headroom_bytes: u64,
    /// Idle policy of the serve loop.
    pub wait: SpinThenPark,
    /// Where to serve `GET /metrics` and `GET /healthz` over HTTP, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// Most bytes one client (one connection) may hold reserved and pinned
    /// (`None`: no limit).
    pub max_client_bytes: Option<u64>,
    /// Most bytes the clients of one uid may hold reserved and pinned
    /// together, however many connections they open (`None`: no limit).
    pub max_uid_bytes: Option<u64>,
    /// Most control connections open at once.
    pub max_connections: u32,
    /// How long a connection that is not a client's (no hello yet, a stats
    /// asker) may go without sending a request before it is closed.
    pub hello_timeout: std::time::Duration,
    /// How long one step of a takeover may take as a whole, on either side
    /// (`crate::takeover::STEP_TIMEOUT` by default).
    pub takeover_timeout: std::time::Duration,
    /// How long this daemon's clients may wait while a new daemon takes
    /// over, from its go to its verdict (`crate::takeover::PAUSE_LIMIT` by
    /// default); past it the takeover fails and this daemon serves on.
    pub takeover_pause: std::time::Duration,
    /// How long a client may leave its completion ring full with requests
    /// waiting before it is disconnected (`None`: never).
    pub stuck_client_timeout: Option<std::time::Duration>,
    /// Run the full invariant check for every stats answer.
    pub check_invariants: bool,
    /// Which blocks eviction takes first (`docs/eviction.md`).
    pub eviction: crate::store::EvictionPolicy,
    /// The tiers behind the megaslab, in the order a local miss asks them
    /// (`crate::tiers::TIERS` makes them from `kachedb serve`'s flags; docs/tiers.md).
    pub tiers: Vec<Arc<dyn TierSetup>>,
    /// Tenants and their limits (`kachedb serve --tenant-limit`, docs/metrics.md "Tenants").
    pub tenants: TenantConfig,
    /// The KV event publisher, if on (`kachedb serve --events-endpoint`, docs/events.md).
    pub events: Option<crate::kv_events::EventsConfig>,
}

/// Tenant accounting and limits (`store/tenants.rs`).
#[derive(Clone, Debug)]
pub struct TenantConfig {
    /// Megaslab bytes each named tenant may hold (`--tenant-limit NAME=SIZE`).
    pub limits: Vec<(String, u64)>,
    /// The limit of every other tenant, `default` and `_other` included
    /// (`--tenant-limit-default`); `None`: none.
    pub default_limit: Option<u64>,
    /// Count tenants apart (names, hits, misses, request windows); off,
    /// every client is the default tenant's (`--tenant-accounting off`).
    pub accounting: bool,
    /// How long a request window runs (`--request-window`).
    pub request_window: std::time::Duration,
    /// Tenants bound to uids and gids (`--tenant-uid`, `--tenant-gid`): only
    /// their peers may act as them, and only their sessions may replace or
    /// delete their blocks (`crate::binding`, docs/tenants.md). Each name
    /// once, never the default tenant; needs `accounting`.
    pub bindings: Vec<crate::binding::TenantBinding>,
}

impl TenantConfig {
    /// The names of the bound tenants.
    pub fn bound_names(&self) -> Vec<String> {
        self.bindings.iter().map(|b| b.name.clone()).collect()
    }
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            limits: Vec::new(),
            default_limit: None,
            accounting: true,
            request_window: crate::serve::DEFAULT_REQUEST_WINDOW,
            bindings: Vec::new(),
        }
    }
}

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Another daemon holds the lock.
    #[error("another kachedb daemon already serves {socket} (lock {lock} is held{pid}): stop it, or use another --instance or --socket")]
    AlreadyRunning {
        /// Socket path.
        socket: String,
        /// Lock path.
        lock: String,
        /// Holder pid text.
        pid: String,
    },
    /// The socket's directory could let another user replace the socket.
    #[error("refusing to serve in {dir}: {why}, so another user could replace the socket; give a private directory (yours, mode 0700) with --socket")]
    UnsafeSocketDir {
        /// The directory.
        dir: String,
        /// What is wrong with it.
        why: String,
    },
    /// The region could not be made.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// The metrics address could not be bound.
    #[error("cannot serve metrics on {addr}: {source}; pick a free address with --metrics-addr (or stop the process listening there)")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// Error.
        #[source]
        source: std::io::Error,
    },
    /// A tier could not start (the tier's own error, which names it).
    #[error("{0}")]
    Tier(TierError),
    /// The tenants' settings cannot be applied.
    #[error("{0}")]
    Tenants(String),
    /// `--takeover` did not happen.
    #[error(transparent)]
    Takeover(#[from] crate::takeover::TakeoverError),
    /// The KV event publisher could not start.
    #[error("cannot publish KV events: {0}; pick a free address with --events-endpoint / --events-replay-endpoint")]
    Events(String),
    /// A filesystem or socket operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What.
        what: &'static str,
        /// Path.
        path: String,
        /// Error.
        #[source]
        source: std::io::Error,
    },
}

/// A started daemon: region made, socket bound, control thread running.
pub struct Daemon {
    cfg: ServeConfig,
    region: Arc<Region>,
    store: Store,
    events: Receiver<Event>,
    channels: Arc<Channels>,
    shutdown: Arc<AtomicBool>,
    control: Option<std::thread::JoinHandle<Option<i32>>>,
    metrics: Arc<Metrics>,
    /// The tiers behind the megaslab, in order.
    tiers: Vec<Box<dyn Tier>>,
    /// The metrics endpoint's thread and bound address.
    http: Option<(std::thread::JoinHandle<()>, SocketAddr)>,
    _lock: crate::lock::InstanceLock,
    started: Instant,
    /// What the daemon taken over was serving (`crate::takeover`).
    restored: Option<Restored>,
    /// The KV event publisher's queue and thread, if on.
    kv_events: Option<KvEvents>,
}

/// The serve loop's end of the KV event publisher's queue, and its thread.
type KvEvents = (crate::kv_events::EventSink, std::thread::JoinHandle<()>);

/// The serve loop's part of a takeover, taken up by [`Daemon::run`].
struct Restored {
    channels: Vec<crate::takeover::state::ChannelState>,
    waits: Vec<crate::takeover::state::ParkedWait>,
    counters: crate::takeover::state::ServeCounters,
    streams: std::collections::HashMap<u32, Arc<std::os::unix::net::UnixStream>>,
    /// The old daemon's tiers' writes not finished, and keys whose older
    /// copy they could not remove (`ServeState`).
    tier_writes: Vec<crate::tier::PendingWrite>,
    tier_unremoved: Vec<u128>,
    /// The descriptors the old daemon's tiers handed over, by tier name,
    /// for this daemon's tiers of the same names to adopt.
    tier_fds: Vec<(String, Vec<std::os::fd::OwnedFd>)>,
}

/// The descriptors `fds` the old daemon's tiers handed over, by tier
/// (`names`: whose, and how many, in order); a tier whose descriptors are
/// not all there is left out.
fn handed_over(names: &[(String, u32)], fds: &[std::os::fd::OwnedFd]) -> Vec<(String, Vec<std::os::fd::OwnedFd>)> {
    let mut at = 0usize;
    let mut out = Vec::new();
    for (name, n) in names {
        let n = *n as usize;
        let own: Option<Vec<_>> = fds.get(at..at + n).and_then(|f| f.iter().map(|fd| fd.try_clone().ok()).collect());
        if let Some(own) = own {
            out.push((name.clone(), own));
        }
        at += n;
    }
    out
}

/// How [`Daemon::run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Shut down (SIGINT/SIGTERM): channels closed, socket removed.
    Stopped,
    /// A new daemon took over: it serves the region, the socket and every client now.
    HandedOver {
        /// Its pid, as the kernel gave it for its connection (`SO_PEERCRED`;
        /// 0 if it is in another pid namespace).
        successor_pid: u32,
    },
}

/// What [`Daemon::take_over`] found.
#[derive(Clone, Copy, Debug)]
pub struct TakeoverSummary {
    /// The old daemon's pid.
    pub old_pid: u32,
    /// Blocks in the store taken over.
    pub blocks: u64,
    /// Client connections taken over.
    pub connections: usize,
    /// From asking to serving.
    pub took: std::time::Duration,
    /// Of which: asking and receiving the state and the fds.
    pub received: std::time::Duration,
    /// Of which: mapping the region and rebuilding and checking the store.
    pub rebuilt: std::time::Duration,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon").field("cfg", &self.cfg).finish()
    }
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ServeError + 'a {
    move |source| ServeError::Io { what, path: path.display().to_string(), source }
}

/// Refuses a socket directory that someone else could swap the socket (or
/// the lock file) in: one owned by another user (root excepted), or writable
/// by group or others without the sticky bit (a sticky one such as /tmp lets
/// nobody remove or rename another user's file).
fn check_socket_dir(dir: &Path) -> Result<(), ServeError> {
    // The same rule clients apply before they trust a daemon's socket.
    kachedb_shm::trust::check_socket_dir(dir, &[])
        .map_err(|why| ServeError::UnsafeSocketDir { dir: dir.display().to_string(), why })
}

impl Daemon {
    /// Takes the instance lock, creates the region (calling `progress` while
    /// memory is reserved), binds the control socket and starts its thread.
    pub fn start(
        cfg: ServeConfig,
        shutdown: Arc<AtomicBool>,
        progress: impl FnMut(u64, u64),
    ) -> Result<Daemon, ServeError> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let sock = cfg.socket_path.clone();
        if let Some(dir) = sock.parent() {
            if !dir.as_os_str().is_empty() && !dir.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(io_err("creating the socket directory", dir))?;
            }
            check_socket_dir(if dir.as_os_str().is_empty() { Path::new(".") } else { dir })?;
        }
        let lock_path = PathBuf::from(format!("{}.lock", sock.display()));
        let lock = match crate::lock::InstanceLock::acquire(&lock_path) {
            Ok(l) => l,
            Err(crate::lock::LockError::Held(pid)) => {
                return Err(ServeError::AlreadyRunning {
                    socket: sock.display().to_string(),
                    lock: lock_path.display().to_string(),
                    pid: pid.map(|p| format!(" by pid {p}")).unwrap_or_default(),
                })
            }
            Err(crate::lock::LockError::Io(e)) => return Err(io_err("opening the lock file", &lock_path)(e)),
        };
        // Before the (slow) memory reservation, so that a busy port fails at once.
        let metrics_listener = match cfg.metrics_addr {
            Some(addr) => Some(crate::http::bind(addr).map_err(|source| ServeError::Metrics { addr, source })?),
            None => None,
        };
        let layout = Layout::new(cfg.channels, cfg.ring_capacity, cfg.slab_bytes)?;
        let region = Region::create(
            &CreateOptions {
                name: kachedb_shm::naming::region_name(cfg.instance),
                layout,
                headroom_bytes: cfg.headroom_bytes,
            },
            progress,
        )?;
        // We hold the lock, so a socket file here is a crashed daemon's leftover.
        if sock.exists() {
            std::fs::remove_file(&sock).map_err(io_err("removing the stale socket", &sock))?;
        }
        let listener = UnixListener::bind(&sock).map_err(io_err("binding the control socket", &sock))?;
        std::fs::set_permissions(
            &sock,
            std::fs::Permissions::from_mode(if cfg.allow_gids.is_empty() { 0o600 } else { 0o660 }),
        )
        .map_err(io_err("setting permissions of", &sock))?;
        let mut store = Store::new(layout.slab_offset, layout.slab_len);
        store.set_max_session_bytes(cfg.max_client_bytes);
        store.set_max_uid_bytes(cfg.max_uid_bytes);
        store.set_eviction_policy(cfg.eviction);
        store.set_tenant_limits(cfg.tenants.default_limit, &cfg.tenants.limits, cfg.tenants.accounting);
        store.set_bound_tenants(&cfg.tenants.bound_names()).map_err(ServeError::Tenants)?;
        let control_lock = lock.dup().map_err(io_err("duplicating the instance lock for", &sock))?;
        let started = Parts {
            channels: Arc::new(Channels::new(cfg.channels)),
            cfg,
            region,
            store,
            listener,
            control_lock,
            metrics_listener,
            conns: Vec::new(),
            shutdown,
            started: Instant::now(),
            restored: None,
        }
        .start()?;
        Ok(started.serve(lock))
    }

    /// Takes over from the daemon serving `cfg.socket_path` (`kachedb serve
    /// --takeover`, `crate::takeover`): its region, socket, lock, clients and
    /// store. The region's geometry is the old daemon's; of `cfg`, the limits,
    /// the tenant bindings (to the blocks at once, to the hellos from then on;
    /// a client connected before keeps its tenant), the eviction policy, the
    /// remote tier and the metrics address (when the old daemon had no
    /// metrics listener) apply.
    ///
    /// Everything that can fail (reading the state, checking the region
    /// against it, the remote tier's options, binding the metrics address,
    /// starting every thread) happens before this daemon answers `ready`; a
    /// failure there is a `refuse`, and the old daemon serves on. After
    /// `ready`, the threads already started are let loose.
    pub fn take_over(cfg: ServeConfig, shutdown: Arc<AtomicBool>) -> Result<(Daemon, TakeoverSummary), ServeError> {
        let t0 = Instant::now();
        let taken = crate::takeover::take(&cfg.socket_path, cfg.takeover_timeout)?;
        let received = t0.elapsed();
        let (started, lock_fd, blocks, restored_at) = match Self::take_state(cfg, shutdown, &taken, t0) {
            Ok(x) => x,
            // Already refused, with its reason.
            Err(e @ ServeError::Takeover(_)) => return Err(e),
            Err(e) => return Err(taken.refuse(&format!("the new daemon cannot start: {e}")).into()),
        };
        let rebuilt = restored_at - received;
        // The old daemon stops only now; until this returns it may resume.
        if let Err(e) = taken.confirm() {
            started.abandon();
            return Err(e.into());
        }
        let lock = crate::lock::InstanceLock::taken_over(lock_fd, &started.lock_path());
        let summary = TakeoverSummary {
            old_pid: taken.old_pid,
            blocks,
            connections: taken.conns.len(),
            took: t0.elapsed(),
            received,
            rebuilt,
        };
        Ok((started.serve(lock), summary))
    }

    /// The new daemon's side of a takeover up to `ready`: rebuilds the state
    /// `taken` and starts every thread (held until [`Started::serve`]).
    /// Returns them, the lock's fd, the blocks taken over and when the store
    /// was rebuilt (from `t0`). A problem with the state is refused here; any
    /// other error is the caller's to refuse.
    fn take_state(
        cfg: ServeConfig,
        shutdown: Arc<AtomicBool>,
        taken: &crate::takeover::Taken,
        t0: Instant,
    ) -> Result<(Started, std::os::fd::OwnedFd, u64, std::time::Duration), ServeError> {
        let sock = cfg.socket_path.clone();
        let mut serve = crate::takeover::decode_serve(taken.state_version, &taken.serve)
            .map_err(|e| taken.refuse(&format!("serve state: {e}")))?;
        let region =
            Region::attach_lazily(taken.region.try_clone().map_err(io_err("duplicating the region of", &sock))?)
                .map_err(|e| taken.refuse(&format!("the region: {e}")))?;
        if region.generation() != serve.region_generation {
            return Err(taken.refuse("the region is not the one the state describes").into());
        }
        // The header is writable by every client: its geometry must be the
        // one the old daemon serves, or every client's rings would move.
        let header = RegionLayout::from(region.layout());
        if header != serve.layout {
            return Err(taken
                .refuse(&format!(
                    "the region header says {header}, but the running daemon serves {}: the header was written after the region was made (by a client?); not taking over",
                    serve.layout
                ))
                .into());
        }
        let layout = *region.layout();
        let received_store = std::mem::take(&mut serve.store);
        let mut store = Store::from_state(received_store, layout.slab_offset, layout.slab_len)
            .map_err(|e| taken.refuse(&format!("the store: {e}")))?;
        store.set_max_session_bytes(cfg.max_client_bytes);
        store.set_max_uid_bytes(cfg.max_uid_bytes);
        store.set_eviction_policy(cfg.eviction);
        store.set_tenant_limits(cfg.tenants.default_limit, &cfg.tenants.limits, cfg.tenants.accounting);
        store.set_bound_tenants(&cfg.tenants.bound_names()).map_err(|e| taken.refuse(&e))?;
        let listener = UnixListener::from(taken.listener.try_clone().map_err(io_err("duplicating the socket", &sock))?);
        let metrics_listener = match (&taken.metrics, cfg.metrics_addr) {
            (Some(fd), _) => Some(std::net::TcpListener::from(
                fd.try_clone().map_err(io_err("duplicating the metrics listener of", &sock))?,
            )),
            (None, Some(addr)) => Some(crate::http::bind(addr).map_err(|source| ServeError::Metrics { addr, source })?),
            (None, None) => None,
        };
        let mut conns = Vec::with_capacity(taken.conns.len());
        let mut streams = std::collections::HashMap::new();
        for (fd, st) in taken.conns.iter().zip(&taken.control.conns) {
            let stream = Arc::new(std::os::unix::net::UnixStream::from(
                fd.try_clone().map_err(io_err("duplicating a client connection of", &sock))?,
            ));
            if let Some(ch) = st.channel {
                streams.insert(ch, stream.clone());
            }
            conns.push(control::Conn::taken_over(stream, st));
        }
        let channels = Arc::new(Channels::restore(taken.control.free_channels.clone(), &taken.control.quarantine));
        let lock_path = PathBuf::from(format!("{}.lock", sock.display()));
        let lock_fd = taken.lock.try_clone().map_err(io_err("duplicating the lock", &lock_path))?;
        let control_lock = lock_fd.try_clone().map_err(io_err("duplicating the lock", &lock_path))?;
        let blocks = store.stats().blocks;
        let restored_at = t0.elapsed();
        let started = Instant::now().checked_sub(std::time::Duration::from_millis(serve.uptime_ms)).unwrap_or(t0);
        let tier_fds = handed_over(&serve.tier_fds, &taken.tier_fds);
        let restored = Restored {
            channels: serve.channels,
            waits: serve.waits,
            counters: serve.counters,
            streams,
            tier_writes: serve
                .tier_writes
                .iter()
                .map(|w| crate::tier::PendingWrite { key: w.key, parent: w.parent })
                .collect(),
            tier_unremoved: serve.tier_unremoved,
            tier_fds,
        };
        let started = Parts {
            cfg,
            region,
            store,
            listener,
            control_lock,
            channels,
            metrics_listener,
            conns,
            shutdown,
            started,
            restored: Some(restored),
        }
        .start()?;
        Ok((started, lock_fd, blocks, restored_at))
    }

    /// The control socket path.
    pub fn socket_path(&self) -> &Path {
        &self.cfg.socket_path
    }

    /// The region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Where the metrics endpoint listens (the bound address: a port 0 asked
    /// for is resolved), if it runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(|(_, a)| *a)
    }

    /// Serves until the shutdown flag is set; then closes every channel,
    /// removes the socket and returns. Or until a new daemon took over: then
    /// leaves the socket, the lock file, the channels and the connections to it.
    pub fn run(self) -> Ended {
        let Daemon {
            cfg,
            region,
            store,
            events,
            channels,
            shutdown,
            control,
            metrics,
            tiers,
            http,
            _lock: lock,
            started,
            restored,
            kv_events,
        } = self;
        let mut serve = Serve::new(
            region,
            store,
            events,
            channels,
            shutdown.clone(),
            cfg.wait,
            cfg.socket_path.clone(),
            started,
            metrics,
        );
        let mut tier_work = None;
        if let Some(r) = restored {
            serve = serve.restore(r.channels, r.waits, r.counters, &r.streams);
            tier_work = Some((r.tier_writes, r.tier_unremoved));
        }
        let (sink, events_thread) = kv_events.unzip();
        let mut serve = serve
            .with_kv_events(sink)
            .with_full_checks(cfg.check_invariants)
            .with_tiers(tiers)
            .with_stuck_client_timeout(cfg.stuck_client_timeout)
            .with_request_window(cfg.tenants.request_window);
        if let Some((writes, unremoved)) = tier_work {
            serve = serve.take_up_tier_work(writes, unremoved);
        }
        let handed_over = serve.run();
        if handed_over {
            // The control thread has returned; this stops the metrics thread.
            shutdown.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let successor = control.and_then(|c| c.join().ok().flatten());
        if let Some((h, _)) = http {
            let _ = h.join();
        }
        // Its queue's sender went with the serve loop: it sends what is queued and ends.
        if let Some(t) = events_thread {
            let _ = t.join();
        }
        if handed_over {
            lock.hand_over();
            return Ended::HandedOver { successor_pid: successor.and_then(|p| u32::try_from(p).ok()).unwrap_or(0) };
        }
        let _ = std::fs::remove_file(&cfg.socket_path);
        // Unlinks the lock file before letting go of the flock (see `lock`).
        lock.release();
        Ended::Stopped
    }
}

/// A daemon's pieces before its threads start: made by [`Daemon::start`]
/// (fresh) or [`Daemon::take_over`] (handed over).
struct Parts {
    cfg: ServeConfig,
    region: Arc<Region>,
    store: Store,
    listener: UnixListener,
    /// A second fd of the instance lock, for the control thread to hand over.
    control_lock: std::os::fd::OwnedFd,
    channels: Arc<Channels>,
    metrics_listener: Option<std::net::TcpListener>,
    conns: Vec<control::Conn>,
    shutdown: Arc<AtomicBool>,
    started: Instant,
    restored: Option<Restored>,
}

/// A daemon whose tiers run and whose control and metrics threads are
/// started but held: [`serve`](Self::serve) lets them loose,
/// [`abandon`](Self::abandon) ends them.
struct Started {
    cfg: ServeConfig,
    region: Arc<Region>,
    store: Store,
    events: Receiver<Event>,
    channels: Arc<Channels>,
    shutdown: Arc<AtomicBool>,
    control: std::thread::JoinHandle<Option<i32>>,
    metrics: Arc<Metrics>,
    tiers: Vec<Box<dyn Tier>>,
    http: Option<(std::thread::JoinHandle<()>, SocketAddr)>,
    /// `true` on these lets the control and metrics threads serve; `false`
    /// (or dropping them) ends them.
    go: Vec<Sender<bool>>,
    started: Instant,
    restored: Option<Restored>,
    kv_events: Option<KvEvents>,
}

impl Parts {
    /// Starts everything that can fail: the tiers, the control thread and
    /// the metrics endpoint (the threads wait for [`Started::serve`]).
    fn start(self) -> Result<Started, ServeError> {
        let Parts {
            cfg,
            region,
            mut store,
            listener,
            control_lock,
            channels,
            metrics_listener,
            conns,
            shutdown,
            started,
            mut restored,
        } = self;
        let sock = cfg.socket_path.clone();
        let layout = *region.layout();
        let (tx, rx) = events::queue(region.clone());
        let access = Access {
            uid: rustix::process::geteuid().as_raw(),
            allow_gids: cfg.allow_gids.clone(),
            bindings: cfg.tenants.bindings.clone(),
            max_connections: cfg.max_connections.max(1) as usize,
            hello_timeout: cfg.hello_timeout,
            takeover_timeout: cfg.takeover_timeout,
            takeover_pause: cfg.takeover_pause,
        };
        let metrics = Metrics::new(layout.channel_count, layout.ring_capacity);
        if restored.is_some() {
            // The old daemon stops for good before this one serves: the
            // node is healthy from the first scrape on.
            metrics.set_health(crate::metrics::Health::HandingOver);
        }
        // Every tier the daemon is built with counts (and shows zeros in
        // the stats) whether or not it starts.
        for kind in crate::tiers::TIERS {
            kind.register(&metrics);
        }
        // After a takeover the old daemon holds the addresses until it
        // exits: the thread binds as soon as they are free. Started before the
        // tiers: the disk tier publishes its index from its start.
        let kv_events = match &cfg.events {
            Some(ec) => Some(
                crate::kv_events::start(
                    ec,
                    &mut store,
                    metrics.tier::<crate::kv_events::EventCells>(),
                    restored.is_some(),
                )
                .map_err(ServeError::Events)?,
            ),
            None => None,
        };
        let mut tiers: Vec<Box<dyn Tier>> = Vec::new();
        for setup in &cfg.tiers {
            // Taking over: the tier waits (touching nothing) until this
            // daemon serves, and adopts what the old daemon's tier of the
            // same name handed over.
            let adopt = restored
                .as_mut()
                .and_then(|r| r.tier_fds.iter_mut().find(|(name, _)| name == setup.name()))
                .map(|(_, fds)| std::mem::take(fds))
                .unwrap_or_default();
            let at = Start {
                region: region.clone(),
                events: tx.tier_events(tiers.len()),
                metrics: metrics.clone(),
                adopt,
                held: restored.is_some(),
                kv_events: kv_events.as_ref().map(|(sink, _)| sink.tier_sink()),
            };
            tiers.push(setup.start(at).map_err(ServeError::Tier)?);
        }
        let mut go = Vec::new();
        let (control_go, control_start) = mpsc::channel();
        go.push(control_go);
        let control = spawn_control(
            control::Control {
                listener,
                region: region.clone(),
                access,
                channels: channels.clone(),
                events: tx,
                shutdown: shutdown.clone(),
                metrics: metrics.clone(),
                lock: control_lock,
                metrics_listener: dup_listener(metrics_listener.as_ref()),
                conns,
            },
            &sock,
            control_start,
        )?;
        let http = match metrics_listener {
            Some(l) => {
                let addr = l.local_addr().map_err(io_err("reading the metrics address of", &sock))?;
                let (http_go, http_start) = mpsc::channel();
                go.push(http_go);
                let t = crate::http::spawn(l, metrics.clone(), shutdown.clone(), http_start)
                    .map_err(|source| ServeError::Metrics { addr, source })?;
                Some((t, addr))
            }
            None => None,
        };
        Ok(Started {
            cfg,
            region,
            store,
            events: rx,
            channels,
            shutdown,
            control,
            metrics,
            tiers,
            http,
            go,
            started,
            restored,
            kv_events,
        })
    }
}

impl Started {
    /// The instance lock's path.
    fn lock_path(&self) -> PathBuf {
        PathBuf::from(format!("{}.lock", self.cfg.socket_path.display()))
    }

    /// Lets the control and metrics threads serve; the daemon, holding `lock`.
    fn serve(self, lock: crate::lock::InstanceLock) -> Daemon {
        for g in &self.go {
            let _ = g.send(true);
        }
        Daemon {
            cfg: self.cfg,
            region: self.region,
            store: self.store,
            events: self.events,
            channels: self.channels,
            shutdown: self.shutdown,
            control: Some(self.control),
            metrics: self.metrics,
            tiers: self.tiers,
            http: self.http,
            _lock: lock,
            started: self.started,
            restored: self.restored,
            kv_events: self.kv_events,
        }
    }

    /// Ends the threads before they served anything, and the tiers.
    fn abandon(self) {
        drop(self.go);
        let _ = self.control.join();
        if let Some((h, _)) = self.http {
            let _ = h.join();
        }
        drop(self.tiers);
    }
}

/// Starts the control thread, which serves once `true` comes on `start`
/// (`false` or the sender gone: it ends at once).
fn spawn_control(
    ctl: control::Control,
    sock: &Path,
    start: Receiver<bool>,
) -> Result<std::thread::JoinHandle<Option<i32>>, ServeError> {
    std::thread::Builder::new()
        .name("kachedb-control".into())
        .spawn(move || if start.recv() == Ok(true) { control::run(ctl) } else { None })
        .map_err(io_err("spawning the control thread for", sock))
}

/// A second fd of the metrics listener, for a takeover to hand over.
fn dup_listener(l: Option<&std::net::TcpListener>) -> Option<std::os::fd::OwnedFd> {
    l.and_then(|l| l.try_clone().ok()).map(Into::into)
}
