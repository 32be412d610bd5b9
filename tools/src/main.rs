//! `llms`: the one command-line tool of the project: the model, generation and chat, evaluation and benchmarks.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use clap::{Parser, Subcommand};

mod bench_pager;
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
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// The userfaultfd pager: populate (COPY, MOVE), fault-to-resolved, reclaim, against memcpy.
    Pager(bench_pager::BenchPagerArgs),
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
        Command::Bench(BenchCommand::Pager(args)) => bench_pager::bench_pager(&args),
    }
}
