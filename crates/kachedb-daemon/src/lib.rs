//! KacheDB daemon: the megaslab allocator ([`alloc`]), the block store
//! ([`store`]), the control socket thread ([`control`]) and who may act as
//! which tenant there ([`binding`]), the serve loop
//! (`serve`) and the daemon's start and shutdown ([`daemon`]).
//!
//! Arrows point one way: `daemon` starts `control` and runs `serve`; both
//! of those share only the channel pool ([`channels`]) and the event queue
//! ([`events`]) from `control` to `serve`. Both also count into the
//! [`metrics`] (atomics), which the optional HTTP endpoint ([`http`]) reads
//! on its own threads. The tiers behind the megaslab ([`TIERS`]: with
//! `--disk`, the [`disk`] tier; with `--remote`, the [`remote`] tier) run
//! their own threads; `serve` drives them through one interface ([`tier`])
//! and hears from them through the same event queue. Each tier's module
//! holds all of it (flags, configuration, errors, counters, stats rows);
//! the other modules reach a tier only through [`TIERS`] (`tiers.rs`) and
//! what [`tier_kind`] says a tier gives.
//! With `--events-endpoint`, the [`kv_events`] publisher's thread sends the
//! store's index changes, which `serve` queues for it, to KV-aware routers.
#![warn(missing_docs)]

pub mod alloc;
pub mod binding;
pub mod channels;
pub mod control;
pub mod daemon;
pub mod disk;
pub mod events;
pub mod http;
pub mod kv_events;
pub mod lock;
pub mod metrics;
pub mod remote;
mod serve;
mod state_format;
pub mod store;
pub mod takeover;
pub mod tier;
pub mod tier_kind;
pub mod tiers;
mod waits;

pub use binding::TenantBinding;
pub use daemon::{Daemon, Ended, ServeConfig, ServeError, TakeoverSummary, TenantConfig};
pub use store::EvictionPolicy;
pub use tiers::TIERS;
