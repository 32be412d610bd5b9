//! Causal GQA attention of a batch of queries over a context's chunked KV cache.
//!
//! Decode (a few query rows) reads chunk memory directly: each chunk's block of one KV head is
//! read in place by every query row of that head at once (codes converted in registers), or,
//! for values in groups narrower than the head (Gemma 3), decoded into a small buffer that
//! stays in L1; no f32 copy of the context is ever made.
//!
//! Prefill and recompute (many rows) are block-causal by chunk ([`attend_chunks`]): a query
//! attends to every earlier chunk in its sealed form (decoded from its format, whether it sits
//! in chunk memory or was sealed by the same pass a moment ago) and to its own chunk in f32, as
//! decode does. Each KV head's sealed keys and values are gathered to f32 once, then every
//! (KV head, chunk) pair is one task of fixed-shape GEMMs over all the chunk's query rows. The
//! shapes depend only on the chunk's index, so a chunk's result never depends on which other
//! chunks were in the pass: prefill in pieces of any size and recompute of any set agree bit
//! for bit.
//!
//! Chunks of one context may be in mixed formats. While it runs, the attention every key
//! receives is summed into the cache, so each chunk's information density is known with no
//! second pass.

use crate::kernels::{axpy, dot, matmul_nn, matmul_nt, matmul_serial, softmax};
use crate::kv::codec::{decode_k, decode_v};
use crate::kv::{KvCache, KvError};
use rayon::prelude::*;

mod decode;

pub use decode::attend_packed;

/// The shape of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// A sliding-window layer's window: a query at position `p` sees keys `p + 1 - window..=p`
    /// only. `None` for a global layer (every key up to the query's own).
    pub window: Option<usize>,
}

impl AttnShape {
    /// The first key position a query at `pos` sees.
    pub fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// The first chunk (of `tokens`) whose keys any query of chunk `chunk` sees: a function of
    /// the chunk's index alone, so a chunk's products keep one shape in every pass.
    pub fn first_chunk(&self, chunk: usize, tokens: usize) -> usize {
        self.first_key(chunk * tokens) / tokens
    }
}

/// Query rows handled by one parallel task.
const ROW_BLOCK: usize = 48;

/// Query tokens up to which attention reads packed chunks directly instead of gathering.
pub const PACKED_MAX_TOKENS: usize = 2;

/// Attention at `layer` for `n` queries at positions `p0..p0 + n` (their K/V already written to
/// the cache). `q` is `[n][n_heads * head_dim]` (after RoPE); the result goes to `out`, same shape.
pub fn attend(
    cache: &mut KvCache,
    layer: usize,
    shape: AttnShape,
    q: &[f32],
    p0: usize,
    n: usize,
    out: &mut [f32],
) -> Result<(), KvError> {
    if n <= PACKED_MAX_TOKENS {
        attend_packed(cache, layer, shape, q, p0, n, out)
    } else {
        let positions: Vec<usize> = (p0..p0 + n).collect();
        let rows = ChunkRows::of(&positions, cache.shape().tokens);
        attend_chunks(cache, layer, shape, q, &rows, out)
    }
}

/// The query rows of one chunk in a batched pass: rows `first..first + n` of the batch are the
/// chunk's tokens `lo..lo + n` (positions `chunk * tokens + lo..`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkRows {
    /// The chunk.
    pub chunk: usize,
    /// The batch row of its first query.
    pub first: usize,
    /// The first query's offset in the chunk.
    pub lo: usize,
    /// Queries.
    pub n: usize,
}

impl ChunkRows {
    /// The rows of a batch whose queries sit at `positions` (ascending), grouped by chunk of
    /// `tokens` positions.
    pub fn of(positions: &[usize], tokens: usize) -> Vec<ChunkRows> {
        let mut rows: Vec<ChunkRows> = Vec::new();
        for (i, &p) in positions.iter().enumerate() {
            match rows.last_mut() {
                Some(r) if r.chunk == p / tokens && r.chunk * tokens + r.lo + r.n == p => r.n += 1,
                _ => rows.push(ChunkRows {
                    chunk: p / tokens,
                    first: i,
                    lo: p % tokens,
                    n: 1,
                }),
            }
        }
        rows
    }
}

/// Block-causal attention at `layer` of a batch of queries grouped by chunk (see the module
/// comment): each chunk's queries see every earlier chunk sealed ([`KvCache::sealed_layer`])
/// and their own chunk in f32 ([`KvCache::f32_layer`]; its sealed form when it has no f32
/// staging). Every chunk before the last one with queries must have a sealed form. `q` is
/// `[rows][n_heads * head_dim]` (after RoPE); the result goes to `out`, same shape.
pub fn attend_chunks(
    cache: &mut KvCache,
    layer: usize,
    shape: AttnShape,
    q: &[f32],
    rows: &[ChunkRows],
    out: &mut [f32],
) -> Result<(), KvError> {
    let Some(last) = rows.iter().map(|r| r.chunk).max() else {
        return Ok(());
    };
    let t = cache.shape().tokens;
    let from = rows
        .iter()
        .map(|r| shape.first_chunk(r.chunk, t))
        .min()
        .unwrap_or(0);
    // One KV head at a time, so that one head's keys and values are gathered at once (a third of
    // the default model's at depth: 3.1 MiB at 6k tokens, where all heads took 9.4 MiB).
    for g in 0..shape.n_kv_heads {
        // Phase 1: the head's sealed keys and values of chunks `from..=last`, f32 [pos][dim].
        let gathered = gather_sealed(cache, layer, shape, rows, from, last, g)?;
        // Phase 2: per chunk with queries, all its query rows at once, padded to the full chunk
        // so the shapes depend on the chunk's index alone. Row r is the chunk's token r / group,
        // head g * group + r % group.
        let results: Vec<(usize, Vec<f32>, Vec<f32>)> = {
            let cache = &*cache;
            (0..rows.len())
                .into_par_iter()
                .map(|i| {
                    let (o, col) =
                        chunk_task(cache, layer, shape, q, rows[i], g, from * t, &gathered);
                    (i, o, col)
                })
                .collect()
        };
        for (i, o, col) in results {
            scatter_rows(shape, rows[i], g, &o, out);
            cache.add_attention_from(layer, shape.first_chunk(rows[i].chunk, t) * t, &col);
        }
    }
    record_seen(cache, layer, shape, rows, last);
    Ok(())
}

/// One task of [`attend_chunks`]: KV head `g` for the query rows `r` of one chunk, against the
/// head's `gathered` sealed keys and values (from position `from`); returns the outputs
/// `[token * group + j][head_dim]` and the attention each key from the chunk's first visible one
/// received.
#[allow(clippy::too_many_arguments)]
fn chunk_task(
    cache: &KvCache,
    layer: usize,
    shape: AttnShape,
    q: &[f32],
    r: ChunkRows,
    g: usize,
    from: usize,
    gathered: &(Vec<f32>, Vec<f32>),
) -> (Vec<f32>, Vec<f32>) {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim: hd,
        ..
    } = shape;
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let t = cache.shape().tokens;
    let m = t * group;
    let base = r.chunk * t;
    // Keys from the chunk's first visible chunk (0 on a global layer) to its end.
    let k0 = shape.first_chunk(r.chunk, t) * t;
    let width = base + t - k0;
    let (ka, va) = gathered;
    let (ka, va) = (&ka[(k0 - from) * hd..], &va[(k0 - from) * hd..]);
    let block = t * hd;
    let (ko, vo) = match cache.f32_layer(layer, r.chunk) {
        Some(buf) => (
            &buf[g * block..(g + 1) * block],
            &buf[(n_kv_heads + g) * block..(n_kv_heads + g + 1) * block],
        ),
        None => (
            &ka[(base - k0) * hd..width * hd],
            &va[(base - k0) * hd..width * hd],
        ),
    };
    let live = r.lo..r.lo + r.n;
    let mut qb = vec![0.0; m * hd];
    for tok in live.clone() {
        for j in 0..group {
            let src = (r.first + tok - r.lo) * n_heads * hd + (g * group + j) * hd;
            qb[(tok * group + j) * hd..][..hd].copy_from_slice(&q[src..src + hd]);
        }
    }
    // Scores: earlier chunks sealed, then the chunk's own keys.
    let before = base - k0;
    let mut s = vec![0.0; m * width];
    matmul_serial(&mut s, width, &qb, hd, ka, (hd, 1), (m, before, hd), false);
    matmul_serial(
        &mut s[before..],
        width,
        &qb,
        hd,
        ko,
        (hd, 1),
        (m, t, hd),
        false,
    );
    // col[p - k0]: the attention key p received from the chunk's rows.
    let mut col = vec![0.0f32; width];
    for (row, srow) in s.chunks_exact_mut(width).enumerate() {
        let tok = row / group;
        if !live.contains(&tok) {
            srow.fill(0.0);
            continue;
        }
        let first = shape.first_key(base + tok) - k0;
        let (seen, masked) = srow.split_at_mut(base + tok + 1 - k0);
        let (hidden, seen) = seen.split_at_mut(first);
        softmax(seen, scale);
        hidden.fill(0.0);
        masked.fill(0.0);
        for (c, p) in col[first..].iter_mut().zip(seen.iter()) {
            *c += p;
        }
    }
    // Weighted values, in the same two parts.
    let mut o = vec![0.0; m * hd];
    matmul_serial(&mut o, hd, &s, width, va, (1, hd), (m, hd, before), false);
    let acc = before > 0;
    matmul_serial(
        &mut o,
        hd,
        &s[before..],
        width,
        vo,
        (1, hd),
        (m, hd, t),
        acc,
    );
    (o, col)
}

/// Copies KV head `g`'s outputs for chunk rows `r` (`o`: `[token * group + j][head_dim]`) to
/// their query rows of `out`.
fn scatter_rows(shape: AttnShape, r: ChunkRows, g: usize, o: &[f32], out: &mut [f32]) {
    let (n_heads, hd) = (shape.n_heads, shape.head_dim);
    let group = n_heads / shape.n_kv_heads;
    for tok in r.lo..r.lo + r.n {
        for j in 0..group {
            let src = (tok * group + j) * hd;
            let dst = (r.first + tok - r.lo) * n_heads * hd + (g * group + j) * hd;
            out[dst..dst + hd].copy_from_slice(&o[src..src + hd]);
        }
    }
}

/// KV head `g`'s sealed keys and values of chunks `from..=last` (from the first row's window
/// to the last chunk with queries), as f32 `[pos][dim]`, decoded in parallel by chunk. A chunk
/// with no sealed form stays zero: only its own queries read it, from its f32 staging; a chunk
/// later queries need without a sealed form is an error. Chunks before every row's window are
/// neither read nor held: on a sliding-window layer deep in a long context the gather is the
/// window's, not the context's.
fn gather_sealed(
    cache: &KvCache,
    layer: usize,
    shape: AttnShape,
    rows: &[ChunkRows],
    from: usize,
    last: usize,
    g: usize,
) -> Result<(Vec<f32>, Vec<f32>), KvError> {
    let cs = *cache.shape();
    let block = cs.tokens * shape.head_dim;
    let len = (last + 1 - from) * block;
    let mut ka = vec![0.0; len];
    let mut va = vec![0.0; len];
    ka.par_chunks_mut(block)
        .zip(va.par_chunks_mut(block))
        .enumerate()
        .with_min_len(8)
        .try_for_each(|(i, (k, v))| {
            let c = from + i;
            if let Some((f, bytes)) = cache.sealed_layer(layer, c)? {
                decode_k(&cs, f, bytes, g, k);
                decode_v(&cs, f, bytes, g, v);
            } else if rows.iter().any(|r| r.chunk > c) {
                return Err(KvError::NotResident { index: c });
            }
            Ok(())
        })?;
    Ok((ka, va))
}

/// Records, when the cache records, how many query rows saw each key of chunks `0..=last`: key
/// p is seen by every query at or after it (within the window on a sliding-window layer), once
/// per head.
fn record_seen(
    cache: &mut KvCache,
    layer: usize,
    shape: AttnShape,
    rows: &[ChunkRows],
    last: usize,
) {
    if !cache.recording() {
        return;
    }
    let t = cache.shape().tokens;
    let queries = rows
        .iter()
        .flat_map(|r| (r.lo..r.lo + r.n).map(move |tok| r.chunk * t + tok));
    let seen = seen_counts(shape, queries, (last + 1) * t);
    cache.add_rows(layer, &seen);
}

/// How many query rows see each key `0..len`: each query at `q` sees keys
/// `shape.first_key(q)..=q`, once per head.
pub(super) fn seen_counts(
    shape: AttnShape,
    queries: impl Iterator<Item = usize>,
    len: usize,
) -> Vec<u32> {
    // A difference array: +1 where a query's keys start, -1 past its own position.
    let mut diff = vec![0i64; len + 1];
    for q in queries {
        diff[shape.first_key(q)] += 1;
        diff[q + 1] -= 1;
    }
    let mut run = 0;
    diff[..len]
        .iter()
        .map(|d| {
            run += d;
            (run * shape.n_heads as i64) as u32
        })
        .collect()
}

/// Attention of many query rows: gather to f32, then GEMM per block of rows.
pub fn attend_gathered(
    cache: &mut KvCache,
    layer: usize,
    shape: AttnShape,
    q: &[f32],
    p0: usize,
    n: usize,
    out: &mut [f32],
) -> Result<(), KvError> {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim: hd,
        ..
    } = shape;
    let group = n_heads / n_kv_heads;
    let total = p0 + n;
    let scale = 1.0 / (hd as f32).sqrt();
    let chunks = cache.chunks_upto(total);

    // Phase 1: every KV head's keys and values for positions 0..total, as f32 [pos][dim].
    let gathered = gather_blocks(cache, layer, shape, chunks)?;

    // Phase 2: per (KV head, block of query rows): scores, masked softmax, weighted values.
    // Row r of head g's block is query token r / group, head g * group + r % group.
    let rows = n * group;
    let tasks: Vec<(usize, usize)> = (0..n_kv_heads)
        .flat_map(|g| (0..rows).step_by(ROW_BLOCK).map(move |r0| (g, r0)))
        .collect();
    let results: Vec<(usize, usize, Vec<f32>, Vec<f32>)> = tasks
        .into_par_iter()
        .map(|(g, r0)| {
            let r1 = (r0 + ROW_BLOCK).min(rows);
            let m = r1 - r0;
            // The last key any row of this block may see.
            let last_tok = (r1 - 1) / group;
            let width = p0 + last_tok + 1;
            let (ka, va) = &gathered[g];
            let mut qb = vec![0.0; m * hd];
            for (i, r) in (r0..r1).enumerate() {
                let (tok, j) = (r / group, r % group);
                let src = tok * n_heads * hd + (g * group + j) * hd;
                qb[i * hd..(i + 1) * hd].copy_from_slice(&q[src..src + hd]);
            }
            let mut s = vec![0.0; m * width];
            if m >= 8 {
                matmul_nt(&mut s, &qb, ka, m, width, hd);
            } else {
                for (i, srow) in s.chunks_exact_mut(width).enumerate() {
                    let qr = &qb[i * hd..(i + 1) * hd];
                    for (p, sv) in srow.iter_mut().enumerate() {
                        *sv = dot(qr, &ka[p * hd..(p + 1) * hd]);
                    }
                }
            }
            let mut col = vec![0.0f32; width];
            for (i, srow) in s.chunks_exact_mut(width).enumerate() {
                let pos = p0 + (r0 + i) / group;
                let first = shape.first_key(pos);
                let (live, masked) = srow.split_at_mut(pos + 1);
                let (hidden, live) = live.split_at_mut(first);
                softmax(live, scale);
                hidden.fill(0.0);
                masked.fill(0.0);
                for (c, p) in col[first..].iter_mut().zip(live.iter()) {
                    *c += p;
                }
            }
            let mut o = vec![0.0; m * hd];
            if m >= 8 {
                matmul_nn(&mut o, &s, va, m, hd, width);
            } else {
                for (i, srow) in s.chunks_exact(width).enumerate() {
                    let orow = &mut o[i * hd..(i + 1) * hd];
                    for (p, &w) in srow.iter().enumerate() {
                        if w != 0.0 {
                            axpy(orow, w, &va[p * hd..(p + 1) * hd]);
                        }
                    }
                }
            }
            (g, r0, o, col)
        })
        .collect();

    for (g, r0, o, col) in results {
        for (i, orow) in o.chunks_exact(hd).enumerate() {
            let r = r0 + i;
            let (tok, j) = (r / group, r % group);
            let dst = tok * n_heads * hd + (g * group + j) * hd;
            out[dst..dst + hd].copy_from_slice(orow);
        }
        cache.add_attention(layer, &col);
    }
    if cache.recording() {
        let seen = seen_counts(shape, p0..total, total);
        cache.add_rows(layer, &seen);
    }
    Ok(())
}

/// Each KV head's keys and values, f32 `[pos][dim]`.
type Gathered = Vec<(Vec<f32>, Vec<f32>)>;

/// Every KV head's keys and values of chunks `0..chunks`, decoded to f32 `[pos][dim]`.
fn gather_blocks(
    cache: &KvCache,
    layer: usize,
    shape: AttnShape,
    chunks: usize,
) -> Result<Gathered, KvError> {
    let (t, hd) = (cache.shape().tokens, shape.head_dim);
    (0..shape.n_kv_heads)
        .into_par_iter()
        .map(|g| -> Result<_, KvError> {
            let mut ka = vec![0.0; chunks * t * hd];
            let mut va = vec![0.0; chunks * t * hd];
            let mut kb = vec![0.0; t * hd];
            let mut vb = vec![0.0; t * hd];
            for c in 0..chunks {
                let (k, v) = cache.block(layer, g, c, &mut kb, &mut vb)?;
                ka[c * t * hd..(c + 1) * t * hd].copy_from_slice(k);
                va[c * t * hd..(c + 1) * t * hd].copy_from_slice(v);
            }
            Ok((ka, va))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::decode::{DecodeSplit, attend_packed_split, decode_splits};
    use super::*;
    use crate::kv::{ChunkShape, HeapChunks, KvFormat};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const SHAPE: AttnShape = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        window: None,
    };

    /// A cache of `len` random tokens over 2 layers whose sealed chunks take `formats` in turn,
    /// the coded formats' values in groups of `value_group` channels (0: the head's 16).
    fn cache(len: usize, formats: &[KvFormat], value_group: usize, rng: &mut StdRng) -> KvCache {
        cache_hd(len, formats, value_group, 16, rng)
    }

    /// [`cache`] with heads of `hd` channels.
    fn cache_hd(
        len: usize,
        formats: &[KvFormat],
        value_group: usize,
        hd: usize,
        rng: &mut StdRng,
    ) -> KvCache {
        let s = ChunkShape {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: hd,
            tokens: 16,
            value_group,
            ..ChunkShape::DENSE
        };
        let mut c = KvCache::new(s, KvFormat::F16, 1024, Box::new(HeapChunks::default()));
        c.reserve(len).unwrap();
        for p in 0..len {
            for l in 0..2 {
                let k: Vec<f32> = (0..2 * hd).map(|_| rng.random_range(-2.0..2.0)).collect();
                let v: Vec<f32> = (0..2 * hd).map(|_| rng.random_range(-2.0..2.0)).collect();
                c.write(l, p, &k, &v);
            }
        }
        c.commit(&vec![0; len]).unwrap();
        for i in 0..c.chunk_formats().len() {
            let f = formats[i % formats.len()];
            if f != KvFormat::F16 {
                c.recompress(i, f).unwrap();
            }
        }
        c
    }

    /// Direct attention from the full matrix: every key decoded, each row's softmax over the
    /// keys at or before it (and in its window). Returns the output and every key's summed
    /// column.
    fn direct(
        c: &KvCache,
        shape: AttnShape,
        layer: usize,
        q: &[f32],
        p0: usize,
        n: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let AttnShape {
            n_heads,
            n_kv_heads,
            head_dim: hd,
            window,
        } = shape;
        let t = c.shape().tokens;
        let total = p0 + n;
        let (mut keys, mut vals) = (vec![vec![]; n_kv_heads], vec![vec![]; n_kv_heads]);
        for g in 0..n_kv_heads {
            for ch in 0..c.chunks_upto(total) {
                let (mut kb, mut vb) = (vec![0.0; t * hd], vec![0.0; t * hd]);
                let (k, v) = c.block(layer, g, ch, &mut kb, &mut vb).unwrap();
                keys[g].extend_from_slice(k);
                vals[g].extend_from_slice(v);
            }
        }
        let mut out = vec![0.0; n * n_heads * hd];
        let mut col = vec![0.0; total];
        for i in 0..n {
            for h in 0..n_heads {
                let g = h / (n_heads / n_kv_heads);
                let qr = &q[(i * n_heads + h) * hd..][..hd];
                let visible = p0 + i + 1;
                let first = window.map_or(0, |w| visible.saturating_sub(w));
                let scores: Vec<f64> = (first..visible)
                    .map(|p| {
                        let k = &keys[g][p * hd..(p + 1) * hd];
                        qr.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (p, s) in (first..).zip(&scores) {
                    let a = (s - m).exp() / z;
                    col[p] += a as f32;
                    for d in 0..hd {
                        out[(i * n_heads + h) * hd + d] += (a * vals[g][p * hd + d] as f64) as f32;
                    }
                }
            }
        }
        (out, col)
    }

    fn check(len: usize, n: usize, formats: &[KvFormat], seed: u64) {
        check_split(len, n, formats, seed, None);
    }

    /// [`check`] with decode's chunks cut into `splits` ranges per KV head (`None`: as chosen).
    fn check_split(
        len: usize,
        n: usize,
        formats: &[KvFormat],
        seed: u64,
        splits: Option<DecodeSplit>,
    ) {
        check_shape(SHAPE, len, n, formats, 0, seed, splits);
    }

    /// [`check_split`] of attention of `shape`, over values in groups of `value_group` channels
    /// in the coded formats (0: the whole head).
    fn check_shape(
        shape: AttnShape,
        len: usize,
        n: usize,
        formats: &[KvFormat],
        value_group: usize,
        seed: u64,
        splits: Option<DecodeSplit>,
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut c = cache(len, formats, value_group, &mut rng);
        let p0 = len - n;
        let q: Vec<f32> = (0..n * 64).map(|_| rng.random_range(-2.0..2.0)).collect();
        let (want, want_col) = direct(&c, shape, 1, &q, p0, n);
        let mut got = vec![0.0; n * 64];
        match splits {
            Some(s) => attend_packed_split(&mut c, 1, shape, &q, p0, n, s, &mut got).unwrap(),
            None => attend(&mut c, 1, shape, &q, p0, n, &mut got).unwrap(),
        }
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() < 1e-4,
                "{formats:?} len {len} n {n}: out {i}: {a} vs {b}"
            );
        }
        let (col, rows) = c.attention_received();
        for p in 0..len {
            assert!(
                (col[p] - want_col[p]).abs() < 1e-4,
                "{formats:?} len {len} n {n}: key {p}: {} vs {}",
                col[p],
                want_col[p]
            );
            // The queries whose window holds key p.
            let w = shape.window.unwrap_or(usize::MAX);
            let seen = (p0..len).filter(|&q| q >= p && q - p < w).count() * 4;
            assert_eq!(rows[p] as usize, seen, "rows of key {p}");
        }
    }

    /// Decode attention over chunks of codes with heads of 64 channels, values in one group a
    /// head or in groups of 32 channels: in f32 as the full matrix; in integers (where the CPU
    /// has the kernels) within the rounding of its folded rows, and not the f32 path's bits
    /// (so the integer kernels ran).
    #[test]
    fn integer_decode_attention_is_near_the_full_matrix() {
        use crate::kernels::coded::{KvArith, int8_available};
        use KvFormat::*;
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 64,
            window: None,
        };
        // Value groups of the whole head, and of 32 channels (Gemma 3's; the coded formats).
        let cases = [(70, 1, 0), (70, 2, 0), (300, 1, 0), (16, 1, 0), (600, 2, 0)]
            .into_iter()
            .chain([(70, 1, 32), (300, 2, 32)]);
        for (len, n, group) in cases {
            let mut rng = StdRng::seed_from_u64((len * 10 + n + group) as u64);
            let mut c = cache_hd(len, &[K4v3, K8v8, K4v4, Int4, Int2], group, 64, &mut rng);
            let p0 = len - n;
            let q: Vec<f32> = (0..n * 256).map(|_| rng.random_range(-2.0..2.0)).collect();
            let (want, _) = direct(&c, shape, 1, &q, p0, n);
            let mut got = [vec![0.0; n * 256], vec![0.0; n * 256]];
            for (arith, out) in [KvArith::F32, KvArith::Int8].into_iter().zip(&mut got) {
                c.set_arith(arith);
                attend(&mut c, 1, shape, &q, p0, n, out).unwrap();
            }
            let worst = |o: &[f32]| {
                o.iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max)
            };
            assert!(
                worst(&got[0]) < 1e-4,
                "f32, len {len} n {n} groups {group}: {}",
                worst(&got[0])
            );
            assert!(
                worst(&got[1]) < 2e-2,
                "int8, len {len} n {n} groups {group}: {}",
                worst(&got[1])
            );
            if int8_available() {
                assert_ne!(
                    got[0], got[1],
                    "len {len} n {n}: the integer kernels did not run"
                );
            }
        }
    }

    /// The grouped values' parameters laid out group by group give back what `decode_v`
    /// decodes, on chunks whose groups fit one pass (16 tokens) and need two (64 tokens of
    /// heads of 256 in groups of 32: 512 groups).
    #[test]
    fn grouped_values_laid_out_by_group_decode_as_decode_v() {
        use crate::kv::codec::{decode_v, encode_layer, packed_value};
        for tokens in [16, 64] {
            let s = ChunkShape {
                n_layers: 1,
                n_kv_heads: 2,
                head_dim: 256,
                tokens,
                value_group: 32,
                ..ChunkShape::DENSE
            };
            let mut rng = StdRng::seed_from_u64(tokens as u64);
            let n = 2 * tokens * 256;
            let k: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
            for f in [KvFormat::K4v3, KvFormat::K8v8] {
                let mut layer = vec![0u8; s.layer_bytes(f)];
                encode_layer(&s, f, &k, &v, &mut layer).unwrap();
                for h in 0..2 {
                    let mut want = vec![0.0; tokens * 256];
                    decode_v(&s, f, &layer, h, &mut want);
                    let groups = s.value_groups(f);
                    let (mut m, mut sc) = (vec![0.0; groups], vec![0.0; groups]);
                    let (codes, first, layout) =
                        decode::packed_grouped_values(&s, f, &layer, h, &mut m, &mut sc);
                    for i in 0..tokens {
                        for c in 0..256 {
                            let j = c / layout.width * layout.stride + i;
                            let code = packed_value(codes, first + i * 256 + c, f.value_bits());
                            let got = m[j] + f32::from(code) * sc[j];
                            let at = format!("{f:?} tokens {tokens} head {h} [{i}][{c}]");
                            assert!((got - want[i * 256 + c]).abs() < 1e-5, "{at}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn attention_over_values_in_groups_equals_the_full_matrix() {
        use KvFormat::*;
        // Groups of 8 channels: two a token of the test's heads of 16.
        let coded = [K8v8, K4v3, F16, K4v4];
        check_shape(SHAPE, 70, 1, &coded, 8, 11, None);
        check_shape(SHAPE, 70, 2, &coded, 8, 12, None);
        check_shape(SHAPE, 70, 20, &coded, 8, 13, None);
        for heads in [1, 2] {
            let split = DecodeSplit { heads, ranges: 3 };
            check_shape(SHAPE, 300, 2, &coded, 8, 14, Some(split));
        }
    }

    #[test]
    fn packed_and_gathered_attention_equal_the_full_matrix() {
        use KvFormat::*;
        let mixed = [Int8, F16, Int4, Int2];
        // Decode (packed path) and prefill (gathered path), sealed chunks and an open tail.
        check(1, 1, &[Int8], 1);
        check(16, 1, &[Int8], 2);
        check(70, 1, &mixed, 3);
        check(70, 2, &mixed, 4);
        check(64, 2, &[Int2], 5);
        check(70, 20, &mixed, 6);
        check(40, 40, &[F16], 7);
        check(100, 3, &[Int4, F16], 8);
    }

    /// A sliding-window layer's attention (decode, in pieces, and block-causal prefill): each
    /// query sees only the keys of its window, windows that end inside a chunk, span several
    /// chunks or reach the start.
    #[test]
    fn windowed_attention_equals_the_full_matrix_within_the_window() {
        use KvFormat::*;
        for window in [1, 5, 16, 17, 40, 1000] {
            let shape = AttnShape {
                window: Some(window),
                ..SHAPE
            };
            let seed = window as u64;
            for (len, n) in [(70, 1), (70, 2), (100, 20), (40, 40), (257, 2)] {
                check_shape(shape, len, n, &[Int8, F16, K4v4, Int4], 0, seed, None);
            }
            for ranges in [1, 3, 7] {
                for heads in [1, 2] {
                    let split = DecodeSplit { heads, ranges };
                    check_shape(shape, 300, 2, &[Int8, F16], 0, seed, Some(split));
                }
            }
        }
    }

    #[test]
    fn decode_attention_in_pieces_equals_the_full_matrix() {
        use KvFormat::*;
        // Pieces of unequal length, a last chunk still open, a piece the first of two query
        // rows sees none of (len 257: the second row's last key alone in chunk 16).
        for (len, n) in [(300, 1), (300, 2), (257, 2), (33, 1)] {
            for ranges in [1, 2, 3, 5, 40] {
                // A task per KV head, or tasks of both KV heads.
                for heads in [1, 2] {
                    check_split(
                        len,
                        n,
                        &[Int8, F16, K4v4, Int4, K4v3],
                        len as u64 + ranges as u64,
                        Some(DecodeSplit { heads, ranges }),
                    );
                }
            }
        }
    }

    #[test]
    fn decode_splits_balance_the_threads() {
        let check = |heads, chunks, threads, want| {
            assert_eq!(
                decode_splits(heads, chunks, threads),
                want,
                "{heads} heads, {chunks} chunks, {threads} threads"
            );
        };
        check(3, 32, 2, 2);
        check(3, 128, 2, 2);
        check(3, 15, 2, 1);
        check(3, 16, 2, 2);
        check(3, 1, 2, 1);
        check(2, 100, 2, 1);
        check(3, 100, 4, 4);
        check(3, 16, 4, 2);
        check(8, 200, 2, 1);
        check(3, 40, 1, 1);
    }

    /// Long contexts are cut by chunks alone, one range a thread, each task taking every KV
    /// head; short ones (or one KV head) keep a task per head.
    #[test]
    fn long_contexts_are_split_by_chunks_with_every_head() {
        let wide = |heads, ranges| DecodeSplit { heads, ranges };
        assert_eq!(DecodeSplit::of(3, 512, 2), wide(3, 2));
        assert_eq!(DecodeSplit::of(3, 64, 2), wide(3, 2));
        assert_eq!(DecodeSplit::of(3, 63, 2), wide(1, decode_splits(3, 63, 2)));
        assert_eq!(DecodeSplit::of(3, 200, 4), wide(3, 4));
        assert_eq!(
            DecodeSplit::of(1, 512, 2),
            wide(1, decode_splits(1, 512, 2))
        );
        assert_eq!(DecodeSplit::of(3, 40, 1), wide(3, 1));
    }
}
