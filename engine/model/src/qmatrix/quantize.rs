//! The simplest correct quantizer for each stored format, for the test GGUF writer
//! ([`crate::tiny`]) and the tests: every value lands within half a step of its block's (or
//! sub-block's) grid, because each scale is rounded up, never down, so the range always covers
//! the values (no clamping), and each min is rounded down. No search for the best scales, as
//! llama.cpp's quantizers do: the tests need correct blocks, not the smallest error.

use super::Kind;
use super::blocks::SUPER;
use half::f16;

/// The smallest f16 at least `v` (finite `v`).
fn f16_up(v: f32) -> f16 {
    let h = f16::from_f32(v);
    if h.to_f32() >= v {
        h
    } else if h.is_sign_negative() && h.to_f32() != 0.0 {
        f16::from_bits(h.to_bits() - 1)
    } else {
        f16::from_bits((h.to_bits() & 0x7FFF) + 1)
    }
}

/// The largest f16 at most `v` (finite `v`).
fn f16_down(v: f32) -> f16 {
    let h = f16::from_f32(v);
    if h.to_f32() <= v {
        h
    } else if h.to_f32() == 0.0 {
        f16::from_bits(0x8001)
    } else if h.is_sign_negative() {
        f16::from_bits(h.to_bits() + 1)
    } else {
        f16::from_bits(h.to_bits() - 1)
    }
}

/// `round(v / step)` clamped to `lo..=hi` (0 when the step is 0).
fn code(v: f32, step: f32, lo: i32, hi: i32) -> i32 {
    if step > 0.0 {
        ((v / step).round() as i32).clamp(lo, hi)
    } else {
        0
    }
}

/// Quantizes `w` (a multiple of the format's block) to `kind`'s blocks, in the file's layout.
pub fn quantize(kind: Kind, w: &[f32]) -> Vec<u8> {
    let vals = kind.block_values();
    assert!(w.len().is_multiple_of(vals), "quantize: partial block");
    let mut out = Vec::with_capacity(w.len() / vals * kind.block_bytes());
    for b in w.chunks_exact(vals) {
        match kind {
            Kind::F32 => out.extend_from_slice(&b[0].to_le_bytes()),
            Kind::Q8_0 | Kind::Q4_0 | Kind::Q5_0 => symmetric(kind, b, &mut out),
            Kind::Q4_1 | Kind::Q5_1 => with_min(kind, b, &mut out),
            Kind::Q4_K | Kind::Q5_K => k_with_mins(kind, b, &mut out),
            Kind::Q6_K => q6_k(b, &mut out),
        }
    }
    out
}

/// Q8_0, Q4_0, Q5_0: `d = amax / levels`, codes `round(x / d)` offset to unsigned.
fn symmetric(kind: Kind, b: &[f32], out: &mut Vec<u8>) {
    let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let levels = match kind {
        Kind::Q8_0 => 127,
        Kind::Q4_0 => 7,
        _ => 15,
    };
    let d = f16_up(amax / levels as f32);
    out.extend_from_slice(&d.to_le_bytes());
    let q: Vec<i32> = b
        .iter()
        .map(|&v| code(v, d.to_f32(), -levels, levels))
        .collect();
    match kind {
        Kind::Q8_0 => out.extend(q.iter().map(|&c| c as i8 as u8)),
        Kind::Q4_0 => nibbles(&q.iter().map(|c| (c + 8) as u8).collect::<Vec<_>>(), out),
        _ => five_bits(&q.iter().map(|c| (c + 16) as u8).collect::<Vec<_>>(), out),
    }
}

/// Q4_1, Q5_1: `m = min`, `d = (max - m) / levels`, codes `round((x - m) / d)`.
fn with_min(kind: Kind, b: &[f32], out: &mut Vec<u8>) {
    let lo = b.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let hi = b.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let levels = if kind == Kind::Q4_1 { 15 } else { 31 };
    let m = f16_down(lo);
    let d = f16_up((hi - m.to_f32()) / levels as f32);
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&m.to_le_bytes());
    let q: Vec<u8> = b
        .iter()
        .map(|&v| code(v - m.to_f32(), d.to_f32(), 0, levels) as u8)
        .collect();
    if kind == Kind::Q4_1 {
        nibbles(&q, out)
    } else {
        five_bits(&q, out)
    }
}

/// 32 codes below 16 as 16 bytes: value `j` in byte `j`'s low nibble, `j + 16` in its high one.
fn nibbles(q: &[u8], out: &mut Vec<u8>) {
    out.extend((0..16).map(|j| (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)));
}

/// 32 codes below 32: their fifth bits as a little-endian u32, then their nibbles.
fn five_bits(q: &[u8], out: &mut Vec<u8>) {
    let qh = (0..32).fold(0u32, |h, j| h | (u32::from(q[j] >> 4) << j));
    out.extend_from_slice(&qh.to_le_bytes());
    nibbles(q, out);
}

/// Q4_K, Q5_K: per sub-block of 32 an offset `mn · dmin` (at least `-min(x, 0)`), then a scale
/// `sc · d` that covers the rest of the range; both 6-bit multiples of the super-block's f16.
fn k_with_mins(kind: Kind, b: &[f32], out: &mut Vec<u8>) {
    let levels = if kind == Kind::Q4_K { 15.0 } else { 31.0 };
    let neg: Vec<f32> = b
        .chunks_exact(32)
        .map(|s| -s.iter().fold(0.0f32, |m, &v| m.min(v)))
        .collect();
    let dmin = f16_up(neg.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0);
    let mn: Vec<u8> = neg
        .iter()
        .map(|&v| steps_up(v, dmin.to_f32(), 63))
        .collect();
    let offs: Vec<f32> = mn.iter().map(|&m| dmin.to_f32() * f32::from(m)).collect();
    let want: Vec<f32> = b
        .chunks_exact(32)
        .zip(&offs)
        .map(|(s, &o)| s.iter().fold(0.0f32, |m, &v| m.max(v + o)) / levels)
        .collect();
    let d = f16_up(want.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0);
    let sc: Vec<u8> = want.iter().map(|&v| steps_up(v, d.to_f32(), 63)).collect();
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    for j in 0..4 {
        out.push((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    }
    for j in 0..4 {
        out.push((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    }
    for j in 0..4 {
        out.push((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
    let q: Vec<u8> = b
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let s = i / 32;
            code(v + offs[s], d.to_f32() * f32::from(sc[s]), 0, levels as i32) as u8
        })
        .collect();
    if kind == Kind::Q5_K {
        out.extend((0..32).map(|l| (0..8).fold(0u8, |h, s| h | ((q[32 * s + l] >> 4) << s))));
    }
    for k in 0..4 {
        out.extend((0..32).map(|l| (q[64 * k + l] & 0xF) | ((q[64 * k + 32 + l] & 0xF) << 4)));
    }
}

/// The fewest steps of `unit` that reach `v` (`v ≤ max · unit`), at most `max`.
fn steps_up(v: f32, unit: f32, max: u8) -> u8 {
    if unit > 0.0 {
        ((v / unit).ceil() as i32).clamp(0, i32::from(max)) as u8
    } else {
        0
    }
}

/// Q6_K: per 16 values a scale `sc · d` (sc an i8) with `amax / 31 ≤ sc · d`, codes in -32..=31.
fn q6_k(b: &[f32], out: &mut Vec<u8>) {
    let want: Vec<f32> = b
        .chunks_exact(16)
        .map(|s| s.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0)
        .collect();
    let d = f16_up(want.iter().fold(0.0f32, |m, &v| m.max(v)) / 127.0);
    let sc: Vec<u8> = want.iter().map(|&v| steps_up(v, d.to_f32(), 127)).collect();
    let q: Vec<u8> = b
        .iter()
        .enumerate()
        .map(|(i, &v)| (code(v, d.to_f32() * f32::from(sc[i / 16]), -32, 31) + 32) as u8)
        .collect();
    let mut ql = [0u8; SUPER / 2];
    let mut qh = [0u8; SUPER / 4];
    for h in 0..2 {
        for l in 0..32 {
            let at = |g: usize| q[128 * h + 32 * g + l];
            ql[64 * h + l] = (at(0) & 0xF) | ((at(2) & 0xF) << 4);
            ql[64 * h + 32 + l] = (at(1) & 0xF) | ((at(3) & 0xF) << 4);
            qh[32 * h + l] = (0..4).fold(0u8, |acc, g| acc | ((at(g) >> 4) << (2 * g)));
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().copied());
    out.extend_from_slice(&d.to_le_bytes());
}
