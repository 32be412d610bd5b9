//! Candidate KV formats measured before they get a packed layout: a chunk's values are quantized
//! and dequantized as the candidate would store them (fake quantization) and the result is kept
//! in f16, so `llms eval ppl` scores the candidate's fidelity exactly, and its all-in stored size
//! is computed from the same parameters ([`SimFormat::stored_bits`]).
//!
//! A candidate is written `k4+v4+kc8+vc8+g64+pre+o2` (any order, each part optional):
//! `k<bits>`, `v<bits>` the key and value bits (default 4); `kf16`/`kc8`/`ks8` and
//! `vf16`/`vc8`/`vs8` their parameters per group (see [`Params`]; default f16); `g<n>` the value
//! group, channels of one token (default the head dimension); `pre` quantizes keys before RoPE
//! (rotated back after, as attention would); `o<n>` keeps the `n` largest key channels of each
//! head in int8 (dense-and-sparse, KVQuant).

use std::fmt;

use half::f16;

use crate::kv::codec::ChunkShape;

/// How a quantization group's parameters are stored; named `f16`, `c8`, `s8` in a candidate's
/// name (`Display`, `FromStr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::Display, strum::EnumString)]
pub enum Params {
    /// Minimum and scale in f16 (32 bits), as int4 and int2 store them.
    #[strum(serialize = "f16")]
    F16,
    /// Minimum as an 8-bit multiple of `amax / 127` and scale as an 8-bit code `amax 2^(-j/8)`,
    /// `amax` being the head's largest magnitude in the section (one f16 per head): 16 bits.
    #[strum(serialize = "c8")]
    Code8,
    /// Symmetric around zero: the 8-bit scale code only (8 bits).
    #[strum(serialize = "s8")]
    Sym8,
}

impl Params {
    /// Bits per group.
    pub fn bits(self) -> usize {
        match self {
            Params::F16 => 32,
            Params::Code8 => 16,
            Params::Sym8 => 8,
        }
    }
}

/// A candidate format (see the module doc for its name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimFormat {
    pub key_bits: u32,
    pub value_bits: u32,
    pub key_params: Params,
    pub value_params: Params,
    /// Channels per value group (a divisor of the head dimension); 0 means the head dimension.
    pub value_group: usize,
    pub pre_rope: bool,
    pub outliers: usize,
}

/// A candidate's name did not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("bad simulated format {name:?}: expected parts like k4+v4+kc8+vc8+g64+pre+o2")]
pub struct BadSimFormat {
    pub name: String,
}

impl std::str::FromStr for SimFormat {
    type Err = BadSimFormat;
    fn from_str(s: &str) -> Result<Self, BadSimFormat> {
        let bad = || BadSimFormat { name: s.into() };
        let mut f = SimFormat {
            key_bits: 4,
            value_bits: 4,
            key_params: Params::F16,
            value_params: Params::F16,
            value_group: 0,
            pre_rope: false,
            outliers: 0,
        };
        for part in s.split('+') {
            let num = |p: &str| p.parse::<usize>().map_err(|_| bad());
            let bits = |p: &str| match num(p)? {
                b @ 1..=8 => Ok(b as u32),
                _ => Err(bad()),
            };
            if part == "pre" {
                f.pre_rope = true;
            } else if let Some(p) = part.strip_prefix('g') {
                f.value_group = num(p)?;
            } else if let Some(p) = part.strip_prefix('o') {
                f.outliers = num(p)?;
            } else if let Some(p) = part.strip_prefix('k') {
                match p.parse() {
                    Ok(q) => f.key_params = q,
                    Err(_) => f.key_bits = bits(p)?,
                }
            } else if let Some(p) = part.strip_prefix('v') {
                match p.parse() {
                    Ok(q) => f.value_params = q,
                    Err(_) => f.value_bits = bits(p)?,
                }
            } else {
                return Err(bad());
            }
        }
        Ok(f)
    }
}

impl fmt::Display for SimFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "k{}+v{}+k{}+v{}",
            self.key_bits, self.value_bits, self.key_params, self.value_params
        )?;
        if self.value_group > 0 {
            write!(f, "+g{}", self.value_group)?;
        }
        if self.pre_rope {
            f.write_str("+pre")?;
        }
        if self.outliers > 0 {
            write!(f, "+o{}", self.outliers)?;
        }
        Ok(())
    }
}

/// One rotary embedding's angles, to take keys back before RoPE and forward again.
#[derive(Clone, Copy, Debug)]
pub struct RopeSpec {
    pub rope_dim: usize,
    pub base: f32,
}

impl SimFormat {
    fn group(&self, head_dim: usize) -> usize {
        match self.value_group {
            0 => head_dim,
            g => g.min(head_dim),
        }
    }

    /// Whether the candidate fits `shape` (value groups divide the head, outliers fit).
    pub fn fits(&self, shape: &ChunkShape) -> bool {
        let g = self.group(shape.head_dim);
        g > 0 && shape.head_dim.is_multiple_of(g) && self.outliers < shape.head_dim
    }

    /// Bits of one chunk as the candidate would store it, parameters and kvfs header included.
    pub fn chunk_bits(&self, s: &ChunkShape) -> usize {
        let (hd, t, n) = (s.head_dim, s.tokens, self.outliers);
        let coded = |p: Params| if p == Params::F16 { 0 } else { 16 };
        // Outlier channels: int8 values, an f16 scale and an 8-bit channel index each.
        let k = (hd - n) * (t * self.key_bits as usize + self.key_params.bits())
            + n * (t * 8 + 16 + 8)
            + coded(self.key_params);
        let v = hd * t * self.value_bits as usize
            + t * (hd / self.group(hd)) * self.value_params.bits()
            + coded(self.value_params);
        s.n_layers * s.n_kv_heads * (k + v) + 8 * kvfs::format::HEADER_LEN
    }

    /// All-in stored bits per value ([`SimFormat::chunk_bits`] over the chunk's values).
    pub fn stored_bits(&self, s: &ChunkShape) -> f64 {
        self.chunk_bits(s) as f64 / s.chunk_values() as f64
    }

    /// Quantizes and dequantizes one layer of a chunk in place (`k`, `v`:
    /// `[kv_head][token][dim]`), its first token at position `pos0`.
    pub fn apply(&self, s: &ChunkShape, rope: RopeSpec, pos0: usize, k: &mut [f32], v: &mut [f32]) {
        let (hd, t) = (s.head_dim, s.tokens);
        let mut col = vec![0f32; t];
        for blk in k.chunks_exact_mut(t * hd) {
            if self.pre_rope {
                rotate(blk, hd, rope, pos0, -1.0);
            }
            // The outlier channels: largest magnitude first.
            let amax_of =
                |blk: &[f32], c: usize| (0..t).fold(0f32, |m, i| m.max(blk[i * hd + c].abs()));
            let mut order: Vec<usize> = (0..hd).collect();
            order.sort_by(|&a, &b| amax_of(blk, b).total_cmp(&amax_of(blk, a)));
            let (out, rest) = order.split_at(self.outliers);
            let base = rest.iter().fold(0f32, |m, &c| m.max(amax_of(blk, c)));
            for (c, bits, params) in out
                .iter()
                .map(|&c| (c, 8, Params::Sym8))
                .chain(rest.iter().map(|&c| (c, self.key_bits, self.key_params)))
            {
                for (i, x) in col.iter_mut().enumerate() {
                    *x = blk[i * hd + c];
                }
                // Outliers get an exact f16 scale of their own: their own amax is the base.
                let b = if bits == 8 { amax_of(blk, c) } else { base };
                quantize(&mut col, bits, params, b);
                for (i, x) in col.iter().enumerate() {
                    blk[i * hd + c] = *x;
                }
            }
            if self.pre_rope {
                rotate(blk, hd, rope, pos0, 1.0);
            }
        }
        let g = self.group(hd);
        for blk in v.chunks_exact_mut(t * hd) {
            let base = blk.iter().fold(0f32, |m, x| m.max(x.abs()));
            for grp in blk.chunks_exact_mut(g) {
                quantize(grp, self.value_bits, self.value_params, base);
            }
        }
    }
}

/// Rotates each token row of one head's block by its position's RoPE angles (`dir` 1.0) or back
/// (`dir` -1.0), pairs (2i, 2i+1) as the model rotates them.
fn rotate(blk: &mut [f32], hd: usize, rope: RopeSpec, pos0: usize, dir: f64) {
    let half = rope.rope_dim / 2;
    for (j, row) in blk.chunks_exact_mut(hd).enumerate() {
        for i in 0..half {
            let theta = 1.0 / f64::from(rope.base).powf((2 * i) as f64 / rope.rope_dim as f64);
            let a = (pos0 + j) as f64 * theta * dir;
            let (sn, cs) = a.sin_cos();
            let (x0, x1) = (f64::from(row[2 * i]), f64::from(row[2 * i + 1]));
            row[2 * i] = (x0 * cs - x1 * sn) as f32;
            row[2 * i + 1] = (x0 * sn + x1 * cs) as f32;
        }
    }
}

/// The smallest scale code `base 2^(-j/8)` not below `need`.
fn coded_scale(need: f32, base: f32) -> f32 {
    if need <= 0.0 || base <= 0.0 {
        return base.max(f32::MIN_POSITIVE) * (-31.875f32).exp2();
    }
    let mut j = (-8.0 * (need / base).log2()).floor().clamp(0.0, 255.0);
    while j > 0.0 && base * (-j / 8.0).exp2() < need {
        j -= 1.0;
    }
    base * (-j / 8.0).exp2()
}

/// Quantizes one group to `bits` with `params` and writes the dequantized values back.
fn quantize(xs: &mut [f32], bits: u32, params: Params, base: f32) {
    let lo = xs.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (min, scale, qmin, qmax) = match params {
        Params::F16 => {
            let levels = ((1u32 << bits) - 1) as f32;
            let min = f16::from_f32(lo);
            let min = if min.to_f32() > lo {
                f16::from_f32(lo - lo.abs() / 1024.0 - 6e-8)
            } else {
                min
            }
            .to_f32();
            let s = f16::from_f32((hi - min) / levels).to_f32();
            let s = if s * levels + min < hi {
                s * (1.0 + 1.0 / 1024.0) + 6e-8
            } else {
                s
            };
            (min, s, 0.0, levels)
        }
        Params::Code8 => {
            let levels = ((1u32 << bits) - 1) as f32;
            let step = base / 127.0;
            let min = if step > 0.0 {
                (lo / step).floor().max(-127.0) * step
            } else {
                0.0
            };
            (min, coded_scale((hi - min) / levels, base), 0.0, levels)
        }
        Params::Sym8 => {
            let q = ((1u32 << (bits - 1)) - 1).max(1) as f32;
            let amax = lo.abs().max(hi.abs());
            (0.0, coded_scale(amax / q, base), -q, q)
        }
    };
    for x in xs.iter_mut() {
        let q = ((*x - min) / scale).round().clamp(qmin, qmax);
        *x = min + q * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape() -> ChunkShape {
        ChunkShape {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 16,
            tokens: 4,
            ..ChunkShape::DENSE
        }
    }

    #[test]
    fn names_round_trip_and_bad_names_are_refused() {
        for name in [
            "k4+v4+kf16+vf16",
            "k4+v3+kc8+vs8+g8+pre+o2",
            "k2+v2+kc8+vc8",
        ] {
            let f: SimFormat = name.parse().unwrap();
            assert_eq!(f.to_string(), name);
        }
        for bad in ["k9", "x4", "kq8", "g", "v0"] {
            assert!(bad.parse::<SimFormat>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_f16_candidate_costs_what_int4_stores() {
        let s = shape();
        let f: SimFormat = "k4+v4".parse().unwrap();
        let real = s.stored_bytes(crate::kv::KvFormat::Int4) * 8;
        assert_eq!(f.chunk_bits(&s), real);
    }

    proptest! {
        #[test]
        fn candidates_stay_within_half_a_coded_step(
            k in prop::collection::vec(-40.0f32..40.0, 128),
            v in prop::collection::vec(-40.0f32..40.0, 128),
            kb in 2u32..=8,
            vb in 2u32..=8,
            pre in any::<bool>(),
            outliers in 0usize..3,
        ) {
            let s = ChunkShape { n_layers: 1, ..shape() };
            let rope = RopeSpec { rope_dim: 16, base: 10000.0 };
            for (kp, vp) in [(Params::F16, Params::F16), (Params::Code8, Params::Code8), (Params::Code8, Params::Sym8)] {
                let f = SimFormat { key_bits: kb, value_bits: vb, key_params: kp, value_params: vp,
                    value_group: 8, pre_rope: pre, outliers };
                let (mut qk, mut qv) = (k.clone(), v.clone());
                f.apply(&s, rope, 32, &mut qk, &mut qv);
                // Every group's range (at most 80, or twice the magnitude for the symmetric
                // grid) over its levels, the coded scale up to 2^(1/8) more, the coded minimum
                // one step of 40/127 lower; pre-RoPE keys up to sqrt(2) larger.
                let bound = |bits: u32, p: Params| {
                    let levels = match p {
                        Params::Sym8 => ((1u32 << (bits - 1)) - 1).max(1) as f32,
                        _ => ((1u32 << bits) - 1) as f32,
                    };
                    let range = match p { Params::Sym8 => 40.0 * 1.5, _ => 80.0 * 1.5 + 1.0 };
                    range / levels * 1.1 / 2.0 + 1e-3
                };
                for (x, y) in k.iter().zip(&qk) {
                    prop_assert!((x - y).abs() <= bound(kb.min(8), kp) * 1.5, "{f} key {x} -> {y}");
                }
                for (x, y) in v.iter().zip(&qv) {
                    prop_assert!((x - y).abs() <= bound(vb, vp), "{f} value {x} -> {y}");
                }
            }
        }
    }
}
