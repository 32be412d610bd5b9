//! Exact recompute of interleaved chunks (paper Fig. 7): rebuilds the K/V of any set of a
//! context's sealed chunks from their token ids, at their true positions, attending causally to
//! every other chunk, and seals each into its slot in its recorded format.
//!
//! Chunks are rebuilt in ascending order, as many per batched pass as fill a prefill step
//! ([`Model::prefill_chunk`] tokens, 16 chunks by default): one GEMM per weight matrix and layer
//! over all the pass's rows, whatever the gaps between its chunks ([`Model::forward_chunks`]).
//! Attention is block-causal by chunk, the rule prefill follows too: a chunk's tokens attend to
//! every earlier chunk as sealed (decoded from its format, whether resident, rebuilt by an
//! earlier pass, or sealed a moment ago by this pass at the same layer) and to their own chunk
//! in f32. Every GEMM rounds a row alike whatever the batch (weight products sliced at
//! [`crate::kernels::GEMM_DEPTH`]; attention as one task per chunk and KV head, shaped
//! by the chunk's index alone), so a rebuilt chunk reproduces the bytes a batched prefill made
//! of it exactly, whatever the prefill's piece sizes and whichever chunks are rebuilt together. Only chunks whose original rows came through a single-token or tiny
//! forward (decode, pieces under four tokens: matrix-vector products on quantized activations)
//! or that were recompressed from a heavier format differ, within the format's quantization
//! error. Resident chunks between and after the set are only read, and attention received is
//! not recorded again.

use crate::kv::KvCache;
use crate::{Model, ModelError};
use std::time::Instant;

/// What went wrong recomputing chunks.
#[derive(Debug, thiserror::Error)]
pub enum RecomputeError {
    /// A requested chunk is not a sealed chunk of the context.
    #[error("chunk {index} cannot be recomputed: the context has {sealed} sealed chunks")]
    NotSealed { index: usize, sealed: usize },
    /// A chunk before a requested one is missing and not requested: its K/V are needed.
    #[error("chunk {chunk} needs chunk {missing}, which is not resident and not being recomputed")]
    Dependency { chunk: usize, missing: usize },
    /// The model failed while recomputing a pass of chunks (the first one named).
    #[error("recomputing chunks from {chunk}: {source}")]
    Model { chunk: usize, source: ModelError },
}

/// What one recompute did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RecomputeStats {
    /// Chunks rebuilt.
    pub chunks: usize,
    /// Tokens run through the model.
    pub tokens: usize,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Recomputes exactly the sealed chunks `chunks` (any order, duplicates ignored) of `cache`
/// from its token ids, writing each into its slot. Every chunk before the largest requested one
/// must be resident or requested.
pub fn recompute_chunks(
    model: &Model,
    cache: &mut KvCache,
    chunks: &[usize],
) -> Result<RecomputeStats, RecomputeError> {
    let start = Instant::now();
    let mut set = chunks.to_vec();
    set.sort_unstable();
    set.dedup();
    let sealed = cache.chunk_formats().len();
    if let Some(&index) = set.iter().find(|&&c| c >= sealed) {
        return Err(RecomputeError::NotSealed { index, sealed });
    }
    if let Some(&last) = set.last()
        && let Some(missing) = (0..last).find(|c| !cache.is_resident(*c) && !set.contains(c))
    {
        return Err(RecomputeError::Dependency {
            chunk: last,
            missing,
        });
    }
    let t = cache.shape().tokens;
    let per_pass = (model.prefill_chunk / t).max(1);
    for pass in set.chunks(per_pass) {
        let run = model.forward_chunks(cache, pass);
        if let Err(source) = run {
            let _ = cache.end_recompute_run();
            return Err(RecomputeError::Model {
                chunk: pass[0],
                source,
            });
        }
    }
    // Chunks past a sliding window rebuilt whole for the later passes keep their global
    // layers alone again.
    cache
        .end_recompute_run()
        .map_err(|source| RecomputeError::Model {
            chunk: set[0],
            source: source.into(),
        })?;
    let stats = RecomputeStats {
        chunks: set.len(),
        tokens: set.len() * t,
        seconds: start.elapsed().as_secs_f64(),
    };
    tracing::debug!(chunks = stats.chunks, secs = stats.seconds, "recomputed");
    Ok(stats)
}

/// Recomputes every sealed chunk of `cache` that is not resident.
pub fn recompute_missing(
    model: &Model,
    cache: &mut KvCache,
) -> Result<RecomputeStats, RecomputeError> {
    let missing = cache.missing_chunks();
    recompute_chunks(model, cache, &missing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Logits;
    use crate::kv::{HeapChunks, KvFormat};
    use crate::tiny::{TinySpec, write_tiny_gguf};

    fn tiny() -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &TinySpec::default()).unwrap();
        let model = Model::load(&path).unwrap();
        (dir, model)
    }

    fn prefill(model: &Model, tokens: &[u32], f: KvFormat) -> KvCache {
        let mut c = KvCache::new(
            model.chunk_shape(16),
            f,
            512,
            Box::new(HeapChunks::default()),
        );
        for piece in tokens.chunks(16) {
            model.forward(&mut c, piece, Logits::Last).unwrap();
        }
        c
    }

    #[test]
    fn interleaved_chunks_of_the_tiny_model_recompute_bit_exactly() {
        let (_dir, model) = tiny();
        let tokens: Vec<u32> = (0..100u32).map(|i| (i * 31 + 7) % 256).collect();
        let mut c = prefill(&model, &tokens, KvFormat::F16);
        let n = c.chunk_formats().len();
        assert_eq!(n, 6);
        let original: Vec<Vec<u8>> = (0..n).map(|i| c.chunk_bytes(i).unwrap().to_vec()).collect();
        for set in [
            vec![0],
            vec![5],
            vec![1, 3, 5],
            vec![0, 1, 2, 3, 4, 5],
            vec![4, 2],
        ] {
            for &i in &set {
                c.reclaim(i).unwrap();
            }
            let stats = recompute_missing(&model, &mut c).unwrap();
            assert_eq!((stats.chunks, stats.tokens), (set.len(), set.len() * 16));
            for (i, want) in original.iter().enumerate() {
                assert!(c.chunk_bytes(i).unwrap() == &want[..], "{set:?}: chunk {i}");
            }
        }
    }

    #[test]
    fn large_interleaved_sets_recompute_bit_exactly_after_prefill_in_any_piece_size() {
        let (_dir, mut model) = tiny();
        let tokens: Vec<u32> = (0..391u32).map(|i| (i * 53 + 11) % 256).collect();
        let by_chunk = prefill(&model, &tokens, KvFormat::Int8);
        let n = by_chunk.chunk_formats().len();
        assert_eq!(n, 24);
        let original: Vec<Vec<u8>> = (0..n)
            .map(|i| by_chunk.chunk_bytes(i).unwrap().to_vec())
            .collect();
        // Block-causal prefill: the pieces' size does not change a byte.
        for piece in [model.prefill_chunk, 100, 7] {
            let mut c = KvCache::new(
                model.chunk_shape(16),
                KvFormat::Int8,
                512,
                Box::new(HeapChunks::default()),
            );
            for p in tokens.chunks(piece) {
                model.forward(&mut c, p, Logits::Last).unwrap();
            }
            for (i, want) in original.iter().enumerate() {
                assert!(
                    c.chunk_bytes(i).unwrap() == &want[..],
                    "piece {piece}: chunk {i}"
                );
            }
        }
        let every_other: Vec<usize> = (0..n).step_by(2).collect();
        let odd: Vec<usize> = (1..n).step_by(2).collect();
        let sets = [
            (1..=20).collect::<Vec<_>>(),
            every_other,
            odd,
            (0..n).collect(),
            vec![23, 0, 12],
        ];
        // Passes of 16 chunks (the default step) and of 3, which cut the sets elsewhere.
        for step in [model.prefill_chunk, 48] {
            model.prefill_chunk = step;
            let mut c = prefill(&model, &tokens, KvFormat::Int8);
            for set in &sets {
                for &i in set {
                    c.reclaim(i).unwrap();
                }
                let stats = recompute_chunks(&model, &mut c, set).unwrap();
                assert_eq!(stats.chunks, set.len());
                for (i, want) in original.iter().enumerate() {
                    assert!(
                        c.chunk_bytes(i).unwrap() == &want[..],
                        "step {step}, set {set:?}: chunk {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn decode_over_packed_chunks_matches_prefill_logits() {
        let (_dir, model) = tiny();
        let tokens: Vec<u32> = (0..70u32).map(|i| (i * 17 + 3) % 256).collect();
        for f in [KvFormat::F16, KvFormat::Int8] {
            // Prefill all but the last token; decode the last one (packed path).
            let mut c = prefill(&model, &tokens[..69], f);
            let decoded = model.forward(&mut c, &tokens[69..], Logits::Last).unwrap();
            // Every attention row's softmax sums to one, so the total attention received is
            // the number of (query, head, layer) rows.
            let (sum, rows) = c.attention_received();
            let total: f64 = sum.iter().map(|&x| f64::from(x)).sum();
            let want = 70.0 * (model.cfg.n_heads * model.cfg.n_layers) as f64;
            assert!((total - want).abs() < 1e-3 * want, "{f}: {total} vs {want}");
            assert_eq!(
                rows[0] as usize,
                70 * model.cfg.n_heads * model.cfg.n_layers
            );
            assert_eq!(rows[69] as usize, model.cfg.n_heads * model.cfg.n_layers);
            // The same token run as a 3-token batch at the end (gathered path) agrees.
            let mut g = prefill(&model, &tokens[..67], f);
            let all = model.forward(&mut g, &tokens[67..], Logits::All).unwrap();
            let last = &all[2 * model.cfg.vocab..];
            let max = decoded
                .iter()
                .zip(last)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            // Pieces of different sizes run some products on Q8_0 weights and others on f32,
            // so the two runs are close, not equal.
            assert!(max < 0.1, "{f}: decode and batch logits differ by {max}");
        }
    }
}
