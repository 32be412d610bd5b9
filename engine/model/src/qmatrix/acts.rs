//! Decode's quantized activations (`--activations int8|int16|auto`, [`super::Activations`]):
//! a vector quantized to 8 or 16 bits per 32-value block, for the products that multiply codes
//! with codes, and which matrices take them and through which kernels.

use super::{Activations, BLOCK, Isa, Kind, QMatrix, blocks};
#[cfg(target_arch = "x86_64")]
use crate::simd;

/// Activations quantized per 32-value block: `x ≈ d (q + lo / 256)`, with `lo` empty for 8-bit
/// ones.
pub(super) struct QuantizedActs {
    pub(super) q: Vec<i8>,
    pub(super) lo: Vec<i8>,
    pub(super) d: Vec<f32>,
}

/// What a product reads of [`QuantizedActs`]: the codes, and the remainders for 16-bit
/// activations (`lo` empty for 8-bit ones).
#[derive(Clone, Copy)]
pub(super) struct Codes<'a> {
    pub(super) q: &'a [i8],
    pub(super) lo: &'a [i8],
    pub(super) d: &'a [f32],
}

impl QuantizedActs {
    /// The activations as a product of `taken` reads them: 16-bit ones, or their 8-bit codes
    /// alone (the same codes: `q` is the 8-bit quantization either way).
    pub(super) fn codes(&self, taken: Taken) -> Codes<'_> {
        let lo: &[i8] = if taken == Taken::Int16 { &self.lo } else { &[] };
        Codes {
            q: &self.q,
            lo,
            d: &self.d,
        }
    }

    /// Each block's `d Σ (q + lo / 256)` for the products that read `taken` (the minimum term
    /// of Q4_1 and the K-quants): the sum of the activations the product multiplies, so the
    /// product is exactly `Σ w x̂`; with the exact sum, the activations' rounding errors would
    /// multiply the uncentred `d_w q` instead of the weights.
    pub(super) fn sums(&self, taken: Taken) -> Vec<f32> {
        let c = self.codes(taken);
        (0..c.d.len())
            .map(|b| {
                let q: i32 = c.q[b * BLOCK..(b + 1) * BLOCK]
                    .iter()
                    .map(|&v| i32::from(v))
                    .sum();
                if c.lo.is_empty() {
                    c.d[b] * q as f32
                } else {
                    let l: i32 = c.lo[b * BLOCK..(b + 1) * BLOCK]
                        .iter()
                        .map(|&v| i32::from(v))
                        .sum();
                    c.d[b] * ((256 * q + l) as f32 / 256.0)
                }
            })
            .collect()
    }
}

/// Which activations a matrix's product takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Taken {
    F32,
    Int8,
    Int16,
}

/// Quantizes `x` (a multiple of 32 long) per 32-value block: `d = amax / 127`, codes rounded
/// to nearest, ties to even, and for 16-bit activations (`sixteen`) each value's remainder in
/// 256ths of a step, on the best path this CPU has (every path gives the same bits).
pub(super) fn quantize_acts(x: &[f32], sixteen: bool) -> QuantizedActs {
    let nb = x.len() / BLOCK;
    let (mut q, mut d) = (vec![0i8; nb * BLOCK], vec![0f32; nb]);
    let mut lo = if sixteen {
        vec![0i8; nb * BLOCK]
    } else {
        Vec::new()
    };
    // The quantizer of the best path within `LLMS_ISA`, so a capped run does what that CPU
    // would do.
    #[cfg(target_arch = "x86_64")]
    match Isa::best() {
        Isa::Avx512 if simd::vnni::available() => {
            // SAFETY: the CPU has the kernels' features (checked just above); they check the
            // sizes.
            unsafe {
                if sixteen {
                    simd::vnni::quantize16(x, &mut q, &mut lo, &mut d);
                } else {
                    simd::vnni::quantize(x, &mut q, &mut d);
                }
            }
            return QuantizedActs { q, lo, d };
        }
        Isa::Avx2 | Isa::Avx512 => {
            // SAFETY: the path has AVX2, FMA and F16C; lo holds x.len() values when sixteen.
            unsafe {
                if sixteen {
                    simd::avx2::split_int8::quantize::<true>(x, &mut q, &mut lo, &mut d);
                } else {
                    simd::avx2::split_int8::quantize::<false>(x, &mut q, &mut [], &mut d);
                }
            }
            return QuantizedActs { q, lo, d };
        }
        Isa::Portable => {}
    }
    quantize_acts_portable(x, &mut q, &mut d);
    if sixteen {
        remainders_portable(x, &q, &d, &mut lo);
    }
    QuantizedActs { q, lo, d }
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

/// The remainders of 16-bit activations in plain Rust: `round((x / d - q) · 256)`, ties to
/// even, clamped to -127..=127 (only a remainder of exactly half a step is clamped; AVX2's
/// Q8_0 kernel negates remainders, and -128 has no negation in a byte), with `x / d` taken as
/// `x · (127 / amax)`, as the quantizer took it.
pub(crate) fn remainders_portable(x: &[f32], q: &[i8], d: &[f32], lo: &mut [i8]) {
    for (((b, qb), lb), &d) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact(BLOCK))
        .zip(lo.chunks_exact_mut(BLOCK))
        .zip(d)
    {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        debug_assert_eq!(d, amax / 127.0);
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for ((l, v), &c) in lb.iter_mut().zip(b).zip(qb) {
            let rest = (v * inv - f32::from(c)) * 256.0;
            *l = rest.round_ties_even().clamp(-127.0, 127.0) as i8;
        }
    }
}

impl QMatrix {
    /// Which activations this matrix's product on `isa` takes under `acts`.
    pub(super) fn taken(&self, isa: Isa, acts: Activations) -> Taken {
        match acts {
            Activations::F32 => Taken::F32,
            Activations::Int8 if self.kind != Kind::F32 => Taken::Int8,
            Activations::Int16 | Activations::Auto if self.has_int16_rows(isa) => Taken::Int16,
            Activations::Auto if self.kind.is_raw() && self.has_int8_rows(isa) => Taken::Int8,
            _ => Taken::F32,
        }
    }

    /// Whether `isa` has a kernel over 16-bit activations for this matrix: Q4_1 and Q8_0 with
    /// AVX2 (AVX-512 VNNI where the CPU has it, which [`Self::rows_dot_q8`] takes instead).
    pub(super) fn has_int16_rows(&self, isa: Isa) -> bool {
        isa.has_avx2() && matches!(self.kind, Kind::Q4_1 | Kind::Q8_0)
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
        x: Codes,
        xsum: &[f32],
        out: &mut [f32],
    ) -> bool {
        // Only the Q4_1 and Q8_0 kernels (VNNI and AVX2) read remainders (`has_int16_rows`).
        debug_assert!(x.lo.is_empty() || self.has_int16_rows(isa));
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
                        simd::vnni::blocks::matvec(self.kind, raw, x.q, x.d, xsum, out)
                    } else {
                        simd::avx2::blocks_int8::matvec(self.kind, raw, x.q, x.d, xsum, out)
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
                        simd::vnni::matvec_q4_1(d, m, qs, x.q, x.lo, x.d, xsum, out);
                    } else {
                        simd::avx2::split_int8::matvec_q4_1(d, m, qs, x.q, x.lo, x.d, xsum, out);
                    }
                    return true;
                },
                // SAFETY: as above.
                Kind::Q8_0 => unsafe {
                    let (d, qs) = (&self.d[b0..b1], &self.qs[b0 * 32..b1 * 32]);
                    if vnni {
                        simd::vnni::matvec_q8_0(d, qs, x.q, x.lo, x.d, out);
                    } else {
                        simd::avx2::split_int8::matvec_q8_0(d, qs, x.q, x.lo, x.d, out);
                    }
                    return true;
                },
                _ => {}
            }
        }
        let _ = (isa, r0, x, xsum, out);
        false
    }

    /// Row `r` · the quantized activations `x`, portably: the paths without a several-rows
    /// kernel (8-bit activations only for the formats read as the file's blocks).
    pub(super) fn row_dot_q8(&self, r: usize, x: Codes, xsum: &[f32]) -> f32 {
        let nb = self.cols / BLOCK;
        if self.kind.is_raw() {
            debug_assert!(x.lo.is_empty(), "16-bit activations on {:?}", self.kind);
            return blocks::dot_row_q8(self.kind, self.raw_row(r), x.q, x.d, xsum);
        }
        // 16-bit activations as integers in 256ths of a step: 256 q + lo.
        let sixteen = !x.lo.is_empty();
        let unit = if sixteen { 1.0 / 256.0 } else { 1.0 };
        let act = |i: usize| {
            if sixteen {
                256 * i32::from(x.q[i]) + i32::from(x.lo[i])
            } else {
                i32::from(x.q[i])
            }
        };
        let d = &self.d[r * nb..(r + 1) * nb];
        match self.kind {
            Kind::Q4_1 => {
                let m = &self.m[r * nb..(r + 1) * nb];
                let qs = &self.qs[r * nb * 16..(r + 1) * nb * 16];
                let mut acc = 0.0;
                for b in 0..nb {
                    let (q, o) = (&qs[b * 16..(b + 1) * 16], b * 32);
                    let s: i32 = (0..16)
                        .map(|j| {
                            let (a, c) = (o + j, o + j + 16);
                            i32::from(q[j] & 0xF) * act(a) + i32::from(q[j] >> 4) * act(c)
                        })
                        .sum();
                    acc += d[b].to_f32() * (x.d[b] * unit) * s as f32 + m[b].to_f32() * xsum[b];
                }
                acc
            }
            Kind::Q8_0 => {
                let qs = &self.qs[r * nb * 32..(r + 1) * nb * 32];
                let mut acc = 0.0;
                for b in 0..nb {
                    let s: i32 = qs[b * 32..(b + 1) * 32]
                        .iter()
                        .enumerate()
                        .map(|(j, &w)| i32::from(w as i8) * act(b * 32 + j))
                        .sum();
                    acc += d[b].to_f32() * (x.d[b] * unit) * s as f32;
                }
                acc
            }
            _ => unreachable!("f32 matrices take f32 activations; the raw formats return above"),
        }
    }
}
