//! AVX2 + FMA + F16C kernels of decode attention, the 256-bit form of `simd::avx512`'s: keys'
//! dot products several keys per pass with their sums reduced together, weighted value sums held
//! in registers, f16 and packed 2-, 3-, 4- and 8-bit KV codes converted in registers (eight at
//! a time) and read in place by several query rows at once, and the coded parameters decoded
//! eight pairs at a time.

use super::hsum;
use crate::simd::{HALF, SIGNED8};
use std::arch::x86_64::*;

/// Four vectors' horizontal sums, lane `i` of the result being `Σ v[i]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce4(v: &[__m256; 4]) -> __m128 {
    let a = _mm256_hadd_ps(v[0], v[1]);
    let b = _mm256_hadd_ps(v[2], v[3]);
    // Per 128-bit lane: [Σ0, Σ1, Σ2, Σ3] partial sums of that lane's half.
    let s = _mm256_hadd_ps(a, b);
    _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s))
}

/// Eight vectors' horizontal sums, lane `i` of the result being `Σ v[i]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce8(v: &[__m256; 8]) -> __m256 {
    let a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // a's low lane holds the low halves' sums of v0..v3, its high lane their high halves'.
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a, b),
        _mm256_permute2f128_ps::<0x31>(a, b),
    )
}

/// Eight packed unsigned `BITS`-bit codes (2, 3, 4 or 8; code j in bits `BITS·j..` of the
/// little-endian bytes from `p`) as f32: sub-byte codes are one word of `BITS` bytes,
/// broadcast and shifted into place per lane with one `vpsrlvd`.
///
/// # Safety
/// The CPU must have AVX2; `p` must point at `BITS` readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_codes8<const BITS: usize>(p: *const u8) -> __m256 {
    // SAFETY: BITS readable bytes at `p` (the contract): 8 for 8-bit codes, else the word's.
    unsafe {
        if BITS == 8 {
            return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)));
        }
        let w = match BITS {
            4 => (p as *const u32).read_unaligned(),
            3 => u32::from((p as *const u16).read_unaligned()) | u32::from(*p.add(2)) << 16,
            _ => u32::from((p as *const u16).read_unaligned()),
        };
        let b = BITS as i32;
        let shifts = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
        let v = _mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts);
        _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << BITS) - 1)))
    }
}

/// Eight stored values of kind `K` (see [`SIGNED8`]) from value index `at` of `p` (on a byte),
/// as f32.
///
/// # Safety
/// The CPU must have AVX2 and F16C; the eight values must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_stored8<const K: usize>(p: *const u8, at: usize) -> __m256 {
    // SAFETY: in each branch the eight values from `at` are readable (the contract).
    unsafe {
        match K {
            SIGNED8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                p.add(at) as *const __m128i
            ))),
            HALF => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * at) as *const __m128i)),
            _ => load_codes8::<K>(p.add(at * K / 8)),
        }
    }
}

/// Whether `n` rows of `hd` values of kind `K` from value index `first` lie in `len` bytes,
/// each row starting on a byte.
fn stored_fits<const K: usize>(len: usize, first: usize, n: usize, hd: usize) -> bool {
    let bits = match K {
        SIGNED8 => 8,
        k => k,
    };
    (first * bits).is_multiple_of(8) && len * 8 >= (first + n * hd) * bits
}

/// `R` query rows against the same keys, each key's values loaded and converted once for all
/// rows: `out[r · stride + j] = bias[r] + Σ_d q[r · hd + d] · key(j, d)` for j < n. Four keys
/// per pass (`4 R` accumulators: sixteen registers hold no more at `R = 3`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `hd` a multiple of 8, `q` at least `R · hd` long,
/// `out` at least `(R - 1) · stride + n`, and `key(j, d)` valid for every j < n and
/// d + 8 <= hd.
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows_multi_by<const R: usize>(
    q: &[f32],
    hd: usize,
    bias: [f32; R],
    out: &mut [f32],
    stride: usize,
    n: usize,
    key: impl Fn(usize, usize) -> __m256,
) {
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    let mut j = 0;
    while j + 4 <= n {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        for d in (0..hd).step_by(8) {
            for k in 0..4 {
                let kv = key(j + k, d);
                for r in 0..R {
                    // SAFETY: r · hd + d + 8 <= R · hd <= q.len() (the contract).
                    let qv = unsafe { _mm256_loadu_ps(qp.add(r * hd + d)) };
                    acc[r][k] = _mm256_fmadd_ps(kv, qv, acc[r][k]);
                }
            }
        }
        for r in 0..R {
            let sums = _mm_add_ps(reduce4(&acc[r]), _mm_set1_ps(bias[r]));
            // SAFETY: r · stride + j + 4 <= (R - 1) · stride + n <= out.len().
            unsafe { _mm_storeu_ps(op.add(r * stride + j), sums) };
        }
        j += 4;
    }
    while j < n {
        let mut acc = [_mm256_setzero_ps(); R];
        for d in (0..hd).step_by(8) {
            let kv = key(j, d);
            for r in 0..R {
                // SAFETY: as above.
                let qv = unsafe { _mm256_loadu_ps(qp.add(r * hd + d)) };
                acc[r] = _mm256_fmadd_ps(kv, qv, acc[r]);
            }
        }
        for r in 0..R {
            // SAFETY: r · stride + j < out.len(), as above.
            unsafe { *op.add(r * stride + j) = bias[r] + hsum(acc[r]) };
        }
        j += 1;
    }
}

/// `R` output rows summed from the same value rows, each value row loaded and converted once
/// for all rows: `o[r · hd + d] += bias[r] + Σ_i w[r · wstride + i] · val(i, d)` for i < n,
/// 32 dimensions at a time in registers.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `hd` a multiple of 8, `o` at least `R · hd` long, `w`
/// at least `(R - 1) · wstride + n`, and `val(i, d)` valid for every i < n and d + 8 <= hd.
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_rows_multi_by<const R: usize>(
    o: &mut [f32],
    hd: usize,
    bias: [f32; R],
    w: &[f32],
    wstride: usize,
    n: usize,
    val: impl Fn(usize, usize) -> __m256,
) {
    let (op, wp) = (o.as_mut_ptr(), w.as_ptr());
    for d0 in (0..hd).step_by(32) {
        let nv = ((hd - d0) / 8).min(4);
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        for r in 0..R {
            for v in 0..nv {
                // SAFETY: r · hd + d0 + 8 v + 8 <= R · hd <= o.len() (the contract).
                acc[r][v] = _mm256_add_ps(
                    unsafe { _mm256_loadu_ps(op.add(r * hd + d0 + 8 * v)) },
                    _mm256_set1_ps(bias[r]),
                );
            }
        }
        for i in 0..n {
            // SAFETY: r · wstride + i < (R - 1) · wstride + n <= w.len().
            let wb: [__m256; R] =
                std::array::from_fn(|r| _mm256_set1_ps(unsafe { *wp.add(r * wstride + i) }));
            for v in 0..nv {
                let vv = val(i, d0 + 8 * v);
                for r in 0..R {
                    acc[r][v] = _mm256_fmadd_ps(wb[r], vv, acc[r][v]);
                }
            }
        }
        for r in 0..R {
            for v in 0..nv {
                // SAFETY: as the loads above.
                unsafe { _mm256_storeu_ps(op.add(r * hd + d0 + 8 * v), acc[r][v]) };
            }
        }
    }
}

/// [`dot_rows_multi_by`] over keys stored as values of kind `K` (see [`SIGNED8`]): key j's
/// start at value `first + j · hd` of `codes`. Scales per channel are folded into `q` and
/// minimums into `bias` by the caller.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows_stored<const K: usize, const R: usize>(
    q: &[f32],
    hd: usize,
    bias: [f32; R],
    codes: &[u8],
    first: usize,
    out: &mut [f32],
    stride: usize,
    n: usize,
) {
    assert!(
        hd.is_multiple_of(8)
            && stored_fits::<K>(codes.len(), first, n, hd)
            && q.len() >= R * hd
            && out.len() >= (R - 1) * stride + n,
        "avx2::dot_rows_stored: bad sizes"
    );
    let cp = codes.as_ptr();
    // SAFETY: values d..d + 8 of key j < n lie inside `codes` (asserted).
    let key = |j: usize, d: usize| unsafe { load_stored8::<K>(cp, first + j * hd + d) };
    // SAFETY: the CPU has the features (this function's contract); sizes asserted above.
    unsafe { dot_rows_multi_by::<R>(q, hd, bias, out, stride, n, key) }
}

/// [`axpy_rows_multi_by`] over value rows stored as values of kind `K` (row i from value
/// `first + i · hd`). Scales per row are folded into `w` and minimums into `bias` by the
/// caller.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_rows_stored<const K: usize, const R: usize>(
    o: &mut [f32],
    hd: usize,
    bias: [f32; R],
    w: &[f32],
    wstride: usize,
    n: usize,
    codes: &[u8],
    first: usize,
) {
    assert!(
        hd.is_multiple_of(8)
            && stored_fits::<K>(codes.len(), first, n, hd)
            && o.len() >= R * hd
            && w.len() >= (R - 1) * wstride + n,
        "avx2::axpy_rows_stored: bad sizes"
    );
    let cp = codes.as_ptr();
    // SAFETY: values d..d + 8 of row i < n lie inside `codes` (asserted).
    let val = |i: usize, d: usize| unsafe { load_stored8::<K>(cp, first + i * hd + d) };
    // SAFETY: the CPU has the features (this function's contract); sizes asserted above.
    unsafe { axpy_rows_multi_by::<R>(o, hd, bias, w, wstride, n, val) }
}

/// The AVX2 body of [`crate::kernels::decode_coded_params`]: eight (minimum code, scale code)
/// byte pairs at a time; returns how many pairs it decoded (the whole vectors'), and the caller
/// decodes the rest.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn decode_coded_params(
    pairs: &[u8],
    amax: f32,
    step: f32,
    steps: &[f32; 8],
    mins: &mut [f32],
    scales: &mut [f32],
) -> usize {
    let n = mins.len();
    assert!(
        scales.len() == n && pairs.len() >= 2 * n,
        "avx2::decode_coded_params: bad sizes"
    );
    let (pp, mp, sp) = (pairs.as_ptr(), mins.as_mut_ptr(), scales.as_mut_ptr());
    let (va, vstep) = (_mm256_set1_ps(amax), _mm256_set1_ps(step));
    // SAFETY: `steps` holds eight f32.
    let table = unsafe { _mm256_loadu_ps(steps.as_ptr()) };
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: pairs i..i + 8 are 16 bytes inside `pairs` (asserted).
        let x = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(pp.add(2 * i) as *const __m128i) });
        // Each lane holds one pair, little end first: the minimum code (signed) in bits
        // 0..8, the scale code in bits 8..16.
        let m = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(x));
        let j = _mm256_srli_epi32::<8>(x);
        let frac = _mm256_permutevar8x32_ps(table, _mm256_and_si256(j, _mm256_set1_epi32(7)));
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(
            _mm256_set1_epi32(127),
            _mm256_srli_epi32::<3>(j),
        )));
        // (amax · step) · 2^-k, in that order: the portable path's rounding.
        let scale = _mm256_mul_ps(_mm256_mul_ps(va, frac), pow2);
        // SAFETY: i + 8 <= n = mins.len() = scales.len().
        unsafe {
            _mm256_storeu_ps(mp.add(i), _mm256_mul_ps(_mm256_cvtepi32_ps(m), vstep));
            _mm256_storeu_ps(sp.add(i), scale);
        }
        i += 8;
    }
    i
}

/// The AVX2 body of [`crate::kernels::decode_codes`] for one code width.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn decode_codes<const BITS: usize>(
    codes: &[u8],
    first: usize,
    hd: usize,
    mins: &[f32],
    scales: &[f32],
    per_row: bool,
    out: &mut [f32],
) {
    let rows = out.len() / hd.max(1);
    let params = if per_row { rows } else { hd };
    assert!(
        hd.is_multiple_of(8)
            && out.len() == rows * hd
            && (first * BITS).is_multiple_of(8)
            && codes.len() * 8 >= (first + rows * hd) * BITS
            && mins.len() >= params
            && scales.len() >= params,
        "avx2::decode_codes: bad sizes"
    );
    let (cp, op) = (codes.as_ptr(), out.as_mut_ptr());
    for r in 0..rows {
        // Rows start on a byte: hd is a multiple of 8 and `first` of 8 / BITS.
        let row = (first + r * hd) * BITS / 8;
        let (mr, sr) = if per_row {
            (_mm256_set1_ps(mins[r]), _mm256_set1_ps(scales[r]))
        } else {
            (_mm256_setzero_ps(), _mm256_setzero_ps())
        };
        for d in (0..hd).step_by(8) {
            // SAFETY: codes d..d + 8 of row r are BITS bytes inside `codes` (asserted).
            let c = unsafe { load_codes8::<BITS>(cp.add(row + d * BITS / 8)) };
            let (m, s) = if per_row {
                (mr, sr)
            } else {
                // SAFETY: d + 8 <= hd <= mins.len(), scales.len() (asserted).
                unsafe {
                    (
                        _mm256_loadu_ps(mins.as_ptr().add(d)),
                        _mm256_loadu_ps(scales.as_ptr().add(d)),
                    )
                }
            };
            // Multiply, then add: the same rounding as the portable path.
            // SAFETY: r · hd + d + 8 <= out.len() (asserted).
            unsafe { _mm256_storeu_ps(op.add(r * hd + d), _mm256_add_ps(m, _mm256_mul_ps(c, s))) };
        }
    }
}

/// `out[i] = q · keys[i q.len()..(i + 1) q.len()]` for every `i`: one query row against
/// consecutive keys, eight keys per pass, their sums reduced together.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `q.len()` must be a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows(q: &[f32], keys: &[f32], out: &mut [f32]) {
    let hd = q.len();
    assert!(
        hd.is_multiple_of(8) && keys.len() >= out.len() * hd,
        "avx2::dot_rows: bad sizes"
    );
    let (n, qp, kp) = (out.len(), q.as_ptr(), keys.as_ptr());
    let mut i = 0;
    while i + 8 <= n {
        let mut acc = [_mm256_setzero_ps(); 8];
        for d in (0..hd).step_by(8) {
            // SAFETY: d + 8 <= hd: inside q; key i + j < n holds hd values inside `keys`.
            unsafe {
                let qv = _mm256_loadu_ps(qp.add(d));
                for (j, a) in acc.iter_mut().enumerate() {
                    let kv = _mm256_loadu_ps(kp.add((i + j) * hd + d));
                    *a = _mm256_fmadd_ps(kv, qv, *a);
                }
            }
        }
        // SAFETY: i + 8 <= n: inside out.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), reduce8(&acc)) };
        i += 8;
    }
    for (j, o) in out.iter_mut().enumerate().skip(i) {
        let mut a = _mm256_setzero_ps();
        for d in (0..hd).step_by(8) {
            // SAFETY: as above.
            unsafe {
                let kv = _mm256_loadu_ps(kp.add(j * hd + d));
                a = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qp.add(d)), a);
            }
        }
        *o = hsum(a);
    }
}

/// `o += Σ_i w[i] vals[i o.len()..(i + 1) o.len()]`: the weighted sum of consecutive value
/// rows into one output row, kept in registers 32 dimensions at a time, even and odd rows in
/// two sets of accumulators for twice the FMAs in flight.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `o.len()` must be a multiple of 8.
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_rows(o: &mut [f32], w: &[f32], vals: &[f32]) {
    let hd = o.len();
    assert!(
        hd.is_multiple_of(8) && vals.len() >= w.len() * hd,
        "avx2::axpy_rows: bad sizes"
    );
    let (op, vp) = (o.as_mut_ptr(), vals.as_ptr());
    for d0 in (0..hd).step_by(32) {
        let nv = ((hd - d0) / 8).min(4);
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        for v in 0..nv {
            // SAFETY: d0 + 8 v + 8 <= hd: inside o.
            acc[0][v] = unsafe { _mm256_loadu_ps(op.add(d0 + 8 * v)) };
        }
        for (i, &wi) in w.iter().enumerate() {
            let wb = _mm256_set1_ps(wi);
            for v in 0..nv {
                // SAFETY: row i < w.len() holds hd values inside `vals` (asserted above).
                let x = unsafe { _mm256_loadu_ps(vp.add(i * hd + d0 + 8 * v)) };
                acc[i & 1][v] = _mm256_fmadd_ps(wb, x, acc[i & 1][v]);
            }
        }
        for v in 0..nv {
            // SAFETY: as the loads above.
            unsafe { _mm256_storeu_ps(op.add(d0 + 8 * v), _mm256_add_ps(acc[0][v], acc[1][v])) };
        }
    }
}
