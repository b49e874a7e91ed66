//! The `kachedb-bench` command: the benchmarks (`ring`, `ops`, `remote`,
//! `disk`, `scale`), the demo, and the hidden child processes they start by
//! re-executing this binary: `bench-child` and `demo-child`, and `serve`, the
//! daemon the benchmarks start (the code of `kachedb serve`, from `kachedb-cli`,
//! linked in so that a benchmark needs nothing beside this binary; `--socket`
//! measures a daemon already running instead).
//!
//! The shipped `kachedb` binary carries none of this; its `bench` and `demo`
//! commands forward here for one release (`kachedb-cli`).

use clap::{Parser, Subcommand};
use std::ffi::OsString;

pub mod demo;
pub mod disk;
pub mod events;
pub mod ops;
pub mod remote;
pub mod ring;
pub mod scale;
pub mod scale_chart;
pub mod scale_costs;
pub mod scrape;
pub mod spawn;

/// KacheDB's benchmarks and demo.
#[derive(Debug, Parser)]
#[command(
    name = "kachedb-bench",
    version,
    about = "KacheDB's benchmarks (each figure against a baseline measured in the same run) and the demo.",
    long_about = None
)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands of `kachedb-bench`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The SPSC ring across two processes: throughput per message and batched,
    /// against a naive ring in the same run, and ping-pong round trips.
    Ring(ring::RingArgs),
    /// Operations against a daemon (started for the run unless --socket is
    /// given): GET-hit round trip, batched ops/s, PUT and GET of large blocks
    /// against memcpy, idle daemon CPU.
    Ops(ops::OpsArgs),
    /// The remote tier against a Redis Cluster (started for the run unless
    /// --remote is given): fill throughput against a plain Redis client's GET
    /// of the same bytes, write-behind throughput, local GET latency during fills.
    Remote(remote::RemoteArgs),
    /// The disk tier: fill and write-behind throughput against plain reads
    /// and writes of the same files, O_DIRECT next to buffered, GET latency
    /// during disk I/O, restart after kill -9 with 100 000 blocks on disk.
    Disk(disk::DiskArgs),
    /// How the costs grow with the blocks stored (10³ … 10⁶): GET, PUT and
    /// LOOKUP p50/p99, eviction per evicted block, stats, the daemon's RAM
    /// per block, the takeover's pause, and with --disk the disk index's RAM
    /// and its restart after kill -9; a table, --json and a PNG chart.
    Scale(scale::ScaleArgs),
    /// The KV event publisher: PUT/GET round trips and put_many throughput
    /// with it on (and a subscriber) vs off in alternating rounds, the rate it
    /// keeps up with (100 000 blocks/s by default) and the lag from a commit
    /// to a subscriber's receipt.
    Events(events::EventsArgs),
    /// Start a daemon (unless one runs), put a tensor from one process and get it
    /// back in another, verifying every byte.
    Demo(demo::DemoArgs),
    /// Internal: the writer/reader processes of `demo`.
    #[command(hide = true)]
    DemoChild(demo::DemoChildArgs),
    /// Internal: the child side of `ring`.
    #[command(hide = true)]
    BenchChild(ring::ChildArgs),
    /// Internal: the daemon a benchmark starts (`kachedb serve`'s code and flags).
    #[command(hide = true)]
    Serve(Box<kachedb_cli::serve_cmd::ServeArgs>),
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
    match run(&cli.command) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kachedb-bench: error: {e}");
            1
        }
    }
}

/// Runs `command`.
pub fn run(command: &Command) -> Result<(), Box<dyn std::error::Error>> {
    match command {
        Command::Ring(a) => ring::run(a),
        Command::Ops(a) => ops::run(a),
        Command::Remote(a) => remote::run(a),
        Command::Disk(a) => disk::run(a),
        Command::Scale(a) => scale::run(a),
        Command::Events(a) => events::run(a),
        Command::Demo(a) => demo::run(a),
        Command::DemoChild(a) => demo::child(a),
        Command::BenchChild(a) => ring::child(a),
        Command::Serve(a) => kachedb_cli::serve_cmd::serve(a),
    }
}
