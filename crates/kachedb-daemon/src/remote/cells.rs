//! The remote tier's counters and metric families (`kachedb_remote_*`), and
//! its rows of `kachedb stats`.

use crate::tier::metrics::{put_rows, rows, rows_of, Family, FillLatency, Kind, Row, TierMetrics};
use kachedb_shm::control::Stats;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// The remote tier's counters (`kachedb serve --remote`). Written by the
/// remote workers and the serve loop with `fetch_add`/`fetch_sub` (several
/// writers; a slow path: a few per remote request). Relaxed: each value is
/// read for itself, nothing else is published through it
/// (`crate::tier::metrics`).
#[derive(Debug, Default)]
pub struct RemoteCells {
    /// The tier is on.
    pub enabled: AtomicBool,
    /// Blocks written.
    pub writes: AtomicU64,
    /// Tensor bytes written.
    pub write_bytes: AtomicU64,
    /// Blocks not queued: the queue was full.
    pub dropped_writes: AtomicU64,
    /// Tensor bytes queued or being written.
    pub queue_bytes: AtomicU64,
    /// Blocks queued or being written.
    pub queue_blocks: AtomicU64,
    /// Remote reads asked for.
    pub fetches: AtomicU64,
    /// Blocks filled.
    pub fills: AtomicU64,
    /// Tensor bytes filled.
    pub fill_bytes: AtomicU64,
    /// Keys the remote store does not hold.
    pub misses: AtomicU64,
    /// Requests failed or timed out.
    pub errors: AtomicU64,
    /// Values that did not verify.
    pub corrupt: AtomicU64,
    /// Values that failed authentication (keying or tag).
    pub auth_failures: AtomicU64,
    /// Fetches cancelled at their deadline.
    pub fetches_cancelled: AtomicU64,
    /// Blocks read ahead along a chain into free megaslab space.
    pub read_ahead: AtomicU64,
    /// Fill latency, per fetch that ended at the remote tier.
    pub fill: FillLatency,
}

const ROWS: [Row<RemoteCells>; 14] = [
    ("remote_writes", "Blocks written to the remote store.", Kind::Counter, |c| &c.writes),
    (
        "remote_write_bytes",
        "Tensor bytes of the blocks written to the remote store.",
        Kind::Counter,
        |c| &c.write_bytes,
    ),
    (
        "remote_dropped_writes",
        "Committed blocks not written remotely because the write-behind queue was full.",
        Kind::Counter,
        |c| &c.dropped_writes,
    ),
    (
        "remote_queue_bytes",
        "Tensor bytes queued or being written to the remote store.",
        Kind::Gauge,
        |c| &c.queue_bytes,
    ),
    ("remote_queue_blocks", "Blocks queued or being written to the remote store.", Kind::Gauge, |c| &c.queue_blocks),
    ("remote_fetches", "Remote reads asked for (one per local-miss tail of a batch).", Kind::Counter, |c| &c.fetches),
    ("remote_fills", "Blocks filled from the remote store into the megaslab.", Kind::Counter, |c| &c.fills),
    ("remote_fill_bytes", "Tensor bytes filled from the remote store.", Kind::Counter, |c| &c.fill_bytes),
    ("remote_misses", "Keys asked for that the remote store does not hold.", Kind::Counter, |c| &c.misses),
    ("remote_errors", "Remote requests that failed or timed out.", Kind::Counter, |c| &c.errors),
    (
        "remote_corrupt",
        "Remote values whose header or checksum did not verify (never served).",
        Kind::Counter,
        |c| &c.corrupt,
    ),
    (
        "remote_auth_failures",
        "Remote values refused because they failed authentication: a tag that does not verify under the fleet key, or keyed/unkeyed not as this node (never served).",
        Kind::Counter,
        |c| &c.auth_failures,
    ),
    (
        "remote_fetches_cancelled",
        "Remote fetches cancelled at their deadline (their unfilled keys are misses).",
        Kind::Counter,
        |c| &c.fetches_cancelled,
    ),
    (
        "remote_read_ahead",
        "Blocks read ahead along a chain from the remote store into free megaslab space (--remote-read-ahead).",
        Kind::Counter,
        |c| &c.read_ahead,
    ),
];

impl TierMetrics for RemoteCells {
    fn fill_stats(&self, into: &mut Stats) {
        put_rows(&mut into.tiers, &self.stats());
    }

    fn families(&self, out: &mut Vec<Family>) {
        if !self.enabled.load(Relaxed) {
            return;
        }
        rows(self, &ROWS, out);
        out.push(self.fill.family(
            "remote_fill_duration_seconds",
            "Time from a local GET or LOOKUP miss to its remote fill landing in the megaslab (per fetch).",
        ));
    }
}

impl RemoteCells {
    /// The counters as stats.
    pub fn stats(&self) -> RemoteStats {
        RemoteStats {
            remote_enabled: self.enabled.load(Relaxed),
            remote_writes: self.writes.load(Relaxed),
            remote_write_bytes: self.write_bytes.load(Relaxed),
            remote_dropped_writes: self.dropped_writes.load(Relaxed),
            remote_queue_bytes: self.queue_bytes.load(Relaxed),
            remote_queue_blocks: self.queue_blocks.load(Relaxed),
            remote_fetches: self.fetches.load(Relaxed),
            remote_fills: self.fills.load(Relaxed),
            remote_fill_bytes: self.fill_bytes.load(Relaxed),
            remote_misses: self.misses.load(Relaxed),
            remote_errors: self.errors.load(Relaxed),
            remote_corrupt: self.corrupt.load(Relaxed),
            remote_auth_failures: self.auth_failures.load(Relaxed),
            remote_fetches_cancelled: self.fetches_cancelled.load(Relaxed),
            remote_read_ahead: self.read_ahead.load(Relaxed),
            remote_fill_ms_mean: self.fill.mean_ms(),
            remote_fill_ms_max: self.fill.max_ms(),
        }
    }
}

/// The remote tier's rows of `kachedb stats` (`kachedb serve --remote`,
/// docs/remote.md): all zero without `--remote`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RemoteStats {
    /// The daemon runs with a remote tier.
    pub remote_enabled: bool,
    /// Blocks written to the remote store.
    pub remote_writes: u64,
    /// Tensor bytes of the blocks written.
    pub remote_write_bytes: u64,
    /// Committed blocks not written because the write-behind queue was full.
    pub remote_dropped_writes: u64,
    /// Tensor bytes queued or being written now.
    pub remote_queue_bytes: u64,
    /// Blocks queued or being written now.
    pub remote_queue_blocks: u64,
    /// Remote reads asked for (one per local-miss tail of a batch).
    pub remote_fetches: u64,
    /// Blocks filled from the remote store into the megaslab.
    pub remote_fills: u64,
    /// Tensor bytes of the blocks filled.
    pub remote_fill_bytes: u64,
    /// Keys asked for that the remote store does not hold.
    pub remote_misses: u64,
    /// Remote requests that failed or timed out (a node down or slow).
    pub remote_errors: u64,
    /// Values read back whose header or checksum did not verify (never served).
    pub remote_corrupt: u64,
    /// Values read back that failed authentication: a tag that does not
    /// verify under the fleet key, or keyed/unkeyed not as this node (never served).
    pub remote_auth_failures: u64,
    /// Fetches cancelled at their deadline (their unfilled keys are misses).
    pub remote_fetches_cancelled: u64,
    /// Blocks read ahead along a chain into free megaslab space.
    pub remote_read_ahead: u64,
    /// Mean time from a local miss to its fill being served, milliseconds.
    pub remote_fill_ms_mean: f64,
    /// Longest such time, milliseconds.
    pub remote_fill_ms_max: f64,
}

impl RemoteStats {
    /// The remote tier's rows of `s`.
    pub fn of(s: &Stats) -> RemoteStats {
        rows_of(&s.tiers)
    }
}
