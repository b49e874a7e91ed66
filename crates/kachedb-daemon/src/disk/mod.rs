//! The disk tier: local files under one directory behind the megaslab
//! (`kachedb serve --disk DIR --disk-size SIZE`, docs/disk.md). More cache
//! than RAM, and a cache that survives the daemon's death.
//!
//! The serve loop never touches the disk. It hands work to this module's
//! [`DiskTier`] through the tier interface ([`Tier`], `crate::tier`); the
//! work runs on the tier's own threads (`kachedb-disk`, nicer than the serve
//! loop by [`DiskConfig::worker_nice`]) and reports [`TierEvent`]s on the
//! loop's event queue:
//!
//! * **Write-behind** (writer threads): for each block a client commits, the
//!   serve loop pins it for the tier's session and queues a [`WriteJob`] (or
//!   drops it, counted, when the queue's bytes would pass
//!   [`DiskConfig::queue_bytes`]). A writer takes the jobs queued one
//!   behind the other as a batch ([`write_batch`], a group commit): for each
//!   it makes room ([`index`]: leaves first, within the limit of the block's
//!   tenant, whose name the header carries) and writes the header and the
//!   pinned bytes to a temporary file, then `fdatasync`s each file and drops
//!   its pages from the page cache (`POSIX_FADV_DONTNEED`), renames each into
//!   place and syncs the directory once; only then are the blocks counted
//!   written (`disk_writes`) and indexed. The pins go back with
//!   [`TierEvent::Written`].
//! * **Fill** (reader threads): a local miss's [`FetchJob`] is looked up by
//!   file name (no index needed, so fills work while the index is being
//!   rebuilt); each header is read and checked ([`format`]), the serve loop
//!   reserves room ([`TierEvent::Reserve`]), the payload is read straight
//!   into the reservation and hashed there; a block that does not verify is
//!   left out (its file deleted, counted in `disk_torn`) and its reservation
//!   aborted. [`TierEvent::Filled`] commits the rest with their parents, each
//!   counted for the tenant its header names ([`FillSpec::tenant`]).
//! * **Delete** (writer threads): a client's DELETE of a key reaches the
//!   tier ([`Tier::delete`]) as a tombstone, at once: fills treat the key as
//!   missing from then on, and a write of it queued before the DELETE does
//!   not land (see [`Deletes`]); a writer then removes the file and the
//!   index entry.
//! * **Start**: the directory is locked (`DIR/lock`, `flock`, holding the
//!   pid), `DIR/tmp` (unfinished writes) is emptied and the index is rebuilt
//!   from the headers of `DIR/blocks` on a thread of its own (one open and
//!   one 256-byte read per file; payloads are checked at fill time); writes
//!   wait for it, fills do not.
//!
//! The megaslab is touched only under the read side of a gate
//! (`Shared::running`); [`Tier::stop`] takes the write side, so once it
//! returns no thread of the tier reads a pin or writes a reservation.
//!
//! I/O: plain `pread`/`pwrite` from a few threads, buffered, with
//! `sync_file_range` (write-out started as each piece is copied),
//! `fdatasync` + `POSIX_FADV_DONTNEED` so the page cache does not keep a
//! second copy of the KV (docs/disk.md says why not `O_DIRECT` or io_uring).

pub mod format;
pub mod index;

use crate::metrics::{DiskCells, Metrics};
use crate::tier::{
    Admission, FetchJob, FillSpec, StoppedTier, Tier, TierError, TierEvent, TierEvents, TierKind, WriteJob,
};
use format::Header;
use index::Index;
use kachedb_shm::Region;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Default bound of the write-behind queue, bytes.
pub const DEFAULT_QUEUE_BYTES: u64 = 1 << 30;
/// Default longest wait for a disk fill before its keys count as misses.
pub const DEFAULT_TIMEOUT_MS: u64 = 2000;
/// Default of how much nicer than the daemon the tier's threads run.
pub const DEFAULT_WORKER_NICE: u8 = 10;
/// The name of the tier's threads.
pub const THREAD_NAME: &str = "kachedb-disk";
/// Writer threads (one syncs while the other copies).
const WRITERS: usize = 2;
/// Most blocks a writer takes from the queue at once and makes durable
/// together: their data synced file by file, then renamed into place, then
/// one `fsync` of the directory for all of them (a group commit).
const BATCH_BLOCKS: usize = 64;
/// Most tensor bytes of such a batch beyond its first block.
const BATCH_BYTES: u64 = 16 << 20;
/// A block's bytes are copied to its file in pieces of this size, each
/// handed to the disk (`sync_file_range`) as soon as it is copied, so the
/// device writes one piece while the next is copied.
const WRITE_PIECE_BYTES: u64 = 8 << 20;
/// Reader threads.
const READERS: usize = 2;
/// Threads reading headers at start.
const INDEX_THREADS: usize = 8;
/// Block files up to this size are asked for ahead, whole
/// (`POSIX_FADV_WILLNEED`), when a fetch starts.
const WILLNEED_MAX_BYTES: u64 = 8 << 20;

/// How the disk tier is set up (`kachedb serve --disk …`).
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// Most file-system bytes the blocks may take (`--disk-size`).
    pub size_bytes: u64,
    /// Most tensor bytes queued for writing (beyond: writes are dropped).
    pub queue_bytes: u64,
    /// Longest a fill may take before the serve loop stops waiting for it.
    pub timeout: Duration,
    /// How much nicer (`setpriority`) than the thread that starts the tier
    /// its threads run, capped at nice 19; 0: the same priority.
    pub worker_nice: u8,
    /// The scheduling class of the tier's threads (`--disk-worker-class`).
    pub worker_class: WorkerClass,
    /// Which committed blocks are written (`--disk-admit`).
    pub admission: Admission,
    /// The tenants' limits on disk bytes (`--tenant-disk-limit`, or their
    /// share by `--tenant-limit`; docs/disk.md "Tenants").
    pub tenant_limits: index::Limits,
}

/// The scheduling class the tier's threads run in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WorkerClass {
    /// `SCHED_IDLE`: a thread runs only on a core no thread of the normal
    /// class wants (the serve loop and the clients), and a thread of that
    /// class waking up preempts it at once; the nice value still sets the
    /// threads' default I/O priority.
    #[default]
    Idle,
    /// `SCHED_OTHER` at the nice value (`worker_nice`): the kernel shares a
    /// busy core between the serve loop and the tier by weight.
    Normal,
}

/// Why the disk tier could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// An option is wrong.
    #[error("disk tier: {0}")]
    Config(String),
    /// Another daemon uses the directory.
    #[error("disk tier: {dir} is in use by another kachedb daemon (pid {pid}; lock {dir}/lock is held): stop it, or give this daemon another --disk directory")]
    InUse {
        /// The directory.
        dir: String,
        /// What the lock file says (the holder's pid), if readable.
        pid: String,
    },
    /// The directory could not be made, opened or locked.
    #[error("disk tier: {what} {path}: {source}")]
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

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> DiskError + 'a {
    move |source| DiskError::Io { what, path: path.display().to_string(), source }
}

/// The directory's lock: `DIR/lock`, `flock`ed for the tier's life and
/// holding the holder's pid, so that two daemons never use one directory.
/// The file is never removed (so a lock is always on the inode the path
/// names) and is held through a read-only descriptor (so the file system
/// can be remounted read-only under a running daemon). Dropping it lets go.
#[derive(Debug)]
struct DirLock {
    _fd: std::os::fd::OwnedFd,
}

impl DirLock {
    fn acquire(dir: &Path) -> Result<DirLock, DiskError> {
        use rustix::fs::{FlockOperation, Mode, OFlags};
        let path = dir.join("lock");
        let fd = rustix::fs::open(
            &path,
            OFlags::RDONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io_err("opening the lock", &path)(e.into()))?;
        if rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive).is_err() {
            let pid = std::fs::read_to_string(&path).unwrap_or_default().trim().to_string();
            return Err(DiskError::InUse {
                dir: dir.display().to_string(),
                pid: if pid.is_empty() { "unknown".into() } else { pid },
            });
        }
        std::fs::write(&path, std::process::id().to_string()).map_err(io_err("writing the lock", &path))?;
        Ok(DirLock { _fd: fd })
    }
}

/// A queue the tier's threads wait on.
struct Queue<T> {
    items: Mutex<VecDeque<T>>,
    ready: Condvar,
}

impl<T> Queue<T> {
    fn new() -> Queue<T> {
        Queue { items: Mutex::new(VecDeque::new()), ready: Condvar::new() }
    }

    fn push(&self, item: T) {
        lock(&self.items).push_back(item);
        self.ready.notify_one();
    }

    /// The items at the front, without waiting, while `take` accepts them.
    fn pop_while(&self, mut take: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut q = lock(&self.items);
        let mut out = Vec::new();
        while q.front().is_some_and(&mut take) {
            out.extend(q.pop_front());
        }
        out
    }

    /// The next item, waiting for one; `None` once `stop` is set.
    fn pop(&self, stop: &AtomicBool) -> Option<T> {
        let mut q = lock(&self.items);
        loop {
            // Relaxed: the flag is set before `notify_all` under this mutex
            // (see `Shared::halt`), and the mutex orders the two.
            if stop.load(Relaxed) {
                return None;
            }
            if let Some(item) = q.pop_front() {
                return Some(item);
            }
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Work for the writer threads, in the order the serve loop asked for it.
enum Job {
    /// Write a block; the number orders it against deletes ([`Deletes`]).
    Write(WriteJob, u64),
    /// A client deleted the key (the tombstone numbered so): remove the file.
    Delete(u128, u64),
}

/// A client's DELETE of a key, until every write it must win against is over.
#[derive(Clone, Copy, Debug)]
struct Tomb {
    /// Its number ([`Deletes::last`] when it was made).
    seq: u64,
    /// The key's file and index entry are gone, or were replaced by a
    /// newer write's.
    done: bool,
}

/// Orders writes and deletes of a key, which run on several threads, as the
/// serve loop asked for them. Each write-behind and each delete gets the
/// next number; a delete leaves a tombstone for its key. A fill never reads
/// a key with a tombstone (a miss). A write numbered before the tombstone
/// does not land (checked under [`Shared::commit`] just before its rename);
/// a write numbered after it lands and replaces the file, doing the
/// delete's work. The tombstone goes once the delete's work is done and no
/// write numbered before it is still queued or running, so the map holds
/// only the keys deleted while writes were behind.
///
/// The serve loop takes this mutex (a map operation per commit and per
/// DELETE); nothing holds it while doing I/O.
#[derive(Debug, Default)]
struct Deletes {
    /// The last number given out.
    last: u64,
    /// The numbers of the writes queued or running.
    writes: BTreeSet<u64>,
    tombs: HashMap<u128, Tomb>,
}

impl Deletes {
    fn next(&mut self) -> u64 {
        self.last += 1;
        self.last
    }

    /// Drops the tombstones no write still needs to see.
    fn prune(&mut self) {
        let oldest = self.writes.first().copied().unwrap_or(u64::MAX);
        self.tombs.retain(|_, t| !t.done || t.seq > oldest);
    }
}

/// Locks `m`, taking it over from a thread that panicked while holding it
/// (the data under these mutexes stays consistent between statements).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the tier's threads share.
struct Shared {
    cfg: DiskConfig,
    blocks_dir: PathBuf,
    tmp_dir: PathBuf,
    region: Arc<Region>,
    events: TierEvents,
    metrics: Arc<Metrics>,
    index: Mutex<Index>,
    /// Writes and deletes in the order the serve loop asked for them.
    deletes: Mutex<Deletes>,
    /// Held by a writer thread across the last check of [`Deletes`] and the
    /// rename or unlink of a block file, so that two of them on one key
    /// happen in the order they were checked. Never taken by the serve loop.
    commit: Mutex<()>,
    /// Whether the start-up index rebuild is done (writers wait for it).
    indexed: Mutex<bool>,
    indexed_cv: Condvar,
    writes: Queue<Job>,
    fetches: Queue<FetchJob>,
    /// Set by [`Shared::halt`]: the threads stop taking work.
    stop: AtomicBool,
    /// The megaslab gate: `true` while the tier runs. Held for reading while
    /// a thread reads a pinned block or writes a reservation; the write side
    /// sets it to `false` (see the module docs).
    running: RwLock<bool>,
    /// Numbers temporary files.
    tmp_seq: AtomicU64,
}

impl Shared {
    fn cells(&self) -> &DiskCells {
        &self.metrics.disk
    }

    /// Publishes the index's block and byte counts, in total and per
    /// tenant (together, under the tenants' mutex, so that a reader holding
    /// it sees rows that add up to the totals).
    fn publish(&self, ix: &Index) {
        let mut tenants = lock(&self.cells().tenants);
        *tenants = ix.tenants();
        self.cells().blocks.store(ix.blocks(), Relaxed);
        self.cells().bytes.store(ix.used(), Relaxed);
    }

    /// Stops the threads taking work and closes the megaslab gate (waiting
    /// for a copy in progress); the queued writes are dropped (counted).
    fn halt(&self) {
        {
            let _q = lock(&self.writes.items);
            let _f = lock(&self.fetches.items);
            // Relaxed: read under these mutexes by `Queue::pop`.
            self.stop.store(true, Relaxed);
        }
        self.writes.ready.notify_all();
        self.fetches.ready.notify_all();
        self.indexed_cv.notify_all();
        *self.running.write().unwrap_or_else(|e| e.into_inner()) = false;
        let dropped: Vec<Job> = lock(&self.writes.items).drain(..).collect();
        let cells = self.cells();
        for j in &dropped {
            match j {
                Job::Write(j, _) => {
                    DiskCells::add(&cells.dropped_writes, 1);
                    cells.queue_bytes.fetch_sub(j.len, Relaxed);
                    cells.queue_blocks.fetch_sub(1, Relaxed);
                }
                // A deleted key stays deleted for the daemon that opens the
                // directory next (no write can land any more: the threads stopped).
                Job::Delete(key, _) => {
                    let _ = std::fs::remove_file(format::block_path(&self.blocks_dir, *key));
                }
            }
        }
        lock(&self.fetches.items).clear();
    }
}

/// The serve loop's handle on the disk tier. Dropping it stops its threads'
/// work and lets go of the directory's lock (queued writes are lost; the
/// daemon is going away).
pub struct DiskTier {
    shared: Arc<Shared>,
    lock: Option<DirLock>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").field("cfg", &self.shared.cfg).finish()
    }
}

/// The nice value the tier's threads get: the calling thread's raised by
/// `by`, capped at 19; `None` when `by` is 0.
fn worker_nice_value(by: u8) -> Option<i32> {
    if by == 0 {
        return None;
    }
    let own = rustix::process::getpriority_process(None).unwrap_or(0);
    Some((own + i32::from(by)).min(19))
}

/// Puts the calling thread in the `SCHED_IDLE` class (see [`WorkerClass::Idle`]).
pub fn set_sched_idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: FFI call on the calling thread (pid 0) with a valid pointer to
    // a `sched_param` that lives across the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl DiskTier {
    /// Checks `cfg`, makes and locks the directory and starts the tier's
    /// threads (the index is rebuilt in the background).
    pub fn start(
        cfg: DiskConfig,
        region: Arc<Region>,
        events: TierEvents,
        metrics: Arc<Metrics>,
    ) -> Result<DiskTier, DiskError> {
        if cfg.size_bytes < format::HEADER_AREA * 2 {
            return Err(DiskError::Config(format!("--disk-size {} is too small", cfg.size_bytes)));
        }
        if cfg.timeout.is_zero() {
            return Err(DiskError::Config("the timeout must be above zero".into()));
        }
        if cfg.worker_nice > 19 {
            return Err(DiskError::Config(format!("worker nice {} above 19", cfg.worker_nice)));
        }
        let dir = &cfg.dir;
        std::fs::create_dir_all(dir).map_err(io_err("making the directory", dir))?;
        let lock = DirLock::acquire(dir)?;
        let blocks_dir = dir.join("blocks");
        let tmp_dir = dir.join("tmp");
        for d in [&blocks_dir, &tmp_dir] {
            std::fs::create_dir_all(d).map_err(io_err("making the directory", d))?;
        }
        let cells = &metrics.disk;
        cells.enabled.store(true, Relaxed);
        cells.capacity_bytes.store(cfg.size_bytes, Relaxed);
        cells.indexed.store(false, Relaxed);
        cells.index_us.store(0, Relaxed);
        let shared = Arc::new(Shared {
            index: Mutex::new(Index::new(cfg.size_bytes, &cfg.tenant_limits)),
            deletes: Mutex::new(Deletes::default()),
            commit: Mutex::new(()),
            cfg,
            blocks_dir,
            tmp_dir,
            region,
            events,
            metrics,
            indexed: Mutex::new(false),
            indexed_cv: Condvar::new(),
            writes: Queue::new(),
            fetches: Queue::new(),
            stop: AtomicBool::new(false),
            running: RwLock::new(true),
            tmp_seq: AtomicU64::new(0),
        });
        let nice = worker_nice_value(shared.cfg.worker_nice);
        let class = shared.cfg.worker_class;
        let spawn = |f: fn(&Shared)| {
            let s = shared.clone();
            std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || {
                if let Some(n) = nice {
                    if let Err(e) = rustix::process::setpriority_process(None, n) {
                        tracing::warn!("disk tier: setting its threads' nice value to {n}: {e}");
                    }
                }
                if class == WorkerClass::Idle {
                    if let Err(e) = set_sched_idle() {
                        tracing::warn!("disk tier: running its threads SCHED_IDLE: {e}");
                    }
                }
                f(&s)
            })
        };
        let started = (|| -> std::io::Result<()> {
            spawn(rebuild_index)?;
            for _ in 0..WRITERS {
                spawn(write_loop)?;
            }
            for _ in 0..READERS {
                spawn(read_loop)?;
            }
            Ok(())
        })();
        if let Err(e) = started {
            shared.halt();
            drop(lock);
            return Err(io_err("starting the threads for", &shared.cfg.dir)(e));
        }
        Ok(DiskTier { shared, lock: Some(lock) })
    }
}

impl Tier for DiskTier {
    /// Takes the block if the write-behind queue's bytes stay within the
    /// bound and the block fits on the disk at all; otherwise counts it in
    /// `disk_dropped_writes`.
    fn write_behind(&self, len: u64, pinned: &mut dyn FnMut() -> Option<WriteJob>) {
        let cells = self.shared.cells();
        let fits = index::disk_bytes(format::file_len(len)) <= self.shared.cfg.size_bytes;
        // One writer of increments (the serve loop), workers only subtract:
        // this load-then-add never lets the sum pass the bound.
        if !fits || cells.queue_bytes.load(Relaxed).saturating_add(len) > self.shared.cfg.queue_bytes {
            DiskCells::add(&cells.dropped_writes, 1);
            return;
        }
        let Some(job) = pinned() else {
            DiskCells::add(&cells.dropped_writes, 1);
            return;
        };
        cells.queue_bytes.fetch_add(len, Relaxed);
        DiskCells::add(&cells.queue_blocks, 1);
        let seq = {
            let mut d = lock(&self.shared.deletes);
            let seq = d.next();
            d.writes.insert(seq);
            seq
        };
        self.shared.writes.push(Job::Write(job, seq));
    }

    fn fetch(&self, job: FetchJob) {
        DiskCells::add(&self.shared.cells().fetches, 1);
        self.shared.fetches.push(job);
    }

    fn fetch_bound(&self) -> Duration {
        self.shared.cfg.timeout
    }

    fn landed(&self, len: u64) {
        DiskCells::add(&self.shared.cells().fills, 1);
        DiskCells::add(&self.shared.cells().fill_bytes, len);
    }

    fn kind(&self) -> TierKind {
        TierKind::Disk
    }

    fn admission(&self) -> Admission {
        self.shared.cfg.admission
    }

    /// Leaves a tombstone for `key` (fills miss it from now on, earlier
    /// writes of it do not land) and queues the removal of its file.
    fn delete(&self, key: u128) {
        let seq = {
            let mut d = lock(&self.shared.deletes);
            let seq = d.next();
            d.tombs.insert(key, Tomb { seq, done: false });
            seq
        };
        self.shared.writes.push(Job::Delete(key, seq));
    }

    fn timed_out(&self) {
        DiskCells::add(&self.shared.cells().fetches_timed_out, 1);
    }

    /// Stops the threads' work (waiting for a copy in progress), drops the
    /// queued writes (counted in `disk_dropped_writes`) and lets go of the
    /// directory's lock, so that the daemon taking over can open it. The
    /// blocks on disk stay: the new daemon's tier indexes them.
    fn stop(mut self: Box<Self>) -> Box<dyn StoppedTier> {
        self.shared.halt();
        drop(self.lock.take());
        Box::new(StoppedDisk {
            cfg: self.shared.cfg.clone(),
            region: self.shared.region.clone(),
            events: self.shared.events.clone(),
            metrics: self.shared.metrics.clone(),
        })
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if let Some(l) = self.lock.take() {
            self.shared.halt();
            drop(l);
        }
    }
}

/// The disk tier stopped for a takeover: what it needs to start again.
#[derive(Debug)]
struct StoppedDisk {
    cfg: DiskConfig,
    region: Arc<Region>,
    events: TierEvents,
    metrics: Arc<Metrics>,
}

impl StoppedTier for StoppedDisk {
    fn resume(self: Box<Self>) -> Result<Box<dyn Tier>, TierError> {
        Ok(Box::new(DiskTier::start(self.cfg, self.region, self.events, self.metrics)?))
    }
}

/// Drops a file's pages from the page cache (clean pages go at once: call
/// after the data is synced or only read).
fn drop_cache(f: &File) {
    let _ = rustix::fs::fadvise(f, 0, None, rustix::fs::Advice::DontNeed);
}

/// Deletes the files of blocks evicted from the index.
fn delete_victims(s: &Shared, victims: &[(u128, index::Entry)]) {
    for (key, _) in victims {
        match std::fs::remove_file(format::block_path(&s.blocks_dir, *key)) {
            Ok(()) => DiskCells::add(&s.cells().evictions, 1),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                DiskCells::add(&s.cells().errors, 1);
                tracing::debug!(key = %format_args!("{key:032x}"), "disk tier: deleting an evicted block: {e}");
            }
        }
    }
}

/// Deletes a block file that did not verify and takes it out of the index.
fn discard_torn(s: &Shared, key: u128, why: &dyn std::fmt::Display) {
    DiskCells::add(&s.cells().torn, 1);
    tracing::warn!(key = %format_args!("{key:032x}"), "disk tier: block file refused and deleted: {why}");
    let _ = std::fs::remove_file(format::block_path(&s.blocks_dir, key));
    let mut ix = lock(&s.index);
    ix.remove(key);
    s.publish(&ix);
}

/// Empties `tmp/` and rebuilds the index from the headers under `blocks/`;
/// then lets the writers go.
fn rebuild_index(s: &Shared) {
    let t0 = Instant::now();
    let mut torn = 0u64;
    if let Ok(rd) = std::fs::read_dir(&s.tmp_dir) {
        for e in rd.flatten() {
            if std::fs::remove_file(e.path()).is_ok() {
                torn += 1;
            }
        }
    }
    // The block files' names, then their headers read by a few threads at
    // once (a cold disk answers several reads in flight faster than one).
    let mut names: Vec<(u128, PathBuf)> = Vec::new();
    match std::fs::read_dir(&s.blocks_dir) {
        Ok(rd) => {
            for e in rd.flatten() {
                if let Some(key) = e.file_name().to_str().and_then(format::key_of_name) {
                    names.push((key, e.path()));
                }
            }
        }
        Err(e) => {
            DiskCells::add(&s.cells().errors, 1);
            tracing::warn!("disk tier: reading {}: {e}", s.blocks_dir.display());
        }
    }
    let per = names.len().div_ceil(INDEX_THREADS).max(1);
    let parts: Vec<(Vec<Found>, u64)> = std::thread::scope(|sc| {
        let handles: Vec<_> = names.chunks(per).map(|part| sc.spawn(move || index_files(s, part))).collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    if s.stop.load(Relaxed) {
        return;
    }
    let mut found = Vec::with_capacity(names.len());
    for (f, t) in parts {
        found.extend(f);
        torn += t;
    }
    // Least recently written first: the LRU order the index starts with.
    found.sort_by_key(|f| f.0);
    let recovered = found.len() as u64;
    let bytes: u64 = found.iter().map(|f| f.3).sum();
    let victims = {
        let mut ix = lock(&s.index);
        for (_, key, parent, b, tenant) in &found {
            let t = ix.tenant(tenant.as_deref().unwrap_or(kachedb_shm::control::DEFAULT_TENANT));
            ix.insert(*key, *parent, *b, t);
        }
        let v = ix.shrink_to_fit();
        s.publish(&ix);
        v
    };
    delete_victims(s, &victims);
    let took = t0.elapsed();
    let cells = s.cells();
    cells.recovered.store(recovered, Relaxed);
    DiskCells::add(&cells.torn, torn);
    cells.index_us.store(took.as_micros().max(1) as u64, Relaxed);
    cells.indexed.store(true, Relaxed);
    tracing::info!(
        event = "disk_indexed",
        dir = %s.cfg.dir.display(),
        recovered,
        torn,
        evicted = victims.len(),
        "disk tier {}: {recovered} blocks recovered ({} MiB), {torn} torn skipped, {} evicted to fit, in {:.3} s",
        s.cfg.dir.display(),
        bytes >> 20,
        victims.len(),
        took.as_secs_f64()
    );
    *lock(&s.indexed) = true;
    s.indexed_cv.notify_all();
}

/// A block file that verified at start: when written, key, parent, bytes on
/// disk, tenant (`None`: a version 1 file, the default tenant's).
type Found = (SystemTime, u128, Option<u128>, u64, Option<String>);

/// Checks the headers of the block files `names`: those that verify (when
/// written, key, parent, bytes on disk), and how many did not (deleted).
fn index_files(s: &Shared, names: &[(u128, PathBuf)]) -> (Vec<Found>, u64) {
    let (mut found, mut torn) = (Vec::with_capacity(names.len()), 0);
    for (key, path) in names {
        if s.stop.load(Relaxed) {
            break;
        }
        let checked = (|| -> Result<(SystemTime, Header, u64), String> {
            let f = File::open(path).map_err(|e| e.to_string())?;
            let meta = f.metadata().map_err(|e| e.to_string())?;
            // No readahead: the read below brings in the header's page only,
            // and that page is uptodate and unlocked when the `DONTNEED` after
            // it runs (a readahead still in flight then would stay cached).
            let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::Random);
            let mut b = [0u8; format::HEADER_LEN];
            f.read_exact_at(&mut b, 0).map_err(|e| e.to_string())?;
            drop_cache(&f);
            let h = Header::decode(&b, *key).map_err(|e| e.to_string())?;
            h.check_file_len(meta.len()).map_err(|e| e.to_string())?;
            Ok((meta.modified().unwrap_or(UNIX_EPOCH), h, meta.len()))
        })();
        match checked {
            Ok((mtime, h, len)) => found.push((mtime, *key, h.parent, index::disk_bytes(len), h.tenant)),
            Err(why) => {
                torn += 1;
                tracing::warn!(key = %format_args!("{key:032x}"), "disk tier: block file refused at start and deleted: {why}");
                let _ = std::fs::remove_file(path);
            }
        }
    }
    (found, torn)
}

/// A writer thread: waits for the index, then writes queued blocks, those
/// queued one behind the other in batches ([`write_batch`]).
fn write_loop(s: &Shared) {
    {
        let mut done = lock(&s.indexed);
        while !*done && !s.stop.load(Relaxed) {
            done = s.indexed_cv.wait(done).unwrap_or_else(|e| e.into_inner());
        }
    }
    while let Some(job) = s.writes.pop(&s.stop) {
        let first = match job {
            Job::Write(job, seq) => (job, seq),
            Job::Delete(key, seq) => {
                delete_block(s, key, seq);
                continue;
            }
        };
        let (mut bytes, mut more) = (0u64, 0usize);
        let mut batch = vec![first];
        batch.extend(
            s.writes
                .pop_while(|j| match j {
                    Job::Write(j, _) if more + 1 < BATCH_BLOCKS && bytes.saturating_add(j.len) <= BATCH_BYTES => {
                        bytes += j.len;
                        more += 1;
                        true
                    }
                    _ => false,
                })
                .into_iter()
                .filter_map(|j| match j {
                    Job::Write(j, seq) => Some((j, seq)),
                    Job::Delete(..) => None,
                }),
        );
        let results = write_batch(s, &batch);
        let cells = s.cells();
        for ((job, seq), result) in batch.into_iter().zip(results) {
            match result {
                Ok(true) => {
                    DiskCells::add(&cells.writes, 1);
                    DiskCells::add(&cells.write_bytes, job.len);
                }
                Ok(false) => DiskCells::add(&cells.dropped_writes, 1),
                Err(e) => {
                    DiskCells::add(&cells.errors, 1);
                    tracing::debug!(key = %format_args!("{:032x}", job.key), "disk write failed: {e}");
                }
            }
            cells.queue_bytes.fetch_sub(job.len, Relaxed);
            cells.queue_blocks.fetch_sub(1, Relaxed);
            {
                let mut d = lock(&s.deletes);
                d.writes.remove(&seq);
                d.prune();
            }
            s.events.send(TierEvent::Written { pin: job.pin });
        }
    }
}

/// Whether the write numbered `seq` of `key` lost to a later DELETE.
fn superseded(s: &Shared, key: u128, seq: u64) -> bool {
    lock(&s.deletes).tombs.get(&key).is_some_and(|t| t.seq > seq)
}

/// Removes the file and index entry of `key` for the DELETE numbered `seq`,
/// unless a later DELETE will (its own job) or a later write replaced them.
fn delete_block(s: &Shared, key: u128, seq: u64) {
    let _commit = lock(&s.commit);
    {
        let d = lock(&s.deletes);
        match d.tombs.get(&key) {
            Some(t) if t.seq == seq && !t.done => {}
            _ => return,
        }
    }
    match std::fs::remove_file(format::block_path(&s.blocks_dir, key)) {
        Ok(()) => DiskCells::add(&s.cells().deletes, 1),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            // The tombstone stays (`done` unset): fills keep missing the key.
            DiskCells::add(&s.cells().errors, 1);
            tracing::debug!(key = %format_args!("{key:032x}"), "disk tier: deleting a deleted key's block: {e}");
            return;
        }
    }
    {
        let mut ix = lock(&s.index);
        ix.remove(key);
        s.publish(&ix);
    }
    let mut d = lock(&s.deletes);
    if let Some(t) = d.tombs.get_mut(&key).filter(|t| t.seq == seq) {
        t.done = true;
    }
    d.prune();
}

/// A block of a batch on its way to disk.
struct Staged {
    /// Its place in the batch.
    at: usize,
    /// Bytes it takes on disk (reserved in the index).
    bytes: u64,
    /// Its tenant's row in the index.
    tenant: index::TenantRow,
    tmp: PathBuf,
    /// Open while its data is being synced.
    file: Option<File>,
}

/// Writes the blocks `batch` (each with its number, see [`Deletes`]);
/// each one's outcome: `Ok(true)` written, `Ok(false)` not written (the
/// tier stopped, the block does not fit on the disk, or a later DELETE of
/// its key came first), or the error.
///
/// A group commit: each block's file is written under `tmp/` and handed to
/// the disk at once, then each file's data is synced (`fdatasync`) and
/// dropped from the page cache, then each is renamed into place, then the
/// directory is synced once for all of them; a block counts as written only
/// after that sync, so only once its bytes and its name are durable.
fn write_batch(s: &Shared, batch: &[(WriteJob, u64)]) -> Vec<std::io::Result<bool>> {
    let mut out: Vec<std::io::Result<bool>> = batch.iter().map(|_| Ok(false)).collect();
    let mut staged: Vec<Staged> = Vec::with_capacity(batch.len());
    for (at, (job, seq)) in batch.iter().enumerate() {
        if superseded(s, job.key, *seq) {
            continue;
        }
        let bytes = index::disk_bytes(format::file_len(job.len));
        let (victims, tenant) = {
            let mut ix = lock(&s.index);
            let tenant = ix.tenant(&job.tenant);
            let v = ix.make_room(bytes, job.parent, tenant);
            s.publish(&ix);
            (v, tenant)
        };
        let Ok(victims) = victims else { continue };
        delete_victims(s, &victims);
        let tmp = s.tmp_dir.join(format!("{:032x}.{}.tmp", job.key, s.tmp_seq.fetch_add(1, Relaxed)));
        match write_file(s, job, &tmp) {
            Ok(file) => staged.push(Staged { at, bytes, tenant, tmp, file }),
            Err(e) => {
                out[at] = Err(e);
                staged.push(Staged { at, bytes, tenant, tmp, file: None });
            }
        }
    }
    // Data: synced file by file (the first sync waits for the device; the
    // others find their writes done or in flight).
    for st in &mut staged {
        if let Some(f) = st.file.take() {
            match f.sync_data() {
                Ok(()) => {
                    drop_cache(&f);
                    out[st.at] = Ok(!s.stop.load(Relaxed));
                }
                Err(e) => out[st.at] = Err(e),
            }
        }
    }
    // Names: renamed into place, then one directory sync for the batch.
    let mut renamed = false;
    for st in &staged {
        if matches!(out[st.at], Ok(true)) {
            let (job, seq) = &batch[st.at];
            out[st.at] = rename_into_place(s, job, *seq, &st.tmp);
            renamed |= matches!(out[st.at], Ok(true));
        }
    }
    if renamed {
        if let Err(e) = File::open(&s.blocks_dir).and_then(|d| d.sync_all()) {
            for st in &staged {
                if matches!(out[st.at], Ok(true)) {
                    out[st.at] = Err(std::io::Error::new(e.kind(), e.to_string()));
                }
            }
        }
    }
    // Indexed (and so counted in `disk_blocks`) only once synced; under the
    // commit lock, so that a DELETE's removal comes wholly before or after.
    let _commit = lock(&s.commit);
    let mut ix = lock(&s.index);
    for st in &staged {
        let (job, seq) = &batch[st.at];
        ix.unreserve(st.bytes, st.tenant);
        match out[st.at] {
            Ok(true) if !superseded(s, job.key, *seq) => ix.insert(job.key, job.parent, st.bytes, st.tenant),
            Ok(true) => out[st.at] = Ok(false),
            _ => {
                let _ = std::fs::remove_file(&st.tmp);
            }
        }
    }
    s.publish(&ix);
    out
}

/// Renames the written file `tmp` of `job` (numbered `seq`) into place,
/// unless a later DELETE of its key came first (`Ok(false)`). A tombstone
/// of an earlier DELETE is done with: this file replaces the deleted one.
fn rename_into_place(s: &Shared, job: &WriteJob, seq: u64, tmp: &Path) -> std::io::Result<bool> {
    let _commit = lock(&s.commit);
    {
        let mut d = lock(&s.deletes);
        match d.tombs.get_mut(&job.key) {
            Some(t) if t.seq > seq => return Ok(false),
            Some(t) => t.done = true,
            None => {}
        }
    }
    std::fs::rename(tmp, format::block_path(&s.blocks_dir, job.key))?;
    Ok(true)
}

/// Writes `job`'s block to the new file `tmp` and hands its pages to the
/// disk (not yet synced); `None`: the tier stopped.
fn write_file(s: &Shared, job: &WriteJob, tmp: &Path) -> std::io::Result<Option<File>> {
    let f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(tmp)?;
    {
        let gate = s.running.read().unwrap_or_else(|e| e.into_inner());
        if !*gate {
            return Ok(None);
        }
        let Some(ptr) = s.region.slab_ptr(job.data_offset, job.len) else {
            return Err(std::io::Error::other("block outside the megaslab"));
        };
        // SAFETY: `job.pin` pins this committed block for the tier's session
        // until the writer sends `Written`, after this returns: the extent is
        // not evicted, moved or reused meanwhile, and a committed block's
        // bytes are not written again. The pin outlives the gate only while
        // the tier runs: `stop` (which closes the tier's session, dropping
        // the pin) waits for this read guard. The region stays mapped while
        // `s.region` (an `Arc`) lives.
        let data: &[u8] = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), job.len as usize) };
        let written_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        let header = Header {
            tenant: Some(job.tenant.clone()),
            key: job.key,
            parent: job.parent,
            dtype: job.dtype,
            shape: job.shape,
            len: job.len,
            written_ms,
            checksum: format::checksum(data),
        };
        f.write_all_at(&header.encode(), 0)?;
        start_writeback(&f, 0, format::HEADER_AREA);
        let mut at = 0u64;
        for piece in data.chunks(WRITE_PIECE_BYTES as usize) {
            f.write_all_at(piece, format::HEADER_AREA + at)?;
            start_writeback(&f, format::HEADER_AREA + at, piece.len() as u64);
            at += piece.len() as u64;
        }
    }
    Ok((!s.stop.load(Relaxed)).then_some(f))
}

/// Starts the write-out of `len` dirty bytes of `f` at `offset`
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`: no wait, no durability; the
/// `fdatasync` after it then finds the pages written or in flight). A
/// failure here shows again at that sync.
fn start_writeback(f: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: FFI call on a descriptor `f` owns for the call's duration; it
    // takes no pointers.
    unsafe {
        libc::sync_file_range(
            f.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// A reader thread: runs fetches.
fn read_loop(s: &Shared) {
    while let Some(job) = s.fetches.pop(&s.stop) {
        let filled = fetch(s, &job);
        s.events.send(TierEvent::Filled { fetch: job.id, filled });
    }
}

/// Runs one fetch; the reservations filled, with their tensor bytes.
fn fetch(s: &Shared, job: &FetchJob) -> Vec<(u64, u64)> {
    let cells = s.cells();
    // Open every file of the fetch first and ask the kernel for the small
    // ones whole at once (`POSIX_FADV_WILLNEED`): the header and payload
    // reads below then find them in flight or cached instead of waiting one
    // by one; large files are read ahead by the sequential reads themselves.
    let mut opened: Vec<(u128, File)> = Vec::with_capacity(job.keys.len());
    for &key in &job.keys {
        // Deleted by a client (its file may not be removed yet).
        if lock(&s.deletes).tombs.contains_key(&key) {
            DiskCells::add(&cells.misses, 1);
            continue;
        }
        match File::open(format::block_path(&s.blocks_dir, key)) {
            Ok(f) => {
                if let Some(len) = f.metadata().ok().map(|m| m.len()).filter(|&l| l <= WILLNEED_MAX_BYTES) {
                    let _ = rustix::fs::fadvise(&f, 0, std::num::NonZeroU64::new(len), rustix::fs::Advice::WillNeed);
                }
                opened.push((key, f));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => DiskCells::add(&cells.misses, 1),
            Err(e) => {
                DiskCells::add(&cells.errors, 1);
                tracing::debug!(key = %format_args!("{key:032x}"), "disk read failed: {e}");
            }
        }
    }
    let mut found: Vec<(Header, File)> = Vec::new();
    for (key, f) in opened {
        let mut b = [0u8; format::HEADER_LEN];
        let checked = f
            .read_exact_at(&mut b, 0)
            .map_err(|e| e.to_string())
            .and_then(|()| Header::decode(&b, key).map_err(|e| e.to_string()))
            .and_then(|h| {
                let len = f.metadata().map_err(|e| e.to_string())?.len();
                h.check_file_len(len).map_err(|e| e.to_string())?;
                Ok(h)
            });
        match checked {
            Ok(h) => found.push((h, f)),
            Err(why) => discard_torn(s, key, &why),
        }
    }
    if found.is_empty() {
        return Vec::new();
    }
    let specs = found
        .iter()
        .map(|(h, _)| FillSpec {
            key: h.key,
            dtype: h.dtype,
            shape: h.shape,
            len: h.len,
            parent: h.parent,
            tenant: h.tenant.clone(),
        })
        .collect();
    let (tx, rx) = tokio::sync::oneshot::channel();
    s.events.send(TierEvent::Reserve { fetch: job.id, blocks: specs, reply: tx });
    // The serve loop answers at its next pass (or drops the sender when it
    // stops).
    let Ok(reserved) = rx.blocking_recv() else { return Vec::new() };
    let mut filled = Vec::new();
    for ((h, f), r) in found.iter().zip(reserved) {
        let Some(r) = r else { continue };
        let gate = s.running.read().unwrap_or_else(|e| e.into_inner());
        if !*gate {
            break;
        }
        let Some(ptr) = s.region.slab_ptr(r.data_offset, h.len) else { continue };
        // SAFETY: the serve loop reserved `[data_offset, data_offset + len)`
        // for the tier's session and touches it again only when this fetch's
        // `Filled` (sent after this returns) commits or aborts it; a
        // reservation is invisible to clients and never evicted. The tier's
        // session (and with it the reservation) is closed only after `stop`,
        // which waits for this read guard. The region stays mapped while
        // `s.region` lives.
        let buf: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), h.len as usize) };
        match f.read_exact_at(buf, format::HEADER_AREA) {
            Ok(()) if format::checksum(buf) == h.checksum => {
                drop(gate);
                drop_cache(f);
                filled.push((r.handle, h.len));
                lock(&s.index).touch(h.key);
            }
            Ok(()) => {
                drop(gate);
                discard_torn(s, h.key, &format::FormatError::Checksum);
            }
            // Truncated since its header was checked.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                drop(gate);
                discard_torn(s, h.key, &e);
            }
            Err(e) => {
                drop(gate);
                DiskCells::add(&cells.errors, 1);
                tracing::debug!(key = %format_args!("{:032x}", h.key), "disk read failed: {e}");
            }
        }
    }
    // What a WILLNEED brought in and no fill read (no room, a stop) goes too.
    for (_, f) in &found {
        drop_cache(f);
    }
    filled
}
