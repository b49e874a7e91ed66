//! The disk tier's lines of `kachedb stats` and of its watch view.

use super::cells::{DiskStats, TenantDiskStats};
use crate::tier::view::{bar, grouped, tenants_shown, Sample, TENANT_ROWS};
use kachedb_shm::units::human_bytes;
use kachedb_shm::Stats;

/// `kachedb stats`: the tenants' rows on disk (once there are several, or
/// a disk limit), then the tier's figures; nothing without the tier.
pub fn stats_lines(s: &Stats) -> Vec<String> {
    let d = DiskStats::of(s);
    if !d.disk_enabled {
        return Vec::new();
    }
    let mut lines = Vec::new();
    let tenants: Vec<(&str, TenantDiskStats)> =
        s.tenants.iter().map(|t| (t.name.as_str(), TenantDiskStats::of(t))).collect();
    if tenants.len() > 1 || tenants.iter().any(|(_, t)| t.disk_limit_bytes.is_some()) {
        lines.push(format!(
            "{:<20} {:>10} {:>10} {:>9} {:>9} {:>9}",
            "tenant on disk", "bytes", "limit", "blocks", "evicted", "refused"
        ));
        for (name, t) in tenants.iter().filter(|(_, t)| t.disk_blocks > 0 || t.disk_limit_bytes.is_some()) {
            lines.push(format!(
                "{:<20} {:>10} {:>10} {:>9} {:>9} {:>9}",
                name,
                human_bytes(t.disk_bytes),
                t.disk_limit_bytes.map_or("-".into(), human_bytes),
                t.disk_blocks,
                t.disk_evictions,
                t.disk_limit_refusals
            ));
        }
    }
    lines.extend([
        format!(
            "disk              {} block(s), {} of {}; {} evicted; {} recovered at start{}",
            d.disk_blocks,
            human_bytes(d.disk_bytes),
            human_bytes(d.disk_capacity_bytes),
            d.disk_evictions,
            d.disk_recovered,
            if d.disk_indexed { format!(" (indexed in {:.3} s)", d.disk_index_s) } else { " (indexing)".into() }
        ),
        format!(
            "disk writes       {} ({}), {} dropped, queue {} in {} block(s)",
            d.disk_writes,
            human_bytes(d.disk_write_bytes),
            d.disk_dropped_writes,
            human_bytes(d.disk_queue_bytes),
            d.disk_queue_blocks
        ),
        format!(
            "disk fills        {} ({}) from {} fetch(es), {} miss(es), {} timed out; mean {:.2} ms",
            d.disk_fills,
            human_bytes(d.disk_fill_bytes),
            d.disk_fetches,
            d.disk_misses,
            d.disk_fetches_timed_out,
            d.disk_fill_ms_mean
        ),
        format!(
            "disk errors       {} I/O error(s), {} torn or corrupt (refused, deleted); {} deleted by clients",
            d.disk_errors, d.disk_torn, d.disk_deletes
        ),
    ]);
    lines
}

/// `kachedb stats --watch`: how full the disk is, its rates, and the
/// tenants' rows on disk; nothing without the tier.
pub fn watch_lines(s: &Stats, prev: Option<(f64, &Stats)>) -> Vec<String> {
    let d = DiskStats::of(s);
    if !d.disk_enabled {
        return Vec::new();
    }
    let sample = Sample { now: s, prev };
    let on_disk = d.disk_bytes as f64 / d.disk_capacity_bytes.max(1) as f64;
    let mut lines = vec![
        String::new(),
        format!(
            "disk    {} {:>5.1}%  {} / {}",
            bar(on_disk, 36),
            on_disk * 100.0,
            human_bytes(d.disk_bytes),
            human_bytes(d.disk_capacity_bytes)
        ),
        format!(
            "        {} blocks, queue {} blocks ({}), torn {}{}",
            grouped(d.disk_blocks),
            grouped(d.disk_queue_blocks),
            human_bytes(d.disk_queue_bytes),
            grouped(d.disk_torn),
            if d.disk_indexed { String::new() } else { ", indexing".into() }
        ),
        sample.row(
            "disk writes",
            |s| DiskStats::of(s).disk_writes,
            format!("{} dropped", grouped(d.disk_dropped_writes)),
        ),
        sample.row("disk fills", |s| DiskStats::of(s).disk_fills, format!("{} misses", grouped(d.disk_misses))),
        sample.row(
            "disk errors",
            |s| DiskStats::of(s).disk_errors,
            format!("{} timed out", grouped(d.disk_fetches_timed_out)),
        ),
    ];
    lines.extend(tenant_lines(s, prev));
    lines
}

/// The tenants' rows on the disk tier, under the same terms as the watch
/// view's tenants' table: the largest [`TENANT_ROWS`] by disk bytes, with
/// their disk limits, blocks, evictions from disk a second and the writes
/// refused for their disk limit (all time).
fn tenant_lines(s: &Stats, prev: Option<(f64, &Stats)>) -> Vec<String> {
    if !tenants_shown(s, |t| TenantDiskStats::of(t).disk_limit_bytes.is_some()) {
        return Vec::new();
    }
    let mut ts: Vec<(&str, TenantDiskStats)> =
        s.tenants.iter().map(|t| (t.name.as_str(), TenantDiskStats::of(t))).collect();
    ts.sort_by(|(an, a), (bn, b)| b.disk_bytes.cmp(&a.disk_bytes).then_with(|| an.cmp(bn)));
    let mut lines = vec![
        String::new(),
        format!(
            "{:<16}{:>22}{:>10}{:>14}{:>18}",
            "tenant on disk", "bytes / limit", "blocks", "evicted/s", "refused (limit)"
        ),
    ];
    for (name, t) in ts.iter().take(TENANT_ROWS) {
        let before = prev.and_then(|(dt, p)| p.tenants.iter().find(|x| x.name == *name).map(|x| (dt, x)));
        let evicted = match before {
            Some((dt, p)) if dt > 0.0 => grouped(
                (t.disk_evictions.saturating_sub(TenantDiskStats::of(p).disk_evictions) as f64 / dt).round() as u64,
            ),
            _ => "-".into(),
        };
        lines.push(format!(
            "{:<16}{:>22}{:>10}{:>14}{:>18}",
            name,
            format!("{} / {}", human_bytes(t.disk_bytes), t.disk_limit_bytes.map_or("-".into(), human_bytes)),
            grouped(t.disk_blocks),
            evicted,
            grouped(t.disk_limit_refusals)
        ));
    }
    if ts.len() > TENANT_ROWS {
        lines.push(format!("({} more tenants: kachedb stats)", ts.len() - TENANT_ROWS));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::metrics::put_rows;
    use kachedb_shm::control::TenantStats;

    /// Stats carrying the disk tier's rows `d` and one default tenant.
    fn with(d: &DiskStats) -> Stats {
        let mut s =
            Stats { tenants: vec![TenantStats { name: "default".into(), ..Default::default() }], ..Default::default() };
        put_rows(&mut s.tiers, d);
        s
    }

    #[test]
    fn nothing_while_the_tier_is_off() {
        let s = with(&DiskStats::default());
        assert!(stats_lines(&s).is_empty() && watch_lines(&s, None).is_empty());
    }

    #[test]
    fn watch_rows_with_rates_and_tenants() {
        let mut d = DiskStats {
            disk_enabled: true,
            disk_capacity_bytes: 1 << 40,
            disk_bytes: 1 << 39,
            disk_blocks: 1_000_000,
            disk_queue_blocks: 12,
            ..Default::default()
        };
        let a = with(&d);
        (d.disk_writes, d.disk_fills, d.disk_errors, d.disk_torn) = (600, 200, 3, 1);
        let b = with(&d);
        let lines = watch_lines(&b, Some((2.0, &a)));
        for l in &lines {
            assert!(l.chars().count() <= 80, "{} columns: {l}", l.chars().count());
        }
        let find = |p: &str| lines.iter().find(|l| l.starts_with(p)).unwrap_or_else(|| panic!("no {p} in {lines:?}"));
        assert!(find("disk    [").contains("50.0%"));
        assert!(
            find("        1,000,000 blocks").contains("queue 12 blocks")
                && find("        1,000,000").contains("torn 1")
        );
        // 600 writes in 2 s: 300 a second.
        assert!(find("disk writes").contains(" 300 "), "{}", find("disk writes"));
        assert!(find("disk fills").contains(" 100 "));
        assert!(find("disk errors").contains('3'));
        // One default tenant: no per-tenant disk rows.
        assert!(!lines.iter().any(|l| l.starts_with("tenant on disk")), "{lines:?}");

        // Two tenants: a row each on disk, the largest first, with the rate of
        // evictions from disk between the two samples.
        let tenant = |name: &str, disk_bytes: u64, disk_limit: Option<u64>, evictions: u64, refused: u64| {
            let mut t = TenantStats { name: name.into(), ..Default::default() };
            let row = TenantDiskStats {
                disk_bytes,
                disk_blocks: disk_bytes >> 20,
                disk_limit_bytes: disk_limit,
                disk_evictions: evictions,
                disk_limit_refusals: refused,
            };
            put_rows(&mut t.tiers, &row);
            t
        };
        let mut a = with(&d);
        a.tenants = vec![tenant("default", 1 << 30, None, 0, 0), tenant("team-a", 3 << 30, Some(4 << 30), 10, 0)];
        let mut c = a.clone();
        c.tenants[1] = tenant("team-a", 3 << 30, Some(4 << 30), 30, 7);
        let lines = watch_lines(&c, Some((2.0, &a)));
        let header = lines.iter().position(|l| l.starts_with("tenant on disk")).expect("a disk tenant table");
        let (first, second) = (&lines[header + 1], &lines[header + 2]);
        assert!(first.starts_with("team-a") && first.contains("3.0 GiB / 4.0 GiB"), "{lines:?}");
        assert!(first.contains("3,072") && first.contains(" 10 ") && first.ends_with(" 7"), "{first}");
        assert!(second.starts_with("default") && second.contains("1.0 GiB / -"), "{second}");
        assert!(lines.iter().all(|l| l.chars().count() <= 80), "{lines:?}");

        // `kachedb stats`: the tenants on disk, then the tier's lines.
        let text = stats_lines(&c);
        assert!(text[0].starts_with("tenant on disk") && text[1].starts_with("default"), "{text:?}");
        assert!(text.iter().any(|l| l.starts_with("disk writes       600 ")), "{text:?}");
    }
}
