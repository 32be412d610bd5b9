//! AVX-512 (F, BW, VL) + FMA + F16C kernels of decode attention, the 512-bit form of
//! `simd::avx2::kv`'s: keys' dot products several keys per pass with their sums reduced
//! together, weighted value sums held in registers, f16 and packed 2-, 3-, 4- and 8-bit KV codes
//! converted in registers (sixteen at a time, 4-bit keys 64 at a time, and with VBMI every
//! sub-byte width 64 at a time) and read in place by several query rows at once, and the coded
//! parameters decoded sixteen pairs at a time.

use super::{lanes, load_f16x16, load_i8x16};
use std::arch::x86_64::*;

/// The first two rounds of [`reduce16`] and [`reduce4`]: `out[i]` holds, per 128-bit lane,
/// that lane's partial sums of vectors `4i..4i + 4` of `v` (`v` is four times as long).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
fn lane_partials(v: &[__m512], out: &mut [__m512]) {
    debug_assert_eq!(v.len(), 4 * out.len());
    for (i, o) in out.iter_mut().enumerate() {
        // Per 128-bit lane, [a0 + a2, b0 + b2, a1 + a3, b1 + b3] for each pair (a, b).
        let (a, b) = (v[4 * i], v[4 * i + 1]);
        let x = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        let (a, b) = (v[4 * i + 2], v[4 * i + 3]);
        let y = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        // Interleaved as pairs of f32 (64-bit lanes), added as f32.
        let (a, b) = (_mm512_castps_pd(x), _mm512_castps_pd(y));
        *o = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        );
    }
}

/// Sixteen vectors' horizontal sums, lane `i` of the result being `Σ v[i]`: three rounds of
/// pairwise interleaving, 45 instructions in all instead of 16 full reductions.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
fn reduce16(v: &[__m512; 16]) -> __m512 {
    let mut s2 = [_mm512_setzero_ps(); 4];
    lane_partials(v, &mut s2);
    // Across the four 128-bit lanes: lane m of the result gathers s2[m]'s four.
    let z01 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(s2[0], s2[1]),
        _mm512_shuffle_f32x4::<0xDD>(s2[0], s2[1]),
    );
    let z23 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(s2[2], s2[3]),
        _mm512_shuffle_f32x4::<0xDD>(s2[2], s2[3]),
    );
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(z01, z23),
        _mm512_shuffle_f32x4::<0xDD>(z01, z23),
    )
}

/// The body of the `dot_rows` kernels: `key(j, d)` gives key j's values d..d + 16 as f32.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C; `q.len()` must be a multiple of 16,
/// and `key(j, d)` must be valid for every j < out.len() and d + 16 <= q.len().
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn dot_rows_by(q: &[f32], out: &mut [f32], key: impl Fn(usize, usize) -> __m512) {
    let (hd, n, qp) = (q.len(), out.len(), q.as_ptr());
    let mut i = 0;
    while i + 16 <= n {
        let mut acc = [_mm512_setzero_ps(); 16];
        for d in (0..hd).step_by(16) {
            // SAFETY: d + 16 <= hd: inside q.
            let qv = unsafe { _mm512_loadu_ps(qp.add(d)) };
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(key(i + j, d), qv, *a);
            }
        }
        // SAFETY: i + 16 <= n: inside out.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), reduce16(&acc)) };
        i += 16;
    }
    for (j, o) in out.iter_mut().enumerate().skip(i) {
        let mut a = _mm512_setzero_ps();
        for d in (0..hd).step_by(16) {
            // SAFETY: d + 16 <= hd: inside q.
            let qv = unsafe { _mm512_loadu_ps(qp.add(d)) };
            a = _mm512_fmadd_ps(key(j, d), qv, a);
        }
        *o = _mm512_reduce_add_ps(a);
    }
}

/// The body of the `axpy_rows` kernels: `val(i, d)` gives value row i's values d..d + 16 as
/// f32; rows are summed 64 dimensions at a time, even and odd rows in two sets of
/// accumulators for twice the FMAs in flight.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C; `o.len()` must be a multiple of 16,
/// and `val(i, d)` must be valid for every i < w.len() and d + 16 <= o.len().
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_rows_by(o: &mut [f32], w: &[f32], val: impl Fn(usize, usize) -> __m512) {
    let (hd, op) = (o.len(), o.as_mut_ptr());
    for d0 in (0..hd).step_by(64) {
        let nv = ((hd - d0) / 16).min(4);
        let mut acc = [[_mm512_setzero_ps(); 4]; 2];
        for v in 0..nv {
            // SAFETY: d0 + 16 v + 16 <= hd: inside o.
            acc[0][v] = unsafe { _mm512_loadu_ps(op.add(d0 + 16 * v)) };
        }
        for (i, &wi) in w.iter().enumerate() {
            let wb = _mm512_set1_ps(wi);
            for v in 0..nv {
                acc[i & 1][v] = _mm512_fmadd_ps(wb, val(i, d0 + 16 * v), acc[i & 1][v]);
            }
        }
        for v in 0..nv {
            let sum = _mm512_add_ps(acc[0][v], acc[1][v]);
            // SAFETY: as the loads above.
            unsafe { _mm512_storeu_ps(op.add(d0 + 16 * v), sum) };
        }
    }
}

/// Sixteen packed unsigned `BITS`-bit codes (2, 3, 4 or 8; code j in bits `BITS·j..` of the
/// little-endian bytes from `p`) as f32. Sub-byte codes are read as two words of `BITS`
/// bytes, eight codes each, spread over the lanes and shifted into place.
///
/// # Safety
/// The CPU must have AVX-512 F; `p` must point at `2 · BITS` readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn load_codes16<const BITS: usize>(p: *const u8) -> __m512 {
    if BITS == 8 {
        // SAFETY: 16 readable bytes at `p` (the contract).
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(unsafe {
            _mm_loadu_si128(p as *const __m128i)
        }));
    }
    let word = |q: *const u8| {
        let mut w = 0u32;
        // At most four bytes: BITS is 2, 3 or 4 here (8 returned above).
        for k in 0..BITS.min(4) {
            // SAFETY: k < BITS, and both words lie in the 2 · BITS readable bytes.
            w |= u32::from(unsafe { *q.add(k) }) << (8 * k);
        }
        w as i32
    };
    // SAFETY: the second word starts BITS bytes in, inside the readable bytes.
    let (w0, w1) = (word(p), word(unsafe { p.add(BITS) }));
    let v = _mm512_inserti64x4::<1>(_mm512_set1_epi32(w0), _mm256_set1_epi32(w1));
    let b = BITS as i32;
    let shifts = _mm512_setr_epi32(
        0,
        b,
        2 * b,
        3 * b,
        4 * b,
        5 * b,
        6 * b,
        7 * b,
        0,
        b,
        2 * b,
        3 * b,
        4 * b,
        5 * b,
        6 * b,
        7 * b,
    );
    let mask = _mm512_set1_epi32((1 << BITS) - 1);
    _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(v, shifts), mask))
}

/// Four vectors' horizontal sums, lane `i` of the result being `Σ v[i]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
fn reduce4(v: &[__m512; 4]) -> __m128 {
    let mut s = [_mm512_setzero_ps(); 1];
    lane_partials(v, &mut s);
    let h = _mm256_add_ps(
        _mm512_castps512_ps256(s[0]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s[0]))),
    );
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

/// `R` query rows against the same keys, each key's values loaded and converted once for
/// all rows: `out[r · stride + j] = bias[r] + Σ_d q[r · hd + d] · key(j, d)` for j < n, where
/// `key(j, d0)` gives key j's values `d0..d0 + 16 NV` in `NV` vectors (a key read 64 values at
/// a time lets 4-bit codes be unpacked in wide pieces).
/// Four keys per pass (`4 R` accumulators: with eight, three rows of them spilled to the stack
/// and the pass ran 20-50% slower, `cargo bench -p model --bench kvcodes`).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C; `hd` a multiple of `16 NV`, `q` at
/// least `R · hd` long, `out` at least `(R - 1) · stride + n`, and `key(j, d0)` valid for
/// every j < n and d0 + 16 NV <= hd.
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn dot_rows_multi_by<const R: usize, const NV: usize>(
    q: &[f32],
    hd: usize,
    bias: [f32; R],
    out: &mut [f32],
    stride: usize,
    n: usize,
    key: impl Fn(usize, usize) -> [__m512; NV],
) {
    debug_assert!(hd.is_multiple_of(16 * NV));
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    let mut j = 0;
    while j + 4 <= n {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for d0 in (0..hd).step_by(16 * NV) {
            for k in 0..4 {
                let kv = key(j + k, d0);
                for v in 0..NV {
                    for r in 0..R {
                        // SAFETY: r · hd + d0 + 16 v + 16 <= R · hd <= q.len() (the contract).
                        let qv = unsafe { _mm512_loadu_ps(qp.add(r * hd + d0 + 16 * v)) };
                        acc[r][k] = _mm512_fmadd_ps(kv[v], qv, acc[r][k]);
                    }
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
        let mut acc = [_mm512_setzero_ps(); R];
        for d0 in (0..hd).step_by(16 * NV) {
            let kv = key(j, d0);
            for v in 0..NV {
                for r in 0..R {
                    // SAFETY: as above.
                    let qv = unsafe { _mm512_loadu_ps(qp.add(r * hd + d0 + 16 * v)) };
                    acc[r] = _mm512_fmadd_ps(kv[v], qv, acc[r]);
                }
            }
        }
        for r in 0..R {
            // SAFETY: r · stride + j < out.len(), as above.
            unsafe { *op.add(r * stride + j) = bias[r] + _mm512_reduce_add_ps(acc[r]) };
        }
        j += 1;
    }
}

/// `R` output rows summed from the same value rows, each value row loaded and converted once
/// for all rows: `o[r · hd + d] += bias[r] + Σ_i w[r · wstride + i] · val(i, d)` for i < n,
/// 64 dimensions at a time in registers.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C; `hd` a multiple of 16, `o` at least
/// `R · hd` long, `w` at least `(R - 1) · wstride + n`, and `val(i, d)` valid for every
/// i < n and d + 16 <= hd.
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_rows_multi_by<const R: usize>(
    o: &mut [f32],
    hd: usize,
    bias: [f32; R],
    w: &[f32],
    wstride: usize,
    n: usize,
    val: impl Fn(usize, usize) -> __m512,
) {
    let (op, wp) = (o.as_mut_ptr(), w.as_ptr());
    for d0 in (0..hd).step_by(64) {
        let nv = ((hd - d0) / 16).min(4);
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for r in 0..R {
            for v in 0..nv {
                // SAFETY: r · hd + d0 + 16 v + 16 <= R · hd <= o.len() (the contract).
                acc[r][v] = _mm512_add_ps(
                    unsafe { _mm512_loadu_ps(op.add(r * hd + d0 + 16 * v)) },
                    _mm512_set1_ps(bias[r]),
                );
            }
        }
        for i in 0..n {
            let vals: [__m512; 4] = std::array::from_fn(|v| {
                if v < nv {
                    val(i, d0 + 16 * v)
                } else {
                    _mm512_setzero_ps()
                }
            });
            for r in 0..R {
                // SAFETY: r · wstride + i < (R - 1) · wstride + n <= w.len().
                let wb = _mm512_set1_ps(unsafe { *wp.add(r * wstride + i) });
                for v in 0..nv {
                    acc[r][v] = _mm512_fmadd_ps(wb, vals[v], acc[r][v]);
                }
            }
        }
        for r in 0..R {
            for v in 0..nv {
                // SAFETY: as the loads above.
                unsafe { _mm512_storeu_ps(op.add(r * hd + d0 + 16 * v), acc[r][v]) };
            }
        }
    }
}

/// [`axpy_rows_multi_by`] for heads of whole groups of 64 whose value rows are loaded a group
/// at a time: `val(i, d0)` gives value row i's dimensions `d0..d0 + 64` in four vectors.
/// A body of its own on purpose: one body generic over the vectors a load gives ran the 3- and
/// 4-bit value rows 6-7% slower in L1 (`cargo bench -p model --bench kvcodes`), and one whose
/// loader returned the group with its partial vectors 20-30% slower on every kind.
///
/// # Safety
/// As [`axpy_rows_multi_by`], with `hd` a multiple of 64 and `val(i, d0)` valid for every
/// i < n and `d0` a multiple of 64 below `hd`.
// One index runs over several register arrays at once.
#[allow(clippy::needless_range_loop)]
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_rows_multi64_by<const R: usize>(
    o: &mut [f32],
    hd: usize,
    bias: [f32; R],
    w: &[f32],
    wstride: usize,
    n: usize,
    val: impl Fn(usize, usize) -> [__m512; 4],
) {
    debug_assert!(hd.is_multiple_of(64));
    let (op, wp) = (o.as_mut_ptr(), w.as_ptr());
    for d0 in (0..hd).step_by(64) {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for r in 0..R {
            for v in 0..4 {
                // SAFETY: r · hd + d0 + 16 v + 16 <= R · hd <= o.len() (the contract).
                acc[r][v] = _mm512_add_ps(
                    unsafe { _mm512_loadu_ps(op.add(r * hd + d0 + 16 * v)) },
                    _mm512_set1_ps(bias[r]),
                );
            }
        }
        for i in 0..n {
            let vals = val(i, d0);
            for r in 0..R {
                // SAFETY: r · wstride + i < (R - 1) · wstride + n <= w.len().
                let wb = _mm512_set1_ps(unsafe { *wp.add(r * wstride + i) });
                for v in 0..4 {
                    acc[r][v] = _mm512_fmadd_ps(wb, vals[v], acc[r][v]);
                }
            }
        }
        for r in 0..R {
            for v in 0..4 {
                // SAFETY: as the loads above.
                unsafe { _mm512_storeu_ps(op.add(r * hd + d0 + 16 * v), acc[r][v]) };
            }
        }
    }
}

pub use crate::simd::{HALF, SIGNED8};

/// Sixteen stored values of kind `K` from value index `at` of `p` (on a byte), as f32.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL and F16C; the sixteen values must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn load_stored16<const K: usize>(p: *const u8, at: usize) -> __m512 {
    // SAFETY: in each branch the sixteen values from `at` are readable (the contract).
    unsafe {
        match K {
            SIGNED8 => load_i8x16(p.add(at)),
            HALF => load_f16x16(p.add(2 * at)),
            _ => load_codes16::<K>(p.add(at * K / 8)),
        }
    }
}

/// Sixty-four packed 4-bit codes (32 bytes at `p`, code j in bits `4j..` of the little-endian
/// bytes) as f32 in four vectors: split into their nibbles in two registers at once and widened
/// sixteen at a time, about four instructions per sixteen codes against eight for
/// [`load_codes16`].
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C; `p` must point at 32 readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn load_nibbles64(p: *const u8) -> [__m512; 4] {
    // SAFETY: 32 readable bytes at `p` (the contract).
    let x = unsafe { _mm256_loadu_si256(p as *const __m256i) };
    let m = _mm256_set1_epi8(0x0F);
    let (lo, hi) = (
        _mm256_and_si256(x, m),
        _mm256_and_si256(_mm256_srli_epi16::<4>(x), m),
    );
    // Codes 0-15 and 32-47 (byte i's low nibble, then its high one), then 16-31 and 48-63.
    let (a, b) = (_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi));
    let wide = |v: __m128i| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
    [
        wide(_mm256_castsi256_si128(a)),
        wide(_mm256_castsi256_si128(b)),
        wide(_mm256_extracti128_si256::<1>(a)),
        wide(_mm256_extracti128_si256::<1>(b)),
    ]
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

/// [`dot_rows_multi_by`] over keys stored as values of kind `K` (see [`SIGNED8`]): key j's
/// start at value `first + j · hd` of `codes`. Scales per channel are folded into `q` and
/// minimums into `bias` by the caller.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
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
        hd.is_multiple_of(16)
            && stored_fits::<K>(codes.len(), first, n, hd)
            && q.len() >= R * hd
            && out.len() >= (R - 1) * stride + n,
        "avx512::kv::dot_rows_stored: bad sizes"
    );
    if matches!(K, 2 | 3) && hd.is_multiple_of(64) && has_vbmi() {
        // SAFETY: the CPU has VBMI (checked) and the rest (this function's contract); sizes
        // asserted above.
        return unsafe { dot_rows_stored_vbmi::<K, R>(q, hd, bias, codes, first, out, stride, n) };
    }
    let cp = codes.as_ptr();
    if K == 4 && hd.is_multiple_of(64) {
        // SAFETY: values d..d + 64 of key j < n (hd a multiple of 64) lie inside `codes`
        // (asserted).
        let key = |j: usize, d: usize| unsafe { load_nibbles64(cp.add((first + j * hd + d) / 2)) };
        // SAFETY: the CPU has the features (this function's contract); sizes asserted above.
        unsafe { dot_rows_multi_by::<R, 4>(q, hd, bias, out, stride, n, key) }
    } else {
        // SAFETY: values d..d + 16 of key j < n lie inside `codes` (asserted).
        let key = |j: usize, d: usize| unsafe { [load_stored16::<K>(cp, first + j * hd + d)] };
        // SAFETY: the CPU has the features (this function's contract); sizes asserted above.
        unsafe { dot_rows_multi_by::<R, 1>(q, hd, bias, out, stride, n, key) }
    }
}

/// [`dot_rows_stored`] for 2- and 3-bit keys with a head of whole groups of 64: each group of
/// a key unpacked at once by [`load_codes64`].
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VBMI, FMA and F16C; `K` 2 or 3, `hd` a multiple of
/// 64, and the sizes as [`dot_rows_stored`] asserts them.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,fma,f16c")]
unsafe fn dot_rows_stored_vbmi<const K: usize, const R: usize>(
    q: &[f32],
    hd: usize,
    bias: [f32; R],
    codes: &[u8],
    first: usize,
    out: &mut [f32],
    stride: usize,
    n: usize,
) {
    let cp = codes.as_ptr();
    // SAFETY: values d..d + 64 <= hd of key j < n lie inside `codes`, on a byte (the caller's
    // assertion).
    let key =
        |j: usize, d: usize| unsafe { load_codes64::<K>(cp.add((first + j * hd + d) * K / 8)) };
    // SAFETY: the CPU has the features (this function's contract); sizes as asserted by the
    // caller.
    unsafe { dot_rows_multi_by::<R, 4>(q, hd, bias, out, stride, n, key) }
}

/// [`axpy_rows_multi_by`] over value rows stored as values of kind `K` (row i from value
/// `first + i · hd`). Scales per row are folded into `w` and minimums into `bias` by the
/// caller. Sub-byte codes are unpacked 64 at a time where the CPU has VBMI and the head is
/// whole groups of 64 ([`axpy_rows_stored_vbmi`]), sixteen at a time otherwise.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
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
        hd.is_multiple_of(16)
            && stored_fits::<K>(codes.len(), first, n, hd)
            && o.len() >= R * hd
            && w.len() >= (R - 1) * wstride + n,
        "avx512::kv::axpy_rows_stored: bad sizes"
    );
    if matches!(K, 2..=4) && hd.is_multiple_of(64) && has_vbmi() {
        // SAFETY: the CPU has VBMI (checked) and the rest (this function's contract); sizes
        // asserted above.
        return unsafe { axpy_rows_stored_vbmi::<K, R>(o, hd, bias, w, wstride, n, codes, first) };
    }
    let cp = codes.as_ptr();
    // SAFETY: values d..d + 16 of row i < n lie inside `codes` (asserted).
    let val = |i: usize, d: usize| unsafe { load_stored16::<K>(cp, first + i * hd + d) };
    // SAFETY: the CPU has the features (this function's contract); sizes asserted above.
    unsafe { axpy_rows_multi_by::<R>(o, hd, bias, w, wstride, n, val) }
}

/// [`axpy_rows_stored`] for 2-, 3- and 4-bit codes with a head of whole groups of 64: each
/// group of a value row unpacked at once by [`load_codes64`].
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VBMI, FMA and F16C; `K` 2, 3 or 4, `hd` a multiple
/// of 64, and the sizes as [`axpy_rows_stored`] asserts them.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,fma,f16c")]
unsafe fn axpy_rows_stored_vbmi<const K: usize, const R: usize>(
    o: &mut [f32],
    hd: usize,
    bias: [f32; R],
    w: &[f32],
    wstride: usize,
    n: usize,
    codes: &[u8],
    first: usize,
) {
    let cp = codes.as_ptr();
    // SAFETY: values d0..d0 + 64 <= hd of row i < n lie inside `codes`, on a byte (the
    // caller's assertion).
    let val =
        |i: usize, d0: usize| unsafe { load_codes64::<K>(cp.add((first + i * hd + d0) * K / 8)) };
    // SAFETY: the CPU has the features (this function's contract); sizes as asserted by the
    // caller.
    unsafe { axpy_rows_multi64_by::<R>(o, hd, bias, w, wstride, n, val) }
}

/// Whether this CPU has AVX-512 VBMI (byte permutes across the whole register), detected once.
pub fn has_vbmi() -> bool {
    static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VBMI.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vbmi"))
}

/// Sixty-four packed unsigned `BITS`-bit codes (2, 3 or 4: `8 BITS` bytes at `p`, code j in bits
/// `BITS·j..` of the little-endian bytes) as f32 in four vectors: one masked load, then per
/// sixteen codes a byte permute (`vpermb`) that puts the bytes holding each lane's code in the
/// lane's low bytes, a shift per lane, a mask and the conversion, where [`load_codes16`] builds
/// its words from scalar loads and shifts. A first form, one permute and one multishift
/// (`vpmultishiftqb`) for all 64 codes, then widened sixteen at a time, ran the value and key
/// kernels 3-8% slower in L1 (more cross-lane shuffles).
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VBMI; `p` must point at `8 BITS` readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,fma,f16c")]
unsafe fn load_codes64<const BITS: usize>(p: *const u8) -> [__m512; 4] {
    // Vector v, lane j holds code c = 16 v + j: the permute puts the four bytes from byte
    // BITS c / 8 in the lane (at most byte 34 of the 64, for 4-bit codes), the shift takes the
    // code's bits down to bit 0.
    const fn bytes(bits: usize, v: usize) -> [u8; 64] {
        let mut t = [0u8; 64];
        let mut j = 0;
        while j < 64 {
            t[j] = (bits * (16 * v + j / 4) / 8 + j % 4) as u8;
            j += 1;
        }
        t
    }
    const fn shifts(bits: usize, v: usize) -> [u32; 16] {
        let mut t = [0u32; 16];
        let mut j = 0;
        while j < 16 {
            t[j] = (bits * (16 * v + j) % 8) as u32;
            j += 1;
        }
        t
    }
    let tables = const {
        [
            bytes(BITS, 0),
            bytes(BITS, 1),
            bytes(BITS, 2),
            bytes(BITS, 3),
        ]
    };
    let counts = const {
        [
            shifts(BITS, 0),
            shifts(BITS, 1),
            shifts(BITS, 2),
            shifts(BITS, 3),
        ]
    };
    // SAFETY: the masked load reads the 8 BITS bytes the contract makes readable, nothing else.
    let x = unsafe { _mm512_maskz_loadu_epi8((1u64 << (8 * BITS)) - 1, p as *const i8) };
    let mask = _mm512_set1_epi32((1 << BITS) - 1);
    std::array::from_fn(|v| {
        // SAFETY: each table is 64 bytes.
        let (perm, count) = unsafe {
            (
                _mm512_loadu_si512(tables[v].as_ptr() as *const _),
                _mm512_loadu_si512(counts[v].as_ptr() as *const _),
            )
        };
        let lanes = _mm512_srlv_epi32(_mm512_permutexvar_epi8(perm, x), count);
        _mm512_cvtepi32_ps(_mm512_and_si512(lanes, mask))
    })
}

/// The AVX-512 body of [`crate::kernels::fold_params`]: `out = x · scales`, returning
/// `x · mins`, sixteen lanes at a time (the last ones masked).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn fold_params(x: &[f32], mins: &[f32], scales: &[f32], out: &mut [f32]) -> f32 {
    let n = x.len();
    assert!(
        mins.len() == n && scales.len() == n && out.len() == n,
        "avx512::kv::fold_params: bad sizes"
    );
    let (xp, mp, sp, op) = (x.as_ptr(), mins.as_ptr(), scales.as_ptr(), out.as_mut_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    // Whole vectors with plain loads and stores: the scores' kernel reads `out` right after,
    // and a masked store may not forward to a load.
    while i + 16 <= n {
        // SAFETY: i + 16 <= n: inside all four slices (asserted).
        unsafe {
            let xv = _mm512_loadu_ps(xp.add(i));
            _mm512_storeu_ps(op.add(i), _mm512_mul_ps(xv, _mm512_loadu_ps(sp.add(i))));
            acc = _mm512_fmadd_ps(xv, _mm512_loadu_ps(mp.add(i)), acc);
        }
        i += 16;
    }
    if i < n {
        let m = lanes(n - i);
        // SAFETY: the lanes of `m` are i..n, inside all four slices (asserted); masked loads
        // and stores touch nothing else.
        unsafe {
            let xv = _mm512_maskz_loadu_ps(m, xp.add(i));
            let sv = _mm512_maskz_loadu_ps(m, sp.add(i));
            let mv = _mm512_maskz_loadu_ps(m, mp.add(i));
            _mm512_mask_storeu_ps(op.add(i), m, _mm512_mul_ps(xv, sv));
            acc = _mm512_fmadd_ps(xv, mv, acc);
        }
    }
    _mm512_reduce_add_ps(acc)
}

/// The AVX-512 body of [`crate::kernels::decode_coded_params`]: sixteen (minimum code,
/// scale code) byte pairs at a time; returns how many pairs it decoded (the whole vectors'),
/// and the caller decodes the rest.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
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
        "avx512::kv::decode_coded_params: bad sizes"
    );
    let (pp, mp, sp) = (pairs.as_ptr(), mins.as_mut_ptr(), scales.as_mut_ptr());
    let (va, vstep) = (_mm512_set1_ps(amax), _mm512_set1_ps(step));
    // SAFETY: `steps` holds eight f32; the upper half of the register is never indexed.
    let table = _mm512_castps256_ps512(unsafe { _mm256_loadu_ps(steps.as_ptr()) });
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: pairs i..i + 16 are 32 bytes inside `pairs` (asserted).
        let x =
            _mm512_cvtepu16_epi32(unsafe { _mm256_loadu_si256(pp.add(2 * i) as *const __m256i) });
        // Each lane holds one pair, little end first: the minimum code (signed) in bits
        // 0..8, the scale code in bits 8..16.
        let m = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(x));
        let j = _mm512_srli_epi32::<8>(x);
        let frac = _mm512_permutexvar_ps(_mm512_and_si512(j, _mm512_set1_epi32(7)), table);
        let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(
            _mm512_set1_epi32(127),
            _mm512_srli_epi32::<3>(j),
        )));
        // (amax · step) · 2^-k, in that order: the portable path's rounding.
        let scale = _mm512_mul_ps(_mm512_mul_ps(va, frac), pow2);
        // SAFETY: i + 16 <= n = mins.len() = scales.len().
        unsafe {
            _mm512_storeu_ps(mp.add(i), _mm512_mul_ps(_mm512_cvtepi32_ps(m), vstep));
            _mm512_storeu_ps(sp.add(i), scale);
        }
        i += 16;
    }
    i
}

/// The AVX-512 body of [`crate::kernels::decode_codes`] for one code width.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
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
        hd.is_multiple_of(16)
            && out.len() == rows * hd
            && (first * BITS).is_multiple_of(8)
            && codes.len() * 8 >= (first + rows * hd) * BITS
            && mins.len() >= params
            && scales.len() >= params,
        "avx512::kv::decode_codes: bad sizes"
    );
    let (cp, op) = (codes.as_ptr(), out.as_mut_ptr());
    for r in 0..rows {
        // Rows start on a byte: hd is a multiple of 16 and `first` of 8 / BITS.
        let row = (first + r * hd) * BITS / 8;
        let (mr, sr) = if per_row {
            (_mm512_set1_ps(mins[r]), _mm512_set1_ps(scales[r]))
        } else {
            (_mm512_setzero_ps(), _mm512_setzero_ps())
        };
        for d in (0..hd).step_by(16) {
            // SAFETY: codes d..d + 16 of row r are 2 · BITS bytes inside `codes` (asserted).
            let c = unsafe { load_codes16::<BITS>(cp.add(row + d * BITS / 8)) };
            let (m, s) = if per_row {
                (mr, sr)
            } else {
                // SAFETY: d + 16 <= hd <= mins.len(), scales.len() (asserted).
                unsafe {
                    (
                        _mm512_loadu_ps(mins.as_ptr().add(d)),
                        _mm512_loadu_ps(scales.as_ptr().add(d)),
                    )
                }
            };
            // Multiply, then add: the same rounding as the portable path.
            // SAFETY: r · hd + d + 16 <= out.len() (asserted).
            unsafe { _mm512_storeu_ps(op.add(r * hd + d), _mm512_add_ps(m, _mm512_mul_ps(c, s))) };
        }
    }
}

/// `out[i] = q · keys[i q.len()..(i + 1) q.len()]` for every `i`: one query row against
/// consecutive keys, sixteen keys per pass.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C; `q.len()` must be a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn dot_rows(q: &[f32], keys: &[f32], out: &mut [f32]) {
    let hd = q.len();
    assert!(
        hd.is_multiple_of(16) && keys.len() >= out.len() * hd,
        "avx512::kv::dot_rows: bad sizes"
    );
    let kp = keys.as_ptr();
    // SAFETY: key j < out.len() holds hd values inside `keys` (asserted above); d + 16 <= hd.
    let key = |j: usize, d: usize| unsafe { _mm512_loadu_ps(kp.add(j * hd + d)) };
    // SAFETY: the CPU has the features (this function's contract); `key` as above.
    unsafe { dot_rows_by(q, out, key) }
}

/// `o += Σ_i w[i] vals[i o.len()..(i + 1) o.len()]`: the weighted sum of consecutive value
/// rows into one output row, kept in registers 64 dimensions at a time.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, FMA and F16C; `o.len()` must be a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn axpy_rows(o: &mut [f32], w: &[f32], vals: &[f32]) {
    let hd = o.len();
    assert!(
        hd.is_multiple_of(16) && vals.len() >= w.len() * hd,
        "avx512::kv::axpy_rows: bad sizes"
    );
    let vp = vals.as_ptr();
    // SAFETY: row i < w.len() holds hd values inside `vals` (asserted above); d + 16 <= hd.
    let val = |i: usize, d: usize| unsafe { _mm512_loadu_ps(vp.add(i * hd + d)) };
    // SAFETY: the CPU has the features (this function's contract); `val` as above.
    unsafe { axpy_rows_by(o, w, val) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`load_codes64`] gives the codes [`load_codes16`] gives, sixteen at a time, for every
    /// width it takes, on random bytes (where the CPU has VBMI; otherwise there is nothing to
    /// run).
    #[test]
    fn codes_unpacked_64_at_a_time_are_the_codes_unpacked_16_at_a_time() {
        if !(crate::qmatrix::Isa::Avx512.available() && has_vbmi()) {
            return;
        }
        let mut s = 7u32;
        let bytes: Vec<u8> = (0..64)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 24) as u8
            })
            .collect();
        fn check<const B: usize>(bytes: &[u8]) {
            let lanes = |v: __m512| {
                let mut a = [0f32; 16];
                // SAFETY: 16 writable f32.
                unsafe { _mm512_storeu_ps(a.as_mut_ptr(), v) };
                a
            };
            // SAFETY: the CPU has AVX-512 F, BW, VL and VBMI (checked by the caller); the 8 B
            // bytes of 64 codes lie in `bytes` (64 long).
            let wide = unsafe { load_codes64::<B>(bytes.as_ptr()) };
            for (v, &w) in wide.iter().enumerate() {
                // SAFETY: as above; sixteen codes take 2 B bytes, at 2 B v < 8 B.
                let narrow = unsafe { load_codes16::<B>(bytes.as_ptr().add(2 * B * v)) };
                assert_eq!(lanes(w), lanes(narrow), "{B}-bit codes {}..", 16 * v);
            }
        }
        check::<2>(&bytes);
        check::<3>(&bytes);
        check::<4>(&bytes);
    }
}
