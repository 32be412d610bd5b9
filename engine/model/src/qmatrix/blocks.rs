//! The block formats held as the file stores them (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): their
//! layouts, and the portable decode, dot products and dequantization every SIMD path is checked
//! against (after the f64 oracle, [`super::oracle`], checks these).
//!
//! Every format decodes to one shape: signed codes, a scale per 16 values and an offset per 32,
//! `w[j] = scale[j / 16] · code[j] + min[j / 32]`. The formats differ only in how they pack it:
//!
//! - Q4_0 (18 bytes per 32): f16 `d`, 16 bytes of nibbles (byte `j`: value `j` low, `j + 16`
//!   high); code `q - 8`, scale `d`, no offset.
//! - Q5_0 (22 bytes per 32): f16 `d`, a little-endian u32 `qh` whose bit `j` is value `j`'s
//!   fifth bit, nibbles as Q4_0; code `q - 16`, scale `d`.
//! - Q5_1 (24 bytes per 32): f16 `d`, f16 `m`, `qh`, nibbles; code `q`, scale `d`, offset `m`.
//! - Q4_K (144 bytes per 256): f16 `d`, f16 `dmin`, 12 bytes of eight 6-bit sub-block scales
//!   `sc` and mins `mn` (bytes 0-3: `sc[0..4]` in the low 6 bits, the top 2 bits of `sc[4..8]`
//!   above; bytes 4-7: the same for `mn`; bytes 8-11: the low 4 bits of `sc[4..8]` low and of
//!   `mn[4..8]` high), 128 bytes of nibbles: sub-blocks `2k` and `2k + 1` are the low and the
//!   high nibbles of bytes `32k..32k + 32`; code `q`, scale `d · sc`, offset `-dmin · mn`.
//! - Q5_K (176 bytes per 256): as Q4_K with 32 bytes `qh` before the nibbles, whose byte `l`
//!   bit `s` is the fifth bit of value `l` of sub-block `s`.
//! - Q6_K (210 bytes per 256): 128 bytes `ql`, 64 bytes `qh`, sixteen i8 scales, f16 `d` last.
//!   Each half `h` (128 values) takes `ql[64h..64h + 64]` and `qh[32h..32h + 32]`: its groups of
//!   32 are the low nibbles of `ql[0..32]`, of `ql[32..64]`, then the high nibbles of the same,
//!   their two high bits bits `2g, 2g + 1` of `qh[l]`; code `q - 32`, scale `d · scales[j/16]`.

use super::Kind;
use half::f16;

/// Values of a K-quant super-block.
pub const SUPER: usize = 256;

/// One block decoded: `value[j] = scales[j / 16] · codes[j] + mins[j / 32]` for the block's
/// `kind.block_values()` values.
pub(crate) struct Decoded {
    pub codes: [i8; SUPER],
    pub scales: [f32; SUPER / 16],
    pub mins: [f32; SUPER / 32],
}

impl Default for Decoded {
    fn default() -> Self {
        Self {
            codes: [0; SUPER],
            scales: [0.0; SUPER / 16],
            mins: [0.0; SUPER / 32],
        }
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Sub-block `j`'s 6-bit scale and min from a Q4_K/Q5_K 12-byte scale field.
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The nibbles and fifth bits of a Q5_0/Q5_1 block (`qh` at `h`, nibbles at `h + 4`) as codes
/// `q - offset`.
fn five_bit(b: &[u8], h: usize, offset: i8, codes: &mut [i8]) {
    let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
    for j in 0..16 {
        let q = b[h + 4 + j];
        let lo = (q & 0xF) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        codes[j] = lo as i8 - offset;
        codes[j + 16] = hi as i8 - offset;
    }
}

/// Decodes one block of `kind` (one of the formats of this module) from its bytes.
pub(crate) fn decode(kind: Kind, b: &[u8], out: &mut Decoded) {
    match kind {
        Kind::Q4_0 => {
            for j in 0..16 {
                out.codes[j] = (b[2 + j] & 0xF) as i8 - 8;
                out.codes[j + 16] = (b[2 + j] >> 4) as i8 - 8;
            }
            out.scales[..2].fill(half(b, 0));
            out.mins[0] = 0.0;
        }
        Kind::Q5_0 => {
            five_bit(b, 2, 16, &mut out.codes);
            out.scales[..2].fill(half(b, 0));
            out.mins[0] = 0.0;
        }
        Kind::Q5_1 => {
            five_bit(b, 4, 0, &mut out.codes);
            out.scales[..2].fill(half(b, 0));
            out.mins[0] = half(b, 2);
        }
        Kind::Q4_K | Kind::Q5_K => {
            let (d, dmin) = (half(b, 0), half(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if kind == Kind::Q5_K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for s in 0..8 {
                let (sc, mn) = scale_min_k4(s, scales);
                out.scales[2 * s] = d * f32::from(sc);
                out.scales[2 * s + 1] = d * f32::from(sc);
                out.mins[s] = -(dmin * f32::from(mn));
                let bytes = &qs[32 * (s / 2)..32 * (s / 2) + 32];
                for l in 0..32 {
                    let nib = if s % 2 == 0 {
                        bytes[l] & 0xF
                    } else {
                        bytes[l] >> 4
                    };
                    let high = qh.map_or(0, |h| ((h[l] >> s) & 1) << 4);
                    out.codes[32 * s + l] = (nib | high) as i8;
                }
            }
        }
        Kind::Q6_K => {
            let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
            let d = half(b, 208);
            for h in 0..2 {
                let (ql, qh) = (&ql[64 * h..64 * h + 64], &qh[32 * h..32 * h + 32]);
                for g in 0..4 {
                    let src = &ql[32 * (g % 2)..32 * (g % 2) + 32];
                    for l in 0..32 {
                        let nib = if g < 2 { src[l] & 0xF } else { src[l] >> 4 };
                        let q = nib | (((qh[l] >> (2 * g)) & 3) << 4);
                        out.codes[128 * h + 32 * g + l] = q as i8 - 32;
                    }
                }
            }
            for (s, &v) in out.scales.iter_mut().zip(sc) {
                *s = d * f32::from(v as i8);
            }
            out.mins.fill(0.0);
        }
        Kind::Q4_1 | Kind::Q8_0 | Kind::F32 => unreachable!("{kind:?} is not held as raw blocks"),
    }
}

/// Dequantizes a row of whole blocks of `kind` into `out` (`scale · code + min`, one multiply
/// and one add per value).
pub(crate) fn dequant_row(kind: Kind, row: &[u8], out: &mut [f32]) {
    let (vals, bytes) = (kind.block_values(), kind.block_bytes());
    let mut dec = Decoded::default();
    for (b, o) in row.chunks_exact(bytes).zip(out.chunks_exact_mut(vals)) {
        decode(kind, b, &mut dec);
        for (j, o) in o.iter_mut().enumerate() {
            *o = dec.scales[j / 16] * f32::from(dec.codes[j]) + dec.mins[j / 32];
        }
    }
}

/// `Σ w x` over a row of whole blocks of `kind`, with `xsum` the activations' sum per 32 values:
/// per 16 values `Σ code · x`, scaled, then the offsets `Σ min · xsum`.
pub(crate) fn dot_row(kind: Kind, row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let (vals, bytes) = (kind.block_values(), kind.block_bytes());
    let mut dec = Decoded::default();
    let mut acc = 0.0f32;
    for (i, b) in row.chunks_exact(bytes).enumerate() {
        decode(kind, b, &mut dec);
        let xb = &x[i * vals..(i + 1) * vals];
        for (g, xg) in xb.chunks_exact(16).enumerate() {
            let p: f32 = dec.codes[16 * g..16 * g + 16]
                .iter()
                .zip(xg)
                .map(|(&c, &v)| f32::from(c) * v)
                .sum();
            acc += dec.scales[g] * p;
        }
        if kind.has_mins() {
            for (k, &s) in xsum[i * vals / 32..(i + 1) * vals / 32].iter().enumerate() {
                acc += dec.mins[k] * s;
            }
        }
    }
    acc
}

/// [`dot_row`] with the activations quantized per 32 values (`x ≈ dx · xq`): integer sums per
/// 16 values times `scale · dx`, the offsets with the exact f32 sums `xsum`.
pub(crate) fn dot_row_q8(kind: Kind, row: &[u8], xq: &[i8], dx: &[f32], xsum: &[f32]) -> f32 {
    let (vals, bytes) = (kind.block_values(), kind.block_bytes());
    let mut dec = Decoded::default();
    let mut acc = 0.0f32;
    for (i, b) in row.chunks_exact(bytes).enumerate() {
        decode(kind, b, &mut dec);
        let xb = &xq[i * vals..(i + 1) * vals];
        for (g, xg) in xb.chunks_exact(16).enumerate() {
            let s: i32 = dec.codes[16 * g..16 * g + 16]
                .iter()
                .zip(xg)
                .map(|(&c, &v)| i32::from(c) * i32::from(v))
                .sum();
            acc += dec.scales[g] * dx[(i * vals + 16 * g) / 32] * s as f32;
        }
        if kind.has_mins() {
            for (k, &s) in xsum[i * vals / 32..(i + 1) * vals / 32].iter().enumerate() {
                acc += dec.mins[k] * s;
            }
        }
    }
    acc
}

/// The value at index `j` of a row of whole blocks of `kind`: the one value of [`decode`],
/// `scale · code + min` with the same f32 operations, decoded alone (the int8 products' shadow
/// columns read a few values of every row).
pub(crate) fn value(kind: Kind, row: &[u8], j: usize) -> f32 {
    let (vals, bytes) = (kind.block_values(), kind.block_bytes());
    let b = &row[j / vals * bytes..(j / vals + 1) * bytes];
    let k = j % vals;
    // A legacy block's nibble and fifth bit (`qh` at `h`, nibbles after it).
    let nib = |at: usize| {
        let q = b[at + k % 16];
        if k < 16 { q & 0xF } else { q >> 4 }
    };
    let bit5 = |h: usize| (((b[h + k / 8] >> (k % 8)) & 1) << 4) as i8;
    let (scale, code, min) = match kind {
        Kind::Q4_0 => (half(b, 0), nib(2) as i8 - 8, 0.0),
        Kind::Q5_0 => (half(b, 0), (nib(6) as i8 | bit5(2)) - 16, 0.0),
        Kind::Q5_1 => (half(b, 0), nib(8) as i8 | bit5(4), half(b, 2)),
        Kind::Q4_K | Kind::Q5_K => {
            let (s, l) = (k / 32, k % 32);
            let (sc, mn) = scale_min_k4(s, &b[4..16]);
            let qs = if kind == Kind::Q5_K { 48 } else { 16 };
            let byte = b[qs + 32 * (s / 2) + l];
            let n = if s % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let high = if kind == Kind::Q5_K {
                ((b[16 + l] >> s) & 1) << 4
            } else {
                0
            };
            let (d, dmin) = (half(b, 0), half(b, 2));
            (d * f32::from(sc), (n | high) as i8, -(dmin * f32::from(mn)))
        }
        Kind::Q6_K => {
            let (h, g, l) = (k / 128, k % 128 / 32, k % 32);
            let src = b[64 * h + 32 * (g % 2) + l];
            let n = if g < 2 { src & 0xF } else { src >> 4 };
            let q = n | (((b[128 + 32 * h + l] >> (2 * g)) & 3) << 4);
            (
                half(b, 208) * f32::from(b[192 + k / 16] as i8),
                q as i8 - 32,
                0.0,
            )
        }
        Kind::Q4_1 | Kind::Q8_0 | Kind::F32 => unreachable!("{kind:?} is not held as raw blocks"),
    };
    scale * f32::from(code) + min
}

/// A test generator's step (64-bit LCG, the top 31 bits).
#[cfg(test)]
pub(crate) fn lcg(s: &mut u64) -> u32 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*s >> 33) as u32
}

/// `n` blocks of `kind` with every code bit random and sane f16 scales (0.001..0.05) and
/// minimums (-0.5..0.5): every bit pattern of codes and 6-bit scales is reachable.
#[cfg(test)]
pub(crate) fn random_blocks(kind: Kind, n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    let bytes = kind.block_bytes();
    let mut raw: Vec<u8> = (0..n * bytes).map(|_| lcg(&mut s) as u8).collect();
    let halves: &[(usize, bool)] = match kind {
        Kind::Q4_0 | Kind::Q5_0 | Kind::Q8_0 => &[(0, false)],
        Kind::Q4_1 | Kind::Q5_1 => &[(0, false), (2, true)],
        Kind::Q4_K | Kind::Q5_K => &[(0, false), (2, false)],
        Kind::Q6_K => &[(208, false)],
        Kind::F32 => &[],
    };
    for b in raw.chunks_exact_mut(bytes) {
        for &(at, signed) in halves {
            let u = (lcg(&mut s) % 1000) as f32 / 1000.0;
            let v = if signed { u - 0.5 } else { 0.001 + u * 0.049 };
            b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    raw
}

/// Checks an int8-activation kernel over the file's blocks (`kernel(kind, raw, xq, dx, xsum,
/// out)`) against [`dot_row_q8`]: every format, over rows that take the four-row passes and the
/// one-row tail, rows of one, three and more blocks (and an odd block count), within rounding.
#[cfg(test)]
pub(crate) fn check_int8_rows(kernel: impl Fn(Kind, &[u8], &[i8], &[f32], &[f32], &mut [f32])) {
    for kind in tests::RAW {
        let vals = kind.block_values();
        for cols in [
            vals,
            3 * vals,
            640usize.next_multiple_of(vals),
            2048,
            32 * 21,
            // Two of the AVX2 kernel's 64-block segments, the second with a partial eight.
            32 * 75,
        ] {
            if !cols.is_multiple_of(vals) {
                continue;
            }
            let rows = 7;
            let raw = random_blocks(kind, rows * cols / vals, 11 + cols as u64);
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 37.0)
                .collect();
            let mut xq = vec![0i8; cols];
            let mut dx = vec![0f32; cols / 32];
            super::acts::quantize_acts_portable(&x, &mut xq, &mut dx);
            let xsum: Vec<f32> = x.chunks_exact(32).map(|b| b.iter().sum()).collect();
            let mut got = vec![f32::NAN; rows + 1];
            kernel(kind, &raw, &xq, &dx, &xsum, &mut got[..rows]);
            assert!(got[rows].is_nan(), "{kind:?} wrote past its rows");
            let rb = kind.bytes_of(cols);
            for r in 0..rows {
                let want = dot_row_q8(kind, &raw[r * rb..(r + 1) * rb], &xq, &dx, &xsum);
                let tol = 1e-4 * (1.0 + want.abs()) + 1e-5 * cols as f32;
                assert!(
                    (got[r] - want).abs() <= tol,
                    "{kind:?} cols {cols} row {r}: {} against {want}",
                    got[r]
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Activations, BLOCK, Isa, QMatrix, oracle, quantize};
    use super::*;

    /// The formats held as raw blocks, and every format the oracle knows.
    pub(super) const RAW: [Kind; 6] = [
        Kind::Q4_0,
        Kind::Q5_0,
        Kind::Q5_1,
        Kind::Q4_K,
        Kind::Q5_K,
        Kind::Q6_K,
    ];

    fn decoded(kind: Kind, raw: &[u8]) -> Vec<Decoded> {
        raw.chunks_exact(kind.block_bytes())
            .map(|b| {
                let mut d = Decoded::default();
                decode(kind, b, &mut d);
                d
            })
            .collect()
    }

    /// Per value, the magnitude `|scale · code| + |min|` its rounding errors scale with.
    fn magnitudes(kind: Kind, raw: &[u8]) -> Vec<f64> {
        let vals = kind.block_values();
        decoded(kind, raw)
            .iter()
            .flat_map(|d| {
                (0..vals).map(move |j| {
                    f64::from(
                        (d.scales[j / 16] * f32::from(d.codes[j])).abs() + d.mins[j / 32].abs(),
                    )
                })
            })
            .collect()
    }

    #[test]
    fn decoding_matches_the_oracle_value_for_value() {
        for kind in RAW {
            let raw = random_blocks(kind, 9, kind.block_bytes() as u64);
            let n = 9 * kind.block_values();
            let mut want = vec![0.0; n];
            oracle::dequant(kind, &raw, &mut want);
            let vals = kind.block_values();
            for (b, d) in decoded(kind, &raw).iter().enumerate() {
                for j in 0..vals {
                    // Scales and minimums are exact f32 products (at most 11 + 8 significant
                    // bits), so the decoded parts give the oracle's value to f64 rounding.
                    let (s, m) = (f64::from(d.scales[j / 16]), f64::from(d.mins[j / 32]));
                    let got = s * f64::from(d.codes[j]) + m;
                    let w = want[b * vals + j];
                    assert!(
                        (got - w).abs() <= 1e-12 * (1.0 + w.abs()),
                        "{kind:?} block {b} value {j}: {got} vs {w}"
                    );
                }
            }
            // f32 dequantization: one rounding of the product (Q6_K's may need 25 bits) and one
            // of the sum, each within u = EPSILON / 2 of what it rounds.
            let mut got = vec![0.0; n];
            dequant_row(kind, &raw, &mut got);
            let mag = magnitudes(kind, &raw);
            for j in 0..n {
                let bound = f64::from(f32::EPSILON) * (mag[j] + want[j].abs());
                assert!(
                    (f64::from(got[j]) - want[j]).abs() <= bound,
                    "{kind:?} {j}: {} vs {}",
                    got[j],
                    want[j]
                );
                assert!(value(kind, &raw, j) == got[j], "{kind:?} {j}: value alone");
            }
        }
    }

    /// candle's dequantization (its own reading of ggml's formats) agrees with the oracle: the
    /// layouts are ggml's, not only self-consistent.
    #[test]
    fn the_oracle_agrees_with_candle_on_every_format() {
        for kind in RAW.into_iter().chain([Kind::Q4_1, Kind::Q8_0]) {
            let n = 4 * 256;
            let raw = random_blocks(kind, n / kind.block_values(), 7);
            let t = candle_core::quantized::ggml_file::qtensor_from_ggml(
                kind.ggml(),
                &raw,
                vec![4, 256],
                &candle_core::Device::Cpu,
            )
            .and_then(|q| q.dequantize(&candle_core::Device::Cpu))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("candle dequantizes");
            let mut want = vec![0.0; n];
            oracle::dequant(kind, &raw, &mut want);
            let mag = magnitudes_any(kind, &raw, &want);
            for j in 0..n {
                // candle rounds in f32 up to three times (d·sc, ·q, − dmin·m).
                let bound = 2.0 * f64::from(f32::EPSILON) * (mag[j] + want[j].abs());
                assert!(
                    (f64::from(t[j]) - want[j]).abs() <= bound,
                    "{kind:?} {j}: candle {} vs {}",
                    t[j],
                    want[j]
                );
            }
        }
    }

    /// [`magnitudes`], for Q4_1 and Q8_0 too (their minimum bounds the cancellation).
    fn magnitudes_any(kind: Kind, raw: &[u8], want: &[f64]) -> Vec<f64> {
        if kind.is_raw() {
            return magnitudes(kind, raw);
        }
        let m: Vec<f64> = raw
            .chunks_exact(kind.block_bytes())
            .map(|b| match kind {
                Kind::Q4_1 => f64::from(f16::from_le_bytes([b[2], b[3]]).to_f32()).abs(),
                _ => 0.0,
            })
            .collect();
        want.iter()
            .enumerate()
            .map(|(j, w)| 2.0 * (w.abs() + m[j / BLOCK]))
            .collect()
    }

    #[test]
    fn each_quantizer_lands_within_half_a_step() {
        for kind in RAW.into_iter().chain([Kind::Q4_1, Kind::Q8_0]) {
            let mut s = 3;
            let n = 3 * 256;
            let x: Vec<f32> = (0..n)
                .map(|i| {
                    let v = (lcg(&mut s) % 20001) as f32 / 10000.0 - 1.0;
                    // One sub-block all positive, one with an outlier, one all zero.
                    match i / 32 {
                        2 => v.abs() + 0.5,
                        5 if i % 32 == 3 => 9.0,
                        7 => 0.0,
                        _ => v,
                    }
                })
                .collect();
            let raw = quantize::quantize(kind, &x);
            assert_eq!(raw.len(), kind.bytes_of(n), "{kind:?}");
            let mut w = vec![0.0; n];
            oracle::dequant(kind, &raw, &mut w);
            let step: Vec<f64> = if kind.is_raw() {
                decoded(kind, &raw)
                    .iter()
                    .flat_map(|d| {
                        (0..kind.block_values()).map(move |j| f64::from(d.scales[j / 16].abs()))
                    })
                    .collect()
            } else {
                raw.chunks_exact(kind.block_bytes())
                    .flat_map(|b| {
                        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                        std::iter::repeat_n(f64::from(d), BLOCK)
                    })
                    .collect()
            };
            for j in 0..n {
                // Half a step, and the f32 rounding of the shifted value before its code.
                let bound = step[j] * 0.5 * (1.0 + 1e-5) + 1e-6 * f64::from(x[j].abs());
                assert!(
                    (w[j] - f64::from(x[j])).abs() <= bound,
                    "{kind:?} {j}: {} vs {} (step {})",
                    w[j],
                    x[j],
                    step[j]
                );
            }
        }
    }

    /// Σ over a row of |w x| split as the kernels round it: `|scale · code · x| + |min · x|`.
    fn row_magnitude(m: &[f64], x: &[f32]) -> f64 {
        m.iter().zip(x).map(|(m, &x)| m * f64::from(x.abs())).sum()
    }

    fn check_products(kind: Kind, rows: usize, cols: usize, seed: u64) {
        let raw = random_blocks(kind, rows * cols / kind.block_values(), seed);
        let q = QMatrix::from_raw(rows, cols, kind, &raw);
        assert_eq!(q.bytes(), raw.len(), "{kind:?}: held as the file's bytes");
        let mut s = seed + 1;
        let mut x: Vec<f32> = (0..cols)
            .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        x[cols / 3] = 7.5;
        let mag = magnitudes(kind, &raw);
        let rb = kind.bytes_of(cols);
        let xq = super::super::quantize_acts(&x, false);
        for isa in Isa::all_available() {
            let mut got = vec![f32::NAN; rows + 1];
            q.matvec_with(isa, Activations::F32, &x, &mut got);
            assert!(got[rows].is_nan(), "{isa:?} wrote past the rows");
            let mut got8 = vec![0.0; rows];
            q.matvec_with(isa, Activations::Int8, &x, &mut got8);
            for r in 0..rows {
                let row = &raw[r * rb..(r + 1) * rb];
                let want = oracle::dot(kind, row, &x);
                // Every path sums the same terms in chains of at most 16 (a group) + cols / 16
                // (the groups) + cols / 32 (the offsets, whose Σx are 32-term sums) + 40
                // (lane reductions and the scale products) roundings, each within
                // u = EPSILON / 2 of the terms' magnitude.
                let n = (cols / 16 + cols / 32 + 56) as f64;
                let m = row_magnitude(&mag[r * cols..(r + 1) * cols], &x);
                let bound = n * f64::from(f32::EPSILON) / 2.0 * m;
                assert!(
                    (f64::from(got[r]) - want).abs() <= bound + 1e-6,
                    "{isa:?} {kind:?} {rows}x{cols} row {r}: {} vs {want} (bound {bound})",
                    got[r]
                );
                // int8 activations: each off by at most half its block's step.
                let mut w = vec![0.0; cols];
                oracle::dequant(kind, row, &mut w);
                let act: f64 = (0..cols)
                    .map(|c| w[c].abs() * f64::from(xq.d[c / BLOCK]) * 0.5)
                    .sum();
                assert!(
                    (f64::from(got8[r]) - want).abs() <= act * 1.001 + bound + 1e-6,
                    "{isa:?} {kind:?} int8 row {r}: {} vs {want} (bound {act})",
                    got8[r]
                );
                // And it is the product with the dequantized activations, up to float
                // rounding: the minimum terms take the codes' sums, not the exact ones.
                let (exact, mag8) = (0..cols).fold((0.0f64, 0.0f64), |(e, a), c| {
                    let xh = f64::from(xq.d[c / BLOCK]) * f64::from(xq.q[c]);
                    (e + w[c] * xh, a + mag[r * cols + c] * xh.abs())
                });
                let bound8 = n * f64::from(f32::EPSILON) / 2.0 * mag8;
                assert!(
                    (f64::from(got8[r]) - exact).abs() <= bound8 + 1e-6,
                    "{isa:?} {kind:?} int8 row {r}: {} vs Σ w x̂ {exact}",
                    got8[r]
                );
            }
            // Dequantized rows within one rounding of the product and one of the sum.
            let (r0, r1) = (rows / 3, rows);
            let mut tile = vec![0.0; (r1 - r0) * cols];
            q.dequant_rows_with(isa, r0, r1, &mut tile);
            let mut want = vec![0.0; (r1 - r0) * cols];
            oracle::dequant(kind, &raw[r0 * rb..r1 * rb], &mut want);
            for (j, (a, b)) in tile.iter().zip(&want).enumerate() {
                let bound = f64::from(f32::EPSILON) * (mag[r0 * cols + j] + b.abs());
                assert!(
                    (f64::from(*a) - b).abs() <= bound,
                    "{isa:?} {kind:?} dequant {j}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn every_path_matches_the_oracle_on_every_format() {
        for kind in RAW {
            let v = kind.block_values();
            // Row counts around the kernels' passes of several rows; block counts 1, 2, 3 and
            // the default model's widths.
            for (rows, nb) in [(1, 1), (3, 2), (4, 3), (5, 1), (7, 2), (13, 3), (29, 1)] {
                check_products(kind, rows, nb * v, (rows * 31 + nb) as u64);
            }
            check_products(kind, 9, if v == 256 { 2304 } else { 576 }, 5);
        }
    }

    #[test]
    fn raw_matrices_stack_and_refill_as_the_file_holds_them() {
        for kind in RAW {
            let cols = 2 * kind.block_values();
            let (a, b) = (random_blocks(kind, 6, 1), random_blocks(kind, 10, 2));
            let s = QMatrix::stack(vec![
                QMatrix::from_raw(3, cols, kind, &a),
                QMatrix::from_raw(5, cols, kind, &b),
            ]);
            assert_eq!((s.rows(), s.bytes()), (8, a.len() + b.len()));
            let mut r = QMatrix::with_capacity(0, 0, Kind::Q8_0);
            r.reserve_parts(0, 0, a.len() + b.len());
            let cap = r.capacity_bytes();
            r.refill(8, cols, kind, &[&a, &b]);
            assert_eq!(r.capacity_bytes(), cap, "{kind:?}: refill allocated");
            let (mut x, mut y) = (vec![0.0; 8 * cols], vec![0.0; 8 * cols]);
            s.dequant_rows(0, 8, &mut x);
            r.dequant_rows(0, 8, &mut y);
            assert_eq!(x, y);
            assert_eq!(s.value(4, 7), x[4 * cols + 7]);
        }
    }
}
