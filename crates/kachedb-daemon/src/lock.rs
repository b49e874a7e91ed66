//! The instance lock: `<socket>.lock`, held with `flock` for the daemon's
//! whole life, so that two daemons never serve one socket.
//!
//! The file is removed on a clean stop, which opens a classic race: a
//! contender that opened the file just before the holder unlinked it can
//! then lock the *unlinked* inode, while a third process creates a fresh
//! file at the path and locks that one too: two "holders". [`InstanceLock::
//! acquire`] therefore checks, after taking the `flock`, that the path still
//! names the very inode it locked (same device and inode number) and starts
//! over otherwise. The holder unlinks the path *before* it lets go of the
//! lock ([`InstanceLock::release`]), so a lock on an inode that the path
//! still names is always the one live lock.

use rustix::fs::FlockOperation;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why the lock was not taken.
#[derive(Debug)]
pub enum LockError {
    /// Another process holds it; the text is what the lock file says (its pid), if readable.
    Held(Option<String>),
    /// Opening or checking the file failed.
    Io(std::io::Error),
}

/// A held instance lock. Dropping it releases the `flock` but leaves the
/// file; [`InstanceLock::release`] removes the file first.
#[derive(Debug)]
pub struct InstanceLock {
    file: File,
    path: PathBuf,
}

impl InstanceLock {
    /// Takes the lock at `path` without blocking, writes this process's pid
    /// into it and returns it; [`LockError::Held`] if another process holds it.
    pub fn acquire(path: &Path) -> Result<InstanceLock, LockError> {
        // A few rounds: each lost round means a holder unlinked the file
        // between our open and our flock; that cannot repeat for long.
        for _ in 0..64 {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                // A symlink planted at the lock path is refused, not followed.
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(path)
                .map_err(LockError::Io)?;
            if rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
                return Err(LockError::Held(std::fs::read_to_string(path).ok().map(|p| p.trim().to_string())));
            }
            let ours = file.metadata().map_err(LockError::Io)?;
            match std::fs::symlink_metadata(path) {
                Ok(now) if now.dev() == ours.dev() && now.ino() == ours.ino() => {
                    use std::io::{Seek, Write};
                    let mut l = &file;
                    let _ = l.set_len(0);
                    let _ = l.seek(std::io::SeekFrom::Start(0));
                    let _ = write!(l, "{}", std::process::id());
                    return Ok(InstanceLock { file, path: path.to_path_buf() });
                }
                // Unlinked (or replaced) after our open: this lock guards nothing.
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(LockError::Io(e)),
            }
        }
        Err(LockError::Held(None))
    }

    /// A second fd of the lock's open file (the flock is shared by both),
    /// for a takeover to hand over.
    pub fn dup(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.file.try_clone().map(Into::into)
    }

    /// The lock a takeover handed over: `fd` is the old daemon's open file,
    /// so the flock it took is held here too. Writes this process's pid in it.
    pub fn taken_over(fd: std::os::fd::OwnedFd, path: &Path) -> InstanceLock {
        use std::io::{Seek, Write};
        let file = File::from(fd);
        let mut l = &file;
        let _ = l.set_len(0);
        let _ = l.seek(std::io::SeekFrom::Start(0));
        let _ = write!(l, "{}", std::process::id());
        InstanceLock { file, path: path.to_path_buf() }
    }

    /// Lets go of this process's fd of the lock without unlinking the file:
    /// the daemon that took over holds the same lock.
    pub fn hand_over(self) {
        drop(self.file);
    }

    /// Removes the lock file, then lets go of the lock (in that order, see
    /// the module notes).
    pub fn release(self) {
        let _ = std::fs::remove_file(&self.path);
        drop(self.file);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Many contenders take and release (unlinking) the lock in a tight loop;
    /// at no moment may two of them hold it. Without the inode check after
    /// `flock` this fails within a few thousand rounds (a contender locks the
    /// unlinked inode while another creates and locks a fresh file).
    #[test]
    fn lock_is_never_held_twice_while_holders_unlink_it() {
        let dir = std::env::temp_dir().join(format!("kachedb-lock-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.sock.lock");
        let holders = Arc::new(AtomicUsize::new(0));
        let taken = Arc::new(AtomicUsize::new(0));
        let broken = Arc::new(AtomicBool::new(false));
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
        let threads: Vec<_> = (0..6)
            .map(|_| {
                let (path, holders, taken, broken) = (path.clone(), holders.clone(), taken.clone(), broken.clone());
                std::thread::spawn(move || {
                    while std::time::Instant::now() < deadline && !broken.load(Ordering::Relaxed) {
                        if let Ok(l) = InstanceLock::acquire(&path) {
                            if holders.fetch_add(1, Ordering::SeqCst) != 0 {
                                broken.store(true, Ordering::Relaxed);
                            }
                            taken.fetch_add(1, Ordering::Relaxed);
                            std::thread::yield_now();
                            holders.fetch_sub(1, Ordering::SeqCst);
                            l.release();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!broken.load(Ordering::Relaxed), "two holders of one instance lock");
        assert!(taken.load(Ordering::Relaxed) > 100, "too few rounds to mean anything");
    }

    #[test]
    fn symlink_at_the_lock_path_is_refused() {
        let dir = std::env::temp_dir().join(format!("kachedb-lock-link-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("victim");
        std::fs::write(&target, "keep").unwrap();
        let path = dir.join("y.sock.lock");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(matches!(InstanceLock::acquire(&path), Err(LockError::Io(_))));
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
