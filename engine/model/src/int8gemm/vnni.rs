//! AVX-512 kernels with VNNI (8-bit dot products): the int8 products of [`super`].

use super::{PANEL, RowsView, Sums, TOKENS, form};
use std::arch::x86_64::*;

/// Tokens of one register tile when a task's two panels are multiplied together.
const PAIR_TOKENS: usize = 4;

/// The int8 product for every token of `x` and the `rows` rows held in consecutive panels of
/// `panel_bytes` each (`rows.div_ceil(16)` of them), their columns side by side from `out`
/// (see [`crate::int8gemm`] for the layout and the arithmetic, which the portable path repeats
/// operation for operation). Two panels are multiplied together, each activation group
/// broadcast once for both, [`PAIR_TOKENS`] tokens at a time; one panel [`TOKENS`] at a time.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI; each panel must hold `x.cols / 32` panel blocks
/// of form `f`, and `x`'s slices `x.tokens` rows; `out` must be valid for writes of `rows`
/// values at each of `out + t * ld`, `t < x.tokens`, that no other thread accesses meanwhile.
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
    let panel = |p: usize| &panels[p * panel_bytes..(p + 1) * panel_bytes];
    let lanes = |p: usize| (rows - p * PANEL).min(PANEL);
    let mut p = 0;
    while p < n {
        let pair = n - p >= 2;
        let step = if pair { PAIR_TOKENS } else { TOKENS };
        let mut t0 = 0;
        while t0 < x.tokens {
            let t1 = (t0 + step).min(x.tokens);
            let (xs, o) = (x.slice(t0, t1), out.wrapping_add(t0 * ld + p * PANEL));
            // SAFETY: the caller's guarantees, for tokens t0..t1 of x and the columns of
            // panel p (and p + 1 for a pair).
            unsafe {
                if pair {
                    tokens::<2>(
                        f,
                        [panel(p), panel(p + 1)],
                        xs,
                        o,
                        ld,
                        [lanes(p), lanes(p + 1)],
                    )
                } else {
                    tokens::<1>(f, [panel(p)], xs, o, ld, [lanes(p)])
                }
            }
            t0 = t1;
        }
        p += if pair { 2 } else { 1 };
    }
}

/// [`tile`] for `x.tokens` tokens (1 to 8, at most [`PAIR_TOKENS`] for two panels) and the
/// form `f`.
///
/// # Safety
/// As [`panels`], for `P` panels starting at column 0 of `out`, panel `p`'s first
/// `lanes[p]` rows written.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tokens<const P: usize>(
    f: u8,
    panels: [&[u8]; P],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: [usize; P],
) {
    macro_rules! go {
        ($($t:literal)*) => {
            match x.tokens {
                $($t if P == 1 || $t <= PAIR_TOKENS => forms::<$t, P>(f, panels, x, out, ld, lanes),)*
                _ => panic!("vnni::tokens: {} tokens for {P} panels", x.tokens),
            }
        };
    }
    // SAFETY: the caller's guarantees, passed on; each arm's T equals x.tokens.
    unsafe { go!(1 2 3 4 5 6 7 8) }
}

/// [`tile`] for the form `f`.
///
/// # Safety
/// As [`tokens`], with `x.tokens == T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn forms<const T: usize, const P: usize>(
    f: u8,
    panels: [&[u8]; P],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: [usize; P],
) {
    // SAFETY: the caller's guarantees, passed on with the form they name.
    unsafe {
        match f {
            form::NIB_MIN => tile::<T, { form::NIB_MIN }, P>(panels, x, out, ld, lanes),
            form::NIB_OFF => tile::<T, { form::NIB_OFF }, P>(panels, x, out, ld, lanes),
            form::BYTE_MIN => tile::<T, { form::BYTE_MIN }, P>(panels, x, out, ld, lanes),
            form::BYTE_OFF => tile::<T, { form::BYTE_OFF }, P>(panels, x, out, ld, lanes),
            form::SIGNED => tile::<T, { form::SIGNED }, P>(panels, x, out, ld, lanes),
            form::HALVES => tile::<T, { form::HALVES }, P>(panels, x, out, ld, lanes),
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
    for b in 0..nb {
        // SAFETY: block b < nb: its 32 values are inside x and its 32 codes inside q (the
        // assert above); unaligned loads and stores accept any address.
        unsafe {
            let xp = x.as_ptr().add(b * 32);
            let (lo, hi) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            // |x| by `vpandd` (AVX-512 F; `_mm512_andnot_ps` needs DQ, which these functions
            // do not enable, and was called out of line).
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
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

/// The product for exactly `T` tokens, `P` panels and the form `F`, with the tile's
/// accumulators in registers.
///
/// Per block, the code vectors are read a group of four codes at a time (both nibbles of a
/// byte group at once), and each token's activation group is broadcast once and multiplied into
/// every panel's integer sum; then each sum is scaled into its f32 accumulator in the order the
/// portable path takes.
///
/// Kept whole: the accumulators must stay in registers across the block loop, so the loop and
/// the per-form scaling it calls inline are one function.
///
/// # Safety
/// As [`tokens`], with `x.tokens == T` and panels of form `F`.
///
/// One index runs over several register arrays at once (hence the index loops).
#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const T: usize, const F: u8, const P: usize>(
    panels: [&[u8]; P],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: [usize; P],
) {
    let nb = x.cols / 32;
    let (qb, pb) = (form::code_bytes(F), form::block_bytes(F));
    assert!(
        x.tokens == T
            && panels.iter().all(|p| p.len() >= nb * pb)
            && x.q.len() >= T * x.cols
            && x.d.len() >= T * nb
            && x.sum.len() >= T * nb
            && x.qsum.len() >= T * nb
            && x.qlo.len() >= T * nb
            && lanes.iter().all(|&l| l <= PANEL),
        "vnni::tile: bad sizes"
    );
    let off = form::offset(F);
    let nibble = _mm512_set1_epi8(0x0F);
    let mut f = [[_mm512_setzero_ps(); T]; P];
    let xq = x.q.as_ptr();
    for b in 0..nb {
        // Token t's activation group g (codes 4g..4g + 4) of block b.
        let xg = |t: usize, g: usize| {
            // SAFETY: g < 8: token t < T of x holds x.cols >= 32 (b + 1) codes (asserted
            // above), so the eight 4-byte groups of its block b are inside x.q.
            _mm512_set1_epi32(unsafe {
                (xq.add(t * x.cols + b * 32) as *const i32)
                    .add(g)
                    .read_unaligned()
            })
        };
        // Panel p's code vector k of block b (64 bytes: four codes of each of 16 rows).
        // SAFETY: k < qb / 4 and b < nb: inside the panel's nb blocks of pb bytes (asserted
        // above); unaligned loads accept any address.
        let codes = |p: usize, k: usize| unsafe {
            _mm512_loadu_si512(panels[p].as_ptr().add(b * pb + 64 * k) as *const __m512i)
        };
        // Token t's parameter of block b; x's slices hold T · nb of each (asserted above), so
        // the reads need no bounds checks inside the loop.
        // SAFETY: t < T and b < nb: index t · nb + b is inside each slice (asserted above).
        let at = |v: &[i32], t: usize| unsafe { *v.as_ptr().add(t * nb + b) };
        // SAFETY: as above.
        let atf = |v: &[f32], t: usize| unsafe { *v.as_ptr().add(t * nb + b) };
        // The integer sums, with the offset's correction taken off at the start: values
        // 0..16 in `lo` and 16..32 in `hi` for Q6_K's two scales, all 32 in `lo` otherwise.
        let (mut lo, mut hi): ([[__m512i; T]; P], [[__m512i; T]; P]) = if F == form::HALVES {
            (
                [std::array::from_fn(|t| _mm512_set1_epi32(-off * at(x.qlo, t))); P],
                [std::array::from_fn(|t| _mm512_set1_epi32(-off * (at(x.qsum, t) - at(x.qlo, t))));
                    P],
            )
        } else {
            (
                [std::array::from_fn(|t| _mm512_set1_epi32(-off * at(x.qsum, t))); P],
                [[_mm512_setzero_si512(); T]; P],
            )
        };
        if form::nibbles(F) {
            // Byte group k holds codes 4k.. in its low nibbles and 16 + 4k.. in its high ones.
            for k in 0..4 {
                let z: [__m512i; P] = std::array::from_fn(|p| codes(p, k));
                let wl: [__m512i; P] = std::array::from_fn(|p| _mm512_and_si512(z[p], nibble));
                let wh: [__m512i; P] =
                    std::array::from_fn(|p| _mm512_and_si512(_mm512_srli_epi16::<4>(z[p]), nibble));
                for t in 0..T {
                    let (xl, xh) = (xg(t, k), xg(t, k + 4));
                    for p in 0..P {
                        lo[p][t] = _mm512_dpbusd_epi32(lo[p][t], wl[p], xl);
                        lo[p][t] = _mm512_dpbusd_epi32(lo[p][t], wh[p], xh);
                    }
                }
            }
        } else {
            for g in 0..8 {
                let w: [__m512i; P] = std::array::from_fn(|p| codes(p, g));
                for t in 0..T {
                    let xv = xg(t, g);
                    for p in 0..P {
                        if F == form::HALVES && g >= 4 {
                            hi[p][t] = _mm512_dpbusd_epi32(hi[p][t], w[p], xv);
                        } else {
                            lo[p][t] = _mm512_dpbusd_epi32(lo[p][t], w[p], xv);
                        }
                    }
                }
            }
        }
        for p in 0..P {
            // SAFETY: the block's 16 f32 scales and, if the form has them, its 16 second
            // parameters follow its codes inside the panel (asserted above).
            let (dw, second) = unsafe {
                let s = panels[p].as_ptr().add(b * pb + PANEL * qb) as *const f32;
                let second = if form::has_second(F) {
                    _mm512_loadu_ps(s.add(PANEL))
                } else {
                    _mm512_setzero_ps()
                };
                (_mm512_loadu_ps(s), second)
            };
            for t in 0..T {
                let xd = _mm512_set1_ps(atf(x.d, t));
                let fp = &mut f[p][t];
                *fp = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[p][t]), _mm512_mul_ps(dw, xd), *fp);
                if F == form::HALVES {
                    let s = _mm512_mul_ps(second, xd);
                    *fp = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[p][t]), s, *fp);
                } else if form::mins(F) {
                    *fp = _mm512_fmadd_ps(second, _mm512_set1_ps(atf(x.sum, t)), *fp);
                }
            }
        }
    }
    for p in 0..P {
        let mask: __mmask16 = if lanes[p] == PANEL {
            0xFFFF
        } else {
            (1u16 << lanes[p]) - 1
        };
        for (t, &v) in f[p].iter().enumerate() {
            // SAFETY: the caller guarantees `lanes[p]` writable values at panel p's columns of
            // out + t * ld for t < T; the mask writes only those.
            unsafe { _mm512_mask_storeu_ps(out.add(t * ld + p * PANEL), mask, v) };
        }
    }
}
