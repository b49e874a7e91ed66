//! `kachedb-bench events`: what the KV event publisher costs and how fast it
//! tells, against real daemon processes and a real ZMQ subscriber.
//!
//! * **On vs off, same run**: two daemons, one publishing with a live
//!   subscriber and one without a publisher, measured in alternating rounds:
//!   small PUT round trip (a 4 KiB block under a fresh key: reserve, copy,
//!   commit) and GET round trip p50/p99, and `put_many` throughput (five
//!   batches of 1000 back to back); each timed phase starts once the
//!   publisher and the subscriber are done with the phase before
//!   ([`SETTLE`]), so it pays for publishing its own changes only.
//!   `--no-subscriber`: the same with nobody subscribed.
//! * **Rate and lag**: the writer stores blocks at a target rate (default
//!   100 000 blocks/s, paced batches) for a few seconds while the subscriber
//!   notes when each block's `BlockStored` arrives; the lag is the receipt
//!   minus the moment the writer's `put_many` returned (the commit happened
//!   before that, so the true lag is larger by at most the request's round
//!   trip, reported beside it). Blocks never reported and sequence gaps are
//!   counted: both must be 0 for the figures to mean anything.

use crate::spawn::DaemonProcess;
use clap::Args;
use kachedb_client::{Client, ConnectOptions, Key};
use kachedb_daemon::kv_events::wire::{block_hash, decode_batch};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Options of `kachedb-bench events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A short run (fewer rounds and requests, one second of stores).
    #[arg(long)]
    pub quick: bool,
    /// Blocks stored per second in the rate run.
    #[arg(long, default_value_t = 100_000, value_name = "N")]
    pub rate: u64,
    /// Seconds of the rate run.
    #[arg(long, default_value_t = 3.0, value_name = "S")]
    pub seconds: f64,
    /// Alternating on/off rounds.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub rounds: usize,
    /// TCP port of the publisher (the replay port is one above).
    #[arg(long, default_value_t = 5671, value_name = "PORT")]
    pub port: u16,
    /// Nice value of the subscriber's thread: 0, it competes with the client
    /// and the daemon for the cores, as a router on the same small machine
    /// would; 19, it takes only CPU the node leaves idle, as a router on
    /// another machine would (on 2 cores this did not move the on/off
    /// figures: docs/journal.md, 2026-12-05).
    #[arg(long, default_value_t = 0, value_name = "N",
          value_parser = clap::value_parser!(i32).range(0..=19))]
    pub subscriber_nice: i32,
    /// The on/off rounds with no subscriber: what the publisher costs by
    /// itself (encoding and sending to nobody), without a subscriber's
    /// thread beside the client and the daemon on the same cores.
    #[arg(long)]
    pub no_subscriber: bool,
}

const BLOCK_BYTES: usize = 4096;
/// Blocks of one paced `put_many` in the rate run (batches every
/// `BATCH / rate` seconds).
const BATCH: usize = 100;

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A ZMQ subscriber on its own thread: the receipt time of every stored
/// block's hash, the stored events counted and the sequence gaps seen.
struct Subscriber {
    received: Arc<Mutex<HashMap<u64, Instant>>>,
    stored: Arc<AtomicU64>,
    gaps: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Subscriber {
    fn start(endpoint: String, nice: i32) -> Result<Subscriber, Box<dyn std::error::Error>> {
        let received = Arc::new(Mutex::new(HashMap::new()));
        let (stored, gaps, stop) =
            (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (r, s, g, st) = (received.clone(), stored.clone(), gaps.clone(), stop.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || -> Result<(), String> {
            use zeromq::{Socket, SocketRecv, SubSocket};
            // On Linux a nice value is per thread: this one only.
            rustix::process::setpriority_process(None, nice)
                .map_err(|e| format!("setting the subscriber's nice value to {nice}: {e}"))?;
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
            rt.block_on(async {
                let mut sub = SubSocket::new();
                sub.subscribe("").await.map_err(|e| e.to_string())?;
                sub.connect(&endpoint).await.map_err(|e| format!("connecting to {endpoint}: {e}"))?;
                let _ = ready_tx.send(());
                let mut last: Option<u64> = None;
                while !st.load(Ordering::Relaxed) {
                    let msg = match tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
                        Err(_) => continue,
                        Ok(m) => m.map_err(|e| e.to_string())?,
                    };
                    let at = Instant::now();
                    let frames = msg.into_vec();
                    let [_, seq, payload] = frames.as_slice() else { continue };
                    let seq = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes).unwrap_or(0);
                    if last.is_some_and(|l| seq > l + 1) {
                        g.fetch_add(seq - last.unwrap_or(0) - 1, Ordering::Relaxed);
                    }
                    last = Some(seq);
                    let batch = decode_batch(payload)?;
                    let mut map = r.lock().map_err(|_| "poisoned")?;
                    for e in batch.events.iter().filter(|e| e.kind == "BlockStored") {
                        s.fetch_add(e.hashes.len() as u64, Ordering::Relaxed);
                        for h in &e.hashes {
                            map.entry(*h).or_insert(at);
                        }
                    }
                }
                Ok(())
            })
        });
        ready_rx.recv_timeout(Duration::from_secs(10)).map_err(|_| "the subscriber did not connect")?;
        // A ZMQ subscription reaches the publisher after the connect returns.
        std::thread::sleep(Duration::from_millis(300));
        Ok(Subscriber { received, stored, gaps, stop, thread: Some(thread) })
    }

    /// Stops it: the receipt time by block hash, stored events, sequence gaps.
    fn finish(mut self) -> Result<Received, Box<dyn std::error::Error>> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().map_err(|_| "the subscriber thread panicked")??;
        }
        let map = std::mem::take(&mut *self.received.lock().map_err(|_| "poisoned")?);
        Ok(Received { at: map, stored: self.stored.load(Ordering::Relaxed), gaps: self.gaps.load(Ordering::Relaxed) })
    }
}

/// What a [`Subscriber`] saw.
struct Received {
    /// When each stored block's hash first arrived.
    at: HashMap<u64, Instant>,
    /// Hashes in `BlockStored` events.
    stored: u64,
    /// Sequence numbers missed.
    gaps: u64,
}

/// One round's figures against one daemon.
struct Round {
    /// PUT round trips, ns, sorted.
    put_ns: Vec<u64>,
    /// GET round trips, ns, sorted.
    get_ns: Vec<u64>,
    /// Seconds of one put_many of 1000 blocks.
    put_many_s: f64,
}

fn connect(d: &DaemonProcess) -> Result<Client, Box<dyn std::error::Error>> {
    Ok(Client::connect(&ConnectOptions { socket: Some(d.socket().to_path_buf()), ..Default::default() })?)
}

/// The pause before each timed phase of a round (on and off alike): the
/// publisher and the subscriber are done with the phase before (20 000
/// events take them tens of milliseconds on 2 cores), so each phase pays for
/// publishing its own changes only — not the 20 000 removals of the DELETE
/// before it, which a `put_many` of a few milliseconds would otherwise meet.
const SETTLE: Duration = Duration::from_millis(300);
/// `put_many` batches of 1000 timed back to back in a round: a store rate
/// with the publisher's work on the batches before running beside it.
const PUT_MANY_BATCHES: usize = 5;

/// One round against one daemon: PUT and GET round trips, put_many time.
fn round(kc: &Client, tag: &str, iters: usize) -> Result<Round, Box<dyn std::error::Error>> {
    let block = vec![7u8; BLOCK_BYTES];
    let mut put = Vec::with_capacity(iters);
    let keys: Vec<Key> = (0..iters).map(|i| Key::from_bytes(format!("bench/ev/{tag}/{i}").as_bytes())).collect();
    for k in &keys {
        let t = Instant::now();
        kc.put(*k, &block)?;
        put.push(t.elapsed().as_nanos() as u64);
    }
    std::thread::sleep(SETTLE);
    let mut get = Vec::with_capacity(iters);
    for k in &keys {
        let t = Instant::now();
        drop(kc.get(*k)?);
        get.push(t.elapsed().as_nanos() as u64);
    }
    kc.delete_many(&keys)?;
    let many: Vec<Vec<Key>> = (0..PUT_MANY_BATCHES)
        .map(|b| (0..1000).map(|i| Key::from_bytes(format!("bench/ev/{tag}/many/{b}/{i}").as_bytes())).collect())
        .collect();
    let batches: Vec<Vec<(Key, &[u8])>> =
        many.iter().map(|keys| keys.iter().map(|k| (*k, &block[..])).collect()).collect();
    std::thread::sleep(SETTLE);
    let t = Instant::now();
    for items in &batches {
        kc.put_many(items)?;
    }
    // Seconds of one batch of 1000, on average over the batches.
    let put_many_s = t.elapsed().as_secs_f64() / PUT_MANY_BATCHES as f64;
    for keys in &many {
        kc.delete_many(keys)?;
    }
    put.sort_unstable();
    get.sort_unstable();
    Ok(Round { put_ns: put, get_ns: get, put_many_s })
}

/// Runs the benchmark.
pub fn run(a: &EventsArgs) -> Result<(), Box<dyn std::error::Error>> {
    let (rounds, iters, seconds) = if a.quick { (2, 2_000, 1.0) } else { (a.rounds.max(1), 20_000, a.seconds) };
    let endpoint = format!("tcp://127.0.0.1:{}", a.port);
    let emit = |v: serde_json::Value, human: String| {
        if a.json {
            println!("{v}");
        } else {
            println!("{human}");
        }
    };
    if !a.json {
        if a.no_subscriber {
            println!("kachedb-bench events — daemons and client are separate; one daemon at a time, medians of {rounds} alternating rounds; no subscriber in the on/off rounds (--no-subscriber)");
        } else {
            println!("kachedb-bench events — daemons, client and subscriber are separate; one daemon at a time, medians of {rounds} alternating rounds; the subscriber's thread at nice {} (--subscriber-nice)", a.subscriber_nice);
        }
    }

    // On vs off: one daemon alive at a time (an idle daemon's serve loop
    // polls for a while after its last request and would take the other's
    // core on a small machine), a fresh pair each round.
    let size = 1u64 << 30;
    let (mut m_on, mut m_off) = (Vec::new(), Vec::new());
    let (mut seen, mut gaps) = (0u64, 0u64);
    for r in 0..rounds {
        let on = DaemonProcess::spawn(size, &["--events-endpoint", &endpoint])?;
        let sub = if a.no_subscriber { None } else { Some(Subscriber::start(endpoint.clone(), a.subscriber_nice)?) };
        m_on.push(round(&connect(&on)?, &format!("on{r}"), iters)?);
        if let Some(sub) = sub {
            let got = sub.finish()?;
            (seen, gaps) = (seen + got.stored, gaps + got.gaps);
        }
        drop(on);
        let off = DaemonProcess::spawn(size, &[])?;
        m_off.push(round(&connect(&off)?, &format!("off{r}"), iters)?);
        drop(off);
    }
    let summary = |m: &[Round]| {
        let f = |pick: &dyn Fn(&Round) -> f64| median(&mut m.iter().map(pick).collect::<Vec<_>>());
        (
            f(&|x| percentile(&x.put_ns, 0.5) as f64),
            f(&|x| percentile(&x.put_ns, 0.99) as f64),
            f(&|x| percentile(&x.get_ns, 0.5) as f64),
            f(&|x| percentile(&x.get_ns, 0.99) as f64),
            1000.0 / f(&|x| x.put_many_s),
        )
    };
    let (on_p50, on_p99, on_g50, on_g99, on_tput) = summary(&m_on);
    let (off_p50, off_p99, off_g50, off_g99, off_tput) = summary(&m_off);
    emit(
        json!({"bench":"events_on_off","rounds":rounds,"iters":iters,"block_bytes":BLOCK_BYTES,
               "put_p50_ns_on":on_p50,"put_p50_ns_off":off_p50,"put_p99_ns_on":on_p99,"put_p99_ns_off":off_p99,
               "get_p50_ns_on":on_g50,"get_p50_ns_off":off_g50,"get_p99_ns_on":on_g99,"get_p99_ns_off":off_g99,
               "put_many_blocks_per_s_on":on_tput,"put_many_blocks_per_s_off":off_tput,
               "subscriber_stored_events":seen,"subscriber_gaps":gaps}),
        format!(
            "publisher on vs off (4 KiB blocks)\n  PUT p50 {on_p50:>8.0} vs {off_p50:>8.0} ns ({:.3}x)   p99 {on_p99:>8.0} vs {off_p99:>8.0} ns ({:.3}x)\n  GET p50 {on_g50:>8.0} vs {off_g50:>8.0} ns ({:.3}x)   p99 {on_g99:>8.0} vs {off_g99:>8.0} ns ({:.3}x)\n  put_many {:>9.0} vs {:>9.0} blocks/s ({:.3}x)\n  subscriber: {seen} stored events, {gaps} sequence gaps",
            on_p50 / off_p50,
            on_p99 / off_p99,
            on_g50 / off_g50,
            on_g99 / off_g99,
            on_tput,
            off_tput,
            on_tput / off_tput
        ),
    );

    // Rate and lag.
    let blocks = (a.rate as f64 * seconds) as usize;
    let on = DaemonProcess::spawn((blocks * BLOCK_BYTES) as u64 + (256 << 20), &["--events-endpoint", &endpoint])?;
    let sub = Subscriber::start(endpoint.clone(), a.subscriber_nice)?;
    let kc = connect(&on)?;
    let block = vec![3u8; BLOCK_BYTES];
    let keys: Vec<Key> = (0..blocks).map(|i| Key::from_bytes(format!("bench/ev/rate/{i}").as_bytes())).collect();
    let mut returned = Vec::with_capacity(blocks);
    let mut rtt = Vec::with_capacity(blocks / BATCH + 1);
    let period = Duration::from_secs_f64(BATCH as f64 / a.rate.max(1) as f64);
    let t0 = Instant::now();
    for (i, chunk) in keys.chunks(BATCH).enumerate() {
        let due = t0 + period * i as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let items: Vec<(Key, &[u8])> = chunk.iter().map(|k| (*k, &block[..])).collect();
        let t = Instant::now();
        kc.put_many(&items)?;
        let done = Instant::now();
        rtt.push(done.duration_since(t).as_nanos() as u64);
        returned.extend(std::iter::repeat_n(done, chunk.len()));
    }
    let write_s = t0.elapsed().as_secs_f64();
    // Every block's event, or 5 s of quiet.
    let deadline = Instant::now() + Duration::from_secs(5);
    while sub.received.lock().map_err(|_| "poisoned")?.len() < blocks && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let Received { at: received, gaps, .. } = sub.finish()?;
    let mut lag: Vec<u64> = Vec::with_capacity(blocks);
    let mut missing = 0usize;
    let mut last_receipt = t0;
    for (k, done) in keys.iter().zip(&returned) {
        match received.get(&block_hash(u128::from(*k))) {
            Some(at) => {
                lag.push(at.saturating_duration_since(*done).as_nanos() as u64);
                last_receipt = last_receipt.max(*at);
            }
            None => missing += 1,
        }
    }
    lag.sort_unstable();
    rtt.sort_unstable();
    let stored_per_s = blocks as f64 / write_s;
    let published_per_s = lag.len() as f64 / last_receipt.duration_since(t0).as_secs_f64().max(1e-9);
    emit(
        json!({"bench":"events_rate","target_blocks_per_s":a.rate,"blocks":blocks,"block_bytes":BLOCK_BYTES,
               "stored_blocks_per_s":stored_per_s,"received_blocks_per_s":published_per_s,
               "missing":missing,"gaps":gaps,"lag_p50_us":percentile(&lag,0.5) as f64/1e3,
               "lag_p99_us":percentile(&lag,0.99) as f64/1e3,"lag_max_us":lag.last().copied().unwrap_or(0) as f64/1e3,
               "put_many_rtt_p50_us":percentile(&rtt,0.5) as f64/1e3,"batch":BATCH}),
        format!(
            "rate: {blocks} blocks stored at {stored_per_s:.0}/s (target {}), received at {published_per_s:.0}/s; {missing} never reported, {gaps} sequence gaps\n  lag from put_many's return to the subscriber's receipt: p50 {:.0} us, p99 {:.0} us, max {:.0} us (+ up to the put_many round trip, p50 {:.0} us, batches of {BATCH})",
            a.rate,
            percentile(&lag, 0.5) as f64 / 1e3,
            percentile(&lag, 0.99) as f64 / 1e3,
            lag.last().copied().unwrap_or(0) as f64 / 1e3,
            percentile(&rtt, 0.5) as f64 / 1e3,
        ),
    );
    drop(kc);
    drop(on);
    Ok(())
}
