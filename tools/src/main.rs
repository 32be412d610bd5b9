//! `llms`: the one command-line tool of the project: the model, generation and chat, evaluation and benchmarks.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use clap::{Parser, Subcommand};

mod kvfs_cmd;
mod model_cmd;

/// Run one LLM for many apps, keeping every conversation context alive under a memory budget.
#[derive(Parser)]
#[command(name = "llms", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch and list models.
    Model(model_cmd::ModelArgs),
    /// Mount or inspect a kvfs chunk store
    #[command(subcommand)]
    Kvfs(kvfs_cmd::KvfsCommand),
    /// Benchmarks
    #[command(subcommand)]
    Bench(Bench),
}

#[derive(Subcommand)]
enum Bench {
    /// kvfs: reads and writes through the mount and directly, page cache, zstd on KV chunks
    Kvfs(kvfs_cmd::BenchArgs),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Model(args) => model_cmd::run(args),
        Command::Kvfs(cmd) => kvfs_cmd::run(cmd),
        Command::Bench(Bench::Kvfs(args)) => kvfs_cmd::bench(args),
    }
}
