//! Starting a daemon as a child process for `demo` and the benchmarks.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A daemon child process; stopped (SIGTERM, then waited for) when dropped.
#[derive(Debug)]
pub struct DaemonProcess {
    child: Child,
    socket: PathBuf,
    _dir: TempDir,
}

/// A directory removed when dropped.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh private directory under the system temp dir.
    pub fn new(prefix: &str) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir();
        for i in 0..1000u32 {
            let p = base.join(format!("{prefix}-{}-{i}", std::process::id()));
            if std::fs::DirBuilder::new().mode(0o700).create(&p).is_ok() {
                return Ok(TempDir(p));
            }
        }
        Err(std::io::Error::other("could not create a temporary directory"))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl DaemonProcess {
    /// Spawns `kachedb serve --size <size_bytes>` on a private socket and waits
    /// until it accepts connections.
    pub fn spawn(size_bytes: u64, extra: &[&str]) -> Result<Self, Box<dyn std::error::Error>> {
        let dir = TempDir::new("kachedb")?;
        let socket = dir.0.join("kachedb.sock");
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve").arg("--size").arg(size_bytes.to_string()).arg("--socket").arg(&socket).args(extra);
        cmd.stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()));
        let child = cmd.spawn()?;
        let mut d = DaemonProcess { child, socket, _dir: dir };
        d.wait_ready(Duration::from_secs(60))?;
        Ok(d)
    }

    fn wait_ready(&mut self, limit: Duration) -> Result<(), Box<dyn std::error::Error>> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait()? {
                return Err(format!("the daemon exited during start ({status})").into());
            }
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!("the daemon did not accept connections within {} s", limit.as_secs()).into())
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills it with SIGKILL (no shutdown of its own) and waits for it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let hz = rustix::param::clock_ticks_per_second() as f64;
    Some((utime + stime) / hz)
}
