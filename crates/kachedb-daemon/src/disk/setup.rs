//! The disk tier's flags of `kachedb serve` (`--disk*`,
//! `--tenant-disk-limit*`), the configuration they give, and the tier's
//! entry in the daemon's list of tiers ([`KIND`]).

use super::cells::{DiskCells, TenantDiskStats};
use super::{index, Adopted, DiskConfig, DiskTier, WorkerClass, DEFAULT_QUEUE_BYTES, HANDOVER_NAME};
use crate::metrics::Metrics;
use crate::tier::{Admission, Tier, TierError};
use crate::tier_kind::{ServeFlags, Start, TierFlags, TierKind, TierSetup};
use kachedb_shm::control::{parse_tenant_limit, TenantStats, MAX_TENANTS};
use kachedb_shm::units::{human_bytes, parse_size};
use kachedb_shm::Stats;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

/// The disk tier's flags of `kachedb serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct DiskArgs {
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
    #[arg(long, default_value_t = super::DEFAULT_TIMEOUT_MS, value_name = "MS")]
    pub disk_timeout_ms: u64,
    /// How much nicer than the serve loop the disk tier's threads run (0 to 19).
    #[arg(long, default_value_t = super::DEFAULT_WORKER_NICE, value_name = "N",
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
    /// Blocks read ahead along a chain: a client's miss of a block filled
    /// from disk, and its first GET of a block read ahead, start fills of
    /// up to this many blocks after it in its chain (the child used last,
    /// and so on; at most 128MiB), into free megaslab space only (a guess
    /// never evicts a resident block; without room the files are read into
    /// the page cache instead), committed as the first blocks eviction
    /// takes until a client uses them. 0: off (docs/disk.md, "Read-ahead").
    #[arg(long, default_value_t = super::DEFAULT_READ_AHEAD, value_name = "BLOCKS")]
    pub disk_read_ahead: usize,
    /// Entries the disk tier's catalog (DIR/tmp/catalog: what a restart
    /// indexes the disk from without reading each block's header) may hold
    /// beyond twice the blocks on disk before a writer writes it anew (the
    /// writers wait meanwhile: one pass over the file, about a second at a
    /// million blocks). Larger: fewer rewrites, a longer file to read at start
    /// (docs/disk.md, "The catalog").
    #[arg(long, default_value_t = super::DEFAULT_CATALOG_SLACK, value_name = "ENTRIES")]
    pub disk_catalog_slack: u64,
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

impl DiskArgs {
    /// The checks of `--tenant-disk-limit` and `--tenant-disk-limit-default`
    /// against the other flags.
    fn check_tenant_limits(&self, serve: &ServeFlags<'_>) -> Result<(), String> {
        let given = !self.tenant_disk_limits.is_empty() || self.tenant_disk_limit_default.is_some();
        if given && !serve.tenant_accounting {
            return Err("--tenant-disk-limit and --tenant-disk-limit-default need --tenant-accounting on".into());
        }
        if given && self.disk.is_none() {
            return Err("--tenant-disk-limit and --tenant-disk-limit-default need --disk DIR".into());
        }
        let mut disk_names = BTreeSet::new();
        for (name, _) in &self.tenant_disk_limits {
            if !disk_names.insert(name) {
                return Err(format!("--tenant-disk-limit {name}=…: tenant {name:?} is named twice"));
            }
        }
        let named = serve.tenant_limits.iter().map(|(n, _)| n).chain(disk_names).collect::<BTreeSet<_>>().len();
        if named > MAX_TENANTS - 2 {
            return Err(format!(
                "--tenant-limit and --tenant-disk-limit name {named} tenants; the daemon counts at most {} besides `default` and `_other`",
                MAX_TENANTS - 2
            ));
        }
        Ok(())
    }

    /// The tenants' limits on disk bytes: `--tenant-disk-limit` (and its
    /// default) where given, else each `--tenant-limit`'s share of the
    /// megaslab applied to the disk (`disk_bytes`), rounded down to 4 KiB (a
    /// block file's unit).
    fn tenant_limits(&self, serve: &ServeFlags<'_>, disk_bytes: u64) -> index::Limits {
        let share = |limit: u64| {
            let b = u128::from(limit) * u128::from(disk_bytes) / u128::from(serve.slab_bytes.max(1));
            (b.min(u128::from(disk_bytes)) as u64) / 4096 * 4096
        };
        let mut named = self.tenant_disk_limits.clone();
        for (name, limit) in serve.tenant_limits {
            if !named.iter().any(|(n, _)| n == name) {
                named.push((name.clone(), share(*limit)));
            }
        }
        index::Limits { named, default: self.tenant_disk_limit_default.or(serve.tenant_limit_default.map(share)) }
    }
}

impl TierFlags for DiskArgs {
    fn setup(&self, serve: &ServeFlags<'_>) -> Result<Option<Arc<dyn TierSetup>>, String> {
        let Some(dir) = &self.disk else {
            if self.disk_size.is_some() {
                return Err("--disk-size needs --disk DIR".into());
            }
            self.check_tenant_limits(serve)?;
            return Ok(None);
        };
        let Some(size_bytes) = self.disk_size else {
            return Err("--disk needs --disk-size SIZE (the most bytes its blocks may take)".into());
        };
        if self.disk_timeout_ms == 0 {
            return Err("--disk-timeout-ms must be above 0".into());
        }
        self.check_tenant_limits(serve)?;
        Ok(Some(Arc::new(DiskConfig {
            dir: dir.clone(),
            size_bytes,
            queue_bytes: self.disk_queue_bytes.unwrap_or((serve.slab_bytes / 4).min(DEFAULT_QUEUE_BYTES)),
            timeout: std::time::Duration::from_millis(self.disk_timeout_ms),
            worker_nice: self.disk_worker_nice,
            worker_class: match self.disk_worker_class {
                DiskWorkerClass::Idle => WorkerClass::Idle,
                DiskWorkerClass::Normal => WorkerClass::Normal,
            },
            admission: match self.disk_admit {
                DiskAdmit::First => Admission::First,
                DiskAdmit::Second => Admission::Second,
            },
            tenant_limits: self.tenant_limits(serve, size_bytes),
            read_ahead: self.disk_read_ahead,
            catalog_slack: self.disk_catalog_slack,
        })))
    }
}

impl TierSetup for DiskConfig {
    fn name(&self) -> &'static str {
        HANDOVER_NAME
    }

    fn describe(&self) -> String {
        format!("disk tier {} ({}; index rebuilt in the background)", self.dir.display(), human_bytes(self.size_bytes))
    }

    /// Adopts the directory and lock the daemon taken over handed over
    /// (its two descriptors), if any.
    fn start(&self, at: Start) -> Result<Box<dyn Tier>, TierError> {
        let adopt = match <[_; 2]>::try_from(at.adopt) {
            Ok([dir, lock]) => Some(Adopted { dir, lock }),
            Err(_) => None,
        };
        Ok(Box::new(DiskTier::start(self.clone(), at.region, at.events, at.metrics, adopt, at.held, at.kv_events)?))
    }
}

/// The disk tier in the daemon's list of tiers (`crate::tiers::TIERS`).
pub static KIND: Disk = Disk;

/// The disk tier's [`TierKind`].
#[derive(Debug)]
pub struct Disk;

impl TierKind for Disk {
    fn flags(&self, cmd: clap::Command) -> clap::Command {
        <DiskArgs as clap::Args>::augment_args(cmd)
    }

    fn parse(&self, m: &clap::ArgMatches) -> Result<Arc<dyn TierFlags>, clap::Error> {
        Ok(Arc::new(<DiskArgs as clap::FromArgMatches>::from_arg_matches(m)?))
    }

    fn register(&self, metrics: &Metrics) {
        metrics.tier::<DiskCells>();
    }

    fn stats_lines(&self, s: &Stats) -> Vec<String> {
        super::view::stats_lines(s)
    }

    fn watch_lines(&self, s: &Stats, prev: Option<(f64, &Stats)>) -> Vec<String> {
        super::view::watch_lines(s, prev)
    }

    fn tenant_limited(&self, t: &TenantStats) -> bool {
        TenantDiskStats::of(t).disk_limit_bytes.is_some()
    }
}
