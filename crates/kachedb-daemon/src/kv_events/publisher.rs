//! The publisher thread: turns the index's changes into vLLM `KVEventBatch`es
//! (`wire.rs`) and sends them on a ZMQ PUB socket, keeps the last batches for
//! the replay socket, and keeps its own copy of the index for snapshots.
//!
//! # Frames (vLLM's `ZmqEventPublisher`)
//!
//! * PUB: each batch is a three-frame message `[topic, seq, payload]`: the
//!   topic (`--events-topic`, empty by default), the sequence number as 8
//!   bytes big-endian, the msgpack batch. Sequence numbers go up by one per
//!   batch, with no gap, from the publisher's start time in microseconds
//!   since the epoch: a daemon that takes over, or starts again, goes on
//!   above the numbers of the one before (unless the clock went back), so a
//!   subscriber sees a gap and asks for a replay, which is a snapshot.
//! * Replay (ROUTER): a request is `[empty, start]` from a REQ or DEALER
//!   socket (`start` 8 bytes big-endian); the answer is one
//!   `[empty, seq, payload]` message per buffered batch from `start` on, then
//!   the end marker `[empty, -1 as 8 bytes, empty]`. When `start` is older
//!   than the oldest buffered batch (a late joiner asks from 0, or a
//!   subscriber fell behind further than the buffer), the answer is a
//!   **snapshot** instead: batches that begin with `AllBlocksCleared` and store
//!   every block of the index as of the last batch published, each with that
//!   batch's sequence number `S`, then the end marker; the subscriber goes on
//!   with the stream from `S + 1`. (vLLM answers such a request with what it
//!   still has, leaving the subscriber's view incomplete.)
//!
//! # Gathering
//!
//! The first message that wakes the thread starts a [`GATHER`] interval;
//! at its end the thread takes everything queued and publishes it. While
//! changes come, the thread wakes once per interval, not once per serve-loop
//! pass, and the serve loop's sends wake nobody (the queue is not awaited
//! meanwhile): on a node whose cores the serve loop and its clients keep
//! busy, the publisher takes a time slice a millisecond rather than one per
//! request. A replay request answered meanwhile publishes what was taken
//! first.
//!
//! # Its copy of the index
//!
//! The thread applies every change it publishes to a map hash -> parent, so
//! the map is the index as of the last batch sent: what a snapshot sends. A
//! change the serve loop could not queue (queue full) never reaches it; the
//! serve loop then sends the store's whole index as one message, which
//! replaces the map and goes out on the stream as `AllBlocksCleared` and a
//! `BlockStored` per block: every subscriber's view is whole again.
//!
//! # A subscriber that does not read
//!
//! The PUB socket (the `zeromq` crate) writes a batch to each subscriber in
//! turn and waits for room in its connection: a batch not taken within
//! `send_timeout` is given up (`kachedb_events_send_timeouts_total`), for
//! that subscriber and the ones after it in this send, who see a gap in the
//! sequence and ask the replay socket. A subscriber sees a gap only when a
//! later batch comes: so when the stream goes quiet after such a batch, an
//! empty batch follows ([`GAP_NOTICE_AFTER`]). While a subscriber stalls,
//! each batch costs up to `send_timeout` and batches grow (the thread takes
//! all the queued changes at once); the serve loop never waits.

use super::cells::EventCells;
use super::wire::{block_hash, encode_batch, KvEvent, MEDIUM_CPU, MEDIUM_DISK};
use super::{EventsConfig, Msg};
use crate::store::IndexChange;
use bytes::Bytes;
use kachedb_shm::BlockMeta;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

/// Most events in one batch (a snapshot of a large index is many batches).
const EVENTS_PER_BATCH: usize = 4096;
/// Most queued messages the thread takes before it publishes.
const MESSAGES_PER_ROUND: usize = 4096;
/// How long the thread lets changes gather after the first that wakes it,
/// before it takes the queue's messages and publishes them: at most one wake
/// of this thread (and one batch on the wire, the stream busy) per interval,
/// not one per serve-loop pass, and the serve loop's sends meanwhile wake
/// nobody. It adds up to this much to the lag.
const GATHER: Duration = Duration::from_millis(1);
/// How long a bind of an address in use is retried after a takeover (the
/// old daemon holds it until it exits).
const BIND_RETRY: Duration = Duration::from_secs(15);

/// How long after a batch that a subscriber did not take in time (and no
/// batch since) an empty batch follows: it lets that subscriber see the gap
/// even when the stream goes quiet (it sees a gap only when a later batch
/// comes).
const GAP_NOTICE_AFTER: Duration = Duration::from_millis(100);

/// The end marker of a replay answer: -1 as 8 bytes big-endian.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// A block as the stream told it.
struct Entry {
    /// Its published hash: the engine's (META), else the key's low 64 bits.
    hash: u64,
    /// The key of the block it is chained under in the store, if any.
    parent_key: Option<u128>,
    /// Its published parent hash.
    parent_hash: Option<u64>,
    /// What its writer told of it.
    meta: Option<Arc<BlockMeta>>,
}

/// The thread's state.
struct State {
    cfg: EventsConfig,
    cells: Arc<EventCells>,
    /// Changes queued by the serve loop and not yet taken.
    in_flight: Arc<AtomicUsize>,
    topic: Bytes,
    /// The next batch's sequence number.
    next_seq: u64,
    /// The last batches sent, oldest first, at most `cfg.replay_batches`.
    buffer: VecDeque<(u64, Bytes)>,
    /// The index as of the last batch sent: key -> what was published of it.
    index: HashMap<u128, Entry>,
    /// The same of the disk tier's index (medium `DISK`).
    disk: HashMap<u128, Entry>,
    /// Events taken, not yet sent.
    pending: Vec<KvEvent>,
    /// The last batch sent was not taken by every subscriber in time: an
    /// empty batch follows when the stream stays quiet ([`GAP_NOTICE_AFTER`]).
    gap_notice_due: bool,
}

/// Which copy of the index a change or an entry is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Medium {
    /// The megaslab's (the store's index).
    Ram,
    /// The disk tier's.
    Disk,
}

impl Medium {
    fn name(self) -> &'static str {
        match self {
            Medium::Ram => MEDIUM_CPU,
            Medium::Disk => MEDIUM_DISK,
        }
    }
}

impl State {
    fn map(&mut self, medium: Medium) -> &mut HashMap<u128, Entry> {
        match medium {
            Medium::Ram => &mut self.index,
            Medium::Disk => &mut self.disk,
        }
    }

    /// The hash block `key` was published under, on `medium` or else on the
    /// other; its own if neither has it.
    fn published_hash(&self, medium: Medium, key: u128) -> u64 {
        let (this, other) = match medium {
            Medium::Ram => (&self.index, &self.disk),
            Medium::Disk => (&self.disk, &self.index),
        };
        this.get(&key).or_else(|| other.get(&key)).map_or(block_hash(key), |e| e.hash)
    }

    fn take(&mut self, msg: Msg) {
        match msg {
            Msg::Changes(changes) => {
                self.in_flight.fetch_sub(changes.len(), Relaxed);
                for c in changes {
                    self.apply(Medium::Ram, c);
                }
            }
            Msg::Snapshot(all) => {
                self.in_flight.fetch_sub(1, Relaxed);
                self.index.clear();
                self.pending.push(KvEvent::Cleared);
                for c in all {
                    self.apply(Medium::Ram, c);
                }
                // `AllBlocksCleared` voids the disk tier's blocks too: told again.
                let disk = ordered(&self.disk, MEDIUM_DISK);
                self.pending.extend(disk);
                self.cells.resyncs.fetch_add(1, Relaxed);
            }
            Msg::Disk(changes) => {
                self.in_flight.fetch_sub(changes.len(), Relaxed);
                for c in changes {
                    self.apply(Medium::Disk, c);
                }
            }
            Msg::DiskSnapshot(all) => {
                self.in_flight.fetch_sub(1, Relaxed);
                // What the stream told of the disk goes, the tier's index comes.
                let old: Vec<u64> = self.disk.drain().map(|(_, e)| e.hash).collect();
                for hash in old {
                    self.removed(Medium::Disk, hash);
                }
                for c in parents_first(all) {
                    self.apply(Medium::Disk, c);
                }
                self.cells.resyncs.fetch_add(1, Relaxed);
            }
        }
    }

    fn apply(&mut self, medium: Medium, change: IndexChange) {
        match change {
            IndexChange::Stored { key, parent, replaced, meta } => {
                let old = self.map(medium).remove(&key);
                if replaced || old.is_some() {
                    self.removed(medium, old.map_or(block_hash(key), |e| e.hash));
                }
                let hash = meta.as_ref().map_or(block_hash(key), |m| m.block_hash);
                // The writer's word on the parent, when it gave a record;
                // else the chain link, as that block was published (on this
                // medium, else on the other: the disk tier's two writers can
                // index a child before its parent).
                let parent_hash = match &meta {
                    Some(m) => m.parent_hash,
                    None => parent.map(|p| self.published_hash(medium, p)),
                };
                self.pending.push(KvEvent::Stored {
                    hash,
                    parent: parent_hash,
                    medium: medium.name(),
                    meta: meta.clone(),
                });
                self.map(medium).insert(key, Entry { hash, parent_key: parent, parent_hash, meta });
            }
            IndexChange::Removed { key } => {
                let hash = self.map(medium).remove(&key).map_or(block_hash(key), |e| e.hash);
                self.removed(medium, hash);
            }
        }
    }

    /// A removal, merged into the previous event if that is one too, of
    /// the same medium.
    fn removed(&mut self, medium: Medium, hash: u64) {
        match self.pending.last_mut() {
            Some(KvEvent::Removed { hashes, medium: m }) if *m == medium.name() => hashes.push(hash),
            _ => self.pending.push(KvEvent::Removed { hashes: vec![hash], medium: medium.name() }),
        }
    }

    /// Sends the pending events as batches of at most [`EVENTS_PER_BATCH`]
    /// (`empty_too`: one empty batch when none are pending).
    async fn publish(&mut self, sock: &mut PubSocket, empty_too: bool) {
        let pending = std::mem::take(&mut self.pending);
        let no_events: &[KvEvent] = &[];
        let chunks: Vec<&[KvEvent]> =
            if pending.is_empty() && empty_too { vec![no_events] } else { pending.chunks(EVENTS_PER_BATCH).collect() };
        for chunk in chunks {
            let seq = self.next_seq;
            self.next_seq += 1;
            let payload = batch_payload(chunk);
            let msg = frames(vec![self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]);
            self.gap_notice_due = false;
            match tokio::time::timeout(self.cfg.send_timeout, sock.send(msg)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!("KV event batch {seq}: {e}"),
                Err(_) => {
                    self.cells.send_timeouts.fetch_add(1, Relaxed);
                    self.gap_notice_due = true;
                }
            }
            self.cells.batches.fetch_add(1, Relaxed);
            self.cells.events.fetch_add(chunk.len() as u64, Relaxed);
            self.cells.bytes.fetch_add(payload.len() as u64, Relaxed);
            self.cells.sequence.store(seq, Relaxed);
            if self.cfg.replay_batches > 0 {
                if self.buffer.len() == self.cfg.replay_batches {
                    self.buffer.pop_front();
                }
                self.buffer.push_back((seq, payload));
            }
        }
        self.cells.blocks.store(self.index.len() as u64, Relaxed);
        self.cells.disk_blocks.store(self.disk.len() as u64, Relaxed);
        // Keeps the vector's capacity for the next round.
        self.pending = pending;
        self.pending.clear();
    }

    /// Answers one replay request (`msg`: identity, empty, start).
    async fn replay(&mut self, sock: &mut RouterSocket, msg: ZmqMessage) {
        let req = msg.into_vec();
        let [id, _, start] = req.as_slice() else {
            tracing::debug!("a replay request of {} frames (3 expected) is ignored", req.len());
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::debug!("a replay request whose start is not 8 bytes is ignored");
            return;
        };
        let start = u64::from_be_bytes(start);
        self.cells.replays.fetch_add(1, Relaxed);
        let empty = Bytes::new();
        let buffered = self.buffer.front().is_some_and(|&(oldest, _)| start >= oldest) || start >= self.next_seq;
        let mut answers: Vec<(u64, Bytes)> = Vec::new();
        if buffered {
            answers.extend(self.buffer.iter().filter(|(seq, _)| *seq >= start).cloned());
        } else {
            self.cells.replay_snapshots.fetch_add(1, Relaxed);
            let last = self.next_seq.saturating_sub(1);
            let events = self.snapshot();
            for chunk in events.chunks(EVENTS_PER_BATCH) {
                answers.push((last, batch_payload(chunk)));
            }
        }
        for (seq, payload) in answers {
            let reply = frames(vec![id.clone(), empty.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload]);
            if sock.send(reply).await.is_err() {
                return; // the peer left
            }
        }
        let _ = sock.send(frames(vec![id.clone(), empty.clone(), Bytes::from_static(&END_SEQ), empty])).await;
    }

    /// `AllBlocksCleared`, then every block of the index and of the disk
    /// tier's, parents before their children.
    fn snapshot(&self) -> Vec<KvEvent> {
        let mut out = Vec::with_capacity(self.index.len() + self.disk.len() + 1);
        out.push(KvEvent::Cleared);
        out.extend(ordered(&self.index, MEDIUM_CPU));
        out.extend(ordered(&self.disk, MEDIUM_DISK));
        out
    }
}

/// `changes` (a tier's whole index: all `Stored`), parents before their
/// children (the tier's own order is its slots'); a cycle (the disk's links
/// come from file headers) is cut where the walk meets a block already taken.
fn parents_first(changes: Vec<IndexChange>) -> Vec<IndexChange> {
    let mut by_key: HashMap<u128, IndexChange> = HashMap::with_capacity(changes.len());
    let mut keys = Vec::with_capacity(changes.len());
    for c in changes {
        if let IndexChange::Stored { key, .. } = c {
            keys.push(key);
            by_key.insert(key, c);
        }
    }
    let mut out = Vec::with_capacity(keys.len());
    let mut chain = Vec::new();
    for key in keys {
        // Walk up through the ancestors not yet taken, then take them downwards.
        let mut k = key;
        while let Some(c) = by_key.remove(&k) {
            let parent = match &c {
                IndexChange::Stored { parent, .. } => *parent,
                IndexChange::Removed { .. } => None,
            };
            chain.push(c);
            match parent {
                Some(p) => k = p,
                None => break,
            }
        }
        out.extend(chain.drain(..).rev());
    }
    out
}

/// A `BlockStored` of `medium` for every entry of `map`, parents before
/// their children.
fn ordered(map: &HashMap<u128, Entry>, medium: &'static str) -> Vec<KvEvent> {
    let mut out = Vec::with_capacity(map.len());
    let mut sent: std::collections::HashSet<u128> = std::collections::HashSet::with_capacity(map.len());
    let mut chain = Vec::new();
    for &key in map.keys() {
        // Walk up to the first ancestor sent (or absent), then send
        // downwards.
        let mut k = key;
        while !sent.contains(&k) {
            let Some(e) = map.get(&k) else { break };
            chain.push((k, e));
            match e.parent_key {
                // Longer than the map: a cycle (the store's links form a
                // forest; the disk's come from file headers, and are
                // bounded here all the same).
                Some(p) if chain.len() <= map.len() => k = p,
                _ => break,
            }
        }
        while let Some((k, e)) = chain.pop() {
            if sent.insert(k) {
                out.push(KvEvent::Stored { hash: e.hash, parent: e.parent_hash, medium, meta: e.meta.clone() });
            }
        }
    }
    out
}

fn batch_payload(events: &[KvEvent]) -> Bytes {
    let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let mut out = Vec::with_capacity(16 + events.len() * 48);
    encode_batch(ts, events, 0, &mut out);
    Bytes::from(out)
}

fn frames(v: Vec<Bytes>) -> ZmqMessage {
    // Never empty: every caller gives at least three frames.
    ZmqMessage::try_from(v).unwrap_or_else(|_| ZmqMessage::from(Bytes::new()))
}

/// Binds `sock` to `endpoint`, retrying an address in use for [`BIND_RETRY`]
/// if `retry`.
async fn bind<S: Socket>(sock: &mut S, endpoint: &str, retry: bool) -> Result<(), String> {
    let until = tokio::time::Instant::now() + BIND_RETRY;
    loop {
        match sock.bind(endpoint).await {
            Ok(_) => return Ok(()),
            Err(e) => {
                let in_use = e.to_string().to_ascii_lowercase().contains("in use");
                if !(retry && in_use) || tokio::time::Instant::now() >= until {
                    return Err(format!("binding {endpoint}: {e}"));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The thread: binds, reports the outcome on `bound`, then publishes until
/// the serve loop drops its sender.
pub(super) fn run(
    cfg: EventsConfig,
    cells: Arc<EventCells>,
    in_flight: Arc<AtomicUsize>,
    mut rx: mpsc::Receiver<Msg>,
    retry_bind: bool,
    bound: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = bound.send(Err(format!("starting the KV event publisher's runtime: {e}")));
            return;
        }
    };
    rt.block_on(async move {
        let mut pub_sock = PubSocket::new();
        let mut monitor = pub_sock.monitor();
        if let Err(e) = bind(&mut pub_sock, &cfg.endpoint, retry_bind).await {
            tracing::error!("the KV event publisher is off: {e}");
            let _ = bound.send(Err(e));
            return;
        }
        let mut router = None;
        if let Some(ep) = &cfg.replay_endpoint {
            let mut r = RouterSocket::new();
            if let Err(e) = bind(&mut r, ep, retry_bind).await {
                tracing::error!("the KV event publisher is off: {e}");
                let _ = bound.send(Err(e));
                return;
            }
            router = Some(r);
        }
        let _ = bound.send(Ok(()));
        cells.enabled.store(1, Relaxed);
        let mut st = State {
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            cfg,
            cells: cells.clone(),
            in_flight,
            next_seq: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64),
            buffer: VecDeque::new(),
            index: HashMap::new(),
            disk: HashMap::new(),
            pending: Vec::new(),
            gap_notice_due: false,
        };
        let mut monitor_open = true;
        // Set while changes gather (see GATHER): the queue is not awaited, so
        // the serve loop's sends wake nobody.
        let mut gather_until: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                m = rx.recv(), if gather_until.is_none() => {
                    let Some(m) = m else { break };
                    st.take(m);
                    gather_until = Some(tokio::time::Instant::now() + GATHER);
                }
                _ = tokio::time::sleep_until(gather_until.unwrap_or_else(tokio::time::Instant::now)), if gather_until.is_some() => {
                    gather_until = None;
                    let mut closed = false;
                    for _ in 0..MESSAGES_PER_ROUND {
                        match rx.try_recv() {
                            Ok(m) => st.take(m),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => {
                                closed = true;
                                break;
                            }
                        }
                    }
                    st.publish(&mut pub_sock, false).await;
                    if closed {
                        break;
                    }
                }
                _ = tokio::time::sleep(GAP_NOTICE_AFTER), if st.gap_notice_due => {
                    st.publish(&mut pub_sock, true).await;
                }
                req = async { router.as_mut().expect("guarded").recv().await }, if router.is_some() => {
                    if let (Ok(req), Some(r)) = (req, router.as_mut()) {
                        // What was taken goes out first: a snapshot is as of the last batch sent.
                        if !st.pending.is_empty() {
                            st.publish(&mut pub_sock, false).await;
                        }
                        st.replay(r, req).await;
                    }
                }
                ev = futures_util::StreamExt::next(&mut monitor), if monitor_open => match ev {
                    Some(SocketEvent::Accepted(..)) => {
                        cells.subscribers.fetch_add(1, Relaxed);
                        // An empty batch shortly after tells a subscriber that
                        // connects now (a router reconnecting to a restarted
                        // daemon) the sequence: its gap brings its replay and a
                        // snapshot without waiting for the next store.
                        st.gap_notice_due = true;
                    }
                    Some(SocketEvent::Disconnected(_)) => {
                        crate::tier::metrics::sub(&cells.subscribers, 1);
                    }
                    Some(_) => {}
                    None => monitor_open = false,
                },
            }
        }
        cells.enabled.store(0, Relaxed);
        cells.subscribers.store(0, Relaxed);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> State {
        State {
            cfg: EventsConfig::new("tcp://127.0.0.1:5557").expect("an endpoint"),
            cells: Arc::new(EventCells::default()),
            // (Each message taken is subtracted: start high.)
            in_flight: Arc::new(AtomicUsize::new(1 << 20)),
            topic: Bytes::new(),
            next_seq: 1,
            buffer: VecDeque::new(),
            index: HashMap::new(),
            disk: HashMap::new(),
            pending: Vec::new(),
            gap_notice_due: false,
        }
    }

    fn stored(key: u128, parent: Option<u128>, meta: Option<Arc<BlockMeta>>) -> IndexChange {
        IndexChange::Stored { key, parent, replaced: false, meta }
    }

    /// (hash, medium) of each `BlockStored`, and the removals, in order.
    fn told(events: &[KvEvent]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                KvEvent::Stored { hash, parent, medium, .. } => format!("+{hash}<{parent:?}@{medium}"),
                KvEvent::Removed { hashes, medium } => format!("-{hashes:?}@{medium}"),
                KvEvent::Cleared => "clear".into(),
            })
            .collect()
    }

    #[test]
    fn the_disk_tiers_index_is_published_beside_the_megaslabs_and_survives_its_snapshots() {
        let mut st = state();
        let meta = Arc::new(BlockMeta { block_hash: 100, parent_hash: None, block_size: 16, ..BlockMeta::default() });
        st.take(Msg::Changes(vec![stored(1, None, None)]));
        st.take(Msg::Disk(vec![stored(1, None, Some(meta.clone())), stored(2, Some(1), None)]));
        // A disk block's parent by key is published under the hash its
        // parent has on disk (the record's).
        assert_eq!(told(&st.pending), ["+1<None@CPU", "+100<None@DISK", "+2<Some(100)@DISK"]);
        st.pending.clear();
        // Removals merge per medium only.
        st.take(Msg::Changes(vec![IndexChange::Removed { key: 1 }]));
        st.take(Msg::Disk(vec![IndexChange::Removed { key: 2 }]));
        assert_eq!(told(&st.pending), ["-[1]@CPU", "-[2]@DISK"]);
        st.pending.clear();
        // A disk block written again (the tier replaced it) is removed, then stored.
        st.take(Msg::Disk(vec![stored(1, None, None)]));
        assert_eq!(told(&st.pending), ["-[100]@DISK", "+1<None@DISK"]);
        st.pending.clear();
        st.take(Msg::Disk(vec![stored(1, None, Some(meta)), stored(3, Some(1), None)]));
        st.pending.clear();
        // The megaslab's snapshot clears everything: the disk's blocks are told again, parents first.
        st.take(Msg::Snapshot(vec![stored(5, None, None)]));
        assert_eq!(told(&st.pending), ["clear", "+5<None@CPU", "+100<None@DISK", "+3<Some(100)@DISK"]);
        st.pending.clear();
        // The disk's own snapshot replaces what was told of the disk, and only that.
        st.take(Msg::DiskSnapshot(vec![stored(4, Some(3), None), stored(3, None, None)]));
        let t = told(&st.pending);
        assert!(["-[100, 3]@DISK", "-[3, 100]@DISK"].contains(&t[0].as_str()), "{t:?}");
        assert_eq!(t[1..], ["+3<None@DISK", "+4<Some(3)@DISK"]);
        // A disk child indexed before its parent: named by the parent's hash in the megaslab.
        st.pending.clear();
        let m9 = Arc::new(BlockMeta { block_hash: 900, parent_hash: None, block_size: 16, ..BlockMeta::default() });
        st.take(Msg::Changes(vec![stored(9, None, Some(m9))]));
        st.take(Msg::Disk(vec![stored(10, Some(9), None)]));
        assert_eq!(told(&st.pending), ["+900<None@CPU", "+10<Some(900)@DISK"]);
        st.take(Msg::Changes(vec![IndexChange::Removed { key: 9 }]));
        st.take(Msg::Disk(vec![IndexChange::Removed { key: 10 }]));
        st.pending.clear();
        // A late joiner's snapshot: both media.
        assert_eq!(told(&st.snapshot()), ["clear", "+5<None@CPU", "+3<None@DISK", "+4<Some(3)@DISK"]);
        assert_eq!((st.index.len(), st.disk.len()), (1, 2));
    }
}
