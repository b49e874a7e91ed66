//! KacheDB blocking Rust client.
//!
//! ```no_run
//! use kachedb_client::{Client, ConnectOptions, Key};
//! let kc = Client::connect(&ConnectOptions::default())?;
//! kc.put(Key::from_bytes(b"prefix-0"), &[1u8, 2, 3])?;
//! let view = kc.get(Key::from_bytes(b"prefix-0"))?.expect("present");
//! assert_eq!(&*view, &[1, 2, 3]);
//! # Ok::<(), kachedb_client::ClientError>(())
//! ```
//!
//! One [`Client`] is one channel (a pair of rings) to the daemon. It can be
//! shared between threads (`Arc<Client>` or `&Client`); operations on one client
//! are serialised by a mutex, so use one client per thread for parallel work.
//! Views ([`BlockView`]) keep their block pinned, and keep the region mapped and
//! the connection open, for as long as they live.
#![warn(missing_docs)]

pub mod key;

pub use kachedb_shm::{DType, Shape};
pub use key::Key;

use kachedb_shm::{
    Completion, Consumer, Op, Producer, Region, RingError, SpinThenPark, Status, TensorBlockDescriptor, Tick,
};
use std::io::{BufRead, BufReader, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// While spinning for a completion, how often to check that the daemon lives.
const LIVENESS_EVERY: Duration = Duration::from_millis(10);

/// Why an operation failed. Messages say what to do.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No committed block has that key.
    #[error("key not found")]
    NotFound,
    /// The store is full of pinned blocks and reservations.
    #[error("out of memory: the store cannot make room (everything left is pinned or reserved); release views or start the daemon with a larger --size")]
    OutOfMemory,
    /// The block is larger than the whole megaslab.
    #[error("the block ({0} bytes) is larger than the daemon's megaslab: start the daemon with a larger --size")]
    TooLarge(u64),
    /// The daemon rejected the request as malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The handle is not one of this client's.
    #[error("bad handle: the reservation or pin is not this client's, or is already gone")]
    BadHandle,
    /// The daemon is gone or the client is closed.
    #[error("disconnected: {0}")]
    Disconnected(String),
    /// The daemon broke an invariant (a bug in the daemon).
    #[error("the daemon reported an internal error; please report it with the daemon's log")]
    Internal,
    /// The daemon spoke nonsense.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The region could not be mapped.
    #[error(transparent)]
    Region(#[from] kachedb_shm::RegionError),
}

fn status_error(status: Status, len: u64) -> ClientError {
    match status {
        Status::Ok => ClientError::Protocol("OK is not an error".into()),
        Status::NotFound => ClientError::NotFound,
        Status::OutOfMemory => ClientError::OutOfMemory,
        Status::TooLarge => ClientError::TooLarge(len),
        Status::Invalid => ClientError::Invalid("the daemon rejected the frame (bad dtype, shape or offset)".into()),
        Status::BadHandle => ClientError::BadHandle,
        Status::Internal => ClientError::Internal,
    }
}

/// Result alias.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// How to connect.
#[derive(Clone, Debug, Default)]
pub struct ConnectOptions {
    /// Control socket; `None` = the default for `instance` (honours `KACHEDB_SOCKET`).
    pub socket: Option<PathBuf>,
    /// Daemon instance.
    pub instance: u32,
    /// How to wait for completions.
    pub wait: SpinThenPark,
}

impl ConnectOptions {
    /// The socket path these options resolve to.
    pub fn socket_path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| kachedb_shm::naming::default_socket_path(self.instance))
    }
}

struct Io {
    sub: Producer,
    comp: Consumer,
    /// Request id of the next frame pushed.
    next_request_id: u32,
    /// Request id the next completion must carry (completions come in order).
    next_expected_id: u32,
    /// Fire-and-forget frames (RELEASEs) pushed but not yet acknowledged;
    /// their completions come before any later request's and are discarded.
    unacked: usize,
    frames: Vec<TensorBlockDescriptor>,
}

struct Inner {
    region: Arc<Region>,
    io: Mutex<Io>,
    /// Pins dropped while `io` was busy; released by the next holder.
    pending_release: Mutex<Vec<u64>>,
    closed: AtomicBool,
    /// Set in a process that inherited this client through `fork()`: the rings
    /// and the connection belong to the parent; touch neither.
    forked: AtomicBool,
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
    channel: u32,
    socket_path: PathBuf,
}

/// A connection to the daemon. See the crate docs.
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("channel", &self.inner.channel).field("socket", &self.inner.socket_path).finish()
    }
}

fn recv_hello(stream: &UnixStream) -> Result<(serde_json::Value, Option<std::os::fd::OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut line = Vec::new();
    let mut fd = None;
    let mut buf = [0u8; 4096];
    while !line.contains(&b'\n') {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut cmsg = RecvAncillaryBuffer::new(&mut space);
        let r =
            rustix::net::recvmsg(stream.as_fd(), &mut [IoSliceMut::new(&mut buf)], &mut cmsg, RecvFlags::CMSG_CLOEXEC)
                .map_err(|e| ClientError::Disconnected(format!("reading the daemon's hello reply: {e}")))?;
        for msg in cmsg.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                for f in fds {
                    fd.get_or_insert(f);
                }
            }
        }
        if r.bytes == 0 {
            return Err(ClientError::Disconnected("the daemon closed the connection during hello".into()));
        }
        line.extend_from_slice(&buf[..r.bytes]);
        if line.len() > 64 * 1024 {
            return Err(ClientError::Protocol("hello reply longer than 64 KiB".into()));
        }
    }
    let end = line.iter().position(|&b| b == b'\n').unwrap_or(line.len());
    let v: serde_json::Value = serde_json::from_slice(&line[..end])
        .map_err(|e| ClientError::Protocol(format!("hello reply is not JSON: {e}")))?;
    Ok((v, fd))
}

fn connect_stream(path: &PathBuf) -> Result<UnixStream> {
    UnixStream::connect(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            // There is a socket, but its mode keeps us out: another user's daemon.
            return ClientError::Disconnected(format!(
                "permission denied connecting to the KacheDB daemon at {} ({e}): it runs as another user; ask its owner to start it with --allow-gid <a group of yours>, or start your own with `kachedb serve --socket <a path of yours>`",
                path.display()
            ));
        }
        ClientError::Disconnected(format!(
            "no KacheDB daemon at {} ({e}): start one with `kachedb serve` (Python: kachedb.connect(start=True))",
            path.display()
        ))
    })
}

/// After a failed write: a daemon that refuses a peer (another uid) answers
/// at once and closes, possibly before the peer wrote anything, so the write
/// fails (EPIPE) while the daemon's reason waits in the receive queue. Returns
/// that reason, if there is one.
fn refusal(stream: &UnixStream) -> Option<String> {
    stream.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).ok()?;
    let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
    if v.get("ok") != Some(&serde_json::Value::Bool(false)) {
        return None;
    }
    Some(v.get("error").and_then(|e| e.as_str()).unwrap_or("no reason given").to_string())
}

/// Asks the daemon at `opts` for its stats (JSON), without taking a channel.
pub fn daemon_stats(opts: &ConnectOptions) -> Result<serde_json::Value> {
    let path = opts.socket_path();
    let stream = connect_stream(&path)?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
    (&stream).write_all(b"{\"op\":\"stats\"}\n").map_err(|e| match refusal(&stream) {
        Some(why) => ClientError::Protocol(format!("\"{why}\"")),
        None => ClientError::Disconnected(e.to_string()),
    })?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(|e| ClientError::Disconnected(e.to_string()))?;
    let v: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| ClientError::Protocol(format!("stats reply is not JSON: {e}")))?;
    if v.get("ok") != Some(&serde_json::Value::Bool(true)) {
        return Err(ClientError::Protocol(v.get("error").map(|e| e.to_string()).unwrap_or_else(|| line.clone())));
    }
    Ok(v.get("stats").cloned().unwrap_or_default())
}

impl Client {
    /// Connects to the daemon, maps its region and takes a channel.
    pub fn connect(opts: &ConnectOptions) -> Result<Client> {
        let path = opts.socket_path();
        let stream = connect_stream(&path)?;
        let hello = serde_json::json!({"op": "hello", "version": 1, "pid": std::process::id()});
        (&stream).write_all(format!("{hello}\n").as_bytes()).map_err(|e| match refusal(&stream) {
            Some(why) => ClientError::Disconnected(format!("the daemon refused the connection: {why}")),
            None => ClientError::Disconnected(format!("sending hello: {e}")),
        })?;
        let (reply, fd) = recv_hello(&stream)?;
        if reply.get("ok") != Some(&serde_json::Value::Bool(true)) {
            let msg = reply.get("error").and_then(|e| e.as_str()).unwrap_or("no reason given");
            return Err(ClientError::Disconnected(format!("the daemon refused the connection: {msg}")));
        }
        let fd = fd.ok_or_else(|| ClientError::Protocol("hello reply carried no region fd".into()))?;
        let region = Region::attach(fd)?;
        if reply.get("generation").and_then(|g| g.as_u64()) != Some(region.generation()) {
            return Err(ClientError::Protocol("region generation does not match the hello reply".into()));
        }
        let channel = reply
            .get("channel")
            .and_then(|c| c.as_u64())
            .and_then(|c| u32::try_from(c).ok())
            .ok_or_else(|| ClientError::Protocol("hello reply has no channel".into()))?;
        let (sub, comp) = region
            .client_channel(channel)
            .ok_or_else(|| ClientError::Protocol(format!("channel {channel} is outside the region")))?;
        let inner = Inner {
            region,
            io: Mutex::new(Io { sub, comp, next_request_id: 1, next_expected_id: 1, unacked: 0, frames: Vec::new() }),
            pending_release: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            forked: AtomicBool::new(false),
            stream: Mutex::new(Some(stream)),
            gone: AtomicBool::new(false),
            wait: opts.wait,
            channel,
            socket_path: path,
        };
        Ok(Client { inner: Arc::new(inner) })
    }

    /// The channel this client holds.
    pub fn channel(&self) -> u32 {
        self.inner.channel
    }

    /// The mapped region.
    pub fn region(&self) -> &Arc<Region> {
        &self.inner.region
    }

    /// Stops this client from starting new operations. The connection (and so
    /// the pins of live views) stays open until the last view is dropped.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Round trip with no effect.
    pub fn ping(&self) -> Result<()> {
        let c = self.inner.call1(TensorBlockDescriptor::request(Op::Ping, 0, 0))?;
        ok_or(c, 0).map(|_| ())
    }

    /// Reserves a block for `key` with `dtype` and `shape`; write it through the
    /// returned [`Reservation`] and commit. `page_offset` (multiple of 64, below
    /// 4096) asks for a data start with that offset within a 4 KiB page, which
    /// makes a copy from a source with the same alignment run at full speed.
    pub fn reserve(&self, key: Key, dtype: DType, shape: &Shape, page_offset: u64) -> Result<Reservation> {
        let len =
            shape.len_bytes(dtype).ok_or_else(|| ClientError::Invalid("shape times itemsize overflows".into()))?;
        let mut f = TensorBlockDescriptor::request(Op::Reserve, 0, key.0);
        f.set_shape(dtype, shape);
        f.offset = page_offset;
        let c = ok_or(self.inner.call1(f)?, len)?;
        let ptr = self.inner.region.slab_ptr(c.offset, len).ok_or_else(|| {
            ClientError::Protocol(format!("daemon returned offset {} outside the megaslab", c.offset))
        })?;
        Ok(Reservation { inner: self.inner.clone(), handle: c.handle, ptr, len, dtype, shape: *shape, done: false })
    }

    /// Stores `bytes` under `key` as a flat `u8` block (one copy into shared memory).
    pub fn put(&self, key: Key, bytes: &[u8]) -> Result<()> {
        let shape = Shape::for_bytes(bytes.len() as u64)
            .ok_or_else(|| ClientError::Invalid("a flat block above 4 GiB must be a multiple of 4096 bytes".into()))?;
        self.put_tensor(key, DType::U8, &shape, bytes)
    }

    /// Stores a tensor's bytes under `key` (one copy into shared memory).
    pub fn put_tensor(&self, key: Key, dtype: DType, shape: &Shape, bytes: &[u8]) -> Result<()> {
        let len =
            shape.len_bytes(dtype).ok_or_else(|| ClientError::Invalid("shape times itemsize overflows".into()))?;
        if len != bytes.len() as u64 {
            return Err(ClientError::Invalid(format!(
                "shape and dtype make {len} bytes but {} were given",
                bytes.len()
            )));
        }
        let mut r = self.reserve(key, dtype, shape, page_offset_of(bytes.as_ptr()))?;
        r.as_mut_slice().copy_from_slice(bytes);
        r.commit()
    }

    /// Stores many flat byte blocks, with one publish per ring-full of frames.
    pub fn put_many(&self, items: &[(Key, &[u8])]) -> Result<()> {
        let mut tensors = Vec::with_capacity(items.len());
        for (key, bytes) in items {
            let shape = Shape::for_bytes(bytes.len() as u64).ok_or_else(|| {
                ClientError::Invalid("a flat block above 4 GiB must be a multiple of 4096 bytes".into())
            })?;
            tensors.push((*key, DType::U8, shape, *bytes));
        }
        self.put_many_tensors(&tensors)
    }

    /// Stores many tensors: all RESERVEs in one batch, the copies, then all
    /// COMMITs in one batch. If any reservation fails, every one of them is
    /// aborted and the first error returned (nothing becomes visible).
    pub fn put_many_tensors(&self, items: &[(Key, DType, Shape, &[u8])]) -> Result<()> {
        let mut frames = Vec::with_capacity(items.len());
        for (key, dtype, shape, bytes) in items {
            let len =
                shape.len_bytes(*dtype).ok_or_else(|| ClientError::Invalid("shape times itemsize overflows".into()))?;
            if len != bytes.len() as u64 {
                return Err(ClientError::Invalid(format!(
                    "shape and dtype make {len} bytes but {} were given",
                    bytes.len()
                )));
            }
            let mut f = TensorBlockDescriptor::request(Op::Reserve, 0, key.0);
            f.set_shape(*dtype, shape);
            f.offset = page_offset_of(bytes.as_ptr());
            frames.push(f);
        }
        let done = self.inner.call_many(&frames)?;
        let mut reservations = Vec::with_capacity(items.len());
        let mut first_err = None;
        for (c, (_, _, _, bytes)) in done.iter().zip(items) {
            match ok_or(*c, bytes.len() as u64) {
                Ok(c) => {
                    reservations.push(c.handle);
                    match self.inner.region.slab_ptr(c.offset, bytes.len() as u64) {
                        // SAFETY: the daemon reserved [offset, offset+len) for this
                        // client alone; it stays allocated until commit or abort.
                        Some(ptr) => unsafe {
                            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.as_ptr(), bytes.len())
                        },
                        None => {
                            first_err.get_or_insert(ClientError::Protocol("reservation outside the megaslab".into()));
                        }
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let op = if first_err.is_some() { Op::Abort } else { Op::Commit };
        let frames: Vec<_> = reservations
            .iter()
            .map(|&h| {
                let mut f = TensorBlockDescriptor::request(op, 0, 0);
                f.handle = h;
                f
            })
            .collect();
        let done = self.inner.call_many(&frames)?;
        if let Some(e) = first_err {
            return Err(e);
        }
        for c in done {
            ok_or(c, 0)?;
        }
        Ok(())
    }

    /// Pins the block under `key` and returns a view of it, or `None`.
    pub fn get(&self, key: Key) -> Result<Option<BlockView>> {
        let c = self.inner.call1(TensorBlockDescriptor::request(Op::Get, 0, key.0))?;
        self.view_of(c)
    }

    /// Pins many blocks with one publish per ring-full of frames.
    pub fn get_many(&self, keys: &[Key]) -> Result<Vec<Option<BlockView>>> {
        let frames: Vec<_> = keys.iter().map(|k| TensorBlockDescriptor::request(Op::Get, 0, k.0)).collect();
        let done = self.inner.call_many(&frames)?;
        done.into_iter().map(|c| self.view_of(c)).collect()
    }

    fn view_of(&self, c: Completion) -> Result<Option<BlockView>> {
        if c.status == Status::NotFound {
            return Ok(None);
        }
        let c = ok_or(c, 0)?;
        let Some((dtype, shape, len)) = c.tensor else {
            return Err(ClientError::Protocol("GET completion without dtype and shape".into()));
        };
        let Some(ptr) = self.inner.region.slab_ptr(c.offset, len) else {
            // Give the pin back before failing.
            self.inner.release(c.handle);
            return Err(ClientError::Protocol(format!("daemon returned offset {} outside the megaslab", c.offset)));
        };
        Ok(Some(BlockView { inner: self.inner.clone(), handle: c.handle, ptr, len, dtype, shape }))
    }

    /// How many leading keys of `keys` are present (a prefix-cache hash chain).
    pub fn lookup(&self, keys: &[Key]) -> Result<usize> {
        let frames: Vec<_> = keys.iter().map(|k| TensorBlockDescriptor::request(Op::Lookup, 0, k.0)).collect();
        let done = self.inner.call_many(&frames)?;
        Ok(done.iter().take_while(|c| c.status == Status::Ok).count())
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: Key) -> Result<bool> {
        Ok(self.lookup(&[key])? == 1)
    }

    /// Unlinks `key`; returns whether it was present.
    pub fn delete(&self, key: Key) -> Result<bool> {
        let c = self.inner.call1(TensorBlockDescriptor::request(Op::Delete, 0, key.0))?;
        match c.status {
            Status::Ok => Ok(true),
            Status::NotFound => Ok(false),
            s => Err(status_error(s, 0)),
        }
    }

    /// Full daemon stats over the control socket.
    pub fn stats(&self) -> Result<serde_json::Value> {
        daemon_stats(&ConnectOptions { socket: Some(self.inner.socket_path.clone()), ..Default::default() })
    }

    /// Sends raw frames as they are (no validation) and returns the raw
    /// completions: for tests of the daemon's handling of malformed input.
    pub fn call_raw(&self, frames: &[TensorBlockDescriptor]) -> Result<Vec<TensorBlockDescriptor>> {
        self.inner.call_raw(frames)
    }

    /// For a process that inherited this client through `fork()`: forgets the
    /// connection without touching the rings (which belong to the parent) and
    /// closes this process's copy of the socket, so the daemon still sees the
    /// parent's exit. Every later call fails with `Disconnected`; views
    /// inherited from the parent stay readable but release nothing.
    pub fn forget_after_fork(&self) {
        self.inner.forked.store(true, Ordering::Release);
        self.inner.closed.store(true, Ordering::Release);
        if let Ok(mut s) = self.inner.stream.lock() {
            s.take();
        }
    }
}

fn page_offset_of(p: *const u8) -> u64 {
    (p as u64 % 4096) & !63
}

fn ok_or(c: Completion, len: u64) -> Result<Completion> {
    if c.status == Status::Ok {
        Ok(c)
    } else {
        Err(status_error(c.status, len))
    }
}

impl Inner {
    fn lock(&self) -> Result<MutexGuard<'_, Io>> {
        if self.forked.load(Ordering::Acquire) {
            return Err(ClientError::Disconnected(
                "this client was inherited through fork(): connect again in this process".into(),
            ));
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(ClientError::Disconnected("the client is closed: connect again".into()));
        }
        self.io.lock().map_err(|_| ClientError::Disconnected("a thread panicked while using this client".into()))
    }

    fn call1(&self, f: TensorBlockDescriptor) -> Result<Completion> {
        let mut v = self.call_many(std::slice::from_ref(&f))?;
        v.pop().ok_or_else(|| ClientError::Protocol("no completion".into()))
    }

    fn call_many(&self, frames: &[TensorBlockDescriptor]) -> Result<Vec<Completion>> {
        let raw = self.call_raw(frames)?;
        raw.iter()
            .map(|d| {
                Completion::decode(d).map_err(|e| ClientError::Protocol(format!("daemon sent a bad completion: {e}")))
            })
            .collect()
    }

    fn call_raw(&self, frames: &[TensorBlockDescriptor]) -> Result<Vec<TensorBlockDescriptor>> {
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

    /// Pushes `frames` (request ids assigned here) and collects one completion
    /// each, in order.
    fn exchange(
        &self,
        io: &mut Io,
        frames: &[TensorBlockDescriptor],
        keep: bool,
    ) -> Result<Vec<TensorBlockDescriptor>> {
        if self.forked.load(Ordering::Acquire) {
            return Err(ClientError::Disconnected(
                "this client was inherited through fork(): connect again in this process".into(),
            ));
        }
        if self.gone.load(Ordering::Acquire) {
            return Err(self.gone_error());
        }
        let mut out = Vec::with_capacity(if keep { frames.len() } else { 0 });
        let mut sent = 0usize;
        let mut received = 0usize;
        let first_id = io.next_request_id;
        io.frames.clear();
        io.frames.extend_from_slice(frames);
        for (i, f) in io.frames.iter_mut().enumerate() {
            f.request_id = first_id.wrapping_add(i as u32);
        }
        io.next_request_id = first_id.wrapping_add(frames.len() as u32);
        let mut buf = [TensorBlockDescriptor::default(); 64];
        while received < frames.len() || io.unacked > 0 {
            if sent < frames.len() {
                let Io { sub, frames: fr, .. } = &mut *io;
                let n = sub.push_batch(&fr[sent..]).map_err(|e| self.ring_err(e))?;
                if n > 0 {
                    sent += n;
                    self.region.doorbell().notify();
                }
            }
            let want = (io.unacked + sent - received).min(buf.len());
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
            let got = self.wait.wait(
                // The completion ring's line-0 cell: the daemon notifies it.
                self.region
                    .completion_wait_cell(self.channel)
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
            )?;
            if let Some(e) = dead {
                return Err(e);
            }
            let got = got.map_err(|e| self.ring_err(e))?;
            for d in &buf[..got] {
                self.check_order(io, d)?;
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
        debug_assert_eq!(io.next_expected_id, first_id.wrapping_add(frames.len() as u32));
        Ok(out)
    }

    fn check_order(&self, io: &mut Io, d: &TensorBlockDescriptor) -> Result<()> {
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

    /// Pushes fire-and-forget frames (RELEASEs): no wait for their
    /// completions, which later calls discard. Falls back to waiting when the
    /// ring is full.
    fn post(&self, io: &mut Io, frames: &[TensorBlockDescriptor]) -> Result<()> {
        if self.forked.load(Ordering::Acquire) || self.gone.load(Ordering::Acquire) {
            return Ok(()); // nothing to release: the parent's, or a dead daemon's
        }
        // Discard acknowledgements that are already there (no waiting).
        let mut buf = [TensorBlockDescriptor::default(); 64];
        while io.unacked > 0 {
            let want = io.unacked.min(buf.len());
            let n = io.comp.pop_batch(&mut buf[..want]).map_err(|e| self.ring_err(e))?;
            if n == 0 {
                break;
            }
            for d in &buf[..n] {
                self.check_order(io, d)?;
            }
            io.unacked -= n;
        }
        let first_id = io.next_request_id;
        io.frames.clear();
        io.frames.extend_from_slice(frames);
        for (i, f) in io.frames.iter_mut().enumerate() {
            f.request_id = first_id.wrapping_add(i as u32);
        }
        let Io { sub, frames: fr, .. } = &mut *io;
        let n = sub.push_batch(fr).map_err(|e| self.ring_err(e))?;
        io.next_request_id = first_id.wrapping_add(n as u32);
        io.unacked += n;
        if n > 0 {
            self.region.doorbell().notify();
        }
        if n < frames.len() {
            // The ring is full: wait for room the ordinary way.
            self.exchange(io, &frames[n..], false)?;
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

    fn release(&self, handle: u64) {
        // A closed client still releases the pins of its live views.
        match self.io.try_lock() {
            Ok(mut io) => {
                let mut f = TensorBlockDescriptor::request(Op::Release, 0, 0);
                f.handle = handle;
                if self.post(&mut io, &[f]).is_err() {
                    self.closed.store(true, Ordering::Release);
                }
                self.flush_releases(&mut io);
                drop(io);
                self.after_unlock();
            }
            Err(_) => {
                if let Ok(mut p) = self.pending_release.lock() {
                    p.push(handle);
                }
                self.after_unlock();
            }
        }
    }

    fn flush_releases(&self, io: &mut Io) {
        let handles = match self.pending_release.lock() {
            Ok(mut p) if !p.is_empty() => std::mem::take(&mut *p),
            _ => return,
        };
        let frames: Vec<_> = handles
            .iter()
            .map(|&h| {
                let mut f = TensorBlockDescriptor::request(Op::Release, 0, 0);
                f.handle = h;
                f
            })
            .collect();
        if self.post(io, &frames).is_err() {
            self.closed.store(true, Ordering::Release);
        }
    }

    /// A release queued while we held the lock would otherwise wait for the
    /// next operation: take the lock again if it is free and flush.
    fn after_unlock(&self) {
        loop {
            let pending = self.pending_release.lock().map(|p| !p.is_empty()).unwrap_or(false);
            if !pending {
                return;
            }
            match self.io.try_lock() {
                Ok(mut io) => self.flush_releases(&mut io),
                Err(_) => return, // the holder flushes before it unlocks
            }
        }
    }
}

/// A pinned, immutable view of a committed block. Dropping it releases the pin.
pub struct BlockView {
    inner: Arc<Inner>,
    handle: u64,
    ptr: NonNull<u8>,
    len: u64,
    dtype: DType,
    shape: Shape,
}

// SAFETY: the view points into a mapping kept alive by `inner.region`; the
// block is committed (immutable) and pinned, so no one writes it while it lives.
unsafe impl Send for BlockView {}
// SAFETY: as above; shared access is read-only.
unsafe impl Sync for BlockView {}

impl std::fmt::Debug for BlockView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockView")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape.dims())
            .field("len", &self.len)
            .finish()
    }
}

impl BlockView {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Whether the block has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Address of the first byte in this process.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    /// The pin handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }
    /// Bytes from the region base.
    pub fn offset(&self) -> u64 {
        self.ptr.as_ptr() as u64 - self.inner.region.base() as u64
    }
}

impl std::ops::Deref for BlockView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: [ptr, ptr+len) is inside the mapping (checked by slab_ptr when
        // the view was made), kept mapped by `inner`, and immutable while pinned.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len as usize) }
    }
}

impl Drop for BlockView {
    fn drop(&mut self) {
        self.inner.release(self.handle);
    }
}

/// A reserved, not yet visible block. Write it, then [`commit`](Self::commit);
/// dropped without commit, it is aborted.
pub struct Reservation {
    inner: Arc<Inner>,
    handle: u64,
    ptr: NonNull<u8>,
    len: u64,
    dtype: DType,
    shape: Shape,
    done: bool,
}

// SAFETY: the reserved extent belongs to this reservation alone until commit or
// abort, inside a mapping kept alive by `inner`.
unsafe impl Send for Reservation {}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation").field("dtype", &self.dtype).field("shape", &self.shape.dims()).finish()
    }
}

impl Reservation {
    /// The writable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the extent is reserved for this client alone (no reader can see
        // it before commit) and mapped while `inner` lives; `&mut self` makes the
        // slice unique in this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len as usize) }
    }
    /// Address of the first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Whether the block has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The reservation handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }
    /// Makes the block visible under its key.
    pub fn commit(mut self) -> Result<()> {
        self.done = true;
        self.finish(Op::Commit)
    }
    /// Drops the block.
    pub fn abort(mut self) -> Result<()> {
        self.done = true;
        self.finish(Op::Abort)
    }
    fn finish(&self, op: Op) -> Result<()> {
        let mut f = TensorBlockDescriptor::request(op, 0, 0);
        f.handle = self.handle;
        let mut io = self
            .inner
            .io
            .lock()
            .map_err(|_| ClientError::Disconnected("a thread panicked while using this client".into()))?;
        let r = self.inner.exchange(&mut io, &[f], true);
        self.inner.flush_releases(&mut io);
        drop(io);
        self.inner.after_unlock();
        let d = r?.pop().ok_or_else(|| ClientError::Protocol("no completion".into()))?;
        let c = Completion::decode(&d).map_err(|e| ClientError::Protocol(e.to_string()))?;
        ok_or(c, self.len).map(|_| ())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.finish(Op::Abort);
        }
    }
}
