//! The daemon's KV events: every change of the block index (a block stored,
//! removed, everything cleared) published in vLLM's `KVEventBatch` format on
//! a ZMQ PUB socket, with vLLM's replay socket beside it, so a KV-aware
//! router (Dynamo's KV indexer, llm-d, vLLM's production stack) learns what
//! the node holds from the node itself (docs/events.md).
//!
//! Off by default; `kachedb serve --events-endpoint tcp://HOST:PORT` turns it
//! on. Three parts:
//!
//! * the store logs its index's changes in the order it applies them
//!   (`crate::store::IndexChange`, `store/changes.rs`);
//! * the serve loop's [`EventSink`] takes them after each pass and queues
//!   them, never waiting: the queue is bounded ([`EventsConfig::queue_changes`]
//!   changes in flight); a pass whose changes do not fit loses them
//!   (`kachedb_events_dropped_total`) and queues the store's whole index
//!   instead as soon as there is room, so the stream stays exact;
//! * the publisher thread (`publisher.rs`, its own current-thread tokio
//!   runtime, `kachedb-events`) encodes (`wire.rs`), sends, buffers for
//!   replay and answers replay requests.

mod cells;
mod publisher;
pub mod wire;

pub use cells::EventCells;

use crate::store::{IndexChange, Store};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The publisher's settings (`kachedb serve --events-*`).
#[derive(Clone, Debug)]
pub struct EventsConfig {
    /// The PUB socket's endpoint, bound (`tcp://HOST:PORT`, `tcp://*:PORT`
    /// for every interface, `ipc://PATH`).
    pub endpoint: String,
    /// The replay socket's endpoint (ROUTER, bound), if any.
    pub replay_endpoint: Option<String>,
    /// The first frame of every PUB message (subscribers filter on it).
    pub topic: String,
    /// Batches kept for replay.
    pub replay_batches: usize,
    /// Most index changes queued between the serve loop and the publisher.
    pub queue_changes: usize,
    /// How long the publisher waits for a subscriber to take a batch.
    pub send_timeout: Duration,
}

impl EventsConfig {
    /// vLLM's defaults (`KVEventsConfig`: 10 000 batches for replay), for
    /// a PUB socket at `endpoint`.
    pub fn new(endpoint: &str) -> Result<EventsConfig, String> {
        Ok(EventsConfig {
            endpoint: normalize_endpoint(endpoint)?,
            replay_endpoint: None,
            topic: String::new(),
            replay_batches: DEFAULT_REPLAY_BATCHES,
            queue_changes: DEFAULT_QUEUE_CHANGES,
            send_timeout: DEFAULT_SEND_TIMEOUT,
        })
    }

    /// With a replay socket at `endpoint`.
    pub fn with_replay(mut self, endpoint: &str) -> Result<EventsConfig, String> {
        self.replay_endpoint = Some(normalize_endpoint(endpoint)?);
        Ok(self)
    }
}

/// Batches kept for replay by default (vLLM's `buffer_steps`).
pub const DEFAULT_REPLAY_BATCHES: usize = 10_000;
/// Index changes queued for the publisher at most, by default (~56 bytes each).
pub const DEFAULT_QUEUE_CHANGES: usize = 262_144;
/// How long a subscriber may take to accept a batch, by default.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_millis(20);
/// Messages queued for the publisher at most (each a pass's changes).
const QUEUE_MESSAGES: usize = 8192;

/// `endpoint` checked, with vLLM's `tcp://*:PORT` (every interface) as
/// `tcp://0.0.0.0:PORT`; or why it is not one.
pub fn normalize_endpoint(endpoint: &str) -> Result<String, String> {
    let e = match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_owned(),
    };
    match e.parse::<zeromq::Endpoint>() {
        Ok(zeromq::Endpoint::Tcp(_, 0)) => {
            Err(format!("{endpoint}: give a port (routers connect to a known one), e.g. tcp://127.0.0.1:5557"))
        }
        Ok(_) => Ok(e),
        Err(err) => {
            Err(format!("{endpoint} is not a ZMQ endpoint ({err}): use tcp://HOST:PORT, tcp://*:PORT or ipc://PATH"))
        }
    }
}

/// What the serve loop and the tiers queue for the publisher.
pub(crate) enum Msg {
    /// The changes of one pass, in order.
    Changes(Vec<IndexChange>),
    /// The whole index (after a loss, and at start).
    Snapshot(Vec<IndexChange>),
    /// Changes of the disk tier's index (medium `DISK`), in its order.
    Disk(Vec<IndexChange>),
    /// The disk tier's whole index (after a loss, and when it attaches).
    DiskSnapshot(Vec<IndexChange>),
}

/// The disk tier's end of the publisher's queue: its index's changes,
/// sent from the tier's own threads (in the order its index applied them:
/// the sender holds the index's lock), never waiting. Bounded by the same
/// count of changes in flight as the serve loop's; changes that do not fit
/// are lost (`kachedb_events_dropped_total`) and the tier sends its whole
/// index instead, as the serve loop does.
#[derive(Clone)]
pub struct TierSink {
    tx: mpsc::Sender<Msg>,
    in_flight: Arc<AtomicUsize>,
    limit: usize,
    cells: Arc<EventCells>,
}

impl std::fmt::Debug for TierSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierSink").finish_non_exhaustive()
    }
}

impl TierSink {
    /// A sink whose queue holds `limit` changes (and `messages` messages),
    /// with the publisher's end of it and the count in flight.
    #[cfg(test)]
    pub(crate) fn for_tests(limit: usize, messages: usize) -> (TierSink, mpsc::Receiver<Msg>, Arc<AtomicUsize>) {
        let (tx, rx) = mpsc::channel(messages);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let sink = TierSink { tx, in_flight: in_flight.clone(), limit, cells: Arc::new(EventCells::default()) };
        (sink, rx, in_flight)
    }

    /// Queues `changes`; `false` if they did not fit (lost and counted: the
    /// tier owes the publisher its whole index, [`send_all`](Self::send_all)).
    pub fn send(&self, changes: Vec<IndexChange>) -> bool {
        let n = changes.len();
        if n == 0 {
            return true;
        }
        if self.in_flight.load(Relaxed) + n > self.limit {
            self.cells.dropped.fetch_add(n as u64, Relaxed);
            return false;
        }
        self.in_flight.fetch_add(n, Relaxed);
        if self.tx.try_send(Msg::Disk(changes)).is_err() {
            self.in_flight.fetch_sub(n, Relaxed);
            self.cells.dropped.fetch_add(n as u64, Relaxed);
            return false;
        }
        true
    }

    /// Queues the tier's whole index (it replaces what the publisher held
    /// of it); `false` if there is no room yet (try again later).
    pub fn send_all(&self, all: Vec<IndexChange>) -> bool {
        if self.in_flight.load(Relaxed) >= self.limit {
            return false;
        }
        self.in_flight.fetch_add(1, Relaxed);
        if self.tx.try_send(Msg::DiskSnapshot(all)).is_err() {
            self.in_flight.fetch_sub(1, Relaxed);
            return false;
        }
        true
    }

    /// Whether the publisher is gone (the tier stops logging).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// The serve loop's end of the queue.
pub(crate) struct EventSink {
    tx: mpsc::Sender<Msg>,
    /// Changes queued and not yet taken by the publisher (a snapshot counts 1).
    in_flight: Arc<AtomicUsize>,
    limit: usize,
    cells: Arc<EventCells>,
    /// Changes were lost (or nothing was sent yet): the next flush that finds
    /// room sends the whole index.
    snapshot_due: bool,
    scratch: Vec<IndexChange>,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink").field("snapshot_due", &self.snapshot_due).finish_non_exhaustive()
    }
}

impl EventSink {
    /// Queues what the store changed since the last call. Never waits.
    pub(crate) fn flush(&mut self, store: &mut Store) {
        store.take_changes(&mut self.scratch);
        if self.tx.is_closed() {
            // The publisher ended (it could not bind after a takeover).
            self.scratch.clear();
            self.snapshot_due = false;
            store.log_changes(false);
            return;
        }
        if self.snapshot_due {
            // The snapshot holds these changes' outcome.
            self.scratch.clear();
            if self.in_flight.load(Relaxed) >= self.limit || self.tx.capacity() == 0 {
                return;
            }
            let all = store.index_snapshot();
            // One in the count, whatever its size: the changes that follow
            // it queue as usual (counting its blocks would make a snapshot
            // of an index larger than the queue lose them, and bring the
            // next snapshot).
            self.in_flight.fetch_add(1, Relaxed);
            match self.tx.try_send(Msg::Snapshot(all)) {
                Ok(()) => self.snapshot_due = false,
                Err(_) => {
                    self.in_flight.fetch_sub(1, Relaxed);
                }
            }
            return;
        }
        if self.scratch.is_empty() {
            return;
        }
        let n = self.scratch.len();
        if self.in_flight.load(Relaxed) + n > self.limit {
            self.lose(n);
            return;
        }
        self.in_flight.fetch_add(n, Relaxed);
        let batch = std::mem::replace(&mut self.scratch, Vec::with_capacity(64));
        if let Err(e) = self.tx.try_send(Msg::Changes(batch)) {
            self.in_flight.fetch_sub(n, Relaxed);
            if let mpsc::error::TrySendError::Full(Msg::Changes(v))
            | mpsc::error::TrySendError::Closed(Msg::Changes(v)) = e
            {
                self.scratch = v;
            }
            self.lose(n);
        }
    }

    fn lose(&mut self, n: usize) {
        self.scratch.clear();
        self.cells.dropped.fetch_add(n as u64, Relaxed);
        self.snapshot_due = true;
    }

    /// Whether a snapshot waits for room in the queue (the serve loop then
    /// comes back soon even when idle).
    pub(crate) fn snapshot_due(&self) -> bool {
        self.snapshot_due
    }

    /// An end of the queue for a tier's own index (the disk tier's).
    pub(crate) fn tier_sink(&self) -> TierSink {
        TierSink {
            tx: self.tx.clone(),
            in_flight: self.in_flight.clone(),
            limit: self.limit,
            cells: self.cells.clone(),
        }
    }
}

/// Starts the publisher thread for `store` (its change log turned on);
/// returns once its sockets are bound (`retry_bind`: an address in use is
/// retried for a while, as after a takeover, and the thread goes on trying
/// in the background) with the serve loop's end of its queue.
pub(crate) fn start(
    cfg: &EventsConfig,
    store: &mut Store,
    cells: Arc<EventCells>,
    retry_bind: bool,
) -> Result<(EventSink, std::thread::JoinHandle<()>), String> {
    let (tx, rx) = mpsc::channel(QUEUE_MESSAGES);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let thread = {
        let (cfg, cells, in_flight) = (cfg.clone(), cells.clone(), in_flight.clone());
        std::thread::Builder::new()
            .name("kachedb-events".into())
            .spawn(move || publisher::run(cfg, cells, in_flight, rx, retry_bind, bound_tx))
            .map_err(|e| format!("spawning the KV event publisher: {e}"))?
    };
    if !retry_bind {
        match bound_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => return Err("the KV event publisher ended before binding".into()),
        }
    }
    store.log_changes(true);
    let sink =
        EventSink { tx, in_flight, limit: cfg.queue_changes.max(1), cells, snapshot_due: true, scratch: Vec::new() };
    Ok((sink, thread))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::PAGE_LEN;
    use kachedb_shm::{DType, Request, Shape, Status};

    fn put(st: &mut Store, s: crate::store::SessionId, key: u128) {
        let len = 100;
        let r = st.handle(
            s,
            1,
            &Request::Reserve { key, dtype: DType::U8, shape: Shape::for_bytes(len).unwrap(), len, page_offset: 0 },
        );
        assert_eq!(r.status, Status::Ok);
        assert_eq!(st.handle(s, 2, &Request::Commit { handle: r.handle, parent: None }).status, Status::Ok);
    }

    fn sink(limit: usize) -> (EventSink, mpsc::Receiver<Msg>) {
        let (tx, rx) = mpsc::channel(4);
        let cells = Arc::new(EventCells::default());
        let in_flight = Arc::new(AtomicUsize::new(0));
        (EventSink { tx, in_flight, limit, cells, snapshot_due: true, scratch: Vec::new() }, rx)
    }

    /// What the publisher does with a message: takes it off the count.
    fn take(sink: &EventSink, rx: &mut mpsc::Receiver<Msg>) -> Msg {
        let m = rx.try_recv().expect("a message");
        let n = match &m {
            Msg::Changes(c) | Msg::Disk(c) => c.len(),
            Msg::Snapshot(_) | Msg::DiskSnapshot(_) => 1,
        };
        sink.in_flight.fetch_sub(n, Relaxed);
        m
    }

    #[test]
    fn first_a_snapshot_then_changes_and_a_loss_brings_a_snapshot_not_a_wait() {
        let mut st = Store::new(2 << 20, 64 * PAGE_LEN);
        st.log_changes(true);
        let s = st.open_session();
        let (mut sink, mut rx) = sink(2);
        put(&mut st, s, 1);
        sink.flush(&mut st);
        // The first message is the whole index (here: block 1).
        assert!(matches!(take(&sink, &mut rx), Msg::Snapshot(all) if all.len() == 1));
        put(&mut st, s, 2);
        sink.flush(&mut st);
        assert!(matches!(take(&sink, &mut rx), Msg::Changes(c) if c.len() == 1));
        // Three changes do not fit a queue of two: lost, counted, a snapshot due.
        for k in 3..6 {
            put(&mut st, s, k);
        }
        sink.flush(&mut st);
        assert_eq!(sink.cells.dropped.load(Relaxed), 3);
        assert!(sink.snapshot_due() && rx.try_recv().is_err());
        // The next flush with room sends the whole index: 6 blocks.
        put(&mut st, s, 6);
        sink.flush(&mut st);
        let Msg::Snapshot(all) = take(&sink, &mut rx) else { panic!("a snapshot") };
        assert_eq!(all.len(), 6);
        assert!(!sink.snapshot_due());
    }
}
