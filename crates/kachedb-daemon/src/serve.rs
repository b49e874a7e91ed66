//! The daemon: owns the region, the store and the serve loop.
//!
//! One thread serves every channel: it pops a batch of submissions from each
//! ring that has work (as many as the client's completion ring has room for),
//! answers them from the [`Store`], publishes the completions once per batch and
//! wakes the client only if it parked. With no work it spins briefly, then
//! parks on the region doorbell (idle CPU ~0 %). Control events (attach, detach,
//! stats) arrive on an mpsc queue from the control thread, which rings the
//! doorbell.

use crate::control::{self, Access, Channels};
use crate::store::Store;
use kachedb_shm::region::{CreateOptions, Layout};
use kachedb_shm::{
    Completion, Consumer, Op, Producer, Region, RegionError, Request, RingError, SpinThenPark, Status,
    TensorBlockDescriptor,
};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Frames handled per channel per pass (bounds latency for the others).
const BATCH: usize = 64;

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

/// Messages from the control thread.
#[derive(Debug)]
pub enum Event {
    /// A client said hello and got `channel`.
    Attach {
        /// Channel.
        channel: u32,
        /// Its socket (to shut down a corrupt client).
        stream: Arc<UnixStream>,
        /// Peer pid.
        pid: i32,
    },
    /// A client's socket closed.
    Detach {
        /// Channel.
        channel: u32,
        /// The daemon closed it (a control protocol error), not the client.
        closed_by_daemon: bool,
    },
    /// Someone asked for stats.
    Stats(Sender<serde_json::Value>),
}

struct Session {
    session: crate::store::SessionId,
    sub: Consumer,
    comp: Producer,
    stream: Arc<UnixStream>,
    pid: i32,
    /// Frames popped whose completions are not yet pushed (completion ring full).
    backlog: Vec<TensorBlockDescriptor>,
    kicked: bool,
}

/// Daemon-level counters (the store has its own).
#[derive(Debug, Default, Clone, serde::Serialize)]
struct Counters {
    ops: u64,
    rejected_frames: u64,
    clients_connected: u64,
    clients_total: u64,
    clients_kicked: u64,
    wakeups_sent: u64,
    parks: u64,
}

/// A started daemon: region made, socket bound, control thread running.
pub struct Daemon {
    cfg: ServeConfig,
    region: Arc<Region>,
    store: Store,
    events: Receiver<Event>,
    channels: Arc<Channels>,
    shutdown: Arc<AtomicBool>,
    control: Option<std::thread::JoinHandle<()>>,
    _lock: std::fs::File,
    started: Instant,
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
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(dir).map_err(io_err("checking the socket directory", dir))?;
    let euid = rustix::process::geteuid().as_raw();
    let why = if md.uid() != euid && md.uid() != 0 {
        format!("it belongs to uid {}", md.uid())
    } else if md.mode() & 0o022 != 0 && md.mode() & 0o1000 == 0 {
        format!(
            "its mode {:o} lets {} write to it",
            md.mode() & 0o7777,
            if md.mode() & 0o002 != 0 { "everyone" } else { "its group" }
        )
    } else {
        return Ok(());
    };
    Err(ServeError::UnsafeSocketDir { dir: dir.display().to_string(), why })
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
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(io_err("opening the lock file", &lock_path))?;
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
            let pid =
                std::fs::read_to_string(&lock_path).ok().map(|p| format!(" by pid {}", p.trim())).unwrap_or_default();
            return Err(ServeError::AlreadyRunning {
                socket: sock.display().to_string(),
                lock: lock_path.display().to_string(),
                pid,
            });
        }
        {
            use std::io::{Seek, Write};
            let mut l = &lock;
            let _ = l.set_len(0);
            let _ = l.seek(std::io::SeekFrom::Start(0));
            let _ = write!(l, "{}", std::process::id());
        }
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
        let (tx, rx) = mpsc::channel();
        let channels = Arc::new(Channels::new(cfg.channels));
        let access = Access { uid: rustix::process::geteuid().as_raw(), allow_gids: cfg.allow_gids.clone() };
        let control = {
            let (region, channels, shutdown) = (region.clone(), channels.clone(), shutdown.clone());
            std::thread::Builder::new()
                .name("kachedb-control".into())
                .spawn(move || control::run(listener, region, access, channels, tx, shutdown))
                .map_err(io_err("spawning the control thread for", &sock))?
        };
        let store = Store::new(layout.slab_offset, layout.slab_len);
        Ok(Daemon {
            cfg,
            region,
            store,
            events: rx,
            channels,
            shutdown,
            control: Some(control),
            _lock: lock,
            started: Instant::now(),
        })
    }

    /// The control socket path.
    pub fn socket_path(&self) -> &Path {
        &self.cfg.socket_path
    }

    /// The region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Serves until the shutdown flag is set; then closes every channel,
    /// removes the socket and returns.
    pub fn run(mut self) {
        let mut sessions: Vec<Option<Session>> = (0..self.cfg.channels).map(|_| None).collect();
        let mut counters = Counters::default();
        let mut req = [TensorBlockDescriptor::default(); BATCH];
        let mut out: Vec<TensorBlockDescriptor> = Vec::with_capacity(BATCH);
        let mut idle_since: Option<Instant> = None;
        let mut loops: u64 = 0;
        let mut rate = RateWindow::default();
        let mut stats_waiting: Vec<Sender<serde_json::Value>> = Vec::new();
        let doorbell_region = self.region.clone();
        let doorbell = doorbell_region.doorbell();
        while !self.shutdown.load(Ordering::Relaxed) {
            let mut did_work = false;
            // Control events.
            while let Ok(ev) = self.events.try_recv() {
                did_work = true;
                match ev {
                    Event::Stats(tx) => stats_waiting.push(tx),
                    ev => self.on_event(ev, &mut sessions, &mut counters, &rate),
                }
            }
            // Rings.
            did_work |= serve_all(&mut self.store, &mut sessions, &mut req, &mut out, &mut counters);
            if !stats_waiting.is_empty() {
                // Answer stats only after serving every frame published before
                // the request (e.g. a fire-and-forget RELEASE), so a client that
                // releases and then asks sees its release counted.
                for _ in 0..256 {
                    if !serve_all(&mut self.store, &mut sessions, &mut req, &mut out, &mut counters) {
                        break;
                    }
                }
                for tx in stats_waiting.drain(..) {
                    let _ = tx.send(self.stats_json(&counters, &rate));
                }
            }
            loops = loops.wrapping_add(1);
            if loops % 1024 == 0 || !did_work {
                rate.tick(counters.ops);
            }
            if did_work {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            let idle = since.elapsed();
            if idle < self.cfg.wait.spin {
                std::hint::spin_loop();
            } else if idle < self.cfg.wait.park_after {
                std::thread::yield_now();
            } else {
                counters.parks += 1;
                // The control thread rings the doorbell after queueing an event,
                // so the ready check must look at the queue too: an event queued
                // between the `try_recv` loop above and the park would otherwise
                // find the cell not yet PARKED (no wake) and wait out the timeout.
                // SYNC: `park`'s SeqCst fence between storing PARKED and this
                // check pairs with the fence in `notify` after the control
                // thread's `send`: either we see the event here, or it sees
                // PARKED and wakes us.
                let events = &self.events;
                let mut first_event = None;
                doorbell.park(
                    || {
                        if let Ok(ev) = events.try_recv() {
                            first_event = Some(ev);
                            return true;
                        }
                        sessions.iter_mut().flatten().any(|s| !s.kicked && (s.sub.has_data() || !s.backlog.is_empty()))
                    },
                    self.cfg.wait.park_timeout,
                );
                match first_event {
                    // The oldest queued event; the rest follow on the next pass.
                    Some(Event::Stats(tx)) => stats_waiting.push(tx),
                    Some(ev) => self.on_event(ev, &mut sessions, &mut counters, &rate),
                    None => {}
                }
            }
        }
        tracing::info!("shutting down: closing {} client channel(s)", sessions.iter().flatten().count());
        for (ch, s) in sessions.iter_mut().enumerate() {
            if let Some(s) = s.take() {
                self.region.close_channel(ch as u32);
                s.comp.notify_consumer();
                let _ = s.stream.shutdown(std::net::Shutdown::Both);
            }
        }
        if let Some(c) = self.control.take() {
            let _ = c.join();
        }
        let _ = std::fs::remove_file(&self.cfg.socket_path);
        let _ = std::fs::remove_file(format!("{}.lock", self.cfg.socket_path.display()));
    }

    fn on_event(&mut self, ev: Event, sessions: &mut [Option<Session>], counters: &mut Counters, rate: &RateWindow) {
        match ev {
            Event::Attach { channel, stream, pid } => {
                let Some(slot) = sessions.get_mut(channel as usize) else { return };
                let Some((sub, comp)) = self.region.daemon_channel(channel) else { return };
                let session = self.store.open_session();
                *slot = Some(Session { session, sub, comp, stream, pid, backlog: Vec::new(), kicked: false });
                counters.clients_connected += 1;
                counters.clients_total += 1;
            }
            Event::Detach { channel, closed_by_daemon } => {
                if let Some(s) = sessions.get_mut(channel as usize).and_then(Option::take) {
                    self.store.close_session(s.session);
                    counters.clients_connected = counters.clients_connected.saturating_sub(1);
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
            Event::Stats(reply) => {
                let _ = reply.send(self.stats_json(counters, rate));
            }
        }
    }

    fn stats_json(&self, counters: &Counters, rate: &RateWindow) -> serde_json::Value {
        let l = self.region.layout();
        let mut v = serde_json::to_value(self.store.stats()).unwrap_or_default();
        if let Some(m) = v.as_object_mut() {
            if let Ok(serde_json::Value::Object(c)) = serde_json::to_value(counters) {
                m.extend(c);
            }
            m.insert("ops_per_s".into(), rate.per_second().into());
            m.insert("region_bytes".into(), l.region_len.into());
            m.insert("slab_bytes".into(), l.slab_len.into());
            m.insert("channels".into(), l.channel_count.into());
            m.insert("ring_capacity".into(), l.ring_capacity.into());
            m.insert("uptime_s".into(), self.started.elapsed().as_secs_f64().into());
            m.insert("daemon_pid".into(), std::process::id().into());
            m.insert("socket".into(), self.cfg.socket_path.display().to_string().into());
            m.insert("invariants_ok".into(), self.store.check_invariants().is_ok().into());
            self.channels.release_exited();
            m.insert("channels_quarantined".into(), self.channels.quarantined().into());
        }
        v
    }
}

/// One pass over every live channel; whether any frame was served.
fn serve_all(
    store: &mut Store,
    sessions: &mut [Option<Session>],
    req: &mut [TensorBlockDescriptor; BATCH],
    out: &mut Vec<TensorBlockDescriptor>,
    counters: &mut Counters,
) -> bool {
    let mut did_work = false;
    for slot in sessions.iter_mut() {
        let Some(s) = slot.as_mut() else { continue };
        if s.kicked {
            continue;
        }
        match serve_channel(store, s, req, out, counters) {
            Ok(n) => did_work |= n > 0,
            Err(e) => {
                tracing::warn!(pid = s.pid, "disconnecting a corrupt client: {e}");
                counters.clients_kicked += 1;
                s.kicked = true;
                // Its socket's EOF brings the Detach that cleans up.
                let _ = s.stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
    did_work
}

/// Handles what one channel has, bounded by room in its completion ring.
fn serve_channel(
    store: &mut Store,
    s: &mut Session,
    req: &mut [TensorBlockDescriptor; BATCH],
    out: &mut Vec<TensorBlockDescriptor>,
    counters: &mut Counters,
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
    let room = s.comp.free_slots()?.min(BATCH);
    if room == 0 {
        return Ok(0);
    }
    let n = s.sub.pop_batch(&mut req[..room])?;
    if n == 0 {
        return Ok(0);
    }
    out.clear();
    for frame in &req[..n] {
        counters.ops += 1;
        let c = match Request::decode(frame) {
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
        out.push(c.encode());
    }
    let pushed = s.comp.push_batch(out)?;
    if pushed < out.len() {
        s.backlog.extend_from_slice(&out[pushed..]);
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
