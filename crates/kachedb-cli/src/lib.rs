//! The `kachedb` command line: `serve` and `stats`; with the `bench` feature
//! (on by default) also `demo`, `bench ring` and `bench ops` from `kachedb-bench`.
//!
//! The Python package (`kachedb-shm` on the package index) ships this binary
//! built without the `bench` feature and runs it for `kachedb serve|stats`;
//! the engine config commands (`vllm-config`, …) are the package's own and are
//! listed here so that `kachedb --help` names every command.

use clap::{Parser, Subcommand};
use std::ffi::OsString;

pub mod serve_cmd;
pub mod watch;

/// KacheDB: a node-local KV-cache block store over shared memory.
#[derive(Debug, Parser)]
#[command(name = "kachedb", version, about = "KacheDB: a node-local KV-cache block store over shared memory.", long_about = None)]
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
    /// `demo`, `bench ring|ops` and their hidden child processes.
    #[cfg(feature = "bench")]
    #[command(flatten)]
    Bench(kachedb_bench::Command),
    /// Benchmarks: not in this build (the one the Python package ships).
    #[cfg(not(feature = "bench"))]
    #[command(hide = true, disable_help_flag = true)]
    Bench(PackageCommand),
    /// The demo: not in this build (the one the Python package ships).
    #[cfg(not(feature = "bench"))]
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
        Command::VllmConfig(_) => return in_package("vllm-config"),
        Command::LmcacheConfig(_) => return in_package("lmcache-config"),
        Command::SglangConfig(_) => return in_package("sglang-config"),
        #[cfg(feature = "bench")]
        Command::Bench(c) => kachedb_bench::run(&c),
        #[cfg(not(feature = "bench"))]
        Command::Bench(_) | Command::Demo(_) => {
            eprintln!(
                "kachedb: the benchmarks and the demo are not part of this build (the one the Python package ships): \
                 run `python benchmarks/python_ops.py` from a KacheDB checkout for the Python figures, or build the \
                 full binary (`cargo build --release -p kachedb-cli`) for `kachedb demo` and `kachedb bench ring|ops`"
            );
            return USAGE;
        }
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
