//! The control socket's messages, as types: what a client asks
//! ([`ControlRequest`]), what the daemon answers ([`Reply`] of a [`HelloReply`]
//! or a [`StatsReply`], or a [`Refusal`]), the daemon's [`Stats`], the protocol
//! version, and the framing (one JSON object per `\n`-terminated line, at most
//! [`MAX_LINE_LEN`] bytes: [`to_line`], [`from_line`], [`read_line`],
//! [`LineBuffer`]).
//!
//! Both ends and the CLI use these types, so the JSON on the wire
//! (`docs/PROTOCOL.md`, "Control socket") is written down here once. Unknown
//! fields are ignored and missing ones take their default, so a client and a
//! daemon one field apart still understand each other; the version in
//! [`ControlRequest::Hello`] is what must match.

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::io::{BufRead, Read};

/// Version of the control protocol; the daemon refuses a hello with another.
pub const PROTOCOL_VERSION: u32 = 1;

/// Longest control message, bytes (its newline excluded).
pub const MAX_LINE_LEN: usize = 64 * 1024;

/// What a client sends on the control socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// `{"op":"hello","version":1,"pid":N}`: asks for a channel and the
    /// region fd. The connection then stays open for the client's life.
    Hello {
        /// [`PROTOCOL_VERSION`] of the client (0 when absent: refused).
        #[serde(default)]
        version: u32,
        /// The client's pid, for logs (the daemon trusts `SO_PEERCRED`).
        #[serde(default)]
        pid: u32,
        /// The tenant this client's blocks and requests count for
        /// (`"tenant":"NAME"`, a [`check_tenant_name`] name); absent: the
        /// [`DEFAULT_TENANT`]. Optional both ways: a daemon that does not
        /// know the field ignores it, a client that does not send it is
        /// the default tenant's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tenant: Option<String>,
    },
    /// `{"op":"stats"}`: asks for [`Stats`]; answered after every frame
    /// already published on the rings has been served.
    Stats,
    /// `{"op":"takeover","state_versions":[2]}`: a new daemon of the same
    /// user asks the running one to hand over everything (`kachedb serve
    /// --takeover`; docs/takeover.md). `state_versions` are the state formats
    /// the asker reads; the answer is a [`TakeoverOffer`] or a refusal.
    Takeover {
        /// State format versions the new daemon understands.
        #[serde(default)]
        state_versions: Vec<u32>,
    },
    /// `{"op":"takeover_go"}`: the new daemon's answer to a
    /// [`TakeoverPrepare`]: it is there and reading. Only then does the
    /// running daemon stop its serve loop and send everything, so an asker
    /// that goes silent after asking costs its clients nothing.
    TakeoverGo,
}

/// The running daemon's first answer to a takeover request it accepts
/// (`{"ok":true,"daemon_pid":N,"pause_ms":M}`): say
/// [`ControlRequest::TakeoverGo`] to get the [`TakeoverOffer`]. From the
/// go on, the running daemon's clients wait (at most `pause_ms`, its
/// `--takeover-pause-ms`) until the new daemon answers `ready`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeoverPrepare {
    /// The running daemon's pid.
    pub daemon_pid: u32,
    /// The longest its clients wait, from the go to the verdict, ms.
    pub pause_ms: u64,
}

/// The running daemon's answer to a takeover request. The region memfd, the
/// listening socket, the instance lock and, if `metrics_listener`, the
/// metrics listener travel with this line (`SCM_RIGHTS`, in that order); then
/// `fd_batches` single bytes `F`, each with up to [`TAKEOVER_FDS_PER_BATCH`]
/// client connections; then the serve loop's state (`serve_state_bytes` of
/// bytes) and the control thread's (`control_state_bytes`). The new daemon
/// answers with a [`TakeoverVerdict`] line; after `Ready` the old one stops
/// serving and confirms with a [`TakeoverDone`] reply.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeoverOffer {
    /// The format of the state that follows.
    pub state_version: u32,
    /// Bytes of the serve loop's state.
    pub serve_state_bytes: u64,
    /// Bytes of the control thread's state.
    pub control_state_bytes: u64,
    /// Single-byte messages carrying client connections.
    pub fd_batches: u32,
    /// Client connections handed over.
    pub connections: u32,
    /// Whether the metrics listener travels with the offer.
    pub metrics_listener: bool,
    /// The running daemon's pid.
    pub daemon_pid: u32,
    /// Descriptors of the tiers' storage that travel with the offer, after
    /// the metrics listener (the serve state says whose).
    #[serde(default)]
    pub tier_fds: u32,
}

/// Most file descriptors in one takeover batch (the kernel takes up to 253
/// in one `SCM_RIGHTS` message).
pub const TAKEOVER_FDS_PER_BATCH: usize = 200;

/// The new daemon's word once it has the offer: it serves from here on
/// (`{"op":"ready"}`), or it refuses and the old daemon goes on serving.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TakeoverVerdict {
    /// Everything was received and understood.
    Ready,
    /// Something was not; the old daemon keeps serving.
    Refuse {
        /// Why.
        error: String,
    },
}

/// The old daemon's last line: it has stopped serving for good.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeoverDone {
    /// The old daemon's pid (it exits next).
    pub daemon_pid: u32,
}

impl ControlRequest {
    /// The hello of this process at this protocol version.
    pub fn hello() -> Self {
        ControlRequest::Hello { version: PROTOCOL_VERSION, pid: std::process::id(), tenant: None }
    }

    /// The hello of this process for `tenant` (`None`: the default tenant).
    pub fn hello_as(tenant: Option<&str>) -> Self {
        ControlRequest::Hello { version: PROTOCOL_VERSION, pid: std::process::id(), tenant: tenant.map(str::to_owned) }
    }
}

/// The tenant of a client that names none (and the name a client may give
/// to mean the same).
pub const DEFAULT_TENANT: &str = "default";

/// The tenant that clients are counted in once the daemon already counts
/// [`MAX_TENANTS`] tenants; no client can name it (names start with a
/// letter or digit).
pub const OTHER_TENANT: &str = "_other";

/// Most tenants the daemon counts apart, [`DEFAULT_TENANT`] and
/// [`OTHER_TENANT`] included (so the `tenant` label of the metrics has at
/// most this many values).
pub const MAX_TENANTS: usize = 64;

/// Longest tenant name, bytes.
pub const MAX_TENANT_NAME_LEN: usize = 64;

/// Whether `name` may name a tenant: 1 to [`MAX_TENANT_NAME_LEN`] bytes of
/// ASCII letters, digits, `_`, `-` and `.`, the first a letter or digit
/// (a Prometheus label value as it is, and never [`OTHER_TENANT`]). The
/// one place this rule is written: the client checks before its hello, the
/// daemon at hello and at `--tenant-limit`.
pub fn check_tenant_name(name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    let first_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    if name.len() > MAX_TENANT_NAME_LEN || !first_ok || !name.chars().all(ok_char) {
        return Err(format!(
            "tenant name {name:?} is not 1 to {MAX_TENANT_NAME_LEN} ASCII letters, digits, '_', '-' or '.' starting with a letter or digit"
        ));
    }
    Ok(())
}

/// `NAME=SIZE` as the flags that give a tenant a limit take it
/// (`kachedb serve --tenant-limit team-a=1GiB`).
pub fn parse_tenant_limit(s: &str) -> Result<(String, u64), String> {
    let (name, size) = s.split_once('=').ok_or_else(|| format!("{s:?}: give NAME=SIZE, e.g. team-a=1GiB"))?;
    check_tenant_name(name)?;
    Ok((name.to_owned(), crate::units::parse_size(size)?))
}

/// The daemon's answer: `{"ok":true, …the fields of T}` or, refused,
/// `{"ok":false,"error":"…what to do…"}` (after which the daemon closes the
/// connection).
#[derive(Clone, Debug, PartialEq)]
pub enum Reply<T> {
    /// `ok: true` and the answer.
    Accepted(T),
    /// `ok: false` and why.
    Refused(Refusal),
}

/// Why the daemon refused a request; the message says what to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// The reason (empty when the daemon gave none).
    #[serde(default)]
    pub error: String,
}

impl Refusal {
    /// A refusal for `why`.
    pub fn new(why: impl Into<String>) -> Self {
        Self { error: why.into() }
    }

    /// The reason, or "no reason given".
    pub fn reason(&self) -> &str {
        if self.error.is_empty() {
            "no reason given"
        } else {
            &self.error
        }
    }
}

/// The refusal in a reply line, if the line is one (whatever an accepted
/// reply would have carried).
pub fn refusal_in(line: &[u8]) -> Option<Refusal> {
    match from_line::<Reply<serde::de::IgnoredAny>>(line).ok()? {
        Reply::Refused(r) => Some(r),
        Reply::Accepted(_) => None,
    }
}

impl<T: Serialize> Serialize for Reply<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Accepted<'a, T> {
            ok: bool,
            #[serde(flatten)]
            body: &'a T,
        }
        #[derive(Serialize)]
        struct Refused<'a> {
            ok: bool,
            error: &'a str,
        }
        match self {
            Reply::Accepted(body) => Accepted { ok: true, body }.serialize(s),
            Reply::Refused(r) => Refused { ok: false, error: &r.error }.serialize(s),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Reply<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // `ok` decides how to read the rest; JSON objects are small here.
        let v = serde_json::Value::deserialize(d)?;
        match v.get("ok") {
            Some(serde_json::Value::Bool(true)) => T::deserialize(v).map(Reply::Accepted).map_err(D::Error::custom),
            Some(serde_json::Value::Bool(false)) => {
                Refusal::deserialize(v).map(Reply::Refused).map_err(D::Error::custom)
            }
            _ => Err(D::Error::custom("a control reply needs a boolean \"ok\"")),
        }
    }
}

/// The answer to a hello; the region fd travels with this line (`SCM_RIGHTS`).
/// Every field is required.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    /// The channel (pair of rings) given to this client.
    pub channel: u32,
    /// The region's random generation (must match the attached region's header).
    pub generation: u64,
    /// Region bytes.
    pub region_len: u64,
    /// `LAYOUT_VERSION` of the daemon's region.
    pub layout_version: u32,
    /// The daemon's pid.
    pub daemon_pid: u32,
}

/// The answer to a stats request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatsReply {
    /// The daemon's stats.
    pub stats: Stats,
}

/// What `kachedb stats --json` prints and Python's `stats()` returns: one flat
/// JSON object (the sections below are flattened into it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    /// The block store's counters and gauges.
    #[serde(flatten)]
    pub store: StoreStats,
    /// The serve loop's counters.
    #[serde(flatten)]
    pub serve: ServeStats,
    /// Frames served per second over the last whole second (0 when idle for 3 s).
    pub ops_per_s: f64,
    /// Region bytes.
    pub region_bytes: u64,
    /// Megaslab bytes.
    pub slab_bytes: u64,
    /// Channels (clients connected at once).
    pub channels: u32,
    /// Slots per ring.
    pub ring_capacity: u32,
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// The daemon's pid.
    pub daemon_pid: u32,
    /// The control socket's path.
    pub socket: String,
    /// Whether the store's invariants hold, checked for this answer: in full
    /// when `invariants_full` (a daemon started with `--check-invariants`;
    /// `O(n log n)`, for tests and debugging), else the `O(1)` cross-checks of
    /// its counters (bytes used + free = total, pins and reservations counted
    /// two ways agree, evictable ≤ used).
    pub invariants_ok: bool,
    /// Whether `invariants_ok` comes from the full check.
    pub invariants_full: bool,
    /// Channels held back until the process of a client disconnected as corrupt exits.
    pub channels_quarantined: u64,
    /// Per tenant (`kachedb serve --tenant-limit`, docs/metrics.md
    /// "Tenants"): one object per tenant the daemon counts now, the default
    /// tenant first. Their `bytes`, `blocks`, hits, misses and evictions add
    /// up to the store's totals exactly.
    pub tenants: Vec<TenantStats>,
    /// Each tier's rows, flattened into the object beside the others: keys
    /// named `<tier>_<figure>` (`kachedb_daemon`'s tier modules write them,
    /// every tier the daemon is built with, zeros while it is off; docs/tiers.md).
    /// A key this version does not know of lands here too, so a reply
    /// passes through whole.
    #[serde(flatten)]
    pub tiers: TierRows,
}

/// A section of rows of the stats object that the tiers fill: key and
/// value, flattened into the object that holds it.
pub type TierRows = std::collections::BTreeMap<String, serde_json::Value>;

/// One tenant's share of the store (an element of [`Stats::tenants`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantStats {
    /// The tenant's name ([`DEFAULT_TENANT`], [`OTHER_TENANT`] or a client's).
    pub name: String,
    /// Its limit on `bytes` (`--tenant-limit`, `--tenant-limit-default`);
    /// absent: none.
    pub limit_bytes: Option<u64>,
    /// Clients connected as this tenant now.
    pub clients: u64,
    /// Megaslab bytes in its extents: its blocks, its deleted-but-pinned
    /// blocks and its reservations (what the limit bounds).
    pub bytes: u64,
    /// Its committed blocks that GET can find.
    pub blocks: u64,
    /// Bytes of those whose chain back to its root is whole in the megaslab.
    pub reachable_bytes: u64,
    /// Bytes of the others: a block before them in their chain is gone.
    pub orphaned_bytes: u64,
    /// GET requests of its clients that found their key.
    pub get_hits: u64,
    /// GET requests of its clients that did not.
    pub get_misses: u64,
    /// LOOKUP requests of its clients that found their key.
    pub lookup_hits: u64,
    /// LOOKUP requests of its clients that did not.
    pub lookup_misses: u64,
    /// Its blocks evicted (by its own RESERVEs or, for a tenant without a
    /// limit, by anyone's).
    pub evictions: u64,
    /// Extent bytes of those.
    pub evicted_bytes: u64,
    /// Tensor bytes its clients committed.
    pub stored_bytes: u64,
    /// RESERVEs refused because they could not fit within its limit.
    pub limit_refusals: u64,
    /// Distinct keys its clients asked for (GET, LOOKUP) in the current
    /// request window (a HyperLogLog estimate, ~1.6 % standard error).
    pub window_distinct_keys: u64,
    /// Keys its clients asked for in the current request window.
    pub window_key_requests: u64,
    /// Its columns of each tier's (keys `<tier>_<figure>`, as
    /// [`Stats::tiers`]).
    #[serde(flatten)]
    pub tiers: TierRows,
}

impl Stats {
    /// The JSON object, on one line without its newline.
    pub fn to_json(&self) -> String {
        // Serialising this struct cannot fail: string keys, no custom
        // serialisers that fail (non-finite floats become `null`).
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Counters and gauges of the daemon's block store.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreStats {
    /// Open sessions.
    pub sessions: u64,
    /// Committed blocks linked under their key (what GET can find).
    pub blocks: u64,
    /// Deleted or replaced blocks still held by pins.
    pub unlinked_blocks: u64,
    /// Live reservations (not yet committed or aborted).
    pub reserved: u64,
    /// Pins held, all sessions and blocks together.
    pub pins: u64,
    /// Bytes in allocated extents (blocks, unlinked blocks, reservations).
    pub bytes_used: u64,
    /// Bytes in free extents.
    pub bytes_free: u64,
    /// Bytes of the megaslab under management.
    pub bytes_total: u64,
    /// Largest free extent, bytes.
    pub largest_free_bytes: u64,
    /// Bytes held by linked unpinned blocks (what eviction could free).
    pub evictable_bytes: u64,
    /// Free extents (a fragmentation measure).
    pub free_extents: u64,
    /// Blocks evicted since start.
    pub evictions: u64,
    /// Extent bytes freed by eviction since start.
    pub evicted_bytes: u64,
    /// Committed blocks that replaced an older block of the same key.
    pub replaced: u64,
    /// The eviction policy (`kachedb serve --eviction`): `"chain"` (leaves
    /// first, least recently used among them) or `"lru"` (docs/eviction.md).
    pub eviction_policy: String,
    /// Linked blocks whose parent (named at COMMIT) is linked: chain links now.
    pub chained_blocks: u64,
    /// Extent bytes of the linked blocks whose chain back to its root (a
    /// block committed naming no parent) is whole in the megaslab: what a
    /// LOOKUP from the chain's head reaches.
    pub reachable_bytes: u64,
    /// Extent bytes of the other linked blocks: a block before them in
    /// their chain was missing at their COMMIT, or was deleted, replaced or
    /// (under `lru`) evicted since. `reachable_bytes + orphaned_bytes` is
    /// the bytes of the linked blocks.
    pub orphaned_bytes: u64,
    /// Distinct keys asked for (GET, LOOKUP) in the current request window
    /// (`kachedb serve --request-window`; a HyperLogLog estimate, ~0.8 %
    /// standard error). 0 with `--tenant-accounting off`.
    pub window_distinct_keys: u64,
    /// Keys asked for (GET, LOOKUP) in the current request window.
    pub window_key_requests: u64,
    /// Seconds the current request window has run.
    pub window_s: f64,
    /// `1 - window_distinct_keys / window_key_requests`: the hit ratio an
    /// unbounded cache would have had on the window's requests (every
    /// first request of a key misses); 0 before any request.
    pub hit_ratio_ceiling: f64,
    /// The window's distinct keys times the mean extent bytes of a linked
    /// block: the bytes the window's working set would take.
    pub working_set_bytes: u64,
    /// COMMITs that named a parent that was not linked (absent, or the block's
    /// own key): committed without a parent.
    pub parents_missing: u64,
    /// Chain links cut because the parent was deleted, replaced or evicted
    /// (the child stays, as a block without a parent).
    pub links_cut: u64,
    /// Of those, links cut by eviction: each one left a linked block that a
    /// LOOKUP of its chain no longer reaches. Always 0 under `chain`.
    pub links_cut_by_eviction: u64,
    /// PING requests.
    pub pings: u64,
    /// RESERVE requests (any outcome).
    pub reserves: u64,
    /// COMMIT requests (any outcome).
    pub commits: u64,
    /// ABORT requests (any outcome).
    pub aborts: u64,
    /// GET requests (any outcome).
    pub gets: u64,
    /// GET requests that found their key.
    pub get_hits: u64,
    /// RELEASE requests (any outcome).
    pub releases: u64,
    /// LOOKUP requests (any outcome).
    pub lookups: u64,
    /// LOOKUP requests that found their key.
    pub lookup_hits: u64,
    /// DELETE requests (any outcome).
    pub deletes: u64,
    /// DELETE requests that found their key.
    pub delete_hits: u64,
    /// STATS requests.
    pub stats_requests: u64,
    /// Completions with status `NOT_FOUND`.
    pub not_found: u64,
    /// Completions with status `OUT_OF_MEMORY`.
    pub out_of_memory: u64,
    /// Of those, the ones refused by the per-client or per-uid limit
    /// (`--max-client-bytes`, `--max-uid-bytes`).
    pub client_limit_hits: u64,
    /// Of those, RESERVEs refused because they could not fit within their
    /// tenant's limit (`--tenant-limit`); nothing was evicted for them.
    pub tenant_limit_hits: u64,
    /// Completions with status `INVALID`.
    pub invalid: u64,
    /// Completions with status `BAD_HANDLE`.
    pub bad_handle: u64,
    /// Completions with status `TOO_LARGE`.
    pub too_large: u64,
    /// Completions with status `DENIED`: COMMITs that would have replaced,
    /// and DELETEs, of a block of a tenant bound to other users or groups
    /// (`kachedb serve --tenant-uid` / `--tenant-gid`); nothing changed.
    pub denied: u64,
    /// Completions with status `INTERNAL`, plus internal errors met while
    /// closing sessions (each one is a bug).
    pub internal: u64,
}

/// Counters of the daemon's serve loop.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServeStats {
    /// Frames served (decoded or rejected).
    pub ops: u64,
    /// Frames that failed decoding (answered `INVALID`).
    pub rejected_frames: u64,
    /// Clients connected now.
    pub clients_connected: u64,
    /// Clients connected since start.
    pub clients_total: u64,
    /// Clients disconnected because their rings were corrupt, or because
    /// they left their completion ring full past `--stuck-client-timeout-ms`.
    pub clients_kicked: u64,
    /// Wake syscalls made for parked clients.
    pub wakeups_sent: u64,
    /// Times the serve loop parked on the doorbell.
    pub parks: u64,
}

/// Why a control line could not be read, written or understood.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// More than [`MAX_LINE_LEN`] bytes without a newline.
    #[error("control message longer than {} KiB", MAX_LINE_LEN / 1024)]
    TooLong,
    /// The peer closed the connection before sending a line.
    #[error("the connection closed before a full control message")]
    Closed,
    /// Reading or writing the socket failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The line is not the JSON of the expected message.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
}

/// One message as a line: its JSON and a `\n`.
pub fn to_line<T: Serialize>(msg: &T) -> Result<Vec<u8>, LineError> {
    let mut line = serde_json::to_vec(msg)?;
    line.push(b'\n');
    Ok(line)
}

/// One message from a line (its `\n`, if still there, is ignored).
pub fn from_line<T: DeserializeOwned>(line: &[u8]) -> Result<T, LineError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    if line.len() > MAX_LINE_LEN {
        return Err(LineError::TooLong);
    }
    Ok(serde_json::from_slice(line)?)
}

/// Reads one line from a blocking reader: up to its `\n`, or up to the end of
/// the stream if the peer closed after a last line without one. Bytes the
/// reader buffered past the line stay in it.
pub fn read_line(r: &mut impl BufRead) -> Result<Vec<u8>, LineError> {
    let mut line = Vec::new();
    r.by_ref().take(MAX_LINE_LEN as u64 + 1).read_until(b'\n', &mut line)?;
    match line.last() {
        Some(b'\n') => {
            line.pop();
            Ok(line)
        }
        None => Err(LineError::Closed),
        Some(_) if line.len() > MAX_LINE_LEN => Err(LineError::TooLong),
        Some(_) => Ok(line),
    }
}

/// Bytes of a stream read piecemeal (a non-blocking socket, `recvmsg`), cut
/// into lines.
#[derive(Debug, Default)]
pub struct LineBuffer {
    buf: Vec<u8>,
}

impl LineBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes read. Fails once more than [`MAX_LINE_LEN`] bytes wait
    /// to be taken: a peer that sends that much at once is not speaking this
    /// protocol.
    pub fn extend(&mut self, bytes: &[u8]) -> Result<(), LineError> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() > MAX_LINE_LEN {
            return Err(LineError::TooLong);
        }
        Ok(())
    }

    /// Takes the first complete line, without its `\n`.
    pub fn next_line(&mut self) -> Option<Vec<u8>> {
        let end = self.buf.iter().position(|&b| b == b'\n')?;
        let mut line: Vec<u8> = self.buf.drain(..=end).collect();
        line.pop();
        Some(line)
    }

    /// Whether a complete line is waiting.
    pub fn has_line(&self) -> bool {
        self.buf.contains(&b'\n')
    }

    /// The bytes read but not yet taken as lines.
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(line: &[u8]) -> serde_json::Value {
        serde_json::from_slice(line).unwrap()
    }

    #[test]
    fn requests_on_the_wire() {
        let hello = ControlRequest::Hello { version: 1, pid: 42, tenant: None };
        let line = to_line(&hello).unwrap();
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(json(&line), serde_json::json!({"op": "hello", "version": 1, "pid": 42}));
        assert_eq!(from_line::<ControlRequest>(&line).unwrap(), hello);
        // A tenant travels as one more field; a daemon that does not know it ignores it.
        let named = ControlRequest::Hello { version: 1, pid: 42, tenant: Some("team-a".into()) };
        let line = to_line(&named).unwrap();
        assert_eq!(json(&line), serde_json::json!({"op": "hello", "version": 1, "pid": 42, "tenant": "team-a"}));
        assert_eq!(from_line::<ControlRequest>(&line).unwrap(), named);
        assert_eq!(json(&to_line(&ControlRequest::Stats).unwrap()), serde_json::json!({"op": "stats"}));
        assert_eq!(from_line::<ControlRequest>(br#"{"op":"stats"}"#).unwrap(), ControlRequest::Stats);
        // A hello without a version reads as version 0 (which the daemon refuses with a reason).
        assert_eq!(
            from_line::<ControlRequest>(br#"{"op":"hello"}"#).unwrap(),
            ControlRequest::Hello { version: 0, pid: 0, tenant: None }
        );
        for bad in [&b"not json"[..], br#"{"op":"launch"}"#, br#"{"version":1}"#, b"[]"] {
            assert!(from_line::<ControlRequest>(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn replies_on_the_wire() {
        let hello = HelloReply { channel: 3, generation: 77, region_len: 1 << 30, layout_version: 1, daemon_pid: 9 };
        let line = to_line(&Reply::Accepted(hello.clone())).unwrap();
        assert_eq!(
            json(&line),
            serde_json::json!({"ok": true, "channel": 3, "generation": 77, "region_len": 1u64 << 30,
                               "layout_version": 1, "daemon_pid": 9})
        );
        assert_eq!(from_line::<Reply<HelloReply>>(&line).unwrap(), Reply::Accepted(hello));
        let refused = Reply::<HelloReply>::Refused(Refusal::new("all 4 channels are in use"));
        let line = to_line(&refused).unwrap();
        assert_eq!(json(&line), serde_json::json!({"ok": false, "error": "all 4 channels are in use"}));
        assert_eq!(from_line::<Reply<HelloReply>>(&line).unwrap(), refused);
        // Any reply can be read as a refusal or not, whatever it carries.
        assert_eq!(refusal_in(&line), Some(Refusal::new("all 4 channels are in use")));
        assert_eq!(refusal_in(&to_line(&Reply::Accepted(StatsReply::default())).unwrap()), None);
        match from_line::<Reply<StatsReply>>(br#"{"ok":false}"#).unwrap() {
            Reply::Refused(r) => assert_eq!(r.reason(), "no reason given"),
            other => panic!("{other:?}"),
        }
        assert!(from_line::<Reply<HelloReply>>(br#"{"channel":1}"#).is_err());
    }

    #[test]
    fn stats_are_one_flat_object() {
        let mut st = Stats { ops_per_s: 1.5, socket: "/tmp/k.sock".into(), invariants_ok: true, ..Stats::default() };
        st.store.blocks = 2;
        st.serve.clients_connected = 1;
        let v: serde_json::Value = serde_json::from_str(&st.to_json()).unwrap();
        let m = v.as_object().unwrap();
        for key in [
            "blocks",
            "bytes_used",
            "bytes_free",
            "bytes_total",
            "pins",
            "reserved",
            "evictions",
            "internal",
            "clients_connected",
            "clients_kicked",
            "rejected_frames",
            "ops",
            "ops_per_s",
            "region_bytes",
            "uptime_s",
            "daemon_pid",
            "socket",
            "invariants_ok",
            "channels_quarantined",
        ] {
            assert!(m.contains_key(key), "{key} missing from {v}");
        }
        assert!(m.values().all(|x| !x.is_object()), "nested: {v}");
        assert_eq!((v["blocks"].as_u64(), v["clients_connected"].as_u64()), (Some(2), Some(1)));
        let reply = to_line(&Reply::Accepted(StatsReply { stats: st.clone() })).unwrap();
        match from_line::<Reply<StatsReply>>(&reply).unwrap() {
            Reply::Accepted(r) => assert_eq!(r.stats, st),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tier_rows_pass_through_flat_both_ways() {
        // What a daemon with tiers sends: the tiers' keys beside the others,
        // and in each tenant row.
        let sent = serde_json::json!({
            "blocks": 2, "ops": 7, "socket": "/s", "tenants": [
                {"name": "default", "bytes": 1, "tier_a_bytes": 5, "tier_a_limit_bytes": null}
            ],
            "tier_a_writes": 3, "tier_a_on": true, "tier_b_fill_ms_mean": 1.5
        });
        let st: Stats = serde_json::from_value(sent.clone()).unwrap();
        assert_eq!((st.store.blocks, st.serve.ops, st.socket.as_str()), (2, 7, "/s"));
        assert_eq!(st.tiers.len(), 3, "only the tiers' keys land in the rows: {:?}", st.tiers);
        assert_eq!(st.tiers["tier_a_writes"], 3);
        assert_eq!(st.tenants[0].tiers.len(), 2, "{:?}", st.tenants[0].tiers);
        assert_eq!(st.tenants[0].bytes, 1);
        // Sent on unchanged: every key, same values, still flat.
        let again: serde_json::Value = serde_json::from_str(&st.to_json()).unwrap();
        for (k, v) in sent.as_object().unwrap() {
            if k != "tenants" {
                assert_eq!(&again[k], v, "{k}");
            }
        }
        assert_eq!(again["tenants"][0]["tier_a_limit_bytes"], serde_json::Value::Null);
        assert_eq!(again["tenants"][0]["tier_a_bytes"], 5);

        // A reader that types a tier's section (an older client's layout)
        // reads the same object; one that does not know the keys ignores them.
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Section {
            tier_a_writes: u64,
            tier_a_on: bool,
        }
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Older {
            blocks: u64,
            #[serde(flatten)]
            a: Section,
        }
        let old: Older = serde_json::from_str(&st.to_json()).unwrap();
        assert_eq!((old.blocks, old.a.tier_a_writes, old.a.tier_a_on), (2, 3, true));
    }

    #[test]
    fn tenant_names() {
        for good in ["default", "a", "team-a.prod_1", "0", &"x".repeat(MAX_TENANT_NAME_LEN)] {
            assert!(check_tenant_name(good).is_ok(), "{good}");
        }
        for bad in ["", OTHER_TENANT, "-a", ".a", "a b", "a\"b", "é", "a{", &"x".repeat(MAX_TENANT_NAME_LEN + 1)] {
            let e = check_tenant_name(bad).unwrap_err();
            assert!(e.contains("letters, digits"), "{bad}: {e}");
        }
    }

    #[test]
    fn line_framing() {
        let mut r = std::io::Cursor::new(b"{\"a\":1}\n{\"b\":2}".to_vec());
        assert_eq!(read_line(&mut r).unwrap(), b"{\"a\":1}");
        assert_eq!(read_line(&mut r).unwrap(), b"{\"b\":2}");
        assert!(matches!(read_line(&mut r), Err(LineError::Closed)));
        let long = vec![b' '; MAX_LINE_LEN + 1];
        assert!(matches!(read_line(&mut std::io::Cursor::new(long.clone())), Err(LineError::TooLong)));
        assert!(matches!(from_line::<ControlRequest>(&long), Err(LineError::TooLong)));

        let mut b = LineBuffer::new();
        b.extend(b"{\"op\":").unwrap();
        assert!(!b.has_line() && b.next_line().is_none());
        b.extend(b"\"stats\"}\n{\"op\"").unwrap();
        assert_eq!(from_line::<ControlRequest>(&b.next_line().unwrap()).unwrap(), ControlRequest::Stats);
        assert!(b.next_line().is_none());
        assert!(matches!(b.extend(&long), Err(LineError::TooLong)));
    }
}
