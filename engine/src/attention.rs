//! Causal GQA attention of a batch of queries over a context's chunked KV cache.
//!
//! Each KV head's keys and values are gathered from the chunks (decoding sealed chunks, borrowing
//! the open one) into f32, then scores, a masked softmax and the weighted sum of values are
//! computed per block of query rows in parallel. While it runs, the attention every key receives
//! is summed into the cache, so each chunk's information density is known with no second pass.

use crate::kernels::{matmul_nn, matmul_nt, softmax};
use crate::kv::{KvCache, KvError};
use rayon::prelude::*;

/// The shape of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

/// Query rows handled by one parallel task.
const ROW_BLOCK: usize = 48;

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
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = shape;
    let group = n_heads / n_kv_heads;
    let total = p0 + n;
    let scale = 1.0 / (hd as f32).sqrt();
    let t = cache.shape().tokens;
    let chunks = cache.chunks_upto(total);

    // Phase 1: every KV head's keys and values for positions 0..total, as f32 [pos][dim].
    let gathered: Vec<(Vec<f32>, Vec<f32>)> = {
        let cache = &*cache;
        (0..n_kv_heads)
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
            .collect::<Result<_, _>>()?
    };

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
                let visible = p0 + (r0 + i) / group + 1;
                let (live, masked) = srow.split_at_mut(visible);
                for v in live.iter_mut() {
                    *v *= scale;
                }
                softmax(live);
                masked.fill(0.0);
                for (c, p) in col.iter_mut().zip(live.iter()) {
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
        cache.add_attention(&col);
    }
    // Every query row of every head saw the keys before it: count the rows once per key.
    // Key p is seen by every query at or after it: all n for p < p0, n - (p - p0) after.
    let seen: Vec<u32> = (0..total)
        .map(|p| (n - p.saturating_sub(p0)) as u32 * n_heads as u32)
        .collect();
    cache.add_rows(&seen);
    Ok(())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight accumulators let the compiler keep independent vector FMAs in flight.
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}
