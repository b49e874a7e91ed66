//! The benchmarks and the demo of the `kachedb` command: `kachedb bench ring`,
//! `kachedb bench ops`, `kachedb bench remote`, `kachedb bench disk`, `kachedb demo`, and the hidden child processes they
//! start by re-executing the current binary.
//!
//! `kachedb-cli` flattens [`Command`] into its subcommands when built with its
//! `bench` feature (on by default) and hands the parsed value to [`run`]. The
//! child processes are started as `<current exe> bench-child …` and
//! `<current exe> demo-child …`, so the binary that runs [`run`] must parse
//! [`Command`] too.

use clap::Subcommand;

pub mod demo;
pub mod disk;
pub mod ops;
pub mod remote;
pub mod ring;
pub mod scrape;
pub mod spawn;

/// The subcommands this crate adds to `kachedb`.
#[derive(Debug, Subcommand)]
pub enum Command {
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
    BenchChild(ring::ChildArgs),
}

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
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
}

/// Runs `command`.
pub fn run(command: &Command) -> Result<(), Box<dyn std::error::Error>> {
    match command {
        Command::Demo(a) => demo::run(a),
        Command::DemoChild(a) => demo::child(a),
        Command::Bench(BenchCommand::Ring(a)) => ring::run(a),
        Command::Bench(BenchCommand::Ops(a)) => ops::run(a),
        Command::Bench(BenchCommand::Remote(a)) => remote::run(a),
        Command::Bench(BenchCommand::Disk(a)) => disk::run(a),
        Command::BenchChild(a) => ring::child(a),
    }
}
