//! The disk tier's counters and metric families (`kachedb_disk_*`,
//! `kachedb_tenant_disk_*`), and its rows of `kachedb stats`.

use crate::disk::index::TenantDisk;
use crate::tier::metrics::{put_rows, rows, rows_of, Family, FillLatency, Kind, Row, TierMetrics, Values};
use kachedb_shm::control::{Stats, TenantStats};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// The disk tier's counters (`kachedb serve --disk`). Written by the disk
/// tier's threads and the serve loop with `fetch_add`/`fetch_sub`/`store`
/// (several writers; a slow path: a few per block written or filled).
/// Relaxed: each value is read for itself, nothing else is published
/// through it (`crate::tier::metrics`).
#[derive(Debug, Default)]
pub struct DiskCells {
    /// The tier is on.
    pub enabled: AtomicBool,
    /// Blocks on disk (set from the index).
    pub blocks: AtomicU64,
    /// File-system bytes of the blocks on disk (set from the index).
    pub bytes: AtomicU64,
    /// The bound (`--disk-size`).
    pub capacity_bytes: AtomicU64,
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
    /// Disk reads asked for.
    pub fetches: AtomicU64,
    /// Blocks filled.
    pub fills: AtomicU64,
    /// Tensor bytes filled.
    pub fill_bytes: AtomicU64,
    /// Keys not on disk.
    pub misses: AtomicU64,
    /// Blocks evicted from disk.
    pub evictions: AtomicU64,
    /// I/O errors.
    pub errors: AtomicU64,
    /// Block files found torn or corrupt.
    pub torn: AtomicU64,
    /// Blocks found whole at start.
    pub recovered: AtomicU64,
    /// Of those, blocks the catalog knew (no header read at start).
    pub catalogued: AtomicU64,
    /// Blocks deleted by a client's DELETE.
    pub deletes: AtomicU64,
    /// Fetches the serve loop stopped waiting for (past `--disk-timeout-ms`).
    pub fetches_timed_out: AtomicU64,
    /// Blocks read ahead into free megaslab space.
    pub read_ahead: AtomicU64,
    /// Blocks read ahead into the page cache (no free megaslab room).
    pub read_ahead_cached: AtomicU64,
    /// The start-up index rebuild is done.
    pub indexed: AtomicBool,
    /// Microseconds the start-up index rebuild took.
    pub index_us: AtomicU64,
    /// 1 once the tier's directory is no longer the one it opened.
    pub dir_lost: AtomicU64,
    /// Removals not confirmed durable in time (answered `NOT_DURABLE`).
    pub unconfirmed_removals: AtomicU64,
    /// Removals made durable before the client's answer.
    pub removals: AtomicU64,
    /// Per tenant (set from the index with `blocks` and `bytes`, under
    /// this mutex: a reader holding it sees rows that add up to them).
    pub tenants: Mutex<Vec<TenantDisk>>,
    /// Fill latency, per fetch that ended at the disk.
    pub fill: FillLatency,
}

const ROWS: [Row<DiskCells>; 25] = [
    ("disk_blocks", "Blocks on the disk tier.", Kind::Gauge, |c| &c.blocks),
    ("disk_bytes", "File-system bytes the disk tier's blocks take.", Kind::Gauge, |c| &c.bytes),
    ("disk_capacity_bytes", "The bound on the disk tier's bytes (--disk-size).", Kind::Gauge, |c| &c.capacity_bytes),
    (
        "disk_writes",
        "Blocks written to disk (complete: synced and renamed into place).",
        Kind::Counter,
        |c| &c.writes,
    ),
    ("disk_write_bytes", "Tensor bytes of the blocks written to disk.", Kind::Counter, |c| &c.write_bytes),
    (
        "disk_dropped_writes",
        "Committed blocks not written to disk: the write-behind queue was full, the block is larger than the disk or its tenant's disk limit allows, or its key was deleted first.",
        Kind::Counter,
        |c| &c.dropped_writes,
    ),
    ("disk_queue_bytes", "Tensor bytes queued or being written to disk.", Kind::Gauge, |c| &c.queue_bytes),
    ("disk_queue_blocks", "Blocks queued or being written to disk.", Kind::Gauge, |c| &c.queue_blocks),
    ("disk_fetches", "Disk reads asked for (one per local-miss tail of a batch).", Kind::Counter, |c| &c.fetches),
    ("disk_fills", "Blocks filled from disk into the megaslab.", Kind::Counter, |c| &c.fills),
    ("disk_fill_bytes", "Tensor bytes filled from disk.", Kind::Counter, |c| &c.fill_bytes),
    ("disk_misses", "Keys asked for that are not on disk.", Kind::Counter, |c| &c.misses),
    ("disk_evictions", "Blocks evicted from disk to make room.", Kind::Counter, |c| &c.evictions),
    ("disk_errors", "Disk writes or reads that failed (full, read-only, gone).", Kind::Counter, |c| &c.errors),
    (
        "disk_torn",
        "Block files found torn or corrupt, at start or at a fill (never served, deleted).",
        Kind::Counter,
        |c| &c.torn,
    ),
    ("disk_recovered", "Blocks found whole on disk at start.", Kind::Counter, |c| &c.recovered),
    (
        "disk_catalogued",
        "Blocks found at start through the disk tier's catalog (no header read).",
        Kind::Counter,
        |c| &c.catalogued,
    ),
    ("disk_deletes", "Blocks deleted from disk because a client deleted their key.", Kind::Counter, |c| &c.deletes),
    (
        "disk_fetches_timed_out",
        "Disk fetches not done within --disk-timeout-ms (their keys were answered as misses).",
        Kind::Counter,
        |c| &c.fetches_timed_out,
    ),
    ("disk_index_microseconds", "Time the start-up index rebuild took (0 until done).", Kind::Gauge, |c| &c.index_us),
    (
        "disk_dir_lost",
        "1 once the disk tier's directory is no longer the one it opened (removed, moved or replaced under the daemon): the tier stopped.",
        Kind::Gauge,
        |c| &c.dir_lost,
    ),
    (
        "disk_removals",
        "Older copies of deleted or replaced keys removed from disk durably before the client's answer.",
        Kind::Counter,
        |c| &c.removals,
    ),
    (
        "disk_unconfirmed_removals",
        "Deletes and replacements whose older copy on disk was not confirmed gone in time (answered NOT_DURABLE; retried).",
        Kind::Counter,
        |c| &c.unconfirmed_removals,
    ),
    (
        "disk_read_ahead",
        "Blocks read ahead along a chain into free megaslab space (--disk-read-ahead; counted in disk_fills too once committed).",
        Kind::Counter,
        |c| &c.read_ahead,
    ),
    (
        "disk_read_ahead_cached",
        "Blocks read ahead along a chain into the page cache only: the megaslab had no free room for them.",
        Kind::Counter,
        |c| &c.read_ahead_cached,
    ),
];

/// A per-tenant family: name, help, kind, and its value for a tenant row
/// (`None`: no series for that tenant).
type TenantFamily = (&'static str, &'static str, Kind, fn(&TenantDisk) -> Option<u64>);

const TENANT_FAMILIES: [TenantFamily; 5] = [
    (
        "tenant_disk_bytes",
        "File-system bytes of the tenant's blocks on the disk tier (sums to kachedb_disk_bytes).",
        Kind::Gauge,
        |t| Some(t.bytes),
    ),
    (
        "tenant_disk_blocks",
        "The tenant's blocks on the disk tier (sums to kachedb_disk_blocks).",
        Kind::Gauge,
        |t| Some(t.blocks),
    ),
    (
        "tenant_disk_limit_bytes",
        "The tenant's limit on kachedb_tenant_disk_bytes (--tenant-disk-limit, or its --tenant-limit share); absent without one.",
        Kind::Gauge,
        |t| t.limit,
    ),
    (
        "tenant_disk_evictions",
        "The tenant's blocks evicted from disk to make room (by its own writes, or, without a disk limit, by anyone's).",
        Kind::Counter,
        |t| Some(t.evictions),
    ),
    (
        "tenant_disk_limit_refusals",
        "The tenant's blocks not written to disk: its own blocks there could not make room within its disk limit (counted in kachedb_disk_dropped_writes too).",
        Kind::Counter,
        |t| Some(t.limit_refusals),
    ),
];

impl TierMetrics for DiskCells {
    fn fill_stats(&self, into: &mut Stats) {
        let (disk, tenants) = self.stats_and_tenants(std::mem::take(&mut into.tenants));
        put_rows(&mut into.tiers, &disk);
        into.tenants = tenants;
    }

    fn families(&self, out: &mut Vec<Family>) {
        if !self.enabled.load(Relaxed) {
            return;
        }
        // Held while the totals are read too: the tier publishes totals
        // and tenant rows under it, so the rows add up to the totals.
        let published = self.tenants.lock();
        let tenants = published.as_ref().map(|t| (*t).clone()).unwrap_or_default();
        rows(self, &ROWS, out);
        drop(published);
        for (name, help, kind, pick) in TENANT_FAMILIES {
            let series = tenants.iter().filter_map(|t| Some((vec![("tenant", t.name.clone())], pick(t)?))).collect();
            out.push(Family { name, help, kind, values: Values::Labelled(series) });
        }
        out.push(self.fill.family(
            "disk_fill_duration_seconds",
            "Time from a local GET or LOOKUP miss to its disk fill landing in the megaslab (per fetch that ended at the disk).",
        ));
    }
}

impl DiskCells {
    /// The counters as stats.
    pub fn stats(&self) -> DiskStats {
        DiskStats {
            disk_fill_ms_mean: self.fill.mean_ms(),
            disk_enabled: self.enabled.load(Relaxed),
            disk_blocks: self.blocks.load(Relaxed),
            disk_bytes: self.bytes.load(Relaxed),
            disk_capacity_bytes: self.capacity_bytes.load(Relaxed),
            disk_writes: self.writes.load(Relaxed),
            disk_write_bytes: self.write_bytes.load(Relaxed),
            disk_dropped_writes: self.dropped_writes.load(Relaxed),
            disk_queue_bytes: self.queue_bytes.load(Relaxed),
            disk_queue_blocks: self.queue_blocks.load(Relaxed),
            disk_fetches: self.fetches.load(Relaxed),
            disk_fills: self.fills.load(Relaxed),
            disk_fill_bytes: self.fill_bytes.load(Relaxed),
            disk_misses: self.misses.load(Relaxed),
            disk_evictions: self.evictions.load(Relaxed),
            disk_errors: self.errors.load(Relaxed),
            disk_torn: self.torn.load(Relaxed),
            disk_recovered: self.recovered.load(Relaxed),
            disk_catalogued: self.catalogued.load(Relaxed),
            disk_deletes: self.deletes.load(Relaxed),
            disk_fetches_timed_out: self.fetches_timed_out.load(Relaxed),
            disk_read_ahead: self.read_ahead.load(Relaxed),
            disk_read_ahead_cached: self.read_ahead_cached.load(Relaxed),
            disk_indexed: self.indexed.load(Relaxed),
            disk_index_s: self.index_us.load(Relaxed) as f64 / 1e6,
            disk_dir_lost: self.dir_lost.load(Relaxed) != 0,
            disk_unconfirmed_removals: self.unconfirmed_removals.load(Relaxed),
            disk_removals: self.removals.load(Relaxed),
        }
    }

    /// The counters as stats, and `tenants` (the megaslab's rows) with each
    /// tenant's disk figures added, and a row for each tenant the disk holds
    /// blocks of that the megaslab does not count now (after them). Read
    /// under the tenants' lock, so the rows add up to the totals.
    pub fn stats_and_tenants(&self, mut tenants: Vec<TenantStats>) -> (DiskStats, Vec<TenantStats>) {
        let published = self.tenants.lock();
        let stats = self.stats();
        let disk = published.as_deref().map_or(&[][..], |d| d.as_slice());
        let mut rows = vec![TenantDiskStats::default(); tenants.len()];
        for d in disk {
            let i = match tenants.iter().position(|t| t.name == d.name) {
                Some(i) => i,
                None if d.blocks == 0 && d.limit.is_none() && d.evictions == 0 && d.limit_refusals == 0 => continue,
                None => {
                    tenants.push(TenantStats { name: d.name.clone(), ..Default::default() });
                    rows.push(TenantDiskStats::default());
                    tenants.len() - 1
                }
            };
            rows[i] = TenantDiskStats {
                disk_bytes: d.bytes,
                disk_blocks: d.blocks,
                disk_limit_bytes: d.limit,
                disk_evictions: d.evictions,
                disk_limit_refusals: d.limit_refusals,
            };
        }
        drop(published);
        for (t, row) in tenants.iter_mut().zip(&rows) {
            put_rows(&mut t.tiers, row);
        }
        (stats, tenants)
    }
}

/// The disk tier's rows of `kachedb stats` (`kachedb serve --disk`,
/// docs/disk.md): all zero without `--disk`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiskStats {
    /// The daemon runs with a disk tier.
    pub disk_enabled: bool,
    /// Blocks on disk.
    pub disk_blocks: u64,
    /// File-system bytes the blocks on disk take.
    pub disk_bytes: u64,
    /// The bound on them (`--disk-size`).
    pub disk_capacity_bytes: u64,
    /// Blocks written (reported written: renamed into place, synced).
    pub disk_writes: u64,
    /// Tensor bytes of the blocks written.
    pub disk_write_bytes: u64,
    /// Committed blocks not written: the write-behind queue was full.
    pub disk_dropped_writes: u64,
    /// Tensor bytes queued or being written now.
    pub disk_queue_bytes: u64,
    /// Blocks queued or being written now.
    pub disk_queue_blocks: u64,
    /// Disk reads asked for (one per local-miss tail of a batch).
    pub disk_fetches: u64,
    /// Blocks filled from disk into the megaslab.
    pub disk_fills: u64,
    /// Tensor bytes of the blocks filled.
    pub disk_fill_bytes: u64,
    /// Keys asked for that are not on disk.
    pub disk_misses: u64,
    /// Blocks evicted from disk to make room.
    pub disk_evictions: u64,
    /// I/O errors (a write or read that failed: full, read-only, gone).
    pub disk_errors: u64,
    /// Block files found torn or corrupt (at start or at a fill; never
    /// served, deleted).
    pub disk_torn: u64,
    /// Blocks found whole at start.
    pub disk_recovered: u64,
    /// Of those, blocks found through the catalog (no header read at start).
    pub disk_catalogued: u64,
    /// Blocks deleted from disk because a client deleted their key
    /// (DELETE goes through to the disk).
    pub disk_deletes: u64,
    /// Disk fetches the serve loop stopped waiting for at
    /// `--disk-timeout-ms` (their keys were answered as misses).
    pub disk_fetches_timed_out: u64,
    /// Blocks read ahead along a chain into free megaslab space.
    pub disk_read_ahead: u64,
    /// Blocks read ahead into the page cache only (no free megaslab room).
    pub disk_read_ahead_cached: u64,
    /// The start-up index rebuild is done.
    pub disk_indexed: bool,
    /// Seconds the start-up index rebuild took.
    pub disk_index_s: f64,
    /// The tier's directory is no longer the one it opened (removed,
    /// moved or replaced under the daemon): the tier stopped, every key is a
    /// miss and nothing is written (docs/disk.md).
    pub disk_dir_lost: bool,
    /// DELETEs (and replacements) whose removal of the older copy on disk
    /// was not confirmed in time: answered `NOT_DURABLE`, retried.
    pub disk_unconfirmed_removals: u64,
    /// Removals of older copies made durable (a DELETE's, or a replaced
    /// key's, file unlinked and the directory synced) before the client's
    /// answer.
    pub disk_removals: u64,
    /// Mean time from a local miss to its disk fill landing, milliseconds
    /// (fetches that ended at the disk and filled something).
    pub disk_fill_ms_mean: f64,
}

impl DiskStats {
    /// The disk tier's rows of `s`.
    pub fn of(s: &Stats) -> DiskStats {
        rows_of(&s.tiers)
    }
}

/// The disk tier's columns of a tenant row of `kachedb stats`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantDiskStats {
    /// File-system bytes of its blocks on the disk tier (`--disk`; these
    /// add up to `disk_bytes` exactly).
    pub disk_bytes: u64,
    /// Its blocks on the disk tier (these add up to `disk_blocks`).
    pub disk_blocks: u64,
    /// Its limit on `disk_bytes` (`--tenant-disk-limit`, or its share by
    /// `--tenant-limit`); absent: none.
    pub disk_limit_bytes: Option<u64>,
    /// Its blocks evicted from disk (by its own writes or, for a tenant
    /// without a disk limit, by anyone's).
    pub disk_evictions: u64,
    /// Its blocks not written to disk because its own blocks there could not
    /// make room within its disk limit.
    pub disk_limit_refusals: u64,
}

impl TenantDiskStats {
    /// The disk tier's columns of tenant row `t`.
    pub fn of(t: &TenantStats) -> TenantDiskStats {
        rows_of(&t.tiers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use std::sync::Arc;

    #[test]
    fn a_scrape_carries_the_disk_families_once_the_tier_is_on() {
        let m = Metrics::new(4, 64);
        let cells = m.tier::<DiskCells>();
        assert!(!Metrics::render(&m.registry()).contains("kachedb_disk_"));
        cells.enabled.store(true, Relaxed);
        crate::tier::metrics::add(&cells.writes, 3);
        cells.fill.observe(150);
        *cells.tenants.lock().unwrap() = vec![TenantDisk { name: "a".into(), blocks: 2, ..Default::default() }];
        assert!(Arc::ptr_eq(&cells, &m.tier::<DiskCells>()), "one set of cells per daemon");
        let t = Metrics::render(&m.registry());
        assert!(t.contains("\nkachedb_disk_writes_total 3\n"), "{t}");
        assert!(t.contains("# TYPE kachedb_disk_queue_bytes gauge"), "{t}");
        assert!(t.contains("\nkachedb_tenant_disk_blocks{tenant=\"a\"} 2\n"), "{t}");
        assert!(!t.contains("kachedb_tenant_disk_limit_bytes{"), "no limit, no series: {t}");
        assert!(t.contains("kachedb_disk_fill_duration_seconds_bucket{le=\"0.00025\"} 1"), "{t}");
        assert!(t.contains("\nkachedb_disk_fill_duration_seconds_count 1\n"), "{t}");
        assert_eq!(cells.stats().disk_writes, 3);
    }
}
