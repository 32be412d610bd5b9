//! AVX-512 kernels with VNNI (8-bit dot products): the int8 products of [`super`].

use super::{PANEL, RowsView, Sums, TOKENS, form};
use std::arch::x86_64::*;

/// `out[t * ld + i] = Σ_b …` for the `x.tokens` tokens of `x` and the first `lanes` rows of
/// one repacked panel of form `f` (see [`crate::int8gemm`] for the layout and the arithmetic,
/// which the portable path repeats operation for operation).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI; `panel` must hold `x.cols / 32` panel blocks of
/// form `f`; `x.tokens` must be 1 to 8 with `x`'s slices holding that many rows;
/// `out` must be valid for writes of `lanes <= 16` values at each of `out + t * ld`,
/// `t < x.tokens`, that no other thread accesses meanwhile.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn panel(f: u8, panel: &[u8], x: RowsView<'_>, out: *mut f32, ld: usize, lanes: usize) {
    macro_rules! go {
        ($($t:literal)*) => {
            match x.tokens {
                $($t => forms::<$t>(f, panel, x, out, ld, lanes),)*
                _ => panic!("vnni::panel: {} tokens", x.tokens),
            }
        };
    }
    // SAFETY: the caller's guarantees, passed on; each arm's T equals x.tokens.
    unsafe { go!(1 2 3 4 5 6 7 8) }
}

/// The int8 product for every token of `x` and the `rows` rows held in consecutive panels of
/// `panel_bytes` each (`rows.div_ceil(16)` of them), their columns side by side from `out`:
/// eight tokens at a time, each group of tokens through every panel while its codes are in L1.
///
/// # Safety
/// As `panel`, for each panel and any number of tokens: `out` must be valid for writes of
/// `rows` values at each of `out + t * ld`, `t < x.tokens`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn panels(
    f: u8,
    panels: &[u8],
    panel_bytes: usize,
    rows: usize,
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
) {
    let n = rows.div_ceil(PANEL);
    assert!(panels.len() >= n * panel_bytes, "vnni::panels: bad sizes");
    let mut t0 = 0;
    while t0 < x.tokens {
        let t1 = (t0 + TOKENS).min(x.tokens);
        let xs = x.slice(t0, t1);
        for p in 0..n {
            let one = &panels[p * panel_bytes..(p + 1) * panel_bytes];
            let lanes = (rows - p * PANEL).min(PANEL);
            // SAFETY: the caller's guarantees, for tokens t0..t1 of x and panel p's columns.
            unsafe { panel(f, one, xs, out.add(t0 * ld + p * PANEL), ld, lanes) };
        }
        t0 = t1;
    }
}

/// [`tile`] for the form `f`.
///
/// # Safety
/// As [`panel`], with `x.tokens == T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn forms<const T: usize>(
    f: u8,
    panel: &[u8],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    // SAFETY: the caller's guarantees, passed on with the form they name.
    unsafe {
        match f {
            form::NIB_MIN => tile::<T, { form::NIB_MIN }>(panel, x, out, ld, lanes),
            form::NIB_OFF => tile::<T, { form::NIB_OFF }>(panel, x, out, ld, lanes),
            form::BYTE_MIN => tile::<T, { form::BYTE_MIN }>(panel, x, out, ld, lanes),
            form::BYTE_OFF => tile::<T, { form::BYTE_OFF }>(panel, x, out, ld, lanes),
            form::SIGNED => tile::<T, { form::SIGNED }>(panel, x, out, ld, lanes),
            form::HALVES => tile::<T, { form::HALVES }>(panel, x, out, ld, lanes),
            _ => unreachable!("panel form {f}"),
        }
    }
}

/// Quantizes 32-value blocks exactly as `int8gemm::quantize_portable` does (same codes,
/// scales and sums, bit for bit).
///
/// # Safety
/// The CPU must have AVX-512 F and BW; `q` must hold as many values as `x` (a multiple of
/// 32), and each of `s`'s slices one value per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn quantize(x: &[f32], q: &mut [i8], s: Sums<'_>) {
    let nb = x.len() / 32;
    assert!(
        q.len() >= nb * 32
            && s.d.len() >= nb
            && s.sum.len() >= nb
            && s.qsum.len() >= nb
            && s.qlo.len() >= nb
    );
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
            s.d[b] = amax / 127.0;
            let inv = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            // Round to nearest, ties to even (the default MXCSR mode).
            let ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            let qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            let qp = q.as_mut_ptr().add(b * 32);
            _mm_storeu_si128(qp as *mut __m128i, _mm512_cvtepi32_epi8(ql));
            _mm_storeu_si128(qp.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(qh));
            s.qlo[b] = _mm512_reduce_add_epi32(ql);
            s.qsum[b] = s.qlo[b] + _mm512_reduce_add_epi32(qh);
            s.sum[b] = s.d[b] * s.qsum[b] as f32;
        }
    }
}

/// [`panel`] for exactly `T` tokens and the form `F`, with the token tile's accumulators in
/// registers.
///
/// Kept whole: the accumulators must stay in registers across the group loop, so the loop and
/// the per-form scaling it calls inline are one function.
///
/// # Safety
/// As [`panel`], with `x.tokens == T` and a panel of form `F`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const T: usize, const F: u8>(
    panel: &[u8],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    let nb = x.cols / 32;
    let (qb, pb) = (form::code_bytes(F), form::block_bytes(F));
    assert!(
        x.tokens == T
            && panel.len() >= nb * pb
            && x.q.len() >= T * x.cols
            && x.d.len() >= T * nb
            && x.sum.len() >= T * nb
            && x.qsum.len() >= T * nb
            && x.qlo.len() >= T * nb
            && lanes <= PANEL,
        "vnni::tile: bad sizes"
    );
    let off = form::offset(F);
    let nibble = _mm512_set1_epi8(0x0F);
    let mut f = [_mm512_setzero_ps(); T];
    let xq = x.q.as_ptr();
    for b in 0..nb {
        // SAFETY: block b < nb of the panel is inside `panel` (asserted above): its codes
        // (PANEL * qb bytes, read as qb / 4 vectors of 64), its 16 f32 scales and, if the form
        // has them, its 16 second parameters; unaligned loads accept any address.
        let (w, dw, second) = unsafe {
            let o = panel.as_ptr().add(b * pb);
            let mut w = [_mm512_setzero_si512(); 8];
            if form::nibbles(F) {
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
            let s = o.add(PANEL * qb) as *const f32;
            let dw = _mm512_loadu_ps(s);
            let second = if form::has_second(F) {
                _mm512_loadu_ps(s.add(PANEL))
            } else {
                _mm512_setzero_ps()
            };
            (w, dw, second)
        };
        // Group after group, each loaded code vector multiplied into every token's integer
        // sum: the tokens' sums are independent chains, held in registers.
        let xg = |t: usize, g: usize| {
            // SAFETY: g < 8: token t < T of x holds x.cols >= 32 (b + 1) codes (asserted
            // above), so the eight 4-byte groups of its block b are inside x.q.
            _mm512_set1_epi32(unsafe {
                (xq.add(t * x.cols + b * 32) as *const i32)
                    .add(g)
                    .read_unaligned()
            })
        };
        // Token t's parameter of block b; x's slices hold T · nb of each (asserted above), so
        // the reads need no bounds checks inside the loop.
        // SAFETY: t < T and b < nb: index t · nb + b is inside each slice (asserted above).
        let at = |v: &[i32], t: usize| unsafe { *v.as_ptr().add(t * nb + b) };
        // SAFETY: as above.
        let atf = |v: &[f32], t: usize| unsafe { *v.as_ptr().add(t * nb + b) };
        if F == form::HALVES {
            let mut lo: [__m512i; T] =
                std::array::from_fn(|t| _mm512_set1_epi32(-off * at(x.qlo, t)));
            let mut hi: [__m512i; T] =
                std::array::from_fn(|t| _mm512_set1_epi32(-off * (at(x.qsum, t) - at(x.qlo, t))));
            for g in 0..4 {
                for t in 0..T {
                    lo[t] = _mm512_dpbusd_epi32(lo[t], w[g], xg(t, g));
                    hi[t] = _mm512_dpbusd_epi32(hi[t], w[g + 4], xg(t, g + 4));
                }
            }
            for (t, f) in f.iter_mut().enumerate() {
                let xd = _mm512_set1_ps(atf(x.d, t));
                *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[t]), _mm512_mul_ps(dw, xd), *f);
                *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[t]), _mm512_mul_ps(second, xd), *f);
            }
        } else {
            let mut acc: [__m512i; T] =
                std::array::from_fn(|t| _mm512_set1_epi32(-off * at(x.qsum, t)));
            for (g, &wg) in w.iter().enumerate() {
                for (t, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_dpbusd_epi32(*acc, wg, xg(t, g));
                }
            }
            for (t, f) in f.iter_mut().enumerate() {
                let xd = _mm512_set1_ps(atf(x.d, t));
                *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), _mm512_mul_ps(dw, xd), *f);
                if form::mins(F) {
                    *f = _mm512_fmadd_ps(second, _mm512_set1_ps(atf(x.sum, t)), *f);
                }
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

/// `o[i] += v · w[i]`, multiplied then added as the portable loop does (the compiler does not
/// fuse them), in vectors.
///
/// # Safety
/// The CPU must have AVX-512 F.
#[target_feature(enable = "avx512f")]
pub unsafe fn add_scaled(o: &mut [f32], v: f32, w: &[f32]) {
    for (o, &wv) in o.iter_mut().zip(w) {
        *o += v * wv;
    }
}
