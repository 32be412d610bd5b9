//! `llms bench http-load`: many clients streaming chat completions over the HTTP API's TCP
//! listener at once, against a daemon it starts; the mechanism is `bench::http_load`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::args::ModelsDirArg;
use crate::report::table;

/// `llms bench http-load`.
#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    llms bench http-load                      # 64 clients, 4 apps, one minute\n  \
    llms bench http-load --clients 16 --seconds 10 --max-tokens 4\n\
    App 0 has half the clients and the other apps share the rest: the queue should give every \
    app the same share of the streams whatever its size. Writes <out>/http-load.json.")]
pub struct BenchHttpLoadArgs {
    #[command(flatten)]
    pub dir: ModelsDirArg,
    /// A known model's name (fetched if missing) or a GGUF file [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
    pub model: Option<PathBuf>,
    /// Clients streaming at once, each on its own keep-alive TCP connection
    #[arg(long, default_value_t = 64, value_parser = crate::report::positive)]
    pub clients: usize,
    /// Apps (keys) the clients are spread over: app 0 has half of them
    #[arg(long, default_value_t = 4, value_parser = crate::report::positive)]
    pub apps: usize,
    /// How long the clients start new streams (those running then are read to their end)
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// Turns of each client's conversation before it starts another
    #[arg(long, default_value_t = 4, value_parser = crate::report::positive)]
    pub turns: usize,
    /// Tokens each answer streams, at most
    #[arg(long, default_value_t = 16, value_parser = crate::report::positive)]
    pub max_tokens: usize,
    /// The daemon's KV budget (suffixes K, M, G), to see memory held under it while every
    /// client's context stays alive [default: the daemon's]
    #[arg(long, value_name = "BYTES")]
    pub kv_budget: Option<String>,
    /// Engine threads of the daemon [default: the number of CPUs]
    #[arg(long, value_name = "N", value_parser = crate::report::positive)]
    pub threads: Option<usize>,
    /// Where the daemon's store, sockets, mount and key file go (a fresh directory inside,
    /// removed at the end) [default: <out>]
    #[arg(long, value_name = "DIR")]
    pub scratch: Option<PathBuf>,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
}

pub fn run(a: BenchHttpLoadArgs) -> anyhow::Result<()> {
    a.report.begin();
    anyhow::ensure!(
        a.seconds > 0.0 && a.seconds.is_finite(),
        "--seconds must be positive"
    );
    let model = crate::args::resolve_model(a.model.as_deref(), &a.dir)?;
    let dir = a
        .report
        .scratch_dir(a.scratch.as_deref())?
        .join(format!("http-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let spec = bench::http_load::HttpLoadSpec {
        model,
        dir: dir.clone(),
        clients: a.clients,
        apps: a.apps,
        seconds: a.seconds,
        turns: a.turns,
        max_tokens: a.max_tokens,
        threads: a.threads,
        kv_budget: a.kv_budget,
    };
    let r = bench::http_load::run(&spec);
    let _ = std::fs::remove_dir_all(&dir);
    let r = r?;
    print(&r);
    a.report.write("http-load", &r)?;
    anyhow::ensure!(
        r.incomplete == 0,
        "{} of {} streams did not complete: {:?}",
        r.incomplete,
        r.incomplete + r.completed,
        r.failures
    );
    Ok(())
}

fn print(r: &bench::http_load::HttpLoadReport) {
    table!(
        "{} clients starting streams for {:.1} s (the last ended at {:.1} s), conversations of \
         {} turns, up to {} tokens an answer; shares count the streams ended in the first {:.1} s",
        r.clients,
        r.window_s,
        r.seconds,
        r.turns,
        r.max_tokens,
        r.window_s
    );
    table!(
        "{:<6} {:>8} {:>8} {:>8} {:>8} {:>14} {:>12} {:>12}",
        "app",
        "clients",
        "streams",
        "tokens",
        "share",
        "first-come at",
        "ttft p50 ms",
        "ttft p99 ms"
    );
    for a in &r.apps {
        table!(
            "{:<6} {:>8} {:>8} {:>8} {:>8.3} {:>14.3} {:>12.1} {:>12.1}",
            a.app,
            a.clients,
            a.streams,
            a.tokens,
            a.share,
            a.clients_share,
            a.first_token.median_ms,
            a.first_token.p99_ms
        );
    }
    table!(
        "fairness (Jain's index of the apps' shares): {:.4}; a first-come queue: {:.4}",
        r.fairness,
        r.first_come_fairness
    );
    table!(
        "streams: {} completed, {} not ({} busy); {} of {} later turns continued their context",
        r.completed,
        r.incomplete,
        r.busy,
        r.continued,
        r.later_turns
    );
    table!(
        "first token: median {:.1} ms, p99 {:.1}, max {:.1}; whole stream: median {:.1} ms, \
         p99 {:.1}; {:.1} tokens/s in all",
        r.first_token.median_ms,
        r.first_token.p99_ms,
        r.first_token.max_ms,
        r.stream.median_ms,
        r.stream.p99_ms,
        r.tokens_per_s
    );
    let m = &r.memory;
    table!(
        "daemon RSS: {:.0} MiB at the start, {:.0} peak, {:.0} at the end (VmHWM {:.0})",
        m.start_mib,
        m.peak_mib,
        m.end_mib,
        m.hwm_mib
    );
    table!(
        "KV: {:.1} MiB resident of a {:.1} MiB budget at the end, {} contexts held; {} chunks \
         read back and {} recomputed over the run",
        m.kv_resident_mib,
        m.kv_budget_mib,
        m.contexts,
        m.chunks_read,
        m.chunks_recomputed
    );
}
