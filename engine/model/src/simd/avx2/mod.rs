//! AVX2 + FMA + F16C kernels (every x86-64 CPU since Haswell and Zen 1): single-row products,
//! f16 conversion, softmax and SwiGLU here; the several-rows-per-pass decode products in
//! [`matvec`] (f32 activations), [`blocks_int8`] and [`split_int8`] (int8 activations on the
//! file's block formats and on Q4_1/Q8_0), and the attention kernels in [`kv`], the 256-bit
//! forms of `simd::avx512`'s.

pub mod blocks_int8;
pub mod coded;
pub mod kv;
pub mod matvec;
pub mod split_int8;

use half::f16;
use std::arch::x86_64::*;

/// One f16 to f32 through F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn h2f(h: f16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits()))))
}

/// The 32 nibbles of a Q4_1 block as four vectors of eight f32 (values 0..8, ..., 24..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q4(q: __m128i) -> [__m256; 4] {
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(q, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
    [
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(lo))),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(hi))),
    ]
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Dequantizes Q4_1 blocks into `out` (32 values per block).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `m` must hold `d.len()` values, `qs` 16 bytes and
/// `out` 32 values for each of the `d.len()` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_q4_1(d: &[f16], m: &[f16], qs: &[u8], out: &mut [f32]) {
    let nb = d.len();
    assert!(m.len() >= nb && qs.len() >= nb * 16 && out.len() >= nb * 32);
    for b in 0..nb {
        // SAFETY: the assert above keeps the 16-byte load at qs[16b..] inside `qs`.
        let q = unsafe { _mm_loadu_si128(qs.as_ptr().add(b * 16) as *const __m128i) };
        let (db, mb) = (_mm256_set1_ps(h2f(d[b])), _mm256_set1_ps(h2f(m[b])));
        for (i, w) in unpack_q4(q).into_iter().enumerate() {
            // SAFETY: out[32b + 8i..+8] is inside `out` by the assert above.
            unsafe {
                _mm256_storeu_ps(
                    out.as_mut_ptr().add(b * 32 + i * 8),
                    _mm256_fmadd_ps(w, db, mb),
                )
            };
        }
    }
}

/// Dequantizes Q8_0 blocks into `out` (32 values per block).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `qs` and `out` must hold 32 values for each of the
/// `d.len()` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_q8_0(d: &[f16], qs: &[u8], out: &mut [f32]) {
    let nb = d.len();
    assert!(qs.len() >= nb * 32 && out.len() >= nb * 32);
    for (b, &h) in d.iter().enumerate() {
        let db = _mm256_set1_ps(h2f(h));
        for i in 0..4 {
            // SAFETY: the 8-byte load at qs[32b + 8i..] and the 8-float store at
            // out[32b + 8i..] are inside their slices by the assert above.
            unsafe {
                let q = _mm_loadl_epi64(qs.as_ptr().add(b * 32 + i * 8) as *const __m128i);
                let w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                _mm256_storeu_ps(out.as_mut_ptr().add(b * 32 + i * 8), _mm256_mul_ps(w, db));
            }
        }
    }
}

/// Little-endian f16 bytes to f32, eight at a time.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `src` must hold two bytes per value of `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16_to_f32(src: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert!(src.len() >= n * 2);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: the 16-byte load at src[2i..2i+16] and the 8-float store at out[i..i+8]
        // are inside their slices (i + 8 <= n and the assert above).
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i * 2) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for j in i..n {
        out[j] = h2f(f16::from_le_bytes([src[2 * j], src[2 * j + 1]]));
    }
}

/// `Σ a b` over two f32 rows of equal length, in four vector accumulators.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8 j + 8 <= i + 32 <= n, inside both slices.
            unsafe {
                let x = _mm256_loadu_ps(a.as_ptr().add(i + 8 * j));
                let y = _mm256_loadu_ps(b.as_ptr().add(i + 8 * j));
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, inside both slices.
        unsafe {
            let x = _mm256_loadu_ps(a.as_ptr().add(i));
            let y = _mm256_loadu_ps(b.as_ptr().add(i));
            acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
        }
        i += 8;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut s = hsum(v);
    for j in i..n {
        s = a[j].mul_add(b[j], s);
    }
    s
}

/// `y += a x` over f32 rows of equal length.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_f32(y: &mut [f32], a: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, inside both slices; y is not aliased by x (&mut borrow).
        unsafe {
            let yp = y.as_mut_ptr().add(i);
            let v = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(yp));
            _mm256_storeu_ps(yp, v);
        }
        i += 8;
    }
    for j in i..n {
        y[j] = a.mul_add(x[j], y[j]);
    }
}

/// `e^x` in each lane, Cephes' single-precision method: `x = n ln 2 + r` with `|r| ≤ ln 2 / 2`
/// (ln 2 split in two parts so `r` is exact), a degree-7 polynomial for `e^r`, and `2^n`
/// built in the exponent bits. Within a few ulp of `e^x` for `x` in `[-87, 88.7]`; `x` is
/// clamped to `[-87.3, 88.7]`, so a very negative `x` gives 0 or about 1e-38 and a very
/// large one about 3.4e38, never infinity.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(crate::simd::EXP_MIN)),
        _mm256_set1_ps(crate::simd::EXP_MAX),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(crate::simd::LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(crate::simd::LN2_LO), r);
    let [c0, rest @ ..] = crate::simd::EXP_POLY;
    let mut y = _mm256_set1_ps(c0);
    for c in rest {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    // 2^n for n in [-126, 128]: the biased exponent, shifted into place. n = 128 (x near
    // 88.7) would overflow the exponent; take 2^(n-1) and double instead.
    let n1 = _mm256_sub_ps(n, _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n1),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(
        _mm256_mul_ps(y, _mm256_castsi256_ps(e)),
        _mm256_set1_ps(2.0),
    )
}

/// Eight values at `i` of `v`, or what is left of `v` padded with `pad`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_or_pad(v: &[f32], i: usize, pad: f32) -> __m256 {
    if v.len() - i >= 8 {
        // SAFETY: v[i..i + 8] is inside v (checked just above).
        return unsafe { _mm256_loadu_ps(v.as_ptr().add(i)) };
    }
    let mut b = [pad; 8];
    let n = (v.len() - i).min(8);
    b[..n].copy_from_slice(&v[i..i + n]);
    // SAFETY: b holds eight f32; unaligned loads accept any address.
    unsafe { _mm256_loadu_ps(b.as_ptr()) }
}

/// Stores the first `n` lanes of `x` at `v[i..i + n]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_part(v: &mut [f32], i: usize, n: usize, x: __m256) {
    if n == 8 {
        assert!(i + 8 <= v.len());
        // SAFETY: v[i..i + 8] is inside v (asserted just above).
        return unsafe { _mm256_storeu_ps(v.as_mut_ptr().add(i), x) };
    }
    let mut b = [0.0f32; 8];
    // SAFETY: b holds eight f32; unaligned stores accept any address.
    unsafe { _mm256_storeu_ps(b.as_mut_ptr(), x) };
    v[i..i + n].copy_from_slice(&b[..n]);
}

/// `row = softmax(scale · row)` in place (`scale > 0`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn softmax(row: &mut [f32], scale: f32) {
    let len = row.len();
    if len == 0 {
        return;
    }
    // SAFETY: the caller's guarantee, passed on.
    let (_, sum) = unsafe { softmax_exp(row, scale) };
    let inv = _mm256_set1_ps(1.0 / sum);
    let mut i = 0;
    while i < len {
        let n = (len - i).min(8);
        store_part(row, i, n, _mm256_mul_ps(load_or_pad(row, i, 0.0), inv));
        i += 8;
    }
}

/// `row = e^(scale · row - max)` in place, where `max` is `scale` times the row's largest
/// value (`scale > 0`); returns `(max, Σ row)`: a softmax before its normalization.
/// An empty row gives `(-∞, 0)`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn softmax_exp(row: &mut [f32], scale: f32) -> (f32, f32) {
    let len = row.len();
    if len == 0 {
        return (f32::NEG_INFINITY, 0.0);
    }
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..len).step_by(8) {
        m = _mm256_max_ps(m, load_or_pad(row, i, f32::NEG_INFINITY));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    // scale > 0, so the scaled row's largest is the largest scaled.
    let max_s = _mm_cvtss_f32(m) * scale;
    let max = _mm256_set1_ps(max_s);
    let sc = _mm256_set1_ps(scale);
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i < len {
        let n = (len - i).min(8);
        let e = exp8(_mm256_fmsub_ps(load_or_pad(row, i, 0.0), sc, max));
        // Padding lanes are left out of the sum.
        let keep = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(keep)));
        store_part(row, i, n, e);
        i += 8;
    }
    (max_s, hsum(sum))
}

/// GeGLU of one row: `out = gelu(gate) · up` with GELU in its tanh form,
/// `0.5 g (1 + tanh y) = g / (1 + e^(-2y))`, `y = sqrt(2 / π) (g + 0.044715 g³)`: SwiGLU's
/// shape, one `e^x` per value (libm's `tanhf`, scalar, took a quarter of Gemma 3's prefill).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `gate` and `up` at least as long as `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn geglu(out: &mut [f32], gate: &[f32], up: &[f32]) {
    let len = out.len();
    assert!(gate.len() >= len && up.len() >= len);
    let one = _mm256_set1_ps(1.0);
    // -2 sqrt(2 / π), and the cubic term's factor.
    let c = _mm256_set1_ps(-2.0 * 0.797_884_6);
    let k = _mm256_set1_ps(0.044_715);
    let mut i = 0;
    while i < len {
        let n = (len - i).min(8);
        let g = load_or_pad(gate, i, 0.0);
        let z = _mm256_mul_ps(
            _mm256_mul_ps(c, g),
            _mm256_fmadd_ps(_mm256_mul_ps(k, g), g, one),
        );
        let s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(z)));
        store_part(out, i, n, _mm256_mul_ps(s, load_or_pad(up, i, 0.0)));
        i += 8;
    }
}

/// SwiGLU of one row: `out = silu(gate) · up = gate / (1 + e^-gate) · up`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `gate` and `up` at least as long as `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn swiglu(out: &mut [f32], gate: &[f32], up: &[f32]) {
    let len = out.len();
    assert!(gate.len() >= len && up.len() >= len);
    let one = _mm256_set1_ps(1.0);
    let neg = _mm256_set1_ps(-0.0);
    let mut i = 0;
    while i < len {
        let n = (len - i).min(8);
        let g = load_or_pad(gate, i, 0.0);
        let e = exp8(_mm256_xor_ps(g, neg));
        let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        store_part(out, i, n, _mm256_mul_ps(s, load_or_pad(up, i, 0.0)));
        i += 8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GeGLU within a few ulp of the f64 GELU(tanh) times `up`, at every length's tail and
    /// at gates far enough out that `e^x` clamps.
    #[test]
    fn geglu_is_gelu_tanh_of_the_gate_times_up() {
        if !crate::qmatrix::Isa::Avx2.available() {
            return;
        }
        let gate: Vec<f32> = (0..203)
            .map(|i| ((i * 7919 % 211) as f32 - 105.0) * if i % 5 == 0 { 0.5 } else { 0.05 })
            .chain([-60.0, -12.0, 12.0, 60.0, 0.0, -0.0])
            .collect();
        let up: Vec<f32> = (0..gate.len())
            .map(|i| 1.0 + (i % 7) as f32 * 0.25)
            .collect();
        for len in [gate.len(), 5, 8, 13] {
            let mut out = vec![f32::NAN; len];
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above); gate and up are longer.
            unsafe { geglu(&mut out, &gate, &up) };
            for (i, &o) in out.iter().enumerate() {
                let g = f64::from(gate[i]);
                let y = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                // 0.5 g (1 + tanh y), written without its cancellation for y ≪ 0.
                let want = g / (1.0 + (-2.0 * y).exp()) * f64::from(up[i]);
                assert!((want - 0.5 * g * (1.0 + y.tanh()) * f64::from(up[i])).abs() < 1e-9);
                assert!(
                    (f64::from(o) - want).abs() <= want.abs() * 3e-6 + 1e-30,
                    "{i}: {o} vs {want} (gate {g})"
                );
            }
        }
    }
}
