//! The row-wise kernels of a forward pass: RMSNorm, the gated activations (SwiGLU, GeGLU) and
//! the residual add, each row on its own, a batch's rows split across the engine's threads (a
//! row gets the same bits in any batch).

use super::threads;
use crate::qmatrix::Isa;
use crate::simd;

/// Values a task of the row-wise kernels takes at least: a batch's rows split across the
/// engine's threads in runs of about this many values, a single row (decode) on the calling
/// thread.
const ROW_TASK_VALUES: usize = 16 << 10;

/// Runs `f(rows, first)` over runs of whole rows of `out` (`d` values a row; `first` the index
/// of the run's first row), on the engine's threads when there are enough rows.
pub(crate) fn rows_par<F>(out: &mut [f32], d: usize, f: F)
where
    F: Fn(&mut [f32], usize) + Sync,
{
    use rayon::prelude::*;
    let d = d.max(1);
    let rows = out.len() / d;
    let per = (ROW_TASK_VALUES / d).max(1);
    if rows <= per || threads() == 1 {
        return f(out, 0);
    }
    out.par_chunks_mut(per * d)
        .enumerate()
        .for_each(|(i, o)| f(o, i * per));
}

/// `Σ v²` in a fixed order: sixteen running sums (value `i` into sum `i % 16`, each a multiply
/// then an add), added pairwise at the end. The order is the same on every CPU, and the sums are
/// independent chains the compiler puts in vectors, where one running sum waited on each add.
pub fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += v * v;
    }
    let mut n = acc.len();
    while n > 1 {
        n /= 2;
        for i in 0..n {
            acc[i] += acc[i + n];
        }
    }
    acc[0]
}

/// RMSNorm of each row of `x` (rows of `w.len()`), scaled by `w`, into `out`.
pub fn rms_norm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    let n = out.len().min(x.len()) / d.max(1);
    rows_par(&mut out[..n * d], d, |out, first| {
        for (o, x) in out.chunks_exact_mut(d).zip(x[first * d..].chunks_exact(d)) {
            let r = 1.0 / (sum_squares(x) / d as f32 + eps).sqrt();
            for ((o, x), w) in o.iter_mut().zip(x).zip(w) {
                *o = x * r * w;
            }
        }
    });
}

/// [`rms_norm`] of each row of `x` (rows of `w.len()`) in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    rows_par(x, d, |x, _| {
        for x in x.chunks_exact_mut(d) {
            let r = 1.0 / (sum_squares(x) / d as f32 + eps).sqrt();
            for (x, w) in x.iter_mut().zip(w) {
                *x = *x * r * w;
            }
        }
    });
}

/// GeGLU on rows of `[gate | up]` (each `ffn` wide): `out = gelu(gate) * up`, GELU in its
/// tanh form (Gemma's `gelu_pytorch_tanh`).
pub fn geglu(out: &mut [f32], gate_up: &[f32], ffn: usize) {
    geglu_with(Isa::best(), out, gate_up, ffn);
}

/// [`geglu`] on a given path (the AVX2 one takes `tanh` through one polynomial `e^x`, within a
/// few ulp of libm's).
pub fn geglu_with(isa: Isa, out: &mut [f32], gate_up: &[f32], ffn: usize) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    gated(out, gate_up, ffn, |o, g, u| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); g and u are ffn long.
        Isa::Avx2 | Isa::Avx512 => unsafe { simd::avx2::geglu(o, g, u) },
        _ => {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                let t = (C * (g + 0.044_715 * g * g * g)).tanh();
                *o = 0.5 * g * (1.0 + t) * u;
            }
        }
    });
}

/// SwiGLU on rows of `[gate | up]` (each `ffn` wide): `out = silu(gate) * up`.
pub fn swiglu(out: &mut [f32], gate_up: &[f32], ffn: usize) {
    swiglu_with(Isa::best(), out, gate_up, ffn);
}

/// [`swiglu`] on a given path (the AVX2 one's `e^x` is a polynomial within a few ulp of libm's).
pub fn swiglu_with(isa: Isa, out: &mut [f32], gate_up: &[f32], ffn: usize) {
    assert!(isa.available(), "{isa:?} path on a CPU without it");
    gated(out, gate_up, ffn, |o, g, u| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); g and u are ffn long.
        Isa::Avx2 | Isa::Avx512 => unsafe { simd::avx2::swiglu(o, g, u) },
        _ => {
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        }
    });
}

/// `row(out, gate, up)` for each row of `out` (`ffn` wide) and of `[gate | up]`, a batch's
/// rows split across the engine's threads.
fn gated<F>(out: &mut [f32], gate_up: &[f32], ffn: usize, row: F)
where
    F: Fn(&mut [f32], &[f32], &[f32]) + Sync,
{
    rows_par(out, ffn, |out, first| {
        let gate_up = &gate_up[first * 2 * ffn..];
        for (o, gu) in out.chunks_exact_mut(ffn).zip(gate_up.chunks_exact(2 * ffn)) {
            let (g, u) = gu.split_at(ffn);
            row(o, g, u);
        }
    });
}

/// Adds `b` to `a` elementwise.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    let n = a.len().min(b.len());
    rows_par(&mut a[..n], 1, |a, first| {
        for (a, b) in a.iter_mut().zip(&b[first..]) {
            *a += b;
        }
    });
}
