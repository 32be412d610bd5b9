//! AVX2 + FMA + F16C matrix-vector kernels for single-token products, the 256-bit form of
//! `simd::avx512::matvec_q4_1` and `matvec_q8_0`: several rows per pass, so each activation
//! load and each group's f16 scale conversion serve all of them, and the weights' cache lines
//! asked for ahead of the rows in work.

use super::hsum;
use crate::simd::{WEIGHTS_AHEAD, prefetch_weights};
use half::f16;
use std::arch::x86_64::*;

/// Rows per pass of the matrix-vector kernels.
pub const ROWS: usize = 4;

/// Up to eight f16 from `p` as f32, the lanes past `n` zero.
///
/// # Safety
/// The CPU must have F16C; `n` f16 at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16_part(p: *const f16, n: usize) -> __m256 {
    if n >= 8 {
        // SAFETY: eight readable f16 at p (the contract); unaligned loads accept any address.
        return _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) });
    }
    let mut b = [0u16; 8];
    // SAFETY: n < 8 readable f16 at p, copied into b's first n.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u16, b.as_mut_ptr(), n) };
    // SAFETY: b holds eight u16.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) })
}

/// Up to eight f32 from `p`, the lanes past `n` zero.
///
/// # Safety
/// `n` f32 at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f32_part(p: *const f32, n: usize) -> __m256 {
    if n >= 8 {
        // SAFETY: eight readable f32 at p (the contract).
        return unsafe { _mm256_loadu_ps(p) };
    }
    let mut b = [0f32; 8];
    // SAFETY: n < 8 readable f32 at p, copied into b's first n.
    unsafe { std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), n) };
    // SAFETY: b holds eight f32.
    unsafe { _mm256_loadu_ps(b.as_ptr()) }
}

/// `out[r] = Σ_b d[r][b] Σ_j q[r][b][j] x[32b + j] + Σ_b m[r][b] xsum[b]` for the
/// `out.len()` Q4_1 rows held in `d`, `m` (`nb = x.len() / 32` values per row) and `qs`
/// (16 bytes per block); `xsum` holds Σ x per block.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `x.len()` must be a multiple of 32; `d` and `m` must
/// hold `nb` values, `qs` `16 nb` bytes for each row of `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matvec_q4_1(
    d: &[f16],
    m: &[f16],
    qs: &[u8],
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    let nb = x.len() / 32;
    let rows = out.len();
    assert!(
        x.len() == nb * 32
            && xsum.len() >= nb
            && d.len() >= rows * nb
            && m.len() >= rows * nb
            && qs.len() >= rows * nb * 16,
        "avx2::matvec_q4_1: bad sizes"
    );
    // The first rows' lines, then each pass asks for the lines WEIGHTS_AHEAD ahead of it.
    prefetch_weights(qs.as_ptr(), WEIGHTS_AHEAD);
    prefetch_weights(d.as_ptr() as *const u8, WEIGHTS_AHEAD / 8);
    prefetch_weights(m.as_ptr() as *const u8, WEIGHTS_AHEAD / 8);
    let mut r = 0;
    while r + ROWS <= rows {
        let (q0, s0) = (r * nb * 16 + WEIGHTS_AHEAD, r * nb * 2 + WEIGHTS_AHEAD / 8);
        prefetch_weights(qs.as_ptr().wrapping_add(q0), ROWS * nb * 16);
        prefetch_weights((d.as_ptr() as *const u8).wrapping_add(s0), ROWS * nb * 2);
        prefetch_weights((m.as_ptr() as *const u8).wrapping_add(s0), ROWS * nb * 2);
        // SAFETY: rows r..r + ROWS are inside the slices (asserted above).
        unsafe { rows_q4_1::<ROWS>(d, m, qs, x, xsum, r, &mut out[r..r + ROWS]) };
        r += ROWS;
    }
    while r < rows {
        // SAFETY: row r is inside the slices (asserted above).
        unsafe { rows_q4_1::<1>(d, m, qs, x, xsum, r, &mut out[r..r + 1]) };
        r += 1;
    }
}

/// [`matvec_q4_1`] for the `R` rows from `r0`: eight blocks' scales and minimums converted per
/// row at once, each block's 32 activations loaded once for the `R` rows, and each row's 16
/// bytes zero-extended from memory in two halves (a lane's low nibble is value j, its high
/// nibble value j + 16: a mask and a shift, no shuffles).
///
/// # Safety
/// As [`matvec_q4_1`], for rows `r0..r0 + R`; `out` holds `R` values.
#[inline]
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_q4_1<const R: usize>(
    d: &[f16],
    m: &[f16],
    qs: &[u8],
    x: &[f32],
    xsum: &[f32],
    r0: usize,
    out: &mut [f32],
) {
    let nb = x.len() / 32;
    let nibble = _mm256_set1_epi32(0x0F);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut mins = [_mm256_setzero_ps(); R];
    let mut ds = [[0.0f32; 8]; R];
    let (dp, mp) = (d.as_ptr(), m.as_ptr());
    let (qp, xp) = (qs.as_ptr(), x.as_ptr());
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(8);
        // SAFETY: blocks g..g + n of rows r0..r0 + R are inside d, m (caller) and g + n <= nb
        // inside xsum; the partial loads read only those.
        unsafe {
            let xs = load_f32_part(xsum.as_ptr().add(g), n);
            for r in 0..R {
                let o = (r0 + r) * nb + g;
                _mm256_storeu_ps(ds[r].as_mut_ptr(), load_f16_part(dp.add(o), n));
                mins[r] = _mm256_fmadd_ps(load_f16_part(mp.add(o), n), xs, mins[r]);
            }
        }
        for i in 0..n {
            let b = g + i;
            // SAFETY: block b < nb: its 32 activations are inside x, and its 16 bytes of
            // each row r0 + r inside qs (caller); unaligned loads accept any address.
            unsafe {
                let xv: [__m256; 4] =
                    std::array::from_fn(|k| _mm256_loadu_ps(xp.add(b * 32 + 8 * k)));
                for r in 0..R {
                    let q = qp.add(((r0 + r) * nb + b) * 16);
                    let v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q as *const __m128i));
                    let v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.add(8) as *const __m128i));
                    let w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, nibble));
                    let w1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, nibble));
                    let w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v0));
                    let w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v1));
                    let t = _mm256_fmadd_ps(w1, xv[1], _mm256_mul_ps(w0, xv[0]));
                    let t = _mm256_fmadd_ps(w3, xv[3], _mm256_fmadd_ps(w2, xv[2], t));
                    acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(ds[r][i]), acc[r]);
                }
            }
        }
        g += 8;
    }
    for r in 0..R {
        out[r] = hsum(_mm256_add_ps(acc[r], mins[r]));
    }
}

/// `out[r] = Σ_b d[r][b] Σ_j q[r][b][j] x[32b + j]` for the `out.len()` Q8_0 rows held in
/// `d` (`nb = x.len() / 32` values per row) and `qs` (32 signed bytes per block).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `x.len()` must be a multiple of 32; `d` must hold
/// `nb` values and `qs` `32 nb` bytes for each row of `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matvec_q8_0(d: &[f16], qs: &[u8], x: &[f32], out: &mut [f32]) {
    let nb = x.len() / 32;
    let rows = out.len();
    assert!(
        x.len() == nb * 32 && d.len() >= rows * nb && qs.len() >= rows * nb * 32,
        "avx2::matvec_q8_0: bad sizes"
    );
    prefetch_weights(qs.as_ptr(), WEIGHTS_AHEAD);
    prefetch_weights(d.as_ptr() as *const u8, WEIGHTS_AHEAD / 16);
    let mut r = 0;
    while r + ROWS <= rows {
        let (q0, s0) = (r * nb * 32 + WEIGHTS_AHEAD, r * nb * 2 + WEIGHTS_AHEAD / 16);
        prefetch_weights(qs.as_ptr().wrapping_add(q0), ROWS * nb * 32);
        prefetch_weights((d.as_ptr() as *const u8).wrapping_add(s0), ROWS * nb * 2);
        // SAFETY: rows r..r + ROWS are inside the slices (asserted above).
        unsafe { rows_q8_0::<ROWS>(d, qs, x, r, &mut out[r..r + ROWS]) };
        r += ROWS;
    }
    while r < rows {
        // SAFETY: row r is inside the slices (asserted above).
        unsafe { rows_q8_0::<1>(d, qs, x, r, &mut out[r..r + 1]) };
        r += 1;
    }
}

/// [`matvec_q8_0`] for the `R` rows from `r0`.
///
/// # Safety
/// As [`matvec_q8_0`], for rows `r0..r0 + R`; `out` holds `R` values.
#[inline]
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_q8_0<const R: usize>(d: &[f16], qs: &[u8], x: &[f32], r0: usize, out: &mut [f32]) {
    let nb = x.len() / 32;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut ds = [[0.0f32; 8]; R];
    let (dp, qp, xp) = (d.as_ptr(), qs.as_ptr(), x.as_ptr());
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(8);
        for (r, ds) in ds.iter_mut().enumerate() {
            // SAFETY: scales g..g + n of row r0 + r are inside d (caller); the partial load
            // reads only those.
            unsafe {
                let dv = load_f16_part(dp.add((r0 + r) * nb + g), n);
                _mm256_storeu_ps(ds.as_mut_ptr(), dv);
            }
        }
        for i in 0..n {
            let b = g + i;
            // SAFETY: block b < nb: its 32 activations are inside x, and its 32 bytes of
            // each row r0 + r inside qs (caller); unaligned loads accept any address.
            unsafe {
                let xv: [__m256; 4] =
                    std::array::from_fn(|k| _mm256_loadu_ps(xp.add(b * 32 + 8 * k)));
                for r in 0..R {
                    let q = qp.add(((r0 + r) * nb + b) * 32);
                    let w: [__m256; 4] = std::array::from_fn(|k| {
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            q.add(8 * k) as *const __m128i
                        )))
                    });
                    let t = _mm256_fmadd_ps(w[1], xv[1], _mm256_mul_ps(w[0], xv[0]));
                    let t = _mm256_fmadd_ps(w[3], xv[3], _mm256_fmadd_ps(w[2], xv[2], t));
                    acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(ds[r][i]), acc[r]);
                }
            }
        }
        g += 8;
    }
    for r in 0..R {
        out[r] = hsum(acc[r]);
    }
}
