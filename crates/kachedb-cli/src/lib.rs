//! The `kachedb` command line: `serve`, `stats`, `bench ring`, `bench ops`.
//!
//! A library so that the Python package can run the same CLI in-process
//! (`python -m kachedb serve …`).

use clap::{Parser, Subcommand};
use std::ffi::OsString;

pub mod bench_ops;
pub mod bench_ring;
pub mod demo;
pub mod serve_cmd;
pub mod spawn;

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
    Serve(serve_cmd::ServeArgs),
    /// Print a running daemon's stats (blocks, bytes, pins, clients, evictions,
    /// rejected frames, ops/s).
    Stats(serve_cmd::StatsArgs),
    /// Start a daemon (unless one runs), put a tensor from one process and get it
    /// back in another, verifying every byte.
    Demo(demo::DemoArgs),
    /// Internal: the writer/reader processes of `demo`.
    #[command(hide = true)]
    DemoChild(demo::DemoChildArgs),
    /// Benchmarks (print a table, or JSON lines with --json).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Internal: the child side of a benchmark (spawned by `bench`).
    #[command(hide = true)]
    BenchChild(bench_ring::ChildArgs),
}

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The SPSC ring across two processes: throughput per message and batched,
    /// against a naive ring in the same run, and ping-pong round trips.
    Ring(bench_ring::RingArgs),
    /// Operations against a daemon (started for the run unless --socket is
    /// given): GET-hit round trip, batched ops/s, PUT and GET of large blocks
    /// against memcpy, idle daemon CPU.
    Ops(bench_ops::OpsArgs),
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
        Command::Demo(a) => demo::run(&a),
        Command::DemoChild(a) => demo::child(&a),
        Command::Bench(BenchCommand::Ring(a)) => bench_ring::run(&a),
        Command::Bench(BenchCommand::Ops(a)) => bench_ops::run(&a),
        Command::BenchChild(a) => bench_ring::child(&a),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kachedb: error: {e}");
            1
        }
    }
}
