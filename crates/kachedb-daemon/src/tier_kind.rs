//! How a tier is set up and shown, from its own module: its flags of
//! `kachedb serve` (a clap `Args` of the tier's), the configuration they give
//! ([`TierSetup`], which starts the tier), and its lines of `kachedb stats`
//! and of the watch view. Each tier's module has one [`TierKind`]; the list
//! of them, `crate::tiers::TIERS`, is the one place that names the tiers.

use crate::metrics::Metrics;
use crate::tier::{Tier, TierError, TierEvents};
use kachedb_shm::control::{Stats, TenantStats};
use kachedb_shm::Region;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// What `kachedb serve`'s own flags say that a tier's configuration may
/// depend on.
#[derive(Clone, Copy, Debug)]
pub struct ServeFlags<'a> {
    /// Megaslab bytes (`--size`, or its default).
    pub slab_bytes: u64,
    /// `--tenant-limit NAME=SIZE`.
    pub tenant_limits: &'a [(String, u64)],
    /// `--tenant-limit-default`.
    pub tenant_limit_default: Option<u64>,
    /// `--tenant-accounting on`.
    pub tenant_accounting: bool,
}

/// What a tier is started with.
pub struct Start {
    /// The daemon's region (the tier reaches the megaslab through a
    /// [`SlabGate`](crate::tier::gate::SlabGate) over it).
    pub region: Arc<Region>,
    /// Where the tier's reports go.
    pub events: TierEvents,
    /// The daemon's metrics (the tier's cells: `Metrics::tier`).
    pub metrics: Arc<Metrics>,
    /// The descriptors the daemon taken over handed over under this tier's
    /// [`name`](TierSetup::name) (`StoppedTier::handover_fds`); empty on a
    /// fresh start.
    pub adopt: Vec<OwnedFd>,
    /// Taking over: the tier touches its storage only once
    /// [`Tier::release`]d.
    pub held: bool,
    /// The KV event publisher's queue, while the daemon publishes: a tier
    /// with an index of its own (the disk tier's) publishes it there
    /// (medium `DISK`, docs/events.md).
    pub kv_events: Option<crate::kv_events::TierSink>,
}

impl std::fmt::Debug for Start {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Start").field("events", &self.events).field("held", &self.held).finish_non_exhaustive()
    }
}

/// A tier's configuration: what the daemon starts it from.
pub trait TierSetup: Send + Sync + std::fmt::Debug {
    /// The tier's name: the one its descriptors are handed over under in a
    /// takeover.
    fn name(&self) -> &'static str;

    /// One line for the log once the daemon serves (what the tier is on).
    fn describe(&self) -> String;

    /// Starts the tier (checks what only starting can check).
    fn start(&self, at: Start) -> Result<Box<dyn Tier>, TierError>;
}

/// A tier's parsed flags of `kachedb serve`.
pub trait TierFlags: Send + Sync + std::fmt::Debug {
    /// The tier's configuration, `None` when the flags do not ask for the
    /// tier; `Err`: what is wrong with them, for the user.
    fn setup(&self, serve: &ServeFlags<'_>) -> Result<Option<Arc<dyn TierSetup>>, String>;
}

/// A kind of tier the daemon is built with: what the generic layers (the
/// daemon's start, `kachedb serve`'s flags, `kachedb stats` and its watch
/// view) ask of it.
pub trait TierKind: Sync {
    /// Adds the tier's flags to `kachedb serve`'s (`clap::Args::augment_args`
    /// of its own `Args`).
    fn flags(&self, cmd: clap::Command) -> clap::Command;

    /// Reads them back from what `kachedb serve` parsed.
    fn parse(&self, m: &clap::ArgMatches) -> Result<Arc<dyn TierFlags>, clap::Error>;

    /// Registers the tier's cells with `metrics` (`Metrics::tier`), so that
    /// the stats carry its rows (zeros while it is off) whether or not it
    /// starts.
    fn register(&self, metrics: &Metrics);

    /// Its lines of `kachedb stats` (none while it is off).
    fn stats_lines(&self, s: &Stats) -> Vec<String>;

    /// Its lines of `kachedb stats --watch` (none while it is off); `prev`:
    /// the seconds since the sample before, and that sample.
    fn watch_lines(&self, s: &Stats, prev: Option<(f64, &Stats)>) -> Vec<String>;

    /// Whether tenant row `t` has a limit on this tier (the tenants'
    /// tables are then shown).
    fn tenant_limited(&self, _t: &TenantStats) -> bool {
        false
    }
}
