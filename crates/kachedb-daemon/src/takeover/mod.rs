//! Hot takeover: a new daemon (`kachedb serve --takeover`) takes the running
//! one's place on the same socket with the cache and every client intact.
//!
//! The new daemon connects to the control socket and asks
//! ([`ControlRequest::Takeover`]). The old daemon's control thread stops
//! accepting and reading, and asks its serve loop for its state: the serve
//! loop stops its remote tier (a write or fill in flight is dropped; its pins
//! and reservations go with the tier's session), answers nothing more and
//! serializes the [`Store`] (every table, so the handles clients hold stay
//! valid), each channel's session (pending completions, held frames, parked
//! WAITs with the time they have left) and its counters. The control thread
//! adds its part (each connection's channel, peer and unread bytes; free and
//! quarantined channels) and sends a [`TakeoverOffer`] with the region memfd,
//! the listening socket, the instance lock (the same open file: the flock
//! stays held) and the metrics listener attached, then the client
//! connections in batches, then the two states ([`encode`]; `docs/takeover.md`
//! has the wire sequence).
//!
//! The new daemon maps the region, rebuilds the store and checks it in full,
//! and answers [`TakeoverVerdict::Ready`]; the old one then tells its serve
//! loop to stop for good, answers [`TakeoverDone`] and exits, leaving the
//! socket, the lock file, the channels and the connections as they are. The
//! new daemon serves only after `TakeoverDone` — or once the old daemon's
//! process is gone, if it died after `Ready`.
//!
//! Failures: a state version the new daemon does not read, a state it cannot
//! rebuild, a region header whose geometry is not the one the state carries
//! (any client can write the header), a new daemon that cannot start (its
//! options, its threads: all started before `Ready`, held until it serves),
//! the new daemon dying, going silent or trickling bytes (each step
//! as a whole, however many socket calls it takes, waits at most the step
//! timeout, [`STEP_TIMEOUT`] by default: see [`Deadline`]) all leave the old
//! daemon serving, its state untouched
//! (only the remote tier restarts). The old daemon dying mid-handover gives
//! the new one a clean error. Never do two daemons serve one region: the old
//! one stops before `Ready` is asked for and resumes only if `Ready` never
//! came, and the new one serves only after `TakeoverDone` or the old one's death.

pub(crate) mod state;
mod v5;

use kachedb_shm::control::{
    self, ControlRequest, LineBuffer, Reply, TakeoverDone, TakeoverOffer, TakeoverPrepare, TakeoverVerdict,
    TAKEOVER_FDS_PER_BATCH,
};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// The state format this build writes: the serve loop's part as
/// [`state::ServeState`] ([`state::encode`]: a header, then the store's
/// fixed-size slot and pin records), the control thread's as
/// [`ControlState`] ([`encode`]); `docs/takeover.md`, "The state format".
/// Any change to either, or to their encoding, must bump it, keep a decoder
/// of the format before it in [`STATE_VERSIONS_READ`], and re-point
/// `tests/upgrade/PREVIOUS` at a commit that writes that format; the
/// committed states of `crate::state_format`'s tests fail until then.
pub const STATE_VERSION: u32 = 6;

/// The state formats this build reads, oldest first: a daemon writing one of
/// them can be taken over by this build. Ends with [`STATE_VERSION`].
pub const STATE_VERSIONS_READ: &[u32] = &[5, 6];

/// The version line of `kachedb --version`: the crate version, the state
/// format written and read, and the client wire (region layout and control
/// protocol versions) the daemon serves.
pub fn version_line() -> String {
    let reads = match STATE_VERSIONS_READ {
        [one] => one.to_string(),
        [first, .., last] => format!("{first}..{last}"),
        [] => "none".into(),
    };
    format!(
        "{} (takeover state {STATE_VERSION}, reads {reads}; wire: region layout {}, control protocol {})",
        env!("CARGO_PKG_VERSION"),
        kachedb_shm::region::LAYOUT_VERSION,
        control::PROTOCOL_VERSION
    )
}

/// Encodes the control thread's state ([`ControlState`]): postcard
/// (serde's data model as varints, no field names).
pub(crate) fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, String> {
    postcard::to_stdvec(v).map_err(|e| e.to_string())
}

/// Decodes what [`encode`] wrote.
pub(crate) fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    postcard::from_bytes(bytes).map_err(|e| e.to_string())
}

/// The longest one step of the handover may take as a whole (the serve loop
/// stopping, sending everything, receiving everything, rebuilding and
/// answering `Ready`, confirming) before the side waiting gives up, unless
/// `kachedb serve --takeover-timeout-ms` says otherwise.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(20);

/// The longest the running daemon's clients wait during a takeover, from
/// the new daemon's go to its verdict (the serve loop stopping, sending
/// everything, the new daemon rebuilding and answering), unless `kachedb
/// serve --takeover-pause-ms` says otherwise: past it, the running daemon
/// resumes and the takeover fails.
pub const PAUSE_LIMIT: Duration = Duration::from_secs(5);

/// A time limit over one whole step of the handover, however many socket
/// calls the step takes: before each call the socket's timeouts are set to
/// the time left, so a peer that trickles bytes (each call making progress)
/// gets no more time than a silent one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    at: Instant,
    /// The step's length, for messages.
    step: Duration,
}

impl Deadline {
    /// A step of `step` starting now.
    pub(crate) fn after(step: Duration) -> Deadline {
        Deadline { at: Instant::now() + step, step }
    }

    /// The time left, if any.
    pub(crate) fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    fn expired(&self) -> String {
        format!("the other daemon did not finish this step of the takeover within {:?}", self.step)
    }

    /// Sets `stream`'s read and write timeouts to the time left; an error once none is left.
    fn arm(&self, stream: &UnixStream) -> Result<(), String> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.expired());
        }
        stream.set_read_timeout(Some(left)).and_then(|()| stream.set_write_timeout(Some(left))).map_err(io)
    }

    /// Turns a socket call's error into text: a timeout says the step ran out.
    fn error(&self, what: &str, e: std::io::Error) -> String {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!("{what}: {}", self.expired()),
            _ => format!("{what}: {e}"),
        }
    }
}

/// Why a takeover did not happen.
#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// No daemon answers on the socket.
    #[error("no running daemon to take over at {socket}: {source}; start without --takeover")]
    NoDaemon {
        /// Socket path.
        socket: String,
        /// Error.
        #[source]
        source: std::io::Error,
    },
    /// The running daemon refused.
    #[error("the running daemon refused the takeover: {0}")]
    Refused(String),
    /// Something failed on the way; the running daemon goes on serving.
    #[error("takeover failed, the running daemon keeps serving: {0}")]
    Failed(String),
    /// The running daemon died during the handover: nobody serves.
    #[error("the running daemon (pid {pid}) died during the takeover ({why}); nothing was taken over: start a daemon without --takeover")]
    OldDied {
        /// Its pid.
        pid: u32,
        /// What this side saw.
        why: String,
    },
}

/// One control connection (its fd travels at the same index).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ConnState {
    pub channel: Option<u32>,
    pub pid: i32,
    pub uid: u32,
    pub refused: bool,
    pub awaiting_first: bool,
    /// Bytes read but not yet a whole line.
    pub unread: Vec<u8>,
}

/// The control thread's part of the state.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct ControlState {
    pub free_channels: Vec<u32>,
    /// (channel, pid) held back until the process exits.
    pub quarantine: Vec<(u32, i32)>,
    pub conns: Vec<ConnState>,
}

/// The fds that travel with the offer besides the connections.
pub(crate) struct HandoverFds<'a> {
    pub region: BorrowedFd<'a>,
    pub listener: BorrowedFd<'a>,
    pub lock: BorrowedFd<'a>,
    pub metrics: Option<BorrowedFd<'a>>,
    /// The stopped tiers' storage (the serve state says whose).
    pub tiers: Vec<BorrowedFd<'a>>,
}

fn io(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Writes `bytes` with `fds` attached to its first byte, by `by`.
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>], by: Deadline) -> Result<(), String> {
    let n = loop {
        by.arm(stream)?;
        match kachedb_shm::fdpass::send_with_fds(stream, bytes, fds) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(by.error("sending", e)),
        }
    };
    // The fds went with the first byte; the rest is plain data.
    write_all_by(stream, &bytes[n..], by)
}

/// Writes all of `bytes` by `by`, however many writes it takes.
fn write_all_by(stream: &UnixStream, mut bytes: &[u8], by: Deadline) -> Result<(), String> {
    let mut s = stream;
    while !bytes.is_empty() {
        by.arm(stream)?;
        match s.write(bytes) {
            Ok(0) => return Err("the other daemon closed the connection".into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(by.error("sending", e)),
        }
    }
    Ok(())
}

/// Reads a stream whose bytes may carry fds: every read is a `recvmsg`, and
/// the fds received are queued in order. Every read ends by one deadline.
struct FdReader<'a> {
    stream: &'a UnixStream,
    buf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
    by: Deadline,
}

impl<'a> FdReader<'a> {
    fn new(stream: &'a UnixStream, by: Deadline) -> Self {
        FdReader { stream, buf: Vec::new(), fds: VecDeque::new(), by }
    }

    fn fill(&mut self) -> Result<(), String> {
        let mut tmp = vec![0u8; 1 << 16];
        let n = loop {
            self.by.arm(self.stream)?;
            match kachedb_shm::fdpass::recv_with_fds(
                self.stream,
                &mut tmp,
                kachedb_shm::fdpass::MAX_FDS_PER_MESSAGE,
                &mut self.fds,
            ) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.by.error("reading from the other daemon", e)),
            }
        };
        if n == 0 {
            return Err("the other daemon closed the connection".into());
        }
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(())
    }

    /// The next line, without its `\n`.
    fn line(&mut self) -> Result<Vec<u8>, String> {
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                line.pop();
                return Ok(line);
            }
            if self.buf.len() > control::MAX_LINE_LEN {
                return Err("a line longer than the control protocol allows".into());
            }
            self.fill()?;
        }
    }

    /// The next `n` bytes.
    fn exact(&mut self, n: usize) -> Result<Vec<u8>, String> {
        self.buf.reserve(n.saturating_sub(self.buf.len()));
        while self.buf.len() < n {
            self.fill()?;
        }
        Ok(self.buf.drain(..n).collect())
    }
}

fn write_line<T: Serialize>(stream: &UnixStream, msg: &T, by: Deadline) -> Result<(), String> {
    let line = control::to_line(msg).map_err(io)?;
    write_all_by(stream, &line, by)
}

/// The old daemon's answer to an accepted takeover request: say go.
pub(crate) fn prepare(stream: &UnixStream, pause: Duration) -> Result<(), String> {
    let line = control::to_line(&Reply::Accepted(TakeoverPrepare {
        daemon_pid: std::process::id(),
        pause_ms: pause.as_millis() as u64,
    }))
    .map_err(io)?;
    // The socket is non-blocking and the line small: a full buffer is an
    // asker that does not read.
    let mut s = stream;
    s.write_all(&line).map_err(io)
}

/// The old daemon's side, on its control thread, once its serve loop has
/// stopped and serialized `serve`: sends everything to the new daemon on
/// `stream` and waits for its verdict, both by `by` (the clients wait
/// meanwhile). `Ok(())`: the new daemon took over (the caller tells its
/// serve loop to stop for good, then calls [`confirm_done`]); `Err`: why not
/// (the caller resumes serving).
pub(crate) fn give(
    stream: &UnixStream,
    fds: &HandoverFds<'_>,
    serve: &[u8],
    control: &ControlState,
    conns: &[BorrowedFd<'_>],
    by: Deadline,
) -> Result<(), String> {
    stream.set_nonblocking(false).map_err(io)?;
    let sending = by;
    let control_bytes = encode(control)?;
    let batches: Vec<&[BorrowedFd<'_>]> = conns.chunks(TAKEOVER_FDS_PER_BATCH).collect();
    let offer = TakeoverOffer {
        state_version: STATE_VERSION,
        serve_state_bytes: serve.len() as u64,
        control_state_bytes: control_bytes.len() as u64,
        fd_batches: batches.len() as u32,
        connections: conns.len() as u32,
        metrics_listener: fds.metrics.is_some(),
        daemon_pid: std::process::id(),
        tier_fds: fds.tiers.len() as u32,
    };
    let line = control::to_line(&Reply::Accepted(offer)).map_err(io)?;
    let mut first = vec![fds.region, fds.listener, fds.lock];
    first.extend(fds.metrics);
    first.extend(fds.tiers.iter().copied());
    send_with_fds(stream, &line, &first, sending).map_err(|e| format!("the offer: {e}"))?;
    for b in batches {
        send_with_fds(stream, b"F", b, sending).map_err(|e| format!("the connections: {e}"))?;
    }
    write_all_by(stream, serve, sending)
        .and_then(|()| write_all_by(stream, &control_bytes, sending))
        .map_err(|e| format!("the state: {e}"))?;
    let mut r = FdReader::new(stream, by);
    let line = r.line().map_err(|e| format!("waiting for the verdict: {e}"))?;
    match control::from_line::<TakeoverVerdict>(&line).map_err(io)? {
        TakeoverVerdict::Ready => Ok(()),
        TakeoverVerdict::Refuse { error } => Err(format!("the new daemon refused: {error}")),
    }
}

/// The old daemon's last word, once its serve loop has stopped for good.
pub(crate) fn confirm_done(stream: &UnixStream, step: Duration) {
    let _ =
        write_line(stream, &Reply::Accepted(TakeoverDone { daemon_pid: std::process::id() }), Deadline::after(step));
}

/// What the new daemon received.
pub(crate) struct Taken {
    /// The connection to the old daemon.
    pub stream: UnixStream,
    pub old_pid: u32,
    /// The old daemon's process (readable once it has exited); `None` where
    /// pidfds are not available.
    old_process: Option<OwnedFd>,
    pub region: OwnedFd,
    pub listener: OwnedFd,
    pub lock: OwnedFd,
    pub metrics: Option<OwnedFd>,
    /// The stopped tiers' storage, in the order the serve state lists them.
    pub tier_fds: Vec<OwnedFd>,
    /// The format the old daemon wrote its state in (one of [`STATE_VERSIONS_READ`]).
    pub state_version: u32,
    /// The serve loop's state, as encoded ([`state::ServeState`] of `state_version`).
    pub serve: Vec<u8>,
    pub control: ControlState,
    /// In the order of `control.conns`.
    pub conns: Vec<OwnedFd>,
    /// How long each remaining step may take.
    step: Duration,
}

/// The new daemon's side: asks the daemon serving `socket` for everything
/// (two steps of `step`: the old daemon's serve loop stops, then it sends).
/// On a state it cannot read it tells the old daemon, which goes on serving.
pub(crate) fn take(socket: &std::path::Path, step: Duration) -> Result<Taken, TakeoverError> {
    let stream = UnixStream::connect(socket)
        .map_err(|source| TakeoverError::NoDaemon { socket: socket.display().to_string(), source })?;
    let me = rustix::process::geteuid().as_raw();
    let peer =
        kachedb_shm::trust::peer_cred(&stream).map_err(|e| TakeoverError::Failed(format!("SO_PEERCRED: {e}")))?;
    let old_pid = peer.pid.and_then(|p| i32::try_from(p).ok()).and_then(rustix::process::Pid::from_raw);
    let old_process = old_pid.and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    if peer.uid != me {
        return Err(TakeoverError::Refused(format!(
            "the daemon on {} runs as uid {}, not as this process (uid {me})",
            socket.display(),
            peer.uid
        )));
    }
    let receiving = Deadline::after(step * 2);
    write_line(&stream, &ControlRequest::Takeover { state_versions: STATE_VERSIONS_READ.to_vec() }, receiving)
        .map_err(TakeoverError::Failed)?;
    let old_pid = peer.pid.unwrap_or(0);
    let failed = |why: String| match &old_process {
        Some(fd) if exited_within(fd, 1) => TakeoverError::OldDied { pid: old_pid, why },
        _ => TakeoverError::Failed(why),
    };
    let mut r = FdReader::new(&stream, receiving);
    let line = r.line().map_err(failed)?;
    match control::from_line::<Reply<TakeoverPrepare>>(&line) {
        Ok(Reply::Accepted(_)) => {}
        Ok(Reply::Refused(why)) => return Err(TakeoverError::Refused(why.reason().to_string())),
        Err(e) => return Err(TakeoverError::Failed(format!("the answer was not understood: {e}"))),
    }
    write_line(&stream, &ControlRequest::TakeoverGo, receiving).map_err(TakeoverError::Failed)?;
    let line = r.line().map_err(failed)?;
    let offer = match control::from_line::<Reply<TakeoverOffer>>(&line) {
        Ok(Reply::Accepted(o)) => o,
        Ok(Reply::Refused(why)) => return Err(TakeoverError::Refused(why.reason().to_string())),
        Err(e) => return Err(TakeoverError::Failed(format!("the answer was not understood: {e}"))),
    };
    let refuse = |stream: &UnixStream, why: String| {
        let _ = write_line(stream, &TakeoverVerdict::Refuse { error: why.clone() }, Deadline::after(step));
        TakeoverError::Failed(why)
    };
    if !STATE_VERSIONS_READ.contains(&offer.state_version) {
        return Err(refuse(
            &stream,
            format!(
                "state format {} is not one this build reads ({STATE_VERSIONS_READ:?}); the running daemon keeps serving",
                offer.state_version
            ),
        ));
    }
    let received = (|| -> Result<_, String> {
        let marks = r.exact(offer.fd_batches as usize)?;
        if marks.iter().any(|&b| b != b'F') {
            return Err("connection batches out of step".into());
        }
        let serve = r.exact(usize::try_from(offer.serve_state_bytes).map_err(io)?)?;
        let control = r.exact(usize::try_from(offer.control_state_bytes).map_err(io)?)?;
        let control = decode_control(offer.state_version, &control).map_err(|e| format!("control state: {e}"))?;
        let want = 3 + usize::from(offer.metrics_listener) + offer.tier_fds as usize + offer.connections as usize;
        if r.fds.len() != want || control.conns.len() != offer.connections as usize {
            return Err(format!(
                "{} fds and {} connections received, {want} and {} announced",
                r.fds.len(),
                control.conns.len(),
                offer.connections
            ));
        }
        Ok((serve, control))
    })();
    let (serve, control) = match received {
        Ok(x) => x,
        Err(why) if old_process.as_ref().is_some_and(|fd| exited_within(fd, 1)) => {
            return Err(TakeoverError::OldDied { pid: old_pid, why })
        }
        Err(why) => return Err(refuse(&stream, why)),
    };
    let mut fds = std::mem::take(&mut r.fds);
    let (Some(region), Some(listener), Some(lock)) = (fds.pop_front(), fds.pop_front(), fds.pop_front()) else {
        return Err(refuse(&stream, "fds missing".into()));
    };
    let metrics = if offer.metrics_listener { fds.pop_front() } else { None };
    let tier_fds: Vec<OwnedFd> = (0..offer.tier_fds).filter_map(|_| fds.pop_front()).collect();
    Ok(Taken {
        stream,
        old_pid: offer.daemon_pid,
        old_process,
        state_version: offer.state_version,
        region,
        listener,
        lock,
        metrics,
        tier_fds,
        serve,
        control,
        conns: fds.into_iter().collect(),
        step,
    })
}

impl Taken {
    /// Tells the old daemon this one cannot serve its state (it goes on serving).
    pub(crate) fn refuse(&self, why: &str) -> TakeoverError {
        let _ =
            write_line(&self.stream, &TakeoverVerdict::Refuse { error: why.to_string() }, Deadline::after(self.step));
        TakeoverError::Failed(why.to_string())
    }

    /// Says `Ready` and waits for the old daemon to stop; `Ok` once it has
    /// (or once its process is gone), then this daemon serves.
    pub(crate) fn confirm(&self) -> Result<(), TakeoverError> {
        let by = Deadline::after(self.step);
        write_line(&self.stream, &TakeoverVerdict::Ready, by).map_err(TakeoverError::Failed)?;
        let mut r = FdReader::new(&self.stream, by);
        let answer = r.line();
        if let Ok(line) = &answer {
            if let Ok(Reply::Accepted(TakeoverDone { .. })) = control::from_line::<Reply<TakeoverDone>>(line) {
                return Ok(());
            }
        }
        // No confirmation: serve only if the old daemon is gone for sure.
        if self.old_process.as_ref().is_some_and(|fd| exited_within(fd, 1)) {
            tracing::warn!(pid = self.old_pid, "the old daemon died after the handover; serving");
            return Ok(());
        }
        Err(TakeoverError::Failed(format!(
            "the running daemon (pid {}) did not confirm it stopped ({})",
            self.old_pid,
            answer.err().unwrap_or_else(|| "an answer not understood".into())
        )))
    }
}

/// Whether the process of `pidfd` has exited, or does within `secs` seconds.
fn exited_within(pidfd: &OwnedFd, secs: i64) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let wait = rustix::time::Timespec { tv_sec: secs, tv_nsec: 0 };
    matches!(rustix::event::poll(&mut fds, Some(&wait)), Ok(n) if n > 0)
}

/// The unread bytes of a [`LineBuffer`] as a [`ConnState`] carries them.
pub(crate) fn unread_of(lines: &LineBuffer) -> Vec<u8> {
    lines.pending().to_vec()
}
// The decoders of every state format this build reads (`STATE_VERSIONS_READ`),
// each into the state the serve loop and the control thread take up; the
// committed states of formats 5 and 6 are checked in `state_format.rs`.

/// Why a version is not read.
fn unread(version: u32) -> String {
    format!("state format {version} is not one this build reads ({STATE_VERSIONS_READ:?})")
}

/// The serve loop's state of format `version`, in the current types.
pub(crate) fn decode_serve(version: u32, bytes: &[u8]) -> Result<state::ServeState, String> {
    match version {
        5 => v5::decode_serve(bytes),
        6 => state::decode(bytes),
        v => Err(unread(v)),
    }
}

/// The control thread's state of format `version` (the same in formats 5
/// and 6), as the current types hold it.
pub(crate) fn decode_control(version: u32, bytes: &[u8]) -> Result<ControlState, String> {
    match version {
        5 | 6 => decode(bytes),
        v => Err(unread(v)),
    }
}
