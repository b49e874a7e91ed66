//! The control socket: the slow path. Accepts clients, authenticates them with
//! `SO_PEERCRED`, hands over the region fd (`SCM_RIGHTS`) and a channel, answers
//! `stats`, and notices at once (EOF) when a client goes away.
//!
//! Runs on its own thread; talks to the serve loop through an mpsc queue of
//! [`Event`]s, ringing the region doorbell so a parked loop sees them.

use crate::serve::Event;
use kachedb_shm::Region;
use rustix::event::{PollFd, PollFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use std::collections::HashMap;
use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Longest control message (bytes).
pub const MAX_LINE_LEN: usize = 64 * 1024;
/// Control protocol version.
pub const CONTROL_VERSION: u64 = 1;

/// Who may connect.
#[derive(Clone, Debug)]
pub struct Access {
    /// The daemon's effective uid: peers with it are allowed.
    pub uid: u32,
    /// Extra groups whose members (by primary gid) are allowed.
    pub allow_gids: Vec<u32>,
}

struct Conn {
    stream: Arc<UnixStream>,
    buf: Vec<u8>,
    /// Channel given to this connection, if it said hello.
    channel: Option<u32>,
    pid: i32,
    /// The daemon closes this connection for a protocol error (the client
    /// did not hang up: its process may still write its rings).
    refused: bool,
}

/// State shared with the serve loop: free channels, and channels in quarantine.
#[derive(Debug)]
pub struct Channels {
    free: Mutex<Vec<u32>>,
    /// Channels of clients that the daemon disconnected (a corrupt ring, a
    /// control protocol error) while their process lived on. Such a process
    /// still maps the region and may keep writing the channel's rings; handed
    /// to a new client, the channel would carry its garbage into that
    /// client's requests and completions. So it stays out of the pool until
    /// that process has exited, or goes back to that same process when it
    /// connects again (its writes then only hurt itself).
    quarantine: Mutex<Vec<Quarantined>>,
}

#[derive(Debug)]
struct Quarantined {
    channel: u32,
    pid: i32,
    /// Readable once the process has exited; `None` where pidfds are not
    /// available (then `kill(pid, 0)` tells).
    pidfd: Option<std::os::fd::OwnedFd>,
}

impl Quarantined {
    fn exited(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut fds = [PollFd::new(fd, PollFlags::IN)];
                let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
                matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
            }
            None => match rustix::process::Pid::from_raw(self.pid) {
                Some(p) => rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH),
                None => true,
            },
        }
    }
}

impl Channels {
    /// All `count` channels free.
    pub fn new(count: u32) -> Self {
        Self { free: Mutex::new((0..count).rev().collect()), quarantine: Mutex::new(Vec::new()) }
    }

    /// A channel for a client of process `pid`: its own quarantined channel if
    /// it has one, else a free one.
    fn take(&self, pid: i32) -> Option<u32> {
        self.release_exited();
        if let Ok(mut q) = self.quarantine.lock() {
            if let Some(i) = q.iter().position(|x| x.pid == pid) {
                return Some(q.swap_remove(i).channel);
            }
        }
        self.free.lock().ok()?.pop()
    }

    /// Returns a recycled channel to the pool.
    pub fn put_back(&self, ch: u32) {
        if let Ok(mut f) = self.free.lock() {
            f.push(ch);
        }
    }

    /// Channel `ch` of process `pid`, whose connection the daemon closed:
    /// kept out of the pool until `pid` exits (see [`Channels`]).
    pub fn quarantine(&self, ch: u32, pid: i32) {
        use rustix::process::{pidfd_open, Pid, PidfdFlags};
        let Some(p) = Pid::from_raw(pid) else {
            // The peer's pid is not visible here (another pid namespace):
            // nothing to wait for.
            return self.put_back(ch);
        };
        let pidfd = match pidfd_open(p, PidfdFlags::empty()) {
            Ok(fd) => Some(fd),
            Err(rustix::io::Errno::SRCH) => return self.put_back(ch), // already gone
            Err(_) => None,
        };
        if let Ok(mut q) = self.quarantine.lock() {
            q.push(Quarantined { channel: ch, pid, pidfd });
        }
    }

    /// Returns the quarantined channels whose process has exited to the pool.
    pub fn release_exited(&self) {
        let Ok(mut q) = self.quarantine.lock() else { return };
        let mut i = 0;
        while i < q.len() {
            if q[i].exited() {
                let x = q.swap_remove(i);
                self.put_back(x.channel);
            } else {
                i += 1;
            }
        }
    }

    /// Channels in quarantine.
    pub fn quarantined(&self) -> usize {
        self.quarantine.lock().map(|q| q.len()).unwrap_or(0)
    }
}

/// Runs the control loop until `shutdown` is set.
pub fn run(
    listener: UnixListener,
    region: Arc<Region>,
    access: Access,
    channels: Arc<Channels>,
    events: Sender<Event>,
    shutdown: Arc<AtomicBool>,
) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!("control socket: cannot make it non-blocking: {e}");
        return;
    }
    let mut conns: HashMap<i32, Conn> = HashMap::new();
    let send = |ev: Event| {
        let _ = events.send(ev);
        region.doorbell().notify();
    };
    while !shutdown.load(Ordering::Relaxed) {
        let fds: Vec<i32> = conns.keys().copied().collect();
        let mut pollfds = Vec::with_capacity(fds.len() + 1);
        pollfds.push(PollFd::new(&listener, PollFlags::IN));
        for fd in &fds {
            pollfds.push(PollFd::new(conns[fd].stream.as_ref(), PollFlags::IN));
        }
        let timeout = rustix::time::Timespec { tv_sec: 0, tv_nsec: 200_000_000 };
        if rustix::event::poll(&mut pollfds, Some(&timeout)).is_err() {
            continue;
        }
        let listener_ready = !pollfds[0].revents().is_empty();
        let ready: Vec<i32> =
            fds.iter().zip(&pollfds[1..]).filter(|(_, p)| !p.revents().is_empty()).map(|(fd, _)| *fd).collect();
        drop(pollfds);
        if listener_ready {
            accept_all(&listener, &access, &mut conns);
        }
        for fd in ready {
            let close = match conns.get_mut(&fd) {
                Some(c) => service(c, &region, &channels, &events, &send),
                None => false,
            };
            if close {
                if let Some(c) = conns.remove(&fd) {
                    let _ = c.stream.shutdown(std::net::Shutdown::Both);
                    if let Some(ch) = c.channel {
                        tracing::info!(channel = ch, pid = c.pid, "client disconnected");
                        send(Event::Detach { channel: ch, closed_by_daemon: c.refused });
                    }
                }
            }
        }
    }
    for (_, c) in conns.drain() {
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn accept_all(listener: &UnixListener, access: &Access, conns: &mut HashMap<i32, Conn>) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let cred = match rustix::net::sockopt::socket_peercred(&stream) {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!("refusing a connection: cannot read SO_PEERCRED: {e}");
                        continue;
                    }
                };
                let (uid, gid, pid) = (cred.uid.as_raw(), cred.gid.as_raw(), cred.pid.as_raw_nonzero().get());
                if uid != access.uid && !access.allow_gids.contains(&gid) {
                    tracing::warn!(uid, gid, pid, "refusing a client of another user");
                    let mut s = &stream;
                    let _ = s.write_all(
                        format!(
                            "{{\"ok\":false,\"error\":\"permission denied: uid {uid} is not the daemon's uid {}; start the daemon with --allow-gid <gid> to admit a group\"}}\n",
                            access.uid
                        )
                        .as_bytes(),
                    );
                    continue;
                }
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                let fd = stream.as_raw_fd();
                conns
                    .insert(fd, Conn { stream: Arc::new(stream), buf: Vec::new(), channel: None, pid, refused: false });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                return;
            }
        }
    }
}

/// Reads what is there; handles complete lines. Returns true to close.
fn service(
    c: &mut Conn,
    region: &Arc<Region>,
    channels: &Channels,
    events: &Sender<Event>,
    send: &dyn Fn(Event),
) -> bool {
    let mut tmp = [0u8; 4096];
    loop {
        match (&*c.stream).read(&mut tmp) {
            Ok(0) => return true,
            Ok(n) => {
                c.buf.extend_from_slice(&tmp[..n]);
                if c.buf.len() > MAX_LINE_LEN {
                    reply_err(c, "control message longer than 64 KiB");
                    return true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
    while let Some(pos) = c.buf.iter().position(|&b| b == b'\n') {
        let line: Vec<u8> = c.buf.drain(..=pos).collect();
        if handle_line(c, &line[..line.len() - 1], region, channels, events, send) {
            return true;
        }
    }
    false
}

/// Answers an error; the caller then closes the connection.
fn reply_err(c: &mut Conn, msg: &str) {
    c.refused = true;
    let v = serde_json::json!({"ok": false, "error": msg});
    let _ = write_line(&c.stream, &v);
}

fn write_line(stream: &UnixStream, v: &serde_json::Value) -> std::io::Result<()> {
    let mut bytes = v.to_string().into_bytes();
    bytes.push(b'\n');
    // The socket is non-blocking; replies are small, so a full buffer means a
    // client that does not read: give up on it.
    let mut s = stream;
    s.write_all(&bytes)
}

/// Returns true to close the connection.
fn handle_line(
    c: &mut Conn,
    line: &[u8],
    region: &Arc<Region>,
    channels: &Channels,
    events: &Sender<Event>,
    send: &dyn Fn(Event),
) -> bool {
    let msg: serde_json::Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => {
            reply_err(c, &format!("control message is not JSON ({e}); send {{\"op\":\"hello\",\"version\":1}}"));
            return true;
        }
    };
    match msg.get("op").and_then(|o| o.as_str()) {
        Some("hello") => {
            if c.channel.is_some() {
                reply_err(c, "hello sent twice on one connection");
                return true;
            }
            let version = msg.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
            if version != CONTROL_VERSION {
                reply_err(c, &format!("control protocol version {version} is not {CONTROL_VERSION}: upgrade the client or the daemon so they match"));
                return true;
            }
            let Some(ch) = channels.take(c.pid) else {
                let held = match channels.quarantined() {
                    0 => String::new(),
                    n => format!(" ({n} held back until the processes of clients disconnected as corrupt exit)"),
                };
                reply_err(c, &format!("all {} channels are in use{held}: start the daemon with more --channels, or close idle clients", region.layout().channel_count));
                return true;
            };
            // The channel's rings were reset when it was recycled; reset again in
            // case it was never used.
            region.reset_channel(ch);
            c.channel = Some(ch);
            send(Event::Attach { channel: ch, stream: c.stream.clone(), pid: c.pid });
            let l = region.layout();
            let reply = serde_json::json!({
                "ok": true,
                "channel": ch,
                "generation": region.generation(),
                "region_len": l.region_len,
                "layout_version": kachedb_shm::region::LAYOUT_VERSION,
                "daemon_pid": std::process::id(),
            });
            if let Err(e) = send_with_fd(&c.stream, &reply, region) {
                tracing::warn!("could not hand the region to pid {}: {e}", c.pid);
                return true;
            }
            tracing::info!(channel = ch, pid = c.pid, "client connected");
            false
        }
        Some("stats") => {
            let (tx, rx) = mpsc::channel();
            let _ = events.send(Event::Stats(tx));
            region.doorbell().notify();
            let v = match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(stats) => serde_json::json!({"ok": true, "stats": stats}),
                Err(_) => serde_json::json!({"ok": false, "error": "the serve loop did not answer within 5 s"}),
            };
            let _ = write_line(&c.stream, &v);
            false
        }
        Some(other) => {
            reply_err(c, &format!("unknown control op {other:?}: expected \"hello\" or \"stats\""));
            true
        }
        None => {
            reply_err(c, "control message has no \"op\"");
            true
        }
    }
}

fn send_with_fd(stream: &UnixStream, v: &serde_json::Value, region: &Region) -> std::io::Result<()> {
    let mut bytes = v.to_string().into_bytes();
    bytes.push(b'\n');
    let fds = [region.fd()];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    cmsg.push(SendAncillaryMessage::ScmRights(&fds));
    let n = rustix::net::sendmsg(stream.as_fd(), &[IoSlice::new(&bytes)], &mut cmsg, SendFlags::NOSIGNAL)?;
    if n != bytes.len() {
        // The fd went with the first byte; the rest is plain data.
        let mut s = stream;
        s.write_all(&bytes[n..])?;
    }
    Ok(())
}
