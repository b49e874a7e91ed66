//! Helpers of the disk tier's suites (`tests/disk.rs`, `tests/disk_trust.rs`):
//! daemons with a disk tier, the stats they are waited on by, block
//! patterns and files, and the file systems and cgroups the fault tests make
//! (a size-limited tmpfs, a loop-mounted ext4 image, a blkio read throttle, a
//! freezer for the tier's threads; those need root: the tests that make
//! them are ignored without it, `common::need`).

use super::*;
use kachedb_client::{Client, Key};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A daemon serving `tmp`'s socket with the disk tier on `disk`.
pub fn disk_daemon(tmp: &TempDir, size: &str, disk: &Path, disk_size: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--disk", disk.to_str().expect("utf-8 path"), "--disk-size", disk_size];
    args.extend_from_slice(extra);
    let mut d = Daemon::spawn_with(&tmp.socket(), size, &args);
    d.wait_ready();
    d
}

/// Waits until the disk tier's start-up index is built; its stats then.
pub fn indexed(socket: &Path) -> Value {
    poll_stats_fast(socket, Duration::from_secs(60), "disk index rebuilt", |v| v["disk_indexed"] == true).0
}

/// Waits until the write-behind queue is empty; the stats then.
pub fn drained(socket: &Path) -> Value {
    poll_stats_fast(socket, Duration::from_secs(60), "disk queue drained", |v| num(v, "disk_queue_blocks") == 0).0
}

/// The pattern of `key`, `len` bytes.
pub fn pattern(key: Key, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    fill(&mut b, seed_of(key));
    b
}

/// Files in `dir` (0 if it is missing).
pub fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|rd| rd.count()).unwrap_or(0)
}

/// The disk tier's catalog (docs/disk.md, "The catalog").
pub fn catalog_file(disk: &Path) -> PathBuf {
    disk.join("tmp").join("catalog")
}

/// Deletes the catalog: the next start reads every block file's header (as
/// on a directory a build before the catalog wrote).
pub fn forget_catalog(disk: &Path) {
    match std::fs::remove_file(catalog_file(disk)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("removing the catalog: {e}"),
    }
}

/// Files under `DIR/tmp` that are unfinished writes (the catalog is not one).
pub fn unfinished_writes(disk: &Path) -> usize {
    std::fs::read_dir(disk.join("tmp"))
        .map(|rd| rd.filter_map(Result::ok).filter(|e| e.file_name() != "catalog").count())
        .unwrap_or(0)
}

pub fn block_file(disk: &Path, key: Key) -> PathBuf {
    disk.join("blocks").join(format!("{:032x}.kdb", key.0))
}

/// Pushes the blocks put so far out of the megaslab (whose eviction takes
/// the least recently used first): `n` blocks of 1 MiB of key tag `tag`,
/// each written to disk before the next (a DELETE would delete the disk
/// copies too).
pub fn push_out_of_ram(c: &Client, socket: &Path, tag: u64, n: u64) {
    for j in 0..n {
        c.put(tkey(tag, j), &[j as u8; 1 << 20]).expect("put a filler");
        drained(socket);
    }
}

/// A file system mounted for a test, unmounted (lazily) when dropped.
pub struct Mount {
    pub at: PathBuf,
    image: Option<PathBuf>,
}

impl Mount {
    pub fn run(cmd: &mut Command) {
        let out = cmd.output().expect("run a mount tool");
        assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// A tmpfs of `size` (e.g. "4m") at `at`.
    pub fn tmpfs(at: &Path, size: &str) -> Mount {
        std::fs::create_dir_all(at).expect("mount point");
        Mount::run(
            Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"]).arg(at),
        );
        Mount { at: at.to_path_buf(), image: None }
    }

    /// An ext4 image of `mib` MiB, loop-mounted at `at`.
    pub fn ext4(at: &Path, mib: u64) -> Mount {
        std::fs::create_dir_all(at).expect("mount point");
        let image = at.with_extension("img");
        let f = std::fs::File::create(&image).expect("image file");
        f.set_len(mib << 20).expect("size the image");
        Mount::run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image));
        Mount::run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(at));
        Mount { at: at.to_path_buf(), image: Some(image) }
    }

    pub fn remount_ro(&self) {
        Mount::run(Command::new("mount").args(["-o", "remount,ro"]).arg(&self.at));
    }

    pub fn remount_rw(&self) {
        Mount::run(Command::new("mount").args(["-o", "remount,rw"]).arg(&self.at));
    }

    /// Detaches the file system (lazily: open files stay valid, paths no longer reach it).
    pub fn detach(&self) {
        Mount::run(Command::new("umount").arg("-l").arg(&self.at));
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).output();
        if let Some(i) = &self.image {
            let _ = std::fs::remove_file(i);
        }
    }
}

/// Reads of one block device throttled for the processes of a blkio cgroup
/// (cgroup v1 `blkio.throttle.read_bps_device`, or v2 `io.max` where the
/// `io` controller is on); lifting the limit lets stalled reads go at once.
/// Dropped: the limit lifted, the group removed.
pub struct ReadThrottle {
    dir: PathBuf,
    dev: String,
    v2: bool,
}

impl ReadThrottle {
    /// A group for `name` throttling reads of device `dev` (`major:minor`);
    /// the test fails where this machine has no blkio controller (it is
    /// ignored there unless built where there was one: `kdb_blkio`).
    pub fn new(name: &str, dev: String) -> ReadThrottle {
        let v1 = Path::new("/sys/fs/cgroup/blkio/cgroup.procs");
        let v2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "io"));
        let (dir, v2) = if v1.exists() {
            (PathBuf::from("/sys/fs/cgroup/blkio").join(format!("kdb-{name}-{}", std::process::id())), false)
        } else if v2 {
            let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+io");
            (PathBuf::from("/sys/fs/cgroup").join(format!("kdb-{name}-{}", std::process::id())), true)
        } else {
            panic!("{name} needs a blkio (cgroup v1) or io (cgroup v2) controller to stall a disk with");
        };
        std::fs::create_dir_all(&dir).expect("make the cgroup");
        ReadThrottle { dir, dev, v2 }
    }

    /// The file whose writing moves a process into the group.
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Limits reads to `bps` bytes a second; 0 lifts the limit.
    pub fn limit(&self, bps: u64) {
        let (file, line) = if self.v2 {
            let v = if bps == 0 { "max".to_string() } else { bps.to_string() };
            ("io.max", format!("{} rbps={v}", self.dev))
        } else {
            ("blkio.throttle.read_bps_device", format!("{} {bps}", self.dev))
        };
        std::fs::write(self.dir.join(file), line).expect("set the read limit");
    }

    /// A daemon started inside the group from its first instruction.
    pub fn daemon(&self, socket: &Path, size: &str, extra: &[&str]) -> Daemon {
        let inner = Daemon::command(socket, size, extra);
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("echo $$ > {} && exec \"$@\"", self.procs().display()))
            .arg("sh")
            .arg(inner.get_program())
            .args(inner.get_args());
        for (k, v) in inner.get_envs() {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut d = Daemon::launch(cmd, socket);
        d.wait_ready();
        d
    }
}

impl Drop for ReadThrottle {
    fn drop(&mut self) {
        if std::panic::catch_unwind(|| self.limit(0)).is_err() {
            eprintln!("could not lift the read limit of {}", self.dir.display());
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `major:minor` of the device holding `path`'s file system.
pub fn device_of(path: &Path) -> String {
    let st = rustix::fs::stat(path).expect("stat");
    format!("{}:{}", rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev))
}

/// Drops the page-cache pages of every block file under `disk`.
pub fn uncache_blocks(disk: &Path) {
    for e in std::fs::read_dir(disk.join("blocks")).expect("blocks dir").flatten() {
        if let Ok(f) = std::fs::File::open(e.path()) {
            let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
        }
    }
}

/// Threads of a process stopped in their tracks (cgroup v1 `freezer`): the
/// disk tier's writers frozen, say, while everything else of the daemon
/// runs, so that its write-behind queue stays full as long as a test needs.
/// A frozen thread holds no lock of the daemon's if it was frozen while
/// waiting for work. Dropped (or [`thaw`](Self::thaw)ed): the threads run
/// again, the group is removed.
pub struct Freezer {
    dir: PathBuf,
    tids: Vec<u32>,
}

impl Freezer {
    /// Fails `test` unless threads can be frozen here (root, and the cgroup
    /// v1 freezer); such a test is ignored without them (`kdb_freezer`).
    pub fn need(test: &str) {
        super::need::root(test);
        super::need::file(test, "/sys/fs/cgroup/freezer/tasks", "the cgroup v1 freezer");
    }

    /// A freezer group for `name` (see [`need`](Self::need)).
    /// Declare it after the daemon whose threads it freezes: dropped first
    /// (on a panic too), it thaws them, so the daemon can be killed and reaped.
    pub fn new(name: &str) -> Freezer {
        let dir = Path::new("/sys/fs/cgroup/freezer").join(format!("kdb-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("make the freezer group");
        Freezer { dir, tids: Vec::new() }
    }

    /// Freezes the threads of `pid` named `comm` (at least one); how many.
    pub fn freeze(&mut self, pid: u32, comm: &str) -> usize {
        for e in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads").flatten() {
            if std::fs::read_to_string(e.path().join("comm")).unwrap_or_default().trim() == comm {
                let tid = e.file_name().to_string_lossy().to_string();
                std::fs::write(self.dir.join("tasks"), &tid).expect("move a thread into the freezer");
                self.tids.push(tid.parse().expect("a tid"));
            }
        }
        assert!(!self.tids.is_empty(), "no thread named {comm} in process {pid}");
        std::fs::write(self.dir.join("freezer.state"), "FROZEN").expect("freeze");
        let t = std::time::Instant::now();
        while std::fs::read_to_string(self.dir.join("freezer.state")).unwrap_or_default().trim() != "FROZEN" {
            assert!(t.elapsed() < Duration::from_secs(10), "the threads did not freeze");
            std::thread::sleep(Duration::from_millis(5));
        }
        self.tids.len()
    }

    /// Lets the frozen threads run again.
    pub fn thaw(&self) {
        let _ = std::fs::write(self.dir.join("freezer.state"), "THAWED");
    }
}

impl Drop for Freezer {
    fn drop(&mut self) {
        self.thaw();
        for tid in &self.tids {
            let _ = std::fs::write("/sys/fs/cgroup/freezer/tasks", tid.to_string());
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
