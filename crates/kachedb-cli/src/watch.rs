//! `kachedb stats --watch [SECS]`: a live view of a daemon's stats — rates per
//! second, hit ratios, a memory bar — redrawn in place, at most
//! [`WIDTH`] columns wide. Ctrl-C (or SIGTERM) ends it and gives the cursor
//! back. With `--json`, one stats object per line per interval instead.
//!
//! It asks the control socket (`{"op":"stats"}`), so it needs no
//! `--metrics-addr`; when the daemon goes away the view says so and keeps
//! trying.

use kachedb_daemon::tier::view::{bar, grouped, percent, tenants_shown, Sample, TENANT_ROWS};
use kachedb_shm::units::human_bytes;
use kachedb_shm::Stats;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Columns the view fits in.
pub const WIDTH: usize = 80;

/// Watches until SIGINT/SIGTERM; `every` between samples.
pub fn run(
    opts: &kachedb_client::ConnectOptions,
    every: Duration,
    json: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let mut out = std::io::stdout().lock();
    let tty = out.is_terminal() && !json;
    if tty {
        // Hide the cursor and clear the screen once; each frame then redraws in place.
        write!(out, "\x1b[?25l\x1b[H\x1b[2J")?;
    }
    let mut prev: Option<(Instant, Stats)> = None;
    let result = loop {
        let sample = kachedb_client::daemon_stats(opts);
        let now = Instant::now();
        let written = match (&sample, json) {
            (Ok(s), true) => writeln!(out, "{}", s.to_json()),
            (Err(e), true) => {
                eprintln!("kachedb: stats: {e}");
                Ok(())
            }
            (_, false) => {
                let lines = match &sample {
                    Ok(s) => render(s, prev.as_ref().map(|(t, p)| (now.duration_since(*t).as_secs_f64(), p)), every),
                    Err(e) => unreachable_lines(&opts.socket_path().display().to_string(), &e.to_string()),
                };
                draw(&mut out, &lines, tty)
            }
        };
        if let Err(e) = written.and_then(|()| out.flush()) {
            // stdout closed (a pipe whose reader left): nothing more to show.
            break if e.kind() == std::io::ErrorKind::BrokenPipe { Ok(()) } else { Err(e.into()) };
        }
        if let Ok(s) = sample {
            prev = Some((now, s));
        }
        let until = now + every;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50).min(until.saturating_duration_since(Instant::now())));
        }
        if stop.load(Ordering::Relaxed) {
            break Ok(());
        }
    };
    if tty {
        let _ = write!(out, "\x1b[?25h");
        let _ = out.flush();
    }
    result
}

/// Redraws in place on a terminal (each line cleared to its end, then
/// everything below); elsewhere appends the frame and a blank line.
fn draw(out: &mut impl Write, lines: &[String], tty: bool) -> std::io::Result<()> {
    if tty {
        write!(out, "\x1b[H")?;
        for l in lines {
            write!(out, "{l}\x1b[K\r\n")?;
        }
        write!(out, "\x1b[J")
    } else {
        for l in lines {
            writeln!(out, "{l}")?;
        }
        writeln!(out)
    }
}

fn unreachable_lines(socket: &str, why: &str) -> Vec<String> {
    fit(vec![
        format!("kachedb  {}  UTC {}", socket, clock()),
        String::new(),
        "daemon not reachable (retrying; Ctrl-C to quit):".into(),
        why.to_string(),
    ])
}

/// Cuts every line to [`WIDTH`] characters.
fn fit(lines: Vec<String>) -> Vec<String> {
    lines
        .into_iter()
        .map(|l| if l.chars().count() > WIDTH { l.chars().take(WIDTH - 1).chain(['…']).collect() } else { l })
        .collect()
}

/// `HH:MM:SS` of now, UTC.
fn clock() -> String {
    let s = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

fn duration(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h{:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d{:02}h", s / 86_400, s / 3600 % 24),
    }
}

/// The view of `s`; `prev` is the sample before and the seconds between them
/// (rates need two samples: the first frame shows `-`).
pub fn render(s: &Stats, prev: Option<(f64, &Stats)>, every: Duration) -> Vec<String> {
    let (st, sv) = (&s.store, &s.serve);
    let sample = Sample { now: s, prev };
    let delta = |f: fn(&Stats) -> u64| prev.map(|(_, p)| f(s).saturating_sub(f(p)));
    let ratio = |hits: fn(&Stats) -> u64, all: fn(&Stats) -> u64| {
        let now = match (delta(hits), delta(all)) {
            (Some(h), Some(a)) => percent(h, a),
            _ => "-".into(),
        };
        format!("hit {now:>6}  (all {:>6})", percent(hits(s), all(s)))
    };
    let used = st.bytes_used as f64 / st.bytes_total.max(1) as f64;
    let row = |name: &str, f: fn(&Stats) -> u64, extra: String| sample.row(name, f, extra);
    let mut lines = vec![
        format!(
            "kachedb  pid {}  up {}  {} client(s)  every {}s  UTC {}",
            s.daemon_pid,
            duration(s.uptime_s),
            sv.clients_connected,
            every.as_secs_f64(),
            clock()
        ),
        format!("socket  {}", if s.socket.is_empty() { "-" } else { &s.socket }),
        String::new(),
        format!(
            "memory  {} {:>5.1}%  {} / {}",
            bar(used, 36),
            used * 100.0,
            human_bytes(st.bytes_used),
            human_bytes(st.bytes_total)
        ),
        format!(
            "        free {} (largest extent {}), evictable {}",
            human_bytes(st.bytes_free),
            human_bytes(st.largest_free_bytes),
            human_bytes(st.evictable_bytes)
        ),
        format!(
            "blocks  {}   pins {}   reservations {}   channels {} / {}",
            grouped(st.blocks),
            grouped(st.pins),
            grouped(st.reserved),
            sv.clients_connected,
            s.channels
        ),
        String::new(),
        format!("{:<16}{:>12}{:>16}", "", "per second", "total"),
        row("ops", |s| s.serve.ops, String::new()),
        row("GET", |s| s.store.gets, ratio(|s| s.store.get_hits, |s| s.store.gets)),
        row("LOOKUP", |s| s.store.lookups, ratio(|s| s.store.lookup_hits, |s| s.store.lookups)),
        row("PUT (commit)", |s| s.store.commits, String::new()),
        row("DELETE", |s| s.store.deletes, String::new()),
        row("evictions", |s| s.store.evictions, format!("{} evicted", human_bytes(st.evicted_bytes))),
        row("rejected frames", |s| s.serve.rejected_frames, String::new()),
        row("clients kicked", |s| s.serve.clients_kicked, String::new()),
    ];
    lines.push(format!(
        "reuse   reachable {}  orphaned {}  hit ceiling {}  working set {}",
        human_bytes(st.reachable_bytes),
        human_bytes(st.orphaned_bytes),
        if st.window_key_requests == 0 { "-".into() } else { format!("{:.1}%", st.hit_ratio_ceiling * 100.0) },
        human_bytes(st.working_set_bytes),
    ));
    lines.extend(tenant_lines(s, prev));
    for kind in kachedb_daemon::TIERS {
        lines.extend(kind.watch_lines(s, prev));
    }
    lines.extend([String::new(), "Ctrl-C to quit".into()]);
    fit(lines)
}

/// The tenants' table: shown once a tenant other than `default` exists or a
/// limit is set ([`several_tenants`]); the largest [`TENANT_ROWS`] by bytes.
fn tenant_lines(s: &Stats, prev: Option<(f64, &Stats)>) -> Vec<String> {
    if !several_tenants(s) {
        return Vec::new();
    }
    let mut ts: Vec<&kachedb_shm::control::TenantStats> = s.tenants.iter().collect();
    ts.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    let mut lines = vec![
        String::new(),
        format!(
            "{:<16}{:>22}{:>10}{:>9}{:>14}{:>9}",
            "tenant", "bytes / limit", "blocks", "clients", "evicted/s", "GET hit"
        ),
    ];
    for t in ts.iter().take(TENANT_ROWS) {
        let before = prev.and_then(|(dt, p)| p.tenants.iter().find(|x| x.name == t.name).map(|x| (dt, x)));
        let evicted = match before {
            Some((dt, p)) if dt > 0.0 => grouped((t.evictions.saturating_sub(p.evictions) as f64 / dt).round() as u64),
            _ => "-".into(),
        };
        let limit = t.limit_bytes.map_or("-".into(), human_bytes);
        lines.push(format!(
            "{:<16}{:>22}{:>10}{:>9}{:>14}{:>9}",
            t.name,
            format!("{} / {}", human_bytes(t.bytes), limit),
            grouped(t.blocks),
            t.clients,
            evicted,
            percent(t.get_hits, t.get_hits + t.get_misses)
        ));
    }
    if ts.len() > TENANT_ROWS {
        lines.push(format!("({} more tenants: kachedb stats)", ts.len() - TENANT_ROWS));
    }
    lines
}

/// Whether the tenants' tables are shown: a tenant other than `default`
/// exists, or a limit (on the megaslab or a tier) is set.
fn several_tenants(s: &Stats) -> bool {
    tenants_shown(s, |t| kachedb_daemon::TIERS.iter().any(|k| k.tenant_limited(t)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(gets: u64, hits: u64, ops: u64) -> Stats {
        let mut s = Stats {
            daemon_pid: 4242,
            uptime_s: 3725.0,
            channels: 64,
            socket: "/run/user/1000/kachedb/kachedb_0.sock".into(),
            ..Stats::default()
        };
        s.store.gets = gets;
        s.store.get_hits = hits;
        s.store.bytes_total = 4 << 30;
        s.store.bytes_used = 3 << 30;
        s.store.blocks = 123_456;
        s.serve.ops = ops;
        s.serve.clients_connected = 3;
        s
    }

    #[test]
    fn fits_eighty_columns_with_rates_and_ratios() {
        let (a, b) = (sample(1000, 900, 5000), sample(3000, 2800, 9000));
        let first = render(&a, None, Duration::from_secs(1));
        let next = render(&b, Some((2.0, &a)), Duration::from_secs(1));
        for l in first.iter().chain(&next) {
            assert!(l.chars().count() <= WIDTH, "{} columns: {l}", l.chars().count());
        }
        let get = next.iter().find(|l| l.starts_with("GET")).unwrap();
        // 2000 GETs in 2 s; 1900 of them hits (95%); all-time 2800/3000.
        assert!(get.contains(" 1,000 ") && get.contains("3,000"), "{get}");
        assert!(get.contains("95.0%") && get.contains("93.3%"), "{get}");
        assert!(first.iter().any(|l| l.starts_with("GET") && l.contains(" - ")), "{first:?}");
        let mem = next.iter().find(|l| l.starts_with("memory")).unwrap();
        assert!(mem.contains("75.0%") && mem.contains("[###"), "{mem}");
        // A very long socket path is cut, not wrapped.
        let mut long = b.clone();
        long.socket = "/x".repeat(100);
        assert!(render(&long, None, Duration::from_secs(1)).iter().all(|l| l.chars().count() <= WIDTH));
        // No tier on: no tier rows between the reuse line and the end.
        let reuse = next.iter().position(|l| l.starts_with("reuse")).unwrap();
        assert_eq!(&next[reuse + 1..], ["", "Ctrl-C to quit"], "{next:?}");
    }

    #[test]
    fn shows_tenants_once_there_are_several_and_reuse_always() {
        let a = sample(10, 5, 20);
        let lines = render(&a, None, Duration::from_secs(1));
        assert!(lines.iter().any(|l| l.starts_with("reuse")), "{lines:?}");
        assert!(!lines.iter().any(|l| l.starts_with("tenant")), "one default tenant: no table; {lines:?}");
        let tenant = |name: &str, bytes: u64, limit: Option<u64>, evictions: u64| kachedb_shm::control::TenantStats {
            name: name.into(),
            limit_bytes: limit,
            bytes,
            blocks: 3,
            clients: 1,
            get_hits: 3,
            get_misses: 1,
            evictions,
            ..Default::default()
        };
        let mut b = a.clone();
        b.tenants = vec![tenant("default", 1 << 20, None, 0), tenant("team-a", 1 << 30, Some(1 << 30), 4)];
        let mut c = b.clone();
        c.tenants[1].evictions = 14;
        let lines = render(&c, Some((1.0, &b)), Duration::from_secs(1));
        let header = lines.iter().position(|l| l.starts_with("tenant")).expect("a tenant table");
        assert!(lines[header + 1].starts_with("team-a"), "the largest first: {lines:?}");
        assert!(lines[header + 1].contains("1.0 GiB / 1.0 GiB") && lines[header + 1].contains("10"), "{lines:?}");
        assert!(lines.iter().all(|l| l.chars().count() <= 80), "{lines:?}");
    }

    #[test]
    fn formats() {
        assert_eq!(duration(3725.0), "1h02m");
        assert_eq!(duration(59.0), "59s");
        assert_eq!(duration(90_000.0), "1d01h");
    }
}
