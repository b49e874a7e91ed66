//! The shapes of the lines of `kachedb stats --watch` (and the number
//! formats of `kachedb stats`): the CLI's own lines and each tier's
//! ([`TierKind::watch_lines`](crate::tier_kind::TierKind::watch_lines)) are
//! made with these, so that they line up.

use kachedb_shm::control::TenantStats;
use kachedb_shm::Stats;

/// Most tenant rows a table of the watch view shows (the largest).
pub const TENANT_ROWS: usize = 8;

/// `1234567` -> `1,234,567`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// `part` of `whole` as a percentage with one decimal; `-` when `whole` is 0.
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}%", part as f64 * 100.0 / whole as f64)
    }
}

/// A bar of `width` cells, `frac` of them filled.
pub fn bar(frac: f64, width: usize) -> String {
    let filled = ((frac.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled))
}

/// Whether the watch view shows tenants' tables: a tenant other than
/// `default` exists, or a limit is set (on the megaslab, or one that
/// `limited` finds).
pub fn tenants_shown(s: &Stats, limited: impl Fn(&TenantStats) -> bool) -> bool {
    s.tenants.len() > 1 || s.tenants.iter().any(|t| t.limit_bytes.is_some() || limited(t))
}

/// A sample of the stats and the one before it (rates need two: the first
/// frame shows `-`).
#[derive(Clone, Copy, Debug)]
pub struct Sample<'a> {
    /// This sample.
    pub now: &'a Stats,
    /// Seconds since the sample before, and that sample.
    pub prev: Option<(f64, &'a Stats)>,
}

impl Sample<'_> {
    /// How fast `f` grew between the two samples, per second, grouped; `-`
    /// without a sample before.
    pub fn rate(&self, f: impl Fn(&Stats) -> u64) -> String {
        match self.prev {
            Some((dt, p)) if dt > 0.0 => grouped((f(self.now).saturating_sub(f(p)) as f64 / dt).round() as u64),
            _ => "-".into(),
        }
    }

    /// A row of the rates table: `name`, the rate of `f`, its total, and
    /// `extra` after them.
    pub fn row(&self, name: &str, f: impl Fn(&Stats) -> u64, extra: String) -> String {
        format!("{name:<16}{:>12}{:>16}  {extra}", self.rate(&f), grouped(f(self.now)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(1_234_567), "1,234,567");
        assert_eq!(bar(0.5, 4), "[##--]");
        assert_eq!(bar(2.0, 2), "[##]");
        assert_eq!(percent(1, 0), "-");
        assert_eq!(percent(1, 3), "33.3%");
        let (a, mut b) = (Stats::default(), Stats::default());
        b.serve.ops = 600;
        assert_eq!(Sample { now: &b, prev: Some((2.0, &a)) }.rate(|s| s.serve.ops), "300");
        assert_eq!(Sample { now: &b, prev: None }.rate(|s| s.serve.ops), "-");
    }
}
