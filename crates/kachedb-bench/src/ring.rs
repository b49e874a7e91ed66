//! `kachedb-bench ring`: the SPSC ring between two real processes.
//!
//! The parent creates a small sealed region (one channel) and, for every
//! measurement, spawns this executable as `kachedb-bench bench-child --region
//! /proc/<pid>/fd/<n> --mode …`; the child attaches the region by that path.
//! The parent produces into the channel's submission ring, the child consumes;
//! the completion ring carries the child's "ready" and "done (count,
//! checksum)" frames, so the parent times exactly the transfer.
//!
//! Measured, all with 64-byte frames:
//! * throughput of `kachedb_shm`'s ring per message (`try_push` / `try_pop`)
//!   and in batches of 16, 64 and 256 (`push_batch` / `pop_batch`);
//! * the same for a deliberately naive ring over the same memory, which loads
//!   the other side's cursor (Acquire) on every message and never caches it;
//! * `kachedb_shm`'s ring algorithm with plain 64-byte slot copies
//!   (`plaincopy`, per message and batches of 64 and 256), the comparison for
//!   its atomic word copies: the slot copy is the only difference;
//! * ping-pong round trips over the two rings with both sides spinning, and
//!   with the responder parked before every request (it must be woken);
//! * the CPU a consumer burns while it waits on an empty ring with the default
//!   spin-then-park policy.
//!
//! Throughput runs are interleaved (run 1 of every configuration, then run 2…)
//! so that a noisy neighbour hurts every configuration alike; each figure is
//! the median of the runs. Neither side calls `notify` in throughput runs (the
//! consumer spins): they measure the ring, not the wake-up path.

use clap::{Args, ValueEnum};
use kachedb_shm::{
    Completion, Consumer, CreateOptions, Layout, Op, Producer, Region, RingError, SpinThenPark, Status,
    TensorBlockDescriptor, Tick,
};
use std::process::{Child, Command, Stdio};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error>;

/// Options of `kachedb-bench ring`.
#[derive(Debug, Args)]
pub struct RingArgs {
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A short run (a few seconds, for smoke tests): 2 M messages, 3 runs,
    /// 20 k / 2 k round trips, 0.3 s idle.
    #[arg(long)]
    pub quick: bool,
    /// Messages per throughput run.
    #[arg(long, default_value_t = 20_000_000)]
    pub msgs: u64,
    /// Runs per throughput configuration (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Round trips with both sides spinning.
    #[arg(long, default_value_t = 100_000)]
    pub round_trips: u64,
    /// Round trips with the responder parked before each request.
    #[arg(long, default_value_t = 20_000)]
    pub parked_round_trips: u64,
    /// Seconds the consumer waits on an empty ring for the idle CPU figure.
    #[arg(long, default_value_t = 1.5)]
    pub idle_secs: f64,
    /// Ring capacity in slots (power of two).
    #[arg(long, default_value_t = 1024)]
    pub capacity: u32,
    /// Do not pin the two processes to different CPUs.
    #[arg(long)]
    pub no_pin: bool,
}

/// Options of the hidden child process.
#[derive(Debug, Args)]
pub struct ChildArgs {
    /// Path of the shared region (`/proc/<pid>/fd/<n>`).
    #[arg(long)]
    pub region: String,
    /// What the child does.
    #[arg(long, value_enum, default_value_t = ChildMode::Ring)]
    pub mode: ChildMode,
    /// Frames per `pop_batch` (1: `try_pop`).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Messages per run, or round trips.
    #[arg(long, default_value_t = 0)]
    pub msgs: u64,
    /// Runs.
    #[arg(long, default_value_t = 1)]
    pub runs: u32,
    /// CPU to pin this process to.
    #[arg(long)]
    pub cpu: Option<usize>,
}

/// What the child process does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ChildMode {
    /// Consume `msgs` frames `runs` times from the kachedb ring.
    Ring,
    /// Consume `msgs` frames `runs` times from the naive ring.
    Naive,
    /// Consume `msgs` frames `runs` times from the plain-copy ring.
    PlainCopy,
    /// Answer `msgs` requests, spinning between them.
    PingSpin,
    /// Answer `msgs` requests, parking (immediately) between them.
    PingParked,
    /// Wait for one frame with the default policy; report the CPU it took.
    Idle,
}

impl ChildMode {
    fn name(self) -> &'static str {
        match self {
            ChildMode::Ring => "ring",
            ChildMode::Naive => "naive",
            ChildMode::PlainCopy => "plain-copy",
            ChildMode::PingSpin => "ping-spin",
            ChildMode::PingParked => "ping-parked",
            ChildMode::Idle => "idle",
        }
    }
}

/// `request_id` of the child's control frames on the completion ring.
const READY: u32 = 0x5EAD;
const DONE: u32 = 0xD0E;
/// Round trips run before the measured ones.
const WARMUP_ROUND_TRIPS: u64 = 1_000;
/// After the responder announces PARKED, the requester waits this long so the
/// responder is asleep in the kernel, not between its store and the syscall.
const PARK_SETTLE: Duration = Duration::from_micros(30);
/// Empty or full polls between liveness checks of the other process (a power of two).
const CHECK_EVERY: u32 = 1 << 20;

// ---------------------------------------------------------------------------
// Parent

/// Runs the ring benchmark.
pub fn run(args: &RingArgs) -> Result<(), BoxError> {
    let (msgs, runs, round_trips, parked_round_trips, idle_secs) = if args.quick {
        (2_000_000, 3, 20_000, 2_000, 0.3)
    } else {
        (args.msgs, args.runs.max(1), args.round_trips, args.parked_round_trips, args.idle_secs)
    };
    if msgs == 0 || round_trips == 0 || parked_round_trips == 0 {
        return Err("--msgs, --round-trips and --parked-round-trips must be at least 1".into());
    }
    let layout = Layout::new(1, args.capacity, 2 << 20)?;
    let region =
        Region::create(&CreateOptions { name: "kachedb_bench_ring".into(), layout, headroom_bytes: 0 }, |_, _| {})?;
    // Before pinning: afterwards this process may run on one CPU only.
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // Spinning pairs are very sensitive to other load: say how busy the machine was.
    let idle_before = idle_percent(Duration::from_millis(500));
    let pin = if args.no_pin { None } else { pin_plan() };
    if let Some((me, _)) = pin {
        pin_to(me)?;
    }
    let bench = Bench { region, child_cpu: pin.map(|p| p.1) };
    let out = Output { json: args.json };

    out.config(&serde_json::json!({
        "bench": "config",
        "frame_bytes": 64,
        "capacity": args.capacity,
        "msgs_per_run": msgs,
        "runs": runs,
        "pinned": pin.is_some(),
        "parent_cpu": pin.map(|p| p.0),
        "child_cpu": pin.map(|p| p.1),
        "cpus": cpus,
        "machine_idle_percent_before": idle_before.map(round2),
    }));

    // Throughput, interleaved: one run of each configuration per round.
    let configs: [(Impl, usize); 8] = [
        (Impl::Kachedb, 1),
        (Impl::Naive, 1),
        (Impl::Kachedb, 16),
        (Impl::Kachedb, 64),
        (Impl::Kachedb, 256),
        (Impl::PlainCopy, 1),
        (Impl::PlainCopy, 64),
        (Impl::PlainCopy, 256),
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for _ in 0..runs {
        for (k, &(imp, batch)) in configs.iter().enumerate() {
            rates[k].push(bench.throughput(imp, batch, msgs)?);
        }
    }
    let mut medians = Vec::new();
    for (k, &(imp, batch)) in configs.iter().enumerate() {
        let m = median(&rates[k]);
        medians.push(m);
        out.throughput(imp, batch, m, &rates[k], msgs);
    }
    let ratio = medians[0] / medians[1];
    out.ratio(ratio);

    let spin = bench.ping_pong(ChildMode::PingSpin, round_trips)?;
    out.rtt("spin", &spin);
    let parked = bench.ping_pong(ChildMode::PingParked, parked_round_trips)?;
    out.rtt("parked", &parked);

    let (percent, secs) = bench.idle(idle_secs)?;
    out.idle(percent, secs);
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Impl {
    Kachedb,
    Naive,
    PlainCopy,
}

impl Impl {
    fn name(self) -> &'static str {
        match self {
            Impl::Kachedb => "kachedb",
            Impl::Naive => "naive",
            Impl::PlainCopy => "plaincopy",
        }
    }
}

/// Percent of all CPUs' time spent idle over `window` (from `/proc/stat`).
fn idle_percent(window: Duration) -> Option<f64> {
    fn sample() -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let line = stat.lines().next()?.strip_prefix("cpu ")?;
        let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal
        let total: u64 = v.iter().take(8).sum();
        Some((total, v.get(3)? + v.get(4)?))
    }
    let (t0, i0) = sample()?;
    std::thread::sleep(window);
    let (t1, i1) = sample()?;
    (t1 > t0).then(|| 100.0 * (i1 - i0) as f64 / (t1 - t0) as f64)
}

/// The two CPUs to use (parent, child), if this process may run on two.
fn pin_plan() -> Option<(usize, usize)> {
    let set = rustix::thread::sched_getaffinity(None).ok()?;
    let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect();
    (cpus.len() >= 2).then(|| (cpus[0], cpus[1]))
}

fn pin_to(cpu: usize) -> Result<(), BoxError> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).map_err(|e| format!("pinning to CPU {cpu}: {e}"))?;
    Ok(())
}

struct Bench {
    region: Arc<Region>,
    child_cpu: Option<usize>,
}

/// A running child; killed if still running when dropped.
struct ChildProc {
    child: Child,
    deadline: Instant,
}

impl ChildProc {
    /// Fails if the child has exited or the session is past its deadline.
    fn check(&mut self) -> Result<(), BoxError> {
        if let Some(status) = self.child.try_wait()? {
            return Err(format!("the bench child exited early ({status})").into());
        }
        if Instant::now() > self.deadline {
            return Err("the bench child did not finish in time".into());
        }
        Ok(())
    }

    fn finish(mut self) -> Result<(), BoxError> {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("the bench child failed ({status})").into())
                };
            }
            if Instant::now() > until {
                return Err("the bench child did not exit".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Bench {
    /// Resets channel 0, attaches the parent's ends and spawns a child.
    fn session(
        &self,
        mode: ChildMode,
        batch: usize,
        msgs: u64,
        runs: u32,
    ) -> Result<(Producer, Consumer, ChildProc), BoxError> {
        self.region.reset_channel(0);
        let (sub, comp) = self.region.client_channel(0).ok_or("channel 0 missing")?;
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.arg("bench-child")
            .args(["--region", &self.region.proc_path()])
            .args(["--mode", mode.name()])
            .args(["--batch", &batch.to_string()])
            .args(["--msgs", &msgs.to_string()])
            .args(["--runs", &runs.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some(cpu) = self.child_cpu {
            cmd.args(["--cpu", &cpu.to_string()]);
        }
        let child = cmd.spawn().map_err(|e| format!("spawning the bench child: {e}"))?;
        Ok((sub, comp, ChildProc { child, deadline: Instant::now() + Duration::from_secs(300) }))
    }

    /// One throughput run of `msgs` frames; messages per second.
    fn throughput(&self, imp: Impl, batch: usize, msgs: u64) -> Result<f64, BoxError> {
        let mode = match imp {
            Impl::Kachedb => ChildMode::Ring,
            Impl::Naive => ChildMode::Naive,
            Impl::PlainCopy => ChildMode::PlainCopy,
        };
        let (mut sub, mut comp, mut child) = self.session(mode, batch, msgs, 1)?;
        expect_control(&mut comp, &mut child, READY)?;
        let t0 = Instant::now();
        match imp {
            Impl::Kachedb if batch <= 1 => produce(&mut PushEach(&mut sub), 1, msgs, &mut child)?,
            Impl::Kachedb => produce(&mut PushBatch(&mut sub), batch, msgs, &mut child)?,
            Impl::Naive => {
                // SAFETY: channel 0's submission ring lies inside the region
                // (trusted layout) and was just reset; `sub` is not used while
                // the naive producer runs, and the child is its only consumer.
                let mut naive = unsafe { NaiveRing::submission(&self.region)? };
                produce(&mut naive, 1, msgs, &mut child)?;
            }
            Impl::PlainCopy => {
                // SAFETY: as for the naive ring: channel 0's submission ring
                // was just reset, `sub` is unused meanwhile, and the child is
                // the only consumer.
                let mut plain = unsafe { PlainCopyRing::submission(&self.region)? };
                produce(&mut plain, batch, msgs, &mut child)?;
            }
        }
        let done = expect_control(&mut comp, &mut child, DONE)?;
        let elapsed = t0.elapsed();
        if done.handle != msgs || done.offset != expected_sum(msgs) {
            return Err(format!(
                "{} batch {batch}: the child counted {} frames with checksum {:#x}, expected {msgs} and {:#x}",
                imp.name(),
                done.handle,
                done.offset,
                expected_sum(msgs)
            )
            .into());
        }
        child.finish()?;
        Ok(msgs as f64 / elapsed.as_secs_f64())
    }

    /// Round trips: request on the submission ring, reply on the completion
    /// ring. Sorted nanoseconds, plus how many requests found the responder
    /// parked (made the wake syscall).
    fn ping_pong(&self, mode: ChildMode, n: u64) -> Result<RttStats, BoxError> {
        let total = n + WARMUP_ROUND_TRIPS;
        let (mut sub, mut comp, mut child) = self.session(mode, 1, total, 1)?;
        expect_control(&mut comp, &mut child, READY)?;
        let parked = mode == ChildMode::PingParked;
        let mut rtts = Vec::with_capacity(n as usize);
        let mut wakes = 0u64;
        let mut req = frame(0);
        for i in 0..total {
            if parked {
                let mut spins = 0u32;
                while !sub.header().consumer.wait.is_parked() {
                    spins += 1;
                    if spins & 4095 == 0 {
                        child.check()?;
                        std::thread::yield_now();
                    }
                    std::hint::spin_loop();
                }
                let t = Instant::now();
                while t.elapsed() < PARK_SETTLE {
                    std::hint::spin_loop();
                }
            }
            req.offset = i;
            let t0 = Instant::now();
            push_spin(&mut sub, &req, &mut child)?;
            let woke = sub.notify_consumer();
            let reply = pop_spin(&mut comp, &mut child)?;
            let rtt = t0.elapsed();
            if reply.offset != i || reply.request_id != DONE + 1 {
                return Err(format!("round trip {i}: wrong reply {reply:?}").into());
            }
            if i >= WARMUP_ROUND_TRIPS {
                rtts.push(rtt.as_nanos() as u64);
                wakes += u64::from(woke);
            }
        }
        child.finish()?;
        rtts.sort_unstable();
        Ok(RttStats { sorted_ns: rtts, wakes })
    }

    /// CPU used by a consumer waiting `secs` on an empty ring with the
    /// default policy: (percent of one core, seconds measured).
    fn idle(&self, secs: f64) -> Result<(f64, f64), BoxError> {
        let (mut sub, mut comp, mut child) = self.session(ChildMode::Idle, 1, 1, 1)?;
        expect_control(&mut comp, &mut child, READY)?;
        std::thread::sleep(Duration::from_secs_f64(secs));
        push_spin(&mut sub, &frame(0), &mut child)?;
        sub.notify_consumer();
        let done = expect_control(&mut comp, &mut child, DONE)?;
        child.finish()?;
        let (cpu_ns, wall_ns) = (done.handle as f64, done.offset as f64);
        Ok((100.0 * cpu_ns / wall_ns, wall_ns / 1e9))
    }
}

struct RttStats {
    sorted_ns: Vec<u64>,
    wakes: u64,
}

impl RttStats {
    fn pct(&self, p: f64) -> u64 {
        let i = ((self.sorted_ns.len() as f64 - 1.0) * p).round() as usize;
        self.sorted_ns[i]
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Frame `i` of a run: the sequence number is in `offset`.
fn frame(i: u64) -> TensorBlockDescriptor {
    let mut f = TensorBlockDescriptor::request(Op::Lookup, 7, 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
    f.offset = i;
    f
}

/// The child's checksum of a run of `n` frames: the sum of their sequence numbers.
fn expected_sum(n: u64) -> u64 {
    let (a, b) = if n & 1 == 0 { (n / 2, n.wrapping_sub(1)) } else { (n, (n - 1) / 2) };
    a.wrapping_mul(b)
}

/// A ring as the parent's producer loop sees it: pushes what fits of
/// `frames` and says how many.
trait PushFrom {
    fn push_from(&mut self, frames: &[TensorBlockDescriptor]) -> Result<usize, BoxError>;
}

/// The real ring, one `try_push` per frame.
struct PushEach<'a>(&'a mut Producer);

impl PushFrom for PushEach<'_> {
    #[inline(always)]
    fn push_from(&mut self, frames: &[TensorBlockDescriptor]) -> Result<usize, BoxError> {
        Ok(usize::from(self.0.try_push(&frames[0])?))
    }
}

/// The real ring, one `push_batch` per call.
struct PushBatch<'a>(&'a mut Producer);

impl PushFrom for PushBatch<'_> {
    #[inline(always)]
    fn push_from(&mut self, frames: &[TensorBlockDescriptor]) -> Result<usize, BoxError> {
        Ok(self.0.push_batch(frames)?)
    }
}

impl PushFrom for NaiveRing {
    #[inline(always)]
    fn push_from(&mut self, frames: &[TensorBlockDescriptor]) -> Result<usize, BoxError> {
        Ok(usize::from(self.try_push(&frames[0])))
    }
}

impl PushFrom for PlainCopyRing {
    #[inline(always)]
    fn push_from(&mut self, frames: &[TensorBlockDescriptor]) -> Result<usize, BoxError> {
        self.push_batch(frames)
    }
}

/// The parent's producer loop, one per ring kind (monomorphised): frames
/// numbered 0..n, up to `batch` a call; spins while the ring is full,
/// checking the child every [`CHECK_EVERY`] full polls.
#[inline(never)] // a separate symbol per ring kind, so its code can be inspected with objdump
fn produce<R: PushFrom>(r: &mut R, batch: usize, n: u64, child: &mut ChildProc) -> Result<(), BoxError> {
    let batch = batch.max(1);
    let mut buf: Vec<TensorBlockDescriptor> = (0..batch as u64).map(frame).collect();
    let (mut i, mut full) = (0u64, 0u32);
    while i < n {
        let k = (n - i).min(batch as u64) as usize;
        for (j, f) in buf[..k].iter_mut().enumerate() {
            f.offset = i + j as u64;
        }
        let mut sent = 0;
        while sent < k {
            let m = r.push_from(&buf[sent..k])?;
            if m == 0 {
                full = full.wrapping_add(1);
                if full & (CHECK_EVERY - 1) == 0 {
                    child.check()?;
                }
                std::hint::spin_loop();
            }
            sent += m;
        }
        i += k as u64;
    }
    Ok(())
}

fn push_spin(p: &mut Producer, f: &TensorBlockDescriptor, child: &mut ChildProc) -> Result<(), BoxError> {
    let mut full = 0u32;
    while !p.try_push(f)? {
        full = full.wrapping_add(1);
        if full & 4095 == 0 {
            child.check()?;
        }
        std::hint::spin_loop();
    }
    Ok(())
}

fn pop_spin(c: &mut Consumer, child: &mut ChildProc) -> Result<TensorBlockDescriptor, BoxError> {
    let mut empty = 0u32;
    loop {
        if let Some(f) = c.try_pop()? {
            return Ok(f);
        }
        empty = empty.wrapping_add(1);
        if empty & 0xffff == 0 {
            child.check()?;
        }
        std::hint::spin_loop();
    }
}

/// Waits for the child's control frame `id` on the completion ring.
fn expect_control(c: &mut Consumer, child: &mut ChildProc, id: u32) -> Result<TensorBlockDescriptor, BoxError> {
    let mut empty = 0u32;
    loop {
        if let Some(f) = c.try_pop()? {
            if f.request_id != id {
                return Err(format!("expected control frame {id:#x} from the child, got {f:?}").into());
            }
            return Ok(f);
        }
        empty = empty.wrapping_add(1);
        if empty & 1023 == 0 {
            child.check()?;
            std::thread::yield_now();
        }
        std::hint::spin_loop();
    }
}

// ---------------------------------------------------------------------------
// The naive ring

/// The baseline: the same memory and slot layout as a `kachedb_shm` ring
/// (`head` at byte 0, `tail` at byte 64, slots after 192 bytes), but every
/// push loads the consumer's `head` and every pop loads the producer's `tail`
/// (Acquire), and every operation publishes its own cursor: no cached copy of
/// the other side's cursor, no batching. The design the seed's 17.66 M msg/s
/// matches. No validation of the peer either (it is a baseline).
struct NaiveRing {
    head: NonNull<AtomicU64>,
    tail: NonNull<AtomicU64>,
    slots: NonNull<TensorBlockDescriptor>,
    mask: u64,
    /// This side's cursor (head for the consumer, tail for the producer).
    own: u64,
    _region: Arc<Region>,
}

impl NaiveRing {
    /// # Safety
    /// Channel 0's submission ring of `region` was reset and is used by no
    /// other producer (in this process) or consumer (in the peer) than the
    /// naive ones for as long as the result lives.
    unsafe fn submission(region: &Arc<Region>) -> Result<Self, BoxError> {
        let layout = region.layout();
        let (offset, _) = layout.ring_offsets(0).ok_or("channel 0 missing")?;
        let base = region.base();
        // SAFETY: `offset` comes from the trusted layout: the ring header (192
        // bytes, 64-byte aligned) and `ring_capacity` slots lie inside the
        // mapping, which the Arc kept in the result keeps alive. Offsets 0 and
        // 64 of a ring header are its `head` and `tail` cursors, 8-byte aligned
        // u64s only ever accessed atomically.
        unsafe {
            let ring = base.add(offset as usize);
            Ok(Self {
                head: NonNull::new(ring.cast::<AtomicU64>()).ok_or("null region base")?,
                tail: NonNull::new(ring.add(64).cast::<AtomicU64>()).ok_or("null region base")?,
                slots: NonNull::new(ring.add(kachedb_shm::ring::RING_HEADER_LEN).cast()).ok_or("null region base")?,
                mask: u64::from(layout.ring_capacity) - 1,
                own: 0,
                _region: region.clone(),
            })
        }
    }

    fn head(&self) -> &AtomicU64 {
        // SAFETY: see `submission`: valid and atomic for the life of `_region`.
        unsafe { self.head.as_ref() }
    }

    fn tail(&self) -> &AtomicU64 {
        // SAFETY: see `submission`.
        unsafe { self.tail.as_ref() }
    }

    #[inline]
    fn try_push(&mut self, f: &TensorBlockDescriptor) -> bool {
        // SYNC POINT: Acquire pairs with the consumer's Release store of head.
        let head = self.head().load(Ordering::Acquire);
        if self.own.wrapping_sub(head) > self.mask {
            return false;
        }
        // SAFETY: slot `own` is free (own - head < capacity) and in bounds
        // (masked); the consumer will not read it until tail passes it.
        unsafe { self.slots.as_ptr().add((self.own & self.mask) as usize).write_volatile(*f) };
        self.own = self.own.wrapping_add(1);
        // SYNC POINT: Release pairs with the consumer's Acquire load of tail.
        self.tail().store(self.own, Ordering::Release);
        true
    }

    #[inline]
    fn try_pop(&mut self) -> Option<TensorBlockDescriptor> {
        // SYNC POINT: Acquire pairs with the producer's Release store of tail.
        let tail = self.tail().load(Ordering::Acquire);
        if tail == self.own {
            return None;
        }
        // SAFETY: slot `own` was published (own < tail) and is in bounds
        // (masked); the producer will not rewrite it until head passes it.
        let f = unsafe { self.slots.as_ptr().add((self.own & self.mask) as usize).read_volatile() };
        self.own = self.own.wrapping_add(1);
        // SYNC POINT: Release pairs with the producer's Acquire load of head.
        self.head().store(self.own, Ordering::Release);
        Some(f)
    }
}

// ---------------------------------------------------------------------------
// The plain-copy ring

/// `kachedb_shm`'s ring algorithm (cached peer cursor refreshed only when the
/// ring looks full or empty, one cursor publish per batch, peer cursors
/// checked) over the same memory, with the slots copied by plain 64-byte
/// `ptr::write` / `ptr::read`: the comparison for `kachedb_shm`'s atomic
/// word copies, which are defined even when a peer writes a slot
/// concurrently. Benchmark only: a plain copy racing a peer's write is
/// undefined behaviour.
struct PlainCopyRing {
    inner: NaiveRing,
    /// The other side's cursor as last read.
    cached_peer: u64,
}

impl PlainCopyRing {
    /// # Safety
    /// As for [`NaiveRing::submission`].
    unsafe fn submission(region: &Arc<Region>) -> Result<Self, BoxError> {
        // SAFETY: forwarded contract.
        Ok(Self { inner: unsafe { NaiveRing::submission(region)? }, cached_peer: 0 })
    }

    fn corrupt(own: u64, peer: u64) -> BoxError {
        format!("plain-copy ring: peer cursor {peer} out of range of {own}").into()
    }

    #[inline]
    fn push_batch(&mut self, frames: &[TensorBlockDescriptor]) -> Result<usize, BoxError> {
        let r = &mut self.inner;
        let cap = r.mask + 1;
        let mut free = cap - r.own.wrapping_sub(self.cached_peer);
        if free < frames.len() as u64 {
            // SYNC POINT: Acquire pairs with the consumer's Release store of head.
            let head = r.head().load(Ordering::Acquire);
            if r.own.wrapping_sub(head) > cap {
                return Err(Self::corrupt(r.own, head));
            }
            self.cached_peer = head;
            free = cap - r.own.wrapping_sub(head);
        }
        let n = frames.len().min(free as usize);
        for (i, f) in frames[..n].iter().enumerate() {
            let slot = (r.own.wrapping_add(i as u64) & r.mask) as usize;
            // SAFETY: slots [own, head + capacity) are the producer's and in
            // bounds (masked); the consumer reads none of them until tail passes.
            unsafe { r.slots.as_ptr().add(slot).write(*f) };
        }
        r.own = r.own.wrapping_add(n as u64);
        // SYNC POINT: Release pairs with the consumer's Acquire load of tail.
        r.tail().store(r.own, Ordering::Release);
        Ok(n)
    }

    #[inline]
    fn pop_batch(&mut self, out: &mut [TensorBlockDescriptor]) -> Result<usize, BoxError> {
        let r = &mut self.inner;
        let mut avail = self.cached_peer.wrapping_sub(r.own);
        if avail < out.len() as u64 {
            // SYNC POINT: Acquire pairs with the producer's Release store of tail.
            let tail = r.tail().load(Ordering::Acquire);
            if tail.wrapping_sub(r.own) > r.mask + 1 {
                return Err(Self::corrupt(r.own, tail));
            }
            self.cached_peer = tail;
            avail = tail.wrapping_sub(r.own);
        }
        let n = out.len().min(avail as usize);
        for (i, o) in out[..n].iter_mut().enumerate() {
            let slot = (r.own.wrapping_add(i as u64) & r.mask) as usize;
            // SAFETY: slots [head, tail) are the consumer's and in bounds
            // (masked); the producer rewrites none of them until head passes.
            *o = unsafe { r.slots.as_ptr().add(slot).read() };
        }
        if n > 0 {
            r.own = r.own.wrapping_add(n as u64);
            // SYNC POINT: Release pairs with the producer's Acquire load of head.
            r.head().store(r.own, Ordering::Release);
        }
        Ok(n)
    }
}

// ---------------------------------------------------------------------------
// Child

/// Runs the child side.
pub fn child(args: &ChildArgs) -> Result<(), BoxError> {
    if let Some(cpu) = args.cpu {
        pin_to(cpu)?;
    }
    let region = Region::attach_path(&args.region)?;
    let (mut sub, mut comp) = region.daemon_channel(0).ok_or("channel 0 missing")?;
    let parent = std::os::unix::process::parent_id();
    let alive = move || -> Result<(), BoxError> {
        if std::os::unix::process::parent_id() != parent {
            return Err("the bench parent is gone".into());
        }
        Ok(())
    };
    match args.mode {
        ChildMode::Ring | ChildMode::Naive | ChildMode::PlainCopy => {
            for _ in 0..args.runs.max(1) {
                control(&mut comp, READY, 0, 0)?;
                let sum = match args.mode {
                    ChildMode::Naive => {
                        // SAFETY: the parent reset channel 0 before spawning us and
                        // runs the naive producer; we are the only consumer.
                        let mut naive = unsafe { NaiveRing::submission(&region)? };
                        consume(&mut naive, 1, args.msgs, &alive)?
                    }
                    ChildMode::PlainCopy => {
                        // SAFETY: as for the naive ring.
                        let mut plain = unsafe { PlainCopyRing::submission(&region)? };
                        consume(&mut plain, args.batch, args.msgs, &alive)?
                    }
                    _ if args.batch <= 1 => consume(&mut PerMessage(&mut sub), 1, args.msgs, &alive)?,
                    _ => consume(&mut Batched(&mut sub), args.batch, args.msgs, &alive)?,
                };
                control(&mut comp, DONE, args.msgs, sum)?;
            }
        }
        ChildMode::PingSpin | ChildMode::PingParked => {
            control(&mut comp, READY, 0, 0)?;
            let policy = if args.mode == ChildMode::PingSpin {
                // Pure spinning between requests (the parent sends the next one
                // within a microsecond); a park after 1 s idle only so that the
                // child notices a vanished parent.
                SpinThenPark {
                    spin: Duration::from_secs(1),
                    park_after: Duration::from_secs(1),
                    park_timeout: Duration::from_millis(100),
                    wake_window: Duration::ZERO,
                }
            } else {
                SpinThenPark { park_timeout: Duration::from_millis(100), ..SpinThenPark::park_immediately() }
            };
            let mut reply = frame(0);
            reply.request_id = DONE + 1;
            reply.status = Status::Ok as u8;
            for _ in 0..args.msgs {
                let req = wait_pop(&mut sub, &policy, &alive)?;
                reply.offset = req.offset;
                while !comp.try_push(&reply)? {
                    std::hint::spin_loop();
                }
                comp.notify_consumer();
            }
        }
        ChildMode::Idle => {
            control(&mut comp, READY, 0, 0)?;
            let cpu0 = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
            let t0 = Instant::now();
            wait_pop(&mut sub, &SpinThenPark::default(), &alive)?;
            let cpu1 = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
            let wall = t0.elapsed().as_nanos() as u64;
            let ns = |t: rustix::time::Timespec| t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64;
            control(&mut comp, DONE, ns(cpu1).saturating_sub(ns(cpu0)), wall)?;
        }
    }
    Ok(())
}

/// Sends a control frame to the parent: `handle` and `offset` carry results.
fn control(comp: &mut Producer, id: u32, handle: u64, offset: u64) -> Result<(), BoxError> {
    let c = Completion { request_id: id, op: Op::Stats, status: Status::Ok, handle, offset, tensor: None };
    while !comp.try_push(&c.encode())? {
        std::hint::spin_loop();
    }
    comp.notify_consumer();
    Ok(())
}

/// One frame, waiting with `policy`; after each park, checks the parent.
fn wait_pop(
    c: &mut Consumer,
    policy: &SpinThenPark,
    alive: &impl Fn() -> Result<(), BoxError>,
) -> Result<TensorBlockDescriptor, BoxError> {
    let got = c.wait_with(
        policy,
        |c| c.try_pop().transpose(),
        || match alive() {
            Ok(()) => Tick::Continue,
            Err(e) => Tick::Stop(e),
        },
    )?;
    got.map_err(|e: RingError| Box::new(e) as BoxError)
}

fn out_of_order(i: u64, got: u64) -> BoxError {
    format!("frame {i} arrived with sequence number {got}").into()
}

/// A ring as the child's consumer loop sees it: pops what is there, up to
/// `buf.len()` frames, into `buf`; 0 when it is empty.
trait PopInto {
    fn pop_into(&mut self, buf: &mut [TensorBlockDescriptor]) -> Result<usize, BoxError>;
}

/// The real ring, one `try_pop` per frame.
struct PerMessage<'a>(&'a mut Consumer);

impl PopInto for PerMessage<'_> {
    #[inline(always)]
    fn pop_into(&mut self, buf: &mut [TensorBlockDescriptor]) -> Result<usize, BoxError> {
        Ok(match self.0.try_pop()? {
            Some(f) => {
                buf[0] = f;
                1
            }
            None => 0,
        })
    }
}

/// The real ring, one `pop_batch` per call.
struct Batched<'a>(&'a mut Consumer);

impl PopInto for Batched<'_> {
    #[inline(always)]
    fn pop_into(&mut self, buf: &mut [TensorBlockDescriptor]) -> Result<usize, BoxError> {
        Ok(self.0.pop_batch(buf)?)
    }
}

impl PopInto for NaiveRing {
    #[inline(always)]
    fn pop_into(&mut self, buf: &mut [TensorBlockDescriptor]) -> Result<usize, BoxError> {
        Ok(match self.try_pop() {
            Some(f) => {
                buf[0] = f;
                1
            }
            None => 0,
        })
    }
}

impl PopInto for PlainCopyRing {
    #[inline(always)]
    fn pop_into(&mut self, buf: &mut [TensorBlockDescriptor]) -> Result<usize, BoxError> {
        self.pop_batch(buf)
    }
}

/// The child's consumer loop, one per ring kind (monomorphised): pops `n`
/// frames (up to `batch` a call), checks their sequence numbers and returns
/// their sum; spins while the ring is empty, checking the parent every
/// [`CHECK_EVERY`] empty polls.
#[inline(never)] // a separate symbol per ring kind, so its code can be inspected with objdump
fn consume<R: PopInto>(
    r: &mut R,
    batch: usize,
    n: u64,
    alive: &impl Fn() -> Result<(), BoxError>,
) -> Result<u64, BoxError> {
    let mut buf = vec![TensorBlockDescriptor::default(); batch.max(1)];
    let (mut i, mut sum, mut empty) = (0u64, 0u64, 0u32);
    while i < n {
        let k = r.pop_into(&mut buf)?;
        if k == 0 {
            empty = empty.wrapping_add(1);
            if empty & (CHECK_EVERY - 1) == 0 {
                alive()?;
            }
            std::hint::spin_loop();
            continue;
        }
        for f in &buf[..k] {
            if f.offset != i {
                return Err(out_of_order(i, f.offset));
            }
            sum = sum.wrapping_add(f.offset);
            i += 1;
        }
    }
    Ok(sum)
}

// ---------------------------------------------------------------------------
// Output

struct Output {
    json: bool,
}

impl Output {
    fn config(&self, v: &serde_json::Value) {
        if self.json {
            println!("{v}");
        } else {
            let pin = if v["pinned"] == true {
                format!(
                    "pinned to CPUs {} (parent, producer) and {} (child, consumer)",
                    v["parent_cpu"], v["child_cpu"]
                )
            } else {
                "not pinned".to_string()
            };
            println!(
                "kachedb-bench ring: 64-byte frames across two processes, ring capacity {} slots, {pin}",
                v["capacity"]
            );
            if let Some(idle) = v["machine_idle_percent_before"].as_f64() {
                let warn = if idle < 90.0 { " (other load: expect low and noisy figures)" } else { "" };
                println!("machine idle before the run: {idle:.0} %{warn}");
            }
            println!("throughput: median of {} interleaved runs of {} messages each", v["runs"], v["msgs_per_run"]);
            println!();
            println!("{:<9} {:>6} {:>12} {:>9}   runs (M msg/s)", "impl", "batch", "M msg/s", "ns/msg");
        }
    }

    fn throughput(&self, imp: Impl, batch: usize, msgs_per_s: f64, runs: &[f64], msgs: u64) {
        if self.json {
            println!(
                "{}",
                serde_json::json!({
                    "bench": "ring",
                    "impl": imp.name(),
                    "batch": batch,
                    "msgs_per_s": msgs_per_s.round(),
                    "ns_per_msg": round2(1e9 / msgs_per_s),
                    "best_msgs_per_s": runs.iter().cloned().fold(0.0, f64::max).round(),
                    "runs_msgs_per_s": runs.iter().map(|r| r.round()).collect::<Vec<_>>(),
                    "msgs_per_run": msgs,
                })
            );
        } else {
            let list: Vec<String> = runs.iter().map(|r| format!("{:.1}", r / 1e6)).collect();
            println!(
                "{:<9} {:>6} {:>12.1} {:>9.2}   {}",
                imp.name(),
                batch,
                msgs_per_s / 1e6,
                1e9 / msgs_per_s,
                list.join(" ")
            );
        }
    }

    fn ratio(&self, ratio: f64) {
        if self.json {
            println!(
                "{}",
                serde_json::json!({"bench": "ratio", "what": "kachedb batch 1 / naive batch 1", "ratio": round2(ratio)})
            );
        } else {
            println!();
            println!("kachedb per message / naive per message: {ratio:.2}x");
        }
    }

    fn rtt(&self, mode: &str, s: &RttStats) {
        let (p50, p99, p999) = (s.pct(0.50), s.pct(0.99), s.pct(0.999));
        if self.json {
            println!(
                "{}",
                serde_json::json!({
                    "bench": "rtt",
                    "mode": mode,
                    "p50_ns": p50,
                    "p99_ns": p99,
                    "p999_ns": p999,
                    "min_ns": s.sorted_ns[0],
                    "round_trips": s.sorted_ns.len(),
                    "wake_syscalls": s.wakes,
                })
            );
        } else {
            let what = if mode == "spin" {
                "both sides spinning".to_string()
            } else {
                format!("responder parked before each request, {} wake syscalls", s.wakes)
            };
            println!(
                "round trip, {what} ({} trips): p50 {} p99 {} p99.9 {}",
                s.sorted_ns.len(),
                fmt_ns(p50),
                fmt_ns(p99),
                fmt_ns(p999)
            );
        }
    }

    fn idle(&self, percent: f64, secs: f64) {
        if self.json {
            println!(
                "{}",
                serde_json::json!({"bench": "idle_cpu", "percent": round2(percent), "secs": round2(secs), "policy": "default"})
            );
        } else {
            println!(
                "idle consumer CPU: {percent:.2} % of one core over {secs:.2} s waiting on an empty ring (default policy: spin 20 µs, yield to 100 µs, then park)"
            );
        }
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn fmt_ns(ns: u64) -> String {
    if ns < 10_000 {
        format!("{ns} ns")
    } else {
        format!("{:.1} µs", ns as f64 / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_the_sum_of_sequence_numbers() {
        for n in [0u64, 1, 2, 3, 10, 1_000_001] {
            assert_eq!(expected_sum(n), (0..n).fold(0u64, |s, i| s.wrapping_add(i)));
        }
    }

    #[test]
    fn median_and_percentiles() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let s = RttStats { sorted_ns: (1..=100).collect(), wakes: 0 };
        assert_eq!(s.pct(0.5), 51);
        assert_eq!(s.pct(0.99), 99);
    }
}
