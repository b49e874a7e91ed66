//! `kachedb bench ring` (being written).
use clap::Args;

/// Options of `kachedb bench ring`.
#[derive(Debug, Args)]
pub struct RingArgs {
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Options of the hidden child process.
#[derive(Debug, Args)]
pub struct ChildArgs {
    /// Path of the shared region (`/proc/<pid>/fd/<n>`).
    #[arg(long)]
    pub region: String,
}

/// Runs the ring benchmark.
pub fn run(_args: &RingArgs) -> Result<(), Box<dyn std::error::Error>> {
    Err("not written yet".into())
}

/// Runs the child side.
pub fn child(_args: &ChildArgs) -> Result<(), Box<dyn std::error::Error>> {
    Err("not written yet".into())
}
