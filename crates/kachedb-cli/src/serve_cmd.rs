//! `kachedb serve` and `kachedb stats`.
//!
//! Under systemd (`Type=notify`, deploy/kachedb.service) `serve` reports
//! `READY=1` and its pid once it serves, `STOPPING=1` when it stops; with
//! `--on-sighup takeover`, SIGHUP starts a successor (`serve … --takeover`,
//! from the same path) that takes everything over, and the main pid moves to it.

use clap::Args;
use kachedb_daemon::tier_kind::{ServeFlags, TierFlags, TierSetup};
use kachedb_daemon::{Daemon, ServeConfig};
use kachedb_shm::units::{human_bytes, parse_size};
use kachedb_shm::SpinThenPark;
use std::ffi::OsString;
use std::io::IsTerminal;
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
    /// Control socket path [default: $KACHEDB_SOCKET for instance 0, else
    /// $XDG_RUNTIME_DIR/kachedb/kachedb_<N>.sock or /tmp/kachedb-<uid>/kachedb_<N>.sock:
    /// the one rule every client applies, kachedb_shm::naming::default_socket_path].
    #[arg(long)]
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
    /// Serve Prometheus metrics (`GET /metrics`) and `GET /healthz` over HTTP
    /// at this address, e.g. `127.0.0.1:9464` (docs/metrics.md). Off by default.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Log format on stderr: `text`, or `json` (one object per line, for log shippers).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Most bytes one client (one connection) may hold reserved and pinned
    /// at once, e.g. `1GiB` (beyond it its reserves and gets answer
    /// OUT_OF_MEMORY; others are not affected). Committed blocks nobody pins
    /// count against no client: they are the cache's, and eviction takes
    /// them. Default: no limit.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub max_client_bytes: Option<u64>,
    /// Most bytes the clients of one uid (`SO_PEERCRED`) may hold reserved and
    /// pinned together, however many connections they open, e.g. `4GiB`.
    /// Default: no limit.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub max_uid_bytes: Option<u64>,
    /// Most control connections open at once (connected clients and those not
    /// yet past hello); more are closed at once.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: u32,
    /// Milliseconds a control connection that is not a client's (no hello
    /// yet, a `kachedb stats`) may go without sending a request, from its
    /// accept and then from its last request, before it is closed.
    #[arg(long, default_value_t = 5000)]
    pub hello_timeout_ms: u64,
    /// Milliseconds one step of a takeover may take as a whole (the serve loop
    /// stopping, the state sent, the new daemon's answer, the confirmation),
    /// on either side, before that side gives up (the running daemon then
    /// serves on). docs/takeover.md.
    #[arg(long, default_value_t = kachedb_daemon::takeover::STEP_TIMEOUT.as_millis() as u64, value_name = "MS")]
    pub takeover_timeout_ms: u64,
    /// Milliseconds this daemon's clients may wait while a new daemon takes
    /// over: from the new daemon's go (it asked, and is there) to its
    /// verdict. Past it this daemon serves on and the takeover fails. Raise
    /// it for stores of millions of blocks (docs/takeover.md).
    #[arg(long, default_value_t = kachedb_daemon::takeover::PAUSE_LIMIT.as_millis() as u64, value_name = "MS")]
    pub takeover_pause_ms: u64,
    /// Milliseconds a client may leave requests unanswerable because it does
    /// not drain its completion ring (stopped, in a debugger, throttled)
    /// before it is disconnected and its pins and reservations dropped.
    /// 0: never. (A live client that published more than a ring of requests
    /// and then stopped calling the library for that long looks the same.)
    #[arg(long, default_value_t = 0)]
    pub stuck_client_timeout_ms: u64,
    /// Run the store's full invariant check for every stats answer (slow with
    /// many blocks: for tests and debugging; stats otherwise cross-check counters).
    #[arg(long, env = "KACHEDB_CHECK_INVARIANTS", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub check_invariants: bool,
    /// Which blocks eviction takes first: `chain` (blocks no other block names
    /// as parent, least recently used first, so a cached block's prefix stays
    /// cached) or `lru` (least recently used, parents or not). docs/eviction.md.
    #[arg(long, value_enum, default_value_t = Eviction::Chain)]
    pub eviction: Eviction,
    /// Most megaslab bytes tenant NAME may hold (its blocks and reservations),
    /// e.g. `team-a=1GiB` (repeatable). A tenant at its limit evicts its own
    /// blocks first; one whose block cannot fit within it gets OUT_OF_MEMORY
    /// and nothing is evicted; its blocks are never evicted by another
    /// tenant. Clients name their tenant at connect (docs/metrics.md "Tenants").
    #[arg(long = "tenant-limit", value_name = "NAME=SIZE", value_parser = kachedb_shm::control::parse_tenant_limit)]
    pub tenant_limits: Vec<(String, u64)>,
    /// The limit of every tenant not named by --tenant-limit (`default`,
    /// the tenant of clients that name none, and `_other` included).
    /// Default: none.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub tenant_limit_default: Option<u64>,
    /// Count tenants apart (`on`: per-tenant bytes, hits, misses and request
    /// windows in stats and metrics) or not (`off`: every client is the
    /// default tenant's, no request window is kept; --tenant-limit is then
    /// refused).
    #[arg(long, value_enum, default_value_t = Switch::On, value_name = "ON|OFF")]
    pub tenant_accounting: Switch,
    /// Binds tenant NAME to these uids, e.g. `team-a=1001,1002` (numeric;
    /// repeatable, one flag per tenant): a client of another uid naming
    /// NAME is refused at connect, and a client of these uids is NAME's
    /// (naming none, it is put in NAME; naming another tenant, it is
    /// refused). Only NAME's clients may then replace or delete NAME's
    /// blocks (others get DENIED); every client may still read them. Binds,
    /// never admits: a client must still be the daemon's uid or in an
    /// --allow-gid group. docs/tenants.md.
    #[arg(long = "tenant-uid", value_name = "NAME=UID[,UID…]", value_parser = parse_tenant_ids)]
    pub tenant_uids: Vec<(String, Vec<u32>)>,
    /// Binds tenant NAME to these groups, e.g. `team-b=2000` (numeric;
    /// repeatable): as --tenant-uid, for clients whose primary gid or one of
    /// whose supplementary groups is one of them. A tenant may have both.
    #[arg(long = "tenant-gid", value_name = "NAME=GID[,GID…]", value_parser = parse_tenant_ids)]
    pub tenant_gids: Vec<(String, Vec<u32>)>,
    /// Seconds a request window runs (the distinct keys asked for in it
    /// give the hit-ratio ceiling; docs/metrics.md "How reusable is the
    /// cache"); a new one starts at its end.
    #[arg(long, default_value_t = 300, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub request_window: u64,
    /// The flags of every tier the daemon is built with, each tier's own
    /// (`kachedb_daemon::TIERS`).
    #[command(flatten)]
    pub tiers: TierArgs,
    /// Take over from the daemon running on the same socket (an upgrade or a
    /// restart without losing anything): it hands over its region, socket,
    /// clients and store, then exits; clients notice a short pause. Its
    /// region geometry is kept (--size, --channels, --ring-capacity and
    /// --headroom are not used); the other options apply. If anything fails,
    /// the running daemon keeps serving. docs/takeover.md.
    #[arg(long)]
    pub takeover: bool,
    /// What SIGHUP does: `stop` (as SIGTERM: a closed terminal stops the
    /// daemon), or `takeover`: start a successor, this command again from the
    /// same path with `--takeover`, which takes everything over (`systemctl
    /// reload` after an upgrade, deploy/kachedb.service).
    #[arg(long, value_enum, default_value_t = OnSighup::Stop, value_name = "ACTION")]
    pub on_sighup: OnSighup,
    /// The KV event publisher (`--events-*`).
    #[command(flatten)]
    pub events: crate::events_cmd::EventsArgs,
}

/// `kachedb serve --on-sighup`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnSighup {
    /// Stop, as on SIGTERM.
    Stop,
    /// Hand everything over to a successor started from the same path.
    Takeover,
}

/// An on/off option.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

/// `NAME=ID[,ID…]` of `--tenant-uid` and `--tenant-gid`.
fn parse_tenant_ids(s: &str) -> Result<(String, Vec<u32>), String> {
    let (name, ids) = s.split_once('=').ok_or_else(|| format!("{s:?}: give NAME=ID[,ID…], e.g. team-a=1001,1002"))?;
    kachedb_shm::control::check_tenant_name(name)?;
    if name == kachedb_shm::control::DEFAULT_TENANT {
        return Err(format!(
            "{name:?} is the tenant of every client that names none and cannot be bound: bind a tenant of a name of its own"
        ));
    }
    let mut out = Vec::new();
    for id in ids.split(',') {
        let n = id.trim().parse::<u32>().map_err(|_| {
            format!("{id:?} in {s:?} is not a numeric id: give numbers (`id -u NAME` / `getent group NAME` print them)")
        })?;
        if !out.contains(&n) {
            out.push(n);
        }
    }
    Ok((name.to_owned(), out))
}

/// `kachedb serve --eviction`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Eviction {
    /// Leaves of the prefix chains first, least recently used among them.
    Chain,
    /// Least recently used first.
    Lru,
}

/// The tenants' settings from `a`.
fn tenant_config(a: &ServeArgs) -> Result<kachedb_daemon::TenantConfig, Box<dyn std::error::Error>> {
    let accounting = a.tenant_accounting == Switch::On;
    if !accounting && (!a.tenant_limits.is_empty() || a.tenant_limit_default.is_some()) {
        return Err("--tenant-limit and --tenant-limit-default need --tenant-accounting on".into());
    }
    let mut names = std::collections::BTreeSet::new();
    for (name, _) in &a.tenant_limits {
        if !names.insert(name) {
            return Err(format!("--tenant-limit {name}=…: tenant {name:?} is named twice").into());
        }
    }
    if names.len() > kachedb_shm::control::MAX_TENANTS - 2 {
        return Err(format!(
            "--tenant-limit names {} tenants; the daemon counts at most {} besides `default` and `_other`",
            names.len(),
            kachedb_shm::control::MAX_TENANTS - 2
        )
        .into());
    }
    let bindings = tenant_bindings(a)?;
    if !accounting && !bindings.is_empty() {
        return Err("--tenant-uid and --tenant-gid need --tenant-accounting on".into());
    }
    let rows = names.iter().copied().chain(bindings.iter().map(|b| &b.name)).collect::<std::collections::BTreeSet<_>>();
    if rows.len() > kachedb_shm::control::MAX_TENANTS - 2 {
        return Err(format!(
            "--tenant-limit, --tenant-uid and --tenant-gid name {} tenants; the daemon counts at most {} besides `default` and `_other`",
            rows.len(),
            kachedb_shm::control::MAX_TENANTS - 2
        )
        .into());
    }
    Ok(kachedb_daemon::TenantConfig {
        limits: a.tenant_limits.clone(),
        default_limit: a.tenant_limit_default,
        accounting,
        request_window: std::time::Duration::from_secs(a.request_window),
        bindings,
    })
}

/// The tenants bound by `--tenant-uid` and `--tenant-gid`, one per name
/// (a tenant may have both flags, each once).
fn tenant_bindings(a: &ServeArgs) -> Result<Vec<kachedb_daemon::TenantBinding>, Box<dyn std::error::Error>> {
    let mut out: Vec<kachedb_daemon::TenantBinding> = Vec::new();
    for (flag, list, gids) in [("--tenant-uid", &a.tenant_uids, false), ("--tenant-gid", &a.tenant_gids, true)] {
        let mut seen = std::collections::BTreeSet::new();
        for (name, ids) in list {
            if !seen.insert(name) {
                return Err(format!(
                    "{flag} {name}=…: tenant {name:?} is named twice; give all its ids in one flag ({name}=ID,ID,…)"
                )
                .into());
            }
            let i = match out.iter().position(|b| &b.name == name) {
                Some(i) => i,
                None => {
                    out.push(kachedb_daemon::TenantBinding { name: name.clone(), ..Default::default() });
                    out.len() - 1
                }
            };
            if gids {
                out[i].gids = ids.clone();
            } else {
                out[i].uids = ids.clone();
            }
        }
    }
    Ok(out)
}

/// The tiers the flags ask for, in the order of `kachedb_daemon::TIERS`.
fn tier_setups(a: &ServeArgs, slab_bytes: u64) -> Result<Vec<Arc<dyn TierSetup>>, Box<dyn std::error::Error>> {
    let serve = ServeFlags {
        slab_bytes,
        tenant_limits: &a.tenant_limits,
        tenant_limit_default: a.tenant_limit_default,
        tenant_accounting: a.tenant_accounting == Switch::On,
    };
    let mut out = Vec::new();
    for flags in &a.tiers.0 {
        out.extend(flags.setup(&serve)?);
    }
    Ok(out)
}

/// The flags of every tier the daemon is built with
/// (`kachedb_daemon::TIERS`), each tier's own `clap::Args`, as one group of
/// `kachedb serve`'s.
#[derive(Clone, Debug)]
pub struct TierArgs(pub Vec<Arc<dyn TierFlags>>);

impl clap::FromArgMatches for TierArgs {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        kachedb_daemon::TIERS.iter().map(|k| k.parse(m)).collect::<Result<_, _>>().map(TierArgs)
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl clap::Args for TierArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        kachedb_daemon::TIERS.iter().fold(cmd, |cmd, k| k.flags(cmd))
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

/// Heap memory the daemon's allocator keeps instead of handing back to the
/// kernel at once: up to [`HEAP_TRIM_BYTES`] free at the top of a heap, and
/// allocations below [`HEAP_MMAP_BYTES`] served from the heap (glibc's
/// defaults adjust both to the last large free, a few MiB). A remote fill
/// holds a block's chunks (1 MiB each, up to the fill budget) as buffers
/// until it lands them; with the defaults every fill faulted its buffers in
/// anew (the kernel zeroing each page) and the fill ran at half the speed
/// (`kachedb bench remote`, docs/remote.md).
const HEAP_TRIM_BYTES: i32 = 128 << 20;
/// See [`HEAP_TRIM_BYTES`].
const HEAP_MMAP_BYTES: i32 = 4 << 20;

fn keep_heap_pages() {
    // SAFETY: `mallopt` only sets allocator parameters; it is called before
    // the daemon starts any thread, and an unknown parameter is refused
    // (returns 0), never undefined.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, HEAP_TRIM_BYTES);
        libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_MMAP_BYTES);
    }
}

/// How `kachedb serve` writes its log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (tracing's JSON layer; event fields at the top level).
    Json,
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
    /// Control socket path (default as for `serve`: $KACHEDB_SOCKET for
    /// instance 0, else the instance's default path).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// A live view, refreshed every SECS seconds (default 1) until Ctrl-C:
    /// rates per second, hit ratios, memory. With --json: one object per line.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "1")]
    pub watch: Option<f64>,
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
    keep_heap_pages();
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never into a file or the journal.
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match a.log_format {
        LogFormat::Text => fmt.try_init(),
        LogFormat::Json => fmt.json().flatten_event(true).with_current_span(false).with_span_list(false).try_init(),
    };
    // The daemon's own notes on stderr: plain lines, or log events when the log is JSON.
    let say = |msg: String| match a.log_format {
        LogFormat::Text => eprintln!("kachedb: {msg}"),
        LogFormat::Json => tracing::info!("{msg}"),
    };
    let size = a.size.unwrap_or_else(default_size);
    let socket_path = a.socket.clone().unwrap_or_else(|| kachedb_shm::naming::default_socket_path(a.instance));
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, shutdown.clone())?;
    }
    if a.on_sighup == OnSighup::Stop {
        signal_hook::flag::register(signal_hook::consts::SIGHUP, shutdown.clone())?;
    }
    let tiers = tier_setups(a, size)?;
    let cfg = ServeConfig {
        instance: a.instance,
        socket_path,
        slab_bytes: size,
        channels: a.channels,
        ring_capacity: a.ring_capacity,
        allow_gids: a.allow_gids.clone(),
        headroom_bytes: a.headroom,
        wait: SpinThenPark { park_after: std::time::Duration::from_micros(a.park_after_us), ..SpinThenPark::default() },
        metrics_addr: a.metrics_addr,
        max_client_bytes: a.max_client_bytes,
        max_uid_bytes: a.max_uid_bytes,
        max_connections: a.max_connections,
        hello_timeout: std::time::Duration::from_millis(a.hello_timeout_ms),
        takeover_timeout: std::time::Duration::from_millis(a.takeover_timeout_ms.max(1)),
        takeover_pause: std::time::Duration::from_millis(a.takeover_pause_ms.max(1)),
        stuck_client_timeout: (a.stuck_client_timeout_ms > 0)
            .then(|| std::time::Duration::from_millis(a.stuck_client_timeout_ms)),
        check_invariants: a.check_invariants,
        eviction: match a.eviction {
            Eviction::Chain => kachedb_daemon::EvictionPolicy::Chain,
            Eviction::Lru => kachedb_daemon::EvictionPolicy::Lru,
        },
        tiers: tiers.clone(),
        tenants: tenant_config(a)?,
        events: crate::events_cmd::events_config(&a.events)?,
    };
    if a.takeover {
        let (daemon, t) = Daemon::take_over(cfg, shutdown)?;
        let l = *daemon.region().layout();
        println!(
            "kachedb: took over instance {} on {} from pid {} in {:.1} ms (state received {:.1} ms, store rebuilt {:.1} ms) — {} block(s), {} connection(s); region {} (megaslab {}, {} channels x {} slots), pid {}",
            a.instance,
            daemon.socket_path().display(),
            t.old_pid,
            t.took.as_secs_f64() * 1e3,
            t.received.as_secs_f64() * 1e3,
            t.rebuilt.as_secs_f64() * 1e3,
            t.blocks,
            t.connections,
            human_bytes(l.region_len),
            human_bytes(l.slab_len),
            l.channel_count,
            l.ring_capacity,
            std::process::id()
        );
        return finish(daemon, a, &tiers, &say);
    }
    say(format!(
        "reserving {} of shared memory for instance {}{}",
        human_bytes(size),
        a.instance,
        if a.size.is_none() { " (default: a quarter of available memory, at most 4 GiB; set with --size)" } else { "" }
    ));
    let mut last_pct = 0;
    let daemon = Daemon::start(cfg, shutdown, |done, total| {
        let pct = done * 100 / total.max(1);
        if total > (1 << 30) && pct >= last_pct + 25 {
            say(format!("reserved {} / {} ({pct}%)", human_bytes(done), human_bytes(total)));
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
    finish(daemon, a, &tiers, &say)
}

/// Serves with a started daemon until it stops or hands over.
fn finish(
    daemon: Daemon,
    a: &ServeArgs,
    tiers: &[Arc<dyn TierSetup>],
    say: &dyn Fn(String),
) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    if let Some(addr) = daemon.metrics_addr() {
        say(format!("metrics at http://{addr}/metrics"));
    }
    for t in tiers {
        say(t.describe());
    }
    for b in tenant_bindings(a)? {
        let list = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        say(format!(
            "tenant {:?} bound to uids [{}] and gids [{}]: only their clients act as it, replace or delete its blocks",
            b.name,
            list(&b.uids),
            list(&b.gids)
        ));
    }
    if a.on_sighup == OnSighup::Takeover {
        reload_on_sighup()?;
    }
    let status = format!("serving on {}", daemon.socket_path().display());
    notify_systemd(&[
        sd_notify::NotifyState::MainPid(std::process::id()),
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&status),
    ]);
    match daemon.run() {
        kachedb_daemon::Ended::Stopped => {
            notify_systemd(&[sd_notify::NotifyState::Stopping]);
            say("stopped".into())
        }
        kachedb_daemon::Ended::HandedOver { successor_pid } => {
            // The successor says so itself once it serves; said here too, before this
            // process exits, so that systemd never sees its main pid gone.
            if successor_pid != 0 {
                notify_systemd(&[sd_notify::NotifyState::MainPid(successor_pid)]);
            }
            say(format!("handed over to the new daemon (pid {successor_pid}); exiting"))
        }
    }
    Ok(())
}

/// Sends `state` to systemd when it started this process (`$NOTIFY_SOCKET`);
/// does nothing otherwise. A failure is logged, never fatal.
fn notify_systemd(state: &[sd_notify::NotifyState<'_>]) {
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        if let Err(e) = sd_notify::notify(state) {
            tracing::warn!("cannot notify systemd through $NOTIFY_SOCKET: {e}");
        }
    }
}

/// On each SIGHUP, starts a successor: this command again, from the same path
/// (`argv[0]`, so an upgraded binary there is the one started), with
/// `--takeover`. It takes the region, socket, clients and store over and this
/// daemon exits; if it fails, this daemon keeps serving.
fn reload_on_sighup() -> std::io::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP])?;
    std::thread::Builder::new().name("kachedb-sighup".into()).spawn(move || {
        for _ in signals.forever() {
            let mut argv = std::env::args_os();
            let prog = argv.next().unwrap_or_else(|| OsString::from("kachedb"));
            let mut args: Vec<OsString> = argv.collect();
            if !args.iter().any(|a| a == "--takeover") {
                args.push("--takeover".into());
            }
            tracing::info!("SIGHUP: starting a successor to take over: {} {:?}", prog.to_string_lossy(), args);
            match std::process::Command::new(&prog).args(&args).stdin(std::process::Stdio::null()).spawn() {
                // Reaped here if it fails; once it has taken over, this process is gone.
                Ok(mut child) => match child.wait() {
                    Ok(s) => tracing::warn!("the successor (pid {}) exited ({s}); still serving", child.id()),
                    Err(e) => tracing::warn!("waiting for the successor: {e}"),
                },
                Err(e) => tracing::error!("SIGHUP: cannot start {}: {e}; still serving", prog.to_string_lossy()),
            }
        }
    })?;
    Ok(())
}

/// Prints the daemon's stats.
pub fn stats(a: &StatsArgs) -> Result<(), Box<dyn std::error::Error>> {
    let opts = kachedb_client::ConnectOptions { socket: a.socket.clone(), instance: a.instance, ..Default::default() };
    if let Some(secs) = a.watch {
        if !(0.1..=3600.0).contains(&secs) {
            return Err(format!("--watch {secs}: give an interval between 0.1 and 3600 seconds").into());
        }
        return crate::watch::run(&opts, std::time::Duration::from_secs_f64(secs), a.json);
    }
    let s = kachedb_client::daemon_stats(&opts)?;
    if a.json {
        println!("{}", s.to_json());
        return Ok(());
    }
    let (store, serve) = (&s.store, &s.serve);
    println!("socket            {}", if s.socket.is_empty() { "-" } else { &s.socket });
    println!("daemon pid        {}", s.daemon_pid);
    println!("uptime            {:.1} s", s.uptime_s);
    println!("blocks            {}", store.blocks);
    println!("reserved          {}", store.reserved);
    println!("pins              {}", store.pins);
    println!(
        "bytes used        {} of {} (largest free extent {})",
        human_bytes(store.bytes_used),
        human_bytes(store.bytes_total),
        human_bytes(store.largest_free_bytes)
    );
    println!(
        "clients           {} connected, {} since start, {} disconnected as corrupt",
        serve.clients_connected, serve.clients_total, serve.clients_kicked
    );
    println!(
        "evictions         {} ({}), policy {}",
        store.evictions,
        human_bytes(store.evicted_bytes),
        store.eviction_policy
    );
    println!(
        "reusable          {} reachable, {} orphaned (a block before them in their chain is gone)",
        human_bytes(store.reachable_bytes),
        human_bytes(store.orphaned_bytes)
    );
    if store.window_key_requests > 0 {
        println!(
            "request window    {} key(s) asked for in {:.0} s, ~{} distinct (working set ~{} of {}): hit ratio ceiling {:.1} %",
            store.window_key_requests,
            store.window_s,
            store.window_distinct_keys,
            human_bytes(store.working_set_bytes),
            human_bytes(store.bytes_total),
            store.hit_ratio_ceiling * 100.0
        );
    }
    println!("rejected frames   {}", serve.rejected_frames);
    println!("ops               {} total, {:.0}/s over the last second", serve.ops, s.ops_per_s);
    if s.tenants.len() > 1 || s.tenants.iter().any(|t| t.limit_bytes.is_some()) {
        println!(
            "{:<20} {:>7} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "tenant", "clients", "bytes", "limit", "blocks", "hits", "misses", "evicted", "refused"
        );
        for t in &s.tenants {
            println!(
                "{:<20} {:>7} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}",
                t.name,
                t.clients,
                human_bytes(t.bytes),
                t.limit_bytes.map_or("-".into(), human_bytes),
                t.blocks,
                t.get_hits + t.lookup_hits,
                t.get_misses + t.lookup_misses,
                t.evictions,
                t.limit_refusals
            );
        }
    }
    for kind in kachedb_daemon::TIERS {
        for line in kind.stats_lines(&s) {
            println!("{line}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[test]
    fn every_tiers_flags_are_serves_with_their_help_and_ask_for_nothing_unless_given() {
        let cli = crate::Cli::command();
        let serve = cli.find_subcommand("serve").expect("a serve subcommand");
        let mut flags = 0;
        for kind in kachedb_daemon::TIERS {
            let own = kind.flags(clap::Command::new("tier"));
            for arg in own.get_arguments() {
                let long = arg.get_long().expect("tier flags are long flags");
                let there = serve
                    .get_arguments()
                    .find(|a| a.get_long() == Some(long))
                    .unwrap_or_else(|| panic!("--{long} is not a flag of kachedb serve"));
                assert_eq!(there.get_help().map(ToString::to_string), arg.get_help().map(ToString::to_string));
                assert!(arg.get_help().is_some(), "--{long} has no help text");
                flags += 1;
            }
        }
        assert!(flags > 0, "no tier has flags");
        let crate::Command::Serve(a) = crate::Cli::try_parse_from(["kachedb", "serve"]).unwrap().command else {
            panic!("not serve")
        };
        assert_eq!(a.tiers.0.len(), kachedb_daemon::TIERS.len(), "one set of flags per tier");
        assert!(tier_setups(&a, 1 << 30).unwrap().is_empty(), "no tier flag given: no tier");
    }
}
