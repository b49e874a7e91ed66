//! The `kachedb` command line: `serve`, `stats` and `events`. This binary is the one
//! shipped: the Python package (`kachedb-shm` on the package index) carries it
//! as built here and runs it for `kachedb serve|stats`; the engine config
//! commands (`vllm-config`, …) are the package's own and are listed here so
//! that `kachedb --help` names every command.
//!
//! The benchmarks and the demo are the `kachedb-bench` binary (crate
//! `kachedb-bench`). `kachedb bench …` and `kachedb demo …` are kept for one
//! release: they run the `kachedb-bench` beside this binary with the same
//! arguments, or say where the benchmarks are when there is none.

use clap::{Parser, Subcommand};
use std::ffi::OsString;

pub mod events_cmd;
pub mod serve_cmd;
pub mod watch;

/// `kachedb --version`: the crate version, the takeover state formats and the client wire
/// (`kachedb_daemon::takeover::version_line`).
fn version_line() -> &'static str {
    static LINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LINE.get_or_init(kachedb_daemon::takeover::version_line)
}

/// KacheDB: a node-local KV-cache block store over shared memory.
#[derive(Debug, Parser)]
#[command(name = "kachedb", version = version_line(), about = "KacheDB: a node-local KV-cache block store over shared memory.", long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: own the shared-memory region and serve clients until
    /// SIGINT/SIGTERM/SIGHUP (`--on-sighup takeover`: hand everything over to
    /// a fresh copy of the binary). Needs no config: the defaults are printed at start.
    Serve(Box<serve_cmd::ServeArgs>),
    /// Print a running daemon's stats (blocks, bytes, pins, clients, evictions,
    /// rejected frames, ops/s); `--watch` keeps a live view.
    Stats(serve_cmd::StatsArgs),
    /// Print a KV event stream live (`kachedb serve --events-endpoint`, or a
    /// vLLM engine's): one line per batch, its sequence number and events.
    Events(events_cmd::WatchArgs),
    /// Print the `--kv-transfer-config` JSON that plugs KacheDB into vLLM
    /// (Python package: `kachedb vllm-config --help`).
    #[command(disable_help_flag = true)]
    VllmConfig(PackageCommand),
    /// Print the LMCache config entries that make KacheDB its remote storage
    /// (Python package: `kachedb lmcache-config --help`).
    #[command(disable_help_flag = true)]
    LmcacheConfig(PackageCommand),
    /// Print SGLang's `--hicache-storage-backend-extra-config` JSON for KacheDB
    /// (Python package: `kachedb sglang-config --help`).
    #[command(disable_help_flag = true)]
    SglangConfig(PackageCommand),
    /// Deprecated: `kachedb-bench ring|ops|remote|disk|scale` (run when it is beside this binary).
    #[command(hide = true, disable_help_flag = true)]
    Bench(PackageCommand),
    /// Deprecated: `kachedb-bench demo` (run when it is beside this binary).
    #[command(hide = true, disable_help_flag = true)]
    Demo(PackageCommand),
}

/// The arguments of a command this binary only names (whatever follows it).
#[derive(Debug, clap::Args)]
pub struct PackageCommand {
    /// Passed on as they are.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

/// Exit status of a usage error (clap's).
const USAGE: u8 = 2;

/// Parses `args` (program name first) and runs the command; returns the exit status.
pub fn main_with_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { USAGE } else { 0 };
        }
    };
    let result = match cli.command {
        Command::Serve(a) => serve_cmd::serve(&a),
        Command::Stats(a) => serve_cmd::stats(&a),
        Command::Events(a) => events_cmd::watch(&a),
        Command::VllmConfig(_) => return in_package("vllm-config"),
        Command::LmcacheConfig(_) => return in_package("lmcache-config"),
        Command::SglangConfig(_) => return in_package("sglang-config"),
        Command::Bench(a) => return to_bench_binary("bench", &[], &a.args),
        Command::Demo(a) => return to_bench_binary("demo", &["demo".into()], &a.args),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kachedb: error: {e}");
            1
        }
    }
}

/// Says that `cmd` belongs to the Python package: the `kachedb` console script
/// it installs runs it before this binary is reached.
fn in_package(cmd: &str) -> u8 {
    eprintln!(
        "kachedb: `{cmd}` is a command of the Python package (pip install kachedb-shm): run `python -m kachedb {cmd}`, \
         or the `kachedb` command that the package installs"
    );
    USAGE
}

/// The benchmarks' binary, looked for beside this one.
pub const BENCH_BINARY: &str = "kachedb-bench";

/// `kachedb bench|demo …` (deprecated, kept one release): runs the
/// `kachedb-bench` beside this binary as `kachedb-bench <lead> <args>`, in
/// place of this process, after a note on stderr; without one, says where the
/// benchmarks are. Returns the exit status when it does not exec.
fn to_bench_binary(cmd: &str, lead: &[OsString], args: &[OsString]) -> u8 {
    use std::os::unix::process::CommandExt;
    let beside = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join(BENCH_BINARY)));
    match beside {
        Some(bench) if bench.is_file() => {
            eprintln!(
                "kachedb: `kachedb {cmd}` is deprecated and goes in the next release: running `{}`",
                bench.display()
            );
            let e = std::process::Command::new(&bench).args(lead).args(args).exec();
            eprintln!("kachedb: error: cannot run {}: {e}", bench.display());
            1
        }
        _ => {
            eprintln!(
                "kachedb: the benchmarks and the demo are the `{BENCH_BINARY}` binary, not part of `kachedb` \
                 (the one the Python package ships): from a KacheDB checkout, `cargo build --release -p kachedb-bench` \
                 and run `target/release/{BENCH_BINARY} ring|ops|remote|disk|scale|demo`; \
                 `python benchmarks/python_ops.py` gives the Python figures"
            );
            USAGE
        }
    }
}
