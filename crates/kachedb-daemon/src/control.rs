//! The control socket: the slow path. Accepts clients, authenticates them with
//! `SO_PEERCRED`, hands over the region fd (`SCM_RIGHTS`) and a channel, answers
//! `stats`, and notices at once (EOF) when a client goes away.
//!
//! A connection is a client's from its `hello` on and stays open for the
//! client's life; any other connection (one that has not said hello yet, a
//! `stats` asker) is closed once it has sent no complete request for
//! [`Access::hello_timeout`], so idle ones cannot use up `max_connections`.
//! Every connection the daemon closes goes through [`close`], which tells the
//! serve loop to drop a client's session (pins, reservations, channel).
//!
//! Runs on its own thread; tells the serve loop about clients through the
//! [`events`](crate::events) queue and takes channels from the
//! [`channels`](crate::channels) pool. Messages are `kachedb_shm::control`'s types.

use crate::binding::{self, PeerIds, TenantBinding};
use crate::channels::Channels;
use crate::events::{Event, EventSender};
use crate::metrics::{Metrics, Refusal as Refused};
use crate::takeover::{self, ConnState, ControlState, HandoverFds};
use kachedb_shm::control::{
    self, ControlRequest, HelloReply, LineBuffer, Refusal, Reply, StatsReply, PROTOCOL_VERSION,
};
use kachedb_shm::Region;
use rustix::event::{PollFd, PollFlags};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Who may connect, and how many at once.
#[derive(Clone, Debug)]
pub struct Access {
    /// The daemon's effective uid: peers with it are allowed.
    pub uid: u32,
    /// Extra groups whose members (by primary gid) are allowed.
    pub allow_gids: Vec<u32>,
    /// Tenants bound to uids and gids: which tenant an admitted peer acts
    /// as is decided at its hello ([`binding::tenant_for`]).
    pub bindings: Vec<TenantBinding>,
    /// Most connections open at once; one more is closed at accept.
    pub max_connections: usize,
    /// How long a connection that is not a client's may go without sending a
    /// complete request (from its accept, then from its last request) before
    /// it is closed.
    pub hello_timeout: Duration,
    /// How long one step of a takeover may take as a whole
    /// ([`takeover::STEP_TIMEOUT`] by default).
    pub takeover_timeout: Duration,
    /// How long the clients may wait during a takeover, from the new
    /// daemon's go to its verdict ([`takeover::PAUSE_LIMIT`] by default).
    pub takeover_pause: Duration,
}

/// How long the control thread stops accepting after `accept` failed for
/// want of file descriptors (EMFILE/ENFILE): the pending connection stays in
/// the backlog and the listener stays readable, so accepting again at once
/// would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// At most one log line per this interval about refused or failed accepts.
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

/// What the accept path remembers between calls.
#[derive(Default)]
struct AcceptState {
    /// Accepting pauses until then (after EMFILE/ENFILE).
    paused_until: Option<Instant>,
    /// When the last accept problem was logged, and how many went unlogged since.
    last_log: Option<Instant>,
    unlogged: u64,
}

impl AcceptState {
    /// Logs `msg` unless a line was written within [`ACCEPT_LOG_EVERY`].
    fn log(&mut self, msg: std::fmt::Arguments<'_>) {
        let now = Instant::now();
        if self.last_log.is_some_and(|t| now.duration_since(t) < ACCEPT_LOG_EVERY) {
            self.unlogged += 1;
            return;
        }
        let more = std::mem::take(&mut self.unlogged);
        tracing::warn!(event = "accept_trouble", suppressed = more, "{msg}");
        self.last_log = Some(now);
    }
}

pub(crate) struct Conn {
    stream: Arc<UnixStream>,
    lines: LineBuffer,
    /// Channel given to this connection, if it said hello.
    channel: Option<u32>,
    pid: i32,
    uid: u32,
    /// The peer's gid and supplementary groups when it connected
    /// (`SO_PEERCRED`, `SO_PEERGROUPS`), for the tenant bindings.
    gid: u32,
    groups: Vec<u32>,
    /// Why the daemon refused this connection, if it did (counted when it closes).
    refusal: Option<Refused>,
    /// The daemon closes this connection for a protocol error (the client
    /// did not hang up: its process may still write its rings).
    refused: bool,
    /// For a connection that is not a client's: since when it has sent no
    /// complete request (its accept, then its last request). `None` for a
    /// client.
    idle_since: Option<Instant>,
    /// It has sent at least one complete request.
    asked: bool,
    /// A new daemon asked to take over on this connection, reading these
    /// state versions, and was told to say go (`crate::takeover`).
    takeover_asked: Option<Vec<u32>>,
    /// … and said go: hand over now.
    takeover: Option<Vec<u32>>,
}

impl Conn {
    /// A connection handed over by the daemon this one took over from. The
    /// kernel keeps the peer's credentials from its connect with the socket,
    /// so its gid and groups are read again here (the handed-over state
    /// carries only its uid).
    pub(crate) fn taken_over(stream: Arc<UnixStream>, st: &ConnState) -> Conn {
        let mut lines = LineBuffer::new();
        let _ = lines.extend(&st.unread);
        let ids = peer_ids(&stream);
        Conn {
            gid: ids.as_ref().map_or(u32::MAX, |i| i.gid),
            groups: ids.map(|i| i.groups).unwrap_or_default(),
            stream,
            lines,
            channel: st.channel,
            pid: st.pid,
            uid: st.uid,
            refusal: None,
            refused: st.refused,
            // The idle time starts again in this daemon.
            idle_since: st.channel.is_none().then(Instant::now),
            asked: !st.awaiting_first,
            takeover_asked: None,
            takeover: None,
        }
    }

    fn state(&self) -> ConnState {
        ConnState {
            channel: self.channel,
            pid: self.pid,
            uid: self.uid,
            refused: self.refused,
            awaiting_first: !self.asked,
            unread: crate::takeover::unread_of(&self.lines),
        }
    }
}

/// What the control thread runs with.
pub(crate) struct Control {
    pub listener: UnixListener,
    pub region: Arc<Region>,
    pub access: Access,
    pub channels: Arc<Channels>,
    pub events: EventSender,
    pub shutdown: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    /// The instance lock (the same open file as the daemon's) and the metrics
    /// listener, for a takeover to hand over.
    pub lock: OwnedFd,
    pub metrics_listener: Option<OwnedFd>,
    /// Connections taken over from the previous daemon.
    pub conns: Vec<Conn>,
}

/// Runs the control loop until `shutdown` is set, or until a new daemon
/// took over (then every connection is left open for it); returns the new
/// daemon's pid in that case.
pub(crate) fn run(ctl: Control) -> Option<i32> {
    let Control { listener, region, access, channels, events, shutdown, metrics, lock, metrics_listener, conns: taken } =
        ctl;
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!("control socket: cannot make it non-blocking: {e}");
        return None;
    }
    let mut conns: HashMap<i32, Conn> = taken.into_iter().map(|c| (c.stream.as_raw_fd(), c)).collect();
    let mut accepting = AcceptState::default();
    while !shutdown.load(Ordering::Relaxed) {
        // Connections, not clients', that sent no request in time.
        let now = Instant::now();
        let late: Vec<i32> = conns
            .iter()
            .filter(|(_, c)| c.idle_since.is_some_and(|t| now.duration_since(t) > access.hello_timeout))
            .map(|(fd, _)| *fd)
            .collect();
        for fd in late {
            if let Some(mut c) = conns.remove(&fd) {
                if c.asked {
                    tracing::debug!(
                        pid = c.pid,
                        uid = c.uid,
                        "closing a control connection idle for {:?}",
                        access.hello_timeout
                    );
                } else {
                    c.refusal = Some(Refused::Protocol);
                    accepting.log(format_args!(
                        "closing a connection (pid {}, uid {}) that sent no request within {:?}",
                        c.pid, c.uid, access.hello_timeout
                    ));
                }
                close(c, &metrics, &events);
            }
        }
        if accepting.paused_until.is_some_and(|t| now >= t) {
            accepting.paused_until = None;
        }
        let fds: Vec<i32> = conns.keys().copied().collect();
        let mut pollfds = Vec::with_capacity(fds.len() + 1);
        // While accepting is paused the listener is polled for nothing (its
        // pending connections would make poll return at once).
        let listen_for = if accepting.paused_until.is_some() { PollFlags::empty() } else { PollFlags::IN };
        pollfds.push(PollFd::new(&listener, listen_for));
        for fd in &fds {
            pollfds.push(PollFd::new(conns[fd].stream.as_ref(), PollFlags::IN));
        }
        // 200 ms, or less while accepting is paused (to resume on time).
        let nanos = if accepting.paused_until.is_some() { ACCEPT_BACKOFF.as_nanos() as i64 } else { 200_000_000 };
        let timeout = rustix::time::Timespec { tv_sec: 0, tv_nsec: nanos };
        if rustix::event::poll(&mut pollfds, Some(&timeout)).is_err() {
            continue;
        }
        let listener_ready = !pollfds[0].revents().is_empty();
        let ready: Vec<i32> =
            fds.iter().zip(&pollfds[1..]).filter(|(_, p)| !p.revents().is_empty()).map(|(fd, _)| *fd).collect();
        drop(pollfds);
        if listener_ready && accepting.paused_until.is_none() {
            accept_all(&listener, &access, &mut conns, &metrics, &mut accepting);
        }
        for fd in ready {
            let close_it = match conns.get_mut(&fd) {
                Some(c) => service(c, &region, &channels, &events, &access),
                None => false,
            };
            if close_it {
                if let Some(c) = conns.remove(&fd) {
                    close(c, &metrics, &events);
                }
            }
        }
        if let Some(fd) = conns.iter().find(|(_, c)| c.takeover.is_some()).map(|(fd, _)| *fd) {
            if let Some(mut t) = conns.remove(&fd) {
                let successor = t.pid;
                let fds = HandoverFds {
                    region: region.fd(),
                    listener: listener.as_fd(),
                    lock: lock.as_fd(),
                    metrics: metrics_listener.as_ref().map(|f| f.as_fd()),
                    tiers: Vec::new(),
                };
                if hand_over(&mut t, &conns, &fds, &access, &channels, &events) {
                    // Every connection now belongs to the new daemon: closed
                    // here (our copies) without a shutdown.
                    return Some(successor);
                }
                close(t, &metrics, &events);
                restore_region_header(&region, "after a takeover that did not happen");
            }
        }
    }
    for (_, c) in conns.drain() {
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
    None
}

fn accept_all(
    listener: &UnixListener,
    access: &Access,
    conns: &mut HashMap<i32, Conn>,
    metrics: &Metrics,
    accepting: &mut AcceptState,
) {
    loop {
        match listener.accept() {
            Ok((stream, _)) if conns.len() >= access.max_connections => {
                // Closed at once (the client sees EOF before any answer).
                drop(stream);
                metrics.client_refused(Refused::ChannelsFull);
                accepting.log(format_args!(
                    "refusing connections: {} are open, the most --max-connections allows",
                    conns.len()
                ));
            }
            Ok((stream, _)) => {
                let cred = match kachedb_shm::trust::peer_cred(&stream) {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!("refusing a connection: cannot read SO_PEERCRED: {e}");
                        continue;
                    }
                };
                // 0 = no pid visible here; `Channels` treats such a peer's
                // channel as never known to exit (see `Channels::quarantine`).
                let pid = cred.pid.and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
                let (uid, gid) = (cred.uid, cred.gid);
                if uid != access.uid && !access.allow_gids.contains(&gid) {
                    tracing::warn!(
                        event = "client_refused",
                        reason = "permission",
                        uid,
                        gid,
                        pid,
                        "refusing a client of another user"
                    );
                    metrics.client_refused(Refused::Permission);
                    let why = format!(
                        "permission denied: uid {uid} is not the daemon's uid {}; start the daemon with --allow-gid <gid> to admit a group",
                        access.uid
                    );
                    let _ = write_reply(&stream, &Reply::<()>::Refused(Refusal::new(why)));
                    continue;
                }
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                let groups = if access.bindings.is_empty() { Vec::new() } else { peer_groups(&stream) };
                let fd = stream.as_raw_fd();
                conns.insert(
                    fd,
                    Conn {
                        stream: Arc::new(stream),
                        lines: LineBuffer::new(),
                        channel: None,
                        pid,
                        uid,
                        gid,
                        groups,
                        refusal: None,
                        refused: false,
                        idle_since: Some(Instant::now()),
                        asked: false,
                        takeover_asked: None,
                        takeover: None,
                    },
                );
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // EMFILE/ENFILE (out of file descriptors), ENOBUFS, …: the
                // connection stays queued; pause instead of spinning on it.
                accepting.paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                accepting.log(format_args!(
                    "accept failed: {e}; pausing accepts for {ACCEPT_BACKOFF:?} (raise the open-files limit, or --max-connections below it)"
                ));
                return;
            }
        }
    }
}

/// Closes `c` for good: shuts its socket down, counts its refusal if it was
/// refused, and for a client tells the serve loop to drop its session (pins,
/// reservations) and take its channel back.
fn close(c: Conn, metrics: &Metrics, events: &EventSender) {
    let _ = c.stream.shutdown(std::net::Shutdown::Both);
    if let Some(why) = c.refusal {
        metrics.client_refused(why);
    }
    if let Some(ch) = c.channel {
        tracing::info!(
            event = "client_disconnected",
            channel = ch,
            pid = c.pid,
            uid = c.uid,
            closed_by_daemon = c.refused,
            "client disconnected"
        );
        events.send(Event::Detach { channel: ch, closed_by_daemon: c.refused });
    }
}

/// Reads what is there; handles complete lines up to a takeover request (the
/// last thing read on its connection). Returns true to close.
fn service(c: &mut Conn, region: &Arc<Region>, channels: &Channels, events: &EventSender, access: &Access) -> bool {
    let mut tmp = [0u8; 4096];
    loop {
        match (&*c.stream).read(&mut tmp) {
            Ok(0) => return true,
            Ok(n) => {
                if let Err(e) = c.lines.extend(&tmp[..n]) {
                    reply_err(c, Refused::Protocol, &e.to_string());
                    return true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
    while c.takeover.is_none() {
        let Some(line) = c.lines.next_line() else { break };
        c.asked = true;
        if handle_line(c, &line, region, channels, events, access) {
            return true;
        }
        // A client's connection stays open for its life; any other is idle
        // from its last request on.
        c.idle_since = c.channel.is_none().then(Instant::now);
    }
    false
}

/// Answers a refusal; the caller then closes the connection.
fn reply_err(c: &mut Conn, reason: Refused, why: &str) {
    tracing::warn!(
        event = "client_refused",
        reason = reason.name(),
        pid = c.pid,
        uid = c.uid,
        "refusing a client: {why}"
    );
    c.refused = true;
    c.refusal = Some(reason);
    let _ = write_reply(&c.stream, &Reply::<()>::Refused(Refusal::new(why)));
}

fn write_reply<T: serde::Serialize>(stream: &UnixStream, reply: &Reply<T>) -> Result<(), control::LineError> {
    let line = control::to_line(reply)?;
    // The socket is non-blocking; replies are small, so a full buffer means a
    // client that does not read: give up on it.
    let mut s = stream;
    Ok(s.write_all(&line)?)
}

/// Returns true to close the connection.
fn handle_line(
    c: &mut Conn,
    line: &[u8],
    region: &Arc<Region>,
    channels: &Channels,
    events: &EventSender,
    access: &Access,
) -> bool {
    let msg = match control::from_line::<ControlRequest>(line) {
        Ok(msg) => msg,
        Err(e) => {
            reply_err(
                c,
                Refused::Protocol,
                &format!(
                    "control message not understood ({e}); send {{\"op\":\"hello\",\"version\":{PROTOCOL_VERSION},\"pid\":<pid>}} or {{\"op\":\"stats\"}}"
                ),
            );
            return true;
        }
    };
    match msg {
        ControlRequest::Hello { version, tenant, .. } => {
            if c.channel.is_some() {
                reply_err(c, Refused::Protocol, "hello sent twice on one connection");
                return true;
            }
            if version != PROTOCOL_VERSION {
                reply_err(c, Refused::Protocol, &format!("control protocol version {version} is not {PROTOCOL_VERSION}: upgrade the client or the daemon so they match"));
                return true;
            }
            if let Some(Err(why)) = tenant.as_deref().map(control::check_tenant_name) {
                reply_err(c, Refused::Protocol, &format!("{why}: name another tenant in the hello, or none"));
                return true;
            }
            let ids = PeerIds { uid: c.uid, gid: c.gid, groups: c.groups.clone() };
            let tenant = match binding::tenant_for(&access.bindings, &ids, tenant.as_deref()) {
                Ok(t) => t,
                Err(why) => {
                    reply_err(c, Refused::Tenant, &why);
                    return true;
                }
            };
            let Some(ch) = channels.take(c.pid) else {
                let held = match channels.quarantined() {
                    0 => String::new(),
                    n => format!(" ({n} held back until the processes of clients disconnected as corrupt exit)"),
                };
                reply_err(c, Refused::ChannelsFull, &format!("all {} channels are in use{held}: start the daemon with more --channels, or close idle clients", region.layout().channel_count));
                return true;
            };
            // The channel's rings were reset when it was recycled; reset again in
            // case it was never used.
            region.reset_channel(ch);
            restore_region_header(region, "before answering a hello");
            c.channel = Some(ch);
            events.send(Event::Attach {
                channel: ch,
                stream: c.stream.clone(),
                pid: c.pid,
                uid: c.uid,
                tenant: tenant.clone(),
            });
            let reply = HelloReply {
                channel: ch,
                generation: region.generation(),
                region_len: region.layout().region_len,
                layout_version: kachedb_shm::region::LAYOUT_VERSION,
                daemon_pid: std::process::id(),
            };
            if let Err(e) = send_with_fd(&c.stream, &Reply::Accepted(reply), region) {
                tracing::warn!("could not hand the region to pid {}: {e}", c.pid);
                return true;
            }
            tracing::info!(
                event = "client_connected",
                channel = ch,
                pid = c.pid,
                uid = c.uid,
                tenant = tenant.as_deref().unwrap_or(kachedb_shm::control::DEFAULT_TENANT),
                "client connected"
            );
            false
        }
        ControlRequest::Takeover { state_versions } => {
            if c.channel.is_some() {
                reply_err(
                    c,
                    Refused::Protocol,
                    "a takeover is asked for on a connection of its own, not on a client's (this one said hello)",
                );
                return true;
            }
            if let Err((reason, why)) = takeover_allowed(c, &state_versions, access) {
                tracing::warn!(event = "takeover_refused", pid = c.pid, "refusing a takeover: {why}");
                reply_err(c, reason, &why);
                return true;
            }
            // Nothing stops until it says go: an asker that goes silent is
            // closed as any idle connection is.
            if let Err(e) = takeover::prepare(&c.stream, access.takeover_pause) {
                tracing::warn!(pid = c.pid, "takeover: answering the asker: {e}");
                return true;
            }
            c.takeover_asked = Some(state_versions);
            false
        }
        ControlRequest::TakeoverGo => {
            let Some(versions) = c.takeover_asked.take() else {
                reply_err(c, Refused::Protocol, "takeover_go without a takeover request before it");
                return true;
            };
            // Handled by the control loop once this read is done.
            c.takeover = Some(versions);
            false
        }
        ControlRequest::Stats => {
            let (tx, rx) = mpsc::channel();
            events.send(Event::Stats(tx));
            let reply = match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(stats) => Reply::Accepted(StatsReply { stats }),
                Err(_) => Reply::Refused(Refusal::new("the serve loop did not answer within 5 s")),
            };
            let _ = write_reply(&c.stream, &reply);
            false
        }
    }
}

/// Hands everything over to the new daemon on `t` (see `crate::takeover`);
/// whether it took over (then this daemon stops). Otherwise the serve loop
/// resumes and the caller closes `t`.
fn hand_over(
    t: &mut Conn,
    conns: &HashMap<i32, Conn>,
    fds: &HandoverFds<'_>,
    access: &Access,
    channels: &Channels,
    events: &EventSender,
) -> bool {
    let refuse = |why: String| {
        tracing::warn!(event = "takeover_refused", pid = t.pid, "refusing a takeover: {why}");
        let _ = write_reply(&t.stream, &Reply::<()>::Refused(Refusal::new(why)));
    };
    tracing::info!(event = "takeover_started", pid = t.pid, "a new daemon (pid {}) is taking over", t.pid);
    // The clients wait from here until the verdict, at most the pause limit.
    let pause = takeover::Deadline::after(access.takeover_pause);
    let (state_tx, state_rx) = mpsc::channel();
    let (outcome_tx, outcome_rx) = mpsc::channel();
    events.send(Event::Takeover { state: state_tx, outcome: outcome_rx });
    let (serve, tier_fds) = match state_rx.recv_timeout(pause.left()) {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            let _ = outcome_tx.send(false);
            refuse(format!("the serve loop could not write its state: {e}"));
            return false;
        }
        Err(_) => {
            let _ = outcome_tx.send(false);
            refuse("the serve loop did not stop in time".into());
            return false;
        }
    };
    let list: Vec<&Conn> = conns.values().collect();
    let (free_channels, quarantine) = channels.snapshot();
    let state = ControlState { free_channels, quarantine, conns: list.iter().map(|c| c.state()).collect() };
    let conn_fds: Vec<_> = list.iter().map(|c| c.stream.as_fd()).collect();
    let fds = HandoverFds { tiers: tier_fds.iter().map(|f| f.as_fd()).collect(), ..*fds };
    let started = Instant::now();
    match takeover::give(&t.stream, &fds, &serve, &state, &conn_fds, pause) {
        Ok(()) => {
            let _ = outcome_tx.send(true);
            takeover::confirm_done(&t.stream, access.takeover_timeout);
            tracing::info!(
                event = "takeover_done",
                pid = t.pid,
                connections = list.len(),
                state_bytes = serve.len(),
                "handed over to pid {} in {:?}; stopping",
                t.pid,
                started.elapsed()
            );
            true
        }
        Err(why) => {
            let _ = outcome_tx.send(false);
            tracing::warn!(
                event = "takeover_failed",
                pid = t.pid,
                "takeover failed, serving on (the tiers resume with their queues): {why}"
            );
            false
        }
    }
}

/// Whether the connection `t` may take over, reading `versions`: only a
/// new daemon of the daemon's own uid, on a connection of its own, that
/// reads the state format this daemon writes.
fn takeover_allowed(t: &mut Conn, versions: &[u32], access: &Access) -> Result<(), (Refused, String)> {
    if t.uid != access.uid {
        return Err((
            Refused::Permission,
            format!(
                "only a new daemon of the daemon's own user (uid {}) may take over, on a connection of its own",
                access.uid
            ),
        ));
    }
    if !versions.contains(&takeover::STATE_VERSION) {
        return Err((
            Refused::Protocol,
            format!(
                "this daemon writes state format {}, the new one reads {versions:?}: use a kachedb build that reads it, or restart the daemon (the cache is lost)",
                takeover::STATE_VERSION
            ),
        ));
    }
    Ok(())
}

/// Writes back the region header's words (all but the doorbell) that a peer
/// changed, so that no client attaching later maps a geometry or generation
/// a peer wrote (`Region::restore_header`), and logs it; `when` says at
/// which point the daemon looked.
fn restore_region_header(region: &Region, when: &str) {
    let words = region.restore_header();
    if words > 0 {
        tracing::warn!(
            event = "region_header_restored",
            words,
            "region header restored {when}: {words} of its 16 words had been changed (by a client?)"
        );
    }
}

/// Writes `reply` with the region fd attached (`SCM_RIGHTS`).
fn send_with_fd(stream: &UnixStream, reply: &Reply<HelloReply>, region: &Region) -> Result<(), control::LineError> {
    let bytes = control::to_line(reply)?;
    let n = kachedb_shm::fdpass::send_with_fds(stream, &bytes, &[region.fd()])?;
    if n != bytes.len() {
        // The fd went with the first byte; the rest is plain data.
        let mut s = stream;
        s.write_all(&bytes[n..])?;
    }
    Ok(())
}

/// The supplementary groups of `stream`'s peer (`SO_PEERGROUPS`); none
/// where the kernel does not report them (before Linux 4.13: then a
/// `--tenant-gid` binding matches the primary gid only), said once in the log.
fn peer_groups(stream: &UnixStream) -> Vec<u32> {
    static WARNED: AtomicBool = AtomicBool::new(false);
    match kachedb_shm::trust::peer_groups(stream) {
        Ok(g) => g,
        Err(e) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "cannot read a peer's supplementary groups (SO_PEERGROUPS: {e}): --tenant-gid matches primary gids only"
                );
            }
            Vec::new()
        }
    }
}

/// `stream`'s peer's gid and groups, read again from the socket.
fn peer_ids(stream: &UnixStream) -> Option<PeerIds> {
    let cred = kachedb_shm::trust::peer_cred(stream).ok()?;
    Some(PeerIds { uid: cred.uid, gid: cred.gid, groups: peer_groups(stream) })
}
