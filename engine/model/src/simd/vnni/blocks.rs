//! AVX-512 VNNI matrix-vector products over int8 activations for the block formats held as the
//! file's bytes (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; their layouts in
//! [`crate::qmatrix::blocks`]): the products llama.cpp computes for these formats at decode,
//! against activations quantized per 32 values.
//!
//! Every format is read 64 codes at a time as unsigned bytes `u` in value order (nibbles split
//! by a 64-bit shift of the upper copy, fifth bits added under a byte mask, Q6_K's two high bits
//! shifted into place), and one `vpdpbusd` per 64 codes and row sums each four products into
//! one of 16 lanes. The stored code is `u - offset` (8 for Q4_0, 16 for Q5_0, 32 for Q6_K, 0
//! otherwise): each lane starts from `-offset Σ x` of its four activations, computed once per
//! product for every row. A lane's four values share one scale unit (a block of 32 for the
//! 32-value formats, a group of 16 for the K-quants), so the lanes are converted to f32 once
//! and multiplied by their unit's `scale · d_x`: for the 32-value formats the two blocks'
//! scales read as scalars and spread over their halves of the lanes (a gather of sixteen
//! blocks' scales was slower), for the K-quants picked by a lane permute from the super-block's
//! sixteen scales, built once per super-block. Offsets (Q5_1, Q4_K, Q5_K) add `min · Σ x` with
//! the activations' exact f32 sums, as the f32 kernels do.

use super::{ROWS, bytes, passes};
use crate::qmatrix::Kind;
use crate::simd::blocks::{Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, code_offset, geometry, h2f, tag};
use std::arch::x86_64::*;

/// Whether the format holds 32-value blocks with one scale each (else 256-value super-blocks
/// with a scale per 16 values).
const fn small(k: u8) -> bool {
    k <= Q5_1
}

/// The lanes of a scale vector that pick groups `4z` to `4z + 3` of sixteen, four lanes each:
/// the units of the `z`-th 64 values of a K-quant super-block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
fn quad_index(z: usize) -> __m512i {
    let a = 4 * z as i32;
    let (b, c, d) = (a + 1, a + 2, a + 3);
    _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d)
}

/// `out[r] = Σ_j w[r][j] x[j]` for the `out.len()` rows of `kind` held in `raw` (whole blocks,
/// `xq.len()` values a row), with the activations quantized per 32 (`x[j] ≈ dx[j / 32] xq[j]`)
/// and `xsum` their exact sums per 32 (read only for the formats with offsets). The same sums
/// as [`crate::qmatrix::blocks::dot_row_q8`], in another order.
///
/// # Safety
/// The CPU must have what [`super::available`] checks. The sizes are checked.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
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
        "vnni::blocks::matvec: bad sizes"
    );
    // Each lane's -offset Σ x over its four activations, per 64 of them, for every row.
    let off = _mm512_set1_epi8(code_offset(K));
    let base: Vec<__m512i> = (0..cols.div_ceil(64))
        .map(|z| {
            // SAFETY: the first min(64, cols - 64 z) activations from 64 z are inside xq; the
            // masked load reads only them.
            let x =
                unsafe { _mm512_maskz_loadu_epi8(bytes(cols - 64 * z), xq.as_ptr().add(64 * z)) };
            _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, x),
            )
        })
        .collect();
    passes(rows, rb, raw.as_ptr(), |r, n| {
        let out = &mut out[r..r + n];
        // SAFETY: rows r..r + n are inside raw (asserted above); the CPU has the features
        // (this function's contract).
        unsafe {
            match n {
                ROWS => rows_of::<K, ROWS>(raw, rb, xq, dx, xsum, &base, r, out),
                _ => rows_of::<K, 1>(raw, rb, xq, dx, xsum, &base, r, out),
            }
        }
    });
}

/// The 64 codes of blocks `p` and, if `both`, the one after it (`bb` bytes on) of a 32-value
/// format, unsigned, in value order (zeros for a missing second block).
///
/// # Safety
/// The block at `p` (and the next if `both`) must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn small_codes<const K: u8>(p: *const u8, bb: usize, both: bool) -> __m512i {
    let (qh_at, qs_at) = match K {
        Q4_0 => (0, 2),
        Q5_0 => (2, 6),
        _ => (4, 8),
    };
    // Blocks A, B as 128-bit lanes [A, A, B, B], then the high nibbles of lanes 1 and 3.
    let spread = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    let shift = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    // SAFETY: the nibbles (and the fifth bits) lie inside the blocks (the contract).
    unsafe {
        let a = _mm_loadu_si128(p.add(qs_at) as *const __m128i);
        let b = if both {
            _mm_loadu_si128(p.add(bb + qs_at) as *const __m128i)
        } else {
            _mm_setzero_si128()
        };
        let w = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(_mm256_set_m128i(b, a)));
        let w = _mm512_and_si512(_mm512_srlv_epi64(w, shift), _mm512_set1_epi8(0x0F));
        if K == Q4_0 {
            return w;
        }
        let ha = (p.add(qh_at) as *const u32).read_unaligned();
        let hb = if both {
            (p.add(bb + qh_at) as *const u32).read_unaligned()
        } else {
            0
        };
        let fifth = u64::from(ha) | u64::from(hb) << 32;
        _mm512_mask_add_epi8(w, fifth, w, _mm512_set1_epi8(16))
    }
}

/// Codes `64 z .. 64 z + 64` of the K-quant super-block at `p`, unsigned, in value order.
///
/// # Safety
/// The super-block at `p` must be readable; `z < 4`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k_codes<const K: u8>(p: *const u8, z: usize) -> __m512i {
    // A 256-bit load as both halves of a vector, the upper half shifted by `hi` bits.
    let twice = |v: __m256i, hi: i64| {
        let w = _mm512_permutexvar_epi64(
            _mm512_setr_epi64(0, 1, 2, 3, 0, 1, 2, 3),
            _mm512_castsi256_si512(v),
        );
        _mm512_srlv_epi64(w, _mm512_setr_epi64(0, 0, 0, 0, hi, hi, hi, hi))
    };
    let nibble = _mm512_set1_epi8(0x0F);
    // SAFETY: every load lies inside the super-block (the contract; offsets from the layouts).
    unsafe {
        match K {
            // Sub-blocks 2z, 2z + 1: the low and high nibbles of bytes 32z..32z + 32.
            Q4_K | Q5_K => {
                let qs = if K == Q4_K { 16 } else { 48 };
                let v = _mm256_loadu_si256(p.add(qs + 32 * z) as *const __m256i);
                let w = _mm512_and_si512(twice(v, 4), nibble);
                if K == Q4_K {
                    return w;
                }
                // Fifth bits: bit 2z (bit 2z + 1) of byte l of `qh` for value l of sub-block
                // 2z (2z + 1).
                let qh = twice(_mm256_loadu_si256(p.add(16) as *const __m256i), 0);
                let sel = _mm512_inserti64x4::<1>(
                    _mm512_set1_epi8(1 << (2 * z)),
                    _mm256_set1_epi8(1 << (2 * z + 1)),
                );
                let fifth = _mm512_test_epi8_mask(qh, sel);
                _mm512_mask_add_epi8(w, fifth, w, _mm512_set1_epi8(16))
            }
            // Half h = z / 2 of 128 values: groups 2(z % 2) and 2(z % 2) + 1 are the low (even
            // z) or high (odd z) nibbles of ql[64h..64h + 64], their two high bits bits
            // 2g, 2g + 1 of qh[32h + l].
            _ => {
                let (h, pair) = (z / 2, z % 2);
                let ql = _mm512_loadu_si512(p.add(64 * h) as *const __m512i);
                let ql = if pair == 0 {
                    ql
                } else {
                    _mm512_srli_epi16::<4>(ql)
                };
                let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                let s = 4 * pair as i64;
                let w = _mm512_permutexvar_epi64(
                    _mm512_setr_epi64(0, 1, 2, 3, 0, 1, 2, 3),
                    _mm512_castsi256_si512(qh),
                );
                let top =
                    _mm512_srlv_epi64(w, _mm512_setr_epi64(s, s, s, s, s + 2, s + 2, s + 2, s + 2));
                let top = _mm512_slli_epi16::<4>(_mm512_and_si512(top, _mm512_set1_epi8(3)));
                _mm512_or_si512(_mm512_and_si512(ql, nibble), top)
            }
        }
    }
}

/// [`run`] for the `R` rows from `r0`; `base` holds each 64 activations' starting lanes.
///
/// # Safety
/// As [`matvec`], for rows `r0..r0 + R` inside `raw` (`rb` bytes a row); `out` holds `R`
/// values.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn rows_of<const K: u8, const R: usize>(
    raw: &[u8],
    rb: usize,
    xq: &[i8],
    dx: &[f32],
    xsum: &[f32],
    base: &[__m512i],
    r0: usize,
    out: &mut [f32],
) {
    let row = |r: usize| raw.as_ptr().wrapping_add((r0 + r) * rb);
    // SAFETY: rows r0..r0 + R are inside raw (the caller's contract, passed on).
    let (acc, mins) = unsafe {
        if small(K) {
            rows_small::<K, R>(row, xq, dx, xsum, base)
        } else {
            rows_k::<K, R>(row, xq, dx, xsum, base)
        }
    };
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], mins[r]));
    }
}

/// [`rows_of`] for the 32-value formats, two blocks a vector: each row's sums and its
/// offsets' terms, in lanes (`row(r)`: where row `r` starts).
///
/// # Safety
/// As [`rows_of`].
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn rows_small<const K: u8, const R: usize>(
    row: impl Fn(usize) -> *const u8,
    xq: &[i8],
    dx: &[f32],
    xsum: &[f32],
    base: &[__m512i],
) -> ([__m512; R], [__m512; R]) {
    let (_, bb) = geometry(K);
    let (cols, xp) = (xq.len(), xq.as_ptr());
    let mut acc = [_mm512_setzero_ps(); R];
    let nb = cols / 32;
    // Lanes 0-7 from the first of two values, 8-15 from the second.
    let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    // The offsets' terms (Q5_1), a lane per block of the pair.
    let mut mins2 = [_mm_setzero_ps(); R];
    let mut b = 0;
    while b < nb {
        let two = (nb - b).min(2);
        // SAFETY: blocks b..b + two are inside xq (two · 32 bytes), dx and xsum (the
        // caller's contract); masked loads read only those.
        let (x, dxp, xs) = unsafe {
            let k = (1u8 << two) - 1;
            (
                _mm512_maskz_loadu_epi8(bytes(32 * two), xp.add(b * 32)),
                _mm_maskz_loadu_ps(k, dx.as_ptr().add(b)),
                if K == Q5_1 {
                    _mm_maskz_loadu_ps(k, xsum.as_ptr().add(b))
                } else {
                    _mm_setzero_ps()
                },
            )
        };
        let dxp = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(dxp));
        for r in 0..R {
            let p = row(r).wrapping_add(b * bb);
            // SAFETY: blocks b..b + two of row r are inside raw (the caller's contract),
            // their first four bytes `d` (and `m` for Q5_1) as f16.
            let (w, head) = unsafe {
                let w = small_codes::<K>(p, bb, two == 2);
                let a = (p as *const u32).read_unaligned();
                let b = if two == 2 {
                    (p.add(bb) as *const u32).read_unaligned()
                } else {
                    0
                };
                (w, _mm_setr_epi32(a as i32, b as i32, 0, 0))
            };
            let dd = _mm_cvtph_ps(_mm_packus_epi32(
                _mm_and_si128(head, _mm_set1_epi32(0xFFFF)),
                _mm_setzero_si128(),
            ));
            if K == Q5_1 {
                let m = _mm_cvtph_ps(_mm_packus_epi32(
                    _mm_srli_epi32::<16>(head),
                    _mm_setzero_si128(),
                ));
                mins2[r] = _mm_fmadd_ps(m, xs, mins2[r]);
            }
            let scale = _mm512_mul_ps(
                _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(dd)),
                dxp,
            );
            let sums = _mm512_dpbusd_epi32(base[b / 2], w, x);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
        }
        b += 2;
    }
    (acc, mins2.map(|m| _mm512_zextps128_ps512(m)))
}

/// [`rows_of`] for the K-quants, 64 values of a super-block a vector: each row's sums and its
/// offsets' terms, in lanes (`row(r)`: where row `r` starts).
///
/// # Safety
/// As [`rows_of`].
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn rows_k<const K: u8, const R: usize>(
    row: impl Fn(usize) -> *const u8,
    xq: &[i8],
    dx: &[f32],
    xsum: &[f32],
    base: &[__m512i],
) -> ([__m512; R], [__m512; R]) {
    let (_, bb) = geometry(K);
    let (cols, xp) = (xq.len(), xq.as_ptr());
    let mut acc = [_mm512_setzero_ps(); R];
    // The offsets' terms, a lane per sub-block (Q4_K, Q5_K).
    let mut mins8 = [_mm256_setzero_ps(); R];
    let mut ds = [_mm512_setzero_ps(); R];
    // dx per 32 values, each twice: one lane per group of 16.
    let twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for b in 0..cols / 256 {
        // SAFETY: the super-block's eight sub-blocks are inside dx and xsum (the caller's
        // contract).
        let (dxu, xs) = unsafe {
            let dx8 = _mm256_loadu_ps(dx.as_ptr().add(8 * b));
            let xs = if K == Q6_K {
                _mm256_setzero_ps()
            } else {
                _mm256_loadu_ps(xsum.as_ptr().add(8 * b))
            };
            (
                _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(dx8)),
                xs,
            )
        };
        for r in 0..R {
            let p = row(r).wrapping_add(b * bb);
            // SAFETY: the super-block b of row r is inside raw (the caller's contract);
            // offsets from the layouts.
            unsafe {
                if K == Q6_K {
                    let sc = _mm_loadu_si128(p.add(192) as *const __m128i);
                    let scf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc));
                    ds[r] = _mm512_mul_ps(_mm512_mul_ps(scf, _mm512_set1_ps(h2f(p.add(208)))), dxu);
                } else {
                    let (d, dmin) = (h2f(p), h2f(p.add(2)));
                    let (sc, mn) = crate::simd::blocks::k4_scales(p.add(4));
                    let sc = _mm_cvtsi64_si128(sc as i64);
                    let scf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc, sc)));
                    ds[r] = _mm512_mul_ps(_mm512_mul_ps(scf, _mm512_set1_ps(d)), dxu);
                    let mnf =
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64)));
                    mins8[r] =
                        _mm256_fmadd_ps(_mm256_mul_ps(mnf, xs), _mm256_set1_ps(-dmin), mins8[r]);
                }
            }
        }
        for z in 0..4 {
            // SAFETY: values 256 b + 64 z.. + 64 are inside xq (cols is a multiple of 256).
            let x = unsafe { _mm512_loadu_si512(xp.add(256 * b + 64 * z) as *const __m512i) };
            let pick = quad_index(z);
            for r in 0..R {
                // SAFETY: the super-block b of row r is inside raw (the caller's contract).
                let w = unsafe { k_codes::<K>(row(r).add(b * bb), z) };
                let sums = _mm512_dpbusd_epi32(base[4 * b + z], w, x);
                let scale = _mm512_permutexvar_ps(pick, ds[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            }
        }
    }
    (acc, mins8.map(|m| _mm512_zextps256_ps512(m)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format gives the portable int8 product within rounding, over whole and partial
    /// passes of rows and short and long rows ([`crate::qmatrix::blocks::check_int8_rows`];
    /// where the CPU has VNNI, otherwise there is nothing to run).
    #[test]
    fn raw_blocks_times_int8_activations_match_the_portable_product() {
        if !super::super::available() {
            return;
        }
        crate::qmatrix::blocks::check_int8_rows(|kind, raw, xq, dx, xsum, out| {
            // SAFETY: the CPU has the features (checked above); the kernel checks the sizes.
            unsafe { matvec(kind, raw, xq, dx, xsum, out) }
        });
    }
}
