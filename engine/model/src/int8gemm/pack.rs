//! Repacking a matrix's rows into the panels the int8 kernels read ([`super::Form`]): every
//! format's 32-value blocks become unsigned codes, a scale and a second parameter (a minimum,
//! or Q6_K's scale of values 16..32), each an exact f32.
//!
//! The codes are the format's own, only moved: Q4_0, Q4_1 and Q4_K nibbles in Q4_1's order
//! (byte `j`: value `j` low, value `j + 16` high), the 5- and 6-bit codes and Q8_0's (offset by
//! 128) one byte per value. The parameters are the products the formats define, each exact in
//! f32: an f16 scale times a 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) integer needs at most 19
//! significant bits. A row's blocks are decoded eight codes at a time in 64-bit words, since
//! every product repacks its whole matrix once per batch.

use super::{PANEL, form};
use crate::qmatrix::blocks::scale_min_k4;
use crate::qmatrix::{BLOCK, Kind, QMatrix};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// The low nibble of every byte.
const LO: u64 = 0x0F0F_0F0F_0F0F_0F0F;

/// Each bit `i` of a byte moved to bit 4 of byte `i` (a 5-bit code's fifth bit).
const SPREAD: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut i = 0;
        while i < 8 {
            if b >> i & 1 != 0 {
                t[b] |= 0x10 << (8 * i);
            }
            i += 1;
        }
        b += 1;
    }
    t
};

fn le64(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// One 32-value block of a row as a panel holds it: codes (16 bytes of nibbles or 32 bytes),
/// the scale and the second parameter.
pub(super) struct Block {
    pub(super) codes: [u8; 32],
    pub(super) scale: f32,
    pub(super) second: f32,
}

/// Calls `put(b, block)` for every 32-value block `b` of row `r` of `w`.
pub(super) fn row_blocks(w: &QMatrix, r: usize, mut put: impl FnMut(usize, &Block)) {
    let kind = w.kind();
    let nb = w.cols() / BLOCK;
    let (d, m, qs) = w.raw_parts();
    let mut blk = Block {
        codes: [0; 32],
        scale: 0.0,
        second: 0.0,
    };
    let codes8 =
        |c: &mut [u8; 32], k: usize, v: u64| c[8 * k..8 * k + 8].copy_from_slice(&v.to_le_bytes());
    match kind {
        Kind::Q4_1 | Kind::Q8_0 => {
            let qb = if kind == Kind::Q4_1 { 16 } else { 32 };
            for b in 0..nb {
                let i = r * nb + b;
                let src = &qs[i * qb..(i + 1) * qb];
                for (c, &s) in blk.codes.iter_mut().zip(src) {
                    *c = if kind == Kind::Q8_0 { s ^ 0x80 } else { s };
                }
                blk.scale = d[i].to_f32();
                blk.second = if kind == Kind::Q4_1 {
                    m[i].to_f32()
                } else {
                    0.0
                };
                put(b, &blk);
            }
        }
        Kind::Q4_0 | Kind::Q5_0 | Kind::Q5_1 => {
            let bytes = kind.block_bytes();
            let row = &qs[r * nb * bytes..(r + 1) * nb * bytes];
            for (b, src) in row.chunks_exact(bytes).enumerate() {
                blk.scale = half(src, 0);
                blk.second = if kind == Kind::Q5_1 {
                    half(src, 2)
                } else {
                    0.0
                };
                if kind == Kind::Q4_0 {
                    blk.codes[..16].copy_from_slice(&src[2..18]);
                } else {
                    // Q5_0: qh at 2, nibbles at 6; Q5_1: qh at 4, nibbles at 8.
                    let h = if kind == Kind::Q5_0 { 2 } else { 4 };
                    let (qh, nib) = (&src[h..h + 4], &src[h + 4..h + 20]);
                    for k in 0..4 {
                        let n = le64(&nib[8 * (k % 2)..]) >> (4 * (k / 2)) & LO;
                        codes8(&mut blk.codes, k, n | SPREAD[usize::from(qh[k])]);
                    }
                }
                put(b, &blk);
            }
        }
        Kind::Q4_K | Kind::Q5_K | Kind::Q6_K => {
            let bytes = kind.block_bytes();
            let nsb = nb / 8;
            let row = &qs[r * nsb * bytes..(r + 1) * nsb * bytes];
            for (sb, src) in row.chunks_exact(bytes).enumerate() {
                for s in 0..8 {
                    super_sub_block(kind, src, s, &mut blk);
                    put(8 * sb + s, &blk);
                }
            }
        }
        Kind::F32 => unreachable!("f32 matrices take the f32 GEMM"),
    }
}

/// Sub-block `s` (values `32 s..32 s + 32`) of one Q4_K, Q5_K or Q6_K super-block `b`.
fn super_sub_block(kind: Kind, b: &[u8], s: usize, blk: &mut Block) {
    let codes8 =
        |c: &mut [u8; 32], k: usize, v: u64| c[8 * k..8 * k + 8].copy_from_slice(&v.to_le_bytes());
    match kind {
        Kind::Q4_K | Kind::Q5_K => {
            let (d, dmin) = (half(b, 0), half(b, 2));
            let (sc, mn) = scale_min_k4(s, &b[4..16]);
            blk.scale = d * f32::from(sc);
            blk.second = -(dmin * f32::from(mn));
            let shift = 4 * (s % 2);
            if kind == Kind::Q4_K {
                // The sub-block's 32 nibbles, put in Q4_1's order: value j low, j + 16 high.
                let q = &b[16 + 32 * (s / 2)..16 + 32 * (s / 2) + 32];
                for k in 0..2 {
                    let lo = le64(&q[8 * k..]) >> shift & LO;
                    let hi = le64(&q[16 + 8 * k..]) >> shift & LO;
                    codes8(&mut blk.codes, k, lo | hi << 4);
                }
            } else {
                let (qh, q) = (&b[16..48], &b[48 + 32 * (s / 2)..48 + 32 * (s / 2) + 32]);
                for k in 0..4 {
                    let n = le64(&q[8 * k..]) >> shift & LO;
                    let h = (le64(&qh[8 * k..]) >> s & 0x0101_0101_0101_0101) << 4;
                    codes8(&mut blk.codes, k, n | h);
                }
            }
        }
        Kind::Q6_K => {
            // Values 32 s.. are group g of half h: low or high nibbles of 32 `ql` bytes, their
            // two high bits bits 2g, 2g + 1 of `qh`.
            let (h, g) = (s / 4, s % 4);
            let ql = &b[64 * h + 32 * (g % 2)..];
            let qh = &b[128 + 32 * h..];
            for k in 0..4 {
                let n = le64(&ql[8 * k..]) >> (4 * (g / 2)) & LO;
                let t = (le64(&qh[8 * k..]) >> (2 * g) & 0x0303_0303_0303_0303) << 4;
                codes8(&mut blk.codes, k, n | t);
            }
            let d = half(b, 208);
            blk.scale = d * f32::from(b[192 + 2 * s] as i8);
            blk.second = d * f32::from(b[193 + 2 * s] as i8);
        }
        _ => unreachable!("{kind:?} has no super-blocks"),
    }
}

/// Repacks rows `r0..r1` (at most [`PANEL`]) of `w` into one panel at `out` (rows past `r1`
/// are zero): for each block, the codes as 4-byte groups across the rows (`[group][row][4]`),
/// then the rows' scales and, if the form has one, their second parameters, as f32.
pub(super) fn pack_panel(w: &QMatrix, r0: usize, r1: usize, out: &mut [u8]) {
    let f = form::of(w.kind());
    let nb = w.cols() / BLOCK;
    let (pb, qb) = (form::block_bytes(f), form::code_bytes(f));
    let out = &mut out[..nb * pb];
    if r1 - r0 < PANEL {
        out.fill(0);
    }
    if matches!(w.kind(), Kind::Q4_1 | Kind::Q8_0) {
        return pack_split(w, r0, r1, out);
    }
    let second = form::has_second(f);
    for (i, r) in (r0..r1).enumerate() {
        row_blocks(w, r, |b, blk| {
            let o = &mut out[b * pb..(b + 1) * pb];
            put_codes(o, i, &blk.codes[..qb]);
            let p = PANEL * qb;
            o[p + 4 * i..p + 4 * i + 4].copy_from_slice(&blk.scale.to_le_bytes());
            if second {
                let p = p + 4 * PANEL;
                o[p + 4 * i..p + 4 * i + 4].copy_from_slice(&blk.second.to_le_bytes());
            }
        });
    }
}

/// Puts one row's codes of one block (`qb` bytes) into panel block `o` as row `i`: 4-byte
/// group `g` at `(g · 16 + i) · 4`.
#[inline]
fn put_codes(o: &mut [u8], i: usize, codes: &[u8]) {
    for (g, word) in codes.chunks_exact(4).enumerate() {
        let at = (g * PANEL + i) * 4;
        o[at..at + 4].copy_from_slice(word);
    }
}

/// [`pack_panel`] for the formats held split (Q4_1, Q8_0: codes, then f16 scales and
/// minimums apart): the codes moved a word at a time (Q8_0's made unsigned), the parameters
/// converted a row at a time.
fn pack_split(w: &QMatrix, r0: usize, r1: usize, out: &mut [u8]) {
    let kind = w.kind();
    let f = form::of(kind);
    let nb = w.cols() / BLOCK;
    let (pb, qb) = (form::block_bytes(f), form::code_bytes(f));
    let (d, m, qs) = w.raw_parts();
    // Q8_0's signed codes stored + 128: the top bit of each byte flipped.
    let flip = if kind == Kind::Q8_0 {
        0x8080_8080u32
    } else {
        0
    };
    let mut params = [0.0f32; 64];
    for (i, r) in (r0..r1).enumerate() {
        let row = &qs[r * nb * qb..(r + 1) * nb * qb];
        for (src, o) in row.chunks_exact(qb).zip(out.chunks_exact_mut(pb)) {
            for (g, word) in src.chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([word[0], word[1], word[2], word[3]]) ^ flip;
                let at = (g * PANEL + i) * 4;
                o[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        let halves: &[&[f16]] = if kind == Kind::Q4_1 { &[d, m] } else { &[d] };
        for (k, h) in halves.iter().enumerate() {
            let at = PANEL * qb + 4 * PANEL * k + 4 * i;
            for b0 in (0..nb).step_by(params.len()) {
                let n = (nb - b0).min(params.len());
                h[r * nb + b0..r * nb + b0 + n].convert_to_f32_slice(&mut params[..n]);
                for (b, v) in params[..n].iter().enumerate() {
                    let o = (b0 + b) * pb + at;
                    out[o..o + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qmatrix::blocks::{Decoded, decode, random_blocks};

    /// Every block as packed gives the format's decode: `scale · (code − offset) + min` with
    /// the same f32 scale and minimum (per 16 values for Q6_K).
    #[test]
    fn packed_blocks_are_the_formats_decode() {
        for kind in Kind::ALL.into_iter().filter(|&k| k != Kind::F32) {
            let cols = 512;
            let raw = random_blocks(kind, 3 * cols / kind.block_values(), 17);
            let w = QMatrix::from_raw(3, cols, kind, &raw);
            let f = form::of(kind);
            let off = form::offset(f);
            for r in 0..3 {
                let mut dense = vec![0.0f32; cols];
                w.dequant_rows_with(crate::qmatrix::Isa::Portable, r, r + 1, &mut dense);
                let mut seen = 0;
                row_blocks(&w, r, |b, blk| {
                    seen += 1;
                    for j in 0..BLOCK {
                        let u = if form::code_bytes(f) == 16 {
                            if j < 16 {
                                blk.codes[j] & 0xF
                            } else {
                                blk.codes[j - 16] >> 4
                            }
                        } else {
                            blk.codes[j]
                        };
                        assert!(i32::from(u) <= form::max_code(f), "{kind:?}");
                        let code = f32::from(i16::from(u) - off as i16);
                        let (scale, min) = match f {
                            form::HALVES if j >= 16 => (blk.second, 0.0),
                            form::NIB_MIN | form::BYTE_MIN => (blk.scale, blk.second),
                            _ => (blk.scale, 0.0),
                        };
                        let got = scale * code + min;
                        let want = dense[b * BLOCK + j];
                        assert!(got == want, "{kind:?} r{r} b{b} j{j}: {got} vs {want}");
                    }
                });
                assert_eq!(seen, cols / BLOCK);
            }
            if kind.is_raw() {
                // The raw formats' scales are exactly those of their decode.
                let mut dec = Decoded::default();
                decode(kind, &raw[..kind.block_bytes()], &mut dec);
                row_blocks(&w, 0, |b, blk| {
                    if b < kind.block_values() / BLOCK {
                        assert_eq!(blk.scale, dec.scales[2 * b], "{kind:?}");
                    }
                });
            }
        }
    }
}
