//! AVX2 kernels of decode attention in integers, the 256-bit form of `simd::vnni::kv` for CPUs
//! without AVX-512 (AMD Zen 3, most laptops and desktops): over one block of at most sixteen
//! tokens of a chunk stored in unsigned codes with a minimum and a scale per group (keys per
//! channel, values per token or per token and group of channels), the parameters folded inside.
//!
//! The rounding is `simd::vnni::kv`'s: each query row folded with the keys' scales is rounded
//! to signed bytes against its largest magnitude, 64 channels at a time (`max |x| / 127` a
//! step), and each row of attention weights folded with the values' scales to unsigned bytes
//! against its largest (`max / 255`); the minimums' term stays in f32 and the integer sums are
//! exact. Without `vpdpbusd` the products are `vpmaddubsw` (unsigned bytes times signed bytes,
//! two products a 16-bit lane) where the operands keep its 16-bit sums from saturating, and
//! `vpmaddwd` (16-bit) where they would not:
//!
//! - Scores ([`dot_rows_coded`]): 4-bit keys' low and high nibbles (the even and odd channels)
//!   against the query's even and odd channels, two `vpmaddubsw` and one `vpmaddwd` by ones a
//!   key and row (16-bit sums of at most 4 · 15 · 127); 8-bit keys widened to 16 bits against
//!   the query in 16 bits (`vpmaddwd`; 2 · 255 · 127 would saturate `vpmaddubsw`). Eight keys'
//!   eight partial sums are put together by `vphaddd`, as `simd::avx2::kv::reduce8` does in
//!   f32.
//! - Weighted values ([`axpy_rows_coded`]): each value row's 64 codes are first laid out as
//!   bytes (2- and 3-bit codes by one in-lane byte shuffle, a 16-bit multiply and a shift per
//!   sixteen codes, 4-bit codes by their nibbles interleaved; the same layout for every
//!   width), two tokens' bytes of each channel
//!   side by side; a `vpmaddubsw` against the two tokens' weights adds both products per
//!   channel, and four such (eight tokens, at most 8 · 255 · 15 < 2^15) are summed in 16 bits
//!   before they are widened. 8-bit codes take `vpmaddwd` on the same pairs widened to 16 bits.

use crate::simd::{
    ValueGroups, coded_block_fits as block_fits, fold_piece_groups, inverse_step, sixteen_rows,
};
use std::arch::x86_64::*;

/// Whether this CPU runs these kernels: AVX2, FMA and F16C (the engine's AVX2 path).
pub fn available() -> bool {
    crate::qmatrix::Isa::Avx2.available()
}

/// A mask of the first `n` of eight 32-bit lanes (for `vmaskmovps`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes8(n: usize) -> __m256i {
    let n = n.min(8) as i32;
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// The largest of eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// The statistics of a row folded with a group's parameters (as `simd::vnni::kv`'s): the
/// first `valid` of `x`'s `len` values (a multiple of 8; the rest taken as 0) times `scales`:
/// the largest magnitude of `x · scales`, and `x · mins`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `x`, `mins` and `scales` must hold `valid` values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fold_stats(
    x: *const f32,
    mins: *const f32,
    scales: *const f32,
    len: usize,
    valid: usize,
) -> (f32, f32) {
    let (mut bias, mut top) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    for v in 0..len / 8 {
        let m = lanes8(valid.saturating_sub(8 * v));
        // SAFETY: the loads are masked to values 8 v.. of the `valid` ones (the contract).
        let (xv, sv, mv) = unsafe {
            (
                _mm256_maskload_ps(x.add(8 * v), m),
                _mm256_maskload_ps(scales.add(8 * v), m),
                _mm256_maskload_ps(mins.add(8 * v), m),
            )
        };
        top = _mm256_max_ps(top, _mm256_and_ps(_mm256_mul_ps(xv, sv), abs));
        bias = _mm256_fmadd_ps(xv, mv, bias);
    }
    (hmax(top), super::hsum(bias))
}

/// Eight values of a folded row times `inv`, rounded to 32-bit integers (to nearest, ties to
/// even, as `vcvtps2dq` does on every path): `round(x · scales · inv)`, the product computed
/// as [`fold_stats`] computes it, so it never exceeds the row's largest. Lanes outside `mask`
/// are 0.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the lanes of `mask` must be readable from `x` and
/// `scales`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn round8(x: *const f32, scales: *const f32, inv: __m256, mask: __m256i) -> __m256i {
    // SAFETY: masked to the readable lanes (the contract).
    let f = unsafe {
        _mm256_mul_ps(
            _mm256_maskload_ps(x, mask),
            _mm256_maskload_ps(scales, mask),
        )
    };
    _mm256_cvtps_epi32(_mm256_mul_ps(f, inv))
}

/// Sixteen 32-bit integers (`a` then `b`) as 16-bit ones in order (saturating, never reached
/// by the kernels' values).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn words16(a: __m256i, b: __m256i) -> __m256i {
    // `vpackssdw` works per 128-bit lane: [a0-3, b0-3 | a4-7, b4-7]; the qword permute puts
    // them in order.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b))
}

/// Sixty-four channels of a query row (from `q`, minimums and scales from `mins` and
/// `scales`) folded and rounded to signed values against their largest magnitude, as
/// [`fold_stats`] and [`round8`] do (each product computed once here), laid out for `K`-bit
/// keys: for 4-bit keys two registers of bytes, the even channels (the codes' low nibbles) then
/// the odd ones; for 8-bit keys four registers of sixteen 16-bit values in order. With them,
/// the step (the largest over 127) and the row's dot product with the minimums.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; 64 values must be readable from `q`, `mins` and
/// `scales`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn query_words<const K: usize>(
    q: *const f32,
    mins: *const f32,
    scales: *const f32,
) -> ([__m256i; 4], f32, f32) {
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let (mut top, mut bias) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // SAFETY: 64 readable values of each (the contract).
    let f: [__m256; 8] = std::array::from_fn(|i| unsafe {
        let x = _mm256_loadu_ps(q.add(8 * i));
        let f = _mm256_mul_ps(x, _mm256_loadu_ps(scales.add(8 * i)));
        top = _mm256_max_ps(top, _mm256_and_ps(f, abs));
        bias = _mm256_fmadd_ps(x, _mm256_loadu_ps(mins.add(8 * i)), bias);
        f
    });
    let top = hmax(top);
    let inv = _mm256_set1_ps(inverse_step(top, 127.0));
    let y: [__m256i; 8] = std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv)));
    let w = [
        words16(y[0], y[1]),
        words16(y[2], y[3]),
        words16(y[4], y[5]),
        words16(y[6], y[7]),
    ];
    let (step, bias) = (top / 127.0, super::hsum(bias));
    if K == 8 {
        return (w, step, bias);
    }
    // Bytes in order (channels 0-31 and 32-63: `vpacksswb` works per 128-bit lane, as
    // `vpackssdw` in `words16`), then per lane the even channels in the low eight bytes and the
    // odd in the high, then the lanes' halves gathered.
    let split = _mm256_setr_epi8(
        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5,
        7, 9, 11, 13, 15,
    );
    let b0 = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi16(w[0], w[1]));
    let b1 = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi16(w[2], w[3]));
    let (b0, b1) = (
        _mm256_shuffle_epi8(b0, split),
        _mm256_shuffle_epi8(b1, split),
    );
    let even = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_unpacklo_epi64(b0, b1));
    let odd = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_unpackhi_epi64(b0, b1));
    ([even, odd, even, odd], step, bias)
}

/// Eight vectors' horizontal sums, lane `i` of the result being `Σ v[i]` (exact in 32 bits).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce8_epi32(v: &[__m256i; 8]) -> __m256i {
    let a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    // a's low lane holds the low halves' sums of v0..v3, its high lane their high halves'.
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(a, b),
        _mm256_permute2x128_si256::<0x31>(a, b),
    )
}

/// Scores of `R` query rows against `n <= 16` keys of `hd` channels stored as unsigned
/// `K`-bit codes (4 or 8) with a minimum and a scale per channel, as
/// `simd::vnni::kv::dot_rows_coded` computes them (see the module comment):
/// `out[r · stride + j] = Σ_d q[r · hd + d] · (mins[d] + scales[d] · code(j, d))`.
///
/// Kept whole: each row's scores stay in registers across the pieces of 64 channels, and the
/// keys' split nibbles across the rows, so the loops are one function.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. The sizes are checked.
///
/// One index runs over several register arrays at once (hence the index loops).
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
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
        "avx2::coded::dot_rows_coded: bad sizes"
    );
    if n == 0 {
        return;
    }
    let (qp, mp, sp) = (q.as_ptr(), mins.as_ptr(), scales.as_ptr());
    let row_bytes = hd * K / 8;
    let mut tail = Vec::new();
    let kp = sixteen_rows(codes, first * K / 8, n, row_bytes, &mut tail);
    let (nib, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    // Per row, the scores of keys 0-7 and 8-15 so far (the minimums' term first).
    let mut scores = [[_mm256_setzero_ps(); 2]; R];
    for u in 0..hd / 64 {
        let mut step = [0f32; R];
        let mut qw = [[_mm256_setzero_si256(); 4]; R];
        for r in 0..R {
            let at = r * hd + 64 * u;
            let bias;
            // SAFETY: values at..at + 64 of `q` and 64 u..64 u + 64 of the parameters are
            // inside them (hd a multiple of 64, asserted).
            (qw[r], step[r], bias) =
                unsafe { query_words::<K>(qp.add(at), mp.add(64 * u), sp.add(64 * u)) };
            for s in &mut scores[r] {
                *s = _mm256_add_ps(*s, _mm256_set1_ps(bias));
            }
        }
        // 4-bit keys' nibbles split once for every row (kept in L1: with the rows' eight
        // partial sums in registers, sixteen keys' would not fit).
        let mut nibbles = [[_mm256_setzero_si256(); 2]; 16];
        if K == 4 {
            for (j, kn) in nibbles.iter_mut().enumerate() {
                // SAFETY: key j < 16 of `kp` (the chunk's or the padded copy's sixteen rows),
                // with the 32 bytes of its channels 64 u..64 u + 64.
                let x = unsafe { _mm256_loadu_si256(kp.add(j * row_bytes + 32 * u) as *const _) };
                *kn = [
                    _mm256_and_si256(x, nib),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(x), nib),
                ];
            }
        }
        for r in 0..R {
            let q = qw[r];
            for h in 0..2 {
                let part: [__m256i; 8] = std::array::from_fn(|k| {
                    let j = 8 * h + k;
                    if K == 4 {
                        let p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(nibbles[j][0], q[0]),
                            _mm256_maddubs_epi16(nibbles[j][1], q[1]),
                        );
                        _mm256_madd_epi16(p, ones)
                    } else {
                        // SAFETY: key j < 16 of `kp` (above), the 64 bytes of its channels
                        // 64 u..64 u + 64, 16 at a time.
                        let c: [__m256i; 4] = std::array::from_fn(|i| unsafe {
                            let at = kp.add(j * row_bytes + 64 * u + 16 * i);
                            _mm256_cvtepu8_epi16(_mm_loadu_si128(at as *const __m128i))
                        });
                        let a = _mm256_add_epi32(
                            _mm256_madd_epi16(c[0], q[0]),
                            _mm256_madd_epi16(c[1], q[1]),
                        );
                        let b = _mm256_add_epi32(
                            _mm256_madd_epi16(c[2], q[2]),
                            _mm256_madd_epi16(c[3], q[3]),
                        );
                        _mm256_add_epi32(a, b)
                    }
                });
                let sums = _mm256_cvtepi32_ps(reduce8_epi32(&part));
                scores[r][h] = _mm256_fmadd_ps(sums, _mm256_set1_ps(step[r]), scores[r][h]);
            }
        }
    }
    for (r, s) in scores.iter().enumerate() {
        // SAFETY: out[r · stride..r · stride + n] is inside `out` (asserted); the stores are
        // masked to those lanes.
        unsafe {
            let p = out.as_mut_ptr().add(r * stride);
            _mm256_maskstore_ps(p, lanes8(n), s[0]);
            if n > 8 {
                _mm256_maskstore_ps(p.add(8), lanes8(n - 8), s[1]);
            }
        }
    }
}

/// The in-lane byte shuffle and the 16-bit multipliers that take sixteen `BITS`-bit codes
/// (2, 3 or 4; [`row_codes`] reads 4-bit rows by their nibbles instead) out of a value row: register `k` of [`row_codes`] holds, in 16-bit lanes,
/// channels `8 k..8 k + 8` in its low 128-bit lane and `32 + 8 k..` in its high one. The
/// low lane's source is the row's bytes from 0, the high lane's from [`high_source`]; each
/// 16-bit lane gathers the two bytes that hold its code, and multiplying by
/// `2^(16 - BITS - shift)` then shifting right by `16 - BITS` leaves the code.
const fn code_tables(bits: usize, k: usize) -> ([u8; 32], [u16; 16]) {
    let mut shuf = [0u8; 32];
    let mut mul = [0u16; 16];
    let mut lane = 0;
    while lane < 2 {
        let base = if lane == 0 { 0 } else { high_source(bits) };
        let mut j = 0;
        while j < 8 {
            let ch = 32 * lane + 8 * k + j;
            let byte = ch * bits / 8 - base;
            let shift = ch * bits % 8;
            shuf[16 * lane + 2 * j] = byte as u8;
            // The second byte only where the code reaches into it (else a zero).
            shuf[16 * lane + 2 * j + 1] = if shift + bits > 8 {
                (byte + 1) as u8
            } else {
                0x80
            };
            mul[8 * lane + j] = 1 << (16 - bits - shift);
            j += 1;
        }
        lane += 1;
    }
    (shuf, mul)
}

/// The byte of a row of 64 `bits`-bit codes that the high lane of [`row_codes`]'s source
/// starts at: the byte of channel 32, or earlier so the 16 bytes stay in the row.
const fn high_source(bits: usize) -> usize {
    let at = 32 * bits / 8;
    let row = 64 * bits / 8;
    if at + 16 > row { row - 16 } else { at }
}

/// Channels `64 u..64 u + 64` of a value row of `K`-bit codes (from `row`) as two registers
/// of bytes: channels 0-15 and 32-47 of the piece, then 16-31 and 48-63 (the lanes of
/// `vpunpck*`'s results below).
///
/// # Safety
/// The CPU must have AVX2; the row's `8 K` bytes of those channels must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_codes<const K: usize>(row: *const u8, u: usize) -> [__m256i; 2] {
    // SAFETY: the row's 8 K bytes from 8 K u (the contract); the 16-byte loads stay inside them
    // (`high_source`).
    unsafe {
        let p = row.add(8 * K * u);
        if K == 8 {
            let a = _mm256_loadu_si256(p as *const __m256i);
            let b = _mm256_loadu_si256(p.add(32) as *const __m256i);
            return [
                _mm256_permute2x128_si256::<0x20>(a, b),
                _mm256_permute2x128_si256::<0x31>(a, b),
            ];
        }
        if K == 4 {
            // Byte b holds channels 2 b (low nibble) and 2 b + 1: interleaving the nibbles per
            // lane gives channels 0-15 | 32-47 and 16-31 | 48-63.
            let x = _mm256_loadu_si256(p as *const __m256i);
            let nib = _mm256_set1_epi8(0x0F);
            let (lo, hi) = (
                _mm256_and_si256(x, nib),
                _mm256_and_si256(_mm256_srli_epi16::<4>(x), nib),
            );
            return [_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)];
        }
        let src = _mm256_loadu2_m128i(p.add(high_source(K)) as *const __m128i, p as *const __m128i);
        let tables: [([u8; 32], [u16; 16]); 4] = const {
            [
                code_tables(K, 0),
                code_tables(K, 1),
                code_tables(K, 2),
                code_tables(K, 3),
            ]
        };
        let w: [__m256i; 4] = std::array::from_fn(|k| {
            let shuf = _mm256_loadu_si256(tables[k].0.as_ptr() as *const __m256i);
            let mul = _mm256_loadu_si256(tables[k].1.as_ptr() as *const __m256i);
            let x = _mm256_mullo_epi16(_mm256_shuffle_epi8(src, shuf), mul);
            _mm256_srl_epi16(x, _mm_cvtsi32_si128(16 - K as i32))
        });
        // Per 128-bit lane: [w0's eight, w1's eight]: channels 0-15 | 32-47, and 16-31 | 48-63.
        [
            _mm256_packus_epi16(w[0], w[1]),
            _mm256_packus_epi16(w[2], w[3]),
        ]
    }
}

/// A row of attention weights (`n` from `w`) folded with the values' scales and rounded to
/// unsigned values ([`round8`] against 255 over the row's largest; negative products are taken
/// as 0), as eight pairs of tokens, with its step and its bias (the weights times the
/// minimums): for codes of at most 4 bits pair `p` is tokens `2 p` and `2 p + 1` as the two
/// bytes of a 16-bit value, for 8-bit codes as the two 16-bit halves of a 32-bit one.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `n <= 16` values must be readable from `w`, `mins`
/// and `scales`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weight_pairs<const K: usize>(
    w: *const f32,
    mins: *const f32,
    scales: *const f32,
    n: usize,
) -> ([i32; 8], f32, f32) {
    // SAFETY: the loads are masked to the n readable values (the contract).
    let (top, bias, words) = unsafe {
        let (top, bias) = fold_stats(w, mins, scales, 16, n);
        let inv = _mm256_set1_ps(inverse_step(top, 255.0));
        let lo = round8(w, scales, inv, lanes8(n));
        let hi = round8(w.add(8), scales.add(8), inv, lanes8(n.saturating_sub(8)));
        // Unsigned saturation takes a negative product (a rounding of -0) to 0.
        let words = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi));
        (top, bias, words)
    };
    let mut pairs = [0i32; 8];
    if K == 8 {
        // SAFETY: `pairs` is 32 bytes.
        unsafe { _mm256_storeu_si256(pairs.as_mut_ptr() as *mut __m256i, words) };
    } else {
        let mut t = [0u16; 16];
        // SAFETY: `t` is 32 bytes.
        unsafe { _mm256_storeu_si256(t.as_mut_ptr() as *mut __m256i, words) };
        for (p, x) in pairs.iter_mut().enumerate() {
            *x = i32::from(t[2 * p] | t[2 * p + 1] << 8);
        }
    }
    (pairs, top / 255.0, bias)
}

/// Sums of `n <= 16` value rows of `hd` channels stored as unsigned `K`-bit codes (2, 3, 4 or
/// 8) with a minimum and a scale per token and group of channels (`groups`), weighted for `R`
/// output rows, as `simd::vnni::kv::axpy_rows_coded` computes them (see the module comment):
/// `o[r · hd + d] += Σ_i w[r · wstride + i] · (mins[j] + scales[j] · code(i, d))`, `j` the
/// index of token i's group of channel d; weights and scales must not be negative (a negative
/// product counts as 0).
///
/// Kept whole: the pairs' bytes, laid out once per piece of 64 channels, are read by every
/// row, whose 16- and 32-bit sums stay in registers across the pairs, so the loops are one
/// function.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. The sizes are checked.
///
/// One index runs over several register arrays at once (hence the index loops).
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
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
        "avx2::coded::axpy_rows_coded: bad sizes"
    );
    if n == 0 {
        return;
    }
    // Per row, the folded weights, step and bias of the groups of a piece's two halves of 32
    // channels (the low and the high 128-bit lanes below), folded again only when the group
    // changes.
    let mut folded = [[([0i32; 8], 0f32, 0f32); 2]; R];
    let mut held = [usize::MAX; 2];
    let row_bytes = hd * K / 8;
    let mut tail = Vec::new();
    let vp = sixteen_rows(codes, first * K / 8, n, row_bytes, &mut tail);
    let zero = _mm256_setzero_si256();
    for u in 0..hd / 64 {
        fold_piece_groups(groups, u, &mut held, &mut folded, |r, at| {
            // SAFETY: the n weights of row r and the n parameters of the group from `at` are
            // inside the slices (asserted: `params_len`).
            unsafe {
                weight_pairs::<K>(
                    w.as_ptr().add(r * wstride),
                    mins.as_ptr().add(at),
                    scales.as_ptr().add(at),
                    n,
                )
            }
        });
        // Pair p's two tokens' bytes side by side per channel: register k holds channels
        // 8 k..8 k + 8 of the piece in its low lane and 32 + 8 k.. in its high one.
        let mut z = [[zero; 4]; 8];
        for (p, zp) in z.iter_mut().enumerate() {
            // SAFETY: rows 2 p and 2 p + 1 < 16 of `vp` (the chunk's sixteen rows or the padded
            // copy's), with their channels 64 u..64 u + 64.
            let (a, b) = unsafe {
                (
                    row_codes::<K>(vp.add(2 * p * row_bytes), u),
                    row_codes::<K>(vp.add((2 * p + 1) * row_bytes), u),
                )
            };
            *zp = [
                _mm256_unpacklo_epi8(a[0], b[0]),
                _mm256_unpackhi_epi8(a[0], b[0]),
                _mm256_unpacklo_epi8(a[1], b[1]),
                _mm256_unpackhi_epi8(a[1], b[1]),
            ];
        }
        for r in 0..R {
            // Channels 8 k..8 k + 8 in acc[k], 32 + 8 k.. in acc[4 + k].
            let mut acc = [zero; 8];
            if K == 8 {
                // Per pair the two tokens' codes widened to 16 bits against their weights: the
                // low unpack holds channels 8 k..+4 | 32 + 8 k..+4, the high one the next four.
                let mut lo4 = [zero; 4];
                let mut hi4 = [zero; 4];
                for p in 0..8 {
                    let (a, b) = (folded[r][0].0[p], folded[r][1].0[p]);
                    let wp = _mm256_set_m128i(_mm_set1_epi32(b), _mm_set1_epi32(a));
                    for k in 0..4 {
                        let x = z[p][k];
                        lo4[k] = _mm256_add_epi32(
                            lo4[k],
                            _mm256_madd_epi16(_mm256_unpacklo_epi8(x, zero), wp),
                        );
                        hi4[k] = _mm256_add_epi32(
                            hi4[k],
                            _mm256_madd_epi16(_mm256_unpackhi_epi8(x, zero), wp),
                        );
                    }
                }
                for k in 0..4 {
                    acc[k] = _mm256_permute2x128_si256::<0x20>(lo4[k], hi4[k]);
                    acc[4 + k] = _mm256_permute2x128_si256::<0x31>(lo4[k], hi4[k]);
                }
            } else {
                for half in 0..2 {
                    let mut s16 = [zero; 4];
                    for p in 4 * half..4 * half + 4 {
                        let (a, b) = (folded[r][0].0[p] as i16, folded[r][1].0[p] as i16);
                        let wp = _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a));
                        for k in 0..4 {
                            s16[k] = _mm256_add_epi16(s16[k], _mm256_maddubs_epi16(wp, z[p][k]));
                        }
                    }
                    for k in 0..4 {
                        let (l, h) = (
                            _mm256_castsi256_si128(s16[k]),
                            _mm256_extracti128_si256::<1>(s16[k]),
                        );
                        acc[k] = _mm256_add_epi32(acc[k], _mm256_cvtepi16_epi32(l));
                        acc[4 + k] = _mm256_add_epi32(acc[4 + k], _mm256_cvtepi16_epi32(h));
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let (_, step, bias) = folded[r][i / 4];
                let (s, b) = (_mm256_set1_ps(step), _mm256_set1_ps(bias));
                let ch = 64 * u + if i < 4 { 8 * i } else { 32 + 8 * (i - 4) };
                // SAFETY: o[r · hd + ch..+ 8] is inside `o` (asserted: ch + 8 <= hd).
                unsafe {
                    let p = o.as_mut_ptr().add(r * hd + ch);
                    let x = _mm256_add_ps(_mm256_loadu_ps(p), b);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(_mm256_cvtepi32_ps(*a), s, x));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_tables_take_each_code_from_its_bytes() {
        // Every channel's code, read through the tables from a row of known codes, is that
        // code (the layout of `row_codes`, checked without the CPU's instructions).
        for bits in [2usize, 3, 4] {
            let codes: Vec<u32> = (0..64).map(|c| (c * 7 + 3) as u32 % (1 << bits)).collect();
            let mut row = vec![0u8; 64 * bits / 8];
            for (c, &v) in codes.iter().enumerate() {
                for b in 0..bits {
                    if v >> b & 1 == 1 {
                        row[(c * bits + b) / 8] |= 1 << ((c * bits + b) % 8);
                    }
                }
            }
            for k in 0..4 {
                let (shuf, mul) = code_tables(bits, k);
                for lane in 0..2 {
                    let base = if lane == 0 { 0 } else { high_source(bits) };
                    for j in 0..8 {
                        let byte = |i: u8| {
                            if i & 0x80 != 0 {
                                0u16
                            } else {
                                u16::from(row[base + i as usize])
                            }
                        };
                        let word =
                            byte(shuf[16 * lane + 2 * j]) | byte(shuf[16 * lane + 2 * j + 1]) << 8;
                        let got = word.wrapping_mul(mul[8 * lane + j]) >> (16 - bits);
                        let ch = 32 * lane + 8 * k + j;
                        assert_eq!(u32::from(got), codes[ch], "bits {bits} channel {ch}");
                    }
                }
            }
        }
    }
}
