//! `kachedb serve --events-*`: the KV event publisher's flags
//! (`kachedb_daemon::kv_events`, docs/events.md).

use clap::Args;
use kachedb_daemon::kv_events::{EventsConfig, DEFAULT_QUEUE_CHANGES, DEFAULT_REPLAY_BATCHES};

/// The KV event publisher's options of `kachedb serve`.
#[derive(Debug, Args, Clone, Default)]
pub struct EventsArgs {
    /// Publish the store's KV events (a block stored, removed, all cleared) in
    /// vLLM's `KVEventBatch` format on a ZMQ PUB socket bound here, e.g.
    /// `tcp://127.0.0.1:5557` or `tcp://*:5557` (docs/events.md). Off by default.
    #[arg(long, value_name = "ENDPOINT")]
    pub events_endpoint: Option<String>,
    /// Answer replay requests (vLLM's protocol; a snapshot of the index when
    /// the start asked for is no longer buffered) on a ZMQ ROUTER socket bound
    /// here, e.g. `tcp://127.0.0.1:5558`. Needs --events-endpoint.
    #[arg(long, value_name = "ENDPOINT", requires = "events_endpoint")]
    pub events_replay_endpoint: Option<String>,
    /// The topic frame of every event message (subscribers filter on it).
    #[arg(long, value_name = "TOPIC", default_value = "", requires = "events_endpoint")]
    pub events_topic: String,
    /// Event batches kept for replay.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_REPLAY_BATCHES, requires = "events_endpoint")]
    pub events_replay_batches: usize,
    /// Most index changes queued between the serve loop and the publisher;
    /// past it they are dropped (counted) and a snapshot follows.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_QUEUE_CHANGES, requires = "events_endpoint")]
    pub events_queue: usize,
}

/// The publisher's config, if `--events-endpoint` is given; or what is wrong.
pub fn events_config(a: &EventsArgs) -> Result<Option<EventsConfig>, String> {
    let Some(endpoint) = &a.events_endpoint else { return Ok(None) };
    let mut cfg = EventsConfig::new(endpoint).map_err(|e| format!("--events-endpoint {e}"))?;
    if let Some(replay) = &a.events_replay_endpoint {
        cfg = cfg.with_replay(replay).map_err(|e| format!("--events-replay-endpoint {e}"))?;
        if cfg.replay_endpoint.as_deref() == Some(cfg.endpoint.as_str()) {
            return Err("--events-replay-endpoint must differ from --events-endpoint".into());
        }
    }
    if a.events_queue == 0 {
        return Err("--events-queue must be at least 1".into());
    }
    cfg.topic = a.events_topic.clone();
    cfg.replay_batches = a.events_replay_batches;
    cfg.queue_changes = a.events_queue;
    Ok(Some(cfg))
}
