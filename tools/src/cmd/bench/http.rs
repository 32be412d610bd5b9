//! `llms bench http`: the latency the OpenAI-compatible HTTP API adds to a call over the socket
//! protocol, on a running daemon (`llms serve --http unix:PATH`); the mechanism is
//! `bench::http`.

use std::path::PathBuf;

use clap::Args;

use crate::args::default_socket;
use crate::report::table;

/// `llms bench http`.
#[derive(Args, Debug)]
pub struct BenchHttpArgs {
    /// The daemon's HTTP Unix socket (`llms serve --http unix:PATH`)
    #[arg(long, value_name = "PATH")]
    pub http: PathBuf,
    /// The daemon's protocol socket [default: the default socket]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Calls on each path
    #[arg(long, default_value_t = 100, value_parser = crate::report::positive)]
    pub calls: usize,
    /// Tokens each call generates
    #[arg(long, default_value_t = 1, value_parser = crate::report::positive)]
    pub max_tokens: usize,
    /// The prompt of every call
    #[arg(long, default_value = "Say one word.")]
    pub prompt: String,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
}

pub fn run(a: BenchHttpArgs) -> anyhow::Result<()> {
    a.report.begin();
    let spec = bench::http::HttpBenchSpec {
        socket: a.socket.unwrap_or_else(default_socket),
        http: a.http,
        calls: a.calls,
        max_tokens: a.max_tokens,
        prompt: a.prompt,
    };
    let r = bench::http::run(&spec)?;
    table!(
        "{} calls a path, {} token(s) each, conversations of {} tokens at the end",
        r.calls,
        r.max_tokens,
        r.context_tokens
    );
    table!(
        "{:<34} {:>10} {:>10} {:>10} {:>14}",
        "path",
        "median ms",
        "min ms",
        "max ms",
        "over socket ms"
    );
    let row = |name: &str, l: &bench::http::Latencies, over: Option<f64>| {
        let over = over.map_or("".into(), |o| format!("{o:.3}"));
        table!(
            "{name:<34} {:>10.3} {:>10.3} {:>10.3} {over:>14}",
            l.median_ms,
            l.min_ms,
            l.max_ms
        );
    };
    row("socket call", &r.socket, None);
    row(
        "POST /v1/responses (previous id)",
        &r.responses,
        Some(r.responses_overhead_ms),
    );
    row(
        "POST /v1/chat/completions",
        &r.chat,
        Some(r.chat_overhead_ms),
    );
    a.report.write("http", &r)?;
    Ok(())
}
