//! What a tier counts and how it shows it: each tier keeps its counters in
//! its own cells (a type of its module implementing [`TierMetrics`]), gets
//! them from [`Metrics::tier`](crate::metrics::Metrics::tier) (one per kind
//! of tier and daemon, so a tier that resumes after a failed takeover counts
//! on), and describes them as [`Family`]s: name (without the `kachedb_`
//! prefix), help, kind and values by label. `crate::metrics` encodes them
//! with the daemon's other families and names no tier.
//!
//! Writers are the tier's threads and the serve loop, with `fetch_add`,
//! `fetch_sub` and `store` (several writers; a slow path: a few per block
//! written or filled). Relaxed: each value is read for itself, nothing else
//! is published through it.

use kachedb_shm::control::TierRows;
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Whether a family counts up or goes up and down (or is a histogram).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (`_total` is added to its name).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Buckets, sum and count ([`Values::Histogram`]).
    Histogram,
}

/// A family's values.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// One value, no labels.
    One(u64),
    /// One value per label set (no series at all: the family is still
    /// described).
    Labelled(Vec<(Vec<(&'static str, String)>, u64)>),
    /// A histogram without labels: the sum, the count, and `(upper bound,
    /// count in this bucket)` (not cumulative; the last bound is `+Inf`).
    Histogram {
        /// Sum of the observations.
        sum: f64,
        /// Number of observations.
        count: u64,
        /// Per bucket.
        buckets: Vec<(f64, u64)>,
    },
}

/// One metric family a tier exports.
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    /// Name without the `kachedb_` prefix (and without `_total`).
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// Its values.
    pub values: Values,
}

/// A tier's cells, as the daemon's metrics hold them.
pub trait TierMetrics: Send + Sync + std::fmt::Debug + Any {
    /// Appends the tier's families to `out` (none while the tier is off).
    fn families(&self, out: &mut Vec<Family>);

    /// Writes the tier's figures into `kachedb stats`' answer: its rows
    /// (`into.tiers`, [`put_rows`]), and its columns of the tenant rows
    /// (`into.tenants` holds the megaslab's rows when this is called). A
    /// tier that is off writes them too, as zeros, so that the answer
    /// always has the same keys.
    fn fill_stats(&self, into: &mut kachedb_shm::control::Stats);
}

/// Adds the fields of `section` (a struct of a tier's rows, each field named
/// `<tier>_<figure>`) to `into`, as the stats object carries them.
pub fn put_rows<T: serde::Serialize>(into: &mut TierRows, section: &T) {
    // A struct of plain fields always serialises to an object.
    if let Ok(serde_json::Value::Object(m)) = serde_json::to_value(section) {
        into.extend(m);
    }
}

/// A tier's section as its own struct, read from `rows`: the fields not
/// there at their defaults (a daemon of another version may carry other
/// rows); all of them, if the rows do not read as `T`.
pub fn rows_of<T: serde::de::DeserializeOwned + Default>(rows: &TierRows) -> T {
    let picked = serde_json::Map::from_iter(rows.iter().map(|(k, v)| (k.clone(), v.clone())));
    serde_json::from_value(serde_json::Value::Object(picked)).unwrap_or_default()
}

/// A row of a tier's table of single-valued families: name, help, kind and
/// the cell it reads. A tier lists its counters once, in such a table.
pub type Row<C> = (&'static str, &'static str, Kind, fn(&C) -> &AtomicU64);

/// Appends one family per row of `rows`, read from `cells`.
pub fn rows<C>(cells: &C, rows: &[Row<C>], out: &mut Vec<Family>) {
    for &(name, help, kind, cell) in rows {
        out.push(Family { name, help, kind, values: Values::One(cell(cells).load(Relaxed)) });
    }
}

/// Adds `n` to `c` (relaxed: see the module's notes).
#[inline]
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

/// Subtracts `n` from `c`, stopping at 0 (a gauge a reset may have zeroed
/// under an in-flight job).
#[inline]
pub fn sub(c: &AtomicU64, n: u64) {
    // Relaxed: see the module's notes; a lost race leaves the gauge off by
    // one job until the next reset, never wrapped.
    let _ = c.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(n)));
}

/// Upper bounds of the fill latency buckets, microseconds (a 64 KiB block
/// from a local disk or cluster takes ~0.2 ms, a 64 MiB one ~150 ms).
const FILL_BOUNDS_US: [u64; 12] =
    [100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000];

/// The time from a local miss to a tier's fill landing in the megaslab, per
/// fetch (written by the serve loop, [`Tier::filled_after`](super::Tier::filled_after)).
#[derive(Debug, Default)]
pub struct FillLatency {
    /// Per bucket of [`FILL_BOUNDS_US`], the last one `+Inf`.
    buckets: [AtomicU64; FILL_BOUNDS_US.len() + 1],
    /// Sum, microseconds.
    sum_us: AtomicU64,
    /// Longest, microseconds.
    max_us: AtomicU64,
}

impl FillLatency {
    /// Records one fill that took `us` microseconds.
    pub fn observe(&self, us: u64) {
        // Prometheus buckets are `le`: the first bound >= value.
        let i = FILL_BOUNDS_US.partition_point(|&b| b < us);
        add(&self.buckets[i], 1);
        add(&self.sum_us, us);
        self.max_us.fetch_max(us, Relaxed);
    }

    /// `(sum in seconds, count, buckets)`; the count is the sum of the
    /// buckets as loaded, so it always equals the `+Inf` bucket.
    fn load(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let buckets =
            FILL_BOUNDS_US.iter().map(|&b| b as f64 / 1e6).chain([f64::INFINITY]).zip(counts.iter().copied()).collect();
        (self.sum_us.load(Relaxed) as f64 / 1e6, counts.iter().sum(), buckets)
    }

    /// The mean fill time, milliseconds (0 before the first).
    pub fn mean_ms(&self) -> f64 {
        let (sum_s, count, _) = self.load();
        if count == 0 {
            0.0
        } else {
            sum_s * 1e3 / count as f64
        }
    }

    /// The longest fill time, milliseconds.
    pub fn max_ms(&self) -> f64 {
        self.max_us.load(Relaxed) as f64 / 1e3
    }

    /// The histogram as family `name`.
    pub fn family(&self, name: &'static str, help: &'static str) -> Family {
        let (sum, count, buckets) = self.load();
        Family { name, help, kind: Kind::Histogram, values: Values::Histogram { sum, count, buckets } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_latency_buckets_are_le_and_count_their_sum() {
        let f = FillLatency::default();
        for us in [100, 101, 2_000_000] {
            f.observe(us);
        }
        let (sum, count, b) = f.load();
        assert_eq!(count, 3);
        assert!((sum - 2.000201).abs() < 1e-9, "{sum}");
        assert_eq!((b[0].1, b[1].1, b.last().unwrap().1), (1, 1, 1));
        assert_eq!(f.max_ms(), 2000.0);
        assert!((f.mean_ms() - 2000.201 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn sub_stops_at_zero() {
        let c = AtomicU64::new(2);
        sub(&c, 5);
        assert_eq!(c.load(Relaxed), 0);
    }
}
