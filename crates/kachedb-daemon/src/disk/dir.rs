//! The disk tier's directory, as the daemon's own: checked once when it is
//! opened, then reached only through descriptors.
//!
//! * **Owner and mode.** `DIR` (made `0700` if missing) must belong to the
//!   daemon's user and not be writable by its group or others; so must
//!   `DIR/blocks` and `DIR/tmp`. Another user who could write there could
//!   plant files or links for the daemon to read, rename or delete.
//! * **No symlink followed under it.** `DIR` itself may be reached through
//!   symlinks (an operator's `/var/cache/kachedb -> /mnt/nvme/…`); every name
//!   under it is opened relative to a directory descriptor with `O_NOFOLLOW`
//!   (`openat`, `renameat`, `unlinkat`, `mkdirat`), so a link planted under it
//!   is refused, never followed: the daemon never reads, writes or deletes a
//!   file outside the directory it opened.
//! * **A lock that removing or replacing DIR cannot fool.** The lock is
//!   `DIR/lock` (`flock`, holding the pid), taken through the directory's
//!   descriptor, and every file operation goes through the descriptors
//!   opened at start: after `rm -rf DIR` (or `mv DIR elsewhere; mkdir DIR`)
//!   the daemon can no longer create anything in the path's new directory,
//!   so a second daemon that locks the new `DIR` never shares a directory
//!   with it. [`TierDir::check_still_ours`] notices that the path no longer
//!   names the directory it opened; the tier then stops (docs/disk.md).
//!
//! A takeover hands the directory's descriptor and the lock's open file
//! to the new daemon ([`TierDir::adopt`]): the `flock` is on the open file
//! both hold, so the lock is never let go between the two daemons.

use super::DiskError;
use super::{catalog, format};
use rustix::fs::{AtFlags, FlockOperation, Mode, OFlags};
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// A block file's header area, page-aligned: what an `O_DIRECT` read of it
/// needs (buffer, offset and length all multiples of the device's block).
#[repr(C, align(4096))]
pub(super) struct HeaderPage(pub [u8; format::HEADER_AREA as usize]);

const _: () = assert!(std::mem::align_of::<HeaderPage>() as u64 == format::HEADER_AREA);

impl HeaderPage {
    pub(super) fn new() -> Box<HeaderPage> {
        Box::new(HeaderPage([0; format::HEADER_AREA as usize]))
    }
}

/// The sub-directories the tier keeps its files in.
const BLOCKS: &str = "blocks";
const TMP: &str = "tmp";
/// The lock file's name.
const LOCK: &str = "lock";

/// A directory the tier uses, opened and checked.
#[derive(Debug)]
pub(super) struct TierDir {
    /// The path it was opened by (for messages, and to check it still names it).
    path: PathBuf,
    root: OwnedFd,
    blocks: OwnedFd,
    tmp: OwnedFd,
    /// `(st_dev, st_ino)` of `root`.
    id: (u64, u64),
    /// `DIR/lock`, `flock`ed, read-only (the file system may turn read-only
    /// under a running daemon).
    lock: OwnedFd,
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(rustix::io::Errno) -> DiskError + 'a {
    move |e| DiskError::Io { what, path: path.display().to_string(), source: e.into() }
}

/// Refuses a directory another user could write (see the module docs).
fn check_owner(path: &Path, st: &rustix::fs::Stat, uid: u32) -> Result<(), DiskError> {
    let mode = st.st_mode & 0o7777;
    if st.st_uid != uid {
        return Err(DiskError::Unsafe {
            path: path.display().to_string(),
            why: format!("it belongs to uid {}, not to the daemon's uid {uid}", st.st_uid),
            fix: format!("chown {uid} {}", path.display()),
        });
    }
    if mode & 0o022 != 0 {
        return Err(DiskError::Unsafe {
            path: path.display().to_string(),
            why: format!("its mode {mode:04o} lets its group or others write it"),
            fix: format!("chmod go-w {}", path.display()),
        });
    }
    Ok(())
}

/// Opens (making it `0700` if missing) the sub-directory `name` of `root`,
/// without following a symlink, and checks it.
fn sub_dir(root: &OwnedFd, root_path: &Path, name: &str, uid: u32) -> Result<OwnedFd, DiskError> {
    let path = root_path.join(name);
    match rustix::fs::mkdirat(root, name, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(io_err("making the directory", &path)(e)),
    }
    let fd = rustix::fs::openat(
        root,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => DiskError::Unsafe {
            path: path.display().to_string(),
            why: "it is not a directory (a symlink, or a file)".into(),
            fix: format!("remove it (the daemon makes it): rm {}", path.display()),
        },
        e => io_err("opening the directory", &path)(e),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(io_err("reading the status of", &path))?;
    check_owner(&path, &st, uid)?;
    Ok(fd)
}

impl TierDir {
    /// Opens `path` for a tier of the daemon's user `uid`: makes it (`0700`)
    /// if missing, checks it and its sub-directories, and takes the lock.
    pub(super) fn open(path: &Path, uid: u32) -> Result<TierDir, DiskError> {
        if !path.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path).map_err(|source| DiskError::Io {
                what: "making the directory",
                path: path.display().to_string(),
                source,
            })?;
        }
        let root = rustix::fs::open(path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(io_err("opening the directory", path))?;
        // Refused before anything is made in it (the lock file).
        let st = rustix::fs::fstat(&root).map_err(io_err("reading the status of", path))?;
        check_owner(path, &st, uid)?;
        let lock = take_lock(&root, path)?;
        Self::with(path, root, lock, uid)
    }

    /// The directory of a daemon taken over: its descriptor `root` and the
    /// lock's open file `lock` (already `flock`ed by the old daemon, and so
    /// by this one), if `path` names that directory; `Ok(None)` if it names
    /// another (then [`open`](Self::open) it).
    pub(super) fn adopt(path: &Path, root: OwnedFd, lock: OwnedFd, uid: u32) -> Result<Option<TierDir>, DiskError> {
        let given = rustix::fs::fstat(&root).map_err(io_err("reading the status of", path))?;
        match rustix::fs::stat(path) {
            Ok(st) if (st.st_dev, st.st_ino) == (given.st_dev, given.st_ino) => {}
            _ => return Ok(None),
        }
        // The same open file as the old daemon's: taking it again succeeds
        // at once, and fails only if the descriptor is not a lock at all.
        if rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive).is_err() {
            return Err(DiskError::InUse { dir: path.display().to_string(), pid: "unknown".into() });
        }
        Self::with(path, root, lock, uid).map(Some)
    }

    fn with(path: &Path, root: OwnedFd, lock: OwnedFd, uid: u32) -> Result<TierDir, DiskError> {
        let st = rustix::fs::fstat(&root).map_err(io_err("reading the status of", path))?;
        check_owner(path, &st, uid)?;
        let blocks = sub_dir(&root, path, BLOCKS, uid)?;
        let tmp = sub_dir(&root, path, TMP, uid)?;
        Ok(TierDir { path: path.to_path_buf(), root, blocks, tmp, id: (st.st_dev, st.st_ino), lock })
    }

    /// Writes this process's pid in the lock file (a daemon that adopted the
    /// directory, once it serves); a failure is logged.
    pub(super) fn write_pid(&self) {
        if let Err(e) = write_pid(&self.root) {
            tracing::warn!("disk tier: writing this daemon's pid in {}/lock: {e}", self.path.display());
        }
    }

    /// The path it was opened by.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// The descriptors a takeover hands over: the directory and the lock.
    pub(super) fn handover_fds(&self) -> [BorrowedFd<'_>; 2] {
        [self.root.as_fd(), self.lock.as_fd()]
    }

    /// `Err` (saying what happened) once `DIR` no longer names the
    /// directory this opened: removed, moved, or replaced.
    pub(super) fn check_still_ours(&self) -> Result<(), String> {
        match rustix::fs::stat(&self.path) {
            Ok(st) if (st.st_dev, st.st_ino) == self.id => Ok(()),
            Ok(_) => Err(format!("{} is another directory now (replaced or moved)", self.path.display())),
            Err(e) => Err(format!("{} is gone ({e})", self.path.display())),
        }
    }

    /// Opens block `key`'s file for reading.
    pub(super) fn open_block(&self, key: u128) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            &self.blocks,
            format::block_name(key),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(File::from(fd))
    }

    /// Reads block `key`'s header area into `page` and the file's status,
    /// for the index rebuild: one open, one `fstat`, one read. The open is
    /// `O_NOATIME` (the read writes no inode) and, while `direct` holds,
    /// `O_DIRECT`: the header page goes from the device to `page` without
    /// entering the page cache, so nothing is left to drop. A file system
    /// that refuses `O_DIRECT` for a regular file clears `direct` and is
    /// read buffered from then on (the page dropped after the read). Returns the bytes read
    /// (fewer than the header area for a file that short) and the status.
    pub(super) fn read_header(
        &self,
        key: u128,
        page: &mut HeaderPage,
        direct: &AtomicBool,
    ) -> std::io::Result<(usize, rustix::fs::Stat)> {
        let name = format::block_name(key);
        let base = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let open = |flags: OFlags| -> rustix::io::Result<OwnedFd> {
            match rustix::fs::openat(&self.blocks, name.as_str(), flags | OFlags::NOATIME, Mode::empty()) {
                // `O_NOATIME` is for the file's owner only.
                Err(rustix::io::Errno::PERM) => rustix::fs::openat(&self.blocks, name.as_str(), flags, Mode::empty()),
                r => r,
            }
        };
        // Whether the file system refused `O_DIRECT` for this file: if it is
        // a regular file, reads go buffered from then on (a planted
        // directory, which refuses it too, changes nothing).
        let mut refused = false;
        if direct.load(Relaxed) {
            match open(base | OFlags::DIRECT) {
                Ok(fd) => {
                    let st = rustix::fs::fstat(&fd)?;
                    match rustix::io::pread(&fd, &mut page.0, 0) {
                        Ok(n) => return Ok((n, st)),
                        Err(rustix::io::Errno::INVAL) => refused = true,
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(rustix::io::Errno::INVAL) => refused = true,
                Err(e) => return Err(e.into()),
            }
        }
        let fd = open(base)?;
        let st = rustix::fs::fstat(&fd)?;
        if refused && rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile {
            direct.store(false, Relaxed);
        }
        // No readahead: the read brings in the header's page only, and that
        // page is uptodate and unlocked when the `DONTNEED` after it runs (a
        // readahead still in flight then would stay cached).
        let _ = rustix::fs::fadvise(&fd, 0, None, rustix::fs::Advice::Random);
        let n = rustix::io::pread(&fd, &mut page.0[..format::HEADER_LEN], 0);
        let _ = rustix::fs::fadvise(&fd, 0, None, rustix::fs::Advice::DontNeed);
        Ok((n?, st))
    }

    /// Creates the temporary file `name` (`0600`; it must not exist).
    pub(super) fn create_tmp(&self, name: &str) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            &self.tmp,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(File::from(fd))
    }

    /// Renames the temporary file `name` to block `key`'s file (replacing it).
    pub(super) fn rename_into_place(&self, name: &str, key: u128) -> std::io::Result<()> {
        Ok(rustix::fs::renameat(&self.tmp, name, &self.blocks, format::block_name(key))?)
    }

    /// Removes block `key`'s file; `Ok(false)` if there was none.
    pub(super) fn remove_block(&self, key: u128) -> std::io::Result<bool> {
        match rustix::fs::unlinkat(&self.blocks, format::block_name(key), AtFlags::empty()) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes the temporary file `name`, if it is there.
    pub(super) fn remove_tmp(&self, name: &str) {
        let _ = rustix::fs::unlinkat(&self.tmp, name, AtFlags::empty());
    }

    /// Makes the names under `blocks/` (renames, removals) durable.
    pub(super) fn sync_blocks(&self) -> std::io::Result<()> {
        Ok(rustix::fs::fsync(&self.blocks)?)
    }

    /// The block files under `blocks/`: each one's key and inode, as the
    /// directory's entries give them (other names are left alone).
    pub(super) fn list_blocks(&self) -> std::io::Result<Vec<(u128, u64)>> {
        let mut out = Vec::new();
        let mut dir = rustix::fs::Dir::read_from(&self.blocks)?;
        while let Some(entry) = dir.read() {
            let entry = entry?;
            if let Some(key) = entry.file_name().to_str().ok().and_then(format::key_of_name) {
                out.push((key, entry.ino()));
            }
        }
        Ok(out)
    }

    /// Empties `tmp/` (writes a crash cut short) but for the catalog
    /// ([`catalog::FILE`]); how many entries went. `unlinkat` removes a link
    /// itself, never what it points to.
    pub(super) fn clear_tmp(&self) -> u64 {
        let Ok(mut dir) = rustix::fs::Dir::read_from(&self.tmp) else { return 0 };
        let mut names = Vec::new();
        while let Some(Ok(entry)) = dir.read() {
            let name = entry.file_name().to_bytes();
            if name != b"."
                && name != b".."
                && name != catalog::FILE.as_bytes()
                && entry.file_type() != rustix::fs::FileType::Directory
            {
                names.push(entry.file_name().to_owned());
            }
        }
        names.iter().filter(|n| rustix::fs::unlinkat(&self.tmp, n.as_c_str(), AtFlags::empty()).is_ok()).count() as u64
    }

    /// The catalog, opened for reading; `Ok(None)` if there is none.
    pub(super) fn open_catalog(&self) -> std::io::Result<Option<File>> {
        match rustix::fs::openat(
            &self.tmp,
            catalog::FILE,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(Some(File::from(fd))),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes a whole new catalog by `write` (under another name, synced,
    /// then renamed over the old one and `tmp/` synced); `write` returns how
    /// many entries it wrote, and so does this.
    pub(super) fn replace_catalog(
        &self,
        write: impl FnOnce(&mut std::io::BufWriter<&File>) -> std::io::Result<u64>,
    ) -> std::io::Result<u64> {
        let _ = rustix::fs::unlinkat(&self.tmp, catalog::NEW_FILE, AtFlags::empty());
        let f = self.create_tmp(catalog::NEW_FILE)?;
        let n = {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, &f);
            let n = write(&mut w)?;
            w.into_inner().map_err(|e| e.into_error())?;
            n
        };
        f.sync_data()?;
        drop(f);
        rustix::fs::renameat(&self.tmp, catalog::NEW_FILE, &self.tmp, catalog::FILE)?;
        rustix::fs::fsync(&self.tmp)?;
        Ok(n)
    }

    /// The catalog, opened for appending (for one batch).
    pub(super) fn append_catalog(&self) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            &self.tmp,
            catalog::FILE,
            OFlags::WRONLY | OFlags::APPEND | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(File::from(fd))
    }

    /// Deletes the catalog, durably (`tmp/` synced after).
    pub(super) fn remove_catalog(&self) -> std::io::Result<()> {
        match rustix::fs::unlinkat(&self.tmp, catalog::FILE, AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(rustix::fs::fsync(&self.tmp)?)
    }
}

/// Takes `DIR/lock` (made `0600` if missing; never through a link) and
/// writes this process's pid in it.
fn take_lock(root: &OwnedFd, path: &Path) -> Result<OwnedFd, DiskError> {
    let lock_path = path.join(LOCK);
    let fd = rustix::fs::openat(
        root,
        LOCK,
        OFlags::RDONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(io_err("opening the lock", &lock_path))?;
    if rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive).is_err() {
        let pid = read_pid(root).unwrap_or_default();
        return Err(DiskError::InUse {
            dir: path.display().to_string(),
            pid: if pid.is_empty() { "unknown".into() } else { pid },
        });
    }
    write_pid(root).map_err(|source| DiskError::Io {
        what: "writing the lock",
        path: lock_path.display().to_string(),
        source,
    })?;
    Ok(fd)
}

/// Writes this process's pid in `DIR/lock` (through a descriptor of its
/// own: the lock's is read-only).
fn write_pid(root: &OwnedFd) -> std::io::Result<()> {
    let w = rustix::fs::openat(
        root,
        LOCK,
        OFlags::WRONLY | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    use std::io::Write;
    File::from(w).write_all(std::process::id().to_string().as_bytes())
}

/// What `DIR/lock` says (its holder's pid).
fn read_pid(root: &OwnedFd) -> Option<String> {
    let fd = rustix::fs::openat(root, LOCK, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty()).ok()?;
    let mut s = String::new();
    use std::io::Read;
    File::from(fd).take(64).read_to_string(&mut s).ok()?;
    Some(s.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kachedb_shm::{DType, Shape};

    /// A fresh directory under `base` (removed when dropped).
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn scratch(base: &str, name: &str) -> Scratch {
        let p = Path::new(base).join(format!("kachedb-dir-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Scratch(p)
    }

    /// Writes block `key`'s file (`len` tensor bytes) under `dir`.
    fn write_block(d: &TierDir, key: u128, len: u64) -> format::Header {
        let payload = vec![9u8; len as usize];
        let h = format::Header {
            tenant: Some("team-a".into()),
            key,
            parent: Some(key + 1),
            dtype: DType::U8,
            shape: Shape::new(&[len]).unwrap(),
            len,
            written_ms: 1,
            checksum: format::checksum(&payload),
        };
        let mut b = h.encode();
        b.extend_from_slice(&payload);
        std::fs::write(format::block_path(&d.path().join(BLOCKS), key), b).unwrap();
        h
    }

    /// The header a rebuild reads is the one written, direct or buffered, on
    /// the temp directory's file system and on tmpfs; a short file gives
    /// the bytes it has; a link planted as a block file is refused.
    #[test]
    fn a_header_read_for_the_index_gives_the_header_and_the_files_length() {
        let uid = rustix::process::geteuid().as_raw();
        let tmp = std::env::temp_dir();
        for base in [tmp.to_str().unwrap(), "/dev/shm"] {
            if !Path::new(base).is_dir() {
                continue;
            }
            let s = scratch(base, "read-header");
            let d = TierDir::open(&s.0, uid).unwrap();
            let h = write_block(&d, 7, 5000);
            let mut page = HeaderPage::new();
            for want_direct in [true, false] {
                let direct = AtomicBool::new(want_direct);
                let (n, st) = d.read_header(7, &mut page, &direct).unwrap();
                assert_eq!(format::Header::decode(&page.0[..n], 7), Ok(h.clone()), "{base}, direct {want_direct}");
                assert_eq!(st.st_size as u64, format::file_len(5000));
            }
            // A file shorter than the header area: its bytes, refused by the decode.
            std::fs::write(format::block_path(&s.0.join(BLOCKS), 8), [1u8; 100]).unwrap();
            let (n, _) = d.read_header(8, &mut page, &AtomicBool::new(true)).unwrap();
            assert_eq!(n, 100);
            assert!(format::Header::decode(&page.0[..n], 8).is_err());
            // A link planted as a block file is not followed.
            std::os::unix::fs::symlink(
                format::block_path(&s.0.join(BLOCKS), 7),
                format::block_path(&s.0.join(BLOCKS), 9),
            )
            .unwrap();
            assert!(d.read_header(9, &mut page, &AtomicBool::new(true)).is_err());
            assert!(d.read_header(10, &mut page, &AtomicBool::new(true)).is_err(), "a missing file");
            // A directory planted as a block file is refused and leaves
            // `O_DIRECT` on for the files after it.
            std::fs::create_dir(format::block_path(&s.0.join(BLOCKS), 11)).unwrap();
            let direct = AtomicBool::new(true);
            assert!(d.read_header(11, &mut page, &direct).is_err(), "a directory");
            assert!(direct.load(Relaxed), "{base}: a planted directory turned O_DIRECT off");
        }
    }
}
