//! The `kachedb` command line: `serve` and `stats`; with the `bench` feature
//! (on by default) also `demo`, `bench ring` and `bench ops` from `kachedb-bench`.
//!
//! A library so that the Python package can run the same CLI in-process
//! (`python -m kachedb serve …`); it builds it without the `bench` feature.

use clap::{Parser, Subcommand};
use std::ffi::OsString;

pub mod serve_cmd;
pub mod watch;

/// KacheDB: a node-local KV-cache block store over shared memory.
#[derive(Debug, Parser)]
#[command(name = "kachedb", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: own the shared-memory region and serve clients until
    /// SIGINT/SIGTERM. Needs no config: the defaults are printed at start.
    Serve(Box<serve_cmd::ServeArgs>),
    /// Print a running daemon's stats (blocks, bytes, pins, clients, evictions,
    /// rejected frames, ops/s); `--watch` keeps a live view.
    Stats(serve_cmd::StatsArgs),
    /// `demo`, `bench ring|ops` and their hidden child processes.
    #[cfg(feature = "bench")]
    #[command(flatten)]
    Bench(kachedb_bench::Command),
}

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
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let result = match cli.command {
        Command::Serve(a) => serve_cmd::serve(&a),
        Command::Stats(a) => serve_cmd::stats(&a),
        #[cfg(feature = "bench")]
        Command::Bench(c) => kachedb_bench::run(&c),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kachedb: error: {e}");
            1
        }
    }
}
