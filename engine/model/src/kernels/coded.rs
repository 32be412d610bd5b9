//! Decode attention over chunks of unsigned codes in integers: the query rows and the attention
//! weights folded with a chunk's scales and rounded to bytes, multiplied with the codes by
//! `vpdpbusd` (`simd::vnni::kv`, AVX-512 VNNI and VBMI) or `vpmaddubsw`/`vpmaddwd`
//! (`simd::avx2::coded`, AVX2), the same rounding on both; [`CodedPath`] chooses the kernels.
//! The f32 kernels ([`super::dot_rows_codes`], [`super::axpy_rows_codes`]) stay the reference;
//! [`KvArith`] chooses between them.

use crate::qmatrix::IsaCap;
pub use crate::simd::ValueGroups;
use std::sync::OnceLock;

/// How decode attention multiplies a chunk of codes: in f32 (every code converted, the
/// reference), or with the folded rows rounded to bytes and multiplied in integers where the
/// CPU can (AVX-512 VNNI and VBMI, or AVX2; f32 on the portable path).
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
        match (KvArith::get(), CodedPath::best()) {
            (KvArith::Int8, Some(CodedPath::Vnni)) => {
                "int8: vnni::kv::dot_rows_coded/axpy_rows_coded, folded rows rounded to bytes, vpdpbusd over 4- and 8-bit keys and 2- to 8-bit values, 16 tokens a block"
            }
            (KvArith::Int8, Some(CodedPath::Avx2)) => {
                "int8: avx2::coded::dot_rows_coded/axpy_rows_coded, folded rows rounded to bytes, vpmaddubsw over 4-bit keys and 2- to 4-bit values (vpmaddwd over 8-bit ones), 16 tokens a block"
            }
            (KvArith::Int8, None) => {
                "f32: the portable kernels below (int8 asked; the portable path has no integer kernels)"
            }
            (KvArith::F32, _) if crate::qmatrix::Isa::best() == crate::qmatrix::Isa::Portable => {
                "f32: the portable kernels below"
            }
            (KvArith::F32, _) => "f32: the kernels below",
        }
    }
}

/// The integer kernels of decode attention a CPU can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodedPath {
    /// `simd::avx2::coded`: `vpmaddubsw` and `vpmaddwd` on 256 bits (AVX2, FMA and F16C).
    Avx2,
    /// `simd::vnni::kv`: `vpdpbusd` on 512 bits (AVX-512 VNNI and VBMI).
    Vnni,
}

impl CodedPath {
    /// Whether this CPU has the path's instructions.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        match self {
            CodedPath::Avx2 => crate::simd::avx2::coded::available(),
            CodedPath::Vnni => crate::simd::vnni::kv::available(),
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// The path decode attention takes: the widest the CPU has within `LLMS_ISA`'s cap
    /// ([`IsaCap`]: `avx2` and `avx2-vnni` take [`CodedPath::Avx2`]), none on the portable
    /// path.
    pub fn best() -> Option<CodedPath> {
        static BEST: OnceLock<Option<CodedPath>> = OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = IsaCap::get();
            if cap >= IsaCap::Avx512 && CodedPath::Vnni.available() {
                Some(CodedPath::Vnni)
            } else if cap >= IsaCap::Avx2 && CodedPath::Avx2.available() {
                Some(CodedPath::Avx2)
            } else {
                None
            }
        })
    }

    /// Every path this CPU can run (for the tests, which run each).
    pub fn all_available() -> Vec<CodedPath> {
        [CodedPath::Avx2, CodedPath::Vnni]
            .into_iter()
            .filter(|p| p.available())
            .collect()
    }
}

/// Whether decode attention multiplies codes in integers on this CPU within `LLMS_ISA`'s cap
/// (a [`CodedPath`] is there).
pub fn int8_available() -> bool {
    CodedPath::best().is_some()
}

/// Dispatches on the path, the code width and the rows of one call (`keys`: 4- and 8-bit
/// codes only, the widths the scores' kernel takes).
#[cfg(target_arch = "x86_64")]
macro_rules! coded_kernel {
    (@keys $($f:ident)::+, $bits:expr, $rows:expr, ($($arg:expr),*)) => {{
        match ($bits, $rows) {
            (4, 1) => $($f)::+::<4, 1>($($arg),*),
            (4, 2) => $($f)::+::<4, 2>($($arg),*),
            (4, 3) => $($f)::+::<4, 3>($($arg),*),
            (4, _) => $($f)::+::<4, 4>($($arg),*),
            (_, 1) => $($f)::+::<8, 1>($($arg),*),
            (_, 2) => $($f)::+::<8, 2>($($arg),*),
            (_, 3) => $($f)::+::<8, 3>($($arg),*),
            (_, _) => $($f)::+::<8, 4>($($arg),*),
        }
    }};
    (@all $($f:ident)::+, $bits:expr, $rows:expr, ($($arg:expr),*)) => {{
        match ($bits, $rows) {
            (2, 1) => $($f)::+::<2, 1>($($arg),*),
            (2, 2) => $($f)::+::<2, 2>($($arg),*),
            (2, 3) => $($f)::+::<2, 3>($($arg),*),
            (2, _) => $($f)::+::<2, 4>($($arg),*),
            (3, 1) => $($f)::+::<3, 1>($($arg),*),
            (3, 2) => $($f)::+::<3, 2>($($arg),*),
            (3, 3) => $($f)::+::<3, 3>($($arg),*),
            (3, _) => $($f)::+::<3, 4>($($arg),*),
            (4, 1) => $($f)::+::<4, 1>($($arg),*),
            (4, 2) => $($f)::+::<4, 2>($($arg),*),
            (4, 3) => $($f)::+::<4, 3>($($arg),*),
            (4, _) => $($f)::+::<4, 4>($($arg),*),
            (_, 1) => $($f)::+::<8, 1>($($arg),*),
            (_, 2) => $($f)::+::<8, 2>($($arg),*),
            (_, 3) => $($f)::+::<8, 3>($($arg),*),
            (_, _) => $($f)::+::<8, 4>($($arg),*),
        }
    }};
    ($path:expr, @$kind:ident $f:ident, $bits:expr, $rows:expr, ($($arg:expr),*)) => {{
        match $path {
            CodedPath::Vnni => {
                coded_kernel!(@$kind crate::simd::vnni::kv::$f, $bits, $rows, ($($arg),*))
            }
            CodedPath::Avx2 => {
                coded_kernel!(@$kind crate::simd::avx2::coded::$f, $bits, $rows, ($($arg),*))
            }
        }
    }};
}

/// Scores of `q.len() / hd` query rows (one after another) against `n` keys of `bits`-bit
/// codes with a minimum and a scale per channel, in integers:
/// `out[r · stride + j] = Σ_d q[r · hd + d] · (mins[d] + scales[d] · code(j, d))`, key j's codes
/// from packed value `first + j · hd`. Returns false, writing nothing, where the integer
/// kernels do not take the shape or the CPU lacks them ([`CodedPath::best`]); the caller then
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
    CodedPath::best().is_some_and(|path| {
        dot_rows_coded_on(
            path, q, hd, mins, scales, codes, first, bits, out, stride, n,
        )
    })
}

/// [`dot_rows_coded`] on a given path (which must be [`CodedPath::available`]).
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_coded_on(
    path: CodedPath,
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
    assert!(path.available(), "{path:?} kernels on a CPU without them");
    if !(matches!(bits, 4 | 8) && hd.is_multiple_of(64)) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    for (r0, rows) in q.chunks(4 * hd).enumerate() {
        let out = &mut out[4 * r0 * stride..];
        for j in (0..n).step_by(16) {
            let m = (n - j).min(16);
            let (k, at) = (rows.len() / hd, first + j * hd);
            // SAFETY: the CPU has the path's kernels (asserted); they check the sizes.
            unsafe {
                coded_kernel!(
                    path,
                    @keys dot_rows_coded,
                    bits,
                    k,
                    (rows, hd, mins, scales, codes, at, &mut out[j..], stride, m)
                )
            };
        }
    }
    true
}

/// Sums of `n` value rows of `bits`-bit codes with a minimum and a scale per token and group of
/// channels ([`ValueGroups`]: the whole head, or Gemma 3's 32 channels), weighted for
/// `o.len() / hd` output rows (one after another), in integers:
/// `o[r · hd + d] += Σ_i w[r · wstride + i] · (mins[j] + scales[j] · code(i, d))`, `j` the index
/// of token i's group of channel d, value row i's codes from packed value `first + i · hd`;
/// weights and scales must not be negative (a negative product counts as 0). Returns false,
/// changing nothing, where the integer kernels do not take the shape (as [`dot_rows_coded`]).
#[allow(clippy::too_many_arguments)]
pub fn axpy_rows_coded(
    o: &mut [f32],
    hd: usize,
    w: &[f32],
    wstride: usize,
    n: usize,
    mins: &[f32],
    scales: &[f32],
    groups: ValueGroups,
    codes: &[u8],
    first: usize,
    bits: usize,
) -> bool {
    CodedPath::best().is_some_and(|path| {
        axpy_rows_coded_on(
            path, o, hd, w, wstride, n, mins, scales, groups, codes, first, bits,
        )
    })
}

/// [`axpy_rows_coded`] on a given path (which must be [`CodedPath::available`]).
#[allow(clippy::too_many_arguments)]
pub fn axpy_rows_coded_on(
    path: CodedPath,
    o: &mut [f32],
    hd: usize,
    w: &[f32],
    wstride: usize,
    n: usize,
    mins: &[f32],
    scales: &[f32],
    groups: ValueGroups,
    codes: &[u8],
    first: usize,
    bits: usize,
) -> bool {
    assert!(path.available(), "{path:?} kernels on a CPU without them");
    if !(matches!(bits, 2 | 3 | 4 | 8) && hd.is_multiple_of(64) && groups.fits(hd)) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    for (r0, rows) in o.chunks_mut(4 * hd).enumerate() {
        let w = &w[4 * r0 * wstride..];
        for i in (0..n).step_by(16) {
            let m = (n - i).min(16);
            let k = rows.len() / hd;
            let (mins, scales) = (&mins[i..], &scales[i..]);
            let (rows, w) = (&mut *rows, &w[i..]);
            // SAFETY: the CPU has the path's kernels (asserted); they check the sizes.
            unsafe {
                coded_kernel!(
                    path,
                    @all axpy_rows_coded,
                    bits,
                    k,
                    (rows, hd, w, wstride, m, mins, scales, groups, codes, first + i * hd)
                )
            };
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    #[test]
    fn the_arithmetic_is_named_as_the_environment_says() {
        assert_eq!(KvArith::parse(""), Some(KvArith::Int8));
        assert_eq!(KvArith::parse(" INT8 "), Some(KvArith::Int8));
        assert_eq!(KvArith::parse("f32"), Some(KvArith::F32));
        assert_eq!(KvArith::parse("fp16"), None);
    }

    /// `n` rows of `hd` random `bits`-bit codes packed as the KV formats pack them (low bits
    /// first along the row), after `first` values of padding.
    fn packed(
        rng: &mut StdRng,
        bits: usize,
        first: usize,
        n: usize,
        hd: usize,
    ) -> (Vec<u8>, Vec<u32>) {
        let codes: Vec<u32> = (0..n * hd)
            .map(|_| rng.random_range(0..1u32 << bits))
            .collect();
        let mut bytes = vec![0u8; ((first + n * hd) * bits).div_ceil(8) + 1];
        for (i, &c) in codes.iter().enumerate() {
            let bit = (first + i) * bits;
            for b in 0..bits {
                if c >> b & 1 == 1 {
                    bytes[(bit + b) / 8] |= 1 << ((bit + b) % 8);
                }
            }
        }
        (bytes, codes)
    }

    fn rand_row(rng: &mut StdRng, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(lo..hi)).collect()
    }

    /// `rows` query rows against `n` keys on `path`, against f64: within half a step of each
    /// folded query value (the step of its piece of 64 channels) times its code.
    fn check_dot(path: CodedPath, rng: &mut StdRng, bits: usize, rows: usize, hd: usize, n: usize) {
        let first = 2 * hd;
        let (bytes, codes) = packed(rng, bits, first, n, hd);
        // Pieces of 64 channels ten times smaller each than the one before.
        let mut q = rand_row(rng, rows * hd, -2.0, 2.0);
        for (i, x) in q.iter_mut().enumerate() {
            *x *= 0.1f32.powi((i % hd / 64) as i32);
        }
        let mins = rand_row(rng, hd, -1.0, 0.0);
        let scales = rand_row(rng, hd, 0.001, 0.2);
        let stride = n + 3;
        let mut out = vec![f32::NAN; rows * stride];
        assert!(dot_rows_coded_on(
            path, &q, hd, &mins, &scales, &bytes, first, bits, &mut out, stride, n
        ));
        let at = format!("{path:?} bits {bits} rows {rows} hd {hd} n {n}");
        for r in 0..rows {
            let qr = &q[r * hd..(r + 1) * hd];
            let step: Vec<f32> = (0..hd)
                .map(|d| {
                    let piece = d / 64 * 64..d / 64 * 64 + 64;
                    let top = piece.map(|c| (qr[c] * scales[c]).abs()).fold(0.0, f32::max);
                    top / 127.0
                })
                .collect();
            for j in 0..n {
                let key = &codes[j * hd..(j + 1) * hd];
                let exact: f64 = (0..hd)
                    .map(|d| {
                        f64::from(qr[d])
                            * (f64::from(mins[d]) + f64::from(scales[d]) * f64::from(key[d]))
                    })
                    .sum();
                // Half a step of each folded query value times its code, and f32 rounding.
                let bound: f64 = key
                    .iter()
                    .zip(&step)
                    .map(|(&c, &st)| f64::from(st) / 2.0 * f64::from(c))
                    .sum::<f64>()
                    + 1e-4 * (1.0 + exact.abs());
                let got = f64::from(out[r * stride + j]);
                assert!(
                    (got - exact).abs() <= bound,
                    "{at}: row {r} key {j}: {got} against {exact} (bound {bound})"
                );
            }
            let past = &out[r * stride + n..(r + 1) * stride];
            assert!(
                past.iter().all(|x| x.is_nan()),
                "{at}: row {r} written past key {n}"
            );
        }
    }

    /// `rows` rows of weights over `n` value rows on `path`, against f64: within half a step
    /// of each folded weight (the step of its row, group of `vw` channels and block of 16
    /// tokens) times its code.
    #[allow(clippy::too_many_arguments)]
    fn check_axpy(
        path: CodedPath,
        rng: &mut StdRng,
        bits: usize,
        rows: usize,
        hd: usize,
        n: usize,
        vw: usize,
    ) {
        let first = 3 * hd;
        let (bytes, codes) = packed(rng, bits, first, n, hd);
        let wstride = n + 5;
        let w = rand_row(rng, rows * wstride, 0.0, 1.0);
        // Group g's parameters of token i at g · n + i.
        let groups = ValueGroups {
            width: vw,
            stride: n,
        };
        let np = (hd / vw * n).max(1);
        let mins = rand_row(rng, np, -1.0, 0.0);
        let scales = rand_row(rng, np, 0.001, 0.2);
        let o0 = rand_row(rng, rows * hd, -1.0, 1.0);
        let mut o = o0.clone();
        assert!(axpy_rows_coded_on(
            path, &mut o, hd, &w, wstride, n, &mins, &scales, groups, &bytes, first, bits
        ));
        let at = format!("{path:?} bits {bits} rows {rows} hd {hd} n {n} groups of {vw}");
        for r in 0..rows {
            let wr = &w[r * wstride..r * wstride + n];
            for d in 0..hd {
                let j = |i: usize| d / vw * n + i;
                let step = |i: usize| {
                    let block = i / 16 * 16..(i / 16 * 16 + 16).min(n);
                    block
                        .map(|t| (wr[t] * scales[j(t)]).abs())
                        .fold(0.0, f32::max)
                        / 255.0
                };
                let exact: f64 = f64::from(o0[r * hd + d])
                    + (0..n)
                        .map(|i| {
                            f64::from(wr[i])
                                * (f64::from(mins[j(i)])
                                    + f64::from(scales[j(i)]) * f64::from(codes[i * hd + d]))
                        })
                        .sum::<f64>();
                let bound: f64 = (0..n)
                    .map(|i| f64::from(step(i)) / 2.0 * f64::from(codes[i * hd + d]))
                    .sum::<f64>()
                    + 1e-4 * (1.0 + exact.abs());
                let got = f64::from(o[r * hd + d]);
                assert!(
                    (got - exact).abs() <= bound,
                    "{at}: row {r} channel {d}: {got} against {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn integer_scores_match_f64_within_the_query_rounding_on_every_path() {
        let mut rng = StdRng::seed_from_u64(7);
        for path in CodedPath::all_available() {
            for hd in [64, 128, 256, 512] {
                for n in [16, 1, 5, 13, 40] {
                    for (bits, rows) in [(4, 3), (8, 3), (4, 1), (8, 4), (4, 2), (4, 5), (8, 6)] {
                        check_dot(path, &mut rng, bits, rows, hd, n);
                    }
                }
            }
        }
    }

    #[test]
    fn integer_value_sums_match_f64_within_the_weights_rounding_on_every_path() {
        let mut rng = StdRng::seed_from_u64(8);
        for path in CodedPath::all_available() {
            for hd in [64, 128, 256] {
                for n in [16, 1, 6, 15, 0, 37] {
                    for (bits, rows) in [(2, 3), (3, 3), (4, 3), (8, 3), (3, 4), (4, 1), (8, 2)] {
                        check_axpy(path, &mut rng, bits, rows, hd, n, hd);
                    }
                    check_axpy(path, &mut rng, 3, 7, hd, n, hd);
                }
            }
        }
    }

    /// Values whose minimums and scales are per group of channels (Gemma 3's 32, and 64 or
    /// 128 in heads of 256): each group's weights folded and rounded on their own.
    #[test]
    fn integer_value_sums_in_groups_match_f64_on_every_path() {
        let mut rng = StdRng::seed_from_u64(10);
        for path in CodedPath::all_available() {
            for (hd, vw) in [(64, 32), (256, 32), (256, 64), (256, 128), (128, 64)] {
                for n in [16, 1, 13, 32, 37] {
                    for (bits, rows) in [(3, 4), (4, 4), (2, 1), (8, 3), (3, 2)] {
                        check_axpy(path, &mut rng, bits, rows, hd, n, vw);
                    }
                }
            }
        }
    }

    /// Every path the CPU has gives the same scores and sums up to f32 rounding: the same
    /// bytes multiplied, only the order of the float sums differs.
    #[test]
    fn the_integer_paths_agree() {
        let paths = CodedPath::all_available();
        let mut rng = StdRng::seed_from_u64(9);
        let (hd, n, rows) = (128, 16, 3);
        for bits in [2, 3, 4, 8] {
            let (bytes, _) = packed(&mut rng, bits, 0, n, hd);
            let q = rand_row(&mut rng, rows * hd, -2.0, 2.0);
            let w = rand_row(&mut rng, rows * n, 0.0, 1.0);
            let mins = rand_row(&mut rng, hd, -1.0, 0.0);
            let scales = rand_row(&mut rng, hd, 0.001, 0.2);
            let results: Vec<(Vec<f32>, Vec<f32>)> = paths
                .iter()
                .map(|&p| {
                    let mut s = vec![0.0; rows * n];
                    let mut o = vec![0.0; rows * hd];
                    let keys =
                        dot_rows_coded_on(p, &q, hd, &mins, &scales, &bytes, 0, bits, &mut s, n, n);
                    assert_eq!(keys, matches!(bits, 4 | 8));
                    let (m, sc, g) = (&mins[..n], &scales[..n], ValueGroups::whole(hd));
                    assert!(axpy_rows_coded_on(
                        p, &mut o, hd, &w, n, n, m, sc, g, &bytes, 0, bits
                    ));
                    (s, o)
                })
                .collect();
            for (p, r) in paths.iter().zip(&results).skip(1) {
                for (a, b) in [(&results[0].0, &r.0), (&results[0].1, &r.1)] {
                    for (x, y) in a.iter().zip(b) {
                        assert!(
                            (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                            "{p:?} against {:?}, bits {bits}: {y} vs {x}",
                            paths[0]
                        );
                    }
                }
            }
        }
    }
}
