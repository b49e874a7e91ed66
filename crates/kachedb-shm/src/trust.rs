//! Who trusts whom on the control socket, for both ends: the peer's
//! credentials ([`peer_cred`], `SO_PEERCRED`, defined for a peer in another
//! PID namespace) and the rule for a socket directory nobody else can swap
//! the socket in ([`check_socket_dir`]).

use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

/// A socket peer's credentials as the kernel reports them (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's pid in *our* PID namespace; `None` when the kernel reports
    /// 0, which it does for a peer in a PID namespace we cannot see (another
    /// container) — such a peer has no pid we could signal or watch.
    pub pid: Option<u32>,
    /// The peer's effective uid (when it called `connect` or `listen`).
    pub uid: u32,
    /// The peer's effective gid (idem).
    pub gid: u32,
}

/// Reads `SO_PEERCRED` of a connected Unix socket; a pid of 0 comes back as
/// `pid: None`. The one raw `getsockopt` of the workspace: rustix's
/// `socket_peercred` reads into a `UCred` whose `pid` is a `Pid` (a
/// `NonZeroI32`), and the kernel reports pid 0 for a peer in a PID namespace
/// we cannot see (another container), which that type cannot hold.
pub fn peer_cred(sock: impl AsFd) -> std::io::Result<PeerCred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a plain-old-data `ucred` (every bit pattern valid) that
    // outlives the call, and `len` says its exact size, so the kernel writes
    // at most that many bytes into it; the fd is borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "short SO_PEERCRED answer"));
    }
    Ok(PeerCred { pid: u32::try_from(cred.pid).ok().filter(|&p| p != 0), uid: cred.uid, gid: cred.gid })
}

/// Checks that `dir` (a control socket's directory) cannot be used by
/// someone else to swap the socket or the lock file: its owner must be this
/// process's effective uid, root, or one of `trusted_uids`, and it must not
/// be writable by group or others unless it is sticky (like `/tmp`, where
/// nobody can remove or rename another user's file). `Err` says what is
/// wrong, for a message.
pub fn check_socket_dir(dir: &Path, trusted_uids: &[u32]) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(dir).map_err(|e| format!("cannot check it: {e}"))?;
    let euid = rustix::process::geteuid().as_raw();
    if md.uid() != euid && md.uid() != 0 && !trusted_uids.contains(&md.uid()) {
        return Err(format!("it belongs to uid {}", md.uid()));
    }
    if md.mode() & 0o022 != 0 && md.mode() & 0o1000 == 0 {
        return Err(format!(
            "its mode {:o} lets {} write to it",
            md.mode() & 0o7777,
            if md.mode() & 0o002 != 0 { "everyone" } else { "its group" }
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_cred_of_a_socketpair_is_ours() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let c = peer_cred(&a).unwrap();
        assert_eq!(c.pid, Some(std::process::id()));
        assert_eq!(c.uid, rustix::process::geteuid().as_raw());
        assert_eq!(c.gid, rustix::process::getegid().as_raw());
    }
}
