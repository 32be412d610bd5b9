//! AVX2 matrix-vector products over int8 activations for the formats held split into scales
//! and quants (Q4_1, Q8_0): the 256-bit form of `simd::vnni::matvec_q4_1` and `matvec_q8_0`,
//! four rows a pass, for CPUs without AVX-512 VNNI.
//!
//! Each block's 32 codes are multiplied with the 32 activation bytes by `vpmaddubsw` and
//! `vpmaddwd` by ones into eight 32-bit lanes, converted to f32 once and multiplied by
//! `d_w · d_x`. Q4_1's nibbles are unsigned (pair sums at most 2 · 15 · 127); Q8_0's codes are
//! signed, so they are taken as `|w|` times `x` with `w`'s sign (at most 2 · 128 · 127 =
//! 32,512, never saturated). Q4_1's minimum term takes `xsum` as given (the codes' sums).
//!
//! With 16-bit activations (`xl`, each value's remainder in 256ths of a step, -127..=127) each
//! activation is first put together as one word, `256 · xq + xl` (at most 32,639 in magnitude,
//! once per call for all rows: [`words`]), and the weights, widened to words, are multiplied
//! with them by `vpmaddwd` alone (pair sums at most 2 · 128 · 32,639, inside 32 bits): the same
//! integer as the codes' and the remainders' products added, in two `vpmaddwd` a block where
//! the two passes took four multiplies and two shuffles. Each block takes one scale,
//! `d_w · d_x / 256`.

use super::hsum;
use crate::simd::{ROWS, passes};
use half::f16;
use std::arch::x86_64::*;

/// `out[r] = Σ_b d[r][b] dx[b] Σ_j q[r][b][j] x[32b + j] + Σ_b m[r][b] xsum[b]` for the
/// `out.len()` Q4_1 rows held in `d`, `m` (`nb = xq.len() / 32` each) and `qs` (16 bytes a
/// block: quant j in the low nibble of byte j, quant j + 16 in its high nibble), where `x` is
/// `xq` (8-bit activations, `xl` empty) or `xq + xl / 256` (16-bit ones, `xl` as long as `xq`,
/// in -127..=127).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. The sizes are checked.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matvec_q4_1(
    d: &[f16],
    m: &[f16],
    qs: &[u8],
    xq: &[i8],
    xl: &[i8],
    dx: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    let nb = xq.len() / 32;
    let rows = out.len();
    assert!(
        xq.len() == nb * 32
            && (xl.is_empty() || xl.len() == xq.len())
            && dx.len() >= nb
            && xsum.len() >= nb
            && d.len() >= rows * nb
            && m.len() >= rows * nb
            && qs.len() >= rows * nb * 16,
        "avx2::split_int8::matvec_q4_1: bad sizes"
    );
    // SAFETY: the sizes are as `all_rows` needs them (asserted); the CPU has the features
    // (this function's contract).
    unsafe { all_rows::<false>(d, m, qs, xq, xl, dx, xsum, out) };
}

/// `out[r] = Σ_b d[r][b] dx[b] Σ_j q[r][b][j] x[32b + j]` for the `out.len()` Q8_0 rows held
/// in `d` (`nb = xq.len() / 32` each) and `qs` (32 signed bytes a block), where `x` is `xq`
/// (8-bit activations, `xl` empty) or `xq + xl / 256` (16-bit ones, `xl` as long as `xq`, in
/// -127..=127).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. The sizes are checked.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matvec_q8_0(d: &[f16], qs: &[u8], xq: &[i8], xl: &[i8], dx: &[f32], out: &mut [f32]) {
    let nb = xq.len() / 32;
    let rows = out.len();
    assert!(
        xq.len() == nb * 32
            && (xl.is_empty() || xl.len() == xq.len())
            && dx.len() >= nb
            && d.len() >= rows * nb
            && qs.len() >= rows * nb * 32,
        "avx2::split_int8::matvec_q8_0: bad sizes"
    );
    // SAFETY: as in `matvec_q4_1`.
    unsafe { all_rows::<true>(d, &[], qs, xq, xl, dx, &[], out) };
}

/// Every row of [`matvec_q8_0`] (`Q8`) or [`matvec_q4_1`], [`ROWS`] a pass ([`passes`]), the
/// 16-bit activations put together as words first when `xl` holds them.
///
/// # Safety
/// As those, whose size checks the caller has made.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn all_rows<const Q8: bool>(
    d: &[f16],
    m: &[f16],
    qs: &[u8],
    xq: &[i8],
    xl: &[i8],
    dx: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    let row_bytes = xq.len() / 32 * if Q8 { 32 } else { 16 };
    WORDS.with_borrow_mut(|x16| {
        // SAFETY: the CPU has AVX2 (the contract); xl is empty or as long as xq (checked by the
        // caller).
        unsafe { words(xq, xl, x16) };
        let x16 = &x16[..];
        passes(out.len(), row_bytes, qs.as_ptr(), |r, n| {
            let out = &mut out[r..r + n];
            // SAFETY: rows r..r + n are inside the slices (checked by the caller); the CPU has
            // the features (the contract).
            unsafe {
                match (n, xl.is_empty()) {
                    (ROWS, true) => rows_of::<Q8, ROWS, false>(d, m, qs, xq, x16, dx, xsum, r, out),
                    (_, true) => rows_of::<Q8, 1, false>(d, m, qs, xq, x16, dx, xsum, r, out),
                    (ROWS, false) => rows_of::<Q8, ROWS, true>(d, m, qs, xq, x16, dx, xsum, r, out),
                    (_, false) => rows_of::<Q8, 1, true>(d, m, qs, xq, x16, dx, xsum, r, out),
                }
            }
        })
    });
}

thread_local! {
    /// Each thread's buffer of 16-bit activation words ([`words`]), kept across calls.
    static WORDS: std::cell::RefCell<Vec<i16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The 16-bit activations as words, `256 · xq + xl`, into `x16` (emptied where `xl` is empty:
/// 8-bit activations).
///
/// # Safety
/// The CPU must have AVX2; `xl` must be empty or as long as `xq`, a multiple of 16.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn words(xq: &[i8], xl: &[i8], x16: &mut Vec<i16>) {
    x16.clear();
    if xl.is_empty() {
        return;
    }
    assert!(xl.len() == xq.len() && xq.len().is_multiple_of(16));
    x16.resize(xq.len(), 0);
    for i in (0..xq.len()).step_by(16) {
        // SAFETY: values i..i + 16 of xq, xl and x16 (their lengths, asserted).
        unsafe {
            let q = _mm256_cvtepi8_epi16(_mm_loadu_si128(xq.as_ptr().add(i) as *const __m128i));
            let l = _mm256_cvtepi8_epi16(_mm_loadu_si128(xl.as_ptr().add(i) as *const __m128i));
            let w = _mm256_add_epi16(_mm256_slli_epi16::<8>(q), l);
            _mm256_storeu_si256(x16.as_mut_ptr().add(i) as *mut __m256i, w);
        }
    }
}

/// Blocks whose scales [`rows_of`] prepares at a time.
const SEGMENT: usize = 64;

/// The `R` rows from `r0` of [`matvec_q8_0`] (`Q8`) or [`matvec_q4_1`], over the 8-bit
/// activations `xq`, or with `LO` the 16-bit ones as words `x16` ([`words`]).
///
/// Up to [`SEGMENT`] blocks at a time, each row's scales `d_w · d_x` are first converted and
/// multiplied eight blocks at a time into a buffer, and Q4_1's minimum term `m · xsum` summed
/// into the row's accumulator eight blocks a lane; each block then takes its scale by one
/// broadcast from the buffer, where a scalar conversion, product and broadcast a block and
/// row, and the minimum's scalar terms, had been a third of the instructions.
///
/// # Safety
/// As those, for rows `r0..r0 + R` inside the slices; `out` holds `R` values.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const Q8: bool, const R: usize, const LO: bool>(
    d: &[f16],
    m: &[f16],
    qs: &[u8],
    xq: &[i8],
    x16: &[i16],
    dx: &[f32],
    xsum: &[f32],
    r0: usize,
    out: &mut [f32],
) {
    let nb = xq.len() / 32;
    debug_assert!(!LO || x16.len() == xq.len());
    let bytes = if Q8 { 32 } else { 16 };
    // The words count 256 remainders' units a code (16-bit activations).
    let unit = if LO { 1.0 / 256.0 } else { 1.0 };
    let mut acc = [_mm256_setzero_ps(); R];
    let mut mins = [0f32; R];
    let mut scales = [[0f32; SEGMENT]; R];
    let (dp, mp, qp) = (d.as_ptr(), m.as_ptr(), qs.as_ptr());
    for s0 in (0..nb).step_by(SEGMENT) {
        let len = (nb - s0).min(SEGMENT);
        let whole = len / 8 * 8;
        for r in 0..R {
            let o = (r0 + r) * nb + s0;
            // SAFETY: blocks s0..s0 + len of the activations and of row r0 + r are inside dx,
            // xsum, d and m (the contract); the stores are inside `scales[r]` (len <= SEGMENT).
            unsafe {
                for k in (0..whole).step_by(8) {
                    let dxk = _mm256_mul_ps(
                        _mm256_loadu_ps(dx.as_ptr().add(s0 + k)),
                        _mm256_set1_ps(unit),
                    );
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(dp.add(o + k) as *const __m128i));
                    _mm256_storeu_ps(scales[r].as_mut_ptr().add(k), _mm256_mul_ps(dw, dxk));
                    if !Q8 {
                        let mw = _mm256_cvtph_ps(_mm_loadu_si128(mp.add(o + k) as *const __m128i));
                        let xs = _mm256_loadu_ps(xsum.as_ptr().add(s0 + k));
                        acc[r] = _mm256_fmadd_ps(mw, xs, acc[r]);
                    }
                }
                for k in whole..len {
                    scales[r][k] = (*dp.add(o + k)).to_f32() * (*dx.get_unchecked(s0 + k) * unit);
                    if !Q8 {
                        mins[r] += (*mp.add(o + k)).to_f32() * *xsum.get_unchecked(s0 + k);
                    }
                }
            }
        }
        for k in 0..len {
            let b = s0 + k;
            // SAFETY: block b < nb: its 32 codes inside xq, and with LO its 32 words inside x16
            // (the contract).
            let (x, x0, x1) = unsafe {
                if LO {
                    let w = x16.as_ptr().add(32 * b) as *const __m256i;
                    (
                        _mm256_setzero_si256(),
                        _mm256_loadu_si256(w),
                        _mm256_loadu_si256(w.add(1)),
                    )
                } else {
                    let x = _mm256_loadu_si256(xq.as_ptr().add(32 * b) as *const __m256i);
                    (x, _mm256_setzero_si256(), _mm256_setzero_si256())
                }
            };
            for r in 0..R {
                let o = (r0 + r) * nb + b;
                // SAFETY: block b of row r0 + r is inside qs (the contract).
                let ints = unsafe { block_sums::<Q8, LO>(qp.add(o * bytes), x, x0, x1) };
                let sums = _mm256_cvtepi32_ps(ints);
                // SAFETY: k < len <= SEGMENT.
                let s = unsafe { _mm256_broadcast_ss(scales[r].get_unchecked(k)) };
                acc[r] = _mm256_fmadd_ps(sums, s, acc[r]);
            }
        }
    }
    for r in 0..R {
        out[r] = hsum(acc[r]) + mins[r];
    }
}

/// One block's eight lanes of integer sums of [`rows_of`]: its codes at `q` against the 8-bit
/// activations `x`, or with `LO` against the activations' words `x0` (values 0-15) and `x1`
/// (16-31).
///
/// # Safety
/// The CPU must have AVX2; the block's bytes (32 for Q8_0, 16 for Q4_1) must be readable at `q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums<const Q8: bool, const LO: bool>(
    q: *const u8,
    x: __m256i,
    x0: __m256i,
    x1: __m256i,
) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the block's bytes (the contract).
    unsafe {
        match (Q8, LO) {
            // The codes widened to words against the activations' words.
            (true, true) => {
                let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(q as *const __m128i));
                let w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(16) as *const __m128i));
                _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1))
            }
            (false, true) => {
                let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(q as *const __m128i));
                let w0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
                let w1 = _mm256_srli_epi16::<4>(v);
                _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1))
            }
            (true, false) => {
                let w = _mm256_loadu_si256(q as *const __m256i);
                let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
                _mm256_madd_epi16(p, ones)
            }
            (false, false) => {
                let v = _mm_loadu_si128(q as *const __m128i);
                let w = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16::<4>(v), v),
                    _mm256_set1_epi8(0x0F),
                );
                _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones)
            }
        }
    }
}

/// Quantizes `x` per block of 32 into `q` (codes in -127..=127, rounded to nearest, ties to
/// even), `d` (each block's largest magnitude over 127) and, with `LO`, each value's remainder
/// in 256ths of a step into `lo` (clamped to -127..=127): the same bits as the portable
/// quantizer of `qmatrix` and `simd::vnni::quantize`/`quantize16`, on 256 bits.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; with `LO`, `lo` must hold `x.len()` values. The other
/// sizes are checked.
// One index runs over the codes and the scales at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize<const LO: bool>(x: &[f32], q: &mut [i8], lo: &mut [i8], d: &mut [f32]) {
    let nb = x.len() / 32;
    assert!(
        q.len() >= nb * 32 && d.len() >= nb,
        "avx2::split_int8::quantize: bad sizes"
    );
    let sign = _mm256_set1_ps(-0.0);
    let (steps, floor) = (_mm256_set1_ps(256.0), _mm256_set1_epi32(-127));
    // `vpackssdw` and `vpacksswb` interleave their 128-bit lanes; this puts the words back.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let pack = |c: [__m256i; 4]| {
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(c[0], c[1]),
            _mm256_packs_epi32(c[2], c[3]),
        );
        _mm256_permutevar8x32_epi32(w, order)
    };
    for b in 0..nb {
        // SAFETY: block b < nb: its 32 values are inside x and its 32 codes inside q (the
        // assert above) and, with LO, inside lo (the caller); unaligned loads and stores
        // accept any address.
        unsafe {
            let xp = x.as_ptr().add(b * 32);
            let v = [0, 8, 16, 24].map(|k| _mm256_loadu_ps(xp.add(k)));
            let a = v.map(|v| _mm256_andnot_ps(sign, v));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
            d[b] = amax / 127.0;
            let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let s = v.map(|v| _mm256_mul_ps(v, inv));
            // Round to nearest, ties to even (the default MXCSR mode); s - q is exact.
            let c = s.map(|s| _mm256_cvtps_epi32(s));
            _mm256_storeu_si256(q.as_mut_ptr().add(b * 32) as *mut __m256i, pack(c));
            if LO {
                let r = [0, 1, 2, 3].map(|k| {
                    let rest = _mm256_mul_ps(_mm256_sub_ps(s[k], _mm256_cvtepi32_ps(c[k])), steps);
                    _mm256_max_epi32(_mm256_cvtps_epi32(rest), floor)
                });
                _mm256_storeu_si256(lo.as_mut_ptr().add(b * 32) as *mut __m256i, pack(r));
            }
        }
    }
}
