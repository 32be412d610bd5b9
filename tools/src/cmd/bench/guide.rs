//! `llms bench guide`: what structured output costs per decode token on a model's vocabulary.
//! Every example schema (`guide::examples`) is compiled, then answers are decoded under it from
//! pseudo-random logits (a pessimistic walk: it wanders into more automaton states than a model
//! does), cold (each state's token mask computed when first reached) and warm (masks cached);
//! each step's time is the mask applied to a whole row of logits plus the step of the automaton.
//! Beside it, the model's own decode step (one token's forward pass), when the model loads.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ::guide::{Grammar, Matcher, Step};
use anyhow::Context;
use clap::Args;
use model::kv::{HeapChunks, KvCache};
use model::tokenizer::Tokenizer;
use model::{Logits, Model};

use crate::args::{ModelsDirArg, init_threads, resolve_model};
use crate::report::table;

/// `llms bench guide`.
#[derive(Args, Debug)]
pub struct BenchGuideArgs {
    #[command(flatten)]
    pub dir: ModelsDirArg,
    /// A known model's name (fetched if missing) or a GGUF file [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
    pub model: Option<PathBuf>,
    /// Answers decoded per schema (each cold, then again warm)
    #[arg(long, default_value_t = 4, value_parser = crate::report::positive)]
    pub answers: usize,
    /// Most tokens per answer
    #[arg(long, default_value_t = 160, value_parser = crate::report::positive)]
    pub max_tokens: usize,
    /// Decode steps of the model to time (0: none)
    #[arg(long, default_value_t = 32)]
    pub decode: usize,
    /// Engine threads for the model's decode step [default: all]
    #[arg(long)]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
}

/// One schema's figures.
#[derive(serde::Serialize, Debug)]
struct SchemaRow {
    name: &'static str,
    states: usize,
    compile_ms: f64,
    tokens: usize,
    cold_us_per_token: f64,
    warm_us_per_token: f64,
    max_step_us: f64,
    masks: usize,
    mask_bytes: usize,
}

#[derive(serde::Serialize, Debug)]
struct Report {
    model: String,
    cpu: String,
    vocab: usize,
    text_tokens: usize,
    trie_nodes: usize,
    decode_ms_per_token: Option<f64>,
    cold_us_per_token: f64,
    warm_us_per_token: f64,
    schemas: Vec<SchemaRow>,
}

/// Decodes answers under `g` from seeded pseudo-random logits; returns tokens and seconds spent
/// in the matcher, and the longest step.
fn walk(
    g: &Arc<Grammar>,
    stop: &[u32],
    size: usize,
    answers: usize,
    max: usize,
) -> (usize, f64, f64) {
    let mut logits = vec![0f32; size];
    let (mut tokens, mut secs, mut worst) = (0, 0.0f64, 0.0f64);
    for a in 0..answers {
        let mut m = Matcher::new(Arc::clone(g), stop.to_vec());
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (a as u64 + 1);
        for n in 0..max {
            for l in logits.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *l = (x % 10_000) as f32 / 1000.0;
            }
            let t = Instant::now();
            let step = m.constrain(&mut logits, max - n);
            let dt = t.elapsed().as_secs_f64();
            if step == Step::End {
                secs += dt;
                break;
            }
            let best = model::generate::argmax(&logits);
            let t2 = Instant::now();
            let ok = m.advance(best);
            let dt = dt + t2.elapsed().as_secs_f64();
            secs += dt;
            worst = worst.max(dt);
            tokens += 1;
            if !ok || stop.contains(&best) {
                break;
            }
        }
    }
    (tokens, secs, worst)
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_default()
}

/// Runs `llms bench guide`.
pub fn run(a: BenchGuideArgs) -> anyhow::Result<()> {
    a.report.begin();
    let path = resolve_model(a.model.as_deref(), &a.dir)?;
    let tok = Tokenizer::from_gguf_file(&path)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    let t = Instant::now();
    let vocab = Arc::new(daemon::format::vocab_of(&tok));
    tracing::info!(
        ms = t.elapsed().as_secs_f64() * 1e3,
        "vocabulary trie built"
    );
    let stop = tok.stop_ids();
    let size = tok.vocab_size();
    let mut rows = Vec::new();
    let (mut cold_t, mut cold_s, mut warm_t, mut warm_s) = (0, 0.0, 0, 0.0);
    for (name, _, schema) in ::guide::examples::SCHEMAS {
        let schema: serde_json::Value = serde_json::from_str(schema)?;
        let t = Instant::now();
        let g = Arc::new(Grammar::from_schema(&schema, Arc::clone(&vocab))?);
        let compile_ms = t.elapsed().as_secs_f64() * 1e3;
        let (tc, sc, worst) = walk(&g, &stop, size, a.answers, a.max_tokens);
        let (tw, sw, _) = walk(&g, &stop, size, a.answers, a.max_tokens);
        let (masks, mask_bytes) = g.cached_masks();
        cold_t += tc;
        cold_s += sc;
        warm_t += tw;
        warm_s += sw;
        rows.push(SchemaRow {
            name,
            states: g.states(),
            compile_ms,
            tokens: tc,
            cold_us_per_token: sc * 1e6 / tc.max(1) as f64,
            warm_us_per_token: sw * 1e6 / tw.max(1) as f64,
            max_step_us: worst * 1e6,
            masks,
            mask_bytes,
        });
    }
    let decode_ms = decode_step(&a, &path, &tok)?;
    let report = Report {
        model: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        cpu: cpu_name(),
        vocab: size,
        text_tokens: vocab.text_tokens(),
        trie_nodes: vocab.nodes(),
        decode_ms_per_token: decode_ms,
        cold_us_per_token: cold_s * 1e6 / cold_t.max(1) as f64,
        warm_us_per_token: warm_s * 1e6 / warm_t.max(1) as f64,
        schemas: rows,
    };
    print(&report);
    let out = a.report.write("guide", &report)?;
    eprintln!("report: {}", out.display());
    Ok(())
}

/// The model's decode step (one token's forward pass after a short prompt), in milliseconds,
/// when asked for and the model loads.
fn decode_step(
    a: &BenchGuideArgs,
    path: &std::path::Path,
    tok: &Tokenizer,
) -> anyhow::Result<Option<f64>> {
    Ok(if a.decode == 0 {
        None
    } else {
        match Model::load(path) {
            Ok(m) => {
                init_threads(a.threads)?;
                let mut cache = KvCache::new(
                    m.chunk_shape(16),
                    model::kv::KvFormat::Int8,
                    m.cfg.max_ctx.min(4096),
                    Box::new(HeapChunks::default()),
                );
                let prompt = tok.encode("The structured output benchmark decodes a few tokens.");
                let mut logits = m.forward(&mut cache, &prompt, Logits::Last)?;
                let t = Instant::now();
                for _ in 0..a.decode {
                    let next = model::generate::argmax(&logits);
                    logits = m.forward(&mut cache, &[next], Logits::Last)?;
                }
                Some(t.elapsed().as_secs_f64() * 1e3 / a.decode as f64)
            }
            Err(e) => {
                eprintln!("llms bench guide: the model does not load here ({e}); no decode step");
                None
            }
        }
    })
}

/// The report as a table and a summary line.
fn print(report: &Report) {
    let decode_ms = report.decode_ms_per_token;
    table!(
        "{:<18} {:>7} {:>10} {:>7} {:>12} {:>12} {:>12} {:>6} {:>9}",
        "schema",
        "states",
        "compile ms",
        "tokens",
        "cold us/tok",
        "warm us/tok",
        "max step us",
        "masks",
        "mask KiB"
    );
    for r in &report.schemas {
        table!(
            "{:<18} {:>7} {:>10.1} {:>7} {:>12.1} {:>12.1} {:>12.0} {:>6} {:>9}",
            r.name,
            r.states,
            r.compile_ms,
            r.tokens,
            r.cold_us_per_token,
            r.warm_us_per_token,
            r.max_step_us,
            r.masks,
            r.mask_bytes / 1024
        );
    }
    let ratio = |us: f64| {
        decode_ms.map_or(String::from("-"), |d| {
            format!("{:.2}%", us / 1e3 / d * 100.0)
        })
    };
    eprintln!(
        "{} ({} ids, {} text tokens, {} trie nodes) on {}: cold {:.1} us/token ({} of a decode step), warm {:.1} us/token ({}); decode step {}",
        report.model,
        report.vocab,
        report.text_tokens,
        report.trie_nodes,
        report.cpu,
        report.cold_us_per_token,
        ratio(report.cold_us_per_token),
        report.warm_us_per_token,
        ratio(report.warm_us_per_token),
        decode_ms.map_or("not measured".into(), |d| format!("{d:.2} ms")),
    );
}
