//! Perplexity of real text with the KV cache compressed by format or by the tolerance-aware mix
//! (paper Fig. 6 and 12): how much each KV format and each mix of levels costs in fidelity.
//!
//! The text is cut into windows. In each window the first half is prefilled (sealed in int8, or
//! f16 for the f16 reference), its chunks are compressed as asked, then the second half is run
//! with the model predicting each next token from the compressed context; the perplexity is
//! over those predictions. Chunks of a mix get their levels by density rank, from the attention
//! the prefill recorded (paper Eq. 1), through the policy crate.

use crate::kv::{HeapChunks, KvCache, KvError, KvFormat};
use crate::model::{Logits, Model, ModelError};
use policy::{Level, LevelSet, assign_levels, chunk_densities};

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

/// How the context's chunks are compressed before the continuation is scored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compression {
    /// Every chunk in one format.
    Uniform(KvFormat),
    /// Fractions of chunks at int8, int4 and int2, the densest chunks kept heaviest.
    Fractions([f64; 3]),
    /// The policy's assignment (Eq. 2-3) under this global ratio to int8 (0.5: half the bits).
    Ratio(f64),
}

impl Compression {
    fn base(self) -> KvFormat {
        match self {
            Compression::Uniform(KvFormat::F16) => KvFormat::F16,
            _ => KvFormat::Int8,
        }
    }
}

/// The outcome of [`perplexity`].
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct PplReport {
    /// Tokens scored.
    pub tokens: usize,
    /// exp of the mean negative log-likelihood.
    pub ppl: f64,
    /// Nominal bits per K/V value of the compressed context chunks.
    pub bits_per_value: f64,
    /// Bits per K/V value including scales and minimums.
    pub bits_with_params: f64,
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

/// Perplexity of `tokens` in windows of `window` tokens under `compression` (see module doc).
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    compression: Compression,
    window: usize,
) -> Result<PplReport, EvalMixError> {
    let chunk = 16;
    if window < 2 * chunk || !window.is_multiple_of(2 * chunk) {
        return Err(EvalMixError::BadWindow { window, chunk });
    }
    if tokens.len() < window {
        return Err(EvalMixError::TooShort {
            tokens: tokens.len(),
            window,
        });
    }
    if let Compression::Fractions(f) = compression
        && (f.iter().any(|x| !x.is_finite() || *x < 0.0)
            || (f.iter().sum::<f64>() - 1.0).abs() > 1e-6)
    {
        return Err(EvalMixError::BadMix { fractions: f });
    }
    let shape = model.chunk_shape(chunk);
    let heads_layers = (model.cfg.n_heads * model.cfg.n_layers) as u32;
    let (mut nll, mut scored) = (0.0f64, 0usize);
    let (mut bits, mut bytes, mut chunks) = (0.0f64, 0usize, 0usize);
    for w in tokens.chunks_exact(window) {
        let (ctx, rest) = w.split_at(window / 2);
        let mut cache = KvCache::new(
            shape,
            compression.base(),
            window,
            Box::new(HeapChunks::default()),
        );
        model.forward(&mut cache, ctx, Logits::Last)?;
        let n = cache.chunk_formats().len();
        let densities = || {
            chunk_densities(&cache.token_attention(heads_layers), chunk, heads_layers)
                .map(|d| d[..n].to_vec())
                .map_err(|e| EvalMixError::Policy(e.to_string()))
        };
        let formats = |levels: &[Level]| -> Vec<KvFormat> {
            levels.iter().map(|l| LEVEL_FORMATS[l.0 as usize]).collect()
        };
        let targets: Vec<KvFormat> = match compression {
            Compression::Uniform(f) => vec![f; n],
            Compression::Fractions(f) => formats(&levels_by_fractions(&densities()?, f)),
            Compression::Ratio(r) => {
                let a = assign_levels(&densities()?, None, &LevelSet::paper_default(), r)
                    .map_err(|e| EvalMixError::Policy(e.to_string()))?;
                formats(&a.levels)
            }
        };
        for (i, &f) in targets.iter().enumerate() {
            if f != compression.base() {
                cache.recompress(i, f)?;
            }
            bits += f64::from(f.bits());
            bytes += shape.chunk_bytes(f);
            chunks += 1;
        }
        let logits = model.forward(&mut cache, &rest[..rest.len() - 1], Logits::All)?;
        let vocab = model.cfg.vocab;
        for (row, &next) in logits.chunks_exact(vocab).zip(&rest[1..]) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = row
                .iter()
                .map(|&x| f64::from(x - max).exp())
                .sum::<f64>()
                .ln()
                + f64::from(max);
            nll += lse - f64::from(row[next as usize]);
            scored += 1;
        }
    }
    let values = (chunks * 2 * shape.section() * shape.n_layers).max(1) as f64;
    Ok(PplReport {
        tokens: scored,
        ppl: (nll / scored.max(1) as f64).exp(),
        bits_per_value: bits / chunks.max(1) as f64,
        bits_with_params: bytes as f64 * 8.0 / values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tiny::{TinySpec, write_tiny_gguf};

    #[test]
    fn perplexity_under_formats_and_mixes_on_the_tiny_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &TinySpec::default()).unwrap();
        let model = Model::load(&path).unwrap();
        let tokens: Vec<u32> = (0..256u32).map(|i| (i * 97 + 13) % 256).collect();
        let ppl = |c| perplexity(&model, &tokens, c, 128).unwrap();
        let f16 = ppl(Compression::Uniform(KvFormat::F16));
        let int8 = ppl(Compression::Uniform(KvFormat::Int8));
        let int2 = ppl(Compression::Uniform(KvFormat::Int2));
        assert_eq!(f16.tokens, 2 * 63);
        assert!(f16.ppl.is_finite() && f16.ppl > 1.0, "{f16:?}");
        assert_eq!(
            (f16.bits_per_value, int8.bits_per_value, int2.bits_per_value),
            (16.0, 8.0, 2.0)
        );
        assert!(int2.bits_with_params > 2.0 && int2.bits_with_params < int8.bits_with_params);
        // All chunks kept at int8, by fractions or by a ratio of 1, is the int8 run exactly.
        assert_eq!(ppl(Compression::Fractions([1.0, 0.0, 0.0])), int8);
        assert_eq!(ppl(Compression::Ratio(1.0)), int8);
        let mix = ppl(Compression::Ratio(0.5));
        assert!(mix.bits_per_value <= 4.0 + 1e-9, "{mix:?}");
        let half = ppl(Compression::Fractions([0.5, 0.0, 0.5]));
        assert_eq!(half.bits_per_value, 5.0);
        assert!(matches!(
            perplexity(&model, &tokens[..100], Compression::Ratio(0.5), 128),
            Err(EvalMixError::TooShort { tokens: 100, .. })
        ));
        assert!(matches!(
            perplexity(
                &model,
                &tokens,
                Compression::Fractions([0.5, 0.6, 0.0]),
                128
            ),
            Err(EvalMixError::BadMix { .. })
        ));
        assert!(matches!(
            perplexity(&model, &tokens, Compression::Ratio(0.5), 40),
            Err(EvalMixError::BadWindow { .. })
        ));
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
