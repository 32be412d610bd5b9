//! AVX-512 VNNI matrix-vector products over int8 activations (`Activations::Int8`), for the
//! formats held split into scales and quants (Q4_1, Q8_0); [`blocks`] has them for the formats
//! held as the file's bytes.
//!
//! Activations come quantized per block of 32 (`xq` signed bytes, `dx` their scales). Each pass
//! takes two blocks of [`ROWS`] rows: one `vpdpbusd` multiplies the 64 weights of a row's two
//! blocks with the 64 activation bytes and sums each four products into one of 16 lanes, lanes
//! 0-7 the first block's and 8-15 the second's; the lanes are converted to f32 once and scaled
//! by their block's `d_w · d_x`. So a row's block sums never need a horizontal reduction, and
//! the integer sums are exact.
//!
//! With 16-bit activations (`Activations::Int16`) each value is two signed bytes, its code
//! `q` and the remainder `l` in 256ths of a step (`x ≈ d (q + l / 256)`, `l` in -127..=127):
//! a second
//! `vpdpbusd` multiplies the same weight bytes with the remainders, and the first sums are
//! shifted up by 8 bits before they join them, so the integer sums stay exact and each block
//! takes one scale, `d_w · d_x / 256`.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes. Q4_1's quants are unsigned already; Q8_0's
//! are signed, so they are read with their top bit flipped (`w + 128`) and each lane starts from
//! `-128 Σ x` of its four activations, which the pass computes once for every row.

use crate::simd::passes;
use half::f16;
use std::arch::x86_64::*;

pub mod blocks;
pub mod kv;

/// Rows per pass.
pub use crate::simd::ROWS;

/// Whether this CPU runs these kernels: AVX-512 F, BW, VL and VNNI, and F16C.
pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// The lanes of a scale vector that pick blocks `2k` (lanes 0-7) and `2k + 1` (lanes 8-15) of
/// sixteen.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn pair_index(k: usize) -> __m512i {
    let (a, b) = (2 * k as i32, 2 * k as i32 + 1);
    _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
}

/// The first `n` of sixteen lanes.
#[inline]
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 }
}

/// The first `n` of 64 bytes.
#[inline]
pub(super) fn bytes(n: usize) -> __mmask64 {
    if n >= 64 { !0 } else { (1u64 << n) - 1 }
}

/// `out[r] = Σ_b d[r][b] dx[b] Σ_j q[r][b][j] x[32b + j] + Σ_b m[r][b] xsum[b]` for the
/// `out.len()` Q4_1 rows held in `d`, `m` (`nb = xq.len() / 32` each) and `qs` (16 bytes a
/// block: quant j in the low nibble of byte j, quant j + 16 in its high nibble), where `x` is
/// `xq` (8-bit activations, `xl` empty) or `xq + xl / 256` (16-bit ones, `xl` as long as `xq`).
///
/// # Safety
/// The CPU must have what [`available`] checks. The sizes are checked.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
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
        "vnni::matvec_q4_1: bad sizes"
    );
    passes(rows, nb * 16, qs.as_ptr(), |r, n| {
        let out = &mut out[r..r + n];
        // SAFETY: rows r..r + n are inside the slices (asserted above); the CPU has the
        // features (this function's contract).
        unsafe {
            match (n, xl.is_empty()) {
                (ROWS, true) => rows_q4_1::<ROWS, false>(d, m, qs, xq, xl, dx, xsum, r, out),
                (_, true) => rows_q4_1::<1, false>(d, m, qs, xq, xl, dx, xsum, r, out),
                (ROWS, false) => rows_q4_1::<ROWS, true>(d, m, qs, xq, xl, dx, xsum, r, out),
                (_, false) => rows_q4_1::<1, true>(d, m, qs, xq, xl, dx, xsum, r, out),
            }
        }
    });
}

/// [`matvec_q4_1`] for the `R` rows from `r0`, with the remainders `xl` if `LO`.
///
/// # Safety
/// As [`matvec_q4_1`], for rows `r0..r0 + R` inside the slices; `out` holds `R` values.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn rows_q4_1<const R: usize, const LO: bool>(
    d: &[f16],
    m: &[f16],
    qs: &[u8],
    xq: &[i8],
    xl: &[i8],
    dx: &[f32],
    xsum: &[f32],
    r0: usize,
    out: &mut [f32],
) {
    let nb = xq.len() / 32;
    let nibble = _mm512_set1_epi8(0x0F);
    // Blocks A, B of a pair as 128-bit lanes [A, A, B, B], then the high nibbles of lanes 1, 3.
    let spread = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    let shift = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut mins = [_mm512_setzero_ps(); R];
    let (dp, mp, qp, xp, lp) = (
        d.as_ptr(),
        m.as_ptr(),
        qs.as_ptr(),
        xq.as_ptr(),
        xl.as_ptr(),
    );
    // 16-bit activations' sums come out in 256ths of a step (a power of two: exact).
    let unit = _mm512_set1_ps(if LO { 1.0 / 256.0 } else { 1.0 });
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(16);
        let k = lanes(n);
        // SAFETY: blocks g..g + n are inside dx and xsum, and inside d and m for each row
        // (the caller's contract); masked loads read only those lanes.
        let (dxv, xs) = unsafe {
            (
                _mm512_mul_ps(_mm512_maskz_loadu_ps(k, dx.as_ptr().add(g)), unit),
                _mm512_maskz_loadu_ps(k, xsum.as_ptr().add(g)),
            )
        };
        let mut ds = [_mm512_setzero_ps(); R];
        for r in 0..R {
            let o = (r0 + r) * nb + g;
            // SAFETY: as above.
            unsafe {
                let dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dp.add(o) as *const i16));
                ds[r] = _mm512_mul_ps(dv, dxv);
                let mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mp.add(o) as *const i16));
                mins[r] = _mm512_fmadd_ps(mv, xs, mins[r]);
            }
        }
        for p in 0..n.div_ceil(2) {
            let b = g + 2 * p;
            let two = (nb - b).min(2);
            // SAFETY: blocks b..b + two are inside xq (two · 32 bytes) and inside each row's
            // quants (two · 16 bytes); masked loads read only those bytes.
            let x = unsafe { _mm512_maskz_loadu_epi8(bytes(32 * two), xp.add(b * 32)) };
            let lo = if LO {
                // SAFETY: as above, and xl is as long as xq when LO.
                unsafe { _mm512_maskz_loadu_epi8(bytes(32 * two), lp.add(b * 32)) }
            } else {
                _mm512_setzero_si512()
            };
            let pick = pair_index(p);
            for r in 0..R {
                // SAFETY: as above.
                let w = unsafe {
                    _mm256_maskz_loadu_epi8(
                        bytes(16 * two) as __mmask32,
                        qp.add(((r0 + r) * nb + b) * 16) as *const i8,
                    )
                };
                let w = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(w));
                let w = _mm512_and_si512(_mm512_srlv_epi64(w, shift), nibble);
                let mut sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
                if LO {
                    // Four products of at most 15 · 128 a lane: 256 times them fits easily.
                    sums = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(sums), w, lo);
                }
                let scale = _mm512_permutexvar_ps(pick, ds[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            }
        }
        g += 16;
    }
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], mins[r]));
    }
}

/// `out[r] = Σ_b d[r][b] dx[b] Σ_j q[r][b][j] x[32b + j]` for the `out.len()` Q8_0 rows held
/// in `d` (`nb = xq.len() / 32` each) and `qs` (32 signed bytes a block), where `x` is `xq`
/// (8-bit activations, `xl` empty) or `xq + xl / 256` (16-bit ones, `xl` as long as `xq`).
///
/// # Safety
/// The CPU must have what [`available`] checks. The sizes are checked.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn matvec_q8_0(d: &[f16], qs: &[u8], xq: &[i8], xl: &[i8], dx: &[f32], out: &mut [f32]) {
    let nb = xq.len() / 32;
    let rows = out.len();
    assert!(
        xq.len() == nb * 32
            && (xl.is_empty() || xl.len() == xq.len())
            && dx.len() >= nb
            && d.len() >= rows * nb
            && qs.len() >= rows * nb * 32,
        "vnni::matvec_q8_0: bad sizes"
    );
    // Each lane's -128 Σ x over its four activations, for every pair of blocks: what reading
    // the quants as w + 128 adds (for the codes, then for the remainders).
    let flip = _mm512_set1_epi8(-128);
    let offsets = |x: &[i8]| -> Vec<__m512i> {
        if x.is_empty() {
            return Vec::new();
        }
        (0..nb.div_ceil(2))
            .map(|p| {
                let two = (nb - 2 * p).min(2);
                // SAFETY: blocks 2p..2p + two are inside x (as long as xq); the masked load
                // reads only them.
                let x = unsafe { _mm512_maskz_loadu_epi8(bytes(32 * two), x.as_ptr().add(64 * p)) };
                _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, x),
                )
            })
            .collect()
    };
    let (base, base_lo) = (offsets(xq), offsets(xl));
    passes(rows, nb * 32, qs.as_ptr(), |r, n| {
        let out = &mut out[r..r + n];
        let bases = (&base[..], &base_lo[..]);
        // SAFETY: rows r..r + n are inside the slices (asserted above); the CPU has the
        // features (this function's contract).
        unsafe {
            match (n, xl.is_empty()) {
                (ROWS, true) => rows_q8_0::<ROWS, false>(d, qs, xq, xl, dx, bases, r, out),
                (_, true) => rows_q8_0::<1, false>(d, qs, xq, xl, dx, bases, r, out),
                (ROWS, false) => rows_q8_0::<ROWS, true>(d, qs, xq, xl, dx, bases, r, out),
                (_, false) => rows_q8_0::<1, true>(d, qs, xq, xl, dx, bases, r, out),
            }
        }
    });
}

/// [`matvec_q8_0`] for the `R` rows from `r0`, with the remainders `xl` if `LO`; `bases`
/// holds each pair's starting lanes for the codes and for the remainders.
///
/// # Safety
/// As [`matvec_q8_0`], for rows `r0..r0 + R` inside the slices; `out` holds `R` values.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn rows_q8_0<const R: usize, const LO: bool>(
    d: &[f16],
    qs: &[u8],
    xq: &[i8],
    xl: &[i8],
    dx: &[f32],
    (base, base_lo): (&[__m512i], &[__m512i]),
    r0: usize,
    out: &mut [f32],
) {
    let nb = xq.len() / 32;
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); R];
    let (dp, qp, xp, lp) = (d.as_ptr(), qs.as_ptr(), xq.as_ptr(), xl.as_ptr());
    // 16-bit activations' sums come out in 256ths of a step (a power of two: exact).
    let unit = _mm512_set1_ps(if LO { 1.0 / 256.0 } else { 1.0 });
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(16);
        let k = lanes(n);
        // SAFETY: blocks g..g + n are inside dx, and inside d for each row (the caller's
        // contract); masked loads read only those lanes.
        let dxv = unsafe { _mm512_mul_ps(_mm512_maskz_loadu_ps(k, dx.as_ptr().add(g)), unit) };
        let mut ds = [_mm512_setzero_ps(); R];
        for r in 0..R {
            // SAFETY: as above.
            let dv = unsafe {
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                    k,
                    dp.add((r0 + r) * nb + g) as *const i16,
                ))
            };
            ds[r] = _mm512_mul_ps(dv, dxv);
        }
        for p in 0..n.div_ceil(2) {
            let b = g + 2 * p;
            let two = (nb - b).min(2);
            let mask = bytes(32 * two);
            // SAFETY: blocks b..b + two are inside xq and inside each row's quants; masked
            // loads read only those bytes.
            let x = unsafe { _mm512_maskz_loadu_epi8(mask, xp.add(b * 32)) };
            let lo = if LO {
                // SAFETY: as above, and xl is as long as xq when LO.
                unsafe { _mm512_maskz_loadu_epi8(mask, lp.add(b * 32)) }
            } else {
                _mm512_setzero_si512()
            };
            let pick = pair_index(p);
            for r in 0..R {
                // SAFETY: as above.
                let w = unsafe {
                    _mm512_maskz_loadu_epi8(mask, qp.add(((r0 + r) * nb + b) * 32) as *const i8)
                };
                // Past the last block the bytes read as 0 flip to 128, against activations of
                // 0 and a scale of 0.
                let w = _mm512_xor_si512(w, flip);
                let mut sums = _mm512_dpbusd_epi32(base[b / 2], w, x);
                if LO {
                    // A lane's four products are at most 255 · 128 each: 256 times their sum
                    // (under 2^26) and the remainders' sums fit in 32 bits.
                    let low = _mm512_dpbusd_epi32(base_lo[b / 2], w, lo);
                    sums = _mm512_add_epi32(_mm512_slli_epi32::<8>(sums), low);
                }
                let scale = _mm512_permutexvar_ps(pick, ds[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            }
        }
        g += 16;
    }
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(acc[r]);
    }
}

/// [`quantize`], and each value's remainder in 256ths of its block's step into `lo`
/// (`round((x / d - q) · 256)`, ties to even, clamped to -127..=127, where AVX2's sign trick
/// for Q8_0 needs it): the same bits as the portable quantizer of `qmatrix`.
///
/// # Safety
/// The CPU must have what [`available`] checks. The sizes are checked.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn quantize16(x: &[f32], q: &mut [i8], lo: &mut [i8], d: &mut [f32]) {
    let nb = x.len() / 32;
    assert!(lo.len() >= nb * 32, "vnni::quantize16: bad sizes");
    // SAFETY: the CPU has the features (this function's contract); lo holds nb blocks.
    unsafe { quantize_with::<true>(x, q, lo, d) }
}

/// Quantizes `x` per block of 32 into `q` (codes in -127..=127, rounded to nearest, ties to
/// even) and `d` (each block's largest magnitude over 127): the same bits as the portable
/// quantizer of `qmatrix`.
///
/// # Safety
/// The CPU must have what [`available`] checks. The sizes are checked.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn quantize(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    // SAFETY: the CPU has the features (this function's contract); lo is not read without LO.
    unsafe { quantize_with::<false>(x, q, &mut [], d) }
}

/// [`quantize`], and with `LO` [`quantize16`]'s remainders into `lo`.
///
/// # Safety
/// The CPU must have what [`available`] checks; with `LO`, `lo` must hold `x.len()` values.
/// The other sizes are checked.
// One index runs over the codes and the scales at once.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn quantize_with<const LO: bool>(x: &[f32], q: &mut [i8], lo: &mut [i8], d: &mut [f32]) {
    let nb = x.len() / 32;
    assert!(
        q.len() >= nb * 32 && d.len() >= nb,
        "vnni::quantize: bad sizes"
    );
    let (steps, floor) = (_mm512_set1_ps(256.0), _mm512_set1_epi32(-127));
    for b in 0..nb {
        // SAFETY: block b < nb: its 32 values are inside x and its 32 codes inside q (the
        // assert above) and, with LO, inside lo (the caller); unaligned loads and stores
        // accept any address.
        unsafe {
            let xp = x.as_ptr().add(b * 32);
            let (xl, xh) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            // |x| by `vpandd` (AVX-512 F; `_mm512_andnot_ps` needs DQ, which these functions
            // do not enable, and was called out of line).
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(xl), _mm512_abs_ps(xh)));
            d[b] = amax / 127.0;
            let inv = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            for (half, v) in [xl, xh].into_iter().enumerate() {
                let s = _mm512_mul_ps(v, inv);
                // Round to nearest, ties to even (the default MXCSR mode); s - q is exact.
                let c = _mm512_cvtps_epi32(s);
                let at = b * 32 + 16 * half;
                _mm_storeu_si128(
                    q.as_mut_ptr().add(at) as *mut __m128i,
                    _mm512_cvtepi32_epi8(c),
                );
                if LO {
                    let rest = _mm512_mul_ps(_mm512_sub_ps(s, _mm512_cvtepi32_ps(c)), steps);
                    _mm_storeu_si128(
                        lo.as_mut_ptr().add(at) as *mut __m128i,
                        _mm512_cvtsepi32_epi8(_mm512_max_epi32(_mm512_cvtps_epi32(rest), floor)),
                    );
                }
            }
        }
    }
}
