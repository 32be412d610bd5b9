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
    /// A known model's name (fetched if missing) or a GGUF file [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
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

/// Runs the benchmark: the daemon started, checked, called and killed, --kills times, then
/// started a last time, checked and stopped; the report printed and written. A context lost
/// or diverged, or a chunk quarantined, fails the run.
pub fn run(args: &BenchCrashArgs) -> anyhow::Result<()> {
    args.report.begin();
    let model = crate::args::resolve_model(args.model.as_deref(), &args.dir)?;
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
    let dir = args
        .scratch
        .as_ref()
        .unwrap_or(&args.report.out)
        .join(format!("crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut crashes = Crashes {
        args,
        tok,
        spec: DaemonSpec::new(&model, &dir),
        rng: rand::rngs::StdRng::seed_from_u64(seed),
        report: CrashReport {
            seed,
            ..CrashReport::default()
        },
        restarts: Vec::new(),
        expected: BTreeMap::new(),
    };
    for round in 0..args.kills {
        crashes.round(round)?;
    }
    crashes.last_round(args.kills)?;
    let mut report = crashes.report;
    report.restart_ms_max = crashes.restarts.iter().copied().fold(0.0, f64::max);
    report.restart_ms_median = median(crashes.restarts.iter().copied());
    print_report(&report);
    args.report.write("crash", &report)?;
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(
        report.diverged == 0 && report.lost == 0 && report.quarantined == 0,
        "the daemon lost or damaged state across kills (seed {seed})"
    );
    Ok(())
}

/// The parameters of a replayed call: a raw prompt, at most `max_tokens` generated.
fn params(max_tokens: usize) -> CallParams {
    CallParams {
        format: PromptFormat::Raw,
        max_tokens,
        ..CallParams::default()
    }
}

/// A run in progress: the replay's random draws, what was found so far, and what each
/// context may hold after the next restart.
struct Crashes<'a> {
    args: &'a BenchCrashArgs,
    tok: Tokenizer,
    spec: DaemonSpec,
    rng: rand::rngs::StdRng,
    report: CrashReport,
    /// Each start's spawn to listening, ms.
    restarts: Vec<f64>,
    /// Context id -> the lengths it may have after a restart.
    expected: BTreeMap<u64, Vec<usize>>,
}

impl Crashes<'_> {
    /// Starts the daemon and checks what survived the last kill: each context's length, and the
    /// mount's count of quarantined chunks.
    fn restart(&mut self, round: usize) -> anyhow::Result<(Daemon, Client)> {
        let (d, ms) = Daemon::start(&self.spec)?;
        self.restarts.push(ms);
        let mut c =
            Client::connect(&self.spec.socket(), "crash").context("connecting to the daemon")?;
        for (&ctx, may) in self.expected.iter_mut() {
            match c.info(ctx) {
                Ok(info) if may.contains(&info.tokens) => *may = vec![info.tokens],
                Ok(info) => {
                    self.report.diverged += 1;
                    tracing::error!(ctx, tokens = info.tokens, ?may, round, "a context diverged");
                    *may = vec![info.tokens];
                }
                Err(e) => {
                    self.report.lost += 1;
                    tracing::error!(ctx, error = %e, round, "a context was lost");
                }
            }
        }
        self.report.quarantined = quarantined(&self.spec.mountpoint())?;
        Ok((d, c))
    }

    /// The last restart: every context answers once more, then a clean stop.
    fn last_round(&mut self, round: usize) -> anyhow::Result<()> {
        let (mut d, mut c) = self.restart(round)?;
        for &ctx in self.expected.keys() {
            c.call(ctx, PROMPTS[0], &params(2))?.collect_answer()?;
        }
        drop(c);
        d.term()
    }

    /// One round: a restart and its checks, the contexts made up to --contexts, 0 to 2 calls
    /// that complete, and one that a kill interrupts.
    fn round(&mut self, round: usize) -> anyhow::Result<()> {
        let (mut d, mut c) = self.restart(round)?;
        while self.expected.len() < self.args.contexts {
            let ctx = c.new_context(None, PromptFormat::Raw)?;
            self.expected.insert(ctx, vec![0]);
        }
        let ids: Vec<u64> = self.expected.keys().copied().collect();
        for _ in 0..self.rng.random_range(0..3) {
            let ctx = ids[self.rng.random_range(0..ids.len())];
            let prompt = PROMPTS[self.rng.random_range(0..PROMPTS.len())];
            let max_tokens = self.rng.random_range(1..=self.args.max_tokens);
            let a = c.call(ctx, prompt, &params(max_tokens))?.collect_answer()?;
            self.expected.insert(ctx, vec![a.done.context_tokens]);
            self.report.calls_completed += 1;
        }
        self.interrupted_call(&mut c, &mut d, &ids, round)?;
        self.report.kills += 1;
        let kills = self.args.kills;
        if self.report.kills.is_multiple_of(10) || self.report.kills == kills {
            #[allow(clippy::print_stderr)]
            {
                eprintln!(
                    "bench crash: {}/{kills} kills, {} diverged, {} lost",
                    self.report.kills, self.report.diverged, self.report.lost
                );
            }
        }
        Ok(())
    }

    /// One call of a context of `ids` that the kill interrupts after some of its tokens (or
    /// none): what the context may hold after the restart is what it held before, or the call's
    /// whole prompt and what was streamed; a call that finished before the kill holds exactly
    /// that.
    fn interrupted_call(
        &mut self,
        c: &mut Client,
        d: &mut Daemon,
        ids: &[u64],
        round: usize,
    ) -> anyhow::Result<()> {
        let max_tokens = self.args.max_tokens;
        let ctx = ids[self.rng.random_range(0..ids.len())];
        let prompt = PROMPTS[self.rng.random_range(0..PROMPTS.len())];
        let before = self.expected[&ctx][0];
        let mut stream = c.call(ctx, prompt, &params(max_tokens.max(2) * 4))?;
        let wait_for = self.rng.random_range(0..max_tokens * 2);
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
        let completed = before + self.tok.encode(prompt).len() + streamed;
        match done {
            Some(n) => {
                self.report.calls_completed += 1;
                // A finished call holds what it was told plus what it streamed.
                if n != completed {
                    self.report.diverged += 1;
                    tracing::error!(
                        ctx,
                        tokens = n,
                        completed,
                        round,
                        "a call's length diverged"
                    );
                }
                self.expected.insert(ctx, vec![n]);
            }
            None => {
                self.report.calls_interrupted += 1;
                self.expected.insert(ctx, vec![before, completed]);
            }
        }
        Ok(())
    }
}

/// The run's counts and restart times.
fn print_report(report: &CrashReport) {
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
}
