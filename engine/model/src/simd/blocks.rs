//! x86-64 kernels for the block formats held as the file's bytes (Q4_0, Q5_0, Q5_1, Q4_K,
//! Q5_K, Q6_K; [`crate::qmatrix::blocks`] has their layouts): the decode matrix-vector
//! product on AVX2 and on AVX-512, and dequantization into f32 tiles (the f32 prefill) on AVX2.
//!
//! Every format is read the same way: a block's scales and offsets decoded once per row (a
//! scale per 16 values, an offset per 32), then per sub-block of 32 values its codes unpacked
//! into 32 signed bytes (masks, shifts, and for the fifth and sixth bits a byte shuffle), widened
//! to f32 and multiplied with the activations, which are loaded once for the several rows of a
//! pass; each sum of 16 (or 32) products is scaled once, and the offsets add `Σ min · Σx` per 32.
//! The block headers' scales are unpacked in vectors (Q4_K/Q5_K's 6-bit scales and minimums
//! four at a time in a word).
//!
//! Every format but Q6_K (one scale per 16 values) sums a sub-block's 32 products before its
//! one scale; Q4_K and Q5_K take their eight minimums a block as one 8-lane product.
//! On AVX-512 two formats take kernels of their own, with fewer instructions per value:
//! Q4_K (one scale per 32 values: codes widened straight from memory, the two halves of a
//! sub-block summed before their one scale, the minimums as one 8-lane product per block) and
//! Q5_0 (its fifth bits as a lane mask, the code's offset one masked subtraction).

use crate::qmatrix::Kind;
use crate::simd::{WEIGHTS_AHEAD, prefetch_weights};
use std::arch::x86_64::*;

/// Rows per pass of the matrix-vector kernels.
pub const ROWS: usize = 4;

pub(crate) const Q4_0: u8 = 0;
pub(crate) const Q5_0: u8 = 1;
pub(crate) const Q5_1: u8 = 2;
pub(crate) const Q4_K: u8 = 3;
pub(crate) const Q5_K: u8 = 4;
pub(crate) const Q6_K: u8 = 5;

/// Values and bytes of a block of the format tagged `k`.
pub(crate) const fn geometry(k: u8) -> (usize, usize) {
    match k {
        Q4_0 => (32, 18),
        Q5_0 => (32, 22),
        Q5_1 => (32, 24),
        Q4_K => (256, 144),
        Q5_K => (256, 176),
        _ => (256, 210),
    }
}

/// What a stored code is offset by in the int8 kernels, which read codes unsigned: the value's
/// code is `u - code_offset(k)`.
pub(crate) const fn code_offset(k: u8) -> i8 {
    match k {
        Q4_0 => 8,
        Q5_0 => 16,
        Q6_K => 32,
        _ => 0,
    }
}

/// Whether one scale covers each 32 values (every format but Q6_K, which has one per 16):
/// then a sub-block's 32 products are summed before they are scaled.
const fn one_scale(k: u8) -> bool {
    k != Q6_K
}

/// Whether values carry offsets.
const fn has_mins(k: u8) -> bool {
    matches!(k, Q5_1 | Q4_K | Q5_K)
}

/// Whether a block holds eight offsets (one per 32 of its 256 values), taken as one 8-lane
/// product with the block's eight sums of activations.
const fn mins8(k: u8) -> bool {
    matches!(k, Q4_K | Q5_K)
}

/// The f16 at `p` as f32, through F16C.
///
/// # Safety
/// Two bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn h2f(p: *const u8) -> f32 {
    // SAFETY: two readable bytes (the contract); an unaligned read.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// The block's scales (two per sub-block of 32, one per 16 values) and offsets (one per 32).
///
/// # Safety
/// A whole block of format `K` must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn header<const K: u8>(p: *const u8, sc: &mut [f32; 16], mn: &mut [f32; 8]) {
    // SAFETY: every read is inside the block (the contract; offsets from the layouts).
    unsafe {
        match K {
            Q4_0 | Q5_0 | Q5_1 => {
                let d = h2f(p);
                (sc[0], sc[1]) = (d, d);
                mn[0] = if K == Q5_1 { h2f(p.add(2)) } else { 0.0 };
            }
            Q4_K | Q5_K => {
                let (d, dmin) = (h2f(p), h2f(p.add(2)));
                let (a, m) = k4_scales(p.add(4));
                // Each sub-block's scale twice (one per 16 values), in order.
                let sa = _mm256_mul_ps(bytes8_ps(a), _mm256_set1_ps(d));
                let lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
                let hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
                _mm256_storeu_ps(sc.as_mut_ptr(), _mm256_permutevar8x32_ps(sa, lo));
                _mm256_storeu_ps(sc.as_mut_ptr().add(8), _mm256_permutevar8x32_ps(sa, hi));
                let neg = _mm256_set1_ps(-dmin);
                _mm256_storeu_ps(mn.as_mut_ptr(), _mm256_mul_ps(bytes8_ps(m), neg));
            }
            _ => {
                let d = _mm256_set1_ps(h2f(p.add(208)));
                let q = _mm_loadu_si128(p.add(192) as *const __m128i);
                let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q)));
                _mm256_storeu_ps(sc.as_mut_ptr(), _mm256_mul_ps(lo, d));
                _mm256_storeu_ps(sc.as_mut_ptr().add(8), _mm256_mul_ps(hi, d));
            }
        }
    }
}

/// The eight 6-bit scales and eight 6-bit minimums of a Q4_K/Q5_K block's 12 packed bytes at
/// `p`, one per byte (what [`crate::qmatrix::blocks::scale_min_k4`] gives one at a time):
/// sub-blocks 0-3 keep the low six bits of bytes 0-3 (scales) and 4-7 (minimums); sub-blocks
/// 4-7 take a nibble of bytes 8-11 and the top two bits of bytes 0-3 or 4-7, all four bytes
/// at once in a word.
///
/// # Safety
/// 12 bytes at `p` must be readable.
#[inline]
pub(crate) unsafe fn k4_scales(p: *const u8) -> (u64, u64) {
    // SAFETY: 12 readable bytes (the contract), read as three unaligned words.
    let [u0, u1, u2] =
        std::array::from_fn(|i| unsafe { (p.add(4 * i) as *const u32).read_unaligned() });
    let (six, low, top) = (0x3F3F_3F3Fu32, 0x0F0F_0F0Fu32, 0x0303_0303u32);
    let a_hi = (u2 & low) | (((u0 >> 6) & top) << 4);
    let m_hi = ((u2 >> 4) & low) | (((u1 >> 6) & top) << 4);
    (
        u64::from(u0 & six) | u64::from(a_hi) << 32,
        u64::from(u1 & six) | u64::from(m_hi) << 32,
    )
}

/// The eight bytes of `v` (little-endian) as eight f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes8_ps(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

/// 32 bits of `qh` at `p` (little-endian) as 32 bytes, 0x10 where the bit is set.
///
/// # Safety
/// Four bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fifth_bits(p: *const u8) -> __m256i {
    // SAFETY: four readable bytes (the contract).
    let qh = unsafe { (p as *const i32).read_unaligned() };
    // Byte j takes byte j / 8 of qh (both 128-bit lanes hold all four), then tests bit j % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The 16 bytes at `p` as 32 nibbles in value order: the low nibbles, then the high ones.
///
/// # Safety
/// 16 bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    // SAFETY: 16 readable bytes (the contract).
    let q = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(q, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
    _mm256_set_m128i(hi, lo)
}

/// The codes of sub-block `s` (values `32s..32s + 32`) of the block at `p`, as signed bytes.
///
/// # Safety
/// A whole block of format `K` must be readable at `p`; `s` below its sub-block count.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes<const K: u8>(p: *const u8, s: usize) -> __m256i {
    let low = _mm256_set1_epi8(0x0F);
    // SAFETY: every read is inside the block (the contract; offsets from the layouts).
    unsafe {
        match K {
            Q4_0 => _mm256_sub_epi8(nibbles16(p.add(2)), _mm256_set1_epi8(8)),
            Q5_0 => {
                let q = _mm256_or_si256(nibbles16(p.add(6)), fifth_bits(p.add(2)));
                _mm256_sub_epi8(q, _mm256_set1_epi8(16))
            }
            Q5_1 => _mm256_or_si256(nibbles16(p.add(8)), fifth_bits(p.add(4))),
            Q4_K | Q5_K => {
                let base = if K == Q5_K { 48 } else { 16 };
                let q = _mm256_loadu_si256(p.add(base + 32 * (s / 2)) as *const __m256i);
                let q = if s.is_multiple_of(2) {
                    q
                } else {
                    _mm256_srli_epi16::<4>(q)
                };
                let q = _mm256_and_si256(q, low);
                if K == Q4_K {
                    return q;
                }
                let h = _mm256_loadu_si256(p.add(16) as *const __m256i);
                let h = _mm256_srl_epi16(h, _mm_cvtsi32_si128(s as i32));
                let h = _mm256_and_si256(h, _mm256_set1_epi8(1));
                _mm256_or_si256(q, _mm256_slli_epi16::<4>(h))
            }
            _ => {
                let (half, g) = (s / 4, s % 4);
                let ql = _mm256_loadu_si256(p.add(64 * half + 32 * (g % 2)) as *const __m256i);
                let ql = if g < 2 {
                    ql
                } else {
                    _mm256_srli_epi16::<4>(ql)
                };
                let ql = _mm256_and_si256(ql, low);
                let qh = _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i);
                let qh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g as i32));
                let qh = _mm256_and_si256(qh, _mm256_set1_epi8(3));
                let q = _mm256_or_si256(ql, _mm256_slli_epi16::<4>(qh));
                _mm256_sub_epi8(q, _mm256_set1_epi8(32))
            }
        }
    }
}

/// 32 signed byte codes as four vectors of eight f32 (values 0..8, ..., 24..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen(c: __m256i) -> [__m256; 4] {
    let (lo, hi) = (_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi))),
    ]
}

/// The format's tag, for the const-generic kernels (here and in `simd::vnni::blocks`,
/// `simd::avx2::blocks_int8`).
pub(crate) fn tag(kind: Kind) -> u8 {
    match kind {
        Kind::Q4_0 => Q4_0,
        Kind::Q5_0 => Q5_0,
        Kind::Q5_1 => Q5_1,
        Kind::Q4_K => Q4_K,
        Kind::Q5_K => Q5_K,
        Kind::Q6_K => Q6_K,
        _ => unreachable!("{kind:?} is not held as raw blocks"),
    }
}

/// `out[r] = Σ w[r][j] x[j]` for the `out.len()` rows of `kind` in `raw` (whole blocks, rows
/// of `x.len()` values back to back), with `xsum` the activations' sums per 32 values.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (and, if `wide`, AVX-512 F, BW and VL); `kind` must be
/// a raw-block format, `x.len()` a multiple of its block; `raw` must hold the rows' blocks and
/// `xsum` `x.len() / 32` values if the format has offsets.
pub unsafe fn matvec(wide: bool, kind: Kind, raw: &[u8], x: &[f32], xsum: &[f32], out: &mut [f32]) {
    let (vals, bytes) = geometry(tag(kind));
    let rb = x.len() / vals * bytes;
    assert!(
        x.len().is_multiple_of(vals)
            && raw.len() >= out.len() * rb
            && (!has_mins(tag(kind)) || xsum.len() >= x.len() / 32),
        "blocks::matvec: bad sizes"
    );
    macro_rules! run {
        ($k:expr) => {
            if wide {
                // SAFETY: the caller's contract, sizes asserted above.
                unsafe { passes::<$k, true>(raw, rb, x, xsum, out) }
            } else {
                // SAFETY: as above.
                unsafe { passes::<$k, false>(raw, rb, x, xsum, out) }
            }
        };
    }
    match tag(kind) {
        Q4_0 => run!(Q4_0),
        Q5_0 => run!(Q5_0),
        Q5_1 => run!(Q5_1),
        Q4_K => run!(Q4_K),
        Q5_K => run!(Q5_K),
        _ => run!(Q6_K),
    }
}

/// [`matvec`] in passes of [`ROWS`] rows, then one row at a time; each pass asks for the
/// lines [`WEIGHTS_AHEAD`] ahead of it.
///
/// # Safety
/// As [`matvec`], sizes checked; `rb` the bytes of a row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn passes<const K: u8, const WIDE: bool>(
    raw: &[u8],
    rb: usize,
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    let rows = out.len();
    prefetch_weights(raw.as_ptr(), WEIGHTS_AHEAD);
    let mut r = 0;
    while r < rows {
        let n = if r + ROWS <= rows { ROWS } else { 1 };
        prefetch_weights(raw.as_ptr().wrapping_add(r * rb + WEIGHTS_AHEAD), n * rb);
        let (w, o) = (&raw[r * rb..(r + n) * rb], &mut out[r..r + n]);
        // SAFETY: rows r..r + n are inside raw (checked by the caller); the CPU has the
        // features of the path (the caller's contract).
        unsafe {
            match (n, WIDE) {
                (ROWS, false) => rows_avx2::<K, ROWS>(w, rb, x, xsum, o),
                (_, false) => rows_avx2::<K, 1>(w, rb, x, xsum, o),
                (ROWS, true) => rows_avx512::<K, ROWS>(w, rb, x, xsum, o),
                (_, true) => rows_avx512::<K, 1>(w, rb, x, xsum, o),
            }
        }
        r += n;
    }
}

/// `R` rows' products on 256 bits: per sub-block the activations loaded once for the `R` rows,
/// each row's codes widened and multiplied, the two halves' sums scaled by their scales.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `raw` holds `R` rows of `rb` bytes, `x` their values'
/// activations (a multiple of the block), `xsum` its sums per 32.
#[inline]
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<const K: u8, const R: usize>(
    raw: &[u8],
    rb: usize,
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    let (vals, bytes) = geometry(K);
    let mut acc = [_mm256_setzero_ps(); R];
    let (mut offs, mut offv) = ([0.0f32; R], [_mm256_setzero_ps(); R]);
    let (mut sc, mut mn) = ([[0.0f32; 16]; R], [[0.0f32; 8]; R]);
    for b in 0..x.len() / vals {
        // SAFETY: block b of each row is inside raw, its values inside x and their sums
        // inside xsum (the contract); unaligned loads accept any address.
        unsafe {
            let at = |r: usize| raw.as_ptr().add(r * rb + b * bytes);
            headers::<K, R>(at, xsum, b, &mut sc, &mut mn, &mut offv);
            for s in 0..vals / 32 {
                let xp = x.as_ptr().add(b * vals + 32 * s);
                let xv: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(xp.add(8 * k)));
                for r in 0..R {
                    let w = widen(codes::<K>(at(r), s));
                    let lo = _mm256_fmadd_ps(w[1], xv[1], _mm256_mul_ps(w[0], xv[0]));
                    if one_scale(K) {
                        let t = _mm256_fmadd_ps(w[3], xv[3], _mm256_fmadd_ps(w[2], xv[2], lo));
                        acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(sc[r][2 * s]), acc[r]);
                    } else {
                        let hi = _mm256_fmadd_ps(w[3], xv[3], _mm256_mul_ps(w[2], xv[2]));
                        acc[r] = _mm256_fmadd_ps(lo, _mm256_set1_ps(sc[r][2 * s]), acc[r]);
                        acc[r] = _mm256_fmadd_ps(hi, _mm256_set1_ps(sc[r][2 * s + 1]), acc[r]);
                    }
                    if has_mins(K) && !mins8(K) {
                        offs[r] += mn[r][s] * *xsum.get_unchecked(b * vals / 32 + s);
                    }
                }
            }
        }
    }
    for r in 0..R {
        out[r] = super::avx2::hsum(acc[r]) + offs[r];
        if mins8(K) {
            out[r] += super::avx2::hsum(offv[r]);
        }
    }
}

/// The headers of block `b` of `R` rows of format `K` (row `r`'s at `at(r)`) into `sc` and
/// `mn`; for the formats with eight offsets a block ([`mins8`]), their term added to `offs` as
/// one 8-lane product a row with the block's eight sums of activations in `xsum`.
///
/// # Safety
/// A whole block of format `K` must be readable at `at(r)` for every row; for [`mins8`]
/// formats `xsum` holds the sums of block `b`'s eight sub-blocks.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn headers<const K: u8, const R: usize>(
    at: impl Fn(usize) -> *const u8,
    xsum: &[f32],
    b: usize,
    sc: &mut [[f32; 16]; R],
    mn: &mut [[f32; 8]; R],
    offs: &mut [__m256; R],
) {
    for r in 0..R {
        // SAFETY: the block is readable (the contract).
        unsafe { header::<K>(at(r), &mut sc[r], &mut mn[r]) };
    }
    if mins8(K) {
        let xs = &xsum[b * 8..b * 8 + 8];
        // SAFETY: xs holds eight values (sliced just above), mn[r] eight.
        let xs = unsafe { _mm256_loadu_ps(xs.as_ptr()) };
        for r in 0..R {
            // SAFETY: as above.
            let m = unsafe { _mm256_loadu_ps(mn[r].as_ptr()) };
            offs[r] = _mm256_fmadd_ps(m, xs, offs[r]);
        }
    }
}

/// [`rows_avx2`] on 512 bits: a sub-block's 32 products in two vectors of 16, one per scale.
///
/// # Safety
/// As [`rows_avx2`], and the CPU must have AVX-512 F, BW and VL.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_avx512<const K: u8, const R: usize>(
    raw: &[u8],
    rb: usize,
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    match K {
        // SAFETY: the contract, passed on.
        Q4_K => return unsafe { rows_q4_k::<R>(raw, rb, x, xsum, out) },
        // SAFETY: as above.
        Q5_0 => return unsafe { rows_q5_0::<R>(raw, rb, x, out) },
        _ => {}
    }
    let (vals, bytes) = geometry(K);
    let mut acc = [_mm512_setzero_ps(); R];
    let (mut offs, mut offv) = ([0.0f32; R], [_mm256_setzero_ps(); R]);
    let (mut sc, mut mn) = ([[0.0f32; 16]; R], [[0.0f32; 8]; R]);
    for b in 0..x.len() / vals {
        // SAFETY: as in rows_avx2.
        unsafe {
            let at = |r: usize| raw.as_ptr().add(r * rb + b * bytes);
            headers::<K, R>(at, xsum, b, &mut sc, &mut mn, &mut offv);
            for s in 0..vals / 32 {
                let xp = x.as_ptr().add(b * vals + 32 * s);
                let (x0, x1) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
                for r in 0..R {
                    let c = codes::<K>(at(r), s);
                    let w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c)));
                    let w1 =
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(c)));
                    let t0 = _mm512_mul_ps(w0, x0);
                    if one_scale(K) {
                        let t = _mm512_fmadd_ps(w1, x1, t0);
                        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(sc[r][2 * s]), acc[r]);
                    } else {
                        let t1 = _mm512_mul_ps(w1, x1);
                        acc[r] = _mm512_fmadd_ps(t0, _mm512_set1_ps(sc[r][2 * s]), acc[r]);
                        acc[r] = _mm512_fmadd_ps(t1, _mm512_set1_ps(sc[r][2 * s + 1]), acc[r]);
                    }
                    if has_mins(K) && !mins8(K) {
                        offs[r] += mn[r][s] * *xsum.get_unchecked(b * vals / 32 + s);
                    }
                }
            }
        }
    }
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(acc[r]) + offs[r];
        if mins8(K) {
            out[r] += super::avx2::hsum(offv[r]);
        }
    }
}

/// [`rows_avx512`] for Q4_K, whose scale covers 32 values: a pair of sub-blocks' 32 bytes
/// widened sixteen at a time straight from memory, the low nibbles (the first sub-block) masked
/// and the high ones (the second) shifted down, each sub-block's 32 products summed before its
/// one scale; the minimums' term is one 8-lane product per block.
///
/// # Safety
/// As [`rows_avx512`] for Q4_K.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_q4_k<const R: usize>(
    raw: &[u8],
    rb: usize,
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    let (vals, bytes) = geometry(Q4_K);
    let nibble = _mm512_set1_epi32(0x0F);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut offs = [_mm256_setzero_ps(); R];
    let (mut sc, mut mn) = ([[0.0f32; 16]; R], [[0.0f32; 8]; R]);
    for b in 0..x.len() / vals {
        // SAFETY: block b of each row is inside raw, its values inside x and their eight sums
        // inside xsum (the contract); unaligned loads accept any address.
        unsafe {
            let at = |r: usize| raw.as_ptr().add(r * rb + b * bytes);
            headers::<Q4_K, R>(at, xsum, b, &mut sc, &mut mn, &mut offs);
            for pair in 0..4 {
                let xp = x.as_ptr().add(b * vals + 64 * pair);
                let xv: [__m512; 4] = std::array::from_fn(|k| _mm512_loadu_ps(xp.add(16 * k)));
                for r in 0..R {
                    let q = at(r).add(16 + 32 * pair);
                    let v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(q as *const __m128i));
                    let v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(16) as *const __m128i));
                    let f = |v: __m512i| _mm512_cvtepi32_ps(v);
                    let (l0, l1) = (_mm512_and_si512(v0, nibble), _mm512_and_si512(v1, nibble));
                    let lo = _mm512_fmadd_ps(f(l1), xv[1], _mm512_mul_ps(f(l0), xv[0]));
                    let (h0, h1) = (_mm512_srli_epi32::<4>(v0), _mm512_srli_epi32::<4>(v1));
                    let hi = _mm512_fmadd_ps(f(h1), xv[3], _mm512_mul_ps(f(h0), xv[2]));
                    acc[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(sc[r][4 * pair]), acc[r]);
                    acc[r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(sc[r][4 * pair + 2]), acc[r]);
                }
            }
        }
    }
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(acc[r]) + super::avx2::hsum(offs[r]);
    }
}

/// [`rows_avx512`] for Q5_0: a block's 16 bytes widened sixteen at a time straight from
/// memory, its fifth bits taken as a lane mask (`qh`'s bit j is value j's), so that a code
/// `q - 16` is one masked subtraction of the nibble: `nibble - 16` where the bit is clear.
///
/// # Safety
/// As [`rows_avx512`] for Q5_0.
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_q5_0<const R: usize>(raw: &[u8], rb: usize, x: &[f32], out: &mut [f32]) {
    let (vals, bytes) = geometry(Q5_0);
    let (nibble, sixteen) = (_mm512_set1_epi32(0x0F), _mm512_set1_epi32(16));
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..x.len() / vals {
        // SAFETY: block b of each row is inside raw and its values inside x (the contract);
        // unaligned loads accept any address.
        unsafe {
            let xp = x.as_ptr().add(b * vals);
            let (x0, x1) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            for r in 0..R {
                let p = raw.as_ptr().add(r * rb + b * bytes);
                let qh = (p.add(2) as *const u32).read_unaligned();
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(6) as *const __m128i));
                let (lo, hi) = (_mm512_and_si512(v, nibble), _mm512_srli_epi32::<4>(v));
                let lo = _mm512_mask_sub_epi32(lo, !(qh as u16), lo, sixteen);
                let hi = _mm512_mask_sub_epi32(hi, !((qh >> 16) as u16), hi, sixteen);
                let (lo, hi) = (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi));
                let t = _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0));
                acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(h2f(p)), acc[r]);
            }
        }
    }
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(acc[r]);
    }
}

/// Dequantizes whole blocks of `kind` (`raw`) into `out`: `scale · code + min` per value.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `kind` must be a raw-block format, `raw` whole blocks
/// and `out` their values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant(kind: Kind, raw: &[u8], out: &mut [f32]) {
    let (vals, bytes) = geometry(tag(kind));
    assert!(
        raw.len().is_multiple_of(bytes) && out.len() >= raw.len() / bytes * vals,
        "blocks::dequant: bad sizes"
    );
    // SAFETY: sizes checked above; the CPU's features are the caller's contract.
    unsafe {
        match tag(kind) {
            Q4_0 => dequant_k::<Q4_0>(raw, out),
            Q5_0 => dequant_k::<Q5_0>(raw, out),
            Q5_1 => dequant_k::<Q5_1>(raw, out),
            Q4_K => dequant_k::<Q4_K>(raw, out),
            Q5_K => dequant_k::<Q5_K>(raw, out),
            _ => dequant_k::<Q6_K>(raw, out),
        }
    }
}

/// [`dequant`] for the format tagged `K`.
///
/// # Safety
/// As [`dequant`], sizes checked.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_k<const K: u8>(raw: &[u8], out: &mut [f32]) {
    let (vals, bytes) = geometry(K);
    let (mut sc, mut mn) = ([0.0f32; 16], [0.0f32; 8]);
    for (b, o) in raw.chunks_exact(bytes).zip(out.chunks_exact_mut(vals)) {
        // SAFETY: b is one whole block, o its values.
        unsafe {
            header::<K>(b.as_ptr(), &mut sc, &mut mn);
            for s in 0..vals / 32 {
                let w = widen(codes::<K>(b.as_ptr(), s));
                let m = _mm256_set1_ps(mn[s]);
                for (k, w) in w.iter().enumerate() {
                    let v = _mm256_add_ps(_mm256_mul_ps(*w, _mm256_set1_ps(sc[2 * s + k / 2])), m);
                    _mm256_storeu_ps(o.as_mut_ptr().add(32 * s + 8 * k), v);
                }
            }
        }
    }
}
