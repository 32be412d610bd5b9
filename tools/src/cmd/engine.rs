//! `llms generate`, `llms chat` and `llms eval ppl`: the engine used directly, one local context,
//! no daemon.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use model::Logits;
use model::generate::{Sampler, SamplingParams, generate};
use model::kv::KvCache;
use model::tokenizer::{Message, StreamDecoder};

use crate::args::{EngineOpts, Loaded, load, load_path, model_path};

/// How to sample.
#[derive(Args, Debug, Clone)]
pub struct SampleOpts {
    /// Most tokens to generate per answer
    #[arg(long, default_value_t = protocol::DEFAULT_MAX_TOKENS, value_name = "N")]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub temperature: f32,
    /// Sample only from the k most likely tokens (0: all)
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub top_k: usize,
    /// Sample only from the most likely tokens whose probabilities sum to p
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    pub top_p: f32,
    /// Seed of the sampler
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SampleOpts {
    /// The call options the daemon takes.
    pub fn params(&self) -> anyhow::Result<protocol::client::CallParams> {
        self.sampler()?;
        Ok(protocol::client::CallParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            ..Default::default()
        })
    }

    fn sampler(&self) -> anyhow::Result<Sampler> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1]");
        }
        Ok(Sampler::new(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        }))
    }
}

/// `llms generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineOpts,
    #[command(flatten)]
    pub sample: SampleOpts,
    /// The prompt
    #[arg(long, short)]
    pub prompt: String,
    /// Feed the prompt as plain text instead of a chat turn
    #[arg(long)]
    pub raw: bool,
    /// System prompt of the chat turn [default: the model's own]
    #[arg(long)]
    pub system: Option<String>,
}

/// `llms chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub engine: EngineOpts,
    #[command(flatten)]
    pub sample: SampleOpts,
    /// Answer this one message and exit (without it, chat interactively, a message per line)
    #[arg(long, short)]
    pub prompt: Option<String>,
    /// System prompt [default: the model's own]
    #[arg(long)]
    pub system: Option<String>,
    /// Run the model in this process, one context, no daemon (the --kv-format, --chunk-tokens,
    /// --prefill-chunk and --threads options apply only here)
    #[arg(long)]
    pub local: bool,
    #[command(flatten)]
    pub socket: crate::args::SocketArg,
    /// Continue this context of the daemon (see `llms ctx ls`) instead of a new one
    #[arg(long, value_name = "ID", conflicts_with_all = ["local", "system"])]
    pub context: Option<u64>,
    /// Start from this transcript (JSON, as `llms ctx export` writes it): a new context rebuilt
    /// from its turns
    #[arg(long, value_name = "FILE", conflicts_with_all = ["local", "system", "context"])]
    pub transcript: Option<std::path::PathBuf>,
    /// Keep the new context when the chat ends (it is deleted otherwise)
    #[arg(long, conflicts_with = "local")]
    pub keep: bool,
    /// The app name the daemon files the context under
    #[arg(long, default_value = "chat", value_name = "NAME")]
    pub app: String,
    /// Answer as JSON that validates against the JSON Schema in this file (structured output)
    #[arg(long, value_name = "FILE", conflicts_with_all = ["local", "regex"])]
    pub json_schema: Option<std::path::PathBuf>,
    /// Answer with text this regular expression matches as a whole (structured output)
    #[arg(long, value_name = "REGEX", conflicts_with = "local")]
    pub regex: Option<String>,
    /// Declare the tools in this file (a JSON list of {"name", "description", "parameters"}) on
    /// the new context; a tool call is printed as `[tool_call NAME ARGUMENTS]` and the next line
    /// typed is the tool's result
    #[arg(long, value_name = "FILE", conflicts_with_all = ["local", "context", "transcript"])]
    pub tools: Option<std::path::PathBuf>,
    /// How the model chooses between an answer and a tool call: auto, required, none, or a
    /// tool's name
    #[arg(long, value_name = "CHOICE", requires = "tools")]
    pub tool_choice: Option<String>,
}

/// Streams one answer to stdout, feeding `history[cache.len()..]` first; returns the answer's tokens.
fn answer(
    l: &Loaded,
    cache: &mut KvCache,
    history: &[u32],
    sampler: &mut Sampler,
    max_tokens: usize,
) -> anyhow::Result<Vec<u32>> {
    let stop = l.tokenizer.stop_ids();
    let mut dec = StreamDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let g = generate(
        &l.model,
        cache,
        &history[cache.len()..],
        max_tokens,
        &stop,
        sampler,
        |t| {
            let s = dec.push(&l.tokenizer, t);
            write!(out, "{s}").and_then(|_| out.flush()).is_ok()
        },
    )?;
    writeln!(out, "{}", dec.finish())?;
    let n = g.tokens.len().saturating_sub(1).max(1);
    tracing::info!(
        prompt_tokens = g.prompt_tokens,
        prefill_tps = g.prompt_tokens as f64 / g.prefill_secs,
        decode_tps = n as f64 / g.decode_secs,
        stop = ?g.stop,
        "answered"
    );
    eprintln!(
        "[{} prompt tokens at {:.0} t/s, {} generated at {:.1} t/s, stop: {:?}]",
        g.prompt_tokens,
        g.prompt_tokens as f64 / g.prefill_secs.max(1e-9),
        g.tokens.len(),
        n as f64 / g.decode_secs.max(1e-9),
        g.stop
    );
    Ok(g.tokens)
}

fn first_turn(l: &Loaded, system: Option<&str>, user: &str) -> anyhow::Result<Vec<u32>> {
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(Message::system(s));
    }
    msgs.push(Message::user(user));
    Ok(l.tokenizer.encode_chat(&msgs, true)?)
}

/// Runs `llms generate`.
pub fn run_generate(a: GenerateArgs) -> anyhow::Result<()> {
    let l = load(&a.engine)?;
    let mut sampler = a.sample.sampler()?;
    let prompt = if a.raw {
        l.tokenizer.encode_start(&a.prompt)
    } else {
        first_turn(&l, a.system.as_deref(), &a.prompt)?
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let mut cache = l.new_cache();
    answer(&l, &mut cache, &prompt, &mut sampler, a.sample.max_tokens)?;
    Ok(())
}

/// Runs `llms chat --local`.
pub fn run_chat(a: ChatArgs) -> anyhow::Result<()> {
    let l = load(&a.engine)?;
    let mut sampler = a.sample.sampler()?;
    let mut cache = l.new_cache();
    let tk = &l.tokenizer;
    let turns = tk.chat_turns()?;
    let (start, end) = (turns.start, turns.end);
    let mut history: Vec<u32> = Vec::new();
    let mut turn =
        |history: &mut Vec<u32>, user: &str, cache: &mut KvCache| -> anyhow::Result<()> {
            if history.is_empty() {
                *history = first_turn(&l, a.system.as_deref(), user)?;
            } else {
                history.push(start);
                history.extend(tk.encode(&format!("user\n{user}")));
                history.push(end);
                history.extend(tk.encode("\n"));
                history.push(start);
                history.extend(tk.encode(&format!("{}\n", turns.assistant)));
            }
            let reply = answer(&l, cache, history, &mut sampler, a.sample.max_tokens)?;
            history.extend(reply);
            history.push(end);
            history.extend(tk.encode("\n"));
            Ok(())
        };
    converse(a.prompt.as_deref(), |user| {
        turn(&mut history, user, &mut cache)
    })
}

/// `llms eval ppl`.
#[derive(Args, Debug)]
pub struct PplArgs {
    #[command(flatten)]
    pub engine: EngineOpts,
    /// The text to score (UTF-8)
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Tokens per window; each window is scored on its second half
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub ctx: usize,
    /// Score at most this many windows (0: all)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_windows: usize,
    /// Compress each window's first half before scoring its second: `8:4:2=PCT:PCT:PCT`
    /// (shares of chunks at int8/int4/int2 by density rank), `ratio=R` (the policy's
    /// assignment under global ratio R), `sim:SPEC` (a simulated candidate), `mix:L/L/L@BITS`
    /// (levels by density under a budget of stored bits per value), `llms` (the service's mix:
    /// k8v8/k4v4/k4v3 at 4.5 bits) or a format name (f16, int8, int4, int2, k8v8, k4v4, k4v3);
    /// several, comma-separated, are scored on the same windows
    #[arg(long, value_name = "MIX", value_delimiter = ',')]
    pub kv_mix: Vec<String>,
    /// Also report each run's KL divergence from the f16 run's next-token distributions and the
    /// share of tokens whose top prediction agrees (implies --kv-mix, by default --kv-format's)
    #[arg(long)]
    pub kl: bool,
    /// Prefill activations of the KL reference run (implies --kl): `--prefill-activations int8
    /// --kl-prefill f32` measures what int8 activations cost, as KL divergence and the share of
    /// tokens whose greedy choice stays the same [default: --prefill-activations']
    #[arg(long, value_name = "KIND", value_parser = ["auto", "f32", "int8"])]
    pub kl_prefill: Option<String>,
    /// Score each window's second half token by token through decode attention over the
    /// chunks as stored (the kernels a call's answer runs), instead of in one batched pass; as
    /// many forward passes as scored tokens, so slower (implies --kv-mix, by default
    /// --kv-format's)
    #[arg(long)]
    pub decode: bool,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
}

/// The perplexity of a text, with the protocol of llama.cpp's perplexity tool.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PplResult {
    pub text: String,
    pub kv_format: String,
    pub ctx: usize,
    pub windows: usize,
    pub scored_tokens: usize,
    pub ppl: f64,
    /// All-in stored bits per K/V value of the format (kvfs header amortized).
    pub stored_bits: f64,
    pub seconds: f64,
}

/// Scores `tokens` in non-overlapping windows of `ctx`, each on its second half; calls
/// `progress(window, running_ppl)` after each window.
pub fn perplexity(
    l: &Loaded,
    tokens: &[u32],
    ctx: usize,
    max_windows: usize,
    mut progress: impl FnMut(usize, f64),
) -> anyhow::Result<(f64, usize, usize)> {
    if ctx < 4 || ctx > l.model.cfg.max_ctx {
        bail!(
            "--ctx must be between 4 and the model's context length {}",
            l.model.cfg.max_ctx
        );
    }
    let mut windows = tokens.len() / ctx;
    if windows == 0 {
        bail!(
            "the text has {} tokens, fewer than one window of {ctx}",
            tokens.len()
        );
    }
    if max_windows > 0 {
        windows = windows.min(max_windows);
    }
    let first = ctx / 2;
    let vocab = l.model.cfg.vocab;
    let (mut nll, mut count) = (0.0f64, 0usize);
    for w in 0..windows {
        let win = &tokens[w * ctx..(w + 1) * ctx];
        let mut cache = l.new_cache();
        // Logits of positions first..ctx-1 predict tokens first+1..ctx.
        let logits = l
            .model
            .forward(&mut cache, win, Logits::Tail(ctx - first))?;
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let pos = first + j;
            if pos + 1 >= ctx {
                break;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = row
                .iter()
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln()
                + max as f64;
            nll += lse - row[win[pos + 1] as usize] as f64;
            count += 1;
        }
        progress(w + 1, (nll / count as f64).exp());
    }
    Ok(((nll / count as f64).exp(), windows, count))
}

/// Runs `llms eval ppl`.
pub fn run_ppl(a: PplArgs) -> anyhow::Result<()> {
    if a.ctx < 4 {
        bail!("--ctx must be at least 4 tokens");
    }
    a.report.begin();
    let l = load(&a.engine)?;
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("cannot read {} as UTF-8 text", a.text.display()))?;
    let tokens = l.tokenizer.bos_windows(&l.tokenizer.encode(&text), a.ctx);
    let reference = match &a.kl_prefill {
        Some(kind) => {
            let opts = EngineOpts {
                prefill_activations: kind.clone(),
                ..a.engine.clone()
            };
            Some(load_path(&model_path(&opts)?, &opts)?.model)
        }
        None => None,
    };
    if !a.kv_mix.is_empty() || a.kl || a.decode || reference.is_some() {
        let mixes = match a.kv_mix.is_empty() {
            true => vec![l.format.to_string()],
            false => a.kv_mix.clone(),
        };
        let name = a.text.display().to_string();
        let run = crate::cmd::kv_mix::MixRun {
            text: &name,
            tokens: &tokens,
            ctx: a.ctx,
            max_windows: a.max_windows,
            kl: reference.as_ref().or(a.kl.then_some(&l.model)),
            scoring: match a.decode {
                true => model::kv::eval::Scoring::Decode,
                false => model::kv::eval::Scoring::Batched,
            },
        };
        return crate::cmd::kv_mix::run(&l, &run, &mixes, &a.report);
    }
    let t = Instant::now();
    eprint!(
        "perplexity of {} ({} tokens), ctx {}, kv {}:",
        a.text.display(),
        tokens.len(),
        a.ctx,
        l.format
    );
    let (ppl, windows, scored) = perplexity(&l, &tokens, a.ctx, a.max_windows, |w, p| {
        eprint!(" [{w}]{p:.4}");
    })?;
    eprintln!();
    let stored_bits = l.model.chunk_shape(l.chunk_tokens).stored_bits(l.format);
    let r = PplResult {
        text: a.text.display().to_string(),
        kv_format: l.format.to_string(),
        ctx: a.ctx,
        windows,
        scored_tokens: scored,
        ppl,
        stored_bits,
        seconds: t.elapsed().as_secs_f64(),
    };
    crate::report::table!(
        "kv {}: ppl {ppl:.4} at {stored_bits:.3} stored bits/value ({scored} tokens, {windows} windows of {})",
        r.kv_format,
        a.ctx
    );
    a.report.write("ppl", &r)?;
    Ok(())
}

/// The conversation of `llms chat`, local or through the daemon: `prompt` alone, or one message
/// per line of standard input (with a `> ` prompt on a terminal) until an empty line or EOF.
pub fn converse(
    prompt: Option<&str>,
    mut turn: impl FnMut(&str) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if let Some(p) = prompt {
        return turn(p);
    }
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    if interactive {
        eprintln!("llms chat: one message per line; an empty line or Ctrl-D ends the chat.");
    }
    loop {
        if interactive {
            eprint!("> ");
        }
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        turn(line.trim_end())?;
    }
}
