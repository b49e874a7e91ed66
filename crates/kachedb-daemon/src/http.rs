//! The metrics endpoint (`kachedb serve --metrics-addr`): `GET /metrics`
//! (Prometheus text format 0.0.4) and `GET /healthz` over HTTP/1.x, served by
//! `hyper` on a current-thread tokio runtime of its own (one thread,
//! `kachedb-http`).
//!
//! It reads only [`Metrics`] (atomics): a scrape never takes a lock the serve
//! loop holds nor waits for it, so the worst a client of this port can do is
//! occupy this runtime, within these bounds:
//!
//! * A connection is a task, not a thread, so a client that sends or reads
//!   slowly holds no thread. Its request head must arrive whole within
//!   [`HEAD_TIMEOUT`] (hyper's header-read timer: closed past it) and fit in
//!   [`MAX_HEAD_LEN`] bytes and [`MAX_HEADERS`] headers (else `431`); a
//!   malformed head gets `400`, another HTTP version `505` (hyper's answers).
//! * A connection lives at most [`CONNECTION_TIMEOUT`], whatever its client
//!   does. At most [`MAX_CONNECTIONS`] are open at once; one more closes the
//!   oldest (slow clients cannot shut others out).
//! * Every answer is made on the runtime thread: `/healthz`, `/` and the
//!   errors at once, `GET`/`HEAD /metrics` by rendering the text there (a
//!   render reads atomics only and encodes again only the per-tenant
//!   families whose figures changed, [`Exposition`]: tens of µs at 64
//!   tenants, so a `/healthz` waits behind at most a few of them; a hop to
//!   another thread would cost as much). At most [`MAX_SCRAPES`]
//!   scrapes are under way at once, each holding its place until its answer
//!   is written (so at most that many rendered texts are in memory); one more
//!   gets `503` at once. Another method on a
//!   known path gets `405`, an unknown path `404`.
//! * One request per connection (`Connection: close`). After the answer the
//!   connection is half-closed and what the client still sends is read and
//!   dropped for [`DRAIN_TIMEOUT`] (at most [`MAX_DRAIN`] bytes), so that our
//!   close is not a reset that could discard the answer.
//! * `/healthz` answers from the daemon's [`Health`]: 200 while it serves and
//!   throughout a takeover (on both daemons), 503 before it serves and once it
//!   stopped.
//! * Once told to stop (a takeover, a shutdown) it accepts no more and gives
//!   the connections under way [`STOP_GRACE`] to finish; the listener (a
//!   duplicate of which a successor holds) is then dropped.

use crate::metrics::{Exposition, Health, Metrics};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CACHE_CONTROL, CONNECTION, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

/// Longest request head (request line and headers), bytes (hyper's smallest
/// read buffer).
pub const MAX_HEAD_LEN: usize = 8 * 1024;
/// Most header lines in a request head.
pub const MAX_HEADERS: usize = 64;
/// Time for a whole request head to arrive.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a response to be written, all of it (a client that does not read).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection is served: its head, then its answer.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(HEAD_TIMEOUT.as_secs() + WRITE_TIMEOUT.as_secs());
/// Time, all reads together, for reading what a client still sends after its
/// answer, before the connection is closed.
pub const DRAIN_TIMEOUT: Duration = Duration::from_millis(100);
/// Most bytes read from a client after its answer.
pub const MAX_DRAIN: usize = 256 * 1024;
/// Connections open at once, at most; one more closes the oldest.
pub const MAX_CONNECTIONS: usize = 256;
/// How long connections under way may finish once the endpoint is told to
/// stop (a takeover, a shutdown).
pub const STOP_GRACE: Duration = Duration::from_secs(1);
/// The accept loop looks at the shutdown flag at least this often.
const POLL_EVERY: Duration = Duration::from_millis(200);
/// Scrapes of `/metrics` under way (rendered, being written), at most.
pub const MAX_SCRAPES: usize = 20;

/// The `Content-Type` of `/metrics`.
pub const METRICS_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Binds the metrics listener (the caller turns an error into one that names
/// the address).
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
}

/// What every connection's service reads.
struct Shared {
    metrics: Arc<Metrics>,
    exposition: Exposition,
    /// A scrape of `/metrics` holds one from before its render until its
    /// answer is written.
    scrapes: Arc<Semaphore>,
}

/// Serves `metrics` on `listener` once `true` comes on `start`, until
/// `shutdown` is set (`false` or the sender gone: it never serves); the
/// returned thread ends after the connections under way (at most
/// [`STOP_GRACE`]). Starting the thread and serving are apart so that a daemon
/// taking over starts every thread before it says `ready`, and serves only
/// after.
pub fn spawn(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
    start: mpsc::Receiver<bool>,
) -> std::io::Result<JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
    let listener = {
        let _in_rt = rt.enter();
        tokio::net::TcpListener::from_std(listener)?
    };
    let shared = Arc::new(Shared {
        exposition: Exposition::new(&metrics),
        metrics,
        scrapes: Arc::new(Semaphore::new(MAX_SCRAPES)),
    });
    std::thread::Builder::new().name("kachedb-http".into()).spawn(move || {
        if start.recv() == Ok(true) {
            rt.block_on(accept_loop(listener, shared, &shutdown));
        } else {
            drop(listener);
        }
        rt.shutdown_timeout(STOP_GRACE);
    })
}

/// Accepts connections until `shutdown` is set, then gives those under way
/// [`STOP_GRACE`] and ends them.
async fn accept_loop(listener: tokio::net::TcpListener, shared: Arc<Shared>, shutdown: &AtomicBool) {
    // Oldest first; finished ones are pruned when the bound is reached.
    let mut open: VecDeque<AbortHandle> = VecDeque::with_capacity(MAX_CONNECTIONS);
    // Relaxed: a flag on its own; nothing else is read in its light.
    while !shutdown.load(Ordering::Relaxed) {
        // Accepting is cancel-safe: a connection not taken now waits for the next call.
        match tokio::time::timeout(POLL_EVERY, listener.accept()).await {
            Err(_) => {}
            Ok(Ok((conn, _))) => {
                if open.len() >= MAX_CONNECTIONS {
                    open.retain(|c| !c.is_finished());
                }
                if open.len() >= MAX_CONNECTIONS {
                    if let Some(oldest) = open.pop_front() {
                        oldest.abort();
                    }
                }
                open.push_back(tokio::spawn(connection(conn, shared.clone())).abort_handle());
            }
            Ok(Err(e)) => {
                // Out of fds and the like: let connections end first.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(POLL_EVERY).await;
            }
        }
    }
    drop(listener);
    let by = tokio::time::Instant::now() + STOP_GRACE;
    while open.iter().any(|c| !c.is_finished()) && tokio::time::Instant::now() < by {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for c in open {
        c.abort();
    }
}

/// Serves one request on `conn`, then drains and closes it.
async fn connection(mut conn: tokio::net::TcpStream, shared: Arc<Shared>) {
    // The scrape's place, held until its answer is written.
    let place: Arc<Mutex<Option<OwnedSemaphorePermit>>> = Arc::default();
    let service = {
        let place = place.clone();
        hyper::service::service_fn(move |req| answer(req, shared.clone(), place.clone()))
    };
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD_LEN)
        .max_headers(MAX_HEADERS)
        .keep_alive(false)
        .half_close(true)
        .title_case_headers(true)
        // Lent, not given: hyper drops its end after an error answer (400,
        // 431, 505) as well as after a served one, and the drain below
        // still needs the socket.
        .serve_connection(TokioIo::new(&mut conn), service)
        .without_shutdown();
    let served = tokio::time::timeout(CONNECTION_TIMEOUT, served).await;
    drop(place);
    if served.is_err() {
        return;
    }
    drop(served);
    // Whatever the client still sends is not answered: shut our side and give
    // its close a moment, so that unread bytes do not turn ours into a reset
    // that could discard the answer.
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        conn.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < MAX_DRAIN {
            match conn.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        std::io::Result::Ok(())
    })
    .await;
}

/// The answer to `req`; a scrape of `/metrics` keeps its place in `place`.
async fn answer(
    req: Request<Incoming>,
    shared: Arc<Shared>,
    place: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    let (method, path) = (req.method().as_str(), req.uri().path());
    let health = shared.metrics.health();
    let reply = if path == "/metrics" && (req.method() == Method::GET || req.method() == Method::HEAD) {
        match shared.scrapes.clone().try_acquire_owned() {
            Ok(permit) => {
                if let Ok(mut p) = place.lock() {
                    *p = Some(permit);
                }
                route(method, path, || shared.exposition.render(), health)
            }
            Err(_) => Reply::text(503, "busy: too many scrapes at once\n"),
        }
    } else {
        route(method, path, String::new, health)
    };
    Ok(reply.into_response())
}

/// A response to write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    content_type: &'static str,
    /// Set for 405.
    allow: bool,
    pub(crate) body: String,
}

impl Reply {
    fn text(status: u16, body: &str) -> Self {
        Self { status, content_type: "text/plain; charset=utf-8", allow: false, body: body.to_string() }
    }

    fn into_response(self) -> hyper::Response<Full<Bytes>> {
        let mut r = hyper::Response::new(Full::new(Bytes::from(self.body)));
        *r.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        h.insert(CONNECTION, HeaderValue::from_static("close"));
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if self.allow {
            h.insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        }
        r
    }
}

/// The answer to `method` on `path`; `render` makes the metrics text,
/// `health` is where the daemon is in its life.
pub(crate) fn route(method: &str, path: &str, render: impl FnOnce() -> String, health: Health) -> Reply {
    let known = matches!(path, "/" | "/metrics" | "/healthz");
    if !known {
        return Reply::text(404, "not found: try /metrics or /healthz\n");
    }
    if method != "GET" && method != "HEAD" {
        let mut r = Reply::text(405, "only GET and HEAD\n");
        r.allow = true;
        return r;
    }
    match path {
        "/metrics" => Reply { status: 200, content_type: METRICS_CONTENT_TYPE, allow: false, body: render() },
        // One body for every healthy state: probes and scripts match "ok".
        "/healthz" if health.healthy() => Reply::text(200, "ok\n"),
        "/healthz" if health == Health::Starting => Reply::text(503, "starting: not serving yet\n"),
        "/healthz" => Reply::text(503, "the serve loop is not running\n"),
        _ => Reply::text(200, "kachedb metrics: GET /metrics (Prometheus text format), GET /healthz\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    #[test]
    fn routes() {
        let render = || "kachedb_blocks 1\n".to_string();
        let r = route("GET", "/metrics", render, Health::Serving);
        assert_eq!((r.status, r.body.as_str(), r.content_type), (200, "kachedb_blocks 1\n", METRICS_CONTENT_TYPE));
        let ok = Health::Serving;
        assert_eq!(route("HEAD", "/metrics", render, ok).status, 200);
        for (h, status) in [
            (Health::Starting, 503),
            (Health::Serving, 200),
            (Health::HandingOver, 200),
            (Health::HandedOver, 200),
            (Health::Stopped, 503),
        ] {
            assert_eq!(route("GET", "/healthz", render, h).status, status, "{h:?}");
            assert_eq!(h.healthy(), status == 200, "{h:?}");
        }
        assert_eq!(route("GET", "/", render, ok).status, 200);
        assert_eq!(route("GET", "/metricz", render, ok).status, 404);
        assert_eq!(route("DELETE", "/nope", render, ok).status, 404);
        let r = route("POST", "/metrics", render, ok);
        assert_eq!((r.status, r.allow), (405, true));
    }

    /// A server on a free port; set the flag and join the thread to stop it.
    fn server() -> (SocketAddr, Arc<AtomicBool>, JoinHandle<()>) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = Arc::new(AtomicBool::new(false));
        let (go, start) = mpsc::channel();
        let t = spawn(listener, Metrics::new(2, 16), shutdown.clone(), start).unwrap();
        go.send(true).unwrap();
        (addr, shutdown, t)
    }

    fn ask(addr: SocketAddr, req: &[u8]) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(req).unwrap();
        let mut out = Vec::new();
        c.read_to_end(&mut out).unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn serves_over_tcp() {
        let (addr, shutdown, t) = server();
        let r = ask(addr, b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains(&format!("Content-Type: {METRICS_CONTENT_TYPE}\r\n")), "{r}");
        assert!(r.contains("Cache-Control: no-store\r\n") && r.contains("\r\n\r\n# HELP kachedb_"), "{r}");
        assert!(ask(addr, b"GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(ask(addr, b"GARBAGE\r\n\r\n").starts_with("HTTP/1.1 400 "));
        assert!(ask(addr, b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n").starts_with("HTTP/1.1 400 "));
        let r = ask(addr, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 405 ") && r.contains("Allow: GET, HEAD\r\n"), "{r}");
        let head = ask(addr, b"HEAD /healthz HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 503 ") && head.ends_with("\r\n\r\n"), "{head}");
        // Too large: a head over the cap, too many headers.
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD_LEN + 1, b'a');
        huge.extend_from_slice(b"\r\n\r\n");
        assert!(ask(addr, &huge).starts_with("HTTP/1.1 431 "));
        let mut many = b"GET /metrics HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert!(ask(addr, &many).starts_with("HTTP/1.1 431 "));
        // A client that half-closes right after its request still gets the answer.
        for path in ["/healthz", "/metrics"] {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).unwrap();
            c.shutdown(std::net::Shutdown::Write).unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).unwrap();
            // Answered in the request's version.
            assert!(out.starts_with("HTTP/1.0 200 ") || out.starts_with("HTTP/1.0 503 "), "{path}: {out:?}");
        }
        shutdown.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }

    /// Past [`MAX_CONNECTIONS`] idle connections, each new one closes the
    /// oldest, and a request on a new connection is still answered.
    #[test]
    fn the_oldest_idle_connection_makes_room() {
        let (addr, shutdown, t) = server();
        let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let r = ask(addr, b"GET /healthz HTTP/1.1\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 503 "), "{r}");
        let mut oldest = &idle[0];
        oldest.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
        assert!(matches!(oldest.read(&mut [0u8; 1]), Ok(0) | Err(_)), "the oldest idle connection was kept");
        let newest = &idle[MAX_CONNECTIONS - 1];
        newest.set_nonblocking(true).unwrap();
        let held = matches!((&*newest).read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        assert!(held, "the newest idle connection was closed");
        shutdown.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }
}
