//! The metrics endpoint (`kachedb serve --metrics-addr`): a small HTTP/1.x
//! server for `GET /metrics` (Prometheus text format 0.0.4) and `GET /healthz`.
//!
//! It runs on its own threads and reads only [`Metrics`] (atomics): a scrape
//! never takes a lock the serve loop holds nor waits for it, so the worst a
//! client of this port can do is occupy these threads.
//!
//! * One acceptor thread polls the listener (200 ms, to see shutdown) and
//!   hands connections to [`WORKERS`] worker threads through a queue of
//!   [`QUEUE`]; when the queue is full the connection gets `503` at once and
//!   is closed. At most `WORKERS + QUEUE` connections are held.
//! * A request head must arrive whole within [`HEAD_TIMEOUT`] of the accept
//!   and fit in [`MAX_HEAD_LEN`] bytes (else `431`). A malformed request line
//!   or header gets `400`, another method on a known path `405`, an unknown
//!   path `404`.
//! * Every phase of a connection has a deadline over all its socket calls,
//!   never a timeout per call, so a client trickling a byte at a time gets no
//!   more time than a silent one: the head [`HEAD_TIMEOUT`] (then `408` and
//!   closed), the answer [`WRITE_TIMEOUT`], and reading what the client still
//!   sends after it (so that our close is not a reset that could discard the
//!   answer) [`DRAIN_TIMEOUT`]. A connection holds a worker for at most
//!   [`CONN_TIMEOUT`], whatever its client does.
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
/// The longest a connection holds a worker, from its accept.
pub const CONN_TIMEOUT: Duration =
    Duration::from_millis((HEAD_TIMEOUT.as_millis() + WRITE_TIMEOUT.as_millis() + DRAIN_TIMEOUT.as_millis()) as u64);
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

/// Serves `metrics` on `listener` until `shutdown` is set; the returned
/// thread ends after its workers.
pub fn spawn(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let (tx, rx) = mpsc::sync_channel::<(TcpStream, Instant)>(QUEUE);
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
        accept_loop(&listener, tx, &shutdown);
        for w in workers {
            let _ = w.join();
        }
    })
}

fn accept_loop(listener: &TcpListener, tx: SyncSender<(TcpStream, Instant)>, shutdown: &AtomicBool) {
    while !shutdown.load(Ordering::Relaxed) {
        let mut fds = [PollFd::new(listener, PollFlags::IN)];
        let timeout = rustix::time::Timespec { tv_sec: 0, tv_nsec: 200_000_000 };
        if rustix::event::poll(&mut fds, Some(&timeout)).is_err() {
            continue;
        }
        loop {
            match listener.accept() {
                Ok((conn, _)) => {
                    if conn.set_nonblocking(false).is_err() {
                        continue;
                    }
                    match tx.try_send((conn, Instant::now())) {
                        Ok(()) => {}
                        Err(TrySendError::Full((conn, _))) => {
                            let busy = Response::text(503, "Service Unavailable", "busy: too many connections\n");
                            let _ = busy.write_to(&conn, false, Instant::now() + Duration::from_millis(100));
                        }
                        Err(TrySendError::Disconnected(_)) => return,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of fds and the like: wait for the next poll.
                    tracing::warn!("metrics endpoint: accept failed: {e}");
                    break;
                }
            }
        }
    }
}

fn worker(rx: &Mutex<Receiver<(TcpStream, Instant)>>, registry: &Registry, metrics: &Metrics) {
    loop {
        let next = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok((conn, accepted)) = next else { return };
        serve_conn(&conn, accepted, registry, metrics);
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

/// Reads one request head (within the deadline and size cap) and answers it.
fn serve_conn(conn: &TcpStream, accepted: Instant, registry: &Registry, metrics: &Metrics) {
    let deadline = accepted + HEAD_TIMEOUT;
    let mut buf = Vec::with_capacity(1024);
    let mut tmp = [0u8; 2048];
    let head = loop {
        match parse_head(&buf) {
            Ok(Some(head)) => break head,
            Ok(None) => {}
            Err(reject) => {
                let _ = reject.response().write_to(conn, false, Instant::now() + WRITE_TIMEOUT);
                return;
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            let _ = timed_out().write_to(conn, false, Instant::now() + WRITE_TIMEOUT);
            return;
        }
        // Never read past what the cap allows (plus one byte to notice).
        let want = (MAX_HEAD_LEN + 1 - buf.len().min(MAX_HEAD_LEN)).min(tmp.len());
        match (&*conn).read(&mut tmp[..want]) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                let _ = timed_out().write_to(conn, false, Instant::now() + WRITE_TIMEOUT);
                return;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    };
    let resp = route(&head, || Metrics::render(registry), metrics.health());
    let _ = resp.write_to(conn, head.method == "HEAD", Instant::now() + WRITE_TIMEOUT);
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
        let t = spawn(listener, m, shutdown.clone()).unwrap();
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
        shutdown.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }
}
