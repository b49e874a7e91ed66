//! What `kachedb-bench scale` reports: each cost's name, column head and
//! chart panel, a row of figures, and how a figure is printed (shared by the
//! benchmark, its table and its chart).

use serde_json::{Map, Value as Json};

/// What each cost is called, in which unit and on which panel of the chart.
#[derive(Clone, Copy, Debug)]
pub struct Cost {
    /// The JSON key.
    pub key: &'static str,
    /// The table's column head.
    pub label: &'static str,
    /// The chart panel.
    pub panel: Panel,
}

/// The chart's panels (and the unit of the costs on each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Panel {
    /// Microseconds per request or per evicted block.
    Micros,
    /// Milliseconds.
    Millis,
    /// Bytes of RAM per block.
    BytesPerBlock,
}

/// Every cost the benchmark reports, in the table's order.
pub const COSTS: &[Cost] = &[
    Cost { key: "get_p50_us", label: "GET p50 µs", panel: Panel::Micros },
    Cost { key: "get_p99_us", label: "GET p99 µs", panel: Panel::Micros },
    Cost { key: "put_p50_us", label: "PUT p50 µs", panel: Panel::Micros },
    Cost { key: "put_p99_us", label: "PUT p99 µs", panel: Panel::Micros },
    Cost { key: "lookup_p50_us", label: "LOOKUP p50 µs", panel: Panel::Micros },
    Cost { key: "lookup_p99_us", label: "LOOKUP p99 µs", panel: Panel::Micros },
    Cost { key: "evict_us_per_block", label: "evicting PUT µs / evicted block", panel: Panel::Micros },
    Cost { key: "stats_p50_ms", label: "stats p50 ms", panel: Panel::Millis },
    Cost { key: "stats_p99_ms", label: "stats p99 ms", panel: Panel::Millis },
    Cost { key: "rss_bytes_per_block", label: "daemon RAM B / block", panel: Panel::BytesPerBlock },
    Cost { key: "takeover_ms", label: "takeover handover ms", panel: Panel::Millis },
    Cost { key: "takeover_stall_ms", label: "longest client GET in takeover ms", panel: Panel::Millis },
    Cost { key: "disk_index_bytes_per_block", label: "disk index RAM B / block", panel: Panel::BytesPerBlock },
    Cost { key: "restart_first_get_ms", label: "restart: first GET ms", panel: Panel::Millis },
    Cost { key: "restart_indexed_ms", label: "restart: all indexed ms", panel: Panel::Millis },
];

/// The figures at one count: `blocks` and the costs measured (keys of [`COSTS`]).
pub type Row = Map<String, Json>;

/// Three significant figures or so.
pub fn fmt_figure(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 0.01 {
        format!("{v:.2}")
    } else {
        format!("{v:.1e}")
    }
}
