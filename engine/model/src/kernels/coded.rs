//! Decode attention over chunks of unsigned codes in integers (`simd::vnni::kv`): the query
//! rows and the attention weights folded with a chunk's scales and rounded to bytes, multiplied
//! with the codes by `vpdpbusd`. The f32 kernels ([`super::dot_rows_codes`],
//! [`super::axpy_rows_codes`]) stay the reference; [`KvArith`] chooses between them.

use crate::qmatrix::IsaCap;
use std::sync::OnceLock;

/// How decode attention multiplies a chunk of codes: in f32 (every code converted, the
/// reference), or with the folded rows rounded to bytes and multiplied in integers where the
/// CPU can (AVX-512 VNNI and VBMI; f32 elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvArith {
    /// Every code converted to f32 and multiplied in f32: the reference.
    F32,
    /// The folded rows rounded to bytes and multiplied in integers, where the CPU can.
    Int8,
}

/// The environment variable that sets [`KvArith`] for a process: `f32` or `int8`.
pub const KV_ARITH_ENV: &str = "LLMS_KV_ARITH";

impl KvArith {
    /// The arithmetic new caches take ([`crate::kv::KvCache::arith`]): [`KV_ARITH_ENV`] read
    /// once, else int8 (an unknown value is logged and ignored).
    pub fn get() -> KvArith {
        static ARITH: OnceLock<KvArith> = OnceLock::new();
        *ARITH.get_or_init(|| {
            let v = std::env::var(KV_ARITH_ENV).unwrap_or_default();
            KvArith::parse(&v).unwrap_or_else(|| {
                tracing::warn!("{KV_ARITH_ENV}={v:?} is neither f32 nor int8: ignored");
                KvArith::Int8
            })
        })
    }

    /// The arithmetic a value names (the empty string: the default, int8).
    pub fn parse(v: &str) -> Option<KvArith> {
        match v.trim().to_ascii_lowercase().as_str() {
            "f32" => Some(KvArith::F32),
            "" | "int8" => Some(KvArith::Int8),
            _ => None,
        }
    }

    /// Whether this arithmetic runs the integer kernels here: int8, the CPU has them
    /// ([`int8_available`]).
    pub fn int8_here(self) -> bool {
        self == KvArith::Int8 && int8_available()
    }

    /// The kernels the arithmetic runs on this CPU, for the benchmarks' reports.
    pub fn describe() -> &'static str {
        if KvArith::get().int8_here() {
            "int8: vnni::kv::dot_rows_coded/axpy_rows_coded, folded rows rounded to bytes, vpdpbusd over 4- and 8-bit keys and 2- to 8-bit values, 16 tokens a block"
        } else if crate::qmatrix::Isa::best() == crate::qmatrix::Isa::Portable {
            "f32: the portable kernels below"
        } else if KvArith::get() == KvArith::Int8 {
            "f32: int8 asked, but this CPU has no AVX-512 VNNI and VBMI (or LLMS_ISA caps it)"
        } else {
            "f32: the kernels below"
        }
    }
}

/// Whether the CPU runs the integer kernels (AVX-512 VNNI and VBMI) and `LLMS_ISA` does not
/// cap the kernels below AVX-512.
pub fn int8_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        IsaCap::get() >= IsaCap::Avx512 && crate::simd::vnni::kv::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Dispatches on the code width and the rows of one call (`keys`: 4- and 8-bit codes only, the
/// widths the scores' kernel takes).
#[cfg(target_arch = "x86_64")]
macro_rules! coded_kernel {
    (keys $f:ident, $bits:expr, $rows:expr, ($($arg:expr),*)) => {{
        use crate::simd::vnni::kv::$f;
        match ($bits, $rows) {
            (4, 1) => $f::<4, 1>($($arg),*),
            (4, 2) => $f::<4, 2>($($arg),*),
            (4, 3) => $f::<4, 3>($($arg),*),
            (4, _) => $f::<4, 4>($($arg),*),
            (_, 1) => $f::<8, 1>($($arg),*),
            (_, 2) => $f::<8, 2>($($arg),*),
            (_, 3) => $f::<8, 3>($($arg),*),
            (_, _) => $f::<8, 4>($($arg),*),
        }
    }};
    ($f:ident, $bits:expr, $rows:expr, ($($arg:expr),*)) => {{
        use crate::simd::vnni::kv::$f;
        match ($bits, $rows) {
            (2, 1) => $f::<2, 1>($($arg),*),
            (2, 2) => $f::<2, 2>($($arg),*),
            (2, 3) => $f::<2, 3>($($arg),*),
            (2, _) => $f::<2, 4>($($arg),*),
            (3, 1) => $f::<3, 1>($($arg),*),
            (3, 2) => $f::<3, 2>($($arg),*),
            (3, 3) => $f::<3, 3>($($arg),*),
            (3, _) => $f::<3, 4>($($arg),*),
            (4, 1) => $f::<4, 1>($($arg),*),
            (4, 2) => $f::<4, 2>($($arg),*),
            (4, 3) => $f::<4, 3>($($arg),*),
            (4, _) => $f::<4, 4>($($arg),*),
            (_, 1) => $f::<8, 1>($($arg),*),
            (_, 2) => $f::<8, 2>($($arg),*),
            (_, 3) => $f::<8, 3>($($arg),*),
            (_, _) => $f::<8, 4>($($arg),*),
        }
    }};
}

/// Scores of `q.len() / hd` query rows (one after another) against `n` keys of `bits`-bit
/// codes with a minimum and a scale per channel, in integers:
/// `out[r · stride + j] = Σ_d q[r · hd + d] · (mins[d] + scales[d] · code(j, d))`, key j's codes
/// from packed value `first + j · hd`. Returns false, writing nothing, where the integer
/// kernels do not take the shape or the CPU lacks them ([`int8_available`]); the caller then
/// runs the f32 kernels.
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_coded(
    q: &[f32],
    hd: usize,
    mins: &[f32],
    scales: &[f32],
    codes: &[u8],
    first: usize,
    bits: usize,
    out: &mut [f32],
    stride: usize,
    n: usize,
) -> bool {
    if !(int8_available() && matches!(bits, 4 | 8) && hd.is_multiple_of(64)) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    for (r0, rows) in q.chunks(4 * hd).enumerate() {
        let out = &mut out[4 * r0 * stride..];
        for j in (0..n).step_by(16) {
            let m = (n - j).min(16);
            let (k, at) = (rows.len() / hd, first + j * hd);
            // SAFETY: the CPU has the kernels (`int8_available`); they check the sizes.
            unsafe {
                coded_kernel!(
                    keys dot_rows_coded,
                    bits,
                    k,
                    (rows, hd, mins, scales, codes, at, &mut out[j..], stride, m)
                )
            };
        }
    }
    true
}

/// Sums of `n` value rows of `bits`-bit codes with a minimum and a scale per row, weighted for
/// `o.len() / hd` output rows (one after another), in integers:
/// `o[r · hd + d] += Σ_i w[r · wstride + i] · (mins[i] + scales[i] · code(i, d))`, value row
/// i's codes from packed value `first + i · hd`; weights and scales must not be negative (a
/// negative product counts as 0). Returns false, changing nothing, where the integer kernels
/// do not take the shape (as [`dot_rows_coded`]).
#[allow(clippy::too_many_arguments)]
pub fn axpy_rows_coded(
    o: &mut [f32],
    hd: usize,
    w: &[f32],
    wstride: usize,
    n: usize,
    mins: &[f32],
    scales: &[f32],
    codes: &[u8],
    first: usize,
    bits: usize,
) -> bool {
    if !(int8_available() && matches!(bits, 2 | 3 | 4 | 8) && hd.is_multiple_of(64)) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    for (r0, rows) in o.chunks_mut(4 * hd).enumerate() {
        let w = &w[4 * r0 * wstride..];
        for i in (0..n).step_by(16) {
            let m = (n - i).min(16);
            let k = rows.len() / hd;
            let (mins, scales) = (&mins[i..], &scales[i..]);
            // SAFETY: the CPU has the kernels (`int8_available`); they check the sizes.
            unsafe {
                coded_kernel!(
                    axpy_rows_coded,
                    bits,
                    k,
                    (
                        &mut *rows,
                        hd,
                        &w[i..],
                        wstride,
                        m,
                        mins,
                        scales,
                        codes,
                        first + i * hd
                    )
                )
            };
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arithmetic_is_named_as_the_environment_says() {
        assert_eq!(KvArith::parse(""), Some(KvArith::Int8));
        assert_eq!(KvArith::parse(" INT8 "), Some(KvArith::Int8));
        assert_eq!(KvArith::parse("f32"), Some(KvArith::F32));
        assert_eq!(KvArith::parse("fp16"), None);
    }
}
