//! Cost models of the Load pipeline: recompute time per chunk and I/O time per byte, as linear fits of measured points.

/// Why a cost model was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CostError {
    #[error("a linear fit needs at least 2 points, got {got}")]
    TooFewPoints { got: usize },
    #[error("point {index} ({x}, {y}) is not finite and non-negative")]
    BadPoint { index: usize, x: f64, y: f64 },
    #[error("every point has x = {x}; measure at two sizes at least")]
    SameX { x: f64 },
    #[error(
        "the fit's slope {slope} is negative: cost falls as work grows, so the measurements are wrong"
    )]
    NegativeSlope { slope: f64 },
    #[error(
        "the fit's intercept {intercept} is negative beyond noise (largest measurement {max_y}); measure smaller sizes"
    )]
    NegativeIntercept { intercept: f64, max_y: f64 },
    #[error("the fit explains too little of the measurements (r^2 = {r_squared}, need {min})")]
    PoorFit { r_squared: f64, min: f64 },
    #[error(
        "cost coefficients must be finite and non-negative (fixed {fixed}, per unit {per_unit})"
    )]
    BadCoefficient { fixed: f64, per_unit: f64 },
}

/// `T(x) = fixed + per_unit * x` seconds for `x > 0` units of work, and nothing for none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearCost {
    fixed: f64,
    per_unit: f64,
}

/// A fitted [`LinearCost`] and how well it fits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    pub cost: LinearCost,
    /// The coefficient of determination (1.0 when the measurements do not vary).
    pub r_squared: f64,
    /// Whether a slightly negative intercept (within noise) was raised to zero.
    pub clamped_intercept: bool,
}

impl LinearCost {
    /// Below this coefficient of determination a fit is refused.
    pub const MIN_R_SQUARED: f64 = 0.5;
    /// A negative intercept down to this share of the largest measurement counts as noise.
    pub const INTERCEPT_NOISE: f64 = 0.1;

    pub fn new(fixed: f64, per_unit: f64) -> Result<Self, CostError> {
        if !(fixed.is_finite() && per_unit.is_finite() && fixed >= 0.0 && per_unit >= 0.0) {
            return Err(CostError::BadCoefficient { fixed, per_unit });
        }
        Ok(Self { fixed, per_unit })
    }

    /// Seconds spent once whatever the amount of work.
    pub fn fixed(&self) -> f64 {
        self.fixed
    }

    /// Seconds per unit of work.
    pub fn per_unit(&self) -> f64 {
        self.per_unit
    }

    /// The time for `units` of work, zero for none.
    pub fn eval(&self, units: f64) -> f64 {
        if units <= 0.0 {
            0.0
        } else {
            self.fixed + self.per_unit * units
        }
    }

    /// The time for `count` items holding `units` of work together: the fixed part is paid once
    /// as soon as there is any item, even an empty one.
    pub fn eval_items(&self, count: usize, units: f64) -> f64 {
        if count == 0 {
            0.0
        } else {
            self.fixed + self.per_unit * units
        }
    }

    /// Least-squares fit of `(work, seconds)` points, checked for sanity: at least two distinct
    /// sizes, a non-negative slope, an intercept not negative beyond noise (raised to zero within
    /// it), and an r^2 of at least [`MIN_R_SQUARED`](Self::MIN_R_SQUARED).
    pub fn fit(points: &[(f64, f64)]) -> Result<Fit, CostError> {
        if points.len() < 2 {
            return Err(CostError::TooFewPoints { got: points.len() });
        }
        if let Some((index, &(x, y))) = points
            .iter()
            .enumerate()
            .find(|(_, (x, y))| !(x.is_finite() && y.is_finite() && *x >= 0.0 && *y >= 0.0))
        {
            return Err(CostError::BadPoint { index, x, y });
        }
        let n = points.len() as f64;
        let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let syy: f64 = points.iter().map(|p| (p.1 - my) * (p.1 - my)).sum();
        if sxx <= f64::EPSILON * mx * mx * n || sxx == 0.0 {
            return Err(CostError::SameX { x: points[0].0 });
        }
        let slope = sxy / sxx;
        let intercept = my - slope * mx;
        let max_x = points.iter().map(|p| p.0).fold(0.0, f64::max);
        let max_y = points.iter().map(|p| p.1).fold(0.0, f64::max);
        // A slope negative only by rounding is zero.
        if slope * max_x < -1e-9 * max_y {
            return Err(CostError::NegativeSlope { slope });
        }
        let slope = slope.max(0.0);
        let clamped_intercept = intercept < 0.0;
        if intercept < -Self::INTERCEPT_NOISE * max_y {
            return Err(CostError::NegativeIntercept { intercept, max_y });
        }
        let r_squared = if syy <= 0.0 {
            1.0
        } else {
            let ss_res: f64 = points
                .iter()
                .map(|p| {
                    let e = p.1 - (intercept + slope * p.0);
                    e * e
                })
                .sum();
            1.0 - ss_res / syy
        };
        if r_squared < Self::MIN_R_SQUARED {
            return Err(CostError::PoorFit {
                r_squared,
                min: Self::MIN_R_SQUARED,
            });
        }
        Ok(Fit {
            cost: Self::new(intercept.max(0.0), slope)?,
            r_squared,
            clamped_intercept,
        })
    }
}

/// The profiled costs the planner works from (paper §3.3 "Profiling").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Recompute: seconds for a batch of `x` chunks (one forward pass over them, all layers).
    pub recompute: LinearCost,
    /// I/O: seconds to read `m` bytes of chunks from the store, in one stream.
    pub io: LinearCost,
    /// In how many pieces (groups of layers) a chunk can be read, so that recompute at the first
    /// layers can start before the last layers are read: 1 when a chunk file is read whole
    /// (0 counts as 1).
    pub read_groups: u32,
}

impl CostModel {
    /// A model whose chunks are read whole.
    pub fn new(recompute: LinearCost, io: LinearCost) -> Self {
        Self {
            recompute,
            io,
            read_groups: 1,
        }
    }

    /// When a recompute pass over `recompute` chunks ends, if it needs `blocking` chunks of
    /// `blocking_bytes` read first and the read stream starts with them.
    ///
    /// With `G` read groups the blocking reads go group by group (all chunks' first layers, then
    /// the next ones) and the pass at group `g` waits for group `g`; the pass ends at
    /// `T_IO fixed + max over g of ((g+1) * io_B / G + (G-g) * T_re / G)`, whose maximum is at
    /// `g = 0` or `g = G - 1`.
    pub fn recompute_end(&self, recompute: usize, blocking: usize, blocking_bytes: f64) -> f64 {
        let re = self.recompute.eval(recompute as f64);
        if recompute == 0 {
            return 0.0;
        }
        if blocking == 0 {
            return re;
        }
        let g = f64::from(self.read_groups.max(1));
        let io = self.io.per_unit() * blocking_bytes;
        self.io.fixed() + (io / g + re).max(io + re / g)
    }

    /// When the blocking reads' first group is in memory (the pass can start).
    pub fn recompute_start(&self, blocking: usize, blocking_bytes: f64) -> f64 {
        if blocking == 0 {
            return 0.0;
        }
        let g = f64::from(self.read_groups.max(1));
        self.io.fixed() + self.io.per_unit() * blocking_bytes / g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(points: &[(f64, f64)], expected: Result<(f64, f64), CostError>) {
        let got = LinearCost::fit(points).map(|f| (f.cost.fixed(), f.cost.per_unit()));
        match (&got, &expected) {
            (Ok((a, b)), Ok((c, d))) => {
                assert!((a - c).abs() < 1e-9 && (b - d).abs() < 1e-9, "{got:?}")
            }
            _ => assert_eq!(got, expected),
        }
    }

    #[test]
    fn fits() {
        check(&[(1.0, 3.0), (2.0, 5.0), (3.0, 7.0)], Ok((1.0, 2.0)));
        check(&[(0.0, 0.5), (10.0, 0.5)], Ok((0.5, 0.0)));
        // A small negative intercept is noise and becomes zero.
        check(&[(1.0, 0.95), (2.0, 1.95), (3.0, 2.95)], Ok((0.0, 1.0)));
    }

    #[test]
    fn refusals() {
        check(&[(1.0, 1.0)], Err(CostError::TooFewPoints { got: 1 }));
        check(&[(2.0, 1.0), (2.0, 3.0)], Err(CostError::SameX { x: 2.0 }));
        check(
            &[(1.0, 1.0), (f64::INFINITY, 1.0)],
            Err(CostError::BadPoint {
                index: 1,
                x: f64::INFINITY,
                y: 1.0,
            }),
        );
        assert!(matches!(
            LinearCost::fit(&[(1.0, 3.0), (2.0, 2.0)]),
            Err(CostError::NegativeSlope { .. })
        ));
        assert!(matches!(
            LinearCost::fit(&[(10.0, 1.0), (20.0, 11.0)]),
            Err(CostError::NegativeIntercept { .. })
        ));
        assert!(matches!(
            LinearCost::fit(&[(1.0, 1.0), (2.0, 9.0), (3.0, 1.0), (4.0, 9.0), (5.0, 1.0)]),
            Err(CostError::PoorFit { .. })
        ));
        assert!(matches!(
            LinearCost::new(-1.0, 0.0),
            Err(CostError::BadCoefficient { .. })
        ));
    }

    /// Steps through the layer groups one by one, as the engine would run them.
    fn simulate(m: &CostModel, recompute: usize, blocking_bytes: f64) -> f64 {
        let g = m.read_groups.max(1);
        let step = m.recompute.eval(recompute as f64) / f64::from(g);
        let mut end = 0.0f64;
        for group in 0..g {
            let ready = m.io.fixed()
                + m.io.per_unit() * blocking_bytes * f64::from(group + 1) / f64::from(g);
            end = end.max(ready) + step;
        }
        end
    }

    proptest::proptest! {
        #[test]
        fn recompute_end_matches_simulation(
            groups in 1u32..40,
            io_fixed in 0.0f64..10.0,
            per_byte in 0.0f64..3.0,
            re_fixed in 0.0f64..10.0,
            per_chunk in 0.0f64..50.0,
            recompute in 1usize..50,
            bytes in 1.0f64..100.0,
        ) {
            let m = CostModel {
                recompute: LinearCost::new(re_fixed, per_chunk).unwrap(),
                io: LinearCost::new(io_fixed, per_byte).unwrap(),
                read_groups: groups,
            };
            let closed = m.recompute_end(recompute, 1, bytes);
            let stepped = simulate(&m, recompute, bytes);
            proptest::prop_assert!((closed - stepped).abs() <= 1e-9 * stepped.max(1.0));
        }
    }

    #[test]
    fn eval() {
        let c = LinearCost::new(1.0, 2.0).unwrap();
        assert_eq!(c.eval(0.0), 0.0);
        assert_eq!(c.eval(3.0), 7.0);
        assert_eq!(c.eval_items(0, 5.0), 0.0);
        assert_eq!(c.eval_items(1, 0.0), 1.0);
    }
}
