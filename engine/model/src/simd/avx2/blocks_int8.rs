//! AVX2 matrix-vector products over int8 activations for the block formats held as the file's
//! bytes (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; layouts in [`crate::qmatrix::blocks`]): the
//! 256-bit form of [`crate::simd::vnni::blocks`], for CPUs without AVX-512 VNNI.
//!
//! Each 32 values of a row are read as 32 unsigned codes `u` in value order, multiplied with
//! the 32 activation bytes by `vpmaddubsw` (pairs summed into 16 bits: at most 2 · 63 · 127, so
//! never saturated) and `vpmaddwd` by ones (each four summed into one of eight 32-bit lanes).
//! The stored code is `u - offset` (8 for Q4_0, 16 for Q5_0, 32 for Q6_K, 0 otherwise): the
//! offset's term `-offset Σ x` is computed once per product for every row, per block for the
//! 32-value formats (scaled with the block's scale outside the codes' products) and per lane
//! of four activations for Q6_K (added to the lanes). The lanes are converted to f32 once and
//! multiplied by `scale · d_x`: one scale for the 32 values, or for Q6_K one for lanes 0-3 and
//! one for lanes 4-7. Offsets (Q5_1, Q4_K, Q5_K) add `min · Σ x` with the activations' exact
//! f32 sums. Four rows a pass share each load of the activations; the 32-value formats'
//! scales are converted eight blocks at a time before a row's products (`rows_small`).

use crate::qmatrix::Kind;
use crate::simd::blocks::{Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, code_offset, geometry, h2f, tag};
use crate::simd::{ROWS, passes};
use std::arch::x86_64::*;

/// The eight bytes of `v` (little-endian) as eight f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes8_ps(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

/// `Σ u x` of 32 codes and 32 activations in eight lanes of four, plus `base` for the formats
/// whose codes are offset (`K`: the format's tag).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot32<const K: u8>(w: __m256i, x: __m256i, base: __m256i) -> __m256 {
    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    let p = if code_offset(K) != 0 {
        _mm256_add_epi32(p, base)
    } else {
        p
    };
    _mm256_cvtepi32_ps(p)
}

/// `out[r] = Σ_j w[r][j] x[j]` for the `out.len()` rows of `kind` held in `raw` (whole blocks,
/// `xq.len()` values a row), with the activations quantized per 32 (`x[j] ≈ dx[j / 32] xq[j]`)
/// and `xsum` their exact sums per 32 (read only for the formats with offsets). The same sums
/// as [`crate::qmatrix::blocks::dot_row_q8`], in another order.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. The sizes are checked.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matvec(kind: Kind, raw: &[u8], xq: &[i8], dx: &[f32], xsum: &[f32], out: &mut [f32]) {
    // SAFETY: the CPU has the features (this function's contract); `run` checks the sizes.
    unsafe {
        match tag(kind) {
            Q4_0 => run::<Q4_0>(raw, xq, dx, xsum, out),
            Q5_0 => run::<Q5_0>(raw, xq, dx, xsum, out),
            Q5_1 => run::<Q5_1>(raw, xq, dx, xsum, out),
            Q4_K => run::<Q4_K>(raw, xq, dx, xsum, out),
            Q5_K => run::<Q5_K>(raw, xq, dx, xsum, out),
            _ => run::<Q6_K>(raw, xq, dx, xsum, out),
        }
    }
}

/// [`matvec`] for the format tagged `K`.
///
/// # Safety
/// As [`matvec`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<const K: u8>(raw: &[u8], xq: &[i8], dx: &[f32], xsum: &[f32], out: &mut [f32]) {
    let (vals, bb) = geometry(K);
    let cols = xq.len();
    let rb = cols / vals * bb;
    let rows = out.len();
    let mins = matches!(K, Q5_1 | Q4_K | Q5_K);
    assert!(
        cols > 0
            && cols.is_multiple_of(vals)
            && dx.len() >= cols / 32
            && (!mins || xsum.len() >= cols / 32)
            && raw.len() >= rows * rb,
        "avx2::blocks_int8::matvec: bad sizes"
    );
    // The codes are read unsigned: each K-quant sub-block's lanes start from -offset Σ x of
    // their four activations; each 32-value block's offset term, -offset Σ x, is scaled with
    // the block instead (`rows_small`). Both once per product, for every row.
    let off = _mm256_set1_epi8(code_offset(K));
    let lane_offsets = |b: usize| {
        // SAFETY: values 32 b..32 b + 32 are inside xq (cols is a multiple of 32).
        let x = unsafe { _mm256_loadu_si256(xq.as_ptr().add(32 * b) as *const __m256i) };
        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(off, x), _mm256_set1_epi16(1));
        _mm256_sub_epi32(_mm256_setzero_si256(), s)
    };
    let small = K <= Q5_1;
    let base: Vec<__m256i> = if small {
        Vec::new()
    } else {
        (0..cols / 32).map(lane_offsets).collect()
    };
    // For the 32-value formats, per block and padded with zeros to whole eights: d_x, the
    // offset term (Q4_0, Q5_0) and Σ x (Q5_1).
    let (mut offs, mut dx8, mut xsum8) = (Vec::new(), Vec::new(), Vec::new());
    if small {
        let padded = (cols / 32).next_multiple_of(8);
        dx8 = dx[..cols / 32].to_vec();
        dx8.resize(padded, 0.0);
        if code_offset(K) != 0 {
            offs = (0..cols / 32)
                .map(|b| super::hsum(_mm256_cvtepi32_ps(lane_offsets(b))))
                .collect();
            offs.resize(padded, 0.0);
        }
        if K == Q5_1 {
            xsum8 = xsum[..cols / 32].to_vec();
            xsum8.resize(padded, 0.0);
        }
    }
    passes(rows, rb, raw.as_ptr(), |r, n| {
        let out = &mut out[r..r + n];
        let (dx, xsum) = if small {
            (&dx8[..], &xsum8[..])
        } else {
            (dx, xsum)
        };
        let sums = Sums {
            xq,
            dx,
            xsum,
            base: &base,
            offs: &offs,
        };
        // SAFETY: rows r..r + n are inside raw (asserted above); the CPU has the features
        // (this function's contract).
        unsafe {
            match n {
                ROWS => rows_of::<K, ROWS>(raw, rb, &sums, r, out),
                _ => rows_of::<K, 1>(raw, rb, &sums, r, out),
            }
        }
    });
}

/// What every row of one product reads besides its own blocks: the activations, their scales
/// and sums per 32, and the codes' offset terms (per lane of four activations for the
/// K-quants, per block for Q4_0 and Q5_0; empty for the formats whose codes are not offset).
struct Sums<'a> {
    xq: &'a [i8],
    dx: &'a [f32],
    xsum: &'a [f32],
    base: &'a [__m256i],
    offs: &'a [f32],
}

/// The 32 codes of the 32-value block at `p`, unsigned, in value order.
///
/// # Safety
/// The block at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn small_codes<const K: u8>(p: *const u8) -> __m256i {
    let (qh_at, qs_at) = match K {
        Q4_0 => (0, 2),
        Q5_0 => (2, 6),
        _ => (4, 8),
    };
    // SAFETY: the nibbles (and the fifth bits) lie inside the block (the contract).
    unsafe {
        // The sixteen bytes in both halves, the high half's shifted down to its high nibbles.
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(qs_at) as *const __m128i));
        let w = _mm256_and_si256(
            _mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
            _mm256_set1_epi8(0x0F),
        );
        if K == Q4_0 {
            return w;
        }
        // Bit j of `qh` to byte j: bytes 0-1 of the word to the low half's sixteen bytes, 2-3
        // to the high half's, then each byte's own bit tested.
        let qh = (p.add(qh_at) as *const u32).read_unaligned();
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), spread);
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)))
    }
}

/// Codes `32 s .. 32 s + 32` (sub-block `s`) of the K-quant super-block at `p`, unsigned, in
/// value order.
///
/// # Safety
/// The super-block at `p` must be readable; `s < 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_codes<const K: u8>(p: *const u8, s: usize) -> __m256i {
    let nibble = _mm256_set1_epi8(0x0F);
    let low_or_high = |v: __m256i, high: bool| {
        let v = if high { _mm256_srli_epi16::<4>(v) } else { v };
        _mm256_and_si256(v, nibble)
    };
    // SAFETY: every load lies inside the super-block (the contract; offsets from the layouts).
    unsafe {
        match K {
            // Sub-block s: the low (even s) or high nibbles of bytes 32(s / 2)..+32.
            Q4_K | Q5_K => {
                let qs = if K == Q4_K { 16 } else { 48 };
                let v = _mm256_loadu_si256(p.add(qs + 32 * (s / 2)) as *const __m256i);
                let w = low_or_high(v, s % 2 == 1);
                if K == Q4_K {
                    return w;
                }
                // Fifth bits: bit s of byte l of `qh` for value l.
                let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
                let bit = _mm256_set1_epi8(1 << s);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)))
            }
            // Half h = s / 4, group g = s % 4: the low (g < 2) or high nibbles of
            // ql[64h + 32(g % 2)..+32], their two high bits bits 2g, 2g + 1 of qh[32h + l].
            _ => {
                let (h, g) = (s / 4, s % 4);
                let ql = _mm256_loadu_si256(p.add(64 * h + 32 * (g % 2)) as *const __m256i);
                let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                let top = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g as i32));
                let top = _mm256_slli_epi16::<4>(_mm256_and_si256(top, _mm256_set1_epi8(3)));
                _mm256_or_si256(low_or_high(ql, g >= 2), top)
            }
        }
    }
}

/// [`run`] for the `R` rows from `r0`.
///
/// # Safety
/// As [`matvec`], for rows `r0..r0 + R` inside `raw` (`rb` bytes a row); `out` holds `R`
/// values.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const K: u8, const R: usize>(
    raw: &[u8],
    rb: usize,
    sums: &Sums<'_>,
    r0: usize,
    out: &mut [f32],
) {
    let row = |r: usize| raw.as_ptr().wrapping_add((r0 + r) * rb);
    let (xq, dx, xsum) = (sums.xq, sums.dx, sums.xsum);
    // SAFETY: rows r0..r0 + R are inside raw (the caller's contract, passed on).
    let (acc, mins) = unsafe {
        if K <= Q5_1 {
            rows_small::<K, R>(row, sums)
        } else {
            rows_k::<K, R>(row, xq, dx, xsum, sums.base)
        }
    };
    for r in 0..R {
        out[r] = super::hsum(_mm256_add_ps(acc[r], mins[r]));
    }
}

/// Blocks whose scales [`rows_small`] prepares at a time.
const SEGMENT: usize = 64;

/// The f16 at `p`, `p + stride`, ... of `n <= 8` blocks as one vector of eight (zeros past
/// `n`), put together in general registers: eight 16-bit stores read back as one vector would
/// wait for the stores to retire.
///
/// # Safety
/// Two bytes must be readable at each of the `n` addresses.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves8(p: *const u8, stride: usize, n: usize) -> __m128i {
    let mut v = [0u64; 2];
    for i in 0..n {
        // SAFETY: block i < n's two bytes (the contract).
        let h = unsafe { (p.add(i * stride) as *const u16).read_unaligned() };
        v[i / 4] |= u64::from(h) << (16 * (i % 4));
    }
    _mm_set_epi64x(v[1] as i64, v[0] as i64)
}

/// [`rows_of`] for the 32-value formats, a block a vector: each row's sums and its offsets'
/// terms, in lanes (`row(r)`: where row `r` starts).
///
/// Up to [`SEGMENT`] blocks at a time, each row's scales `d · d_x` are first gathered as f16,
/// converted and multiplied eight blocks at a time into a buffer, and the block's terms that
/// do not depend on its codes (`d · d_x` times the codes' offset term, Q5_1's `m · Σ x`) summed
/// eight blocks a lane. Each block then costs its codes, two multiplies, a conversion and one
/// fused multiply-add with its scale broadcast from the buffer; a scalar conversion, product
/// and broadcast a block and row, and the offset's add, had been a quarter of the
/// instructions.
///
/// # Safety
/// As [`rows_of`].
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_small<const K: u8, const R: usize>(
    row: impl Fn(usize) -> *const u8,
    sums: &Sums<'_>,
) -> ([__m256; R], [__m256; R]) {
    let (_, bb) = geometry(K);
    let (xq, dx, xsum, offs) = (sums.xq, sums.dx, sums.xsum, sums.offs);
    let (nb, xp) = (xq.len() / 32, xq.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    // The terms outside the codes' products, eight blocks a lane.
    let mut terms = [_mm256_setzero_ps(); R];
    let mut scales = [[0f32; SEGMENT]; R];
    for s0 in (0..nb).step_by(SEGMENT) {
        let len = (nb - s0).min(SEGMENT);
        for r in 0..R {
            let p = row(r).wrapping_add(s0 * bb);
            for k in (0..len).step_by(8) {
                let at = s0 + k;
                let n = (len - k).min(8);
                // SAFETY: blocks s0 + k..s0 + k + n of row r are inside raw, and the
                // activations' terms of blocks at..at + 8 inside dx, xsum (Q5_1) and offs (Q4_0,
                // Q5_0), padded by the caller to whole eights; the store is inside `scales[r]`
                // (len <= SEGMENT, a multiple of 8).
                unsafe {
                    let d = _mm256_cvtph_ps(halves8(p.add(k * bb), bb, n));
                    let s = _mm256_mul_ps(d, _mm256_loadu_ps(dx.as_ptr().add(at)));
                    _mm256_storeu_ps(scales[r].as_mut_ptr().add(k), s);
                    if code_offset(K) != 0 {
                        let o = _mm256_loadu_ps(offs.as_ptr().add(at));
                        terms[r] = _mm256_fmadd_ps(s, o, terms[r]);
                    }
                    if K == Q5_1 {
                        let m = _mm256_cvtph_ps(halves8(p.add(k * bb + 2), bb, n));
                        let xs = _mm256_loadu_ps(xsum.as_ptr().add(at));
                        terms[r] = _mm256_fmadd_ps(m, xs, terms[r]);
                    }
                }
            }
        }
        for k in 0..len {
            let b = s0 + k;
            // SAFETY: values 32 b..32 b + 32 are inside xq (the caller's contract).
            let x = unsafe { _mm256_loadu_si256(xp.add(32 * b) as *const __m256i) };
            for r in 0..R {
                // SAFETY: block b of row r is inside raw (the caller's contract); k < len <=
                // SEGMENT.
                let (w, s) = unsafe {
                    (
                        small_codes::<K>(row(r).wrapping_add(b * bb)),
                        _mm256_broadcast_ss(scales[r].get_unchecked(k)),
                    )
                };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r]);
            }
        }
    }
    (acc, terms)
}

/// [`rows_of`] for the K-quants, a sub-block of 32 values a vector: each row's sums and its
/// offsets' terms, in lanes (`row(r)`: where row `r` starts).
///
/// # Safety
/// As [`rows_of`].
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_k<const K: u8, const R: usize>(
    row: impl Fn(usize) -> *const u8,
    xq: &[i8],
    dx: &[f32],
    xsum: &[f32],
    base: &[__m256i],
) -> ([__m256; R], [__m256; R]) {
    let (_, bb) = geometry(K);
    let (cols, xp) = (xq.len(), xq.as_ptr());
    let mut acc = [_mm256_setzero_ps(); R];
    // The offsets' terms, a lane per sub-block (Q4_K, Q5_K).
    let mut mins8 = [_mm256_setzero_ps(); R];
    // Each row's scale times d_x per 16 values of the super-block.
    let mut su = [[0.0f32; 16]; R];
    for b in 0..cols / 256 {
        // SAFETY: the super-block's eight sub-blocks are inside dx and xsum (the caller's
        // contract).
        let (dx8, xs) = unsafe {
            let xs = if K == Q6_K {
                _mm256_setzero_ps()
            } else {
                _mm256_loadu_ps(xsum.as_ptr().add(8 * b))
            };
            (_mm256_loadu_ps(dx.as_ptr().add(8 * b)), xs)
        };
        for r in 0..R {
            let p = row(r).wrapping_add(b * bb);
            // SAFETY: the super-block b of row r is inside raw (the caller's contract);
            // offsets from the layouts; the stores stay inside `su[r]`.
            unsafe {
                if K == Q6_K {
                    let d = _mm256_set1_ps(h2f(p.add(208)));
                    let sc = _mm_loadu_si128(p.add(192) as *const __m128i);
                    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
                    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)));
                    let twice =
                        |a: i32| _mm256_setr_epi32(a, a, a + 1, a + 1, a + 2, a + 2, a + 3, a + 3);
                    let (dlo, dhi) = (
                        _mm256_permutevar8x32_ps(dx8, twice(0)),
                        _mm256_permutevar8x32_ps(dx8, twice(4)),
                    );
                    let o = su[r].as_mut_ptr();
                    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_mul_ps(lo, d), dlo));
                    _mm256_storeu_ps(o.add(8), _mm256_mul_ps(_mm256_mul_ps(hi, d), dhi));
                } else {
                    let (d, dmin) = (h2f(p), h2f(p.add(2)));
                    let (sc, mn) = crate::simd::blocks::k4_scales(p.add(4));
                    let s8 = _mm256_mul_ps(_mm256_mul_ps(bytes8_ps(sc), _mm256_set1_ps(d)), dx8);
                    _mm256_storeu_ps(su[r].as_mut_ptr(), s8);
                    let m8 = _mm256_mul_ps(bytes8_ps(mn), xs);
                    mins8[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(-dmin), mins8[r]);
                }
            }
        }
        for s in 0..8 {
            // SAFETY: values 256 b + 32 s..+32 are inside xq (cols is a multiple of 256).
            let x = unsafe { _mm256_loadu_si256(xp.add(256 * b + 32 * s) as *const __m256i) };
            let bs = base[8 * b + s];
            for r in 0..R {
                // SAFETY: the super-block b of row r is inside raw (the caller's contract).
                let w = unsafe { k_codes::<K>(row(r).wrapping_add(b * bb), s) };
                let scale = if K == Q6_K {
                    // Lanes 0-3 are values 0-15 of the sub-block, 4-7 values 16-31.
                    _mm256_set_m128(_mm_set1_ps(su[r][2 * s + 1]), _mm_set1_ps(su[r][2 * s]))
                } else {
                    _mm256_set1_ps(su[r][s])
                };
                acc[r] = _mm256_fmadd_ps(dot32::<K>(w, x, bs), scale, acc[r]);
            }
        }
    }
    (acc, mins8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format gives the portable int8 product within rounding, over whole and partial
    /// passes of rows and short and long rows ([`crate::qmatrix::blocks::check_int8_rows`];
    /// where the CPU has AVX2, otherwise there is nothing to run).
    #[test]
    fn raw_blocks_times_int8_activations_match_the_portable_product() {
        if !crate::qmatrix::Isa::Avx2.available() {
            return;
        }
        crate::qmatrix::blocks::check_int8_rows(|kind, raw, xq, dx, xsum, out| {
            // SAFETY: the CPU has the features (checked above); the kernel checks the sizes.
            unsafe { matvec(kind, raw, xq, dx, xsum, out) }
        });
    }
}
