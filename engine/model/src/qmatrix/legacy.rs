//! The portable kernels of the formats held split into scales, minimums and quants (Q4_1,
//! Q8_0): the reference the SIMD paths of [`crate::simd`] are checked against.

use super::BLOCK;
use half::f16;

pub(super) fn dequant_q4_1_portable(d: &[f16], m: &[f16], qs: &[u8], out: &mut [f32]) {
    for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
        let (db, mb) = (d[b].to_f32(), m[b].to_f32());
        let q = &qs[b * 16..(b + 1) * 16];
        for j in 0..16 {
            o[j] = db * (q[j] & 0xF) as f32 + mb;
            o[j + 16] = db * (q[j] >> 4) as f32 + mb;
        }
    }
}

pub(super) fn dequant_q8_0_portable(d: &[f16], qs: &[u8], out: &mut [f32]) {
    for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
        let db = d[b].to_f32();
        for (o, &q) in o.iter_mut().zip(&qs[b * 32..(b + 1) * 32]) {
            *o = db * q as i8 as f32;
        }
    }
}

/// Σ (d q + m) x over the blocks of one Q4_1 row.
pub(super) fn dot_q4_1_portable(d: &[f16], m: &[f16], qs: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let mut acc = 0.0;
    for b in 0..d.len() {
        let q = &qs[b * 16..(b + 1) * 16];
        let xb = &x[b * BLOCK..(b + 1) * BLOCK];
        let mut s = 0.0;
        for j in 0..16 {
            s += (q[j] & 0xF) as f32 * xb[j] + (q[j] >> 4) as f32 * xb[j + 16];
        }
        acc += d[b].to_f32() * s + m[b].to_f32() * xsum[b];
    }
    acc
}

pub(super) fn dot_q8_0_portable(d: &[f16], qs: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0;
    for b in 0..d.len() {
        let s: f32 = qs[b * 32..(b + 1) * 32]
            .iter()
            .zip(&x[b * 32..(b + 1) * 32])
            .map(|(&w, &a)| w as i8 as f32 * a)
            .sum();
        acc += d[b].to_f32() * s;
    }
    acc
}
