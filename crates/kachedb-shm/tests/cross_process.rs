//! The ring between two real processes over a sealed memfd region.
//!
//! Each test re-runs this test binary as its child (`current_exe() --exact
//! <test> --nocapture` with `KACHEDB_XPROC_CHILD=<test>`); the child attaches
//! the parent's region by its `/proc/<pid>/fd/<n>` path and plays the daemon's
//! side of channel 0 (consumer of the submission ring, producer of the
//! completion ring). The parent plays the client.
//!
//! ```text
//! cargo test -p kachedb-shm --release --test cross_process
//! ```
//!
//! Every frame's fields are derived from its sequence number and the child
//! compares each whole frame; it reports a count and a checksum back over the
//! completion ring, and the parent checks them against its own.
#![cfg(not(loom))]

use kachedb_shm::{
    Completion, Consumer, CreateOptions, DType, Layout, Op, Producer, Region, RingError, SpinThenPark, Status,
    TensorBlockDescriptor, Tick,
};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "KACHEDB_XPROC_CHILD";
const REGION_ENV: &str = "KACHEDB_XPROC_REGION";
/// No single test may take longer than this (a hang is a failure, not a stall).
const DEADLINE: Duration = Duration::from_secs(300);
/// The `request_id` of the child's final report frame.
const REPORT_ID: u32 = 0xC0DE;

/// Tests run one at a time: each pair of processes wants both cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------
// Frames

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Frame number `i`: every field depends on `i`.
fn frame(i: u64) -> TensorBlockDescriptor {
    let mut d = TensorBlockDescriptor::request(Op::Reserve, i as u32, (u128::from(i) << 64) | u128::from(mix(i)));
    d.dtype = DType::F16 as u8;
    d.ndim = 2;
    d.shape = [(i & 0xffff) as u32 + 1, (i >> 16) as u32 + 1, 0, 0, 0, 0];
    d.handle = !i;
    d.offset = (i % 64) * 64;
    d
}

fn fold(sum: u64, f: &TensorBlockDescriptor) -> u64 {
    sum.rotate_left(5) ^ mix(f.key_lo ^ f.handle ^ u64::from(f.request_id))
}

fn checksum(n: u64) -> u64 {
    (0..n).fold(0, |s, i| fold(s, &frame(i)))
}

// ---------------------------------------------------------------------------
// Processes

/// The child process of one test; killed if the test fails first.
struct ChildProc {
    child: Option<Child>,
    started: Instant,
}

impl ChildProc {
    /// Re-runs this binary as the child of `test`, attached to `region`.
    fn spawn(test: &str, region: &Region, env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(std::env::current_exe().expect("path of the test binary"));
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, test)
            .env(REGION_ENV, region.proc_path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self { child: Some(cmd.spawn().expect("spawning the child test process")), started: Instant::now() }
    }

    /// Panics with the child's stderr if it exited, or if the test is past its deadline.
    fn check(&mut self, what: &str) {
        let child = self.child.as_mut().expect("child");
        if let Some(status) = child.try_wait().expect("try_wait") {
            let mut err = String::new();
            let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut err));
            panic!("child exited ({status}) while the parent was {what}; its stderr:\n{err}");
        }
        assert!(self.started.elapsed() < DEADLINE, "timed out after {DEADLINE:?} while {what}");
    }

    /// Waits for the child to exit and asserts it succeeded.
    fn finish(mut self) {
        let mut child = self.child.take().expect("child");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                let mut err = String::new();
                let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut err));
                assert!(status.success(), "child failed ({status}); its stderr:\n{err}");
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("child did not exit within 30 s of finishing");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn create_region(channels: u32, capacity: u32) -> Arc<Region> {
    let layout = Layout::new(channels, capacity, 2 << 20).unwrap();
    Region::create(&CreateOptions { name: "kachedb_xproc_test".into(), layout, headroom_bytes: 0 }, |_, _| {})
        .expect("creating the test region")
}

/// In the child: the region and the daemon's ends of channel 0.
fn child_attach() -> (Arc<Region>, Consumer, Producer) {
    let path = std::env::var(REGION_ENV).expect("region path from the parent");
    let region = Region::attach_path(&path).expect("attaching the parent's region");
    let (sub, comp) = region.daemon_channel(0).expect("channel 0");
    (region, sub, comp)
}

/// `tick` for the child's waits: stop if the parent is gone or time is up.
fn child_tick(parent: u32, started: Instant) -> impl FnMut() -> Tick<String> {
    move || {
        if std::os::unix::process::parent_id() != parent {
            Tick::Stop("the parent process is gone".into())
        } else if started.elapsed() > DEADLINE {
            Tick::Stop(format!("child timed out after {DEADLINE:?}"))
        } else {
            Tick::Continue
        }
    }
}

/// One frame from the child, waiting with `policy`.
fn child_pop(
    c: &mut Consumer,
    policy: &SpinThenPark,
    tick: &mut impl FnMut() -> Tick<String>,
) -> TensorBlockDescriptor {
    c.wait_with(policy, |c| c.try_pop().transpose(), &mut *tick)
        .unwrap_or_else(|e| panic!("child: {e}"))
        .unwrap_or_else(|e: RingError| panic!("child: {e}"))
}

/// Pushes one frame, spinning (then yielding) while the ring is full.
fn push_one(p: &mut Producer, f: &TensorBlockDescriptor, mut check: impl FnMut()) {
    let mut spins = 0u32;
    while !p.try_push(f).expect("push") {
        spins += 1;
        if spins & (1024 - 1) == 0 {
            check();
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The child's report: a completion with `handle` = count, `offset` = checksum.
fn send_report(comp: &mut Producer, count: u64, sum: u64) {
    let report = Completion {
        request_id: REPORT_ID,
        op: Op::Stats,
        status: Status::Ok,
        handle: count,
        offset: sum,
        tensor: None,
    };
    push_one(comp, &report.encode(), || {});
    comp.notify_consumer();
}

/// The parent waits for the child's report.
fn recv_report(c: &mut Consumer, child: &mut ChildProc) -> (u64, u64) {
    let mut spins = 0u32;
    loop {
        if let Some(f) = c.try_pop().expect("pop report") {
            let r = Completion::decode(&f).expect("report frame decodes");
            assert_eq!(r.request_id, REPORT_ID);
            return (r.handle, r.offset);
        }
        spins += 1;
        if spins & (1024 - 1) == 0 {
            child.check("waiting for the child's report");
            std::thread::yield_now();
        }
    }
}

// ---------------------------------------------------------------------------
// Tests

/// 5 M frames, one `try_push` / `try_pop` at a time, capacity 1024.
#[test]
fn five_million_frames_per_message() {
    const TEST: &str = "five_million_frames_per_message";
    const N: u64 = 5_000_000;
    if std::env::var(CHILD_ENV).as_deref() == Ok(TEST) {
        let (_region, mut sub, mut comp) = child_attach();
        let mut tick = child_tick(std::os::unix::process::parent_id(), Instant::now());
        let policy = SpinThenPark::default();
        let mut sum = 0;
        for i in 0..N {
            let f = child_pop(&mut sub, &policy, &mut tick);
            if f != frame(i) {
                panic!("frame {i}: got {f:?}, want {:?}", frame(i));
            }
            sum = fold(sum, &f);
        }
        send_report(&mut comp, N, sum);
        return;
    }
    let _serial = serial();
    let region = create_region(1, 1024);
    let mut child = ChildProc::spawn(TEST, &region, &[]);
    let (mut sub, mut comp) = region.client_channel(0).unwrap();
    for i in 0..N {
        push_one(&mut sub, &frame(i), || child.check("pushing"));
        sub.notify_consumer();
    }
    let (count, sum) = recv_report(&mut comp, &mut child);
    assert_eq!(count, N);
    assert_eq!(sum, checksum(N), "checksum of the frames the child saw");
    child.finish();
}

/// 5 M frames in batches of 1..=300 (some larger than the 256-slot ring, so
/// pushes are partial) against pops of up to 61, capacity 256.
#[test]
fn five_million_frames_batched() {
    const TEST: &str = "five_million_frames_batched";
    const N: u64 = 5_000_000;
    if std::env::var(CHILD_ENV).as_deref() == Ok(TEST) {
        let (_region, mut sub, mut comp) = child_attach();
        let mut tick = child_tick(std::os::unix::process::parent_id(), Instant::now());
        let policy = SpinThenPark::default();
        let mut buf = [TensorBlockDescriptor::default(); 61];
        let (mut next, mut sum) = (0u64, 0u64);
        while next < N {
            let n = sub
                .wait_with(
                    &policy,
                    |c| match c.pop_batch(&mut buf) {
                        Ok(0) => None,
                        r => Some(r),
                    },
                    &mut tick,
                )
                .unwrap_or_else(|e| panic!("child: {e}"))
                .unwrap_or_else(|e| panic!("child: {e}"));
            for f in &buf[..n] {
                if *f != frame(next) {
                    panic!("frame {next}: got {f:?}, want {:?}", frame(next));
                }
                sum = fold(sum, f);
                next += 1;
            }
        }
        send_report(&mut comp, next, sum);
        return;
    }
    let _serial = serial();
    let region = create_region(1, 256);
    let mut child = ChildProc::spawn(TEST, &region, &[]);
    let (mut sub, mut comp) = region.client_channel(0).unwrap();
    let mut batch = Vec::with_capacity(300);
    let (mut i, mut size, mut partial) = (0u64, 1u64, 0u64);
    let mut spins = 0u32;
    while i < N {
        batch.clear();
        batch.extend((i..(i + size).min(N)).map(frame));
        let k = sub.push_batch(&batch).expect("push_batch") as u64;
        if k > 0 {
            sub.notify_consumer();
            partial += u64::from(k < batch.len() as u64);
            i += k;
            size = size % 300 + 1;
        } else {
            spins += 1;
            if spins & (1024 - 1) == 0 {
                child.check("pushing batches");
                std::thread::yield_now();
            }
        }
    }
    let (count, sum) = recv_report(&mut comp, &mut child);
    assert_eq!(count, N);
    assert_eq!(sum, checksum(N));
    assert!(partial > 0, "no batch was ever published in part: the partial path went untested");
    child.finish();
}

/// The consumer parks after one empty poll (long park timeout); the producer
/// waits until it sees the consumer parked, sends a burst, notifies, waits for
/// the burst to be drained, sleeps, and repeats. At least 100 notifies must
/// have found the consumer parked and made the wake syscall, and no burst may
/// wait for the park timeout (a lost wake-up).
#[test]
fn parked_consumer_is_woken_per_burst() {
    const TEST: &str = "parked_consumer_is_woken_per_burst";
    const BURSTS: u64 = 300;
    let burst_len = |b: u64| 1 + b % 7;
    let total: u64 = (0..BURSTS).map(burst_len).sum();
    let park_timeout = Duration::from_secs(10);
    if std::env::var(CHILD_ENV).as_deref() == Ok(TEST) {
        let (_region, mut sub, mut comp) = child_attach();
        let mut tick = child_tick(std::os::unix::process::parent_id(), Instant::now());
        let policy = SpinThenPark { park_timeout, ..SpinThenPark::park_immediately() };
        let mut sum = 0;
        for i in 0..total {
            let f = child_pop(&mut sub, &policy, &mut tick);
            assert_eq!(f, frame(i), "frame {i}");
            sum = fold(sum, &f);
        }
        send_report(&mut comp, total, sum);
        return;
    }
    let _serial = serial();
    let region = create_region(1, 64);
    let mut child = ChildProc::spawn(TEST, &region, &[]);
    let (mut sub, mut comp) = region.client_channel(0).unwrap();
    let (mut next, mut seen_parked, mut woken) = (0u64, 0u64, 0u64);
    let mut slowest = Duration::ZERO;
    for b in 0..BURSTS {
        // Wait until the consumer has announced that it sleeps.
        let mut spins = 0u32;
        while !sub.header().consumer.wait.is_parked() {
            spins += 1;
            if spins & (64 - 1) == 0 {
                child.check("waiting for the consumer to park");
                std::thread::yield_now();
            }
        }
        seen_parked += 1;
        for _ in 0..burst_len(b) {
            push_one(&mut sub, &frame(next), || child.check("pushing a burst"));
            next += 1;
        }
        let t0 = Instant::now();
        woken += u64::from(sub.notify_consumer());
        while !sub.is_drained() {
            assert!(
                t0.elapsed() < park_timeout / 2,
                "burst {b} not consumed within {:?}: lost wake-up",
                park_timeout / 2
            );
            child.check("waiting for a burst to drain");
            std::thread::yield_now();
        }
        slowest = slowest.max(t0.elapsed());
        std::thread::sleep(Duration::from_micros(200 + 37 * (b % 11)));
    }
    let (count, sum) = recv_report(&mut comp, &mut child);
    assert_eq!(count, total);
    assert_eq!(sum, checksum(total));
    assert_eq!(seen_parked, BURSTS);
    assert!(woken >= 100, "only {woken} of {BURSTS} notifies found the consumer parked");
    assert!(slowest < Duration::from_secs(2), "slowest wake-to-drain {slowest:?}");
    eprintln!("parked_consumer_is_woken_per_burst: {woken}/{BURSTS} wake syscalls, slowest wake-to-drain {slowest:?}");
    child.finish();
}

/// Ping-pong over the channel's two rings: 100 k round trips with the child
/// spinning, then 2 k with the child parked before every request.
#[test]
fn ping_pong_over_both_rings() {
    const TEST: &str = "ping_pong_over_both_rings";
    const SPIN: u64 = 100_000;
    const PARKED: u64 = 2_000;
    if std::env::var(CHILD_ENV).as_deref() == Ok(TEST) {
        let (_region, mut sub, mut comp) = child_attach();
        let mut tick = child_tick(std::os::unix::process::parent_id(), Instant::now());
        let spin = SpinThenPark::default();
        let parked = SpinThenPark { park_timeout: Duration::from_secs(10), ..SpinThenPark::park_immediately() };
        for i in 0..SPIN + PARKED {
            let policy = if i < SPIN { &spin } else { &parked };
            let req = child_pop(&mut sub, policy, &mut tick);
            assert_eq!(req, frame(i), "request {i}");
            let reply = Completion {
                request_id: req.request_id,
                op: Op::Get,
                status: Status::Ok,
                handle: req.handle ^ 0xffff,
                offset: req.offset + 4096,
                tensor: Some((DType::F16, kachedb_shm::Shape::new(&[i & 0xfff, 3]).unwrap(), (i & 0xfff) * 6)),
            };
            push_one(&mut comp, &reply.encode(), || {});
            comp.notify_consumer();
        }
        return;
    }
    let _serial = serial();
    let region = create_region(2, 8);
    let mut child = ChildProc::spawn(TEST, &region, &[]);
    let (mut sub, mut comp) = region.client_channel(0).unwrap();
    let mut woken = 0u64;
    let mut rtts = Vec::with_capacity(SPIN as usize);
    for i in 0..SPIN + PARKED {
        if i >= SPIN {
            let mut spins = 0u32;
            while !sub.header().consumer.wait.is_parked() {
                spins += 1;
                if spins & (64 - 1) == 0 {
                    child.check("waiting for the responder to park");
                    std::thread::yield_now();
                }
            }
        }
        let t0 = Instant::now();
        push_one(&mut sub, &frame(i), || child.check("sending a request"));
        let syscall = sub.notify_consumer();
        woken += u64::from(syscall && i >= SPIN);
        let mut spins = 0u32;
        let reply = loop {
            if let Some(f) = comp.try_pop().expect("pop reply") {
                break f;
            }
            spins += 1;
            if spins & (4096 - 1) == 0 {
                child.check("waiting for a reply");
            }
            std::hint::spin_loop();
        };
        if i < SPIN {
            rtts.push(t0.elapsed());
        }
        let c = Completion::decode(&reply).expect("reply decodes");
        assert_eq!(c.request_id, i as u32);
        assert_eq!(c.handle, !i ^ 0xffff);
        assert_eq!(c.offset, frame(i).offset + 4096);
        assert_eq!(c.tensor.map(|t| t.2), Some((i & 0xfff) * 6));
    }
    rtts.sort();
    assert!(woken >= PARKED / 2, "only {woken} of {PARKED} parked requests made a wake syscall");
    eprintln!(
        "ping_pong_over_both_rings: spin RTT p50 {:?} p99 {:?}; {woken}/{PARKED} parked requests woke the responder",
        rtts[rtts.len() / 2],
        rtts[rtts.len() * 99 / 100]
    );
    child.finish();
}
