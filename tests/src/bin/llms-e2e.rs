//! The `llms` command line built inside the tests crate, so its end-to-end tests can spawn it
//! (`CARGO_BIN_EXE_llms-e2e`) as a real daemon process.

fn main() -> std::process::ExitCode {
    tools::main()
}
