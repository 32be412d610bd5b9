//! `llms bench crash`: a live daemon is killed with SIGKILL at random moments of a replay of calls,
//! again and again; after every restart each context must hold exactly its last completed call
//! (or, for the call the crash interrupted, that call's tokens once they were made durable), the
//! conversation must go on, and the store must not have served or quarantined a damaged chunk.
//! Reports restart times (spawn to listening, contexts recovered) and the checks' counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use model::tokenizer::Tokenizer;
use protocol::PromptFormat;
use protocol::client::{CallEvent, CallParams, Client};
use rand::{Rng, SeedableRng};
use uffd_pager::median;

use crate::args::ModelsDirArg;
use bench::daemon_proc::{Daemon, DaemonSpec};

/// Options of `llms bench crash`.
#[derive(clap::Args, Debug)]
pub struct BenchCrashArgs {
    #[command(flatten)]
    pub dir: ModelsDirArg,
    /// A GGUF model file [default: the default model, fetched if missing]
    #[arg(long, env = "LLMS_MODEL", value_name = "FILE")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Times the daemon is killed
    #[arg(long, default_value_t = 100, value_parser = crate::report::positive)]
    pub kills: usize,
    /// Contexts the replay keeps
    #[arg(long, default_value_t = 3, value_parser = crate::report::positive)]
    pub contexts: usize,
    /// Most tokens one call generates (each call picks 1 to this many)
    #[arg(long, default_value_t = 8, value_parser = crate::report::positive)]
    pub max_tokens: usize,
    /// Seed of the replay [default: from the clock; printed so a run replays]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Where the daemon's store, socket and mount go (a fresh directory is made inside, removed
    /// at the end) [default: <out>]
    #[arg(long, value_name = "DIR")]
    pub scratch: Option<PathBuf>,
}

const PROMPTS: [&str; 4] = [
    "The quick brown fox jumps over the lazy dog. ",
    "Tell me about the moon in one sentence. ",
    "A second message, somewhat longer than the first one, to fill a chunk or two of the cache. ",
    "And then? ",
];

/// What one run found.
#[derive(Debug, Default, serde::Serialize)]
pub struct CrashReport {
    pub seed: u64,
    pub kills: usize,
    pub calls_completed: usize,
    pub calls_interrupted: usize,
    /// Contexts whose length after a restart was neither allowed value.
    pub diverged: usize,
    /// Contexts missing after a restart.
    pub lost: usize,
    /// Chunks the store quarantined (failed their checks) over the run.
    pub quarantined: u64,
    /// Spawn to listening, milliseconds: median and max.
    pub restart_ms_median: f64,
    pub restart_ms_max: f64,
}

/// The `quarantined` count of the mount's `/stats`.
fn quarantined(mnt: &Path) -> anyhow::Result<u64> {
    let stats = std::fs::read_to_string(mnt.join("stats"))
        .with_context(|| format!("reading {}/stats", mnt.display()))?;
    stats
        .lines()
        .find_map(|l| l.strip_prefix("quarantined"))
        .and_then(|v| v.trim().parse().ok())
        .context("no quarantined line in the mount's stats")
}

/// Runs the benchmark.
pub fn run(args: &BenchCrashArgs) -> anyhow::Result<()> {
    args.report.begin();
    let model = match &args.model {
        Some(p) => p.clone(),
        None => model::fetch::default_model_path(&args.dir.fetch_options())
            .context("cannot get the default model (try `llms model fetch`)")?,
    };
    let tok = Tokenizer::from_gguf_file(&model)
        .with_context(|| format!("cannot build the tokenizer of {}", model.display()))?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    #[allow(clippy::print_stderr)]
    {
        eprintln!("bench crash: seed {seed} (replay with --seed {seed})");
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = args
        .scratch
        .as_ref()
        .unwrap_or(&args.report.out)
        .join(format!("crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let spec = DaemonSpec::new(&model, &dir);
    let mnt = spec.mountpoint();
    let socket = spec.socket();
    let params = |max_tokens| CallParams {
        format: PromptFormat::Raw,
        max_tokens,
        ..CallParams::default()
    };
    let mut report = CrashReport {
        seed,
        ..CrashReport::default()
    };
    let mut restarts = Vec::new();
    // Context id -> the lengths it may have after a restart.
    let mut expected: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for round in 0..=args.kills {
        let (mut d, ms) = Daemon::start(&spec)?;
        restarts.push(ms);
        let mut c = Client::connect(&socket, "crash").context("connecting to the daemon")?;
        for (&ctx, may) in expected.iter_mut() {
            match c.info(ctx) {
                Ok(info) if may.contains(&info.tokens) => *may = vec![info.tokens],
                Ok(info) => {
                    report.diverged += 1;
                    tracing::error!(ctx, tokens = info.tokens, ?may, round, "a context diverged");
                    *may = vec![info.tokens];
                }
                Err(e) => {
                    report.lost += 1;
                    tracing::error!(ctx, error = %e, round, "a context was lost");
                }
            }
        }
        report.quarantined = quarantined(&mnt)?;
        if round == args.kills {
            // The last restart: every context answers once more, then a clean stop.
            for &ctx in expected.keys() {
                c.call(ctx, PROMPTS[0], &params(2))?.collect_answer()?;
            }
            drop(c);
            d.term()?;
            break;
        }
        while expected.len() < args.contexts {
            let ctx = c.new_context(None, PromptFormat::Raw)?;
            expected.insert(ctx, vec![0]);
        }
        let ids: Vec<u64> = expected.keys().copied().collect();
        for _ in 0..rng.random_range(0..3) {
            let ctx = ids[rng.random_range(0..ids.len())];
            let prompt = PROMPTS[rng.random_range(0..PROMPTS.len())];
            let a = c
                .call(ctx, prompt, &params(rng.random_range(1..=args.max_tokens)))?
                .collect_answer()?;
            expected.insert(ctx, vec![a.done.context_tokens]);
            report.calls_completed += 1;
        }
        // One call that the kill interrupts after some of its tokens (or none).
        let ctx = ids[rng.random_range(0..ids.len())];
        let prompt = PROMPTS[rng.random_range(0..PROMPTS.len())];
        let before = expected[&ctx][0];
        let mut stream = c.call(ctx, prompt, &params(args.max_tokens.max(2) * 4))?;
        let wait_for = rng.random_range(0..args.max_tokens * 2);
        let (mut streamed, mut done) = (0, None);
        while streamed < wait_for && done.is_none() {
            match stream.next() {
                Some(Ok(CallEvent::Token { .. })) => streamed += 1,
                Some(Ok(CallEvent::Done(dn))) => done = Some(dn.context_tokens),
                other => bail!("round {round}: the call ended with {other:?}"),
            }
        }
        d.kill9()?;
        // What the daemon sent before it died is still in the socket.
        while done.is_none() {
            match stream.next() {
                Some(Ok(CallEvent::Token { .. })) => streamed += 1,
                Some(Ok(CallEvent::Done(dn))) => done = Some(dn.context_tokens),
                _ => break,
            }
        }
        let completed = before + tok.encode(prompt).len() + streamed;
        match done {
            Some(n) => {
                report.calls_completed += 1;
                // A finished call holds what it was told plus what it streamed.
                if n != completed {
                    report.diverged += 1;
                    tracing::error!(
                        ctx,
                        tokens = n,
                        completed,
                        round,
                        "a call's length diverged"
                    );
                }
                expected.insert(ctx, vec![n]);
            }
            None => {
                report.calls_interrupted += 1;
                expected.insert(ctx, vec![before, completed]);
            }
        }
        report.kills += 1;
        if report.kills.is_multiple_of(10) || report.kills == args.kills {
            #[allow(clippy::print_stderr)]
            {
                eprintln!(
                    "bench crash: {}/{} kills, {} diverged, {} lost",
                    report.kills, args.kills, report.diverged, report.lost
                );
            }
        }
    }
    report.restart_ms_max = restarts.iter().copied().fold(0.0, f64::max);
    report.restart_ms_median = median(restarts.iter().copied());
    crate::report::table!(
        "kills {}  calls completed {}  interrupted {}  contexts diverged {}  lost {}  chunks quarantined {}",
        report.kills,
        report.calls_completed,
        report.calls_interrupted,
        report.diverged,
        report.lost,
        report.quarantined
    );
    crate::report::table!(
        "restart (spawn to listening, store recovered, mount up): median {:.0} ms, max {:.0} ms",
        report.restart_ms_median,
        report.restart_ms_max
    );
    args.report.write("crash", &report)?;
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(
        report.diverged == 0 && report.lost == 0 && report.quarantined == 0,
        "the daemon lost or damaged state across kills (seed {seed})"
    );
    Ok(())
}
