//! The trace generator's random numbers: ChaCha8 from a seed, through samplers written here, so a
//! trace depends only on its seed and parameters, not on the `rand` crate's version.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seeded stream of random numbers; ChaCha8's output is fixed by its specification.
pub struct TraceRng(ChaCha8Rng);

impl TraceRng {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> TraceRng {
        TraceRng(ChaCha8Rng::seed_from_u64(seed))
    }

    /// A uniform number in [0, 1), with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.0.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `0..n` (`n` ≥ 1), without modulo bias (rejection).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        // The largest multiple of n that fits: draws at or past it are rejected.
        let zone = u64::MAX - (u64::MAX % n + 1) % n;
        loop {
            let x = self.0.next_u64();
            if x <= zone {
                return x % n;
            }
        }
    }

    /// A uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + self.below(u64::from(hi - lo) + 1) as u32
    }

    /// An exponential variate of rate `rate` (mean 1/rate): a Poisson process's inter-arrival
    /// time.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        // 1 - unit() is in (0, 1], so the logarithm is finite.
        -(1.0 - self.unit()).ln() / rate
    }

    /// An index drawn from a cumulative distribution (`cdf` non-decreasing, last entry the
    /// total weight).
    pub fn pick_cdf(&mut self, cdf: &[f64]) -> usize {
        let total = cdf[cdf.len() - 1];
        let x = self.unit() * total;
        cdf.partition_point(|&c| c <= x).min(cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_is_uniform_and_in_range() {
        let mut r = TraceRng::new(7);
        let mut counts = [0u32; 6];
        let n = 60_000;
        for _ in 0..n {
            counts[r.below(6) as usize] += 1;
        }
        // Each count is binomial(n, 1/6): sd ≈ 91; allow 5 sd.
        for c in counts {
            assert!((f64::from(c) - 10_000.0).abs() < 460.0, "{counts:?}");
        }
        for _ in 0..1000 {
            let x = r.range(10, 12);
            assert!((10..=12).contains(&x));
        }
        assert_eq!(r.range(5, 5), 5);
    }

    #[test]
    fn the_same_seed_gives_the_same_stream() {
        let a: Vec<u64> = {
            let mut r = TraceRng::new(42);
            (0..100).map(|_| r.below(1000)).collect()
        };
        let b: Vec<u64> = {
            let mut r = TraceRng::new(42);
            (0..100).map(|_| r.below(1000)).collect()
        };
        let c: Vec<u64> = {
            let mut r = TraceRng::new(43);
            (0..100).map(|_| r.below(1000)).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn exponential_gaps_have_the_poisson_mean_and_variance() {
        let mut r = TraceRng::new(1);
        let rate = 0.25;
        let n = 200_000;
        let gaps: Vec<f64> = (0..n).map(|_| r.exponential(rate)).collect();
        assert!(gaps.iter().all(|g| g.is_finite() && *g >= 0.0));
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        // Exponential(rate): mean 4, variance 16; the mean's sd is 4/sqrt(n) ≈ 0.009.
        assert!((mean - 4.0).abs() < 0.05, "mean {mean}");
        assert!((var - 16.0).abs() < 0.5, "variance {var}");
        // Arrivals per unit of time are Poisson: counts in windows of 8 s have mean = variance = 2.
        let mut t = 0.0;
        let mut counts = vec![0u32; (gaps.iter().sum::<f64>() / 8.0) as usize + 1];
        for g in &gaps {
            t += g;
            counts[(t / 8.0) as usize] += 1;
        }
        counts.pop(); // the last window is cut short
        let m = counts.iter().map(|&c| f64::from(c)).sum::<f64>() / counts.len() as f64;
        let v = counts
            .iter()
            .map(|&c| (f64::from(c) - m).powi(2))
            .sum::<f64>()
            / (counts.len() - 1) as f64;
        assert!((m - 2.0).abs() < 0.05, "window mean {m}");
        assert!((v - 2.0).abs() < 0.1, "window variance {v}");
    }

    #[test]
    fn pick_cdf_follows_the_weights() {
        let mut r = TraceRng::new(3);
        let cdf = [1.0, 1.0, 4.0]; // weights 1, 0, 3
        let mut counts = [0u32; 3];
        for _ in 0..40_000 {
            counts[r.pick_cdf(&cdf)] += 1;
        }
        assert_eq!(counts[1], 0);
        // counts[0] is binomial(40000, 1/4): sd ≈ 87.
        assert!(
            (f64::from(counts[0]) - 10_000.0).abs() < 450.0,
            "{counts:?}"
        );
    }
}
