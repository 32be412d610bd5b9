//! AVX2 kernels of the int8 products of [`super`], the 256-bit form of [`super::vnni`]: each
//! 16-row panel is read as two halves of eight rows, and each 4-byte group of codes is
//! multiplied with the token's four codes broadcast to every lane, by `vpdpbusd` where the CPU
//! has AVX-VNNI, else by `vpmaddubsw` and `vpmaddwd` (AVX2 only: AMD Zen 3).
//!
//! Without VNNI the integer sums stay exact: a Q4_1 nibble (≤ 15) times a code (|x| ≤ 127)
//! leaves `vpmaddubsw`'s 16-bit pair sums at most 3,810, so the eight groups of a block add up
//! in 16 bits (≤ 30,480) before one `vpmaddwd` widens them; Q8_0's codes, stored offset by 128,
//! are taken back to signed and multiplied as `|w|` times `x` with `w`'s sign (pair sums at most
//! 2 · 128 · 127 = 32,512), which gives `Σ w x`, the same integer the offset form gives after
//! its `128 Σ x_q` correction. So every path gives the portable path's bits.
//!
//! The activations' quantization ([`quantize`]) has its AVX2 form here too, for both paths.

use super::{PANEL, RowsView};
use std::arch::x86_64::*;

/// Tokens of one register tile (sixteen registers hold the eight groups of codes, the tile's
/// accumulators and the scales).
const TOKENS: usize = 4;

/// `out[t * ld + i] = Σ_b …` for the `x.tokens` tokens of `x` and the first `lanes` rows of
/// one repacked panel (see [`crate::int8gemm`]), with `vpdpbusd` on 256 bits if `VNNI`, else
/// `vpmaddubsw`/`vpmaddwd`.
///
/// # Safety
/// The CPU must have AVX2 and F16C, and AVX-VNNI if `VNNI`; `panel` must hold `x.cols / 32`
/// panel blocks of the kind `q4` says; `x.tokens` must be 1 to 8 with `x`'s slices holding that
/// many rows; `out` must be valid for writes of `lanes <= 16` values at each of
/// `out + t * ld`, `t < x.tokens`, that no other thread accesses meanwhile.
pub unsafe fn panel<const VNNI: bool>(
    q4: bool,
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
            macro_rules! go {
                ($($t:literal)*) => {
                    match (t1 - t0, q4) {
                        $(($t, true) => dispatch::<$t, true, VNNI>(panel, xs, o, ld, lanes),
                        ($t, false) => dispatch::<$t, false, VNNI>(panel, xs, o, ld, lanes),)*
                        _ => unreachable!("1 to {TOKENS} tokens"),
                    }
                };
            }
            go!(1 2 3 4)
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
/// The CPU must have AVX2; `q` must hold as many values as `x` (a multiple of 32), and `d`,
/// `sum`, `qsum` one per block.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [f32], qsum: &mut [i32]) {
    let nb = x.len() / 32;
    assert!(q.len() >= nb * 32 && d.len() >= nb && sum.len() >= nb && qsum.len() >= nb);
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
            d[b] = amax / 127.0;
            let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let c: [__m256i; 4] =
                std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(c[0], c[1]),
                _mm256_packs_epi32(c[2], c[3]),
            );
            let qp = q.as_mut_ptr().add(b * 32) as *mut __m256i;
            _mm256_storeu_si256(qp, _mm256_permutevar8x32_epi32(bytes, order));
            let s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            qsum[b] = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
            sum[b] = d[b] * qsum[b] as f32;
        }
    }
}

/// The kernel for `T` tokens on the path `VNNI` names.
///
/// # Safety
/// As [`panel`], with `x.tokens == T`.
#[inline]
unsafe fn dispatch<const T: usize, const Q4: bool, const VNNI: bool>(
    panel: &[u8],
    x: RowsView<'_>,
    out: *mut f32,
    ld: usize,
    lanes: usize,
) {
    // SAFETY: the caller's guarantees, passed on; the CPU has AVX-VNNI if VNNI.
    unsafe {
        if VNNI {
            with_vnni::tile::<T, Q4>(panel, x, out, ld, lanes)
        } else {
            plain::tile::<T, Q4>(panel, x, out, ld, lanes)
        }
    }
}

/// The kernels, compiled once per target-feature set: every function of a set is inlined
/// into the others, which needs the same features on all of them.
macro_rules! kernels {
    ($m:ident, $vnni:literal, $feat:meta) => {
        /// The kernels compiled with the features this module's name says.
        mod $m {
            use super::*;

            /// The integer sum of one token's block against one half-panel's eight rows: `w` holds
            /// the block's code groups (Q4_1: four low-nibble groups then four high; Q8_0: eight
            /// groups, the codes signed, their magnitudes in `wabs` for the AVX2 form), `xq` the
            /// token's 32 codes as eight 4-byte groups, `qsum` their sum.
            ///
            /// # Safety
            /// The CPU must have AVX2, and AVX-VNNI if `VNNI`; `xq` must point at 32 readable
            /// codes.
            #[inline]
            #[$feat]
            unsafe fn block_sum<const Q4: bool>(
                w: &[__m256i; 8],
                wabs: &[__m256i; 8],
                xq: *const i32,
                qsum: i32,
            ) -> __m256i {
                // SAFETY: g < 8: inside the token's block of 32 codes (the contract); the callers
                // are compiled with AVX2 (and AVX-VNNI when VNNI).
                unsafe {
                    let xg = |g: usize| _mm256_set1_epi32(xq.add(g).read_unaligned());
                    if $vnni {
                        let mut acc = if Q4 {
                            _mm256_setzero_si256()
                        } else {
                            _mm256_set1_epi32(-128 * qsum)
                        };
                        for (g, &wg) in w.iter().enumerate() {
                            // Only the AVX-VNNI set ($vnni true) runs this.
                            acc = _mm256_dpbusd_avx_epi32(acc, wg, xg(g));
                        }
                        acc
                    } else if Q4 {
                        let mut s = _mm256_maddubs_epi16(w[0], xg(0));
                        for (g, &wg) in w.iter().enumerate().skip(1) {
                            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(wg, xg(g)));
                        }
                        _mm256_madd_epi16(s, _mm256_set1_epi16(1))
                    } else {
                        let ones = _mm256_set1_epi16(1);
                        let mut acc = _mm256_setzero_si256();
                        for g in 0..8 {
                            let p = _mm256_maddubs_epi16(wabs[g], _mm256_sign_epi8(xg(g), w[g]));
                            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
                        }
                        acc
                    }
                }
            }

            /// [`panel`] for exactly `T` tokens: each half-panel of eight rows in turn, the token
            /// tile's accumulators in registers.
            ///
            /// # Safety
            /// As [`panel`], with `x.tokens == T`; called only from functions compiled with AVX2,
            /// FMA and F16C (and AVX-VNNI if `VNNI`).
            #[$feat]
            pub unsafe fn tile<const T: usize, const Q4: bool>(
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
                    "int8gemm::avx2::tile: bad sizes"
                );
                for h in 0..PANEL / 8 {
                    if 8 * h >= lanes {
                        break;
                    }
                    let mut f = [_mm256_setzero_ps(); T];
                    for b in 0..nb {
                        // Block b < nb of the panel is inside `panel` (asserted above): its code
                        // groups of 64 bytes (this half's 32 at 32 h), its 16 f16 scales and, for
                        // Q4_1, 16 f16 minimums (this half's 8 at 16 h bytes in).
                        let blk = panel[b * pb..].as_ptr();
                        // SAFETY: `blk` points at one whole panel block (above).
                        let (w, wabs, dw, mw) = unsafe { load_half::<Q4>(blk, h) };
                        for (t, f) in f.iter_mut().enumerate() {
                            let p = t * nb + b;
                            // SAFETY: token t < T of x holds x.cols >= 32 (b + 1) codes (asserted
                            // above).
                            let acc = unsafe {
                                let xq = x.q.as_ptr().add(t * x.cols + b * 32) as *const i32;
                                block_sum::<Q4>(&w, &wabs, xq, x.qsum[p])
                            };
                            let sd = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[p]));
                            *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), sd, *f);
                            if Q4 {
                                *f = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.sum[p]), *f);
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

            /// One panel block's codes, scales and minimums for half `h` (rows 8 h..8 h + 8), as
            /// [`block_sum`] takes them.
            ///
            /// # Safety
            /// `o` must point at one whole panel block of the kind `Q4` says; called only from
            /// functions compiled with AVX2 and F16C.
            #[inline]
            #[$feat]
            unsafe fn load_half<const Q4: bool>(
                o: *const u8,
                h: usize,
            ) -> ([__m256i; 8], [__m256i; 8], __m256, __m256) {
                let qb = if Q4 { 16 } else { 32 };
                let mut w = [_mm256_setzero_si256(); 8];
                let mut wabs = [_mm256_setzero_si256(); 8];
                // SAFETY: every load is inside the panel block (the contract): code group g's 64
                // bytes at 64 g, then PANEL f16 scales and (Q4_1) PANEL f16 minimums.
                unsafe {
                    let ld =
                        |g: usize| _mm256_loadu_si256(o.add(64 * g + 32 * h) as *const __m256i);
                    if Q4 {
                        let nibble = _mm256_set1_epi8(0x0F);
                        for j in 0..4 {
                            let z = ld(j);
                            w[j] = _mm256_and_si256(z, nibble);
                            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(z), nibble);
                        }
                    } else {
                        let flip = _mm256_set1_epi8(-128);
                        for g in 0..8 {
                            if $vnni {
                                w[g] = ld(g);
                            } else {
                                w[g] = _mm256_xor_si256(ld(g), flip);
                                wabs[g] = _mm256_abs_epi8(w[g]);
                            }
                        }
                    }
                    let s = o.add(PANEL * qb + 16 * h);
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(s as *const __m128i));
                    let mw = if Q4 {
                        _mm256_cvtph_ps(_mm_loadu_si128(s.add(32) as *const __m128i))
                    } else {
                        _mm256_setzero_ps()
                    };
                    (w, wabs, dw, mw)
                }
            }
        }
    };
}

kernels!(plain, false, target_feature(enable = "avx2,fma,f16c"));
kernels!(
    with_vnni,
    true,
    target_feature(enable = "avx2,fma,f16c,avxvnni")
);
