//! AVX2 kernels of the int8 products of [`super`], the 256-bit form of [`super::vnni`]: each
//! 16-row panel is read as two halves of eight rows, and each 4-byte group of codes is
//! multiplied with the token's four codes broadcast to every lane, by `vpdpbusd` where the CPU
//! has AVX-VNNI, else by `vpmaddubsw` and `vpmaddwd` (AVX2 only: AMD Zen 3).
//!
//! Without VNNI the integer sums stay exact: `vpmaddubsw` adds two products of a code and an
//! activation code (|x| ≤ 127) into 16 bits, saturating, so the pair sums are added in 16 bits
//! only as far as they cannot reach 32,767, then widened by `vpmaddwd`. Nibbles (≤ 15) give
//! pair sums of at most 3,810: a block's eight groups add up in 16 bits (≤ 30,480). Five-bit
//! codes (≤ 31, at most 7,874 per pair sum) add four groups (≤ 31,496), each half of the block
//! widened apart; Q6_K's six-bit codes (≤ 63, 16,002) two groups (32,004). Q8_0's codes, stored
//! offset by 128, are taken back to signed and multiplied as `|w|` times `x` with `w`'s sign
//! (pair sums at most 2 · 128 · 127 = 32,512), each group widened, which gives `Σ w x`, the same
//! integer the offset form gives after its `128 Σ x_q` correction. So every path gives the
//! portable path's bits.
//!
//! The activations' quantization ([`quantize`]) has its AVX2 form here too, for both paths.

use super::{PANEL, RowsView, Sums, form};
use std::arch::x86_64::*;

/// Tokens of one register tile (sixteen registers hold the eight groups of codes, the tile's
/// accumulators and the scales).
const TOKENS: usize = 4;

/// `out[t * ld + i] = Σ_b …` for the `x.tokens` tokens of `x` and the first `lanes` rows of
/// one repacked panel of form `f` (see [`crate::int8gemm`]), with `vpdpbusd` on 256 bits if
/// `VNNI`, else `vpmaddubsw`/`vpmaddwd`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and AVX-VNNI if `VNNI`; `panel` must hold `x.cols / 32`
/// panel blocks of form `f`; `x.tokens` must be 1 to 8 with `x`'s slices holding that
/// many rows; `out` must be valid for writes of `lanes <= 16` values at each of
/// `out + t * ld`, `t < x.tokens`, that no other thread accesses meanwhile.
pub unsafe fn panel<const VNNI: bool>(
    f: u8,
    panel: &[u8],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    let mut t0 = 0;
    while t0 < x.tokens {
        let t1 = (t0 + TOKENS).min(x.tokens);
        let xs = x.slice(t0, t1);
        // SAFETY: the caller's guarantees, for tokens t0..t1 of x and their rows of out.
        unsafe {
            let o = out.add(t0 * ld);
            match t1 - t0 {
                1 => forms::<1, VNNI>(f, panel, xs, o, ld, lanes),
                2 => forms::<2, VNNI>(f, panel, xs, o, ld, lanes),
                3 => forms::<3, VNNI>(f, panel, xs, o, ld, lanes),
                4 => forms::<4, VNNI>(f, panel, xs, o, ld, lanes),
                _ => unreachable!("1 to {TOKENS} tokens"),
            }
        }
        t0 = t1;
    }
}

/// Quantizes 32-value blocks exactly as `int8gemm::quantize_portable` does (same codes,
/// scales and sums, bit for bit): the largest magnitude and the integer sum are exact in any
/// order, the scale and its inverse are the same scalar operations, and `vcvtps2dq` rounds to
/// nearest, ties to even (the default MXCSR mode) as `round_ties_even` does.
///
/// # Safety
/// The CPU must have AVX2; `q` must hold as many values as `x` (a multiple of 32), and each of
/// `s`'s slices one value per block.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize(x: &[f32], q: &mut [i8], s: Sums<'_>) {
    let nb = x.len() / 32;
    assert!(
        q.len() >= nb * 32
            && s.d.len() >= nb
            && s.sum.len() >= nb
            && s.qsum.len() >= nb
            && s.qlo.len() >= nb
    );
    // The eight 32-bit lanes' sum.
    let hsum = |v: __m256i| {
        let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v)))
    };
    let sign = _mm256_set1_ps(-0.0);
    // packs works within 128-bit halves: this gathers their 4-byte groups back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nb {
        // SAFETY: block b < nb: its 32 values are inside x and its 32 codes inside q (the
        // assert above); unaligned loads and stores accept any address.
        unsafe {
            let xp = x.as_ptr().add(b * 32);
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xp.add(8 * i)));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            s.d[b] = amax / 127.0;
            let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let c: [__m256i; 4] =
                std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(c[0], c[1]),
                _mm256_packs_epi32(c[2], c[3]),
            );
            let qp = q.as_mut_ptr().add(b * 32) as *mut __m256i;
            _mm256_storeu_si256(qp, _mm256_permutevar8x32_epi32(bytes, order));
            s.qlo[b] = hsum(_mm256_add_epi32(c[0], c[1]));
            s.qsum[b] = s.qlo[b] + hsum(_mm256_add_epi32(c[2], c[3]));
            s.sum[b] = s.d[b] * s.qsum[b] as f32;
        }
    }
}

/// The kernel for `T` tokens and the form `f` on the path `VNNI` names.
///
/// # Safety
/// As [`panel`], with `x.tokens == T`.
#[inline]
unsafe fn forms<const T: usize, const VNNI: bool>(
    f: u8,
    panel: &[u8],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    macro_rules! go {
        ($($f:ident)*) => {
            match f {
                $(form::$f if VNNI => with_vnni::tile::<T, { form::$f }>(panel, x, out, ld, lanes),
                form::$f => plain::tile::<T, { form::$f }>(panel, x, out, ld, lanes),)*
                _ => unreachable!("panel form {f}"),
            }
        };
    }
    // SAFETY: the caller's guarantees, passed on with the form they name; the CPU has
    // AVX-VNNI if VNNI.
    unsafe { go!(NIB_MIN NIB_OFF BYTE_MIN BYTE_OFF SIGNED HALVES) }
}

/// The kernels, compiled once per target-feature set: every function of a set is inlined
/// into the others, which needs the same features on all of them.
macro_rules! kernels {
    ($m:ident, $vnni:literal, $feat:meta) => {
        /// The kernels compiled with the features this module's name says.
        mod $m {
            use super::*;

            /// The integer sums `Σ (q - o) x_q` of one token's block against one half-panel's
            /// eight rows, over the whole block, or for Q6_K over its two halves (the second
            /// value; 0 for the other forms): `w` holds the block's eight code groups (nibbles:
            /// four low groups then four high; Q8_0: signed, their magnitudes in `wabs` for the
            /// AVX2 form), `xq` the token's 32 codes as eight 4-byte groups, `qsum` and `qlo`
            /// the sums of its 32 and of its first 16 codes.
            ///
            /// # Safety
            /// The CPU must have AVX2, and AVX-VNNI if `VNNI`; `xq` must point at 32 readable
            /// codes.
            #[inline]
            #[$feat]
            unsafe fn block_sum<const F: u8>(
                w: &[__m256i; 8],
                wabs: &[__m256i; 8],
                xq: *const i32,
                qsum: i32,
                qlo: i32,
            ) -> (__m256i, __m256i) {
                // SAFETY: g < 8: inside the token's block of 32 codes (the contract); the callers
                // are compiled with AVX2 (and AVX-VNNI when VNNI: only that set runs vpdpbusd).
                unsafe {
                    let off = form::offset(F);
                    let xg = |g: usize| _mm256_set1_epi32(xq.add(g).read_unaligned());
                    let ones = _mm256_set1_epi16(1);
                    let mb = |g: usize| _mm256_maddubs_epi16(w[g], xg(g));
                    let wide = |s: __m256i| _mm256_madd_epi16(s, ones);
                    if F == form::HALVES {
                        let mut lo = _mm256_set1_epi32(-off * qlo);
                        let mut hi = _mm256_set1_epi32(-off * (qsum - qlo));
                        if $vnni {
                            for g in 0..4 {
                                // Only the AVX-VNNI set ($vnni true) runs this.
                                lo = _mm256_dpbusd_avx_epi32(lo, w[g], xg(g));
                                hi = _mm256_dpbusd_avx_epi32(hi, w[g + 4], xg(g + 4));
                            }
                        } else {
                            // Six-bit codes: two groups per 16-bit sum.
                            for g in [0, 2] {
                                lo = _mm256_add_epi32(lo, wide(_mm256_add_epi16(mb(g), mb(g + 1))));
                                let (a, b) = (mb(g + 4), mb(g + 5));
                                hi = _mm256_add_epi32(hi, wide(_mm256_add_epi16(a, b)));
                            }
                        }
                        return (lo, hi);
                    }
                    let zero = _mm256_setzero_si256();
                    let mut acc = _mm256_set1_epi32(-off * qsum);
                    if $vnni {
                        for (g, &wg) in w.iter().enumerate() {
                            // Only the AVX-VNNI set ($vnni true) runs this.
                            acc = _mm256_dpbusd_avx_epi32(acc, wg, xg(g));
                        }
                    } else if form::nibbles(F) {
                        let mut s = mb(0);
                        for g in 1..8 {
                            s = _mm256_add_epi16(s, mb(g));
                        }
                        acc = _mm256_add_epi32(acc, wide(s));
                    } else if F == form::SIGNED {
                        acc = zero;
                        for g in 0..8 {
                            let p = _mm256_maddubs_epi16(wabs[g], _mm256_sign_epi8(xg(g), w[g]));
                            acc = _mm256_add_epi32(acc, wide(p));
                        }
                    } else {
                        // Five-bit codes: four groups per 16-bit sum.
                        for h in [0, 4] {
                            let s = _mm256_add_epi16(
                                _mm256_add_epi16(mb(h), mb(h + 1)),
                                _mm256_add_epi16(mb(h + 2), mb(h + 3)),
                            );
                            acc = _mm256_add_epi32(acc, wide(s));
                        }
                    }
                    (acc, zero)
                }
            }

            /// [`panel`] for exactly `T` tokens and the form `F`: each half-panel of eight rows
            /// in turn, the token tile's accumulators in registers.
            ///
            /// # Safety
            /// As [`panel`], with `x.tokens == T` and a panel of form `F`; called only from
            /// functions compiled with AVX2, FMA and F16C (and AVX-VNNI if `VNNI`).
            #[$feat]
            pub unsafe fn tile<const T: usize, const F: u8>(
                panel: &[u8],
                x: RowsView<'_>,
                out: *mut f32,
                ld: usize,
                lanes: usize,
            ) {
                let nb = x.cols / 32;
                let pb = form::block_bytes(F);
                assert!(
                    x.tokens == T
                        && panel.len() >= nb * pb
                        && x.q.len() >= T * x.cols
                        && x.d.len() >= T * nb
                        && x.sum.len() >= T * nb
                        && x.qsum.len() >= T * nb
                        && x.qlo.len() >= T * nb
                        && lanes <= PANEL,
                    "int8gemm::avx2::tile: bad sizes"
                );
                for h in 0..PANEL / 8 {
                    if 8 * h >= lanes {
                        break;
                    }
                    let mut f = [_mm256_setzero_ps(); T];
                    for b in 0..nb {
                        // Block b < nb of the panel is inside `panel` (asserted above): its code
                        // groups of 64 bytes (this half's 32 at 32 h), its 16 f32 scales and, if
                        // the form has them, 16 second parameters (this half's 8 at 32 h bytes in).
                        let blk = panel[b * pb..].as_ptr();
                        // SAFETY: `blk` points at one whole panel block (above).
                        let (w, wabs, dw, second) = unsafe { load_half::<F>(blk, h) };
                        for (t, f) in f.iter_mut().enumerate() {
                            let p = t * nb + b;
                            // SAFETY: token t < T of x holds x.cols >= 32 (b + 1) codes, and x's
                            // parameter slices T · nb > p values each (asserted above): no bounds
                            // checks in the loop.
                            let (acc, hi, xd, xsum) = unsafe {
                                let xq = x.q.as_ptr().add(t * x.cols + b * 32) as *const i32;
                                let (qsum, qlo) = (*x.qsum.as_ptr().add(p), *x.qlo.as_ptr().add(p));
                                let (acc, hi) = block_sum::<F>(&w, &wabs, xq, qsum, qlo);
                                (acc, hi, *x.d.as_ptr().add(p), *x.sum.as_ptr().add(p))
                            };
                            let xd = _mm256_set1_ps(xd);
                            *f =
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(dw, xd), *f);
                            if F == form::HALVES {
                                let sd = _mm256_mul_ps(second, xd);
                                *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), sd, *f);
                            } else if form::mins(F) {
                                *f = _mm256_fmadd_ps(second, _mm256_set1_ps(xsum), *f);
                            }
                        }
                    }
                    let n = (lanes - 8 * h).min(8);
                    let keep = _mm256_cmpgt_epi32(
                        _mm256_set1_epi32(n as i32),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    );
                    for (t, &f) in f.iter().enumerate() {
                        // SAFETY: the caller guarantees `lanes` writable values at out + t * ld for
                        // t < T; the mask writes only lanes 8 h..8 h + n of them.
                        unsafe { _mm256_maskstore_ps(out.add(t * ld + 8 * h), keep, f) };
                    }
                }
            }

            /// One panel block's codes, scales and second parameters for half `h` (rows
            /// 8 h..8 h + 8), as [`block_sum`] takes them.
            ///
            /// # Safety
            /// `o` must point at one whole panel block of the form `F`; called only from
            /// functions compiled with AVX2.
            #[inline]
            #[$feat]
            unsafe fn load_half<const F: u8>(
                o: *const u8,
                h: usize,
            ) -> ([__m256i; 8], [__m256i; 8], __m256, __m256) {
                let qb = form::code_bytes(F);
                let mut w = [_mm256_setzero_si256(); 8];
                let mut wabs = [_mm256_setzero_si256(); 8];
                // SAFETY: every load is inside the panel block (the contract): code group g's 64
                // bytes at 64 g, then PANEL f32 scales and (if the form has them) PANEL second
                // parameters.
                unsafe {
                    let ld =
                        |g: usize| _mm256_loadu_si256(o.add(64 * g + 32 * h) as *const __m256i);
                    if form::nibbles(F) {
                        let nibble = _mm256_set1_epi8(0x0F);
                        for j in 0..4 {
                            let z = ld(j);
                            w[j] = _mm256_and_si256(z, nibble);
                            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(z), nibble);
                        }
                    } else {
                        let flip = _mm256_set1_epi8(-128);
                        for g in 0..8 {
                            if $vnni || F != form::SIGNED {
                                w[g] = ld(g);
                            } else {
                                w[g] = _mm256_xor_si256(ld(g), flip);
                                wabs[g] = _mm256_abs_epi8(w[g]);
                            }
                        }
                    }
                    let s = o.add(PANEL * qb) as *const f32;
                    let dw = _mm256_loadu_ps(s.add(8 * h));
                    let second = if form::has_second(F) {
                        _mm256_loadu_ps(s.add(PANEL + 8 * h))
                    } else {
                        _mm256_setzero_ps()
                    };
                    (w, wabs, dw, second)
                }
            }
        }
    };
}

kernels!(plain, false, target_feature(enable = "avx2,fma"));
kernels!(with_vnni, true, target_feature(enable = "avx2,fma,avxvnni"));

/// `o[i] += v · w[i]`, multiplied then added as the portable loop does (the compiler does not
/// fuse them), in vectors.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn add_scaled(o: &mut [f32], v: f32, w: &[f32]) {
    for (o, &wv) in o.iter_mut().zip(w) {
        *o += v * wv;
    }
}
