//! The `kachedb` command.
fn main() -> std::process::ExitCode {
    kachedb_cli::main_with_args(std::env::args_os())
}
