//! What the KV event publisher counts (`kachedb_events_*` on `/metrics`).
//! Writers: the serve loop (`dropped`, `resyncs_queued`) and the publisher
//! thread (the rest); relaxed, as every tier's cells (`crate::tier::metrics`).

use crate::tier::metrics::{rows, Family, Kind, Row, TierMetrics};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The publisher's counters and gauges.
#[derive(Debug, Default)]
pub struct EventCells {
    /// 1 while a publisher runs.
    pub enabled: AtomicU64,
    /// Batches sent on the PUB socket.
    pub batches: AtomicU64,
    /// Events in those batches.
    pub events: AtomicU64,
    /// Payload bytes of those batches.
    pub bytes: AtomicU64,
    /// Index changes the serve loop (or the disk tier) could not queue (the
    /// queue was full); each such loss is followed by a snapshot on the stream.
    pub dropped: AtomicU64,
    /// Snapshots published on the stream after a loss (or at start).
    pub resyncs: AtomicU64,
    /// Replay requests answered.
    pub replays: AtomicU64,
    /// Replay requests answered with a snapshot (their start was no longer
    /// buffered).
    pub replay_snapshots: AtomicU64,
    /// Sends to a subscriber that did not take a batch in time.
    pub send_timeouts: AtomicU64,
    /// Subscribers connected to the PUB socket now.
    pub subscribers: AtomicU64,
    /// The last sequence number published.
    pub sequence: AtomicU64,
    /// Blocks in the publisher's index (what a snapshot sends).
    pub blocks: AtomicU64,
    /// Blocks in its copy of the disk tier's index (medium `DISK`).
    pub disk_blocks: AtomicU64,
}

const ROWS: [Row<EventCells>; 12] = [
    ("events_batches", "KV event batches published on the PUB socket.", Kind::Counter, |c| &c.batches),
    ("events_published", "KV events published (stored, removed, cleared).", Kind::Counter, |c| &c.events),
    ("events_bytes", "Payload bytes of the KV event batches published.", Kind::Counter, |c| &c.bytes),
    (
        "events_dropped",
        "Index changes the serve loop or the disk tier could not queue for the publisher (queue full); a snapshot follows each loss.",
        Kind::Counter,
        |c| &c.dropped,
    ),
    ("events_resyncs", "Snapshots published on the stream (at start and after a loss).", Kind::Counter, |c| &c.resyncs),
    ("events_replays", "Replay requests answered.", Kind::Counter, |c| &c.replays),
    (
        "events_replay_snapshots",
        "Replay requests answered with a snapshot (their start was no longer buffered).",
        Kind::Counter,
        |c| &c.replay_snapshots,
    ),
    (
        "events_send_timeouts",
        "Batches a subscriber did not take in time (it sees a sequence gap and replays).",
        Kind::Counter,
        |c| &c.send_timeouts,
    ),
    ("events_subscribers", "Subscribers connected to the PUB socket.", Kind::Gauge, |c| &c.subscribers),
    ("events_sequence", "The last sequence number published.", Kind::Gauge, |c| &c.sequence),
    ("events_blocks", "Blocks in the publisher's index (what a snapshot sends).", Kind::Gauge, |c| &c.blocks),
    (
        "events_disk_blocks",
        "Blocks in the publisher's copy of the disk tier's index (medium DISK).",
        Kind::Gauge,
        |c| &c.disk_blocks,
    ),
];

impl TierMetrics for EventCells {
    fn families(&self, out: &mut Vec<Family>) {
        if self.enabled.load(Relaxed) == 0 {
            return;
        }
        rows(self, &ROWS, out);
    }

    fn fill_stats(&self, _into: &mut kachedb_shm::control::Stats) {}
}
