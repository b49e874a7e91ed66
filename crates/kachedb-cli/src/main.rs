//! The `kachedb` command.
fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(kachedb_cli::main_with_args(std::env::args_os()))
}
