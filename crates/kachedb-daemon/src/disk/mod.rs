//! The disk tier: local files under one directory behind the megaslab
//! (`kachedb serve --disk DIR --disk-size SIZE`, docs/disk.md). More cache
//! than RAM, and a cache that survives the daemon's death.
//!
//! The serve loop never touches the disk. It hands work to this module's
//! [`DiskTier`] through the tier interface ([`Tier`], `crate::tier`); the
//! work runs on the tier's own threads (`kachedb-disk`) and reports
//! [`TierEvent`]s on the loop's event queue:
//!
//! * **Write-behind** (writer threads): for each block a client commits, the
//!   serve loop pins it for the tier's session and queues a [`WriteJob`] (or
//!   drops it, counted and logged, when the queue's bytes — or the block
//!   tenant's share of them — would pass their bound). A writer takes the
//!   jobs queued one behind the other as a batch ([`write_batch`], a group
//!   commit): for each it makes room ([`index`]: leaves first, within the
//!   limit of the block's tenant, whose name the header carries) and writes
//!   the header and the pinned bytes to a temporary file, then `fdatasync`s
//!   each file and drops its pages from the page cache
//!   (`POSIX_FADV_DONTNEED`), renames each into place and syncs the
//!   directory once; only then are the blocks counted written
//!   (`disk_writes`) and indexed. The pins go back with
//!   [`TierEvent::Written`].
//! * **Fill** (reader threads): a local miss's [`FetchJob`] is looked up by
//!   file name (no index needed, so fills work while the index is being
//!   rebuilt); each header is read and checked ([`format`]), the serve loop
//!   reserves room ([`TierEvent::Reserve`]), the payload is read straight
//!   into the reservation and hashed there; a block that does not verify is
//!   left out (its file deleted, counted in `disk_torn`) and its reservation
//!   aborted. [`TierEvent::Filled`] commits the rest with their parents, each
//!   counted for the tenant its header names ([`FillSpec::tenant`]).
//! * **Read-ahead** (reader threads, after the fills clients wait for): the
//!   serve loop asks [`Tier::chain_after`] for the blocks after one a client
//!   asked for (the index's child hints, [`index::Index::chain_after`]) and
//!   fetches each with a [`FetchJob::ahead`] job, which reserves free
//!   megaslab space only; a block that gets none is read into the page
//!   cache instead (`POSIX_FADV_WILLNEED`, kept), for the client's miss of it
//!   to copy rather than wait for the disk.
//! * **Removal** (the remover thread): a client's DELETE of a key, or its
//!   COMMIT of a newer block of a key the tier may hold, reaches the tier
//!   ([`Tier::remove`]) as a tombstone at once — fills treat the key as
//!   missing from then on, and a write of it taken before does not land
//!   (see [`Order`]) — and, if an older copy could be on disk, as a removal
//!   job: its file is unlinked and the directory synced, and only then
//!   does the client get its answer ([`TierEvent::Removed`]). Removals have
//!   a thread and a queue of their own, so they never wait behind writes.
//! * **Start**: the directory is opened and checked, and locked
//!   ([`dir`]), `DIR/tmp` (unfinished writes) is emptied but for the
//!   catalog ([`catalog`]) and the index is rebuilt on a thread of its own
//!   ([`rebuild`]): the files the catalog knows (key and inode) from it, the
//!   others from their headers (one open, `fstat` and header-page read per
//!   file, `O_DIRECT`, by many threads at once; payloads are checked at fill
//!   time); writes wait for it, fills and removals do not. A writer appends
//!   its batch's catalog entries and syncs them before its renames.
//!
//! The megaslab is touched only under the read side of a gate
//! (`Shared::running`); stopping takes the write side, so once
//! [`Tier::stop`] returns no thread of the tier reads a pin or writes a
//! reservation. Threads belong to a run (`Shared::run`): stopping starts a
//! new one, and a thread of an older run renames or unlinks nothing more
//! (checked under `Shared::commit`), even one that was stuck in the kernel.
//!
//! I/O: plain `pread`/`pwrite` from a few threads, buffered, with
//! `sync_file_range` (write-out started as each piece is copied),
//! `fdatasync` + `POSIX_FADV_DONTNEED` so the page cache does not keep a
//! second copy of the KV (docs/disk.md says why not `O_DIRECT` or io_uring).
//! The index rebuild's header reads are the exception: one 4 KiB page per
//! file, read `O_DIRECT` straight into an aligned buffer, so no page is
//! cached and none needs dropping.

mod catalog;
pub mod cells;
mod dir;
mod events;
pub mod format;
pub mod index;
mod rebuild;
pub mod setup;
mod view;

use crate::kv_events::TierSink;
use crate::metrics::Metrics;
use crate::tier::gate::{Refused, SlabGate};
use crate::tier::metrics::add;
use crate::tier::threads::{enter_worker_class, worker_nice_value, WriteQueue};
use crate::tier::{
    Admission, FetchJob, FillSpec, Handover, Offer, PendingWrite, Removal, StoppedTier, Tier, TierError, TierEvent,
    TierEvents, WriteJob,
};
use cells::DiskCells;
use dir::TierDir;
use format::Header;
use index::Index;
use kachedb_shm::{BlockMeta, Region};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Default bound of the write-behind queue, bytes.
pub const DEFAULT_QUEUE_BYTES: u64 = 1 << 30;
/// Default longest wait for a disk fill before its keys count as misses.
pub const DEFAULT_TIMEOUT_MS: u64 = 2000;
/// Default of how much nicer than the daemon the tier's threads run.
pub const DEFAULT_WORKER_NICE: u8 = 10;
/// The name of the tier's threads.
pub const THREAD_NAME: &str = "kachedb-disk";
/// The name of the remover thread (normal scheduling class: a client's
/// DELETE waits for it).
pub const REMOVER_THREAD_NAME: &str = "kachedb-disk-rm";
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
/// Threads reading headers at start. A header read of a cold file waits
/// for the device, which answers many reads in flight about as fast as
/// one: 10⁵ cold headers on the development VM's disk took 2.5 s with 8
/// threads and 1.1–1.3 s with 64.
const INDEX_THREADS: usize = 64;
/// Most keys an index thread takes at a time (fewer in a small directory,
/// so that every thread gets some: a few hundred files, the start after a
/// crash of a young tier, are read 64 at a time too).
const INDEX_BATCH: usize = 256;
/// Block files the index rebuild indexes per hold of the index's mutex.
const INDEX_CHUNK: usize = 4096;
/// Entries the catalog may hold beyond twice the blocks on disk before it
/// is written anew (at start, or by a writer), by default.
pub const DEFAULT_CATALOG_SLACK: u64 = 65_536;
/// Block files up to this size are asked for ahead, whole
/// (`POSIX_FADV_WILLNEED`), when a fetch starts.
const WILLNEED_MAX_BYTES: u64 = 8 << 20;
/// Default of `--disk-read-ahead`: blocks read ahead along a chain.
pub const DEFAULT_READ_AHEAD: usize = 8;
/// Most file-system bytes one read-ahead asks for (the first block always).
const READ_AHEAD_MAX_BYTES: u64 = 128 << 20;
/// A removal that failed is tried again after this long (until it works).
const REMOVAL_RETRY: Duration = Duration::from_secs(1);
/// At most one log line per this interval about writes not taken.
const DROP_LOG_EVERY: Duration = Duration::from_secs(10);

/// How the disk tier is set up (`kachedb serve --disk …`).
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// Most file-system bytes the blocks may take (`--disk-size`).
    pub size_bytes: u64,
    /// Most tensor bytes queued for writing (beyond: writes are dropped).
    pub queue_bytes: u64,
    /// Longest a fill may take before the serve loop stops waiting for it;
    /// also the longest a client's DELETE waits for its removal to be
    /// durable.
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
    /// Blocks read ahead along a chain (`--disk-read-ahead`; 0: none).
    pub read_ahead: usize,
    /// Entries the catalog may hold beyond twice the blocks on disk before it
    /// is written anew (`--disk-catalog-slack`).
    pub catalog_slack: u64,
}

/// The scheduling class the tier's threads run in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WorkerClass {
    /// `SCHED_IDLE`: a thread runs only on a core no thread of the normal
    /// class wants (the serve loop and the clients), and a thread of that
    /// class waking up preempts it at once; the nice value still sets the
    /// threads' default I/O priority. The remover thread (whose work a
    /// client's DELETE waits for) stays in the normal class.
    #[default]
    Idle,
    /// `SCHED_OTHER` at the nice value (`worker_nice`): the kernel shares a
    /// busy core between the serve loop and the tier by weight.
    Normal,
}

impl WorkerClass {
    /// The name `--disk-worker-class` takes.
    pub fn name(self) -> &'static str {
        match self {
            WorkerClass::Idle => "idle",
            WorkerClass::Normal => "normal",
        }
    }
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
    /// The directory (or one under it) is not the daemon's own.
    #[error("disk tier: refusing {path}: {why}, so another user could plant files or links there for the daemon to read or delete; fix it ({fix}) or give another --disk directory")]
    Unsafe {
        /// The directory.
        path: String,
        /// What is wrong with it.
        why: String,
        /// A command that fixes it.
        fix: String,
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

    /// Queues `item` before the first item `later` says goes after it.
    fn push_before(&self, item: T, later: impl Fn(&T) -> bool) {
        let mut q = lock(&self.items);
        let at = q.iter().position(later).unwrap_or(q.len());
        q.insert(at, item);
        drop(q);
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

    /// Every item queued, waiting up to `wait` for one (`None`: no limit);
    /// `None` once `alive` says no.
    fn pop_all(&self, alive: &dyn Fn() -> bool, wait: Option<Duration>) -> Option<Vec<T>> {
        let mut q = lock(&self.items);
        let until = wait.map(|w| Instant::now() + w);
        loop {
            if !alive() {
                return None;
            }
            if !q.is_empty() {
                return Some(q.drain(..).collect());
            }
            match until {
                None => q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let left = t.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Some(Vec::new());
                    }
                    q = self.ready.wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
    }

    /// The next item, waiting for one; `None` once `alive` says no.
    fn pop(&self, alive: &dyn Fn() -> bool) -> Option<T> {
        let mut q = lock(&self.items);
        loop {
            if !alive() {
                return None;
            }
            if let Some(item) = q.pop_front() {
                return Some(item);
            }
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wakes every thread waiting (after `alive` changed; under the queue's
    /// mutex, so no waiter misses it between its check and its wait).
    fn wake_all(&self) {
        let _q = lock(&self.items);
        self.ready.notify_all();
    }
}

/// A block to write, numbered by [`Order`].
struct Write {
    job: WriteJob,
    seq: u64,
}

/// A removal of `key`'s older copies to make durable, answered with
/// `token` (0: nobody waits for the answer).
#[derive(Clone, Copy, Debug)]
struct RemoveJob {
    key: u128,
    token: u64,
}

/// A key's older copies must go (until every write it must win against is over).
#[derive(Clone, Copy, Debug)]
struct Tomb {
    /// Its number ([`Order::last`] when it was made).
    seq: u64,
    /// The key's file and index entry are gone, or were replaced by a
    /// newer write's.
    done: bool,
}

/// Orders writes and removals of a key, which run on several threads, as
/// the serve loop asked for them. Each write taken and each removal gets
/// the next number; a removal leaves a tombstone for its key. A fill never
/// reads a key with a tombstone (a miss). A write numbered before the
/// tombstone does not land (checked under `Shared::commit` just before its
/// rename); a write numbered after it lands and replaces the file, doing
/// the removal's work. A tombstone goes once its work is done and no write
/// numbered before it is still queued or running, so the map holds only
/// the keys removed while writes were behind (or whose removal failed).
///
/// With the index, it knows which keys the tier may hold: those in the
/// index, those with writes queued or running here, and those being evicted
/// here (out of the index, file not yet unlinked or not yet synced). A key
/// goes into or out of the index and into or out of these maps under the
/// index's mutex, so that one who holds this mutex and gets the index's sees
/// them agree (the serve loop, which asks at every COMMIT, only tries the
/// index's mutex: see `DiskTier::remove`). Nothing holds its mutex while
/// doing I/O.
#[derive(Debug, Default)]
struct Order {
    /// The last number given out.
    last: u64,
    /// The writes queued or running, by number: what a stop hands over.
    writes: BTreeMap<u64, PendingWrite>,
    /// Keys with writes queued or running, with how many.
    writing: HashMap<u128, u32>,
    /// Keys taken out of the index for eviction whose unlinks are not
    /// durable yet, with how many such evictions.
    evicting: HashMap<u128, u32>,
    tombs: HashMap<u128, Tomb>,
}

/// Adds one to `key`'s count in `m`.
fn count_in(m: &mut HashMap<u128, u32>, key: u128) {
    *m.entry(key).or_insert(0) += 1;
}

/// Takes one off `key`'s count in `m` (dropping it at zero).
fn count_out(m: &mut HashMap<u128, u32>, key: u128) {
    if let Some(n) = m.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            m.remove(&key);
        }
    }
}

impl Order {
    fn next(&mut self) -> u64 {
        self.last += 1;
        self.last
    }

    /// Numbers a write of `w` taken now.
    fn take_write(&mut self, w: PendingWrite) -> u64 {
        let seq = self.next();
        self.writes.insert(seq, w);
        count_in(&mut self.writing, w.key);
        seq
    }

    /// The write numbered `seq` is over (landed or not).
    fn finish_write(&mut self, seq: u64) {
        if let Some(w) = self.writes.remove(&seq) {
            count_out(&mut self.writing, w.key);
        }
        self.prune();
    }

    /// Drops the tombstones no write still needs to see.
    fn prune(&mut self) {
        let oldest = self.writes.keys().next().copied().unwrap_or(u64::MAX);
        self.tombs.retain(|_, t| !t.done || t.seq > oldest);
    }
}

/// Locks `m`, taking it over from a thread that panicked while holding it
/// (the data under these mutexes stays consistent between statements).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The bytes queued for writing per tenant, and the log of writes not taken.
#[derive(Debug, Default)]
struct Backlog {
    /// Tensor bytes queued or being written, per tenant name.
    by_tenant: HashMap<String, u64>,
    /// Writes not taken since the last log line, and why the last one was not.
    unlogged: u64,
    last_why: String,
    last_log: Option<Instant>,
}

/// What the tier's threads share.
struct Shared {
    cfg: DiskConfig,
    dir: TierDir,
    /// The tier's only way into the megaslab.
    slab: SlabGate,
    events: TierEvents,
    /// The tier's counters (`Metrics::tier`).
    cells: Arc<DiskCells>,
    index: Mutex<Index>,
    /// The index's changes for the KV events (lock order: after `index`).
    log: Mutex<events::DiskLog>,
    /// Writes and removals in the order the serve loop asked for them.
    order: Mutex<Order>,
    /// Held by a thread across the last check of [`Order`] (and of the run)
    /// and the rename or unlink of a block file, so that two of them on one
    /// key happen in the order they were checked, and none after a stop.
    /// Never taken by the serve loop. Lock order: `commit`, `index`, `order`.
    commit: Mutex<()>,
    /// Held by the remover across a batch (unlinks, the directory sync,
    /// the reports), so that stopping finds no removal half done.
    removing: Mutex<()>,
    /// Whether the start-up index rebuild is done (writers wait for it).
    indexed: AtomicBool,
    indexed_wait: (Mutex<()>, Condvar),
    writes: Queue<Write>,
    removals: Queue<RemoveJob>,
    fetches: Queue<FetchJob>,
    /// The run the threads belong to; a stop starts the next one, and a
    /// thread whose run is over takes no more work.
    run: AtomicU64,
    /// `false` while the tier is held (a takeover's new daemon before the
    /// old one stopped): its threads touch nothing until released.
    released: (Mutex<bool>, Condvar),
    /// The directory is no longer the one the tier opened: it stopped.
    lost: AtomicBool,
    backlog: Mutex<Backlog>,
    /// The catalog, open for appending (`None`: there is none until the
    /// next start, which reads headers). Lock order: before `index`.
    catalog: Mutex<Option<catalog::Appender>>,
    /// The catalog failed and could not be deleted: no block is renamed
    /// into place until it is (writes fail, counted).
    catalog_stuck: AtomicBool,
    /// Writers whose batch's entries are in the catalog and whose blocks are
    /// not indexed yet: the catalog is not written anew meanwhile (it keeps
    /// the entries of indexed keys only, and a replaced key is out of the
    /// index until its new block is in). Incremented under `catalog`,
    /// decremented after the batch's index update (Release); read under
    /// `catalog` (Acquire).
    catalog_writers: AtomicUsize,
    /// Numbers temporary files.
    tmp_seq: AtomicU64,
    /// Numbers removal tokens.
    tokens: AtomicU64,
}

impl Shared {
    fn cells(&self) -> &DiskCells {
        &self.cells
    }

    /// The write-behind queue (`--disk-queue-bytes`).
    fn queue(&self) -> WriteQueue<'_> {
        WriteQueue { bytes: &self.cells.queue_bytes, blocks: &self.cells.queue_blocks, bound: self.cfg.queue_bytes }
    }

    /// Whether threads of run `run` may still work.
    fn live(&self, run: u64) -> bool {
        self.run.load(Acquire) == run
    }

    /// Publishes the index's (`ix`, held) block and byte counts, in total
    /// and per tenant (together, under the tenants' mutex, so that a reader
    /// holding it sees rows that add up to the totals), and hands its logged
    /// changes to the KV event publisher.
    fn publish(&self, ix: &Index) {
        let mut tenants = lock(&self.cells().tenants);
        *tenants = ix.tenants();
        self.cells().blocks.store(ix.blocks(), Relaxed);
        self.cells().bytes.store(ix.used(), Relaxed);
        drop(tenants);
        lock(&self.log).flush(ix);
    }

    /// Logs the removal of `keys`, just taken out of the index (held).
    fn log_removed<'a>(&self, keys: impl IntoIterator<Item = &'a u128>) {
        let mut log = lock(&self.log);
        if log.is_on() {
            for &key in keys {
                log.removed(key);
            }
        }
    }

    /// Waits until the tier is released (see `released`); `false` if the
    /// run `run` ended first.
    fn wait_released(&self, run: u64) -> bool {
        let (m, cv) = &self.released;
        let mut r = lock(m);
        while !*r {
            if !self.live(run) {
                return false;
            }
            r = cv.wait_timeout(r, Duration::from_millis(100)).unwrap_or_else(|e| e.into_inner()).0;
        }
        self.live(run)
    }

    /// Checks that the directory is still the tier's; if not, the tier stops
    /// (every key a miss, nothing written), saying why, once.
    fn check_dir(&self) -> bool {
        if self.lost.load(Relaxed) {
            return false;
        }
        match self.dir.check_still_ours() {
            Ok(()) => true,
            Err(why) => {
                if !self.lost.swap(true, Relaxed) {
                    self.cells().dir_lost.store(1, Relaxed);
                    tracing::error!(
                        event = "disk_dir_lost",
                        dir = %self.dir.path().display(),
                        "disk tier stopped: {why}; the daemon serves from RAM only (every disk read a miss, nothing written) until it restarts on a directory of its own"
                    );
                }
                false
            }
        }
    }

    /// Counts a write not taken (dropped) and logs it, at most once per
    /// [`DROP_LOG_EVERY`] with the count since the last line.
    fn dropped(&self, why: impl FnOnce() -> String) {
        add(&self.cells().dropped_writes, 1);
        let mut b = lock(&self.backlog);
        b.unlogged += 1;
        let now = Instant::now();
        if b.last_log.is_some_and(|t| now.duration_since(t) < DROP_LOG_EVERY) {
            return;
        }
        let n = std::mem::take(&mut b.unlogged);
        b.last_why = why();
        b.last_log = Some(now);
        let class = match self.cfg.worker_class {
            WorkerClass::Idle => " The tier's threads run SCHED_IDLE (--disk-worker-class idle): on a node whose cores are busy they get little CPU; --disk-worker-class normal trades GET latency for disk throughput.",
            WorkerClass::Normal => "",
        };
        tracing::warn!(
            event = "disk_writes_dropped",
            dropped = n,
            "disk tier: {n} committed block(s) not written in the last {DROP_LOG_EVERY:?} (last: {}); they live in RAM only and are lost at a crash. The disk does not keep up with the commits: raise --disk-queue-bytes, give the tier a faster disk, or admit fewer blocks (--disk-admit second).{class}",
            b.last_why
        );
    }

    /// Stops the threads of the current run: they take no more work, and no
    /// rename or unlink starts after this returns (a stuck one is of an old
    /// run); closes the megaslab gate, waiting for a copy in progress;
    /// finishes the queued removals; hands back the writes taken and not
    /// finished. Fetches queued are dropped (the serve loop ends them).
    fn halt(&self) -> Handover {
        {
            let _c = lock(&self.commit);
            self.run.fetch_add(1, Release);
        }
        self.writes.wake_all();
        self.removals.wake_all();
        self.fetches.wake_all();
        self.indexed_wait.1.notify_all();
        self.released.1.notify_all();
        self.slab.close();
        let _r = lock(&self.removing);
        // Removals: those queued, then every tombstone whose work is not
        // done (a removal that failed before), once more.
        let queued: Vec<RemoveJob> = lock(&self.removals.items).drain(..).collect();
        let mut removed = Vec::new();
        if !self.lost.load(Relaxed) {
            let results = remove_now(self, &queued, None);
            removed.extend(queued.iter().map(|j| j.token).zip(results));
            let undone: Vec<RemoveJob> = lock(&self.order)
                .tombs
                .iter()
                .filter(|(_, t)| !t.done)
                .map(|(&key, _)| RemoveJob { key, token: 0 })
                .collect();
            remove_now(self, &undone, None);
        } else {
            // Nothing of this directory's can be removed any more.
            removed.extend(queued.iter().map(|j| (j.token, Err("the disk tier's directory is gone".to_string()))));
        }
        lock(&self.writes.items).clear();
        lock(&self.fetches.items).clear();
        let mut order = lock(&self.order);
        let pending: Vec<PendingWrite> = order.writes.values().copied().collect();
        order.writes.clear();
        order.writing.clear();
        order.prune();
        drop(order);
        lock(&self.backlog).by_tenant.clear();
        let cells = self.cells();
        cells.queue_bytes.store(0, Relaxed);
        cells.queue_blocks.store(0, Relaxed);
        Handover { pending, removed, unremoved: self.unremoved() }
    }

    /// Keys whose older copy the tier could not remove yet (their
    /// tombstones stand): a new daemon's tier must remove them too.
    fn unremoved(&self) -> Vec<u128> {
        lock(&self.order).tombs.iter().filter(|(_, t)| !t.done).map(|(&k, _)| k).collect()
    }
}

/// The serve loop's handle on the disk tier. Dropping it stops its threads'
/// work and lets go of the directory's lock (queued writes are lost; the
/// daemon is going away).
pub struct DiskTier {
    shared: Arc<Shared>,
    /// Stopped already ([`Tier::stop`]): dropping it does nothing more.
    halted: bool,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").field("cfg", &self.shared.cfg).finish()
    }
}

/// The directory a takeover's new daemon adopts: the old daemon's
/// descriptors of it and of its lock (see [`dir`]).
#[derive(Debug)]
pub struct Adopted {
    /// `DIR`, opened.
    pub dir: OwnedFd,
    /// `DIR/lock`'s open file, `flock`ed.
    pub lock: OwnedFd,
}

/// The name a takeover hands the disk tier's descriptors over under.
pub const HANDOVER_NAME: &str = "disk";

impl DiskTier {
    /// Checks `cfg`, makes, checks and locks the directory (or adopts the
    /// one `adopt` names, if it is the same) and starts the tier's threads
    /// (the index is rebuilt in the background). `held`: the threads touch
    /// nothing until [`Tier::release`] (a takeover's new daemon).
    pub fn start(
        cfg: DiskConfig,
        region: Arc<Region>,
        events: TierEvents,
        metrics: Arc<Metrics>,
        adopt: Option<Adopted>,
        held: bool,
        kv_events: Option<TierSink>,
    ) -> Result<DiskTier, DiskError> {
        let mut log = events::DiskLog::default();
        if let Some(sink) = kv_events {
            log.attach(sink);
        }
        if cfg.size_bytes < format::HEADER_AREA * 2 {
            return Err(DiskError::Config(format!("--disk-size {} is too small", cfg.size_bytes)));
        }
        if cfg.timeout.is_zero() {
            return Err(DiskError::Config("the timeout must be above zero".into()));
        }
        if cfg.worker_nice > 19 {
            return Err(DiskError::Config(format!("worker nice {} above 19", cfg.worker_nice)));
        }
        let uid = rustix::process::geteuid().as_raw();
        let adopted = match adopt {
            Some(a) => TierDir::adopt(&cfg.dir, a.dir, a.lock, uid)?,
            None => None,
        };
        let dir = match adopted {
            Some(d) => {
                tracing::info!(dir = %cfg.dir.display(), "disk tier: adopting the directory and lock of the daemon taken over");
                d
            }
            None => TierDir::open(&cfg.dir, uid)?,
        };
        let cells = metrics.tier::<DiskCells>();
        cells.enabled.store(true, Relaxed);
        cells.capacity_bytes.store(cfg.size_bytes, Relaxed);
        cells.indexed.store(false, Relaxed);
        cells.index_us.store(0, Relaxed);
        cells.dir_lost.store(0, Relaxed);
        if cfg.worker_class == WorkerClass::Idle {
            tracing::info!(
                "disk tier: its threads run SCHED_IDLE (--disk-worker-class idle, the default): GETs from RAM stay fast while the disk works, but on a node whose cores are all busy the tier gets little CPU, and fills time out and writes are dropped (counted in kachedb_disk_dropped_writes_total, logged); --disk-worker-class normal trades GET latency for disk throughput (docs/disk.md)"
            );
        }
        let shared = Arc::new(Shared {
            index: Mutex::new(Index::new(cfg.size_bytes, &cfg.tenant_limits)),
            log: Mutex::new(log),
            order: Mutex::new(Order::default()),
            commit: Mutex::new(()),
            removing: Mutex::new(()),
            cfg,
            dir,
            slab: SlabGate::new(region),
            events,
            cells,
            indexed: AtomicBool::new(false),
            indexed_wait: (Mutex::new(()), Condvar::new()),
            writes: Queue::new(),
            removals: Queue::new(),
            fetches: Queue::new(),
            run: AtomicU64::new(0),
            released: (Mutex::new(!held), Condvar::new()),
            lost: AtomicBool::new(false),
            backlog: Mutex::new(Backlog::default()),
            catalog: Mutex::new(None),
            catalog_stuck: AtomicBool::new(false),
            catalog_writers: AtomicUsize::new(0),
            tmp_seq: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
        });
        if let Err(e) = spawn_threads(&shared) {
            shared.halt();
            return Err(DiskError::Io {
                what: "starting the threads for",
                path: shared.cfg.dir.display().to_string(),
                source: e,
            });
        }
        Ok(DiskTier { shared, halted: false })
    }
}

/// Starts the threads of the current run: the index rebuild (if not done
/// yet), the writers, the readers and the remover.
fn spawn_threads(shared: &Arc<Shared>) -> std::io::Result<()> {
    let run = shared.run.load(Acquire);
    let nice = worker_nice_value(shared.cfg.worker_nice);
    let class = shared.cfg.worker_class;
    let spawn = |f: fn(&Shared, u64), idle: bool| {
        let s = shared.clone();
        let name = if idle { THREAD_NAME } else { REMOVER_THREAD_NAME };
        std::thread::Builder::new().name(name.into()).spawn(move || {
            enter_worker_class("disk", nice, idle && class == WorkerClass::Idle);
            if s.wait_released(run) {
                f(&s, run)
            }
        })
    };
    if !shared.indexed.load(Acquire) {
        spawn(rebuild::rebuild_index, true)?;
    }
    for _ in 0..WRITERS {
        spawn(write_loop, true)?;
    }
    for _ in 0..READERS {
        spawn(read_loop, true)?;
    }
    spawn(remove_loop, false)?;
    Ok(())
}

impl Tier for DiskTier {
    /// Takes the block if the write-behind queue's bytes stay within the
    /// bound, the block's tenant's queued bytes within its share (half its
    /// megaslab limit, if it has one: its backlog, pinned, never holds all
    /// of it) and the block fits on the disk at all; otherwise counts it in
    /// `disk_dropped_writes` (and logs, at most every 10 s).
    fn write_behind(&self, offer: Offer<'_>, pinned: &mut dyn FnMut() -> Option<WriteJob>) {
        let s = &self.shared;
        let len = offer.len;
        if s.lost.load(Relaxed) {
            s.dropped(|| "the tier's directory is gone".into());
            return;
        }
        if index::disk_bytes(format::file_len(len)) > s.cfg.size_bytes {
            s.dropped(|| format!("a block of {len} bytes is larger than --disk-size"));
            return;
        }
        if let Err(queued) = s.queue().fits(len) {
            s.dropped(|| {
                format!("the write-behind queue holds {queued} bytes of --disk-queue-bytes {}", s.cfg.queue_bytes)
            });
            return;
        }
        let share = offer.tenant_limit.map_or(s.cfg.queue_bytes, |l| (l / 2).min(s.cfg.queue_bytes));
        let tenant_queued = lock(&s.backlog).by_tenant.get(offer.tenant).copied().unwrap_or(0);
        if tenant_queued.saturating_add(len) > share {
            s.dropped(|| {
                format!(
                    "tenant {:?} has {tenant_queued} bytes queued, its share of the queue is {share} (half its --tenant-limit)",
                    offer.tenant
                )
            });
            return;
        }
        let Some(job) = pinned() else {
            s.dropped(|| "the block was gone before it was pinned".into());
            return;
        };
        s.queue().push(len);
        *lock(&s.backlog).by_tenant.entry(job.tenant.clone()).or_insert(0) += len;
        let seq = lock(&s.order).take_write(PendingWrite { key: job.key, parent: job.parent });
        s.writes.push(Write { job, seq });
    }

    /// Queues the fetch; a read-ahead after every fetch a client waits for.
    fn fetch(&self, job: FetchJob) {
        if !job.ahead {
            add(&self.shared.cells().fetches, 1);
        }
        if self.shared.lost.load(Relaxed) {
            self.shared.events.send(TierEvent::Filled { fetch: job.id, filled: Vec::new() });
            return;
        }
        if job.ahead {
            self.shared.fetches.push(job);
        } else {
            self.shared.fetches.push_before(job, |j| j.ahead);
        }
    }

    /// Up to `--disk-read-ahead` blocks after `key` (at most
    /// [`READ_AHEAD_MAX_BYTES`]), from the index's child hints; none while
    /// another thread holds the index (the serve loop does not wait).
    fn chain_after(&self, key: u128) -> Vec<u128> {
        let s = &self.shared;
        if s.cfg.read_ahead == 0 || s.lost.load(Relaxed) {
            return Vec::new();
        }
        match s.index.try_lock() {
            Ok(ix) => ix.chain_after(key, s.cfg.read_ahead, READ_AHEAD_MAX_BYTES).into_iter().map(|e| e.0).collect(),
            Err(_) => Vec::new(),
        }
    }

    fn fetch_bound(&self) -> Duration {
        self.shared.cfg.timeout
    }

    fn landed(&self, len: u64) {
        add(&self.shared.cells().fills, 1);
        add(&self.shared.cells().fill_bytes, len);
    }

    fn filled_after(&self, us: u64) {
        self.shared.cells().fill.observe(us);
    }

    fn admission(&self) -> Admission {
        self.shared.cfg.admission
    }

    /// Leaves a tombstone for `key` (fills miss it from now on, earlier
    /// writes of it do not land) and, if an older copy of it may be on
    /// disk (in the index, being written or evicted, or the index is not
    /// rebuilt yet), queues its removal for the remover: `Pending`.
    fn remove(&self, key: u128) -> Removal {
        let s = &self.shared;
        if s.lost.load(Relaxed) {
            return Removal::Done;
        }
        // Before the rebuild is done, any key may be on disk; after it, the
        // keys on disk, written or evicted are all in `Order` (a write is
        // indexed before it leaves `writing`).
        let indexed = s.indexed.load(Acquire);
        let mut order = lock(&s.order);
        // The index only if its mutex is free (this is the serve loop): a
        // thread holding it may be changing the index and `order` together,
        // so while it is held any key may be on disk.
        let in_index = || match s.index.try_lock() {
            Ok(ix) => ix.contains(key),
            Err(TryLockError::Poisoned(e)) => e.into_inner().contains(key),
            Err(TryLockError::WouldBlock) => true,
        };
        let may_hold = !indexed
            || order.writing.contains_key(&key)
            || order.evicting.contains_key(&key)
            || order.tombs.get(&key).is_some_and(|t| !t.done)
            || in_index();
        if !may_hold {
            return Removal::Done;
        }
        let seq = order.next();
        order.tombs.insert(key, Tomb { seq, done: false });
        drop(order);
        let token = s.tokens.fetch_add(1, Relaxed) + 1;
        s.removals.push(RemoveJob { key, token });
        Removal::Pending(token)
    }

    fn release(&self) {
        let (m, cv) = &self.shared.released;
        let mut released = lock(m);
        if !*released {
            // Adopted from the daemon taken over: the lock file names this one now.
            self.shared.dir.write_pid();
        }
        *released = true;
        cv.notify_all();
    }

    fn timed_out(&self) {
        add(&self.shared.cells().fetches_timed_out, 1);
    }

    fn unconfirmed(&self) {
        add(&self.shared.cells().unconfirmed_removals, 1);
    }

    /// Stops the threads' work (waiting for a copy in progress), finishes
    /// the queued removals and hands back the writes not finished; keeps the
    /// directory and its lock (the stopped tier holds them, and a takeover
    /// hands them to the new daemon: the lock is never let go in between).
    fn stop(mut self: Box<Self>) -> (Box<dyn StoppedTier>, Handover) {
        self.halted = true;
        let handover = self.shared.halt();
        (Box::new(StoppedDisk { shared: self.shared.clone() }), handover)
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if !self.halted {
            self.shared.halt();
        }
    }
}

/// The disk tier stopped for a takeover: its state, directory and lock,
/// to start again as it was if the takeover fails.
struct StoppedDisk {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for StoppedDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoppedDisk").field("dir", &self.shared.cfg.dir).finish()
    }
}

impl StoppedTier for StoppedDisk {
    fn resume(self: Box<Self>) -> Result<Box<dyn Tier>, TierError> {
        let shared = self.shared.clone();
        shared.slab.reopen();
        spawn_threads(&shared)?;
        for key in shared.unremoved() {
            // Retried by the new run's remover (nobody waits for the answer).
            shared.removals.push(RemoveJob { key, token: 0 });
        }
        Ok(Box::new(DiskTier { shared, halted: false }))
    }

    fn handover_fds(&self) -> Option<(&'static str, Vec<OwnedFd>)> {
        let [dir, lock] = self.shared.dir.handover_fds();
        let fds: Vec<OwnedFd> = [dir, lock].iter().filter_map(|fd| fd.try_clone_to_owned().ok()).collect();
        (fds.len() == 2).then_some((HANDOVER_NAME, fds))
    }
}

/// Drops a file's pages from the page cache (clean pages go at once: call
/// after the data is synced or only read).
fn drop_cache(f: &File) {
    let _ = rustix::fs::fadvise(f, 0, None, rustix::fs::Advice::DontNeed);
}

/// Deletes the files of blocks evicted from the index (taken out of it and
/// noted in `Order::evicting` by the caller, who syncs the directory and
/// then calls [`evicted`]).
fn delete_victims(s: &Shared, victims: &[(u128, index::Entry)]) {
    for (key, _) in victims {
        let _c = lock(&s.commit);
        match s.dir.remove_block(*key) {
            Ok(true) => add(&s.cells().evictions, 1),
            Ok(false) => {}
            Err(e) => {
                add(&s.cells().errors, 1);
                tracing::debug!(key = %format_args!("{key:032x}"), "disk tier: deleting an evicted block: {e}");
            }
        }
    }
}

/// The evictions of `keys` are over: their unlinks are durable (the
/// directory was synced since), so a removal need not wait for them.
fn evicted(s: &Shared, keys: &[u128]) {
    let mut order = lock(&s.order);
    for &key in keys {
        count_out(&mut order.evicting, key);
    }
}

/// Deletes a block file that did not verify and takes it out of the index.
fn discard_torn(s: &Shared, key: u128, why: &dyn std::fmt::Display) {
    add(&s.cells().torn, 1);
    tracing::warn!(key = %format_args!("{key:032x}"), "disk tier: block file refused and deleted: {why}");
    {
        let _c = lock(&s.commit);
        let _ = s.dir.remove_block(key);
    }
    let mut ix = lock(&s.index);
    if ix.remove(key).is_some() {
        s.log_removed([&key]);
    }
    s.publish(&ix);
}

/// The metadata record in the header area `area` of block `key`, if it has
/// one that verifies (one that does not is logged and left out: the block
/// is published by key).
fn record_of(key: u128, area: &[u8]) -> Option<Arc<BlockMeta>> {
    match Header::record(area)? {
        Ok(m) => Some(Arc::new(m)),
        Err(why) => {
            tracing::debug!(key = %format_args!("{key:032x}"), "disk tier: the block's metadata record is ignored: {why}");
            None
        }
    }
}

/// A writer thread: waits for the index, then writes queued blocks, those
/// queued one behind the other in batches ([`write_batch`]).
fn write_loop(s: &Shared, run: u64) {
    {
        let mut g = lock(&s.indexed_wait.0);
        while !s.indexed.load(Acquire) && s.live(run) {
            g = s.indexed_wait.1.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
    let alive = || s.live(run);
    while let Some(first) = s.writes.pop(&alive) {
        let (mut bytes, mut more) = (0u64, 0usize);
        let mut batch = vec![first];
        batch.extend(s.writes.pop_while(|w| {
            let take = more + 1 < BATCH_BLOCKS && bytes.saturating_add(w.job.len) <= BATCH_BYTES;
            if take {
                bytes += w.job.len;
                more += 1;
            }
            take
        }));
        let results =
            if s.check_dir() { write_batch(s, &batch, run) } else { batch.iter().map(|_| Ok(false)).collect() };
        let cells = s.cells();
        for (w, result) in batch.into_iter().zip(results) {
            match result {
                Ok(true) => {
                    add(&cells.writes, 1);
                    add(&cells.write_bytes, w.job.len);
                }
                Ok(false) if !s.live(run) => {}
                Ok(false) => add(&cells.dropped_writes, 1),
                Err(e) => {
                    add(&cells.errors, 1);
                    tracing::debug!(key = %format_args!("{:032x}", w.job.key), "disk write failed: {e}");
                }
            }
            if s.live(run) {
                // (A stop hands the queue over and resets these itself.)
                s.queue().pop(w.job.len);
                if let Some(b) = lock(&s.backlog).by_tenant.get_mut(&w.job.tenant) {
                    *b = b.saturating_sub(w.job.len);
                }
                lock(&s.order).finish_write(w.seq);
            }
            s.events.send(TierEvent::Written { pin: w.job.pin });
        }
    }
}

/// Whether the write numbered `seq` of `key` lost to a later removal.
fn superseded(s: &Shared, key: u128, seq: u64) -> bool {
    lock(&s.order).tombs.get(&key).is_some_and(|t| t.seq > seq)
}

/// A block of a batch on its way to disk.
struct Staged {
    /// Its place in the batch.
    at: usize,
    /// Bytes it takes on disk (reserved in the index).
    bytes: u64,
    /// Its tenant's row in the index.
    tenant: index::TenantRow,
    tmp: String,
    /// Open while its data is being synced.
    file: Option<File>,
    /// Its catalog entry (`None`: no file, or no inode).
    entry: Option<catalog::Entry>,
}

/// Writes the blocks `batch`; each one's outcome: `Ok(true)` written,
/// `Ok(false)` not written (the tier stopped, the block does not fit on the
/// disk, or a later removal of its key came first), or the error.
///
/// A group commit: each block's file is written under `tmp/` and handed to
/// the disk at once, then each file's data is synced (`fdatasync`) and
/// dropped from the page cache, then each is renamed into place, then the
/// directory is synced once for all of them; a block counts as written only
/// after that sync, so only once its bytes and its name are durable.
fn write_batch(s: &Shared, batch: &[Write], run: u64) -> Vec<std::io::Result<bool>> {
    let mut out: Vec<std::io::Result<bool>> = batch.iter().map(|_| Ok(false)).collect();
    let mut staged: Vec<Staged> = Vec::with_capacity(batch.len());
    let mut evictions: Vec<u128> = Vec::new();
    for (at, w) in batch.iter().enumerate() {
        let job = &w.job;
        if superseded(s, job.key, w.seq) {
            continue;
        }
        let bytes = index::disk_bytes(format::file_len(job.len));
        let (victims, tenant) = {
            let mut ix = lock(&s.index);
            let tenant = ix.tenant(&job.tenant);
            let v = ix.make_room(bytes, job.parent, tenant);
            if let Ok(v) = &v {
                s.log_removed(v.iter().map(|(k, _)| k));
                let mut order = lock(&s.order);
                for (key, _) in v {
                    count_in(&mut order.evicting, *key);
                }
            }
            s.publish(&ix);
            (v, tenant)
        };
        let Ok(victims) = victims else { continue };
        delete_victims(s, &victims);
        evictions.extend(victims.iter().map(|(k, _)| *k));
        let tmp = format!("{:032x}.{}.tmp", job.key, s.tmp_seq.fetch_add(1, Relaxed));
        match write_file(s, job, &tmp, run) {
            Ok(Some((file, written_ms))) => {
                let entry = file.metadata().ok().map(|m| catalog::Entry {
                    key: job.key,
                    parent: job.parent,
                    ino: std::os::unix::fs::MetadataExt::ino(&m),
                    file_len: format::file_len(job.len),
                    written_ms,
                    tenant: job.tenant.as_str().into(),
                    record: format::record_bytes(job.meta.as_deref()).map(Vec::into_boxed_slice),
                });
                staged.push(Staged { at, bytes, tenant, tmp, file: Some(file), entry })
            }
            Ok(None) => staged.push(Staged { at, bytes, tenant, tmp, file: None, entry: None }),
            Err(e) => {
                out[at] = Err(e);
                staged.push(Staged { at, bytes, tenant, tmp, file: None, entry: None });
            }
        }
    }
    // The catalog's entries, written now and synced before any rename
    // (`catalog`, "The contract").
    let mut catalog = lock(&s.catalog);
    // Stuck (its removal failed): tried again, the renames go on once it is gone.
    if s.catalog_stuck.load(Relaxed) && s.dir.remove_catalog().is_ok() {
        tracing::info!("disk tier: the failed catalog is deleted now: blocks are written to disk again");
        s.catalog_stuck.store(false, Relaxed);
    }
    let mut catalog_ok = true;
    let mut catalog_file = None;
    let mut appended = false;
    // (A writer of a run that is over renames nothing: it appends nothing either,
    // so a stalled one cannot write into the catalog of the tier's next owner.)
    if let Some(c) = catalog.as_mut().filter(|_| s.live(run) && staged.iter().any(|st| st.entry.is_some())) {
        let entries = staged.iter().filter_map(|st| st.entry.as_ref());
        match s.dir.append_catalog().and_then(|f| c.append(&f, entries).map(|_| f)) {
            Ok(f) => {
                s.catalog_writers.fetch_add(1, Relaxed);
                appended = true;
                catalog_file = Some(f);
            }
            Err(e) => catalog_ok = drop_catalog(s, &mut catalog, &e),
        }
    }
    // Data: synced file by file (the first sync waits for the device; the
    // others find their writes done or in flight).
    for st in &mut staged {
        if let Some(f) = st.file.take() {
            match f.sync_data() {
                Ok(()) => {
                    drop_cache(&f);
                    out[st.at] = Ok(s.live(run));
                }
                Err(e) => out[st.at] = Err(e),
            }
        }
    }
    if let Some(f) = catalog_file.take() {
        if let Err(e) = f.sync_data() {
            catalog_ok &= drop_catalog(s, &mut catalog, &e);
        }
    }
    drop(catalog);
    if !catalog_ok || s.catalog_stuck.load(Relaxed) {
        // Neither entries nor the catalog's removal durable: no rename.
        for st in &staged {
            if matches!(out[st.at], Ok(true)) {
                out[st.at] = Err(std::io::Error::other("the disk tier's catalog failed"));
            }
        }
    }
    // Names: renamed into place, then one directory sync for the batch.
    let mut renamed = false;
    for st in &staged {
        if matches!(out[st.at], Ok(true)) {
            let w = &batch[st.at];
            out[st.at] = rename_into_place(s, &w.job, w.seq, &st.tmp, run);
            renamed |= matches!(out[st.at], Ok(true));
        }
    }
    if renamed || !evictions.is_empty() {
        if let Err(e) = s.dir.sync_blocks() {
            for st in &staged {
                if matches!(out[st.at], Ok(true)) {
                    out[st.at] = Err(std::io::Error::new(e.kind(), e.to_string()));
                }
            }
        }
    }
    evicted(s, &evictions);
    // Indexed (and so counted in `disk_blocks`) only once synced; under the
    // commit lock, so that a removal's unlink comes wholly before or after.
    let _commit = lock(&s.commit);
    let mut ix = lock(&s.index);
    for st in &staged {
        let w = &batch[st.at];
        ix.unreserve(st.bytes, st.tenant);
        match out[st.at] {
            Ok(true) if !superseded(s, w.job.key, w.seq) => {
                ix.insert(w.job.key, w.job.parent, st.bytes, st.tenant);
                lock(&s.log).stored(w.job.key, w.job.parent, w.job.meta.clone());
            }
            Ok(true) => out[st.at] = Ok(false),
            _ => s.dir.remove_tmp(&st.tmp),
        }
    }
    s.publish(&ix);
    drop((ix, _commit));
    if appended {
        s.catalog_writers.fetch_sub(1, Release);
    }
    compact_catalog(s, run);
    out
}

/// Deletes the catalog after it failed (`e`): a block renamed without its
/// entry must not meet an older entry of its key at the next start.
/// Whether it is gone (durably); if not, no block is renamed into place
/// until it is ([`Shared::catalog_stuck`]: writes fail, fills and removals
/// go on; each batch tries the removal again).
fn drop_catalog(s: &Shared, catalog: &mut Option<catalog::Appender>, e: &std::io::Error) -> bool {
    *catalog = None;
    add(&s.cells().errors, 1);
    match s.dir.remove_catalog() {
        Ok(()) => {
            tracing::warn!("disk tier: the catalog failed ({e}) and is deleted: the next start reads every header");
            true
        }
        Err(e2) => {
            tracing::error!(
                "disk tier: the catalog failed ({e}) and could not be deleted ({e2}): no block is written to disk until it is"
            );
            s.catalog_stuck.store(true, Relaxed);
            false
        }
    }
}

/// Writes the catalog anew when it holds more than twice as many entries
/// as blocks on disk (and `--disk-catalog-slack` more): its latest entry of each
/// block still on disk. Writers wait meanwhile (a pass over the file).
fn compact_catalog(s: &Shared, run: u64) {
    let mut catalog = lock(&s.catalog);
    let Some(c) = catalog.as_ref() else { return };
    let blocks = lock(&s.index).blocks();
    if c.entries <= 2 * blocks + s.cfg.catalog_slack || !s.live(run) || s.catalog_writers.load(Acquire) > 0 {
        // (Another writer's entries name blocks not indexed yet: the next
        // batch's end writes it anew.)
        return;
    }
    let t = Instant::now();
    let before = c.entries;
    let done = match s.dir.open_catalog() {
        Ok(Some(f)) => catalog::load(std::io::BufReader::with_capacity(1 << 20, f)).map_err(|e| e.to_string()),
        Ok(None) => Err("it is gone".into()),
        Err(e) => Err(e.to_string()),
    }
    .and_then(|mut l| {
        for chunk in l.entries.chunks_mut(INDEX_CHUNK) {
            let ix = lock(&s.index);
            for e in chunk {
                if !ix.contains(e.key) {
                    e.key = 0;
                    e.ino = 0;
                }
            }
        }
        let keep = l.entries.iter().filter(|e| e.ino != 0);
        s.dir.replace_catalog(|w| catalog::write_all(w, keep)).map_err(|e| e.to_string())
    });
    match done {
        Ok(n) => {
            *catalog = Some(catalog::Appender::new(n));
            tracing::info!(
                "disk tier: the catalog written anew: {before} entries to {n}, in {:.3} s",
                t.elapsed().as_secs_f64()
            );
        }
        Err(e) => {
            drop_catalog(s, &mut catalog, &std::io::Error::other(e));
        }
    }
}

/// Renames the written file `tmp` of `job` (numbered `seq`) into place,
/// unless the run is over or a later removal of its key came first
/// (`Ok(false)`). A tombstone of an earlier removal is done with: this file
/// replaces the older one.
fn rename_into_place(s: &Shared, job: &WriteJob, seq: u64, tmp: &str, run: u64) -> std::io::Result<bool> {
    let _commit = lock(&s.commit);
    if !s.live(run) {
        return Ok(false);
    }
    {
        let mut order = lock(&s.order);
        match order.tombs.get_mut(&job.key) {
            Some(t) if t.seq > seq => return Ok(false),
            Some(t) => t.done = true,
            None => {}
        }
    }
    s.dir.rename_into_place(tmp, job.key)?;
    Ok(true)
}

/// Writes `job`'s block to the new temporary file `tmp` and hands its pages
/// to the disk (not yet synced); the file and the header's time, or `None`:
/// the tier stopped.
fn write_file(s: &Shared, job: &WriteJob, tmp: &str, run: u64) -> std::io::Result<Option<(File, u64)>> {
    let f = s.dir.create_tmp(tmp)?;
    let wrote = s.slab.with(job.data_offset, job.len, |ptr| -> std::io::Result<Option<u64>> {
        if !s.live(run) {
            return Ok(None);
        }
        // SAFETY: `job.pin` pins this committed block for the tier's session
        // until the writer sends `Written`, after this returns: the extent is
        // not evicted, moved or reused meanwhile, and a committed block's
        // bytes are not written again. The pin outlives the gate only while
        // the tier runs: stopping (which closes the tier's session, dropping
        // the pin) closes the gate first, which waits for this closure. The
        // region stays mapped while the gate's region (an `Arc`) lives.
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
        // The block's metadata record rides in the header area, where it fits.
        f.write_all_at(&header.encode_with(job.meta.as_deref()).0, 0)?;
        start_writeback(&f, 0, format::HEADER_AREA);
        let mut at = 0u64;
        for piece in data.chunks(WRITE_PIECE_BYTES as usize) {
            f.write_all_at(piece, format::HEADER_AREA + at)?;
            start_writeback(&f, format::HEADER_AREA + at, piece.len() as u64);
            at += piece.len() as u64;
        }
        Ok(Some(written_ms))
    });
    match wrote {
        Ok(Ok(Some(ms))) => Ok(s.live(run).then_some((f, ms))),
        Ok(Ok(None)) | Err(Refused::Closed) => Ok(None),
        Ok(Err(e)) => Err(e),
        Err(Refused::Outside) => Err(std::io::Error::other("block outside the megaslab")),
    }
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

/// The remover thread: makes the queued removals durable, a batch at a
/// time (each key's file unlinked, then one directory sync), answers each
/// once, and tries those that failed again every [`REMOVAL_RETRY`].
fn remove_loop(s: &Shared, run: u64) {
    let alive = || s.live(run);
    let mut retry: Vec<RemoveJob> = Vec::new();
    let mut retry_at = Instant::now();
    loop {
        let mut wait = (!retry.is_empty()).then(|| retry_at.saturating_duration_since(Instant::now()));
        // The KV event publisher is owed the whole index: retried until it
        // has room, even while the tier is quiet.
        let owed = lock(&s.log).snapshot_due();
        if owed {
            wait = Some(wait.map_or(events::RETRY, |w| w.min(events::RETRY)));
        }
        let Some(mut batch) = s.removals.pop_all(&alive, wait) else { return };
        if owed {
            let ix = lock(&s.index);
            s.publish(&ix);
        }
        let retrying = !retry.is_empty() && Instant::now() >= retry_at;
        if retrying {
            batch.append(&mut retry);
        }
        if batch.is_empty() {
            continue;
        }
        let _r = lock(&s.removing);
        if !s.live(run) {
            // Stopping: the stop finishes the queue (put back what was taken).
            let mut q = lock(&s.removals.items);
            for j in batch.into_iter().rev() {
                q.push_front(j);
            }
            return;
        }
        let results = if s.check_dir() {
            remove_now(s, &batch, Some(run))
        } else {
            batch.iter().map(|_| Err("the disk tier's directory is gone".to_string())).collect()
        };
        for (job, result) in batch.into_iter().zip(results) {
            let failed = result.is_err();
            if job.token != 0 {
                s.events.send(TierEvent::Removed { token: job.token, result });
            }
            if failed && !s.lost.load(Relaxed) {
                retry.push(RemoveJob { token: 0, ..job });
            }
        }
        if !retry.is_empty() {
            retry_at = Instant::now() + REMOVAL_RETRY;
        }
    }
}

/// Makes the removals `jobs` durable now: under the commit lock, each
/// key's file is unlinked unless a newer write's rename (or an earlier
/// removal) took it away already; then, if anything could still come back
/// after a crash (a file unlinked, a rename that replaced the older copy, an
/// eviction of the key not synced yet), the directory is synced; then each
/// key is out of the index and its tombstone done. `run`: stop if that run
/// is over. Each one's outcome.
fn remove_now(s: &Shared, jobs: &[RemoveJob], run: Option<u64>) -> Vec<Result<(), String>> {
    let mut out: Vec<Result<(), String>> = Vec::with_capacity(jobs.len());
    let mut unlinked = 0u64;
    let mut needs_sync = false;
    // The tombstones whose work this does, by the number they had: marked
    // done once synced (not a newer one made meanwhile, which has a job of
    // its own).
    let mut done: Vec<(u128, u64)> = Vec::new();
    {
        let _c = lock(&s.commit);
        if run.is_some_and(|r| !s.live(r)) {
            return jobs.iter().map(|_| Err("the tier stopped".into())).collect();
        }
        for j in jobs {
            let (tomb, evicting) = {
                let order = lock(&s.order);
                (order.tombs.get(&j.key).copied(), order.evicting.contains_key(&j.key))
            };
            let Some(tomb) = tomb.filter(|t| !t.done) else {
                // Replaced by a newer write's rename, or removed already:
                // the sync below makes that durable.
                needs_sync = true;
                out.push(Ok(()));
                continue;
            };
            match s.dir.remove_block(j.key) {
                Ok(removed) => {
                    // Out of the index now, under the commit lock: a newer
                    // write renamed in after this is indexed after it.
                    let mut ix = lock(&s.index);
                    if ix.remove(j.key).is_some() {
                        s.log_removed([&j.key]);
                        s.publish(&ix);
                    }
                    unlinked += u64::from(removed);
                    needs_sync |= removed || evicting;
                    done.push((j.key, tomb.seq));
                    out.push(Ok(()));
                }
                Err(e) => {
                    add(&s.cells().errors, 1);
                    out.push(Err(format!(
                        "removing {}/blocks/{}: {e}",
                        s.cfg.dir.display(),
                        format::block_name(j.key)
                    )));
                }
            }
        }
    }
    if needs_sync {
        if let Err(e) = s.dir.sync_blocks() {
            add(&s.cells().errors, 1);
            let why = format!("syncing {}/blocks: {e}", s.cfg.dir.display());
            for o in &mut out {
                if o.is_ok() {
                    *o = Err(why.clone());
                }
            }
            done.clear();
        }
    }
    let ix = lock(&s.index);
    let mut order = lock(&s.order);
    for (key, seq) in done {
        if let Some(t) = order.tombs.get_mut(&key).filter(|t| t.seq == seq) {
            t.done = true;
        }
    }
    order.prune();
    drop(order);
    s.publish(&ix);
    drop(ix);
    let ok = out.iter().filter(|o| o.is_ok()).count() as u64;
    add(&s.cells().removals, ok);
    add(&s.cells().deletes, unlinked);
    for why in out.iter().filter_map(|o| o.as_ref().err()) {
        tracing::warn!(
            event = "disk_removal_failed",
            "disk tier: an older copy could not be removed (retried; no copy is served meanwhile): {why}"
        );
    }
    out
}

/// A reader thread: runs fetches.
fn read_loop(s: &Shared, run: u64) {
    let alive = || s.live(run);
    while let Some(job) = s.fetches.pop(&alive) {
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
        // Removed (deleted, replaced) by a client (its file may not be gone yet).
        if lock(&s.order).tombs.contains_key(&key) {
            if !job.ahead {
                add(&cells.misses, 1);
            }
            continue;
        }
        match s.dir.open_block(key) {
            Ok(f) => {
                if let Some(len) = f.metadata().ok().map(|m| m.len()).filter(|&l| l <= WILLNEED_MAX_BYTES) {
                    let _ = rustix::fs::fadvise(&f, 0, std::num::NonZeroU64::new(len), rustix::fs::Advice::WillNeed);
                }
                opened.push((key, f));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !job.ahead {
                    add(&cells.misses, 1);
                }
            }
            Err(e) => {
                add(&cells.errors, 1);
                tracing::debug!(key = %format_args!("{key:032x}"), "disk read failed: {e}");
            }
        }
    }
    let mut found: Vec<(Header, File, Option<Arc<BlockMeta>>)> = Vec::new();
    // The whole header area while the KV events are published: the block's
    // metadata record goes with it into the megaslab.
    let records = lock(&s.log).is_on();
    let mut b = vec![0u8; if records { format::HEADER_AREA as usize } else { format::HEADER_LEN }];
    for (key, f) in opened {
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
            Ok(h) => {
                let meta = if records { record_of(key, &b) } else { None };
                found.push((h, f, meta))
            }
            Err(why) => discard_torn(s, key, &why),
        }
    }
    if found.is_empty() {
        return Vec::new();
    }
    let specs = found
        .iter()
        .map(|(h, _, meta)| FillSpec {
            key: h.key,
            dtype: h.dtype,
            shape: h.shape,
            len: h.len,
            parent: h.parent,
            tenant: h.tenant.clone(),
            meta: meta.clone(),
        })
        .collect();
    let (tx, rx) = crate::tier::reply::channel();
    s.events.send(TierEvent::Reserve { fetch: job.id, blocks: specs, reply: tx });
    // The serve loop answers at its next pass (or drops the sender when it
    // stops).
    let Ok(reserved) = rx.wait() else { return Vec::new() };
    let mut filled = Vec::new();
    // Read-ahead blocks without free megaslab room: read into the page cache
    // (kept), for a client's miss of them to copy instead of wait.
    let mut cached: Vec<usize> = Vec::new();
    for (at, ((h, f, _), r)) in found.iter().zip(reserved).enumerate() {
        let Some(r) = r else {
            if job.ahead {
                let _ = rustix::fs::fadvise(f, 0, None, rustix::fs::Advice::WillNeed);
                add(&cells.read_ahead_cached, 1);
                cached.push(at);
            }
            continue;
        };
        let read = s.slab.with(r.data_offset, h.len, |ptr| {
            // SAFETY: the serve loop reserved `[data_offset, data_offset + len)`
            // for the tier's session and touches it again only when this fetch's
            // `Filled` (sent after this returns) commits or aborts it; a
            // reservation is invisible to clients and never evicted. The tier's
            // session (and with it the reservation) is closed only after a stop,
            // which closes the gate first (waiting for this closure). The region
            // stays mapped while the gate's region lives.
            let buf: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), h.len as usize) };
            f.read_exact_at(buf, format::HEADER_AREA).map(|()| format::checksum(buf) == h.checksum)
        });
        match read {
            Err(Refused::Closed) => break,
            Err(Refused::Outside) => continue,
            Ok(Ok(true)) => {
                drop_cache(f);
                filled.push((r.handle, h.len));
                if job.ahead {
                    add(&cells.read_ahead, 1);
                } else {
                    lock(&s.index).touch(h.key);
                }
            }
            Ok(Ok(false)) => discard_torn(s, h.key, &format::FormatError::Checksum),
            // Truncated since its header was checked.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => discard_torn(s, h.key, &e),
            Ok(Err(e)) => {
                add(&cells.errors, 1);
                tracing::debug!(key = %format_args!("{:032x}", h.key), "disk read failed: {e}");
            }
        }
    }
    // What a WILLNEED brought in and no fill read (no room, a stop) goes too,
    // but for the read-ahead kept in the page cache.
    for (at, (_, f, _)) in found.iter().enumerate() {
        if !cached.contains(&at) {
            drop_cache(f);
        }
    }
    filled
}
