//! Rotary position embedding (RoPE): the angles of a pass's positions, and the rotation of a
//! row's heads by them, in the pairing each family uses.

use crate::config::RopeStyle;

/// Rotary position embedding: each pair of a head's first `rope_dim` dimensions turned by
/// `pos · θᵢ`. The angles are taken for the positions of a pass ([`Rope::angles`]), not held
/// for every position the model could reach (at Gemma 3's 32k positions and 256-wide heads a
/// table would be 33 MB per base).
#[derive(Debug, Clone)]
pub struct Rope {
    style: RopeStyle,
    /// θᵢ per pair, in f64 so angles at 32k positions keep their precision.
    theta: Vec<f64>,
}

/// The cosines and sines of a pass's positions: `[n][rope_dim / 2]` each.
#[derive(Debug, Clone, Default)]
pub struct RopeAngles {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// RoPE over `rope_dim` dimensions with frequency base `base`, positions scaled by
    /// `freq_scale` (linear scaling; 1 for none), and pair `i`'s frequency divided by
    /// `freq_factors[i]` when given (Llama 3's `rope_freqs`).
    pub fn new(
        rope_dim: usize,
        base: f32,
        style: RopeStyle,
        freq_scale: f32,
        freq_factors: Option<&[f32]>,
    ) -> Self {
        let half = rope_dim / 2;
        let theta = (0..half)
            .map(|i| {
                let f =
                    f64::from(freq_scale) / f64::from(base).powf((2 * i) as f64 / rope_dim as f64);
                f / freq_factors.map_or(1.0, |ff| f64::from(ff[i]))
            })
            .collect();
        Self { style, theta }
    }

    /// Dimensions rotated.
    pub fn dim(&self) -> usize {
        self.theta.len() * 2
    }

    /// The angles of `positions`.
    pub fn angles(&self, positions: &[usize]) -> RopeAngles {
        let half = self.theta.len();
        let mut a = RopeAngles {
            half,
            cos: Vec::with_capacity(positions.len() * half),
            sin: Vec::with_capacity(positions.len() * half),
        };
        for &p in positions {
            for t in &self.theta {
                let (s, c) = (p as f64 * t).sin_cos();
                a.cos.push(c as f32);
                a.sin.push(s as f32);
            }
        }
        a
    }

    /// Rotates every head (of `head_dim`) of one token's row by row `i` of `angles`, in place.
    /// The dimensions past `rope_dim` pass through.
    pub fn apply(&self, row: &mut [f32], head_dim: usize, angles: &RopeAngles, i: usize) {
        let half = angles.half;
        let c = &angles.cos[i * half..(i + 1) * half];
        let s = &angles.sin[i * half..(i + 1) * half];
        for head in row.chunks_exact_mut(head_dim) {
            match self.style {
                RopeStyle::Adjacent => {
                    for i in 0..half {
                        let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = x0 * c[i] - x1 * s[i];
                        head[2 * i + 1] = x0 * s[i] + x1 * c[i];
                    }
                }
                RopeStyle::Halves => {
                    let (a, b) = head.split_at_mut(half);
                    for i in 0..half {
                        let (x0, x1) = (a[i], b[i]);
                        a[i] = x0 * c[i] - x1 * s[i];
                        b[i] = x0 * s[i] + x1 * c[i];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        for style in [RopeStyle::Adjacent, RopeStyle::Halves] {
            let rope = Rope::new(8, 10_000.0, style, 1.0, None);
            let orig: Vec<f32> = (0..16).map(|i| i as f32 - 3.0).collect();
            let mut row = orig.clone();
            let a = rope.angles(&[0, 11]);
            rope.apply(&mut row, 8, &a, 0);
            assert_eq!(row, orig);
            rope.apply(&mut row, 8, &a, 1);
            let n0: f32 = orig.iter().map(|v| v * v).sum();
            let n1: f32 = row.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-3);
        }
    }

    /// The two styles pair different dimensions: the first pair's first member turns with its
    /// neighbour (adjacent) or with the member half a head away (halves), and the slowest pair
    /// of a scaled frequency turns by its scaled angle.
    #[test]
    fn rope_styles_pair_the_dimensions_their_families_pair() {
        let x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let p = 3usize;
        for (style, partner) in [(RopeStyle::Adjacent, 1), (RopeStyle::Halves, 4)] {
            let rope = Rope::new(8, 100.0, style, 1.0, None);
            let mut row = x.clone();
            rope.apply(&mut row, 8, &rope.angles(&[p]), 0);
            let (s, c) = (p as f32).sin_cos();
            assert!(
                (row[0] - (x[0] * c - x[partner] * s)).abs() < 1e-5,
                "{style:?}"
            );
            assert!(
                (row[partner] - (x[0] * s + x[partner] * c)).abs() < 1e-5,
                "{style:?}"
            );
        }
        // Pair 3 of base 100 over 8 dims turns by θ = 100^(-6/8) a position; a scale of 0.5
        // and a factor of 4 make it θ / 8.
        let theta = 100f64.powf(-0.75);
        let scaled = Rope::new(
            8,
            100.0,
            RopeStyle::Adjacent,
            0.5,
            Some(&[1.0, 1.0, 1.0, 4.0]),
        );
        let a = scaled.angles(&[5]);
        assert!((f64::from(a.sin[3]) - (5.0 * theta / 8.0).sin()).abs() < 1e-6);
        assert!((f64::from(a.sin[2]) - (5.0 * 100f64.powf(-0.5) / 2.0).sin()).abs() < 1e-6);
    }
}
