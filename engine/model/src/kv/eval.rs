//! Perplexity of real text with the KV cache compressed by format or by the tolerance-aware mix
//! (paper Fig. 6 and 12): how much each KV format and each mix of levels costs in fidelity.
//!
//! The text is cut into windows. In each window the first half is prefilled (sealed in int8, or
//! f16 for the f16 reference), its chunks are compressed as asked, then the second half is run
//! with the model predicting each next token from the compressed context; the perplexity is
//! over those predictions. Chunks of a mix get their levels by density rank, from the attention
//! the prefill recorded (paper Eq. 1), through the policy crate. On a model with sliding-window
//! layers the chunks past the window (their global layers alone) and the others are two groups,
//! each ranked by its own layers' densities and held to the budget apart, as the service does
//! (`policy::GroupDensity`, `policy::assign_levels_grouped`).

use crate::kv::codec::{ChunkShape, decode_layer, encode_layer};
use crate::kv::received::group_density;
use crate::kv::sim::{RopeSpec, SimFormat};
use crate::kv::{HeapChunks, KvCache, KvError, KvFormat};
use crate::{Logits, Model, ModelError};
use policy::{Level, LevelSet, assign_levels_grouped};

/// What went wrong measuring perplexity.
#[derive(Debug, thiserror::Error)]
pub enum EvalMixError {
    /// The text is too short for one window.
    #[error("the text has {tokens} tokens, fewer than one window of {window}")]
    TooShort { tokens: usize, window: usize },
    /// A window shorter than two chunks, or not a multiple of the chunk size.
    #[error("window {window} must be a multiple of 2 x {chunk} tokens")]
    BadWindow { window: usize, chunk: usize },
    /// Mix fractions that are negative or do not sum to 1.
    #[error("mix fractions {fractions:?} must be non-negative and sum to 1")]
    BadMix { fractions: [f64; 3] },
    /// A bit budget below the lightest level's all-in bits, or levels not lightest last.
    #[error(
        "budget {budget} bits/value is below the lightest level's {lightest}, or levels are not heaviest first"
    )]
    BadBudget { budget: f64, lightest: f64 },
    /// A simulated format that does not fit the model's heads.
    #[error("simulated format {format} does not fit head dimension {head_dim}")]
    BadSim { format: SimFormat, head_dim: usize },
    /// The policy refused the densities or the ratio.
    #[error("level assignment failed: {0}")]
    Policy(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The cache refused a recompression.
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// How one chunk is stored: a real format, or a candidate simulated in f16 ([`crate::kv::sim`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stored {
    Real(KvFormat),
    Sim(SimFormat),
}

impl Stored {
    /// All-in stored bits per value of a chunk of `shape`.
    pub fn stored_bits(self, shape: &ChunkShape) -> f64 {
        match self {
            Stored::Real(f) => shape.stored_bits(f),
            Stored::Sim(f) => f.stored_bits(shape),
        }
    }

    /// Nominal payload bits per value.
    pub fn bits(self) -> f64 {
        match self {
            Stored::Real(f) => f.bits(),
            Stored::Sim(f) => f64::from(f.key_bits + f.value_bits) / 2.0,
        }
    }
}

impl std::fmt::Display for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stored::Real(x) => write!(f, "{x}"),
            Stored::Sim(x) => write!(f, "{x}"),
        }
    }
}

/// The most levels a [`Compression::Budget`] mix has.
pub const MAX_MIX_LEVELS: usize = 4;

/// How the context's chunks are compressed before the continuation is scored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compression {
    /// Every chunk in one format.
    Uniform(KvFormat),
    /// Every chunk in one simulated candidate format.
    Sim(SimFormat),
    /// Fractions of chunks at int8, int4 and int2, the densest chunks kept heaviest.
    Fractions([f64; 3]),
    /// The policy's assignment (Eq. 2-3) under this global ratio to int8 (0.5: half the bits).
    Ratio(f64),
    /// The tolerance-aware mix under an all-in budget: levels (heaviest first, the first
    /// `Some`s) assigned by density rank to keep the most information (Eq. 2-3, each level's
    /// ratio being its all-in bits over the heaviest's) with the mean all-in stored bits per
    /// value at most `bits` ([`levels_for_budget`]).
    Budget {
        levels: [Option<Stored>; MAX_MIX_LEVELS],
        bits: f64,
    },
}

impl Compression {
    fn base(self) -> KvFormat {
        match self {
            Compression::Uniform(KvFormat::F16) => KvFormat::F16,
            _ => KvFormat::Int8,
        }
    }
}

/// Each chunk's level (an index into `bits`, heaviest first) so that the chunks keep the most
/// information `sum (bits_w / bits_0) D_i` while the mean of their levels' bits stays at most
/// `budget`; levels follow density rank (densest heaviest, ties by chunk order), exactly over all
/// rank thresholds.
pub fn levels_for_budget(
    densities: &[f64],
    bits: &[f64],
    budget: f64,
) -> Result<Vec<usize>, EvalMixError> {
    let lightest = bits.last().copied().unwrap_or(f64::INFINITY);
    if bits.is_empty() || lightest > budget || bits.windows(2).any(|w| w[0] < w[1]) {
        return Err(EvalMixError::BadBudget { budget, lightest });
    }
    let n = densities.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| densities[b].total_cmp(&densities[a]).then(a.cmp(&b)));
    let mut prefix = vec![0.0; n + 1];
    for (r, &i) in order.iter().enumerate() {
        prefix[r + 1] = prefix[r] + densities[i];
    }
    let cap = budget * n as f64 + 1e-9;
    // Thresholds t_0 <= .. <= t_{k-2}: ranks below t_0 at level 0, and so on; the last level
    // takes the rest. Enumerated exactly (k <= 4, n a few hundred at most).
    let mut best: Option<(f64, Vec<usize>)> = None;
    let mut t = vec![0usize; bits.len() - 1];
    fn walk(
        w: usize,
        from: usize,
        t: &mut Vec<usize>,
        bits: &[f64],
        prefix: &[f64],
        cap: f64,
        best: &mut Option<(f64, Vec<usize>)>,
    ) {
        let n = prefix.len() - 1;
        if w == t.len() {
            let (mut cost, mut info, mut prev) = (0.0, 0.0, 0);
            for (l, &b) in bits.iter().enumerate() {
                let end = if l < t.len() { t[l] } else { n };
                cost += b * (end - prev) as f64;
                info += b / bits[0] * (prefix[end] - prefix[prev]);
                prev = end;
            }
            if cost <= cap && best.as_ref().is_none_or(|(i, _)| info > *i) {
                *best = Some((info, t.clone()));
            }
            return;
        }
        for x in from..=n {
            t[w] = x;
            walk(w + 1, x, t, bits, prefix, cap, best);
        }
    }
    walk(0, 0, &mut t, bits, &prefix, cap, &mut best);
    let t = best.map(|(_, t)| t).unwrap_or_default();
    let mut levels = vec![bits.len() - 1; n];
    for (r, &i) in order.iter().enumerate() {
        levels[i] = t.iter().position(|&x| r < x).unwrap_or(bits.len() - 1);
    }
    Ok(levels)
}

/// Replaces sealed chunk `index` (in the cache's base format) by its values as `f` would store
/// them, kept in f16.
fn simulate(
    cache: &mut KvCache,
    index: usize,
    f: SimFormat,
    rope: RopeSpec,
) -> Result<(), KvError> {
    // Past the window a chunk keeps its global layers alone; each layer is treated alike.
    let s = cache.shape_of(index);
    let from = cache.chunk_formats()[index];
    let bytes = cache
        .chunk_bytes(index)
        .ok_or(KvError::NotResident { index })?
        .to_vec();
    let (lf, lt) = (s.layer_bytes(from), s.layer_bytes(KvFormat::F16));
    let mut out = vec![0u8; s.chunk_bytes(KvFormat::F16)];
    let (mut k, mut v) = (vec![0.0; s.section()], vec![0.0; s.section()]);
    for l in 0..s.n_layers {
        decode_layer(&s, from, &bytes[l * lf..(l + 1) * lf], &mut k, &mut v);
        f.apply(&s, rope, index * s.tokens, &mut k, &mut v);
        encode_layer(&s, KvFormat::F16, &k, &v, &mut out[l * lt..(l + 1) * lt])
            .map_err(|source| KvError::Codec { index, source })?;
    }
    cache.reclaim(index)?;
    cache.restore(index, KvFormat::F16, &out)
}

/// The outcome of [`perplexity`] for one compression.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct PplReport {
    /// Tokens scored.
    pub tokens: usize,
    /// exp of the mean negative log-likelihood.
    pub ppl: f64,
    /// Nominal bits per K/V value of the compressed context chunks (payload only).
    pub bits_per_value: f64,
    /// All-in stored bits per K/V value of the compressed context chunks: payload, scales,
    /// minimums and kvfs's chunk header amortized ([`crate::kv::codec::ChunkShape::stored_bits`]),
    /// over the values the chunks hold (a chunk past the sliding window holds its global layers
    /// alone).
    pub stored_bits: f64,
    /// Mean KL divergence `KL(p_f16 || p)` in nats of each scored token's next-token
    /// distribution from the f16 run's, when asked for.
    pub kl: Option<f64>,
    /// Share of scored tokens whose most likely next token is the f16 run's, when asked for.
    pub top1: Option<f64>,
}

/// The level of each chunk when `fractions` (int8, int4, int2) of them go to each level by
/// density rank, densest first; rounding gives leftover chunks to the lightest level.
pub fn levels_by_fractions(densities: &[f64], fractions: [f64; 3]) -> Vec<Level> {
    let n = densities.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| densities[b].total_cmp(&densities[a]).then(a.cmp(&b)));
    let n8 = (fractions[0] * n as f64).round() as usize;
    let n4 = ((fractions[0] + fractions[1]) * n as f64).round() as usize;
    let mut levels = vec![Level(0); n];
    for (rank, &i) in order.iter().enumerate() {
        levels[i] = Level(if rank < n8 {
            0
        } else if rank < n4 {
            1
        } else {
            2
        });
    }
    levels
}

const LEVEL_FORMATS: [KvFormat; 3] = [KvFormat::Int8, KvFormat::Int4, KvFormat::Int2];

/// How the second half of each window is run: in one batched pass (prefill's attention over
/// the chunks gathered), or token by token through decode attention over the chunks as stored
/// (what a call's answer takes), which scores the decode kernels themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    Batched,
    Decode,
}

impl Scoring {
    /// The name reports give it: `batched` or `decode`.
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Batched => "batched",
            Scoring::Decode => "decode",
        }
    }
}

/// Perplexity of `tokens` in windows of `window` tokens, the KV cache in chunks of `chunk`
/// tokens, under `compression` (see module doc).
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    compression: Compression,
    window: usize,
    chunk: usize,
) -> Result<PplReport, EvalMixError> {
    let r = evaluate(
        model,
        tokens,
        &[compression],
        window,
        chunk,
        None,
        Scoring::Batched,
    )?;
    Ok(r[0])
}

/// Running sums of one compression's scores.
#[derive(Default)]
struct Sums {
    nll: f64,
    kl: f64,
    top1: usize,
    scored: usize,
    bits: f64,
    stored: f64,
    /// Layers of the chunks compressed (each chunk's layers hold the same number of values).
    values: f64,
}

/// `log_softmax(row)` into `out`; returns the log-sum-exp (summed in f64).
fn log_softmax(row: &[f32], out: &mut [f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = row
        .iter()
        .map(|&x| f64::from(x - max).exp())
        .sum::<f64>()
        .ln()
        + f64::from(max);
    for (o, &x) in out.iter_mut().zip(row) {
        *o = (f64::from(x) - lse) as f32;
    }
    lse
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0
}

/// Perplexity of `tokens` under each of `compressions` (see module doc), window by window, the
/// KV cache in chunks of `chunk` tokens (a window holds a whole number of chunk pairs); with
/// `kl`, also each one's KL divergence from, and top-1 agreement with, the next-token
/// distributions of that model's f16 run (llama.cpp's `llama-perplexity --kl-divergence`),
/// made once per window. The reference model is `model` itself, or the same weights run
/// another way (f32 prefill activations, to measure what int8 ones cost). `scoring` says how
/// the scored halves are run (the reference's too).
pub fn evaluate(
    model: &Model,
    tokens: &[u32],
    compressions: &[Compression],
    window: usize,
    chunk: usize,
    kl: Option<&Model>,
    scoring: Scoring,
) -> Result<Vec<PplReport>, EvalMixError> {
    check_inputs(model, tokens, compressions, window, chunk)?;
    let shape = model.chunk_shape(chunk);
    let vocab = model.cfg.vocab;
    let mut sums: Vec<Sums> = compressions.iter().map(|_| Sums::default()).collect();
    let reference = Compression::Uniform(KvFormat::F16);
    let mut lp = vec![0f32; vocab];
    for w in tokens.chunks_exact(window) {
        let (ctx, rest) = w.split_at(window / 2);
        // The f16 run's log-probabilities and top tokens, one row per scored token.
        let mut ref_rows: Vec<f32> = Vec::new();
        let mut ref_top: Vec<usize> = Vec::new();
        if let Some(reference_model) = kl {
            let (logits, _, _) = run_window(
                reference_model,
                ctx,
                rest,
                reference,
                window,
                chunk,
                scoring,
            )?;
            ref_rows.resize(logits.len(), 0.0);
            for (row, out) in logits
                .chunks_exact(vocab)
                .zip(ref_rows.chunks_exact_mut(vocab))
            {
                log_softmax(row, out);
                ref_top.push(argmax(row));
            }
        }
        for (c, s) in compressions.iter().zip(&mut sums) {
            let (logits, targets, past) = run_window(model, ctx, rest, *c, window, chunk, scoring)?;
            // Per value: a chunk past the window holds its global layers alone.
            for (i, f) in targets.into_iter().enumerate() {
                let s_i = if i < past { shape.trimmed() } else { shape };
                let values = s_i.n_layers as f64;
                s.bits += f.bits() * values;
                s.stored += f.stored_bits(&s_i) * values;
                s.values += values;
            }
            for (i, (row, &next)) in logits.chunks_exact(vocab).zip(&rest[1..]).enumerate() {
                let lse = log_softmax(row, &mut lp);
                s.nll += lse - f64::from(row[next as usize]);
                s.scored += 1;
                if kl.is_some() {
                    let r = &ref_rows[i * vocab..(i + 1) * vocab];
                    s.kl += r
                        .iter()
                        .zip(&lp)
                        .map(|(&p, &q)| f64::from(p).exp() * f64::from(p - q))
                        .sum::<f64>();
                    s.top1 += usize::from(argmax(row) == ref_top[i]);
                }
            }
        }
    }
    Ok(sums
        .iter()
        .map(|s| {
            let n = s.scored.max(1) as f64;
            PplReport {
                tokens: s.scored,
                ppl: (s.nll / n).exp(),
                bits_per_value: s.bits / s.values.max(1.0),
                stored_bits: s.stored / s.values.max(1.0),
                kl: kl.map(|_| s.kl / n),
                top1: kl.map(|_| s.top1 as f64 / n),
            }
        })
        .collect())
}

/// Checks `evaluate`'s inputs: a window of whole chunk pairs, enough tokens, mixes that sum to
/// one, simulated formats the model's heads fit.
fn check_inputs(
    model: &Model,
    tokens: &[u32],
    compressions: &[Compression],
    window: usize,
    chunk: usize,
) -> Result<(), EvalMixError> {
    if window < 2 * chunk || !window.is_multiple_of(2 * chunk) {
        return Err(EvalMixError::BadWindow { window, chunk });
    }
    if tokens.len() < window {
        return Err(EvalMixError::TooShort {
            tokens: tokens.len(),
            window,
        });
    }
    for c in compressions {
        if let Compression::Fractions(f) = *c
            && (f.iter().any(|x| !x.is_finite() || *x < 0.0)
                || (f.iter().sum::<f64>() - 1.0).abs() > 1e-6)
        {
            return Err(EvalMixError::BadMix { fractions: f });
        }
    }
    let shape = model.chunk_shape(chunk);
    for c in compressions {
        let sims = match c {
            Compression::Sim(f) => vec![*f],
            Compression::Budget { levels, .. } => levels
                .iter()
                .filter_map(|l| match l {
                    Some(Stored::Sim(f)) => Some(*f),
                    _ => None,
                })
                .collect(),
            _ => vec![],
        };
        if let Some(f) = sims.into_iter().find(|f| !f.fits(&shape)) {
            return Err(EvalMixError::BadSim {
                format: f,
                head_dim: shape.head_dim,
            });
        }
    }
    Ok(())
}

/// Prefills `ctx`, compresses its chunks as `compression` says, and returns the logits of every
/// token of `rest` but the last (each predicting the next), the formats the chunks got and how
/// many of the first chunks were past the sliding window (their global layers alone).
fn run_window(
    model: &Model,
    ctx: &[u32],
    rest: &[u32],
    compression: Compression,
    window: usize,
    chunk: usize,
    scoring: Scoring,
) -> Result<(Vec<f32>, Vec<Stored>, usize), EvalMixError> {
    let shape = model.chunk_shape(chunk);
    let heads = model.cfg.n_heads as u32;
    let mut cache = KvCache::new(
        shape,
        compression.base(),
        window,
        Box::new(HeapChunks::default()),
    );
    model.forward(&mut cache, ctx, Logits::Last)?;
    let n = cache.chunk_formats().len();
    // Chunks `..past` are past the sliding window: their own group (see the module comment).
    let past = cache.trimmed_chunks().min(n);
    let policy_err = |e: &dyn std::fmt::Display| EvalMixError::Policy(e.to_string());
    let densities = || {
        let mut d = group_density(&shape, heads).map_err(|e| policy_err(&e))?;
        let a = cache.attention(heads);
        d.merge(&a.all, a.global.as_deref())
            .map_err(|e| policy_err(&e))?;
        let mut d = d.chunk_densities(past);
        d.truncate(n);
        Ok::<_, EvalMixError>(d)
    };
    let formats = |levels: &[Level]| -> Vec<Stored> {
        levels
            .iter()
            .map(|l| Stored::Real(LEVEL_FORMATS[l.0 as usize]))
            .collect()
    };
    let targets: Vec<Stored> = match compression {
        Compression::Uniform(f) => vec![Stored::Real(f); n],
        Compression::Sim(f) => vec![Stored::Sim(f); n],
        Compression::Budget { levels, bits } => {
            let levels: Vec<Stored> = levels.iter().map_while(|l| *l).collect();
            let d = densities()?;
            let mut got = Vec::with_capacity(n);
            for (range, s) in [(0..past, shape.trimmed()), (past..n, shape)] {
                if range.is_empty() {
                    continue;
                }
                let b: Vec<f64> = levels.iter().map(|l| l.stored_bits(&s)).collect();
                got.extend(levels_for_budget(&d[range], &b, bits)?);
            }
            got.iter().map(|&l| levels[l]).collect()
        }
        Compression::Fractions(f) => {
            let d = densities()?;
            let mut got = levels_by_fractions(&d[..past], f);
            got.extend(levels_by_fractions(&d[past..], f));
            formats(&got)
        }
        Compression::Ratio(r) => {
            let d = densities()?;
            let got = assign_levels_grouped(&d, past, None, &LevelSet::paper_default(), r)
                .map_err(|e| policy_err(&e))?;
            formats(&got)
        }
    };
    let rope = RopeSpec {
        rope_dim: model.cfg.rope_dim,
        base: model.cfg.rope_base,
    };
    for (i, &f) in targets.iter().enumerate() {
        match f {
            Stored::Real(f) if f != compression.base() => cache.recompress(i, f)?,
            Stored::Real(_) => {}
            Stored::Sim(f) => simulate(&mut cache, i, f, rope)?,
        }
    }
    let scored = &rest[..rest.len() - 1];
    let logits = match scoring {
        Scoring::Batched => model.forward(&mut cache, scored, Logits::All)?,
        Scoring::Decode => {
            let mut all = Vec::with_capacity(scored.len() * model.cfg.vocab);
            for &t in scored {
                all.extend(model.forward(&mut cache, &[t], Logits::Last)?);
            }
            all
        }
    };
    Ok((logits, targets, past))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::{TinySpec, write_tiny_gguf};

    /// Scoring token by token through decode attention gives the batched pass's perplexity
    /// (the same products, summed in another order), over f16, int8 and coded chunks; and it
    /// runs the decode path: its logits are not the batched pass's bit for bit.
    #[test]
    fn decode_scoring_matches_the_batched_pass() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &TinySpec::default()).unwrap();
        let model = Model::load(&path).unwrap();
        let tokens: Vec<u32> = (0..256u32).map(|i| (i * 97 + 13) % 256).collect();
        let formats = [
            KvFormat::F16,
            KvFormat::Int8,
            KvFormat::K4v4,
            KvFormat::K4v3,
        ];
        let compressions: Vec<Compression> =
            formats.iter().map(|&f| Compression::Uniform(f)).collect();
        let run = |s| evaluate(&model, &tokens, &compressions, 128, 16, None, s).unwrap();
        let (batched, decode) = (run(Scoring::Batched), run(Scoring::Decode));
        for ((f, b), d) in formats.iter().zip(&batched).zip(&decode) {
            assert_eq!(b.tokens, d.tokens);
            assert!(
                (d.ppl / b.ppl - 1.0).abs() < 1e-3,
                "{f}: decode {d:?} against batched {b:?}"
            );
        }
        let (ctx, rest) = tokens[..128].split_at(64);
        let f16 = Compression::Uniform(KvFormat::F16);
        let (lb, _, _) = run_window(&model, ctx, rest, f16, 128, 16, Scoring::Batched).unwrap();
        let (ld, _, _) = run_window(&model, ctx, rest, f16, 128, 16, Scoring::Decode).unwrap();
        assert_eq!(lb.len(), ld.len());
        assert_ne!(lb, ld, "decode scoring ran the batched pass");
    }

    #[test]
    fn perplexity_under_formats_and_mixes_on_the_tiny_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &TinySpec::default()).unwrap();
        let model = Model::load(&path).unwrap();
        let tokens: Vec<u32> = (0..256u32).map(|i| (i * 97 + 13) % 256).collect();
        let ppl = |c| perplexity(&model, &tokens, c, 128, 16).unwrap();
        let f16 = ppl(Compression::Uniform(KvFormat::F16));
        let int8 = ppl(Compression::Uniform(KvFormat::Int8));
        let int2 = ppl(Compression::Uniform(KvFormat::Int2));
        assert_eq!(f16.tokens, 2 * 63);
        assert!(f16.ppl.is_finite() && f16.ppl > 1.0, "{f16:?}");
        assert_eq!(
            (f16.bits_per_value, int8.bits_per_value, int2.bits_per_value),
            (16.0, 8.0, 2.0)
        );
        assert!(int2.stored_bits > 2.0 && int2.stored_bits < int8.stored_bits);
        assert_eq!(
            int8.stored_bits,
            model.chunk_shape(16).stored_bits(KvFormat::Int8)
        );
        // Against the f16 run itself: no divergence, every top token the same.
        let kl = evaluate(
            &model,
            &tokens,
            &[
                Compression::Uniform(KvFormat::F16),
                Compression::Uniform(KvFormat::Int2),
            ],
            128,
            16,
            Some(&model),
            Scoring::Batched,
        )
        .unwrap();
        assert_eq!((kl[0].kl, kl[0].top1), (Some(0.0), Some(1.0)));
        assert_eq!(kl[0].ppl, f16.ppl);
        let (d, t) = (kl[1].kl.unwrap(), kl[1].top1.unwrap());
        assert!(
            d > 0.0 && d.is_finite() && (0.0..=1.0).contains(&t),
            "{:?}",
            kl[1]
        );
        assert_eq!(kl[1].ppl, int2.ppl);
        // A simulated candidate with int4's parameters costs int4's bytes; a budget mix stays
        // within its budget and, given int8's bits, is the int8 run.
        let sim: SimFormat = "k4+v4".parse().unwrap();
        let int4 = ppl(Compression::Uniform(KvFormat::Int4));
        let s4 = ppl(Compression::Sim(sim));
        assert_eq!(s4.stored_bits, int4.stored_bits);
        assert!((s4.ppl / int4.ppl - 1.0).abs() < 0.01, "{s4:?} {int4:?}");
        let levels = [
            Some(Stored::Real(KvFormat::Int8)),
            Some(Stored::Sim(sim)),
            Some(Stored::Real(KvFormat::Int2)),
            None,
        ];
        let mix = ppl(Compression::Budget { levels, bits: 4.5 });
        assert!(mix.stored_bits <= 4.5, "{mix:?}");
        let all8 = ppl(Compression::Budget { levels, bits: 11.0 });
        assert_eq!(all8, int8);
        // The coded formats store what their simulations counted and score about the same
        // (they differ only in amax rounded up to f16 and the minimum's lowest code).
        for (real, sim) in [
            (KvFormat::K8v8, "k8+v8+kc8+vc8"),
            (KvFormat::K4v4, "k4+v4+kc8+vc8"),
            (KvFormat::K4v3, "k4+v3+kc8+vc8"),
        ] {
            let r = ppl(Compression::Uniform(real));
            let s = ppl(Compression::Sim(sim.parse().unwrap()));
            assert_eq!(r.stored_bits, s.stored_bits, "{real}");
            assert!((r.ppl / s.ppl - 1.0).abs() < 0.01, "{real}: {r:?} {s:?}");
        }
        // The service's mix of packed coded formats keeps its budget (the tiny model's chunks
        // amortize the header over few values: k4v3 stores 4.97 bits here).
        let coded = KvFormat::CODED.map(|f| Some(Stored::Real(f)));
        let levels = [coded[0], coded[1], coded[2], None];
        let mix = ppl(Compression::Budget { levels, bits: 6.0 });
        assert!(mix.stored_bits <= 6.0 && mix.stored_bits > 4.9, "{mix:?}");
        assert!(mix.ppl.is_finite(), "{mix:?}");
        // All chunks kept at int8, by fractions or by a ratio of 1, is the int8 run exactly.
        assert_eq!(ppl(Compression::Fractions([1.0, 0.0, 0.0])), int8);
        assert_eq!(ppl(Compression::Ratio(1.0)), int8);
        let mix = ppl(Compression::Ratio(0.5));
        assert!(mix.bits_per_value <= 4.0 + 1e-9, "{mix:?}");
        let half = ppl(Compression::Fractions([0.5, 0.0, 0.5]));
        assert_eq!(half.bits_per_value, 5.0);
        assert!(matches!(
            perplexity(&model, &tokens[..100], Compression::Ratio(0.5), 128, 16),
            Err(EvalMixError::TooShort { tokens: 100, .. })
        ));
        assert!(matches!(
            perplexity(
                &model,
                &tokens,
                Compression::Fractions([0.5, 0.6, 0.0]),
                128,
                16
            ),
            Err(EvalMixError::BadMix { .. })
        ));
        assert!(matches!(
            perplexity(&model, &tokens, Compression::Ratio(0.5), 40, 16),
            Err(EvalMixError::BadWindow { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn a_budget_mix_never_exceeds_its_budget(
            densities in proptest::collection::vec(0.0f64..1.0, 0..40),
            three in proptest::bool::ANY,
            budget in 2.3f64..10.0,
        ) {
            let bits: &[f64] = if three { &[9.25, 5.25, 3.25] } else { &[8.6, 4.4, 3.4, 2.4] };
            match levels_for_budget(&densities, bits, budget) {
                Ok(levels) => {
                    let n = densities.len().max(1) as f64;
                    let mean = levels.iter().map(|&l| bits[l]).sum::<f64>() / n;
                    proptest::prop_assert!(densities.is_empty() || mean <= budget + 1e-9, "{mean} > {budget}");
                    // Denser chunks are never lighter.
                    for i in 0..densities.len() {
                        for j in 0..densities.len() {
                            if densities[i] > densities[j] {
                                proptest::prop_assert!(levels[i] <= levels[j]);
                            }
                        }
                    }
                    if budget >= bits[0] {
                        proptest::prop_assert!(levels.iter().all(|&l| l == 0));
                    }
                }
                Err(e) => proptest::prop_assert!(budget < bits[bits.len() - 1], "{e}"),
            }
        }
    }

    #[test]
    fn fractions_keep_the_densest_chunks_heaviest() {
        let d = [0.1, 0.9, 0.5, 0.3, 0.7, 0.2];
        let l = |v: &[u8]| v.iter().map(|&x| Level(x)).collect::<Vec<_>>();
        assert_eq!(
            levels_by_fractions(&d, [0.5, 0.5, 0.0]),
            l(&[1, 0, 0, 1, 0, 1])
        );
        assert_eq!(
            levels_by_fractions(&d, [1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]),
            l(&[2, 0, 1, 1, 0, 2])
        );
        assert_eq!(levels_by_fractions(&d, [0.0, 0.0, 1.0]), l(&[2; 6]));
    }
}
