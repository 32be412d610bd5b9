//! Decode's int8 activations (`--activations int8`, [`super::Activations::Int8`]): a vector
//! quantized to 8 bits per 32-value block, for the products that multiply codes with codes.

use super::BLOCK;
#[cfg(target_arch = "x86_64")]
use crate::simd;

/// Activations quantized to 8 bits per 32-value block.
pub(super) struct QuantizedActs {
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
}

/// Quantizes `x` (a multiple of 32 long) per 32-value block: `d = amax / 127`, codes rounded
/// to nearest, ties to even, on the best path this CPU has (every path gives the same bits).
pub(super) fn quantize_acts(x: &[f32]) -> QuantizedActs {
    let nb = x.len() / BLOCK;
    let (mut q, mut d) = (vec![0i8; nb * BLOCK], vec![0f32; nb]);
    #[cfg(target_arch = "x86_64")]
    if simd::vnni::available() {
        // SAFETY: the CPU has the kernel's features (checked just above); it checks the sizes.
        unsafe { simd::vnni::quantize(x, &mut q, &mut d) };
        return QuantizedActs { q, d };
    }
    quantize_acts_portable(x, &mut q, &mut d);
    QuantizedActs { q, d }
}

/// [`quantize_acts`] in plain Rust, into `q` and `d`.
pub(crate) fn quantize_acts_portable(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for ((b, qb), d) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
    {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, v) in qb.iter_mut().zip(b) {
            *q = (v * inv).round_ties_even() as i8;
        }
    }
}
