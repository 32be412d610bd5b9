//! The portable f64 oracle: every stored format dequantized to f64 value by value, written
//! straight from the formats' definitions (not from the kernels' decode, [`super::blocks`]),
//! and products summed in f64. Every kernel, on every path, is checked against it.

use super::Kind;
use half::f16;

fn h(b: &[u8], at: usize) -> f64 {
    f64::from(f16::from_le_bytes([b[at], b[at + 1]]).to_f32())
}

/// The 6-bit scale (`which = 0`) or min (`which = 1`) of sub-block `s` of a Q4_K/Q5_K scale
/// field, bit by bit: sub-blocks 0-3 keep theirs in the low 6 bits of bytes `s` (scales) and
/// `s + 4` (mins); sub-blocks 4-7 have their low 4 bits in byte `s + 4` (scales low, mins
/// high) and their top 2 bits in the top bits of bytes `s - 4` (scales) and `s` (mins).
fn six_bit(scales: &[u8], s: usize, which: usize) -> f64 {
    let v = if s < 4 {
        scales[s + 4 * which] & 0x3F
    } else {
        let low = (scales[s + 4] >> (4 * which)) & 0xF;
        let top = scales[s - 4 + 4 * which] >> 6;
        low | (top << 4)
    };
    f64::from(v)
}

/// Value `j` of one block of `kind` (`b` its bytes), in f64.
pub fn block_value(kind: Kind, b: &[u8], j: usize) -> f64 {
    let nib = |qs: &[u8], j: usize| f64::from(if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 });
    let bit5 = |qh: &[u8], j: usize| {
        let word = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
        f64::from((word >> j) & 1) * 16.0
    };
    match kind {
        Kind::F32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Kind::Q8_0 => h(b, 0) * f64::from(b[2 + j] as i8),
        Kind::Q4_0 => h(b, 0) * (nib(&b[2..], j) - 8.0),
        Kind::Q4_1 => h(b, 0) * nib(&b[4..], j) + h(b, 2),
        Kind::Q5_0 => h(b, 0) * (nib(&b[6..], j) + bit5(&b[2..], j) - 16.0),
        Kind::Q5_1 => h(b, 0) * (nib(&b[8..], j) + bit5(&b[4..], j)) + h(b, 2),
        Kind::Q4_K | Kind::Q5_K => {
            let s = j / 32;
            let (d, dmin, scales) = (h(b, 0), h(b, 2), &b[4..16]);
            let qs = if kind == Kind::Q5_K {
                &b[48..]
            } else {
                &b[16..]
            };
            let byte = qs[32 * (s / 2) + j % 32];
            let mut q = f64::from(if s.is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            });
            if kind == Kind::Q5_K && b[16 + j % 32] & (1 << s) != 0 {
                q += 16.0;
            }
            d * six_bit(scales, s, 0) * q - dmin * six_bit(scales, s, 1)
        }
        Kind::Q6_K => {
            // Value j = 128 half + 32 group + l.
            let (half, group, l) = (j / 128, j % 128 / 32, j % 32);
            let ql = b[64 * half + 32 * (group % 2) + l];
            let low = if group < 2 { ql & 0xF } else { ql >> 4 };
            let high = (b[128 + 32 * half + l] >> (2 * group)) & 3;
            let q = f64::from(low | (high << 4)) - 32.0;
            h(b, 208) * f64::from(b[192 + j / 16] as i8) * q
        }
    }
}

/// Dequantizes whole blocks of `kind` (`raw`, the file's bytes) into `out`, in f64.
pub fn dequant(kind: Kind, raw: &[u8], out: &mut [f64]) {
    let (vals, bytes) = (kind.block_values(), kind.block_bytes());
    for (b, o) in raw.chunks_exact(bytes).zip(out.chunks_exact_mut(vals)) {
        for (j, o) in o.iter_mut().enumerate() {
            *o = block_value(kind, b, j);
        }
    }
}

/// `Σ w x` in f64 over a row of whole blocks of `kind`.
pub fn dot(kind: Kind, row: &[u8], x: &[f32]) -> f64 {
    let mut w = vec![0.0; x.len()];
    dequant(kind, row, &mut w);
    w.iter().zip(x).map(|(w, &x)| w * f64::from(x)).sum()
}
