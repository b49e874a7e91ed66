//! The shared-memory region: a sealed memfd holding the [`RegionHeader`], the
//! per-client channels (a submission and a completion ring each) and the
//! megaslab.
//!
//! Why a sealed memfd rather than `shm_open`: it needs no name in `/dev/shm`
//! (nothing leaks after `kill -9`, Docker's 64 MiB `/dev/shm` does not apply),
//! it dies with the last process that maps it, and `F_SEAL_SHRINK |
//! F_SEAL_GROW` stop any peer from truncating it under the daemon (which would
//! turn its accesses into SIGBUS). Clients receive the fd over the control
//! socket. Memory is reserved with `fallocate` at creation, after checking that
//! the machine has it, so a region that does not fit fails then with a message,
//! never later with SIGBUS; mappings are populated, so page faults happen at
//! creation and attach time, not on the hot path.

use crate::ring::{self, ring_len, Consumer, Producer, RingHeader};
use crate::wait::WaitCell;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

/// First bytes of every region.
pub const MAGIC: [u8; 8] = *b"KACHEDB\0";
/// Bumped on any change to this layout or to `docs/PROTOCOL.md` that a peer
/// of the previous version would misread (not for a field that such a daemon
/// ignores and such a client leaves zero, as a COMMIT's parent in its shape
/// words, `COMMIT_AS_PARENT_NDIM`).
pub const LAYOUT_VERSION: u32 = 4;
/// Page size the layout aligns to.
pub use crate::descriptor::PAGE_LEN;
/// The megaslab starts on a 2 MiB boundary.
pub const SLAB_ALIGN: u64 = 2 << 20;
/// Bytes of the region header page.
pub const HEADER_LEN: u64 = PAGE_LEN;

/// The header at offset 0 of a region. Written once by the daemon before any
/// client maps it; clients copy it once at attach and validate it. The
/// doorbell is the only live field. Every peer maps the page writable, so
/// the daemon keeps its own copy of the words before the doorbell and writes
/// them back when a peer changed them ([`Region::restore_header`]).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct RegionHeader {
    /// [`MAGIC`].
    pub magic: [u8; 8],
    /// [`LAYOUT_VERSION`].
    pub layout_version: u32,
    /// Bytes of this header ([`HEADER_LEN`]).
    pub header_len: u32,
    /// Random per region; a client checks it against the control socket's.
    pub generation: u64,
    /// Bytes of the whole region.
    pub region_len: u64,
    /// Bytes from the base to channel 0.
    pub channel_offset: u64,
    /// Bytes between channels.
    pub channel_stride: u64,
    /// Channels.
    pub channel_count: u32,
    /// Slots per ring.
    pub ring_capacity: u32,
    /// Bytes from the base to the megaslab.
    pub slab_offset: u64,
    /// Bytes of megaslab.
    pub slab_len: u64,
    /// Daemon process id.
    pub daemon_pid: u32,
    _reserved: [u8; 4],
    /// The daemon parks on this cell when every submission ring is empty;
    /// clients notify it after publishing (own cache line).
    pub doorbell: Doorbell,
}

/// The doorbell on its own cache line.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct Doorbell {
    /// The daemon's wait cell.
    pub cell: WaitCell,
}

#[cfg(not(loom))]
const _: () = {
    assert!(core::mem::offset_of!(RegionHeader, doorbell) == 128);
    assert!(core::mem::size_of::<RegionHeader>() <= HEADER_LEN as usize);
};

/// The 8-byte words of the header before the doorbell: every field but the
/// doorbell, and the padding up to its cache line.
const HEADER_WORDS: usize = core::mem::offset_of!(RegionHeader, doorbell) / 8;

/// The trusted geometry of a region, computed from three numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Channels (clients at once).
    pub channel_count: u32,
    /// Slots per ring (power of two).
    pub ring_capacity: u32,
    /// Bytes from the base to channel 0.
    pub channel_offset: u64,
    /// Bytes between channels (page multiple).
    pub channel_stride: u64,
    /// Bytes from the base to the megaslab (2 MiB multiple).
    pub slab_offset: u64,
    /// Bytes of megaslab (page multiple).
    pub slab_len: u64,
    /// Bytes of the region.
    pub region_len: u64,
}

const fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

impl Layout {
    /// A layout for `channel_count` channels of two rings of `ring_capacity`
    /// slots, and a megaslab of `slab_len` bytes (rounded up to pages).
    pub fn new(channel_count: u32, ring_capacity: u32, slab_len: u64) -> Result<Self, RegionError> {
        if channel_count == 0 || channel_count > 4096 {
            return Err(RegionError::BadLayout(format!("channel count {channel_count} must be in 1..=4096")));
        }
        if !ring_capacity.is_power_of_two() || !(2..=1 << 20).contains(&ring_capacity) {
            return Err(RegionError::BadLayout(format!(
                "ring capacity {ring_capacity} must be a power of two in 2..=1048576"
            )));
        }
        let channel_stride = round_up(2 * ring_len(ring_capacity) as u64, PAGE_LEN);
        let channel_offset = HEADER_LEN;
        let slab_offset = round_up(channel_offset + channel_stride * u64::from(channel_count), SLAB_ALIGN);
        let slab_len = round_up(slab_len.max(PAGE_LEN), PAGE_LEN);
        let region_len = slab_offset
            .checked_add(slab_len)
            .ok_or_else(|| RegionError::BadLayout("megaslab size overflows".into()))?;
        Ok(Self { channel_count, ring_capacity, channel_offset, channel_stride, slab_offset, slab_len, region_len })
    }

    /// Byte offsets (from the base) of channel `ch`'s submission and completion rings.
    pub fn ring_offsets(&self, ch: u32) -> Option<(u64, u64)> {
        if ch >= self.channel_count {
            return None;
        }
        let sub = self.channel_offset + self.channel_stride * u64::from(ch);
        Some((sub, sub + ring_len(self.ring_capacity) as u64))
    }

    fn from_header(h: &RegionHeader, fd_len: u64) -> Result<Self, RegionError> {
        if h.magic != MAGIC {
            return Err(RegionError::BadHeader("magic mismatch: this fd is not a KacheDB region".into()));
        }
        if h.layout_version != LAYOUT_VERSION {
            return Err(RegionError::BadHeader(format!(
                "layout version {} but this client speaks {LAYOUT_VERSION}: upgrade the client or the daemon so they match",
                h.layout_version
            )));
        }
        let l = Layout::new(h.channel_count, h.ring_capacity, h.slab_len)?;
        if l.channel_offset != h.channel_offset
            || l.channel_stride != h.channel_stride
            || l.slab_offset != h.slab_offset
            || l.slab_len != h.slab_len
            || l.region_len != h.region_len
            || h.header_len as u64 != HEADER_LEN
        {
            return Err(RegionError::BadHeader("header offsets do not match the layout they describe".into()));
        }
        if l.region_len != fd_len {
            return Err(RegionError::BadHeader(format!(
                "header says {} bytes but the memfd has {fd_len}",
                l.region_len
            )));
        }
        Ok(l)
    }
}

/// Why creating or attaching a region failed.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The geometry asked for is impossible.
    #[error("bad region layout: {0}")]
    BadLayout(String),
    /// The machine does not have the memory.
    #[error("the region needs {need_bytes} bytes but only {avail_bytes} are available ({source_name}): {fix}")]
    NotEnoughMemory {
        /// Bytes the region needs.
        need_bytes: u64,
        /// Bytes available.
        avail_bytes: u64,
        /// Where the limit comes from.
        source_name: String,
        /// What to do.
        fix: String,
    },
    /// The mapped header is not a valid region.
    #[error("invalid region header: {0}")]
    BadHeader(String),
    /// The memfd is not sealed against shrinking and growing.
    #[error("region memfd is not sealed (seals {0:#x}): refusing to map a region a peer could shrink under us")]
    NotSealed(u32),
    /// A system call failed.
    #[error("{what}: {source}")]
    Os {
        /// What was attempted.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn os(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> RegionError {
    move |e| RegionError::Os { what, source: e.into() }
}

/// Memory this process may still fill: `MemAvailable` and the memory limits of
/// its cgroup and every ancestor (cgroup v2 `memory.max`, or v1
/// `memory.limit_in_bytes`), whichever is least. The text names the source.
pub fn available_memory() -> (u64, String) {
    let mut best = (u64::MAX, String::from("unlimited"));
    if let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") {
        if let Some(kb) = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            best = (kb * 1024, "MemAvailable in /proc/meminfo".into());
        }
    }
    if let Some((avail, file)) = cgroup_available() {
        if avail < best.0 {
            best = (avail, format!("the cgroup memory limit in {file}"));
        }
    }
    best
}

/// Whether `available_memory`'s source is a cgroup limit.
fn is_cgroup_source(source: &str) -> bool {
    source.starts_with("the cgroup")
}

/// The least room left under the memory limit of this process's cgroup or of
/// any ancestor, and the limit file that sets it. Both hierarchies count: a
/// v1 `memory` controller (`N:…memory…:/path`) and v2 (`0::/path`). Without
/// this check, reserving a region past the limit gets the daemon OOM-killed
/// (shmem pages are charged to the cgroup) instead of refused with a message.
fn cgroup_available() -> Option<(u64, String)> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let v2_root = if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        "/sys/fs/cgroup"
    } else {
        "/sys/fs/cgroup/unified"
    };
    let mut best: Option<(u64, String)> = None;
    for line in cg.lines() {
        let mut it = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (it.next(), it.next(), it.next()) else { continue };
        let (root, max_file, cur_file) = if controllers.is_empty() {
            (v2_root, "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
        } else {
            continue;
        };
        let read = |p: &std::path::Path| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
        // The cgroup's own limit and every ancestor's apply.
        let root = std::path::Path::new(root);
        let mut dir = root.join(path.trim().trim_start_matches('/'));
        loop {
            // "max" (v2, no limit) does not parse: skipped.
            if let (Some(max), Some(cur)) = (read(&dir.join(max_file)), read(&dir.join(cur_file))) {
                let avail = max.saturating_sub(cur);
                if !matches!(&best, Some((b, _)) if *b <= avail) {
                    best = Some((avail, dir.join(max_file).display().to_string()));
                }
            }
            if dir == root || !dir.starts_with(root) || !dir.pop() {
                break;
            }
        }
    }
    best
}

/// Options for [`Region::create`].
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// The memfd's name (shown in `/proc/<pid>/fd` as `/memfd:<name>`).
    pub name: String,
    /// The geometry.
    pub layout: Layout,
    /// Memory that must stay free beside the region (bytes).
    pub headroom_bytes: u64,
}

/// A mapped region. Shared (`Arc`) by every ring handle and view into it; it is
/// unmapped when the last one goes.
pub struct Region {
    /// Attached regions only: recorded for forked children (see [`crate::fork`]);
    /// declared before `map`, so it is forgotten before the mapping goes.
    _fork: Option<crate::fork::Recorded>,
    map: memmap2::MmapRaw,
    fd: OwnedFd,
    layout: Layout,
    generation: u64,
    /// The header's words before the doorbell as this process made them
    /// (create) or checked them (attach); [`Region::restore_header`] writes
    /// them back.
    header_words: [u64; HEADER_WORDS],
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("layout", &self.layout).field("generation", &self.generation).finish()
    }
}

impl Region {
    /// Creates, reserves, seals, maps and initialises a region. `progress` is
    /// called with (bytes reserved, bytes total) while memory is reserved.
    pub fn create(opts: &CreateOptions, mut progress: impl FnMut(u64, u64)) -> Result<Arc<Region>, RegionError> {
        use rustix::fs::{fallocate, fcntl_add_seals, ftruncate, memfd_create, FallocateFlags, MemfdFlags, SealFlags};
        let layout = opts.layout;
        let (avail, source_name) = available_memory();
        let need = layout.region_len.saturating_add(opts.headroom_bytes);
        if need > avail {
            let fix = format!(
                "ask for a smaller region (e.g. --size {}MiB) or {}",
                (avail.saturating_sub(opts.headroom_bytes) / 2) >> 20,
                if is_cgroup_source(&source_name) {
                    "raise the cgroup's memory limit (e.g. `docker run --memory`)"
                } else {
                    "free memory"
                }
            );
            return Err(RegionError::NotEnoughMemory {
                need_bytes: layout.region_len,
                avail_bytes: avail.saturating_sub(opts.headroom_bytes),
                source_name,
                fix,
            });
        }
        let fd = memfd_create(opts.name.as_str(), MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(os("memfd_create"))?;
        ftruncate(&fd, layout.region_len).map_err(os("ftruncate of the region memfd"))?;
        // Reserve the memory now, in chunks so a caller can show progress.
        const CHUNK: u64 = 256 << 20;
        let mut done = 0;
        while done < layout.region_len {
            let n = CHUNK.min(layout.region_len - done);
            fallocate(&fd, FallocateFlags::empty(), done, n).map_err(|e| RegionError::NotEnoughMemory {
                need_bytes: layout.region_len,
                avail_bytes: done,
                source_name: format!("fallocate failed: {e}"),
                fix: "ask for a smaller region with --size, or raise the memory limit".into(),
            })?;
            done += n;
            progress(done, layout.region_len);
        }
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(os("sealing the region memfd"))?;
        let map = map_fd(&fd, layout.region_len, true)?;
        let generation = {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 40) ^ (map.as_ptr() as u64)
        };
        let header = RegionHeader {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            header_len: HEADER_LEN as u32,
            generation,
            region_len: layout.region_len,
            channel_offset: layout.channel_offset,
            channel_stride: layout.channel_stride,
            channel_count: layout.channel_count,
            ring_capacity: layout.ring_capacity,
            slab_offset: layout.slab_offset,
            slab_len: layout.slab_len,
            daemon_pid: std::process::id(),
            _reserved: [0; 4],
            doorbell: Doorbell::default(),
        };
        // SAFETY: the mapping is at least HEADER_LEN bytes, page aligned, and no
        // other process has the fd yet, so nothing else accesses it.
        unsafe { std::ptr::write(map.as_mut_ptr().cast::<RegionHeader>(), header) };
        // What was written, padding included (no peer has the fd yet).
        let header_words = read_header_words(&map);
        let region = Arc::new(Region { _fork: None, map, fd, layout, generation, header_words });
        for ch in 0..layout.channel_count {
            region.reset_channel(ch);
        }
        Ok(region)
    }

    /// Maps a region received from the daemon and validates its header and
    /// seals; every page is mapped at once (no page fault on first touch).
    pub fn attach(fd: OwnedFd) -> Result<Arc<Region>, RegionError> {
        Self::attach_with(fd, true)
    }

    /// [`attach`](Self::attach) without mapping the pages in advance: for a
    /// daemon taking over a region (it touches the rings and headers only,
    /// and mapping a multi-GiB megaslab up front would lengthen the pause).
    pub fn attach_lazily(fd: OwnedFd) -> Result<Arc<Region>, RegionError> {
        Self::attach_with(fd, false)
    }

    fn attach_with(fd: OwnedFd, populate: bool) -> Result<Arc<Region>, RegionError> {
        use rustix::fs::{fcntl_get_seals, fstat, SealFlags};
        let seals = fcntl_get_seals(&fd).map_err(os("reading the region's seals"))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(RegionError::NotSealed(seals.bits()));
        }
        let st = fstat(&fd).map_err(os("fstat of the region memfd"))?;
        let fd_len = st.st_size as u64;
        if fd_len < HEADER_LEN {
            return Err(RegionError::BadHeader(format!("memfd is only {fd_len} bytes")));
        }
        // The header page alone first, not pre-faulted: a hostile or broken
        // daemon's fd may be huge (and sparse), and mapping and pre-faulting
        // all of it before the header is checked would allocate that much
        // shared memory, charged to this process.
        let (header, header_words) = {
            let page = memmap2::MmapOptions::new()
                .len(HEADER_LEN as usize)
                .map_raw(fd.as_raw_fd())
                .map_err(|e| RegionError::Os { what: "mmap of the region header", source: e })?;
            let words = read_header_words(&page);
            (header_of(&words), words)
        };
        let layout = Layout::from_header(&header, fd_len)?;
        // Only now the whole region (its size is the checked layout's).
        let map = map_fd(&fd, layout.region_len, populate)?;
        let fork = crate::fork::record(map.as_mut_ptr(), map.len());
        Ok(Arc::new(Region { _fork: Some(fork), map, fd, layout, generation: header.generation, header_words }))
    }

    /// Opens a region by path (`/proc/<pid>/fd/<n>` of another process); for
    /// tests and benchmarks that share a region without a control socket.
    pub fn attach_path(path: &str) -> Result<Arc<Region>, RegionError> {
        use rustix::fs::{open, Mode, OFlags};
        let fd = open(path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()).map_err(os("opening the region path"))?;
        Self::attach(fd)
    }

    /// The memfd (to hand to a client).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `/proc/<pid>/fd/<n>` of this region in this process.
    pub fn proc_path(&self) -> String {
        format!("/proc/{}/fd/{}", std::process::id(), self.fd.as_raw_fd())
    }

    /// The trusted geometry.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The region's generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Base address of the mapping in this process.
    pub fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Writes back the header words before the doorbell that differ from
    /// what this process made them (or checked them to be at attach);
    /// returns how many 8-byte words it wrote (0: the header was intact).
    /// Every peer maps the header writable: a daemon calls this before it
    /// answers a hello and after a takeover failed, so that no client
    /// attaching later reads a geometry or generation a peer wrote. The
    /// doorbell, which clients write, is not touched. A peer writing the
    /// header at the same time can still win a word; the next call restores it.
    pub fn restore_header(&self) -> usize {
        use std::sync::atomic::{AtomicU64, Ordering};
        let base = self.map.as_ptr().cast::<AtomicU64>();
        let mut restored = 0;
        for (i, &want) in self.header_words.iter().enumerate() {
            // SAFETY: the header page is mapped for the life of self and is
            // page aligned, so word i < HEADER_WORDS (16) is in bounds and
            // 8-byte aligned; AtomicU64 is valid for every bit pattern, and
            // every process accesses these words atomically only.
            let word = unsafe { &*base.add(i) };
            // SYNC POINT: Relaxed load and store, paired with the Relaxed
            // loads of `read_header_words` in a client that attaches later:
            // it maps the region after it receives the fd in the answer to
            // its hello, which is sent after this store, and the
            // sendmsg/recvmsg pair orders the two (as it orders the header
            // written at creation). A client attached earlier never reads
            // the header again.
            if word.load(Ordering::Relaxed) != want {
                word.store(want, Ordering::Relaxed);
                restored += 1;
            }
        }
        restored
    }

    /// The daemon's doorbell.
    pub fn doorbell(&self) -> &WaitCell {
        // SAFETY: the header page is mapped for the life of self; the doorbell is
        // an atomic, valid for every bit pattern, and only accessed atomically.
        unsafe { &(*self.map.as_ptr().cast::<RegionHeader>()).doorbell.cell }
    }

    fn ring_base(&self, offset: u64) -> NonNull<u8> {
        debug_assert!(offset + ring_len(self.layout.ring_capacity) as u64 <= self.layout.region_len);
        // SAFETY: offset comes from the trusted layout and lies inside the mapping.
        NonNull::new(unsafe { self.base().add(offset as usize) }).expect("mapping base is non-null")
    }

    fn ring_header(&self, offset: u64) -> &RingHeader {
        // SAFETY: ring headers sit at 64-byte aligned, in-bounds offsets of the
        // trusted layout; RingHeader is atomics only (every bit pattern valid).
        unsafe { self.ring_base(offset).cast::<RingHeader>().as_ref() }
    }

    /// Reinitialises both rings of channel `ch` (daemon only, while no client
    /// uses the channel). Returns false if `ch` is out of range.
    pub fn reset_channel(&self, ch: u32) -> bool {
        let Some((sub, comp)) = self.layout.ring_offsets(ch) else { return false };
        self.ring_header(sub).init(self.layout.ring_capacity);
        self.ring_header(comp).init(self.layout.ring_capacity);
        true
    }

    /// The wait cell a client parks on for channel `ch`'s completions.
    pub fn completion_wait_cell(&self, ch: u32) -> Option<&WaitCell> {
        let (_, comp) = self.layout.ring_offsets(ch)?;
        Some(&self.ring_header(comp).consumer.wait)
    }

    /// Closes both rings of channel `ch`.
    pub fn close_channel(&self, ch: u32) {
        if let Some((sub, comp)) = self.layout.ring_offsets(ch) {
            self.ring_header(sub).close();
            self.ring_header(comp).close();
        }
    }

    /// The daemon's ends of channel `ch`: it consumes submissions and produces
    /// completions.
    pub fn daemon_channel(self: &Arc<Self>, ch: u32) -> Option<(Consumer, Producer)> {
        let (sub, comp) = self.layout.ring_offsets(ch)?;
        let cap = self.layout.ring_capacity;
        // SAFETY: both rings lie inside the mapping (trusted layout), were
        // initialised by `reset_channel`, and the Arc keeps the mapping alive; the
        // daemon is the only consumer of `sub` and only producer of `comp`.
        unsafe {
            Some((
                ring::consumer(self.ring_base(sub), cap, self.clone()),
                ring::producer(self.ring_base(comp), cap, self.clone()),
            ))
        }
    }

    /// A client's ends of channel `ch`: it produces submissions and consumes
    /// completions.
    pub fn client_channel(self: &Arc<Self>, ch: u32) -> Option<(Producer, Consumer)> {
        let (sub, comp) = self.layout.ring_offsets(ch)?;
        let cap = self.layout.ring_capacity;
        // SAFETY: as in `daemon_channel`; the daemon gave this channel to this
        // client alone.
        unsafe {
            Some((
                ring::producer(self.ring_base(sub), cap, self.clone()),
                ring::consumer(self.ring_base(comp), cap, self.clone()),
            ))
        }
    }

    /// A copy of the `len` bytes of megaslab at `offset` (bytes from the
    /// region base), or `None` if that range is not inside the megaslab. A
    /// client may write them meanwhile: the copy is untrusted bytes, for the
    /// caller to check (the daemon reads a META's record this way).
    pub fn copy_from_slab(&self, offset: u64, len: u64) -> Option<Vec<u8>> {
        let ptr = self.slab_ptr(offset, len)?;
        let mut out = vec![0u8; usize::try_from(len).ok()?];
        // SAFETY: `slab_ptr` checked that the range lies inside the mapping,
        // which `self` keeps mapped; bytes have no invalid values, so a
        // concurrent write by a client only changes what is copied.
        unsafe { std::ptr::copy_nonoverlapping(ptr.as_ptr(), out.as_mut_ptr(), out.len()) };
        Some(out)
    }

    /// A pointer to `len` bytes of megaslab at `offset` (bytes from the region
    /// base), or `None` if that range is not inside the megaslab.
    pub fn slab_ptr(&self, offset: u64, len: u64) -> Option<NonNull<u8>> {
        let end = offset.checked_add(len)?;
        if offset < self.layout.slab_offset || end > self.layout.region_len {
            return None;
        }
        // SAFETY: the range lies inside the mapping (checked above).
        NonNull::new(unsafe { self.base().add(offset as usize) })
    }
}

/// The header words before the doorbell, read once as aligned 64-bit
/// atomic loads (the daemon, or any peer, may write the page while we read
/// it: plain reads of it would be a data race). A client validates the copy
/// ([`header_of`], [`Layout::from_header`]) and never re-reads it.
fn read_header_words(page: &memmap2::MmapRaw) -> [u64; HEADER_WORDS] {
    use std::sync::atomic::{AtomicU64, Ordering};
    let mut words = [0u64; HEADER_WORDS];
    let base = page.as_ptr().cast::<AtomicU64>();
    for (i, w) in words.iter_mut().enumerate() {
        // SAFETY: the mapping is at least HEADER_LEN (4096) bytes and page
        // aligned, so word i < 16 is in bounds and 8-byte aligned; AtomicU64 is
        // valid for every bit pattern, and the mapping outlives this loop.
        // SYNC POINT: Relaxed, paired with the daemon's writes of the header
        // (at creation, and `Region::restore_header`'s Relaxed stores), which
        // happen before it hands the fd over: sendmsg/recvmsg order them; no
        // later write is trusted anyway.
        *w = unsafe { (*base.add(i)).load(Ordering::Relaxed) };
    }
    words
}

/// The header fields of `words` (from [`read_header_words`]), unchecked.
fn header_of(words: &[u64; HEADER_WORDS]) -> RegionHeader {
    let mut bytes = [0u8; HEADER_WORDS * 8];
    for (chunk, w) in bytes.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_ne_bytes());
    }
    let u32_at = |off: usize| u32::from_ne_bytes(bytes[off..off + 4].try_into().expect("4 bytes"));
    let u64_at = |off: usize| u64::from_ne_bytes(bytes[off..off + 8].try_into().expect("8 bytes"));
    use core::mem::offset_of;
    RegionHeader {
        magic: bytes[..8].try_into().expect("8 bytes"),
        layout_version: u32_at(offset_of!(RegionHeader, layout_version)),
        header_len: u32_at(offset_of!(RegionHeader, header_len)),
        generation: u64_at(offset_of!(RegionHeader, generation)),
        region_len: u64_at(offset_of!(RegionHeader, region_len)),
        channel_offset: u64_at(offset_of!(RegionHeader, channel_offset)),
        channel_stride: u64_at(offset_of!(RegionHeader, channel_stride)),
        channel_count: u32_at(offset_of!(RegionHeader, channel_count)),
        ring_capacity: u32_at(offset_of!(RegionHeader, ring_capacity)),
        slab_offset: u64_at(offset_of!(RegionHeader, slab_offset)),
        slab_len: u64_at(offset_of!(RegionHeader, slab_len)),
        daemon_pid: u32_at(offset_of!(RegionHeader, daemon_pid)),
        _reserved: [0; 4],
        doorbell: Doorbell::default(),
    }
}

fn map_fd(fd: &OwnedFd, len: u64, populate: bool) -> Result<memmap2::MmapRaw, RegionError> {
    let len =
        usize::try_from(len).map_err(|_| RegionError::BadLayout("region larger than the address space".into()))?;
    let mut opts = memmap2::MmapOptions::new();
    opts.len(len);
    if populate {
        opts.populate();
    }
    opts.map_raw(fd.as_raw_fd()).map_err(|e| RegionError::Os { what: "mmap of the region", source: e })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::descriptor::{Op, TensorBlockDescriptor};

    fn small() -> Arc<Region> {
        let layout = Layout::new(2, 8, 4 << 20).unwrap();
        Region::create(&CreateOptions { name: "kachedb_test".into(), layout, headroom_bytes: 0 }, |_, _| {}).unwrap()
    }

    #[test]
    fn layout_is_aligned() {
        let l = Layout::new(64, 1024, 3 << 30).unwrap();
        assert_eq!(l.slab_offset % SLAB_ALIGN, 0);
        assert_eq!(l.channel_stride % PAGE_LEN, 0);
        let (s, c) = l.ring_offsets(63).unwrap();
        assert!(c > s && c + ring_len(1024) as u64 <= l.slab_offset);
        assert!(l.ring_offsets(64).is_none());
        assert!(Layout::new(4, 1000, 1).is_err());
    }

    #[test]
    fn create_attach_and_talk() {
        let r = small();
        let r2 = Region::attach_path(&r.proc_path()).unwrap();
        assert_eq!(r2.layout(), r.layout());
        assert_eq!(r2.generation(), r.generation());
        let (mut cp, _cc) = r2.client_channel(1).unwrap();
        let (mut dc, _dp) = r.daemon_channel(1).unwrap();
        let f = TensorBlockDescriptor::request(Op::Ping, 42, 7);
        assert!(cp.try_push(&f).unwrap());
        assert_eq!(dc.try_pop().unwrap(), Some(f));
        assert!(r.slab_ptr(r.layout().slab_offset, 4096).is_some());
        assert!(r.slab_ptr(0, 16).is_none());
        assert!(r.slab_ptr(r.layout().region_len - 8, 16).is_none());
        assert!(r.slab_ptr(u64::MAX - 1, 16).is_none());
    }

    /// A peer writes the header's geometry, generation and magic (through its
    /// own mapping) and the doorbell word; `restore_header` writes back the
    /// words the region was made with, leaves the doorbell as the peer set
    /// it, and a later attach sees the region as made. An intact header
    /// restores nothing.
    #[test]
    fn restore_header_writes_back_what_a_peer_changed_and_leaves_the_doorbell() {
        use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
        let r = small();
        assert_eq!(r.restore_header(), 0);
        let peer = Region::attach_path(&r.proc_path()).unwrap();
        let base = peer.base();
        // SAFETY: the header page is mapped (shared) while `peer` lives; the
        // offsets are in it and aligned for their widths; all accesses are atomic.
        let (at32, at64) = unsafe {
            (|off: usize| &*base.add(off).cast::<AtomicU32>(), |off: usize| &*base.add(off).cast::<AtomicU64>())
        };
        use core::mem::offset_of;
        at64(0).store(0, Relaxed);
        at64(offset_of!(RegionHeader, generation)).store(!r.generation(), Relaxed);
        at32(offset_of!(RegionHeader, channel_count)).store(1, Relaxed);
        let bell = offset_of!(RegionHeader, doorbell);
        let rang = at32(bell).load(Relaxed) ^ 0x5a5a;
        at32(bell).store(rang, Relaxed);
        assert!(Region::attach_path(&r.proc_path()).is_err(), "a bad magic attaches");
        assert_eq!(r.restore_header(), 3);
        assert_eq!(at32(bell).load(Relaxed), rang, "the doorbell was written");
        let later = Region::attach_path(&r.proc_path()).unwrap();
        assert_eq!((later.layout(), later.generation()), (r.layout(), r.generation()));
        assert_eq!(r.restore_header(), 0);
        // A region attached (as a daemon taking over does) restores what it checked.
        at32(offset_of!(RegionHeader, ring_capacity)).store(2, Relaxed);
        assert_eq!(later.restore_header(), 1);
        assert_eq!(Region::attach_path(&r.proc_path()).unwrap().layout(), r.layout());
    }

    #[test]
    fn region_is_sealed() {
        let r = small();
        let e = rustix::fs::ftruncate(r.fd(), 4096).unwrap_err();
        assert_eq!(e, rustix::io::Errno::PERM);
        let e = rustix::fs::ftruncate(r.fd(), r.layout().region_len * 2).unwrap_err();
        assert_eq!(e, rustix::io::Errno::PERM);
    }

    #[test]
    fn too_large_is_a_clear_error() {
        let layout = Layout::new(1, 8, 1 << 50).unwrap();
        let e =
            Region::create(&CreateOptions { name: "big".into(), layout, headroom_bytes: 0 }, |_, _| {}).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("--size"), "{msg}");
    }

    #[test]
    fn unsealed_or_foreign_fd_is_refused() {
        let fd = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
        assert!(matches!(Region::attach(fd), Err(RegionError::NotSealed(_))));
        let fd = rustix::fs::memfd_create("y", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
        rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW).unwrap();
        assert!(matches!(Region::attach(fd), Err(RegionError::BadHeader(_))));
    }

    /// Issue 12, item 3: a huge sparse sealed memfd with a bad header is
    /// refused after mapping its header page only: nothing of it is
    /// allocated (before, the whole fd was mapped with MAP_POPULATE first,
    /// which allocated all of it).
    #[test]
    fn oversized_fd_is_refused_before_it_is_mapped_whole() {
        use rustix::fs::{fcntl_add_seals, fstat, ftruncate, memfd_create, MemfdFlags, SealFlags};
        let fd = memfd_create("huge", MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&fd, 1 << 30).unwrap();
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        let keep = fd.try_clone().unwrap();
        let t = std::time::Instant::now();
        assert!(matches!(Region::attach(fd), Err(RegionError::BadHeader(_))));
        assert!(t.elapsed() < std::time::Duration::from_millis(200), "{:?}", t.elapsed());
        // st_blocks: 512-byte units allocated; at most the header page.
        assert!(fstat(&keep).unwrap().st_blocks <= 8, "{} blocks allocated", fstat(&keep).unwrap().st_blocks);
        // A good header whose layout does not match the fd's size is refused too.
        let good = small();
        let fd = memfd_create("huge2", MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&fd, 1 << 30).unwrap();
        let mut head = vec![0u8; HEADER_LEN as usize];
        // SAFETY: the region maps at least HEADER_LEN bytes for the life of `good`.
        unsafe { std::ptr::copy_nonoverlapping(good.base(), head.as_mut_ptr(), head.len()) };
        rustix::io::pwrite(&fd, &head, 0).unwrap();
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        let keep = fd.try_clone().unwrap();
        assert!(matches!(Region::attach(fd), Err(RegionError::BadHeader(m)) if m.contains("memfd has")));
        assert!(fstat(&keep).unwrap().st_blocks <= 8);
        // And a faithful copy attaches.
        let fd = rustix::fs::memfd_create("ok", MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&fd, good.layout().region_len).unwrap();
        rustix::io::pwrite(&fd, &head, 0).unwrap();
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        let r = Region::attach(fd).unwrap();
        assert_eq!(r.generation(), good.generation());
        assert_eq!(r.layout().region_len, good.layout().region_len);
    }
}
