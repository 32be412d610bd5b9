//! Decode's int8 activations (`--activations int8|auto`, [`super::Activations`]): a vector
//! quantized to 8 bits per 32-value block, for the products that multiply codes with codes,
//! and which matrices take them and through which kernels.

use super::{Activations, BLOCK, Isa, Kind, QMatrix, blocks};
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

impl QMatrix {
    /// Whether this matrix's product on `isa` takes the activations as int8 codes under `acts`.
    pub(super) fn takes_int8(&self, isa: Isa, acts: Activations) -> bool {
        match acts {
            Activations::F32 => false,
            Activations::Int8 => self.kind != Kind::F32,
            Activations::Auto => self.kind.is_raw() && self.has_int8_rows(isa),
        }
    }

    /// Whether `isa` has a several-rows-a-pass kernel over int8 activations for this matrix:
    /// every block format has one on AVX2 (and on AVX-512 VNNI, where [`Self::rows_dot_q8`]
    /// takes that instead).
    pub(super) fn has_int8_rows(&self, isa: Isa) -> bool {
        isa.has_avx2() && self.kind != Kind::F32
    }

    /// `out[i]` = row `r0 + i` · the int8 activations `x` for every `i`, several rows a pass,
    /// where the path has such a kernel for this matrix's format (AVX-512 VNNI, else AVX2:
    /// every block format); returns whether it had one.
    pub(super) fn rows_dot_q8(
        &self,
        isa: Isa,
        r0: usize,
        x: &QuantizedActs,
        xsum: &[f32],
        out: &mut [f32],
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.has_int8_rows(isa) {
            let nb = self.cols / BLOCK;
            let (b0, b1) = (r0 * nb, (r0 + out.len()) * nb);
            let vnni = isa == Isa::Avx512 && simd::vnni::available();
            if self.kind.is_raw() {
                let rb = self.kind.bytes_of(self.cols);
                let raw = &self.qs[r0 * rb..(r0 + out.len()) * rb];
                // SAFETY: the CPU has the kernels' features (AVX-512 VNNI if `vnni`, else AVX2,
                // FMA and F16C: `has_int8_rows`); raw holds the rows' whole blocks (the kernels
                // check the sizes).
                unsafe {
                    if vnni {
                        simd::vnni::blocks::matvec(self.kind, raw, &x.q, &x.d, xsum, out)
                    } else {
                        simd::avx2::blocks_int8::matvec(self.kind, raw, &x.q, &x.d, xsum, out)
                    }
                }
                return true;
            }
            match self.kind {
                // SAFETY: the CPU has the kernels' features (`has_int8_rows`: AVX-512 VNNI if
                // `vnni`, else AVX2, FMA and F16C); the slices hold nb blocks for each of the
                // out.len() rows (the kernels check the sizes).
                Kind::Q4_1 => unsafe {
                    let (d, m, qs) = (&self.d[b0..b1], &self.m[b0..b1], &self.qs[b0 * 16..b1 * 16]);
                    if vnni {
                        simd::vnni::matvec_q4_1(d, m, qs, &x.q, &x.d, xsum, out);
                    } else {
                        simd::avx2::split_int8::matvec_q4_1(d, m, qs, &x.q, &x.d, xsum, out);
                    }
                    return true;
                },
                // SAFETY: as above.
                Kind::Q8_0 => unsafe {
                    let (d, qs) = (&self.d[b0..b1], &self.qs[b0 * 32..b1 * 32]);
                    if vnni {
                        simd::vnni::matvec_q8_0(d, qs, &x.q, &x.d, out);
                    } else {
                        simd::avx2::split_int8::matvec_q8_0(d, qs, &x.q, &x.d, out);
                    }
                    return true;
                },
                _ => {}
            }
        }
        let _ = (isa, r0, x, xsum, out);
        false
    }

    /// Row `r` · the int8 activations `x`, portably: the paths without a several-rows kernel.
    pub(super) fn row_dot_q8(&self, r: usize, x: &QuantizedActs, xsum: &[f32]) -> f32 {
        let nb = self.cols / BLOCK;
        if self.kind.is_raw() {
            return blocks::dot_row_q8(self.kind, self.raw_row(r), &x.q, &x.d, xsum);
        }
        let d = &self.d[r * nb..(r + 1) * nb];
        match self.kind {
            Kind::Q4_1 => {
                let m = &self.m[r * nb..(r + 1) * nb];
                let qs = &self.qs[r * nb * 16..(r + 1) * nb * 16];
                let mut acc = 0.0;
                for b in 0..nb {
                    let (q, xb) = (&qs[b * 16..(b + 1) * 16], &x.q[b * 32..(b + 1) * 32]);
                    let s: i32 = (0..16)
                        .map(|j| {
                            i32::from(q[j] & 0xF) * i32::from(xb[j])
                                + i32::from(q[j] >> 4) * i32::from(xb[j + 16])
                        })
                        .sum();
                    acc += d[b].to_f32() * x.d[b] * s as f32 + m[b].to_f32() * xsum[b];
                }
                acc
            }
            Kind::Q8_0 => {
                let qs = &self.qs[r * nb * 32..(r + 1) * nb * 32];
                let mut acc = 0.0;
                for b in 0..nb {
                    let s: i32 = qs[b * 32..(b + 1) * 32]
                        .iter()
                        .zip(&x.q[b * 32..(b + 1) * 32])
                        .map(|(&w, &a)| i32::from(w as i8) * i32::from(a))
                        .sum();
                    acc += d[b].to_f32() * x.d[b] * s as f32;
                }
                acc
            }
            _ => unreachable!("f32 matrices take f32 activations; the raw formats return above"),
        }
    }
}
