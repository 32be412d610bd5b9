//! `llms`: the one command-line tool of the project: the service and its clients, the model,
//! generation and chat, evaluation and benchmarks. The binary (`main.rs`) calls [`main`]; the
//! end-to-end tests run the same code as their own binary.
//!
//! This crate holds no mechanism: each command parses its arguments ([`args`] holds the shared
//! ones), calls a library crate, and prints; it is the only crate that prints.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use clap::{Parser, Subcommand};

mod args;
mod cmd;
mod report;

use cmd::bench::{
    crash as bench_crash, engine as bench_engine, guide as bench_guide, http as bench_http,
    http_load as bench_http_load, kv as bench_kv, load as bench_load, pager as bench_pager,
    switch as bench_switch, weights as bench_weights,
};
use cmd::{
    chat as chat_cmd, ctx as ctx_cmd, engine as engine_cmd, http as http_cmd, kv_mix as kv_mix_cmd,
    kvfs as kvfs_cmd, model as model_cmd, profile as profile_cmd, serve as serve_cmd,
    trace as trace_cmd,
};

/// Run one LLM for many apps, keeping every conversation context alive under a memory budget.
#[derive(Parser)]
#[command(
    name = "llms",
    version,
    propagate_version = true,
    after_help = "Start with `llms chat --prompt \"Hello\"`: it fetches the default model if \
                  missing and starts `llms serve` in the background if none runs.\n\
                  Commands that use a model take --model FILE (or LLMS_MODEL); reports take \
                  --json; benchmarks write bench-out/<name>.json (--out DIR)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch and list models.
    Model(model_cmd::ModelArgs),
    /// Generate a continuation of one prompt (a chat turn unless --raw), streamed to stdout.
    Generate(engine_cmd::GenerateArgs),
    /// Run the service: one model for every app, over a Unix socket (and the OpenAI HTTP API
    /// with --http).
    Serve(Box<serve_cmd::ServeArgs>),
    /// Keys of the OpenAI-compatible HTTP API over TCP (`llms serve --http HOST:PORT`).
    #[command(subcommand)]
    Keys(http_cmd::KeysCommand),
    /// Chat through the daemon (started in the background if none listens), or --local.
    Chat(engine_cmd::ChatArgs),
    /// The daemon's contexts (yours).
    #[command(subcommand)]
    Ctx(ctx_cmd::CtxCommand),
    /// The daemon's counters: memory, switch latency, chunks, queue.
    Stats(ctx_cmd::StatsArgs),
    /// Mount or inspect a kvfs chunk store.
    #[command(subcommand)]
    Kvfs(kvfs_cmd::KvfsCommand),
    /// Context-switching traces: generate one (Poisson arrivals, Random/Markov/Gaussian
    /// switching, real text) and sum one up.
    #[command(subcommand)]
    Trace(trace_cmd::TraceCommand),
    /// Measure the model's quality.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Benchmarks; each prints a table and writes its JSON to bench-out/<name>.json (--out DIR).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Measure recompute cost on this machine and fit the planner's cost model
    /// (bench-out/profile.json).
    Profile(profile_cmd::ProfileArgs),
}

#[derive(Subcommand)]
enum EvalCommand {
    /// Perplexity of a text (llama.cpp's protocol: windows of --ctx tokens, each scored on its second half).
    Ppl(engine_cmd::PplArgs),
    /// Perplexity, KL and top-1 of many KV formats and mixes at several window lengths: a
    /// table, bench-out/sweep.json and bench-out/sweep.png (ppl against stored bits per value).
    Sweep(kv_mix_cmd::SweepArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode speed of the engine, and the memory of weights and KV.
    Engine(bench_engine::BenchEngineArgs),
    /// The userfaultfd pager: populate (COPY, MOVE), fault-to-resolved, reclaim, against memcpy.
    Pager(bench_pager::BenchPagerArgs),
    /// kvfs: reads and writes through the mount and directly, page cache, zstd on KV chunks.
    Kvfs(kvfs_cmd::BenchArgs),
    /// KV chunks: codec GB/s and error per format, attention per decode step, recompute tokens/s.
    Kv(bench_kv::KvArgs),
    /// Switch latency: a context swapped out and brought back by reads, recompute and the plan.
    Load(bench_load::BenchLoadArgs),
    /// Crash safety: kill -9 a live daemon at random moments of a replay of calls, many times,
    /// and check that no completed call is lost and no context diverges.
    Crash(bench_crash::BenchCrashArgs),
    /// Context-switch latency under a KV budget: a trace replayed against a real daemon for
    /// each context manager (llms and the paper's baselines), storage throttled and memory
    /// measured with cgroup v1; a table, CSV, JSON and plots (docs/bench.md).
    Switch(Box<bench_switch::BenchSwitchArgs>),
    /// Weights under a memory budget: decode and prefill speed against the budget for mmap in a
    /// memory cgroup, prefetch only, + balanced locking and + tensor preservation.
    Weights(bench_weights::BenchWeightsArgs),
    /// What the OpenAI-compatible HTTP API adds to a call over the socket protocol, on a
    /// running daemon (`llms serve --http unix:PATH`): median latencies of the three paths.
    Http(bench_http::BenchHttpArgs),
    /// Many clients streaming chat completions over the HTTP API's TCP listener at once, apps
    /// of unequal size: every stream complete, each app's share of the queue, latency, memory.
    HttpLoad(bench_http_load::BenchHttpLoadArgs),
    /// Structured output's cost per decode token on the model's vocabulary: every example
    /// schema, token masks cold and cached, beside the model's decode step (docs/guide.md).
    Guide(bench_guide::BenchGuideArgs),
}

/// The whole `llms` command line: parses the arguments, runs the command, reports errors.
pub fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The service logs its life by default; the other commands only warnings. fuser warns when
    // it finds the mount it would unmount already gone, which is how kvfs unmounts (it retries a
    // busy mount itself first).
    let default = if matches!(cli.command, Command::Serve(_)) {
        "info,fuser::mnt=error"
    } else {
        "warn,fuser::mnt=error"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        // Colours only for a terminal: a daemon's log file stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// An error and its causes, outermost first, joined by `: ` as anyhow's `{:#}` does, but
/// without a cause whose text its outer message already ends with (many of the crates' errors
/// say their source in their own message, and `{:#}` printed it twice).
pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if !out.is_empty() && out.ends_with(&t) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&t);
    }
    out
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Model(args) => model_cmd::run(args),
        Command::Generate(args) => engine_cmd::run_generate(args),
        Command::Serve(args) => serve_cmd::run(*args),
        Command::Keys(cmd) => http_cmd::run(cmd),
        Command::Chat(args) => chat_cmd::run(args),
        Command::Ctx(cmd) => ctx_cmd::run(cmd),
        Command::Stats(args) => ctx_cmd::run_stats(args),
        Command::Trace(cmd) => trace_cmd::run(cmd),
        Command::Eval(EvalCommand::Ppl(args)) => engine_cmd::run_ppl(args),
        Command::Eval(EvalCommand::Sweep(args)) => kv_mix_cmd::sweep(args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine::run(args),
        Command::Bench(BenchCommand::Pager(args)) => bench_pager::bench_pager(&args),
        Command::Kvfs(cmd) => kvfs_cmd::run(cmd),
        Command::Bench(BenchCommand::Kvfs(args)) => kvfs_cmd::bench(args),
        Command::Bench(BenchCommand::Kv(args)) => bench_kv::run(args),
        Command::Bench(BenchCommand::Load(args)) => bench_load::run_cmd(&args),
        Command::Bench(BenchCommand::Crash(args)) => bench_crash::run(&args),
        Command::Bench(BenchCommand::Switch(args)) => bench_switch::run(&args),
        Command::Bench(BenchCommand::Weights(args)) => bench_weights::run(args),
        Command::Bench(BenchCommand::Guide(args)) => bench_guide::run(args),
        Command::Bench(BenchCommand::Http(args)) => bench_http::run(args),
        Command::Bench(BenchCommand::HttpLoad(args)) => bench_http_load::run(args),
        Command::Profile(args) => profile_cmd::run(args),
    }
}

#[cfg(test)]
mod tests {
    use std::fmt;

    /// An error whose message is `text`, and says its cause's when `says`.
    #[derive(Debug)]
    struct Layer {
        text: &'static str,
        says: bool,
        cause: Option<Box<Layer>>,
    }

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match (&self.cause, self.says) {
                (Some(c), true) => write!(f, "{}: {c}", self.text),
                _ => write!(f, "{}", self.text),
            }
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.cause.as_deref().map(|c| c as _)
        }
    }

    fn layers(says: bool) -> anyhow::Error {
        let leaf = Layer {
            text: "bad byte",
            says: false,
            cause: None,
        };
        let outer = Layer {
            text: "cannot encode chunk 0",
            says,
            cause: Some(Box::new(leaf)),
        };
        anyhow::Error::new(outer).context("perplexity")
    }

    #[test]
    fn an_error_says_each_cause_once() {
        let e = layers(true);
        assert_eq!(
            format!("{e:#}"),
            "perplexity: cannot encode chunk 0: bad byte: bad byte"
        );
        assert_eq!(
            super::error_text(&e),
            "perplexity: cannot encode chunk 0: bad byte"
        );
        assert_eq!(
            super::error_text(&layers(false)),
            "perplexity: cannot encode chunk 0: bad byte"
        );
    }
}
