//! The control socket, client side: connecting, the hello that hands over a
//! channel and the region fd (`SCM_RIGHTS`), a refusal's reason, and the
//! stats request. Messages are `kachedb_shm::control`'s types.

use crate::error::{ClientError, Result};
use kachedb_shm::control::{self, ControlRequest, HelloReply, LineBuffer, Reply, StatsReply};
use kachedb_shm::{SpinThenPark, Stats};
use std::io::{BufReader, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How to connect.
#[derive(Clone, Debug, Default)]
pub struct ConnectOptions {
    /// Control socket; `None` = the default for `instance` (honours `KACHEDB_SOCKET`).
    pub socket: Option<PathBuf>,
    /// Daemon instance.
    pub instance: u32,
    /// How to wait for completions.
    pub wait: SpinThenPark,
    /// A uid besides this process's own and root whose daemon this client
    /// trusts (a daemon shared through `--allow-gid`); `KACHEDB_TRUST_UID`
    /// (a uid, or several separated by commas) adds more.
    pub trust_uid: Option<u32>,
    /// How long to wait for the daemon's answer to hello or stats (default
    /// [`DEFAULT_ANSWER_TIMEOUT`]); something that accepts and never answers
    /// then fails `connect` instead of hanging it.
    pub answer_timeout: Option<Duration>,
    /// The tenant this client's blocks and requests count for (sent in the
    /// hello; a `kachedb_shm::control::check_tenant_name` name); `None`: the
    /// daemon's default tenant. The daemon's limit for that tenant
    /// (`kachedb serve --tenant-limit`) bounds what its clients hold.
    pub tenant: Option<String>,
}

/// Environment variable naming uids (comma-separated) whose daemons a client trusts
/// besides its own uid and root.
pub const TRUST_UID_ENV: &str = "KACHEDB_TRUST_UID";

/// How long a client waits for the daemon's first answer by default.
pub const DEFAULT_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

impl ConnectOptions {
    /// The socket path these options resolve to.
    pub fn socket_path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| kachedb_shm::naming::default_socket_path(self.instance))
    }
}

impl ConnectOptions {
    /// The uids this client trusts besides its own and root: `trust_uid` and
    /// `$KACHEDB_TRUST_UID`.
    pub fn trusted_uids(&self) -> Result<Vec<u32>> {
        let mut uids: Vec<u32> = self.trust_uid.into_iter().collect();
        if let Some(v) = std::env::var_os(TRUST_UID_ENV).filter(|v| !v.is_empty()) {
            for part in v.to_string_lossy().split(',').map(str::trim).filter(|p| !p.is_empty()) {
                uids.push(part.parse().map_err(|_| {
                    ClientError::Invalid(format!(
                        "{TRUST_UID_ENV}={:?}: {part:?} is not a uid (give numbers separated by commas)",
                        v
                    ))
                })?);
            }
        }
        Ok(uids)
    }
}

/// Connects to the daemon that `opts` name and checks that it may be trusted
/// with this process's data before anything is sent: the socket's directory
/// must be one nobody else can swap the socket in
/// ([`kachedb_shm::trust::check_socket_dir`]), and the process serving the
/// socket (`SO_PEERCRED`) must run as this process's uid, root, or a trusted
/// uid. The stream then has read and write timeouts
/// ([`ConnectOptions::answer_timeout`]).
pub(crate) fn connect_trusted(opts: &ConnectOptions) -> Result<(UnixStream, PathBuf)> {
    let path = opts.socket_path();
    let trusted = opts.trusted_uids()?;
    let stream = connect_stream(&path)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    kachedb_shm::trust::check_socket_dir(dir, &trusted).map_err(|why| {
        ClientError::Untrusted(format!(
            "the socket {} lies in {}, and {why}: another user could have put that socket there; use a socket in a private directory (yours, mode 0700), e.g. `kachedb serve --socket $XDG_RUNTIME_DIR/kachedb/kachedb_0.sock`",
            path.display(),
            dir.display()
        ))
    })?;
    let cred = kachedb_shm::trust::peer_cred(&stream).map_err(|e| {
        ClientError::Untrusted(format!(
            "cannot read the credentials of the daemon at {} (SO_PEERCRED): {e}",
            path.display()
        ))
    })?;
    let me = rustix::process::geteuid().as_raw();
    if cred.uid != me && cred.uid != 0 && !trusted.contains(&cred.uid) {
        return Err(ClientError::Untrusted(format!(
            "the process serving {} runs as uid {}, not as you (uid {me}) or root, so it could read every block you put and serve you forged ones; if that daemon is one you mean to share (started with --allow-gid), trust it with {TRUST_UID_ENV}={} (Python: connect(trust_uid={})); otherwise remove that socket and start your own daemon",
            path.display(),
            cred.uid,
            cred.uid,
            cred.uid
        )));
    }
    let t = opts.answer_timeout.unwrap_or(DEFAULT_ANSWER_TIMEOUT);
    stream.set_read_timeout(Some(t)).ok();
    stream.set_write_timeout(Some(t)).ok();
    Ok((stream, path))
}

/// Connects to the control socket at `path`; errors say how to start a daemon.
fn connect_stream(path: &Path) -> Result<UnixStream> {
    UnixStream::connect(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            // There is a socket, but its mode keeps us out: another user's daemon.
            return ClientError::Disconnected(format!(
                "permission denied connecting to the KacheDB daemon at {} ({e}): it runs as another user; ask its owner to start it with --allow-gid <a group of yours>, or start your own with `kachedb serve --socket <a path of yours>`",
                path.display()
            ));
        }
        ClientError::Disconnected(format!(
            "no KacheDB daemon at {} ({e}): start one with `kachedb serve` (Python: kachedb.connect(start=True))",
            path.display()
        ))
    })
}

/// Sends `req`; if the write fails, returns the daemon's refusal as `refused`
/// makes it, else `failed` of the write error.
fn send(
    stream: &UnixStream,
    req: &ControlRequest,
    refused: impl FnOnce(String) -> ClientError,
    failed: impl FnOnce(std::io::Error) -> ClientError,
) -> Result<()> {
    let line = control::to_line(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
    (&*stream).write_all(&line).map_err(|e| match refusal(stream) {
        Some(why) => refused(why),
        None => failed(e),
    })
}

/// After a failed write: a daemon that refuses a peer (another uid) answers
/// at once and closes, possibly before the peer wrote anything, so the write
/// fails (EPIPE) while the daemon's reason waits in the receive queue. Returns
/// that reason, if there is one.
fn refusal(stream: &UnixStream) -> Option<String> {
    stream.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    let line = control::read_line(&mut BufReader::new(stream)).ok()?;
    control::refusal_in(&line).map(|r| r.reason().to_string())
}

/// Says hello on `stream`; returns the daemon's answer and the region fd that
/// came with it.
pub(crate) fn hello(stream: &UnixStream, tenant: Option<&str>) -> Result<(HelloReply, OwnedFd)> {
    if let Some(name) = tenant {
        control::check_tenant_name(name).map_err(ClientError::Invalid)?;
    }
    send(
        stream,
        &ControlRequest::hello_as(tenant),
        |why| ClientError::Disconnected(format!("the daemon refused the connection: {why}")),
        |e| ClientError::Disconnected(format!("sending hello: {e}")),
    )?;
    let (line, fd) = recv_with_fd(stream)?;
    let reply = control::from_line::<Reply<HelloReply>>(&line)
        .map_err(|e| ClientError::Protocol(format!("hello reply not understood: {e}")))?;
    let reply = match reply {
        Reply::Accepted(r) => r,
        Reply::Refused(r) => {
            return Err(ClientError::Disconnected(format!("the daemon refused the connection: {}", r.reason())))
        }
    };
    let fd = fd.ok_or_else(|| ClientError::Protocol("hello reply carried no region fd".into()))?;
    Ok((reply, fd))
}

/// Reads one line, keeping the first fd passed with it.
fn recv_with_fd(stream: &UnixStream) -> Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut lines = LineBuffer::new();
    let mut fds = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(line) = lines.next_line() {
            return Ok((line, fds.into_iter().next()));
        }
        let n = kachedb_shm::fdpass::recv_with_fds(stream, &mut buf, 1, &mut fds).map_err(|e| {
            if e.kind() == std::io::ErrorKind::WouldBlock {
                ClientError::Untrusted(format!(
                    "the daemon accepted the connection but did not answer hello within {:?}: it is stuck, or the socket is not a KacheDB daemon's",
                    stream.read_timeout().ok().flatten().unwrap_or_default()
                ))
            } else {
                ClientError::Disconnected(format!("reading the daemon's hello reply: {e}"))
            }
        })?;
        if n == 0 {
            return Err(ClientError::Disconnected("the daemon closed the connection during hello".into()));
        }
        lines.extend(&buf[..n]).map_err(|e| ClientError::Protocol(format!("hello reply: {e}")))?;
    }
}

/// Asks the daemon at `opts` for its stats, without taking a channel.
pub fn daemon_stats(opts: &ConnectOptions) -> Result<Stats> {
    let (stream, _) = connect_trusted(opts)?;
    send(
        &stream,
        &ControlRequest::Stats,
        |why| ClientError::Protocol(format!("\"{why}\"")),
        |e| ClientError::Disconnected(e.to_string()),
    )?;
    let line =
        control::read_line(&mut BufReader::new(&stream)).map_err(|e| ClientError::Disconnected(e.to_string()))?;
    match control::from_line::<Reply<StatsReply>>(&line) {
        Ok(Reply::Accepted(r)) => Ok(r.stats),
        Ok(Reply::Refused(r)) => Err(ClientError::Protocol(format!("\"{}\"", r.reason()))),
        Err(e) => Err(ClientError::Protocol(format!("stats reply not understood: {e}"))),
    }
}
