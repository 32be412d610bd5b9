//! `llms trace gen` and `llms trace show`: context-switching traces (`docs/trace.md`); the
//! mechanism is `bench::trace`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use bench::trace::{self, PastCap, Pattern, Source, Summary, TraceSpec};
use clap::{Args, Subcommand, ValueEnum};
use model::tokenizer::Tokenizer;
use strum::VariantArray;

use crate::args::ModelsDirArg;

/// `writeln!` into a `String` (which cannot fail).
macro_rules! outln {
    ($o:expr) => { $o.push('\n') };
    ($o:expr, $($arg:tt)*) => {{ use std::fmt::Write as _; let _ = writeln!($o, $($arg)*); }};
}

/// `write!` into a `String`.
macro_rules! out {
    ($o:expr, $($arg:tt)*) => {{ use std::fmt::Write as _; let _ = write!($o, $($arg)*); }};
}

#[derive(Subcommand, Debug)]
pub enum TraceCommand {
    /// Generate a trace: Poisson arrivals, a switching pattern, prompts of real text whose
    /// lengths follow the paper's Table 3 (docs/trace.md)
    Gen(Box<GenArgs>),
    /// Sum up a trace: calls per context, prompt lengths, arrivals, how calls switch contexts
    Show(ShowArgs),
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatternArg {
    /// Every call picks a context uniformly
    Random,
    /// A Markov chain with locality: stay, go to a ring neighbour, or anywhere (--stay, --neighbour)
    Markov,
    /// Popularity by workload: contexts of moderate prompt growth are called most (--sigma)
    Gaussian,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PastCapArg {
    /// Keep calling; the service slides the context's window over the last --max-context tokens
    Slide,
    /// End the conversation and start a new one in the same context
    Restart,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    llms trace gen trace.jsonl                      # the standard run: 8 contexts, Markov, 200 calls\n  \
    llms trace gen --pattern gaussian --contexts 16 --calls 1000 --rate 1/60 t.jsonl\n  \
    llms trace gen --sources xsum,sst2 --max-context 4096 --past-cap restart t.jsonl\n  \
    llms trace show trace.jsonl\n\
    Same seed and flags (and text and model) give a byte-identical file.")]
pub struct GenArgs {
    /// The trace file to write (replaced if it exists); - for stdout
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Seed of every random draw
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Calls in the trace
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=trace_limits::CALLS))]
    pub calls: u64,
    /// Contexts the calls go to; context i takes the i-th source of --sources, in turn
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=trace_limits::CONTEXTS))]
    pub contexts: u32,
    /// Mean arrival rate of the Poisson process, calls per second: a number or a fraction
    /// (1/300 is the paper's one call per five minutes)
    #[arg(long, default_value = "1/300", value_name = "CALLS_PER_S", value_parser = parse_rate)]
    pub rate: f64,
    /// How calls switch contexts
    #[arg(long, value_enum, default_value_t = PatternArg::Markov)]
    pub pattern: PatternArg,
    /// Markov: probability that a call goes to the same context as the previous one [default: 0.5]
    #[arg(long, value_name = "P", value_parser = parse_probability)]
    pub stay: Option<f64>,
    /// Markov: probability that it goes to a ring neighbour (context i±1), split evenly; the
    /// rest goes evenly to the others [default: 0.3]
    #[arg(long, value_name = "P", value_parser = parse_probability)]
    pub neighbour: Option<f64>,
    /// Gaussian: the popularity curve's standard deviation, as a fraction of the number of
    /// contexts [default: 0.25]
    #[arg(long, value_name = "FRACTION", value_parser = parse_positive_f64)]
    pub sigma: Option<f64>,
    /// Sources of the calls, given to the contexts in turn. Paper Table 3: ag_news (200-500
    /// prompt tokens), xsum (1000-2000), samsum (100-300), cnn_dailymail (500-1000), wmt
    /// (100-500), sst2 (10-100). Long contexts (with a --max-context of 8192 or more):
    /// document (a pasted document of 4096-16384 tokens, at most 3/4 of --max-context, opens
    /// each conversation, then questions of 10-60), chat (100-400, growing to the limit and
    /// sliding)
    #[arg(long, value_delimiter = ',', value_name = "NAMES",
          default_value = "ag_news,xsum,samsum,cnn_dailymail,wmt,sst2", value_parser = parse_source)]
    pub sources: Vec<Source>,
    /// Most tokens a context holds (prompts and answers); see --past-cap
    #[arg(long, default_value_t = 2048, value_name = "TOKENS",
          value_parser = clap::value_parser!(u32).range(1..=1 << 24))]
    pub max_context: u32,
    /// What a context does when its next call would take it past --max-context
    #[arg(long, value_enum, default_value_t = PastCapArg::Slide)]
    pub past_cap: PastCapArg,
    /// Most tokens of each answer (counted in each context's length)
    #[arg(long, default_value_t = 32, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_tokens: u32,
    /// Text files the prompts are cut from, in order (repeatable) [default: the licences in
    /// /usr/share/common-licenses]
    #[arg(long, value_name = "FILE")]
    pub text: Vec<PathBuf>,
    /// The model whose tokenizer counts the tokens: a known model's name (smollm2-135m,
    /// gemma3-270m: fetched into the cache if missing) or a GGUF file [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub dir: ModelsDirArg,
}

/// Bounds of `llms trace gen`'s counts.
mod trace_limits {
    pub const CALLS: u64 = 10_000_000;
    pub const CONTEXTS: i64 = 65_536;
}

#[derive(Args, Debug)]
pub struct ShowArgs {
    /// The trace file
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Print the summary as JSON on stdout
    #[arg(long)]
    pub json: bool,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let s = s.trim();
    let v = match s.split_once('/') {
        Some((a, b)) => {
            let a: f64 = a.trim().parse().map_err(|e| format!("'{a}': {e}"))?;
            let b: f64 = b.trim().parse().map_err(|e| format!("'{b}': {e}"))?;
            a / b
        }
        None => s.parse::<f64>().map_err(|e| format!("'{s}': {e}"))?,
    };
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!(
            "must be a positive number of calls per second (e.g. 0.5 or 1/300), not {s}"
        ))
    }
}

fn parse_probability(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("'{s}': {e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be a probability from 0 to 1, not {s}"))
    }
}

fn parse_positive_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("'{s}': {e}"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a positive number, not {s}"))
    }
}

fn parse_source(s: &str) -> Result<Source, String> {
    s.trim().parse().map_err(|_| {
        let names: Vec<&str> = Source::VARIANTS.iter().map(|s| s.name()).collect();
        format!("unknown source '{s}' (known: {})", names.join(", "))
    })
}

pub fn run(cmd: TraceCommand) -> anyhow::Result<()> {
    match cmd {
        TraceCommand::Gen(a) => run_gen(*a),
        TraceCommand::Show(a) => run_show(&a),
    }
}

/// The first flag of `flags` that was given.
fn stray(flags: &[(&'static str, Option<f64>)]) -> Option<&'static str> {
    flags.iter().find(|(_, v)| v.is_some()).map(|f| f.0)
}

/// The pattern the flags describe; a parameter of another pattern is an error.
fn pattern(a: &GenArgs) -> anyhow::Result<Pattern> {
    let markov_only = [("--stay", a.stay), ("--neighbour", a.neighbour)];
    let gaussian_only = [("--sigma", a.sigma)];
    let p = match a.pattern {
        PatternArg::Random => Pattern::Random,
        PatternArg::Markov => Pattern::Markov {
            stay: a.stay.unwrap_or(trace::DEFAULT_STAY),
            neighbour: a.neighbour.unwrap_or(trace::DEFAULT_NEIGHBOUR),
        },
        PatternArg::Gaussian => Pattern::Gaussian {
            sigma: a.sigma.unwrap_or(trace::DEFAULT_SIGMA),
        },
    };
    if a.pattern != PatternArg::Markov
        && let Some(f) = stray(&markov_only)
    {
        bail!("{f} is a parameter of --pattern markov, not {}", p.name());
    }
    if a.pattern != PatternArg::Gaussian
        && let Some(f) = stray(&gaussian_only)
    {
        bail!("{f} is a parameter of --pattern gaussian, not {}", p.name());
    }
    if let Err(e) = p.check() {
        bail!("bad --pattern {}: {e}", p.name());
    }
    Ok(p)
}

fn run_gen(a: GenArgs) -> anyhow::Result<()> {
    let pattern = pattern(&a)?;
    let mut spec = TraceSpec::new(String::new());
    spec.seed = a.seed;
    spec.calls = a.calls;
    spec.contexts = a.contexts;
    spec.rate = a.rate;
    spec.pattern = pattern;
    spec.sources = a.sources;
    spec.max_context = a.max_context;
    spec.past_cap = match a.past_cap {
        PastCapArg::Slide => PastCap::Slide,
        PastCapArg::Restart => PastCap::Restart,
    };
    spec.max_tokens = a.max_tokens;
    if !a.text.is_empty() {
        spec.text = a.text;
    }
    // Refuse a bad spec or unreadable text before fetching or loading anything.
    spec.check().map_err(|e| anyhow::anyhow!("{e}"))?;
    for t in &spec.text {
        std::fs::File::open(t)
            .with_context(|| format!("cannot read the text file {}", t.display()))?;
    }
    let model = crate::args::resolve_model(a.model.as_deref(), &a.dir)?;
    spec.model = model.file_name().map_or_else(
        || model.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let tokenizer = Tokenizer::from_gguf_file(&model)
        .with_context(|| format!("cannot build the tokenizer of {}", model.display()))?;
    let t = trace::generate(&spec, &tokenizer).context("cannot generate the trace")?;
    if a.file.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        trace::write_to(&t, &mut out).context("cannot write the trace to stdout")?;
        out.flush()?;
    } else {
        trace::write(&t, &a.file)?;
    }
    let s = Summary::of(&t);
    eprintln!(
        "wrote {}: {} calls to {} contexts over {} ({} pattern, seed {}), {} prompt tokens; \
         `llms trace show {}` for more",
        a.file.display(),
        s.calls,
        s.contexts,
        duration(s.duration_s),
        pattern.name(),
        spec.seed,
        s.prompt_tokens,
        a.file.display()
    );
    Ok(())
}

/// Seconds as `1h02m03s`, `2m03.4s` or `3.456s`.
fn duration(s: f64) -> String {
    if s >= 3600.0 {
        let t = s.round() as u64;
        format!("{}h{:02}m{:02}s", t / 3600, t / 60 % 60, t % 60)
    } else if s >= 60.0 {
        format!("{}m{:04.1}s", (s / 60.0) as u64, s % 60.0)
    } else {
        format!("{s:.3}s")
    }
}

/// `llms trace show`: the summary as JSON, or as text: its counts, then a table per context
/// and per source.
fn run_show(a: &ShowArgs) -> anyhow::Result<()> {
    let t = trace::read(&a.file)?;
    let s = Summary::of(&t);
    if a.json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(&s)?));
    }
    let mut o = String::new();
    outln!(o, "{}", a.file.display());
    show_counts(&mut o, &t.header, &s);
    outln!(o);
    show_contexts(&mut o, &s);
    outln!(o);
    show_sources(&mut o, &s);
    emit(&o)
}

/// The summary's counts: calls and contexts, time and rate, the caps, and how calls switch.
fn show_counts(o: &mut String, h: &trace::TraceHeader, s: &Summary) {
    let pattern = match h.pattern {
        Pattern::Random => "random".to_string(),
        Pattern::Markov { stay, neighbour } => {
            format!("markov (stay {stay}, neighbour {neighbour})")
        }
        Pattern::Gaussian { sigma } => format!("gaussian (sigma {sigma} x contexts)"),
    };
    outln!(
        o,
        "  {} calls, {} contexts ({} called), pattern {pattern}, seed {}",
        s.calls,
        s.contexts,
        s.contexts_called,
        s.seed
    );
    outln!(
        o,
        "  duration {} ({:.1} s); rate {:.6} calls/s (header {:.6}); inter-arrival mean {:.3} s, cv {:.2}",
        duration(s.duration_s),
        s.duration_s,
        s.measured_rate,
        s.rate,
        s.interarrival_s.mean,
        s.interarrival_cv
    );
    outln!(
        o,
        "  max context {} tokens, past it: {}; answers up to {} tokens; {} prompt tokens in all; tokens of {}",
        h.max_context,
        h.past_cap.name(),
        h.max_tokens,
        s.prompt_tokens,
        h.model
    );
    outln!(
        o,
        "  switches: {:.1}% of calls go to another context than the previous call; mean reuse distance {:.2}",
        100.0 * s.switch_fraction,
        s.mean_reuse_distance
    );
    out!(o, "  reuse distance (other contexts called in between):");
    for (b, c) in s
        .reuse_distance
        .buckets
        .iter()
        .zip(&s.reuse_distance.counts)
    {
        out!(o, "  {b}: {c}");
    }
    outln!(o);
}

/// A row per context: its app, source, calls, starts, prompt lengths and tokens.
fn show_contexts(o: &mut String, s: &Summary) {
    outln!(
        o,
        "{:>7}  {:<10} {:<14} {:>6} {:>6} {:>6} {:>8}  {:>18}  {:>8} {:>7}",
        "CONTEXT",
        "APP",
        "SOURCE",
        "CALLS",
        "SHARE",
        "STARTS",
        "PASTCAP",
        "PROMPT min/mean/max",
        "APPENDED",
        "FINAL"
    );
    for c in &s.per_context {
        outln!(
            o,
            "{:>7}  {:<10} {:<14} {:>6} {:>5.1}% {:>6} {:>8}  {:>18}  {:>8} {:>7}",
            c.context,
            c.app,
            c.source.name(),
            c.calls,
            100.0 * c.share,
            c.starts,
            c.past_cap,
            format!(
                "{:.0}/{:.0}/{:.0}",
                c.tokens.min, c.tokens.mean, c.tokens.max
            ),
            c.appended_tokens,
            c.final_tokens
        );
    }
}

/// A row per source: its Table 3 range, contexts, calls and prompt lengths.
fn show_sources(o: &mut String, s: &Summary) {
    outln!(
        o,
        "{:<14} {:>10} {:>8} {:>6}  {:>18}",
        "SOURCE",
        "TABLE 3",
        "CONTEXTS",
        "CALLS",
        "PROMPT min/mean/max"
    );
    for src in &s.per_source {
        outln!(
            o,
            "{:<14} {:>10} {:>8} {:>6}  {:>18}",
            src.source.name(),
            format!("{}-{}", src.range.0, src.range.1),
            src.contexts,
            src.calls,
            format!(
                "{:.0}/{:.0}/{:.0}",
                src.tokens.min, src.tokens.mean, src.tokens.max
            )
        );
    }
}

/// Writes `text` to stdout; a reader that went away (`| head`) is not an error.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(e).context("cannot write to stdout")
        }
        _ => Ok(()),
    }
}
