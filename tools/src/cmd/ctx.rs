//! `llms ctx ls|show|prewarm|fork|export|rm` and `llms stats`: the daemon's contexts and counters, through its
//! socket (a uid sees only its own contexts).

use anyhow::Context;
use clap::{Args, Subcommand};
use protocol::ContextInfo;
use protocol::client::Client;

use crate::args::SocketArg;

/// The app name these commands give the daemon.
const APP: &str = "llms-cli";

fn connect(s: &SocketArg) -> anyhow::Result<Client> {
    let path = s.path();
    Client::connect(&path, APP).with_context(|| format!("no daemon on {}", path.display()))
}

/// `llms ctx`.
#[derive(Subcommand, Debug)]
pub enum CtxCommand {
    /// List your contexts: tokens, chunks, residency.
    Ls(CtxLs),
    /// One context in detail.
    Show(CtxShow),
    /// Bring a context's chunks back into memory before its next call.
    Prewarm(CtxPrewarm),
    /// Copy a context: a new one with its tokens and turns that shares its computed chunks
    /// (held once in memory and on disk; each goes on on its own). Prints the new id.
    Fork(CtxFork),
    /// A context's turns as JSON (`llms chat --transcript FILE` rebuilds a context from it).
    Export(CtxExport),
    /// Delete contexts (memory and store).
    Rm(CtxRm),
}

#[derive(Args, Debug)]
pub struct CtxPrewarm {
    #[command(flatten)]
    pub socket: SocketArg,
    /// JSON on stdout instead of text
    #[arg(long)]
    pub json: bool,
    /// The context's id
    pub id: u64,
}

#[derive(Args, Debug)]
pub struct CtxFork {
    #[command(flatten)]
    pub socket: SocketArg,
    /// The context to copy
    pub id: u64,
}

#[derive(Args, Debug)]
pub struct CtxLs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// JSON on stdout instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CtxShow {
    #[command(flatten)]
    pub socket: SocketArg,
    /// JSON on stdout instead of text
    #[arg(long)]
    pub json: bool,
    /// The context's id
    pub id: u64,
}

#[derive(Args, Debug)]
pub struct CtxExport {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Write the transcript to this file instead of stdout (written whole, then renamed)
    #[arg(long, short, value_name = "FILE")]
    pub out: Option<std::path::PathBuf>,
    /// The context's id
    pub id: u64,
}

#[derive(Args, Debug)]
pub struct CtxRm {
    #[command(flatten)]
    pub socket: SocketArg,
    /// The contexts' ids
    #[arg(required = true)]
    pub ids: Vec<u64>,
}

/// `llms stats`.
#[derive(Args, Debug)]
pub struct StatsArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// JSON on stdout instead of a table
    #[arg(long)]
    pub json: bool,
}

fn formats(c: &ContextInfo) -> String {
    let v: Vec<String> = c.formats.iter().map(|(f, n)| format!("{f}:{n}")).collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join(" ")
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Runs `llms ctx ...`.
pub fn run(cmd: CtxCommand) -> anyhow::Result<()> {
    match cmd {
        CtxCommand::Ls(a) => {
            let list = connect(&a.socket)?.list()?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            println!(
                "{:>6}  {:<16} {:>7} {:>7} {:>9} {:>10} {:>6}  formats",
                "id", "app", "tokens", "chunks", "resident", "MiB", "calls"
            );
            for c in &list {
                println!(
                    "{:>6}  {:<16} {:>7} {:>7} {:>9} {:>10.2} {:>6}  {}",
                    c.id,
                    c.app,
                    c.tokens,
                    c.chunks,
                    c.resident_chunks,
                    mib(c.resident_bytes),
                    c.calls,
                    formats(c)
                );
            }
            Ok(())
        }
        CtxCommand::Show(a) => {
            let c = connect(&a.socket)?.info(a.id)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&c)?);
                return Ok(());
            }
            println!("context  {}", c.id);
            println!("app      {}", c.app);
            println!("tokens   {}", c.tokens);
            let own = if c.shared_chunks.unwrap_or(0) > 0 {
                " of its own"
            } else {
                ""
            };
            println!(
                "chunks   {} ({} resident, {:.2} MiB{own})",
                c.chunks,
                c.resident_chunks,
                mib(c.resident_bytes)
            );
            if let Some(n) = c.shared_chunks.filter(|&n| n > 0) {
                println!(
                    "shared   the first {n} chunks, held once with the contexts that share them"
                );
            }
            println!("formats  {}", formats(&c));
            println!("calls    {} (since the daemon started)", c.calls);
            Ok(())
        }
        CtxCommand::Prewarm(a) => prewarm(a),
        CtxCommand::Export(a) => export(a),
        CtxCommand::Fork(a) => {
            let child = connect(&a.socket)?
                .fork(a.id)
                .with_context(|| format!("cannot fork context {}", a.id))?;
            println!("{child}");
            eprintln!("forked context {} into context {child}", a.id);
            Ok(())
        }
        CtxCommand::Rm(a) => {
            let mut client = connect(&a.socket)?;
            for id in a.ids {
                client
                    .delete(id)
                    .with_context(|| format!("cannot delete context {id}"))?;
                eprintln!("deleted context {id}");
            }
            Ok(())
        }
    }
}

/// `llms ctx prewarm ID`.
fn prewarm(a: CtxPrewarm) -> anyhow::Result<()> {
    let p = connect(&a.socket)?
        .prewarm(a.id)
        .with_context(|| format!("cannot prewarm context {}", a.id))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
        return Ok(());
    }
    println!(
        "context {}: {} of {} chunks brought back ({} read, {:.2} MiB; {} recomputed) in {:.2} ms",
        a.id,
        p.missing,
        p.chunks,
        p.read,
        mib(p.read_bytes),
        p.recomputed,
        p.load_ms
    );
    Ok(())
}

/// `llms ctx export ID`: the transcript on stdout, or into a file by write, fsync and rename, so
/// a kill leaves the old file or the new one.
fn export(a: CtxExport) -> anyhow::Result<()> {
    let t = connect(&a.socket)?
        .export(a.id)
        .with_context(|| format!("cannot export context {}", a.id))?;
    let mut text = serde_json::to_string_pretty(&t)?;
    text.push('\n');
    let Some(path) = a.out else {
        print!("{text}");
        return Ok(());
    };
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!(
        "context {}: {} turns to {}",
        a.id,
        t.turns.len(),
        path.display()
    );
    Ok(())
}

/// Runs `llms stats`.
pub fn run_stats(a: StatsArgs) -> anyhow::Result<()> {
    let s = connect(&a.socket)?.stats()?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    let d = &s.daemon;
    let s = &s.service;
    println!("manager        {}", s.manager);
    println!(
        "kv memory      {:.1} / {:.1} MiB resident",
        mib(s.resident_bytes),
        mib(s.budget_bytes)
    );
    println!("contexts       {}", s.contexts);
    println!("calls          {}", s.calls);
    println!(
        "switch         {} calls: mean {:.2} ms, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        s.switch.count, s.switch.mean_ms, s.switch.p50_ms, s.switch.p99_ms, s.switch.max_ms
    );
    println!(
        "chunks         {} read, {} recomputed, {} faults",
        s.chunks_read, s.chunks_recomputed, s.faults
    );
    println!(
        "reclaims       {} ({} waited for a write, {} given up unwritten)",
        s.reclaims, s.sync_reclaims, s.unwritten_reclaims
    );
    println!(
        "writes         {} done, {} failed, {} queued",
        s.writes, s.write_failures, s.writes_queued
    );
    println!(
        "load buffers   {:.1} MiB, {:.1} MiB of it in huge pages; reads {}",
        mib(s.load_buffer_bytes),
        mib(s.load_buffer_huge_bytes),
        if s.load_io_uring {
            "in flight on an io_uring"
        } else {
            "one per I/O thread"
        }
    );
    let wt = &s.weights;
    let budget = wt.budget_bytes.map_or_else(
        || "no budget".to_owned(),
        |b| format!("{:.1} MiB budget", mib(b)),
    );
    println!(
        "weights        {:.1} MiB resident ({:.1} MiB stream buffers), {budget}, residency {}",
        mib(wt.resident_bytes),
        mib(wt.buffer_bytes),
        wt.residency
    );
    println!(
        "weight reads   {:.1} MiB streamed per token by plan, {:.1} MiB per token measured over {} decode tokens, {:.1} MiB read in all",
        mib(wt.streamed_bytes),
        wt.read_bytes_per_token / (1u64 << 20) as f64,
        wt.decode_tokens,
        mib(wt.bytes_read)
    );
    println!(
        "daemon         up {:.0} s, {} connections, {} queued, {} requests, {} errors ({} busy)",
        d.uptime_secs, d.connections, d.queued, d.requests, d.errors, d.busy
    );
    Ok(())
}
