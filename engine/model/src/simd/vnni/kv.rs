//! AVX-512 VNNI and VBMI kernels of decode attention in integers, over one block of at most
//! sixteen tokens of a chunk stored in unsigned codes with a minimum and a scale per group
//! (keys per channel, values per token or per token and group of channels, `ValueGroups`): the
//! int8 form of `simd::avx512::kv`'s `dot_rows_stored` and `axpy_rows_stored` with the
//! parameters' folding inside.
//!
//! Each kernel folds the scales into its f32 rows (the query times the keys' scales, the
//! attention weights times the values' scales), rounds them to bytes against their largest
//! magnitude (a query row 64 channels at a time, a row of weights 16 tokens at a time), and
//! multiplies them with the codes by `vpdpbusd` (64 products a pass, summed four at a time
//! into 32-bit lanes, exactly); the minimums' term stays in f32. The rounding is the only
//! error: at most half a step times each code, the step being `max |x| / 127` for a query's
//! piece (signed bytes against the unsigned codes) and `max / 255` for a row of weights (never
//! negative: unsigned bytes against the codes read as signed, 8-bit codes less 128 with the
//! difference added back from the weights' sum).
//!
//! - Scores ([`dot_rows_coded`], 4- and 8-bit keys): a register holds 64 codes of two keys;
//!   one `vpdpbusd` leaves eight partial sums of each, and the sixteen keys' sums are put
//!   together by interleaving, as `simd::avx512::kv::reduce16` does for f32.
//! - Weighted values ([`axpy_rows_coded`], 2-, 3-, 4- and 8-bit values): the four bytes of a
//!   lane must be four tokens' codes of one channel, so four value rows are interleaved by one
//!   two-register byte permute (`vpermi2b`) and one per-byte bit shift (`vpmultishiftqb`)
//!   per 64 codes, and the four tokens' weights are one broadcast lane.
//!
//! Against the f32 kernels, attention of one decode step at depth 8,192 over k4v3 chunks takes
//! about a quarter less time on an AMD EPYC (Zen 4), and the service's mix stays within 0.25% of
//! int8's perplexity (docs/bench-long.md, "Decode attention in integers").

use crate::simd::{
    ValueGroups, coded_block_fits as block_fits, fold_piece_groups, inverse_step, sixteen_rows,
};
use std::arch::x86_64::*;

/// Whether this CPU runs these kernels: what [`super::available`] checks, and VBMI.
pub fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| super::available() && std::arch::is_x86_feature_detected!("avx512vbmi"))
}

/// The first `n` of sixteen lanes.
#[inline]
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 }
}

/// The statistics of a row folded with a group's parameters: the first `valid` of `x`'s values
/// (`len` in all, a multiple of 16; the rest taken as 0) times `scales`: the largest magnitude
/// of `x · scales`, and `x · mins`.
///
/// # Safety
/// The CPU must have what [`available`] checks; `x`, `mins` and `scales` must hold `valid`
/// values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn fold_stats(
    x: *const f32,
    mins: *const f32,
    scales: *const f32,
    len: usize,
    valid: usize,
) -> (f32, f32) {
    let (mut bias, mut top) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for v in 0..len / 16 {
        let m = lanes(valid.saturating_sub(16 * v));
        // SAFETY: the loads are masked to values 16 v.. of the `valid` ones (the contract).
        let (xv, sv, mv) = unsafe {
            (
                _mm512_maskz_loadu_ps(m, x.add(16 * v)),
                _mm512_maskz_loadu_ps(m, scales.add(16 * v)),
                _mm512_maskz_loadu_ps(m, mins.add(16 * v)),
            )
        };
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_mul_ps(xv, sv)));
        bias = _mm512_fmadd_ps(xv, mv, bias);
    }
    (_mm512_reduce_max_ps(top), _mm512_reduce_add_ps(bias))
}

/// Sixteen values of a folded row of non-negative values (attention weights) rounded to
/// unsigned bytes: `round(x · scales · inv)`, `inv` 255 over the row's largest; negative
/// products are taken as 0. Lanes outside `mask` are 0.
///
/// # Safety
/// The CPU must have what [`available`] checks; the lanes of `mask` must be readable from `x`
/// and `scales`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn round16_u8(x: *const f32, scales: *const f32, inv: __m512, mask: __mmask16) -> __m128i {
    // SAFETY: masked to the readable lanes (the contract).
    let f = unsafe {
        _mm512_mul_ps(
            _mm512_maskz_loadu_ps(mask, x),
            _mm512_maskz_loadu_ps(mask, scales),
        )
    };
    let q = _mm512_max_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(f, inv)),
        _mm512_setzero_si512(),
    );
    _mm512_cvtusepi32_epi8(q)
}

/// Sixty-four channels of a query row (from `q`, minimums and scales from `mins` and `scales`)
/// folded and rounded to signed bytes against their largest magnitude (`round(x · scales · 127 /
/// max)`, the product computed once, so no byte exceeds ±127), and laid out as a key pair's codes
/// ([`key_pair`]): for 4-bit keys the even channels (the low nibbles) then the odd ones, for
/// 8-bit keys each half; each twice. With them, the step (the largest over 127) and the row's
/// dot product with the minimums.
///
/// # Safety
/// The CPU must have what [`available`] checks; 64 values must be readable from `q`, `mins`
/// and `scales`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn query_bytes<const K: usize>(
    q: *const f32,
    mins: *const f32,
    scales: *const f32,
) -> ([__m512i; 2], f32, f32) {
    let (mut top, mut bias) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    // SAFETY: 64 readable values of each (the contract).
    let f: [__m512; 4] = std::array::from_fn(|i| unsafe {
        let x = _mm512_loadu_ps(q.add(16 * i));
        let f = _mm512_mul_ps(x, _mm512_loadu_ps(scales.add(16 * i)));
        top = _mm512_max_ps(top, _mm512_abs_ps(f));
        bias = _mm512_fmadd_ps(x, _mm512_loadu_ps(mins.add(16 * i)), bias);
        f
    });
    let top = _mm512_reduce_max_ps(top);
    let inv = _mm512_set1_ps(inverse_step(top, 127.0));
    let b: [__m128i; 4] =
        std::array::from_fn(|i| _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(f[i], inv))));
    let (step, bias) = (top / 127.0, _mm512_reduce_add_ps(bias));
    let x = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(b[0]), b[1]);
    let x = _mm512_inserti32x4::<3>(_mm512_inserti32x4::<2>(x, b[2]), b[3]);
    if K == 4 {
        const EVEN: [u8; 64] = {
            let mut t = [0u8; 64];
            let mut i = 0;
            while i < 64 {
                t[i] = (2 * (i % 32)) as u8;
                i += 1;
            }
            t
        };
        // SAFETY: a 64-byte table.
        let even = unsafe { _mm512_loadu_si512(EVEN.as_ptr() as *const _) };
        let odd = _mm512_add_epi8(even, _mm512_set1_epi8(1));
        let v = [
            _mm512_permutexvar_epi8(even, x),
            _mm512_permutexvar_epi8(odd, x),
        ];
        (v, step, bias)
    } else {
        let v = [
            _mm512_shuffle_i64x2::<0x44>(x, x),
            _mm512_shuffle_i64x2::<0xEE>(x, x),
        ];
        (v, step, bias)
    }
}

/// Channels `64 u..64 u + 64` of two keys' `K`-bit codes (rows from `a` and `b`) as the two
/// registers of unsigned bytes [`query_bytes`] pairs with: each key's codes in one half, for
/// 4-bit keys the low nibbles in the first register and the high ones in the second, for
/// 8-bit keys channels 0-31 of the piece in the first and 32-63 in the second.
///
/// # Safety
/// The CPU must have what [`available`] checks; each row's bytes of those channels must be
/// readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn key_pair<const K: usize>(a: *const u8, b: *const u8, u: usize) -> [__m512i; 2] {
    // SAFETY: the bytes of channels 64 u..64 u + 64 of both rows (the contract).
    unsafe {
        if K == 4 {
            let nib = _mm512_set1_epi8(0x0F);
            let x = _mm512_castsi256_si512(_mm256_loadu_si256(a.add(32 * u) as *const __m256i));
            let x = _mm512_inserti64x4::<1>(x, _mm256_loadu_si256(b.add(32 * u) as *const __m256i));
            [
                _mm512_and_si512(x, nib),
                _mm512_and_si512(_mm512_srli_epi16::<4>(x), nib),
            ]
        } else {
            let (a, b) = (a.add(64 * u), b.add(64 * u));
            let lo = _mm512_castsi256_si512(_mm256_loadu_si256(a as *const __m256i));
            let hi = _mm512_castsi256_si512(_mm256_loadu_si256(a.add(32) as *const __m256i));
            [
                _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(b as *const __m256i)),
                _mm512_inserti64x4::<1>(hi, _mm256_loadu_si256(b.add(32) as *const __m256i)),
            ]
        }
    }
}

/// Per 128-bit lane `m`, element `e` of the result is the sum of `w[e]`'s four elements in
/// that lane (as `simd::avx512::kv::lane_partials`, in integers).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
fn lane_sums(w: &[__m512i; 4]) -> __m512i {
    let x = _mm512_add_epi32(
        _mm512_unpacklo_epi32(w[0], w[1]),
        _mm512_unpackhi_epi32(w[0], w[1]),
    );
    let y = _mm512_add_epi32(
        _mm512_unpacklo_epi32(w[2], w[3]),
        _mm512_unpackhi_epi32(w[2], w[3]),
    );
    _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y))
}

/// Scores of `R` query rows against `n <= 16` keys of `hd` channels stored as unsigned
/// `K`-bit codes (4 or 8) with a minimum and a scale per channel:
/// `out[r · stride + j] = Σ_d q[r · hd + d] · (mins[d] + scales[d] · code(j, d))`, key j's
/// codes from packed value `first + j · hd` of `codes`, each row's folded query rounded to
/// bytes 64 channels at a time (see the module comment).
///
/// # Safety
/// The CPU must have what [`available`] checks. The sizes are checked.
#[allow(clippy::too_many_arguments)]
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
pub unsafe fn dot_rows_coded<const K: usize, const R: usize>(
    q: &[f32],
    hd: usize,
    mins: &[f32],
    scales: &[f32],
    codes: &[u8],
    first: usize,
    out: &mut [f32],
    stride: usize,
    n: usize,
) {
    assert!(
        matches!(K, 4 | 8)
            && block_fits(K, R, hd, n, codes.len(), first)
            && q.len() >= R * hd
            && mins.len() >= hd
            && scales.len() >= hd
            && (n == 0 || out.len() >= (R - 1) * stride + n),
        "vnni::kv::dot_rows_coded: bad sizes"
    );
    if n == 0 {
        return;
    }
    let (qp, mp, sp) = (q.as_ptr(), mins.as_ptr(), scales.as_ptr());
    let row_bytes = hd * K / 8;
    let mut tail = Vec::new();
    let kp = sixteen_rows(codes, first * K / 8, n, row_bytes, &mut tail);
    // Per row, the scores so far (the minimums' term first).
    let mut scores = [_mm512_setzero_ps(); R];
    let mut step = [0f32; R];
    let mut qv = [[_mm512_setzero_si512(); 2]; R];
    // Sixty-four channels at a time, each piece of a query row rounded against its own
    // largest magnitude (a row of Gemma 3's 256 channels in one step cost it a third more KL).
    for u in 0..hd / 64 {
        for r in 0..R {
            let at = r * hd + 64 * u;
            let bias;
            // SAFETY: values at..at + 64 of `q` and 64 u..64 u + 64 of the parameters are
            // inside them (hd a multiple of 64, asserted).
            (qv[r], step[r], bias) =
                unsafe { query_bytes::<K>(qp.add(at), mp.add(64 * u), sp.add(64 * u)) };
            scores[r] = _mm512_add_ps(scores[r], _mm512_set1_ps(bias));
        }
        // Per row, the sums of keys e, e + 4, e + 8, e + 12 in the lanes of register e (four
        // partial sums a key).
        let mut w = [[_mm512_setzero_si512(); 4]; R];
        for e in 0..4 {
            // Keys e and e + 4 in one register, e + 8 and e + 12 in the other: so the sums
            // come out in the keys' order.
            let mut acc = [[_mm512_setzero_si512(); 2]; R];
            for h in 0..2 {
                let (j0, j1) = (e + 8 * h, e + 4 + 8 * h);
                // SAFETY: keys j0, j1 < 16 of `kp` (the chunk's or the padded copy's sixteen
                // rows), with their channels 64 u..64 u + 64.
                let halves =
                    unsafe { key_pair::<K>(kp.add(j0 * row_bytes), kp.add(j1 * row_bytes), u) };
                for r in 0..R {
                    let a = _mm512_dpbusd_epi32(acc[r][h], halves[0], qv[r][0]);
                    acc[r][h] = _mm512_dpbusd_epi32(a, halves[1], qv[r][1]);
                }
            }
            for r in 0..R {
                let (a, b) = (acc[r][0], acc[r][1]);
                let sums = _mm512_add_epi32(
                    _mm512_shuffle_i32x4::<0x88>(a, b),
                    _mm512_shuffle_i32x4::<0xDD>(a, b),
                );
                w[r][e] = sums;
            }
        }
        for r in 0..R {
            let sums = _mm512_cvtepi32_ps(lane_sums(&w[r]));
            scores[r] = _mm512_fmadd_ps(sums, _mm512_set1_ps(step[r]), scores[r]);
        }
    }
    for (r, s) in scores.iter().enumerate() {
        // SAFETY: out[r · stride..r · stride + n] is inside `out` (asserted); the store is
        // masked to those lanes.
        unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(r * stride), lanes(n), *s) };
    }
}

/// The byte permute and the bit shifts that interleave four value rows of `BITS`-bit codes
/// (2, 3 or 4), each row's 64 channels in a 32-byte slot of a two-register source, into the
/// lanes of channels `16 k..16 k + 16`: byte `t` of lane `c` is row t's code of channel
/// `16 k + c`. Qword `q` of the permuted source holds two bytes of each row (from the byte
/// that holds channel `16 k + 2 q`); the shift of each output byte takes its code out of them.
const fn interleave_tables(bits: usize, k: usize) -> [[u8; 64]; 2] {
    let mut perm = [0u8; 64];
    let mut shift = [0u8; 64];
    let mut q = 0;
    while q < 8 {
        let d0 = 16 * k + 2 * q;
        let mut t = 0;
        while t < 4 {
            let mut b = 0;
            while b < 2 {
                // The byte past a row's last one is never shifted in; keep the index in range.
                perm[8 * q + 2 * t + b] = ((32 * t + bits * d0 / 8 + b) & 127) as u8;
                b += 1;
            }
            let mut i = 0;
            while i < 2 {
                shift[8 * q + 4 * i + t] = (16 * t + bits * d0 % 8 + bits * i) as u8;
                i += 1;
            }
            t += 1;
        }
        q += 1;
    }
    [perm, shift]
}

/// A row of attention weights (`n` from `w`) folded with the values' scales and rounded to
/// unsigned bytes ([`round16_u8`]), four tokens a lane, with its step and its bias: its
/// weights times the minimums, and for 8-bit codes (read as signed, less 128) 128 times the
/// bytes' sum in steps.
///
/// # Safety
/// The CPU must have what [`available`] checks; `n <= 16` values must be readable from `w`,
/// `mins` and `scales`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn weight_bytes<const K: usize>(
    w: *const f32,
    mins: *const f32,
    scales: *const f32,
    n: usize,
) -> ([i32; 4], f32, f32) {
    let mut wb = [0i32; 4];
    // SAFETY: the loads are masked to the n readable values (the contract); `wb` is 16 bytes.
    let (top, bias, bytes) = unsafe {
        let (top, bias) = fold_stats(w, mins, scales, 16, n);
        let inv = _mm512_set1_ps(inverse_step(top, 255.0));
        let bytes = round16_u8(w, scales, inv, lanes(n));
        _mm_storeu_si128(wb.as_mut_ptr() as *mut __m128i, bytes);
        (top, bias, bytes)
    };
    let step = top / 255.0;
    let offset = if K == 8 {
        // The bytes' sum: two sums of eight by `vpsadbw`.
        let s = _mm_sad_epu8(bytes, _mm_setzero_si128());
        let sum = _mm_cvtsi128_si64(s) + _mm_extract_epi64::<1>(s);
        128.0 * sum as f32 * step
    } else {
        0.0
    };
    (wb, step, bias + offset)
}

/// Channels `64 u..64 u + 64` of four value rows of `K`-bit codes (from `rows`, `row_bytes`
/// apart) interleaved for `vpdpbusd`: register k holds channels `16 k..16 k + 16`, byte t of
/// each lane row t's code, as signed bytes (8-bit codes less 128).
///
/// # Safety
/// The CPU must have what [`available`] checks; the four rows' bytes of those channels must be
/// readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn value_lanes<const K: usize>(rows: *const u8, row_bytes: usize, u: usize) -> [__m512i; 4] {
    const fn spread8() -> [u8; 64] {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            t[i] = (16 * (i % 4) + i / 4) as u8;
            i += 1;
        }
        t
    }
    let mut z = [_mm512_setzero_si512(); 4];
    if K == 8 {
        // Four rows' 16 bytes of a lane of channels side by side, then interleaved.
        const SPREAD: [u8; 64] = spread8();
        // SAFETY: a 64-byte table; bytes 64 u + 16 k.. of each row (the contract).
        unsafe {
            let spread = _mm512_loadu_si512(SPREAD.as_ptr() as *const _);
            for (k, zk) in z.iter_mut().enumerate() {
                let p = rows.add(64 * u + 16 * k);
                let x = _mm512_castsi128_si512(_mm_loadu_si128(p as *const __m128i));
                let x = _mm512_inserti32x4::<1>(x, _mm_loadu_si128(p.add(row_bytes) as *const _));
                let x =
                    _mm512_inserti32x4::<2>(x, _mm_loadu_si128(p.add(2 * row_bytes) as *const _));
                let x =
                    _mm512_inserti32x4::<3>(x, _mm_loadu_si128(p.add(3 * row_bytes) as *const _));
                let signed = _mm512_set1_epi8(-128);
                *zk = _mm512_xor_si512(_mm512_permutexvar_epi8(spread, x), signed);
            }
        }
        return z;
    }
    let tables: [[[u8; 64]; 2]; 4] = const {
        [
            interleave_tables(K, 0),
            interleave_tables(K, 1),
            interleave_tables(K, 2),
            interleave_tables(K, 3),
        ]
    };
    let piece = ((1u64 << (8 * K.min(4))) - 1) as u32;
    let mask = _mm512_set1_epi8(((1u16 << K) - 1) as u8 as i8);
    // SAFETY: each row's 8 K bytes of the channels (the contract), the loads masked to them;
    // 64-byte tables.
    unsafe {
        let p = rows.add(8 * K * u);
        let r0 = _mm256_maskz_loadu_epi8(piece, p as *const i8);
        let r1 = _mm256_maskz_loadu_epi8(piece, p.add(row_bytes) as *const i8);
        let r2 = _mm256_maskz_loadu_epi8(piece, p.add(2 * row_bytes) as *const i8);
        let r3 = _mm256_maskz_loadu_epi8(piece, p.add(3 * row_bytes) as *const i8);
        let s0 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(r0), r1);
        let s1 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(r2), r3);
        for (k, zk) in z.iter_mut().enumerate() {
            let perm = _mm512_loadu_si512(tables[k][0].as_ptr() as *const _);
            let shift = _mm512_loadu_si512(tables[k][1].as_ptr() as *const _);
            let x = _mm512_permutex2var_epi8(s0, perm, s1);
            *zk = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, x), mask);
        }
    }
    z
}

/// Sums of `n <= 16` value rows of `hd` channels stored as unsigned `K`-bit codes (2, 3, 4 or
/// 8) with a minimum and a scale per token and group of channels (`groups`), weighted for `R`
/// output rows:
/// `o[r · hd + d] += Σ_i w[r · wstride + i] · (mins[j] + scales[j] · code(i, d))`, `j` the
/// index of token i's group of channel d ([`ValueGroups`]), value row i's codes from packed
/// value `first + i · hd` of `codes`, each output row's weights folded with each group's scales
/// and rounded to unsigned bytes (see the module comment): weights and scales must not be
/// negative (attention weights and the formats' scales never are); a negative product counts
/// as 0.
///
/// # Safety
/// The CPU must have what [`available`] checks. The sizes are checked.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
pub unsafe fn axpy_rows_coded<const K: usize, const R: usize>(
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
) {
    assert!(
        matches!(K, 2 | 3 | 4 | 8)
            && block_fits(K, R, hd, n, codes.len(), first)
            && groups.fits(hd)
            && o.len() >= R * hd
            && mins.len() >= groups.params_len(hd, n)
            && scales.len() >= groups.params_len(hd, n)
            && (n == 0 || w.len() >= (R - 1) * wstride + n),
        "vnni::kv::axpy_rows_coded: bad sizes"
    );
    if n == 0 {
        return;
    }
    // Per row, the folded weights, step and bias of the groups of a piece's two halves of 32
    // channels, folded again only when the group changes.
    let mut folded = [[([0i32; 4], 0f32, 0f32); 2]; R];
    let mut held = [usize::MAX; 2];
    let row_bytes = hd * K / 8;
    let mut tail = Vec::new();
    let vp = sixteen_rows(codes, first * K / 8, n, row_bytes, &mut tail);
    for u in 0..hd / 64 {
        fold_piece_groups(groups, u, &mut held, &mut folded, |r, at| {
            // SAFETY: the n weights of row r and the n parameters of the group from `at` are
            // inside the slices (asserted: `params_len`).
            unsafe {
                weight_bytes::<K>(
                    w.as_ptr().add(r * wstride),
                    mins.as_ptr().add(at),
                    scales.as_ptr().add(at),
                    n,
                )
            }
        });
        let mut acc = [[_mm512_setzero_si512(); 4]; R];
        for g in 0..n.div_ceil(4) {
            // SAFETY: rows 4 g..4 g + 4 < 16 of `vp` (the chunk's sixteen rows or the padded
            // copy's), with their channels 64 u..64 u + 64.
            let z = unsafe { value_lanes::<K>(vp.add(4 * g * row_bytes), row_bytes, u) };
            for r in 0..R {
                let b = [
                    _mm512_set1_epi32(folded[r][0].0[g]),
                    _mm512_set1_epi32(folded[r][1].0[g]),
                ];
                for k in 0..4 {
                    acc[r][k] = _mm512_dpbusd_epi32(acc[r][k], b[k / 2], z[k]);
                }
            }
        }
        for r in 0..R {
            for k in 0..4 {
                let (_, step, bias) = folded[r][k / 2];
                let (s, b) = (_mm512_set1_ps(step), _mm512_set1_ps(bias));
                // SAFETY: o[r · hd + 64 u + 16 k..+ 16] is inside `o` (asserted).
                unsafe {
                    let p = o.as_mut_ptr().add(r * hd + 64 * u + 16 * k);
                    let x = _mm512_add_ps(_mm512_loadu_ps(p), b);
                    _mm512_storeu_ps(p, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][k]), s, x));
                }
            }
        }
    }
}
