//! `kachedb serve --events-*`, the KV event publisher's flags, and `kachedb
//! events`, a live view of a publisher's stream (`kachedb_daemon::kv_events`,
//! docs/events.md).

use clap::Args;
use kachedb_daemon::kv_events::wire::decode_batch;
use kachedb_daemon::kv_events::{EventsConfig, DEFAULT_QUEUE_CHANGES, DEFAULT_REPLAY_BATCHES};
use std::io::Write;

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

/// Options of `kachedb events`.
#[derive(Debug, Args, Clone)]
pub struct WatchArgs {
    /// The publisher's PUB endpoint (`kachedb serve --events-endpoint`, or a vLLM engine's).
    #[arg(long, value_name = "ENDPOINT", default_value = "tcp://127.0.0.1:5557")]
    pub endpoint: String,
    /// Only messages whose topic starts with this.
    #[arg(long, value_name = "TOPIC", default_value = "")]
    pub topic: String,
    /// Hashes shown per event at most.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub hashes: usize,
    /// Stop after this many batches.
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
}

/// `kachedb events`: one line per batch received — its sequence number (and
/// a gap before it), then each event with its first hashes — until
/// interrupted or `--count` batches.
pub fn watch(a: &WatchArgs) -> Result<(), Box<dyn std::error::Error>> {
    use zeromq::{Socket, SocketRecv, SubSocket};
    let endpoint = kachedb_daemon::kv_events::normalize_endpoint(&a.endpoint).map_err(|e| format!("--endpoint {e}"))?;
    let endpoint = endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut sub = SubSocket::new();
        sub.subscribe(&a.topic).await?;
        sub.connect(&endpoint).await.map_err(|e| format!("connecting to {endpoint}: {e}"))?;
        eprintln!("kachedb: subscribed to {endpoint}; one line per batch (Ctrl-C stops)");
        let mut last: Option<u64> = None;
        let mut seen = 0u64;
        let out = std::io::stdout();
        while a.count.is_none_or(|n| seen < n) {
            let frames = sub.recv().await?.into_vec();
            let [_, seq, payload] = frames.as_slice() else {
                eprintln!("kachedb: a message of {} frames (3 expected) skipped", frames.len());
                continue;
            };
            let seq = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes).unwrap_or(u64::MAX);
            let mut line = match last {
                Some(l) if seq > l + 1 => format!("seq {seq} (gap: {} missed)", seq - l - 1),
                _ => format!("seq {seq}"),
            };
            last = Some(seq);
            seen += 1;
            match decode_batch(payload) {
                Ok(b) if b.events.is_empty() => line.push_str(": (empty)"),
                Ok(b) => {
                    for e in &b.events {
                        let shown: Vec<String> = e.hashes.iter().take(a.hashes).map(|h| format!("{h:#x}")).collect();
                        let more = e.hashes.len().saturating_sub(a.hashes);
                        line.push_str(&format!("  {}", e.kind));
                        if !e.hashes.is_empty() {
                            line.push_str(&format!(
                                " [{}{}]",
                                shown.join(" "),
                                if more > 0 { format!(" +{more}") } else { String::new() }
                            ));
                        }
                        if let Some(m) = &e.medium {
                            line.push_str(&format!(" {m}"));
                        }
                        if e.tokens > 0 {
                            line.push_str(&format!(" {} tokens", e.tokens));
                        }
                    }
                }
                Err(e) => line.push_str(&format!(": undecodable ({e})")),
            }
            let mut o = out.lock();
            writeln!(o, "{line}")?;
            o.flush()?;
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}
