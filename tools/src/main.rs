//! The `llms` binary: everything is in the `tools` library.

fn main() -> std::process::ExitCode {
    tools::main()
}
