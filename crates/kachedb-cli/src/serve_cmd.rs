//! `kachedb serve` and `kachedb stats`.

use clap::Args;
use kachedb_daemon::{Daemon, ServeConfig};
use kachedb_shm::SpinThenPark;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Options of `kachedb serve`.
#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    /// Daemon instance; names the region `kachedb_<N>` and the default socket.
    #[arg(long, default_value_t = 0)]
    pub instance: u32,
    /// Megaslab size, e.g. `8GiB`, `512MiB`, `3G`, or bytes. Default: a quarter
    /// of available memory, at most 4 GiB.
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Control socket path [default: $XDG_RUNTIME_DIR/kachedb/kachedb_<N>.sock or /tmp/kachedb-<uid>/kachedb_<N>.sock].
    #[arg(long, env = "KACHEDB_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Most clients connected at once (one channel each).
    #[arg(long, default_value_t = 64)]
    pub channels: u32,
    /// Slots per ring (power of two).
    #[arg(long, default_value_t = 1024)]
    pub ring_capacity: u32,
    /// Also admit peers whose primary group is GID (repeatable). By default only
    /// the daemon's own uid may connect.
    #[arg(long = "allow-gid", value_name = "GID")]
    pub allow_gids: Vec<u32>,
    /// Memory to leave free beside the region, e.g. `1GiB`.
    #[arg(long, value_parser = parse_size, default_value = "512MiB")]
    pub headroom: u64,
    /// Microseconds the serve loop polls an idle ring before parking.
    #[arg(long, default_value_t = 100)]
    pub park_after_us: u64,
}

/// Options of `kachedb stats`.
#[derive(Debug, Args)]
pub struct StatsArgs {
    /// Print the raw JSON object.
    #[arg(long)]
    pub json: bool,
    /// Daemon instance.
    #[arg(long, default_value_t = 0)]
    pub instance: u32,
    /// Control socket path (default as for `serve`).
    #[arg(long, env = "KACHEDB_SOCKET")]
    pub socket: Option<PathBuf>,
}

/// Parses `8GiB`, `512MiB`, `3G`, `100M`, `4096K`, `12345`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num.parse().map_err(|_| format!("{s:?} is not a size: use e.g. 8GiB, 512MiB or a byte count"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("unknown size unit {u:?} in {s:?}: use KiB, MiB, GiB or TiB")),
    };
    Ok((num * mult as f64) as u64)
}

/// `1.5 GiB`-style text.
pub fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

/// The default megaslab size: a quarter of available memory, at most 4 GiB,
/// at least 64 MiB, in 64 MiB steps.
pub fn default_size() -> u64 {
    let (avail, _) = kachedb_shm::region::available_memory();
    let quarter = (avail / 4).min(4 << 30);
    (quarter / (64 << 20)).max(1) * (64 << 20)
}

/// Runs the daemon until SIGINT/SIGTERM.
pub fn serve(a: &ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .try_init();
    let size = a.size.unwrap_or_else(default_size);
    let socket_path = a.socket.clone().unwrap_or_else(|| kachedb_shm::naming::default_socket_path(a.instance));
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, shutdown.clone())?;
    }
    let cfg = ServeConfig {
        instance: a.instance,
        socket_path,
        slab_bytes: size,
        channels: a.channels,
        ring_capacity: a.ring_capacity,
        allow_gids: a.allow_gids.clone(),
        headroom_bytes: a.headroom,
        wait: SpinThenPark { park_after: std::time::Duration::from_micros(a.park_after_us), ..SpinThenPark::default() },
    };
    eprintln!(
        "kachedb: reserving {} of shared memory for instance {}{}",
        human_bytes(size),
        a.instance,
        if a.size.is_none() { " (default: a quarter of available memory, at most 4 GiB; set with --size)" } else { "" }
    );
    let mut last_pct = 0;
    let daemon = Daemon::start(cfg, shutdown, |done, total| {
        let pct = done * 100 / total.max(1);
        if total > (1 << 30) && pct >= last_pct + 25 {
            eprintln!("kachedb: reserved {} / {} ({pct}%)", human_bytes(done), human_bytes(total));
            last_pct = pct;
        }
    })?;
    let l = *daemon.region().layout();
    println!(
        "kachedb: serving instance {} on {} — region {} (megaslab {}, {} channels x {} slots), pid {}",
        a.instance,
        daemon.socket_path().display(),
        human_bytes(l.region_len),
        human_bytes(l.slab_len),
        l.channel_count,
        l.ring_capacity,
        std::process::id()
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    daemon.run();
    eprintln!("kachedb: stopped");
    Ok(())
}

/// Prints the daemon's stats.
pub fn stats(a: &StatsArgs) -> Result<(), Box<dyn std::error::Error>> {
    let opts = kachedb_client::ConnectOptions { socket: a.socket.clone(), instance: a.instance, ..Default::default() };
    let v = kachedb_client::daemon_stats(&opts)?;
    if a.json {
        println!("{v}");
        return Ok(());
    }
    let get = |k: &str| v.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let bytes = |k: &str| get(k).as_u64().map(human_bytes).unwrap_or_else(|| "-".into());
    println!("socket            {}", get("socket").as_str().unwrap_or("-"));
    println!("daemon pid        {}", get("daemon_pid"));
    println!("uptime            {:.1} s", get("uptime_s").as_f64().unwrap_or(0.0));
    println!("blocks            {}", get("blocks"));
    println!("reserved          {}", get("reserved"));
    println!("pins              {}", get("pins"));
    println!(
        "bytes used        {} of {} (largest free extent {})",
        bytes("bytes_used"),
        bytes("bytes_total"),
        bytes("largest_free_bytes")
    );
    println!(
        "clients           {} connected, {} since start, {} disconnected as corrupt",
        get("clients_connected"),
        get("clients_total"),
        get("clients_kicked")
    );
    println!("evictions         {} ({})", get("evictions"), bytes("evicted_bytes"));
    println!("rejected frames   {}", get("rejected_frames"));
    println!(
        "ops               {} total, {:.0}/s over the last second",
        get("ops"),
        get("ops_per_s").as_f64().unwrap_or(0.0)
    );
    Ok(())
}
