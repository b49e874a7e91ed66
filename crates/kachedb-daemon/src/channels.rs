//! The channel pool: which channels are free to hand to a new client, and
//! which are held back in quarantine. The control thread takes channels for
//! new clients; the serve loop gives them back when a client is gone.

use rustix::event::{PollFd, PollFlags};
use std::sync::Mutex;

/// Free channels, and channels in quarantine; shared by the control thread and the serve loop.
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
                // A peer without a visible pid (pid 0): we can never see it exit.
                None => false,
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
    pub fn take(&self, pid: i32) -> Option<u32> {
        self.release_exited();
        if let Ok(mut q) = self.quarantine.lock() {
            // Pid 0 (a peer in another PID namespace) names no process: two
            // such peers must not get each other's quarantined channel.
            if let Some(i) = q.iter().position(|x| pid != 0 && x.pid == pid) {
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
            // The peer's pid is not visible here (pid 0: another PID
            // namespace), so we cannot tell when it exits, and it may write
            // the channel's rings for as long as it lives: the channel stays
            // out of the pool until the daemon restarts.
            tracing::warn!(
                channel = ch,
                "holding back the channel of a disconnected client in another PID namespace until the daemon restarts"
            );
            if let Ok(mut q) = self.quarantine.lock() {
                q.push(Quarantined { channel: ch, pid: 0, pidfd: None });
            }
            return;
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

    /// The free channels, and the quarantined ones with their process, for a
    /// takeover (`crate::takeover`).
    pub(crate) fn snapshot(&self) -> (Vec<u32>, Vec<(u32, i32)>) {
        let free = self.free.lock().map(|f| f.clone()).unwrap_or_default();
        let q = self.quarantine.lock().map(|q| q.iter().map(|x| (x.channel, x.pid)).collect()).unwrap_or_default();
        (free, q)
    }

    /// The pool as [`snapshot`](Self::snapshot) gave it in the daemon taken
    /// over: quarantined channels watch their process again (one that
    /// exited meanwhile is freed at the next look).
    pub(crate) fn restore(free: Vec<u32>, quarantine: &[(u32, i32)]) -> Self {
        let c = Self { free: Mutex::new(free), quarantine: Mutex::new(Vec::new()) };
        for &(ch, pid) in quarantine {
            c.quarantine(ch, pid);
        }
        c
    }

    /// Channels in quarantine.
    pub fn quarantined(&self) -> usize {
        self.quarantine.lock().map(|q| q.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Item 2 of issue 12: a disconnected client whose pid the daemon cannot
    /// see (SO_PEERCRED pid 0) keeps its channel out of the pool, and another
    /// pid-0 client never gets it back.
    #[test]
    fn channel_of_a_pid0_peer_stays_quarantined() {
        let c = Channels::new(2);
        let a = c.take(0).unwrap();
        c.quarantine(a, 0);
        assert_eq!(c.quarantined(), 1);
        c.release_exited();
        assert_eq!(c.quarantined(), 1);
        let b = c.take(0).unwrap();
        assert_ne!(a, b);
        assert_eq!(c.take(0), None);
    }
}
