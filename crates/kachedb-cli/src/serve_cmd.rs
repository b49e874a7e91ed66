//! `kachedb serve` and `kachedb stats`.
//!
//! Under systemd (`Type=notify`, deploy/kachedb.service) `serve` reports
//! `READY=1` and its pid once it serves, `STOPPING=1` when it stops; with
//! `--on-sighup takeover`, SIGHUP starts a successor (`serve … --takeover`,
//! from the same path) that takes everything over, and the main pid moves to it.

use clap::Args;
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
    #[arg(long = "tenant-limit", value_name = "NAME=SIZE", value_parser = parse_tenant_limit)]
    pub tenant_limits: Vec<(String, u64)>,
    /// The limit of every tenant not named by --tenant-limit (`default`,
    /// the tenant of clients that name none, and `_other` included).
    /// Default: none.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub tenant_limit_default: Option<u64>,
    /// Most disk-tier bytes tenant NAME's blocks may take (file-system bytes,
    /// as --disk-size counts them), e.g. `team-a=100GiB` (repeatable; needs
    /// --disk). A tenant at its disk limit evicts its own blocks on disk
    /// (leaves first); a block that cannot fit within it is not written.
    /// Without it, a tenant with a --tenant-limit gets the same share of the
    /// disk as of the megaslab (limit / --size × --disk-size). docs/disk.md "Tenants".
    #[arg(long = "tenant-disk-limit", value_name = "NAME=SIZE", value_parser = parse_tenant_limit)]
    pub tenant_disk_limits: Vec<(String, u64)>,
    /// The disk limit of every tenant not named by --tenant-disk-limit or
    /// --tenant-limit (`default` and `_other` included). Default: the share
    /// --tenant-limit-default gives, else none.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub tenant_disk_limit_default: Option<u64>,
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
    /// A Redis Cluster (any node; the cluster is discovered) or a standalone
    /// Redis behind the megaslab, shared by a fleet of daemons:
    /// `redis://HOST:PORT`, or `rediss://HOST:PORT` for TLS (docs/remote.md).
    /// Off by default.
    #[arg(long, value_name = "URL")]
    pub remote: Option<String>,
    /// A file holding the remote's password (its first line). The password
    /// can also come from the environment variable KACHEDB_REMOTE_PASSWORD;
    /// it is never taken on the command line, which other users can read.
    #[arg(long, value_name = "PATH")]
    pub remote_password_file: Option<PathBuf>,
    /// A file holding the fleet key: 32 random bytes, or 64 hex digits
    /// (`openssl rand -hex 32 > key; chmod 600 key`), the same on every node
    /// of the fleet. Values are then written with keyed tags over the
    /// namespace, the header and the bytes, and only values with valid tags
    /// are served; without it the tier trusts every writer to its namespace.
    /// The file must be the daemon user's own, not readable or writable by
    /// group or others, and not a symbolic link. Never on the command line
    /// (docs/remote.md).
    #[arg(long, value_name = "PATH")]
    pub remote_key_file: Option<PathBuf>,
    /// Key prefix in the remote store: daemons with the same namespace share
    /// blocks, others do not see them.
    #[arg(long, default_value = "kachedb", value_name = "NAME")]
    pub remote_namespace: String,
    /// Milliseconds one round of remote requests may take; past it the keys
    /// are misses (a node down or slow never stalls a client longer).
    #[arg(long, default_value_t = kachedb_daemon::remote::DEFAULT_TIMEOUT_MS, value_name = "MS")]
    pub remote_timeout_ms: u64,
    /// Expiry of the blocks written to the remote store, seconds (default: none).
    #[arg(long, value_name = "SECS")]
    pub remote_ttl_s: Option<u64>,
    /// Most block bytes waiting to be written to the remote store (pinned in
    /// the megaslab meanwhile); blocks committed beyond it are not written
    /// (counted as remote_dropped_writes) [default: 1GiB].
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub remote_queue_bytes: Option<u64>,
    /// Bytes per remote value (a block is cut into chunks of this size;
    /// 64KiB to 64MiB).
    #[arg(long, value_parser = parse_size, default_value = "1MiB", value_name = "SIZE")]
    pub remote_chunk_bytes: u64,
    /// How much nicer than the serve loop the remote tier's threads run
    /// (0 to 19; 0: the same priority). When fills and local traffic want
    /// the same cores, the serve loop gets them first, so fills do not slow
    /// local GETs down; fills use whatever CPU is left (docs/remote.md).
    #[arg(long, default_value_t = kachedb_daemon::remote::DEFAULT_WORKER_NICE, value_name = "N",
          value_parser = clap::value_parser!(u8).range(0..=i64::from(kachedb_daemon::remote::MAX_WORKER_NICE)))]
    pub remote_worker_nice: u8,
    /// A directory of local files behind the megaslab (docs/disk.md): every
    /// committed block is written there behind the clients' backs, a local
    /// miss is filled from there (before the remote tier), and a daemon
    /// started again on it after a crash serves what it holds. Off by
    /// default; needs --disk-size.
    #[arg(long, value_name = "DIR")]
    pub disk: Option<PathBuf>,
    /// Most file-system bytes the disk tier's blocks take; beyond, blocks
    /// are evicted, leaves of the prefix chains first.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub disk_size: Option<u64>,
    /// Most block bytes waiting to be written to disk (pinned in the
    /// megaslab meanwhile); blocks committed beyond it are not written
    /// (counted as disk_dropped_writes). Default: a quarter of --size, at
    /// most 1GiB.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub disk_queue_bytes: Option<u64>,
    /// Milliseconds a disk fill may take; past it the keys are misses
    /// (and the remote tier, if any, is not asked for them).
    #[arg(long, default_value_t = kachedb_daemon::disk::DEFAULT_TIMEOUT_MS, value_name = "MS")]
    pub disk_timeout_ms: u64,
    /// How much nicer than the serve loop the disk tier's threads run (0 to 19).
    #[arg(long, default_value_t = kachedb_daemon::disk::DEFAULT_WORKER_NICE, value_name = "N",
          value_parser = clap::value_parser!(u8).range(0..=19))]
    pub disk_worker_nice: u8,
    /// The scheduling class of the disk tier's threads: `idle`
    /// (`SCHED_IDLE`: they run only on a core the serve loop and the clients
    /// leave free, so disk work does not slow GETs of RAM blocks down) or
    /// `normal` (the nice value above shares a busy core by weight).
    #[arg(long, value_enum, default_value_t = DiskWorkerClass::Idle, value_name = "CLASS")]
    pub disk_worker_class: DiskWorkerClass,
    /// Which committed blocks the disk tier writes: `first`, every one at
    /// its commit; `second`, only a block requested again (GET, LOOKUP or
    /// WAIT) while still in RAM after its commit, written at that request,
    /// or committed a second time (docs/disk.md, "Admission").
    #[arg(long, value_enum, default_value_t = DiskAdmit::First, value_name = "POLICY")]
    pub disk_admit: DiskAdmit,
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

/// `kachedb serve --disk-admit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DiskAdmit {
    /// Every committed block, at its commit.
    First,
    /// Only blocks requested again after their commit.
    Second,
}

/// `kachedb serve --disk-worker-class`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DiskWorkerClass {
    /// `SCHED_IDLE`.
    Idle,
    /// `SCHED_OTHER` at `--disk-worker-nice`.
    Normal,
}

/// An on/off option.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

/// `NAME=SIZE` of `--tenant-limit`.
fn parse_tenant_limit(s: &str) -> Result<(String, u64), String> {
    let (name, size) = s.split_once('=').ok_or_else(|| format!("{s:?}: give NAME=SIZE, e.g. team-a=1GiB"))?;
    kachedb_shm::control::check_tenant_name(name)?;
    Ok((name.to_owned(), parse_size(size)?))
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

/// The disk tier's settings from `a`, if `--disk` is given.
fn tenant_config(a: &ServeArgs) -> Result<kachedb_daemon::TenantConfig, Box<dyn std::error::Error>> {
    let accounting = a.tenant_accounting == Switch::On;
    if !accounting && (!a.tenant_limits.is_empty() || a.tenant_limit_default.is_some()) {
        return Err("--tenant-limit and --tenant-limit-default need --tenant-accounting on".into());
    }
    if !accounting && (!a.tenant_disk_limits.is_empty() || a.tenant_disk_limit_default.is_some()) {
        return Err("--tenant-disk-limit and --tenant-disk-limit-default need --tenant-accounting on".into());
    }
    if a.disk.is_none() && (!a.tenant_disk_limits.is_empty() || a.tenant_disk_limit_default.is_some()) {
        return Err("--tenant-disk-limit and --tenant-disk-limit-default need --disk DIR".into());
    }
    let mut names = std::collections::BTreeSet::new();
    for (name, _) in &a.tenant_limits {
        if !names.insert(name) {
            return Err(format!("--tenant-limit {name}=…: tenant {name:?} is named twice").into());
        }
    }
    let mut disk_names = std::collections::BTreeSet::new();
    for (name, _) in &a.tenant_disk_limits {
        if !disk_names.insert(name) {
            return Err(format!("--tenant-disk-limit {name}=…: tenant {name:?} is named twice").into());
        }
    }
    if names.union(&disk_names).count() > kachedb_shm::control::MAX_TENANTS - 2 {
        return Err(format!(
            "--tenant-limit and --tenant-disk-limit name {} tenants; the daemon counts at most {} besides `default` and `_other`",
            names.union(&disk_names).count(),
            kachedb_shm::control::MAX_TENANTS - 2
        )
        .into());
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

/// The tenants' limits on disk bytes: `--tenant-disk-limit` (and its
/// default) where given, else each `--tenant-limit`'s share of the megaslab
/// (`megaslab_bytes`) applied to the disk (`disk_bytes`), rounded down to
/// 4 KiB (a block file's unit).
fn tenant_disk_limits(a: &ServeArgs, megaslab_bytes: u64, disk_bytes: u64) -> kachedb_daemon::disk::index::Limits {
    let share = |limit: u64| {
        let b = u128::from(limit) * u128::from(disk_bytes) / u128::from(megaslab_bytes.max(1));
        (b.min(u128::from(disk_bytes)) as u64) / 4096 * 4096
    };
    let mut named = a.tenant_disk_limits.clone();
    for (name, limit) in &a.tenant_limits {
        if !named.iter().any(|(n, _)| n == name) {
            named.push((name.clone(), share(*limit)));
        }
    }
    kachedb_daemon::disk::index::Limits {
        named,
        default: a.tenant_disk_limit_default.or(a.tenant_limit_default.map(share)),
    }
}

fn disk_config(a: &ServeArgs) -> Result<Option<kachedb_daemon::disk::DiskConfig>, Box<dyn std::error::Error>> {
    let Some(dir) = &a.disk else {
        if a.disk_size.is_some() {
            return Err("--disk-size needs --disk DIR".into());
        }
        return Ok(None);
    };
    let Some(size_bytes) = a.disk_size else {
        return Err("--disk needs --disk-size SIZE (the most bytes its blocks may take)".into());
    };
    if a.disk_timeout_ms == 0 {
        return Err("--disk-timeout-ms must be above 0".into());
    }
    Ok(Some(kachedb_daemon::disk::DiskConfig {
        dir: dir.clone(),
        size_bytes,
        queue_bytes: a
            .disk_queue_bytes
            .unwrap_or((a.size.unwrap_or_else(default_size) / 4).min(kachedb_daemon::disk::DEFAULT_QUEUE_BYTES)),
        timeout: std::time::Duration::from_millis(a.disk_timeout_ms),
        worker_nice: a.disk_worker_nice,
        worker_class: match a.disk_worker_class {
            DiskWorkerClass::Idle => kachedb_daemon::disk::WorkerClass::Idle,
            DiskWorkerClass::Normal => kachedb_daemon::disk::WorkerClass::Normal,
        },
        admission: match a.disk_admit {
            DiskAdmit::First => kachedb_daemon::tier::Admission::First,
            DiskAdmit::Second => kachedb_daemon::tier::Admission::Second,
        },
        tenant_limits: tenant_disk_limits(a, a.size.unwrap_or_else(default_size), size_bytes),
    }))
}

/// The remote tier's settings from `a`, if `--remote` is given; the password
/// from `--remote-password-file` or KACHEDB_REMOTE_PASSWORD.
fn remote_config(a: &ServeArgs) -> Result<Option<kachedb_daemon::remote::RemoteConfig>, Box<dyn std::error::Error>> {
    let Some(url) = &a.remote else {
        if a.remote_password_file.is_some() {
            return Err("--remote-password-file needs --remote".into());
        }
        if a.remote_key_file.is_some() {
            return Err("--remote-key-file needs --remote".into());
        }
        return Ok(None);
    };
    let password = match &a.remote_password_file {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).map_err(|e| format!("--remote-password-file {}: {e}", p.display()))?;
            Some(text.lines().next().unwrap_or("").to_string())
        }
        None => std::env::var("KACHEDB_REMOTE_PASSWORD").ok().filter(|p| !p.is_empty()),
    };
    let userinfo = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest).split('/').next().unwrap_or("");
    if userinfo.rsplit_once('@').is_some_and(|(user, _)| user.contains(':')) {
        return Err("--remote: give the password with --remote-password-file or KACHEDB_REMOTE_PASSWORD, not in the URL (other users can read command lines)".into());
    }
    let chunk_bytes = u32::try_from(a.remote_chunk_bytes)
        .ok()
        .filter(|&c| kachedb_daemon::remote::format::chunk_bytes_ok(u64::from(c)))
        .ok_or_else(|| format!("--remote-chunk-bytes {}: give 64KiB to 64MiB", a.remote_chunk_bytes))?;
    if a.remote_timeout_ms == 0 {
        return Err("--remote-timeout-ms must be above 0".into());
    }
    Ok(Some(kachedb_daemon::remote::RemoteConfig {
        url: url.clone(),
        password,
        namespace: a.remote_namespace.clone(),
        timeout: std::time::Duration::from_millis(a.remote_timeout_ms),
        ttl: a.remote_ttl_s.filter(|&s| s > 0).map(std::time::Duration::from_secs),
        queue_bytes: a.remote_queue_bytes.unwrap_or(kachedb_daemon::remote::DEFAULT_QUEUE_BYTES),
        chunk_bytes,
        worker_nice: a.remote_worker_nice,
        key: a.remote_key_file.as_deref().map(read_key_file).transpose()?,
    }))
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

/// Most bytes read from a key file: a key is 32 bytes, or 64 hex digits and
/// some whitespace.
const KEY_FILE_MAX_LEN: u64 = 4096;

/// The fleet key in `path`: a regular file of the daemon's own user that
/// group and others can neither read nor write, holding 32 bytes or 64 hex
/// digits. The file is opened without following a symbolic link (`O_NOFOLLOW`)
/// and its owner, mode and type are read from the open descriptor (`fstat`),
/// so what is checked is what is read, whatever happens to the path meanwhile.
fn read_key_file(path: &std::path::Path) -> Result<kachedb_daemon::remote::format::FleetKey, String> {
    use rustix::fs::{FileType, Mode, OFlags};
    use std::io::Read;
    let shown = path.display();
    // NONBLOCK: opening a FIFO does not wait for a writer (it is then refused as not a file).
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let fd = rustix::fs::open(path, flags, Mode::empty()).map_err(|e| match e {
        rustix::io::Errno::LOOP => format!(
            "--remote-key-file {shown}: a symbolic link; the daemon does not follow one (it could be pointed at another \
             file): give the path of the key file itself"
        ),
        e => format!("--remote-key-file {shown}: {}", std::io::Error::from(e)),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| format!("--remote-key-file {shown}: {}", std::io::Error::from(e)))?;
    let (owner, mode) = (st.st_uid, st.st_mode & 0o7777);
    let me = rustix::process::geteuid().as_raw();
    let what = format!("--remote-key-file {shown} (owned by uid {owner}, mode {mode:03o})");
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(format!("{what}: not a regular file: give the path of a file holding the key"));
    }
    if owner != me {
        return Err(format!(
            "{what}: the fleet key must belong to the daemon's user (uid {me}), who alone may read it: \
             chown {me} {shown} && chmod 600 {shown}"
        ));
    }
    if mode & 0o077 != 0 {
        return Err(format!(
            "{what}: group or others can read or write the key; anyone who reads it can forge blocks every node \
             serves: chmod 600 {shown}"
        ));
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(KEY_FILE_MAX_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("--remote-key-file {shown}: {e}"))?;
    if bytes.len() as u64 > KEY_FILE_MAX_LEN {
        return Err(format!("{what}: longer than {KEY_FILE_MAX_LEN} bytes: give 32 bytes or 64 hex digits"));
    }
    kachedb_daemon::remote::format::FleetKey::parse(&bytes).map_err(|e| format!("--remote-key-file {shown}: {e}"))
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
        remote: remote_config(a)?,
        disk: disk_config(a)?,
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
        return finish(daemon, a, &say);
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
    finish(daemon, a, &say)
}

/// Serves with a started daemon until it stops or hands over.
fn finish(daemon: Daemon, a: &ServeArgs, say: &dyn Fn(String)) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    if let Some(addr) = daemon.metrics_addr() {
        say(format!("metrics at http://{addr}/metrics"));
    }
    if let (Some(dir), Some(size)) = (&a.disk, a.disk_size) {
        say(format!("disk tier {} ({}; index rebuilt in the background)", dir.display(), human_bytes(size)));
    }
    if let Some(url) = &a.remote {
        let trust = if a.remote_key_file.is_some() {
            "values authenticated with the fleet key"
        } else {
            "no --remote-key-file: values not authenticated, every writer trusted"
        };
        say(format!("remote tier {url} (namespace {}; {trust})", a.remote_namespace));
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
    if s.disk.disk_enabled && (s.tenants.len() > 1 || s.tenants.iter().any(|t| t.disk_limit_bytes.is_some())) {
        println!(
            "{:<20} {:>10} {:>10} {:>9} {:>9} {:>9}",
            "tenant on disk", "bytes", "limit", "blocks", "evicted", "refused"
        );
        for t in s.tenants.iter().filter(|t| t.disk_blocks > 0 || t.disk_limit_bytes.is_some()) {
            println!(
                "{:<20} {:>10} {:>10} {:>9} {:>9} {:>9}",
                t.name,
                human_bytes(t.disk_bytes),
                t.disk_limit_bytes.map_or("-".into(), human_bytes),
                t.disk_blocks,
                t.disk_evictions,
                t.disk_limit_refusals
            );
        }
    }
    let r = &s.remote;
    if r.remote_enabled {
        println!(
            "remote writes     {} ({}), {} dropped, queue {} in {} block(s)",
            r.remote_writes,
            human_bytes(r.remote_write_bytes),
            r.remote_dropped_writes,
            human_bytes(r.remote_queue_bytes),
            r.remote_queue_blocks
        );
        println!(
            "remote fills      {} ({}) from {} fetch(es), {} miss(es); fill {:.2} ms mean, {:.2} ms max",
            r.remote_fills,
            human_bytes(r.remote_fill_bytes),
            r.remote_fetches,
            r.remote_misses,
            r.remote_fill_ms_mean,
            r.remote_fill_ms_max
        );
        println!(
            "remote errors     {} failed or timed out, {} corrupt and {} failed authentication (refused), {} fetch(es) cancelled at the deadline",
            r.remote_errors, r.remote_corrupt, r.remote_auth_failures, r.remote_fetches_cancelled
        );
    }
    let d = &s.disk;
    if d.disk_enabled {
        println!(
            "disk              {} block(s), {} of {}; {} evicted; {} recovered at start{}",
            d.disk_blocks,
            human_bytes(d.disk_bytes),
            human_bytes(d.disk_capacity_bytes),
            d.disk_evictions,
            d.disk_recovered,
            if d.disk_indexed { format!(" (indexed in {:.3} s)", d.disk_index_s) } else { " (indexing)".into() }
        );
        println!(
            "disk writes       {} ({}), {} dropped, queue {} in {} block(s)",
            d.disk_writes,
            human_bytes(d.disk_write_bytes),
            d.disk_dropped_writes,
            human_bytes(d.disk_queue_bytes),
            d.disk_queue_blocks
        );
        println!(
            "disk fills        {} ({}) from {} fetch(es), {} miss(es), {} timed out; mean {:.2} ms",
            d.disk_fills,
            human_bytes(d.disk_fill_bytes),
            d.disk_fetches,
            d.disk_misses,
            d.disk_fetches_timed_out,
            d.disk_fill_ms_mean
        );
        println!(
            "disk errors       {} I/O error(s), {} torn or corrupt (refused, deleted); {} deleted by clients",
            d.disk_errors, d.disk_torn, d.disk_deletes
        );
    }
    Ok(())
}
