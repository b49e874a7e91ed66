//! The `kachedb-bench` command.
fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(kachedb_bench::main_with_args(std::env::args_os()))
}
