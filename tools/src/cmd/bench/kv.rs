//! `llms bench kv`: KV chunk codec speed and error per format, attention time per decode step
//! over packed chunks, and recompute throughput, on the real model; a table and JSON.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use model::kv::attention::{AttnShape, attend_gathered, attend_packed};
use model::kv::codec::{ChunkShape, KvFormat, decode_layer, encode_layer};
use model::kv::recompute::recompute_chunks;
use model::kv::{HeapChunks, KvCache};
use model::tokenizer::Tokenizer;
use model::{Logits, Model};
use serde::Serialize;
use strum::VariantArray;

use crate::args::ModelsDirArg;
use crate::report::table;

/// Where the model and the context's tokens come from, shared with `llms profile`.
#[derive(Args, Debug, Clone)]
pub struct ModelInput {
    #[command(flatten)]
    pub dir: ModelsDirArg,
    /// A known model's name (fetched if missing) or a GGUF file [default: smollm2-135m]
    #[arg(long, env = "LLMS_MODEL", value_name = "NAME|FILE")]
    pub model: Option<PathBuf>,
    /// Take the context's tokens from this text file (tokenized with the model's vocabulary)
    /// instead of a deterministic pseudo-random sequence.
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,
}

impl ModelInput {
    /// Loads the model (fetching the default one if needed).
    pub fn load(&self) -> anyhow::Result<Model> {
        let path = crate::args::resolve_model(self.model.as_deref(), &self.dir)?;
        let model =
            Model::load(&path).with_context(|| format!("cannot load {}", path.display()))?;
        // No timed run shares the cores with the copy of the weights into huge pages.
        model.settle_huge_pages();
        Ok(model)
    }

    /// `n` token ids: the text file's tokens repeated, or a pseudo-random sequence.
    pub fn tokens(&self, model: &Model, n: usize) -> anyhow::Result<Vec<u32>> {
        let Some(text) = &self.text else {
            let mut x = 0x2545_f491_4f6c_dd1du64;
            let vocab = model.cfg.vocab as u64;
            return Ok((0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % vocab) as u32
                })
                .collect());
        };
        let body = std::fs::read_to_string(text)
            .with_context(|| format!("cannot read {}", text.display()))?;
        let tok = Tokenizer::from_gguf_file(model.path())
            .with_context(|| format!("cannot build the tokenizer of {}", model.path().display()))?;
        let ids = tok.encode(&body);
        anyhow::ensure!(!ids.is_empty(), "{} has no tokens", text.display());
        Ok(ids.iter().copied().cycle().take(n).collect())
    }
}

/// A cache of `tokens` prefilled by the model in `format`, in chunks of `chunk` tokens.
pub fn prefilled(
    model: &Model,
    tokens: &[u32],
    format: KvFormat,
    chunk: usize,
) -> anyhow::Result<KvCache> {
    let mut c = KvCache::new(
        model.chunk_shape(chunk),
        format,
        tokens.len().max(16),
        Box::new(HeapChunks::default()),
    );
    model
        .forward(&mut c, tokens, Logits::Last)
        .context("prefill failed")?;
    Ok(c)
}

/// Median wall time of `f` over `reps` runs, in seconds.
pub fn median_secs(reps: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    Ok(uffd_pager::median(t))
}

#[derive(Args, Debug)]
pub struct KvArgs {
    #[command(flatten)]
    pub input: ModelInput,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Context lengths in tokens for the attention timings (1 to 65536).
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192", value_parser = crate::report::positive)]
    pub contexts: Vec<usize>,
    /// Chunk counts for the recompute timings (their context, 16 tokens a chunk plus one chunk,
    /// must fit the model's context).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64", value_parser = crate::report::positive)]
    pub recompute: Vec<usize>,
    /// Repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = crate::report::positive)]
    pub reps: usize,
}

/// The longest context `llms bench kv` times attention at (its KV is held in memory).
const MAX_BENCH_CONTEXT: usize = 1 << 16;

#[derive(Serialize)]
struct CodecRow {
    format: KvFormat,
    encode_gbps: f64,
    decode_gbps: f64,
    key_rel_rms: f64,
    value_rel_rms: f64,
    bits_with_params: f64,
    slot_bytes: usize,
}

#[derive(Serialize)]
struct AttnRow {
    format: KvFormat,
    context: usize,
    packed_ms: f64,
    gathered_ms: f64,
}

#[derive(Serialize)]
struct RecomputeRow {
    chunks: usize,
    context: usize,
    seconds: f64,
    tokens_per_sec: f64,
}

#[derive(Serialize)]
struct Report {
    model: String,
    threads: usize,
    /// The attention kernels the timings ran on (`model::chosen`, within `LLMS_ISA`).
    chosen_kernels: Vec<model::chosen::Chosen>,
    codec: Vec<CodecRow>,
    attention: Vec<AttnRow>,
    recompute: Vec<RecomputeRow>,
}

/// Real K/V of every layer of the first chunks of a prefilled f16 context, as f32 sections.
fn real_layers(c: &KvCache, chunks: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let s = *c.shape();
    let mut out = Vec::new();
    for i in 0..chunks.min(c.chunk_formats().len()) {
        let Some(bytes) = c.chunk_bytes(i) else {
            continue;
        };
        let lb = s.layer_bytes(KvFormat::F16);
        for l in 0..s.n_layers {
            let (mut k, mut v) = (vec![0.0; s.section()], vec![0.0; s.section()]);
            decode_layer(
                &s,
                KvFormat::F16,
                &bytes[l * lb..(l + 1) * lb],
                &mut k,
                &mut v,
            );
            out.push((k, v));
        }
    }
    out
}

fn rel_rms(a: &[f32], b: &[f32]) -> (f64, f64) {
    let e: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let s: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    (e, s)
}

fn codec_rows(s: &ChunkShape, layers: &[(Vec<f32>, Vec<f32>)]) -> anyhow::Result<Vec<CodecRow>> {
    let mut rows = Vec::new();
    let f32_bytes = (layers.len() * 2 * s.section() * 4) as f64;
    for &f in KvFormat::VARIANTS {
        let lb = s.layer_bytes(f);
        let mut enc = vec![0u8; lb * layers.len()];
        let t = Instant::now();
        for (i, (k, v)) in layers.iter().enumerate() {
            encode_layer(s, f, k, v, &mut enc[i * lb..(i + 1) * lb])
                .with_context(|| format!("cannot encode a real layer in {f}"))?;
        }
        let enc_s = t.elapsed().as_secs_f64();
        let (mut dk, mut dv) = (vec![0.0; s.section()], vec![0.0; s.section()]);
        let (mut ke, mut ks, mut ve, mut vs) = (0.0, 0.0, 0.0, 0.0);
        let mut dec_s = 0.0;
        for (i, (k, v)) in layers.iter().enumerate() {
            let t = Instant::now();
            decode_layer(s, f, &enc[i * lb..(i + 1) * lb], &mut dk, &mut dv);
            dec_s += t.elapsed().as_secs_f64();
            let (e, n) = rel_rms(k, &dk);
            (ke, ks) = (ke + e, ks + n);
            let (e, n) = rel_rms(v, &dv);
            (ve, vs) = (ve + e, vs + n);
        }
        rows.push(CodecRow {
            format: f,
            encode_gbps: f32_bytes / enc_s / 1e9,
            decode_gbps: f32_bytes / dec_s / 1e9,
            key_rel_rms: (ke / ks).sqrt(),
            value_rel_rms: (ve / vs).sqrt(),
            bits_with_params: (lb * 8) as f64 / (2 * s.section()) as f64,
            slot_bytes: s.slot_bytes(f),
        });
    }
    Ok(rows)
}

/// A cache of `len` tokens in `format` whose chunks repeat the real chunks' K/V.
fn synthetic(
    s: ChunkShape,
    format: KvFormat,
    len: usize,
    real: &[(Vec<f32>, Vec<f32>)],
) -> anyhow::Result<KvCache> {
    let mut c = KvCache::new(s, format, len, Box::new(HeapChunks::default()));
    c.reserve(len)?;
    let row = s.n_kv_heads * s.head_dim;
    let (mut k, mut v) = (vec![0.0; row], vec![0.0; row]);
    let per_chunk = real.len() / s.n_layers;
    for p in 0..len {
        let src = (p / s.tokens) % per_chunk.max(1);
        for l in 0..s.n_layers {
            let (rk, rv) = &real[src * s.n_layers + l];
            for h in 0..s.n_kv_heads {
                let o = h * s.block() + (p % s.tokens) * s.head_dim;
                k[h * s.head_dim..(h + 1) * s.head_dim].copy_from_slice(&rk[o..o + s.head_dim]);
                v[h * s.head_dim..(h + 1) * s.head_dim].copy_from_slice(&rv[o..o + s.head_dim]);
            }
            c.write(l, p, &k, &v);
        }
    }
    c.commit(&vec![0; len])?;
    Ok(c)
}

/// Runs `llms bench kv`: the codecs on real K/V of a prefilled context, attention per decode
/// step at each context length and format, and recompute of some chunks of an int8 context;
/// the tables, then JSON.
pub fn run(args: KvArgs) -> anyhow::Result<()> {
    if let Some(n) = args.contexts.iter().find(|&&n| n > MAX_BENCH_CONTEXT) {
        anyhow::bail!("--contexts {n} is longer than {MAX_BENCH_CONTEXT} tokens");
    }
    args.report.begin();
    let model = args.input.load()?;
    let chosen_kernels = model::chosen::attention();
    for c in &chosen_kernels {
        eprintln!("  kernel: {}: {}", c.product, c.kernel);
    }
    let s = model.chunk_shape(16);
    let most = args.recompute.iter().copied().max().unwrap_or(1);
    anyhow::ensure!(
        most.saturating_mul(16).saturating_add(16) <= model.cfg.max_ctx,
        "--recompute {most} needs a context of {} tokens, longer than the model's {}",
        most.saturating_mul(16).saturating_add(16),
        model.cfg.max_ctx
    );
    eprintln!("prefilling 256 tokens for real K/V");
    let tokens = args.input.tokens(&model, 257)?;
    let base = prefilled(&model, &tokens[..256], KvFormat::F16, 16)?;
    let real = real_layers(&base, 16);
    let codec = codec_rows(&s, &real)?;
    let attention = attention_rows(&model, &args, &real)?;
    let ctx_len = most * 16 + 16;
    let recompute = recompute_rows(&model, &args, ctx_len)?;
    codec_table(&codec, real.len() / s.n_layers, s.n_layers);
    attention_table(&attention, s.n_layers);
    recompute_table(&recompute, ctx_len);
    let report = Report {
        model: model.path().display().to_string(),
        threads: model::kernels::threads(),
        chosen_kernels,
        codec,
        attention,
        recompute,
    };
    args.report.write("kv", &report)?;
    Ok(())
}

/// Attention of one decode step over every layer, packed and gathered, for each context
/// length and format: caches whose chunks repeat the `real` K/V, the median of --reps.
fn attention_rows(
    model: &Model,
    args: &KvArgs,
    real: &[(Vec<f32>, Vec<f32>)],
) -> anyhow::Result<Vec<AttnRow>> {
    let s = model.chunk_shape(16);
    let cfg = &model.cfg;
    let shape = AttnShape {
        n_heads: cfg.n_heads,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        window: None,
    };
    let qd = cfg.n_heads * cfg.head_dim;
    let q: Vec<f32> = (0..qd)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let mut out = vec![0.0; qd];
    let mut attention = Vec::new();
    for &len in &args.contexts {
        for &f in KvFormat::VARIANTS {
            let mut c = synthetic(s, f, len, real)?;
            let mut step = |packed: bool| {
                median_secs(args.reps, || {
                    for l in 0..s.n_layers {
                        if packed {
                            attend_packed(&mut c, l, shape, &q, len - 1, 1, &mut out)?;
                        } else {
                            attend_gathered(&mut c, l, shape, &q, len - 1, 1, &mut out)?;
                        }
                    }
                    Ok(())
                })
            };
            let packed = step(true)?;
            let gathered = step(false)?;
            attention.push(AttnRow {
                format: f,
                context: len,
                packed_ms: packed * 1e3,
                gathered_ms: gathered * 1e3,
            });
        }
    }
    Ok(attention)
}

/// Recompute of each --recompute count of chunks, spread over an int8 context of `ctx_len`
/// tokens, the last chunk included; the median of at most 3 runs.
fn recompute_rows(
    model: &Model,
    args: &KvArgs,
    ctx_len: usize,
) -> anyhow::Result<Vec<RecomputeRow>> {
    let mut recompute = Vec::new();
    eprintln!("prefilling {ctx_len} tokens for recompute");
    let tokens = args.input.tokens(model, ctx_len)?;
    let mut c = prefilled(model, &tokens, KvFormat::Int8, 16)?;
    let sealed = c.chunk_formats().len();
    for &x in &args.recompute {
        let x = x.min(sealed);
        // Spread the chunks over the context, the last one included.
        let set: Vec<usize> = (0..x).map(|i| sealed - 1 - i * sealed / x.max(1)).collect();
        let secs = median_secs(args.reps.min(3), || {
            for &i in &set {
                c.reclaim(i)?;
            }
            recompute_chunks(model, &mut c, &set)?;
            Ok(())
        })?;
        recompute.push(RecomputeRow {
            chunks: x,
            context: ctx_len,
            seconds: secs,
            tokens_per_sec: (x * 16) as f64 / secs,
        });
    }
    Ok(recompute)
}

/// The codec table: real K/V of `chunks` chunks of `n_layers` layers each.
fn codec_table(codec: &[CodecRow], chunks: usize, n_layers: usize) {
    table!("codec (real K/V of {chunks} chunks x {n_layers} layers)");
    table!(
        "{:<6} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "format",
        "enc GB/s",
        "dec GB/s",
        "K rel rms",
        "V rel rms",
        "bits",
        "slot KB"
    );
    for r in codec {
        table!(
            "{:<6} {:>10.2} {:>10.2} {:>10.5} {:>10.5} {:>8.2} {:>8}",
            r.format.name(),
            r.encode_gbps,
            r.decode_gbps,
            r.key_rel_rms,
            r.value_rel_rms,
            r.bits_with_params,
            r.slot_bytes / 1024
        );
    }
}

/// The attention table: ms per decode step over `n_layers` layers.
fn attention_table(attention: &[AttnRow], n_layers: usize) {
    table!("\nattention per decode step ({n_layers} layers, ms)");
    table!(
        "{:<6} {:>8} {:>10} {:>12}",
        "format",
        "context",
        "packed",
        "gathered"
    );
    for r in attention {
        table!(
            "{:<6} {:>8} {:>10.3} {:>12.3}",
            r.format.name(),
            r.context,
            r.packed_ms,
            r.gathered_ms
        );
    }
}

/// The recompute table, over an int8 context of `ctx_len` tokens.
fn recompute_table(recompute: &[RecomputeRow], ctx_len: usize) {
    table!("\nrecompute (int8 context of {ctx_len} tokens)");
    table!("{:>7} {:>10} {:>10}", "chunks", "seconds", "tokens/s");
    for r in recompute {
        table!(
            "{:>7} {:>10.3} {:>10.1}",
            r.chunks,
            r.seconds,
            r.tokens_per_sec
        );
    }
}
