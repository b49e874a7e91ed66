//! Who trusts whom on the control socket, for both ends: the peer's
//! credentials ([`peer_cred`], `SO_PEERCRED`, defined for a peer in another
//! PID namespace; [`peer_groups`], `SO_PEERGROUPS`) and the rule for a socket directory nobody else can swap
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
/// `pid: None`. One of the two raw `getsockopt`s of the workspace (with
/// [`peer_groups`]): rustix's
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

/// Most supplementary groups a process can have (`NGROUPS_MAX` on Linux).
const MAX_GROUPS: usize = 65_536;

/// Reads `SO_PEERGROUPS` of a connected Unix socket: the peer's
/// supplementary groups when it called `connect` (Linux 4.13 and later;
/// older kernels answer `ENOPROTOOPT`). The list is fixed at connect, as
/// `SO_PEERCRED` is: a process cannot leave a group it connected with by
/// changing its credentials afterwards.
pub fn peer_groups(sock: impl AsFd) -> std::io::Result<Vec<u32>> {
    let fd = sock.as_fd().as_raw_fd();
    let mut groups: Vec<libc::gid_t> = vec![0; 32];
    loop {
        let mut len = std::mem::size_of_val(groups.as_slice()) as libc::socklen_t;
        // SAFETY: `groups` is a buffer of plain integers (every bit pattern
        // valid) of exactly `len` bytes that outlives the call, so the kernel
        // writes at most that many bytes into it; the fd is borrowed for the call.
        let rc = unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERGROUPS, groups.as_mut_ptr().cast(), &mut len)
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n.min(groups.len()));
            return Ok(groups);
        }
        let e = std::io::Error::last_os_error();
        // Too small a buffer: the kernel says in `len` how much it needs.
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= MAX_GROUPS {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
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

    #[test]
    fn peer_groups_of_a_socketpair_are_ours() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut got = peer_groups(&a).unwrap();
        let mut want: Vec<u32> = rustix::process::getgroups().unwrap().iter().map(|g| g.as_raw()).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
    }
}
