//! The remote tier's flags of `kachedb serve` (`--remote*`), the
//! configuration they give, and the tier's entry in the daemon's list of
//! tiers ([`KIND`]).

use super::cells::{RemoteCells, RemoteStats};
use super::{
    format, RemoteConfig, RemoteTier, DEFAULT_QUEUE_BYTES, DEFAULT_READ_AHEAD, DEFAULT_TIMEOUT_MS, DEFAULT_WORKER_NICE,
};
use crate::metrics::Metrics;
use crate::tier::{Tier, TierError};
use crate::tier_kind::{ServeFlags, Start, TierFlags, TierKind, TierSetup};
use kachedb_shm::units::{human_bytes, parse_size};
use kachedb_shm::Stats;
use std::path::PathBuf;
use std::sync::Arc;

/// The remote tier's flags of `kachedb serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct RemoteArgs {
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
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_MS, value_name = "MS")]
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
    #[arg(long, default_value_t = DEFAULT_WORKER_NICE, value_name = "N",
          value_parser = clap::value_parser!(u8).range(0..=i64::from(super::MAX_WORKER_NICE)))]
    pub remote_worker_nice: u8,
    /// Blocks read ahead along a chain after a fill from the remote store,
    /// into free megaslab space only (0: off; at most 64). A block written
    /// with a parent leaves a hint under the parent's key naming it; a fill
    /// reads the hint of the last block it filled and follows the hints
    /// from there (docs/remote.md, "Read-ahead").
    #[arg(long, default_value_t = DEFAULT_READ_AHEAD, value_name = "BLOCKS")]
    pub remote_read_ahead: usize,
}

impl TierFlags for RemoteArgs {
    /// The settings, if `--remote` is given; the password from
    /// `--remote-password-file` or KACHEDB_REMOTE_PASSWORD.
    fn setup(&self, _serve: &ServeFlags<'_>) -> Result<Option<Arc<dyn TierSetup>>, String> {
        let a = self;
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
            .filter(|&c| format::chunk_bytes_ok(u64::from(c)))
            .ok_or_else(|| format!("--remote-chunk-bytes {}: give 64KiB to 64MiB", a.remote_chunk_bytes))?;
        if a.remote_read_ahead > super::MAX_READ_AHEAD {
            return Err(format!(
                "--remote-read-ahead {}: at most {} blocks",
                a.remote_read_ahead,
                super::MAX_READ_AHEAD
            ));
        }
        if a.remote_timeout_ms == 0 {
            return Err("--remote-timeout-ms must be above 0".into());
        }
        Ok(Some(Arc::new(RemoteConfig {
            url: url.clone(),
            password,
            namespace: a.remote_namespace.clone(),
            timeout: std::time::Duration::from_millis(a.remote_timeout_ms),
            ttl: a.remote_ttl_s.filter(|&s| s > 0).map(std::time::Duration::from_secs),
            queue_bytes: a.remote_queue_bytes.unwrap_or(DEFAULT_QUEUE_BYTES),
            chunk_bytes,
            worker_nice: a.remote_worker_nice,
            read_ahead: a.remote_read_ahead,
            key: a.remote_key_file.as_deref().map(read_key_file).transpose()?,
            records: false,
        })))
    }
}

impl TierSetup for RemoteConfig {
    fn name(&self) -> &'static str {
        "remote"
    }

    fn describe(&self) -> String {
        let trust = if self.key.is_some() {
            "values authenticated with the fleet key"
        } else {
            "no --remote-key-file: values not authenticated, every writer trusted"
        };
        format!("remote tier {} (namespace {}; {trust})", self.url, self.namespace)
    }

    fn start(&self, at: Start) -> Result<Box<dyn Tier>, TierError> {
        let cfg = RemoteConfig { records: at.kv_events.is_some(), ..self.clone() };
        Ok(Box::new(RemoteTier::start(cfg, at.region, at.events, at.metrics)?))
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
pub fn read_key_file(path: &std::path::Path) -> Result<format::FleetKey, String> {
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
    format::FleetKey::parse(&bytes).map_err(|e| format!("--remote-key-file {shown}: {e}"))
}

/// The remote tier in the daemon's list of tiers (`crate::tiers::TIERS`).
pub static KIND: Remote = Remote;

/// The remote tier's [`TierKind`].
#[derive(Debug)]
pub struct Remote;

impl TierKind for Remote {
    fn flags(&self, cmd: clap::Command) -> clap::Command {
        <RemoteArgs as clap::Args>::augment_args(cmd)
    }

    fn parse(&self, m: &clap::ArgMatches) -> Result<Arc<dyn TierFlags>, clap::Error> {
        Ok(Arc::new(<RemoteArgs as clap::FromArgMatches>::from_arg_matches(m)?))
    }

    fn register(&self, metrics: &Metrics) {
        metrics.tier::<RemoteCells>();
    }

    fn stats_lines(&self, s: &Stats) -> Vec<String> {
        let r = RemoteStats::of(s);
        if !r.remote_enabled {
            return Vec::new();
        }
        vec![
            format!(
                "remote writes     {} ({}), {} dropped, queue {} in {} block(s)",
                r.remote_writes,
                human_bytes(r.remote_write_bytes),
                r.remote_dropped_writes,
                human_bytes(r.remote_queue_bytes),
                r.remote_queue_blocks
            ),
            format!(
                "remote fills      {} ({}) from {} fetch(es), {} miss(es); fill {:.2} ms mean, {:.2} ms max",
                r.remote_fills,
                human_bytes(r.remote_fill_bytes),
                r.remote_fetches,
                r.remote_misses,
                r.remote_fill_ms_mean,
                r.remote_fill_ms_max
            ),
            format!(
                "remote errors     {} failed or timed out, {} corrupt and {} failed authentication (refused), {} fetch(es) cancelled at the deadline",
                r.remote_errors, r.remote_corrupt, r.remote_auth_failures, r.remote_fetches_cancelled
            ),
        ]
    }

    fn watch_lines(&self, _s: &Stats, _prev: Option<(f64, &Stats)>) -> Vec<String> {
        Vec::new()
    }
}
