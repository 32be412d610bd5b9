//! Synthetic data shaped like KV chunks, for when real ones are not at hand: KV-shaped chunks
//! of each format (what a real chunk's payload compresses like) and incompressible noise.

use kvfs::format::KvFormat;

/// K and V channels of one token over all layers of SmolLM2-135M: 30 layers × 3 KV heads × 64 × 2.
pub const SMOLLM2_CHANNELS: usize = 30 * 3 * 64 * 2;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn gauss(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

/// `len` bytes of KV-shaped chunks in `format` (SmolLM2-135M's channels, 16 tokens each),
/// one after another from `seed` on, cut at `len`: what a real chunk's payload compresses like.
pub fn kv_bytes(format: KvFormat, len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut s = seed;
    while out.len() < len {
        out.extend(kv_chunk(format, 16, SMOLLM2_CHANNELS, s));
        s += 1;
    }
    out.truncate(len);
    out
}

/// Incompressible bytes.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..len).map(|_| (r.next() >> 24) as u8).collect()
}

/// One chunk of `tokens` tokens × `channels` channels in `format`: Gaussian activations whose
/// channels have log-normal scales with a few outlier channels; keys (the first half of the
/// channels) quantized per channel and values per token, as KIVI does; int8 symmetric, int4 and
/// int2 asymmetric (min/max) and packed two or four to a byte; f16 plain. The scales (and minima)
/// follow the codes as f32, as a real chunk carries them.
pub fn kv_chunk(format: KvFormat, tokens: usize, channels: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
    let scale: Vec<f32> = (0..channels)
        .map(|c| {
            let s = (0.5 * r.gauss()).exp();
            if c % 97 == 0 { s * 8.0 } else { s }
        })
        .collect();
    let x: Vec<f32> = (0..tokens * channels)
        .map(|i| r.gauss() * scale[i % channels])
        .collect();
    // The coded-parameter formats are laid out as their f32-parameter neighbours here.
    let format = match format {
        KvFormat::K8v8 => KvFormat::Int8,
        KvFormat::K4v4 | KvFormat::K4v3 => KvFormat::Int4,
        f => f,
    };
    if format == KvFormat::F16 {
        return x.iter().flat_map(|v| f16_bits(*v).to_le_bytes()).collect();
    }
    let half = channels / 2;
    // Groups: one per key channel (over tokens), one per token's values.
    let mut groups: Vec<Vec<usize>> = (0..half)
        .map(|c| (0..tokens).map(|t| t * channels + c).collect())
        .collect();
    groups.extend((0..tokens).map(|t| (half..channels).map(|c| t * channels + c).collect()));
    let mut codes = vec![0u8; tokens * channels];
    let mut params = Vec::new();
    for g in &groups {
        let (lo, hi) = g.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &i| {
            (lo.min(x[i]), hi.max(x[i]))
        });
        match format {
            KvFormat::Int8 => {
                let s = lo.abs().max(hi.abs()) / 127.0;
                for &i in g {
                    codes[i] = ((x[i] / s).round().clamp(-127.0, 127.0) as i8) as u8;
                }
                params.extend_from_slice(&s.to_le_bytes());
            }
            _ => {
                let levels = if format == KvFormat::Int4 { 15.0 } else { 3.0 };
                let s = (hi - lo).max(f32::MIN_POSITIVE) / levels;
                for &i in g {
                    codes[i] = ((x[i] - lo) / s).round().clamp(0.0, levels) as u8;
                }
                params.extend_from_slice(&s.to_le_bytes());
                params.extend_from_slice(&lo.to_le_bytes());
            }
        }
    }
    let mut out = match format {
        KvFormat::Int4 => codes
            .chunks(2)
            .map(|p| p[0] | p.get(1).map_or(0, |b| b << 4))
            .collect(),
        KvFormat::Int2 => codes
            .chunks(4)
            .map(|p| {
                p.iter()
                    .enumerate()
                    .fold(0u8, |acc, (k, b)| acc | (b << (2 * k)))
            })
            .collect(),
        _ => codes,
    };
    out.extend(params);
    out
}

/// IEEE half-precision bits of `v` (round to nearest; subnormals flushed to zero).
fn f16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    if exp >= 31 {
        return sign | 0x7c00;
    }
    let mant = b & 0x7f_ffff;
    let half = ((exp as u32) << 10) | (mant >> 13);
    let round = (mant >> 12) & 1;
    sign | (half + round).min(0x7bff) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_format() {
        let len = |f| kv_chunk(f, 16, 256, 1).len();
        let groups = 128 + 16;
        assert_eq!(len(KvFormat::F16), 16 * 256 * 2);
        assert_eq!(len(KvFormat::Int8), 16 * 256 + groups * 4);
        assert_eq!(len(KvFormat::Int4), 16 * 256 / 2 + groups * 8);
        assert_eq!(len(KvFormat::Int2), 16 * 256 / 4 + groups * 8);
    }

    #[test]
    fn f16_conversion() {
        fn check(v: f32, bits: u16) {
            assert_eq!(f16_bits(v), bits, "{v}");
        }
        check(0.0, 0);
        check(1.0, 0x3c00);
        check(-2.0, 0xc000);
        check(0.5, 0x3800);
        check(65504.0, 0x7bff);
        check(1e9, 0x7c00);
        check(1e-9, 0);
    }
}
