//! AVX-512 kernels with VNNI (8-bit dot products): the int8 products of [`super`].

use super::{PANEL, RowsView};
use std::arch::x86_64::*;

/// `out[t * ld + i] = Σ_b …` for the `x.tokens` tokens of `x` and the first `lanes` rows of
/// one repacked panel (see [`crate::int8gemm`] for the layout and the arithmetic,
/// which the portable path repeats operation for operation).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI; `panel` must hold `x.cols / 32` panel blocks of
/// the kind `q4` says; `x.tokens` must be 1 to 8 with `x`'s slices holding that many rows;
/// `out` must be valid for writes of `lanes <= 16` values at each of `out + t * ld`,
/// `t < x.tokens`, that no other thread accesses meanwhile.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn panel(
    q4: bool,
    panel: &[u8],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    macro_rules! go {
        ($($t:literal)*) => {
            match (x.tokens, q4) {
                $(($t, true) => tile::<$t, true>(panel, x, out, ld, lanes),
                ($t, false) => tile::<$t, false>(panel, x, out, ld, lanes),)*
                _ => panic!("vnni::panel: {} tokens", x.tokens),
            }
        };
    }
    // SAFETY: the caller's guarantees, passed on; each arm's T equals x.tokens.
    unsafe { go!(1 2 3 4 5 6 7 8) }
}

/// Quantizes 32-value blocks exactly as `int8gemm::quantize_portable` does (same codes,
/// scales and sums, bit for bit).
///
/// # Safety
/// The CPU must have AVX-512 F and BW; `q` must hold as many values as `x` (a multiple of
/// 32), and `d`, `sum`, `qsum` one per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn quantize(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [f32], qsum: &mut [i32]) {
    let nb = x.len() / 32;
    assert!(q.len() >= nb * 32 && d.len() >= nb && sum.len() >= nb && qsum.len() >= nb);
    let sign = _mm512_set1_ps(-0.0);
    for b in 0..nb {
        // SAFETY: block b < nb: its 32 values are inside x and its 32 codes inside q (the
        // assert above); unaligned loads and stores accept any address.
        unsafe {
            let xp = x.as_ptr().add(b * 32);
            let (lo, hi) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(
                _mm512_andnot_ps(sign, lo),
                _mm512_andnot_ps(sign, hi),
            ));
            d[b] = amax / 127.0;
            let inv = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            // Round to nearest, ties to even (the default MXCSR mode).
            let ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            let qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            let qp = q.as_mut_ptr().add(b * 32);
            _mm_storeu_si128(qp as *mut __m128i, _mm512_cvtepi32_epi8(ql));
            _mm_storeu_si128(qp.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(qh));
            qsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
            sum[b] = d[b] * qsum[b] as f32;
        }
    }
}

/// [`panel`] for exactly `T` tokens, with the token tile's accumulators in registers.
///
/// # Safety
/// As [`panel`], with `x.tokens == T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const T: usize, const Q4: bool>(
    panel: &[u8],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    let nb = x.cols / 32;
    let qb = if Q4 { 16 } else { 32 };
    let pb = PANEL * qb + if Q4 { 64 } else { 32 };
    assert!(
        x.tokens == T
            && panel.len() >= nb * pb
            && x.q.len() >= T * x.cols
            && x.d.len() >= T * nb
            && x.sum.len() >= T * nb
            && x.qsum.len() >= T * nb
            && lanes <= PANEL,
        "vnni::tile: bad sizes"
    );
    let nibble = _mm512_set1_epi8(0x0F);
    let mut f = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: block b < nb of the panel is inside `panel` (asserted above): its codes
        // (PANEL * qb bytes, read as qb / 4 vectors of 64), its 16 f16 scales and, for Q4_1,
        // its 16 f16 minimums; unaligned loads accept any address.
        let (w, dw, mw) = unsafe {
            let o = panel.as_ptr().add(b * pb);
            let mut w = [_mm512_setzero_si512(); 8];
            if Q4 {
                for j in 0..4 {
                    let z = _mm512_loadu_si512(o.add(64 * j) as *const __m512i);
                    w[j] = _mm512_and_si512(z, nibble);
                    w[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(z), nibble);
                }
            } else {
                for (g, w) in w.iter_mut().enumerate() {
                    *w = _mm512_loadu_si512(o.add(64 * g) as *const __m512i);
                }
            }
            let s = o.add(PANEL * qb);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(s as *const __m256i));
            let mw = if Q4 {
                _mm512_cvtph_ps(_mm256_loadu_si256(s.add(32) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            (w, dw, mw)
        };
        for (t, f) in f.iter_mut().enumerate() {
            let p = t * nb + b;
            let mut acc = if Q4 {
                _mm512_setzero_si512()
            } else {
                _mm512_set1_epi32(-128 * x.qsum[p])
            };
            // SAFETY: token t < T of x holds x.cols >= 32 (b + 1) codes (asserted above),
            // so the eight 4-byte groups of its block b are inside x.q.
            let xq = unsafe { x.q.as_ptr().add(t * x.cols + b * 32) } as *const i32;
            for (g, &wg) in w.iter().enumerate() {
                // SAFETY: g < 8: inside the block's 32 codes (see above).
                let a = unsafe { xq.add(g).read_unaligned() };
                acc = _mm512_dpbusd_epi32(acc, wg, _mm512_set1_epi32(a));
            }
            let sd = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[p]));
            *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sd, *f);
            if Q4 {
                *f = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sum[p]), *f);
            }
        }
    }
    let mask: __mmask16 = if lanes == PANEL {
        0xFFFF
    } else {
        (1u16 << lanes) - 1
    };
    for (t, &f) in f.iter().enumerate() {
        // SAFETY: the caller guarantees `lanes` writable values at out + t * ld for t < T;
        // the mask writes only those.
        unsafe { _mm512_mask_storeu_ps(out.add(t * ld), mask, f) };
    }
}
