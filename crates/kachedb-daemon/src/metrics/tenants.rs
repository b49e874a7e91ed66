//! The `kachedb_tenant_*` families: one series per tenant row in use (at
//! most `MAX_TENANTS`) by the `tenant` label, two for the by-op families.
//!
//! They are most of a scrape's text (at 64 tenants, 14 families of 64 series:
//! ~900 of ~1 000 lines), and most of them do not change from one scrape to
//! the next (idle tenants, limits, refusals, evictions without pressure). So
//! [`Text`] keeps each family's encoded text with the figures it shows and
//! encodes again, with `prometheus-client`'s encoder, only a family whose
//! figures or tenant names changed; the others are copied as they are. A
//! family's text is always encoded from the figures it is kept with, so a
//! cached text is exactly what encoding the current figures would give.

use super::{Metrics, TenantCells};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType::{self, Counter, Gauge};
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// The tenant rows' names, as the serve loop last copied them.
#[derive(Debug)]
pub(super) struct Names {
    /// Changes whenever a name does.
    pub(super) version: u64,
    /// The `tenant` label of each tenant row (empty: not in use).
    pub(super) names: Vec<String>,
}

/// What a family shows of a tenant row.
#[derive(Clone, Copy)]
enum Shows {
    /// One cell: one series per tenant.
    Cell(fn(&TenantCells) -> u64),
    /// The limit (`limit_plus_one`): a series only for a tenant that has one.
    Limit,
    /// Two cells: the series `op="get"` and `op="lookup"`.
    ByOp(fn(&TenantCells) -> [u64; 2]),
}

/// One `kachedb_tenant_*` family.
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    shows: Shows,
}

/// A [`Family`] in one line of [`FAMILIES`].
const fn family(name: &'static str, help: &'static str, kind: MetricType, shows: Shows) -> Family {
    Family { name, help, kind, shows }
}

/// Every per-tenant family, in the order they are written.
const FAMILIES: [Family; 14] = [
    family("tenant_clients", "Clients connected as this tenant now.", Gauge, Shows::Cell(|c| c.clients.get())),
    family("tenant_bytes", "Megaslab bytes in the tenant's extents: its blocks, deleted-but-pinned blocks and reservations (sums to kachedb_bytes_used).", Gauge, Shows::Cell(|c| c.bytes.get())),
    family("tenant_blocks", "The tenant's blocks that GET can find (sums to kachedb_blocks).", Gauge, Shows::Cell(|c| c.blocks.get())),
    family("tenant_reachable_bytes", "Extent bytes of the tenant's blocks whose chain is whole in the megaslab.", Gauge, Shows::Cell(|c| c.reachable_bytes.get())),
    family("tenant_orphaned_bytes", "Extent bytes of the tenant's blocks a block before them in their chain is missing for.", Gauge, Shows::Cell(|c| c.orphaned_bytes.get())),
    family("tenant_evictions", "The tenant's blocks evicted (sums to kachedb_evictions_total).", Counter, Shows::Cell(|c| c.evictions.get())),
    family("tenant_evicted_bytes", "Extent bytes of the tenant's blocks evicted.", Counter, Shows::Cell(|c| c.evicted_bytes.get())),
    family("tenant_stored_bytes", "Tensor bytes the tenant's clients committed.", Counter, Shows::Cell(|c| c.stored_bytes.get())),
    family("tenant_limit_refusals", "RESERVEs refused because they could not fit within the tenant's limit (nothing evicted).", Counter, Shows::Cell(|c| c.limit_refusals.get())),
    family("tenant_window_distinct_keys", "Distinct keys the tenant's clients asked for in the current request window (HyperLogLog estimate, ~1.6 % standard error).", Gauge, Shows::Cell(|c| c.window_distinct_keys.get())),
    family("tenant_window_key_requests", "Keys the tenant's clients asked for (GET, LOOKUP) in the current request window.", Gauge, Shows::Cell(|c| c.window_key_requests.get())),
    family("tenant_limit_bytes", "The tenant's limit on kachedb_tenant_bytes (--tenant-limit); absent without one.", Gauge, Shows::Limit),
    family("tenant_hit_blocks", "Keys the tenant's clients found, by op (sums to kachedb_hit_blocks_total).", Counter, Shows::ByOp(|c| [c.get_hits.get(), c.lookup_hits.get()])),
    family("tenant_miss_blocks", "Keys the tenant's clients did not find, by op (sums to kachedb_miss_blocks_total).", Counter, Shows::ByOp(|c| [c.get_misses.get(), c.lookup_misses.get()])),
];

impl Family {
    /// Appends this family's figures of each row in `rows` to `into`.
    fn load(&self, cells: &[TenantCells], rows: &[usize], into: &mut Vec<u64>) {
        for c in rows.iter().filter_map(|&t| cells.get(t)) {
            match self.shows {
                Shows::Cell(pick) => into.push(pick(c)),
                Shows::Limit => into.push(c.limit_plus_one.get()),
                Shows::ByOp(pick) => into.extend(pick(c)),
            }
        }
    }

    /// Writes this family: `tenants[i]`'s series from its figures in
    /// `figures` (as [`Family::load`] put them).
    fn encode(&self, enc: &mut DescriptorEncoder, tenants: &[String], figures: &[u64]) -> std::fmt::Result {
        let mut e = enc.encode_descriptor(self.name, self.help, None, self.kind)?;
        let per_tenant = if matches!(self.shows, Shows::ByOp(_)) { 2 } else { 1 };
        for (tenant, v) in tenants.iter().zip(figures.chunks_exact(per_tenant)) {
            let tenant = tenant.as_str();
            match self.shows {
                Shows::Cell(_) => value(e.encode_family(&[("tenant", tenant)])?, self.kind, v[0])?,
                Shows::Limit if v[0] == 0 => {}
                Shows::Limit => value(e.encode_family(&[("tenant", tenant)])?, self.kind, v[0] - 1)?,
                Shows::ByOp(_) => {
                    for (op, &v) in ["get", "lookup"].into_iter().zip(v) {
                        value(e.encode_family(&[("tenant", tenant), ("op", op)])?, self.kind, v)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Writes `v` as a counter or a gauge.
fn value(e: prometheus_client::encoding::MetricEncoder, kind: MetricType, v: u64) -> std::fmt::Result {
    match kind {
        Counter => ConstCounter::new(v).encode(e),
        _ => ConstGauge::new(v as i64).encode(e),
    }
}

/// The rows in use and their names (the `tenant` label values), in row order.
fn rows_in_use(names: &Names) -> (Vec<usize>, Arc<[String]>) {
    let (rows, tenants): (Vec<usize>, Vec<String>) =
        names.names.iter().enumerate().filter(|(_, n)| !n.is_empty()).map(|(t, n)| (t, n.clone())).unzip();
    (rows, tenants.into())
}

/// The [`Collector`] of every per-tenant family, encoding the current figures
/// (`Metrics::registry`).
#[derive(Debug)]
pub(super) struct Live(pub(super) Arc<Metrics>);

impl Collector for Live {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let m = &*self.0;
        let (rows, tenants) = match m.tenant_names.lock() {
            Ok(n) => rows_in_use(&n),
            Err(_) => return Ok(()),
        };
        let mut figures = Vec::new();
        for f in &FAMILIES {
            figures.clear();
            f.load(&m.serve.tenants, &rows, &mut figures);
            f.encode(&mut enc, &tenants, &figures)?;
        }
        Ok(())
    }
}

/// The [`Collector`] of one family from figures loaded before.
#[derive(Debug)]
struct Loaded {
    family: usize,
    tenants: Arc<[String]>,
    figures: Vec<u64>,
}

impl Collector for Loaded {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        FAMILIES[self.family].encode(&mut enc, &self.tenants, &self.figures)
    }
}

/// A family's text as last encoded, and the figures it was encoded from.
#[derive(Debug, Default)]
struct Kept {
    figures: Vec<u64>,
    text: String,
}

/// The per-tenant families' texts as last encoded (see the module's doc).
#[derive(Debug, Default)]
pub(super) struct Text {
    /// The [`Names::version`] `rows` and `tenants` are of; `None` before the
    /// first scrape (every `kept` is then empty).
    version: Option<u64>,
    rows: Vec<usize>,
    tenants: Arc<[String]>,
    /// By family, as in [`FAMILIES`].
    kept: Vec<Kept>,
    /// The figures being loaded.
    now: Vec<u64>,
}

impl Text {
    /// Appends every per-tenant family of `m`, as of now, to `out`.
    pub(super) fn write(&mut self, m: &Metrics, out: &mut String) {
        let Ok(names) = m.tenant_names.lock() else { return };
        let renamed = self.version != Some(names.version);
        if renamed {
            (self.rows, self.tenants) = rows_in_use(&names);
            self.version = Some(names.version);
        }
        drop(names);
        self.kept.resize_with(FAMILIES.len(), Kept::default);
        for (i, (f, kept)) in FAMILIES.iter().zip(&mut self.kept).enumerate() {
            self.now.clear();
            f.load(&m.serve.tenants, &self.rows, &mut self.now);
            if renamed || kept.text.is_empty() || kept.figures != self.now {
                std::mem::swap(&mut kept.figures, &mut self.now);
                let mut r = Registry::with_prefix("kachedb");
                let (tenants, figures) = (self.tenants.clone(), kept.figures.clone());
                r.register_collector(Box::new(Loaded { family: i, tenants, figures }));
                kept.text.clear();
                // Writing to a String cannot fail (see `Metrics::render`).
                let _ = prometheus_client::encoding::prometheus_text::encode(&mut kept.text, &r);
            }
            out.push_str(&kept.text);
        }
    }
}
