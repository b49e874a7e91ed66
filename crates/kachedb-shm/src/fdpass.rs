//! File descriptors passed over a Unix socket (`SCM_RIGHTS`), for every side
//! that passes them: the daemon's control socket (the region fd with a hello
//! reply), the takeover (the region, the sockets and the lock, then the
//! client connections) and the client (receiving the region fd).
//!
//! The fds travel attached to a byte of the stream: [`send_with_fds`]
//! attaches them to the first byte of what it sends, and [`recv_with_fds`]
//! collects those that come with the bytes it reads. Each call is one
//! `sendmsg` or `recvmsg`; time limits (socket timeouts) and retries on
//! `EINTR` are the caller's.

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The most fds Linux passes in one message (`SCM_MAX_FD`).
pub const MAX_FDS_PER_MESSAGE: usize = 253;

/// Sends as much of `bytes` as one `sendmsg` takes (without `SIGPIPE`),
/// with `fds` attached to its first byte; the bytes sent. The caller sends
/// the rest as plain data. `bytes` must not be empty when `fds` is not.
pub fn send_with_fds(sock: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<usize> {
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && (fds.len() > MAX_FDS_PER_MESSAGE || !cmsg.push(SendAncillaryMessage::ScmRights(fds))) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} fds in one message; at most {MAX_FDS_PER_MESSAGE}", fds.len()),
        ));
    }
    Ok(rustix::net::sendmsg(sock.as_fd(), &[IoSlice::new(bytes)], &mut cmsg, SendFlags::NOSIGNAL)?)
}

/// Reads once (`recvmsg`) into `buf`, adding the fds that came with the
/// bytes (close-on-exec, in the order sent) to `fds`, at most `max_fds` of
/// them: any beyond are closed. The bytes read; 0 at end of stream.
pub fn recv_with_fds(
    sock: impl AsFd,
    buf: &mut [u8],
    max_fds: usize,
    fds: &mut impl Extend<OwnedFd>,
) -> std::io::Result<usize> {
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(max_fds))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let r = rustix::net::recvmsg(sock.as_fd(), &mut [IoSliceMut::new(buf)], &mut cmsg, RecvFlags::CMSG_CLOEXEC)?;
    let mut kept = 0;
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(got) = m {
            // Those beyond `max_fds` (the buffer rounds up) are closed here.
            for fd in got {
                if kept < max_fds {
                    fds.extend(Some(fd));
                    kept += 1;
                }
            }
        }
    }
    Ok(r.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    #[test]
    fn fds_arrive_with_the_first_byte_and_work() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut pipe_r, pipe_w) = std::io::pipe().unwrap();
        assert_eq!(send_with_fds(&a, b"hello", &[pipe_w.as_fd()]).unwrap(), 5);
        drop(pipe_w);
        let mut buf = [0u8; 16];
        let mut fds = Vec::new();
        let n = recv_with_fds(&b, &mut buf, 4, &mut fds).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 1);
        // The fd received is the pipe's write end: what goes in comes out.
        std::fs::File::from(fds.pop().unwrap()).write_all(b"through").unwrap();
        let mut out = String::new();
        pipe_r.read_to_string(&mut out).unwrap();
        assert_eq!(out, "through");
    }

    #[test]
    fn fds_beyond_max_are_not_received() {
        let (a, b) = UnixStream::pair().unwrap();
        let (_r, w) = std::io::pipe().unwrap();
        send_with_fds(&a, b"x", &[w.as_fd(), w.as_fd(), w.as_fd()]).unwrap();
        let mut fds = Vec::new();
        assert_eq!(recv_with_fds(&b, &mut [0u8; 4], 1, &mut fds).unwrap(), 1);
        assert_eq!(fds.len(), 1);
    }

    #[test]
    fn too_many_fds_is_an_error_not_a_send() {
        let (a, _b) = UnixStream::pair().unwrap();
        let (_r, w) = std::io::pipe().unwrap();
        let many = vec![w.as_fd(); MAX_FDS_PER_MESSAGE + 1];
        let e = send_with_fds(&a, b"x", &many).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    }
}
