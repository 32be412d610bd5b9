//! Bit streams and reductions of the KV codecs (`codec.rs`): sub-byte values packed low bits
//! first, one at a time or a run at a time, and the extremes of a chunk's groups, reduced in
//! independent lanes so the compiler vectorizes them.

/// Writes value `q` (`bits` wide) as the `i`-th value of the bit stream `out` (low bits first;
/// a 3-bit value may straddle two bytes).
pub(super) fn pack(out: &mut [u8], i: usize, bits: usize, q: u8) {
    let (byte, shift) = (i * bits / 8, i * bits % 8);
    let w = u16::from(q) << shift;
    out[byte] |= w as u8;
    if shift + bits > 8 {
        out[byte + 1] |= (w >> 8) as u8;
    }
}

pub(super) fn unpack(b: &[u8], i: usize, bits: usize) -> u8 {
    let (byte, shift) = (i * bits / 8, i * bits % 8);
    let lo = u16::from(b[byte]);
    let hi = if shift + bits > 8 {
        u16::from(b[byte + 1])
    } else {
        0
    };
    (((lo | hi << 8) >> shift) & ((1u16 << bits) - 1)) as u8
}

/// The extremes of each group of one head's `[token][dim]` block: per channel over the tokens
/// (`keys`), else per token over the channels. The values are finite (checked before).
pub(super) fn group_extremes(blk: &[f32], hd: usize, keys: bool, lo: &mut [f32], hi: &mut [f32]) {
    if keys {
        lo.copy_from_slice(&blk[..hd]);
        hi.copy_from_slice(&blk[..hd]);
        for row in blk.chunks_exact(hd).skip(1) {
            for ((l, h), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(row) {
                *l = if x < *l { x } else { *l };
                *h = if x > *h { x } else { *h };
            }
        }
    } else {
        for ((row, l), h) in blk.chunks_exact(hd).zip(lo.iter_mut()).zip(hi.iter_mut()) {
            (*l, *h) = min_max(row);
        }
    }
}

/// Lanes of the reductions below: independent accumulators the compiler keeps in one vector,
/// instead of one chain of dependent `maxss` (four cycles each) over the whole run.
const LANES: usize = 8;

/// The largest `|x|` of `xs` (0 for none); the values are finite.
pub(super) fn max_abs(xs: &[f32]) -> f32 {
    let mut m = [0f32; LANES];
    let mut it = xs.chunks_exact(LANES);
    for c in &mut it {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = if x.abs() > *m { x.abs() } else { *m };
        }
    }
    let tail = it.remainder().iter().fold(0f32, |a, x| a.max(x.abs()));
    m.iter().fold(tail, |a, &b| a.max(b))
}

/// The smallest and largest of `xs` (not empty; finite values).
fn min_max(xs: &[f32]) -> (f32, f32) {
    let (mut lo, mut hi) = ([xs[0]; LANES], [xs[0]; LANES]);
    let mut it = xs.chunks_exact(LANES);
    for c in &mut it {
        for ((l, h), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(c) {
            *l = if x < *l { x } else { *l };
            *h = if x > *h { x } else { *h };
        }
    }
    let a = lo.iter().fold(xs[0], |a, &x| a.min(x));
    let b = hi.iter().fold(xs[0], |a, &x| a.max(x));
    it.remainder()
        .iter()
        .fold((a, b), |(a, b), &x| (a.min(x), b.max(x)))
}

/// Packs `codes` (`bits` wide each) as values `first..` of the bit stream `out` (zeroed), as
/// [`pack`] would one by one: whole bytes at a time where the run starts on a byte.
pub(super) fn pack_run(out: &mut [u8], first: usize, bits: usize, codes: &[u8]) {
    if !(first * bits).is_multiple_of(8) || !(codes.len() * bits).is_multiple_of(8) {
        for (i, &c) in codes.iter().enumerate() {
            pack(out, first + i, bits, c);
        }
        return;
    }
    let start = first * bits / 8;
    let out = &mut out[start..start + codes.len() * bits / 8];
    match bits {
        8 => out.copy_from_slice(codes),
        4 => {
            for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
                *o = c[0] | c[1] << 4;
            }
        }
        2 => {
            for (o, c) in out.iter_mut().zip(codes.chunks_exact(4)) {
                *o = c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6;
            }
        }
        _ => {
            // Eight codes fill `bits` whole bytes, low bits first.
            let per = 8 * bits / 8;
            for (o, c) in out.chunks_exact_mut(per).zip(codes.chunks_exact(8)) {
                let mut w: u64 = 0;
                for (k, &x) in c.iter().enumerate() {
                    w |= u64::from(x) << (k * bits);
                }
                o.copy_from_slice(&w.to_le_bytes()[..per]);
            }
        }
    }
}
