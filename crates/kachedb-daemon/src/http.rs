//! The metrics endpoint (`kachedb serve --metrics-addr`): a small HTTP/1.x
//! server for `GET /metrics` (Prometheus text format 0.0.4) and `GET /healthz`.
//!
//! It runs on its own threads and reads only [`Metrics`] (atomics): a scrape
//! never takes a lock the serve loop holds nor waits for it, so the worst a
//! client of this port can do is occupy these threads.
//!
//! * One thread (the acceptor) accepts connections and reads their request
//!   heads, all of them at once (`poll`, non-blocking reads), so a client that
//!   sends slowly holds no thread: a request head must arrive whole within
//!   [`HEAD_TIMEOUT`] of the accept (a deadline over all its reads: `408` and
//!   closed past it) and fit in [`MAX_HEAD_LEN`] bytes (else `431`). At most
//!   [`MAX_PENDING`] connections are read at once; one more closes the
//!   oldest of them (slow heads cannot shut others out).
//! * The acceptor answers every request but `/metrics` itself (`/healthz`,
//!   errors: a few hundred bytes, written at once), so `/healthz` never waits
//!   for a worker. A malformed request line or header gets `400`, another
//!   method on a known path `405`, an unknown path `404`.
//! * `GET`/`HEAD /metrics` goes to one of [`WORKERS`] worker threads through a
//!   queue of [`QUEUE`] (full: `503` at once), which renders and writes it
//!   within [`WRITE_TIMEOUT`] (a deadline over all its writes: a client that
//!   does not read gets no more).
//! * After an answer the connection is half-closed and what the client still
//!   sends is read and dropped for [`DRAIN_TIMEOUT`] in all (so that our close
//!   is not a reset that could discard the answer), then it is closed. A
//!   connection holds a worker for at most [`WORKER_TIMEOUT`], whatever its
//!   client does, and the acceptor never waits on one.
//! * One request per connection (`Connection: close`): a scraper reconnects,
//!   which costs it a round trip and nothing here.
//! * `/healthz` answers from the daemon's [`Health`]: 200 while it serves and
//!   throughout a takeover (on both daemons), 503 before it serves and once it
//!   stopped.

use crate::metrics::{Health, Metrics};
use prometheus_client::registry::Registry;
use rustix::event::{PollFd, PollFlags};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest request head (request line and headers), bytes.
pub const MAX_HEAD_LEN: usize = 8 * 1024;
/// Most header lines in a request head.
pub const MAX_HEADERS: usize = 64;
/// Time from accept for a whole request head to arrive.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a response to be written, all of it (a client that does not read).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Time, all reads together, for reading what a client still sends after its
/// answer, before the connection is closed.
pub const DRAIN_TIMEOUT: Duration = Duration::from_millis(100);
/// Most bytes read from a client after its answer.
pub const MAX_DRAIN: usize = 256 * 1024;
/// The longest a connection holds a worker: its answer, then the drain.
pub const WORKER_TIMEOUT: Duration =
    Duration::from_millis((WRITE_TIMEOUT.as_millis() + DRAIN_TIMEOUT.as_millis()) as u64);
/// Connections whose request head is being read (or that are being closed),
/// at most; one more closes the oldest.
pub const MAX_PENDING: usize = 256;
/// How long the acceptor keeps answering the heads it is reading once it is
/// told to stop (a takeover, a shutdown).
pub const STOP_GRACE: Duration = Duration::from_secs(1);
/// The acceptor looks at the shutdown flag at least this often.
const POLL_EVERY: Duration = Duration::from_millis(200);
/// Connections served at once.
pub const WORKERS: usize = 4;
/// Connections accepted and waiting for a worker.
pub const QUEUE: usize = 16;

/// The `Content-Type` of `/metrics`.
pub const METRICS_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Binds the metrics listener (the caller turns an error into one that names
/// the address).
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
}

/// Serves `metrics` on `listener` once `true` comes on `start`, until
/// `shutdown` is set (`false` or the sender gone: it never serves); the
/// returned thread ends after its workers. Starting the threads and serving
/// are apart so that a daemon taking over starts every thread before it says
/// `ready`, and serves only after.
pub fn spawn(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
    start: mpsc::Receiver<bool>,
) -> std::io::Result<JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let (tx, rx) = mpsc::sync_channel::<(TcpStream, Head)>(QUEUE);
    let rx = Arc::new(Mutex::new(rx));
    let registry = Arc::new(metrics.registry());
    let mut workers = Vec::with_capacity(WORKERS);
    for i in 0..WORKERS {
        let (rx, registry, metrics) = (rx.clone(), registry.clone(), metrics.clone());
        workers.push(
            std::thread::Builder::new()
                .name(format!("kachedb-http-{i}"))
                .stack_size(256 * 1024)
                .spawn(move || worker(&rx, &registry, &metrics))?,
        );
    }
    std::thread::Builder::new().name("kachedb-http".into()).stack_size(256 * 1024).spawn(move || {
        if start.recv() == Ok(true) {
            accept_loop(&listener, &tx, &shutdown, &metrics);
        }
        drop(tx);
        for w in workers {
            let _ = w.join();
        }
    })
}

/// Where a connection on the acceptor is.
enum Phase {
    /// Its request head, read so far.
    Head(Vec<u8>),
    /// Answered and half-closed; bytes read and dropped since.
    Closing(usize),
}

/// A connection the acceptor holds (non-blocking).
struct Pending {
    conn: TcpStream,
    phase: Phase,
    /// The head's deadline, then the drain's.
    deadline: Instant,
}

impl Pending {
    /// Writes `r` (small: it fits in a fresh connection's send buffer, else it
    /// is dropped; the socket is non-blocking, so this never waits) and
    /// starts closing.
    fn answer(&mut self, r: &Response, head_only: bool) {
        let _ = r.write_to(&self.conn, head_only, Instant::now() + WRITE_TIMEOUT);
        let _ = self.conn.shutdown(std::net::Shutdown::Write);
        self.phase = Phase::Closing(0);
        self.deadline = Instant::now() + DRAIN_TIMEOUT;
    }
}

/// What to do with a connection after reading from it.
enum Next {
    Keep,
    Close,
    /// A `/metrics` request, for a worker.
    Render(Head),
}

/// Accepts connections and reads their heads until `shutdown` is set (then
/// for at most [`STOP_GRACE`] more, without accepting, for the heads under way).
fn accept_loop(listener: &TcpListener, tx: &SyncSender<(TcpStream, Head)>, shutdown: &AtomicBool, metrics: &Metrics) {
    let mut pending: Vec<Pending> = Vec::new();
    let mut stop_by: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if stop_by.is_none() && shutdown.load(Ordering::Relaxed) {
            stop_by = Some(now + STOP_GRACE);
        }
        if stop_by.is_some_and(|t| now >= t || pending.iter().all(|p| matches!(p.phase, Phase::Closing(_)))) {
            return;
        }
        // Deadlines: a head not complete gets 408; a closing connection goes.
        let mut i = 0;
        while i < pending.len() {
            if now < pending[i].deadline {
                i += 1;
            } else if matches!(pending[i].phase, Phase::Head(_)) {
                pending[i].answer(&timed_out(), false);
                i += 1;
            } else {
                pending.swap_remove(i);
            }
        }
        let accepting = stop_by.is_none();
        let wait = pending.iter().map(|p| p.deadline.saturating_duration_since(now)).fold(POLL_EVERY, Duration::min);
        let mut fds = Vec::with_capacity(pending.len() + 1);
        fds.push(PollFd::new(listener, if accepting { PollFlags::IN } else { PollFlags::empty() }));
        fds.extend(pending.iter().map(|p| PollFd::new(&p.conn, PollFlags::IN)));
        let timeout = rustix::time::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
        if rustix::event::poll(&mut fds, Some(&timeout)).is_err() {
            continue;
        }
        let listener_ready = accepting && !fds[0].revents().is_empty();
        let ready: Vec<usize> =
            fds[1..].iter().enumerate().filter(|(_, f)| !f.revents().is_empty()).map(|(i, _)| i).collect();
        drop(fds);
        let mut next: Vec<(usize, Next)> =
            ready.into_iter().map(|i| (i, read_some(&mut pending[i], metrics))).collect();
        // Highest index first: each swap_remove moves in the last entry, which
        // lies past every index still to come, so those stay valid.
        next.sort_unstable_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, what) in next {
            match what {
                Next::Keep => {}
                Next::Close => drop(pending.swap_remove(i)),
                Next::Render(head) => {
                    let p = pending.swap_remove(i);
                    if p.conn.set_nonblocking(false).is_err() {
                        continue;
                    }
                    match tx.try_send((p.conn, head)) {
                        Ok(()) => {}
                        Err(TrySendError::Full((conn, _))) => {
                            let busy = Response::text(503, "Service Unavailable", "busy: too many scrapes at once\n");
                            let _ = busy.write_to(&conn, false, Instant::now() + Duration::from_millis(100));
                        }
                        Err(TrySendError::Disconnected(_)) => return,
                    }
                }
            }
        }
        if listener_ready {
            accept_all(listener, &mut pending);
        }
    }
}

/// Accepts what is waiting; past [`MAX_PENDING`] each new connection closes
/// the oldest one held.
fn accept_all(listener: &TcpListener, pending: &mut Vec<Pending>) {
    loop {
        match listener.accept() {
            Ok((conn, _)) => {
                if conn.set_nonblocking(true).is_err() {
                    continue;
                }
                if pending.len() >= MAX_PENDING {
                    // The oldest connection still sending its head, else the
                    // oldest closing one.
                    let oldest = |head: bool| {
                        pending
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| matches!(p.phase, Phase::Head(_)) == head)
                            .min_by_key(|(_, p)| p.deadline)
                            .map(|(i, _)| i)
                    };
                    if let Some(i) = oldest(true).or_else(|| oldest(false)) {
                        pending.swap_remove(i);
                    }
                }
                pending.push(Pending {
                    conn,
                    phase: Phase::Head(Vec::with_capacity(512)),
                    deadline: Instant::now() + HEAD_TIMEOUT,
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of fds and the like: wait for the next poll.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                return;
            }
        }
    }
}

/// Reads what `p` has sent: while its head is incomplete, more of it (and
/// answers it once whole, unless it is for `/metrics`); once answered, drops
/// what it sends until EOF or [`MAX_DRAIN`] bytes.
fn read_some(p: &mut Pending, metrics: &Metrics) -> Next {
    let mut tmp = [0u8; 4096];
    match &mut p.phase {
        Phase::Closing(drained) => loop {
            match (&p.conn).read(&mut tmp) {
                Ok(0) => return Next::Close,
                Ok(n) => {
                    *drained += n;
                    if *drained >= MAX_DRAIN {
                        return Next::Close;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Next::Keep,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Next::Close,
            }
        },
        Phase::Head(buf) => {
            // The client may send its head and close its side at once: the
            // head is still answered.
            let mut eof = false;
            loop {
                // Never read past what the cap allows (plus one byte to notice).
                let want = (MAX_HEAD_LEN + 1 - buf.len().min(MAX_HEAD_LEN)).min(tmp.len());
                match (&p.conn).read(&mut tmp[..want]) {
                    Ok(0) => {
                        eof = true;
                        break;
                    }
                    Ok(n) => {
                        buf.extend_from_slice(&tmp[..n]);
                        if buf.len() > MAX_HEAD_LEN {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return Next::Close,
                }
            }
            match parse_head(buf) {
                Ok(None) if eof => Next::Close,
                Ok(None) => Next::Keep,
                Err(reject) => {
                    p.answer(&reject.response(), false);
                    Next::Keep
                }
                Ok(Some(head)) if head.path == "/metrics" && matches!(head.method.as_str(), "GET" | "HEAD") => {
                    Next::Render(head)
                }
                Ok(Some(head)) => {
                    // Never `/metrics` here: nothing to render.
                    let resp = route(&head, String::new, metrics.health());
                    p.answer(&resp, head.method == "HEAD");
                    Next::Keep
                }
            }
        }
    }
}

/// Renders and writes `/metrics` for the requests the acceptor hands over.
fn worker(rx: &Mutex<Receiver<(TcpStream, Head)>>, registry: &Registry, metrics: &Metrics) {
    loop {
        let next = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok((conn, head)) = next else { return };
        let resp = route(&head, || Metrics::render(registry), metrics.health());
        let _ = resp.write_to(&conn, head.method == "HEAD", Instant::now() + WRITE_TIMEOUT);
        // Whatever the client still sends is not answered: shut our side, give
        // its close a moment so that unread bytes do not turn ours into a
        // reset that could discard the response, then drop.
        let _ = conn.shutdown(std::net::Shutdown::Write);
        drain(&conn, Instant::now() + DRAIN_TIMEOUT);
    }
}

/// Reads and drops what `conn` sends until EOF, [`MAX_DRAIN`] bytes or
/// `deadline`, whichever comes first.
fn drain(conn: &TcpStream, deadline: Instant) {
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < MAX_DRAIN {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match (&*conn).read(&mut sink) {
            Ok(n) if n > 0 => drained += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => return,
        }
    }
}

fn timed_out() -> Response {
    Response::text(408, "Request Timeout", "request head not received in time\n")
}

/// A parsed request head: what routing needs.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Head {
    pub(crate) method: String,
    /// The target's path (without its query).
    pub(crate) path: String,
}

/// Why a request head is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reject {
    /// A malformed request line or header.
    BadRequest(&'static str),
    /// More than [`MAX_HEAD_LEN`] bytes or [`MAX_HEADERS`] headers.
    TooLarge,
    /// Not HTTP/1.0 or HTTP/1.1.
    Version,
}

impl Reject {
    fn response(&self) -> Response {
        match self {
            Reject::BadRequest(why) => Response::text(400, "Bad Request", &format!("bad request: {why}\n")),
            Reject::TooLarge => Response::text(
                431,
                "Request Header Fields Too Large",
                &format!("request head over {} bytes or {MAX_HEADERS} headers\n", MAX_HEAD_LEN),
            ),
            Reject::Version => Response::text(505, "HTTP Version Not Supported", "HTTP/1.0 or HTTP/1.1 only\n"),
        }
    }
}

/// The head at the start of `buf`: `Ok(None)` while incomplete.
pub(crate) fn parse_head(buf: &[u8]) -> Result<Option<Head>, Reject> {
    // The head ends at the first empty line ("\r\n\r\n", or bare "\n\n").
    let end = (0..buf.len())
        .find(|&i| buf[i] == b'\n' && (buf[i + 1..].starts_with(b"\n") || buf[i + 1..].starts_with(b"\r\n")))
        .map(|i| i + 1);
    let Some(end) = end else {
        return if buf.len() > MAX_HEAD_LEN { Err(Reject::TooLarge) } else { Ok(None) };
    };
    if end > MAX_HEAD_LEN {
        return Err(Reject::TooLarge);
    }
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| Reject::BadRequest("the head is not UTF-8"))?;
    let mut lines = head.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Reject::BadRequest("the request line is not METHOD TARGET VERSION"));
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(Reject::BadRequest("the method is not a token"));
    }
    if !version.starts_with("HTTP/") {
        return Err(Reject::BadRequest("no HTTP version"));
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(Reject::Version);
    }
    if !target.starts_with('/') {
        return Err(Reject::BadRequest("the target is not a path"));
    }
    let mut headers = 0;
    for line in lines.take_while(|l| !l.is_empty()) {
        headers += 1;
        if headers > MAX_HEADERS {
            return Err(Reject::TooLarge);
        }
        match line.split_once(':') {
            Some((name, _)) if !name.is_empty() && !name.contains([' ', '\t']) => {}
            _ => return Err(Reject::BadRequest("a header line is not NAME: VALUE")),
        }
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);
    Ok(Some(Head { method: method.to_string(), path: path.to_string() }))
}

/// A response to write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Response {
    pub(crate) status: u16,
    reason: &'static str,
    content_type: &'static str,
    /// Set for 405.
    allow: bool,
    pub(crate) body: String,
}

impl Response {
    fn text(status: u16, reason: &'static str, body: &str) -> Self {
        Self { status, reason, content_type: "text/plain; charset=utf-8", allow: false, body: body.to_string() }
    }

    /// Writes the whole response (head only for `HEAD`) by `deadline`, however
    /// many writes it takes.
    fn write_to(&self, mut conn: &TcpStream, head_only: bool, deadline: Instant) -> std::io::Result<()> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\nCache-Control: no-store\r\n{}\r\n",
            self.status,
            self.reason,
            self.content_type,
            self.body.len(),
            if self.allow { "Allow: GET, HEAD\r\n" } else { "" }
        );
        if !head_only {
            out.push_str(&self.body);
        }
        let mut bytes = out.as_bytes();
        while !bytes.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            conn.set_write_timeout(Some(left))?;
            match conn.write(bytes) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The answer to `head`; `render` makes the metrics text, `health` is where
/// the daemon is in its life.
pub(crate) fn route(head: &Head, render: impl FnOnce() -> String, health: Health) -> Response {
    let known = matches!(head.path.as_str(), "/" | "/metrics" | "/healthz");
    if !known {
        return Response::text(404, "Not Found", "not found: try /metrics or /healthz\n");
    }
    if head.method != "GET" && head.method != "HEAD" {
        let mut r = Response::text(405, "Method Not Allowed", "only GET and HEAD\n");
        r.allow = true;
        return r;
    }
    match head.path.as_str() {
        "/metrics" => {
            Response { status: 200, reason: "OK", content_type: METRICS_CONTENT_TYPE, allow: false, body: render() }
        }
        // One body for every healthy state: probes and scripts match "ok".
        "/healthz" if health.healthy() => Response::text(200, "OK", "ok\n"),
        "/healthz" if health == Health::Starting => {
            Response::text(503, "Service Unavailable", "starting: not serving yet\n")
        }
        "/healthz" => Response::text(503, "Service Unavailable", "the serve loop is not running\n"),
        _ => Response::text(200, "OK", "kachedb metrics: GET /metrics (Prometheus text format), GET /healthz\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(method: &str, path: &str) -> Head {
        Head { method: method.into(), path: path.into() }
    }

    #[test]
    fn parses_request_heads() {
        assert_eq!(parse_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Ok(Some(head("GET", "/metrics"))));
        assert_eq!(parse_head(b"HEAD /healthz?x=1 HTTP/1.0\n\n"), Ok(Some(head("HEAD", "/healthz"))));
        // Bytes past the head (a body) are not the parser's business.
        assert_eq!(parse_head(b"POST /metrics HTTP/1.1\r\n\r\nbody"), Ok(Some(head("POST", "/metrics"))));
        // Incomplete: wait for more.
        for partial in [&b""[..], b"GET", b"GET /metrics HTTP/1.1\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"] {
            assert_eq!(parse_head(partial), Ok(None), "{}", String::from_utf8_lossy(partial));
        }
    }

    #[test]
    fn refuses_bad_heads() {
        let bad = |b: &[u8]| matches!(parse_head(b), Err(Reject::BadRequest(_)));
        assert!(bad(b"GET /metrics\r\n\r\n"));
        assert!(bad(b"GET  /metrics HTTP/1.1\r\n\r\n"));
        assert!(bad(b"get /metrics HTTP/1.1\r\n\r\n"));
        assert!(bad(b"GET metrics HTTP/1.1\r\n\r\n"));
        assert!(bad(b"GET /metrics FTP/1.1\r\n\r\n"));
        assert!(bad(b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n"));
        assert!(bad(b"GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n"));
        assert!(bad(b"GET /\xff HTTP/1.1\r\n\r\n"));
        assert_eq!(parse_head(b"GET /metrics HTTP/2.0\r\n\r\n"), Err(Reject::Version));
        // Too large: no end within the cap, an end past it, too many headers.
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD_LEN + 1, b'a');
        assert_eq!(parse_head(&huge), Err(Reject::TooLarge));
        huge.extend_from_slice(b"\r\n\r\n");
        assert_eq!(parse_head(&huge), Err(Reject::TooLarge));
        let mut many = b"GET /metrics HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parse_head(&many), Err(Reject::TooLarge));
    }

    #[test]
    fn routes() {
        let render = || "kachedb_blocks 1\n".to_string();
        let r = route(&head("GET", "/metrics"), render, Health::Serving);
        assert_eq!((r.status, r.body.as_str(), r.content_type), (200, "kachedb_blocks 1\n", METRICS_CONTENT_TYPE));
        let ok = Health::Serving;
        assert_eq!(route(&head("HEAD", "/metrics"), render, ok).status, 200);
        for (h, status) in [
            (Health::Starting, 503),
            (Health::Serving, 200),
            (Health::HandingOver, 200),
            (Health::HandedOver, 200),
            (Health::Stopped, 503),
        ] {
            assert_eq!(route(&head("GET", "/healthz"), render, h).status, status, "{h:?}");
            assert_eq!(h.healthy(), status == 200, "{h:?}");
        }
        assert_eq!(route(&head("GET", "/"), render, ok).status, 200);
        assert_eq!(route(&head("GET", "/metricz"), render, ok).status, 404);
        assert_eq!(route(&head("DELETE", "/nope"), render, ok).status, 404);
        let r = route(&head("POST", "/metrics"), render, ok);
        assert_eq!((r.status, r.allow), (405, true));
    }

    #[test]
    fn serves_over_tcp() {
        let m = Metrics::new(2, 16);
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = Arc::new(AtomicBool::new(false));
        let (go, start) = mpsc::channel();
        let t = spawn(listener, m, shutdown.clone(), start).unwrap();
        go.send(true).unwrap();
        let ask = |req: &[u8]| {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(req).unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).unwrap();
            out
        };
        let r = ask(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("\r\n\r\n# HELP kachedb_"), "{r}");
        assert!(ask(b"GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(ask(b"GARBAGE\r\n\r\n").starts_with("HTTP/1.1 400 "));
        let head = ask(b"HEAD /healthz HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 503 ") && head.ends_with("\r\n\r\n"), "{head}");
        // A client that half-closes right after its request still gets the answer.
        for path in ["/healthz", "/metrics"] {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).unwrap();
            c.shutdown(std::net::Shutdown::Write).unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).unwrap();
            assert!(out.starts_with("HTTP/1.1 "), "{path}: {out:?}");
        }
        shutdown.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }
}
